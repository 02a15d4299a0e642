"""Generation: tokens per second with the key/value cache against running the whole window again for
every token (``window_generate``, what ``meshkit train``'s end-of-run sample does), at 256 new tokens.

A Llama of width 256, 4 layers, 8 heads (4 key/value heads), vocabulary 256, on one CPU device; a
prompt of 32 tokens, greedy (``--model gemma``: a Gemma 2 of the same sizes, local and global layers
alternating with a window of 64, soft caps; ``--positions``: the model's positions, which the window pads
to, as a checkpoint's ``max_position_embeddings``). Each way runs once to compile, then ``--repeats``
times; the median wall-clock time gives tokens/s. The ways must produce the same tokens (checked): the
cache in one program, the cache one step at a time (``generate.stream``, what streaming and stop strings
run), and the whole window per token.

Then the time to the first token (one new token) for a prompt of a length seen before and for one of
a length not seen (27 and 29 tokens after 32: the same bucket of compiled lengths), side by side:
the ratio unseen / seen is the price of a new length (issue 39's goal: within 2x).

    .venv/bin/python benchmarks/bench_generate.py [--model llama|gemma] [--new 256] [--repeats 3] [--batch 1]
        [--positions N]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")
import jax
import numpy as np

from meshkit.models import gemma, llama
from meshkit.models import generate as G


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--new", type=int, default=256)
    ap.add_argument("--prompt", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--batch", type=int, default=1, help="prompts decoded together by the cache")
    ap.add_argument("--model", choices=("llama", "gemma"), default="llama")
    ap.add_argument("--positions", type=int, default=0, help="the model's positions (0: prompt + new)")
    args = ap.parse_args()
    sizes = dict(vocab_size=256, seq_len=args.positions or args.prompt + args.new, layers=4, width=256, heads=8,
                 kv_heads=4, ffn=768)  # fmt: skip
    if args.model == "gemma":
        cfg = gemma.GemmaConfig(**sizes, window=64, local_layers=(True, False) * 2, attn_softcap=50.0,
                                final_softcap=30.0, qk_norm=False)  # fmt: skip
    else:
        cfg = llama.LlamaConfig(**sizes)
    params = (gemma if args.model == "gemma" else llama).init(jax.random.key(0), cfg)
    prompt = np.random.default_rng(0).integers(0, cfg.vocab_size, args.prompt).tolist()
    prompts = [prompt] * args.batch

    def timed(fn):
        first = fn()  # compile
        times = []
        for _ in range(args.repeats):
            start = time.perf_counter()
            out = fn()
            times.append(time.perf_counter() - start)
        assert out == first
        return out, statistics.median(times)

    cached, t_cache = timed(lambda: G.generate(params, cfg, prompts, args.new))
    stepped, t_step = timed(lambda: np.stack(list(G.stream(params, cfg, prompts, args.new)), 1).tolist())
    window, t_window = timed(lambda: G.window_generate(params, cfg, prompt, args.new))
    assert cached[0] == window, "the cache and the window disagree on the greedy tokens"
    assert stepped == cached, "the cache one step at a time and in one program disagree"
    n = args.new * args.batch
    print(f"{args.model} width {cfg.width}, {cfg.layers} layers, {cfg.heads} heads ({cfg.kv_heads} kv), vocab "
          f"{cfg.vocab_size}, {cfg.seq_len} positions; prompt {args.prompt}, {args.new} new tokens, "
          f"{jax.device_count()} {jax.default_backend()} device(s)")  # fmt: skip
    print("| way | batch | seconds | tokens/s |\n|---|---|---|---|")
    print(f"| key/value cache | {args.batch} | {t_cache:.3f} | {n / t_cache:,.0f} |")
    print(f"| key/value cache, one step at a time | {args.batch} | {t_step:.3f} | {n / t_step:,.0f} |")
    print(f"| whole window per token | 1 | {t_window:.3f} | {args.new / t_window:,.0f} |")
    print(f"speed-up of the cache: {(n / t_cache) / (args.new / t_window):.1f}x (same greedy tokens)")
    first_token(params, cfg, prompt)


def first_token(params, cfg, prompt) -> None:
    """Seconds to one new token for a seen prompt length and for two unseen ones."""

    def once(p):
        start = time.perf_counter()
        G.generate(params, cfg, [p], 1)
        return time.perf_counter() - start

    once(prompt)  # the seen length, compiled
    seen = statistics.median(once(prompt) for _ in range(3))
    unseen = [once(prompt[: len(prompt) - k]) for k in (5, 3)]  # lengths never generated from before
    print("| prompt | first token (s) |\n|---|---|")
    print(f"| seen length {len(prompt)} | {seen:.4f} |")
    for k, t in zip((5, 3), unseen, strict=True):
        print(f"| unseen length {len(prompt) - k} | {t:.4f} |")
    print(f"time to first token, unseen / seen length: {max(unseen) / seen:.2f}x (goal <= 2x)")


if __name__ == "__main__":
    main()
