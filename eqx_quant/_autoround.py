"""Learned rounding and clipping (AutoRound, Cheng et al., 2023): each weight's rounding offset and each group's
clipping range trained by signed gradient descent against the layer's output error on calibration data."""

import functools
from collections.abc import Callable, Iterable

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, PyTree

from ._format import FloatFormat, Format, IntFormat, apply_scale, effective_scale, exponent, pow2, reciprocal
from ._gptq_model import as_stored, solve_weights
from ._misc import FLOAT32_TINY, check_int, check_real
from ._observe import warns_of_calibration_data
from ._scales import block_absmax, block_scale, e8m0_scale, finite_or, ggml_scale, tensor_scale_of


def _exact(smooth: Array, value: Array) -> Array:
    """`value` in the forward pass, with the derivatives of `smooth` (a straight-through estimate): `smooth -
    smooth` is exactly 0, so the value is `value`'s to the bit."""
    return smooth - jax.lax.stop_gradient(smooth) + jax.lax.stop_gradient(value)


def offset_levels(fmt: Format, v: Array, offset: Array) -> Array:
    """The grid points of `v` (a weight over its scale) rounded after moving it by `offset ∈ [-1/2, 1/2]` steps of
    the grid around it, saturated at the grid's ends: `offset = 0` is the format's own rounding to nearest, and any
    offset picks one of the two grid points next to `v`. On an integer grid the step is 1; on a float grid it is
    the spacing of the binade of `|v|` (`2**(max(e, emin) - nmant)`), so that `v` just above a power of two cannot
    be moved to a point of the finer binade below."""
    if not isinstance(fmt, FloatFormat):
        return fmt.levels(v + offset, None)
    v = jnp.clip(v, -fmt.bound, fmt.bound)
    k = _binade_step(fmt, v)
    return fmt.levels(jnp.round(v * pow2(-k, v.dtype) + offset) * pow2(k, v.dtype), None)


def _binade_step(fmt: FloatFormat, v: Array) -> Array:
    """The exponent `k` of the grid's step `2**k` around `v` (within the grid's range): that of `|v|`'s binade, or of
    the subnormals."""
    return jnp.maximum(exponent(jnp.abs(v)), fmt.emin) - fmt.nmant


def _unsaturated(fmt: Format) -> tuple[float, float]:
    """Where gradients pass: the range of `v + offset` that rounds to a grid point without saturating, which reaches
    half a step beyond the grid's ends. For most formats that is their `limits`; integer grids rounding halves to
    even have their ends as limits, and float grids their largest values, so theirs are widened here."""
    if isinstance(fmt, FloatFormat):
        half = 2.0 ** (fmt.emax - fmt.nmant - 1)
        return -fmt.bound - half, fmt.bound + half
    if isinstance(fmt, IntFormat) and fmt.rounding == "half_even" and fmt.window == "levels":
        return fmt.qmin - 0.5, fmt.qmax + 0.5
    return fmt.limits(None, 0)


@functools.partial(jax.jit, static_argnames=("fmt", "group_size", "steps"))
def autoround_solve(
    weight: Float[Array, "out n"],
    hessian: Float[Array, "n n"],
    learning_rate: Float[Array, ""],
    *,
    fmt: Format,
    group_size: int | None,
    steps: int,
) -> tuple[Array, Array, Array | None]:
    """AutoRound on one layer: `W̃ = s(α) * q(W / s(α), V)`, the levels `q` of `offset_levels` with an offset
    `V ∈ [-1/2, 1/2]` per weight, the scales `s(α)` those of the format for the row's or group's largest magnitude
    times `α ∈ [1/2, 1]` (per row or group); `V` and `α` trained for `steps` steps of signed gradient descent (the
    learning rate decaying linearly to 0, the rounding's gradient passed straight through where it does not
    saturate, the block formats' scale rules as if `s` were `α` times the unclipped scale) on the output error
    `tr((W̃ - W) H (W̃ - W)ᵀ)`; the parameters of least error seen are kept (`V = 0, α = 1`, round to nearest,
    among them). NVFP4's tensor scale is that of the original weight. Scales come from the finite weights: a NaN
    weight stays NaN and an infinite one saturates, and the layer's loss is then not finite, so round to nearest is
    kept. Returns `(W̃, s, tensor scale)`, `s` of
    shape `(out,)` or `(out, groups)` as the format holds it (MX: powers of two; NVFP4: the block scales)."""
    out, n = weight.shape
    g = n if group_size is None else group_size
    w = weight.astype(jnp.float32).reshape(out, n // g, g)
    hessian = hessian.astype(jnp.float32)
    top = block_absmax(w, 2)[0]  # of the finite entries
    t = tensor_scale_of(top, fmt) if fmt.scale == "e4m3" else None

    def format_scale(alpha):  # the format's scale of groups whose largest magnitude is `alpha * top`
        clipped = alpha * top
        if fmt.scale == "float32":
            return jnp.maximum(clipped / fmt.bound, FLOAT32_TINY)
        if fmt.scale == "e8m0":
            return e8m0_scale(clipped, fmt)
        if fmt.scale == "e4m3":
            assert t is not None
            return block_scale(clipped, t, fmt)
        assert isinstance(fmt, IntFormat)
        return ggml_scale(alpha * finite_or(w, 0.0), clipped, 2, fmt)

    unclipped = effective_scale(format_scale(jnp.ones_like(top)), t)
    low, high = _unsaturated(fmt)

    def quantized(params, straight_through=True):
        offset, alpha = params
        s = format_scale(alpha)
        v = w * reciprocal(fmt, s, t, 3)
        q = offset_levels(fmt, v, offset)
        value = apply_scale(fmt, q, s, t)
        if not straight_through:
            return value, s
        # The derivatives of `s_α * clip(w / s_α + V * step)`, `s_α = α * unclipped` (on float32 scales the scale
        # itself), the step that of `offset_levels` and the clip passing gradients inside the grid's limits.
        s_alpha = s if fmt.scale == "float32" else _exact(alpha * unclipped, effective_scale(s, t))
        step = 1.0
        if isinstance(fmt, FloatFormat):
            step = pow2(_binade_step(fmt, jnp.clip(v, -fmt.bound, fmt.bound)), v.dtype)
        u = _exact(w / jnp.where(s_alpha != 0, s_alpha, 1.0), v) + offset * step
        inside = (u >= low) & (u <= high)
        return _exact(s_alpha * _exact(jnp.where(inside, u, jax.lax.stop_gradient(u)), q), value), s

    def loss(params):
        d = (quantized(params)[0] - w).reshape(out, n)
        return jnp.sum(jnp.matmul(d, hessian, precision=jax.lax.Precision.HIGHEST) * d)

    def step(carry, i):
        params, best, best_loss = carry
        value, grads = jax.value_and_grad(loss)(params)
        better = value < best_loss
        best = jax.tree.map(lambda p, b: jnp.where(better, p, b), params, best)
        rate = learning_rate * (1 - i / steps)
        offset = jnp.clip(params[0] - rate * jnp.sign(grads[0]), -0.5, 0.5)
        alpha = jnp.clip(params[1] - rate * jnp.sign(grads[1]), 0.5, 1.0)
        return ((offset, alpha), best, jnp.minimum(value, best_loss)), None

    start = (jnp.zeros_like(w), jnp.ones_like(top))
    (last, best, best_loss), _ = jax.lax.scan(step, (start, start, jnp.inf), jnp.arange(steps, dtype=jnp.float32))
    best = jax.tree.map(lambda p, b: jnp.where(loss(last) < best_loss, p, b), last, best)
    new_weight, s = quantized(best, straight_through=False)
    s = as_stored(fmt, s[:, 0, 0] if group_size is None else s[..., 0])
    return new_weight.reshape(out, n).astype(weight.dtype), s, t


@warns_of_calibration_data("autoround")
def autoround(
    model: PyTree,
    batches: Iterable[PyTree],
    *,
    steps: int = 200,
    learning_rate: float | None = None,
    sequential: bool = True,
    batched: bool = False,
    where: Callable[[str, eqx.Module], bool] | str | None = None,
    progress: bool = False,
) -> PyTree:
    r"""Learned rounding and clipping of a model's linear weights: AutoRound's signed gradient descent (Cheng et al.,
    2023), layer by layer.

    Each chosen [`eqx_quant.nn.QuantLinear`][]'s weight becomes

    $$\tilde W = s_\alpha \cdot q\big(W / s_\alpha + V \cdot \delta\big),$$

    with a rounding offset `V ∈ [-1/2, 1/2]` per weight and a clipping factor `α ∈ [1/2, 1]` per output row or group
    (the weight quantizer's layout). `q` rounds to the nearest point of the weight quantizer's grid (its format's own
    rounding, saturating at the ends) and `δ` is the grid's step around `W / s_α`: 1 on an integer grid, the spacing
    of the binade on a float grid (FP8, FP6, FP4), so that every offset chooses between the two grid points next to
    `W / s_α`. `s_α` is the format's scale for a largest magnitude of `α max|w|`: `α max|w| / bound` for float32
    scales, the power of two of an MX block, NVFP4's `float8_e4m3fn` block scale under the tensor scale of the
    original weight, GGML's `d`.

    `V` and `α` are trained from round to nearest (`V = 0`, `α = 1`) for `steps` steps of signed gradient descent,
    `θ ← clip(θ - η_t sign(∇θ))` with `η_t` decaying linearly from `learning_rate` (by default `1 / steps`) to 0,
    rounding's gradient passed straight through (and, for the block formats, whose scales move in steps, the
    scale's as if it were `α` times the unclipped one). The loss is the layer's output error over all of the
    calibration data, `tr((W̃ - W) H (W̃ - W)ᵀ)` with `H = Σ x xᵀ` (GPTQ's Hessian), so each step is exact and costs
    one product with `H`; the parameters of least loss seen are kept, round to nearest among them, so no layer ends
    worse than round to nearest on that loss. AutoRound trains a transformer block at a time on its output; this
    trains each linear layer on its own output, and `sequential=True` (the default) collects each layer's `H` on the
    outputs of the layers already rounded, in call order, as [`eqx_quant.gptq`][] does.

    The layer then holds `W̃` and a fixed weight quantizer with the scales `s_α` (a static [`eqx_quant.FakeQuant`][],
    or for a stack of layers a [`eqx_quant.LearnedFakeQuant`][] with one set per layer), which computes exactly with
    the learned grid points; [`eqx_quant.convert`][] stores them.

    **Non-finite data.** NaN and infinite calibration inputs count as zeros in the Hessians, with a warning that
    counts them per layer; a layer whose calibration inputs are all zero (a zero Hessian: nothing to fit) and a NaN
    or infinite weight entry are a `ValueError` naming the layer, as for [`eqx_quant.gptq`][].

    **Arguments:**

    - `model`: a model from [`eqx_quant.quantize`][] whose chosen weight quantizers are symmetric, with one scale per
        output row or per group (or block) of input columns, in any format [`eqx_quant.gptq`][] takes: integer grids
        (e.g. the `"w4a16_g32"` recipe), FP8, FP6 and FP4 with float32 scales, the MX formats, NVFP4, GGML's.
    - `batches`: an iterable of calibration inputs with a leading batch axis, as for [`eqx_quant.calibrate`][].
    - `steps`: the steps of signed gradient descent per layer.
    - `learning_rate`: the initial step size (default `1 / steps`).
    - `sequential`, `batched`, `where`, `progress`: as for [`eqx_quant.gptq`][].

    **Returns:**

    The model with learned-rounding weights.

    **Raises:**

    `ValueError`, naming the layer, for a weight quantizer that is not symmetric per row or per group, an integer
    grid without 0 and positive levels, or a layer never called on the batches; `ValueError` for `steps` < 1 or a
    `learning_rate` that is not positive and finite.
    """
    steps = check_int("steps", steps)
    if steps < 1:
        raise ValueError(f"`steps` must be at least 1, got steps={steps}.")
    rate = 1 / steps if learning_rate is None else check_real("learning_rate", learning_rate)
    if not (0 < rate < float("inf")):
        raise ValueError(f"`learning_rate` must be positive and finite, got learning_rate={learning_rate!r}.")

    def make(fmt: Format, group_size: int | None) -> Callable:
        return lambda weight, hessian: autoround_solve(
            weight, hessian, jnp.float32(rate), fmt=fmt, group_size=group_size, steps=steps
        )

    return solve_weights(model, batches, "autoround", make, sequential, batched, where, progress)
