"""The same MLP written with `eqx.nn.Linear` layers and with bare weight arrays, quantized by the layer path and by
the traced path (`quantize(..., example=)`): their outputs compared bit for bit, their training step, compile time
and converted inference timed side by side, for `w8a8` and `w4a8_g32` on the integer products, and for `w4a8_g32`
with `matmul="float"` (the float product of the quantized operands).

Run with `python benchmarks/traced.py` (`--rounds`, `--repeats`). The MLP is 784-1024-1024-10 with ReLU, batch 256,
softmax cross-entropy and SGD, as in `benchmarks/train_step.py`; the bare twin holds the same arrays and computes
`x @ W.T + b`. For each recipe it prints whether the two quantized models give the same outputs bit for bit (jitted,
and eagerly for one example) and how far apart they are otherwise; the median step time of each (and of the float
model) and their ratio; the ahead-of-time compile time of each step (`lower(...).compile()` after clearing JAX's
caches, median over rounds); and the converted models' inference time at batch 1 and 256. Writes
`benchmarks/results/traced.json`.
"""

import dataclasses
import json
import pathlib
import statistics
import time

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from _timing import arguments, interleaved_times

import eqx_quant


WIDTHS = (784, 1024, 1024, 10)
# (name, recipe, matmul): the integer products of each recipe, and the float product of the quantized operands
ARMS = (("w8a8", "w8a8", "int"), ("w4a8_g32", "w4a8_g32", "int"), ("w4a8_g32 matmul=float", "w4a8_g32", "float"))


class BareMLP(eqx.Module):
    """The MLP with its weights as bare arrays: what a model from another package looks like."""

    weights: list
    biases: list

    def __call__(self, x):
        for i, (w, b) in enumerate(zip(self.weights, self.biases, strict=True)):
            x = x @ w.T + b
            x = jax.nn.relu(x) if i < len(self.weights) - 1 else x
        return x


def _loss(model, x, y):
    logits = jax.vmap(model)(x)
    log_probs = jax.nn.log_softmax(logits, axis=-1)
    return -jnp.mean(jnp.take_along_axis(log_probs, y[:, None], axis=-1))


@eqx.filter_jit
def _step(model, x, y):
    grads = eqx.filter_grad(_loss)(model, x, y)
    return jax.tree.map(lambda p, g: p - 0.01 * g, eqx.filter(model, eqx.is_inexact_array), grads)


@eqx.filter_jit
def _forward(model, x):
    return jax.vmap(model)(x)


def _compile_seconds(model, x, y, rounds: int) -> float:
    times = []
    for _ in range(rounds):
        jax.clear_caches()
        t0 = time.perf_counter()
        _step.lower(model, x, y).compile()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main():
    args = arguments(__doc__, repeats=5)
    keys = jax.random.split(jax.random.key(0), 4)
    mlp = eqx.nn.MLP(WIDTHS[0], WIDTHS[-1], WIDTHS[1], len(WIDTHS) - 2, key=keys[0])
    bare = BareMLP([layer.weight for layer in mlp.layers], [layer.bias for layer in mlp.layers])
    x = jax.random.normal(keys[1], (256, WIDTHS[0]))
    y = jax.random.randint(keys[2], (256,), 0, WIDTHS[-1])
    results = {}
    for name, recipe, matmul in ARMS:
        rules = [dataclasses.replace(rule, matmul=matmul) for rule in eqx_quant.recipe(recipe)["rules"]]
        layers = eqx_quant.quantize(mlp, rules)
        traced = eqx_quant.quantize(bare, rules, example=(x[0],))
        a, b = np.asarray(_forward(layers, x)), np.asarray(_forward(traced, x))
        same = bool(np.array_equal(a, b))
        eager_same = bool(np.array_equal(np.asarray(layers(x[0])), np.asarray(traced(x[0]))))
        gap = float(np.max(np.abs(a - b)) / np.max(np.abs(a)))
        models = {"float": mlp, "layers": layers, "traced": traced}
        calls = {k: (lambda m=m: _step(m, x, y)) for k, m in models.items()}
        steps = interleaved_times(calls, args.rounds, args.repeats)
        step = {k: statistics.median(v) for k, v in steps.items()}
        compile_s = {k: _compile_seconds(m, x, y, args.rounds) for k, m in (("layers", layers), ("traced", traced))}
        converted = {"layers": eqx_quant.convert(layers), "traced": eqx_quant.convert(traced)}
        inference = {}
        for batch in (1, 256):
            calls = {k: (lambda m=m, b=batch: _forward(m, x[:b])) for k, m in converted.items()}
            inference[batch] = {k: statistics.median(v) for k, v in interleaved_times(calls, args.rounds, 20).items()}
        results[name] = {
            "outputs bit for bit (jit)": same,
            "outputs bit for bit (eager, one example)": eager_same,
            "largest difference / largest output": gap,
            "step ms": {k: 1e3 * v for k, v in step.items()},
            "traced step / layers step": step["traced"] / step["layers"],
            "compile s": compile_s,
            "traced compile / layers compile": compile_s["traced"] / compile_s["layers"],
            "converted inference ms": {str(k): {m: 1e3 * t for m, t in v.items()} for k, v in inference.items()},
        }
        r = results[name]
        print(f"{name}: bit for bit {same} (eager {eager_same}), largest difference {gap:.2e} of the largest output")
        print(f"  step ms: float {r['step ms']['float']:.2f}, layers {r['step ms']['layers']:.2f}, traced "
              f"{r['step ms']['traced']:.2f} (traced / layers {r['traced step / layers step']:.3f})")  # fmt: skip
        print(f"  compile s: layers {compile_s['layers']:.2f}, traced {compile_s['traced']:.2f} (ratio "
              f"{r['traced compile / layers compile']:.2f})")  # fmt: skip
        for batch, v in r["converted inference ms"].items():
            print(f"  converted inference, batch {batch}: layers {v['layers']:.3f} ms, traced {v['traced']:.3f} ms")
    out = pathlib.Path(__file__).parent / "results" / "traced.json"
    machine = f"{jax.default_backend()}, {jax.devices()[0].device_kind}"
    record = {"machine": machine, "command": "python benchmarks/traced.py", "results": results}
    out.write_text(json.dumps(record, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
