"""The independent reference: Hugging Face ``transformers`` (torch on CPU), run in its own Python
3.11 environment (``scripts/reference_env.sh``) by ``tests/test_hf_reference.py``.

``python hf_reference.py JOBS.json``: for each job, optionally make a tiny random model of a config
and save it as the Hub does (safetensors shards with an index; with ``config_only``, its config.json
alone, and nothing more for that job), then load the directory with
``AutoModelForCausalLM.from_pretrained`` and write its float32 logits for the job's tokens; a job with
``generate`` (``{"prompt": [ids], "new": n}``) also writes ``generate(do_sample=False)``'s ids, the
prompt's among them, to ``OUT.generated.json``; one with ``auto_dtype`` also loads it with ``dtype="auto"``
and writes its parameters' dtypes to ``OUT.dtype.json``."""

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
            if job.get("config_only"):  # config.json alone, in the form this transformers writes
                config.save_pretrained(job["dir"])
                continue
            model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
            with torch.no_grad():  # norms and biases away from 1 and 0, so a misplaced one shows
                for p in model.parameters():
                    p.add_(0.02 * torch.randn_like(p))
            model.save_pretrained(job["dir"], max_shard_size="20KB", safe_serialization=True)
        model = AutoModelForCausalLM.from_pretrained(
            job["dir"], dtype=torch.float32, attn_implementation="eager"
        )
        model.eval()
        tokens = torch.tensor(np.load(job["tokens"]), dtype=torch.long)
        with torch.no_grad():
            logits = model(tokens).logits.numpy()
        np.save(job["out"], logits)
        if job.get(
            "auto_dtype"
        ):  # the dtype transformers gives the weights when told to keep the checkpoint's
            kept = AutoModelForCausalLM.from_pretrained(job["dir"], dtype="auto")
            with open(job["out"] + ".dtype.json", "w") as f:
                json.dump(sorted({str(p.dtype) for p in kept.parameters()}), f)
        if "generate" in job:  # greedy, with transformers' own cache; eos is None in the job's config
            prompt = torch.tensor([job["generate"]["prompt"]], dtype=torch.long)
            with torch.no_grad():
                out = model.generate(prompt, max_new_tokens=job["generate"]["new"], do_sample=False)
            with open(job["out"] + ".generated.json", "w") as f:
                json.dump(out[0].tolist(), f)
        if "text" in job:  # the export's tokenizer and generation settings, as transformers reads them
            from transformers import AutoTokenizer, GenerationConfig, PreTrainedTokenizerFast

            tok = AutoTokenizer.from_pretrained(job["dir"])
            gen = GenerationConfig.from_pretrained(job["dir"])
            ids = tok(job["text"])["input_ids"]
            with torch.no_grad():
                model(torch.tensor([ids], dtype=torch.long))  # every id inside the embedding
                out = model.generate(torch.tensor([ids], dtype=torch.long), max_new_tokens=4, do_sample=False)
            meta = {
                "ids": ids,
                "class": type(tok).__name__,  # 5.x names the plain tokenizer.json class TokenizersBackend
                "plain": type(tok) is PreTrainedTokenizerFast,
                "eos": gen.eos_token_id,
                "bos": gen.bos_token_id,
                "model_eos": model.generation_config.eos_token_id,
                "generated": out[0].tolist(),
            }
            with open(job["out"] + ".json", "w") as f:
                json.dump(meta, f)
        print(f"{job['dir']}: {type(model).__name__}, logits {logits.shape}", flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
