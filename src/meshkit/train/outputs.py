"""What a run directory gives out once trained: its model loaded back from the newest checkpoint
(``load_run``), written as a Hugging Face checkpoint (``export_run``: ``meshkit export``, ``meshkit
train --export-hf``), and text generated from it (``generate_text``: ``meshkit generate``)."""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jax

from meshkit import interop
from meshkit.data import Corpus, DataError, load
from meshkit.data.readers import lone_surrogate, surrogate_said
from meshkit.models import generate as G
from meshkit.models import gpt, lora, registry
from meshkit.models.family import Family
from meshkit.plans import Trainable
from meshkit.train import config as C
from meshkit.train import optim
from meshkit.train.checkpoint import Checkpointer
from meshkit.train.job import family_params, model_config, run_trainable, saved_config


@dataclass(frozen=True, kw_only=True, slots=True)
class TrainedModel:
    """A run's model: config, parameters on one device, the step they come from, its vocabulary."""

    cfg: C.TrainConfig
    family: Family
    """The run's model family (``--model``), resolved once from its name."""
    model: Any
    """The model's config (the family's config class)."""
    params: Any
    step: int
    corpus: Corpus
    """The run's data: how text becomes its ids and back."""

    @property
    def vocab(self) -> tuple[str, ...] | None:
        """The character vocabulary (text data), or None (token shards, bare ids)."""
        return self.corpus.chars


def load_run(run_dir: str | Path) -> TrainedModel:
    """The newest readable checkpoint of ``run_dir`` on this process's first device."""
    run_dir = Path(run_dir)
    cfg = saved_config(run_dir)
    data = load(cfg.data.data)
    family = registry.family(cfg.model.model)
    model = model_config(cfg, family, data.vocab_size)
    device = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
    adapters = C.lora_config(cfg)
    shapes = jax.eval_shape(lambda: _adapted(family.module.init(jax.random.key(0), model), adapters))
    optimizer = optim.optimizer(cfg)
    if (trainable := run_trainable(cfg)) is not None:  # the optimizer state of the trained leaves alone
        optimizer = Trainable.of(trainable, shapes).optimizer(optimizer)
    opt = jax.eval_shape(optimizer.init, shapes)
    like = jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=device), (shapes, opt))
    with Checkpointer(run_dir / "checkpoints") as ckpt:
        params, _, meta = ckpt.restore(None, *like)
    params = family_params(cfg, params)  # a LoRA run's adapters merged: the family's own parameters
    return TrainedModel(
        cfg=cfg, family=family, model=model, params=params, step=int(meta["step"]), corpus=data
    )


def _adapted(params: Any, adapters: Any) -> Any:
    return params if adapters is None else lora.add(jax.random.key(0), params, adapters)


def export_run(run_dir: str | Path, out: str | Path, *, max_shard_bytes: int = 2 * 2**30) -> TrainedModel:
    """Write the run's newest checkpoint as a Hugging Face checkpoint into ``out`` (a new directory):
    the loop form in float32, with the run's character vocabulary (``meshkit_vocab.json``), the ids and
    generation settings of the checkpoint it started from (``special_tokens``) and, beside a tokenizer, the
    chat template it trained with (``_chat_template``) and the padding and unknown tokens it names."""
    run = load_run(run_dir)
    model = dataclasses.replace(run.model, compute_dtype=None, scan_layers=False)
    bpe, special = run.corpus.bpe, special_tokens(run)
    if bpe is not None:  # what a tokenizer beside the weights needs besides its ends
        special = dataclasses.replace(special, named=_named(run, bpe), chat_template=_chat_template(run))
    interop.save(
        gpt.to_form(run.params, False),
        model,
        out,
        max_shard_bytes=max_shard_bytes,
        vocab=run.vocab,
        tokenizer_json=None if bpe is None else bpe.to_str(),
        special=special,
    )
    return run


def _started_from(run: TrainedModel, *, required: bool) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """The ids (``read_special``) and generation_config.json of the checkpoint the run started from
    (``--init-from``); none without one. Where that checkpoint is gone, ``required`` refuses: an export
    without them would stop where transformers' defaults say (a Llama's eos 2, a Qwen's never)."""
    if run.cfg.model.init_from is None:
        return {}, None
    where = Path(run.cfg.model.init_from[len(C.HF_PREFIX) :])
    if not where.is_dir():
        if required:
            raise interop.InteropError(
                f"the checkpoint this run started from ('{where}', --init-from) is gone: its bos/eos/pad ids and "
                f"generation_config.json cannot be carried into the export; put it back there"
            )
        return {}, None
    return interop.hf.read_special(where), interop.hf.read_generation(where)


def special_tokens(run: TrainedModel, *, required: bool = True) -> interop.hf.Special | None:
    """The run's end, beginning of text and padding, and generation settings: those of the checkpoint it
    started from (``--init-from``: its generation_config.json, else config.json; eos as the list it may
    be), where a tokenizer runs, those of them that are its special tokens, else those the tokenizer was
    prepared with (``meshkit data prepare`` records them); None for a run from scratch on characters or
    bare ids, which has none. ``required``: see ``_started_from``."""
    theirs, generation = _started_from(run, required=required)
    bpe = run.corpus.bpe
    eos = theirs.get("eos_token_id")
    eos = [] if eos is None else eos if isinstance(eos, list) else [eos]
    if bpe is None:  # no tokenizer to name them: the checkpoint's ids as they are
        if not theirs and generation is None:
            return None
        bos, pad = theirs.get("bos_token_id"), theirs.get("pad_token_id")
        return interop.hf.Special(
            eos=(None, eos[0]) if eos else None,
            more_eos=tuple(eos[1:]),
            pad=pad,
            bos=None if bos is None else (None, bos),
            generation=generation,
        )
    own = {i: t for t, i in filter(None, (bpe.eos, bpe.bos))}

    def name(i: int | None) -> str | None:  # a special token of the tokenizer, or one it was prepared with
        return None if i is None else bpe.special(i) or own.get(i)

    # ids that are no special token of the tokenizer (a config's defaults) are not taken for its ends
    eos = [i for i in eos if name(i) is not None] or [bpe.eot_id]
    bos = theirs.get("bos_token_id", None if bpe.bos is None else bpe.bos[1])
    pad = theirs.get("pad_token_id")
    return interop.hf.Special(
        eos=(name(eos[0]), eos[0]),
        more_eos=tuple(eos[1:]),
        generation=generation,
        bos=None if name(bos) is None else (name(bos), bos),
        pad=pad if name(pad) is not None else None,
    )


def _chat_template(run: TrainedModel) -> str | None:
    """The chat template the run's model speaks: the one its conversations were prepared with (every source
    of a mixture the same; none for plain prompt/completion rows), else that of the checkpoint it started
    from; None where there is neither."""
    from meshkit.data.mixture import parse

    if run.corpus.chat:
        found = {_template_in(path) for path, _ in parse(run.cfg.data.data)}
        return found.pop() if len(found) == 1 else None
    return (
        None if run.cfg.model.init_from is None else _template_in(run.cfg.model.init_from[len(C.HF_PREFIX) :])
    )


def _template_in(directory: str) -> str | None:
    from meshkit.data.chat_template import load_template

    try:
        return load_template(directory).source
    except DataError:  # none there: plain rows, a base model
        return None


def _named(run: TrainedModel, bpe: Any) -> dict[str, str]:
    """The padding and unknown tokens (``CARRIED``) the checkpoint the run started from names, else those
    its data's tokenizer named (``meshkit data prepare`` keeps them), where they are tokens of the run's."""
    from meshkit.data.mixture import parse
    from meshkit.data.prepare import carried_tokens

    init = run.cfg.model.init_from
    where = (
        Path(init[len(C.HF_PREFIX) :])
        if init
        else Path(parse(run.cfg.data.data)[0][0])
        if run.cfg.data.data
        else None
    )
    return {} if where is None else carried_tokens(bpe, where)


def generate_text(
    run: TrainedModel,
    prompts: list[str],
    max_new_tokens: int,
    *,
    sampling: G.Sampling,
    seed: int = 0,
    stop_strings: Sequence[str] = (),
    show: Callable[[int, str], None] | None = None,
) -> list[str]:
    """The continuation of each prompt, up to its end of text (the tokenizer's, and those of the checkpoint
    the run started from) or before the first of ``stop_strings`` it contains: batched with a key/value
    cache, or, for a GPT continued past its learned positions, one prompt at a time over its window of
    ``seq_len`` tokens (``continue_prompts``). ``show(row, text)`` is given each row's text as it grows
    (``settled``: what no later token can change). New tokens are bounded by the model's positions, and a
    continuation past what the run trained on (``--seq-len``) is said in one ``warning:`` line: the model
    never saw such positions."""
    if (bad := lone_surrogate(prompts, "--prompt")) is not None:  # bytes no UTF-8 decodes come as these
        raise C.ConfigError(surrogate_said(*bad))
    if any(s == "" for s in stop_strings):
        raise C.ConfigError(
            "--stop '': an empty stop string would end every text before it starts: give text"
        )
    try:
        ids = [run.corpus.encode(p).tolist() for p in prompts]
    except DataError as e:
        raise C.ConfigError(f"--prompt: {e}") from None
    new = _bounded(run, max((len(i) for i in ids), default=0), max_new_tokens)
    special = special_tokens(run, required=False)
    stop = {run.corpus.bpe.eot_id} if run.corpus.bpe is not None else set()
    stop |= set(special.eos_ids) if special is not None else set()
    until = None
    if stop_strings or show is not None:

        def until(row: int, tokens: list[int]) -> bool:
            text = run.corpus.decode(tokens)
            cut = stop_at(text, stop_strings)
            if show is not None:
                show(row, text[:cut] if cut is not None else settled(text, stop_strings))
            return cut is not None

    out = G.continue_prompts(
        run.params, run.model, ids, new, sampling=sampling, seed=seed, stop=stop, until=until
    )
    texts = [run.corpus.decode(row) for row in out]
    return [t[: stop_at(t, stop_strings)] for t in texts]


def stop_at(text: str, stop_strings: Sequence[str]) -> int | None:
    """Where ``text`` is cut: before the earliest of ``stop_strings`` in it (the stop string not kept, as
    vLLM and OpenAI's API return), or None."""
    found = [i for i in (text.find(s) for s in stop_strings) if i >= 0]
    return min(found) if found else None


def settled(text: str, stop_strings: Sequence[str]) -> str:
    """What of a growing ``text`` later tokens cannot change: without a trailing replacement character (a
    character whose UTF-8 bytes have not all come) and the longest end that could begin a stop string."""
    text = text.rstrip("\ufffd")
    held = max((n for s in stop_strings for n in range(1, len(s)) if text.endswith(s[:n])), default=0)
    return text[: len(text) - held]


def _bounded(run: TrainedModel, longest: int, max_new_tokens: int) -> int:
    """``--max-new-tokens`` as the model can run it. Where positions are computed (a rotary) they grow with
    every token: the prompt and its new tokens must fit the model's positions (a cache as long as asked
    would allocate beyond any memory: a billion tokens, 971 GB), so fewer are generated, and said. Past a
    learned table's positions the window slides and they end at the window's length."""
    positions, trained = run.model.seq_len, run.cfg.data.seq_len
    kv = not run.family.learned_positions
    if kv and longest >= positions:
        raise C.ConfigError(
            f"--prompt of {longest} tokens fills the model's {positions} positions: give a shorter prompt"
        )
    new = min(max_new_tokens, positions - longest) if kv else max_new_tokens
    if new < max_new_tokens:
        _warn(
            f"--max-new-tokens {max_new_tokens}: the model has {positions} positions and the prompt takes "
            f"{longest}; generating {new}"
        )
    reach = longest + new if kv else min(longest + new, positions)
    if reach > trained:
        _warn(
            f"the prompt and its new tokens reach position {reach}, past the {trained} the run trained on "
            f"(--seq-len {trained}): the model never saw such positions"
        )
    return new


def _warn(line: str) -> None:
    sys.stderr.write(f"warning: {line}\n")
