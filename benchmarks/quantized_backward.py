"""The opt-in quantized backward (`eqx_quant.QuantizedBackward`) against the float backward of the fake-quant
formulation: training-step time, and the accuracy that QAT reaches with each.

Run with `python benchmarks/quantized_backward.py --out DIR` (add `--lm full --cache DIR` for the language model's
full preset, `--demo` for the digits demo). It measures

- the MLP 784-1024-1024-10 step (batch 256, SGD, as in `train_step.py`): float, W8A8 with the float backward, and
    W8A8 with `QuantizedBackward(8)` (input gradients as int8 products, rounding to nearest), interleaved;
- the language-model benchmark's QAT arm at `w4a8_g32` (`benchmarks/lm.py`, preset `--lm`, `smoke` by default)
    with the float backward and with `QuantizedBackward(8)`: validation bits per character and step time;
- with `--demo`, the digits demo's QAT accuracy (`python examples/qat_demo.py`) with both backwards.

It prints the figures and writes them to `DIR/quantized_backward.json`.
"""

import argparse
import functools
import json
import pathlib
import statistics
import sys

import equinox as eqx
import jax
import jax.numpy as jnp
import lm
import numpy as np
from _timing import interleaved_times
from train_step import _compiled_step

import eqx_quant


sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "examples"))
import qat_demo  # noqa: E402  (examples/qat_demo.py)


RECIPE = "w4a8_g32"


def mlp_steps(rounds: int, repeats: int) -> dict:
    """Median step times (ms) of the MLP, float and W8A8 with each backward, and their ratios to the float step."""
    key = jax.random.key(0)
    mlp = eqx.nn.MLP(784, 10, 1024, 2, activation=jax.nn.relu, key=key)
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((256, 784), dtype=np.float32))
    y = jnp.asarray(rng.integers(0, 10, 256, dtype=np.int32))
    w8a8 = functools.partial(
        eqx_quant.quantize,
        mlp,
        weights=eqx_quant.DynamicFakeQuant(8, axis=0),
        activations=eqx_quant.DynamicFakeQuant(8),
    )
    models = {
        "float": mlp,
        "W8A8 float backward": w8a8(),
        "W8A8 int8 backward": w8a8(backward=eqx_quant.QuantizedBackward(8)),
    }
    calls = {}
    for name, model in models.items():
        fn, params, *_ = _compiled_step(model, x, y, 1)
        calls[name] = functools.partial(fn, params, x, y)
    times = interleaved_times(calls, rounds, repeats)
    base = statistics.median(times["float"])
    return {
        name: {"step_ms": 1e3 * statistics.median(t), "ratio": statistics.median(t) / base} for name, t in times.items()
    }


def lm_qat(preset: str, cache: pathlib.Path | None) -> dict:
    """The language model's QAT arm at `RECIPE` with the float backward and with `QuantizedBackward(8)`."""
    bench = lm.prepare(lm.PRESETS[preset], progress=False)
    model, _ = lm.float_model(bench, cache)
    out = {"preset": preset, "float_val_bpc": lm.validation_bpc(model, bench)}
    models = {}
    for name, backward in (("float backward", None), ("int8 backward", eqx_quant.QuantizedBackward(8))):
        quantized = eqx_quant.quantize(model, **eqx_quant.recipe(RECIPE, keep=lm.KEEP, learned=True), backward=backward)
        models[name] = quantized
        trained = lm.finetune(quantized, bench, description=f"qat {RECIPE} {name}")
        out[name] = {"val_bpc": lm.validation_bpc(trained, bench)}
    seconds = lm.step_seconds({"float": model, **models}, bench)
    for name in models:
        out[name]["step_ms"] = 1e3 * seconds[name]
        out[name]["step_ratio"] = seconds[name] / seconds["float"]
    out["float_step_ms"] = 1e3 * seconds["float"]
    out["bpc_change"] = out["int8 backward"]["val_bpc"] / out["float backward"]["val_bpc"] - 1
    return out


def demo_qat(out: pathlib.Path) -> dict:
    """The digits demo's QAT accuracies with each backward."""
    accuracies = {}
    for name, backward in (("float backward", None), ("int8 backward", eqx_quant.QuantizedBackward(8))):
        results = qat_demo.run(out=out / name.replace(" ", "_"), backward=backward, progress=False, log=None)
        accuracies[name] = {config: r["accuracy"] for config, r in results["qat"].items()}
    accuracies["change_points"] = {
        config: 100 * (accuracies["int8 backward"][config] - accuracies["float backward"][config])
        for config in accuracies["float backward"]
    }
    return accuracies


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=pathlib.Path, required=True)
    parser.add_argument("--lm", choices=sorted(lm.PRESETS), default="smoke")
    parser.add_argument("--cache", type=pathlib.Path, default=None, help="folder of the trained float LM")
    parser.add_argument("--demo", action="store_true", help="also run the digits demo with both backwards")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    print(f"jax {jax.__version__}, backend {jax.default_backend()}, {jax.devices()[0].device_kind}")
    args.out.mkdir(parents=True, exist_ok=True)
    results = {"mlp": mlp_steps(args.rounds, args.repeats)}
    for name, r in results["mlp"].items():
        print(f"MLP {name:<22} step {r['step_ms']:7.2f} ms  ratio to float {r['ratio']:.3f}")
    results["lm"] = lm_qat(args.lm, args.cache)
    r = results["lm"]
    for name in ("float backward", "int8 backward"):
        print(
            f"LM {RECIPE} QAT, {name:<15} val {r[name]['val_bpc']:.4f} bpc, step {r[name]['step_ms']:.1f} ms "
            f"({r[name]['step_ratio']:.3f} of float)"
        )
    print(f"LM bpc change with the int8 backward: {100 * r['bpc_change']:+.2f}%")
    if args.demo:
        results["demo"] = demo_qat(args.out)
        for config, change in results["demo"]["change_points"].items():
            print(
                f"demo {config} QAT accuracy: float backward {100 * results['demo']['float backward'][config]:.2f}%, "
                f"int8 backward {100 * results['demo']['int8 backward'][config]:.2f}% ({change:+.2f} points)"
            )
    path = args.out / "quantized_backward.json"
    path.write_text(json.dumps(results, indent=1))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
