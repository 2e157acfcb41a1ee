"""`auto_recipe`: Hutchinson's trace against the exact Hessian, the allocation against a brute-force search, the
budget met exactly, a sensitive layer found without being told, and the errors."""

import itertools

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import eqx_quant
from eqx_quant._auto import allocate


RNG = np.random.default_rng(0)
MLP = eqx.nn.MLP(32, 4, 32, 2, activation=jax.nn.gelu, key=jax.random.key(0))
BATCHES = [jnp.asarray(RNG.standard_normal((16, 32)).astype(np.float32)) for _ in range(2)]
SMALL = ("int8", "int4_g32", "int2_g32")


@pytest.mark.parametrize("seed", range(6))
def test_allocation_is_that_of_a_brute_force_search(seed):
    rng = np.random.default_rng(seed)
    units, options = 4, 3
    costs = rng.uniform(0, 1, (units, options))
    costs[rng.uniform(size=costs.shape) < 0.15] = np.inf  # candidates a unit cannot take
    costs[:, 0] = rng.uniform(0, 1, units)  # every unit can take one
    sizes = rng.integers(1, 20, (units, options)) * 8
    least = sum(min(s for s, c in zip(sizes[u], costs[u], strict=True) if np.isfinite(c)) for u in range(units))
    for budget in (least, int(sizes.mean() * units), sizes.max(axis=1).sum()):
        best, best_size = np.inf, None
        for choice in itertools.product(range(options), repeat=units):
            size = sum(sizes[u, c] for u, c in enumerate(choice))
            cost = sum(costs[u, c] for u, c in enumerate(choice))
            if size <= budget and np.isfinite(cost) and (cost < best or (cost == best and size < best_size)):
                best, best_size = cost, size
        picks = allocate(costs, sizes, int(budget))
        assert sum(sizes[u, c] for u, c in enumerate(picks)) <= budget
        np.testing.assert_allclose(sum(costs[u, c] for u, c in enumerate(picks)), best, rtol=1e-12)


def test_allocation_rounds_sizes_up_when_the_budget_is_large():
    costs = np.array([[1.0, 0.0], [1.0, 0.0]])
    sizes = np.array([[1, 10**7 - 10**5], [1, 10**7 - 10**5]])  # more states than the exact program takes
    assert allocate(costs, sizes, 2 * 10**7) == (1, 1)
    picks = allocate(costs, sizes, 10**7)
    assert sorted(picks) == [0, 1] and sum(sizes[u, c] for u, c in enumerate(picks)) <= 10**7
    with pytest.raises(ValueError, match="fits the budget"):
        allocate(costs, sizes, 1)


def _exact_traces(model, batches):
    """The exact trace of each layer's block of the Hessian of the output-matching loss, from `jax.hessian`."""
    reference = [jax.vmap(model)(b) for b in batches]
    weights = [layer.weight for layer in model.layers]

    def loss(ws):
        m = eqx.tree_at(lambda m: [layer.weight for layer in m.layers], model, ws)
        return sum(jnp.mean((jax.vmap(m)(b) - r) ** 2) for b, r in zip(batches, reference, strict=True)) / len(batches)

    hessian = jax.hessian(loss)(weights)
    return [float(jnp.trace(hessian[i][i].reshape(w.size, w.size))) for i, w in enumerate(weights)]


@pytest.mark.slow
def test_hutchinson_trace_is_the_exact_hessian_trace():
    mlp = eqx.nn.MLP(8, 2, 8, 1, activation=jax.nn.gelu, key=jax.random.key(1))
    batches = [b[:, :8] for b in BATCHES]
    exact = _exact_traces(mlp, batches)
    auto = eqx_quant.auto_recipe(mlp, batches, average_bits=8, candidates=("int8",), probes=1000)
    estimated = [row.trace for row in auto.report.rows]
    # Rademacher probes of each layer's block: the mean of 1000 is within 2% of the trace on three keys tried here, so
    # 6% is three standard errors.
    np.testing.assert_allclose(estimated, exact, rtol=0.06)


def test_hutchinson_trace_is_exact_for_a_diagonal_hessian():
    """With a loss whose Hessian is diagonal, each Rademacher probe gives the trace exactly (`z_i**2 = 1`)."""
    coefficients = [1.0, 3.0, 0.5]

    def loss(model, batch):
        del batch
        return sum(c * jnp.sum(layer.weight**2) for c, layer in zip(coefficients, model.layers, strict=True))

    auto = eqx_quant.auto_recipe(MLP, BATCHES[:1], average_bits=8, candidates=("int8",), loss=loss, probes=2)
    want = [2 * c * layer.weight.size for c, layer in zip(coefficients, MLP.layers, strict=True)]
    np.testing.assert_allclose([row.trace for row in auto.report.rows], want, rtol=1e-6)
    # The predicted cost of a layer: its mean curvature times the squared rounding error.
    for row, c, layer in zip(auto.report.rows, coefficients, MLP.layers, strict=True):
        error = eqx_quant.quantize(layer, **eqx_quant.recipe("w8a16"))
        fake = error.weight_quant(layer.weight)
        np.testing.assert_allclose(row.predicted, 2 * c * float(jnp.sum((fake - layer.weight) ** 2)), rtol=1e-5)


class _Sensitive(eqx.Module):
    """Three linear layers side by side, the middle one's output amplified: its rounding matters 100 times as
    much."""

    layers: tuple

    def __init__(self, key):
        keys = jax.random.split(key, 3)
        self.layers = tuple(eqx.nn.Linear(32, 4, key=k) for k in keys)

    def __call__(self, x):
        a, b, c = self.layers
        return a(x) + 100.0 * b(x) + c(x)


@pytest.mark.parametrize("method", ["hessian", "measured"])
def test_a_sensitive_layer_is_kept_wide_without_being_told(method):
    model = _Sensitive(jax.random.key(2))
    auto = eqx_quant.auto_recipe(model, BATCHES, average_bits=4, candidates=SMALL, method=method)
    choices = {row.path: row.choice for row in auto.report.rows}
    bits = {row.path: row.bits for row in auto.report.rows}
    assert bits["layers.1"] > max(bits["layers.0"], bits["layers.2"]), choices
    assert auto.report.average_bits <= 4


@pytest.mark.parametrize("method", ["hessian", "measured"])
def test_the_budget_is_met_and_the_rules_quantize_the_model_as_reported(method):
    uniform = eqx_quant.quantize(MLP, **eqx_quant.recipe("w4a16_g32"))
    budget = eqx_quant.summary(uniform).stored_bytes
    auto = eqx_quant.auto_recipe(MLP, BATCHES, budget_bytes=budget, candidates=(*SMALL, "float"), method=method)
    qmodel = eqx_quant.quantize(MLP, **auto)
    table = eqx_quant.summary(qmodel)
    assert table.stored_bytes == auto.report.bytes <= budget
    for row, layer in zip(auto.report.rows, table.rows, strict=True):
        assert row.path == layer.path and row.bytes == layer.stored_bytes
        assert (row.choice == "float") == (layer.kind == "Linear")
    assert "total" in str(auto.report)


@pytest.mark.slow
def test_average_bits_counts_elements_only_and_reaches_stacked_layers():
    class Stack(eqx.Module):
        blocks: eqx.nn.Linear
        head: eqx.nn.Linear

        def __init__(self, key):
            k1, k2 = jax.random.split(key)
            self.blocks = eqx.filter_vmap(lambda k: eqx.nn.Linear(32, 32, key=k))(jax.random.split(k1, 3))
            self.head = eqx.nn.Linear(32, 4, key=k2)

        def __call__(self, x):
            dynamic, static = eqx.partition(self.blocks, eqx.is_array)
            h = jax.lax.scan(lambda h, d: (jax.nn.gelu(eqx.combine(d, static)(h)), None), x, dynamic)[0]
            return self.head(h)

    model = Stack(jax.random.key(3))
    auto = eqx_quant.auto_recipe(model, BATCHES, average_bits=3, candidates=("int4_g32", "int2_g32"))
    assert [row.path for row in auto.report.rows] == ["blocks", "head"]
    total = sum(row.weights for row in auto.report.rows)
    assert total == 3 * 32 * 32 + 32 * 4
    assert sum(row.bits * row.weights for row in auto.report.rows) <= 3 * total
    out = jax.vmap(eqx_quant.quantize(model, **auto))(BATCHES[0])
    assert out.shape == (16, 4) and bool(jnp.all(jnp.isfinite(out)))


def test_measured_cost_is_the_loss_with_that_layer_quantized():
    auto = eqx_quant.auto_recipe(MLP, BATCHES, average_bits=8, candidates=("int8", "int2_g32"), method="measured")
    row = auto.report.rows[1]
    single = eqx_quant.quantize(MLP, [eqx_quant.Rule("layers\\.1", weight=eqx_quant.LayerQuantizer(
        eqx_quant.format_named("int2"), 32), input=None)])  # fmt: skip
    want = np.mean([float(jnp.mean((jax.vmap(single)(b) - jax.vmap(MLP)(b)) ** 2)) for b in BATCHES])
    np.testing.assert_allclose(row.costs["int2_g32"], want, rtol=1e-5)


def test_allocation_with_rounded_sizes_still_finds_a_choice_that_fits_exactly():
    costs = np.array([[0.0, 1.0]] * 3)
    sizes = np.array([[100_003, 200_000]] * 3)  # a budget of more than 2**17 units of their gcd, 1
    assert allocate(costs, sizes, 300_009) == (0, 0, 0)
    rng = np.random.default_rng(7)
    for _ in range(5):
        costs, sizes = rng.uniform(size=(6, 3)), rng.integers(10_000, 400_000, (6, 3))
        budget = int(sizes.mean(axis=1).sum())
        picks = allocate(costs, sizes, budget)
        assert sum(sizes[u, c] for u, c in enumerate(picks)) <= budget
        best = min(
            sum(costs[u, c] for u, c in enumerate(choice))
            for choice in itertools.product(range(3), repeat=6)
            if sum(sizes[u, c] for u, c in enumerate(choice)) <= budget
        )
        # Optimal up to one rounding step (here about 10 of the budget's million) per row: here the optimum itself.
        np.testing.assert_allclose(sum(costs[u, c] for u, c in enumerate(picks)), best, rtol=1e-12)


def test_a_layer_whose_inputs_mix_magnitudes_stays_float_when_activations_are_measured():
    """The case of a pretrained network whose first layer reads one feature near 100 and others near 1: with int8
    inputs per tensor, the small features round away there. Measured with its input quantized, that layer is the one
    kept in float under a budget that allows one float layer."""
    rng = np.random.default_rng(3)
    batches = []
    for _ in range(2):
        x = rng.standard_normal((32, 32)).astype(np.float32)
        x[:, 0] = 100.0 + rng.standard_normal(32)
        batches.append(jnp.asarray(x))
    model = eqx.nn.MLP(32, 32, 32, 2, activation=jax.nn.gelu, key=jax.random.key(5))
    per_int8 = [32 * 32 + 32 * 4] * 3  # int8 codes and float32 scales per output channel
    budget = sum(per_int8) + 32 * 32 * 4 - per_int8[0]  # room for exactly one float layer
    auto = eqx_quant.auto_recipe(model, batches, budget_bytes=budget, candidates=("int8", "float"),
                                 method="measured", activations=eqx_quant.DynamicFakeQuant(8))  # fmt: skip
    assert [row.choice for row in auto.report.rows] == ["float", "int8", "int8"]
    assert [r.input.format.bits for r in auto["rules"]] == [8]


def test_kl_loss_is_the_divergence_from_the_float_outputs():
    auto = eqx_quant.auto_recipe(MLP, BATCHES, average_bits=8, candidates=("int8", "int2_g32"), method="measured",
                                 loss="kl")  # fmt: skip
    single = eqx_quant.quantize(MLP, [eqx_quant.Rule("layers\\.2", weight=eqx_quant.LayerQuantizer(
        eqx_quant.format_named("int2"), 32), input=None)])  # fmt: skip
    want = []
    for b in BATCHES:
        p = np.asarray(jax.nn.log_softmax(jax.vmap(MLP)(b)), np.float64)
        q = np.asarray(jax.nn.log_softmax(jax.vmap(single)(b)), np.float64)
        want.append(np.mean(np.sum(np.exp(p) * (p - q), axis=-1)))
    np.testing.assert_allclose(auto.report.rows[2].costs["int2_g32"], np.mean(want), rtol=1e-4)


def test_non_finite_data_and_layers_no_candidate_fits_are_clear_errors():
    bad = [BATCHES[0].at[0, 0].set(jnp.nan)]
    for method in ("hessian", "measured"):
        with pytest.raises(ValueError, match="not finite"):
            eqx_quant.auto_recipe(MLP, bad, average_bits=8, candidates=("int8", "int4_g32"), method=method)
    small = eqx.nn.MLP(8, 2, 8, 1, key=jax.random.key(0))
    with pytest.warns(UserWarning, match="stays float"), pytest.raises(ValueError, match="none of the candidates"):
        eqx_quant.auto_recipe(small, [b[:, :8] for b in BATCHES], average_bits=8, candidates=("q4_0",))


def _untouchable():
    raise AssertionError("the batches were read before the arguments were checked")
    yield


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        (dict(average_bits=4, candidates=("int8",)), ValueError, "smallest takes"),
        (dict(average_bits=4, keep=123), TypeError, "keep"),
        (dict(average_bits=4, keep="(["), ValueError, "keep"),
        (dict(average_bits=4, key=0), TypeError, "key"),
        (dict(average_bits=4, candidates=("int8_g0",)), ValueError, "int8_g0"),
        (dict(average_bits=4, activations="int8"), TypeError, "activations"),
        (dict(average_bits=4, batched="yes"), TypeError, "batched"),
        (dict(average_bits=4, candidates=("float",)), ValueError, "only 'float'"),
        (dict(average_bits=4, method="measured", probes=4), ValueError, "probes"),
        (dict(average_bits=4, loss=lambda m, b: 0.0, batched=True), ValueError, "batched"),
        (dict(average_bits=4, loss="l1"), TypeError, "loss"),
    ],
)
def test_bad_arguments_fail_before_the_batches_are_read(kwargs, error, match):
    with pytest.raises(error, match=match):
        eqx_quant.auto_recipe(MLP, _untouchable(), **kwargs)


def test_one_array_for_batches_is_an_error():
    with pytest.raises(TypeError, match="batches"):
        eqx_quant.auto_recipe(MLP, BATCHES[0], average_bits=4)


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        (dict(), ValueError, "exactly one budget"),
        (dict(average_bits=4, budget_bytes=100), ValueError, "exactly one budget"),
        (dict(average_bits=-1), ValueError, "average_bits"),
        (dict(average_bits="4"), TypeError, "average_bits"),
        (dict(budget_bytes=0), ValueError, "budget_bytes"),
        (dict(average_bits=4, candidates=("int4_g32", "int5x")), ValueError, "int5x"),
        (dict(average_bits=4, candidates=()), ValueError, "empty"),
        (dict(average_bits=4, candidates="int8"), TypeError, "candidates"),
        (dict(average_bits=4, method="trace"), (ValueError, TypeError), "method"),
        (dict(average_bits=4, probes=0), ValueError, "probes"),
        (dict(average_bits=4, keep="head"), ValueError, "matches no layer"),
        (dict(average_bits=1, candidates=("int4_g32", "int2_g32")), ValueError, "smallest takes"),
    ],
)
def test_bad_arguments_are_clear_errors(kwargs, error, match):
    with pytest.raises(error, match=match):
        eqx_quant.auto_recipe(MLP, BATCHES, **kwargs)


def test_a_quantized_model_is_an_error():
    with pytest.raises(ValueError, match="float model"):
        eqx_quant.auto_recipe(eqx_quant.quantize(MLP), BATCHES, average_bits=4)


def test_a_model_of_bare_arrays_is_an_error_that_points_to_the_rules():
    class Bare(eqx.Module):
        w: jax.Array

        def __call__(self, x):
            return x @ self.w

    with pytest.raises(ValueError, match=r"no Linear, Conv or Embedding layer .* bare arrays take the rules you give"):
        eqx_quant.auto_recipe(Bare(jnp.ones((4, 2))), BATCHES, average_bits=4)


def test_layers_quantized_only_by_tracing_stay_float_with_a_warning():
    """A transposed convolution is no layer `auto_recipe` allocates to: it says that the layer stays float, outside
    the budget, and the rules leave it float."""

    class Upsample(eqx.Module):
        up: eqx.nn.ConvTranspose1d
        head: eqx.nn.Linear

        def __call__(self, x):
            return self.head(self.up(x).reshape(-1))

    k1, k2 = jax.random.split(jax.random.key(0))
    model = Upsample(eqx.nn.ConvTranspose1d(2, 2, 3, key=k1), eqx.nn.Linear(64, 4, key=k2))
    batches = [jnp.asarray(RNG.standard_normal((4, 2, 30)).astype(np.float32))]
    with pytest.warns(UserWarning, match=r"the layers 'up' \(ConvTranspose1d\) stay in floating point, outside"):
        auto = eqx_quant.auto_recipe(model, batches, average_bits=4)
    assert [row.path for row in auto.report.rows] == ["head"]
    assert type(eqx_quant.quantize(model, **auto).up) is eqx.nn.ConvTranspose1d


def test_weights_of_products_outside_the_layers_stay_float_with_a_warning():
    """Bare weight arrays multiplied by activations (found by tracing the first batch) are outside the allocation:
    `auto_recipe` names them and their size (before, it allocated the budget over the one linear layer silently)."""

    class Bare(eqx.Module):
        w: jax.Array
        head: eqx.nn.Linear

        def __call__(self, x):
            return self.head(jnp.tanh(x @ self.w.T))

    k1, k2 = jax.random.split(jax.random.key(0))
    model = Bare(jax.random.normal(k1, (32, 16)) / 4, eqx.nn.Linear(32, 4, key=k2))
    batches = [jnp.asarray(RNG.standard_normal((8, 16)).astype(np.float32))]
    with pytest.warns(UserWarning, match=r"the model's arrays 'w' \(512 weights\) are weights of products outside"):
        auto = eqx_quant.auto_recipe(model, batches, average_bits=4, method="measured", candidates=SMALL)
    assert [row.path for row in auto.report.rows] == ["head"]


def test_a_model_with_several_outputs_sums_their_errors():
    class TwoOutputs(eqx.Module):
        mlp: eqx.nn.MLP

        def __call__(self, x):
            y = self.mlp(x)
            return y, 2.0 * y

    model = TwoOutputs(MLP)
    auto = eqx_quant.auto_recipe(model, BATCHES, average_bits=8, candidates=("int8", "int2_g32"), method="measured")
    alone = eqx_quant.auto_recipe(MLP, BATCHES, average_bits=8, candidates=("int8", "int2_g32"), method="measured")
    for row, single in zip(auto.report.rows, alone.report.rows, strict=True):
        assert row.path == "mlp." + single.path
        np.testing.assert_allclose(row.costs["int2_g32"], 5 * single.costs["int2_g32"], rtol=1e-5)  # 1 + 2**2


def test_an_earlier_report_gives_its_predictions_to_another_budget():
    first = eqx_quant.auto_recipe(MLP, BATCHES, average_bits=6, candidates=SMALL)
    again = eqx_quant.auto_recipe(MLP, first.report, average_bits=3, candidates=SMALL)
    fresh = eqx_quant.auto_recipe(MLP, BATCHES, average_bits=3, candidates=SMALL)
    assert again.report == fresh.report and again["rules"] == fresh["rules"]
    with pytest.raises(ValueError, match="method"):
        eqx_quant.auto_recipe(MLP, first.report, average_bits=3, candidates=SMALL, method="measured")
    with pytest.raises(ValueError, match="no prediction"):
        eqx_quant.auto_recipe(MLP, first.report, average_bits=3, candidates=(*SMALL, "int3_g32"))
    with pytest.raises(ValueError, match="layers"):
        eqx_quant.auto_recipe(MLP, first.report, average_bits=3, candidates=SMALL, keep="layers\\.0")
