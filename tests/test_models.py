"""Models as real libraries write them go through quantize -> calibrate -> QAT -> convert, and the converted model
computes exactly what the fake-quant model computes."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import eqx_quant
from eqx_quant import DynamicFakeQuant
from eqx_quant._int_ops import ConvSpec, plan

from .helpers import assert_bitwise_equal, init, integer_products
from .models import DecoderLM, MobileNet, ViT


def train(model, loss, batches, steps):
    optimizer = optax.sgd(0.01)
    state = optimizer.init(eqx.filter(model, eqx.is_array))

    @eqx.filter_jit
    def step(model, state, batch):
        value, grads = eqx.filter_value_and_grad(loss)(model, batch)
        updates, state = optimizer.update(grads, state)
        return eqx.apply_updates(model, updates), state, value

    values = []
    for _ in range(steps):
        model, state, value = step(model, state, batches[0])
        values.append(float(value))
    return model, values


@eqx.filter_jit
def run_both(first, second, x):
    """Two models on the batch `x`, compiled as one program."""
    return jax.vmap(first)(x), jax.vmap(second)(x)


def classification_loss(model, batch):
    images, labels = batch
    return optax.softmax_cross_entropy_with_integer_labels(jax.vmap(model)(images), labels).mean()


@pytest.fixture(scope="module")
def images():
    rngs = [np.random.default_rng(seed) for seed in (0, 1)]  # NumPy: no random-number program to compile
    return [
        (jnp.asarray(r.standard_normal((8, 1, 8, 8)), jnp.float32), jnp.asarray(r.integers(0, 5, 8), jnp.int32))
        for r in rngs
    ]


@pytest.mark.slow
def test_vit(images):
    model = init(ViT, 1)
    qmodel = eqx_quant.quantize(model, **eqx_quant.recipe("w8a8_attn"))
    assert type(qmodel.patch) is eqx_quant.nn.QuantConv and type(qmodel.blocks.attn.scores) is eqx_quant.nn.QuantEinsum
    qmodel = eqx_quant.calibrate(qmodel, [x for x, _ in images])
    # Every stacked layer got per-layer static input scales; the patch convolution a static one.
    assert qmodel.blocks.fc1.input_quant.scale.shape == (2,) and type(qmodel.patch.input_quant) is eqx_quant.FakeQuant
    qmodel, losses = train(qmodel, classification_loss, images, 4)
    assert losses[-1] < losses[0], losses
    converted = eqx_quant.convert(qmodel)
    assert_bitwise_equal(*run_both(converted, qmodel, images[1][0]))
    # Per block: four projections and two linear layers on int8 x int8 products, and the two attention products
    # (each with two more int8 products that locate NaN); the head too.
    jaxpr = jax.make_jaxpr(lambda x: qmodel(x))(images[0][0][0])
    assert integer_products(jaxpr.jaxpr) == 6 + 2 * 3 + 1


def lm_loss(model, tokens):
    logits = jax.vmap(model)(tokens)[:, :-1]
    return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()


@pytest.mark.slow
def test_decoder_language_model():
    model = init(DecoderLM, 2)
    batches = [jnp.asarray(np.random.default_rng(seed).integers(0, 13, (4, 6)), jnp.int32) for seed in (3, 4)]
    qmodel = eqx_quant.quantize(model, **eqx_quant.recipe("w8a8_attn", group_size=8, keep=r"embed"))
    # The tied head reads the embedding's `.weight`: the quantized table, per row at 8 bits (kept).
    assert_bitwise_equal(qmodel.embed.weight, DynamicFakeQuant(8, axis=0)(model.embed.weight))
    qmodel = eqx_quant.calibrate(qmodel, batches, method="minmax")
    assert qmodel.blocks.qkv.input_quant.zero_point.shape == (2,)
    qmodel, losses = train(qmodel, lm_loss, batches, 4)
    assert losses[-1] < losses[0], losses
    converted = eqx_quant.convert(qmodel)
    assert converted.blocks.gate.qweight.stack_depth == 1
    assert_bitwise_equal(*run_both(converted, qmodel, batches[1]))
    # Per block five linear layers (asymmetric calibrated inputs still run on integers) and two products (each
    # with its two NaN-locating int8 products).
    jaxpr = jax.make_jaxpr(lambda t: qmodel(t))(batches[0][0])
    assert integer_products(jaxpr.jaxpr) == 5 + 2 * 3


@pytest.mark.slow
def test_mobilenet(images):
    model = init(MobileNet, 4)
    qmodel = eqx_quant.calibrate(eqx_quant.quantize(model, **eqx_quant.recipe("w8a8")), [x for x, _ in images])
    qmodel, losses = train(qmodel, classification_loss, images, 4)
    assert losses[-1] < losses[0], losses
    converted = eqx_quant.convert(qmodel)
    assert_bitwise_equal(*run_both(converted, qmodel, images[1][0]))
    # Every convolution (the stem with "SAME" padding and stride 2, the depthwise ones, the pointwise ones) takes
    # the integer path.
    convs = [qmodel.stem] + [conv for block in qmodel.blocks for conv in (block.depthwise, block.pointwise)]
    for conv in convs:
        # Shapes and formats decide the plan: the operands are quantized abstractly (traced, not compiled).
        w, _ = eqx.filter_eval_shape(conv.weight_quant.quantize_with_mask, conv.layer.weight)
        x, _ = eqx.filter_eval_shape(conv.input_quant.quantize_with_mask, jnp.ones((conv.layer.in_channels, 8, 8)))
        assert isinstance(plan(conv.layer, conv.layer.weight.shape, w, x), ConvSpec)
