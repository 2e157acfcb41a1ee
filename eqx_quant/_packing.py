"""Packing integers of 2, 3 or 4 bits into bytes, as a little-endian bit stream per row."""

import math

import jax
import jax.numpy as jnp
import numpy as np
from beartype import beartype
from jaxtyping import Array, Int, UInt8, jaxtyped

from ._misc import one_program


NIBBLE_ORDER = "low-first"
"""How [`eqx_quant.pack_int4`][] orders two 4-bit values in a byte: element `2i` of a row in bits 0-3, element
`2i + 1` in bits 4-7."""

BIT_ORDER = "low-first"
"""How [`eqx_quant.pack_bits`][] lays out a row: element `j` of `b` bits takes bits `j * b` to `j * b + b - 1` of
the row's bit stream, and bit `k` of the stream is bit `k % 8` of byte `k // 8`."""

PACKED_WIDTHS = (2, 3, 4)
"""The widths [`eqx_quant.pack_bits`][] packs."""


def _group(bits: int) -> tuple[int, int]:
    """`(values, bytes)`: the shortest run of values that fills whole bytes, e.g. eight 3-bit values in 3 bytes."""
    values = 8 // math.gcd(bits, 8)
    return values, values * bits // 8


def _check_bits(bits: object) -> int:
    if isinstance(bits, (bool, np.bool_)) or bits not in PACKED_WIDTHS:
        raise ValueError(f"`bits` must be one of {PACKED_WIDTHS}, got {bits!r}.")
    return int(bits)  # pyright: ignore[reportArgumentType]


def _check_range(values: Array, bits: int) -> None:
    """Raises if concrete `values` hold integers that no reading of `bits`-bit patterns gives back."""
    if isinstance(values, jax.core.Tracer) or values.size == 0:
        return
    concrete = np.asarray(values)
    lo, hi = int(concrete.min()), int(concrete.max())
    half = 1 << (bits - 1)
    if not (-half <= lo and hi < half) and not (0 <= lo and hi < 2 * half):
        raise ValueError(
            f"`values` must lie in [{-half}, {half - 1}] (signed) or in [0, {2 * half - 1}] (unsigned) to be stored "
            f"in {bits} bits, got values in [{lo}, {hi}]."
        )


@jaxtyped(typechecker=beartype)
def pack_bits(values: Int[Array, "rows n"], bits: int | np.integer) -> UInt8[Array, "rows packed"]:
    """Packs `bits`-bit integers along the last axis into bytes, each row a little-endian bit stream.

    Each value is stored as its `bits`-bit two's complement pattern (`value & (2**bits - 1)`). Element `j` of a row
    takes bits `j * bits` to `j * bits + bits - 1` of the row's bit stream, and bit `k` of the stream is bit `k % 8`
    of byte `k // 8`: lowest bits first. So 4-bit values go two per byte (element `2i` in the low nibble, as
    [`eqx_quant.pack_int4`][]), 2-bit values four per byte (element `4i + j` in bits `2j` and `2j + 1`), and 3-bit
    values eight in three bytes. The last byte of a row is padded with zero bits.

    **Arguments:**

    - `values`: an integer array of shape `(rows, n)`, with all values in the signed range
        `[-2**(bits - 1), 2**(bits - 1) - 1]` or all in the unsigned range `[0, 2**bits - 1]`;
        [`eqx_quant.unpack_bits`][] is told which.
    - `bits`: the width of a value: 2, 3 or 4.

    **Returns:**

    A `uint8` array of shape `(rows, ceil(n * bits / 8))`.

    **Raises:**

    `ValueError` if `bits` is not 2, 3 or 4, or if `values` is a concrete array holding a value outside both
    ranges (or values from both sides: some negative, some above the signed maximum), which no reading would give
    back. Under `jax.jit` the values are not checked: those outside the range are stored wrapped to their low
    `bits` bits.

    !!! example

        ```python
        import jax.numpy as jnp
        import eqx_quant

        values = jnp.array([[1, -2, 3, 0, -1]], jnp.int8)
        packed = eqx_quant.pack_bits(values, 3)
        print([hex(int(b)) for b in packed[0]])  # ['0xf1', '0x70']
        assert (eqx_quant.unpack_bits(packed, 5, 3) == values).all()
        ```
    """
    bits = _check_bits(bits)
    _check_range(values, bits)
    return _pack(values, bits)


@one_program
def _pack(values: Array, bits: int) -> Array:
    rows, n = values.shape
    per_group, group_bytes = _group(bits)
    fields = (values.astype(jnp.int32) & ((1 << bits) - 1)).astype(jnp.uint32)
    groups = -(-n // per_group)
    fields = jnp.pad(fields, ((0, 0), (0, groups * per_group - n))).reshape(rows, groups, per_group)
    shifts = (jnp.arange(per_group, dtype=jnp.uint32) * jnp.uint32(bits))[None, None, :]
    words = jnp.sum(fields << shifts, axis=-1, dtype=jnp.uint32)  # disjoint bits: the sum is their union
    byte_shifts = (jnp.arange(group_bytes, dtype=jnp.uint32) * jnp.uint32(8))[None, None, :]
    packed = ((words[:, :, None] >> byte_shifts) & jnp.uint32(0xFF)).astype(jnp.uint8)
    return packed.reshape(rows, groups * group_bytes)[:, : -(-n * bits // 8)]


@jaxtyped(typechecker=beartype)
def unpack_bits(
    packed: UInt8[Array, "rows packed"], n: int | np.integer, bits: int | np.integer, *, signed: bool = True
) -> Int[Array, "rows _"]:
    """Unpacks what [`eqx_quant.pack_bits`][] packed.

    **Arguments:**

    - `packed`: a `uint8` array of shape `(rows, ceil(n * bits / 8))`.
    - `n`: the number of values per row.
    - `bits`: the width of a value: 2, 3 or 4.
    - `signed`: read the patterns as two's complement (`[-2**(bits - 1), 2**(bits - 1) - 1]`) if `True`, as
        unsigned (`[0, 2**bits - 1]`) if `False`.

    **Returns:**

    An `int8` array of shape `(rows, n)`.

    **Raises:**

    `ValueError` if `bits` is not 2, 3 or 4, or `n` does not match the length of the packed rows.
    """
    bits = _check_bits(bits)
    rows, length = packed.shape
    if isinstance(n, (bool, np.bool_)) or n < 0 or length != -(-n * bits // 8):
        raise ValueError(f"`n`={n!r} does not match the packed row length {length} for {bits}-bit values.")
    return _unpack(packed, int(n), bits, signed)


@one_program
def _unpack(packed: Array, n: int, bits: int, signed: bool) -> Array:
    rows, length = packed.shape
    per_group, group_bytes = _group(bits)
    groups = -(-n // per_group)
    padded = jnp.pad(packed, ((0, 0), (0, groups * group_bytes - length))).astype(jnp.uint32)
    byte_shifts = (jnp.arange(group_bytes, dtype=jnp.uint32) * jnp.uint32(8))[None, None, :]
    words = jnp.sum(padded.reshape(rows, groups, group_bytes) << byte_shifts, axis=-1, dtype=jnp.uint32)
    shifts = (jnp.arange(per_group, dtype=jnp.uint32) * jnp.uint32(bits))[None, None, :]
    fields = (words[:, :, None] >> shifts) & jnp.uint32((1 << bits) - 1)
    values = fields.reshape(rows, groups * per_group)[:, :n].astype(jnp.int8)
    if signed:
        half = 1 << (bits - 1)
        values = (values ^ half) - half  # sign-extend the two's complement pattern
    return values


@jaxtyped(typechecker=beartype)
def pack_int4(values: Int[Array, "rows n"]) -> UInt8[Array, "rows packed"]:
    """Packs 4-bit integers two per byte along the last axis, low nibble first: [`eqx_quant.pack_bits`][] with
    `bits=4`.

    Each value is stored as its 4-bit two's complement pattern (`value & 0xF`), so signed values in `[-8, 7]` and
    unsigned values in `[0, 15]` are both representable; [`eqx_quant.unpack_int4`][] is told which. Element `2i`
    of a row goes to bits 0-3 of byte `i` and element `2i + 1` to bits 4-7. A row of odd length is padded with a
    zero nibble.

    **Arguments:**

    - `values`: an integer array of shape `(rows, n)`, all in `[-8, 7]` or all in `[0, 15]`.

    **Returns:**

    A `uint8` array of shape `(rows, ceil(n / 2))`.

    **Raises:**

    `ValueError` if `values` is concrete and holds a value that 4 bits cannot give back (not checked under
    `jax.jit`).

    !!! example

        ```python
        import jax.numpy as jnp
        import eqx_quant

        values = jnp.array([[1, -2, 7]], jnp.int8)
        packed = eqx_quant.pack_int4(values)
        print([hex(int(b)) for b in packed[0]])  # ['0xe1', '0x7']
        assert (eqx_quant.unpack_int4(packed, 3) == values).all()
        ```
    """
    return pack_bits(values, 4)


@jaxtyped(typechecker=beartype)
def unpack_int4(
    packed: UInt8[Array, "rows packed"], n: int | np.integer, *, signed: bool = True
) -> Int[Array, "rows _"]:
    """Unpacks what [`eqx_quant.pack_int4`][] packed.

    **Arguments:**

    - `packed`: a `uint8` array of shape `(rows, ceil(n / 2))`.
    - `n`: the number of values per row.
    - `signed`: read the nibbles as two's complement (`[-8, 7]`) if `True`, as unsigned (`[0, 15]`) if `False`.

    **Returns:**

    An `int8` array of shape `(rows, n)`.

    **Raises:**

    `ValueError` if `n` does not match the length of the packed rows.
    """
    return unpack_bits(packed, n, 4, signed=signed)
