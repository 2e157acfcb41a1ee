"""Inference throughput of converted (integer) models against their float32 originals, on this machine.

Run with `python benchmarks/inference.py`. Two parts:

- For an MLP 784-1024-1024-10 (batch 256) and the demo convnet (batch 256), it builds the float model, quantizes it
  (weights 8 bits per output channel, inputs 8 bits per tensor, calibrated on random data), converts it with
  `eqx_quant.convert`, and times jitted batched inference of the float, converted and fake-quant models,
  interleaved, printing examples per second and the ratios to float.
- Side by side with Qwix: an MLP 1024-4096-1024 (ReLU) at batch 1 (one example at a time, as in decoding) and batch
  256, float and converted from the `"w8a8"` recipe (int8 weights per output channel, int8 dynamic inputs) and the
  `"w4a16_g32"` recipe (int4 weights in groups of 32, float inputs); when `qwix` and `flax` are installed
  (`pip install -e ".[bench]"`), the same MLP in Flax, float and through Qwix's `PtqProvider` (int8 weights and
  inputs; int4 weights in tiles of 32), timed in the same interleaved rounds. Each ratio is to its own library's
  float model, taken round by round. The figures are written to `benchmarks/results/inference.json`.
"""

import functools
import json
import pathlib
import statistics
import sys

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from _timing import arguments, flax_mlp, interleaved_times

import eqx_quant


sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "examples"))
from qat_demo import ConvNet  # noqa: E402  (examples/qat_demo.py)


@eqx.filter_jit
def _batched(model, x):
    return jax.vmap(model)(x)


def _bench(title, model, x, rounds, repeats):
    quantized = eqx_quant.quantize(
        model, weights=eqx_quant.DynamicFakeQuant(8, axis=0), activations=eqx_quant.DynamicFakeQuant(8)
    )
    quantized = eqx_quant.calibrate(quantized, [x])
    converted = eqx_quant.convert(quantized)
    models = {"float32": model, "int8 (converted)": converted, "fake-quant": quantized}
    # Each model is an argument of the jitted function, not a constant of it, as in a serving loop whose parameters
    # are loaded at run time: XLA cannot precompute anything from the weights (such as their quantization).
    calls = {name: functools.partial(_batched, m, x) for name, m in models.items()}
    rates = {name: [x.shape[0] / t for t in times] for name, times in interleaved_times(calls, rounds, repeats).items()}
    base = statistics.median(rates["float32"])
    print(f"\n{title}")
    print(f"{'model':<20}{'examples/s':>14}{'ratio to float32':>18}")
    for name, r in rates.items():
        print(f"{name:<20}{statistics.median(r):>14,.0f}{statistics.median(r) / base:>18.3f}")


class _MLP(eqx.Module):
    up: eqx.nn.Linear
    down: eqx.nn.Linear

    def __init__(self, width, hidden, key):
        k1, k2 = jax.random.split(key)
        self.up, self.down = eqx.nn.Linear(width, hidden, key=k1), eqx.nn.Linear(hidden, width, key=k2)

    def __call__(self, x):
        return self.down(jax.nn.relu(self.up(x)))


def _qwix_models(width, hidden, x) -> dict:
    """The MLP in Flax, float and quantized by Qwix's PTQ (int8 weights and inputs; int4 weights in tiles of 32), as
    `(jitted forward, params)` pairs; empty if `qwix` or `flax` is not installed."""
    flax = flax_mlp((hidden, width))
    if flax is None:
        return {}
    model, qwix = flax
    params = model.init(jax.random.key(0), x)["params"]
    out = {"Qwix float": (jax.jit(lambda p, x: model.apply({"params": p}, x)), params)}
    for name, weights, inputs, tile in (
        ("Qwix W8A8", jnp.int8, jnp.int8, None),
        ("Qwix W4A16 g32", jnp.int4, None, 32),
    ):
        rule = qwix.QuantizationRule(module_path=".*", weight_qtype=weights, act_qtype=inputs, tile_size=tile)
        quantized = qwix.quantize_model(model, qwix.PtqProvider([rule]))
        abstract = jax.eval_shape(quantized.init, jax.random.key(0), x)["params"]
        qparams = qwix.quantize_params(params, abstract)
        out[name] = (jax.jit(lambda p, x, m=quantized: m.apply({"params": p}, x)), qparams)
    return out


def _side_by_side(rounds, width=1024, hidden=4096) -> dict:
    mlp = _MLP(width, hidden, jax.random.key(0))
    results = {}
    for batch, repeats in ((1, 200), (256, 10)):
        x = jax.random.normal(jax.random.key(batch), (batch, width))
        calls = {"float": functools.partial(_batched, mlp, x)}
        for name, recipe in (("W8A8", "w8a8"), ("W4A16 g32", "w4a16_g32")):
            converted = eqx_quant.convert(eqx_quant.quantize(mlp, **eqx_quant.recipe(recipe)))
            calls[name] = functools.partial(_batched, converted, x)
        qwix_models = _qwix_models(width, hidden, x)
        calls |= {name: functools.partial(fn, params, x) for name, (fn, params) in qwix_models.items()}
        times = interleaved_times(calls, rounds, repeats)
        print(f"\nMLP {width}-{hidden}-{width}, batch {batch} (converted models; Qwix's PTQ models)")
        print(f"{'model':<18}{'ms':>10}{'ratio to own float':>20}")
        results[f"batch {batch}"] = {}
        for name, t in times.items():
            base = times["Qwix float" if name.startswith("Qwix") else "float"]
            ratios = [a / b for a, b in zip(t, base, strict=True)]  # paired: the same round and repeat
            row = {"ms": 1e3 * statistics.median(t), "ratio": statistics.median(ratios)}
            results[f"batch {batch}"][name] = row
            print(f"{name:<18}{row['ms']:>10.3f}{row['ratio']:>20.3f}")
        if not qwix_models:
            print('qwix and flax are not installed: no Qwix rows (pip install -e ".[bench]")')
    return results


def main():
    args = arguments(__doc__, repeats=10)
    results = _side_by_side(args.rounds)
    path = pathlib.Path(__file__).parent / "results" / "inference.json"
    path.write_text(json.dumps({"jax": jax.__version__, "backend": jax.default_backend(), **results}, indent=1))
    print(f"written to {path}")
    rng = np.random.default_rng(0)
    key = jax.random.key(0)
    mlp = eqx.nn.MLP(784, 10, 1024, 2, activation=jax.nn.relu, key=key)
    _bench("MLP 784-1024-1024-10, batch 256", mlp, jnp.asarray(rng.standard_normal((256, 784), np.float32)),
           args.rounds, args.repeats)  # fmt: skip
    images = jnp.asarray(rng.uniform(0, 1, (256, 1, 8, 8)).astype(np.float32))
    _bench("demo convnet, batch 256", ConvNet(key), images, args.rounds, args.repeats * 4)


if __name__ == "__main__":
    main()
