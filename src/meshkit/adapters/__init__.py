"""Flax NNX, Flax linen and Equinox models as ``Trainer`` inputs (the frameworks are optional).

``from_nnx(model)``, ``from_linen(module, variables)`` and ``from_equinox(model)`` return an
``Adapted``: the trainable parameters (floating arrays, as a plain pytree), the model's other
state (BatchNorm statistics, RNG keys and counts, other non-float arrays: carried through the
step, never differentiated, updated where the model updates them), the logical axes read from
Flax partition metadata (``nnx.with_partitioning``, ``nn.with_logical_partitioning``), and the
glue that rebuilds the framework's model inside the loss. Pass it to ``Trainer`` as ``params``::

    model = meshkit.from_nnx(MLP(rngs=nnx.Rngs(0)))
    trainer = meshkit.Trainer(loss_fn, model, optax.adamw(1e-3), plan="fsdp+tp")
    # loss_fn(model, batch) -> loss, with the NNX (linen: a callable; Equinox: eqx) model

Inside a plan's manual data region each device sees only its rows of the batch; batch statistics
(BatchNorm) are then averaged over the data axis, so they are those of the whole global batch,
as on one device.
"""

from meshkit.adapters._common import Adapted
from meshkit.adapters._equinox import from_equinox
from meshkit.adapters._linen import from_linen
from meshkit.adapters._nnx import from_nnx

__all__ = ["Adapted", "from_equinox", "from_linen", "from_nnx"]
