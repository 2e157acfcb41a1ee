import jax.numpy as jnp
from beartype import beartype
from jaxtyping import Array, Int, UInt8, jaxtyped


NIBBLE_ORDER = "low-first"
"""How [`eqx_quant.pack_int4`][] orders two 4-bit values in a byte: element `2i` of a row in bits 0-3, element
`2i + 1` in bits 4-7."""


@jaxtyped(typechecker=beartype)
def pack_int4(values: Int[Array, "rows n"]) -> UInt8[Array, "rows packed"]:
    """Packs 4-bit integers two per byte along the last axis, low nibble first.

    Each value is stored as its 4-bit two's complement pattern (`value & 0xF`), so signed values in `[-8, 7]` and
    unsigned values in `[0, 15]` are both representable; [`eqx_quant.unpack_int4`][] is told which. Element `2i`
    of a row goes to bits 0-3 of byte `i` and element `2i + 1` to bits 4-7. A row of odd length is padded with a
    zero nibble.

    **Arguments:**

    - `values`: an integer array of shape `(rows, n)` with values in `[-8, 15]`.

    **Returns:**

    A `uint8` array of shape `(rows, ceil(n / 2))`.

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
    rows, n = values.shape
    nibbles = (values.astype(jnp.int32) & 0xF).astype(jnp.uint8)
    if n % 2:
        nibbles = jnp.concatenate([nibbles, jnp.zeros((rows, 1), jnp.uint8)], axis=1)
    pairs = nibbles.reshape(rows, -1, 2)
    return pairs[:, :, 0] | (pairs[:, :, 1] << 4)


@jaxtyped(typechecker=beartype)
def unpack_int4(packed: UInt8[Array, "rows packed"], n: int, *, signed: bool = True) -> Int[Array, "rows _"]:
    """Unpacks what [`eqx_quant.pack_int4`][] packed.

    **Arguments:**

    - `packed`: a `uint8` array of shape `(rows, ceil(n / 2))`.
    - `n`: the number of values per row.
    - `signed`: read the nibbles as two's complement (`[-8, 7]`) if `True`, as unsigned (`[0, 15]`) if `False`.

    **Returns:**

    An `int8` array of shape `(rows, n)`.
    """
    if not 0 <= n <= 2 * packed.shape[1] or packed.shape[1] != (n + 1) // 2:
        raise ValueError(f"`n`={n} does not match the packed row length {packed.shape[1]}.")
    low = (packed & 0xF).astype(jnp.int8)
    high = (packed >> 4).astype(jnp.int8)
    values = jnp.stack([low, high], axis=-1).reshape(packed.shape[0], -1)[:, :n]
    if signed:
        values = (values ^ 8) - 8  # sign-extend the 4-bit two's complement pattern
    return values
