"""The Llama's row in the registry (``meshkit.models.registry``): ``meshkit.models.llama``, read
from and written as a Llama, Mistral, Qwen2, Qwen3, Mixtral or Qwen3-MoE checkpoint (its Hugging
Face format, one row per model type: ``meshkit.models.llama_hf``; the table in ``docs/families.md``).
"""

from __future__ import annotations

from typing import Any

from meshkit.models import llama_hf
from meshkit.models.family import Family, HFFormat, tied_lm_head


def _llama() -> Any:
    from meshkit.models import llama

    return llama


def options_of(cfg: Any) -> dict[str, Any]:
    """``--kv-heads`` (0: as many as the heads) and ``--tie-embeddings`` as a run writes them."""
    return {
        "kv_heads": cfg.kv_heads if cfg.kv_heads != cfg.heads else 0,
        "tie_embeddings": cfg.tie_embeddings,
    }


def check(run: Any) -> str | None:
    """Rotary embeddings rotate pairs: a head's width must be even (from a checkpoint, its head_dim
    decides, checked by the config when it is read)."""
    if run.init_from is None and (run.width // run.heads) % 2:
        return f"--model llama needs an even head width (--width / --heads = {run.width // run.heads}) for rotary embeddings"
    return None


def units(cfg: Any) -> dict[str, int]:
    return _llama().units(cfg)


def small(*, layers: int, heads: int, experts: int, scan_layers: bool) -> Any:
    """The Llama ``meshkit verify`` certifies plans on: width 32, ``heads`` query heads and half as many
    key/value heads (grouped-query attention), MLP width 64."""
    return _llama().LlamaConfig(
        vocab_size=64,
        seq_len=16,
        layers=layers,
        width=32,
        heads=heads,
        kv_heads=max(heads // 2, 1),
        ffn=64,
        scan_layers=scan_layers,
        experts=experts,
    )


FAMILY = Family(
    name="llama",
    about="rotary, RMSNorm, SwiGLU, grouped-query attention",
    module_name="meshkit.models.llama",
    config_name="LlamaConfig",
    config_module="meshkit.models.llama_config",
    gated=True,
    options=("kv_heads", "tie_embeddings"),
    options_of=options_of,
    check=check,
    units=units,
    small=small,
    hf=HFFormat(
        label="Llama",
        model_types=tuple(llama_hf.TYPES),
        read=llama_hf.read,
        write=llama_hf.write,
        names=llama_hf.names,
        unread=llama_hf.unread,
        head=tied_lm_head,
    ),
)
