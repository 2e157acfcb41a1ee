"""A tensor stored as the codes of a low-precision float format, with its scales."""

import functools
import math

import equinox as eqx
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from jaxtyping import Array, ArrayLike, Float, Int, Integer, Shaped, UInt8

from ._fake_quant import prepare_scale, scaled
from ._float_formats import (
    _FORMATS,
    _MX_ELEMENTS,
    _block_scales,
    _exponent,
    _finite_block_amax,
    _Format,
    _mx_exponent,
    _pow2,
    _quantize,
    nvfp4_scales,
)
from ._misc import compute_dtype, expand_to_rank, is_concrete
from ._packing import pack_bits, unpack_bits


# ---------------------------------------------------------------------------------------------------------------------
# Element codes: the bit patterns `ml_dtypes` gives each format, one per byte (FP8, FP6) or two per byte (FP4).


def _table(element: str) -> np.ndarray:
    """The value of every code of `element` (NaN for NaN codes), indexed by the code, as float64."""
    dtype = getattr(ml_dtypes, element)
    return np.arange(2 ** ml_dtypes.finfo(dtype).bits, dtype=np.uint8).view(dtype).astype(np.float64)


_BITS = {name: ml_dtypes.finfo(getattr(ml_dtypes, name)).bits for name in _FORMATS}
_TABLES = {name: _table(name) for name in _FORMATS}
# The code `ml_dtypes` gives NaN: a NaN code for the 8-bit formats, the code of -0 for the others (they have no NaN).
_NAN_CODES = {
    name: int(np.array(np.nan, np.float32).astype(getattr(ml_dtypes, name)).view(np.uint8)) for name in _FORMATS
}
_E8M0_NAN = 0xFF
_E4M3 = _FORMATS["float8_e4m3fn"]


def has_nan(element: str) -> bool:
    """Whether the element format has a NaN code (the 8-bit formats do; the 6- and 4-bit formats do not)."""
    return bool(np.isnan(_TABLES[element]).any())


def encode(q: Array, element: str) -> UInt8[Array, "*shape"]:
    """The codes of `q`, whose entries are points of `element`'s grid (or NaN): the bit patterns of an `ml_dtypes`
    cast of `q` to the format, as `uint8`, computed exactly from the bits of `q`."""
    fmt = _FORMATS[element]
    bits = _BITS[element]
    a = jnp.abs(q)
    k = jnp.maximum(_exponent(a), fmt.emin)
    normal = a >= 2.0**fmt.emin
    # On the grid, `a * 2**(nmant - k)` is an integer: the significand with its leading bit for normal numbers.
    significand = (a * _pow2(fmt.nmant - k, a.dtype)).astype(jnp.int32)
    mantissa = significand - jnp.where(normal, 1 << fmt.nmant, 0)
    exponent = jnp.where(normal, k.astype(jnp.int32) - fmt.emin + 1, 0)
    sign = jnp.signbit(q).astype(jnp.int32)
    code = (sign << (bits - 1)) | (exponent << fmt.nmant) | mantissa
    return jnp.where(jnp.isnan(q), _NAN_CODES[element], code).astype(jnp.uint8)


def decode(codes: Integer[Array, "*shape"], element: str, dtype: np.dtype) -> Float[Array, "*shape"]:
    """The values of `codes` of `element`, in `dtype` (exactly: every value of these formats is a float32)."""
    return jnp.asarray(_TABLES[element], dtype)[codes.astype(jnp.int32)]


def _pack_rows(shape: tuple[int, ...]) -> int:
    """The number of rows of packed FP4 codes: the first axis of a tensor of rank 2 or more, else one row."""
    return shape[0] if len(shape) >= 2 else 1


def _pack(codes: Array) -> Array:
    rows = _pack_rows(codes.shape)
    return pack_bits(codes.reshape(rows, -1).astype(jnp.int8), 4)


def _unpack(packed: Array, shape: tuple[int, ...]) -> Array:
    rows = _pack_rows(shape)
    n = math.prod(shape) // rows if rows else 0
    return unpack_bits(packed, n, 4, signed=False).reshape(shape)


# ---------------------------------------------------------------------------------------------------------------------
# Formats.


_BLOCK_FORMATS = {**_MX_ELEMENTS, "nvfp4": "float4_e2m1fn"}
FORMATS = (*_FORMATS, *_BLOCK_FORMATS)
"""Every format name a [`eqx_quant.nn.FloatQuantizedTensor`][] can have."""


def _scheme(format: str) -> str:
    return "mx" if format in _MX_ELEMENTS else "nvfp4" if format == "nvfp4" else "scaled"


# ---------------------------------------------------------------------------------------------------------------------
# The tensor.


class FloatQuantizedTensor(eqx.Module):
    """A tensor stored as the codes of a low-precision float format, with its scales: what
    [`eqx_quant.convert`][] keeps of a weight quantized by a [float quantizer](../concepts/float-formats.md).

    `format` is an element format (`"float8_e4m3fn"`, `"float8_e5m2"`, `"float6_e2m3fn"`, `"float6_e3m2fn"`,
    `"float4_e2m1fn"`) with one float scale per tensor or per channel, an MX format (`"mxfp8_e4m3"`, `"mxfp8_e5m2"`,
    `"mxfp6_e2m3"`, `"mxfp6_e3m2"`, `"mxfp4"`) or `"nvfp4"`. The leaves:

    - `codes`: the elements, as the bit patterns that `ml_dtypes` gives the element format (`uint8`). FP8 and FP6
        elements take one byte each, in the tensor's shape; FP4 elements two per byte, packed like 4-bit integers
        ([`eqx_quant.pack_int4`][]: element `2i` of a row in the low nibble), one row of bytes per index of the first
        axis (a tensor of rank 0 or 1 is one row).
    - `scale`: for an element format, the float scales (float32; float64 for float64 tensors), with unit axes where
        they are shared, so that they broadcast against the tensor. For MX, one E8M0 byte per block (the exponent
        plus 127; 255 is NaN); for NVFP4, one `float8_e4m3fn` byte per block. Block scales have the tensor's shape,
        with `block_axis` shortened by the factor `block_size`.
    - `tensor_scale`: NVFP4's scale for the whole tensor (float32; float64 for float64 tensors), else `None`.

    The static fields say what the codes mean: `format`, `shape` and `dtype` of the tensor, the `channel_axes` of
    per-channel scales, the `block_axis` and `block_size` of block scales, and the MX `scale_rule`.

    [`eqx_quant.nn.FloatQuantizedTensor.dequantize`][] returns, bit for bit, what the quantizer that made the tensor
    returned (except where a format without NaN, FP6 or FP4 under a per-tensor or per-channel scale, would have to
    store a NaN: its `quantize` refuses concrete NaN). Tensors of stacked layers (built with `eqx.filter_vmap`)
    carry the stack in front of every leaf, as [`eqx_quant.nn.QuantizedTensor`][]s do.
    """

    codes: UInt8[Array, "*codes_shape"]
    scale: Shaped[Array, "*scale_shape"]
    tensor_scale: Float[Array, "*stack"] | None
    format: str = eqx.field(static=True)
    shape: tuple[int, ...] = eqx.field(static=True)
    dtype: str = eqx.field(static=True)
    channel_axes: tuple[int, ...] = eqx.field(static=True)
    block_axis: int | None = eqx.field(static=True)
    block_size: int | None = eqx.field(static=True)
    scale_rule: str | None = eqx.field(static=True)

    def __check_init__(self):
        if self.format not in FORMATS:
            raise ValueError(f"`format` must be one of {FORMATS}, got format={self.format!r}.")
        blocked = _scheme(self.format) != "scaled"
        if blocked != (self.block_axis is not None) or blocked != (self.block_size is not None):
            raise ValueError(
                f"`block_axis` and `block_size` must be given exactly for the block formats, got format="
                f"{self.format!r}, block_axis={self.block_axis!r}, block_size={self.block_size!r}."
            )
        if (_scheme(self.format) == "mx") != (self.scale_rule in ("floor", "rceil")):
            raise ValueError(
                f"`scale_rule` must be 'floor' or 'rceil' for an MX format and None otherwise, got format="
                f"{self.format!r}, scale_rule={self.scale_rule!r}."
            )
        if (_scheme(self.format) == "nvfp4") != (self.tensor_scale is not None):
            raise ValueError(f"`tensor_scale` must be given exactly for NVFP4, got format={self.format!r}.")

    @property
    def element(self) -> str:
        """The element format: `format` itself, or the element of an MX or NVFP4 format (e.g. `"float4_e2m1fn"`)."""
        return _BLOCK_FORMATS.get(self.format, self.format)

    @property
    def scale_format(self) -> str:
        """How `scale` is stored: `"float8_e8m0fnu"` (MX), `"float8_e4m3fn"` (NVFP4), or the name of the float
        dtype of per-tensor and per-channel scales."""
        scheme = _scheme(self.format)
        return {"mx": "float8_e8m0fnu", "nvfp4": "float8_e4m3fn"}.get(scheme, np.dtype(self.scale.dtype).name)

    @property
    def packed(self) -> bool:
        """Whether the codes are 4-bit, two per byte."""
        return _BITS[self.element] == 4

    @property
    def codes_shape(self) -> tuple[int, ...]:
        """The shape of `codes` for one tensor: `shape`, or for packed FP4 codes `(rows, ceil(n / 2))`."""
        if not self.packed:
            return self.shape
        rows = _pack_rows(self.shape)
        n = math.prod(self.shape) // rows if rows else 0
        return (rows, -(-n // 2))

    @property
    def stack_depth(self) -> int:
        """The number of leading axes along which whole tensors are stacked (see
        [`eqx_quant.nn.QuantizedTensor.stack_depth`][])."""
        return self.codes.ndim - len(self.codes_shape)

    @property
    def nbytes(self) -> int:
        """Bytes of the codes and scales."""
        leaves = [self.codes, self.scale] + ([] if self.tensor_scale is None else [self.tensor_scale])
        return sum(leaf.size * leaf.dtype.itemsize for leaf in leaves)

    def _compute_dtype(self) -> np.dtype:
        return compute_dtype(np.dtype(self.dtype))

    def _per_tensor(self, fn):
        for _ in range(self.stack_depth):
            fn = jax.vmap(fn)
        return fn

    def _elements(self, codes: Array) -> Array:
        """The element values of one tensor's codes, in the compute dtype, with the tensor's shape."""
        if self.packed:
            codes = _unpack(codes, self.shape)
        return decode(codes, self.element, self._compute_dtype())

    def elements(self) -> Float[Array, "*stack_and_shape"]:
        """The element values (the codes read as numbers, before scaling), in float32 (float64 for float64 tensors),
        with the tensor's shape (after the stacked axes, if any)."""
        return _compiled(FloatQuantizedTensor._all_elements, self)

    def _all_elements(self) -> Array:
        return self._per_tensor(self._elements)(self.codes)

    def _scaled(self, elements: Array, scale: Array, tensor_scale: Array | None, axis: int | None) -> Array:
        """`elements` times their scales, as the quantizer computed them. `scale` has the rank of `elements`; block
        scales are repeated `block_size` times along `axis` (`None`: they have one entry per element already)."""
        scheme = _scheme(self.format)
        if scheme == "scaled":
            return expand_to_rank(scale, elements.ndim) * elements
        if axis is not None:
            scale = jnp.repeat(scale, self.block_size, axis=axis)  # pyright: ignore[reportArgumentType]
        dtype = elements.dtype
        if scheme == "mx":
            # The block scale 2**e as two factors applied one after the other, as `mx_fake_quant` applies it (2**-127
            # is subnormal in float32; its halves are not).
            e = scale.astype(jnp.int32) - 127
            half = jax.lax.shift_right_arithmetic(e, jnp.asarray(1, e.dtype))
            first = jnp.where(scale == _E8M0_NAN, jnp.asarray(jnp.nan, dtype), _pow2(half, dtype))
            return elements * first * _pow2(e - half, dtype)
        assert tensor_scale is not None
        return elements * (decode(scale, "float8_e4m3fn", dtype) * tensor_scale)

    def _dequantize(self) -> Array:
        def one(codes, scale, tensor_scale):
            return self._scaled(self._elements(codes), scale, tensor_scale, self.block_axis).astype(self.dtype)

        return self._per_tensor(one)(self.codes, self.scale, self.tensor_scale)

    def dequantize(self) -> Float[Array, "*stack_and_shape"]:
        """The elements times their scales, in the tensor's dtype: bit for bit what the quantizer returned (after the
        stacked axes, if any)."""
        return _compiled(FloatQuantizedTensor._dequantize, self)

    def dequantize_row(self, index: Int[ArrayLike, ""]) -> Float[Array, "*row_shape"]:
        """Row `index` (along the first axis) of [`eqx_quant.nn.FloatQuantizedTensor.dequantize`][], computed from
        that row's codes and scales alone (an embedding's lookup). Needs a tensor of rank 2 or more, not stacked."""
        if len(self.shape) < 2 or self.stack_depth:
            raise ValueError(
                f"`dequantize_row` needs an unstacked tensor of rank 2 or more, got shape {self.shape} with "
                f"{self.stack_depth} stacked axes."
            )
        return _compiled(FloatQuantizedTensor._dequantize_row, self, jnp.asarray(index))

    def _dequantize_row(self, index: Array) -> Array:
        if self.packed:
            row_codes = _unpack(self.codes[index][None], (1, *self.shape[1:]))[0]
        else:
            row_codes = self.codes[index]
        elements = decode(row_codes, self.element, self._compute_dtype())
        axis = self.block_axis
        if axis == 0:  # the row lies in block `index // block_size` of every column
            scale, axis = self.scale[index // self.block_size], None  # pyright: ignore[reportOperator]
        elif self.scale.shape[0] == 1:
            scale = self.scale[0]
        else:
            scale = self.scale[index]
        axis = None if axis is None else axis - 1
        return self._scaled(elements, scale, self.tensor_scale, axis).astype(self.dtype)


# Each method above is compiled as one program, even in eager calls: a few dozen small operations, each compiled on its
# own otherwise. (Inside `jax.jit` the call is inlined.)
_compiled = eqx.filter_jit(lambda method, tensor, *args: method(tensor, *args))


# ---------------------------------------------------------------------------------------------------------------------
# Making one from an array: the arithmetic of the primitives, keeping the codes.


@functools.partial(jax.jit, static_argnums=(2,))
def _scaled_codes(x: Array, scale: Array, element: _Format) -> Array:
    codes = encode(_quantize(scaled(x, scale), element), element.name)
    return _pack(codes) if _BITS[element.name] == 4 else codes


def scaled_tensor(x: Array, scale: Array, element: str, channel_axes: tuple[int, ...]) -> FloatQuantizedTensor:
    """The [`eqx_quant.nn.FloatQuantizedTensor`][] of `fake_quant_float(x, scale, element)`, whose `scale` has the
    rank of `x` (unit axes where it is shared) and varies along `channel_axes`. No gradient flows through it.

    Raises `ValueError` for a concrete `x` holding NaN when `element` has no NaN code."""
    x = jax.lax.stop_gradient(x)
    cdtype = compute_dtype(x.dtype)
    scale = jax.lax.stop_gradient(prepare_scale(scale, x.shape, cdtype))
    if not has_nan(element) and is_concrete(x):
        nan = np.argwhere(np.isnan(np.asarray(x, np.float32)))
        if nan.size:
            raise ValueError(
                f"`x` holds NaN (at index {tuple(int(i) for i in nan[0])}), which {element} cannot store under a "
                "per-tensor or per-channel scale."
            )
    codes = _scaled_codes(x.astype(cdtype), scale, _FORMATS[element])
    scale = expand_to_rank(scale, x.ndim)
    return FloatQuantizedTensor(
        codes, scale, None, element, tuple(x.shape), np.dtype(x.dtype).name, channel_axes, None, None, None
    )


@functools.partial(jax.jit, static_argnums=(1, 2, 3, 4))
def _block_codes(
    x: Array, axis: int, block_size: int, element: _Format, scheme: tuple[str, ...]
) -> tuple[Array, Array, Array | None]:
    """`(codes, block scale bytes, tensor scale)` of `x` blocked along `axis`, as `mx_fake_quant` (`scheme` `("mx",
    rule)`) or `nvfp4_fake_quant` (`("nvfp4",)`) quantize it: the same `_block_scales`, the same rounding."""
    moved = jnp.moveaxis(x.astype(compute_dtype(x.dtype)), axis, -1)
    shape = moved.shape
    xb = moved.reshape(*shape[:-1], shape[-1] // block_size, block_size)
    inv, _ = _block_scales(xb, element, scheme)
    codes = encode(_quantize(xb * inv, element), element.name)
    amax, bad = _finite_block_amax(xb)
    tensor_scale = None
    if scheme[0] == "mx":
        e = _mx_exponent(amax, element, scheme[1])
        scale = jnp.where(bad, _E8M0_NAN, e + 127).astype(jnp.uint8)  # E8M0: the exponent plus 127
    else:
        tensor_scale, b, _ = nvfp4_scales(xb)
        scale = jnp.where(bad, _NAN_CODES["float8_e4m3fn"], encode(b, "float8_e4m3fn")).astype(jnp.uint8)
    codes = jnp.moveaxis(codes.reshape(shape), -1, axis)
    if _BITS[element.name] == 4:
        codes = _pack(codes)
    scale = jnp.moveaxis(scale[..., 0], -1, axis)
    return codes, scale, tensor_scale


def block_tensor(x: Array, format: str, axis: int, block_size: int, scale_rule: str | None) -> FloatQuantizedTensor:
    """The [`eqx_quant.nn.FloatQuantizedTensor`][] of `mx_fake_quant(x, format, axis=axis, block_size=block_size,
    scale_rule=scale_rule)`, or of `nvfp4_fake_quant(x, axis=axis)` for `format="nvfp4"` (with `block_size` 16 and
    `scale_rule` `None`). `axis` is non-negative and checked against `x`. No gradient flows through it."""
    x = jax.lax.stop_gradient(x)
    element = _FORMATS[_BLOCK_FORMATS[format]]
    scheme = ("nvfp4",) if format == "nvfp4" else ("mx", scale_rule)
    codes, scale, tensor_scale = _block_codes(x, axis, block_size, element, scheme)  # pyright: ignore[reportArgumentType]
    return FloatQuantizedTensor(
        codes, scale, tensor_scale, format, tuple(x.shape), np.dtype(x.dtype).name, (), axis, block_size, scale_rule
    )
