"""Helpers of quantization-aware training: what trains, and the distillation loss."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, ArrayLike, Float, PyTree

from ._misc import is_concrete
from ._quantizers import AbstractQuantizer


_SCALE_FIELDS = ("scale", "tensor_scale")


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
    quantizer. Static and dynamic quantizers hold no floating arrays and never train. Stacked layers (built with
    `eqx.filter_vmap`) are selected like any other: their arrays carry the stack's leading axes.

    **Arguments:**

    - `model`: a model from [`eqx_quant.quantize`][] (or any model: without quantizers, only `weights` matters).
    - `weights`, `scales`, `zero_points`, `input_quantizers`: what trains, as above; all `True` by default, which
        selects what `eqx.is_inexact_array` selects.

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
        return isinstance(node, AbstractQuantizer)

    def quantizer_spec(role_weight: bool, path: tuple, leaf: object) -> bool:
        if not eqx.is_inexact_array(leaf):
            return False
        if not role_weight:
            return input_quantizers
        field = getattr(path[0], "name", None) if path else None
        return zero_points if field == "zero_point" else scales if field in _SCALE_FIELDS else weights

    def spec(path: tuple, node: object) -> object:
        if is_quantizer(node):
            role_weight = bool(path) and getattr(path[-1], "name", None) == "weight_quant"
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
    finite logits; take the mean over positions (and the batch) for a scalar loss.

    **Arguments:**

    - `student_logits`: the quantized model's logits, classes on the last axis.
    - `teacher_logits`: the float model's logits, of the same shape.
    - `temperature`: $T > 0$; 1 by default.

    **Returns:**

    The loss per position, of shape `student_logits.shape[:-1]`.

    **Raises:**

    `ValueError` if the shapes differ, if the logits are scalars, or for a temperature that is not positive and
    finite (when concrete). `TypeError` for a non-numeric temperature.

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
    return jnp.sum(jnp.exp(log_p) * (log_p - log_q), axis=-1) * (temperature * temperature)
