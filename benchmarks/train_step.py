"""QAT training-step time and compile time against the float model, measured in one process.

Run with `python benchmarks/train_step.py`. For the MLP 784-1024-1024-10 (ReLU, batch 256, softmax cross-entropy,
SGD) and for the demo convnet (batch 64), it times the float model and the same model quantized with
`eqx_quant.quantize` at W8A8, W4A8 and W4A4 (weights per output channel, inputs per tensor, integer forward), at
W8A8 with the float-matmul fallback (`matmul="float"`), at W8A8 with the opt-in quantized backward
(`eqx_quant.QuantizedBackward(8)`: the linear layers' input gradients as int8 products), and at W8A8 and W4A8 with
the opt-in `eqx_quant.UnquantizedBackward()` (the float layers' gradients at the original operands, Qwix's
contract). Step times are medians of
interleaved rounds; compile times are ahead-of-time `lower(...).compile()` after clearing JAX's caches, also
medians over rounds; `trace s` is the part of it before XLA (JAX tracing the step and lowering it), `kernels` the
number of fused kernels in XLA's optimised program, `eqns` the number of equations in the step's jaxpr (top
level: a call of a jitted helper counts once) and `all eqns` the number with those inside nested jaxprs (jitted
helpers, custom derivative rules) counted too. `temp MB` is the size of the temporary buffers XLA allocates for one
step (`Compiled.memory_analysis()`).

For the MLP, two more rows time floors. `floor (casts only)` is the least work of any W8A8 step with an integer
forward: each layer only casts its weight and input to int8 (no scales, rounding, clipping or straight-through
masks) for the int8 product, and its backward is the float layer's, with the original operands. `floor (contract)`
is the least work of eqx_quant's gradient contract at W8A8, written directly in `jax.lax` (`_contract_product`):
dynamic scales from the finite maxima, the int8 product rescaled, and the derivative of `fake_quant(W) @
fake_quant(x) + b`, with the fake-quantized operands recomputed and the clipped straight-through masks. It leaves
out what the library adds: NaN propagation through the integer product, the ulp-exact scale nudge and its cap, and
the `opaque` guard against fused multiply-adds. A line printed first checks it against the library: given the
library's scales, the same loss bit for bit and the same gradients up to float32 sums, and its equation counts.

When `qwix` and `flax` are installed (`pip install -e ".[bench]"`), the MLP's table has three more rows, timed in
the same interleaved rounds: the same MLP in Flax, and Qwix's quantization-aware training of it (`QtProvider`, int8
or int4 weights per channel and int8 activations, dynamic). Their ratios are to the Flax float step, and a last
line compares the quantized steps of the two libraries directly.
"""

import functools
import pathlib
import statistics
import sys
import time

import equinox as eqx
import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
from _timing import arguments, flax_mlp, interleaved_times

import eqx_quant


sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "examples"))
from qat_demo import ConvNet  # noqa: E402  (examples/qat_demo.py)

from eqx_quant._format import IntFormat
from eqx_quant._scales import absmax_scale


def _loss(model, x, y):
    logits = jax.vmap(model)(x)
    log_probs = jax.nn.log_softmax(logits, axis=-1)
    return -jnp.mean(jnp.take_along_axis(log_probs, y[:, None], axis=-1))


def _step(model, x, y):
    loss, grads = eqx.filter_value_and_grad(_loss)(model, x, y)
    model = eqx.apply_updates(model, jax.tree.map(lambda g: -0.01 * g, grads))
    return model, loss


def _variants(model):
    def q(weight_bits, input_bits, matmul="int", backward=None):
        return eqx_quant.quantize(
            model,
            weights=eqx_quant.DynamicFakeQuant(weight_bits, axis=0),
            activations=eqx_quant.DynamicFakeQuant(input_bits),
            matmul=matmul,
            backward=backward,
        )

    return {
        "float": model,
        "W8A8": q(8, 8),
        "W4A8": q(4, 8),
        "W4A4": q(4, 4),
        "W8A8 float-matmul": q(8, 8, "float"),
        "W8A8 int8 backward": q(8, 8, backward=eqx_quant.QuantizedBackward(8)),
        "W8A8 unquantized bw": q(8, 8, backward=eqx_quant.UnquantizedBackward()),
        "W4A8 unquantized bw": q(4, 8, backward=eqx_quant.UnquantizedBackward()),
    }


class _CastLinear(eqx.Module):
    """The floor of a W8A8 training step with an integer forward: an `eqx.nn.Linear` whose forward casts its weight
    and input to int8 (no scale, no rounding, no clipping: the least work that produces int8 operands) and multiplies
    them with int32 accumulation, and whose derivative is the float layer's, as in eqx_quant's integer forward."""

    linear: eqx.nn.Linear

    def __call__(self, x):
        return _cast_product(self.linear.weight, x) + self.linear.bias


@jax.custom_jvp
def _cast_product(w, x):
    dims = (((0,), (1,)), ((), ()))
    acc = jax.lax.dot_general(x.astype(jnp.int8), w.astype(jnp.int8), dims, preferred_element_type=jnp.int32)
    return acc.astype(jnp.float32)


@_cast_product.defjvp
def _cast_product_jvp(primals, tangents):
    (w, x), (dw, dx) = primals, tangents
    return _cast_product(w, x), dw @ x + w @ dx


def _floor(mlp: eqx.nn.MLP, layer=None) -> eqx.nn.MLP:
    return eqx.tree_at(lambda m: m.layers, mlp, tuple((layer or _CastLinear)(layer_) for layer_ in mlp.layers))


# The least work of eqx_quant's gradient contract at W8A8 (weights per output channel, inputs per example), written
# directly in `jax.lax`: the scales from the finite maxima, the integers, the int8 product rescaled `(acc * s_w) * s_x
# + b`, and the derivative of `fake_quant(W) @ fake_quant(x) + b` (the product of the fake-quantized operands,
# recomputed, and the clipped straight-through masks). It leaves out what the library adds to it: NaN propagation
# through the integer product, the ulp-exact scale nudge and its cap (a scale from `max|x| * c`, with `c` the
# reciprocal of 127 rounded up by three float32 rounding errors, fits as well: the largest magnitude lands at or
# below 127), and `opaque`.
_MARGIN = np.float32(np.nextafter(np.float32((1 + 3 * 2.0**-24) / 127), np.float32(1)))


def _levels(v, axis, nudged):
    """Integer levels (as float32), the scale and `v / scale` of `v`, absmax per slice along `axis`; `nudged` takes
    the library's scale instead of the margin's."""
    magnitude = jax.lax.abs(jax.lax.stop_gradient(v))
    finite = jax.lax.select(magnitude < np.float32(np.inf), magnitude, jnp.zeros_like(magnitude))
    absmax = jax.lax.reduce_max(finite, (axis,))
    if nudged:
        scale = absmax_scale(absmax, IntFormat(-128, 127))
    else:
        scale = jax.lax.max(absmax * _MARGIN, np.float32(np.finfo(np.float32).tiny))
    scale = jax.lax.expand_dims(scale, (axis,))
    ratio = jax.lax.stop_gradient(v) * (1 / scale)
    rounded = jax.lax.round(ratio, jax.lax.RoundingMethod.TO_NEAREST_EVEN)
    return jax.lax.clamp(np.float32(-128), rounded, np.float32(127)), scale, ratio


def _int8_product(w_levels, w_scale, x_levels, x_scale):
    dims = (((0,), (1,)), ((), ()))
    x_int, w_int = x_levels[0].astype(jnp.int8), w_levels.astype(jnp.int8)
    acc = jax.lax.dot_general(x_int, w_int, dims, preferred_element_type=jnp.int32)
    return (acc.astype(jnp.float32) * w_scale[:, 0]) * x_scale[0, 0]


@functools.partial(jax.custom_jvp, nondiff_argnums=(0,))
def _contract_product(nudged, w, x):
    return _int8_product(*_levels(w, 1, nudged)[:2], *_levels(x[None], 1, nudged)[:2])


@_contract_product.defjvp
def _contract_product_jvp(nudged, primals, tangents):
    (w, x), (dw, dx) = primals, tangents
    (w_levels, w_scale, w_ratio), (x_levels, x_scale, x_ratio) = _levels(w, 1, nudged), _levels(x[None], 1, nudged)
    inside = lambda r: (r >= -128) & (r <= 127)  # noqa: E731
    dw = jax.lax.select(inside(w_ratio), dw, jnp.zeros_like(dw))
    dx = jax.lax.select(inside(x_ratio[0]), dx, jnp.zeros_like(dx))
    y = _int8_product(w_levels, w_scale, x_levels, x_scale)
    return y, dw @ (x_levels[0] * x_scale[0]) + (w_levels * w_scale) @ dx


class _ContractLinear(eqx.Module):
    """An `eqx.nn.Linear` computed by `_contract_product` (with the library's scales if `nudged`)."""

    linear: eqx.nn.Linear
    nudged: bool = eqx.field(static=True, default=False)

    def __call__(self, x):
        return _contract_product(self.nudged, self.linear.weight, x) + self.linear.bias


def _compiled_step(model, x, y, rounds):
    """The jitted SGD step on the model's float arrays, compiled ahead of time, its arrays, and per round (each after
    clearing JAX's caches) the time JAX takes to trace and lower it and the time XLA takes to compile that."""
    params, static = eqx.partition(model, eqx.is_inexact_array)

    @jax.jit
    def step(params, x, y):
        new, loss = _step(eqx.combine(params, static), x, y)
        return eqx.filter(new, eqx.is_inexact_array), loss

    return _compiled(step, params, x, y, rounds)


def _qwix_steps(x) -> dict:
    """The MLP in Flax, float and quantized by Qwix (int8 / int4 weights per channel, int8 activations, dynamic), as
    `(jitted SGD step, params)` pairs; empty if `qwix` or `flax` is not installed."""
    flax = flax_mlp((1024, 1024, 10))
    if flax is None:
        return {}
    float_model, qwix = flax
    params = float_model.init(jax.random.key(1), x)["params"]

    def qat(weight_qtype):
        rule = qwix.QtRule(module_path=".*", weight_qtype=weight_qtype, act_qtype=jnp.int8)
        return qwix.quantize_model(float_model, qwix.QtProvider([rule]))

    def step_of(model):
        def loss(params, x, y):
            log_probs = jax.nn.log_softmax(model.apply({"params": params}, x), axis=-1)
            return -jnp.mean(jnp.take_along_axis(log_probs, y[:, None], axis=-1))

        @jax.jit
        def step(params, x, y):
            value, grads = jax.value_and_grad(loss)(params, x, y)
            return jax.tree.map(lambda p, g: p - 0.01 * g, params, grads), value

        return step

    models = {"Flax float": float_model, "Qwix W8A8": qat(jnp.int8), "Qwix W4A8": qat(jnp.int4)}
    return {name: (step_of(model), params) for name, model in models.items()}


def _all_equations(jaxpr) -> int:
    """The equations of `jaxpr` and, recursively, of the jaxprs inside them (jitted helpers, custom rules, ...)."""
    return sum(1 + sum(_all_equations(sub) for sub in jax.extend.core.jaxprs_in_params(e.params)) for e in jaxpr.eqns)


def _compiled(step, params, x, y, rounds):
    jaxpr = step.trace(params, x, y).jaxpr
    equations = (len(jaxpr.eqns), _all_equations(jaxpr))
    trace_times, xla_times = [], []
    for _ in range(rounds):
        jax.clear_caches()
        t0 = time.perf_counter()
        lowered = step.lower(params, x, y)
        t1 = time.perf_counter()
        compiled = lowered.compile()
        trace_times.append(t1 - t0)
        xla_times.append(time.perf_counter() - t1)
    return compiled, params, trace_times, xla_times, equations


def _bench(title, model, x, y, rounds, repeats, floors=None, others=None):
    variants = {**_variants(model), **(floors or {})}
    others = others or {}
    calls, compile_times, trace_times, kernels, temp_bytes, equations = {}, {}, {}, {}, {}, {}
    for name in [*variants, *others]:
        if name in variants:
            fn, params, traces, xla, equations[name] = _compiled_step(variants[name], x, y, rounds)
        else:
            fn, params, traces, xla, equations[name] = _compiled(*others[name], x, y, rounds)
        calls[name] = functools.partial(fn, params, x, y)
        compile_times[name] = statistics.median(t + c for t, c in zip(traces, xla, strict=True))
        trace_times[name] = statistics.median(traces)
        kernels[name] = fn.as_text().count(" fusion(")  # XLA's fused kernels in the optimised program
        temp_bytes[name] = fn.memory_analysis().temp_size_in_bytes
    step_times = interleaved_times(calls, rounds, repeats)
    print(f"\n{title}")
    print(
        f"{'variant':<20}{'step ms':>9}{'step ratio':>12}{'compile s':>11}{'compile ratio':>15}{'trace s':>9}"
        f"{'kernels':>9}{'eqns':>7}{'all eqns':>10}{'temp MB':>9}"
    )
    for name in [*variants, *others]:
        base = "Flax float" if name in others else "float"
        base_step, base_compile = statistics.median(step_times[base]), compile_times[base]
        step = statistics.median(step_times[name])
        print(
            f"{name:<20}{1e3 * step:>9.2f}{step / base_step:>12.3f}{compile_times[name]:>11.2f}"
            f"{compile_times[name] / base_compile:>15.3f}{trace_times[name]:>9.2f}{kernels[name]:>9}"
            f"{equations[name][0]:>7}{equations[name][1]:>10}"
            f"{temp_bytes[name] / 1e6:>9.2f}"
        )
    if others:
        pairs = [(ours, f"Qwix {ours[:4]}") for ours in ("W8A8", "W8A8 unquantized bw", "W4A8", "W4A8 unquantized bw")]
        for ours, theirs in pairs:
            ratio = statistics.median(step_times[ours]) / statistics.median(step_times[theirs])
            print(f"step {ours} / {theirs}: {ratio:.3f}")


def _check_contract_floor(mlp, x, y):
    """Prints that the contract floor, given the library's scales, computes the library's W8A8 step (the same loss,
    bit for bit, and the same gradients up to the order of float32 sums), and how many equations its step traces:
    the difference from the floor's count is the scale nudge's, and the rest of the difference from the W8A8 row's
    is NaN propagation and the library's other bookkeeping."""
    nudged = _floor(mlp, functools.partial(_ContractLinear, nudged=True))
    library = _variants(mlp)["W8A8"]
    loss_and_grad = eqx.filter_jit(eqx.filter_value_and_grad(_loss))
    (floor_loss, floor_grads), (loss, grads) = loss_and_grad(nudged, x, y), loss_and_grad(library, x, y)
    leaves = [jax.tree.leaves(eqx.filter(g, eqx.is_array)) for g in (floor_grads, grads)]
    close = all(np.allclose(a, b, rtol=1e-5, atol=1e-7) for a, b in zip(*leaves, strict=True))
    params, static = eqx.partition(nudged, eqx.is_inexact_array)
    jaxpr = jax.make_jaxpr(lambda p: eqx.filter(_step(eqx.combine(p, static), x, y), eqx.is_array))(params).jaxpr
    print(
        f"floor (contract) with the library's scales: its loss equals W8A8's bit for bit: {bool(floor_loss == loss)}; "
        f"its gradients are W8A8's (within float32 sums): {close}; its step traces {len(jaxpr.eqns)} / "
        f"{_all_equations(jaxpr)} equations"
    )


def main():
    args = arguments(__doc__, repeats=10)
    rng = np.random.default_rng(0)
    key = jax.random.key(0)

    mlp = eqx.nn.MLP(784, 10, 1024, 2, activation=jax.nn.relu, key=key)
    x = jnp.asarray(rng.standard_normal((256, 784), dtype=np.float32))
    y = jnp.asarray(rng.integers(0, 10, 256, dtype=np.int32))
    others = _qwix_steps(x)
    if not others:
        print('qwix and flax are not installed: no Qwix rows (pip install -e ".[bench]")')
    mlp_title = "MLP 784-1024-1024-10, batch 256"
    floors = {"floor (casts only)": _floor(mlp), "floor (contract)": _floor(mlp, _ContractLinear)}
    _check_contract_floor(mlp, x, y)
    _bench(mlp_title, mlp, x, y, args.rounds, args.repeats, floors=floors, others=others)

    convnet = ConvNet(key)
    x = jnp.asarray(rng.uniform(0, 1, (64, 1, 8, 8)).astype(np.float32))
    y = jnp.asarray(rng.integers(0, 10, 64, dtype=np.int32))
    _bench("demo convnet, batch 64", convnet, x, y, args.rounds, args.repeats * 4)


if __name__ == "__main__":
    main()
