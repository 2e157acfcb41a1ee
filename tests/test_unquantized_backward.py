"""`UnquantizedBackward`: the quantized forward, differentiated as the float layer at the original operands."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import eqx_quant
from eqx_quant import DynamicFakeQuant, FakeQuant, LearnedFakeQuant, UnquantizedBackward
from eqx_quant.nn import QuantConv, QuantLinear

from .helpers import assert_bitwise_equal, assert_trees_equal, init, slow_unless


F32 = np.float32
UNQUANTIZED = UnquantizedBackward()

# Weight and input quantizers: integer forward (per channel, and grouped), float forward (weight-only, FP8).
LINEAR_CASES = {
    "w8a8": (DynamicFakeQuant(8, axis=0), DynamicFakeQuant(8)),
    "w4a8_g8": (DynamicFakeQuant(4, axis=0, group_size=8), DynamicFakeQuant(8)),
    "w4a16": (DynamicFakeQuant(4, axis=0), None),
    "fp8": (DynamicFakeQuant(format="float8_e4m3fn", axis=0), DynamicFakeQuant(format="float8_e4m3fn")),
}


def _linear(case, backward, seed=0):
    weight_quant, input_quant = LINEAR_CASES[case]
    linear = init(lambda key: eqx.nn.Linear(16, 8, key=key), seed)
    return QuantLinear(linear, weight_quant=weight_quant, input_quant=input_quant, backward=backward)


def _data(seed, shape):
    return jnp.asarray(np.random.default_rng(seed).standard_normal(shape).astype(F32))


@eqx.filter_jit
def _batched_grads(model, x, c):
    """The gradients towards the model and the inputs of `sum(c * vmap(model)(x))`, and the outputs."""

    def loss(model, x):
        y = jax.vmap(model)(x)
        return jnp.sum(c * y), y

    (_, y), grads = eqx.filter_value_and_grad(loss, has_aux=True)(model, x)
    x_grad = jax.grad(lambda x: loss(model, x)[0])(x)
    return y, grads, x_grad


@pytest.mark.parametrize("case", slow_unless(["w8a8", "w4a16"], sorted(LINEAR_CASES)))
def test_linear_forward_unchanged_gradients_those_of_the_float_layer(case):
    default, unquantized = _linear(case, None), _linear(case, UNQUANTIZED)
    x, c = _data(1, (5, 16)) * 3, _data(2, (5, 8))
    y_default, _, _ = _batched_grads(default, x, c)
    y, grads, x_grad = _batched_grads(unquantized, x, c)
    assert_bitwise_equal(y, y_default)  # the forward is the quantized one, bit for bit
    # The gradients are the float layer's, with the same cotangent: bit for bit what JAX gives the float layer...
    _, float_grads, float_x_grad = _batched_grads(unquantized.layer, x, c)
    assert_bitwise_equal(grads.layer.weight, float_grads.weight)
    assert_bitwise_equal(grads.layer.bias, float_grads.bias)
    assert_bitwise_equal(x_grad, float_x_grad)
    # ... and, against NumPy: W̄ = Σ_b c_b x_bᵀ, b̄ = Σ_b c_b, x̄_b = Wᵀ c_b, with no clipping mask.
    w = np.asarray(unquantized.layer.weight, np.float64)
    cn, xn = np.asarray(c, np.float64), np.asarray(x, np.float64)
    np.testing.assert_allclose(grads.layer.weight, cn.T @ xn, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(grads.layer.bias, cn.sum(0), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(x_grad, cn @ w, rtol=1e-5, atol=1e-5)


def test_inputs_beyond_the_grid_keep_their_gradient():
    """The default contract masks the gradient of an input beyond the grid's range; this one does not."""
    linear = init(lambda key: eqx.nn.Linear(2, 1, key=key), 0)
    fixed = FakeQuant(0.01, format="int8")  # the grid ends at 1.27
    x = jnp.array([0.5, 3.0])
    for backward, expected in ((None, [1.0, 0.0]), (UNQUANTIZED, [1.0, 1.0])):
        q = QuantLinear(linear, weight_quant=None, input_quant=fixed, backward=backward)
        grad = jax.grad(lambda x, q=q: q(x)[0])(x)
        np.testing.assert_array_equal(grad, np.asarray(linear.weight[0]) * np.asarray(expected, F32))


@pytest.mark.parametrize("integer", slow_unless([True], [True, False]))
def test_conv_forward_unchanged_gradients_those_of_the_float_conv(integer):
    conv = init(lambda key: eqx.nn.Conv2d(3, 4, 3, padding=1, key=key), 0)
    if integer:
        quantizers = dict(weight_quant=DynamicFakeQuant(8, axis=0), input_quant=DynamicFakeQuant(8))
    else:
        quantizers = dict(weight_quant=DynamicFakeQuant(format="float8_e4m3fn", axis=0), input_quant=None)
    default = QuantConv(conv, **quantizers)
    unquantized = QuantConv(conv, **quantizers, backward=UNQUANTIZED)
    x, c = _data(3, (2, 3, 5, 5)), _data(4, (2, 4, 5, 5))
    y_default, _, _ = _batched_grads(default, x, c)
    y, grads, x_grad = _batched_grads(unquantized, x, c)
    assert_bitwise_equal(y, y_default)
    _, float_grads, float_x_grad = _batched_grads(conv, x, c)
    assert_bitwise_equal(grads.layer.weight, float_grads.weight)
    assert_bitwise_equal(x_grad, float_x_grad)
    # Against a NumPy loop: W̄[o, i, u, v] = Σ c[b, o, p, q] · x_padded[b, i, p + u, q + v].
    xp = np.pad(np.asarray(x, np.float64), ((0, 0), (0, 0), (1, 1), (1, 1)))
    cn = np.asarray(c, np.float64)
    expected = np.zeros((4, 3, 3, 3))
    for u in range(3):
        for v in range(3):
            expected[:, :, u, v] = np.einsum("bopq,bipq->oi", cn, xp[:, :, u : u + 5, v : v + 5])
    np.testing.assert_allclose(grads.layer.weight, expected, rtol=1e-5, atol=1e-5)


def _np_mlp_grads(model, x, c):
    """The gradients of `sum(c * vmap(mlp)(x))` for a 2-layer ReLU MLP, by hand in NumPy: the forward activations
    are those of the quantized model (read from its layers), the backward the float layers' at the float
    operands."""
    l0, l1 = model.layers
    h_pre = np.asarray(jax.vmap(l0)(x), np.float64)  # the quantized layer's outputs
    w1 = np.asarray(l1.layer.weight, np.float64)
    cn, xn = np.asarray(c, np.float64), np.asarray(x, np.float64)
    w1_grad = cn.T @ np.maximum(h_pre, 0)
    h_grad = (cn @ w1) * (h_pre > 0)
    w0_grad = h_grad.T @ xn
    return w0_grad, w1_grad, h_grad.sum(0)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["w8a8", "w4a16_g32", "nvfp4"])
def test_quantized_mlp_gradients_against_numpy(name):
    mlp = init(lambda key: eqx.nn.MLP(32, 4, 32, 1, activation=jax.nn.relu, key=key), 5)
    model = eqx_quant.quantize(mlp, **eqx_quant.recipe(name, backward=UNQUANTIZED))
    assert all(layer.backward == UNQUANTIZED for layer in model.layers)
    x, c = _data(6, (7, 32)), _data(7, (7, 4))
    grads = eqx.filter_grad(lambda m: jnp.sum(c * jax.vmap(m)(x)))(model)
    w0_grad, w1_grad, b0_grad = _np_mlp_grads(model, x, c)
    np.testing.assert_allclose(grads.layers[0].layer.weight, w0_grad, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(grads.layers[1].layer.weight, w1_grad, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(grads.layers[0].layer.bias, b0_grad, rtol=1e-5, atol=1e-5)


def test_forward_mode_is_the_float_layers():
    q = _linear("w8a8", UNQUANTIZED)
    x, dx = _data(8, (16,)), _data(9, (16,))
    y, dy = jax.jvp(q, (x,), (dx,))
    assert_bitwise_equal(y, _linear("w8a8", None)(x))
    assert_bitwise_equal(dy, q.layer.weight @ dx)


def test_eager_and_jit_gradients_agree():
    q = _linear("w4a8_g8", UNQUANTIZED)
    x = _data(10, (16,))
    loss = lambda m, x: jnp.sum(jnp.sin(m(x)))  # noqa: E731
    eager = eqx.filter_grad(loss)(q, x)
    jitted = eqx.filter_jit(eqx.filter_grad(loss))(q, x)
    assert_trees_equal(eager, jitted)


def test_quantize_rules_and_recipes_reach_every_linear_and_conv():
    class Net(eqx.Module):
        conv: eqx.nn.Conv2d
        linear: eqx.nn.Linear

        def __init__(self, key):
            k1, k2 = jax.random.split(key)
            self.conv = eqx.nn.Conv2d(1, 2, 3, key=k1)
            self.linear = eqx.nn.Linear(8, 2, key=k2)

    net = Net(jax.random.key(0))
    for model in (
        eqx_quant.quantize(net, backward=UNQUANTIZED),
        eqx_quant.quantize(net, [eqx_quant.Rule(backward=UNQUANTIZED)]),
        eqx_quant.quantize(net, **eqx_quant.recipe("w8a16", backward=UNQUANTIZED)),
        eqx_quant.quantize(net, backward=UNQUANTIZED, matmul="float"),
    ):
        assert model.conv.backward == UNQUANTIZED and model.linear.backward == UNQUANTIZED


def test_refused_configurations():
    linear = eqx.nn.Linear(4, 2, key=jax.random.key(0))
    conv = eqx.nn.Conv1d(2, 2, 3, key=jax.random.key(1))
    learned = LearnedFakeQuant(jnp.float32(0.1), format="int8")
    with pytest.raises(ValueError, match="would never train"):
        QuantLinear(linear, weight_quant=learned, backward=UNQUANTIZED)
    with pytest.raises(ValueError, match="would never train"):
        QuantConv(conv, input_quant=learned, backward=UNQUANTIZED)
    with pytest.raises(ValueError, match="learned=True"):
        eqx_quant.recipe("w4a16_g32", learned=True, backward=UNQUANTIZED)
    # A learned quantizer swapped in after construction is refused when the layer is called.
    q = QuantLinear(linear, backward=UNQUANTIZED)
    swapped = eqx.tree_at(lambda q: q.weight_quant, q, learned)
    with pytest.raises(ValueError, match="would never train"):
        swapped(jnp.ones(4))
    # Arguments of the wrong type: tests/unhooked/check_errors.py (the type-checking hook would answer first).


@pytest.mark.slow
def test_save_load_and_convert(tmp_path):
    net = eqx.nn.Sequential(
        [
            eqx.nn.Conv1d(2, 4, 3, key=jax.random.key(0)),
            eqx.nn.Lambda(jnp.ravel),
            eqx.nn.Linear(8, 3, key=jax.random.key(1)),
        ]
    )
    model = eqx_quant.quantize(net, backward=UNQUANTIZED)
    path = tmp_path / "model.eqxq"
    eqx_quant.save(path, model)
    loaded = eqx_quant.load(path, net)  # rebuilt from the float model: the file's record gives the backward
    assert loaded.layers[0].backward == UNQUANTIZED and loaded.layers[2].backward == UNQUANTIZED
    x = _data(11, (2, 4))
    assert_bitwise_equal(loaded(x), model(x))
    assert_bitwise_equal(eqx_quant.convert(model)(x), model(x))
