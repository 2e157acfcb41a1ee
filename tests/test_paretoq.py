"""ParetoQ's low-bit weights: the stretched grids, the ternary and stretched 2-bit initialisation, their recipes,
2-bit storage, and quantization-aware training on them."""

import json
import struct
from fractions import Fraction

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import eqx_quant
from eqx_quant import DynamicFakeQuant, LearnedFakeQuant

from .helpers import assert_bitwise_equal, few_rows, init, np_absmax_scale


F32 = np.float32


def np_stretched_levels(v, bits):
    """The grid point of `v` on the stretched grid of `bits` bits, by its definition: the nearest of the half-integers
    `q + 1/2`, `q` in `[-2**(bits-1), 2**(bits-1) - 1]`, a tie going to the even `q`, saturating; NaN stays NaN."""
    qmin, qmax = -(2 ** (bits - 1)), 2 ** (bits - 1) - 1
    v = np.asarray(v, np.float64)
    out = np.full(v.shape, np.nan)
    for i, value in np.ndenumerate(v):
        if np.isnan(value):
            continue
        value = Fraction(float(np.clip(value, qmin - 1, qmax + 1)))  # exact distances; infinities saturate
        distances = {q: abs(Fraction(2 * q + 1, 2) - value) for q in range(qmin, qmax + 1)}
        best = [q for q, d in distances.items() if d == min(distances.values())]
        out[i] = (best[0] if len(best) == 1 else next(q for q in best if q % 2 == 0)) + 0.5
    return out


def ternary_and_ties(rng, n):
    """Normal data, plus every tie and end of the 2-bit grid at scale 1 and the non-finite values."""
    specials = [0.0, -0.0, 1.0, -1.0, 2.0, -2.0, 0.5, -0.5, 1.5, -1.5, 7.0, -7.0, 1e-30, -1e-30, np.inf, -np.inf]
    return np.concatenate([rng.normal(size=n) * 1.2, specials, [np.nan]]).astype(F32)


@pytest.mark.parametrize("bits", [1, 2, 3])
def test_stretched_grid_against_its_definition(bits):
    fmt = eqx_quant.stretched_format(bits)
    x = ternary_and_ties(np.random.default_rng(bits), 200)
    scale = F32(0.5)  # a power of two: `x / scale` is exact, so the ties stay ties
    want = (scale * np_stretched_levels(x / scale, bits)).astype(F32)
    got = eqx_quant.fake_quant_format(jnp.asarray(x), scale, fmt)
    assert_bitwise_equal(got, want)
    assert_bitwise_equal(jax.jit(lambda x: eqx_quant.fake_quant_format(x, scale, fmt))(jnp.asarray(x)), want)
    row = jax.vmap(lambda x: eqx_quant.fake_quant_format(x, scale, fmt))(jnp.asarray(x).reshape(-1, 1))
    assert_bitwise_equal(row.reshape(-1), want)
    assert fmt.bound == 2 ** (bits - 1) - 0.5 and fmt.qmin == -(2 ** (bits - 1)) and fmt.bits == bits


def test_stretched_grid_with_a_scale_whose_quotients_are_rounded():
    """A scale that is not a power of two: the quotient `x * (1 / scale)` is rounded, eagerly and under `jit` alike."""
    fmt = eqx_quant.stretched_format(2)
    x = jnp.asarray(np.random.default_rng(7).normal(size=(64, 33)).astype(F32))
    scale = jnp.asarray(np.random.default_rng(8).uniform(0.3, 0.9, size=(64, 1)).astype(F32))
    v = np.asarray(x) * (F32(1) / np.asarray(scale))
    want = (np.asarray(scale) * np_stretched_levels(v, 2)).astype(F32)
    eager = eqx_quant.fake_quant_format(x, scale, fmt)
    assert_bitwise_equal(eager, want)
    assert_bitwise_equal(jax.jit(eqx_quant.fake_quant_format, static_argnums=2)(x, scale, fmt), want)


@pytest.mark.parametrize(
    "name, ends", [("int2_stretched", (-1.5, 1.5)), ("int2_narrow_wide", (-1.0, 1.0)), ("int3_stretched", (-3.5, 3.5))]
)
def test_paretoq_grids_pass_gradients_wherever_rounding_does_not_saturate(name, ends):
    """The window of ParetoQ's grids reaches half a step beyond the outermost levels: the input's gradient passes
    there, and the scale's learned-step-size slope is `level - v` there and the end level beyond."""
    fmt = eqx_quant.format_named(name)
    low, high = ends[0] - 0.5, ends[1] + 0.5
    v = np.array([low - 0.25, low, low + 0.25, -0.3, 0.0, 0.7, ends[1], ends[1] + 0.25, high, high + 0.01, np.nan], F32)
    c = np.arange(1, v.size + 1, dtype=F32)
    loss = lambda x, s: jnp.nansum(jnp.asarray(c) * eqx_quant.fake_quant_format(x, s, fmt))  # noqa: E731
    gx, gs = jax.jit(jax.grad(loss, argnums=(0, 1)))(jnp.asarray(v), jnp.asarray(F32(1.0)))
    inside = (v >= low) & (v <= high)
    np.testing.assert_array_equal(np.asarray(gx), np.where(inside, c, 0.0))
    levels = np.asarray(eqx_quant.fake_quant_format(jnp.asarray(v), 1.0, fmt), np.float64)
    slope = np.where(inside, levels - v, np.where(v < 0, ends[0], ends[1]))
    np.testing.assert_allclose(float(gs), np.sum(np.where(np.isnan(v), 0.0, c * slope)), rtol=1e-6)
    if name.endswith("_wide"):  # the same grid and values as the integers, with another window
        plain = eqx_quant.format_named(name.removesuffix("_wide"))
        assert_bitwise_equal(eqx_quant.fake_quant_format(jnp.asarray(v), 1.0, plain), levels.astype(F32))
        assert not fmt.zero_points and fmt.window == "rounding"
        with pytest.raises(ValueError, match="needs a zero point"):
            DynamicFakeQuant(fmt, symmetric=False)


def test_wide_window_format_checks_and_names():
    with pytest.raises(ValueError, match="`window` must be 'levels' or 'rounding', got window='all'"):
        eqx_quant.IntFormat(-1, 1, window="all")
    with pytest.raises(ValueError, match="`window`='rounding' takes float32 scales"):
        eqx_quant.IntFormat(-127, 127, scale="e8m0", scale_rule="floor", window="rounding")
    with pytest.raises(ValueError, match="`format`='int0_wide' names no integer grid"):
        eqx_quant.format_named("int0_wide")
    assert eqx_quant.format_named("uint4_wide") == eqx_quant.IntFormat(0, 15, window="rounding")
    assert eqx_quant.LayerQuantizer("int2_stretched", learned=True, method="paretoq").format.name == "int2_stretched"
    with pytest.raises(ValueError, match="the recipe 'ternary' trains its scales"):
        eqx_quant.recipe("ternary", backward=eqx_quant.UnquantizedBackward())


def test_stretched_dynamic_scale_storage_and_conversion(tmp_path):
    fmt = eqx_quant.format_named("int2_stretched")
    w = jnp.asarray(np.random.default_rng(3).normal(size=(8, 64)).astype(F32))
    q = DynamicFakeQuant(fmt, axis=0)
    scale = np_absmax_scale(np.abs(np.asarray(w)).max(1, keepdims=True), 1.5)  # the top level at max|w|
    want = (scale * np_stretched_levels(np.asarray(w) * (F32(1) / scale), 2)).astype(F32)
    assert_bitwise_equal(q(w), want)
    array = q.quantize_array(w)
    assert array.packed_bits == 2 and array.values.dtype == jnp.uint8 and array.values.shape == (8, 16)
    codes = np.asarray(array.unpacked())
    np.testing.assert_array_equal(codes, np.floor(want / scale).astype(np.int8))
    assert codes.min() == -2 and codes.max() == 1
    assert_bitwise_equal(array.dequantize(), want)
    assert_bitwise_equal(array.levels(), np_stretched_levels(np.asarray(w) * (F32(1) / scale), 2).astype(F32))
    # The file written for a converted layer: the codes, packed four to a byte, and level = code + 1/2.
    linear = eqx.tree_at(lambda l: l.weight, eqx.nn.Linear(64, 8, key=jax.random.key(0)), w)
    real = eqx_quant.convert(eqx_quant.nn.QuantLinear(linear, weight_quant=q, input_quant=None))
    path = tmp_path / "w.safetensors"
    eqx_quant.export_safetensors(path, real)
    header = json.loads(path.read_bytes()[8 : 8 + struct.unpack("<Q", path.read_bytes()[:8])[0]])
    meta = json.loads(header["__metadata__"]["layer"])
    assert (meta["format"], meta["qmin"], meta["qmax"], meta["packed_bits"], meta["level_offset"]) == (
        "int2_stretched",
        -2,
        1,
        2,
        0.5,
    )
    stored = eqx_quant.unpack_bits(jnp.asarray(np.asarray(array.values)), 64, 2, signed=True)
    np.testing.assert_array_equal(np.asarray(stored), codes)


def test_paretoq_initialisation_against_numpy():
    rng = np.random.default_rng(11)
    w = rng.normal(size=(6, 64)).astype(F32)
    for fmt, divisor in ((eqx_quant.int_format(2, narrow=True), 1.5), (eqx_quant.stretched_format(2), 2.0),
                         (eqx_quant.stretched_format(3), 4.0)):  # fmt: skip
        per_row = LearnedFakeQuant.init_from(jnp.asarray(w), fmt, axis=0, method="paretoq")
        np.testing.assert_allclose(np.asarray(per_row.scale), np.abs(w).max(1) / divisor, rtol=1e-7)
        grouped = LearnedFakeQuant.init_from(jnp.asarray(w), fmt, group_size=32, method="paretoq")
        want = np.abs(w.reshape(6, 2, 32)).max(-1) / divisor
        np.testing.assert_allclose(np.asarray(grouped.scale), want, rtol=1e-7)
    lsq = LearnedFakeQuant.init_from(jnp.asarray(w), "int2_stretched", axis=0, method="lsq")  # qmax: the top level
    np.testing.assert_allclose(np.asarray(lsq.scale), 2 * np.abs(w).mean(1) / np.sqrt(1.5), rtol=1e-6)
    stacked = LearnedFakeQuant.init_from(jnp.asarray(w.reshape(2, 3, 64)), "int2_stretched", axis=0, stacked=1,
                                         method="paretoq")  # fmt: skip
    np.testing.assert_allclose(np.asarray(stacked.scale), np.abs(w).max(1).reshape(2, 3) / 2.0, rtol=1e-7)
    # Ternary at that scale: levels at two thirds of the largest magnitude, zero below a third of it.
    q = LearnedFakeQuant.init_from(jnp.asarray(w), eqx_quant.int_format(2, narrow=True), axis=0, method="paretoq")
    out, top = np.asarray(q(jnp.asarray(w))), np.abs(w).max(1, keepdims=True)
    np.testing.assert_allclose(np.abs(out).max(1, keepdims=True), top / 1.5, rtol=1e-6)
    assert np.all(out[np.abs(w) < top / 3 * 0.999] == 0) and np.all(out[np.abs(w) > top / 3 * 1.001] != 0)


def test_paretoq_initialisation_refuses_other_grids():
    w = jnp.ones((4, 32))
    with pytest.raises(ValueError, match="`method`='paretoq' is the rule of the ternary grid"):
        LearnedFakeQuant.init_from(w, 4, axis=0, method="paretoq")
    with pytest.raises(ValueError, match="needs `symmetric`=True"):
        LearnedFakeQuant.init_from(w, eqx_quant.int_format(2, narrow=True), axis=0, method="paretoq", symmetric=False)
    with pytest.raises(ValueError, match="int2_stretched does not have"):  # no zero point on a stretched grid
        LearnedFakeQuant.init_from(w, "int2_stretched", axis=0, method="paretoq", symmetric=False)
    with pytest.raises(ValueError, match="needs learned=True and such a grid"):
        eqx_quant.LayerQuantizer(eqx_quant.stretched_format(2), method="paretoq")
    with pytest.raises(ValueError, match="needs learned=True and such a grid"):
        eqx_quant.LayerQuantizer(eqx_quant.int_format(4), learned=True, method="paretoq")
    with pytest.raises(ValueError, match=r"`bits` must be an int in \[1, 8\], got bits=9"):
        eqx_quant.stretched_format(9)
    with pytest.raises(ValueError, match=r"`format`='int0_stretched' names no stretched grid: `bits` must be"):
        eqx_quant.format_named("int0_stretched")


MLP = init(lambda k: eqx.nn.MLP(64, 8, 64, 2, key=k), 21)
X = jnp.asarray(np.random.default_rng(22).normal(size=(16, 64)).astype(F32))
Y = jnp.asarray(np.random.default_rng(23).normal(size=(16, 8)).astype(F32))


def _loss(model, x, y):
    return jnp.mean((jax.vmap(model)(x) - y) ** 2)


_run = eqx.filter_jit(lambda m, x: jax.vmap(m)(x))


@eqx.filter_jit
def _sgd_step(model, x, y):
    loss, grads = eqx.filter_value_and_grad(_loss)(model, x, y)
    return eqx.apply_updates(model, jax.tree.map(lambda g: -0.05 * g, grads)), loss


@pytest.mark.parametrize("name, divisor", [("ternary", 1.5), ("w2a16_stretched", 2.0)])
@pytest.mark.slow
def test_paretoq_recipes_train_convert_and_store_at_two_bits(name, divisor, tmp_path):
    for learned in (False, True):  # learned scales whatever `learned` says
        model = eqx_quant.quantize(MLP, **eqx_quant.recipe(name, learned=learned))
        for layer, float_layer in zip(model.layers, MLP.layers, strict=True):
            q = layer.weight_quant
            assert type(q) is LearnedFakeQuant and q.format.bits == 2 and q.layout.axes == (0,)
            np.testing.assert_allclose(q.scale, np.abs(np.asarray(float_layer.weight)).max(1) / divisor, rtol=1e-7)
            assert layer.input_quant is None
    losses = []
    for _ in range(5):
        model, loss = _sgd_step(model, X, Y)
        losses.append(float(loss))
    assert losses[-1] < losses[0]
    assert not np.array_equal(model.layers[0].weight_quant.scale, MLP.layers[0].weight)  # the scales moved
    real = eqx_quant.convert(model)
    for layer in real.layers:
        assert layer.qweight.packed_bits == 2 and layer.qweight.values.dtype == jnp.uint8
    assert_bitwise_equal(_run(real, X), _run(model, X))
    eqx_quant.save(tmp_path / "m.eqx", real)
    loaded = eqx_quant.load(tmp_path / "m.eqx", eqx_quant.convert(eqx_quant.quantize(MLP, **eqx_quant.recipe(name))))
    assert_bitwise_equal(_run(loaded, X), _run(model, X))
    weights = sum(layer.qweight.values.size for layer in real.layers)
    assert weights * 4 == sum(layer.weight.size for layer in MLP.layers)  # four weights to a byte


@pytest.mark.slow
@few_rows
def test_gptq_and_learn_scales_on_the_stretched_grid():
    model = eqx_quant.quantize(MLP, weights=DynamicFakeQuant("int2_stretched", axis=0), activations=None)
    ptq = eqx_quant.gptq(model, [X])
    for layer in ptq.layers:
        w, scale = np.asarray(layer.layer.weight), np.asarray(layer.weight_quant.scale, F32).reshape(-1, 1)
        codes = w / scale - 0.5
        np.testing.assert_allclose(codes, np.round(codes), atol=1e-5)  # GPTQ's weights lie on the grid
        assert codes.min() > -2.01 and codes.max() < 1.01
    assert_bitwise_equal(_run(eqx_quant.convert(ptq), X), _run(ptq, X))
    learned = eqx_quant.learn_scales(ptq)
    assert all(type(layer.weight_quant) is LearnedFakeQuant for layer in learned.layers)
    assert_bitwise_equal(_run(learned, X), _run(ptq, X))
