"""The QAT demo: a small convnet on the 8x8 digits, in float, post-training quantized (PTQ) and quantization-aware
trained (QAT) at several bit widths.

Run with `python examples/qat_demo.py` from a checkout; `--help` lists the options. It needs the `examples` extra
(from a checkout, `pip install -e ".[examples]"`): optax, scikit-learn (whose bundled digits dataset is used: nothing
is downloaded), tqdm and matplotlib. It prints a one-line summary of every phase as it ends and a table of the results,
and writes `results.json`, `accuracy.png` and the saved models (`models/*.eqx`, float and converted to integers) to
`--out`.
"""

import argparse
import json
import math
import pathlib
import re
import time
from collections.abc import Callable

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Int, PRNGKeyArray

import eqx_quant


CONFIGS = ("W8A8", "W4A4", "W2A4")
BATCH_SIZE = 64
QAT_LEARNING_RATE = 5e-4  # QAT fine-tunes the calibrated model, more gently than the float training (3e-3)


class ConvNet(eqx.Module):
    """Two 3x3 convolutions and two linear layers, for 1x8x8 images and 10 classes."""

    conv1: eqx.nn.Conv2d
    conv2: eqx.nn.Conv2d
    linear1: eqx.nn.Linear
    linear2: eqx.nn.Linear

    def __init__(self, key: PRNGKeyArray):
        k1, k2, k3, k4 = jax.random.split(key, 4)
        self.conv1 = eqx.nn.Conv2d(1, 16, 3, padding=1, key=k1)
        self.conv2 = eqx.nn.Conv2d(16, 32, 3, stride=2, padding=1, key=k2)
        self.linear1 = eqx.nn.Linear(32 * 4 * 4, 64, key=k3)
        self.linear2 = eqx.nn.Linear(64, 10, key=k4)

    def __call__(self, x: Float[Array, "1 8 8"]) -> Float[Array, "10"]:
        x = jax.nn.relu(self.conv1(x))
        x = jax.nn.relu(self.conv2(x))
        x = jax.nn.relu(self.linear1(x.ravel()))
        return self.linear2(x)


def load_digits(seed: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """scikit-learn's bundled 8x8 digits, scaled to [0, 1], split 80/20 with a seeded permutation."""
    from sklearn.datasets import load_digits as _load

    digits = _load()
    images = (digits.images / 16.0).astype(np.float32)[:, None, :, :]
    labels = digits.target.astype(np.int32)
    order = np.random.default_rng(seed).permutation(len(labels))
    n_train = int(0.8 * len(labels))
    train, test = order[:n_train], order[n_train:]
    return images[train], labels[train], images[test], labels[test]


def parse_config(name: str) -> tuple[int, int]:
    """`"W4A8"` -> `(4, 8)`: weight and activation bits."""
    match = re.fullmatch(r"W(\d+)A(\d+)", name)
    if match is None:
        raise ValueError(f"A bit-width configuration looks like 'W4A8', got {name!r}.")
    weight_bits, activation_bits = int(match.group(1)), int(match.group(2))
    if not 2 <= weight_bits <= 16 or not 1 <= activation_bits <= 16:
        raise ValueError(f"Weights take 2 to 16 bits and activations 1 to 16 (unsigned), got {name!r}.")
    return weight_bits, activation_bits


def quantized(
    model: eqx.Module, weight_bits: int, activation_bits: int, backward: eqx_quant.QuantizedBackward | None = None
) -> eqx.Module:
    """Weights quantized per output channel (dynamic, symmetric); inputs per tensor on an unsigned grid, since every
    layer of the convnet sees non-negative inputs (pixels, then ReLU outputs); they are calibrated afterwards.
    `backward` is the linear layers' [`eqx_quant.QuantizedBackward`][] (the convolutions keep the float backward), or
    `None` for the float backward."""
    weight = eqx_quant.DynamicFakeQuant(weight_bits, axis=0)
    inputs = eqx_quant.DynamicFakeQuant(activation_bits, signed=False)
    rules = [
        eqx_quant.Rule(r"conv\d", weight=weight, input=inputs),
        eqx_quant.Rule(r"linear\d", weight=weight, input=inputs, backward=backward),
    ]
    return eqx_quant.quantize(model, rules)


def calibrated(model: eqx.Module, images: np.ndarray, activation_bits: int) -> eqx.Module:
    """Static activation scales from training images in batches of 256 (a trailing partial batch is left out):
    MSE-optimal clipping at low bit widths, absmax at 8."""
    batches = [jnp.asarray(images[i : i + 256]) for i in range(0, max(len(images) - 255, 1), 256)]
    return eqx_quant.calibrate(model, batches, method="mse" if activation_bits < 8 else "absmax")


def weight_bytes(model: eqx.Module, weight_bits: int | None) -> int:
    """Bytes of the model's parameters: quantized weights at `weight_bits` (plus one float32 scale per output
    channel), everything else (biases, float weights) at 4 bytes per value."""
    total = 0
    quantized_weights = set()
    if weight_bits is not None:
        for layer in jax.tree.leaves(model, is_leaf=lambda n: isinstance(n, eqx_quant.nn.AbstractQuantLayer)):
            if isinstance(layer, eqx_quant.nn.AbstractQuantLayer):
                w = layer.layer.weight  # pyright: ignore[reportAttributeAccessIssue]
                total += -(-w.size * weight_bits // 8) + 4 * w.shape[0]
                quantized_weights.add(id(w))
    for leaf in jax.tree.leaves(eqx.filter(model, eqx.is_inexact_array)):
        if id(leaf) not in quantized_weights:
            total += 4 * leaf.size
    return total


@eqx.filter_jit
def _accuracy(model: eqx.Module, images: Array, labels: Array) -> Array:
    logits = jax.vmap(model)(images)
    return jnp.mean(jnp.argmax(logits, axis=-1) == labels)


def accuracy(model: eqx.Module, images: np.ndarray, labels: np.ndarray) -> float:
    return float(_accuracy(model, jnp.asarray(images), jnp.asarray(labels)))


def _loss(model: eqx.Module, images: Float[Array, "b 1 8 8"], labels: Int[Array, " b"]) -> Array:
    logits = jax.vmap(model)(images)
    log_probs = jax.nn.log_softmax(logits, axis=-1)
    return -jnp.mean(jnp.take_along_axis(log_probs, labels[:, None], axis=-1))


def total_steps(examples: int, epochs: int, max_steps: int | None) -> int:
    """The number of steps `train` takes: `epochs` passes over `examples` in whole batches of `BATCH_SIZE`, or
    `max_steps` if that is fewer."""
    total = epochs * (examples // BATCH_SIZE)
    return total if max_steps is None else min(max_steps, total)


def train(
    model: eqx.Module,
    images: np.ndarray,
    labels: np.ndarray,
    *,
    epochs: int,
    learning_rate: float,
    seed: int,
    description: str,
    max_steps: int | None = None,
    progress: bool = True,
) -> tuple[eqx.Module, list[float]]:
    """Adam with a cosine schedule on the softmax cross-entropy, batches of 64, seeded shuffling."""
    import optax
    from tqdm.auto import tqdm

    batch_size = BATCH_SIZE
    steps_per_epoch = len(images) // batch_size
    total = total_steps(len(images), epochs, max_steps)
    optimizer = optax.adam(optax.cosine_decay_schedule(learning_rate, max(total, 1)))
    opt_state = optimizer.init(eqx.filter(model, eqx.is_inexact_array))

    @eqx.filter_jit
    def step(model, opt_state, x, y):
        loss, grads = eqx.filter_value_and_grad(_loss)(model, x, y)
        # optax mixes Python floats with its int32 step count, which strict dtype promotion would reject.
        with jax.numpy_dtype_promotion("standard"):
            updates, opt_state = optimizer.update(grads, opt_state, eqx.filter(model, eqx.is_inexact_array))
        return eqx.apply_updates(model, updates), opt_state, loss

    rng = np.random.default_rng(seed)
    losses: list[float] = []
    bar = tqdm(total=total, desc=description, disable=not progress, leave=False)
    done = 0
    while done < total:
        order = rng.permutation(len(images))
        for i in range(steps_per_epoch):
            if done == total:
                break
            index = order[i * batch_size : (i + 1) * batch_size]
            model, opt_state, loss = step(model, opt_state, jnp.asarray(images[index]), jnp.asarray(labels[index]))
            done += 1
            if done % 20 == 0 or done == total:
                losses.append(float(loss))
                bar.set_postfix(loss=f"{losses[-1]:.3f}")
            bar.update(1)
    bar.close()
    return model, losses


def file_bytes(model: eqx.Module, path: pathlib.Path) -> int:
    """The size of the file that [`eqx_quant.save`][] writes for `model`."""
    eqx_quant.save(path, model)
    return path.stat().st_size


def deployed(model: eqx.Module, images: np.ndarray, labels: np.ndarray, out: pathlib.Path, name: str) -> dict:
    """Converts a fake-quantized model to integers and measures its accuracy and file size beside the float ones, and
    the time all this took (`convert_time_s`)."""
    start = time.perf_counter()
    converted = eqx_quant.convert(model)
    result = {
        "int_accuracy": accuracy(converted, images, labels),
        "int_file_bytes": file_bytes(converted, out / f"{name}.int.eqx"),
        "file_bytes": file_bytes(model, out / f"{name}.fake.eqx"),
    }
    return {**result, "convert_time_s": time.perf_counter() - start}


def _timed(fn: Callable, *args, **kwargs):
    start = time.perf_counter()
    out = fn(*args, **kwargs)
    return out, time.perf_counter() - start


def _percent(fraction: float) -> str:
    return f"{100 * fraction:.2f}%"


def run(
    *,
    epochs: int = 30,
    qat_epochs: int = 15,
    configs: tuple[str, ...] = CONFIGS,
    seed: int = 0,
    out: pathlib.Path = pathlib.Path("eqx_quant_demo_out"),
    quick: bool = False,
    progress: bool = True,
    log: Callable[[str], None] | None = print,
    backward: eqx_quant.QuantizedBackward | None = None,
) -> dict:
    """Trains and evaluates every variant and writes `results.json` and `accuracy.png` to `out`.

    **Arguments:**

    - `epochs`, `qat_epochs`: the epochs of float training and of each QAT run.
    - `configs`: the bit widths for PTQ and QAT, such as `"W4A4"`.
    - `seed`: seeds the data split, the initialisation and the shuffling.
    - `out`: the output folder, created if needed.
    - `quick`: a smoke run: 10 steps per training, 256 calibration images and 128 test images.
    - `progress`: whether to show a progress bar during each training run (on stderr; it disappears when the run
        ends).
    - `log`: receives a one-line summary of each phase as it ends (float training; for each configuration, PTQ
        calibration, QAT training and each conversion); `None` for none.
    - `backward`: the linear layers' [`eqx_quant.QuantizedBackward`][] in QAT (and PTQ, where it changes nothing), or
        `None` (the default) for the float backward of the fake-quant formulation.

    **Returns:**

    The results, as written to `results.json`.
    """
    say = log if log is not None else (lambda line: None)
    start = time.perf_counter()
    out.mkdir(parents=True, exist_ok=True)
    models = out / "models"
    models.mkdir(exist_ok=True)
    x_train, y_train, x_test, y_test = load_digits(seed)
    max_steps = 10 if quick else None
    x_calibration = x_train[: 256 if quick else 1024]
    if quick:
        x_test, y_test = x_test[:128], y_test[:128]
    key = jax.random.key(seed)
    common = dict(seed=seed, max_steps=max_steps, progress=progress)

    (float_model, float_losses), float_time = _timed(
        train, ConvNet(key), x_train, y_train, epochs=epochs, learning_rate=3e-3, description="float", **common
    )
    results: dict = {
        "float": {
            "accuracy": accuracy(float_model, x_test, y_test),
            "weight_bytes": weight_bytes(float_model, None),
            "wall_time_s": float_time,
            "steps": total_steps(len(x_train), epochs, max_steps),
            "file_bytes": file_bytes(float_model, models / "float.eqx"),
            "losses": float_losses,
        },
        "ptq": {},
        "qat": {},
    }
    r = results["float"]
    say(
        f"float: trained {r['steps']} steps in {r['wall_time_s']:.1f} s, test accuracy {_percent(r['accuracy'])}, "
        f"saved {r['file_bytes']:,} B"
    )

    def summary(model: eqx.Module, w_bits: int, wall: float, tag: str) -> dict:
        return {
            "accuracy": accuracy(model, x_test, y_test),
            "weight_bytes": weight_bytes(model, w_bits),
            "wall_time_s": wall,
            **deployed(model, x_test, y_test, models, tag),
        }

    def say_converted(name: str, method: str, r: dict) -> None:
        say(
            f"{name} {method}: converted and saved in {r['convert_time_s']:.2f} s, int accuracy "
            f"{_percent(r['int_accuracy'])}, {r['int_file_bytes']:,} B (fake-quant file {r['file_bytes']:,} B)"
        )

    ptq_models = {}
    for name in configs:
        w_bits, a_bits = parse_config(name)
        model, wall = _timed(calibrated, quantized(float_model, w_bits, a_bits, backward), x_calibration, a_bits)
        ptq_models[name] = model
        r = results["ptq"][name] = summary(model, w_bits, wall, f"ptq_{name}")
        say(f"{name} PTQ: calibrated in {r['wall_time_s']:.1f} s, test accuracy {_percent(r['accuracy'])}")
        say_converted(name, "PTQ", r)
    for name in configs:
        w_bits, a_bits = parse_config(name)

        # QAT starts from the calibrated (PTQ) model and fine-tunes its float weights through the quantizers.
        (model, losses), wall = _timed(
            train, ptq_models[name], x_train, y_train, epochs=qat_epochs, learning_rate=QAT_LEARNING_RATE,
            description=f"QAT {name}", **common,
        )  # fmt: skip
        steps = total_steps(len(x_train), qat_epochs, max_steps)
        r = results["qat"][name] = {**summary(model, w_bits, wall, f"qat_{name}"), "steps": steps, "losses": losses}
        say(
            f"{name} QAT: trained {r['steps']} steps in {r['wall_time_s']:.1f} s, "
            f"test accuracy {_percent(r['accuracy'])}"
        )
        say_converted(name, "QAT", r)
    results["config"] = {
        "epochs": epochs,
        "qat_epochs": qat_epochs,
        "seed": seed,
        "quick": quick,
        "backward": None if backward is None else repr(backward),
        "train_examples": int(len(x_train)),
        "test_examples": int(len(x_test)),
        "jax": jax.__version__,
        "backend": jax.default_backend(),
        "total_wall_time_s": time.perf_counter() - start,
    }
    (out / "results.json").write_text(json.dumps(results, indent=2))
    plot(results, out / "accuracy.png")
    return results


def binomial_interval(accuracy: float, n: int) -> float:
    """The half-width of a 95% interval of an accuracy measured on `n` test images (the normal approximation of a
    binomial proportion, `1.96 * sqrt(p (1 - p) / n)`): the noise of the test set."""
    return 1.96 * math.sqrt(max(accuracy * (1 - accuracy), 0.25 / n) / n)


def plot(results: dict, path: pathlib.Path) -> None:
    """Test accuracy per configuration: PTQ and QAT side by side as bars over categorical bit widths, each with the
    test set's 95% interval, the float model as a band of its own interval, and each configuration's converted
    weight size under its name."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    n = results["config"]["test_examples"]
    names = sorted({*results["ptq"], *results["qat"]}, key=lambda name: parse_config(name), reverse=True)
    fig, ax = plt.subplots(figsize=(6.0, 4.2), dpi=120)
    float_accuracy = results["float"]["accuracy"]
    band = 100 * binomial_interval(float_accuracy, n)
    ax.axhspan(100 * float_accuracy - band, 100 * float_accuracy + band, color="0.85", zorder=0)
    ax.axhline(100 * float_accuracy, color="black", linestyle="--", linewidth=1,
               label=f"float32 {100 * float_accuracy:.1f}% ({results['float']['weight_bytes']:,} B)")  # fmt: skip
    width = 0.38
    lows = [100 * float_accuracy - band]
    for offset, kind, color in ((-width / 2, "ptq", "tab:blue"), (width / 2, "qat", "tab:orange")):
        xs = [i + offset for i, name in enumerate(names) if name in results[kind]]
        accuracies = [results[kind][name]["accuracy"] for name in names if name in results[kind]]
        errors = [100 * binomial_interval(a, n) for a in accuracies]
        heights = [100 * a for a in accuracies]
        ax.bar(xs, heights, width, yerr=errors, capsize=3, color=color, label=kind.upper(), zorder=2)
        for x, h, e in zip(xs, heights, errors, strict=True):
            ax.annotate(f"{h:.1f}", (x, h + e), textcoords="offset points", xytext=(0, 2), ha="center", fontsize=7)
        lows += [h - e for h, e in zip(heights, errors, strict=True)]
    sizes = {
        name: next(results[kind][name]["weight_bytes"] for kind in ("qat", "ptq") if name in results[kind])
        for name in names
    }
    ax.set_xticks(range(len(names)), [f"{name}\n{sizes[name]:,} B" for name in names])
    low = min(lows)
    ax.set_ylim(max(0.0, low - 0.1 * (100 - low) - 1), 103)
    ax.set_xlabel("configuration (W: weight bits, A: activation bits) and converted weight size")
    ax.set_ylabel("test accuracy (%)")
    ax.set_title(f"8x8 digits convnet: PTQ and QAT ({n} test images, 95% intervals)", fontsize=10)
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.3), ncol=3, fontsize=7, frameon=False)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def table(results: dict) -> str:
    """The results as a text table: fake-quant and integer (converted) accuracy, weight bytes, file sizes, time."""
    rows = [("float", "float32", results["float"])]
    rows += [("PTQ", name, r) for name, r in results["ptq"].items()]
    rows += [("QAT", name, r) for name, r in results["qat"].items()]
    header = (
        f"{'method':<7}{'bits':<9}{'accuracy':>9}{'int acc.':>9}{'weight B':>10}{'file B':>9}{'int file B':>11}"
        f"{'time':>7}"
    )
    lines = [header, "-" * len(header)]
    for method, bits, r in rows:
        int_acc = f"{100 * r['int_accuracy']:>8.2f}%" if "int_accuracy" in r else f"{'-':>9}"
        int_file = f"{r['int_file_bytes']:>11,}" if "int_file_bytes" in r else f"{'-':>11}"
        lines.append(
            f"{method:<7}{bits:<9}{100 * r['accuracy']:>8.2f}%{int_acc}{r['weight_bytes']:>10,}"
            f"{r['file_bytes']:>9,}{int_file}{r['wall_time_s']:>6.1f}s"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="qat_demo.py", description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--epochs", type=int, default=30, help="float training epochs (QAT runs half as many; default: %(default)s)"
    )
    parser.add_argument(
        "--bits", default=",".join(CONFIGS), help="comma-separated bit widths for PTQ and QAT (default: %(default)s)"
    )
    parser.add_argument(
        "--seed", type=int, default=0, help="the seed of the data split, the initialisation and the batches"
    )
    parser.add_argument(
        "--backward",
        choices=("float", "int8"),
        default="float",
        help="the linear layers' backward in QAT: the float one (default) or QuantizedBackward(8)",
    )
    parser.add_argument(
        "--out",
        type=pathlib.Path,
        default=pathlib.Path("eqx_quant_demo_out"),
        help="the folder for results.json, accuracy.png and the saved models (default: %(default)s)",
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help="a smoke run: 10 steps per training, 128 test images (compilation takes most of its time)",
    )
    args = parser.parse_args(argv)
    configs = tuple(name.strip() for name in args.bits.split(",") if name.strip())
    for name in configs:
        try:
            parse_config(name)
        except ValueError as e:
            parser.error(f"--bits: {e}")
    if not configs:
        parser.error("--bits names no configuration")
    if args.epochs < 1:
        parser.error(f"--epochs must be >= 1, got {args.epochs}")
    results = run(
        epochs=args.epochs,
        qat_epochs=max(1, args.epochs // 2),
        configs=configs,
        seed=args.seed,
        out=args.out,
        quick=args.quick,
        backward=eqx_quant.QuantizedBackward(8) if args.backward == "int8" else None,
    )
    print(table(results))
    print(f"\nwrote {args.out / 'results.json'} and {args.out / 'accuracy.png'}")


if __name__ == "__main__":
    main()
