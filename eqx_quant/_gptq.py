"""GPTQ (Frantar et al., ICLR 2023): quantizing a linear layer's weight column by column, each column's rounding
error fed back into the columns not yet quantized through the inverse Hessian of the layer's inputs."""

import functools
import math
import numbers
from typing import Literal

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Shaped

from ._format import Format, IntFormat, apply_scale, as_format, check_range, effective_scale, reciprocal
from ._misc import check_int, first_where
from ._scales import (
    Scales,
    absmax_scale,
    block_absmax,
    block_scale,
    e8m0_scale,
    finite_absmax,
    ggml_scale,
    least_error_scale,
    tensor_scale_of,
)


def _check(
    weight: Array,
    hessian: Array,
    fmt: Format,
    group_size: object,
    act_order: object,
    damp: object,
    block_size: object,
    method: object = "absmax",
    num_candidates: object = 100,
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
    if isinstance(fmt, IntFormat) and not (fmt.qmin <= 0 < fmt.qmax):
        raise ValueError(
            f"GPTQ quantizes symmetrically: the grid needs `qmin` <= 0 < `qmax`, got qmin={fmt.qmin} and "
            f"qmax={fmt.qmax}."
        )
    if fmt.scale != "float32" and group_size is None:
        raise ValueError(f"{fmt.name} has block scales: `group_size` must be its block size, got None.")
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
    check_scale_method(method, num_candidates, fmt)


def _check_values(weight: Array, hessian: Array) -> None:
    """Raises for concrete values GPTQ cannot solve with: a non-finite weight or Hessian entry, a negative diagonal
    entry of the Hessian (no second moment has one) or a zero Hessian (which would zero the whole weight)."""
    concrete = {name: np.asarray(a) for name, a in (("weight", weight), ("hessian", hessian))
                if not isinstance(a, jax.core.Tracer)}  # fmt: skip
    for name, values in concrete.items():
        index = first_where(~np.isfinite(values))
        if index is not None:
            raise ValueError(f"`{name}` must be finite, got {values[index]} at index {index}.")
    if "hessian" not in concrete:
        return
    diagonal = np.diagonal(concrete["hessian"])
    if (diagonal < 0).any():
        i = int(np.argmax(diagonal < 0))
        raise ValueError(
            f"`hessian` must be a second moment `Σ x xᵀ`, whose diagonal is >= 0, got {diagonal[i]} at index "
            f"({i}, {i})."
        )
    if not diagonal.any():
        raise ValueError(
            "`hessian` is zero (the calibration inputs were all zero): GPTQ would set every weight to zero."
        )


def check_scale_method(method: object, num_candidates: object, fmt: Format | None = None) -> None:
    """Raises for a GPTQ scale `method` other than `"absmax"` and `"mse"`, a `num_candidates` below 1, or (given
    `fmt`) `"mse"` on a format whose scales follow a block rule."""
    if method not in ("absmax", "mse"):
        raise ValueError(f"`method` must be 'absmax' or 'mse', got method={method!r}.")
    if check_int("num_candidates", num_candidates) < 1:
        raise ValueError(f"`num_candidates` must be >= 1, got num_candidates={num_candidates}.")
    if fmt is not None and method == "mse" and fmt.scale != "float32":
        raise ValueError(
            f"`method='mse'` searches float32 scales, and {fmt.name} sets its block scales by its own rule: use "
            "method='absmax'."
        )


def gptq_quantize(
    weight: Float[Array, "out in"],
    hessian: Float[Array, "rows cols"],
    qmin: int | None = None,
    qmax: int | None = None,
    *,
    format: Format | str | None = None,
    group_size: int | None = None,
    act_order: bool = False,
    damp: float = 0.01,
    block_size: int = 128,
    method: Literal["absmax", "mse"] = "absmax",
    num_candidates: int = 100,
) -> tuple[Shaped[Array, "out in"], Float[Array, "out groups"]]:
    """Quantizes a linear layer's weight with GPTQ.

    For `y = W x`, the columns of `W` (one per input feature) are quantized one after another on the symmetric grid
    `[qmin, qmax]` (or onto the grid of `format`: an FP8, FP6 or FP4 element type, an MX format, NVFP4 or a GGML
    format, whose rounding is as exact as an integer's); the rounding error of column `i`, divided by `U[i, i]`, is
    subtracted from every later column `j` in proportion to `U[i, j]`, where `U` is the upper Cholesky factor of
    `H⁻¹`. This minimises, column by column, the output error `‖W X - Ŵ X‖²` over the calibration inputs, whose
    second moment is the Hessian `H = 2 Σ x xᵀ` (any positive multiple of it gives the same result).

    Before inverting: input features that never vary (`H[i, i] = 0`) get `H[i, i] = 1` and a zero weight column,
    and `damp * mean(diag(H))` is added to the diagonal.

    Scales are those of [`eqx_quant.DynamicFakeQuant`][]'s symmetric scale (`absmax_scale`; the block rule of an MX
    format; NVFP4's block scales under the tensor scale of the whole original weight; GGML's `d` of a block), and
    levels are rounded with [`eqx_quant.fake_quant_format`][]'s arithmetic, so that the fake quantizer with these
    scales reproduces the levels exactly from `scale * levels`:

    - per output row (`group_size=None`): from the original row;
    - per group of `group_size` input columns: from the group's columns as the error feedback has left them when the
        first of them is reached; with `act_order`, from the original weight instead (static groups), so that every
        group is fixed before the columns are visited out of order and the groups stay contiguous in the original
        column order.

    With `method="mse"` (float32-scaled formats), each of these scales clips instead: of the thresholds
    `k / num_candidates` of the row's (or group's) largest magnitude, `k = 1 ... num_candidates`, it takes the one
    whose rounding to nearest errs least on those weights, each squared error weighted by its column's `H[i, i]`
    (the diagonal of the output error `(w - q)ᵀ H (w - q)`): the weights beyond it saturate, and the rest get a
    finer grid. Ties go to the smallest threshold. The search itself runs in float32 (as the scales are), also
    when the rest is in float64.

    Columns are processed in blocks of `block_size`: the errors of a block's columns reach the later columns of the
    same block at once, and the columns after the block in one matrix product when the block is done (GPTQ's lazy
    batch updates). The block size changes the order of the floating-point sums only, not the algorithm. With lazy
    groups, blocks are shortened so that no group straddles two of them: to a multiple of `group_size` when
    `group_size <= block_size`, else to the largest divisor of `group_size` that is at most `block_size`.

    **Arguments:**

    - `weight`: the weight, shape `(out_features, in_features)`.
    - `hessian`: `Σ x xᵀ` (times any positive constant) over the layer's calibration inputs, shape
        `(in_features, in_features)`.
    - `qmin`, `qmax`: the integer grid, Python ints with `qmin <= 0 < qmax`; or, instead of them,
    - `format`: a [`eqx_quant.Format`][] or its name (float32-scaled, MX, NVFP4, or GGML's `"q8_0"`, `"q4_0"`,
        `"q5_0"` with `group_size=32`).
    - `group_size`: `None` for one scale per output row, or the size of the groups of input columns (a divisor of
        `in_features`); the block size of an MX format or NVFP4.
    - `act_order`: visit the columns in order of decreasing `H[i, i]` (the inputs with the most energy first).
    - `damp`: the relative damping of the Hessian's diagonal, `>= 0`.
    - `block_size`: the number of columns updated together, `>= 1`.
    - `method`: `"absmax"` (the scale of the largest magnitude) or `"mse"` (the clipping search above).
    - `num_candidates`: the number of thresholds `method="mse"` tries, `>= 1`.

    **Returns:**

    `(levels, scale)`: levels of the weight's shape, in the original column order (int32 integers, or the float
    format's element values), and float32 scales of shape `(out_features, 1)` per row or
    `(out_features, in_features // group_size)` per group (MX: the powers of two, `2**-127` as 0; NVFP4: the block
    scale times the tensor scale). The quantized weight is `scale * levels`, the scales repeated over each group.

    **Raises:**

    `TypeError` for non-floating `weight` or `hessian`, or arguments of the wrong type; `ValueError` for shapes that
    do not fit, a NaN or infinite entry of `weight` or `hessian`, a negative diagonal entry of `hessian` or a zero
    `hessian` (values checked where they are known, outside `jax.jit` and `jax.vmap`), a grid without 0 or positive
    levels, a `group_size` that does not divide `in_features`, a negative or non-finite `damp`, a `block_size`
    below 1, a `method` other than `"absmax"` and `"mse"` (or `"mse"` on a format with block scales) or a
    `num_candidates` below 1.

    !!! note

        The computation is in float32, or in float64 when `weight` or `hessian` is float64 (with `jax_enable_x64`).
        It is a function of arrays with static settings: it runs under `jax.jit` and maps with `jax.vmap` over
        stacked layers (with the same results as layer by layer). A Hessian that is not positive definite after
        damping (`damp=0` with fewer calibration inputs than features) gives NaN scales or levels that are not
        meaningful: it is not checked, since its values are not known under `jax.jit`.
    """
    if format is None:
        if qmin is None or qmax is None:
            raise ValueError("`qmin` and `qmax` (an integer grid) or `format` is needed.")
        fmt: Format = IntFormat(*check_range(qmin, qmax))
    elif qmin is not None or qmax is not None:
        raise ValueError(f"Give `qmin` and `qmax` or `format`, not both: got format={format!r}, qmin={qmin!r}.")
    else:
        fmt = as_format(format)
    weight, hessian = jnp.asarray(weight), jnp.asarray(hessian)
    # Values checked here, for direct callers: the model's solvers check theirs first and call `gptq_solve`.
    _check(weight, hessian, fmt, group_size, act_order, damp, block_size, method, num_candidates)
    _check_values(weight, hessian)
    levels, scales = gptq_solve(weight, hessian, fmt, group_size, act_order, damp, block_size, method, num_candidates)
    return levels, effective_scale(scales.scale, scales.tensor_scale)


def gptq_solve(
    weight: Array,
    hessian: Array,
    fmt: Format,
    group_size: object = None,
    act_order: object = False,
    damp: object = 0.01,
    block_size: object = 128,
    method: object = "absmax",
    num_candidates: object = 100,
) -> tuple[Array, Scales]:
    """[`eqx_quant.gptq_quantize`][] onto `fmt`, with the scales as the format holds them: `(levels, scales)`, the
    scales of shape `(out_features, groups)` and the tensor scale of a two-level format apart."""
    weight, hessian = jnp.asarray(weight), jnp.asarray(hessian)
    _check(weight, hessian, fmt, group_size, act_order, damp, block_size, method, num_candidates)
    group_size = None if group_size is None else int(group_size)  # pyright: ignore[reportArgumentType]
    candidates = int(num_candidates) if method == "mse" else None  # pyright: ignore[reportArgumentType]
    return _gptq(weight, hessian, fmt, group_size, act_order, float(damp), int(block_size), candidates)  # pyright: ignore


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
def _gptq(weight, hessian, fmt, group_size, act_order, damp, block_size, candidates):
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
    energy = jnp.diagonal(h)  # weighs the clipping search's squared errors, in the original column order
    order = jnp.argsort(-jnp.diagonal(h), stable=True) if act_order else jnp.arange(n)
    h = h[order][:, order]
    h = h + damp * jnp.mean(jnp.diagonal(h)) * jnp.eye(n, dtype=dtype)
    # U: the upper Cholesky factor of H⁻¹.
    lower = jnp.linalg.cholesky(h)
    h_inv = jax.scipy.linalg.cho_solve((lower, True), jnp.eye(n, dtype=dtype))
    u = jnp.linalg.cholesky(h_inv).T

    # NVFP4's tensor scale, of the whole original weight; the block scales under it are fixed like the others.
    ts = tensor_scale_of(block_absmax(w.reshape(out, n // g, g), 2)[0], fmt) if fmt.scale == "e4m3" else None

    def group_scales(w_cols, h_cols, search=True):  # each row's symmetric scale over columns of energies h_cols
        if fmt.scale == "float32":
            absmax = finite_absmax(w_cols, (1,))
            if candidates is None or not search:
                return absmax_scale(absmax, fmt)[:, 0]
            weights = (h_cols / jnp.max(h_cols)).astype(jnp.float32)[None, :]  # relative: no overflow, no underflow
            f32 = w_cols.astype(jnp.float32)
            return least_error_scale(f32, weights, absmax.astype(jnp.float32), (1,), fmt, candidates)[:, 0]
        amax = block_absmax(w_cols, 1)[0]
        if fmt.scale == "float16":  # GGML's `d`, from the block's values
            assert isinstance(fmt, IntFormat)
            return ggml_scale(w_cols, amax, 1, fmt)[:, 0]
        return (e8m0_scale(amax, fmt) if fmt.scale == "e8m0" else block_scale(amax, ts, fmt))[:, 0]

    # Every group's scale from the original weight; lazy groups are refreshed from the updated weights in the loop
    # (their clipping searched there only).
    initial = functools.partial(group_scales, search=not lazy)
    scales = jax.vmap(initial, in_axes=(1, 0), out_axes=1)(w.reshape(out, n // g, g), energy.reshape(n // g, g))
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
    # Lazy groups run in the original column order, and lie within the unpadded columns.
    energy_of = lambda first: jax.lax.dynamic_slice_in_dim(energy, first, g)  # noqa: E731

    def block(b, carry):
        w, scales, levels = carry
        start = b * length
        if lazy and g > length:  # a group starts at this block (its columns are all up to date)

            def refresh(scales):
                fresh = group_scales(jax.lax.dynamic_slice_in_dim(w, start, g, axis=1), energy_of(start))
                return jax.lax.dynamic_update_index_in_dim(scales, fresh, start // g, axis=1)

            scales = jax.lax.cond(start % g == 0, refresh, lambda scales: scales, scales)
        wb = jax.lax.dynamic_slice_in_dim(w, start, length, axis=1)
        ub = jax.lax.dynamic_slice(u, (start, start), (length, length))
        groups = jax.lax.dynamic_slice_in_dim(group_of, start, length)

        def run_segment(t, inner):
            wb, errors, qb, scales = inner
            if lazy and g <= length:  # a group starts here, within this block
                first = t * segment
                fresh = group_scales(jax.lax.dynamic_slice_in_dim(wb, first, g, axis=1), energy_of(start + first))
                scales = jax.lax.dynamic_update_index_in_dim(scales, fresh, (start + first) // g, axis=1)

            def column(c, inner):
                wb, errors, qb = inner
                k = t * segment + c
                s = jax.lax.dynamic_index_in_dim(scales, groups[k], axis=1, keepdims=False).astype(dtype)
                col = jax.lax.dynamic_index_in_dim(wb, k, axis=1, keepdims=False)
                q = fmt.levels(col * reciprocal(fmt, s, ts, 1), None)
                err = (col - apply_scale(fmt, q, s, ts)) / ub[k, k]
                row = jnp.where(positions > k, ub[k], 0.0)
                wb = wb - err[:, None] * row[None, :]
                errors = jax.lax.dynamic_update_index_in_dim(errors, err, k, axis=1)
                qb = jax.lax.dynamic_update_index_in_dim(qb, q.astype(level_dtype), k, axis=1)
                return wb, errors, qb

            wb, errors, qb = jax.lax.fori_loop(0, segment, column, (wb, errors, qb))
            return wb, errors, qb, scales

        errors = jnp.zeros((out, length), dtype)
        qb = jnp.zeros((out, length), level_dtype)
        _, errors, qb, scales = jax.lax.fori_loop(0, length // segment, run_segment, (wb, errors, qb, scales))
        # The block's errors reach the columns after it at once.
        rows = jax.lax.dynamic_slice_in_dim(u, start, length, axis=0)
        rows = jnp.where(columns[None, :] >= start + length, rows, 0.0)
        w = w - jnp.matmul(errors, rows, precision=highest)
        levels = jax.lax.dynamic_update_slice_in_dim(levels, qb, start, axis=1)
        return w, scales, levels

    level_dtype = jnp.int32 if isinstance(fmt, IntFormat) else dtype
    levels = jnp.zeros((out, padded), level_dtype)
    _, scales, levels = jax.lax.fori_loop(0, blocks, block, (w, scales, levels))
    levels = levels[:, :n][:, jnp.argsort(order)]
    return levels, Scales(scales[:, : n // g].astype(jnp.float32), None, None if ts is None else ts.astype(jnp.float32))
