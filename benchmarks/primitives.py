"""Times `fake_quant` against an elementwise floor measured in the same run, and prints the ratios.

Run with `python benchmarks/primitives.py`. For each size, the forward is compared with a jitted `jnp.clip` of the
same array, and forward+backward (values and the gradient of `x` for a given cotangent) with a jitted op of equal
memory traffic: it reads `x` and `g` and writes two arrays of the same size. Timings are interleaved and the median
of many repeats is reported.
"""

import statistics

import jax
import jax.numpy as jnp
import numpy as np
from _timing import arguments, interleaved_times

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


def _median_pair(fn_a, fn_b, args, rounds, repeats):
    times = interleaved_times({"a": lambda: fn_a(*args), "b": lambda: fn_b(*args)}, rounds, repeats)
    return statistics.median(times["a"]), statistics.median(times["b"])


def main():
    args = arguments(__doc__, repeats=40)
    rng = np.random.default_rng(0)
    print(f"{'elements':>10} {'fwd ms':>9} {'floor ms':>9} {'ratio':>6}", end=" ")
    print(f"{'fwd+bwd ms':>11} {'floor ms':>9} {'ratio':>6}")
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
