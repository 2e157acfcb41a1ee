import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from eqx_quant import DynamicFakeQuant, FakeQuant
from eqx_quant.nn import QuantConv, QuantEmbedding, QuantLinear

from .helpers import assert_bitwise_equal, reference_fake_quant


@eqx.filter_jit
def apply(model, x):
    return model(x)


@eqx.filter_jit
def quantization_params(quantizer, x):
    return quantizer.quantization_params(x)


def numpy_quant(quantizer, x) -> np.ndarray:
    """`quantizer(x)` computed by the NumPy reference, with the scale and zero point the quantizer uses."""
    x = np.asarray(x)
    if isinstance(quantizer, DynamicFakeQuant):
        scale, zero_point = (np.asarray(a) for a in quantization_params(quantizer, jnp.asarray(x)))
        qmin, qmax = quantizer.qmin, quantizer.qmax
        axis = quantizer.axis
    else:
        assert isinstance(quantizer, FakeQuant)
        scale, zero_point = np.asarray(quantizer.scale, np.float32), np.asarray(quantizer.zero_point, np.float32)
        qmin, qmax = quantizer.qmin, quantizer.qmax
        axis = quantizer.axis
    if axis is not None:
        shape = [1] * x.ndim
        shape[axis] = -1
        scale, zero_point = scale.reshape(shape), zero_point.reshape(shape)
    return reference_fake_quant(x, scale, qmin, qmax, zero_point)


def ulps_above(a, b) -> np.ndarray:
    """How many float32 ulps `a` lies above `b` (both positive)."""
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    return a.view(np.int32).astype(np.int64) - b.view(np.int32).astype(np.int64)


def check_absmax_scale(scale, absmax, qmax):
    """`scale` is `absmax / qmax` in float32 or a few ulps above, and `absmax` maps inside the grid with it."""
    scale, absmax = np.asarray(scale, np.float32), np.asarray(absmax, np.float32)
    ulps = ulps_above(scale, absmax / np.float32(qmax))
    assert np.all((ulps >= 0) & (ulps <= 4)), ulps
    assert np.all(absmax * (np.float32(1) / scale) <= qmax)


@pytest.fixture
def linear():
    return eqx.nn.Linear(5, 4, key=jax.random.key(10))


@pytest.fixture
def x5():
    return jax.random.normal(jax.random.key(11), (5,)) * 3.0


# ---------------------------------------------------------------------------------------------------------------------
# QuantLinear.


@pytest.mark.slow
def test_quant_linear_defaults_against_numpy(linear, x5):
    qlinear = QuantLinear(linear)
    assert qlinear.layer is linear
    assert qlinear.weight_quant == DynamicFakeQuant(8, axis=0)
    assert qlinear.input_quant == DynamicFakeQuant(8)
    w, b, x = np.asarray(linear.weight), np.asarray(linear.bias), np.asarray(x5)
    # The scales the default quantizers use: one per output row of the weight, one for the whole input.
    w_scale, w_zp = quantization_params(qlinear.weight_quant, linear.weight)
    x_scale, x_zp = quantization_params(qlinear.input_quant, x5)
    assert w_scale.shape == (4,) and x_scale.shape == ()
    np.testing.assert_array_equal(w_zp, np.zeros(4, np.float32))
    check_absmax_scale(w_scale, np.abs(w).max(axis=1), 127)
    check_absmax_scale(x_scale, np.abs(x).max(), 127)
    w_q = reference_fake_quant(w, np.asarray(w_scale)[:, None], -128, 127)
    x_q = reference_fake_quant(x, np.asarray(x_scale), -128, 127)
    levels = w_q / np.asarray(w_scale)[:, None]
    np.testing.assert_allclose(levels, np.round(levels), atol=1e-4)
    assert np.abs(np.round(levels)).max() == 127  # the largest weight of each row is on the grid's end
    assert not np.array_equal(w_q, w) and not np.array_equal(x_q, x)
    out = qlinear(x5)  # eagerly
    assert out.shape == (4,) and out.dtype == jnp.float32
    np.testing.assert_allclose(out, w_q @ x_q + b, rtol=1e-5, atol=1e-6)
    # The float layer on the float input gives something else: the quantization is really applied.
    assert not np.allclose(out, w @ x + b, rtol=1e-6, atol=0)


def test_quant_linear_static_quantizers_against_numpy(linear, x5):
    weight_quant = FakeQuant(0.05, -8, 7)
    input_quant = FakeQuant.from_bits(4, 0.4, signed=False)
    qlinear = QuantLinear(linear, weight_quant=weight_quant, input_quant=input_quant)
    w, b, x = np.asarray(linear.weight), np.asarray(linear.bias), np.asarray(x5)
    w_q = reference_fake_quant(w, np.float32(0.05), -8, 7)
    x_q = reference_fake_quant(x, np.float32(0.4), 0, 15)
    # Both quantizers clip here: some weights exceed 7 * 0.05 and the negative inputs go to 0.
    assert np.any(np.abs(w) > 0.4) and np.any(x < 0)
    assert x_q.min() == 0.0
    np.testing.assert_allclose(apply(qlinear, x5), w_q @ x_q + b, rtol=1e-5, atol=1e-6)


def test_quant_linear_none_quantizers(linear, x5):
    w, b, x = np.asarray(linear.weight), np.asarray(linear.bias), np.asarray(x5)
    w_q = numpy_quant(DynamicFakeQuant(8, axis=0), w)
    x_q = numpy_quant(DynamicFakeQuant(8), x)
    only_input = QuantLinear(linear, weight_quant=None)
    np.testing.assert_allclose(apply(only_input, x5), w @ x_q + b, rtol=1e-5, atol=1e-6)
    only_weight = QuantLinear(linear, input_quant=None)
    np.testing.assert_allclose(apply(only_weight, x5), w_q @ x + b, rtol=1e-5, atol=1e-6)
    neither = QuantLinear(linear, weight_quant=None, input_quant=None)
    assert_bitwise_equal(apply(neither, x5), apply(linear, x5))
    assert neither.quantized_layer() is linear


@pytest.mark.slow
def test_quant_linear_scalar_features():
    to_vector = eqx.nn.Linear("scalar", 3, key=jax.random.key(12))
    to_scalar = eqx.nn.Linear(3, "scalar", key=jax.random.key(13))
    x = jnp.array(-1.7)
    y = apply(QuantLinear(to_vector), x)
    assert y.shape == (3,)
    w_q = numpy_quant(DynamicFakeQuant(8, axis=0), to_vector.weight)  # (3, 1): each row is one value
    np.testing.assert_array_equal(w_q, np.asarray(to_vector.weight))
    np.testing.assert_allclose(y, w_q[:, 0] * np.float32(-1.7) + np.asarray(to_vector.bias), rtol=1e-6)
    z = apply(QuantLinear(to_scalar), y)
    assert z.shape == ()
    expected = numpy_quant(DynamicFakeQuant(8, axis=0), to_scalar.weight) @ numpy_quant(DynamicFakeQuant(8), y)
    np.testing.assert_allclose(z, expected[0] + np.asarray(to_scalar.bias), rtol=1e-5, atol=1e-6)


def test_quant_linear_under_jit_and_vmap(linear):
    qlinear = QuantLinear(linear, weight_quant=DynamicFakeQuant(4, axis=0))
    xs = jax.random.normal(jax.random.key(14), (3, 5))
    out = eqx.filter_jit(lambda m, x: jax.vmap(m)(x))(qlinear, xs)
    assert out.shape == (3, 4)
    w_q = numpy_quant(DynamicFakeQuant(4, axis=0), linear.weight)
    b = np.asarray(linear.bias)
    for i in range(3):
        x_q = numpy_quant(DynamicFakeQuant(8), xs[i])  # the input scale is per example under vmap
        np.testing.assert_allclose(out[i], w_q @ x_q + b, rtol=1e-5, atol=1e-6)
    # A key is accepted, as by the wrapped layer.
    np.testing.assert_allclose(qlinear(xs[0], key=jax.random.key(0)), out[0], rtol=1e-6, atol=1e-7)


# ---------------------------------------------------------------------------------------------------------------------
# QuantConv.


CONVS = {
    "conv1d": (
        lambda key: eqx.nn.Conv1d(4, 6, 3, stride=2, padding=1, groups=2, key=key),
        (4, 9),
        (6, 5),
    ),
    "conv2d": (
        lambda key: eqx.nn.Conv2d(2, 4, (3, 2), stride=(1, 2), padding=((1, 0), (0, 1)), groups=2, key=key),
        (2, 5, 6),
        (4, 4, 3),
    ),
}


@pytest.mark.parametrize("name", sorted(CONVS))
@pytest.mark.slow
def test_quant_conv_equals_conv_on_quantized_operands(name):
    make, in_shape, out_shape = CONVS[name]
    conv = make(jax.random.key(20))
    x = jax.random.normal(jax.random.key(21), in_shape) * 2.0
    qconv = QuantConv(conv)
    assert qconv.weight_quant == DynamicFakeQuant(8, axis=0) and qconv.input_quant == DynamicFakeQuant(8)
    w = np.asarray(conv.weight)
    w_scale, _ = quantization_params(qconv.weight_quant, conv.weight)
    assert w_scale.shape == (w.shape[0],)
    check_absmax_scale(w_scale, np.abs(w.reshape(w.shape[0], -1)).max(axis=1), 127)
    w_q = reference_fake_quant(w, np.asarray(w_scale).reshape((-1,) + (1,) * (w.ndim - 1)), -128, 127)
    x_q = numpy_quant(DynamicFakeQuant(8), x)
    reference = eqx.tree_at(lambda c: c.weight, conv, jnp.asarray(w_q))
    expected = reference(jnp.asarray(x_q))
    float_out = conv(x)
    assert expected.shape == out_shape == float_out.shape
    # With `matmul="float"` it is exactly the wrapped convolution on the quantized operands. Eagerly, so that both
    # sides run the same operations (under `jit`, XLA may move scale multiplications across the convolution).
    assert_bitwise_equal(QuantConv(conv, matmul="float")(x), expected)
    # With float operands it is the float convolution.
    assert_bitwise_equal(QuantConv(conv, weight_quant=None, input_quant=None)(x), float_out)
    # The default forward is the integer convolution: the same up to float rounding.
    out = apply(qconv, x)
    assert out.shape == out_shape
    np.testing.assert_allclose(out, expected, rtol=1e-5, atol=1e-6)
    assert not np.allclose(out, float_out, rtol=1e-3, atol=0)


@pytest.mark.slow
def test_quant_conv_static_input_quantizer_unsigned():
    conv = eqx.nn.Conv1d(2, 3, 2, dilation=2, use_bias=False, key=jax.random.key(22))
    x = jnp.array([[0.1, -0.6, 1.3, 2.9], [0.7, 0.05, -1.0, 0.26]])
    quantizers = dict(weight_quant=DynamicFakeQuant(3, axis=0), input_quant=FakeQuant.from_bits(2, 0.5, signed=False))
    qconv = QuantConv(conv, **quantizers)
    x_q = reference_fake_quant(np.asarray(x), np.float32(0.5), 0, 3)
    np.testing.assert_array_equal(x_q, [[0.0, 0.0, 1.5, 1.5], [0.5, 0.0, 0.0, 0.5]])
    w_q = numpy_quant(DynamicFakeQuant(3, axis=0), conv.weight)
    # Each output channel on its own 3-bit grid: multiples of max|w| / 3 over that channel.
    levels = w_q / (np.abs(np.asarray(conv.weight)).max(axis=(1, 2), keepdims=True) / 3)
    np.testing.assert_allclose(levels, np.round(levels), atol=1e-4)
    assert np.all(np.abs(np.round(levels)) <= 3) and np.all(np.abs(np.round(levels)).max(axis=(1, 2)) == 3)
    reference = eqx.tree_at(lambda c: c.weight, conv, jnp.asarray(w_q))
    expected = reference(jnp.asarray(x_q))
    out = apply(qconv, x)
    assert out.shape == (3, 2)
    np.testing.assert_allclose(out, expected, rtol=1e-5, atol=1e-6)
    assert_bitwise_equal(QuantConv(conv, **quantizers, matmul="float")(x), expected)


# ---------------------------------------------------------------------------------------------------------------------
# QuantEmbedding.


def test_quant_embedding_rows():
    embedding = eqx.nn.Embedding(6, 5, key=jax.random.key(30))
    qembedding = QuantEmbedding(embedding)
    assert qembedding.weight_quant == DynamicFakeQuant(8, axis=0) and qembedding.input_quant is None
    table = np.asarray(embedding.weight)
    scale, _ = quantization_params(qembedding.weight_quant, embedding.weight)
    check_absmax_scale(scale, np.abs(table).max(axis=1), 127)
    table_q = reference_fake_quant(table, np.asarray(scale)[:, None], -128, 127)
    for i in range(6):
        row = apply(qembedding, jnp.asarray(i))
        assert row.shape == (5,)
        assert_bitwise_equal(row, table_q[i])
    lookup = eqx.filter_jit(lambda m, i: jax.vmap(m)(i))
    assert_bitwise_equal(lookup(qembedding, jnp.array([5, 0, 5])), table_q[[5, 0, 5]])
    coarse = QuantEmbedding(embedding, weight_quant=FakeQuant(0.25, -2, 1))
    assert_bitwise_equal(apply(coarse, jnp.asarray(2)), reference_fake_quant(table[2], np.float32(0.25), -2, 1))
    assert_bitwise_equal(apply(QuantEmbedding(embedding, weight_quant=None), jnp.asarray(4)), table[4])


# ---------------------------------------------------------------------------------------------------------------------
# Invalid arguments.


def test_invalid_constructor_arguments(linear):
    conv = eqx.nn.Conv1d(1, 1, 1, key=jax.random.key(40))
    embedding = eqx.nn.Embedding(3, 2, key=jax.random.key(41))
    with pytest.raises(TypeError, match="layer"):
        QuantLinear(conv)  # pyright: ignore[reportArgumentType]
    with pytest.raises(TypeError, match="layer"):
        QuantConv(linear)  # pyright: ignore[reportArgumentType]
    with pytest.raises(TypeError, match="layer"):
        QuantEmbedding(linear)  # pyright: ignore[reportArgumentType]
    with pytest.raises(TypeError, match="weight_quant"):
        QuantLinear(linear, weight_quant="int8")  # pyright: ignore[reportArgumentType]
    with pytest.raises(TypeError, match="input_quant"):
        QuantConv(conv, input_quant=jax.nn.relu)  # pyright: ignore[reportArgumentType]
    with pytest.raises(TypeError, match="weight_quant"):
        QuantEmbedding(embedding, weight_quant=0.1)  # pyright: ignore[reportArgumentType]
    with pytest.raises((TypeError, ValueError), match="input_quant"):
        QuantEmbedding(embedding, input_quant=DynamicFakeQuant(8))  # pyright: ignore[reportArgumentType]


# ---------------------------------------------------------------------------------------------------------------------
# Gradients.


def test_gradients_reach_the_float_weight_through_the_ste(linear, x5):
    cotangent = jnp.array([1.0, -2.0, 0.5, 3.0])

    def loss(model, x):
        return jnp.sum(cotangent * model(x))

    qlinear = QuantLinear(linear)
    grads = eqx.filter_jit(eqx.filter_grad(loss))(qlinear, x5)
    x_q = numpy_quant(DynamicFakeQuant(8), x5)
    c = np.asarray(cotangent)
    # Absmax scales put every weight inside the grid, so the STE passes the full gradient of W_q @ x_q + b.
    np.testing.assert_allclose(grads.layer.weight, np.outer(c, x_q), rtol=1e-6)
    np.testing.assert_allclose(grads.layer.bias, c, rtol=1e-6)
    w_q = numpy_quant(DynamicFakeQuant(8, axis=0), linear.weight)
    np.testing.assert_allclose(jax.jit(jax.grad(lambda x: loss(qlinear, x)))(x5), w_q.T @ c, rtol=1e-5, atol=1e-6)

    # A static weight quantizer that clips: clipped weights get exactly zero gradient.
    clipped = QuantLinear(linear, weight_quant=FakeQuant(0.05, -4, 3), input_quant=None)
    grads = eqx.filter_jit(eqx.filter_grad(loss))(clipped, x5)
    w = np.asarray(linear.weight)
    u = w * (np.float32(1) / np.float32(0.05))
    inside = (u >= -4) & (u <= 3)
    assert 0 < inside.sum() < inside.size
    np.testing.assert_allclose(grads.layer.weight, np.where(inside, np.outer(c, np.asarray(x5)), 0), rtol=1e-6)
    assert np.all(np.asarray(grads.layer.weight)[~inside] == 0)


@pytest.mark.slow
def test_conv_gradient_through_the_ste():
    conv = eqx.nn.Conv1d(2, 3, 3, padding=1, key=jax.random.key(50))
    x = jax.random.normal(jax.random.key(51), (2, 6))
    cotangent = jax.random.normal(jax.random.key(52), (3, 6))
    qconv = QuantConv(conv)
    grads = eqx.filter_jit(eqx.filter_grad(lambda m: jnp.sum(cotangent * m(x))))(qconv)
    w_q = jnp.asarray(numpy_quant(DynamicFakeQuant(8, axis=0), conv.weight))
    x_q = jnp.asarray(numpy_quant(DynamicFakeQuant(8), x))

    def float_loss(weight):
        return jnp.sum(cotangent * eqx.tree_at(lambda c: c.weight, conv, weight)(x_q))

    np.testing.assert_allclose(grads.layer.weight, jax.jit(jax.grad(float_loss))(w_q), rtol=1e-5, atol=1e-6)
    # The gradient of a 1-D convolution with respect to one weight entry, as an explicit sum.
    xp = np.pad(np.asarray(x_q), ((0, 0), (1, 1)))
    c = np.asarray(cotangent)
    expected = np.zeros((3, 2, 3), np.float32)
    for o in range(3):
        for i in range(2):
            for k in range(3):
                expected[o, i, k] = np.sum(c[o] * xp[i, k : k + 6])
    np.testing.assert_allclose(grads.layer.weight, expected, rtol=1e-5, atol=1e-5)
