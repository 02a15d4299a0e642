"""A Flax NNX MLP (BatchNorm, dropout, partition metadata) trained by meshkit under fsdp+tp.

Run: python examples/nnx_mlp.py   (8 simulated CPU devices; about 10 s)
"""

import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

import meshkit

meshkit.simulate_devices(8)  # before any computation: 8 simulated CPU devices


class MLP(nnx.Module):
    def __init__(self, din: int, dhidden: int, dout: int, *, rngs: nnx.Rngs):
        init = nnx.initializers.lecun_normal()
        self.linear1 = nnx.Linear(din, dhidden, use_bias=False, rngs=rngs,
                                  kernel_init=nnx.with_partitioning(init, ("embed", "mlp")))  # fmt: skip
        self.bn = nnx.BatchNorm(dhidden, rngs=rngs)
        self.dropout = nnx.Dropout(0.1, rngs=rngs)
        self.linear2 = nnx.Linear(
            dhidden, dout, rngs=rngs, kernel_init=nnx.with_partitioning(init, ("mlp", "embed"))
        )

    def __call__(self, x):
        return self.linear2(self.dropout(nnx.relu(self.bn(self.linear1(x)))))


def loss_fn(model, batch):
    x, y = batch
    return jnp.mean((model(x) - y) ** 2)


def main(steps: int = 20) -> meshkit.Trainer:
    with nnx.use_eager_sharding(False):  # the metadata is read by meshkit; no mesh needed at init
        model = MLP(8, 32, 4, rngs=nnx.Rngs(0))
    rng = np.random.default_rng(0)
    x = rng.normal(size=(64, 8)).astype(np.float32)
    batch = (x, np.tanh(x @ rng.normal(size=(8, 4))).astype(np.float32))
    trainer = meshkit.Trainer(
        loss_fn, meshkit.from_nnx(model), optax.adamw(1e-2), plan="fsdp+tp", mesh="data=4,model=2"
    )
    for _ in range(steps):
        metrics = trainer.step(batch)
    print(f"loss after {steps} steps: {float(metrics['loss']):.4f}")
    trained = trainer.model()  # an nnx.Module again, with the trained parameters and statistics
    trained.eval()
    print("eval loss:", float(loss_fn(trained, batch)))
    return trainer


if __name__ == "__main__":
    main()
