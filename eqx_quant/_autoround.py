"""Learned rounding and clipping (AutoRound, Cheng et al., 2023): each weight's rounding offset and each group's
clipping range trained by signed gradient descent against the layer's output error on calibration data."""

import functools
from collections.abc import Callable, Iterable

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, PyTree

from ._format import Format, IntFormat
from ._gptq_model import solve_weights
from ._misc import FLOAT32_TINY, check_int, check_real


def _check_format(path: str, fmt: Format) -> None:
    if not isinstance(fmt, IntFormat) or fmt.scale != "float32":
        raise ValueError(
            f"Layer {path!r} quantizes its weight to {fmt.name}; `autoround` learns the rounding of integer grids "
            "with float32 scales. Use `gptq` for float and block formats, or exclude the layer with `where`."
        )


@functools.partial(jax.jit, static_argnames=("qmin", "qmax", "group_size", "steps"))
def autoround_solve(
    weight: Float[Array, "out n"],
    hessian: Float[Array, "n n"],
    learning_rate: Float[Array, ""],
    *,
    qmin: int,
    qmax: int,
    group_size: int | None,
    steps: int,
) -> tuple[Array, Array, None]:
    """AutoRound on one layer: `W̃ = s * clip(round(W / s + V), qmin, qmax)` with `s = α max|w| / qmax` per row or
    group, `V ∈ [-1/2, 1/2]` per weight and `α ∈ [1/2, 1]` per row or group, trained for `steps` steps of signed
    gradient descent (the learning rate decaying linearly to 0, the rounding's gradient passed straight through) on
    the output error `tr((W̃ - W) H (W̃ - W)ᵀ)`; the parameters of least error seen are kept (`V = 0, α = 1`, round
    to nearest, among them). Returns `(W̃, s, None)`, `s` of shape `(out,)` or `(out, groups)`."""
    out, n = weight.shape
    g = n if group_size is None else group_size
    w = weight.astype(jnp.float32).reshape(out, n // g, g)
    hessian = hessian.astype(jnp.float32)
    top = jnp.max(jnp.abs(w), axis=-1, keepdims=True)

    def scale(alpha):
        return jnp.maximum(alpha * top / qmax, FLOAT32_TINY)

    def levels(params, straight_through):
        offset, alpha = params
        y = w / scale(alpha) + offset
        rounded = y + jax.lax.stop_gradient(jnp.round(y) - y) if straight_through else jnp.round(y)
        return jnp.clip(rounded, qmin, qmax)

    def loss(params, straight_through=True):
        d = (levels(params, straight_through) * scale(params[1]) - w).reshape(out, n)
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
    s = scale(best[1])
    new_weight = (levels(best, straight_through=False) * s).reshape(out, n).astype(weight.dtype)
    return new_weight, s[:, 0, 0] if group_size is None else s[..., 0], None


def autoround(
    model: PyTree,
    batches: Iterable[PyTree],
    *,
    steps: int = 200,
    learning_rate: float | None = None,
    sequential: bool = True,
    batched: bool = False,
    where: Callable[[str, eqx.Module], bool] | None = None,
    progress: bool = False,
) -> PyTree:
    r"""Learned rounding and clipping of a model's linear weights: AutoRound's signed gradient descent (Cheng et al.,
    2023), layer by layer.

    Each chosen [`eqx_quant.nn.QuantLinear`][]'s weight becomes

    $$\tilde W = s \cdot \mathrm{clip}\big(\lfloor W / s + V \rceil, q_{\min}, q_{\max}\big), \qquad
    s = \alpha \max|w| / q_{\max},$$

    with a rounding offset `V ∈ [-1/2, 1/2]` per weight and a clipping factor `α ∈ [1/2, 1]` per output row or group
    (the weight quantizer's layout), trained from round to nearest (`V = 0`, `α = 1`) for `steps` steps of signed
    gradient descent, `θ ← clip(θ - η_t sign(∇θ))` with `η_t` decaying linearly from `learning_rate` (by default
    `1 / steps`) to 0, rounding's gradient passed straight through. The loss is the layer's output error over all of
    the calibration data, `tr((W̃ - W) H (W̃ - W)ᵀ)` with `H = Σ x xᵀ` (GPTQ's Hessian), so each step is exact and
    costs one product with `H`; the parameters of least loss seen are kept, round to nearest among them, so no layer
    ends worse than round to nearest on that loss. AutoRound trains a transformer block at a time on its output;
    this trains each linear layer on its own output, and `sequential=True` (the default) collects each layer's `H` on
    the outputs of the layers already rounded, in call order, as [`eqx_quant.gptq`][] does.

    The layer then holds `W̃` and a fixed weight quantizer with the scales `s` (a static [`eqx_quant.FakeQuant`][], or
    for a stack of layers a [`eqx_quant.LearnedFakeQuant`][] with one set per layer), which computes exactly with the
    learned integers; [`eqx_quant.convert`][] stores them.

    **Arguments:**

    - `model`: a model from [`eqx_quant.quantize`][] whose chosen weight quantizers are symmetric integer grids with
        one scale per output row or per group of input columns (e.g. the `"w4a16_g32"` recipe).
    - `batches`: an iterable of calibration inputs with a leading batch axis, as for [`eqx_quant.calibrate`][].
    - `steps`: the steps of signed gradient descent per layer.
    - `learning_rate`: the initial step size (default `1 / steps`).
    - `sequential`, `batched`, `where`, `progress`: as for [`eqx_quant.gptq`][].

    **Returns:**

    The model with learned-rounding weights.

    **Raises:**

    `ValueError`, naming the layer, for a weight quantizer that is not a symmetric integer grid per row or per group
    (float and block formats: use `gptq`), or a layer never called on the batches; `ValueError` for `steps` < 1 or a
    `learning_rate` that is not positive and finite.
    """
    steps = check_int("steps", steps)
    if steps < 1:
        raise ValueError(f"`steps` must be at least 1, got steps={steps}.")
    rate = 1 / steps if learning_rate is None else check_real("learning_rate", learning_rate)
    if not (0 < rate < float("inf")):
        raise ValueError(f"`learning_rate` must be positive and finite, got learning_rate={learning_rate!r}.")

    def make(fmt: Format, group_size: int | None) -> Callable:
        assert isinstance(fmt, IntFormat)
        return lambda weight, hessian: autoround_solve(
            weight, hessian, jnp.float32(rate), qmin=fmt.qmin, qmax=fmt.qmax, group_size=group_size, steps=steps
        )

    return solve_weights(model, batches, "autoround", make, sequential, batched, where, progress, _check_format)
