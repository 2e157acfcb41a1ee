"""Post-training calibration of a model's activation quantizers: the observers, the jit-compiled statistics step and
the folding of per-batch statistics."""

import functools
import math
import threading
from collections.abc import Callable, Iterable
from typing import Any, Literal

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import io_callback
from jaxtyping import Array, PRNGKeyArray, PyTree

from ._misc import FLOAT32_TINY, check_int
from ._quantizers import AbstractQuantizer, DynamicFakeQuant, FakeQuant, LearnedFakeQuant
from ._scales import (
    absmax_scale,
    check_method,
    finite_or,
    histogram_centres,
    histogram_edges,
    least_error_scale,
    minmax_scale,
    percentile_threshold,
    stats,
)
from ._tree import map_nodes, nodes
from .nn._layers import AbstractQuantLayer, per_layer, stack_depth


class _Recording:
    """The statistics that observers report while the calibration step runs: by layer path, by position in the
    layer's stack (0 for a layer that is not stacked), folded over every call."""

    def __init__(self):
        self.totals: dict[str, dict[int, dict[str, np.ndarray]]] = {}
        self.lock = threading.Lock()

    def add(self, path: str, index: Any, record: dict[str, Any]) -> None:
        with self.lock:
            layers = self.totals.setdefault(path, {})
            index = int(index)
            if index in layers:
                old = layers[index]
                layers[index] = {name: np.asarray(_HOST_FOLDS[name](old[name], v)) for name, v in record.items()}
            else:
                layers[index] = {name: np.asarray(v) for name, v in record.items()}


_active: list[_Recording] = []  # the recording of the calibration step in progress; empty outside of one
_HOST_FOLDS = {"absmax": np.maximum, "max": np.maximum, "min": np.minimum, "hist": np.add, "gram": np.add}
_REDUCTIONS = {"absmax": jnp.max, "max": jnp.max, "min": jnp.min, "hist": jnp.sum, "gram": jnp.sum}


def _report(path: str, index: Any, record: dict[str, Any]) -> None:
    if not _active:
        raise RuntimeError("A calibration observer ran outside `eqx_quant.calibrate`.")
    _active[-1].add(path, index, record)


@functools.cache
def _tap_for(path: str) -> Callable[[Array, dict[str, Array]], Array]:
    """`_tap` for one layer: a function of arrays only, as `custom_vmap` needs."""

    @jax.custom_batching.custom_vmap
    def tap(index: Array, record: dict[str, Array]) -> Array:
        if "vector" in record:  # one input vector: its outer product
            record = {"gram": jnp.outer(record["vector"], record["vector"])}
        io_callback(functools.partial(_report, path), None, index, record, ordered=False)
        return index

    @tap.def_vmap
    def tap_batched(axis_size: int, in_batched: list, index: Array, record: dict[str, Array]):
        index_batched, record_batched = in_batched
        if not index_batched:  # one layer: reduce over the mapped axis, then report once
            if "vector" in record and record_batched["vector"]:
                # The sum of the outer products of a batch of vectors, without materialising each of them.
                v = record["vector"]
                record = {"gram": jnp.einsum("bi,bj->ij", v, v, precision=jax.lax.Precision.HIGHEST)}
            else:
                record = {
                    name: _REDUCTIONS[name](v, axis=0) if record_batched[name] else v for name, v in record.items()
                }
            return tap(index, record), False
        # Several layers along the mapped axis (a model that maps a stack of layers with `vmap`): one at a time.
        record = {
            name: v if record_batched[name] else jnp.broadcast_to(v, (axis_size,) + v.shape)
            for name, v in record.items()
        }
        return jax.lax.map(lambda args: tap(*args), (index, record)), True

    return tap


def _tensor_stats(x: Array, top: Array | None, num_bins: int) -> dict[str, Array]:
    del top, num_bins
    absmax, lo, hi = stats(x, tuple(range(jnp.ndim(x))))
    return {"absmax": absmax.reshape(()), "min": lo.reshape(()), "max": hi.reshape(())}


def _histogram(x: Array, top: Array | None, num_bins: int) -> dict[str, Array]:
    """Counts of the finite |x| in `num_bins` equal bins over `[0, top]` (values above `top` go to the last)."""
    assert top is not None
    x = jnp.abs(jax.lax.stop_gradient(x).astype(jnp.float32)).ravel()
    finite = jnp.isfinite(x)
    width = jnp.maximum(top, FLOAT32_TINY) / num_bins
    index = jnp.clip(jnp.floor(finite_or(x, 0.0) / width), 0, num_bins - 1).astype(jnp.int32)
    return {"hist": jnp.zeros(num_bins, jnp.float32).at[index].add(finite.astype(jnp.float32))}


def _gram(x: Array, top: Array | None, num_bins: int) -> dict[str, Array]:
    """The input vector (finite entries; others as 0), in float32, whose outer products `x xᵀ` the tap sums: the
    Hessian of GPTQ."""
    del top, num_bins
    return {"vector": finite_or(jax.lax.stop_gradient(x).astype(jnp.float32).ravel(), 0.0)}


_STATISTICS = {"stats": _tensor_stats, "hist": _histogram, "gram": _gram}


class _Observer(AbstractQuantizer):
    """Stands in for an input quantizer during calibration: passes `x` through and reports a statistic of it.

    `index` is the layer's position in its stack and `top` the histogram range of that layer: arrays with the stack's
    shape, so that a `jax.lax.scan` over stacked layers hands each step its own.
    """

    index: Array
    top: Array | None
    path: str = eqx.field(static=True)
    statistic: str = eqx.field(static=True)
    num_bins: int = eqx.field(static=True)

    def __call__(self, x: Array, *, key: PRNGKeyArray | None = None) -> Array:
        del key
        if self.index.ndim:
            raise ValueError(
                f"The stacked layer {self.path!r} was called on the whole stack at once; `calibrate` observes stacked "
                "layers called one layer at a time (inside `jax.lax.scan`, or a `jax.vmap` over the layers)."
            )
        record = _STATISTICS[self.statistic](x, self.top, self.num_bins)
        _tap_for(self.path)(self.index, record)
        return x


@eqx.filter_jit
def _calibration_step(observed: PyTree, batch: PyTree, batched: bool) -> PyTree:
    """Runs the observed model on one batch; the observers report to the host as it runs."""
    return observed(batch) if batched else jax.vmap(observed)(batch)


def _calibration_targets(model: PyTree) -> list[tuple[str, AbstractQuantLayer]]:
    layers = nodes(model, (AbstractQuantLayer,))
    return [(path, layer) for path, layer in layers if isinstance(layer.input_quant, (DynamicFakeQuant, FakeQuant))]


def layer_stack(layer: AbstractQuantLayer) -> tuple[int, ...]:
    """The shape of the stack a quantized layer belongs to: `()` for a single layer, `(layers,)` for layers built
    with `eqx.filter_vmap`."""
    weight = layer.layer.weight  # pyright: ignore[reportAttributeAccessIssue]
    if not eqx.is_array(weight):  # the placeholder of an `eqx.nn.Shared` tie: a single layer
        return ()
    return tuple(weight.shape[: stack_depth(layer.layer, weight.shape)])


def observe(
    model: PyTree, targets: list[tuple[str, AbstractQuantLayer]], statistic: str, tops=None, num_bins: int = 0
) -> PyTree:
    """`model` with the input quantizer of each target layer replaced by an observer of `statistic`."""
    chosen = dict(targets)

    def swap(path: str, layer: AbstractQuantLayer) -> AbstractQuantLayer:
        if path not in chosen:
            return layer
        stack = layer_stack(layer)
        index = jnp.arange(math.prod(stack), dtype=jnp.int32).reshape(stack)
        top = None if tops is None else jnp.asarray(tops[path], jnp.float32).reshape(stack)
        observer = _Observer(index, top, path, statistic, num_bins)
        return eqx.tree_at(lambda l: l.input_quant, layer, observer, is_leaf=lambda x: x is None)

    return map_nodes(model, (AbstractQuantLayer,), swap)


def fold(model, targets, batches, batched, statistic, tops=None, num_bins=0) -> dict[str, list[dict[str, Any]]]:
    """Runs the observed model over all batches: per target layer, the statistics folded over every call, one
    record per layer of its stack (in stack order, flattened)."""
    observed = observe(model, targets, statistic, tops, num_bins)
    recording = _Recording()
    seen = False
    for batch in batches:
        seen = True
        _active.append(recording)
        try:
            jax.block_until_ready(_calibration_step(observed, batch, batched))
            jax.effects_barrier()
        finally:
            _active.pop()
    if not seen:
        raise ValueError("`batches` is empty: calibration needs at least one batch.")
    results = {}
    for path, layer in targets:
        size = math.prod(layer_stack(layer))
        layers = recording.totals.get(path, {})
        if not layers:
            continue  # never called
        missing = [i for i in range(size) if i not in layers]
        if missing:
            raise ValueError(f"Layers {missing} of the stacked layer {path!r} were never called during calibration.")
        results[path] = [layers[i] for i in range(size)]
    return results


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
    quantizers active and its input quantizers replaced by observers. The observers send the statistics of what they
    see (absolute maximum, minimum and maximum, or a histogram of `|x|` with `num_bins` bins) to the host as the step
    runs, reduced on the device over any `jax.vmap` around them, so that the host folds one small record per layer
    and batch; memory does not grow with the number of batches. Layers called inside the model's own `jax.vmap`
    (over tokens, say) or `jax.lax.scan` (over a stack of layers) are observed like any other; a layer called
    several times per example gets the statistics of all its inputs.

    **Stacked layers.** A layer built with `eqx.filter_vmap` (weights of shape `(layers, ...)`) and run with
    `jax.lax.scan` gets statistics and a scale per layer of the stack. Static configuration cannot vary along a
    scan, so its calibrated quantizer holds them as arrays: a [`eqx_quant.LearnedFakeQuant`][] per tensor, one
    entry per layer, whose forward pass is exactly that of the [`eqx_quant.FakeQuant`][] with the same scale (and
    which QAT can go on training; leave it out of the optimizer to keep it fixed).

    **Arguments:**

    - `model`: a model from [`eqx_quant.quantize`][].
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

    totals = fold(model, targets, batches, batched, "stats")
    if two_passes:
        tops = {path: np.array([record["absmax"] for record in records]) for path, records in totals.items()}
        observed = [(path, layer) for path, layer in targets if path in totals]
        counts = fold(model, observed, batches, batched, "hist", tops, num_bins)

    def fit(t: dict[str, np.ndarray], hist: np.ndarray | None, qmin: int, qmax: int) -> tuple[float, int]:
        """The scale and zero point of one layer from its statistics."""
        if method == "absmax":
            return float(absmax_scale(jnp.asarray(t["absmax"]), qmin, qmax)), 0
        if method == "minmax":
            scale, zero_point = minmax_scale(jnp.asarray(t["min"]), jnp.asarray(t["max"]), qmin, qmax)
            return float(scale), int(zero_point)
        assert hist is not None
        if method == "percentile":
            threshold = percentile_threshold(histogram_edges(hist.size, float(t["absmax"])), hist, percentile)
            return float(absmax_scale(jnp.asarray(threshold, jnp.float32), qmin, qmax)), 0
        # The histogram is of |x|: its centres stand for magnitudes on the side of the grid that the symmetric
        # scale spans (the negative side of a grid such as [-8, 0]).
        side = 1.0 if qmax > 0 else -1.0
        centres = jnp.asarray(side * histogram_centres(num_bins, float(t["absmax"])))
        weights = jnp.asarray(hist, jnp.float32)
        absmax = jnp.asarray(t["absmax"], jnp.float32).reshape(1)
        return float(least_error_scale(centres, weights, absmax, (0,), qmin, qmax, num_candidates)[0]), 0

    def replace(path: str, layer: AbstractQuantLayer) -> AbstractQuantLayer:
        if path not in totals:
            return layer
        qmin, qmax = layer.input_quant.qmin, layer.input_quant.qmax  # pyright: ignore[reportOptionalMemberAccess]
        if method != "minmax" and not qmin <= 0 <= qmax:
            raise ValueError(
                f"`method`={method!r} fits a symmetric scale with zero point 0, which the input grid [{qmin}, {qmax}] "
                f"of layer {path!r} does not hold; use method='minmax'."
            )
        fits = [fit(t, counts[path][i]["hist"] if two_passes else None, qmin, qmax) for i, t in enumerate(totals[path])]
        stack = layer_stack(layer)
        if not stack:
            quantizer = FakeQuant(fits[0][0], qmin, qmax, zero_point=fits[0][1])
        else:
            # Static configuration cannot vary along a scan: one array entry per layer of the stack instead.
            scales = jnp.asarray([scale for scale, _ in fits], jnp.float32).reshape(stack)
            zero_points = None
            if method == "minmax":
                zero_points = jnp.asarray([zp for _, zp in fits], jnp.float32).reshape(stack)
            make = lambda s, z: LearnedFakeQuant(s, qmin, qmax, zero_point=z, min_scale=FLOAT32_TINY)  # noqa: E731
            quantizer = per_layer(make, len(stack))(scales, zero_points)
        return eqx.tree_at(lambda l: l.input_quant, layer, quantizer)

    return map_nodes(model, (AbstractQuantLayer,), replace)
