import jax
import jax.numpy as jnp
import numpy as np
from beartype import beartype
from jaxtyping import Array, ArrayLike, Float, Real, jaxtyped

from ._fake_quant import RealLike
from ._misc import as_float_input, check_broadcastable, expand_to_rank, is_concrete


@jax.custom_jvp
def _clip_passthrough(x, lo, hi):
    return jnp.clip(x, lo, hi)


@_clip_passthrough.defjvp
def _clip_passthrough_jvp(primals, tangents):
    x, lo, hi = primals
    x_dot, _, _ = tangents
    # The primal output goes through the custom rule again, so that higher derivatives pass through as well.
    return _clip_passthrough(x, lo, hi), x_dot


def _prepare_bound(name: str, bound: object, x: Array) -> Array:
    """`bound` as an array (not yet cast to the dtype of `x`), its type, shape and (when concrete) value checked."""
    if isinstance(bound, (bool, np.bool_)):
        raise TypeError(f"`{name}` must be a real number or array, got {bound!r}.")
    if not isinstance(bound, jax.Array) and np.asarray(bound).dtype.kind in "iu":
        bound = np.asarray(bound, np.float64)  # Python ints beyond int32 are valid bounds
    bound = jnp.asarray(bound)
    if not (jnp.issubdtype(bound.dtype, jnp.floating) or jnp.issubdtype(bound.dtype, jnp.integer)):
        raise TypeError(f"`{name}` must be a real number or array, got dtype {bound.dtype}.")
    check_broadcastable(name, bound.shape, x.shape)
    if is_concrete(bound) and np.isnan(np.asarray(bound, dtype=np.float64)).any():
        raise ValueError(f"`{name}` must not be NaN, got {name}={np.asarray(bound)!r}.")
    return bound


@jaxtyped(typechecker=beartype)
def clip_passthrough(
    x: RealLike, lo: Real[ArrayLike, "*lo_shape"], hi: Real[ArrayLike, "*hi_shape"]
) -> Float[Array, "*shape"]:
    """Clips `x` to `[lo, hi]` in the forward pass, and passes every tangent straight through.

    The primal output is `jnp.clip(x, lo, hi)`. The derivative is the identity for every entry of `x`, whether it is
    below, inside, at or above the bounds; `lo` and `hi` get a zero derivative. It is a `jax.custom_jvp`, so it
    works in forward mode (`jax.jvp`, `jax.jacfwd`), in reverse mode (`jax.grad`, `jax.vjp`, `jax.jacrev`), at higher
    order (`jax.hessian`), and under `jax.vmap` and `jax.jit`.

    Use it for a range constraint that must not stop gradients, e.g. to clip activations to a calibrated range
    while training continues to see every entry.

    **Arguments:**

    - `x`: the array to clip. Floating dtypes are kept; integer and bool inputs are promoted to float32.
    - `lo`, `hi`: the bounds, Python numbers or arrays that broadcast to `x` without changing its shape. They are
        cast to the dtype of `x`. `lo == hi` is allowed (the output is constant; the tangent still passes).

    **Returns:**

    The clipped array, with the shape and dtype of `x`. NaN entries of `x` stay NaN.

    **Raises:**

    `TypeError` for a non-real `x`, `lo` or `hi`; `ValueError` if a bound does not broadcast to `x`, is NaN, or if
    `lo > hi` anywhere. The values are checked only when they are concrete (not inside `jax.jit`).

    !!! example

        ```python
        import jax
        import jax.numpy as jnp
        import eqx_quant

        x = jnp.array([-2.0, 0.5, 3.0])
        y, y_dot = jax.jvp(lambda x: eqx_quant.clip_passthrough(x, 0.0, 1.0), (x,), (jnp.array([2.0, -3.0, 4.0]),))
        print(y)  # [0.  0.5 1. ]
        print(y_dot)  # [ 2. -3.  4.]
        ```
    """
    x = as_float_input("x", x)
    lo = _prepare_bound("lo", lo, x)
    hi = _prepare_bound("hi", hi, x)
    # Compared as given, before the cast to the dtype of `x`, which can make crossed bounds equal (both `inf` in
    # float16, say).
    if is_concrete(lo) and is_concrete(hi):
        lo_np, hi_np = np.broadcast_arrays(np.asarray(lo, np.float64), np.asarray(hi, np.float64))
        if np.any(lo_np > hi_np):
            bad = np.argwhere(lo_np > hi_np)[0]
            raise ValueError(
                f"`lo` must be <= `hi`, got lo={lo_np[tuple(bad)].item()!r} > hi={hi_np[tuple(bad)].item()!r}"
                + (f" at index {tuple(int(i) for i in bad)}." if lo_np.ndim else ".")
            )
    lo, hi = lo.astype(x.dtype), hi.astype(x.dtype)
    with jax.named_scope("eqx_quant.clip_passthrough"):
        return _clip_passthrough(x, expand_to_rank(lo, x.ndim), expand_to_rank(hi, x.ndim))
