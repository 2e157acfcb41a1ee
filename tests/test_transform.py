import re

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from eqx_quant import DynamicFakeQuant, FakeQuant, Rule, calibrate, dequantize, quantize
from eqx_quant.nn import AbstractQuantLayer, QuantConv, QuantEmbedding, QuantLinear

from .helpers import init, reference_fake_quant


@eqx.filter_jit
def quantization_params(quantizer, x):
    return quantizer.quantization_params(x)


def numpy_dynamic_quant(quantizer: DynamicFakeQuant, x) -> np.ndarray:
    """`quantizer(x)` by the NumPy reference, with the scale and zero point the quantizer reports for `x`."""
    x = np.asarray(x)
    scale, zero_point = (np.asarray(a) for a in quantization_params(quantizer, jnp.asarray(x)))
    if quantizer.axis is not None:
        shape = [1] * x.ndim
        shape[quantizer.axis] = -1
        scale, zero_point = scale.reshape(shape), zero_point.reshape(shape)
    return reference_fake_quant(x, scale, quantizer.qmin, quantizer.qmax, zero_point)


def leaves_identical(a, b) -> bool:
    leaves_a, leaves_b = jax.tree.leaves(a), jax.tree.leaves(b)
    return len(leaves_a) == len(leaves_b) and all(x is y for x, y in zip(leaves_a, leaves_b))


def record(calls: list, result):
    """A `(path, layer)` callable that appends its arguments to `calls` and returns `result(path, layer)`."""

    def fn(path, layer):
        calls.append((path, layer))
        return result(path, layer)

    return fn


# ---------------------------------------------------------------------------------------------------------------------
# Models.


class Block(eqx.Module):
    conv: eqx.nn.Conv1d
    linear: eqx.nn.Linear

    def __init__(self, key):
        k1, k2 = jax.random.split(key)
        self.conv = eqx.nn.Conv1d(2, 2, 3, padding=1, key=k1)
        self.linear = eqx.nn.Linear(8, 8, key=k2)

    def __call__(self, x):
        x = jax.nn.relu(self.conv(x))
        return self.linear(x.reshape(8)).reshape(2, 4)


class Nested(eqx.Module):
    embed: eqx.nn.Embedding
    blocks: list
    heads: dict
    norm: eqx.nn.LayerNorm
    temperature: jax.Array
    name: str = eqx.field(static=True)

    def __init__(self, key):
        keys = jax.random.split(key, 5)
        self.embed = eqx.nn.Embedding(6, 8, key=keys[0])
        self.blocks = [Block(keys[1]), Block(keys[2])]
        self.heads = {"key": eqx.nn.Linear(8, 3, key=keys[3]), "value": eqx.nn.Linear(8, 3, key=keys[4])}
        self.norm = eqx.nn.LayerNorm(8)
        self.temperature = jnp.array(0.5)
        self.name = "nested"

    def __call__(self, index):
        h = self.embed(index).reshape(2, 4)
        for block in self.blocks:
            h = block(h)
        h = self.norm(h.reshape(8))
        return {name: head(h) for name, head in self.heads.items()}


# Every quantizable layer of `Nested`: its path as eqx_quant names it, how to reach it, and its wrapper.
NESTED_LAYERS = {
    "embed": (lambda m: m.embed, QuantEmbedding),
    "blocks.0.conv": (lambda m: m.blocks[0].conv, QuantConv),
    "blocks.0.linear": (lambda m: m.blocks[0].linear, QuantLinear),
    "blocks.1.conv": (lambda m: m.blocks[1].conv, QuantConv),
    "blocks.1.linear": (lambda m: m.blocks[1].linear, QuantLinear),
    "heads.key": (lambda m: m.heads["key"], QuantLinear),
    "heads.value": (lambda m: m.heads["value"], QuantLinear),
}


class ConvNet(eqx.Module):
    conv1: eqx.nn.Conv2d
    conv2: eqx.nn.Conv2d
    linear: eqx.nn.Linear

    def __init__(self, key):
        k1, k2, k3 = jax.random.split(key, 3)
        self.conv1 = eqx.nn.Conv2d(1, 2, 3, padding=1, key=k1)
        self.conv2 = eqx.nn.Conv2d(2, 3, 3, stride=2, key=k2)
        self.linear = eqx.nn.Linear(12, 2, key=k3)

    def __call__(self, x):
        x = jax.nn.relu(self.conv1(x))
        x = jax.nn.relu(self.conv2(x))
        return self.linear(x.reshape(12))


class Stacked(eqx.Module):
    """Three `Linear(4, 4)` layers stored as one, with a leading layer axis, applied with `jax.lax.scan`."""

    layers: eqx.Module

    def __init__(self, key):
        self.layers = eqx.filter_vmap(lambda k: eqx.nn.Linear(4, 4, key=k))(jax.random.split(key, 3))

    def __call__(self, x):
        dynamic, static = eqx.partition(self.layers, eqx.is_array)

        def body(h, layer_arrays):
            layer = eqx.combine(layer_arrays, static)
            return jax.nn.relu(layer(h)), None

        return jax.lax.scan(body, x, dynamic)[0]


@pytest.fixture(scope="module")
def nested():
    return Nested(jax.random.key(1))


@pytest.fixture(scope="module")
def mlp():
    return eqx.nn.MLP(3, 2, 5, 2, key=jax.random.key(2))


def wrap_by_hand(model, getters, make):
    return eqx.tree_at(lambda m: [get(m) for get in getters], model, [make(get(model)) for get in getters])


def default_wrapper(layer):
    if isinstance(layer, eqx.nn.Embedding):
        return QuantEmbedding(layer)
    if isinstance(layer, eqx.nn.Conv):
        return QuantConv(layer)
    return QuantLinear(layer)


# ---------------------------------------------------------------------------------------------------------------------
# quantize: which layers are swapped, by path.


@pytest.mark.slow
def test_quantize_nested_model(nested):
    calls = []
    qmodel = quantize(nested, where=record(calls, lambda path, layer: True))
    # The predicate sees every candidate once, under its dotted path, with the layer itself.
    assert sorted(path for path, _ in calls) == sorted(NESTED_LAYERS)
    for path, layer in calls:
        assert layer is NESTED_LAYERS[path][0](nested)
    for path, (get, wrapper) in NESTED_LAYERS.items():
        layer = get(qmodel)
        assert type(layer) is wrapper, path
        assert layer.layer is get(nested)
        assert layer.weight_quant == DynamicFakeQuant(8, axis=0)
        assert layer.input_quant == (None if wrapper is QuantEmbedding else DynamicFakeQuant(8))
    # Everything else is kept: the norm, the array leaf, the static string; every leaf is the same object.
    assert type(qmodel.norm) is eqx.nn.LayerNorm and qmodel.norm.weight is nested.norm.weight
    assert qmodel.temperature is nested.temperature and qmodel.name == "nested"
    assert leaves_identical(qmodel, nested)
    # The same model as wrapping each layer by hand.
    by_hand = wrap_by_hand(nested, [get for get, _ in NESTED_LAYERS.values()], default_wrapper)
    assert eqx.tree_equal(qmodel, by_hand)
    out = eqx.filter_jit(lambda m, i: m(i))(qmodel, jnp.asarray(4))
    assert set(out) == {"key", "value"} and out["key"].shape == (3,)


@pytest.mark.slow
def test_quantize_small_convnet():
    model = ConvNet(jax.random.key(3))
    qmodel = quantize(model)
    assert type(qmodel.conv1) is QuantConv and type(qmodel.conv2) is QuantConv and type(qmodel.linear) is QuantLinear
    assert qmodel.conv2.layer is model.conv2
    getters = [lambda m: m.conv1, lambda m: m.conv2, lambda m: m.linear]
    assert eqx.tree_equal(qmodel, wrap_by_hand(model, getters, default_wrapper))
    # Against the float layers applied by hand to the fake-quantized weights and inputs (the default forward is the
    # integer one, equal up to float rounding).

    @eqx.filter_jit
    def by_hand(model, x):
        for name in ("conv1", "conv2", "linear"):
            layer = getattr(model, name)
            layer = eqx.tree_at(lambda l: l.weight, layer, DynamicFakeQuant(8, axis=0)(layer.weight))
            x = layer(DynamicFakeQuant(8)(x.reshape(12) if name == "linear" else x))
            x = x if name == "linear" else jax.nn.relu(x)
        return x

    x = jax.random.uniform(jax.random.key(4), (1, 5, 5))
    expected = by_hand(model, x)
    out = eqx.filter_jit(lambda m, x: m(x))(qmodel, x)
    np.testing.assert_allclose(out, expected, rtol=1e-5, atol=1e-5)


def test_quantize_sequential():
    keys = jax.random.split(jax.random.key(5), 2)
    seq = eqx.nn.Sequential(
        [eqx.nn.Linear(3, 4, key=keys[0]), eqx.nn.Lambda(jax.nn.relu), eqx.nn.Linear(4, 2, key=keys[1])]
    )
    calls = []
    qseq = quantize(seq, weights=record(calls, lambda path, layer: DynamicFakeQuant(4, axis=0)))
    assert [path for path, _ in calls] == ["layers.0", "layers.2"]
    assert type(qseq.layers[0]) is QuantLinear and type(qseq.layers[2]) is QuantLinear
    assert type(qseq.layers[1]) is eqx.nn.Lambda and qseq.layers[1].fn is jax.nn.relu
    assert qseq.layers[2].weight_quant == DynamicFakeQuant(4, axis=0)
    assert leaves_identical(qseq, seq)


@pytest.mark.slow
def test_quantize_stacked_layers_under_scan():
    model = Stacked(jax.random.key(6))
    assert model.layers.weight.shape == (3, 4, 4)
    calls = []
    qmodel = quantize(model, where=record(calls, lambda path, layer: True))
    assert [path for path, _ in calls] == ["layers"]
    assert type(qmodel.layers) is QuantLinear and qmodel.layers.layer is model.layers
    x = jnp.array([0.5, -1.0, 2.0, 0.25])
    out = eqx.filter_jit(lambda m, x: m(x))(qmodel, x)
    # Inside the scan each slice is one layer: its weight gets one scale per output row.
    h = np.asarray(x)
    weights, biases = np.asarray(model.layers.weight), np.asarray(model.layers.bias)
    for i in range(3):
        w_q = numpy_dynamic_quant(DynamicFakeQuant(8, axis=0), weights[i])
        h_q = numpy_dynamic_quant(DynamicFakeQuant(8), h)
        h = np.maximum(w_q @ h_q + biases[i], 0)
    np.testing.assert_allclose(out, h, rtol=1e-4, atol=1e-4)
    float_out = eqx.filter_jit(lambda m, x: m(x))(model, x)
    assert not np.allclose(out, float_out, rtol=1e-6, atol=0)


# ---------------------------------------------------------------------------------------------------------------------
# quantize: `where`.


def test_where_regex(nested):
    qmodel = quantize(nested, where=r"blocks\.\d+\.conv")
    for path, (get, wrapper) in NESTED_LAYERS.items():
        expected = wrapper if path in ("blocks.0.conv", "blocks.1.conv") else type(get(nested))
        assert type(get(qmodel)) is expected, path
    # Searched, not matched from the start.
    qmodel = quantize(nested, where="key")
    assert type(qmodel.heads["key"]) is QuantLinear and type(qmodel.heads["value"]) is eqx.nn.Linear
    assert type(qmodel.embed) is eqx.nn.Embedding


def test_where_predicate(nested):
    qmodel = quantize(nested, where=lambda path, layer: isinstance(layer, eqx.nn.Linear) and layer.out_features == 3)
    quantized = {path for path, (get, _) in NESTED_LAYERS.items() if isinstance(get(qmodel), AbstractQuantLayer)}
    assert quantized == {"heads.key", "heads.value"}
    qmodel = quantize(nested, where=lambda path, layer: path.startswith("blocks.1"))
    quantized = {path for path, (get, _) in NESTED_LAYERS.items() if isinstance(get(qmodel), AbstractQuantLayer)}
    assert quantized == {"blocks.1.conv", "blocks.1.linear"}


@pytest.mark.parametrize("where", ["decoder", lambda path, layer: False])
def test_where_matching_nothing_lists_the_candidates(nested, where):
    with pytest.raises(ValueError) as info:
        quantize(nested, where=where)
    message = str(info.value)
    for path in NESTED_LAYERS:
        assert re.search(rf"\b{re.escape(path)}\b", message), (path, message)


# ---------------------------------------------------------------------------------------------------------------------
# quantize: `weights` and `activations`.


class _Normalised(eqx.Module):
    normed: eqx.Module
    head: eqx.nn.Linear

    def __call__(self, x, *state):
        h = self.normed(x, *state)
        return self.head(h[0] if state else h)


def test_weight_normalisations_name_the_layer_they_wrap():
    # `eqx.nn.WeightNorm` and `eqx.nn.SpectralNorm` replace their layer's `weight` at every call, which a quantized
    # layer cannot take: quantizing that layer is an error naming it and the rule that keeps it float, which works.
    weight_norm = init(
        lambda k: _Normalised(eqx.nn.WeightNorm(eqx.nn.Linear(8, 8, key=k)), eqx.nn.Linear(8, 4, key=k)), 0
    )
    spectral, _ = init(
        lambda k: eqx.nn.make_with_state(eqx.nn.SpectralNorm)(eqx.nn.Linear(8, 8, key=k), "weight", key=k), 1
    )
    for model, kind in ((weight_norm, "WeightNorm"), (_Normalised(spectral, weight_norm.head), "SpectralNorm")):
        message = rf"Layer 'normed.layer' is wrapped by the eqx.nn.{kind} at 'normed'.*" + re.escape(
            r"`Rule('normed\\..*', weight=None, input=None)`"
        )
        with pytest.raises(ValueError, match=message):
            quantize(model)
        qmodel = quantize(model, [Rule(r"normed\..*", weight=None, input=None), Rule(".*")])
        assert type(qmodel.normed.layer) is eqx.nn.Linear and type(qmodel.head) is QuantLinear


@pytest.mark.slow
def test_weight_normalisations_keep_their_layer_float():
    x = jax.random.normal(jax.random.key(2), (8,))
    head = eqx.nn.Linear(8, 4, key=jax.random.key(1))
    weight_norm = _Normalised(eqx.nn.WeightNorm(eqx.nn.Linear(8, 8, key=jax.random.key(0))), head)
    float_rule = [Rule(r"normed\..*", weight=None, input=None), Rule(".*", weight=DynamicFakeQuant(8, axis=0))]
    for qmodel in (
        quantize(weight_norm, float_rule),
        quantize(weight_norm, where=r"head"),
        quantize(weight_norm, float_rule, example=(x,)),  # traced: the normalisation's gain `g` is kept float too
    ):
        expected = DynamicFakeQuant(8, axis=0)(head.weight) @ DynamicFakeQuant(8)(weight_norm.normed(x)) + head.bias
        np.testing.assert_allclose(np.asarray(qmodel(x)), np.asarray(expected), rtol=1e-6, atol=1e-6)


def test_shared_quantizer(mlp):
    q4 = DynamicFakeQuant(4, axis=0)
    qmlp = quantize(mlp, weights=q4, activations=None)
    for layer in qmlp.layers:
        assert type(layer) is QuantLinear and layer.weight_quant is q4 and layer.input_quant is None


def test_factories(mlp):
    weight_calls, activation_calls = [], []
    weights = record(
        weight_calls, lambda path, layer: None if path == "layers.1" else DynamicFakeQuant(3 + int(path[-1]), axis=0)
    )
    activations = record(activation_calls, lambda path, layer: FakeQuant(0.5 * layer.in_features, -8, 7))
    qmlp = quantize(mlp, weights=weights, activations=activations)
    assert [path for path, _ in weight_calls] == ["layers.0", "layers.1", "layers.2"]
    assert [path for path, _ in activation_calls] == ["layers.0", "layers.1", "layers.2"]
    for (_, layer), original in zip(weight_calls + activation_calls, mlp.layers + mlp.layers):
        assert layer is original
    assert qmlp.layers[0].weight_quant == DynamicFakeQuant(3, axis=0)
    assert qmlp.layers[1].weight_quant is None
    assert qmlp.layers[2].weight_quant == DynamicFakeQuant(5, axis=0)
    expected = [FakeQuant(1.5, -8, 7), FakeQuant(2.5, -8, 7), FakeQuant(2.5, -8, 7)]  # 0.5 * in_features
    assert [layer.input_quant for layer in qmlp.layers] == expected
    with pytest.raises(TypeError):
        quantize(mlp, weights=lambda path, layer: "int4")


def test_mappings_mixed_precision(mlp):
    q4, q6, q8 = DynamicFakeQuant(4, axis=0), DynamicFakeQuant(6, axis=0), DynamicFakeQuant(8, axis=0)
    calls = []
    weights = {
        r"layers\.0": q4,  # first match wins, although the next pattern matches too
        r"layers\.[01]": q6,
        r"layers\.2": record(calls, lambda path, layer: q8),
    }
    activations = {r"layers\.2$": FakeQuant(0.1, -8, 7), r"layers\.1": None, r"layers": DynamicFakeQuant(5)}
    qmlp = quantize(mlp, weights=weights, activations=activations)
    assert [layer.weight_quant for layer in qmlp.layers] == [q4, q6, q8]
    assert qmlp.layers[0].weight_quant is q4
    assert [path for path, _ in calls] == ["layers.2"] and calls[0][1] is mlp.layers[2]
    assert [layer.input_quant for layer in qmlp.layers] == [DynamicFakeQuant(5), None, FakeQuant(0.1, -8, 7)]
    # Unmatched layers get no quantizer (but are still wrapped when `where` selects them).
    qmlp = quantize(mlp, weights={r"layers\.1": q4}, activations={r"layers\.2": None})
    assert [type(layer) for layer in qmlp.layers] == [QuantLinear] * 3
    assert [layer.weight_quant for layer in qmlp.layers] == [None, q4, None]
    assert [layer.input_quant for layer in qmlp.layers] == [None, None, None]
    # A pattern that matches no layer (a typo) is an error that lists the paths, not a model left in float.
    with pytest.raises(ValueError, match=r"`activations`: the pattern 'nothing' matches none of the layers.*'layers.0'"):
        quantize(mlp, weights={r"layers\.1": q4}, activations={"nothing": q8})
    with pytest.raises(ValueError, match=r"`weights`: the pattern 'layer\\\\.1' matches none"):
        quantize(mlp, weights={r"layer\.1": q4})


def test_weights_that_are_not_floating_are_refused_naming_the_layer(mlp):
    # Integer weights were wrapped, and the first call failed saying the input `x` must be floating.
    as_ints = jax.tree.map(lambda a: a.astype(jnp.int32) if eqx.is_array(a) else a, mlp)
    with pytest.raises(TypeError, match=r"Layer 'layers.0': `layer`'s weight must be a floating array to be quantized, "
                                        "got dtype int32"):  # fmt: skip
        quantize(as_ints)
    conv = eqx.nn.Conv1d(2, 2, 1, key=jax.random.key(0))
    with pytest.raises(TypeError, match="weight must be a floating array to be quantized, got dtype complex64"):
        QuantConv(eqx.tree_at(lambda c: c.weight, conv, conv.weight.astype(jnp.complex64)))
    table = eqx.nn.Embedding(4, 2, key=jax.random.key(0))
    with pytest.raises(TypeError, match="weight must be a floating array to be quantized, got dtype int8"):
        QuantEmbedding(eqx.tree_at(lambda e: e.weight, table, table.weight.astype(jnp.int8)))
    assert quantize(as_ints, weights=None, activations=DynamicFakeQuant(8)).layers[0].weight_quant is None


# ---------------------------------------------------------------------------------------------------------------------
# quantize twice, and dequantize.


def test_quantize_partially_quantized_model(mlp):
    first = quantize(mlp, where=r"layers\.0", weights=DynamicFakeQuant(4, axis=0))
    with pytest.warns(UserWarning, match=r"The layers at \['layers.0'\] are quantized already and keep"):
        second = quantize(first)
    assert [type(layer) for layer in second.layers] == [QuantLinear] * 3
    assert second.layers[0] is not None and type(second.layers[0].layer) is eqx.nn.Linear  # not re-wrapped
    assert second.layers[0].weight_quant == DynamicFakeQuant(4, axis=0)  # and kept as it was
    assert second.layers[0].layer is mlp.layers[0]
    assert second.layers[1].weight_quant == DynamicFakeQuant(8, axis=0)
    assert leaves_identical(second, mlp)


def test_quantize_twice_is_idempotent(nested, mlp):
    for model in (mlp, nested):
        once = quantize(model)
        with pytest.warns(UserWarning, match="are quantized already and keep their quantizers"):
            twice = quantize(once)
        assert jax.tree.structure(twice) == jax.tree.structure(once)
        assert eqx.tree_equal(twice, once)
        assert leaves_identical(twice, model)


def test_dequantize_returns_the_original_leaves(nested, mlp):
    seq = eqx.nn.Sequential([eqx.nn.Linear(2, 2, key=jax.random.key(7)), eqx.nn.Lambda(jnp.tanh)])
    for model in (nested, mlp, seq, Stacked(jax.random.key(8)), quantize(mlp, where=r"layers\.2")):
        restored = dequantize(quantize(model, where=lambda path, layer: not isinstance(layer, AbstractQuantLayer)))
        assert jax.tree.structure(restored) == jax.tree.structure(dequantize(model))
        assert leaves_identical(restored, model)
        assert not any(
            isinstance(node, AbstractQuantLayer)
            for node in jax.tree.leaves(restored, is_leaf=lambda n: isinstance(n, AbstractQuantLayer))
        )
    # Float models come back as they are; trained weights come back from a trained quantized model.
    assert jax.tree.structure(dequantize(nested)) == jax.tree.structure(nested)
    assert leaves_identical(dequantize(nested), nested)
    qmodel = quantize(nested)
    new_weight = jnp.ones((3, 8))
    trained = eqx.tree_at(lambda m: m.heads["value"].layer.weight, qmodel, new_weight)
    restored = dequantize(trained)
    assert type(restored.heads["value"]) is eqx.nn.Linear and restored.heads["value"].weight is new_weight
    assert restored.heads["key"].weight is nested.heads["key"].weight


# ---------------------------------------------------------------------------------------------------------------------
# A short QAT run.


@pytest.mark.slow
def test_qat_run_decreases_the_loss_and_keeps_weights_on_the_grid():
    bits = 3
    x = jax.random.normal(jax.random.key(9), (64, 3))
    y = (x @ jnp.array([1.0, -2.0, 0.5]))[:, None]
    model = eqx.nn.MLP(3, 1, 16, 1, activation=jnp.tanh, key=jax.random.key(10))
    model = quantize(model, weights=DynamicFakeQuant(bits, axis=0), activations=DynamicFakeQuant(8))

    def loss_fn(model, x, y):
        return jnp.mean((jax.vmap(model)(x) - y) ** 2)

    @eqx.filter_jit
    def step(model, x, y):
        loss, grads = eqx.filter_value_and_grad(loss_fn)(model, x, y)
        model = eqx.apply_updates(model, jax.tree.map(lambda g: -0.1 * g, grads))
        return model, loss

    initial_weights = [np.asarray(layer.layer.weight) for layer in model.layers]
    losses = []
    for _ in range(40):
        model, loss = step(model, x, y)
        losses.append(float(loss))
    assert all(np.isfinite(losses))
    assert losses[-1] < 0.1 * losses[0]
    assert np.mean(losses[-5:]) < np.mean(losses[:5])
    quantized_weights = eqx.filter_jit(lambda m: [layer.weight_quant(layer.layer.weight) for layer in m.layers])(model)
    for layer, initial, quantized in zip(model.layers, initial_weights, quantized_weights):
        assert type(layer) is QuantLinear
        weight = np.asarray(layer.layer.weight)
        assert not np.array_equal(weight, initial)  # the float weights were trained
        quantized = np.asarray(quantized)
        for row, float_row in zip(quantized, weight):
            assert len(np.unique(row)) <= 2**bits
            # On the row's grid: integer multiples of max|row| / 3.
            levels = row / (np.abs(float_row).max() / 3)
            np.testing.assert_allclose(levels, np.round(levels), atol=1e-4)
            assert np.all(np.abs(np.round(levels)) <= 4)


# ---------------------------------------------------------------------------------------------------------------------
# calibrate.


@pytest.fixture(scope="module")
def calibration_mlp():
    return eqx.nn.MLP(4, 3, 8, 2, key=jax.random.key(11))


@pytest.fixture(scope="module")
def calibration_data():
    x = jax.random.normal(jax.random.key(12), (96, 4)) * jnp.array([[2.0, 0.5, 1.0, 3.0]])
    return x, [x[:32], x[32:64], x[64:]]


def layer_inputs(qmodel, x) -> list[np.ndarray]:
    """The input of each layer of a quantized MLP, by hand in NumPy: weights fake-quantized, inputs left as they are."""
    h = np.asarray(x)
    inputs = []
    for i, layer in enumerate(qmodel.layers):
        inputs.append(h)
        w_q = numpy_dynamic_quant(layer.weight_quant, layer.layer.weight)
        h = h @ w_q.T + np.asarray(layer.layer.bias)
        if i < len(qmodel.layers) - 1:
            h = np.maximum(h, 0)
    return inputs


def check_scale_near(scale, expected, *, exact: bool, qmax: int):
    """`scale` is `expected / qmax` (a few ulps above for exact data; else to the precision of the reference)."""
    scale, expected = np.float32(scale), np.float32(expected)
    if exact:
        ulps = int(scale.view(np.int32)) - int((expected / np.float32(qmax)).view(np.int32))
        assert 0 <= ulps <= 4, ulps
        assert expected * (np.float32(1) / scale) <= qmax
    else:
        np.testing.assert_allclose(scale, expected / qmax, rtol=1e-5)


@pytest.mark.slow
def test_calibrate_absmax(calibration_mlp, calibration_data):
    x, batches = calibration_data
    qmodel = quantize(calibration_mlp)
    calibrated = calibrate(qmodel, batches)
    inputs = layer_inputs(qmodel, x)
    for i, (layer, original) in enumerate(zip(calibrated.layers, qmodel.layers)):
        quantizer = layer.input_quant
        assert type(quantizer) is FakeQuant
        assert (quantizer.qmin, quantizer.qmax, quantizer.zero_point, quantizer.axis) == (-128, 127, 0, None)
        check_scale_near(quantizer.scale, np.abs(inputs[i]).max(), exact=i == 0, qmax=127)
        # Weights and weight quantizers are untouched.
        assert layer.layer.weight is original.layer.weight and layer.weight_quant == original.weight_quant
    # Streaming: the same scales from one batch, and from a generator.
    assert eqx.tree_equal(calibrate(qmodel, [x]), calibrated)
    assert eqx.tree_equal(calibrate(qmodel, (b for b in batches)), calibrated)


@pytest.mark.slow
def test_calibrate_minmax(calibration_mlp, calibration_data):
    x, batches = calibration_data
    qmodel = quantize(calibration_mlp)
    calibrated = calibrate(qmodel, batches, method="minmax")
    assert eqx.tree_equal(calibrate(qmodel, [x], method="minmax"), calibrated)
    inputs = layer_inputs(qmodel, x)
    for i, layer in enumerate(calibrated.layers):
        quantizer = layer.input_quant
        assert type(quantizer) is FakeQuant and (quantizer.qmin, quantizer.qmax) == (-128, 127)
        scale, zero_point = np.float32(quantizer.scale), quantizer.zero_point
        assert type(zero_point) is int and -128 <= zero_point <= 127
        lo, hi = min(inputs[i].min(), 0.0), max(inputs[i].max(), 0.0)
        width = np.float64(hi) - np.float64(lo)
        assert width / 255 * (1 - 1e-5) <= scale <= width / 254 * (1 + 1e-5)
        if i == 0:
            # The extremes of the data land inside the grid, with gradient 1 through the STE.
            extremes = np.array([lo, hi], np.float32)
            values, grads, _, _ = reference_fake_quant(extremes, scale, -128, 127, zero_point, np.ones(2, np.float32))
            np.testing.assert_array_equal(grads, [1.0, 1.0])
            np.testing.assert_allclose(values, extremes, atol=scale / 2)
            assert abs(zero_point - (-128 - lo / scale)) <= 1
        else:
            assert zero_point == -128  # ReLU outputs: the range starts at 0


def test_calibrate_percentile(calibration_mlp, calibration_data):
    x, batches = calibration_data
    qmodel = quantize(calibration_mlp)
    num_bins = 32
    calibrated = calibrate(qmodel, batches, method="percentile", percentile=90.0, num_bins=num_bins)
    inputs = layer_inputs(qmodel, x)
    for i, layer in enumerate(calibrated.layers):
        quantizer = layer.input_quant
        assert type(quantizer) is FakeQuant and quantizer.zero_point == 0 and quantizer.qmax == 127
        magnitudes = np.abs(inputs[i])
        width = magnitudes.max() / num_bins
        threshold = quantizer.scale * 127
        # The same definition as on data (the inverted empirical distribution), resolved to the upper edge of the
        # histogram bin that holds the data's percentile.
        reference = np.percentile(magnitudes, 90.0, method="inverted_cdf")
        assert reference * (1 - 1e-6) <= threshold <= (reference + width) * (1 + 1e-4), (i, threshold, reference)
        assert threshold < 0.9 * magnitudes.max()  # it really clips


def test_calibrate_mse(calibration_mlp, calibration_data):
    x, batches = calibration_data
    qmodel = quantize(calibration_mlp, activations=DynamicFakeQuant(4))
    by_mse = calibrate(qmodel, batches, method="mse")
    by_absmax = calibrate(qmodel, batches)
    inputs = layer_inputs(qmodel, x)
    improvements = []
    for i in range(3):
        q_mse, q_absmax = by_mse.layers[i].input_quant, by_absmax.layers[i].input_quant
        assert (q_mse.qmin, q_mse.qmax, q_mse.zero_point) == (-8, 7, 0)
        assert q_mse.scale <= q_absmax.scale * (1 + 1e-6)

        def error(scale, i=i):
            a = inputs[i]
            return np.mean((reference_fake_quant(a, np.float32(scale), -8, 7) - a).astype(np.float64) ** 2)

        assert error(q_mse.scale) <= 1.05 * error(q_absmax.scale), i
        improvements.append(error(q_mse.scale) < 0.95 * error(q_absmax.scale))
    assert any(improvements)


def test_calibrate_keeps_other_quantizers(calibration_mlp, calibration_data):
    x, batches = calibration_data
    unsigned = DynamicFakeQuant(6, signed=False)
    qmodel = quantize(calibration_mlp, activations={r"layers\.1": unsigned, r"layers\.2": FakeQuant(0.5, -8, 7)})
    calibrated = calibrate(qmodel, batches)
    inputs = layer_inputs(qmodel, x)
    assert calibrated.layers[0].input_quant is None
    # Each calibrated quantizer keeps the integer grid of the one it replaces (a static one is recalibrated).
    for i, grid in ((1, (0, 63)), (2, (-8, 7))):
        quantizer = calibrated.layers[i].input_quant
        assert type(quantizer) is FakeQuant and (quantizer.qmin, quantizer.qmax) == grid
        check_scale_near(quantizer.scale, np.abs(inputs[i]).max(), exact=False, qmax=grid[1])


class Pointwise(eqx.Module):
    """Takes a whole batch `(batch, 4)`: 1x1 convolutions over the features, with the batch as the spatial axis."""

    conv1: eqx.nn.Conv1d
    conv2: eqx.nn.Conv1d

    def __init__(self, key):
        k1, k2 = jax.random.split(key)
        self.conv1 = eqx.nn.Conv1d(4, 5, 1, key=k1)
        self.conv2 = eqx.nn.Conv1d(5, 2, 1, key=k2)

    def __call__(self, x):
        return self.conv2(jax.nn.relu(self.conv1(x.T))).T


def test_calibrate_batched_model(calibration_data):
    x, batches = calibration_data
    qmodel = quantize(Pointwise(jax.random.key(13)))
    calibrated = calibrate(qmodel, batches, batched=True)
    w_q = numpy_dynamic_quant(DynamicFakeQuant(8, axis=0), qmodel.conv1.layer.weight)[:, :, 0]
    hidden = np.maximum(np.asarray(x) @ w_q.T + np.asarray(qmodel.conv1.layer.bias)[:, 0], 0)
    check_scale_near(calibrated.conv1.input_quant.scale, np.abs(np.asarray(x)).max(), exact=True, qmax=127)
    check_scale_near(calibrated.conv2.input_quant.scale, hidden.max(), exact=False, qmax=127)


class VmappedMLP(eqx.Module):
    """Takes a whole batch, as Equinox models usually do: by `jax.vmap` of a per-example model."""

    mlp: eqx.nn.MLP

    def __call__(self, x):
        return jax.vmap(self.mlp)(x)


@pytest.mark.slow
def test_calibrate_sees_layers_inside_the_models_own_vmap(calibration_mlp, calibration_data):
    # Layers called inside the model's own vmap are observed like any other: the same statistics, and so the same
    # static quantizers, as calibrating the per-example model.
    _, batches = calibration_data
    qmodel = quantize(calibration_mlp)
    for method in ("absmax", "minmax", "percentile"):
        per_example = calibrate(qmodel, batches, method=method, num_bins=64)
        vmapped = calibrate(VmappedMLP(qmodel), batches, batched=True, method=method, num_bins=64)
        for a, b in zip(per_example.layers, vmapped.mlp.layers, strict=True):
            assert type(b.input_quant) is FakeQuant and a.input_quant == b.input_quant, method


def test_calibrate_errors(calibration_mlp, calibration_data):
    _, batches = calibration_data
    qmodel = quantize(calibration_mlp)
    for method in ("percentile", "mse"):
        with pytest.raises(TypeError, match="batches"):
            calibrate(qmodel, (b for b in batches), method=method)
    with pytest.raises(ValueError, match="batches"):
        calibrate(qmodel, [])
    # A ValueError; under the test suite's jaxtyping hook the `Literal` annotation turns it into a TypeError first.
    with pytest.raises((ValueError, TypeError), match="method"):
        calibrate(qmodel, batches, method="max")  # pyright: ignore[reportArgumentType]
    with pytest.raises(ValueError):
        calibrate(quantize(calibration_mlp, activations=None), batches)
    with pytest.raises(ValueError):
        calibrate(calibration_mlp, batches)
