"""GPTQ over a model: each linear layer's Hessian from calibration data, and its weight replaced by GPTQ's."""

import functools
import math
import warnings
from collections.abc import Callable, Iterable
from typing import Any, Literal, NamedTuple

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec
from jaxtyping import Array, PRNGKeyArray, PyTree

from ._format import Format, IntFormat, apply_scale
from ._gptq import check_scale_method, gptq_solve
from ._layout import Layout
from ._misc import (
    FLOAT32_TINY,
    as_where,
    caller_stacklevel,
    check_flags,
    check_real,
    first_where,
    named_sharding,
    placed_like,
    sharded_in_type,
    where_traced,
)
from ._observe import (
    TracedInput,
    add_batch_note,
    check_callable,
    check_called,
    check_convolutions,
    check_not_converted,
    check_not_one_array,
    checked,
    fold,
    layer_stack,
    progress_bar,
    traced_inputs,
    warns_of_calibration_data,
)
from ._quantizers import AbstractQuantizer, DynamicFakeQuant, FakeQuant, LearnedFakeQuant
from ._summary import describe_quantizer
from ._traced import QuantTraced, as_matrix, from_matrix, leaves_by_path, replaced
from ._traced_layers import traced_probes
from ._tree import join_path, map_nodes, nodes, path_string
from .nn._layers import QuantLinear, per_layer


def _symmetric(quantizer: object) -> bool:
    """Whether a weight quantizer is symmetric on a grid holding 0 and positive levels, as GPTQ quantizes."""
    symmetric = (
        (isinstance(quantizer, DynamicFakeQuant) and quantizer.symmetric)
        or (isinstance(quantizer, FakeQuant) and quantizer.zero_point == 0)
        or (isinstance(quantizer, LearnedFakeQuant) and quantizer.zero_point is None)
    )
    fmt = getattr(quantizer, "format", None)
    return symmetric and (not isinstance(fmt, IntFormat) or fmt.qmin <= 0 < fmt.qmax)


def _gptq_grid(path: str, quantizer: object, name: str) -> tuple[Format, int | None]:
    """`(format, group_size)` of a weight quantizer that GPTQ (or another weight solver, `name`) can stand in for,
    or a `ValueError` naming the layer: symmetric, with one scale per output row (`axis=0`) or per group (or block)
    of input columns."""
    layout = getattr(quantizer, "layout", None)
    fmt = getattr(quantizer, "format", None)
    per_row = layout is not None and layout.axes in ((0,), (-2,)) and layout.group_size is None
    per_group = (
        layout is not None and layout.axes == () and layout.group_size is not None and layout.group_axis in (-1, 1)
    )
    if not _symmetric(quantizer) or not (per_row or per_group):
        raise ValueError(
            f"Layer {path!r} has weight quantizer {quantizer!r}; `{name}` needs a symmetric one (DynamicFakeQuant, "
            "or a FakeQuant / LearnedFakeQuant with zero point 0) with one scale per output row (axis=0) or per group "
            "or block of input columns (group_size), on a grid holding 0 and positive levels. Exclude the layer with "
            "`where`."
        )
    assert fmt is not None and layout is not None
    return fmt, layout.group_size


class _Solved(AbstractQuantizer):
    """Stands in for a weight quantizer while sequential GPTQ runs: the weight as it is where `done` (GPTQ's
    quantized weight, already in place), the quantizer's output elsewhere. `done` is an array (one entry per layer of
    a stack), so that every pass over the calibration data runs the same compiled program."""

    done: Array
    quantizer: AbstractQuantizer

    def __call__(self, x: Array, *, key: PRNGKeyArray | None = None) -> Array:
        return jnp.where(self.done, x, self.quantizer(x, key=key))


class _Order(AbstractQuantizer):
    """Stands in for an input quantizer while the model is traced once: records the layer's path when Python calls
    it, so that the layers are listed in the order the model calls them."""

    path: str = eqx.field(static=True)
    calls: "_Calls" = eqx.field(static=True)

    def __call__(self, x: Array, *, key: PRNGKeyArray | None = None) -> Array:
        if self.path not in self.calls.paths:
            self.calls.paths.append(self.path)
        return x


class _Calls:
    """The paths `_Order` records, in a holder hashed by identity (a static field must be hashable)."""

    def __init__(self):
        self.paths: list[str] = []


def _call_order(model: PyTree, layers: list, batch: PyTree, batched: bool) -> list[str]:
    """The paths of `layers` in the order the model first calls them on `batch` (traced, not run). A layer inside a
    `jax.lax.scan` over a stack is called once in the traced body, in its place among the body's layers."""
    calls = _Calls()
    chosen = dict(layers)
    swap = lambda path, l: eqx.tree_at(lambda m: m.input_quant, l, _Order(path, calls), is_leaf=lambda x: x is None)  # noqa: E731
    traced = map_nodes(model, (QuantLinear,), lambda path, l: swap(path, l) if path in chosen else l)
    try:
        eqx.filter_eval_shape(lambda m, b: m(b) if batched else jax.vmap(m)(b), traced, batch)
    except Exception as error:
        add_batch_note(error, batch, batched)
        raise
    return calls.paths


def _stack_root(leaves: list[tuple[str, Array]], path: str, stack: tuple[int, ...]) -> str:
    """The outermost module on the way to the layer at `path` whose every array leaf (of the model's `(path, leaf)`
    pairs) carries the stack's leading axes: the module built with `eqx.filter_vmap` (a scanned block), which the
    layers of one step of the scan share."""
    parts = path.split(".")
    for i in range(1, len(parts) + 1):
        prefix = ".".join(parts[:i])
        under = [leaf for p, leaf in leaves if p == prefix or p.startswith(f"{prefix}.")]
        if under and all(leaf.shape[: len(stack)] == stack for leaf in under):
            return prefix
    return path


def _steps(model: PyTree, order: list[str], stacks: dict[str, tuple[int, ...]]) -> list[tuple[str, int]]:
    """`(path, index in the stack)` in the order of quantization: the layers in call order, and consecutive layers of
    one stacked module (the layers of one scanned block) interleaved along the stack: block 0's layers, then block
    1's, ..."""
    flat = jax.tree_util.tree_flatten_with_path(model)[0]
    leaves = [(path_string(p), leaf) for p, leaf in flat if eqx.is_array(leaf)]
    roots = {path: _stack_root(leaves, path, stacks[path]) for path in order if stacks[path]}
    steps: list[tuple[str, int]] = []
    i = 0
    while i < len(order):
        group = [order[i]]
        while order[i] in roots and i + len(group) < len(order) and roots.get(order[i + len(group)]) == roots[order[i]]:
            group.append(order[i + len(group)])
        steps += [(path, k) for k in range(math.prod(stacks[order[i]])) for path in group]
        i += len(group)
    return steps


def _solve(weight: Array, hessian: Array, fmt: Format, group_size: int | None, **options: Any):
    """GPTQ on one layer (or, under `jax.vmap`, on each layer of a stack), with `gptq_solve`'s other `options`: the
    quantized weight `scale * levels` in the weight's dtype, its scales in the compact layout of the quantizer, and
    the tensor scale (or None)."""
    levels, scales = gptq_solve(weight, hessian, fmt=fmt, group_size=group_size, **options)
    g = weight.shape[-1] if group_size is None else group_size
    repeated = jnp.repeat(scales.scale, g, axis=-1)
    t = scales.tensor_scale
    new_weight = apply_scale(fmt, levels.astype(jnp.float32), repeated, t).astype(weight.dtype)
    compact = scales.scale[..., 0] if group_size is None else scales.scale
    return new_weight, as_stored(fmt, compact), t


def as_stored(fmt: Format, scales: Array) -> Array:
    """A solver's scales as the format stores and applies them: GGML's `d` rounded to float16 (its levels were
    found with the float32 `d`; with the rounded one, a quantizer finds them again), others as they are."""
    return scales.astype(jnp.float16).astype(scales.dtype) if fmt.scale == "float16" else scales


def _with_solution(layer: QuantLinear, fmt: Format, group_size: int | None, weight, compact, t) -> QuantLinear:
    """`layer` holding GPTQ's weight, and a fixed weight quantizer with GPTQ's scales: a static `FakeQuant`, or for
    a stack a `LearnedFakeQuant` holding one set of scales per layer."""
    stack = layer_stack(layer)
    layout = dict(axis=0) if group_size is None else dict(group_size=group_size)
    if not stack:
        tensor_scale = None if t is None else float(t)
        quantizer = FakeQuant(np.asarray(compact), format=fmt, tensor_scale=tensor_scale, **layout)
    else:
        make = lambda s, t: LearnedFakeQuant(s, format=fmt, tensor_scale=t, min_scale=FLOAT32_TINY, **layout)  # noqa: E731
        quantizer = per_layer(make, len(stack))(compact, t)
    weight = placed_like(weight, layer.layer.weight)  # a sharded weight keeps its partitioning
    return eqx.tree_at(lambda l: (l.layer.weight, l.weight_quant), layer, (weight, quantizer))


@warns_of_calibration_data("gptq")
def gptq(
    model: PyTree,
    batches: Iterable[PyTree],
    *,
    sequential: bool = True,
    damp: float = 0.01,
    act_order: bool = False,
    method: Literal["absmax", "mse"] = "absmax",
    num_candidates: int = 100,
    quantized_inputs: bool = False,
    batched: bool = False,
    where: Callable[[str, eqx.Module], bool] | str | None = None,
    progress: bool = False,
) -> PyTree:
    """Post-training quantization of a model's linear weights with GPTQ ([`eqx_quant.gptq_quantize`][]).

    Every [`eqx_quant.nn.QuantLinear`][] with a weight quantizer (or those `where` selects) gets its weight replaced
    by GPTQ's quantized weight `scale * levels`, in the format and layout of its weight quantizer (which must be
    symmetric, per output row or per group; integer grids, FP8, FP6 and FP4 with float32 scales, and the MX and
    NVFP4 block formats all work, with block scales fixed from the weight as GPTQ fixes a group's), and its weight
    quantizer replaced by a fixed one with GPTQ's scales: a
    static [`eqx_quant.FakeQuant`][], or for stacked layers (built with `eqx.filter_vmap`, run with `jax.lax.scan`)
    a [`eqx_quant.LearnedFakeQuant`][] holding one set of scales per layer. The fake-quant forward then computes
    exactly with GPTQ's integers, and [`eqx_quant.convert`][] stores them. Biases, input quantizers and other layers
    are unchanged. (A `LearnedFakeQuant`'s scales are positive: the signed block scales of `"q4_0"` and `"q5_0"` are
    a `ValueError` on stacked layers.)

    The Hessian of a layer is `Σ x xᵀ` over the inputs the layer sees when the model runs on `batches`, with the
    chosen layers' input quantizers bypassed. It is collected like [`eqx_quant.calibrate`][]'s statistics, so that
    layers inside the model's own `jax.vmap` and `jax.lax.scan` are seen, one Hessian per layer of a stack. A
    traced weight whose axes are batch dimensions of all its products (experts stacked in one array `(experts, in,
    out)`, applied by `jnp.einsum("teh,ehd->ted", ...)` or a `jax.vmap` over the experts) has one Hessian per index
    along them, each expert solved on its own tokens as a weight of its own would be (up to the float rounding of
    the solve), and an expert that no calibration token reaches on the tokens of all of them, with a warning. (With
    NVFP4's tensor scale, one for the whole weight, the experts share one Hessian.)

    **Sequential** (the default, as the paper does it): the layers are quantized one at a time in the order the
    model calls them (found by tracing the model once on the first batch), each layer's Hessian collected on the
    outputs of the layers already quantized with GPTQ, the later ones still computing with their weight quantizers.
    The layers of a scanned stack go layer by layer along the stack: the first block's layers in their order, then
    the second block's (the layers of one module built with `eqx.filter_vmap`, in the order of its stack axis; a
    scan in reverse, or a layer outside the stack called inside its scan, is not followed). That is one pass over
    `batches` per layer (and per layer of a stack), each running the same compiled program per layer path; `batches`
    is read into a list first. With `sequential=False`, one pass collects every Hessian from the model with its
    weight quantizers active: faster, but no layer sees its predecessors' GPTQ error (on the LM benchmark, as good at
    3 and 4 bits, far worse at 2).

    **Quantized inputs** (`quantized_inputs=True`, for layers that also quantize their inputs, e.g. W4A8): GPTQ as
    published minimises `‖(W - Ŵ) X‖²` on the float inputs `X` and leaves the input quantizer's error `W (X - Q(X))`
    to chance. This option minimises the error of the layer's actual output against its float output, `‖W X - Ŵ
    Q(X)‖²` (the asymmetric objective of GPTAQ, with `X` the layer's own input in the quantized model): the Hessian
    is `G = Σ Q(x) Q(x)ᵀ`, and GPTQ rounds the least-squares map of the quantized inputs onto the float outputs,
    shrunk towards `W` by GPTQ's damping, `W (C + λI)(G + λI)⁻¹` with `C = Σ x Q(x)ᵀ` and `λ = damp * mean(diag(G))`
    (computed in float64 on the host; the minimum-norm solution where `damp=0`), in place of `W`. The calibration
    passes run the model with the solved layers' input quantizers active, so that each layer sees what it will see
    after conversion. Layers without an input quantizer are solved as without the option; if no chosen layer (nor
    traced weight) has one, it is a `ValueError`. On a small calibration set the map can fit the calibration
    inputs' rounding noise: compare on held-out data.

    **Non-finite data.** NaN and infinite calibration inputs count as zeros in the Hessians, with a warning that
    counts them per layer. A layer (or layer of a stack) whose calibration inputs are all zero so has a zero Hessian,
    on which GPTQ would set its whole weight to zero: a `ValueError` names it. A NaN or infinite weight entry, which
    the error feedback would spread over its row, is a `ValueError` naming the weight and the index, before the
    batches are read.

    **Arguments:**

    - `model`: a model from [`eqx_quant.quantize`][] whose linear weight quantizers are symmetric per-row or
        per-group (e.g. `DynamicFakeQuant(4, group_size=32)`, `DynamicFakeQuant("mxfp4", group_size=32)`).
    - `batches`: an iterable of calibration inputs with a leading batch axis, as for [`eqx_quant.calibrate`][].
    - `sequential`: quantize the layers one after another (above), or all from one pass.
    - `damp`, `act_order`, `method`, `num_candidates`: as for [`eqx_quant.gptq_quantize`][]: `method="mse"`
        clips each row's or group's scale where that rounds the weights with less error (weighted by the Hessian's
        diagonal), for weights on float32-scaled grids (integers, FP8, FP6, FP4); formats with block scales (MX,
        NVFP4, GGML) raise a `ValueError` naming the format (exclude those layers with `where`).
    - `quantized_inputs`: solve each layer for its float output from its quantized inputs (above), or (`False`,
        the paper's GPTQ) from its float inputs.
    - `batched`: as for [`eqx_quant.calibrate`][].
    - `where`: a predicate `f(path, layer)` choosing the layers (and `f(name, weight)` the traced weights of
        `quantize(..., example=)`, named `model.<path>`, with the leaf array in place of a layer), a regular expression
        choosing the paths it matches whole, or `None` for every `QuantLinear` and traced weight with a weight
        quantizer, except the traced weights that the model reads otherwise than as the weight of its products (a
        tied embedding's lookup, found by tracing the model on the first batch): their Hessians see the products
        alone, so they are left to their weight quantizers, with a warning naming them.
    - `progress`: show progress bars over the batches and over the layers (tqdm's when it is installed).

    **Returns:**

    The model with GPTQ-quantized linear weights.
    """
    check_flags(act_order=act_order, quantized_inputs=quantized_inputs)
    damp = check_real("damp", damp)
    if not (math.isfinite(damp) and damp >= 0):
        raise ValueError(f"`damp` must be finite and >= 0, got damp={damp!r}.")
    check_scale_method(method, num_candidates)  # and each layer's format, in `make`

    def make(fmt: Format, group_size: int | None) -> Callable:
        check_scale_method(method, num_candidates, fmt)
        options = dict(act_order=act_order, damp=damp, method=method, num_candidates=num_candidates)
        return functools.partial(_solve, fmt=fmt, group_size=group_size, **options)

    input_damp = damp if quantized_inputs else None
    return solve_weights(model, batches, "gptq", make, sequential, batched, where, progress, input_damp)


def solve_weights(
    model: PyTree,
    batches: Iterable[PyTree],
    name: str,
    make_solve: Callable[[Format, int | None], Callable],
    sequential: bool,
    batched: bool,
    where: Callable[[str, eqx.Module], bool] | str | None,
    progress: bool,
    input_damp: float | None = None,
) -> PyTree:
    """The model wiring of a weight solver (GPTQ's, AutoRound's): the chosen layers, their Hessians (sequentially or
    from one pass), `make_solve(fmt, group_size)(weight, hessian) -> (weight, compact scales, tensor scale)` on each
    layer (of a stack), and the layers made to hold the solution with a fixed quantizer of its scales. With
    `input_damp` (GPTQ's damping; `None` for float inputs), each Hessian is that of the layer's quantized inputs,
    and the weight solved is the least-squares map of those onto the float outputs, damped by it (`_mapped`)."""
    check_callable(model)
    check_not_converted(model, name)
    check_flags(sequential=sequential, batched=batched, progress=progress)
    check_not_one_array(batches)
    given, where = where, as_where(where)
    layers = [
        (path, layer)
        for path, layer in nodes(model, (QuantLinear,))
        # A layer whose weight is the placeholder of an `eqx.nn.Shared` tie has no weight of its own to quantize.
        if layer.weight_quant is not None and eqx.is_array(layer.layer.weight)
    ]
    if where is not None:
        candidates = [path for path, _ in layers] + [
            join_path(root, inner)
            for root, traced in nodes(model, (QuantTraced,))
            for inner, target in traced_inputs(traced)
            if traced.weight_quants[target.index] is not None
        ]
        layers = [(path, layer) for path, layer in layers if where(path, layer)]
    traced, unpaired = _traced_targets(model, where, name)
    left = (
        f"the traced weights {unpaired}, whose products do not pair the axes they sum over one to one with their "
        "input's (a convolution, a reshape merging summed axes), are left as they are"
        if unpaired
        else ""
    )
    check_convolutions(model, where, name, lambda layer: layer.weight_quant is not None)
    if where is not None and candidates and not layers and not traced:
        raise ValueError(f"`where`={given!r} chooses none of the weights `{name}` can solve: {candidates}.")
    if not layers and not traced:
        raise ValueError(
            f"`model` has no QuantLinear layer (nor traced weight) with a weight quantizer to quantize with `{name}`"
            + (f": {left}." if unpaired else ".")
        )
    if unpaired:
        warnings.warn(f"`{name}` cannot solve them: {left}. Choose the weights with `where` to silence this.",
                      stacklevel=caller_stacklevel())  # fmt: skip
    # The solvers' own errors (a setting the format cannot take), naming the weight, before the batches are read.
    grids = [(f"Layer {path!r}", *_gptq_grid(path, layer.weight_quant, name)) for path, layer in layers]
    for what, fmt, group_size in grids + [(f"Traced weight {t.name!r}", t.fmt, t.group_size) for t in traced]:
        try:
            make_solve(fmt, group_size)
        except ValueError as error:
            raise ValueError(f"{what}: {error}") from None

    for what, weight in [(f"Layer {path!r}", layer.layer.weight) for path, layer in layers] + [
        (f"Traced weight {t.name!r}", t.weight) for t in traced
    ]:
        _check_finite(what, weight, name)

    def check_inputs(traced: list) -> None:  # before the batches are read, and once the tied weights are left out
        unquantized = all(layer.input_quant is None for _, layer in layers)
        if input_damp is not None and unquantized and all(q is None for q in _traced_inputs(model, traced).values()):
            raise ValueError(
                f"`quantized_inputs=True` would change nothing: none of the layers (nor traced weights) that "
                f"`{name}` solves quantizes its input."
            )

    check_inputs(traced)
    if traced:
        # The first batch traced to find the tied weights and the experts' batch axes; all read by each solver.
        batches = checked(batches)
        reads, products = traced_probes(model, batches[0], batched)
        if where is None:
            traced = _without_tied(traced, reads, bool(layers), name)
            check_inputs(traced)
        traced = _with_batches(traced, reads, products)
    options = (sequential, batched, progress, input_damp)
    if traced:
        if layers:
            model = _solve_layers(model, layers, batches, name, make_solve, *options)
        return _solve_traced(model, traced, make_solve, batches, name, *options)
    return _solve_layers(model, layers, batches, name, make_solve, *options)


def _without_tied(traced: list["_TracedTarget"], reads: dict[str, str | None], layers: bool, name: str) -> list:
    """The `traced` targets but those the model reads otherwise than as the weight of their products (a tied
    embedding's lookup, as `reads` found by tracing it), which are left out with a warning: their Hessians see the
    products alone. A `ValueError` where that leaves nothing to solve (no `layers` either)."""
    tied = [t.name for t in traced if reads.get(t.path) == "stray"]
    if not tied:
        return traced
    kept = [t for t in traced if t.name not in tied]
    what = (
        f"`{name}` leaves out the traced weights {tied}, which the model also reads otherwise than as the weight of "
        "products summing over their contracted axes whole (a tied embedding's lookup, a slice or split of those "
        "axes, arithmetic on the weight), as their Hessians see those products alone and the solution may serve the "
        "other reads worse than round to nearest. Choose them with `where` to solve them anyway."
    )
    if not layers and not kept:
        raise ValueError(f"`{name}` would change nothing: {what}")
    warnings.warn(what, stacklevel=caller_stacklevel())
    return kept


def _with_batches(traced: list["_TracedTarget"], reads: dict[str, str | None], products: dict[str, set]) -> list:
    """The `traced` targets, each with the axes of its weight that are batch dimensions of all its products (the
    expert axis of experts stacked in one array and applied by one `einsum` or `jax.vmap`), as `products` found by
    tracing the model: each index along them is a product of its own, with its own Hessian. Not for a format with a
    tensor scale (NVFP4's, one for the whole weight), whose products keep one Hessian, nor for a weight the model
    also reads otherwise (`reads`; chosen by `where`, a reversal of the experts, say), whose indices may not be its
    products'."""
    kept = []
    for t in traced:
        seen = products.get(t.path, set())
        axes = next(iter(seen)) if len(seen) == 1 else None
        if axes and t.fmt.scale != "e4m3" and reads.get(t.path) is None:
            t = t._replace(batch=axes)
        kept.append(t)
    return kept


def _check_finite(what: str, weight: Array, name: str) -> None:
    """A `ValueError` naming `what` if its concrete `weight` holds NaN or infinity, which the solvers' error feedback
    would spread over its row (NaN becoming zeros)."""
    if isinstance(weight, jax.core.Tracer):
        return
    values = np.asarray(weight)
    index = first_where(~np.isfinite(values))
    if index is not None:
        raise ValueError(
            f"{what} has a non-finite weight entry, {values[index]} at index {index}, which `{name}` "
            "cannot solve for (its error feedback would spread it over the row). Replace it before calling "
            f"`{name}`, or leave the weight out with `where`."
        )


def _check_seen(grams: dict[str, list[dict[str, Any]]], name: str, kind: str = "Layer", index: int | None = None):
    """A `ValueError` naming the weight whose calibration inputs were all zero (NaN and infinite entries count as
    zeros): its Hessian is zero, and the solver has nothing to fit (GPTQ would set every entry of the weight to
    zero)."""
    for path, records in grams.items():
        for k, record in enumerate(records):
            if not np.diagonal(np.asarray(record["gram"]), axis1=-2, axis2=-1).any():
                at = index if index is not None else k if len(records) > 1 else None
                where = "" if at is None else f" (layer {at} of its stack)"
                raise ValueError(
                    f"{kind} {path!r}{where} saw no nonzero calibration input (NaN and infinite entries count as "
                    f"zeros): its Hessian is zero, and `{name}` would set its whole weight to zero. Pass batches "
                    "that reach it with data, or leave it out with `where`."
                )


def _solve_apart(solve: Callable, weight: Array, record: dict[str, Any], damp: float | None, t: "_TracedTarget"):
    """One layer's `(weight, compact scales, tensor scale)` of the traced weight of `t`, in the weight's layout: the
    solver on its matrix, or, along batch axes, on the matrix of each index with that index's Hessian."""
    depth = len(t.stack)
    batch = tuple(a - depth for a in t.batch)
    if not batch:
        result = _solved(solve, as_matrix(weight, 0, t.axes), record, damp)
        return _from_matrix(result, weight.shape, t.axes, t.group_size)
    order = list(batch) + [a for a in range(weight.ndim) if a not in batch]
    moved = jnp.moveaxis(weight, batch, tuple(range(len(batch))))
    parts = moved.reshape((-1,) + moved.shape[len(batch) :])
    axes = tuple(order.index(a) - len(batch) for a in t.axes)
    apart = {name: np.asarray(v).reshape((len(parts),) + v.shape[-2:]) for name, v in record.items()
             if name in ("gram", "cross")}  # fmt: skip
    # An index whose products saw no calibration input (an expert no token reached) has a zero Hessian, which would
    # zero its weight: it takes the Hessian of all the indices' inputs instead.
    unseen = [k for k in range(len(parts)) if not np.any(apart["gram"][k])]
    if unseen:
        warnings.warn(
            f"Traced weight {t.name!r}: the indices {unseen} of its axes {t.batch} (experts, say) saw no calibration "
            "input; each is solved with the Hessian of all the indices' inputs.",
            stacklevel=caller_stacklevel(),
        )
    pooled = {name: v.sum(axis=0) for name, v in apart.items()}
    records = [record | (pooled if k in unseen else {name: v[k] for name, v in apart.items()})
               for k in range(len(parts))]  # fmt: skip
    solved = [
        _from_matrix(_solved(solve, as_matrix(part, 0, axes), r, damp), part.shape, axes, t.group_size)
        for part, r in zip(parts, records, strict=True)
    ]
    assert all(tensor_scale is None for _, _, tensor_scale in solved)
    new = jnp.stack([w for w, _, _ in solved]).reshape(moved.shape)
    compact = jnp.stack([c for _, c, _ in solved])
    compact = compact.reshape(moved.shape[: len(batch)] + compact.shape[1:])
    if t.group_size is None:  # one scale per channel: the batch axes among the others, in the weight's order
        others = [a for a in range(weight.ndim) if a not in t.axes]
        where = tuple(others.index(a) for a in batch)
    else:  # the weight's layout, its contracted axis in tiles
        where = batch
    front = tuple(range(len(batch)))
    return jnp.moveaxis(new, front, batch), jnp.moveaxis(compact, front, where), None


def _mapped(weight: Array, record: dict[str, Any], damp: float) -> Array:
    """The weight `V` that maps a layer's quantized inputs `q` onto its float outputs `W x` in the least squares
    sense, shrunk towards `W`: `V = W (C + λI)(G + λI)⁻¹`, from the record's `"cross"` `C = Σ x qᵀ` and `"gram"`
    `G = Σ q qᵀ`, with `λ = damp * mean(diag(G))` (GPTQ's damping: directions that the calibration inputs barely
    span keep `W`; with `λ = 0`, the minimum-norm solution), computed in float64 on the host. The weight itself
    where the record has no `"cross"` (a layer without input quantizer). In float32, or float64 for a float64
    weight."""
    if "cross" not in record:
        return weight
    w = np.asarray(weight, np.float64)
    gram, cross = np.asarray(record["gram"], np.float64), np.asarray(record["cross"], np.float64)
    ridge = damp * np.mean(np.diag(gram)) * np.eye(len(gram))
    rhs = (cross + ridge).T @ w.T  # V (G + λI) = W (C + λI), G + λI symmetric
    if ridge[0, 0] > 0:  # positive definite
        mapped = np.linalg.solve(gram + ridge, rhs).T
    else:
        mapped = np.linalg.lstsq(gram, rhs, rcond=None)[0].T
    return jnp.asarray(mapped, jnp.promote_types(weight.dtype, jnp.float32))


def _solved(solve: Callable, weight: Array, record: dict[str, Any], damp: float | None) -> tuple:
    """`solve(weight, hessian)` on one layer's record (`_mapped`'s weight with quantized inputs), its solved weight
    in the dtype of `weight`."""
    target = weight if damp is None else _mapped(weight, record, damp)
    sharding = named_sharding(target)
    if sharding is not None and sharded_in_type(target):
        # Split over Explicit mesh axes, whose column updates would each need a sharding: solved whole on every
        # device (it is put back with the weight's partitioning).
        target = jax.device_put(target, NamedSharding(sharding.mesh, PartitionSpec()))
    new, compact, t = solve(target, jnp.asarray(record["gram"]))
    return new.astype(weight.dtype), compact, t


def _traced_inputs(model: PyTree, targets: list["_TracedTarget"]) -> dict[str, Any]:
    """The input quantizer of the products of each traced weight of `targets`, by name."""
    traced = dict(nodes(model, (QuantTraced,)))
    return {t.name: traced[t.root].input_quants[t.index] for t in targets}


def _solve_layers(model, layers, batches, name, make_solve, sequential, batched, progress, input_damp) -> PyTree:
    """`solve_weights` on the chosen QuantLinear layers."""
    grids = {path: _gptq_grid(path, layer.weight_quant, name) for path, layer in layers}
    for path, layer in layers:
        fmt = grids[path][0]
        if layer_stack(layer) and fmt.scale_rule == "signed_max":
            raise ValueError(
                f"Layer {path!r} is stacked (built with `eqx.filter_vmap`) and quantizes its weight to {fmt.name}, "
                f"whose block scales are signed: a stacked layer holds `{name}`'s scales in a LearnedFakeQuant, "
                f"which keeps them positive. Run `{name}` on the unstacked layers, or choose another format (q8_0), "
                "or exclude the layer with `where`."
            )
    solve = {path: make_solve(*grids[path]) for path, _ in layers}
    if sequential:
        solved = _sequential(model, layers, solve, batches, batched, progress, name, input_damp)
    else:
        # The observers stand in for the input quantizers: the layers see float inputs, as GPTQ's Hessian assumes
        # (or, with quantized inputs, the quantized ones, and the products of both).
        statistic, data = _statistic(input_damp, {path: layer.input_quant for path, layer in layers})
        grams = fold(model, layers, batches, batched, statistic, data, progress=progress,
                     description=f"{name} (Hessians)")  # fmt: skip
        check_called(layers, grams)
        _check_seen(grams, name)
        solved = {}
        for path, layer in progress_bar(layers, progress, f"{name} (layers)"):
            stack, weight = layer_stack(layer), layer.layer.weight
            records = grams[path]
            hessian = jnp.asarray(np.stack([record["gram"] for record in records]))
            flat = weight.reshape((-1,) + weight.shape[len(stack) :])
            if input_damp is not None:
                flat = jnp.stack([_mapped(w, r, input_damp) for w, r in zip(flat, records, strict=True)])
            fn = solve[path]
            for _ in stack:
                fn = jax.vmap(fn)
            new, compact, t = fn(flat.reshape(stack + flat.shape[1:]), hessian.reshape(stack + hessian.shape[1:]))
            solved[path] = (new.astype(weight.dtype), compact, t)
    done = {path: _with_solution(layer, *grids[path], *solved[path]) for path, layer in layers}
    return map_nodes(model, (QuantLinear,), lambda path, layer: done.get(path, layer))


class _TracedTarget(NamedTuple):
    """A traced weight that a weight solver quantizes: its name, where it lives, its grid and contracted axes."""

    name: str  # `<root>.model.<path>`, as `traced_inputs` names it
    root: str
    index: int
    path: str
    stack: tuple[int, ...]
    weight: Array
    fmt: Format
    group_size: int | None
    axes: tuple[int, ...]  # one layer's contracted axes (after the stack's), in the order the products pair them
    batch: tuple[int, ...] = ()  # the leaf axes that are batch dimensions of every product (experts): solved apart


def _traced_targets(model: PyTree, where: Callable | None, name: str) -> tuple[list[_TracedTarget], list[str]]:
    """The traced weights of `model` with a weight quantizer (those `where(name, weight)` selects) that a weight
    solver can take: symmetric, one scale per channel (or per tile of the one axis their products sum over), and
    products that pair the axes they sum over one to one with their input's; and, where `where` is None, the names
    of those left out because their products do not pair them (a convolution's), which `where` choosing is an
    error."""
    targets, unpaired = [], []
    found = [(root, traced, inner, target) for root, traced in nodes(model, (QuantTraced,))
             for inner, target in traced_inputs(traced)]  # fmt: skip
    for root, traced, inner, target in found:
        full = join_path(root, inner)
        target = target._replace(root=root)
        path, quantizer = traced.weight_paths[target.index], traced.weight_quants[target.index]
        weight = leaves_by_path(traced.model)[path]
        if (
            quantizer is None
            or not eqx.is_array(weight)
            or (where is not None and not where_traced(where, full, weight))
        ):
            continue
        layout, ndim, depth = getattr(quantizer, "layout", None), weight.ndim, len(target.stack)
        contracted: set[int] = set()
        if layout is not None and layout.group_size is None and not layout.stacked:
            contracted = {a for a in range(ndim) if a not in {x % ndim for x in layout.axes}}
        elif layout is not None and not layout.axes and not layout.stacked:
            contracted = {layout.group_axis % ndim}
        pairing = traced.pairings[target.index]
        if pairing is None and len(contracted) == 1:
            pairing = tuple(contracted)
        if not _symmetric(quantizer) or pairing is None or set(pairing) != contracted or min(pairing) < depth:
            pairs = traced.pairings[target.index] is not None
            if not pairs and where is None:
                unpaired.append(full)  # left as it is, as the quantized convolutions are (a warning names them)
                continue
            if not _symmetric(quantizer):
                why = f"its weight quantizer {describe_quantizer(quantizer)} is not symmetric (zero point 0)"
            elif not pairs:
                why = ("its products do not pair the weight's summed axes one to one with their input's (a "
                       "convolution, a reshape merging summed axes)")  # fmt: skip
            else:
                why = (f"its weight quantizer's scales ({describe_quantizer(quantizer)}) are not one per channel, "
                       "nor per tile of the single axis its products sum over")  # fmt: skip
            raise ValueError(f"Traced weight {full!r}: `{name}` cannot solve it: {why}. Exclude it with `where`.")
        fmt = quantizer.format  # pyright: ignore[reportAttributeAccessIssue]
        if depth and fmt.scale != "float32" and fmt.scale != "e8m0":
            raise ValueError(
                f"Traced weight {full!r} is stepped through by `jax.lax.scan` and quantizes to {fmt.name}, whose "
                f"scales a static quantizer of the whole stack cannot hold per layer. Exclude it with `where`."
            )
        axes = tuple(a - depth for a in pairing)
        targets.append(_TracedTarget(full, target.root, target.index, path, target.stack, weight, fmt,
                                     layout.group_size, axes))  # fmt: skip
    return targets, unpaired


def _from_matrix(solution: tuple, shape: tuple[int, ...], axes: tuple[int, ...], group_size: int | None) -> tuple:
    """A solver's `(weight, compact scales, tensor scale)` on `as_matrix`'s matrix of one layer's weight (its
    contracted axes last, in the order the products pair them with their input's, whose Gram matrix flattens them in
    that order), in the layer weight's layout."""
    weight, compact, t = solution
    others = tuple(n for i, n in enumerate(shape) if i not in axes)
    weight = from_matrix(weight, shape, 0, axes)
    if group_size is None:
        compact = compact.reshape(others)
    else:  # one contracted axis, in tiles
        compact = jnp.moveaxis(compact.reshape(others + (compact.shape[-1],)), -1, axes[0])
    return weight, compact, t


def _with_traced(model: PyTree, target: _TracedTarget, weight: Array, quantizer: Any) -> PyTree:
    """`model` with the traced weight of `target` and its weight quantizer replaced."""

    def put(root: str, traced: QuantTraced) -> QuantTraced:
        if root != target.root:
            return traced
        leaf = lambda m: _leaf_at(m, target.path)  # noqa: E731
        inner = eqx.tree_at(leaf, traced.model, placed_like(weight, leaf(traced.model)))
        weights = list(traced.weight_quants)
        weights[target.index] = quantizer
        return replaced(traced, model=inner, weight_quants=weights)

    return map_nodes(model, (QuantTraced,), put)


def _leaf_at(model: PyTree, path: str) -> Any:
    for p, x in jax.tree_util.tree_flatten_with_path(model)[0]:
        if path_string(p) == path:
            return x
    raise KeyError(path)


def _traced_solution(target: _TracedTarget, compact: Array, tensor_scale: Array | None) -> FakeQuant:
    """A fixed quantizer of the traced weight with the solver's scales: a static FakeQuant over the whole leaf (one
    scale per channel, a stack's layer axes among them, or per tile of the contracted axis)."""
    summed = {a + len(target.stack) for a in target.axes}
    if target.group_size is None:
        layout = Layout(axes=tuple(a for a in range(target.weight.ndim) if a not in summed))
    else:
        layout = Layout(group_size=target.group_size, group_axis=min(summed))
    t = None if tensor_scale is None else float(tensor_scale)
    return FakeQuant(np.asarray(compact), format=target.fmt, tensor_scale=t, layout=layout)


def _statistic(input_damp: float | None, quantizers: dict[str, Any]) -> tuple[str, dict[str, Any] | None]:
    """The statistic of the Hessians' pass, and the observers' data: the input quantizers with quantized inputs."""
    return ("gram", None) if input_damp is None else ("gram_quantized", quantizers)


def _solve_traced(model, targets, make_solve, batches, name, sequential, batched, progress, input_damp) -> PyTree:
    """A weight solver on the traced weights `targets`: per weight (and per layer of a stack), its products' Gram
    matrix over the axes they sum over, the solver on the weight as a matrix, and the solution put back with a fixed
    quantizer of its scales. Sequential: in the order the program first uses them (the weights of one stack
    interleaved layer by layer), each on the outputs of those already solved. `batches` is a `checked` list."""
    solve = {t.name: make_solve(t.fmt, t.group_size) for t in targets}
    layers = lambda t: math.prod(t.stack)  # noqa: E731
    flat = {t.name: t.weight.reshape((-1,) + t.weight.shape[len(t.stack) :]) for t in targets}
    parts: dict[str, list] = {t.name: [None] * layers(t) for t in targets}
    observed = lambda chosen: [(t.name, TracedInput(t.root, t.index, t.stack, None)) for t in chosen]  # noqa: E731
    statistic, data = _statistic(input_damp, _traced_inputs(model, targets))

    apart = {t.name: t.batch for t in targets if t.batch}
    if not sequential:
        grams = fold(model, observed(targets), batches, batched, statistic, data, progress=progress,
                     description=f"{name} (Hessians)", apart=apart)  # fmt: skip
        check_called(observed(targets), grams)
        _check_seen(grams, name, "Traced weight")
        for t in targets:
            for k in range(layers(t)):
                parts[t.name][k] = _solve_apart(solve[t.name], flat[t.name][k], grams[t.name][k], input_damp, t)
    else:
        chosen = {(t.root, t.index) for t in targets}

        def bypass(root: str, traced: QuantTraced) -> QuantTraced:
            weights, inputs = list(traced.weight_quants), list(traced.input_quants)
            leaves = leaves_by_path(traced.model)
            for i in range(len(weights)):
                if (root, i) in chosen:
                    stack = traced.stacks[i]
                    ndim = leaves[traced.weight_paths[i]].ndim
                    weights[i] = _Solved(jnp.zeros(stack + (1,) * (ndim - len(stack)), bool), weights[i])  # pyright: ignore
                    inputs[i] = None if input_damp is None else inputs[i]
            return replaced(traced, weight_quants=weights, input_quants=inputs)

        current = map_nodes(model, (QuantTraced,), bypass)
        steps, i = [], 0
        while i < len(targets):  # consecutive weights of one stack shape: the layers of one scanned block
            group = [targets[i]]
            while (targets[i].stack and i + len(group) < len(targets)
                   and targets[i + len(group)].stack == targets[i].stack):  # fmt: skip
                group.append(targets[i + len(group)])
            steps += [(t, k) for k in range(layers(group[0])) for t in group]
            i += len(group)
        for t, k in progress_bar(steps, progress, f"{name} (layers)"):
            grams = fold(current, observed([t]), batches, batched, statistic, data, apart=apart)
            check_called(observed([t]), grams)
            _check_seen({t.name: grams[t.name][k : k + 1]}, name, "Traced weight", k if t.stack else None)
            parts[t.name][k] = _solve_apart(solve[t.name], flat[t.name][k], grams[t.name][k], input_damp, t)
            flat[t.name] = flat[t.name].at[k].set(parts[t.name][k][0])
            traced = dict(nodes(current, (QuantTraced,)))[t.root]
            solved = traced.weight_quants[t.index]
            done = solved.done.reshape(-1).at[k].set(True).reshape(solved.done.shape)  # pyright: ignore
            solved = eqx.tree_at(lambda q: q.done, solved, done)
            current = _with_traced(current, t, flat[t.name].reshape(t.weight.shape), solved)
    for t in targets:
        results = parts[t.name]
        weight = jnp.stack([r[0] for r in results]).reshape(t.weight.shape)
        compact = jnp.stack([r[1] for r in results])
        compact = compact.reshape(t.stack + compact.shape[1:])
        model = _with_traced(model, t, weight, _traced_solution(t, compact, results[0][2]))
    return model


def _put(model: PyTree, path: str, weight: Array, done: Array) -> PyTree:
    """`model` with the layer at `path` holding `weight` and the flags `done` of its `_Solved` quantizer."""

    def put(p: str, layer: QuantLinear) -> QuantLinear:
        if p != path:
            return layer
        return eqx.tree_at(lambda l: (l.layer.weight, l.weight_quant.done), layer, (weight, done))  # pyright: ignore

    return map_nodes(model, (QuantLinear,), put)


def _sequential(model, layers, solve, batches, batched, progress, name, input_damp) -> dict[str, tuple]:
    """Sequential GPTQ: per layer (and per layer of a stack) in call order, its Hessian on the outputs of the layers
    already quantized (their inputs too, where `input_damp` asks for quantized inputs), then its solution put in
    place. Returns `(weight, compact scales, tensor scale)` by path."""
    batches = checked(batches)
    stacks = {path: layer_stack(layer) for path, layer in layers}
    order = _call_order(model, layers, batches[0], batched)
    check_called(layers, {path: None for path in order})
    chosen = {path for path, _ in layers}

    def solving(path: str, layer: QuantLinear) -> QuantLinear:  # weights GPTQ's where done; bypassed inputs
        if path not in chosen:
            return layer
        done = _Solved(jnp.zeros(stacks[path] + (1, 1), bool), layer.weight_quant)  # pyright: ignore[reportArgumentType]
        inputs = None if input_damp is None else layer.input_quant
        return eqx.tree_at(
            lambda l: (l.weight_quant, l.input_quant), layer, (done, inputs), is_leaf=lambda x: x is None
        )

    current = map_nodes(model, (QuantLinear,), solving)
    results: dict[str, list] = {path: [None] * math.prod(stacks[path]) for path in chosen}
    for path, k in progress_bar(_steps(model, order, stacks), progress, f"{name} (layers)"):
        layer = dict(nodes(current, (QuantLinear,)))[path]
        grams = fold(current, [(path, layer)], batches, batched, *_statistic(input_damp, {path: layer.input_quant}))
        check_called([(path, layer)], grams)
        _check_seen({path: grams[path][k : k + 1]}, name, "Layer", k if stacks[path] else None)
        stack = stacks[path]
        weights = layer.layer.weight.reshape((-1,) + layer.layer.weight.shape[len(stack) :])
        result = _solved(solve[path], weights[k], grams[path][k], input_damp)
        results[path][k] = result
        new_weight = weights.at[k].set(result[0]).reshape(layer.layer.weight.shape)
        flags = layer.weight_quant.done.reshape(-1, 1, 1).at[k].set(True).reshape(layer.weight_quant.done.shape)  # pyright: ignore
        current = _put(current, path, new_weight, flags)
    out = {}
    for path in chosen:
        parts = results[path]
        weight = jnp.stack([p[0] for p in parts]).reshape(dict(layers)[path].layer.weight.shape)
        compact = jnp.stack([p[1] for p in parts])
        compact = compact.reshape(stacks[path] + compact.shape[1:])
        t = None if parts[0][2] is None else jnp.stack([p[2] for p in parts]).reshape(stacks[path])
        out[path] = (weight, compact, t)
    return out
