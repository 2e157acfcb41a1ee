"""QAT on a `(data=2, model=2)` mesh of 4 CPU devices, checked against the same computation on one device.

Weights are tensor parallel: output channels (axis 0) on `model`, except the MLP's middle layer, whose input
features (axis 1) are: a row-parallel layer, whose contraction and per-channel statistics span both `model` devices.
Batches are split along `data`.
"""

import functools

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

import eqx_quant
from examples.qat_demo import ConvNet
from eqx_quant.nn import AbstractQuantLayer, IntConv, IntLinear
from tests.helpers import few_rows


if jax.device_count() != 4:
    pytest.fail(
        f"The sharded tests need 4 devices, found {jax.device_count()}. Run them through tests/test_sharding.py, or "
        "as `XLA_FLAGS=--xla_force_host_platform_device_count=4 pytest -o python_files='check_*.py' tests/sharded`.",
        pytrace=False,
    )

AUTO = jax.make_mesh((2, 2), ("data", "model"), axis_types=(AxisType.Auto,) * 2)
EXPLICIT = jax.make_mesh((2, 2), ("data", "model"), axis_types=(AxisType.Explicit,) * 2)
BATCH = 16
ROW_PARALLEL = ("layers.1",)  # in the MLP


def _name(path) -> str:
    return jax.tree_util.keystr(path, simple=True, separator=".")


def weight_spec(name: str, ndim: int, row_parallel: tuple[str, ...]) -> P:
    """The partitioning of a float model's leaf, from its path."""
    layer = name.rsplit(".", 1)[0]
    if layer in row_parallel:
        return P(None, "model") if name.endswith("weight") else P()
    return P("model", *([None] * (ndim - 1)))


def shard(model, mesh, row_parallel=ROW_PARALLEL):
    def place(path, leaf):
        if not eqx.is_array(leaf):
            return leaf
        return jax.device_put(leaf, NamedSharding(mesh, weight_spec(_name(path), leaf.ndim, row_parallel)))

    return jax.tree_util.tree_map_with_path(place, model)


def float_model(kind: str):
    key = jax.random.key(0)
    if kind == "mlp":
        return eqx.nn.MLP(64, 16, 128, 2, activation=jax.nn.relu, key=key)
    return ConvNet(key)


def batch(kind: str):
    rng = np.random.default_rng(1)
    shape = (BATCH, 64) if kind == "mlp" else (BATCH, 1, 8, 8)
    x = rng.standard_normal(shape, dtype=np.float32)
    y = rng.integers(0, 16 if kind == "mlp" else 10, BATCH, dtype=np.int32)
    return jnp.asarray(x), jnp.asarray(y)


def shard_batch(x, y, mesh):
    return (
        jax.device_put(x, NamedSharding(mesh, P("data", *([None] * (x.ndim - 1))))),
        jax.device_put(y, NamedSharding(mesh, P("data"))),
    )


def quantizers(variant: str):
    """`(weights, activations, matmul)` for `eqx_quant.quantize`."""
    if variant in ("dynamic", "int8-backward"):
        return eqx_quant.DynamicFakeQuant(8, axis=0), eqx_quant.DynamicFakeQuant(8), "int"
    if variant == "per-tensor":
        return eqx_quant.DynamicFakeQuant(8), eqx_quant.DynamicFakeQuant(8), "int"
    if variant == "w4a4":
        return eqx_quant.DynamicFakeQuant(4, axis=0), eqx_quant.DynamicFakeQuant(4), "int"
    if variant == "float-matmul":
        return eqx_quant.DynamicFakeQuant(8, axis=0), eqx_quant.DynamicFakeQuant(8), "float"
    if variant == "learned":
        return (
            lambda path, layer: eqx_quant.LearnedFakeQuant.init_from(layer.weight, 8, axis=0),
            eqx_quant.LearnedFakeQuant(0.05, -128, 127),
            "int",
        )
    if variant == "static":
        return (
            lambda path, layer: eqx_quant.FakeQuant.calibrate(layer.weight, 8, axis=0),
            eqx_quant.FakeQuant(0.05, -128, 127),
            "int",
        )
    raise AssertionError(variant)


def quantized(kind: str, variant: str, mesh=None, row_parallel=ROW_PARALLEL):
    model = float_model(kind)
    if mesh is not None:
        model = shard(model, mesh, row_parallel)
    weights, activations, matmul = quantizers(variant)
    backward = eqx_quant.QuantizedBackward(8) if variant == "int8-backward" else None
    model = eqx_quant.quantize(model, weights=weights, activations=activations, matmul=matmul, backward=backward)
    if mesh is not None:  # the learned input scales, made on one device, are replicated
        model = jax.tree.map(lambda a: replicate(a, mesh) if eqx.is_array(a) else a, model)
    return model


def replicate(a, mesh):
    if isinstance(a.sharding, NamedSharding):
        return a
    return jax.device_put(a, NamedSharding(mesh, P()))


def _loss(model, x, y, explicit):
    logits = jax.vmap(model)(x)
    if explicit:  # with Explicit axes the gather below needs the class axis whole
        logits = jax.sharding.reshard(logits, P("data", None))
    log_probs = jax.nn.log_softmax(logits, axis=-1)
    return -jnp.mean(jnp.take_along_axis(log_probs, y[:, None], axis=-1))


@eqx.filter_jit
def train_step(model, x, y, explicit=False):
    loss, grads = eqx.filter_value_and_grad(_loss)(model, x, y, explicit)
    model = eqx.apply_updates(model, jax.tree.map(lambda g: -0.1 * g, grads))
    return model, loss, grads


@eqx.filter_jit
def forward(model, x):
    return jax.vmap(model)(x)


def arrays(tree):
    return jax.tree.leaves(eqx.filter(tree, eqx.is_array))


def assert_trees_close(actual, expected):
    actual, expected = arrays(actual), arrays(expected)
    assert len(actual) == len(expected)
    for a, e in zip(actual, expected, strict=True):
        a, e = np.asarray(a), np.asarray(e)
        assert a.shape == e.shape and a.dtype == e.dtype
        np.testing.assert_allclose(a, e, rtol=1e-5, atol=1e-6 * max(1.0, float(np.max(np.abs(e), initial=0.0))))


def assert_same_shardings(actual, expected):
    for a, e in zip(arrays(actual), arrays(expected), strict=True):
        assert a.sharding.is_equivalent_to(e.sharding, a.ndim), (a.shape, a.sharding, e.sharding)


@functools.cache
def trained(kind: str, variant: str):
    """One training step on one device and on the mesh: `(single, sharded, sharded model before the step)`."""
    x, y = batch(kind)
    single = train_step(quantized(kind, variant), x, y)
    model = quantized(kind, variant, AUTO)
    sharded = train_step(model, *shard_batch(x, y, AUTO))
    return single, sharded, model


STEP_CASES = [
    ("mlp", "dynamic"),
    ("mlp", "per-tensor"),
    ("mlp", "learned"),
    ("mlp", "static"),
    ("mlp", "w4a4"),
    ("mlp", "float-matmul"),
    ("mlp", "int8-backward"),
    ("convnet", "learned"),  # the convolutions' sharding; the MLP covers the other variants
]


@pytest.mark.parametrize("kind, variant", STEP_CASES)
def test_sharded_step_matches_single_device(kind, variant):
    (model_one, loss_one, grads_one), (model_mesh, loss_mesh, grads_mesh), before = trained(kind, variant)
    np.testing.assert_allclose(float(loss_mesh), float(loss_one), rtol=1e-6)
    assert_trees_close(grads_mesh, grads_one)
    assert_trees_close(model_mesh, model_one)
    # No silent replication: every parameter and gradient keeps the sharding of the parameter it belongs to.
    assert_same_shardings(model_mesh, before)
    assert_same_shardings(grads_mesh, eqx.filter(before, eqx.is_inexact_array))


@pytest.mark.parametrize("kind, variant", [case for case in STEP_CASES if case[1] != "float-matmul"])
def test_sharded_integer_forward_is_bitwise_single_device(kind, variant):
    """Integer accumulation is exact, so splitting a contraction across devices changes no bit of the output."""
    _, _, model_mesh = trained(kind, variant)
    model_one = quantized(kind, variant)
    x, y = batch(kind)
    sx, _ = shard_batch(x, y, AUTO)
    np.testing.assert_array_equal(np.asarray(forward(model_mesh, sx)), np.asarray(forward(model_one, x)))


def test_quantize_keeps_shardings_and_places_learned_scales_with_their_channels():
    float_sharded = shard(float_model("mlp"), AUTO)
    model = quantized("mlp", "learned", AUTO)
    for path, layer in [("layers.0", model.layers[0]), ("layers.1", model.layers[1]), ("layers.2", model.layers[2])]:
        original = float_sharded.layers[int(path[-1])]
        assert layer.layer.weight.sharding.is_equivalent_to(original.weight.sharding, 2)
        assert layer.layer.bias.sharding.is_equivalent_to(original.bias.sharding, 1)
        # One scale per output channel: sharded on `model` where the output channels are, replicated otherwise.
        expected = P() if path in ROW_PARALLEL else P("model")
        scale = layer.weight_quant.scale
        assert scale.sharding.is_equivalent_to(NamedSharding(AUTO, expected), 1), (path, scale.sharding)
        # and equal to the scales computed on one device, up to the summation order of `mean|w|`
        single = eqx_quant.LearnedFakeQuant.init_from(jnp.asarray(np.asarray(original.weight)), 8, axis=0)
        np.testing.assert_allclose(np.asarray(scale), np.asarray(single.scale), rtol=1e-6)


def layers_of(model, types):
    """The nodes of `model` that are instances of `types`, in order."""
    is_layer = lambda n: isinstance(n, types)  # noqa: E731
    return [leaf for leaf in jax.tree.leaves(model, is_leaf=is_layer) if is_layer(leaf)]


@pytest.mark.parametrize("kind, variant", [c for c in STEP_CASES if c[1] in ("dynamic", "static", "w4a4", "learned")])
def test_convert_shards_integers_like_weights(kind, variant):
    (_, _, _), (model_mesh, _, _), _ = trained(kind, variant)
    converted = eqx_quant.convert(model_mesh)
    quant_layers = layers_of(model_mesh, AbstractQuantLayer)
    int_layers = layers_of(converted, IntLinear | IntConv)
    assert len(int_layers) == len(quant_layers) > 0
    for quant, integer in zip(quant_layers, int_layers, strict=True):
        weight = quant.layer.weight
        spec = tuple(weight.sharding.spec) + (None,) * (weight.ndim - len(weight.sharding.spec))
        tensor = integer.qweight
        expected_values = P(*spec)  # packed too: a row's bytes follow its input features (which divide evenly here)
        assert tensor.values.sharding.is_equivalent_to(NamedSharding(AUTO, expected_values), tensor.values.ndim)
        per_channel = tensor.scale.shape[0] > 1
        expected_scale = P(spec[0] if per_channel else None, *([None] * (tensor.scale.ndim - 1)))
        assert tensor.scale.sharding.is_equivalent_to(NamedSharding(AUTO, expected_scale), tensor.scale.ndim)
        if quant.layer.bias is not None:
            assert integer.layer.bias.sharding.is_equivalent_to(quant.layer.bias.sharding, 1)
    # The converted model computes, sharded, what the fake-quantized model computes.
    x, y = batch(kind)
    sx, _ = shard_batch(x, y, AUTO)
    expected = np.asarray(forward(model_mesh, sx))
    np.testing.assert_array_equal(np.asarray(forward(converted, sx)), expected)


def test_dynamic_scales_follow_their_channels():
    w = jax.random.normal(jax.random.key(2), (8, 6))
    params = jax.jit(lambda q, w: q.quantization_params(w), static_argnums=0)
    column = jax.device_put(w, NamedSharding(AUTO, P("model", None)))
    row = jax.device_put(w, NamedSharding(AUTO, P(None, "model")))
    per_channel = eqx_quant.DynamicFakeQuant(8, axis=0)
    expected = np.max(np.abs(np.asarray(w)), axis=1)
    scale, _ = params(per_channel, column)
    assert scale.sharding.is_equivalent_to(NamedSharding(AUTO, P("model")), 1)
    np.testing.assert_array_equal(np.asarray(scale), np.asarray(per_channel.quantization_params(w)[0]))
    # Reduced across the devices that hold a channel's elements: the maximum of the whole row.
    scale, _ = params(per_channel, row)
    np.testing.assert_array_equal(np.asarray(scale), np.asarray(per_channel.quantization_params(w)[0]))
    assert np.all(np.asarray(scale) * 127 >= expected)
    # Per tensor: the maximum over the whole sharded tensor, not over one device's shard.
    per_tensor = eqx_quant.DynamicFakeQuant(8)
    for sharded in (column, row):
        scale, _ = params(per_tensor, sharded)
        assert float(scale) == float(per_tensor.quantization_params(w)[0])
        assert float(scale) * 127 >= np.max(np.abs(np.asarray(w)))


def test_explicit_axes():
    """With Explicit mesh axes the quantized layers train where the float layers do; the loss reshards its logits."""
    x, y = batch("mlp")
    (model_one, loss_one, grads_one), _, _ = trained("mlp", "learned")
    with jax.set_mesh(EXPLICIT):
        model = quantized("mlp", "learned", EXPLICIT, row_parallel=())
        model_mesh, loss_mesh, grads_mesh = train_step(model, *shard_batch(x, y, EXPLICIT), explicit=True)
    np.testing.assert_allclose(float(loss_mesh), float(loss_one), rtol=1e-6)
    assert_trees_close(grads_mesh, grads_one)
    assert_trees_close(model_mesh, model_one)
    assert_same_shardings(model_mesh, model)
    converted = eqx_quant.convert(model_mesh)
    with jax.set_mesh(EXPLICIT):
        sx, _ = shard_batch(x, y, EXPLICIT)
        np.testing.assert_array_equal(np.asarray(forward(converted, sx)), np.asarray(forward(model_mesh, sx)))


@pytest.mark.parametrize("recipe", ["w8a16", "w4a8_g32", "fp8", "nvfp4"])
def test_explicit_axes_with_weight_only_grouped_and_float_format_recipes(recipe):
    """On Explicit axes the recipes whose layers read a weight after their input (weight-only, float formats), whose
    grouped product takes input features sharded by the layer before, or whose codes decode through a table train and
    convert as on Auto axes: the converted model equals the fake-quant one bit for bit, and the integer forward
    (`w4a8_g32`) equals the one-device model's."""
    x, y = batch("mlp")
    one_device = eqx_quant.quantize(float_model("mlp"), **eqx_quant.recipe(recipe))
    with jax.set_mesh(EXPLICIT):
        model = eqx_quant.quantize(shard(float_model("mlp"), EXPLICIT, row_parallel=()), **eqx_quant.recipe(recipe))
        sx, sy = shard_batch(x, y, EXPLICIT)
        trained_model, loss, _ = train_step(model, sx, sy, explicit=True)
        assert np.isfinite(float(loss))
        assert_same_shardings(trained_model, model)
        out = forward(model, sx)
        converted = eqx_quant.convert(model)
        np.testing.assert_array_equal(np.asarray(forward(converted, sx)), np.asarray(out))
    if recipe == "w4a8_g32":
        np.testing.assert_array_equal(np.asarray(out), np.asarray(forward(one_device, x)))


@few_rows
def test_explicit_axes_gptq_awq_and_histograms_on_batches_split_over_data():
    """`gptq`, `awq` and the histograms of `calibrate` sum their statistics (Gram matrices, counts) over
    calibration batches split over an Explicit `data` axis, with column-parallel weights: the results equal the
    one-device run's up to the order of the float sums."""
    x, _ = batch("mlp")
    runs = {
        "gptq": lambda m, b: eqx_quant.gptq(eqx_quant.quantize(m, **eqx_quant.recipe("w4a16_g32")), b),
        "awq": lambda m, b: eqx_quant.awq(eqx_quant.quantize(m, **eqx_quant.recipe("w4a16_g32")), b),
        "mse": lambda m, b: eqx_quant.calibrate(eqx_quant.quantize(m), b, method="mse"),
    }
    one_device = {name: run(float_model("mlp"), [x]) for name, run in runs.items()}
    with jax.set_mesh(EXPLICIT):
        sx = jax.device_put(x, NamedSharding(EXPLICIT, P("data", None)))
        for name, expected in one_device.items():
            result = runs[name](shard(float_model("mlp"), EXPLICIT, row_parallel=()), [sx])
            for got, want in zip(arrays(result), arrays(expected), strict=True):
                np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-6, err_msg=name)


class _TwoProducts(eqx.Module):
    w1: jax.Array
    w2: jax.Array

    def __call__(self, x):
        return jax.nn.gelu(x @ self.w1) @ self.w2


def test_explicit_axes_outside_a_mesh_context():
    """Arrays on Explicit mesh axes need no `jax.set_mesh` around eager calls, as for the float layers: a rotation
    of column-parallel outputs and the grouped integer product of input features sharded by the layer before gather
    them on the arrays' own mesh (before, both named a bare `PartitionSpec`, which JAX refuses outside a mesh
    context), and the quantizers' statistics and NaN tags make no array of another mesh; traced products' tiles
    alike. (An eager gradient needs the mesh context, of the float layers too.)"""
    x, _ = batch("mlp")
    sx = jax.device_put(x, NamedSharding(EXPLICIT, P("data", None)))
    for recipe in ("w8a8", "w4a8_g32", "fp8"):
        rules = eqx_quant.recipe(recipe, group_size=16) if recipe == "w4a8_g32" else eqx_quant.recipe(recipe)
        one_device = eqx_quant.quantize(float_model("mlp"), **rules)
        model = eqx_quant.quantize(shard(float_model("mlp"), EXPLICIT, row_parallel=()), **rules)
        out = forward(model, sx)
        np.testing.assert_array_equal(np.asarray(forward(eqx_quant.convert(model), sx)), np.asarray(out))
        if recipe != "fp8":  # integer products: the one device's bits
            np.testing.assert_array_equal(np.asarray(out), np.asarray(forward(one_device, x)))
    # The same for traced weights: the tiles of a bare product's contraction split over `model` by the one before.
    w1, w2 = jax.random.normal(jax.random.key(1), (64, 128)) / 8, jax.random.normal(jax.random.key(2), (128, 16)) / 11
    bare = _TwoProducts(jax.device_put(w1, NamedSharding(EXPLICIT, P(None, "model"))), w2)
    grouped = eqx_quant.recipe("w4a8_g32", group_size=16)
    want = eqx_quant.quantize(_TwoProducts(w1, w2), **grouped, example=(x,))(x)
    np.testing.assert_array_equal(np.asarray(eqx_quant.quantize(bare, **grouped, example=(sx,))(sx)), np.asarray(want))
    rotated = lambda m, b: eqx_quant.calibrate(eqx_quant.rotate(eqx_quant.quantize(m), key=jax.random.key(0)), b)  # noqa: E731
    want = rotated(float_model("mlp"), [x])
    got = rotated(shard(float_model("mlp"), EXPLICIT, row_parallel=()), [sx])
    np.testing.assert_allclose(np.asarray(forward(got, sx)), np.asarray(forward(want, x)), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("spec", [P(None, "model"), P("data", "model")])
def test_packed_convolution_kernels_split_along_input_channels_convert_bit_for_bit(spec):
    """A convolution's int4 codes, packed two to a byte along its flattened input channels and kernel positions,
    keep a split along the input channels (contiguous runs of bytes): its converted outputs are then the
    fake-quantized ones bit for bit (before, the codes were replicated and the converted convolution summed its
    channels in another order than the fake-quantized one)."""
    conv = eqx.nn.Conv2d(8, 16, 3, key=jax.random.key(0))
    conv = eqx.tree_at(lambda c: c.weight, conv, jax.device_put(conv.weight, NamedSharding(AUTO, spec)))
    x = jax.random.normal(jax.random.key(1), (2, 8, 6, 6))
    quantized = eqx_quant.quantize(conv, weights=eqx_quant.DynamicFakeQuant(4, axis=0), activations=None)
    converted = eqx_quant.convert(quantized)
    assert converted.qweight.values.shape == (16, 36)
    assert tuple(converted.qweight.values.sharding.spec) == tuple(spec)
    run = eqx.filter_jit(forward)
    np.testing.assert_array_equal(np.asarray(run(converted, x)), np.asarray(run(quantized, x)))


def test_arrays_the_algorithms_make_are_on_the_model_mesh(tmp_path):
    """The arrays that calibration, SmoothQuant, rotations, `learn_scales` and `load` make for a sharded model
    (per-layer input scales of a stack, input transforms, learned scales) are on its mesh, replicated where they
    have no axis of a weight: a training step then keeps every array's sharding."""
    x, _ = batch("mlp")
    sx = jax.device_put(x, NamedSharding(AUTO, P("data", None)))
    model = shard(float_model("mlp"), AUTO)
    stacked_float = jax.tree.map(
        lambda a: jax.device_put(a, NamedSharding(AUTO, P(None, "model"))),
        eqx.filter_vmap(lambda k: eqx.nn.Linear(64, 64, key=k))(jax.random.split(jax.random.key(4), 2)),
    )

    class Stack(eqx.Module):
        layers: eqx.nn.Linear

        def __call__(self, h):
            dynamic, static = eqx.partition(self.layers, eqx.is_array)
            return jax.lax.scan(lambda h, d: (eqx.combine(d, static)(h), None), h, dynamic)[0]

    w8a8 = eqx_quant.recipe("w8a8")
    made = {
        "smoothquant": eqx_quant.smoothquant(eqx_quant.quantize(model, **w8a8), [sx]),
        "rotate": eqx_quant.rotate(eqx_quant.quantize(model, **w8a8), key=jax.random.key(0)),
        "calibrate (stacked)": eqx_quant.calibrate(eqx_quant.quantize(Stack(stacked_float), **w8a8), [sx]),
        "learn_scales": eqx_quant.learn_scales(eqx_quant.quantize(model, **w8a8)),
    }
    eqx_quant.save(tmp_path / "m.eqx", eqx_quant.convert(made["smoothquant"]))
    made["load"] = eqx_quant.load(tmp_path / "m.eqx", model)
    for name, result in made.items():
        for leaf in arrays(result):
            assert isinstance(leaf.sharding, NamedSharding) and leaf.sharding.mesh == AUTO, (name, leaf.shape)
    signs = made["rotate"].layers[0].input_transform.signs
    assert signs.sharding.is_equivalent_to(NamedSharding(AUTO, P()), 1)


@pytest.mark.parametrize("recipe", ["w8a16", "w4a16_g32"])
def test_weight_only_tensor_parallel_forward_gathers_no_activation(recipe):
    """A column- then row-parallel MLP with weight-only layers communicates as the float model does: the row-parallel
    layer's partial sums, and no gather of a layer's input (which the CPU's ordering of a dequantized weight after
    its layer's input once took)."""
    model = eqx_quant.quantize(shard(float_model("mlp"), AUTO), **eqx_quant.recipe(recipe))
    x, _ = batch("mlp")
    sx = jax.device_put(x, NamedSharding(AUTO, P("data", None)))
    dynamic, static = eqx.partition(model, eqx.is_array)
    hlo = jax.jit(lambda d, x: jax.vmap(eqx.combine(d, static))(x)).lower(dynamic, sx).compile().as_text()
    assert "all-gather" not in hlo
    np.testing.assert_array_equal(np.asarray(forward(model, sx)), np.asarray(forward(eqx_quant.convert(model), sx)))


class _BareThenLinear(eqx.Module):
    w: jax.Array
    linear: eqx.nn.Linear

    def __call__(self, x):
        return self.linear(jnp.tanh(x @ self.w))


def test_explicit_axes_traced_weights():
    """A traced weight sharded over Explicit axes (a column-parallel bare `x @ w`) is traced with its sharding, as
    the call computes: the integer forward equals the one-device model's bit for bit, it trains, and it converts."""
    k1, k2, k3 = jax.random.split(jax.random.key(5), 3)
    model = _BareThenLinear(jax.random.normal(k1, (16, 32)) / 4, eqx.nn.Linear(32, 8, key=k2))
    x = jax.random.normal(k3, (BATCH, 16))
    w8a8 = eqx_quant.recipe("w8a8")
    one_device = eqx_quant.quantize(model, **w8a8, example=(x[0],))
    with jax.set_mesh(EXPLICIT):
        placed = eqx.tree_at(lambda m: m.w, model, jax.device_put(model.w, NamedSharding(EXPLICIT, P(None, "model"))))
        sx = jax.device_put(x, NamedSharding(EXPLICIT, P("data", None)))
        traced = eqx_quant.quantize(placed, **w8a8, example=(x[0],))
        out = forward(traced, sx)
        grads = eqx.filter_jit(eqx.filter_grad(lambda m, x: jnp.sum(jax.vmap(m)(x) ** 2)))(traced, sx)
        converted = eqx_quant.convert(traced)
        np.testing.assert_array_equal(np.asarray(forward(converted, sx)), np.asarray(out))
    np.testing.assert_array_equal(np.asarray(out), np.asarray(forward(one_device, x)))
    expected = eqx.filter_grad(lambda m, x: jnp.sum(jax.vmap(m)(x) ** 2))(one_device, x)
    assert_trees_close(grads, expected)


def test_explicit_axes_row_parallel_needs_an_output_sharding_like_float():
    """A contraction over an Explicit-sharded axis has no unambiguous output sharding: `eqx.nn.Linear` raises, and
    so does its quantized wrapper, with JAX's own error."""
    x, y = batch("mlp")
    with jax.set_mesh(EXPLICIT):
        batch_8 = shard_batch(x, y, EXPLICIT)
        for model in (shard(float_model("mlp"), EXPLICIT), quantized("mlp", "dynamic", EXPLICIT)):
            with pytest.raises(Exception, match="Contracting dimensions are sharded"):  # JAX's ShardingTypeError
                train_step(model, *batch_8, explicit=True)


@pytest.mark.parametrize("kind", ["mlp", "convnet"])
def test_calibrate_sharded_model_matches_single_device(kind):
    x, _ = batch(kind)
    batches = [x[:8], x[8:]]
    single = eqx_quant.calibrate(quantized(kind, "dynamic"), batches)
    spec = P("data", *([None] * (x.ndim - 1)))
    before = quantized(kind, "dynamic", AUTO)
    sharded = eqx_quant.calibrate(before, [jax.device_put(b, NamedSharding(AUTO, spec)) for b in batches])
    layers = [layers_of(m, AbstractQuantLayer) for m in (sharded, single, before)]
    for a, b, c in zip(*layers, strict=True):
        # The statistics are those of float activations, whose sums depend on the layout: equal up to rounding.
        assert (a.input_quant.qmin, a.input_quant.qmax) == (b.input_quant.qmin, b.input_quant.qmax)
        np.testing.assert_allclose(a.input_quant.scale, b.input_quant.scale, rtol=1e-6)
        # The weights keep their layout, split along the model axis.
        assert a.layer.weight.sharding.spec == c.layer.weight.sharding.spec and "model" in a.layer.weight.sharding.spec


@few_rows
def test_gptq_keeps_the_weights_partitioning():
    """GPTQ's weights keep the shardings of the weights they replace (the row-parallel layer's input features on
    `model`, the others' output channels), and equal the one-device model's up to the Hessians' float sums."""
    x, _ = batch("mlp")
    batches = [x[:8], x[8:]]
    single = eqx_quant.gptq(quantized("mlp", "dynamic"), batches)
    before = quantized("mlp", "dynamic", AUTO)
    solved = eqx_quant.gptq(before, [jax.device_put(b, NamedSharding(AUTO, P("data", None))) for b in batches])
    for a, b, c in zip(*[layers_of(m, AbstractQuantLayer) for m in (solved, single, before)], strict=True):
        assert a.layer.weight.sharding.is_equivalent_to(c.layer.weight.sharding, 2), a.layer.weight.sharding
        np.testing.assert_allclose(a.layer.weight, b.layer.weight, rtol=1e-5, atol=1e-6)


def test_load_gives_arrays_the_shardings_of_like(tmp_path):
    """A converted model saved and loaded into its sharded self, or into the sharded float model it came from: the
    same arrays, sharded as `like`'s (the float weights' partitioning carried into the stored integers)."""
    converted = eqx_quant.convert(quantized("mlp", "dynamic", AUTO))
    path = tmp_path / "model.eqx"
    eqx_quant.save(path, converted)
    for like in (converted, shard(float_model("mlp"), AUTO)):
        loaded = eqx_quant.load(path, like)
        assert "model" in loaded.layers[0].qweight.values.sharding.spec  # sharded, not on one device
        assert_same_shardings(loaded, converted)
        for a, b in zip(arrays(loaded), arrays(converted), strict=True):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    # A traced weight (of `quantize(..., example=)`), loaded into its sharded float model.
    weight = jax.device_put(jnp.linspace(-1.0, 1.0, 64 * 16).reshape(64, 16), NamedSharding(AUTO, P(None, "model")))
    bare = _Bare(weight)
    stored = eqx_quant.convert(eqx_quant.quantize(bare, **eqx_quant.recipe("w8a16"), example=(jnp.ones(64),)))
    eqx_quant.save(tmp_path / "bare.eqx", stored)
    loaded = eqx_quant.load(tmp_path / "bare.eqx", bare)
    assert_same_shardings(loaded, stored)
    assert "model" in loaded.model.w.values.sharding.spec
    # Grouped 4-bit codes and stacked layers: the codes and the scales keep the axes they share with the weight, in
    # the converted model and loaded into the sharded float model.
    grouped = eqx_quant.convert(eqx_quant.quantize(shard(float_model("mlp"), AUTO), **eqx_quant.recipe("w4a16_g32")))
    stacked_float = jax.tree.map(
        lambda a: jax.device_put(a, NamedSharding(AUTO, P(None, "model"))),
        eqx.filter_vmap(lambda k: eqx.nn.Linear(64, 32, key=k))(jax.random.split(jax.random.key(3), 2)),
    )
    stacked = eqx_quant.convert(eqx_quant.quantize(stacked_float, **eqx_quant.recipe("w8a16")))
    for name, model, like, tensor, expected in (
        ("grouped", grouped, shard(float_model("mlp"), AUTO), grouped.layers[0].qweight, P("model")),
        ("stacked", stacked, stacked_float, stacked.qweight, P(None, "model")),
    ):
        assert tensor.values.sharding.is_equivalent_to(NamedSharding(AUTO, expected), tensor.values.ndim), name
        assert tensor.scale.sharding.is_equivalent_to(NamedSharding(AUTO, expected), tensor.scale.ndim), name
        eqx_quant.save(tmp_path / f"{name}.eqx", model)
        loaded = eqx_quant.load(tmp_path / f"{name}.eqx", like)
        assert_same_shardings(loaded, model)
        for a, b in zip(arrays(loaded), arrays(model), strict=True):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


class _Bare(eqx.Module):
    w: jax.Array

    def __call__(self, x):
        return x @ self.w


def test_shard_map_row_parallel_linear_layer_takes_its_shard_of_the_features():
    """Inside `shard_map` a row-parallel quantized layer runs on its weight's shard of the input features, with
    statistics across the shards (`axis_name`): after `psum`, the whole layer's output up to the float sum of the
    rescaled partial sums."""
    mesh = jax.make_mesh((4,), ("model",), axis_types=(AxisType.Auto,))
    linear = eqx.nn.Linear(64, 32, use_bias=False, key=jax.random.key(0))
    x = jnp.asarray(np.random.default_rng(2).standard_normal(64, dtype=np.float32))
    whole = eqx_quant.quantize(linear, weights=eqx_quant.DynamicFakeQuant(8), activations=eqx_quant.DynamicFakeQuant(8))
    split = eqx_quant.quantize(linear, weights=eqx_quant.DynamicFakeQuant(8, axis_name="model"),
                               activations=eqx_quant.DynamicFakeQuant(8, axis_name="model"))  # fmt: skip

    def row(w, xs):
        return jax.lax.psum(eqx.tree_at(lambda m: m.layer.weight, split, w)(xs), "model")

    y = jax.jit(jax.shard_map(row, mesh=mesh, in_specs=(P(None, "model"), P("model")), out_specs=P()))(linear.weight, x)
    np.testing.assert_allclose(np.asarray(y), np.asarray(whole(x)), rtol=1e-6, atol=1e-6)


def test_shard_map_per_tensor_statistics_with_axis_name():
    """Inside `shard_map` a quantizer sees one shard; `axis_name` makes its statistics those of the whole tensor."""
    whole_w = jnp.concatenate([jnp.full((4, 3), 0.5), jnp.full((4, 3), 2.0)]).at[0, 0].set(-0.3)
    w = jax.device_put(whole_w, NamedSharding(AUTO, P("model", None)))

    def on_shards(quantizer):
        fn = jax.shard_map(quantizer, mesh=AUTO, in_specs=P("model", None), out_specs=P("model", None))
        return np.asarray(jax.jit(fn)(w))

    whole = np.asarray(eqx_quant.DynamicFakeQuant(4)(whole_w))
    np.testing.assert_array_equal(on_shards(eqx_quant.DynamicFakeQuant(4, axis_name="model")), whole)
    # Without it each shard has its own scale: the first half (max 0.5) is quantized on a finer grid.
    local = on_shards(eqx_quant.DynamicFakeQuant(4))
    assert not np.array_equal(local, whole)
    np.testing.assert_array_equal(local[:4], np.asarray(eqx_quant.DynamicFakeQuant(4)(whole_w[:4])))
    # A name the `shard_map` does not bind (a typo) is an error naming it; JAX's `pmax` fails an empty assertion there.
    with pytest.raises(ValueError, match="`axis_name`='modle' names an axis that is not bound here"):
        on_shards(eqx_quant.DynamicFakeQuant(4, axis_name="modle"))


def test_shard_map_learned_scale_gradient_with_axis_name():
    w = jax.random.normal(jax.random.key(3), (8, 4))
    target = jax.random.normal(jax.random.key(4), (8, 4))

    def loss(q, w, target):
        return jnp.sum((q(w) - target) ** 2)

    q = eqx_quant.LearnedFakeQuant(0.3, -8, 7)
    expected = jax.grad(loss)(q, w, target).scale

    def sharded_loss(q, w, target):
        return jax.lax.psum(loss(q, w, target), "model")

    q_named = eqx_quant.LearnedFakeQuant(0.3, -8, 7, axis_name="model")
    fn = jax.shard_map(
        jax.grad(sharded_loss), mesh=AUTO, in_specs=(P(), P("model", None), P("model", None)), out_specs=P()
    )
    grad = jax.jit(fn)(q_named, w, target).scale
    np.testing.assert_allclose(np.asarray(grad), np.asarray(expected), rtol=1e-5)


def test_shard_map_quantized_backward_matches_one_device():
    """Data parallel inside `shard_map`: each device runs the quantized backward on its examples; the input's gradient
    is per example, so it matches one device bit for bit, and the weight's gradient is summed across devices."""
    linear = eqx.nn.Linear(8, 6, key=jax.random.key(5))
    quantizers = dict(weights=eqx_quant.DynamicFakeQuant(8, axis=0), activations=eqx_quant.DynamicFakeQuant(8))
    q = eqx_quant.quantize(linear, **quantizers, backward=eqx_quant.QuantizedBackward(8))
    x = jax.random.normal(jax.random.key(6), (BATCH, 8))
    cotangent = jax.random.normal(jax.random.key(7), (BATCH, 6))

    def loss(q, x, cotangent):
        return jnp.sum(jax.vmap(q)(x) * cotangent)

    grad_q, grad_x = jax.jit(jax.grad(loss, argnums=(0, 1)))(q, x, cotangent)

    def sharded_loss(q, x, cotangent):
        return jax.lax.psum(loss(q, x, cotangent), "data")

    fn = jax.shard_map(
        jax.grad(sharded_loss, argnums=(0, 1)),
        mesh=AUTO,
        in_specs=(P(), P("data", None), P("data", None)),
        out_specs=(P(), P("data", None)),
    )
    sharded_q, sharded_x = jax.jit(fn)(q, x, cotangent)
    np.testing.assert_array_equal(np.asarray(sharded_x), np.asarray(grad_x))
    assert_trees_close(sharded_q, grad_q)
    # The input's gradient is the quantized backward's, not the float one's.
    float_q = eqx_quant.quantize(linear, **quantizers)
    float_grad_x = jax.jit(jax.grad(loss, argnums=1))(float_q, x, cotangent)
    assert not np.array_equal(np.asarray(float_grad_x), np.asarray(grad_x))
