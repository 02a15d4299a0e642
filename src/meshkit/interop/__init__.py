"""Checkpoints of other tools in and out: Hugging Face ``config.json`` + safetensors (``hf``)."""

from meshkit.interop.hf import InteropError, config_from_hf, config_to_hf, load, read_config, read_vocab
from meshkit.interop.hf_save import save

__all__ = ["InteropError", "config_from_hf", "config_to_hf", "load", "read_config", "read_vocab", "save"]
