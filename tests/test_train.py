"""`trainable` (what QAT updates) on stacked and unstacked layers, and `distillation_loss` against NumPy."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import eqx_quant
from eqx_quant._tree import path_string

from .models import LinearStack


RNG = np.random.default_rng(0)
MLP = eqx.nn.MLP(32, 4, 32, 1, key=jax.random.key(0))


def _selected(model, spec) -> set[str]:
    leaves = jax.tree_util.tree_flatten_with_path(eqx.filter(model, spec))[0]
    return {path_string(path) for path, leaf in leaves if leaf is not None}


def _quantized_with_every_kind():
    return eqx_quant.quantize(
        MLP,
        weights=lambda path, layer: eqx_quant.LearnedFakeQuant.init_from(layer.weight, 4, symmetric=False, axis=0),
        activations=eqx_quant.LearnedFakeQuant(0.05, -128, 127),
    )


@pytest.mark.parametrize("weights", [True, False])
@pytest.mark.parametrize("scales", [True, False])
@pytest.mark.parametrize("zero_points", [True, False])
@pytest.mark.parametrize("input_quantizers", [True, False])
def test_trainable_selects_each_kind_of_array(weights, scales, zero_points, input_quantizers):
    model = _quantized_with_every_kind()
    kinds = {
        "weights": [f"layers.{i}.layer.{name}" for i in (0, 1) for name in ("weight", "bias")],
        "scales": [f"layers.{i}.weight_quant.scale" for i in (0, 1)],
        "zero_points": [f"layers.{i}.weight_quant.zero_point" for i in (0, 1)],
        "input_quantizers": [f"layers.{i}.input_quant.scale" for i in (0, 1)],
    }
    chosen = dict(weights=weights, scales=scales, zero_points=zero_points, input_quantizers=input_quantizers)
    want = {path for kind, paths in kinds.items() if chosen[kind] for path in paths}
    if not want:
        with pytest.raises(ValueError, match="Nothing would train"):
            eqx_quant.trainable(model, **chosen)
        return
    assert _selected(model, eqx_quant.trainable(model, **chosen)) == want
    # Everything on is what `eqx.is_inexact_array` selects.
    if all(chosen.values()):
        assert want == _selected(model, eqx.is_inexact_array)


def test_trainable_on_stacked_layers_leaves_the_calibrated_input_scales_out():
    """`calibrate` gives a stack per-layer input scales as arrays; `input_quantizers=False` keeps them fixed while the
    stacked weights and their learned scales train."""
    model = eqx_quant.quantize(LinearStack(32, 3, jax.random.key(1)), **eqx_quant.recipe("w8a8", learned=True))
    batches = [jnp.asarray(RNG.standard_normal((8, 32)).astype(np.float32)) for _ in range(2)]
    model = eqx_quant.calibrate(model, batches)
    spec = eqx_quant.trainable(model, input_quantizers=False)
    assert _selected(model, spec) == {"blocks.layer.weight", "blocks.layer.bias", "blocks.weight_quant.scale"}
    assert model.blocks.input_quant.scale.shape == (3,)  # one per layer of the stack, left out

    # One SGD step through `eqx.partition`: the selected arrays move, the others stay bit for bit.
    params, static = eqx.partition(model, spec)

    def loss(p):
        return jnp.sum(jax.vmap(eqx.combine(p, static))(batches[0]) ** 2)

    grads = jax.grad(loss)(params)
    stepped = eqx.combine(jax.tree.map(lambda p, g: p - 1e-3 * g, params, grads), static)
    np.testing.assert_array_equal(stepped.blocks.input_quant.scale, model.blocks.input_quant.scale)
    assert not np.array_equal(stepped.blocks.weight_quant.scale, model.blocks.weight_quant.scale)
    assert not np.array_equal(stepped.blocks.layer.weight, model.blocks.layer.weight)


def test_trainable_errors():
    model = _quantized_with_every_kind()
    with pytest.raises(TypeError, match="scales"):
        eqx_quant.trainable(model, scales=1)  # pyright: ignore[reportArgumentType]
    with pytest.raises(ValueError, match="Nothing would train"):
        eqx_quant.trainable(MLP, weights=False)  # a float model has no quantizers
    dynamic = eqx_quant.quantize(MLP, **eqx_quant.recipe("w8a8"))
    with pytest.raises(ValueError, match="Nothing would train"):
        eqx_quant.trainable(dynamic, weights=False)  # dynamic quantizers hold no arrays


def _reference_kl(student, teacher, temperature):
    s = np.asarray(student, np.float64) / temperature
    t = np.asarray(teacher, np.float64) / temperature
    log_q = s - np.log(np.sum(np.exp(s - s.max(-1, keepdims=True)), -1, keepdims=True)) - s.max(-1, keepdims=True)
    log_p = t - np.log(np.sum(np.exp(t - t.max(-1, keepdims=True)), -1, keepdims=True)) - t.max(-1, keepdims=True)
    return temperature**2 * np.sum(np.exp(log_p) * (log_p - log_q), axis=-1)


@pytest.mark.parametrize("temperature", [1.0, 2.0, 0.5])
def test_distillation_loss_is_the_kl_divergence_from_the_teacher(temperature):
    student = jnp.asarray(RNG.standard_normal((3, 5, 7)).astype(np.float32) * 3)
    teacher = jnp.asarray(RNG.standard_normal((3, 5, 7)).astype(np.float32) * 3)
    got = eqx_quant.distillation_loss(student, teacher, temperature=temperature)
    assert got.shape == (3, 5) and got.dtype == jnp.float32
    np.testing.assert_allclose(got, _reference_kl(student, teacher, temperature), rtol=2e-5, atol=1e-6)
    np.testing.assert_allclose(eqx_quant.distillation_loss(teacher, teacher, temperature=temperature), 0, atol=1e-6)
    # The teacher receives no gradient; the student's is the softmax difference, times T.
    g_s, g_t = jax.grad(lambda s, t: jnp.sum(eqx_quant.distillation_loss(s, t, temperature=temperature)), (0, 1))(
        student, teacher
    )
    np.testing.assert_array_equal(g_t, np.zeros_like(teacher))
    want = temperature * (jax.nn.softmax(student / temperature) - jax.nn.softmax(teacher / temperature))
    np.testing.assert_allclose(g_s, want, rtol=1e-4, atol=1e-6)


def test_distillation_loss_promotes_half_precision_and_stays_finite_for_large_logits():
    student = jnp.asarray([[1000.0, -1000.0, 0.0]], jnp.bfloat16)
    teacher = jnp.asarray([[-1000.0, 1000.0, 0.0]], jnp.bfloat16)
    got = eqx_quant.distillation_loss(student, teacher)
    assert got.dtype == jnp.float32 and np.isfinite(got).all()
    np.testing.assert_allclose(got, [2000.0], rtol=1e-6)


def test_distillation_loss_of_a_teacher_that_rules_out_a_class():
    # p = softmax([-inf, 2, 0]) = [0, e^2, 1] / (e^2 + 1): the first class contributes 0 (p log p -> 0), not NaN.
    teacher = jnp.array([[-jnp.inf, 2.0, 0.0]] * 3)
    student = jnp.array([[1.0, 2.0, 3.0], [-jnp.inf, 2.0, 3.0], [1.0, -jnp.inf, 3.0]])
    p = np.array([0.0, np.e**2, 1.0]) / (np.e**2 + 1)
    q = np.exp([1.0, 2.0, 3.0]) / np.sum(np.exp([1.0, 2.0, 3.0]))
    q_without_first = np.array([0.0, np.e**2, np.e**3]) / (np.e**2 + np.e**3)
    want = [
        p[1] * np.log(p[1] / q[1]) + p[2] * np.log(p[2] / q[2]),
        p[1] * np.log(p[1] / q_without_first[1]) + p[2] * np.log(p[2] / q_without_first[2]),  # both rule it out
        np.inf,  # the student rules out a class the teacher allows
    ]
    np.testing.assert_allclose(eqx_quant.distillation_loss(student, teacher), want, rtol=1e-6)
    # The student's gradient is q - p, finite, 0 for the class both rule out.
    g = jax.grad(lambda s: jnp.sum(eqx_quant.distillation_loss(s, teacher[:2])))(student[:2])
    np.testing.assert_allclose(g, [q - p, q_without_first - p], rtol=1e-5, atol=1e-7)
    # A NaN teacher (a NaN logit, every logit -inf, a +inf logit) stays NaN: not the 0 of a ruled-out class.
    broken = jnp.array([[1.0, jnp.nan, 0.5], [-jnp.inf, -jnp.inf, -jnp.inf], [jnp.inf, 0.0, 0.0]])
    assert np.isnan(np.asarray(eqx_quant.distillation_loss(student, broken))).all()


@pytest.mark.parametrize(
    "student, teacher, kwargs, error, match",
    [
        (np.zeros((2, 3)), np.zeros((2, 4)), {}, ValueError, "same shape"),
        (np.float32(0), np.float32(0), {}, ValueError, "classes axis"),
        (np.zeros((2, 3)), np.zeros((2, 3)), dict(temperature=0.0), ValueError, "temperature"),
        (np.zeros((2, 3)), np.zeros((2, 3)), dict(temperature=float("nan")), ValueError, "temperature"),
        (np.zeros((2, 3)), np.zeros((2, 3)), dict(temperature="1"), TypeError, "temperature"),
    ],
)
def test_distillation_loss_errors(student, teacher, kwargs, error, match):
    with pytest.raises(error, match=match):
        eqx_quant.distillation_loss(student, teacher, **kwargs)
