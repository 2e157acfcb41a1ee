"""A tensor stored as integers on a quantization grid."""

import math

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, ArrayLike, Bool, Float, Int, Integer

from ._fake_quant import dequantize_levels, prepare_scale, prepare_zero_point, quantize_levels, scaled
from ._layout import Layout
from ._misc import compute_dtype, expand_to_rank
from ._packing import PACKED_WIDTHS, pack_bits, unpack_bits


def int_dtype(lo: int, hi: int) -> np.dtype:
    """The narrowest of int8, int16 and int32 that holds every integer in `[lo, hi]`."""
    for dtype in (np.int8, np.int16, np.int32):
        info = np.iinfo(dtype)
        if info.min <= lo and hi <= info.max:
            return np.dtype(dtype)
    raise ValueError(f"The integer range [{lo}, {hi}] does not fit in int32.")


def shifted_range(qmin: int, qmax: int, has_zero_point: bool) -> tuple[int, int]:
    """The range of `level - zero_point` for levels and zero points in `[qmin, qmax]`."""
    return (qmin - qmax, qmax - qmin) if has_zero_point else (qmin, qmax)


def shifted_bound(qmin: int, qmax: int, has_zero_point: bool) -> int:
    """A bound on `|level - zero_point|`: what the int32 bound of the integer products multiplies."""
    lo, hi = shifted_range(qmin, qmax, has_zero_point)
    return max(-lo, hi)


def levels_of(
    view: Array, scale: float | Array, zero_point: int | Array, qmin: int, qmax: int
) -> tuple[Array, Array, Array | None]:
    """`(levels, scale, zero_point)` of `view` on a grid, computed exactly as [`eqx_quant.fake_quant`][] computes them
    (the levels as floats of the compute dtype; the zero point `None` when it is 0). No gradient flows through them."""
    view, scale, zero_point = (
        jax.lax.stop_gradient(a) if isinstance(a, jax.Array) else a for a in (view, scale, zero_point)
    )
    compute = compute_dtype(view.dtype)
    scale = prepare_scale(scale, view.shape, compute)
    zero_point = prepare_zero_point(zero_point, view.shape, compute)
    return quantize_levels(view.astype(compute), scale, zero_point, qmin, qmax), scale, zero_point


def shift_levels(levels: Array, zero_point: Array | None, qmin: int, qmax: int) -> tuple[Array, int]:
    """`levels - zero_point` for levels in `[qmin, qmax]` (a zero point of `None` is 0), in the narrowest integer dtype
    that holds it, and a bound on its magnitude: an operand of the integer products."""
    if zero_point is not None:
        levels = levels.astype(zero_point.dtype) - expand_to_rank(zero_point, levels.ndim)
    lo, hi = shifted_range(qmin, qmax, zero_point is not None)
    return levels.astype(int_dtype(lo, hi)), shifted_bound(qmin, qmax, zero_point is not None)


def packed_width(qmin: int, qmax: int) -> int | None:
    """The width at which a grid is packed: the narrowest of 2, 3 and 4 bits whose signed (`qmin < 0`) or unsigned
    range holds `[qmin, qmax]`, or `None` for a wider grid (stored as int8, int16 or int32)."""
    for bits in PACKED_WIDTHS:
        half = 1 << (bits - 1)
        if (-half <= qmin and qmax < half) if qmin < 0 else qmax < 2 * half:
            return bits
    return None


class QuantizedTensor(eqx.Module):
    """A tensor stored as integers on a quantization grid, with its float scale and zero point.

    The integers are `clip(round(x / scale) + zero_point, qmin, qmax)`, computed by the same arithmetic as
    [`eqx_quant.fake_quant`][], so that [`eqx_quant.nn.QuantizedTensor.dequantize`][] returns, bit for bit, what the
    fake quantizer returned. Grids of at most 4 bits are packed at their width, row by row along the first axis
    ([`eqx_quant.pack_bits`][]): 2-bit grids (`[-2, 1]` or within `[0, 3]`) four values per byte, 3-bit grids
    (`[-4, 3]` or within `[0, 7]`) eight values in three bytes, 4-bit grids two values per byte; wider grids use the
    narrowest of int8, int16 and int32. `packed_bits` is the packed width, or `None` for unpacked integers. `layout`
    (an [`eqx_quant.Layout`][]) says which elements share a scale: it is stored, never guessed from shapes.
    """

    values: Integer[Array, "*values_shape"]
    scale: Float[Array, "*scale_shape"]
    zero_point: Float[Array, "*zero_point_shape"] | None
    shape: tuple[int, ...] = eqx.field(static=True)
    layout: Layout = eqx.field(static=True)
    qmin: int = eqx.field(static=True)
    qmax: int = eqx.field(static=True)
    packed_bits: int | None = eqx.field(static=True)
    dtype: str = eqx.field(static=True)

    @property
    def view_shape(self) -> tuple[int, ...]:
        """The shape of the levels: `shape`, or for groups `shape[:-1] + (shape[-1] // group_size, group_size)`."""
        return self.layout.view_shape(self.shape)

    @property
    def stack_depth(self) -> int:
        """The number of leading axes along which whole tensors are stacked: the leaves of a tensor converted from a
        layer built with `eqx.filter_vmap` (and run with `jax.lax.scan`) carry the stack in front, while the static
        fields (`shape`, `layout`, ...) describe one tensor of it, as `eqx.nn.Linear`'s do."""
        return self.scale.ndim - len(self.view_shape)

    def _per_tensor(self, fn):
        """`fn` mapped over the stacked axes (see [`eqx_quant.nn.QuantizedTensor.stack_depth`][])."""
        for _ in range(self.stack_depth):
            fn = jax.vmap(fn)
        return fn

    @property
    def packed(self) -> bool:
        """Whether the integers are packed (`packed_bits` is not `None`)."""
        return self.packed_bits is not None

    def _unpack(self, rows: Array) -> Array:
        """The levels of packed `rows` (shape `(rows, bytes)`), one row of the view each, as `(rows, values)`."""
        assert self.packed_bits is not None
        per_row = math.prod(self.view_shape[1:]) if self.view_shape else 1
        return unpack_bits(rows, per_row, self.packed_bits, signed=self.qmin < 0)

    def levels(self) -> Int[Array, "*stack_and_view_shape"]:
        """The integer levels, unpacked, with the shape of the view (after the stacked axes, if any)."""
        if self.packed_bits is None:
            return self.values
        return self._per_tensor(lambda v: self._unpack(v).reshape(self.view_shape))(self.values)

    def dequantize(self) -> Float[Array, "*stack_and_shape"]:
        """`scale * (levels - zero_point)`, reshaped to `shape` (after the stacked axes, if any): the fake-quantized
        tensor."""

        def one(levels, scale, zero_point):
            levels = levels.astype(scale.dtype)
            return dequantize_levels(levels, scale, zero_point).reshape(self.shape).astype(self.dtype)

        return self._per_tensor(one)(self.levels(), self.scale, self.zero_point)

    def dequantize_row(self, index: Int[ArrayLike, ""]) -> Float[Array, "*row_shape"]:
        """Row `index` (along the first axis) of [`eqx_quant.nn.QuantizedTensor.dequantize`][], computed from that
        row's integers alone."""
        row_shape = self.view_shape[1:]
        if self.packed_bits is not None:
            levels = self._unpack(self.values[index][None]).reshape(row_shape)
        else:
            levels = self.values[index]
        pick = lambda a: a[index] if a.shape[0] > 1 else a[0]  # noqa: E731
        zero_point = None if self.zero_point is None else pick(self.zero_point)
        row = dequantize_levels(levels.astype(self.scale.dtype), pick(self.scale), zero_point)
        return row.reshape(self.shape[1:]).astype(self.dtype)

    def shifted(self) -> tuple[Array, int]:
        """The integers minus the zero point, as [`eqx_quant.nn.QuantLinear`][]'s integer forward computes them,
        and a bound on their magnitude."""
        return shift_levels(self.levels(), self.zero_point, self.qmin, self.qmax)

    @property
    def nbytes(self) -> int:
        """Bytes of the integers, scales and zero points."""
        leaves = [self.values, self.scale] + ([] if self.zero_point is None else [self.zero_point])
        return sum(leaf.size * leaf.dtype.itemsize for leaf in leaves)


def quantize_tensor(
    x: Array,
    scale: float | Array,
    zero_point: int | Array,
    qmin: int,
    qmax: int,
    layout: Layout,
    *,
    pack: bool = True,
    mask: bool = True,
) -> tuple[QuantizedTensor, Bool[Array, "*view_shape"] | None]:
    """The [`eqx_quant.nn.QuantizedTensor`][] of `x` on a grid, and where its levels are NaN (no integer holds NaN: the
    integer products take those positions apart; `None` with `mask=False`). No gradient flows through either.

    `scale` and `zero_point` broadcast against `layout.view(x)` (a zero point of the int 0 for symmetric grids), as a
    fake quantizer's `params` returns them; `pack` packs grids of at most 4 bits ([`eqx_quant.pack_bits`][]), as
    stored weights are, while `False` keeps one integer per element, as the integer products take them.
    """
    view = layout.view(x)
    levels, scale, zp = levels_of(view, scale, zero_point, qmin, qmax)
    rank = len(view.shape)
    scale = scale.reshape((1,) * (rank - scale.ndim) + scale.shape)
    zp = None if zp is None else zp.reshape((1,) * (rank - zp.ndim) + zp.shape)
    bits = packed_width(qmin, qmax) if pack else None
    if bits is not None:
        rows = view.shape[0] if rank else 1
        values = pack_bits(levels.reshape(rows, -1).astype(jnp.int8), bits)
    else:
        values = levels.astype(int_dtype(qmin, qmax))
    tensor = QuantizedTensor(values, scale, zp, tuple(x.shape), layout, qmin, qmax, bits, np.dtype(x.dtype).name)
    return tensor, jnp.isnan(levels) if mask else None


def nan_levels(x: Array, tensor: QuantizedTensor, axes: tuple[int, ...]) -> Bool[Array, "..."]:
    """Whether the levels of `tensor` (the quantized `x`) hold a NaN, reduced over `axes` of the layout's view of `x`
    (kept as unit axes): what the integer products need of a NaN mask, computed without one.

    The levels are NaN exactly where `x / scale` is (rounding and clipping keep NaN and make nothing else NaN) or the
    zero point is, and a float maximum propagates NaN: so this is `isnan(max(x / scale))`, which XLA fuses into one
    pass over `x`, where a reduction of a boolean mask makes it write the full-size mask first.
    """
    view = jax.lax.stop_gradient(tensor.layout.view(x)).astype(tensor.scale.dtype)
    nan = jnp.isnan(jnp.max(scaled(view, tensor.scale), axis=axes, keepdims=True, initial=-jnp.inf))
    if tensor.zero_point is not None:
        zero_point = jnp.broadcast_to(tensor.zero_point, view.shape[: tensor.zero_point.ndim])
        nan = nan | jnp.isnan(jnp.max(zero_point, axis=axes, keepdims=True, initial=-jnp.inf))
    return nan
