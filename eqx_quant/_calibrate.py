"""Post-training calibration of a model's activation quantizers: static scales from the statistics of the inputs
each layer sees."""

import warnings
from collections.abc import Iterable
from typing import Literal

import equinox as eqx
import jax.numpy as jnp
import numpy as np
from jaxtyping import PyTree

from ._format import Format, IntFormat
from ._misc import FLOAT32_TINY, caller_stacklevel, check_flags, check_int, keeps_the_mesh
from ._observe import (
    TracedInput,
    check_callable,
    check_called,
    check_not_converted,
    check_not_one_array,
    fold,
    layer_stack,
    traced_inputs,
    with_traced_inputs,
)
from ._quantizers import AbstractQuantizer, DynamicFakeQuant, FakeQuant, LearnedFakeQuant, check_fit_method
from ._scales import (
    absmax_scale,
    check_method,
    histogram_centres,
    histogram_edges,
    least_error_scale,
    minmax_scale,
    percentile_threshold,
)
from ._summary import describe_quantizer
from ._tree import map_nodes, nodes
from .nn._layers import AbstractQuantLayer, per_layer


def _quantized_inputs(model: PyTree) -> list[tuple[str, AbstractQuantLayer | TracedInput]]:
    """The quantized layers and traced weights of `model`, each with its `input_quant`."""
    return nodes(model, (AbstractQuantLayer,)) + traced_inputs(model)


def _calibratable(quantizer: object) -> bool:
    """Whether a static quantizer can replace `quantizer`: a dynamic or static one with float32 scales."""
    return isinstance(quantizer, (DynamicFakeQuant, FakeQuant)) and quantizer.format.scale == "float32"


def _check_finite(totals: dict[str, list[dict[str, np.ndarray]]]) -> None:
    """Raises for a layer that saw no finite input; warns, with counts, for layers that saw NaN or inf."""
    counts = {path: (sum(float(r["nonfinite"]) for r in records),
                     sum(float(r["finite"]) + float(r["nonfinite"]) for r in records))
              for path, records in totals.items()}  # fmt: skip
    empty = [path for path, (bad, count) in counts.items() if bad == count]
    if empty:
        raise ValueError(
            f"The layers at {empty} saw no finite input during calibration (only NaN or inf, or none at all): no "
            "scale can be fitted to them. Check the calibration batches."
        )
    noisy = {path: (int(bad), int(count)) for path, (bad, count) in counts.items() if bad}
    if noisy:
        listed = ", ".join(f"{path!r} {bad:,} of {count:,}" for path, (bad, count) in noisy.items())
        warnings.warn(f"Calibration inputs held NaN or inf values, left out of the statistics: {listed}.",
                      stacklevel=caller_stacklevel())  # fmt: skip


@keeps_the_mesh
def calibrate(
    model: PyTree,
    batches: Iterable[PyTree],
    *,
    method: Literal["absmax", "minmax", "percentile", "mse"] = "absmax",
    percentile: float = 99.99,
    num_bins: int = 2048,
    num_candidates: int = 100,
    batched: bool = False,
    progress: bool = False,
) -> PyTree:
    """Post-training quantization: fixes the activation (input) quantizers of a model from calibration data.

    A layer's (or a traced weight's products', see [`eqx_quant.nn.QuantTraced`][]) calibrated input quantizer is a
    static [`eqx_quant.FakeQuant`][], whose scale is part of the compiled
    program, except in a stack of layers (built with `eqx.filter_vmap` and run with `jax.lax.scan`), where a scan needs
    the scales as arrays, one per layer: there it is a [`eqx_quant.LearnedFakeQuant`][] holding them, which computes
    exactly what the static quantizer would, and which an optimizer trains if the model's arrays are handed to it (see
    Stacked layers below).

    Every quantized layer whose `input_quant` is a [`eqx_quant.DynamicFakeQuant`][] or a
    [`eqx_quant.FakeQuant`][] with float32 scales (an integer grid, or an FP8, FP6 or FP4 element type) gets a
    static [`eqx_quant.FakeQuant`][] of the same format, with a per-tensor scale (and, for `"minmax"`, a zero point)
    from the statistics of that layer's inputs over all batches: inputs beyond the calibrated range then saturate.
    Other layers, other quantizers (the block scales of MX and NVFP4 inputs, which are computed from each block at
    every call) and all weights are unchanged. So are the operand quantizers of [`eqx_quant.nn.QuantEinsum`][]
    (products of two activations, such as attention's): they keep computing their scales at every call. (In a stack
    of blocks run by `jax.lax.scan`, a product holds no array of its own, so it has nowhere to keep one calibrated
    scale per layer.)

    The model runs once per batch (twice for `"percentile"` and `"mse"`) in a jit-compiled step, with its weight
    quantizers active and its input quantizers replaced by observers. The observers send the statistics of what they
    see (absolute maximum, minimum and maximum, or a histogram of `|x|` with `num_bins` bins) to the host as the step
    runs, reduced on the device over any `jax.vmap` around them, so that the host folds one small record per layer
    and batch; memory does not grow with the number of batches. Layers called inside the model's own `jax.vmap`
    (over tokens, say) or `jax.lax.scan` (over a stack of layers) are observed like any other; a layer called
    several times per example gets the statistics of all its inputs. A layer that no batch reaches is an error (its
    input would stay dynamic). JAX takes no reports to the host from a `jax.lax.cond` or `jax.lax.switch` under
    `jax.vmap`: for a model with quantized layers in such branches, the examples of each batch run one after another
    (`jax.lax.map`) instead, each observed in the branch it takes (slower; the same statistics, up to the order of
    their float sums); a model that maps such a branch with a `jax.vmap` of its own (over tokens, or with
    `batched=True`) cannot be observed. The other algorithms that run the model on batches ([`eqx_quant.gptq`][],
    [`eqx_quant.smoothquant`][], ...) do the same.

    **Stacked layers.** A layer built with `eqx.filter_vmap` (weights of shape `(layers, ...)`) and run with
    `jax.lax.scan` gets statistics and a scale per layer of the stack. Static configuration cannot vary along a
    scan, so its calibrated quantizer holds them as arrays: a [`eqx_quant.LearnedFakeQuant`][] per tensor, one
    entry per layer, whose forward pass is exactly that of the [`eqx_quant.FakeQuant`][] with the same scale (and
    which QAT can go on training; leave it out of the optimizer to keep it fixed).

    **Non-finite data.** NaN and infinite inputs are left out of the statistics, with a warning that counts them per
    layer; a layer that sees no finite input at all is an error.

    **Arguments:**

    - `model`: a model from [`eqx_quant.quantize`][].
    - `batches`: an iterable of inputs, each with a leading batch axis (a PyTree of arrays is passed to the model as
        it is). `"percentile"` and `"mse"` read it twice, so it must be re-iterable (a list, not a generator).
    - `method`: `"absmax"` (symmetric, `max|x|`), `"minmax"` (asymmetric with an integer zero point; integer grids
        only),
        `"percentile"` (symmetric, clip at the `percentile`-th percentile of `|x|`, resolved to a histogram bin), or
        `"mse"` (symmetric, the threshold among `num_candidates` fractions of `max|x|` with the least quantization
        error on the histogram).
    - `percentile`, `num_bins`, `num_candidates`: the parameters of those methods.
    - `batched`: `False` (default) for a model written for one example, as Equinox models are: it is applied with
        `jax.vmap`. `True` for a model that takes whole batches.
    - `progress`: show a progress bar over the batches (tqdm's when it is installed).

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
    check_callable(model)
    check_not_converted(model, "calibrate")
    check_flags(batched=batched, progress=progress)
    check_not_one_array(batches)
    check_method(method, percentile, num_candidates)
    if check_int("num_bins", num_bins) < 1:
        raise ValueError(f"`num_bins` must be >= 1, got num_bins={num_bins}.")
    quantized = _quantized_inputs(model)
    targets = [(path, layer) for path, layer in quantized if _calibratable(layer.input_quant)]
    if not targets:
        if quantized:
            found = {path: describe_quantizer(layer.input_quant) for path, layer in quantized[:4]}
            raise ValueError(
                "`model` is quantized, but none of its input quantizers can be calibrated (a DynamicFakeQuant or a "
                f"FakeQuant with float32 scales); its layers' input quantizers: {found}"
                f"{', ...' if len(quantized) > 4 else ''}. With inputs in float (weight-only layers), or in a block "
                "format whose scales come from each block as the model runs (MX, NVFP4, GGML), calibration has "
                "nothing to fit: skip it."
            )
        raise ValueError(
            "`model` has no quantized layer whose input quantizer can be calibrated (a DynamicFakeQuant or a "
            "FakeQuant with float32 scales); quantize it first with `eqx_quant.quantize`."
        )
    for path, layer in targets:
        try:
            check_fit_method(layer.input_quant.format, method)  # pyright: ignore[reportOptionalMemberAccess]
        except ValueError as error:
            raise ValueError(f"Layer {path!r}: {error}") from None
    two_passes = method in ("percentile", "mse")
    if two_passes and iter(batches) is batches:
        raise TypeError(f"`batches` must be re-iterable for method={method!r} (it is read twice), got an iterator.")

    totals = fold(model, targets, batches, batched, "stats", progress=progress)
    check_called(targets, totals, where=False)
    _check_finite(totals)
    if two_passes:
        observed = [(path, layer) for path, layer in targets if path in totals]
        tops = {
            path: jnp.asarray([record["absmax"] for record in totals[path]], jnp.float32).reshape(layer_stack(layer))
            for path, layer in observed
        }
        counts = fold(model, observed, batches, batched, "hist", tops, num_bins, progress, "calibrate (histograms)")

    def fit(t: dict[str, np.ndarray], hist: np.ndarray | None, fmt: Format) -> tuple[float, int]:
        """The scale and zero point of one layer from its statistics."""
        if method == "absmax":
            return float(absmax_scale(jnp.asarray(t["absmax"]), fmt)), 0
        if method == "minmax":
            assert isinstance(fmt, IntFormat)
            scale, zero_point = minmax_scale(jnp.asarray(t["min"]), jnp.asarray(t["max"]), fmt)
            return float(scale), int(zero_point)
        assert hist is not None
        if method == "percentile":
            threshold = percentile_threshold(histogram_edges(hist.size, float(t["absmax"])), hist, percentile)
            return float(absmax_scale(jnp.asarray(threshold, jnp.float32), fmt)), 0
        # The histogram is of |x|: its centres stand for magnitudes on the side of the grid that the symmetric
        # scale spans (the negative side of a grid such as [-8, 0]).
        side = -1.0 if isinstance(fmt, IntFormat) and fmt.qmax <= 0 else 1.0
        centres = jnp.asarray(side * histogram_centres(num_bins, float(t["absmax"])))
        weights = jnp.asarray(hist, jnp.float32)
        absmax = jnp.asarray(t["absmax"], jnp.float32).reshape(1)
        return float(least_error_scale(centres, weights, absmax, (0,), fmt, num_candidates)[0]), 0

    def calibrated(path: str, layer: AbstractQuantLayer | TracedInput) -> AbstractQuantizer:
        fmt = layer.input_quant.format  # pyright: ignore[reportOptionalMemberAccess]
        if method != "minmax" and isinstance(fmt, IntFormat) and not fmt.qmin <= 0 <= fmt.qmax:
            raise ValueError(
                f"`method`={method!r} fits a symmetric scale with zero point 0, which the input grid [{fmt.qmin}, "
                f"{fmt.qmax}] of layer {path!r} does not hold; use method='minmax'."
            )
        fits = [fit(t, counts[path][i]["hist"] if two_passes else None, fmt) for i, t in enumerate(totals[path])]
        stack = layer_stack(layer)
        if not stack:
            quantizer = FakeQuant(fits[0][0], format=fmt, zero_point=fits[0][1])
        else:
            # Static configuration cannot vary along a scan: one array entry per layer of the stack instead.
            scales = jnp.asarray([scale for scale, _ in fits], jnp.float32).reshape(stack)
            zero_points = None
            if method == "minmax":
                zero_points = jnp.asarray([zp for _, zp in fits], jnp.float32).reshape(stack)
            make = lambda s, z: LearnedFakeQuant(s, format=fmt, zero_point=z, min_scale=FLOAT32_TINY)  # noqa: E731
            quantizer = per_layer(make, len(stack))(scales, zero_points)
        return quantizer

    def replace(path: str, layer: AbstractQuantLayer) -> AbstractQuantLayer:
        if path not in totals:
            return layer
        return eqx.tree_at(lambda l: l.input_quant, layer, calibrated(path, layer))

    model = map_nodes(model, (AbstractQuantLayer,), replace)
    return with_traced_inputs(model, lambda p, t: calibrated(p, t) if p in totals else t.input_quant)
