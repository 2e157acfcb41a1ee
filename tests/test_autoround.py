"""`eqx_quant.autoround`: learned rounding and clipping by signed gradient descent, checked against NumPy round to
nearest, the layer's output error computed in float64, the layers' Hessians collected by hand, and the converted
model."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import eqx_quant
from eqx_quant._autoround import autoround_solve

from .helpers import assert_bitwise_equal, init
from .models import LinearStack


def correlated(seed: int, count: int, n: int) -> np.ndarray:
    """Inputs whose `n` features mix a few latent factors, plus a little noise: a Hessian far from diagonal."""
    rng = np.random.default_rng(seed)
    return (rng.normal(size=(count, 4)) @ rng.normal(size=(4, n)) + 0.1 * rng.normal(size=(count, n))).astype(
        np.float32
    )


def output_error(weight, reference, hessian) -> float:
    """`tr((W - W_ref) H (W - W_ref)ᵀ)` in float64."""
    d = np.asarray(weight, np.float64) - np.asarray(reference, np.float64)
    return float(np.sum((d @ np.asarray(hessian, np.float64)) * d))


def numpy_rtn(weight, qmax: int, group: int) -> tuple[np.ndarray, np.ndarray]:
    """Round to nearest with `s = max|w| / qmax` per row and group of `group` columns: `(levels, s)`."""
    w = np.asarray(weight, np.float32).reshape(weight.shape[0], -1, group)
    s = np.maximum(np.max(np.abs(w), axis=-1, keepdims=True) / np.float32(qmax), np.finfo(np.float32).tiny)
    levels = np.clip(np.round(w / s), -qmax - 1, qmax)
    return levels.reshape(weight.shape), s[..., 0]


W = np.random.default_rng(0).normal(size=(8, 32)).astype(np.float32)
X = correlated(1, 256, 32)
H = X.T.astype(np.float64) @ X


@pytest.mark.parametrize("group_size", [None, 16])
def test_a_vanishing_step_is_round_to_nearest(group_size):
    """With a learning rate too small to move any offset past a rounding boundary, the result is round to nearest
    with absmax scales, the NumPy twin's levels and scales."""
    weight, scales, tensor = autoround_solve(
        jnp.asarray(W), jnp.asarray(H, jnp.float32), jnp.float32(1e-12), qmin=-8, qmax=7, group_size=group_size,
        steps=3,
    )  # fmt: skip
    g = 32 if group_size is None else group_size
    levels, s = numpy_rtn(W, 7, g)
    # XLA divides by `qmax` as a product with its reciprocal: the scales may differ from NumPy's by an ulp.
    np.testing.assert_allclose(np.asarray(scales).reshape(s.shape), s, rtol=2e-7)
    repeated = np.repeat(np.asarray(scales).reshape(s.shape), g, axis=-1)
    np.testing.assert_array_equal(np.round(np.asarray(weight) / repeated), levels)
    np.testing.assert_array_equal(np.asarray(weight), (levels * repeated).astype(np.float32))
    assert tensor is None


@pytest.mark.parametrize(("qmin", "qmax", "group_size"), [(-8, 7, None), (-4, 3, 16), (-2, 1, 16)])
def test_learned_rounding_stays_on_the_grid_and_never_loses_to_round_to_nearest(qmin, qmax, group_size):
    g = 32 if group_size is None else group_size
    weight, scales, _ = autoround_solve(
        jnp.asarray(W), jnp.asarray(H, jnp.float32), jnp.float32(1 / 50), qmin=qmin, qmax=qmax,
        group_size=group_size, steps=50,
    )  # fmt: skip
    s = np.repeat(np.asarray(scales).reshape(8, -1), g, axis=-1)
    levels = np.round(np.asarray(weight) / s)
    np.testing.assert_array_equal(np.asarray(weight), (levels * s).astype(np.float32))  # integers times the scales
    assert levels.min() >= qmin and levels.max() <= qmax
    # The clipping factor is within [1/2, 1] of the absmax scale, the offsets within half a step.
    _, rtn_s = numpy_rtn(W, qmax, g)
    ratio = np.asarray(scales).reshape(rtn_s.shape) / rtn_s
    assert ratio.min() >= 0.5 - 1e-6 and ratio.max() <= 1 + 1e-6
    unclipped = (levels > qmin) & (levels < qmax)
    assert np.all(np.abs(levels - W / s)[unclipped] <= 1 + 1e-4)
    rtn_levels, rtn_scales = numpy_rtn(W, qmax, g)
    rtn = rtn_levels * np.repeat(rtn_scales, g, axis=-1)
    learned, nearest = output_error(weight, W, H), output_error(rtn, W, H)
    assert learned <= nearest
    assert learned < 0.7 * nearest  # the correlated inputs leave room that rounding each weight alone misses


@pytest.mark.slow
def test_autoround_on_a_model_solves_each_layer_on_the_rounded_outputs_of_the_previous():
    """Sequential: the second layer's Hessian is the Gram matrix of its inputs through the first layer's learned
    weight (computed here by hand); each layer holds `autoround_solve`'s weight and a static quantizer that
    reproduces it; converted == fake-quant bit for bit; save and load keep it."""
    mlp = init(lambda k: eqx.nn.MLP(32, 8, 32, 1, activation=jnp.tanh, key=k), 3)
    qmodel = eqx_quant.quantize(mlp, **eqx_quant.recipe("w3a16_g32"))
    x = jnp.asarray(X)
    rounded = eqx_quant.autoround(qmodel, [x[:128], x[128:]], steps=20)
    h = np.asarray(X, np.float64)
    for i in range(2):
        layer = rounded.layers[i]
        expected = autoround_solve(
            qmodel.layers[i].layer.weight, jnp.asarray(h.T @ h, jnp.float32), jnp.float32(1 / 20), qmin=-4, qmax=3,
            group_size=32 if i == 0 else None, steps=20,
        )[0]  # fmt: skip
        # The Hessian by hand sums in another order than the observers: a weight may move by a rounding step.
        assert np.mean(np.asarray(layer.layer.weight) == np.asarray(expected)) > 0.95
        assert type(layer.weight_quant) is eqx_quant.FakeQuant
        assert_bitwise_equal(layer.weight_quant(layer.layer.weight), layer.layer.weight)
        h = np.tanh(np.asarray(jax.vmap(layer)(jnp.asarray(h, jnp.float32)), np.float64))
    run = eqx.filter_jit(lambda m, x: jax.vmap(m)(x))
    converted = eqx_quant.convert(rounded)
    assert_bitwise_equal(run(converted, x), run(rounded, x))
    reference = run(mlp, x)
    error = lambda m: float(jnp.linalg.norm(run(m, x) - reference))  # noqa: E731
    assert error(rounded) < error(qmodel)


@pytest.mark.slow
def test_autoround_on_a_scanned_stack_and_its_storage(tmp_path):
    model = init(lambda k: LinearStack(32, 2, k), 4)
    qmodel = eqx_quant.quantize(model, **eqx_quant.recipe("w4a16_g32"))
    x = jnp.asarray(X[:64])
    rounded = eqx_quant.autoround(qmodel, [x], steps=10, sequential=False)
    quantizer = rounded.blocks.weight_quant
    assert type(quantizer) is eqx_quant.LearnedFakeQuant and quantizer.scale.shape == (2, 32, 1)
    run = eqx.filter_jit(lambda m, x: jax.vmap(m)(x))
    converted = eqx_quant.convert(rounded)
    assert_bitwise_equal(run(converted, x), run(rounded, x))
    eqx_quant.save(tmp_path / "m.eqx", converted)
    loaded = eqx_quant.load(tmp_path / "m.eqx", eqx.filter_eval_shape(LinearStack, 32, 2, jax.random.key(0)))
    assert_bitwise_equal(run(loaded, x), run(converted, x))


def test_autoround_errors():
    mlp = init(lambda k: eqx.nn.MLP(32, 8, 32, 1, key=k), 5)
    x = [jnp.asarray(X[:8])]
    with pytest.raises(ValueError, match="steps"):
        eqx_quant.autoround(eqx_quant.quantize(mlp, **eqx_quant.recipe("w4a16_g32")), x, steps=0)
    with pytest.raises(ValueError, match="learning_rate"):
        eqx_quant.autoround(eqx_quant.quantize(mlp, **eqx_quant.recipe("w4a16_g32")), x, learning_rate=-1.0)
    with pytest.raises(ValueError, match="layers.0.*float8_e4m3fn.*gptq"):
        eqx_quant.autoround(eqx_quant.quantize(mlp, **eqx_quant.recipe("fp8")), x)
    with pytest.raises(ValueError, match="no QuantLinear"):
        eqx_quant.autoround(eqx_quant.quantize(mlp, **eqx_quant.recipe("w4a16_g32")), x, where=lambda p, l: False)
