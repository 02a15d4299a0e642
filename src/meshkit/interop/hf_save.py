"""Hugging Face checkpoints out (``save``): ``config.json``, the weights in safetensors shards with their
index, and what transformers needs beside them (the ids that frame text, the tokenizer, its chat template).

``save`` gathers one tensor at a time to the host and writes it into its safetensors shard
(``meshkit.interop.stream``), so an export's host memory is a small multiple of its largest tensor, never
the model; it writes into a new directory beside the target and renames it into place at the end: a
failure leaves nothing behind, and is one line naming the directory and its free space. A parameter the
family's format has no name for (a GPT's mixture of experts) is refused before anything is written.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import jax
import numpy as np

from meshkit._errors import gist
from meshkit.files import free_space
from meshkit.interop import stream
from meshkit.interop.hf import TOKENIZER, VOCAB, ModelConfig, _format, _named, config_to_hf
from meshkit.interop.special import CHAT_TEMPLATE, CONFIG, GENERATION, Special
from meshkit.models import gpt
from meshkit.models.family import InteropError


def _host(x: Any) -> np.ndarray:
    """One parameter gathered to this host, shard by shard into one new array. Not ``np.asarray(x)``:
    that keeps the host copy on the array it reads (the parameters would keep every tensor's), and a
    copy made through a new ``jax.Array`` over the same buffers was freed only at the next garbage
    collection (measured: the copies of a whole model's layers held at once)."""
    if not isinstance(x, jax.Array) or not x.is_fully_addressable:
        return np.asarray(jax.device_get(x))  # another process's blocks: jax's own error says so
    out = np.empty(x.shape, x.dtype)
    for shard in x.addressable_shards:
        if shard.replica_id == 0:  # each block once (a replicated array: one device's)
            data = shard.data
            one = jax.make_array_from_single_device_arrays(data.shape, data.sharding, [data])
            out[shard.index] = np.asarray(one)  # read through a new array: any copy cached goes with it
            del one
    return out


def _tensors(params: Any, cfg: ModelConfig) -> tuple[list[stream.Tensor], bool]:
    """The checkpoint's tensors from meshkit parameters, each read (gathered to the host, transposed,
    its fused columns filled) only when it is written."""
    params = gpt.to_form(params, False)
    hf = _format(cfg)
    tied = hf.tied(params)
    names = dict(hf.names(cfg, None, tied))
    out: list[stream.Tensor] = []
    fused: dict[str, list] = {}
    for keys, source, layer, leaf in _named(cfg, params, names):
        if tied and keys == ("unembed",):
            continue
        name, shape = source.name.format(i=layer, j=None), tuple(leaf.shape)
        if source.columns is not None:
            fused.setdefault(name, []).append((source.columns, leaf, source.transpose, source.step))
            continue
        for j in range(shape[0]) if source.experts else [None]:  # an expert's tensor: its row of the leaf
            one = (lambda x=leaf: x) if j is None else (lambda x=leaf, j=j: x[j])
            read = (lambda one=one: _host(one()).T) if source.transpose else (lambda one=one: _host(one()))
            size = shape if j is None else shape[1:]
            out.append(
                stream.Tensor(
                    name=source.name.format(i=layer, j=j),
                    dtype=np.dtype(leaf.dtype),
                    read=read,
                    shape=size[::-1] if source.transpose else size,
                )
            )
    for name, parts in fused.items():  # columns no leaf fills are zeros (GPT-2's key bias: the GPT has none)
        first, transpose = parts[0][1], parts[0][2]  # Phi-3's qkv_proj, gate_up_proj: torch's (out, in)
        shape = (*first.shape[:-1], max(hi for (_, hi), *_ in parts))

        def read(parts=parts, shape=shape, dtype=first.dtype, transpose=transpose) -> np.ndarray:
            whole = np.zeros(shape, dtype)
            for (lo, hi), leaf, _, step in parts:  # GPT-OSS's gate_up_proj: interleaved (step 2)
                whole[..., lo:hi:step] = _host(leaf)
            return np.ascontiguousarray(whole.T) if transpose else whole

        stored = shape[::-1] if transpose else shape
        out.append(stream.Tensor(name=name, shape=stored, dtype=np.dtype(first.dtype), read=read))
    return out, tied


def _dtype(tensors: list[stream.Tensor]) -> str | None:
    """The floating dtype the tensors are written in (config.json's ``torch_dtype``), if one."""
    kinds = {
        str(t.dtype) for t in tensors if np.issubdtype(t.dtype, np.floating) or t.dtype.name == "bfloat16"
    }
    return kinds.pop() if len(kinds) == 1 else None


class WriteError(InteropError):
    """A checkpoint could not be written (a full disk, a read-only directory): nothing of it is left. The
    line names the directory and its disk's free space, as a failed checkpoint save does."""

    def __init__(self, target: Path, reason: str) -> None:
        self.target, self.reason = Path(target), reason
        super().__init__(
            f"cannot write '{target}' ({reason}); {free_space(self.target.parent)} there: free space, fix "
            "permissions or give another directory; nothing was written"
        )


def save(
    params: Any,
    cfg: ModelConfig,
    directory: str | Path,
    *,
    max_shard_bytes: int = 2 * 2**30,
    vocab: tuple[str, ...] | None = None,
    tokenizer_json: str | None = None,
    special: Special | None = None,
) -> Path:
    """Write ``params`` as a Hugging Face checkpoint into ``directory`` (which must not exist or be
    empty): ``config.json`` (``torch_dtype``: the parameters' dtype), the weights in safetensors files
    of at most ``max_shard_bytes`` (with an index when more than one; written tensor by tensor), ``meshkit_vocab.json`` when a character ``vocab`` is given, and
    ``tokenizer.json`` when a BPE tokenizer (``tokenizers``' JSON) is; with ``special`` tokens, their
    ids in config.json and generation_config.json and, beside a tokenizer, tokenizer_config.json,
    special_tokens_map.json and its chat template (so that transformers' ``generate`` stops where meshkit's
    does, ``AutoTokenizer`` gives meshkit's ids and ``apply_chat_template`` the conversations it trained on)."""
    target = Path(directory)
    if target.exists() and (not target.is_dir() or any(target.iterdir())):
        raise InteropError(
            f"'{directory}' already exists and is not an empty directory: give a new directory"
        )
    tensors, tied = _tensors(params, cfg)
    config = config_to_hf(cfg, tied) | {"torch_dtype": _dtype(tensors) or cfg.dtype}
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        work = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
    except OSError as e:
        raise WriteError(target, e.strerror or gist(e)) from None
    try:
        stream.write(work, tensors, max_shard_bytes)
        ids = special.config() if special else {}
        (work / CONFIG).write_text(json.dumps(config | ids, indent=2, sort_keys=True))
        if special is not None and (ids or special.generation):
            (work / GENERATION).write_text(json.dumps(special.generation_config(), indent=2, sort_keys=True))
        if vocab is not None:
            (work / VOCAB).write_text(json.dumps(list(vocab)))
        if tokenizer_json is not None:
            (work / TOKENIZER).write_text(tokenizer_json, encoding="utf-8")
            if special is not None:
                tok_cfg = special.tokenizer_config(cfg.seq_len)
                (work / "tokenizer_config.json").write_text(json.dumps(tok_cfg, indent=2))
                named = ("bos_token", "eos_token", *special.named)
                tokens = {k: tok_cfg[k] for k in named if tok_cfg[k] is not None}
                (work / "special_tokens_map.json").write_text(json.dumps(tokens, indent=2))
                if special.chat_template is not None:  # where transformers 4.44 and later read it
                    (work / CHAT_TEMPLATE).write_text(special.chat_template, encoding="utf-8")
        if target.exists():
            target.rmdir()
        os.replace(work, target)
    except BaseException as e:
        shutil.rmtree(work, ignore_errors=True)
        if isinstance(e, OSError):
            raise WriteError(target, e.strerror or gist(e)) from None
        raise
    return target
