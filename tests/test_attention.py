"""Products of two activations on integers (QuantEinsum), multi-head attention with them, and `quantize` on them."""

import re
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import eqx_quant
from eqx_quant import DynamicFakeQuant, FakeQuant
from eqx_quant.nn import Einsum, QuantEinsum, QuantMultiheadAttention

from .helpers import assert_bitwise_equal, np_absmax_scale, slow_unless


def np_levels(x, axis_keep, qmax=127):
    """Levels and scales of a symmetric dynamic quantizer with one scale per index of `axis_keep` (or per tensor)."""
    x = np.asarray(x, np.float32)
    reduce = tuple(i for i in range(x.ndim) if i not in axis_keep)
    scale = np_absmax_scale(np.abs(x).max(axis=reduce, keepdims=True), qmax)
    return np.clip(np.round(x * (np.float32(1) / scale)), -qmax - 1, qmax).astype(np.int64), scale


@pytest.fixture(scope="module")
def operands():
    k1, k2 = jax.random.split(jax.random.key(0))
    return jax.random.normal(k1, (5, 8)) * 2, jax.random.normal(k2, (6, 8))


SCORES = QuantEinsum(Einsum("td,sd->ts"), lhs_quant=DynamicFakeQuant(8, axis=0), rhs_quant=DynamicFakeQuant(8))
call = eqx.filter_jit(lambda q, a, b: q(a, b))


@pytest.mark.slow
def test_integer_einsum_against_an_int64_reference(operands):
    a, b = operands
    qa, sa = np_levels(a, (0,))  # one scale per token
    qb, sb = np_levels(b, ())
    acc = qa @ qb.T  # exact in int64
    expected = (acc.astype(np.float32) * (sa * sb.reshape(1, 1))).astype(np.float32)
    eager = SCORES(a, b)
    np.testing.assert_array_equal(np.asarray(eager), expected)
    assert_bitwise_equal(call(SCORES, a, b), eager)
    # Batched over a leading axis (heads), each slice as it would be alone.
    stacked = jax.vmap(SCORES)(jnp.stack([a, -a]), jnp.stack([b, b]))
    assert_bitwise_equal(stacked[1], SCORES(-a, b))
    # Close to the float product of the fake-quantized operands, which rounds its sums.
    float_path = QuantEinsum(SCORES.einsum, lhs_quant=SCORES.lhs_quant, rhs_quant=SCORES.rhs_quant, matmul="float")
    np.testing.assert_allclose(np.asarray(float_path(a, b)), expected, rtol=1e-5, atol=1e-5)


@pytest.mark.slow
def test_gradients_are_those_of_the_float_formulation(operands):
    a, b = operands
    float_path = QuantEinsum(SCORES.einsum, lhs_quant=SCORES.lhs_quant, rhs_quant=SCORES.rhs_quant, matmul="float")
    weights = jax.random.normal(jax.random.key(1), (5, 6))
    grad = lambda q: jax.grad(lambda a, b: jnp.sum(q(a, b) * weights), argnums=(0, 1))(a, b)  # noqa: E731
    for g_int, g_float in zip(grad(SCORES), grad(float_path), strict=True):
        np.testing.assert_allclose(np.asarray(g_int), np.asarray(g_float), rtol=1e-6, atol=1e-6)
        assert np.abs(np.asarray(g_int)).sum() > 0


@pytest.mark.slow
def test_nan_and_fallbacks(operands):
    a, b = operands
    a_nan = a.at[2, 3].set(jnp.nan)
    out = np.asarray(SCORES(a_nan, b))
    assert np.isnan(out[2]).all() and not np.isnan(np.delete(out, 2, axis=0)).any()
    # Scales along the contracted axis: no integer product; the float one of the fake-quantized operands.
    per_feature = QuantEinsum(SCORES.einsum, lhs_quant=DynamicFakeQuant(8, axis=1), rhs_quant=DynamicFakeQuant(8))
    expected = jnp.einsum("td,sd->ts", DynamicFakeQuant(8, axis=1)(a), DynamicFakeQuant(8)(b))
    assert_bitwise_equal(per_feature(a, b), expected)
    asymmetric = QuantEinsum(SCORES.einsum, lhs_quant=DynamicFakeQuant(8, symmetric=False), rhs_quant=None)
    assert_bitwise_equal(asymmetric(a, b), jnp.einsum("td,sd->ts", DynamicFakeQuant(8, symmetric=False)(a), b))


def test_a_label_summed_in_one_operand_only(operands):
    # "td,sd->s" sums `t` in the lhs alone: the integer einsum sums it too, so the rescale must not sum scales
    # along it (it once summed the lhs's scale over `t`, multiplying the output by the number of tokens).
    a, b = operands
    product = QuantEinsum(Einsum("td,sd->s"), lhs_quant=DynamicFakeQuant(8), rhs_quant=DynamicFakeQuant(8, axis=0))
    qa, sa = np_levels(a, ())
    qb, sb = np_levels(b, (0,))  # one scale per `s`, an output label
    acc = np.einsum("td,sd->s", qa, qb)  # exact in int64
    expected = acc.astype(np.float32) * (sa.reshape(()) * sb.reshape(-1))
    np.testing.assert_array_equal(np.asarray(product(a, b)), expected)
    assert_bitwise_equal(call(product, a, b), product(a, b))
    # A NaN of the lhs enters every output's sum, and a NaN in row `s` of the rhs output `s` alone.
    assert np.isnan(np.asarray(product(a.at[2, 3].set(jnp.nan), b))).all()
    np.testing.assert_array_equal(np.isnan(np.asarray(product(a, b.at[4, 0].set(jnp.nan)))), np.arange(6) == 4)
    # A summed label of length 1 in one operand broadcasts to the other's length, which the int32 bound counts:
    # 140000 terms of 127 * 127 would overflow int32, so the product runs in floating point, either way round.
    long, one = jnp.ones((140000, 1)), jnp.ones((1, 1))
    dot = QuantEinsum(Einsum("td,td->"), lhs_quant=DynamicFakeQuant(8), rhs_quant=DynamicFakeQuant(8))
    assert float(dot(long, one)) == float(dot(one, long)) == 140000.0
    # One scale per token on the lhs, along the label summed in it alone: no integer product, the float einsum.
    per_token = QuantEinsum(Einsum("td,sd->s"), lhs_quant=DynamicFakeQuant(8, axis=0), rhs_quant=DynamicFakeQuant(8))
    expected = jnp.einsum("td,sd->s", DynamicFakeQuant(8, axis=0)(a), DynamicFakeQuant(8)(b))
    assert_bitwise_equal(per_token(a, b), expected)


def test_einsum_errors():
    for bad in ("td,sd", "td->t", "td,sd,xd->ts", "t1,sd->ts", "tt,sd->ts", "td,sd->tz"):
        with pytest.raises(ValueError, match="equation"):
            Einsum(bad)
    with pytest.raises(TypeError, match="einsum"):
        QuantEinsum(jnp.einsum, lhs_quant=None, rhs_quant=None)  # pyright: ignore[reportArgumentType]
    with pytest.raises(TypeError, match="lhs_quant"):
        QuantEinsum(Einsum("td,sd->ts"), lhs_quant=3, rhs_quant=None)  # pyright: ignore[reportArgumentType]


class Block(eqx.Module):
    attn: eqx.nn.MultiheadAttention
    head: eqx.nn.Linear

    def __init__(self, key):
        k1, k2 = jax.random.split(key)
        self.attn = eqx.nn.MultiheadAttention(2, 8, key=k1)
        self.head = eqx.nn.Linear(8, 3, key=k2)

    def __call__(self, x):
        mask = jnp.tril(jnp.ones((x.shape[0], x.shape[0]), bool))
        return jax.vmap(self.head)(self.attn(x, x, x, mask=mask))


@pytest.mark.slow
def test_multihead_attention_wrapper_equals_equinox():
    mha = eqx.nn.MultiheadAttention(2, 8, key=jax.random.key(2), dropout_p=0.5)
    x = jax.random.normal(jax.random.key(3), (5, 8))
    kv = jax.random.normal(jax.random.key(4), (7, 8))
    wrapped = QuantMultiheadAttention(mha)
    mask = jax.random.bernoulli(jax.random.key(5), 0.7, (5, 7))
    head_mask = jax.random.bernoulli(jax.random.key(6), 0.7, (2, 5, 7))
    for kwargs in (dict(mask=mask, inference=True), dict(mask=head_mask, inference=True), dict(key=jax.random.key(7))):
        assert_bitwise_equal(wrapped(x, kv, kv, **kwargs), mha(x, kv, kv, **kwargs))


def test_rules_name_an_attention_projection_by_either_of_its_paths():
    """`attn.query_proj` (its path as `quantize` finds it) and `attn.attention.query_proj` (once the attention is
    wrapped, as `summary` lists it) reach the same layer."""
    model = Block(jax.random.key(8))
    four = DynamicFakeQuant(4, axis=0)
    chosen = {}
    for pattern in (r"attn\.query_proj", r"attn\.attention\.query_proj"):
        rules = [eqx_quant.Rule(pattern, weight=four), *eqx_quant.recipe("w8a8_attn")["rules"]]
        chosen[pattern] = eqx_quant.quantize(model, rules)
        assert chosen[pattern].attn.attention.query_proj.weight_quant == four
        assert chosen[pattern].attn.attention.key_proj.weight_quant != four
        assert "attn.attention.query_proj" in [row.path for row in eqx_quant.summary(chosen[pattern]).rows]
    assert eqx.tree_equal(*chosen.values())
    # A rule naming the attention reaches its products alone: nothing for `convert` to store, and it says why.
    products_only = eqx_quant.quantize(model, [eqx_quant.Rule("attn", products=DynamicFakeQuant(8))])
    assert type(products_only.attn.attention.query_proj) is eqx.nn.Linear
    with pytest.raises(ValueError, match=r"quantizes products of two activations alone .* nothing to do"):
        eqx_quant.convert(products_only)


@pytest.mark.slow
def test_quantize_attention_products_and_convert():
    model = Block(jax.random.key(8))
    x = jax.random.normal(jax.random.key(9), (6, 8))
    assert type(eqx_quant.quantize(model).attn) is eqx.nn.MultiheadAttention  # products stay float by default
    qmodel = eqx_quant.quantize(model, products=DynamicFakeQuant(8))
    attn = qmodel.attn
    assert type(attn) is QuantMultiheadAttention and type(attn.scores) is QuantEinsum
    assert type(attn.attention.query_proj) is eqx_quant.nn.QuantLinear
    # Per-operand quantizers by pattern: a pair for the scores, the values left float.
    pairs = eqx_quant.quantize(
        model, products={r"attn\.scores": (DynamicFakeQuant(8, axis=0), FakeQuant(0.05, -128, 127))}
    )
    assert pairs.attn.scores.rhs_quant == FakeQuant(0.05, -128, 127) and type(pairs.attn.values) is Einsum
    fake = eqx.filter_jit(lambda m, x: m(x))(qmodel, x)
    np.testing.assert_allclose(np.asarray(fake), np.asarray(model(x)), atol=0.05)
    assert not np.array_equal(np.asarray(fake), np.asarray(eqx_quant.quantize(model)(x)))
    converted = eqx_quant.convert(qmodel)
    assert type(converted.attn.attention.query_proj) is eqx_quant.nn.IntLinear
    assert_bitwise_equal(eqx.filter_jit(lambda m, x: m(x))(converted, x), fake)
    # Every product runs on integers: int8 dot_generals with int32 results in the jaxpr, per head.
    jaxpr = jax.make_jaxpr(lambda x: qmodel(x))(x)
    text = str(jaxpr)
    assert text.count("preferred_element_type=int32") >= 2 + 5  # two products, five linear layers


@pytest.mark.parametrize("bits, groups", [(8, 1), (4, 1), (3, 2)])
def test_integer_kv_cache_decodes_like_the_quantized_products(bits, groups):
    """One integer per entry at every width (at most 8 bits), and grouped-query attention: `groups` query heads per
    cached head."""
    heads, dim, max_len = 2, 4, 6
    keys = jax.random.normal(jax.random.key(10), (max_len, heads, dim)) * 2
    values = jax.random.normal(jax.random.key(11), (max_len, heads, dim))
    queries = jax.random.normal(jax.random.key(12), (max_len, heads * groups, dim))
    q_spec, mix_spec = ("hgd,shd->hgs", "hgs,shd->hgd") if groups > 1 else ("hd,shd->hs", "hs,shd->hd")
    q_axes = (0, 1) if groups > 1 else 0
    scores = QuantEinsum(
        Einsum(q_spec), lhs_quant=DynamicFakeQuant(bits, axis=q_axes), rhs_quant=DynamicFakeQuant(bits, axis=(0, 1))
    )
    mix = QuantEinsum(Einsum(mix_spec), lhs_quant=None, rhs_quant=DynamicFakeQuant(bits, axis=(0, 1)))

    def reference(q, length):
        # The same products on the positions so far (later ones zero and masked), as a fake-quant model has them.
        written = (jnp.arange(max_len) < length)[:, None, None]
        k, v = jnp.where(written, keys, 0.0), jnp.where(written, values, 0.0)
        q = q / jnp.sqrt(jnp.float32(dim))
        logits = scores(q.reshape(heads, groups, dim) if groups > 1 else q, k)
        logits = jnp.where(jnp.arange(max_len) < length, logits, jnp.finfo(jnp.float32).min)
        return mix(jax.nn.softmax(logits, axis=-1), v).reshape(q.shape)

    @jax.jit
    def decode_step(cache, i):
        cache = cache.append(keys[i], values[i], i)
        return cache, cache.attend(queries[i], i + 1)

    cache = eqx_quant.nn.QuantKVCache.empty(max_len, heads, dim, bits=bits)
    for i in range(max_len):
        cache, out = decode_step(cache, i)
        assert_bitwise_equal(out, jax.jit(reference)(queries[i], i + 1))
    assert cache.keys.dtype == jnp.int8 and cache.key_scales.shape == (max_len, heads, 1)
    # The stored integers are those of the per-head quantizer, position by position, and dequantize to its output.
    qmax = 2 ** (bits - 1) - 1
    levels, scale = np_levels(keys[3], (0,), qmax)
    np.testing.assert_array_equal(np.asarray(cache.keys[3]), levels)
    assert_bitwise_equal(cache.dequantized()[0][3], DynamicFakeQuant(bits, axis=0)(keys[3]))
    with pytest.raises(ValueError, match="bits"):
        eqx_quant.nn.QuantKVCache.empty(4, 2, 4, bits=9)
    with pytest.raises((ValueError, TypeError), match="key_"):  # TypeError under the jaxtyping hook
        cache.append(keys[0, 0], values[0], 0)
    with pytest.raises((ValueError, TypeError), match="query"):  # 3 query heads for 2 cached heads
        cache.attend(jnp.ones((3, dim)), 1)
    # Positions outside the cache, where `dynamic_update_slice` would write the last one instead.
    with pytest.raises(ValueError, match=re.escape(f"`index` must be in [0, {max_len - 1}] for this cache, got index")):
        cache.append(keys[0], values[0], max_len)
    for length in (0, max_len + 1):
        with pytest.raises(ValueError, match=re.escape(f"`length` must be in [1, {max_len}]")):
            cache.attend(queries[0], length)
    with pytest.raises(TypeError, match="`index` must be an integer scalar"):
        cache.append(keys[0], values[0], 1.0)
    # A Python int inside `jit` (static, or in a loop written out) is checked and taken, as outside it.
    step = eqx.filter_jit(lambda c, i: c.append(keys[i], values[i], i).attend(queries[i], i + 1))
    assert_bitwise_equal(step(cache, 2), decode_step(cache, 2)[1])


def np_attention(query, keys, values, length):
    """Float attention of one query over positions `0 .. length - 1`, in float64 NumPy: query heads `i * g .. i * g
    + g - 1` read the cache's head `i`."""
    groups = query.shape[0] // keys.shape[1]
    k, v = (np.repeat(np.asarray(a[:length], np.float64), groups, axis=1) for a in (keys, values))
    with np.errstate(invalid="ignore"):
        scores = np.einsum("hd,shd->hs", np.asarray(query, np.float64), k) / np.sqrt(keys.shape[2])
        weights = np.exp(scores - scores.max(axis=-1, keepdims=True))
        return np.einsum("hs,shd->hd", weights / weights.sum(axis=-1, keepdims=True), v)


@pytest.mark.parametrize("groups", [1, 2])
def test_integer_kv_cache_keeps_nan_where_float_attention_has_it(groups):
    max_len, heads, dim = 4, 2, 4
    rng = np.random.default_rng(5)
    keys = rng.standard_normal((max_len, heads, dim)).astype(np.float32)
    values = rng.standard_normal((max_len, heads, dim)).astype(np.float32)
    keys[1, 0, 2] = np.nan  # every score of head 0 from length 2 on
    values[2, 1, 3] = np.nan  # feature 3 of head 1's outputs from length 3 on
    keys[3, 1, 0] = values[3, 0, 1] = np.nan  # read only with length 4
    query = jnp.asarray(rng.standard_normal((heads * groups, dim)).astype(np.float32))
    append = eqx.filter_jit(lambda c, k, v, i: c.append(k, v, i))
    cache = eqx_quant.nn.QuantKVCache.empty(max_len, heads, dim)
    for i in range(max_len):
        cache = append(cache, jnp.asarray(keys[i]), jnp.asarray(values[i]), i)
    for stored, appended in zip(cache.dequantized(), (keys, values), strict=True):
        np.testing.assert_array_equal(np.isnan(stored), np.isnan(appended))
    attend = eqx.filter_jit(lambda c, q, n: c.attend(q, n))
    for length in range(1, max_len + 1):
        want = np_attention(query, keys, values, length)
        for got in (attend(cache, query, length), cache.attend(query, length)):
            np.testing.assert_array_equal(np.isnan(got), np.isnan(want))
            np.testing.assert_allclose(np.asarray(got)[~np.isnan(want)], want[~np.isnan(want)], atol=0.05)


def test_integer_kv_cache_checks_concrete_array_positions():
    cache = eqx_quant.nn.QuantKVCache.empty(4, 2, 4)
    k = jnp.arange(8.0).reshape(2, 4)
    for index in (jnp.array(5), jnp.array(-1), np.array(4)):
        message = f"`index` must be in [0, 3] for this cache, got index={index}."
        with pytest.raises(ValueError, match=re.escape(message)):
            cache.append(k, k, index)
    for length in (jnp.array(9), jnp.array(0)):
        message = f"`length` must be in [1, 4] for this cache, got length={length}."
        with pytest.raises(ValueError, match=re.escape(message)):
            cache.attend(k, length)
    # In range, an array writes its position as a Python int does; traced, it cannot be checked, and one beyond
    # the cache writes the last position (as `jax.lax.dynamic_update_slice` does).
    assert_bitwise_equal(cache.append(k, k, jnp.array(2)).keys, cache.append(k, k, 2).keys)
    traced = jax.jit(lambda c, i: c.append(k, k, i))(cache, jnp.array(5))
    assert_bitwise_equal(traced.keys, cache.append(k, k, 3).keys)


@pytest.mark.slow
def test_calibrate_leaves_the_products_of_two_activations_dynamic(operands):
    # What `calibrate` documents: the linear layer's input quantizer becomes static, the product's operand
    # quantizers stay the dynamic ones, and the calibrated model computes the product with them.
    class Scores(eqx.Module):
        proj: eqx_quant.nn.QuantLinear
        scores: QuantEinsum

        def __call__(self, x):
            return self.scores(jax.vmap(self.proj)(x), x)

    linear = eqx.nn.Linear(8, 8, use_bias=False, key=jax.random.key(1))
    model = Scores(eqx_quant.quantize(linear), SCORES)
    a, _ = operands
    calibrated = eqx_quant.calibrate(model, [a[None]], batched=False)
    assert type(calibrated.proj.input_quant) is FakeQuant
    assert calibrated.scores.lhs_quant == SCORES.lhs_quant and calibrated.scores.rhs_quant == SCORES.rhs_quant
    expected = SCORES(jax.vmap(calibrated.proj)(a), a)
    assert_bitwise_equal(eqx.filter_jit(lambda m, x: m(x))(calibrated, a), expected)


class _RotaryAttention(eqx.Module):
    """Projections, a rotary embedding of the queries and keys, and `jax.nn.dot_product_attention`: the projections
    linear layers, or (`bare`) their arrays."""

    qkv: Any
    out: Any
    rope: eqx.nn.RotaryPositionalEmbedding
    bare: bool = eqx.field(static=True)

    def __call__(self, x):
        if self.bare:
            project = lambda wb, h: h @ wb[0].T + wb[1][None]  # noqa: E731
        else:
            project = lambda layer, h: jax.vmap(layer)(h)  # noqa: E731
        q, k, v = (a.reshape(8, 2, 8) for a in jnp.split(project(self.qkv, x), 3, -1))
        rope = jax.vmap(self.rope, in_axes=1, out_axes=1)
        return project(self.out, jax.nn.dot_product_attention(rope(q), rope(k), v).reshape(8, 16))


class _Stacked(eqx.Module):
    """Blocks stacked with `eqx.filter_vmap`, each applied to the input by a `jax.vmap` over the stack."""

    blocks: Any

    def __call__(self, x):
        return eqx.filter_vmap(lambda block: block(x))(self.blocks).sum(0)


@pytest.mark.parametrize("form", slow_unless(["layers", "bare"], ["layers", "bare", "stacked"]))
def test_converted_equals_fake_quant_through_a_rotary_embedding_and_fused_attention(form):
    """An integer product's output reaches the model's own arithmetic from a buffer computed before it, in the
    quantized and the converted model alike (one conditional, also for layers stacked and mapped with `jax.vmap`):
    fused with a rotary embedding, XLA contracted that arithmetic into fused multiply-adds in one program and not
    the other (one token's outputs in eight differed in the last bit)."""
    k1, k2, k3 = jax.random.split(jax.random.key(0), 3)
    make = lambda k1, k2: [eqx.nn.Linear(16, 48, key=k1), eqx.nn.Linear(16, 16, key=k2)]  # noqa: E731
    layers = make(k1, k2)
    if form == "bare":
        layers = [(layer.weight, layer.bias) for layer in layers]
    model = _RotaryAttention(*layers, eqx.nn.RotaryPositionalEmbedding(8), form == "bare")
    if form == "stacked":
        stack = lambda k: _RotaryAttention(*make(*jax.random.split(k)), eqx.nn.RotaryPositionalEmbedding(8), False)  # noqa: E731
        model = _Stacked(eqx.filter_vmap(stack)(jax.random.split(k1, 2)))
    x = jax.random.normal(k3, (32, 8, 16))
    example = {"example": (x[0],)} if form == "bare" else {}
    quantized = eqx_quant.quantize(model, **eqx_quant.recipe("w8a8"), **example)
    run = eqx.filter_jit(lambda m, x: jax.vmap(m)(x))
    assert_bitwise_equal(run(eqx_quant.convert(quantized), x), run(quantized, x))


@pytest.mark.slow
def test_an_attention_at_the_root_saves_and_loads_into_its_float_attention(tmp_path):
    """A model that is one `eqx.nn.MultiheadAttention` with quantized products loads into the float attention, fake
    and converted, as one a level down does (before, its projections' paths at the root were not recognised)."""
    mha = eqx.nn.MultiheadAttention(2, 16, key=jax.random.key(0))
    x = jax.random.normal(jax.random.key(1), (5, 16))
    quantized = eqx_quant.quantize(mha, **eqx_quant.recipe("w8a8_attn"))
    for model in (quantized, eqx_quant.convert(quantized)):
        eqx_quant.save(tmp_path / "m.eqxq", model)
        loaded = eqx_quant.load(tmp_path / "m.eqxq", mha)
        assert type(loaded) is type(model) and type(loaded.attention.key_proj) is type(model.attention.key_proj)
        assert_bitwise_equal(loaded(x, x, x), model(x, x, x))
