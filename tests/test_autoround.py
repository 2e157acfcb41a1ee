"""`eqx_quant.autoround`: learned rounding and clipping by signed gradient descent, checked against NumPy round to
nearest, the layer's output error computed in float64, the layers' Hessians collected by hand, and the converted
model."""

import equinox as eqx
import gguf
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import eqx_quant
from eqx_quant._autoround import autoround_solve
from eqx_quant._gptq_model import _solve as _gptq_solve

from .helpers import assert_bitwise_equal, init, slow_unless
from .models import LinearStack


def correlated(seed: int, count: int, n: int) -> np.ndarray:
    """Inputs whose `n` features mix a few latent factors, plus a little noise: a Hessian far from diagonal."""
    rng = np.random.default_rng(seed)
    return (rng.normal(size=(count, 4)) @ rng.normal(size=(4, n)) + 0.1 * rng.normal(size=(count, n))).astype(
        np.float32
    )


def output_error(weight, reference, hessian) -> float:
    """`tr((W - W_ref) H (W - W_ref)ᵀ)` in float64."""
    d = np.asarray(weight, np.float64) - np.asarray(reference, np.float64)
    return float(np.sum((d @ np.asarray(hessian, np.float64)) * d))


W = np.random.default_rng(0).normal(size=(8, 32)).astype(np.float32)
X = correlated(1, 256, 32)
H = X.T.astype(np.float64) @ X


def numpy_grid(name: str) -> np.ndarray:
    """Every finite grid point of a format, ascending: the integers of an integer grid, or every finite value of
    the float element type (from `ml_dtypes`)."""
    ints = {"int8": (-127, 127), "int4": (-8, 7), "int3": (-4, 3), "int2": (-2, 1), "q4_0": (-8, 7)}
    if name in ints:
        return np.arange(ints[name][0], ints[name][1] + 1, dtype=np.float64)
    element = {"mxfp4": "float4_e2m1fn", "nvfp4": "float4_e2m1fn", "mxfp8_e4m3": "float8_e4m3fn"}.get(name, name)
    dtype = getattr(ml_dtypes, element)
    values = np.arange(2 ** ml_dtypes.finfo(dtype).bits, dtype=np.uint16).astype(np.uint8).view(dtype)
    values = values.astype(np.float64)
    return np.unique(values[np.isfinite(values)])


def numpy_nearest(name: str, weight: np.ndarray, g: int) -> tuple[np.ndarray, np.ndarray]:
    """Round to nearest on a block format's own scales, computed in NumPy: `(W̃, scales)`, the scales as the format
    holds them (per row and block). MX: `2**(floor(log2 max|w|) - e_max)`; NVFP4: the tensor scale `max|W| / (448 *
    6)` and `float8_e4m3fn` block scales `max|w| / (6 t)`; GGML: llama.cpp's reference quantizer."""
    w = weight.reshape(weight.shape[0], -1, g)
    top = np.max(np.abs(w), axis=-1, keepdims=True)
    grid = numpy_grid(name)
    if name == "q4_0":
        values = gguf.quants.dequantize(gguf.quants.quantize(weight, gguf.GGMLQuantizationType.Q4_0), 2)
        return values.reshape(weight.shape).astype(np.float32), np.empty(0)
    if name == "mxfp4":
        s = np.ldexp(np.float32(1), np.frexp(top)[1] - 1 - 2).astype(np.float32)  # e_max of FP4 is 2
        effective = s
    else:  # nvfp4
        t = np.float32(np.max(top)) / np.float32(448 * 6)
        s = np.clip(top / (np.float32(6) * t), 0, 448).astype(ml_dtypes.float8_e4m3fn).astype(np.float32)
        effective = s * t
    levels = np.clip(w * (np.float32(1) / effective), grid[0], grid[-1]).astype(ml_dtypes.float4_e2m1fn)
    return (levels.astype(np.float32) * effective).reshape(weight.shape), s[..., 0]


@pytest.mark.parametrize(
    ("name", "group_size"), [("int4", None), ("int4", 16), ("float4_e2m1fn", 16), ("float8_e4m3fn", None)]
)
def test_a_vanishing_step_is_round_to_nearest_with_float32_scales(name, group_size):
    """With a learning rate too small to move any offset past a rounding boundary, the result is round to nearest
    with absmax scales: the NumPy twin's scales, and its levels (an integer rounding, or an `ml_dtypes` cast)."""
    fmt = eqx_quant.format_named(name)
    weight, scales, tensor = autoround_solve(
        jnp.asarray(W), jnp.asarray(H, jnp.float32), jnp.float32(1e-12), fmt=fmt, group_size=group_size, steps=3
    )
    g = 32 if group_size is None else group_size
    w = W.reshape(8, -1, g)
    s = np.maximum(np.max(np.abs(w), axis=-1) / np.float32(fmt.bound), np.finfo(np.float32).tiny)
    # XLA divides by the bound as a product with its reciprocal: the scales may differ from NumPy's by an ulp.
    np.testing.assert_allclose(np.asarray(scales).reshape(s.shape), s, rtol=2e-7)
    repeated = np.repeat(np.asarray(scales).reshape(s.shape), g, axis=-1)
    v = W * (np.float32(1) / repeated)
    if name == "int4":
        levels = np.clip(np.round(v), -8, 7)
    else:
        dtype = getattr(ml_dtypes, name)
        levels = np.clip(v, -fmt.bound, fmt.bound).astype(dtype).astype(np.float32)
    np.testing.assert_array_equal(np.asarray(weight), (levels * repeated).astype(np.float32))
    assert tensor is None


@pytest.mark.parametrize(
    ("name", "group_size"), slow_unless([("q4_0", 32)], [("mxfp4", 32), ("nvfp4", 16), ("q4_0", 32)])
)
def test_a_vanishing_step_is_round_to_nearest_with_block_scales(name, group_size):
    """Block formats: round to nearest on the format's own block scales, bit for bit what NumPy (MX, NVFP4) and
    llama.cpp's reference quantizer (Q4_0) compute, and the scales as the format holds them."""
    weight, scales, tensor = autoround_solve(
        jnp.asarray(W), jnp.asarray(H, jnp.float32), jnp.float32(1e-12), fmt=eqx_quant.format_named(name),
        group_size=group_size, steps=3,
    )  # fmt: skip
    expected, expected_scales = numpy_nearest(name, W, group_size)
    np.testing.assert_array_equal(np.asarray(weight), expected)
    if name != "q4_0":
        np.testing.assert_array_equal(np.asarray(scales), expected_scales)
    if name == "nvfp4":
        np.testing.assert_array_equal(np.asarray(tensor), np.float32(np.max(np.abs(W))) / np.float32(448 * 6))
    else:
        assert tensor is None


CASES = [
    ("int4", None), ("int3", 16), ("int2", 16), ("float4_e2m1fn", 16), ("float8_e4m3fn", None), ("mxfp4", 32),
    ("mxfp8_e4m3", 32), ("nvfp4", 16), ("q4_0", 32),
]  # fmt: skip


@pytest.mark.parametrize(("name", "group_size"), slow_unless([("int3", 16), ("q4_0", 32)], CASES))
def test_learned_rounding_picks_a_neighbouring_grid_point_and_beats_round_to_nearest(name, group_size):
    """On every format: each learned weight is its scale times a grid point (NumPy's table of the format's values),
    one of the two next to `W / s` (so each offset moved it by at most one point), with the learned scales within
    the clipping range (`α ∈ [1/2, 1]` of round to nearest's largest magnitude); a fixed quantizer of those scales
    reproduces the weight; and the output error (float64) is below round to nearest's, by a margin on these
    correlated inputs (MX block scales are powers of two: halving one never paid on these weights)."""
    fmt = eqx_quant.format_named(name)
    solve = lambda rate, steps: autoround_solve(  # noqa: E731
        jnp.asarray(W), jnp.asarray(H, jnp.float32), jnp.float32(rate), fmt=fmt, group_size=group_size, steps=steps
    )
    weight, scales, tensor = solve(1 / 50, 50)
    nearest, nearest_scales, _ = solve(1e-12, 3)
    g = 32 if group_size is None else group_size
    rows = lambda a: np.repeat(np.asarray(a, np.float32).reshape(8, -1), g, axis=-1)  # noqa: E731
    s = rows(scales) * (1 if tensor is None else np.float32(tensor))
    applied = s.astype(np.float16).astype(np.float32) if name == "q4_0" else s  # GGML applies `d` as float16
    grid = numpy_grid(name)
    v = np.clip(W * (np.float32(1) / s), grid[0], grid[-1]).astype(np.float64)
    learned = np.asarray(weight, np.float64) / applied
    levels = grid[np.argmin(np.abs(learned[..., None] - grid), axis=-1)]
    np.testing.assert_array_equal((levels.astype(np.float32) * applied).astype(np.float32), np.asarray(weight))
    lower = grid[np.clip(np.searchsorted(grid, v, side="right") - 1, 0, len(grid) - 1)]
    upper = grid[np.clip(np.searchsorted(grid, v, side="left"), 0, len(grid) - 1)]
    assert np.all((levels == lower) | (levels == upper))
    ratio = np.asarray(scales) / np.asarray(nearest_scales)
    if name in ("mxfp4", "mxfp8_e4m3"):
        assert set(np.unique(ratio)) <= {0.5, 1.0}  # a power of two: the block's scale or the one below it
    else:  # float32, E4M3 or float16 block scales: rounded, so slightly beyond the range of `α`
        assert ratio.min() >= 0.5 * (1 - 2**-3) and ratio.max() <= 1 + 1e-6
        assert np.any(ratio < 1)  # some clipping was learned (halving an MX block's scale never paid here)
    layout = dict(axis=0) if group_size is None else dict(group_size=group_size)
    fixed = eqx_quant.FakeQuant(
        np.asarray(scales), format=fmt, tensor_scale=None if tensor is None else float(tensor), **layout
    )
    assert_bitwise_equal(fixed(weight), weight)
    learned_error, nearest_error = output_error(weight, W, H), output_error(nearest, W, H)
    # The correlated inputs leave room that rounding each weight alone misses (0.09-0.54 of the error here); NVFP4's
    # round to nearest starts lower, on its finer two-level scales, and keeps 0.81 of it.
    assert learned_error < (0.9 if name == "nvfp4" else 0.7) * nearest_error


@pytest.mark.parametrize(
    ("name", "group_size"),
    slow_unless([("int4", 32), ("nvfp4", 16)], [("int4", 32), ("mxfp4", 32), ("nvfp4", 16), ("q8_0", 32)]),
)
def test_non_finite_weights_keep_round_to_nearest(name, group_size):
    """A NaN and an infinite weight: the scales come from the finite weights, the NaN stays NaN, the infinity
    saturates at the grid's end, the loss is not finite so round to nearest is kept, and a fixed quantizer of the
    scales reproduces the weight (NaN included)."""
    fmt = eqx_quant.format_named(name)
    w = W.copy()
    w[0, 3], w[1, 5] = np.nan, np.inf
    solve = lambda rate, steps: autoround_solve(  # noqa: E731
        jnp.asarray(w), jnp.asarray(H, jnp.float32), jnp.float32(rate), fmt=fmt, group_size=group_size, steps=steps
    )
    weight, scales, tensor = solve(1 / 50, 50)
    assert_bitwise_equal(weight, solve(1e-12, 3)[0])
    out = np.asarray(weight)
    assert np.isnan(out[0, 3]) and np.isfinite(np.delete(out.ravel(), 3)).all()
    s = np.asarray(scales)[1, 5 // group_size] * (1 if tensor is None else np.float32(tensor))
    s = np.float32(s).astype(np.float16).astype(np.float32) if name == "q8_0" else np.float32(s)
    assert out[1, 5] == np.float32(numpy_grid(name if name != "q8_0" else "int8")[-1] * s)
    fixed = eqx_quant.FakeQuant(
        np.asarray(scales), format=fmt, tensor_scale=None if tensor is None else float(tensor), group_size=group_size
    )
    assert_bitwise_equal(fixed(weight), weight)


@pytest.mark.parametrize("name", slow_unless(["q4_0"], ["q8_0", "q4_0"]))
def test_ggml_scales_are_returned_as_stored_so_small_blocks_round_trip(name):
    """Blocks of weights near 1e-4, whose `d` is subnormal in float16: AutoRound and GPTQ return `d` rounded to
    float16, as it is stored and applied, so that a fixed quantizer of it finds their levels again (with the float32
    `d`, re-quantizing moved 57-90 of them by a level)."""
    fmt = eqx_quant.format_named(name)
    w = jnp.asarray(W * np.float32(1e-4))
    a_weight, a_scales, _ = autoround_solve(
        w, jnp.asarray(H, jnp.float32), jnp.float32(1 / 50), fmt=fmt, group_size=32, steps=50
    )
    g_weight, g_scales, _ = _gptq_solve(w, jnp.asarray(H, jnp.float32), fmt, 32, act_order=False, damp=0.01)
    for weight, scales in ((a_weight, a_scales), (g_weight, g_scales)):
        stored = np.asarray(scales)
        np.testing.assert_array_equal(stored, stored.astype(np.float16).astype(np.float32))
        assert_bitwise_equal(eqx_quant.FakeQuant(stored, format=fmt, group_size=32)(weight), weight)


@pytest.mark.slow
def test_autoround_on_a_model_solves_each_layer_on_the_rounded_outputs_of_the_previous():
    """Sequential: the second layer's Hessian is the Gram matrix of its inputs through the first layer's learned
    weight (computed here by hand); each layer holds `autoround_solve`'s weight and a static quantizer that
    reproduces it; converted == fake-quant bit for bit; save and load keep it."""
    mlp = init(lambda k: eqx.nn.MLP(32, 8, 32, 1, activation=jnp.tanh, key=k), 3)
    qmodel = eqx_quant.quantize(mlp, **eqx_quant.recipe("w3a16_g32"))
    x = jnp.asarray(X)
    rounded = eqx_quant.autoround(qmodel, [x[:128], x[128:]], steps=20)
    h = np.asarray(X, np.float64)
    for i in range(2):
        layer = rounded.layers[i]
        expected = autoround_solve(
            qmodel.layers[i].layer.weight, jnp.asarray(h.T @ h, jnp.float32), jnp.float32(1 / 20),
            fmt=eqx_quant.format_named("int3"), group_size=32 if i == 0 else None, steps=20,
        )[0]  # fmt: skip
        # The Hessian by hand sums in another order than the observers: a weight may move by a rounding step.
        assert np.mean(np.asarray(layer.layer.weight) == np.asarray(expected)) > 0.95
        assert type(layer.weight_quant) is eqx_quant.FakeQuant
        assert_bitwise_equal(layer.weight_quant(layer.layer.weight), layer.layer.weight)
        h = np.tanh(np.asarray(jax.vmap(layer)(jnp.asarray(h, jnp.float32)), np.float64))
    run = eqx.filter_jit(lambda m, x: jax.vmap(m)(x))
    converted = eqx_quant.convert(rounded)
    assert_bitwise_equal(run(converted, x), run(rounded, x))
    reference = run(mlp, x)
    error = lambda m: float(jnp.linalg.norm(run(m, x) - reference))  # noqa: E731
    assert error(rounded) < error(qmodel)


@pytest.mark.slow
def test_autoround_on_a_scanned_stack_and_its_storage(tmp_path):
    model = init(lambda k: LinearStack(32, 2, k), 4)
    qmodel = eqx_quant.quantize(model, **eqx_quant.recipe("w4a16_g32"))
    x = jnp.asarray(X[:64])
    rounded = eqx_quant.autoround(qmodel, [x], steps=10, sequential=False)
    quantizer = rounded.blocks.weight_quant
    assert type(quantizer) is eqx_quant.LearnedFakeQuant and quantizer.scale.shape == (2, 32, 1)
    run = eqx.filter_jit(lambda m, x: jax.vmap(m)(x))
    converted = eqx_quant.convert(rounded)
    assert_bitwise_equal(run(converted, x), run(rounded, x))
    eqx_quant.save(tmp_path / "m.eqx", converted)
    loaded = eqx_quant.load(tmp_path / "m.eqx", eqx.filter_eval_shape(LinearStack, 32, 2, jax.random.key(0)))
    assert_bitwise_equal(run(loaded, x), run(converted, x))


@pytest.mark.slow
@pytest.mark.parametrize(("name", "stacked"), [("mxfp4", False), ("nvfp4", True)])
def test_autoround_on_block_formats_in_a_model(name, stacked, tmp_path):
    """The block formats through the model workflow, with the format's recipe: an MLP (MXFP4: static E8M0 block
    scales), and a scanned stack (NVFP4: one tensor scale and one set of block scales per layer); each layer's weight
    reproduced by its fixed quantizer, the outputs closer to the float model's than round to nearest's, converted ==
    fake-quant bit for bit, save/load."""
    if stacked:
        model = init(lambda k: LinearStack(32, 2, k), 7)
    else:
        # Both layers (32, 32): their solves, and the eager quantizers' operations, compile once.
        model = init(lambda k: eqx.nn.MLP(32, 32, 32, 1, activation=jnp.tanh, key=k), 6)
    x = jnp.asarray(X[:128])
    qmodel = eqx_quant.quantize(model, **eqx_quant.recipe(name))
    rounded = eqx_quant.autoround(qmodel, [x[:64], x[64:]], steps=50)  # the steps of the solves above: compiled once
    if stacked:
        quantizer = rounded.blocks.weight_quant
        assert type(quantizer) is eqx_quant.LearnedFakeQuant
        assert (quantizer.tensor_scale is not None) == (name == "nvfp4")
        # A stack's quantizer applies to one layer at a time, as the scan calls it.
        reproduced = eqx.filter_vmap(lambda l: l.weight_quant(l.layer.weight))(rounded.blocks)
        assert_bitwise_equal(reproduced, rounded.blocks.layer.weight)
    else:
        for layer in rounded.layers:
            assert_bitwise_equal(layer.weight_quant(layer.layer.weight), layer.layer.weight)
    run = eqx.filter_jit(lambda m, x: jax.vmap(m)(x))
    reference = run(model, x)
    error = lambda m: float(jnp.linalg.norm(run(m, x) - reference))  # noqa: E731
    assert error(rounded) < error(qmodel)
    converted = eqx_quant.convert(rounded)
    assert_bitwise_equal(run(converted, x), run(rounded, x))
    eqx_quant.save(tmp_path / "m.eqx", converted)
    loaded = eqx_quant.load(tmp_path / "m.eqx", eqx.filter_eval_shape(lambda: model))
    assert_bitwise_equal(run(loaded, x), run(converted, x))


def test_autoround_errors():
    mlp = init(lambda k: eqx.nn.MLP(32, 8, 32, 1, key=k), 5)
    x = [jnp.asarray(X[:8])]
    with pytest.raises(ValueError, match="steps"):
        eqx_quant.autoround(eqx_quant.quantize(mlp, **eqx_quant.recipe("w4a16_g32")), x, steps=0)
    with pytest.raises(ValueError, match="learning_rate"):
        eqx_quant.autoround(eqx_quant.quantize(mlp, **eqx_quant.recipe("w4a16_g32")), x, learning_rate=-1.0)
    negative = eqx_quant.DynamicFakeQuant(eqx_quant.IntFormat(-8, 0), axis=0)
    with pytest.raises(ValueError, match=r"(?s)layers.0.*qmax=0.*`autoround` needs.*positive levels"):
        eqx_quant.autoround(eqx_quant.quantize(mlp, [eqx_quant.Rule(".*", weight=negative)]), x)
    with pytest.raises(ValueError, match=r"`where`=.* chooses none of the weights `autoround` can solve: \['layers.0'"):
        eqx_quant.autoround(eqx_quant.quantize(mlp, **eqx_quant.recipe("w4a16_g32")), x, where=lambda p, l: False)
    with pytest.raises(ValueError, match="no QuantLinear"):
        eqx_quant.autoround(eqx_quant.quantize(mlp, weights=None, activations=eqx_quant.DynamicFakeQuant(8)), x)
