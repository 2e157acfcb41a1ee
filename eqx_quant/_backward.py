"""The opt-in quantized backward of a linear layer: the input's gradient as an integer product."""

import functools
from typing import Literal, NamedTuple

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, PRNGKeyArray

from ._int_ops import opaque, safe_contraction
from ._misc import FLOAT32_TINY, check_int, vary_alike
from ._qarray import QuantizedArray, nan_levels


_ROUNDINGS = ("nearest", "stochastic")


class QuantizedBackward(eqx.Module):
    """Asks a [`eqx_quant.nn.QuantLinear`][] to compute its input's gradient with an integer product, as Google's
    and NVIDIA's quantized-training recipes do: **this changes the gradient contract**.

    By default (without it) the backward pass of a quantized layer is that of the float formulation
    `y = fake_quant(W) @ fake_quant(x) + b`: the input's cotangent is the float product `Wqᵀ ȳ`. With a
    `QuantizedBackward`, it is instead computed from the weight's integers `W_int` (the forward pass's own) and the
    incoming gradient quantized per example (per row of the batch's gradient):

    - the weight's scales are folded into the gradient first, `h[o] = scale_w[o] * ȳ[o]` (per output channel;
        for weights with one scale per group along the contraction, one `h` per group), so that the contraction runs
        over integers only;
    - `h` is put on the symmetric grid `[-qmax, qmax]`, `qmax = 2**(bits - 1) - 1`, with one scale
        `s = max(max|h| * (1 / qmax), 2**-126)` (per example, and per weight group; the floor, float32's smallest
        normal, serves an all-zero gradient), as `h * (1 / s)` rounded to nearest (half to even) or stochastically
        (`floor(h * (1 / s) + u)`, `u` uniform in `[0, 1)` from the layer call's `key`, which is unbiased);
    - the input's cotangent is `s * (W_intᵀ @ h_int)`, an int32-accumulated product (split into chunks where int32
        could overflow), and then passes the input quantizer's straight-through estimator as usual.

    The weight's and bias's gradients are unchanged (float products of the fake-quant formulation): under the
    model's `jax.vmap` the weight's gradient is a sum over examples that JAX forms by transposition, where no
    per-example integer product can take its place without the batch at hand. A NaN in the weight makes NaN the
    input-gradient entries of its column, as the float product would; a non-finite incoming gradient makes the whole
    input gradient of that example NaN.

    Only linear layers with an integer forward take it: an integer weight quantizer with one scale per tensor, per
    output channel or per group along the contraction, and an integer per-tensor input quantizer.

    !!! example

        ```python
        import equinox as eqx
        import jax
        import jax.numpy as jnp
        import eqx_quant

        mlp = eqx.nn.MLP(4, 2, 8, 1, key=jax.random.key(0))
        qmlp = eqx_quant.quantize(mlp, backward=eqx_quant.QuantizedBackward(8))
        x = jnp.ones((3, 4))
        grads = eqx.filter_jit(eqx.filter_grad(lambda m: jnp.sum(jax.vmap(m)(x) ** 2)))(qmlp)
        print(grads.layers[0].layer.weight.shape)  # (8, 4)
        ```
    """

    bits: int = eqx.field(static=True)
    rounding: Literal["nearest", "stochastic"] = eqx.field(static=True)

    def __init__(self, bits: int | np.integer = 8, *, rounding: Literal["nearest", "stochastic"] = "nearest"):
        """**Arguments:**

        - `bits`: the width of the gradient's grid, 2 to 16.
        - `rounding`: `"nearest"` (half to even) or `"stochastic"`, which needs a `key` at every call of the layer
            whose gradient is taken (under the model's `jax.vmap`, one key per example: `jax.random.split(key,
            batch)` mapped with the inputs); calls without a gradient need none.
        """
        self.bits = check_int("bits", bits)
        self.rounding = rounding

    def __check_init__(self):
        if not 2 <= self.bits <= 16:
            raise ValueError(f"`bits` must be between 2 and 16, got bits={self.bits}.")
        if self.rounding not in _ROUNDINGS:
            raise ValueError(f"`rounding` must be one of {_ROUNDINGS}, got rounding={self.rounding!r}.")

    @property
    def qmax(self) -> int:
        """The largest level of the gradient's symmetric grid `[-qmax, qmax]`."""
        return 2 ** (self.bits - 1) - 1


_NOISE_STREAM = 0x9B  # folded into the layer call's key for the stochastic rounding's noise


class _Spec(NamedTuple):
    qmax: int
    stochastic: bool
    chunk: int  # the longest contraction (over output channels) that int32 holds exactly
    dtype: str  # the input's dtype, which its cotangent takes


def quantized_input_gradient(
    backward: QuantizedBackward,
    y: Array,
    xq: Array,
    w: QuantizedArray,
    w_float: Array,
    key: PRNGKeyArray | None,
) -> Array:
    """`y` unchanged, with `xq`'s cotangent computed as `backward` describes, from the weight's integers.

    `y` is the layer's output, computed without a derivative towards `xq` (the forward took `stop_gradient(xq)`);
    `xq` the fake-quantized input vector (its value unused); `w` the weight as a quantized tensor (unpacked), and
    `w_float` the float weight it was computed from.
    """
    w_int, w_bound = w.shifted()
    w_int = w_int.reshape(w_int.shape[0], -1)  # per-group weights come as (out, groups, group_size)
    out, k = w_int.shape
    scale = w.scale.reshape(w.scale.shape[0], -1)
    w_scale = jnp.broadcast_to(scale, (out, scale.shape[1])).astype(jnp.float32)
    column_nan = nan_levels(w_float, w, (0,)).reshape(k)
    chunk = safe_contraction(w_bound, backward.qmax)
    if chunk < 1:
        raise ValueError(
            f"QuantizedBackward({backward.bits}) cannot multiply this weight's integers (magnitudes up to {w_bound}) "
            "with int32 accumulation: a single product may overflow. Use fewer gradient bits or a narrower weight grid."
        )
    spec = _Spec(backward.qmax, backward.rounding == "stochastic", chunk, xq.dtype.name)
    key = key if spec.stochastic else None
    # Inside `jax.shard_map`, the operands that are the same on every device are cast to varying first, so that the
    # rule's cotangents are per device and summed across devices on the way back (see `vary_alike`).
    return _through(spec, *vary_alike(y, xq, w_int, w_scale, column_nan), key)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _through(spec, y, xq, w_int, w_scale, column_nan, key):
    del xq, w_int, w_scale, column_nan, key
    return y


def _through_fwd(spec, y, xq, w_int, w_scale, column_nan, key):
    del xq
    return y, (w_int, w_scale, column_nan, key)


def _through_bwd(spec, residuals, g):
    w_int, w_scale, column_nan, key = residuals
    if spec.stochastic and key is None:
        raise ValueError(
            "A layer with QuantizedBackward(rounding='stochastic') needs a `key` at every call whose gradient is "
            "taken: pass `key=` to the layer (one per example under `jax.vmap`)."
        )
    out, k = w_int.shape
    groups = w_scale.shape[1]
    # The weight's scales join the gradient, one `h` per weight group: `dx[j] = sum_o W_int[o, j] * h[o, group(j)]`.
    h = g.astype(jnp.float32)[:, None] * w_scale  # (out, groups)
    absmax = jnp.max(jnp.abs(h), axis=0, initial=0.0)  # per group; NaN or inf when the gradient is not finite
    scale = jnp.maximum(absmax * np.float32(1 / spec.qmax), FLOAT32_TINY)
    scale = jnp.where(jnp.isfinite(absmax), scale, jnp.nan)
    v = h * (1 / scale)[None]
    if spec.stochastic:
        # `opaque`: the product must not be fused with the sum into one rounding under `jit` only. The noise comes
        # from the key folded with a constant, so that a key the layer's caller also uses elsewhere (for dropout)
        # gives unrelated noise here.
        noise = jax.random.uniform(jax.random.fold_in(key, _NOISE_STREAM), v.shape, jnp.float32)
        levels = jnp.floor(opaque(v) + noise)
    else:
        levels = jax.lax.round(v, jax.lax.RoundingMethod.TO_NEAREST_EVEN)
    levels = jnp.clip(levels, -spec.qmax, spec.qmax).astype(jnp.int8 if spec.qmax <= 127 else jnp.int16)
    w_int = w_int.astype(np.promote_types(w_int.dtype, levels.dtype))
    levels = levels.astype(w_int.dtype)
    acc = jnp.zeros((groups, k // groups), jnp.float32)
    for start in range(0, out, spec.chunk):  # int32 sums of at most `chunk` terms, added in float32
        part_levels, part_w = levels[start : start + spec.chunk], w_int[start : start + spec.chunk]
        if groups == 1:
            dims = (((0,), (0,)), ((), ()))  # contract the output channels
            part = jax.lax.dot_general(part_levels[:, 0], part_w, dims, preferred_element_type=jnp.int32)[None]
        else:
            part_w = part_w.reshape(part_w.shape[0], groups, k // groups)
            dims = (((0,), (0,)), ((1,), (1,)))  # contract the output channels; the groups are a batch axis
            part = jax.lax.dot_general(part_levels, part_w, dims, preferred_element_type=jnp.int32)
        acc = acc + part.astype(jnp.float32)
    dx = jnp.where(column_nan, jnp.nan, (acc * scale[:, None]).reshape(k))
    return g, dx.astype(spec.dtype), None, None, None, None


_through.defvjp(_through_fwd, _through_bwd)


class UnquantizedBackward(eqx.Module):
    """Asks a quantized layer ([`eqx_quant.nn.QuantLinear`][], [`eqx_quant.nn.QuantConv`][]) for the gradients of
    its float layer at the original operands: the straight-through estimator around the whole quantized product.
    **This changes the gradient contract**, to the one of Google's Qwix (its `use_original_residuals`).

    The forward pass is unchanged (the integer product, or the float product of the fake-quantized operands, bit for
    bit the same). By default the backward pass is that of `y = fake_quant(W) @ fake_quant(x) + b`: the product's
    gradients at the fake-quantized operands, each passing its quantizer's clipped straight-through estimator, and
    the learned scales' gradients. With an `UnquantizedBackward` it is that of the float layer `y = W @ x + b` at the
    float weight and input: `W̄ = ȳ xᵀ`, `x̄ = Wᵀ ȳ`, with no clipping mask and no quantization in the backward
    pass; the quantizers' scales and zero points receive no gradient. The backward pass then keeps only the float
    operands (which a float layer keeps anyway) and recomputes nothing: less memory and less work than the default
    contract's (see [Benchmarks](../benchmarks.md#qwixs-gradient-contract-unquantizedbackward)). What it gives up is
    the clipping mask, which tells the optimizer that a weight or input beyond the grid's range has no effect on the
    output.

    The JVP rule is this float layer's, so forward-mode derivatives (`jax.jvp`, `jax.hessian`) follow the same
    contract. Learned quantizers ([`eqx_quant.LearnedFakeQuant`][]) are refused: their scales would never move. The
    products of two activations ([`eqx_quant.nn.QuantEinsum`][], attention's two products under a `"w8a8_attn"`
    recipe) keep the default contract.

    !!! example

        ```python
        import equinox as eqx
        import jax
        import jax.numpy as jnp
        import eqx_quant

        linear = eqx.nn.Linear(2, 1, key=jax.random.key(0))
        inputs = eqx_quant.FakeQuant(0.01, format="int8")  # the grid reaches 1.27
        x = jnp.array([0.5, 3.0])  # the second entry lies beyond it
        for backward in (None, eqx_quant.UnquantizedBackward()):
            qlinear = eqx_quant.nn.QuantLinear(linear, weight_quant=None, input_quant=inputs, backward=backward)
            print(jax.grad(lambda x: qlinear(x)[0])(x) / linear.weight[0])  # [ 1. -0.], then [1. 1.]
        ```
    """


def check_backward(backward: object) -> None:
    """A `TypeError` unless `backward` is one of the backward passes a layer or rule accepts."""
    if backward is not None and not isinstance(backward, (QuantizedBackward, UnquantizedBackward)):
        raise TypeError(
            f"`backward` must be a QuantizedBackward, an UnquantizedBackward or None, got backward={backward!r}."
        )


@eqx.filter_custom_jvp
def straight_through(args, *, value, derivative):
    """`value(*args)`, whose derivative is that of `derivative(*args)`: the quantized computation `value`
    differentiated as the float one `derivative`."""
    return value(*args)


@straight_through.def_jvp
def _straight_through_jvp(primals, tangents, *, value, derivative):
    (args,) = primals
    (dargs,) = tangents
    # The value through the function itself, so that a second derivative is again the float computation's.
    y = straight_through(args, value=value, derivative=derivative)
    # The float computation's own value is not used: under `jit` XLA drops it.
    _, dy = eqx.filter_jvp(lambda a: derivative(*a), (args,), (dargs,))
    return y, dy.astype(y.dtype)
