"""Integer conversion: `convert`, the integer layers, 4-bit packing, the integer forward of the quantized layers,
`save` / `load` and the safetensors export."""

import dataclasses
import json
import re
import struct

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import safetensors.numpy

import eqx_quant
from eqx_quant import (
    NIBBLE_ORDER,
    DynamicFakeQuant,
    FakeQuant,
    LearnedFakeQuant,
    PassthroughClip,
    convert,
    export_safetensors,
    load,
    pack_int4,
    quantize,
    save,
    unpack_int4,
)
from eqx_quant._int_ops import ConvSpec, int_conv, safe_contraction
from eqx_quant.nn import IntConv, IntEmbedding, IntLinear, QuantConv, QuantEmbedding, QuantizedTensor, QuantLinear
from examples import qat_demo as demo

from .helpers import (
    assert_bitwise_equal,
    assert_trees_equal,
    init,
    reference_fake_quant,
    slow_unless,
    zeros_like_tree,
)


INT32_MAX = 2**31 - 1


# ---------------------------------------------------------------------------------------------------------------------
# Construction, application and NumPy references.


def normal(seed: int, shape, loc: float = 0.0) -> jax.Array:
    return jnp.asarray(np.random.default_rng(seed).normal(loc, 1.0, shape).astype(np.float32))


def with_weight(layer, weight):
    return eqx.tree_at(lambda l: l.weight, layer, jnp.asarray(weight, jnp.float32))


@eqx.filter_jit
def apply(model, x):
    return model(x)


@eqx.filter_jit
def apply_batch(model, xs):
    return jax.vmap(model)(xs)


@eqx.filter_jit
def quantization_params(quantizer, w):
    return quantizer.quantization_params(w)


def f32(a) -> np.ndarray:
    return np.asarray(a, np.float32)


def np_levels(x, scale, zero_point, qmin, qmax) -> np.ndarray:
    """NumPy `clip(round(x * (1 / scale)) + zero_point, qmin, qmax)`, with the reciprocal taken in float32."""
    s, z = f32(scale), f32(zero_point)
    return np.clip(np.round(f32(x) * (np.float32(1) / s)) + z, qmin, qmax)


def np_rescale(acc, w_scale, x_scale, bias) -> np.ndarray:
    """`(acc * scale_w) * scale_x + bias` in float32, `scale_w` along the output channels: each product rounded, then
    the bias added to the rescaled sum."""
    acc = np.asarray(acc).astype(np.float32)
    sw = f32(w_scale).reshape((-1,) + (1,) * (acc.ndim - 1))
    y = (acc * sw) * np.float32(x_scale)
    if bias is not None:
        y = y + f32(bias).reshape(acc.shape[:1] + (1,) * (acc.ndim - 1))
    return y


def np_int_conv(w, x, stride, padding, dilation, groups) -> np.ndarray:
    """A direct int64 convolution, looping over output positions: `w` of shape `(out, in // groups, *kernel)`, `x`
    of shape `(in, *spatial)`."""
    w, x = np.asarray(w, np.int64), np.asarray(x, np.int64)
    nd = x.ndim - 1
    xp = np.pad(x, [(0, 0)] + [tuple(p) for p in padding])
    kernel, cin, per_group = w.shape[2:], w.shape[1], w.shape[0] // groups
    spans = [dilation[d] * (kernel[d] - 1) + 1 for d in range(nd)]
    out_shape = tuple((xp.shape[1 + d] - spans[d]) // stride[d] + 1 for d in range(nd))
    out = np.zeros((w.shape[0],) + out_shape, np.int64)
    for o in range(w.shape[0]):
        g = o // per_group
        xg = xp[g * cin : (g + 1) * cin]
        for pos in np.ndindex(*out_shape):
            window = tuple(slice(pos[d] * stride[d], pos[d] * stride[d] + spans[d], dilation[d]) for d in range(nd))
            out[(o,) + pos] = np.sum(w[o] * xg[(slice(None),) + window])
    return out


def np_chunked(w_int, x_int, chunk) -> np.ndarray:
    """Per-chunk int64 products, each rounded to float32, summed in float32 in order."""
    acc = np.zeros(w_int.shape[0], np.float32)
    for start in range(0, x_int.shape[0], chunk):
        part = w_int[:, start : start + chunk] @ x_int[start : start + chunk]
        acc = acc + part.astype(np.float32)
    return acc


def int32_wrap(a) -> np.ndarray:
    return (np.asarray(a, np.int64) + 2**31) % 2**32 - 2**31


def py_pack(values) -> np.ndarray:
    """Packs rows of 4-bit values with a plain Python loop: element 2i in bits 0-3, element 2i+1 in bits 4-7."""
    rows = []
    for row in np.asarray(values).tolist():
        row = row + [0] * (len(row) % 2)
        rows.append([(row[2 * i] & 0xF) | ((row[2 * i + 1] & 0xF) << 4) for i in range(len(row) // 2)])
    return np.asarray(rows, np.uint8)


def py_unpack(packed, n, signed) -> np.ndarray:
    rows = []
    for row in np.asarray(packed).tolist():
        nibbles = []
        for byte in row:
            nibbles += [byte & 0xF, byte >> 4]
        if signed:
            nibbles = [v - 16 if v >= 8 else v for v in nibbles]
        rows.append(nibbles[:n])
    return np.asarray(rows, np.int64)


def uses_int_product(model, x) -> bool:
    """Whether the traced forward contains a product or convolution accumulated in int32."""
    return "preferred_element_type=int32" in str(jax.make_jaxpr(model)(x))


def channel_shape(ndim: int, axis: int | None, n: int) -> tuple[int, ...]:
    if axis is None:
        return (1,) * ndim
    return tuple(n if i == axis % ndim else 1 for i in range(ndim))


def reference_grid(quantizer, w):
    """`(view, scale, zero_point, qmin, qmax)` that `quantizer` uses on `w`, from its own parameters; the scale and
    zero point broadcast against the view."""
    w = f32(w)
    if isinstance(quantizer, DynamicFakeQuant):
        scale, zp = (np.asarray(a) for a in quantization_params(quantizer, jnp.asarray(w)))
        if quantizer.group_size is not None:
            view = w.reshape(w.shape[:-1] + (-1, quantizer.group_size))
            return view, scale[..., None], zp[..., None], quantizer.qmin, quantizer.qmax
        shape = channel_shape(w.ndim, quantizer.axis, scale.size)
        return w, scale.reshape(shape), zp.reshape(shape), quantizer.qmin, quantizer.qmax
    if isinstance(quantizer, FakeQuant):
        scale, zp = f32(quantizer.scale), f32(quantizer.zero_point)
        n = max(scale.size, zp.size)
        shape = channel_shape(w.ndim, quantizer.axis, n)
        scale, zp = np.broadcast_to(scale, (n,)), np.broadcast_to(zp, (n,))
        return w, scale.reshape(shape), zp.reshape(shape), quantizer.qmin, quantizer.qmax
    assert isinstance(quantizer, LearnedFakeQuant)
    scale = np.maximum(f32(quantizer.scale), np.float32(quantizer.min_scale))
    zp = np.zeros_like(scale) if quantizer.zero_point is None else f32(quantizer.zero_point)
    zp = np.round(np.clip(zp, quantizer.qmin, quantizer.qmax))
    shape = channel_shape(w.ndim, quantizer.axis, scale.size)
    return w, scale.reshape(shape), zp.reshape(shape), quantizer.qmin, quantizer.qmax


def wrap(layer, **kwargs):
    wrapper = QuantLinear if isinstance(layer, eqx.nn.Linear) else QuantConv
    return wrapper(layer, **kwargs)


# ---------------------------------------------------------------------------------------------------------------------
# 4-bit packing.


@pytest.mark.slow
def test_pack_int4_layout_by_hand():
    packed = pack_int4(jnp.array([[1, -2, 7], [-8, 0, -1]], jnp.int8))
    # row 0: 1 -> 0x1 (low), -2 -> 0xE (high); 7 -> 0x7 beside a zero pad nibble. row 1: -8 -> 0x8, 0; -1 -> 0xF.
    assert packed.dtype == jnp.uint8
    np.testing.assert_array_equal(np.asarray(packed), np.array([[0xE1, 0x07], [0x08, 0x0F]], np.uint8))
    np.testing.assert_array_equal(np.asarray(unpack_int4(packed, 3)), [[1, -2, 7], [-8, 0, -1]])
    unsigned = pack_int4(jnp.array([[3, 15, 0, 9]], jnp.int32))
    np.testing.assert_array_equal(np.asarray(unsigned), np.array([[0xF3, 0x90]], np.uint8))
    np.testing.assert_array_equal(np.asarray(unpack_int4(unsigned, 4, signed=False)), [[3, 15, 0, 9]])
    assert NIBBLE_ORDER == "low-first"


@pytest.mark.parametrize("n", [1, 6, 13])
@pytest.mark.slow
def test_pack_unpack_round_trip_against_python_loop(n):
    rng = np.random.default_rng(n)
    for signed, lo, hi in ((True, -8, 8), (False, 0, 16)):
        values = rng.integers(lo, hi, size=(3, n))
        values[0, 0], values[-1, -1] = lo, hi - 1  # both ends of the range
        packed = pack_int4(jnp.asarray(values, jnp.int8 if signed else jnp.int32))
        assert packed.dtype == jnp.uint8 and packed.shape == (3, (n + 1) // 2)
        np.testing.assert_array_equal(np.asarray(packed), py_pack(values))
        unpacked = unpack_int4(packed, n, signed=signed)
        assert unpacked.dtype == jnp.int8
        np.testing.assert_array_equal(np.asarray(unpacked), values)
        np.testing.assert_array_equal(py_unpack(np.asarray(packed), n, signed), values)


# ---------------------------------------------------------------------------------------------------------------------
# What `convert` produces.


@pytest.mark.slow
def test_convert_structure_dtypes_and_no_float_weight():
    model = {
        "emb": QuantEmbedding(init(lambda k: eqx.nn.Embedding(10, 6, key=k), 0)),
        "lin8": QuantLinear(init(lambda k: eqx.nn.Linear(8, 6, key=k), 1)),
        "lin4": QuantLinear(init(lambda k: eqx.nn.Linear(7, 4, key=k), 2), weight_quant=DynamicFakeQuant(4, axis=0)),
        "conv4": QuantConv(
            init(lambda k: eqx.nn.Conv2d(2, 3, 3, key=k), 3),
            weight_quant=DynamicFakeQuant(4, signed=False, symmetric=False),
        ),
        "plain": QuantLinear(init(lambda k: eqx.nn.Linear(3, 3, key=k), 4), weight_quant=None),
        "bare": QuantLinear(init(lambda k: eqx.nn.Linear(3, 3, key=k), 5), weight_quant=None, input_quant=None),
        "other": jnp.arange(3.0),
    }
    converted = convert(model)
    assert isinstance(converted["emb"], IntEmbedding)
    assert isinstance(converted["lin8"], IntLinear) and isinstance(converted["lin4"], IntLinear)
    assert isinstance(converted["conv4"], IntConv)
    # No weight quantizer: nothing to store. The quantized input still shapes the output, so the layer stays; with
    # neither quantizer it becomes its float layer.
    assert converted["plain"] is model["plain"] and converted["bare"] is model["bare"].layer
    x = jnp.array([0.3, -1.7, 0.05])
    assert_bitwise_equal(converted["plain"](x), model["plain"](x))
    assert not np.array_equal(np.asarray(model["plain"](x)), np.asarray(model["plain"].layer(x)))
    assert converted["other"] is model["other"]

    expected = {  # name: (values dtype, values shape, packed)
        "emb": (jnp.int8, (10, 6), False),
        "lin8": (jnp.int8, (6, 8), False),
        "lin4": (jnp.uint8, (4, 4), True),  # 7 values per row -> 4 bytes
        "conv4": (jnp.uint8, (3, 9), True),  # 2 * 3 * 3 = 18 values per output channel -> 9 bytes
    }
    for name, (dtype, shape, packed) in expected.items():
        layer, float_weight = converted[name], model[name].layer.weight
        assert isinstance(layer.qweight, QuantizedTensor)
        assert layer.qweight.values.dtype == dtype and layer.qweight.values.shape == shape
        assert layer.qweight.packed is packed and layer.weight.shape == float_weight.shape
        assert layer.layer.weight is None
        assert layer.qweight.scale.dtype == jnp.float32
        for leaf in jax.tree.leaves(layer):
            if eqx.is_inexact_array(leaf):
                assert leaf.shape != float_weight.shape and leaf.size < float_weight.size, (name, leaf.shape)
    zero_point = converted["conv4"].qweight.zero_point
    assert zero_point is not None and zero_point.dtype == jnp.float32
    assert converted["lin8"].qweight.zero_point is None

    # The nibbles of the stored bytes are the levels, element 2i low and 2i+1 high, row by row.
    for name in ("lin4", "conv4"):
        layer, w = converted[name], model[name].layer.weight
        view, scale, zp, qmin, qmax = reference_grid(model[name].weight_quant, w)
        levels = np_levels(view, scale, zp, qmin, qmax).reshape(w.shape[0], -1).astype(np.int64)
        values = np.asarray(layer.qweight.values)
        for r in range(levels.shape[0]):
            for j in range(levels.shape[1]):
                byte = int(values[r, j // 2])
                nibble = (byte >> 4) if j % 2 else (byte & 0xF)
                assert nibble == levels[r, j] & 0xF, (name, r, j)
            if levels.shape[1] % 2:
                assert int(values[r, -1]) >> 4 == 0  # the pad nibble

    # The converted layers compute what the quantized ones did.
    for index in (0, 9):
        assert_bitwise_equal(converted["emb"](jnp.asarray(index)), model["emb"](jnp.asarray(index)))
    indices = jnp.arange(10)
    table = apply_batch(model["emb"], indices)
    assert_bitwise_equal(apply_batch(converted["emb"], indices), table)
    view, scale, zp, qmin, qmax = reference_grid(model["emb"].weight_quant, model["emb"].layer.weight)
    assert_bitwise_equal(table, reference_fake_quant(view, scale, qmin, qmax, zp))
    x7 = normal(0, (3, 7))
    assert_bitwise_equal(apply_batch(converted["lin4"], x7), apply_batch(model["lin4"], x7))
    img = normal(1, (3, 2, 5, 5))
    assert_bitwise_equal(apply_batch(converted["conv4"], img), apply_batch(model["conv4"], img))


def test_packed_weight_by_hand():
    """A 1x3 weight on the symmetric 4-bit grid: scale 1/7, levels [2, -7, 4] -> bytes 0x92, 0x04."""
    linear = with_weight(init(lambda k: eqx.nn.Linear(3, 1, key=k), 0), [[0.3, -1.0, 0.6]])
    layer = convert(QuantLinear(linear, weight_quant=DynamicFakeQuant(4)))
    np.testing.assert_array_equal(np.asarray(layer.qweight.values), np.array([[0x92, 0x04]], np.uint8))
    np.testing.assert_array_equal(np.asarray(layer.qweight.levels()), [[2, -7, 4]])
    np.testing.assert_allclose(np.asarray(layer.qweight.scale).reshape(()), 1 / 7, rtol=1e-6)


WEIGHT_QUANTIZERS = {
    "dynamic-tensor-sym8": lambda w: DynamicFakeQuant(8),
    "dynamic-channel-sym4": lambda w: DynamicFakeQuant(4, axis=0),
    "dynamic-channel-asym8": lambda w: DynamicFakeQuant(8, axis=0, symmetric=False),
    "dynamic-channel-unsigned4": lambda w: DynamicFakeQuant(4, axis=0, signed=False, symmetric=False),
    "dynamic-group-sym4": lambda w: DynamicFakeQuant(4, axis=0, group_size=4),
    "dynamic-group-asym8": lambda w: DynamicFakeQuant(8, group_size=4, symmetric=False),
    "static-channel-minmax8": lambda w: FakeQuant.calibrate(w, 8, axis=0, method="minmax"),
    "static-channel-clipping4": lambda w: FakeQuant.from_bits(4, 0.5 * np.abs(np.asarray(w)).max(1) / 7, axis=0),
    "learned-channel4": lambda w: LearnedFakeQuant.init_from(w, 4, axis=0),
    "learned-tensor-asym8": lambda w: LearnedFakeQuant.init_from(w, 8, symmetric=False),
}


@pytest.mark.parametrize("name", list(WEIGHT_QUANTIZERS))
@pytest.mark.slow
def test_stored_integers_are_those_of_the_fake_quant_forward(name):
    # an offset per column, so that asymmetric grids matter
    w = np.random.default_rng(3).normal(0, 1, (6, 8)).astype(np.float32) + np.linspace(-0.1, 0.6, 8, dtype=np.float32)
    w = jnp.asarray(w)
    linear = with_weight(init(lambda k: eqx.nn.Linear(8, 6, key=k), 3), w)
    quantizer = WEIGHT_QUANTIZERS[name](w)
    tensor = convert(QuantLinear(linear, weight_quant=quantizer)).qweight

    assert_bitwise_equal(tensor.dequantize(), quantizer(w))
    view, scale, zp, qmin, qmax = reference_grid(quantizer, w)
    expected = np_levels(view, scale, zp, qmin, qmax)
    levels = np.asarray(tensor.levels())
    assert levels.dtype == np.int8 and levels.shape == view.shape
    np.testing.assert_array_equal(levels, expected)
    assert tensor.packed == (qmax - qmin <= 15)
    assert tensor.format == eqx_quant.IntFormat(qmin, qmax)
    assert_bitwise_equal(np.broadcast_to(np.asarray(tensor.scale), view.shape), np.broadcast_to(scale, view.shape))
    stored_zp = np.zeros((), np.float32) if tensor.zero_point is None else np.asarray(tensor.zero_point)
    np.testing.assert_array_equal(np.broadcast_to(stored_zp, view.shape), np.broadcast_to(zp, view.shape))
    # and the dequantized weight is the NumPy fake quantization
    assert_bitwise_equal(tensor.dequantize(), reference_fake_quant(view, scale, qmin, qmax, zp).reshape(w.shape))


# ---------------------------------------------------------------------------------------------------------------------
# Integer forward: converted layers == quantized layers == NumPy integer reference.


PARITY_CASES = {
    # name: (float layer, weight quantizer, input calibration method, input bits, input shape)
    "linear-tensor-sym-w8-asym-a8": (lambda k: eqx.nn.Linear(8, 6, key=k), DynamicFakeQuant(8), "minmax", 8, (8,)),
    "linear-channel-asym-w4-sym-a4": (
        lambda k: eqx.nn.Linear(8, 6, key=k),
        DynamicFakeQuant(4, axis=0, symmetric=False),
        "absmax",
        4,
        (8,),
    ),
    "conv1d-channel-sym-stride": (
        lambda k: eqx.nn.Conv1d(3, 4, 3, stride=2, padding=1, key=k),
        DynamicFakeQuant(8, axis=0),
        "minmax",
        8,
        (3, 9),
    ),
    "conv2d-tensor-asym-groups": (
        lambda k: eqx.nn.Conv2d(
            4, 6, (3, 2), stride=(2, 1), padding=((1, 0), (1, 1)), dilation=(1, 2), groups=2, key=k
        ),
        DynamicFakeQuant(8, symmetric=False),
        "minmax",
        8,
        (4, 6, 5),
    ),
}


def reference_forward(layer, weight_quant, input_quant, x) -> np.ndarray:
    """The NumPy integer forward: int64 `(W - zw) (*) (x - zx)`, bias on the accumulator grid, one rescale."""
    view, sw, zw, wmin, wmax = reference_grid(weight_quant, layer.weight)
    w_int = (np_levels(view, sw, zw, wmin, wmax) - zw).astype(np.int64)
    _, sx, zx, xmin, xmax = reference_grid(input_quant, x)
    sx, zx = np.float32(sx.reshape(())), np.float32(zx.reshape(()))
    x_int = (np_levels(x, sx, zx, xmin, xmax) - zx).astype(np.int64)
    bias = None if layer.bias is None else f32(layer.bias)
    if isinstance(layer, eqx.nn.Linear):
        acc = w_int @ x_int
    else:
        acc = np_int_conv(w_int, x_int, layer.stride, layer.padding, layer.dilation, layer.groups)
    return np_rescale(acc, sw, sx, bias)


@pytest.mark.parametrize("name", slow_unless(list(PARITY_CASES)[:1], list(PARITY_CASES)))
def test_integer_forward_parity(name):
    make, weight_quant, method, input_bits, shape = PARITY_CASES[name]
    layer = init(make, len(name))
    xs = normal(len(name), (5,) + shape, loc=0.4)
    input_quant = FakeQuant.calibrate(xs[:4], input_bits, method=method)
    assert (input_quant.zero_point != 0) == (method == "minmax")
    quant = wrap(layer, weight_quant=weight_quant, input_quant=input_quant)
    converted = convert(quant)
    assert uses_int_product(quant, xs[0]) and uses_int_product(converted, xs[0])

    expected = np.stack([reference_forward(layer, weight_quant, input_quant, np.asarray(x)) for x in xs])
    assert_bitwise_equal(converted(xs[0]), expected[0])  # eager
    assert_bitwise_equal(quant(xs[0]), expected[0])
    assert_bitwise_equal(apply(converted, xs[1]), expected[1])  # jit
    assert_bitwise_equal(apply_batch(converted, xs), expected)  # jit of vmap
    assert_bitwise_equal(apply_batch(quant, xs), expected)
    # the float product of the fake-quantized operands agrees to summation error (the bias to 2**-17 of a step)
    as_float = wrap(layer, weight_quant=weight_quant, input_quant=input_quant, matmul="float")
    tolerance = 1e-5
    np.testing.assert_allclose(np.asarray(apply_batch(as_float, xs)), expected, rtol=0, atol=tolerance)


@pytest.mark.slow
def test_default_quantizers_integer_forward():
    """The default quantizers: 8 bits per output channel for the weight, 8 bits per tensor with a scale computed
    at every call for the input."""
    cases = (
        (lambda k: eqx.nn.Linear(8, 6, key=k), (8,)),
        (lambda k: eqx.nn.Conv2d(2, 3, 3, padding=1, key=k), (2, 5, 5)),
    )
    for make, shape in cases:
        layer = init(make, 41)
        quant = wrap(layer)
        assert isinstance(quant.input_quant, DynamicFakeQuant) and quant.input_quant.axis is None
        converted = convert(quant)
        xs = normal(41, (3,) + shape)
        expected = np.stack([reference_forward(layer, quant.weight_quant, quant.input_quant, x) for x in xs])
        assert uses_int_product(converted, xs[0]) and uses_int_product(quant, xs[0])
        assert_bitwise_equal(converted(xs[0]), expected[0])
        assert_bitwise_equal(quant(xs[0]), expected[0])
        assert_bitwise_equal(apply_batch(converted, xs), expected)
        assert_bitwise_equal(apply_batch(quant, xs), expected)


@pytest.mark.slow
def test_bias_is_added_to_the_rescaled_sum():
    """`y = (acc * s_w) * s_x + b`: the bias joins at full float32 precision, after the rescaling."""
    linear = init(lambda k: eqx.nn.Linear(2, 1, key=k), 0)
    linear = eqx.tree_at(lambda l: (l.weight, l.bias), linear, (jnp.array([[1.0, -0.5]]), jnp.array([0.3])))
    quant = QuantLinear(
        linear, weight_quant=FakeQuant(0.5, -128, 127), input_quant=FakeQuant(0.25, -128, 127, zero_point=3)
    )
    x = jnp.array([1.0, 0.5])
    # w levels [2, -1]; x levels [4 + 3, 2 + 3] - 3 = [4, 2]; acc = 2 * 4 - 1 * 2 = 6; 6 * 0.5 * 0.25 = 0.75 exactly,
    # and 0.75 + fl(0.3) rounds once.
    expected = np.array([np.float32(0.75) + np.float32(0.3)], np.float32)
    assert float(expected[0]) == float(np.float32(1.05))
    assert_bitwise_equal(quant(x), expected)
    assert_bitwise_equal(convert(quant)(x), expected)
    assert_bitwise_equal(apply(convert(quant), x), expected)


@pytest.mark.slow
def test_float_path_for_grouped_weights_and_per_channel_inputs():
    # Grouped weights of a linear layer take the integer path (tests/test_groups.py); a convolution's do not.
    linear = init(lambda k: eqx.nn.Linear(8, 6, key=k), 5)
    conv = init(lambda k: eqx.nn.Conv2d(3, 4, 3, padding=1, key=k), 6)
    xs, images = normal(5, (3, 8)), normal(6, (3, 3, 5, 5))
    cases = [
        (conv, DynamicFakeQuant(8, axis=0, group_size=3), FakeQuant.calibrate(images, 8, method="minmax"), images),
        (linear, DynamicFakeQuant(8, axis=0), FakeQuant.calibrate(xs.T, 8, axis=0, method="minmax"), xs),
        (conv, DynamicFakeQuant(8, axis=0), FakeQuant.calibrate(jnp.moveaxis(images, 1, 0), 8, axis=0), images),
    ]
    for i, (layer, weight_quant, input_quant, inputs) in enumerate(cases):
        as_int = wrap(layer, weight_quant=weight_quant, input_quant=input_quant)
        as_float = wrap(layer, weight_quant=weight_quant, input_quant=input_quant, matmul="float")
        converted = convert(as_int)
        assert not uses_int_product(converted, inputs[0]) and not uses_int_product(as_int, inputs[0])
        expected = apply_batch(as_float, inputs)
        assert_bitwise_equal(apply_batch(converted, inputs), expected)
        assert_bitwise_equal(apply_batch(as_int, inputs), expected)
        if i == 0:  # eager
            assert_bitwise_equal(converted(inputs[0]), as_float(inputs[0]))
        # and that is the float layer on the fake-quantized operands
        reference = with_weight(layer, weight_quant(layer.weight))
        assert_bitwise_equal(expected, apply_batch(lambda x: reference(input_quant(x)), inputs))


@pytest.mark.slow
def test_int_forward_is_the_integer_product_not_the_float_one():
    """Without a bias the two forwards differ only by float rounding; the int one is the int64 reference exactly."""
    linear = init(lambda k: eqx.nn.Linear(64, 16, use_bias=False, key=k), 11)
    xs = normal(11, (128, 64))
    weight_quant, input_quant = DynamicFakeQuant(8, axis=0), FakeQuant.calibrate(xs, 8)
    as_int = QuantLinear(linear, weight_quant=weight_quant, input_quant=input_quant)
    as_float = QuantLinear(linear, weight_quant=weight_quant, input_quant=input_quant, matmul="float")
    y_int, y_float = np.asarray(apply_batch(as_int, xs)), np.asarray(apply_batch(as_float, xs))
    expected = np.stack([reference_forward(linear, weight_quant, input_quant, np.asarray(x)) for x in xs])
    assert_bitwise_equal(y_int, expected)
    assert np.any(y_int != y_float)
    np.testing.assert_allclose(y_float, expected, rtol=0, atol=1e-5 * np.abs(expected).max())


# ---------------------------------------------------------------------------------------------------------------------
# Gradients of the integer forward.


@eqx.filter_jit
def grads(model, x, c):
    return eqx.filter_grad(lambda mx: jnp.sum(mx[0](mx[1]) * c))((model, x))


@pytest.mark.slow
def test_int_matmul_gradients_equal_float_matmul_gradients():
    linear = init(lambda k: eqx.nn.Linear(8, 6, key=k), 21)
    conv = init(lambda k: eqx.nn.Conv2d(2, 3, 3, stride=2, padding=1, key=k), 22)
    x, image = normal(21, (8,)) * 2, normal(22, (2, 5, 5))
    # a static input grid narrower than the data, so that some entries clip and get no gradient
    input_quant = FakeQuant(0.01, -128, 127, zero_point=10)
    for layer, inp in ((linear, x), (conv, image)):
        as_int, as_float = (
            wrap(layer, weight_quant=DynamicFakeQuant(8, axis=0), input_quant=input_quant, matmul=m)
            for m in ("int", "float")
        )
        assert uses_int_product(as_int, inp)
        c = normal(23, jax.eval_shape(as_int, inp).shape)
        (g_int, gx_int), (g_float, gx_float) = grads(as_int, inp, c), grads(as_float, inp, c)
        pairs = ((g_int.layer.weight, g_float.layer.weight), (g_int.layer.bias, g_float.layer.bias), (gx_int, gx_float))
        for a, b in pairs:
            assert a.shape == b.shape
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-7)
        assert np.any(np.asarray(gx_int) == 0) and np.any(np.asarray(gx_int) != 0)

    # for the linear layer, against NumPy: the straight-through estimator passes the float product's gradients
    model = QuantLinear(linear, weight_quant=DynamicFakeQuant(8, axis=0), input_quant=input_quant)
    c = normal(23, (6,))
    g_model, g_x = grads(model, x, c)
    c = np.asarray(c)
    _, sw, _, _, _ = reference_grid(model.weight_quant, linear.weight)
    wq = reference_fake_quant(f32(linear.weight), sw, -128, 127)
    xq, gx, _, _ = reference_fake_quant(f32(x), np.float32(0.01), -128, 127, np.float32(10), cotangent=wq.T @ c)
    np.testing.assert_allclose(np.asarray(g_model.layer.bias), c, rtol=1e-6)
    np.testing.assert_allclose(np.asarray(g_model.layer.weight), np.outer(c, xq), rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(np.asarray(g_x), gx, rtol=1e-5, atol=1e-7)


def test_lsq_gradients_reach_the_learned_scales_with_the_int_path():
    linear = init(lambda k: eqx.nn.Linear(8, 6, key=k), 31)
    x, c = normal(31, (8,)).at[:2].set(jnp.array([3.0, -3.0])), normal(32, (6,))
    w = linear.weight
    # scales small enough that some weights and inputs clip, so that every LSQ term is exercised
    weight_quant = LearnedFakeQuant(jnp.max(jnp.abs(w), axis=1) / 5, -8, 7, axis=0)
    input_quant = LearnedFakeQuant(0.01, -128, 127, zero_point=5.0)
    as_int, as_float = (
        QuantLinear(linear, weight_quant=weight_quant, input_quant=input_quant, matmul=m) for m in ("int", "float")
    )
    assert uses_int_product(as_int, x) and not uses_int_product(as_float, x)
    g_int, g_float = grads(as_int, x, c), grads(as_float, x, c)
    leaves_int, leaves_float = jax.tree.leaves(g_int), jax.tree.leaves(g_float)
    assert len(leaves_int) == len(leaves_float) == 6  # weight, bias, two scales, zero point, x
    for a, b in zip(leaves_int, leaves_float):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-7)

    # NumPy reference: the fake-quant gradients, times the LSQ factor 1 / sqrt(numel * qmax) for the scales
    sw, sx, zx = f32(weight_quant.scale)[:, None], np.float32(0.01), np.float32(5.0)
    c = np.asarray(c)
    wq = reference_fake_quant(f32(w), sw, -8, 7)
    xq = reference_fake_quant(f32(x), sx, -128, 127, zx)
    _, gw, gsw, _ = reference_fake_quant(f32(w), sw, -8, 7, cotangent=np.outer(c, xq))
    _, gx, gsx, gzx = reference_fake_quant(f32(x), sx, -128, 127, zx, cotangent=wq.T @ c)
    g_model, g_x = g_int
    np.testing.assert_allclose(np.asarray(g_model.layer.weight), gw, rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(
        np.asarray(g_model.weight_quant.scale), gsw.sum(1) / np.sqrt(8 * 7), rtol=1e-5, atol=1e-7
    )
    np.testing.assert_allclose(np.asarray(g_model.input_quant.scale), gsx.sum() / np.sqrt(8 * 127), rtol=1e-5)
    np.testing.assert_allclose(np.asarray(g_model.input_quant.zero_point), gzx.sum() / np.sqrt(8 * 127), rtol=1e-5)
    np.testing.assert_allclose(np.asarray(g_x), gx, rtol=1e-5, atol=1e-7)
    assert np.all(np.asarray(g_model.weight_quant.scale) != 0)
    assert np.asarray(g_model.input_quant.scale) != 0 and np.asarray(g_model.input_quant.zero_point) != 0


def _batched_loss(model, xs, c):
    return jnp.sum(jax.vmap(model)(xs) * c)


@pytest.mark.slow
def test_batched_int_path_gradients_equal_fake_quant_gradients_and_sum_over_the_batch():
    """Under `jax.vmap` (how models see batches) the integer forward's gradients are the float formulation's, and the
    weight's gradient is one product over the batch: no per-example `(batch, out, in)` array anywhere."""
    mlp = init(lambda k: eqx.nn.MLP(12, 5, 16, 1, activation=jax.nn.relu, key=k), 41)
    xs, c = normal(41, (6, 12)) * 2, normal(42, (6, 5))
    weights = lambda path, layer: LearnedFakeQuant.init_from(layer.weight, 4, axis=0)  # noqa: E731
    as_int, as_float = (
        eqx_quant.quantize(mlp, weights=weights, activations=DynamicFakeQuant(8), matmul=m) for m in ("int", "float")
    )
    assert uses_int_product(as_int.layers[0], xs[0])
    value_and_grad = eqx.filter_jit(eqx.filter_value_and_grad(_batched_loss))
    (loss_int, g_int), (loss_float, g_float) = value_and_grad(as_int, xs, c), value_and_grad(as_float, xs, c)
    np.testing.assert_allclose(float(loss_int), float(loss_float), rtol=1e-5)
    leaves_int, leaves_float = jax.tree.leaves(g_int), jax.tree.leaves(g_float)
    assert len(leaves_int) == len(leaves_float) == 6  # two layers: weight, bias, learned weight scales (none else)
    for a, b in zip(leaves_int, leaves_float, strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6 * float(np.max(np.abs(b))))
    # the weight's gradient against a loop over the examples, each with the float formulation
    expected = sum(eqx.filter_grad(lambda m, x, cc: jnp.sum(m(x) * cc))(as_float, x, cc).layers[0].layer.weight
                   for x, cc in zip(xs, c))  # fmt: skip
    np.testing.assert_allclose(g_int.layers[0].layer.weight, expected, rtol=1e-5, atol=1e-6)
    program = value_and_grad.lower(as_int, xs, c).as_text()  # the StableHLO that JAX emits, before XLA's rewrites
    assert "tensor<6x16x12xf32>" not in program and "tensor<6x5x16xf32>" not in program
    assert "tensor<16x12xf32>" in program  # (the weight's gradient is there, summed)
    # the integer product has the batch along its rows (XLA's CPU int8 product is faster that way)
    assert "tensor<6x16xi32>" in program and "tensor<16x6xi32>" not in program


@pytest.mark.slow
def test_qat_training_loop_traces_once():
    mlp = init(lambda k: eqx.nn.MLP(8, 3, 8, 1, activation=jax.nn.relu, key=k), 43)
    model = eqx_quant.quantize(
        mlp,
        weights=lambda path, layer: LearnedFakeQuant.init_from(layer.weight, 8, axis=0),
        activations=DynamicFakeQuant(8),
    )
    traces = 0

    @eqx.filter_jit
    def step(model, xs, c):
        nonlocal traces
        traces += 1
        grads = eqx.filter_grad(_batched_loss)(model, xs, c)
        return eqx.apply_updates(model, jax.tree.map(lambda g: -0.01 * g, grads))

    for i in range(4):
        before = model.layers[0].weight_quant.scale
        model = step(model, normal(44 + i, (4, 8)), normal(50 + i, (4, 3)))
        assert not np.array_equal(np.asarray(model.layers[0].weight_quant.scale), np.asarray(before))  # it learns
    assert traces == 1


# ---------------------------------------------------------------------------------------------------------------------
# int32 overflow.


def test_safe_contraction():
    assert safe_contraction(128, 128) == 131071
    for w_bound, x_bound in ((128, 128), (128, 255), (255, 255), (8, 128), (8, 8), (32768, 32768), (32768, 65535)):
        k = safe_contraction(w_bound, x_bound)
        assert k == INT32_MAX // (w_bound * x_bound)
        assert k * w_bound * x_bound <= INT32_MAX < (k + 1) * w_bound * x_bound


@pytest.mark.slow
def test_int8_contraction_longer_than_the_bound_is_chunked():
    """K = 131072 products of -128 * -128 sum to 2**31: one past the int32 range."""
    k = 131072
    rng = np.random.default_rng(0)
    w = np.stack([-np.ones(k, np.float32), rng.uniform(-1, 1, k).astype(np.float32)])
    linear = with_weight(init(lambda key: eqx.nn.Linear(k, 2, use_bias=False, key=key), 0), w)
    x = -np.ones(k, np.float32)
    grid = FakeQuant(1 / 128, -128, 127)
    quant = QuantLinear(linear, weight_quant=grid, input_quant=grid)
    w_int = np_levels(w, 1 / 128, 0, -128, 127).astype(np.int64)
    x_int = np_levels(x, 1 / 128, 0, -128, 127).astype(np.int64)
    exact = w_int @ x_int
    assert exact[0] == 2**31 and int32_wrap(exact[0]) == -(2**31)
    expected = np_rescale(np_chunked(w_int, x_int, 131071), np.float32(1 / 128), np.float32(1 / 128), None)
    assert expected[0] == 131072.0
    assert_bitwise_equal(convert(quant)(jnp.asarray(x)), expected)
    assert_bitwise_equal(quant(jnp.asarray(x)), expected)


def sixteen_bit_case(symmetric: bool):
    """A Linear on 16-bit grids whose products reach the top of the grid, with a contraction of 16."""
    rng = np.random.default_rng(2)
    w = rng.choice([-1.0, 1.0], size=(3, 16)) * rng.uniform(0.9, 1.0, size=(3, 16))
    w[0] = 1.0  # every product of row 0 is near 2**30
    x = rng.uniform(0.9, 1.0, 16).astype(np.float32)
    if not symmetric:
        w = np.abs(w)  # non-negative operands: the zero points sit at qmin and the shifted integers reach 65535
    w = w.astype(np.float32)
    linear = with_weight(init(lambda k: eqx.nn.Linear(16, 3, key=k), 2), w)
    weight_quant = DynamicFakeQuant(16, axis=0, symmetric=symmetric)
    input_quant = FakeQuant.from_bits(16, 1.0 / 32767) if symmetric else FakeQuant.calibrate(x, 16, method="minmax")
    quant = QuantLinear(linear, weight_quant=weight_quant, input_quant=input_quant)
    _, sw, zw, qmin, qmax = reference_grid(weight_quant, w)
    w_int = (np_levels(w, sw, zw, qmin, qmax) - zw).astype(np.int64)
    sx, zx = np.float32(input_quant.scale), np.float32(input_quant.zero_point)
    x_int = (np_levels(x, sx, zx, input_quant.qmin, input_quant.qmax) - zx).astype(np.int64)
    return linear, quant, x, w_int, x_int, sw, sx


@pytest.mark.slow
def test_16_bit_contraction_is_chunked_exactly():
    linear, quant, x, w_int, x_int, sw, sx = sixteen_bit_case(symmetric=True)
    bound = safe_contraction(32768, 32768)
    assert bound == 1 < 16
    exact = w_int @ x_int
    assert np.abs(exact).max() > INT32_MAX  # a single int32 accumulator would wrap
    bias = f32(linear.bias)
    expected = np_rescale(np_chunked(w_int, x_int, bound), sw, sx, bias)
    wrapped = np_rescale(int32_wrap(exact), sw, sx, bias)
    converted = convert(quant)
    for y in (converted(jnp.asarray(x)), quant(jnp.asarray(x)), apply(converted, jnp.asarray(x))):
        assert_bitwise_equal(y, expected)
        assert not np.allclose(np.asarray(y), wrapped)
    # and within float32 summation error of the exact sum
    error = 16 * 2.0**-24 * (np.abs(w_int) @ np.abs(x_int)) * np.abs(f32(sw).reshape(-1) * sx)
    assert np.all(np.abs(expected - np_rescale(exact, sw, sx, bias)) <= error)


@pytest.mark.slow
def test_16_bit_asymmetric_contraction_does_not_wrap():
    """Both operands asymmetric on 16 bits: shifted integers up to 65535, so a single product exceeds int32."""
    linear, quant, x, w_int, x_int, sw, sx = sixteen_bit_case(symmetric=False)
    assert w_int.max() == 65535 and x_int.max() == 65535
    exact = w_int @ x_int
    # the exact result rounded once; any correct accumulation lies within float32 summation error of it
    expected = np_rescale(exact.astype(np.float64).astype(np.float32), sw, sx, f32(linear.bias))
    for y in (convert(quant)(jnp.asarray(x)), quant(jnp.asarray(x))):
        np.testing.assert_allclose(np.asarray(y), expected, rtol=1e-6)


def convolution_types(spec, w, x) -> set[str]:
    """The result element types of the convolutions in `int_conv`'s program as XLA compiles it for this backend."""
    args = (spec, jnp.asarray(w), jnp.asarray(x), jnp.ones(w.shape[0]), jnp.ones(()), None)
    hlo = jax.jit(int_conv, static_argnums=0).lower(*args).compile().as_text()
    return set(re.findall(r"= (\w+)\[[^\]]*\]\S* convolution\(", hlo))


def test_integer_convolution_is_exact_at_the_float32_bound():
    """`int_conv` may compute on float32 when every partial sum is at most 2**24 in magnitude: K = 64 * 4 * 4 = 1024
    int8 products of up to 2**14, one output being 2**24 itself. Exact against int64."""
    rng = np.random.default_rng(64)
    w = rng.choice(np.array([-128, 127, -127, 1], np.int8), size=(3, 64, 4, 4))
    x = rng.choice(np.array([-128, 127, -127, 1], np.int8), size=(64, 6, 6))
    w[0], x[:, :4, :4] = -128, -128  # one output is the largest sum, 128 * 128 * 1024
    spec = ConvSpec((1, 1), ((0, 0), (0, 0)), (1, 1), 1, 128 * 128)
    expected = np_int_conv(w, x, (1, 1), ((0, 0), (0, 0)), (1, 1), 1)
    assert expected.max() == 2**24
    y = jax.jit(int_conv, static_argnums=0)(spec, jnp.asarray(w), jnp.asarray(x), jnp.ones(3), jnp.ones(()), None)
    assert_bitwise_equal(y, expected.astype(np.float32))
    # On CPU the float32 convolution runs (XLA's integer one is much slower); elsewhere the int32 one.
    assert convolution_types(spec, w, x) == ({"f32"} if jax.default_backend() == "cpu" else {"s32"})


def test_integer_convolution_beyond_the_float32_bound_accumulates_in_int32():
    """Odd 12-bit products whose sums pass 2**24: a float32 accumulation would round, int32 does not."""
    rng = np.random.default_rng(65)
    w = (rng.integers(1000, 1500, size=(2, 4, 3, 3)) * 2 + 1).astype(np.int16)  # odd, up to 3001
    x = (rng.integers(1000, 1500, size=(4, 5, 5)) * 2 + 1).astype(np.int16)
    spec = ConvSpec((1, 1), ((1, 1), (1, 1)), (1, 1), 1, 3001 * 3001)
    expected = np_int_conv(w, x, (1, 1), ((1, 1), (1, 1)), (1, 1), 1)
    assert np.any(expected.astype(np.float32).astype(np.int64) != expected)  # float32 cannot hold these sums
    y = jax.jit(int_conv, static_argnums=0)(spec, jnp.asarray(w), jnp.asarray(x), jnp.ones(2), jnp.ones(()), None)
    assert_bitwise_equal(y, expected.astype(np.float32))  # rounded once, from the exact sum
    assert convolution_types(spec, w, x) == {"s32"}


# ---------------------------------------------------------------------------------------------------------------------
# Saving, loading, exporting; the demo model.


@pytest.fixture(scope="module")
def digits():
    return demo.load_digits(0)


@pytest.fixture(scope="module")
def demo_models(digits):
    """The demo ConvNet (untrained), quantized W8A8 and W4A4, calibrated on 256 training images, converted."""
    x_train, _, _, _ = digits
    model = init(demo.ConvNet, 0)
    out = {}
    for bits in (8, 4):
        fake = demo.calibrated(demo.quantized(model, bits, bits), x_train[:256], bits)
        out[bits] = (fake, convert(fake))
    return model, out


@pytest.mark.slow
def test_save_load_round_trip_and_file_sizes(demo_models, tmp_path):
    float_model, by_bits = demo_models
    float_path = tmp_path / "float.eqx"
    eqx.tree_serialise_leaves(float_path, float_model)
    float_size = float_path.stat().st_size
    limits = {8: 0.27, 4: 0.15}
    for bits, (_, converted) in by_bits.items():
        path = tmp_path / f"int{bits}.eqx"
        save(path, converted)
        loaded = load(path, zeros_like_tree(converted))
        assert_trees_equal(loaded, converted)
        dtype = jnp.int8 if bits == 8 else jnp.uint8
        assert all(getattr(loaded, n).qweight.values.dtype == dtype for n in ("conv1", "conv2", "linear1", "linear2"))
        ratio = path.stat().st_size / float_size
        print(f"ConvNet W{bits}: {path.stat().st_size} / {float_size} bytes = {ratio:.4f}")
        assert ratio <= limits[bits]

    mlp = init(lambda k: eqx.nn.MLP(256, 10, 512, 2, key=k), 4)
    float_path = tmp_path / "mlp.eqx"
    eqx.tree_serialise_leaves(float_path, mlp)
    for bits in (8, 4):
        converted = convert(quantize(mlp, weights=DynamicFakeQuant(bits, axis=0)))
        path = tmp_path / f"mlp{bits}.eqx"
        save(path, converted)
        assert_trees_equal(load(path, zeros_like_tree(converted)), converted)
        ratio = path.stat().st_size / float_path.stat().st_size
        print(f"MLP 256-512-512-10 W{bits}: {path.stat().st_size} / {float_path.stat().st_size} bytes = {ratio:.4f}")
        assert ratio <= limits[bits]


@pytest.mark.slow
def test_demo_convnet_converted_parity(demo_models, digits):
    _, _, x_test, _ = digits
    _, by_bits = demo_models
    images = jnp.asarray(x_test)
    for bits, (fake, converted) in by_bits.items():
        assert all(isinstance(getattr(converted, n), (IntConv, IntLinear)) for n in ("conv1", "conv2", "linear1"))
        assert uses_int_product(converted, images[0]) and uses_int_product(fake, images[0])
        logits_fake = np.asarray(apply_batch(fake, images))
        logits_int = np.asarray(apply_batch(converted, images))
        agreement = np.mean(np.argmax(logits_fake, -1) == np.argmax(logits_int, -1))
        print(f"W{bits}A{bits}: argmax agreement {agreement:.4f} on {len(images)} test digits")
        assert agreement == 1.0
        assert np.max(np.abs(logits_fake - logits_int)) <= 1e-5 * np.max(np.abs(logits_fake))
        assert_bitwise_equal(logits_int, logits_fake)


def read_header(path) -> dict:
    with open(path, "rb") as f:
        (length,) = struct.unpack("<Q", f.read(8))
        return json.loads(f.read(length))


def test_export_safetensors(tmp_path):
    xs = normal(8, (4, 8), loc=0.5)
    model = {
        "a": QuantLinear(
            init(lambda k: eqx.nn.Linear(8, 6, key=k), 8),
            weight_quant=DynamicFakeQuant(8, axis=0, symmetric=False),
            input_quant=FakeQuant.calibrate(xs, 8, method="minmax"),
        ),
        "b": QuantLinear(
            init(lambda k: eqx.nn.Linear(8, 3, use_bias=False, key=k), 9),
            weight_quant=DynamicFakeQuant(4, axis=0, group_size=4),
        ),
        "c": QuantConv(init(lambda k: eqx.nn.Conv1d(2, 4, 3, key=k), 10), weight_quant=DynamicFakeQuant(4)),
    }
    path = tmp_path / "model.safetensors"
    export_safetensors(path, convert(model))
    tensors = safetensors.numpy.load_file(str(path))
    assert set(tensors) == {
        "a.weight", "a.weight_scale", "a.weight_zero_point", "a.bias", "b.weight", "b.weight_scale", "c.weight",
        "c.weight_scale", "c.bias",
    }  # fmt: skip

    levels = {}
    for name, layer in model.items():
        w = layer.layer.weight
        view, scale, zp, qmin, qmax = reference_grid(layer.weight_quant, w)
        levels[name] = np_levels(view, scale, zp, qmin, qmax).reshape(w.shape[0], -1).astype(np.int64)
        assert_bitwise_equal(tensors[f"{name}.weight_scale"].reshape(-1), scale.reshape(-1))
        if layer.layer.bias is not None:
            assert_bitwise_equal(tensors[f"{name}.bias"], f32(layer.layer.bias))
    assert tensors["a.weight"].dtype == np.int8
    np.testing.assert_array_equal(tensors["a.weight"], levels["a"])
    _, _, zp_a, _, _ = reference_grid(model["a"].weight_quant, model["a"].layer.weight)
    assert np.any(zp_a != 0)
    np.testing.assert_array_equal(tensors["a.weight_zero_point"].reshape(-1), zp_a.reshape(-1))
    for name in ("b", "c"):
        assert tensors[f"{name}.weight"].dtype == np.uint8
        np.testing.assert_array_equal(tensors[f"{name}.weight"], py_pack(levels[name]))
        np.testing.assert_array_equal(py_unpack(tensors[f"{name}.weight"], levels[name].shape[1], True), levels[name])

    header = read_header(path)
    assert header["a.weight"]["dtype"] == "I8" and header["b.weight"]["dtype"] == "U8"
    assert header["a.weight_scale"]["dtype"] == "F32" and header["c.bias"]["dtype"] == "F32"
    metadata = header["__metadata__"]
    assert metadata["nibble_order"] == "low-first"
    info = {name: json.loads(metadata[name]) for name in ("a", "b", "c")}
    for name, (qmin, qmax, axis, group_size, packed, shape) in {
        "a": (-128, 127, 0, None, False, [6, 8]),
        "b": (-8, 7, None, 4, True, [3, 8]),
        "c": (-8, 7, None, None, True, [4, 2, 3]),
    }.items():
        layer_info = info[name]
        assert (layer_info["qmin"], layer_info["qmax"]) == (qmin, qmax), name
        assert (layer_info["axis"], layer_info["group_size"]) == (axis, group_size), name
        assert layer_info["packed_int4"] is packed and layer_info["shape"] == shape, name
        assert layer_info["nibble_order"] == ("low-first" if packed else None), name
    assert all(info[name]["stack"] == [] for name in info)
    # A stack of layers (built with `eqx.filter_vmap`): every tensor carries the stack in front, as `stack` says.
    stack = eqx.filter_vmap(lambda k: eqx.nn.Linear(8, 4, key=k))(jax.random.split(jax.random.key(3), 2))
    export_safetensors(tmp_path / "stack.safetensors", convert(quantize({"s": stack}, **eqx_quant.recipe("w8a8"))))
    s_info = json.loads(read_header(tmp_path / "stack.safetensors")["__metadata__"]["s"])
    assert s_info["stack"] == [2] and s_info["shape"] == [4, 8]
    stacked = safetensors.numpy.load_file(str(tmp_path / "stack.safetensors"))
    assert stacked["s.weight"].shape == (2, 4, 8) and stacked["s.weight_scale"].shape == (2, 4, 1)
    a_input = model["a"].input_quant
    assert info["a"]["input"] == {
        "kind": "FakeQuant", "format": "int8", "scale": a_input.scale, "zero_point": a_input.zero_point,
        "tensor_scale": None, "qmin": -128, "qmax": 127, "axis": None, "group_size": None, "group_axis": -1,
    }  # fmt: skip


# ---------------------------------------------------------------------------------------------------------------------
# Errors.


def test_convert_rejects_a_passthrough_clip_weight_quantizer():
    layer = QuantLinear(init(lambda k: eqx.nn.Linear(3, 2, key=k), 0), weight_quant=PassthroughClip(-1.0, 1.0))
    with pytest.raises(TypeError, match="PassthroughClip"):
        convert({"head": layer})


def test_export_needs_an_integer_layer(tmp_path):
    linear = init(lambda k: eqx.nn.Linear(3, 2, key=k), 0)
    with pytest.raises(ValueError, match="no converted layer"):
        export_safetensors(tmp_path / "a.safetensors", [linear])
    with pytest.raises(ValueError, match="no converted layer"):
        export_safetensors(tmp_path / "b.safetensors", quantize([linear]))
    assert not (tmp_path / "a.safetensors").exists() and not (tmp_path / "b.safetensors").exists()


@pytest.mark.slow
def test_load_restores_static_quantizers_and_rejects_foreign_files(tmp_path):
    # Calibrated input scales are static configuration, not arrays: `save` records them, `load` puts them back
    # even when `like` was calibrated on other data.
    mlp = eqx.nn.MLP(4, 2, 8, 1, key=jax.random.key(3))
    data = [normal(1, (16, 4))]
    model = convert(eqx_quant.calibrate(eqx_quant.quantize(mlp), data))
    like = convert(eqx_quant.calibrate(eqx_quant.quantize(mlp), [normal(2, (16, 4)) * 3]))
    assert like.layers[0].input_quant.scale != model.layers[0].input_quant.scale
    path = tmp_path / "model.eqx"
    eqx_quant.save(path, model)
    restored = eqx_quant.load(path, like)
    assert restored.layers[0].input_quant == model.layers[0].input_quant
    assert_bitwise_equal(jax.vmap(restored)(data[0]), jax.vmap(model)(data[0]))
    foreign = tmp_path / "leaves.eqx"
    eqx.tree_serialise_leaves(foreign, model)
    with pytest.raises(ValueError, match="eqx_quant.save"):
        eqx_quant.load(foreign, like)
    with pytest.raises(ValueError, match="static quantizers"):
        eqx_quant.load(path, convert(eqx_quant.quantize(mlp)))


@pytest.mark.parametrize(
    "named, plain",
    [
        (LearnedFakeQuant(0.02, -8, 7, axis_name="model"), LearnedFakeQuant(0.02, -8, 7)),
        (DynamicFakeQuant(8, axis=0, axis_name=("a", "b")), DynamicFakeQuant(8, axis=0)),
    ],
)
def test_convert_drops_a_weight_quantizers_axis_name(named, plain):
    """`axis_name` serves calls inside `jax.shard_map`; conversion sees the whole weight, outside any named axis."""
    linear = init(lambda k: eqx.nn.Linear(6, 4, key=k), 61)
    input_quant = FakeQuant(0.05, -128, 127)
    converted = convert(QuantLinear(linear, weight_quant=named, input_quant=input_quant))
    expected = convert(QuantLinear(linear, weight_quant=plain, input_quant=input_quant))
    assert_bitwise_equal(converted.qweight.values, expected.qweight.values)
    x = normal(62, (6,))
    assert_bitwise_equal(converted(x), expected(x))


@pytest.mark.slow
def test_integer_forward_keeps_no_copies_of_the_operands_for_the_backward():
    """The backward pass multiplies with the fake-quantized operands, but computes them again from the float
    operands: what `jax.vjp` keeps is the float model's residuals and the weights (for the straight-through masks),
    and no second float array of a weight's or an activation's shape, nor their integers or NaN masks."""
    mlp = init(lambda k: eqx.nn.MLP(12, 5, 16, 2, activation=jax.nn.relu, key=k), 71)
    xs, c = normal(71, (6, 12)), normal(72, (6, 5))

    def residuals(model):
        params, static = eqx.partition(model, eqx.is_inexact_array)
        _, pullback = jax.vjp(lambda p: _batched_loss(eqx.combine(p, static), xs, c), params)
        leaves = [leaf for leaf in jax.tree.leaves(pullback) if isinstance(leaf, jax.Array) and leaf.ndim == 2]
        count = {}
        for leaf in leaves:
            count[(leaf.dtype.name, leaf.shape)] = count.get((leaf.dtype.name, leaf.shape), 0) + 1
        return count

    float_res = residuals(mlp)
    quant_res = residuals(eqx_quant.quantize(mlp, weights=DynamicFakeQuant(8, axis=0), activations=DynamicFakeQuant(8)))
    weight_shapes = {(16, 12), (16, 16), (5, 16)}
    for (dtype, shape), n in quant_res.items():
        if 1 in shape:
            continue  # scales: one per channel, or per example
        allowed = float_res.get((dtype, shape), 0) + (1 if dtype == "float32" and shape in weight_shapes else 0)
        assert n <= allowed, (dtype, shape, n, float_res)


class _LookupThenNorm(eqx.Module):
    embedding: eqx.nn.Embedding
    norm: eqx.nn.LayerNorm
    head: eqx.nn.Linear

    def __call__(self, tokens):
        return jax.vmap(lambda t: self.head(self.norm(self.embedding(t))))(tokens)


@pytest.mark.parametrize("seed", [0, 1])
def test_an_embedding_read_by_a_norm_converts_bit_for_bit_under_jit(seed):
    # The quantized table's row and the converted one's are the same values computed by different operations; XLA
    # fused each into the normalisation that reads it and summed the normalisation's mean in another order: the two
    # models differed in the last bit under `jit` (every seed tried, before the rows were computed ahead of their
    # readers).
    keys = jax.random.split(jax.random.key(seed), 3)
    model = _LookupThenNorm(eqx.nn.Embedding(33, 64, key=keys[0]), eqx.nn.LayerNorm(64),
                            eqx.nn.Linear(64, 33, key=keys[1]))  # fmt: skip
    tokens = jax.random.randint(keys[2], (17,), 0, 33)
    quantized = eqx_quant.quantize(model, eqx_quant.recipe("w8a8")["rules"])
    call = eqx.filter_jit(lambda m, t: m(t))
    assert_bitwise_equal(call(eqx_quant.convert(quantized), tokens), call(quantized, tokens))


@pytest.mark.parametrize("recipe", slow_unless(["mxfp4"], ["nvfp4", "mxfp4"]))
def test_an_embedding_with_block_scale_codes_converts_bit_for_bit_under_jit(recipe):
    # The converted rows are computed ahead of their readers by a conditional on the first stored scale; with the
    # scales stored as integer codes (E4M3, E8M0) its predicate was constant, XLA removed the conditional, and fused
    # NVFP4's product by the tensor scale with the addition that reads the row into one fused multiply-add. (MX's
    # power-of-two scales make that product exact, fused or not: its case guards the conditional's other uses.)
    embedding = eqx.nn.Embedding(64, 64, key=jax.random.key(0))
    tokens, ones = jnp.arange(16), jnp.ones((16, 64))
    quantized = eqx_quant.quantize(embedding, **eqx_quant.recipe(recipe))
    converted = eqx_quant.convert(quantized)
    assert converted.qweight.scale.dtype == jnp.uint8
    table = np.asarray(jax.vmap(quantized)(tokens))
    call = eqx.filter_jit(lambda m, t, y: jax.vmap(m)(t) + y)
    assert_bitwise_equal(call(quantized, tokens, ones), table + np.float32(1))
    assert_bitwise_equal(call(converted, tokens, ones), table + np.float32(1))


@pytest.mark.parametrize("recipe", slow_unless(["w4a16_g32"], ["w4a16_g32", "fp8", "w8a16"]))
def test_a_tied_head_of_one_row_converts_bit_for_bit_under_jit(recipe):
    # `h @ embedding.weight.T` for one token (a decoding step): XLA fused the computation of the table into that
    # matrix-vector product and summed it in an order that depended on how the table was computed (fake-quantized,
    # or dequantized from codes): the logits differed in the last bit (before `.weight` was computed ahead of its
    # readers). Linear layers' `.weight` is read the same way.
    keys = jax.random.split(jax.random.key(0), 3)
    h = jax.random.normal(keys[2], (1, 64))
    head = eqx.filter_jit(lambda layer, h: h @ layer.weight.T)
    for layer in (eqx.nn.Embedding(29, 64, key=keys[0]), eqx.nn.Linear(64, 29, key=keys[1])):
        quantized = eqx_quant.quantize(layer, **eqx_quant.recipe(recipe))
        converted = eqx_quant.convert(quantized)
        table = np.asarray(quantized.weight)
        assert_bitwise_equal(converted.weight, table)
        assert_bitwise_equal(head(converted, h), head(quantized, h))
        np.testing.assert_allclose(head(quantized, h), np.asarray(h, np.float64) @ table.T, rtol=1e-5, atol=1e-5)


def _run_twice_compiling_once(run):
    """`run()` twice, the second time checking that XLA compiles nothing; both results."""
    first = run()  # compiles
    events = []
    listener = lambda event, duration, **kwargs: events.append(event)  # noqa: E731
    jax.monitoring.register_event_duration_secs_listener(listener)
    try:
        again = run()
    finally:
        jax.monitoring.unregister_event_duration_listener(listener)
    assert [e for e in events if e == "/jax/core/compile/backend_compile_duration"] == []
    return first, again


def test_weight_reads_and_mapped_calls_outside_jit_compile_once():
    # `.weight` and a weight-only layer's call pass conditionals (`computed_before`, `after_input`); with their
    # branches defined anew at each call, every eager read compiled them again.
    layer = eqx_quant.quantize(
        eqx.nn.Linear(8, 4, key=jax.random.key(0)), **eqx_quant.recipe("w4a16_g32", group_size=8)
    )
    layers, x = (layer, eqx_quant.convert(layer)), jnp.ones((3, 8))

    first, again = _run_twice_compiling_once(lambda: [(each.weight, jax.vmap(each)(x)) for each in layers])
    for (w1, y1), (w2, y2) in zip(first, again, strict=True):
        assert_bitwise_equal(w2, w1)
        assert_bitwise_equal(y2, y1)
    assert_bitwise_equal(first[1][0], first[0][0])


class _BareProduct(eqx.Module):
    w: jax.Array

    def __call__(self, x):
        return x @ self.w.T


@pytest.mark.slow
def test_integer_products_outside_jit_compile_once():
    # The grouped integer product and the integer convolution choose their form per platform with conditionals whose
    # branches were defined anew at each call: every eager call (of a traced model, or a `jax.vmap` of a layer)
    # compiled them again.
    key1, key2 = jax.random.split(jax.random.key(1))
    grouped = eqx_quant.recipe("w4a8_g32", group_size=8)
    linear = eqx_quant.quantize(eqx.nn.Linear(16, 4, key=key1), **grouped)
    conv = eqx_quant.quantize(eqx.nn.Conv1d(2, 4, 3, key=key2), **eqx_quant.recipe("w8a8"))
    bare = _BareProduct(jax.random.normal(key1, (4, 16)))
    traced = eqx_quant.quantize(bare, **grouped, example=(jnp.ones((3, 16)),))
    calls = [
        (model, inputs, call)
        for layer, inputs, call in [
            (linear, jnp.ones((3, 16)), jax.vmap),
            (conv, jnp.ones((3, 2, 5)), jax.vmap),
            (traced, jnp.ones((3, 16)), lambda m: m),
        ]
        for model in (layer, eqx_quant.convert(layer))
    ]

    first, again = _run_twice_compiling_once(lambda: [call(model)(inputs) for model, inputs, call in calls])
    for y1, y2 in zip(first, again, strict=True):
        assert_bitwise_equal(y2, y1)


class _Readout(eqx.Module):
    linear: eqx.nn.Linear

    def __call__(self, h):
        return self.linear(jnp.mean(jnp.tanh(h), axis=0))


def test_a_single_output_readout_of_a_mean_converts_bit_for_bit_under_jit():
    # A weight-only layer of one output reading a mean over rows (a graph network's readout): 15 of 50 inputs gave
    # converted outputs one ulp from the quantized ones under `jit`, the converted layer's weight depending on its
    # input (`after_input`) and the quantized layer's not, before both did.
    model = _Readout(eqx.nn.Linear(16, 1, key=jax.random.key(0)))
    quantized = eqx_quant.quantize(model, **eqx_quant.recipe("w8a16"))
    converted = eqx_quant.convert(quantized)
    call = eqx.filter_jit(lambda m, h: m(h))
    for seed in range(20):
        h = jax.random.normal(jax.random.key(seed), (10, 16))
        assert_bitwise_equal(call(converted, h), call(quantized, h))


class _ResidualBlock(eqx.Module):
    stem: eqx.nn.Conv2d
    conv1: eqx.nn.Conv2d
    conv2: eqx.nn.Conv2d
    norms: tuple[eqx.nn.BatchNorm, ...]
    state: eqx.nn.State
    head: eqx.nn.Linear

    def __init__(self, key):
        keys = jax.random.split(key, 4)
        self.stem = eqx.nn.Conv2d(1, 32, 3, padding=1, key=keys[0])
        self.conv1 = eqx.nn.Conv2d(32, 32, 3, padding=1, use_bias=False, key=keys[1])
        self.conv2 = eqx.nn.Conv2d(32, 32, 3, padding=1, use_bias=False, key=keys[2])
        norms, self.state = eqx.nn.make_with_state(
            lambda: tuple(eqx.nn.BatchNorm(32, "batch", mode="ema") for _ in range(3))
        )()
        self.norms = eqx.nn.inference_mode(norms)
        self.head = eqx.nn.Linear(32, 10, key=keys[3])

    def __call__(self, x):
        norm = lambda i, h: self.norms[i](h, self.state)[0]  # noqa: E731
        h = jax.nn.relu(norm(0, self.stem(x)))
        r = jax.nn.relu(norm(1, self.conv1(h)))
        h = jax.nn.relu(norm(2, self.conv2(r)) + h)
        return self.head(jnp.mean(h, axis=(1, 2)))


@pytest.mark.parametrize("recipe", slow_unless(["w4a16_g32"], ["w8a16", "w4a16_g32"]))
def test_a_residual_block_with_weight_only_convolutions_converts_bit_for_bit_under_jit(recipe):
    # A converted weight-only layer makes its dequantized weight depend on its input on CPU (for its memory; see
    # `after_input`). That dependency changed how XLA fused the normalisation and the residual around the layer, and
    # the converted residual network's outputs differed from the quantized one's in the last bit under `jit`
    # (before the quantized layers took the same dependency).
    model = _ResidualBlock(jax.random.key(0))
    x = jax.random.uniform(jax.random.key(1), (32, 1, 8, 8))
    quantized = eqx_quant.quantize(model, **eqx_quant.recipe(recipe))
    converted = eqx_quant.convert(quantized)
    call = eqx.filter_jit(lambda m, x: jax.vmap(m)(x))
    want = call(quantized, x)
    assert_bitwise_equal(call(converted, x), want)
    assert_bitwise_equal(jax.vmap(converted)(x), jax.vmap(quantized)(x))
    reference = np.asarray(call(model, x), np.float64)
    tolerance = 0.05 if recipe == "w8a16" else 0.25  # the float model's, to rounding
    assert np.linalg.norm(want - reference) < tolerance * np.linalg.norm(reference)


@pytest.mark.slow
def test_layers_with_float_products_keep_them_when_converted(tmp_path):
    # `matmul="float"` asks for the float product of the fake-quantized operands; the converted layers computed the
    # integer one (grouped int4 sums, per-channel int8 convolutions) and differed from the quantized model.
    keys = jax.random.split(jax.random.key(0), 4)
    model = eqx.nn.Sequential([eqx.nn.Conv1d(4, 8, 3, key=keys[0]), eqx.nn.Lambda(jnp.ravel),
                               eqx.nn.Linear(8 * 32, 64, key=keys[1]), eqx.nn.Linear(64, 5, key=keys[2])])  # fmt: skip
    x = jax.random.normal(keys[3], (6, 4, 34))
    call = eqx.filter_jit(lambda m, x: jax.vmap(m)(x))
    for matmul in ("int", "float"):
        rules = [eqx_quant.Rule("layers.0", weight=eqx_quant.LayerQuantizer(8), matmul=matmul),
                 eqx_quant.Rule(".*", weight=eqx_quant.LayerQuantizer(4, 32), matmul=matmul)]  # fmt: skip
        quantized = eqx_quant.quantize(model, rules)
        converted = eqx_quant.convert(quantized)
        assert [converted.layers[i].matmul for i in (0, 2, 3)] == [matmul] * 3
        assert_bitwise_equal(call(converted, x), call(quantized, x))
        integer_products = str(eqx.filter_make_jaxpr(call)(converted, x)[0]).count("preferred_element_type=int32")
        assert integer_products == (3 if matmul == "int" else 0)
        eqx_quant.save(tmp_path / f"{matmul}.eqx", converted)
        loaded = eqx_quant.load(tmp_path / f"{matmul}.eqx", like=converted)
        assert [loaded.layers[i].matmul for i in (0, 2, 3)] == [matmul] * 3
        assert_bitwise_equal(call(loaded, x), call(quantized, x))
        if matmul == "float":  # deployed on the integers instead: what the `matmul="int"` model computes
            on_integers = eqx_quant.convert(quantized, matmul="int")
            assert_bitwise_equal(call(on_integers, x), call(int_model, x))
        int_model = quantized


@pytest.mark.slow
def test_convert_with_matmul_reaches_the_products_of_two_activations():
    attention = eqx.nn.MultiheadAttention(2, 16, key=jax.random.key(0))
    x = jax.random.normal(jax.random.key(1), (6, 16))
    rules = eqx_quant.recipe("w8a8_attn")["rules"]
    on_integers = eqx_quant.quantize(attention, rules)
    in_float = eqx_quant.quantize(attention, [dataclasses.replace(rule, matmul="float") for rule in rules])
    call = eqx.filter_jit(lambda m, x: m(x, x, x))
    for model, other, matmul in ((in_float, on_integers, "int"), (on_integers, in_float, "float")):
        converted = eqx_quant.convert(model, matmul=matmul)
        assert [converted.scores.matmul, converted.values.matmul] == [matmul] * 2
        assert_bitwise_equal(call(converted, x), call(other, x))
