"""Recipes, full-match layer patterns and the subclass guard of `quantize`."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import eqx_quant
from eqx_quant import DynamicFakeQuant, LearnedFakeQuant, quantize, recipe

from .helpers import assert_bitwise_equal


@pytest.fixture(scope="module")
def mlp():
    return eqx.nn.MLP(64, 10, 64, 3, key=jax.random.key(0))


def test_recipes_give_the_documented_quantizers(mlp):
    expected = {  # name: (weight bits, group size, activation bits)
        "w8a8": (8, None, 8),
        "w8a16": (8, None, None),
        "w4a8_g32": (4, 32, 8),
        "w4a16_g32": (4, 32, None),
        "w3a16_g32": (3, 32, None),
        "w2a16_g32": (2, 32, None),
    }
    for name, (bits, group, act) in expected.items():
        qmodel = quantize(mlp, **recipe(name))
        for i, layer in enumerate(qmodel.layers):
            # The last layer has 64 inputs too: every layer is grouped for the grouped recipes.
            w = DynamicFakeQuant(bits, group_size=group) if group else DynamicFakeQuant(bits, axis=0)
            assert layer.weight_quant == w, (name, i)
            assert layer.input_quant == (None if act is None else DynamicFakeQuant(act)), (name, i)
    assert quantize(mlp, **recipe("w4a16_g32", group_size=16)).layers[0].weight_quant.group_size == 16


def test_recipe_keeps_first_and_last_layers_at_8_bits(mlp):
    qmodel = quantize(mlp, **recipe("w2a16_g32", keep=(r"layers\.0", r"layers\.3")))
    bits = [layer.weight_quant.bits for layer in qmodel.layers]
    assert bits == [8, 2, 2, 8]
    # A weight-only recipe keeps its layers' inputs float, kept layers' too; one with activations gives them int8.
    assert [layer.input_quant for layer in qmodel.layers] == [None] * 4
    w4a8 = quantize(mlp, **recipe("w4a8_g32", keep=r"layers\.0"))
    assert [layer.input_quant for layer in w4a8.layers] == [DynamicFakeQuant(8)] * 4
    assert w4a8.layers[0].weight_quant == DynamicFakeQuant(8, axis=0)
    # Full match: "layers.0" does not keep "layers.0x" style paths; a bare "0" keeps nothing, which is an error.
    with pytest.raises(ValueError, match=r"Rule 0 \(pattern '0'\) reaches none of the layers; the paths there are: "
                       r"'layers.0', 'layers.1'.* must match a whole path"):  # fmt: skip
        quantize(mlp, **recipe("w2a16_g32", keep="0"))
    with pytest.raises(ValueError, match=r"Rule 1 \(pattern 'x'\) reaches none of the layers; an earlier rule"):
        quantize(mlp, rules=[eqx_quant.Rule(".*"), eqx_quant.Rule("x")])


@pytest.mark.slow
def test_recipe_equals_the_same_quantizers_by_hand(mlp):
    x = jax.random.normal(jax.random.key(1), (4, 64))
    by_recipe = quantize(mlp, **recipe("w4a8_g32"))
    by_hand = quantize(mlp, weights=DynamicFakeQuant(4, group_size=32), activations=DynamicFakeQuant(8))
    run = eqx.filter_jit(lambda m, x: jax.vmap(m)(x))
    assert_bitwise_equal(run(by_recipe, x), run(by_hand, x))


@pytest.mark.slow
def test_learned_recipe_starts_from_the_round_to_nearest_model(mlp):
    qmodel = quantize(mlp, **recipe("w4a8_g32", learned=True))
    layer = qmodel.layers[1]
    assert type(layer.weight_quant) is LearnedFakeQuant and layer.weight_quant.scale.shape == (64, 2)
    expected = LearnedFakeQuant.init_from(mlp.layers[1].weight, 4, group_size=32, method="absmax")
    assert_bitwise_equal(layer.weight_quant.scale, expected.scale)
    # Before any training the learned model is the round-to-nearest one, bit for bit.
    x = jax.random.normal(jax.random.key(1), (4, 64))
    run = eqx.filter_jit(lambda m, x: jax.vmap(m)(x))
    assert_bitwise_equal(run(qmodel, x), run(quantize(mlp, **recipe("w4a8_g32")), x))


def test_attention_recipe_quantizes_the_products():
    model = {"attn": eqx.nn.MultiheadAttention(2, 8, key=jax.random.key(2))}
    qmodel = quantize(model, **recipe("w8a8_attn"))
    assert type(qmodel["attn"].scores) is eqx_quant.nn.QuantEinsum
    assert type(quantize(model, **recipe("w8a8"))["attn"]) is eqx.nn.MultiheadAttention


def test_recipe_errors():
    with pytest.raises(ValueError, match="w8a8"):
        recipe("int4")
    with pytest.raises(ValueError, match="keep"):
        recipe("w8a8", keep="(")
    with pytest.raises((ValueError, TypeError), match="group_size"):
        recipe("w4a8_g32", group_size=0)
    # A rule's quantizer factory checks its settings when made (a zero group size divided by zero at `quantize`; a
    # string flag acted as true).
    with pytest.raises(ValueError, match="`group_size` must be None or a positive int, got group_size=0"):
        eqx_quant.LayerQuantizer(4, group_size=0)
    with pytest.raises(TypeError, match="group_size"):  # under the suite's hook, its annotation's TypeError
        eqx_quant.LayerQuantizer(4, group_size="32")  # pyright: ignore[reportArgumentType]
    for flag in ("learned", "input", "per_token"):
        with pytest.raises(TypeError, match=flag):
            eqx_quant.LayerQuantizer(4, **{flag: "yes"})  # pyright: ignore[reportArgumentType]


def test_rules_refuse_the_legacy_arguments_and_say_how_to_keep_layers_float(mlp):
    # `rules` is the whole configuration: `where` or `matmul` beside it would be ignored, so they are refused, with
    # the rule that does what `where` would have done.
    for extra in ({"where": "layers.0"}, {"matmul": "float"}):
        with pytest.raises(ValueError, match=r"leave '(where|matmul)' out of it.*Rule\(pattern, weight=None"):
            quantize(mlp, **recipe("w8a8"), **extra)
    kept = quantize(mlp, rules=[eqx_quant.Rule(r"layers\.0", weight=None, input=None), *recipe("w8a8")["rules"]])
    first, second = kept.layers[0], kept.layers[1]
    assert (first.weight_quant, first.input_quant) == (None, None) and second.weight_quant is not None
    x = jnp.linspace(-1.0, 1.0, 64)
    assert_bitwise_equal(first(x), mlp.layers[0](x))
    # Called eagerly, a layer kept float computes as the float layer that `convert` gives back (a scalar input's
    # product, compiled as one program, rounded otherwise in some outputs).
    scalar = eqx.nn.Linear("scalar", 3, key=jax.random.key(1))
    kept = quantize({"l": scalar}, [eqx_quant.Rule("l", weight=None, input=None)])
    converted = eqx_quant.convert({"l": kept["l"], "other": quantize(mlp)})["l"]
    assert type(converted) is eqx.nn.Linear
    for value in jnp.linspace(-3.0, 3.0, 16):
        assert_bitwise_equal(kept["l"](value), converted(value))


def test_full_match_patterns():
    mlp = eqx.nn.MLP(2, 2, 4, 11, key=jax.random.key(3))
    searched = quantize(mlp, where=r"layers\.1")
    assert [i for i, l in enumerate(searched.layers) if type(l) is not eqx.nn.Linear] == [1, 10, 11]
    full = quantize(mlp, where=r"layers\.1", match="full")
    assert [i for i, l in enumerate(full.layers) if type(l) is not eqx.nn.Linear] == [1]
    mapped = quantize(mlp, weights={r"layers\.1": DynamicFakeQuant(4, axis=0)}, match="full")
    assert mapped.layers[1].weight_quant.bits == 4 and mapped.layers[10].weight_quant is None
    with pytest.raises((ValueError, TypeError), match="match"):
        quantize(mlp, match="prefix")  # pyright: ignore[reportArgumentType]


class Doubling(eqx.nn.Linear):
    def __call__(self, x, *, key=None):
        return 2 * super().__call__(x, key=key)


class Named(eqx.nn.Linear):
    """A subclass that keeps the base computation."""


def test_subclasses_that_override_call_are_not_silently_replaced():
    key = jax.random.key(4)
    model = {"plain": eqx.nn.Linear(3, 3, key=key), "double": Doubling(3, 3, key=key), "named": Named(3, 3, key=key)}
    with pytest.raises(ValueError, match="'double'.*Doubling"):
        quantize(model)
    skipped = quantize(model, subclasses="skip")
    assert type(skipped["double"]) is Doubling and type(skipped["named"]) is eqx_quant.nn.QuantLinear
    wrapped = quantize(model, subclasses="wrap")
    assert type(wrapped["double"]) is eqx_quant.nn.QuantLinear
    x = jnp.array([0.5, -1.0, 2.0])
    np.testing.assert_allclose(np.asarray(skipped["double"](x)), 2 * np.asarray(model["plain"](x)), rtol=1e-6)
    assert type(quantize(model, where=lambda path, layer: path != "double")["double"]) is Doubling


@eqx.filter_jit
def _by_hand(qmodel, x):
    for layer in qmodel.layers:
        weight, inputs = layer.weight_quant(layer.layer.weight), jax.vmap(layer.input_quant)(x)
        x = inputs @ weight.T + layer.layer.bias[None]
    return x


@pytest.mark.slow
def test_float_recipes_give_the_documented_quantizers_and_convert_exactly():
    # Inputs 32, 48, 24: blocks of 32 (MX) fit the first layer only, blocks of 16 (NVFP4) the first two; a layer they
    # do not fit falls back to FP8 E4M3 (weights per output channel, inputs per tensor).
    model = eqx.nn.Sequential(
        [eqx.nn.Linear(32, 48, key=jax.random.key(0)), eqx.nn.Linear(48, 24, key=jax.random.key(1)),
         eqx.nn.Linear(24, 5, key=jax.random.key(2))]
    )  # fmt: skip
    fp8_weights = eqx_quant.DynamicFloatFakeQuant("float8_e4m3fn", axis=0)
    fp8_inputs = eqx_quant.DynamicFloatFakeQuant("float8_e4m3fn")
    expected = {
        "fp8": [(fp8_weights, fp8_inputs)] * 3,
        "mxfp4": [(eqx_quant.MXFakeQuant("mxfp4"), eqx_quant.MXFakeQuant("mxfp8_e4m3"))]
        + [(fp8_weights, fp8_inputs)] * 2,
        "nvfp4": [(eqx_quant.NVFP4FakeQuant(), eqx_quant.NVFP4FakeQuant())] * 2 + [(fp8_weights, fp8_inputs)],
    }
    x = jax.random.normal(jax.random.key(3), (6, 32))
    run = eqx.filter_jit(lambda m, x: jax.vmap(m)(x))
    for name, quantizers in expected.items():
        if name == "fp8":
            qmodel = quantize(model, **recipe(name))
        else:  # the layers that blocks do not fit are named in a warning
            with pytest.warns(UserWarning, match="does not split into tiles of") as caught:
                qmodel = quantize(model, **recipe(name))
            assert len(caught) == (4 if name == "mxfp4" else 2)  # weights and inputs of each
        assert [(layer.weight_quant, layer.input_quant) for layer in qmodel.layers] == quantizers, name
        converted = eqx_quant.convert(qmodel)
        assert_bitwise_equal(run(converted, x), run(qmodel, x))
        # The fake-quantized output is the float model on the fake-quantized operands, layer by layer.
        np.testing.assert_allclose(run(qmodel, x), _by_hand(qmodel, x), rtol=1e-5, atol=1e-6)
    # A convolution blocks along its input channels: axis 1 of its weight (out, in, kh, kw), axis 0 of its input
    # (in, h, w), both counted from the end (-3) so that stacked weights block alike.
    conv = eqx.nn.Conv2d(32, 4, 3, key=jax.random.key(4))
    qconv = quantize(conv, **recipe("mxfp4"))
    assert qconv.weight_quant == eqx_quant.MXFakeQuant("mxfp4", axis=-3)
    assert qconv.input_quant == eqx_quant.MXFakeQuant("mxfp8_e4m3", axis=-3)
    image = jax.random.normal(jax.random.key(5), (32, 5, 5))
    by_hand = eqx.tree_at(lambda c: c.weight, conv, qconv.weight_quant(conv.weight))(qconv.input_quant(image))
    assert_bitwise_equal(qconv(image), by_hand)
    learned = quantize(model, **recipe("fp8", learned=True)).layers[0].weight_quant
    assert type(learned) is eqx_quant.LearnedFakeQuant and learned.scale.shape == (48,)
    assert learned.format == eqx_quant.float_format("float8_e4m3fn")
    with pytest.raises(ValueError, match="group_size"):
        recipe("mxfp4", group_size=32)
