"""Test models written the way Equinox model libraries write them: a vision transformer, a decoder language model
with tied embeddings and rotary attention, and a MobileNet-style convnet. Tiny sizes; one example per call."""

import equinox as eqx
import jax
import jax.numpy as jnp

import eqx_quant


def scan_blocks(blocks: eqx.Module, h: jax.Array) -> jax.Array:
    """Runs blocks stacked with `eqx.filter_vmap` one after another with `jax.lax.scan`."""
    dynamic, static = eqx.partition(blocks, eqx.is_array)

    def step(h, arrays):
        return eqx.combine(arrays, static)(h), None

    return jax.lax.scan(step, h, dynamic)[0]


class LinearStack(eqx.Module):
    """`depth` `Linear(width, width)` layers stacked with `eqx.filter_vmap`, each followed by a GELU, scanned."""

    blocks: eqx.nn.Linear

    def __init__(self, width: int, depth: int, key):
        self.blocks = eqx.filter_vmap(lambda k: eqx.nn.Linear(width, width, key=k))(jax.random.split(key, depth))

    def __call__(self, x):
        dynamic, static = eqx.partition(self.blocks, eqx.is_array)
        return jax.lax.scan(lambda h, d: (jax.nn.gelu(eqx.combine(d, static)(h)), None), x, dynamic)[0]


class ViTBlock(eqx.Module):
    norm1: eqx.nn.LayerNorm
    attn: eqx.nn.MultiheadAttention
    norm2: eqx.nn.LayerNorm
    fc1: eqx.nn.Linear
    fc2: eqx.nn.Linear

    def __init__(self, dim: int, heads: int, key):
        k1, k2, k3 = jax.random.split(key, 3)
        self.norm1 = eqx.nn.LayerNorm(dim)
        self.attn = eqx.nn.MultiheadAttention(heads, dim, key=k1)
        self.norm2 = eqx.nn.LayerNorm(dim)
        self.fc1 = eqx.nn.Linear(dim, 2 * dim, key=k2)
        self.fc2 = eqx.nn.Linear(2 * dim, dim, key=k3)

    def __call__(self, h):
        x = jax.vmap(self.norm1)(h)
        h = h + self.attn(x, x, x)
        x = jax.vmap(self.norm2)(h)
        return h + jax.vmap(lambda t: self.fc2(jax.nn.gelu(self.fc1(t))))(x)


class ViT(eqx.Module):
    """Patch embedding by a strided convolution with string padding, a class token, learned positions, pre-LN
    blocks stacked with `eqx.filter_vmap` and scanned, a linear head."""

    patch: eqx.nn.Conv2d
    cls: jax.Array
    pos: jax.Array
    blocks: ViTBlock
    norm: eqx.nn.LayerNorm
    head: eqx.nn.Linear

    def __init__(self, key, dim=16, heads=2, depth=2, classes=5):
        k1, k2, k3, k4 = jax.random.split(key, 4)
        self.patch = eqx.nn.Conv2d(1, dim, 4, stride=4, padding="VALID", key=k1)
        self.cls = jnp.zeros((1, dim))
        self.pos = 0.02 * jax.random.normal(k2, (5, dim))
        self.blocks = eqx.filter_vmap(lambda k: ViTBlock(dim, heads, k))(jax.random.split(k3, depth))
        self.norm = eqx.nn.LayerNorm(dim)
        self.head = eqx.nn.Linear(dim, classes, key=k4)

    def __call__(self, image):  # (1, 8, 8)
        patches = self.patch(image)  # (dim, 2, 2)
        tokens = patches.reshape(patches.shape[0], -1).T
        h = jnp.concatenate([self.cls, tokens]) + self.pos
        h = scan_blocks(self.blocks, h)
        return self.head(self.norm(h[0]))


def rotary(x: jax.Array) -> jax.Array:
    """Rotary position embedding of `(tokens, heads, head_dim)` queries or keys."""
    t, _, d = x.shape
    freqs = 1.0 / (10000.0 ** (jnp.arange(0, d, 2, dtype=jnp.float32) / d))
    angles = jnp.arange(t, dtype=jnp.float32)[:, None] * freqs[None, :]
    cos, sin = jnp.cos(angles)[:, None, :], jnp.sin(angles)[:, None, :]
    x1, x2 = x[..., ::2], x[..., 1::2]
    return jnp.stack([x1 * cos - x2 * sin, x1 * sin + x2 * cos], axis=-1).reshape(x.shape)


class RMSNorm(eqx.Module):
    weight: jax.Array

    def __init__(self, dim: int):
        self.weight = jnp.ones(dim)

    def __call__(self, x):
        return x * jax.lax.rsqrt(jnp.mean(x * x) + 1e-6) * self.weight


class DecoderBlock(eqx.Module):
    norm1: RMSNorm
    qkv: eqx.nn.Linear
    out: eqx.nn.Linear
    scores: eqx_quant.nn.Einsum
    mix: eqx_quant.nn.Einsum
    norm2: RMSNorm
    gate: eqx.nn.Linear
    up: eqx.nn.Linear
    down: eqx.nn.Linear
    heads: int = eqx.field(static=True)

    def __init__(self, dim: int, heads: int, key):
        k1, k2, k3, k4, k5 = jax.random.split(key, 5)
        self.norm1 = RMSNorm(dim)
        self.qkv = eqx.nn.Linear(dim, 3 * dim, use_bias=False, key=k1)
        self.out = eqx.nn.Linear(dim, dim, use_bias=False, key=k2)
        self.scores = eqx_quant.nn.Einsum("thd,shd->hts")
        self.mix = eqx_quant.nn.Einsum("hts,shd->thd")
        self.norm2 = RMSNorm(dim)
        self.gate = eqx.nn.Linear(dim, 2 * dim, use_bias=False, key=k3)
        self.up = eqx.nn.Linear(dim, 2 * dim, use_bias=False, key=k4)
        self.down = eqx.nn.Linear(2 * dim, dim, use_bias=False, key=k5)
        self.heads = heads

    def __call__(self, h):
        t, dim = h.shape
        x = jax.vmap(self.norm1)(h)
        q, k, v = jnp.split(jax.vmap(self.qkv)(x).reshape(t, 3, self.heads, dim // self.heads), 3, axis=1)
        q, k, v = rotary(q[:, 0]), rotary(k[:, 0]), v[:, 0]
        logits = self.scores(q, k) / jnp.sqrt(jnp.float32(dim // self.heads))
        logits = jnp.where(jnp.tril(jnp.ones((t, t), bool)), logits, -1e30)
        attn = self.mix(jax.nn.softmax(logits, axis=-1), v).reshape(t, dim)
        h = h + jax.vmap(self.out)(attn)
        x = jax.vmap(self.norm2)(h)
        return h + jax.vmap(lambda u: self.down(jax.nn.silu(self.gate(u)) * self.up(u)))(x)


class DecoderLM(eqx.Module):
    """Token embedding tied to the output head (read through `.weight`), rotary attention written with einsums,
    SwiGLU MLPs, blocks stacked and scanned."""

    embed: eqx.nn.Embedding
    blocks: DecoderBlock
    norm: RMSNorm

    def __init__(self, key, vocab=13, dim=16, heads=2, depth=2):
        k1, k2 = jax.random.split(key)
        self.embed = eqx.nn.Embedding(vocab, dim, key=k1)
        self.blocks = eqx.filter_vmap(lambda k: DecoderBlock(dim, heads, k))(jax.random.split(k2, depth))
        self.norm = RMSNorm(dim)

    def __call__(self, tokens):
        h = scan_blocks(self.blocks, jax.vmap(self.embed)(tokens))
        return jax.vmap(self.norm)(h) @ self.embed.weight.T


class SeparableBlock(eqx.Module):
    depthwise: eqx.nn.Conv2d
    pointwise: eqx.nn.Conv2d
    norm: eqx.nn.GroupNorm

    def __init__(self, channels_in: int, channels_out: int, stride: int, key):
        k1, k2 = jax.random.split(key)
        self.depthwise = eqx.nn.Conv2d(
            channels_in, channels_in, 3, stride=stride, padding="SAME", groups=channels_in, key=k1
        )
        self.pointwise = eqx.nn.Conv2d(channels_in, channels_out, 1, key=k2)
        self.norm = eqx.nn.GroupNorm(2, channels_out)

    def __call__(self, x):
        return jax.nn.relu6(self.norm(self.pointwise(jax.nn.relu6(self.depthwise(x)))))


class MobileNet(eqx.Module):
    """A stem convolution with "SAME" padding and stride, depthwise separable blocks, global average pooling and a
    linear head."""

    stem: eqx.nn.Conv2d
    blocks: list[SeparableBlock]
    head: eqx.nn.Linear

    def __init__(self, key, classes=5):
        k1, k2, k3, k4 = jax.random.split(key, 4)
        self.stem = eqx.nn.Conv2d(1, 4, 3, stride=2, padding="SAME", key=k1)
        self.blocks = [SeparableBlock(4, 8, 1, k2), SeparableBlock(8, 8, 2, k3)]
        self.head = eqx.nn.Linear(8, classes, key=k4)

    def __call__(self, image):  # (1, 8, 8)
        x = jax.nn.relu6(self.stem(image))
        for block in self.blocks:
            x = block(x)
        return self.head(jnp.mean(x, axis=(1, 2)))
