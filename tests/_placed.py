"""Parameters placed as fsdp+tp's rules place them on ``data=4,model=2``, for the sampler's tests (the
cache's key/value heads on ``model`` beside them): one copy of the placement those tests share."""

import jax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from meshkit.mesh import make_mesh

TP_RULES = {"heads": "model", "kv_heads": "model", "mlp": "model", "vocab": "model"}
"""The tensor-parallel rules: heads, the MLP's hidden width and the vocabulary on ``model``."""


def tp_placed(params, logical_axes) -> tuple:
    """``(mesh, params)``: the mesh ``data=4,model=2`` (the model axis XLA's, as the Trainer's) and
    ``params`` put on it, each leaf split by ``TP_RULES`` over its logical axes."""
    mesh = make_mesh("data=4,model=2", axis_types="auto")
    shardings = jax.tree.map(lambda names: NamedSharding(mesh, P(*[TP_RULES.get(n) for n in names])),
                             logical_axes, is_leaf=lambda x: isinstance(x, tuple))  # fmt: skip
    return mesh, jax.device_put(params, shardings)
