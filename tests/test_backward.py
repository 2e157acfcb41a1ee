"""The opt-in quantized backward: input gradients as integer products, against NumPy loops."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import eqx_quant
from eqx_quant import DynamicFakeQuant, QuantizedBackward
from eqx_quant.nn import QuantLinear

from .helpers import assert_bitwise_equal, init, slow_unless


F32 = np.float32


def np_input_gradient(w_int, w_scale, g, qmax, uniforms=None, chunk=None):
    """The input's cotangent of `QuantizedBackward`, one example (row of `g`) and one weight group at a time:
    `h = scale_w * g`, `s = max(max|h| / qmax, 2**-126)`, levels rounded half to even (or `floor(h / s + u)`),
    `s * sum_o W_int[o, j] * level[o]` with int64 sums (per chunk of output channels, each rounded to float32 and
    summed in float32)."""
    w_int = np.asarray(w_int, np.int64)
    w_int = w_int.reshape(w_int.shape[0], -1)
    out, k = w_int.shape
    w_scale = np.asarray(w_scale, F32)
    w_scale = w_scale.reshape(w_scale.shape[0], -1)
    w_scale = np.broadcast_to(w_scale, (out, w_scale.shape[1]))
    groups = w_scale.shape[1]
    size = k // groups
    chunk = chunk or out
    rows = []
    for b, row in enumerate(np.asarray(g, F32)):
        dx = np.zeros(k, F32)
        for j in range(groups):
            h = row * w_scale[:, j]
            s = max(F32(np.abs(h).max()) * F32(1 / qmax), F32(2.0**-126))
            v = h * (F32(1) / s)
            levels = np.round(v) if uniforms is None else np.floor(v + uniforms[b][:, j])
            levels = np.clip(levels, -qmax, qmax).astype(np.int64)
            acc = np.zeros(size, F32)
            for start in range(0, out, chunk):
                part = levels[start : start + chunk] @ w_int[start : start + chunk, j * size : (j + 1) * size]
                acc = acc + part.astype(F32)
            dx[j * size : (j + 1) * size] = acc * s
        rows.append(dx)
    return np.stack(rows)


def layer(out, k, weight_quant, bits=8, rounding="nearest", seed=0):
    linear = init(lambda key: eqx.nn.Linear(k, out, key=key), seed)
    return QuantLinear(linear, weight_quant=weight_quant, backward=QuantizedBackward(bits, rounding=rounding))


def weight_integers(q):
    tensor = q.weight_quant.quantize(q.layer.weight, pack=False)
    return np.asarray(tensor.values), np.asarray(tensor.scale, F32)


@jax.jit
def _input_gradient(q, x, cotangent, keys):
    def loss(x):
        if keys is None:
            y = jax.vmap(q)(x)
        else:
            y = jax.vmap(lambda x, key: q(x, key=key))(x, keys)
        return jnp.sum(y * cotangent)

    return jax.grad(loss)(x)


def _data(batch, k, out, seed):
    rng = np.random.default_rng(seed)
    return jnp.asarray(rng.standard_normal((batch, k), dtype=F32)), jnp.asarray(
        rng.standard_normal((batch, out), dtype=F32)
    )


@pytest.mark.parametrize(
    "weight_quant, bits",
    slow_unless(
        [(DynamicFakeQuant(8, axis=0), 8)],
        [(DynamicFakeQuant(8, axis=0), 8), (DynamicFakeQuant(8), 8), (DynamicFakeQuant(4, group_size=4), 4)],
    ),
    ids=["per-channel-8", "per-tensor-8", "grouped-4"],
)
def test_nearest_rounding_against_numpy(weight_quant, bits):
    q = layer(6, 8, weight_quant, bits)
    x, cotangent = _data(5, 8, 6, 1)
    w_int, w_scale = weight_integers(q)
    expected = np_input_gradient(w_int, w_scale, cotangent, 2 ** (bits - 1) - 1)
    # The input quantizer (dynamic, per tensor) passes every finite entry's gradient straight through.
    assert_bitwise_equal(_input_gradient(q, x, cotangent, None), expected)
    # One example, eagerly, is the same row.
    eager = jax.grad(lambda v: jnp.sum(q(v) * cotangent[2]))(x[2])
    assert_bitwise_equal(eager, expected[2])


@pytest.mark.slow
def test_stochastic_rounding_against_numpy_with_the_same_uniforms():
    q = layer(6, 8, DynamicFakeQuant(8, axis=0), rounding="stochastic")
    x, cotangent = _data(4, 8, 6, 2)
    keys = jax.random.split(jax.random.key(3), 4)
    # The noise is drawn from the layer call's key folded with the library's constant stream number.
    uniforms = [np.asarray(jax.random.uniform(jax.random.fold_in(key, 0x9B), (6, 1), jnp.float32)) for key in keys]
    w_int, w_scale = weight_integers(q)
    expected = np_input_gradient(w_int, w_scale, cotangent, 127, uniforms)
    assert_bitwise_equal(_input_gradient(q, x, cotangent, keys), expected)
    # Eagerly, one example is the same row.
    eager = jax.grad(lambda v: jnp.sum(q(v, key=keys[1]) * cotangent[1]))(x[1])
    assert_bitwise_equal(eager, expected[1])
    # Stochastic rounding moves some levels away from the nearest ones.
    nearest = QuantLinear(q.layer, weight_quant=q.weight_quant, backward=QuantizedBackward(8))
    assert not np.array_equal(expected, np.asarray(_input_gradient(nearest, x, cotangent, None)))


@pytest.mark.slow
def test_stochastic_rounding_is_unbiased():
    """Over many keys, the mean input gradient approaches `W_intᵀ h` with `h` unrounded, within four standard
    errors (each level's rounding error is at most one step, so its variance is at most 1/4 step²)."""
    q = layer(6, 8, DynamicFakeQuant(4, axis=0), bits=4, rounding="stochastic")
    n = 4000
    x = jnp.broadcast_to(_data(1, 8, 6, 4)[0], (n, 8))
    cotangent = jnp.broadcast_to(_data(1, 8, 6, 5)[1], (n, 6))
    grads = np.asarray(_input_gradient(q, x, cotangent, jax.random.split(jax.random.key(6), n)), np.float64)
    w_int, w_scale = weight_integers(q)
    h = np.asarray(cotangent[0], np.float64) * w_scale.reshape(-1)
    exact = h @ w_int.astype(np.float64)
    step = np.abs(h).max() / 7
    standard_error = np.sqrt((w_int.astype(np.float64) ** 2).sum(axis=0) * step**2 / 4 / n)
    assert np.all(np.abs(grads.mean(axis=0) - exact) <= 4 * standard_error + 1e-6)
    # The rounding is really random: the gradients vary from key to key.
    assert np.std(grads, axis=0).max() > 0


@pytest.mark.slow
def test_long_contractions_are_split_where_int32_could_overflow():
    # 16-bit gradient levels and 8-bit weights: at most 2**31 // (32767 * 128) = 512 output channels per int32 sum.
    # A weight whose rows all reach -128 in the same column and a gradient of one sign drive the full sum of column 0
    # to 600 * 128 * 32767 > 2**31: one int32 sum would wrap around.
    q = layer(600, 3, DynamicFakeQuant(8, axis=0), bits=16)
    weight = q.layer.weight.at[:, 0].set(-1.0).at[:, 1:].multiply(0.25)
    q = eqx.tree_at(lambda m: m.layer.weight, q, weight)
    x, cotangent = _data(2, 3, 600, 7)
    cotangent = 1.0 + 0.01 * jnp.abs(cotangent)
    w_int, w_scale = weight_integers(q)
    for row in np.asarray(cotangent, F32):  # the whole sum of column 0, in int64, is beyond int32
        h = row * w_scale.reshape(-1)
        levels = np.round(h * (F32(1) / (F32(np.abs(h).max()) * F32(1 / 32767))))
        assert abs(int(levels.astype(np.int64) @ np.asarray(w_int, np.int64)[:, 0])) > 2**31
    expected = np_input_gradient(w_int, w_scale, cotangent, 32767, chunk=2**31 // (32767 * 128))
    assert_bitwise_equal(_input_gradient(q, x, cotangent, None), expected)


@pytest.mark.slow
def test_forward_and_weight_gradient_are_those_of_the_float_backward():
    q = layer(6, 8, DynamicFakeQuant(8, axis=0))
    plain = QuantLinear(q.layer, weight_quant=q.weight_quant)
    x, cotangent = _data(5, 8, 6, 8)

    def loss(model):
        return jnp.sum(jax.vmap(model)(x) * cotangent)

    assert_bitwise_equal(jax.vmap(q)(x), jax.vmap(plain)(x))
    grads, plain_grads = (eqx.filter_jit(eqx.filter_grad(loss))(m) for m in (q, plain))
    assert_bitwise_equal(grads.layer.weight, plain_grads.layer.weight)
    assert_bitwise_equal(grads.layer.bias, plain_grads.layer.bias)
    # The input's gradient is close to the float product's, not equal to it.
    dx = np.asarray(_input_gradient(q, x, cotangent, None))
    plain_dx = np.asarray(jax.grad(lambda v: jnp.sum(jax.vmap(plain)(v) * cotangent))(x))
    assert not np.array_equal(dx, plain_dx)
    assert np.abs(dx - plain_dx).max() <= 0.02 * np.abs(plain_dx).max()


@pytest.mark.slow
def test_nan_in_the_weight_and_in_the_incoming_gradient():
    q = layer(4, 5, DynamicFakeQuant(8, axis=0))
    q = eqx.tree_at(lambda m: m.layer.weight, q, q.layer.weight.at[1, 3].set(jnp.nan))
    x, cotangent = _data(3, 5, 4, 9)
    cotangent = cotangent.at[2, 0].set(jnp.nan)
    dx = np.asarray(_input_gradient(q, x, cotangent, None))
    # The NaN weight reaches column 3 of every example; the NaN gradient every entry of example 2.
    assert np.isnan(dx[:2, 3]).all() and np.isfinite(np.delete(dx[:2], 3, axis=1)).all()
    assert np.isnan(dx[2]).all()


@pytest.mark.slow
def test_quantize_and_calibrate_keep_the_backward():
    mlp = init(lambda key: eqx.nn.MLP(4, 2, 8, 1, key=key), 10)
    backward = QuantizedBackward(8)
    qmlp = eqx_quant.quantize(mlp, backward=backward)
    assert all(layer.backward == backward for layer in qmlp.layers)
    calibrated = eqx_quant.calibrate(qmlp, [jnp.ones((3, 4))])
    assert all(layer.backward == backward for layer in calibrated.layers)
    assert isinstance(calibrated.layers[0].input_quant, eqx_quant.FakeQuant)
    # Layers without integer quantizers for both operands keep the float backward.
    with pytest.warns(UserWarning, match=r"the layers at \['layers.1'\] .* keep the float backward"):
        mixed = eqx_quant.quantize(mlp, weights={"layers.0": DynamicFakeQuant(8, axis=0)}, backward=backward)
    assert mixed.layers[0].backward == backward and mixed.layers[1].backward is None
    # The converted model does not depend on it.
    x = jnp.ones((3, 4))
    assert_bitwise_equal(jax.vmap(eqx_quant.convert(calibrated))(x), jax.vmap(calibrated)(x))


@pytest.mark.slow
def test_asymmetric_weights_multiply_their_integers_minus_the_zero_point():
    q = layer(5, 8, DynamicFakeQuant(8, axis=0, symmetric=False))
    x, cotangent = _data(3, 8, 5, 12)
    tensor = q.weight_quant.quantize(q.layer.weight, pack=False)
    w_int = np.asarray(tensor.values, np.int64) - np.asarray(tensor.zero_point, np.int64)
    expected = np_input_gradient(w_int, np.asarray(tensor.scale, F32), cotangent, 127)
    assert_bitwise_equal(_input_gradient(q, x, cotangent, None), expected)


def test_bfloat16_layer_gets_a_bfloat16_input_gradient_from_the_float32_computation():
    linear = init(lambda key: eqx.nn.Linear(8, 6, dtype=jnp.bfloat16, key=key), 13)
    q = QuantLinear(linear, weight_quant=DynamicFakeQuant(8, axis=0), backward=QuantizedBackward(8))
    x, cotangent = (a.astype(jnp.bfloat16) for a in _data(3, 8, 6, 14))
    w_int, w_scale = weight_integers(q)
    # The incoming gradient is taken to float32 (exactly), the product is computed as for float32 layers, and the
    # input's gradient is rounded to the input's dtype once, at the end.
    expected = np_input_gradient(w_int, w_scale, np.asarray(cotangent, F32), 127)
    dx = _input_gradient(q, x, cotangent, None)
    assert dx.dtype == jnp.bfloat16
    assert_bitwise_equal(dx, jnp.asarray(expected).astype(jnp.bfloat16))


@pytest.mark.slow
def test_errors():
    linear = init(lambda key: eqx.nn.Linear(3, 2, key=key), 11)
    with pytest.raises(ValueError, match="`bits` must be between 2 and 16, got bits=1."):
        QuantizedBackward(1)
    with pytest.raises(ValueError, match="needs the integer forward, matmul='int'; got matmul='float'"):
        QuantLinear(linear, matmul="float", backward=QuantizedBackward())
    with pytest.raises(ValueError, match="needs an integer quantizer for both operands; got weight_quant=None"):
        QuantLinear(linear, weight_quant=None, backward=QuantizedBackward())
    per_channel_input = QuantLinear(linear, input_quant=DynamicFakeQuant(8, axis=0), backward=QuantizedBackward())
    with pytest.raises(ValueError, match="needs the integer forward, but its quantizers"):
        per_channel_input(jnp.ones(3))
    stochastic = QuantLinear(linear, backward=QuantizedBackward(rounding="stochastic"))
    # A call without a gradient needs no key; a gradient does.
    assert_bitwise_equal(stochastic(jnp.ones(3)), QuantLinear(linear)(jnp.ones(3)))
    with pytest.raises(ValueError, match="needs a `key` at every call whose gradient is taken"):
        jax.grad(lambda v: jnp.sum(stochastic(v)))(jnp.ones(3))


@pytest.mark.slow
def test_the_demo_passes_the_backward_to_its_linear_layers():
    from examples.qat_demo import ConvNet, quantized

    model = quantized(ConvNet(jax.random.key(0)), 4, 4, QuantizedBackward(8))
    is_layer = lambda node: isinstance(node, (QuantLinear, eqx_quant.nn.QuantConv))  # noqa: E731
    layers = [node for node in jax.tree.leaves(model, is_leaf=is_layer) if is_layer(node)]
    linears = [node for node in layers if isinstance(node, QuantLinear)]
    assert linears and len(linears) < len(layers)
    assert all(node.backward == QuantizedBackward(8) for node in linears)
