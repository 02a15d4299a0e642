"""Issue 39's Hugging Face defects, each on the input that showed it: a sliding window a model type
does not compute refused by name (not as an unread model type; Mistral's own window is read since), ``rope_scaling {"rope_type": "default"}`` read as the null it equals,
tensors a config does not declare refused instead of dropped, a checkpoint's own head_dim trained
from, and a run's FLOPs counted at its own sequence, not the checkpoint's positions.

The transformers side of the same cases (their logits equal meshkit's) is in test_hf_reference.py
(``hf-llama-head-dim``, ``hf-llama-rope-default``, ``hf-mistral-window``)."""

import json

import jax
import numpy as np
import pytest

from meshkit import interop
from meshkit.data import load
from meshkit.interop.hf import InteropError, config_from_hf
from meshkit.models import llama
from meshkit.train import config as C

LLAMA = {"model_type": "llama", "vocab_size": 64, "hidden_size": 32, "intermediate_size": 64,
         "num_hidden_layers": 1, "num_attention_heads": 4, "num_key_value_heads": 2,
         "max_position_embeddings": 64}  # fmt: skip


@pytest.mark.parametrize(
    ("extra", "says"),
    [
        (
            {"model_type": "mistral", "sliding_window": 16, "use_sliding_window": False},
            "use_sliding_window=False",
        ),
        ({"sliding_window": 32}, "sliding_window=32 in a LlamaForCausalLM config"),
        ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0}}, "rope_scaling="),
        ({"rope_scaling": {"rope_type": "default", "factor": 2.0}}, "rope_scaling="),
    ],
)
def test_a_field_meshkit_does_not_compute_is_refused_by_its_name(extra, says):
    with pytest.raises(InteropError) as e:
        config_from_hf({**LLAMA, **extra})
    assert says in str(e.value) and "not one meshkit reads" not in str(e.value), str(e.value)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize(
    "extra",
    [
        {"rope_scaling": {"rope_type": "default"}},
        {"rope_scaling": {"type": "default"}},
        {"model_type": "mistral", "sliding_window": None},
        {"model_type": "mistral", "sliding_window": 64},  # as long as the positions: it never binds
        {"sliding_window": None},
    ],
)
def test_fields_equal_to_what_meshkit_computes_are_read(extra):
    assert config_from_hf({**LLAMA, **extra}) == config_from_hf(LLAMA)


def _checkpoint(where, cfg, extra_tensors=None):
    params = llama.init(jax.random.key(0), cfg)
    interop.save(params, cfg, where)
    if extra_tensors:
        from safetensors.numpy import load_file, save_file

        path = where / "model.safetensors"
        save_file({**load_file(str(path)), **extra_tensors}, str(path))
    return params


def test_tensors_the_config_does_not_declare_are_refused_not_dropped(tmp_path):
    cfg = llama.LlamaConfig(vocab_size=64, seq_len=16, layers=1, width=32, heads=4, kv_heads=2, ffn=64)
    bias = {"model.layers.0.self_attn.q_proj.bias": np.ones(32, np.float32)}  # a Qwen2-style bias
    _checkpoint(tmp_path / "bias", cfg, bias)
    with pytest.raises(
        InteropError, match=r"holds 1 tensor\(s\) its config.json does not declare \(model.layers.0"
    ):
        interop.load(tmp_path / "bias")
    # buffers that are no weights (a rotary frequency table) are skipped, as transformers skips them
    table = {"model.layers.0.self_attn.rotary_emb.inv_freq": np.ones(4, np.float32)}
    want = _checkpoint(tmp_path / "buffer", cfg, table)
    got, _ = interop.load(tmp_path / "buffer")
    assert all(
        np.array_equal(a, np.asarray(b))
        for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True)
    )


def _init_from_cfg(tmp_path, model, **options):
    data = load(C.tiny().data.data)
    params = llama.init(jax.random.key(1), model)
    interop.save(params, model, tmp_path / "ckpt", vocab=data.chars)
    cfg = C.tiny().replace(model="llama", layers=model.layers, width=model.width, heads=model.heads,
                           kv_heads=model.kv_heads, plan="dp", init_from=f"hf:{tmp_path / 'ckpt'}",
                           run_dir=str(tmp_path / "run"), **options)  # fmt: skip
    return cfg, params


def test_init_from_a_checkpoint_whose_head_dim_is_not_width_over_heads(tmp_path):
    """6 heads of 8 at width 20: the run starts from the checkpoint's weights (before, --heads 6 had to
    divide --width 20, and the run was refused although the load and forward are exact)."""
    from meshkit.train.job import prepare

    vocab = len(load(C.tiny().data.data).chars)
    model = llama.LlamaConfig(vocab_size=vocab, seq_len=64, layers=1, width=20, heads=6, kv_heads=2,
                              head_dim=8, ffn=32)  # fmt: skip
    cfg, params = _init_from_cfg(tmp_path, model)
    C.validate(cfg)  # --heads 6 does not divide --width 20: the checkpoint's head_dim decides
    job = prepare(cfg)
    assert job.model.head_dim == 8 and job.trainer.params["blocks"][0]["attn"]["wq"].shape == (20, 48)
    got = jax.tree.leaves(job.trainer.params)
    assert all(
        np.array_equal(np.asarray(a), np.asarray(b))
        for a, b in zip(got, jax.tree.leaves(params), strict=True)
    )
    with pytest.raises(C.ConfigError, match="--heads 6 must divide --width 20"):
        C.validate(cfg.replace(init_from=None))


def test_the_runs_flops_count_its_own_sequence_not_the_checkpoints_positions(tmp_path):
    from meshkit.train.job import prepare
    from meshkit.train.results import results

    vocab = len(load(C.tiny().data.data).chars)
    model = llama.LlamaConfig(vocab_size=vocab, seq_len=8192, layers=1, width=32, heads=4, kv_heads=2, ffn=64)
    cfg, _ = _init_from_cfg(tmp_path, model, seq_len=32)
    job = prepare(cfg)
    report = results(job)
    assert report["model_flops_per_token"] == llama.flops_per_token(job.model, 32)
    assert report["model_flops_per_token"] < llama.flops_per_token(job.model)  # 8192 positions' count
    assert json.loads(json.dumps(report["model_flops_per_token"])) > 6 * llama.matmul_params(job.model)
