"""A tensor stored as integers on a quantization grid."""

import math

import equinox as eqx
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, ArrayLike, Float, Int, Integer

from ._fake_quant import dequantize_levels
from ._int_ops import grid_levels, int_dtype, shift_levels
from ._layout import Layout
from ._packing import PACKED_WIDTHS, pack_bits, unpack_bits
from ._quantizers import QuantGrid


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

    @classmethod
    def from_grid(cls, grid: QuantGrid, shape: tuple[int, ...], dtype: np.dtype) -> "QuantizedTensor":
        """Quantizes `grid.view` onto its grid and stores the integers.

        **Arguments:**

        - `grid`: a grid from an [`eqx_quant.AbstractFakeQuantizer`][]'s `grid` method.
        - `shape`: the shape of the tensor (the view may be grouped).
        - `dtype`: the floating dtype that dequantization returns.

        **Returns:**

        A [`eqx_quant.nn.QuantizedTensor`][].
        """
        view, qmin, qmax = grid.view, grid.qmin, grid.qmax
        levels, scale, zp = grid_levels(grid)
        rank = len(view.shape)
        scale = scale.reshape((1,) * (rank - scale.ndim) + scale.shape)
        zp = None if zp is None else zp.reshape((1,) * (rank - zp.ndim) + zp.shape)
        bits = packed_width(qmin, qmax)
        if bits is not None:
            rows = view.shape[0] if rank else 1
            values = pack_bits(levels.reshape(rows, -1).astype(jnp.int8), bits)
        else:
            values = levels.astype(int_dtype(qmin, qmax))
        return cls(values, scale, zp, tuple(shape), grid.layout, qmin, qmax, bits, np.dtype(dtype).name)

    @property
    def view_shape(self) -> tuple[int, ...]:
        """The shape of the levels: `shape`, or for groups `shape[:-1] + (shape[-1] // group_size, group_size)`."""
        return self.layout.view_shape(self.shape)

    @property
    def packed(self) -> bool:
        """Whether the integers are packed (`packed_bits` is not `None`)."""
        return self.packed_bits is not None

    def _unpack(self, rows: Array) -> Array:
        """The levels of packed `rows` (shape `(rows, bytes)`), one row of the view each, as `(rows, values)`."""
        assert self.packed_bits is not None
        per_row = math.prod(self.view_shape[1:]) if self.view_shape else 1
        return unpack_bits(rows, per_row, self.packed_bits, signed=self.qmin < 0)

    def levels(self) -> Int[Array, "*view_shape"]:
        """The integer levels, unpacked, with the shape of the view."""
        if self.packed_bits is None:
            return self.values
        return self._unpack(self.values).reshape(self.view_shape)

    def dequantize(self) -> Float[Array, "*shape"]:
        """`scale * (levels - zero_point)`, reshaped to `shape`: the fake-quantized tensor."""
        levels = self.levels().astype(self.scale.dtype)
        return dequantize_levels(levels, self.scale, self.zero_point).reshape(self.shape).astype(self.dtype)

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
