"""What a run directory gives out once trained: its model loaded back from the newest checkpoint
(``load_run``), written as a Hugging Face checkpoint (``export_run``: ``meshkit export``, ``meshkit
train --export-hf``), and text generated from it (``generate_text``: ``meshkit generate``)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jax

from meshkit import interop
from meshkit.data import Corpus, DataError, load
from meshkit.models import generate as G
from meshkit.models import gpt, lora, module_of
from meshkit.plans import Trainable
from meshkit.train import config as C
from meshkit.train import optim
from meshkit.train.checkpoint import Checkpointer
from meshkit.train.job import family_params, model_config, run_trainable, saved_config


@dataclass(frozen=True, kw_only=True, slots=True)
class TrainedModel:
    """A run's model: config, parameters on one device, the step they come from, its vocabulary."""

    cfg: C.TrainConfig
    model: Any
    """The model's config (a family's of ``meshkit.models.registry``)."""
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
    data = load(cfg.data)
    model = model_config(cfg, data.vocab_size)
    device = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
    adapters = C.lora_config(cfg)
    shapes = jax.eval_shape(lambda: _adapted(module_of(model).init(jax.random.key(0), model), adapters))
    optimizer = optim.optimizer(cfg)
    if (trainable := run_trainable(cfg)) is not None:  # the optimizer state of the trained leaves alone
        optimizer = Trainable.of(trainable, shapes).optimizer(optimizer)
    opt = jax.eval_shape(optimizer.init, shapes)
    like = jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=device), (shapes, opt))
    with Checkpointer(run_dir / "checkpoints") as ckpt:
        params, _, meta = ckpt.restore(None, *like)
    params = family_params(cfg, params)  # a LoRA run's adapters merged: the family's own parameters
    return TrainedModel(cfg=cfg, model=model, params=params, step=int(meta["step"]), corpus=data)


def _adapted(params: Any, adapters: Any) -> Any:
    return params if adapters is None else lora.add(jax.random.key(0), params, adapters)


def export_run(run_dir: str | Path, out: str | Path, *, max_shard_bytes: int = 2 * 2**30) -> TrainedModel:
    """Write the run's newest checkpoint as a Hugging Face checkpoint into ``out`` (a new directory):
    the loop form in float32, with the run's character vocabulary (``meshkit_vocab.json``)."""
    run = load_run(run_dir)
    model = dataclasses.replace(run.model, compute_dtype=None, scan_layers=False)
    bpe = run.corpus.bpe
    interop.save(gpt.to_form(run.params, False), model, out, max_shard_bytes=max_shard_bytes, vocab=run.vocab,
                 tokenizer_json=None if bpe is None else bpe.to_str(), special=special_tokens(run))  # fmt: skip
    return run


def special_tokens(run: TrainedModel) -> interop.hf.Special | None:
    """The run's end (and beginning) of text: those of the checkpoint it started from (``--init-from``:
    its generation_config.json or config.json), else those its tokenizer was prepared with (``meshkit
    data prepare`` records them); None for character data, which has none."""
    bpe = run.corpus.bpe
    if bpe is None:
        return None
    ids = {"eos_token_id": bpe.eot_id} | ({} if bpe.bos is None else {"bos_token_id": bpe.bos[1]})
    if run.cfg.init_from is not None:
        ids |= interop.hf.read_special(run.cfg.init_from[len(C.HF_PREFIX) :])
    own = {i: t for t, i in filter(None, (bpe.eos, bpe.bos))}

    def name(i: int) -> str | None:  # a special token of the tokenizer, or one it was prepared with
        return bpe.special(i) or own.get(i)

    eos, bos = ids["eos_token_id"], ids.get("bos_token_id")
    if name(eos) is None:  # not a special token of the tokenizer: the text's end is its own
        eos = bpe.eot_id
    bos_token = None if bos is None else name(bos)
    return interop.hf.Special(eos=(name(eos), eos), bos=None if bos_token is None else (bos_token, bos))


def generate_text(
    run: TrainedModel, prompts: list[str], max_new_tokens: int, *, sampling: G.Sampling, seed: int = 0
) -> list[str]:
    """The continuation of each prompt: batched with a key/value cache where the model's family keeps one
    (the Llama), else one prompt at a time over its window (the GPT: its learned positions end at
    ``seq_len``)."""
    try:
        ids = [run.corpus.encode(p).tolist() for p in prompts]
    except DataError as e:
        raise C.ConfigError(f"--prompt: {e}") from None
    out = G.continue_prompts(run.params, run.model, ids, max_new_tokens, sampling=sampling, seed=seed)
    return [run.corpus.decode(row) for row in out]
