"""Equivalent transforms of linear layers before quantization: SmoothQuant's and AWQ's per-channel scaling, and
randomized Hadamard rotations. Each gives a layer an input transform `T` and the weight `W T⁻¹`, which compute the
same float function and quantize better."""

import functools
import math
import numbers
import warnings
from collections.abc import Callable, Iterable
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, PyTree

from ._fold import Fold, find_folds, scale_leaves
from ._misc import (
    FLOAT32_TINY,
    as_where,
    caller_stacklevel,
    check_flags,
    check_int,
    check_real,
    keeps_the_mesh,
    lookup,
)
from ._observe import (
    check_callable,
    check_called,
    check_convolutions,
    check_not_converted,
    checked,
    fold as fold_statistics,
    layer_stack,
    progress_bar,
    warns_of_calibration_data,
)
from ._quantizers import AbstractQuantizer, DynamicFakeQuant, LearnedFakeQuant
from ._scales import absmax_scale, finite_or
from ._traced import QuantTraced
from ._traced_layers import TracedLayer, put_traced, traced_layers
from ._tree import map_nodes, nodes, path_string
from .nn._layers import QuantLinear
from .nn._transforms import AbstractInputTransform, RotateInput, ScaleInput, absorbed, hadamard_order


# `f(path, layer)`, and `f(name, weight)` for a traced weight; or a regular expression that chosen paths match whole
Where = Callable[[str, Any], bool] | str | None


def _check_fold(fold: object) -> None:
    if isinstance(fold, bool) or (isinstance(fold, str) and fold == "only"):
        return
    error = ValueError if isinstance(fold, str) else TypeError
    raise error(f"`fold` must be True, False or 'only', got fold={fold!r}.")


def _only_folded(targets: list, groups: list[Fold], what: str) -> list:
    """The targets whose factors fold (`fold="only"`), or a `ValueError` if none does."""
    folded = {path for g in groups for path in g.layers}
    kept = [(path, layer) for path, layer in targets if path in folded]
    if not kept:
        raise ValueError(
            f"None of the chosen layers {[path for path, _ in targets]} has factors that fold into a preceding "
            f"normalisation or linear layer (see `fold`; traced weights never fold): `{what}(..., fold='only')` "
            "would change nothing. `fold=True` gives such layers a multiplier of their own."
        )
    return kept


def _left_text(left: dict[str, str]) -> str:
    """The traced weights left out, grouped by why: `'a', 'b': each {why}; 'c' {why}`."""
    names: dict[str, list[str]] = {}
    for name, why in left.items():
        names.setdefault(why, []).append(repr(name))
    return "; ".join(f"{group[0]} {why}" if len(group) == 1 else f"{', '.join(group)}: each {why}"
                     for why, group in names.items())  # fmt: skip


def _warn_left_alone(left: dict[str, str], what: str) -> None:
    """Warns of the traced weights that `what` would have chosen by default but leaves as they are, with why."""
    if left:
        reasons = _left_text(left)
        # The caller of `what`: past this, `_targets`, `what` and (but for `rotate`) its `warns_of_calibration_data`.
        warnings.warn(f"`{what}` leaves traced weights as they are: {reasons}. Choose the weights with `where` to "
                      "silence this.", stacklevel=caller_stacklevel())  # fmt: skip


def _targets(
    model: PyTree,
    where: Where,
    default: Callable[[AbstractQuantizer | None, AbstractQuantizer | None], bool],
    what: str,
    wanted: str,
    batch: PyTree | None = None,
    batched: bool = False,
    traced_too: bool = True,
    which: str = "the first batch",
) -> tuple[list[tuple[str, QuantLinear]], list[tuple[str, QuantLinear]], dict[str, TracedLayer]]:
    """The `QuantLinear` layers the algorithm `what` transforms, and the traced weights (of `quantize(...,
    example=)`) as layers (see `traced_layers`, which traces the model on `batch`) with where they lie: those `where`
    selects, else those whose quantizers `default(weight_quant, input_quant)` keeps (`wanted` says which, in the
    errors); each checked. Layers inside an `eqx.nn.Shared` are left out by default and refused when `where` selects
    them: a tie would carry one side's transformed weight to the other, untransformed, side. Traced weights that
    cannot be transformed are left out with a warning by default, and refused when `where` selects them; none is
    chosen unless `traced_too`."""
    traced, where_of, left = [], {}, {}
    if traced_too:
        traced, where_of, left = traced_layers(model, where, default, what, wanted, batch, batched, which)
    shared = {path for path, _ in nodes(model, (eqx.nn.Shared,))}
    tied = lambda path: any(path == s or path.startswith(f"{s}.") for s in shared)  # noqa: E731
    chosen = nodes(model, (QuantLinear,))
    layer_default = lambda l: default(l.weight_quant, l.input_quant)  # noqa: E731
    if where is None:
        chosen = [(p, l) for p, l in chosen if layer_default(l) and not tied(p)]
    else:
        chosen = [(p, l) for p, l in chosen if where(p, l)]
    check_convolutions(model, where, what, layer_default)
    if not chosen and not traced:
        selection = "that `where` selects" if where is not None else wanted
        unusable = f" Traced weights left out: {_left_text(left)}." if left else ""
        if not traced_too and nodes(model, (QuantTraced,)):
            unusable += " Traced weights never fold: `fold='only'` leaves them as they are."
        raise ValueError(
            f"`model` has no eqx_quant.nn.QuantLinear {selection}, nor a traced weight (of `quantize(..., "
            f"example=)`) that it can transform: `{what}` would change nothing.{unusable}"
        )
    _warn_left_alone(left, what)
    for path, layer in chosen:
        name = path or "(the model itself)"
        if tied(path):
            raise ValueError(
                f"Layer {name!r} is inside an `eqx.nn.Shared`: `{what}` cannot transform a layer whose weight a tie "
                "may share with another. Exclude it with `where`."
            )
        if not layer_default(layer):
            raise ValueError(f"Layer {name!r} is not a layer {wanted}, so `{what}` would do nothing for it. "
                             "Exclude it with `where`.")  # fmt: skip
        _check_layer(path, layer, what)
    return chosen, traced, where_of


def _check_layer(path: str, layer: QuantLinear, what: str) -> None:
    """Raises, naming the layer, unless `what` can give `layer` an input transform: a single array weight, no
    transform yet, and quantizers that will see the transformed operands (dynamic ones, not fitted yet)."""
    name = path or "(the model itself)"
    if layer.layer.in_features == "scalar":
        raise ValueError(
            f"Layer {name!r} takes a scalar input, which `{what}` cannot transform. Exclude it with `where`."
        )
    if layer.input_transform is not None:
        raise ValueError(
            f"Layer {name!r} already has the input transform {type(layer.input_transform).__name__}; a layer holds "
            f"one. Exclude it from `{what}` with `where`."
        )
    for kind, quantizer, before in (
        ("weight", layer.weight_quant, "`gptq`, `learn_scales` or `quantize(..., learned=True)`"),
        ("input", layer.input_quant, "`calibrate` or `quantize(..., learned=True)`"),
    ):
        if quantizer is not None and not isinstance(quantizer, DynamicFakeQuant):
            raise ValueError(
                f"Layer {name!r} has the {kind} quantizer {quantizer!r}, whose scales were fitted to the operand "
                f"as it is; `{what}` changes that operand. Run `{what}` on the model from `quantize`, before "
                f"{before}."
            )


def _stacked(records: list[dict[str, np.ndarray]], name: str, stack: tuple[int, ...]) -> np.ndarray:
    array = np.stack([record[name] for record in records])
    return array.reshape(stack + array.shape[1:])


def _statistics(model, targets, batches, batched, statistic, progress, what) -> dict[str, list]:
    found = fold_statistics(model, targets, batches, batched, statistic, progress=progress, description=what)
    check_called(targets, found)
    return found


def _with_transform(layer: QuantLinear, transform: AbstractInputTransform, weight: Array) -> QuantLinear:
    weight = weight.astype(layer.layer.weight.dtype)
    return eqx.tree_at(
        lambda l: (l.layer.weight, l.input_transform), layer, (weight, transform), is_leaf=lambda x: x is None
    )


def _replace(model: PyTree, done: dict[str, QuantLinear], where_of: dict[str, TracedLayer]) -> PyTree:
    """`model` with the layers of `done` in place, those named in `where_of` put back as traced weights."""
    traced = {name: layer for name, layer in done.items() if name in where_of}
    model = put_traced(model, where_of, traced) if traced else model
    return map_nodes(model, (QuantLinear,), lambda path, layer: done.get(path, layer))


@keeps_the_mesh
@warns_of_calibration_data("smoothquant")
def smoothquant(
    model: PyTree,
    batches: Iterable[PyTree],
    *,
    alpha: float | Iterable[float] = 0.5,
    fold: bool | str = True,
    batched: bool = False,
    where: Where = None,
    progress: bool = False,
) -> PyTree:
    r"""SmoothQuant (Xiao et al., ICML 2023): moves the quantization difficulty of outlier input channels from the
    activations to the weights.

    For each chosen [`eqx_quant.nn.QuantLinear`][], with `X_j` the layer's inputs in channel `j` over the calibration
    data and `W_j` its weight's column `j`,

    $$s_j = \frac{\max |X_j|^{\alpha}}{\max |W_j|^{1 - \alpha}},$$

    (`s_j = 1` where either maximum is 0), the layer's input is multiplied by `1 / s` (an
    [`eqx_quant.nn.ScaleInput`][] applied before its input quantizer) and its weight's columns by `s`. The float
    function is unchanged up to rounding; the input's channels are evened out, at the weight's expense.

    **Searching `α` per layer.** Given several values of `alpha`, each layer (and each layer of a stack) takes the
    one whose quantized layer is closest to the float layer on the calibration data: the least `Σ ‖Q_w(W s) Q_x(x /
    s) - W x‖²` over the layer's inputs `x`, with the layer's weight quantizer on the smoothed weight and its input
    quantizer on the smoothed input, calibrated as [`eqx_quant.calibrate`][] calibrates it by default (one static
    scale per tensor, the largest smoothed magnitude over the data; block-scaled inputs stay dynamic). That is a
    second pass over `batches`, evaluating every candidate at once (memory: a quantized copy of each layer's weight
    per candidate); each layer is measured on the inputs of the unsmoothed model before it, and ties go to the
    first candidate given. SmoothQuant's paper searches one `α` for the whole model on its end task; here each
    layer's own output is the measure, whose least error need not be the model's: compare the result with a single
    `α` on held-out data (the [PTQ guide](../how-to/ptq.md) has measurements).

    **Where `1 / s` goes.** With `fold=True` (the default), it is folded into what makes the layer's input, where
    the model allows it, so that the layer computes as a plain layer (which the exporters take):

    - *A normalisation's output* `a * γ` or `a * γ + β` (`γ`, `β` arrays of the model with one entry per channel, per
        layer of a stack: `eqx.nn.LayerNorm`, `eqx.nn.RMSNorm`, or a model's own normalisation written that way),
        or that output pooled over other axes than the channels (a sum, maximum or minimum over the tokens, a
        division by a constant as in `jnp.mean`, a token's row: a classifier's head), that nothing but the chosen
        layers reads: `1 / s` is folded into `γ` and `β`. The layers reading it (the query, key and value
        projections after one norm, say) share one `s`, from the largest magnitudes of all their weights' columns.
    - *A preceding linear layer's output*, seen through operations that commute with a positive factor per channel:
        ReLU (also leaky, or as a clip or a selection against 0), absolute values, a gate by a sign or by a
        comparison with 0, a product with another value (a gated MLP's `up` projection before `down`), the
        attention's mixing of the tokens (the value projection before the output projection, through the reshapes
        into heads and back), transposes and casts. The preceding layer's weight rows and bias are multiplied by
        `1 / s` (whether or not `where` chooses it): all of them, or where the layer reads one part of its channels
        (split, sliced or indexed off: the values of a fused query-key-value projection), the rows of that part
        alone. Where the layer's input repeats a channel (grouped-query attention's values repeated over the query
        heads), the copies share one factor, from their largest input and weight magnitudes. Its quantization is
        unchanged up to rounding, which needs each of its weight's scales to cover part of one row: no weight
        quantizer, or a dynamic one with float32 scales per row or per group along the rows (not one scale per
        tensor, nor the power-of-two or float16 scales of MX or GGML formats). Nothing else may read those channels
        of the preceding layer's output or what those operations make of them (a residual sum, GELU; the other parts
        may be read in any way), nor the layer's weight or bias (its `.weight` in a tied head,
        `jax.tree_util.tree_leaves` of it); the model calls it and the layers once, and in a stack one layer at a
        time (a scan stepping through their weights, not a `jax.vmap` over them, under which an operation could mix
        the layers' outputs).

    Both are found by tracing the model on the first batch, and only where it is sure: every call of each of those
    layers reads that value (with the layer's input channels on its last axis), in the same program (not across a
    `jax.jit` or `jax.checkpoint` around the layers alone, nor in a program called at two places, nor in a `while`
    loop), nothing else reads `γ`, `β` or the value, and in a scanned stack the scan steps through `γ` and `β` (or
    the preceding layer's weight) with the layers' weights. A layer reached from two such sources (the product of
    two layers' outputs) folds into neither. Every other layer computes `x * (1 / s)` on its input (an
    [`eqx_quant.nn.ScaleInput`][], with its own `s` from its own weight). Either way the fake-quant and converted
    models agree bit for bit. Run it on the model from [`eqx_quant.quantize`][], before [`eqx_quant.calibrate`][]
    and [`eqx_quant.gptq`][], whose scales and Hessians then see the smoothed operands.

    **Layers whose weight the model reads.** A layer whose weight or bias the model reads besides calling it (its
    `.weight` in a tied head, `jax.tree_util.tree_leaves` of it; found on the model's program) would compute that
    read with the transformed weight on an untransformed input: it is left as it is, with a warning, unless `where`
    chooses it, which is a `ValueError`.

    **Traced weights** (of [`eqx_quant.quantize`][] with `example=`: products the model writes with its own arrays)
    are smoothed as layers are: each weight's products are one layer, its channels the axes they sum over (flattened
    in the order of the weight's `pairings`; for a scanned stack, per layer), the multiplier held by the
    [`eqx_quant.nn.QuantTraced`][] (its `input_transforms`) and applied to each product's input before the input
    quantizer, the weight scaled along those axes. They never fold (`fold="only"` leaves them as they are). A traced
    weight is left as it is, with a warning by default and a `ValueError` where `where` chooses it, if the model
    reads it otherwise than as the weight of `dot_general`s summing over those axes whole, or not at all (a tied
    embedding's gather, a scan's carry; found on the first batch), if its products do not pair its summed axes one
    to one with their input's (a convolution), if its quantizers are not dynamic or its weight quantizer's scales
    are not per tensor (per layer of a stack), per index of its other axes or in tiles along its one summed axis, if
    it has an input transform already, or if it is stored as codes (converted).

    **Non-finite data.** NaN and infinite calibration inputs count as zeros in the channels' maxima, with a
    warning that counts them per layer.

    **Arguments:**

    - `model`: a model from [`eqx_quant.quantize`][], with dynamic quantizers on the chosen layers.
    - `batches`: an iterable of calibration inputs with a leading batch axis, as for [`eqx_quant.calibrate`][] (read
        into a list first: the model is traced on the first batch).
    - `alpha`: the migration strength in `[0, 1]`: 0 leaves the input as it is up to the weight's scale, 1 divides
        every input channel by its maximum. A sequence of such values is searched per layer (above; a group of
        layers folded into one normalisation searches one value, on the sum of its layers' errors).
    - `fold`: `True` folds `1 / s` into preceding normalisations and linear layers where the model allows it
        (above) and gives every other layer its own multiplier; `"only"` smooths only the layers whose factors
        fold and leaves the others as they are (as SmoothQuant's paper smooths only the layers after a
        normalisation), so that every layer stays plain and the model exports; `False` gives every layer its own
        multiplier.
    - `batched`, `progress`: as for [`eqx_quant.calibrate`][].
    - `where`: a predicate `f(path, layer)` choosing the layers (and `f(name, weight)` the traced weights, named
        `model.<path>` with the leaf array), a regular expression choosing the paths it matches whole, or `None` for
        every `QuantLinear` with an input quantizer (outside any `eqx.nn.Shared`, whose tie would carry the
        transformed weight to its other side) and every traced weight with one.

    **Returns:**

    The model with smoothed layers.

    **Raises:**

    `ValueError`, naming the layer, if no layer or traced weight is chosen, a chosen layer has no input quantizer, is
    inside an `eqx.nn.Shared`, already has an input transform or holds a fitted quantizer (static, learned: the
    order above), or is never called on the batches, or a chosen traced weight cannot be smoothed (above), or with
    `fold="only"` if no chosen layer's factors fold, or if the model reads the weight of every layer it would choose
    besides calling it (above), or if `batches` is empty; `ValueError` for an
    `alpha` outside `[0, 1]` or an empty sequence of them; `TypeError` for an `alpha` that is not a real number or a
    sequence of them; `TypeError` or `ValueError` for a `fold` other than `True`, `False` or `"only"`.

    **Warns:**

    `UserWarning` naming the layers it leaves as they are because the model reads their weights, and one naming the
    traced weights it leaves as they are, with why (above). A `UserWarning` counting, per layer, the calibration
    inputs that are NaN or infinite.
    """
    check_callable(model)
    check_not_converted(model, "smoothquant")
    where = as_where(where)
    alphas = _check_alphas(alpha)
    check_flags(batched=batched, progress=progress)
    _check_fold(fold)
    batches = checked(batches)  # traced on its first batch, and read twice to search `alpha`
    targets, traced, where_of = _targets(model, where, lambda w, x: x is not None, "smoothquant",
                                         "with an input quantizer", batches[0], batched, fold != "only")  # fmt: skip
    groups, read = _fold_groups(model, dict(targets), batches[0], batched, fold) if targets else ([], frozenset())
    targets, groups = _leave_read_out(targets, groups, read, where, "smoothquant", bool(traced))
    if fold == "only":
        targets = _only_folded(targets, groups, "smoothquant")
    targets += traced
    layers = dict(targets)
    found = _statistics(model, targets, batches, batched, "channels", progress, "smoothquant")
    group_of = {path: g.layers for g in groups for path in g.layers}
    # The units that share one factor: a folded group (its layers share their input), or a layer alone.
    unit_of = {path: group_of.get(path, (path,)) for path, _ in targets}
    units = list(dict.fromkeys(unit_of.values()))
    rows = {g.layers: g.rows for g in groups}
    x_maxes = {path: _stacked(found[path], "channel_absmax", layer_stack(layer)) for path, layer in targets}
    factors = {}
    for unit in units:
        x_max = np.max([x_maxes[p] for p in unit], axis=0).astype(np.float64)
        w_max = np.max([np.max(np.abs(np.asarray(layers[p].layer.weight, np.float64)), axis=-2) for p in unit], 0)
        x_max, w_max = (_tied(m, rows.get(unit), np.maximum) for m in (x_max, w_max))
        factors[unit] = [smoothquant_factors(x_max, w_max, a) for a in alphas]
    chosen = {unit: options[0] for unit, options in factors.items()}
    if len(alphas) > 1:
        data = {path: _candidates(layer, factors[unit_of[path]], x_maxes[path]) for path, layer in targets}
        errors = fold_statistics(
            model, targets, batches, batched, _smoothing_errors, data, 0, progress, "smoothquant (alpha)"
        )
        check_called(targets, errors)
        for unit in units:
            stack = layer_stack(layers[unit[0]])
            best = np.argmin(sum(_stacked(errors[p], "errors", stack) for p in unit), axis=-1)  # the first of ties
            options = np.stack(factors[unit], axis=len(stack))  # (*stack, candidates, n)
            chosen[unit] = np.take_along_axis(options, best[..., None, None], axis=len(stack))[..., 0, :]
    multipliers = {unit: jnp.asarray(1 / factor, jnp.float32) for unit, factor in chosen.items()}
    weights = {path: ScaleInput(multipliers[unit_of[path]]).absorb(layer.layer.weight) for path, layer in targets}
    return _place(model, targets, groups, unit_of, multipliers, weights, where_of)


def _place(
    model: PyTree,
    targets: list[tuple[str, QuantLinear]],
    groups: list[Fold],
    unit_of: dict[str, tuple[str, ...]],
    multipliers: dict[tuple[str, ...], Array | None],
    weights: dict[str, Array],
    where_of: dict[str, TracedLayer],
) -> PyTree:
    """`model` with each target's new weight (which has absorbed the multiplier of its unit), and the multiplier
    folded into what makes the input of the units of `groups` (a normalisation's `γ` and `β`, or a preceding
    layer's rows and bias), or else held by the layer as its `ScaleInput` (none where the multiplier is `None`).
    The targets at `where_of` are traced weights as layers, put back into their traced model."""
    folded = {path for g in groups for path in g.layers}
    done = {}
    for path, layer in targets:
        if path in folded or multipliers[unit_of[path]] is None:
            done[path] = eqx.tree_at(lambda l: l.layer.weight, layer, weights[path].astype(layer.layer.weight.dtype))
        else:
            done[path] = _with_transform(layer, ScaleInput(multipliers[unit_of[path]]), weights[path])
    everything = dict(nodes(model, (QuantLinear,)))
    leaf_factors = {}
    for g in groups:
        multiplier = multipliers[g.layers]
        leaf_factors.update({p: multiplier for p in (g.gamma, g.beta) if p is not None})
        if g.producer is not None:
            done[g.producer] = _scale_rows(done.get(g.producer, everything[g.producer]), multiplier, g.rows)
    return scale_leaves(_replace(model, done, where_of), leaf_factors)


def _fold_groups(
    model: PyTree, layers: dict[str, QuantLinear], batch: PyTree, batched: bool, fold: bool | str
) -> tuple[list[Fold], frozenset[str]]:
    """The groups of `layers` whose factors fold into a preceding normalisation's `γ` (and `β`), or into the rows
    of a preceding linear layer (none unless `fold`): those of `find_folds` whose layers share their stack and input
    size, with `γ` of one entry per channel per layer, or a producer of that stack and output size whose weight's
    rows keep their own scales (`_rows_scale_alone`); and the layers whose weights the model reads besides calling
    them."""
    leaves = jax.tree_util.tree_flatten_with_path(model)[0]
    shapes = {path_string(p): leaf.shape for p, leaf in leaves if eqx.is_array(leaf)}
    shared = [path for path, _ in nodes(model, (eqx.nn.Shared,))]
    everything = dict(nodes(model, (QuantLinear,)))
    producers = [
        path for path, layer in everything.items()
        if fold and not any(path == s or path.startswith(f"{s}.") for s in shared) and _rows_scale_alone(layer)
    ]  # fmt: skip
    found = find_folds(model, list(layers), batch, batched, producers)
    if not fold:  # traced for the reads alone
        return [], found.read_elsewhere
    groups = []
    for g in found.folds:
        stacks = {layer_stack(layers[p]) + (layers[p].layer.in_features,) for p in g.layers}
        if len(stacks) != 1:
            continue
        (stack,) = stacks
        if g.producer is not None:
            producer = everything[g.producer]
            size = producer.layer.out_features if g.rows is None else len(g.rows)
            if layer_stack(producer) + (size,) == stack:
                groups.append(g)
        elif all(shapes.get(p) == stack for p in (g.gamma, g.beta) if p is not None):
            groups.append(g)
    return groups, found.read_elsewhere


def _leave_read_out(targets: list, groups: list[Fold], read: frozenset[str], where: Where, what: str,
                    others: bool = False):  # fmt: skip
    """The targets and groups without the layers whose weights the model reads besides calling them (a tied head's
    `layer.weight`), which a transform would leave computing with the transformed weight on the untransformed
    input: left out with a warning where `where` is None, else a `ValueError` (also where no target is left and
    there are no `others`, traced weights, to transform)."""
    chosen = [path for path, _ in targets if path in read]
    if not chosen:
        return targets, groups
    why = (f"the model reads the weights of {chosen} besides calling them (their `.weight` in a tied head, say), "
           f"which would then compute with the weight that `{what}` transforms, on an untransformed input")  # fmt: skip
    if where is not None:
        raise ValueError(f"Cannot transform the layers that `where` chooses: {why}. Exclude them with `where`.")
    targets = [(path, layer) for path, layer in targets if path not in read]
    if not targets and not others:
        raise ValueError(f"`{what}` would change nothing: {why}.")
    warnings.warn(f"`{what}` leaves layers as they are: {why}. Choose the layers with `where` to silence this.",
                  stacklevel=caller_stacklevel())  # fmt: skip
    return targets, [g for g in groups if not set(g.layers) & read]


def _tied(values: np.ndarray, rows: tuple[int, ...] | None, pool: np.ufunc) -> np.ndarray:
    """`values` (per input channel of a layer, on the last axis) made equal over the channels that are copies of one
    channel of the layer whose rows take the factors (`rows` with repeats: grouped-query attention's values
    repeated over the query heads), which must share one factor: their maximum (`pool=np.maximum`) or their mean
    (`np.add`)."""
    if rows is None or len(set(rows)) == len(rows):
        return values
    _, copy_of, counts = np.unique(np.asarray(rows), return_inverse=True, return_counts=True)
    moved = np.moveaxis(np.asarray(values, np.float64), -1, 0)
    pooled = np.full((len(counts), *moved.shape[1:]), -np.inf if pool is np.maximum else 0.0)
    pool.at(pooled, copy_of, moved)
    if pool is np.add:
        pooled /= counts.reshape((-1,) + (1,) * (moved.ndim - 1))
    return np.moveaxis(pooled[copy_of], 0, -1)


def _rows_scale_alone(layer: QuantLinear) -> bool:
    """Whether dividing the rows of `layer`'s weight (and its bias) by positive factors leaves its quantization as
    it is up to rounding: no weight quantizer, or a dynamic one whose float32 scales each cover part of one row."""
    q, inner = layer.weight_quant, layer.layer
    if inner.out_features == "scalar" or inner.in_features == "scalar":
        return False
    if q is None:
        return True
    if not isinstance(q, DynamicFakeQuant) or q.format.scale != "float32":
        return False
    shape = tuple(inner.weight.shape)[len(layer_stack(layer)) :]  # a stacked layer's quantizer sees one layer
    row, tile = len(shape) - 2, q.layout.tile_axis(shape)
    return tile != row if tile is not None else row in q.layout.channel_axes(shape)


def _scale_rows(layer: QuantLinear, multiplier: Array, rows: tuple[int, ...] | None = None) -> QuantLinear:
    """`layer` computing its output times `multiplier` (`1 / s`, per layer of a stack: one entry per output channel,
    or per channel of `rows`, the others left as they are): its weight's rows and its bias multiplied by it, in their
    dtypes."""
    inner = layer.layer
    if rows is not None:
        ones = jnp.ones((*multiplier.shape[:-1], inner.out_features), multiplier.dtype)
        multiplier = ones.at[..., np.asarray(rows)].set(multiplier)
    weight = (inner.weight * multiplier[..., :, None].astype(inner.weight.dtype)).astype(inner.weight.dtype)
    if inner.bias is None:
        return eqx.tree_at(lambda l: l.layer.weight, layer, weight)
    bias = (inner.bias * multiplier.astype(inner.bias.dtype)).astype(inner.bias.dtype)
    return eqx.tree_at(lambda l: (l.layer.weight, l.layer.bias), layer, (weight, bias))


def _check_alphas(alpha: object) -> tuple[float, ...]:
    """`alpha` (a real number, or an iterable of them: a list, a tuple, a 1-D array) as a tuple of floats in
    `[0, 1]`, or a clear error."""

    def scalar(value: object) -> object:  # a 0-d array as the number it holds
        return value.item() if isinstance(value, (np.ndarray, jax.Array)) and value.ndim == 0 else value

    if isinstance(alpha, (str, bytes, numbers.Real)) or scalar(alpha) is not alpha:
        alphas = (check_real("alpha", scalar(alpha)),)
    else:
        try:
            values = list(alpha)  # pyright: ignore[reportArgumentType]
        except TypeError:
            raise TypeError(
                f"`alpha` must be a real number or a sequence of them, got {alpha!r} of type {type(alpha).__name__}."
            ) from None
        if not values:
            raise ValueError(f"`alpha` must be a value or a non-empty sequence of values, got alpha={alpha!r}.")
        alphas = tuple(check_real("alpha", scalar(a)) for a in values)
    for a in alphas:
        if not 0 <= a <= 1:
            raise ValueError(f"`alpha` must be in [0, 1], got alpha={alpha!r}.")
    return alphas


class _Candidates(eqx.Module):
    """What the observer of a layer needs to measure SmoothQuant's candidates (arrays with the layer's stack shape in
    front): the float weight, each candidate's input multiplier `1 / s` and quantized smoothed weight, and its static
    input scale (or `None`: the layer's dynamic input quantizer, kept as it is)."""

    weight: Array  # (*stack, out, n)
    multipliers: Array  # (*stack, candidates, n)
    weights: Array  # (*stack, candidates, out, n)
    input_scales: Array | None  # (*stack, candidates)
    input_quant: AbstractQuantizer


def _candidates(layer: QuantLinear, factors: list[np.ndarray], x_max: np.ndarray) -> _Candidates:
    stack = layer_stack(layer)
    weight_quant, input_quant = layer.weight_quant, layer.input_quant
    assert input_quant is not None
    quantize_weight = (lambda w: w) if weight_quant is None else weight_quant
    for _ in stack:
        quantize_weight = jax.vmap(quantize_weight)
    multipliers, weights, scales = [], [], []
    fmt = input_quant.format  # pyright: ignore[reportAttributeAccessIssue]
    for s in factors:
        transform = ScaleInput(jnp.asarray(1 / s, jnp.float32))
        multipliers.append(transform.multiplier)
        weights.append(quantize_weight(transform.absorb(layer.layer.weight)).astype(jnp.float32))
        # The largest smoothed magnitude is that of the channels' largest, `x * m` rounding monotonically.
        scales.append(absmax_scale(jnp.max(jnp.asarray(x_max, jnp.float32) * transform.multiplier, axis=-1), fmt))
    axis = len(stack)
    return _Candidates(
        jnp.asarray(layer.layer.weight, jnp.float32),
        jnp.stack(multipliers, axis),
        jnp.stack(weights, axis),
        jnp.stack(scales, axis) if fmt.scale == "float32" else None,
        input_quant,
    )


def _smoothing_errors(x: Array, data: _Candidates, num_bins: int) -> dict[str, Array]:
    """The observer's statistic for `smoothquant`'s search: per candidate, `‖Q_w(W s) Q_x(x / s) - W x‖²` of one
    input vector (non-finite entries as 0)."""
    del num_bins
    x = finite_or(jax.lax.stop_gradient(x).astype(jnp.float32), 0.0)
    highest = jax.lax.Precision.HIGHEST
    reference = jnp.matmul(data.weight, x, precision=highest)
    fmt = data.input_quant.format  # pyright: ignore[reportAttributeAccessIssue]

    def error(multiplier, weight, scale):
        quantize = data.input_quant
        if scale is not None:
            quantize = LearnedFakeQuant(scale, format=fmt, min_scale=FLOAT32_TINY)
        d = jnp.matmul(weight, quantize(ScaleInput(multiplier)(x)), precision=highest) - reference
        return jnp.sum(d * d)

    return {"errors": jax.vmap(error)(data.multipliers, data.weights, data.input_scales)}


def smoothquant_factors(x_max: np.ndarray, w_max: np.ndarray, alpha: float) -> np.ndarray:
    """SmoothQuant's `s = x_max**alpha / w_max**(1 - alpha)` in float64, 1 where either maximum is 0."""
    with np.errstate(divide="ignore", invalid="ignore"):
        s = x_max**alpha / w_max ** (1 - alpha)
    return np.where((x_max > 0) & (w_max > 0) & np.isfinite(s) & (s > 0), s, 1.0)


def _awq_group(path: str, layer: QuantLinear) -> int | None:
    """The group of columns that share a weight scale in `layer` (AWQ's clipping searches one limit per row and
    group): `None` for one scale per tensor, the group size, or the row's length for per-row scales."""
    q = layer.weight_quant
    layout = q.layout  # pyright: ignore[reportOptionalMemberAccess]
    n = layer.layer.in_features
    if layout.is_per_tensor():
        return None
    if layout.axes in ((0,), (-2,)) and layout.group_size is None:
        return n  # pyright: ignore[reportReturnType]
    if layout.axes == () and layout.group_size is not None and layout.group_axis in (-1, 1):
        return layout.group_size
    raise ValueError(
        f"Layer {path!r} has weight quantizer {q!r}; `awq` needs one scale per tensor, per output row (axis=0) or "
        "per group of input columns (group_size). Exclude the layer with `where`."
    )


@eqx.filter_jit
def _awq_scales(quantizers: list, weights: list[Array], gram: Array, x_mean: Array, grid: int) -> Array:
    """AWQ's search of `s = x_mean**alpha` (normalised) over `alpha = i / grid`: the multiplier `1 / s` (float32)
    whose quantized layers (`weights`, each with its quantizer, all reading inputs of Gram matrix `gram`) make the
    least output error `Σ tr(D G Dᵀ)`, `D` a layer's effective weight minus its weight."""
    weights = [w.astype(jnp.float32) for w in weights]

    def error(alpha):
        multiplier = awq_multiplier(x_mean, alpha)[None, :]
        errors = []
        for quantizer, weight in zip(quantizers, weights, strict=True):
            d = quantizer(weight / multiplier) * multiplier - weight
            errors.append(jnp.sum(jnp.matmul(d, gram, precision=jax.lax.Precision.HIGHEST) * d))
        return functools.reduce(jnp.add, errors), multiplier

    errors, multipliers = jax.lax.map(error, jnp.arange(grid, dtype=jnp.float32) / grid)
    return multipliers[jnp.argmin(errors), 0]


def awq_multiplier(x_mean: Array, alpha: Array) -> Array:
    """`1 / s` for AWQ's `s = max(x_mean, 1e-4)**alpha / sqrt(max(s) * min(s))`, in float32."""
    s = jnp.maximum(x_mean, 1e-4) ** alpha
    s = s / jnp.sqrt(jnp.max(s) * jnp.min(s))
    return (1 / s).astype(jnp.float32)


@eqx.filter_jit
def _awq_clip(quantizer, weight: Array, gram: Array, multiplier: Array, group: int | None, ratios: Array) -> Array:
    """AWQ's clipping search on the scaled weight `weight` (computing on `multiplier * x`): per row and group of
    `group` columns (or for the whole tensor when `group` is None), the limit `ratio * max|w|` whose clipped and
    quantized weight makes the least error on the group's share of the output. Returns the clipped weight."""
    out, n = weight.shape
    g = n if group is None else group
    blocks = jnp.stack([gram[i : i + g, i : i + g] for i in range(0, n, g)])  # (groups, g, g)
    rows = weight.reshape(out, n // g, g)
    top = jnp.max(jnp.abs(rows), axis=-1, keepdims=True) if group is not None else jnp.max(jnp.abs(weight))

    def error(ratio):
        limit = top * ratio
        clipped = jnp.clip(rows, -limit, limit).reshape(out, n)
        d = ((quantizer(clipped) - weight) * multiplier[None, :]).reshape(out, n // g, g)
        moved = jnp.einsum("ogi,gij->ogj", d, blocks, precision=jax.lax.Precision.HIGHEST)
        return jnp.sum(moved * d, axis=-1)  # (out, groups)

    errors = jax.lax.map(error, ratios)  # (ratios, out, groups)
    if group is None:
        best = ratios[jnp.argmin(jnp.sum(errors, axis=(1, 2)))]
    else:
        best = lookup(ratios, jnp.argmin(errors, axis=0))[..., None]
    limit = top * best
    clipped = jnp.clip(rows, -limit, limit).reshape(out, n)
    if quantizer.format.scale != "e4m3":  # each group's rounding depends on that group alone
        return clipped

    def total(w):  # the whole layer's error: NVFP4's tensor scale, from the whole weight, ties the groups together
        d = (quantizer(w) - weight) * multiplier[None, :]
        return jnp.sum(jnp.matmul(d, gram, precision=jax.lax.Precision.HIGHEST) * d)

    return jnp.where(total(clipped) <= total(weight), clipped, weight)


@keeps_the_mesh
@warns_of_calibration_data("awq")
def awq(
    model: PyTree,
    batches: Iterable[PyTree],
    *,
    grid: int = 20,
    clip: bool = True,
    clip_grid: int = 20,
    max_shrink: float = 0.5,
    fold: bool | str = False,
    batched: bool = False,
    where: Where = None,
    progress: bool = False,
) -> PyTree:
    r"""Activation-aware weight quantization (AWQ; Lin et al., MLSys 2024): per-input-channel scaling of the weight
    searched on calibration data, then a search of each weight group's clipping range.

    For each chosen [`eqx_quant.nn.QuantLinear`][], with `x̄_j` the mean `|x_j|` of the layer's inputs in channel `j`
    and `G = Σ x xᵀ` their Gram matrix over the calibration data:

    - **scaling**: for `α = 0, 1/grid, ..., (grid-1)/grid`, `s = x̄^α` (each `x̄_j` at least `1e-4`), divided by
        `sqrt(max s * min s)`; the layer would compute `Q(W diag(s)) (x / s)`, whose output error over the data is
        `tr(D G Dᵀ)` with `D = Q(W diag(s)) diag(1/s) - W`. The `α` of least error wins (`α = 0` is plain
        round-to-nearest, so the error never grows). The layer then holds an [`eqx_quant.nn.ScaleInput`][] of
        `1 / s` (unless it is folded, below) and the weight `W diag(s)`.
    - **clipping** (`clip=True`): for each output row and group of columns sharing a weight scale (the whole row
        for per-row scales; the whole tensor for one scale), the limit `r * max|w|`,
        `r = 1, 1 - 1/clip_grid, ...` down to `1 - max_shrink` (excluded), that makes the least error on that group's
        share of the output, `d_g G_gg d_gᵀ`; the weight is clipped to it, so that the weight quantizer, which fits
        its scales to the weight when it runs, uses the clipped range. On NVFP4, whose tensor scale (from the whole
        weight) ties the groups together, the clipped weight is kept only if the whole layer's error is no larger.

    **Folding** (`fold=True`): where [`eqx_quant.smoothquant`][] would fold a layer's factors into a preceding
    normalisation or linear layer (see there), `1 / s` is folded the same way, and the layer holds no
    `ScaleInput`: it computes as a plain layer, which the exporters take. The layers that read one normalisation's
    output (a query, key and value projection) then share one `s`, searched on the sum of their errors, as AWQ's
    paper searches them; layers that read different views of one layer's output (`b(relu(h))` and `c(h)`) keep
    factors of their own; the copies of a repeated channel (grouped-query attention's values) share one factor,
    searched on their mean input magnitude. Off by default: each layer's own search can only do as well or better
    on its own error, at the cost of one product per input and of a layer the exporters refuse.

    The weight quantizer is applied as the layer applies it, so the search works for every weight format and
    layout: integer grids, FP4/FP6/FP8 with float32 scales, MX and NVFP4. The error it measures is the weight's:
    input quantizers are not part of it (AWQ is made for weight-only quantization; with quantized inputs, the
    smoothing of the inputs by `1 / s` also changes their rounding). Run it on the model from
    [`eqx_quant.quantize`][], before [`eqx_quant.calibrate`][] and [`eqx_quant.gptq`][] (AWQ then GPTQ combine).

    **Layers whose weight the model reads** besides calling them are left as they are, as
    [`eqx_quant.smoothquant`][] leaves them.

    **Traced weights** (of `quantize(..., example=)`) are scaled and clipped as layers are, as
    [`eqx_quant.smoothquant`][] smooths them (see there): a weight per index of its other axes is a row, tiles
    along its one summed axis are groups; the multiplier is held by the `QuantTraced`.

    **Non-finite data.** NaN and infinite calibration inputs are left out of the channels' means and count as
    zeros in the Gram matrices, with a warning that counts them per layer.

    **Arguments:**

    - `model`: a model from [`eqx_quant.quantize`][], with dynamic quantizers on the chosen layers.
    - `batches`: an iterable of calibration inputs with a leading batch axis, as for [`eqx_quant.calibrate`][]
        (read into a list first: it is passed over twice).
    - `grid`: the number of `α` tried.
    - `clip`: whether to search the clipping range too.
    - `clip_grid`, `max_shrink`: the clipping ratios tried, `1 - i / clip_grid` for `i < max_shrink * clip_grid`.
    - `fold`: `True` folds `1 / s` into preceding normalisations and linear layers where the model allows it
        (above; the first batch is traced to find them) and gives every other layer its own multiplier; `"only"`
        scales only the layers whose factors fold and gives the others the clipping search alone, with no
        multiplier, so that every layer stays plain and the model exports; `False` gives every layer its own
        multiplier.
    - `batched`, `progress`: as for [`eqx_quant.calibrate`][].
    - `where`: a predicate `f(path, layer)` choosing the layers (and `f(name, weight)` the traced weights), a
        regular expression choosing the paths it matches whole, or `None` for every `QuantLinear` with a weight
        quantizer (outside any `eqx.nn.Shared`, whose tie would carry the transformed weight to its other side) and
        every traced weight with one.

    **Returns:**

    The model with scaled (and clipped) weights.

    **Raises:**

    `ValueError`, naming the layer, if no layer or traced weight is chosen, a chosen traced weight cannot be
    transformed (as for [`eqx_quant.smoothquant`][]), `batches` is empty, a chosen layer has no weight quantizer or
    is inside an `eqx.nn.Shared`, already has an input transform, holds a fitted quantizer (run `awq` before `gptq`,
    `calibrate`, `learn_scales`), has a weight layout other than per
    tensor, per row or per group of columns, or is never called on the batches, or with `fold="only"` and
    `clip=False` if no chosen layer's factors fold, or if the model reads the weight of every layer it would choose
    besides calling it; `ValueError` or `TypeError` for `grid` (at least 2),
    `clip_grid` or `max_shrink` out of range (with `clip=True`, at least two ratios), or a `fold` other than
    `True`, `False` or `"only"`.

    **Warns:**

    `UserWarning` naming the layers it leaves as they are because the model reads their weights, and one naming the
    traced weights it leaves as they are, with why (as [`eqx_quant.smoothquant`][] does). A `UserWarning` counting,
    per layer, the calibration inputs that are NaN or infinite.
    """
    check_callable(model)
    check_not_converted(model, "awq")
    where = as_where(where)
    grid, clip_grid = check_int("grid", grid), check_int("clip_grid", clip_grid)
    if grid < 2:  # one `α`, 0, is round to nearest
        raise ValueError(f"`grid` must be at least 2, got grid={grid}.")
    max_shrink = check_real("max_shrink", max_shrink)
    if not 0 <= max_shrink < 1:
        raise ValueError(f"`max_shrink` must be in [0, 1), got max_shrink={max_shrink}.")
    check_flags(clip=clip, batched=batched, progress=progress)
    _check_fold(fold)
    shrinks = math.ceil(max_shrink * clip_grid - 1e-9)
    if clip and (clip_grid < 1 or shrinks < 2):  # only the ratio 1: no clipping
        raise ValueError(
            f"`clip=True` needs at least two clipping ratios, `1 - i / clip_grid` for `i < max_shrink * clip_grid`; "
            f"got clip_grid={clip_grid}, max_shrink={max_shrink}."
        )
    batches = checked(batches)  # read twice: the channels' means, then the Gram matrices
    targets, traced, where_of = _targets(model, where, lambda w, x: w is not None, "awq", "with a weight quantizer",
                                         batches[0], batched, fold != "only" or clip)  # fmt: skip
    column_groups = {path: _awq_group(path, layer) for path, layer in targets + traced}
    folds, read = _fold_groups(model, dict(targets), batches[0], batched, fold) if targets else ([], frozenset())
    targets, folds = _leave_read_out(targets, folds, read, where, "awq", bool(traced))
    targets += traced
    means = _statistics(model, targets, batches, batched, "channels", progress, "awq (statistics)")
    grams = _statistics(model, targets, batches, batched, "gram", progress, "awq (Gram matrices)")
    ratios = jnp.asarray(1 - np.arange(max(shrinks, 1)) / max(clip_grid, 1), jnp.float32)
    layers = dict(targets)

    # Per layer, over the calibration data (with the stack's axes in front): the sum of `|x|` per channel, the
    # count of those, and the Gram matrix.
    stats = {
        path: tuple(_stacked(found, name, layer_stack(layer)) for found, name in
                    ((means[path], "channel_abssum"), (means[path], "count"), (grams[path], "gram")))
        for path, layer in targets
    }  # fmt: skip

    def one_input(group: Fold) -> bool:  # the layers read one value (after a norm), not two views of a layer's output
        first = stats[group.layers[0]]
        return all(all(map(np.array_equal, first, stats[p])) for p in group.layers[1:])

    folds = [g for g in folds if one_input(g)]  # the others' layers keep factors of their own
    fold_rows = {g.layers: g.rows for g in folds}
    if fold == "only" and not clip:  # the layers that do not fold would not change
        targets = _only_folded(targets, folds, "awq")
    unit_of = {path: (path,) for path, _ in targets} | {path: g.layers for g in folds for path in g.layers}
    folded = {g.layers for g in folds}
    multipliers, weights = {}, {}
    for unit in progress_bar(list(dict.fromkeys(unit_of.values())), progress, "awq (layers)"):
        scaled_too = fold != "only" or unit in folded  # else the clipping alone, with no multiplier
        # The layers of a unit read one value (`one_input`): the first one's statistics are all of theirs.
        stack, n = layer_stack(layers[unit[0]]), layers[unit[0]].layer.in_features
        abssum, count, gram = stats[unit[0]]
        x_mean = _tied((abssum / np.maximum(count, 1)).reshape(-1, n), fold_rows.get(unit), np.add)
        gram = gram.reshape(-1, n, n)
        flat = {p: layers[p].layer.weight.reshape((-1,) + layers[p].layer.weight.shape[-2:]) for p in unit}
        quantizers = [layers[p].weight_quant for p in unit]
        found, scaled = [], {p: [] for p in unit}
        for i in range(gram.shape[0]):
            g_i, m_i = jnp.asarray(gram[i], jnp.float32), jnp.asarray(x_mean[i], jnp.float32)
            multiplier = jnp.ones((n,), jnp.float32)
            if scaled_too:
                multiplier = _awq_scales(quantizers, [flat[p][i] for p in unit], g_i, m_i, grid)
            for p in unit:
                w = (flat[p][i] / multiplier[None, :]).astype(jnp.float32)
                if clip:
                    w = _awq_clip(layers[p].weight_quant, w, g_i, multiplier, column_groups[p], ratios)
                scaled[p].append(w)
            found.append(multiplier)
        multipliers[unit] = jnp.stack(found).reshape(stack + (n,)) if scaled_too else None
        weights.update({p: jnp.stack(scaled[p]).reshape(layers[p].layer.weight.shape) for p in unit})
    return _place(model, targets, folds, unit_of, multipliers, weights, where_of)


@keeps_the_mesh
def rotate(
    model: PyTree, *, key: Array, where: Where = None, batch: PyTree | None = None, batched: bool = False
) -> PyTree:
    r"""Randomized Hadamard rotations of linear layers' inputs (as in QuaRot, Ashkboos et al., NeurIPS 2024): outliers
    spread over all channels before rounding.

    Each chosen [`eqx_quant.nn.QuantLinear`][] with `n` input features gets an [`eqx_quant.nn.RotateInput`][]
    `R = H D / sqrt(n)` (`H` a Hadamard matrix, `D` random signs drawn from `key`, one draw per layer and per layer
    of a stack) and the rotated weight `W Rᵀ`, so that `(W Rᵀ)(R x) = W x`: the float function is unchanged up to
    rounding, while both operands of the product are spread by `R`. The input is rotated online, when the layer
    runs, by a fast Walsh-Hadamard transform (`O(n log n)`), in the fake-quant and converted models alike. `n` must
    be a power of two, or `m * 2**k` with `m - 1` a prime `≡ 3 (mod 4)` and `m <= 256` (12, 20, 24, 40, 44, 48, 60, 68,
    72, ...).

    Run it on the model from [`eqx_quant.quantize`][], before [`eqx_quant.calibrate`][] and [`eqx_quant.gptq`][]
    (rotation then GPTQ combine). It needs no data, so it does not trace the model for its layers: a layer whose
    weight the model reads besides calling it (its `.weight` in a tied head) would compute that read with the
    rotated weight on an unrotated input. Leave such a layer out with `where` ([`eqx_quant.smoothquant`][] and
    [`eqx_quant.awq`][] find and leave them out).

    **Traced weights** (of `quantize(..., example=)`) are rotated over the axes their products sum over, flattened
    (as [`eqx_quant.smoothquant`][] smooths them; their size must be one `rotate` can rotate), the rotation held by
    the `QuantTraced`. With `batch` (one calibration batch), the model is traced on it to find the traced weights it
    reads besides their products, which are left out as `smoothquant` leaves them; without it, only the traced
    weights `where` chooses are rotated, and a call that reads one otherwise is a `ValueError`.

    **Arguments:**

    - `model`: a model from [`eqx_quant.quantize`][], with dynamic quantizers on the chosen layers.
    - `key`: a JAX PRNG key (`jax.random.key(0)`) for the signs.
    - `where`: a predicate `f(path, layer)` choosing the layers (and `f(name, weight)` the traced weights), a
        regular expression choosing the paths it matches whole, or `None` for every `QuantLinear` with a quantizer
        (outside any `eqx.nn.Shared`, whose tie would carry the transformed weight to its other side) and, given
        `batch`, every traced weight with one.
    - `batch`, `batched`: one calibration batch, as an element of [`eqx_quant.calibrate`][]'s `batches` with its
        `batched`, on which the model is traced to choose its traced weights (above); `None` for none.

    **Returns:**

    The model with rotated layers.

    **Raises:**

    `ValueError`, naming the layer, if no layer or traced weight is chosen, or a chosen layer has no quantizer, is
    inside an `eqx.nn.Shared`, has an input size that cannot be rotated, already has an input transform or holds a
    fitted quantizer, or a chosen traced weight cannot be transformed; `TypeError` for a `key` that is not a PRNG
    key or a `batched` that is not a bool.

    **Warns:**

    `UserWarning` naming the traced weights it leaves as they are, with why (no `batch`, say), if `where` is not
    given.
    """
    if not (isinstance(key, jax.Array) and jax.dtypes.issubdtype(key.dtype, jax.dtypes.prng_key)):
        raise TypeError(f"`key` must be a JAX PRNG key (`jax.random.key(0)`), got key={key!r}.")
    check_not_converted(model, "rotate")
    where = as_where(where)
    has_quantizer = lambda w, x: w is not None or x is not None  # noqa: E731
    check_flags(batched=batched)
    targets, traced, where_of = _targets(
        model, where, has_quantizer, "rotate", "with a quantizer", batch, batched, which="`batch`"
    )
    targets += traced
    for path, layer in targets:
        n = layer.layer.in_features
        if n < 2 or hadamard_order(n) is None:  # pyright: ignore[reportArgumentType]  (one feature: a sign flip)
            size = f"Traced weight {path!r} sums over {n} channels" if path in where_of else (
                f"Layer {path!r} has in_features={n}")  # fmt: skip
            raise ValueError(
                f"{size}, which `rotate` cannot rotate: it needs a power of two (2 or more), or m * 2**k with m - 1 a "
                "prime ≡ 3 (mod 4) (12, 20, 24, 44, ...). Exclude it with `where`."
            )
    done = {}
    for i, (path, layer) in enumerate(targets):
        shape = layer_stack(layer) + (layer.layer.in_features,)
        signs = jax.random.rademacher(jax.random.fold_in(key, i), shape, dtype=jnp.int8)
        transform = RotateInput(signs)
        done[path] = _with_transform(layer, transform, absorbed(transform, layer.layer.weight))
    return _replace(model, done, where_of)
