"""Integer matrix products and convolutions with int32 accumulation, shared by training and deployment.

The quantized layers ([`eqx_quant.nn.QuantLinear`][], [`eqx_quant.nn.QuantConv`][]) compute their forward pass with
these functions when both operands are on integer grids, and the converted layers
([`eqx_quant.nn.ConvertedLinear`][], [`eqx_quant.nn.ConvertedConv`][]) call the very same functions on their stored
integers, so that the two agree bit for bit.
"""

import functools
import math
from collections.abc import Callable
from typing import Any, NamedTuple

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array

from ._fake_quant import fake_quant_scales
from ._format import Format, IntFormat
from ._misc import compute_dtype, is_zero_tangent, value_computed_before, vary_alike, whole_along, whole_batch
from ._qarray import QuantizedArray, shifted_range
from ._scales import Scales


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


def _bound(array: QuantizedArray) -> int:
    """A static bound on `|level - zero_point|` for the operand's grid."""
    assert isinstance(array.format, IntFormat)
    lo, hi = shifted_range(array.format, array.zero_point is not None)
    return max(-lo, hi)


def _integer(array: QuantizedArray) -> bool:
    """Whether an operand is on an integer grid with float32 scales, as the integer products take them."""
    return isinstance(array.format, IntFormat) and array.format.scale == "float32"


def integer_grid(quantizer: object) -> bool:
    """Whether `quantizer` puts its operand on an integer grid with float32 scales: what the integer products need of
    both operands (besides the layouts `plan` checks)."""
    fmt = getattr(quantizer, "format", None)
    return isinstance(fmt, IntFormat) and fmt.scale == "float32"


def any_float64(*dtypes: object) -> bool:
    """Whether an operand of a product is float64 (with `jax_enable_x64`), given the operands' dtypes (or their
    names): the product then computes in floating point, on every path (see `plan`)."""
    return any(np.dtype(d) == np.float64 for d in dtypes)


def plan(
    layer: eqx.Module, weight_shape: tuple[int, ...], w: QuantizedArray, x: QuantizedArray
) -> LinearSpec | ConvSpec | None:
    """Whether `layer` (an `eqx.nn.Linear` or `eqx.nn.Conv`) computes its forward pass on integers, and how: the one
    decision that the quantized layers and their converted integer layers share, so that both take the same path.

    The integer path needs two integer grids with float32 scales: an input with one scale (and zero point) for the
    whole input, and a weight with one scale per tensor or per output channel, or (linear layers) per group along the
    contraction; a convolution needs zero padding; and int32 must hold the sums exactly: a linear layer splits longer
    contractions into chunks (groups must fit in one), a convolution is not split. Otherwise (`None`) the layer
    computes in floating point, as it does when either operand is float64 (with `jax_enable_x64`): the integer sums
    are rescaled in float32, and the float product keeps float64's precision.
    """
    if any_float64(w.dtype, x.dtype):
        return None
    if not (_integer(w) and _integer(x)) or not x.layout.is_per_tensor() or x.layout.stacked:
        return None
    w_bound, x_bound = _bound(w), _bound(x)
    chunk = safe_contraction(w_bound, x_bound)
    if chunk < 1 or w.layout.stacked:
        return None
    channels = w.layout.channel_axes(weight_shape)
    grouped = w.layout.group_size is not None
    if isinstance(layer, eqx.nn.Linear):
        if grouped:
            along_contraction = w.layout.tile_axis(weight_shape) == len(weight_shape) - 1
            return (
                LinearSpec(chunk, w.layout.group_size) if along_contraction and w.layout.group_size <= chunk else None
            )
        return LinearSpec(chunk) if channels in ((), (0,)) else None
    if isinstance(layer, eqx.nn.Conv):
        if grouped or channels not in ((), (0,)) or layer.padding_mode != "ZEROS":
            return None
        if math.prod(weight_shape[1:]) > chunk:
            return None
        padding = layer.padding if isinstance(layer.padding, str) else tuple(tuple(p) for p in layer.padding)
        return ConvSpec(tuple(layer.stride), padding, tuple(layer.dilation), layer.groups, w_bound * x_bound)
    return None


def _rescale(acc: Array, w_scale: Array | None, x_scale: Array, bias: Array | None) -> Array:
    """`(acc * scale_w) * scale_x + bias` in float32, `scale_w` broadcast along the output channels (axis 0); `None`
    for an accumulator already in the input's units.

    The two scales multiply the accumulator one after the other, so that a product of scales below float32's
    smallest normal (which the CPU flushes to zero) never stands in for them. The bias is added to the rounded
    product in float32, at full precision. The product passes `opaque` first: XLA would otherwise contract it and the
    sum into a fused multiply-add under `jit` only, and round differently there than in eager mode. A scale tagged
    NaN (see `_tag_nan`) makes its outputs NaN.
    """
    y = acc.astype(jnp.float32)
    if w_scale is not None:
        y = y * w_scale.reshape((-1,) + (1,) * (acc.ndim - 1))
    y = opaque(y * x_scale.reshape(()))
    if bias is None:
        return y
    return y + bias.astype(jnp.float32).reshape(acc.shape[:1] + (1,) * (acc.ndim - 1))


def unfused(y: Array, anchor: Array) -> Array:
    """An integer product's rescaled output `y`, computed before the model's operations that read it (behind a
    conditional: `value_computed_before`, whose derivative is the identity, one conditional also under a `jax.vmap`
    over stacked layers), its predicate read from `anchor` (the weight's scale).

    The rescaling reads other arrays in a quantized layer (scales and NaN masks computed from the float weight) than
    in its converted twin (stored ones). Where XLA fuses it with what the model does next, the two fused loops differ
    around the model's own arithmetic, which the compiler may then contract into fused multiply-adds in one and not in
    the other: a rotary embedding then fused attention (`jax.nn.dot_product_attention`) differed in the last bit of
    one token in eight. Behind the conditional both models compute what follows from the same buffer, alike.
    """
    return value_computed_before(y, anchor)


def _tag_nan(scale: Array, nan: Array | None) -> Array:
    """`scale` with NaN where `nan` (broadcast along its leading axes) is true: the factor that rescales the integer
    sums then makes NaN the outputs that a NaN operand entry reaches, as in the float product. Integers hold no NaN,
    and the scales are small arrays, so this costs nothing on the full-size output."""
    if nan is None:
        return scale
    nan = nan.reshape(nan.shape + (1,) * (scale.ndim - nan.ndim))
    return jnp.where(nan, jnp.asarray(jnp.nan, scale.dtype), scale)  # a per-tensor scale takes the mask's shape


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
    if y.dtype != jnp.float32:  # a float64 bitcast to int32 would gain an axis of two halves
        raise TypeError(f"`opaque` takes float32, got {y.dtype}.")
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
    """`w @ x` on integers with int32 accumulation, rescaled, plus the bias; `unfused` (computed before what reads it).

    Contractions longer than `spec.chunk` are split into chunks whose int32 results are summed in float32. `w_nan`
    and `x_nan` mark where the operands hold NaN (an integer holds none), entry by entry or already reduced (per
    row of `w`, one flag for `x`, as `nan_levels` gives them): as in the float product, a NaN in `x` makes every
    output NaN, and a NaN in row `i` of `w` makes output `i` NaN.
    """
    # `x` is the left operand: under `jax.vmap` over inputs, XLA's CPU integer product is faster with the batch as
    # the rows of its result than as the columns (as `w @ x` would give). An exact sum does not depend on the order.
    x, w = _common_int(x, w)
    w_scale = _tag_nan(w_scale, None if w_nan is None else _rows(w_nan))
    x_scale = _tag_nan(x_scale, None if x_nan is None else jnp.any(x_nan))
    if spec.group is not None:
        return unfused(_rescale(_grouped_sum((w, w_scale), x), None, x_scale, bias), w_scale)
    k = x.shape[0]
    if k <= spec.chunk:
        acc = int_matvec(w, x)
    else:
        acc = jnp.zeros(w.shape[0], jnp.float32)
        for start in range(0, k, spec.chunk):
            part = int_matvec(w[:, start : start + spec.chunk], x[start : start + spec.chunk])
            acc = acc + part.astype(jnp.float32)
    return unfused(_rescale(acc, w_scale, x_scale, bias), w_scale)


def _int_matvec(w: Array, x: Array) -> Array:
    """`w @ x` of integers (`w` of shape `(out, k)`, `x` of shape `(*batch, k)`), with int32 accumulation: shape
    `(*batch, out)`.

    The sums are exact, so the formulation is free, and it is chosen by the batch it is computed for: `jax.vmap`
    passes its batch on to this function (see `whole_batch`), so that a layer written for one example sees all the
    examples of the call. XLA's CPU integer product of a single row (`batch` of one example: decoding, one token at a
    time) takes a path several times slower than for two rows, so on CPU a single row is multiplied as two, with a
    row of zeros, and the first row of the result is kept; every other batch, and every other platform, runs the
    one product.
    """
    if math.prod(x.shape[:-1]) != 1:
        return _int_matmul(w, x)
    return jax.lax.platform_dependent(w, x, cpu=_int_matvec_as_two_rows, default=_int_matmul)


int_matvec = whole_batch(_int_matvec, batched_output=True)


def _int_matmul(w: Array, x: Array) -> Array:
    dims = (((x.ndim - 1,), (1,)), ((), ()))
    return jax.lax.dot_general(x, w, dims, preferred_element_type=jnp.int32)


def _int_matvec_as_two_rows(w: Array, x: Array) -> Array:
    row = x.reshape(1, x.shape[-1])
    y = _int_matmul(w, jnp.concatenate([row, jnp.zeros_like(row)]))
    return y[0].reshape(x.shape[:-1] + w.shape[:1])


def _rows(nan: Array) -> Array:
    """Whether each row (index along the first axis) of a weight's NaN mask holds a NaN."""
    return jnp.any(nan, axis=tuple(range(1, nan.ndim)))


def _grouped_sum_of(weight: tuple[Array, Array], x: Array) -> Array:
    """`sum_j scale_w[:, j] * (w[:, j] @ x[j])` over the groups `j` of the contraction, in the units of `x`, for
    `weight = (w, scale_w)` with `w` of shape `(out, groups, group)` and `x` of shape `(*batch, in)`.

    Each group's product is an exact int32 sum; it is scaled by its group's weight scale, and the scaled sums are
    added in float32 in the groups' order (`sum_in_order`), each product rounded before it is added. Under `jit`,
    XLA would fuse a product feeding the sum into a fused multiply-add, which rounds once where the eager computation
    rounds twice; `opaque` stands between them, so that eager and compiled calls give the same bits. The sums are
    computed for the whole batch of a `jax.vmap` at once (`whole_batch`), with the groups leading: mapped as it is,
    the product's batch axis came out in front of the groups', and moving the products (groups x batch x outputs)
    there and back cost as much as computing them.
    """
    w, w_scale = weight
    out, groups, group = w.shape
    batch = x.shape[:-1]
    xs = jnp.moveaxis(x.reshape(-1, groups, group), 1, 0)  # (groups, examples, group)
    # Every device needs all the groups for its outputs (the float product gathers them too).
    xs = whole_along(xs, 0)
    dims = (((2,), (2,)), ((0,), (0,)))  # contract within a group; groups along the batch axis
    acc = group_sums(xs, jnp.moveaxis(w, 1, 0), dims, group)  # (groups, examples, out)
    terms = opaque(acc * jnp.moveaxis(w_scale.reshape(out, groups), 1, 0)[:, None, :])
    return sum_in_order(terms).reshape(batch + (out,))


_grouped_sum = whole_batch(_grouped_sum_of, batched_output=True)


def group_sums(lhs: Array, rhs: Array, dims: Any, length: int) -> Array:
    """The `dot_general` of two integer arrays whose sums run over `length` elements (the tiles of a grouped
    product), as float32: exact either way.

    With 8-bit integers and tiles of at most 1024, every partial sum is an integer within `2**24`, which float32
    holds exactly, so a float32 product at `Precision.HIGHEST` gives the int32 one bit for bit, summed in any order.
    On CPU that product is used: XLA's CPU integer product of many short tiles (a batch of products each summing
    32 elements) is half as fast again as its float one. Other platforms keep the int32 product."""
    integer, exact_float = _products(dims)
    bound = (jnp.iinfo(lhs.dtype).max + 1) * (jnp.iinfo(rhs.dtype).max + 1)  # the largest |product| of two levels
    if length * bound > FLOAT32_EXACT:
        return integer(lhs, rhs)
    return jax.lax.platform_dependent(lhs, rhs, cpu=exact_float, default=integer)


@functools.cache
def _products(dims: Any) -> tuple[Callable[[Array, Array], Array], Callable[[Array, Array], Array]]:
    """The int32 and the exact float32 `dot_general` of `group_sums`, made once for each `dims`: the branches of
    `jax.lax.platform_dependent`, which an eager call compiles again for branches it has not seen."""

    def integer(lhs: Array, rhs: Array) -> Array:
        return jax.lax.dot_general(lhs, rhs, dims, preferred_element_type=jnp.int32).astype(jnp.float32)

    def exact_float(lhs: Array, rhs: Array) -> Array:
        f32 = jnp.float32
        return jax.lax.dot_general(lhs.astype(f32), rhs.astype(f32), dims, precision=jax.lax.Precision.HIGHEST,
                                   preferred_element_type=f32)  # fmt: skip

    return integer, exact_float


@jax.jit  # one call when run eagerly, not one per term
def sum_in_order(terms: Array) -> Array:
    """The sum of `terms` along their leading axis, added one after another, first to last.

    A reduction (`jnp.sum`) leaves the order of its additions to the compiler, and XLA's CPU backend chose another
    order for a reduction fused with the multiplication that computes its terms than for the same reduction on its
    own (eager and compiled grouped products differed in the last bit, in 4 of 30 shapes tried). Additions written out
    one by one are not reassociated: every program sums them alike."""
    total = terms[0]
    for term in terms[1:]:
        total = total + term
    return total


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
    """The convolution of integers with int32 accumulation, rescaled, plus the bias; `unfused`.

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
    conv, integer, exact_float = _convolutions(spec)
    if math.prod(rhs.shape[1:]) * spec.product_bound <= FLOAT32_EXACT:
        acc = jax.lax.platform_dependent(lhs, rhs, cpu=exact_float, default=integer)
    else:
        acc = integer(lhs, rhs)
    y = _rescale(acc[0], _tag_nan(w_scale, None if w_nan is None else _rows(w_nan)), x_scale, bias)
    if x_nan is not None:
        # The windows that cover a NaN: a convolution of the NaN mask with a kernel of ones, one output per group.
        ones = jnp.ones((spec.groups,) + w.shape[1:], jnp.float32)
        hits = conv(x_nan.astype(jnp.float32)[None], ones, precision=jax.lax.Precision.HIGHEST)[0] > 0
        per_group = y.reshape((spec.groups, y.shape[0] // spec.groups) + y.shape[1:])  # not -1: `y` may be empty
        y = _with_nan(per_group, hits[:, None]).reshape(y.shape)
    return unfused(y, w_scale)


@functools.cache
def _convolutions(spec: ConvSpec) -> tuple[Callable[..., Array], ...]:
    """The convolution of `spec`, and its int32 and exact float32 forms of `int_conv`, made once for each `spec`
    (see `_products`)."""
    conv = functools.partial(
        jax.lax.conv_general_dilated, window_strides=spec.stride, padding=spec.padding, rhs_dilation=spec.dilation,
        feature_group_count=spec.groups,
    )  # fmt: skip

    def integer(lhs: Array, rhs: Array) -> Array:
        return conv(lhs, rhs, preferred_element_type=jnp.int32).astype(jnp.float32)

    def exact_float(lhs: Array, rhs: Array) -> Array:
        f32 = jnp.float32
        return conv(lhs.astype(f32), rhs.astype(f32), precision=jax.lax.Precision.HIGHEST, preferred_element_type=f32)

    return conv, integer, exact_float


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
    w: QuantizedArray,
    x: QuantizedArray,
    w_nan: Array | None,
    x_nan: Array | None,
    w_float: Array,
    x_float: Array,
) -> Array:
    """The integer computation in the forward pass, the float one of the fake-quantized operands for derivatives.

    `wq` and `xq` carry the fake-quantized weight's and input's derivatives (their values are not used: the layers
    pass the operands themselves, with `fake_quant`'s derivatives); `w` and `x` the same operands as (unpacked)
    quantized tensors, `w_nan` and `x_nan` where they are NaN, and `w_float` and `x_float` the
    float operands that all of these were computed from. The value is the integer product (or convolution); the
    derivative is that of the float `wq @ xq + bias`, so that gradients continue through the quantizers'
    straight-through estimators. Only the tangents of `wq` and `xq` (and their dtypes and shapes) are used: their
    values, where the derivative needs them, are computed again from the float operands (which the quantizers' own
    backward passes keep anyway), so that under `jit` the forward pass never computes them and keeps nothing more
    for the backward pass.

    The derivative is given as a JVP rule, which JAX transposes for reverse mode: under `jax.vmap`, the weight's
    gradient is then one matrix product over the batch, as for a float layer, never a per-example outer product
    summed afterwards.
    """
    operands = (w.shifted()[0], x.shifted()[0], w.scale, x.scale, w_nan, x_nan)
    floats = (_FloatOperand.of(w_float, w), _FloatOperand.of(x_float, x))
    return _integer_forward(spec, *vary_alike(wq, xq, bias, *operands), *floats)


class _FloatOperand(eqx.Module):
    """What a fake-quantized operand is computed from: the float operand under the layout's view, its scales as the
    integers were computed with, and the format."""

    view: Array
    scales: Scales
    format: Format = eqx.field(static=True)

    @classmethod
    def of(cls, x: Array, array: QuantizedArray) -> "_FloatOperand":
        return cls(array.layout.view(x), array.scales(), array.format)

    def fake_quantized(self, like: Array) -> Array:
        """The fake-quantized operand, computed by [`eqx_quant.fake_quant`][]'s own function (so that a second
        derivative passes its straight-through estimator), with the dtype and shape of `like`."""
        view = self.view.astype(compute_dtype(like.dtype))
        return fake_quant_scales(view, self.scales, self.format).astype(like.dtype).reshape(like.shape)


def integer_product(
    spec: LinearSpec | ConvSpec,
    w: QuantizedArray,
    x: QuantizedArray,
    bias: Array | None,
    w_nan: Array | None,
    x_nan: Array | None,
) -> Array:
    """The integer product (or convolution) that `spec` describes, of quantized tensors: the value of
    `integer_forward`, without a derivative (the computation of the converted layers)."""
    return _INT_OPS[type(spec)](spec, w.shifted()[0], x.shifted()[0], w.scale, x.scale, bias, w_nan, x_nan)


@functools.partial(jax.custom_jvp, nondiff_argnums=(0,))
def _integer_forward(spec, wq, xq, bias, w_int, x_int, w_scale, x_scale, w_nan, x_nan, w_float, x_float):
    del wq, xq, w_float, x_float
    return _INT_OPS[type(spec)](spec, w_int, x_int, w_scale, x_scale, bias, w_nan, x_nan)


def _integer_forward_jvp(spec, primals, tangents):
    wq, xq, *_, w_float, x_float = primals
    dw, dx, dbias = (None if is_zero_tangent(t) else t for t in tangents[:3])
    # The value through the function itself, so that a derivative of this rule (a second derivative) uses this rule.
    y = _integer_forward(spec, *primals)
    float_op = functools.partial(_FLOAT_OPS[type(spec)], spec)

    # The tangent of the float formulation at the fake-quantized operands. The product is bilinear, so the tangent is
    # `dw @ xq + wq @ dx` (plus `dbias`), written out: no primal product is traced only to be discarded, and an
    # operand without a tangent (the data fed to the first layer, a frozen weight) costs no product at all. The
    # operands are computed again from the float ones, bit for bit, inside `jax.checkpoint`: the backward pass keeps
    # no copy of them (nor of the integers or their NaN masks) from the forward pass, and XLA fuses their computation
    # into the loops that read them. The integers and scales carry no derivative of their own: the scales' reaches
    # `wq` and `xq` through the quantizers, and counting it here as well would count it twice. The float operands'
    # tangents are not read either; they carry their derivatives into this rule's own derivative (a second
    # derivative), where the operands pass `fake_quant`'s straight-through estimator.
    @jax.checkpoint
    def tangent(w_float, x_float, dw, dx):
        terms = []
        if dw is not None:
            terms.append(float_op(dw, x_float.fake_quantized(xq), None))
        if dx is not None:
            terms.append(float_op(w_float.fake_quantized(wq), dx, None))
        return terms

    terms = tangent(w_float, x_float, dw, dx)
    if dbias is not None:
        terms.append(jnp.broadcast_to(dbias, y.shape))
    dy = functools.reduce(jnp.add, terms) if terms else jnp.zeros_like(y)
    return y, dy.astype(y.dtype)


_integer_forward.defjvp(_integer_forward_jvp, symbolic_zeros=True)
