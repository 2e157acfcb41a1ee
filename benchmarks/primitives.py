"""Times `fake_quant` against an elementwise floor measured in the same run, and prints the ratios.

Run with `python benchmarks/primitives.py`. For each size, the forward is compared with a jitted `jnp.clip` of the
same array, and forward+backward (values and the gradient of `x` for a given cotangent) with a jitted op of equal
memory traffic: it reads `x` and `g` and writes two arrays of the same size. Timings are interleaved and the median
of many repeats is reported.
"""

import argparse
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

import eqx_quant


SCALE, QMIN, QMAX = 0.02, -128, 127


def _fq(x):
    return eqx_quant.fake_quant(x, SCALE, QMIN, QMAX)


fq_forward = jax.jit(_fq)
floor_forward = jax.jit(lambda x: jnp.clip(x, -1.0, 1.0))


@jax.jit
def fq_forward_backward(x, g):
    y, pullback = jax.vjp(_fq, x)
    return y, pullback(g)[0]


@jax.jit
def floor_forward_backward(x, g):
    # Reads x and g once and writes two full-size arrays: the memory traffic of the fused forward+backward.
    return jnp.clip(x, -1.0, 1.0), jnp.where(x > 0, g, 0.0)


def _time(fn, *args, repeats):
    jax.block_until_ready(fn(*args))  # compile and warm up
    out = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        out.append(time.perf_counter() - t0)
    return out


def _median_pair(fn_a, fn_b, args, rounds, repeats):
    a, b = [], []
    for _ in range(rounds):  # interleave so that drifts in machine load hit both sides alike
        a += _time(fn_a, *args, repeats=repeats)
        b += _time(fn_b, *args, repeats=repeats)
    return statistics.median(a), statistics.median(b)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=40)
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    print(f"jax {jax.__version__}, backend {jax.default_backend()}, {jax.devices()[0].device_kind}")
    print(f"{'elements':>10} {'fwd ms':>9} {'floor ms':>9} {'ratio':>6} {'fwd+bwd ms':>11} {'floor ms':>9} {'ratio':>6}")
    for log2 in (16, 20, 22):
        n = 2**log2
        x = jnp.asarray(rng.standard_normal(n, dtype=np.float32))
        g = jnp.asarray(rng.standard_normal(n, dtype=np.float32))
        repeats = max(5, args.repeats >> max(0, log2 - 18))
        f, f0 = _median_pair(fq_forward, floor_forward, (x,), args.rounds, repeats)
        fb, fb0 = _median_pair(
            lambda x, g: fq_forward_backward(x, g), floor_forward_backward, (x, g), args.rounds, repeats
        )
        print(
            f"{'2^' + str(log2):>10} {f * 1e3:9.3f} {f0 * 1e3:9.3f} {f / f0:6.3f} {fb * 1e3:11.3f} {fb0 * 1e3:9.3f}"
            f" {fb / fb0:6.3f}"
        )


if __name__ == "__main__":
    main()
