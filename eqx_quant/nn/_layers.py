import functools
from collections.abc import Callable
from typing import Any, Literal

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, ArrayLike, Float, Int, PRNGKeyArray

from .._backward import (
    QuantizedBackward,
    UnquantizedBackward,
    check_backward,
    quantized_input_gradient,
    straight_through,
)
from .._int_ops import LinearSpec, any_float64, integer_forward, integer_grid, plan
from .._misc import computed_before, one_program, read_through, sharded_in_type, value_computed_before
from .._qarray import nan_levels
from .._quantizers import AbstractQuantizer, DynamicFakeQuant, LearnedFakeQuant
from ._transforms import AbstractInputTransform


def default_weight_quant() -> DynamicFakeQuant:
    """The default weight quantizer: 8 bits, symmetric, one scale per output channel (axis 0 of the weight)."""
    return DynamicFakeQuant(8, axis=0)


def default_input_quant() -> DynamicFakeQuant:
    """The default input quantizer: 8 bits, symmetric, one scale for the whole input."""
    return DynamicFakeQuant(8)


_MATMULS = ("int", "float")


def stack_depth(layer: eqx.Module, weight_shape: tuple[int, ...]) -> int:
    """The number of leading axes along which the weights of `layer` (a `Linear`, `Conv` or `Embedding`) are
    stacked: layers built with `eqx.filter_vmap` hold one weight per layer of the stack, of shape
    `(layers, *weight_shape)`, while their static fields describe one layer."""
    base = layer.num_spatial_dims + 2 if isinstance(layer, eqx.nn.Conv) else 2  # pyright: ignore[reportAttributeAccessIssue]
    return max(len(weight_shape) - base, 0)


def stack_shape(layer: eqx.Module) -> tuple[int, ...]:
    """The shape of the stack that the float `layer` (a `Linear`, `Conv` or `Embedding`, with arrays or with the
    `jax.ShapeDtypeStruct`s of `eqx.filter_eval_shape`) belongs to: `()` for a single layer, `(layers,)` for layers
    built with `eqx.filter_vmap`. The placeholder of an `eqx.nn.Shared` tie (another layer's weight) has no shape: a
    single layer."""
    weight = layer.weight  # pyright: ignore[reportAttributeAccessIssue]
    if not hasattr(weight, "shape"):
        return ()
    return tuple(weight.shape[: stack_depth(layer, weight.shape)])


def per_layer(fn: Callable, depth: int) -> Callable:
    """`fn(quantizer, weight)` mapped over `depth` leading stacked axes of the weight and of the quantizer's arrays
    (a quantizer of a stacked layer holds one set of arrays per layer, as the layer holds one weight per layer).
    An eager call of the mapped function runs as one program."""
    if depth == 0:
        return fn
    for _ in range(depth):
        fn = eqx.filter_vmap(fn)
    return one_program(fn)


@functools.cache
def _quantized_weight(depth: int) -> Callable:
    """`quantizer(weight)` for a layer stacked `depth` times: one function per depth, so that its eager calls
    reuse one compiled program."""
    return per_layer(lambda quantizer, weight: quantizer(weight), depth)


@jax.custom_jvp
def after_input(weight: Array, x: Array) -> Array:
    """`weight` unchanged, made to depend on the layer's input `x`, so that it is computed when the layer runs.

    A dequantized (or fake-quantized) weight is a temporary array as large as the float weight. Depending on the
    stored weight alone, every layer's is computed at the start of the program under `jit`, and all are alive at
    once. On CPU the temporary memory of one call then grows beyond what the C library's allocator keeps for reuse
    (32 MB), and is mapped afresh from the operating system at every call, which made a converted weight-only MLP
    many times slower than float at batch 1. Computed when its layer runs, each dequantized weight reuses the
    previous one's memory.

    The dependency is a selection that changes no value: a weight entry that is NaN is replaced by NaN where the
    first entry of `x` is NaN. Under `jax.vmap` it reads the first entry of the whole batch, so that the weight
    stays one weight, not one per example; a weight mapped itself (a stack of layers run with `jax.vmap`) is taken
    as it is. (`jax.lax.optimization_barrier` does not order XLA's CPU
    schedule.) Its derivative towards the weight is the identity. Other platforms than CPU take the weight as it
    is.

    The quantized layers order their fake-quantized weight the same way, for their memory too, and because the
    dependency changes how XLA fuses the operations around the layer: a converted layer with it and a quantized
    layer without it summed a later normalisation or residual of the model otherwise (in a residual network's
    block), and their outputs differed in the last bit.
    """
    return _select_after(weight, x)


@after_input.defjvp
def _after_jvp(primals, tangents):
    (weight, x), (weight_dot, _) = primals, tangents
    return after_input(weight, x), weight_dot  # the identity, towards the weight; nothing towards `x`


def _select(weight: Array, x: Array) -> Array:
    if x.size == 0:  # an empty input (or batch): nothing to wait for
        return weight
    if sharded_in_type(x):
        # Sharded in its type (Explicit mesh axes), where reading one entry of a sharded axis is refused: the
        # weight as it is, in the quantized and the converted layer alike.
        return weight
    # On CPU only, where the memory is the allocator's problem: elsewhere the dependency is not needed, and with the
    # batch sharded across devices its first entry would cost a collective per layer.
    return jax.lax.platform_dependent(weight, x, cpu=_select_on_cpu, default=_weight_alone)


# The branches of `_select`, defined once, so that eager calls reuse their compiled programs.
def _select_on_cpu(weight: Array, x: Array) -> Array:
    # The entry at the origin, sliced out: a batch sharded across devices is not gathered for it (a reshape first
    # would gather the whole batch).
    first = jnp.isnan(x[(0,) * x.ndim])
    return jnp.where(first & jnp.isnan(weight), jnp.nan, weight).astype(weight.dtype)


def _weight_alone(weight: Array, x: Array) -> Array:
    del x
    return weight


@jax.custom_batching.custom_vmap
def _select_after(weight: Array, x: Array) -> Array:
    return _select(weight, x)


@_select_after.def_vmap
def _select_after_rule(axis_size: int, in_batched: list[bool], weight: Array, x: Array) -> tuple[Array, bool]:
    """Mapped over `x` alone: one weight for the whole batch, after its first entry. Mapped over the weight (one
    per example: a stack of layers run with `jax.vmap`), the weight as it is: a selection of a stack of weights is
    fused into their product by XLA's CPU compiler, which then sums in another order than the quantized layer's."""
    del axis_size
    weight_batched, x_batched = in_batched
    if weight_batched:
        return weight, True
    return _select_after(weight, x), False


class AbstractQuantLayer(eqx.Module):
    """Base class of the quantized layers: a float layer, a weight quantizer and an input quantizer.

    The layer is computed on the fake-quantized weight and input, with the wrapped layer's own call signature.
    Either quantizer may be `None`, which leaves that operand in floating point.
    """

    layer: eqx.AbstractVar[eqx.Module]
    weight_quant: eqx.AbstractVar[AbstractQuantizer | None]
    input_quant: eqx.AbstractVar[AbstractQuantizer | None]

    @property
    def weight(self) -> Any:
        """The weight the layer computes with: the fake-quantized weight of the wrapped layer (its float weight when
        `weight_quant` is `None`), with the gradients of the forward pass (the straight-through estimator reaches
        `layer.weight`).

        Model code that reads a layer's `.weight` (a language-model head tied to the input embedding,
        `h @ embedding.weight.T`) therefore computes with the quantized table, and so does the converted model,
        whose integer layers' `.weight` is the dequantized table, the same values bit for bit. The trainable float
        weight is `layer.weight`. Stacked layers (built with `eqx.filter_vmap`) give the stack of quantized weights.
        In an `eqx.nn.Shared` tie, the layer whose weight is the placeholder receives the other layer's `.weight`
        (the quantized table) when the tie is restored, and quantizes it with its own quantizer.
        """
        weight = self.layer.weight  # pyright: ignore[reportAttributeAccessIssue]
        if self.weight_quant is None or not eqx.is_array(weight):
            # Not an array: the placeholder of a tie (`eqx.nn.Shared` stores one where the tied weight goes, and
            # `eqx.tree_at` looks for it through this property), returned as it is.
            return weight
        # Computed before what reads it, as the converted layer's `.weight` is (see `computed_before`).
        return value_computed_before(self._fake_quantized_weight(), weight)

    def _fake_quantized_weight(self) -> Array:
        weight = self.layer.weight  # pyright: ignore[reportAttributeAccessIssue]
        depth = stack_depth(self.layer, weight.shape)
        return _quantized_weight(depth)(self.weight_quant, weight)

    def __getattr__(self, name: str) -> Any:
        """Every other public attribute of the wrapped layer reads through (`bias`, `in_features`,
        `out_features`, `use_bias`, a convolution's `stride`, ...), so that model code reading them works on the
        quantized layer as on the float layer."""
        return read_through(self, "layer", name)

    def quantized_layer(self) -> eqx.Module:
        """The wrapped layer with its weight replaced by the fake-quantized weight."""
        if self.weight_quant is None:
            return self.layer
        return eqx.tree_at(lambda layer: layer.weight, self.layer, self._fake_quantized_weight())

    def _float_path(self, x, key):
        if self.weight_quant is None:
            layer = self.layer
        else:
            weight = weight_for_product(self._fake_quantized_weight(), x, self.layer.weight)  # pyright: ignore
            layer = eqx.tree_at(lambda l: l.weight, self.layer, weight)
        if self.input_quant is not None:
            x = self.input_quant(x)
        return layer(x, key=key)  # pyright: ignore[reportCallIssue]


def weight_for_product(weight: Array, x: Array, anchor: Array) -> Array:
    """The weight of a layer's float product, as the quantized and the converted layer both compute it: after the
    input `x` (`after_input`), and for a single output (`single_output`) before the product, behind a conditional
    whose predicate reads `anchor` (`computed_before`). Its derivative towards `weight` is the identity."""
    weight = after_input(weight, x)
    return value_computed_before(weight, anchor) if single_output(weight) else weight


def single_output(weight: Any) -> bool:
    """Whether a layer's weight has a single output channel (a linear layer's `out_features` 1 or `"scalar"`, a
    convolution's one output channel).

    Then XLA may compute the layer's product of one example as a sum of elementwise products, into which it fuses the
    computation of the weight: the fake-quantized weight and the converted layer's dequantized one, computed by
    different operations, made sums differing in the last bit. Both layers then compute the weight before the
    product (`computed_before`), where the sums are alike. Other shapes take a dot product, which reads its
    operands as computed."""
    return eqx.is_array(weight) and weight.ndim >= 1 and weight.shape[0] == 1


def check_unquantized_backward(layer: "QuantLinear | QuantConv") -> None:
    """A `ValueError` for an `UnquantizedBackward` with a learned quantizer, whose scales it would never train."""
    if not isinstance(layer.backward, UnquantizedBackward):
        return
    for name in ("weight_quant", "input_quant"):
        if isinstance(getattr(layer, name), LearnedFakeQuant):
            raise ValueError(
                f"`backward=UnquantizedBackward()` gives no gradient to the quantizers' scales, so the learned "
                f"quantizer {name}={getattr(layer, name)!r} would never train; use a static or dynamic quantizer, or "
                "the default backward."
            )


def check_quantizer(name: str, value: object) -> None:
    if value is not None and not isinstance(value, AbstractQuantizer):
        raise TypeError(f"`{name}` must be a quantizer module or None, got {value!r}.")


def check_floating_weight(layer: eqx.Module, weight_quant: object) -> None:
    """A `TypeError` for a weight quantizer on a weight that is not floating (integer or complex), which no quantizer
    takes."""
    weight = getattr(layer, "weight", None)
    dtype = getattr(weight, "dtype", None)
    if weight_quant is not None and dtype is not None and not jnp.issubdtype(dtype, jnp.floating):
        raise TypeError(f"`layer`'s weight must be a floating array to be quantized, got dtype {dtype}.")


def check_transform(layer: eqx.nn.Linear, transform: object) -> None:
    """Raises unless `transform` is `None` or an input transform of `layer`'s input size."""
    if transform is None:
        return
    if not isinstance(transform, AbstractInputTransform):
        raise TypeError(f"`input_transform` must be an input transform module or None, got {transform!r}.")
    array = next(a for a in jax.tree.leaves(transform))
    if layer.in_features == "scalar" or array.shape[-1] != layer.in_features:
        raise ValueError(
            f"`input_transform` must act on {layer.in_features!r} input features (its arrays' last axis), got "
            f"{transform!r}."
        )


def check_matmul(matmul: object) -> None:
    if matmul not in _MATMULS:
        raise ValueError(f"`matmul` must be one of {_MATMULS}, got matmul={matmul!r}.")


def check_input(layer: eqx.Module, x: Array) -> None:
    """Raises a `ValueError` unless `x` is one example for the float `layer` (a `Linear` or a `Conv`): the check that
    the quantized layer and its converted integer layer both make first, so that they fail alike. A linear layer's
    input is checked against its weight's input features where it holds a weight (the quantized layer's, a shard of
    them inside `jax.shard_map`), else against `in_features` (the converted layer's skeleton, whose codes are whole)."""
    if not (hasattr(x, "shape") and hasattr(x, "dtype")):
        pairs = " (for (inputs, labels) pairs, pass the inputs alone)" if isinstance(x, (tuple, list)) else ""
        raise TypeError(f"`x` must be an array, one example, got a {type(x).__name__}{pairs}.")
    if isinstance(layer, eqx.nn.Linear):
        features = layer.in_features
        if features != "scalar" and eqx.is_array(layer.weight):
            # The weight's own: inside `jax.shard_map` a row-parallel layer holds its shard of the input features.
            features = layer.weight.shape[-1]
        expected = () if features == "scalar" else (features,)
        if x.shape != expected:
            what = "in_features='scalar'" if features == "scalar" else f"a weight of {features} input features"
            raise ValueError(
                f"`x` must have shape {expected} for a linear layer with {what}, got shape {x.shape}. Layers take one "
                "example: map a batch with `jax.vmap`."
            )
    elif isinstance(layer, eqx.nn.Conv):
        if x.ndim != layer.num_spatial_dims + 1 or x.shape[0] != layer.in_channels:
            raise ValueError(
                f"`x` must have shape (in_channels, *spatial) = ({layer.in_channels}, ...) with "
                f"{layer.num_spatial_dims} spatial axes for this convolution, got shape {x.shape}. Layers take one "
                "example: map a batch with `jax.vmap`."
            )


@one_program
def quant_forward(layer: AbstractQuantLayer, x: Array, key: PRNGKeyArray | None) -> Array:
    """The forward pass of a quantized `Linear` or `Conv` (`x` one example, checked): the integer computation where
    `plan` allows it (and `matmul="int"`), else the float layer on the fake-quantized operands; with an
    `UnquantizedBackward`, differentiated as the float layer."""
    if isinstance(getattr(layer, "backward", None), UnquantizedBackward):
        check_unquantized_backward(layer)  # pyright: ignore[reportArgumentType]  (a quantizer swapped in since)
        return straight_through((layer, x, key), value=_quant_forward, derivative=_float_forward)
    return _quant_forward(layer, x, key)


def _float_forward(layer: AbstractQuantLayer, x: Array, key: PRNGKeyArray | None) -> Array:
    return layer.layer(x, key=key)  # pyright: ignore[reportCallIssue]


def _quant_forward(layer: AbstractQuantLayer, x: Array, key: PRNGKeyArray | None) -> Array:
    float_layer = layer.layer
    weight = float_layer.weight  # pyright: ignore[reportAttributeAccessIssue]
    vector = as_vector(float_layer, x)
    quantizers = (layer.weight_quant, layer.input_quant)
    if layer.matmul == "float" or not all(integer_grid(q) for q in quantizers):  # pyright: ignore
        return layer._float_path(x, key)
    # The integer forward uses of the fake-quantized operands only their tangents (`value=False`), and a linear
    # product no full NaN mask (below).
    mask = not isinstance(float_layer, eqx.nn.Linear)
    wq, w, w_nan = layer.weight_quant.fake_quant_and_array(weight, value=False, mask=mask)  # pyright: ignore[reportOptionalMemberAccess]
    xq, x_int, x_nan = layer.input_quant.fake_quant_and_array(vector, value=False, mask=mask)  # pyright: ignore[reportOptionalMemberAccess]
    spec = plan(float_layer, weight.shape, w, x_int)
    if isinstance(spec, LinearSpec):
        # A linear product needs to know only which rows of the weight, and whether the input, hold a NaN.
        w_nan = nan_levels(weight, w, tuple(range(1, w.values.ndim)))
        x_nan = nan_levels(vector, x_int, tuple(range(x_int.values.ndim)))
    backward = getattr(layer, "backward", None)
    backward = backward if isinstance(backward, QuantizedBackward) else None
    if spec is None:
        if backward is not None:
            wide = any_float64(weight.dtype, vector.dtype)
            raise ValueError(
                "This layer has a `backward=QuantizedBackward(...)`, which needs the integer forward, but "
                + (
                    f"its operands compute in float64 (weight {weight.dtype}, input {vector.dtype}), which takes the "
                    "float product."
                    if wide
                    else f"its quantizers (weight_quant={layer.weight_quant!r}, input_quant={layer.input_quant!r}) "
                    "compute in floating point: the weight needs one scale per tensor, per output channel or per "
                    "group along the contraction, and the input one scale per tensor."
                )
            )
        return layer._float_path(x, key)
    # With the quantized backward, the input's gradient comes from it instead of the float product's transpose.
    x_derivative = xq if backward is None else jax.lax.stop_gradient(xq)
    y = integer_forward(spec, wq, x_derivative, float_layer.bias, w, x_int, w_nan, x_nan, weight, vector)  # pyright: ignore[reportArgumentType]
    if backward is not None:
        y = quantized_input_gradient(backward, y, xq, w, weight, key)
    return scalar_output(float_layer, y.astype(weight.dtype))


class QuantLinear(AbstractQuantLayer):
    """An `eqx.nn.Linear` computed on a fake-quantized weight and input.

    **Integer forward.** With `matmul="int"` (the default), when the weight quantizer has one scale per tensor or per
    output channel, and the input quantizer one scale for the whole input, the forward pass
    runs the integer product: the weight's and the input's integers (minus zero points) are multiplied with int32
    accumulation, the sum is rescaled and the bias added, `y = (acc * scale_w) * scale_x + bias` — the
    computation of the converted [`eqx_quant.nn.ConvertedLinear`][], bit for bit, in eager mode and under `jit` alike.
    It differs from the float product `fake_quant(W) @ fake_quant(x) + b` only by that product's rounding errors,
    which the exact integer sum does not make. The backward pass is that of the fake-quant formulation
    `y = fake_quant(W) @ fake_quant(x) + b`: the float product's gradients, through the quantizers'
    straight-through estimators (and learned-scale gradients), unless `backward` asks for the opt-in quantized
    backward ([`eqx_quant.QuantizedBackward`][]), which computes the input's gradient as an integer product. A
    weight with one scale per group along the contraction (`group_size`) runs on integers as well: each group's
    int32 sum is scaled by its group's scale, the scaled sums are added in float32, rescaled by the input's scale,
    and the bias is added. Otherwise, or with `matmul="float"`, the forward is that float product.

    !!! example

        ```python
        import equinox as eqx
        import jax
        import jax.numpy as jnp
        import eqx_quant

        linear = eqx.nn.Linear(3, 2, key=jax.random.key(0))
        qlinear = eqx_quant.nn.QuantLinear(linear, weight_quant=eqx_quant.DynamicFakeQuant(4, axis=0))
        print(qlinear(jnp.ones(3)))
        ```
    """

    layer: eqx.nn.Linear
    weight_quant: AbstractQuantizer | None
    input_quant: AbstractQuantizer | None
    matmul: Literal["int", "float"] = eqx.field(static=True)
    backward: QuantizedBackward | UnquantizedBackward | None = eqx.field(static=True)
    input_transform: AbstractInputTransform | None

    def __init__(
        self,
        layer: eqx.nn.Linear,
        *,
        weight_quant: AbstractQuantizer | None = default_weight_quant(),
        input_quant: AbstractQuantizer | None = default_input_quant(),
        matmul: Literal["int", "float"] = "int",
        backward: QuantizedBackward | UnquantizedBackward | None = None,
        input_transform: AbstractInputTransform | None = None,
    ):
        """**Arguments:**

        - `layer`: the float layer.
        - `weight_quant`: the weight quantizer, applied to `layer.weight` of shape `(out_features, in_features)`;
            by default 8 bits per output channel. `None` keeps the weight in floating point.
        - `input_quant`: the input quantizer; by default 8 bits per tensor. `None` keeps the input as it is.
        - `matmul`: `"int"` to compute the forward with the integer product where the quantizers allow it,
            `"float"` for the float product of the fake-quantized operands.
        - `backward`: `None` (default) for the float backward of the fake-quant formulation; an
            [`eqx_quant.QuantizedBackward`][] to compute the input's gradient with an integer product (it needs
            `matmul="int"` and integer quantizers for both operands); or an [`eqx_quant.UnquantizedBackward`][] for
            the float layer's gradients at the original operands. Both change the gradient contract.
        - `input_transform`: `None`, or an invertible map `T` of the input applied before the input quantizer
            ([`eqx_quant.nn.ScaleInput`][], [`eqx_quant.nn.RotateInput`][]), whose inverse `layer.weight` has
            absorbed: the layer computes `layer.weight @ input_quant(T x)`. [`eqx_quant.smoothquant`][],
            [`eqx_quant.awq`][] and [`eqx_quant.rotate`][] set it.
        """
        self.layer = layer
        self.weight_quant = weight_quant
        self.input_quant = input_quant
        self.matmul = matmul
        self.backward = backward
        self.input_transform = input_transform

    def __check_init__(self):
        if not isinstance(self.layer, eqx.nn.Linear):
            raise TypeError(f"`layer` must be an eqx.nn.Linear, got {type(self.layer).__name__}.")
        check_quantizer("weight_quant", self.weight_quant)
        check_floating_weight(self.layer, self.weight_quant)
        check_quantizer("input_quant", self.input_quant)
        check_matmul(self.matmul)
        check_backward(self.backward)
        check_unquantized_backward(self)
        check_transform(self.layer, self.input_transform)
        if isinstance(self.backward, QuantizedBackward):
            if self.matmul != "int":
                raise ValueError(f"`backward` needs the integer forward, matmul='int'; got matmul={self.matmul!r}.")
            for name in ("weight_quant", "input_quant"):
                if not integer_grid(getattr(self, name)):
                    raise ValueError(
                        f"`backward` needs an integer quantizer for both operands; got {name}={getattr(self, name)!r}."
                    )

    def __call__(self, x: Float[Array, "*in"], *, key: PRNGKeyArray | None = None) -> Float[Array, "*out"]:
        """Like `eqx.nn.Linear.__call__`, on the fake-quantized weight and input."""
        with jax.named_scope("eqx_quant.QuantLinear"):
            check_input(self.layer, x)
            if self.input_transform is not None:
                x = self.input_transform(x)
            elif self.weight_quant is None and self.input_quant is None:
                return self.layer(x, key=key)  # the float layer that `convert` gives back, called alike
            return quant_forward(self, x, key)


def as_vector(layer: eqx.Module, x: Array) -> Array:
    """The input as the integer products take it: a scalar input of a layer with `in_features="scalar"` as `(1,)`."""
    return jnp.broadcast_to(x, (1,)) if getattr(layer, "in_features", None) == "scalar" else x


def scalar_output(layer: eqx.Module, y: Array) -> Array:
    """Squeezes the output of a layer with `out_features="scalar"`, as `eqx.nn.Linear` does."""
    return jnp.squeeze(y) if getattr(layer, "out_features", None) == "scalar" else y


class QuantConv(AbstractQuantLayer):
    """An `eqx.nn.Conv` (`Conv1d`, `Conv2d`, `Conv3d`, or any dimensionality) computed on a fake-quantized weight
    and input.

    The weight has shape `(out_channels, in_channels // groups, *kernel_size)`; the default weight quantizer has one
    scale per output channel. With `matmul="int"` (the default), zero padding, a per-tensor or per-output-channel
    weight grid, a per-tensor input grid and a contraction within the int32 bound, the forward runs the integer
    convolution of the converted [`eqx_quant.nn.ConvertedConv`][], bit for bit, with the gradients of the float
    convolution of the fake-quantized operands; see [`eqx_quant.nn.QuantLinear`][]. (On CPU, where XLA's integer
    convolution is slow, a convolution whose partial sums stay within `2**24` runs as an exact float32 convolution of
    the same integers: see [Parity with integer inference](../concepts/parity.md#the-integer-forward).)
    """

    layer: eqx.nn.Conv
    weight_quant: AbstractQuantizer | None
    input_quant: AbstractQuantizer | None
    matmul: Literal["int", "float"] = eqx.field(static=True)
    backward: UnquantizedBackward | None = eqx.field(static=True)

    def __init__(
        self,
        layer: eqx.nn.Conv,
        *,
        weight_quant: AbstractQuantizer | None = default_weight_quant(),
        input_quant: AbstractQuantizer | None = default_input_quant(),
        matmul: Literal["int", "float"] = "int",
        backward: UnquantizedBackward | None = None,
    ):
        """**Arguments:**

        - `layer`: the float convolution.
        - `weight_quant`: the weight quantizer; by default 8 bits per output channel. `None` keeps the float weight.
        - `input_quant`: the input quantizer; by default 8 bits per tensor. `None` keeps the input as it is.
        - `matmul`: `"int"` for the integer convolution where the quantizers allow it, `"float"` for the float one.
        - `backward`: `None` (default) for the float backward of the fake-quant formulation, or an
            [`eqx_quant.UnquantizedBackward`][] for the float convolution's gradients at the original operands
            (which changes the gradient contract).
        """
        self.layer = layer
        self.weight_quant = weight_quant
        self.input_quant = input_quant
        self.matmul = matmul
        self.backward = backward

    def __check_init__(self):
        if not isinstance(self.layer, eqx.nn.Conv):
            raise TypeError(f"`layer` must be an eqx.nn.Conv, got {type(self.layer).__name__}.")
        check_quantizer("weight_quant", self.weight_quant)
        check_floating_weight(self.layer, self.weight_quant)
        check_quantizer("input_quant", self.input_quant)
        check_matmul(self.matmul)
        if self.backward is not None and not isinstance(self.backward, UnquantizedBackward):
            raise TypeError(f"`backward` must be an UnquantizedBackward or None, got backward={self.backward!r}.")
        check_unquantized_backward(self)

    def __call__(
        self, x: Float[Array, "in_channels *spatial"], *, key: PRNGKeyArray | None = None
    ) -> Float[Array, "out_channels *out_spatial"]:
        """Like `eqx.nn.Conv.__call__`, on the fake-quantized weight and input."""
        with jax.named_scope("eqx_quant.QuantConv"):
            check_input(self.layer, x)
            if self.weight_quant is None and self.input_quant is None:
                return self.layer(x, key=key)  # the float layer that `convert` gives back, called alike
            return quant_forward(self, x, key)


class QuantEmbedding(AbstractQuantLayer):
    """An `eqx.nn.Embedding` whose table is fake-quantized (by default with one scale per row).

    Its input is an integer index, so `input_quant` must be `None`.
    """

    layer: eqx.nn.Embedding
    weight_quant: AbstractQuantizer | None

    def __init__(
        self,
        layer: eqx.nn.Embedding,
        *,
        weight_quant: AbstractQuantizer | None = default_weight_quant(),
        input_quant: None = None,
    ):
        """**Arguments:**

        - `layer`: the float embedding, with a weight of shape `(num_embeddings, embedding_size)`.
        - `weight_quant`: the table quantizer; by default 8 bits per row. `None` keeps the float table.
        - `input_quant`: must be `None` (the input is an index); accepted so that every quantized layer takes the
            same arguments.
        """
        if input_quant is not None:
            raise ValueError(
                f"`input_quant` must be None for an embedding (its input is an index), got {input_quant!r}."
            )
        self.layer = layer
        self.weight_quant = weight_quant

    def __check_init__(self):
        if not isinstance(self.layer, eqx.nn.Embedding):
            raise TypeError(f"`layer` must be an eqx.nn.Embedding, got {type(self.layer).__name__}.")
        check_quantizer("weight_quant", self.weight_quant)
        check_floating_weight(self.layer, self.weight_quant)

    @property
    def input_quant(self) -> None:
        """`None`: an embedding's input is an index, which is never quantized."""
        return None

    def __call__(self, x: Int[ArrayLike, ""], *, key: PRNGKeyArray | None = None) -> Float[Array, " embedding_size"]:
        """Like `eqx.nn.Embedding.__call__`: the fake-quantized row `x` of the table."""
        with jax.named_scope("eqx_quant.QuantEmbedding"):
            row = self.quantized_layer()(x, key=key)  # pyright: ignore[reportCallIssue]
            # Computed before what reads it, as the converted embedding's row is (see `computed_before`).
            return computed_before(row, self.layer.weight)
