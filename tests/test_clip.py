import jax
import jax.numpy as jnp
import numpy as np
import pytest

from eqx_quant import clip_passthrough

from .helpers import assert_bitwise_equal


X = jnp.array([-2.0, 0.5, 3.0])


def _clip01(x):
    return clip_passthrough(x, 0.0, 1.0)


def test_documented_example():
    np.testing.assert_array_equal(clip_passthrough(X, 0, 1), [0.0, 0.5, 1.0])
    y, y_dot = jax.jvp(_clip01, (X,), (jnp.array([2.0, -3.0, 4.0]),))
    np.testing.assert_array_equal(y, [0.0, 0.5, 1.0])
    np.testing.assert_array_equal(y_dot, [2.0, -3.0, 4.0])
    # plain clipping would stop the tangent outside the bounds
    _, plain_dot = jax.jvp(lambda x: jnp.clip(x, 0.0, 1.0), (X,), (jnp.array([2.0, -3.0, 4.0]),))
    np.testing.assert_array_equal(plain_dot, [0.0, -3.0, 0.0])
    np.testing.assert_array_equal(jax.grad(lambda x: _clip01(x).sum())(X), [1.0, 1.0, 1.0])
    w = jnp.array([0.25, -7.0, 3.0])
    np.testing.assert_array_equal(jax.grad(lambda x: (w * _clip01(x)).sum())(X), w)


def test_values_against_numpy():
    x = np.random.default_rng(0).normal(size=(5, 7)).astype(np.float32) * 3
    lo = np.linspace(-2, 0, 7).astype(np.float32)
    hi = np.linspace(0, 2, 5).astype(np.float32)[:, None]
    assert_bitwise_equal(clip_passthrough(jnp.asarray(x), jnp.asarray(lo), jnp.asarray(hi)), np.clip(x, lo, hi))
    assert_bitwise_equal(jax.jit(clip_passthrough)(x, lo, hi), np.clip(x, lo, hi))


def test_at_the_bounds_and_equal_bounds():
    x = jnp.array([0.0, 1.0, -5.0, 5.0])
    y, y_dot = jax.jvp(_clip01, (x,), (jnp.ones(4),))
    np.testing.assert_array_equal(y, [0.0, 1.0, 0.0, 1.0])
    np.testing.assert_array_equal(y_dot, [1.0, 1.0, 1.0, 1.0])
    y, y_dot = jax.jvp(lambda x_: clip_passthrough(x_, 0.5, 0.5), (x,), (jnp.arange(4.0),))
    np.testing.assert_array_equal(y, [0.5] * 4)
    np.testing.assert_array_equal(y_dot, [0.0, 1.0, 2.0, 3.0])


def test_bounds_get_zero_derivative():
    grads = jax.grad(lambda x, lo, hi: clip_passthrough(x, lo, hi).sum(), argnums=(0, 1, 2))(
        X, jnp.array(0.0), jnp.array([1.0, 1.0, 1.0])
    )
    np.testing.assert_array_equal(grads[0], [1.0, 1.0, 1.0])
    np.testing.assert_array_equal(grads[1], 0.0)
    np.testing.assert_array_equal(grads[2], [0.0, 0.0, 0.0])
    _, y_dot = jax.jvp(lambda lo: clip_passthrough(X, lo, 1.0), (jnp.array(0.0),), (jnp.array(1.0),))
    np.testing.assert_array_equal(y_dot, [0.0, 0.0, 0.0])


@pytest.mark.slow
def test_all_transformations():
    eye = np.eye(3, dtype=np.float32)
    np.testing.assert_array_equal(jax.jacfwd(_clip01)(X), eye)
    np.testing.assert_array_equal(jax.jacrev(_clip01)(X), eye)
    # y = sum(clip(x)^2): the Hessian passes through the clip twice, so it is 2 I even outside the bounds.
    np.testing.assert_array_equal(jax.hessian(lambda x: (_clip01(x) ** 2).sum())(X), 2 * eye)
    y, vjp = jax.vjp(_clip01, X)
    np.testing.assert_array_equal(vjp(jnp.array([1.0, 2.0, 3.0]))[0], [1.0, 2.0, 3.0])
    batch = jnp.stack([X, -X])
    np.testing.assert_array_equal(jax.vmap(_clip01)(batch), np.clip(np.asarray(batch), 0, 1))
    per_row = jax.vmap(clip_passthrough)(batch, jnp.array([0.0, -1.0]), jnp.array([1.0, 0.0]))
    np.testing.assert_array_equal(per_row, [[0.0, 0.5, 1.0], [0.0, -0.5, -1.0]])
    np.testing.assert_array_equal(jax.jit(jax.grad(lambda x: _clip01(x).sum()))(X), [1.0, 1.0, 1.0])
    np.testing.assert_array_equal(jax.jit(jax.jacfwd(_clip01))(X), eye)


def test_special_values():
    x = jnp.array([jnp.nan, jnp.inf, -jnp.inf, -0.0])
    y, y_dot = jax.jvp(_clip01, (x,), (jnp.ones(4),))
    y = np.asarray(y)
    assert np.isnan(y[0])
    np.testing.assert_array_equal(y[1:], [1.0, 0.0, 0.0])
    np.testing.assert_array_equal(y_dot, [1.0, 1.0, 1.0, 1.0])


@pytest.mark.parametrize("dtype", [jnp.float16, jnp.bfloat16, jnp.float32])
def test_dtypes(dtype):
    x = jnp.linspace(-2, 2, 9).astype(dtype)
    y, y_dot = jax.jvp(lambda x_: clip_passthrough(x_, -1.0, jnp.array(1.0)), (x,), (jnp.ones(9, dtype),))
    assert y.dtype == dtype and y_dot.dtype == dtype
    assert_bitwise_equal(y, np.clip(np.asarray(x), -1, 1).astype(dtype))


def test_integer_input_is_promoted():
    y = clip_passthrough(jnp.array([-3, 0, 3]), -1, 1)
    assert y.dtype == jnp.float32
    np.testing.assert_array_equal(y, [-1.0, 0.0, 1.0])


def test_scalar_and_empty():
    assert float(clip_passthrough(5.0, 0.0, 1.0)) == 1.0
    assert clip_passthrough(jnp.zeros((0, 3)), 0.0, 1.0).shape == (0, 3)


def test_errors():
    with pytest.raises(ValueError, match=r"`lo` must be <= `hi`, got lo=2\.0 > hi=1\.0"):
        clip_passthrough(X, 2.0, 1.0)
    with pytest.raises(ValueError, match=r"at index \(1,\)"):
        clip_passthrough(X, jnp.array([0.0, 3.0, 0.0]), 1.0)
    with pytest.raises(ValueError, match="`hi`.*NaN"):
        clip_passthrough(X, 0.0, float("nan"))
    with pytest.raises(ValueError, match=r"`lo` of shape \(2,\)"):
        clip_passthrough(X, jnp.zeros(2), 1.0)
    with pytest.raises(TypeError, match="lo"):
        clip_passthrough(X, True, 1.0)
    with pytest.raises(TypeError):
        clip_passthrough(X.astype(jnp.complex64), 0.0, 1.0)


def test_traced_bounds_are_not_value_checked():
    # Inside jit, lo > hi cannot be detected; the result is jnp.clip's, which returns hi.
    out = jax.jit(clip_passthrough)(X, jnp.array(2.0), jnp.array(1.0))
    np.testing.assert_array_equal(out, np.clip(np.asarray(X), 2.0, 1.0))
