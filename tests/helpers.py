"""NumPy reference implementations and comparison helpers for the tests."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest


def compute_dtype(dtype) -> np.dtype:
    return np.dtype(np.float32) if np.dtype(dtype).itemsize < 4 else np.dtype(dtype)


def reference_fake_quant(x, scale, qmin, qmax, zero_point=0, cotangent=None):
    """NumPy fake quantization: values and, given a cotangent, the gradients of `x`, `scale` and `zero_point`.

    `x / scale` is taken as `x * (1 / scale)` in the compute dtype, which is eqx_quant's documented convention.
    Gradients for `scale` and `zero_point` are returned at full size (not summed over broadcast axes).
    """
    x = np.asarray(x)
    dtype = compute_dtype(x.dtype)
    xc = x.astype(dtype)
    s = np.asarray(scale, dtype=dtype)
    z = np.asarray(zero_point, dtype=dtype)
    v = _flush_subnormals(_flush_subnormals(xc) * (dtype.type(1) / s))
    levels = np.clip(np.round(v) + z, qmin, qmax)
    values = (s * (levels - z)).astype(x.dtype)
    if cotangent is None:
        return values
    g = np.asarray(cotangent, dtype=dtype)
    with np.errstate(invalid="ignore"):
        # the mask on v + z, evaluated exactly as v against the integers qmin - z and qmax - z
        inside = (v >= qmin - z) & (v <= qmax - z)
        below = v < qmin - z
        above = v > qmax - z
        grad_x = np.where(inside, g, 0)
        d_scale = np.select([inside, below, above], [np.round(v) - v, qmin - z, qmax - z], 0)
    grad_scale = g * d_scale
    grad_zp = np.where(below | above, -s * g, 0)
    return values, grad_x, grad_scale, grad_zp


def _flush_subnormals(a):
    """Subnormal floats as zeros of the same sign: XLA on CPU (and GPU) flushes them, in inputs and results."""
    tiny = np.finfo(a.dtype).tiny
    return np.where(np.abs(a) < tiny, a * a.dtype.type(0), a)


def sum_to_shape(a, shape):
    """Sums a full-size NumPy array down to `shape` (the adjoint of broadcasting), with an explicit loop."""
    a = np.asarray(a)
    while a.ndim > len(shape):
        a = a.sum(axis=0)
    for i, s in enumerate(shape):
        if s == 1 and a.shape[i] != 1:
            a = a.sum(axis=i, keepdims=True)
    return a


def bits_of(a) -> np.ndarray:
    """The raw bit patterns of a float array, with -0.0 mapped to 0.0.

    eqx_quant's contract is bit-for-bit equality except for the sign of a zero: XLA may fold `x + 0.0` to `x` under
    `jit` but not in eager mode, so no library can promise it (see the Concepts page of the docs).
    """
    a = np.asarray(a)
    a = np.where(a == 0, np.zeros((), a.dtype), a)
    return a.view(np.dtype(f"u{a.dtype.itemsize}"))


def assert_bitwise_equal(a, b):
    """Asserts equal dtypes, shapes and bit patterns (NaNs at the same places; the sign of zero aside)."""
    a, b = np.asarray(a), np.asarray(b)
    assert a.dtype == b.dtype, (a.dtype, b.dtype)
    assert a.shape == b.shape, (a.shape, b.shape)
    np.testing.assert_array_equal(bits_of(a), bits_of(b))


def assert_trees_equal(a, b):
    """Asserts equal tree structures, and equal dtypes, shapes and values of every array leaf (other leaves equal)."""
    leaves_a, tree_a = jax.tree_util.tree_flatten(a)
    leaves_b, tree_b = jax.tree_util.tree_flatten(b)
    assert tree_a == tree_b
    for x, y in zip(leaves_a, leaves_b, strict=True):
        if isinstance(x, jax.Array):
            assert isinstance(y, jax.Array) and x.dtype == y.dtype and x.shape == y.shape
            np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
        else:
            assert x == y


def zeros_like_tree(tree):
    """`tree` with every array leaf replaced by zeros of its shape and dtype: a skeleton to load into."""
    return jax.tree.map(lambda a: jnp.zeros_like(a) if isinstance(a, jax.Array) else a, tree)


def np_absmax_scale(absmax, qmax):
    """NumPy twin of the symmetric scale: `absmax / qmax`, stepped up by ulps until `absmax` maps inside the range."""
    f32 = np.float32
    absmax = np.asarray(absmax, f32)
    scale = np.maximum(absmax * f32(1.0 / qmax), np.finfo(f32).tiny)
    for _ in range(4):
        scale = np.where(absmax * (f32(1) / scale) > qmax, np.nextafter(scale, f32(np.inf)), scale)
    return scale.astype(f32)


def init(make, seed: int):
    """The layer (or model) `make(key)` with NumPy-random parameters instead of its own random initialisation, which
    would compile a few operations for every new shape."""
    rng = np.random.default_rng(seed)

    def fill(leaf):
        if not isinstance(leaf, jax.ShapeDtypeStruct):
            return leaf
        fan_in = int(np.prod(leaf.shape[1:])) if len(leaf.shape) > 1 else 4
        return jnp.asarray((rng.uniform(-1, 1, leaf.shape) / np.sqrt(fan_in)).astype(leaf.dtype))

    return jax.tree.map(fill, eqx.filter_eval_shape(make, jax.random.key(0)))


def integer_products(jaxpr) -> int:
    """The `dot_general`s of two integer operands (int8, or int16 for levels minus an asymmetric zero point) with
    int32 results, in `jaxpr` and the jaxprs inside it (scan bodies, custom derivatives, nested calls; of a choice
    between platforms, the branch with the most)."""
    count = 0
    for eqn in jaxpr.eqns:
        if eqn.params.get("branches_platforms"):  # one product, formulated for each platform: counted once
            count += max(integer_products(branch.jaxpr) for branch in eqn.params["branches"])
            continue
        if eqn.primitive.name == "dot_general":
            dtypes = {str(v.aval.dtype) for v in eqn.invars}
            count += dtypes <= {"int8", "int16"} and str(eqn.outvars[0].aval.dtype) == "int32"
        for param in eqn.params.values():
            for sub in param if isinstance(param, (list, tuple)) else (param,):
                if isinstance(sub, jax.extend.core.ClosedJaxpr):
                    count += integer_products(sub.jaxpr)
                elif isinstance(sub, jax.extend.core.Jaxpr):
                    count += integer_products(sub)
    return count


def slow_unless(keep, cases) -> list:
    """`pytest.mark.parametrize` cases with those not in `keep` marked slow: the default run (CI's tier) runs the
    cases in `keep`, `pytest --all` every case. A case is one value, or a tuple of values for several names (a
    tuple is always unpacked: not for one name whose values are tuples, nor for cases already `pytest.param`)."""
    missing = [case for case in keep if case not in cases]
    if missing:
        raise ValueError(f"cases to keep that are not cases: {missing}")
    return [
        case if case in keep else pytest.param(*(case if isinstance(case, tuple) else (case,)), marks=pytest.mark.slow)
        for case in cases
    ]


# For tests whose small calibration sets (compiles dominate their time) give layers fewer rows than input features,
# which the weight solvers warn of (tested in tests/test_gptq.py::test_fewer_calibration_rows_than_features_warn).
few_rows = pytest.mark.filterwarnings("ignore:`[a-z]+`. layers saw fewer rows of calibration input:UserWarning")
