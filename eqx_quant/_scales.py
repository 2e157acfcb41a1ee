"""Fitting scales for any format and layout, shared by calibration (of a quantizer on data, or of a model's
activations from histograms), GPTQ and the dynamic quantizers (traced): each method is written once here.

Every function here is written with `jax.numpy`, so that a scale computed once at calibration time and a scale
computed at every call of a dynamic quantizer come out of the same arithmetic. Statistics of float32 scales are
float32; the block scales of the MX formats and NVFP4 are computed in the compute dtype of the data.
"""

import functools
import math
from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float

from ._format import E4M3, Format, IntFormat, apply_scale, divide, exponent, pow2, reciprocal
from ._misc import FLOAT32_TINY, AxisName, across_shards, check_int, expand_to_rank


class Scales(NamedTuple):
    """The scales of one call of a quantizer, broadcasting against the view of its input: `scale`, the zero point
    of an integer grid (`None` for 0) and the float32 tensor scale of two-level formats (`None` otherwise)."""

    scale: Array
    zero_point: Array | None = None
    tensor_scale: Array | None = None


_HUGE = 1 / FLOAT32_TINY  # 2**126: the largest scale whose reciprocal is a normal float32 (a larger one's flushes to 0)
_NUDGES = 4  # at most two are ever needed in float32; see `absmax_scale`


def _lands_inside(x: Array, scale: Array, zero_point: Array, fmt: Format) -> Array:
    """Whether `x / scale + zero_point` lies in the grid of `fmt`, with the arithmetic of `fake_quant`'s mask."""
    v = expand_to_rank(x, scale.ndim) * reciprocal(fmt, scale, None, scale.ndim)
    low, high = fmt.limits(zero_point, v.ndim)
    return (v >= low) & (v <= high)


def _first_fitting(scale: Array, fits: Callable[[Array], Array]) -> Array:
    """The first of `scale` and the `_NUDGES` float32 values above it for which `fits` holds (else the last of them).

    This is the loop `scale = where(fits(scale), scale, nextafter(scale, inf))` run `_NUDGES` times, written so that
    XLA compiles it into one small kernel: `fits` is called once, on every candidate at once, stacked along a new
    leading axis (to whose rank it must expand its other operands). `fits` must be monotone (once true, true for
    every larger scale), so that the number of candidates that do not fit is the number of steps up. For positive
    floats the order of the bit patterns is the order of the values: the `k`-th float above `scale` is its bit
    pattern plus `k`. `scale` must be positive and at most `2**126` (or NaN, which stays NaN), so that the candidates
    stay far below infinity.
    """
    scale_bits = jax.lax.bitcast_convert_type(scale, jnp.int32)
    # An iota, not a constant array: computed from nothing, it keeps a value computed from a layer's arrays alone a
    # value of theirs where `quantize` traces products (a constant array would make it an activation).
    k = jax.lax.broadcasted_iota(jnp.int32, (_NUDGES,) + (1,) * scale.ndim, 0)
    candidates = jax.lax.bitcast_convert_type(expand_to_rank(scale_bits, k.ndim) + k, jnp.float32)
    steps = jnp.sum(~fits(candidates), axis=0, dtype=jnp.int32)
    return jax.lax.bitcast_convert_type(scale_bits + steps, jnp.float32)


@functools.cache
def largest_scale(largest_level: int | float) -> float:
    """The largest scale, at most `2**126` (whose reciprocal is the last normal float32), that maps `largest_level`
    to a finite float32: larger scales would make the reciprocal or the dequantized value unusable."""
    level, top = np.float32(largest_level), np.float32(_HUGE)
    scale = min(np.float32(float(np.finfo(np.float32).max) / max(largest_level, 1)), top)  # within an ulp or two
    with np.errstate(over="ignore"):
        while not np.isfinite(scale * level):
            scale = np.nextafter(scale, np.float32(0))
        while scale < top and np.isfinite(np.nextafter(scale, top) * level):
            scale = np.nextafter(scale, top)
    return float(scale)


def _fitted(scale: Array, fits: Callable[[Array], Array], largest_level: int | float) -> Array:
    """`_first_fitting` of `scale` floored at the smallest normal float32 and capped at `largest_scale(largest_level)`
    (NaN stays NaN): bounded first, so that the steps start from a scale that `_first_fitting` takes, and capped again
    after them (steps up from below the cap end at the cap, as they would have from above it)."""
    cap = jnp.float32(largest_scale(largest_level))
    scale = jax.lax.min(jax.lax.max(scale, jnp.float32(FLOAT32_TINY)), cap)
    return jax.lax.min(_first_fitting(scale, fits), cap)


def absmax_scale(absmax: Float[Array, "*c"], fmt: Format) -> Float[Array, "*c"]:
    """The symmetric float32 scale `absmax / bound`, nudged up by ulps until `absmax / scale <= bound` holds in
    float32.

    `bound` is [`eqx_quant.Format.bound`][]: the grid's `qmax` when it is positive, or the largest value of a float
    format. A plain `absmax / bound` puts `absmax` one ulp above `bound` about one time in seven, which clips the
    largest value and zeroes its gradient. Scales are floored at the smallest normal float32, so an all-zero tensor
    gets a valid scale and quantizes to exact zeros, and capped where a larger one would make its reciprocal
    subnormal or a grid point's value overflow (see `largest_scale`): on grids of 3 bits or fewer, magnitudes above
    about `bound * 2**126` (`8.5e37` for 2 bits) then saturate instead of making the scale unusable.
    """
    bound = fmt.bound
    absmax = absmax.astype(jnp.float32)
    fits = lambda s: expand_to_rank(absmax, s.ndim) * (1 / s) <= bound  # noqa: E731
    return _fitted(absmax * (1.0 / bound), fits, fmt.largest)


def minmax_scale(
    lo: Float[Array, "*c"], hi: Float[Array, "*c"], fmt: IntFormat
) -> tuple[Float[Array, "*c"], Float[Array, "*c"]]:
    """An asymmetric `(scale, zero_point)` whose grid covers `[min(lo, 0), max(hi, 0)]`.

    The zero point is an integer in `[qmin, qmax]`, so that real 0 is exactly representable. Of the two integers
    next to the ideal (fractional) zero point, the one that needs the smaller scale to keep both ends inside the range
    is taken; then the scale is nudged up by ulps until both ends land inside with `fake_quant`'s arithmetic. It is
    bounded like `absmax_scale`'s.
    """
    qmin, qmax = fmt.qmin, fmt.qmax
    lo = jnp.minimum(lo.astype(jnp.float32), 0.0)
    hi = jnp.maximum(hi.astype(jnp.float32), 0.0)
    width = hi - lo
    degenerate = width == 0
    safe_width = jnp.where(degenerate, 1.0, width)
    # Written without a product feeding a sum, which XLA would contract into a fused multiply-add under `jit` only.
    ideal = qmin - (lo * (qmax - qmin)) / safe_width
    # Past float32's range (`hi - lo` or `lo * (qmax - qmin)` overflows), the same ratio from halved operands.
    half_width = jnp.where(degenerate, 1.0, hi * 0.5 - lo * 0.5)
    ideal = jnp.where(jnp.isfinite(ideal), ideal, qmin - (lo / half_width) * ((qmax - qmin) * 0.5))

    def needed_scale(zp):
        # The smallest scale with lo / scale >= qmin - zp and hi / scale <= qmax - zp.
        below = jnp.where(lo < 0, -lo / jnp.maximum(zp - qmin, 1.0), 0.0)
        above = jnp.where(hi > 0, hi / jnp.maximum(qmax - zp, 1.0), 0.0)
        return jnp.maximum(below, above)

    # A negative `lo` needs a zero point above `qmin`, a positive `hi` one below `qmax` (when the grid has room).
    first = jnp.where(lo < 0, min(qmin + 1, qmax), qmin).astype(jnp.float32)
    last = jnp.maximum(jnp.where(hi > 0, qmax - 1, qmax).astype(jnp.float32), first)
    low_zp = jnp.clip(jnp.floor(ideal), first, last)
    high_zp = jnp.clip(jnp.ceil(ideal), first, last)
    low_scale, high_scale = needed_scale(low_zp), needed_scale(high_zp)
    zero_point = jnp.where(low_scale <= high_scale, low_zp, high_zp)
    scale = jnp.minimum(low_scale, high_scale)
    zero_point = jnp.where(degenerate, float(min(max(0, qmin), qmax)), zero_point)
    scale = jnp.where(degenerate, 0.0, scale)  # floored at the smallest normal by `_fitted`
    fits = lambda s: _lands_inside(lo, s, zero_point, fmt) & _lands_inside(hi, s, zero_point, fmt)  # noqa: E731
    return _fitted(scale, fits, qmax - qmin), zero_point


def finite_or(x: Array, fill: float) -> Array:
    """`x` with its non-finite entries replaced by `fill`, so that statistics ignore NaN and infinity."""
    return jnp.where(jax.lax.is_finite(x), x, jnp.asarray(fill, x.dtype))


def finite_absmax(x: Array, axes: tuple[int, ...]) -> Array:
    """The largest finite `|x|` over `axes` (kept as unit axes; 0 where there is none), in float32, without
    gradient."""
    x = jax.lax.stop_gradient(x).astype(jnp.float32)
    return jnp.max(finite_or(jnp.abs(x), 0.0), axis=axes, keepdims=True, initial=0.0)


def stats(x: Array, axes: tuple[int, ...]) -> tuple[Array, Array, Array]:
    """`(absmax, min, max)` of the finite entries of `x` over `axes` (kept as unit axes), in float32.

    The minimum and maximum include 0 (an empty or all-non-finite slice gives zeros), and no gradient flows
    through them.
    """
    absmax = finite_absmax(x, axes)
    x = jax.lax.stop_gradient(x).astype(jnp.float32)
    lo = jnp.min(finite_or(x, 0.0), axis=axes, keepdims=True, initial=0.0)
    hi = jnp.max(finite_or(x, 0.0), axis=axes, keepdims=True, initial=0.0)
    return absmax, lo, hi


METHODS = ("absmax", "minmax", "percentile", "mse")


def check_method(method: object, percentile: object, num_candidates: object) -> None:
    """Raises for a calibration `method` that is not one of `METHODS`, or a bad parameter of one."""
    if method not in METHODS:
        raise ValueError(f"`method` must be one of {METHODS}, got method={method!r}.")
    if isinstance(percentile, bool) or not isinstance(percentile, (int, float)) or not 0 < percentile <= 100:
        raise ValueError(f"`percentile` must be in (0, 100], got percentile={percentile!r}.")
    if check_int("num_candidates", num_candidates) < 1:
        raise ValueError(f"`num_candidates` must be >= 1, got num_candidates={num_candidates}.")


@functools.partial(jax.jit, static_argnums=(3, 4, 5))
def least_error_scale(
    values: Array, weights: Array | None, absmax: Array, axes: tuple[int, ...], fmt: Format, candidates: int
) -> Array:
    """The `"mse"` method: of the symmetric float32 scales for the clipping thresholds `absmax * k / candidates`
    (`k = 1 ... candidates`), the one with the least squared quantization error of `values` on the grid of `fmt`,
    summed over `axes` (weighted by `weights`, a histogram's counts, unless `None`).

    The error is that of `fake_quant`'s arithmetic. Non-finite values count as zeros. `absmax` has the shape of the
    sums (with unit axes at `axes`), and so does the result. Candidates are tried one after another, so that memory
    stays that of one.
    """
    values = finite_or(values, 0.0)
    # `k / candidates` rounded once, on the host: XLA would multiply by a rounded `1 / candidates` instead.
    fractions = jnp.asarray(np.arange(1, candidates + 1, dtype=np.float32) / np.float32(candidates))
    # Errors in units of `absmax`, so that their squares cannot overflow for data near float32's largest values.
    unit = expand_to_rank(1 / jnp.maximum(absmax, FLOAT32_TINY), values.ndim)

    def error(fraction):
        scale = absmax_scale(absmax * fraction, fmt)
        levels = fmt.levels(values * reciprocal(fmt, scale, None, values.ndim), None)
        squared = ((apply_scale(fmt, levels, scale, None) - values) * unit) ** 2
        return jnp.sum(squared if weights is None else weights * squared, axis=axes, keepdims=True)

    best = fractions[jnp.argmin(jax.lax.map(error, fractions), axis=0)]
    return absmax_scale(absmax * best, fmt)


#
# Block scales: the E8M0 scales of the MX formats and NVFP4's two levels, from the blocks of a view.
#


def block_absmax(view: Array, axis: int) -> tuple[Array, Array]:
    """Per block (along `axis` of the view, kept as a unit axis): the largest finite `|x|` (0 if none), in the
    compute dtype, and whether the block holds a NaN or an inf."""
    finite = jnp.isfinite(view)
    amax = jnp.max(jnp.where(finite, jnp.abs(view), jnp.zeros((), view.dtype)), axis=axis, keepdims=True)
    return amax, ~jnp.all(finite, axis=axis, keepdims=True)


def e8m0_scale(amax: Array, fmt: Format) -> Array:
    """The power-of-two scale `2**e` of blocks whose largest magnitude is `amax`, `e` clamped to [-127, 127] (held as
    0 for `2**-127`, which float32 has only as a subnormal).

    With `M` the format's largest value and `e_max` its exponent: `"floor"` (the MX specification's rule) takes
    `e = floor(log2(amax)) - e_max`, `"rceil"` the smallest `e` with `amax <= M * 2**e`. Both are read exactly from the
    bits of `amax`: with `amax = m_a * 2**k` and `M = m_M * 2**e_max` (mantissas in [1, 2)), `ceil(log2(amax / M))` is
    `k - e_max`, plus one when `m_a > m_M`. Zero and subnormal `amax` land far below the clamp.
    """
    k = exponent(amax)
    emax = math.frexp(fmt.largest)[1] - 1
    e = k - emax
    if fmt.scale_rule == "rceil":
        nmant = jnp.finfo(amax.dtype).nmant
        bits = jax.lax.bitcast_convert_type(amax, k.dtype)
        max_bits = int((fmt.largest / 2**emax - 1) * 2**nmant)
        e = e + ((bits & (2**nmant - 1)) > max_bits).astype(k.dtype)
    return pow2(jnp.clip(e, -127, 127), amax.dtype)


def tensor_scale_of(amax_block: Array, fmt: Format, axis_name: AxisName | None = None) -> Array:
    """NVFP4's tensor scale `t = amax / (448 * M)`: `amax` the largest of `amax_block` (across the shards of
    `axis_name`), `M` the element's largest value (2688 in all for `float4_e2m1fn`), correctly rounded."""
    (amax,) = across_shards(axis_name, (jnp.max(amax_block, initial=0),))
    return divide(amax, E4M3.bound * fmt.bound)


def block_scale(amax_block: Array, t: Array, fmt: Format) -> Array:
    """NVFP4's block scales under the tensor scale `t`: `b = float8_e4m3fn(clip(amax_b / (M * t), 0, 448))`, the
    division correctly rounded; 0 where `t` is."""
    ratio = jnp.where(t > 0, divide(amax_block, fmt.bound * jnp.where(t > 0, t, 1)), jnp.zeros((), t.dtype))
    return E4M3.levels(ratio, None)  # ratio >= 0: the clip to [-448, 448] is the clip to [0, 448]


def ggml_scale(view: Array, amax: Array, axis: int, fmt: IntFormat) -> Array:
    """The float32 `d` of GGML's blocks (along `axis` of the view; `amax` their largest magnitude), as llama.cpp's
    reference quantizers compute it: `"absmax"` (Q8_0) `amax / qmax`, `"signed_max"` (Q4_0, Q5_0) `m / qmin` with `m`
    the block's first element of largest magnitude, sign included. The divisions are correctly rounded on every
    path."""
    if fmt.scale_rule == "absmax":
        return divide(amax, fmt.qmax)
    first = jnp.argmax(jnp.abs(view), axis=axis, keepdims=True)
    return divide(jnp.take_along_axis(view, first, axis=axis), fmt.qmin)


def fit_scales(
    view: Array, axes: tuple[int, ...], fmt: Format, *, symmetric: bool = True, axis_name: AxisName | None = None
) -> Scales:
    """The scales a dynamic quantizer takes for `view` (a tensor under its layout), the elements sharing a scale
    along `axes` of it, without gradient:

    - float32 scales: `absmax_scale` of the largest finite magnitude (or `minmax_scale` with `symmetric=False`);
    - E8M0 scales: `e8m0_scale` of each block's largest finite magnitude;
    - two-level scales: `block_scale` under `tensor_scale_of` the whole view;
    - float16 scales (the GGML formats): `ggml_scale` of each block.

    A block holding NaN or inf gets a NaN scale (every entry of it quantizes to NaN). With `axis_name`, the
    statistics of float32 scales, and NVFP4's tensor scale, are those of the whole tensor whose shards are split along
    the named axes (blocks lie within one shard).
    """
    view = jax.lax.stop_gradient(view)
    if fmt.scale == "float32":
        if symmetric:
            (absmax,) = across_shards(axis_name, (finite_absmax(view, axes),))
            return Scales(absmax_scale(absmax, fmt))
        assert isinstance(fmt, IntFormat)
        _, lo, hi = stats(view, axes)
        hi, lo = across_shards(axis_name, (hi,), (lo,))
        return Scales(*minmax_scale(lo, hi, fmt))
    (axis,) = axes
    amax, bad = block_absmax(view, axis)
    nan = jnp.asarray(jnp.nan, amax.dtype)
    if fmt.scale == "float16":
        assert isinstance(fmt, IntFormat)
        return Scales(jnp.where(bad, nan, ggml_scale(view, amax, axis, fmt)))
    if fmt.scale == "e8m0":
        return Scales(jnp.where(bad, nan, e8m0_scale(amax, fmt)))
    t = tensor_scale_of(amax, fmt, axis_name)
    return Scales(jnp.where(bad, nan, block_scale(amax, t, fmt)), None, t)


def percentile_threshold(values: np.ndarray, weights: np.ndarray, percentile: float) -> np.ndarray:
    """The `"percentile"` clipping threshold, the one definition that calibration on data and calibration on a model's
    histograms share: along the last axis, the smallest of `values` at which the cumulative weight (in ascending
    order of value) reaches `percentile` percent of the total weight, the inverted empirical distribution function.
    Rows whose weights sum to 0 give 0.

    On data, `values` are the magnitudes and the weights 1 (0 for non-finite entries); on a histogram of `|x|`, the
    values are the upper edges of the bins and the weights their counts.
    """
    values = np.asarray(values, np.float64)
    weights = np.broadcast_to(np.asarray(weights, np.float64), values.shape)
    order = np.argsort(values, axis=-1, kind="stable")
    values = np.take_along_axis(values, order, axis=-1)
    cumulative = np.cumsum(np.take_along_axis(weights, order, axis=-1), axis=-1)
    total = cumulative[..., -1:]
    with np.errstate(invalid="ignore", divide="ignore"):
        reached = cumulative / total >= percentile / 100.0
    index = np.argmax(reached, axis=-1)[..., None]
    threshold = np.take_along_axis(values, index, axis=-1)[..., 0]
    return np.where(total[..., 0] > 0, threshold, 0.0)


def histogram_edges(num_bins: int, top: float) -> np.ndarray:
    """The upper edges of `num_bins` equal bins over `[0, top]`."""
    return np.linspace(0.0, top, num_bins + 1, dtype=np.float64)[1:]


def histogram_centres(num_bins: int, top: float) -> np.ndarray:
    """The centres of `num_bins` equal bins over `[0, top]`."""
    edges = np.linspace(0.0, top, num_bins + 1, dtype=np.float64)
    return ((edges[:-1] + edges[1:]) / 2).astype(np.float32)
