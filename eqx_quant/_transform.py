import functools
import re
from collections.abc import Callable, Iterable, Mapping
from typing import Any, Literal, TypeAlias

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, PRNGKeyArray, PyTree

from ._misc import check_int
from ._quantizers import AbstractQuantizer, DynamicFakeQuant, FakeQuant
from ._scales import absmax_scale, finite_or, minmax_scale, stats, symmetric_bound
from ._tree import map_nodes, nodes
from .nn._layers import (
    AbstractQuantLayer,
    QuantConv,
    QuantEmbedding,
    QuantLinear,
    default_input_quant,
    default_weight_quant,
)


Factory: TypeAlias = Callable[[str, eqx.Module], AbstractQuantizer | None]
QuantizerSpec: TypeAlias = AbstractQuantizer | Factory | Mapping[str, "AbstractQuantizer | Factory | None"] | None
Where: TypeAlias = Callable[[str, eqx.Module], bool] | str | None

_FLOAT_LAYERS = (eqx.nn.Linear, eqx.nn.Conv, eqx.nn.Embedding)


def _compiled(name: str, pattern: object) -> re.Pattern:
    """`pattern` compiled, or a `ValueError` naming the argument it came from."""
    if not isinstance(pattern, str):
        raise TypeError(f"The layer patterns of `{name}` must be strings, got {pattern!r}.")
    try:
        return re.compile(pattern)
    except re.error as error:
        raise ValueError(f"`{name}`: {pattern!r} is not a valid regular expression ({error}).") from None


def _check_patterns(name: str, spec: object) -> None:
    if isinstance(spec, Mapping):
        for pattern in spec:
            _compiled(name, pattern)


def _resolve(name: str, spec: object, path: str, layer: eqx.Module) -> AbstractQuantizer | None:
    if spec is None or isinstance(spec, AbstractQuantizer):
        return spec
    if isinstance(spec, Mapping):
        for pattern, value in spec.items():
            if re.search(pattern, path):
                if isinstance(value, Mapping):
                    raise TypeError(f"`{name}` mappings cannot be nested, got {value!r} under {pattern!r}.")
                return _resolve(name, value, path, layer)
        return None
    if callable(spec):
        quantizer = spec(path, layer)
        if quantizer is not None and not isinstance(quantizer, AbstractQuantizer):
            raise TypeError(f"The `{name}` factory returned {quantizer!r} for layer {path!r}, not a quantizer or None.")
        return quantizer
    raise TypeError(f"`{name}` must be a quantizer, a factory, a mapping from patterns to them, or None; got {spec!r}.")


def _selector(where: Where) -> Callable[[str, eqx.Module], bool]:
    if where is None:
        return lambda path, layer: True
    if isinstance(where, str):
        pattern = _compiled("where", where)
        return lambda path, layer: pattern.search(path) is not None
    if callable(where):
        return where
    raise TypeError(f"`where` must be None, a regular expression or a predicate on (path, layer), got {where!r}.")


def quantize(
    model: PyTree,
    *,
    weights: QuantizerSpec = default_weight_quant(),
    activations: QuantizerSpec = default_input_quant(),
    where: Where = None,
    matmul: Literal["int", "float"] = "int",
) -> PyTree:
    """Replaces the layers of a model by their quantized wrappers.

    Every `eqx.nn.Linear`, `eqx.nn.Conv` (any dimensionality) and `eqx.nn.Embedding` in `model` (or only those that
    `where` selects) becomes a [`eqx_quant.nn.QuantLinear`][], [`eqx_quant.nn.QuantConv`][] or
    [`eqx_quant.nn.QuantEmbedding`][] holding the original layer. The model can be any PyTree: nested modules, lists,
    tuples, dicts, `eqx.nn.Sequential`, `eqx.nn.MLP`; every other leaf is kept as it is (shardings included), and
    layers that are already quantized are left alone.

    Layers are named by their path in the PyTree, as a dotted string: `layers.0` for the first layer of an
    `eqx.nn.MLP`, `blocks.1.conv` for `model.blocks[1].conv`, `heads.key` for a dict entry.

    **Patterns.** A layer pattern (a key of a `weights` or `activations` mapping, or a string `where`) is a regular
    expression *searched* anywhere in the path (`re.search`): `r"layers\\.1"` selects `layers.1`, but also
    `layers.10` and `encoder.layers.1.conv`. Anchor it to name one layer: `r"^layers\\.1$"`.

    **Arguments:**

    - `model`: the float model.
    - `weights`: the weight quantizer of each layer. One of: a quantizer module (shared by every layer; quantizers
        hold no per-layer state unless learned); a factory `f(path, layer) -> quantizer | None`; a mapping from
        patterns (regular expressions searched in the path, see above) to either, where the first matching pattern
        wins and an unmatched layer gets `None`; or `None` for float weights. By default 8 bits, one scale per output
        channel.
    - `activations`: the input quantizer of each `Linear` and `Conv`, in the same forms; by default 8 bits per
        tensor. Embeddings take integer indices and never get one.
    - `where`: which layers to quantize: `None` for all, a pattern (a regular expression searched in the path, see
        above), or a predicate `f(path, layer) -> bool`.
    - `matmul`: the `matmul` of every [`eqx_quant.nn.QuantLinear`][] and [`eqx_quant.nn.QuantConv`][]: `"int"` for
        the integer forward where the quantizers allow it, `"float"` for the float product of the fake-quantized
        operands.

    **Returns:**

    The model with the selected layers wrapped.

    **Raises:**

    `ValueError` if `where` selects no layer (the message lists the candidate paths), if a pattern is not a valid
    regular expression, or if the model has no layer to quantize (a model whose layers are all quantized already is
    returned as it is); `TypeError` for a malformed `weights`, `activations` or `where`.

    !!! example

        ```python
        import equinox as eqx
        import jax
        import eqx_quant

        mlp = eqx.nn.MLP(4, 2, 8, 2, key=jax.random.key(0))
        qmlp = eqx_quant.quantize(
            mlp,
            # The first matching pattern wins; anchored, so that "layers.0" cannot match "layers.01" or "a.layers.0".
            weights={r"^layers\\.0$": eqx_quant.DynamicFakeQuant(4, axis=0), "": eqx_quant.DynamicFakeQuant(8, axis=0)},
            where=r"^layers\\.[01]$",
        )
        print([type(layer).__name__ for layer in qmlp.layers])  # ['QuantLinear', 'QuantLinear', 'Linear']
        ```
    """
    if matmul not in ("int", "float"):
        raise ValueError(f"`matmul` must be 'int' or 'float', got matmul={matmul!r}.")
    select = _selector(where)
    _check_patterns("weights", weights)
    _check_patterns("activations", activations)
    layers = nodes(model, _FLOAT_LAYERS + (AbstractQuantLayer,))
    if not layers:
        raise ValueError("`model` contains no eqx.nn.Linear, eqx.nn.Conv or eqx.nn.Embedding layer to quantize.")
    candidates = [(path, layer) for path, layer in layers if isinstance(layer, _FLOAT_LAYERS)]
    if not candidates:
        return model  # every layer is quantized already
    chosen = {path for path, layer in candidates if select(path, layer)}
    if not chosen:
        raise ValueError(
            f"`where`={where!r} matches none of the layers; the candidate paths are: "
            + ", ".join(repr(path) for path, _ in candidates)
            + "."
        )

    def wrap(path: str, layer: Any) -> Any:
        if path not in chosen or isinstance(layer, AbstractQuantLayer):
            return layer
        weight_quant = _resolve("weights", weights, path, layer)
        if isinstance(layer, eqx.nn.Embedding):
            return QuantEmbedding(layer, weight_quant=weight_quant)
        input_quant = _resolve("activations", activations, path, layer)
        wrapper = QuantLinear if isinstance(layer, eqx.nn.Linear) else QuantConv
        return wrapper(layer, weight_quant=weight_quant, input_quant=input_quant, matmul=matmul)

    return map_nodes(model, _FLOAT_LAYERS + (AbstractQuantLayer,), wrap)


def dequantize(model: PyTree) -> PyTree:
    """Replaces every quantized layer by the float layer it wraps: the inverse of [`eqx_quant.quantize`][].

    **Arguments:**

    - `model`: a model containing [`eqx_quant.nn.QuantLinear`][], [`eqx_quant.nn.QuantConv`][] or
        [`eqx_quant.nn.QuantEmbedding`][] layers.

    **Returns:**

    The float model, whose leaves are exactly the wrapped layers' leaves (after training, the trained ones).
    """
    return map_nodes(model, (AbstractQuantLayer,), lambda path, layer: layer.layer)


# ---------------------------------------------------------------------------------------------------------------------
# Post-training calibration.


class _Recording:
    """The statistics that observers report during one traced forward pass, and the per-layer inputs they need."""

    def __init__(self, inputs: dict[str, Array] | None):
        self.inputs = inputs
        self.records: dict[str, Any] = {}


_active: list[_Recording] = []  # the recordings of the calibration traces in progress; empty outside `calibrate`


class _Observer(AbstractQuantizer):
    """Stands in for an input quantizer during calibration: passes `x` through and reports a statistic of it."""

    path: str = eqx.field(static=True)
    statistic: Callable[[Array, Array | None], dict[str, Array]] = eqx.field(static=True)

    def __call__(self, x: Array, *, key: PRNGKeyArray | None = None) -> Array:
        del key
        if not _active:
            raise RuntimeError("A calibration observer was called outside `eqx_quant.calibrate`.")
        recording = _active[-1]
        if self.path in recording.records:
            raise ValueError(
                f"Layer {self.path!r} was called more than once in one forward pass; `calibrate` needs each layer "
                "to be called once per example."
            )
        inputs = None if recording.inputs is None else recording.inputs[self.path]
        recording.records[self.path] = self.statistic(x, inputs)
        return x


def _tensor_stats(x: Array, inputs: None) -> dict[str, Array]:
    del inputs
    absmax, lo, hi = stats(x, tuple(range(jnp.ndim(x))))
    return {"absmax": absmax.reshape(()), "min": lo.reshape(()), "max": hi.reshape(())}


@functools.cache  # one function per bin count, so that calibration steps compile once
def _histogram(num_bins: int) -> Callable[[Array, Array | None], dict[str, Array]]:
    def histogram(x: Array, top: Array | None) -> dict[str, Array]:
        """Counts of the finite |x| in `num_bins` equal bins over `[0, top]` (values above `top` go to the last)."""
        assert top is not None
        x = jnp.abs(jax.lax.stop_gradient(x).astype(jnp.float32)).ravel()
        finite = jnp.isfinite(x)
        width = jnp.maximum(top, jnp.finfo(jnp.float32).tiny) / num_bins
        index = jnp.clip(jnp.floor(finite_or(x, 0.0) / width), 0, num_bins - 1).astype(jnp.int32)
        return {"hist": jnp.zeros(num_bins, jnp.float32).at[index].add(finite.astype(jnp.float32))}

    return histogram


_REDUCTIONS = {"absmax": jnp.max, "max": jnp.max, "min": jnp.min, "hist": jnp.sum}


@eqx.filter_jit
def _calibration_step(observed: PyTree, batch: PyTree, batched: bool, inputs: dict[str, Array] | None) -> dict:
    """Runs the observed model on one batch and returns the per-layer statistics of the batch.

    `inputs` (the histogram range of each layer) is an argument, so that one compilation serves every batch.
    """

    def run(example):
        recording = _Recording(inputs)
        _active.append(recording)
        try:
            observed(example)
        finally:
            _active.pop()
        return recording.records

    if batched:
        return run(batch)
    records = jax.vmap(run)(batch)
    return {path: {name: _REDUCTIONS[name](v, axis=0) for name, v in record.items()} for path, record in records.items()}


def _calibration_targets(model: PyTree) -> list[tuple[str, AbstractQuantLayer]]:
    layers = nodes(model, (AbstractQuantLayer,))
    return [(path, layer) for path, layer in layers if isinstance(layer.input_quant, (DynamicFakeQuant, FakeQuant))]


def _observe(model: PyTree, statistic: Callable[[Array, Array | None], dict[str, Array]]) -> PyTree:
    paths = {path for path, _ in _calibration_targets(model)}

    def swap(path: str, layer: AbstractQuantLayer) -> AbstractQuantLayer:
        if path not in paths:
            return layer
        return eqx.tree_at(lambda l: l.input_quant, layer, _Observer(path, statistic))

    return map_nodes(model, (AbstractQuantLayer,), swap)


def _threshold_from_histogram(
    counts: np.ndarray, top: float, bound: int, method: str, percentile: float, num_candidates: int
) -> float:
    num_bins = counts.size
    edges = np.linspace(0.0, top, num_bins + 1, dtype=np.float64)
    total = counts.sum()
    if total == 0 or top == 0:
        return 0.0
    if method == "percentile":
        cdf = np.cumsum(counts) / total
        return float(edges[1 + min(int(np.searchsorted(cdf, percentile / 100.0)), num_bins - 1)])
    # "mse": the quantization error of the bin centres, weighted by the counts, for each candidate threshold.
    centres = jnp.asarray((edges[:-1] + edges[1:]) / 2, jnp.float32)
    weights = jnp.asarray(counts, jnp.float32)
    thresholds = jnp.arange(1, num_candidates + 1, dtype=jnp.float32) * (top / num_candidates)
    return float(_least_error_threshold(centres, weights, thresholds, bound))


@functools.partial(jax.jit, static_argnums=3)
def _least_error_threshold(centres: Array, weights: Array, thresholds: Array, bound: int) -> Array:
    """The threshold whose absmax scale gives the least count-weighted quantization error of the (non-negative) bin
    centres on a symmetric grid `[-bound, bound]`."""

    def error(threshold):
        scale = absmax_scale(threshold, -bound, bound)
        levels = jnp.clip(jnp.round(centres * (1 / scale)), -bound, bound)
        return jnp.sum(weights * (levels * scale - centres) ** 2)

    return thresholds[jnp.argmin(jax.lax.map(error, thresholds))]


def calibrate(
    model: PyTree,
    batches: Iterable[PyTree],
    *,
    method: Literal["absmax", "minmax", "percentile", "mse"] = "absmax",
    percentile: float = 99.99,
    num_bins: int = 2048,
    num_candidates: int = 100,
    batched: bool = False,
) -> PyTree:
    """Post-training quantization: fixes the activation (input) quantizers of a model from calibration data.

    Every quantized layer whose `input_quant` is a [`eqx_quant.DynamicFakeQuant`][] or a
    [`eqx_quant.FakeQuant`][] gets a static [`eqx_quant.FakeQuant`][] on the same integer grid, with a per-tensor
    scale (and, for `"minmax"`, a zero point) from the statistics of that layer's inputs over all batches. Other
    layers, other quantizers and all weights are unchanged.

    The model runs once per batch (twice for `"percentile"` and `"mse"`) in a jit-compiled step, with its weight
    quantizers active and its input quantizers replaced by observers. Each step returns the statistics of that batch
    as a PyTree (per layer: absolute maximum, minimum and maximum, or a histogram of `|x|` with `num_bins` bins),
    which are folded into running statistics; memory does not grow with the number of batches.

    **Arguments:**

    - `model`: a model from [`eqx_quant.quantize`][]. Each calibrated layer must be called once per example, and
        not inside a `jax.vmap` or `jax.lax.scan` of the model's own (such layers cannot be observed: `ValueError`).
    - `batches`: an iterable of inputs, each with a leading batch axis (a PyTree of arrays is passed to the model as
        it is). `"percentile"` and `"mse"` read it twice, so it must be re-iterable (a list, not a generator).
    - `method`: `"absmax"` (symmetric, `max|x|`), `"minmax"` (asymmetric with an integer zero point),
        `"percentile"` (symmetric, clip at the `percentile`-th percentile of `|x|`, resolved to a histogram bin), or
        `"mse"` (symmetric, the threshold among `num_candidates` fractions of `max|x|` with the least quantization
        error on the histogram).
    - `percentile`, `num_bins`, `num_candidates`: the parameters of those methods.
    - `batched`: `False` (default) for a model written for one example, as Equinox models are: it is applied with
        `jax.vmap`. `True` for a model that takes whole batches.

    **Returns:**

    The calibrated model.

    !!! example

        ```python
        import equinox as eqx
        import jax
        import jax.numpy as jnp
        import eqx_quant

        model = eqx_quant.quantize(eqx.nn.MLP(4, 2, 8, 1, key=jax.random.key(0)))
        data = [jax.random.normal(jax.random.key(i), (16, 4)) for i in range(3)]
        model = eqx_quant.calibrate(model, data)
        print(model.layers[0].input_quant)
        ```
    """
    methods = ("absmax", "minmax", "percentile", "mse")
    if method not in methods:
        raise ValueError(f"`method` must be one of {methods}, got method={method!r}.")
    if not 0 < percentile <= 100:
        raise ValueError(f"`percentile` must be in (0, 100], got percentile={percentile!r}.")
    if check_int("num_bins", num_bins) < 1 or check_int("num_candidates", num_candidates) < 1:
        raise ValueError(f"`num_bins` and `num_candidates` must be >= 1, got {num_bins} and {num_candidates}.")
    targets = _calibration_targets(model)
    if not targets:
        raise ValueError(
            "`model` has no quantized layer whose input quantizer can be calibrated (a DynamicFakeQuant or a "
            "FakeQuant); quantize it first with `eqx_quant.quantize`."
        )
    two_passes = method in ("percentile", "mse")
    if two_passes and iter(batches) is batches:
        raise TypeError(f"`batches` must be re-iterable for method={method!r} (it is read twice), got an iterator.")

    totals = _fold(model, batches, _tensor_stats, batched, None)
    if two_passes:
        tops = {path: totals[path]["absmax"] for path in totals}
        counts = _fold(model, batches, _histogram(num_bins), batched, tops)

    def replace(path: str, layer: AbstractQuantLayer) -> AbstractQuantLayer:
        if path not in totals:
            return layer
        qmin, qmax = layer.input_quant.qmin, layer.input_quant.qmax  # pyright: ignore[reportOptionalMemberAccess]
        bound = symmetric_bound(qmin, qmax)
        t = totals[path]
        zero_point = 0
        if method == "absmax":
            scale = absmax_scale(t["absmax"], qmin, qmax)
        elif method == "minmax":
            scale, zp = minmax_scale(t["min"], t["max"], qmin, qmax)
            zero_point = int(zp)
        else:
            threshold = _threshold_from_histogram(
                np.asarray(counts[path]["hist"]), float(t["absmax"]), bound, method, percentile, num_candidates
            )
            scale = absmax_scale(jnp.asarray(threshold, jnp.float32), qmin, qmax)
        return eqx.tree_at(lambda l: l.input_quant, layer, FakeQuant(float(scale), qmin, qmax, zero_point=zero_point))

    return map_nodes(model, (AbstractQuantLayer,), replace)


def _fold(model, batches, statistic, batched, inputs) -> dict[str, dict[str, Array]]:
    """Runs the calibration step over all batches and folds the per-batch statistics into running ones."""
    observed = _observe(model, statistic)
    totals: dict[str, dict[str, Array]] | None = None
    for batch in batches:
        try:
            step = _calibration_step(observed, batch, batched, inputs)
        except jax.errors.UnexpectedTracerError as e:
            raise ValueError(
                "`calibrate` observes each quantized layer's input in one forward pass per example, and cannot see "
                "layers that the model calls inside its own `jax.vmap` or `jax.lax.scan`. Pass the per-example "
                "model with `batched=False` instead."
            ) from e
        if totals is None:
            totals = step
        else:
            totals = {
                path: {name: _FOLDS[name](totals[path][name], value) for name, value in record.items()}
                for path, record in step.items()
            }
    if totals is None:
        raise ValueError("`batches` is empty: calibration needs at least one batch.")
    return totals


_FOLDS = {"absmax": jnp.maximum, "max": jnp.maximum, "min": jnp.minimum, "hist": jnp.add}
