"""Text generation with a key/value cache, for every family: one prefill of the prompts, then one
decode step per new token, all in one compiled program. The cache and its masks are this module's; a
family's ``decode`` runs its layers, each attending through the cache (``_forward``).

Prompts of different lengths are left-padded to the longest: row ``b`` starts at cache slot
``pad[b]``, its positions (for the rotary embedding) count from there, and its keys before that
slot are masked. The cache holds every layer's keys and values, ``(layers, B, S, kv_heads,
head_dim)`` with ``S`` = longest prompt + new tokens; given ``cache_sharding``, it is laid out
under it (e.g. the key/value heads on the training mesh's ``model`` axis, beside parameters split
by the same rules), else it lives where the parameters do. A layer with a sliding window masks the
keys more than ``window - 1`` slots before its query (the cache keeps every slot; the mask decides,
so one cache serves layers of every window: Mistral's and Qwen2's windows, Gemma's local and global
layers), and Gemma 2's scores are capped as its training forward caps them. A mixture of experts runs
dropless. Sampling: greedy
(``temperature=0``), or temperature with top-k, top-p (nucleus) and min-p filtering; each new token's
log-probability under the model comes with it (``logprobs=True``).

Compiled shapes come in buckets (``bucket``): the prompts are left-padded to a power of two of at
least ``BUCKET_MIN`` tokens and the new tokens rounded up to a power of two (the extra ones dropped), so a prompt
of a length not seen before, or another ``max_new_tokens``, reuses the program of its bucket instead
of compiling one (at most twice the work of the exact shape).

``window_generate`` is the way without a cache (the whole window run again for every token): the GPT's
past its learned positions, where the window slides, the benchmark's baseline, and the check that both
give the same greedy tokens.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from meshkit._errors import MeshkitError
from meshkit.models import llama_layers as L
from meshkit.models import registry


@dataclass(frozen=True, kw_only=True, slots=True)
class Sampling:
    """How the next token is drawn from the logits."""

    temperature: float = 0.0
    """0: greedy (argmax); else logits / temperature."""
    top_k: int = 0
    """Keep the k most likely tokens (0: all)."""
    top_p: float = 1.0
    """Keep the smallest set of most likely tokens whose probability reaches p (1: all)."""
    min_p: float = 0.0
    """Keep the tokens at least ``min_p`` times as likely as the most likely one (0: all; transformers'
    ``min_p``, after the temperature)."""

    def __post_init__(self) -> None:
        if not (self.temperature >= 0 and np.isfinite(self.temperature)):
            raise MeshkitError(f"--temperature must be a finite number of at least 0, got {self.temperature}")
        if self.top_k < 0:
            raise MeshkitError(f"--top-k must be at least 0 (0: every token), got {self.top_k}")
        if not 0 < self.top_p <= 1:
            raise MeshkitError(f"--top-p must be in (0, 1], got {self.top_p}")
        if not 0 <= self.min_p < 1:
            raise MeshkitError(f"--min-p must be in [0, 1), got {self.min_p}")


def sample(logits_bv: jax.Array, key: jax.Array, how: Sampling) -> jax.Array:
    """One token per row from ``(B, V)`` logits."""
    logits = logits_bv.astype(jnp.float32)
    if how.temperature == 0:
        return jnp.argmax(logits, -1).astype(jnp.int32)
    logits = logits / how.temperature
    if how.top_k:
        kth = lax.top_k(logits, min(how.top_k, logits.shape[-1]))[0][:, -1:]
        logits = jnp.where(logits < kth, -jnp.inf, logits)
    if how.top_p < 1:
        order = jnp.argsort(-logits, -1)
        probs = jax.nn.softmax(jnp.take_along_axis(logits, order, -1), -1)
        before = jnp.cumsum(probs, -1) - probs  # probability of the more likely tokens
        keep_sorted = before < how.top_p  # the most likely token is always kept
        keep = jnp.zeros_like(keep_sorted).at[jnp.arange(logits.shape[0])[:, None], order].set(keep_sorted)
        logits = jnp.where(keep, logits, -jnp.inf)
    if how.min_p:  # log p >= log p_max + log min_p, the softmax's normaliser cancelling
        floor = jnp.max(logits, -1, keepdims=True) + np.log(how.min_p)
        logits = jnp.where(logits < floor, -jnp.inf, logits)
    return jax.random.categorical(key, logits, -1).astype(jnp.int32)


def token_logprob(logits_bv: jax.Array, token_b: jax.Array) -> jax.Array:
    """Each row's log-probability of ``token`` under the model: the log-softmax of the logits as they are
    (no temperature, no filter), in at least float32: the trainer's forward log-probability of that
    token (``tests/test_sampler_logprobs.py`` certifies them equal)."""
    logits = logits_bv.astype(jnp.promote_types(logits_bv.dtype, jnp.float32))
    return jnp.take_along_axis(jax.nn.log_softmax(logits, -1), token_b[:, None], -1)[:, 0]


def _kv_heads(cfg: Any) -> int:
    return getattr(cfg, "kv_heads", cfg.heads)  # the GPT: one key/value head per query head


def _forward(params, tokens_bt, pos_bt, mask_bts, cache, slot, cfg):
    """The logits after the last of ``tokens`` (at positions ``pos``), their keys and values written into ``cache`` at
    slots ``slot .. slot + T``, attending over the cache where ``mask`` allows and, in a layer with a
    window, over the last ``window`` slots of each query's (itself among them: transformers' sliding
    window, whose cache keeps ``window - 1`` keys besides the new one). The family's ``decode`` runs the
    layers; each layer's attention is this cache's."""
    ks, vs = cache
    near = slot + jnp.arange(tokens_bt.shape[1])[:, None] - jnp.arange(ks.shape[2])[None, :]  # (T, S): q - k

    def attend(i, q, k, v, window=None, softcap=None, sinks=None):
        nonlocal ks, vs
        # straight into the stacked cache: `ks.at[i].set(update(ks[i]))` doubled a decode step's time on the
        # CPU (benchmarks/bench_sampler.py), a copy of the layer's cache each step
        ks = lax.dynamic_update_slice(ks, k.astype(ks.dtype)[None], (i, 0, slot, 0, 0))
        vs = lax.dynamic_update_slice(vs, v.astype(vs.dtype)[None], (i, 0, slot, 0, 0))
        mask = mask_bts if window is None else mask_bts & (near < window)[None]
        return L.attend(q, ks[i].astype(q.dtype), vs[i].astype(q.dtype), mask, softcap, sinks)

    logits = registry.family_of(cfg).module.decode(params, tokens_bt, pos_bt, attend, cfg)
    return logits, (ks, vs)  # the next token's logits only (a prompt's last)


def _lp_of(logprobs: bool):
    """Each drawn token's log-prob where asked (a log-softmax over the vocabulary every step), else zeros."""
    return token_logprob if logprobs else (lambda logits_bv, token_b: jnp.zeros(token_b.shape, jnp.float32))


def _prefill(params, tokens_bp, pad_b, key, *, cfg, total: int, how: Sampling, cache_sharding, logprobs):
    """Every prompt token at once (causal, a row's padding masked) into a cache of ``total`` slots: the
    first new token of each row, its log-prob, and the cache."""
    b, prompt = tokens_bp.shape
    shape = (cfg.layers, b, total, _kv_heads(cfg), cfg.head_dim)
    compute = cfg.compute_dtype or cfg.dtype
    cache = (jnp.zeros(shape, compute), jnp.zeros(shape, compute))
    if cache_sharding is not None:
        cache = jax.tree.map(lambda c: lax.with_sharding_constraint(c, cache_sharding), cache)
    slots = jnp.arange(total)
    pos = jnp.maximum(jnp.arange(prompt)[None] - pad_b[:, None], 0)
    mask = (slots[None, None, :] <= jnp.arange(prompt)[None, :, None]) & (
        slots[None, None, :] >= pad_b[:, None, None]
    )
    logits, cache = _forward(params, tokens_bp, pos, mask, cache, 0, cfg)
    first = sample(logits[:, -1], jax.random.fold_in(key, 0), how)
    return first, _lp_of(logprobs)(logits[:, -1], first), cache


def _decode(params, token_b, pad_b, cache, slot, key, j, *, cfg, how: Sampling, logprobs):
    """Token ``j + 1`` of each row after its token ``j`` (written at cache ``slot``), and its log-prob."""
    slots = jnp.arange(cache[0].shape[2])
    mask = (slots[None, None, :] <= slot) & (slots[None, None, :] >= pad_b[:, None, None])
    logits, cache = _forward(params, token_b[:, None], (slot - pad_b)[:, None], mask, cache, slot, cfg)
    nxt = sample(logits[:, -1], jax.random.fold_in(key, j + 1), how)
    return nxt, _lp_of(logprobs)(logits[:, -1], nxt), cache


@functools.partial(jax.jit, static_argnames=("cfg", "new", "how", "cache_sharding", "logprobs"))
def _generate(
    params, tokens_bp, pad_b, key, *, cfg, new: int, how: Sampling, cache_sharding=None, logprobs=True
):
    """``new`` tokens of each row in one program: the prefill, then a scan of decode steps."""
    prompt = tokens_bp.shape[1]
    first, first_lp, cache = _prefill(
        params, tokens_bp, pad_b, key, cfg=cfg, total=prompt + new, how=how, cache_sharding=cache_sharding,
        logprobs=logprobs,
    )  # fmt: skip

    def step(carry, j):
        token, lp, cache = carry
        nxt, nxt_lp, cache = _decode(params, token, pad_b, cache, prompt + j, key, j, cfg=cfg, how=how,
                                     logprobs=logprobs)  # fmt: skip
        return (nxt, nxt_lp, cache), (token, lp)

    (last, last_lp, _), (out, lps) = lax.scan(step, (first, first_lp, cache), jnp.arange(new - 1))
    tokens = jnp.concatenate([out.T, last[:, None]], 1)
    return tokens, jnp.concatenate([lps.T, last_lp[:, None]], 1)


_prefill_jit = jax.jit(_prefill, static_argnames=("cfg", "total", "how", "cache_sharding", "logprobs"))
_decode_jit = jax.jit(_decode, static_argnames=("cfg", "how", "logprobs"), donate_argnames=("cache",))


BUCKET_MIN = 16
"""The shortest compiled prompt and new-token length."""


def bucket(n: int, least: int = BUCKET_MIN) -> int:
    """The compiled length for ``n`` tokens: the next power of two, at least ``least``."""
    return max(least, 1 << (max(n, 1) - 1).bit_length())


def _padded(prompts: Sequence[Sequence[int]], vocab: int) -> tuple[np.ndarray, np.ndarray]:
    if not prompts or any(len(p) == 0 for p in prompts):
        raise MeshkitError("every prompt needs at least one token: give non-empty prompts")
    for p in prompts:
        bad = [t for t in p if not 0 <= int(t) < vocab]
        if bad:
            raise MeshkitError(f"prompt token {bad[0]} is outside the model's vocabulary of {vocab}")
    longest = bucket(max(len(p) for p in prompts))
    tokens = np.zeros((len(prompts), longest), np.int32)
    pad = np.array([longest - len(p) for p in prompts], np.int32)
    for row, (p, k) in enumerate(zip(prompts, pad, strict=True)):
        tokens[row, k:] = p
    return tokens, pad


def _checked(
    cfg: Any, prompts: Sequence[Sequence[int]], max_new_tokens: int
) -> tuple[np.ndarray, np.ndarray]:
    """The prompts left-padded to their bucket and each row's padding, once the request is checked."""
    if max_new_tokens < 1:
        raise MeshkitError(f"--max-new-tokens must be at least 1, got {max_new_tokens}")
    tokens, pad = _padded(prompts, cfg.vocab_size)
    longest = max(len(p) for p in prompts)
    if longest + max_new_tokens > cfg.seq_len:
        raise MeshkitError(
            f"--max-new-tokens {max_new_tokens} after a prompt of {longest} tokens passes the model's "
            f"{cfg.seq_len} positions: give at most {max(cfg.seq_len - longest, 0)}"
        )
    return tokens, pad


def generate(
    params: Any,
    cfg: Any,
    prompts: Sequence[Sequence[int]],
    max_new_tokens: int,
    *,
    sampling: Sampling | None = None,
    seed: int = 0,
    cache_sharding: Any = None,
    logprobs: bool = False,
) -> Any:
    """``max_new_tokens`` new tokens for each prompt (lists of token ids), with a key/value cache; with
    ``logprobs``, ``(tokens, logprobs)``: each new token's log-probability under the model
    (``token_logprob``: what the trainer's forward gives it, whatever the sampling). The prompt and its
    new tokens must fit the model's positions (``cfg.seq_len``): the cache is that long at most, and a
    position past them is one the model was never given (``meshkit generate`` bounds
    ``--max-new-tokens`` by them and says so)."""
    tokens, pad = _checked(cfg, prompts, max_new_tokens)
    out, lps = _generate(
        params,
        tokens,
        pad,
        jax.random.key(seed),
        cfg=cfg,
        new=bucket(max_new_tokens, 1),
        how=sampling or Sampling(),
        cache_sharding=cache_sharding,
        logprobs=logprobs,
    )
    tokens = np.asarray(out)[:, :max_new_tokens].tolist()
    return (tokens, np.asarray(lps)[:, :max_new_tokens].tolist()) if logprobs else tokens


def stream(
    params: Any,
    cfg: Any,
    prompts: Sequence[Sequence[int]],
    max_new_tokens: int,
    *,
    sampling: Sampling | None = None,
    seed: int = 0,
    cache_sharding: Any = None,
) -> Iterator[np.ndarray]:
    """``generate``'s tokens one step at a time: each row's next token ``(B,)`` as soon as it is drawn (the
    prefill, then one compiled decode step per token, the host between them); for the same seed, the tokens
    ``generate`` draws. Stop iterating to stop early: a row's stop token or string is the caller's to find
    (``continue_prompts``)."""
    tokens, pad = _checked(cfg, prompts, max_new_tokens)
    how, key, prompt = sampling or Sampling(), jax.random.key(seed), tokens.shape[1]
    pad = jnp.asarray(pad)
    token, _, cache = _prefill_jit(params, tokens, pad, key, cfg=cfg, total=prompt + bucket(max_new_tokens, 1),
                                   how=how, cache_sharding=cache_sharding, logprobs=False)  # fmt: skip
    yield np.asarray(token)
    for j in range(max_new_tokens - 1):
        token, _, cache = _decode_jit(params, token, pad, cache, jnp.int32(prompt + j), key, jnp.int32(j), cfg=cfg,
                                      how=how, logprobs=False)  # fmt: skip
        yield np.asarray(token)


def kv_sharding(mesh: jax.sharding.Mesh, cfg: Any) -> jax.sharding.NamedSharding:
    """The cache under a training mesh's tensor-parallel split: key/value heads on ``model`` where
    they divide over it (as ``tp_rules.WHERE_DIVIDES`` splits ``wk`` and ``wv``), else whole."""
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    m = int(mesh.shape.get("model", 1))
    heads = "model" if m > 1 and _kv_heads(cfg) % m == 0 else None
    return NamedSharding(mesh, P(None, None, None, heads, None))


@functools.partial(jax.jit, static_argnames=("cfg", "how"))
def _next_token(params, window_t, length, key, *, cfg, how: Sampling):
    """The token after the first ``length`` of the window (one program per model and sampling)."""
    logits = registry.family_of(cfg).module.apply(params, window_t[None], cfg)[0]
    return sample(logits[length - 1][None], key, how)[0]


def window_generate(
    params: Any,
    cfg: Any,
    prompt: Sequence[int],
    max_new_tokens: int,
    *,
    sampling: Sampling | None = None,
    seed: int = 0,
    stop: Sequence[int] = (),
    until: Callable[[list[int]], bool] | None = None,
) -> list[int]:
    """New tokens for one prompt without a cache: the last ``seq_len`` tokens run through the whole
    model for every new token (the GPT's learned positions allow no more); it ends early at a token of
    ``stop`` (an end of text), which is not returned, or after a token where ``until(tokens so far)``."""
    how = sampling or Sampling()
    window = np.asarray(list(prompt)[-cfg.seq_len :], np.int32)
    width = cfg.seq_len
    buf = np.zeros(width, np.int32)
    n = len(window)
    buf[:n] = window
    key, out = jax.random.key(seed), []
    for j in range(max_new_tokens):
        tok = int(_next_token(params, jnp.asarray(buf), n, jax.random.fold_in(key, j), cfg=cfg, how=how))
        if tok in stop:
            break
        out.append(tok)
        if until is not None and until(out):
            break
        if n < width:
            buf[n], n = tok, n + 1
        else:
            buf = np.concatenate([buf[1:], [tok]]).astype(np.int32)
    return out


def continue_prompts(
    params: Any,
    cfg: Any,
    prompts: Sequence[Sequence[int]],
    max_new_tokens: int,
    *,
    sampling: Sampling | None = None,
    seed: int = 0,
    stop: Sequence[int] = (),
    until: Callable[[int, list[int]], bool] | None = None,
) -> list[list[int]]:
    """New tokens for each prompt, each ending before its first token of ``stop`` (the ids that end a text,
    as transformers' ``generate`` stops at ``eos_token_id``): batched with a key/value cache where the prompt
    and its new tokens fit the model's positions, else, for a family whose positions end (a learned table:
    the GPT), one prompt at a time over the window of its last ``seq_len`` tokens, the positions sliding.

    ``until(row, tokens)`` is asked after each new token of a row still going, with that row's tokens so
    far: True ends the row there (a stop string found; the caller shows the text as it grows). With it the
    cache runs one step at a time (``stream``) and stops once every row has ended; without it, one compiled
    program draws every token and each row is cut after it."""
    stop = frozenset(stop)
    longest = max((len(p) for p in prompts), default=0)
    if registry.family_of(cfg).learned_positions and longest + max_new_tokens > cfg.seq_len:
        return [
            window_generate(params, cfg, p, max_new_tokens, sampling=sampling, seed=seed, stop=stop,
                            until=None if until is None else functools.partial(until, row))
            for row, p in enumerate(prompts)
        ]  # fmt: skip
    if until is None:
        rows = generate(params, cfg, prompts, max_new_tokens, sampling=sampling, seed=seed)
        return [row[: next((i for i, t in enumerate(row) if t in stop), len(row))] for row in rows]
    rows, going = [[] for _ in prompts], set(range(len(prompts)))
    for drawn in stream(params, cfg, prompts, max_new_tokens, sampling=sampling, seed=seed):
        for row in sorted(going):
            if int(drawn[row]) in stop:
                going.discard(row)
                continue
            rows[row].append(int(drawn[row]))
            if until(row, rows[row]):
                going.discard(row)
        if not going:
            break
    return rows
