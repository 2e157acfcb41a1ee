"""Layers stacked with `eqx.filter_vmap` and run with `jax.lax.scan`, layers called inside the model's own `vmap`,
and tied weights read through `.weight`: quantize, calibrate, train, convert, save."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import eqx_quant
from eqx_quant import DynamicFakeQuant, FakeQuant, LearnedFakeQuant, calibrate, convert, quantize

from .helpers import assert_bitwise_equal, np_absmax_scale, slow_unless


D, HIDDEN, LAYERS, VOCAB, T = 8, 16, 3, 11, 5


class Block(eqx.Module):
    up: eqx.nn.Linear
    down: eqx.nn.Linear

    def __init__(self, key):
        k1, k2 = jax.random.split(key)
        self.up = eqx.nn.Linear(D, HIDDEN, key=k1)
        self.down = eqx.nn.Linear(HIDDEN, D, key=k2)

    def __call__(self, h):  # h: (tokens, D); the layers take one token each
        return h + jax.vmap(lambda t: self.down(jax.nn.relu(self.up(t))))(h)


class TiedLM(eqx.Module):
    """Token embedding tied to the output head (read through `.weight`), blocks stacked and scanned."""

    embed: eqx.nn.Embedding
    blocks: Block

    def __init__(self, key):
        k1, k2 = jax.random.split(key)
        self.embed = eqx.nn.Embedding(VOCAB, D, key=k1)
        self.blocks = eqx.filter_vmap(Block)(jax.random.split(k2, LAYERS))

    def __call__(self, tokens):
        h = jax.vmap(self.embed)(tokens)
        dynamic, static = eqx.partition(self.blocks, eqx.is_array)

        def step(h, arrays):
            return eqx.combine(arrays, static)(h), None

        h = jax.lax.scan(step, h, dynamic)[0]
        return h @ self.embed.weight.T


@pytest.fixture(scope="module")
def lm():
    return TiedLM(jax.random.key(0))


@pytest.fixture(scope="module")
def token_batches():
    keys = jax.random.split(jax.random.key(1), 3)
    return [jax.random.randint(k, (4, T), 0, VOCAB) for k in keys]


run = eqx.filter_jit(lambda model, tokens: jax.vmap(model)(tokens))


def layer_inputs(model, tokens):
    """The input of every block's `up` and `down` layer, per layer of the stack, by running the blocks one at a
    time in NumPy-visible steps (an independent reference for the observers inside the scan)."""
    h = jax.vmap(jax.vmap(model.embed))(tokens)
    inputs = {"up": [], "down": []}
    for i in range(LAYERS):
        block = jax.tree_util.tree_map(lambda a: a[i] if eqx.is_array(a) else a, model.blocks)  # noqa: B023
        flat = h.reshape(-1, D)
        inputs["up"].append(np.asarray(flat))
        hidden = jax.nn.relu(jax.vmap(block.up)(flat))
        inputs["down"].append(np.asarray(hidden))
        h = jax.vmap(block)(h)
    return inputs


@pytest.mark.slow
def test_calibrate_scanned_blocks_per_layer(lm, token_batches):
    qmodel = quantize(lm, activations={r"blocks\.up": DynamicFakeQuant(8), r"blocks\.down": DynamicFakeQuant(8)})
    # Weight quantizers stay active while calibrating: the reference runs the same fake-quant weights with float
    # inputs (the observers pass inputs through).
    observed = eqx.tree_at(lambda m: (m.blocks.up.input_quant, m.blocks.down.input_quant), qmodel, (None, None))
    tokens = jnp.concatenate(token_batches)
    inputs = layer_inputs(observed, tokens)
    for method in ("absmax", "minmax"):
        calibrated = calibrate(qmodel, token_batches, method=method)
        for name in ("up", "down"):
            quantizer = getattr(calibrated.blocks, name).input_quant
            assert type(quantizer) is LearnedFakeQuant and quantizer.scale.shape == (LAYERS,)
            for i in range(LAYERS):
                x = inputs[name][i]
                if method == "absmax":
                    expected = np_absmax_scale(np.abs(x).max(), 127)
                    assert quantizer.zero_point is None
                    assert np.float32(quantizer.scale[i]) == expected, (name, i)
                else:
                    # Each layer's own range: the scale covers [min(x, 0), max(x, 0)] of that layer alone.
                    lo, hi = min(x.min(), 0.0), max(x.max(), 0.0)
                    scale, zp = float(quantizer.scale[i]), float(quantizer.zero_point[i])
                    assert -128 <= np.round(lo / scale) + zp and np.round(hi / scale) + zp <= 127
                    assert (hi - lo) / 255 <= scale <= (hi - lo) / 254 * 1.01, (name, i)
            # The layers of the stack really differ (the residual stream grows), so per-layer scales matter.
            assert len(set(np.asarray(quantizer.scale).tolist())) == LAYERS


@pytest.mark.slow
def test_calibrated_stack_matches_static_quantizers(lm, token_batches):
    # The per-layer LearnedFakeQuant that calibration gives a stack computes exactly what a static FakeQuant with
    # the same scale computes, layer by layer.
    qmodel = calibrate(quantize(lm), token_batches)
    quantizer = qmodel.blocks.up.input_quant
    x = jax.random.normal(jax.random.key(2), (D,)) * 3
    for i in range(LAYERS):
        one = jax.tree_util.tree_map(lambda a: a[i], quantizer)
        static = FakeQuant(float(quantizer.scale[i]), -128, 127)
        assert_bitwise_equal(jax.jit(lambda q, x: q(x))(one, x), jax.jit(lambda x: static(x))(x))


# Grouped weights in a scanned model: tests/test_models.py (the decoder language model).
@pytest.mark.parametrize(
    "weights", slow_unless([DynamicFakeQuant(8, axis=0)], [DynamicFakeQuant(8, axis=0), "learned"])
)
def test_scanned_model_converts_bit_for_bit(lm, token_batches, weights):
    if weights == "learned":
        weights = lambda path, layer: LearnedFakeQuant.init_from(  # noqa: E731
            layer.weight, 4, axis=0, stacked=layer.weight.ndim - 2
        )
    qmodel = calibrate(quantize(lm, weights=weights), token_batches)
    fake = run(qmodel, token_batches[0])
    converted = convert(qmodel)
    real = run(converted, token_batches[0])
    assert_bitwise_equal(real, fake)
    # The stacked integers carry the stack in front; the static fields describe one layer.
    qweight = converted.blocks.up.qweight
    assert qweight.stack_depth == 1 and qweight.shape == (HIDDEN, D) and qweight.values.shape[0] == LAYERS
    # Each layer's integers are those its own quantizer gives its own slice.
    for i in range(LAYERS):
        w_i = qmodel.blocks.up.layer.weight[i]
        quantizer = jax.tree_util.tree_map(lambda a: a[i], qmodel.blocks.up.weight_quant)
        np.testing.assert_array_equal(np.asarray(quantizer.quantize(w_i).levels()), np.asarray(qweight.levels()[i]))
    # `.weight` is the stack of fake-quantized weights before conversion and of dequantized ones after.
    assert_bitwise_equal(converted.blocks.up.weight, qmodel.blocks.up.weight)
    assert qmodel.blocks.up.weight.shape == (LAYERS, HIDDEN, D)


@pytest.mark.slow
def test_init_from_stacked_is_per_layer():
    w = jax.random.normal(jax.random.key(3), (LAYERS, 6, 8)) * jnp.arange(1.0, LAYERS + 1.0)[:, None, None]
    stacked = LearnedFakeQuant.init_from(w, 4, axis=0, stacked=1, method="lsq")
    assert stacked.scale.shape == (LAYERS, 6) and stacked.axis == 0
    grouped = LearnedFakeQuant.init_from(w, 4, group_size=4, stacked=1, symmetric=False)
    assert grouped.scale.shape == (LAYERS, 6, 2) and grouped.zero_point.shape == (LAYERS, 6, 2)
    for i in range(LAYERS):
        one = LearnedFakeQuant.init_from(w[i], 4, axis=0, method="lsq")
        # LSQ's initial step: 2 mean|w| / sqrt(qmax), per output row of each layer.
        expected = 2 * np.abs(np.asarray(w[i], np.float64)).mean(axis=1) / np.sqrt(7)
        np.testing.assert_allclose(np.asarray(stacked.scale[i]), expected, rtol=1e-6)
        assert_bitwise_equal(stacked.scale[i], one.scale)
    with pytest.raises(ValueError, match="stacked"):
        LearnedFakeQuant.init_from(w, 4, stacked=-1)
    with pytest.raises(ValueError, match="stacked"):
        LearnedFakeQuant.init_from(w[0, 0], 4, stacked=2)


@pytest.mark.slow
def test_tied_embedding_gradients_and_conversion(lm, token_batches):
    qmodel = quantize(lm, weights=DynamicFakeQuant(4, axis=0))
    tokens = token_batches[0]
    # The head reads the embedding's `.weight`: the fake-quantized table, whose rows the embedding looks up too.
    table = qmodel.embed.weight
    assert_bitwise_equal(table, DynamicFakeQuant(4, axis=0)(lm.embed.weight))
    assert_bitwise_equal(jax.vmap(qmodel.embed)(tokens[0]), table[tokens[0]])

    def loss(model, tokens):
        logits = jax.vmap(model)(tokens)[:, :-1]
        return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()

    grads = eqx.filter_grad(loss)(qmodel, tokens)
    # Both uses of the tied table send gradient to the one float weight: rows that no token looks up get gradient
    # through the head alone, rows that are looked up through both.
    row_grads = np.abs(np.asarray(grads.embed.layer.weight)).sum(axis=1)
    unused = np.setdiff1d(np.arange(VOCAB), np.asarray(tokens))
    assert unused.size and np.all(row_grads[unused] > 0) and np.all(row_grads > 0)
    # Training through the tied table: tests/test_models.py (the decoder language model).
    converted = convert(qmodel)
    assert_bitwise_equal(converted.embed.weight, qmodel.embed.weight)
    assert_bitwise_equal(run(converted, tokens), run(qmodel, tokens))


@pytest.mark.slow
def test_converted_stack_saves_and_loads(lm, token_batches, tmp_path):
    qmodel = calibrate(quantize(lm, weights=DynamicFakeQuant(4, group_size=4)), token_batches)
    converted = convert(qmodel)
    path = tmp_path / "lm.eqx"
    eqx_quant.save(path, converted)
    like = convert(
        calibrate(quantize(TiedLM(jax.random.key(9)), weights=DynamicFakeQuant(4, group_size=4)), token_batches)
    )
    loaded = eqx_quant.load(path, like)
    assert_bitwise_equal(run(loaded, token_batches[1]), run(converted, token_batches[1]))


class SharedLM(eqx.Module):
    """An input embedding tied to a linear head with `eqx.nn.Shared`."""

    shared: eqx.nn.Shared

    def __init__(self, key):
        k1, k2 = jax.random.split(key)
        embed = eqx.nn.Embedding(VOCAB, D, key=k1)
        head = eqx.nn.Linear(D, VOCAB, use_bias=False, key=k2)
        self.shared = eqx.nn.Shared((embed, head), lambda p: p[1].weight, lambda p: p[0].weight)

    def __call__(self, tokens):
        embed, head = self.shared()
        return jax.vmap(head)(jax.vmap(embed)(tokens))


@pytest.mark.slow
def test_shared_tie_survives_quantize_training_and_convert(token_batches, tmp_path):
    model = SharedLM(jax.random.key(7))
    qmodel = quantize(model, weights=DynamicFakeQuant(8, axis=0), activations=None)
    tokens = token_batches[0][0]
    embed, head = qmodel.shared()
    # The head receives the embedding's quantized table and quantizes it again on its own (same) grid: the same
    # levels (on scales that may differ in the last bit).
    assert_bitwise_equal(head.layer.weight, embed.weight)
    levels = [layer.weight_quant.quantize(layer.layer.weight).levels() for layer in (head, embed)]
    assert_bitwise_equal(*levels)
    assert_bitwise_equal(qmodel(tokens), jax.vmap(lambda t: head.weight @ embed.weight[t])(tokens))
    # One float weight receives the gradient of both uses.
    grads = eqx.filter_grad(lambda m: jnp.sum(m(tokens) ** 2))(qmodel)
    row_grads = np.abs(np.asarray(grads.shared.pytree[0].layer.weight)).sum(axis=1)
    assert np.all(row_grads > 0)
    converted = convert(qmodel)
    assert type(converted.shared.pytree[0]) is eqx_quant.nn.IntEmbedding
    # Calibration sees the head through the tie too: its static input scale is that of the embedded tokens.
    calibrated = calibrate(quantize(model, weights=DynamicFakeQuant(8, axis=0)), [token_batches[0]])
    head_quant = calibrated.shared.pytree[1].input_quant
    embedded = np.asarray(jax.vmap(jax.vmap(qmodel.shared()[0]))(token_batches[0]))
    assert type(head_quant) is FakeQuant and np.float32(head_quant.scale) == np_absmax_scale(
        np.abs(embedded).max(), 127
    )
    assert_bitwise_equal(
        eqx.filter_jit(lambda m, t: m(t))(converted, tokens), eqx.filter_jit(lambda m, t: m(t))(qmodel, tokens)
    )
    # Saved converted, it loads into the float model and into its shape skeleton; the summary names the head's
    # weight and input quantizers beside its tie, and counts it as quantized.
    converted = convert(calibrated)
    eqx_quant.save(tmp_path / "shared.eqx", converted)
    expected = eqx.filter_jit(lambda m, t: m(t))(converted, tokens)
    for like in (model, eqx.filter_eval_shape(SharedLM, jax.random.key(7))):
        loaded = eqx_quant.load(tmp_path / "shared.eqx", like)
        assert_bitwise_equal(eqx.filter_jit(lambda m, t: m(t))(loaded, tokens), expected)
    table = eqx_quant.summary(converted)
    (row,) = [r for r in table.rows if r.path == "shared.pytree.1"]
    # The tied layer quantizes the other layer's (dequantized) weight again with its own quantizer.
    assert (row.weight, row.input) == ("tied, int8 dynamic, per channel (axis 0)", "int8 static, per tensor")
    assert f"{len(table.rows)} of {len(table.rows)} quantized" in str(table)
    # With learned scales, the layer that owns the weight learns them; the tied layer has no values of its own to
    # learn from, and quantizes what it receives with dynamic scales (a learned recipe raised on its placeholder).
    learned = quantize(model, **eqx_quant.recipe("w8a16", learned=True))
    embed, head = learned.shared.pytree
    assert isinstance(embed.weight_quant, eqx_quant.LearnedFakeQuant) and head.weight_quant == DynamicFakeQuant(
        8, axis=0
    )
    embed, head = learned.shared()
    assert_bitwise_equal(learned(tokens), jax.vmap(lambda t: head.weight @ embed.weight[t])(tokens))
