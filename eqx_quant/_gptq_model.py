"""GPTQ over a model: each linear layer's Hessian from calibration data, and its weight replaced by GPTQ's."""

import functools
from collections.abc import Callable, Iterable

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import PyTree

from ._format import Format, IntFormat, apply_scale
from ._gptq import gptq_solve
from ._misc import FLOAT32_TINY
from ._observe import fold, layer_stack, progress_bar
from ._quantizers import DynamicFakeQuant, FakeQuant, LearnedFakeQuant
from ._tree import map_nodes, nodes
from .nn._layers import QuantLinear, per_layer


def _gptq_grid(path: str, quantizer: object) -> tuple[Format, int | None]:
    """`(format, group_size)` of a weight quantizer that GPTQ can stand in for, or a `ValueError` naming the
    layer: symmetric, with one scale per output row (`axis=0`) or per group (or block) of input columns."""
    symmetric = (
        (isinstance(quantizer, DynamicFakeQuant) and quantizer.symmetric)
        or (isinstance(quantizer, FakeQuant) and quantizer.zero_point == 0)
        or (isinstance(quantizer, LearnedFakeQuant) and quantizer.zero_point is None)
    )
    layout = getattr(quantizer, "layout", None)
    fmt = getattr(quantizer, "format", None)
    per_row = layout is not None and layout.axes in ((0,), (-2,)) and layout.group_size is None
    per_group = (
        layout is not None and layout.axes == () and layout.group_size is not None and layout.group_axis in (-1, 1)
    )
    grid = not isinstance(fmt, IntFormat) or fmt.qmin <= 0 < fmt.qmax
    if not symmetric or not (per_row or per_group) or not grid:
        raise ValueError(
            f"Layer {path!r} has weight quantizer {quantizer!r}; GPTQ needs a symmetric one (DynamicFakeQuant, or a "
            "FakeQuant / LearnedFakeQuant with zero point 0) with one scale per output row (axis=0) or per group "
            "or block of input columns (group_size), on a grid holding 0 and positive levels. Exclude the layer with "
            "`where`."
        )
    assert fmt is not None and layout is not None
    return fmt, layout.group_size


def gptq(
    model: PyTree,
    batches: Iterable[PyTree],
    *,
    damp: float = 0.01,
    act_order: bool = False,
    batched: bool = False,
    where: Callable[[str, eqx.Module], bool] | None = None,
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

    The Hessian of each layer is `Σ x xᵀ` over the inputs the layer sees when the model runs on `batches` with its
    weight quantizers active and the chosen layers' input quantizers bypassed (all layers from one pass: layers are not
    re-run one after another on the outputs of already-GPTQ-quantized ones). It is collected like
    [`eqx_quant.calibrate`][]'s statistics, so that layers inside the model's own `jax.vmap` and `jax.lax.scan` are
    seen, one Hessian per layer of a stack.

    **Arguments:**

    - `model`: a model from [`eqx_quant.quantize`][] whose linear weight quantizers are symmetric per-row or
        per-group (e.g. `DynamicFakeQuant(4, group_size=32)`, `DynamicFakeQuant("mxfp4", group_size=32)`).
    - `batches`: an iterable of calibration inputs with a leading batch axis, as for [`eqx_quant.calibrate`][].
    - `damp`, `act_order`: as for [`eqx_quant.gptq_quantize`][].
    - `batched`: as for [`eqx_quant.calibrate`][].
    - `where`: a predicate `f(path, layer)` choosing the layers, or `None` for every `QuantLinear` with a weight
        quantizer.
    - `progress`: show progress bars over the batches and over the layers (tqdm's when it is installed).

    **Returns:**

    The model with GPTQ-quantized linear weights.
    """
    layers = [
        (path, layer)
        for path, layer in nodes(model, (QuantLinear,))
        # A layer whose weight is the placeholder of an `eqx.nn.Shared` tie has no weight of its own to quantize.
        if layer.weight_quant is not None and eqx.is_array(layer.layer.weight)
    ]
    if where is not None:
        layers = [(path, layer) for path, layer in layers if where(path, layer)]
    if not layers:
        raise ValueError("`model` has no QuantLinear layer with a weight quantizer to quantize with GPTQ.")
    grids = {path: _gptq_grid(path, layer.weight_quant) for path, layer in layers}
    for path, layer in layers:
        fmt = grids[path][0]
        if layer_stack(layer) and fmt.scale_rule == "signed_max":
            raise ValueError(
                f"Layer {path!r} is stacked (built with `eqx.filter_vmap`) and quantizes its weight to {fmt.name}, "
                "whose block scales are signed: a stacked layer holds GPTQ's scales in a LearnedFakeQuant, which "
                "keeps them positive. Run `gptq` on the unstacked layers, or choose another format (q8_0), or "
                "exclude the layer with `where`."
            )
    # The observers stand in for the input quantizers: the layers see float inputs, as GPTQ's Hessian assumes.
    grams = fold(model, layers, batches, batched, "gram", progress=progress, description="gptq (Hessians)")
    never = [path for path, _ in layers if path not in grams]
    if never:
        raise ValueError(f"The layers at {never} were never called on the calibration batches.")

    def solved(path: str, layer: QuantLinear) -> QuantLinear:
        fmt, group_size = grids[path]
        weight = layer.layer.weight
        stack = layer_stack(layer)
        hessian = jnp.asarray(np.stack([record["gram"] for record in grams[path]]))
        hessian = hessian.reshape(stack + hessian.shape[1:])
        solve = functools.partial(gptq_solve, fmt=fmt, group_size=group_size, act_order=act_order, damp=damp)
        for _ in stack:
            solve = jax.vmap(solve)
        levels, scales = solve(weight, hessian)
        g = weight.shape[-1] if group_size is None else group_size
        repeated = jnp.repeat(scales.scale, g, axis=-1)
        t = scales.tensor_scale
        t_of_row = None if t is None else t.reshape(t.shape + (1, 1))  # one per layer of a stack, against its rows
        new_weight = apply_scale(fmt, levels.astype(jnp.float32), repeated, t_of_row).astype(weight.dtype)
        compact = scales.scale[..., 0] if group_size is None else scales.scale
        layout = dict(axis=0) if group_size is None else dict(group_size=group_size)
        if not stack:
            tensor_scale = None if t is None else float(t)
            quantizer = FakeQuant(np.asarray(compact), format=fmt, tensor_scale=tensor_scale, **layout)
        else:
            make = lambda s, t: LearnedFakeQuant(s, format=fmt, tensor_scale=t, min_scale=FLOAT32_TINY, **layout)  # noqa: E731
            quantizer = per_layer(make, len(stack))(compact, t)
        return eqx.tree_at(lambda l: (l.layer.weight, l.weight_quant), layer, (new_weight, quantizer))

    done = {path: solved(path, layer) for path, layer in progress_bar(layers, progress, "gptq (layers)")}
    return map_nodes(model, (QuantLinear,), lambda path, layer: done.get(path, layer))
