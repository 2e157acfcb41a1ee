"""Where the time of a converted weight-only layer goes at batch 1, and the formulations that do not help.

Run with `python benchmarks/weight_only_batch1.py`. One linear layer 1024 -> 4096 without bias, converted from the
`"w4a16_g32"` recipe (int4 weights in groups of 32 along the contraction, float inputs), applied to one example
under `jax.vmap`, as a decoding step does. Timed in interleaved rounds, each as a ratio to the float layer's
product:

- `float`: the float layer;
- `converted`: the converted layer, which dequantizes its weight to float32 and multiplies as the float layer does;
- `dequantize`: the converted layer's `qweight.dequantize()` alone;
- `write floor`: int8 codes (one byte per entry, already unpacked) times their group's scale, a float32 array of
  the weight's size: the least that any formulation which dequantizes before multiplying must write;
- `fused reduce, float`: the float layer's product written as a sum of elementwise products,
  `(weight * x).sum(-1)`, which XLA computes as one loop instead of a matrix-vector product;
- `fused reduce, codes`: the same sum with the dequantization inside it (unpacking and scaling each entry where it
  is read), so that no float32 weight is ever written.

The figures are written to `benchmarks/results/weight_only_batch1.json`.
"""

import json
import pathlib
import statistics

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from _timing import arguments, interleaved_times

import eqx_quant


IN, OUT, GROUP = 1024, 4096, 32


@eqx.filter_jit
def _layer(layer, x):
    return jax.vmap(layer)(x)


@eqx.filter_jit
def _dequantize(qweight):
    return qweight.dequantize()


@jax.jit
def _write_floor(codes, scale):
    return (codes.astype(jnp.float32) * scale).reshape(OUT, IN)


@jax.jit
def _fused_float(weight, x):
    return (weight * x[0]).sum(-1)


@eqx.filter_jit
def _fused_codes(qweight, x):
    codes = qweight.unpacked().reshape(OUT, IN // GROUP, GROUP).astype(jnp.float32)
    return ((codes * qweight.scale).reshape(OUT, IN) * x[0]).sum(-1)


def main():
    args = arguments(__doc__, repeats=100)
    rng = np.random.default_rng(0)
    layer = eqx.nn.Linear(IN, OUT, use_bias=False, key=jax.random.key(0))
    converted = eqx_quant.convert(eqx_quant.quantize(layer, **eqx_quant.recipe("w4a16_g32")))
    qweight = converted.qweight
    codes = jnp.asarray(rng.integers(-8, 8, (OUT, IN // GROUP, GROUP)), jnp.int8)
    x = jnp.asarray(rng.standard_normal((1, IN), np.float32))
    calls = {
        "float": lambda: _layer(layer, x),
        "converted": lambda: _layer(converted, x),
        "dequantize": lambda: _dequantize(qweight),
        "write floor": lambda: _write_floor(codes, qweight.scale),
        "fused reduce, float": lambda: _fused_float(layer.weight, x),
        "fused reduce, codes": lambda: _fused_codes(qweight, x),
    }
    times = interleaved_times(calls, args.rounds, args.repeats)
    print(f"\nLinear {IN} -> {OUT}, w4a16_g32, batch 1")
    print(f"{'formulation':<22}{'ms':>10}{'ratio to float':>16}")
    results = {}
    for name, t in times.items():
        ratios = [a / b for a, b in zip(t, times["float"], strict=True)]  # paired: the same round and repeat
        results[name] = {"ms": 1e3 * statistics.median(t), "ratio": statistics.median(ratios)}
        print(f"{name:<22}{results[name]['ms']:>10.3f}{results[name]['ratio']:>16.2f}")
    path = pathlib.Path(__file__).parent / "results" / "weight_only_batch1.json"
    path.write_text(json.dumps({"jax": jax.__version__, "backend": jax.default_backend(), **results}, indent=1))
    print(f"written to {path}")


if __name__ == "__main__":
    main()
