"""An Equinox MLP (BatchNorm state, per-example dropout keys) trained by meshkit under zero1 and fsdp+tp.

Run: python examples/equinox_mlp.py   (8 simulated CPU devices; about 10 s)
"""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax

import meshkit

meshkit.simulate_devices(8)  # before any computation: 8 simulated CPU devices


class MLP(eqx.Module):
    linear1: eqx.nn.Linear
    norm: eqx.nn.BatchNorm
    dropout: eqx.nn.Dropout
    linear2: eqx.nn.Linear

    def __init__(self, key):
        k1, k2 = jax.random.split(key)
        self.linear1 = eqx.nn.Linear(8, 32, use_bias=False, key=k1)
        self.norm = eqx.nn.BatchNorm(32, axis_name="batch", mode="batch")
        self.dropout = eqx.nn.Dropout(0.1)
        self.linear2 = eqx.nn.Linear(32, 4, key=k2)

    def __call__(self, x, state, *, key):
        x, state = self.norm(self.linear1(x), state)
        return self.linear2(self.dropout(jax.nn.relu(x), key=key)), state


def loss_fn(model, state, batch, key):
    x, y = batch
    keys = jax.random.split(key, x.shape[0])
    pred, state = jax.vmap(model, axis_name="batch", in_axes=(0, None), out_axes=(0, None))(
        x, state, key=keys
    )
    return jnp.mean((pred - y) ** 2), state


#: Equinox carries no partition metadata: the tensor-parallel split by path (Linear weights are (out, in)).
RULES = [(r"linear1/weight", ("model", None)), (r"linear2/weight", (None, "model"))]


def main(steps: int = 20) -> dict:
    model, state = eqx.nn.make_with_state(MLP)(jax.random.key(0))
    rng = np.random.default_rng(0)
    x = rng.normal(size=(64, 8)).astype(np.float32)
    batch = (x, np.tanh(x @ rng.normal(size=(8, 4))).astype(np.float32))
    out = {}
    for plan, mesh, rules in (("zero1", "data=8", None), ("fsdp+tp", "data=4,model=2", RULES)):
        trainer = meshkit.Trainer(loss_fn, meshkit.from_equinox(model, state), optax.adamw(1e-2),
                                  plan=plan, mesh=mesh, rng=0, rules=rules)  # fmt: skip
        for _ in range(steps):
            metrics = trainer.step(batch)
        print(f"{plan}: loss after {steps} steps {float(metrics['loss']):.4f}")
        out[plan] = trainer
    trained, state = out["fsdp+tp"].model()  # an eqx.Module and its eqx.nn.State
    pred, _ = jax.vmap(
        eqx.nn.inference_mode(trained), axis_name="batch", in_axes=(0, None), out_axes=(0, None)
    )(x, state, key=jax.random.split(jax.random.key(1), len(x)))
    print("eval loss:", float(jnp.mean((pred - batch[1]) ** 2)))
    return out


if __name__ == "__main__":
    main()
