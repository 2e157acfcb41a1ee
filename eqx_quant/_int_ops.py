"""Integer matrix products and convolutions with int32 accumulation, shared by training and deployment.

The quantized layers ([`eqx_quant.nn.QuantLinear`][], [`eqx_quant.nn.QuantConv`][]) compute their forward pass with
these functions when both operands are on integer grids, and the converted layers ([`eqx_quant.nn.IntLinear`][],
[`eqx_quant.nn.IntConv`][]) call the very same functions on their stored integers, so that the two agree bit for bit.
"""

import functools
import math
from typing import NamedTuple

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array

from ._fake_quant import dequantize_levels
from ._misc import FLOAT32_TINY, compute_dtype, vary_alike
from ._qtensor import QuantizedTensor, shifted_bound


INT32_MAX = 2**31 - 1


def safe_contraction(w_bound: int, x_bound: int) -> int:
    """The longest contraction whose int32 accumulator cannot overflow: `K * w_bound * x_bound <= 2**31 - 1`.

    0 when a single product may already overflow (e.g. two asymmetric 16-bit grids): no integer product then.
    """
    return INT32_MAX // max(1, w_bound * x_bound)


def _common_int(a: Array, b: Array) -> tuple[Array, Array]:
    dtype = np.promote_types(a.dtype, b.dtype)
    return a.astype(dtype), b.astype(dtype)


class LinearSpec(NamedTuple):
    """Static description of an integer matrix-vector product: `chunk`, the longest contraction that int32 holds
    exactly, and `group`, the size of the weight's scale groups along the contraction (`None` for weights with one
    scale per tensor or output channel)."""

    chunk: int
    group: int | None = None


class ConvSpec(NamedTuple):
    """Static description of an integer convolution: the arguments of `jax.lax.conv_general_dilated` that
    `eqx.nn.Conv` uses, and `product_bound`, a bound on `|w * x|` for one weight and one input integer."""

    stride: tuple[int, ...]
    padding: str | tuple[tuple[int, int], ...]
    dilation: tuple[int, ...]
    groups: int
    product_bound: int


def _bound(tensor: QuantizedTensor) -> int:
    """A static bound on `|level - zero_point|` for the operand's grid."""
    return shifted_bound(tensor.qmin, tensor.qmax, tensor.zero_point is not None)


def plan(
    layer: eqx.Module, weight_shape: tuple[int, ...], w: QuantizedTensor, x: QuantizedTensor
) -> LinearSpec | ConvSpec | None:
    """Whether `layer` (an `eqx.nn.Linear` or `eqx.nn.Conv`) computes its forward pass on integers, and how: the one
    decision that the quantized layers and their converted integer layers share, so that both take the same path.

    The integer path needs an input with one scale (and zero point) for the whole input, and a weight with one scale
    per tensor or per output channel, or (linear layers) per group along the contraction; a convolution needs zero
    padding; and int32 must hold the sums exactly: a linear layer splits longer contractions into chunks (groups must
    fit in one), a convolution is not split. Otherwise (`None`) the layer computes in floating point.
    """
    if not x.layout.is_per_tensor() or x.layout.stacked:
        return None
    w_bound, x_bound = _bound(w), _bound(x)
    chunk = safe_contraction(w_bound, x_bound)
    if chunk < 1 or w.layout.stacked:
        return None
    channels = w.layout.channel_axes(weight_shape)
    grouped = w.layout.group_size is not None
    if isinstance(layer, eqx.nn.Linear):
        if grouped:
            return LinearSpec(chunk, w.layout.group_size) if w.layout.group_size <= chunk else None
        return LinearSpec(chunk) if channels in ((), (0,)) else None
    if isinstance(layer, eqx.nn.Conv):
        if grouped or channels not in ((), (0,)) or layer.padding_mode != "ZEROS":
            return None
        if math.prod(weight_shape[1:]) > chunk:
            return None
        padding = layer.padding if isinstance(layer.padding, str) else tuple(tuple(p) for p in layer.padding)
        return ConvSpec(tuple(layer.stride), padding, tuple(layer.dilation), layer.groups, w_bound * x_bound)
    return None


_BIAS_GRID = 2.0**-16


def _rescale(acc: Array, w_scale: Array, x_scale: Array, bias: Array | None) -> Array:
    """`(acc + bias / s) * s` with `s = scale_w * scale_x` broadcast along the output channels (axis 0).

    The bias joins the accumulator in its units, as `round(bias * (1 / s) * 2**16) * 2**-16` (a grid 65536 times
    finer than the accumulator's, so the bias keeps about 16 more bits than integer runtimes keep), and the sum is
    rescaled by a single multiplication. No rounded product feeds a sum: XLA contracts a product and a sum into a fused
    multiply-add under `jit` but not in eager mode, and a multiplication by a power of two is exact either way, so
    eager and compiled calls give the same bits.

    Where `s` is below the smallest normal float32 (it flushes to zero: an all-zero input gets the smallest normal
    scale) or the bias in accumulator units overflows, the accumulator is far below the bias's last bit
    (`|acc * s| <= 2**31 * s`), and the output is the bias itself; without a bias (or with a zero one) it is
    `(acc * scale_w) * scale_x`, which keeps a product that `s` alone would lose.
    """
    w_scale = w_scale.reshape((-1,) + (1,) * (acc.ndim - 1))
    x_scale = x_scale.reshape(())
    scale = w_scale * x_scale
    acc = acc.astype(jnp.float32)
    split = (acc * w_scale) * x_scale
    if bias is None:
        return jnp.where(scale >= FLOAT32_TINY, acc * scale, split)
    bias = bias.astype(jnp.float32).reshape(acc.shape[:1] + (1,) * (acc.ndim - 1))
    units = bias * (1 / scale) * (1 / _BIAS_GRID)
    fits = jnp.isfinite(units)  # False where `scale` flushed to zero or the bias overflows the accumulator's units
    y = (acc + jnp.round(jnp.where(fits, units, 0.0)) * _BIAS_GRID) * scale
    return jnp.where(fits, y, jnp.where(bias == 0, split, bias))


_NAN_BITS = 0x7FC00001  # a NaN whose bits `opaque` may flip into another NaN; no number has them


def opaque(y: Array) -> Array:
    """`y` (float32) unchanged, through an integer operation that the compiler cannot see through: an exclusive or of
    its bits with a zero computed from them.

    An integer layer's output is a rounded product. Under `jit`, XLA's CPU backend contracts a product that feeds an
    addition into one fused multiply-add, which rounds once where the product and the sum rounded separately; the
    addition may be the model's own (a residual `h + layer(x)`), and whether it is contracted depends on how the
    whole program is fused, which differs between a quantized and a converted model. Behind this operation no
    addition can take the product apart, so that both compute the same bits.
    """
    bits = jax.lax.bitcast_convert_type(y, jnp.int32)
    bits = bits ^ (bits == _NAN_BITS).astype(jnp.int32)
    return jax.lax.bitcast_convert_type(bits, jnp.float32)


def _with_nan(y: Array, nan: Array | None) -> Array:
    """`y` with NaN where `nan` (broadcast against it) is true."""
    return y if nan is None else jnp.where(nan, jnp.nan, y)


def int_linear(
    spec: LinearSpec,
    w: Array,
    x: Array,
    w_scale: Array,
    x_scale: Array,
    bias: Array | None,
    w_nan: Array | None = None,
    x_nan: Array | None = None,
) -> Array:
    """`w @ x` on integers with int32 accumulation, plus the bias on the accumulator's grid, rescaled once.

    Contractions longer than `spec.chunk` are split into chunks whose int32 results are summed in float32. `w_nan`
    and `x_nan` mark the operands' NaN entries (an integer holds none): as in the float product, a NaN in `x` makes
    every output NaN, and a NaN in row `i` of `w` makes output `i` NaN.
    """
    # `x` is the left operand: under `jax.vmap` over inputs, XLA's CPU integer product is faster with the batch as
    # the rows of its result than as the columns (as `w @ x` would give). An exact sum does not depend on the order.
    x, w = _common_int(x, w)
    if spec.group is not None:
        y = _grouped_sum(spec.group, w, x, w_scale)
        y = _rescale(y, jnp.ones((), jnp.float32), x_scale, bias)
        return opaque(_with_nans(y, w_nan, x_nan))
    dims = (((0,), (1,)), ((), ()))
    k = x.shape[0]
    if k <= spec.chunk:
        acc = jax.lax.dot_general(x, w, dims, preferred_element_type=jnp.int32)
    else:
        acc = jnp.zeros(w.shape[0], jnp.float32)
        for start in range(0, k, spec.chunk):
            part = jax.lax.dot_general(
                x[start : start + spec.chunk], w[:, start : start + spec.chunk], dims,
                preferred_element_type=jnp.int32,
            )  # fmt: skip
            acc = acc + part.astype(jnp.float32)
    return opaque(_with_nans(_rescale(acc, w_scale, x_scale, bias), w_nan, x_nan))


def _rows(nan: Array) -> Array:
    """Whether each row (index along the first axis) of a weight's NaN mask holds a NaN."""
    return jnp.any(nan, axis=tuple(range(1, nan.ndim)))


def _with_nans(y: Array, w_nan: Array | None, x_nan: Array | None) -> Array:
    """A linear layer's output `y` with NaN where a NaN weight entry (its row) or input entry (all) reaches it."""
    y = _with_nan(y, None if w_nan is None else _rows(w_nan))
    return _with_nan(y, None if x_nan is None else jnp.any(x_nan))


def _grouped_sum(group: int, w: Array, x: Array, w_scale: Array) -> Array:
    """`sum_j scale_w[:, j] * (w[:, j] @ x[j])` over the groups `j` of the contraction, in the units of `x`.

    Each group's product is an exact int32 sum; it is scaled by its group's weight scale, and the scaled sums are
    added in float32, each product rounded before it is added. Under `jit`, XLA would fuse a product feeding the
    sum into a fused multiply-add, which rounds once where the eager computation rounds twice; `opaque` stands
    between them, so that eager and compiled calls give the same bits.
    """
    out, groups = w.shape[0], w.shape[1]
    x = x.reshape(groups, group)
    dims = (((1,), (2,)), ((0,), (1,)))  # contract within a group; groups along the batch axis
    acc = jax.lax.dot_general(x, w, dims, preferred_element_type=jnp.int32)  # (groups, out)
    terms = opaque(acc.astype(jnp.float32) * w_scale.reshape(out, groups).T)
    return jnp.sum(terms, axis=0)


FLOAT32_EXACT = 2**24  # every integer of magnitude up to this is a float32


def int_conv(
    spec: ConvSpec,
    w: Array,
    x: Array,
    w_scale: Array,
    x_scale: Array,
    bias: Array | None,
    w_nan: Array | None = None,
    x_nan: Array | None = None,
) -> Array:
    """The convolution of integers with int32 accumulation, plus the bias on the accumulator's grid, rescaled once.

    `w_nan` and `x_nan` mark the operands' NaN entries, as for `int_linear`: as in the float
    convolution, a NaN in `x` makes NaN every output whose window covers it (in every output channel of its group),
    and a NaN in the weight of an output channel makes that whole channel NaN.

    When every partial sum is at most `2**24` in magnitude (`K * product_bound <= 2**24` for a contraction of
    length `K`: symmetric 8-bit convolutions up to `K = 1024`, up to `K = 514` with an asymmetric 8-bit input), a
    float32 convolution of the same integers computes every sum exactly, in any order, and so gives the int32 result
    bit for bit. On CPU that convolution is used instead, at `Precision.HIGHEST`: XLA's CPU integer convolution is an
    order of magnitude slower than its float one. Other platforms, whose float convolutions may use reduced precision
    or transform-based algorithms, keep the integer convolution.
    """
    lhs, rhs = _common_int(x[None], w)
    conv = functools.partial(
        jax.lax.conv_general_dilated, window_strides=spec.stride, padding=spec.padding, rhs_dilation=spec.dilation,
        feature_group_count=spec.groups,
    )  # fmt: skip

    def integer(lhs, rhs):
        return conv(lhs, rhs, preferred_element_type=jnp.int32).astype(jnp.float32)

    def exact_float(lhs, rhs):
        f32 = jnp.float32
        return conv(lhs.astype(f32), rhs.astype(f32), precision=jax.lax.Precision.HIGHEST, preferred_element_type=f32)

    if math.prod(rhs.shape[1:]) * spec.product_bound <= FLOAT32_EXACT:
        acc = jax.lax.platform_dependent(lhs, rhs, cpu=exact_float, default=integer)
    else:
        acc = integer(lhs, rhs)
    y = _rescale(acc[0], w_scale, x_scale, bias)
    if w_nan is not None:
        y = _with_nan(y, _rows(w_nan).reshape((-1,) + (1,) * (y.ndim - 1)))
    if x_nan is not None:
        # The windows that cover a NaN: a convolution of the NaN mask with a kernel of ones, one output per group.
        ones = jnp.ones((spec.groups,) + w.shape[1:], jnp.float32)
        hits = conv(x_nan.astype(jnp.float32)[None], ones, precision=jax.lax.Precision.HIGHEST)[0] > 0
        per_group = y.reshape((spec.groups, -1) + y.shape[1:])
        y = _with_nan(per_group, hits[:, None]).reshape(y.shape)
    return opaque(y)


def _float_linear(spec: LinearSpec, w: Array, x: Array, bias: Array | None) -> Array:
    y = w @ x
    return y if bias is None else y + bias


def _float_conv(spec: ConvSpec, w: Array, x: Array, bias: Array | None) -> Array:
    y = jax.lax.conv_general_dilated(
        x[None], w, window_strides=spec.stride, padding=spec.padding, rhs_dilation=spec.dilation,
        feature_group_count=spec.groups,
    )[0]  # fmt: skip
    return y if bias is None else y + bias


_FLOAT_OPS = {LinearSpec: _float_linear, ConvSpec: _float_conv}
_INT_OPS = {LinearSpec: int_linear, ConvSpec: int_conv}


def integer_forward(
    spec: LinearSpec | ConvSpec,
    wq: Array,
    xq: Array,
    bias: Array | None,
    w: QuantizedTensor,
    x: QuantizedTensor,
    w_nan: Array | None,
    x_nan: Array | None,
) -> Array:
    """The integer computation in the forward pass, the float one of the fake-quantized operands for derivatives.

    `wq` and `xq` are the fake-quantized weight and input (`scale * (levels - zero_point)`); `w` and `x` the same
    operands as (unpacked) quantized tensors, `w_nan` and `x_nan` where they are NaN. The value is the integer
    product (or convolution); the derivative is that of the float `wq @ xq + bias`, so that gradients continue
    through the quantizers' straight-through estimators. Only the tangents of `wq` and `xq` (and their dtypes and
    shapes) are used: their values, where the derivative needs them, are rebuilt from the integers, so that under
    `jit` the forward pass never computes them.

    The derivative is given as a JVP rule, which JAX transposes for reverse mode: under `jax.vmap`, the weight's
    gradient is then one matrix product over the batch, as for a float layer, never a per-example outer product
    summed afterwards.
    """
    operands = (w.shifted()[0], x.shifted()[0], w.scale, x.scale, w_nan, x_nan)
    return _integer_forward(spec, *vary_alike(wq, xq, bias, *operands))


def integer_product(
    spec: LinearSpec | ConvSpec,
    w: QuantizedTensor,
    x: QuantizedTensor,
    bias: Array | None,
    w_nan: Array | None,
    x_nan: Array | None,
) -> Array:
    """The integer product (or convolution) that `spec` describes, of quantized tensors: the value of
    `integer_forward`, without a derivative (the computation of the converted layers)."""
    return _INT_OPS[type(spec)](spec, w.shifted()[0], x.shifted()[0], w.scale, x.scale, bias, w_nan, x_nan)


@functools.partial(jax.custom_jvp, nondiff_argnums=(0,))
def _integer_forward(spec, wq, xq, bias, w_int, x_int, w_scale, x_scale, w_nan, x_nan):
    del wq, xq
    return _INT_OPS[type(spec)](spec, w_int, x_int, w_scale, x_scale, bias, w_nan, x_nan)


@_integer_forward.defjvp
def _integer_forward_jvp(spec, primals, tangents):
    wq, xq, bias, w_int, x_int, w_scale, x_scale, w_nan, x_nan = primals
    y = _INT_OPS[type(spec)](spec, w_int, x_int, w_scale, x_scale, bias, w_nan, x_nan)
    float_op = functools.partial(_FLOAT_OPS[type(spec)], spec)

    # The tangent of the float formulation at the fake-quantized operands, which are rebuilt from the integers (bit
    # for bit) inside `jax.checkpoint`: the backward pass keeps the integers and recomputes the float operands where
    # it multiplies with them, so no full-size float copy of them is kept from the forward pass for it (nor made
    # there at all: the forward computes on the integers). The integers and scales carry no derivative of their own:
    # the scales' reaches `wq` and `xq` through the quantizers, and counting it here as well would count it twice.
    @jax.checkpoint
    def tangent(w_int, x_int, w_scale, x_scale, w_nan, x_nan, dw, dx, dbias):
        operands = (_dequantized(w_int, w_scale, w_nan, wq), _dequantized(x_int, x_scale, x_nan, xq), bias)
        return jax.jvp(float_op, operands, (dw, dx, dbias))[1]

    dy = tangent(w_int, x_int, w_scale, x_scale, w_nan, x_nan, *tangents[:3])
    return y, dy.astype(y.dtype)


def _dequantized(values: Array, scale: Array, nan: Array, like: Array) -> Array:
    """`scale * values` (NaN where `nan`) with the dtype and shape of `like`: a fake-quantized operand, from its
    integers minus zero point, computed as [`eqx_quant.fake_quant`][] computes it."""
    compute = compute_dtype(like.dtype)
    operand = _with_nan(dequantize_levels(values.astype(compute), scale, None), nan)
    return operand.astype(like.dtype).reshape(like.shape)
