"""The integer matrix-vector product, formulated by the batch it runs for: exact whatever the batch, against NumPy."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import eqx_quant
from eqx_quant._int_ops import int_matvec

from .helpers import assert_bitwise_equal, init, np_absmax_scale, slow_unless


RNG = np.random.default_rng(0)


def _ints(shape, bound, dtype=np.int8):
    return RNG.integers(-bound, bound + 1, shape).astype(dtype)


@pytest.mark.parametrize("dtype, bound", slow_unless([(np.int16, 255)], [(np.int8, 127), (np.int16, 255)]))
def test_exact_for_every_batch(dtype, bound):
    w = _ints((6, 40), bound, dtype)
    expected = lambda x: x.astype(np.int64) @ w.T.astype(np.int64)  # noqa: E731
    for shape in [(40,), (1, 40), (3, 40), (1, 1, 40), (2, 3, 40)]:
        x = _ints(shape, bound, dtype)
        y = jax.jit(int_matvec)(jnp.asarray(w), jnp.asarray(x))
        assert y.dtype == jnp.int32 and y.shape == shape[:-1] + (6,)
        np.testing.assert_array_equal(y, expected(x))
        np.testing.assert_array_equal(int_matvec(jnp.asarray(w), jnp.asarray(x)), expected(x))  # eager
    # Under `jax.vmap` (one example; nested, one by one; several), the call sees the whole batch.
    for shape in [(1, 40), (1, 1, 40), (4, 1, 40), (1, 5, 40)]:
        x = _ints(shape, bound, dtype)
        mapped = lambda x: int_matvec(jnp.asarray(w), x)  # noqa: E731
        for _ in shape[:-1]:
            mapped = jax.vmap(mapped)
        np.testing.assert_array_equal(jax.jit(mapped)(jnp.asarray(x)), expected(x))


def test_one_weight_per_example():
    w, x = _ints((3, 6, 40), 127), _ints((3, 40), 127)
    y = jax.vmap(int_matvec)(jnp.asarray(w), jnp.asarray(x))
    np.testing.assert_array_equal(y, np.einsum("bok,bk->bo", w.astype(np.int64), x.astype(np.int64)))
    y = jax.vmap(int_matvec, in_axes=(0, None))(jnp.asarray(w), jnp.asarray(x[0]))
    np.testing.assert_array_equal(y, np.einsum("bok,k->bo", w.astype(np.int64), x[0].astype(np.int64)))


@pytest.mark.slow
def test_converted_w8a8_agrees_at_every_batch_size():
    """A converted W8A8 model and its fake-quant model give, for one example alone (unbatched, and a batch of one
    under `jax.vmap`) and within batches, the same bits."""
    mlp = init(lambda key: eqx.nn.MLP(16, 8, 16, 2, activation=jax.nn.relu, key=key), 3)
    fake = eqx_quant.quantize(mlp, **eqx_quant.recipe("w8a8"))
    converted = eqx_quant.convert(fake)
    xs = jnp.asarray(RNG.standard_normal((5, 16)).astype(np.float32))
    batched = eqx.filter_jit(lambda m, x: jax.vmap(m)(x))
    reference = batched(fake, xs)
    for model in (fake, converted):
        assert_bitwise_equal(batched(model, xs), reference)
        assert batched(model, xs[:0]).shape == (0, 8)  # an empty batch
        for i in range(2):
            assert_bitwise_equal(batched(model, xs[i : i + 1])[0], reference[i])
            assert_bitwise_equal(eqx.filter_jit(model)(xs[i]), reference[i])
            assert_bitwise_equal(model(xs[i]), reference[i])


@pytest.mark.slow
@pytest.mark.parametrize("name", ["w4a16_g32", "w8a16"])
def test_weight_only_layers_dequantize_one_weight_at_a_time(name):
    """Under `jit`, a converted weight-only model's dequantized weights are computed when their layers run: the
    program's temporary memory holds one of them, not all; its outputs and input gradients are the fake-quant
    model's, bit for bit, batched or not, a NaN input included, and so are those of a stack of copies of them (an
    ensemble) run with `jax.vmap`, eagerly and under `jit` (where XLA sums the float ensemble's products in another
    order than eagerly: each against the other model run the same way)."""
    # Three 64 x 64 layers (two groups of 32 per row for W4A16): computed at the start, the three dequantized weights
    # would all be alive at once, 3 * `one_weight` bytes of temporaries, and the bound below would fail.
    mlp = init(lambda key: eqx.nn.MLP(64, 64, 64, 2, activation=jax.nn.relu, key=key), 4)
    fake = eqx_quant.quantize(mlp, **eqx_quant.recipe(name))
    converted = eqx_quant.convert(fake)
    xs = jnp.asarray(RNG.standard_normal((3, 64)).astype(np.float32)).at[1, 0].set(jnp.nan)
    params, static = eqx.partition(converted, eqx.is_array)
    batched = jax.jit(lambda p, x: jax.vmap(eqx.combine(p, static))(x))
    one_weight = 64 * 64 * 4  # a dequantized weight, in bytes
    for x in (xs, xs[:1]):
        temp = batched.lower(params, x).compile().memory_analysis().temp_size_in_bytes
        assert one_weight <= temp < 2 * one_weight, temp
    for model in (fake, converted):
        assert_bitwise_equal(jax.vmap(model)(xs), jax.vmap(fake)(xs))
        assert_bitwise_equal(model(xs[1]), fake(xs[1]))
    assert jax.vmap(converted)(xs[:0]).shape == jax.jit(jax.vmap(converted))(xs[:0]).shape == (0, 64)  # empty
    # An ensemble (one weight per member, mapped with `eqx.filter_vmap`) computes as the fake-quant ensemble.
    stack = eqx.filter_vmap(lambda m: m, in_axes=None, axis_size=2)
    ensembles = stack(fake), stack(converted)
    members = [eqx.filter_vmap(lambda m, x: m(x))(e, xs[:2]) for e in ensembles]
    assert_bitwise_equal(*members)
    shared = [eqx.filter_vmap(lambda m: jax.vmap(m)(xs))(e) for e in ensembles]
    assert_bitwise_equal(*shared)
    compiled = [eqx.filter_jit(eqx.filter_vmap(lambda m: jax.vmap(m)(xs)))(e) for e in ensembles]
    assert_bitwise_equal(*compiled)
    # Each example through every member, the members mapped inside the examples' map: a dependency of the stack of
    # weights on the input would let XLA fuse it into their products and sum in another order.
    inside = [
        eqx.filter_jit(lambda e: jax.vmap(lambda x: eqx.filter_vmap(lambda m: m(x))(e))(xs))(e) for e in ensembles
    ]
    assert_bitwise_equal(*inside)
    loss = lambda model, x: jnp.sum(jnp.sin(jax.vmap(model)(x)))  # noqa: E731
    assert_bitwise_equal(jax.grad(loss, argnums=1)(converted, xs[::2]), jax.grad(loss, argnums=1)(fake, xs[::2]))


def _np_symmetric(x, qmax, axis):
    """NumPy twin of symmetric integer quantization with one scale per slice reduced over `axis`."""
    scale = np_absmax_scale(np.max(np.abs(x), axis=axis, keepdims=True), qmax)
    return np.clip(np.round(x * (np.float32(1) / scale)), -qmax - 1, qmax), scale


@pytest.mark.slow
def test_grouped_sums_add_the_groups_in_order_eagerly_and_compiled():
    # W4A8 in groups of 32 over 1024 inputs, three examples under `jax.vmap`: XLA's CPU backend summed the 32 groups'
    # terms in another order when the sum was compiled with the products than eagerly (with 3 and 16 outputs, as with
    # 1 and 10, the two differed in the last bit). The groups are now added one after another: NumPy's float32 sum
    # in order, eagerly and compiled.
    rules = eqx_quant.recipe("w4a8_g32")["rules"]
    x = RNG.standard_normal((3, 1024)).astype(np.float32)
    x_levels, x_scale = _np_symmetric(x, 127, axis=1)
    for out in (3, 16):
        layer = eqx_quant.quantize(eqx.nn.Linear(1024, out, use_bias=False, key=jax.random.key(out)), rules)
        w_levels, w_scale = _np_symmetric(np.asarray(layer.layer.weight).reshape(out, 32, 32), 7, axis=2)
        sums = np.einsum("bgk,ogk->gbo", x_levels.reshape(3, 32, 32), w_levels)  # exact integers
        terms = sums.astype(np.float32) * w_scale[:, :, 0].T[:, None, :]
        total = terms[0]
        for term in terms[1:]:
            total = total + term  # float32, in the groups' order
        expected = total * x_scale
        assert_bitwise_equal(jax.vmap(layer)(jnp.asarray(x)), expected)
        assert_bitwise_equal(_mapped(layer, jnp.asarray(x)), expected)


@eqx.filter_jit
def _mapped(layer, x):
    return jax.vmap(layer)(x)


def test_grouped_sums_with_one_weight_per_example():
    # Mapped over the weight and its scales too (an ensemble), the grouped sums are those of each member alone.
    members = [eqx_quant.quantize(eqx.nn.Linear(64, 4, use_bias=False, key=jax.random.key(i)),
                                  eqx_quant.recipe("w4a8_g32")["rules"]) for i in range(2)]  # fmt: skip
    x = jnp.asarray(RNG.standard_normal((2, 64)).astype(np.float32))
    stacked = jax.tree.map(lambda *a: jnp.stack(a) if eqx.is_array(a[0]) else a[0], *members)
    together = _mapped_ensemble(stacked, x)
    for i, member in enumerate(members):
        assert_bitwise_equal(together[i], _mapped(member, x[i : i + 1])[0])


@eqx.filter_jit
def _mapped_ensemble(layers, x):
    return eqx.filter_vmap(lambda layer, x: layer(x))(layers, x)
