"""How long `eqx_quant.auto_recipe` takes on a model of a few hundred layers.

Run with `python benchmarks/auto_recipe_scale.py [--layers N] [--width W] [--out JSON]`. The model is a residual
stack of `N` linear layers of width `W` (default 256 layers of 64, each its own unit of the allocation: a Python list
of `eqx.nn.Linear`, not a scanned stack), fed two batches of 32 random inputs. For each method (`"hessian"` with 8
probes per layer, and `"measured"`) it times one call with the default eight candidates at 4 average bits, and the
allocation (the dynamic program) on its own. Times are wall-clock seconds of one call each, compilation included,
since that is what a user waits for. Prints a line per method and writes the figures as JSON.
"""

import argparse
import json
import pathlib
import time

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

import eqx_quant
from eqx_quant._auto import allocate


class Residual(eqx.Module):
    layers: list

    def __init__(self, depth: int, width: int, key):
        self.layers = [eqx.nn.Linear(width, width, key=k) for k in jax.random.split(key, depth)]

    def __call__(self, x):
        for layer in self.layers:
            x = x + 0.1 * jnp.tanh(layer(x))
        return x


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=256)
    parser.add_argument("--width", type=int, default=64)
    parser.add_argument("--out", type=pathlib.Path, default=None)
    args = parser.parse_args(argv)
    model = Residual(args.layers, args.width, jax.random.key(0))
    rng = np.random.default_rng(0)
    batches = [jnp.asarray(rng.standard_normal((32, args.width)).astype(np.float32)) for _ in range(2)]
    results = {"layers": args.layers, "width": args.width, "backend": jax.default_backend()}
    for method in ("hessian", "measured"):
        start = time.perf_counter()
        probes = {"probes": 8} if method == "hessian" else {}
        auto = eqx_quant.auto_recipe(model, batches, average_bits=4, method=method, **probes)
        seconds = time.perf_counter() - start
        choices = sorted({row.choice for row in auto.report.rows})
        results[method] = {"seconds": seconds, "choices": choices, "average_bits": auto.report.average_bits}
        print(f"{method}: {seconds:.1f} s for {args.layers} layers; formats chosen: {choices}")
    rng = np.random.default_rng(1)
    costs, sizes = rng.uniform(size=(args.layers, 8)), rng.integers(1, 64, (args.layers, 8)) * 128
    start = time.perf_counter()
    allocate(costs, sizes, int(sizes.mean(axis=1).sum()))
    results["allocate_seconds"] = time.perf_counter() - start
    print(f"allocation alone ({args.layers} units, 8 candidates): {results['allocate_seconds']:.2f} s")
    if args.out is not None:
        args.out.write_text(json.dumps(results, indent=1))
    return results


if __name__ == "__main__":
    main()
