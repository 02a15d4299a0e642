"""``meshkit train --init-from hf:DIR``: a run that starts from a Hugging Face checkpoint. The
checkpoint decides the model (the family whose Hugging Face format reads its ``model_type``:
``meshkit.models.registry``); the run's own options must agree with it, and its vocabulary with
the run's data, before anything is read or written."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from meshkit import interop
from meshkit.interop import files
from meshkit.models import registry
from meshkit.models.family import Family
from meshkit.spec import PRECISIONS
from meshkit.train import config as C


def _directory(cfg: C.TrainConfig) -> Path:
    return Path(cfg.model.init_from[len(C.HF_PREFIX) :])


def checkpoint_config(
    cfg: C.TrainConfig, family: Family, vocab: int, *, precision: str, scan_layers: bool
) -> Any:
    """The checkpoint's model config (in ``precision``, the scanned form where asked), after checking
    the run's shape options and its data's vocabulary against it; raises ``ConfigError`` naming the
    option to give."""
    where = _directory(cfg)
    model = interop.read_config(where)
    if (theirs := registry.family_of(model)) is not family:  # what the checkpoint is, read from its config
        raise C.ConfigError(
            f"--init-from: '{where}' holds a {theirs.hf.label} checkpoint but --model is {family.name}: "
            f"give --model {theirs.name}"
        )
    theirs = {"layers": model.layers, "width": model.width, "heads": model.heads} | family.options_of(model)
    differ = {k: v for k, v in theirs.items() if cfg.get(k) != v}
    if differ:
        flags = " ".join(
            C.flag(k) if v is True else f"{C.flag(k)} {v}" for k, v in differ.items() if v is not False
        )
        mine = ", ".join(f"{C.flag(k)} {cfg.get(k)}" for k in differ)
        raise C.ConfigError(
            f"--init-from: the checkpoint's shape is not the run's ({mine}): give {flags or 'no --tie-embeddings'}"
        )
    if family.learned_positions and cfg.data.seq_len > model.seq_len:
        raise C.ConfigError(
            f"--init-from: the checkpoint has {model.seq_len} positions, fewer than --seq-len {cfg.data.seq_len}: "
            f"use --seq-len {model.seq_len} or less"
        )
    _check_vocabulary(cfg, vocab, model.vocab_size, where)
    return dataclasses.replace(model, compute_dtype=PRECISIONS[precision], scan_layers=scan_layers)


def checkpoint_shape(cfg: C.TrainConfig, family: Family) -> dict[str, int]:
    """What the run's options do not set but its checkpoint's model fixes, as ``ModelShape`` fields:
    the heads' width, the MLP's, and a mixture of experts' count, top-k and capacity (dropless: 0), so
    that the planner's shape is the model's ({} for a checkpoint of another family: the run refuses it)."""
    model = interop.read_config(_directory(cfg))
    if registry.family_of(model) is not family:
        return {}
    shape = model.shape()
    fixed = {"head_dim": shape.head_dim, "ffn": shape.ffn}
    if shape.experts:
        fixed |= {
            "experts": shape.experts,
            "experts_per_token": shape.experts_per_token,
            "capacity_factor": shape.capacity_factor,
            "shared_ffn": shape.shared_ffn,
        }
    return fixed


def _check_vocabulary(cfg: C.TrainConfig, vocab: int, theirs: int, where: Path) -> None:
    """The data must read text as the checkpoint does: token shards with the checkpoint's own
    ``tokenizer.json`` (the same ids for the same strings), text with its character vocabulary
    (``meshkit_vocab.json``, written by ``meshkit export``); bare token ids must lie inside its vocabulary."""
    from meshkit.data import load

    data = load(cfg.data.data)
    if data.bpe is not None:
        _check_tokenizer(data.bpe, where)
        return
    if data.chars is None:
        if vocab > theirs:
            raise C.ConfigError(
                f"--init-from: the data's token ids reach {vocab - 1} but the checkpoint's vocabulary has {theirs} "
                f"tokens: give token ids of the checkpoint's tokenizer"
            )
        return
    chars = interop.read_vocab(where)
    if chars is None:
        raise C.ConfigError(
            f"--init-from: '{where}' has no {interop.hf.VOCAB}, so its token ids do not match the run's character "
            f"tokenizer: give --data as a .npy of the checkpoint tokenizer's ids"
        )
    if tuple(chars) != data.chars:
        raise C.ConfigError(
            f"--init-from: the checkpoint's character vocabulary ({len(chars)} characters) is not the data's "
            f"({len(data.chars)}): train on the data it was trained on, or give its token ids as a .npy"
        )


def _check_tokenizer(bpe: Any, where: Path) -> None:
    from meshkit.data.tokenizer import load_tokenizer

    path = files.inside(where, interop.hf.TOKENIZER, str(where))
    prepare = f"prepare the data with it: meshkit data prepare TEXT --tokenizer {path} --out DIR"
    if not files.regular(path):  # a FIFO or a link out of the checkpoint is refused, naming it
        raise C.ConfigError(
            f"--init-from: '{where}' has no {interop.hf.TOKENIZER} to check the data's BPE against: {prepare}"
        )
    if load_tokenizer(path).vocabulary() != bpe.vocabulary():
        raise C.ConfigError(
            f"--init-from: the data's BPE tokenizer is not the checkpoint's ({path}): {prepare}"
        )


def init_from(cfg: C.TrainConfig, model: Any, *, shardings: Any = None) -> Any:
    """The checkpoint's weights in ``model``'s form and dtype: global arrays under ``shardings`` (the
    run's layout: each device's block read from the safetensors files and converted there, so the host
    holds a block at a time, never the model), or host arrays without them."""
    params, _ = interop.load(
        _directory(cfg), dataclasses.replace(model, compute_dtype=None), shardings=shardings
    )
    return params
