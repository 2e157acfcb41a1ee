"""Packing 2-, 3- and 4-bit integers into bytes, and converted models that store their weights at those widths."""

import json
import math
import struct

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import safetensors.numpy

import eqx_quant
from eqx_quant import DynamicFakeQuant, pack_bits, pack_int4, unpack_bits, unpack_int4
from eqx_quant.nn import IntEmbedding, IntLinear

from .helpers import assert_bitwise_equal, assert_trees_equal, zeros_like_tree


# ---------------------------------------------------------------------------------------------------------------------
# Pure-Python references: one bit at a time.


def py_pack(values, bits: int) -> np.ndarray:
    """Each row as a stream of bits, value after value, lowest bit first; eight bits to a byte, lowest first."""
    rows = []
    for row in np.asarray(values).tolist():
        stream = []
        for value in row:
            pattern = value % (1 << bits)  # the two's complement pattern of `bits` bits
            stream += [(pattern >> k) & 1 for k in range(bits)]
        stream += [0] * (-len(stream) % 8)
        rows.append([sum(stream[8 * i + k] << k for k in range(8)) for i in range(len(stream) // 8)])
    return np.asarray(rows, np.uint8).reshape(len(rows), -1)


def py_unpack(packed, n: int, bits: int, signed: bool) -> np.ndarray:
    rows = []
    for row in np.asarray(packed).tolist():
        stream = [(byte >> k) & 1 for byte in row for k in range(8)]
        values = []
        for j in range(n):
            pattern = sum(stream[j * bits + k] << k for k in range(bits))
            values.append(pattern - (1 << bits) if signed and pattern >= 1 << (bits - 1) else pattern)
        rows.append(values)
    return np.asarray(rows, np.int64).reshape(len(rows), n)


def pack_int2(values):
    return pack_bits(values, 2)


def pack_int3(values):
    return pack_bits(values, 3)


def unpack_int2(packed, n, *, signed=True):
    return unpack_bits(packed, n, 2, signed=signed)


def unpack_int3(packed, n, *, signed=True):
    return unpack_bits(packed, n, 3, signed=signed)


PACK = {2: pack_int2, 3: pack_int3, 4: pack_int4}
UNPACK = {2: unpack_int2, 3: unpack_int3, 4: unpack_int4}


# ---------------------------------------------------------------------------------------------------------------------
# Layouts.


@pytest.mark.slow
def test_layouts_by_hand():
    # 2 bits, element 4i + j in bits 2j, 2j + 1: 1 -> 01, -2 -> 10, 0 -> 00, -1 -> 11 = 0b11_00_10_01 = 0xC9; then
    # 1 -> 0x01 beside three zero pads.
    two = pack_int2(jnp.array([[1, -2, 0, -1, 1]], jnp.int8))
    assert two.dtype == jnp.uint8
    np.testing.assert_array_equal(np.asarray(two), np.array([[0xC9, 0x01]], np.uint8))
    # unsigned: 3 | 0 << 2 | 2 << 4 | 1 << 6 = 0b01_10_00_11 = 0x63
    np.testing.assert_array_equal(np.asarray(pack_int2(jnp.array([[3, 0, 2, 1]], jnp.int32))), [[0x63]])
    np.testing.assert_array_equal(
        np.asarray(unpack_int2(jnp.array([[0x63]], jnp.uint8), 4, signed=False)), [[3, 0, 2, 1]]
    )
    np.testing.assert_array_equal(np.asarray(unpack_int2(two, 5)), [[1, -2, 0, -1, 1]])

    # 3 bits, one stream: 1 -> 001 at bits 0-2, -2 -> 110 at 3-5, 3 -> 011 at 6-8, 0 at 9-11, -1 -> 111 at 12-14.
    # Byte 0 holds bits 0, 4, 5, 6, 7 = 0xF1; byte 1 holds bits 12-14 = 0x70 (bit 8 of the 3 is 0).
    three = pack_int3(jnp.array([[1, -2, 3, 0, -1]], jnp.int8))
    np.testing.assert_array_equal(np.asarray(three), np.array([[0xF1, 0x70]], np.uint8))
    np.testing.assert_array_equal(np.asarray(unpack_int3(three, 5)), [[1, -2, 3, 0, -1]])
    # Eight unsigned values fill three bytes: 7 + (1 << 6) + (2 << 9) + (3 << 12) + (4 << 15) + (5 << 18) + (6 << 21)
    # = 0xD63447, little-endian.
    full = pack_int3(jnp.array([[7, 0, 1, 2, 3, 4, 5, 6]], jnp.int32))
    np.testing.assert_array_equal(np.asarray(full), np.array([[0x47, 0x34, 0xD6]], np.uint8))
    np.testing.assert_array_equal(np.asarray(unpack_int3(full, 8, signed=False)), [[7, 0, 1, 2, 3, 4, 5, 6]])

    # 4 bits: 1 -> 0x1 low, -2 -> 0xE high; 7 beside a zero pad nibble.
    np.testing.assert_array_equal(np.asarray(pack_int4(jnp.array([[1, -2, 7]], jnp.int8))), [[0xE1, 0x07]])


@pytest.mark.parametrize("bits", [2, 3, 4])
@pytest.mark.slow
def test_round_trip_against_python_loop(bits):
    rng = np.random.default_rng(bits)
    half = 1 << (bits - 1)
    for n in (1, 5, 11):  # odd lengths: every width ends a row inside a byte
        for signed, lo, hi in ((True, -half, half), (False, 0, 2 * half)):
            values = rng.integers(lo, hi, size=(3, n))
            values[0, 0], values[-1, -1] = lo, hi - 1  # both ends of the range
            packed = pack_bits(jnp.asarray(values, jnp.int8), bits)
            assert packed.dtype == jnp.uint8 and packed.shape == (3, math.ceil(n * bits / 8))
            np.testing.assert_array_equal(np.asarray(packed), py_pack(values, bits))
            np.testing.assert_array_equal(np.asarray(PACK[bits](jnp.asarray(values, jnp.int32))), py_pack(values, bits))
            unpacked = unpack_bits(packed, n, bits, signed=signed)
            assert unpacked.dtype == jnp.int8
            np.testing.assert_array_equal(np.asarray(unpacked), values)
            np.testing.assert_array_equal(np.asarray(UNPACK[bits](packed, n, signed=signed)), values)
            np.testing.assert_array_equal(py_unpack(np.asarray(packed), n, bits, signed), values)
    # NumPy integers for the widths and lengths, as for every int argument.
    assert_bitwise_equal(pack_bits(jnp.asarray(values, jnp.int8), np.int64(bits)), packed)
    assert_bitwise_equal(unpack_bits(packed, np.int32(n), np.int64(bits), signed=signed), unpacked)


def test_jit_packs_as_eager_and_does_not_check():
    values = jnp.asarray(np.random.default_rng(0).integers(-4, 4, size=(2, 9)), jnp.int8)
    pack = jax.jit(pack_bits, static_argnums=1)
    assert_bitwise_equal(pack(values, 3), pack_bits(values, 3))
    unpack = jax.jit(unpack_bits, static_argnums=(1, 2))
    assert_bitwise_equal(unpack(pack(values, 3), 9, 3), values)
    # Traced values are not checked: 16 and -9 keep their low four bits, 0x0 and 0x7.
    wrapped = jax.jit(pack_int4)(jnp.array([[16, -9]], jnp.int32))
    np.testing.assert_array_equal(np.asarray(wrapped), [[0x70]])


# ---------------------------------------------------------------------------------------------------------------------
# Errors.


@pytest.mark.parametrize(
    "bits, bad",
    [(2, [4]), (2, [-3]), (2, [-1, 2]), (3, [8]), (3, [-5]), (3, [-1, 4]), (4, [16]), (4, [-9]), (4, [-1, 8])],
)
def test_out_of_range_values_are_refused(bits, bad):
    # `[-1, 2]`: each value fits one reading of 2 bits, but no one reading gives both back.
    values = jnp.array([[0] + bad], jnp.int32)
    with pytest.raises(ValueError, match=rf"`values` must lie in .* {bits} bits, got values in \[{min(bad + [0])}, "):
        PACK[bits](values)
    with pytest.raises(ValueError, match="`values`"):
        pack_bits(values, bits)


@pytest.mark.slow
def test_bad_widths_and_lengths_are_refused():
    values = jnp.zeros((2, 5), jnp.int8)
    for bits in (1, 5, 8):
        with pytest.raises(ValueError, match=rf"`bits` must be one of \(2, 3, 4\), got {bits}"):
            pack_bits(values, bits)
        with pytest.raises(ValueError, match="`bits`"):
            unpack_bits(jnp.zeros((2, 2), jnp.uint8), 5, bits)
    packed = pack_int3(values)  # 15 bits -> 2 bytes a row
    with pytest.raises(ValueError, match="`n`=6 does not match the packed row length 2"):
        unpack_int3(packed, 6)  # 18 bits would take 3 bytes
    with pytest.raises(ValueError, match="`n`=-1"):
        unpack_bits(packed, -1, 3)
    with pytest.raises(ValueError, match="`n`=9"):
        unpack_int2(pack_int2(values), 9)


# ---------------------------------------------------------------------------------------------------------------------
# Converted models store 2- and 3-bit weights at their width.


def init(make, seed: int):
    """`make(key)` with NumPy-random parameters (no random initialisation to compile)."""
    rng = np.random.default_rng(seed)

    def fill(leaf):
        if not isinstance(leaf, jax.ShapeDtypeStruct):
            return leaf
        return jnp.asarray(rng.uniform(-1, 1, leaf.shape).astype(leaf.dtype))

    return jax.tree.map(fill, eqx.filter_eval_shape(make, jax.random.key(0)))


@eqx.filter_jit
def apply_batch(model, xs):
    return jax.vmap(model)(xs)


def small_model():
    return {
        "mlp": init(lambda k: eqx.nn.MLP(37, 3, 9, 1, key=k), 0),
        "emb": init(lambda k: eqx.nn.Embedding(5, 11, key=k), 1),
    }


@pytest.mark.parametrize("bits", [2, 3])
@pytest.mark.slow
def test_converted_model_stores_weights_at_their_width(bits, tmp_path):
    float_model = small_model()
    fake = eqx_quant.quantize(float_model, weights=DynamicFakeQuant(bits, axis=0))
    unsigned = eqx_quant.quantize(float_model, weights=DynamicFakeQuant(bits, axis=0, signed=False, symmetric=False))
    for model, signed in ((fake, True), (unsigned, False)):
        converted = eqx_quant.convert(model)
        layers = {
            "mlp.layers.0": (model["mlp"].layers[0], converted["mlp"].layers[0]),
            "mlp.layers.1": (model["mlp"].layers[1], converted["mlp"].layers[1]),
            "emb": (model["emb"], converted["emb"]),
        }
        for name, (quantized, integer) in layers.items():
            w = quantized.layer.weight
            tensor = integer.qweight
            rows, per_row = w.shape[0], math.prod(w.shape[1:])
            assert tensor.packed_bits == bits and tensor.packed, name
            assert tensor.values.dtype == jnp.uint8 and tensor.values.shape == (rows, math.ceil(per_row * bits / 8))
            expected_nbytes = rows * math.ceil(per_row * bits / 8) + rows * 4  # one float32 scale per row
            if tensor.zero_point is not None:
                expected_nbytes += rows * 4
            assert tensor.nbytes == expected_nbytes, name
            # The bytes, read bit by bit, are the levels whose dequantization the fake quantizer returned.
            levels = py_unpack(np.asarray(tensor.values), per_row, bits, signed).reshape(w.shape)
            half = 1 << (bits - 1)
            assert levels.min() >= (-half if signed else 0) and levels.max() < (half if signed else 2 * half)
            scale = np.asarray(tensor.scale, np.float32)
            shifted = levels.astype(np.float32)
            if tensor.zero_point is not None:
                shifted = shifted - np.asarray(tensor.zero_point, np.float32)
            assert_bitwise_equal(scale * shifted, quantized.weight_quant(w))
            assert_bitwise_equal(tensor.dequantize(), quantized.weight_quant(w))
            np.testing.assert_array_equal(np.asarray(tensor.levels()), levels)
        assert isinstance(converted["mlp"].layers[0], IntLinear) and isinstance(converted["emb"], IntEmbedding)

        x = jnp.asarray(np.random.default_rng(5).normal(size=(4, 37)).astype(np.float32))
        assert_bitwise_equal(apply_batch(converted["mlp"], x), apply_batch(model["mlp"], x))
        for index in (0, 4):  # an embedding row is unpacked from its own bytes
            assert_bitwise_equal(converted["emb"](jnp.asarray(index)), model["emb"](jnp.asarray(index)))

        path = tmp_path / f"w{bits}{'s' if signed else 'u'}.eqx"
        eqx_quant.save(path, converted)
        assert_trees_equal(eqx_quant.load(path, zeros_like_tree(converted)), converted)


@pytest.mark.slow
def test_narrower_weights_make_smaller_files(tmp_path):
    float_model = small_model()
    sizes = {}
    for bits in (2, 3, 4):
        converted = eqx_quant.convert(eqx_quant.quantize(float_model, weights=DynamicFakeQuant(bits, axis=0)))
        path = tmp_path / f"w{bits}.eqx"
        eqx_quant.save(path, converted)
        sizes[bits] = path.stat().st_size
    # The integers of the three weights, at 2, 3 and 4 bits a value; everything else is the same.
    values = {
        bits: 9 * math.ceil(37 * bits / 8) + 3 * math.ceil(9 * bits / 8) + 5 * math.ceil(11 * bits / 8)
        for bits in (2, 3, 4)
    }
    assert sizes[2] < sizes[3] < sizes[4]
    assert sizes[4] - sizes[2] == values[4] - values[2] and sizes[4] - sizes[3] == values[4] - values[3]


def test_export_metadata_gives_the_packing_width(tmp_path):
    float_model = small_model()
    model = eqx_quant.quantize(
        float_model,
        weights={
            r"layers\.0": DynamicFakeQuant(2, axis=0),
            r"layers\.1": DynamicFakeQuant(3, axis=0),
            "emb": DynamicFakeQuant(8, axis=0),
        },
    )
    converted = eqx_quant.convert(model)
    path = tmp_path / "model.safetensors"
    eqx_quant.export_safetensors(path, converted)
    with open(path, "rb") as f:
        (length,) = struct.unpack("<Q", f.read(8))
        metadata = json.loads(f.read(length))["__metadata__"]
    assert metadata["bit_order"] == "low-first"
    tensors = safetensors.numpy.load_file(str(path))
    layers = {"mlp.layers.0": converted["mlp"].layers[0], "mlp.layers.1": converted["mlp"].layers[1]}
    for name, bits, per_row in (("mlp.layers.0", 2, 37), ("mlp.layers.1", 3, 9), ("emb", None, 11)):
        info = json.loads(metadata[name])
        assert info["packed_bits"] == bits and info["packed_int4"] is False, name
        assert info["bit_order"] == ("low-first" if bits else None) and info["nibble_order"] is None, name
        if bits is not None:
            stored = tensors[f"{name}.weight"]
            assert stored.dtype == np.uint8 and stored.shape[1] == math.ceil(per_row * bits / 8)
            levels = py_unpack(stored, per_row, bits, signed=True)
            np.testing.assert_array_equal(levels, np.asarray(layers[name].qweight.levels()))
