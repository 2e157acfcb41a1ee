"""Low-precision float formats: `fake_quant_float`, `mx_fake_quant` and `nvfp4_fake_quant`, checked bit for bit
against NumPy references that cast with `ml_dtypes`."""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import eqx_quant
from eqx_quant import fake_quant_float, mx_fake_quant, nvfp4_fake_quant


DTYPES = {
    "float8_e4m3fn": ml_dtypes.float8_e4m3fn,
    "float8_e5m2": ml_dtypes.float8_e5m2,
    "float6_e2m3fn": ml_dtypes.float6_e2m3fn,
    "float6_e3m2fn": ml_dtypes.float6_e3m2fn,
    "float4_e2m1fn": ml_dtypes.float4_e2m1fn,
}
BITS = {"float8_e4m3fn": 8, "float8_e5m2": 8, "float6_e2m3fn": 6, "float6_e3m2fn": 6, "float4_e2m1fn": 4}
MX = {
    "mxfp8_e4m3": ("float8_e4m3fn", 8),
    "mxfp8_e5m2": ("float8_e5m2", 15),
    "mxfp6_e2m3": ("float6_e2m3fn", 2),
    "mxfp6_e3m2": ("float6_e3m2fn", 4),
    "mxfp4": ("float4_e2m1fn", 2),
}
F32 = np.float32
TINY = np.finfo(F32).tiny


# ---------------------------------------------------------------------------------------------------------------------
# NumPy references. Float32 arithmetic as NumPy does it (correctly rounded), with subnormal results flushed to zeros
# of the same sign, as XLA does; the rounding onto a format is an `ml_dtypes` cast after saturating.


def ftz(a):
    a = np.asarray(a)
    return np.where(np.abs(a) < np.finfo(a.dtype).tiny, np.copysign(np.zeros_like(a), a), a)


def largest(name):
    return float(ml_dtypes.finfo(DTYPES[name]).max)


def cast(v, name):
    """`v` (float32) saturated to the format's range and cast with ml_dtypes; NaN kept (the 4- and 6-bit formats have
    no NaN, and ml_dtypes sends it to -0)."""
    v = np.asarray(v, F32)
    m = F32(largest(name))
    nan = np.isnan(v)
    c = np.clip(np.where(nan, F32(0), v), -m, m)
    q = np.asarray(c, F32).astype(DTYPES[name]).astype(F32)
    return np.where(nan, F32(np.nan), q)


def ref_fake_quant_float(x, scale, name):
    x = ftz(np.asarray(x, F32))
    s = np.asarray(scale, F32)
    with np.errstate(invalid="ignore", over="ignore"):
        v = ftz(x * (F32(1) / s))
        return ftz(s * cast(v, name))


def ref_mx(x, fmt, block_size, rule):
    """MX along the last axis, in float64 where exact (powers of two), block exponents from `np.frexp`/`np.ldexp`."""
    name, emax = MX[fmt]
    m = largest(name)
    x = ftz(np.asarray(x, F32))
    xb = x.reshape(*x.shape[:-1], -1, block_size).astype(np.float64)
    finite = np.isfinite(xb)
    bad = ~finite.all(-1, keepdims=True)
    amax = np.where(finite, np.abs(xb), 0).max(-1, keepdims=True)
    k = np.frexp(amax)[1] - 1  # floor(log2(amax)) for amax > 0
    e = k - emax
    if rule == "rceil":
        e = np.where(amax <= np.ldexp(m, e), e, e + 1)  # the smallest e with amax <= M * 2**e
    e = np.clip(np.where(amax == 0, -127, e), -127, 127)
    with np.errstate(invalid="ignore", over="ignore"):
        v = ftz((xb * np.ldexp(1.0, -e)).astype(F32))  # exact, but for subnormal results
        out = ftz((cast(v, name).astype(np.float64) * np.ldexp(1.0, e)).astype(F32))
    out = np.where(bad, F32(np.nan), out)
    return out.reshape(x.shape)


def ref_nvfp4(x):
    """NVFP4 along the last axis, one tensor scale per row of a 2-D `x`."""
    x = ftz(np.asarray(x, F32))
    xb = x.reshape(x.shape[0], -1, 16)
    finite = np.isfinite(xb)
    bad = ~finite.all(-1, keepdims=True)
    amax_b = np.where(finite, np.abs(xb), F32(0)).max(-1, keepdims=True)
    amax = amax_b.max(-2, keepdims=True)
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        t = ftz(amax / F32(2688))
        ratio = np.where(t > 0, ftz(amax_b / ftz(F32(6) * t)), F32(0))
        b = cast(np.clip(ratio, F32(0), F32(448)), "float8_e4m3fn")
        s = ftz(b * t)
        v = np.where(s > 0, ftz(xb * (F32(1) / s)), xb * F32(0))
        out = ftz(s * cast(v, "float4_e2m1fn"))
    return np.where(bad, F32(np.nan), out).reshape(x.shape)


def assert_same(got, want):
    """Bit-identical float32 arrays (signs of zeros included), NaN matching NaN."""
    got = np.asarray(got)
    want = np.asarray(want, got.dtype)
    assert got.shape == want.shape and got.dtype == want.dtype
    nan = np.isnan(want)
    np.testing.assert_array_equal(np.isnan(got), nan)
    differ = (got.view(np.uint32) != want.view(np.uint32)) & ~nan
    if differ.any():
        i = np.argwhere(differ)[0]
        raise AssertionError(f"{differ.sum()} entries differ; first at {tuple(i)}: got {got[tuple(i)]!r}, "
                             f"want {want[tuple(i)]!r}")  # fmt: skip


# ---------------------------------------------------------------------------------------------------------------------
# Random data over many magnitudes, plus every edge of every format.


def grid(name):
    """Every finite value of the format, as float32."""
    codes = np.arange(2 ** BITS[name], dtype=np.uint8).view(DTYPES[name]).astype(F32)
    return np.unique(codes[np.isfinite(codes)])


def edges(name):
    """Grid points, exact ties between neighbours and their float32 neighbours, values around and beyond the largest
    value, the smallest subnormal and its half, signed zeros, float32 subnormals and specials."""
    g = grid(name)
    m = F32(largest(name))
    sub = F32(ml_dtypes.finfo(DTYPES[name]).smallest_subnormal)
    ties = ((g[1:].astype(np.float64) + g[:-1]) / 2).astype(F32)  # exact in float32
    step_top = m - g[-2]
    beyond = np.array([m + step_top / 2, m + step_top, 2 * m, 1e30, np.finfo(F32).max, np.inf], F32)
    small = np.array([sub, sub / 2, sub * F32(0.75), sub / 4, TINY, TINY / 2, 1e-45, 0.0], F32)
    pieces = [g, ties, np.nextafter(ties, F32(np.inf)), np.nextafter(ties, F32(-np.inf)), beyond, small]
    pieces += [np.nextafter(m, F32(np.inf))[None], np.nextafter(m, F32(0))[None]]
    pos = np.concatenate(pieces)
    return np.concatenate([pos, -pos, np.array([np.nan, -np.nan], F32)]).astype(F32)


@pytest.fixture(scope="module")
def rng():
    return np.random.default_rng(20240501)


def _signs(rng, shape):
    return np.where(rng.random(shape) < 0.5, F32(-1), F32(1))


def test_reference_cast_rounds_ties_to_even():
    # The reference itself: ties between E2M1 neighbours go to the even mantissa, overflow saturates.
    np.testing.assert_array_equal(cast([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 7.0, -5.0], "float4_e2m1fn"),
                                  [0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, 6.0, -4.0])  # fmt: skip
    np.testing.assert_array_equal(cast([232.0, 464.0, np.inf], "float8_e4m3fn"), [224.0, 448.0, 448.0])


# ---------------------------------------------------------------------------------------------------------------------
# fake_quant_float


_all_formats = jax.jit(lambda x, s: [fake_quant_float(x, s, name) for name in DTYPES])


def test_fake_quant_float_random_million(rng):
    n = 1024
    x = (_signs(rng, (n, n)) * np.exp2(rng.uniform(-30, 20, (n, n)))).astype(F32)
    x[0, :8] = [np.nan, np.inf, -np.inf, 0.0, -0.0, 1e-40, -1e-40, np.finfo(F32).max]
    scale = (np.exp2(rng.integers(-6, 6, (n, 1))) * rng.uniform(1, 2, (n, 1))).astype(F32)
    outs = _all_formats(jnp.asarray(x), jnp.asarray(scale))
    for name, out in zip(DTYPES, outs, strict=True):
        assert out.dtype == jnp.float32
        assert_same(out, ref_fake_quant_float(x, scale, name))


@pytest.mark.parametrize("name", list(DTYPES))
@pytest.mark.slow
def test_fake_quant_float_edges_eager_jit_vmap(name):
    e = edges(name)
    e = np.concatenate([e, np.zeros((-len(e)) % 4, F32)])
    for scale in (1.0, 0.125, 0.3):
        want = ref_fake_quant_float(e, scale, name)
        assert_same(fake_quant_float(jnp.asarray(e), scale, name), want)
        jitted = _all_formats(jnp.asarray(e), jnp.asarray(scale, jnp.float32))[list(DTYPES).index(name)]
        assert_same(jitted, want)
        mapped = jax.vmap(lambda r, s=scale: fake_quant_float(r, s, name))(jnp.asarray(e).reshape(4, -1))
        assert_same(np.asarray(mapped).reshape(-1), want)
    # The hand-checked facts behind the reference: the grid maps to itself, ties go to the even neighbour and the
    # largest value is the saturation value.
    g = grid(name)
    np.testing.assert_array_equal(fake_quant_float(jnp.asarray(g), 1.0, name), g)
    m = largest(name)
    out = np.asarray(fake_quant_float(jnp.array([np.inf, -np.inf, 2 * m, np.nan]), 1.0, name))
    np.testing.assert_array_equal(out[:3], [m, -m, m])
    assert np.isnan(out[3])
    zeros = np.asarray(fake_quant_float(jnp.array([0.0, -0.0]), 1.0, name))
    np.testing.assert_array_equal(np.signbit(zeros), [False, True])


def test_fake_quant_float_hand_values():
    # E2M1 grid: 0, 0.5, 1, 1.5, 2, 3, 4, 6. Ties to even: 0.25 -> 0, 0.75 -> 1, 1.25 -> 1, 1.75 -> 2, 2.5 -> 2,
    # 3.5 -> 4, 5 -> 4.
    x = jnp.array([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 5.01, 6.9, -0.26, -100.0])
    np.testing.assert_array_equal(fake_quant_float(x, 1.0, jnp.float4_e2m1fn), [0, 1, 1, 2, 2, 4, 4, 6, 6, -0.5, -6])
    # E4M3: between 256 and 512 the step is 32; 272 is a tie that goes to 256, 304 one that goes to 320.
    x = jnp.array([272.0, 304.0, 449.0, 480.0, 2.0**-9, 2.0**-10, 1.5 * 2.0**-10])
    np.testing.assert_array_equal(
        fake_quant_float(x, 1.0, ml_dtypes.float8_e4m3fn), [256, 320, 448, 448, 2.0**-9, 0, 2.0**-9]
    )
    # E5M2 keeps inf out: values beyond 57344 saturate. E3M2 and E2M3 by name.
    np.testing.assert_array_equal(fake_quant_float(jnp.array([1e6, 61440.0]), 1.0, "float8_e5m2"), [57344, 57344])
    np.testing.assert_array_equal(
        fake_quant_float(jnp.array([26.0, 30.0, 0.21875]), 1.0, "float6_e3m2fn"), [24, 28, 0.25]
    )
    np.testing.assert_array_equal(
        fake_quant_float(jnp.array([7.25, 0.0625, 0.1875]), 1.0, "float6_e2m3fn"), [7, 0, 0.25]
    )
    # The scale: x / 0.5 = [0.6, 11] -> [0.5, 6] in E2M1, times 0.5.
    np.testing.assert_array_equal(fake_quant_float(jnp.array([0.3, 5.5]), 0.5, "float4_e2m1fn"), [0.25, 3.0])


def test_fake_quant_float_gradients_by_hand():
    x = jnp.array([0.3, 1.25, -2.6, 5.5, 6.0, 7.0, -100.0, np.nan, np.inf])
    g = jnp.array([1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, np.nan, 9.0])
    scale = jnp.ones_like(x)  # per-element scale: its gradient is not summed
    _, pullback = jax.vjp(lambda x_, s_: fake_quant_float(x_, s_, "float4_e2m1fn"), x, scale)
    grad_x, grad_s = pullback(g)
    np.testing.assert_array_equal(grad_x, [1, 2, 3, 4, 5, 0, 0, 0, 0])
    # inside: g * (q(v) - v) = 1*(0.5-0.3), 2*(1-1.25), 3*(-3+2.6), 4*(6-5.5), 5*0; outside: g * sign(v) * 6.
    want = [0.2, -0.5, -1.2, 2.0, 0.0, 36.0, -42.0, 0.0, 54.0]
    np.testing.assert_allclose(grad_s, want, rtol=1e-6, atol=1e-6)
    # A scalar scale of 2 receives the sum; v = x / 2 = [1.5, 4, -0.5], q = [1.5, 4, -0.5], all on the grid, plus
    # 20 / 2 = 10 beyond 6: total 0 + 0 + 0 + 6 = 6; x gets [1, 1, 1, 0].
    gx, gs = jax.grad(lambda x_, s_: jnp.sum(fake_quant_float(x_, s_, "float4_e2m1fn")), argnums=(0, 1))(
        jnp.array([3.0, 8.0, -1.0, 20.0]), jnp.asarray(2.0)
    )
    np.testing.assert_array_equal(gx, [1, 1, 1, 0])
    assert float(gs) == 6.0
    # A per-row scale of shape (2, 1) sums along the row: row 0 v = [0.6, 1.4] -> q - v = [-0.1, 0.1] (sum 0 up to
    # rounding), row 1 v = [-9, 2.6] -> [-6, +(3 - 2.6)] = -5.6.
    gs = jax.grad(lambda s_: jnp.sum(fake_quant_float(jnp.array([[0.6, 1.4], [-9.0, 2.6]]), s_, "float4_e2m1fn")))(
        jnp.ones((2, 1))
    )
    np.testing.assert_allclose(gs, [[0.0], [-5.6]], atol=1e-6)


def test_fake_quant_float_half_precision_and_integers():
    x = np.array([0.3, 1.25, -2.6, 5.5, 100.0], np.float32)
    for dtype in (jnp.bfloat16, jnp.float16):
        out = fake_quant_float(jnp.asarray(x, dtype), 0.5, "float8_e4m3fn")
        assert out.dtype == dtype
        want = ref_fake_quant_float(np.asarray(jnp.asarray(x, dtype).astype(jnp.float32)), 0.5, "float8_e4m3fn")
        np.testing.assert_array_equal(np.asarray(out.astype(jnp.float32)), np.asarray(jnp.asarray(want, dtype), F32))
    out = fake_quant_float(jnp.array([1, 5, -7]), 1.0, "float4_e2m1fn")
    assert out.dtype == jnp.float32
    np.testing.assert_array_equal(out, [1, 4, -6])


def test_fake_quant_float_float64_rounds_once():
    # 1 + 2**-4 + 2**-30 lies just above the E4M3 tie between 1 and 1.125: rounded through float32 first, it would
    # become the tie and go to 1.
    with jax.enable_x64(True):
        x = jnp.array([1 + 2**-4 + 2**-30, 1 + 2**-4], jnp.float64)
        out = fake_quant_float(x, 1.0, "float8_e4m3fn")
        assert out.dtype == jnp.float64
        np.testing.assert_array_equal(out, np.asarray(x).astype(ml_dtypes.float8_e4m3fn).astype(np.float64))
        np.testing.assert_array_equal(out, [1.125, 1.0])


def test_fake_quant_float_errors():
    with pytest.raises(ValueError, match="`dtype`"):
        fake_quant_float(jnp.ones(3), 1.0, "float8_e4m3")
    with pytest.raises(ValueError, match="`dtype`"):
        fake_quant_float(jnp.ones(3), 1.0, jnp.float32)
    with pytest.raises(ValueError, match="`scale`"):
        fake_quant_float(jnp.ones(3), 0.0, "float4_e2m1fn")
    with pytest.raises(ValueError, match="`scale`"):
        fake_quant_float(jnp.ones(3), jnp.ones(2), "float4_e2m1fn")
    with pytest.raises(TypeError):
        fake_quant_float(jnp.ones(3), 1.0, 4)  # pyright: ignore[reportArgumentType]


# ---------------------------------------------------------------------------------------------------------------------
# mx_fake_quant


def _mx_all(x):
    return [mx_fake_quant(x, fmt, scale_rule=rule) for fmt in MX for rule in ("floor", "rceil")]


_mx_jit = jax.jit(_mx_all)


def _mx_data(rng, rows, cols, block_size=32):
    """Blocks whose magnitudes run over the whole float32 range (so both E8M0 clamps are reached), with values
    inside a block spread over about 2**-12 to 2**3 of the block's size, and special blocks mixed in."""
    nb = cols // block_size
    block_exp = rng.uniform(-140, 124, (rows, nb, 1))
    within = np.clip(rng.normal(0, 3, (rows, nb, block_size)), -12, 3)
    x = (_signs(rng, (rows, nb, block_size)) * np.exp2(block_exp + within)).astype(F32)
    x[0, 0] = 0.0
    x[0, 1, 3] = np.nan
    x[0, 2, 5] = -np.inf
    x[0, 3] = -0.0
    x[0, 4, :] = np.finfo(F32).max * _signs(rng, block_size)
    x[0, 5, :] = 1e-41  # float32 subnormals: zeros
    return x.reshape(rows, cols)


@pytest.mark.slow
def test_mx_random_million(rng):
    x = _mx_data(rng, 1024, 1024)
    outs = _mx_jit(jnp.asarray(x))
    i = 0
    for fmt in MX:
        for rule in ("floor", "rceil"):
            assert_same(outs[i], ref_mx(x, fmt, 32, rule))
            i += 1


@pytest.mark.slow
def test_mx_edges_eager_jit_vmap(rng):
    # Each format's edges, scaled by powers of two into blocks of 32 (so each block's scale differs), plus the
    # random blocks; along axis 0 for the eager call.
    e = np.concatenate([edges(name) for name, _ in MX.values()])
    e = np.concatenate([e, np.zeros((-len(e)) % 64, F32)]).reshape(-1, 32)
    with np.errstate(over="ignore"):
        e = e * np.exp2(rng.integers(-20, 20, (e.shape[0], 1))).astype(F32)
    x = np.concatenate([e, _mx_data(rng, 2, 32 * 8).reshape(-1, 32)]).reshape(-1, 64)
    jitted = _mx_jit(jnp.asarray(x))
    mapped = jax.jit(jax.vmap(_mx_all))(jnp.asarray(x))
    i = 0
    for fmt in MX:
        for rule in ("floor", "rceil"):
            want = ref_mx(x, fmt, 32, rule)
            assert_same(jitted[i], want)
            assert_same(mapped[i], want)
            if (i // 2) % 2 == i % 2:  # eager calls (each compiles): both rules, each with half of the formats
                eager = mx_fake_quant(jnp.asarray(x.T), fmt, axis=0, scale_rule=rule)
                assert_same(np.asarray(eager).T, want)
            i += 1


def test_mx_hand_values():
    # floor: amax 7 -> X = 2**(2 - 2) = 1, 7 saturates to 6; rceil: X = 2**ceil(log2(7 / 6)) = 2, 7 / 2 = 3.5 is a
    # tie that goes to 4.
    x = jnp.array([0.1, -0.7, 3.0, 7.0])
    np.testing.assert_array_equal(mx_fake_quant(x, "mxfp4", block_size=4), [0, -0.5, 3, 6])
    np.testing.assert_array_equal(mx_fake_quant(x, "mxfp4", block_size=4, scale_rule="rceil"), [0, -1, 3, 8])

    # rceil at a power of two: amax = 6 exactly gives X = 1; the next float32 up gives X = 2. The second entry tells
    # the two apart: with X = 2, 1.5 / 2 = 0.75 rounds to 1 -> 2; with X = 1 it stays 1.5.
    def rceil(*values):
        return mx_fake_quant(jnp.array(values, jnp.float32), "mxfp4", block_size=len(values), scale_rule="rceil")

    up = float(np.nextafter(F32(6), F32(7)))
    np.testing.assert_array_equal(rceil(6.0, 1.5), [6, 1.5])
    np.testing.assert_array_equal(rceil(up, 1.5), [6, 2])
    np.testing.assert_array_equal(rceil(-6.0, 1.5), [-6, 1.5])
    np.testing.assert_array_equal(rceil(12.0, 3.0), [12, 3])  # amax = 2 * 6: X = 2
    # E4M3 floor: amax 1000 -> X = 2**(9 - 8) = 2; 1000 / 2 = 500 saturates to 448 -> 896; 3 / 2 = 1.5 -> 3.
    np.testing.assert_array_equal(mx_fake_quant(jnp.array([1000.0, 3.0]), "mxfp8_e4m3", block_size=2), [896, 3])


@pytest.mark.slow
def test_mx_special_blocks():
    nan, inf = np.nan, np.inf
    x = jnp.array([0.0, -0.0, 0.0, 0.0, 1.0, nan, 2.0, 3.0, -inf, 1.0, 1.0, 1.0, 1.0, 2.0, 3.0, 4.0])
    for fmt in MX:
        for rule in ("floor", "rceil"):
            out = np.asarray(mx_fake_quant(x, fmt, block_size=4, scale_rule=rule))
            np.testing.assert_array_equal(out[:4], [0, 0, 0, 0])
            np.testing.assert_array_equal(np.signbit(out[:4]), [False, True, False, False])
            assert np.isnan(out[4:12]).all()
            np.testing.assert_array_equal(out[12:], [1, 2, 3, 4])  # on every grid


def test_mx_e8m0_clamps():
    # E2M1, floor: amax = 1.75 * 2**-126 has exponent -126, so X would be 2**-128; clamped to 2**-127, the element
    # is 3.5 -> 4 (not 7 -> saturated 6), giving 2**-125; 2**-126 is 2 -> 2**-126. The float32 product 2**-127 * 4 is
    # formed without the subnormal 2**-127.
    x = jnp.array([1.75 * 2.0**-126, 2.0**-126], jnp.float32)
    np.testing.assert_array_equal(mx_fake_quant(x, "mxfp4", block_size=2), np.array([2.0**-125, 2.0**-126], F32))
    # E4M3 floor: amax = 2**-120 -> X = 2**-127 (clamped from 2**-128), a scale that is subnormal in float32 and
    # still gives exact results: v = 128 and 24, on the grid.
    x = jnp.array([2.0**-120, 1.5 * 2.0**-123], jnp.float32)
    np.testing.assert_array_equal(mx_fake_quant(x, "mxfp8_e4m3", block_size=2), np.asarray(x))
    # rceil near the float32 maximum: X = 2**126 and max / X rounds up to 4, whose product 2**128 overflows to inf.
    big = np.finfo(F32).max
    out = mx_fake_quant(jnp.array([big, 2.0**126]), "mxfp4", block_size=2, scale_rule="rceil")
    np.testing.assert_array_equal(out, np.array([np.inf, 2.0**126], F32))
    out = mx_fake_quant(jnp.array([big, -(2.0**126)]), "mxfp4", block_size=2)  # floor: X = 2**125, 8 -> 6
    np.testing.assert_array_equal(out, np.array([1.5 * 2.0**127, -(2.0**126)], F32))


def test_mx_matches_fake_quant_float_with_block_scale(rng):
    x = (_signs(rng, (4, 32)) * np.exp2(rng.uniform(-8, 8, (4, 32)))).astype(F32)
    amax = np.abs(x).max(-1, keepdims=True)
    scale = np.exp2(np.frexp(amax)[1] - 1 - 8).astype(F32)
    np.testing.assert_array_equal(
        mx_fake_quant(jnp.asarray(x), "mxfp8_e4m3"),
        fake_quant_float(jnp.asarray(x), jnp.asarray(scale), "float8_e4m3fn"),
    )


def test_mx_gradients_by_hand():
    x = jnp.array([0.1, -0.7, 3.0, 7.0, 1.0, np.nan, 2.0, 3.0])
    g = jnp.arange(1.0, 9.0)
    _, pullback = jax.vjp(lambda x_: mx_fake_quant(x_, "mxfp4", block_size=4), x)
    # floor: X = 1 and 7 saturates; the NaN block passes nothing.
    np.testing.assert_array_equal(pullback(g)[0], [1, 2, 3, 0, 0, 0, 0, 0])
    _, pullback = jax.vjp(lambda x_: mx_fake_quant(x_, "mxfp4", block_size=4, scale_rule="rceil"), x)
    np.testing.assert_array_equal(pullback(g)[0], [1, 2, 3, 4, 0, 0, 0, 0])
    # The block scale is constant: the gradient of a sum is 1 for every unsaturated entry, also for the largest.
    grad = jax.grad(lambda x_: jnp.sum(mx_fake_quant(x_, "mxfp8_e4m3", block_size=2)))(jnp.array([3.0, 1.0, 5.0, -2.0]))
    np.testing.assert_array_equal(grad, [1, 1, 1, 1])


def test_mx_axis_and_dtypes():
    x = np.arange(1, 65, dtype=F32).reshape(2, 32) / 7
    want = ref_mx(x, "mxfp6_e3m2", 32, "floor")
    assert_same(mx_fake_quant(jnp.asarray(x.T), "mxfp6_e3m2", axis=0), want.T)
    x3 = np.stack([x, -x], axis=1)  # (2, 2, 32): blocks along the last axis
    assert_same(mx_fake_quant(jnp.asarray(x3), "mxfp6_e3m2", axis=2), ref_mx(x3, "mxfp6_e3m2", 32, "floor"))
    out = mx_fake_quant(jnp.asarray(x, jnp.bfloat16), "mxfp4")
    assert out.dtype == jnp.bfloat16
    want = ref_mx(np.asarray(jnp.asarray(x, jnp.bfloat16).astype(jnp.float32)), "mxfp4", 32, "floor")
    np.testing.assert_array_equal(np.asarray(out.astype(jnp.float32)), np.asarray(jnp.asarray(want, jnp.bfloat16), F32))


def test_mx_errors():
    x = jnp.ones((2, 32))
    with pytest.raises(ValueError, match="`fmt`"):
        mx_fake_quant(x, "mxfp5")
    with pytest.raises(ValueError, match="`scale_rule`"):
        mx_fake_quant(x, "mxfp4", scale_rule="ceil")
    with pytest.raises(ValueError, match="`block_size`"):
        mx_fake_quant(x, "mxfp4", block_size=0)
    with pytest.raises(ValueError, match=r"`block_size` must divide the length of axis=-1 .*block_size=3"):
        mx_fake_quant(x, "mxfp4", block_size=3)  # the axis as the caller gave it
    with pytest.raises(ValueError, match="`block_size`"):
        mx_fake_quant(x, "mxfp4", axis=0)
    with pytest.raises(ValueError, match="`axis`"):
        mx_fake_quant(x, "mxfp4", axis=2)
    with pytest.raises(ValueError, match="`x`"):
        mx_fake_quant(jnp.ones(()), "mxfp4", block_size=1)


# ---------------------------------------------------------------------------------------------------------------------
# nvfp4_fake_quant


_nvfp4_rows = jax.jit(jax.vmap(nvfp4_fake_quant))


def _nvfp4_data(rng, rows, cols):
    """Each row a tensor of its own magnitude; blocks spread over 2**-22 of the row's largest, so block scales cover
    the E4M3 subnormals and zero."""
    nb = cols // 16
    row_exp = rng.uniform(-110, 120, (rows, 1, 1))
    block_exp = rng.uniform(-22, 0, (rows, nb, 1))
    within = np.clip(rng.normal(0, 2, (rows, nb, 16)), -10, 0)
    x = (_signs(rng, (rows, nb, 16)) * np.exp2(row_exp + block_exp + within)).astype(F32)
    x[0, 0] = 0.0
    x[1, 1, 2] = np.nan
    x[2, 2, 3] = np.inf
    x[3] = 0.0  # a zero tensor
    x[4] *= F32(2.0**-100)  # a tensor whose t is subnormal: zeros
    return x.reshape(rows, cols)


def test_nvfp4_random_million(rng):
    x = _nvfp4_data(rng, 1024, 1024)
    assert_same(_nvfp4_rows(jnp.asarray(x)), ref_nvfp4(x))


@pytest.mark.slow
def test_nvfp4_edges_eager_jit_vmap(rng):
    x = _nvfp4_data(rng, 6, 64)
    e = edges("float4_e2m1fn")
    e = np.concatenate([e, np.zeros((-len(e)) % 64, F32)]).reshape(-1, 64)
    with np.errstate(over="ignore"):
        x = np.concatenate([x, e, e * F32(1e-3), e[:, ::-1] * F32(37.0)])
    want = ref_nvfp4(x)
    assert_same(_nvfp4_rows(jnp.asarray(x)), want)
    for i in range(x.shape[0]):
        assert_same(nvfp4_fake_quant(jnp.asarray(x[i])), want[i])
    single = jax.jit(nvfp4_fake_quant)
    assert_same(single(jnp.asarray(x[0])), want[0])
    # Blocks along axis 0: the whole 2-D array is one tensor.
    assert_same(nvfp4_fake_quant(jnp.asarray(x[:2].T), axis=0), ref_nvfp4(x[:2].reshape(1, -1)).reshape(2, -1).T)


def test_nvfp4_hand_values():
    # amax = 2688 -> t = 2688 / 2688 = 1. Block 0 has ratio 448 (b = 448): the grid is
    # 448 * t * E2M1. Block 1 has amax 50.4: ratio 8.4 -> b = 8, so 50.4 / 8 = 6.3 saturates to 6 -> 48 t, and 1.0 is
    # 0.125 -> 0 (below the E2M1 tie 0.25). Block 2 has amax 0.001: ratio 1.67e-4, below E4M3's half subnormal 2**-10,
    # so b = 0 and the block is zeros.
    x = np.zeros(48, F32)
    x[0], x[1], x[2] = 2688.0, 1000.0, -500.0
    x[16], x[17], x[18] = 50.4, 1.0, -9.0
    x[32], x[33] = 0.001, -0.0005
    t = F32(1)
    s0, s1 = F32(448) * t, F32(8) * t
    out = np.asarray(nvfp4_fake_quant(jnp.asarray(x)))
    np.testing.assert_array_equal(out[:3], [s0 * 6, s0 * 2, -s0])  # 1000 / 448 = 2.23 -> 2, -500 / 448 = -1.12 -> -1
    np.testing.assert_array_equal(out[16:19], [s1 * 6, 0.0, -s1])  # -9 / 8 = -1.125 -> -1
    np.testing.assert_array_equal(out[32:48], np.zeros(16))
    assert np.signbit(out[33])
    g = np.asarray(jax.grad(lambda x_: jnp.sum(nvfp4_fake_quant(x_)))(jnp.asarray(x)))
    want = np.ones(48, F32)
    # 2688 / 448 is 6, but 1 / 448 rounds up in float32 and 2688 * (1 / 448) = 6.0000005 saturates, as does 6.3.
    want[0] = want[16] = 0.0
    np.testing.assert_array_equal(g, want)


def test_nvfp4_scales_divide_as_the_format_specifies():
    # t = amax / 2688 and amax_b / (6 t), each correctly rounded: here 448 t is exactly amax / 6 = 11 / 128, so the
    # largest element comes back exactly. Multiplying by the float32 reciprocal of 2688 instead gives a t one ulp
    # larger, and 0.51562506 for the first element.
    x = np.array([0.515625] + [0.1] * 15, F32)
    want = np.array([0.515625] + [0.0859375] * 15, F32)
    for path in (nvfp4_fake_quant, jax.jit(nvfp4_fake_quant)):
        np.testing.assert_array_equal(path(jnp.asarray(x)), want)
    np.testing.assert_array_equal(
        jax.vmap(nvfp4_fake_quant)(jnp.asarray(np.stack([x, 2 * x]))), np.stack([want, 2 * want])
    )


def test_nvfp4_special_values():
    x = np.linspace(-5, 5, 64, dtype=F32)
    zeros = nvfp4_fake_quant(jnp.zeros(32))
    np.testing.assert_array_equal(zeros, np.zeros(32))
    for special in (np.nan, np.inf, -np.inf):
        y = x.copy()
        y[20] = special
        out = np.asarray(nvfp4_fake_quant(jnp.asarray(y)))
        assert np.isnan(out[16:32]).all()
        y[20] = 0.0  # the other blocks: as if the entry were zero
        clean = np.asarray(nvfp4_fake_quant(jnp.asarray(y)))
        assert_same(out[:16], clean[:16])
        assert_same(out[32:], clean[32:])
        y[20] = special
        _, pullback = jax.vjp(nvfp4_fake_quant, jnp.asarray(y))
        gx = np.asarray(pullback(jnp.ones(64))[0])
        np.testing.assert_array_equal(gx[16:32], np.zeros(16))


def test_nvfp4_errors():
    with pytest.raises(ValueError, match="`axis`.*length 20"):
        nvfp4_fake_quant(jnp.ones(20))
    with pytest.raises(ValueError, match="`axis`"):
        nvfp4_fake_quant(jnp.ones(16), axis=1)
    with pytest.raises(ValueError, match="`x`"):
        nvfp4_fake_quant(jnp.ones(()))


def test_exported():
    assert eqx_quant.fake_quant_float is fake_quant_float
    assert eqx_quant.mx_fake_quant is mx_fake_quant
    assert eqx_quant.nvfp4_fake_quant is nvfp4_fake_quant
