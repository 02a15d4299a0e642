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
converted to the parameter's dtype in turn. Writing them is :mod:`meshkit.interop.hf_save`'s. A
parameter the family's format has no name for (a GPT's mixture of experts) is refused before anything
is read.

Each family's format (its ``config.json`` both ways, its weights' names) is its registry row's
(``meshkit.models.registry.HFFormat``); this module reads and writes any of them.
"""

from __future__ import annotations

import itertools
import re
from pathlib import Path
from typing import Any

import jax
import numpy as np

from meshkit.interop import files
from meshkit.interop.special import CONFIG, Special, read_generation, read_special
from meshkit.interop.stream import INDEX, SINGLE
from meshkit.models import registry
from meshkit.models.family import HFFormat, InteropError, Source

VOCAB = "meshkit_vocab.json"
"""meshkit's character vocabulary (a JSON list), written beside the weights when the run has one."""
TOKENIZER = "tokenizer.json"
"""A BPE tokenizer, as Hugging Face tokenizers saves it (the Hub's name)."""

ModelConfig = Any
"""A registered model family's config (``meshkit.models.registry``)."""

FLOATS = frozenset({"F16", "BF16", "F32", "F64"})
"""The safetensors dtypes of weights: anything else (an integer tensor, FP8's quantized bytes) holds no
weight meshkit can convert by a cast."""

__all__ = [
    "Checkpoint",
    "InteropError",
    "Source",
    "Special",
    "config_from_hf",
    "config_to_hf",
    "load",
    "read_config",
    "read_generation",
    "read_special",
    "read_vocab",
]


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


def _config_json(directory: str | Path) -> tuple[dict, Path]:
    """A checkpoint directory's ``config.json`` as a dict, and its path."""
    if not Path(directory).is_dir():
        raise InteropError(
            f"no checkpoint directory '{directory}': give a directory holding config.json and safetensors"
        )
    path = files.inside(Path(directory), CONFIG, str(directory))
    data = files.read_json(path, CONFIG)
    if data is None:
        raise InteropError(f"'{directory}' has no config.json: give a Hugging Face checkpoint directory")
    if not isinstance(data, dict):
        raise InteropError(f"'{path}' is not a JSON object: restore the checkpoint's config.json")
    return data, path


def read_config(directory: str | Path, *, scan_layers: bool = False) -> ModelConfig:
    data, path = _config_json(directory)
    return config_from_hf(data, str(path), scan_layers=scan_layers)


# -- reading ----------------------------------------------------------------------------------------
class Checkpoint:
    """A checkpoint directory's tensors by name. One file is open at a time (``safe_open`` maps it,
    and the pages read count in the process's resident set until it is closed): a load's resident set
    holds at most one shard's pages beside the blocks it reads, not the checkpoint's."""

    def __init__(self, directory: str | Path):
        self.directory = Path(directory)
        index = files.inside(self.directory, INDEX, str(self.directory))
        weight_map = _weight_map(index)
        if weight_map is None and not files.regular(
            files.inside(self.directory, SINGLE, str(self.directory))
        ):
            raise InteropError(f"'{directory}' has no {SINGLE} and no {INDEX}: give a safetensors checkpoint")
        names = sorted(set(weight_map.values())) if weight_map is not None else [SINGLE]
        paths = {f: files.inside(self.directory, f, str(index)) for f in names}  # none leads outside
        missing = [f for f, path in paths.items() if not files.regular(path)]
        if missing:
            raise InteropError(
                f"'{directory}': {len(missing)} of {len(names)} shard(s) named by {INDEX} are missing "
                f"({', '.join(missing[:3])}): copy the whole checkpoint"
            )
        self._file, self._handle = None, None
        for f in names:  # every header checked now, before anything is read
            self._open(f)
        if weight_map is None:
            weight_map = {k: SINGLE for k in self._open(SINGLE).keys()}  # noqa: SIM118
        self.weight_map = weight_map

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

    def dtype(self, name: str) -> str:
        """The tensor's safetensors dtype ('F32', 'BF16', 'I32', ...)."""
        return self._slice(name).get_dtype()

    def _slice(self, name: str):
        if name not in self.weight_map:
            raise InteropError(
                f"'{self.directory}' has no tensor {name!r}: the checkpoint does not match its config.json"
            )
        return self._open(self.weight_map[name]).get_slice(name)

    def read(self, source: Source, index: tuple[slice, ...]) -> np.ndarray:
        """The block ``index`` of the tensor as meshkit lays it out (transposed, columns chosen)."""
        index = list(index)
        step = 1
        if source.columns is not None:
            lo, hi = source.columns
            start, stop, _ = index[-1].indices(len(range(0, hi - lo, source.step)))
            step = source.step  # read contiguous, then every step-th column (safetensors slices by ranges)
            index[-1] = slice(lo + start * step, lo + max(start, stop - 1) * step + (stop > start))
        if source.transpose:
            out = self._slice(source.name)[tuple(reversed(index))].T
            return np.ascontiguousarray(out[..., ::step])
        out = self._slice(source.name)[tuple(index)]
        return out if step == 1 else np.ascontiguousarray(out[..., ::step])


def _weight_map(index: Path) -> dict[str, str] | None:
    """The tensors-to-files map of a safetensors index (None: no index), checked: an object of names."""
    data = files.read_json(index, INDEX)
    if data is None:
        return None
    weight_map = data.get("weight_map") if isinstance(data, dict) else None
    if not isinstance(weight_map, dict) or not all(isinstance(f, str) for f in weight_map.values()):
        raise InteropError(
            f"'{index}' is not a safetensors index (its weight_map is no object of tensor names to file names: "
            f"{weight_map!r:.60}): restore it"
        )
    return weight_map


def _stored_shape(source: Source, shape: tuple[int, ...], layer_shape: tuple[int, ...]) -> tuple[int, ...]:
    """The shape the checkpoint must hold for a meshkit leaf of ``layer_shape`` (``shape``: the one it holds;
    a fused tensor's columns, after any transpose, are as many as it has: ``_fused_width``)."""
    if source.columns is not None:
        layer_shape = (*layer_shape[:-1], _fused_width(source, shape))
    return tuple(reversed(layer_shape)) if source.transpose else layer_shape


def _fused_width(source: Source, shape: tuple[int, ...]) -> int:
    """The columns of a stored tensor as meshkit lays it out (its first dim where it is transposed)."""
    return shape[0] if source.transpose else shape[-1]


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


def _check_undeclared(
    ckpt: Checkpoint, used: set[str], cfg: ModelConfig, directory: str | Path, data: dict
) -> None:
    """Refuse a checkpoint with weights its config does not declare (biases of another family, extra
    layers, ...): meshkit would drop them without a word and compute another model. Those its format leaves
    unread (``HFFormat.unread``: names, and prefixes ending in ``.``) are the checkpoint's own."""
    unread = _format(cfg).unread(cfg, data)
    prefixes = tuple(n for n in unread if n.endswith("."))
    extra = sorted(
        n
        for n in ckpt.names() - used
        if not _BUFFERS.search(n) and n not in unread and not n.startswith(prefixes)
    )
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
    if cfg is None:
        data, path = _config_json(directory)
        cfg = config_from_hf(data, str(path), scan_layers=False)
    else:  # the config given; the directory's config.json, where it has one, still says how its head is tied
        data = files.read_json(files.inside(Path(directory), CONFIG, str(directory)), CONFIG)
    ckpt = Checkpoint(directory)
    shapes = jax.eval_shape(lambda: registry.family_of(cfg).module.init(jax.random.key(0), cfg))
    sources, used = _sources(ckpt, cfg, shapes)
    _check_undeclared(ckpt, used, cfg, directory, data if isinstance(data, dict) else {})
    _check_head(ckpt, cfg, data if isinstance(data, dict) else {})
    flat_shardings = [None] * len(sources) if shardings is None else jax.tree.leaves(shardings)

    def build(item, sharding):
        source, layer, dims, leaf = item

        def block(index: tuple[slice, ...], depth: int = 0, at: tuple = ()) -> np.ndarray:
            """The block ``index`` of the leaf: its stacked dims (layers, experts) one tensor at a time."""
            if depth < len(dims):
                lo, hi, _ = index[0].indices(len(dims[depth][1]))
                return np.stack([block(index[1:], depth + 1, (*at, k)) for k in range(lo, hi)])
            keys = {"i": layer} | dict(zip((d[0] for d in dims), at, strict=True))
            named = Source(source.name.format(**keys), source.transpose, source.columns, step=source.step)
            return ckpt.read(named, index).astype(leaf.dtype, copy=False)

        if sharding is None:
            return block(tuple(slice(None) for _ in leaf.shape))
        return jax.make_array_from_callback(leaf.shape, sharding, block)

    leaves = [build(item, s) for item, s in zip(sources, flat_shardings, strict=True)]
    return jax.tree.unflatten(jax.tree.structure(shapes), leaves), cfg


def _sources(ckpt: Checkpoint, cfg: ModelConfig, shapes: Any) -> tuple[list, set[str]]:
    """Each leaf's ``(source, layer, stacked dims, leaf)`` and the tensor names they read, every tensor's
    shape and dtype checked first: nothing is read from a checkpoint that does not match its config."""
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
            short = source.columns is not None and source.columns[1] > _fused_width(source, ckpt.shape(name))
            if ckpt.shape(name) != want or short:
                raise InteropError(
                    f"'{ckpt.directory}': tensor {name} has shape {ckpt.shape(name)} but the config makes it {want}: "
                    f"the weights do not match config.json"
                )
            if ckpt.dtype(name) not in FLOATS:
                raise InteropError(
                    f"'{ckpt.directory / ckpt.weight_map[name]}': tensor {name} is {ckpt.dtype(name)}, not a "
                    f"floating-point weight ({', '.join(sorted(FLOATS))}): a cast would read its bytes as other "
                    f"numbers; give the checkpoint's float weights"
                )
        sources.append((source, layer, dims, leaf))
    return sources, used


def _check_head(ckpt: Checkpoint, cfg: ModelConfig, data: dict) -> None:
    """A head the config ties to the embedding but the checkpoint also stores must equal it: transformers
    4.57 computes the embedding as the head, 5.x the stored tensor (both measured), two models where they
    differ. (A head the config unties but the checkpoint lacks the format refuses: ``HFFormat.head``.)"""
    pair = _format(cfg).head(cfg, data, frozenset(ckpt.names()), str(ckpt.directory / CONFIG))
    if pair is None:
        return
    head, embedding = pair
    shape = ckpt.shape(head)
    rows = max(1, 2**22 // max(1, int(np.prod(shape[1:], dtype=np.int64))))  # blocks of 4 Mi values
    blocks = [
        (slice(lo, min(lo + rows, shape[0])), *(slice(None) for _ in shape[1:]))
        for lo in range(0, shape[0], rows)
    ]
    same = shape == ckpt.shape(embedding) and all(
        np.array_equal(ckpt.read(Source(head), block), ckpt.read(Source(embedding), block))
        for block in blocks
    )
    if not same:
        raise InteropError(
            f"'{ckpt.directory}': config.json ties the head to the embedding but {head} differs from {embedding}: "
            f"transformers 4.x computes the embedding as the head and 5.x reads {head}, two different models; "
            f"drop {head}, or set tie_word_embeddings false to read it"
        )


def _stacked_dims(source: Source, leaf: Any, stacked: bool, layer: int | None) -> list[tuple[str, range]]:
    """The leaf's leading dims that stack checkpoint tensors, each as ``(name's key, its range)``: the
    layers of the scanned form (``{i}``), then the experts of a per-expert tensor (``{j}``)."""
    dims = [("i", range(leaf.shape[0]))] if stacked else []
    if source.experts:
        dims.append(("j", range(leaf.shape[len(dims)])))
    return dims


def read_vocab(directory: str | Path) -> tuple[str, ...] | None:
    """The character vocabulary written beside the weights, if any."""
    path = files.inside(Path(directory), VOCAB, str(directory))
    vocab = files.read_json(path, VOCAB)
    if vocab is None:
        return None
    if not isinstance(vocab, list) or not all(isinstance(c, str) for c in vocab):
        raise InteropError(f"'{path}' is not a list of characters: restore it")
    return tuple(vocab)
