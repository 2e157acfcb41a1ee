"""A llama-style decoder exported to GGUF with llama.cpp's names and metadata, run by llama.cpp, its logits compared
with the converted model's.

Run with `python benchmarks/gguf_llama_cpp.py [--recipe q4_0] [--only PATTERN] [--out DIR]` where `llama_cpp` (the
`llama-cpp-python` package, which builds llama.cpp from source) is installed. A decoder of 2 blocks (width 64, 4
heads, SwiGLU of 128, RMSNorm, rotary embeddings on adjacent pairs, as llama.cpp's `llama` architecture computes
them; a vocabulary of 320 with byte tokens) is quantized with the recipe, converted and written with
`eqx_quant.export_gguf` (`--recipe f32` writes the float model). llama.cpp loads the file and evaluates 24 tokens.
The script prints whether `gguf`'s dequantization of each tensor equals the model's weight, and the largest
absolute and relative difference between llama.cpp's logits and the converted model's, and those of a model that
quantizes its linear layers' inputs to Q8_0 blocks as llama.cpp's CPU products do. The logits are not expected to
agree bit for bit: llama.cpp's own Q8_0 quantizer of activations rounds some halves otherwise, it sums in its own
order, and its KV cache is float16.
"""

import argparse
import os
import tempfile

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

import eqx_quant


VOCAB, WIDTH, HEADS, FF, BLOCKS, CONTEXT, EPS, BASE = 320, 64, 4, 128, 2, 64, 1e-5, 10000.0


class Block(eqx.Module):
    attn_norm: eqx.nn.RMSNorm
    q: eqx.nn.Linear
    k: eqx.nn.Linear
    v: eqx.nn.Linear
    o: eqx.nn.Linear
    ffn_norm: eqx.nn.RMSNorm
    gate: eqx.nn.Linear
    up: eqx.nn.Linear
    down: eqx.nn.Linear

    def __init__(self, key):
        k = jax.random.split(key, 7)
        linear = lambda i, o, key: eqx.nn.Linear(i, o, use_bias=False, key=key)  # noqa: E731
        self.attn_norm, self.ffn_norm = (eqx.nn.RMSNorm(WIDTH, EPS, use_bias=False) for _ in range(2))
        self.q, self.k, self.v, self.o = (linear(WIDTH, WIDTH, key) for key in k[:4])
        self.gate, self.up, self.down = linear(WIDTH, FF, k[4]), linear(WIDTH, FF, k[5]), linear(FF, WIDTH, k[6])

    def __call__(self, h):  # h: (tokens, width)
        n, dh = h.shape[0], WIDTH // HEADS
        x = jax.vmap(self.attn_norm)(h)
        q, k, v = (jax.vmap(f)(x).reshape(n, HEADS, dh) for f in (self.q, self.k, self.v))
        q, k = rope(q), rope(k)
        scores = jnp.einsum("qhd,khd->hqk", q, k) / jnp.sqrt(float(dh))
        scores = jnp.where(jnp.tril(jnp.ones((n, n), bool)), scores, -jnp.inf)
        attended = jnp.einsum("hqk,khd->qhd", jax.nn.softmax(scores, axis=-1), v).reshape(n, WIDTH)
        h = h + jax.vmap(self.o)(attended)
        x = jax.vmap(self.ffn_norm)(h)
        return h + jax.vmap(self.down)(jax.nn.silu(jax.vmap(self.gate)(x)) * jax.vmap(self.up)(x))


def rope(x):
    """Rotary embeddings on adjacent pairs `(x[2i], x[2i + 1])`, llama.cpp's mode for the `llama` architecture."""
    n, _, dh = x.shape
    theta = jnp.arange(n, dtype=jnp.float32)[:, None] * BASE ** (-jnp.arange(0, dh, 2, dtype=jnp.float32) / dh)
    cos, sin = jnp.cos(theta)[:, None], jnp.sin(theta)[:, None]
    even, odd = x[..., 0::2], x[..., 1::2]
    return jnp.stack([even * cos - odd * sin, even * sin + odd * cos], axis=-1).reshape(x.shape)


class Decoder(eqx.Module):
    embed: eqx.nn.Embedding
    blocks: list
    norm: eqx.nn.RMSNorm
    head: eqx.nn.Linear

    def __init__(self, key):
        k = jax.random.split(key, BLOCKS + 2)
        self.embed = eqx.nn.Embedding(VOCAB, WIDTH, key=k[0])
        self.blocks = [Block(key) for key in k[1:-1]]
        self.norm = eqx.nn.RMSNorm(WIDTH, EPS, use_bias=False)
        self.head = eqx.nn.Linear(WIDTH, VOCAB, use_bias=False, key=k[-1])

    def __call__(self, tokens):
        h = jax.vmap(self.embed)(tokens)
        for block in self.blocks:
            h = block(h)
        return jax.vmap(self.head)(jax.vmap(self.norm)(h))


LLAMA_NAMES = {"attn_norm": "attn_norm", "q": "attn_q", "k": "attn_k", "v": "attn_v", "o": "attn_output",
               "ffn_norm": "ffn_norm", "gate": "ffn_gate", "up": "ffn_up", "down": "ffn_down"}  # fmt: skip


def llama_name(path: str) -> str:
    """llama.cpp's tensor names: `blocks.0.q.weight` is `blk.0.attn_q.weight`."""
    if path.startswith("blocks."):
        _, i, part, leaf = path.split(".")
        return f"blk.{i}.{LLAMA_NAMES[part]}.{leaf}"
    return {"embed.weight": "token_embd.weight", "norm.weight": "output_norm.weight", "head.weight": "output.weight"}[
        path
    ]


def weight_at(model: Decoder, path: str):
    """The weight at a path such as `blocks.0.q.weight` (a converted layer's dequantized one)."""
    node = model
    for part in path.split("."):
        node = node[int(part)] if part.isdigit() else getattr(node, part)
    return node


def metadata() -> dict:
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    tokens += [f"t{i}" for i in range(VOCAB - len(tokens))]
    types = [2, 3, 3] + [6] * 256 + [1] * (VOCAB - 259)  # unknown, control, byte, normal
    u32 = np.uint32
    return {
        "general.architecture": "llama",
        "general.name": "eqx_quant toy decoder",
        "llama.context_length": u32(CONTEXT),
        "llama.embedding_length": u32(WIDTH),
        "llama.block_count": u32(BLOCKS),
        "llama.feed_forward_length": u32(FF),
        "llama.attention.head_count": u32(HEADS),
        "llama.attention.head_count_kv": u32(HEADS),
        "llama.attention.layer_norm_rms_epsilon": np.float32(EPS),
        "llama.rope.freq_base": np.float32(BASE),
        "llama.rope.dimension_count": u32(WIDTH // HEADS),
        "llama.vocab_size": u32(VOCAB),
        "tokenizer.ggml.model": "llama",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.scores": np.zeros(VOCAB, np.float32),
        "tokenizer.ggml.token_type": np.asarray(types, np.int32),
        "tokenizer.ggml.bos_token_id": u32(1),
        "tokenizer.ggml.eos_token_id": u32(2),
        "tokenizer.ggml.unknown_token_id": u32(0),
        "tokenizer.ggml.add_bos_token": False,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--recipe", default="q4_0", choices=["q8_0", "q4_0", "q5_0", "f32"])
    parser.add_argument("--only", default=".*", help="quantize only the layers whose path matches this pattern")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    import gguf

    model = Decoder(jax.random.key(0))
    if args.recipe != "f32":  # "f32": the float model, to check the architecture apart from quantization
        weight = eqx_quant.recipe(args.recipe)["rules"][0].weight
        model = eqx_quant.convert(eqx_quant.quantize(model, [eqx_quant.Rule(args.only, weight=weight, input=None)]))
    path = os.path.join(args.out or tempfile.mkdtemp(), f"decoder-{args.recipe}.gguf")
    eqx_quant.export_gguf(path, model, names=llama_name, metadata=metadata())
    print(f"{path}: {os.path.getsize(path)} bytes")

    paths = ["embed.weight", "norm.weight", "head.weight"]
    paths += [f"blocks.{i}.{part}.weight" for i in range(BLOCKS) for part in LLAMA_NAMES]
    weights = {llama_name(p): np.asarray(weight_at(model, p)) for p in paths}
    exact = all(
        np.array_equal(gguf.quants.dequantize(t.data, t.tensor_type).reshape(weights[t.name].shape), weights[t.name])
        for t in gguf.GGUFReader(path).tensors
    )
    print(f"gguf's dequantization equals the model's quantized weights: {exact}")

    try:
        import llama_cpp
    except ImportError:
        print("llama_cpp is not installed (pip install llama-cpp-python builds llama.cpp): no logits to compare.")
        return
    tokens = [int(t) for t in np.random.default_rng(0).integers(3, VOCAB, 24)]
    ours = np.asarray(eqx.filter_jit(model)(jnp.asarray(tokens)))
    llm = llama_cpp.Llama(path, n_ctx=CONTEXT, n_batch=CONTEXT, logits_all=True, n_threads=2, verbose=False)
    llm.eval(tokens)
    theirs = np.asarray(llm.scores[: len(tokens)], np.float32)
    diff = np.abs(theirs - ours)
    print(f"llama.cpp {llama_cpp.__version__}, recipe {args.recipe} on {args.only!r}, {len(tokens)} tokens")
    print(f"logits: max |difference| {diff.max():.3g}, max |logit| {np.abs(ours).max():.3g}, "
          f"relative {diff.max() / np.abs(ours).max():.3g}")  # fmt: skip
    print(f"argmax agrees at {np.mean(theirs.argmax(-1) == ours.argmax(-1)):.0%} of the tokens")
    if args.recipe != "f32":
        # llama.cpp's CPU products of Q4_0, Q5_0 and Q8_0 weights quantize their input to Q8_0 blocks: the same
        # model with its linear layers' inputs quantized so (on GGML's reference rounding; llama.cpp's vectorised
        # quantizer rounds some halves otherwise, and its KV cache is float16).
        q8 = eqx_quant.DynamicFakeQuant("q8_0", group_size=32)
        rules = [eqx_quant.Rule(args.only, weight=weight, input=q8)]  # pyright: ignore[reportPossiblyUnbound]
        emulated = eqx_quant.quantize(Decoder(jax.random.key(0)), rules)  # embeddings take indices: no input quantizer
        close = np.abs(theirs - np.asarray(eqx.filter_jit(emulated)(jnp.asarray(tokens)))).max(-1)
        print(f"with Q8_0 inputs in JAX too: max |difference| {close.max():.3g}; tokens within 1e-5: "
              f"{np.mean(close <= 1e-5):.0%}")  # fmt: skip


if __name__ == "__main__":
    main()
