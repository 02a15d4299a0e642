"""Model families, meshkit's unit of extension: one row per decoder family (the GPT, the Llama) that
every layer above asks instead of comparing a model's name.

A row (``meshkit.models.family.Family``) says how a ``meshkit train`` run's options become the
family's config (its ``ModelShape``, the options only it takes, its own checks), where its init,
loss, stages and logical axes live, its tensor-parallel rules and whole units, the small model
``meshkit verify`` certifies plans on, and its Hugging Face format (``config.json`` both ways, the weight-name mapping ``meshkit.interop``
reads and writes by). A new family is a model module, a row module (``gpt_family.py`` shows one),
and one line in ``_ROWS`` below.

This module and the rows import no JAX: ``meshkit train --help`` reads the families' names and
summaries.
"""

from __future__ import annotations

import importlib
from typing import Any

from meshkit._errors import MeshkitError
from meshkit.models.family import Family, HFFormat, InteropError, Source

__all__ = [
    "Family",
    "HFFormat",
    "InteropError",
    "Source",
    "families",
    "family",
    "family_of",
    "hf_family",
    "names",
]


_ROWS = ("meshkit.models.gpt_family", "meshkit.models.llama_family", "meshkit.models.gemma_family")
"""The row modules, each holding ``FAMILY``: the first is ``meshkit train``'s default."""


def families() -> tuple[Family, ...]:
    return tuple(importlib.import_module(m).FAMILY for m in _ROWS)


def names() -> tuple[str, ...]:
    """The registered families' names (``--model``), the default first."""
    return tuple(f.name for f in families())


def family(name: str) -> Family:
    """The family named ``name``; unknown names raise, naming the registered ones."""
    for f in families():
        if f.name == name:
            return f
    raise MeshkitError(f"unknown model family {name!r}: use {' or '.join(names())}")


def family_of(cfg: Any) -> Family:
    """The family of a model config (an instance of its config class)."""
    for f in families():
        if type(cfg).__module__ == (f.config_module or f.module_name) and type(cfg).__name__ == f.config_name:
            return f
    raise TypeError(f"no meshkit model family has config {type(cfg).__name__}")


def hf_family(model_type: Any) -> Family | None:
    """The family that reads a Hugging Face ``model_type``, or None."""
    return next((f for f in families() if f.hf is not None and model_type in f.hf.model_types), None)


def hf_readable() -> str:
    """The Hugging Face formats meshkit reads, for messages: 'Llama (model_type llama, mistral) or ...'."""
    return " or ".join(
        f"{f.hf.label} (model_type {', '.join(f.hf.model_types)})" for f in families() if f.hf is not None
    )


def summary() -> str:
    """``--model``'s help: each family's name with what it is ('gpt, or llama (rotary, ...)')."""
    items = [f.name + (f" ({f.about})" if f.about else "") for f in families()]
    return ", or ".join(items) if len(items) < 3 else ", ".join(items[:-1]) + ", or " + items[-1]
