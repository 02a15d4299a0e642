"""The independent reference for the GRPO loss: Hugging Face TRL (``trl==0.25.1``, torch on CPU) in the
Python 3.11 environment ``.venv-ref`` (``scripts/reference_env.sh``).

``python trl_grpo.py JOBS.json``: JOBS.json is a list of jobs, each

    {"policy": HF_DIR, "reference": HF_DIR | null, "batch": NPZ, "out": JSON_PATH,
     "beta": float, "epsilon": float, "epsilon_high": float | null,
     "loss_type": "grpo" | "bnpo" | "dr_grpo" | "dapo", "scale_rewards": "group" | "batch" | "none" | bool,
     "num_generations": G, "max_completion_length": int,
     optional (TRL's defaults): "temperature": 1.0, "delta": null, "importance_sampling_level": "token",
     "top_entropy_quantile": 1.0, "mask_truncated_completions": false, "eos_token_id": 2,
     "vllm_importance_sampling_correction": false, "vllm_importance_sampling_cap": 2.0}

For each job the policy (and, when ``beta != 0``, the reference: ``reference``, or the policy's checkpoint
again when it is null, which is what TRL itself loads) is loaded with ``AutoModelForCausalLM`` (float32, eager
attention, dropout off), TRL's own ``GRPOTrainer`` is built on it (``GRPOConfig`` with the job's values,
``bf16=False``, ``use_cpu``, ``per_device_train_batch_size = N`` so the whole batch is one step with no
gradient accumulation), and one training step's loss is computed by TRL's own code with generation alone
replaced: ``_generate_single_turn`` (the one place that samples) is patched to hand back the batch's ids,
so ``_generate`` logs the completion lengths and counts the tokens (DAPO's normaliser),
``_generate_and_score_completions`` pads, computes the reference log-probs, calls the reward function (which
returns the NPZ's ``rewards`` row by row) and turns the rewards into advantages, and ``compute_loss`` gives
the loss. When the NPZ has ``old_logps`` they replace ``inputs["old_per_token_logps"]`` (TRL's
``num_iterations > 1`` case, ratios ``exp(logp - old)``); without them TRL uses ``per_token_logps.detach()``
(ratio 1). The model is in train mode (dropout is off) so the metrics are TRL's ``train`` ones. ``out`` gets

    {"loss": float, "advantages": [N], "metrics": {every key TRL logs for the step: "reward", "reward_std",
     "frac_reward_zero_std", "rewards/given_reward/mean", "rewards/given_reward/std", "entropy",
     "clip_ratio/low_mean", "clip_ratio/low_min", "clip_ratio/high_mean", "clip_ratio/high_max",
     "clip_ratio/region_mean", "completions/mean_length", ..., "num_tokens", ("kl" when beta != 0),
     ("sampling/..." with the vLLM correction)},
     "per_token_logps": [N][Lc] (policy, the values compute_loss used), "entropies": [N][Lc],
     "completion_mask": [N][Lc] (as TRL used it: mask_truncated_completions may zero rows),
     ("ref_per_token_logps": [N][Lc] when beta != 0), ("old_per_token_logps": [N][Lc] when TRL had them),
     ("importance_sampling_ratio": [N][Lc] with the vLLM correction),
     "num_items_in_batch": int, "trl": version, "job": the job's settings}

Per-token values are on the NPZ's (N, Lc) grid; positions under a 0 of ``completion_mask`` are 0.0 and
mean nothing.

The NPZ holds N = prompts x G rows of already tokenised ids (any integer dtype), the G completions of each
prompt consecutive (TRL's ``RepeatSampler`` order; a group's prompt rows must be equal):

    prompt           (N, Lp)  LEFT-padded: zeros of prompt_mask, then the prompt's tokens
    prompt_mask      (N, Lp)  0/1: [0 ... 0 1 ... 1], at least one 1
    completion       (N, Lc)  RIGHT-padded: the completion's tokens, then padding
    completion_mask  (N, Lc)  0/1: [1 ... 1 0 ... 0], at least one 1
    rewards          (N,)     float: the summed reward of each completion (TRL casts it to float32)
    old_logps        (N, Lc)  optional float: the per-token log-probs of the completion under the policy
                              that sampled it (values under a 0 of completion_mask are ignored)
    sampling_logps   (N, Lc)  only with "vllm_importance_sampling_correction": the sampler's (vLLM's)
                              log-probs; TRL recomputes old_per_token_logps with the model and multiplies
                              the clipped token loss by min(exp(old - sampling), cap)

TRL re-pads the unpadded rows itself (pad id 0; prompts left, completions right) and the model sees
``[prompt | completion]`` with position ids 0.. over the padded row (left padding shifts a row's positions,
which RoPE's relative positions ignore up to rounding). The completion token t is predicted from the logits
at the position before it, divided by ``temperature``. The tokenizer is a word-level one over ``t0 ..
t{V-1}`` (pad ``t0``, EOS ``t{eos_token_id}``), needed to build the trainer and to decode the completions
TRL hands to the reward function; EOS matters only to ``completions/clipped_ratio`` and friends and to
``mask_truncated_completions`` (a completion is "truncated" when its last token is neither EOS nor pad)."""

import os
import sys
import tempfile

os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import numpy as np
import torch
import trl
from _trl import load, rows, run_jobs  # beside this script: python puts its folder first on sys.path
from datasets import Dataset
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast
from trl import GRPOConfig, GRPOTrainer
from trl.trainer.utils import disable_dropout_in_model


def _tokenizer(vocab_size: int, eos_id: int) -> PreTrainedTokenizerFast:
    vocab = {f"t{i}": i for i in range(vocab_size)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="t0", unk_token="t0", bos_token="t1", eos_token=f"t{eos_id}"
    )


def given_reward(prompts, completions, reward, **kwargs) -> list[float]:
    """The reward function: the batch's own rewards, which TRL passes back as the ``reward`` column."""
    return list(reward)


def _grid(t, n: int, width: int) -> list[list[float]]:
    """A (N, <=width) tensor padded on the right with 0.0 to the NPZ's width."""
    a = np.zeros((n, width), dtype=np.float64)
    v = t.detach().double().numpy()
    a[:, : v.shape[1]] = v
    return a.tolist()


def run(job: dict) -> dict:
    z = np.load(job["batch"])
    prompts = rows(z["prompt"], z["prompt_mask"], "left", "prompt")
    completions = rows(z["completion"], z["completion_mask"], "right", "completion")
    rewards = [float(r) for r in np.asarray(z["rewards"], dtype=np.float64).reshape(-1)]
    n, width = z["completion"].shape
    g = int(job["num_generations"])
    if n % g or len(rewards) != n:
        raise ValueError(f"{n} rows, {len(rewards)} rewards: want a multiple of num_generations={g}")
    for i in range(n):
        if prompts[i] != prompts[i - i % g]:
            raise ValueError(f"row {i}'s prompt differs from its group's first ({i - i % g})")
    max_len = int(job["max_completion_length"])
    if max(len(c) for c in completions) > max_len:
        raise ValueError(f"a completion is longer than max_completion_length={max_len}")
    beta = float(job["beta"])
    vllm_is = bool(job.get("vllm_importance_sampling_correction", False))
    settings = dict(
        beta=beta,
        epsilon=float(job["epsilon"]),
        epsilon_high=None if job.get("epsilon_high") is None else float(job["epsilon_high"]),
        loss_type=job["loss_type"],
        scale_rewards=job["scale_rewards"],
        num_generations=g,
        max_completion_length=max_len,
        temperature=float(job.get("temperature", 1.0)),
        delta=None if job.get("delta") is None else float(job["delta"]),
        importance_sampling_level=job.get("importance_sampling_level", "token"),
        top_entropy_quantile=float(job.get("top_entropy_quantile", 1.0)),
        mask_truncated_completions=bool(job.get("mask_truncated_completions", False)),
        vllm_importance_sampling_correction=vllm_is,
        vllm_importance_sampling_cap=float(job.get("vllm_importance_sampling_cap", 2.0)),
    )
    sampling = None
    if vllm_is:
        sampling = [row[: len(c)] for row, c in zip(z["sampling_logps"].tolist(), completions, strict=True)]

    policy = load(job["policy"])
    eos_id = int(job.get("eos_token_id", 2))
    tokenizer = _tokenizer(policy.config.vocab_size, eos_id)
    dummy = Dataset.from_dict({"prompt": ["t3 t4"], "reward": [0.0]})
    with tempfile.TemporaryDirectory() as tmp:
        args = GRPOConfig(
            output_dir=tmp,
            report_to="none",
            use_cpu=True,
            bf16=False,  # GRPOConfig's bf16=None means True (mixed precision) unless fp16
            fp16=False,
            gradient_checkpointing=False,  # GRPOConfig defaults to True
            disable_dropout=True,
            per_device_train_batch_size=n,
            per_device_eval_batch_size=n,
            gradient_accumulation_steps=1,
            num_iterations=1,
            max_prompt_length=None,
            save_strategy="no",
            logging_strategy="no",
            **settings,
        )
        trainer = GRPOTrainer(
            model=policy,
            reward_funcs=given_reward,
            args=args,
            train_dataset=dummy,
            processing_class=tokenizer,
        )
        if beta != 0.0:  # TRL loaded the policy's checkpoint again (its defaults): use the job's reference
            ref = load(job.get("reference") or job["policy"])
            disable_dropout_in_model(ref)
            trainer.ref_model = trainer.accelerator.prepare_model(ref, evaluation_mode=True)
        if vllm_is:  # vLLM itself is not needed: generation is replaced below
            trainer.use_vllm = True

        def generate_single_turn(prompt_texts):  # what sampling would have returned
            return prompts, completions, sampling, {}

        trainer._generate_single_turn = generate_single_turn
        trainer.current_gradient_accumulation_steps = 1  # set by Trainer's training loop
        model = trainer.model.train()  # TRL's "train" mode; dropout is off
        features = [
            {"prompt": " ".join(f"t{t}" for t in p), "reward": r}
            for p, r in zip(prompts, rewards, strict=True)
        ]
        with torch.no_grad():
            inputs = trainer._generate_and_score_completions(features)
            if "old_logps" in z.files:
                old = torch.tensor(np.asarray(z["old_logps"], dtype=np.float32))
                old = old[:, : inputs["completion_ids"].shape[1]] * inputs["completion_mask"].bool()
                inputs["old_per_token_logps"] = old
            seen = {}
            get_logps = trainer._get_per_token_logps_and_entropies

            def capture(*a, **k):  # the policy's per-token log-probs and entropies that compute_loss uses
                seen["logps"], seen["entropies"] = get_logps(*a, **k)
                return seen["logps"], seen["entropies"]

            trainer._get_per_token_logps_and_entropies = capture
            loss = trainer.compute_loss(model, inputs)
            trainer._get_per_token_logps_and_entropies = get_logps
    metrics = {k: sum(v) / len(v) for k, v in trainer._metrics["train"].items()}  # what GRPOTrainer.log does
    mask = inputs["completion_mask"]
    result = {
        "loss": float(loss),
        "advantages": [float(a) for a in inputs["advantages"].tolist()],
        "metrics": {k: float(v) for k, v in metrics.items()},
        "per_token_logps": _grid(seen["logps"] * mask, n, width),
        "entropies": _grid(seen["entropies"] * mask, n, width),
        "completion_mask": _grid(mask, n, width),
        "num_items_in_batch": int(inputs["num_items_in_batch"]),
        "trl": trl.__version__,
        "job": {**settings, "eos_token_id": eos_id, "old_logps": "old_logps" in z.files},
    }
    for key in ("ref_per_token_logps", "old_per_token_logps", "importance_sampling_ratio"):
        if key in inputs:
            result[key] = _grid(inputs[key] * mask, n, width)
    return result


def main(path: str) -> None:
    run_jobs(
        path,
        run,
        lambda job, r: f"{job['out']}: GRPO {job['loss_type']} beta {job['beta']} loss {r['loss']:.6g}",
    )


if __name__ == "__main__":
    main(sys.argv[1])
