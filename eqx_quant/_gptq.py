"""GPTQ (Frantar et al., ICLR 2023): quantizing a linear layer's weight column by column, each column's rounding
error fed back into the columns not yet quantized through the inverse Hessian of the layer's inputs."""

import functools
import math
import numbers
from collections.abc import Callable, Iterable

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Int, PyTree

from ._calibrate import fold, layer_stack
from ._fake_quant import check_range, dequantize_levels, quantize_levels
from ._misc import FLOAT32_TINY, check_int
from ._quantizers import DynamicFakeQuant, FakeQuant, LearnedFakeQuant
from ._scales import absmax_scale, finite_absmax
from ._tree import map_nodes, nodes
from .nn._layers import QuantLinear, per_layer


def _check(
    weight: Array,
    hessian: Array,
    qmin: int,
    qmax: int,
    group_size: object,
    act_order: object,
    damp: object,
    block_size: object,
) -> None:
    """Raises for arguments that [`eqx_quant.gptq_quantize`][] cannot take, naming the argument and its value."""
    if not jnp.issubdtype(weight.dtype, jnp.floating):
        raise TypeError(f"`weight` must be a floating array, got dtype {weight.dtype}.")
    if not jnp.issubdtype(hessian.dtype, jnp.floating):
        raise TypeError(f"`hessian` must be a floating array, got dtype {hessian.dtype}.")
    if weight.ndim != 2 or weight.shape[1] == 0:
        raise ValueError(
            f"`weight` must have shape (out_features, in_features) with in_features >= 1, got shape {weight.shape}."
        )
    n = weight.shape[1]
    if hessian.shape != (n, n):
        raise ValueError(
            f"`hessian` must have shape ({n}, {n}) for a weight of shape {weight.shape}, got shape {hessian.shape}."
        )
    if not (qmin <= 0 < qmax):
        raise ValueError(
            f"GPTQ quantizes symmetrically: the grid needs `qmin` <= 0 < `qmax`, got qmin={qmin} and qmax={qmax}."
        )
    if group_size is not None:
        group_size = check_int("group_size", group_size)
        if group_size < 1 or n % group_size:
            raise ValueError(
                f"`group_size` must be None or a positive divisor of in_features={n}, got group_size={group_size}."
            )
    if not isinstance(act_order, bool):
        raise TypeError(f"`act_order` must be a bool, got {act_order!r}.")
    if isinstance(damp, (bool, np.bool_)) or not isinstance(damp, numbers.Real):
        raise TypeError(f"`damp` must be a float, got {damp!r} of type {type(damp).__name__}.")
    if not (math.isfinite(damp) and damp >= 0):
        raise ValueError(f"`damp` must be finite and >= 0, got damp={damp!r}.")
    if check_int("block_size", block_size) < 1:
        raise ValueError(f"`block_size` must be >= 1, got block_size={block_size}.")


def gptq_quantize(
    weight: Float[Array, "out in"],
    hessian: Float[Array, "rows cols"],
    qmin: int,
    qmax: int,
    *,
    group_size: int | None = None,
    act_order: bool = False,
    damp: float = 0.01,
    block_size: int = 128,
) -> tuple[Int[Array, "out in"], Float[Array, "out groups"]]:
    """Quantizes a linear layer's weight with GPTQ.

    For `y = W x`, the columns of `W` (one per input feature) are quantized one after another on the symmetric grid
    `[qmin, qmax]`; the rounding error of column `i`, divided by `U[i, i]`, is subtracted from every later column `j`
    in proportion to `U[i, j]`, where `U` is the upper Cholesky factor of `H⁻¹`. This minimises, column by column,
    the output error `‖W X - Ŵ X‖²` over the calibration inputs, whose second moment is the Hessian
    `H = 2 Σ x xᵀ` (any positive multiple of it gives the same result).

    Before inverting: input features that never vary (`H[i, i] = 0`) get `H[i, i] = 1` and a zero weight column,
    and `damp * mean(diag(H))` is added to the diagonal.

    Scales are those of [`eqx_quant.DynamicFakeQuant`][]'s symmetric scale (`absmax_scale`), and levels are rounded
    with [`eqx_quant.fake_quant`][]'s arithmetic, so that the fake quantizer with these scales reproduces the levels
    exactly from `scale * levels`:

    - per output row (`group_size=None`): from the original row;
    - per group of `group_size` input columns: from the group's columns as the error feedback has left them when the
        first of them is reached; with `act_order`, from the original weight instead (static groups), so that every
        group is fixed before the columns are visited out of order and the groups stay contiguous in the original
        column order.

    Columns are processed in blocks of `block_size`: the errors of a block's columns reach the later columns of the
    same block at once, and the columns after the block in one matrix product when the block is done (GPTQ's lazy
    batch updates). The block size changes the order of the floating-point sums only, not the algorithm. With lazy
    groups, blocks are shortened so that no group straddles two of them: to a multiple of `group_size` when
    `group_size <= block_size`, else to the largest divisor of `group_size` that is at most `block_size`.

    **Arguments:**

    - `weight`: the weight, shape `(out_features, in_features)`.
    - `hessian`: `Σ x xᵀ` (times any positive constant) over the layer's calibration inputs, shape
        `(in_features, in_features)`.
    - `qmin`, `qmax`: the integer grid, Python ints with `qmin <= 0 < qmax`.
    - `group_size`: `None` for one scale per output row, or the size of the groups of input columns (a divisor of
        `in_features`).
    - `act_order`: visit the columns in order of decreasing `H[i, i]` (the inputs with the most energy first).
    - `damp`: the relative damping of the Hessian's diagonal, `>= 0`.
    - `block_size`: the number of columns updated together, `>= 1`.

    **Returns:**

    `(levels, scale)`: int32 levels of the weight's shape, in the original column order, and float32 scales of shape
    `(out_features, 1)` per row or `(out_features, in_features // group_size)` per group. The quantized weight is
    `scale * levels`, the scales repeated over each group.

    **Raises:**

    `TypeError` for non-floating `weight` or `hessian`, or arguments of the wrong type; `ValueError` for shapes that
    do not fit, a grid without 0 or positive levels, a `group_size` that does not divide `in_features`, a negative or
    non-finite `damp` or a `block_size` below 1.

    !!! note

        The computation is in float32, or in float64 when `weight` or `hessian` is float64 (with `jax_enable_x64`).
        It is a function of arrays with static settings: it runs under `jax.jit` and maps with `jax.vmap` over
        stacked layers (with the same results as layer by layer). A Hessian that is not positive definite after
        damping (`damp=0` with fewer calibration inputs than features) gives NaN scales or levels that are not
        meaningful: it is not checked, since its values are not known under `jax.jit`.
    """
    qmin, qmax = check_range(qmin, qmax)
    weight, hessian = jnp.asarray(weight), jnp.asarray(hessian)
    _check(weight, hessian, qmin, qmax, group_size, act_order, damp, block_size)
    group_size = None if group_size is None else int(group_size)
    return _gptq(weight, hessian, qmin, qmax, group_size, act_order, float(damp), int(block_size))


def _block_length(n: int, group_size: int | None, lazy_groups: bool, block_size: int) -> int:
    """The columns per block: `block_size` (at most `n`), or with lazy groups the nearest length at most
    `block_size` such that every group lies within one block (a multiple of the group size, or a divisor of it)."""
    if not lazy_groups:
        return min(block_size, n)
    assert group_size is not None
    if group_size <= block_size:
        return min(block_size // group_size * group_size, n)
    return max(d for d in range(1, block_size + 1) if group_size % d == 0)


@functools.partial(jax.jit, static_argnums=(2, 3, 4, 5, 6, 7))
def _gptq(weight, hessian, qmin, qmax, group_size, act_order, damp, block_size):
    wide = weight.dtype == jnp.float64 or hessian.dtype == jnp.float64
    dtype = jnp.float64 if wide else jnp.float32
    w, h = weight.astype(dtype), hessian.astype(dtype)
    out, n = w.shape
    g = n if group_size is None else group_size
    lazy = group_size is not None and not act_order  # group scales taken when the first column is reached
    highest = jax.lax.Precision.HIGHEST

    dead = jnp.diagonal(h) == 0
    h = jnp.where(jnp.diag(dead), 1.0, h)
    w = jnp.where(dead[None, :], 0.0, w)
    order = jnp.argsort(-jnp.diagonal(h), stable=True) if act_order else jnp.arange(n)
    h = h[order][:, order]
    h = h + damp * jnp.mean(jnp.diagonal(h)) * jnp.eye(n, dtype=dtype)
    # U: the upper Cholesky factor of H⁻¹.
    lower = jnp.linalg.cholesky(h)
    h_inv = jax.scipy.linalg.cho_solve((lower, True), jnp.eye(n, dtype=dtype))
    u = jnp.linalg.cholesky(h_inv).T

    def group_scales(w_cols):  # the symmetric scale of each row of a block of columns
        return absmax_scale(finite_absmax(w_cols, (1,)), qmin, qmax)[:, 0]

    # Every group's scale from the original weight; lazy groups are refreshed from the updated weights in the loop.
    scales = jax.vmap(group_scales, in_axes=1, out_axes=1)(w.reshape(out, n // g, g))
    w = w[:, order]

    # Padding to whole blocks: zero weight columns, with their own unit diagonal in `U` (no error reaches them or
    # leaves them), and their own scales (lazy groups write theirs), cut off at the end.
    length = _block_length(n, group_size, lazy, block_size)
    blocks = -(-n // length)
    padded = blocks * length
    extra = padded - n
    w = jnp.pad(w, ((0, 0), (0, extra)))
    u = jnp.pad(u, ((0, extra), (0, extra))) + jnp.diag((jnp.arange(padded) >= n).astype(dtype))
    group_of = jnp.concatenate([order, jnp.arange(n, padded)]) // g  # the scale column of each processed column
    scales = jnp.pad(scales, ((0, 0), (0, -(-padded // g) - n // g)), constant_values=1.0)
    # Within a block, a segment starts at each lazy group's first column (with groups within blocks).
    segment = g if lazy and g <= length else length
    positions = jnp.arange(length)
    columns = jnp.arange(padded)

    def block(b, carry):
        w, scales, levels = carry
        start = b * length
        if lazy and g > length:  # a group starts at this block (its columns are all up to date)
            fresh = group_scales(jax.lax.dynamic_slice_in_dim(w, start, g, axis=1))
            refreshed = jax.lax.dynamic_update_index_in_dim(scales, fresh, start // g, axis=1)
            scales = jnp.where(start % g == 0, refreshed, scales)
        wb = jax.lax.dynamic_slice_in_dim(w, start, length, axis=1)
        ub = jax.lax.dynamic_slice(u, (start, start), (length, length))
        groups = jax.lax.dynamic_slice_in_dim(group_of, start, length)

        def run_segment(t, inner):
            wb, errors, qb, scales = inner
            if lazy and g <= length:  # a group starts here, within this block
                fresh = group_scales(jax.lax.dynamic_slice_in_dim(wb, t * segment, g, axis=1))
                scales = jax.lax.dynamic_update_index_in_dim(scales, fresh, (start + t * segment) // g, axis=1)

            def column(c, inner):
                wb, errors, qb = inner
                k = t * segment + c
                s = jax.lax.dynamic_index_in_dim(scales, groups[k], axis=1, keepdims=False).astype(dtype)
                col = jax.lax.dynamic_index_in_dim(wb, k, axis=1, keepdims=False)
                q = quantize_levels(col, s, None, qmin, qmax)
                err = (col - dequantize_levels(q, s, None)) / ub[k, k]
                row = jnp.where(positions > k, ub[k], 0.0)
                wb = wb - err[:, None] * row[None, :]
                errors = jax.lax.dynamic_update_index_in_dim(errors, err, k, axis=1)
                qb = jax.lax.dynamic_update_index_in_dim(qb, q.astype(jnp.int32), k, axis=1)
                return wb, errors, qb

            wb, errors, qb = jax.lax.fori_loop(0, segment, column, (wb, errors, qb))
            return wb, errors, qb, scales

        errors = jnp.zeros((out, length), dtype)
        qb = jnp.zeros((out, length), jnp.int32)
        _, errors, qb, scales = jax.lax.fori_loop(0, length // segment, run_segment, (wb, errors, qb, scales))
        # The block's errors reach the columns after it at once.
        rows = jax.lax.dynamic_slice_in_dim(u, start, length, axis=0)
        rows = jnp.where(columns[None, :] >= start + length, rows, 0.0)
        w = w - jnp.matmul(errors, rows, precision=highest)
        levels = jax.lax.dynamic_update_slice_in_dim(levels, qb, start, axis=1)
        return w, scales, levels

    levels = jnp.zeros((out, padded), jnp.int32)
    _, scales, levels = jax.lax.fori_loop(0, blocks, block, (w, scales, levels))
    levels = levels[:, :n][:, jnp.argsort(order)]
    return levels, scales[:, : n // g].astype(jnp.float32)


def _gptq_grid(path: str, quantizer: object) -> tuple[int, int, int | None]:
    """`(qmin, qmax, group_size)` of a weight quantizer that GPTQ can stand in for, or a `ValueError` naming the
    layer: symmetric, with one scale per output row (`axis=0`) or per group of input columns."""
    symmetric = (
        (isinstance(quantizer, DynamicFakeQuant) and quantizer.symmetric)
        or (isinstance(quantizer, FakeQuant) and quantizer.zero_point == 0)
        or (isinstance(quantizer, LearnedFakeQuant) and quantizer.zero_point is None)
    )
    layout = getattr(quantizer, "layout", None)
    per_row = layout is not None and layout.axes in ((0,), (-2,)) and layout.group_size is None
    per_group = layout is not None and layout.axes == () and layout.group_size is not None
    if not symmetric or not (per_row or per_group) or not quantizer.qmin <= 0 < quantizer.qmax:  # pyright: ignore
        raise ValueError(
            f"Layer {path!r} has weight quantizer {quantizer!r}; GPTQ needs a symmetric one (DynamicFakeQuant, or a "
            "FakeQuant / LearnedFakeQuant with zero point 0) with one scale per output row (axis=0) or per group "
            "(group_size), on a grid holding 0 and positive levels. Exclude the layer with `where`."
        )
    return quantizer.qmin, quantizer.qmax, layout.group_size  # pyright: ignore


def gptq(
    model: PyTree,
    batches: Iterable[PyTree],
    *,
    damp: float = 0.01,
    act_order: bool = False,
    batched: bool = False,
    where: Callable[[str, eqx.Module], bool] | None = None,
) -> PyTree:
    """Post-training quantization of a model's linear weights with GPTQ ([`eqx_quant.gptq_quantize`][]).

    Every [`eqx_quant.nn.QuantLinear`][] with a weight quantizer (or those `where` selects) gets its weight replaced
    by GPTQ's quantized weight `scale * levels`, on the grid and layout of its weight quantizer (which must be
    symmetric, per output row or per group), and its weight quantizer replaced by a fixed one with GPTQ's scales: a
    static [`eqx_quant.FakeQuant`][], or for stacked layers (built with `eqx.filter_vmap`, run with `jax.lax.scan`)
    a [`eqx_quant.LearnedFakeQuant`][] holding one set of scales per layer. The fake-quant forward then computes
    exactly with GPTQ's integers, and [`eqx_quant.convert`][] stores them. Biases, input quantizers and other layers
    are unchanged.

    The Hessian of each layer is `Σ x xᵀ` over the inputs the layer sees when the model runs on `batches` with its
    weight quantizers active and the chosen layers' input quantizers bypassed (all layers from one pass: layers are not
    re-run one after another on the outputs of already-GPTQ-quantized ones). It is collected like
    [`eqx_quant.calibrate`][]'s statistics, so that layers inside the model's own `jax.vmap` and `jax.lax.scan` are
    seen, one Hessian per layer of a stack.

    **Arguments:**

    - `model`: a model from [`eqx_quant.quantize`][] whose linear weight quantizers are symmetric per-row or
        per-group (e.g. `DynamicFakeQuant(4, group_size=32)`).
    - `batches`: an iterable of calibration inputs with a leading batch axis, as for [`eqx_quant.calibrate`][].
    - `damp`, `act_order`: as for [`eqx_quant.gptq_quantize`][].
    - `batched`: as for [`eqx_quant.calibrate`][].
    - `where`: a predicate `f(path, layer)` choosing the layers, or `None` for every `QuantLinear` with a weight
        quantizer.

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
    # The observers stand in for the input quantizers: the layers see float inputs, as GPTQ's Hessian assumes.
    grams = fold(model, layers, batches, batched, "gram")

    def replace(path: str, layer: QuantLinear) -> QuantLinear:
        if path not in grids:
            return layer
        if path not in grams:
            raise ValueError(f"Layer {path!r} was never called on the calibration batches.")
        qmin, qmax, group_size = grids[path]
        weight = layer.layer.weight
        stack = layer_stack(layer)
        hessian = jnp.asarray(np.stack([record["gram"] for record in grams[path]]))
        hessian = hessian.reshape(stack + hessian.shape[1:])
        solve = functools.partial(
            gptq_quantize, qmin=qmin, qmax=qmax, group_size=group_size, act_order=act_order, damp=damp
        )
        for _ in stack:
            solve = jax.vmap(solve)
        levels, scales = solve(weight, hessian)
        g = weight.shape[-1] if group_size is None else group_size
        repeated = jnp.repeat(scales, g, axis=-1)
        new_weight = dequantize_levels(levels.astype(jnp.float32), repeated, None).astype(weight.dtype)
        compact = scales[..., 0] if group_size is None else scales
        axis = 0 if group_size is None else None
        if not stack:
            quantizer = FakeQuant(np.asarray(compact), qmin, qmax, axis=axis, group_size=group_size)
        else:
            make = lambda s: LearnedFakeQuant(s, qmin, qmax, axis=axis, group_size=group_size, min_scale=FLOAT32_TINY)  # noqa: E731
            quantizer = per_layer(make, len(stack))(compact)
        return eqx.tree_at(lambda l: (l.layer.weight, l.weight_quant), layer, (new_weight, quantizer))

    return map_nodes(model, (QuantLinear,), replace)
