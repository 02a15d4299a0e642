"""Defects a hostile probe of checkpoints written by transformers 4.57.6 and 5.25.0 found, each on the input
that showed it: weights that are no floats, names that lead out of the checkpoint directory, FIFOs where files
belong, GPT-2 fields nobody checked, windows transformers defaults to 4096, NaN and negative settings, wrong
types, a tied head stored apart, and the bos/eos/pad ids an export drops. Each is one line; all are read
in-process from tiny checkpoints (no training run, no reference process).

transformers' side of the defaults and of the tied head (4.57.6 ties, 5.25.0 reads the stored head) was
measured with .venv-ref and .venv-ref5 when these were written; docs/families.md names them."""

import dataclasses
import json
import os
import threading
from types import SimpleNamespace

import jax
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from meshkit import interop
from meshkit.interop.hf import InteropError, config_from_hf
from meshkit.models import gemma, gpt, llama
from meshkit.train import config as C

TINY = llama.LlamaConfig(vocab_size=32, seq_len=16, layers=1, width=16, heads=2, kv_heads=1, ffn=32)
LLAMA = {"model_type": "llama", "vocab_size": 32, "hidden_size": 16, "intermediate_size": 32,
         "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 1,
         "max_position_embeddings": 8192}  # fmt: skip
GPT2 = {"model_type": "gpt2", "vocab_size": 32, "n_embd": 16, "n_layer": 1, "n_head": 2, "n_positions": 16}
GEMMA2 = {"model_type": "gemma2", "vocab_size": 32, "hidden_size": 16, "intermediate_size": 32,
          "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 8}  # fmt: skip


def _one_line(error) -> str:
    said = str(error.value)
    assert "\n" not in said, said
    return said


def _saved(path, cfg=TINY, **kw):
    module = llama if isinstance(cfg, llama.LlamaConfig) else gpt
    interop.save(module.init(jax.random.key(0), cfg), cfg, path, **kw)
    return path


# -- 5: weights that are no floats ------------------------------------------------------------------
def test_an_integer_weight_is_refused_naming_the_tensor_and_its_file(tmp_path):
    """An I32 tensor holding a float's bytes was cast to float32 value by value and trained (loss 1.9e8)."""
    ckpt = _saved(tmp_path / "ckpt")
    tensors = load_file(str(ckpt / "model.safetensors"))
    name = "model.layers.0.mlp.up_proj.weight"
    tensors[name] = tensors[name].view(np.int32)
    save_file(tensors, str(ckpt / "model.safetensors"))
    with pytest.raises(InteropError) as e:
        interop.load(ckpt)
    said = _one_line(e)
    assert f"model.safetensors': tensor {name} is I32, not a floating-point weight" in said, said


# -- 6: names that lead out of the checkpoint directory ----------------------------------------------
def _sharded(tmp_path):
    ckpt = _saved(tmp_path / "ckpt", max_shard_bytes=2048)
    index = json.loads((ckpt / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 2
    return ckpt, index


@pytest.mark.parametrize("how", ["dotdot", "absolute", "link"])
def test_a_name_that_leads_out_of_the_checkpoint_directory_is_refused(tmp_path, how):
    """An index naming ``../elsewhere/...`` or an absolute path, or a shard that is a link out, trained on
    another directory's files with exit 0."""
    ckpt, index = _sharded(tmp_path)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    name, first = next(iter(index["weight_map"].items()))
    (elsewhere / first).write_bytes((ckpt / first).read_bytes())
    if how == "link":
        (ckpt / first).unlink()
        (ckpt / first).symlink_to(elsewhere / first)
    else:
        index["weight_map"][name] = f"../elsewhere/{first}" if how == "dotdot" else str(elsewhere / first)
        (ckpt / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(InteropError) as e:
        interop.load(ckpt)
    assert f"which leads outside '{ckpt}'" in _one_line(
        e
    ) and "a checkpoint reads only its own files" in _one_line(e)


def test_the_hub_caches_links_into_its_blobs_are_read(tmp_path):
    """A Hub cache snapshot is links into its repository's blobs: that way out is the one allowed."""
    ckpt = _saved(tmp_path / "ckpt")
    repo = tmp_path / "hub" / "models--org--tiny"
    (repo / "blobs").mkdir(parents=True)
    snapshot = repo / "snapshots" / "0123abc"
    snapshot.mkdir(parents=True)
    for i, f in enumerate(sorted(ckpt.iterdir())):
        (repo / "blobs" / f"blob{i}").write_bytes(f.read_bytes())
        (snapshot / f.name).symlink_to(f"../../blobs/blob{i}")
    params, cfg = interop.load(snapshot)
    assert cfg == TINY and jax.tree.leaves(params)[0].shape


@pytest.mark.parametrize("weight_map", [[], {"model.norm.weight": 3}, None])
def test_an_index_of_the_wrong_type_is_one_line(tmp_path, weight_map):
    ckpt, _ = _sharded(tmp_path)
    (ckpt / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    with pytest.raises(InteropError) as e:
        interop.load(ckpt)
    assert "is not a safetensors index" in _one_line(e)


# -- 7: FIFOs where files belong ---------------------------------------------------------------------
def _returns(call, seconds=20):
    """``call()``'s exception, failing (not hanging) where it blocks: a FIFO read waits for a writer."""
    box = {}

    def run():
        try:
            call()
        except Exception as e:
            box["error"] = e

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(seconds)
    return thread.is_alive(), box.get("error")


@pytest.mark.parametrize(
    "name", ["config.json", "model.safetensors.index.json", "generation_config.json", "tokenizer.json"]
)
def test_a_fifo_in_the_checkpoint_is_refused_not_read(tmp_path, name):
    """A FIFO config.json (or generation_config.json: read by an export) hung; a FIFO index or tokenizer.json
    was taken for a missing one. Each is named as a FIFO now."""
    from meshkit.data.tokenizer import train_bpe
    from meshkit.train.init_from import _check_tokenizer

    ckpt = _saved(tmp_path / "ckpt")
    fifo = ckpt / name
    fifo.unlink(missing_ok=True)
    os.mkfifo(fifo)
    call = {
        "config.json": lambda: interop.read_config(ckpt),
        "model.safetensors.index.json": lambda: interop.load(ckpt),
        "generation_config.json": lambda: interop.hf.read_special(ckpt),
        "tokenizer.json": lambda: _check_tokenizer(train_bpe(["a b c"] * 4, 260), ckpt),
    }[name]
    blocked, error = _returns(call)
    if blocked:  # let the blocked reader go before failing
        os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
    assert not blocked, f"reading a FIFO {name} blocked"
    assert error is not None and f"{name}' is a FIFO (named pipe), not a file" in str(error), error


# -- 12: fields read otherwise than transformers -----------------------------------------------------
@pytest.mark.parametrize(
    ("extra", "says"),
    [
        ({"scale_attn_weights": False}, "scale_attn_weights=False is not what meshkit's GPT computes"),
        ({"layer_norm_epsilon": float("nan")}, "layer_norm_epsilon=nan"),
        ({"rotary_dim": 8}, "rotary_dim=8 is not a field meshkit's GPT (gpt2) reads"),
        ({"n_layer": "1"}, "n_layer='1' is not a whole number"),
        ({"tie_word_embeddings": "false"}, "tie_word_embeddings='false' is not true or false"),
    ],
)
def test_a_gpt2_field_that_changes_the_computation_is_refused(extra, says):
    with pytest.raises(InteropError) as e:
        config_from_hf({**GPT2, **extra})
    assert says in _one_line(e)


def test_gpt2s_own_fields_that_change_no_logit_are_read():
    """gpt2's config.json as the Hub has it (dropouts, the double-heads model's summary, n_ctx; distilgpt2's
    _num_labels and gradient_checkpointing)."""
    hub = {**GPT2, "activation_function": "gelu_new", "attn_pdrop": 0.1, "embd_pdrop": 0.1, "resid_pdrop": 0.1,
           "bos_token_id": 50256, "eos_token_id": 50256, "initializer_range": 0.02, "layer_norm_epsilon": 1e-05,
           "n_ctx": 16, "summary_activation": None, "summary_first_dropout": 0.1, "summary_proj_to_labels": True,
           "summary_type": "cls_index", "summary_use_proj": True, "reorder_and_upcast_attn": False,
           "scale_attn_weights": True, "task_specific_params": {"text-generation": {"do_sample": True}},
           "_num_labels": 1, "gradient_checkpointing": False}  # fmt: skip
    assert config_from_hf(hub) == config_from_hf(GPT2)


@pytest.mark.parametrize(
    ("extra", "window", "sliding"),
    [
        ({"model_type": "mistral"}, 4096, None),
        ({"model_type": "mistral", "sliding_window": None}, None, None),
        ({"model_type": "mixtral", "num_local_experts": 2, "num_experts_per_tok": 1}, None, None),
        ({"model_type": "qwen2", "use_sliding_window": True, "max_window_layers": 1}, 4096, (False, True)),
        ({"model_type": "qwen3", "use_sliding_window": True, "max_window_layers": 1}, 4096, (False, True)),
        ({"model_type": "qwen3_moe", "use_sliding_window": True, "num_experts": 2, "num_experts_per_tok": 1,
          "moe_intermediate_size": 8}, 4096, None),
        ({"model_type": "qwen2"}, None, None),
    ],
)  # fmt: skip
def test_an_omitted_sliding_window_is_transformers_default(extra, window, sliding):
    """MistralConfig, Qwen2Config, Qwen3Config and Qwen3MoeConfig default ``sliding_window`` to 4096 (the Qwens'
    where ``use_sliding_window``) in 4.57.6 and 5.25.0 alike, MixtralConfig to None: read as no window,
    the logits differed from position 4096 on."""
    cfg = config_from_hf({**LLAMA, **extra})
    assert (cfg.window, cfg.sliding) == (window, sliding)


# -- 1b: NaN, infinities, signs no model has; wrong types --------------------------------------------
@pytest.mark.parametrize(
    ("data", "says"),
    [
        ({**LLAMA, "rms_norm_eps": float("nan")}, "rms_norm_eps=nan is not a finite number above 0"),
        ({**LLAMA, "rope_theta": -10000}, "rope_theta=-10000 is not a finite number above 0"),
        ({**LLAMA, "rope_parameters": {"rope_type": "default", "rope_theta": float("inf")}}, "rope_parameters.rope_theta=inf"),
        ({**LLAMA, "rope_scaling": {"rope_type": "llama3", "factor": float("inf"), "low_freq_factor": 1.0,
                                    "high_freq_factor": 4.0, "original_max_position_embeddings": 64}}, "factor=inf"),
        ({**LLAMA, "model_type": "mixtral", "num_local_experts": 2, "num_experts_per_tok": 1,
          "router_aux_loss_coef": -1.0}, "router_aux_loss_coef=-1.0 is not a finite number of at least 0"),
        ({**LLAMA, "num_hidden_layers": "2"}, "num_hidden_layers='2' is not a whole number"),
        ({**LLAMA, "vocab_size": 32.5}, "vocab_size=32.5 is not a whole number"),
        ({**LLAMA, "max_position_embeddings": None}, "max_position_embeddings=None is not a whole number"),
        ({**LLAMA, "tie_word_embeddings": "false"}, "tie_word_embeddings='false' is not true or false"),
        ({**LLAMA, "model_type": "qwen2", "layer_types": [{}, {}]}, "layer_types=[{}, {}]"),
        ({**LLAMA, "rope_scaling": {"rope_type": ["llama3"]}}, "names no single rope_type"),
        ({**LLAMA, "model_type": "qwen3_moe", "num_experts": 2, "num_experts_per_tok": 1, "moe_intermediate_size": 8,
          "mlp_only_layers": "01"}, "mlp_only_layers='01' is not a list of layer numbers"),
        ({**GEMMA2, "attn_logit_softcapping": 0}, "attn_logit_softcapping=0 is not a finite number above 0"),
        ({**GEMMA2, "final_logit_softcapping": float("-inf")}, "final_logit_softcapping=-inf"),
        ({**GEMMA2, "query_pre_attn_scalar": float("nan")}, "query_pre_attn_scalar=nan"),
        ({**GEMMA2, "rms_norm_eps": -1e-6}, "rms_norm_eps=-1e-06"),
        ({**GEMMA2, "model_type": "gemma3_text", "rope_local_base_freq": 0}, "rope_local_base_freq=0"),
        ({**GEMMA2, "model_type": "gemma3_text", "sliding_window_pattern": 0}, "sliding_window_pattern=0"),
        ({**GEMMA2, "num_attention_heads": [2]}, "num_attention_heads=[2] is not a whole number"),
        ({**GEMMA2, "rope_scaling": {"rope_type": "linear", "factor": float("nan")}}, "factor=nan"),
    ],
)  # fmt: skip
def test_a_setting_no_model_has_is_refused_by_name(data, says):
    with pytest.raises(InteropError) as e:
        config_from_hf(data)
    assert says in _one_line(e)


def test_gemmas_omitted_key_value_heads_are_transformers_default():
    """GemmaConfig defaults num_key_value_heads to 16, Gemma2Config and Gemma3TextConfig to 4 (null: the heads)."""
    base = {k: v for k, v in GEMMA2.items() if k != "num_key_value_heads"} | {"num_attention_heads": 8}
    assert config_from_hf(base).kv_heads == 4
    assert config_from_hf({**base, "model_type": "gemma", "num_attention_heads": 16}).kv_heads == 16
    assert config_from_hf({**base, "num_key_value_heads": None}).kv_heads == 8


# -- the head: tied in config.json, stored apart -----------------------------------------------------
def test_a_tied_head_stored_apart_must_be_the_embedding(tmp_path):
    """transformers 4.57.6 computes a tied config's embedding as the head, 5.25.0 the stored lm_head.weight:
    where they differ the releases compute two models, refused; an equal copy reads."""
    cfg = dataclasses.replace(TINY, tie_embeddings=True)
    ckpt = _saved(tmp_path / "ckpt", cfg)
    tensors = load_file(str(ckpt / "model.safetensors"))
    embedding = tensors["model.embed_tokens.weight"]
    save_file({**tensors, "lm_head.weight": embedding.copy()}, str(ckpt / "model.safetensors"))
    interop.load(ckpt)  # the same numbers: one model in both releases
    save_file({**tensors, "lm_head.weight": embedding + 1}, str(ckpt / "model.safetensors"))
    with pytest.raises(InteropError) as e:
        interop.load(ckpt)
    assert (
        "ties the head to the embedding but lm_head.weight differs from model.embed_tokens.weight"
        in _one_line(e)
    )


def test_an_untied_gpt2_without_its_head_is_refused(tmp_path):
    """tie_word_embeddings false and no lm_head.weight: transformers makes a random head (both releases), meshkit
    read the embedding."""
    cfg = gpt.GPTConfig(vocab_size=32, seq_len=16, layers=1, width=16, heads=2)
    params = gpt.init(jax.random.key(0), cfg)
    params["unembed"] = params["tok_embed"].T  # written tied: no lm_head.weight
    ckpt = tmp_path / "gpt"
    interop.save(params, cfg, ckpt)
    config = json.loads((ckpt / "config.json").read_text())
    assert config["tie_word_embeddings"] is True
    (ckpt / "config.json").write_text(json.dumps(config | {"tie_word_embeddings": False}))
    with pytest.raises(InteropError) as e:
        interop.load(ckpt)
    assert "tie_word_embeddings=false but the checkpoint has no lm_head.weight" in _one_line(e)


# -- 13: the ids an export carries -------------------------------------------------------------------
def _run(init_from, bpe=None):
    return SimpleNamespace(
        corpus=SimpleNamespace(bpe=bpe, chat=False), cfg=C.tiny().replace(init_from=init_from)
    )


def test_an_export_of_a_run_on_token_ids_carries_its_checkpoints_ids_and_generation_settings(tmp_path):
    """A run on .npy ids from a Llama 3.1-style checkpoint dropped its ids (transformers then stopped at its
    default eos 2); a Gemma's were written null."""
    from meshkit.train.outputs import special_tokens

    source = tmp_path / "llama31"
    source.mkdir()
    (source / "config.json").write_text(json.dumps({"bos_token_id": 128000, "eos_token_id": 128001}))
    generation = {"bos_token_id": 128000, "eos_token_id": [128001, 128008, 128009], "do_sample": True,
                  "temperature": 0.6, "top_p": 0.9, "transformers_version": "4.43.0"}  # fmt: skip
    (source / "generation_config.json").write_text(json.dumps(generation))
    special = special_tokens(_run(f"hf:{source}"))
    assert special.config() == {"bos_token_id": 128000, "eos_token_id": [128001, 128008, 128009]}
    assert special.generation_config() == generation
    cfg = gemma.GemmaConfig(
        vocab_size=32, seq_len=16, layers=1, width=16, heads=2, kv_heads=1, head_dim=8, ffn=32
    )
    out = tmp_path / "gemma"
    interop.save(gemma.init(jax.random.key(0), cfg), cfg, out, special=special)
    written = json.loads((out / "config.json").read_text())
    assert (written["bos_token_id"], written["eos_token_id"]) == (128000, [128001, 128008, 128009])
    assert json.loads((out / "generation_config.json").read_text()) == generation
    (source / "config.json").write_text(json.dumps({"eos_token_id": "2"}))
    (source / "generation_config.json").unlink()
    with pytest.raises(InteropError, match=r"eos_token_id='2' is not a token id or a list of them"):
        special_tokens(_run(f"hf:{source}"))
    with pytest.raises(InteropError, match=r"is gone: its bos/eos/pad ids"):
        special_tokens(_run(f"hf:{tmp_path / 'moved'}"))


# -- one line instead of a traceback, never a half-written export --------------------------------------
def test_a_failed_export_write_names_the_directory_and_leaves_nothing(tmp_path, monkeypatch):
    """A full disk mid-export: one line naming the directory, nothing left behind (a read-only directory is
    the same path: the first mkdir fails)."""
    import errno

    from meshkit.interop import stream

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(stream, "write", full)
    with pytest.raises(interop.hf_save.WriteError) as e:
        _saved(tmp_path / "out" / "ckpt")
    said = _one_line(e)
    assert "cannot write" in said and "No space left on device" in said and "nothing was written" in said
    assert list((tmp_path / "out").iterdir()) == []


def test_meshkit_export_names_the_directorys_free_space_when_it_cannot_write(tmp_path, monkeypatch):
    """As a failed checkpoint save names it (train.lock.free_space); the run is a stand-in (no training)."""
    import errno

    from meshkit.interop import stream
    from meshkit.train import outputs

    run = SimpleNamespace(model=TINY, params=llama.init(jax.random.key(0), TINY), vocab=None,
                          corpus=SimpleNamespace(bpe=None), cfg=C.tiny())  # fmt: skip
    monkeypatch.setattr(outputs, "load_run", lambda run_dir: run)

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(stream, "write", full)
    with pytest.raises(InteropError) as e:
        outputs.export_run(tmp_path / "run", tmp_path / "out")
    said = _one_line(e)
    assert (
        f"cannot write '{tmp_path / 'out'}' (No space left on device);" in said and " free there" in said
    ), said
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("value", ["nan", "inf", "-1"])
def test_export_shard_mb_must_be_a_finite_positive_size(tmp_path, capsys, value):
    from meshkit.cli import main

    assert main(["export", str(tmp_path / "run"), str(tmp_path / "out"), "--shard-mb", value]) == 2
    err = capsys.readouterr().err
    assert "--shard-mb must be a finite number of MiB above 0" in err and err.count("\n") == 1, err
