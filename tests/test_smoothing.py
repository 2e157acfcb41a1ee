"""Input transforms (`ScaleInput`, `RotateInput` and the Hadamard matrices behind it) and the algorithms that set
them (`smoothquant`, `awq`, `rotate`) against NumPy twins; their workflows with `calibrate`, `gptq`, `convert`,
`save`/`load`, training and the exporters."""

import functools
import re

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import scipy.linalg

import eqx_quant
from eqx_quant.nn import RotateInput, ScaleInput
from eqx_quant.nn._transforms import hadamard_order, paley_hadamard, walsh_hadamard

from .helpers import assert_bitwise_equal, few_rows, init, np_absmax_scale, reference_fake_quant, slow_unless
from .models import DecoderLM, LinearStack, ViTBlock


RNG = np.random.default_rng(0)
# Weights (32, 64) and (8, 32): every input size a multiple of 32 (groups fit) and a power of two (rotations fit).
MLP = init(lambda k: eqx.nn.MLP(64, 8, 32, 1, key=k), 0)
NORMAL = RNG.standard_normal((32, 64)).astype(np.float32)
X_SMOOTH = jnp.asarray(NORMAL * np.where(np.arange(64) == 3, 100, 1).astype(np.float32))  # one outlier channel
X_ROTATE = jnp.asarray(NORMAL * np.where(np.arange(64) == 5, 10, 1).astype(np.float32))  # a milder one
# Channels of very different typical sizes: what AWQ's scaling is for.
X_AWQ = jnp.asarray(NORMAL * np.exp(RNG.standard_normal(64)).astype(np.float32))
W4_ROW = eqx_quant.DynamicFakeQuant(4, axis=0)


@eqx.filter_jit
def _apply(model, x):
    return jax.vmap(model)(x)


def _eager(model, x):
    return jax.vmap(model)(x)


# A function of modules (a transform's bound method, say) compiled: eager calls compile every operation.
_jit = eqx.filter_jit(lambda f, *args: f(*args))


@eqx.filter_jit
def _float_function(layer, x):
    """What a transformed layer computes in floating point: its wrapped layer on the transformed input."""
    return jax.vmap(lambda v: layer.layer(layer.input_transform(v)))(x)


def _np_linear(linear, x) -> np.ndarray:
    """The float64 NumPy twin of an `eqx.nn.Linear` on a batch."""
    return np.asarray(x, np.float64) @ np.asarray(linear.weight, np.float64).T + np.asarray(linear.bias, np.float64)


def _rms(a, b) -> float:
    return float(np.sqrt(np.mean((np.asarray(a, np.float64) - np.asarray(b, np.float64)) ** 2)))


def _hadamard(n: int) -> np.ndarray:
    """The float64 Hadamard matrix of size `n` the rotations use: Paley's factor of order `hadamard_order(n)`
    Kronecker Sylvester's, from scipy."""
    m = hadamard_order(n)
    assert m is not None
    return np.kron(paley_hadamard(m).astype(np.float64), scipy.linalg.hadamard(n // m).astype(np.float64))


def _rotation(signs) -> np.ndarray:
    """The NumPy twin of `RotateInput(signs)`'s matrix, `T = H D / sqrt(n)`, in float64."""
    signs = np.asarray(signs, np.float64)
    return _hadamard(signs.size) * signs[None, :] / np.sqrt(signs.size)


def _matrix(transform, n: int) -> np.ndarray:
    """The matrix of a transform, column by column: `T e_j` for each basis vector."""
    return np.asarray(_jit(jax.vmap(transform), jnp.eye(n, dtype=jnp.float32)), np.float64).T


# --- Hadamard matrices ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("order", [1, 4, 8, 12, 20, 24, 44])
def test_paley_hadamard_is_a_hadamard_matrix(order):
    """`H Hᵀ = m I` with entries ±1."""
    h = paley_hadamard(order).astype(np.int64)
    assert h.shape == (order, order)
    assert set(np.unique(h)) <= {-1, 1}
    np.testing.assert_array_equal(h @ h.T, order * np.eye(order, dtype=np.int64))


def test_hadamard_order_table():
    """The small factor `m` of `n = m * 2**k`: 1 for powers of two, the least Paley order otherwise, else None."""
    table = {1: 1, 2: 1, 16: 1, 1024: 1, 12: 12, 24: 12, 48: 12, 40: 20, 4608: 72, 28: None, 10: None, 6: None}
    table |= {11008: None, 0: None, 3: None, 56: None}
    for n, m in table.items():
        assert hadamard_order(n) == m, n


@pytest.mark.parametrize("n", [16, 12, 48, 40])
def test_walsh_hadamard_is_the_kronecker_product(n):
    """`walsh_hadamard(x)` is `x Hᵀ` (and `x H` with `transpose`) for `H = Paley ⊗ Sylvester`: exact on small
    integers."""
    x = RNG.integers(-8, 9, size=(3, n)).astype(np.float32)
    h = _hadamard(n)
    m = hadamard_order(n)
    assert m is not None
    transform = jax.jit(walsh_hadamard, static_argnums=1, static_argnames="transpose")
    np.testing.assert_array_equal(np.asarray(transform(jnp.asarray(x), m)), x @ h.T)
    np.testing.assert_array_equal(np.asarray(transform(jnp.asarray(x), m, transpose=True)), x @ h)


# --- RotateInput and ScaleInput -------------------------------------------------------------------------------------


@pytest.mark.parametrize("n", [16, 24])
def test_rotate_input_matches_the_numpy_twin(n):
    """`T` read column by column is `H D / sqrt(n)`, orthogonal; `absorb` is `W Tᵀ`, `restore` inverts it, and
    `absorb(W) T x = W x`."""
    signs = jnp.asarray(RNG.choice([-1, 1], size=n).astype(np.int8))
    transform = RotateInput(signs)
    t = _matrix(transform, n)
    twin = _rotation(signs)
    np.testing.assert_allclose(t, twin, rtol=0, atol=1e-6)
    np.testing.assert_allclose(t @ t.T, np.eye(n), rtol=0, atol=1e-6)
    w = RNG.standard_normal((5, n)).astype(np.float32)
    absorbed = _jit(transform.absorb, jnp.asarray(w))
    np.testing.assert_allclose(np.asarray(absorbed), w @ twin.T, rtol=0, atol=1e-5)
    np.testing.assert_allclose(np.asarray(_jit(transform.restore, absorbed)), w, rtol=0, atol=1e-5)
    np.testing.assert_allclose(np.asarray(_jit(transform.restore, jnp.asarray(w))), w @ twin, rtol=0, atol=1e-5)
    x = RNG.standard_normal((7, n)).astype(np.float32)
    y = np.asarray(_jit(jax.vmap(transform), jnp.asarray(x)), np.float64) @ np.asarray(absorbed, np.float64).T
    np.testing.assert_allclose(y, x @ w.T.astype(np.float64), rtol=0, atol=1e-4)


def _transforms():
    multiplier = RNG.uniform(0.1, 10, size=24).astype(np.float32)
    scale = ScaleInput(jnp.asarray(multiplier))
    rotate = RotateInput(jnp.asarray(RNG.choice([-1, 1], size=24).astype(np.int8)))
    return multiplier, scale, rotate


def test_transforms_agree_eagerly_under_jit_and_vmap():
    """Both transforms compute the same bits eagerly (one example at a time), under `jax.jit` and under `jax.vmap`;
    `ScaleInput` is exactly `x * multiplier`, its `restore` exactly `W * m` and its `absorb` `W / m`."""
    x = jnp.asarray(RNG.standard_normal((6, 24)).astype(np.float32))
    multiplier, scale, rotate = _transforms()
    for transform in (scale, rotate):
        eager = np.stack([np.asarray(transform(v)) for v in x])
        assert_bitwise_equal(jax.vmap(transform)(x), eager)
        assert_bitwise_equal(eqx.filter_jit(lambda t, v: jax.vmap(t)(v))(transform, x), eager)
        assert_bitwise_equal(eqx.filter_jit(lambda t, v: t(v))(transform, x[0]), eager[0])
    assert_bitwise_equal(jax.vmap(scale)(x), np.asarray(x) * multiplier)
    np.testing.assert_array_equal(_matrix(scale, 24), np.diag(multiplier.astype(np.float64)))
    w = RNG.standard_normal((5, 24)).astype(np.float32)
    # XLA's float32 division on CPU may be 1 ulp off the correctly rounded quotient.
    np.testing.assert_allclose(np.asarray(scale.absorb(jnp.asarray(w))), w / multiplier, rtol=2.5e-7, atol=0)
    assert_bitwise_equal(scale.restore(jnp.asarray(w)), w * multiplier)


def test_transforms_take_a_batch_under_strict_rank_promotion():
    """The transforms' documented `*batch n` input: a batch at once computes what `jax.vmap` computes."""
    x = jnp.asarray(RNG.standard_normal((6, 24)).astype(np.float32))
    _, scale, rotate = _transforms()
    for transform in (scale, rotate):
        assert_bitwise_equal(transform(x), jax.vmap(transform)(x))


def test_rotate_input_rejects_sizes_without_a_hadamard_matrix():
    """Signs of a size `m * 2**k` with no Paley order `m` are a ValueError that names `signs`."""
    for n in (28, 10):
        with pytest.raises(ValueError, match="`signs`"):
            RotateInput(jnp.ones(n, jnp.int8))


# --- smoothquant ----------------------------------------------------------------------------------------------------


def _w8a8(model=MLP):
    return eqx_quant.quantize(model, **eqx_quant.recipe("w8a8"))


Q8 = _w8a8()
SMOOTH_BATCHES = [X_SMOOTH[:16], X_SMOOTH[16:]]
_second = lambda path, layer: path == "layers.1"  # noqa: E731


@functools.cache
def _smoothed(alpha=0.5, where=None):
    """The W8A8 MLP smoothed with a multiplier per layer (no layer folded into the one before it)."""
    return eqx_quant.smoothquant(Q8, SMOOTH_BATCHES, alpha=alpha, where=where, fold=False)


@functools.cache
def _calibrated(smooth: bool):
    """The W8A8 MLP calibrated on `X_SMOOTH`, smoothed first or not."""
    return eqx_quant.calibrate(_smoothed() if smooth else Q8, [X_SMOOTH])


def _smoothquant_twin(x, weight, alpha):
    """NumPy twin of SmoothQuant's multiplier `1 / s`, `s_j = max|X_j|**alpha / max|W_j|**(1 - alpha)`."""
    x_max = np.max(np.abs(np.asarray(x, np.float64)), axis=0)
    w_max = np.max(np.abs(np.asarray(weight, np.float64)), axis=0)
    return 1 / (x_max**alpha / w_max ** (1 - alpha))


@pytest.mark.parametrize("alpha", [0.5, 0.8])
def test_smoothquant_matches_the_numpy_twin_and_keeps_the_float_function(alpha):
    """The first layer's multiplier (over two batches) is the twin's `1 / s`, its weight `W * s`; every layer with an
    input quantizer is smoothed; the float function of the layer, and `float_model`, are unchanged up to rounding."""
    smoothed = _smoothed(alpha)
    layer = smoothed.layers[0]
    assert isinstance(layer.input_transform, ScaleInput)
    assert isinstance(smoothed.layers[1].input_transform, ScaleInput)
    multiplier = np.asarray(layer.input_transform.multiplier)
    assert multiplier.dtype == np.float32
    np.testing.assert_allclose(multiplier, _smoothquant_twin(X_SMOOTH, MLP.layers[0].weight, alpha), rtol=2e-6)
    assert np.argmin(multiplier) == 3  # the outlier channel is divided down the most
    np.testing.assert_allclose(np.asarray(layer.layer.weight), np.asarray(MLP.layers[0].weight) / multiplier, rtol=1e-6)
    x = X_SMOOTH[:4]
    np.testing.assert_allclose(
        np.asarray(_float_function(layer, x)), _np_linear(MLP.layers[0], x), rtol=1e-5, atol=1e-4
    )
    restored = eqx_quant.float_model(smoothed)
    for a, b in zip(restored.layers, MLP.layers, strict=True):
        np.testing.assert_allclose(np.asarray(a.weight), np.asarray(b.weight), rtol=1e-6, atol=1e-7)
        assert_bitwise_equal(a.bias, b.bias)
    np.testing.assert_allclose(np.asarray(_apply(restored, x)), np.asarray(_apply(MLP, x)), rtol=1e-5, atol=1e-5)


@pytest.mark.slow
def test_smoothquant_lowers_the_w8a8_error_on_an_outlier_channel():
    """Calibrated W8A8 with an outlier input channel: smoothing moves the outlier into the weight, and the output
    error against the float model drops (both computed here)."""
    float_out = _apply(MLP, X_SMOOTH)
    error_plain = _rms(_apply(_calibrated(False), X_SMOOTH), float_out)
    error_smoothed = _rms(_apply(_calibrated(True), X_SMOOTH), float_out)
    assert error_smoothed < 0.5 * error_plain, (error_smoothed, error_plain)


@few_rows
def test_smoothquant_statistics_ignore_non_finite_inputs():
    """A NaN in the calibration data counts as 0 in the channel maxima: the first layer gets the multiplier of data
    with a 0 there (at the entry that was its channel's maximum, so that leaving it in would show)."""
    data = np.array(X_SMOOTH)
    data[int(np.argmax(np.abs(data[:, 7]))), 7] = np.nan
    zeroed = np.where(np.isnan(data), np.float32(0), data)
    with pytest.warns(UserWarning, match=r"`smoothquant`: .* NaN or inf values, .*: 'layers.0' 1, 'layers.1' \d+\.$"):
        with_nan = eqx_quant.smoothquant(Q8, [jnp.asarray(data[:16]), jnp.asarray(data[16:])])
    with_zero = eqx_quant.smoothquant(Q8, [jnp.asarray(zeroed[:16]), jnp.asarray(zeroed[16:])])
    got = with_nan.layers[0].input_transform.multiplier
    assert_bitwise_equal(got, with_zero.layers[0].input_transform.multiplier)
    np.testing.assert_allclose(np.asarray(got), _smoothquant_twin(zeroed, MLP.layers[0].weight, 0.5), rtol=2e-6)
    assert not np.allclose(np.asarray(got), np.asarray(_smoothed().layers[0].input_transform.multiplier))
    # AWQ reads the batches twice (the channels' means, then the Gram matrices) and warns once, with one count.
    w4 = eqx_quant.quantize(MLP, **eqx_quant.recipe("w4a16_g32"))
    with pytest.warns(UserWarning, match=r"`awq`: .*: 'layers.0' 1, 'layers.1' \d+\.$") as caught:
        eqx_quant.awq(w4, [jnp.asarray(data[:16]), jnp.asarray(data[16:])], where=lambda path, layer: True)
    assert len([w for w in caught if "NaN" in str(w.message)]) == 1


def test_smoothquant_where_transforms_only_the_chosen_layer():
    """With `where` choosing `layers.1`, `layers.0` keeps its weight and has no transform."""
    smoothed = _smoothed(where=_second)
    assert smoothed.layers[0].input_transform is None
    assert_bitwise_equal(smoothed.layers[0].layer.weight, Q8.layers[0].layer.weight)
    assert isinstance(smoothed.layers[1].input_transform, ScaleInput)
    assert smoothed.layers[1].input_transform.multiplier.shape == (32,)
    # A regular expression chooses the paths it matches whole, as that predicate does.
    assert eqx.tree_equal(_smoothed(where=r"layers\.1"), smoothed)
    with pytest.raises(ValueError, match="has no eqx_quant.nn.QuantLinear"):  # `layers` matches no path whole
        _smoothed(where="layers")


ALPHAS = (0.2, 0.4, 0.6, 0.8)


def _w8a8_error_twin(x, weight, multiplier) -> float:
    """NumPy twin of the error `smoothquant` measures for a candidate: `Σ ‖Q_w(W s) Q_x(x / s) - W x‖²` with int8
    weights per row and int8 inputs per tensor, their scales `max|·| / 127` (the calibrated static input scale:
    over all of `x`), in float64 after float32 quantization."""
    f32 = np.float32
    x, weight, multiplier = np.asarray(x, f32), np.asarray(weight, f32), np.asarray(multiplier, f32)
    smoothed_w = weight / multiplier
    w_scale = np_absmax_scale(np.abs(smoothed_w).max(axis=1, keepdims=True), 127)
    w_q = w_scale * np.round(smoothed_w * (f32(1) / w_scale))
    xm = x * multiplier
    x_scale = np_absmax_scale(np.abs(xm).max(), 127)
    x_q = x_scale * np.round(xm * (f32(1) / x_scale))
    d = x_q.astype(np.float64) @ w_q.astype(np.float64).T - x.astype(np.float64) @ weight.astype(np.float64).T
    return float(np.sum(d * d))


@pytest.mark.slow
def test_smoothquant_searches_alpha_per_layer_as_the_numpy_twin():
    """With several `alpha`s, the first layer takes the one of least error of its quantized output on the
    calibration data, as the NumPy twin measures it (its inputs are the data itself); every layer's multiplier is
    one candidate's, and here the second layer chooses another than the first."""
    searched = eqx_quant.smoothquant(Q8, SMOOTH_BATCHES, alpha=ALPHAS, fold=False)
    weight = MLP.layers[0].weight
    errors = [_w8a8_error_twin(X_SMOOTH, weight, _smoothed(a).layers[0].input_transform.multiplier) for a in ALPHAS]
    best, second = np.sort(errors)[:2]
    assert best < 0.99 * second  # no near tie that float32 sums could flip
    chosen = ALPHAS[int(np.argmin(errors))]
    multiplier = searched.layers[0].input_transform.multiplier
    assert_bitwise_equal(multiplier, _smoothed(chosen).layers[0].input_transform.multiplier)
    assert_bitwise_equal(searched.layers[0].layer.weight, _smoothed(chosen).layers[0].layer.weight)
    as_array = eqx_quant.smoothquant(Q8, SMOOTH_BATCHES, alpha=np.asarray(ALPHAS), fold=False)  # any iterable
    assert_bitwise_equal(as_array.layers[0].input_transform.multiplier, multiplier)
    picks = []
    for i in (0, 1):
        got = searched.layers[i].input_transform.multiplier
        picks.append([a for a in ALPHAS if np.array_equal(got, _smoothed(a).layers[i].input_transform.multiplier)])
    assert picks[0] == [chosen] and len(picks[1]) == 1 and picks[1] != picks[0]


@pytest.mark.slow
def test_smoothquant_search_on_a_stack_equals_the_same_layers_unstacked():
    """A scanned stack searches each of its layers apart: the stack's multipliers are those that the same two layers,
    written as separate layers called in turn, get from the same search."""

    class TwoLayers(eqx.Module):
        first: eqx.nn.Linear
        second: eqx.nn.Linear

        def __call__(self, x):
            return jax.nn.gelu(self.second(jax.nn.gelu(self.first(x))))

    stack = init(lambda k: LinearStack(64, 2, k), 3)
    blocks = stack.blocks
    linear = init(lambda k: eqx.nn.Linear(64, 64, key=k), 0)
    layers = [eqx.tree_at(lambda l: (l.weight, l.bias), linear, (blocks.weight[i], blocks.bias[i])) for i in (0, 1)]
    unstacked = TwoLayers(*layers)
    batches = [X_SMOOTH[:16], X_SMOOTH[16:]]
    searched = eqx_quant.smoothquant(_w8a8(stack), batches, alpha=ALPHAS)
    apart = eqx_quant.smoothquant(_w8a8(unstacked), batches, alpha=ALPHAS)
    got = np.asarray(searched.blocks.input_transform.multiplier)
    assert got.shape == (2, 64)
    assert_bitwise_equal(got[0], apart.first.input_transform.multiplier)
    assert_bitwise_equal(got[1], apart.second.input_transform.multiplier)


# --- folding into a preceding normalisation ---------------------------------------------------------------------

# Tokens (batch, 5, 16) with an outlier channel, for the blocks that normalise before their layers.
X_BLOCK = jnp.asarray(NORMAL[:20, :16].reshape(4, 5, 16) * np.where(np.arange(16) == 3, 30, 1).astype(np.float32))
BLOCK = init(lambda k: ViTBlock(16, 2, k), 5)
X_SQUARE = jnp.asarray(NORMAL.reshape(8, 16, 16) * np.where(np.arange(16) == 3, 30, 1).astype(np.float32))


def _folded_twin(norm_out, weights, alpha):
    """NumPy twin of the factor a group of layers reading one normalisation's output shares: `1 / s` with
    `s_j = max|X_j|**alpha / max_layers max|W_j|**(1 - alpha)`."""
    x_max = np.max(np.abs(np.asarray(norm_out, np.float64)).reshape(-1, norm_out.shape[-1]), axis=0)
    w_max = np.max([np.max(np.abs(np.asarray(w, np.float64)), axis=0) for w in weights], axis=0)
    return 1 / (x_max**alpha / w_max ** (1 - alpha))


@pytest.mark.slow
def test_smoothquant_folds_into_the_layer_norm_before_its_layers():
    """A pre-LN block: the query, key and value projections (which read `norm1`'s output alone) share one factor,
    the twin's, folded into `norm1`'s weight and bias; `fc1` folds into `norm2`; the attention's output projection
    into the value projection; `fc2` (after GELU) keeps a multiplier; the float function is unchanged up to
    rounding, and the calibrated and converted models agree bit for bit. With `fold=False` every layer keeps a
    multiplier."""
    smoothed = eqx_quant.smoothquant(_w8a8(BLOCK), [X_BLOCK[:2], X_BLOCK[2:]])
    attn, plain = smoothed.attn, BLOCK.attn
    norm1_out = jax.vmap(jax.vmap(BLOCK.norm1))(X_BLOCK)
    projections = ("query_proj", "key_proj", "value_proj")
    m = _folded_twin(norm1_out, [getattr(plain, p).weight for p in projections], 0.5)
    np.testing.assert_allclose(np.asarray(smoothed.norm1.weight), np.asarray(BLOCK.norm1.weight) * m, rtol=3e-6)
    np.testing.assert_allclose(np.asarray(smoothed.norm1.bias), np.asarray(BLOCK.norm1.bias) * m, rtol=3e-6)
    for p in projections:
        assert getattr(attn, p).input_transform is None
    for p in ("query_proj", "key_proj"):
        np.testing.assert_allclose(
            np.asarray(getattr(attn, p).layer.weight), np.asarray(getattr(plain, p).weight) / m, rtol=3e-6
        )
    # The output projection folds into the value projection's rows (through the heads' reshapes and the mixing of
    # the tokens): its columns' factor is the inverse of the value projection's rows'.
    rows = np.asarray(attn.value_proj.layer.weight, np.float64) / (np.asarray(plain.value_proj.weight) / m)
    np.testing.assert_allclose(rows, np.broadcast_to(rows[:, :1], rows.shape), rtol=4e-6)
    columns = np.asarray(attn.output_proj.layer.weight, np.float64) / np.asarray(plain.output_proj.weight)
    np.testing.assert_allclose(columns * rows[:, 0], 1.0, rtol=4e-6)
    assert attn.output_proj.input_transform is None
    # `norm2` reads the attention's output, computed with quantized weights while the statistics are taken: its
    # factor is checked against `fc1`'s columns.
    assert smoothed.fc1.input_transform is None
    fc1_factor = np.asarray(smoothed.fc1.layer.weight, np.float64)[0] / np.asarray(BLOCK.fc1.weight)[0]
    norm2_factor = np.asarray(smoothed.norm2.weight, np.float64) / np.asarray(BLOCK.norm2.weight)
    np.testing.assert_allclose(norm2_factor * fc1_factor, 1.0, rtol=4e-6)
    assert isinstance(smoothed.fc2.input_transform, ScaleInput)  # after GELU
    float_out = np.asarray(_apply(BLOCK, X_BLOCK))
    restored = np.asarray(_apply(eqx_quant.float_model(smoothed), X_BLOCK))
    np.testing.assert_allclose(restored, float_out, rtol=1e-5, atol=1e-5)
    fake = eqx_quant.calibrate(smoothed, [X_BLOCK])
    _assert_converted_matches(fake, eqx_quant.convert(fake), X_BLOCK, eager=False)
    unfolded = eqx_quant.smoothquant(_w8a8(BLOCK), [X_BLOCK[:2], X_BLOCK[2:]], fold=False)
    assert_bitwise_equal(unfolded.norm1.weight, BLOCK.norm1.weight)
    for layer in (*(getattr(unfolded.attn, p) for p in projections), unfolded.attn.output_proj, unfolded.fc1):
        assert isinstance(layer.input_transform, ScaleInput)


class _NormAlsoSkips(eqx.Module):
    norm: eqx.nn.LayerNorm
    fc: eqx.nn.Linear

    def __call__(self, h):
        x = jax.vmap(self.norm)(h)
        return jax.vmap(self.fc)(x) + x  # the normalised tokens are read by the layer and by the residual sum


class _LayerAlsoOnRaw(eqx.Module):
    norm: eqx.nn.LayerNorm
    fc: eqx.nn.Linear

    def __call__(self, h):
        return jax.vmap(self.fc)(jax.vmap(self.norm)(h)) + jax.vmap(self.fc)(h)  # the layer also reads `h` itself


class _GainTwice(eqx.Module):
    norm: eqx.nn.LayerNorm
    fc: eqx.nn.Linear

    def __call__(self, h):
        return jax.vmap(self.fc)(jax.vmap(self.norm)(h)) + self.norm.weight[None, :]  # the gain is read again


class _MisalignedStack(eqx.Module):
    norms: eqx.nn.LayerNorm
    fcs: eqx.nn.Linear

    def __call__(self, h):
        norms, static_norms = eqx.partition(self.norms, eqx.is_array)
        fcs, static_fcs = eqx.partition(self.fcs, eqx.is_array)
        fcs = jax.tree.map(lambda a: jnp.roll(a, 1, axis=0), fcs)  # layer i computes after norm i + 1

        def step(h, arrays):
            norm, fc = eqx.combine(arrays[0], static_norms), eqx.combine(arrays[1], static_fcs)
            return h + jax.vmap(fc)(jax.vmap(norm)(h)), None

        return jax.lax.scan(step, h, (norms, fcs))[0]


def _normalised(h, gain):
    return (h - jnp.mean(h)) / jnp.sqrt(jnp.var(h) + 1e-5) * gain


_gated_twice = jax.jit(lambda fc, gain, h: (lambda y: fc(y) + jnp.sum(y))(_normalised(h, gain)))


class _JitTwice(eqx.Module):
    g1: jax.Array
    g2: jax.Array
    fc: eqx.nn.Linear

    def __call__(self, h):  # one compiled helper (one program) called with two gains
        return jax.vmap(lambda t: _gated_twice(self.fc, self.g1, t) + _gated_twice(self.fc, self.g2, -t))(h)


class _AgainInALoop(eqx.Module):
    norm: eqx.nn.LayerNorm
    fc: eqx.nn.Linear

    def __call__(self, h):  # the layer runs again inside a loop of traced length
        y = jax.vmap(self.fc)(jax.vmap(self.norm)(h))
        return jax.lax.fori_loop(0, jnp.int32(2), lambda i, z: jnp.tanh(jax.vmap(self.fc)(z)), y)


class _TokenMixer(eqx.Module):
    norm: eqx.nn.LayerNorm
    fc: eqx.nn.Linear

    def __call__(self, h):  # (tokens, channels), as many of each: normalised per token, mixed along the tokens
        return jax.vmap(self.fc, in_axes=1, out_axes=1)(jax.vmap(self.norm)(h))


def _norms(depth):
    return eqx.filter_vmap(lambda k: eqx.nn.LayerNorm(16))(jax.random.split(jax.random.key(0), depth))


def _linears(depth):
    return eqx.filter_vmap(lambda k: eqx.nn.Linear(16, 16, key=k))(jax.random.split(jax.random.key(1), depth))


_UNFOLDABLE = {
    "output-read-twice": lambda k: _NormAlsoSkips(eqx.nn.LayerNorm(16), eqx.nn.Linear(16, 16, key=k)),
    "layer-called-elsewhere": lambda k: _LayerAlsoOnRaw(eqx.nn.LayerNorm(16), eqx.nn.Linear(16, 16, key=k)),
    "gain-read-twice": lambda k: _GainTwice(eqx.nn.LayerNorm(16), eqx.nn.Linear(16, 16, key=k)),
    "stack-misaligned": lambda k: _MisalignedStack(_norms(2), _linears(2)),
    "one-program-twice": lambda k: _JitTwice(
        jnp.linspace(0.5, 2.0, 16), jnp.linspace(2.0, 0.5, 16), eqx.nn.Linear(16, 16, key=k)
    ),
    "again-in-a-loop": lambda k: _AgainInALoop(eqx.nn.LayerNorm(16), eqx.nn.Linear(16, 16, key=k)),
    "token-mixing": lambda k: _TokenMixer(eqx.nn.LayerNorm(16), eqx.nn.Linear(16, 16, key=k)),
}


@pytest.mark.parametrize(
    "name", slow_unless(["output-read-twice", "stack-misaligned", "token-mixing"], list(_UNFOLDABLE))
)
def test_smoothquant_does_not_fold_where_folding_would_change_the_model(name):
    """Nothing is folded where that would change what the model computes: the normalisation's output read besides
    the layer (a residual sum), the layer called on another input too, the gain read again, a scan that pairs each
    normalisation with another layer of the stack, one compiled program called with two gains, the layer called
    again inside a loop, or a layer mapped along the tokens of a normalised `(tokens, channels)` input. The layer
    keeps its multiplier, the normalisations their weights, and the float function is unchanged up to rounding."""
    make = _UNFOLDABLE[name]
    model = init(make, 6)
    x = X_SQUARE if isinstance(model, _TokenMixer) else X_BLOCK
    smoothed = eqx_quant.smoothquant(_w8a8(model), [x])
    layer = smoothed.fcs if isinstance(model, _MisalignedStack) else smoothed.fc
    assert isinstance(layer.input_transform, ScaleInput)
    gains = lambda m: [leaf for path, leaf in jax.tree_util.tree_leaves_with_path(m) if "fc" not in str(path)]  # noqa: E731
    for got, want in zip(gains(eqx_quant.float_model(smoothed)), gains(model), strict=True):
        assert_bitwise_equal(got, want)
    float_out = np.asarray(_apply(model, x))
    restored = np.asarray(_apply(eqx_quant.float_model(smoothed), x))
    np.testing.assert_allclose(restored, float_out, rtol=1e-5, atol=1e-5)


class _PooledHead(eqx.Module):
    """A head reading the normalised tokens pooled as `how` says."""

    norm: eqx.nn.LayerNorm
    head: eqx.nn.Linear
    how: str = eqx.field(static=True)

    def __call__(self, h):
        x = jax.vmap(self.norm)(h)
        return {
            "mean": lambda: self.head(jnp.mean(x, axis=0)),
            "class-token": lambda: self.head(x[0]),
            "maximum": lambda: self.head(jnp.max(x[1:], axis=0)),
            "mean-read-twice": lambda: (lambda p: self.head(p) + jnp.sum(p))(jnp.mean(x, axis=0)),
            "mean-plus-offset": lambda: self.head(jnp.mean(x, axis=0) + 1.0),
        }[self.how]()


_POOLED = ["mean", "class-token", "maximum", "mean-read-twice", "mean-plus-offset"]


@pytest.mark.parametrize("how", slow_unless(["mean", "mean-read-twice"], _POOLED))
def test_smoothquant_folds_into_a_norm_through_a_pooling_of_the_tokens(how):
    """A head reading the normalised tokens' mean, the first token's row or their maximum folds into the norm's
    weight and bias (pooling over the tokens commutes with a factor per channel); where the pooled value is read
    again or offset, the head keeps its multiplier and the norm its arrays. Either way the float function is
    unchanged up to rounding."""
    model = init(lambda k: _PooledHead(eqx.nn.LayerNorm(16), eqx.nn.Linear(16, 16, key=k), how), 6)
    smoothed = eqx_quant.smoothquant(_w8a8(model), [X_BLOCK])
    if how in _POOLED[:3]:
        assert smoothed.head.input_transform is None
        gain = np.asarray(smoothed.norm.weight, np.float64) / np.asarray(model.norm.weight)
        np.testing.assert_allclose(np.asarray(smoothed.norm.bias) / np.asarray(model.norm.bias), gain, rtol=2e-6)
        columns = np.asarray(smoothed.head.layer.weight, np.float64) / np.asarray(model.head.weight)
        np.testing.assert_allclose(columns * gain, 1.0, rtol=4e-6)
        assert not np.allclose(gain, 1.0)
    else:
        assert isinstance(smoothed.head.input_transform, ScaleInput)
        assert_bitwise_equal(smoothed.norm.weight, model.norm.weight)
        assert_bitwise_equal(smoothed.norm.bias, model.norm.bias)
    restored = np.asarray(_apply(eqx_quant.float_model(smoothed), X_BLOCK))
    np.testing.assert_allclose(restored, np.asarray(_apply(model, X_BLOCK)), rtol=1e-5, atol=1e-5)


# --- folding into a preceding linear layer --------------------------------------------------------------------------


def _w8a8_mlp_twin_inputs(x, first):
    """NumPy twin of the second layer's inputs in the W8A8 MLP while `smoothquant` takes its statistics:
    `relu(x Q(W)ᵀ + b)` of the first layer, its weight quantized (int8 per row, scales `max|·| / 127`) and its input
    not (the observers of the chosen layers stand in for their input quantizers)."""
    f32 = np.float32
    w = np.asarray(first.weight, f32)
    w_scale = np_absmax_scale(np.abs(w).max(axis=1, keepdims=True), 127)
    w_q = (w_scale * np.round(w * (f32(1) / w_scale))).astype(np.float64)
    return np.maximum(np.asarray(x, np.float64) @ w_q.T + np.asarray(first.bias, np.float64), 0)


def test_smoothquant_folds_into_the_linear_layer_before():
    """An `eqx.nn.MLP`: the second layer reads `relu` of the first's output, so its factor folds into the first
    layer's rows and bias (the twin's `1 / s`, from the first layer's quantized outputs), and it computes as a plain
    layer; the first layer (reading the model's input) keeps its multiplier. The float function is unchanged up to
    rounding and converted == fake-quant bit for bit. `where` choosing the second layer alone folds it the same way
    (with factors of its own: the first layer's input quantizer then runs while the statistics are taken)."""
    smoothed = eqx_quant.smoothquant(Q8, SMOOTH_BATCHES)
    first, second = smoothed.layers
    assert isinstance(first.input_transform, ScaleInput) and second.input_transform is None
    r = _smoothquant_twin(_w8a8_mlp_twin_inputs(X_SMOOTH, MLP.layers[0]), MLP.layers[1].weight, 0.5)
    m = np.asarray(first.input_transform.multiplier, np.float64)
    want = np.asarray(MLP.layers[0].weight, np.float64) / m * r[:, None]
    np.testing.assert_allclose(np.asarray(first.layer.weight), want, rtol=1e-5)
    np.testing.assert_allclose(np.asarray(first.layer.bias), np.asarray(MLP.layers[0].bias) * r, rtol=1e-5)
    np.testing.assert_allclose(np.asarray(second.layer.weight), np.asarray(MLP.layers[1].weight) / r, rtol=1e-5)
    x = X_SMOOTH[:8]
    restored = eqx_quant.float_model(smoothed)
    np.testing.assert_allclose(np.asarray(_apply(restored, x)), np.asarray(_apply(MLP, x)), rtol=1e-5, atol=1e-5)
    fake = eqx_quant.calibrate(smoothed, [X_SMOOTH])
    _assert_converted_matches(fake, eqx_quant.convert(fake), x, eager=False)
    chosen = eqx_quant.smoothquant(Q8, SMOOTH_BATCHES, where=_second)
    assert chosen.layers[0].input_transform is None and chosen.layers[1].input_transform is None
    rows = np.asarray(chosen.layers[0].layer.weight, np.float64) / np.asarray(MLP.layers[0].weight)
    np.testing.assert_allclose(rows, np.broadcast_to(rows[:, :1], rows.shape), rtol=2e-6)
    columns = np.asarray(chosen.layers[1].layer.weight, np.float64) / np.asarray(MLP.layers[1].weight)
    np.testing.assert_allclose(columns * rows[:, 0], 1.0, rtol=4e-6)


def _assert_folded(producer, consumer, plain_producer, plain_consumer, part, reads):
    """Asserts that `consumer` (smoothed from `plain_consumer`) folded its factors into the rows `part` of `producer`
    (from `plain_producer`): each of those rows and its bias times one factor, not all 1; column `j` of `consumer`
    times the factor of the row its input channel `j` is (`part[reads[j]]`) equal to 1; every other row and bias
    bit for bit as it was."""
    assert consumer.input_transform is None
    others = np.setdiff1d(np.arange(plain_producer.weight.shape[0]), part)
    assert_bitwise_equal(producer.layer.weight[others], plain_producer.weight[others])
    assert_bitwise_equal(producer.layer.bias[others], plain_producer.bias[others])
    rows = np.asarray(producer.layer.weight[part], np.float64) / np.asarray(plain_producer.weight[part])
    np.testing.assert_allclose(rows, np.broadcast_to(rows[:, :1], rows.shape), rtol=2e-6)
    bias = np.asarray(producer.layer.bias[part], np.float64) / np.asarray(plain_producer.bias[part])
    np.testing.assert_allclose(bias, rows[:, 0], rtol=2e-6)
    columns = np.asarray(consumer.layer.weight, np.float64) / np.asarray(plain_consumer.weight)
    np.testing.assert_allclose(columns * rows[reads, 0], 1.0, rtol=4e-6)
    assert not np.allclose(rows[:, 0], 1.0)


def _assert_kept(producer, consumer, plain_producer):
    """Asserts that `consumer` keeps its multiplier and `producer` its arrays, bit for bit."""
    assert isinstance(consumer.input_transform, ScaleInput)
    assert_bitwise_equal(producer.layer.weight, plain_producer.weight)
    assert_bitwise_equal(producer.layer.bias, plain_producer.bias)


def _with_callback(y, h):
    jax.debug.callback(lambda v: None, h)  # an operation without outputs that reads `h`
    return y


class _Pair(eqx.Module):
    """`fc1` (16 -> 16) before `fc2`, joined as `how` says; `fc3` and `c` for the cases that need them."""

    fc1: eqx.nn.Linear
    fc2: eqx.nn.Linear
    fc3: eqx.nn.Linear
    c: jax.Array
    how: str = eqx.field(static=True)

    def __call__(self, x):
        fc1, fc2 = self.fc1, self.fc2
        h = fc1(x)
        return {
            # Through operations that commute with a positive factor per channel.
            "relu": lambda: fc2(jax.nn.relu(h)),
            "gated": lambda: fc2(h * jax.nn.sigmoid(x)),
            "divided": lambda: fc2(h / (1 + jnp.abs(x))),
            "relu-plus-itself": lambda: fc2(jax.nn.relu(h) + h),
            "split-and-merged": lambda: fc2(jnp.transpose(jnp.transpose(h.reshape(2, 8))).reshape(16)),
            "weight-read-unused": lambda: (lambda unused: fc2(jax.nn.relu(h)))(jnp.sum(fc1.weight)),
            "permuted": lambda: fc2(jnp.transpose(h.reshape(2, 8)).reshape(16)),
            # Through operations that do not.
            "gelu": lambda: fc2(jax.nn.gelu(h)),
            "bias-between": lambda: fc2(h + self.c),
            "also-residual": lambda: fc2(jax.nn.relu(h)) + h,
            "reversed": lambda: fc2(h[::-1]),
            "two-producers": lambda: fc2(h * self.fc3(x)),
            "called-twice": lambda: fc2(jax.nn.relu(fc1(jax.nn.relu(h)))),
            "weight-read": lambda: fc2(jax.nn.relu(h)) + fc1.weight @ x,
            "cast-to-integers": lambda: fc2((4 * h).astype(jnp.int32).astype(h.dtype)),
            "leaves-read": lambda: fc2(jax.nn.relu(h)) + jax.tree_util.tree_leaves(fc1)[0] @ x,
            "debug-callback": lambda: _with_callback(fc2(jax.nn.relu(h)), h),
            "scanned-over": lambda: fc2(jax.lax.scan(lambda c, v: (c, v), jnp.float32(0), h)[1]),
            "window-product": lambda: fc2(jax.lax.reduce_window(h, 2.0, jax.lax.mul, (2,), (1,), "SAME")),
        }[self.how]()


_FOLDS = ["relu", "gated", "divided", "relu-plus-itself", "split-and-merged", "weight-read-unused", "permuted"]
_KEEPS = ["gelu", "bias-between", "also-residual", "reversed", "two-producers", "called-twice"]
_PERMUTED = np.arange(16).reshape(2, 8).T.ravel()  # the channel of `fc1` that `fc2`'s input channel `j` is
_KEEPS += ["weight-read", "cast-to-integers", "leaves-read", "debug-callback", "scanned-over", "window-product"]
X_PAIR = X_BLOCK.reshape(-1, 16)


def _pair(how):
    return init(lambda k: _Pair(*(eqx.nn.Linear(16, 16, key=j) for j in jax.random.split(k, 3)), jnp.ones(16), how), 9)


@pytest.mark.parametrize("how", slow_unless(["relu", "two-producers"], _FOLDS + _KEEPS))
def test_smoothquant_folds_into_a_linear_layer_only_where_the_factor_commutes(how):
    """With `fc2` chosen: its factor folds into `fc1`'s rows and bias through ReLU, a gate's product, a division, the
    sum of two such views, a reshape undone and one that permutes the channels (each factor into the row of the
    channel it multiplies), also where the model reads `fc1.weight` but drops what it computed; not through GELU, a
    bias, a residual read of `fc1`'s output, reversed channels, a product of two layers' outputs, a second call of
    `fc1`, a read of `fc1.weight` or of its leaves, a cast to integers, an effect reading it (a debug callback), a
    scan along its channels (one whose step returns no new value) or a product over a window of channels, where
    `fc1` keeps its arrays and `fc2` its multiplier. Either way the float function is unchanged up to rounding."""
    model = _pair(how)
    chosen = lambda path, layer: path == "fc2"  # noqa: E731
    smoothed = eqx_quant.smoothquant(_w8a8(model), [X_PAIR], where=chosen)
    fc1, fc2 = smoothed.fc1, smoothed.fc2
    if how in _FOLDS:
        _assert_folded(fc1, fc2, model.fc1, model.fc2, np.arange(16), _PERMUTED if how == "permuted" else np.arange(16))
    else:
        _assert_kept(fc1, fc2, model.fc1)
    restored = np.asarray(_apply(eqx_quant.float_model(smoothed), X_PAIR))
    np.testing.assert_allclose(restored, np.asarray(_apply(model, X_PAIR)), rtol=1e-5, atol=1e-5)


class _Fused(eqx.Module):
    """`fc1` (16 -> 48, a fused projection) before `fc2` (16 -> 16), which reads a part of its output as `how`
    says; `fc3` (16 -> 16) for the case that needs it."""

    fc1: eqx.nn.Linear
    fc2: eqx.nn.Linear
    fc3: eqx.nn.Linear
    how: str = eqx.field(static=True)

    def __call__(self, x):
        fc2, h = self.fc2, self.fc1(x)
        q, k, v = jnp.split(h, 3)
        return {
            # One part of the channels reaches `fc2` through operations that commute with the factor; the others
            # are read in any way.
            "split-values": lambda: fc2(
                (jax.nn.softmax(jnp.sum(q.reshape(2, 8) * k.reshape(2, 8), -1))[:, None] * v.reshape(2, 8)).reshape(16)
            ),
            "gate-up": lambda: fc2(jax.nn.silu(h[:16]) * h[16:32]),
            "head-indexed": lambda: fc2(h.reshape(3, 2, 8)[2].reshape(16)) + jnp.tanh(h[0]),
            "where-relu": lambda: fc2(jnp.where(v > 0, v, 0.0)),
            "leaky-relu": lambda: fc2(jax.nn.leaky_relu(v)),
            "clipped-below": lambda: fc2(jnp.clip(v, 0)),
            "masked": lambda: fc2(jnp.where(x > 0, v, 0.0)),
            "gated-by-a-sign": lambda: fc2(v) * (v[0] > 0).astype(v.dtype),
            "magnitude-and-sign": lambda: fc2(jnp.abs(v)) * jnp.sign(v[0]),
            # Where the part `fc2` reads is also read otherwise, or is not one part.
            "overlapping": lambda: fc2(h[8:24]) + jnp.sum(jax.nn.gelu(h[16:32])),
            "two-parts-summed": lambda: fc2(q + k),
            "thresholded": lambda: fc2(jnp.where(v > 1, v, 0.0)),
            "relu6": lambda: fc2(jax.nn.relu6(v)),
            "read-by-another-layer": lambda: fc2(v) + self.fc3(v),
            "window-maximum": lambda: fc2(jax.lax.reduce_window(v, 0.0, jax.lax.max, (3,), (1,), "SAME")),
        }[self.how]()


# Where `fc2` folds: the first row of the part of `fc1` it reads.
_FUSED_FOLDS = {"split-values": 32, "gate-up": 16, "head-indexed": 32, "where-relu": 32, "leaky-relu": 32}
_FUSED_FOLDS |= {"clipped-below": 32, "masked": 32, "gated-by-a-sign": 32, "magnitude-and-sign": 32}
_FUSED_KEEPS = ["overlapping", "two-parts-summed", "thresholded", "relu6", "read-by-another-layer", "window-maximum"]


@pytest.mark.parametrize("how", slow_unless(["clipped-below", "overlapping"], [*_FUSED_FOLDS, *_FUSED_KEEPS]))
def test_smoothquant_folds_into_the_part_of_a_fused_layer_that_a_layer_reads(how):
    """With `fc2` chosen: where it reads one part of the fused `fc1`'s output (a split, a slice, an index after a
    reshape into parts) through operations that commute with the factor (also a select against a sign or a mask,
    leaky ReLU, a clip from 0 below, magnitudes; the output gated by the sign of one channel), and nothing else
    reads that part so, its factor folds into those rows of `fc1` and their biases, and every other row stays bit
    for bit as it was; where the part is read otherwise (a GELU of overlapping channels, a sum of two parts, a
    threshold other than 0, ReLU6, another layer, a maximum over a window of channels), `fc1` keeps its arrays and
    `fc2` its multiplier. Either way the float function is unchanged up to rounding."""
    keys = jax.random.split(jax.random.key(4), 3)
    model = _Fused(eqx.nn.Linear(16, 48, key=keys[0]), eqx.nn.Linear(16, 16, key=keys[1]),
                   eqx.nn.Linear(16, 16, key=keys[2]), how)  # fmt: skip
    chosen = lambda path, layer: path == "fc2"  # noqa: E731
    smoothed = eqx_quant.smoothquant(_w8a8(model), [X_PAIR], where=chosen)
    fc1, fc2 = smoothed.fc1, smoothed.fc2
    if how in _FUSED_FOLDS:
        part = np.arange(_FUSED_FOLDS[how], _FUSED_FOLDS[how] + 16)
        _assert_folded(fc1, fc2, model.fc1, model.fc2, part, np.arange(16))
    else:
        _assert_kept(fc1, fc2, model.fc1)
    restored = np.asarray(_apply(eqx_quant.float_model(smoothed), X_PAIR))
    np.testing.assert_allclose(restored, np.asarray(_apply(model, X_PAIR)), rtol=1e-5, atol=1e-5)


class _Grouped(eqx.Module):
    """Grouped-query attention over one token: `v` makes 2 heads of 8 values, each repeated over 2 of the 4 query
    heads (`jnp.repeat`), weighted per query head by a softmax of `q`, then `o`."""

    q: eqx.nn.Linear
    v: eqx.nn.Linear
    o: eqx.nn.Linear

    def __call__(self, x):
        heads = jnp.repeat(self.v(x).reshape(2, 8), 2, axis=0)
        return self.o((jax.nn.softmax(self.q(x))[:, None] * heads).reshape(32))


def _grouped(key):
    q, v, o = jax.random.split(key, 3)
    return _Grouped(eqx.nn.Linear(32, 4, key=q), eqx.nn.Linear(32, 16, key=v), eqx.nn.Linear(32, 32, key=o))


GROUPED = init(_grouped, 8)
GROUPED_ROWS = np.arange(32).reshape(4, 8) // 16 * 8 + np.arange(8)  # the channel of `v` each input of `o` repeats
X_GROUPED = X_AWQ[:, :32]


def test_smoothquant_folds_grouped_query_attention_with_one_factor_per_repeated_channel():
    """`o` reads each of `v`'s channels repeated over two query heads: its factor folds into `v`'s rows, one per
    channel of `v`, shared by its copies: SmoothQuant's formula on the largest input and weight magnitudes of the
    copies (the twin, from the per-copy factors that `fold=False` gives `o`). The float function is unchanged, and
    the converted model equals the fake-quant one bit for bit."""
    chosen = lambda path, layer: path == "o"  # noqa: E731
    q8 = _w8a8(GROUPED)
    smoothed = eqx_quant.smoothquant(q8, [X_GROUPED], where=chosen)
    copies = GROUPED_ROWS.ravel()
    _assert_folded(smoothed.v, smoothed.o, GROUPED.v, GROUPED.o, np.arange(16), copies)
    columns = np.asarray(smoothed.o.layer.weight, np.float64)[0] / np.asarray(GROUPED.o.weight)[0]
    # The twin: from each copy's own factor `s_j = sqrt(x_j / w_j)` (alpha 0.5), `x_j = s_j² w_j`; one factor per
    # channel of `v` from the copies' largest `x` and `w`.
    own = 1 / np.asarray(eqx_quant.smoothquant(q8, [X_GROUPED], where=chosen, fold=False).o.input_transform.multiplier,
                         np.float64)  # fmt: skip
    w = np.max(np.abs(np.asarray(GROUPED.o.weight, np.float64)), axis=0)
    x = own**2 * w
    shared = [np.sqrt(x[copies == c].max() / w[copies == c].max()) for c in range(16)]
    np.testing.assert_allclose(columns, np.asarray(shared)[copies], rtol=1e-5)
    assert len(np.unique(np.round(own / np.asarray(shared)[copies], 6))) > 1  # the copies' own factors differ
    restored = np.asarray(_apply(eqx_quant.float_model(smoothed), X_GROUPED))
    np.testing.assert_allclose(restored, np.asarray(_apply(GROUPED, X_GROUPED)), rtol=1e-5, atol=1e-5)
    fake = eqx_quant.calibrate(smoothed, [X_GROUPED])
    _assert_converted_matches(fake, eqx_quant.convert(fake), X_GROUPED, eager=False)


@pytest.mark.slow
def test_awq_folds_grouped_query_attention_with_one_factor_per_repeated_channel():
    """AWQ (`fold=True`) searches `o`'s multiplier on the copies' mean input magnitudes, shared by each channel's
    copies and folded into `v`'s rows; the float function is unchanged."""
    q4 = eqx_quant.quantize(GROUPED, **eqx_quant.recipe("w4a16_g32"))
    folded = eqx_quant.awq(q4, [X_GROUPED], clip=False, fold=True, where=lambda path, layer: path == "o")
    assert folded.o.input_transform is None
    rows = np.asarray(folded.v.layer.weight, np.float64)[:, 0] / np.asarray(GROUPED.v.weight)[:, 0]
    columns = np.asarray(folded.o.layer.weight, np.float64)[0] / np.asarray(GROUPED.o.weight)[0]
    np.testing.assert_allclose(columns * rows[GROUPED_ROWS.ravel()], 1.0, rtol=4e-6)  # `o` divided, `v` multiplied
    assert not np.allclose(rows, rows[0])
    restored = np.asarray(_apply(eqx_quant.float_model(folded), X_GROUPED))
    np.testing.assert_allclose(restored, np.asarray(_apply(GROUPED, X_GROUPED)), rtol=1e-5, atol=1e-5)


class _Ensemble(eqx.Module):
    """Two stacks of two layers computed all at once with `jax.vmap` (no scan): `how` pairs member `i` of `fc1s` with
    member `i` of `fc2s`, or sums `fc1s`' outputs over the stack before `fc2s`."""

    fc1s: eqx.nn.Linear
    fc2s: eqx.nn.Linear
    how: str = eqx.field(static=True)

    def __call__(self, x):
        y = jax.nn.relu(jax.vmap(lambda f: f(x))(self.fc1s))  # (2, 16)
        if self.how == "summed":
            y = jnp.broadcast_to(jnp.sum(y, axis=0), y.shape)
        return jax.vmap(lambda f, v: f(v))(self.fc2s, y)


@pytest.mark.parametrize("how", slow_unless(["summed"], ["summed", "paired"]))
def test_smoothquant_does_not_fold_a_stack_computed_all_at_once(how):
    """A stack's members each have their own factor; computed all at once (`jax.vmap` over the stack, not a scan),
    an operation may mix them (here a sum over the stack), so nothing folds, and the float function is unchanged."""
    linears = lambda k: eqx.filter_vmap(lambda j: eqx.nn.Linear(16, 16, key=j))(jax.random.split(k))  # noqa: E731
    model = init(lambda k: _Ensemble(linears(k), linears(jax.random.fold_in(k, 1)), how), 3)
    smoothed = eqx_quant.smoothquant(_w8a8(model), [X_PAIR])
    assert isinstance(smoothed.fc2s.input_transform, ScaleInput)
    assert_bitwise_equal(smoothed.fc1s.layer.bias, model.fc1s.bias)
    restored = np.asarray(_apply(eqx_quant.float_model(smoothed), X_PAIR))
    np.testing.assert_allclose(restored, np.asarray(_apply(model, X_PAIR)), rtol=1e-5, atol=1e-5)


def test_smoothquant_folds_only_into_a_layer_whose_rows_keep_their_own_scales():
    """A preceding layer with one weight scale per tensor (or a fitted one) is left as it is, and the next layer
    keeps its multiplier; one without a weight quantizer takes the factor."""
    model = _pair("relu")
    quantized = _w8a8(model)
    chosen = lambda path, layer: path == "fc2"  # noqa: E731
    per_tensor = eqx.tree_at(lambda m: m.fc1.weight_quant, quantized, eqx_quant.DynamicFakeQuant(8))
    kept = eqx_quant.smoothquant(per_tensor, [X_PAIR], where=chosen)
    assert isinstance(kept.fc2.input_transform, ScaleInput)
    assert_bitwise_equal(kept.fc1.layer.weight, model.fc1.weight)
    unquantized = eqx.tree_at(lambda m: m.fc1.weight_quant, quantized, None)
    folded = eqx_quant.smoothquant(unquantized, [X_PAIR], where=chosen)
    assert folded.fc2.input_transform is None
    assert not np.array_equal(np.asarray(folded.fc1.layer.weight), np.asarray(model.fc1.weight))


class _NormGelu(eqx.Module):
    norm: eqx.nn.LayerNorm
    fc1: eqx.nn.Linear
    fc2: eqx.nn.Linear

    def __call__(self, x):
        return self.fc2(jax.nn.gelu(self.fc1(self.norm(x))))


def test_smoothquant_fold_only_smooths_the_layers_that_fold(tmp_path):
    """`fold="only"`: `fc1` (after the norm) is smoothed and folded, `fc2` (after GELU) is left exactly as it was, so
    the converted model exports, where `fold=True` gives `fc2` a multiplier the exporters refuse; the float function
    is unchanged up to rounding. With no layer that folds it is a ValueError, as is a `fold` of another value."""
    model = init(
        lambda k: _NormGelu(eqx.nn.LayerNorm(16), *(eqx.nn.Linear(16, 16, key=j) for j in jax.random.split(k))), 2
    )
    quantized = _w8a8(model)
    only = eqx_quant.smoothquant(quantized, [X_PAIR], fold="only")
    assert only.fc1.input_transform is None and only.fc2.input_transform is None
    assert not np.array_equal(np.asarray(only.norm.weight), np.asarray(model.norm.weight))
    assert_bitwise_equal(only.fc2.layer.weight, model.fc2.weight)
    assert_bitwise_equal(only.fc2.layer.bias, model.fc2.bias)
    restored = np.asarray(_apply(eqx_quant.float_model(only), X_PAIR))
    np.testing.assert_allclose(restored, np.asarray(_apply(model, X_PAIR)), rtol=1e-5, atol=1e-5)
    eqx_quant.export_safetensors(tmp_path / "only.safetensors", eqx_quant.convert(only))
    every = eqx_quant.convert(eqx_quant.smoothquant(quantized, [X_PAIR]))
    with pytest.raises(ValueError, match="'fc2' has the input transform ScaleInput"):
        eqx_quant.export_safetensors(tmp_path / "every.safetensors", every)
    fc2 = lambda path, layer: path == "fc2"  # noqa: E731
    with pytest.raises(ValueError, match=r"None of the chosen layers \['fc2'\] .* fold='only'\)` would change nothing"):
        eqx_quant.smoothquant(quantized, [X_PAIR], fold="only", where=fc2)
    with pytest.raises(ValueError, match=re.escape("`fold` must be True, False or 'only', got fold='yes'.")):
        eqx_quant.smoothquant(quantized, [X_PAIR], fold="yes")
    with pytest.raises(ValueError, match=re.escape("`fold` must be True, False or 'only', got fold='Only'.")):
        eqx_quant.awq(quantized, [X_PAIR], fold="Only")  # (other types: tests/unhooked/check_errors.py)


class _ReadsWeight(eqx.Module):
    """`enc`'s weight is read again, transposed, besides its call (a tied decoder)."""

    enc: eqx.nn.Linear
    fc: eqx.nn.Linear

    def __call__(self, x):
        h = jax.nn.relu(self.enc(x))
        return self.fc(h) + self.enc.weight.T @ h


@pytest.mark.slow
def test_transforms_leave_out_layers_whose_weight_the_model_reads():
    """A layer whose weight the model reads besides calling it would compute that read with the transformed weight:
    `smoothquant` and `awq` leave it as it is with a warning naming it (and nothing folds into it), and refuse it
    when `where` chooses it. The smoothed model's output error stays that of round to nearest's order, where
    transforming `enc` made it hundreds of times larger."""
    model = init(lambda k: _ReadsWeight(*(eqx.nn.Linear(16, 16, key=j) for j in jax.random.split(k))), 7)
    quantized = _w8a8(model)
    warning = r"`smoothquant` leaves layers as they are: the model reads the weights of \['enc'\] besides calling"
    with pytest.warns(UserWarning, match=warning):
        smoothed = eqx_quant.smoothquant(quantized, [X_PAIR])
    assert smoothed.enc.input_transform is None and isinstance(smoothed.fc.input_transform, ScaleInput)
    assert_bitwise_equal(smoothed.enc.layer.weight, model.enc.weight)
    assert_bitwise_equal(smoothed.enc.layer.bias, model.enc.bias)
    reference = _apply(model, X_PAIR)
    plain_error = _rms(_apply(eqx_quant.calibrate(quantized, [X_PAIR]), X_PAIR), reference)
    smoothed_error = _rms(_apply(eqx_quant.calibrate(smoothed, [X_PAIR]), X_PAIR), reference)
    assert smoothed_error < 2 * plain_error, (smoothed_error, plain_error)
    enc = lambda path, layer: path == "enc"  # noqa: E731
    with pytest.raises(ValueError, match=r"reads the weights of \['enc'\] .* Exclude them with `where`"):
        eqx_quant.smoothquant(quantized, [X_PAIR], where=enc)
    w4 = eqx_quant.quantize(model, **eqx_quant.recipe("w4a16_g32", group_size=8))
    with pytest.warns(UserWarning, match=r"`awq` leaves layers as they are: the model reads the weights of \['enc'\]"):
        scaled = eqx_quant.awq(w4, [X_PAIR], fold=True)
    assert_bitwise_equal(scaled.enc.layer.weight, model.enc.weight)


class _NormLinearBare(eqx.Module):
    norm: eqx.nn.LayerNorm
    fc: eqx.nn.Linear
    head: jax.Array

    def __call__(self, x):
        return self.head @ self.fc(self.norm(x))


@pytest.mark.slow
def test_smoothquant_folds_in_a_traced_model():
    """In a model quantized with `example=` (a `QuantTraced`), the layer after a norm folds into it as in a model of
    layers; the float function is unchanged up to rounding and converted == fake-quant."""
    model = init(lambda k: _NormLinearBare(eqx.nn.LayerNorm(16), eqx.nn.Linear(16, 16, key=k), jnp.ones((4, 16))), 8)
    x = X_BLOCK.reshape(-1, 16)
    quantized = eqx_quant.quantize(model, **eqx_quant.recipe("w8a8"), example=(x[0],))
    smoothed = eqx_quant.smoothquant(quantized, [x])
    assert isinstance(smoothed.input_transforms[0], ScaleInput)  # the traced head: a multiplier of its own
    assert smoothed.model.fc.input_transform is None
    assert not np.array_equal(smoothed.model.norm.weight, model.norm.weight)
    restored = np.asarray(_apply(eqx_quant.float_model(smoothed), x))
    np.testing.assert_allclose(restored, np.asarray(_apply(model, x)), rtol=1e-5, atol=1e-5)
    fake = eqx_quant.calibrate(smoothed, [x])
    _assert_converted_matches(fake, eqx_quant.convert(fake), x, eager=False)


def test_transforms_beside_traced_weights_check_the_layers_first():
    """Beside traced weights, `where` chooses layers alone (a traced weight is named `model.<path>`), and a chosen
    layer's error names it: weight-only rules give SmoothQuant nothing, layers or traced weights, to smooth."""
    x = X_BLOCK.reshape(-1, 16)
    model = init(lambda k: _NormLinearBare(eqx.nn.LayerNorm(16), eqx.nn.Linear(16, 16, key=k), jnp.ones((4, 16))), 8)
    mixed = eqx_quant.quantize(model, **eqx_quant.recipe("w4a16_g32", group_size=8), example=(x[0],))
    chosen = eqx_quant.awq(mixed, [x], where=lambda path, layer: path == "model.fc")
    assert_bitwise_equal(chosen.model.head, model.head)
    assert chosen.input_transforms == (None,)
    with pytest.raises(ValueError, match="with an input quantizer, nor a traced weight .* `smoothquant` would change"):
        eqx_quant.smoothquant(mixed, [x])
    w8a8 = eqx_quant.quantize(model, **eqx_quant.recipe("w8a8"), example=(x[0],))
    smoothed = eqx_quant.smoothquant(w8a8, [x], fold=False, where=lambda path, layer: path == "model.fc")
    with pytest.raises(ValueError, match=r"'model.fc' already has the input transform ScaleInput"):
        eqx_quant.rotate(smoothed, key=jax.random.key(0), batch=x)


@pytest.mark.slow
def test_smoothquant_does_not_fold_into_layers_where_leaves_out():
    """Only the query projection chosen: the key and value projections read `norm1`'s output too, so nothing folds."""
    query = eqx_quant.smoothquant(_w8a8(BLOCK), [X_BLOCK], where=lambda path, layer: path == "attn.query_proj")
    assert isinstance(query.attn.query_proj.input_transform, ScaleInput)
    assert_bitwise_equal(query.norm1.weight, BLOCK.norm1.weight)


@pytest.mark.slow
def test_smoothquant_folds_into_a_stacked_model_norm_and_searches_per_group():
    """A scanned decoder whose own RMSNorm multiplies by its weight last: `qkv` folds into `norm1`, `gate` and `up`
    (one group: one factor) into `norm2`, `down` into `up`'s rows and `out` into the rows of `qkv` that make the
    values (the split of the fused projection is followed), per layer of the stack; with several
    `alpha`s the group chooses one; the float function is unchanged up to rounding; converted == fake-quant bit for
    bit."""
    lm = init(lambda k: DecoderLM(k), 7)
    tokens = jnp.asarray(RNG.integers(0, 13, size=(4, 6)))
    smoothed = eqx_quant.smoothquant(_w8a8(lm), [tokens[:2], tokens[2:]], alpha=[0.3, 0.6, 0.9])
    blocks, plain = smoothed.blocks, lm.blocks

    def factor(name):  # the factor a layer's columns were multiplied by, per layer of the stack
        return np.asarray(getattr(blocks, name).layer.weight, np.float64) / np.asarray(getattr(plain, name).weight)

    # `down` reads `silu(gate(u)) * up(u)`: it folds into `up`'s rows (`up` holds no bias), per layer of the stack.
    down = factor("down")[:, :1, :]  # (layers, 1, 2 * dim): `s`, the same in every row
    np.testing.assert_allclose(factor("down"), np.broadcast_to(down, factor("down").shape), rtol=2e-6)
    # `out` reads the values, `qkv`'s output channels from `2 * dim` on, through the attention: it folds into those
    # rows of `qkv`, whose other rows keep only the columns' factor.
    out = factor("out")[:, :1, :]
    np.testing.assert_allclose(factor("out"), np.broadcast_to(out, factor("out").shape), rtol=2e-6)
    undo = np.ones_like(factor("qkv")[:, :, :1])
    undo[:, 32:] = np.swapaxes(out, 1, 2)
    columns = {"qkv": factor("qkv") * undo, "gate": factor("gate"), "up": factor("up") * np.swapaxes(down, 1, 2)}
    for name, got in columns.items():
        assert getattr(blocks, name).input_transform is None
        np.testing.assert_allclose(got, np.broadcast_to(got[:, :1, :], got.shape), rtol=4e-6)
    np.testing.assert_allclose(factor("gate")[:, 0], columns["up"][:, 0], rtol=4e-6)
    norm1 = np.asarray(blocks.norm1.weight, np.float64) / np.asarray(plain.norm1.weight)
    np.testing.assert_allclose(norm1 * factor("qkv")[:, 0], 1.0, rtol=4e-6)
    norm2 = np.asarray(blocks.norm2.weight, np.float64) / np.asarray(plain.norm2.weight)
    np.testing.assert_allclose(norm2 * factor("gate")[:, 0], 1.0, rtol=4e-6)
    assert blocks.down.input_transform is None
    assert blocks.out.input_transform is None
    float_out = np.asarray(_apply(lm, tokens))
    np.testing.assert_allclose(np.asarray(_apply(eqx_quant.float_model(smoothed), tokens)), float_out, atol=1e-4)
    fake = eqx_quant.calibrate(smoothed, [tokens])
    _assert_converted_matches(fake, eqx_quant.convert(fake), tokens, eager=False)


class _HalfUsed(eqx.Module):
    used: eqx.nn.Linear
    unused: eqx.nn.Linear

    def __call__(self, x):
        return self.used(x)


def test_smoothquant_errors():
    """ValueErrors naming the argument or the layer: `alpha` outside [0, 1], a `where` that selects nothing, a layer
    smoothed twice, one already calibrated (the message names `calibrate`), a layer never called."""
    with pytest.raises(ValueError, match="alpha"):
        eqx_quant.smoothquant(Q8, SMOOTH_BATCHES, alpha=1.5)
    with pytest.raises(ValueError, match=r"`alpha` must be in \[0, 1\], got alpha=\[0.5, -0.1\]"):
        eqx_quant.smoothquant(Q8, SMOOTH_BATCHES, alpha=[0.5, -0.1])
    with pytest.raises(ValueError, match="non-empty sequence"):
        eqx_quant.smoothquant(Q8, SMOOTH_BATCHES, alpha=[])
    with pytest.raises(ValueError, match="where"):
        eqx_quant.smoothquant(Q8, SMOOTH_BATCHES, where=lambda path, layer: False)
    with pytest.raises(ValueError, match=r"'layers\.1' already has the input transform ScaleInput"):
        eqx_quant.smoothquant(_smoothed(where=_second), SMOOTH_BATCHES)
    with pytest.raises(ValueError, match=r"(?s)'layers\.0'.*before `calibrate`"):
        eqx_quant.smoothquant(_calibrated(False), SMOOTH_BATCHES)
    half = _w8a8(init(lambda k: _HalfUsed(eqx.nn.Linear(64, 8, key=k), eqx.nn.Linear(64, 8, key=k)), 1))
    with pytest.raises(ValueError, match=r"\['unused'\] were never called"):
        eqx_quant.smoothquant(half, SMOOTH_BATCHES)


# --- awq ------------------------------------------------------------------------------------------------------------


def _rtn(w, group):
    """NumPy float32 twin of the symmetric int4 weight quantizer: `max|w| / 7` per row (`group=None`) or per group of
    columns, round half to even, clip to [-8, 7]."""
    w = np.asarray(w, np.float32)
    out, n = w.shape
    blocks = w.reshape(out, -1, group or n)
    scale = np_absmax_scale(np.abs(blocks).max(axis=-1, keepdims=True), 7)
    return (scale * np.clip(np.round(blocks * (np.float32(1) / scale)), -8, 7)).reshape(out, n)


def _awq_multiplier(x_mean, alpha):
    s = np.maximum(x_mean, 1e-4) ** alpha
    return (1 / (s / np.sqrt(s.max() * s.min()))).astype(np.float32)


def _awq_scaling_twin(w, x, group, grid=20):
    """The float64 twin of AWQ's scaling search: each `alpha = i / grid`'s multiplier and output error
    `tr(D G Dᵀ)`."""
    x = np.asarray(x, np.float64)
    gram, x_mean = x.T @ x, np.mean(np.abs(x), axis=0)
    multipliers, errors = [], []
    for i in range(grid):
        m = _awq_multiplier(x_mean, i / grid)
        d = _rtn(w / m, group).astype(np.float64) * m - w
        multipliers.append(m)
        errors.append(np.trace(d @ gram @ d.T))
    return np.stack(multipliers), np.array(errors)


def _assert_least_twin_error(multiplier, w, x, group):
    """Asserts that `multiplier` is the twin's for some `alpha` (to float32 rounding) whose twin error is the least
    (to 1e-4); returns its index and the twin's errors."""
    multipliers, errors = _awq_scaling_twin(w, x, group)
    chosen = int(np.argmin(np.max(np.abs(multipliers - multiplier) / multipliers, axis=1)))
    np.testing.assert_allclose(multiplier, multipliers[chosen], rtol=1e-5)
    assert errors[chosen] <= errors.min() * (1 + 1e-4), (chosen, errors)
    return chosen, errors


def _awq_clip_errors(scaled, multiplier, x, group, ratios):
    """The float64 twin of AWQ's clipping errors `d_g G_gg d_gᵀ` per ratio, row and group, for the scaled weight."""
    x = np.asarray(x, np.float64)
    out, n = scaled.shape
    g = group or n
    blocks = scaled.reshape(out, n // g, g)
    errors = np.zeros((len(ratios), out, n // g))
    for k, ratio in enumerate(ratios):
        limit = np.abs(blocks).max(axis=-1, keepdims=True) * np.float32(ratio)
        clipped = np.clip(blocks, -limit, limit).reshape(out, n)
        d = ((_rtn(clipped, group) - scaled).astype(np.float64) * multiplier).reshape(out, n // g, g)
        for j in range(n // g):
            x_g = x[:, j * g : (j + 1) * g]
            errors[k, :, j] = np.sum((d[:, j] @ x_g.T) ** 2, axis=1)
    return errors


AWQ_BATCHES = [X_AWQ[:16], X_AWQ[16:]]


@functools.cache
def _awq_models():
    """The MLP quantized weight-only int4 per group of 32, and `awq` of its first layer without and with clipping."""
    q = eqx_quant.quantize(MLP, **eqx_quant.recipe("w4a16_g32"))
    first = lambda path, layer: path == "layers.0"  # noqa: E731
    return q, eqx_quant.awq(q, AWQ_BATCHES, clip=False, where=first), eqx_quant.awq(q, AWQ_BATCHES, where=first)


def _output_error(weight, multiplier, w, x):
    """`tr(D G Dᵀ)` of the effective weight `weight * multiplier` against `w` on the data `x`, in float64."""
    d = np.asarray(weight, np.float64) * np.asarray(multiplier, np.float64) - np.asarray(w, np.float64)
    return float(np.sum((np.asarray(x, np.float64) @ d.T) ** 2))


@pytest.mark.slow
@few_rows
def test_awq_matches_the_numpy_twin_and_beats_round_to_nearest():
    """Int4 per group of 32: the multiplier is one of the twin's, of least twin error (to 1e-4), and not
    round-to-nearest's; without clipping the float function is unchanged; each row and group's clipping ratio has
    the least twin error of the ratios tried; the weight-only output error is at most RTN's, with and without
    clipping, and the fake-quant layer computes the twin's `Q(W') (m x)`."""
    q, scaled_model, clipped_model = _awq_models()
    w, x = np.asarray(MLP.layers[0].weight), np.asarray(X_AWQ)
    layer, clipped = scaled_model.layers[0], clipped_model.layers[0]
    multiplier = np.asarray(layer.input_transform.multiplier)
    assert_bitwise_equal(clipped.input_transform.multiplier, multiplier)

    chosen, errors = _assert_least_twin_error(multiplier, w, x, 32)
    assert chosen > 0 and errors[chosen] < errors[0]  # the scaling does better than RTN (alpha = 0) here

    # Without clipping, the weight is `W / m` (to XLA's float32 division) and computes `W x` on `m x`.
    scaled = np.asarray(layer.layer.weight)
    np.testing.assert_allclose(scaled, w / multiplier, rtol=2.5e-7, atol=0)
    np.testing.assert_allclose(
        np.asarray(_float_function(layer, X_AWQ[:4])), _np_linear(MLP.layers[0], X_AWQ[:4]), rtol=1e-5, atol=1e-5
    )

    # Clipping: each row and group is clipped to `ratio * max|w|` for the ratio of least twin error of the 10 tried.
    ratios = 1 - np.arange(10) / 20
    top = np.abs(scaled).reshape(32, 2, 32).max(axis=-1)
    got = np.abs(np.asarray(clipped.layer.weight)).reshape(32, 2, 32).max(axis=-1) / top
    index = np.argmin(np.abs(got[None] - ratios[:, None, None]), axis=0)
    np.testing.assert_allclose(got, ratios[index], rtol=1e-6)
    limit = np.repeat(np.abs(np.asarray(clipped.layer.weight)).reshape(32, 2, 32).max(axis=-1), 32, axis=1)
    assert_bitwise_equal(clipped.layer.weight, np.clip(scaled, -limit, limit))
    clip_errors = _awq_clip_errors(scaled, multiplier, x, 32, ratios)
    chosen_errors = np.take_along_axis(clip_errors, index[None], axis=0)[0]
    np.testing.assert_array_less(chosen_errors, clip_errors.min(axis=0) * (1 + 1e-4) + 1e-9)
    assert np.any(index > 0)  # some groups are clipped

    # The output error on the data is at most round-to-nearest's, and the fake-quant layers compute the twin's.
    final = _rtn(np.asarray(clipped.layer.weight), 32)
    rtn_error = _output_error(_rtn(w, 32), 1, w, x)
    scaled_error = _output_error(_rtn(scaled, 32), multiplier, w, x)
    clipped_error = _output_error(final, multiplier, w, x)
    assert clipped_error <= scaled_error <= rtn_error, (clipped_error, scaled_error, rtn_error)
    bias = np.asarray(MLP.layers[0].bias, np.float64)
    for model, weight, m in ((q, _rtn(w, 32), 1), (clipped_model, final, multiplier)):
        want = (x * m).astype(np.float32).astype(np.float64) @ weight.T.astype(np.float64) + bias
        np.testing.assert_allclose(np.asarray(_apply(model.layers[0], X_AWQ)), want, rtol=1e-5, atol=1e-5)


STACK = init(lambda k: LinearStack(32, 2, k), 3)
X_STACK = jnp.asarray(
    RNG.standard_normal((16, 32)).astype(np.float32) * np.exp(RNG.standard_normal(32)).astype(np.float32)
)


def _gelu(x):
    """`jax.nn.gelu` (its tanh approximation) in float64."""
    return 0.5 * x * (1 + np.tanh(np.sqrt(2 / np.pi) * (x + 0.044715 * x**3)))


@pytest.mark.slow
@few_rows
def test_awq_on_a_stack_searches_each_layer_of_it():
    """A scanned stack of two layers with int4 weights per row gets a multiplier per layer, shape (2, 32), each the
    twin's least-error choice on the inputs that the quantized stack feeds that layer, and the weights `W_i / m_i`."""
    q = eqx_quant.quantize(STACK, weights=W4_ROW, activations=None)
    done = eqx_quant.awq(q, [X_STACK], clip=False)
    multipliers = np.asarray(done.blocks.input_transform.multiplier)
    assert multipliers.shape == (2, 32)
    h = np.asarray(X_STACK, np.float64)
    for i in range(2):
        w = np.asarray(STACK.blocks.weight[i])
        _assert_least_twin_error(multipliers[i], w, h, None)
        np.testing.assert_allclose(np.asarray(done.blocks.layer.weight[i]), w / multipliers[i], rtol=2.5e-7, atol=0)
        h = _gelu(h @ _rtn(w, None).astype(np.float64).T + np.asarray(STACK.blocks.bias[i], np.float64))
    assert not np.allclose(multipliers[0], multipliers[1])


class _AwqBlock(eqx.Module):
    """`a` and `b` read one normalisation's output; `c` reads ReLU of `a`'s."""

    norm: eqx.nn.LayerNorm
    a: eqx.nn.Linear
    b: eqx.nn.Linear
    c: eqx.nn.Linear

    def __call__(self, x):
        h = self.norm(x)
        return self.c(jax.nn.relu(self.a(h))) + self.b(h)


AWQ_BLOCK = init(
    lambda k: _AwqBlock(eqx.nn.LayerNorm(64), *(eqx.nn.Linear(64, 64, key=j) for j in jax.random.split(k, 3))), 4
)


@pytest.mark.slow
@few_rows
def test_awq_folds_where_asked_with_one_search_per_shared_input(tmp_path):
    """`fold=True`: `a` and `b` (which read one LayerNorm's output) share one multiplier, the twin's of least summed
    error, folded into the norm's weight and bias; `c`'s own (the twin's on its inputs, ReLU of `a`'s outputs with
    `a`'s quantized weight) is folded into `a`'s rows and bias; no layer keeps a `ScaleInput`, the float function is
    unchanged (without clipping), and with clipping the converted model equals the fake-quant one bit for bit and
    exports, where the unfolded model's layers are refused."""
    q = eqx_quant.quantize(AWQ_BLOCK, **eqx_quant.recipe("w4a16_g32"))
    folded = eqx_quant.awq(q, AWQ_BATCHES, clip=False, fold=True)
    assert all(getattr(folded, p).input_transform is None for p in "abc")
    m = np.asarray(folded.norm.weight, np.float64) / np.asarray(AWQ_BLOCK.norm.weight)
    np.testing.assert_allclose(np.asarray(folded.norm.bias) / np.asarray(AWQ_BLOCK.norm.bias), m, rtol=2e-6)
    h = np.asarray(jax.vmap(AWQ_BLOCK.norm)(X_AWQ), np.float64)
    twins = [_awq_scaling_twin(np.asarray(getattr(AWQ_BLOCK, p).weight), h, 32) for p in "ab"]
    errors = twins[0][1] + twins[1][1]
    chosen = int(np.argmin(np.max(np.abs(twins[0][0] - m) / twins[0][0], axis=1)))
    np.testing.assert_allclose(m, twins[0][0][chosen], rtol=1e-5)
    assert errors[chosen] <= errors.min() * (1 + 1e-4), (chosen, errors)
    assert chosen != int(np.argmin(twins[0][1])) or chosen != int(np.argmin(twins[1][1]))  # a search of its own
    np.testing.assert_allclose(np.asarray(folded.b.layer.weight), np.asarray(AWQ_BLOCK.b.weight) / m, rtol=1e-6)
    w_a = np.asarray(AWQ_BLOCK.a.weight)
    x_c = np.maximum(h @ _rtn(w_a, 32).astype(np.float64).T + np.asarray(AWQ_BLOCK.a.bias, np.float64), 0)
    m_c = np.asarray(AWQ_BLOCK.c.weight, np.float64)[0] / np.asarray(folded.c.layer.weight, np.float64)[0]
    _assert_least_twin_error(m_c, np.asarray(AWQ_BLOCK.c.weight), x_c, 32)
    np.testing.assert_allclose(np.asarray(folded.a.layer.weight), w_a / m * m_c[:, None], rtol=1e-5)
    np.testing.assert_allclose(np.asarray(folded.a.layer.bias), np.asarray(AWQ_BLOCK.a.bias) * m_c, rtol=1e-5)
    restored = np.asarray(_apply(eqx_quant.float_model(folded), X_AWQ))
    np.testing.assert_allclose(restored, np.asarray(_apply(AWQ_BLOCK, X_AWQ)), rtol=1e-5, atol=1e-5)
    clipped = eqx_quant.awq(q, AWQ_BATCHES, fold=True)
    converted = eqx_quant.convert(clipped)
    _assert_converted_matches(clipped, converted, X_AWQ, eager=False)
    eqx_quant.export_safetensors(tmp_path / "folded.safetensors", converted)
    assert (tmp_path / "folded.safetensors").stat().st_size > 0
    unfolded = eqx_quant.convert(eqx_quant.awq(q, AWQ_BATCHES))
    with pytest.raises(ValueError, match="'a' has the input transform ScaleInput"):
        eqx_quant.export_safetensors(tmp_path / "unfolded.safetensors", unfolded)


class _GateUp(eqx.Module):
    """A fused gate-and-up projection (`gate_up`: the gate's rows, then the up projection's), SiLU gate, `down`."""

    gate_up: eqx.nn.Linear
    down: eqx.nn.Linear

    def __call__(self, x):
        g, u = jnp.split(self.gate_up(x), 2)
        return self.down(jax.nn.silu(g) * u)


@pytest.mark.slow
@few_rows
def test_awq_folds_into_the_up_half_of_a_fused_gate_and_up_projection(tmp_path):
    """`fold=True`: `down`'s multiplier (the twin's of least error on its inputs, from the quantized `gate_up`) is
    folded into the up rows of `gate_up` alone; the gate's rows stay bit for bit, the float function is unchanged,
    and with clipping the converted model equals the fake-quant one and exports."""
    model = init(lambda k: _GateUp(eqx.nn.Linear(64, 128, key=k), eqx.nn.Linear(64, 64, key=jax.random.split(k)[1])), 5)
    q = eqx_quant.quantize(model, **eqx_quant.recipe("w4a16_g32"))
    folded = eqx_quant.awq(q, AWQ_BATCHES, clip=False, fold=True, where=lambda path, layer: path == "down")
    assert folded.down.input_transform is None
    w = np.asarray(model.gate_up.weight)
    assert_bitwise_equal(folded.gate_up.layer.weight[:64], model.gate_up.weight[:64])
    assert_bitwise_equal(folded.gate_up.layer.bias[:64], model.gate_up.bias[:64])
    h = np.asarray(X_AWQ, np.float64) @ _rtn(w, 32).astype(np.float64).T + np.asarray(model.gate_up.bias, np.float64)
    x_down = h[:, :64] / (1 + np.exp(-h[:, :64])) * h[:, 64:]
    m = np.asarray(model.down.weight, np.float64)[0] / np.asarray(folded.down.layer.weight, np.float64)[0]
    _assert_least_twin_error(m, np.asarray(model.down.weight), x_down, 32)
    np.testing.assert_allclose(np.asarray(folded.gate_up.layer.weight[64:]), w[64:] * m[:, None], rtol=1e-5)
    np.testing.assert_allclose(np.asarray(folded.gate_up.layer.bias[64:]), np.asarray(model.gate_up.bias[64:]) * m,
                               rtol=1e-5)  # fmt: skip
    restored = np.asarray(_apply(eqx_quant.float_model(folded), X_AWQ))
    np.testing.assert_allclose(restored, np.asarray(_apply(model, X_AWQ)), rtol=1e-5, atol=1e-5)
    clipped = eqx_quant.awq(q, AWQ_BATCHES, fold="only")
    converted = eqx_quant.convert(clipped)
    _assert_converted_matches(clipped, converted, X_AWQ, eager=False)
    eqx_quant.export_safetensors(tmp_path / "folded.safetensors", converted)
    assert (tmp_path / "folded.safetensors").stat().st_size > 0


@pytest.mark.slow
@few_rows
def test_awq_fold_only_clips_the_layers_that_do_not_fold(tmp_path):
    """`fold="only"`: `fc1` (after the norm) is scaled, its factor folded; `fc2` (after GELU) is only clipped, with
    no multiplier: each row and group at the ratio of least twin error on `fc2`'s inputs (GELU of `fc1`'s outputs
    with `fc1`'s quantized weight). No layer keeps a transform and the converted model exports. With `clip=False`
    and no layer that folds, it is a ValueError."""
    model = init(
        lambda k: _NormGelu(eqx.nn.LayerNorm(64), *(eqx.nn.Linear(64, 64, key=j) for j in jax.random.split(k))), 5
    )
    q = eqx_quant.quantize(model, **eqx_quant.recipe("w4a16_g32"))
    only = eqx_quant.awq(q, AWQ_BATCHES, fold="only")
    assert only.fc1.input_transform is None and only.fc2.input_transform is None
    assert not np.array_equal(np.asarray(only.norm.weight), np.asarray(model.norm.weight))
    w_2, clipped = np.asarray(model.fc2.weight), np.asarray(only.fc2.layer.weight)
    top = np.abs(w_2).reshape(64, 2, 32).max(axis=-1)
    got = np.abs(clipped).reshape(64, 2, 32).max(axis=-1) / top
    ratios = 1 - np.arange(10) / 20
    index = np.argmin(np.abs(got[None] - ratios[:, None, None]), axis=0)
    np.testing.assert_allclose(got, ratios[index], rtol=1e-6)
    limit = np.repeat(np.abs(clipped).reshape(64, 2, 32).max(axis=-1), 32, axis=1)
    assert_bitwise_equal(only.fc2.layer.weight, np.clip(w_2, -limit, limit))
    h = np.asarray(jax.vmap(model.norm)(X_AWQ), np.float64)
    x_2 = _gelu(
        h @ _rtn(np.asarray(model.fc1.weight), 32).astype(np.float64).T + np.asarray(model.fc1.bias, np.float64)
    )
    errors = _awq_clip_errors(w_2, np.ones(64), x_2, 32, ratios)
    chosen = np.take_along_axis(errors, index[None], axis=0)[0]
    np.testing.assert_array_less(chosen, errors.min(axis=0) * (1 + 1e-4) + 1e-9)
    assert np.any(index > 0)
    eqx_quant.export_safetensors(tmp_path / "only.safetensors", eqx_quant.convert(only))
    fc2 = lambda path, layer: path == "fc2"  # noqa: E731
    with pytest.raises(ValueError, match=r"None of the chosen layers \['fc2'\] .* `awq\(..., fold='only'\)`"):
        eqx_quant.awq(q, AWQ_BATCHES, fold="only", clip=False, where=fc2)


class _TwoViews(eqx.Module):
    fc1: eqx.nn.Linear
    b: eqx.nn.Linear
    c: eqx.nn.Linear

    def __call__(self, x):
        h = self.fc1(x)
        return self.b(jax.nn.relu(h)) + self.c(h)


def test_layers_reading_two_views_of_one_output_share_a_fold_in_smoothquant_only():
    """`b` reads ReLU of `fc1`'s output and `c` the output itself. SmoothQuant folds both into `fc1`'s rows with one
    factor (from the larger of their channels' maxima); AWQ, whose search needs one set of statistics per factor,
    gives each its own multiplier, the one `fold=False` gives it, whatever the order of the layers."""
    model = init(lambda k: _TwoViews(*(eqx.nn.Linear(16, 16, key=j) for j in jax.random.split(k, 3))), 11)
    smoothed = eqx_quant.smoothquant(_w8a8(model), [X_PAIR])
    assert smoothed.b.input_transform is None and smoothed.c.input_transform is None
    rows = np.asarray(smoothed.fc1.layer.weight, np.float64) / (
        np.asarray(model.fc1.weight) * np.asarray(smoothed.fc1.input_transform.multiplier)[None, :] ** -1
    )
    for name in ("b", "c"):
        columns = np.asarray(getattr(smoothed, name).layer.weight, np.float64) / np.asarray(getattr(model, name).weight)
        np.testing.assert_allclose(columns * rows[:, :1].T, 1.0, rtol=4e-6)
    w4 = eqx_quant.quantize(model, **eqx_quant.recipe("w4a16_g32", group_size=8))
    folded, separate = eqx_quant.awq(w4, [X_PAIR], fold=True), eqx_quant.awq(w4, [X_PAIR])
    for name in ("b", "c"):
        got = getattr(folded, name).input_transform.multiplier
        assert_bitwise_equal(got, getattr(separate, name).input_transform.multiplier)


@few_rows
def test_awq_errors():
    """ValueErrors naming the argument or the layer: a grid of fewer than two `alpha`s or two clipping ratios (which
    would do nothing), `max_shrink` outside [0, 1), a weight quantizer with a scale per input column, which `awq`
    cannot search, and a layer without a weight quantizer chosen by `where`."""
    q = eqx_quant.quantize(MLP, **eqx_quant.recipe("w4a16_g32"))
    for kwargs, match in (
        (dict(grid=0), "grid"),
        (dict(grid=1), "grid"),  # only alpha = 0: round to nearest
        (dict(clip_grid=0), "clip_grid"),
        (dict(clip_grid=1), "clip_grid"),  # only the ratio 1: no clipping
        (dict(max_shrink=0.0), "max_shrink"),
        (dict(max_shrink=1.0), "max_shrink"),
        (dict(max_shrink=-0.1), "max_shrink"),
    ):
        with pytest.raises(ValueError, match=match):
            eqx_quant.awq(q, [X_AWQ], **kwargs)
    columns = eqx_quant.quantize(MLP, weights=eqx_quant.DynamicFakeQuant(4, axis=1), activations=None)
    with pytest.raises(ValueError, match=r"(?s)'layers\.0'.*`awq` needs"):
        eqx_quant.awq(columns, [X_AWQ])
    inputs_only = eqx_quant.quantize(MLP, weights=None)
    with pytest.raises(ValueError, match=r"'layers\.0' is not a layer with a weight quantizer"):
        eqx_quant.awq(inputs_only, [X_AWQ], where=lambda path, layer: True)
    eqx_quant.awq(q, [X_AWQ], clip=False, max_shrink=0.0)  # no clipping asked for: the ratios do not matter


# --- rotate ---------------------------------------------------------------------------------------------------------


@functools.cache
def _rotated():
    return eqx_quant.rotate(Q8, key=jax.random.key(5))


@pytest.mark.slow
def test_rotate_matches_the_numpy_twin_and_keeps_the_float_function():
    """Each layer's signs are `rademacher(fold_in(key, i))`, its weight `W Tᵀ` for the twin's `T`; the float
    function and `float_model` are unchanged up to rounding; another key gives other signs."""
    key = jax.random.key(5)
    rotated = _rotated()
    for i, (layer, original) in enumerate(zip(rotated.layers, MLP.layers, strict=True)):
        signs = layer.input_transform.signs
        n = original.in_features
        assert_bitwise_equal(signs, jax.random.rademacher(jax.random.fold_in(key, i), (n,), dtype=jnp.int8))
        t = _rotation(signs)
        w = np.asarray(original.weight, np.float64)
        np.testing.assert_allclose(np.asarray(layer.layer.weight), w @ t.T, rtol=0, atol=1e-6)
        v = RNG.standard_normal((4, n)).astype(np.float32)
        np.testing.assert_allclose(np.asarray(_float_function(layer, v)), _np_linear(original, v), rtol=0, atol=1e-5)
    restored = eqx.filter_jit(eqx_quant.float_model)(rotated)  # eagerly, each butterfly stage compiles alone
    for a, b in zip(restored.layers, MLP.layers, strict=True):
        np.testing.assert_allclose(np.asarray(a.weight), np.asarray(b.weight), rtol=0, atol=1e-6)
        assert_bitwise_equal(a.bias, b.bias)
    other = eqx_quant.rotate(Q8, key=jax.random.key(6))
    assert np.any(
        np.asarray(other.layers[0].input_transform.signs) != np.asarray(rotated.layers[0].input_transform.signs)
    )


@pytest.mark.slow
def test_rotate_lowers_the_error_of_4_bit_inputs_with_an_outlier():
    """4-bit per-tensor inputs and an outlier input channel: the rotation spreads the outlier, and the output error
    against the float model drops."""
    q = eqx_quant.quantize(
        MLP, weights=eqx_quant.DynamicFakeQuant(8, axis=0), activations=eqx_quant.DynamicFakeQuant(4)
    )
    rotated = eqx_quant.rotate(q, key=jax.random.key(0))
    float_out = _apply(MLP, X_ROTATE)
    error_plain, error_rotated = _rms(_apply(q, X_ROTATE), float_out), _rms(_apply(rotated, X_ROTATE), float_out)
    assert error_rotated < 0.75 * error_plain, (error_rotated, error_plain)


@pytest.mark.slow
def test_rotate_a_decoder_lm_with_stacked_layers():
    """Every linear layer of the scanned decoder is rotated, with signs of its own for each layer of the stack and
    the weights `W Tᵀ` of the twin, which `float_model` restores; the outputs stay within 2% of the float model's."""
    lm = init(lambda k: DecoderLM(k), 4)
    q = eqx_quant.quantize(lm, **eqx_quant.recipe("w8a8"))
    rotated = eqx_quant.rotate(q, key=jax.random.key(1))
    names = ("qkv", "out", "gate", "up", "down")
    signs = [getattr(rotated.blocks, name).input_transform.signs for name in names]
    for name, s in zip(names, signs, strict=True):
        n = getattr(lm.blocks, name).in_features
        assert s.shape == (2, n) and s.dtype == jnp.int8, name
        assert np.any(np.asarray(s[0]) != np.asarray(s[1])), name
        t = [_rotation(s[i]) for i in range(2)]
        w = np.asarray(getattr(lm.blocks, name).weight, np.float64)
        want = np.stack([w[i] @ t[i].T for i in range(2)])
        np.testing.assert_allclose(np.asarray(getattr(rotated.blocks, name).layer.weight), want, rtol=0, atol=1e-6)
    assert np.any(np.asarray(signs[2]) != np.asarray(signs[3]))  # gate and up: two draws
    restored = eqx.filter_jit(eqx_quant.float_model)(rotated)
    for name in names:
        w = np.asarray(getattr(lm.blocks, name).weight)
        np.testing.assert_allclose(np.asarray(getattr(restored.blocks, name).weight), w, rtol=0, atol=1e-6)
    tokens = jnp.asarray(RNG.integers(0, 13, size=(4, 8)))
    float_out = np.asarray(_apply(lm, tokens))
    assert _rms(_apply(rotated, tokens), float_out) < 0.02 * np.sqrt(np.mean(float_out**2))


def test_rotate_errors():
    """A layer of 28 input features (no Hadamard matrix) is a ValueError naming it and `in_features=28`; a layer
    rotated twice is one too."""
    model = eqx_quant.quantize(init(lambda k: eqx.nn.MLP(28, 4, 32, 1, key=k), 2), **eqx_quant.recipe("w8a8"))
    with pytest.raises(ValueError, match=r"'layers\.0' has in_features=28"):
        eqx_quant.rotate(model, key=jax.random.key(0))
    rotated = eqx_quant.rotate(model, key=jax.random.key(0), where=lambda path, layer: path == "layers.1")
    assert rotated.layers[0].input_transform is None
    with pytest.raises(ValueError, match=r"'layers\.1' already has the input transform RotateInput"):
        eqx_quant.rotate(rotated, key=jax.random.key(0), where=lambda path, layer: path == "layers.1")


# --- workflows: convert, save and load ------------------------------------------------------------------------------


def _assert_converted_matches(fake, converted, x, eager=True):
    """The converted model computes the fake-quant model's bits under `eqx.filter_jit` (and eagerly)."""
    want = _apply(fake, x)
    assert np.all(np.isfinite(np.asarray(want)))
    assert_bitwise_equal(_apply(converted, x), want)
    if eager:
        assert_bitwise_equal(_eager(converted, x), _eager(fake, x))


@functools.cache
def _converted_smoothed():
    return eqx_quant.convert(_calibrated(True))


@functools.cache
def _rotated_stack():
    """The stack quantized W4A8 per group of 32, rotated, then GPTQ-quantized, and its converted model."""
    q = eqx_quant.quantize(STACK, **eqx_quant.recipe("w4a8_g32"))
    fake = eqx_quant.gptq(eqx_quant.rotate(q, key=jax.random.key(2)), [X_STACK])
    return fake, eqx_quant.convert(fake)


@pytest.mark.slow
def test_smoothquant_calibrate_convert_agree_bit_for_bit():
    """smoothquant → calibrate → convert: the converted layers keep the multipliers and compute the same bits."""
    fake, converted = _calibrated(True), _converted_smoothed()
    for a, b in zip(fake.layers, converted.layers, strict=True):
        assert isinstance(b, eqx_quant.nn.ConvertedLinear)
        assert_bitwise_equal(b.input_transform.multiplier, a.input_transform.multiplier)
    _assert_converted_matches(fake, converted, X_SMOOTH)


@pytest.mark.slow
@few_rows
def test_smoothquant_minmax_inputs_and_gptq_on_quantized_inputs_convert_bit_for_bit():
    """smoothquant → calibrate(method="minmax") → gptq(quantized_inputs=True) → convert: each layer's input quantizer
    rounds its smoothed input on an asymmetric grid as the NumPy twin does (the ReLU-fed second layer's grid starts at
    0: zero point -128), and the converted layers compute the fake-quant model's bits."""
    calibrated = eqx_quant.calibrate(_smoothed(), [X_SMOOTH], method="minmax")
    fake = eqx_quant.gptq(calibrated, SMOOTH_BATCHES, quantized_inputs=True)
    first, second = fake.layers
    assert int(first.input_quant.zero_point) != 0 and int(second.input_quant.zero_point) == -128
    hidden = np.maximum(np.asarray(_apply(first, X_SMOOTH)), 0)
    for layer, x in ((first, np.asarray(X_SMOOTH)), (second, hidden)):
        q = layer.input_quant
        smoothed = x * np.asarray(layer.input_transform.multiplier)
        want = reference_fake_quant(smoothed, float(q.scale), -128, 127, float(q.zero_point))
        assert_bitwise_equal(jax.vmap(q)(jnp.asarray(smoothed)), want)
        assert np.max(np.abs(want - smoothed)) <= 0.5 * float(q.scale) * (1 + 1e-6)  # the grid clips no input
    converted = eqx_quant.convert(fake)
    _assert_converted_matches(fake, converted, X_SMOOTH)


@pytest.mark.slow
@few_rows
def test_rotate_gptq_convert_agree_bit_for_bit():
    """rotate → gptq → convert on a scanned stack: GPTQ quantizes the rotated weights, the converted model keeps the
    signs and computes the fake-quant model's bits, and both stay close to the float stack."""
    fake, converted = _rotated_stack()
    assert isinstance(fake.blocks.weight_quant, eqx_quant.LearnedFakeQuant)
    assert fake.blocks.input_transform.signs.shape == (2, 32)
    assert_bitwise_equal(converted.blocks.input_transform.signs, fake.blocks.input_transform.signs)
    _assert_converted_matches(fake, converted, X_STACK, eager=False)
    float_out = np.asarray(_apply(STACK, X_STACK))
    assert _rms(_apply(fake, X_STACK), float_out) < 0.1 * np.sqrt(np.mean(float_out**2))


@pytest.mark.slow
@few_rows
def test_awq_convert_agree_bit_for_bit():
    """awq → convert on weight-only int4 per group: the converted layers keep the multiplier and compute the
    fake-quant model's bits."""
    _, _, fake = _awq_models()
    converted = eqx_quant.convert(fake)
    assert_bitwise_equal(converted.layers[0].input_transform.multiplier, fake.layers[0].input_transform.multiplier)
    _assert_converted_matches(fake, converted, X_AWQ, eager=False)


@pytest.mark.slow
@few_rows
def test_save_and_load_keep_the_transforms(tmp_path):
    """`save` then `load`, into the float model's `filter_eval_shape` skeleton and into the model itself, of a
    fake-quant smoothed MLP and a converted rotated stack: the same transforms and the same output bits."""
    cases = (
        (_calibrated(True), eqx.filter_eval_shape(lambda: MLP), X_SMOOTH, lambda m: m.layers[0].input_transform),
        (_rotated_stack()[1], eqx.filter_eval_shape(lambda: STACK), X_STACK, lambda m: m.blocks.input_transform),
    )
    for i, (model, skeleton, x, transform) in enumerate(cases):
        path = tmp_path / f"model{i}.eqx"
        eqx_quant.save(path, model)
        want = _apply(model, x)
        for like in (skeleton, model):
            loaded = eqx_quant.load(path, like)
            assert type(transform(loaded)) is type(transform(model))
            for a, b in zip(jax.tree.leaves(transform(loaded)), jax.tree.leaves(transform(model)), strict=True):
                assert_bitwise_equal(a, b)
            assert_bitwise_equal(_apply(loaded, x), want)


# --- training and export --------------------------------------------------------------------------------------------


def test_gradients_and_trainable_leave_the_transforms_alone():
    """Through a W8A8 model with a rotated first layer and a smoothed second one, the weights get finite, non-zero
    gradients, the multiplier a zero one and the signs none; `trainable` selects the weights and biases and neither
    transform array."""
    model = eqx_quant.rotate(
        _smoothed(where=_second), key=jax.random.key(3), where=lambda path, layer: path == "layers.0"
    )
    assert isinstance(model.layers[0].input_transform, RotateInput)
    x, y = X_ROTATE[:8], jnp.asarray(RNG.standard_normal((8, 8)).astype(np.float32))

    @eqx.filter_jit
    @eqx.filter_grad
    def grad(model):
        return jnp.mean((jax.vmap(model)(x) - y) ** 2)

    g, spec = grad(model), eqx_quant.trainable(model)
    for g_layer, s_layer in zip(g.layers, spec.layers, strict=True):
        weight_grad = np.asarray(g_layer.layer.weight)
        assert np.all(np.isfinite(weight_grad)) and np.any(weight_grad != 0)
        assert s_layer.layer.weight is True and s_layer.layer.bias is True
    assert g.layers[0].input_transform.signs is None
    assert spec.layers[0].input_transform.signs is False
    np.testing.assert_array_equal(np.asarray(g.layers[1].input_transform.multiplier), 0)
    assert spec.layers[1].input_transform.multiplier is False


def test_exporters_refuse_input_transforms(tmp_path):
    """safetensors, GGUF and compressed-tensors exports of a converted model with input transforms (smoothed on its
    second layer, rotated) are ValueErrors naming the layer and its input transform, and write nothing."""
    for model, name in ((_smoothed(where=_second), "layers.1"), (_rotated(), "layers.0")):
        model = eqx_quant.convert(model)
        assert isinstance(model.layers[1], eqx_quant.nn.ConvertedLinear)
        match = f"'{re.escape(name)}' has the input transform"
        with pytest.raises(ValueError, match=match):
            eqx_quant.export_safetensors(tmp_path / "model.safetensors", model)
        with pytest.raises(ValueError, match=match):
            eqx_quant.export_gguf(tmp_path / "model.gguf", model)
        with pytest.raises(ValueError, match=match):
            eqx_quant.export_compressed_tensors(tmp_path / "checkpoint", model)
    assert not list(tmp_path.iterdir())


def test_summary_names_the_transform_and_counts_its_bytes():
    """`summary` puts the transform before the input quantizer, and counts its arrays in the stored bytes: one int8
    sign per input feature for a rotation, one float32 factor for a smoothing."""
    mlp = init(lambda k: eqx.nn.MLP(16, 4, 32, 1, key=k), 3)
    plain = eqx_quant.quantize(mlp, **eqx_quant.recipe("w8a8"))
    rotated = eqx_quant.rotate(plain, key=jax.random.key(0))
    one = lambda path, layer: path == "layers.1"  # noqa: E731
    smoothed = eqx_quant.smoothquant(plain, [jnp.ones((4, 16))], where=one, fold=False)
    base = [row.stored_bytes for row in eqx_quant.summary(plain).rows]
    rows = eqx_quant.summary(rotated).rows
    assert [row.input for row in rows] == ["RotateInput, then int8 dynamic, per tensor"] * 2
    assert [row.stored_bytes for row in rows] == [base[0] + 16, base[1] + 32]
    rows = eqx_quant.summary(eqx_quant.convert(smoothed)).rows
    assert rows[0].input == "int8 dynamic, per tensor" and rows[0].stored_bytes == base[0]
    assert rows[1].input.startswith("ScaleInput, then ") and rows[1].stored_bytes == base[1] + 4 * 32


class _Tied(eqx.Module):
    """Two linear layers whose weights an `eqx.nn.Shared` ties, and a third of its own."""

    tied: eqx.nn.Shared
    own: eqx.nn.Linear

    def __init__(self, key):
        k1, k2, k3 = jax.random.split(key, 3)
        pair = (eqx.nn.Linear(16, 16, key=k1), eqx.nn.Linear(16, 16, key=k2))
        self.tied = eqx.nn.Shared(pair, where=lambda p: p[1].weight, get=lambda p: p[0].weight)
        self.own = eqx.nn.Linear(16, 16, key=k3)

    def __call__(self, x):
        a, b = self.tied()
        return self.own(b(jnp.tanh(a(x))))


def test_layers_inside_a_tie_are_left_alone_or_refused():
    """The owner of a tied weight would pass its transformed weight to the other side of the tie, which has no
    transform: the algorithms leave every layer inside an `eqx.nn.Shared` alone by default, and refuse one that
    `where` chooses."""
    model = eqx_quant.quantize(init(_Tied, 5), **eqx_quant.recipe("w8a8"))
    x = jnp.asarray(RNG.standard_normal((8, 16)).astype(np.float32))
    rotated = eqx_quant.rotate(model, key=jax.random.key(0))
    assert rotated.own.input_transform is not None
    assert all(layer.input_transform is None for layer in rotated.tied.pytree)
    smoothed = eqx_quant.smoothquant(model, [x])
    assert all(layer.input_transform is None for layer in smoothed.tied.pytree)
    reference = jax.vmap(eqx_quant.float_model(model))(x)
    np.testing.assert_allclose(jax.vmap(eqx_quant.float_model(smoothed))(x), reference, rtol=1e-4, atol=1e-5)
    owner = lambda path, layer: path == "tied.pytree.0"  # noqa: E731
    for call in (
        lambda: eqx_quant.rotate(model, key=jax.random.key(0), where=owner),
        lambda: eqx_quant.smoothquant(model, [x], where=owner),
        lambda: eqx_quant.awq(model, [x], where=owner),
    ):
        with pytest.raises(ValueError, match=r"'tied\.pytree\.0' is inside an `eqx.nn.Shared`"):
            call()


def test_a_layer_without_what_the_algorithm_needs_is_refused_by_where():
    float_inputs = eqx_quant.quantize(MLP, activations=None)
    with pytest.raises(ValueError, match=r"'layers\.0' is not a layer with an input quantizer"):
        eqx_quant.smoothquant(float_inputs, SMOOTH_BATCHES, where=lambda path, layer: True)
    nothing = eqx_quant.quantize(MLP, weights=None, activations=None)
    with pytest.raises(ValueError, match=r"'layers\.0' is not a layer with a quantizer"):
        eqx_quant.rotate(nothing, key=jax.random.key(0), where=lambda path, layer: True)


def test_transforms_refuse_values_that_are_not_invertible_or_not_signs():
    with pytest.raises(ValueError, match="positive and finite"):
        ScaleInput(jnp.asarray([1.0, 0.0, 2.0]))
    with pytest.raises(ValueError, match="positive and finite"):
        ScaleInput(jnp.asarray([1.0, jnp.nan]))
    with pytest.raises(ValueError, match="only -1 and 1"):
        RotateInput(jnp.asarray([3, 0, 1, 1], jnp.int8))


@pytest.mark.parametrize("name", slow_unless(["mxfp4"], ["nvfp4", "mxfp4"]))
def test_awq_on_block_formats_never_raises_the_layers_error(name):
    """On MX and NVFP4 weights, AWQ's scaling is never worse than round to nearest on the layer's output error
    (computed here in float64, from the effective weight against the float one), and scaling and clipping together
    are better. Clipping minimises each group's share of the error (AWQ's objective, which leaves out the terms
    between groups); on NVFP4, where a tensor scale ties the groups together, it is kept only where the whole
    layer's error does not grow."""
    mlp = init(lambda k: eqx.nn.MLP(64, 16, 64, 1, key=k), 7)
    rng = np.random.default_rng(8)
    x = (rng.standard_normal((512, 64)) * np.exp(2 * rng.standard_normal(64))[None, :]).astype(np.float32)
    qmodel = eqx_quant.quantize(mlp, **eqx_quant.recipe(name))
    first = lambda path, layer: path == "layers.0"  # noqa: E731
    rtn = np.asarray(qmodel.layers[0].weight_quant(qmodel.layers[0].layer.weight), np.float64)
    errors = [np.sum((x.astype(np.float64) @ (rtn - np.asarray(mlp.layers[0].weight, np.float64)).T) ** 2)]
    for clip in (False, True):
        layer = eqx_quant.awq(qmodel, [jnp.asarray(x)], clip=clip, where=first).layers[0]
        effective = np.asarray(layer.weight_quant(layer.layer.weight), np.float64)
        effective = effective * np.asarray(layer.input_transform.multiplier, np.float64)[None, :]
        errors.append(
            np.sum((x.astype(np.float64) @ (effective - np.asarray(mlp.layers[0].weight, np.float64)).T) ** 2)
        )
    assert errors[1] <= errors[0] * (1 + 1e-5) and errors[2] < errors[0], errors
    if name == "nvfp4":
        assert errors[2] <= errors[1] * (1 + 1e-5), errors


def test_channel_statistics_leave_non_finite_entries_out_of_the_means():
    """The channels' statistics (SmoothQuant's maxima, AWQ's means) over data with NaN and infinite entries: the
    maxima and means of the finite entries of each channel, as NumPy's `nanmax` and `nanmean` give them."""
    from eqx_quant._observe import fold

    model = eqx_quant.quantize(MLP, **eqx_quant.recipe("w8a8"))
    data = np.array(X_SMOOTH)
    data[3, 1], data[5, 1], data[7, 2] = np.nan, np.inf, -np.inf
    first = [("layers.0", model.layers[0])]
    record = fold(model, first, [jnp.asarray(data[:16]), jnp.asarray(data[16:])], False, "channels")["layers.0"][0]
    finite = np.where(np.isfinite(data), np.abs(data), np.nan)
    np.testing.assert_allclose(record["channel_absmax"], np.nanmax(finite, axis=0), rtol=0)
    np.testing.assert_allclose(record["channel_abssum"] / record["count"], np.nanmean(finite, axis=0), rtol=1e-6)
    np.testing.assert_array_equal(record["count"], np.sum(np.isfinite(data), axis=0))
    assert record["nonfinite"] == 3


class _ConvThenLinear(eqx.Module):
    conv: eqx.nn.Conv1d
    fc: eqx.nn.Linear

    def __call__(self, x):  # x: (2 channels, 8 steps)
        return self.fc(self.conv(x).reshape(-1))


@pytest.mark.slow
@few_rows
def test_transforms_and_solvers_name_the_convolutions_they_leave_alone():
    """The algorithms transform linear layers only: choosing layers by default in a model with quantized
    convolutions, each warns naming them (and still transforms the linear layers); with `where`, none warns, and a
    `where` that chooses a convolution is an error."""
    model = init(lambda k: _ConvThenLinear(eqx.nn.Conv1d(2, 2, 3, key=k), eqx.nn.Linear(12, 16, key=k)), 5)
    quantized = eqx_quant.quantize(model, **eqx_quant.recipe("w4a16_g32", group_size=4))
    linear = lambda path, layer: path == "fc"  # noqa: E731
    key = jax.random.key(0)
    with pytest.warns(UserWarning, match=r"^`rotate` does not transform convolutions: .* \['conv'\] are left"):
        rotated = eqx_quant.rotate(quantized, key=key)
    assert isinstance(rotated.fc.input_transform, RotateInput) and eqx.tree_equal(rotated.conv, quantized.conv)
    assert_bitwise_equal(eqx_quant.rotate(quantized, key=key, where=linear).fc.layer.weight, rotated.fc.layer.weight)
    x = jnp.asarray(NORMAL[:4, :16].reshape(4, 2, 8))
    with pytest.warns(UserWarning, match=r"^`gptq` does not transform convolutions: .* \['conv'\] are left"):
        solved = eqx_quant.gptq(quantized, [x])
    assert eqx.tree_equal(solved.conv, quantized.conv)
    assert_bitwise_equal(eqx_quant.gptq(quantized, [x], where=linear).fc.layer.weight, solved.fc.layer.weight)
    # A `where` that chooses a convolution is an error naming it, as for a traced convolution.
    chooses = r"^`where` chooses the convolutions \['conv'\], which `{}` does not transform"
    # A predicate written for linear layers (it reads `in_features`) chooses no convolution.
    assert_bitwise_equal(
        eqx_quant.gptq(quantized, [x], where=lambda path, layer: layer.layer.in_features == 12).fc.layer.weight,
        solved.fc.layer.weight,
    )
    for where in ("conv", "conv|fc"):
        with pytest.raises(ValueError, match=chooses.format("rotate")):
            eqx_quant.rotate(quantized, key=key, where=where)
        with pytest.raises(ValueError, match=chooses.format("gptq")):
            eqx_quant.gptq(quantized, [x], where=where)
