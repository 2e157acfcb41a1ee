"""SmoothQuant, AWQ and rotations on traced weights (`quantize(..., example=)`): the products a model writes with its
own arrays (`x @ w`, `w @ x.T`, `jnp.einsum` over several axes, a scanned stack) transformed as linear layers are, the
transform held by the `QuantTraced` and applied to each product's input before its quantizer."""

import functools
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import scipy.linalg

import eqx_quant
from eqx_quant._traced import replaced
from eqx_quant.nn import RotateInput, ScaleInput

from .helpers import assert_bitwise_equal, init, slow_unless


RNG = np.random.default_rng(7)
# Tokens of 16 channels, one an outlier: what SmoothQuant is for.
X = jnp.asarray(RNG.standard_normal((6, 5, 16)).astype(np.float32) * np.where(np.arange(16) == 3, 40, 1))


class _Products(eqx.Module):
    """Three products of the tokens `x` (T, 16), each laying out the summed axes its own way."""

    a: jax.Array  # (16, 8): `x @ a`, summed over a's axis 0
    b: jax.Array  # (8, 16): `b @ x.T`, summed over b's axis 1, the input's axis 0
    c: jax.Array  # (4, 4, 8): summed over its axes 0 and 1, the input's channels split in two

    def __call__(self, x):
        y = x @ self.a + (self.b @ x.T).T
        return y + jnp.einsum("thd,hdo->to", x.reshape(-1, 4, 4), self.c)


PRODUCTS = init(lambda k: _Products(*(jax.random.normal(k, s) for s in ((16, 8), (8, 16), (4, 4, 8)))), 1)
# The same model written with linear layers (no bias), for the traced weights to smooth as layers do.
_LINEARS = [
    eqx.tree_at(lambda l: l.weight, eqx.nn.Linear(16, 8, use_bias=False, key=jax.random.key(0)), w)
    for w in (PRODUCTS.a.T, PRODUCTS.b, PRODUCTS.c.reshape(16, 8).T)
]


class _Layers(eqx.Module):
    a: eqx.nn.Linear
    b: eqx.nn.Linear
    c: eqx.nn.Linear

    def __call__(self, x):
        return jax.vmap(lambda v: self.a(v) + self.b(v) + self.c(v))(x)


LAYERS = _Layers(*_LINEARS)


class _Scanned(eqx.Module):
    """A stack of residual blocks run with `jax.lax.scan`, its weights bare arrays with the layers in front."""

    w: jax.Array  # (L, 16, 16)
    v: jax.Array  # (L, 4, 4, 16)

    def __call__(self, x):
        def block(h, weights):
            w, v = weights
            h = h + jnp.tanh(h @ w)
            return h + jnp.einsum("thd,hdo->to", h.reshape(-1, 4, 4), v) / 4, None

        return jax.lax.scan(block, x, (self.w, self.v))[0]


SCANNED = init(lambda k: _Scanned(jax.random.normal(k, (3, 16, 16)) / 4, jax.random.normal(k, (3, 4, 4, 16))), 2)


class _Tied(eqx.Module):
    """A tied embedding (gathered, and the head's weight) around a bare projection."""

    embedding: jax.Array  # (20, 16)
    w: jax.Array  # (16, 16)

    def __call__(self, tokens):
        return (self.embedding[tokens] @ self.w) @ self.embedding.T


@eqx.filter_jit
def _apply(model, x):
    return jax.vmap(model)(x)


def _rel(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def _columns(weight, axes):
    """A weight as rows by columns, its summed `axes` last (in that order) flattened into the columns: NumPy."""
    moved = np.moveaxis(np.asarray(weight, np.float64), axes, tuple(range(-len(axes), 0)))
    return moved.reshape(-1, int(np.prod([np.shape(weight)[a] for a in axes])))


def test_smoothquant_smooths_each_traced_product_against_a_numpy_twin():
    """Each traced weight gets `s_j = max|x_j|^α / max|w_j|^(1-α)` over the channels its products sum over (an
    einsum's two summed axes flattened in its order), computed here in float64 from the tokens and the float weight:
    the multiplier is `1 / s` and the leaf holds `w * s` along those axes. The smoothed model computes the float
    function, and computes as the same model written with linear layers, smoothed, does."""
    q = eqx_quant.quantize(PRODUCTS, **eqx_quant.recipe("w8a8"), example=(X[0],))
    smoothed = eqx_quant.smoothquant(q, [X], alpha=0.6)
    x_max = np.max(np.abs(np.asarray(X, np.float64)).reshape(-1, 16), axis=0)
    order = {}  # by weight, the input's channels in the order of the weight's summed axes (its `pairings`)
    for name, summed in (("a", (0,)), ("b", (1,)), ("c", (0, 1))):
        i = smoothed.weight_paths.index(name)
        axes = smoothed.pairings[i]
        assert sorted(axes) == list(summed)
        # The input's channels split as the weight's summed axes, then laid out in the pairing's order.
        grid = np.arange(16).reshape([PRODUCTS.c.shape[a] for a in summed] if len(summed) > 1 else (16,))
        order[name] = np.transpose(grid, [summed.index(a) for a in axes]).ravel()
        w = getattr(PRODUCTS, name)
        w_max = np.max(np.abs(_columns(w, axes)), axis=0)
        s = x_max[order[name]] ** 0.6 / w_max**0.4
        transform = smoothed.input_transforms[i]
        assert isinstance(transform, ScaleInput)
        np.testing.assert_allclose(np.asarray(transform.multiplier), 1 / s, rtol=2e-7)
        scaled = _columns(getattr(smoothed.model, name), axes)
        np.testing.assert_allclose(scaled, _columns(w, axes) * s, rtol=5e-7)
    want = _apply(PRODUCTS, X)
    assert _rel(_apply(eqx_quant.float_model(smoothed), X), want) < 1e-6
    assert _rel(_apply(smoothed, X), want) < _rel(_apply(q, X), want) / 2
    # The same products as linear layers: the same factors, the same quantized outputs.
    layers = eqx_quant.smoothquant(eqx_quant.quantize(LAYERS, **eqx_quant.recipe("w8a8")), [X], alpha=0.6)
    for name in ("a", "b", "c"):
        multiplier = getattr(layers, name).input_transform.multiplier[order[name]]
        assert_bitwise_equal(smoothed.input_transforms[smoothed.weight_paths.index(name)].multiplier, multiplier)
    np.testing.assert_allclose(_apply(smoothed, X), _apply(layers, X), rtol=1e-5, atol=1e-4)


@pytest.mark.slow
def test_a_smoothed_scanned_stack_converts_saves_and_loads_bit_for_bit(tmp_path):
    """A scanned stack of bare weights: one multiplier per layer, stepped through with the weights; smoothquant →
    calibrate → convert computes the fake-quant bits (compiled and eager), `save`/`load` keep them, and
    `float_model` restores the float function."""
    q = eqx_quant.quantize(SCANNED, **eqx_quant.recipe("w8a8"), example=(X[0],))
    smoothed = eqx_quant.smoothquant(q, [X])
    assert [t.multiplier.shape for t in smoothed.input_transforms] == [(3, 16), (3, 16)]
    # Each layer's own factors: the layers' inputs differ, so their multipliers do.
    assert not np.array_equal(smoothed.input_transforms[0].multiplier[0], smoothed.input_transforms[0].multiplier[1])
    want = _apply(SCANNED, X)
    assert _rel(_apply(eqx_quant.float_model(smoothed), X), want) < 1e-6
    fake = eqx_quant.calibrate(smoothed, [X])
    converted = eqx_quant.convert(fake)
    assert_bitwise_equal(_apply(converted, X), _apply(fake, X))
    assert_bitwise_equal(jax.vmap(converted)(X[:2]), jax.vmap(fake)(X[:2]))
    assert _rel(_apply(fake, X), want) < _rel(_apply(eqx_quant.calibrate(q, [X]), X), want)
    eqx_quant.save(tmp_path / "m.eqxq", converted)
    loaded = eqx_quant.load(tmp_path / "m.eqxq", SCANNED)
    assert_bitwise_equal(_apply(loaded, X), _apply(converted, X))
    rows = {row.path: row for row in eqx_quant.summary(converted).rows}
    assert rows["model.w"].input.startswith("ScaleInput, then int8")
    bare = {row.path: row for row in eqx_quant.summary(replaced(converted, input_transforms=(None, None))).rows}
    assert rows["model.w"].stored_bytes == bare["model.w"].stored_bytes + 3 * 16 * 4  # the float32 multipliers


def test_transforms_leave_out_traced_weights_the_model_reads_besides_their_products():
    """A tied embedding is gathered besides being the head's weight: left out with a warning naming it (the
    projection is smoothed), a `ValueError` when `where` chooses it; a weight given a transform anyway makes the call
    a `ValueError`."""
    model = init(lambda k: _Tied(jax.random.normal(k, (20, 16)), jax.random.normal(k, (16, 16)) / 4), 3)
    tokens = jnp.asarray(RNG.integers(0, 20, (4, 6)))
    q = eqx_quant.quantize(model, **eqx_quant.recipe("w8a8"), example=(tokens[0],))
    with pytest.warns(UserWarning, match=r"leaves traced weights as they are: 'model.embedding' is read by the model"):
        smoothed = eqx_quant.smoothquant(q, [tokens])
    i = smoothed.weight_paths.index("embedding")
    assert smoothed.input_transforms[i] is None
    assert_bitwise_equal(smoothed.model.embedding, model.embedding)
    assert isinstance(smoothed.input_transforms[smoothed.weight_paths.index("w")], ScaleInput)
    assert _rel(_apply(eqx_quant.float_model(smoothed), tokens), _apply(model, tokens)) < 1e-6
    with pytest.raises(ValueError, match=r"Traced weight 'model.embedding' is read by the model otherwise"):
        eqx_quant.awq(q, [tokens], where=lambda path, weight: path == "model.embedding")
    # Without data, `rotate` takes the traced weights `where` chooses on trust; the call then refuses the gather.
    with pytest.raises(ValueError, match=r"`rotate` would change nothing\. Traced weights left out: "
                                         r"'model.w', 'model.embedding': each is taken only where `where` chooses "
                                         "it or a `batch` is given"):  # fmt: skip
        eqx_quant.rotate(q, key=jax.random.key(0))
    rotated = eqx_quant.rotate(q, key=jax.random.key(0), where=lambda path, weight: True)
    with pytest.raises(ValueError, match=r"Traced weight 'embedding' has an input transform \(RotateInput\)"):
        _apply(rotated, tokens)


@pytest.mark.parametrize("name", slow_unless(["gptq"], ["gptq", "autoround"]))
def test_weight_solvers_leave_out_a_traced_weight_the_model_reads_besides_its_products(name):
    """`gptq` and `autoround` solve a weight from its products' inputs alone: a tied embedding, gathered besides, is
    left at round to nearest with a warning naming it (the other weights solved as when `where` chooses them alone),
    unless `where` chooses it; with nothing else to solve, a `ValueError`."""
    solve = eqx_quant.gptq if name == "gptq" else functools.partial(eqx_quant.autoround, steps=2)
    model = init(lambda k: _Tied(jax.random.normal(k, (20, 16)), jax.random.normal(k, (16, 16)) / 4), 3)
    tokens = jnp.asarray(RNG.integers(0, 20, (4, 6)))
    q = eqx_quant.quantize(model, **eqx_quant.recipe("w4a16_g32", group_size=16), example=(tokens[0],))
    e, w = q.weight_paths.index("embedding"), q.weight_paths.index("w")
    with pytest.warns(UserWarning, match=rf"`{name}` leaves out the traced weights \['model.embedding'\], which"):
        solved = solve(q, [tokens])
    assert solved.weight_quants[e] is q.weight_quants[e]
    assert_bitwise_equal(solved.model.embedding, model.embedding)
    assert isinstance(solved.weight_quants[w], eqx_quant.FakeQuant)
    assert_bitwise_equal(solved.model.w, solve(q, [tokens], where=lambda path, weight: path == "model.w").model.w)
    chosen = solve(q, [tokens], where=lambda path, weight: True)  # no warning: chosen, it is solved
    assert isinstance(chosen.weight_quants[e], eqx_quant.FakeQuant)
    assert not np.array_equal(chosen.model.embedding, model.embedding)
    tied_only = replaced(q, weight_quants=[q.weight_quants[i] if i == e else None for i in range(2)])
    with pytest.raises(ValueError, match=rf"`{name}` would change nothing: `{name}` leaves out the traced weights"):
        solve(tied_only, [tokens])
    if name == "gptq":  # quantized inputs where only the weight left out quantizes its input
        inputs = [eqx_quant.DynamicFakeQuant(8) if i == e else None for i in range(2)]
        with pytest.warns(UserWarning, match="leaves out"), pytest.raises(ValueError, match="would change nothing"):
            solve(replaced(q, input_quants=inputs), [tokens], quantized_inputs=True)


class _Carried(eqx.Module):
    """The weight carried through a scan's steps: read there as the carry, unseen as the weight."""

    w: jax.Array  # (16, 16)

    def __call__(self, x):
        def step(carry, _):
            h, w = carry
            return (h @ w, w * 1.0), None

        return jax.lax.scan(step, (x @ self.w, self.w), None, length=2)[0][0]


class _Split(eqx.Module):
    """The summed axis split in two, both summed against the input's split alike: no one-to-one pairing."""

    w: jax.Array  # (16, 16)

    def __call__(self, x):
        return jnp.einsum("thd,hdo->to", x.reshape(-1, 4, 4), self.w.reshape(4, 4, 16))


class _Rounded(eqx.Module):
    """The weight rounded to fewer bits before its product: a read that does not commute with a scale."""

    w: jax.Array  # (16, 16)

    def __call__(self, x):
        return x @ jax.lax.reduce_precision(self.w, exponent_bits=5, mantissa_bits=2)


_READ_OTHERWISE = "is read by the model otherwise"


@pytest.mark.parametrize(
    "make, why", [(_Carried, _READ_OTHERWISE), (_Split, "has products that do not pair"), (_Rounded, _READ_OTHERWISE)]
)
def test_transforms_refuse_weights_read_through_a_scan_carry_a_split_or_a_rounding(make, why):
    """Reads of a weight that its views do not see whole and in order (carried through a scan; a summed axis split
    in two; rounded): smoothing it would change the model's function, so it is refused."""
    model = make(jnp.asarray(RNG.standard_normal((16, 16)).astype(np.float32)))
    q = eqx_quant.quantize(model, **eqx_quant.recipe("w8a8"), example=(X[0],))
    with pytest.raises(ValueError, match=f"Traced weights left out: 'model.w' {why}"):
        eqx_quant.smoothquant(q, [X])


class _Plain(eqx.Module):
    w: jax.Array  # (16, 8)

    def __call__(self, x):  # any leading axes: one example's tokens, or a whole batch of them
        return x @ self.w


class _Narrow(eqx.Module):
    w: jax.Array  # (10, 8): no Hadamard matrix of 10

    def __call__(self, x):
        return x[:, :10] @ self.w


class _Sometimes(eqx.Module):
    """`u` is used only on five tokens: the example's, not the calibration batches'."""

    a: jax.Array  # (16, 8)
    u: jax.Array  # (16, 8)

    def __call__(self, x):
        y = x @ self.a
        return y + x @ self.u if x.shape[0] == 5 else y


def test_a_traced_weight_the_batches_never_use_is_left_out():
    """A traced weight that the calibration batches never reach has no statistics: left as it is with a warning,
    the others smoothed."""
    model = _Sometimes(*(jnp.asarray(RNG.standard_normal((16, 8)).astype(np.float32)) for _ in range(2)))
    q = eqx_quant.quantize(model, **eqx_quant.recipe("w8a8"), example=(X[0],))
    with pytest.warns(UserWarning, match=r"'model.u' is in none of the products that the model computes on the fir"):
        smoothed = eqx_quant.smoothquant(q, [X[:, :2]])
    assert isinstance(smoothed.input_transforms[smoothed.weight_paths.index("a")], ScaleInput)
    assert smoothed.input_transforms[smoothed.weight_paths.index("u")] is None
    assert_bitwise_equal(smoothed.model.u, model.u)


class _Repaired(eqx.Module):
    """A product that pairs the weight's two summed axes in one order on five tokens, in the other otherwise."""

    c: jax.Array  # (4, 4, 8)

    def __call__(self, x):
        grid = x.reshape(-1, 4, 4)
        if x.shape[0] == 5:
            return jnp.einsum("thd,hdo->to", grid, self.c)
        return jax.lax.dot_general(grid.swapaxes(1, 2), self.c, (((2, 1), (0, 1)), ((), ())))


def test_a_call_that_pairs_the_summed_axes_otherwise_lays_the_transform_out_alike():
    """The transform follows the weight's `pairings`, whatever order a call's product lists the summed axes in: on six
    tokens (the other order) the smoothed model still computes the float function, and the calibration observes
    the channels in the same order (the same input scale either way)."""
    model = _Repaired(jnp.asarray(RNG.standard_normal((4, 4, 8)).astype(np.float32)))
    q = eqx_quant.quantize(model, **eqx_quant.recipe("w8a8"), example=(X[0],))
    smoothed = eqx_quant.smoothquant(q, [X])
    six = jnp.concatenate([X, X[:, :1]], axis=1)
    restored = _apply(eqx_quant.float_model(smoothed), six)
    assert _rel(restored, _apply(model, six)) < 1e-6
    unquantized = replaced(smoothed, weight_quants=(None,), input_quants=(None,))  # the transform alone
    assert _rel(_apply(unquantized, six), _apply(model, six)) < 1e-6
    five, other = eqx_quant.calibrate(smoothed, [X]), eqx_quant.calibrate(smoothed, [six])
    assert five.input_quants[0].scale == pytest.approx(other.input_quants[0].scale, rel=1e-6)


def test_traced_transforms_are_checked():
    """`QuantTraced` checks its `input_transforms`; a transform of the wrong size fails at the call, naming the
    sizes; `smoothquant` refuses a traced weight with fitted input scales or a transform already."""
    q = eqx_quant.quantize(PRODUCTS, **eqx_quant.recipe("w8a8"), example=(X[0],))
    # Dynamic inputs per token are laid out at each product: `summary` says so, not the layout they were written with.
    assert {row.input for row in eqx_quant.summary(q).rows} == {"int8 dynamic, per token"}
    with pytest.raises(ValueError, match="one entry per traced weight"):
        eqx_quant.nn.QuantTraced(q.model, q.weight_quants, q.input_quants, q.weight_paths, input_transforms=())
    n = len(q.weight_paths)
    with pytest.raises(TypeError, match=r"`input_transforms` must hold input transforms or None, got 2.0"):
        eqx_quant.nn.QuantTraced(q.model, q.weight_quants, q.input_quants, q.weight_paths, pairings=q.pairings,
                                 input_transforms=(2.0,) * n)  # fmt: skip
    ones = ScaleInput(jnp.ones(16))
    with pytest.raises(ValueError, match=r"'a' has an input transform but no `pairings` entry"):
        eqx_quant.nn.QuantTraced(q.model, q.weight_quants, q.input_quants, q.weight_paths,
                                 input_transforms=(ones,) * n)  # fmt: skip
    wrong = eqx_quant.nn.QuantTraced(q.model, q.weight_quants, q.input_quants, q.weight_paths, pairings=q.pairings,
                                     input_transforms=(ScaleInput(jnp.ones(12)),) * n)  # fmt: skip
    with pytest.raises(ValueError, match=r"acts on 12 channels, but one of its products sums over 16"):
        jax.vmap(wrong)(X[:1])
    # A predicate written for layers meets the traced weights' arrays: a TypeError that says so.
    for algorithm in (eqx_quant.smoothquant, eqx_quant.gptq):
        with pytest.raises(TypeError, match=r"`where` raised AttributeError.* on the traced weight 'model.a'"):
            algorithm(q, [X], where=lambda path, layer: layer.layer.in_features == 16)
    with pytest.raises(ValueError, match=r"would change nothing\. Traced weights never fold: `fold='only'` leaves"):
        eqx_quant.smoothquant(q, [X], fold="only")
    smoothed = eqx_quant.smoothquant(q, [X])
    with pytest.raises(ValueError, match=r"'model.b' already has the input transform ScaleInput"):
        eqx_quant.rotate(smoothed, key=jax.random.key(0), where=lambda path, weight: path == "model.b")
    # A batch the model takes whole (`batched=True`) finds the same weights as one it maps over.
    plain = eqx_quant.quantize(_Plain(jnp.ones((16, 8))), **eqx_quant.recipe("w8a8"), example=(X[0],))
    whole = eqx_quant.rotate(plain, key=jax.random.key(0), batch=X, batched=True)
    assert_bitwise_equal(whole.input_transforms[0].signs, eqx_quant.rotate(plain, key=jax.random.key(0), batch=X)
                         .input_transforms[0].signs)  # fmt: skip
    narrow = eqx_quant.quantize(_Narrow(jnp.ones((10, 8))), **eqx_quant.recipe("w8a8"), example=(X[0],))
    with pytest.raises(ValueError, match=r"Traced weight 'model.w' sums over 10 channels, which `rotate` cannot"):
        eqx_quant.rotate(narrow, key=jax.random.key(0), batch=X)


@pytest.mark.slow
def test_transforms_refuse_traced_weights_fitted_or_stored_already():
    """A traced weight whose input scales were calibrated, or whose weight scales GPTQ fitted, is refused where `where`
    chooses it, naming why; a converted model (every weight stored as codes) is refused as a whole."""
    q = eqx_quant.quantize(PRODUCTS, **eqx_quant.recipe("w8a8"), example=(X[0],))
    calibrated = eqx_quant.calibrate(q, [X])
    a = lambda path, weight: path == "model.a"  # noqa: E731
    with pytest.raises(ValueError, match=r"'model.a' has the input quantizer .* run `smoothquant` before `calibrate`"):
        eqx_quant.smoothquant(calibrated, [X], where=a)
    with pytest.raises(ValueError, match=r"`model` is converted .*: `awq` works on the fake-quant model"):
        eqx_quant.awq(eqx_quant.convert(calibrated), [X], where=a)
    with pytest.raises(ValueError, match=r"'model.a' has the weight quantizer FakeQuant .* needs a dynamic one"):
        eqx_quant.smoothquant(eqx_quant.gptq(q, [X]), [X], where=a)


@pytest.mark.slow
def test_awq_and_gptq_on_traced_weights_as_on_the_same_linear_layers():
    """AWQ on the traced products finds the multipliers it finds on the same model written with linear layers, and
    the same outputs; AWQ then GPTQ converts bit for bit."""
    rules = eqx_quant.recipe("w4a16_g32", group_size=8)
    with pytest.warns(UserWarning, match=r"'c': its product sums over 2 of its axes .* one scale per channel"):
        plain = eqx_quant.quantize(PRODUCTS, **rules, example=(X[0],))
    scaled = eqx_quant.awq(plain, [X], clip=False)  # scaling alone keeps the float function
    layers = eqx_quant.awq(eqx_quant.quantize(LAYERS, **rules), [X], clip=False)
    for name in ("a", "b"):  # `c` sums over two axes: one scale per channel, not tiles (a layer would tile)
        np.testing.assert_allclose(scaled.input_transforms[scaled.weight_paths.index(name)].multiplier,
                                   getattr(layers, name).input_transform.multiplier, rtol=1e-5)  # fmt: skip
    want = _apply(PRODUCTS, X)
    assert _rel(_apply(eqx_quant.float_model(scaled), X), want) < 1e-6
    traced = eqx_quant.awq(plain, [X])
    assert _rel(_apply(traced, X), want) < _rel(_apply(plain, X), want)
    solved = eqx_quant.gptq(traced, [X])
    assert_bitwise_equal(_apply(eqx_quant.convert(solved), X), _apply(solved, X))


@pytest.mark.slow
def test_gptq_with_quantized_inputs_on_traced_weights_as_on_the_same_linear_layers():
    """GPTQ with `quantized_inputs=True` on the traced products quantizes each input token by token, as the same
    model written with linear layers mapped over the tokens does (one scale per token, not per tensor), and finds
    the same levels; the solution converts bit for bit, and differs from GPTQ's on the float inputs."""
    per_token = eqx_quant.LayerQuantizer(8, input=True, per_token=True)
    rules = [eqx_quant.Rule(".*", weight=eqx_quant.LayerQuantizer(4), input=per_token)]
    traced = eqx_quant.quantize(PRODUCTS, rules=rules, example=(X[0],))
    layers = eqx_quant.quantize(LAYERS, rules=rules)
    solved = eqx_quant.gptq(traced, [X[:3], X[3:]], quantized_inputs=True)
    twin = eqx_quant.gptq(layers, [X[:3], X[3:]], quantized_inputs=True)
    # (`c`'s product pairs its two summed axes in the other order, so GPTQ visits its columns in another order.)
    for name, as_rows in (("a", lambda w: w.T), ("b", lambda w: w)):
        i = solved.weight_paths.index(name)
        levels = as_rows(np.asarray(solved.weight_quants[i].quantize(getattr(solved.model, name)).levels()))
        layer = getattr(twin, name)
        np.testing.assert_array_equal(levels, np.asarray(layer.weight_quant.quantize(layer.layer.weight).levels()))
    assert_bitwise_equal(_apply(eqx_quant.convert(solved), X), _apply(solved, X))
    # Quantized per tensor instead, the traced inputs would round otherwise, and the solution differ.
    plain = eqx_quant.gptq(traced, [X[:3], X[3:]])
    assert not np.array_equal(np.asarray(plain.model.a), np.asarray(solved.model.a))


class _Experts(eqx.Module):
    """Experts stacked in one array `w` (experts, in, out), each applied to its own tokens `x` (tokens, experts, in):
    by one `einsum` whose batch dimension is the expert axis, by a `jax.vmap` over the experts, or (`w` a list) one
    product per expert."""

    w: Any
    form: str = eqx.field(static=True)

    def __call__(self, x):
        if self.form == "einsum":
            return jnp.einsum("teh,ehd->ted", x, self.w)
        if self.form == "vmap":
            return jax.vmap(lambda w, x: x @ w, in_axes=(0, 1), out_axes=1)(self.w, x)
        return jnp.stack([x[:, e] @ w for e, w in enumerate(self.w)], axis=1)


def test_gptq_solves_each_of_stacked_experts_with_its_own_hessian():
    """Experts stacked in one array and applied by one batched product: GPTQ solves each expert with the Hessian of
    its own inputs, finding the levels it finds for the same experts held as separate arrays (before, one Hessian of
    all the experts' inputs: other levels); with quantized inputs too, and the solution converts bit for bit."""
    w = jax.random.normal(jax.random.key(3), (3, 16, 8))
    # Each expert's tokens span other directions: one Hessian of them all is no expert's.
    mix = RNG.standard_normal((3, 16, 16)).astype(np.float32) * (RNG.random((3, 1, 16)) < 0.4)
    x = jnp.einsum("nteh,egh->nteg", jnp.asarray(RNG.standard_normal((6, 5, 3, 16)), jnp.float32), mix + 0.05)
    rules = eqx_quant.recipe("w4a8_g32", group_size=8)
    separate = eqx_quant.quantize(_Experts(list(w), "list"), **rules, example=(x[0],))
    for form, options in (("einsum", {}), ("vmap", {"quantized_inputs": True})):
        solved = eqx_quant.gptq(eqx_quant.quantize(_Experts(w, form), **rules, example=(x[0],)), [x], **options)
        twin = eqx_quant.gptq(separate, [x], **options)
        levels = solved.weight_quants[0].quantize(solved.model.w).levels().reshape(w.shape)  # tiles as weights
        for e in range(3):
            twin_levels = twin.weight_quants[e].quantize(twin.model.w[e]).levels().reshape(w.shape[1:])
            np.testing.assert_array_equal(np.asarray(levels[e]), np.asarray(twin_levels))
        assert_bitwise_equal(_apply(eqx_quant.convert(solved), x), _apply(solved, x))
    # One Hessian of all the experts' tokens, for the three experts' rows at once, finds other levels.
    rows = lambda a: np.moveaxis(np.asarray(a), 1, 2).reshape(-1, 16)  # noqa: E731
    tokens = np.asarray(x, np.float64).reshape(-1, 16)
    fmt = solved.weight_quants[0].format
    pooled, _ = eqx_quant.gptq_quantize(jnp.asarray(rows(w)), jnp.asarray(tokens.T @ tokens, jnp.float32), format=fmt,
                                        group_size=8)  # fmt: skip
    assert pooled.shape == rows(levels).shape and not np.array_equal(np.asarray(pooled), rows(levels))
    # An expert no calibration token reaches (its Hessian zero, which would zero its weight) takes the Hessian of all.
    unseen = x.at[:, :, 2].set(0.0)
    model = eqx_quant.quantize(_Experts(w, "einsum"), **rules, example=(x[0],))
    with pytest.warns(UserWarning, match=r"'model.w': the indices \[2\] of its axes \(0,\) .* saw no calibration"):
        solved = eqx_quant.gptq(model, [unseen])
    tokens = np.asarray(unseen, np.float64).reshape(-1, 16)
    want, _ = eqx_quant.gptq_quantize(jnp.asarray(w[2].T), jnp.asarray(tokens.T @ tokens, jnp.float32), format=fmt,
                                      group_size=8)  # fmt: skip
    levels = solved.weight_quants[0].quantize(solved.model.w).levels().reshape(w.shape)
    np.testing.assert_array_equal(np.asarray(levels[2]).T, want)


@pytest.mark.slow
def test_gptq_with_quantized_nvfp4_inputs_quantizes_each_token_as_the_product_does():
    """NVFP4 inputs take their tensor scale per token in a traced product (as in linear layers mapped over the
    tokens); GPTQ's quantized-inputs Hessian sees them so too, and finds the linear layers' levels. (Before, its
    observer quantized the whole operand with one tensor scale, inputs that the model no longer computed.)"""
    rules = [
        eqx_quant.Rule(
            ".*", weight=eqx_quant.LayerQuantizer(4), input=eqx_quant.LayerQuantizer("nvfp4", 16, input=True)
        )
    ]
    with pytest.warns(UserWarning, match="Traced weight 'c': the input of its product sums over 2"):
        traced = eqx_quant.quantize(PRODUCTS, rules=rules, example=(X[0],))
    layers = eqx_quant.quantize(LAYERS, rules=rules)
    solved = eqx_quant.gptq(traced, [X[:3], X[3:]], quantized_inputs=True)
    twin = eqx_quant.gptq(layers, [X[:3], X[3:]], quantized_inputs=True)
    for name, as_rows in (("a", lambda w: w.T), ("b", lambda w: w)):  # `c`'s inputs fall back to FP8 per tensor
        i = solved.weight_paths.index(name)
        levels = as_rows(np.asarray(solved.weight_quants[i].quantize(getattr(solved.model, name)).levels()))
        layer = getattr(twin, name)
        np.testing.assert_array_equal(levels, np.asarray(layer.weight_quant.quantize(layer.layer.weight).levels()))
    assert_bitwise_equal(_apply(eqx_quant.convert(solved), X), _apply(solved, X))


@pytest.mark.slow
def test_rotate_rotates_traced_weights_with_the_hadamard_transform(tmp_path):
    """`rotate` gives each traced weight `R = H D / sqrt(n)` over the channels its products sum over: the leaf holds
    `W Rᵀ` (checked against the dense Hadamard matrix in float64), the float function is unchanged, and the
    converted model computes the fake-quant bits (compiled and eager), and saves and loads."""
    with pytest.warns(UserWarning, match=r"'v': its product sums over 2 of its axes .* one scale per channel"):
        q = eqx_quant.quantize(SCANNED, **eqx_quant.recipe("w4a8_g32", group_size=8), example=(X[0],))
    rotated = eqx_quant.rotate(q, key=jax.random.key(4), batch=X)
    h = scipy.linalg.hadamard(16).astype(np.float64)  # Sylvester's: 16 is a power of two
    for name in ("w", "v"):
        i = rotated.weight_paths.index(name)
        axes = tuple(a - 1 for a in rotated.pairings[i])  # one layer's summed axes, in the columns' order
        transform = rotated.input_transforms[i]
        assert isinstance(transform, RotateInput)
        for layer in range(3):
            r = h * np.asarray(transform.signs[layer], np.float64)[None, :] / 4
            original = _columns(getattr(SCANNED, name)[layer], axes)
            np.testing.assert_allclose(_columns(getattr(rotated.model, name)[layer], axes), original @ r.T,
                                       rtol=1e-5, atol=1e-6)  # fmt: skip
    assert _rel(_apply(eqx_quant.float_model(rotated), X), _apply(SCANNED, X)) < 1e-6
    fake = eqx_quant.calibrate(rotated, [X])
    converted = eqx_quant.convert(fake)
    assert_bitwise_equal(_apply(converted, X), _apply(fake, X))
    assert_bitwise_equal(jax.vmap(converted)(X[:2]), jax.vmap(fake)(X[:2]))
    eqx_quant.save(tmp_path / "rotated.eqxq", converted)
    assert_bitwise_equal(_apply(eqx_quant.load(tmp_path / "rotated.eqxq", SCANNED), X), _apply(converted, X))
