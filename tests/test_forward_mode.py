"""Forward-mode differentiation through the quantizers, layers and models: `jax.jvp`, `jax.jacfwd`, `jax.hessian`,
checked against NumPy, finite differences of the straight-through surrogate, reverse mode, and the backward rule
the quantizers had as a `jax.custom_vjp`."""

import functools

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import eqx_quant
from eqx_quant._fake_quant import _fake_quant_vjp_jit, fake_quant_scales
from eqx_quant._format import as_format
from eqx_quant._scales import Scales

from .helpers import reference_fake_quant, slow_unless


RNG = np.random.default_rng(0)
X = jnp.asarray((RNG.standard_normal((6, 32)) * 2).astype(np.float32))


def test_jvp_of_fake_quant_is_the_clipped_straight_through_tangent():
    x = X.at[0, 0].set(jnp.nan).at[1, 1].set(100.0).at[2, 2].set(-100.0)
    t = jnp.asarray(RNG.standard_normal(x.shape).astype(np.float32))
    scale = jnp.linspace(0.1, 0.6, 6, dtype=jnp.float32)[:, None]
    _, want, _, _ = reference_fake_quant(np.asarray(x), np.asarray(scale), -8, 7, cotangent=np.asarray(t))
    f = functools.partial(eqx_quant.fake_quant_format, scale=scale, format="int4")
    for g in (f, jax.jit(f)):
        y, y_dot = jax.jvp(g, (x,), (t,))
        np.testing.assert_array_equal(y_dot, want)
        np.testing.assert_array_equal(y, f(x))
    _, y_dot = jax.vmap(lambda a, b: jax.jvp(lambda r: eqx_quant.fake_quant_format(r, 0.25, 4), (a,), (b,)))(x, t)
    _, want, _, _ = reference_fake_quant(np.asarray(x), 0.25, -8, 7, cotangent=np.asarray(t))
    np.testing.assert_array_equal(y_dot, want)


def test_jvp_towards_scale_and_zero_point_is_the_learned_step_size_rule():
    x = X.at[0, 0].set(jnp.nan)
    scale = jnp.linspace(0.1, 0.6, 6, dtype=jnp.float32)[:, None]
    zero_point = jnp.arange(-3.0, 3.0, dtype=jnp.float32)[:, None]
    d_scale = jnp.asarray(RNG.standard_normal(scale.shape).astype(np.float32))
    d_zero_point = jnp.asarray(RNG.standard_normal(scale.shape).astype(np.float32))
    ones = np.ones(x.shape, np.float32)
    _, _, slope, zp_slope = reference_fake_quant(np.asarray(x), np.asarray(scale), 0, 15, np.asarray(zero_point), ones)
    f = lambda s, z: eqx_quant.fake_quant_format(x, s, "uint4", zero_point=z)  # noqa: E731
    _, y_dot = jax.jvp(f, (scale, zero_point), (d_scale, jnp.zeros_like(zero_point)))
    np.testing.assert_array_equal(y_dot, np.where(np.isnan(x), 0, slope * np.asarray(d_scale)))
    _, y_dot = jax.jvp(f, (scale, zero_point), (jnp.zeros_like(scale), d_zero_point))
    np.testing.assert_array_equal(y_dot, zp_slope * np.asarray(d_zero_point))


def test_fake_quant_stays_a_custom_vjp_and_fake_quant_format_computes_its_bits_in_both_modes():
    x = X.at[0, 0].set(jnp.nan)
    g = jnp.asarray(RNG.standard_normal(x.shape).astype(np.float32)).at[1, 0].set(jnp.nan)
    scale = jnp.linspace(0.1, 0.6, 6, dtype=jnp.float32)[:, None]
    zero_point = jnp.arange(0.0, 6.0, dtype=jnp.float32)[:, None]
    fq = lambda a, s, z: jnp.sum(eqx_quant.fake_quant(a, s, 0, 15, z) * g)  # noqa: E731
    fqf = lambda a, s, z: jnp.sum(eqx_quant.fake_quant_format(a, s, "uint4", zero_point=z) * g)  # noqa: E731
    for transform in (lambda f: f, jax.jit):
        got = transform(jax.grad(fqf, (0, 1, 2)))(x, scale, zero_point)
        want = transform(jax.grad(fq, (0, 1, 2)))(x, scale, zero_point)
        for a, b in zip(got, want, strict=True):
            np.testing.assert_array_equal(np.asarray(a).view(np.uint32), np.asarray(b).view(np.uint32))
    with pytest.raises(TypeError, match="custom_vjp"):
        jax.jvp(lambda a: eqx_quant.fake_quant(a, 0.5, -8, 7), (x,), (x,))


def _surrogate_derivatives(x, scale, fmt, h=1e-3):
    """Central differences, in float64, of the straight-through surrogate `s * (clip(x / s) + c)`, where `c` (the
    rounding's offset from the clipped value at the base point) is held constant: towards `x` and towards `s`."""
    x, s = np.asarray(x, np.float64), np.asarray(scale, np.float64)
    low, high = fmt.limits(None, 1)
    low, high = float(np.asarray(low)), float(np.asarray(high))
    ends = tuple(float(np.asarray(e)) for e in fmt.ends(None, 1))
    levels = np.asarray(fake_quant_scales(jnp.asarray(x, jnp.float32), Scales(jnp.asarray(s, jnp.float32)), fmt))
    c = levels / s - np.clip(x / s, *ends)

    def surrogate(x, s):
        v = x / s
        return s * (np.where(v < low, ends[0], np.where(v > high, ends[1], v)) + c)

    dx = (surrogate(x + h, s) - surrogate(x - h, s)) / (2 * h)
    ds = (surrogate(x, s + h * s) - surrogate(x, s - h * s)) / (2 * h * s)
    return dx, ds


@pytest.mark.parametrize("format", ["int4", "uint8", "float8_e4m3fn", "float4_e2m1fn"])
def test_forward_mode_matches_finite_differences_of_the_surrogate(format):
    fmt = as_format(format)
    # Points a clear margin away from the grid's ends, where the surrogate has a kink.
    scale = np.full((6, 1), 0.3 if fmt.name.startswith("int") or fmt.name == "uint8" else 0.05, np.float32)
    low, high = (float(np.asarray(e)) for e in fmt.limits(None, 1))
    v = np.asarray(X) / scale
    x = np.where(np.abs(v - low) < 0.05, v + 0.1, np.where(np.abs(v - high) < 0.05, v - 0.1, v)) * scale
    x = jnp.asarray(x.astype(np.float32))
    want_dx, want_ds = _surrogate_derivatives(x, scale, fmt)
    f = lambda a, s: fake_quant_scales(a, Scales(s), fmt)  # noqa: E731
    _, dx = jax.jvp(f, (x, jnp.asarray(scale)), (jnp.ones_like(x), jnp.zeros((6, 1))))
    _, ds = jax.jvp(f, (x, jnp.asarray(scale)), (jnp.zeros_like(x), jnp.ones((6, 1))))
    np.testing.assert_allclose(dx, want_dx, atol=1e-6)
    np.testing.assert_allclose(ds, want_ds, rtol=1e-4, atol=1e-5)


#
# `fake_quant` stays a `jax.custom_vjp`, with the backward rule every quantizer had before the JVP rule: reverse mode
# through the JVP rule computes it bit for bit, for every format.
#


_GROUPED = (6, 4, 8)  # 6 rows of 4 groups of 8


_JVP_CASES = [
    ("int3", False, False), ("uint4", True, False), ("float8_e4m3fn", False, False), ("float4_e2m1fn", False, True),
    ("mxfp4", False, False), ("q4_0", False, False), ("q5_0", False, False),
]  # fmt: skip


@pytest.mark.parametrize(
    "format, zero_point, two_level",
    slow_unless([("uint4", True, False), ("float4_e2m1fn", False, True), ("q4_0", False, False)], _JVP_CASES),
)
def test_reverse_mode_through_the_jvp_rule_is_the_custom_vjp_bit_for_bit(format, zero_point, two_level):
    fmt = as_format("nvfp4") if two_level else as_format(format)
    x = jnp.asarray((RNG.standard_normal(_GROUPED) * np.exp(RNG.uniform(-2, 2, _GROUPED))).astype(np.float32))
    x = x.at[0, 0, 0].set(jnp.nan).at[1, 1, 1].set(jnp.inf)
    g = jnp.asarray(RNG.standard_normal(_GROUPED).astype(np.float32)).at[0, 0, 0].set(jnp.nan).at[2, 0, 0].set(jnp.inf)
    scale = jnp.asarray(RNG.uniform(0.05, 0.5, (6, 4, 1)).astype(np.float32))
    if two_level:
        scale = jnp.asarray(np.asarray(scale).astype(jnp.float8_e4m3fn).astype(np.float32))
    if fmt.scale == "e8m0":  # powers of two
        scale = jnp.exp2(jnp.round(jnp.log2(scale)))
    zp = jnp.asarray(RNG.integers(0, 8, (6, 4, 1)).astype(np.float32)) if zero_point else None
    ts = jnp.float32(0.7) if two_level else None

    def loss(op, x, scale, zp, ts):
        return jnp.sum(op(x, scale, zp, ts) * g)

    new_op = lambda *a: fake_quant_scales(a[0], Scales(*a[1:]), fmt)  # noqa: E731
    old_op = lambda *a: _fake_quant_vjp_jit(*a, fmt)  # noqa: E731
    argnums = tuple(i for i, a in enumerate((x, scale, zp, ts)) if a is not None)
    for transform in (lambda f: f, jax.jit):
        new = transform(jax.grad(functools.partial(loss, new_op), argnums))(x, scale, zp, ts)
        old = transform(jax.grad(functools.partial(loss, old_op), argnums))(x, scale, zp, ts)
        for a, b in zip(new, old, strict=True):
            np.testing.assert_array_equal(np.asarray(a).view(np.uint32), np.asarray(b).view(np.uint32))


QUANTIZERS = {
    "static": eqx_quant.FakeQuant(0.05, -8, 7),
    "dynamic_per_row": eqx_quant.DynamicFakeQuant(8, axis=0),
    "dynamic_fp8": eqx_quant.DynamicFakeQuant("float8_e4m3fn"),
    "mxfp4": eqx_quant.DynamicFakeQuant("mxfp4", group_size=32),
    "nvfp4": eqx_quant.DynamicFakeQuant("nvfp4", group_size=16),
    "learned_groups": eqx_quant.LearnedFakeQuant.init_from(X, 4, group_size=8),
    "learned_asymmetric": eqx_quant.LearnedFakeQuant.init_from(X, 4, symmetric=False, axis=0),
    "learned_nvfp4": eqx_quant.LearnedFakeQuant.init_from(X, "nvfp4", group_size=16),
    "learned_mxfp4": eqx_quant.LearnedFakeQuant.init_from(X, "mxfp4", group_size=32),
    "q4_0": eqx_quant.DynamicFakeQuant("q4_0", group_size=32),
}


@pytest.mark.parametrize(
    "name",
    [pytest.param(n, marks=pytest.mark.slow) if n in ("learned_nvfp4", "learned_mxfp4", "dynamic_fp8") else n
     for n in sorted(QUANTIZERS)],
)  # fmt: skip
def test_jacfwd_equals_jacrev_through_every_quantizer(name):
    quantizer = QUANTIZERS[name]
    x = X[:2, :16] if "fp4" not in name and name != "q4_0" else X[:2]  # blocks of 16 or 32
    if name.startswith("learned"):
        quantizer = type(quantizer).init_from(x, quantizer.format, **_layout_kwargs(name))
    forward, reverse = _both_jacobians(lambda a: quantizer(a), x)
    np.testing.assert_array_equal(forward, reverse)
    if name.startswith("learned"):
        params, static = eqx.partition(quantizer, eqx.is_inexact_array)
        forward, reverse = _both_jacobians(lambda p: eqx.combine(p, static)(x), params)
        for a, b in zip(jax.tree.leaves(forward), jax.tree.leaves(reverse), strict=True):
            np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)
            assert np.any(a != 0)


def _both_jacobians(f, x):
    """`jax.jacfwd(f)(x)` and `jax.jacrev(f)(x)`, compiled together in one program (one compilation, not the
    many small ones of eager dispatch)."""
    return jax.jit(lambda a: (jax.jacfwd(f)(a), jax.jacrev(f)(a)))(x)


def _layout_kwargs(name):
    return {
        "learned_groups": dict(group_size=8),
        "learned_asymmetric": dict(symmetric=False, axis=0),
        "learned_nvfp4": dict(group_size=16),
        "learned_mxfp4": dict(group_size=32),
    }[name]


MLP = eqx.nn.MLP(32, 4, 32, 2, activation=jax.nn.gelu, key=jax.random.key(0))
BATCH = jnp.asarray(RNG.standard_normal((3, 32)).astype(np.float32))


@pytest.mark.parametrize(
    "name, learned",
    [pytest.param(*case, marks=pytest.mark.slow) for case in
     [("w8a8", False), ("w8a8", True), ("w4a16_g32", False), ("w4a16_g32", True), ("fp8", False), ("nvfp4", False),
      ("nvfp4", True)]],
)  # fmt: skip
def test_forward_and_reverse_mode_agree_on_a_quantized_model(name, learned):
    model = eqx_quant.quantize(MLP, **eqx_quant.recipe(name, learned=learned))
    params, static = eqx.partition(model, eqx.is_inexact_array)

    def loss(p, x):
        return jnp.sum(jax.vmap(eqx.combine(p, static))(x) ** 2)

    @jax.jit  # one compiled program for the four derivatives
    def derivatives(p, t, x):
        forward = jax.jvp(lambda q: loss(q, x), (p,), (t,))[1]
        f = lambda a: jax.vmap(eqx.combine(p, static))(a)  # noqa: E731
        return forward, jax.grad(loss)(p, x), jax.jacfwd(f)(x), jax.jacrev(f)(x)

    tangent = jax.tree.map(lambda a: jnp.asarray(RNG.standard_normal(a.shape).astype(a.dtype)), params)
    forward, grads, jac_fwd, jac_rev = derivatives(params, tangent, BATCH)
    reverse = sum(jnp.vdot(a, b) for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(tangent), strict=True))
    np.testing.assert_allclose(forward, reverse, rtol=2e-5)
    np.testing.assert_allclose(jac_fwd, jac_rev, rtol=1e-5, atol=1e-6)
    assert np.any(np.asarray(jac_fwd) != 0)


def _ste(a, scale, qmin, qmax):
    """The straight-through surrogate of `fake_quant(a, scale, qmin, qmax)` written with plain JAX: the quantized
    value, with derivative 1 where `a / scale` lies in `[qmin, qmax]` and 0 elsewhere."""
    v = a * (1 / scale)
    inside = jax.lax.stop_gradient(((v >= qmin) & (v <= qmax)).astype(a.dtype))
    q = scale * jnp.clip(jnp.round(v), qmin, qmax)
    return a * inside + jax.lax.stop_gradient(q - a * inside)


@pytest.mark.slow
def test_hessian_of_an_integer_model_is_that_of_the_straight_through_surrogate():
    """Second derivatives through the integer forward (both layers' weights and the input, their cross terms
    included) equal those of the surrogate written with plain JAX."""
    mlp = eqx.nn.MLP(8, 4, 8, 2, activation=jax.nn.gelu, key=jax.random.key(0))  # small: Hessians grow as n**2
    w_scales = [jnp.asarray(RNG.uniform(0.01, 0.03, (n, 1)).astype(np.float32)) for n in (8, 8, 4)]
    scales = iter(w_scales)
    model = eqx_quant.quantize(
        mlp,
        weights=lambda path, layer: eqx_quant.FakeQuant(next(scales)[:, 0], -128, 127, axis=0),
        activations=eqx_quant.FakeQuant(0.05, -128, 127),
    )
    x = BATCH[0, :8]
    jaxpr = str(jax.make_jaxpr(model)(x))
    # Three integer products, each computed for the batch it runs for and its output behind a conditional.
    assert jaxpr.count("custom_vmap_call") == 6 and "preferred_element_type=int32" in jaxpr

    def surrogate(weights, x):
        h = x
        for i, (w, layer) in enumerate(zip(weights, mlp.layers, strict=True)):
            h = _ste(w, w_scales[i], -128, 127) @ _ste(h, 0.05, -128, 127) + layer.bias
            h = jax.nn.gelu(h) if i < 2 else h
        return jnp.sum(h**2)

    def quantized(weights, x):
        m = eqx.tree_at(lambda m: [layer.layer.weight for layer in m.layers], model, weights)
        return jnp.sum(m(x) ** 2)

    weights = [layer.weight for layer in mlp.layers]
    # All four Hessians in one compiled program (one compilation, not the many small ones of eager dispatch).
    hessians = jax.jit(
        lambda w, x: [(jax.hessian(quantized, i)(w, x), jax.hessian(surrogate, i)(w, x)) for i in (0, 1)]
    )
    results = hessians(weights, x)
    for got, want in results:
        for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
            np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)
    cross = results[0][0][0][1]  # d2 / dW0 dW1 (of the quantized model): through the integer forward's JVP rule
    assert np.any(np.asarray(cross) != 0)


@pytest.mark.slow
def test_forward_mode_through_an_integer_einsum():
    a = jnp.asarray(RNG.standard_normal((4, 8)).astype(np.float32))
    b = jnp.asarray(RNG.standard_normal((8, 4)).astype(np.float32))
    quantizer = eqx_quant.DynamicFakeQuant(8)
    product = eqx_quant.nn.QuantEinsum(eqx_quant.nn.Einsum("ik,kj->ij"), lhs_quant=quantizer, rhs_quant=quantizer)
    forward, reverse = _both_jacobians(lambda ab: product(*ab), (a, b))
    for f, r in zip(forward, reverse, strict=True):
        np.testing.assert_allclose(f, r, rtol=1e-6, atol=1e-6)
    eager = jax.jacfwd(lambda ab: product(*ab))((a, b))  # operation by operation: the JVP rule run eagerly
    for e, f in zip(eager, forward, strict=True):
        np.testing.assert_array_equal(e, f)
    # Straight through: the derivative towards `a` is the fake-quantized `b`.
    bq = eqx_quant.DynamicFakeQuant(8)(b)
    np.testing.assert_array_equal(forward[0][0, :, 0, :], bq.T)
    np.testing.assert_array_equal(forward[0][0, :, 1, :], np.zeros((4, 8), np.float32))


@pytest.mark.slow
def test_forward_mode_is_an_error_under_a_quantized_backward():
    """`QuantizedBackward` replaces the backward pass itself, which has no forward-mode counterpart."""
    model = eqx_quant.quantize(MLP, backward=eqx_quant.QuantizedBackward(8))
    with pytest.raises(TypeError, match="custom_vjp"):
        jax.jvp(model, (BATCH[0],), (BATCH[1],))


class _ConvAttention(eqx.Module):
    conv: eqx.nn.Conv1d
    attention: eqx.nn.MultiheadAttention
    embed: eqx.nn.Embedding

    def __init__(self, key):
        k1, k2, k3 = jax.random.split(key, 3)
        self.conv = eqx.nn.Conv1d(32, 32, 3, padding=1, key=k1)
        self.attention = eqx.nn.MultiheadAttention(2, 32, key=k2)
        self.embed = eqx.nn.Embedding(10, 32, key=k3)

    def __call__(self, x, tokens):
        h = jax.nn.gelu(self.conv((x + jax.vmap(self.embed)(tokens)).T)).T
        return self.attention(h, h, h)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["w8a8_attn", "w4a8_g32", "mxfp4"])
def test_forward_mode_through_convolutions_embeddings_and_attention(name):
    model = eqx_quant.quantize(_ConvAttention(jax.random.key(4)), **eqx_quant.recipe(name))
    x = jnp.asarray(RNG.standard_normal((4, 32)).astype(np.float32))
    tokens = jnp.arange(4)
    jac_fwd, jac_rev = _both_jacobians(lambda a: model(a, tokens), x)
    np.testing.assert_allclose(jac_fwd, jac_rev, rtol=1e-5, atol=1e-6)
    assert np.any(np.asarray(jac_fwd) != 0)
