"""Number formats as one description: names, the one fake-quant entry, MXINT8, one stored array for every format,
calibration of float-format inputs, GPTQ on float grids, learned block scales, tiles along any axis."""

import re

import equinox as eqx
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import eqx_quant
from eqx_quant import DynamicFakeQuant, FakeQuant, LearnedFakeQuant, QuantizedArray

from .helpers import assert_bitwise_equal, init, np_absmax_scale, reference_fake_quant
from .test_float_formats import cast, ftz, ref_mx


F32 = np.float32
NAMES = [
    "int8", "int4", "int2", "int8_narrow", "uint8", "uint1", "int16", "float8_e4m3fn", "float8_e5m2",
    "float6_e2m3fn", "float6_e3m2fn", "float4_e2m1fn", "mxfp8_e4m3", "mxfp8_e5m2", "mxfp6_e2m3", "mxfp6_e3m2",
    "mxfp4", "mxfp4_rceil", "mxint8", "nvfp4", "q8_0", "q4_0", "q5_0", "int1_stretched", "int2_stretched",
    "int4_stretched", "int8_stretched", "int2_narrow_wide", "uint4_wide",
]  # fmt: skip


# ---------------------------------------------------------------------------------------------------------------------
# Formats.


@pytest.mark.parametrize("name", NAMES)
def test_names_round_trip(name):
    fmt = eqx_quant.format_named(name)
    assert fmt.name == name and repr(fmt) == f"Format({name!r})"
    assert eqx_quant._format.format_from_json(fmt.to_json()) == fmt
    assert hash(fmt) == hash(eqx_quant.format_named(name))  # static configuration: hashable, equal by value


def test_format_properties():
    assert eqx_quant.int_format(4) == eqx_quant.IntFormat(-8, 7) and eqx_quant.int_format(4).bits == 4
    assert eqx_quant.IntFormat(-16, 15).bits == 5 and eqx_quant.IntFormat(0, 255).bits == 8
    assert eqx_quant.IntFormat(-4, 3).packed_width == 3 and eqx_quant.IntFormat(-128, 127).packed_width is None
    assert eqx_quant.IntFormat(-3, 5).name == "int[-3, 5]"
    fp8 = eqx_quant.float_format(jnp.float8_e4m3fn)
    assert fp8 == eqx_quant.format_named("float8_e4m3fn") and (fp8.bits, fp8.bound, fp8.emax) == (8, 448.0, 8)
    assert eqx_quant.mx_format("mxfp4").scale == "e8m0" and eqx_quant.format_named("nvfp4").scale == "e4m3"
    assert eqx_quant.mx_format("mxint8") == eqx_quant.IntFormat(-127, 127, scale="e8m0", scale_rule="floor")


def test_format_errors():
    with pytest.raises(ValueError, match="`format`='int99' names no integer grid: `bits` must be between 2 and 16"):
        eqx_quant.format_named("int99")
    with pytest.raises(ValueError, match="`format` must be a Format or one of the names .*got 'fp5'"):
        eqx_quant.format_named("fp5")
    with pytest.raises(ValueError, match="`format`.*'fp5'"):
        DynamicFakeQuant("fp5")
    with pytest.raises(TypeError, match="format"):  # the jaxtyping hook's message, or eqx_quant's without it
        eqx_quant.LearnedFakeQuant.init_from(jnp.ones(4), 4.0)  # pyright: ignore[reportArgumentType]
    with pytest.raises(ValueError, match="`scale`='e4m3' .* takes float4_e2m1fn elements"):
        eqx_quant.FloatFormat("float8_e4m3fn", scale="e4m3")
    with pytest.raises(ValueError, match="`scale_rule` is given exactly for E8M0 and float16 scales"):
        eqx_quant.IntFormat(-8, 7, scale="e8m0")
    with pytest.raises(ValueError, match="`qmin` must be <= `qmax`"):
        eqx_quant.IntFormat(3, 2)
    with pytest.raises(ValueError, match="`signed` and `narrow` apply to a number of bits"):
        DynamicFakeQuant("int8", narrow=True)
    with pytest.raises(ValueError, match="mxfp4 has block scales: give its block size as `group_size`"):
        DynamicFakeQuant("mxfp4")
    with pytest.raises(ValueError, match="NVFP4 has blocks of 16, got group_size=32"):
        DynamicFakeQuant("nvfp4", group_size=32)
    with pytest.raises(ValueError, match="`symmetric`=False needs a zero point, which float8_e4m3fn does not have"):
        DynamicFakeQuant("float8_e4m3fn", symmetric=False)


# ---------------------------------------------------------------------------------------------------------------------
# The one fake-quant entry.


@pytest.mark.slow
def test_fake_quant_format_is_each_primitive():
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.normal(size=(4, 32)).astype(F32) * 3)
    assert_bitwise_equal(eqx_quant.fake_quant_format(x, 0.25, "int4"), eqx_quant.fake_quant(x, 0.25, -8, 7))
    assert_bitwise_equal(
        eqx_quant.fake_quant_format(x, 0.1, eqx_quant.IntFormat(0, 15), zero_point=3),
        eqx_quant.fake_quant(x, 0.1, 0, 15, 3),
    )
    assert_bitwise_equal(
        eqx_quant.fake_quant_format(x, 0.01, "float8_e5m2"), eqx_quant.fake_quant_float(x, 0.01, "float8_e5m2")
    )
    # Block formats, with the scales a dynamic quantizer computes.
    for fmt, call in (("mxfp4", lambda v: eqx_quant.mx_fake_quant(v, "mxfp4")), ("nvfp4", eqx_quant.nvfp4_fake_quant)):
        q = DynamicFakeQuant(fmt, group_size=32 if fmt == "mxfp4" else 16)
        scales = q.scales(x)
        view = q.layout.view(x)
        got = eqx_quant.fake_quant_format(view, scales.scale, fmt, tensor_scale=scales.tensor_scale).reshape(x.shape)
        assert_bitwise_equal(got, call(x))
    with pytest.raises(ValueError, match="`tensor_scale` is needed"):
        eqx_quant.fake_quant_format(x, 1.0, "nvfp4")
    with pytest.raises(ValueError, match="float8_e4m3fn has no zero point"):
        eqx_quant.fake_quant_format(x, 1.0, "float8_e4m3fn", zero_point=1)
    # Concrete block scales that their scale format cannot hold are errors, as in `FakeQuant` (NaN is a NaN block).
    bad = [
        ("mxfp4", 0.3, None, "scale=0.3"),
        ("mxfp4", -2.0, None, "scale=-2.0"),
        ("mxfp4", 2.0**128, None, "scale="),
        ("nvfp4", 0.3, 1.0, "scale=0.3"),  # not a float8_e4m3fn value
        ("nvfp4", 512.0, 1.0, "scale=512.0"),
        ("nvfp4", 1.0, -1.0, "tensor_scale=-1.0"),
        ("nvfp4", 1.0, float("nan"), "tensor_scale=nan"),
    ]
    for fmt, scale, tensor_scale, named in bad:
        with pytest.raises(ValueError, match=re.escape(named)):
            eqx_quant.fake_quant_format(x, scale, fmt, tensor_scale=tensor_scale)
    with pytest.raises(ValueError, match=re.escape("scale[1, 0]=0.75")):
        eqx_quant.fake_quant_format(x, jnp.array([[0.5], [0.75], [1.0], [2.0]]), "mxfp4")
    block_nan = jnp.array([[0.5], [jnp.nan], [0.0], [2.0**-127]])  # NaN, and 0 for 2**-127, are block scales
    out = np.asarray(eqx_quant.fake_quant_format(x, block_nan, "mxfp4"))
    assert np.isnan(out[1]).all() and not np.isnan(out[[0, 2, 3]]).any()
    # NumPy integers are ints wherever an int is taken.
    assert_bitwise_equal(eqx_quant.mx_fake_quant(x, "mxfp4", axis=np.int64(1), block_size=np.int32(16)),
                         eqx_quant.mx_fake_quant(x, "mxfp4", axis=1, block_size=16))  # fmt: skip
    assert_bitwise_equal(eqx_quant.nvfp4_fake_quant(x, axis=np.int64(-1)), eqx_quant.nvfp4_fake_quant(x))


def ref_mxint8(x, block):
    """MXINT8 along the last axis: `X = 2**(floor(log2(amax)) - 6)` per block, integers in [-127, 127]."""
    x = np.asarray(x, np.float64)
    xb = x.reshape(*x.shape[:-1], -1, block)
    amax = np.abs(xb).max(-1, keepdims=True)
    e = np.clip(np.where(amax == 0, -127, np.frexp(amax)[1] - 1 - 6), -127, 127)
    levels = np.clip(np.round(xb * np.ldexp(1.0, -e)), -127, 127)  # exact: a power of two, rounding half to even
    return (levels * np.ldexp(1.0, e)).astype(F32).reshape(x.shape), levels.reshape(x.shape)


@pytest.mark.slow
def test_mxint8_against_numpy():
    rng = np.random.default_rng(1)
    x = (rng.normal(size=(3, 64)) * np.exp2(rng.uniform(-6, 6, (3, 2, 1))).repeat(32, -1).reshape(3, 64)).astype(F32)
    x[1, :32] = 0.0
    want, levels = ref_mxint8(x, 32)
    assert_bitwise_equal(eqx_quant.mx_fake_quant(jnp.asarray(x), "mxint8"), want)
    q = eqx_quant.MXFakeQuant("mxint8")
    array = q.quantize_array(jnp.asarray(x))
    assert array.values.dtype == jnp.int8 and array.scale.dtype == jnp.uint8
    np.testing.assert_array_equal(np.asarray(array.levels()).reshape(3, 64), levels)
    assert_bitwise_equal(array.dequantize(), want)
    # Stored E8M0 bytes read by ml_dtypes are the block scales times 2**6.
    scales = np.asarray(array.scale[..., 0]).view(ml_dtypes.float8_e8m0fnu).astype(np.float64)
    np.testing.assert_array_equal(scales[0], 2.0 ** (np.frexp(np.abs(x[0].reshape(2, 32)).max(-1))[1] - 7))


# ---------------------------------------------------------------------------------------------------------------------
# One stored array for every format.


QUANTIZERS = {
    "int8 per channel": DynamicFakeQuant(8, axis=0),
    "int4 per group": DynamicFakeQuant(4, group_size=16),
    "int3 asymmetric": DynamicFakeQuant(3, axis=0, signed=False, symmetric=False),
    "int4 groups along axis 0": DynamicFakeQuant(4, group_size=2, group_axis=0),
    "fp8 per channel": DynamicFakeQuant("float8_e4m3fn", axis=0),
    "fp6 per tensor": DynamicFakeQuant("float6_e2m3fn"),
    "fp4 static": FakeQuant(0.25, format="float4_e2m1fn"),
    "mxfp4": eqx_quant.MXFakeQuant("mxfp4"),
    "mxfp8": eqx_quant.MXFakeQuant("mxfp8_e4m3", block_size=16),
    "mxint8": eqx_quant.MXFakeQuant("mxint8"),
    "nvfp4": eqx_quant.NVFP4FakeQuant(),
    "q4_0": DynamicFakeQuant("q4_0", group_size=32),
    "q5_0": DynamicFakeQuant("q5_0", group_size=32),
    "q8_0": DynamicFakeQuant("q8_0", group_size=32),
    "learned int4": LearnedFakeQuant(jnp.full((4,), 0.2), -8, 7, axis=0),
    "stretched int2 per channel": DynamicFakeQuant("int2_stretched", axis=0),
    "stretched int3 per group": DynamicFakeQuant("int3_stretched", group_size=16),
    "learned ternary": LearnedFakeQuant(jnp.full((4,), 0.3), -1, 1, axis=0),
}


@pytest.mark.parametrize("name", list(QUANTIZERS))
@pytest.mark.slow
def test_one_stored_array_for_every_format(name, tmp_path):
    q = QUANTIZERS[name]
    w = jnp.asarray(np.random.default_rng(2).normal(size=(4, 32)).astype(F32))
    array = q.quantize_array(w)
    assert type(array) is QuantizedArray and array.format == q.format and array.layout == q.layout
    assert_bitwise_equal(array.dequantize(), q(w))
    assert_bitwise_equal(eqx.filter_jit(lambda a: a.dequantize())(array), q(w))
    for i in (0, 3):
        assert_bitwise_equal(array.dequantize_row(i), q(w)[i])
    # A converted layer holds it, and computes exactly the fake-quant layer's outputs.
    linear = eqx.nn.Linear(32, 4, key=jax.random.key(0))
    linear = eqx.tree_at(lambda l: l.weight, linear, w)
    fake = eqx_quant.nn.QuantLinear(linear, weight_quant=q, input_quant=None)
    real = eqx_quant.convert(fake)
    assert type(real.qweight) is QuantizedArray and real.qweight.format == q.format
    x = jnp.asarray(np.random.default_rng(3).normal(size=(5, 32)).astype(F32))
    run = eqx.filter_jit(lambda m, x: jax.vmap(m)(x))
    assert_bitwise_equal(run(real, x), run(fake, x))
    # It saves and loads, its description checked.
    eqx_quant.save(tmp_path / "a.eqx", real)
    loaded = eqx_quant.load(tmp_path / "a.eqx", eqx_quant.convert(eqx.tree_at(lambda l: l.layer.weight, fake, w * 2)))
    assert_bitwise_equal(run(loaded, x), run(real, x))


@pytest.mark.slow
def test_groups_along_the_first_axis_against_numpy():
    w = np.random.default_rng(4).normal(size=(6, 5)).astype(F32)
    q = DynamicFakeQuant(4, group_size=3, group_axis=0)
    scale = np_absmax_scale(np.abs(w.reshape(2, 3, 5)).max(axis=1, keepdims=True), 7)
    want = reference_fake_quant(w.reshape(2, 3, 5), scale, -8, 7).reshape(6, 5)
    assert_bitwise_equal(q(jnp.asarray(w)), want)
    assert q.quantization_params(jnp.asarray(w))[0].shape == (2, 5)
    with pytest.raises(ValueError, match="`group_size`=4 does not divide axis 0 of `x`, of size 6"):
        DynamicFakeQuant(4, group_size=4, group_axis=0)(jnp.asarray(w))


# ---------------------------------------------------------------------------------------------------------------------
# Calibration of float-format inputs.


@pytest.mark.slow
def test_calibrate_fp8_inputs_gives_static_saturating_scales():
    mlp = init(lambda k: eqx.nn.MLP(8, 3, 16, 1, key=k), 5)
    rng = np.random.default_rng(6)
    batches = [jnp.asarray(rng.normal(size=(16, 8)).astype(F32) * s) for s in (1.0, 4.0)]
    fp8 = DynamicFakeQuant("float8_e4m3fn")
    qmodel = eqx_quant.quantize(mlp, weights=DynamicFakeQuant("float8_e4m3fn", axis=0), activations=fp8)
    calibrated = eqx_quant.calibrate(qmodel, batches)
    quantizer = calibrated.layers[0].input_quant
    assert type(quantizer) is FakeQuant and quantizer.format == fp8.format
    absmax = max(float(np.abs(b).max()) for b in batches)
    assert np.float32(quantizer.scale) == np_absmax_scale(absmax, 448.0)
    # Static: an input beyond the calibrated range saturates at 448 * scale, where a dynamic scale would follow it.
    big = jnp.full((8,), 10 * absmax)
    np.testing.assert_array_equal(quantizer(big), np.full(8, F32(448) * F32(quantizer.scale)))
    # The other symmetric methods fit float grids too, and never a larger scale than absmax's.
    for method in ("percentile", "mse"):
        other = eqx_quant.calibrate(qmodel, batches, method=method, percentile=90.0).layers[0].input_quant
        assert other.format == fp8.format and other.scale <= quantizer.scale
    with pytest.raises(ValueError, match="`method`='minmax' fits an asymmetric grid .* float8_e4m3fn does not have"):
        eqx_quant.calibrate(qmodel, batches, method="minmax")
    # Converted, the calibrated model computes the same bits.
    run = eqx.filter_jit(lambda m, x: jax.vmap(m)(x))
    assert_bitwise_equal(run(eqx_quant.convert(calibrated), batches[1]), run(calibrated, batches[1]))
    # FakeQuant.fit on data agrees with calibrate's absmax.
    fitted = FakeQuant.fit(jnp.concatenate(batches), "float8_e4m3fn")
    assert fitted.scale == quantizer.scale and fitted.format == fp8.format


# ---------------------------------------------------------------------------------------------------------------------
# GPTQ on float grids.


def _correlated(rng, n, count):
    latent = rng.normal(size=(count, 4))
    return (latent @ rng.normal(size=(4, n)) + 0.05 * rng.normal(size=(count, n))).astype(F32)


def _nearest(v, element):
    return cast(ftz(np.asarray(v, F32)), element)


def numpy_gptq_grid(w, h, group, scales_of, damp=0.01):
    """A NumPy GPTQ twin for any grid, one column at a time: `scales_of(columns)` gives `(scale, element)` per row
    for a group of columns (fixed when the group is first reached), the columns are rounded with `ml_dtypes` casts."""
    w, h = np.array(w, np.float64), np.array(h, np.float64)
    out, n = w.shape
    h = h + damp * np.mean(np.diag(h)) * np.eye(n)
    u = np.linalg.cholesky(np.linalg.inv(h)).T
    q = np.zeros_like(w)
    for i in range(n):
        if i % group == 0:
            scale, element = scales_of(w[:, i : i + group].astype(F32))
        col = w[:, i].astype(F32)
        q[:, i] = scale * _nearest(col * (F32(1) / scale), element)
        err = (w[:, i] - q[:, i]) / u[i, i]
        w[:, i + 1 :] -= np.outer(err, u[i, i + 1 :])
    return q


def _fp8_rows(cols):
    return np_absmax_scale(np.abs(cols).max(axis=1), 448.0), "float8_e4m3fn"


def _mx_blocks(cols):
    return np.ldexp(1.0, np.frexp(np.abs(cols).max(axis=1))[1] - 1 - 2).astype(F32), "float4_e2m1fn"


def _fp4_rows(cols):
    return np_absmax_scale(np.abs(cols).max(axis=1), 6.0), "float4_e2m1fn"


@pytest.mark.parametrize(
    "quantizer, group, scales_of",
    [
        (DynamicFakeQuant("float8_e4m3fn", axis=0), None, _fp8_rows),
        (DynamicFakeQuant("float4_e2m1fn", axis=0), None, _fp4_rows),
        (eqx_quant.MXFakeQuant("mxfp4"), 32, _mx_blocks),
        (eqx_quant.NVFP4FakeQuant(), 16, None),
    ],
)
@pytest.mark.slow
def test_gptq_on_float_grids_beats_round_to_nearest(quantizer, group, scales_of):
    rng = np.random.default_rng(7)
    w = rng.normal(size=(8, 64)).astype(F32)
    x = _correlated(rng, 64, 256)
    h = 2.0 * x.T.astype(np.float64) @ x.astype(np.float64)
    fmt = quantizer.format
    levels, scale = eqx_quant.gptq_quantize(jnp.asarray(w), jnp.asarray(h, jnp.float32), format=fmt, group_size=group)
    g = 64 if group is None else group
    gptq_weight = np.asarray(scale).repeat(g, axis=1) * np.asarray(levels)
    rtn_weight = np.asarray(quantizer(jnp.asarray(w)))

    def error(v):
        return float(np.sum(((v - w) @ x.T).astype(np.float64) ** 2))

    ratio = error(gptq_weight) / error(rtn_weight)
    if scales_of is None:  # NVFP4: block scales under the tensor scale of the whole weight
        t = F32(np.abs(w).max()) / F32(2688)

        def scales_of(cols):
            b = cast(np.abs(cols).max(axis=1) / (F32(6) * t), "float8_e4m3fn")
            return F32(b * t), "float4_e2m1fn"

    twin = error(numpy_gptq_grid(w, h, g, scales_of)) / error(rtn_weight)
    print(f"{fmt.name}: output error of GPTQ / round-to-nearest = {ratio:.3f} (NumPy twin {twin:.3f})")
    assert ratio < 0.5 and abs(ratio - twin) < 0.1
    # The levels are the format's grid points.
    grid_points = np.unique(np.abs(np.asarray(levels)))
    assert np.all(np.isin(grid_points, np.abs(cast(grid_points, fmt.element))))


@pytest.mark.parametrize("weights", ["mxfp4", "nvfp4", "fp8"])
@pytest.mark.slow
def test_gptq_on_a_model_with_float_weights_converts_bit_for_bit(weights):
    make = {
        "mxfp4": lambda: eqx_quant.MXFakeQuant("mxfp4"),
        "nvfp4": lambda: eqx_quant.NVFP4FakeQuant(),
        "fp8": lambda: DynamicFakeQuant("float8_e4m3fn", axis=0),
    }[weights]
    rng = np.random.default_rng(8)
    batches = [jnp.asarray(_correlated(rng, 32, 64)) for _ in range(2)]
    model = init(lambda k: eqx.nn.MLP(32, 32, 32, 1, key=k), 9)
    qmodel = eqx_quant.quantize(model, weights=make(), activations=None)
    g = eqx_quant.gptq(qmodel, batches)
    layer = g.layers[0]
    assert type(layer.weight_quant) is FakeQuant and layer.weight_quant.format == make().format
    run = eqx.filter_jit(lambda m, x: jax.vmap(m)(x))
    assert_bitwise_equal(run(eqx_quant.convert(g), batches[0]), run(g, batches[0]))
    # The fixed quantizer reproduces GPTQ's weight exactly: it is on its grid already.
    assert_bitwise_equal(layer.weight_quant(layer.layer.weight), layer.layer.weight)
    # And GPTQ's outputs are closer to the float model's than round-to-nearest's, on the calibration data.
    x = jnp.concatenate(batches)

    def error(m):
        return float(jnp.sum((run(m, x) - run(model, x)) ** 2))

    assert error(g) < error(qmodel)


# ---------------------------------------------------------------------------------------------------------------------
# Learned and static block scales.


@pytest.mark.slow
def test_learned_block_scales_start_at_the_dynamic_ones_and_train():
    w = jnp.asarray(np.random.default_rng(10).normal(size=(4, 32)).astype(F32))
    for fmt, group in (("mxfp4", 32), ("nvfp4", 16), ("mxint8", 32)):
        dynamic = DynamicFakeQuant(fmt, group_size=group)
        learned = LearnedFakeQuant.init_from(w, fmt, group_size=group)
        assert learned.format == dynamic.format
        assert_bitwise_equal(learned(w), dynamic(w))
        grads = eqx.filter_grad(lambda q: jnp.sum((q(w) - w) ** 2))(learned)
        assert np.all(np.isfinite(np.asarray(grads.scale))) and np.any(np.asarray(grads.scale) != 0)
        assert_bitwise_equal(eqx_quant.convert(eqx_quant.nn.QuantLinear(
            eqx.tree_at(lambda l: l.weight, eqx.nn.Linear(32, 4, key=jax.random.key(0)), w),
            weight_quant=learned, input_quant=None)).weight, learned(w))  # fmt: skip
    # The scale in use of a learned E8M0 scale is the nearest power of two (in the log domain); of an E4M3 one, the
    # nearest float8_e4m3fn value.
    s = jnp.asarray([1.0, 1.4, 1.42, 3.0, 2.0**-130], jnp.float32)
    np.testing.assert_array_equal(eqx_quant._fake_quant.pow2_ste(s), [1.0, 1.0, 2.0, 4.0, 0.0])
    assert float(jax.grad(lambda v: eqx_quant._fake_quant.pow2_ste(v))(jnp.float32(1.3))) == 1.0
    np.testing.assert_array_equal(eqx_quant._fake_quant.e4m3_ste(jnp.asarray([0.3, 500.0], jnp.float32)),
                                  cast(np.asarray([0.3, 500.0], F32), "float8_e4m3fn"))  # fmt: skip


def test_static_block_scales_are_checked():
    with pytest.raises(ValueError, match=r"`scale` must be a power of two 2\*\*e .* got scale=0.3"):
        FakeQuant((0.3, 0.5), format="mxfp4", group_size=32)
    with pytest.raises(ValueError, match="`scale` must be a non-negative float8_e4m3fn value, got scale=0.3"):
        FakeQuant((0.3,), format="nvfp4", group_size=16, tensor_scale=1.0)
    with pytest.raises(ValueError, match="`tensor_scale` is given exactly for two-level scales"):
        FakeQuant((0.5,), format="nvfp4", group_size=16)
    q = FakeQuant(((0.5, 2.0**-127),), format="mxfp4", group_size=4)
    x = jnp.asarray([[3.0, -1.0, 0.2, 0.0, 0.0, 0.0, 0.0, 0.0]])
    np.testing.assert_array_equal(q(x), ref_mx(np.asarray(x), "mxfp4", 4, "floor"))
    nv = FakeQuant(((1.0, 0.0),), format="nvfp4", group_size=16, tensor_scale=0.5)
    y = jnp.linspace(-4.0, 4.0, 32)[None]
    assert_bitwise_equal(nv(y)[0, :16], F32(0.5) * cast(np.asarray(y[0, :16]) * F32(2), "float4_e2m1fn"))
    np.testing.assert_array_equal(nv(y)[0, 16:], np.zeros(16))
