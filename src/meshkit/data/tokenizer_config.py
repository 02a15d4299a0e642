"""What a Hugging Face tokenizer's directory says beside its ``tokenizer.json``, read as transformers'
``AutoTokenizer`` reads it: the end-of-text and beginning-of-text tokens (``tokenizer_config.json``,
overridden by ``special_tokens_map.json``; strings or ``AddedToken`` dicts; the tokenizer class's own
defaults where neither names one), and whether a document starts with the BOS token.

That last one is the tokenizer's post-processor (``tokenizer.json``), except for the classes that
transformers rebuilds it for from ``add_bos_token``/``add_eos_token`` (``update_post_processor``: Llama,
Code Llama, Gemma, GPT-NeoX); for those the flags decide, as they do for ``AutoTokenizer``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from meshkit.data.source import DataError
from meshkit.files import regular

CONFIG = "tokenizer_config.json"
SPECIAL_MAP = "special_tokens_map.json"

CLASS_SPECIALS: dict[str, tuple[str | None, str | None]] = {
    "GPT2Tokenizer": ("<|endoftext|>", "<|endoftext|>"),
    "GPTNeoXTokenizer": ("<|endoftext|>", "<|endoftext|>"),
    "LlamaTokenizer": ("</s>", "<s>"),
    "CodeLlamaTokenizer": ("</s>", "<s>"),
    "GemmaTokenizer": ("<eos>", "<bos>"),
    "Qwen2Tokenizer": ("<|endoftext|>", None),
}
"""(eos, bos) a transformers tokenizer class takes when its config names none (its ``__init__`` defaults)."""
REBUILT: dict[str, tuple[bool, bool]] = {
    "LlamaTokenizer": (True, False),
    "CodeLlamaTokenizer": (True, False),
    "GemmaTokenizer": (True, False),
    "GPTNeoXTokenizer": (False, False),
}
"""The classes whose post-processor transformers rebuilds from (add_bos_token, add_eos_token), with
their defaults."""


@dataclass(frozen=True, kw_only=True, slots=True)
class TokenizerConfig:
    """The special tokens and framing flags a tokenizer's directory names (None: not named)."""

    tokenizer_class: str | None = None
    """Without transformers' ``Fast`` suffix."""
    eos_token: str | None = None
    bos_token: str | None = None
    add_bos_token: bool | None = None
    """Only where the class rebuilds its post-processor from it (:data:`REBUILT`), else None."""
    add_eos_token: bool | None = None


def read_json(path: Path) -> dict[str, Any]:
    """A tokenizer directory's JSON file as a dict ({} where absent); one line naming the fix where it is not one."""
    if not regular(path, fix="remove it to use the tokenizer.json alone", error=DataError):
        return {}  # absent; anything there but a regular file (a FIFO would block the read) is refused
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise DataError(
            f"'{path}' is not JSON ({e}): restore it, or remove it to use the tokenizer.json alone"
        ) from None
    if not isinstance(data, dict):
        raise DataError(
            f"'{path}' is not a JSON object: restore it, or remove it to use the tokenizer.json alone"
        )
    return data


def _content(value: Any, key: str, path: Path) -> str | None:
    """A token as the config writes it: a string, an ``AddedToken`` dict (``content``), or null."""
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return value["content"]
    raise DataError(
        f"'{path}': {key} is {value!r}, not a token string: fix it, or give the token with --{key.replace('_', '-')}"
    )


def read_config(directory: Path) -> TokenizerConfig:
    """The directory's ``tokenizer_config.json`` and ``special_tokens_map.json`` (either may be absent)."""
    cfg_path, map_path = directory / CONFIG, directory / SPECIAL_MAP
    cfg, overrides = read_json(cfg_path), read_json(map_path)
    cls = cfg.get("tokenizer_class")
    cls = cls.removesuffix("Fast") if isinstance(cls, str) else None
    defaults = CLASS_SPECIALS.get(cls or "", (None, None))
    tokens = {}
    for key, default in zip(("eos_token", "bos_token"), defaults, strict=True):
        if key in overrides:
            tokens[key] = _content(overrides[key], key, map_path)
        else:
            tokens[key] = _content(cfg[key], key, cfg_path) if key in cfg else default
    flags: dict[str, bool | None] = {"add_bos_token": None, "add_eos_token": None}
    if cls in REBUILT:
        for key, default in zip(flags, REBUILT[cls], strict=True):
            value = cfg.get(key, default)
            if not isinstance(value, bool):
                raise DataError(f"'{cfg_path}': {key} is {value!r}, not true or false: fix it")
            flags[key] = value
    return TokenizerConfig(tokenizer_class=cls, **tokens, **flags)


CARRIED = ("pad_token", "unk_token")
"""Special tokens a tokenizer's files name that meshkit keeps with it (beside the shards, in an export) though
it frames no text with them: ``AutoTokenizer`` knows them by these names only where a file gives them."""


def shards_config(eos: str, bos: str | None, add_bos: bool, carried: dict[str, str]) -> dict[str, Any]:
    """The ``tokenizer_config.json`` written beside the shards' ``tokenizer.json`` (whose post-processor
    already frames a document): meshkit and ``AutoTokenizer`` read the same tokens and ids from it; with the
    ``CARRIED`` tokens the tokenizer's own files named."""
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "eos_token": eos,
        "bos_token": bos,
        "add_bos_token": add_bos,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        **carried,
    }
