"""The Gemma's row in the registry (``meshkit.models.registry``): ``meshkit.models.gemma``, read from and
written as a Gemma 1, Gemma 2 or Gemma 3 (text) checkpoint (its Hugging Face format, one row per model
type: ``meshkit.models.gemma_hf``; the table in ``docs/families.md``).
"""

from __future__ import annotations

from typing import Any

from meshkit.models import gemma_hf
from meshkit.models.family import Family, HFFormat, tied_lm_head


def _gemma() -> Any:
    from meshkit.models import gemma

    return gemma


def options_of(cfg: Any) -> dict[str, Any]:
    """``--kv-heads`` (0: as many as the heads) and ``--tie-embeddings`` as a run writes them."""
    return {
        "kv_heads": cfg.kv_heads if cfg.kv_heads != cfg.heads else 0,
        "tie_embeddings": cfg.tie_embeddings,
    }


def check(run: Any) -> str | None:
    """Rotary embeddings rotate pairs: a head's width must be even (from a checkpoint, its head_dim decides)."""
    if run.init_from is None and (run.width // run.heads) % 2:
        return f"--model gemma needs an even head width (--width / --heads = {run.width // run.heads}) for rotary embeddings"
    return None


def units(cfg: Any) -> dict[str, int]:
    return _gemma().units(cfg)


def small(*, layers: int, heads: int, experts: int, scan_layers: bool) -> Any:
    """The Gemma ``meshkit verify`` certifies plans on: Gemma 2's blocks, ``layers`` pairs of a local layer
    (a window of 8 of the 16 positions) and a global one, so that a pipeline stage holds whole pairs;
    width 32, ``heads`` query heads and half as many key/value heads, MLP width 64; soft caps small
    enough to bind at the initial weights (scores 0.05, logits 0.5), queries scaled by 16 ** -0.5."""
    return _gemma().GemmaConfig(
        vocab_size=64,
        seq_len=16,
        layers=2 * layers,
        width=32,
        heads=heads,
        kv_heads=max(heads // 2, 1),
        ffn=64,
        query_scalar=16.0,
        window=8,
        local_layers=(True, False) * layers,
        attn_softcap=0.05,
        final_softcap=0.5,
        qk_norm=False,
        scan_layers=scan_layers,
        experts=experts,
    )


FAMILY = Family(
    name="gemma",
    about="GeGLU, (1 + w) RMSNorm, local and global attention, soft caps",
    module_name="meshkit.models.gemma",
    config_name="GemmaConfig",
    gated=True,
    options=("kv_heads", "tie_embeddings"),
    options_of=options_of,
    check=check,
    units=units,
    small=small,
    hf=HFFormat(
        label="Gemma",
        model_types=tuple(gemma_hf.TYPES),
        read=gemma_hf.read,
        write=gemma_hf.write,
        names=gemma_hf.names,
        unread=gemma_hf.unread,
        head=tied_lm_head,
    ),
)
