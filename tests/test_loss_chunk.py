"""``--loss-chunk``: the head and the next-token loss computed a piece of the sequence at a time
(``token_loss.head_loss``), never the whole logits. In float64 its loss and gradients equal the whole
form's for every family (the GPT, the Llama with a mixture of experts, the Gemma 2 with its logit cap) to
1e-10, with the batch's weights; under dp, fsdp, tp and fsdp+tp a Trainer's step equals one device's; the
compiled step holds fewer bytes of temporaries; and what cannot chunk is one line."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from _tiers import tiered
from meshkit import Trainer
from meshkit.cli import main
from meshkit.models import gemma, gpt, llama
from meshkit.spec.batch import TokenBatch

MODELS = {
    "gpt": (gpt, gpt.GPTConfig(vocab_size=96, seq_len=16, layers=2, width=32, heads=4, dtype="float64")),
    "llama-moe": (llama, llama.LlamaConfig(vocab_size=96, seq_len=16, layers=2, width=32, heads=4, kv_heads=2, ffn=64,
                                           experts=4, capacity_factor=0.0, dtype="float64")),
    "gemma2": (gemma, gemma.GemmaConfig(vocab_size=96, seq_len=16, layers=2, width=32, heads=4, kv_heads=2, ffn=64,
                                        window=8, local_layers=(True, False), final_softcap=2.0, dtype="float64")),
}  # fmt: skip


PLANS = {"dp": "data=8", "fsdp": "data=8", "tp": "model=8", "fsdp+tp": "data=4,model=2"}


def _batch(vocab, b=4, t=16, weights=True):
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, vocab, (b, t + 1)).astype(np.int32)
    w = rng.uniform(0, 2, (b, t)) * (rng.uniform(size=(b, t)) > 0.3) if weights else None
    return TokenBatch(tokens[:, :-1], tokens[:, 1:], None if w is None else jnp.asarray(w, jnp.float64))


# Tiers: the capped Gemma 2 is core, the Llama with experts (16 s, moved to the sweeps when make test
# measured 16:46) and the GPT sweep: the head and the loss are chunked alike whatever the blocks, and a
# mixture of experts' load-balancing loss beside the chunked cross-entropy trains under fsdp+tp in the core
# case below (the Llama); fsdp+tp (ZeRO-3 over data and the head split over the vocabulary) is core below,
# dp, fsdp (moved when make test measured 22 min: fsdp+tp's split over data alone) and tp sweep.
@pytest.mark.parametrize("name", tiered([(n,) for n in MODELS], MODELS, core={"gemma2"}))
def test_the_chunked_loss_and_its_gradients_equal_the_whole_in_float64(name):
    module, cfg = MODELS[name]
    with jax.enable_x64(True):
        params = module.init(jax.random.key(0), cfg)
        batch = _batch(cfg.vocab_size)
        aux = bool(getattr(cfg, "experts", 0))
        whole = jax.value_and_grad(module.make_loss(cfg, with_aux=aux), has_aux=aux)(params, batch)
        for chunk in (4, 8):
            piece = jax.value_and_grad(module.make_loss(cfg, with_aux=aux, loss_chunk=chunk), has_aux=aux)(
                params, batch
            )
            gaps = jax.tree.map(lambda a, b: float(jnp.max(jnp.abs(a - b))), whole, piece)
            assert max(jax.tree.leaves(gaps)) <= 1e-10, (chunk, gaps)
        assert float(jnp.abs(whole[0][0] if aux else whole[0])) > 1  # a real loss, not a vacuous 0


@pytest.mark.parametrize("plan, mesh", tiered(list(PLANS.items()), PLANS, core={"fsdp+tp"}))
def test_under_each_plan_the_chunked_step_is_one_devices(plan, mesh):
    """The Llama's step with pieces of 4 positions under each plan (its head split over the vocabulary under
    tp) equals the same step on one device, float64."""
    _, cfg = MODELS["llama-moe"]
    cfg = dataclasses.replace(cfg, experts=0)
    with jax.enable_x64(True):
        params = llama.init(jax.random.key(1), cfg)
        batch = _batch(cfg.vocab_size, b=8)
        loss = llama.make_loss(cfg, loss_chunk=4)
        split = Trainer(
            loss, params, optax.sgd(0.5), plan=plan, mesh=mesh, logical_axes=llama.logical_axes(params)
        )
        one = params  # the same two SGD steps on one device, by hand
        for _ in range(2):
            value, grads = jax.value_and_grad(loss)(one, batch)
            one = jax.tree.map(lambda p, g: p - 0.5 * g, one, grads)
            assert abs(float(split.step(batch)["loss"]) - float(value)) <= 1e-10
        gaps = jax.tree.map(
            lambda x, y: float(np.max(np.abs(np.asarray(x) - np.asarray(y)))), one, split.params
        )
        assert max(jax.tree.leaves(gaps)) <= 1e-10


def test_the_compiled_step_holds_fewer_bytes_with_pieces():
    """At a vocabulary of 8192 the whole logits of 4 x 256 positions are the step's largest temporaries; in
    pieces of 32 positions the compiled step's temporaries are at most half (XLA:CPU's memory analysis)."""
    cfg = llama.LlamaConfig(vocab_size=8192, seq_len=256, layers=1, width=64, heads=4, ffn=128)
    params = jax.eval_shape(lambda: llama.init(jax.random.key(0), cfg))
    batch = TokenBatch(*(jax.ShapeDtypeStruct((4, 256), jnp.int32),) * 2)

    def temp(chunk):
        step = jax.jit(jax.grad(llama.make_loss(cfg, loss_chunk=chunk)))
        return step.lower(params, batch).compile().memory_analysis().temp_size_in_bytes

    whole, pieces = temp(0), temp(32)
    assert whole > 4 * 256 * 8192 * 4  # the float32 logits at least
    assert pieces <= whole / 2, (whole, pieces)


@pytest.mark.parametrize(
    "args, said",
    [(["--loss-chunk", "5"], "--loss-chunk 5 must divide --seq-len 32"),
     (["--loss-chunk", "8", "--plan", "dp+pp"], "last stage takes the loss of whole logits"),
     (["--loss-chunk", "8", "--plan", "dp+cp"], "splits over the context axis")],
)  # fmt: skip
def test_what_cannot_chunk_is_one_line(args, said, tmp_path, capsys):
    assert main(["train", "--preset", "tiny", "--seq-len", "32", "--steps", "1", *args,
                 "--run-dir", str(tmp_path / "r")]) == 2  # fmt: skip
    err = capsys.readouterr().err
    assert said in err and err.count("\n") == 1, err
    assert not (tmp_path / "r").exists()
