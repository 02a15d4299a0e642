"""What the TRL reference scripts (``trl_preference.py``, ``trl_grpo.py``) share: a checkpoint loaded as
TRL's trainers should see it, and the unpadded rows of a padded batch."""

import json

import numpy as np
import torch
from transformers import AutoModelForCausalLM


def load(path: str):
    """A checkpoint in float32 with eager attention, in eval mode, its functional attention dropout off
    (which TRL's ``disable_dropout`` does not reach)."""
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager")
    for module in model.modules():
        if hasattr(module, "attention_dropout"):
            module.attention_dropout = 0.0
    return model.eval()


def rows(ids: np.ndarray, mask: np.ndarray, side: str, name: str) -> list[list[int]]:
    """The unpadded rows of a padded (N, L) batch, checking the mask is [0..0 1..1] (left) or [1..1 0..0]."""
    out = []
    for i, (row, m) in enumerate(zip(ids.tolist(), mask.astype(int).tolist(), strict=True)):
        n = sum(m)
        want = [0] * (len(m) - n) + [1] * n if side == "left" else [1] * n + [0] * (len(m) - n)
        if n == 0 or m != want:
            raise ValueError(f"{name}_mask row {i} is not {side}-padded with at least one token: {m}")
        out.append(row[len(m) - n :] if side == "left" else row[:n])
    return out


def run_jobs(path: str, run, said) -> None:
    """Each job of the JSON list at ``path`` through ``run(job) -> result``, the result written to the job's
    ``out``; ``said(job, result)`` is the line printed for it."""
    torch.manual_seed(0)
    with open(path) as f:
        jobs = json.load(f)
    for job in jobs:
        result = run(job)
        with open(job["out"], "w") as f:
            json.dump(result, f, indent=1)
        print(said(job, result), flush=True)
