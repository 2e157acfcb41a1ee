"""Helpers of quantization-aware training: what trains, and the distillation loss."""

import functools
from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, ArrayLike, Float, Int, PyTree

from ._backward import UnquantizedBackward
from ._misc import FLOAT32_TINY, is_concrete, keeps_the_mesh, one_program
from ._observe import check_not_converted, layer_stack
from ._quantizers import AbstractFakeQuantizer, AbstractQuantizer, DynamicFakeQuant, FakeQuant, LearnedFakeQuant
from ._rules import float_model
from ._traced import QuantTraced, leaves_by_path, replaced
from ._tree import map_nodes, nodes
from .nn._attention import QuantMultiheadAttention
from .nn._einsum import QuantEinsum
from .nn._layers import AbstractQuantLayer, per_layer
from .nn._transforms import AbstractInputTransform


_SCALE_FIELDS = ("scale", "tensor_scale")
_QUANTIZED = (AbstractQuantLayer, QuantEinsum, QuantMultiheadAttention)


def trainable(
    model: PyTree,
    *,
    weights: bool = True,
    scales: bool = True,
    zero_points: bool = True,
    input_quantizers: bool = True,
) -> PyTree[bool]:
    """A filter specification choosing what quantization-aware training updates: a PyTree with the structure of
    `model`, `True` at the floating-point arrays that train and `False` everywhere else, for `eqx.partition`,
    `eqx.filter` or an optax mask.

    The floating-point arrays of a quantized model are of four kinds, each switched on or off:

    - `weights`: the model's own parameters, every floating array that is not a quantizer's (the weights and biases
        of the wrapped layers, embeddings, normalisations, and anything else of the model);
    - `scales`: the learned scales of the weight quantizers (`scale`, and `tensor_scale` for NVFP4) of
        [`eqx_quant.LearnedFakeQuant`][]s;
    - `zero_points`: their learned zero points;
    - `input_quantizers`: every array of the quantizers of activations (`input_quant` of the layers, the operands'
        quantizers of [`eqx_quant.nn.QuantEinsum`][]): the per-layer scales that [`eqx_quant.calibrate`][] gives a
        stack of layers, or learned input scales.

    A weight quantizer is one held as a layer's `weight_quant`; every other quantizer counts as an activations'
    quantizer. The arrays of input transforms ([`eqx_quant.nn.ScaleInput`][]) are never selected. Static and dynamic
    quantizers hold no floating arrays and never train. Stacked layers (built with
    `eqx.filter_vmap`) are selected like any other: their arrays carry the stack's leading axes.

    **Arguments:**

    - `model`: a model from [`eqx_quant.quantize`][] (or any model: without quantizers, only `weights` matters).
    - `weights`, `scales`, `zero_points`, `input_quantizers`: what trains, as above; all `True` by default, which
        selects what `eqx.is_inexact_array` selects but the arrays of input transforms.

    **Returns:**

    The filter specification: `eqx.partition(model, trainable(model, ...))` splits the model into what trains and the
    rest.

    **Raises:**

    `TypeError` if a switch is not a bool. `ValueError` if the selection is empty (nothing would train).

    !!! example

        ```python
        import equinox as eqx
        import jax
        import jax.numpy as jnp
        import eqx_quant

        mlp = eqx.nn.MLP(32, 4, 32, 1, key=jax.random.key(0))
        qmlp = eqx_quant.quantize(mlp, **eqx_quant.recipe("w4a8_g32", learned=True))
        # Train the quantizers' scales only, the weights held fixed:
        spec = eqx_quant.trainable(qmlp, weights=False)
        params, static = eqx.partition(qmlp, spec)
        print([leaf.shape for leaf in jax.tree.leaves(params)])  # [(32, 1), (4, 1)]
        ```
    """
    for name, value in (
        ("weights", weights),
        ("scales", scales),
        ("zero_points", zero_points),
        ("input_quantizers", input_quantizers),
    ):
        if not isinstance(value, bool):
            raise TypeError(f"`{name}` must be a bool, got {name}={value!r}.")

    def is_quantizer(node: object) -> bool:
        return isinstance(node, (AbstractQuantizer, AbstractInputTransform))

    def quantizer_spec(role_weight: bool, path: tuple, leaf: object) -> bool:
        if not eqx.is_inexact_array(leaf):
            return False
        if not role_weight:
            return input_quantizers
        field = getattr(path[0], "name", None) if path else None
        return zero_points if field == "zero_point" else scales if field in _SCALE_FIELDS else weights

    def spec(path: tuple, node: object) -> object:
        if isinstance(node, AbstractInputTransform):  # fixed by the algorithm that made it: never trains
            return jax.tree.map(lambda _: False, node)
        if is_quantizer(node):
            names = [getattr(key, "name", None) for key in path[-2:]]
            role_weight = names[-1:] == ["weight_quant"] or names[:1] == ["weight_quants"]  # a layer's or traced
            return jax.tree_util.tree_map_with_path(lambda p, leaf: quantizer_spec(role_weight, p, leaf), node)
        return weights and eqx.is_inexact_array(node)

    selection = jax.tree_util.tree_map_with_path(spec, model, is_leaf=is_quantizer)
    if not any(jax.tree.leaves(selection)):
        raise ValueError(
            f"Nothing would train: the model has no floating arrays of the kinds chosen (weights={weights}, "
            f"scales={scales}, zero_points={zero_points}, input_quantizers={input_quantizers})."
        )
    return selection


def distillation_loss(
    student_logits: Float[ArrayLike, "*student"],
    teacher_logits: Float[ArrayLike, "*teacher"],
    *,
    temperature: float | int = 1.0,
) -> Float[Array, "*positions"]:
    r"""The distillation loss of a quantized student against a float teacher, per position: the KL divergence from
    the teacher's distribution to the student's, at a temperature,

    $$T^2 \sum_c p_c \,(\log p_c - \log q_c), \qquad p = \mathrm{softmax}(t / T),\ q = \mathrm{softmax}(s / T),$$

    over the last axis (the classes, or the vocabulary). The factor $T^2$ keeps the gradients' scale independent of
    the temperature (Hinton et al., 2015). The teacher's logits receive no gradient (`jax.lax.stop_gradient`).
    Computed in float32 (float16 and bfloat16 logits are promoted) with `log_softmax`, so that it is finite for any
    finite logits; take the mean over positions (and the batch) for a scalar loss. A class of teacher probability 0
    (a logit of `-inf`, a masked vocabulary entry) contributes 0, the limit of $p \log p$, and no gradient.

    **Arguments:**

    - `student_logits`: the quantized model's logits, classes on the last axis.
    - `teacher_logits`: the float model's logits, of the same shape.
    - `temperature`: $T > 0$; 1 by default.

    **Returns:**

    The loss per position, of shape `student_logits.shape[:-1]`.

    **Raises:**

    `ValueError` if the shapes differ, if the logits are scalars, or for a temperature that is not positive and
    finite (when concrete). `TypeError` for a non-numeric temperature, or logits that are not floats.

    !!! example

        ```python
        import jax.numpy as jnp
        import eqx_quant

        teacher = jnp.array([[2.0, 0.0, -1.0], [0.0, 0.0, 0.0]])
        print(eqx_quant.distillation_loss(teacher, teacher))  # [0. 0.]
        print(eqx_quant.distillation_loss(jnp.zeros((2, 3)), teacher).shape)  # (2,)
        ```
    """
    if isinstance(temperature, bool) or not isinstance(temperature, (int, float, np.integer, np.floating, jax.Array)):
        raise TypeError(f"`temperature` must be a positive number, got temperature={temperature!r}.")
    if is_concrete(temperature) and not (np.isfinite(float(temperature)) and float(temperature) > 0):
        raise ValueError(f"`temperature` must be positive and finite, got temperature={temperature!r}.")
    student, teacher = jnp.asarray(student_logits), jnp.asarray(teacher_logits)
    for name, logits in (("student_logits", student), ("teacher_logits", teacher)):
        if not jnp.issubdtype(logits.dtype, jnp.floating):
            raise TypeError(f"`{name}` must be floating logits, got dtype {logits.dtype}.")
    if student.shape != teacher.shape:
        raise ValueError(
            f"`student_logits` and `teacher_logits` must have the same shape, got {student.shape} and {teacher.shape}."
        )
    if student.ndim == 0:
        raise ValueError("the logits must have a classes axis (the last), got scalars.")
    dtype = jnp.float64 if jnp.float64 in (student.dtype, teacher.dtype) else jnp.float32
    student = student.astype(dtype)
    teacher = jax.lax.stop_gradient(teacher.astype(dtype))
    log_q = jax.nn.log_softmax(student / temperature, axis=-1)
    log_p = jax.nn.log_softmax(teacher / temperature, axis=-1)
    p = jnp.exp(log_p)
    # A class the teacher rules out (probability 0) contributes 0, as in the KL divergence; NaN stays NaN.
    return jnp.sum(jnp.where(p == 0, 0.0, p * (log_p - log_q)), axis=-1) * (temperature * temperature)


def _is_learnable(quantizer: object) -> bool:
    """Whether `learn_scales` makes `quantizer` learned: a fixed or dynamic quantizer with float32 scales."""
    return (
        isinstance(quantizer, (FakeQuant, DynamicFakeQuant))
        and quantizer.format.scale == "float32"
        and getattr(quantizer, "axis_name", None) is None
    )


def _learned_like(quantizer: FakeQuant | DynamicFakeQuant, weight: Array) -> LearnedFakeQuant:
    """A `LearnedFakeQuant` holding the scales (and zero points) that `quantizer` uses for `weight`."""
    layout = quantizer.layout
    scales = quantizer.scales(jax.lax.stop_gradient(weight))
    shape, broadcast = weight.shape, layout.broadcast_shape(weight.shape)

    def compact(a: Array) -> Array:
        return layout.compact(jnp.broadcast_to(jnp.asarray(a, jnp.float32), broadcast), shape)

    zero_point = None if scales.zero_point is None else compact(scales.zero_point)
    return LearnedFakeQuant(
        compact(scales.scale), format=quantizer.format, zero_point=zero_point, layout=layout, min_scale=FLOAT32_TINY
    )


@keeps_the_mesh
def learn_scales(model: PyTree) -> PyTree:
    """Makes the scales of every weight quantizer learned, starting exactly where they are: the step for training
    the result of post-training quantization on (QAT from PTQ).

    Each weight quantizer with float32 scales (integer grids, and FP8, FP6 and FP4 elements with float32 scales) that
    is fixed ([`eqx_quant.FakeQuant`][]: the scales of [`eqx_quant.gptq`][], or of
    [`eqx_quant.FakeQuant.fit`][]) or dynamic ([`eqx_quant.DynamicFakeQuant`][]: round to nearest) becomes a
    [`eqx_quant.LearnedFakeQuant`][] holding the scales, and zero points, that it uses for the layer's current
    weight, one set per layer of a stack (layers built with `eqx.filter_vmap`); and so does every such quantizer of
    a traced weight of an [`eqx_quant.nn.QuantTraced`][]. The model's outputs are unchanged,
    bit for bit; from there on, gradients train the weights and their scales together (choose what trains with
    [`eqx_quant.trainable`][]).

    Left as they are: learned quantizers; block formats, whose scales follow each block of the weight (MX, NVFP4,
    the GGML formats: their weights still train); quantizers with an `axis_name`; input quantizers; and the
    quantizer of a layer whose weight is the placeholder of an `eqx.nn.Shared` tie (a tied output head: its weight is
    the embedding's, whose own quantizer becomes learned).

    **Arguments:**

    - `model`: a quantized model, e.g. from [`eqx_quant.quantize`][], [`eqx_quant.gptq`][] or
        [`eqx_quant.calibrate`][].

    **Returns:**

    The model with learned weight scales.

    **Raises:**

    `ValueError` if the model has no weight quantizer with float32 scales (nothing could be learned), or if such a
    layer differentiates as the float layer ([`eqx_quant.UnquantizedBackward`][]: its scales would get no gradient).

    !!! example

        ```python
        import equinox as eqx
        import jax
        import eqx_quant

        mlp = eqx.nn.MLP(32, 4, 32, 1, key=jax.random.key(0))
        x = jax.random.normal(jax.random.key(1), (64, 32))
        ptq = eqx_quant.gptq(eqx_quant.quantize(mlp, **eqx_quant.recipe("w4a16_g32", keep=())), [x])
        qat = eqx_quant.learn_scales(ptq)
        q = qat.layers[0].weight_quant
        print(type(q).__name__, q.scale.shape)  # LearnedFakeQuant (32, 1)
        ```
    """
    check_not_converted(model, "learn_scales")
    layers = [
        (path, layer)
        for path, layer in nodes(model, (AbstractQuantLayer,))
        if isinstance(layer.weight_quant, AbstractFakeQuantizer) and eqx.is_array(layer.layer.weight)
    ]
    chosen = {path for path, layer in layers if _is_learnable(layer.weight_quant)}
    traced = [q for _, t in nodes(model, (QuantTraced,)) for q in t.weight_quants]
    if (
        not chosen
        and not any(isinstance(layer.weight_quant, LearnedFakeQuant) for _, layer in layers)
        and not any(_is_learnable(q) or isinstance(q, LearnedFakeQuant) for q in traced)
    ):
        raise ValueError(
            "`model` has no weight quantizer with float32 scales to learn (a FakeQuant or DynamicFakeQuant onto an "
            "integer grid or a float element type); block formats keep their block scales."
        )

    for path, layer in layers:
        if path in chosen and isinstance(getattr(layer, "backward", None), UnquantizedBackward):
            raise ValueError(
                f"Layer {path!r} differentiates as the float layer (`backward=UnquantizedBackward()`), which gives "
                "scales no gradient: learned scales would never train. Quantize it without that backward first."
            )

    def learn(path: str, layer: AbstractQuantLayer) -> AbstractQuantLayer:
        if path not in chosen:
            return layer
        make = per_layer(functools.partial(_learned_like, layer.weight_quant), len(layer_stack(layer)))
        return eqx.tree_at(lambda l: l.weight_quant, layer, one_program(make)(layer.layer.weight))

    def learn_traced(root: str, module: QuantTraced) -> QuantTraced:
        # A traced weight's quantizer covers its whole leaf (a stack's layers are among its channels).
        leaves = leaves_by_path(module.model)
        weights = [
            one_program(functools.partial(_learned_like, q))(leaves[path])
            if _is_learnable(q) and path in leaves and eqx.is_array(leaves[path]) else q
            for path, q in zip(module.weight_paths, module.weight_quants, strict=True)
        ]  # fmt: skip
        return replaced(module, weight_quants=weights)

    model = map_nodes(model, (AbstractQuantLayer,), learn)
    return map_nodes(model, (QuantTraced,), learn_traced) if traced else model


def quantized_after(
    n_steps: int, step: Int[ArrayLike, ""], fn: Callable[..., Any], model: PyTree, *args: Any, **kwargs: Any
) -> Any:
    """Delayed quantization: `fn(model, *args, **kwargs)` computed with the float model before step `n_steps` and
    with the quantized model from it on, in one program.

    Before the switch (`step < n_steps`) the call is `fn(eqx_quant.float_model(model), ...)`: the float layers with
    the same weights, so that training updates the weights the quantized layers will use; from `step >= n_steps` on,
    `fn(model, ...)`. The choice is a `jax.lax.cond` on the traced `step`: a jitted training step is traced and
    compiled once, with both branches, and each step runs one of them. Before the switch, the quantizers' own arrays
    (learned scales) receive zero gradients, and keep the values they had under an optimizer that moves a leaf by its
    gradient alone (an optimizer's weight decay, as `optax.adamw`'s, still shrinks them: give it as `mask`
    `eqx_quant.trainable(params, scales=False, zero_points=False, input_quantizers=False)`, the weights alone, for
    the `params` it updates); a learned scale that should follow the
    weights trained in float can be re-initialised at the switch (which costs one more compilation), or the
    quantizers kept dynamic.

    Each branch is compiled as part of the `cond`: its value equals `fn`'s compiled on its own in our tests, but XLA
    may order a sum differently inside the branch (a gradient one ulp apart has been seen), and an eager call
    compiles the branches where a plain eager call of `fn` runs operation by operation.

    **Arguments:**

    - `n_steps`: the number of float steps, a non-negative int (0: quantized from the start).
    - `step`: the current step, an integer scalar: inside a jitted training step, an array argument (e.g. the step
        count of an optax state), since a Python int is static to `eqx.filter_jit` and compiles once per value.
    - `fn`: a function of the model and `args` returning a PyTree of arrays (a loss, logits, `(loss, aux)`); both
        branches must return the same structure.
    - `model`: a quantized model (from [`eqx_quant.quantize`][]).
    - `args`, `kwargs`: passed to `fn`.

    **Returns:**

    What `fn` returns.

    **Raises:**

    `TypeError` for an `n_steps` that is not an int, a `step` that is not an integer scalar, an `fn` that is not
    callable, or one that returns something other than arrays. `ValueError` for a negative `n_steps`, or a `model`
    without quantized layers (delaying would change nothing).

    !!! example

        ```python
        import equinox as eqx
        import jax
        import jax.numpy as jnp
        import eqx_quant

        mlp = eqx.nn.MLP(32, 1, 32, 1, key=jax.random.key(0))
        qmlp = eqx_quant.quantize(mlp, **eqx_quant.recipe("w4a8_g32"))
        x = jax.random.normal(jax.random.key(1), (4, 32))
        loss = eqx.filter_jit(lambda m: jnp.mean(jax.vmap(m)(x) ** 2))
        delayed = eqx.filter_jit(lambda m, step: eqx_quant.quantized_after(100, step, loss, m))
        before, after = delayed(qmlp, jnp.asarray(99)), delayed(qmlp, jnp.asarray(100))
        print(before == loss(eqx_quant.float_model(qmlp)), after == loss(qmlp))  # True True
        ```
    """
    if isinstance(n_steps, bool) or not isinstance(n_steps, (int, np.integer)):
        raise TypeError(f"`n_steps` must be an int, got n_steps={n_steps!r}.")
    if n_steps < 0:
        raise ValueError(f"`n_steps` must be non-negative, got n_steps={n_steps}.")
    if isinstance(step, bool) or not isinstance(step, (int, np.integer, np.ndarray, jax.Array)):
        raise TypeError(f"`step` must be an integer scalar, got step={step!r}.")
    step = jnp.asarray(step)
    if step.ndim != 0 or not jnp.issubdtype(step.dtype, jnp.integer):
        raise TypeError(f"`step` must be an integer scalar, got an array of shape {step.shape} and dtype {step.dtype}.")
    if not callable(fn):
        raise TypeError(f"`fn` must be callable, got fn={fn!r}.")
    if not nodes(model, _QUANTIZED):
        raise ValueError(
            "`model` has no quantized layer (QuantLinear, QuantConv, QuantEmbedding, QuantEinsum, "
            "QuantMultiheadAttention): it is the same model before and after the switch."
        )
    dynamic, static = eqx.partition((model, args, kwargs), eqx.is_array)

    def branch(quantized: bool, dynamic: PyTree) -> Any:
        m, a, k = eqx.combine(dynamic, static)
        out = fn(m if quantized else float_model(m), *a, **k)
        for leaf in jax.tree.leaves(out):
            if not eqx.is_array(leaf):
                raise TypeError(
                    f"`fn` must return a PyTree of arrays (both branches of the switch return it), got a leaf "
                    f"{leaf!r} of type {type(leaf).__name__}."
                )
        return out

    return jax.lax.cond(step >= n_steps, functools.partial(branch, True), functools.partial(branch, False), dynamic)
