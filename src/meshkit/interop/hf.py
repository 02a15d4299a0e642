"""Hugging Face checkpoints in and out: ``config.json`` + safetensors (one file, or shards with
``model.safetensors.index.json`` as the Hub writes them) for every model family that has a format
(Llama-family and GPT-2 models).

Weights move by name, transpose, column range (GPT-2's fused ``c_attn``) and stacking (a mixture of
experts' leaf ``(E, D, F)`` is one tensor per expert in the checkpoint, as Mixtral's and Qwen3-MoE's
are, and as transformers 5.x's ``save_pretrained`` still writes them) only. ``load`` builds
each parameter as a global ``jax.Array`` under the sharding asked for with
``jax.make_array_from_callback``: every device's block is read from the safetensors file by
``safe_open(...).get_slice``, so neither a device nor the host holds a whole tensor it does not
need (a layer of the scanned form is read layer by layer, an expert expert by expert); without shardings each tensor is read and
converted to the parameter's dtype in turn. ``save`` gathers one tensor at a time to the host and
writes it into its safetensors shard (``meshkit.interop.stream``), so an export's host memory is a
small multiple of its largest tensor, never the model; it writes into a new directory beside the
target and renames it into place at the end: a failure leaves nothing behind. A parameter the
family's format has no name for (a GPT's mixture of experts) is refused before anything is read
or written.

Each family's format (its ``config.json`` both ways, its weights' names) is its registry row's
(``meshkit.models.registry.HFFormat``); this module reads and writes any of them.
"""

from __future__ import annotations

import itertools
import json
import os
import re
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jax
import numpy as np

from meshkit.interop import stream
from meshkit.interop.stream import INDEX, SINGLE
from meshkit.models import gpt, registry
from meshkit.models.family import HFFormat, InteropError, Source

CONFIG = "config.json"
GENERATION = "generation_config.json"
VOCAB = "meshkit_vocab.json"
"""meshkit's character vocabulary (a JSON list), written beside the weights when the run has one."""
TOKENIZER = "tokenizer.json"
"""A BPE tokenizer, as Hugging Face tokenizers saves it (the Hub's name)."""

ModelConfig = Any
"""A registered model family's config (``meshkit.models.registry``)."""

__all__ = ["Checkpoint", "InteropError", "Source", "Special", "config_from_hf", "config_to_hf", "load", "read_config",
           "read_special", "read_vocab", "save"]  # fmt: skip


# -- config.json ------------------------------------------------------------------------------------
def config_from_hf(data: dict, where: str = CONFIG, *, scan_layers: bool = False) -> ModelConfig:
    """meshkit's model config of a Hugging Face ``config.json``: the family whose format reads its
    ``model_type`` builds it."""
    kind = data.get("model_type")
    family = registry.hf_family(kind)
    if family is None:
        arch = ", ".join(data.get("architectures") or []) or "none named"
        raise InteropError(
            f"{where}: model_type {kind!r} (architectures: {arch}) is not one meshkit reads: give a "
            f"{registry.hf_readable()} checkpoint"
        )
    return family.hf.read(data, where, scan_layers)


def _format(cfg: ModelConfig) -> HFFormat:
    family = registry.family_of(cfg)
    if family.hf is None:
        raise InteropError(
            f"model family {family.name} has no Hugging Face format: meshkit cannot write or read it"
        )
    return family.hf


def config_to_hf(cfg: ModelConfig, tied: bool = False) -> dict:
    """The ``config.json`` of ``cfg`` (``tied``: the head written as the embedding)."""
    return _format(cfg).write(cfg, tied)


def read_config(directory: str | Path, *, scan_layers: bool = False) -> ModelConfig:
    path = Path(directory) / CONFIG
    if not Path(directory).is_dir():
        raise InteropError(
            f"no checkpoint directory '{directory}': give a directory holding config.json and safetensors"
        )
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise InteropError(
            f"'{directory}' has no config.json: give a Hugging Face checkpoint directory"
        ) from None
    except ValueError as e:
        raise InteropError(f"'{path}' is not JSON ({e}): restore the checkpoint's config.json") from None
    if not isinstance(data, dict):
        raise InteropError(f"'{path}' is not a JSON object: restore the checkpoint's config.json")
    return config_from_hf(data, str(path), scan_layers=scan_layers)


# -- reading ----------------------------------------------------------------------------------------
class Checkpoint:
    """A checkpoint directory's tensors by name. One file is open at a time (``safe_open`` maps it,
    and the pages read count in the process's resident set until it is closed): a load's resident set
    holds at most one shard's pages beside the blocks it reads, not the checkpoint's."""

    def __init__(self, directory: str | Path):
        self.directory = Path(directory)
        index = self.directory / INDEX
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (ValueError, KeyError, TypeError) as e:
                raise InteropError(f"'{index}' is not a safetensors index ({e}): restore it") from None
        elif (self.directory / SINGLE).is_file():
            weight_map = None
        else:
            raise InteropError(f"'{directory}' has no {SINGLE} and no {INDEX}: give a safetensors checkpoint")
        files = sorted(set(weight_map.values())) if weight_map is not None else [SINGLE]
        missing = [f for f in files if not (self.directory / f).is_file()]
        if missing:
            raise InteropError(
                f"'{directory}': {len(missing)} of {len(files)} shard(s) named by {INDEX} are missing "
                f"({', '.join(missing[:3])}): copy the whole checkpoint"
            )
        self._file, self._handle = None, None
        for f in files:  # every header checked now, before anything is read
            self._open(f)
        self.weight_map = weight_map or {k: SINGLE for k in self._open(SINGLE).keys()}  # noqa: SIM118

    def _open(self, file: str) -> Any:
        """``file``'s handle, the one open (the one before closed)."""
        from safetensors import safe_open

        if file != self._file:
            self._file, self._handle = None, None
            try:
                self._handle = safe_open(str(self.directory / file), framework="numpy")
            except Exception as e:  # safetensors raises its own error type for a damaged header
                raise InteropError(
                    f"'{self.directory / file}' is not a safetensors file ({e}): copy it again"
                ) from None
            self._file = file
        return self._handle

    def names(self) -> set[str]:
        return set(self.weight_map)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._slice(name).get_shape())

    def _slice(self, name: str):
        if name not in self.weight_map:
            raise InteropError(
                f"'{self.directory}' has no tensor {name!r}: the checkpoint does not match its config.json"
            )
        return self._open(self.weight_map[name]).get_slice(name)

    def read(self, source: Source, index: tuple[slice, ...]) -> np.ndarray:
        """The block ``index`` of the tensor as meshkit lays it out (transposed, columns chosen)."""
        index = list(index)
        if source.columns is not None:
            lo, hi = source.columns
            start, stop, _ = index[-1].indices(hi - lo)
            index[-1] = slice(lo + start, lo + stop)
        if source.transpose:
            return np.ascontiguousarray(self._slice(source.name)[tuple(reversed(index))].T)
        return self._slice(source.name)[tuple(index)]


def _stored_shape(source: Source, shape: tuple[int, ...], layer_shape: tuple[int, ...]) -> tuple[int, ...]:
    """The shape the checkpoint must hold for a meshkit leaf of ``layer_shape``."""
    if source.columns is not None:
        return (*layer_shape[:-1], shape[-1])
    return tuple(reversed(layer_shape)) if source.transpose else layer_shape


def _named(
    cfg: ModelConfig, tree: Any, names: dict[tuple, Source]
) -> list[tuple[tuple, Source, int | None, Any]]:
    """Each leaf of ``tree`` (parameters, or their shapes) as ``(keys, source, layer, leaf)``: its path
    less a block's index, the format's tensor, that index (None outside a list of blocks). A leaf the
    format names no tensor for is refused in one line naming them all, before anything is read or written."""
    out, unnamed = [], {}
    for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
        keys = tuple(getattr(k, "key", getattr(k, "idx", None)) for k in path)
        layer = None
        if keys[0] == "blocks" and len(keys) > 1 and isinstance(keys[1], int):
            layer, keys = keys[1], (keys[0], *keys[2:])
        if keys in names:
            out.append((keys, names[keys], layer, leaf))
        else:
            unnamed["/".join(map(str, keys))] = None
    if unnamed:
        said = f"{', '.join(list(unnamed)[:6])}{', ...' if len(unnamed) > 6 else ''}"
        why = (
            "this format has no mixture of experts (meshkit writes and reads experts as Mixtral and Qwen3-MoE, "
            "from the Llama): export a dense model (experts 0)"
            if getattr(cfg, "experts", 0)
            else "meshkit cannot write or read them"
        )
        raise InteropError(
            f"the {_format(cfg).label} Hugging Face format names no tensor for {len(unnamed)} parameter(s) ({said}): {why}"
        )
    return out


_BUFFERS = re.compile(r"(^|\.)(attn\.bias|attn\.masked_bias|rotary_emb\.inv_freq)$")
"""Tensors older checkpoints carry that are no weights (GPT-2's causal mask, a rotary frequency
table): transformers skips them on load, and so does meshkit."""


def _check_undeclared(ckpt: Checkpoint, used: set[str], cfg: ModelConfig, directory: str | Path) -> None:
    """Refuse a checkpoint with weights its config does not declare (biases of another family, extra
    layers, ...): meshkit would drop them without a word and compute another model."""
    unread = _format(cfg).unread(cfg)
    extra = sorted(n for n in ckpt.names() - used if not _BUFFERS.search(n) and n not in unread)
    if extra:
        raise InteropError(
            f"'{directory}' holds {len(extra)} tensor(s) its config.json does not declare ({', '.join(extra[:3])}"
            f"{', ...' if len(extra) > 3 else ''}): meshkit's model would drop them and compute another model; "
            f"give the checkpoint's own config.json"
        )


def load(
    directory: str | Path, cfg: ModelConfig | None = None, *, shardings: Any = None
) -> tuple[Any, ModelConfig]:
    """``(params, cfg)``: the checkpoint's weights as meshkit parameters of ``cfg`` (default: the
    checkpoint's own, loop form), each a global array under ``shardings`` (a pytree like the
    parameters; default: host NumPy arrays). Every shape is checked before anything is read."""
    cfg = read_config(directory, scan_layers=False) if cfg is None else cfg
    ckpt = Checkpoint(directory)
    shapes = jax.eval_shape(lambda: registry.family_of(cfg).module.init(jax.random.key(0), cfg))
    names = dict(_format(cfg).names(cfg, frozenset(ckpt.names()), False))
    sources, used = [], set()
    for keys, source, layer, leaf in _named(cfg, shapes, names):
        stacked = keys[0] == "blocks" and layer is None
        dims = _stacked_dims(source, leaf, stacked, layer)
        tensor_shape = tuple(leaf.shape[len(dims) :])
        for at in itertools.product(*(d[1] for d in dims)):
            name = source.name.format(**{"i": layer} | dict(zip((d[0] for d in dims), at, strict=True)))
            used.add(name)
            want = _stored_shape(source, ckpt.shape(name), tensor_shape)
            if ckpt.shape(name) != want or (source.columns and source.columns[1] > ckpt.shape(name)[-1]):
                raise InteropError(
                    f"'{directory}': tensor {name} has shape {ckpt.shape(name)} but the config makes it {want}: "
                    f"the weights do not match config.json"
                )
        sources.append((source, layer, dims, leaf))
    _check_undeclared(ckpt, used, cfg, directory)
    flat_shardings = [None] * len(sources) if shardings is None else jax.tree.leaves(shardings)

    def build(item, sharding):
        source, layer, dims, leaf = item

        def block(index: tuple[slice, ...], depth: int = 0, at: tuple = ()) -> np.ndarray:
            """The block ``index`` of the leaf: its stacked dims (layers, experts) one tensor at a time."""
            if depth < len(dims):
                lo, hi, _ = index[0].indices(len(dims[depth][1]))
                return np.stack([block(index[1:], depth + 1, (*at, k)) for k in range(lo, hi)])
            keys = {"i": layer} | dict(zip((d[0] for d in dims), at, strict=True))
            named = Source(source.name.format(**keys), source.transpose, source.columns)
            return ckpt.read(named, index).astype(leaf.dtype, copy=False)

        if sharding is None:
            return block(tuple(slice(None) for _ in leaf.shape))
        return jax.make_array_from_callback(leaf.shape, sharding, block)

    leaves = [build(item, s) for item, s in zip(sources, flat_shardings, strict=True)]
    return jax.tree.unflatten(jax.tree.structure(shapes), leaves), cfg


def _stacked_dims(source: Source, leaf: Any, stacked: bool, layer: int | None) -> list[tuple[str, range]]:
    """The leaf's leading dims that stack checkpoint tensors, each as ``(name's key, its range)``: the
    layers of the scanned form (``{i}``), then the experts of a per-expert tensor (``{j}``)."""
    dims = [("i", range(leaf.shape[0]))] if stacked else []
    if source.experts:
        dims.append(("j", range(leaf.shape[len(dims)])))
    return dims


# -- writing ----------------------------------------------------------------------------------------
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
            fused.setdefault(name, []).append((source.columns, leaf))
            continue
        for j in range(shape[0]) if source.experts else [None]:  # an expert's tensor: its row of the leaf
            one = (lambda x=leaf: x) if j is None else (lambda x=leaf, j=j: x[j])
            read = (lambda one=one: _host(one()).T) if source.transpose else (lambda one=one: _host(one()))
            size = shape if j is None else shape[1:]
            out.append(stream.Tensor(name=source.name.format(i=layer, j=j), dtype=np.dtype(leaf.dtype), read=read,
                                     shape=size[::-1] if source.transpose else size))  # fmt: skip
    for name, parts in fused.items():  # columns no leaf fills are zeros (GPT-2's key bias: the GPT has none)
        first = parts[0][1]
        shape = (*first.shape[:-1], max(hi for (_, hi), _ in parts))

        def read(parts=parts, shape=shape, dtype=first.dtype) -> np.ndarray:
            whole = np.zeros(shape, dtype)
            for (lo, hi), leaf in parts:
                whole[..., lo:hi] = _host(leaf)
            return whole

        out.append(stream.Tensor(name=name, shape=shape, dtype=np.dtype(first.dtype), read=read))
    return out, tied


def _dtype(tensors: list[stream.Tensor]) -> str | None:
    """The floating dtype the tensors are written in (config.json's ``torch_dtype``), if one."""
    kinds = {
        str(t.dtype) for t in tensors if np.issubdtype(t.dtype, np.floating) or t.dtype.name == "bfloat16"
    }
    return kinds.pop() if len(kinds) == 1 else None


@dataclass(frozen=True, slots=True)
class Special:
    """The tokens a model's generation and tokenizer name: end of text (where ``generate`` stops) and,
    where the model has one, beginning of text; each as its string and its id."""

    eos: tuple[str, int]
    bos: tuple[str, int] | None = None

    def config(self) -> dict[str, int]:
        """``bos_token_id``/``eos_token_id`` as config.json and generation_config.json write them."""
        return {"eos_token_id": self.eos[1]} | ({"bos_token_id": self.bos[1]} if self.bos else {})

    def tokenizer_config(self, max_length: int) -> dict[str, Any]:
        """tokenizer_config.json for a ``tokenizer.json`` loaded as it is: ``AutoTokenizer`` then gives
        meshkit's ids (without it transformers builds the model type's tokenizer, which for a Llama
        prepends a ``<s>`` the vocabulary may not have)."""
        return {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": self.eos[0],
                "bos_token": self.bos[0] if self.bos else None, "add_bos_token": False, "add_eos_token": False,
                "clean_up_tokenization_spaces": False, "model_max_length": max_length}  # fmt: skip


def read_special(directory: str | Path) -> dict[str, int]:
    """The bos/eos ids a checkpoint's generation_config.json (else config.json) names; {} if none."""
    out: dict[str, int] = {}
    for name in (CONFIG, GENERATION):
        try:
            data = json.loads((Path(directory) / name).read_text())
        except (OSError, ValueError):
            continue
        for key in ("bos_token_id", "eos_token_id"):
            value = data.get(key) if isinstance(data, dict) else None
            if (
                isinstance(value, list) and value
            ):  # Llama 3 names several end ids: the first is the text's end
                value = value[0]
            if isinstance(value, int):
                out[key] = value
    return out


def save(params: Any, cfg: ModelConfig, directory: str | Path, *, max_shard_bytes: int = 2 * 2**30,
         vocab: tuple[str, ...] | None = None, tokenizer_json: str | None = None,
         special: Special | None = None) -> Path:  # fmt: skip
    """Write ``params`` as a Hugging Face checkpoint into ``directory`` (which must not exist or be
    empty): ``config.json`` (``torch_dtype``: the parameters' dtype), the weights in safetensors files
    of at most ``max_shard_bytes`` (with an index when more than one; written tensor by tensor), ``meshkit_vocab.json`` when a character ``vocab`` is given, and
    ``tokenizer.json`` when a BPE tokenizer (``tokenizers``' JSON) is; with ``special`` tokens, their
    ids in config.json and generation_config.json and, beside a tokenizer, tokenizer_config.json and
    special_tokens_map.json (so that transformers' ``generate`` stops where meshkit's does and
    ``AutoTokenizer`` gives meshkit's ids)."""
    target = Path(directory)
    if target.exists() and (not target.is_dir() or any(target.iterdir())):
        raise InteropError(
            f"'{directory}' already exists and is not an empty directory: give a new directory"
        )
    tensors, tied = _tensors(params, cfg)
    config = config_to_hf(cfg, tied) | {"torch_dtype": _dtype(tensors) or cfg.dtype}
    target.parent.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
    try:
        stream.write(work, tensors, max_shard_bytes)
        ids = special.config() if special else {}
        (work / CONFIG).write_text(json.dumps(config | ids, indent=2, sort_keys=True))
        if ids:
            (work / GENERATION).write_text(json.dumps(ids, indent=2, sort_keys=True))
        if vocab is not None:
            (work / VOCAB).write_text(json.dumps(list(vocab)))
        if tokenizer_json is not None:
            (work / TOKENIZER).write_text(tokenizer_json, encoding="utf-8")
            if special is not None:
                tok_cfg = special.tokenizer_config(cfg.seq_len)
                (work / "tokenizer_config.json").write_text(json.dumps(tok_cfg, indent=2))
                tokens = {k: tok_cfg[k] for k in ("bos_token", "eos_token") if tok_cfg[k] is not None}
                (work / "special_tokens_map.json").write_text(json.dumps(tokens, indent=2))
        if target.exists():
            target.rmdir()
        os.replace(work, target)
    except BaseException:
        shutil.rmtree(work, ignore_errors=True)
        raise
    return target


def read_vocab(directory: str | Path) -> tuple[str, ...] | None:
    """The character vocabulary written beside the weights, if any."""
    path = Path(directory) / VOCAB
    if not path.is_file():
        return None
    try:
        vocab = json.loads(path.read_text())
    except ValueError as e:
        raise InteropError(f"'{path}' is not JSON ({e}): restore it") from None
    if not isinstance(vocab, list) or not all(isinstance(c, str) for c in vocab):
        raise InteropError(f"'{path}' is not a list of characters: restore it")
    return tuple(vocab)
