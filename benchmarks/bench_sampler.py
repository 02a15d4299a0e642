"""The sampler (``meshkit.models.generate``): tokens/s of a batch of prompts of different lengths, 32
prompts x 128 new tokens, greedy, against transformers' batched ``generate`` on the CPU (issue 50's
goal: at least 2x) and against a hand-written ``jax.jit`` decode loop of the same model on an
accelerator (goal: at least 0.95x). Each part measures both ways in one run and prints their ratio.

The model: a Llama of random weights (``llama.init``, then every weight perturbed by N(0, 0.02²) and
every RMSNorm scale by N(0, 0.1²), so that norms are not all ones and the greedy argmax is not a
near-tie), of a ``--size`` preset: ``small`` (width 256, 4 layers, 8 heads, 4 key/value heads, ffn 768,
vocabulary 2048: 4.2 M parameters), ``medium`` (width 512, 8 layers, 8 heads, 4 kv heads, ffn 1408,
vocabulary 8192: 32 M parameters) or ``1b`` (width 2048, 16 layers, 32 heads, 8 kv heads, ffn 8192,
vocabulary 32000: 1.1 B parameters, for the TPU). The prompts: ``--prompts`` rows of random ids, their
lengths spread evenly over ``--min-prompt`` .. ``--max-prompt`` (16 .. 48), left-padded in a batch.
Tokens/s counts the new tokens (prompts x ``--new``) over the median wall-clock time of ``--repeats``
runs, each run the whole call (prefill, decode, the tokens back on the host); the first run of each way
(compilation, warm-up) is reported apart and not counted.

``--against transformers`` (the CPU; float32): meshkit's ``generate`` against transformers' ``generate``
in the reference environment (``.venv-ref``: a subprocess), which loads the checkpoint ``interop.save``
writes of the same parameters (``--attn``: ``sdpa``, transformers' default, or ``eager``), left-pads the
batch with id 0 and its attention mask, and generates greedily with its dynamic key/value cache
(``do_sample=False``, ``max_new_tokens = min_new_tokens = --new``, no end-of-text id, so every row gets
all its tokens). torch runs on as many threads as there are cores this process may use
(``os.sched_getaffinity``), the cores XLA's CPU thread pool spreads over; ``--cores N`` pins both
processes to N of them first (on a machine whose other cores are busy, torch's OpenMP threads wait on
one another at every operation: measured 100x slower at 2 threads than at 1 beside one busy core). The
two ways' greedy tokens are compared: a row's tokens agree up to its first difference (float32 sums in
another order may turn a near-tie late in a row), the first new token of every row should.

``--against hand`` (the accelerator; the CPU at a small size): meshkit's ``generate`` against a minimal
decode loop of the same parameters, written here: one ``jax.jit`` program that prefills the left-padded
prompts into a preallocated key/value cache per layer (``(B, S, kv_heads, head_dim)``, written with
``lax.dynamic_update_slice``), then ``lax.fori_loop`` over the new tokens, greedy argmax; no length
buckets (``--hand-pad longest``: the prompts padded to the longest, not to meshkit's power of two), no
sampling filters, no log-probabilities, the output head only at the last position. From the llama module
it takes ``llama.embed``, ``llama.head``, ``llama_layers.rms_norm``, ``project_qkv`` (projections and
the rotary), ``mlp``, ``cast_block`` and ``attend`` (grouped-query attention over the cache: the sampler's
measured here differ in what surrounds them, not in the layers). The two ways alternate, run by run, and must
give the same tokens (the count of equal ones is printed).

    .venv/bin/python benchmarks/bench_sampler.py --against transformers [--size medium] [--repeats 3]
    .venv/bin/python benchmarks/bench_sampler.py --against hand --size small        # the CPU
    python benchmarks/bench_sampler.py --against hand --size 1b --dtype bfloat16    # the TPU chip

``--json OUT`` writes the figures. Python 3.11 and JAX 0.10 suffice (the TPU machine's).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from meshkit import interop
from meshkit.models import generate as G
from meshkit.models import llama
from meshkit.models import llama_layers as L

ROOT = Path(__file__).resolve().parents[1]
REF_PYTHON = ROOT / ".venv-ref" / "bin" / "python"
SIZES = {
    "small": {"width": 256, "layers": 4, "heads": 8, "kv_heads": 4, "ffn": 768, "vocab_size": 2048},
    "medium": {"width": 512, "layers": 8, "heads": 8, "kv_heads": 4, "ffn": 1408, "vocab_size": 8192},
    "1b": {"width": 2048, "layers": 16, "heads": 32, "kv_heads": 8, "ffn": 8192, "vocab_size": 32000},
}
TRANSFORMERS = """
import json, sys, time
import torch, transformers
from transformers import AutoModelForCausalLM

job = json.load(open(sys.argv[1]))
torch.set_num_threads(job["threads"])
model = AutoModelForCausalLM.from_pretrained(job["dir"], dtype=torch.float32, attn_implementation=job["attn"])
model.eval()
gen = model.generation_config
gen.eos_token_id, gen.bos_token_id, gen.pad_token_id = None, None, 0  # every row all its new tokens
prompts, new = job["prompts"], job["new"]
longest = max(len(p) for p in prompts)
ids = torch.zeros((len(prompts), longest), dtype=torch.long)
mask = torch.zeros((len(prompts), longest), dtype=torch.long)
for row, p in enumerate(prompts):
    ids[row, longest - len(p):] = torch.tensor(p)
    mask[row, longest - len(p):] = 1


def run(**extra):
    start = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new,
                             do_sample=False, use_cache=True, eos_token_id=None, pad_token_id=0, **extra)
    return out, time.perf_counter() - start


out, first = run(return_dict_in_generate=True)  # warm-up; it names the cache class generate used
tokens, cache = out.sequences[:, longest:].tolist(), type(out.past_key_values).__name__
times = []
for _ in range(job["repeats"]):
    again, t = run()
    assert again[:, longest:].tolist() == tokens, "transformers' greedy tokens changed between runs"
    times.append(t)
json.dump({"tokens": tokens, "first": first, "times": times, "threads": torch.get_num_threads(),
           "interop_threads": torch.get_num_interop_threads(), "attn": model.config._attn_implementation,
           "torch": torch.__version__, "transformers": transformers.__version__, "cache": cache},
          open(job["out"], "w"))
"""
"""transformers' side of ``--against transformers``, run by the reference environment's Python."""


def model(args: argparse.Namespace, dtype: str) -> tuple[llama.LlamaConfig, dict]:
    """The Llama of ``--size`` in ``dtype``, its weights random and perturbed."""
    cfg = llama.LlamaConfig(seq_len=args.max_prompt + args.new, dtype=dtype, **SIZES[args.size])
    params = llama.init(jax.random.key(0), cfg)
    return cfg, perturb(params, jax.random.key(1))


@jax.jit
def perturb(params: dict, key: jax.Array) -> dict:
    """Every weight plus N(0, 0.02²), every RMSNorm scale plus N(0, 0.1²) (computed in float32)."""
    leaves, tree = jax.tree_util.tree_flatten_with_path(params)
    out = []
    for (path, leaf), k in zip(leaves, jax.random.split(key, len(leaves)), strict=True):
        std = 0.1 if getattr(path[-1], "key", None) == "scale" else 0.02
        noise = std * jax.random.normal(k, leaf.shape, jnp.float32)
        out.append((leaf.astype(jnp.float32) + noise).astype(leaf.dtype))
    return jax.tree_util.tree_unflatten(tree, out)


def prompts_of(args: argparse.Namespace, vocab: int) -> list[list[int]]:
    """``--prompts`` rows of random ids (1 .. vocab - 1), their lengths spread over the prompt range."""
    rng = np.random.default_rng(0)
    lengths = np.linspace(args.min_prompt, args.max_prompt, args.prompts).round().astype(int)
    return [rng.integers(1, vocab, n).tolist() for n in lengths]


def agreement(ours: list[list[int]], theirs: list[list[int]]) -> dict:
    """Equal tokens, rows equal throughout, rows whose first new token is equal, and the earliest step
    at which a row differs (None: none does)."""
    a, b = np.asarray(ours), np.asarray(theirs)
    differ = a != b
    firsts = [int(np.argmax(row)) for row in differ if row.any()]
    return {
        "equal": int((~differ).sum()),
        "total": int(a.size),
        "rows_equal": int((~differ.any(1)).sum()),
        "first_token_equal": int((~differ[:, 0]).sum()),
        "earliest_difference": min(firsts) if firsts else None,
    }


def timed(fn, repeats: int) -> tuple[list, float, list[float]]:
    """``fn``'s output, its first run's seconds (compiling) and ``repeats`` more runs' seconds."""
    start = time.perf_counter()
    out = fn()
    first = time.perf_counter() - start
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        again = fn()
        times.append(time.perf_counter() - start)
        assert again == out, "a second run gave other tokens"
    return out, first, times


def header(args: argparse.Namespace, cfg: llama.LlamaConfig, prompts: list[list[int]]) -> dict:
    dev = jax.devices()[0]
    n_params = sum(int(np.prod(a.shape)) for a in jax.tree.leaves(jax.eval_shape(llama.init, jax.random.key(0), cfg)))  # fmt: skip
    info = {
        "jax": jax.__version__,
        "python": platform.python_version(),
        "backend": jax.default_backend(),
        "device_kind": dev.device_kind,
        "devices": jax.device_count(),
        "cores": len(os.sched_getaffinity(0)),
        "size": args.size,
        "params": n_params,
        "dtype": cfg.dtype,
        "prompts": len(prompts),
        "prompt_lengths": [min(map(len, prompts)), max(map(len, prompts))],
        "new": args.new,
        "repeats": args.repeats,
    }
    print(f"jax {jax.__version__} (Python {info['python']}), {jax.device_count()} {jax.default_backend()} "
          f"device(s): {dev.device_kind}; {info['cores']} cores")  # fmt: skip
    print(f"llama '{args.size}': width {cfg.width}, {cfg.layers} layers, {cfg.heads} heads ({cfg.kv_heads} kv), "
          f"ffn {cfg.ffn}, vocab {cfg.vocab_size}: {n_params / 1e6:,.1f} M parameters in {cfg.dtype}; "
          f"{len(prompts)} prompts of {info['prompt_lengths'][0]}..{info['prompt_lengths'][1]} tokens, "
          f"{args.new} new tokens each, greedy; median of {args.repeats} runs")  # fmt: skip
    return info


def against_transformers(args: argparse.Namespace) -> dict:
    if not REF_PYTHON.is_file():
        sys.exit(f"no reference environment at {REF_PYTHON}: run 'make reference' (scripts/reference_env.sh)")
    if args.dtype != "float32":
        sys.exit(
            "--against transformers compares float32 (torch's CPU kernels in bfloat16 are another story)"
        )
    cfg, params = model(args, "float32")
    prompts = prompts_of(args, cfg.vocab_size)
    info = header(args, cfg, prompts)
    n = len(prompts) * args.new
    ours, ours_first, ours_times = timed(lambda: G.generate(params, cfg, prompts, args.new), args.repeats)
    with tempfile.TemporaryDirectory(prefix="bench_sampler.") as tmp:
        interop.save(jax.device_get(params), cfg, Path(tmp) / "hf")
        job = {"dir": str(Path(tmp) / "hf"), "prompts": prompts, "new": args.new, "repeats": args.repeats,
               "threads": info["cores"], "attn": args.attn, "out": str(Path(tmp) / "out.json")}  # fmt: skip
        (Path(tmp) / "job.json").write_text(json.dumps(job))
        (Path(tmp) / "run.py").write_text(TRANSFORMERS)
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_VERBOSITY": "error"}
        env.pop("PYTHONPATH", None)
        done = subprocess.run([str(REF_PYTHON), str(Path(tmp) / "run.py"), str(Path(tmp) / "job.json")],
                              capture_output=True, text=True, env=env)  # fmt: skip
        if done.returncode:
            sys.exit(f"transformers failed:\n{done.stderr[-3000:]}")
        theirs = json.loads((Path(tmp) / "out.json").read_text())
    t_ours, t_theirs = statistics.median(ours_times), statistics.median(theirs["times"])
    agree = agreement(ours, theirs["tokens"])
    ratio = (n / t_ours) / (n / t_theirs)
    print(f"transformers {theirs['transformers']}, torch {theirs['torch']}: attention '{theirs['attn']}', {theirs['cache']}, "
          f"{theirs['threads']} threads ({theirs['interop_threads']} inter-op); XLA's CPU pool over "
          f"{info['cores']} cores")  # fmt: skip
    print("| way | first run (s) | seconds | tokens/s |\n|---|---|---|---|")
    print(f"| meshkit generate | {ours_first:.2f} | {t_ours:.3f} | {n / t_ours:,.0f} |")
    print(f"| transformers generate ({theirs['attn']}) | {theirs['first']:.2f} | {t_theirs:.3f} | {n / t_theirs:,.0f} |")  # fmt: skip
    print(f"meshkit / transformers: {ratio:.2f}x (goal >= 2x)")
    print(f"greedy tokens equal: {agree['equal']} / {agree['total']}; rows equal throughout: "
          f"{agree['rows_equal']} / {len(prompts)}; first new token equal: {agree['first_token_equal']} / "
          f"{len(prompts)}; earliest difference at new token {agree['earliest_difference']}")  # fmt: skip
    return info | {
        "against": "transformers",
        "meshkit": {"first_s": ours_first, "times_s": ours_times, "tokens_per_s": n / t_ours},
        "transformers": {k: v for k, v in theirs.items() if k != "tokens"} | {"tokens_per_s": n / t_theirs},
        "ratio": ratio,
        "agreement": agree,
    }


@functools.partial(jax.jit, static_argnames=("cfg", "new"))
def hand_decode(params, tokens_bp, pad_b, *, cfg: llama.LlamaConfig, new: int):
    """``new`` greedy tokens after each left-padded prompt (row ``b``'s first ``pad[b]`` slots padding):
    a prefill, then a ``fori_loop`` of one-token steps over a preallocated cache per layer."""
    b, prompt = tokens_bp.shape
    total = prompt + new
    top = {k: v for k, v in params.items() if k != "blocks"}
    blocks = [L.cast_block(p, cfg) for p in params["blocks"]]
    slots = jnp.arange(total)
    real = slots[None, None, :] >= pad_b[:, None, None]  # (B, 1, S): a row's padding is never attended

    def forward(tokens_bt, pos_bt, mask_bts, cache, slot):
        x = llama.embed(top, tokens_bt, cfg)
        written = []
        for p, (kc, vc) in zip(blocks, cache, strict=True):
            q, k, v = L.project_qkv(p["attn"], L.rms_norm(p["attn_norm"], x, cfg.norm_eps), pos_bt, cfg)
            kc = lax.dynamic_update_slice(kc, k.astype(kc.dtype), (0, slot, 0, 0))
            vc = lax.dynamic_update_slice(vc, v.astype(vc.dtype), (0, slot, 0, 0))
            b, t = q.shape[:2]
            x = x + L.attend(q, kc, vc, mask_bts).reshape(b, t, cfg.heads * cfg.head_dim) @ p["attn"]["wo"]
            x = x + L.mlp(p["mlp"], L.rms_norm(p["mlp_norm"], x, cfg.norm_eps))
            written.append((kc, vc))
        return llama.head(top, x[:, -1:], cfg)[:, 0], tuple(written)

    shape = (b, total, cfg.kv_heads, cfg.head_dim)
    cache = tuple((jnp.zeros(shape, cfg.compute), jnp.zeros(shape, cfg.compute)) for _ in blocks)
    ahead = jnp.arange(prompt)
    pos = jnp.maximum(ahead[None] - pad_b[:, None], 0)
    logits, cache = forward(tokens_bp, pos, (slots[None, None, :] <= ahead[None, :, None]) & real, cache, 0)
    first = jnp.argmax(logits, -1).astype(jnp.int32)
    out = jnp.zeros((b, new), jnp.int32).at[:, 0].set(first)

    def step(j, carry):
        token, cache, out = carry
        slot = prompt + j
        mask = (slots[None, None, :] <= slot) & real
        logits, cache = forward(token[:, None], (slot - pad_b)[:, None], mask, cache, slot)
        token = jnp.argmax(logits, -1).astype(jnp.int32)
        return token, cache, lax.dynamic_update_slice(out, token[:, None], (0, j + 1))

    return lax.fori_loop(0, new - 1, step, (first, cache, out))[2]


def hand_generate(params, cfg, prompts, new: int, *, pad_to: str) -> list[list[int]]:
    """The hand loop's tokens for ``prompts``, left-padded (id 0) to the longest or to meshkit's bucket."""
    longest = max(len(p) for p in prompts)
    width = G.bucket(longest) if pad_to == "bucket" else longest
    tokens = np.zeros((len(prompts), width), np.int32)
    pad = np.array([width - len(p) for p in prompts], np.int32)
    for row, (p, k) in enumerate(zip(prompts, pad, strict=True)):
        tokens[row, k:] = p
    return np.asarray(hand_decode(params, tokens, pad, cfg=cfg, new=new)).tolist()


def against_hand(args: argparse.Namespace) -> dict:
    if args.size is None:
        args.size = "small" if jax.default_backend() == "cpu" else "1b"
    cfg, params = model(args, args.dtype)
    prompts = prompts_of(args, cfg.vocab_size)
    info = header(args, cfg, prompts)
    n = len(prompts) * args.new
    ways = {
        "meshkit": lambda: G.generate(params, cfg, prompts, args.new),
        "hand": lambda: hand_generate(params, cfg, prompts, args.new, pad_to=args.hand_pad),
    }
    first, out, times = {}, {}, {name: [] for name in ways}
    for name, fn in ways.items():  # compile each
        start = time.perf_counter()
        out[name] = fn()
        first[name] = time.perf_counter() - start
    for _ in range(args.repeats):  # alternating, so that a slower spell of a shared machine hits both
        for name, fn in ways.items():
            start = time.perf_counter()
            again = fn()
            times[name].append(time.perf_counter() - start)
            assert again == out[name], f"a second run of {name} gave other tokens"
    t = {name: statistics.median(v) for name, v in times.items()}
    agree = agreement(out["meshkit"], out["hand"])
    ratio = (n / t["meshkit"]) / (n / t["hand"])
    longest = max(len(p) for p in prompts)
    hand_width = G.bucket(longest) if args.hand_pad == "bucket" else longest
    print(f"meshkit pads the prompts to {G.bucket(longest)} and the new tokens to {G.bucket(args.new, 1)}; "
          f"the hand loop to {hand_width} ({args.hand_pad})")  # fmt: skip
    print("| way | first run (s) | seconds | tokens/s |\n|---|---|---|---|")
    print(f"| meshkit generate | {first['meshkit']:.2f} | {t['meshkit']:.3f} | {n / t['meshkit']:,.0f} |")
    print(f"| hand-written jit loop | {first['hand']:.2f} | {t['hand']:.3f} | {n / t['hand']:,.0f} |")
    print(f"meshkit / hand: {ratio:.3f}x (goal >= 0.95x)")
    print(f"greedy tokens equal: {agree['equal']} / {agree['total']}; rows equal throughout: "
          f"{agree['rows_equal']} / {len(prompts)}; earliest difference at new token {agree['earliest_difference']}")  # fmt: skip
    return info | {
        "against": "hand",
        "hand_pad": args.hand_pad,
        "meshkit": {
            "first_s": first["meshkit"],
            "times_s": times["meshkit"],
            "tokens_per_s": n / t["meshkit"],
        },
        "hand": {"first_s": first["hand"], "times_s": times["hand"], "tokens_per_s": n / t["hand"]},
        "ratio": ratio,
        "agreement": agree,
    }


def main(argv: list[str] | None = None) -> dict:
    """The run (``argv``: the command line's arguments; None: ``sys.argv``); returns the figures."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--against", choices=("transformers", "hand"), required=True)
    ap.add_argument("--size", choices=tuple(SIZES), default=None,
                    help="model preset (default: medium against transformers; against hand small on the CPU, 1b elsewhere)")  # fmt: skip
    ap.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32",
                    help="parameters, cache and compute (--against hand; transformers is float32)")  # fmt: skip
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--min-prompt", type=int, default=16)
    ap.add_argument("--max-prompt", type=int, default=48)
    ap.add_argument("--new", type=int, default=128, help="new tokens per prompt")
    ap.add_argument("--repeats", type=int, default=3, help="timed runs of each way (the median counts)")
    ap.add_argument("--attn", choices=("sdpa", "eager"), default="sdpa", help="transformers' attention")
    ap.add_argument("--hand-pad", choices=("longest", "bucket"), default="longest",
                    help="the hand loop's prompt padding: to the longest prompt, or to meshkit's bucket")  # fmt: skip
    ap.add_argument("--cores", type=int, default=None,
                    help="pin this process and transformers' to this many cores (default: all it may use)")  # fmt: skip
    ap.add_argument("--json", type=Path, default=None, help="write the figures here")
    args = ap.parse_args(argv)
    if args.cores is not None:  # before XLA's CPU pool starts (it spreads over the cores it may use)
        os.sched_setaffinity(0, sorted(os.sched_getaffinity(0))[: args.cores])
    if args.against == "transformers":
        if "JAX_PLATFORMS" not in os.environ:  # the comparison is on the CPU
            jax.config.update("jax_platforms", "cpu")
        args.size = args.size or "medium"
        figures = against_transformers(args)
    else:
        figures = against_hand(args)
    if args.json is not None:
        args.json.write_text(json.dumps(figures, indent=2))
    return figures


if __name__ == "__main__":
    main()
