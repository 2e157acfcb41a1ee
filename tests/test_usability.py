"""What a newcomer meets first: quantized and converted layers as drop-ins, `summary`, checkpoints that load into the
float model, and no silent no-ops (each a clear error or a warning)."""

import contextlib
import io
import re

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import eqx_quant
from eqx_quant import DynamicFakeQuant

from .helpers import assert_bitwise_equal, assert_trees_equal, few_rows, init, np_absmax_scale
from .models import ViT


run = eqx.filter_jit(lambda model, x: jax.vmap(model)(x))


# ---------------------------------------------------------------------------------------------------------------------
# Drop-in layers.


@pytest.mark.slow
def test_quantized_and_converted_layers_read_like_the_float_layer():
    linear = init(lambda k: eqx.nn.Linear(6, 4, key=k), 0)
    conv = init(lambda k: eqx.nn.Conv2d(2, 3, 3, stride=2, padding=1, key=k), 1)
    embedding = init(lambda k: eqx.nn.Embedding(5, 4, key=k), 2)
    attributes = [
        (linear, ("bias", "in_features", "out_features", "use_bias")),
        (conv, ("bias", "in_channels", "out_channels", "kernel_size", "stride", "padding", "dilation", "groups",
                "use_bias", "padding_mode", "num_spatial_dims")),
        (embedding, ("num_embeddings", "embedding_size")),
    ]  # fmt: skip
    for layer, names in attributes:
        fake = eqx_quant.quantize(layer)
        real = eqx_quant.convert(fake)
        for wrapped in (fake, real):
            for name in names:
                a, b = getattr(wrapped, name), getattr(layer, name)
                assert (a is b) or (np.array_equal(a, b) if eqx.is_array(a) else a == b), (type(wrapped), name)
            assert wrapped.weight.shape == layer.weight.shape
            with pytest.raises(AttributeError):
                wrapped.no_such_attribute  # noqa: B018
    # Model code that reads the bias at call time works on the quantized layer, and `eqx.tree_at` through the
    # attribute reaches the float layer's bias.
    fake = eqx_quant.quantize(linear)
    moved = eqx.tree_at(lambda l: l.bias, fake, fake.bias + 1)
    assert type(moved.layer) is eqx.nn.Linear and np.array_equal(moved.layer.bias, linear.bias + 1)
    # An attention wrapped for its products reads like the attention it wraps.
    mha = init(lambda k: eqx.nn.MultiheadAttention(2, 8, key=k), 3)
    wrapped = eqx_quant.quantize(mha, products=DynamicFakeQuant(8))
    assert type(wrapped) is eqx_quant.nn.QuantMultiheadAttention and wrapped.num_heads == 2
    assert type(wrapped.query_proj) is eqx_quant.nn.QuantLinear and wrapped.query_proj is wrapped.attention.query_proj


# ---------------------------------------------------------------------------------------------------------------------
# summary.


def test_summary_counts_the_bytes_a_converted_model_stores():
    model = {
        "a": init(lambda k: eqx.nn.Linear(64, 16, key=k), 4),
        "b": init(lambda k: eqx.nn.Linear(16, 8, key=k), 5),
        "c": init(lambda k: eqx.nn.Linear(8, 2, key=k), 6),
    }
    rules = [
        eqx_quant.Rule("a", weight=DynamicFakeQuant(4, group_size=32)),
        eqx_quant.Rule("b", weight=DynamicFakeQuant("float8_e4m3fn", axis=0), input=None),
    ]  # "c" stays float
    fake = eqx_quant.quantize(model, rules)
    real = eqx_quant.convert(fake)
    for m in (fake, real):
        table = eqx_quant.summary(m)
        rows = {row.path: row for row in table.rows}
        assert set(rows) == {"a", "b", "c"}
        assert rows["a"].bits == 4 and rows["b"].bits == 8 and rows["c"].bits is None
        assert rows["a"].weight.startswith("int4") and "tiles of 32" in rows["a"].weight
        assert rows["a"].input.startswith("int8") and rows["b"].input == "float" and rows["c"].weight == "float"
        assert [rows[p].float_bytes for p in "abc"] == [64 * 16 * 4, 16 * 8 * 4, 8 * 2 * 4]
        # Stored: a's int4 codes two per byte and its float32 scales per group; b's FP8 codes and scales; c in float.
        assert rows["a"].stored_bytes == 16 * 64 // 2 + 16 * 2 * 4
        assert rows["b"].stored_bytes == 8 * 16 + 8 * 4
        assert rows["c"].stored_bytes == rows["c"].float_bytes
        assert table.stored_bytes == sum(row.stored_bytes for row in table.rows)
        text = str(table)
        assert "2 of 3 quantized" in text and f"{table.float_bytes:,}" in text
    assert eqx_quant.summary(real).stored_bytes == sum(real[p].qweight.nbytes for p in "ab") + model["c"].weight.nbytes
    # A stacked model: the stack's bytes, and the products.
    vit = init(ViT, 7)
    table = eqx_quant.summary(eqx_quant.quantize(vit, **eqx_quant.recipe("w8a8_attn")))
    rows = {row.path: row for row in table.rows}
    assert rows["blocks.fc1"].float_bytes == 2 * 32 * 16 * 4
    assert rows["blocks.fc1"].stored_bytes == 2 * (32 * 16 + 32 * 4)
    assert rows["blocks.attn.scores"].kind == "QuantEinsum"


def test_summary_says_which_quantizers_have_a_zero_point():
    model = {name: init(lambda k: eqx.nn.Linear(4, 4, key=k), i) for i, name in enumerate("abcd")}
    static, learned = eqx_quant.FakeQuant, eqx_quant.LearnedFakeQuant
    dynamic = DynamicFakeQuant(8, axis=0)
    rules = [
        eqx_quant.Rule("a", weight=static(0.1, -128, 127), input=static(0.1, -128, 127, zero_point=3)),
        eqx_quant.Rule("b", weight=dynamic, input=DynamicFakeQuant(8, symmetric=False)),
        eqx_quant.Rule("c", weight=dynamic, input=learned(0.1, -128, 127, zero_point=0.0)),
        eqx_quant.Rule("d", weight=dynamic, input=learned(0.1, -128, 127)),
    ]
    rows = {row.path: row for row in eqx_quant.summary(eqx_quant.quantize(model, rules)).rows}
    assert rows["a"].weight == "int8 static, per tensor" and rows["a"].input == "int8 static asymmetric, per tensor"
    assert rows["b"].input == "int8 dynamic asymmetric, per tensor"
    # A learned zero point makes the quantizer asymmetric whatever its value.
    assert rows["c"].input == "int8 learned asymmetric, per tensor" and rows["d"].input == "int8 learned, per tensor"


class _RoutedBare(eqx.Module):
    router: jax.Array
    up: jax.Array
    gate: jax.Array

    def __call__(self, x):
        weights = jax.nn.softmax(x @ self.router)
        return (x @ self.up) * weights[0] + x @ jnp.where(self.gate > 0, self.gate, 0.0)


def test_summary_lists_the_traced_weights_left_float(tmp_path):
    model = init(lambda k: _RoutedBare(*(jax.random.normal(j, s) for j, s in zip(
        jax.random.split(k, 3), [(8, 2), (8, 4), (8, 4)], strict=True))), 13)  # fmt: skip
    x = jnp.ones(8)
    rules = [eqx_quant.Rule("router|gate", weight=None, input=None), *eqx_quant.recipe("w8a8")["rules"]]
    quantized = eqx_quant.quantize(model, rules, example=(x,))
    for m in (quantized, eqx_quant.convert(quantized)):
        table = eqx_quant.summary(m)
        rows = {row.path: row for row in table.rows}
        # The router kept float by its rule, and `gate` (read through `jnp.where`, no view of it), with their bytes.
        assert list(rows) == ["model.up", "model.router", "model.gate"]
        assert [rows[p].weight for p in ("model.router", "model.gate")] == ["float", "float"]
        assert rows["model.router"].float_bytes == rows["model.router"].stored_bytes == 8 * 2 * 4
        assert table.float_bytes == 4 * (8 * 2 + 8 * 4 + 8 * 4) and "1 of 3 quantized" in str(table)
    eqx_quant.save(tmp_path / "m.eqx", quantized)
    assert eqx_quant.load(tmp_path / "m.eqx", model).float_paths == ("router", "gate")


class _Mix(eqx.Module):
    def __call__(self, p, v):
        return jnp.einsum("hts,she->the", p, v)  # computed as `dot_general(v, p)`: the operands swap


def test_summary_shows_which_operand_of_a_product_a_pair_quantizes(tmp_path):
    rng = np.random.default_rng(14)
    p, v = (jnp.asarray(rng.normal(size=s).astype(np.float32)) for s in [(2, 6, 6), (6, 2, 16)])
    q = DynamicFakeQuant(8)
    seen = []
    factory = lambda path, product: seen.append(product) or (None, q)  # noqa: E731
    quantized = eqx_quant.quantize(_Mix(), [eqx_quant.Rule(r"products\.0", products=factory)], example=(p, v))
    assert (seen[0].input_shape, seen[0].rhs_shape) == ((6, 2, 16), (2, 6, 6))
    # The pair's right quantizer quantizes the right operand of the product as computed: `p`, as the table says.
    (row,) = eqx_quant.summary(quantized).rows
    assert row.input == "lhs (6, 2, 16): float; rhs (2, 6, 6): int8 dynamic, per tensor"
    assert_bitwise_equal(quantized(p, v), jnp.einsum("hts,she->the", q(p), v))
    assert str(eqx_quant.summary(quantized)).splitlines()[-1].split()[-2:] == ["0", "0"]  # no weights: no ratio
    eqx_quant.save(tmp_path / "m.eqx", quantized)
    assert eqx_quant.load(tmp_path / "m.eqx", _Mix()).product_shapes == (((6, 2, 16), (2, 6, 6)),)
    # A quantizer that does not fit its operand is refused by `quantize`, not at the first call.
    with pytest.raises(ValueError, match=r"The lhs quantizer of products\.0 .* of shape \(6, 2, 16\): `axis` must"):
        eqx_quant.quantize(
            _Mix(), [eqx_quant.Rule(r"products\.0", products=DynamicFakeQuant(8, axis=5))], example=(p, v)
        )


# ---------------------------------------------------------------------------------------------------------------------
# Checkpoints that describe themselves.


@pytest.mark.slow
def test_load_into_the_float_model_rebuilds_the_saved_structure(tmp_path):
    vit = init(ViT, 8)
    images = jnp.asarray(np.random.default_rng(9).normal(size=(4, 1, 8, 8)).astype(np.float32))
    rules = eqx_quant.recipe("w8a8_attn", keep="patch", learned=True)["rules"]
    fake = eqx_quant.calibrate(eqx_quant.quantize(vit, rules), [images])
    with pytest.warns(UserWarning, match=r"the layers at \['patch'\] .* keep the float backward"):
        backward = eqx_quant.quantize(
            vit, weights=DynamicFakeQuant(4, axis=0), backward=eqx_quant.QuantizedBackward(8, rounding="stochastic")
        )
    for name, model in (("fake", fake), ("converted", eqx_quant.convert(fake)), ("backward", backward)):
        path = tmp_path / f"{name}.eqx"
        eqx_quant.save(path, model)
        for like in (init(ViT, 10), eqx.filter_eval_shape(ViT, jax.random.key(0))):
            loaded = eqx_quant.load(path, like)
            assert jax.tree.structure(loaded) == jax.tree.structure(model), name
            assert_trees_equal(loaded, model)
            assert_bitwise_equal(run(loaded, images), run(model, images))
        # The exact form keeps working.
        assert_trees_equal(eqx_quant.load(path, model), model)
    # A mismatch says what to do.
    eqx_quant.save(tmp_path / "fake.eqx", fake)
    with pytest.raises(ValueError, match="Load into the float model instead"):
        eqx_quant.load(tmp_path / "fake.eqx", eqx_quant.quantize(vit))
    # A converted file into the fake-quantized model it came from: the structure must be the converted one.
    with pytest.raises(ValueError, match=r"Load into the float model instead .* converted if the saved model was"):
        eqx_quant.load(tmp_path / "converted.eqx", fake)


def test_a_model_that_is_one_layer_loads_into_its_float_layer(tmp_path):
    linear = init(lambda k: eqx.nn.Linear(64, 16, key=k), 12)
    x = jnp.asarray(np.random.default_rng(12).normal(size=(64,)).astype(np.float32))
    fake = eqx_quant.calibrate(eqx_quant.quantize(linear), [x[None]])
    for name, model in (("fake", fake), ("converted", eqx_quant.convert(fake))):
        eqx_quant.save(tmp_path / f"{name}.eqx", model)
        loaded = eqx_quant.load(tmp_path / f"{name}.eqx", linear)  # the file names its arrays from the root
        assert type(loaded) is type(model)
        assert_trees_equal(loaded, model)
        assert_bitwise_equal(loaded(x), model(x))


# ---------------------------------------------------------------------------------------------------------------------
# No silent no-ops.


def test_configurations_that_would_do_nothing_are_errors_or_warnings():
    mlp = init(lambda k: eqx.nn.MLP(32, 2, 48, 1, key=k), 11)
    # Products asked for a model without Einsum or MultiheadAttention (attention written with jnp.einsum).
    with pytest.raises(ValueError, match="no eqx_quant.nn.Einsum nor eqx.nn.MultiheadAttention"):
        eqx_quant.quantize(mlp, products=DynamicFakeQuant(8))
    # Converting a float model.
    with pytest.raises(ValueError, match="`model` has no quantized layer to convert"):
        eqx_quant.convert(mlp)
    # Converting a converted model.
    with pytest.raises(ValueError, match="`model` is converted already"):
        eqx_quant.convert(eqx_quant.convert(eqx_quant.quantize(mlp)))

    # Every algorithm on a converted model, of layers or of traced weights: they change the fake-quant model.
    class Bare(eqx.Module):
        w: jax.Array

        def __call__(self, x):
            return x @ self.w

    batches = [jnp.ones((2, 32))]
    converted = (
        eqx_quant.convert(eqx_quant.quantize(mlp)),
        eqx_quant.convert(eqx_quant.quantize(Bare(jnp.ones((32, 8))), example=(batches[0][0],))),
    )
    calls = {
        "calibrate": lambda m: eqx_quant.calibrate(m, batches),
        "gptq": lambda m: eqx_quant.gptq(m, batches),
        "autoround": lambda m: eqx_quant.autoround(m, batches),
        "smoothquant": lambda m: eqx_quant.smoothquant(m, batches),
        "awq": lambda m: eqx_quant.awq(m, batches),
        "rotate": lambda m: eqx_quant.rotate(m, key=jax.random.key(0)),
        "learn_scales": eqx_quant.learn_scales,
    }
    for model in converted:
        for name, call in calls.items():
            with pytest.raises(ValueError, match=rf"`model` is converted .*: `{name}` works on the fake-quant model"):
                call(model)
    # A model converted in part keeps its fake-quant layers to work on: the converted layer is left as it is.
    quantized = eqx_quant.quantize(mlp)
    part = eqx.tree_at(lambda m: m.layers[0], quantized, eqx_quant.convert(quantized.layers[0]))
    calibrated = eqx_quant.calibrate(part, batches)
    assert eqx.tree_equal(calibrated.layers[0], part.layers[0])
    assert isinstance(calibrated.layers[1].input_quant, eqx_quant.FakeQuant)
    # Calibrating a float model, and a quantized one with nothing to calibrate (weight-only, or block-format inputs).
    batch = jnp.ones((2, 32))
    with pytest.raises(ValueError, match="quantize it first"):
        eqx_quant.calibrate(mlp, [batch])
    tiled = init(lambda k: eqx.nn.MLP(32, 2, 32, 1, key=k), 12)  # contractions of 32: tiles of 32 and 16 fit
    for name, found in (("w4a16_g32", "float"), ("nvfp4", "nvfp4 dynamic, tiles of 16 along axis -1")):
        message = rf"`model` is quantized, but none .* quantizers: \{{'layers.0': '{re.escape(found)}', 'layers.1'"
        with pytest.raises(ValueError, match=message):
            eqx_quant.calibrate(eqx_quant.quantize(tiled, **eqx_quant.recipe(name)), [batch])
    # Quantizing twice keeps the first quantizers, and says so.
    once = eqx_quant.quantize(mlp, **eqx_quant.recipe("w8a8"))
    with pytest.warns(UserWarning, match=r"The layers at \['layers.0', 'layers.1'\] are quantized already"):
        twice = eqx_quant.quantize(once, **eqx_quant.recipe("w2a16_g32"))
    assert eqx.tree_equal(twice, once)
    # Quantizing a converted model leaves its converted layers as they are (the float layers they hold have no
    # weight), and says so.
    converted = eqx_quant.convert(once)
    with pytest.warns(UserWarning, match=r"The layers at \['layers.0', 'layers.1'\] are converted already"):
        again = eqx_quant.quantize(converted, **eqx_quant.recipe("w4a8_g32"))
    assert eqx.tree_equal(again, converted)
    # Its float model holds the float layers with the dequantized weights: the fake-quantized ones, bit for bit.
    back = eqx_quant.float_model(converted)
    for layer, fake in zip(back.layers, once.layers, strict=True):
        assert type(layer) is eqx.nn.Linear
        assert_bitwise_equal(layer.weight, fake.weight)
        assert_bitwise_equal(layer.bias, fake.layer.bias)
    # Calibration batches that never reach a quantized layer: its input would stay dynamic.
    unused = eqx_quant.quantize({"used": mlp, "unused": mlp.layers[0]}, **eqx_quant.recipe("w8a8"))
    never = r"The layers at \['args.0.unused'\] were never called .*: pass batches that reach them, or leave them out"
    with pytest.raises(ValueError, match=never):
        eqx_quant.calibrate(eqx.Partial(lambda m, x: m["used"](x), unused), [jnp.ones((2, 32))])
    # A recipe's groups that a layer's inputs do not split into.
    with pytest.warns(UserWarning, match="'layers.1': its contraction does not split into tiles of 32") as caught:
        grouped = eqx_quant.quantize(mlp, **eqx_quant.recipe("w4a16_g32"))
    assert len(caught) == 1 and grouped.layers[1].weight_quant == DynamicFakeQuant(4, axis=0)
    assert grouped.layers[0].weight_quant == DynamicFakeQuant(4, group_size=32)

    # `example=` whose products of the model's own arrays no rule reaches (rules naming the layers alone, as
    # `auto_recipe`'s do): they stay float, and `quantize` says so. A rule that reaches them with no quantizers is a
    # choice, and silent.
    class Mixed(eqx.Module):
        linear: eqx.nn.Linear
        w: jax.Array

        def __call__(self, x):
            return self.linear(x @ self.w.T)

    mixed, x = Mixed(eqx.nn.Linear(8, 4, key=jax.random.key(0)), jnp.ones((8, 16))), jnp.ones(16)
    with pytest.warns(UserWarning, match=re.escape("`example` found products of the model's own arrays ['w'], but no")):
        alone = eqx_quant.quantize(mixed, [eqx_quant.Rule("linear")], example=(x,))
    assert isinstance(alone, Mixed) and isinstance(alone.linear, eqx_quant.nn.QuantLinear)
    chosen = [eqx_quant.Rule("linear"), eqx_quant.Rule("w", weight=None, input=None)]
    assert eqx.tree_equal(eqx_quant.quantize(mixed, chosen, example=(x,)), alone)


@few_rows
def test_calibrate_and_gptq_observe_layers_inside_a_cond_one_example_at_a_time():
    """Under `jax.vmap`, JAX refuses the observers' reports inside `jax.lax.cond`; the examples then run one after
    another, each observed in the branch it takes."""

    class Gated(eqx.Module):
        a: eqx.nn.Linear
        b: eqx.nn.Linear

        def __call__(self, x):
            return jax.lax.cond(x[0] > 0, lambda x: self.a(x), lambda x: self.b(x), x)

    gated = Gated(init(lambda k: eqx.nn.Linear(8, 4, key=k), 31), init(lambda k: eqx.nn.Linear(8, 4, key=k), 32))
    xs = np.random.default_rng(33).normal(size=(16, 8)).astype(np.float32)
    xs[:, 1:] *= np.where(xs[:, :1] > 0, 1.0, 5.0)  # the two branches see inputs of different ranges
    quantized = eqx_quant.quantize(gated, **eqx_quant.recipe("w8a8"))
    calibrated = eqx_quant.calibrate(quantized, [jnp.asarray(xs)])
    for layer, taken in ((calibrated.a, xs[:, 0] > 0), (calibrated.b, xs[:, 0] <= 0)):
        assert layer.input_quant.scale == np_absmax_scale(np.abs(xs[taken]).max(), 127)
    # GPTQ's Hessian of a branch's layer is that of the examples taking it: as for the layer alone on those examples.
    solved = eqx_quant.gptq(calibrated, [jnp.asarray(xs)])
    alone = eqx_quant.gptq(calibrated.b, [jnp.asarray(xs[xs[:, 0] <= 0])])
    np.testing.assert_allclose(solved.b.layer.weight, alone.layer.weight, rtol=1e-6, atol=1e-6)
    assert not np.array_equal(solved.b.layer.weight, calibrated.b.layer.weight)
    # A model that maps the cond itself (`batched=True`) cannot be observed: the error says what to do instead.
    with pytest.raises(NotImplementedError, match="vmap-of-cond") as caught:
        eqx_quant.calibrate(eqx.Partial(lambda m, x: jax.vmap(m)(x), quantized), [jnp.asarray(xs)], batched=True)
    assert any("`batched=False`, whose examples then run one after another" in note for note in caught.value.__notes__)


@pytest.mark.slow
def test_calibration_data_with_nan_and_inf():
    mlp = init(lambda k: eqx.nn.MLP(4, 2, 8, 1, key=k), 12)
    qmodel = eqx_quant.quantize(mlp)
    clean = np.random.default_rng(13).normal(size=(8, 4)).astype(np.float32)
    dirty = clean.copy()
    dirty[0, 1], dirty[3, 2], dirty[5, 0] = np.nan, np.inf, -np.inf
    with pytest.warns(UserWarning, match=r"held NaN or inf values.*'layers.0' 3 of 32") as caught:
        calibrated = eqx_quant.calibrate(qmodel, [jnp.asarray(dirty)])
    assert len(caught) == 1  # the first layer only: its outputs through the float layer carry them on as NaN
    expected = eqx_quant.calibrate(qmodel, [jnp.asarray(np.where(np.isfinite(dirty), dirty, 0))])
    assert calibrated.layers[0].input_quant == expected.layers[0].input_quant
    with pytest.raises(ValueError, match=r"The layers at \['layers.0', 'layers.1'\] saw no finite input"):
        eqx_quant.calibrate(qmodel, [jnp.full((4, 4), jnp.nan)])


@pytest.mark.slow
def test_progress_bars():
    mlp = init(lambda k: eqx.nn.MLP(8, 2, 8, 1, key=k), 14)
    batches = [jnp.asarray(np.random.default_rng(i).normal(size=(4, 8)).astype(np.float32)) for i in range(3)]
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        quiet = eqx_quant.calibrate(eqx_quant.quantize(mlp), batches)
    assert err.getvalue() == ""
    with contextlib.redirect_stderr(err):
        loud = eqx_quant.calibrate(eqx_quant.quantize(mlp), batches, progress=True)
        eqx_quant.gptq(eqx_quant.quantize(mlp, activations=None), batches, progress=True)
    assert "calibrate" in err.getvalue() and "gptq" in err.getvalue()
    assert loud.layers[0].input_quant == quiet.layers[0].input_quant


class _WithState(eqx.Module):
    fc: eqx.nn.Linear

    def __call__(self, x, state):
        return self.fc(x), state


def _note(error: BaseException) -> str:
    (note,) = [n for n in getattr(error, "__notes__", []) if n.startswith("eqx_quant:")]
    return note


def test_an_error_tracing_example_says_what_example_is():
    """A batch passed as `quantize`'s `example`: the layer's own error keeps its type and message, with a note of the
    arguments traced and that `example` holds one example."""

    class Bare(eqx.Module):
        w: jax.Array
        fc: eqx.nn.Linear

        def __call__(self, x):
            return self.fc(x @ self.w)

    model = Bare(jnp.ones((8, 8)), eqx.nn.Linear(8, 2, key=jax.random.key(0)))
    with pytest.raises(ValueError, match="`x` must have shape") as caught:
        eqx_quant.quantize(model, **eqx_quant.recipe("w8a8"), example=(jnp.ones((16, 8)),))
    assert _note(caught.value) == (
        "eqx_quant: raised tracing `model(*example)` with `example` (float32[16, 8],). `example` is one call of the "
        "model as it runs: for a model written for one example (mapped over a batch with `jax.vmap`), one example's "
        "arguments, without the batch axis."
    )


def test_an_unbound_axis_name_while_tracing_example_says_how_to_bind_it():
    """A batch normalisation reading a named axis, traced on one example: JAX's `NameError` with a note of the two
    ways the note gives, which both quantize the model's bare weight."""

    class Normed(eqx.Module):
        w: jax.Array
        norm: eqx.nn.BatchNorm

        def __call__(self, x, state):
            return self.norm(self.w @ x, state)

    model, state = eqx.nn.make_with_state(Normed)(jnp.ones((4, 4)), eqx.nn.BatchNorm(4, "batch", mode="batch"))
    rules = eqx_quant.recipe("w8a8")["rules"]
    with pytest.raises(NameError, match="unbound axis name: batch") as caught:
        eqx_quant.quantize(model, rules, example=(jnp.ones(4), state))
    assert "named axis" in _note(caught.value) and "axis_name=" in _note(caught.value)
    batch = jnp.arange(8.0).reshape(2, 4)
    mapped = lambda m: jax.vmap(m, axis_name="batch", in_axes=(0, None))(batch, state)  # noqa: E731
    for example in (mapped, (jnp.ones(4), state)):
        traced = model if callable(example) else eqx.nn.inference_mode(model)
        quantized = eqx_quant.quantize(traced, rules, example=example)
        assert quantized.weight_paths == ("w",)


def test_an_error_on_the_first_batch_says_how_batches_are_called():
    """A model that takes a second argument, or a batch of (inputs, labels): the error raised on the first batch keeps
    its type and message, with a note of the batch and of how it was called. One array passed as `batches` is a
    `TypeError` before anything runs."""
    stateful = eqx_quant.quantize(_WithState(eqx.nn.Linear(4, 3, key=jax.random.key(0))), **eqx_quant.recipe("w8a8"))
    with pytest.raises(TypeError, match="missing 1 required positional argument: 'state'") as caught:
        eqx_quant.calibrate(stateful, [jnp.ones((2, 4))])
    assert _note(caught.value) == (
        "eqx_quant: raised running the model on the first batch, float32[2, 4]. Each batch is the model's one "
        "argument, its examples along the leading axis, called as `jax.vmap(model)(batch)`; wrap a model that takes "
        "more (a state, a key, a mask) in a module or an `eqx.Partial` whose call takes the batch alone."
    )
    # `auto_recipe` runs the float model on the batches first: the same note.
    with pytest.raises(TypeError, match="missing 1 required positional argument: 'state'") as caught:
        eqx_quant.auto_recipe(_WithState(eqx.nn.Linear(32, 3, key=jax.random.key(0))), [jnp.ones((2, 32))],
                              average_bits=6)  # fmt: skip
    assert _note(caught.value).startswith("eqx_quant: raised running the model on the first batch, float32[2, 32].")
    # A batch of (inputs, labels), as a data loader gives: the note says to pass the inputs alone.
    layer = eqx_quant.quantize(eqx.nn.Linear(4, 3, key=jax.random.key(0)), **eqx_quant.recipe("w8a8"))
    with pytest.raises(Exception) as caught:
        eqx_quant.calibrate(layer, [(jnp.ones((2, 4)), jnp.zeros(2, jnp.int32))])
    assert _note(caught.value).startswith("eqx_quant: raised running the model on the first batch, (float32[2, 4], ")
    assert _note(caught.value).endswith("for (inputs, labels) pairs from a data loader, pass the inputs alone.")

    # A BatchNorm in training mode reads the batch axis by name, which `jax.vmap(model)` does not bind: the note says
    # to calibrate in inference mode, which runs.
    class Normed(eqx.Module):
        linear: eqx.nn.Linear
        norm: eqx.nn.BatchNorm
        state: eqx.nn.State

        def __call__(self, x):
            return self.norm(self.linear(x), self.state)[0]

    norm, state = eqx.nn.make_with_state(eqx.nn.BatchNorm)(3, "batch", mode="batch")
    normed = eqx_quant.quantize(
        Normed(eqx.nn.Linear(4, 3, key=jax.random.key(0)), norm, state), **eqx_quant.recipe("w8a8")
    )
    with pytest.raises(NameError, match="unbound axis name") as caught:
        eqx_quant.calibrate(normed, [jnp.ones((2, 4))])
    assert _note(caught.value).endswith(
        "pass `eqx.nn.inference_mode(model)`, whose batch statistics are the stored ones, as served."
    )
    eqx_quant.calibrate(eqx.nn.inference_mode(normed), [jnp.ones((2, 4))])
    # One array for `batches`, whose rows would be taken as the batches: refused before anything runs, by every
    # function that reads batches.
    array = jnp.ones((2, 4))
    message = re.escape(
        "`batches` must be an iterable of batches (a list of arrays, each with a leading batch axis), got one array "
        "of shape (2, 4): pass `[x]` for one batch, or `list(x)` for a stack of batches."
    )
    float_layer = eqx.nn.Linear(4, 3, key=jax.random.key(0))
    calls = [
        lambda: eqx_quant.calibrate(layer, array),
        lambda: eqx_quant.smoothquant(layer, array),
        lambda: eqx_quant.gptq(layer, array),
        lambda: eqx_quant.auto_recipe(float_layer, array, average_bits=6),
    ]
    for call in calls:
        with pytest.raises(TypeError, match=message):
            call()

    # `rotate`'s `batch` is one batch too: one example, without its batch axis, gets the same note.
    class Bare(eqx.Module):
        w: jax.Array

        def __call__(self, x):
            return x @ self.w.T

    bare = eqx_quant.quantize(Bare(jnp.ones((3, 32))), **eqx_quant.recipe("w8a8"), example=(jnp.ones((2, 32)),))
    with pytest.raises(ValueError, match="must have ndim at least 1") as caught:
        eqx_quant.rotate(bare, key=jax.random.key(0), batch=jnp.ones(32))
    assert _note(caught.value).startswith(
        "eqx_quant: raised running the model on `batch`, float32[32]. Each batch is the model's one argument, its "
        "examples along the leading axis, called as `jax.vmap(model)(batch)`"
    )
    # GPTQ on traced weights runs the model on the first batch in two steps (the weights it reads, their call
    # order): the error carries one note, not one per step (`_note` takes exactly one).
    with pytest.raises(ValueError, match="must have ndim at least 1") as caught:
        eqx_quant.gptq(bare, [jnp.ones(32)])
    assert _note(caught.value).startswith("eqx_quant: raised running the model on the first batch, float32[32].")
    # Sequential GPTQ traces the model on the first batch before anything else: the same note.
    with pytest.raises(TypeError, match="missing 1 required positional argument: 'state'") as caught:
        eqx_quant.gptq(stateful, [jnp.ones((2, 4))], batched=True)
    assert _note(caught.value).startswith(
        "eqx_quant: raised running the model on the first batch, float32[2, 4]. Each batch is the model's one "
        "argument, its examples along the leading axis, called as `model(batch)` (`batched=True`)"
    )
    # Wrapped so that its call takes the batch alone, it calibrates.
    wrapped = eqx.Partial(lambda model, x: jax.vmap(lambda v: model(v, None)[0])(x), stateful)
    calibrated = eqx_quant.calibrate(wrapped, [jnp.ones((2, 4))], batched=True)
    assert isinstance(calibrated.args[0].fc.input_quant, eqx_quant.FakeQuant)


def test_summary_lists_the_layers_quantize_reaches_only_by_tracing():
    class Model(eqx.Module):
        up: eqx.nn.ConvTranspose2d
        cell: eqx.nn.GRUCell
        lin: eqx.nn.Linear

        def __call__(self, x):
            return self.lin(x)

    model = init(
        lambda k: Model(
            eqx.nn.ConvTranspose2d(2, 3, 3, key=k), eqx.nn.GRUCell(4, 5, key=k), eqx.nn.Linear(4, 2, key=k)
        ),
        0,
    )
    # Without `example=`, `quantize` says which layers it leaves float for want of tracing.
    untraced = r"only by tracing their products: 'up' \(ConvTranspose2d\), 'cell' \(GRUCell\)\. Pass `example=`"
    with pytest.warns(UserWarning, match=untraced):
        quantized = eqx_quant.quantize(model)
    # Not where the configuration does not reach their weights (an unexpected warning fails this test).
    eqx_quant.quantize(model, [eqx_quant.Rule("lin", weight=DynamicFakeQuant(8))])
    eqx_quant.quantize(model, where="lin")
    table = eqx_quant.summary(quantized)
    assert [r.path for r in table.rows] == ["up", "cell", "lin"]  # in the model's order
    rows = {r.path: r for r in table.rows}
    assert (rows["up"].kind, rows["up"].weight, rows["up"].input) == ("ConvTranspose2d", "float", "float")
    assert rows["up"].float_bytes == rows["up"].stored_bytes == 4 * 3 * 2 * 3 * 3
    assert rows["cell"].kind == "GRUCell" and rows["cell"].float_bytes == 4 * (15 * 4 + 15 * 5)
    assert rows["lin"].kind == "QuantLinear"
    assert "1 of 3 quantized" in str(table)

    # The count goes by what a row quantizes, not by its kind's name: a float subclass of a layer counts as float.
    class Mine(eqx.nn.Linear):
        pass

    assert "0 of 1 quantized" in str(eqx_quant.summary(init(lambda k: Mine(4, 2, key=k), 0)))
    bare = eqx.tree_at(lambda m: (m.lin.weight_quant, m.lin.input_quant), quantized, (None, None))
    assert "0 of 3 quantized" in str(eqx_quant.summary(bare))  # a `QuantLinear` without quantizers

    # With `example=`: a traced weight has its own row; one kept float by a rule inside the traced model, a float row.
    class Traced(eqx.Module):
        up: eqx.nn.ConvTranspose1d
        w: jax.Array

        def __call__(self, x):
            return self.up(x).ravel()[:4] @ self.w

    traced = init(lambda k: Traced(eqx.nn.ConvTranspose1d(2, 3, 3, key=k), jnp.zeros((4, 2))), 1)
    rules = [eqx_quant.Rule(r"up\.weight", weight=None, input=None), eqx_quant.Rule(".*", weight=DynamicFakeQuant(8))]
    traced_model = eqx_quant.quantize(traced, rules, example=(jnp.ones((2, 5)),))
    rows = {r.path: r for r in eqx_quant.summary(traced_model).rows}
    assert set(rows) == {"model.up", "model.w"}
    assert (rows["model.up"].kind, rows["model.up"].float_bytes) == ("ConvTranspose1d", 4 * 2 * 3 * 3)
    assert rows["model.w"].kind == "traced"
    # Inside a traced model, which took its layers' weights already, `quantize` warns of none.
    eqx_quant.quantize({"traced": traced_model, "head": init(lambda k: eqx.nn.Linear(2, 2, key=k), 2)})
