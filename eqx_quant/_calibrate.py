"""Post-training calibration of a model's activation quantizers: the observers, the jit-compiled statistics step and
the folding of per-batch statistics."""

import functools
from collections.abc import Callable, Iterable
from typing import Any, Literal

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, PRNGKeyArray, PyTree

from ._misc import check_int
from ._quantizers import AbstractQuantizer, DynamicFakeQuant, FakeQuant
from ._scales import (
    absmax_scale,
    check_method,
    finite_or,
    histogram_centres,
    least_error_scale,
    minmax_scale,
    percentile_of_histogram,
    stats,
)
from ._tree import map_nodes, nodes
from .nn._layers import AbstractQuantLayer


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
    return {
        path: {name: _REDUCTIONS[name](v, axis=0) for name, v in record.items()} for path, record in records.items()
    }


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
    check_method(method, percentile, num_candidates)
    if check_int("num_bins", num_bins) < 1:
        raise ValueError(f"`num_bins` must be >= 1, got num_bins={num_bins}.")
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
        if method != "minmax" and not qmin <= 0 <= qmax:
            raise ValueError(
                f"`method`={method!r} fits a symmetric scale with zero point 0, which the input grid [{qmin}, {qmax}] "
                f"of layer {path!r} does not hold; use method='minmax'."
            )
        t = totals[path]
        zero_point = 0
        if method == "absmax":
            scale = absmax_scale(t["absmax"], qmin, qmax)
        elif method == "minmax":
            scale, zp = minmax_scale(t["min"], t["max"], qmin, qmax)
            zero_point = int(zp)
        elif method == "percentile":
            threshold = percentile_of_histogram(np.asarray(counts[path]["hist"]), float(t["absmax"]), percentile)
            scale = absmax_scale(jnp.asarray(threshold, jnp.float32), qmin, qmax)
        else:
            # The histogram is of |x|: its centres stand for magnitudes on the side of the grid that the symmetric
            # scale spans (the negative side of a grid such as [-8, 0]).
            side = 1.0 if qmax > 0 else -1.0
            centres = side * histogram_centres(num_bins, float(t["absmax"]))
            weights = jnp.asarray(counts[path]["hist"], jnp.float32)
            scale = least_error_scale(jnp.asarray(centres), weights, t["absmax"], (0,), qmin, qmax, num_candidates)[0]
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
