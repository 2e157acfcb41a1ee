"""Layouts: every fake quantizer per tensor, per channel (one or several axes) and per group, and per-group weights on
the integer path. References are NumPy twins written here and int64 sums."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import eqx_quant
from eqx_quant import DynamicFakeQuant, FakeQuant, Layout, LearnedFakeQuant
from eqx_quant._int_ops import LinearSpec, int_linear

from .helpers import assert_bitwise_equal, np_absmax_scale, reference_fake_quant


F32 = np.float32


def grouped(x, g):
    return x.reshape(x.shape[:-1] + (x.shape[-1] // g, g))


def test_layout_shapes_by_hand():
    shape = (2, 3, 8)
    cases = [
        (Layout(), (), (0, 1, 2), 48),
        (Layout((1,)), (3,), (0, 2), 16),
        (Layout((0, -1)), (2, 8), (1,), 3),
        (Layout((), 4), (2, 3, 2), (3,), 4),
        (Layout((), None, 1), (2,), (1, 2), 24),
        (Layout((2,), None, 1), (2, 8), (1,), 3),
    ]
    for layout, scale_shape, axes, numel in cases:
        assert layout.scale_shape(shape) == scale_shape, layout
        assert layout.reduction_axes(shape) == axes, layout
        assert layout.group_numel(shape) == numel, layout
    assert Layout((), 4).view_shape(shape) == (2, 3, 2, 4)
    with pytest.raises(ValueError, match="does not divide"):
        Layout((), 3).view_shape(shape)
    with pytest.raises(ValueError, match="must not be the tiled axis"):
        Layout((2,), 4).view_shape(shape)
    with pytest.raises(ValueError, match="names a stacked axis"):
        Layout((0,), None, 1).view_shape(shape)
    with pytest.raises(ValueError, match="names an axis twice"):
        Layout.of((1, 1))


def test_quantize_refuses_a_group_size_that_does_not_fit_a_weight_naming_the_layer():
    """A grouped weight quantizer whose group size does not divide a chosen layer's contraction is an error of
    `quantize`, naming the layer, not of the model's first call."""
    model = {"pw": eqx.nn.Conv2d(16, 32, 1, key=jax.random.key(0)), "fc": eqx.nn.Linear(12, 4, key=jax.random.key(1))}
    for path, size in (("pw", 1), ("fc", 12)):
        with pytest.raises(ValueError, match=rf"Layer '{path}': its weight quantizer does not fit .* of size {size}"):
            eqx_quant.quantize(model, weights=DynamicFakeQuant(4, group_size=8), where=path)
    fitting = eqx_quant.quantize(model, weights=DynamicFakeQuant(4, group_size=4), where="fc")
    assert fitting["fc"].weight_quant.layout.group_size == 4
    # Stacked layers (built with `eqx.filter_vmap`): the quantizer sees one layer's weight, (4, 12).
    stack = eqx.filter_vmap(lambda k: eqx.nn.Linear(12, 4, key=k))(jax.random.split(jax.random.key(2), 3))
    with pytest.raises(ValueError, match=r"Layer 's': .* of size 12 \(shape \(4, 12\)\)"):
        eqx_quant.quantize({"s": stack}, weights=DynamicFakeQuant(4, group_size=8))
    assert eqx_quant.quantize({"s": stack}, weights=DynamicFakeQuant(4, group_size=4))["s"].weight_quant is not None
    # An input quantizer in tiles that do not divide a linear layer's input features: refused alike.
    with pytest.raises(ValueError, match=r"Layer 'fc': its input quantizer does not fit its input, of shape \(12,\)"):
        eqx_quant.quantize(model, activations=DynamicFakeQuant("nvfp4", group_size=16), where="fc")
    tiled = eqx_quant.quantize(model, activations=DynamicFakeQuant(8, group_size=4), where="fc")["fc"]
    assert tiled(jnp.ones(12)).shape == (4,)


@pytest.mark.slow
def test_dynamic_scales_per_group_and_per_axes_match_numpy():
    x = np.asarray(jax.random.normal(jax.random.key(0), (3, 4, 8)), F32) * F32(3)
    # Groups of 4 along the last axis: one scale per (i, j, group).
    scale, _ = DynamicFakeQuant(4, group_size=4).quantization_params(jnp.asarray(x))
    expected = np_absmax_scale(np.abs(grouped(x, 4)).max(axis=-1), 7)
    assert_bitwise_equal(scale, expected)
    # Two channel axes: one scale per (i, k).
    scale, _ = DynamicFakeQuant(8, axis=(0, 2)).quantization_params(jnp.asarray(x))
    assert_bitwise_equal(scale, np_absmax_scale(np.abs(x).max(axis=1), 127))
    y = DynamicFakeQuant(8, axis=(0, 2))(jnp.asarray(x))
    assert_bitwise_equal(y, reference_fake_quant(x, np.asarray(scale)[:, None, :], -128, 127))


@pytest.mark.parametrize("method", ["absmax", "minmax"])
@pytest.mark.slow
def test_calibrated_per_group_scales_are_those_of_each_group(method):
    w = np.asarray(jax.random.normal(jax.random.key(1), (4, 12)), F32)
    q = FakeQuant.calibrate(w, 4, group_size=4, method=method)
    assert np.shape(q.scale) == (4, 3) and q.group_size == 4
    for i in range(4):
        for j in range(3):
            one = FakeQuant.calibrate(w[i, 4 * j : 4 * j + 4], 4, method=method)
            assert q.scale[i][j] == one.scale and np.ravel(q.zero_point)[i * 3 + j] == one.zero_point
    pieces = [jnp.asarray(w[i, 4 * j : 4 * j + 4]) for i in range(4) for j in range(3)]
    expected = np.concatenate([np.asarray(FakeQuant.calibrate(p, 4, method=method)(p)) for p in pieces]).reshape(4, 12)
    assert_bitwise_equal(q(jnp.asarray(w)), expected)


@pytest.mark.slow
def test_learned_per_group_step_sizes_and_lsq_gradient():
    w = np.asarray(jax.random.normal(jax.random.key(2), (3, 8)), F32)
    q = LearnedFakeQuant.init_from(w, 4, group_size=4, method="lsq")
    assert q.scale.shape == (3, 2)
    expected_scale = 2 * np.abs(grouped(w, 4)).mean(axis=-1) / np.sqrt(7)
    np.testing.assert_allclose(np.asarray(q.scale), expected_scale, rtol=1e-6)
    cotangent = np.asarray(jax.random.normal(jax.random.key(3), (3, 8)), F32)
    y, pullback = jax.vjp(lambda q: q(jnp.asarray(w)), q)
    (grads,) = pullback(jnp.asarray(cotangent))
    s = np.asarray(q.scale)[:, :, None]
    values, _, grad_scale, _ = reference_fake_quant(grouped(w, 4), s, -8, 7, cotangent=grouped(cotangent, 4))
    assert_bitwise_equal(y, values.reshape(3, 8))
    # The LSQ gradient scale counts the elements of one group: 1 / sqrt(4 * 7).
    np.testing.assert_allclose(np.asarray(grads.scale), grad_scale.sum(axis=-1) / np.sqrt(4 * 7), rtol=1e-5, atol=1e-7)
    with pytest.raises(ValueError, match=r"`scale` does not fit `x`"):
        q(jnp.ones((3, 12)))


def test_grouped_integer_product_against_int64_sums():
    # Power-of-two scales make every product and partial sum exact, so the float32 result is the int64 one.
    rng = np.random.default_rng(0)
    w = rng.integers(-8, 8, (5, 3, 4))
    x = rng.integers(-128, 128, 12)
    w_scale = (2.0 ** rng.integers(-6, 0, (5, 3, 1))).astype(F32)
    exact = (w * x.reshape(3, 4)).sum(axis=-1).astype(np.int64)  # (5, 3) int64 group sums
    expected = (exact * w_scale[:, :, 0].astype(np.float64)).sum(axis=1) * 2.0**-7
    y = int_linear(LinearSpec(2**20, 4), jnp.asarray(w, jnp.int8), jnp.asarray(x, jnp.int8), jnp.asarray(w_scale),
                   jnp.float32(2.0**-7), None)  # fmt: skip
    np.testing.assert_array_equal(np.asarray(y, np.float64), expected)


@pytest.fixture(scope="module")
def grouped_models():
    linear = eqx.nn.Linear(16, 6, key=jax.random.key(4))
    weights = {
        "dynamic": DynamicFakeQuant(4, group_size=8),
        "learned": LearnedFakeQuant.init_from(linear.weight, 4, group_size=8),
        "static": FakeQuant.calibrate(linear.weight, 4, group_size=8),
    }
    return linear, {name: eqx_quant.quantize(linear, weights=q) for name, q in weights.items()}


@eqx.filter_jit
def batch(model, xs):
    return jax.vmap(model)(xs)


@pytest.mark.slow
def test_grouped_weights_run_the_integer_path_bit_for_bit(grouped_models):
    linear, models = grouped_models
    xs = jax.random.normal(jax.random.key(5), (3, 16))
    for name, model in models.items():
        assert "preferred_element_type=int32" in str(jax.make_jaxpr(model)(xs[0])), name
        converted = eqx_quant.convert(model)
        assert converted.qweight.layout == Layout((), 8) and converted.qweight.packed_bits == 4
        eager = jnp.stack([model(x) for x in xs])
        for other in (batch(model, xs), batch(converted, xs), jnp.stack([converted(x) for x in xs])):
            assert_bitwise_equal(other, eager)
        # Against the float product of the fake-quantized operands, in float64: only float rounding apart.
        wq = np.asarray(model.weight_quant(linear.weight), np.float64)
        xq = np.asarray(jax.vmap(model.input_quant)(xs), np.float64)
        np.testing.assert_allclose(np.asarray(eager), xq @ wq.T + np.asarray(linear.bias), rtol=1e-5, atol=1e-6)


def test_grouped_integer_path_gradients_equal_the_float_product_gradients(grouped_models):
    linear, models = grouped_models
    xs = jax.random.normal(jax.random.key(6), (3, 16))

    @eqx.filter_jit
    def grads(model):
        return eqx.filter_grad(lambda m: jnp.sum(jnp.sin(jax.vmap(m)(xs))))(model)

    model = models["learned"]
    as_float = eqx_quant.quantize(linear, weights=model.weight_quant, matmul="float")
    a, b = grads(model), grads(as_float)
    for leaf_a, leaf_b in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_allclose(np.asarray(leaf_a), np.asarray(leaf_b), rtol=1e-4, atol=1e-6)
    assert np.abs(np.asarray(a.weight_quant.scale)).sum() > 0


@pytest.mark.slow
def test_static_per_group_quantizer_saves_and_loads(grouped_models, tmp_path):
    _, models = grouped_models
    converted = eqx_quant.convert(eqx_quant.calibrate(models["static"], [jnp.ones((2, 16))]))
    path = tmp_path / "model.eqx"
    eqx_quant.save(path, converted)
    loaded = eqx_quant.load(path, converted)
    x = jnp.linspace(-1.0, 1.0, 16)
    assert_bitwise_equal(loaded(x), converted(x))
    # A per-group static input quantizer survives the header too.
    q = FakeQuant.calibrate(jnp.arange(16.0).reshape(2, 8), 8, group_size=4)
    model = eqx_quant.quantize(eqx.nn.Linear(8, 2, key=jax.random.key(0)), activations=None, weights=q)
    eqx_quant.save(path, model)
    assert eqx_quant.load(path, model).weight_quant == q


@pytest.mark.slow
def test_quantize_gives_the_integers_of_the_forward_pass():
    x = np.asarray(jax.random.normal(jax.random.key(7), (4, 8)), F32)
    cases = [
        (DynamicFakeQuant(4, group_size=4), np_absmax_scale(np.abs(grouped(x, 4)).max(axis=-1), 7)[..., None], 4),
        (DynamicFakeQuant(8, axis=0), np_absmax_scale(np.abs(x).max(axis=1), 127)[:, None], None),
        (FakeQuant(0.25, -2, 1), np.float32(0.25), None),
    ]
    for q, scale, group in cases:
        tensor = q.quantize(jnp.asarray(x))
        view = x if group is None else grouped(x, group)
        expected = np.clip(np.round(view * (F32(1) / scale)), q.qmin, q.qmax)
        np.testing.assert_array_equal(np.asarray(tensor.levels()), expected)
        assert tensor.layout == q.layout and tensor.format == q.format == eqx_quant.IntFormat(q.qmin, q.qmax)
        assert_bitwise_equal(tensor.dequantize(), q(jnp.asarray(x)))


@pytest.mark.parametrize("padding", ["SAME", "VALID", "SAME_LOWER"])
@pytest.mark.slow
def test_string_padding_runs_the_integer_convolution(padding):
    conv = eqx.nn.Conv2d(3, 4, 3, stride=2, padding=padding, key=jax.random.key(8))
    model = eqx_quant.quantize(conv)
    converted = eqx_quant.convert(model)
    x = jax.random.normal(jax.random.key(9), (3, 7, 7))
    assert "preferred_element_type=int32" in str(jax.make_jaxpr(model)(x))
    y = model(x)
    assert y.shape == conv(x).shape
    assert_bitwise_equal(converted(x), y)
    # The float convolution of the same fake-quantized operands: only float rounding apart.
    as_float = eqx_quant.quantize(conv, matmul="float")
    np.testing.assert_allclose(np.asarray(y), np.asarray(as_float(x)), rtol=1e-5, atol=1e-5)
