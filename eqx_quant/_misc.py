import numbers

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array


FLOAT32_TINY = float(np.finfo(np.float32).tiny)  # the smallest positive normal float32


def check_int(name: str, value: object) -> int:
    """Returns `value` as a Python `int`, or raises a `TypeError` naming `name`.

    Python ints and NumPy integer scalars are accepted; bools are not.
    """
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Integral):
        raise TypeError(f"`{name}` must be an int, got {value!r} of type {type(value).__name__}.")
    return int(value)


def check_real(name: str, value: object) -> float:
    """Returns `value` as a Python `float`, or raises a `TypeError` naming `name`.

    Python and NumPy real scalars are accepted; bools are not.
    """
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Real):
        raise TypeError(f"`{name}` must be a real number, got {value!r} of type {type(value).__name__}.")
    return float(value)


def is_concrete(x: object) -> bool:
    """Whether `x`'s value is known now (it is not a tracer inside `jit`, `vmap`, `grad`, ...)."""
    return not isinstance(x, jax.core.Tracer)


def compute_dtype(dtype: np.dtype) -> np.dtype:
    """The dtype in which a floating `dtype` is quantized: float32 for half precision, else itself."""
    if jnp.finfo(dtype).bits < 32:
        return np.dtype(jnp.float32)
    return np.dtype(dtype)


def as_float_input(name: str, x: object) -> Array:
    """`x` as a JAX array: floating dtypes are kept, integers and bools become float32, others are a `TypeError`."""
    x = jnp.asarray(x)
    if jnp.issubdtype(x.dtype, jnp.floating):
        return x
    if jnp.issubdtype(x.dtype, jnp.integer) or x.dtype == jnp.bool_:
        return x.astype(jnp.float32)
    raise TypeError(f"`{name}` must have a real dtype, got {x.dtype}.")


def check_broadcastable(name: str, shape: tuple[int, ...], x_shape: tuple[int, ...]) -> None:
    """Raises a `ValueError` unless an array of `shape` broadcasts to `x_shape` without changing it."""
    ok = len(shape) <= len(x_shape) and all(
        s in (1, t) for s, t in zip(reversed(shape), reversed(x_shape), strict=False)
    )
    if not ok:
        raise ValueError(f"`{name}` of shape {shape} does not broadcast to the shape of `x`, {x_shape}.")


def expand_to_rank(a: Array, ndim: int) -> Array:
    """Prepends unit axes to `a` so that it has rank `ndim` (explicit, so rank promotion is never needed)."""
    return a.reshape((1,) * (ndim - a.ndim) + a.shape)


def sum_to_shape(a: Array, shape: tuple[int, ...]) -> Array:
    """Sums `a` over the axes along which an array of `shape` was broadcast to `a.shape` (the adjoint of a
    broadcast)."""
    lead = a.ndim - len(shape)
    axes = tuple(range(lead)) + tuple(lead + i for i, s in enumerate(shape) if s == 1 and a.shape[lead + i] != 1)
    return jnp.sum(a, axis=axes).reshape(shape) if axes else a.reshape(shape)


def _varying_axes(a: Array) -> frozenset[str]:
    """The manual mesh axes that `a` varies over inside `jax.shard_map` (empty outside it)."""
    aval = jax.typeof(a)
    manual = getattr(aval, "manual_axis_type", None)  # JAX 0.10
    if manual is not None:
        return frozenset(manual.varying)
    return frozenset(getattr(aval, "vma", ()))  # the same set, under its name in earlier JAX releases


def vary_alike(*arrays: Array | None) -> tuple[Array | None, ...]:
    """`arrays` (`None` entries kept), each marked as varying over every manual mesh axis that any of them varies over.

    Inside `jax.shard_map`, a value that is the same on every device (a replicated scale) and one that differs
    (a shard of `x`) have different types, and a custom derivative rule must return cotangents of its inputs'
    types. Casting the replicated inputs to varying first (`jax.lax.pcast`, whose transpose is a `psum`) makes the
    rule's per-device cotangents correct, and sums them across devices on the way back. Outside `shard_map` this
    returns `arrays` unchanged.
    """
    present = [a for a in arrays if a is not None]
    union = frozenset().union(*(_varying_axes(a) for a in present))
    if not union:
        return arrays

    def cast(a: Array | None) -> Array | None:
        missing = None if a is None else tuple(sorted(union - _varying_axes(a)))
        return jax.lax.pcast(a, missing, to="varying") if missing else a

    return tuple(cast(a) for a in arrays)
