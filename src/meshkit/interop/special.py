"""The ids that frame a model's text, as a Hugging Face checkpoint names them: end of text (where
``generate`` stops; Llama 3.1 names three), beginning of text and padding, in ``config.json`` and
``generation_config.json``, and the generation settings beside them.

An export writes them (``interop.save(special=)``): those of the checkpoint its run started from, so
that transformers runs the export as it ran that checkpoint. Without them transformers falls back on
its model type's defaults: a Llama's eos 2, a Gemma's 1, a Qwen's none (its ``generate`` never stops).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from meshkit.interop import files
from meshkit.models.family import InteropError

CONFIG = "config.json"
GENERATION = "generation_config.json"
CHAT_TEMPLATE = "chat_template.jinja"
IDS = ("bos_token_id", "eos_token_id", "pad_token_id")
"""The id fields read and written; only ``eos_token_id`` may be a list (transformers stops at any of them)."""


@dataclass(frozen=True, slots=True)
class Special:
    """The tokens a model's generation and tokenizer name, each as its string (None where no tokenizer
    names it: a run on bare ids) and its id: end of text (where ``generate`` stops), beginning of text,
    padding; and the generation settings of the checkpoint they came from."""

    eos: tuple[str | None, int] | None
    bos: tuple[str | None, int] | None = None
    more_eos: tuple[int, ...] = ()
    """Further ids that end a text (Llama 3.1's ``<|eom_id|>``, ``<|eot_id|>``): ``eos_token_id`` is then a list."""
    pad: int | None = None
    generation: Mapping[str, Any] | None = None
    """The ``generation_config.json`` of the checkpoint the model came from (its sampling settings)."""
    named: Mapping[str, str] = dataclasses.field(default_factory=dict)
    """Further special tokens the tokenizer names, by their ``tokenizer_config.json`` key (``pad_token``,
    ``unk_token``...): ``AutoTokenizer`` knows a token by these names only where the file gives them."""
    chat_template: str | None = None
    """The chat template the model speaks (``chat_template.jinja``): the one its run trained with, else
    its checkpoint's; without it ``apply_chat_template`` raises."""

    @property
    def eos_ids(self) -> tuple[int, ...]:
        """Every id that ends a text."""
        return () if self.eos is None else (self.eos[1], *self.more_eos)

    def config(self) -> dict[str, Any]:
        """``bos_token_id``/``eos_token_id``/``pad_token_id`` as config.json and generation_config.json write them."""
        out: dict[str, Any] = {}
        if self.eos is not None:
            out["eos_token_id"] = list(self.eos_ids) if self.more_eos else self.eos[1]
        if self.bos is not None:
            out["bos_token_id"] = self.bos[1]
        if self.pad is not None:
            out["pad_token_id"] = self.pad
        return out

    def generation_config(self) -> dict[str, Any]:
        """generation_config.json: the checkpoint's settings, with these ids."""
        return {**(self.generation or {}), **self.config()}

    def tokenizer_config(self, max_length: int) -> dict[str, Any]:
        """tokenizer_config.json for a ``tokenizer.json`` loaded as it is: ``AutoTokenizer`` then gives
        meshkit's ids (without it transformers builds the model type's tokenizer, which for a Llama
        prepends a ``<s>`` the vocabulary may not have)."""
        return {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "eos_token": self.eos[0] if self.eos else None,
            "bos_token": self.bos[0] if self.bos else None,
            "add_bos_token": False,
            "add_eos_token": False,
            "clean_up_tokenization_spaces": False,
            "model_max_length": max_length,
            **self.named,
        }


def _ids(value: Any, key: str, path: Path) -> int | list[int] | None:
    """One id field as the file writes it, checked: a token id, or for ``eos_token_id`` a list of them."""
    if value is None or value == []:
        return None
    listed = value if isinstance(value, list) and key == "eos_token_id" else [value]
    if all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in listed):
        return value
    what = "a token id or a list of them" if key == "eos_token_id" else "a token id"
    raise InteropError(f"'{path}': {key}={value!r} is not {what}: restore it")


def read_special(directory: str | Path) -> dict[str, int | list[int]]:
    """The bos/eos/pad ids a checkpoint names: its generation_config.json's (what transformers' ``generate``
    uses), else its config.json's; eos as the list it may be. {} where it names none."""
    directory, out = Path(directory), {}
    for name in (CONFIG, GENERATION):  # generation_config.json's last: it decides
        path = files.inside(directory, name, str(directory))
        data = files.read_json(path, name)
        if data is not None and not isinstance(data, dict):
            raise InteropError(f"'{path}' is not a JSON object: restore the checkpoint's {name}")
        for key in IDS:
            value = _ids((data or {}).get(key), key, path)
            if value is not None:
                out[key] = value
    return out


def read_generation(directory: str | Path) -> dict[str, Any] | None:
    """A checkpoint's generation_config.json (None where it has none)."""
    path = files.inside(Path(directory), GENERATION, str(directory))
    data = files.read_json(path, GENERATION)
    if data is not None and not isinstance(data, dict):
        raise InteropError(f"'{path}' is not a JSON object: restore the checkpoint's {GENERATION}")
    return data
