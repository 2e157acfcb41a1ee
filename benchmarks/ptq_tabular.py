"""Post-training quantization of small classifiers trained on raw tabular data, where a few input features are
orders of magnitude larger than the others: what SmoothQuant, AWQ, Hadamard rotations and GPTQ recover.

Run with `python benchmarks/ptq_tabular.py [--preset {full,smoke}] [--out DIR] [--traced]` (default: the full
preset, results in `benchmarks/results/`; `--traced` quantizes each trained MLP's twin written with bare arrays,
`x @ W.T + b`, through `quantize(..., example=)`, and writes `ptq_tabular_{preset}_traced.json`). It needs the
`examples` extra (optax, scikit-learn). For each data set of the preset (`wine`, `breast_cancer`, bundled with
scikit-learn), it

1. splits the data 70/30, stratified, with a fixed seed, and leaves the features as they are (no standardisation:
   wine's proline reaches 1680 next to features of 0.1 to 10, the cancer data's areas 4254 next to smoothness of
   0.1, and these outliers reach the first linear layer);
2. trains an `eqx.nn.MLP` (in -> 64 -> 64 -> classes, ReLU) in float per seed of the preset: full-batch Adam on the
   cross-entropy, a fixed number of steps, initialised from the seed;
3. quantizes it each way of `CONFIGS` that the preset names (W8A8: int8 weights per output channel, int8 per-tensor
   inputs; W4A8: int4 weights per output channel, int8 per-tensor inputs; the input scales dynamic, one per example
   as the model runs under `jax.vmap`, or calibrated on the training split: by their absolute maximum, by the
   clipping of least squared error in the rows named "MSE inputs", or on an asymmetric grid with a zero point from
   their minimum and maximum in the rows named "min-max inputs"), in the library's order
   `quantize -> [smoothquant | awq | rotate] -> calibrate -> [gptq] -> convert`;
4. scores the converted model (`eqx_quant.convert`) on the test split, after checking that its logits equal the
   fake-quantized model's bit for bit under `eqx.filter_jit`: test accuracy, its drop from the float model (in
   percentage points) and the relative error of the logits, `||y - y_float|| / ||y_float||` over the test split;
5. prints a Markdown table per data set (accuracy per seed, then the means over seeds), the benchmark's targets
   (`targets`) as met or missed with their figures, and writes `DIR/ptq_tabular_{preset}.json`.
"""

import argparse
import dataclasses
import json
import pathlib
import platform
import time
from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import sklearn
from sklearn.datasets import load_breast_cancer, load_wine
from sklearn.model_selection import train_test_split
from traced import BareMLP  # the benchmarks' own twin of an MLP, beside this file

import eqx_quant


RESULTS = pathlib.Path(__file__).resolve().parent / "results"
DATASETS = {"wine": load_wine, "breast_cancer": load_breast_cancer}
SPLIT_SEED = 0  # the train/test split's
TEST_SIZE = 0.3


@dataclasses.dataclass(frozen=True)
class Preset:
    """The sizes of a run: the data sets, the seeds of the float training (initialisation), its full-batch Adam steps
    and learning rate, and the MLP's hidden width and depth."""

    name: str
    datasets: tuple[str, ...]
    seeds: tuple[int, ...]
    steps: int
    learning_rate: float = 1e-3
    width: int = 64
    depth: int = 2
    configs: tuple[str, ...] | None = None  # the rows of `CONFIGS` by name; None for all


# The smoke preset's rows: the premise, SmoothQuant at 8 bits (inputs calibrated both ways), and SmoothQuant with
# GPTQ at 4 bits.
SMOKE_CONFIGS = ("W8A8 RTN", "W8A8 SmoothQuant 0.5", "W8A8 SmoothQuant 0.5, MSE inputs", "W4A8 SmoothQuant 0.5 + GPTQ")
PRESETS = {
    "smoke": Preset("smoke", ("wine",), (0,), steps=500, configs=SMOKE_CONFIGS),
    "full": Preset("full", ("wine", "breast_cancer"), (0, 1, 2), steps=3000),
}


# --------------------------------------------------------------------------------------------------- configurations


_FIRST = ("layers.0", "model.weights.0")  # the first layer's path, and its weight's in the bare twin (`--traced`)


def _hidden(path: str, layer: Any) -> bool:  # a layer, or a traced weight's array
    return path not in _FIRST  # 13 and 30 input features cannot be rotated; the hidden layers' 64 can


def _first(path: str, layer: Any) -> bool:
    return path in _FIRST


ALPHAS = tuple(i / 10 for i in range(11))  # SmoothQuant's candidates when each layer searches its own

TRANSFORMS: dict[str, Callable[[Any, list, int], Any]] = {
    "smoothquant": lambda m, batches, seed: eqx_quant.smoothquant(m, batches, alpha=0.5),
    "smoothquant_0.75": lambda m, batches, seed: eqx_quant.smoothquant(m, batches, alpha=0.75),
    "smoothquant_search": lambda m, batches, seed: eqx_quant.smoothquant(m, batches, alpha=ALPHAS),
    "awq": lambda m, batches, seed: eqx_quant.awq(m, batches),
    "rotate": lambda m, batches, seed: eqx_quant.rotate(m, key=jax.random.key(seed), where=_hidden),
    # SmoothQuant on the first layer (which sees the outlier features), rotations on the hidden ones
    "smoothquant_rotate": lambda m, batches, seed: eqx_quant.rotate(
        eqx_quant.smoothquant(m, batches, alpha=0.5, where=_first), key=jax.random.key(seed), where=_hidden
    ),
}


@dataclasses.dataclass(frozen=True)
class Config:
    """A quantized row: the weights' bits (per output channel; inputs always int8 per tensor), the transform of
    `TRANSFORMS` run before calibration (or none), whether the input scales are calibrated on the training split
    (else dynamic), whether the weights are solved by GPTQ (else rounded to nearest), and whether GPTQ runs with
    `act_order` (the columns of largest Hessian diagonal first: the outlier features' columns, such as wine's last
    one, are then solved first and the other columns compensate their errors), whether GPTQ solves each layer for its
    float output from its quantized inputs (`quantized_inputs`), the calibration `method` (the absolute maximum,
    the clipping threshold of least squared error, `"mse"`, or an asymmetric grid from the minimum and maximum,
    `"minmax"`), and GPTQ's scales (`gptq_method`: from each group's absolute maximum, or clipped to the threshold
    of least squared error, `"mse"`, in the rows named "clipped scales")."""

    name: str
    bits: int
    transform: str | None = None
    calibrated: bool = True
    gptq: bool = False
    act_order: bool = False
    method: str = "absmax"
    quantized_inputs: bool = False
    gptq_method: str = "absmax"


CONFIGS = (
    Config("W8A8 RTN, dynamic inputs", 8, calibrated=False),
    Config("W8A8 RTN", 8),
    Config("W8A8 SmoothQuant 0.5", 8, "smoothquant"),
    Config("W8A8 SmoothQuant 0.75", 8, "smoothquant_0.75"),
    Config("W8A8 SmoothQuant, alpha per layer", 8, "smoothquant_search"),
    Config("W8A8 SmoothQuant 0.5, MSE inputs", 8, "smoothquant", method="mse"),
    Config("W8A8 SmoothQuant 0.5, min-max inputs", 8, "smoothquant", method="minmax"),
    Config("W8A8 SmoothQuant 0.5, dynamic inputs", 8, "smoothquant", calibrated=False),
    Config("W8A8 AWQ", 8, "awq"),
    Config("W4A8 RTN", 4),
    Config("W4A8 GPTQ", 4, gptq=True),
    Config("W4A8 GPTQ act_order", 4, gptq=True, act_order=True),
    Config("W4A8 SmoothQuant 0.5 + GPTQ", 4, "smoothquant", gptq=True),
    Config("W4A8 SmoothQuant 0.5 + GPTQ, quantized inputs", 4, "smoothquant", gptq=True, quantized_inputs=True),
    Config("W4A8 SmoothQuant, alpha per layer + GPTQ", 4, "smoothquant_search", gptq=True),
    Config("W4A8 SmoothQuant 0.5 + GPTQ, dynamic inputs", 4, "smoothquant", calibrated=False, gptq=True),
    Config(
        "W4A8 SmoothQuant 0.5 + GPTQ, quantized inputs, dynamic inputs",
        4,
        "smoothquant",
        calibrated=False,
        gptq=True,
        quantized_inputs=True,
    ),
    Config("W4A8 AWQ + GPTQ", 4, "awq", gptq=True),
    Config("W4A8 AWQ + GPTQ, dynamic inputs", 4, "awq", calibrated=False, gptq=True),
    Config("W4A8 rotate(hidden) + GPTQ", 4, "rotate", gptq=True),
    # The best of a few combinations tried on the full preset (not one of the targets' rows)
    Config(
        "W4A8 SmoothQuant(first) + rotate(hidden) + GPTQ act_order", 4, "smoothquant_rotate", gptq=True, act_order=True
    ),
    Config(
        "W4A8 SmoothQuant(first) + rotate(hidden) + GPTQ act_order, MSE inputs",
        4,
        "smoothquant_rotate",
        gptq=True,
        act_order=True,
        method="mse",
    ),
    Config(
        "W4A8 SmoothQuant(first) + rotate(hidden) + GPTQ act_order, quantized inputs",
        4,
        "smoothquant_rotate",
        gptq=True,
        act_order=True,
        quantized_inputs=True,
    ),
    Config(
        "W4A8 SmoothQuant(first) + rotate(hidden) + GPTQ act_order, quantized inputs, min-max inputs",
        4,
        "smoothquant_rotate",
        gptq=True,
        act_order=True,
        method="minmax",
        quantized_inputs=True,
    ),
    Config(
        "W4A8 SmoothQuant(first) + rotate(hidden) + GPTQ act_order, clipped scales, min-max inputs",
        4,
        "smoothquant_rotate",
        gptq=True,
        act_order=True,
        method="minmax",
        gptq_method="mse",
    ),
    Config(
        "W4A8 SmoothQuant(first) + rotate(hidden) + GPTQ act_order, clipped scales, quantized inputs, dynamic inputs",
        4,
        "smoothquant_rotate",
        calibrated=False,
        gptq=True,
        act_order=True,
        quantized_inputs=True,
        gptq_method="mse",
    ),
)


def rules(bits: int) -> list[eqx_quant.Rule]:
    """Every linear layer: `bits`-bit weights, one scale per output channel; 8-bit dynamic per-tensor inputs."""
    if bits == 8:
        return eqx_quant.recipe("w8a8")["rules"]
    return [eqx_quant.Rule(".*", weight=eqx_quant.LayerQuantizer(bits), input=eqx_quant.DynamicFakeQuant(8))]


def bare(model: eqx.nn.MLP) -> BareMLP:
    """The MLP's twin written with bare arrays, `x @ W.T + b`, which `quantize(..., example=)` quantizes by tracing
    (`--traced`)."""
    return BareMLP([layer.weight for layer in model.layers], [layer.bias for layer in model.layers])


def quantized(model: eqx.nn.MLP, config: Config, batches: list, seed: int, traced: bool = False) -> Any:
    """The fake-quantized model of `config`, calibrated (and solved) on `batches`; with `traced`, of the model's bare
    twin, its products found by tracing."""
    if traced:
        qmodel = eqx_quant.quantize(bare(model), rules=rules(config.bits), example=(batches[0][0],))
    else:
        qmodel = eqx_quant.quantize(model, rules=rules(config.bits))
    if config.transform is not None:
        qmodel = TRANSFORMS[config.transform](qmodel, batches, seed)
    if config.calibrated:
        qmodel = eqx_quant.calibrate(qmodel, batches, method=config.method)
    if config.gptq:
        qmodel = eqx_quant.gptq(
            qmodel,
            batches,
            act_order=config.act_order,
            quantized_inputs=config.quantized_inputs,
            method=config.gptq_method,  # pyright: ignore[reportArgumentType]
        )
    return qmodel


# ------------------------------------------------------------------------------------------------- data, training


@dataclasses.dataclass(frozen=True)
class Data:
    x_train: np.ndarray
    x_test: np.ndarray
    y_train: np.ndarray
    y_test: np.ndarray
    classes: int


def load(name: str) -> Data:
    """The data set's raw features (float32) and labels, split `1 - TEST_SIZE` / `TEST_SIZE`, stratified."""
    bunch = DATASETS[name]()
    x_train, x_test, y_train, y_test = train_test_split(
        bunch.data.astype(np.float32),
        bunch.target.astype(np.int32),
        test_size=TEST_SIZE,
        stratify=bunch.target,
        random_state=SPLIT_SEED,
    )
    return Data(x_train, x_test, y_train, y_test, len(bunch.target_names))


@eqx.filter_jit
def logits(model: Any, x: jax.Array) -> jax.Array:
    return jax.vmap(model)(x)


def train(data: Data, preset: Preset, seed: int) -> tuple[eqx.nn.MLP, float]:
    """The float MLP trained by full-batch Adam for the preset's steps; and its final training loss."""
    model = eqx.nn.MLP(data.x_train.shape[1], data.classes, preset.width, preset.depth, key=jax.random.key(seed))
    params, static = eqx.partition(model, eqx.is_inexact_array)
    optimizer = optax.adam(preset.learning_rate)
    x, y = jnp.asarray(data.x_train), jnp.asarray(data.y_train)

    def loss(params):
        out = jax.vmap(eqx.combine(params, static))(x)
        return jnp.mean(optax.softmax_cross_entropy_with_integer_labels(out, y))

    def step(carry, _):
        params, state = carry
        value, grads = jax.value_and_grad(loss)(params)
        updates, state = optimizer.update(grads, state, params)
        return (optax.apply_updates(params, updates), state), value

    # optax mixes Python floats with its int32 step count, which strict dtype promotion would reject.
    with jax.numpy_dtype_promotion("standard"):
        run = jax.jit(lambda p: jax.lax.scan(step, (p, optimizer.init(p)), None, length=preset.steps))
        (params, _), losses = run(params)
    return eqx.combine(params, static), float(losses[-1])


# ------------------------------------------------------------------------------------------------------ evaluation


def scores(out: np.ndarray, reference: np.ndarray, labels: np.ndarray) -> dict[str, float]:
    """Test accuracy in percent, and the relative error of the logits `out` against the float model's."""
    out64, ref64 = out.astype(np.float64), reference.astype(np.float64)
    return {
        "accuracy": 100.0 * float(np.mean(np.argmax(out, axis=1) == labels)),
        "rel_error": float(np.linalg.norm(out64 - ref64) / np.linalg.norm(ref64)),
    }


def input_spread(model: eqx.nn.MLP, x: jax.Array) -> list[dict[str, float]]:
    """Per linear layer of the float `model`, how much its inputs' magnitudes differ between the examples `x`: the
    median and the largest of each example's absolute maximum, and the levels of an 8-bit grid (127 a side) that
    the median example spans under one per-tensor scale fitted to the largest (what calibration by the absolute
    maximum fits)."""
    spread = []
    for i, layer in enumerate(model.layers):
        absmax = np.abs(np.asarray(x)).max(axis=1)
        median, largest = float(np.median(absmax)), float(absmax.max())
        spread.append({"layer": i, "median": median, "max": largest, "median_levels": 127.0 * median / largest})
        x = jax.vmap(layer)(x)
        if i < len(model.layers) - 1:
            x = model.activation(x)
    return spread


def run_dataset(name: str, preset: Preset, say: Callable[[str], None], traced: bool = False) -> dict:
    """Every row of one data set, per seed and averaged over the seeds, with the targets."""
    data = load(name)
    batches = [jnp.asarray(data.x_train)]  # calibration: the whole training split, one batch
    x_test = jnp.asarray(data.x_test)
    configs = [c for c in CONFIGS if preset.configs is None or c.name in preset.configs]
    per_seed: dict[str, list[dict]] = {"float": [], **{c.name: [] for c in configs}}
    for seed in preset.seeds:
        start = time.perf_counter()
        model, final_loss = train(data, preset, seed)
        reference = np.asarray(logits(model, x_test))
        spread = input_spread(model, batches[0])
        per_seed["float"].append(
            {
                "seed": seed,
                "train_loss": final_loss,
                **scores(reference, reference, data.y_test),
                "input_spread": spread,
            }
        )
        say(
            f"{name} seed {seed}: float trained in {time.perf_counter() - start:.1f} s, loss {final_loss:.4f}, "
            f"test accuracy {per_seed['float'][-1]['accuracy']:.2f}%; the median training example spans "
            + ", ".join(f"{s['median_levels']:.1f}" for s in spread)
            + " of 127 levels of the layers' calibrated 8-bit inputs"
        )
        for config in configs:
            start = time.perf_counter()
            qmodel = quantized(model, config, batches, seed, traced)
            converted = eqx_quant.convert(qmodel)
            fake, out = np.asarray(logits(qmodel, x_test)), np.asarray(logits(converted, x_test))
            # The library's promise: the converted (integer) model computes exactly what the fake-quantized one does.
            assert np.array_equal(fake, out), f"{name} seed {seed} {config.name}: converted != fake-quantized"
            row = {"seed": seed, **scores(out, reference, data.y_test), "converted_equals_fake": True}
            row["seconds"] = time.perf_counter() - start
            per_seed[config.name].append(row)
            say(f"  {config.name}: {row['accuracy']:.2f}%, rel. error {row['rel_error']:.4f}")
    float_accuracy = float(np.mean([r["accuracy"] for r in per_seed["float"]]))
    rows = []
    for row_name, runs in per_seed.items():
        accuracy = float(np.mean([r["accuracy"] for r in runs]))
        rows.append(
            {
                "name": row_name,
                "config": None if row_name == "float" else dataclasses.asdict(_config(row_name)),
                "accuracy": accuracy,
                "drop": float_accuracy - accuracy,
                "rel_error": float(np.mean([r["rel_error"] for r in runs])),
                "per_seed": runs,
            }
        )
    result = {
        "n_train": len(data.y_train),
        "n_test": len(data.y_test),
        "features": int(data.x_train.shape[1]),
        "classes": data.classes,
        "feature_absmax": np.abs(data.x_train).max(axis=0).tolist(),
        "rows": rows,
    }
    result["targets"] = targets(result)
    return result


def _config(name: str) -> Config:
    return next(c for c in CONFIGS if c.name == name)


# --------------------------------------------------------------------------------------------------------- targets


# name: (the target, the rows it reads, whether a row meets it from its mean drop in points and relative error)
TARGETS: dict[str, tuple[str, tuple[str, ...], Callable[[float, float], bool]]] = {
    "outliers_matter": (
        "calibrated RTN W8A8 loses >= 2 points or has >= 2% rel. error",
        ("W8A8 RTN",),
        lambda drop, rel_error: drop >= 2.0 or rel_error >= 0.02,
    ),
    "smoothquant_w8a8": (
        "SmoothQuant W8A8 within 0.5 points or 0.5% rel. error",
        (
            "W8A8 SmoothQuant 0.5",
            "W8A8 SmoothQuant 0.75",
            "W8A8 SmoothQuant, alpha per layer",
            "W8A8 SmoothQuant 0.5, MSE inputs",
            "W8A8 SmoothQuant 0.5, min-max inputs",
            "W8A8 SmoothQuant 0.5, dynamic inputs",
        ),
        lambda drop, rel_error: drop <= 0.5 or rel_error <= 0.005,
    ),
    "w4a8_smoothquant_or_awq_gptq": (
        "W4A8 SmoothQuant or AWQ + GPTQ within 2 points",
        (
            "W4A8 SmoothQuant 0.5 + GPTQ",
            "W4A8 SmoothQuant 0.5 + GPTQ, quantized inputs",
            "W4A8 SmoothQuant, alpha per layer + GPTQ",
            "W4A8 SmoothQuant 0.5 + GPTQ, dynamic inputs",
            "W4A8 SmoothQuant 0.5 + GPTQ, quantized inputs, dynamic inputs",
            "W4A8 AWQ + GPTQ",
            "W4A8 AWQ + GPTQ, dynamic inputs",
        ),
        lambda drop, rel_error: drop <= 2.0,
    ),
}


def targets(dataset: dict) -> dict[str, dict]:
    """The targets of `TARGETS` on one data set's figures, the means over the seeds (a drop is the float model's
    accuracy minus the row's, in points: a gain is within any margin): each with the figures of every row it reads
    that the run has, and met if one of them meets it (a target none of whose rows ran is left out)."""
    by_name = {r["name"]: r for r in dataset["rows"]}
    result = {}
    for key, (text, names, meets) in TARGETS.items():
        rows = []
        names = [n for n in names if n in by_name]
        if not names:
            continue
        for n in names:
            drop, rel_error = by_name[n]["drop"], by_name[n]["rel_error"]
            rows.append({"row": n, "drop": drop, "rel_error": rel_error, "met": meets(drop, rel_error)})
        result[key] = {"target": text, "met": any(r["met"] for r in rows), "rows": rows}
    return result


def table(name: str, dataset: dict) -> str:
    """One data set's rows as a Markdown table: accuracy per seed, then the means over the seeds."""
    lines = [
        f"**{name}** ({dataset['n_train']} train / {dataset['n_test']} test, {dataset['features']} features, "
        f"{dataset['classes']} classes)",
        "",
        "| configuration | accuracy per seed (%) | accuracy (%) | drop (points) | rel. error |",
        "|---|---|---:|---:|---:|",
    ]
    for r in dataset["rows"]:
        seeds = " / ".join(f"{s['accuracy']:.2f}" for s in r["per_seed"])
        lines.append(
            f"| {r['name']} | {seeds} | {r['accuracy']:.2f} | {r['drop']:+.2f} | {100 * r['rel_error']:.2f}% |"
        )
    return "\n".join(lines)


def target_lines(name: str, dataset: dict) -> list[str]:
    """A line per target: met or missed, with the figures of the rows it reads."""
    lines = []
    for t in dataset["targets"].values():
        figures = "; ".join(
            f"{r['row']}: drop {r['drop']:+.2f} points, rel. error {100 * r['rel_error']:.2f}%" for r in t["rows"]
        )
        lines.append(f"{name}: {t['target']}: {'met' if t['met'] else 'missed'} ({figures})")
    return lines


# ------------------------------------------------------------------------------------------------------------- run


def run(
    preset: str | Preset,
    out: pathlib.Path = RESULTS,
    *,
    log: Callable[[str], None] | None = print,
    traced: bool = False,
) -> dict:
    """Runs the benchmark and writes `out/ptq_tabular_{preset}.json` (`..._traced.json` for the bare twins); returns
    what it wrote."""
    if isinstance(preset, str):
        if preset not in PRESETS:
            raise ValueError(f"`preset` must be one of {sorted(PRESETS)}, got {preset!r}.")
        preset = PRESETS[preset]
    say = log if log is not None else (lambda line: None)
    start = time.perf_counter()
    datasets = {name: run_dataset(name, preset, say, traced) for name in preset.datasets}
    results = {
        "preset": dataclasses.asdict(preset),
        "traced": traced,
        "split": {"test_size": TEST_SIZE, "seed": SPLIT_SEED, "stratified": True},
        "machine": {
            "jax": jax.__version__,
            "backend": jax.default_backend(),
            "device": jax.devices()[0].device_kind,
            "eqx_quant": eqx_quant.__version__,
            "equinox": eqx.__version__,
            "sklearn": sklearn.__version__,
            "python": platform.python_version(),
            "platform": platform.platform(),
        },
        "datasets": datasets,
        "seconds": time.perf_counter() - start,
    }
    out.mkdir(parents=True, exist_ok=True)
    (out / _file(preset.name, traced)).write_text(json.dumps(results, indent=1))
    return results


def _file(preset: str, traced: bool) -> str:
    return f"ptq_tabular_{preset}{'_traced' if traced else ''}.json"


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", choices=sorted(PRESETS), default="full")
    parser.add_argument("--out", type=pathlib.Path, default=RESULTS, help="folder for ptq_tabular_{preset}.json")
    twin = "quantize each MLP's bare twin (`x @ W.T + b`) by tracing, `quantize(..., example=)`"
    parser.add_argument("--traced", action="store_true", help=twin)
    args = parser.parse_args(argv)
    print(f"jax {jax.__version__}, backend {jax.default_backend()}, {jax.devices()[0].device_kind}")
    results = run(args.preset, args.out, traced=args.traced)
    for name, dataset in results["datasets"].items():
        print()
        print(table(name, dataset))
        print()
        print("\n".join(target_lines(name, dataset)))
    print(f"\n{results['seconds']:.0f} s; wrote {args.out / _file(args.preset, args.traced)}")
    return results


if __name__ == "__main__":
    main()
