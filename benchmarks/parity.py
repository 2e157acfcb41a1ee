"""Converted against fake-quant outputs, bit for bit under `jax.jit`, on whole transformer encoders built from
`eqx.nn` layers.

Run with `python benchmarks/parity.py` (`--seeds`). The model is a small protein-language-model-style encoder: a
token embedding, three pre-norm blocks (`eqx.nn.LayerNorm`, query/key/value/output `eqx.nn.Linear` projections,
attention's two products written with `jnp.einsum`, a GELU MLP, residuals), a final norm and a linear head. For each
seed (a fresh initialisation and token sequence) and each recipe it quantizes the model, converts it, calls both under
`eqx.filter_jit` and counts the models whose outputs differ in any bit, with the largest difference. Writes
`benchmarks/results/parity.json`.
"""

import argparse
import json
import pathlib

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

import eqx_quant


RECIPES = ("w8a8", "w4a8_g32", "w8a16")


class Block(eqx.Module):
    norm1: eqx.nn.LayerNorm
    q: eqx.nn.Linear
    k: eqx.nn.Linear
    v: eqx.nn.Linear
    o: eqx.nn.Linear
    norm2: eqx.nn.LayerNorm
    up: eqx.nn.Linear
    down: eqx.nn.Linear
    heads: int = eqx.field(static=True)

    def __init__(self, dim: int, heads: int, key):
        keys = jax.random.split(key, 6)
        self.norm1, self.norm2 = eqx.nn.LayerNorm(dim), eqx.nn.LayerNorm(dim)
        self.q, self.k, self.v, self.o = (eqx.nn.Linear(dim, dim, key=k) for k in keys[:4])
        self.up, self.down = eqx.nn.Linear(dim, 4 * dim, key=keys[4]), eqx.nn.Linear(4 * dim, dim, key=keys[5])
        self.heads = heads

    def __call__(self, x):
        t, dim = x.shape
        y = jax.vmap(self.norm1)(x)
        q, k, v = (jax.vmap(layer)(y).reshape(t, self.heads, -1) for layer in (self.q, self.k, self.v))
        scores = jnp.einsum("thd,shd->hts", q, k) / jnp.sqrt(jnp.float32(dim // self.heads))
        mixed = jnp.einsum("hts,shd->thd", jax.nn.softmax(scores, axis=-1), v).reshape(t, dim)
        x = x + jax.vmap(self.o)(mixed)
        return x + jax.vmap(lambda u: self.down(jax.nn.gelu(self.up(u))))(jax.vmap(self.norm2)(x))


class Encoder(eqx.Module):
    embedding: eqx.nn.Embedding
    blocks: list
    norm: eqx.nn.LayerNorm
    head: eqx.nn.Linear

    def __init__(self, key, vocab: int = 33, dim: int = 64, heads: int = 4, depth: int = 3):
        keys = jax.random.split(key, depth + 2)
        self.embedding = eqx.nn.Embedding(vocab, dim, key=keys[0])
        self.blocks = [Block(dim, heads, k) for k in keys[1:-1]]
        self.norm = eqx.nn.LayerNorm(dim)
        self.head = eqx.nn.Linear(dim, vocab, key=keys[-1])

    def __call__(self, tokens):
        x = jax.vmap(self.embedding)(tokens)
        for block in self.blocks:
            x = block(x)
        return jax.vmap(self.head)(jax.vmap(self.norm)(x))


@eqx.filter_jit
def _call(model, tokens):
    return model(tokens)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=6)
    args = parser.parse_args()
    print(f"jax {jax.__version__}, backend {jax.default_backend()}")
    results = {}
    for name in RECIPES:
        differing, largest = 0, 0.0
        for seed in range(args.seeds):
            model = Encoder(jax.random.key(seed))
            tokens = jax.random.randint(jax.random.key(100 + seed), (17,), 0, 33)
            quantized = eqx_quant.quantize(model, eqx_quant.recipe(name)["rules"])
            a = np.asarray(_call(quantized, tokens))
            b = np.asarray(_call(eqx_quant.convert(quantized), tokens))
            differing += int(not np.array_equal(a, b))
            largest = max(largest, float(np.max(np.abs(a - b))))
        results[name] = {"models": args.seeds, "differing": differing, "largest difference": largest}
        print(f"{name}: {differing} of {args.seeds} converted models differ from the fake-quant one "
              f"(largest difference {largest:.3g})")  # fmt: skip
    out = pathlib.Path(__file__).parent / "results" / "parity.json"
    out.write_text(json.dumps({"command": "python benchmarks/parity.py", "results": results}, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
