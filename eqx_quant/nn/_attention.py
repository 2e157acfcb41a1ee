"""Products of two activations (attention's QKᵀ and softmax·V) on integer grids, and multi-head attention with them."""

import functools
import math
import re
import warnings
from typing import Literal

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, PRNGKeyArray

from .._int_ops import INT32_MAX, opaque
from .._layout import Layout
from .._misc import FLOAT32_TINY, check_int
from .._qtensor import QuantizedTensor
from .._quantizers import AbstractFakeQuantizer, AbstractQuantizer, DynamicFakeQuant
from ._layers import _check_matmul, _check_quantizer


_OPERAND = re.compile(r"^[a-zA-Z]*$")


def _parse(equation: object) -> tuple[str, str, str]:
    """`(lhs, rhs, out)` labels of a two-operand einsum equation with an explicit output, or a `ValueError`."""
    if not isinstance(equation, str):
        raise TypeError(f"`equation` must be a string, got {equation!r}.")
    spec = equation.replace(" ", "")
    inputs, arrow, out = spec.partition("->")
    operands = inputs.split(",")
    if not arrow or len(operands) != 2 or not all(_OPERAND.match(s) for s in (*operands, out)):
        raise ValueError(
            f"`equation` must name two operands and the output with letters, as 'td,sd->ts', got equation={equation!r}."
        )
    lhs, rhs = operands
    for name, labels in (("lhs", lhs), ("rhs", rhs), ("output", out)):
        if len(set(labels)) != len(labels):
            raise ValueError(f"`equation`={equation!r} repeats a label in its {name}.")
    if set(out) - set(lhs) - set(rhs):
        raise ValueError(f"`equation`={equation!r} has output labels that no operand has.")
    return lhs, rhs, out


class Einsum(eqx.Module):
    """A product of two arrays written as an einsum, as a module: `Einsum("td,sd->ts")(a, b)` is
    `jnp.einsum("td,sd->ts", a, b)`.

    Write the products of two activations (attention's scores and its weighted values) with it instead of
    `jnp.einsum`, and [`eqx_quant.quantize`][] can find them and turn them into [`eqx_quant.nn.QuantEinsum`][]s.
    """

    equation: str = eqx.field(static=True)

    def __init__(self, equation: str):
        """**Arguments:**

        - `equation`: an einsum equation with two operands and an explicit output, e.g. `"td,sd->ts"`.
        """
        _parse(equation)
        self.equation = equation

    def __call__(self, a: Array, b: Array) -> Array:
        """`jnp.einsum(equation, a, b)`."""
        return jnp.einsum(self.equation, a, b)


def _free_scale(tensor: QuantizedTensor, labels: str, contracted: set[str]) -> tuple[Array, str]:
    """An operand's scale over its free (not contracted) labels: the scales are constant along the contracted ones."""
    scale = jnp.broadcast_to(tensor.scale, tensor.shape)
    index = tuple(0 if label in contracted else slice(None) for label in labels)
    return scale[index], "".join(label for label in labels if label not in contracted)


def integer_einsum_possible(equation: str, a: QuantizedTensor, b: QuantizedTensor) -> bool:
    """Whether the integer einsum of two quantized operands computes their product: symmetric grids, scales
    constant along the contracted labels (no groups), and a contraction whose int32 sums are exact."""
    lhs, rhs, out = _parse(equation)
    contracted = (set(lhs) & set(rhs)) - set(out)
    for tensor, labels in ((a, lhs), (b, rhs)):
        if tensor.zero_point is not None or tensor.layout.group_size is not None or tensor.layout.stacked:
            return False
        channels = tensor.layout.channel_axes(tensor.shape)
        if any(labels[axis] in contracted for axis in channels):
            return False
    length = math.prod(a.shape[lhs.index(label)] for label in contracted)
    bound = max(-a.qmin, a.qmax) * max(-b.qmin, b.qmax)
    return length * bound <= INT32_MAX


def _integer_value(equation: str, a: QuantizedTensor, b: QuantizedTensor, a_nan: Array, b_nan: Array) -> Array:
    """The product from the integers: an int32 einsum, rescaled once by the outer product of the free scales."""
    lhs, rhs, out = _parse(equation)
    contracted = (set(lhs) & set(rhs)) - set(out)
    acc = jnp.einsum(equation, a.values, b.values, preferred_element_type=jnp.int32)
    scale_a, free_a = _free_scale(a, lhs, contracted)
    scale_b, free_b = _free_scale(b, rhs, contracted)
    # One product per output element (no label is summed), so eager and compiled calls round alike.
    scale = jnp.einsum(f"{free_a},{free_b}->{out}", scale_a, scale_b)
    y = acc.astype(scale.dtype) * scale
    # NaN where a contracted slice of either operand holds one, as in the float product.
    ones_a, ones_b = jnp.ones(a.shape, jnp.int8), jnp.ones(b.shape, jnp.int8)
    nan = jnp.einsum(equation, a_nan.astype(jnp.int8), ones_b, preferred_element_type=jnp.int32) > 0
    nan = nan | (jnp.einsum(equation, ones_a, b_nan.astype(jnp.int8), preferred_element_type=jnp.int32) > 0)
    return opaque(jnp.where(nan, jnp.nan, y))


@functools.partial(jax.custom_jvp, nondiff_argnums=(0,))
def _integer_einsum(equation, fa, fb, a, b, a_nan, b_nan):
    del fa, fb
    return _integer_value(equation, a, b, a_nan, b_nan)


@_integer_einsum.defjvp
def _integer_einsum_jvp(equation, primals, tangents):
    fa, fb, a, b, a_nan, b_nan = primals
    dfa, dfb = tangents[:2]
    y = _integer_value(equation, a, b, a_nan, b_nan)
    dy = jnp.einsum(equation, dfa, fb) + jnp.einsum(equation, fa, dfb)
    return y, dy.astype(y.dtype)


class QuantEinsum(eqx.Module):
    """A product of two activations, [`eqx_quant.nn.Einsum`][], computed on fake-quantized operands.

    **Integer forward.** With `matmul="int"` (the default), when both quantizers are fake quantizers on symmetric
    grids whose scales are constant along the contracted labels (per tensor; per token, per head or per any free
    label, e.g. `DynamicFakeQuant(8, axis=0)` for one scale per row of a `(tokens, features)` operand contracted
    over features), and the int32 sums are exact (`K * max|a| * max|b| <= 2**31 - 1` for a contraction of length
    `K`: `K <= 131071` for int8 operands), the forward is the int32 einsum of the two operands' integers, rescaled
    once per output element by the product of their scales. NaN in an operand makes NaN the outputs whose
    contraction it enters. Otherwise (or with `matmul="float"`) the forward is the float einsum of the
    fake-quantized operands. The backward pass is that of the float einsum of the fake-quantized operands either way.

    Both operands are activations: nothing is stored, and [`eqx_quant.convert`][] keeps the module as it is, so that
    the converted model computes exactly this.
    """

    einsum: Einsum
    lhs_quant: AbstractQuantizer | None
    rhs_quant: AbstractQuantizer | None
    matmul: Literal["int", "float"] = eqx.field(static=True)

    def __init__(
        self,
        einsum: Einsum,
        *,
        lhs_quant: AbstractQuantizer | None,
        rhs_quant: AbstractQuantizer | None,
        matmul: Literal["int", "float"] = "int",
    ):
        """**Arguments:**

        - `einsum`: the float product.
        - `lhs_quant`, `rhs_quant`: the quantizers of the two operands, or `None` for a float operand.
        - `matmul`: `"int"` for the integer einsum where the quantizers allow it, `"float"` for the float one.
        """
        self.einsum = einsum
        self.lhs_quant = lhs_quant
        self.rhs_quant = rhs_quant
        self.matmul = matmul

    def __check_init__(self):
        if not isinstance(self.einsum, Einsum):
            raise TypeError(f"`einsum` must be an eqx_quant.nn.Einsum, got {type(self.einsum).__name__}.")
        _check_quantizer("lhs_quant", self.lhs_quant)
        _check_quantizer("rhs_quant", self.rhs_quant)
        _check_matmul(self.matmul)

    def __call__(self, a: Float[Array, "..."], b: Float[Array, "..."]) -> Float[Array, "..."]:
        """`einsum(lhs_quant(a), rhs_quant(b))`, on the integers where possible."""
        equation = self.einsum.equation
        with jax.named_scope("eqx_quant.QuantEinsum"):
            quantizers = (self.lhs_quant, self.rhs_quant)
            if self.matmul == "int" and all(isinstance(q, AbstractFakeQuantizer) for q in quantizers):
                fa, ta, na = self.lhs_quant.fake_quant_and_tensor(a)  # pyright: ignore[reportOptionalMemberAccess]
                fb, tb, nb = self.rhs_quant.fake_quant_and_tensor(b)  # pyright: ignore[reportOptionalMemberAccess]
                if integer_einsum_possible(equation, ta, tb):
                    return _integer_einsum(equation, fa, fb, ta, tb, na, nb).astype(jnp.result_type(fa, fb))
            a = a if self.lhs_quant is None else self.lhs_quant(a)
            b = b if self.rhs_quant is None else self.rhs_quant(b)
            return self.einsum(a, b)


Products = Einsum | QuantEinsum


class QuantMultiheadAttention(eqx.Module):
    """`eqx.nn.MultiheadAttention` with its two products of activations as modules: `scores` (`QKᵀ`, per head
    `"sd,Sd->sS"`) and `values` (softmax·V, `"sS,Sd->sd"`), each an [`eqx_quant.nn.Einsum`][] or a
    [`eqx_quant.nn.QuantEinsum`][]. The softmax stays in floating point.

    The call computes what the wrapped attention computes (masks, dropout, `process_heads` and all), with its own
    projections (which [`eqx_quant.quantize`][] turns into quantized layers) and these two products; with float
    `Einsum`s it equals `eqx.nn.MultiheadAttention` bit for bit.
    """

    attention: eqx.nn.MultiheadAttention
    scores: Products
    values: Products

    def __init__(
        self, attention: eqx.nn.MultiheadAttention, *, scores: Products | None = None, values: Products | None = None
    ):
        """**Arguments:**

        - `attention`: the attention whose projections, sizes and dropout are used.
        - `scores`, `values`: the two products; by default float [`eqx_quant.nn.Einsum`][]s.
        """
        self.attention = attention
        self.scores = Einsum("sd,Sd->sS") if scores is None else scores
        self.values = Einsum("sS,Sd->sd") if values is None else values

    def __check_init__(self):
        if not isinstance(self.attention, eqx.nn.MultiheadAttention):
            raise TypeError(f"`attention` must be an eqx.nn.MultiheadAttention, got {type(self.attention).__name__}.")
        for name, expected in (("scores", "sd,Sd->sS"), ("values", "sS,Sd->sd")):
            product = getattr(self, name)
            einsum = product.einsum if isinstance(product, QuantEinsum) else product
            if not isinstance(einsum, Einsum) or einsum.equation != expected:
                raise ValueError(f"`{name}` must be an Einsum or QuantEinsum of {expected!r}, got {product!r}.")

    def _heads(self, projection: eqx.Module, x: Array) -> Array:
        projected = jax.vmap(projection)(x)  # pyright: ignore[reportArgumentType]
        return projected.reshape(x.shape[0], self.attention.num_heads, -1)

    def _attend(self, query, key_, value, mask, key, inference):
        query = query / math.sqrt(query.shape[-1])
        logits = self.scores(query, key_)
        if mask is not None:
            if mask.shape != logits.shape:
                raise ValueError(
                    f"`mask` must have shape (query_seq_length, kv_seq_length)={logits.shape}, got {mask.shape}."
                )
            logits = jnp.where(mask, logits, jnp.finfo(logits.dtype).min)
        with jax.numpy_dtype_promotion("standard"):
            dtype = jnp.result_type(logits.dtype, jnp.float32)
        weights = jax.nn.softmax(logits.astype(dtype)).astype(logits.dtype)
        if self.attention.dropout is not None:
            weights = self.attention.dropout(weights, key=key, inference=inference)
        return self.values(weights, value)

    def __call__(
        self,
        query: Float[Array, "q_seq q_size"],
        key_: Float[Array, "kv_seq k_size"],
        value: Float[Array, "kv_seq v_size"],
        mask: Bool[Array, "q_seq kv_seq"] | Bool[Array, "num_heads q_seq kv_seq"] | None = None,
        *,
        key: PRNGKeyArray | None = None,
        inference: bool | None = None,
        deterministic: bool | None = None,
        process_heads=None,
    ) -> Float[Array, "q_seq o_size"]:
        """Like `eqx.nn.MultiheadAttention.__call__`."""
        if deterministic is not None:
            inference = deterministic
            warnings.warn(
                "`deterministic` is deprecated in favour of `inference`, as in eqx.nn.MultiheadAttention.", stacklevel=2
            )
        if key_.shape[0] != value.shape[0]:
            raise ValueError("`key_` and `value` must be sequences of equal length.")
        att = self.attention
        q, k, v = (
            self._heads(att.query_proj, query),
            self._heads(att.key_proj, key_),
            self._heads(att.value_proj, value),
        )
        if process_heads is not None:
            shapes = (q.shape, k.shape, v.shape)
            q, k, v = process_heads(q, k, v)
            if (q.shape, k.shape, v.shape) != shapes:
                raise ValueError("`process_heads` must not change the shape of the heads.")
        keys = None if key is None else jax.random.split(key, q.shape[1])
        attend = functools.partial(self._attend, inference=inference)
        if mask is not None and mask.ndim == 3:
            out = jax.vmap(attend, in_axes=(1, 1, 1, 0, 0 if keys is not None else None), out_axes=1)(
                q, k, v, mask, keys
            )
        else:
            out = jax.vmap(
                lambda q, k, v, key: attend(q, k, v, mask, key), in_axes=(1, 1, 1, 0 if keys is not None else None),
                out_axes=1,
            )(q, k, v, keys)  # fmt: skip
        return jax.vmap(att.output_proj)(out.reshape(query.shape[0], -1))  # pyright: ignore[reportArgumentType]


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
    """

    keys: Array
    values: Array
    key_scales: Array
    value_scales: Array
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
        return cls(levels, levels, scales, scales, bits)

    @property
    def _quantizer(self) -> DynamicFakeQuant:
        return DynamicFakeQuant(self.bits, axis=0)

    def append(
        self, key_: Float[Array, "heads head_dim"], value: Float[Array, "heads head_dim"], index
    ) -> "QuantKVCache":
        """The cache with position `index` holding `key_` and `value`, quantized (jit-friendly: `index` may be traced).

        **Arguments:**

        - `key_`, `value`: one position's keys and values, shape `(num_heads, head_dim)`.
        - `index`: the position to write.

        **Returns:**

        The new cache.
        """
        expected = self.keys.shape[1:]
        if key_.shape != expected or value.shape != expected:
            raise ValueError(f"`key_` and `value` must have shape {expected}, got {key_.shape} and {value.shape}.")
        k, v = self._quantizer.quantize(key_), self._quantizer.quantize(value)

        def put(cache, row):
            return jax.lax.dynamic_update_slice_in_dim(cache, row[None].astype(cache.dtype), index, axis=0)

        return eqx.tree_at(
            lambda c: (c.keys, c.values, c.key_scales, c.value_scales),
            self,
            (put(self.keys, k.values), put(self.values, v.values), put(self.key_scales, k.scale),
             put(self.value_scales, v.scale)),
        )  # fmt: skip

    def dequantized(self) -> tuple[Array, Array]:
        """The stored keys and values as floats, `(max_len, num_heads, head_dim)` each."""
        deq = lambda levels, scale: levels.astype(jnp.float32) * scale  # noqa: E731
        return deq(self.keys, self.key_scales), deq(self.values, self.value_scales)

    def attend(self, query: Float[Array, "heads head_dim"], length) -> Float[Array, "heads head_dim"]:
        """Attention of one query over positions `0 .. length - 1`: `softmax(q kᵀ / sqrt(head_dim)) v` per head.

        **Arguments:**

        - `query`: shape `(num_heads, head_dim)`.
        - `length`: the number of positions written so far (may be traced).

        **Returns:**

        The attended values, shape `(num_heads, head_dim)`.
        """
        if query.shape != self.keys.shape[1:]:
            raise ValueError(f"`query` must have shape {self.keys.shape[1:]}, got {query.shape}.")
        q = query / math.sqrt(query.shape[-1])
        fq, tq, nq = self._quantizer.fake_quant_and_tensor(q)
        stored = QuantizedTensor(
            self.keys, self.key_scales, None, self.keys.shape, Layout((0, 1)), -(2 ** (self.bits - 1)),
            2 ** (self.bits - 1) - 1, None, "float32",
        )  # fmt: skip
        no_nan = jnp.zeros(self.keys.shape, bool)
        logits = _integer_value("hd,shd->hs", tq, stored, nq, no_nan)
        logits = jnp.where(jnp.arange(self.keys.shape[0])[None, :] < length, logits, jnp.finfo(jnp.float32).min)
        weights = jax.nn.softmax(logits, axis=-1)
        return jnp.einsum("hs,shd->hd", weights, self.dequantized()[1])
