import functools
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from beartype import beartype
from jaxtyping import Array, ArrayLike, Bool, Float, Float32, Real, jaxtyped

from ._format import (
    E4M3,
    NVFP4,
    NVFP4_BLOCK,
    Format,
    IntFormat,
    apply_scale,
    as_format,
    check_range,
    exponent,
    float_format,
    mx_format,
    pow2,
    reciprocal,
)
from ._layout import Layout
from ._misc import (
    FLOAT32_TINY,
    as_float_input,
    check_broadcastable,
    check_int,
    compute_dtype,
    expand_to_rank,
    first_where,
    is_concrete,
    is_zero_tangent,
    sum_to_shape,
    vary_alike,
)
from ._scales import Scales, fit_scales


RealLike = Real[ArrayLike, "*shape"] | Bool[ArrayLike, "*shape"]


#
# The single numerical path of every format. Every quantity that depends on `x / scale` is computed as
# `x * (1 / scale)`, with the reciprocal taken on the (small) scale array in the compute dtype. XLA rewrites a division
# by a broadcast operand into exactly this product, but a division by a full-size operand it leaves alone; writing the
# product ourselves means eager, `jit`, `vmap`, per-tensor and per-channel calls, and the stored codes all round the
# same way.
#


def quantize_levels(x: Array, scales: Scales, fmt: Format) -> Array:
    """The grid points of `x` under `scales` (plus the zero point, for integers), as floats of the compute dtype."""
    v = x * reciprocal(fmt, scales.scale, scales.tensor_scale, x.ndim)
    return fmt.levels(v, scales.zero_point)


def dequantize_levels(levels: Array, scales: Scales, fmt: Format) -> Array:
    """`scale * (levels - zero_point)`: the inverse map from grid points to the real line."""
    if scales.zero_point is not None:
        levels = levels - expand_to_rank(scales.zero_point, levels.ndim)
    return apply_scale(fmt, levels, scales.scale, scales.tensor_scale)


def _fake_quant_impl(x, scale, zero_point, tensor_scale, fmt):
    scales = Scales(scale, zero_point, tensor_scale)
    return dequantize_levels(quantize_levels(x, scales, fmt), scales, fmt)


# The derivatives of every quantizer are a JVP rule (so forward mode works: `jax.jvp`, `jax.jacfwd`, `jax.hessian`);
# reverse mode transposes it. The rule is written so that its transpose computes, operation for operation and in the
# same order, the clipped straight-through estimator and learned-step-size gradient that `fake_quant` documents: each
# mask is a `select` of the cotangent after it is multiplied (so a NaN cotangent outside the mask gives an exact zero,
# no `-0.0` appears where the estimator gives `0.0`, and no product is contracted with the sum over the scale's
# entries into a fused multiply-add, which would round differently).
_fake_quant = jax.custom_jvp(_fake_quant_impl, nondiff_argnums=(4,))


def _straight_through_impl(x, scale, zero_point, tensor_scale, fmt):
    del scale, zero_point, tensor_scale, fmt
    return x


# `x` itself, with `fake_quant`'s derivatives: for the integer products, which compute their value from the integers
# and need of the fake-quantized operand only its tangent's path through the straight-through estimator (and the
# scale's). Nothing of the fake-quantized value is traced.
_straight_through = jax.custom_jvp(_straight_through_impl, nondiff_argnums=(4,))


def _fake_quant_tangent(fmt, x, scale, zero_point, tensor_scale, dx, d_scale, d_zero_point, d_tensor_scale):
    """The tangent of `fake_quant` at `x`: `dx` where `x / scale` lies in the grid, the learned-step-size terms of
    the scales' tangents, the zero point's outside the grid. Tangents that are `None` are zero."""
    ndim = x.ndim
    v = x * reciprocal(fmt, scale, tensor_scale, ndim)
    low, high = fmt.limits(zero_point, ndim)
    inside = (v >= low) & (v <= high)  # False for NaN (as `v < low` and `v > high` are below)
    zero = jnp.zeros((), x.dtype)
    terms = []
    if dx is not None:
        terms.append(jax.lax.select(inside, dx, jnp.zeros_like(dx)))
    if d_scale is not None or d_tensor_scale is not None:
        below, above = v < low, v > high
        low_end, high_end = fmt.ends(zero_point, ndim)
        slope = jnp.where(inside, fmt.nearest(v) - v, jnp.where(below, low_end, jnp.where(above, high_end, zero)))
        # The tangent of the scale that multiplies the levels (`scale * tensor_scale` for two-level scales). A part
        # multiplied by the other scale is broadcast to `x` first (by adding zeros), so that its transpose sums the
        # products as the estimator does, and not the sum times the scale. NaN entries of `x` contribute nothing to
        # the scale, even where their cotangent is NaN too.
        nan = jnp.isnan(v)
        parts = []
        for d, other in ((d_scale, tensor_scale), (d_tensor_scale, scale)):
            if d is not None:
                d = expand_to_rank(d, ndim)
                if other is not None:
                    d = (d + jnp.zeros_like(x)) * expand_to_rank(other, ndim)
                parts.append(jnp.where(nan, zero, d))
        terms.append(functools.reduce(jnp.add, parts) * slope)
    if d_zero_point is not None:
        outside = (v < low) | (v > high)
        terms.append(jnp.where(outside, expand_to_rank(d_zero_point, ndim), zero) * -expand_to_rank(scale, ndim))
    return functools.reduce(jnp.add, terms)


def _derivative_rule(op):
    """The JVP rule of `op` (`_fake_quant` or `_straight_through`): its value, and `fake_quant`'s tangent. The
    tangent is recomputed from `x` and the scales in the backward pass (`jax.checkpoint`): nothing full-size is
    saved for reverse mode besides `x` itself."""

    def rule(fmt, primals, tangents):
        x, scale, zero_point, tensor_scale = primals
        tangents = tuple(None if is_zero_tangent(t) else t for t in tangents)
        if all(t is None for t in tangents):
            return op(x, scale, zero_point, tensor_scale, fmt), jnp.zeros_like(x)
        tangent = jax.checkpoint(functools.partial(_fake_quant_tangent, fmt))
        return op(x, scale, zero_point, tensor_scale, fmt), tangent(x, scale, zero_point, tensor_scale, *tangents)

    return rule


_fake_quant.defjvp(_derivative_rule(_fake_quant), symbolic_zeros=True)
_straight_through.defjvp(_derivative_rule(_straight_through), symbolic_zeros=True)


# `fake_quant` itself is a `jax.custom_vjp` (reverse mode only), with this backward rule: the same gradients, bit for
# bit, as the transpose of the JVP rule above computes (tested).
_fake_quant_vjp = jax.custom_vjp(_fake_quant_impl, nondiff_argnums=(4,))


def _fake_quant_fwd(x, scale, zero_point, tensor_scale, fmt):
    # Called with `CustomVJPPrimal`s: `perturbed` says which inputs carry a derivative. A dynamic quantizer's scales
    # carry none (they are `stop_gradient`-ed statistics), and their cotangents are then not computed. The backward
    # recomputes everything it needs from `x`, so nothing full-size is saved besides `x` itself.
    value = _fake_quant_impl(x.value, scale.value, _value(zero_point), _value(tensor_scale), fmt)
    wanted = tuple(() if p is not None and p.perturbed else None for p in (scale, zero_point, tensor_scale))
    return value, (x.value, scale.value, _value(zero_point), _value(tensor_scale), wanted)


def _value(primal):
    return None if primal is None else primal.value


def _fake_quant_bwd(fmt, residuals, g):
    x, scale, zero_point, tensor_scale, (scale_wanted, zero_point_wanted, tensor_scale_wanted) = residuals
    if isinstance(g, jax.custom_derivatives.SymbolicZero):
        g = jnp.zeros(g.shape, g.dtype)
    v = x * reciprocal(fmt, scale, tensor_scale, x.ndim)
    low, high = fmt.limits(zero_point, x.ndim)
    inside = (v >= low) & (v <= high)  # False for NaN (as `v < low` and `v > high` are below)
    zero = jnp.zeros((), g.dtype)
    grad_x = jnp.where(inside, g, zero)
    grad_scale = grad_zero_point = grad_tensor_scale = None
    if scale_wanted is not None or tensor_scale_wanted is not None:
        below, above = v < low, v > high
        low_end, high_end = fmt.ends(zero_point, x.ndim)
        d_scale = jnp.where(inside, fmt.nearest(v) - v, jnp.where(below, low_end, jnp.where(above, high_end, zero)))
        # NaN entries of `x` contribute nothing to the scale, even where their incoming gradient is NaN too.
        d = jnp.where(jnp.isnan(v), zero, g * d_scale)  # the derivative towards the scale that multiplies the levels
        if tensor_scale is None:
            grad_scale = sum_to_shape(d, scale.shape)
        else:  # that scale is `scale * tensor_scale`
            grad_scale = sum_to_shape(d * expand_to_rank(tensor_scale, d.ndim), scale.shape)
            grad_tensor_scale = sum_to_shape(d * expand_to_rank(scale, d.ndim), tensor_scale.shape)
    if zero_point_wanted is not None:
        d_zp = jnp.where((v < low) | (v > high), -expand_to_rank(scale, x.ndim) * g, zero)
        grad_zero_point = sum_to_shape(d_zp, zero_point.shape)
    return grad_x, grad_scale, grad_zero_point, grad_tensor_scale


_fake_quant_vjp.defvjp(_fake_quant_fwd, _fake_quant_bwd, symbolic_zeros=True)


# Compiled as one program even in eager calls: a dozen small operations, each compiled on its own otherwise.
_fake_quant_jit = jax.jit(_fake_quant, static_argnums=(4,))
_fake_quant_vjp_jit = jax.jit(_fake_quant_vjp, static_argnums=(4,))
_straight_through_jit = jax.jit(_straight_through, static_argnums=(4,))


def fake_quant_scales(x: Array, scales: Scales, fmt: Format, *, value: bool = True) -> Array:
    """`x` fake-quantized with `scales` (broadcasting against it) onto `fmt`: the computation of every quantizer.
    With `value=False`, `x` itself with the derivatives of that computation: what the integer products take for a
    fake-quantized operand, whose value they never use."""
    op = _fake_quant_jit if value else _straight_through_jit
    return _apply(op, x, scales.scale, fmt, scales.zero_point, scales.tensor_scale)


def _apply(
    op: Callable, x: Array, scale: object, fmt: Format, zero_point: object = 0, tensor_scale: object = None
) -> Array:
    """`op(x, scale, zero_point, tensor_scale, fmt)` on the arguments as `fake_quant` prepares them (in the compute
    dtype, checked, and alike in `jax.shard_map`), cast back to the dtype of `x`."""
    dtype = compute_dtype(x.dtype)
    scale = prepare_scale(scale, x.shape, dtype, check=fmt.scale == "float32")
    zero_point = None if zero_point is None else prepare_zero_point(zero_point, x.shape, dtype, fmt)
    if tensor_scale is not None:
        tensor_scale = jnp.asarray(tensor_scale).astype(dtype)
    xc, scale, zero_point, tensor_scale = vary_alike(x.astype(dtype), scale, zero_point, tensor_scale)
    return op(xc, scale, zero_point, tensor_scale, fmt).astype(x.dtype)


def _check_values(name: str, a: np.ndarray, ok: np.ndarray | np.bool_, requirement: str) -> None:
    if not np.all(ok):
        if a.ndim == 0:
            raise ValueError(f"`{name}` must be {requirement}, got {name}={a.item()!r}.")
        index = first_where(~ok)
        raise ValueError(
            f"`{name}` must be {requirement}, got {name}[{', '.join(map(str, index))}]={a[index].item()!r}."
        )


def valid_scales(values: np.ndarray, kind: str) -> tuple[np.ndarray | np.bool_, str]:
    """Which of `values` are scales of the scale format `kind` (one of `SCALE_FORMATS`), and the requirement in
    words: the one check of static, initial and concrete scales."""
    v = np.asarray(values, np.float64)
    with np.errstate(invalid="ignore", over="ignore"):
        finite = np.isfinite(v)
        if kind == "float32":
            return finite & (v >= FLOAT32_TINY) & (v <= 1 / FLOAT32_TINY), "finite, positive and a normal float32"
        if kind == "float16":
            return finite & (np.abs(v) <= np.finfo(np.float32).max), "a finite float32 (of either sign)"
        if kind == "e8m0":
            mantissa, exponent = np.frexp(np.where(finite, v, 0.0))
            ok = (v == 0) | (finite & (v > 0) & (mantissa == 0.5) & (np.abs(exponent - 1) <= 127))
            return ok, "a power of two 2**e with -127 <= e <= 127 (or 0 for 2**-127)"
        as_e4m3 = np.clip(np.where(finite, v, 0.0), 0, E4M3.bound).astype(np.float32).astype(ml_dtypes.float8_e4m3fn)
        ok = finite & (v >= 0) & (v <= E4M3.bound) & (as_e4m3.astype(np.float64) == v)
        return ok, "a non-negative float8_e4m3fn value"


def prepare_scale(scale: object, x_shape: tuple[int, ...], dtype: np.dtype, *, check: bool = True) -> Array:
    """Validates `scale` (type, broadcasting, and with `check` its value when concrete) and returns it as an array of
    `dtype`."""
    if isinstance(scale, (bool, np.bool_)):
        raise TypeError(f"`scale` must be a float or a float array, got {scale!r}.")
    if not isinstance(scale, jax.Array) and np.asarray(scale).dtype.kind in "iu":
        scale = np.asarray(scale, np.float64)  # a Python int such as 2**40 is a valid step, beyond int32
    scale = jnp.asarray(scale)
    if not (jnp.issubdtype(scale.dtype, jnp.floating) or jnp.issubdtype(scale.dtype, jnp.integer)):
        raise TypeError(f"`scale` must be a float or a float array, got dtype {scale.dtype}.")
    check_broadcastable("scale", scale.shape, x_shape)
    scale = scale.astype(dtype)
    if check and is_concrete(scale):
        s = np.asarray(scale)
        tiny = np.finfo(dtype).tiny
        with np.errstate(invalid="ignore", over="ignore"):
            ok = np.isfinite(s) & (s >= tiny) & (s <= 1 / tiny)
        _check_values("scale", s, ok, f"finite, positive and normal in {np.dtype(dtype).name} (its reciprocal too)")
    return scale


def check_zero_points(zero_point: object, fmt: Format | None = None, integer: bool = True) -> None:
    """Raises unless the zero points `zero_point` (concrete numbers) are finite, and integer-valued and in
    `[qmin, qmax]` on an integer grid `fmt` (with `integer=False`, a learned zero point, rounded and clipped into the
    grid where it is used: finite only): the one check of static, initial and concrete zero points."""
    z = np.asarray(zero_point)
    if z.dtype.kind not in "iuf":
        z = z.astype(np.float64)  # Python ints beyond int64
    if not integer:
        _check_values("zero_point", z, np.isfinite(z), "finite")
        return
    with np.errstate(invalid="ignore"):
        ok = np.isfinite(z) & (z == np.round(z))
        requirement = "integer-valued and finite"
        if isinstance(fmt, IntFormat):
            ok = ok & (z >= fmt.qmin) & (z <= fmt.qmax)
            requirement = f"integer-valued and in [qmin, qmax] = [{fmt.qmin}, {fmt.qmax}]"
    _check_values("zero_point", z, ok, requirement)


def prepare_zero_point(
    zero_point: object, x_shape: tuple[int, ...], dtype: np.dtype, fmt: Format | None = None
) -> Array | None:
    """Validates `zero_point` (type, broadcasting, and its value when concrete, on the grid of `fmt` if given) and
    returns it as an array of `dtype`, or `None` for a zero Python int."""
    if isinstance(zero_point, (bool, np.bool_)):
        raise TypeError(f"`zero_point` must be an int or an integer-valued float array, got {zero_point!r}.")
    if isinstance(zero_point, (int, np.integer)):
        if int(zero_point) == 0:
            return None
        check_zero_points(int(zero_point), fmt)  # before the cast, which an int beyond int32 would overflow
    zero_point = jnp.asarray(zero_point)
    if not (jnp.issubdtype(zero_point.dtype, jnp.floating) or jnp.issubdtype(zero_point.dtype, jnp.integer)):
        raise TypeError(f"`zero_point` must be an int or an integer-valued float array, got dtype {zero_point.dtype}.")
    check_broadcastable("zero_point", zero_point.shape, x_shape)
    zero_point = zero_point.astype(dtype)
    if is_concrete(zero_point):
        check_zero_points(zero_point, fmt)
    return zero_point


@jaxtyped(typechecker=beartype)
def fake_quant(
    x: RealLike,
    scale: Real[ArrayLike, "*scale_shape"],
    qmin: int | np.integer,
    qmax: int | np.integer,
    zero_point: Real[ArrayLike, "*zero_point_shape"] = 0,
) -> Float[Array, "*shape"]:
    r"""Fake-quantizes `x`: rounds it onto the integer grid `[qmin, qmax]` with step `scale`, and back to floats.

    The forward computes

    $$q(x) = s \cdot \bigl(\mathrm{clip}(\mathrm{round}(x / s) + z,\ q_{\min},\ q_{\max}) - z\bigr)$$

    where `round` sends halves to the nearest even integer (`2.5 -> 2`, `3.5 -> 4`, `-2.5 -> -2`) and $x / s$ is
    computed as `x * (1 / s)`, with the reciprocal taken in the compute dtype. This is the single numerical path of
    eqx_quant: eager calls, `jax.jit`, `jax.vmap`, scalar or array scales, the quantizer modules and the integer
    conversion all give bit-identical results.

    Subnormal numbers count as zeros, in inputs and in `x / scale`: XLA flushes them on CPU and GPU.

    The backward is a clipped straight-through estimator. With $v = x / s$ and $u = v + z$:

    - `x` receives `g` where $q_{\min} \le u \le q_{\max}$ (both ends included, on the unrounded value) and exactly
      0 elsewhere, NaN entries included;
    - an array `scale` receives, summed down to its shape, `g * (round(v) - v)` inside the range,
      `g * (qmin - z)` below it and `g * (qmax - z)` above it (the learned-step-size gradient), and 0 for NaN entries
      (whatever `g` is there, NaN included);
    - an array `zero_point` receives, summed down to its shape, `-scale * g` outside the range and 0 inside;
    - `qmin` and `qmax` are static Python ints and receive nothing.

    `fake_quant` is a `jax.custom_vjp`: reverse mode only. [`eqx_quant.fake_quant_format`][]`(x, scale, format,
    zero_point=...)` with the integer format of `[qmin, qmax]` computes the same values, and in reverse mode the same
    gradients bit for bit, through a JVP rule: it works in forward mode too (`jax.jvp`, `jax.jacfwd`, `jax.hessian`),
    as every quantizer module does.

    **Arguments:**

    - `x`: the array to quantize, of any shape. Floating dtypes are kept (float16 and bfloat16 are computed in
        float32 and cast back); integer and bool inputs are promoted to float32.
    - `scale`: the step size. A positive Python float, or a float array that broadcasts to `x` without changing its
        shape (per-channel or per-group scales, e.g. of shape `(channels, 1)`).
    - `qmin`, `qmax`: the inclusive integer range, Python ints (or NumPy integer scalars) with `qmin <= qmax`; see
        [`eqx_quant.int_range`][].
    - `zero_point`: the integer that represents real zero, in `[qmin, qmax]`. A Python int, or an integer-valued
        array broadcastable to `x`. A float array receives a gradient; a learned zero point must be rounded before
        it is passed here, as [`eqx_quant.LearnedFakeQuant`][] does with a straight-through rounding.

    **Returns:**

    The fake-quantized array, with the shape of `x` and its dtype (float32 for integer or bool `x`).

    **Raises:**

    `TypeError` for a non-integer or bool `qmin`/`qmax`, or a non-real `x`, `scale` or `zero_point`. `ValueError` if
    `qmin > qmax`, if `scale` or `zero_point` does not broadcast to `x`, if `scale` is not finite, positive and normal
    (nor its reciprocal), or if `zero_point` is not integer-valued and finite or lies outside `[qmin, qmax]`.

    !!! note "Values known only at run time"

        Inside `jax.jit` (or any other transformation in which `scale` or `zero_point` is a tracer) their values cannot
        be inspected, so they are not checked: a zero, negative or non-finite traced scale is used as it stands (a zero
        scale, for instance, maps every nonzero entry to zero and zeros to NaN) instead of raising. Their types and
        shapes are still checked.

    !!! example

        ```python
        import jax.numpy as jnp
        import eqx_quant

        x = jnp.array([0.3, 1.25, -0.75, 2.6, -3.0])
        print(eqx_quant.fake_quant(x, 0.5, -4, 3))  # [ 0.5  1.  -1.   1.5 -2. ]
        ```
    """
    fmt = IntFormat(*check_range(qmin, qmax))
    x = as_float_input("x", x)
    with jax.named_scope("eqx_quant.fake_quant"):
        return _apply(_fake_quant_vjp_jit, x, scale, fmt, zero_point)


def _as_float32(name: str, value: object) -> Array:
    if not isinstance(value, jax.Array):
        try:
            value = np.asarray(value)
        except ValueError as e:  # ragged nested lists
            raise ValueError(f"`{name}` must be a rectangular array of numbers, got {value!r}.") from e
    if value.dtype.kind not in "biuf" and value.dtype != jnp.bfloat16:
        raise TypeError(f"`{name}` must hold real numbers, got dtype {value.dtype} from {value!r}.")
    return jnp.asarray(value).astype(jnp.float32)


@jaxtyped(typechecker=beartype)
def fake_quant_vjp(
    x: ArrayLike | Sequence[Any],
    scale: Real[ArrayLike, "*scale_shape"],
    qmin: int | np.integer,
    qmax: int | np.integer,
    cotangent: ArrayLike | Sequence[Any],
) -> dict[str, Float32[Array, "*shape"]]:
    """Runs [`eqx_quant.fake_quant`][] forward and backward in one call, in float32.

    A convenience for inspecting the straight-through estimator: it returns the fake-quantized values and the
    gradient that a cotangent produces for `x` (see [`eqx_quant.fake_quant`][] for the rules).

    **Arguments:**

    - `x`: the input: a JAX or NumPy array, a Python number, or nested lists of numbers. Converted to float32.
    - `scale`, `qmin`, `qmax`: as for [`eqx_quant.fake_quant`][].
    - `cotangent`: the incoming gradient, of the same shape as `x`. Converted to float32.

    **Returns:**

    A dict `{"values": q(x), "grads": grad_x}` of float32 arrays with the shape of `x`.

    **Raises:**

    `ValueError` if `cotangent` and `x` differ in shape, plus everything [`eqx_quant.fake_quant`][] raises.

    !!! example

        ```python
        import eqx_quant

        out = eqx_quant.fake_quant_vjp([2.0, 2.5, -2.0, -2.25, 0.5], 1.0, -2, 2, [1, 2, 3, 4, 5])
        print(out["values"])  # [ 2.  2. -2. -2.  0.]
        print(out["grads"])  # [1. 0. 3. 0. 5.]
        ```
    """
    x = _as_float32("x", x)
    cotangent = _as_float32("cotangent", cotangent)
    if cotangent.shape != x.shape:
        raise ValueError(
            f"`cotangent` must have the shape of `x`, got cotangent.shape={cotangent.shape} and x.shape={x.shape}."
        )
    values, pullback = jax.vjp(lambda x_: fake_quant(x_, scale, qmin, qmax), x)
    (grads,) = pullback(cotangent)
    return {"values": values, "grads": grads}


#
# Two straight-through helpers of the learned quantizers.
#


@functools.partial(jax.custom_jvp, nondiff_argnums=(1,))
def _scale_gradient(x, factor):
    return x


@_scale_gradient.defjvp
def _scale_gradient_jvp(factor, primals, tangents):
    (x,), (x_dot,) = primals, tangents
    return _scale_gradient(x, factor), x_dot * factor


def scale_gradient(x: Array, factor: float) -> Array:
    """`x`, whose derivative (tangent and gradient) is multiplied by the static `factor` (the LSQ gradient scale of a
    learned step size)."""
    return _scale_gradient(x, factor)


@jax.custom_jvp
def _round_ste(x):
    return jnp.round(x)


@_round_ste.defjvp
def _round_ste_jvp(primals, tangents):
    (x,), (x_dot,) = primals, tangents
    return _round_ste(x), x_dot


def round_ste(x: Array) -> Array:
    """`jnp.round(x)` (halves to even) whose tangent passes straight through: the rounding of a learned zero point."""
    return _round_ste(x)


def pow2_ste(s: Array) -> Array:
    """The power of two nearest to positive float32 `s` in the log domain (`2**round(log2(s))`, exponents clamped to
    [-127, 127], `2**-127` held as 0), whose tangent passes straight through: the scale in use of a learned E8M0
    scale."""
    return _pow2_ste(s)


@jax.custom_jvp
def _pow2_ste(s):
    # `s = m * 2**k` with `m` in [1, 2) rounds up to `2**(k + 1)` when `m > sqrt(2)`: when its mantissa bits exceed
    # those of the largest float32 below sqrt(2) (sqrt(2) itself is irrational, so no float32 is a tie).
    bits = jax.lax.bitcast_convert_type(s, jnp.int32)
    up = (bits & 0x7FFFFF) > 0x3504F3
    return pow2(jnp.clip(exponent(s) + up.astype(jnp.int32), -127, 127), s.dtype)


@_pow2_ste.defjvp
def _pow2_ste_jvp(primals, tangents):
    (s,), (s_dot,) = primals, tangents
    return _pow2_ste(s), s_dot


def e4m3_ste(b: Array) -> Array:
    """`b` rounded to the nearest `float8_e4m3fn` value (saturating at ±448), whose tangent passes straight through:
    the block scale in use of a learned NVFP4 scale."""
    return _e4m3_ste(b)


@jax.custom_jvp
def _e4m3_ste(b):
    return E4M3.levels(b, None)


@_e4m3_ste.defjvp
def _e4m3_ste_jvp(primals, tangents):
    (b,), (b_dot,) = primals, tangents
    return _e4m3_ste(b), b_dot


#
# The entry keyed on the format, and the float formats' primitives.
#


@jaxtyped(typechecker=beartype)
def fake_quant_format(
    x: Real[ArrayLike, "*shape"] | Bool[ArrayLike, "*shape"],
    scale: Real[ArrayLike, "*scale_shape"],
    format: Format | str | int,
    *,
    zero_point: Real[ArrayLike, "*zero_point_shape"] = 0,
    tensor_scale: Real[ArrayLike, "*tensor_scale_shape"] | None = None,
) -> Float[Array, "*shape"]:
    r"""Fake-quantizes `x` onto any format: [`eqx_quant.fake_quant`][] for every [`eqx_quant.Format`][].

    The forward computes `apply(levels(x * reciprocal(scale)))`: the reciprocal of the scales (`1 / scale` for
    float32 scales, the exact `2**-e` of an E8M0 scale `2**e`, `1 / (scale * tensor_scale)` for two-level ones, 0 where
    that scale is 0), the nearest grid point of the format (saturating, plus the zero point of an integer grid), and the
    scale applied back (minus the zero point). The backward is the format's clipped straight-through estimator:
    `x` receives `g` where `x / scale` lies inside the grid and 0 elsewhere (NaN included); an array `scale` (and
    `tensor_scale`, `zero_point`) receives the learned-step-size gradient of [`eqx_quant.fake_quant`][], with the
    format's grid point in place of `round(v)` and its ends in place of `qmin`, `qmax`. The derivatives are a JVP
    rule, so forward mode works too (`jax.jvp`, `jax.jacfwd`, `jax.hessian`): the tangent is that estimator read
    forwards, and reverse mode transposes it into the same gradients, bit for bit, as `fake_quant`'s backward rule.

    **Arguments:**

    - `x`: the array to quantize. Floating dtypes are kept (float16 and bfloat16 are computed in float32 and cast
        back); integer and bool inputs are promoted to float32.
    - `scale`: the scales, broadcasting to `x` without changing its shape. Float32 scales must be positive and
        normal; an E8M0 scale is a power of two (0 standing for `2**-127`), an E4M3 one a non-negative
        `float8_e4m3fn` value, or NaN for a block that quantizes to NaN (each checked when concrete).
    - `format`: a [`eqx_quant.Format`][], its name, or an int (signed integers of that many bits).
    - `zero_point`: the integer that represents 0, in `[qmin, qmax]`, for integer grids with float32 scales.
    - `tensor_scale`: the float32 scale of the whole tensor of two-level formats (NVFP4): finite and non-negative
        (checked when concrete; 0 quantizes to zeros).

    **Returns:**

    The fake-quantized array, with the shape of `x` and its dtype (float32 for integer or bool `x`).

    !!! example

        ```python
        import jax.numpy as jnp
        import eqx_quant

        x = jnp.array([0.3, 1.25, -2.6, 100.0])
        print(eqx_quant.fake_quant_format(x, 0.5, "int4"))  # [ 0.5  1.  -2.5  3.5]
        print(eqx_quant.fake_quant_format(x, 1.0, "float4_e2m1fn"))  # [ 0.5  1.  -3.   6. ]
        ```
    """
    fmt = as_format(format)
    x = as_float_input("x", x)
    if fmt.scale == "e4m3" and tensor_scale is None:
        raise ValueError(f"`tensor_scale` is needed for the two-level scales of {fmt.name}, got None.")
    if fmt.scale != "e4m3" and tensor_scale is not None:
        raise ValueError(f"`tensor_scale` is for two-level scales (NVFP4), got it for {fmt.name}.")
    if not fmt.zero_points and not (isinstance(zero_point, (int, np.integer)) and int(zero_point) == 0):
        raise ValueError(f"{fmt.name} has no zero point, got zero_point={zero_point!r}.")
    # Float32 scales are checked by `_apply`; block scales may also be NaN (a block that quantizes to NaN).
    if fmt.scale in ("e8m0", "e4m3") and is_concrete(scale):
        s = np.asarray(scale, np.float64)
        ok, requirement = valid_scales(s, fmt.scale)
        _check_values("scale", s, ok | np.isnan(s), f"{requirement}, or NaN, for {fmt.name}")
    if tensor_scale is not None and is_concrete(tensor_scale):
        t = np.asarray(tensor_scale, np.float64)
        with np.errstate(invalid="ignore"):
            ok = np.isfinite(t) & (t >= 0) & (t <= np.finfo(compute_dtype(x.dtype)).max)
        _check_values("tensor_scale", t, ok, "finite and non-negative (0 quantizes to zeros)")
    with jax.named_scope("eqx_quant.fake_quant_format"):
        return _apply(_fake_quant_jit, x, scale, fmt, zero_point, tensor_scale)


@jaxtyped(typechecker=beartype)
def fake_quant_float(
    x: RealLike,
    scale: Real[ArrayLike, "*scale_shape"],
    dtype: str | type | np.dtype,
) -> Float[Array, "*shape"]:
    r"""Fake-quantizes `x` to a low-precision float format: scales it, rounds it onto the format's grid, and scales it
    back.

    The forward computes

    $$q(x) = s \cdot \mathrm{float}\bigl(\mathrm{cast}(\mathrm{clip}(x / s,\ -M,\ M))\bigr)$$

    where $M$ is the largest finite value of the format and the cast rounds to the nearest representable value, ties
    to the one with an even mantissa (as `ml_dtypes` casts do). Values beyond $\pm M$ saturate to $\pm M$ (a plain
    cast would turn them into NaN for the `fn` formats), ±inf included; NaN stays NaN. As in
    [`eqx_quant.fake_quant`][], $x / s$ is computed as `x * (1 / s)`, and subnormal float32 numbers count as zeros;
    eager calls, `jax.jit` and `jax.vmap` give bit-identical results. The rounding is computed in float32 arithmetic
    (exact operations on powers of two), so it does not depend on the backend's support for these dtypes. It is
    [`eqx_quant.fake_quant_format`][] with the format [`eqx_quant.float_format`][]`(dtype)`.

    The backward is a clipped straight-through estimator. With $v = x / s$:

    - `x` receives `g` where $|v| \le M$ and exactly 0 elsewhere, NaN entries included;
    - an array `scale` receives, summed down to its shape, `g * (q(v) - v)` where $|v| \le M$ ($q$ the rounding onto
        the grid), `g * sign(v) * M` where $|v| > M$, and 0 for NaN entries (whatever `g` is there).

    **Arguments:**

    - `x`: the array to quantize, of any shape. Floating dtypes are kept (float16 and bfloat16 are computed in
        float32 and cast back); integer and bool inputs are promoted to float32.
    - `scale`: the step size that maps `x` onto the format's range. A positive Python float, or a float array that
        broadcasts to `x` without changing its shape.
    - `dtype`: the element format: `float8_e4m3fn`, `float8_e5m2`, `float6_e2m3fn`, `float6_e3m2fn` or
        `float4_e2m1fn`, as a JAX or `ml_dtypes` dtype (`jnp.float8_e4m3fn`) or its name as a string.

    **Returns:**

    The fake-quantized array, with the shape of `x` and its dtype (float32 for integer or bool `x`).

    **Raises:**

    `TypeError` if `dtype` is not a dtype or a string, or for a non-real `x` or `scale`. `ValueError` if `dtype` is
    not one of the five formats, if `scale` does not broadcast to `x`, or if a concrete `scale` is not finite,
    positive and normal (nor its reciprocal).

    !!! example

        ```python
        import jax.numpy as jnp
        import eqx_quant

        x = jnp.array([0.3, 1.25, -2.6, 5.5, 100.0, jnp.nan])
        print(eqx_quant.fake_quant_float(x, 1.0, jnp.float4_e2m1fn))  # [ 0.5  1.  -3.   6.   6.   nan]
        print(eqx_quant.fake_quant_float(x, 0.5, "float8_e4m3fn"))  # [ 0.3125  1.25  -2.5  5.5  96.  nan]
        ```
    """
    fmt = float_format(dtype)
    x = as_float_input("x", x)
    with jax.named_scope("eqx_quant.fake_quant_float"):
        return _apply(_fake_quant_jit, x, scale, fmt)


def check_blocks(shape: tuple[int, ...], axis: int, block_size: int, fmt: Format) -> int:
    """Checks that axis `axis` of `shape` splits into blocks of `block_size`, and returns it as a non-negative int."""
    ndim = len(shape)
    if ndim == 0:
        raise ValueError(f"`x` must have at least one axis to split into blocks, got a scalar of format {fmt.name}.")
    if not -ndim <= axis < ndim:
        raise ValueError(f"`axis` must be in [{-ndim}, {ndim}) for `x` of shape {shape}, got axis={axis}.")
    if fmt.scale == "e4m3" and shape[axis] % block_size:
        raise ValueError(
            f"the length of `axis` in `x` must be a multiple of {block_size}, got axis={axis} of length "
            f"{shape[axis]} in `x` of shape {shape}."
        )
    if shape[axis] % block_size:
        raise ValueError(
            f"`block_size` must divide the length of axis={axis} of `x` ({shape[axis]}, shape {shape}), "
            f"got block_size={block_size}."
        )
    return axis % ndim


@functools.partial(jax.jit, static_argnums=(1, 2, 3))
def _fake_quant_blocks(x: Array, axis: int, block_size: int, fmt: Format) -> Array:
    """`x` fake-quantized onto `fmt` with dynamic block scales along `axis`: the computation of a dynamic quantizer
    of that format and layout."""
    layout = Layout(group_size=block_size, group_axis=axis)
    view = layout.view(x)
    scales = fit_scales(view.astype(compute_dtype(x.dtype)), layout.reduction_axes(x.shape), fmt)
    return fake_quant_scales(view, scales, fmt).reshape(x.shape)


@jaxtyped(typechecker=beartype)
def mx_fake_quant(
    x: RealLike,
    fmt: str,
    *,
    axis: int | np.integer = -1,
    block_size: int | np.integer = 32,
    scale_rule: str = "floor",
) -> Float[Array, "*shape"]:
    r"""Fake-quantizes `x` to an OCP Microscaling (MX v1.0) format: blocks of contiguous elements share a power-of-two
    scale, and each element is a low-precision float (or, for MXINT8, an integer in [-127, 127]).

    `x` is split into blocks of `block_size` consecutive elements along `axis`. Each block has the scale
    $X = 2^e$, stored in the specification as E8M0, so $e$ is clamped to $[-127, 127]$; its elements become
    [`eqx_quant.fake_quant_float`][]`(v, X, element)` (the result, for a normal $X$, is bit for bit that call's).
    With `amax` the largest $|x|$ of the block and $M$ the largest value of the element format:

    - `scale_rule="floor"` (the specification's rule): $e = \lfloor \log_2 \mathrm{amax} \rfloor - e_{\max}$, where
        $e_{\max}$ is the exponent of the element's largest normal (8 for E4M3, 15 for E5M2, 2 for E2M3, 4 for E3M2,
        2 for E2M1, 6 for MXINT8's 127). The largest elements of a block may saturate to $\pm M$.
    - `scale_rule="rceil"`: $e = \lceil \log_2(\mathrm{amax} / M) \rceil$ for the exact quotient: the smallest
        $e$ with $\mathrm{amax} \le M \cdot 2^e$, so nothing saturates. (The float32 quotient `amax / M` has the
        same ceiling whenever it is normal: the exact quotient is never within a relative $2^{-24}$ of a power of
        two without being one, so rounding it to float32 never lands on one.)

    Both exponents are read exactly from the bits of `amax`: no logarithm is evaluated. Special blocks:

    - a block of zeros (or of subnormal float32 numbers, which count as zeros) gets $e = -127$ and gives zeros (of
        the signs of its entries);
    - a block holding a NaN or ±inf gives NaN in every entry (the specification's NaN scale);
    - a block whose exponent falls below -127 (`amax` below about $2^{e_{\max} - 127}$) uses $X = 2^{-127}$ all the
        same: its elements land on a coarser grid than the exponent asked for, and results below the normal float32
        range become zeros. Float32 blocks never reach the upper clamp (their largest exponent is 126); float64
        blocks beyond it saturate;
    - with `rceil`, an element within a rounding step of the float32 maximum can round up to $2^{128}$, which
        float32 holds only as inf.

    The backward is straight-through per element with the block scale held constant (as under
    `jax.lax.stop_gradient`): `x` receives `g` where $|x / X| \le M$ and 0 elsewhere, and 0 in every entry of a
    block holding NaN or inf. It is [`eqx_quant.fake_quant_format`][] with the format
    [`eqx_quant.mx_format`][]`(fmt)` and the scales of [`eqx_quant.DynamicFakeQuant`][]`(fmt, group_size=block_size,
    group_axis=axis)`.

    **Arguments:**

    - `x`: the array to quantize, with at least one axis. Floating dtypes are kept (float16 and bfloat16 are
        computed in float32 and cast back); integer and bool inputs are promoted to float32.
    - `fmt`: the MX format: `"mxfp8_e4m3"`, `"mxfp8_e5m2"`, `"mxfp6_e2m3"`, `"mxfp6_e3m2"`, `"mxfp4"` (elements
        `float8_e4m3fn`, `float8_e5m2`, `float6_e2m3fn`, `float6_e3m2fn`, `float4_e2m1fn`) or `"mxint8"`.
    - `axis`: the axis along which blocks are formed (the reduction axis of the matrix product that consumes `x`).
    - `block_size`: the number of elements that share a scale; 32 in the specification.
    - `scale_rule`: `"floor"` or `"rceil"`, as above.

    **Returns:**

    The fake-quantized array, with the shape and dtype of `x` (float32 for integer or bool `x`).

    **Raises:**

    `TypeError` for a non-int `axis` or `block_size`, or a non-real `x`. `ValueError` for an unknown `fmt` or
    `scale_rule`, a `block_size` below 1 or one that does not divide the length of `axis`, an `axis` out of range,
    or a scalar `x`.

    !!! example

        ```python
        import jax.numpy as jnp
        import eqx_quant

        x = jnp.array([0.1, -0.7, 3.0, 7.0, 0.0, -0.0, 0.0, 0.0])
        print(eqx_quant.mx_fake_quant(x, "mxfp4", block_size=4))  # [ 0.  -0.5  3.   6.   0.  -0.   0.   0. ]
        print(eqx_quant.mx_fake_quant(x, "mxfp4", block_size=4, scale_rule="rceil"))  # [ 0. -1. 3. 8. 0. -0. 0. 0.]
        ```
    """
    format = mx_format(fmt, scale_rule=scale_rule)
    axis = check_int("axis", axis)
    block_size = check_int("block_size", block_size)
    if block_size < 1:
        raise ValueError(f"`block_size` must be >= 1, got block_size={block_size}.")
    x = as_float_input("x", x)
    axis = check_blocks(x.shape, axis, block_size, format)
    with jax.named_scope("eqx_quant.mx_fake_quant"):
        return _fake_quant_blocks(x, axis, block_size, format)


@jaxtyped(typechecker=beartype)
def nvfp4_fake_quant(x: RealLike, *, axis: int | np.integer = -1) -> Float[Array, "*shape"]:
    r"""Fake-quantizes `x` to NVFP4: `float4_e2m1fn` elements in blocks of 16, each block with a `float8_e4m3fn`
    scale, under one float32 scale for the whole tensor.

    With `amax` the largest finite $|x|$ of the whole array and `amax_b` that of a block of 16 consecutive elements
    along `axis`, in the compute dtype (float32; float64 for float64 `x`, tensor scale included) and in this order:

    - the tensor scale is `t = amax / 2688` ($2688 = 448 \cdot 6$);
    - the block scale is `b = float8_e4m3fn(clip(amax_b / (6 * t), 0, 448))`, rounded to nearest, ties to even;
    - the elements are [`eqx_quant.fake_quant_float`][]`(x, b * t, float4_e2m1fn)`: `x * (1 / (b * t))`
        saturated to ±6, rounded onto the E2M1 grid and multiplied by `b * t`. Rounding `b` down can make the
        largest elements of a block saturate.

    The two divisions that make the scales are exact float32 divisions (correctly rounded, as the format's
    specification computes them) on every path: eager calls, `jax.jit` and `jax.vmap` agree bit for bit, although
    XLA would otherwise turn a division by a scalar into a multiplication by its reciprocal. The elements use the
    reciprocal of `b * t`, as [`eqx_quant.fake_quant_float`][] does. Special cases:

    - where `b * t` is zero (an all-zero tensor or block, a block too small next to the tensor's `amax` for a
        nonzero E4M3 scale, or a tensor whose `t` falls below the normal float32 range, since subnormals count as
        zeros), the block gives zeros (of the signs of its entries);
    - NaN and ±inf entries are left out of `amax` (the finite entries of their block still count), and a block
        holding one gives NaN in every entry; the other blocks are quantized as if those entries were zeros.

    Under `jax.vmap`, each mapped slice is a tensor with its own `t`. The backward is straight-through per element
    with both scales held constant: `x` receives `g` where $|x / (b t)| \le 6$ (every entry of a zero-scale block
    included) and 0 elsewhere, and 0 in every entry of a block holding NaN or inf. It is
    [`eqx_quant.fake_quant_format`][] with the format `"nvfp4"` and the scales of
    [`eqx_quant.DynamicFakeQuant`][]`("nvfp4", group_size=16, group_axis=axis)`.

    **Arguments:**

    - `x`: the array to quantize, with at least one axis. Floating dtypes are kept (float16 and bfloat16 are
        computed in float32 and cast back); integer and bool inputs are promoted to float32.
    - `axis`: the axis along which blocks of 16 are formed; its length must be a multiple of 16.

    **Returns:**

    The fake-quantized array, with the shape and dtype of `x` (float32 for integer or bool `x`).

    **Raises:**

    `TypeError` for a non-int `axis` or a non-real `x`. `ValueError` if the length of `axis` is not a multiple of
    16, for an `axis` out of range, or a scalar `x`.

    !!! example

        ```python
        import jax.numpy as jnp
        import eqx_quant

        # Two blocks: 16 values in [-3, 3] (block scale 0.5, so the grid is 0.5 * E2M1), then 16 of 0.01.
        x = jnp.concatenate([jnp.linspace(-3.0, 3.0, 16), jnp.full(16, 0.01)])
        y = eqx_quant.nvfp4_fake_quant(x)
        print(y[:4])  # [-3. -3. -2. -2.]
        print(y[16:18])  # [0.01004464 0.01004464]
        ```
    """
    axis = check_int("axis", axis)
    x = as_float_input("x", x)
    axis = check_blocks(x.shape, axis, NVFP4_BLOCK, NVFP4)
    with jax.named_scope("eqx_quant.nvfp4_fake_quant"):
        return _fake_quant_blocks(x, axis, NVFP4_BLOCK, NVFP4)
