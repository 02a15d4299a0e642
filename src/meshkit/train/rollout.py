"""GRPO's rollouts (``meshkit train --task grpo``): each rollout draws ``--generations`` completions of each
of its prompts from the policy as it is (the sampler of :mod:`meshkit.models.generate`, a key/value cache,
with the run's parameters where the run keeps them), scores them with the run's reward
(:mod:`meshkit.rewards`), and makes the batch ``--updates-per-rollout`` optimizer steps train on
(:mod:`meshkit.models.grpo`: a row per completion, its prompt then the completion cut after its first
end-of-text id, advantages normalised in each prompt's group).

The rollout's log-probs of the completions under the policy that sampled them (``sampled``) are the
trainer's forward before the rollout's first update, and the sampler's own log-probs of its tokens are
set beside them each rollout (``logps/sampler_gap``: the largest difference; the two are the same
computation, certified equal in float64 by tests/test_sampler_logprobs.py). The reference (where
``--beta`` > 0) is the frozen starting model, as for DPO (``objective.frozen_logps``): the base weights under
LoRA, else a copy of the starting weights.

Which prompts a rollout takes and the sampler's key are functions of the seed and the rollout's index
alone, so a resumed run draws what the run it continues would have drawn.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any

import jax
import numpy as np

from meshkit._errors import MeshkitError
from meshkit.data import global_batch
from meshkit.models import grpo as G
from meshkit.spec.batch import TokenBatch


class RolloutError(MeshkitError):
    """A rollout that cannot be made as the run asks (prompts longer than the context)."""


@dataclass(kw_only=True)
class Rollouts:
    """The rollout batches of a GRPO run and what they measured (module docstring)."""

    prompts: Any
    """The training prompts (``meshkit.data.prompts.Prompts``)."""
    reward: Any
    """``(prompts, completions, rows) -> rewards`` (``meshkit.rewards.Reward``)."""
    how: G.GRPO
    generations: int
    max_new: int
    updates: int
    """Optimizer steps per rollout (TRL's ``num_iterations``)."""
    seq_len: int
    seed: int
    stop_ids: tuple[int, ...]
    pad_id: int
    decode: Any
    sample_fn: Any
    """``(trainer, prompts ids, seed) -> (tokens, logprobs)``: the policy's completions and their log-probs."""
    logps: Any
    """``(params, batch) -> (B, T)``: the trainer's log-probs of a batch's targets (jitted, sharded)."""
    reference: Any = None
    """``(trainer, batch) -> (B, T)``: the reference's log-probs (None where beta is 0)."""
    rows: int = 0
    """Completions per rollout: the run's --batch-size."""
    steps: int = 0
    """Optimizer steps taken from these rollouts (the stream's position, as ``Batches.batch``)."""
    current: tuple[int, Any, dict[str, float]] | None = field(default=None, repr=False)

    # -- the run's stream (as ``meshkit.data.Batches`` is to other tasks: its position, saved and restored) --
    packing = None
    packing_summary = None

    @property
    def batch(self) -> int:
        return self.steps

    @property
    def state(self) -> dict[str, Any]:
        return {"batch": self.steps, "seed": self.seed, "rollouts": True}

    def restore(self, state: dict[str, Any]) -> None:
        if not isinstance(state, dict) or not state.get("rollouts") or state.get("seed") != self.seed:
            raise RolloutError(
                f"data state {state!r} is not this GRPO run's rollouts (seed {self.seed}): resume with the same "
                "--task, data and seed"
            )
        self.steps, self.current = int(state["batch"]), None

    def close(self) -> None:
        """Nothing runs ahead of the step (a rollout is made when a step asks for it)."""

    def delivered(self, batch: int) -> dict[str, int]:
        return {}

    def prompts_of(self, rollout: int) -> list[int]:
        """The prompt indices of rollout ``rollout``: each prompt once per epoch, shuffled by epoch."""
        return self.prompts.batch(rollout, self.rows // self.generations, self.seed)

    def next_batch(self, trainer: Any) -> tuple[Any, dict[str, float]]:
        """The global batch the next optimizer step trains on, and its rollout's metrics (the rollout's
        first step only: reward, completion length, sampler gap)."""
        rollout, first = divmod(self.steps, self.updates)
        self.steps += 1
        if self.current is None or self.current[0] != rollout:
            self.current = (rollout, *self._make(trainer, rollout))
        _, batch, metrics = self.current
        return batch, metrics if first == 0 else {}

    def greedy(self, trainer: Any, prompts: list[Any]) -> list[list[int]]:
        """The policy's greedy completions of ``prompts`` (the held-out evaluation's), ``max_new`` tokens each."""
        return self.sample_fn(trainer, prompts, 0, greedy=True)[0]

    def _make(self, trainer: Any, rollout: int) -> tuple[Any, dict[str, float]]:
        which, g = self.prompts_of(rollout), self.generations
        ids = [a for i in which for a in [self.prompts.ids(i)] * g]
        tokens, sampler_lps = self.sample_fn(trainer, ids, _key(self.seed, rollout))
        completions = [cut(t, self.stop_ids) for t in tokens]
        # each prompt's row read once, a copy for each completion of its group (a reward function may
        # change what it is given, as TRL's own do)
        asked = [(self.prompts.prompt(i), self.prompts.row(i)) for i in which]
        prompts = [copy.deepcopy(q) for q, _ in asked for _ in range(g)]
        rows = [copy.deepcopy(r) for _, r in asked for _ in range(g)]
        texts = [self.decode(np.asarray(c, np.int32)) for c in completions]
        rewards = self.reward(prompts, texts, rows)
        batch, mask = rows_of(ids, completions, self.seq_len, self.pad_id)
        weights, share = G.weights(mask, self.how, self.max_new)
        values = {
            "advantages": G.advantages(rewards, self.generations, self.how.scale_rewards).astype(np.float32),
            "tokens": share.astype(np.float32),
        }
        placed = global_batch(trainer.shardings.batch, batch._replace(weights=weights.astype(np.float32)))
        values = {k: global_batch(trainer.shardings.batch, (v,))[0] for k, v in values.items()}
        values["sampled"] = self.logps(trainer.params, placed)
        if self.reference is not None:
            values["reference"] = self.reference(trainer, placed)
        gap = _sampler_gap(np.asarray(values["sampled"]), sampler_lps, ids, completions, self.how)
        lengths = np.array([len(c) for c in completions], np.float64)
        groups = np.asarray(rewards, np.float64).reshape(-1, self.generations)
        metrics = {
            "reward": float(np.mean(rewards)),
            "reward_std": float(groups.std(1, ddof=1).mean()),  # TRL's: the mean of the groups' (unbiased)
            "frac_reward_zero_std": float(np.mean(groups.std(1) == 0)),
            "completions/mean_length": float(lengths.mean()),
            "completions/clipped_ratio": float(
                np.mean([not _stopped(c, self.stop_ids) for c in completions])
            ),
        }
        if gap is not None:
            metrics["logps/sampler_gap"] = gap
        return placed._replace(reference=values), metrics


def _key(seed: int, rollout: int) -> int:
    """The sampler's seed of rollout ``rollout`` (a function of the run's seed and the index alone)."""
    return int(np.random.SeedSequence([seed, rollout, 0x6A5]).generate_state(1)[0])


def cut(tokens: Any, stop_ids: tuple[int, ...]) -> list[int]:
    """A completion up to and with its first stop id (the rest was sampled past its end)."""
    out = []
    for t in tokens:
        out.append(int(t))
        if int(t) in stop_ids:
            break
    return out


def _stopped(completion: list[int], stop_ids: tuple[int, ...]) -> bool:
    return bool(completion) and completion[-1] in stop_ids


def rows_of(
    prompts: list[Any], completions: list[list[int]], seq_len: int, pad_id: int
) -> tuple[TokenBatch, np.ndarray]:
    """``(batch, mask)``: a row per completion, its prompt's ids then its own, padded to ``seq_len + 1``
    (segment 1, positions from 0; padding segment 0), and the completion mask of the targets ``(B, T)``."""
    b = len(prompts)
    ids = np.full((b, seq_len + 1), pad_id, np.int32)
    seg, pos = np.zeros((b, seq_len + 1), np.int32), np.zeros((b, seq_len + 1), np.int32)
    mask = np.zeros((b, seq_len), np.float64)
    for r, (p, c) in enumerate(zip(prompts, completions, strict=True)):
        n = len(p) + len(c)
        if n > seq_len + 1:
            raise RolloutError(
                f"a prompt of {len(p)} ids and its completion of {len(c)} pass --seq-len {seq_len} + 1: give a "
                f"longer --seq-len or a smaller --max-new-tokens"
            )
        ids[r, :n] = np.concatenate([np.asarray(p, np.int32), np.asarray(c, np.int32)])
        seg[r, :n], pos[r, :n] = 1, np.arange(n)
        mask[r, len(p) - 1 : n - 1] = 1.0  # target t predicts id t + 1: the completion's ids
    return TokenBatch(ids[:, :-1], ids[:, 1:], None, seg[:, :-1], pos[:, :-1]), mask


def _sampler_gap(sampled, sampler_lps, prompts, completions, how: G.GRPO) -> float | None:
    """The largest difference between the trainer's log-prob of a sampled token and the sampler's own
    (None where the loss reads the logits at another temperature than the sampler reports them: the
    sampler's are of the logits as they are)."""
    if how.temperature != 1.0:
        return None
    gap = 0.0
    for r, (p, c) in enumerate(zip(prompts, completions, strict=True)):
        ours = sampled[r, len(p) - 1 : len(p) - 1 + len(c)]
        theirs = np.asarray(sampler_lps[r][: len(c)], np.float64)
        if len(c):
            gap = max(gap, float(np.max(np.abs(ours - theirs))))
    return gap


def sampler(model: Any, params_of: Any, max_new: int, how: G.GRPO) -> Any:
    """``(trainer, prompts ids, seed, greedy=False) -> (tokens, logprobs)``: ``max_new`` tokens after each
    prompt, drawn at the run's temperature (``greedy``: the most likely) with the key/value cache, the
    parameters as the trainer keeps them (as the family reads them: ``params_of``, a LoRA run's adapters
    merged)."""
    from meshkit.models.generate import Sampling, generate, kv_sharding

    def draw(trainer: Any, prompts: list[Any], seed: int, greedy: bool = False) -> tuple[Any, Any]:
        return generate(
            params_of(trainer.params),
            model,
            [np.asarray(p).tolist() for p in prompts],
            max_new,
            sampling=Sampling(temperature=0.0 if greedy else how.temperature),
            seed=seed,
            cache_sharding=kv_sharding(trainer.mesh, model),
            logprobs=True,
        )

    return draw


def logps_step(apply: Any, how: G.GRPO, sharding: Any) -> Any:
    """The trainer's log-probs of a placed batch's targets at the run's temperature (jitted)."""
    return jax.jit(G.logps_fn(apply, how.temperature), out_shardings=sharding)


def build(
    cfg: Any, data: Any, family: Any, model: Any, trainer: Any, params_of: Any, adapters: Any
) -> Rollouts:
    """The rollouts of a ``--task grpo`` run: its training prompts, reward, sampler and log-probs, laid out
    as ``trainer`` keeps the parameters; ``params_of``: the trainer's parameters as the family reads them
    (a LoRA run's merged), ``adapters``: its ``LoraConfig`` or None (the reference: ``objective``)."""
    from meshkit import rewards
    from meshkit.train import objective

    if jax.process_count() > 1:
        raise RolloutError(
            f"--task grpo makes its rollouts on one process yet, and this job has {jax.process_count()}: run it "
            "as one process (its devices may be many)"
        )
    how = objective.grpo(cfg)
    o = cfg.objective
    check_room(data, cfg.data.seq_len, o.max_new_tokens)
    apply = objective.applied(family, model)
    sharding = trainer.shardings.batch
    reference = None
    if how.beta:
        reference = objective.frozen_logps(
            cfg, G.logps_fn(apply, how.temperature), trainer.params, sharding, adapters
        )
    return Rollouts(
        prompts=data.prompt_set(),
        reward=rewards.load(o.reward),
        how=how,
        generations=o.generations,
        max_new=o.max_new_tokens,
        updates=o.updates_per_rollout,
        seq_len=cfg.data.seq_len,
        seed=cfg.data.seed,
        stop_ids=stop_ids(data),
        pad_id=data.pad_id,
        decode=data.decode,
        sample_fn=sampler(model, params_of, o.max_new_tokens, how),
        logps=logps_step(apply, how, sharding),
        reference=reference,
        rows=cfg.data.batch_size,
    )


def stop_ids(data: Any) -> tuple[int, ...]:
    """The ids a completion ends at: the tokenizer's end of text."""
    return () if data.bpe is None else (int(data.bpe.eot_id),)


def nothing_learnt(history: list[dict[str, Any]]) -> str | None:
    """Why a GRPO run learnt nothing from its reward (one line), or None: no rollout scored any prompt's
    completions apart, so every advantage was 0 and no step moved the policy toward a reward."""
    rollouts = [h for h in history if "frac_reward_zero_std" in h]
    if not rollouts or any(h["frac_reward_zero_std"] < 1.0 for h in rollouts):
        return None
    rewards = sorted({round(h["reward"], 6) for h in rollouts})
    return (
        f"no rollout of the {len(rollouts)} scored one prompt's completions apart (mean rewards {rewards[:3]}): every "
        "advantage was 0 and the policy learnt nothing from --reward; check that it can tell answers apart (the "
        "rows' answer field, the pattern), or sample more --generations or at a higher --temperature"
    )


def check_room(data: Any, seq_len: int, max_new: int) -> None:
    """Every prompt (training and held-out) and ``max_new`` tokens after it fit the model's ``seq_len``
    positions, as the sampler needs them (``models.generate``); else one line naming the longest prompt and
    what fits, before the run directory is written or anything sampled."""
    longest, where = 0, None
    for held in (False, True):
        prompts = data.prompt_set(held_out=held)
        lengths = prompts.ends - prompts.starts
        if len(lengths) and int(lengths.max()) > longest:
            longest = int(lengths.max())
            where = f"{'held-out' if held else 'training'} prompt {int(lengths.argmax())}"
    if longest + max_new > seq_len:
        raise RolloutError(
            f"the longest prompt ({where}, {longest} ids) and --max-new-tokens {max_new} pass --seq-len {seq_len}: "
            f"give --seq-len {longest + max_new} or more, a smaller --max-new-tokens, or shorter prompts"
        )
