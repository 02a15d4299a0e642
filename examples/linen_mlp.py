"""A Flax linen MLP (BatchNorm, dropout, logical partitioning) trained by meshkit under zero3 and dp+tp.

Run: python examples/linen_mlp.py   (8 simulated CPU devices; about 10 s)
"""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax

import meshkit

meshkit.simulate_devices(8)  # before any computation: 8 simulated CPU devices


class MLP(nn.Module):
    hidden: int = 32

    @nn.compact
    def __call__(self, x, train: bool = True):
        init = nn.initializers.lecun_normal()
        x = nn.Dense(
            self.hidden, use_bias=False, kernel_init=nn.with_logical_partitioning(init, ("embed", "mlp"))
        )(x)
        x = nn.BatchNorm(use_running_average=not train)(x)
        x = nn.Dropout(0.1, deterministic=not train)(nn.relu(x))
        return nn.Dense(4, kernel_init=nn.with_logical_partitioning(init, ("mlp", "embed")))(x)


def loss_fn(model, batch, key):
    # `model(...)` is module.apply with the step's params and batch_stats (mutable) and rngs={"dropout": key}
    x, y = batch
    return jnp.mean((model(x, train=True) - y) ** 2), {"mean_abs_y": jnp.mean(jnp.abs(y))}


def main(steps: int = 20) -> dict:
    module = MLP()
    rng = np.random.default_rng(0)
    x = rng.normal(size=(64, 8)).astype(np.float32)
    batch = (x, np.tanh(x @ rng.normal(size=(8, 4))).astype(np.float32))
    variables = module.init(jax.random.key(0), x[:1], train=False)
    out = {}
    for plan, mesh in (("zero3", "data=8"), ("dp+tp", "data=4,model=2")):
        trainer = meshkit.Trainer(loss_fn, meshkit.from_linen(module, variables), optax.adamw(1e-2),
                                  plan=plan, mesh=mesh, rng=0, has_aux=True)  # fmt: skip
        for _ in range(steps):
            metrics = trainer.step(batch)
        print(
            f"{plan}: loss after {steps} steps {float(metrics['loss']):.4f}, aux {float(metrics['mean_abs_y']):.4f}"
        )
        out[plan] = trainer
    trained = out["zero3"].model()  # {"params": ..., "batch_stats": ...}, ready for module.apply
    pred = module.apply(trained, x, train=False)
    print("eval loss:", float(jnp.mean((pred - batch[1]) ** 2)))
    return out


if __name__ == "__main__":
    main()
