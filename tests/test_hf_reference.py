"""Hugging Face checkpoints against an implementation meshkit did not write: ``transformers`` 4.57.6
and 5.x with torch on CPU, each in its own Python 3.11 environment (``make reference``:
scripts/reference_env.sh); every test here runs against both (conftest's ``reference_python``).

One reference process (about 7 s of CPU, most of it importing torch) loads what meshkit exported
and makes checkpoints of its own (sharded, with an index, as the Hub writes them); meshkit loads
those, under a sharded layout too. Logits agree within 1e-5 (float32) both ways; round trips are
bitwise. ``make test`` runs this group apart (``-m reference``)."""

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from _limits import limit
from meshkit import interop
from meshkit.data import load as load_data
from meshkit.interop.hf import Checkpoint
from meshkit.models import gpt, llama
from meshkit.train.outputs import export_run, load_run

# Tiers: sweeps, every case (its reference process, 17-19 s of a core run, makes every case's files): the
# transformers reference is core in test_hf_families.py's Llama 3 cases (a checkpoint 5.x made, read into
# meshkit sharded in the scanned form, its logits and greedy tokens 5.x's; meshkit's export read by 5.x),
# AutoTokenizer on a meshkit export (its template and padding token) in test_chat_template.py's
# test_ids_equal_transformers_apply_chat_template[transformers5]; meshkit's side of these cases is core:
# the GPT-2 and Llama formats written and read back in test_registry.py's
# test_each_hugging_face_format_reads_back_what_it_writes, a trained run's export in test_llama_cli.py, a
# bf16 export read back bf16 in test_interop.py, special tokens where transformers reads them in
# test_export_special.py, issue 39's configs (head_dim, the default rotary written out, a window that never
# binds) in test_hf_config_defects.py.
pytestmark = [pytest.mark.reference, pytest.mark.sweep]
SCRIPT = Path(__file__).parent / "reference" / "hf_reference.py"
TOL = 1e-5

MESHKIT_MODELS = {
    "llama-gqa": llama.LlamaConfig(vocab_size=64, seq_len=16, layers=2, width=32, heads=4, kv_heads=2, ffn=64,
                                   rope_theta=500000.0),
    "llama-tied": llama.LlamaConfig(vocab_size=64, seq_len=16, layers=2, width=32, heads=4, kv_heads=1, ffn=48,
                                    tie_embeddings=True),
    "gpt": gpt.GPTConfig(vocab_size=64, seq_len=16, layers=2, width=32, heads=4),
}  # fmt: skip
REFERENCE_MODELS = {
    "hf-llama-gqa": {"model_type": "llama", "vocab_size": 64, "hidden_size": 32, "intermediate_size": 64,
                     "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
                     "max_position_embeddings": 16, "tie_word_embeddings": False},
    "hf-llama-tied": {"model_type": "llama", "vocab_size": 64, "hidden_size": 32, "intermediate_size": 48,
                      "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 1,
                      "max_position_embeddings": 16, "tie_word_embeddings": True, "rms_norm_eps": 1e-5},
    "hf-gpt2": {"model_type": "gpt2", "vocab_size": 64, "n_embd": 32, "n_layer": 2, "n_head": 4, "n_positions": 16},
    # issue 39: heads whose width is not hidden/heads (8, not 36/6; transformers 5.x refuses a hidden size
    # its heads do not divide), the default rotary written out, a Mistral whose window is as long as its
    # positions (so it never binds)
    "hf-llama-head-dim": {"model_type": "llama", "vocab_size": 64, "hidden_size": 36, "intermediate_size": 48,
                          "num_hidden_layers": 2, "num_attention_heads": 6, "num_key_value_heads": 2,
                          "head_dim": 8, "max_position_embeddings": 16},
    "hf-llama-rope-default": {"model_type": "llama", "vocab_size": 64, "hidden_size": 32, "intermediate_size": 48,
                              "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
                              "max_position_embeddings": 16, "rope_theta": 500000.0,
                              "rope_scaling": {"rope_type": "default"}},
    "hf-mistral-window": {"model_type": "mistral", "vocab_size": 64, "hidden_size": 32, "intermediate_size": 48,
                          "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
                          "max_position_embeddings": 16, "sliding_window": 16},
}  # fmt: skip


def _module(cfg):
    return llama if isinstance(cfg, llama.LlamaConfig) else gpt


def _perturbed(cfg, seed):
    """Initial parameters with every leaf moved (norm scales off 1, biases off 0)."""
    params = _module(cfg).init(jax.random.key(seed), cfg)
    keys = iter(jax.random.split(jax.random.key(seed + 100), len(jax.tree.leaves(params))))
    return jax.tree.map(lambda a: a + 0.02 * jax.random.normal(next(keys), a.shape, a.dtype), params)


@pytest.fixture(scope="module")
def reference(tmp_path_factory, reference_python):
    """Export meshkit's models, let transformers load them and make its own, in one process."""
    tmp = tmp_path_factory.mktemp("hf")
    tokens = np.random.default_rng(0).integers(0, 64, size=(3, 16)).astype(np.int32)
    np.save(tmp / "tokens.npy", tokens)
    ours = {}
    jobs = []
    for i, (name, cfg) in enumerate(MESHKIT_MODELS.items()):
        params = _perturbed(cfg, i)
        interop.save(params, cfg, tmp / name, max_shard_bytes=20_000)
        ours[name] = (params, cfg)
        jobs.append(
            {"dir": str(tmp / name), "tokens": str(tmp / "tokens.npy"), "out": str(tmp / f"{name}.npy")}
        )
    bf16 = dataclasses.replace(MESHKIT_MODELS["llama-gqa"], dtype="bfloat16")
    interop.save(_perturbed(bf16, 9), bf16, tmp / "llama-bf16", max_shard_bytes=20_000)
    ours["llama-bf16"] = (_perturbed(bf16, 9), bf16)
    jobs.append({"dir": str(tmp / "llama-bf16"), "tokens": str(tmp / "tokens.npy"), "out": str(tmp / "llama-bf16.npy"),
                 "auto_dtype": True})  # fmt: skip
    run = _trained_run(tmp / "run")  # a meshkit train run, exported from its run directory
    export_run(run, tmp / "run-hf")
    jobs.append(
        {"dir": str(tmp / "run-hf"), "tokens": str(tmp / "tokens.npy"), "out": str(tmp / "run-hf.npy")}
    )
    bpe_dir, text = _bpe_export(tmp)
    jobs.append(
        {
            "dir": str(bpe_dir),
            "tokens": str(tmp / "bpe-tokens.npy"),
            "out": str(tmp / "bpe.npy"),
            "text": text,
        }
    )
    for name, config in REFERENCE_MODELS.items():
        jobs.append({"make": config, "dir": str(tmp / name), "tokens": str(tmp / "tokens.npy"),
                     "out": str(tmp / f"{name}.npy")})  # fmt: skip
    (tmp / "jobs.json").write_text(json.dumps(jobs))
    # import torch + transformers, 6 tiny models: about 7 s of CPU; 300 s leaves room for a busy machine
    done = subprocess.run([reference_python, str(SCRIPT), str(tmp / "jobs.json")], capture_output=True, text=True,
                          timeout=limit(5), env={**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"})  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    return tmp, tokens, ours


def _bpe_export(tmp):
    """A Llama on a BPE tokenizer of 300 ids, exported with its tokenizer and end-of-text token."""
    from meshkit.data.prepare import prepare as prepare_data
    from meshkit.data.text import default_documents
    from meshkit.data.tokenizer import EOT
    from meshkit.interop.hf import Special

    docs = tmp / "bpe-docs"
    docs.mkdir()
    for i, doc in enumerate(default_documents()[:6]):
        (docs / f"{i}.txt").write_text(doc)
    prepare_data([str(docs)], tmp / "bpe-data", vocab_size=300, shard_tokens=4000)
    bpe = load_data(str(tmp / "bpe-data")).bpe
    cfg = llama.LlamaConfig(
        vocab_size=bpe.vocab_size, seq_len=16, layers=1, width=32, heads=4, kv_heads=2, ffn=48
    )
    interop.save(_perturbed(cfg, 7), cfg, tmp / "bpe-hf", tokenizer_json=bpe.to_str(),
                 special=Special(eos=(EOT, bpe.eot_id)))  # fmt: skip
    text = "def f(x):\n    return x"
    np.save(tmp / "bpe-tokens.npy", bpe.encode(text)[None, :])
    return tmp / "bpe-hf", text


def test_an_export_with_a_tokenizer_loads_in_autotokenizer_with_meshkits_ids_and_its_end(reference):
    """AutoTokenizer on the export encodes as meshkit does (no ``<s>`` prepended as a new id), and
    transformers' generation stops at the tokenizer's end of text (issue 39: eos was transformers'
    default 2 and the tokenizer a LlamaTokenizerFast)."""
    tmp, _, _ = reference
    meta = json.loads((tmp / "bpe.npy.json").read_text())
    bpe = load_data(str(tmp / "bpe-data")).bpe
    assert meta["plain"], meta["class"]  # tokenizer.json as it is, not the model type's own class
    assert meta["ids"] == bpe.encode("def f(x):\n    return x").tolist()
    assert meta["eos"] == meta["model_eos"] == bpe.eot_id and meta["bos"] is None
    cfg = interop.read_config(tmp / "bpe-hf")
    params, _ = interop.load(tmp / "bpe-hf")
    mine = np.asarray(llama.apply(params, np.load(tmp / "bpe-tokens.npy"), cfg))
    assert np.max(np.abs(mine - np.load(tmp / "bpe.npy"))) < TOL


def _trained_run(run_dir):
    """Two steps of a tiny Llama (GQA) under dp, its config and checkpoint in ``run_dir``."""
    import io

    from rich.console import Console

    from meshkit.train import config as C
    from meshkit.train.job import prepare
    from meshkit.train.loop import train

    cfg = C.tiny().replace(model="llama", kv_heads=2, plan="dp", steps=2, eval_every=0, run_dir=str(run_dir))
    job = prepare(cfg)
    assert train(job, Console(file=io.StringIO()))
    (run_dir / "config.json").write_text(C.dumps(cfg))
    return run_dir


def test_exported_run_loads_in_transformers_with_the_same_logits(reference):
    tmp, tokens, _ = reference
    run = load_run(tmp / "run")
    ids = tokens % run.model.vocab_size  # the run's vocabulary is the data's characters
    theirs = np.load(tmp / "run-hf.npy")
    mine = np.asarray(llama.apply(run.params, ids, run.model))
    assert np.max(np.abs(mine[..., : theirs.shape[-1]] - theirs)) < TOL


@pytest.mark.parametrize("name", list(MESHKIT_MODELS))
def test_meshkit_export_loads_in_transformers_with_the_same_logits(reference, name):
    tmp, tokens, ours = reference
    params, cfg = ours[name]
    mine = np.asarray(_module(cfg).apply(params, tokens, cfg))
    theirs = np.load(tmp / f"{name}.npy")
    assert np.max(np.abs(mine - theirs)) < TOL
    again, cfg_again = interop.load(tmp / name)  # and back: bitwise
    assert cfg_again == cfg
    assert all(
        np.array_equal(a, b) for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(again), strict=True)
    )


def test_a_bf16_export_is_bfloat16_in_transformers_with_meshkits_logits(reference):
    """A bfloat16 Llama's export: transformers keeps it bfloat16 (``dtype="auto"`` reads config.json's
    torch_dtype); read in float32, its logits are meshkit's of the same bfloat16 weights in float32."""
    tmp, tokens, ours = reference
    assert json.loads((tmp / "llama-bf16.npy.dtype.json").read_text()) == ["torch.bfloat16"]
    params, cfg = ours["llama-bf16"]
    wide = jax.tree.map(lambda a: a.astype(np.float32), params)
    mine = np.asarray(llama.apply(wide, tokens, dataclasses.replace(cfg, dtype="float32")))
    assert np.max(np.abs(mine - np.load(tmp / "llama-bf16.npy"))) < TOL


@pytest.mark.parametrize("name", list(REFERENCE_MODELS))
def test_transformers_checkpoint_loads_into_meshkit_sharded_with_the_same_logits(reference, name):
    """Loaded straight into fsdp+tp's layout on data=4,model=2 (every leaf split on both axes where
    it can be), the scanned form, then the logits of the loop form on one device."""
    tmp, tokens, _ = reference
    cfg = interop.read_config(tmp / name, scan_layers=True)
    mesh = jax.make_mesh((4, 2), ("data", "model"))
    shapes = jax.eval_shape(lambda: _module(cfg).init(jax.random.key(0), cfg))

    def spec(s):
        dims = [None] * s.ndim
        if s.ndim >= 2 and s.shape[-1] % 2 == 0:
            dims[-1] = "model"
        if s.shape[-2 if s.ndim >= 2 else -1] % 4 == 0:
            dims[-2 if s.ndim >= 2 else -1] = "data"
        return NamedSharding(mesh, P(*dims))

    sharded, _ = interop.load(tmp / name, cfg, shardings=jax.tree.map(spec, shapes))
    whole = jax.tree.leaves(sharded)[0]
    assert len(whole.sharding.device_set) == 8 and not whole.sharding.is_fully_replicated
    loop = gpt.to_form(jax.device_get(sharded), False)
    loop_cfg = dataclasses.replace(cfg, scan_layers=False)
    mine = np.asarray(_module(cfg).apply(loop, tokens, loop_cfg))
    assert np.max(np.abs(mine - np.load(tmp / f"{name}.npy"))) < TOL
    # round trip: meshkit writes back exactly the tensors it read (GPT-2's key bias: zeros, see hf.py)
    interop.save(loop, loop_cfg, tmp / f"{name}-again")
    theirs, again = Checkpoint(tmp / name), Checkpoint(tmp / f"{name}-again")
    assert again.names() <= theirs.names()
    for tensor in again.names():
        a = again.read(_whole(again, tensor), _all(again, tensor))
        b = theirs.read(_whole(theirs, tensor), _all(theirs, tensor))
        if tensor.endswith("c_attn.bias"):
            a, b = np.delete(a, np.s_[32:64]), np.delete(b, np.s_[32:64])
        assert np.array_equal(a, b), tensor


def _whole(ckpt, name):
    from meshkit.interop.hf import Source

    return Source(name)


def _all(ckpt, name):
    return tuple(slice(None) for _ in ckpt.shape(name))


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-m", "reference", "-q"]))
