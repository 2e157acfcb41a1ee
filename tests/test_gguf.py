"""The GGML formats against `gguf`'s reference quantizers (llama.cpp's own Python package), and GGUF files written by
`export_gguf` read by `gguf.GGUFReader` and by `load_gguf`."""

import re

import equinox as eqx
import gguf
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from gguf import GGMLQuantizationType as T

import eqx_quant
from eqx_quant import DynamicFakeQuant, FakeQuant

from .helpers import slow_unless


F32 = np.float32
TYPES = {"q8_0": T.Q8_0, "q4_0": T.Q4_0, "q5_0": T.Q5_0}
NAMES = list(TYPES)


def reference(x, name):
    """`gguf`'s quantize, then dequantize, of float32 `x` (rows along its last axis)."""
    x = np.asarray(x, F32)
    with np.errstate(invalid="ignore", over="ignore"):  # NaN and inf blocks: the reference casts NaN to integers
        return gguf.quants.dequantize(gguf.quants.quantize(x, TYPES[name]), TYPES[name]).reshape(x.shape)


def assert_same_bits(ours, ref):
    """Bit for bit, the sign of zero included; NaN at the same places (its payload aside)."""
    ours, ref = np.asarray(ours, F32), np.asarray(ref, F32)
    assert ours.shape == ref.shape
    nan = np.isnan(ours)
    np.testing.assert_array_equal(nan, np.isnan(ref))
    np.testing.assert_array_equal(ours[~nan].view(np.uint32), ref[~nan].view(np.uint32))


def quantizer(name):
    return DynamicFakeQuant(name, group_size=32)


def random_rows(seed, rows=8, blocks=4):
    """Rows of blocks spanning magnitudes from 1e-6 (float16 `d` subnormal) to 1e3, with ties and signs mixed."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((rows, blocks * 32)).astype(F32)
    return (x * np.exp(rng.uniform(-14, 7, (rows, blocks, 1))).repeat(32, -1).reshape(x.shape)).astype(F32)


@pytest.mark.parametrize("name", slow_unless(["q8_0", "q5_0"], NAMES))
def test_random_rows_bit_for_bit(name):
    x = random_rows(0)
    q = quantizer(name)
    ref = reference(x, name)
    assert_same_bits(q(jnp.asarray(x)), ref)
    assert_same_bits(jax.jit(q)(jnp.asarray(x)), ref)
    assert_same_bits(jax.vmap(q)(jnp.asarray(x)), ref)  # one row at a time
    assert_same_bits(q.quantize_array(jnp.asarray(x)).dequantize(), ref)
    assert_same_bits(
        eqx_quant.fake_quant_format(x.reshape(8, 4, 32), q.scales(jnp.asarray(x)).scale, name), ref.reshape(8, 4, 32)
    )
    # bfloat16 weights are quantized as the float32 numbers they are
    xb = jnp.asarray(x).astype(jnp.bfloat16)
    assert_same_bits(jnp.asarray(q(xb), jnp.float32), reference(np.asarray(xb, F32), name).astype(jnp.bfloat16))


def _ties(name, seed):
    """Blocks whose values land on and next to the rounding boundaries: `v = x / d` a half-integer (a tie of
    round-half-away for Q8_0, a boundary `trunc(v - qmin + 1/2)` crosses for Q4_0 and Q5_0), and one to four float32
    steps either side; with `d` a power of two (exact) and not (`x * (1 / d)` rounded)."""
    fmt = eqx_quant.format_named(name)
    rng = np.random.default_rng(seed)
    rows = []
    for d in (F32(1.0), F32(0.01), F32(3.7), F32(-0.37)):
        for _ in range(4):
            half = rng.integers(fmt.qmin, fmt.qmax, 31).astype(F32) + F32(0.5)
            steps = rng.integers(-4, 5, 31)
            v = np.array([np.float32(h) if s == 0 else _step(h, s) for h, s in zip(half, steps, strict=True)], F32)
            m = F32(fmt.qmin) if fmt.scale_rule == "signed_max" else F32(fmt.qmax)
            block = np.concatenate([[m], v]).astype(F32) * d  # the largest magnitude sets `d` (up to its rounding)
            rows.append(rng.permutation(block))
    return np.stack(rows).astype(F32)


def _step(value, steps):
    v = np.float32(value)
    for _ in range(abs(steps)):
        v = np.nextafter(v, np.float32(np.inf if steps > 0 else -np.inf))
    return v


@pytest.mark.parametrize("name", NAMES)
def test_ties_and_their_neighbours(name):
    x = _ties(name, 1)
    q = quantizer(name)
    ref = reference(x, name)
    assert_same_bits(q(jnp.asarray(x)), ref)
    assert_same_bits(jax.jit(q)(jnp.asarray(x)), ref)
    # The sum `v + 8.5` rounds in float32: values a few ulps below a half land on the next level.
    if name == "q4_0":
        v = np.asarray([np.nextafter(F32(-0.5), F32(-1)), F32(-0.5), F32(0.5)], F32)
        block = np.concatenate([[F32(-8)], v, np.zeros(28, F32)]).astype(F32)  # d = 1
        out = np.asarray(q(jnp.asarray(block)))
        np.testing.assert_array_equal(out[1:4], [0.0, 0.0, 1.0])  # trunc(8.0 - 2**-24 -> 8.0), trunc(8.0), trunc(9.0)


def special_blocks(name):
    """Blocks that the reference handles by its own rules: equal values, zeros of both signs, a largest magnitude
    that is negative, ties of magnitude between signs, tiny and huge blocks, subnormal entries."""
    ramp = np.linspace(-1, 1, 32, dtype=F32)
    blocks = [
        np.full(32, 0.3, F32),
        np.full(32, -0.3, F32),
        np.zeros(32, F32),
        np.full(32, -0.0, F32),
        np.concatenate([[-5.0], ramp[1:]]).astype(F32),  # the largest magnitude negative: d > 0 for Q4_0
        np.concatenate([[2.0], ramp[1:-1], [-2.0]]).astype(F32),  # +2 before -2: the first one sets the sign
        np.concatenate([[-2.0], ramp[1:-1], [2.0]]).astype(F32),
        ramp * F32(1e-4),  # float16 `d` subnormal
        ramp * F32(1e6),  # float16 `d` overflows to inf: the reference's values are inf and NaN
        np.concatenate([[1.0], np.full(31, 1e-40, F32)]).astype(F32),  # subnormal entries in a normal block
        ramp * F32(2.0**-100),  # tiny, still normal `d`
    ]
    return np.stack(blocks).astype(F32)


@pytest.mark.parametrize("name", NAMES)
def test_special_blocks(name):
    x = special_blocks(name)
    assert_same_bits(jax.jit(quantizer(name))(jnp.asarray(x)), reference(x, name))
    assert_same_bits(quantizer(name)(jnp.asarray(x)), reference(x, name))


@pytest.mark.parametrize("name", NAMES)
def test_nan_policy(name):
    # A block holding NaN or inf gives NaN in every entry: the reference's `d` is NaN there (so is every value), and
    # for inf its finite entries are NaN too (its inf entry goes through a cast of NaN to an integer, unspecified).
    x = np.tile(np.linspace(-1, 1, 32, dtype=F32), (3, 1))
    x[0, 5] = np.nan
    x[1, 7] = np.inf
    y = np.asarray(quantizer(name)(jnp.asarray(x)))
    assert np.isnan(y[:2]).all() and np.isfinite(y[2]).all()
    ref = reference(x, name)
    assert np.isnan(ref[0]).all()
    assert np.isnan(np.delete(ref[1], 7)).all()
    assert_same_bits(y[2], ref[2])


def test_block_smaller_than_float32_normals_gives_zeros():
    # `d` below float32's normal range: XLA flushes it (and its inputs) to zero, so the values are zeros, as the
    # reference's are (its float16 `d` is 0); only the sign of a zero may differ.
    x = np.linspace(-1, 1, 32, dtype=F32) * F32(2.0**-124)
    for name in NAMES:
        np.testing.assert_array_equal(np.asarray(quantizer(name)(jnp.asarray(x))), reference(x, name))


@pytest.mark.parametrize("name", slow_unless(["q4_0"], NAMES))
def test_stacked_weights(name):
    # Layers stacked with `eqx.filter_vmap`: each layer's weight is quantized on its own, as `gguf` does its rows.
    keys = jax.random.split(jax.random.key(0), 3)
    linears = eqx.filter_vmap(lambda k: eqx.nn.Linear(64, 8, key=k))(keys)
    stacked = eqx_quant.quantize(linears, **eqx_quant.recipe(name))
    fake = eqx.filter_vmap(lambda layer: layer.weight_quant(layer.layer.weight))(stacked)
    ref = reference(np.asarray(linears.weight), name)
    assert_same_bits(fake, ref)
    converted = eqx_quant.convert(stacked)
    assert converted.qweight.stack_depth == 1
    assert_same_bits(converted.weight, ref)


@pytest.mark.parametrize("name", NAMES)
def test_straight_through_gradients(name):
    # The gradient passes where the rounding does not saturate: everywhere in a dynamic block but for the entries
    # beyond the top level (Q4_0: the ones with `x / d` above 7.5, the largest magnitude's opposite).
    x = jnp.asarray(np.concatenate([[-4.0, 4.0, 3.7], np.linspace(-1, 1, 29)]).astype(F32))
    g = jnp.asarray(np.random.default_rng(0).normal(size=32).astype(F32))
    grad = jax.grad(lambda x: jnp.sum(quantizer(name)(x) * g))(x)
    expected = np.asarray(g).copy()
    if name != "q8_0":  # d = -4 / qmin: 4 maps to v = -qmin, above the last level qmax + 1/2; 3.7 rounds to qmax
        expected[1] = 0
    np.testing.assert_array_equal(np.asarray(grad), expected)


def test_static_and_learned_scales():
    x = random_rows(3)
    for name in NAMES:
        fitted = FakeQuant.fit(x, name, group_size=32)
        assert_same_bits(fitted(jnp.asarray(x)), reference(x, name))
    with pytest.raises(ValueError, match="signed"):
        eqx_quant.LearnedFakeQuant.init_from(x, "q4_0", group_size=32)
    learned = eqx_quant.LearnedFakeQuant.init_from(x, "q8_0", group_size=32)
    assert_same_bits(learned(jnp.asarray(x)), reference(x, "q8_0"))


def test_formats_and_recipes():
    assert eqx_quant.format_named("q4_0") == eqx_quant.IntFormat(-8, 7, "float16", "signed_max", "shifted_trunc")
    assert [eqx_quant.format_named(n).name for n in NAMES] == NAMES
    with pytest.raises(ValueError, match="rounding"):
        eqx_quant.IntFormat(-8, 7, rounding="half_away")
    with pytest.raises(ValueError, match="group_size"):
        DynamicFakeQuant("q4_0")
    with pytest.raises(ValueError, match="group_size"):
        eqx_quant.recipe("q4_0", group_size=64)
    # Layers whose rows do not split into blocks of 32, and convolutions, stay float; `keep` gets Q8_0.
    k = jax.random.split(jax.random.key(0), 4)
    model = {"a": eqx.nn.Linear(64, 8, key=k[0]), "b": eqx.nn.Linear(40, 8, key=k[1]),
             "c": eqx.nn.Conv2d(32, 4, 3, key=k[2]), "d": eqx.nn.Linear(32, 8, key=k[3])}  # fmt: skip
    with pytest.warns(UserWarning) as caught:
        quantized = eqx_quant.quantize(model, **eqx_quant.recipe("q4_0", keep="d"))
    assert [str(w.message) for w in caught] == [
        "Layer 'b': its contraction does not split into tiles of 32, so its weight stays float instead of q4_0 in "
        "tiles of 32.",
        "Layer 'c' is a convolution, whose weight q4_0 does not quantize (GGUF's blocks run along the rows of linear "
        "and embedding weights): it stays float.",
    ]
    assert quantized["a"].weight_quant.format.name == "q4_0" and quantized["a"].input_quant is None
    assert quantized["b"].weight_quant is None and quantized["c"].weight_quant is None
    assert quantized["d"].weight_quant.format.name == "q8_0"


# ---------------------------------------------------------------------------------------------------------------------
# Files.


def _model(key=0):
    """A small model: an embedding, two linear layers (one stacked three times), a norm and a head."""
    k = jax.random.split(jax.random.key(key), 5)
    return {
        "embed": eqx.nn.Embedding(16, 64, key=k[0]),
        "blocks": eqx.filter_vmap(lambda k: eqx.nn.Linear(64, 64, key=k))(jax.random.split(k[1], 3)),
        "norm": eqx.nn.LayerNorm(64),
        "head": eqx.nn.Linear(64, 32, use_bias=False, key=k[2]),
    }


def _read(path):
    reader = gguf.GGUFReader(path)
    tensors = {t.name: (t.tensor_type, gguf.quants.dequantize(t.data, t.tensor_type)) for t in reader.tensors}
    fields = {f.name: f.contents() for f in reader.fields.values() if not f.name.startswith("GGUF.")}
    return tensors, fields


@pytest.mark.parametrize("name", NAMES)
def test_export_read_back_by_gguf(name, tmp_path):
    model = eqx_quant.convert(eqx_quant.quantize(_model(), **eqx_quant.recipe(name)))
    metadata = {"general.architecture": "toy", "toy.block_count": np.uint32(3), "toy.eps": 1e-5, "toy.flag": True,
                "tokenizer.ggml.tokens": ["a", "b"], "toy.ids": np.array([1, 2], np.int32)}  # fmt: skip
    eqx_quant.export_gguf(tmp_path / "m.gguf", model, metadata=metadata)
    tensors, fields = _read(tmp_path / "m.gguf")
    assert fields == {"general.architecture": "toy", "toy.block_count": 3, "toy.eps": pytest.approx(1e-5),
                      "tokenizer.ggml.tokens": ["a", "b"], "toy.ids": [1, 2], "toy.flag": True,
                      "general.quantization_version": 2}  # fmt: skip
    assert set(tensors) == {"embed.weight", "blocks.weight", "blocks.bias", "norm.weight", "norm.bias", "head.weight"}
    for path, weight in [("embed", model["embed"].weight), ("blocks", model["blocks"].weight),
                         ("head", model["head"].weight)]:  # fmt: skip
        kind, values = tensors[f"{path}.weight"]
        assert kind == TYPES[name]
        assert_same_bits(values, weight)  # the model's weight, the fake-quantized one
        assert_same_bits(values, reference(np.asarray(_model()[path].weight), name))
    assert tensors["blocks.bias"][0] == T.F32 and tensors["blocks.bias"][1].shape == (3, 64)
    assert_same_bits(tensors["norm.weight"][1], model["norm"].weight)


class _Tied(eqx.Module):
    shared: eqx.nn.Shared

    def __init__(self, reverse=False):
        embed = eqx.nn.Embedding(40, 64, key=jax.random.key(0))
        head = eqx.nn.Linear(64, 40, use_bias=False, key=jax.random.key(1))
        where, get = (lambda p: p[1].weight), (lambda p: p[0].weight)
        self.shared = eqx.nn.Shared((embed, head), get if reverse else where, where if reverse else get)

    def __call__(self, tokens):
        embed, head = self.shared()
        return jax.vmap(head)(jax.vmap(embed)(tokens))


def test_a_head_tied_by_shared_is_written_once_as_the_table(tmp_path):
    """A head tied with `eqx.nn.Shared` has no weight of its own (it stays a quantized layer after `convert`): the
    file holds the table once, which a reader of tied weights uses for the head. (Before, the export refused the
    converted model as "quantized but not converted".)"""
    model = eqx_quant.convert(eqx_quant.quantize(_Tied(), **eqx_quant.recipe("q8_0")))
    eqx_quant.export_gguf(tmp_path / "m.gguf", model)
    tensors, _ = _read(tmp_path / "m.gguf")
    assert list(tensors) == ["shared.pytree.0.weight"] and tensors["shared.pytree.0.weight"][0] == T.Q8_0
    embed, _ = model.shared()
    assert_same_bits(tensors["shared.pytree.0.weight"][1], embed.weight)
    # The head computed from the file's table: the model's head requantizes it on the same grid.
    tokens = jnp.arange(5)
    np.testing.assert_allclose(model(tokens), (tensors["shared.pytree.0.weight"][1][tokens] @ embed.weight.T),
                               rtol=1e-5, atol=1e-5)  # fmt: skip
    # A head that quantizes the table again on a coarser grid computes other weights than the file holds: refused.
    coarse = eqx_quant.convert(eqx_quant.quantize(_Tied(), **eqx_quant.recipe("q4_0", keep="shared.pytree.0")))
    message = r"'shared\.pytree\.1' reads its weight through an `eqx\.nn\.Shared` tie and quantizes it again with "
    with pytest.raises(ValueError, match=message + "DynamicFakeQuant in format q4_0, which moves it"):
        eqx_quant.export_gguf(tmp_path / "coarse.gguf", coarse)
    assert not (tmp_path / "coarse.gguf").exists()
    # Each entry counts: a table of one row on both grids and tiny other rows, which the coarse head moves.
    table = jnp.concatenate([jnp.tile(jnp.float32([8.0, -8.0]), (1, 32)), jax.random.normal(jax.random.key(2),
                             (39, 64)) * 1e-5])  # fmt: skip
    small = eqx.tree_at(lambda m: m.shared.pytree[0].weight, _Tied(), table)
    coarse = eqx_quant.convert(eqx_quant.quantize(small, **eqx_quant.recipe("q4_0", keep="shared.pytree.0")))
    with pytest.raises(ValueError, match=message):
        eqx_quant.export_gguf(tmp_path / "coarse.gguf", coarse)
    # The other way round (the table read through the head's weight), the embedding is the tied layer.
    reverse = _Tied(reverse=True)
    converted = eqx_quant.convert(eqx_quant.quantize(reverse, **eqx_quant.recipe("q8_0")))
    eqx_quant.export_gguf(tmp_path / "reverse.gguf", converted)
    tensors, _ = _read(tmp_path / "reverse.gguf")
    assert list(tensors) == ["shared.pytree.1.weight"]
    assert_same_bits(tensors["shared.pytree.1.weight"][1], converted.shared()[1].weight)


def test_names_split_stacked_layers_and_round_trip(tmp_path):
    model = eqx_quant.convert(eqx_quant.quantize(_model(), **eqx_quant.recipe("q4_0")))
    names = {"embed.weight": "token_embd.weight", "blocks.weight": "blk.{layer}.ffn.weight",
             "blocks.bias": "blk.{layer}.ffn.bias", "norm.weight": "output_norm.weight", "norm.bias": None,
             "head.weight": "output.weight"}  # fmt: skip
    eqx_quant.export_gguf(tmp_path / "m.gguf", model, names=names, float_type="F16")
    tensors, _ = _read(tmp_path / "m.gguf")
    assert "blk.2.ffn.weight" in tensors and "norm.bias" not in tensors and "output_norm.weight" in tensors
    for i in range(3):
        assert_same_bits(tensors[f"blk.{i}.ffn.weight"][1], model["blocks"].weight[i])
    # load_gguf reads the file into a converted model: written again, it is the same file
    back = eqx_quant.load_gguf(tmp_path / "m.gguf", model, names=names)
    eqx_quant.export_gguf(tmp_path / "again.gguf", back, names=names, float_type="F16")
    assert (tmp_path / "m.gguf").read_bytes() == (tmp_path / "again.gguf").read_bytes()
    assert back["norm"].bias is model["norm"].bias  # left out of the file: kept from `like`


def test_a_batch_norm_state_round_trips_as_int8(tmp_path):
    # `eqx.nn.BatchNorm`'s state holds a boolean flag, which GGUF has no type for: it is written as I8 (0 and 1) and
    # read back as a boolean, beside the running statistics.
    net, state = eqx.nn.make_with_state(
        lambda: (eqx.nn.Linear(32, 32, key=jax.random.key(0)), eqx.nn.BatchNorm(32, "batch", mode="ema"))
    )()
    state = state.set(net[1].ema_first_time_index, jnp.array(False))
    model = eqx_quant.convert(eqx_quant.quantize({"net": net, "state": state}, **eqx_quant.recipe("q8_0")))
    eqx_quant.export_gguf(tmp_path / "m.gguf", model)
    flags = [t for t in gguf.GGUFReader(tmp_path / "m.gguf").tensors if t.tensor_type == T.I8]
    assert len(flags) == 1 and np.array_equal(np.asarray(flags[0].data), [0])
    back = eqx_quant.load_gguf(tmp_path / "m.gguf", model)
    arrays = lambda tree: [x for x in jax.tree.leaves(tree) if eqx.is_array(x)]  # noqa: E731
    assert len(arrays(model)) == 8  # codes, scales, bias; the norm's weight and bias; the flag, mean and variance
    for a, b in zip(arrays(back), arrays(model), strict=True):
        assert a.dtype == b.dtype and np.array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.slow
def test_qat_on_q4_0_then_export_is_gguf_bit_for_bit(tmp_path):
    # Fine-tune a Q4_0 checkpoint: read it into a fake-quantized model, train through the straight-through
    # gradients, convert and export. The file is what `gguf`'s own quantizer makes of the trained weights.
    float_model = _model()
    eqx_quant.export_gguf(
        tmp_path / "start.gguf", eqx_quant.convert(eqx_quant.quantize(float_model, **eqx_quant.recipe("q4_0")))
    )
    model = eqx_quant.load_gguf(tmp_path / "start.gguf", eqx_quant.quantize(float_model, **eqx_quant.recipe("q4_0")))
    again = eqx_quant.convert(model)
    eqx_quant.export_gguf(tmp_path / "untrained.gguf", again)  # nothing trained: the same file
    assert (tmp_path / "start.gguf").read_bytes() == (tmp_path / "untrained.gguf").read_bytes()

    target = jax.random.normal(jax.random.key(5), (32,))

    def loss(m, tokens):
        def one(t):
            h = m["embed"](t)
            for i in range(3):
                layer = jax.tree.map(lambda a, i=i: a[i], m["blocks"])
                h = jax.nn.gelu(layer(h))
            return jnp.sum((m["head"](m["norm"](h)) - target) ** 2)

        return jnp.mean(jax.vmap(one)(tokens))

    tokens = jnp.arange(16)
    params, static = eqx.partition(model, eqx.is_inexact_array)
    step = eqx.filter_jit(
        lambda p: jax.tree.map(
            lambda a, g: a - 0.002 * g, p, jax.grad(lambda p: loss(eqx.combine(p, static), tokens))(p)
        )
    )
    before = loss(model, tokens)
    for _ in range(5):
        params = step(params)
    trained = eqx.combine(params, static)
    assert loss(trained, tokens) < before
    assert not np.array_equal(trained["head"].layer.weight, model["head"].layer.weight)
    eqx_quant.export_gguf(tmp_path / "trained.gguf", eqx_quant.convert(trained))
    reader = gguf.GGUFReader(tmp_path / "trained.gguf")
    for t in reader.tensors:
        path, leaf = t.name.rsplit(".", 1)
        if t.tensor_type != T.Q4_0:
            continue
        weight = np.asarray(trained[path].layer.weight)
        np.testing.assert_array_equal(np.asarray(t.data), gguf.quants.quantize(weight, T.Q4_0).reshape(t.data.shape))


def test_mxfp4_weights_are_stored_exactly(tmp_path):
    # eqx_quant's MXFP4 (the OCP rule) is stored in GGUF's MXFP4 as it is: the same values, except that GGUF's table
    # has no negative zero.
    rules = [eqx_quant.Rule(".*", weight=eqx_quant.LayerQuantizer(eqx_quant.format_named("mxfp4"), 32), input=None)]
    model = eqx_quant.convert(eqx_quant.quantize({"head": eqx.nn.Linear(64, 32, key=jax.random.key(0))}, rules))
    eqx_quant.export_gguf(tmp_path / "m.gguf", model)
    tensors, _ = _read(tmp_path / "m.gguf")
    kind, values = tensors["head.weight"]
    assert kind == T.MXFP4
    np.testing.assert_array_equal(values, np.asarray(model["head"].weight))
    back = eqx_quant.load_gguf(tmp_path / "m.gguf", model)
    assert back["head"].qweight.format == model["head"].qweight.format
    assert_same_bits(back["head"].weight, model["head"].weight)


def test_export_errors(tmp_path):
    linear = {"a": eqx.nn.Linear(64, 8, key=jax.random.key(0))}
    path = tmp_path / "m.gguf"
    int4 = eqx_quant.convert(eqx_quant.quantize(linear, **eqx_quant.recipe("w4a16_g32")))
    with pytest.raises(ValueError, match=r"Layer 'a' has weights in format int4, in groups of 32 along axis 1, of "):
        eqx_quant.export_gguf(path, int4)
    per_channel = eqx_quant.convert(eqx_quant.quantize(linear, **eqx_quant.recipe("w8a16")))
    with pytest.raises(ValueError, match=r"format int8, one scale per index of axes \(0,\), of shape \(8, 64\)"):
        eqx_quant.export_gguf(path, per_channel)
    with pytest.raises(ValueError, match="not converted"):
        eqx_quant.export_gguf(path, eqx_quant.quantize(linear, **eqx_quant.recipe("q4_0")))
    w8a8 = eqx_quant.convert(eqx_quant.quantize(linear, **eqx_quant.recipe("w8a8")))
    with pytest.raises(ValueError, match="activations in floating point"):
        eqx_quant.export_gguf(path, w8a8)
    q4 = eqx_quant.convert(eqx_quant.quantize(linear, **eqx_quant.recipe("q4_0")))
    with pytest.raises(ValueError, match="longer than"):
        eqx_quant.export_gguf(path, q4, names=lambda p: "x" * 64)
    with pytest.raises(ValueError, match="Two tensors"):
        eqx_quant.export_gguf(path, q4, names=lambda p: "w")
    with pytest.raises(ValueError, match=r"misses \['a.bias'\]"):
        eqx_quant.export_gguf(path, q4, names={"a.weight": "w"})
    with pytest.raises(TypeError, match="metadata"):
        eqx_quant.export_gguf(path, q4, metadata={"k": {1: 2}})
    with pytest.raises(ValueError, match="float_type"):
        eqx_quant.export_gguf(path, q4, float_type="Q8_0")
    assert not path.exists()
    eqx_quant.export_gguf(path, q4)
    with pytest.raises(ValueError, match="has no tensor 'b.bias'"):
        eqx_quant.load_gguf(path, {"b": q4["a"]})
    with pytest.raises(ValueError, match="not a GGUF file"):
        eqx_quant.load_gguf(__file__, q4)


@pytest.mark.slow
def test_gptq_on_q4_0_exports_bit_for_bit(tmp_path):
    # GPTQ on the Q4_0 grid: each block's `d` from the weight, as GPTQ fixes a group's scale; the levels chosen
    # against the calibration data. The file holds exactly what the model computes with.
    mlp = eqx.nn.MLP(64, 16, 64, 1, key=jax.random.key(0))
    fake = eqx_quant.quantize(mlp, **eqx_quant.recipe("q4_0"))
    x = jax.random.normal(jax.random.key(1), (64, 64))
    converted = eqx_quant.convert(eqx_quant.gptq(fake, [x]))
    eqx_quant.export_gguf(tmp_path / "g.gguf", converted)
    tensors, _ = _read(tmp_path / "g.gguf")
    assert_same_bits(tensors["layers.0.weight"][1], converted.layers[0].weight)
    w = np.asarray(mlp.layers[0].weight)
    rtn = np.asarray(fake.layers[0].weight_quant(mlp.layers[0].weight))
    error = lambda q: np.sum((np.asarray(x) @ (w - q).T) ** 2)  # noqa: E731
    assert error(np.asarray(converted.layers[0].weight)) < 0.8 * error(rtn)
    # Stacked layers hold GPTQ's scales in a LearnedFakeQuant, whose scales are positive: Q4_0's signed ones are
    # refused before any work, naming the layer.
    stacked = eqx.filter_vmap(lambda k: eqx.nn.Linear(64, 16, key=k))(jax.random.split(jax.random.key(2), 2))
    scanned = eqx_quant.quantize(stacked, **eqx_quant.recipe("q4_0"))
    with pytest.raises(ValueError, match=r"Layer '' is stacked .* q4_0, whose block scales are signed"):
        eqx_quant.gptq(scanned, [x], batched=True)


def _q4_file(tmp_path):
    linear = {"a": eqx.nn.Linear(64, 8, key=jax.random.key(0))}
    q4 = eqx_quant.convert(eqx_quant.quantize(linear, **eqx_quant.recipe("q4_0")))
    path = tmp_path / "m.gguf"
    eqx_quant.export_gguf(path, q4)
    return q4, path, path.read_bytes()


def test_nothing_to_write_or_read_is_refused(tmp_path):
    """A model without arrays, or `names` that leave out every tensor, would write a GGUF file of no tensor; a `like`
    without arrays would read nothing: refused, the existing file (or none) left as it was."""
    q4, path, before = _q4_file(tmp_path)
    for where in (path, tmp_path / "new.gguf"):
        with pytest.raises(ValueError, match=r"`model` has no array to write to a GGUF file, got model=None"):
            eqx_quant.export_gguf(where, None)
        with pytest.raises(ValueError, match=r"`names` leaves out every tensor of `model` \(None for each of "
                                             r"\['a.bias', 'a.weight'\]\).* got names=<function"):  # fmt: skip
            eqx_quant.export_gguf(where, q4, names=lambda p: None)
    assert path.read_bytes() == before and not (tmp_path / "new.gguf").exists()
    with pytest.raises(ValueError, match=r"`like` has no array to read into, got like=None"):
        eqx_quant.load_gguf(path, None)
    with pytest.raises(ValueError, match=r"`names` leaves out every tensor of `like`"):
        eqx_quant.load_gguf(path, q4, names={"a.weight": None, "a.bias": None})


def test_metadata_values_gguf_cannot_hold_are_refused(tmp_path):
    """Integers beyond GGUF's 64-bit types, floats beyond FLOAT32, standard keys of another type than GGUF's (which
    llama.cpp checks) and a `general.alignment` that is not a power of two: refused naming the key, before the file
    is touched."""
    q4, path, before = _q4_file(tmp_path)
    cases = [
        (ValueError, r"`metadata`\['k'\]=1180591620717411303424 holds an integer outside GGUF's 64-bit types",
         {"k": 2**70}),
        (ValueError, r"`metadata`\['k'\]=\[1, -18446744073709551616\] holds an integer outside", {"k": [1, -(2**64)]}),
        (ValueError, r"`metadata`\['k'\]=1e\+39 is beyond FLOAT32", {"k": 1e39}),
        (TypeError, r"`metadata`\['general.architecture'\] must be a str, .* got 3 of type int",
         {"general.architecture": 3}),
        (TypeError, r"`metadata`\['general.quantization_version'\] must be an np.uint32 .* got '2' of type str",
         {"general.quantization_version": "2"}),
        (TypeError, r"`metadata`\['general.alignment'\] must be an np.uint32 .* got -8 of type int",
         {"general.alignment": -8}),
        (ValueError, r"`metadata`\['general.alignment'\] must be a power of two of at least 8, got 48",
         {"general.alignment": 48}),
        # (beartype, under this suite's jaxtyping hook, names `metadata` first: "`metadata` must be a mapping or None,
        # got metadata='x' of type str" without it.)
        (TypeError, "metadata", "x"),
    ]  # fmt: skip
    for error, message, metadata in cases:
        with pytest.raises(error, match=message):
            eqx_quant.export_gguf(path, q4, metadata=metadata)
    assert path.read_bytes() == before
    # What GGUF holds is written: INT64 and UINT64 integers, a list in the type that holds all its items, the
    # standard keys as UINT32 from Python ints, and the tensors' data at the alignment the file states.
    metadata = {"general.architecture": "toy", "i64": -(2**40), "u64": 2**63, "ints": [1, 2**40],
                "general.alignment": 64, "general.file_type": 2}  # fmt: skip
    eqx_quant.export_gguf(path, q4, metadata=metadata)
    reader = gguf.GGUFReader(path)
    V = gguf.GGUFValueType
    types = {f.name: f.types for f in reader.fields.values() if not f.name.startswith("GGUF.")}
    assert types == {"general.architecture": [V.STRING], "i64": [V.INT64], "u64": [V.UINT64],
                     "ints": [V.ARRAY, V.INT64], "general.alignment": [V.UINT32], "general.file_type": [V.UINT32],
                     "general.quantization_version": [V.UINT32]}  # fmt: skip
    assert reader.fields["u64"].contents() == 2**63 and reader.fields["ints"].contents() == [1, 2**40]
    assert all(t.data_offset % 64 == 0 for t in reader.tensors)
    tensors, _ = _read(path)
    assert_same_bits(tensors["a.weight"][1], q4["a"].weight)
    back = eqx_quant.load_gguf(path, q4)
    assert_same_bits(back["a"].weight, q4["a"].weight)


def test_a_truncated_file_is_refused_naming_it(tmp_path):
    q4, path, before = _q4_file(tmp_path)
    cut = tmp_path / "cut.gguf"
    for end in (4, 20, 100, len(before) // 2, len(before) - 1):
        cut.write_bytes(before[:end])
        with pytest.raises(ValueError, match=rf"`path`='{re.escape(str(cut))}' is truncated or not a GGUF file"):
            eqx_quant.load_gguf(cut, q4)


def test_floats_beyond_the_range_of_their_type_are_refused_naming_the_tensor(tmp_path):
    """A float tensor written narrower than its dtype (F16 or BF16 with `float_type`, for rank 2 or more; F32 for
    float64) whose finite values would round to infinities is refused, naming it, before the file is written:
    F16 holds 65519 (which rounds to 65504) but not 65520. The rank is the tensor's in the file: a stack of biases
    written whole is F16, split by `{layer}` F32. Infinities and NaN in the model are written as they are."""
    path = tmp_path / "m.gguf"
    cases = [
        (jnp.float32([[65519.0, -65520.0]]), "F16", "'w' holds values up to 65520 in magnitude, beyond the range of "
         "F16 (at most 65504), in which it is written (float_type='F16'): they would be infinities. Export with "
         "float_type='F32' or 'BF16'."),
        (jnp.float32([[3.4e38]]), "BF16", "'w' holds values up to 3.4e+38 in magnitude, beyond the range of BF16 (at "
         "most 3.389531e+38), in which it is written (float_type='BF16'): they would be infinities. Export with "
         "float_type='F32'."),
        (np.float64([1e39]), "F32", "'w' holds values up to 1e+39 in magnitude, beyond the range of F32 (at most "
         "3.402823e+38), in which it is written (float_type='F32'): they would be infinities."),
    ]  # fmt: skip
    for w, float_type, message in cases:
        with pytest.raises(ValueError, match=re.escape(f"The tensor {message}")):
            eqx_quant.export_gguf(path, {"w": w}, float_type=float_type)
        assert not path.exists()
    # A stack: its weights of rank 2 split or not, its biases of rank 2 whole and of rank 1 (F32) split.
    weight, bias = np.ones((2, 4, 32), np.float32), np.ones((2, 4), np.float32)
    big_bias = {"blocks": {"weight": weight, "bias": np.float32([[1e5, 0, 0, 0], [0, 0, 0, 0]])}}
    big_weight = {"blocks": {"weight": np.float32([1, -1e5])[:, None, None] * weight, "bias": bias}}
    split = lambda p: p.replace("blocks.", "blk.{layer}.")  # noqa: E731
    for model, names, message in [
        (big_bias, None, "The tensor 'blocks.bias' holds values up to 100000 in magnitude, beyond the range of F16"),
        (big_weight, split, "The tensor 'blk.1.weight' (of 'blocks.weight') holds values up to 100000 in magnitude"),
    ]:
        with pytest.raises(ValueError, match=re.escape(message)):
            eqx_quant.export_gguf(path, model, names=names, float_type="F16")
        assert not path.exists()
    eqx_quant.export_gguf(path, big_bias, names=split, float_type="F16")
    tensors, _ = _read(path)
    assert tensors["blk.0.bias"][0] == T.F32 and tensors["blk.0.bias"][1][0] == 1e5
    eqx_quant.export_gguf(path, {"w": jnp.float32([[65519.0, -jnp.inf, jnp.nan]])}, float_type="F16")
    tensors, _ = _read(path)
    assert tensors["w"][0] == T.F16
    np.testing.assert_array_equal(tensors["w"][1], np.float32([[65504.0, -np.inf, np.nan]]))
