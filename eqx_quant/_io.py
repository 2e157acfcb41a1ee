"""Saving, loading and exporting (converted) models."""

import json
import os
import struct
from typing import Any

import equinox as eqx
import numpy as np
from jaxtyping import PyTree

from ._packing import NIBBLE_ORDER
from ._quantizers import DynamicFakeQuant, FakeQuant
from ._tree import map_nodes, nodes
from .nn._int_layers import AbstractIntLayer


_MAGIC = b"EQXQUANT"


def _static_quantizers(model: PyTree) -> dict[str, dict[str, Any]]:
    """The configuration of every static [`eqx_quant.FakeQuant`][] in `model`, by path: it lives in the treedef,
    which `eqx.tree_serialise_leaves` does not write."""
    return {
        path: {"scale": q.scale, "qmin": q.qmin, "qmax": q.qmax, "zero_point": q.zero_point, "axis": q.axis}
        for path, q in nodes(model, (FakeQuant,))
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

        like = map_nodes(like, (FakeQuant,), restore)
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
    layers = nodes(model, (AbstractIntLayer,))
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
