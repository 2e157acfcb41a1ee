"""`learn_scales` (QAT from PTQ: the scales a weight uses become learned, outputs unchanged bit for bit) and
`quantized_after` (delayed quantization: the float model before a step, the quantized one from it on)."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import eqx_quant

from .helpers import few_rows, slow_unless
from .models import LinearStack


RNG = np.random.default_rng(0)
# Weights (32, 64) and (8, 32): every input size a multiple of 32, so groups and MX blocks fit everywhere.
MLP = eqx.nn.MLP(64, 8, 32, 1, key=jax.random.key(0))
X = jnp.asarray(RNG.standard_normal((16, 64)).astype(np.float32))
Y = jnp.asarray(RNG.standard_normal((16, 8)).astype(np.float32))


@eqx.filter_jit
def _apply(model, x):
    return jax.vmap(model)(x)


def _loss(model, x):
    return jnp.mean((jax.vmap(model)(x) - Y) ** 2)


_jit_loss = eqx.filter_jit(_loss)
_jit_grad = eqx.filter_jit(eqx.filter_grad(_loss))


def _weight_quants(model):
    return [layer.weight_quant for layer in model.layers]


def _absmax(w: np.ndarray, group_size: int | None) -> np.ndarray:
    """`max|w|` per output row (`group_size=None`) or per group of `group_size` input features, in float32."""
    w = np.abs(np.asarray(w, np.float32))
    if group_size is None:
        return w.max(axis=1)
    return w.reshape(w.shape[0], w.shape[1] // group_size, group_size).max(axis=-1)


def _absmax_reference(w: np.ndarray, qmax: int, group_size: int | None) -> np.ndarray:
    """The round-to-nearest scales `max|w| / qmax`, in float64."""
    return _absmax(w, group_size).astype(np.float64) / qmax


def _assert_same_outputs(a, b, x=X):
    out_a, out_b = np.asarray(_apply(a, x)), np.asarray(_apply(b, x))
    assert np.all(np.isfinite(out_a))
    assert np.array_equal(out_a, out_b)


# --- learn_scales ---------------------------------------------------------------------------------------------------


@pytest.mark.slow
@few_rows
def test_learn_scales_on_gptq_keeps_its_scales_outputs_and_conversion():
    qmodel = eqx_quant.quantize(MLP, **eqx_quant.recipe("w4a16_g32", keep=()))
    ptq = eqx_quant.gptq(qmodel, [X])
    assert all(isinstance(q, eqx_quant.FakeQuant) for q in _weight_quants(ptq))
    qat = eqx_quant.learn_scales(ptq)

    for fixed, learned, layer in zip(_weight_quants(ptq), _weight_quants(qat), ptq.layers, strict=True):
        assert isinstance(learned, eqx_quant.LearnedFakeQuant)
        assert learned.format == fixed.format and learned.layout == fixed.layout
        assert learned.zero_point is None and learned.tensor_scale is None
        want = np.asarray(fixed.scale, np.float32)
        assert want.shape == (layer.layer.weight.shape[0], layer.layer.weight.shape[1] // 32)
        got = np.asarray(learned.scale)
        assert got.dtype == np.float32 and np.array_equal(got, want)
    # The weights are GPTQ's, untouched.
    for a, b in zip(ptq.layers, qat.layers, strict=True):
        assert np.array_equal(np.asarray(a.layer.weight), np.asarray(b.layer.weight))

    _assert_same_outputs(ptq, qat)
    # Converting the learned model stores the codes its forward pass rounds to: the same outputs, bit for bit.
    _assert_same_outputs(eqx_quant.convert(qat), qat)


@pytest.mark.parametrize(
    ("name", "qmax", "group_size"), slow_unless([("w4a8_g32", 7, 32)], [("w4a8_g32", 7, 32), ("w8a8", 127, None)])
)
def test_learn_scales_on_round_to_nearest_starts_from_the_dynamic_scales(name, qmax, group_size):
    qmodel = eqx_quant.quantize(MLP, **eqx_quant.recipe(name, keep=()))
    assert all(isinstance(q, eqx_quant.DynamicFakeQuant) for q in _weight_quants(qmodel))
    qat = eqx_quant.learn_scales(qmodel)

    for dynamic, learned, layer in zip(_weight_quants(qmodel), _weight_quants(qat), qmodel.layers, strict=True):
        assert isinstance(learned, eqx_quant.LearnedFakeQuant)
        assert learned.zero_point is None
        w = np.asarray(layer.layer.weight)
        got = np.asarray(learned.scale)
        reference = _absmax_reference(w, qmax, group_size)
        assert got.shape == reference.shape
        np.testing.assert_allclose(got, reference, rtol=1e-6)
        # Nudged up, never down: the largest magnitude of each row or group stays on the grid.
        assert np.all(_absmax(w, group_size) * (np.float32(1) / got) <= np.float32(qmax))
        assert np.array_equal(got, np.asarray(dynamic.quantization_params(layer.layer.weight)[0]))

    _assert_same_outputs(qmodel, qat)


@pytest.mark.slow
def test_learn_scales_on_an_asymmetric_quantizer_learns_its_zero_points():
    # Weights mostly positive, so that the zero points are far from 0 (a dropped zero point would change outputs).
    shifted = jax.tree.map(lambda a: jnp.abs(a) - 0.02 if eqx.is_array(a) and a.ndim == 2 else a, MLP)
    qmodel = eqx_quant.quantize(
        shifted, weights=eqx_quant.DynamicFakeQuant(4, axis=0, symmetric=False), activations=None
    )
    qat = eqx_quant.learn_scales(qmodel)

    for dynamic, learned, layer in zip(_weight_quants(qmodel), _weight_quants(qat), qmodel.layers, strict=True):
        assert isinstance(learned, eqx_quant.LearnedFakeQuant)
        assert learned.zero_point is not None and learned.zero_point.shape == (layer.layer.weight.shape[0],)
        scale, zero_point = (np.asarray(a) for a in dynamic.quantization_params(layer.layer.weight))
        assert np.array_equal(np.asarray(learned.scale), scale)
        assert np.array_equal(np.asarray(learned.zero_point), zero_point)
        zp = np.asarray(learned.zero_point)
        assert np.all(zp == np.round(zp)) and np.all((-8 <= zp) & (zp <= 7))
        assert np.all(zp <= -4)  # min(w) is near 0: real 0 sits near the bottom of the grid
        # The grid covers [min(w, 0), max(w, 0)] of each row (to float32 rounding).
        w = np.asarray(layer.layer.weight, np.float64)
        s = np.asarray(learned.scale, np.float64)
        lo, hi = np.minimum(w.min(axis=1), 0), np.maximum(w.max(axis=1), 0)
        assert np.all((-8 - zp) * s <= lo + 1e-6 * np.abs(lo))
        assert np.all((7 - zp) * s >= hi - 1e-6 * np.abs(hi))

    _assert_same_outputs(qmodel, qat)


@pytest.mark.slow
def test_learn_scales_on_stacked_layers_gives_each_layer_its_own_scales():
    qmodel = eqx_quant.quantize(
        LinearStack(16, 3, jax.random.key(1)), **eqx_quant.recipe("w4a16_g32", group_size=16, keep=())
    )
    qat = eqx_quant.learn_scales(qmodel)
    learned = qat.blocks.weight_quant
    assert isinstance(learned, eqx_quant.LearnedFakeQuant)
    weights = np.asarray(qmodel.blocks.layer.weight)
    assert weights.shape == (3, 16, 16)
    scale = np.asarray(learned.scale)
    assert scale.shape == (3, 16, 1)
    one_layer = eqx_quant.DynamicFakeQuant(4, group_size=16)
    for i in range(3):
        np.testing.assert_allclose(scale[i], _absmax_reference(weights[i], 7, 16), rtol=1e-6)
        assert np.array_equal(scale[i], np.asarray(one_layer.quantization_params(jnp.asarray(weights[i]))[0]))
    assert not np.array_equal(scale[0], scale[1])  # not one set of scales for the whole stack

    x = jnp.asarray(RNG.standard_normal((4, 16)).astype(np.float32))
    _assert_same_outputs(qmodel, qat, x)


def test_learned_scales_receive_gradients_and_train():
    qat = eqx_quant.learn_scales(eqx_quant.quantize(MLP, **eqx_quant.recipe("w4a16_g32", keep=())))
    grads = _jit_grad(qat, X)
    for g in _weight_quants(grads):
        scale_grad = np.asarray(g.scale)
        assert np.all(np.isfinite(scale_grad)) and np.any(scale_grad != 0)
    for layer in grads.layers:
        assert np.any(np.asarray(layer.layer.weight) != 0)

    # One SGD step on the weights and the scales together (what `trainable` selects).
    params, static = eqx.partition(qat, eqx_quant.trainable(qat, input_quantizers=False))

    def loss(p):
        return _loss(eqx.combine(p, static), X)

    before, param_grads = eqx.filter_jit(eqx.filter_value_and_grad(loss))(params)
    stepped = jax.tree.map(lambda p, g: p - 1e-2 * g, params, param_grads)
    after = eqx.filter_jit(loss)(stepped)
    assert np.isfinite(after) and after != before
    for old, new in zip(_weight_quants(params), _weight_quants(stepped), strict=True):
        assert not np.array_equal(np.asarray(old.scale), np.asarray(new.scale))


@pytest.mark.parametrize("name", ["mxfp4", "nvfp4", "q4_0"])
def test_learn_scales_rejects_a_model_of_block_formats_only(name):
    qmodel = eqx_quant.quantize(MLP, **eqx_quant.recipe(name, keep=()))
    assert all(isinstance(q, eqx_quant.DynamicFakeQuant) for q in _weight_quants(qmodel))
    with pytest.raises(ValueError, match="float32"):
        eqx_quant.learn_scales(qmodel)


def test_learn_scales_leaves_block_formats_of_a_mixed_model_alone():
    qmodel = eqx_quant.quantize(MLP, **eqx_quant.recipe("mxfp4", keep=(r"layers\.1",)))
    qat = eqx_quant.learn_scales(qmodel)
    mx = qmodel.layers[0].weight_quant
    assert mx.format.scale == "e8m0"
    assert isinstance(qat.layers[0].weight_quant, eqx_quant.DynamicFakeQuant) and qat.layers[0].weight_quant == mx
    learned = qat.layers[1].weight_quant
    assert isinstance(learned, eqx_quant.LearnedFakeQuant) and learned.scale.shape == (8,)
    w = qmodel.layers[1].layer.weight
    want = qmodel.layers[1].weight_quant.quantization_params(w)[0]
    assert np.array_equal(np.asarray(learned.scale), np.asarray(want))
    np.testing.assert_allclose(np.asarray(learned.scale), _absmax_reference(np.asarray(w), 127, None), rtol=1e-6)
    _assert_same_outputs(qmodel, qat)


def test_learn_scales_keeps_learned_quantizers_as_they_are():
    qmodel = eqx_quant.quantize(MLP, **eqx_quant.recipe("w4a8_g32", keep=(), learned=True))
    # Moved away from their initial values, so that recomputing them from the weights would show.
    qmodel = eqx.tree_at(lambda m: [q.scale for q in _weight_quants(m)], qmodel, replace_fn=lambda s: s * 1.5)
    qat = eqx_quant.learn_scales(qmodel)
    assert jax.tree.structure(qat) == jax.tree.structure(qmodel)
    for a, b in zip(jax.tree.leaves(qmodel), jax.tree.leaves(qat), strict=True):
        assert np.array_equal(np.asarray(a), np.asarray(b))


class _TiedAttention(eqx.Module):
    """Tokens embedded by a layer, one attention of bare projections, and the embedding's table as the output head."""

    embed: eqx.nn.Embedding
    wq: jax.Array

    def __call__(self, tokens):
        h = jax.vmap(self.embed)(tokens)
        scores = (h @ self.wq) @ h.T
        return (jax.nn.softmax(scores) @ h) @ self.embed.weight.T


def test_learn_scales_on_a_traced_model_with_a_tied_head_keeps_its_products():
    """A quantized embedding's `.weight` read by a tied head is computed from the layer's arrays alone, whatever its
    quantizer: the head's product is no product of two activations, with the table's dynamic scales (before
    `learn_scales`) as with its learned ones (after): the two attention products are `products.0` and `products.1`,
    and `learn_scales` keeps the outputs."""
    model = _TiedAttention(eqx.nn.Embedding(16, 8, key=jax.random.key(0)), jax.random.normal(jax.random.key(1), (8, 8)))
    tokens = jnp.arange(5)
    traced = eqx_quant.quantize(model, **eqx_quant.recipe("w8a8_attn"), example=(tokens,))
    assert traced.product_indices == (0, 1)
    learned = eqx_quant.learn_scales(traced)
    assert isinstance(learned.model.embed.weight_quant, eqx_quant.LearnedFakeQuant)
    np.testing.assert_array_equal(np.asarray(learned(tokens)), np.asarray(traced(tokens)))
    # Converted, the table is stored as integer codes: still the embedding layer's arrays, the same products.
    for model in (traced, learned):
        converted = eqx_quant.convert(model)
        np.testing.assert_array_equal(np.asarray(converted(tokens)), np.asarray(model(tokens)))
        np.testing.assert_array_equal(np.asarray(eqx.filter_jit(converted)(tokens)), np.asarray(model(tokens)))


def test_learn_scales_rejects_models_without_weight_quantizers():
    with pytest.raises(ValueError, match="float32"):
        eqx_quant.learn_scales(MLP)
    inputs_only = eqx_quant.quantize(MLP, weights=None, activations=eqx_quant.DynamicFakeQuant(8))
    with pytest.raises(ValueError, match="float32"):
        eqx_quant.learn_scales(inputs_only)


# --- quantized_after ------------------------------------------------------------------------------------------------

QMODEL = eqx_quant.quantize(MLP, **eqx_quant.recipe("w4a8_g32", keep=()))


def test_quantized_after_switches_at_n_steps_and_compiles_once():
    traces = []

    def loss(model, x):
        traces.append(None)
        return _loss(model, x)

    step = eqx.filter_jit(lambda m, s: eqx_quant.quantized_after(5, s, loss, m, X))
    values = {s: np.asarray(step(QMODEL, jnp.asarray(s, jnp.int32))) for s in (0, 4, 5, 9)}
    assert len(traces) == 2  # one trace per branch, one compilation for all four steps

    float_value = np.asarray(_jit_loss(eqx_quant.float_model(QMODEL), X))
    quant_value = np.asarray(_jit_loss(QMODEL, X))
    assert float_value != quant_value
    for s in (0, 4):
        assert np.array_equal(values[s], float_value)
    for s in (5, 9):
        assert np.array_equal(values[s], quant_value)


@pytest.mark.slow
def test_quantized_after_gradients_follow_the_branch():
    qat = eqx_quant.learn_scales(QMODEL)
    grad = eqx.filter_jit(eqx.filter_grad(lambda m, s: eqx_quant.quantized_after(5, s, _loss, m, X)))
    float_grads = _jit_grad(eqx_quant.float_model(qat), X)
    quant_grads = _jit_grad(qat, X)

    before = grad(qat, jnp.asarray(4, jnp.int32))
    for layer, want in zip(before.layers, float_grads.layers, strict=True):
        assert np.any(np.asarray(layer.layer.weight) != 0)
        assert np.array_equal(np.asarray(layer.layer.weight), np.asarray(want.weight))
        assert np.array_equal(np.asarray(layer.layer.bias), np.asarray(want.bias))
        assert np.all(np.asarray(layer.weight_quant.scale) == 0)

    after = grad(qat, jnp.asarray(5, jnp.int32))
    assert jax.tree.structure(after) == jax.tree.structure(quant_grads)
    # The same gradients, up to the order of a sum: XLA compiles the branch of `lax.cond` as a program of its own,
    # and the batch sum of the last bias's gradient comes out one ulp apart from the standalone program's.
    for got, want in zip(jax.tree.leaves(after), jax.tree.leaves(quant_grads), strict=True):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-6, atol=0)
    assert all(np.any(np.asarray(q.scale) != 0) for q in _weight_quants(after))
    # The quantized gradients are not the float ones.
    assert not np.array_equal(np.asarray(after.layers[0].layer.weight), np.asarray(float_grads.layers[0].weight))


def test_quantized_after_zero_steps_is_quantized_from_the_start():
    delayed = eqx.filter_jit(lambda n, s, m: eqx_quant.quantized_after(n, s, _loss, m, X))
    quant_value = np.asarray(_jit_loss(QMODEL, X))
    float_value = np.asarray(_jit_loss(eqx_quant.float_model(QMODEL), X))
    assert quant_value != float_value
    assert np.array_equal(np.asarray(delayed(0, jnp.asarray(0, jnp.int32), QMODEL)), quant_value)
    # Python int steps (static under `filter_jit`) switch at the same step.
    assert np.array_equal(np.asarray(delayed(1, 0, QMODEL)), float_value)
    assert np.array_equal(np.asarray(delayed(1, 1, QMODEL)), quant_value)


def test_quantized_after_passes_args_and_kwargs_through():
    def fn(model, x, *, scale):
        out = jax.vmap(model)(x)
        return scale * jnp.mean(out**2), out

    step = eqx.filter_jit(lambda m, s, x, scale: eqx_quant.quantized_after(3, s, fn, m, x, scale=scale))
    reference = eqx.filter_jit(lambda m, x, scale: fn(m, x, scale=scale))
    for s, model in ((2, eqx_quant.float_model(QMODEL)), (3, QMODEL)):
        for scale in (2.0, 4.0):
            scale = jnp.asarray(scale, jnp.float32)
            got = step(QMODEL, jnp.asarray(s, jnp.int32), X, scale)
            want = reference(model, X, scale)
            assert np.array_equal(np.asarray(got[0]), np.asarray(want[0]))
            assert np.array_equal(np.asarray(got[1]), np.asarray(want[1]))
    # The keyword reaches `fn`: another scale, another value.
    two, four = (step(QMODEL, jnp.asarray(3, jnp.int32), X, jnp.asarray(c, jnp.float32))[0] for c in (2.0, 4.0))
    np.testing.assert_allclose(np.asarray(four), 2.0 * np.asarray(two), rtol=1e-6)


@pytest.mark.parametrize(
    ("n_steps", "step", "fn", "model", "error", "match"),
    [
        (-1, 0, _loss, QMODEL, ValueError, "non-negative"),
        (2.0, 0, _loss, QMODEL, TypeError, "n_steps"),
        (True, 0, _loss, QMODEL, TypeError, "n_steps"),
        (2, 1.5, _loss, QMODEL, TypeError, "step"),
        # Under the test suite's jaxtyping hook, beartype rejects the annotations first (naming the parameter).
        (2, jnp.zeros(2, jnp.int32), _loss, QMODEL, TypeError, "step"),
        (2, jnp.asarray(1.0), _loss, QMODEL, TypeError, "step"),
        (2, True, _loss, QMODEL, TypeError, "step"),
        (2, 0, "loss", QMODEL, TypeError, "[Cc]allable"),
        (2, 0, _loss, MLP, ValueError, "no quantized layer"),
    ],
)
def test_quantized_after_errors(n_steps, step, fn, model, error, match):
    with pytest.raises(error, match=match):
        eqx_quant.quantized_after(n_steps, step, fn, model, X)


def test_quantized_after_refuses_outputs_that_are_not_arrays():
    with pytest.raises(TypeError, match="`fn` must return a PyTree of arrays .* got a leaf 'done' of type str"):
        eqx_quant.quantized_after(2, 0, lambda m, x: (_loss(m, x), "done"), QMODEL, X)
    with pytest.raises(TypeError, match="got a leaf 3 of type int"):
        eqx_quant.quantized_after(2, 0, lambda m, x: {"n": 3}, QMODEL, X)


def test_learn_scales_refuses_layers_that_differentiate_as_float():
    model = eqx_quant.quantize(MLP, **eqx_quant.recipe("w8a8", backward=eqx_quant.UnquantizedBackward()))
    with pytest.raises(ValueError, match="Layer 'layers.0' differentiates as the float layer"):
        eqx_quant.learn_scales(model)
