"""The independent reference for the preference losses: Hugging Face TRL (``trl==0.25.1``, torch on CPU)
in the Python 3.11 environment ``.venv-ref`` (``scripts/reference_env.sh``), run by
``tests/test_dpo_reference.py``.

``python trl_preference.py JOBS.json``: JOBS.json is a list of jobs, each

    {"policy": HF_DIR, "reference": HF_DIR, "batch": NPZ, "loss_type": "sigmoid" | "ipo" | "simpo",
     "beta": float, "label_smoothing": float, "gamma": float (simpo only), "out": JSON_PATH}

For each job both checkpoints are loaded with ``AutoModelForCausalLM.from_pretrained`` (float32, eager
attention, eval mode; TRL's ``disable_dropout`` on too), TRL's own trainer is built (``DPOTrainer`` with
``ref_model=reference`` for sigmoid and ipo; ``CPOTrainer`` with ``loss_type="simpo"``, ``cpo_alpha=0``,
``simpo_gamma=gamma`` for simpo, which has no reference model: ``reference`` is not loaded then), the
batch goes through that trainer's own data collator, and the loss and metrics of that one batch are
TRL's ``trainer.get_batch_loss_metrics(model, batch, train_eval="train")``. ``out`` gets

    {"loss": float, "metrics": {"rewards/chosen": ..., "rewards/rejected": ..., "rewards/margins": ...,
     "rewards/accuracies": ..., "logps/chosen": ..., "logps/rejected": ..., "logits/chosen": ...,
     "logits/rejected": ..., ("nll_loss": ... for simpo)},
     "per_pair": {"chosen_logps": [P], "rejected_logps": [P], "losses": [P], "chosen_rewards": [P],
                  "rejected_rewards": [P], ("ref_chosen_logps", "ref_rejected_logps": [P] for DPO)},
     "trl": version, "trainer": class name, "loss_type", "beta", "label_smoothing", ("gamma")}

``metrics`` is exactly the dict TRL returns (batch means); ``per_pair`` is the same quantities per pair from
TRL's own ``concatenated_forward`` and ``dpo_loss`` / ``cpo_loss`` (for IPO and SimPO the logps are TRL's
length-normalised ones, the mean log-prob per completion token).

The NPZ holds P pairs of already tokenised ids (any integer dtype), no tokenizer involved:

    prompt         (P, Lp)  LEFT-padded: each row is zeros of prompt_mask, then the prompt's tokens
    prompt_mask    (P, Lp)  0/1: [0 ... 0 1 ... 1], at least one 1 (the last prompt token predicts the
                            first completion token)
    chosen         (P, Lc)  RIGHT-padded: the chosen completion's tokens, then padding
    chosen_mask    (P, Lc)  0/1: [1 ... 1 0 ... 0], at least one 1
    rejected       (P, Lr)  RIGHT-padded, as chosen
    rejected_mask  (P, Lr)  0/1, as chosen_mask

which is the layout of TRL's ``DataCollatorForPreference`` (prompts padded on the left, completions on the
right). The ids under a 0 of a mask are never read. The script takes each row's unpadded tokens and gives
them to the trainer's own collator (``DataCollatorForPreference`` for DPO; ``DPODataCollatorWithPadding``
on prompt+completion rows with ``-100`` labels over the prompt for CPO, as ``CPOTrainer.tokenize_row``
makes them), so TRL sees what its training loop would. Nothing is added: no BOS before the prompt, no EOS
after a completion (TRL's tokenisation would add them; include them in the ids if they are wanted), and
no truncation (DPO ``max_length=None``; CPO's lengths apply to its tokenisation only, bypassed here). In
both trainers the model sees each sequence as prompt then completion from position 0 (DPO ``flush_left``s
the left padding away), and a completion's log-prob is the sum (IPO, SimPO: the mean) of the log-probs of
its tokens alone, each predicted from the token before it."""

import os
import sys
import tempfile

os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import datasets
import numpy as np
import torch
import trl
from _trl import load, rows, run_jobs  # beside this script: python puts its folder first on sys.path
from datasets import Dataset
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast
from trl import CPOConfig, CPOTrainer, DPOConfig, DPOTrainer


def _tokenizer(vocab_size: int) -> PreTrainedTokenizerFast:
    """A word-level tokenizer over ``t0 .. t{V-1}``: the trainers need one (pad id 0) and tokenise a dummy
    dataset with it at construction; the batch itself is given as ids."""
    vocab = {f"t{i}": i for i in range(vocab_size)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="t0", unk_token="t0", bos_token="t1", eos_token="t2"
    )


def _common_args(job: dict, out_dir: str) -> dict:
    return dict(
        output_dir=out_dir,
        report_to="none",
        use_cpu=True,
        bf16=False,  # TRL's configs default to bf16 (mixed precision), which would autocast on CPU
        fp16=False,
        gradient_checkpointing=False,
        per_device_train_batch_size=1,
        disable_dropout=True,
        beta=float(job["beta"]),
        label_smoothing=float(job.get("label_smoothing", 0.0)),
        dataset_num_proc=None,
        save_strategy="no",
        logging_strategy="no",
    )


def _floats(t) -> list[float]:
    return [float(x) for x in t.detach().reshape(-1).tolist()]


def run(job: dict) -> dict:
    z = np.load(job["batch"])
    prompts = rows(z["prompt"], z["prompt_mask"], "left", "prompt")
    chosen = rows(z["chosen"], z["chosen_mask"], "right", "chosen")
    rejected = rows(z["rejected"], z["rejected_mask"], "right", "rejected")
    loss_type = job["loss_type"]
    policy = load(job["policy"])
    tokenizer = _tokenizer(policy.config.vocab_size)
    dummy = Dataset.from_dict({"prompt": ["t3 t4"], "chosen": [" t5"], "rejected": [" t6"]})
    result = {"trl": trl.__version__, "loss_type": loss_type, "beta": float(job["beta"]),
              "label_smoothing": float(job.get("label_smoothing", 0.0))}  # fmt: skip
    with tempfile.TemporaryDirectory() as tmp:
        if loss_type in ("sigmoid", "ipo"):
            args = DPOConfig(
                **_common_args(job, tmp),
                loss_type=loss_type,
                max_length=None,
                max_prompt_length=None,
                max_completion_length=None,
                precompute_ref_log_probs=False,
                use_logits_to_keep=False,
                padding_free=False,
            )
            trainer = DPOTrainer(
                model=policy, ref_model=load(job["reference"]), args=args, train_dataset=dummy,
                processing_class=tokenizer,
            )  # fmt: skip
            features = [
                {"prompt_input_ids": p, "chosen_input_ids": c, "rejected_input_ids": r}
                for p, c, r in zip(prompts, chosen, rejected, strict=True)
            ]
        elif loss_type == "simpo":
            longest = max(
                len(p) + max(len(c), len(r)) for p, c, r in zip(prompts, chosen, rejected, strict=True)
            )
            args = CPOConfig(
                **_common_args(job, tmp),
                loss_type="simpo",
                cpo_alpha=0.0,
                simpo_gamma=float(job["gamma"]),
                max_length=longest + 2,
                max_prompt_length=longest + 1,
                remove_unused_columns=False,  # what CPOTrainer sets (with a warning) for its collator
            )
            trainer = CPOTrainer(model=policy, args=args, train_dataset=dummy, processing_class=tokenizer)
            result["gamma"] = float(job["gamma"])
            features = []
            for p, c, r in zip(prompts, chosen, rejected, strict=True):  # CPOTrainer.tokenize_row's keys
                features.append({
                    "chosen_input_ids": p + c, "chosen_attention_mask": [1] * (len(p) + len(c)),
                    "chosen_labels": [args.label_pad_token_id] * len(p) + c,
                    "rejected_input_ids": p + r, "rejected_attention_mask": [1] * (len(p) + len(r)),
                    "rejected_labels": [args.label_pad_token_id] * len(p) + r,
                    "prompt_input_ids": p, "prompt_attention_mask": [1] * len(p),
                })  # fmt: skip
        else:
            raise ValueError(f"loss_type {loss_type!r}: give sigmoid, ipo or simpo")
        result["trainer"] = type(trainer).__name__
        batch = trainer.data_collator(features)
        model = trainer.model.eval()
        with torch.no_grad():
            loss, metrics = trainer.get_batch_loss_metrics(model, batch, train_eval="train")
            if loss_type == "simpo":
                chosen_logps, rejected_logps = trainer.concatenated_forward(model, batch)[:2]
                losses, chosen_rewards, rejected_rewards = trainer.cpo_loss(chosen_logps, rejected_logps)
                per_pair = {}
            else:
                out = trainer.concatenated_forward(model, batch)
                chosen_logps, rejected_logps = out["chosen_logps"], out["rejected_logps"]
                ref_chosen, ref_rejected = trainer.compute_ref_log_probs(batch)
                losses, chosen_rewards, rejected_rewards = trainer.dpo_loss(
                    chosen_logps, rejected_logps, ref_chosen, ref_rejected, loss_type, out
                )
                per_pair = {
                    "ref_chosen_logps": _floats(ref_chosen),
                    "ref_rejected_logps": _floats(ref_rejected),
                }
    per_pair.update(
        chosen_logps=_floats(chosen_logps),
        rejected_logps=_floats(rejected_logps),
        losses=_floats(losses),
        chosen_rewards=_floats(chosen_rewards),
        rejected_rewards=_floats(rejected_rewards),
    )
    result.update(loss=float(loss), metrics={k: float(v) for k, v in metrics.items()}, per_pair=per_pair)
    return result


def main(path: str) -> None:
    datasets.disable_progress_bar()  # the dummy dataset's maps
    run_jobs(
        path, run, lambda job, r: f"{job['out']}: {r['trainer']} {job['loss_type']} loss {r['loss']:.6g}"
    )


if __name__ == "__main__":
    main(sys.argv[1])
