"""One stored quantized array for every number format: the codes of a tensor on a format's grid, with its scales."""

import math

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, ArrayLike, Bool, Float, Int, Shaped

from ._fake_quant import dequantize_levels, prepare_scale, prepare_zero_point, quantize_levels
from ._format import FloatFormat, Format, IntFormat, decode_scale, encode_scale, int_dtype
from ._layout import Layout
from ._misc import compute_dtype, expand_to_rank, first_where, is_concrete, one_program
from ._packing import pack_bits, unpack_bits
from ._scales import Scales


def shift_levels(levels: Array, zero_point: Array | None, fmt: IntFormat) -> tuple[Array, int]:
    """`levels - zero_point` for levels of an integer grid (a zero point of `None` is 0), in the narrowest integer
    dtype that holds it, and a bound on its magnitude: an operand of the integer products."""
    if zero_point is not None:
        levels = levels.astype(zero_point.dtype) - expand_to_rank(zero_point, levels.ndim)
    lo, hi = shifted_range(fmt, zero_point is not None)
    return levels.astype(int_dtype(lo, hi)), max(-lo, hi)


def shifted_range(fmt: IntFormat, has_zero_point: bool) -> tuple[int, int]:
    """The range of `level - zero_point` for levels and zero points in `[qmin, qmax]`."""
    return (fmt.qmin - fmt.qmax, fmt.qmax - fmt.qmin) if has_zero_point else (fmt.qmin, fmt.qmax)


def _rows(shape: tuple[int, ...]) -> int:
    """The number of rows of packed codes: the first axis of a tensor of rank 2 or more, else one row."""
    return shape[0] if len(shape) >= 2 else 1


class QuantizedArray(eqx.Module):
    """A tensor stored as the codes of a number format, with its scales: what [`eqx_quant.convert`][] keeps of a
    quantized weight, and what every quantizer's `quantize_array` returns.

    The leaves:

    - `values`: the codes, one per element in the tensor's shape: integers (int8, int16 or int32, the narrowest
        that holds the grid) for an integer format, the `ml_dtypes` bit patterns (`uint8`) for a float format. Codes of
        at most 4 bits are packed at their width ([`eqx_quant.pack_bits`][]), row by row along the first axis (a
        tensor of rank 0 or 1 is one row): 2-bit integer grids four per byte, 3-bit ones eight in three bytes, 4-bit
        integers and FP4 elements two per byte; `packed_bits` is then that width.
    - `scale`: the scales, broadcasting against the tensor's view (see [`eqx_quant.Layout`][]), with unit axes where
        they are shared: float32 values (float64 for float64 tensors), one E8M0 byte per block (the exponent plus
        127; 255 is NaN), or one `float8_e4m3fn` byte per block.
    - `zero_point`: the zero points of an asymmetric integer grid (floats holding integers), else `None`.
    - `tensor_scale`: the float32 scale of the whole tensor of two-level formats (NVFP4; float64 for float64
        tensors, as `scale`), else `None`; one per index of the layout's `stacked` leading axes (a traced weight
        stacked along them, one tensor scale per layer), of the shape of those axes.

    The static fields say what the codes mean: `format` (a [`eqx_quant.Format`][]), `layout`, and the `shape` and
    `dtype` of the tensor. Arrays of stacked layers (built with `eqx.filter_vmap`) carry the stack in front of every
    leaf, while the static fields describe one tensor of it, as `eqx.nn.Linear`'s do.

    [`eqx_quant.QuantizedArray.dequantize`][] returns, bit for bit, what the quantizer that made the array returned
    (except where a format without NaN, FP6 or FP4 under a float32 scale, would have to store a NaN: making such an
    array from concrete NaN data raises).
    """

    values: Shaped[Array, "*values_shape"]
    scale: Shaped[Array, "*scale_shape"]
    zero_point: Float[Array, "*zero_point_shape"] | None
    tensor_scale: Float[Array, "*stack"] | None
    format: Format = eqx.field(static=True)
    layout: Layout = eqx.field(static=True)
    shape: tuple[int, ...] = eqx.field(static=True)
    dtype: str = eqx.field(static=True)
    packed_bits: int | None = eqx.field(static=True)

    @property
    def view_shape(self) -> tuple[int, ...]:
        """The shape of the tensor under its layout (with the tiled axis split into tiles)."""
        return self.layout.view_shape(self.shape)

    @property
    def stack_depth(self) -> int:
        """The number of leading axes along which whole tensors are stacked (layers built with `eqx.filter_vmap`)."""
        return self.scale.ndim - len(self.view_shape)

    @property
    def packed(self) -> bool:
        """Whether the codes are packed (`packed_bits` is not `None`)."""
        return self.packed_bits is not None

    @property
    def nbytes(self) -> int:
        """Bytes of the codes and scales (and zero points)."""
        leaves = [a for a in (self.values, self.scale, self.zero_point, self.tensor_scale) if a is not None]
        return sum(leaf.size * leaf.dtype.itemsize for leaf in leaves)

    def _per_tensor(self, fn):
        """`fn` mapped over the stacked axes (see [`eqx_quant.QuantizedArray.stack_depth`][])."""
        for _ in range(self.stack_depth):
            fn = jax.vmap(fn)
        return fn

    def _unpacked(self, values: Array) -> Array:
        """One tensor's codes in its shape."""
        if self.packed_bits is None:
            return values
        rows = _rows(self.shape)
        n = math.prod(self.shape) // rows if rows else 0
        signed = self.format.signed_codes
        return unpack_bits(values, n, self.packed_bits, signed=signed).reshape(self.shape)

    def unpacked(self) -> Shaped[Array, "*stack_and_view_shape"]:
        """The codes, unpacked, with the shape of the view (after the stacked axes, if any)."""
        return self._per_tensor(lambda v: self._unpacked(v).reshape(self.view_shape))(self.values)

    def levels(self) -> Shaped[Array, "*stack_and_view_shape"]:
        """The grid points, with the shape of the view (after the stacked axes, if any): the integers of an integer
        format, the element values of a float format or the half-integers of a stretched grid (in its compute
        dtype)."""
        if isinstance(self.format, IntFormat):
            return self.unpacked()
        return one_program(QuantizedArray._float_levels)(self)

    def _float_levels(self) -> Array:
        return self.format.decode(self.unpacked(), compute_dtype(np.dtype(self.dtype)))

    def scales(self) -> Scales:
        """The scales as the quantizer computed with them (decoded from their stored form), with the stacked axes."""
        tensor_scale = self.tensor_scale
        if self.layout.stacked and tensor_scale is not None:
            tensor_scale = self._per_tensor(lambda t: _on_view(t, len(self.view_shape)))(tensor_scale)
        return Scales(decode_scale(self.format, self.scale, self._compute_dtype), self.zero_point, tensor_scale)

    @property
    def _compute_dtype(self) -> np.dtype:
        return compute_dtype(np.dtype(self.dtype))

    def _dequantize(self) -> Array:
        def one(values, scale, zero_point, tensor_scale):
            levels = self.format.decode(self._unpacked(values).reshape(self.view_shape), self._compute_dtype)
            tensor_scale = _on_view(tensor_scale, len(self.view_shape)) if self.layout.stacked else tensor_scale
            scales = Scales(decode_scale(self.format, scale, self._compute_dtype), zero_point, tensor_scale)
            return dequantize_levels(levels, scales, self.format).reshape(self.shape).astype(self.dtype)

        return self._per_tensor(one)(self.values, self.scale, self.zero_point, self.tensor_scale)

    def dequantize(self) -> Float[Array, "*stack_and_shape"]:
        """`scale * (levels - zero_point)`, reshaped to `shape` (after the stacked axes, if any), in the tensor's
        dtype: bit for bit what the quantizer returned."""
        return one_program(QuantizedArray._dequantize)(self)

    def dequantize_row(self, index: Int[ArrayLike, ""]) -> Float[Array, "*row_shape"]:
        """Row `index` (along the first axis) of [`eqx_quant.QuantizedArray.dequantize`][], computed from that row's
        codes and scales alone (an embedding's lookup). Needs an unstacked array of rank 2 or more."""
        if len(self.shape) < 2 or self.stack_depth:
            raise ValueError(
                f"`dequantize_row` needs an unstacked tensor of rank 2 or more, got shape {self.shape} with "
                f"{self.stack_depth} stacked axes."
            )
        return one_program(QuantizedArray._dequantize_row)(self, jnp.asarray(index))

    def _dequantize_row(self, index: Array) -> Array:
        if self.packed_bits is not None:
            n = math.prod(self.shape[1:])
            row = unpack_bits(self.values[index][None], n, self.packed_bits, signed=self.format.signed_codes)
        else:
            row = self.values[index]
        tile = self.layout.tile_axis(self.shape)
        if tile == 0:  # the row lies in tile `index // group_size` of every column: one scale per element of it
            assert self.layout.group_size is not None
            pick = lambda a: a[index // self.layout.group_size][0]  # noqa: E731
            row_shape = self.shape[1:]
        else:
            pick = lambda a: a[index] if a.shape[0] > 1 else a[0]  # noqa: E731
            row_shape = self.view_shape[1:]
        levels = self.format.decode(row.reshape(row_shape), self._compute_dtype)
        zero_point = None if self.zero_point is None else pick(self.zero_point)
        scales = Scales(decode_scale(self.format, pick(self.scale), self._compute_dtype), zero_point, self.tensor_scale)
        return dequantize_levels(levels, scales, self.format).reshape(self.shape[1:]).astype(self.dtype)

    def shifted(self) -> tuple[Array, int]:
        """The integers minus the zero point (an integer format's), in the view's shape, as the integer products take
        them, and a bound on their magnitude."""
        assert isinstance(self.format, IntFormat)
        return shift_levels(self.unpacked(), self.zero_point, self.format)


def _on_view(tensor_scale: Array | None, rank: int) -> Array | None:
    """A tensor scale broadcasting against a view of rank `rank`: one per index of a layout's stacked axes (its
    leading axes) takes unit axes after them."""
    if tensor_scale is None or not tensor_scale.ndim:
        return tensor_scale
    return tensor_scale.reshape(tensor_scale.shape + (1,) * (rank - tensor_scale.ndim))


def check_storable(x: Array, fmt: Format) -> None:
    """Raises `ValueError` for a concrete `x` holding NaN when `fmt` is a float format with float32 scales and no NaN
    code (FP6, FP4): no code stores it."""
    if isinstance(fmt, FloatFormat) and not fmt.has_nan and fmt.scale == "float32" and is_concrete(x):
        index = first_where(np.isnan(np.asarray(x, np.float32)))
        if index is not None:
            raise ValueError(
                f"`x` holds NaN (at index {index}), which {fmt.element} cannot store under a "
                "per-tensor or per-channel scale."
            )


def quantize_array(
    x: Array, scales: Scales, fmt: Format, layout: Layout, *, pack: bool = True, mask: bool = True
) -> tuple[QuantizedArray, Bool[Array, "*view_shape"] | None]:
    """The [`eqx_quant.QuantizedArray`][] of `x` with `scales` (broadcasting against `layout.view(x)`, as a
    quantizer's `scales` returns them), and where its grid points are NaN (no integer holds NaN: the integer products
    take those positions apart; `None` with `mask=False`). No gradient flows through either.

    `pack` packs codes of at most 4 bits at their width, as stored weights are, while `False` keeps one code per
    element, as the integer products take them.

    Under a layout with `stacked` leading axes, a two-level format's tensor scale is one per index of them: given in
    their shape (or as one for all), stored in their shape.

    Raises `ValueError` for a concrete `x` holding NaN when `fmt` is a float format with float32 scales and no NaN
    code (FP6, FP4).
    """
    x = jax.lax.stop_gradient(x)
    view = layout.view(x)
    compute = compute_dtype(view.dtype)
    scale = prepare_scale(jax.lax.stop_gradient(scales.scale), view.shape, compute, check=fmt.scale == "float32")
    zero_point = scales.zero_point
    zero_point = prepare_zero_point(0 if zero_point is None else jax.lax.stop_gradient(zero_point), view.shape, compute)
    tensor_scale = scales.tensor_scale
    on_view = None
    if tensor_scale is not None:
        tensor_scale = on_view = jax.lax.stop_gradient(jnp.asarray(tensor_scale)).astype(compute)
        if layout.stacked:  # one per stacked tensor: stored in the shape of the stack
            tensor_scale = jnp.broadcast_to(tensor_scale, x.shape[: layout.stacked])
            on_view = _on_view(tensor_scale, view.ndim)
    check_storable(x, fmt)
    levels = quantize_levels(view.astype(compute), Scales(scale, zero_point, on_view), fmt)
    codes = fmt.encode(levels).reshape(x.shape)
    bits = fmt.packed_width if pack else None
    if bits is not None:
        codes = pack_bits(codes.reshape(_rows(x.shape), -1).astype(jnp.int8), bits)
    rank = view.ndim
    array = QuantizedArray(
        codes, encode_scale(fmt, expand_to_rank(scale, rank)),
        None if zero_point is None else expand_to_rank(zero_point, rank), tensor_scale, fmt, layout,
        tuple(x.shape), np.dtype(x.dtype).name, bits,
    )  # fmt: skip
    return array, jnp.isnan(levels) if mask else None


def nan_levels(x: Array, array: QuantizedArray, axes: tuple[int, ...]) -> Bool[Array, "..."]:
    """Whether the grid points of `array` (the quantized `x`, float32 scales) hold a NaN, reduced over `axes` of the
    layout's view of `x` (kept as unit axes): what the integer products need of a NaN mask, computed without one.

    The levels are NaN exactly where `x / scale` is (rounding and clipping keep NaN and make nothing else NaN) or the
    zero point is, and a float maximum propagates NaN: so this is `isnan(max(x / scale))`, which XLA fuses into one
    pass over `x`, where a reduction of a boolean mask makes it write the full-size mask first.
    """
    view = jax.lax.stop_gradient(array.layout.view(x)).astype(array.scale.dtype)
    scaled = view * expand_to_rank(1 / array.scale, view.ndim)
    nan = jnp.isnan(jnp.max(scaled, axis=axes, keepdims=True, initial=-jnp.inf))
    if array.zero_point is not None:
        zero_point = jnp.broadcast_to(array.zero_point, view.shape[: array.zero_point.ndim])
        nan = nan | jnp.isnan(jnp.max(zero_point, axis=axes, keepdims=True, initial=-jnp.inf))
    return nan
