"""Models under `jax_enable_x64`: float64 layers compute their products in float64 on the fake-quantized operands
(the integer sums are rescaled in float32, so they are not used), and their converted models compute the same bits;
float32 models keep the integer path and every format."""

import equinox as eqx
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import eqx_quant

from .helpers import assert_bitwise_equal, integer_products, slow_unless


RUN = eqx.filter_jit(lambda model, x: jax.vmap(model)(x))
CALL = eqx.filter_jit(lambda model, x: model(x))
W8, X8 = eqx_quant.DynamicFakeQuant(8, axis=0), eqx_quant.DynamicFakeQuant(8)


class _Bare(eqx.Module):
    """A weight held as a bare array, and a product of two activations."""

    w: jax.Array

    def __call__(self, x):
        h = jnp.einsum("td,od->to", x, self.w)
        return jnp.einsum("to,so->ts", h, h)


@eqx.filter_jit
def _bare_by_hand(model, x):
    """`_Bare` on fake-quantized operands: the weight per output row, the input and the product's operands per
    tensor, in float64."""
    h = jnp.einsum("td,od->to", X8(x), W8(model.w))
    return jnp.einsum("to,so->ts", X8(h), X8(h))


def _grads_finite(model, x):
    grads = eqx.filter_grad(lambda m: jnp.sum(RUN(m, x)))(model)
    return all(bool(jnp.all(jnp.isfinite(g))) for g in jax.tree.leaves(eqx.filter(grads, eqx.is_array)))


@pytest.mark.parametrize("recipe", ["w8a8", "w4a8_g32"])
@pytest.mark.slow
def test_float64_linear_layers_compute_in_float64_and_convert_bit_for_bit(recipe):
    with jax.enable_x64(True):
        linear = eqx.nn.Linear(32, 4, key=jax.random.key(0), dtype=jnp.float64)
        x = jnp.asarray(np.random.default_rng(0).normal(size=(3, 32)))
        q = eqx_quant.quantize(linear, **eqx_quant.recipe(recipe))
        y = RUN(q, x)
        assert y.dtype == jnp.float64
        assert integer_products(jax.make_jaxpr(q)(x[0]).jaxpr) == 0
        # The float64 product of the fake-quantized operands, in NumPy.
        w = np.asarray(q.weight_quant(linear.weight))
        xq = np.stack([np.asarray(q.input_quant(row)) for row in x])
        assert w.dtype == xq.dtype == np.float64
        np.testing.assert_allclose(np.asarray(y), xq @ w.T + np.asarray(linear.bias), rtol=1e-13, atol=1e-14)
        assert_bitwise_equal(jax.vmap(q)(x), y)  # eagerly
        assert_bitwise_equal(RUN(eqx_quant.convert(q), x), y)
        calibrated = eqx_quant.calibrate(q, [x])
        assert_bitwise_equal(RUN(eqx_quant.convert(calibrated), x), RUN(calibrated, x))
        assert _grads_finite(q, x)


@pytest.mark.slow
def test_float64_convolutions_traced_weights_and_products():
    with jax.enable_x64(True):
        rng = np.random.default_rng(1)
        conv = eqx.nn.Conv2d(2, 3, 3, key=jax.random.key(0), dtype=jnp.float64)
        images = jnp.asarray(rng.normal(size=(2, 2, 6, 6)))
        q = eqx_quant.quantize(conv, **eqx_quant.recipe("w8a8"))
        y = RUN(q, images)
        by_hand = eqx.tree_at(lambda c: c.weight, conv, q.weight_quant(conv.weight))
        np.testing.assert_allclose(np.asarray(y), np.asarray(RUN(by_hand, RUN(q.input_quant, images))), rtol=1e-13)
        assert_bitwise_equal(RUN(eqx_quant.convert(q), images), y)
        assert _grads_finite(q, images)

        bare = _Bare(jnp.asarray(rng.normal(size=(4, 32))))
        x = jnp.asarray(rng.normal(size=(3, 32)))
        rules = [eqx_quant.Rule(".*", weight=W8, input=X8, products=X8)]
        traced = eqx_quant.quantize(bare, rules, example=(x,))
        assert len(traced.product_indices) == 1  # the product of two activations
        y = CALL(traced, x)
        assert y.dtype == jnp.float64 and integer_products(jax.make_jaxpr(traced)(x).jaxpr) == 0
        np.testing.assert_allclose(np.asarray(y), np.asarray(_bare_by_hand(bare, x)), rtol=1e-12, atol=1e-12)
        assert_bitwise_equal(CALL(eqx_quant.convert(traced), x), y)
        assert _grads_finite(traced, x[None])

        scores = eqx_quant.nn.QuantEinsum(eqx_quant.nn.Einsum("td,sd->ts"), lhs_quant=X8, rhs_quant=X8)
        tokens = x.reshape(3, 4, 8)
        got = RUN(lambda t: scores(t, t), tokens)
        quantized = np.stack([np.asarray(X8(t)) for t in tokens])
        np.testing.assert_allclose(np.asarray(got), np.einsum("btd,bsd->bts", quantized, quantized), rtol=1e-13)


@pytest.mark.parametrize("recipe", slow_unless(["nvfp4"], ["w8a8", "fp8", "nvfp4", "w4a16_g32"]))
def test_float32_models_under_x64_are_unchanged(recipe):
    """The same outputs, bit for bit, as without x64; the integer products stay."""
    linear = eqx.nn.Linear(32, 4, key=jax.random.key(0))
    x = jnp.asarray(np.random.default_rng(2).normal(size=(3, 32)).astype(np.float32))
    q = eqx_quant.quantize(linear, **eqx_quant.recipe(recipe))
    want = np.asarray(RUN(q, x))
    products = integer_products(jax.make_jaxpr(q)(x[0]).jaxpr)
    with jax.enable_x64(True):
        q = eqx_quant.quantize(linear, **eqx_quant.recipe(recipe))
        y = RUN(q, x)
        assert y.dtype == jnp.float32
        assert_bitwise_equal(y, want)
        assert integer_products(jax.make_jaxpr(q)(x[0]).jaxpr) == products == (recipe == "w8a8")
        assert_bitwise_equal(RUN(eqx_quant.convert(q), x), want)
        if recipe == "fp8":  # the weights' elements are FP8 E4M3 values times their row's scale
            scale = np.asarray(q.weight_quant.quantization_params(linear.weight)[0]).reshape(-1, 1)
            w = np.asarray(linear.weight) * (np.float32(1) / scale)
            np.testing.assert_array_equal(
                np.asarray(q.weight_quant(linear.weight)), w.astype(ml_dtypes.float8_e4m3fn).astype(np.float32) * scale
            )


def test_what_takes_no_float64_says_so():
    """The integer backward needs the integer forward, which a float64 operand does not take; the quantized KV cache
    computes in float32: both name the float64 operand."""
    with jax.enable_x64(True):
        linear = eqx.nn.Linear(8, 4, key=jax.random.key(0), dtype=jnp.float64)
        q = eqx_quant.quantize(linear, weights=W8, activations=X8, backward=eqx_quant.QuantizedBackward(8))
        with pytest.raises(ValueError, match=r"compute in float64 \(weight float64, input float64\)"):
            q(jnp.ones(8))
        cache = eqx_quant.nn.QuantKVCache.empty(4, 2, 3)
        row = jnp.ones((2, 3))
        with pytest.raises(TypeError, match="`value` is float64"):
            cache.append(row.astype(jnp.float32), row, 0)
        with pytest.raises(TypeError, match="`query` is float64"):
            cache.attend(row, 1)
