"""`eqx.nn.MultiheadAttention` with its two products of activations as modules that can be quantized."""

import functools
import math
import warnings
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, PRNGKeyArray

from .._misc import read_through
from ._einsum import Einsum, QuantEinsum


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

    def __getattr__(self, name: str) -> Any:
        """Every other public attribute of the wrapped attention reads through: `query_proj`, `key_proj`,
        `value_proj`, `output_proj` (at `<path>.attention.query_proj` and so on in the model's tree), `num_heads`,
        `dropout`, ..."""
        return read_through(self, "attention", name)

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
