"""Distilled from google/neural-tangents neural_tangents/_src/batching.py (see SOURCES), line 775.

``pmap`` imported from jax, applied to a closure whose array arguments come positionally and by
keyword (pmap maps keyword arguments over axis 0), after each array was broadcast to a leading
device axis; the other arguments are closed over.
"""

import jax.numpy as jnp
from jax import jit, pmap
from jax import tree_util


def kernel_fn(x1, x2, get="nngp", scale=1.0):
    nngp = scale * x1 @ x2.T / x1.shape[-1]
    return {"nngp": nngp, "ntk": 2 * nngp} if get == "both" else nngp


def make_f_pmapped(f, device_count):
    def f_pmapped(x_or_kernel, *args, **kwargs):
        args_np = {i: a for i, a in enumerate(args) if isinstance(a, jnp.ndarray)}
        args_other = {i: a for i, a in enumerate(args) if not isinstance(a, jnp.ndarray)}
        kwargs_np = {k: v for k, v in kwargs.items() if isinstance(v, jnp.ndarray)}
        kwargs_other = {k: v for k, v in kwargs.items() if not isinstance(v, jnp.ndarray)}
        args_np_idxs = list(args_np)

        def _f(_x_or_kernel, *_args_np, **_kwargs_np):
            _args_np = dict(zip(args_np_idxs, _args_np, strict=True))
            _args = {**_args_np, **args_other}
            _args = tuple(v for k, v in sorted(_args.items()))
            _kwargs = {**_kwargs_np, **kwargs_other}
            return f(_x_or_kernel, *_args, **_kwargs)

        _f = jit(_f) if device_count == 0 else pmap(_f)

        def broadcast(arg):
            return jnp.broadcast_to(arg, (device_count,) + arg.shape)

        args_np = tree_util.tree_map(broadcast, list(args_np.values()))
        kwargs_np = tree_util.tree_map(broadcast, kwargs_np)
        return _f(x_or_kernel, *args_np, **kwargs_np)

    return f_pmapped


n = 4
x1 = jnp.arange(n * 3 * 5.0).reshape(n, 3, 5) / 10
x2 = jnp.arange(6 * 5.0).reshape(6, 5) / 10
f = make_f_pmapped(kernel_fn, n)
out_positional = f(x1, x2, "both")
out_keyword = f(x1, x2, get="nngp", scale=jnp.array(0.5))
