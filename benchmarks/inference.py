"""Inference throughput of converted (integer) W8A8 models against their float32 originals, on this machine.

Run with `python benchmarks/inference.py`. For an MLP 784-1024-1024-10 (batch 256) and the demo convnet (batch 256),
it builds the float model, quantizes it (weights 8 bits per output channel, inputs 8 bits per tensor, calibrated on
random data), converts it with `eqx_quant.convert`, and times jitted batched inference of the float, converted and
fake-quant models, interleaved, printing examples per second and the ratios to float.
"""

import functools
import pathlib
import statistics
import sys

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from _timing import arguments, interleaved_times

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


def main():
    args = arguments(__doc__, repeats=10)
    rng = np.random.default_rng(0)
    key = jax.random.key(0)
    mlp = eqx.nn.MLP(784, 10, 1024, 2, activation=jax.nn.relu, key=key)
    _bench("MLP 784-1024-1024-10, batch 256", mlp, jnp.asarray(rng.standard_normal((256, 784), np.float32)),
           args.rounds, args.repeats)  # fmt: skip
    images = jnp.asarray(rng.uniform(0, 1, (256, 1, 8, 8)).astype(np.float32))
    _bench("demo convnet, batch 256", ConvNet(key), images, args.rounds, args.repeats * 4)


if __name__ == "__main__":
    main()
