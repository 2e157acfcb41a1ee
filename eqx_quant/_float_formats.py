import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from beartype import beartype
from jaxtyping import Array, ArrayLike, Bool, Float, Real, jaxtyped

from ._fake_quant import prepare_scale, scaled
from ._misc import as_float_input, check_int, compute_dtype, expand_to_rank, sum_to_shape, vary_alike


RealLike = Real[ArrayLike, "*shape"] | Bool[ArrayLike, "*shape"]


class _Format(NamedTuple):
    """A low-precision float element format: its grid, described by Python numbers (static, hashable)."""

    name: str
    nmant: int  # explicit mantissa bits
    emin: int  # exponent of the smallest normal number
    emax: int  # exponent of the largest normal number
    max: float  # the largest finite value


def _describe(dtype: type) -> _Format:
    info = ml_dtypes.finfo(dtype)
    largest = float(info.max)
    return _Format(
        name=np.dtype(dtype).name,
        nmant=int(info.nmant),
        emin=int(math.log2(float(info.smallest_normal))),
        emax=math.frexp(largest)[1] - 1,
        max=largest,
    )


_FORMATS = {
    f.name: f
    for f in map(
        _describe,
        (
            ml_dtypes.float8_e4m3fn,
            ml_dtypes.float8_e5m2,
            ml_dtypes.float6_e2m3fn,
            ml_dtypes.float6_e3m2fn,
            ml_dtypes.float4_e2m1fn,
        ),
    )
}

_MX_ELEMENTS = {
    "mxfp8_e4m3": "float8_e4m3fn",
    "mxfp8_e5m2": "float8_e5m2",
    "mxfp6_e2m3": "float6_e2m3fn",
    "mxfp6_e3m2": "float6_e3m2fn",
    "mxfp4": "float4_e2m1fn",
}

_E8M0_MIN, _E8M0_MAX = -127, 127
_NVFP4_BLOCK = 16
_NVFP4_TENSOR_DIVISOR = 2688  # 448 * 6: the largest float8_e4m3fn block scale times the largest float4_e2m1fn value


def _float_format(dtype: object) -> _Format:
    """The element format named by `dtype` (a dtype, a scalar type, or a name), or an error naming `dtype`."""
    if isinstance(dtype, str):
        name = dtype
    else:
        try:
            name = np.dtype(dtype).name  # pyright: ignore[reportArgumentType]
        except TypeError as e:
            raise TypeError(f"`dtype` must be a float format dtype or its name, got {dtype!r}.") from e
    if name not in _FORMATS:
        raise ValueError(f"`dtype` must be one of {', '.join(_FORMATS)} (or its name), got {dtype!r}.")
    return _FORMATS[name]


#
# Exact arithmetic on the bits of the compute dtype (float32, or float64 when enabled): exponents are read from the
# bit pattern and powers of two are built from it, so no logarithm or `exp2` can be off by one.
#


def _int_dtype(dtype: np.dtype) -> type:
    return jnp.int32 if jnp.finfo(dtype).bits == 32 else jnp.int64


def _exponent(a: Array) -> Array:
    """`floor(log2(a))` for a normal `a >= 0`, as an integer array; zeros and subnormals give the exponent just below
    the smallest normal (-127 in float32). Meaningless for NaN and inf."""
    info = jnp.finfo(a.dtype)
    bits = jax.lax.bitcast_convert_type(a, _int_dtype(a.dtype))
    return jax.lax.shift_right_logical(bits, info.nmant) - (info.maxexp - 1)


def _pow2(n: Array, dtype: np.dtype) -> Array:
    """`2.0 ** n`, exactly, for integers `n` in the normal range of `dtype`."""
    info = jnp.finfo(dtype)
    itype = _int_dtype(dtype)
    return jax.lax.bitcast_convert_type(
        jax.lax.shift_left(n.astype(itype) + (info.maxexp - 1), jnp.asarray(info.nmant, itype)), dtype
    )


def _round_to_format(v: Array, fmt: _Format) -> Array:
    """`v` (with `|v| <= fmt.max`, or NaN) rounded to the nearest point of the format's grid, ties to even: the value
    of a cast to the format, computed in the compute dtype, so that every backend rounds alike."""
    a = jnp.abs(v)
    # The grid step around `a` is 2**(k - nmant), with k the exponent of `a`, or `emin` among subnormals.
    k = jnp.maximum(_exponent(a), fmt.emin)
    step = k - fmt.nmant
    r = jnp.round(a * _pow2(-step, a.dtype)) * _pow2(step, a.dtype)
    return jnp.copysign(r, v)


def _quantize(v: Array, fmt: _Format) -> Array:
    """`float(cast(clip(v, -M, M), fmt))`: saturates, then rounds. NaN stays NaN."""
    return _round_to_format(jnp.clip(v, -fmt.max, fmt.max), fmt)


#
# `fake_quant_float`.
#


def _fake_quant_float_impl(x, scale, fmt):
    return expand_to_rank(scale, x.ndim) * _quantize(scaled(x, scale), fmt)


_fake_quant_float = jax.custom_vjp(_fake_quant_float_impl, nondiff_argnums=(2,))


def _fake_quant_float_fwd(x, scale, fmt):
    return _fake_quant_float_impl(x, scale, fmt), (x, scale)


def _fake_quant_float_bwd(fmt, residuals, g):
    x, scale = residuals
    v = scaled(x, scale)
    inside = jnp.abs(v) <= fmt.max  # False for NaN
    zero = jnp.zeros((), g.dtype)
    grad_x = jnp.where(inside, g, zero)
    d_scale = jnp.where(inside, _quantize(v, fmt) - v, jnp.sign(v) * fmt.max)
    grad_scale = sum_to_shape(jnp.where(jnp.isnan(v), zero, g * d_scale), scale.shape)
    return grad_x, grad_scale


_fake_quant_float.defvjp(_fake_quant_float_fwd, _fake_quant_float_bwd)


def check_nvfp4_blocks(x: Array, axis: int) -> int:
    """Checks that `x`'s `axis` splits into NVFP4's blocks of 16, and returns the axis as a nonnegative int."""
    if x.ndim >= 1 and -x.ndim <= axis < x.ndim and x.shape[axis] % _NVFP4_BLOCK != 0:
        raise ValueError(
            f"the length of `axis` in `x` must be a multiple of {_NVFP4_BLOCK}, got axis={axis} of length "
            f"{x.shape[axis]} in `x` of shape {x.shape}."
        )
    return _check_blocks(x, axis, _NVFP4_BLOCK)


# Compiled as one program even in eager calls: a dozen small operations, each compiled on its own otherwise.
_fake_quant_float_jit = jax.jit(_fake_quant_float, static_argnums=(2,))


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
    (exact operations on powers of two), so it does not depend on the backend's support for these dtypes.

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
    fmt = _float_format(dtype)
    x = as_float_input("x", x)
    cdtype = compute_dtype(x.dtype)
    scale = prepare_scale(scale, x.shape, cdtype)
    with jax.named_scope("eqx_quant.fake_quant_float"):
        xc, scale = vary_alike(x.astype(cdtype), scale)
        return _fake_quant_float_jit(xc, scale, fmt).astype(x.dtype)


#
# Block formats. Both work on `xb`, the input with the blocked axis split into (blocks, block_size) at the end, and
# differ only in their block scales: `inv`, the reciprocal of the block scale (NaN for a block holding NaN or inf,
# 0 for a block whose scale is 0), and `factors`, whose product is the block scale (applied one after the other, so
# that a product below the normal range is never formed on the way to a normal result).
#


def _finite_block_amax(xb: Array) -> tuple[Array, Array]:
    """Per block: the largest finite `|x|` (0 if none), and whether the block holds a NaN or an inf."""
    finite = jnp.isfinite(xb)
    amax = jnp.max(jnp.where(finite, jnp.abs(xb), jnp.zeros((), xb.dtype)), axis=-1, keepdims=True)
    bad = ~jnp.all(finite, axis=-1, keepdims=True)
    return amax, bad


def _mx_exponent(amax: Array, fmt: _Format, scale_rule: str) -> Array:
    """The E8M0 block exponent `e` (the block scale is `2**e`), clamped to [-127, 127]."""
    k = _exponent(amax)
    if scale_rule == "floor":
        e = k - fmt.emax
    else:
        # ceil(log2(amax / M)) of the exact quotient: with amax = ma * 2**k and M = mM * 2**emax (mantissas in
        # [1, 2)), the quotient is (ma / mM) * 2**(k - emax) with ma / mM in (1/2, 2), so the ceiling is k - emax,
        # plus one when ma > mM, which compares the stored mantissa bits. Zero and subnormal `amax` land far below
        # the clamp.
        nmant = jnp.finfo(amax.dtype).nmant
        bits = jax.lax.bitcast_convert_type(amax, k.dtype)
        max_bits = int((fmt.max / 2**fmt.emax - 1) * 2**nmant)
        e = k - fmt.emax + ((bits & (2**nmant - 1)) > max_bits).astype(k.dtype)
    return jnp.clip(e, _E8M0_MIN, _E8M0_MAX)


def _mx_scales(xb: Array, fmt: _Format, scale_rule: str) -> tuple[Array, tuple[Array, ...]]:
    amax, bad = _finite_block_amax(xb)
    e = _mx_exponent(amax, fmt, scale_rule)
    inv = jnp.where(bad, jnp.asarray(jnp.nan, xb.dtype), _pow2(-e, xb.dtype))
    # 2**e itself is subnormal in float32 for e = -127; its two halves are normal.
    half = jax.lax.shift_right_arithmetic(e, jnp.asarray(1, e.dtype))
    return inv, (_pow2(half, xb.dtype), _pow2(e - half, xb.dtype))


def _divide(a: Array, b: Array | float | int) -> Array:
    """`a / b`, correctly rounded on every path. XLA turns a division by a scalar (a constant, or a broadcast one)
    into a multiplication by its reciprocal, which differs in the last bit for some values, and under `jax.vmap` an
    unmapped divisor is broadcast. So the divisor enters at the shape (and mapping) of `a`, computed from `a` (`a * 0`
    is 0 for the finite `a` this is used on), behind an optimization barrier that keeps XLA from seeing through it."""
    divisor = jax.lax.optimization_barrier(a * jnp.zeros((), a.dtype) + jnp.asarray(b, a.dtype))
    return a / divisor


def nvfp4_scales(xb: Array) -> tuple[Array, Array, Array]:
    """NVFP4's tensor scale `t = amax / 2688`, block scales `b = float8_e4m3fn(clip(amax_b / (6 t), 0, 448))` (as
    floats) and non-finite-block mask of blocked `xb` (blocks along the last axis), in that order of float
    operations, each correctly rounded."""
    amax_block, bad = _finite_block_amax(xb)
    amax = jnp.max(amax_block, initial=0)
    t = _divide(amax, _NVFP4_TENSOR_DIVISOR)
    ratio = jnp.where(t > 0, _divide(amax_block, 6 * jnp.where(t > 0, t, 1)), jnp.zeros((), xb.dtype))
    b = _quantize(ratio, _FORMATS["float8_e4m3fn"])  # ratio >= 0: the clip to [-448, 448] is the clip to [0, 448]
    return t, b, bad


def _nvfp4_scales(xb: Array) -> tuple[Array, tuple[Array, ...]]:
    dtype = xb.dtype
    t, b, bad = nvfp4_scales(xb)
    zero = jnp.zeros((), dtype)
    s = b * t
    inv = jnp.where(bad, jnp.asarray(jnp.nan, dtype), jnp.where(s > 0, 1 / jnp.where(s > 0, s, 1), zero))
    return inv, (s,)


def _block_scales(xb: Array, fmt: _Format, scheme: tuple[str, ...]) -> tuple[Array, tuple[Array, ...]]:
    if scheme[0] == "mx":
        return _mx_scales(xb, fmt, scheme[1])
    return _nvfp4_scales(xb)


def _block_fake_quant_fwd(xb, fmt, scheme):
    inv, factors = _block_scales(xb, fmt, scheme)
    out = _quantize(xb * inv, fmt)
    for factor in factors:
        out = out * factor
    return out, (xb, inv)


def _block_fake_quant_impl(xb, fmt, scheme):
    return _block_fake_quant_fwd(xb, fmt, scheme)[0]


_block_fake_quant = jax.custom_vjp(_block_fake_quant_impl, nondiff_argnums=(1, 2))


def _block_fake_quant_bwd(fmt, scheme, residuals, g):
    del scheme
    xb, inv = residuals
    inside = jnp.abs(xb * inv) <= fmt.max  # False for NaN, so for every entry of a block holding NaN or inf
    return (jnp.where(inside, g, jnp.zeros((), g.dtype)),)


_block_fake_quant.defvjp(_block_fake_quant_fwd, _block_fake_quant_bwd)


def _check_blocks(x: Array, axis: int, block_size: int) -> int:
    """Checks that `x`'s `axis` splits into blocks of `block_size`, and returns the axis as a nonnegative int."""
    if x.ndim == 0:
        raise ValueError(f"`x` must have at least one axis to split into blocks, got a scalar, x={x!r}.")
    if not -x.ndim <= axis < x.ndim:
        raise ValueError(f"`axis` must be in [{-x.ndim}, {x.ndim}) for `x` of shape {x.shape}, got axis={axis}.")
    if x.shape[axis] % block_size != 0:
        raise ValueError(
            f"`block_size` must divide the length of axis={axis} of `x` ({x.shape[axis]}, shape {x.shape}), "
            f"got block_size={block_size}."
        )
    return axis % x.ndim


# Compiled as one program even in eager calls: a few dozen small operations, each compiled on its own otherwise.
@functools.partial(jax.jit, static_argnums=(1, 2, 3, 4))
def _blocks_jit(x: Array, axis: int, block_size: int, fmt: _Format, scheme: tuple[str, ...]) -> Array:
    moved = jnp.moveaxis(x.astype(compute_dtype(x.dtype)), axis, -1)
    shape = moved.shape
    xb = moved.reshape(*shape[:-1], shape[-1] // block_size, block_size)
    out = _block_fake_quant(xb, fmt, scheme).reshape(shape)
    return jnp.moveaxis(out, -1, axis).astype(x.dtype)


def _run_blocks(x: Array, axis: int, block_size: int, fmt: _Format, scheme: tuple[str, ...]) -> Array:
    axis = _check_blocks(x, axis, block_size)
    return _blocks_jit(x, axis, block_size, fmt, scheme)


@jaxtyped(typechecker=beartype)
def mx_fake_quant(
    x: RealLike,
    fmt: str,
    *,
    axis: int = -1,
    block_size: int = 32,
    scale_rule: str = "floor",
) -> Float[Array, "*shape"]:
    r"""Fake-quantizes `x` to an OCP Microscaling (MX v1.0) format: blocks of contiguous elements share a power-of-two
    scale, and each element is a low-precision float.

    `x` is split into blocks of `block_size` consecutive elements along `axis`. Each block has the scale
    $X = 2^e$, stored in the specification as E8M0, so $e$ is clamped to $[-127, 127]$; its elements become
    [`eqx_quant.fake_quant_float`][]`(v, X, element)` (the result, for a normal $X$, is bit for bit that call's).
    With `amax` the largest $|x|$ of the block and $M$ the largest value of the element format:

    - `scale_rule="floor"` (the specification's rule): $e = \lfloor \log_2 \mathrm{amax} \rfloor - e_{\max}$, where
        $e_{\max}$ is the exponent of the element's largest normal (8 for E4M3, 15 for E5M2, 2 for E2M3, 4 for E3M2,
        2 for E2M1). The largest elements of a block may saturate to $\pm M$.
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
    block holding NaN or inf.

    **Arguments:**

    - `x`: the array to quantize, with at least one axis. Floating dtypes are kept (float16 and bfloat16 are
        computed in float32 and cast back); integer and bool inputs are promoted to float32.
    - `fmt`: the MX format: `"mxfp8_e4m3"`, `"mxfp8_e5m2"`, `"mxfp6_e2m3"`, `"mxfp6_e3m2"` or `"mxfp4"` (elements
        `float8_e4m3fn`, `float8_e5m2`, `float6_e2m3fn`, `float6_e3m2fn`, `float4_e2m1fn`).
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
    if fmt not in _MX_ELEMENTS:
        raise ValueError(f"`fmt` must be one of {', '.join(map(repr, _MX_ELEMENTS))}, got fmt={fmt!r}.")
    if scale_rule not in ("floor", "rceil"):
        raise ValueError(f"`scale_rule` must be 'floor' or 'rceil', got scale_rule={scale_rule!r}.")
    axis = check_int("axis", axis)
    block_size = check_int("block_size", block_size)
    if block_size < 1:
        raise ValueError(f"`block_size` must be >= 1, got block_size={block_size}.")
    x = as_float_input("x", x)
    element = _FORMATS[_MX_ELEMENTS[fmt]]
    with jax.named_scope("eqx_quant.mx_fake_quant"):
        return _run_blocks(x, axis, block_size, element, ("mx", scale_rule))


@jaxtyped(typechecker=beartype)
def nvfp4_fake_quant(x: RealLike, *, axis: int = -1) -> Float[Array, "*shape"]:
    r"""Fake-quantizes `x` to NVFP4: `float4_e2m1fn` elements in blocks of 16, each block with a `float8_e4m3fn`
    scale, under one float32 scale for the whole tensor.

    With `amax` the largest finite $|x|$ of the whole array and `amax_b` that of a block of 16 consecutive elements
    along `axis`, in the compute dtype (float32) and in this order:

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
    included) and 0 elsewhere, and 0 in every entry of a block holding NaN or inf.

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
    check_nvfp4_blocks(x, axis)
    with jax.named_scope("eqx_quant.nvfp4_fake_quant"):
        return _run_blocks(x, axis, _NVFP4_BLOCK, _FORMATS["float4_e2m1fn"], ("nvfp4",))
