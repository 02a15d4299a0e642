"""The independent reference: Hugging Face ``transformers`` (torch on CPU), run in its own Python
3.11 environment (``scripts/reference_env.sh``) by ``tests/test_hf_reference.py``.

``python hf_reference.py JOBS.json``: for each job, optionally make a tiny random model of a config
and save it as the Hub does (safetensors shards with an index), then load the directory with
``AutoModelForCausalLM.from_pretrained`` and write its float32 logits for the job's tokens."""

import json
import sys

import numpy as np
import torch
from transformers import AutoConfig, AutoModelForCausalLM


def main(path: str) -> None:
    torch.manual_seed(0)
    with open(path) as f:
        jobs = json.load(f)
    for job in jobs:
        if "make" in job:
            config = AutoConfig.for_model(**job["make"])
            model = AutoModelForCausalLM.from_config(config, torch_dtype=torch.float32)
            with torch.no_grad():  # norms and biases away from 1 and 0, so a misplaced one shows
                for p in model.parameters():
                    p.add_(0.02 * torch.randn_like(p))
            model.save_pretrained(job["dir"], max_shard_size="20KB", safe_serialization=True)
        model = AutoModelForCausalLM.from_pretrained(
            job["dir"], torch_dtype=torch.float32, attn_implementation="eager"
        )
        model.eval()
        tokens = torch.tensor(np.load(job["tokens"]), dtype=torch.long)
        with torch.no_grad():
            logits = model(tokens).logits.numpy()
        np.save(job["out"], logits)
        print(f"{job['dir']}: {type(model).__name__}, logits {logits.shape}", flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
