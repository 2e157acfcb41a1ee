"""An integer key/value cache for incremental decoding."""

import math

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float

from .._format import int_format
from .._layout import Layout
from .._misc import FLOAT32_TINY, check_int, is_concrete
from .._qarray import QuantizedArray
from .._quantizers import DynamicFakeQuant
from ._einsum import integer_value


class QuantKVCache(eqx.Module):
    """A key/value cache of integers for incremental decoding: one query at a time attends to the keys and values of
    the positions so far, stored as `bits`-bit integers with one symmetric scale per position and head.

    Keys and values enter with [`eqx_quant.nn.QuantKVCache.append`][] quantized as
    `DynamicFakeQuant(bits, axis=0)` quantizes a `(heads, head_dim)` array (one scale per head), so that the cache
    holds exactly the integers that a fake-quant model computes for them. [`eqx_quant.nn.QuantKVCache.attend`][]
    computes the scores on integers (the query quantized per head) and the weighted values from the dequantized
    values (their scales vary along the positions that the product sums over, so no single rescale exists): the
    computation of [`eqx_quant.nn.QuantEinsum`][]s with those quantizers, bit for bit. Positions not yet written hold
    zeros and are masked.

    **NaN.** No integer holds NaN: the cache keeps, one bit per entry (`key_nan`, `value_nan`, packed along
    `head_dim` with `jnp.packbits`), where an appended key or value was NaN, and puts NaN back where float attention
    over the written positions has it: a NaN key entry makes NaN the scores of its position and head, so every output
    of the query heads that read that head; a NaN value entry makes NaN the outputs of that entry's head and feature.
    [`eqx_quant.nn.QuantKVCache.dequantized`][] gives NaN at those entries.
    """

    keys: Array
    values: Array
    key_scales: Array
    value_scales: Array
    key_nan: Array
    value_nan: Array
    bits: int = eqx.field(static=True)

    @classmethod
    def empty(cls, max_len: int, num_heads: int, head_dim: int, *, bits: int = 8) -> "QuantKVCache":
        """An empty cache.

        **Arguments:**

        - `max_len`: the number of positions it holds.
        - `num_heads`, `head_dim`: the shape of one position's keys (and values).
        - `bits`: the width of the stored integers, at most 8.

        **Returns:**

        A [`eqx_quant.nn.QuantKVCache`][] of zeros.
        """
        for name, value in (("max_len", max_len), ("num_heads", num_heads), ("head_dim", head_dim)):
            if check_int(name, value) < 1:
                raise ValueError(f"`{name}` must be a positive int, got {name}={value}.")
        if not 2 <= check_int("bits", bits) <= 8:
            raise ValueError(f"`bits` must be in [2, 8], got bits={bits}.")
        levels = jnp.zeros((max_len, num_heads, head_dim), jnp.int8)
        scales = jnp.full((max_len, num_heads, 1), FLOAT32_TINY, jnp.float32)
        nan = jnp.zeros((max_len, num_heads, (head_dim + 7) // 8), jnp.uint8)
        return cls(levels, levels, scales, scales, nan, nan, bits)

    @property
    def _quantizer(self) -> DynamicFakeQuant:
        return DynamicFakeQuant(self.bits, axis=0)

    def append(
        self, key_: Float[Array, "heads head_dim"], value: Float[Array, "heads head_dim"], index
    ) -> "QuantKVCache":
        """The cache with position `index` holding `key_` and `value`, quantized (jit-friendly: `index` may be traced).

        **Arguments:**

        - `key_`, `value`: one position's keys and values, shape `(num_heads, head_dim)`.
        - `index`: the position to write, in `[0, max_len)`: a Python or NumPy int or an integer scalar array. Its
            value is checked unless it is traced (inside `jax.jit`, say), where it cannot be: a traced index beyond
            the cache writes its last position, and a negative one its first, as `jax.lax.dynamic_update_slice` does.

        **Returns:**

        The new cache.
        """
        _check_position("index", index, 0, self.keys.shape[0] - 1)
        expected = self.keys.shape[1:]
        if key_.shape != expected or value.shape != expected:
            raise ValueError(f"`key_` and `value` must have shape {expected}, got {key_.shape} and {value.shape}.")
        _check_not_float64(key_=key_, value=value)
        (k, k_nan), (v, v_nan) = (self._quantizer.quantize_with_mask(a) for a in (key_, value))  # unpacked

        def put(cache, row):
            return jax.lax.dynamic_update_slice_in_dim(cache, row[None].astype(cache.dtype), index, axis=0)

        def nan_bits(nan):
            return jnp.packbits(nan.reshape(expected), axis=-1)

        return eqx.tree_at(
            lambda c: (c.keys, c.values, c.key_scales, c.value_scales, c.key_nan, c.value_nan),
            self,
            (put(self.keys, k.values), put(self.values, v.values), put(self.key_scales, k.scale),
             put(self.value_scales, v.scale), put(self.key_nan, nan_bits(k_nan)), put(self.value_nan, nan_bits(v_nan))),
        )  # fmt: skip

    def _nan(self) -> tuple[Array, Array]:
        """Where the stored keys and values are NaN, `(max_len, num_heads, head_dim)` bools each."""
        dim = self.keys.shape[-1]
        return tuple(jnp.unpackbits(bits, axis=-1, count=dim).astype(bool) for bits in (self.key_nan, self.value_nan))

    def dequantized(self) -> tuple[Array, Array]:
        """The stored keys and values as floats, `(max_len, num_heads, head_dim)` each, NaN where they were NaN."""
        key_nan, value_nan = self._nan()
        keys = _dequantized(self.keys, self.key_scales, key_nan)
        return keys, _dequantized(self.values, self.value_scales, value_nan)

    def attend(self, query: Float[Array, "query_heads head_dim"], length) -> Float[Array, "query_heads head_dim"]:
        """Attention of one query over positions `0 .. length - 1`: `softmax(q kᵀ / sqrt(head_dim)) v` per head.

        With grouped-query attention (`query_heads` a multiple `g` of the cache's `num_heads`), query heads
        `i * g .. i * g + g - 1` attend to the cache's head `i`: the products are then those of the
        [`eqx_quant.nn.QuantEinsum`][]s `"hgd,shd->hgs"` and `"hgs,shd->hgd"` on the query reshaped to
        `(num_heads, g, head_dim)` (the query still quantized per query head).

        **Arguments:**

        - `query`: shape `(query_heads, head_dim)`, `query_heads` a multiple of `num_heads`.
        - `length`: the number of positions written so far, in `[1, max_len]`: a Python or NumPy int or an integer
            scalar array, checked unless it is traced (inside `jax.jit`, say), where it cannot be.

        **Returns:**

        The attended values, shape `(query_heads, head_dim)`.
        """
        _check_position("length", length, 1, self.keys.shape[0])
        heads, dim = self.keys.shape[1:]
        if query.ndim != 2 or query.shape[1] != dim or query.shape[0] % heads:
            raise ValueError(
                f"`query` must have shape (query_heads, {dim}) with query_heads a multiple of the cache's {heads} "
                f"heads, got {query.shape}."
            )
        _check_not_float64(query=query)
        groups = query.shape[0] // heads
        q = query / math.sqrt(dim)
        if groups > 1:
            q = q.reshape(heads, groups, dim)
        scores, mix = ("hgd,shd->hgs", "hgs,shd->hgd") if groups > 1 else ("hd,shd->hs", "hs,shd->hd")
        tq, nq = DynamicFakeQuant(self.bits, axis=tuple(range(q.ndim - 1))).quantize_with_mask(q)
        fmt = int_format(self.bits)
        stored = QuantizedArray(
            self.keys, self.key_scales, None, None, fmt, Layout((0, 1)), self.keys.shape, "float32", None
        )
        key_nan, value_nan = self._nan()
        logits = integer_value(scores, tq, stored, nq, key_nan)
        written = jnp.arange(self.keys.shape[0]) < length
        logits = jnp.where(written, logits, jnp.finfo(jnp.float32).min)
        weights = jax.nn.softmax(logits, axis=-1)
        # NaN values of positions not read would turn their zero weights into NaN: only the written ones count.
        values = _dequantized(self.values, self.value_scales, value_nan & written[:, None, None])
        return jnp.einsum(mix, weights, values).reshape(query.shape)


def _dequantized(levels: Array, scales: Array, nan: Array) -> Array:
    """Stored levels as floats, NaN where `nan` is set."""
    return jnp.where(nan, jnp.nan, levels.astype(jnp.float32) * scales)


def _check_position(name: str, value: object, low: int, high: int) -> None:
    """Raises unless `value` is an integer scalar in `[low, high]` (the value of a traced array cannot be checked)."""
    if isinstance(value, np.ndarray) and value.ndim == 0:
        value = value[()]  # a NumPy scalar
    if isinstance(value, (jax.Array, np.ndarray)):
        shape, dtype = jnp.shape(value), value.dtype
        if shape or not jnp.issubdtype(dtype, jnp.integer):
            raise TypeError(f"`{name}` must be an integer scalar, got an array of shape {shape} and dtype {dtype}.")
        if not is_concrete(value):
            return
        value = int(value)
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"`{name}` must be an integer scalar, got {name}={value!r}.")
    if not low <= int(value) <= high:
        raise ValueError(f"`{name}` must be in [{low}, {high}] for this cache, got {name}={int(value)}.")


def _check_not_float64(**arrays: Array) -> None:
    """A `TypeError` naming a float64 argument: the cache stores float32 scales and computes in float32."""
    for name, a in arrays.items():
        if a.dtype == jnp.float64:
            raise TypeError(
                f"`{name}` is float64 (with `jax_enable_x64`), but a QuantKVCache stores float32 scales and computes "
                "in float32: cast it to float32."
            )
