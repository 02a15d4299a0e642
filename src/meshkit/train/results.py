"""What a run achieved and what it cost, as its end reports them: the held-out evaluation (also run
every ``--eval-every`` steps), model FLOPs utilisation, the results of ``report.json``, the communication
and memory of the compiled step beside the model (``proof``), and text sampled from the model."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from meshkit.data import global_batch, process_rows
from meshkit.data.mixture import realised
from meshkit.devices import host
from meshkit.models import num_params
from meshkit.planner.hardware import peak_flops
from meshkit.spec.batch import extras
from meshkit.train import evals, rollout
from meshkit.train.job import Job, family_params
from meshkit.train.task import batch_options, trained_tokens


def evaluate(job: Job) -> dict[str, float]:
    """Held-out loss over ``eval_batches`` fixed held-out batches: ``eval_loss`` in nats per token and,
    where the ids stand for text, ``eval_bpb`` in bits per byte (comparable across tokenizers). A
    mixture's sources each on their own held-out split (``eval_loss/NAME``, ``eval_bpb/NAME``), and
    ``eval_loss``/``eval_bpb`` their mean weighted by the mixture's weights. With ``--eval-tasks``, each
    task's ``acc/NAME`` and ``acc_norm/NAME`` (:mod:`meshkit.train.evals`)."""
    # --eval-tasks: acc/NAME, acc_norm/NAME
    tasks = {} if job.tasks is None else job.tasks(job.trainer.params)  # merged inside (evals.build)
    if not job.data.parts:
        return _held_out(job, None) | tasks
    out: dict[str, float] = {}
    for i, part in enumerate(job.data.parts):
        one = _held_out(job, i)
        for key, value in one.items():
            out[key] = out.get(key, 0.0) + part.weight * value
            out[f"{key}/{part.name}"] = value
    return out | tasks


def _held_out(job: Job, part: int | None) -> dict[str, float]:
    """``evaluate`` on the held-out split (of the mixture's source ``part``)."""
    t = job.trainer
    if job.cfg.data.task == "grpo":
        return _held_out_rewards(job)
    examples = job.cfg.data.batch_size
    stream = job.data.batches(
        seq_len=job.cfg.data.seq_len,
        global_batch=examples,
        seed=job.cfg.data.seed,
        held_out=True,
        part=part,
        rows=process_rows(t.shardings.batch, examples),
        **batch_options(job.cfg),
    )
    if job.cfg.data.task == "dpo":
        return _held_out_pairs(job, stream)
    losses, targets, nats, counted = [], [], 0.0, 0
    tokens = examples * job.cfg.data.seq_len
    for _ in range(job.cfg.run.eval_batches):
        local = next(stream)
        losses.append(float(job.eval_loss(t.params, global_batch(t.shardings.batch, local, examples))))
        learnt = trained_tokens(local, tokens)  # weighted (fine-tuning): the masked mean of `learnt`
        nats += losses[-1] * (tokens if learnt is None else learnt)
        counted += tokens if learnt is None else learnt
        weights = extras(local)[0]
        targets.append(local[1] if weights is None else local[1][np.asarray(weights) > 0])
    # per target, not per batch: a weighted batch's loss is its own masked mean, and one with nothing to
    # learn (a conversation cut before its answer) is 0 and counts no target (nan: none in any batch)
    out = {"eval_loss": nats / counted if counted else float("nan")}
    if job.data.token_bytes is not None:
        # each process holds its rows of the held-out batches: every row counted once, also where the
        # processes hold the same rows (a batch axis within each process)
        copies = jax.process_count() * stream.local_batch / examples
        nbytes = np.array([sum(job.data.target_bytes(t) for t in targets) / copies], np.float64)
        if jax.process_count() > 1:
            from jax.experimental import multihost_utils

            nbytes = multihost_utils.process_allgather(nbytes)
        if (bpb := job.data.bits_per_byte(nats, int(np.sum(nbytes)))) is not None:
            out["eval_bpb"] = bpb
    return out


def _held_out_pairs(job: Job, stream: Any) -> dict[str, float]:
    """``--task dpo``'s held-out figures: the preference loss (``eval_loss``) and TRL's metrics
    (``eval_rewards/accuracies``, ...), each the mean over the held-out batches (of equal pairs)."""
    t, sums = job.trainer, {}
    for _ in range(job.cfg.run.eval_batches):
        batch = global_batch(t.shardings.batch, next(stream), job.cfg.data.batch_size)
        if job.reference is not None:
            batch = job.reference(t, batch)
        loss, metrics = job.eval_loss(t.params, batch)
        for key, value in {"loss": loss, **metrics}.items():
            sums[key] = sums.get(key, 0.0) + float(value) / job.cfg.run.eval_batches
    return {f"eval_{k}": v for k, v in sums.items()}


def _held_out_rewards(job: Job) -> dict[str, float]:
    """``--task grpo``'s held-out figure: the reward of the policy's greedy completion of each held-out prompt
    (up to ``--eval-batches`` rollouts' worth of prompts): ``eval_reward``, and its share of prompts whose
    reward is above 0 (``eval_reward_positive``)."""
    rollouts = job.batches
    held = job.data.prompt_set(held_out=True)
    n = min(len(held), job.cfg.run.eval_batches * rollouts.rows // rollouts.generations)
    ids = [held.ids(i) for i in range(n)]
    tokens = rollouts.greedy(job.trainer, ids)
    texts = [job.data.decode(np.asarray(rollout.cut(c, rollouts.stop_ids), np.int32)) for c in tokens]
    rewards = rollouts.reward([held.prompt(i) for i in range(n)], texts, [held.row(i) for i in range(n)])
    return {
        "eval_reward": float(np.mean(rewards)),
        "eval_reward_positive": float(np.mean(np.asarray(rewards) > 0)),
    }


def utilisation(job: Job) -> tuple[int, float | None, str]:
    """The model's training FLOPs per token at the run's sequence length (attention included), the
    devices' peak FLOP/s each, and where that peak comes from (``planner.hardware.peak_flops``)."""
    if job.utilisation is None:
        flops = job.family.module.flops_per_token(job.model, job.cfg.data.seq_len)
        kind = jax.devices()[0].device_kind
        job.utilisation = (flops, *peak_flops(kind, job.cfg.parallel.precision, job.cfg.run.peak_tflops))
    return job.utilisation


def mfu(job: Job, tokens_per_s: float) -> float | None:
    """Model FLOPs utilisation: the model's FLOP/s over every device's peak (None where no peak is known)."""
    flops, peak, _ = utilisation(job)
    return None if peak is None else tokens_per_s * flops / (job.trainer.num_devices * peak)


def moe_slots(job: Job) -> int:
    """Token-slots a step routes: tokens x experts per token x routed layers of the global batch (a Llama's
    dense layers among routed ones, ``LlamaConfig.sparse_layers``, route none)."""
    m = job.model
    layers = getattr(m, "sparse_layers", m.layers)
    return job.cfg.data.batch_size * job.cfg.data.seq_len * m.experts_per_token * layers


def sample(job: Job, chars: int, temperature: float = 0.8) -> str:
    """Text sampled from the trained model, primed with the start of the held-out split."""
    if chars <= 0 or job.data.decoder is None:
        return ""
    params = jax.device_put(host(job.trainer.params), jax.local_devices()[0])  # every process, all shards
    params = family_params(job.cfg, params)
    t_len = job.cfg.data.seq_len
    ctx = np.asarray(job.data.held_out.read(0, t_len), np.int32)

    @jax.jit
    def next_token(p, window, key):
        logits = job.family.module.apply(p, window[None], job.model)[0, -1].astype(jnp.float32)
        return jax.random.categorical(key, logits / temperature)

    key, out = jax.random.key(job.cfg.data.seed), []
    while len(out) < chars and (job.data.tokenizer == "characters" or len(job.data.decode(out)) < chars):
        key, sub = jax.random.split(key)
        tok = int(next_token(params, jnp.asarray(ctx), sub))
        out.append(tok)
        ctx = np.concatenate([ctx[1:], [tok]]).astype(np.int32)
    return job.data.decode(np.asarray(out, np.int32))


def _rollout_rewards(history: list[dict[str, Any]]) -> dict[str, float]:
    """``--task grpo``: the first and the last rollouts' mean rewards (its loss is no measure of progress: its
    advantages are centred in each group)."""
    rewards = [h["reward"] for h in history if "reward" in h]
    return {"initial_reward": rewards[0], "final_reward": rewards[-1]} if rewards else {}


def results(job: Job) -> dict[str, Any]:
    """What the run achieved: loss, throughput, FLOPs and MFU; needs nothing but the history."""
    t = job.trainer
    steady = [h["tokens_per_s"] for h in job.history[1:]] or [h["tokens_per_s"] for h in job.history]
    tokens_per_s = float(np.median(steady)) if steady else 0.0
    flops, peak, peak_source = utilisation(job)
    return {
        "plan": job.cfg.parallel.plan,
        "precision": job.cfg.parallel.precision,
        "attention": job.cfg.parallel.attention,
        "attention_kernels": sorted(t.assembled.attention.used),
        "mesh": dict(t.mesh.shape),
        "devices": t.num_devices,
        "platform": jax.default_backend(),
        "processes": jax.process_count(),
        "params": num_params(t.params),
        "data": job.data.source,
        "steps": job.step,
        "initial_loss": job.history[0]["loss"] if job.history else None,
        "final_loss": job.history[-1]["loss"] if job.history else None,
        **_rollout_rewards(job.history),
        "eval_loss": job.evals[-1].get("eval_loss") if job.evals else None,
        "eval_bpb": job.evals[-1].get("eval_bpb") if job.evals else None,
        # --task dpo: TRL's metrics of the held-out pairs
        **(
            {k: v for k, v in job.evals[-1].items() if k.startswith(("eval_reward", "eval_logps/"))}
            if job.evals
            else {}
        ),
        **({"tasks": evals.summary(job.evals[-1])} if job.evals and job.tasks is not None else {}),
        "tokenizer": job.data.tokenizer,
        "vocab": job.data.vocab_size,
        **({"packing": packing} if (packing := job.batches.packing_summary) is not None else {}),
        **_mixture(job),
        "tokens_per_s": tokens_per_s,
        "step_time_s": float(np.median([h["step_time_s"] for h in job.history[1:]] or [0.0])),
        "model_flops_per_token": flops,
        "achieved_flops_per_s": tokens_per_s * flops,
        "peak_flops_per_device": peak,
        "peak_source": peak_source,
        "mfu": mfu(job, tokens_per_s),
        **_dropped(job),
    }


def _mixture(job: Job) -> dict[str, Any]:
    """A mixture: per source what it delivered over the run (rows, tokens, share beside its weight,
    epochs) and its last held-out loss."""
    if not job.data.parts or not job.history:
        return {}
    sources = realised(job.data.parts, job.history[-1], job.cfg.data.seq_len)
    last = job.evals[-1] if job.evals else {}
    for source in sources:
        source["eval_loss"] = last.get(f"eval_loss/{source['name']}")
    return {"mixture": sources}


def _dropped(job: Job) -> dict[str, Any]:
    """A mixture of experts: the token-slots dropped over the run (past an expert's capacity), and
    their share of every slot routed."""
    counts = [h["dropped_tokens"] for h in job.history if "dropped_tokens" in h]
    if not counts:
        return {}
    return {"dropped_tokens": sum(counts), "dropped_fraction": sum(counts) / (len(counts) * moe_slots(job))}


def proof(job: Job) -> dict[str, Any]:
    """What the run cost: communication and memory measured from the compiled step beside the model."""
    probe = (
        job.batches.current[1]  # GRPO: its last rollout
        if job.cfg.data.task == "grpo"
        else next(
            job.data.batches(
                seq_len=job.cfg.data.seq_len,
                global_batch=job.cfg.data.batch_size,
                seed=job.cfg.data.seed,
                process_index=0,
                process_count=1,
            )
        )
    )
    if job.reference is not None:  # --task dpo's step reads its pairs' reference log-probs (compiled only)
        probe = probe._replace(reference=np.zeros((len(probe[0]), 2), np.float32))
    plan_report = job.trainer.report(probe)
    if plan_report.pipeline is not None and plan_report.pipeline.record is not None and job.writer:
        from meshkit.plans import plot_schedule as plot

        p = plan_report.pipeline
        plot(
            p.record,
            job.run_dir / "schedule.png",
            v=p.virtual_stages,
            title=f"{p.schedule}, stage={p.stages}, microbatches={p.microbatches}",
        )
    keep = (
        "communication",
        "memory",
        "compiled_memory",
        "replicated_leaves",
        "peak",
        "pipeline",
        "deterministic",
    )
    return {
        "mesh": plan_report.mesh,
        "checks_ok": plan_report.ok,
        **{k: v for k, v in plan_report.to_json().items() if k in keep},
    }
