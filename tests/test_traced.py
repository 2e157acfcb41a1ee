"""Products found by tracing (`quantize(..., example=)`, `eqx_quant.nn.QuantTraced`): models that write their
products with bare arrays, custom classes and `jnp.einsum`, against hand-quantized twins built from the public
quantizers along the axes each product implies; the workflow (gradients, calibrate, gptq, convert, save/load,
summary) on them, and the errors."""

import dataclasses
import functools
import re
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import eqx_quant
from eqx_quant import DynamicFakeQuant

from .helpers import assert_bitwise_equal, few_rows, init, np_absmax_scale, slow_unless


RNG = np.random.default_rng(0)
X8 = DynamicFakeQuant(8)  # int8 inputs, one scale per tensor per call
XT = DynamicFakeQuant(8, axis=0)  # the recipes' inputs of a product of activations (tokens, ...): per token
W8 = eqx_quant.LayerQuantizer(8)  # the w8a8 recipe's weights: int8 per output channel
identity = lambda v: v  # noqa: E731


def _normal(*shape, scale=1.0):
    return jnp.asarray(RNG.standard_normal(shape).astype(np.float32) * np.float32(scale))


# Each model quantizes the activation operand of each of its products with `xq` (identity by default), so that its
# hand-quantized twin is the model with its weights replaced by `DynamicFakeQuant(8, axis=channels)` of them, called
# with `xq=X8`. The channel axes are written by hand here: what the library must find.


class BareMLP(eqx.Module):
    w_in: jax.Array  # (out, in), used as `W @ x`
    w_mid: jax.Array  # (out, in), used as `x @ W.T`
    w_out: jax.Array  # (in, out), used as `jnp.dot(x, W)`

    def __call__(self, x, xq=identity):
        h = jax.nn.relu(self.w_in @ xq(x))
        h = jax.nn.relu(xq(h) @ self.w_mid.T)
        return jnp.dot(xq(h), self.w_out)


BARE_MLP = BareMLP(_normal(16, 8), _normal(16, 16, scale=0.3), _normal(16, 4, scale=0.3))
BARE_MLP_CHANNELS = {"w_in": (0,), "w_mid": (0,), "w_out": (1,)}


class Dense(eqx.Module):
    """A custom linear class, as interatomic-potential packages write it: weights `(in, out)`."""

    weights: jax.Array
    bias: jax.Array

    def __call__(self, x, xq):
        return jnp.dot(xq(x), self.weights) + self.bias


class Potential(eqx.Module):
    layers: list

    def __call__(self, x, xq=identity):
        for layer in self.layers[:-1]:
            x = jax.nn.silu(layer(x, xq))
        return self.layers[-1](x, xq)


POTENTIAL = Potential([Dense(_normal(8, 12), _normal(12)), Dense(_normal(12, 3, scale=0.3), _normal(3))])
POTENTIAL_CHANNELS = {"layers.0.weights": (1,), "layers.1.weights": (1,)}


class Heads(eqx.Module):
    """Projections `(heads, d, e)` and their output `(heads, e, d)` with `jnp.einsum`."""

    wq: jax.Array
    wo: jax.Array

    def __call__(self, x, xq=identity):  # x: (tokens, d)
        q = jnp.tanh(jnp.einsum("td,hde->the", xq(x), self.wq))
        return jnp.einsum("the,hed->td", xq(q), self.wo)  # sums over heads and e: one scale per output feature


HEADS = Heads(_normal(2, 8, 4), _normal(2, 4, 8, scale=0.3))
HEADS_CHANNELS = {"wq": (0, 2), "wo": (2,)}


class Stack(eqx.Module):
    """Raw stacked weights `(layers, out, in)` run with `lax.scan`: one set of scales per layer."""

    w: jax.Array

    def __call__(self, x, xq=identity):
        step = lambda h, w: (jnp.tanh(w @ xq(h)), None)  # noqa: E731
        return jax.lax.scan(step, x, self.w)[0]


STACK = Stack(_normal(3, 8, 8, scale=0.4) * jnp.arange(1.0, 4.0)[:, None, None])
STACK_CHANNELS = {"w": (0, 1)}


class GNN(eqx.Module):
    """Message passing with `.at[].add`, as graph-network packages write it."""

    w_self: jax.Array
    w_msg: jax.Array

    def __call__(self, h, senders, receivers, xq=identity):  # h: (nodes, d)
        messages = xq(h[senders]) @ self.w_msg.T
        pooled = jnp.zeros_like(h).at[receivers].add(messages)
        return jax.nn.relu(xq(h) @ self.w_self.T + pooled)


GNN_MODEL = GNN(_normal(6, 6, scale=0.5), _normal(6, 6, scale=0.5))
GNN_CHANNELS = {"w_self": (0,), "w_msg": (0,)}
SENDERS, RECEIVERS = jnp.array([0, 1, 2, 3, 4]), jnp.array([1, 2, 3, 4, 0])


class Conv(eqx.Module):
    kernel: jax.Array  # (out, in, 3, 3)

    def __call__(self, x, xq=identity):  # x: (in, height, width)
        return jax.lax.conv_general_dilated(xq(x)[None], self.kernel, (1, 1), "SAME")[0]


CONV = Conv(_normal(4, 3, 3, 3, scale=0.3))
CONV_CHANNELS = {"kernel": (0,)}


@jax.custom_jvp
def _custom_product(w, h):
    return w @ h


@_custom_product.defjvp
def _custom_product_jvp(primals, tangents):
    (w, h), (dw, dh) = primals, tangents
    return w @ h, dw @ h + w @ dh


class Wrapped(eqx.Module):
    """Products inside `jit`, `checkpoint`, `cond` and a custom-derivative function."""

    a: jax.Array
    b: jax.Array
    c: jax.Array
    d: jax.Array

    def __call__(self, x, xq=identity):
        h = jax.jit(lambda w, v: w @ xq(v))(self.a, x)
        h = jax.checkpoint(lambda v: jnp.tanh(self.b @ xq(v)))(h)
        h = jax.lax.cond(h[0] > 0, lambda v: self.c @ xq(v), lambda v: -(self.c @ xq(v)), h)
        return _custom_product(self.d, xq(h))


WRAPPED = Wrapped(*(_normal(6, 6, scale=0.5) for _ in range(4)))
WRAPPED_CHANNELS = {name: (0,) for name in "abcd"}

CASES = {
    "bare_mlp": (BARE_MLP, BARE_MLP_CHANNELS, (_normal(8),)),
    "custom_class": (POTENTIAL, POTENTIAL_CHANNELS, (_normal(8),)),
    "einsum_heads": (HEADS, HEADS_CHANNELS, (_normal(5, 8),)),
    "scan_stack": (STACK, STACK_CHANNELS, (_normal(8),)),
    "message_passing": (GNN_MODEL, GNN_CHANNELS, (_normal(5, 6), SENDERS, RECEIVERS)),
    "conv": (CONV, CONV_CHANNELS, (_normal(3, 6, 6),)),
    "wrapped": (WRAPPED, WRAPPED_CHANNELS, (_normal(6),)),
}


def _leaf(model, path):
    return {jax.tree_util.keystr(p, simple=True, separator="."): x for p, x in jax.tree_util.tree_leaves_with_path(
        model)}[path]  # fmt: skip


def _twin(model, channels):
    """The hand-quantized twin: each traced weight fake-quantized per index of its channel axes."""
    for path, axes in channels.items():
        where = functools.partial(_leaf, path=path)
        model = eqx.tree_at(where, model, DynamicFakeQuant(8, axis=axes)(where(model)))
    return model


_call = eqx.filter_jit(lambda model, args, kwargs: model(*args, **kwargs))


@eqx.filter_jit
def _call_twin(model, channels, args):
    """The twin called under `jit` with its weights quantized inside the program, as the traced model quantizes
    them: a float product is summed in an order that XLA chooses per program (the parity page), so a twin whose
    weights were constants of the program may round its last bit otherwise."""
    return _twin(model, channels)(*args, xq=X8)


PER_TENSOR = [eqx_quant.Rule(".*", weight=W8, input=X8)]  # `w8a8` with the inputs' quantizer as it is: per tensor


@functools.cache
def _quantized(name):
    model, _, args = CASES[name]
    return eqx_quant.quantize(model, PER_TENSOR, example=args)


_SLOW = {"custom_class", "einsum_heads", "message_passing", "wrapped"}  # the other cases cover each path quickly


@pytest.mark.parametrize(
    "name", [pytest.param(name, marks=pytest.mark.slow) if name in _SLOW else name for name in CASES]
)
def test_forward_is_the_hand_quantized_model(name):
    model, channels, args = CASES[name]
    quantized = _quantized(name)
    assert isinstance(quantized, eqx_quant.nn.QuantTraced)
    assert set(quantized.weight_paths) == set(channels)
    for path, quantizer in zip(quantized.weight_paths, quantized.weight_quants, strict=True):
        assert quantizer.layout.axes == channels[path], path
    expected = _call_twin(model, channels, args)
    got = _call(quantized, args, {})
    if name == "conv":  # a float product of the quantized operands, as the twin's
        assert_bitwise_equal(got, expected)
        assert_bitwise_equal(quantized(*args), _twin(model, channels)(*args, xq=X8))  # and eagerly
    else:  # integer products: the float twin's values, to its rounding; eager and compiled alike, bit for bit
        np.testing.assert_allclose(np.asarray(got), np.asarray(expected), rtol=2e-6, atol=2e-6)
        assert_bitwise_equal(quantized(*args), got)
    # The float model differs: the test would fail if nothing were quantized.
    assert np.max(np.abs(np.asarray(_call(model, args, {})) - np.asarray(expected))) > 1e-4


def _np_levels(x, axes, bits=8):
    """NumPy twin of symmetric integer quantization, one scale per index of `axes` (all others reduced)."""
    x = np.asarray(x, np.float32)
    qmax = 2 ** (bits - 1) - 1
    reduced = tuple(a for a in range(x.ndim) if a not in axes)
    scale = np_absmax_scale(np.max(np.abs(x), axis=reduced, keepdims=True), qmax)
    return np.clip(np.round(x * (np.float32(1) / scale)), -qmax - 1, qmax).astype(np.int64), scale


def _along_output(scale, shape, labels, out_labels):
    """A scale constant along an operand's contracted labels (broadcast to the operand's `shape`), laid along the
    output's labels: its free labels in the output's order, unit axes for the other operand's."""
    free = np.broadcast_to(scale, shape)[tuple(slice(None) if label in out_labels else 0 for label in labels)]
    kept = "".join(label for label in labels if label in out_labels)
    ordered = "".join(sorted(kept, key=out_labels.index))
    return np.einsum(f"{kept}->{ordered}", free)[tuple(slice(None) if c in kept else None for c in out_labels)]


class One(eqx.Module):
    """One product of a weight with an input, written as `equation` (input first) for `jnp.einsum`."""

    w: jax.Array
    equation: str = eqx.field(static=True)

    def __call__(self, x):
        return jnp.einsum(self.equation, x, self.w)


ONE = {
    "Wx": (One(_normal(6, 8), "i,oi->o"), (0,), _normal(8)),
    "xW_in_out": (One(_normal(8, 6), "ti,io->to"), (1,), _normal(3, 8)),
    "heads": (One(_normal(2, 8, 4), "td,hde->the"), (0, 2), _normal(3, 8)),
    "out_heads": (One(_normal(2, 4, 8), "the,hed->td"), (2,), _normal(3, 2, 4)),
    "batched_stack": (One(_normal(3, 5, 4), "li,loi->lo"), (0, 1), _normal(3, 4)),
}


@pytest.mark.parametrize("per_token", [False, True])
@pytest.mark.parametrize("name", slow_unless(["xW_in_out", "heads"], list(ONE)))
def test_integer_product_against_numpy(name, per_token):
    model, channels, x = ONE[name]
    # The recipe's inputs are per token; a rule's quantizer `X8` is applied as it is: one scale per tensor.
    rules = eqx_quant.recipe("w8a8")["rules"] if per_token else PER_TENSOR
    quantized = eqx_quant.quantize(model, rules, example=(x,))
    operands, out_labels = model.equation.split("->")
    labels_x, labels_w = operands.split(",")
    tokens = tuple(i for i, label in enumerate(labels_x) if label in out_labels) if per_token else ()
    w_levels, w_scale = _np_levels(model.w, channels)
    x_levels, x_scale = _np_levels(x, tokens)  # per token: one scale per index of the input's free axes
    acc = np.einsum(model.equation, x_levels, w_levels)  # int64: exact
    # The exact integer sum (exact in float32 here) times the weight's scale (per output channel, laid along the
    # output's axes), then times the input's, as a linear layer rescales it.
    w_out = _along_output(w_scale, model.w.shape, labels_w, out_labels)
    x_out = _along_output(x_scale, x.shape, labels_x, out_labels)
    expected = ((acc.astype(np.float32) * w_out.astype(np.float32)) * x_out.astype(np.float32)).astype(np.float32)
    assert_bitwise_equal(_call(quantized, (x,), {}), expected)
    assert_bitwise_equal(quantized(x), expected)
    assert_bitwise_equal(_call(eqx_quant.convert(quantized), (x,), {}), expected)
    if tokens:  # the per-tensor result differs: the test would fail if the scales were not per token
        per_tensor = eqx_quant.quantize(model, PER_TENSOR, example=(x,))
        assert np.any(np.asarray(_call(per_tensor, (x,), {})) != expected)


def test_grouped_integer_product_against_numpy():
    # `jnp.dot(x, W)` with W (in=64, out=6), int4 in groups of 32 down its columns, int8 inputs per token: one int32
    # sum per group, times the group's scale and rounded, the groups' terms added in order, times the token's scale.
    w, x = _normal(64, 6, scale=0.2), _normal(3, 64)
    model = One(w, "ti,io->to")
    quantized = eqx_quant.quantize(model, eqx_quant.recipe("w4a8_g32")["rules"], example=(x,))
    w_levels, w_scale = _np_levels(w.reshape(2, 32, 6), (0, 2), bits=4)
    x_levels, x_scale = _np_levels(x, (0,))
    acc = np.einsum("tgk,gko->gto", x_levels.reshape(3, 2, 32), w_levels)  # one exact sum per group
    terms = (acc.astype(np.float32) * w_scale.reshape(2, 1, 6)).astype(np.float32)
    expected = ((terms[0] + terms[1]) * x_scale).astype(np.float32)
    assert_bitwise_equal(_call(quantized, (x,), {}), expected)
    assert_bitwise_equal(quantized(x), expected)
    converted = eqx_quant.convert(quantized)
    assert converted.model.w.packed_bits == 4
    assert_bitwise_equal(_call(converted, (x,), {}), expected)
    # Mapped from outside over two sequences, the second twice the first (scales twice as large, the same levels).
    mapped = _call(jax.vmap(converted), (jnp.stack([x, 2 * x]),), {})
    assert_bitwise_equal(mapped, np.stack([expected, 2 * expected]))
    # `matmul="float"` keeps the float product of the fake-quantized operands: other sums, other bits.
    rules = [dataclasses.replace(r, matmul="float") for r in eqx_quant.recipe("w4a8_g32")["rules"]]
    floated = eqx_quant.quantize(model, rules, example=(x,))
    fake = DynamicFakeQuant(8, axis=0)(x) @ DynamicFakeQuant(4, group_size=32, group_axis=0)(w)
    np.testing.assert_allclose(np.asarray(_call(floated, (x,), {})), np.asarray(fake), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("name", slow_unless(["bare_mlp", "scan_stack"], ["bare_mlp", "scan_stack", "message_passing"]))
def test_converted_matches_fake_quant_bit_for_bit(name):
    quantized = _quantized(name)
    args = CASES[name][2]
    converted = eqx_quant.convert(quantized)
    for path in quantized.weight_paths:
        stored = _leaf_node(converted.model, path)
        assert isinstance(stored, eqx_quant.QuantizedArray) and stored.values.dtype == jnp.int8
    assert_bitwise_equal(_call(converted, args, {}), _call(quantized, args, {}))
    assert_bitwise_equal(converted(*args), quantized(*args))


class _LoRA(eqx.Module):
    a: jax.Array
    b: jax.Array
    optimize: bool = eqx.field(static=True, default=True)

    def __call__(self, x):
        return jnp.einsum("ti,ir,ro->to", x, self.a, self.b, optimize="auto" if self.optimize else False)


class _Calls(eqx.Module):
    """Calls that compute none of a traced weight's products with an input: a loop of one step (`zeros @ u`), a
    regulariser alone (`w.T @ w`)."""

    w: jax.Array
    u: jax.Array

    def __call__(self, xs, product=True):
        h = jnp.zeros(8)
        for x in xs:
            h = jnp.tanh(x @ self.w + h @ self.u)
        return (h if product else xs[0]) + jnp.trace(self.w.T @ self.w)


def test_a_call_that_multiplies_a_traced_weight_by_another_array_alone_raises():
    """`jnp.einsum` of three operands orders its products by shape: traced on one token `(x a) b`, on eight tokens
    `x (a b)`, where `a`'s input quantizer has no input: an error naming the weight, not a product left float. A
    weight-only recipe has nothing to follow there and runs; calls that multiply a weight by a constant or by itself
    alone, and none of its products, run."""
    lora = _LoRA(jax.random.normal(jax.random.key(0), (32, 64)) / 4, jax.random.normal(jax.random.key(1), (64, 4)))
    one, eight = jnp.ones((1, 32)), jnp.ones((8, 32))
    w8a8 = eqx_quant.quantize(lora, **eqx_quant.recipe("w8a8"), example=(one,))
    w8a8(one)
    with pytest.raises(ValueError, match=r"multiplies the traced weight 'a' by another .* `optimize=False`"):
        w8a8(eight)
    # Left to right at every shape: the eight tokens' call computes the example's products, each token alike.
    ordered = eqx_quant.quantize(_LoRA(lora.a, lora.b, optimize=False), **eqx_quant.recipe("w8a8"), example=(one,))
    rows = jax.random.normal(jax.random.key(4), (8, 32))
    assert_bitwise_equal(ordered(rows)[3], ordered(rows[3:4])[0])
    w8a16 = eqx_quant.quantize(lora, **eqx_quant.recipe("w8a16"), example=(one,))
    fake = _LoRA(w8a16.weight_quants[0](lora.a), w8a16.weight_quants[1](lora.b))
    assert_bitwise_equal(w8a16(eight), fake(eight))
    calls = _Calls(jax.random.normal(jax.random.key(2), (8, 8)), jax.random.normal(jax.random.key(3), (8, 8)))
    traced = eqx_quant.quantize(calls, **eqx_quant.recipe("w8a8"), example=(jnp.ones((3, 8)),))
    assert traced.weight_paths == ("w", "u")
    for args in ((jnp.ones((1, 8)),), (jnp.ones((2, 8)), False)):
        assert np.all(np.isfinite(np.asarray(traced(*args))))


class _Scaled(eqx.Module):
    w: jax.Array
    config: Any = None

    def __call__(self, x, factor=None):
        h = x @ self.w.T
        factor = self.config if factor is None else factor
        return h if factor is None else h * factor


def test_an_eager_call_runs_as_one_compiled_program():
    """An eager call with array arguments compiles the traced program once (before: each of its operations, dozens
    of programs, and traced again at every call), and gives the bits of the call under `eqx.filter_jit`; with a
    Python number among its arguments (which the model may branch on) it runs operation by operation, as before."""
    traced = eqx_quant.quantize(_Scaled(jnp.ones((7, 13)) / 3), **eqx_quant.recipe("w8a8"), example=(jnp.ones(13),))
    x = jax.random.normal(jax.random.key(0), (5, 13))
    compiles = []
    listener = lambda event, duration, **kwargs: compiles.append(event)  # noqa: E731
    jax.monitoring.register_event_duration_secs_listener(listener)
    try:
        eager = traced(x, jnp.float32(2.0))
    finally:
        jax.monitoring.unregister_event_duration_listener(listener)
    assert len([e for e in compiles if e == "/jax/core/compile/backend_compile_duration"]) <= 1
    assert_bitwise_equal(eager, eqx.filter_jit(lambda m, x: m(x, jnp.float32(2.0)))(traced, x))
    assert_bitwise_equal(traced(x, 2.0), eager)
    assert_bitwise_equal(eager, traced(x) * 2)  # doubling is exact
    assert not np.array_equal(np.asarray(traced(x)), np.asarray(x @ traced.model.w.T))  # quantized
    # A model with a non-array part that cannot be hashed (a mutable dataclass) cannot key a compiled program: it
    # runs operation by operation, with the same bits.
    config = _Unhashable(2.0)
    odd = eqx_quant.quantize(_Scaled(traced.model.w, config), **eqx_quant.recipe("w8a8"), example=(jnp.ones(13),))
    assert_bitwise_equal(odd(x), eager)
    # NumPy arrays in a static field hash but do not compare: a second such model runs operation by operation too.
    for factor in (2.0, 3.0):
        with pytest.warns(UserWarning, match="being set as static"):  # Equinox's, for the array in a static field
            model = _StaticFactor(traced.model.w, np.full((1, 7), factor, np.float32))
        static = eqx_quant.quantize(model, **eqx_quant.recipe("w8a8"), example=(x[:1],))
        like = eqx_quant.quantize(_Scaled(traced.model.w, factor), **eqx_quant.recipe("w8a8"), example=(x[:1],))
        np.testing.assert_allclose(static(x), like(x), rtol=1e-6)  # (compiled alike or not)


class _StaticFactor(eqx.Module):
    w: jax.Array
    factor: np.ndarray = eqx.field(static=True)

    def __call__(self, x):
        return (x @ self.w.T) * self.factor


@dataclasses.dataclass
class _Unhashable:
    factor: float

    def __rmul__(self, h):
        return h * self.factor


def test_exporters_refuse_traced_weights_and_name_save(tmp_path):
    """A converted model of traced weights has no layer names for a file format: each exporter says so (not that the
    model lacks converted layers) and points to `eqx_quant.save`; nothing is written."""
    converted = eqx_quant.convert(_quantized("bare_mlp"))
    exporters = {
        "a safetensors file": lambda path: eqx_quant.export_safetensors(path, converted),
        "a GGUF file": lambda path: eqx_quant.export_gguf(path, converted),
        "a compressed-tensors checkpoint": lambda path: eqx_quant.export_compressed_tensors(path, converted),
    }
    for what, export in exporters.items():
        path = tmp_path / "out"
        message = rf"QuantTraced: its traced weights \['w_in', 'w_mid', 'w_out'\].*which {what} has no layer names"
        with pytest.raises(ValueError, match=f"(?s){message}.*`eqx_quant.save`"):
            export(path)
        assert not path.exists()

    # Linear layers and a product of two activations alone: the wrapped model holds every stored weight.
    class Scores(eqx.Module):
        proj: eqx.nn.Linear

        def __call__(self, x):
            h = jax.vmap(self.proj)(x)
            return h @ h.T

    scores = Scores(eqx.nn.Linear(4, 4, key=jax.random.key(0)))
    only_products = eqx_quant.quantize(scores, **eqx_quant.recipe("w8a8_attn"), example=(jnp.ones((3, 4)),))
    assert only_products.weight_paths == () and only_products.product_indices == (0,)
    message = r"QuantTraced of no traced weight, only products of two activations .* the model it wraps, `model.model`"
    with pytest.raises(ValueError, match=message):
        eqx_quant.export_safetensors(tmp_path / "products", eqx_quant.convert(only_products))
    assert not (tmp_path / "products").exists()


class Transposed(eqx.Module):
    w: jax.Array

    def __call__(self, x):
        return x @ self.w.T


@pytest.mark.parametrize("recipe", slow_unless(["w4a16_g32", "fp8"], ["w4a16_g32", "w8a16", "fp8"]))
def test_float_products_convert_bit_for_bit(recipe):
    # A matrix-vector product of a transposed weight on the float path, which XLA on CPU sums differently when the
    # weight's computation is fused into it: without `materialised`, the fake-quant and converted models differed in
    # the last bit here.
    model, x = Transposed(_normal(64, 64)), _normal(64)
    quantized = eqx_quant.quantize(model, eqx_quant.recipe(recipe)["rules"], example=(x,))
    converted = eqx_quant.convert(quantized)
    assert_bitwise_equal(_call(converted, (x,), {}), _call(quantized, (x,), {}))
    weight, inputs = quantized.weight_quants[0](model.w), quantized.input_quants[0]
    expected = (x if inputs is None else inputs(x)) @ weight.T  # FP8 inputs too for "fp8"
    np.testing.assert_allclose(np.asarray(_call(quantized, (x,), {})), np.asarray(expected), rtol=1e-5, atol=1e-5)


def _leaf_node(model, path):
    is_stored = lambda x: isinstance(x, eqx_quant.QuantizedArray)  # noqa: E731
    leaves = jax.tree_util.tree_leaves_with_path(model, is_leaf=is_stored)
    return {jax.tree_util.keystr(p, simple=True, separator="."): x for p, x in leaves}[path]


def test_a_bare_weight_computes_what_a_linear_layer_computes():
    linear = init(lambda k: eqx.nn.Linear(32, 16, key=k), 0)

    class Bare(eqx.Module):
        weight: jax.Array
        bias: jax.Array

        def __call__(self, x):
            y = x @ self.weight.T
            return y + jnp.broadcast_to(self.bias, y.shape)

    bare, x, tokens = Bare(linear.weight, linear.bias), _normal(32), _normal(4, 32)
    for name in ("w8a8", "w8a16", "w4a8_g32"):
        rules = eqx_quant.recipe(name)["rules"]
        layer, traced = eqx_quant.quantize(linear, rules), eqx_quant.quantize(bare, rules, example=(x,))
        if name != "w8a16":  # both on the integers (per channel, or per group summed alike): the same bits
            assert_bitwise_equal(_call(traced, (x,), {}), _call(layer, (x,), {}))
        else:  # float products, summed in another order
            np.testing.assert_allclose(np.asarray(_call(traced, (x,), {})), np.asarray(_call(layer, (x,), {})),
                                       rtol=1e-5, atol=1e-6)  # fmt: skip
            continue
        # All the tokens at once, `x @ W.T` of shape (tokens, features), with one input scale per token: what the
        # layer mapped over the tokens computes.
        per_token = eqx_quant.quantize(bare, rules, example=(tokens,))
        assert_bitwise_equal(_call(per_token, (tokens,), {}), _call(jax.vmap(layer), (tokens,), {}))


@pytest.mark.slow
def test_layers_of_a_stack_indexed_outside_a_scan_compute_on_the_integers():
    # `x @ Ws[i].T` slices the stack along an axis the product does not sum over: whole tiles, the grouped integer
    # product, as linear layers holding the slices compute it.
    class Indexed(eqx.Module):
        ws: jax.Array  # (2, out, in)

        def __call__(self, x):
            return x @ self.ws[0].T, x @ self.ws[1, :3].T

    ws, x = _normal(2, 5, 64, scale=0.2), _normal(3, 64)
    rules = eqx_quant.recipe("w4a8_g32")["rules"]
    quantized = eqx_quant.quantize(Indexed(ws), rules, example=(x,))
    got = _call(quantized, (x,), {})
    for out, w in zip(got, (ws[0], ws[1, :3]), strict=True):
        rows = w.shape[0]
        linear = eqx_quant.quantize(init(lambda k: eqx.nn.Linear(64, rows, use_bias=False, key=k), 0), rules)  # noqa: B023
        linear = eqx.tree_at(lambda l: l.layer.weight, linear, w)
        assert_bitwise_equal(out, _call(jax.vmap(linear), (x,), {}))


def test_factories_receive_the_traced_product():
    seen = {}

    def factory(path, product):
        seen[path] = product
        return DynamicFakeQuant(8)

    model, _, args = CASES["einsum_heads"]
    eqx_quant.quantize(model, [eqx_quant.Rule(".*", weight=factory, input=None)], example=args)
    wq, wo = seen["wq"], seen["wo"]
    assert isinstance(wq, eqx_quant.TracedProduct)
    assert (wq.contracted, wq.channels, wq.input_shape, wq.input_contracted) == ((1,), (0, 2), (5, 8), (1,))
    assert (wo.contracted, wo.channels, wo.input_shape, set(wo.input_contracted)) == ((0, 1), (2,), (5, 2, 4), {1, 2})
    assert wq.input_free == wo.input_free == (0,)  # the tokens
    assert wq.primitive == "dot_general" and wq.stack == () and wq.weight is model.wq
    seen.clear()
    eqx_quant.quantize(STACK, [eqx_quant.Rule(".*", weight=factory)], example=CASES["scan_stack"][2])
    assert seen["w"].stack == (3,) and seen["w"].contracted == (2,)
    seen.clear()
    eqx_quant.quantize(CONV, [eqx_quant.Rule(".*", weight=factory)], example=CASES["conv"][2])
    assert seen["kernel"].primitive == "conv_general_dilated" and seen["kernel"].contracted == (1, 2, 3)


def test_groups_run_along_the_contracted_axis():
    # `x @ W` with W (in=64, out=8): groups of 32 run down the columns, along axis 0.
    w = _normal(64, 8, scale=0.2)
    model = Dense(w, jnp.zeros(8))
    x = _normal(64)
    call = lambda m: m(x, identity)  # noqa: E731
    quantized = eqx_quant.quantize(model, eqx_quant.recipe("w4a16_g32")["rules"], example=call)
    (quantizer,) = quantized.weight_quants
    assert quantizer.layout.group_size == 32 and quantizer.layout.group_axis == 0
    expected = jnp.dot(x, DynamicFakeQuant(4, group_size=32, group_axis=0)(w))
    assert_bitwise_equal(quantized(x, identity), expected)
    converted = eqx_quant.convert(quantized)
    assert converted.model.weights.packed_bits == 4
    assert_bitwise_equal(converted(x, identity), expected)


def test_a_layer_and_a_bare_weight_in_one_model():
    class Mixed(eqx.Module):
        linear: eqx.nn.Linear
        w: jax.Array

        def __call__(self, x, xq=identity):
            return self.w @ xq(jax.nn.relu(self.linear(x)))

    model = Mixed(init(lambda k: eqx.nn.Linear(8, 8, key=k), 0), _normal(4, 8))
    x = _normal(8)
    quantized = eqx_quant.quantize(model, eqx_quant.recipe("w8a8")["rules"], example=(x,))
    assert quantized.weight_paths == ("w",)  # the layer's weight is the layer's, quantized as a layer
    assert isinstance(quantized.model.linear, eqx_quant.nn.QuantLinear)
    twin = eqx.filter_jit(
        lambda m, x: eqx_quant.quantize(_twin(m, {"w": (0,)}), eqx_quant.recipe("w8a8")["rules"])(x, xq=X8)
    )
    np.testing.assert_allclose(np.asarray(_call(quantized, (x,), {})), np.asarray(twin(model, x)), rtol=2e-6, atol=2e-6)
    rows = {row.path: row for row in eqx_quant.summary(quantized).rows}
    assert rows["model.w"].kind == "traced" and rows["model.linear"].kind == "QuantLinear"
    assert rows["model.w"].float_bytes == 4 * 8 * 4 and rows["model.w"].stored_bytes == 4 * 8 + 4 * 4
    restored = eqx_quant.float_model(quantized)
    assert type(restored) is Mixed and restored.w is model.w and type(restored.linear) is eqx.nn.Linear


def test_vmap_outside_gives_each_example_its_own_input_scale():
    quantized = _quantized("bare_mlp")
    x = jnp.stack([_normal(8), 100 * _normal(8)])
    batched = _call(eqx.filter_vmap(quantized), (x,), {})
    for i in range(2):
        assert_bitwise_equal(batched[i], _call(quantized, (x[i],), {}))


def test_gradients_are_those_of_the_hand_quantized_model():
    model, channels, args = CASES["scan_stack"]
    quantized = _quantized("scan_stack")
    grads = eqx.filter_jit(eqx.filter_grad(lambda m, x: jnp.sum(m(x) ** 2)))(quantized, *args)

    def twin_loss(m, x):
        return jnp.sum(_twin(m, channels)(x, xq=X8) ** 2)

    expected = eqx.filter_jit(eqx.filter_grad(twin_loss))(model, *args)
    # The same straight-through gradients; the forward values (integer products here, float in the twin) differ in
    # their last bits, and the derivatives of `tanh` with them.
    np.testing.assert_allclose(np.asarray(grads.model.w), np.asarray(expected.w), rtol=1e-4, atol=1e-6)
    assert np.any(np.asarray(grads.model.w) != 0)


@pytest.mark.slow
def test_quantization_aware_training_with_optax():
    model, _, _ = CASES["bare_mlp"]
    x = _normal(64, 8)
    y = jnp.sin(x[:, :4])
    quantized = eqx_quant.quantize(model, eqx_quant.recipe("w8a8")["rules"], example=(x[0],))
    optimizer = optax.sgd(0.1)
    state = optimizer.init(eqx.filter(quantized, eqx.is_inexact_array))

    @eqx.filter_jit
    def step(m, state):
        loss, grads = eqx.filter_value_and_grad(lambda m: jnp.mean((jax.vmap(m)(x) - y) ** 2))(m)
        updates, state = optimizer.update(grads, state, m)
        return eqx.apply_updates(m, updates), state, loss

    losses = []
    for _ in range(30):
        quantized, state, loss = step(quantized, state)
        losses.append(float(loss))
    assert losses[-1] < 0.5 * losses[0]


@pytest.mark.slow
def test_calibrate_gives_each_product_and_each_layer_of_a_stack_its_input_scale():
    model, channels, _ = CASES["scan_stack"]
    data = [_normal(4, 8), _normal(4, 8, scale=3.0)]
    calibrated = eqx_quant.calibrate(_quantized("scan_stack"), data)
    (quantizer,) = calibrated.input_quants
    assert isinstance(quantizer, eqx_quant.LearnedFakeQuant) and quantizer.scale.shape == (3,)
    # By hand: the inputs each layer's product sees (weights quantized, inputs float), their max |x| per layer.
    twin = _twin(model, channels)
    tops = np.zeros(3, np.float32)
    for batch in data:
        h = batch
        for layer in range(3):
            tops[layer] = max(tops[layer], float(jnp.max(jnp.abs(h))))
            h = jnp.tanh(h @ twin.w[layer].T)
    np.testing.assert_array_equal(np.asarray(quantizer.scale), np_absmax_scale(tops, 127))
    # The calibrated model applies layer k's scale to layer k's input, and converts bit for bit.
    x = data[1][0]
    h = x
    for layer in range(3):
        h = jnp.tanh(twin.w[layer] @ eqx_quant.FakeQuant(float(quantizer.scale[layer]), -128, 127)(h))
    np.testing.assert_allclose(np.asarray(_call(calibrated, (x,), {})), np.asarray(h), rtol=1e-6, atol=1e-6)
    assert_bitwise_equal(_call(eqx_quant.convert(calibrated), (x,), {}), _call(calibrated, (x,), {}))


def test_a_weight_in_products_summing_over_different_axes():
    class Tied(eqx.Module):
        w: jax.Array
        v: jax.Array

        def __call__(self, x):
            return self.v @ (self.w.T @ jnp.tanh(self.w @ x))  # `w` summed over its axis 1, then over its axis 0

    model, x = Tied(_normal(4, 4), _normal(3, 4)), _normal(4)
    with pytest.raises(ValueError, match="'w' enters two products that sum over different axes"):
        eqx_quant.quantize(model, example=(x,))
    # Left out of the rules, it stays float and the rest is quantized.
    quantized = eqx_quant.quantize(model, [eqx_quant.Rule("w", weight=None, input=None), eqx_quant.Rule(".*")],
                                   example=(x,))  # fmt: skip
    assert quantized.weight_paths == ("v",)


def _gptq_inputs(model, channels, data):
    """By hand: the inputs of each product of BARE_MLP in the one-pass model (weights round to nearest, inputs
    float), as rows."""
    twin = _twin(model, channels)
    xs = jnp.concatenate(data)
    h1 = jax.nn.relu(xs @ twin.w_in.T)
    h2 = jax.nn.relu(h1 @ twin.w_mid.T)
    return {"w_in": xs, "w_mid": h1, "w_out": h2}


@pytest.mark.slow
def test_gptq_one_pass_is_gptq_quantize_on_each_product():
    model, channels, _ = CASES["bare_mlp"]
    data = [_normal(16, 8), _normal(16, 8)]
    solved = eqx_quant.gptq(_quantized("bare_mlp"), data, sequential=False)
    inputs = _gptq_inputs(model, channels, data)
    for path, transpose in (("w_in", False), ("w_mid", False), ("w_out", True)):
        x = np.asarray(inputs[path], np.float64)
        hessian = jnp.asarray(x.T @ x, jnp.float32)
        weight = getattr(model, path)
        levels, scales = eqx_quant.gptq_quantize(weight.T if transpose else weight, hessian, -128, 127)
        expected = np.asarray(scales, np.float32) * np.asarray(levels, np.float32)
        got = np.asarray(_leaf(solved.model, path))
        np.testing.assert_allclose(got.T if transpose else got, expected, rtol=1e-5, atol=1e-6)
        quantizer = solved.weight_quants[solved.weight_paths.index(path)]
        assert isinstance(quantizer, eqx_quant.FakeQuant)
        # The fixed quantizer reproduces GPTQ's levels exactly.
        assert_bitwise_equal(quantizer(_leaf(solved.model, path)), _leaf(solved.model, path))
    x = data[0][0]
    assert_bitwise_equal(_call(eqx_quant.convert(solved), (x,), {}), _call(solved, (x,), {}))


@pytest.mark.slow
def test_nan_inputs_of_traced_products_count_as_zeros_with_a_warning():
    # A NaN in the data makes its row of every later product's input NaN: GPTQ counts each product's non-finite
    # inputs (1, then a row of 16, then a row of 16), warns with the counts, and takes them as zeros in the Hessians.
    model, channels, _ = CASES["bare_mlp"]
    data = [_normal(16, 8).at[3, 2].set(jnp.nan), _normal(16, 8)]
    inputs = _gptq_inputs(model, channels, data)
    counts = {path: int(np.sum(~np.isfinite(x))) for path, x in inputs.items()}
    assert counts == {"w_in": 1, "w_mid": 16, "w_out": 16}
    expected = ", ".join(f"'model.{path}' {n}" for path, n in counts.items())  # the products' weights in the model
    with pytest.warns(UserWarning, match=rf"`gptq`: .* take as zeros or leave out: {expected}\."):
        solved = eqx_quant.gptq(_quantized("bare_mlp"), data, sequential=False)
    for path, transpose in (("w_in", False), ("w_mid", False), ("w_out", True)):
        x = np.nan_to_num(np.asarray(inputs[path], np.float64), nan=0.0)
        weight = getattr(model, path)
        levels, scales = eqx_quant.gptq_quantize(
            weight.T if transpose else weight, jnp.asarray(x.T @ x, jnp.float32), -128, 127
        )
        got = np.asarray(_leaf(solved.model, path))
        expected_weight = np.asarray(scales, np.float32) * np.asarray(levels, np.float32)
        np.testing.assert_allclose(got.T if transpose else got, expected_weight, rtol=1e-5, atol=1e-6)


@pytest.mark.slow
def test_sequential_gptq_and_autoround_reduce_the_output_error():
    w1 = _normal(32, 64, scale=0.15)
    w2 = _normal(16, 64, scale=0.12)

    class Mlp(eqx.Module):
        w1: jax.Array
        w2: jax.Array

        def __call__(self, x):
            return jnp.tanh(x @ self.w1) @ self.w2.T

    model = Mlp(w1, w2)
    xs = _normal(256, 32) @ _normal(32, 32, scale=0.5)
    rules = eqx_quant.recipe("w4a16_g32")["rules"]
    quantized = eqx_quant.quantize(model, rules, example=(xs[0],))
    reference = jax.vmap(model)(xs)
    error = lambda m: float(jnp.mean((_call(jax.vmap(m), (xs,), {}) - reference) ** 2))  # noqa: E731
    rtn = error(quantized)
    batches = [xs[:128], xs[128:]]
    assert error(eqx_quant.gptq(quantized, batches)) < 0.6 * rtn
    assert error(eqx_quant.autoround(quantized, batches, steps=40)) < rtn


def test_save_and_load_into_the_float_skeleton(tmp_path):
    quantized = eqx_quant.calibrate(_quantized("scan_stack"), [_normal(4, 8)])
    converted = eqx_quant.convert(quantized)
    path = tmp_path / "traced.eqx"
    eqx_quant.save(path, converted)
    skeleton = eqx.filter_eval_shape(lambda: STACK)
    loaded = eqx_quant.load(path, skeleton)
    assert isinstance(loaded, eqx_quant.nn.QuantTraced) and loaded.stacks == ((3,),)
    x = _normal(8)
    assert_bitwise_equal(_call(loaded, (x,), {}), _call(converted, (x,), {}))
    eqx_quant.save(path, quantized)  # not converted: the float weights and the quantizers
    assert_bitwise_equal(_call(eqx_quant.load(path, STACK), (x,), {}), _call(quantized, (x,), {}))


def test_learned_scales_start_from_round_to_nearest_and_are_trainable_scales():
    model, _, args = CASES["bare_mlp"]
    quantized = eqx_quant.quantize(model, eqx_quant.recipe("w8a8", learned=True)["rules"], example=args)
    quantizers = quantized.weight_quants
    assert all(isinstance(q, eqx_quant.LearnedFakeQuant) for q in quantizers)
    assert [q.scale.shape for q in quantizers] == [(16,), (16,), (4,)]
    params, _ = eqx.partition(quantized, eqx_quant.trainable(quantized, weights=False))
    assert [leaf.shape for leaf in jax.tree.leaves(params)] == [(16,), (16,), (4,)]
    # Initialised as round to nearest does: the same outputs as the dynamic quantizers.
    assert_bitwise_equal(_call(quantized, args, {}), _call(_quantized("bare_mlp"), args, {}))


@few_rows
def test_errors():
    model, _, args = CASES["bare_mlp"]
    with pytest.raises(ValueError, match="reaches none of the layers.*'w_in'"):
        eqx_quant.quantize(model, [eqx_quant.Rule("w_typo")], example=args)
    with pytest.raises(ValueError, match="no eqx.nn.Linear.*with `example=`"):
        eqx_quant.quantize(model)
    with pytest.raises(ValueError, match="no eqx.nn.Linear.*ConvTranspose.*with `example=`"):
        eqx_quant.quantize(eqx.nn.ConvTranspose1d(2, 2, 3, key=jax.random.key(0)))
    with pytest.raises(ValueError, match="sets `backward`"):
        eqx_quant.quantize(model, [eqx_quant.Rule(".*", backward=eqx_quant.UnquantizedBackward())], example=args)
    static = eqx_quant.FakeQuant((0.1,) * 16, -128, 127, axis=0)
    with pytest.raises(ValueError, match="'w_out'.*does not follow that product"):
        eqx_quant.quantize(model, [eqx_quant.Rule("w_out", weight=static)], example=args)
    with pytest.raises(ValueError, match="QuantTraced already"):
        eqx_quant.quantize(_quantized("bare_mlp"), example=args)
    with pytest.raises(ValueError, match="no eqx_quant.nn.Einsum"):
        eqx_quant.quantize(HEADS, eqx_quant.recipe("w8a8_attn")["rules"], example=CASES["einsum_heads"][2])

    class Loop(eqx.Module):
        w: jax.Array

        def __call__(self, x):
            return jax.lax.while_loop(lambda h: jnp.sum(h) < 10.0, lambda h: self.w @ h + 1.0, x)

    with pytest.raises(ValueError, match="'w'.*while_loop"):
        eqx_quant.quantize(Loop(_normal(4, 4)), example=(_normal(4),))
    with pytest.raises(ValueError, match=r"`where`=.* chooses none of the weights `gptq` can solve: \['model.kernel'"):
        eqx_quant.gptq(_quantized("conv"), [CASES["conv"][2][0][None]], where=lambda path, w: False)
    # A convolution's weight: left as it is, with the warning that names it, where the weights are chosen by default
    # (as quantized convolutions are); an error where `where` chooses it.
    message = re.escape("nor traced weight) with a weight quantizer to quantize with `gptq`: the traced weights ")
    with pytest.raises(ValueError, match=message + re.escape("['model.kernel'], whose products do not pair")):
        eqx_quant.gptq(_quantized("conv"), [CASES["conv"][2][0][None]])  # nothing else to solve

    # Beside a weight it can solve, the convolution's is left with a warning that points at the call.
    class ConvThenDense(eqx.Module):
        kernel: jax.Array
        w: jax.Array

        def __call__(self, x):
            h = jax.lax.conv_general_dilated(x[None], self.kernel, (1, 1), "SAME")
            return h.reshape(-1) @ self.w.T

    image = _normal(1, 4, 4)
    both = eqx_quant.quantize(ConvThenDense(_normal(2, 1, 3, 3), _normal(8, 32)), **eqx_quant.recipe("w8a16"),
                              example=(image,))  # fmt: skip
    with pytest.warns(
        UserWarning, match=re.escape("`gptq` cannot solve them: the traced weights ['model.kernel']")
    ) as caught:
        solved = eqx_quant.gptq(both, [image[None]])
    assert caught[0].filename == __file__
    assert np.array_equal(solved.model.kernel, both.model.kernel) and not np.array_equal(solved.model.w, both.model.w)
    message = re.escape("Traced weight 'model.kernel': `gptq` cannot solve it: its products do not pair the weight's")
    with pytest.raises(ValueError, match=message):
        eqx_quant.gptq(_quantized("conv"), [CASES["conv"][2][0][None]], where=lambda path, w: True)

    class Bare(eqx.Module):
        w: jax.Array

        def __call__(self, x):
            return self.w @ x

    def unread():  # batches that must not be read
        raise AssertionError("read")
        yield

    mx = eqx_quant.Rule(".*", weight=eqx_quant.DynamicFakeQuant("mxfp4", group_size=32), input=None)
    bare = eqx_quant.quantize(Bare(_normal(4, 32)), [mx], example=(_normal(32),))
    with pytest.raises(ValueError, match="Traced weight 'model.w': `method='mse'` searches float32 scales, and mxfp4"):
        eqx_quant.gptq(bare, unread(), method="mse")


def test_per_token_inputs(tmp_path):
    # Tokens mapped with the model's own `jax.vmap` reach the product as one operand (tokens, features); the recipe's
    # inputs are per token, which is what a linear layer mapped over the tokens gives. A rule's quantizer, applied as
    # it is, gives one scale for all of them.
    class Mapped(eqx.Module):
        w: jax.Array

        def __call__(self, x):
            return jax.vmap(lambda token: self.w @ token)(x)

    linear = init(lambda k: eqx.nn.Linear(8, 6, use_bias=False, key=k), 1)
    model, tokens = Mapped(linear.weight), _normal(4, 8) * jnp.arange(1.0, 5.0)[:, None]
    quantized_linear = eqx_quant.quantize(linear, eqx_quant.recipe("w8a8")["rules"])
    layer = jax.vmap(quantized_linear)
    per_token = eqx_quant.quantize(model, eqx_quant.recipe("w8a8")["rules"], example=(tokens,))
    per_tensor = eqx_quant.quantize(model, PER_TENSOR, example=(tokens,))
    assert per_token.per_token == (True,) and per_token.input_quants[0].layout.axes == (0,)
    assert per_tensor.per_token == (False,) and per_tensor.input_quants[0].layout.is_per_tensor()
    assert_bitwise_equal(_call(per_token, (tokens,), {}), _call(layer, (tokens,), {}))
    assert np.any(np.asarray(_call(per_tensor, (tokens,), {})) != np.asarray(_call(layer, (tokens,), {})))
    # A linear layer sees one token per call: its inputs stay per tensor. Calibration gives one static scale per
    # tensor, from all the tokens.
    assert quantized_linear.input_quant == X8
    calibrated = eqx_quant.calibrate(per_token, [tokens[None]])
    scale = np_absmax_scale(np.max(np.abs(np.asarray(tokens))), 127)
    assert isinstance(calibrated.input_quants[0], eqx_quant.FakeQuant)
    assert_bitwise_equal(np.float32(calibrated.input_quants[0].scale), scale)
    # The tokens are those of each call, whatever its rank: `x @ W.T` quantized with an example of 4 tokens, called
    # with one token (as when decoding), and with a batch of sequences, as the layer mapped over them; and a weight
    # applied both to all the tokens and to one vector.
    quantized = eqx_quant.quantize(Transposed(linear.weight), eqx_quant.recipe("w8a8")["rules"], example=(tokens,))
    assert_bitwise_equal(_call(quantized, (tokens[1],), {}), _call(quantized_linear, (tokens[1],), {}))
    sequences = jnp.stack([tokens, -2 * tokens[::-1]])
    assert_bitwise_equal(_call(quantized, (sequences,), {}), _call(jax.vmap(layer), (sequences,), {}))

    class Two(eqx.Module):
        w: jax.Array

        def __call__(self, x):
            return x @ self.w.T, self.w @ x[0]

    two = eqx_quant.quantize(Two(linear.weight), eqx_quant.recipe("w8a8")["rules"], example=(tokens,))
    all_tokens, first = _call(two, (tokens,), {})
    assert_bitwise_equal(all_tokens, _call(layer, (tokens,), {}))
    assert_bitwise_equal(first, _call(quantized_linear, (tokens[0],), {}))
    eqx_quant.save(tmp_path / "two.eqx", two)
    assert eqx_quant.load(tmp_path / "two.eqx", Two(linear.weight)).per_token == (True,)
    # A factory around the per-token quantizer, or a rule's quantizer with one scale per token of the example's
    # product, is taken as per token too.
    wrapped = [eqx_quant.Rule(".*", weight=W8, input=lambda path, product: eqx_quant.LayerQuantizer(
        8, input=True, per_token=True)(path, product))]  # fmt: skip
    rows = [eqx_quant.Rule(".*", weight=W8, input=DynamicFakeQuant(8, axis=0))]
    for rules in (wrapped, rows):
        quantized = eqx_quant.quantize(Transposed(linear.weight), rules, example=(tokens,))
        assert quantized.per_token == (True,)
        assert_bitwise_equal(_call(quantized, (tokens[1],), {}), _call(quantized_linear, (tokens[1],), {}))
    # A rule's quantizer is applied as it is, and must fit every product's input.
    with pytest.raises(ValueError, match="(?s)traced weight 'w'.*shape \\(8,\\).*Rule\\('w', input="):
        eqx_quant.quantize(Two(linear.weight), [eqx_quant.Rule("w", input=DynamicFakeQuant(8, axis=1))],
                           example=(tokens,))  # fmt: skip
    # A convolution's windows overlap: one scale per tensor.
    assert eqx_quant.quantize(CONV, eqx_quant.recipe("w8a8")["rules"], example=CASES["conv"][2]).input_quants[0] == X8
    with pytest.raises(ValueError, match="needs input=True"):
        eqx_quant.LayerQuantizer(8, per_token=True)
    with pytest.raises(ValueError, match="float32 scales; mxfp8_e4m3"):
        eqx_quant.LayerQuantizer("mxfp8_e4m3", 32, input=True, per_token=True)


@pytest.mark.slow
def test_nvfp4_inputs_take_their_tensor_scale_per_token():
    # NVFP4's second-level (tensor) scale of a dynamic input was one for the whole operand of a traced product: an
    # earlier token's quantized input depended on the later tokens (a causal model's decoding step differed from its
    # whole-sequence call), unlike a linear layer mapped over the tokens. Each token now takes its own, as it does
    # there; a product whose weight comes first (`W @ x.T`) too.
    class WeightFirst(eqx.Module):
        w: jax.Array

        def __call__(self, x):
            return (self.w @ x.T).T

    linear = init(lambda k: eqx.nn.Linear(64, 16, use_bias=False, key=k), 2)
    tokens = _normal(6, 64) * jnp.logspace(-1, 1, 6)[:, None]  # tokens of very different magnitudes
    layer = eqx_quant.quantize(linear, **eqx_quant.recipe("nvfp4"))
    rows = jax.vmap(layer.input_quant)(tokens)  # each token's input, quantized as the layer does
    for model in (WeightFirst(linear.weight), Transposed(linear.weight)):
        quantized = eqx_quant.quantize(model, **eqx_quant.recipe("nvfp4"), example=(tokens,))
        want = _call(type(model)(layer.weight), (rows,), {})  # the same product of the quantized operands
        assert_bitwise_equal(_call(quantized, (tokens,), {}), want)
        assert_bitwise_equal(_call(quantized, (tokens[:2],), {}), want[:2])  # the first tokens alone: the same
        assert_bitwise_equal(_call(eqx_quant.convert(quantized), (tokens,), {}), want)
    assert_bitwise_equal(_call(quantized, (tokens,), {}), _call(jax.vmap(layer), (tokens,), {}))

    # A rule's quantizer blocking the first of two summed axes: each token is blocked along that axis too.
    class TwoSummed(eqx.Module):
        w: jax.Array

        def __call__(self, x):
            return jnp.einsum("tab,abo->to", x, self.w)

    nvfp4 = DynamicFakeQuant(eqx_quant.format_named("nvfp4"), group_size=16, group_axis=-2)
    x = _normal(4, 32, 8) * jnp.logspace(-1, 1, 4)[:, None, None]
    model = eqx_quant.quantize(TwoSummed(_normal(32, 8, 4)), [eqx_quant.Rule(".*", weight=None, input=nvfp4)],
                               example=(x,))  # fmt: skip
    rows = jax.vmap(dataclasses.replace(nvfp4, layout=nvfp4.layout._replace(group_axis=-2)))(x)
    assert_bitwise_equal(_call(model, (x,), {}), _call(TwoSummed(model.model.w), (rows,), {}))
    # The recipe's NVFP4 inputs of such a product fall back to float8_e4m3fn (blocks run along one axis): one scale
    # per token, as a linear layer's input would have, not one for all the tokens of a call.
    with pytest.warns(UserWarning, match="sums over 2 of its axes .* gets float8_e4m3fn instead of nvfp4"):
        fallback = eqx_quant.quantize(TwoSummed(_normal(32, 8, 4)), **eqx_quant.recipe("nvfp4"), example=(x,))
    assert fallback.per_token == (True,) and fallback.input_quants[0].format.name == "float8_e4m3fn"
    rows = jax.vmap(DynamicFakeQuant(eqx_quant.format_named("float8_e4m3fn")))(x)
    want = _call(TwoSummed(fallback.weight_quants[0](fallback.model.w)), (rows,), {})
    assert_bitwise_equal(_call(fallback, (x,), {}), want)
    assert_bitwise_equal(_call(fallback, (x[:2],), {}), want[:2])


class TwoStacks(eqx.Module):
    """Raw stacked weights run with `lax.scan`: `a` `(layers, out, in)` used as `h @ a.T`, `b` `(layers, in, out)`
    used as `h @ b`."""

    a: jax.Array
    b: jax.Array

    def __call__(self, x, xq=identity):  # x: (tokens, d)
        step = lambda h, ab: (jnp.tanh(xq(jnp.tanh(xq(h) @ ab[0].T)) @ ab[1]), None)  # noqa: E731
        return jax.lax.scan(step, x, (self.a, self.b))[0]


def test_nvfp4_traced_stack_takes_one_tensor_scale_per_layer(tmp_path):
    # NVFP4's tensor scale of a stacked traced weight was one for the whole stack: with layer 0 a million times larger
    # than layer 1, layer 1 quantized to zeros. Each layer now takes its own, as a stack of linear layers does.
    a, b = _normal(2, 32, 32).at[0].multiply(1e6), _normal(2, 32, 32, scale=0.2)
    model, x = TwoStacks(a, b), _normal(4, 32)
    quantized = eqx_quant.quantize(model, **eqx_quant.recipe("nvfp4"), example=(x,))
    assert quantized.weight_paths == ("a", "b") and quantized.stacks == ((2,), (2,))
    nvfp4 = lambda axis: DynamicFakeQuant("nvfp4", group_size=16, group_axis=axis)  # noqa: E731
    fake = quantized.quantized_model()
    for got, w, axis in ((fake.a, a, -1), (fake.b, b, 0)):  # blocks along the summed axis of one layer
        for layer in range(2):  # each layer quantized on its own
            assert_bitwise_equal(got[layer], nvfp4(axis)(w[layer]))
        assert_bitwise_equal(got, jax.vmap(nvfp4(axis))(w))
    assert np.count_nonzero(fake.a[1]) > 0.9 * fake.a[1].size
    assert np.linalg.norm(fake.a[1] - a[1]) / np.linalg.norm(a[1]) < 0.2  # 1.0 (all zeros) with a shared scale
    # The model computes with those weights and each token's input quantized on its own.
    rows = jax.vmap(nvfp4(-1))
    assert_bitwise_equal(_call(quantized, (x,), {}), _call(TwoStacks(fake.a, fake.b), (x,), {"xq": rows}))

    converted = eqx_quant.convert(quantized)
    for stored, w, want in ((converted.model.a, a, fake.a), (converted.model.b, b, fake.b)):
        assert stored.layout.stacked == 1  # the whole leaf, one tensor scale per layer
        # Independently, in NumPy: each layer's tensor scale is its own largest magnitude over 448 * 6.
        assert_bitwise_equal(stored.tensor_scale, np.abs(np.asarray(w)).max(axis=(1, 2)) / np.float32(448 * 6))
        assert_bitwise_equal(stored.dequantize(), want)
    assert_bitwise_equal(eqx_quant.float_model(converted).a, fake.a)
    eager = converted(x)
    assert_bitwise_equal(eager, quantized(x))
    assert_bitwise_equal(_call(converted, (x,), {}), _call(quantized, (x,), {}))
    assert_bitwise_equal(_call(converted, (x,), {}), eager)
    assert {row.path for row in eqx_quant.summary(converted).rows} >= {"model.a", "model.b"}
    path = tmp_path / "nvfp4_stack.eqx"
    eqx_quant.save(path, converted)
    for like in (eqx.filter_eval_shape(lambda: model), converted):  # the float skeleton, the converted model
        loaded = eqx_quant.load(path, like)
        assert loaded.model.a.tensor_scale.shape == (2,)
        assert_bitwise_equal(_call(loaded, (x,), {}), eager)


class BareAttention(eqx.Module):
    """Projections `(heads, d, e)` and attention's two products with `jnp.einsum`, as protein and vision packages
    write them."""

    wq: jax.Array
    wk: jax.Array
    wv: jax.Array
    wo: jax.Array

    def __call__(self, x):  # (tokens, d)
        q, k, v = (jnp.einsum("td,hde->the", x, w) for w in (self.wq, self.wk, self.wv))
        scores = jnp.einsum("the,she->hts", q, k) / jnp.sqrt(jnp.float32(q.shape[-1]))
        mixed = jnp.einsum("hts,she->the", jax.nn.softmax(scores, axis=-1), v)
        return jnp.einsum("the,hed->td", mixed, self.wo)


ATTENTION = BareAttention(*(_normal(2, 8, 4, scale=0.4) for _ in range(3)), _normal(2, 4, 8, scale=0.4))


@pytest.mark.slow
def test_attention_products_written_with_einsum():
    x = _normal(5, 8)
    quantized = eqx_quant.quantize(ATTENTION, eqx_quant.recipe("w8a8_attn")["rules"], example=(x,))
    assert quantized.product_indices == (0, 1) and quantized.weight_paths == ("wq", "wk", "wv", "wo")
    assert all(pair == (X8, X8) for pair in quantized.product_quants)
    rows = {row.path: row for row in eqx_quant.summary(quantized).rows}
    assert rows["products.0"].kind == "traced product"

    @eqx.filter_jit
    def twin(m, x):  # every product's operands quantized by hand, weights per output channel
        m = _twin(m, {"wq": (0, 2), "wk": (0, 2), "wv": (0, 2), "wo": (2,)})
        q, k, v = (jnp.einsum("td,hde->the", XT(x), w) for w in (m.wq, m.wk, m.wv))
        scores = jnp.einsum("the,she->hts", X8(q), X8(k)) / jnp.sqrt(jnp.float32(4))
        mixed = jnp.einsum("hts,she->the", X8(jax.nn.softmax(scores, axis=-1)), X8(v))
        return jnp.einsum("the,hed->td", XT(mixed), m.wo)

    got = _call(quantized, (x,), {})
    np.testing.assert_allclose(np.asarray(got), np.asarray(twin(ATTENTION, x)), rtol=1e-5, atol=1e-5)
    assert_bitwise_equal(quantized(x), got)
    assert_bitwise_equal(_call(eqx_quant.convert(quantized), (x,), {}), got)
    # Without the products in the rules (`w8a8`), attention's products stay float: the outputs differ.
    weights_only = eqx_quant.quantize(ATTENTION, eqx_quant.recipe("w8a8")["rules"], example=(x,))
    assert weights_only.product_indices == ()
    assert np.max(np.abs(np.asarray(_call(weights_only, (x,), {})) - np.asarray(got))) > 1e-4
    # A rule reaching one product by name.
    rules = [eqx_quant.Rule("products\\.1", weight=None, input=None, products=X8), eqx_quant.Rule(".*")]
    assert eqx_quant.quantize(ATTENTION, rules, example=(x,)).product_indices == (1,)


class BareDecoder(eqx.Module):
    """A decoder written with bare arrays: a token table looked up and tied to the output head (`h @ table.T`),
    RMS norms with gains, rotary attention with `jnp.einsum`, a SwiGLU MLP, residuals, the blocks' weights stacked
    `(layers, ...)` and run with `jax.lax.scan`."""

    table: jax.Array  # (vocab, d)
    gains: jax.Array  # (layers, 2, d)
    wqkv: jax.Array  # (layers, d, 3, heads, e)
    wo: jax.Array  # (layers, heads, e, d)
    w_up: jax.Array  # (layers, 2, d, f)
    w_down: jax.Array  # (layers, f, d)

    def __call__(self, tokens):
        def norm(h, g):
            return h * jax.lax.rsqrt(jnp.mean(h * h, axis=-1, keepdims=True) + 1e-6) * g[None, :]

        def block(h, weights):
            gains, wqkv, wo, w_up, w_down = weights
            q, k, v = jnp.unstack(jnp.einsum("td,dche->cthe", norm(h, gains[0]), wqkv), axis=0)
            t = h.shape[0]
            scores = jnp.einsum("the,she->hts", rotary(q), rotary(k)) / jnp.sqrt(jnp.float32(q.shape[-1]))
            scores = jnp.where(jnp.tril(jnp.ones((t, t), bool))[None], scores, -1e30)
            h = h + jnp.einsum("hts,she,hed->td", jax.nn.softmax(scores, axis=-1), v, wo)
            gate, up = jnp.unstack(jnp.einsum("td,gdf->gtf", norm(h, gains[1]), w_up), axis=0)
            return h + (jax.nn.silu(gate) * up) @ w_down, None

        h, _ = jax.lax.scan(block, self.table[tokens], (self.gains, self.wqkv, self.wo, self.w_up, self.w_down))
        return h @ self.table.T


def rotary(x):
    t, _, d = x.shape
    angles = jnp.arange(t, dtype=jnp.float32)[:, None] / (100.0 ** (jnp.arange(0, d, 2, dtype=jnp.float32) / d))[None]
    cos, sin = jnp.cos(angles)[:, None, :], jnp.sin(angles)[:, None, :]
    x1, x2 = x[..., ::2], x[..., 1::2]
    return jnp.stack([x1 * cos - x2 * sin, x1 * sin + x2 * cos], axis=-1).reshape(x.shape)


DECODER = BareDecoder(
    _normal(11, 16), 1 + 0.1 * _normal(2, 2, 16), _normal(2, 16, 3, 2, 8, scale=0.25), _normal(2, 2, 8, 16, scale=0.2),
    _normal(2, 2, 16, 32, scale=0.25), _normal(2, 32, 16, scale=0.18),
)  # fmt: skip


@pytest.mark.slow
def test_a_bare_decoder_converts_bit_for_bit_dynamic_and_calibrated():
    tokens = jnp.array([1, 4, 2, 9, 0, 3])
    quantized = eqx_quant.quantize(DECODER, eqx_quant.recipe("w8a8_attn")["rules"], example=(tokens,))
    # The three-operand einsum `hts,she,hed->td` is two products: the mix of two activations, then the output
    # projection `wo`, a product of a weight. The token table is looked up and tied to the head: one traced weight.
    assert quantized.weight_paths == ("wqkv", "wo", "w_up", "w_down", "table")
    assert quantized.product_indices == (0, 1) and quantized.stacks == ((2,),) * 4 + ((),)
    reference = DECODER(tokens)
    for model in (quantized, eqx_quant.calibrate(quantized, [jnp.stack([tokens, tokens[::-1]])])):
        got = _call(model, (tokens,), {})
        assert float(jnp.max(jnp.abs(got - reference))) < 0.1 * float(jnp.max(jnp.abs(reference)))
        assert_bitwise_equal(_call(eqx_quant.convert(model), (tokens,), {}), got)
        assert_bitwise_equal(model(tokens), got)


class _Masked(eqx.Module):
    g: jax.Array

    def __call__(self, x):
        return x @ jnp.where(self.g > 0, self.g, 0.0)  # `jnp.where` passes its 0.0 into a jitted function


class _Stopped(eqx.Module):
    w: jax.Array

    def __call__(self, x):
        return x @ jax.lax.stop_gradient(self.w)


def test_a_weight_masked_by_where_is_refused_not_taken_for_an_activation():
    """`jnp.where(g > 0, g, 0.0)` passes its 0.0 into a jitted function: a constant there, so the masked weight is
    derived from `g` (refused, naming it), not an activation whose product would be one of two activations."""
    model, x = _Masked(_normal(8, 8)), _normal(3, 8)
    with pytest.raises(ValueError, match="'g' reaches a product through operations that are not views"):
        eqx_quant.quantize(model, eqx_quant.recipe("w8a8")["rules"], example=(x,))
    keep = [eqx_quant.Rule(".*", weight=None, input=None)]
    with pytest.raises(ValueError, match="nor, tracing `example`, a product of two activations"):
        eqx_quant.quantize(model, keep + eqx_quant.recipe("w8a8_attn")["rules"], example=(x,))


def test_a_product_of_two_arrays_of_the_model_counts_as_an_activation():
    class LowRank(eqx.Module):
        u: jax.Array
        v: jax.Array

        def __call__(self, x):
            return x @ (self.u @ self.v)

    model, x = LowRank(_normal(8, 2), _normal(2, 8)), _normal(3, 8)
    with pytest.raises(ValueError, match=r"reaches none of the layers; the model has none \(an array multiplied only"):
        eqx_quant.quantize(model, eqx_quant.recipe("w8a8")["rules"], example=(x,))
    quantized = eqx_quant.quantize(model, eqx_quant.recipe("w8a8_attn")["rules"], example=(x,))
    assert quantized.weight_paths == () and quantized.product_indices == (0,)


def test_a_weight_through_stop_gradient_is_quantized_as_the_weight_itself():
    model, x = _Stopped(_normal(8, 4)), _normal(3, 8)
    rules = eqx_quant.recipe("w8a8")["rules"]
    quantized = eqx_quant.quantize(model, rules, example=(x,))
    assert quantized.weight_paths == ("w",)
    expected = XT(x) @ DynamicFakeQuant(8, axis=1)(model.w)
    np.testing.assert_allclose(np.asarray(_call(quantized, (x,), {})), np.asarray(expected), rtol=1e-5, atol=1e-5)
    assert_bitwise_equal(_call(eqx_quant.convert(quantized), (x,), {}), _call(quantized, (x,), {}))


def test_products_that_sum_over_nothing_are_not_weight_products():
    class Gained(eqx.Module):
        gain: jax.Array
        w: jax.Array

        def __call__(self, x):  # x: (tokens, d)
            return jnp.einsum("td,d->td", x, self.gain) @ self.w.T  # the gain: a `dot_general` summing over nothing

    model, x = Gained(1 + _normal(8), _normal(4, 8)), _normal(3, 8)
    quantized = eqx_quant.quantize(model, eqx_quant.recipe("w8a8")["rules"], example=(x,))
    assert quantized.weight_paths == ("w",)
    with pytest.raises(ValueError, match="nor, tracing `example`, a product of two activations"):
        eqx_quant.quantize(model, eqx_quant.recipe("w8a8_attn")["rules"], example=(x,))
    expected = XT(x * model.gain[None, :]) @ DynamicFakeQuant(8, axis=0)(model.w).T
    np.testing.assert_allclose(np.asarray(_call(quantized, (x,), {})), np.asarray(expected), rtol=1e-5, atol=1e-5)


def test_weights_read_through_other_operations_than_views():
    class Fused(eqx.Module):
        wq: jax.Array
        wk: jax.Array
        w: jax.Array

        def __call__(self, x):  # x: (tokens, d)
            qk = x @ jnp.concatenate([self.wq, self.wk], axis=1)  # a concatenation: not a view of either weight
            return qk @ self.w

    model, x = Fused(_normal(8, 4), _normal(8, 4), _normal(8, 2)), _normal(3, 8)
    with pytest.raises(ValueError, match="'wq' reaches a product through operations that are not views"):
        eqx_quant.quantize(model, eqx_quant.recipe("w8a8")["rules"], example=(x,))
    # Each array of the concatenation is named: keeping the first float leaves the second to refuse.
    only_wq = [eqx_quant.Rule("wq", weight=None, input=None)]
    with pytest.raises(ValueError, match="'wk' reaches a product through operations that are not views"):
        eqx_quant.quantize(model, only_wq + eqx_quant.recipe("w8a8")["rules"], example=(x,))
    keep = [eqx_quant.Rule("w[qk]", weight=None, input=None)]
    # The fused product is neither a weight's (it stays float) nor one of two activations.
    with pytest.raises(ValueError, match="nor, tracing `example`, a product of two activations"):
        eqx_quant.quantize(model, keep + eqx_quant.recipe("w8a8_attn")["rules"], example=(x,))
    quantized = eqx_quant.quantize(model, keep + eqx_quant.recipe("w8a8")["rules"], example=(x,))
    assert quantized.weight_paths == ("w",) and quantized.float_paths == ("wq", "wk")
    qk = x @ jnp.concatenate([model.wq, model.wk], axis=1)
    expected = XT(qk) @ DynamicFakeQuant(8, axis=1)(model.w)
    np.testing.assert_allclose(np.asarray(_call(quantized, (x,), {})), np.asarray(expected), rtol=1e-5, atol=1e-5)


def test_a_weight_quantizer_not_fitting_its_traced_weight_is_refused_at_quantize():
    model, x = One(_normal(16, 8), "ti,io->to"), _normal(4, 16)  # `x @ w`: tiles along axis 0, of 16
    rules = [eqx_quant.Rule("w", weight=DynamicFakeQuant(4, group_size=5), input=None)]
    message = r"Traced weight 'w': its weight quantizer does not fit it, of shape \(16, 8\)"
    with pytest.raises(ValueError, match=message):
        eqx_quant.quantize(model, rules, example=(x,))
    rules = [eqx_quant.Rule("w", weight=DynamicFakeQuant(4, group_size=4), input=None)]
    quantized = eqx_quant.quantize(model, rules, example=(x,))
    expected = x @ DynamicFakeQuant(4, group_size=4, group_axis=0)(model.w)
    np.testing.assert_allclose(np.asarray(_call(quantized, (x,), {})), np.asarray(expected), rtol=1e-5, atol=1e-5)


def test_a_jit_helper_called_twice_keeps_each_calls_quantizers():
    product = jax.jit(lambda a, b: jnp.einsum("td,sd->ts", a, b))  # one jaxpr, shared by both call sites

    class Twice(eqx.Module):
        def __call__(self, x):
            return product(jnp.tanh(product(x, x)), x)

    x = _normal(4, 4)
    q4 = DynamicFakeQuant(4)
    rules = [eqx_quant.Rule("products\\.0", products=X8), eqx_quant.Rule("products\\.1", products=q4)]
    quantized = eqx_quant.quantize(Twice(), rules, example=(x,))
    assert quantized.product_indices == (0, 1)
    expected = jnp.einsum("td,sd->ts", q4(jnp.tanh(jnp.einsum("td,sd->ts", X8(x), X8(x)))), q4(x))
    np.testing.assert_allclose(np.asarray(_call(quantized, (x,), {})), np.asarray(expected), rtol=1e-5, atol=1e-5)


@pytest.mark.slow
def test_multihead_attention_and_a_bare_weight():
    class Block(eqx.Module):
        attention: eqx.nn.MultiheadAttention
        w: jax.Array

        def __call__(self, x):
            return self.attention(x, x, x) @ self.w

    block = Block(init(lambda k: eqx.nn.MultiheadAttention(2, 8, key=k), 0), _normal(8, 4))
    x = _normal(3, 8)
    quantized = eqx_quant.quantize(block, eqx_quant.recipe("w8a8_attn")["rules"], example=(x,))
    # The attention's products are its own, quantized as a layer's: no traced product of two activations.
    assert isinstance(quantized.model.attention, eqx_quant.nn.QuantMultiheadAttention)
    assert quantized.weight_paths == ("w",) and quantized.product_indices == ()
    expected = XT(_call(quantized.model.attention, (x, x, x), {})) @ DynamicFakeQuant(8, axis=1)(block.w)
    np.testing.assert_allclose(np.asarray(_call(quantized, (x,), {})), np.asarray(expected), rtol=1e-5, atol=1e-5)


def test_a_weight_in_a_while_loop_left_out_of_the_rules():
    class Loop(eqx.Module):
        w: jax.Array
        v: jax.Array

        def __call__(self, x):
            h = jax.lax.while_loop(lambda h: jnp.sum(h * h) < 100.0, lambda h: 1.5 * (self.w @ h) + 0.1, x)
            return self.v @ h

    model, x = Loop(_normal(4, 4), _normal(2, 4)), _normal(4)
    with pytest.raises(ValueError, match="'w' enters a dot_general inside a `jax.lax.while_loop`"):
        eqx_quant.quantize(model, example=(x,))
    rules = [eqx_quant.Rule("w", weight=None, input=None), eqx_quant.Rule(".*")]
    quantized = eqx_quant.quantize(model, rules, example=(x,))
    assert quantized.weight_paths == ("v",)
    hidden = jax.lax.while_loop(lambda h: jnp.sum(h * h) < 100.0, lambda h: 1.5 * (model.w @ h) + 0.1, x)
    expected = DynamicFakeQuant(8, axis=0)(model.v) @ X8(hidden)
    np.testing.assert_allclose(np.asarray(_call(quantized, (x,), {})), np.asarray(expected), rtol=1e-5, atol=1e-5)


def test_a_scan_over_part_of_a_stack():
    class Part(eqx.Module):
        w: jax.Array  # (3, d, d); the scan runs over its last two layers

        def __call__(self, x):
            return jax.lax.scan(lambda h, w: (jnp.tanh(w @ h), None), x, self.w[1:])[0]

    model, x = Part(_normal(3, 8, 8, scale=0.4)), _normal(8)
    quantized = eqx_quant.quantize(model, eqx_quant.recipe("w8a8")["rules"], example=(x,))
    assert quantized.stacks == ((),)  # no stack of input quantizers: one scale for both steps
    calibrated = eqx_quant.calibrate(quantized, [_normal(4, 8)])
    assert isinstance(calibrated.input_quants[0], eqx_quant.FakeQuant)
    assert_bitwise_equal(_call(eqx_quant.convert(calibrated), (x,), {}), _call(calibrated, (x,), {}))


def test_a_per_tensor_quantizer_on_a_scanned_stack_is_per_layer():
    quantized = eqx_quant.quantize(STACK, weights=DynamicFakeQuant(8), example=CASES["scan_stack"][2])
    assert quantized.weight_quants[0].layout.axes == (0,)  # one scale per layer of the stack


def test_shapes_stand_for_arrays_in_the_example():
    model, _, (x,) = CASES["bare_mlp"]
    quantized = eqx_quant.quantize(model, example=(jax.ShapeDtypeStruct(x.shape, x.dtype),))
    assert quantized.weight_paths == _quantized("bare_mlp").weight_paths


def test_a_call_that_takes_another_path_than_the_example():
    class Optional(eqx.Module):
        def __call__(self, x, context=None):
            if context is not None:  # a cross-attention first
                x = jnp.einsum("ts,sd->td", jax.nn.softmax(jnp.einsum("td,sd->ts", x, context)), context)
            return jnp.einsum("ts,sd->td", jax.nn.softmax(jnp.einsum("td,sd->ts", x, x)), x)

    x = _normal(3, 4)
    quantized = eqx_quant.quantize(Optional(), eqx_quant.recipe("w8a8_attn")["rules"], example=(x,))
    assert quantized.product_indices == (0, 1)
    with pytest.raises(ValueError, match="computes 4 products of two activations where the example computed 2"):
        quantized(x, x)


@pytest.mark.slow
def test_learn_scales_after_gptq_keeps_the_outputs():
    model, _, args = CASES["scan_stack"]
    solved = eqx_quant.gptq(_quantized("scan_stack"), [_normal(8, 8)], sequential=False)
    learned = eqx_quant.learn_scales(solved)
    (quantizer,) = learned.weight_quants
    assert isinstance(quantizer, eqx_quant.LearnedFakeQuant) and quantizer.scale.shape == (3, 8)
    np.testing.assert_array_equal(np.asarray(quantizer.scale), np.asarray(solved.weight_quants[0].scale, np.float32))
    assert_bitwise_equal(_call(learned, args, {}), _call(solved, args, {}))
    grads = eqx.filter_grad(lambda m: jnp.sum(m(*args) ** 2))(learned)
    assert np.any(np.asarray(grads.weight_quants[0].scale) != 0)  # the scales train


@pytest.mark.slow
def test_gptq_on_a_weight_whose_product_sums_over_two_of_its_axes():
    seen = {}

    def factory(path, product):
        seen[path] = product
        return eqx_quant.LayerQuantizer(8)(path, product)

    batch = _normal(6, 5, 8)
    quantized = eqx_quant.quantize(HEADS, [eqx_quant.Rule(".*", weight=factory, input=X8)], example=(batch[0],))
    wo = seen["wo"]
    assert wo.pairing is not None and set(wo.pairing) == {0, 1}  # `the,hed->td` sums over the output's h and e
    solved = eqx_quant.gptq(quantized, [batch], sequential=False)
    # By hand: the inputs `wo`'s product sees (wq round to nearest, inputs float), as rows over the summed axes in
    # the order the product pairs them, and GPTQ on `wo` laid out as (d, h*e) in that order.
    q = jnp.tanh(jnp.einsum("btd,hde->bthe", batch, DynamicFakeQuant(8, axis=(0, 2))(HEADS.wq)))
    inputs = np.moveaxis(np.asarray(q, np.float64), [a + 1 for a in wo.input_contracted], [2, 3]).reshape(-1, 8)
    hessian = jnp.asarray(inputs.T @ inputs, jnp.float32)
    matrix = jnp.moveaxis(HEADS.wo, wo.pairing, (1, 2)).reshape(8, 8)  # (d, the summed axes in pairing order)
    levels, scales = eqx_quant.gptq_quantize(matrix, hessian, -128, 127)
    summed = tuple(HEADS.wo.shape[a] for a in wo.pairing)
    expected = (np.asarray(scales, np.float32) * np.asarray(levels, np.float32)).reshape(8, *summed)
    expected = np.moveaxis(expected, (1, 2), wo.pairing)
    np.testing.assert_allclose(np.asarray(solved.model.wo), expected, rtol=1e-5, atol=1e-6)
    quantizer = solved.weight_quants[solved.weight_paths.index("wo")]
    assert isinstance(quantizer, eqx_quant.FakeQuant) and quantizer.layout.axes == (2,)
    assert_bitwise_equal(quantizer(solved.model.wo), solved.model.wo)


def test_rows_looked_up_by_the_input_are_activations():
    class Lookup(eqx.Module):
        table: jax.Array  # (vocab, d): looked up by the tokens, and tied to the output head
        w: jax.Array
        gain: jax.Array

        def __call__(self, tokens):
            h = self.table[tokens]
            h = h * jax.lax.rsqrt(jnp.mean(h * h, axis=-1, keepdims=True)) * self.gain[None, :]
            return jax.nn.relu(h @ self.w) @ self.table.T

    model, tokens = Lookup(_normal(11, 8), _normal(8, 8, scale=0.4), 1 + 0.1 * _normal(8)), jnp.array([1, 5, 2])
    quantized = eqx_quant.quantize(model, eqx_quant.recipe("w8a8")["rules"], example=(tokens,))
    assert quantized.weight_paths == ("w", "table")

    @eqx.filter_jit
    def twin(m, tokens):
        table, w = DynamicFakeQuant(8, axis=0)(m.table), DynamicFakeQuant(8, axis=1)(m.w)
        h = table[tokens]  # the table is quantized wherever it is read, its lookup included
        h = h * jax.lax.rsqrt(jnp.mean(h * h, axis=-1, keepdims=True)) * m.gain[None, :]
        return XT(jax.nn.relu(XT(h) @ w)) @ table.T

    got = _call(quantized, (tokens,), {})
    np.testing.assert_allclose(np.asarray(got), np.asarray(twin(model, tokens)), rtol=1e-5, atol=1e-5)


class _LinearThenBare(eqx.Module):
    fc: eqx.nn.Linear
    w: jax.Array

    def __call__(self, x):
        return self.w @ self.fc(x)


@pytest.mark.slow
def test_learned_layer_quantizers_beside_traced_weights():
    """With `learned=True`, a layer's weight reaches its product through its learned quantizer's arithmetic on the
    weight and its scales, all arrays of the layer: none of them is taken for a traced weight. The model is the one
    `learn_scales` makes of the dynamic one, bit for bit."""
    model = init(lambda k: _LinearThenBare(eqx.nn.Linear(8, 16, key=k), jnp.ones((4, 16))), 3)
    x = _normal(8)
    for recipe in ("w8a8", "w4a16_g32"):
        options = dict(group_size=8) if recipe == "w4a16_g32" else {}
        learned = eqx_quant.quantize(model, **eqx_quant.recipe(recipe, learned=True, **options), example=(x,))
        assert learned.weight_paths == ("w",)
        assert isinstance(learned.model.fc.weight_quant, eqx_quant.LearnedFakeQuant)
        dynamic = eqx_quant.quantize(model, **eqx_quant.recipe(recipe, **options), example=(x,))
        assert_bitwise_equal(learned(x), eqx_quant.learn_scales(dynamic)(x))
    # A bare weight computed with a layer's weight is the one the walk reports, not the layer's.
    mixed = init(lambda k: _LayerTimesBare(eqx.nn.Linear(8, 8, key=k), jnp.ones((8, 8))), 3)
    found = eqx_quant._traced.find_products(mixed, eqx_quant._traced.trace_call((x,)), ["fc"])
    assert list(found.problems) == ["w"] and not found.weights


class _LayerTimesBare(eqx.Module):
    fc: eqx.nn.Linear
    w: jax.Array

    def __call__(self, x):
        return (self.fc.weight * self.w) @ x


def test_tile_fallback_warnings_say_why_tiles_do_not_fit():
    """`wq` sums over its axis of 8 (tiles of 3 do not divide it); `wo` over two of its axes (tiles run along one):
    each gets one scale per channel instead, and the warning gives the reason that applies."""
    with pytest.warns(UserWarning) as caught:
        quantized = eqx_quant.quantize(HEADS, [eqx_quant.Rule(".*", weight=eqx_quant.LayerQuantizer(4, 3))],
                                       example=(_normal(5, 8),))  # fmt: skip
    messages = sorted(str(w.message) for w in caught)
    assert messages == [
        "Traced weight 'wo': its product sums over 2 of its axes ((0, 1) of (2, 4, 8)), and tiles run along one, so "
        "it gets one scale per channel instead of int4 in tiles of 3.",
        "Traced weight 'wq': its product's contraction (axes (1,) of (2, 8, 4)) does not split into tiles of 3, so it "
        "gets one scale per channel instead of int4 in tiles of 3.",
    ]
    assert [q.layout.group_size for q in quantized.weight_quants] == [None, None]


class _RowsTimesWeight(eqx.Module):
    w: jax.Array

    def __call__(self, x):  # one token (features,) or several (tokens, features)
        return x @ self.w.T


def test_block_inputs_tile_the_contracted_axis_of_every_call():
    """The blocks of an MX input run along the product's contracted axis, counted from the end: an example of one
    token, called with a batch, quantizes each token as `jax.vmap` does; an example of a batch takes one token. Both
    are the float product of the block-quantized operands (MX scales hold no per-tensor part)."""
    model = _RowsTimesWeight(_normal(16, 64))
    tokens = _normal(6, 64)
    weights, inputs = eqx_quant.MXFakeQuant("mxfp4"), eqx_quant.MXFakeQuant("mxfp8_e4m3")  # the recipe's
    expected = np.asarray(inputs(tokens) @ weights(model.w).T)
    one = eqx_quant.quantize(model, **eqx_quant.recipe("mxfp4"), example=(tokens[0],))
    assert one.input_quants[0].layout.group_axis == -1
    assert_bitwise_equal(one(tokens), jax.vmap(one)(tokens))
    np.testing.assert_allclose(one(tokens), expected, rtol=1e-6, atol=1e-6)
    batch = eqx_quant.quantize(model, **eqx_quant.recipe("mxfp4"), example=(tokens,))
    np.testing.assert_allclose(batch(tokens[0]), expected[0], rtol=1e-6, atol=1e-6)


class _Shuffled(eqx.Module):
    w: jax.Array  # (32, 16)

    def __call__(self, x):
        return x @ self.w.reshape(4, 8, 16).transpose(1, 0, 2).reshape(32, 16)


def test_a_weight_whose_summed_axis_is_split_and_merged_again_is_not_a_view():
    """Splitting the summed axis, transposing the parts and merging them puts the rows in another order: the leaf's
    tiles along that axis are no longer the product's (the integer product used other tiles' scales), so the weight
    is refused, naming it."""
    x = jnp.ones((2, 32))
    model = _Shuffled(jnp.ones((32, 16)))
    with pytest.raises(ValueError, match=r"The weight 'w' reaches a product .* puts back together the parts of an"):
        eqx_quant.quantize(model, eqx_quant.recipe("w8a8")["rules"], example=(x[0],))
