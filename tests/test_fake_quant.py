import re

import equinox as eqx
import hypothesis.extra.numpy as hnp
import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings

import eqx_quant
from eqx_quant import fake_quant, fake_quant_vjp

from .helpers import assert_bitwise_equal, reference_fake_quant, sum_to_shape


# ---------------------------------------------------------------------------------------------------------------------
# The worked examples.

EXAMPLES = [
    ([0.3, 1.25, -0.75, 2.6, -3.0], 0.5, -4, 3, [1, 1, 1, 1, 1], [0.5, 1.0, -1.0, 1.5, -2.0], [1, 1, 1, 0, 0]),
    (
        [[0.1, 0.6], [3.9, -0.2]],
        0.25,
        0,
        15,
        [[2, -1], [0.5, 3]],
        [[0, 0.5], [3.75, 0]],
        [[2, -1], [0, 0]],
    ),
    ([2.0, 2.5, -2.0, -2.25, 0.5], 1.0, -2, 2, [1, 2, 3, 4, 5], [2, 2, -2, -2, 0], [1, 0, 3, 0, 5]),
]


@pytest.mark.parametrize("x, scale, qmin, qmax, cot, values, grads", EXAMPLES)
def test_examples(x, scale, qmin, qmax, cot, values, grads):
    out = fake_quant_vjp(x, scale, qmin, qmax, cot)
    assert set(out) == {"values", "grads"}
    for key, expected in (("values", values), ("grads", grads)):
        assert isinstance(out[key], jax.Array)
        assert out[key].dtype == jnp.float32
        np.testing.assert_array_equal(np.asarray(out[key]), np.asarray(expected, np.float32))
    # The same through `jax.vjp` on the public function, and through NumPy inputs.
    y, pullback = jax.vjp(lambda x_: fake_quant(x_, scale, qmin, qmax), jnp.asarray(x, jnp.float32))
    np.testing.assert_array_equal(np.asarray(y), np.asarray(values, np.float32))
    np.testing.assert_array_equal(np.asarray(pullback(jnp.asarray(cot, jnp.float32))[0]), np.asarray(grads, np.float32))
    out_np = fake_quant_vjp(np.asarray(x), scale, qmin, qmax, np.asarray(cot))
    np.testing.assert_array_equal(np.asarray(out_np["values"]), np.asarray(values, np.float32))


def test_round_half_to_even():
    x = jnp.array([0.5, 1.5, 2.5, 3.5, -0.5, -1.5, -2.5, -3.5])
    np.testing.assert_array_equal(fake_quant(x, 1.0, -10, 10), [0, 2, 2, 4, -0, -2, -2, -4])


def test_fake_quant_vjp_accepts_python_scalars_and_jax_arrays():
    out = fake_quant_vjp(2.6, 0.5, -4, 3, 1)
    assert out["values"].shape == () and float(out["values"]) == 1.5 and float(out["grads"]) == 0.0
    out = fake_quant_vjp(jnp.array([1, 2], jnp.int32), 1.0, 0, 1, jnp.array([True, True]))
    np.testing.assert_array_equal(out["values"], [1.0, 1.0])
    np.testing.assert_array_equal(out["grads"], [1.0, 0.0])


# ---------------------------------------------------------------------------------------------------------------------
# Ties, boundaries and special values.


@pytest.mark.parametrize("scale", [0.5, 0.25, 2.0, 1 / 1024])
def test_ties_at_power_of_two_scales(scale):
    k = np.arange(-6, 6, dtype=np.float32)
    x = (k + 0.5) * np.float32(scale)  # exact ties
    expected = np.clip(np.round(k + 0.5), -4, 3) * np.float32(scale)
    out = fake_quant(jnp.asarray(x), scale, -4, 3)
    np.testing.assert_array_equal(out, expected)
    # halves go to even integers: 0.5 -> 0, 1.5 -> 2, 2.5 -> 2, -0.5 -> -0, -1.5 -> -2, -2.5 -> -2
    np.testing.assert_array_equal(np.asarray(out)[4:9] / np.float32(scale), [-2, -0, 0, 2, 2])


@pytest.mark.parametrize("scale", [0.1, 0.3, 0.7, 1 / 3, 0.0123])
def test_ties_and_neighbours_at_other_scales(scale):
    s = np.float32(scale)
    k = np.arange(-130, 130, dtype=np.float32)
    ties = (k + np.float32(0.5)) * s
    x = np.concatenate([ties, np.nextafter(ties, np.inf), np.nextafter(ties, -np.inf)])
    cot = np.linspace(-1, 1, x.size, dtype=np.float32)
    out = fake_quant_vjp(x, scale, -128, 127, cot)
    values, grad_x, _, _ = reference_fake_quant(x, scale, -128, 127, cotangent=cot)
    assert_bitwise_equal(out["values"], values)
    assert_bitwise_equal(out["grads"], grad_x)


def test_division_convention_is_reciprocal_multiplication():
    # For a scale that is not a power of two, `x * (1 / scale)` and `x / scale` round differently for some inputs.
    # eqx_quant documents and uses the former everywhere; this finds such inputs and checks which one is used.
    s = np.float32(0.3)
    ties = (np.arange(-1000, 1000, dtype=np.float32) + np.float32(0.5)) * s
    x = np.concatenate([ties, np.nextafter(ties, np.inf), np.nextafter(ties, -np.inf)])
    by_product = np.round(x * (np.float32(1) / s))
    by_division = np.round(x / s)
    differ = by_product != by_division
    assert differ.sum() > 0
    out = np.asarray(fake_quant(jnp.asarray(x[differ]), 0.3, -1000, 1000))
    np.testing.assert_array_equal(out, s * by_product[differ])


def test_entries_at_the_range_ends_and_one_ulp_outside():
    scale = 0.25  # a power of two, so x / scale is exact and an ulp in x is an ulp in x / scale
    lo, hi = np.float32(-8 * scale), np.float32(7 * scale)
    x = np.array(
        [lo, hi, np.nextafter(lo, -np.inf), np.nextafter(hi, np.inf), np.nextafter(lo, 0), np.nextafter(hi, 0)]
    )
    out = fake_quant_vjp(x, scale, -8, 7, np.ones_like(x))
    np.testing.assert_array_equal(out["values"], [lo, hi, lo, hi, lo, hi])
    np.testing.assert_array_equal(out["grads"], [1, 1, 0, 0, 1, 1])


def test_special_values():
    x = jnp.array([jnp.inf, -jnp.inf, jnp.nan, 3e38, -3e38, -0.0, -0.2, 0.0])
    scale = jnp.array(0.5)
    y, pullback = jax.vjp(lambda x_, s_: fake_quant(x_, s_, -4, 3), x, scale)
    y = np.asarray(y)
    np.testing.assert_array_equal(y[[0, 1, 3, 4]], [1.5, -2.0, 1.5, -2.0])
    assert np.isnan(y[2])
    np.testing.assert_array_equal(y[5:], [0.0, 0.0, 0.0])  # -0.0 and small negatives quantize to zero
    g = jnp.arange(1.0, 9.0)
    grad_x, grad_scale = pullback(g)
    np.testing.assert_array_equal(grad_x, [0, 0, 0, 0, 0, 6, 7, 8])
    # scale gradient: qmax above, qmin below, 0 for NaN; round(v) - v inside.
    expected = 1 * 3 + 2 * -4 + 0 + 4 * 3 + 5 * -4 + 0 + 7 * np.float32(0.4) + 0
    np.testing.assert_allclose(float(grad_scale), expected, rtol=1e-6)
    assert np.isfinite(float(grad_scale))


def test_nan_cotangent_at_a_masked_entry_gives_zero():
    _, pullback = jax.vjp(lambda x: fake_quant(x, 1.0, -1, 1), jnp.array([5.0, 0.0]))
    np.testing.assert_array_equal(pullback(jnp.array([jnp.nan, 2.0]))[0], [0.0, 2.0])


@pytest.mark.parametrize("shape", [(), (0,), (2, 0), (1,)])
def test_scalar_and_empty(shape):
    x = jnp.full(shape, 0.7, jnp.float32)
    y, pullback = jax.vjp(lambda x_, s_: fake_quant(x_, s_, -4, 3), x, jnp.array(0.5))
    assert y.shape == shape and y.dtype == jnp.float32
    np.testing.assert_array_equal(y, np.full(shape, 0.5, np.float32))
    grad_x, grad_s = pullback(jnp.ones(shape))
    assert grad_x.shape == shape and grad_s.shape == ()
    np.testing.assert_allclose(float(grad_s), np.prod(shape) * np.float32(1 - 1.4), rtol=1e-6)


# ---------------------------------------------------------------------------------------------------------------------
# Dtypes.


@pytest.mark.parametrize("dtype", [jnp.float16, jnp.bfloat16, jnp.float32])
def test_dtypes(dtype):
    x_np = np.linspace(-3, 3, 37).astype(dtype)
    cot = np.linspace(1, 2, 37).astype(dtype)
    y, pullback = jax.vjp(lambda x_: fake_quant(x_, 0.1, -16, 15), jnp.asarray(x_np))
    assert y.dtype == dtype
    (grad,) = pullback(jnp.asarray(cot))
    assert grad.dtype == dtype
    values, grad_x, _, _ = reference_fake_quant(x_np, 0.1, -16, 15, cotangent=cot)
    assert values.dtype == dtype
    assert_bitwise_equal(y, values)
    assert_bitwise_equal(grad, grad_x.astype(dtype))


def test_bfloat16_reference_dtype():
    # The NumPy reference computes bfloat16 in float32 and casts back, as the library does.
    assert np.dtype(ml_dtypes.bfloat16) == np.dtype(jnp.bfloat16)


def test_float64_with_x64():
    with jax.enable_x64(True):
        x_np = np.random.default_rng(1).uniform(-2, 2, 50)
        cot = np.ones(50)
        y, pullback = jax.vjp(lambda x_, s_: fake_quant(x_, s_, -8, 7), jnp.asarray(x_np), jnp.asarray(0.3))
        assert y.dtype == jnp.float64
        grad_x, grad_s = pullback(jnp.asarray(cot))
        values, ref_gx, ref_gs, _ = reference_fake_quant(x_np, 0.3, -8, 7, cotangent=cot)
        assert values.dtype == np.float64
        assert_bitwise_equal(y, values)
        assert_bitwise_equal(grad_x, ref_gx)
        assert grad_s.dtype == jnp.float64
        np.testing.assert_allclose(float(grad_s), ref_gs.sum(), rtol=1e-12)
        # A Python-float scale is taken at float64 precision here.
        assert_bitwise_equal(fake_quant(jnp.asarray(x_np), 0.3, -8, 7), values)


@pytest.mark.parametrize("dtype", [jnp.int32, jnp.int8, jnp.bool_])
def test_integer_and_bool_inputs_are_promoted(dtype):
    x = jnp.array([0, 1, 1, 3]).astype(dtype)
    y = fake_quant(x, 0.5, -2, 1)
    assert y.dtype == jnp.float32
    np.testing.assert_array_equal(y, np.clip(np.asarray(x, np.float32) * 2, -2, 1) * 0.5)


# ---------------------------------------------------------------------------------------------------------------------
# Per-channel and per-group scales, and the scale and zero-point gradients.


def _per_slice_loop(x, scales, qmin, qmax, zero_points):
    """Quantizes each row of `x` with its own Python-float scale through the per-tensor call."""
    return np.stack(
        [np.asarray(fake_quant(x[i], float(scales[i]), qmin, qmax, int(zero_points[i]))) for i in range(x.shape[0])]
    )


def test_per_channel_matches_a_per_slice_loop():
    rng = np.random.default_rng(2)
    x = jnp.asarray(rng.normal(size=(4, 33)).astype(np.float32))
    scales = np.array([0.1, 0.03, 0.7, 1 / 3], np.float32)
    zps = np.array([0, 3, -2, 1], np.float32)
    by_channel = fake_quant(x, jnp.asarray(scales)[:, None], -8, 7, jnp.asarray(zps)[:, None])
    assert_bitwise_equal(by_channel, _per_slice_loop(x, scales, -8, 7, zps))
    # Along the last axis, a 1-D scale broadcasts like NumPy.
    by_column = fake_quant(x.T, jnp.asarray(scales), -8, 7, jnp.asarray(zps))
    assert_bitwise_equal(by_column, _per_slice_loop(x, scales, -8, 7, zps).T)


@pytest.mark.parametrize(
    "x_shape, scale_shape",
    [((6,), ()), ((3, 5), (3, 1)), ((3, 5), (5,)), ((2, 3, 4), (1, 3, 1)), ((2, 3, 4), (2, 3, 2, 2))],
)
@pytest.mark.slow
def test_scale_and_zero_point_gradients_against_numpy(x_shape, scale_shape):
    rng = np.random.default_rng(3)
    if len(scale_shape) == 4:  # per-group: the last axis split into groups of two
        x_np = rng.normal(size=(2, 3, 2, 2)).astype(np.float32) * 2
    else:
        x_np = rng.normal(size=x_shape).astype(np.float32) * 2
    s_np = rng.uniform(0.05, 0.6, size=scale_shape).astype(np.float32)
    z_np = rng.integers(-2, 3, size=scale_shape).astype(np.float32)
    cot = rng.normal(size=x_np.shape).astype(np.float32)

    def f(x, s, z):
        return fake_quant(x, s, -8, 7, z)

    y, pullback = jax.vjp(f, jnp.asarray(x_np), jnp.asarray(s_np), jnp.asarray(z_np))
    grad_x, grad_s, grad_z = pullback(jnp.asarray(cot))
    values, ref_gx, ref_gs, ref_gz = reference_fake_quant(x_np, s_np, -8, 7, z_np, cotangent=cot)
    assert_bitwise_equal(y, values)
    assert_bitwise_equal(grad_x, ref_gx)
    assert grad_s.shape == scale_shape and grad_z.shape == scale_shape
    np.testing.assert_allclose(grad_s, sum_to_shape(ref_gs, scale_shape), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(grad_z, sum_to_shape(ref_gz, scale_shape), rtol=1e-5, atol=1e-5)
    # Cotangents are computed only for the inputs that carry a derivative (symbolic zeros): each one alone, the
    # others held fixed (a frozen scale with a learned zero point, ...), gets the same bits as all three together.
    x, s, z, c = (jnp.asarray(a) for a in (x_np, s_np, z_np, cot))
    alone = [
        jax.vjp(lambda x: f(x, s, z), x)[1](c)[0],
        jax.vjp(lambda s: f(x, s, z), s)[1](c)[0],
        jax.vjp(lambda z: f(x, s, z), z)[1](c)[0],
    ]
    for one, joint in zip(alone, (grad_x, grad_s, grad_z), strict=True):
        assert_bitwise_equal(one, joint)


def test_scale_gradient_hand_computed():
    x = jnp.array([[0.3, 1.0], [5.0, -7.0]])
    grad = jax.grad(lambda s: fake_quant(x, s, -4, 3).sum())(jnp.array([0.5, 0.25]))
    # column 0: 0.3/0.5 = 0.6 -> round 1, 1 - 0.6 = 0.4; 5/0.5 = 10 > 3 -> 3.  column 1: 4 > 3 -> 3; -28 < -4 -> -4.
    np.testing.assert_allclose(grad, [3.4, -1.0], rtol=1e-6)
    grad_z = jax.grad(lambda z: fake_quant(x, 0.5, -4, 3, z).sum())(jnp.array([1.0, 0.0]))
    np.testing.assert_array_equal(grad_z, [-0.5, -0.5])


def test_integer_zero_point_array_and_python_int():
    x = jnp.linspace(-1, 2, 13)
    a = fake_quant(x, 0.25, 0, 7, 2)
    b = fake_quant(x, 0.25, 0, 7, jnp.array(2, jnp.int32))
    c = fake_quant(x, 0.25, 0, 7, jnp.array([2.0]))
    np.testing.assert_array_equal(a, reference_fake_quant(np.asarray(x), 0.25, 0, 7, 2))
    assert_bitwise_equal(a, b)
    assert_bitwise_equal(a, c)
    assert float(a.min()) == -0.5  # 0 - zero_point = -2 levels


# ---------------------------------------------------------------------------------------------------------------------
# One numerical path: eager, jit, vmap, Python-float and array scales agree bit for bit.


_jit_fq = jax.jit(fake_quant, static_argnums=(2, 3))
_filter_jit_fq = eqx.filter_jit(fake_quant)


def _near_ties(scale, qmin, qmax, n=400):
    s = np.float32(scale)
    k = np.linspace(qmin - 2, qmax + 2, n).round().astype(np.float32)
    ties = (k + np.float32(0.5)) * s
    return np.concatenate([ties, np.nextafter(ties, np.inf), np.nextafter(ties, -np.inf)]).reshape(-1, 4)


@pytest.mark.parametrize("scale", [0.1, 0.3, 1 / 3, 0.0123, 0.5])
@pytest.mark.slow
def test_paths_agree_bitwise(scale):
    x = jnp.asarray(_near_ties(scale, -128, 127))
    reference = fake_quant(x, scale, -128, 127)
    s_arr = jnp.asarray(scale, jnp.float32)
    candidates = {
        "numpy": reference_fake_quant(np.asarray(x), scale, -128, 127),
        "jit": _jit_fq(x, scale, -128, 127),
        "jit array scale": _jit_fq(x, s_arr, -128, 127),
        "filter_jit": _filter_jit_fq(x, scale, -128, 127),
        "eager array scale": fake_quant(x, s_arr, -128, 127),
        "full-size scale": fake_quant(x, jnp.full(x.shape, scale, jnp.float32), -128, 127),
        "per-row scale": fake_quant(x, jnp.full((x.shape[0], 1), scale, jnp.float32), -128, 127),
        "vmap rows": jax.vmap(lambda r: fake_quant(r, scale, -128, 127))(x),
        "vmap scale": jax.vmap(lambda r, s: fake_quant(r, s, -128, 127))(x, jnp.full(x.shape[0], scale)),
        "jit vmap": jax.jit(jax.vmap(lambda r: fake_quant(r, scale, -128, 127)))(x),
        "zero_point array 0": fake_quant(x, scale, -128, 127, jnp.zeros(())),
    }
    for name, out in candidates.items():
        np.testing.assert_array_equal(np.asarray(out), np.asarray(reference), err_msg=name)
    # The gradients, too, with an array scale.
    w = jnp.linspace(-1.0, 1.0, x.size).reshape(x.shape)

    def loss(x_, s_):
        return jnp.sum(fake_quant(x_, s_, -128, 127) * w)

    grads_eager = jax.grad(loss, argnums=(0, 1))(x, s_arr)
    grads_jit = jax.jit(jax.grad(loss, argnums=(0, 1)))(x, s_arr)
    assert_bitwise_equal(grads_eager[0], grads_jit[0])
    np.testing.assert_allclose(grads_eager[1], grads_jit[1], rtol=1e-6)  # a sum: XLA may reorder it


# ---------------------------------------------------------------------------------------------------------------------
# Composition with transformations.


def test_jacrev_is_the_diagonal_mask():
    x = jnp.array([-5.0, -1.0, 0.2, 1.4, 9.0])
    jac = jax.jacrev(lambda x_: fake_quant(x_, 0.5, -4, 3))(x)
    np.testing.assert_array_equal(jac, np.diag([0.0, 1.0, 1.0, 1.0, 0.0]))
    jac = jax.jit(jax.jacrev(lambda x_: fake_quant(x_, 0.5, -4, 3)))(x)
    np.testing.assert_array_equal(jac, np.diag([0.0, 1.0, 1.0, 1.0, 0.0]))


def test_vmap_of_grad_with_per_example_scales():
    x = jnp.array([[0.3, 2.9, -7.0], [0.3, 2.9, -7.0]])
    scales = jnp.array([0.5, 1.0])
    grads = jax.vmap(jax.grad(lambda x_, s_: fake_quant(x_, s_, -4, 3).sum(), argnums=1))(x, scales)
    expected = [
        sum_to_shape(reference_fake_quant(np.asarray(x[i]), float(scales[i]), -4, 3, cotangent=np.ones(3))[2], ())
        for i in range(2)
    ]
    np.testing.assert_allclose(grads, np.asarray(expected, np.float32).ravel(), rtol=1e-6)


# ---------------------------------------------------------------------------------------------------------------------
# Property-based comparison with NumPy.


@st.composite
def _cases(draw):
    shape = draw(hnp.array_shapes(min_dims=0, max_dims=3, min_side=0, max_side=5))
    bits = draw(st.integers(2, 8))
    signed = draw(st.booleans())
    qmin, qmax = eqx_quant.int_range(bits, signed=signed)
    scale = draw(st.floats(2.0**-10, 8.0, width=32))
    bound = float(np.float32(4 * qmax * scale + 1))
    finite = st.floats(-bound, bound, width=32)
    ties = st.integers(qmin - 3, qmax + 3).map(lambda k: float(np.float32(k + 0.5) * np.float32(scale)))
    x = draw(hnp.arrays(np.float32, shape, elements=st.one_of(finite, ties)))
    cot = draw(hnp.arrays(np.float32, shape, elements=st.floats(-2, 2, width=32)))
    per_channel = draw(st.booleans()) and len(shape) > 0
    if per_channel:
        s_shape = (shape[0],) + (1,) * (len(shape) - 1)
        scale = np.asarray(draw(hnp.arrays(np.float32, s_shape, elements=st.floats(2.0**-10, 8.0, width=32))))
    return x, cot, scale, qmin, qmax


@settings(max_examples=60, deadline=None, derandomize=True)
@given(_cases())
@pytest.mark.slow
def test_property_values_and_gradients_match_numpy(case):
    x, cot, scale, qmin, qmax = case
    s = jnp.asarray(scale, jnp.float32)
    y, pullback = jax.vjp(lambda x_, s_: fake_quant(x_, s_, qmin, qmax), jnp.asarray(x), s)
    grad_x, grad_s = pullback(jnp.asarray(cot))
    values, ref_gx, ref_gs, _ = reference_fake_quant(x, scale, qmin, qmax, cotangent=cot)
    assert_bitwise_equal(y, values)
    assert_bitwise_equal(grad_x, ref_gx)
    ref_gs = sum_to_shape(ref_gs, s.shape)
    np.testing.assert_allclose(grad_s, ref_gs, rtol=1e-4, atol=1e-4 * (1 + np.abs(cot).sum()))
    # The Python-float call agrees with the array call.
    if np.ndim(scale) == 0:
        assert_bitwise_equal(fake_quant(jnp.asarray(x), float(scale), qmin, qmax), y)


# ---------------------------------------------------------------------------------------------------------------------
# Errors.


@pytest.mark.parametrize("scale", [0.0, -0.5, float("nan"), float("inf"), 1e-40, 1e39])
def test_bad_scale_values(scale):
    with pytest.raises(ValueError, match="`scale`"):
        fake_quant(jnp.ones(3), scale, -4, 3)


def test_bad_scale_array_names_the_value():
    with pytest.raises(ValueError, match=r"`scale`.*-0\.5"):
        fake_quant(jnp.ones((2, 3)), jnp.array([[0.5], [-0.5]]), -4, 3)
    with pytest.raises(ValueError, match="`scale`"):
        fake_quant(jnp.ones(3), np.array([0.1, 0.0, 0.2], np.float32), -4, 3)


def test_scale_not_broadcastable():
    with pytest.raises(ValueError, match=r"`scale` of shape \(4,\).*\(2, 3\)"):
        fake_quant(jnp.ones((2, 3)), jnp.ones(4), -4, 3)
    with pytest.raises(ValueError, match="`scale`"):  # would enlarge x
        fake_quant(jnp.ones(3), jnp.ones((2, 3)), -4, 3)
    with pytest.raises(ValueError, match="`zero_point`"):
        fake_quant(jnp.ones((2, 3)), 0.5, -4, 3, jnp.ones(2))


@pytest.mark.parametrize("qmin, qmax", [(1.0, 3), (0, 3.0), (True, 3), (0, np.True_), ("0", 3)])
def test_bad_range_types(qmin, qmax):
    with pytest.raises(TypeError, match="qmin|qmax"):
        fake_quant(jnp.ones(3), 0.5, qmin, qmax)


def test_numpy_integer_range_is_accepted():
    np.testing.assert_array_equal(fake_quant(jnp.array([9.0]), 1.0, np.int8(-4), np.int64(3)), [3.0])


def test_qmin_greater_than_qmax():
    with pytest.raises(ValueError, match="qmin=4 and qmax=3"):
        fake_quant(jnp.ones(3), 0.5, 4, 3)


def test_bad_zero_points():
    with pytest.raises(ValueError, match=r"`zero_point`.*1\.5"):
        fake_quant(jnp.ones(3), 0.5, -4, 3, jnp.array(1.5))
    with pytest.raises(ValueError, match="`zero_point`"):
        fake_quant(jnp.ones(3), 0.5, -4, 3, jnp.array([0.0, jnp.nan, 1.0]))
    with pytest.raises(TypeError, match="`zero_point`"):
        fake_quant(jnp.ones(3), 0.5, -4, 3, True)


def test_zero_point_outside_the_grid_is_refused_when_concrete():
    # Every entry would saturate; `FakeQuant` refuses such a zero point with the same check and message.
    x = np.array([0.3, 1.25, -0.75, 2.6, -6.0], np.float32)
    message = re.escape("`zero_point` must be integer-valued and in [qmin, qmax] = [-8, 7], got zero_point=100.")
    with pytest.raises(ValueError, match=message):
        fake_quant(jnp.asarray(x), 0.5, -8, 7, 100)
    with pytest.raises(ValueError, match=message):
        eqx_quant.FakeQuant(0.5, -8, 7, zero_point=100)
    with pytest.raises(ValueError, match=re.escape("[qmin, qmax] = [-8, 7], got zero_point[1, 0]=-9.0.")):
        fake_quant(jnp.ones((2, 1)), 0.5, -8, 7, jnp.array([[0.0], [-9.0]]))
    with pytest.raises(ValueError, match=re.escape("[qmin, qmax] = [-8, 7], got zero_point=8.")):
        eqx_quant.fake_quant_format(jnp.asarray(x), 0.5, "int4", zero_point=8)
    for z in (-8, 7):  # the ends of the grid are zero points
        np.testing.assert_array_equal(fake_quant(jnp.asarray(x), 0.5, -8, 7, z), reference_fake_quant(x, 0.5, -8, 7, z))
    # A traced zero point cannot be checked: the formula as it stands, every entry at the top, 0.5 * (7 - 100).
    out = jax.jit(lambda z: fake_quant(jnp.asarray(x), 0.5, -8, 7, z))(jnp.float32(100))
    np.testing.assert_array_equal(out, np.full(5, -46.5, np.float32))


def test_bad_types():
    with pytest.raises(TypeError):
        fake_quant(jnp.ones(3, jnp.complex64), 0.5, -4, 3)
    with pytest.raises(TypeError, match="`scale`"):
        fake_quant(jnp.ones(3), True, -4, 3)
    with pytest.raises(TypeError):
        fake_quant(jnp.ones(3), "0.5", -4, 3)


def test_cotangent_shape_mismatch_names_both_shapes():
    with pytest.raises(ValueError, match=r"\(2,\).*\(3,\)"):
        fake_quant_vjp([1.0, 2.0, 3.0], 0.5, -4, 3, [1.0, 1.0])
    with pytest.raises(TypeError, match="`x`"):
        fake_quant_vjp([1.0, "a"], 0.5, -4, 3, [1.0, 1.0])


def test_traced_scale_is_not_checked_but_shapes_are():
    # Inside jit the value of a traced scale is unknown: no error, and the formula is applied as it stands.
    x = np.array([1.0, -1.0, 0.0], np.float32)
    out = jax.jit(lambda s: fake_quant(jnp.asarray(x), s, -4, 3))(jnp.array(0.0))
    with np.errstate(divide="ignore", invalid="ignore"):
        expected = reference_fake_quant(x, np.float32(0), -4, 3)
    assert_bitwise_equal(out, expected)
    assert np.isnan(np.asarray(out)[2])
    with pytest.raises(ValueError, match="`scale`"):
        jax.jit(lambda s: fake_quant(jnp.ones((2, 3)), s, -4, 3))(jnp.ones(4))


def test_subnormals_count_as_zero():
    # XLA flushes subnormal inputs and results to zero, so -2e-44 is inside the unsigned range [0, 3], like 0.
    out = fake_quant_vjp([-2e-44, 1e-38], 1.0, 0, 3, [1.0, 1.0])
    np.testing.assert_array_equal(out["values"], [0.0, 0.0])
    np.testing.assert_array_equal(out["grads"], [1.0, 1.0])
    # ... and so is a product x / scale that would be subnormal: -1e-38 / 100.
    np.testing.assert_array_equal(fake_quant_vjp([-1e-38], 100.0, 0, 3, [1.0])["grads"], [1.0])
