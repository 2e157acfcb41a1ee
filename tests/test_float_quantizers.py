"""Float-format quantizers (`FloatFakeQuant`, `DynamicFloatFakeQuant`, `LearnedFloatFakeQuant`, `MXFakeQuant`,
`NVFP4FakeQuant`), their stored codes (`FloatQuantizedTensor`), conversion, `save` / `load` and the safetensors
export, checked bit for bit against the NumPy / `ml_dtypes` references of `test_float_formats.py`."""

import json

import equinox as eqx
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
import safetensors.numpy

import eqx_quant
from eqx_quant import (
    AbstractFloatQuantizer,
    DynamicFloatFakeQuant,
    FloatFakeQuant,
    LearnedFloatFakeQuant,
    MXFakeQuant,
    NVFP4FakeQuant,
)
from eqx_quant.nn import FloatQuantizedTensor, IntConv, IntEmbedding, IntLinear, QuantEmbedding, QuantLinear

from .helpers import assert_trees_equal, init, slow_unless
from .test_float_formats import (
    BITS,
    DTYPES,
    MX,
    assert_same,
    cast,
    ftz,
    grid,
    largest,
    ref_fake_quant_float,
    ref_mx,
    ref_nvfp4,
)


F32 = np.float32


# ---------------------------------------------------------------------------------------------------------------------
# References: the codes and scales a tensor should store, from NumPy and `ml_dtypes` alone.


def ml_codes(values, name):
    """The `ml_dtypes` bit patterns of float32 `values` (points of the format's grid, or NaN) as uint8."""
    return np.asarray(values, F32).astype(DTYPES[name]).view(np.uint8)


def unpacked_codes(tensor):
    """The codes of a tensor, one per element, in its shape: FP4 nibbles unpacked by hand (low nibble first)."""
    codes = np.asarray(tensor.values)
    if not tensor.packed:
        return codes
    nibbles = np.stack([codes & 0xF, codes >> 4], axis=-1).reshape(codes.shape[0], -1)
    return nibbles[:, : int(np.prod(tensor.shape)) // codes.shape[0]].reshape(tensor.shape)


def ref_mx_exponents(x, fmt, block_size, rule):
    """The E8M0 byte of every block of a 2-D `x` along its last axis: the block exponent plus 127, 255 for blocks
    holding NaN or inf (exponents from `np.frexp`, as in `ref_mx`)."""
    name, emax = MX[fmt]
    xb = ftz(np.asarray(x, F32)).reshape(x.shape[0], -1, block_size).astype(np.float64)
    finite = np.isfinite(xb)
    amax = np.where(finite, np.abs(xb), 0).max(-1)
    e = np.frexp(amax)[1] - 1 - emax
    if rule == "rceil":
        e = np.where(amax <= np.ldexp(largest(name), e), e, e + 1)
    e = np.clip(np.where(amax == 0, -127, e), -127, 127)
    return np.where(finite.all(-1), e + 127, 255).astype(np.uint8)


def ref_nvfp4_scales(x):
    """NVFP4's tensor scale and E4M3 block-scale bytes of `x` taken as one tensor, blocks along the last axis."""
    xb = ftz(np.asarray(x, F32)).reshape(-1, 16)
    finite = np.isfinite(xb)
    amax_b = np.where(finite, np.abs(xb), F32(0)).max(-1)
    t = ftz(amax_b.max() / F32(2688))
    with np.errstate(divide="ignore", invalid="ignore"):
        ratio = np.where(t > 0, ftz(amax_b / ftz(F32(6) * t)), F32(0))
    b = cast(np.clip(ratio, F32(0), F32(448)), "float8_e4m3fn")
    return t, np.where(finite.all(-1), ml_codes(b, "float8_e4m3fn"), 0x7F).reshape(*x.shape[:-1], -1)


def ref_dynamic_scale(x, name, axis=None):
    """`amax / M` per tensor (or per row of the channel `axis`), stepped up by ulps until `amax * (1 / s) <= M`."""
    x = np.moveaxis(np.asarray(x, F32), axis, 0) if axis is not None else np.asarray(x, F32).reshape(1, -1)
    m = F32(largest(name))
    amax = np.where(np.isfinite(x), np.abs(x), F32(0)).reshape(x.shape[0], -1).max(-1)
    s = np.maximum(amax * (F32(1) / m), np.finfo(F32).tiny)
    while np.any(amax * (F32(1) / s) > m):
        s = np.where(amax * (F32(1) / s) > m, np.nextafter(s, F32(np.inf)), s)
    return s.astype(F32)


def data(seed, shape, spread=8.0):
    """Signed values over `2**-spread .. 2**spread`, with zeros, a signed zero, infinities and a float32
    subnormal in the first row."""
    rng = np.random.default_rng(seed)
    x = (np.where(rng.random(shape) < 0.5, -1, 1) * np.exp2(rng.uniform(-spread, spread, shape))).astype(F32)
    x.reshape(-1)[:5] = [0.0, -0.0, np.inf, -np.inf, 1e-40]
    return x


def assert_dequantizes_to(tensor, want):
    assert isinstance(tensor, eqx_quant.QuantizedArray)
    assert_same(tensor.dequantize(), want)


# ---------------------------------------------------------------------------------------------------------------------
# Codes.


@pytest.mark.parametrize("name", list(DTYPES))
@pytest.mark.slow
def test_codes_are_ml_dtypes_bit_patterns(name):
    # Every point of the grid (scale 1) and its negative: the stored codes are the patterns of an `ml_dtypes` cast,
    # and FP4 codes are packed two per byte, low nibble first.
    g = grid(name)
    x = np.concatenate([g, -g, [np.nan] if name.startswith("float8") else []]).astype(F32)
    x = np.concatenate([x, np.zeros(-len(x) % 2, F32)])
    tensor = FloatFakeQuant(name, 1.0).quantize(jnp.asarray(x))
    assert tensor.values.dtype == jnp.uint8 and tensor.format.name == name and tensor.format.element == name
    if BITS[name] == 4:
        assert tensor.packed and tensor.values.shape == (1, len(x) // 2)
        low, high = ml_codes(x[0::2], name), ml_codes(x[1::2], name)
        np.testing.assert_array_equal(np.asarray(tensor.values)[0], low | (high << 4))
    else:
        assert not tensor.packed and tensor.values.shape == x.shape
        np.testing.assert_array_equal(tensor.values, ml_codes(x, name))
    assert_same(tensor.dequantize(), x)
    np.testing.assert_array_equal(tensor.levels(), np.asarray(tensor.dequantize()))


# ---------------------------------------------------------------------------------------------------------------------
# Per-tensor and per-channel float scales.


@pytest.mark.parametrize("name", list(DTYPES))
@pytest.mark.slow
def test_static_scales_bit_exact(name):
    x = data(1, (6, 32))
    rows = (0.5, 0.125, 3.0, 0.01, 1.0, 7.0)
    columns = tuple(np.exp2(np.arange(32) % 7 - 3.0).tolist())
    for q, scale in (
        (FloatFakeQuant(name, 0.3), F32(0.3)),
        (FloatFakeQuant(name, rows, axis=0), np.asarray(rows, F32)[:, None]),
        (FloatFakeQuant(name, columns, axis=-1), np.asarray(columns, F32)[None, :]),
    ):
        want = ref_fake_quant_float(x, scale, name)
        assert_same(q(jnp.asarray(x)), want)
        tensor = q.quantize(jnp.asarray(x))
        assert_dequantizes_to(tensor, want)
        assert tensor.scale.dtype == jnp.float32 and tensor.scale.shape == np.broadcast_shapes(np.shape(scale), (1, 1))
        with np.errstate(invalid="ignore"):
            v = ftz(ftz(x) * (F32(1) / scale))
        np.testing.assert_array_equal(unpacked_codes(tensor), ml_codes(cast(v, name), name))


@pytest.mark.slow
def test_dynamic_scale_and_gradient():
    x = data(2, (4, 48), spread=20.0)
    for name in ("float8_e4m3fn", "float6_e2m3fn", "float4_e2m1fn"):
        for axis in (None, 0):
            q = DynamicFloatFakeQuant(name, axis=axis)
            tensor = q.quantize(jnp.asarray(x))
            want_scale = ref_dynamic_scale(x, name, axis)
            np.testing.assert_array_equal(np.asarray(tensor.scale).reshape(-1), want_scale)
            scale = want_scale.reshape((-1, 1) if axis == 0 else (1, 1))
            want = ref_fake_quant_float(x, scale, name)
            assert_same(q(jnp.asarray(x)), want)
            assert_dequantizes_to(tensor, want)
            assert tensor.layout.axes == (() if axis is None else (0,))
    # The largest magnitude keeps its gradient; the scale gets none (stop_gradient); infinities get 0.
    q = DynamicFloatFakeQuant("float8_e4m3fn", axis=0)
    grad = np.asarray(jax.jit(jax.grad(lambda x_: jnp.sum(q(x_))))(jnp.asarray(x)))
    np.testing.assert_array_equal(grad, np.where(np.isfinite(x), 1.0, 0.0))
    # A zero tensor: the smallest normal scale, exact zeros.
    zero = q.quantize(jnp.zeros((2, 4)))
    np.testing.assert_array_equal(zero.scale, np.full((2, 1), np.finfo(F32).tiny))
    np.testing.assert_array_equal(zero.dequantize(), np.zeros((2, 4)))


@pytest.mark.slow
def test_learned_scale_gradient_and_init():
    x = data(3, (3, 16))[1:]  # finite rows
    q = LearnedFloatFakeQuant.init_from(jnp.asarray(x), "float6_e3m2fn", axis=0)
    assert q.scale.shape == (2,) and q.scale.dtype == jnp.float32
    np.testing.assert_array_equal(q.scale, ref_dynamic_scale(x, "float6_e3m2fn", 0))
    q = LearnedFloatFakeQuant("float6_e3m2fn", jnp.array([0.05, 2.0]), axis=0)
    g = np.asarray(np.random.default_rng(0).normal(size=x.shape), F32)
    out, pullback = jax.vjp(lambda q_: q_(jnp.asarray(x)), q)
    scale = np.array([[0.05], [2.0]], F32)
    assert_same(out, ref_fake_quant_float(x, scale, "float6_e3m2fn"))
    # d out / d scale = q(v) - v inside the range, sign(v) * M outside, summed per channel, times the LSQ factor
    # 1 / sqrt(numel * M) with numel = 16 elements per channel.
    v = ftz(x * (F32(1) / scale)).astype(np.float64)
    m = largest("float6_e3m2fn")
    d = np.where(np.abs(v) <= m, cast(v.astype(F32), "float6_e3m2fn") - v, np.sign(v) * m)
    want = (g * d).sum(-1) / np.sqrt(16 * m)
    np.testing.assert_allclose(pullback(jnp.asarray(g))[0].scale, want, rtol=1e-5)
    assert_dequantizes_to(q.quantize(jnp.asarray(x)), np.asarray(out))
    # Below `min_scale`, the scale in use is `min_scale` and the leaf still receives a gradient.
    small = LearnedFloatFakeQuant("float8_e4m3fn", 1e-9, min_scale=1e-3)
    y = jnp.array([0.1, -0.3])
    assert_same(small(y), ref_fake_quant_float(np.asarray(y), F32(1e-3), "float8_e4m3fn"))
    assert float(jax.grad(lambda q_: jnp.sum(q_(y)))(small).scale) != 0.0
    # Stacked: one quantizer per stacked tensor.
    stacked = LearnedFloatFakeQuant.init_from(jnp.asarray(np.stack([x, 2 * x])), "float8_e4m3fn", stacked=1)
    np.testing.assert_array_equal(
        stacked.scale, [ref_dynamic_scale(x, "float8_e4m3fn")[0], ref_dynamic_scale(2 * x, "float8_e4m3fn")[0]]
    )


@pytest.mark.slow
def test_nan_and_half_precision():
    x = jnp.array([0.5, np.nan, -3.0, 100.0])
    # FP8 stores NaN as its NaN code; FP4 under a float scale has none, so `quantize` refuses it.
    tensor = FloatFakeQuant("float8_e5m2", 1.0).quantize(x)
    assert_dequantizes_to(tensor, np.asarray(FloatFakeQuant("float8_e5m2", 1.0)(x)))
    assert int(tensor.values[1]) == int(ml_codes(np.nan, "float8_e5m2"))
    with pytest.raises(ValueError, match=r"`x` holds NaN \(at index \(1,\)\).*float4_e2m1fn"):
        FloatFakeQuant("float4_e2m1fn", 1.0).quantize(x)
    # bfloat16 in, bfloat16 out, and the dequantized tensor in bfloat16 too.
    xb = jnp.asarray(data(4, (2, 32)), jnp.bfloat16)
    for q in (DynamicFloatFakeQuant("float8_e4m3fn"), MXFakeQuant("mxfp4"), NVFP4FakeQuant()):
        out = q(xb)
        assert out.dtype == jnp.bfloat16
        tensor = q.quantize(xb)
        assert tensor.dtype == "bfloat16"
        assert_same(tensor.dequantize().astype(jnp.float32), np.asarray(out.astype(jnp.float32)))


# ---------------------------------------------------------------------------------------------------------------------
# MX and NVFP4.


def mx_data(seed, rows, cols):
    """Blocks of 32 with magnitudes from 2**-130 to 2**120, and a zero block, a NaN block and an inf block."""
    rng = np.random.default_rng(seed)
    magnitudes = np.exp2(rng.uniform(-130, 120, (rows, cols // 32, 1))).repeat(32, -1).reshape(rows, cols)
    x = (data(seed, (rows, cols), spread=4.0) * magnitudes).astype(F32)
    x[0, :32] = 0.0
    x[1, 3] = np.nan
    x[2, 40] = np.inf
    return x


@pytest.mark.slow
def test_mx_bit_exact():
    x = mx_data(5, 4, 64)
    for fmt in MX:
        for rule in ("floor", "rceil"):
            q = MXFakeQuant(fmt, scale_rule=rule)
            want = ref_mx(x, fmt, 32, rule)
            assert_same(q(jnp.asarray(x)), want)
            tensor = q.quantize(jnp.asarray(x))
            assert tensor.format == eqx_quant.mx_format(fmt, scale_rule=rule) and tensor.layout.group_size == 32
            assert tensor.layout.tile_axis(tensor.shape) == 1 and tensor.format.scale == "e8m0"
            assert tensor.scale.dtype == jnp.uint8 and tensor.scale.shape == (4, 2, 1)  # against the view (4, 2, 32)
            np.testing.assert_array_equal(tensor.scale[..., 0], ref_mx_exponents(x, fmt, 32, rule))
            assert_dequantizes_to(tensor, want)
            # Elements of finite blocks: `ml_dtypes` codes of x / X; E8M0 bytes read by `ml_dtypes` give X.
            scale = np.asarray(tensor.scale[..., 0]).view(ml_dtypes.float8_e8m0fnu).astype(np.float64)
            ok = np.isfinite(scale).repeat(32, -1)
            v = (x.astype(np.float64) / scale.repeat(32, -1)).astype(F32)
            np.testing.assert_array_equal(unpacked_codes(tensor)[ok], ml_codes(cast(v, MX[fmt][0]), MX[fmt][0])[ok])
    # Blocks of 8 along axis 0 (a zero block and a NaN block among them).
    q = MXFakeQuant("mxfp6_e2m3", axis=0, block_size=8, scale_rule="rceil")
    xt = np.ascontiguousarray(mx_data(6, 4, 64)[:2].reshape(8, 16).T)
    want = ref_mx(xt.T, "mxfp6_e2m3", 8, "rceil").T
    assert_same(q(jnp.asarray(xt)), want)
    tensor = q.quantize(jnp.asarray(xt))
    assert tensor.layout.tile_axis(tensor.shape) == 0 and tensor.scale.shape == (2, 1, 8)
    np.testing.assert_array_equal(tensor.scale[:, 0], ref_mx_exponents(xt.T, "mxfp6_e2m3", 8, "rceil").T)
    assert_dequantizes_to(tensor, want)
    for i in (0, 5, 12):
        assert_same(tensor.dequantize_row(i), want[i])


@pytest.mark.slow
def test_nvfp4_bit_exact():
    rng = np.random.default_rng(7)
    x = (data(7, (4, 64)) * np.exp2(rng.uniform(-12, 0, (4, 4, 1))).repeat(16, -1).reshape(4, 64)).astype(F32)
    x[1, 20] = np.nan
    x[3, 48:] = 0.0
    want = ref_nvfp4(x.reshape(1, -1)).reshape(x.shape)
    q = NVFP4FakeQuant()
    assert_same(q(jnp.asarray(x)), want)
    tensor = q.quantize(jnp.asarray(x))
    t, b = ref_nvfp4_scales(x)
    assert tensor.format.name == "nvfp4" and tensor.layout.group_size == 16 and tensor.format.scale == "e4m3"
    assert tensor.tensor_scale is not None and tensor.tensor_scale.dtype == jnp.float32
    np.testing.assert_array_equal(tensor.tensor_scale, t)
    np.testing.assert_array_equal(tensor.scale[..., 0], b)
    assert int(tensor.scale[1, 1, 0]) == 0x7F  # the NaN block's scale is E4M3 NaN
    assert_dequantizes_to(tensor, want)
    for i in range(4):
        assert_same(tensor.dequantize_row(i), want[i])
    # Along axis 0.
    assert_same(NVFP4FakeQuant(axis=0)(jnp.asarray(x[:, :16].T)), ref_nvfp4(x[:, :16].reshape(1, -1)).reshape(4, 16).T)
    tensor = NVFP4FakeQuant(axis=0).quantize(jnp.asarray(np.ascontiguousarray(x[:, :16].T)))
    assert tensor.scale.shape == (1, 1, 4) and tensor.values.shape == (16, 2)


@pytest.mark.slow
def test_jit_vmap_and_stacked_tensors():
    x = jnp.asarray(mx_data(8, 3, 64)[:, :64])
    quantizers = (
        MXFakeQuant("mxfp4"),
        NVFP4FakeQuant(),
        DynamicFloatFakeQuant("float8_e4m3fn", axis=0),
        FloatFakeQuant("float8_e5m2", (0.5, 1.0, 2.0), axis=0),
    )
    for q in quantizers:
        eager = q(x)
        assert_same(eqx.filter_jit(q)(x), eager)
        jitted = eqx.filter_jit(q.quantize)(x)
        assert_trees_equal(jitted, q.quantize(x))
        # Stacked: `quantize` mapped over two tensors gives one stacked tensor, which dequantizes slice by slice.
        if isinstance(q, eqx_quant.FakeQuant):
            continue
        pair = jnp.stack([x, -2 * x])
        # Mapped under `jit`: mapped eagerly, each operation would compile on its own.
        tensor = eqx.filter_jit(eqx.filter_vmap(q.quantize))(pair)
        assert tensor.stack_depth == 1 and tensor.shape == x.shape
        mapped = eqx.filter_jit(jax.vmap(q))(pair)
        assert_same(tensor.dequantize(), mapped)
        assert_same(mapped[1], q(-2 * x))
    # vmap over rows of a per-tensor dynamic quantizer: one scale per row, as a loop over rows.
    q = DynamicFloatFakeQuant("float8_e5m2")
    rows = jax.vmap(q)(x)
    for i in range(3):
        assert_same(rows[i], q(x[i]))


@pytest.mark.slow
def test_gradients_straight_through():
    x = jnp.array([[0.1, -0.7, 3.0, 7.0], [1.0, 2.0, -13.0, 0.25]])
    # Each gradient compiled as one program (eagerly, each of its operations would compile on its own).
    # FP4, scale 1: 7 and -13 saturate and pass nothing.
    grad = jax.jit(jax.grad(lambda x_: jnp.sum(FloatFakeQuant("float4_e2m1fn", 1.0)(x_))))(x)
    np.testing.assert_array_equal(grad, [[1, 1, 1, 0], [1, 1, 0, 1]])
    # MX floor, blocks of 4: block 0 has X = 1 and 7 saturates; block 1 (amax 13) X = 2**(3 - 2) = 2: -13 / 2
    # saturates to -6 as well. rceil saturates nothing.
    grad = jax.jit(jax.grad(lambda x_: jnp.sum(MXFakeQuant("mxfp4", block_size=4)(x_))))(x)
    np.testing.assert_array_equal(grad, [[1, 1, 1, 0], [1, 1, 0, 1]])
    grad = jax.jit(jax.grad(lambda x_: jnp.sum(MXFakeQuant("mxfp4", block_size=4, scale_rule="rceil")(x_))))(x)
    np.testing.assert_array_equal(grad, np.ones((2, 4)))
    grad = jax.jit(jax.grad(lambda x_: jnp.sum(NVFP4FakeQuant()(x_))))(jnp.linspace(-3.0, 3.0, 16))
    np.testing.assert_array_equal(grad, np.ones(16))


@pytest.mark.slow
def test_errors():
    x = jnp.ones((2, 32))
    for cls, args in ((LearnedFloatFakeQuant, ("float8_e4m3fn", 1.0)), (eqx_quant.LearnedFakeQuant, (1.0, -8, 7))):
        for bad in ("x", None, True):
            with pytest.raises(TypeError, match="min_scale"):
                cls(*args, min_scale=bad)
    with pytest.raises(ValueError, match="`dtype`"):
        FloatFakeQuant("float8_e4m3", 1.0)
    with pytest.raises(TypeError, match="dtype"):
        DynamicFloatFakeQuant(8)  # pyright: ignore[reportArgumentType]
    for bad in (0.0, -1.0, float("nan"), 1e-39):
        with pytest.raises(ValueError, match="`scale`"):
            FloatFakeQuant("float8_e4m3fn", bad)
    with pytest.raises(ValueError, match="per-channel `scale` needs `axis`"):
        FloatFakeQuant("float8_e4m3fn", (1.0, 2.0))
    with pytest.raises(ValueError, match="`scale` does not fit `x`"):
        FloatFakeQuant("float8_e4m3fn", (1.0, 2.0, 3.0), axis=0)(x)
    with pytest.raises(TypeError, match="`x` must be a floating array|parameter 'x'"):
        FloatFakeQuant("float8_e4m3fn", 1.0)(jnp.ones(3, jnp.int32))
    with pytest.raises(TypeError, match="`x` must be a floating array|parameter 'x'"):
        MXFakeQuant("mxfp4").quantize(jnp.ones(32, jnp.int32))
    with pytest.raises(ValueError, match="`scale` must have 1 dimension"):
        LearnedFloatFakeQuant("float8_e4m3fn", 1.0, axis=0)
    with pytest.raises(ValueError, match="`scale` must be finite and positive"):
        LearnedFloatFakeQuant("float8_e4m3fn", jnp.array([1.0, -1.0]), axis=0)
    with pytest.raises(ValueError, match="`x` is empty"):
        LearnedFloatFakeQuant.init_from(jnp.ones((0, 3)), "float8_e4m3fn")
    with pytest.raises(ValueError, match="`fmt`.*fmt='mxfp5'"):
        MXFakeQuant("mxfp5")
    with pytest.raises(ValueError, match="`scale_rule`"):
        MXFakeQuant("mxfp4", scale_rule="ceil")
    with pytest.raises(ValueError, match="`block_size` must be >= 1"):
        MXFakeQuant("mxfp4", block_size=0)
    with pytest.raises(TypeError, match="block_size"):
        MXFakeQuant("mxfp4", block_size=32.0)  # pyright: ignore[reportArgumentType]
    with pytest.raises(TypeError, match="axis"):
        NVFP4FakeQuant(axis=None)  # pyright: ignore[reportArgumentType]
    for call in (MXFakeQuant("mxfp4", block_size=3), MXFakeQuant("mxfp4", block_size=3).quantize):
        with pytest.raises(ValueError, match="`block_size`.*block_size=3"):
            call(x)
    for call in (NVFP4FakeQuant(axis=0), NVFP4FakeQuant(axis=0).quantize):
        with pytest.raises(ValueError, match="multiple of 16, got axis=0 of length 2"):
            call(x)
    with pytest.raises(ValueError, match="`axis` must be in"):
        MXFakeQuant("mxfp4", axis=2).quantize(x)
    with pytest.raises(ValueError, match="`dequantize_row` needs"):
        MXFakeQuant("mxfp4").quantize(jnp.ones(32)).dequantize_row(0)
    # The constructors of earlier releases make the one family of quantizers, with a float format.
    made = (FloatFakeQuant("float8_e4m3fn", 1.0), DynamicFloatFakeQuant("float8_e4m3fn"),
            LearnedFloatFakeQuant("float8_e4m3fn", 1.0), MXFakeQuant("mxfp4"), NVFP4FakeQuant())  # fmt: skip
    kinds = (eqx_quant.FakeQuant, eqx_quant.DynamicFakeQuant, eqx_quant.LearnedFakeQuant, eqx_quant.DynamicFakeQuant,
             eqx_quant.DynamicFakeQuant)  # fmt: skip
    assert all(type(q) is kind and isinstance(q, AbstractFloatQuantizer) for q, kind in zip(made, kinds, strict=True))
    assert all(isinstance(q.format, eqx_quant.FloatFormat) for q in made)


# ---------------------------------------------------------------------------------------------------------------------
# Conversion: the converted forward is the fake-quant forward, bit for bit.


def _fp8_weights(path, layer):
    """FP8 e4m3 weights with a static scale per output channel, fitted to the layer's weight."""
    w = np.abs(np.asarray(layer.weight)).reshape(layer.weight.shape[0], -1).max(-1)
    return FloatFakeQuant("float8_e4m3fn", tuple(np.maximum(w / 448, 1e-6).tolist()), axis=0)


def _schemes(conv):
    """(name, weights, activations): FP8 W8A8, MXFP4 weights with MXFP8 activations, NVFP4 W4A4, blocked along the
    contraction (the input channels of a convolution)."""
    w_axis, x_axis = (1, 0) if conv else (-1, -1)
    return [
        ("fp8", _fp8_weights, DynamicFloatFakeQuant("float8_e4m3fn")),
        ("mxfp4", MXFakeQuant("mxfp4", axis=w_axis), MXFakeQuant("mxfp8_e4m3", axis=x_axis)),
        ("nvfp4", NVFP4FakeQuant(axis=w_axis), NVFP4FakeQuant(axis=x_axis)),
    ]


@eqx.filter_jit
def _batched(model, x):
    return jax.vmap(model)(x)


@eqx.filter_jit
def _batched_pair(first, second, x):
    """`_batched(first, x)` and `_batched(second, x)`, compiled as one program."""
    return jax.vmap(first)(x), jax.vmap(second)(x)


@pytest.mark.parametrize("conv", slow_unless([False], [False, True]), ids=["mlp", "convnet"])
def test_convert_bit_exact(conv):
    if conv:
        make = lambda key: eqx.nn.Sequential(  # noqa: E731
            [
                eqx.nn.Conv2d(32, 32, 3, padding=1, key=key),
                eqx.nn.Lambda(jax.nn.relu),
                eqx.nn.Conv2d(32, 16, 3, key=key),
            ]
        )
        x = jnp.asarray(np.random.default_rng(0).normal(size=(2, 32, 5, 5)).astype(F32))
        int_type = IntConv
    else:
        make = lambda key: eqx.nn.MLP(32, 16, 32, 2, key=key)  # noqa: E731
        x = jnp.asarray(np.random.default_rng(0).normal(size=(4, 32)).astype(F32))
        int_type = IntLinear
    model = init(make, 1)
    for name, weights, activations in _schemes(conv):
        fake = eqx_quant.quantize(model, weights=weights, activations=activations)
        real = eqx_quant.convert(fake)
        layers = [layer for layer in jax.tree.leaves(real, is_leaf=lambda n: isinstance(n, int_type))
                  if isinstance(layer, int_type)]  # fmt: skip
        assert len(layers) == (2 if conv else 3)
        for layer in layers:
            assert isinstance(layer.qweight, FloatQuantizedTensor)
            assert layer.qweight.format.name == {"fp8": "float8_e4m3fn", "mxfp4": "mxfp4", "nvfp4": "nvfp4"}[name]
            assert layer.qweight.values.dtype == jnp.uint8
        got, want = _batched_pair(real, fake, x)
        assert_same(got, np.asarray(want))


@pytest.mark.slow
def test_convert_embedding_stacked_and_learned_inputs():
    # An embedding: its lookup dequantizes one row, bit for bit the fake-quantized table's.
    emb = init(lambda key: eqx.nn.Embedding(8, 32, key=key), 2)
    fake = QuantEmbedding(emb, weight_quant=MXFakeQuant("mxfp6_e3m2"))
    real = eqx_quant.convert(fake)
    assert isinstance(real, IntEmbedding) and isinstance(real.qweight, FloatQuantizedTensor)
    for i in (0, 5):
        assert_same(real(jnp.asarray(i)), np.asarray(fake(jnp.asarray(i))))
    # Stacked linear layers (eqx.filter_vmap): one tensor per layer, stacked.
    stack = init(lambda key: eqx.filter_vmap(lambda k: eqx.nn.Linear(32, 8, key=k))(jax.random.split(key, 3)), 3)
    for quantizer in (NVFP4FakeQuant(), DynamicFloatFakeQuant("float4_e2m1fn", axis=0)):
        fake = QuantLinear(stack, weight_quant=quantizer, input_quant=None)
        real = eqx_quant.convert(fake)
        assert real.qweight.stack_depth == 1 and real.qweight.shape == (8, 32)
        assert_same(real.weight, np.asarray(fake.weight))
    # A per-tensor learned float input quantizer is frozen into a static one with the same scale.
    linear = init(lambda key: eqx.nn.Linear(32, 8, key=key), 4)
    x = jnp.asarray(np.random.default_rng(1).normal(size=(32,)).astype(F32))
    fake = QuantLinear(
        linear, weight_quant=MXFakeQuant("mxfp4"), input_quant=LearnedFloatFakeQuant("float8_e4m3fn", 0.01)
    )
    real = eqx_quant.convert(fake)
    assert real.input_quant == FloatFakeQuant("float8_e4m3fn", float(F32(0.01)))
    assert_same(real(x), np.asarray(fake(x)))
    # Float weights with integer inputs compute in floating point on both sides.
    fake = QuantLinear(linear, weight_quant=NVFP4FakeQuant(), input_quant=eqx_quant.DynamicFakeQuant(8))
    assert_same(eqx_quant.convert(fake)(x), np.asarray(fake(x)))
    # A stacked layer's per-tensor learned input quantizer holds one scale per layer: it stays learned, and the
    # converted stack, run with `jax.lax.scan`, computes what the fake-quantized one does.
    inputs = LearnedFloatFakeQuant.init_from(
        jnp.ones((3, 32)) * jnp.arange(1.0, 4.0)[:, None], "float8_e4m3fn", stacked=1
    )
    fake = QuantLinear(stack, weight_quant=MXFakeQuant("mxfp4"), input_quant=inputs)
    real = eqx_quant.convert(fake)
    assert real.input_quant is inputs

    def scanned(layer):
        arrays, static = eqx.partition(layer, eqx.is_array)
        return jax.lax.scan(lambda carry, a: (carry, eqx.combine(a, static)(x)), 0, arrays)[1]

    assert_same(scanned(real), np.asarray(scanned(fake)))


# ---------------------------------------------------------------------------------------------------------------------
# save / load / export_safetensors.


def _converted(seed, weights, activations):
    model = init(lambda key: eqx.nn.MLP(32, 16, 32, 2, key=key), seed)
    return eqx_quant.convert(eqx_quant.quantize(model, weights=weights, activations=activations))


def _mixed(seed, rule="floor", input_scale=0.02, fmt="mxfp4"):
    """Three layers: MXFP4 (with MXFP8 inputs), NVFP4 W4A4, FP8 weights with a static FP8 input scale."""
    return _converted(
        seed,
        {r"0": MXFakeQuant(fmt, scale_rule=rule), r"1": NVFP4FakeQuant(), r"2": _fp8_weights},
        {r"0": MXFakeQuant("mxfp8_e4m3"), r"1": NVFP4FakeQuant(), r"2": FloatFakeQuant("float8_e4m3fn", input_scale)},
    )


@pytest.mark.slow
def test_save_load_round_trip_and_checks(tmp_path):
    model = _mixed(0)
    path = tmp_path / "model.eqx"
    eqx_quant.save(path, model)
    like = _mixed(1, input_scale=0.5)  # other weights, another static input scale
    loaded = eqx_quant.load(path, like)
    assert_trees_equal(loaded, model)
    x = jnp.asarray(np.random.default_rng(2).normal(size=(3, 32)).astype(F32))
    assert_same(_batched(loaded, x), np.asarray(_batched(model, x)))
    # The header describes the codes: format, scale rule, block size.
    header = json.loads(path.read_bytes()[16 : 16 + int.from_bytes(path.read_bytes()[8:16], "little")])
    table = header["quantized_arrays"]
    rows = {p: dict(zip(table["fields"], row, strict=True)) for p, row in table["tensors"].items()}
    assert rows["layers.0.qweight"]["format"] == "mxfp4" and rows["layers.0.qweight"]["layout"][1] == 32
    assert rows["layers.1.qweight"]["format"] == "nvfp4" and rows["layers.1.qweight"]["layout"][1] == 16
    assert header["static_quantizers"]["layers.2.input_quant"]["format"] == "float8_e4m3fn"
    # A `like` of another scale rule (same shapes) or another format is refused, naming the fields.
    with pytest.raises(ValueError, match="format='mxfp4' in .* but format='mxfp4_rceil' in `like`"):
        eqx_quant.load(path, _mixed(1, rule="rceil"))
    with pytest.raises(ValueError, match="format='mxfp4'.*format='mxfp6_e2m3'.* in `like`"):
        eqx_quant.load(path, _mixed(1, fmt="mxfp6_e2m3"))
    # A static integer input quantizer where the file has a float one: the file's format is restored.
    integer_input = eqx.tree_at(lambda m: m.layers[2].input_quant, like, eqx_quant.FakeQuant(0.02, -128, 127))
    assert eqx_quant.load(path, integer_input).layers[2].input_quant == FloatFakeQuant("float8_e4m3fn", 0.02)


def test_export_safetensors_decodes_with_ml_dtypes(tmp_path):
    model = _mixed(0)
    path = tmp_path / "model.safetensors"
    eqx_quant.export_safetensors(path, model)
    tensors = safetensors.numpy.load_file(str(path))
    with open(path, "rb") as f:
        metadata = json.loads(f.read(int.from_bytes(f.read(8), "little")))["__metadata__"]
    info = [json.loads(metadata[f"layers.{i}"]) for i in range(3)]
    assert info[0]["format"] == "mxfp4" and info[0]["scale_rule"] == "floor" and info[0]["block_size"] == 32
    assert info[0]["scale_format"] == "float8_e8m0fnu" and info[0]["packed_fp4"] and info[0]["nibble_order"]
    assert info[0]["input"]["format"] == "mxfp8_e4m3"
    assert info[1]["format"] == "nvfp4" and info[1]["scale_format"] == "float8_e4m3fn"
    assert info[2]["format"] == "float8_e4m3fn" and info[2]["input"]["scale"] == 0.02
    # Decoded from the file with NumPy and ml_dtypes alone, each weight is the converted layer's weight.

    def nibbles(codes):
        return np.stack([codes & 0xF, codes >> 4], -1).reshape(codes.shape[0], -1).view(ml_dtypes.float4_e2m1fn)

    codes, scale = tensors["layers.0.weight"], tensors["layers.0.weight_scale"]
    e8m0 = scale.view(ml_dtypes.float8_e8m0fnu).astype(F32).repeat(32, -1)
    mx = nibbles(codes).astype(F32) * e8m0
    codes, scale, t = (tensors[f"layers.1.weight{s}"] for s in ("", "_scale", "_tensor_scale"))
    nv = nibbles(codes).astype(F32) * (scale.view(ml_dtypes.float8_e4m3fn).astype(F32) * t).repeat(16, -1)
    fp8 = tensors["layers.2.weight_scale"] * tensors["layers.2.weight"].view(ml_dtypes.float8_e4m3fn).astype(F32)
    for i, w in enumerate((mx, nv, fp8)):
        assert_same(model.layers[i].weight, w)
        np.testing.assert_array_equal(tensors[f"layers.{i}.bias"], model.layers[i].layer.bias)


def test_file_sizes(tmp_path):
    # Three 256 x 256 linear layers: MXFP4 at most 14% of the float32 file, NVFP4 at most 15%.
    model = init(lambda key: eqx.nn.MLP(256, 256, 256, 2, key=key), 5)
    eqx.tree_serialise_leaves(tmp_path / "float.eqx", model)
    base = (tmp_path / "float.eqx").stat().st_size
    for name, weights, limit in (("mxfp4", MXFakeQuant("mxfp4"), 0.14), ("nvfp4", NVFP4FakeQuant(), 0.15)):
        eqx_quant.save(tmp_path / f"{name}.eqx", eqx_quant.convert(eqx_quant.quantize(model, weights=weights)))
        assert (tmp_path / f"{name}.eqx").stat().st_size <= limit * base


def test_exported_learned_scale_is_the_scale_in_use():
    from eqx_quant._export import _input_metadata

    q = LearnedFloatFakeQuant("float8_e4m3fn", jnp.array([1e-9, 0.5]), axis=0, min_scale=1e-3)
    assert _input_metadata(q)["scale"] == [float(F32(1e-3)), 0.5]
    # The forward pass uses the same scales: 0.0123 / 1e-3 = 12.3 rounds to 12 on the E4M3 grid (steps of 1 in
    # [8, 16)), and 0.3 / 0.5 = 0.6 to 0.625 (steps of 1/16 in [0.5, 1)).
    x = jnp.array([[0.0123], [0.3]])
    np.testing.assert_array_equal(q(x), np.array([[F32(1e-3) * F32(12)], [F32(0.3125)]], F32))
