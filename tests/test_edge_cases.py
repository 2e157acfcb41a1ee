"""Zero, tiny, huge, NaN and infinite data, degenerate grids and malformed arguments: each with a defined result.

The contract these tests hold is stated on the Edge cases page of the documentation (`docs/concepts/edge-cases.md`).
Expected values come from NumPy or from the float Equinox layers, never from the library under test.
"""

import pathlib
import re
import subprocess
import sys

import equinox as eqx
import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings

import eqx_quant

from .helpers import assert_bitwise_equal, few_rows, slow_unless


ROOT = pathlib.Path(__file__).resolve().parent.parent
F32 = np.float32
TINY = F32(np.finfo(np.float32).tiny)


@eqx.filter_jit
def jitted(model, x):
    return model(x)


def linear(seed: int = 0, in_features: int = 6, out_features: int = 3) -> eqx.nn.Linear:
    layer = eqx.nn.Linear(in_features, out_features, key=jax.random.key(seed))
    # A bias far from zero, so that "the output is the bias" is a real check.
    return eqx.tree_at(lambda l: l.bias, layer, jnp.array([-0.75, 0.5, 2.0][:out_features], jnp.float32))


def conv(groups: int = 1, stride: int = 1) -> eqx.nn.Conv2d:
    return eqx.nn.Conv2d(4, 4, 3, stride=stride, padding=1, groups=groups, key=jax.random.key(1))


def all_paths(float_layer, x, **quantize_kwargs):
    """The outputs of a quantized layer (integer forward, eager and jit), of its converted layer (eager and jit) and
    of the float-product forward, for the input `x`."""
    fake = eqx_quant.quantize(float_layer, **quantize_kwargs)
    real = eqx_quant.convert(fake)
    floaty = eqx_quant.quantize(float_layer, matmul="float", **quantize_kwargs)
    return {
        "fake": fake(x),
        "fake_jit": jitted(fake, x),
        "converted": real(x),
        "converted_jit": jitted(real, x),
        "float_product": floaty(x),
    }


def same_bits_or_both_nan(a, b):
    """Equal bit patterns where both are numbers (sign of zero aside), NaN at the same places."""
    a, b = np.asarray(a), np.asarray(b)
    np.testing.assert_array_equal(np.isnan(a), np.isnan(b))
    assert_bitwise_equal(np.where(np.isnan(a), 0, a), np.where(np.isnan(b), 0, b))


# ---------------------------------------------------------------------------------------------------------------------
# Zero and tiny inputs through the integer forward.


@pytest.mark.slow
def test_zero_input_gives_the_bias_on_every_path():
    layer = linear()
    for name, y in all_paths(layer, jnp.zeros(6)).items():
        np.testing.assert_array_equal(np.asarray(y), np.asarray(layer.bias), err_msg=name)
    c = conv()
    x = jnp.zeros((4, 5, 5))
    expected = np.broadcast_to(np.asarray(c.bias), (4, 5, 5))
    for name, y in all_paths(c, x).items():
        np.testing.assert_array_equal(np.asarray(y), expected, err_msg=name)


def test_zero_input_without_bias_gives_zeros():
    layer = eqx.nn.Linear(6, 3, use_bias=False, key=jax.random.key(0))
    for name, y in all_paths(layer, jnp.zeros(6)).items():
        np.testing.assert_array_equal(np.asarray(y), np.zeros(3, F32), err_msg=name)


def test_layer_calibrated_on_zeros_stays_finite():
    # A dead ReLU: the calibration data are all zero, so the input scale is the smallest normal float32. Every later
    # input then lands on qmax * tiny (about 1.5e-36), and the float result is the bias up to far below its last bit.
    layer = linear()
    fake = eqx_quant.calibrate(eqx_quant.quantize(layer), [jnp.zeros((4, 6))])
    assert fake.input_quant.scale == float(TINY)
    real = eqx_quant.convert(fake)
    x = jnp.linspace(-1.0, 1.0, 6)
    for y in (fake(x), jitted(fake, x), real(x), jitted(real, x)):
        np.testing.assert_array_equal(np.asarray(y), np.asarray(layer.bias))


@pytest.mark.parametrize("magnitude", [1e-30, 1e-36])
def test_tiny_inputs_give_the_float_result(magnitude):
    layer = linear()
    x = jnp.asarray(np.linspace(-1.0, 1.0, 6, dtype=F32) * F32(magnitude))
    # Reference in float64 from NumPy: per-channel weight and per-tensor input quantization, then the product.
    w = np.asarray(layer.weight, np.float64)
    w_scale = np.abs(w).max(axis=1, keepdims=True) / 127
    w_q = np.clip(np.round(w / w_scale), -128, 127) * w_scale
    x64 = np.asarray(x, np.float64)
    x_scale = np.abs(x64).max() / 127
    x_q = np.clip(np.round(x64 / x_scale), -128, 127) * x_scale
    expected = w_q @ x_q + np.asarray(layer.bias, np.float64)
    outputs = all_paths(layer, x)
    for name, y in outputs.items():
        assert np.all(np.isfinite(y)), name
        np.testing.assert_allclose(np.asarray(y, np.float64), expected, rtol=1e-6, err_msg=name)
    for name in ("fake_jit", "converted", "converted_jit"):
        assert_bitwise_equal(outputs[name], outputs["fake"])


# ---------------------------------------------------------------------------------------------------------------------
# NaN and infinity through the integer forward.


def test_nan_input_makes_every_linear_output_nan():
    layer = linear()
    x = jnp.array([0.5, jnp.nan, -1.0, 2.0, 0.0, 1.0])
    reference = np.asarray(layer(x))  # Equinox's float layer: NaN spreads to every output
    assert np.isnan(reference).all()
    for name, y in all_paths(layer, x).items():
        assert np.isnan(np.asarray(y)).all(), name


@pytest.mark.parametrize("groups, stride", [(1, 1), (2, 2), (4, 1)])
@pytest.mark.slow
def test_nan_input_makes_nan_the_conv_outputs_whose_window_covers_it(groups, stride):
    c = conv(groups, stride)
    x = np.array(jax.random.normal(jax.random.key(2), (4, 6, 6)))
    x[1, 0, 3] = np.nan  # channel 1: group 0 of two, group 1 of four
    x[3, 5, 5] = np.nan
    x = jnp.asarray(x)
    expected_nan = np.isnan(np.asarray(c(x)))  # where Equinox's float convolution is NaN
    assert expected_nan.any() and not expected_nan.all()
    outputs = all_paths(c, x)
    for name, y in outputs.items():
        np.testing.assert_array_equal(np.isnan(np.asarray(y)), expected_nan, err_msg=name)
    for name in ("fake_jit", "converted", "converted_jit"):
        same_bits_or_both_nan(outputs[name], outputs["fake"])


@pytest.mark.slow
def test_nan_weight_makes_its_output_channel_nan_in_training():
    layer = linear()
    weight = np.asarray(layer.weight).copy()
    weight[1, 4] = np.nan
    layer = eqx.tree_at(lambda l: l.weight, layer, jnp.asarray(weight))
    expected_nan = np.isnan(np.asarray(layer(jnp.ones(6))))
    np.testing.assert_array_equal(expected_nan, [False, True, False])
    for matmul in ("int", "float"):
        fake = eqx_quant.quantize(layer, matmul=matmul)
        for y in (fake(jnp.ones(6)), jitted(fake, jnp.ones(6))):
            np.testing.assert_array_equal(np.isnan(np.asarray(y)), expected_nan)
    c = conv()
    weight = np.asarray(c.weight).copy()
    weight[2, 0, 1, 1] = np.nan
    c = eqx.tree_at(lambda l: l.weight, c, jnp.asarray(weight))
    x = jnp.ones((4, 5, 5))
    expected_nan = np.isnan(np.asarray(c(x)))
    assert expected_nan[2].all() and not expected_nan[[0, 1, 3]].any()
    np.testing.assert_array_equal(np.isnan(np.asarray(eqx_quant.quantize(c)(x))), expected_nan)


def test_convert_refuses_a_nan_weight_naming_the_layer():
    mlp = eqx.nn.MLP(3, 2, 4, 1, key=jax.random.key(0))
    mlp = eqx.tree_at(lambda m: m.layers[1].weight, mlp, mlp.layers[1].weight.at[0, 2].set(jnp.nan))
    with pytest.raises(ValueError, match=r"'layers\.1'.*NaN.*\(0, 2\)"):
        eqx_quant.convert(eqx_quant.quantize(mlp))


def test_convert_stores_an_infinite_weight_entry():
    """An infinite weight entry saturates on an integer grid; in a block format its block's scale is NaN, stored as
    such, so the converted block reads back NaN where the fake-quant one is, and the other blocks are untouched."""
    linear = eqx.nn.Linear(64, 2, key=jax.random.key(0))
    linear = eqx.tree_at(lambda l: l.weight, linear, linear.weight.at[1, 40].set(jnp.inf))
    for name, block in (("w8a16", None), ("mxfp4", 32), ("nvfp4", 16), ("q4_0", 32)):
        quantized = eqx_quant.quantize(linear, **eqx_quant.recipe(name))
        fake = quantized.weight_quant(linear.weight)
        stored = eqx_quant.convert(quantized).qweight.dequantize()
        assert_bitwise_equal(stored, fake)
        nan = np.isnan(np.asarray(fake))
        if block is None:
            assert not nan.any() and np.isfinite(np.asarray(fake)).all()
        else:  # exactly the block holding the entry
            expected = np.zeros_like(nan)
            expected[1, 40 // block * block : (40 // block + 1) * block] = True
            np.testing.assert_array_equal(nan, expected)


def test_convert_under_jit_stores_a_nan_weight_as_level_zero():
    """Under `jax.jit` the weight cannot be inspected: the NaN entry is stored as level 0 (XLA's NaN-to-integer
    conversion), so the converted outputs are finite where the quantized model's are NaN (documented)."""
    mlp = eqx.nn.MLP(3, 2, 4, 1, key=jax.random.key(0))
    mlp = eqx.tree_at(lambda m: m.layers[1].weight, mlp, mlp.layers[1].weight.at[0, 2].set(jnp.nan))
    quantized = eqx_quant.quantize(mlp, **eqx_quant.recipe("w8a16"))
    converted = eqx.filter_jit(eqx_quant.convert)(quantized)
    levels = np.asarray(converted.layers[1].qweight.values)
    assert levels[0, 2] == 0
    x = jnp.ones(3)
    assert np.isnan(np.asarray(quantized(x))[0]) and np.all(np.isfinite(np.asarray(converted(x))))
    layer = quantized.layers[1].layer
    nan_free = eqx.tree_at(lambda m: m.layers[1].layer.weight, quantized, jnp.nan_to_num(layer.weight))
    assert_bitwise_equal(converted(x), eqx_quant.convert(nan_free)(x))


def test_infinite_inputs_saturate_like_the_float_product():
    # fake_quant maps +inf to qmax * scale and -inf to qmin * scale (the scale ignores them), on every path.
    layer = linear()
    x = jnp.array([jnp.inf, -jnp.inf, 0.5, -0.25, 1.0, 0.0])
    outputs = all_paths(layer, x)
    for name, y in outputs.items():
        assert np.all(np.isfinite(np.asarray(y))), name
    np.testing.assert_allclose(outputs["fake"], outputs["float_product"], rtol=1e-5)
    for name in ("fake_jit", "converted", "converted_jit"):
        assert_bitwise_equal(outputs[name], outputs["fake"])


def test_an_infinite_or_nan_learned_scale_makes_every_output_nan():
    x = jnp.array([0.0, 1.0, -3.0, 1e30])
    for bad in (jnp.inf, jnp.nan):
        q = eqx.tree_at(lambda q: q.scale, eqx_quant.LearnedFakeQuant(0.5, -8, 7), jnp.float32(bad))
        for y in (q(x), eqx.filter_jit(lambda q, x: q(x))(q, x)):
            assert np.all(np.isnan(np.asarray(y))), (bad, y)


def test_nan_gradient_at_a_nan_entry_does_not_reach_the_learned_scale():
    q = eqx_quant.LearnedFakeQuant(0.5, -8, 7)
    x = jnp.array([np.nan, 0.7, 9.0, -1.3])
    cotangent = jnp.array([np.nan, 1.0, 2.0, -1.0])  # a NaN arrives exactly where x is NaN
    grads = jax.grad(lambda q: jnp.sum(cotangent * q(x)))(q)
    # LSQ by hand on the finite entries, v = x / 0.5: 1.4 -> round(v) - v = -0.4; 18 -> above, qmax = 7;
    # -2.6 -> round(v) - v = -0.4; times the LSQ gradient scale 1 / sqrt(4 * 7).
    expected = (1.0 * -0.4 + 2.0 * 7 + -1.0 * -0.4) / np.sqrt(4 * 7)
    np.testing.assert_allclose(float(grads.scale), expected, rtol=1e-6)


# ---------------------------------------------------------------------------------------------------------------------
# Extreme data on narrow grids.


@pytest.mark.parametrize("bits", [2, 3])
def test_huge_data_on_narrow_grids_saturates_at_the_largest_usable_scale(bits):
    x = jnp.array([3e38, -1e38, 9e37, 1.0, 0.0, -np.inf], jnp.float32)
    qmin, qmax = eqx_quant.int_range(bits)
    # max|x| / qmax exceeds 2**126, whose reciprocal is the last normal float32: the scale stops there, or (3 bits)
    # one ulp below it, so that the level -4 times the scale is still finite (4 * 2**126 = 2**128 overflows).
    scale = np.float64(2.0**126) if bits == 2 else np.float64(np.nextafter(F32(2.0**126), F32(0)))
    finite = np.asarray(x, np.float64)
    expected = (np.clip(np.round(finite / scale), qmin, qmax) * scale).astype(F32)
    q = eqx_quant.DynamicFakeQuant(bits)
    for y in (q(x), jax.jit(q)(x)):
        np.testing.assert_array_equal(np.asarray(y), expected)
    calibrated = eqx_quant.FakeQuant.calibrate(x, bits)
    assert calibrated.scale == scale
    assert np.all(np.isfinite(expected))
    np.testing.assert_array_equal(np.asarray(calibrated(x)), expected)
    asymmetric = eqx_quant.FakeQuant.calibrate(x, bits, method="minmax")
    assert np.isfinite(asymmetric.scale) and asymmetric.scale <= 2.0**126
    assert np.all(np.isfinite(np.asarray(asymmetric(x))))


def test_calibrate_on_a_grid_without_positive_levels():
    # The grid [-8, 0] has no positive level: a symmetric scale maps the largest magnitude to -qmin = 8 instead.
    layer = linear()
    fake = eqx_quant.quantize(layer, activations=eqx_quant.FakeQuant(1.0, -8, 0))
    data = jnp.asarray(np.linspace(-3.0, 2.0, 24, dtype=F32).reshape(4, 6))
    for method in ("absmax", "percentile", "mse", "minmax"):
        q = eqx_quant.calibrate(fake, [data], method=method).input_quant
        assert (q.qmin, q.qmax) == (-8, 0) and np.isfinite(q.scale) and q.scale > 0, method
    q = eqx_quant.calibrate(fake, [data]).input_quant
    assert F32(-3.0) * (F32(1) / F32(q.scale)) >= -8 and q.scale <= 3.0 / 8 * (1 + 1e-6)


# ---------------------------------------------------------------------------------------------------------------------
# Argument checks.


def test_python_int_scale_beyond_int32():
    x = jnp.array([2.0**41, -(2.0**43), 2.0**39], jnp.float32)
    expected = (np.clip(np.round(np.asarray(x, np.float64) / 2.0**40), -8, 7) * 2.0**40).astype(F32)
    np.testing.assert_array_equal(np.asarray(eqx_quant.fake_quant(x, 2**40, -8, 7)), expected)
    assert eqx_quant.FakeQuant(2**40, -8, 7).scale == 2.0**40
    assert float(eqx_quant.LearnedFakeQuant(2**40, -8, 7).scale) == 2.0**40


@pytest.mark.parametrize("qmin, qmax, name", [(-(2**40), 7, "qmin"), (0, 2**31, "qmax")])
def test_grids_beyond_int32_are_value_errors(qmin, qmax, name):
    with pytest.raises(ValueError, match=f"`{name}` must be an int32"):
        eqx_quant.fake_quant(jnp.ones(2), 1.0, qmin, qmax)
    with pytest.raises(ValueError, match=f"`{name}` must be an int32"):
        eqx_quant.FakeQuant(1.0, qmin, qmax)


def test_clip_passthrough_checks_bounds_before_the_cast():
    x = jnp.ones(3, jnp.float16)
    with pytest.raises(ValueError, match="`lo` must be <= `hi`, got lo=100000.0 > hi=70000.0"):
        eqx_quant.clip_passthrough(x, 1e5, 7e4)  # both are inf in float16
    np.testing.assert_array_equal(np.asarray(eqx_quant.clip_passthrough(x, 2**40, 2**41)), np.full(3, np.inf))


@pytest.mark.slow
def test_argument_errors_without_the_jaxtyping_hook():
    # Users run without the import hook that this suite runs under, which would answer many bad arguments with
    # beartype's error before the library's own: `tests/unhooked/check_errors.py` checks the library's messages.
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-o", "addopts=", "-o",
         "python_files=check_*.py", "tests/unhooked"],
        cwd=ROOT, capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    report = result.stdout + result.stderr
    assert result.returncode == 0, report
    match = re.search(r"(\d+) passed in", report.strip().splitlines()[-1])
    assert match is not None and int(match[1]) >= 2 and "skipped" not in report, report


@pytest.mark.parametrize(
    "kwargs, name, pattern",
    [({"where": "layers.("}, "where", "layers.("), ({"weights": {"[": None}}, "weights", "[")],
)
def test_invalid_patterns_are_value_errors(kwargs, name, pattern):
    mlp = eqx.nn.MLP(3, 2, 4, 1, key=jax.random.key(0))
    with pytest.raises(ValueError, match=f"`{name}`: '{pattern}' is not a valid regular expression".replace("[", r"\[")
                       .replace("(", r"\(")):  # fmt: skip
        eqx_quant.quantize(mlp, **kwargs)


def test_training_and_converted_layers_guard_their_input_alike():
    c = conv()
    fake = eqx_quant.calibrate(eqx_quant.quantize(c), [jnp.ones((2, 4, 5, 5))])
    real = eqx_quant.convert(fake)
    batched = jnp.ones((2, 4, 5, 5))
    messages = []
    for layer in (fake, real):
        with pytest.raises(ValueError, match=r"`x` must have shape \(in_channels, \*spatial\)") as info:
            layer(batched)
        messages.append(str(info.value))
    assert messages[0] == messages[1]
    lin = linear()
    fake = eqx_quant.quantize(lin)
    real = eqx_quant.convert(fake)
    square = jnp.ones((6, 6))  # a batch as long as the input: a product would silently contract the wrong axis
    for layer in (fake, real):
        with pytest.raises(ValueError, match=r"`x` must have shape \(6,\)"):
            layer(square)


# ---------------------------------------------------------------------------------------------------------------------
# A property: every path gives the same bits, finite data stay finite, NaN positions are kept.


@st.composite
def _quantizer_cases(draw):
    dtype = draw(st.sampled_from([jnp.float32, jnp.float16, jnp.bfloat16]))
    rows = draw(st.sampled_from([1, 3]))
    cols = draw(st.sampled_from([4, 8]))
    bits = draw(st.sampled_from([2, 3, 4, 8]))
    signed = draw(st.booleans())
    symmetric = draw(st.booleans())
    granularity = draw(st.sampled_from(["tensor", "channel", "group"]))
    log_scale = draw(st.sampled_from([-30.0, -3.0, 0.0, 3.0, 30.0]))
    seed = draw(st.integers(0, 2**16))
    with_nan = draw(st.booleans())
    return dtype, rows, cols, bits, signed, symmetric, granularity, log_scale, seed, with_nan


@settings(max_examples=4, deadline=None, derandomize=True)
@given(_quantizer_cases())
@pytest.mark.slow
def test_property_paths_agree_and_keep_finite_and_nan_data(case):
    dtype, rows, cols, bits, signed, symmetric, granularity, log_scale, seed, with_nan = case
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal((2, rows, cols)) * 10.0**log_scale).astype(np.float32)
    if with_nan:
        x[rng.integers(2), rng.integers(rows), rng.integers(cols)] = np.nan
    x = jnp.asarray(x).astype(dtype)
    q = eqx_quant.DynamicFakeQuant(
        bits,
        signed=signed,
        symmetric=symmetric,
        axis=0 if granularity == "channel" else None,
        group_size=cols // 2 if granularity == "group" else None,
    )
    eager = [q(x[i]) for i in range(2)]
    jitted_ = [jax.jit(q)(x[i]) for i in range(2)]
    batched = jax.vmap(q)(x)
    for i in range(2):
        assert eager[i].dtype == dtype
        assert_bitwise_equal(jitted_[i], eager[i])
        assert_bitwise_equal(batched[i], eager[i])
        np.testing.assert_array_equal(
            np.isnan(np.asarray(eager[i], np.float32)), np.isnan(np.asarray(x[i], np.float32))
        )
        assert np.all(np.isfinite(np.asarray(eager[i], np.float32)[~np.isnan(np.asarray(x[i], np.float32))]))
    # The stored integers of a finite tensor give the fake-quantized tensor back, bit for bit.
    finite = jnp.where(jnp.isnan(x[0]), jnp.zeros((), dtype), x[0])
    stored = q.quantize(finite)
    assert_bitwise_equal(stored.dequantize(), q(finite))


# ---------------------------------------------------------------------------------------------------------------------
# Found by reading the contract page against the code.


@pytest.mark.slow
def test_layer_without_outputs_works_on_every_path():
    layer = eqx.nn.Linear(3, 0, key=jax.random.key(0))
    for name, y in all_paths(layer, jnp.ones(3)).items():
        assert y.shape == (0,), name


def test_learned_step_size_of_huge_data_is_finite():
    # The sum of |x| overflows float32; the mean 1e38 does not: 2 * 1e38 / sqrt(127).
    q = eqx_quant.LearnedFakeQuant.init_from(jnp.full(4, 1e38, jnp.float32), 8, method="lsq")
    np.testing.assert_allclose(float(q.scale), 2e38 / np.sqrt(127), rtol=1e-6)


def test_mse_calibration_of_huge_data_searches_every_candidate():
    # Squared errors of data near 1e25 overflow float32 unless measured in units of max|x|: the search would then
    # stop at its first candidate (a hundredth of max|x|). Here no clipping pays, so max|x| itself is best.
    x = jnp.array([1e25, -3e24, 1.0, 5e24], jnp.float32)
    assert eqx_quant.FakeQuant.calibrate(x, 8, method="mse").scale == eqx_quant.FakeQuant.calibrate(x, 8).scale


def test_symmetric_calibration_needs_zero_on_the_grid():
    fake = eqx_quant.quantize(linear(), activations=eqx_quant.FakeQuant(1.0, 3, 3, zero_point=3))
    with pytest.raises(ValueError, match=r"`method`='absmax' fits a symmetric scale .* \[3, 3\] .* method='minmax'"):
        eqx_quant.calibrate(fake, [jnp.ones((2, 6))])
    assert eqx_quant.calibrate(fake, [jnp.ones((2, 6))], method="minmax").input_quant.qmin == 3


def test_export_refuses_colliding_paths_and_keeps_the_old_file(tmp_path):
    layers = {"a.b": eqx.nn.Linear(2, 2, key=jax.random.key(0)), "a": {"b": eqx.nn.Linear(2, 2, key=jax.random.key(1))}}
    path = tmp_path / "model.safetensors"
    path.write_bytes(b"old")
    with pytest.raises(ValueError, match="same path|two"):
        eqx_quant.export_safetensors(path, eqx_quant.convert(eqx_quant.quantize(layers)))
    assert path.read_bytes() == b"old"


def test_passthrough_clip_bounds_are_not_bools():
    # A bool is an int, so the annotations let it through; the module's own check refuses it (strings and other
    # types: tests/unhooked/check_errors.py).
    with pytest.raises(TypeError, match="`hi` must be a real number, got True"):
        eqx_quant.PassthroughClip(0.0, True)


@pytest.mark.parametrize("recipe", slow_unless(["q4_0"], ["fp8", "w4a16_g32", "q4_0"]))
def test_a_layer_with_one_output_converts_bit_for_bit_one_example_at_a_time(recipe):
    """A linear layer with one output (`out_features` 1 or `"scalar"`) on the float path, called on one example:
    XLA sums its product as elementwise products into which it fuses the weight's computation, which differs
    between the fake-quantized and the dequantized weight. Both are computed before the product, so the two layers
    sum alike, eagerly, compiled and mapped; the gradients are those of the float layer on the fake-quantized
    operands."""
    rng = np.random.default_rng(3)
    xs = jnp.asarray(rng.standard_normal((6, 32)).astype(np.float32))
    call = eqx.filter_jit(lambda layer, x: layer(x))
    mapped = eqx.filter_jit(lambda layer, x: jax.vmap(layer)(x))
    for out in ("scalar", 1):
        layer = eqx.nn.Linear(32, out, key=jax.random.key(0))
        quantized = eqx_quant.quantize(layer, **eqx_quant.recipe(recipe))
        converted = eqx_quant.convert(quantized)
        for run in (lambda m, x: m(x), call):
            assert_bitwise_equal(np.stack([run(converted, x) for x in xs]), np.stack([run(quantized, x) for x in xs]))
        assert_bitwise_equal(mapped(converted, xs), mapped(quantized, xs))
        # The float function of the fake-quantized operands (FP8 inputs too for "fp8"), one example at a time, and
        # its gradient towards the input (the straight-through estimator's where nothing saturates).
        inputs = quantized.input_quant or (lambda x: x)
        fake = eqx.tree_at(lambda l: l.weight, layer, quantized.weight)
        want = np.stack([np.asarray(fake(inputs(x))) for x in xs])
        np.testing.assert_allclose(np.stack([np.asarray(call(quantized, x)) for x in xs]), want, rtol=1e-6, atol=1e-6)
        grad = jax.grad(lambda x, m: jnp.sum(m(x)))(xs[0], quantized)
        np.testing.assert_allclose(grad, jnp.reshape(quantized.weight, (32,)), rtol=0, atol=0)


@few_rows
def test_calibration_data_without_examples_is_a_clear_error():
    """No batches, or a batch of no examples (a leading axis of length 0, among others or alone), is a `ValueError`
    naming `batches` in every function that reads calibration data, not an error of a reduction over nothing."""
    mlp = eqx.nn.MLP(4, 3, 16, 1, key=jax.random.key(0))
    w8a8 = eqx_quant.quantize(mlp, **eqx_quant.recipe("w8a8"))
    w4 = eqx_quant.quantize(mlp, **eqx_quant.recipe("w4a16_g32", group_size=4))
    readers = {
        "calibrate": lambda b: eqx_quant.calibrate(w8a8, b),
        "smoothquant": lambda b: eqx_quant.smoothquant(w8a8, b),
        "awq": lambda b: eqx_quant.awq(w4, b),
        "gptq": lambda b: eqx_quant.gptq(w4, b),
        "gptq in one pass": lambda b: eqx_quant.gptq(w4, b, sequential=False),
        "autoround": lambda b: eqx_quant.autoround(w4, b, steps=1),
        # Its default candidates warn of the layers some cannot take: the batches are refused before any of that.
        "auto_recipe": lambda b: eqx_quant.auto_recipe(mlp, b, average_bits=8),
    }
    none = r"`batches` holds a batch of no examples: batch {} has arrays float32\[0, 4\], whose leading"
    for read in readers.values():
        with pytest.raises(ValueError, match=r"`batches` is empty"):
            read([])
        with pytest.raises(ValueError, match=none.format(0)):
            read([jnp.zeros((0, 4))])
        with pytest.raises(ValueError, match=r"`batches` holds a batch without arrays: batch 0 is None; each batch"):
            read([None])
    with pytest.raises(ValueError, match=none.format(1)):
        eqx_quant.calibrate(w8a8, [jnp.ones((3, 4)), jnp.zeros((0, 4))])

    class OneShot:  # a stream that can be iterated once: the checks of `batches` must not iterate it
        def __init__(self):
            self.read = False

        def __iter__(self):
            assert not self.read, "iterated twice"
            self.read = True
            return iter([jnp.ones((3, 4))])

    assert_bitwise_equal(eqx_quant.calibrate(w8a8, OneShot()).layers[0].input_quant.scale,
                         eqx_quant.calibrate(w8a8, [jnp.ones((3, 4))]).layers[0].input_quant.scale)  # fmt: skip
    eqx_quant.gptq(w4, OneShot())

    # A batch of several arrays, the model called on it whole: it holds no examples when none of its arrays has any
    # along the leading axis (a scalar has none); an array of length 0 beside others (an empty cache) is data.
    class Batched(eqx.Module):
        mlp: eqx.Module

        def __call__(self, batch):
            return jax.vmap(self.mlp)(batch["x"]) * batch["t"] + jnp.sum(batch["cache"])

    model = Batched(w8a8)
    empty = {"x": jnp.zeros((0, 4)), "t": jnp.float32(2), "cache": jnp.zeros((0, 2))}
    with pytest.raises(ValueError, match=r"batch 0 has arrays float32\[0, 2\], float32\[0, 4\], whose leading"):
        eqx_quant.smoothquant(model, [empty], batched=True)
    calibrated = eqx_quant.calibrate(model, [empty | {"x": jnp.ones((3, 4))}], batched=True)
    assert isinstance(calibrated.mlp.layers[0].input_quant, eqx_quant.FakeQuant)


def test_a_quantized_convolution_of_an_empty_input_is_empty():
    # A spatial axis of length 0: the float convolution's empty output, on the integer path (whose NaN mask once
    # reshaped with -1, undefined for an empty array), the weight-only one, and converted.
    conv = eqx.nn.Conv1d(3, 4, kernel_size=1, key=jax.random.key(0))
    x = jnp.zeros((3, 0))
    for recipe in ("w8a8", "w8a16"):
        quantized = eqx_quant.quantize(conv, **eqx_quant.recipe(recipe))
        for model in (quantized, eqx_quant.convert(quantized)):
            y = model(x)
            assert y.shape == (4, 0) and y.dtype == jnp.float32
