"""GPTQ: the column-by-column algorithm against a NumPy twin, against round-to-nearest, and on models."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import enable_x64

import eqx_quant
from eqx_quant import DynamicFakeQuant, LearnedFakeQuant, gptq
from eqx_quant._gptq import gptq_quantize

from .helpers import assert_bitwise_equal, init, np_absmax_scale, reference_fake_quant, slow_unless


def numpy_gptq(w, h, qmin, qmax, group_size=None, act_order=False, damp=0.01, candidates=None):
    """A float64 NumPy twin of GPTQ written from the paper, one column at a time (no blocks), with explicit loops;
    with `candidates`, each scale is the clipping threshold `k / candidates` of the largest magnitude of least
    squared rounding error, weighted by the Hessian's diagonal (`method="mse"`), tried one by one."""
    w, h = np.array(w, np.float64), np.array(h, np.float64)
    out, n = w.shape
    g = n if group_size is None else group_size
    for i in range(n):
        if h[i, i] == 0:
            h[i, i] = 1.0
            w[:, i] = 0.0
    energy = np.diag(h) / np.max(np.diag(h))  # in the original column order
    order = np.argsort(-np.diag(h), kind="stable") if act_order else np.arange(n)
    h = h[np.ix_(order, order)]
    h = h + damp * np.mean(np.diag(h)) * np.eye(n)
    u = np.linalg.cholesky(np.linalg.inv(h)).T

    def scale_of(block, first):  # the block's columns start at column `first` of the original order
        block = block.astype(np.float32)
        absmax = np.abs(block).max(axis=1)
        if candidates is None:
            return np_absmax_scale(absmax, qmax).astype(np.float64)
        e = energy[first : first + block.shape[1]]
        best = np.zeros(out, np.float32)
        for row in range(out):
            errors = []
            threshold = lambda k: absmax[row] * (np.float32(k) / np.float32(candidates))  # noqa: E731, B023
            for k in range(1, candidates + 1):
                s = np_absmax_scale(threshold(k), qmax)
                q = np.clip(np.round(block[row] * (np.float32(1) / s)), qmin, qmax)
                errors.append(np.sum(e * ((s * q - block[row]).astype(np.float64) / absmax[row]) ** 2))
            best[row] = np_absmax_scale(threshold(np.argmin(errors) + 1), qmax)  # the first of ties
        return best.astype(np.float64)

    scales = np.stack([scale_of(w[:, k * g : (k + 1) * g], k * g) for k in range(n // g)], axis=1)
    w = w[:, order]
    levels = np.zeros((out, n), np.int64)
    for i in range(n):
        if group_size is not None and not act_order and i % g == 0:
            scales[:, i // g] = scale_of(w[:, i : i + g], i)
        s = scales[:, order[i] // g]
        q = np.clip(np.round(w[:, i] * (1 / s)), qmin, qmax)
        err = (w[:, i] - s * q) / u[i, i]
        for j in range(i + 1, n):
            w[:, j] -= err * u[i, j]
        levels[:, i] = q
    inverse = np.argsort(order)
    return levels[:, inverse], scales


def numpy_rtn(w, qmin, qmax, group_size=None):
    """Round-to-nearest with symmetric absmax scales per row (or per group of columns), in NumPy float32."""
    w = np.asarray(w, np.float32)
    out, n = w.shape
    g = n if group_size is None else group_size
    groups = w.reshape(out, n // g, g)
    scales = np_absmax_scale(np.abs(groups).max(axis=2), qmax)
    levels = np.clip(np.round(groups * (np.float32(1) / scales[:, :, None])), qmin, qmax)
    return levels.reshape(out, n).astype(np.int64), scales


def correlated_inputs(seed, n, count):
    """Inputs with strongly correlated features: a few latent factors mixed into `n` features plus small noise.
    Drawn with NumPy: `jax.random` compiles its sampler anew for every shape."""
    rng = np.random.default_rng(seed)
    latent = rng.standard_normal((count, 4)).astype(np.float32)
    mix = rng.standard_normal((4, n)).astype(np.float32)
    return (latent @ mix + np.float32(0.05) * rng.standard_normal((count, n)).astype(np.float32)).astype(np.float64)


CASES = [
    dict(group_size=None, act_order=False),
    dict(group_size=None, act_order=False, block_size=5),  # 7 blocks, the last one padded
    dict(group_size=8, act_order=False),  # one block of 32: four groups
    dict(group_size=8, act_order=False, block_size=24),  # blocks of 24 (3 groups), the second one padded
    dict(group_size=16, act_order=False, block_size=6),  # blocks of 4: a group spans 4 blocks
    dict(group_size=8, act_order=True, block_size=7),
    # Scales that clip where that rounds with less error: per row, lazy groups across blocks, static groups.
    dict(group_size=None, act_order=False, method="mse", num_candidates=20),
    dict(group_size=16, act_order=False, block_size=6, method="mse", num_candidates=20),
    dict(group_size=8, act_order=True, block_size=7, method="mse", num_candidates=20),
]


@pytest.mark.parametrize("case", slow_unless(CASES[:1], CASES))
def test_matches_the_numpy_twin_in_float64(case):
    rng = np.random.default_rng(0)
    w = rng.normal(size=(6, 32))
    x = correlated_inputs(1, 32, 200)
    x[:, 5] = 0.0  # a dead input feature
    h = 2 * x.T @ x
    expected_levels, expected_scales = numpy_gptq(
        w, h, -8, 7, group_size=case["group_size"], act_order=case["act_order"], candidates=case.get("num_candidates")
    )
    with enable_x64(True):
        levels, scales = gptq_quantize(jnp.asarray(w), jnp.asarray(h), -8, 7, **case)
        levels, scales = np.asarray(levels), np.asarray(scales)
    assert levels.dtype == np.int32 and scales.dtype == np.float32
    np.testing.assert_array_equal(levels, expected_levels)
    np.testing.assert_array_equal(scales, expected_scales.astype(np.float32))
    assert np.all(levels[:, 5] == 0)
    # The error feedback does something: the levels are not round-to-nearest's.
    assert np.any(levels != numpy_rtn(w, -8, 7, case["group_size"])[0])
    if "method" in case:
        # The search clips some scales below the absmax scale of the same columns.
        absmax_levels, absmax_scales = numpy_gptq(w, h, -8, 7, case["group_size"], case["act_order"])
        assert np.any(scales < absmax_scales)
        if not case["act_order"]:
            # Here it errs less on the inputs. (With `act_order`, the static groups' scales are clipped on the
            # original weight, which the error feedback then moves: on these strongly correlated inputs, further.)
            g = case["group_size"] or 32
            error = lambda lv, sc: np.linalg.norm((np.repeat(sc, g, axis=1) * lv - w) @ x.T)  # noqa: E731
            assert error(levels, scales) < error(absmax_levels, absmax_scales)


@pytest.mark.slow
def test_float32_agrees_with_the_twin_up_to_ties():
    rng = np.random.default_rng(2)
    w = rng.normal(size=(16, 64)).astype(np.float32)
    x = correlated_inputs(3, 64, 300)
    h = 2 * x.T @ x
    for kwargs in (dict(group_size=16), dict(group_size=None, act_order=True, block_size=24)):
        expected, _ = numpy_gptq(w, h, -4, 3, group_size=kwargs["group_size"], act_order="act_order" in kwargs)
        levels, _ = gptq_quantize(jnp.asarray(w), jnp.asarray(h, jnp.float32), -4, 3, **kwargs)
        # A float32 level can differ from the float64 one only where the float64 `w / s` lies within float32's
        # rounding drift of a half-integer (a tie); once one differs, the different error fed back may move later
        # levels of the same row. On these inputs none differs; 1% (10 of 1024) leaves room for one such run.
        mismatch = np.mean(np.asarray(levels) != expected)
        assert mismatch <= 0.01, (kwargs, mismatch)


@pytest.mark.parametrize(
    "kwargs",
    [dict(group_size=None), dict(group_size=4, block_size=6), dict(group_size=4, act_order=True, block_size=5)],
)
@pytest.mark.slow
def test_diagonal_hessian_is_round_to_nearest(kwargs):
    # With a diagonal Hessian, U is diagonal: no error reaches another column, and every column is rounded alone.
    rng = np.random.default_rng(4)
    w = rng.normal(size=(5, 12)).astype(np.float32)
    hessian = jnp.diag(jnp.asarray(rng.uniform(0.5, 3.0, size=12).astype(np.float32)))
    levels, scales = gptq_quantize(jnp.asarray(w), hessian, -8, 7, **kwargs)
    expected_levels, expected_scales = numpy_rtn(w, -8, 7, kwargs["group_size"])
    np.testing.assert_array_equal(np.asarray(levels), expected_levels)
    np.testing.assert_array_equal(np.asarray(scales), expected_scales)
    # And the library's own round-to-nearest agrees.
    if kwargs["group_size"] is None:
        rtn = DynamicFakeQuant(4, axis=0).quantize(jnp.asarray(w))
        np.testing.assert_array_equal(np.asarray(levels), np.asarray(rtn.levels()))
        np.testing.assert_array_equal(np.asarray(scales), np.asarray(rtn.scale))


@pytest.mark.parametrize("bits, group_size", [(3, None), (4, None), (3, 8), (4, 8)])
@pytest.mark.slow
def test_lower_output_error_than_round_to_nearest(bits, group_size):
    qmin, qmax = eqx_quant.int_range(bits)
    rng = np.random.default_rng(5)
    w = rng.normal(size=(16, 32)).astype(np.float32)
    x = correlated_inputs(6, 32, 400).astype(np.float32)
    levels, scales = gptq_quantize(
        jnp.asarray(w), jnp.asarray(2 * x.T @ x), qmin, qmax, group_size=group_size, block_size=12
    )
    g = 32 if group_size is None else group_size
    w_gptq = np.asarray(levels) * np.repeat(np.asarray(scales), g, axis=1)
    rtn_levels, rtn_scales = numpy_rtn(w, qmin, qmax, group_size)
    w_rtn = rtn_levels * np.repeat(rtn_scales, g, axis=1)
    error = lambda v: np.linalg.norm(x @ (w - v).T)  # noqa: E731
    # Measured: 0.29 (3 bits) and 0.27 (4 bits) per row, 0.35 and 0.29 per group of 8.
    assert error(w_gptq) < 0.4 * error(w_rtn), (error(w_gptq), error(w_rtn))


@pytest.mark.parametrize(
    "kwargs", [dict(group_size=4, block_size=6), dict(group_size=None, act_order=True, block_size=5)]
)
@pytest.mark.slow
def test_jit_and_vmap_over_a_stack_equal_per_layer_calls(kwargs):
    rng = np.random.default_rng(7)
    w = jnp.asarray(rng.normal(size=(2, 4, 16)).astype(np.float32))
    x = correlated_inputs(8, 16, 100).astype(np.float32)
    h = jnp.stack([jnp.asarray(2 * x.T @ x), jnp.asarray(x.T @ x + np.eye(16, dtype=np.float32))])
    solve = lambda w, h: gptq_quantize(w, h, -8, 7, **kwargs)  # noqa: E731
    mapped = jax.vmap(solve)(w, h)
    jitted = jax.jit(jax.vmap(solve))(w, h)
    for i in range(2):
        one = solve(w[i], h[i])
        for stacked in (mapped, jitted):
            assert_bitwise_equal(stacked[0][i], one[0])
            assert_bitwise_equal(stacked[1][i], one[1])


def test_errors():
    w, h = jnp.ones((3, 4)), jnp.eye(4)
    with pytest.raises(ValueError, match="hessian"):
        gptq_quantize(w, jnp.eye(3), -8, 7)
    # A ValueError; under the test suite's jaxtyping hook the shape annotation raises a TypeError first.
    with pytest.raises((ValueError, TypeError), match="weight"):
        gptq_quantize(jnp.ones(4), h, -8, 7)
    with pytest.raises(TypeError, match="weight"):
        gptq_quantize(jnp.ones((3, 4), jnp.int32), h, -8, 7)
    with pytest.raises(ValueError, match="group_size=3"):
        gptq_quantize(w, h, -8, 7, group_size=3)
    with pytest.raises(TypeError, match="group_size"):
        gptq_quantize(w, h, -8, 7, group_size=2.0)  # pyright: ignore[reportArgumentType]
    with pytest.raises(ValueError, match="damp=-1.0"):
        gptq_quantize(w, h, -8, 7, damp=-1.0)
    with pytest.raises(ValueError, match="damp=nan"):
        gptq_quantize(w, h, -8, 7, damp=float("nan"))
    with pytest.raises(ValueError, match="block_size=0"):
        gptq_quantize(w, h, -8, 7, block_size=0)
    with pytest.raises(TypeError, match="act_order"):
        gptq_quantize(w, h, -8, 7, act_order=1)  # pyright: ignore[reportArgumentType]
    with pytest.raises(ValueError, match="qmin=1 and qmax=15"):
        gptq_quantize(w, h, 1, 15)  # no 0 on the grid
    with pytest.raises(ValueError, match="qmin=-8 and qmax=0"):
        gptq_quantize(w, h, -8, 0)  # no positive level
    with pytest.raises(ValueError, match="qmin"):
        gptq_quantize(w, h, 7, -8)
    with pytest.raises(ValueError, match="num_candidates=0"):
        gptq_quantize(w, h, -8, 7, method="mse", num_candidates=0)
    with pytest.raises(TypeError, match="num_candidates"):  # under the suite's hook, its annotation's TypeError
        gptq_quantize(w, h, -8, 7, method="mse", num_candidates=2.0)  # pyright: ignore[reportArgumentType]
    with pytest.raises(ValueError, match="mxfp4 sets its block scales by its own rule"):
        gptq_quantize(jnp.ones((3, 32)), jnp.eye(32), format="mxfp4", group_size=32, method="mse")
    # Values GPTQ cannot solve with (a NaN weight became a row of zero levels, a zero Hessian a zero weight).
    with pytest.raises(ValueError, match=r"`weight` must be finite, got nan at index \(1, 2\)"):
        gptq_quantize(w.at[1, 2].set(jnp.nan), h, -8, 7)
    with pytest.raises(ValueError, match=r"`hessian` must be finite, got inf at index \(0, 3\)"):
        gptq_quantize(w, h.at[0, 3].set(jnp.inf), -8, 7)
    with pytest.raises(ValueError, match=r"diagonal is >= 0, got -1.0 at index \(0, 0\)"):
        gptq_quantize(w, -h, -8, 7)
    with pytest.raises(ValueError, match=r"`hessian` is zero .* every weight to zero"):
        gptq_quantize(w, jnp.zeros((4, 4)), -8, 7)


class Stacked(eqx.Module):
    """Two `Linear(16, 16)` layers stacked with `eqx.filter_vmap`, run with `jax.lax.scan`, each applied per token
    inside the model's own `vmap`."""

    layers: eqx.nn.Linear

    def __init__(self, key):
        self.layers = eqx.filter_vmap(lambda k: eqx.nn.Linear(16, 16, key=k))(jax.random.split(key, 2))

    def __call__(self, tokens):  # (tokens, 16)
        dynamic, static = eqx.partition(self.layers, eqx.is_array)

        def step(h, arrays):
            return jax.vmap(eqx.combine(arrays, static))(h) + h, None

        return jax.lax.scan(step, tokens, dynamic)[0]


def hessians_by_hand(model, tokens):
    """Each layer's `Σ x xᵀ` from running the weight-quantized `model` (inputs unquantized) one layer at a time: the
    model from `quantize` for GPTQ in one pass, the one GPTQ made for sequential GPTQ (whose first layer computes
    with GPTQ's weight, which its fixed quantizer leaves unchanged)."""
    h = np.asarray(tokens, np.float64).reshape(-1, 16)
    grams = []
    for i in range(2):
        layer = jax.tree_util.tree_map(lambda a: a[i] if eqx.is_array(a) else a, model.layers)  # noqa: B023
        grams.append(h.T @ h)
        out = np.asarray(
            jax.vmap(eqx.tree_at(lambda l: l.input_quant, layer, None, is_leaf=lambda v: v is None))(
                jnp.asarray(h, jnp.float32)
            )
        )
        h = out + h
    return grams


@pytest.mark.slow
@pytest.mark.parametrize("sequential", [True, False])
def test_nan_inputs_of_a_scanned_stack_are_counted_once(sequential):
    """One NaN entry in a token: the first layer of the stack sees it, the second the NaN row it makes (16 entries);
    sequentially, each layer's pass observes the whole stack, and the count stays 1 + 16."""
    qmodel = eqx_quant.quantize(init(Stacked, 10), weights=DynamicFakeQuant(3, group_size=8), activations=None)
    latent = correlated_inputs(11, 16, 4 * 6).astype(np.float32).reshape(4, 6, 16)
    latent[1, 2, 3] = np.nan
    with pytest.warns(UserWarning, match=r"`gptq`: .*: 'layers' 17\.$") as caught:
        gptq(qmodel, [jnp.asarray(latent[:2]), jnp.asarray(latent[2:])], sequential=sequential)
    assert len(caught) == 1


@pytest.mark.slow
@pytest.mark.parametrize("sequential, method", [(True, "absmax"), (False, "absmax"), (True, "mse")])
def test_gptq_on_a_scanned_model_uses_exactly_the_gptq_integers(sequential, method):
    model = init(Stacked, 10)
    qmodel = eqx_quant.quantize(model, weights=DynamicFakeQuant(3, group_size=8), activations=None)
    latent = correlated_inputs(11, 16, 4 * 6).astype(np.float32).reshape(4, 6, 16)
    batches = [jnp.asarray(latent[:2]), jnp.asarray(latent[2:])]
    quantized = gptq(qmodel, batches, sequential=sequential, method=method)
    quantizer = quantized.layers.weight_quant
    assert type(quantizer) is LearnedFakeQuant and quantizer.scale.shape == (2, 16, 2)
    # Sequential: the second layer's Hessian comes from the first layer's GPTQ weight; else from its RTN weight.
    grams = hessians_by_hand(quantized if sequential else qmodel, jnp.concatenate(batches))
    for i in range(2):
        expected, scales = gptq_quantize(
            qmodel.layers.layer.weight[i], jnp.asarray(grams[i], jnp.float32), -4, 3, group_size=8, method=method
        )
        one = jax.tree_util.tree_map(lambda a: a[i], quantizer)  # noqa: B023
        weight = quantized.layers.layer.weight[i]
        # The fake quantizer with GPTQ's scales puts GPTQ's quantized weight back on GPTQ's integers.
        np.testing.assert_array_equal(np.asarray(one.quantize(weight).levels()).reshape(16, 16), np.asarray(expected))
        assert_bitwise_equal(one(weight), weight)
        # The Hessian by hand sums in another order than the observers: a group's scale may move by an ulp.
        np.testing.assert_allclose(np.asarray(one.scale), np.asarray(scales), rtol=3e-6)
    # Converted, the model stores those integers and computes what the fake-quant model computes.
    run = eqx.filter_jit(lambda m, x: jax.vmap(m)(x))
    converted = eqx_quant.convert(quantized)
    assert_bitwise_equal(run(converted, batches[0]), run(quantized, batches[0]))
    # And it is closer to the float model than round-to-nearest on the same grid.
    reference = np.asarray(run(model, batches[0]))
    err = lambda m: np.linalg.norm(np.asarray(run(m, batches[0])) - reference)  # noqa: E731
    assert err(quantized) < err(qmodel)


@pytest.mark.slow
def test_gptq_on_an_mlp_gives_static_quantizers_and_checks_its_layers():
    mlp = init(lambda k: eqx.nn.MLP(16, 4, 16, 1, key=k), 12)
    x = jnp.asarray(correlated_inputs(13, 16, 64).astype(np.float32))
    qmodel = eqx_quant.quantize(mlp, weights=DynamicFakeQuant(4, axis=0))
    quantized = gptq(qmodel, [x[:32], x[32:]], act_order=True)
    for layer in quantized.layers:
        assert type(layer.weight_quant) is eqx_quant.FakeQuant and layer.weight_quant.axis == 0
        assert_bitwise_equal(layer.weight_quant(layer.layer.weight), layer.layer.weight)
    with pytest.raises(ValueError, match="layers.0"):
        gptq(eqx_quant.quantize(mlp, weights=DynamicFakeQuant(4)), [x])  # per tensor: not a GPTQ layout
    with pytest.raises(ValueError, match="symmetric"):
        gptq(eqx_quant.quantize(mlp, weights=DynamicFakeQuant(4, axis=0, symmetric=False)), [x])


@pytest.mark.slow
@pytest.mark.parametrize("sequential", [True, False])
def test_nan_inputs_count_as_zeros_in_the_hessians_with_a_warning(sequential):
    """A NaN in the calibration data is a zero in the first layer's Hessian (its solution is that of the data with
    a 0 there), and the warning counts it, and the NaN row it makes of the next layer's input, per layer."""
    mlp = init(lambda k: eqx.nn.MLP(16, 4, 16, 1, key=k), 12)
    x = correlated_inputs(13, 16, 64).astype(np.float32)
    qmodel = eqx_quant.quantize(mlp, weights=DynamicFakeQuant(4, axis=0))
    x[40, 3] = 0.0
    zeroed = gptq(qmodel, [jnp.asarray(x[:32]), jnp.asarray(x[32:])], sequential=sequential)
    x[40, 3] = np.nan
    with pytest.warns(UserWarning, match=r"`gptq`: .* take as zeros or leave out: 'layers.0' 1, 'layers.1' 16\."):
        with_nan = gptq(qmodel, [jnp.asarray(x[:32]), jnp.asarray(x[32:])], sequential=sequential)
    assert_bitwise_equal(with_nan.layers[0].layer.weight, zeroed.layers[0].layer.weight)
    assert_bitwise_equal(with_nan.layers[0].weight_quant.scale, zeroed.layers[0].weight_quant.scale)


def test_fewer_calibration_rows_than_features_warn():
    """A layer whose Hessian sums fewer rows than it has input features (here 8 < 16; a model of tokens counts each
    token) is warned of, with its rows, once per call however many passes read the batches."""
    mlp = init(lambda k: eqx.nn.MLP(16, 4, 16, 1, key=k), 12)
    qmodel = eqx_quant.quantize(mlp, weights=DynamicFakeQuant(4, axis=0))
    x = jnp.asarray(correlated_inputs(13, 16, 16), jnp.float32)
    few = r"layers saw fewer rows of calibration input \(examples, or tokens\) than they have input features"
    rows = r"\(rows of features\): 'layers.0' 8 of 16, 'layers.1' 8 of 16\."
    for sequential in (False, True):
        with pytest.warns(UserWarning, match=rf"`gptq`: {few} {rows}"):
            gptq(qmodel, [x[:5], x[5:8]], sequential=sequential)
    with pytest.warns(UserWarning, match=rf"`awq`: {few} {rows}"):
        eqx_quant.awq(qmodel, [x[:5], x[5:8]])
    # Two examples of 4 tokens each, under the model's own `jax.vmap` over tokens: 8 rows; 16 rows warn of nothing.
    per_token = eqx_quant.quantize(_PerToken(mlp), weights=DynamicFakeQuant(4, axis=0))
    with pytest.warns(UserWarning, match=r"'mlp.layers.0' 8 of 16, 'mlp.layers.1' 8 of 16\."):
        gptq(per_token, [x[:8].reshape(2, 4, 16)])
    gptq(per_token, [x.reshape(4, 4, 16)])
    gptq(qmodel, [x[:10], x[10:]])


class _PerToken(eqx.Module):
    mlp: eqx.nn.MLP

    def __call__(self, tokens):
        return jax.vmap(self.mlp)(tokens)


def test_sequential_gptq_follows_the_call_order_and_the_quantized_outputs():
    """Three layers called in another order than the model holds them: each one's Hessian is the Gram matrix of its
    inputs computed, by hand, through the layers GPTQ quantized before it."""

    class Shuffled(eqx.Module):
        a: eqx.nn.Linear
        b: eqx.nn.Linear
        c: eqx.nn.Linear

        def __call__(self, x):
            return self.a(jnp.tanh(self.c(jnp.tanh(self.b(x)))))

    model = init(lambda k: Shuffled(*(eqx.nn.Linear(8, 8, key=k) for _ in range(3))), 21)
    x = jnp.asarray(correlated_inputs(22, 8, 40).astype(np.float32))
    qmodel = eqx_quant.quantize(model, weights=DynamicFakeQuant(3, axis=0), activations=None)
    quantized = gptq(qmodel, [x[:24], x[24:]])
    h = np.asarray(x, np.float64)
    for name in ("b", "c", "a"):  # the call order
        expected, _ = gptq_quantize(getattr(qmodel, name).layer.weight, jnp.asarray(h.T @ h, jnp.float32), -4, 3)
        layer = getattr(quantized, name)
        levels = layer.weight_quant.quantize(layer.layer.weight).levels()
        np.testing.assert_array_equal(np.asarray(levels), np.asarray(expected))
        h = np.tanh(np.asarray(jax.vmap(layer)(jnp.asarray(h, jnp.float32)), np.float64))


@pytest.mark.slow
def test_quantized_inputs_on_a_scanned_stack_use_each_layers_calibrated_input_scale():
    """Sequential GPTQ with `quantized_inputs=True` on a scanned stack whose input quantizers were calibrated (one
    static scale per layer of the stack): each layer's inputs, computed by hand through the layers solved before it,
    are quantized with its own scale, and its levels are GPTQ's of the damped least-squares weight."""
    model = init(Stacked, 10)
    qmodel = eqx_quant.quantize(model, weights=DynamicFakeQuant(3, group_size=8), activations=DynamicFakeQuant(4))
    latent = correlated_inputs(11, 16, 4 * 6).astype(np.float32).reshape(4, 6, 16)
    batches = [jnp.asarray(latent[:2]), jnp.asarray(latent[2:])]
    qmodel = eqx_quant.calibrate(qmodel, batches)
    solved = gptq(qmodel, batches, quantized_inputs=True)
    input_scales = np.asarray(qmodel.layers.input_quant.scale)
    assert input_scales[0] != input_scales[1]
    h = latent.reshape(-1, 16)
    for i in range(2):
        q = reference_fake_quant(h, input_scales[i], -8, 7).astype(np.float64)
        gram, cross = q.T @ q, h.astype(np.float64).T @ q
        ridge = 0.01 * np.mean(np.diag(gram)) * np.eye(16)
        w = np.asarray(qmodel.layers.layer.weight[i], np.float64)
        mapped = np.linalg.solve(gram + ridge, (cross + ridge).T @ w.T).T
        expected, _ = gptq_quantize(jnp.asarray(mapped, jnp.float32), jnp.asarray(gram, jnp.float32), -4, 3,
                                    group_size=8)  # fmt: skip
        layer = jax.tree_util.tree_map(lambda a: a[i], solved.layers)  # noqa: B023
        levels = layer.weight_quant.quantize(layer.layer.weight).levels().reshape(16, 16)
        np.testing.assert_array_equal(np.asarray(levels), np.asarray(expected))
        h = np.asarray(jax.vmap(layer)(jnp.asarray(h))) + h
    run = eqx.filter_jit(lambda m, x: jax.vmap(m)(x))
    assert_bitwise_equal(run(eqx_quant.convert(solved), batches[0]), run(solved, batches[0]))


class TwoPerBlock(eqx.Module):
    """Two stacks of blocks, each block two `Linear(8, 8)` layers, run one stack after the other with `lax.scan`."""

    enc: eqx.Module
    dec: eqx.Module

    def __init__(self, key):
        def block(k):
            k1, k2 = jax.random.split(k)
            return {"a": eqx.nn.Linear(8, 8, key=k1), "b": eqx.nn.Linear(8, 8, key=k2)}

        k1, k2 = jax.random.split(key)
        self.enc = eqx.filter_vmap(block)(jax.random.split(k1, 2))
        self.dec = eqx.filter_vmap(block)(jax.random.split(k2, 2))

    def __call__(self, h):
        for stack in (self.enc, self.dec):
            dynamic, static = eqx.partition(stack, eqx.is_array)

            def step(h, arrays, static=static):
                blk = eqx.combine(arrays, static)
                return h + blk["b"](jnp.tanh(blk["a"](h))), None

            h = jax.lax.scan(step, h, dynamic)[0]
        return h


def test_sequential_steps_follow_the_blocks_of_each_scanned_stack():
    from eqx_quant._gptq_model import _call_order, _steps
    from eqx_quant._observe import layer_stack
    from eqx_quant._tree import nodes

    qmodel = eqx_quant.quantize(init(TwoPerBlock, 23), weights=DynamicFakeQuant(3, axis=0), activations=None)
    layers = nodes(qmodel, (eqx_quant.nn.QuantLinear,))
    order = _call_order(qmodel, layers, jnp.ones((2, 8)), False)
    assert order == ["enc.a", "enc.b", "dec.a", "dec.b"]
    steps = _steps(qmodel, order, {path: layer_stack(layer) for path, layer in layers})
    assert steps == [("enc.a", 0), ("enc.b", 0), ("enc.a", 1), ("enc.b", 1),
                     ("dec.a", 0), ("dec.b", 0), ("dec.a", 1), ("dec.b", 1)]  # fmt: skip


@pytest.mark.slow
def test_sequential_gptq_on_two_layers_per_scanned_block_uses_the_hessians_by_hand():
    """Each layer's Hessian is the Gram matrix of its inputs computed by hand through the blocks and layers GPTQ
    quantized before it (the first block's two layers, then the second's, then the next stack's)."""
    model = init(TwoPerBlock, 23)
    qmodel = eqx_quant.quantize(model, weights=DynamicFakeQuant(3, axis=0), activations=None)
    x = jnp.asarray(correlated_inputs(24, 8, 48).astype(np.float32))
    quantized = gptq(qmodel, [x[:24], x[24:]])
    h = np.asarray(x, np.float64)
    for name in ("enc", "dec"):
        for i in range(2):
            out = {}
            inputs = h
            for layer_name in ("a", "b"):
                original = getattr(qmodel, name)[layer_name]
                solved = getattr(quantized, name)[layer_name]
                weight = original.layer.weight[i]
                expected, _ = gptq_quantize(weight, jnp.asarray(inputs.T @ inputs, jnp.float32), -4, 3)
                one = jax.tree_util.tree_map(lambda a: a[i], solved.weight_quant)  # noqa: B023
                levels = one.quantize(solved.layer.weight[i]).levels().reshape(8, 8)
                # The Hessian by hand sums in another order than the observers: a level may move by one step.
                assert np.mean(np.asarray(levels) == np.asarray(expected)) > 0.95
                w = np.asarray(solved.layer.weight[i], np.float64)
                b = np.asarray(solved.layer.bias[i], np.float64)
                out[layer_name] = inputs @ w.T + b
                inputs = np.tanh(out[layer_name])
            h = h + out["b"]


def test_bad_settings_are_refused_before_the_batches_are_read():
    mlp = init(lambda k: eqx.nn.MLP(32, 2, 32, 1, key=k), 25)
    qmodel = eqx_quant.quantize(mlp)

    def batches():
        raise AssertionError("read")
        yield  # a generator

    for damp in (-1.0, float("nan")):
        with pytest.raises(ValueError, match="`damp` must be finite and >= 0"):
            gptq(qmodel, batches(), damp=damp)
    with pytest.raises(ValueError, match="num_candidates=0"):
        gptq(qmodel, batches(), method="mse", num_candidates=0)
    # A clipping search on a format whose block scales follow the format's rule.
    mx = eqx_quant.quantize(mlp, weights=DynamicFakeQuant("mxfp4", group_size=32), activations=None)
    with pytest.raises(ValueError, match="Layer 'layers.0': `method='mse'` searches float32 scales, and mxfp4"):
        gptq(mx, batches(), method="mse")
    # Quantized inputs where no layer quantizes its input: the option would change nothing.
    weight_only = eqx_quant.quantize(mlp, weights=DynamicFakeQuant(4, axis=0), activations=None)
    with pytest.raises(ValueError, match=r"`quantized_inputs=True` would change nothing: none of the layers"):
        gptq(weight_only, batches(), quantized_inputs=True)
    # A `where` that chooses nothing named the model as having no layer to quantize.
    with pytest.raises(ValueError, match=r"`where`='nomatch' chooses none of the weights `gptq` can solve: \['layers"):
        gptq(weight_only, batches(), where="nomatch")
    # A NaN weight, which the error feedback spread over its row as zeros.
    broken = eqx.tree_at(
        lambda m: m.layers[1].layer.weight, weight_only, weight_only.layers[1].layer.weight.at[0, 5].set(jnp.nan)
    )
    with pytest.raises(ValueError, match=r"Layer 'layers.1' has a non-finite weight entry, nan at index \(0, 5\)"):
        gptq(broken, batches())


def test_calibration_inputs_that_are_all_zero_are_refused():
    # A zero Hessian (all-zero data; NaN data, which counts as zeros) made GPTQ set the whole weight to zero.
    mlp = init(lambda k: eqx.nn.MLP(32, 2, 32, 1, key=k), 25)
    qmodel = eqx_quant.quantize(mlp, weights=DynamicFakeQuant(4, axis=0), activations=None)
    zeros = jnp.zeros((4, 32))
    for sequential in (True, False):
        with pytest.raises(ValueError, match=r"Layer 'layers.0' saw no nonzero calibration input .* its whole weight"):
            gptq(qmodel, [zeros], sequential=sequential)
    with pytest.raises(ValueError, match=r"'layers.0' saw no nonzero calibration input \(NaN and infinite entries"):
        gptq(qmodel, [zeros + jnp.nan])


def _quantized_rows(x, bits):
    """NumPy twin of a dynamic symmetric input quantizer called on each row of `x` (one scale per row)."""
    qmin, qmax = -(2 ** (bits - 1)), 2 ** (bits - 1) - 1
    scales = np_absmax_scale(np.abs(x).max(axis=1), qmax)[:, None]
    return reference_fake_quant(x, scales, qmin, qmax)


def test_quantized_inputs_solve_each_layer_for_its_float_output_from_its_quantized_inputs():
    """GPTQ with `quantized_inputs=True`: each layer's levels are GPTQ's of the damped least-squares weight
    `W (C + λI)(G + λI)⁻¹` under the Hessian `G`, where `G = Σ q qᵀ` and `C = Σ x qᵀ` over the layer's inputs `x`
    computed by hand (sequentially, through the layers solved before it; in one pass, through the round-to-nearest
    layers; their inputs quantized too in both), `q` their 4-bit quantization and `λ` 1% of the mean of `diag(G)`."""
    mlp = init(lambda k: eqx.nn.MLP(8, 4, 8, 1, activation=jnp.tanh, key=k), 31)
    drawn = correlated_inputs(32, 8, 96).astype(np.float32)  # half for calibration, half held out
    x = drawn[:48]
    qmodel = eqx_quant.quantize(mlp, weights=DynamicFakeQuant(3, axis=0), activations=DynamicFakeQuant(4))
    batches = [jnp.asarray(x[:24]), jnp.asarray(x[24:])]
    for sequential in (False, True):  # `solved` is the sequential solution after the loop
        solved = gptq(qmodel, batches, quantized_inputs=True, sequential=sequential)
        h = x
        for i, layer in enumerate(solved.layers):
            q = _quantized_rows(h, 4)
            q64, h64 = q.astype(np.float64), h.astype(np.float64)
            gram, cross = q64.T @ q64, h64.T @ q64
            w = np.asarray(qmodel.layers[i].layer.weight, np.float64)
            ridge = 0.01 * np.mean(np.diag(gram)) * np.eye(8)  # GPTQ's damping, shrinking the map towards `w`
            mapped = np.linalg.solve(gram + ridge, (cross + ridge).T @ w.T).T
            expected, _ = gptq_quantize(jnp.asarray(mapped, jnp.float32), jnp.asarray(gram, jnp.float32), -4, 3)
            levels = layer.weight_quant.quantize(layer.layer.weight).levels()
            np.testing.assert_array_equal(np.asarray(levels), np.asarray(expected))
            feeding = layer if sequential else qmodel.layers[i]
            out = np.asarray(jax.vmap(feeding)(jnp.asarray(h)))
            by_hand = q @ np.asarray(feeding.weight_quant(feeding.layer.weight)).T + np.asarray(layer.layer.bias)
            np.testing.assert_allclose(out, by_hand, rtol=1e-5, atol=1e-6)
            h = np.tanh(out) if i == 0 else out
    # A layer without input quantizer beside one with: solved as without the option (undamped, where a map from
    # its inputs onto themselves would move the weight by rounding errors).
    mixed = eqx.tree_at(lambda m: m.layers[0].input_quant, qmodel, None, is_leaf=lambda v: v is None)
    with_option = gptq(mixed, batches, quantized_inputs=True, damp=0.0).layers[0]
    assert_bitwise_equal(with_option.layer.weight, gptq(mixed, batches, damp=0.0).layers[0].layer.weight)
    # Converted, the model computes what the fake-quant model computes; and its outputs are closer to the float
    # model's than those of GPTQ on the float inputs.
    run = eqx.filter_jit(lambda m, x: jax.vmap(m)(x))
    assert_bitwise_equal(run(eqx_quant.convert(solved), batches[0]), run(solved, batches[0]))
    held_out = jnp.asarray(drawn[48:])
    reference = np.asarray(run(mlp, held_out))
    err = lambda m: np.linalg.norm(np.asarray(run(m, held_out)) - reference)  # noqa: E731
    assert err(solved) < err(gptq(qmodel, batches))
