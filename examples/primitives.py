"""The fake-quantization primitives on small worked examples.

Run with `python examples/primitives.py`.
"""

import jax
import jax.numpy as jnp

import eqx_quant


def main():
    print(f"eqx_quant {eqx_quant.__version__} on jax {jax.__version__} ({jax.default_backend()})\n")

    qmin, qmax = eqx_quant.int_range(3)
    print(f"3-bit signed grid: [{qmin}, {qmax}]")
    x = [0.3, 1.25, -0.75, 2.6, -3.0]
    out = eqx_quant.fake_quant_vjp(x, 0.5, qmin, qmax, [1.0] * 5)
    print(f"x                     = {x}")
    print(f"fake_quant(x, 0.5)    = {out['values'].tolist()}")
    print(f"clipped-STE gradient  = {out['grads'].tolist()}   (0 where x / scale leaves [{qmin}, {qmax}])\n")

    # Ties go to the even level.
    ties = jnp.array([0.5, 1.5, 2.5, -2.5])
    print(f"round half to even    : {ties.tolist()} -> {eqx_quant.fake_quant(ties, 1.0, -8, 7).tolist()}\n")

    # A learned step size: the scale receives the LSQ gradient.
    data = jnp.linspace(-3.0, 3.0, 7)
    grad = jax.grad(lambda s: jnp.sum((eqx_quant.fake_quant(data, s, qmin, qmax) - data) ** 2))(jnp.array(0.5))
    print(f"d(quantization error)/d(scale) at scale 0.5: {float(grad):.4f}\n")

    # The pass-through clip keeps every tangent.
    clip = lambda v: eqx_quant.clip_passthrough(v, 0.0, 1.0)  # noqa: E731
    y, y_dot = jax.jvp(clip, (jnp.array([-2.0, 0.5, 3.0]),), (jnp.array([2.0, -3.0, 4.0]),))
    print(f"clip_passthrough      : {y.tolist()}, tangent {y_dot.tolist()}")


if __name__ == "__main__":
    main()
