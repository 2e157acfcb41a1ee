import functools
import itertools
import math
import re

import equinox as eqx
import hypothesis.extra.numpy as hnp
import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings

from eqx_quant import (
    AbstractQuantizer,
    DynamicFakeQuant,
    FakeQuant,
    LearnedFakeQuant,
    PassthroughClip,
    fake_quant,
    int_range,
)

from .helpers import (
    assert_bitwise_equal,
    assert_trees_equal,
    np_absmax_scale,
    reference_fake_quant,
    slow_unless,
    sum_to_shape,
)


_TINY = np.finfo(np.float32).tiny
_QUANTIZERS = (FakeQuant, PassthroughClip, DynamicFakeQuant, LearnedFakeQuant)


# ---------------------------------------------------------------------------------------------------------------------
# Helpers. An eager call compiles every primitive separately for each new shape, so most checks run the module under
# one `eqx.filter_jit`; that eager, `jit` and `vmap` agree bit for bit is tested on its own.


@eqx.filter_jit
def _jit_call(q, x):
    return q(x)


@eqx.filter_jit
def _jit_vjp(q, x, cotangent):
    y, pullback = eqx.filter_vjp(lambda q_, x_: q_(x_), q, x)
    grad_q, grad_x = pullback(cotangent)
    return y, grad_x, grad_q


@eqx.filter_jit
def _jit_params(q, x):
    return q.quantization_params(x)


@functools.partial(jax.jit, static_argnums=(3, 4))
def _jit_primitive_grad(x, scale, zero_point, qmin, qmax):
    return jax.grad(lambda x_: jnp.sum(fake_quant(x_, scale, qmin, qmax, zero_point)))(x)


def _call(q, x):
    """`q(x)` under `eqx.filter_jit`, as a NumPy array."""
    return np.asarray(_jit_call(q, jnp.asarray(x)))


def _vjp(q, x, cotangent):
    """`(q(x), gradient w.r.t. x, gradient w.r.t. the module)` for a cotangent, under `eqx.filter_jit`."""
    y, grad_x, grad_q = _jit_vjp(q, jnp.asarray(x), jnp.asarray(cotangent))
    return np.asarray(y), np.asarray(grad_x), grad_q


def _params(q, x):
    """`q.quantization_params(x)` under `eqx.filter_jit`, as NumPy arrays."""
    return tuple(np.asarray(a) for a in _jit_params(q, jnp.asarray(x)))


def _primitive_grad(x, scale, zero_point, qmin, qmax):
    """The gradient of `sum(fake_quant(x, scale, qmin, qmax, zero_point))` w.r.t. `x`."""
    return np.asarray(_jit_primitive_grad(jnp.asarray(x), jnp.float32(scale), jnp.float32(zero_point), qmin, qmax))


def _f32(a):
    return np.asarray(a, np.float32)


def _ulps(a, b):
    """The distance between positive float32 numbers, in units in the last place."""
    a, b = _f32(a), _f32(b)
    return np.abs(a.view(np.int32).astype(np.int64) - b.view(np.int32).astype(np.int64))


def _inside(x, scale, zero_point, qmin, qmax):
    """Whether `x / scale + zero_point` lies in `[qmin, qmax]`: `x * (1 / scale)` in float32, as fake_quant computes
    it, compared exactly with the integers `qmin - zero_point` and `qmax - zero_point`."""
    v = _f32(x) * (np.float32(1) / _f32(scale))
    z = np.asarray(zero_point, np.float64)
    return (v >= qmin - z) & (v <= qmax - z)


def _mse(x, scale, qmin, qmax, zero_point=0):
    x = _f32(x)
    return float(np.mean((reference_fake_quant(x, _f32(scale), qmin, qmax, zero_point).astype(np.float64) - x) ** 2))


def _channel_shape(ndim, axis, n):
    return tuple(n if i == axis % ndim else 1 for i in range(ndim))


def _names(arg):
    """A message that names `arg` in backticks (eqx_quant's errors) or in quotes (the type checker's)."""
    return rf"[`']{arg}[`']"


# ---------------------------------------------------------------------------------------------------------------------
# The class hierarchy; shapes and dtypes.


def test_hierarchy():
    for cls in _QUANTIZERS:
        assert issubclass(cls, AbstractQuantizer) and issubclass(cls, eqx.Module)
    for a, b in itertools.permutations(_QUANTIZERS, 2):
        assert not issubclass(a, b)  # final: no quantizer subclasses another
    with pytest.raises(TypeError):
        AbstractQuantizer()  # pyright: ignore


def _example_quantizers():
    return {
        "FakeQuant": FakeQuant.from_bits(4, 0.3),
        "PassthroughClip": PassthroughClip(-1.0, 0.75),
        "DynamicFakeQuant": DynamicFakeQuant(4),
        "LearnedFakeQuant": LearnedFakeQuant(jnp.array(0.3, jnp.float32), -8, 7),
    }


@pytest.mark.parametrize("dtype", [jnp.float16, jnp.bfloat16])
@pytest.mark.parametrize("name", ["FakeQuant", "PassthroughClip", "DynamicFakeQuant", "LearnedFakeQuant"])
@pytest.mark.slow
def test_half_precision_keeps_its_dtype(name, dtype):
    x_np = np.linspace(-3, 3, 24).reshape(2, 3, 4).astype(dtype)
    x = jnp.asarray(x_np)
    cot = np.linspace(1, 2, 24).reshape(2, 3, 4).astype(dtype)
    q = _example_quantizers()[name]
    y = q(x, key=jax.random.key(0))  # eager, with the (ignored) key of the Equinox layer API
    if name == "PassthroughClip":
        expected = np.clip(x_np.astype(np.float32), -1.0, 0.75).astype(dtype)
        grad_expected = cot
    else:
        if name == "DynamicFakeQuant":
            scale = np.asarray(q.quantization_params(x)[0])
            assert _ulps(scale, np.float32(3) / np.float32(7)) <= 4
        else:
            scale = np.float32(0.3)
        expected, grad_expected, _, _ = reference_fake_quant(x_np, scale, -8, 7, cotangent=cot)
        grad_expected = grad_expected.astype(dtype)
    assert y.shape == x.shape and y.dtype == dtype
    assert_bitwise_equal(y, expected)
    y_jit, grad, _ = _vjp(q, x, jnp.asarray(cot))
    assert_bitwise_equal(y_jit, expected)
    assert grad.dtype == dtype
    assert_bitwise_equal(grad, grad_expected)


# ---------------------------------------------------------------------------------------------------------------------
# FakeQuant.


def test_fake_quant_hand_computed():
    q = FakeQuant.from_bits(4, 0.5)
    np.testing.assert_array_equal(q(jnp.array([0.3, 1.25, 9.0])), _f32([0.5, 1.0, 3.5]))
    # round(x / 0.25) + 4 clipped to [0, 15]: -2.0 -> -4 -> 0 (-1.0); 0.6 -> 2 + 4 (0.5); 9.0 -> 40 -> 15 (2.75)
    q = FakeQuant(0.25, 0, 15, zero_point=4)
    np.testing.assert_array_equal(q(jnp.array([-2.0, 0.6, 9.0, 0.0])), _f32([-1.0, 0.5, 2.75, 0.0]))
    assert (q.scale, q.qmin, q.qmax, q.zero_point, q.axis) == (0.25, 0, 15, 4, None)


def test_fake_quant_is_static_and_gets_no_gradient():
    q = FakeQuant((0.5, 0.25), -8, 7, zero_point=(1, -2), axis=0)
    assert jax.tree.leaves(eqx.filter(q, eqx.is_array)) == []
    assert jax.tree.leaves(q) == []
    w = jnp.array([[0.3, -1.0, 2.0], [0.7, 3.0, -0.1]])
    x = jnp.array([[1.0, 2.0, -1.0], [0.5, 1.0, 2.0]])
    learned = LearnedFakeQuant(jnp.array(0.2, jnp.float32), -8, 7)
    model = (w, q, learned)

    def loss(model, x):
        w_, q_, learned_ = model
        return jnp.sum(learned_(q_(w_ * x)))

    value, grads = eqx.filter_jit(eqx.filter_value_and_grad(loss))(model, x)
    assert grads[1] == q  # the same static configuration, and nothing else
    assert jax.tree.leaves(grads[1]) == []
    # The chain rule in NumPy: the two straight-through masks multiply; the learned scale gets its LSQ gradient.
    w_np, x_np = np.asarray(w), np.asarray(x)
    ones = np.ones((2, 3), np.float32)
    v1, m1, _, _ = reference_fake_quant(w_np * x_np, _f32([[0.5], [0.25]]), -8, 7, _f32([[1], [-2]]), cotangent=ones)
    v2, m2, gs2, _ = reference_fake_quant(v1, np.float32(0.2), -8, 7, cotangent=ones)
    np.testing.assert_allclose(float(value), v2.sum(), rtol=1e-6)
    np.testing.assert_array_equal(grads[0], x_np * m1 * m2)
    np.testing.assert_allclose(float(grads[2].scale), gs2.sum() / math.sqrt(6 * 7), rtol=1e-5)
    grads = eqx.filter_jit(eqx.filter_grad(loss))(model, x)
    assert jax.tree.leaves(grads[1]) == []
    np.testing.assert_array_equal(grads[0], x_np * m1 * m2)


@pytest.mark.parametrize("axis", [0, 2, -1, -3])
@pytest.mark.slow
def test_fake_quant_per_channel_matches_a_per_slice_loop(axis):
    rng = np.random.default_rng(0)
    x_np = rng.normal(size=(2, 3, 4)).astype(np.float32) * 3
    cot = rng.normal(size=x_np.shape).astype(np.float32)
    n = x_np.shape[axis]
    scales = tuple(float(s) for s in rng.uniform(0.05, 0.5, n))
    zero_points = tuple(int(z) for z in rng.integers(-3, 4, n))
    cases = [(scales, zero_points), (scales, 0), (0.3, zero_points)]
    for scale, zero_point in cases:
        q = FakeQuant(scale, -8, 7, zero_point=zero_point, axis=axis)
        s = np.broadcast_to(_f32(scale), (n,))
        z = np.broadcast_to(_f32(zero_point), (n,))
        expected = np.empty_like(x_np)
        expected_grad = np.empty_like(x_np)
        for i in range(n):  # every slice with the per-tensor NumPy reference
            where = (slice(None),) * (axis % 3) + (i,)
            expected[where], expected_grad[where], _, _ = reference_fake_quant(
                x_np[where], s[i], -8, 7, z[i], cotangent=cot[where]
            )
        y, grad, grad_q = _vjp(q, jnp.asarray(x_np), jnp.asarray(cot))
        assert_bitwise_equal(y, expected)
        assert_bitwise_equal(grad, expected_grad)
        assert jax.tree.leaves(grad_q) == []
    # The primitive, slice by slice, agrees.
    q = FakeQuant(scales, -8, 7, zero_point=zero_points, axis=axis)
    slices = [fake_quant(jnp.take(x_np, i, axis=axis), scales[i], -8, 7, zero_points[i]) for i in range(n)]
    assert_bitwise_equal(q(jnp.asarray(x_np)), np.stack(slices, axis=axis % 3))


def test_from_bits():
    x = np.linspace(-5000, 5000, 41).astype(np.float32)
    for bits, signed, narrow in [(8, True, False), (4, True, True), (3, False, False), (16, True, False)]:
        q = FakeQuant.from_bits(bits, 0.125, signed=signed, narrow=narrow)
        assert (q.qmin, q.qmax) == int_range(bits, signed=signed, narrow=narrow)
        assert q.zero_point == 0 and q.axis is None and q.scale == 0.125
        assert_bitwise_equal(_call(q, jnp.asarray(x)), reference_fake_quant(x, np.float32(0.125), q.qmin, q.qmax))
        per_channel = FakeQuant.from_bits(bits, [0.125, 2.0], signed=signed, narrow=narrow, axis=-1)
        assert per_channel.scale == (0.125, 2.0) and per_channel.axis == -1
        x2 = np.stack([x, x], axis=-1)
        expected = reference_fake_quant(x2, _f32([0.125, 2.0]), q.qmin, q.qmax)
        assert_bitwise_equal(_call(per_channel, jnp.asarray(x2)), expected)


def test_filter_jit_compiles_once_per_static_configuration():
    traces = []

    @eqx.filter_jit
    def apply(q, x):
        traces.append(None)  # a Python side effect: runs only while tracing
        return q(x)

    x = jnp.linspace(-2.0, 2.0, 9)
    x_np = np.asarray(x)
    q = FakeQuant.from_bits(4, 0.25)
    for _ in range(3):
        assert_bitwise_equal(apply(q, x), reference_fake_quant(x_np, np.float32(0.25), -8, 7))
    assert_bitwise_equal(apply(FakeQuant.from_bits(4, 0.25), x), reference_fake_quant(x_np, np.float32(0.25), -8, 7))
    assert len(traces) == 1
    assert_bitwise_equal(apply(FakeQuant.from_bits(4, 0.5), x), reference_fake_quant(x_np, np.float32(0.5), -8, 7))
    assert len(traces) == 2
    apply(FakeQuant.from_bits(4, 0.5), x)
    assert len(traces) == 2


# ---------------------------------------------------------------------------------------------------------------------
# FakeQuant.calibrate.


def _check_absmax(q, x, axis=None):
    """Each slice's largest magnitude lands inside the range with the primitive's arithmetic, and its scale is within a
    few ulps of `max|x| / qmax`. Returns the largest magnitudes."""
    x_np = _f32(x)
    if axis is None:
        x_np, scales, axis = x_np.reshape(1, -1), _f32([q.scale]), 0
    else:
        scales = _f32(q.scale)
    moved = np.moveaxis(x_np, axis, 0).reshape(x_np.shape[axis], -1)
    absmax = np.max(np.abs(np.where(np.isfinite(moved), moved, np.float32(0))), axis=1)
    assert q.zero_point in (0, (0,) * len(scales))
    assert np.all(_inside(absmax, scales, 0, q.qmin, q.qmax))
    if q.qmin < 0:
        assert np.all(_inside(-absmax, scales, 0, q.qmin, q.qmax))
    assert np.all(_ulps(scales, np.maximum(absmax / np.float32(q.qmax), _TINY)) <= 4)
    return absmax


def test_calibrate_absmax_on_many_channels_where_plain_division_fails():
    rng = np.random.default_rng(1)
    signed_x = (rng.normal(size=(600, 16)) * rng.uniform(0.01, 100, size=(600, 1))).astype(np.float32)
    for bits, signed, narrow in [(8, True, False), (4, True, True), (8, False, False)]:
        x = signed_x if signed else np.abs(signed_x)  # an unsigned grid has no room for negative values
        q = FakeQuant.calibrate(jnp.asarray(x), bits, signed=signed, narrow=narrow, axis=0)
        assert len(q.scale) == 600 and q.axis == 0
        absmax = _check_absmax(q, x, axis=0)
        # The test has teeth: the plain quotient puts the maximum just outside the range for some channels.
        plain = absmax / np.float32(q.qmax)
        assert np.sum(~_inside(absmax, plain, 0, q.qmin, q.qmax)) > 10
        # Every channel's largest entry keeps gradient 1 and maps to +-qmax * scale.
        y, grad, _ = _vjp(q, jnp.asarray(x), jnp.ones(x.shape, jnp.float32))
        rows, at_max = np.arange(600), np.argmax(np.abs(x), axis=1)
        np.testing.assert_array_equal(np.asarray(grad)[rows, at_max], 1.0)
        np.testing.assert_array_equal(np.abs(np.asarray(y)[rows, at_max]), np.float32(q.qmax) * _f32(q.scale))


_SMALL = float(np.float32(2.0**-10))


@settings(max_examples=30, deadline=None, derandomize=True)
@given(
    x=hnp.arrays(
        np.float32,
        st.sampled_from([(7,), (3, 5)]),
        elements=st.floats(-1e4, 1e4, width=32) | st.floats(-_SMALL, _SMALL, width=32),
    ),
    bits=st.sampled_from([2, 4, 8, 16]),
)
@pytest.mark.slow
def test_calibrate_absmax_property(x, bits):
    q = FakeQuant.calibrate(x, bits)
    _check_absmax(q, x)
    grad = _primitive_grad(x, q.scale, 0, q.qmin, q.qmax)
    assert grad[np.unravel_index(np.argmax(np.abs(x)), x.shape)] == 1.0


def _check_minmax(q, x_slice, zero_point, scale):
    lo = min(float(np.min(x_slice)), 0.0)
    hi = max(float(np.max(x_slice)), 0.0)
    assert zero_point == int(zero_point) and q.qmin <= zero_point <= q.qmax
    assert np.isfinite(scale) and scale > 0
    for v in (lo, hi):
        assert _inside(v, scale, zero_point, q.qmin, q.qmax)
    # Nothing is wasted: a grid one level narrower than the range covers [lo, hi] with an integer zero point.
    if hi > lo:
        assert scale <= (hi - lo) / (q.qmax - q.qmin - 1) * (1 + 1e-5)


@settings(max_examples=25, deadline=None, derandomize=True)
@given(
    x=hnp.arrays(np.float32, (9,), elements=st.floats(-100, 100, width=32)),
    shift=st.sampled_from([0.0, 50.0, -50.0]),
    bits=st.sampled_from([4, 8]),
    signed=st.booleans(),
)
@pytest.mark.slow
def test_calibrate_minmax_property(x, shift, bits, signed):
    x = np.append(x + np.float32(shift), np.float32(0)).astype(np.float32)
    q = FakeQuant.calibrate(x, bits, signed=signed, method="minmax")
    assert isinstance(q.zero_point, int)
    _check_minmax(q, x, q.zero_point, np.float32(q.scale))
    expected = reference_fake_quant(x, np.float32(q.scale), q.qmin, q.qmax, q.zero_point)
    y = np.asarray(q(jnp.asarray(x)))  # eager
    assert_bitwise_equal(y, expected)
    assert y[-1] == 0.0  # 0 is exactly representable
    grad = _primitive_grad(x, q.scale, q.zero_point, q.qmin, q.qmax)
    assert grad[np.argmin(x)] == 1.0 and grad[np.argmax(x)] == 1.0


def test_calibrate_minmax_hand_computed():
    # [-1, 3] on [0, 255]: the ideal zero point is 255 / 4 = 63.75. Zero point 63 needs the scale max(1/63, 3/192) =
    # 1/63; zero point 64 needs max(1/64, 3/191) = 3/191, the smaller one.
    q = FakeQuant.calibrate(jnp.array([-1.0, 0.5, 3.0]), 8, signed=False, method="minmax")
    assert (q.qmin, q.qmax, q.zero_point) == (0, 255, 64)
    assert _ulps(q.scale, np.float32(3) / np.float32(191)) <= 2
    # All-positive data on a signed grid: [0, 2] is covered with 0 at qmin.
    q = FakeQuant.calibrate(jnp.array([0.5, 2.0, 1.0]), 8, method="minmax")
    assert q.zero_point == -128
    assert _ulps(q.scale, np.float32(2) / np.float32(255)) <= 2


@pytest.mark.parametrize("lo, hi", [(-1e-10, 1.0), (-1.0, 1e-10)])
def test_calibrate_minmax_with_a_tiny_extreme(lo, hi):
    # One end of the range is far below one step; the other covers nearly the whole grid.
    x = _f32([lo, 0.25 * (lo + hi), hi])
    q = FakeQuant.calibrate(jnp.asarray(x), 8, method="minmax")
    _check_minmax(q, x, q.zero_point, np.float32(q.scale))
    np.testing.assert_allclose(np.asarray(q(jnp.asarray(x))), x, atol=q.scale)


@pytest.mark.parametrize("percentile", [90.0, 99.0, 100.0])
def test_calibrate_percentile(percentile):
    rng = np.random.default_rng(2)
    x = rng.standard_t(3, size=(4, 257)).astype(np.float32)
    q = FakeQuant.calibrate(jnp.asarray(x), 8, method="percentile", percentile=percentile)
    # The inverted empirical distribution: the smallest magnitude with `percentile` percent of them at or below it.
    clip_at = np.percentile(np.abs(x).astype(np.float64), percentile, method="inverted_cdf")
    np.testing.assert_allclose(q.scale, clip_at / 127, rtol=1e-5)
    if percentile == 100.0:
        assert q.scale == FakeQuant.calibrate(jnp.asarray(x), 8).scale
    per_row = FakeQuant.calibrate(jnp.asarray(x), 8, method="percentile", percentile=percentile, axis=0)
    expected = np.percentile(np.abs(x).astype(np.float64), percentile, axis=1, method="inverted_cdf") / 127
    np.testing.assert_allclose(per_row.scale, expected, rtol=1e-5)
    # Entries beyond the clipping threshold saturate at the ends of the grid.
    y = np.asarray(_call(q, jnp.asarray(x)))
    big = np.abs(x) > clip_at * 1.01 + q.scale
    assert big.any() or percentile == 100.0
    s = np.float32(q.scale)
    np.testing.assert_array_equal(y[big], np.where(x[big] > 0, np.float32(127) * s, np.float32(-128) * s))


def _brute_force_mse(x, qmin, qmax, num_candidates):
    """Every candidate scale, `max|x| * k / n` turned into a scale like absmax, and its MSE on `x`."""
    absmax = np.max(np.abs(x))
    fractions = np.arange(1, num_candidates + 1, dtype=np.float32) / np.float32(num_candidates)
    scales = [np_absmax_scale(absmax * f, qmax) for f in fractions]
    return np.asarray(scales), np.array([_mse(x, s, qmin, qmax) for s in scales])


@pytest.mark.parametrize("bits, num_candidates", [(3, 7), (4, 50)])
@pytest.mark.slow
def test_calibrate_mse_against_a_brute_force_search(bits, num_candidates):
    rng = np.random.default_rng(3)
    x = rng.normal(size=(3, 200)).astype(np.float32)
    qmin, qmax = int_range(bits)
    q = FakeQuant.calibrate(jnp.asarray(x), bits, method="mse", num_candidates=num_candidates)
    scales, errors = _brute_force_mse(x, qmin, qmax, num_candidates)
    chosen = _mse(x, q.scale, qmin, qmax)
    assert np.min(_ulps(scales, q.scale)) <= 1  # one of the candidates
    assert chosen <= errors.min() * (1 + 1e-5)  # ... and the best of them
    absmax_error = _mse(x, FakeQuant.calibrate(jnp.asarray(x), bits).scale, qmin, qmax)
    assert chosen < 0.9 * absmax_error  # at 3 or 4 bits, clipping a Gaussian's tails pays
    # Per channel: each row gets its own search.
    per_row = FakeQuant.calibrate(jnp.asarray(x), bits, method="mse", num_candidates=num_candidates, axis=0)
    for i in range(3):
        scales_i, errors_i = _brute_force_mse(x[i], qmin, qmax, num_candidates)
        assert np.min(_ulps(scales_i, per_row.scale[i])) <= 1
        assert _mse(x[i], per_row.scale[i], qmin, qmax) <= errors_i.min() * (1 + 1e-5)


@pytest.mark.parametrize("method, axis", [("absmax", 1), ("minmax", -2), ("percentile", -2), ("mse", 1)])
@pytest.mark.slow
def test_calibrate_per_channel_equals_per_slice(method, axis):
    rng = np.random.default_rng(4)
    x = (rng.normal(size=(2, 5, 33)) * _f32([0.1, 1.0, 3.0, 30.0, 0.001])[:, None]).astype(np.float32)
    x[:, 2] += 2.0  # an off-centre channel
    kwargs = dict(method=method, percentile=95.0, num_candidates=16)
    q = FakeQuant.calibrate(jnp.asarray(x), 6, axis=axis, **kwargs)
    assert q.axis % 3 == 1
    assert isinstance(q.scale, tuple) and len(q.scale) == 5
    zero_points = q.zero_point if isinstance(q.zero_point, tuple) else (q.zero_point,) * 5
    for i in range(5):
        s = FakeQuant.calibrate(jnp.asarray(x[:, i]), 6, **kwargs)
        if method == "mse":  # the search may settle a near-tie between candidates differently
            assert _mse(x[:, i], q.scale[i], -32, 31) <= _mse(x[:, i], s.scale, -32, 31) * (1 + 1e-5)
        else:
            assert (q.scale[i], zero_points[i]) == (s.scale, s.zero_point)


@pytest.mark.parametrize("method", ["absmax", "minmax", "percentile", "mse"])
@pytest.mark.slow
def test_calibrate_all_zero_and_non_finite(method):
    # An all-zero tensor, and an all-zero channel, quantize to exact zeros with finite gradients.
    q = FakeQuant.calibrate(jnp.zeros((2, 4)), 8, method=method)
    y, grad, _ = _vjp(q, jnp.zeros((2, 4)), jnp.ones((2, 4)))
    assert_bitwise_equal(y, np.zeros((2, 4), np.float32))
    assert_bitwise_equal(grad, np.ones((2, 4), np.float32))
    x = _f32([[0.0, 0.0, 0.0, 0.0], [1.0, -2.0, 0.5, 3.0]])
    q = FakeQuant.calibrate(jnp.asarray(x), 8, method=method, axis=0)
    y, grad, _ = _vjp(q, jnp.asarray(x), jnp.ones((2, 4)))
    assert_bitwise_equal(y[0], np.zeros(4, np.float32))
    assert_bitwise_equal(grad[0], np.ones(4, np.float32))
    assert np.all(np.isfinite(np.asarray(grad)))
    # NaN and infinite entries are ignored by the statistics.
    clean = np.random.default_rng(5).normal(size=40).astype(np.float32)
    dirty = clean.copy()
    dirty[[3, 17, 30]] = [np.nan, np.inf, -np.inf]
    kept = np.delete(clean, [3, 17, 30])
    clean_q = FakeQuant.calibrate(jnp.asarray(kept), 8, method=method, percentile=90.0)
    dirty_q = FakeQuant.calibrate(jnp.asarray(dirty), 8, method=method, percentile=90.0)
    assert np.isfinite(dirty_q.scale)
    if method == "mse":
        assert _mse(kept, dirty_q.scale, -128, 127) <= _mse(kept, clean_q.scale, -128, 127) * (1 + 1e-5)
    else:
        assert (dirty_q.scale, dirty_q.zero_point) == (clean_q.scale, clean_q.zero_point)


@pytest.mark.parametrize("method", ["absmax", "minmax", "percentile", "mse"])
def test_calibrate_empty_input(method):
    # No data: either a valid quantizer (all statistics are 0, as for an all-zero tensor) or a ValueError naming `x`.
    try:
        q = FakeQuant.calibrate(jnp.zeros((0,)), 8, method=method)
    except ValueError as e:
        assert "`x`" in str(e)
    else:
        assert q.scale == _TINY and q.zero_point == 0
        assert _call(q, np.zeros((0,), np.float32)).shape == (0,)


def test_calibrate_accepts_numpy_and_integer_data():
    q = FakeQuant.calibrate(np.array([-3, 1, 2], np.int32), 8)
    assert _ulps(q.scale, np.float32(3) / np.float32(127)) <= 4
    x = np.array([0.5, -1.5], np.float16)
    q = FakeQuant.calibrate(x, 4, signed=False, method="minmax")
    _check_minmax(q, x.astype(np.float32), q.zero_point, np.float32(q.scale))


# ---------------------------------------------------------------------------------------------------------------------
# PassthroughClip.


def test_passthrough_clip():
    clip = PassthroughClip(0, 6)
    assert (clip.lo, clip.hi) == (0.0, 6.0)
    assert jax.tree.leaves(clip) == []
    x = jnp.array([-1.0, 3.0, 8.0, 6.0, 0.0])
    expected = _f32([0.0, 3.0, 6.0, 6.0, 0.0])
    np.testing.assert_array_equal(clip(x), expected)
    np.testing.assert_array_equal(jax.grad(lambda x_: clip(x_).sum())(x), np.ones(5, np.float32))
    tangent = jnp.array([2.0, -3.0, 4.0, 5.0, -6.0])
    y, y_dot = jax.jvp(clip, (x,), (tangent,))
    np.testing.assert_array_equal(y, expected)
    np.testing.assert_array_equal(y_dot, tangent)
    np.testing.assert_array_equal(jax.jacfwd(clip)(x), np.eye(5, dtype=np.float32))
    np.testing.assert_array_equal(jax.jit(jax.jacfwd(clip))(x), np.eye(5, dtype=np.float32))
    # An infinite bound clips on one side only; NaN stays NaN.
    relu = PassthroughClip(0.0, math.inf)
    np.testing.assert_array_equal(relu(jnp.array([-2.0, 1e30, jnp.nan])), _f32([0.0, 1e30, np.nan]))
    # The bounds are static: equal modules are equal and hash alike.
    assert PassthroughClip(0.0, 6.0) == clip and hash(PassthroughClip(0.0, 6.0)) == hash(clip)


# ---------------------------------------------------------------------------------------------------------------------
# DynamicFakeQuant.


def test_dynamic_per_tensor_against_numpy():
    rng = np.random.default_rng(6)
    x = rng.normal(size=(5, 7)).astype(np.float32) * 3
    cot = rng.normal(size=x.shape).astype(np.float32)
    for bits, signed, narrow in [(8, True, False), (4, True, True), (4, False, False)]:
        q = DynamicFakeQuant(bits, signed=signed, narrow=narrow)
        qmin, qmax = int_range(bits, signed=signed, narrow=narrow)
        assert (q.qmin, q.qmax) == (qmin, qmax)
        scale, zero_point = _params(q, jnp.asarray(x))
        assert scale.shape == () and zero_point.shape == () and float(zero_point) == 0.0
        assert scale.dtype == jnp.float32
        assert _ulps(scale, np.max(np.abs(x)) / np.float32(qmax)) <= 4
        assert _inside(np.max(np.abs(x)), scale, 0, qmin, qmax)
        values, grad_x, _, _ = reference_fake_quant(x, np.asarray(scale), qmin, qmax, cotangent=cot)
        y, grad, grad_q = _vjp(q, jnp.asarray(x), jnp.asarray(cot))
        assert_bitwise_equal(y, values)
        # The scale is stop_gradient-ed: the gradient is the clipped straight-through mask times the cotangent.
        assert_bitwise_equal(grad, grad_x)
        assert jax.tree.leaves(grad_q) == []


def test_dynamic_documented_example():
    q = DynamicFakeQuant(8, axis=0)
    w = jnp.array([[0.1, -0.2, 0.3], [10.0, 5.0, -2.5]])
    scale, zero_point = q.quantization_params(w)
    assert _ulps(scale[0], np.float32(0.3) / np.float32(127)) <= 4
    assert _ulps(scale[1], np.float32(10.0) / np.float32(127)) <= 4
    np.testing.assert_array_equal(zero_point, [0.0, 0.0])
    expected = reference_fake_quant(np.asarray(w), np.asarray(scale)[:, None], -128, 127)
    assert_bitwise_equal(q(w), expected)


def _per_slice_loop(per_tensor, x, cot, axis):
    """Values, gradients, scales and zero points of `per_tensor` applied to each slice along `axis` (NumPy arrays)."""
    n = x.shape[axis]
    slices = [(jnp.asarray(np.take(x, i, axis=axis)), jnp.asarray(np.take(cot, i, axis=axis))) for i in range(n)]
    outs = [_vjp(per_tensor, x_i, cot_i)[:2] for x_i, cot_i in slices]
    params = [_params(per_tensor, x_i) for x_i, _ in slices]
    values, grads = (np.stack([np.asarray(o[k]) for o in outs], axis=axis % x.ndim) for k in (0, 1))
    scales, zero_points = (np.stack([np.asarray(p[k]) for p in params]) for k in (0, 1))
    return values, grads, scales, zero_points


@pytest.mark.parametrize("axis, symmetric", [(0, True), (-1, False), (1, True)])
@pytest.mark.slow
def test_dynamic_per_channel_matches_a_per_slice_loop(axis, symmetric):
    rng = np.random.default_rng(7)
    x_np = (rng.normal(size=(3, 4, 5)) * rng.uniform(0.1, 10, size=(1, 4, 1)) + 0.5).astype(np.float32)
    cot = rng.normal(size=x_np.shape).astype(np.float32)
    q = DynamicFakeQuant(5, axis=axis, symmetric=symmetric)
    values, grads, scales, zero_points = _per_slice_loop(DynamicFakeQuant(5, symmetric=symmetric), x_np, cot, axis)
    x = jnp.asarray(x_np)
    y, grad, _ = _vjp(q, x, jnp.asarray(cot))
    assert_bitwise_equal(y, values)
    assert_bitwise_equal(grad, grads)
    scale, zero_point = _params(q, x)
    assert scale.shape == zero_point.shape == (x.shape[axis],)
    assert_bitwise_equal(scale, scales)
    assert_bitwise_equal(zero_point, zero_points)
    assert np.any(zero_points != 0) != symmetric


@pytest.mark.parametrize(
    "shape, group_size, axis, symmetric",
    [((3, 8), 4, None, True), ((2, 3, 8), 4, 0, True), ((3, 8), 4, -2, False), ((8,), 4, None, False)],
)
@pytest.mark.slow
def test_dynamic_per_group_matches_a_per_slice_loop(shape, group_size, axis, symmetric):
    rng = np.random.default_rng(8)
    x_np = (rng.normal(size=shape) * rng.uniform(0.01, 10, size=shape[:-1] + (1,))).astype(np.float32) + 0.25
    cot = rng.normal(size=shape).astype(np.float32)
    x = jnp.asarray(x_np)
    q = DynamicFakeQuant(4, group_size=group_size, axis=axis, symmetric=symmetric)
    per_tensor = DynamicFakeQuant(4, symmetric=symmetric)
    scale, zero_point = _params(q, x)
    groups = shape[-1] // group_size
    assert scale.shape == zero_point.shape == shape[:-1] + (groups,)
    expected, expected_grad = np.empty(shape, np.float32), np.empty(shape, np.float32)
    for index in np.ndindex(shape[:-1]):
        for j in range(groups):
            where = index + (slice(j * group_size, (j + 1) * group_size),)
            x_ij = jnp.asarray(x_np[where])
            expected[where], expected_grad[where], _ = _vjp(per_tensor, x_ij, jnp.asarray(cot[where]))
            s_ij, z_ij = _params(per_tensor, x_ij)
            assert_bitwise_equal(scale[index + (j,)], s_ij)
            assert_bitwise_equal(zero_point[index + (j,)], z_ij)
    y, grad, _ = _vjp(q, x, jnp.asarray(cot))
    assert_bitwise_equal(y, expected)
    assert_bitwise_equal(grad, expected_grad)
    # And with the NumPy reference, from the scales that quantization_params reports.
    s_full = np.repeat(np.asarray(scale), group_size, axis=-1)
    z_full = np.repeat(np.asarray(zero_point), group_size, axis=-1)
    values, grad_x, _, _ = reference_fake_quant(x_np, s_full, q.qmin, q.qmax, z_full, cotangent=cot)
    assert_bitwise_equal(y, values)
    assert_bitwise_equal(grad, grad_x)


def _skewed_rows(n=400, width=11, seed=9):
    rng = np.random.default_rng(seed)
    rows = (rng.normal(size=(n, width)) * rng.uniform(1e-3, 1e3, size=(n, 1))).astype(np.float32)
    rows[:, 0] += np.float32(0.3) * np.abs(rows[:, 1])  # off-centre rows
    return rows


def _check_extremes(rows, scales, zero_points, grads, qmin, qmax, symmetric):
    """Every row's extremes (its largest magnitude when symmetric) land inside the signed range with gradient 1."""
    rows_index = np.arange(rows.shape[0])
    if symmetric:
        extremes = [np.argmax(np.abs(rows), axis=1)]
    else:
        extremes = [np.argmax(rows, axis=1), np.argmin(rows, axis=1)]
    for at in extremes:
        assert np.all(_inside(rows[rows_index, at], scales, zero_points, qmin, qmax))
        np.testing.assert_array_equal(grads[rows_index, at], 1.0)


@pytest.mark.parametrize("symmetric", [True, False])
@pytest.mark.slow
def test_dynamic_extremes_inside_in_eager_jit_and_vmap(symmetric):
    # Many rows at once: eagerly, under jax.jit and under jax.vmap, every row's extremes land inside the range with
    # gradient 1; and all of these agree bit for bit.
    rows = _skewed_rows()
    x = jnp.asarray(rows)
    q = DynamicFakeQuant(8, symmetric=symmetric)
    qmin, qmax = -128, 127
    grad_fn = jax.grad(lambda r: jnp.sum(q(r)))
    fns = (q.quantization_params, q, grad_fn)
    batched = jax.jit(jax.vmap(lambda r: (*q.quantization_params(r), q(r), grad_fn(r))))(x)
    results = {"jit vmap": tuple(np.asarray(a) for a in batched)}
    sample = np.arange(0, 400, 40)
    for name, (params_fn, call_fn, grad_fn_) in (("eager", fns), ("jit", tuple(jax.jit(f) for f in fns))):
        per_row = []
        for i in sample:
            row = jnp.asarray(rows[i])
            per_row.append([np.asarray(a) for a in (*params_fn(row), call_fn(row), grad_fn_(row))])
        results[name] = tuple(np.stack(a) for a in zip(*per_row))
    for name, (scales, zero_points, values, grads) in results.items():
        subset = np.arange(400) if name == "jit vmap" else sample
        _check_extremes(rows[subset], scales, zero_points, grads, qmin, qmax, symmetric)
        expected = reference_fake_quant(rows[subset], scales[:, None], qmin, qmax, zero_points[:, None])
        assert_bitwise_equal(values, expected)
    # Bit for bit alike, and also under an eager vmap.
    results["vmap"] = tuple(np.asarray(a) for a in (*jax.vmap(q.quantization_params)(x), jax.vmap(q)(x)))
    for name in ("vmap", "eager", "jit"):
        for a, b in zip(results[name], results["jit vmap"]):
            assert_bitwise_equal(a, b if name == "vmap" else b[sample])


@pytest.mark.slow
def test_calibrated_minmax_keeps_its_gradients_under_jit():
    # A quantizer calibrated eagerly keeps gradient 1 at every channel's extremes whether the training step is
    # jitted or not, and both give the same gradients.
    rows = _skewed_rows()
    q = FakeQuant.calibrate(jnp.asarray(rows), 8, axis=0, method="minmax")
    scales, zero_points = _f32(q.scale), _f32(q.zero_point)
    ones = jnp.ones(rows.shape, jnp.float32)
    eager = np.asarray(jax.vjp(q, jnp.asarray(rows))[1](ones)[0])
    jitted = np.asarray(_vjp(q, jnp.asarray(rows), ones)[1])
    _check_extremes(rows, scales, zero_points, eager, -128, 127, False)
    _check_extremes(rows, scales, zero_points, jitted, -128, 127, False)
    assert_bitwise_equal(jitted, eager)


def test_dynamic_asymmetric_zero_point():
    rng = np.random.default_rng(10)
    x_np = np.append(rng.uniform(-0.5, 4.0, size=30), 0.0).astype(np.float32)
    x = jnp.asarray(x_np)
    q = DynamicFakeQuant(8, symmetric=False)
    scale, zero_point = _params(q, x)
    zp = float(zero_point)
    assert zp == round(zp) and -128 <= zp <= 127 and zp != 0.0
    _check_minmax(q, x_np, zp, np.float32(scale))
    cot = rng.normal(size=31).astype(np.float32)
    values, grad_x, _, _ = reference_fake_quant(x_np, np.asarray(scale), -128, 127, zp, cotangent=cot)
    y, grad, _ = _vjp(q, x, jnp.asarray(cot))
    assert float(y[-1]) == 0.0  # 0 is exactly representable
    assert_bitwise_equal(y, values)
    assert_bitwise_equal(grad, grad_x)
    # All-negative data on an unsigned grid: 0 sits at qmax.
    q = DynamicFakeQuant(4, signed=False, symmetric=False)
    x_np = -np.abs(x_np) - np.float32(0.1)
    scale, zero_point = _params(q, jnp.asarray(x_np))
    assert float(zero_point) == 15.0
    _check_minmax(q, x_np, float(zero_point), np.float32(scale))


@pytest.mark.parametrize("lo, hi", [(-1e-10, 1.0), (-1.0, 1e-10)])
def test_dynamic_asymmetric_with_a_tiny_extreme(lo, hi):
    x_np = _f32([lo, 0.25 * (lo + hi), hi, 0.0])
    q = DynamicFakeQuant(8, symmetric=False)
    y = np.asarray(_call(q, jnp.asarray(x_np)))
    assert np.all(np.isfinite(y))
    scale, zero_point = _params(q, jnp.asarray(x_np))
    _check_minmax(q, x_np, float(zero_point), np.float32(scale))
    np.testing.assert_allclose(y, x_np, atol=float(scale))


@pytest.mark.parametrize(
    "q, zero_slice",
    [
        (DynamicFakeQuant(8), (slice(None),)),
        (DynamicFakeQuant(8, symmetric=False), (slice(None),)),
        (DynamicFakeQuant(8, axis=0, symmetric=False), (1,)),
        (DynamicFakeQuant(4, group_size=2), (0, slice(2, 4))),
    ],
)
@pytest.mark.slow
def test_dynamic_all_zero_tensor_channel_and_group(q, zero_slice):
    shape = (2, 6)
    x_np = np.random.default_rng(11).normal(size=shape).astype(np.float32)
    x_np[zero_slice] = 0.0
    y, grad, _ = _vjp(q, jnp.asarray(x_np), jnp.ones(shape, jnp.float32))
    y, grad = np.asarray(y), np.asarray(grad)
    assert_bitwise_equal(y[zero_slice], np.zeros_like(x_np[zero_slice]))
    assert np.all(np.isfinite(y)) and np.all(np.isfinite(grad))
    np.testing.assert_array_equal(grad[zero_slice], 1.0)
    scale, _ = _params(q, jnp.asarray(x_np))
    assert np.all(np.isfinite(np.asarray(scale))) and np.all(np.asarray(scale) > 0)


@pytest.mark.parametrize("axis, symmetric", [(None, True), (0, False)])
def test_dynamic_ignores_nan_and_inf(axis, symmetric):
    x_np = np.random.default_rng(12).normal(size=(3, 6)).astype(np.float32)
    x_np[1, 2] = 0.125  # not the largest of its row, nor of the tensor
    q = DynamicFakeQuant(6, axis=axis, symmetric=symmetric)
    clean = np.asarray(q(jnp.asarray(x_np)))
    mask = np.ones(x_np.shape, bool)
    mask[1, 2] = False
    for bad in (np.nan, np.inf, -np.inf):
        dirty_np = x_np.copy()
        dirty_np[1, 2] = bad
        dirty = np.asarray(q(jnp.asarray(dirty_np)))
        assert_bitwise_equal(dirty[mask], clean[mask])
        if np.isnan(bad):
            assert np.isnan(dirty[1, 2])
        assert_bitwise_equal(_params(q, jnp.asarray(dirty_np))[0], _params(q, jnp.asarray(x_np))[0])


# ---------------------------------------------------------------------------------------------------------------------
# LearnedFakeQuant.


def test_learned_forward_and_lsq_gradient_per_tensor():
    rng = np.random.default_rng(13)
    x_np = rng.normal(size=(4, 6)).astype(np.float32) * 2
    cot = rng.normal(size=x_np.shape).astype(np.float32)
    q = LearnedFakeQuant(jnp.array(0.3, jnp.float32), -8, 7)
    assert q.scale.shape == () and q.scale.dtype == jnp.float32 and q.zero_point is None
    values, grad_x, grad_s, _ = reference_fake_quant(x_np, np.float32(0.3), -8, 7, cotangent=cot)
    factor = 1 / math.sqrt(x_np.size * 7)
    y, grad, grad_q = _vjp(q, jnp.asarray(x_np), jnp.asarray(cot))
    assert_bitwise_equal(y, values)
    assert_bitwise_equal(grad, grad_x)
    np.testing.assert_allclose(float(grad_q.scale), grad_s.sum() * factor, rtol=1e-5)
    assert grad_q.zero_point is None
    # jax.grad on the module itself, eagerly.
    grad_q = jax.grad(lambda q_: jnp.sum(q_(jnp.asarray(x_np)) * cot))(q)
    np.testing.assert_allclose(float(grad_q.scale), grad_s.sum() * factor, rtol=1e-5)


@pytest.mark.parametrize("axis", [0, -1])
def test_learned_lsq_gradient_per_channel(axis):
    rng = np.random.default_rng(14)
    x_np = rng.normal(size=(3, 4, 5)).astype(np.float32) * 2
    cot = rng.normal(size=x_np.shape).astype(np.float32)
    n = x_np.shape[axis]
    s_np = rng.uniform(0.1, 0.5, size=n).astype(np.float32)
    q = LearnedFakeQuant(jnp.asarray(s_np), 0, 15, axis=axis)
    shape = _channel_shape(3, axis, n)
    values, grad_x, grad_s, _ = reference_fake_quant(x_np, s_np.reshape(shape), 0, 15, cotangent=cot)
    y, grad, grad_q = _vjp(q, jnp.asarray(x_np), jnp.asarray(cot))
    assert_bitwise_equal(y, values)
    assert_bitwise_equal(grad, grad_x)
    assert grad_q.scale.shape == (n,)
    factor = 1 / math.sqrt((x_np.size // n) * 15)
    expected = sum_to_shape(grad_s, shape).reshape(n) * factor
    np.testing.assert_allclose(grad_q.scale, expected, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("bits, signed, narrow", [(4, True, False), (8, True, True), (3, False, False)])
def test_learned_init_from(bits, signed, narrow):
    rng = np.random.default_rng(15)
    x_np = (rng.normal(size=(5, 8)) * np.arange(1, 6)[:, None]).astype(np.float32)
    qmin, qmax = int_range(bits, signed=signed, narrow=narrow)
    q = LearnedFakeQuant.init_from(jnp.asarray(x_np), bits, signed=signed, narrow=narrow, method="lsq")
    assert (q.qmin, q.qmax, q.axis, q.zero_point) == (qmin, qmax, None, None)
    assert q.scale.shape == () and q.scale.dtype == jnp.float32
    expected = 2 * np.mean(np.abs(x_np), dtype=np.float64) / math.sqrt(qmax)
    np.testing.assert_allclose(float(q.scale), expected, rtol=1e-6)
    for axis, reduce in ((0, 1), (-1, 0)):
        per_channel = LearnedFakeQuant.init_from(
            jnp.asarray(x_np), bits, signed=signed, narrow=narrow, axis=axis, method="lsq"
        )
        assert per_channel.scale.shape == (x_np.shape[axis],)
        expected = 2 * np.mean(np.abs(x_np), axis=reduce, dtype=np.float64) / math.sqrt(qmax)
        np.testing.assert_allclose(per_channel.scale, expected, rtol=1e-6)
    # Non-finite entries are ignored.
    dirty = x_np.copy()
    dirty[0, 0], dirty[2, 3] = np.nan, -np.inf
    finite_abs = np.where(np.isfinite(dirty), np.abs(dirty), np.nan)
    q = LearnedFakeQuant.init_from(jnp.asarray(dirty), bits, signed=signed, narrow=narrow, axis=0, method="lsq")
    expected = 2 * np.nanmean(finite_abs, axis=1, dtype=np.float64) / math.sqrt(qmax)
    np.testing.assert_allclose(q.scale, expected, rtol=1e-6)


@pytest.mark.parametrize("bits", slow_unless([4], [2, 4, 8]))
def test_learned_init_from_absmax_is_round_to_nearest(bits):
    # A NumPy reference of the scale (max|x| / qmax per channel, which the dynamic quantizer may nudge up by a few
    # ulps), and the quantizer's output against the dynamic one's, eagerly and stacked (NaN entries ignored).
    rng = np.random.default_rng(16)
    x_np = (rng.normal(size=(2, 4, 64)) * np.exp(rng.normal(size=(2, 4, 1)))).astype(np.float32)
    x_np[1, 2, 5] = np.nan
    x = jnp.asarray(x_np)
    qmax = int_range(bits)[1]
    q = LearnedFakeQuant.init_from(x[0], bits, axis=0, method="absmax")
    np.testing.assert_allclose(q.scale, np.nanmax(np.abs(x_np[0]), axis=1) / qmax, rtol=3e-7)
    assert_bitwise_equal(q(x[0]), DynamicFakeQuant(bits, axis=0)(x[0]))
    assert_trees_equal(LearnedFakeQuant.init_from(x[0], bits, axis=0), q)  # the default when symmetric
    stacked = LearnedFakeQuant.init_from(x, bits, group_size=32, stacked=1, method="absmax")
    assert stacked.scale.shape == (2, 4, 2)
    dynamic = DynamicFakeQuant(bits, group_size=32)
    assert_bitwise_equal(jax.vmap(lambda quantizer, w: quantizer(w))(stacked, x), jax.vmap(dynamic)(x))
    # (A TypeError under the test suite's type checking of the `Literal` annotation; a ValueError without it.)
    with pytest.raises((ValueError, TypeError), match="method"):
        LearnedFakeQuant.init_from(x[0], bits, method="max")  # pyright: ignore[reportArgumentType]
    with pytest.raises(ValueError, match="needs `symmetric`=True"):
        LearnedFakeQuant.init_from(x[0], bits, method="absmax", symmetric=False)


@pytest.mark.slow
def test_learned_init_from_all_zero():
    x = jnp.zeros((2, 3))
    for q in (
        LearnedFakeQuant.init_from(x, 8),
        LearnedFakeQuant.init_from(x, 8, axis=0),
        LearnedFakeQuant.init_from(x, 8, symmetric=False),
        LearnedFakeQuant.init_from(jnp.array([[0.0, 0.0, 0.0], [1.0, -2.0, 3.0]]), 8, axis=0),
    ):
        assert np.all(np.asarray(q.scale) > 0) and np.all(np.isfinite(np.asarray(q.scale)))
        y, grad, grad_q = _vjp(q, x, jnp.ones((2, 3)))
        assert_bitwise_equal(y, np.zeros((2, 3), np.float32))
        assert_bitwise_equal(grad, np.ones((2, 3), np.float32))
        assert all(np.all(np.isfinite(np.asarray(leaf))) for leaf in jax.tree.leaves(grad_q))


@pytest.mark.parametrize("bad", [0.0, -0.4])
def test_learned_non_positive_leaf_uses_min_scale_and_still_learns(bad):
    x_np = _f32([0.01, -0.03, 0.2, 0.05, -0.5])
    q = LearnedFakeQuant(jnp.array(0.1, jnp.float32), -8, 7, min_scale=0.02)
    q = jax.tree.map(lambda s: jnp.full_like(s, bad), q)  # what an optimizer step may do
    assert q.scale == np.float32(bad)
    values, _, grad_s, _ = reference_fake_quant(x_np, np.float32(0.02), -8, 7, cotangent=np.ones(5, np.float32))
    assert_bitwise_equal(q(jnp.asarray(x_np)), values)  # eager
    assert_bitwise_equal(fake_quant(jnp.asarray(x_np), 0.02, -8, 7), values)
    y, _, grad_q = _vjp(q, jnp.asarray(x_np), jnp.ones(5, jnp.float32))
    assert_bitwise_equal(y, values)
    assert float(grad_q.scale) != 0.0
    np.testing.assert_allclose(float(grad_q.scale), grad_s.sum() / math.sqrt(5 * 7), rtol=1e-5)


def test_learned_zero_point():
    rng = np.random.default_rng(16)
    x_np = rng.uniform(-0.5, 3.0, size=(4, 6)).astype(np.float32)
    q = LearnedFakeQuant.init_from(jnp.asarray(x_np), 4, signed=False, symmetric=False)
    assert q.zero_point is not None and q.zero_point.shape == () and q.zero_point.dtype == jnp.float32
    zp, s = float(q.zero_point), float(q.scale)
    assert zp == round(zp) and 0 <= zp <= 15
    assert zp == min(max(round(0 - float(np.min(x_np)) / s), 0), 15)  # min(x, 0) maps to qmin
    assert LearnedFakeQuant.init_from(jnp.asarray(x_np), 4).zero_point is None
    cot = rng.normal(size=x_np.shape).astype(np.float32)
    factor = 1 / math.sqrt(x_np.size * 15)
    # The forward rounds (and clips) the leaf; the gradient passes straight through both.
    for leaf, used in [(2.4, 2.0), (1.6, 2.0), (19.3, 15.0), (-3.0, 0.0)]:
        q_leaf = eqx.tree_at(lambda m: m.zero_point, q, jnp.array(leaf, jnp.float32))
        values, grad_x, grad_s, grad_z = reference_fake_quant(x_np, np.float32(s), 0, 15, np.float32(used), cot)
        y, grad, grad_q = _vjp(q_leaf, jnp.asarray(x_np), jnp.asarray(cot))
        assert_bitwise_equal(y, values)
        assert_bitwise_equal(grad, grad_x)
        np.testing.assert_allclose(float(grad_q.scale), grad_s.sum() * factor, rtol=1e-5, atol=1e-7)
        np.testing.assert_allclose(float(grad_q.zero_point), grad_z.sum() * factor, rtol=1e-5, atol=1e-7)
    assert np.any(grad_z)  # the last case clips entries, so the zero point's gradient is not trivially 0
    # Per channel.
    q = LearnedFakeQuant.init_from(jnp.asarray(x_np), 4, signed=False, symmetric=False, axis=0)
    assert q.zero_point is not None and q.zero_point.shape == (4,)
    mins = np.minimum(np.min(x_np, axis=1), 0)
    np.testing.assert_array_equal(q.zero_point, np.clip(np.round(0 - mins / np.asarray(q.scale)), 0, 15))


def test_lsq_training_lowers_the_quantization_error(getkey):
    x = jax.random.normal(getkey(), (256,), jnp.float32) * 2 + jax.random.normal(getkey(), (256,), jnp.float32) ** 3
    x_np = np.asarray(x)
    q = LearnedFakeQuant.init_from(x, 3, method="lsq")

    @eqx.filter_jit
    def step(q_):
        loss, grads = eqx.filter_value_and_grad(lambda m: jnp.mean((m(x) - x) ** 2))(q_)
        return jax.tree.map(lambda p, g: p - 1.0 * g, q_, grads), loss  # plain gradient descent

    initial = _mse(x_np, q.scale, -4, 3)
    losses = []
    for _ in range(100):
        q, loss = step(q)
        losses.append(float(loss))
        assert float(q.scale) > 0
    final = _mse(x_np, q.scale, -4, 3)
    np.testing.assert_allclose(losses[0], initial, rtol=1e-5)
    assert final < 0.9 * initial
    np.testing.assert_allclose(np.mean((_call(q, x).astype(np.float64) - x_np) ** 2), final, rtol=1e-5)


# ---------------------------------------------------------------------------------------------------------------------
# Transformations: vmap, scan over stacked layers, serialisation.


def _stack(*modules):
    return jax.tree.map(lambda *a: jnp.stack(a), *modules)


def _scan_layers(stacked, x):
    def body(carry, layer):
        y = layer(carry)
        return y * jnp.float32(1.5), y

    return jax.lax.scan(body, x, stacked)


def _unrolled_layers(layers, x):
    ys = []
    for layer in layers:
        ys.append(layer(x))
        x = ys[-1] * jnp.float32(1.5)
    return x, jnp.stack(ys)


@pytest.mark.slow
def test_scan_and_vmap_over_stacked_learned_quantizers():
    rng = np.random.default_rng(17)
    symmetric = [LearnedFakeQuant(jnp.array(s, jnp.float32), -8, 7) for s in (0.1, 0.25, 0.05)]
    asymmetric = [
        LearnedFakeQuant(jnp.array(s, jnp.float32), 0, 15, zero_point=jnp.array(z, jnp.float32))
        for s, z in ((0.1, 3.0), (0.25, 8.0), (0.05, 0.0))
    ]
    x_np = rng.normal(size=(6,)).astype(np.float32)
    xs = rng.normal(size=(3, 5)).astype(np.float32)
    for layers in (symmetric, asymmetric):
        stacked = _stack(*layers)
        assert stacked.scale.shape == (3,)
        final, ys = (np.asarray(a) for a in eqx.filter_jit(_scan_layers)(stacked, jnp.asarray(x_np)))
        carry = x_np
        for i, layer in enumerate(layers):
            zp = 0.0 if layer.zero_point is None else float(layer.zero_point)
            y_i = reference_fake_quant(carry, np.float32(layer.scale), layer.qmin, layer.qmax, np.float32(zp))
            assert_bitwise_equal(ys[i], y_i)
            carry = y_i * np.float32(1.5)
        assert_bitwise_equal(final, carry)
        # Gradients reach every layer through the scan, as through an unrolled loop.
        grads = eqx.filter_jit(eqx.filter_grad(lambda m: jnp.sum(_scan_layers(m, jnp.asarray(x_np))[0])))(stacked)
        expected = eqx.filter_jit(eqx.filter_grad(lambda m: jnp.sum(_unrolled_layers(m, jnp.asarray(x_np))[0])))(layers)
        assert grads.scale.shape == (3,) and np.any(np.asarray(grads.scale) != 0)
        np.testing.assert_allclose(grads.scale, [float(g.scale) for g in expected], rtol=1e-5, atol=1e-7)
        if layers[0].zero_point is not None:
            np.testing.assert_allclose(grads.zero_point, [float(g.zero_point) for g in expected], rtol=1e-5, atol=1e-7)
        # vmap: one quantizer per row.
        expected_rows = np.stack([_call(layer, xs[i]) for i, layer in enumerate(layers)])
        assert_bitwise_equal(eqx.filter_jit(jax.vmap(lambda m, r: m(r)))(stacked, jnp.asarray(xs)), expected_rows)
        vmapped = eqx.filter_jit(eqx.filter_vmap(lambda m, r: m(r)))(stacked, jnp.asarray(xs))
        assert_bitwise_equal(vmapped, expected_rows)


def test_vmap_over_data_with_fixed_quantizers():
    xs_np = np.random.default_rng(18).normal(size=(4, 7)).astype(np.float32)
    xs = jnp.asarray(xs_np)
    for q in (
        FakeQuant.from_bits(4, 0.2),
        PassthroughClip(-0.5, 0.5),
        DynamicFakeQuant(4),
        LearnedFakeQuant(jnp.array(0.2, jnp.float32), -8, 7),
    ):
        expected = np.stack([_call(q, xs_np[i]) for i in range(4)])
        assert_bitwise_equal(eqx.filter_jit(lambda m, r: jax.vmap(m)(r))(q, xs), expected)
        assert_bitwise_equal(eqx.filter_jit(lambda m, r: eqx.filter_vmap(m)(r))(q, xs), expected)


def test_serialisation_round_trip(tmp_path):
    def make(scale, zero_point, learned_sym_scale):
        return {
            "fake": FakeQuant((0.5, 0.25), -8, 7, zero_point=(1, -2), axis=0),
            "clip": PassthroughClip(-1.0, 2.0),
            "dynamic": DynamicFakeQuant(4, axis=1, symmetric=False),
            "learned": LearnedFakeQuant(scale, 0, 15, zero_point=zero_point, axis=0),
            "learned_sym": LearnedFakeQuant(learned_sym_scale, -8, 7),
        }

    modules = make(jnp.array([0.1, 0.2], jnp.float32), jnp.array([3.0, 4.0]), jnp.array(0.3, jnp.float32))
    path = tmp_path / "quantizers.eqx"
    eqx.tree_serialise_leaves(path, modules)
    like = make(jnp.ones(2, jnp.float32), jnp.zeros(2, jnp.float32), jnp.array(1.0, jnp.float32))
    loaded = eqx.tree_deserialise_leaves(path, like)
    leaves, treedef = jax.tree.flatten(modules)
    loaded_leaves, loaded_treedef = jax.tree.flatten(loaded)
    assert treedef == loaded_treedef and len(leaves) == len(loaded_leaves) == 3
    for a, b in zip(leaves, loaded_leaves):
        assert_bitwise_equal(a, b)
    assert loaded["fake"] == modules["fake"] and loaded["dynamic"] == modules["dynamic"]
    x = jnp.array([[0.3, -1.0], [2.0, 0.7]])
    for name in modules:
        assert_bitwise_equal(_call(loaded[name], x), _call(modules[name], x))


# ---------------------------------------------------------------------------------------------------------------------
# Errors.


_X = jnp.ones((3, 4))


@pytest.mark.parametrize(
    "build, arg",
    [
        (lambda: FakeQuant.from_bits(1, 0.5), "bits"),
        (lambda: FakeQuant.from_bits(17, 0.5), "bits"),
        (lambda: FakeQuant.from_bits(0, 0.5, signed=False), "bits"),
        (lambda: DynamicFakeQuant(1), "bits"),
        (lambda: DynamicFakeQuant(17), "bits"),
        (lambda: DynamicFakeQuant(0, signed=False), "bits"),
        (lambda: LearnedFakeQuant.init_from(_X, 17), "bits"),
        (lambda: LearnedFakeQuant.init_from(_X, 0, signed=False), "bits"),
        (lambda: FakeQuant.calibrate(_X, 1), "bits"),
        (lambda: FakeQuant(0.5, 7, -8), "qmin"),
        (lambda: LearnedFakeQuant(jnp.array(0.5), 7, -8), "qmin"),
        (lambda: FakeQuant(0.0, -8, 7), "scale"),
        (lambda: FakeQuant(-0.5, -8, 7), "scale"),
        (lambda: FakeQuant(float("nan"), -8, 7), "scale"),
        (lambda: FakeQuant(float("inf"), -8, 7), "scale"),
        (lambda: FakeQuant((0.5, -0.1), -8, 7, axis=0), "scale"),
        (lambda: FakeQuant.from_bits(8, 0.0), "scale"),
        (lambda: LearnedFakeQuant(jnp.array(0.0), -8, 7), "scale"),
        (lambda: LearnedFakeQuant(jnp.array(-1.0), -8, 7), "scale"),
        (lambda: LearnedFakeQuant(jnp.array(jnp.nan), -8, 7), "scale"),
        (lambda: LearnedFakeQuant(jnp.array(jnp.inf), -8, 7), "scale"),
        (lambda: LearnedFakeQuant(jnp.array([0.5, -1.0]), -8, 7, axis=0), "scale"),
        (lambda: FakeQuant((0.5, 0.2), -8, 7), "axis"),
        (lambda: FakeQuant(0.5, -8, 7, zero_point=(1, 2)), "axis"),
        (lambda: LearnedFakeQuant(jnp.array([0.5, 0.2]), -8, 7), "scale"),
        (lambda: FakeQuant(0.5, -8, 7, axis=2)(_X), "axis"),
        (lambda: FakeQuant((0.5, 0.2), -8, 7, axis=-3)(_X), "axis"),
        (lambda: DynamicFakeQuant(8, axis=2)(_X), "axis"),
        (lambda: DynamicFakeQuant(8, axis=-3)(_X), "axis"),
        (lambda: LearnedFakeQuant(jnp.array([0.5] * 3), -8, 7, axis=2)(_X), "axis"),
        (lambda: LearnedFakeQuant.init_from(_X, 8, axis=2), "axis"),
        (lambda: FakeQuant.calibrate(_X, 8, axis=-3), "axis"),
        (lambda: DynamicFakeQuant(8, group_size=3)(_X), "group_size"),
        (lambda: DynamicFakeQuant(8, group_size=0), "group_size"),
        (lambda: DynamicFakeQuant(8, group_size=2, axis=1)(_X), "axis"),
        (lambda: DynamicFakeQuant(8, group_size=2, axis=-1)(_X), "axis"),
        (lambda: FakeQuant(0.5, -8, 7, zero_point=8), "zero_point"),
        (lambda: FakeQuant(0.5, 0, 7, zero_point=-1), "zero_point"),
        (lambda: FakeQuant((0.5, 0.5), -8, 7, zero_point=(0, 9), axis=0), "zero_point"),
        (lambda: FakeQuant.calibrate(_X, 8, method="median"), "method"),  # pyright: ignore
        (lambda: PassthroughClip(2.0, 1.0), "lo"),
    ],
)
def test_errors_name_the_argument(build, arg):
    with pytest.raises((ValueError, TypeError), match=_names(arg)):
        build()


def test_learned_zero_point_is_checked_as_fake_quant_checks_it():
    # A NaN zero point made every output NaN. A learned zero point is a real number, rounded and clipped into the grid
    # where it is used, as training leaves it: a fraction, or a value outside the grid (which `convert` rebuilds the
    # quantizer with), is one.
    for zero_point, shown in ((float("nan"), "zero_point=nan"), (np.array([1.0, np.inf]), "zero_point[1]=inf")):
        axis = 0 if np.ndim(zero_point) else None
        scale = np.full(np.shape(zero_point), 0.5, np.float32)
        with pytest.raises(ValueError, match=re.escape(f"`zero_point` must be finite, got {shown}.")):
            LearnedFakeQuant(scale, -8, 7, zero_point=zero_point, axis=axis)
    x = np.array([0.3, 1.25, -0.75, 2.6, -6.0], np.float32)
    for outside, end in ((100.0, 7), (-9.0, -8)):
        q = LearnedFakeQuant(0.5, -8, 7, zero_point=outside)
        np.testing.assert_array_equal(_call(q, x), reference_fake_quant(x, np.float32(0.5), -8, 7, end))
    assert float(LearnedFakeQuant(0.5, -8, 7, zero_point=2.4).zero_point) == np.float32(2.4)
    # Leaves in ml_dtypes' float types (an NVFP4 block scale as stored) are real numbers too.
    for scale in (jnp.asarray(0.5, jnp.float8_e4m3fn), np.asarray(0.5, jnp.float8_e4m3fn)):
        np.testing.assert_array_equal(_call(LearnedFakeQuant(scale, -8, 7), x), _call(LearnedFakeQuant(0.5, -8, 7), x))


def test_learned_zero_point_in_the_grid_and_traced():
    x = np.array([0.3, 1.25, -0.75, 2.6, -6.0], np.float32)
    for z in (-8, 3, 7):
        q = LearnedFakeQuant(0.5, -8, 7, zero_point=float(z))
        np.testing.assert_array_equal(_call(q, x), reference_fake_quant(x, np.float32(0.5), -8, 7, z))
    # Built under `jax.jit`, the zero point is traced and cannot be checked (the forward clips it into the grid).
    zero_point = jax.jit(lambda z: LearnedFakeQuant(0.5, -8, 7, zero_point=z).zero_point)(jnp.float32(100))
    assert float(zero_point) == 100.0


def test_integer_input_is_a_type_error():
    for q in _example_quantizers().values():
        with pytest.raises(TypeError, match=_names("x")):
            q(jnp.ones(3, jnp.int32))
        with pytest.raises(TypeError, match=_names("x")):
            _call(q, jnp.ones(3, jnp.int32))


@pytest.mark.parametrize("cls", [FakeQuant, LearnedFakeQuant])
def test_per_channel_length_mismatch_names_both_numbers(cls):
    if cls is FakeQuant:
        q = FakeQuant((0.5, 0.2), -8, 7, axis=0)
    else:
        q = LearnedFakeQuant(jnp.array([0.5, 0.2]), -8, 7, axis=0)
    with pytest.raises(ValueError, match=r"`scale`.*\b2\b.*\b3\b"):
        q(_X)
    with pytest.raises(ValueError, match=r"`scale`.*\b2\b.*\b3\b"):
        _call(q, _X)
    assert _call(q, jnp.ones((2, 4))).shape == (2, 4)


def test_wrong_types_raise_type_errors():
    with pytest.raises(TypeError, match=_names("scale")):
        FakeQuant("0.5", -8, 7)  # pyright: ignore
    with pytest.raises(TypeError, match=_names("qmin")):
        FakeQuant(0.5, -8.0, 7)  # pyright: ignore
    with pytest.raises(TypeError, match=_names("format")):
        DynamicFakeQuant(8.0)  # pyright: ignore
    with pytest.raises(TypeError, match=_names("bits")):
        FakeQuant.from_bits("8", 0.5)  # pyright: ignore
    with pytest.raises(TypeError, match=_names("x")):
        DynamicFakeQuant(8)(np.ones(3, np.float32))  # pyright: ignore
    with pytest.raises(TypeError, match=_names("axis")):
        LearnedFakeQuant(jnp.array(0.5), -8, 7, axis=0.0)  # pyright: ignore
    with pytest.raises(TypeError, match=_names("group_size")):
        DynamicFakeQuant(8, group_size=2.0)  # pyright: ignore


# ---------------------------------------------------------------------------------------------------------------------
# repr and named scopes.


def test_repr():
    cases = [
        (FakeQuant((0.5, 0.25), -8, 7, zero_point=(1, -2), axis=0),
         ["FakeQuant", "0.5", "0.25", "qmin=-8", "qmax=7", "axes=(0,)"]),
        (PassthroughClip(-1.5, 6.0), ["PassthroughClip", "lo=-1.5", "hi=6.0"]),
        (DynamicFakeQuant(4, axis=1, symmetric=False), ["DynamicFakeQuant", "qmax=7", "axes=(1,)", "symmetric=False"]),
        (LearnedFakeQuant(jnp.array([0.5, 0.2]), 0, 15, axis=-1), ["LearnedFakeQuant", "f32[2]", "qmax=15", "axes=(-1,)"]),
        (DynamicFakeQuant("mxfp4", group_size=32), ["element='float4_e2m1fn'", "scale='e8m0'", "group_size=32"]),
    ]
    for module, parts in cases:
        text = repr(module)
        for part in parts:
            assert part in text, (part, text)


def test_named_scopes_appear_in_the_lowered_program():
    x = jnp.ones((2, 4))
    for module in _example_quantizers().values():
        name = f"eqx_quant.{type(module).__name__}"
        text = jax.jit(lambda x_, m=module: m(x_)).lower(x).as_text(debug_info=True)
        assert name in text
        assert name in jax.make_jaxpr(lambda x_, m=module: m(x_))(x).pretty_print(name_stack=True)


# ---------------------------------------------------------------------------------------------------------------------
# `axis_name`: statistics of a tensor split along named axes (a batch under `jax.vmap` here; `jax.shard_map` in
# tests/sharded/check_sharding.py).


@pytest.mark.parametrize("cls", [DynamicFakeQuant, LearnedFakeQuant])
@pytest.mark.parametrize("bad", [3, "", (), ("batch", 1), ["batch"]])
def test_axis_name_must_be_names(cls, bad):
    # Wrong types are caught by the signature's type check, empty names by the constructor: both name the argument.
    with pytest.raises(TypeError, match="axis_name"):
        cls(8, axis_name=bad) if cls is DynamicFakeQuant else cls(0.1, -8, 7, axis_name=bad)


@pytest.mark.parametrize(
    "q", [DynamicFakeQuant(8, axis_name="batch"), LearnedFakeQuant(0.1, -8, 7, axis_name=("batch", "other"))]
)
def test_unbound_axis_name_is_a_value_error(q):
    with pytest.raises(ValueError, match="`axis_name`=.* names an axis that is not bound here"):
        q(jnp.ones(3))


@pytest.mark.parametrize("symmetric", [True, False])
@pytest.mark.slow
def test_dynamic_axis_name_under_vmap_uses_the_whole_batch(symmetric):
    rng = np.random.default_rng(40)
    x_np = (rng.normal(size=(4, 6)) * rng.uniform(0.1, 5.0, size=(4, 1))).astype(np.float32)  # rows of unlike sizes
    x_np[2, 3] = np.nan  # ignored by the statistics, as for the whole tensor
    named = DynamicFakeQuant(4, symmetric=symmetric, axis_name="batch")
    whole = DynamicFakeQuant(4, symmetric=symmetric)
    out = jax.vmap(named, axis_name="batch")(jnp.asarray(x_np))
    scale, zero_point = whole.quantization_params(jnp.asarray(x_np))
    assert_bitwise_equal(out, reference_fake_quant(x_np, np.asarray(scale), -8, 7, np.asarray(zero_point)))
    per_row = jax.vmap(whole)(jnp.asarray(x_np))  # without the name: one scale per row
    assert not np.array_equal(np.asarray(per_row), np.asarray(out), equal_nan=True)


def test_learned_axis_name_counts_every_shard_in_the_gradient_scale():
    rng = np.random.default_rng(41)
    x_np = rng.normal(size=(5, 6)).astype(np.float32)
    cot = rng.normal(size=x_np.shape).astype(np.float32)
    _, _, grad_s, _ = reference_fake_quant(x_np, np.float32(0.2), -8, 7, cotangent=cot)

    def grads(q):
        loss = lambda q_, x, c: jnp.sum(q_(x) * c)  # noqa: E731
        return jax.vmap(jax.grad(loss), in_axes=(None, 0, 0), axis_name="batch")(q, jnp.asarray(x_np), cot).scale

    named = grads(LearnedFakeQuant(0.2, -8, 7, axis_name="batch"))
    # Each row is one shard of a (5, 6) tensor: its gradient is scaled by 1 / sqrt(30 * 7), not 1 / sqrt(6 * 7).
    np.testing.assert_allclose(named, grad_s.sum(axis=1) / math.sqrt(30 * 7), rtol=1e-5, atol=1e-7)


def test_learned_leaves_are_float32_and_not_weakly_typed():
    for value in (0.25, jnp.asarray(0.25), np.float64(0.25), jnp.asarray([0.25, 0.5], jnp.bfloat16)):
        q = LearnedFakeQuant(value, -8, 7, axis=None if np.ndim(value) == 0 else 0, zero_point=None)
        assert q.scale.dtype == jnp.float32 and not q.scale.weak_type
    q = LearnedFakeQuant(0.25, 0, 15, zero_point=jnp.asarray(3))
    assert q.zero_point is not None and q.zero_point.dtype == jnp.float32 and not q.zero_point.weak_type


def test_scale_nudges_match_nextafter_loop_up_to_the_largest_float():
    """The scale fitting steps up by bit patterns; it must equal the plain `nextafter` loop everywhere, up to the cap
    on scales (2**126, or below it where the largest level times the scale would overflow), including next to the
    largest float32 and at infinity, where stepping up stops."""
    from eqx_quant._format import IntFormat
    from eqx_quant._scales import _NUDGES, absmax_scale, minmax_scale

    def nextafter_loop(absmax, qmax):
        scale = jnp.maximum(absmax * (1.0 / qmax), _TINY)
        for _ in range(_NUDGES):
            scale = jnp.where(absmax * (1 / scale) > qmax, jnp.nextafter(scale, jnp.inf), scale)
        return scale

    def cap(largest_level):  # the largest float32 <= 2**126 whose product with the level is finite, by bisection
        def finite(bits):
            with np.errstate(over="ignore"):
                return np.isfinite(np.uint32(bits).view(np.float32) * np.float32(largest_level))

        lo, hi = 0, int(np.float32(2.0**126).view(np.uint32))  # bit patterns of positive floats are in value order
        if finite(hi):
            return np.float32(2.0**126)
        while hi - lo > 1:
            lo, hi = ((lo + hi) // 2, hi) if finite((lo + hi) // 2) else (lo, (lo + hi) // 2)
        return np.uint32(lo).view(np.float32)

    big = np.finfo(np.float32).max
    rng = np.random.default_rng(42)
    absmax = np.concatenate(
        [np.float32([big, np.nextafter(big, 0), np.inf, 3e38, 1.0, 0.0]), rng.lognormal(0, 20, 200).astype(np.float32)]
    )
    for qmin, qmax in ((-2, 1), (-8, 7), (-128, 127), (0, 255)):
        fitted = jax.jit(absmax_scale, static_argnums=1)(jnp.asarray(absmax), IntFormat(qmin, qmax))
        loop = jax.jit(nextafter_loop, static_argnums=1)(jnp.asarray(absmax), qmax)
        assert_bitwise_equal(fitted, jnp.minimum(loop, cap(max(-qmin, qmax))))
        assert np.all(np.isfinite(np.asarray(fitted)))
    scale, zero_point = minmax_scale(jnp.float32(0.0), jnp.float32(big), IntFormat(0, 1))
    assert float(scale) == 2.0**126 and float(zero_point) == 0.0


def test_percentile_on_data_and_on_a_histogram_agree():
    # Data whose magnitudes are exactly the upper edges of a histogram's bins, repeated as often as the bins count:
    # calibration on the data and on the histogram follow one definition, so they give the same threshold.
    from eqx_quant._scales import histogram_edges, percentile_threshold

    counts = np.array([5.0, 0.0, 7.0, 1.0, 3.0, 4.0])
    edges = histogram_edges(counts.size, 3.0)
    data = np.repeat(edges, counts.astype(int)).astype(np.float32)
    for p in (10.0, 25.0, 60.0, 90.0, 100.0):
        on_histogram = percentile_threshold(edges, counts, p)
        reference = np.percentile(data.astype(np.float64), p, method="inverted_cdf")
        assert on_histogram == reference, (p, on_histogram, reference)
        q = FakeQuant.calibrate(jnp.asarray(data), 8, method="percentile", percentile=p)
        assert q.scale == FakeQuant.calibrate(jnp.asarray([reference], jnp.float32), 8).scale
    assert percentile_threshold(edges, np.zeros(6), 50.0) == 0.0
