import dataclasses
import json
import os
import struct
from typing import Any

import equinox as eqx
import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec
from jaxtyping import PyTree

from ._packing import NIBBLE_ORDER
from ._quantizers import AbstractFakeQuantizer, DynamicFakeQuant, FakeQuant, LearnedFakeQuant
from ._transform import _map_nodes, _nodes
from .nn._int_layers import AbstractIntLayer, IntConv, IntEmbedding, IntLinear, QuantizedTensor
from .nn._layers import AbstractQuantLayer, QuantConv, QuantEmbedding, QuantLinear


_INT_LAYERS = {QuantLinear: IntLinear, QuantConv: IntConv, QuantEmbedding: IntEmbedding}


def _frozen_input_quant(quantizer: Any) -> Any:
    """A per-tensor learned input quantizer becomes the static quantizer with its current values."""
    if isinstance(quantizer, LearnedFakeQuant) and quantizer.axis is None:
        scale = max(float(quantizer.scale), quantizer.min_scale)
        zero_point = 0
        if quantizer.zero_point is not None:
            zero_point = int(np.round(np.clip(float(quantizer.zero_point), quantizer.qmin, quantizer.qmax)))
        return FakeQuant(scale, quantizer.qmin, quantizer.qmax, zero_point=zero_point)
    return quantizer


def _whole_tensor(quantizer: AbstractFakeQuantizer) -> AbstractFakeQuantizer:
    """The quantizer as it applies to a whole weight: without the `axis_name` that let it see one shard of it inside
    `jax.shard_map` (conversion sees the whole weight, and the grid is the same)."""
    if getattr(quantizer, "axis_name", None) is None:
        return quantizer
    return dataclasses.replace(quantizer, axis_name=None)  # pyright: ignore[reportArgumentType]


def _sharded_like(tensor: QuantizedTensor, weight: Any) -> QuantizedTensor:
    """`tensor` with its integers, scales and zero points sharded like the weight they come from.

    An axis of a leaf that has the length of the weight's axis in the same position (the weight's own axes, and the
    channel axis of a per-channel scale) takes that axis' partitioning; the other axes are replicated. Packed
    integers keep the partitioning of the weight's first axis. A weight without a `NamedSharding` (on one device,
    or traced) leaves `tensor` as it is.
    """
    sharding = getattr(weight, "sharding", None) if isinstance(weight, jax.Array) else None
    if isinstance(weight, jax.core.Tracer) or not isinstance(sharding, NamedSharding):
        return tensor
    spec = tuple(sharding.spec) + (None,) * (weight.ndim - len(sharding.spec))
    if tensor.view_shape != weight.shape:  # grouped: the view's axes are not the weight's
        return tensor

    def place(leaf: Any) -> Any:
        if not isinstance(leaf, jax.Array):
            return leaf
        if tensor.packed and leaf is tensor.values:
            leaf_spec = (spec[0], None)
        else:
            leaf_spec = tuple(s if n == m else None for s, n, m in zip(spec, leaf.shape, weight.shape, strict=True))
        return jax.device_put(leaf, NamedSharding(sharding.mesh, PartitionSpec(*leaf_spec)))

    return jax.tree.map(place, tensor)


def convert(model: PyTree) -> PyTree:
    """Converts a fake-quantized model into one that stores integer weights.

    Every [`eqx_quant.nn.QuantLinear`][], [`eqx_quant.nn.QuantConv`][] and [`eqx_quant.nn.QuantEmbedding`][] becomes
    an [`eqx_quant.nn.IntLinear`][], [`eqx_quant.nn.IntConv`][] or [`eqx_quant.nn.IntEmbedding`][]. The weight is
    stored as the integers that the weight quantizer's forward pass used (same grid, same rounding, same arithmetic),
    as int8 (int16/int32 for wider grids) or, for grids of at most 4 bits, packed two per byte; plus its float scales
    and zero points. No float copy of the weight is kept. Biases stay float32.

    Input quantizers are kept; a per-tensor [`eqx_quant.LearnedFakeQuant`][] is frozen into a static
    [`eqx_quant.FakeQuant`][] with its current scale and zero point. Layers whose input quantizer has one scale for the
    whole input (static, or a per-tensor dynamic one) and whose weight has one scale per tensor or per output channel
    then compute on integers (see [`eqx_quant.nn.IntLinear`][]); the others on the dequantized weight. A layer without a
    weight quantizer becomes its float layer. All other leaves are kept as they are (shardings included).

    **Sharding.** The integers, scales and zero points of a weight with a `NamedSharding` are sharded like it: the
    weight's axes keep their partitioning and per-channel scales follow their channels; packed 4-bit integers (one
    row of bytes per output channel) keep only the partitioning of the first axis, and grouped weights are left where
    the conversion put them. A weight quantizer's `axis_name` (for statistics across the shards of a
    `jax.shard_map`) is dropped: conversion sees the whole weight. Input quantizers keep theirs. See
    [Sharded training](../how-to/sharded.md).

    **Arguments:**

    - `model`: a model from [`eqx_quant.quantize`][] (trained or calibrated).

    **Returns:**

    The converted model. Its outputs equal the fake-quant model's up to floating-point summation order.

    !!! example

        ```python
        import equinox as eqx
        import jax
        import jax.numpy as jnp
        import eqx_quant

        mlp = eqx.nn.MLP(4, 2, 8, 1, key=jax.random.key(0))
        data = [jax.random.normal(jax.random.key(1), (32, 4))]
        fake = eqx_quant.calibrate(eqx_quant.quantize(mlp), data)
        real = eqx_quant.convert(fake)
        print(real.layers[0].weight.values.dtype)  # int8
        x = data[0][0]
        print(jnp.max(jnp.abs(real(x) - fake(x))))
        ```
    """

    def to_int(path: str, layer: AbstractQuantLayer) -> Any:
        if layer.weight_quant is None:
            return layer.layer
        if not isinstance(layer.weight_quant, AbstractFakeQuantizer):
            raise TypeError(
                f"Layer {path!r} has weight quantizer {type(layer.weight_quant).__name__}, which has no integer "
                "grid; only fake quantizers (FakeQuant, DynamicFakeQuant, LearnedFakeQuant) can be converted."
            )
        weight = layer.layer.weight  # pyright: ignore[reportAttributeAccessIssue]
        grid = _whole_tensor(layer.weight_quant).grid(weight)
        tensor = _sharded_like(QuantizedTensor.from_grid(grid, weight.shape, weight.dtype), weight)
        skeleton = eqx.tree_at(lambda l: l.weight, layer.layer, None)
        return _INT_LAYERS[type(layer)](skeleton, tensor, _frozen_input_quant(layer.input_quant))

    return _map_nodes(model, (AbstractQuantLayer,), to_int)


_MAGIC = b"EQXQUANT"


def _static_quantizers(model: PyTree) -> dict[str, dict[str, Any]]:
    """The configuration of every static [`eqx_quant.FakeQuant`][] in `model`, by path: it lives in the treedef,
    which `eqx.tree_serialise_leaves` does not write."""
    return {
        path: {"scale": q.scale, "qmin": q.qmin, "qmax": q.qmax, "zero_point": q.zero_point, "axis": q.axis}
        for path, q in _nodes(model, (FakeQuant,))
    }


def save(path: str | os.PathLike, model: PyTree) -> None:
    """Saves a model (integer weights as stored, packed 4-bit weights included) to a file.

    The file starts with a small JSON header holding the static configuration that the arrays alone do not carry:
    the scales, zero points and ranges of every static [`eqx_quant.FakeQuant`][] (e.g. calibrated input
    quantizers). The arrays follow, written by `eqx.tree_serialise_leaves`; 4-bit weights are already packed two per
    byte in a converted model, so they take half a byte per value and read back exactly. Each array carries a NumPy
    header of about 128 bytes.

    **Arguments:**

    - `path`: the file to write.
    - `model`: any model, typically from [`eqx_quant.convert`][].
    """
    header = json.dumps({"format": "eqx_quant", "version": 1, "static_quantizers": _static_quantizers(model)})
    encoded = header.encode()
    with open(path, "wb") as f:
        f.write(_MAGIC + struct.pack("<Q", len(encoded)) + encoded)
        eqx.tree_serialise_leaves(f, model)


def load(path: str | os.PathLike, like: PyTree) -> PyTree:
    """Loads what [`eqx_quant.save`][] wrote.

    **Arguments:**

    - `path`: the file.
    - `like`: a model with the same structure, e.g. the converted model of a freshly initialised and calibrated
        network. Its arrays and the configuration of its static [`eqx_quant.FakeQuant`][]s are replaced by the
        saved ones, so its calibration need not match.

    **Returns:**

    The saved model.

    **Raises:**

    `ValueError` if the file was not written by [`eqx_quant.save`][] or its static quantizers do not match the
    places of those in `like`.
    """
    with open(path, "rb") as f:
        if f.read(len(_MAGIC)) != _MAGIC:
            raise ValueError(f"`path`={str(path)!r} is not a file written by `eqx_quant.save`.")
        (length,) = struct.unpack("<Q", f.read(8))
        saved = json.loads(f.read(length).decode())["static_quantizers"]
        expected = set(_static_quantizers(like))
        if set(saved) != expected:
            raise ValueError(
                f"The static quantizers saved in {str(path)!r} are at {sorted(saved)}, but `like` has them at "
                f"{sorted(expected)}."
            )

        def restore(name: str, quantizer: FakeQuant) -> FakeQuant:
            c = saved[name]
            return FakeQuant(c["scale"], c["qmin"], c["qmax"], zero_point=c["zero_point"], axis=c["axis"])

        like = _map_nodes(like, (FakeQuant,), restore)
        return eqx.tree_deserialise_leaves(f, like)


def _layer_metadata(layer: AbstractIntLayer) -> dict[str, Any]:
    w = layer.weight
    info: dict[str, Any] = {
        "kind": type(layer).__name__,
        "shape": list(w.shape),
        "view_shape": list(w.view_shape),
        "qmin": w.qmin,
        "qmax": w.qmax,
        "packed_int4": w.packed,
        "nibble_order": NIBBLE_ORDER if w.packed else None,
        "group_size": w.view_shape[-1] if w.view_shape != w.shape else None,
        "axis": next((i for i, n in enumerate(w.scale.shape) if n > 1), None) if w.view_shape == w.shape else None,
        "dtype": w.dtype,
    }
    quantizer = layer.input_quant
    if isinstance(quantizer, FakeQuant):
        info["input"] = {
            "scale": quantizer.scale,
            "zero_point": quantizer.zero_point,
            "qmin": quantizer.qmin,
            "qmax": quantizer.qmax,
            "axis": quantizer.axis,
        }
    elif isinstance(quantizer, DynamicFakeQuant):
        info["input"] = {"dynamic_bits": quantizer.bits, "signed": quantizer.signed, "symmetric": quantizer.symmetric}
    return info


_SAFETENSORS_DTYPES = {
    "int8": "I8", "uint8": "U8", "int16": "I16", "int32": "I32", "float32": "F32", "float16": "F16",
    "bfloat16": "BF16", "float64": "F64",
}  # fmt: skip


def export_safetensors(path: str | os.PathLike, model: PyTree) -> None:
    """Writes the integer layers of a converted model to a safetensors file.

    For the layer at path `p` (as named by [`eqx_quant.quantize`][]), the file holds `p.weight` (the stored
    integers: int8/int16/int32, or uint8 with two 4-bit values per byte), `p.weight_scale`, `p.weight_zero_point`
    (if any) and `p.bias` (if any). The header's metadata maps `p` to a JSON object with the weight's shape, the
    grid (`qmin`, `qmax`), the per-channel `axis`, the `group_size`, `packed_int4` and its `nibble_order` (element
    `2i` of a row in the low nibble), and the input quantizer's parameters. It is readable with the `safetensors`
    library alone (`safetensors.numpy.load_file`).

    **Arguments:**

    - `path`: the file to write.
    - `model`: a model from [`eqx_quant.convert`][].
    """
    layers = _nodes(model, (AbstractIntLayer,))
    if not layers:
        raise ValueError("`model` has no integer layer; convert it first with `eqx_quant.convert`.")
    tensors: dict[str, np.ndarray] = {}
    metadata: dict[str, str] = {"format": "eqx_quant", "nibble_order": NIBBLE_ORDER}
    for name, layer in layers:
        name = name or "layer"
        w = layer.weight
        tensors[f"{name}.weight"] = np.asarray(w.values)
        tensors[f"{name}.weight_scale"] = np.asarray(w.scale)
        if w.zero_point is not None:
            tensors[f"{name}.weight_zero_point"] = np.asarray(w.zero_point)
        bias = getattr(layer.layer, "bias", None)
        if bias is not None:
            tensors[f"{name}.bias"] = np.asarray(bias)
        metadata[name] = json.dumps(_layer_metadata(layer))
    _write_safetensors(path, tensors, metadata)


def _write_safetensors(path: str | os.PathLike, tensors: dict[str, np.ndarray], metadata: dict[str, str]) -> None:
    """The safetensors format: an 8-byte little-endian header length, a JSON header, then the raw bytes."""
    header: dict[str, Any] = {"__metadata__": metadata}
    offset = 0
    blobs = []
    for name in sorted(tensors):
        array = np.ascontiguousarray(tensors[name])
        data = array.astype(array.dtype.newbyteorder("<"), copy=False).tobytes()
        header[name] = {
            "dtype": _SAFETENSORS_DTYPES[array.dtype.name],
            "shape": list(array.shape),
            "data_offsets": [offset, offset + len(data)],
        }
        offset += len(data)
        blobs.append(data)
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % 8)  # align the data to 8 bytes
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(encoded)))
        f.write(encoded)
        for data in blobs:
            f.write(data)
