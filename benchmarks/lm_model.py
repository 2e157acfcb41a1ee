"""The model of the language-model benchmark: a small character-level GPT, and greedy decoding with a key/value cache.

Pre-LN transformer blocks (LayerNorm, causal multi-head self-attention with rotary positions, LayerNorm, GELU MLP),
built with `eqx.filter_vmap` over keys and run with `jax.lax.scan`; the token embedding is tied to the output head.
Attention's two products of activations are `eqx_quant.nn.Einsum` modules, so that recipes can quantize them.
Inside a block the per-token layers (`eqx.nn.Linear`, `eqx.nn.LayerNorm`) are applied with `jax.vmap` over the
sequence. Positions enter only through rotary embeddings of the queries and keys: there is no position table, so the
embedding is the model's only input layer and its head.
"""

import math
from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int, PRNGKeyArray

from eqx_quant.nn import Einsum


ROTARY_BASE = 10000.0


def rotary(x: Float[Array, "tokens heads head_dim"], positions: Float[Array, " tokens"]) -> Array:
    """Rotary position embedding: the first and second halves of each head's features, paired element by element,
    are rotated by the angle `position * ROTARY_BASE ** (-i / half)` of pair `i`."""
    half = x.shape[-1] // 2
    inverse_frequencies = ROTARY_BASE ** (-jnp.arange(half, dtype=jnp.float32) / half)
    angles = positions[:, None] * inverse_frequencies[None, :]
    cos, sin = jnp.cos(angles)[:, None, :], jnp.sin(angles)[:, None, :]
    x1, x2 = x[..., :half], x[..., half:]
    return jnp.concatenate([x1 * cos - x2 * sin, x1 * sin + x2 * cos], axis=-1)


class KVCache(eqx.Module):
    """The keys and values of the positions decoded so far, for one block: fixed-size arrays written one position at
    a time with `jax.lax.dynamic_update_slice`, so that every decoding step has the same shapes.

    Its methods are those of [`eqx_quant.nn.QuantKVCache`][] (`empty`, `append`, `attend`), which can take its place
    in [`greedy_generate`][] to decode with an integer cache.
    """

    keys: Float[Array, "max_len heads head_dim"]
    values: Float[Array, "max_len heads head_dim"]

    @classmethod
    def empty(cls, max_len: int, num_heads: int, head_dim: int) -> "KVCache":
        """A cache of zeros holding `max_len` positions of `(num_heads, head_dim)` keys and values."""
        zeros = jnp.zeros((max_len, num_heads, head_dim), jnp.float32)
        return cls(zeros, zeros)

    def append(self, key_: Float[Array, "heads head_dim"], value: Float[Array, "heads head_dim"], index) -> "KVCache":
        """The cache with position `index` (may be traced) holding `key_` and `value`."""
        keys = jax.lax.dynamic_update_slice_in_dim(self.keys, key_[None], index, axis=0)
        values = jax.lax.dynamic_update_slice_in_dim(self.values, value[None], index, axis=0)
        return KVCache(keys, values)

    def attend(self, query: Float[Array, "heads head_dim"], length) -> Float[Array, "heads head_dim"]:
        """Attention of one query over positions `0 .. length - 1`: `softmax(q kᵀ / sqrt(head_dim)) v` per head."""
        q = query / math.sqrt(query.shape[-1])
        logits = jnp.einsum("hd,shd->hs", q, self.keys)
        written = jnp.arange(self.keys.shape[0])[None, :] < length
        weights = jax.nn.softmax(jnp.where(written, logits, jnp.finfo(jnp.float32).min), axis=-1)
        return jnp.einsum("hs,shd->hd", weights, self.values)


class Block(eqx.Module):
    """A pre-LN transformer block: `h + attention(norm1(h))`, then `h + mlp(norm2(h))`."""

    norm1: eqx.nn.LayerNorm
    qkv: eqx.nn.Linear
    proj: eqx.nn.Linear
    norm2: eqx.nn.LayerNorm
    fc: eqx.nn.Linear
    fc_out: eqx.nn.Linear
    scores: Einsum
    mix: Einsum
    heads: int = eqx.field(static=True)

    def __init__(self, dim: int, heads: int, *, key: PRNGKeyArray):
        if dim % heads or (dim // heads) % 2:
            raise ValueError(f"`dim` must split into `heads` heads of even size, got dim={dim}, heads={heads}.")
        k1, k2, k3, k4 = jax.random.split(key, 4)
        self.norm1 = eqx.nn.LayerNorm(dim)
        self.qkv = eqx.nn.Linear(dim, 3 * dim, key=k1)
        self.proj = eqx.nn.Linear(dim, dim, key=k2)
        self.norm2 = eqx.nn.LayerNorm(dim)
        self.fc = eqx.nn.Linear(dim, 4 * dim, key=k3)
        self.fc_out = eqx.nn.Linear(4 * dim, dim, key=k4)
        # The two products of activations, as modules that `eqx_quant.quantize(products=...)` can quantize.
        self.scores = Einsum("thd,shd->hts")
        self.mix = Einsum("hts,shd->thd")
        self.heads = heads

    def attend(
        self,
        q: Float[Array, "t heads head_dim"],
        k: Float[Array, "s heads head_dim"],
        v: Float[Array, "s heads head_dim"],
    ) -> Float[Array, "t heads head_dim"]:
        """Causal attention of `t` queries over as many keys: the block's two products of activations."""
        t = q.shape[0]
        logits = self.scores(q / math.sqrt(q.shape[-1]), k)
        causal = jnp.tril(jnp.ones((t, t), bool))[None]
        weights = jax.nn.softmax(jnp.where(causal, logits, jnp.finfo(jnp.float32).min), axis=-1)
        return self.mix(weights, v)

    def _mlp(self, x: Float[Array, " dim"]) -> Float[Array, " dim"]:
        return self.fc_out(jax.nn.gelu(self.fc(x)))

    def _qkv(self, x: Float[Array, " dim"]) -> Float[Array, "3 heads head_dim"]:
        return self.qkv(x).reshape(3, self.heads, -1)

    def __call__(self, h: Float[Array, "t dim"], positions: Float[Array, " t"]) -> Float[Array, "t dim"]:
        t, dim = h.shape
        qkv = jax.vmap(self._qkv)(jax.vmap(self.norm1)(h))
        q, k, v = rotary(qkv[:, 0], positions), rotary(qkv[:, 1], positions), qkv[:, 2]
        h = h + jax.vmap(self.proj)(self.attend(q, k, v).reshape(t, dim))
        return h + jax.vmap(self._mlp)(jax.vmap(self.norm2)(h))

    def decode(self, h: Float[Array, " dim"], cache: Any, index) -> tuple[Float[Array, " dim"], Any]:
        """One token at position `index` (may be traced): `cache` takes its key and value, and its query attends
        over positions `0 .. index` through `cache.attend`. Returns the block's output and the new cache."""
        qkv = self._qkv(self.norm1(h))
        position = jnp.asarray(index, jnp.float32)[None]
        q, k = rotary(qkv[0][None], position)[0], rotary(qkv[1][None], position)[0]
        cache = cache.append(k, qkv[2], index)
        h = h + self.proj(cache.attend(q, index + 1).reshape(h.shape))
        return h + self._mlp(self.norm2(h)), cache


class GPT(eqx.Module):
    """A character-level GPT: token embedding (tied to the output head), stacked pre-LN blocks, final LayerNorm."""

    embed: eqx.nn.Embedding
    blocks: Block
    norm: eqx.nn.LayerNorm

    def __init__(self, vocab_size: int, dim: int, heads: int, depth: int, *, key: PRNGKeyArray):
        """**Arguments:**

        - `vocab_size`: the number of token ids.
        - `dim`: the width of the residual stream; `heads` heads of `dim // heads` (even) features each.
        - `depth`: the number of blocks.
        - `key`: initialises the parameters.
        """
        k_embed, k_blocks = jax.random.split(key)
        # Embedding rows of norm about 1: with the tied head, initial logits have unit scale.
        weight = jax.random.normal(k_embed, (vocab_size, dim), jnp.float32) / math.sqrt(dim)
        self.embed = eqx.nn.Embedding(weight=weight)
        self.blocks = eqx.filter_vmap(lambda k: Block(dim, heads, key=k))(jax.random.split(k_blocks, depth))
        self.norm = eqx.nn.LayerNorm(dim)

    @property
    def heads(self) -> int:
        return self.blocks.heads

    @property
    def depth(self) -> int:
        return self.blocks.norm1.weight.shape[0]  # the norms stay float when the model is quantized

    def logits(self, h: Float[Array, "*t dim"]) -> Float[Array, "*t vocab"]:
        """The tied head: the final LayerNorm, then the product with the embedding's `.weight`."""
        x = self.norm(h) if h.ndim == 1 else jax.vmap(self.norm)(h)
        return x @ self.embed.weight.T

    def __call__(self, tokens: Int[Array, " t"], *, key: PRNGKeyArray | None = None) -> Float[Array, "t vocab"]:
        """The next-token logits at every position of `tokens`."""
        del key
        h = jax.vmap(self.embed)(tokens)
        positions = jnp.arange(tokens.shape[0], dtype=jnp.float32)
        arrays, static = eqx.partition(self.blocks, eqx.is_array)

        def step(h, block_arrays):
            return eqx.combine(block_arrays, static)(h, positions), None

        h, _ = jax.lax.scan(step, h, arrays)
        return self.logits(h)

    def decode(self, token: Int[Array, ""], caches: Any, index) -> tuple[Float[Array, " vocab"], Any]:
        """The next-token logits after `token` at position `index`, given the caches of every block (stacked along
        a leading axis, as the blocks are); returns them with the updated caches."""
        block_arrays, block_static = eqx.partition(self.blocks, eqx.is_array)
        cache_arrays, cache_static = eqx.partition(caches, eqx.is_array)

        def step(h, arrays):
            block, cache = eqx.combine(arrays[0], block_static), eqx.combine(arrays[1], cache_static)
            h, cache = block.decode(h, cache, index)
            return h, eqx.filter(cache, eqx.is_array)

        h, new_arrays = jax.lax.scan(step, self.embed(token), (block_arrays, cache_arrays))
        return self.logits(h), eqx.combine(new_arrays, cache_static)


def empty_caches(model: GPT, max_len: int, cache: Callable[[int, int, int], Any] = KVCache.empty) -> Any:
    """One empty cache per block, stacked along a leading axis: `cache(max_len, heads, head_dim)` broadcast."""
    head_dim = model.norm.weight.shape[0] // model.heads
    one = cache(max_len, model.heads, head_dim)
    return jax.tree.map(lambda a: jnp.broadcast_to(a, (model.depth, *a.shape)) if eqx.is_array(a) else a, one)


@eqx.filter_jit
def greedy_generate(
    model: GPT, prompt: Int[Array, " p"], new_tokens: int, cache: Callable[[int, int, int], Any] = KVCache.empty
) -> Int[Array, " n"]:
    """Greedy decoding: `prompt` is fed one token per step through [`GPT.decode`][], then each step feeds the argmax
    of the previous step's logits, for `new_tokens` new tokens. The whole loop is one `jax.lax.scan` under jit.

    **Arguments:**

    - `model`: the model.
    - `prompt`: at least one token id.
    - `new_tokens`: how many tokens to generate (at least one); `len(prompt) + new_tokens` positions are cached.
    - `cache`: builds one block's empty cache from `(max_len, heads, head_dim)`: [`KVCache.empty`][] or, for an
        integer cache, e.g. `functools.partial(eqx_quant.nn.QuantKVCache.empty, bits=8)`.

    **Returns:**

    The `new_tokens` generated ids.
    """
    p = prompt.shape[0]
    if p < 1 or new_tokens < 1:
        raise ValueError(f"`prompt` and `new_tokens` must be non-empty, got len(prompt)={p}, new_tokens={new_tokens}.")
    total = p + new_tokens
    tokens = jnp.zeros(total, jnp.int32).at[:p].set(prompt.astype(jnp.int32))

    def step(carry, index):
        tokens, caches = carry
        logits, caches = model.decode(tokens[index], caches, index)
        predicted = jnp.argmax(logits).astype(jnp.int32)
        # Positions inside the prompt keep their token; the first one after it takes the prediction.
        tokens = jnp.where(index + 1 >= p, tokens.at[index + 1].set(predicted), tokens)
        return (tokens, caches), None

    (tokens, _), _ = jax.lax.scan(step, (tokens, empty_caches(model, total, cache)), jnp.arange(total - 1))
    return tokens[p:]
