"""Saving, loading and exporting (converted) models."""

import dataclasses
import json
import os
import secrets
import struct
from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax
import numpy as np
from jaxtyping import PyTree

from ._float_quantizers import AbstractFloatQuantizer, FloatFakeQuant, quantizer_metadata
from ._float_tensor import FloatQuantizedTensor
from ._packing import BIT_ORDER, NIBBLE_ORDER
from ._qtensor import QuantizedTensor
from ._quantizers import AbstractQuantizer, DynamicFakeQuant, FakeQuant
from ._tree import map_nodes, path_string
from .nn._int_layers import AbstractIntLayer


_MAGIC = b"EQXQUANT"
_VERSION = 3  # 2 added the descriptions of the quantized tensors, 3 the configuration of the other quantizers


def _header_nodes(model: PyTree, name: str) -> dict[str, Any]:
    """The static [`eqx_quant.FakeQuant`][]s and [`eqx_quant.FloatFakeQuant`][]s, and the
    [`eqx_quant.nn.QuantizedTensor`][]s and [`eqx_quant.nn.FloatQuantizedTensor`][]s, of `model` by path."""
    return _unique_nodes(model, (FakeQuant, FloatFakeQuant, QuantizedTensor, FloatQuantizedTensor), name)


def _unique_nodes(model: PyTree, types: tuple[type, ...], name: str) -> dict[str, Any]:
    """The nodes of `model` that are instances of `types`, by path; raises if two of them have the same path (a dict
    key with a dot, `{"a.b": ...}`, reads like the attributes `a.b`)."""
    is_node = lambda node: isinstance(node, types)  # noqa: E731
    found: dict[str, tuple[Any, Any]] = {}
    for key_path, leaf in jax.tree_util.tree_flatten_with_path(model, is_leaf=is_node)[0]:
        if not is_node(leaf):
            continue
        path = path_string(key_path)
        if path in found:
            first = jax.tree_util.keystr(found[path][0])
            raise ValueError(
                f"`{name}` has two quantizers or quantized tensors at the path {path!r}: at {first} and at "
                f"{jax.tree_util.keystr(key_path)}. Paths join keys with '.', so rename the dict key that holds a "
                f"'.' (or that reads like another key)."
            )
        found[path] = (key_path, leaf)
    return {path: leaf for path, (_, leaf) in found.items()}


def _static_quantizers(found: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """The configuration of every static [`eqx_quant.FakeQuant`][] and [`eqx_quant.FloatFakeQuant`][] by path: it
    lives in the treedef, which `eqx.tree_serialise_leaves` does not write. (A `FloatFakeQuant` is told apart by
    its `kind`; a `FakeQuant` has none, as in the files written before float formats.)"""
    out = {}
    for path, q in found.items():
        if isinstance(q, FakeQuant):
            out[path] = {
                "scale": q.scale,
                "qmin": q.qmin,
                "qmax": q.qmax,
                "zero_point": q.zero_point,
                "axis": q.axis,
                "group_size": q.group_size,
            }  # fmt: skip
        elif isinstance(q, FloatFakeQuant):
            out[path] = quantizer_metadata(q)
    return out


def _json_value(value: Any) -> Any:
    """A static field's value as JSON: numbers, strings, `None` and (nested) lists of them; anything else (a function,
    an object) by its name, so that the file never depends on a memory address or a printer's layout."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, (np.bool_, np.integer, np.floating)):
        return value.item()
    if isinstance(value, (tuple, list)):  # a `Layout` too (a named tuple)
        return [_json_value(v) for v in value]
    return f"<{getattr(value, '__qualname__', type(value).__qualname__)}>"


def _other_quantizers(model: PyTree, name: str) -> dict[str, dict[str, Any]]:
    """The configuration of every other quantizer of `model` (dynamic, learned, ...) by path: its type and its static
    fields. Its arrays (a learned scale) are saved with the others and checked by their shapes and dtypes, but these
    fields live in the treedef, which the file does not carry: `load` checks that `like` has the same."""
    found = _unique_nodes(model, (AbstractQuantizer,), name)
    out = {}
    for path, q in found.items():
        if isinstance(q, (FakeQuant, FloatFakeQuant)):
            continue
        fields = {f.name: _json_value(getattr(q, f.name)) for f in dataclasses.fields(q) if f.metadata.get("static")}
        out[path] = {"type": type(q).__name__, **fields}
    return out


def _tensor_descriptions(found: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """The static fields of every [`eqx_quant.nn.QuantizedTensor`][] (shape, grid, packing, dtype, and whether it
    has a zero point) and [`eqx_quant.nn.FloatQuantizedTensor`][] (format, scale rule, block size and axis, channel
    axes, shape, dtype) by path: what the stored integers or codes mean, which the arrays alone do not say."""
    out = {}
    for path, tensor in found.items():
        if isinstance(tensor, (QuantizedTensor, FloatQuantizedTensor)):
            info = {f.name: getattr(tensor, f.name) for f in dataclasses.fields(tensor) if f.metadata.get("static")}
            if isinstance(tensor, QuantizedTensor):
                info["zero_point"] = tensor.zero_point is not None
            out[path] = json.loads(json.dumps(info))  # as the header reads back: tuples become lists
    return out


def _tensor_table(descriptions: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """The descriptions as the header stores them: the field names once, then a row of values per tensor (`null`
    for a field that a tensor of the other kind has)."""
    fields = sorted({field for info in descriptions.values() for field in info})
    return {"fields": fields, "tensors": {path: [info.get(f) for f in fields] for path, info in descriptions.items()}}


def _from_table(table: dict[str, Any]) -> dict[str, dict[str, Any]]:
    fields = table["fields"]
    return {path: dict(zip(fields, row, strict=True)) for path, row in table["tensors"].items()}


def save(path: str | os.PathLike, model: PyTree) -> None:
    """Saves a model (integer weights as stored, packed 2-, 3- and 4-bit weights included, and the codes and scales
    of float-format weights) to a file.

    The file starts with a small JSON header holding the static configuration that the arrays alone do not carry:
    the scales, zero points and ranges of every static [`eqx_quant.FakeQuant`][] (e.g. calibrated input
    quantizers) and the format and scales of every [`eqx_quant.FloatFakeQuant`][]; the configuration of every other
    quantizer (dynamic ones such as [`eqx_quant.DynamicFakeQuant`][], and the static fields of learned ones); the
    shape, grid (`qmin`, `qmax`), packing width and dtype of every [`eqx_quant.nn.QuantizedTensor`][]; and the
    format, scale rule, block size and axis, shape and dtype of every [`eqx_quant.nn.FloatQuantizedTensor`][].
    [`eqx_quant.load`][] checks them against the model it loads into. The arrays follow, written by
    `eqx.tree_serialise_leaves`; weights of at most 4 bits are already packed at their width in a converted model
    (FP4 codes two per byte), so they read back exactly. Each array carries a NumPy header of about 128 bytes.

    The file is written to a temporary file beside `path` and then renamed over it, so a save that fails leaves an
    existing file at `path` as it was.

    Quantizers and quantized tensors are named in the header by their path, keys joined with `.` as
    [`eqx_quant.quantize`][] names layers: a dict key holding a `.` may make two of them share a name (the key
    `"a.b"` and the attributes `a.b`), which is refused.

    **Arguments:**

    - `path`: the file to write.
    - `model`: any model, typically from [`eqx_quant.convert`][].

    **Raises:**

    `ValueError` if two quantizers or quantized tensors of `model` have the same path (nothing is written).
    """
    found = _header_nodes(model, "model")
    header = {
        "format": "eqx_quant",
        "version": _VERSION,
        "static_quantizers": _static_quantizers(found),
        "quantized_tensors": _tensor_table(_tensor_descriptions(found)),
    }
    others = _other_quantizers(model, "model")
    if others:  # none (a converted, calibrated model): no entry, as in files of version 2 (of the same length)
        header["other_quantizers"] = others
    encoded = json.dumps(header, separators=(",", ":")).encode()

    def write(f):
        f.write(_MAGIC + struct.pack("<Q", len(encoded)) + encoded)
        eqx.tree_serialise_leaves(f, model)

    _write_replacing(path, write)


def _write_replacing(path: str | os.PathLike, write: Callable[[Any], None]) -> None:
    """Calls `write` on a fresh temporary file beside `path`, then renames it over `path`: a write that fails leaves
    an existing file at `path` as it was (and no temporary file behind)."""
    directory, base = os.path.split(os.path.abspath(os.fspath(path)))
    while True:  # a fresh name beside `path`, created with the permissions `open(path, "wb")` would give
        temporary = os.path.join(directory, f".{base}.{secrets.token_hex(6)}.tmp")
        try:
            fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_BINARY", 0), 0o666)
            break
        except FileExistsError:
            continue
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(temporary, path)
    except BaseException:
        if os.path.exists(temporary):
            os.remove(temporary)
        raise


def _check_paths(what: str, saved: Any, like: Any, path: str | os.PathLike) -> None:
    """Raises unless the paths (keys) of `saved`, read from the file at `path`, are those of `like`."""
    if set(saved) != set(like):
        raise ValueError(
            f"The {what} saved in {str(path)!r} are at {sorted(saved)}, but `like` has them at {sorted(like)}."
        )


def _check_tensors(saved: dict[str, Any], like: dict[str, Any], path: str | os.PathLike) -> None:
    _check_paths("quantized tensors", saved, like, path)
    for name, expected in like.items():
        for field in sorted(set(saved[name]) | set(expected)):
            if saved[name].get(field) != expected.get(field):
                raise ValueError(
                    f"The quantized tensor at {name!r} has `{field}`={saved[name].get(field)!r} in {str(path)!r} but "
                    f"{expected.get(field)!r} in `like`: the file holds integers of another grid, shape or packing."
                )


def _check_other_quantizers(saved: dict[str, Any], like: dict[str, Any], path: str | os.PathLike) -> None:
    _check_paths("dynamic and learned quantizers", saved, like, path)
    for name, config in saved.items():
        if like[name] != config:
            keys = [k for k in config | like[name] if config.get(k) != like[name].get(k)]
            ours = ", ".join(f"{k}={config.get(k)!r}" for k in keys)
            theirs = ", ".join(f"{k}={like[name].get(k)!r}" for k in keys)
            raise ValueError(
                f"The quantizer at {name!r} has {ours} in {str(path)!r} but {theirs} in `like`: the saved model "
                "computes with the former."
            )


def load(path: str | os.PathLike, like: PyTree) -> PyTree:
    """Loads what [`eqx_quant.save`][] wrote.

    **Arguments:**

    - `path`: the file.
    - `like`: a model with the same structure, e.g. the converted model of a freshly initialised and calibrated
        network. Its arrays and the configuration of its static [`eqx_quant.FakeQuant`][]s and
        [`eqx_quant.FloatFakeQuant`][]s are replaced by the saved ones, so its calibration need not match; its other
        quantizers (dynamic, learned) must be of the saved types and have their static fields (bits, range, layout,
        ...), since the saved model computes with those; its [`eqx_quant.nn.QuantizedTensor`][]s must have the
        shapes, grids (`qmin`, `qmax`), packing widths and dtypes of the saved ones, since the stored integers mean
        nothing on another grid, and its [`eqx_quant.nn.FloatQuantizedTensor`][]s their formats, scale rules, block
        sizes and axes, shapes and dtypes.

    **Returns:**

    The saved model.

    **Raises:**

    `ValueError` if the file was not written by [`eqx_quant.save`][], is cut short or holds more than `like` reads;
    if its quantizers or quantized tensors are not at the places of those in `like`, or a dynamic or learned
    quantizer or a quantized tensor differs from the one in `like` (the message names the path and the fields); or
    if an array does not match the one in `like`.

    !!! note

        Files of format version 1, written before weights of 2 and 3 bits were packed at their width, carry no
        description of their quantized tensors: they load into a `like` whose grids are all wider than 3 bits, and
        raise `ValueError` for one with a 2- or 3-bit grid (save them again from the model). Files of versions 1 and
        2 carry no configuration of the dynamic and learned quantizers, which are then taken from `like` unchecked.
    """
    with open(path, "rb") as f:
        if f.read(len(_MAGIC)) != _MAGIC:
            raise ValueError(f"`path`={str(path)!r} is not a file written by `eqx_quant.save`.")
        length_bytes = f.read(8)
        length = struct.unpack("<Q", length_bytes)[0] if len(length_bytes) == 8 else None
        encoded = b"" if length is None else f.read(length)
        if length is None or len(encoded) < length:
            raise ValueError(f"`path`={str(path)!r} is cut short within its `eqx_quant.save` header.")
        try:
            header = json.loads(encoded.decode())
            version, saved = header["version"], header["static_quantizers"]
            # Absent where the model had none, and from files of the versions before 3, which did not save them.
            others = header.get("other_quantizers", {}) if version == _VERSION else None
            tensors = _from_table(header["quantized_tensors"]) if version in (2, _VERSION) else None
        except (ValueError, KeyError, TypeError, AttributeError) as error:
            raise ValueError(f"`path`={str(path)!r} has a damaged `eqx_quant.save` header.") from error
        if version not in (1, 2, _VERSION):
            raise ValueError(f"`path`={str(path)!r} has format version {version!r}; this version reads 1 to 3.")
        found = _header_nodes(like, "like")
        _check_paths("static quantizers", saved, _static_quantizers(found), path)
        if tensors is not None:
            _check_tensors(tensors, _tensor_descriptions(found), path)
        else:
            narrow = [p for p, t in found.items() if isinstance(t, QuantizedTensor) and t.packed_bits in (2, 3)]
            if narrow:
                raise ValueError(
                    f"`path`={str(path)!r} has format version 1, which stored grids of at most 4 bits as 4-bit "
                    f"values, but `like` has 2- or 3-bit weights at {narrow}; save the model again."
                )
        if others is not None:
            _check_other_quantizers(others, _other_quantizers(like, "like"), path)

        def restore(name: str, quantizer: FakeQuant | FloatFakeQuant) -> FakeQuant | FloatFakeQuant:
            c = saved[name]
            kind = c.get("kind", "FakeQuant")
            if kind != type(quantizer).__name__:
                raise ValueError(
                    f"The static quantizer at {name!r} is a {kind} in {str(path)!r} but a {type(quantizer).__name__} "
                    "in `like`."
                )
            axis = tuple(c["axis"]) if isinstance(c["axis"], list) else c["axis"]  # JSON has no tuples
            if kind == "FloatFakeQuant":
                return FloatFakeQuant(c["dtype"], c["scale"], axis=axis)
            return FakeQuant(
                c["scale"], c["qmin"], c["qmax"], zero_point=c["zero_point"], axis=axis, group_size=c.get("group_size")
            )

        like = map_nodes(like, (FakeQuant, FloatFakeQuant), restore)
        try:
            model = eqx.tree_deserialise_leaves(f, like)
        except (ValueError, EOFError, RuntimeError) as error:
            raise ValueError(
                f"The arrays in `path`={str(path)!r} are cut short or do not match those of `like`: {error}"
            ) from error
        if f.read(1):
            raise ValueError(
                f"`path`={str(path)!r} holds more data than `like` reads: it was saved from another model."
            )
        return model


def _json_axis(axes: tuple[int, ...]) -> int | list[int] | None:
    return None if not axes else axes[0] if len(axes) == 1 else list(axes)


def _add_input_metadata(info: dict[str, Any], quantizer: Any) -> None:
    """Describes a layer's input quantizer in `info["input"]`, if it is static, dynamic or a float quantizer."""
    if isinstance(quantizer, FakeQuant):
        info["input"] = {
            "scale": quantizer.scale,
            "zero_point": quantizer.zero_point,
            "qmin": quantizer.qmin,
            "qmax": quantizer.qmax,
            "axis": quantizer.axis,
            "group_size": quantizer.group_size,
        }
    elif isinstance(quantizer, DynamicFakeQuant):
        info["input"] = {"dynamic_bits": quantizer.bits, "signed": quantizer.signed, "symmetric": quantizer.symmetric}
    elif isinstance(quantizer, AbstractFloatQuantizer):
        info["input"] = quantizer_metadata(quantizer)


def _layer_metadata(layer: AbstractIntLayer) -> dict[str, Any]:
    w = layer.qweight
    assert isinstance(w, QuantizedTensor)
    info: dict[str, Any] = {
        "kind": type(layer).__name__,
        "shape": list(w.shape),
        "view_shape": list(w.view_shape),
        "qmin": w.qmin,
        "qmax": w.qmax,
        "packed_bits": w.packed_bits,
        "bit_order": BIT_ORDER if w.packed else None,
        "packed_int4": w.packed_bits == 4,
        "nibble_order": NIBBLE_ORDER if w.packed_bits == 4 else None,
        "group_size": w.layout.group_size,
        # Per-group scales vary along every axis but the grouped one: a channel axis adds nothing to them.
        "axis": None if w.layout.group_size else _json_axis(w.layout.channel_axes(w.shape)),
        "dtype": w.dtype,
    }
    _add_input_metadata(info, layer.input_quant)
    return info


def _float_layer_metadata(layer: AbstractIntLayer) -> dict[str, Any]:
    w = layer.qweight
    assert isinstance(w, FloatQuantizedTensor)
    info: dict[str, Any] = {
        "kind": type(layer).__name__,
        "format": w.format,
        "element": w.element,
        "scale_format": w.scale_format,
        "scale_rule": w.scale_rule,
        "block_size": w.block_size,
        "block_axis": w.block_axis,
        "channel_axes": list(w.channel_axes),
        "shape": list(w.shape),
        "packed_fp4": w.packed,
        "nibble_order": NIBBLE_ORDER if w.packed else None,
        "dtype": w.dtype,
    }
    _add_input_metadata(info, layer.input_quant)
    return info


_SAFETENSORS_DTYPES = {
    "int8": "I8", "uint8": "U8", "int16": "I16", "int32": "I32", "float32": "F32", "float16": "F16",
    "bfloat16": "BF16", "float64": "F64",
}  # fmt: skip


def export_safetensors(path: str | os.PathLike, model: PyTree) -> None:
    """Writes the integer layers of a converted model to a safetensors file.

    For the layer at path `p` (as named by [`eqx_quant.quantize`][]), the file holds `p.weight` (the stored
    integers: int8/int16/int32, or uint8 rows of 2-, 3- or 4-bit values packed by [`eqx_quant.pack_bits`][]),
    `p.weight_scale`, `p.weight_zero_point` (if any) and `p.bias` (if any). The header's metadata maps `p` to a JSON
    object with the weight's shape, the grid (`qmin`, `qmax`), the per-channel `axis`, the `group_size`,
    `packed_bits` (2, 3, 4, or `null` for unpacked integers) and its `bit_order` (`"low-first"`: element `j` of a
    row in bits `j * packed_bits` onwards of the row's little-endian bit stream), and the input quantizer's
    parameters. For readers of 4-bit files, `packed_int4` (whether the weight holds two 4-bit values per byte) and
    its `nibble_order` (element `2i` of a row in the low nibble) are kept. It is readable with the `safetensors`
    library alone (`safetensors.numpy.load_file`).

    A layer whose weight is in a low-precision float format (an [`eqx_quant.nn.FloatQuantizedTensor`][]) has
    `p.weight` holding its codes (uint8: the `ml_dtypes` bit pattern of each FP8 or FP6 element, or two FP4
    elements per byte, element `2i` of a row in the low nibble), `p.weight_scale` (uint8 E8M0 or `float8_e4m3fn`
    bytes per block, or float32 scales per tensor or channel), `p.weight_tensor_scale` (NVFP4's float32 tensor
    scale) and `p.bias`; its metadata gives the `format`, the `element` format, the `scale_format`, the MX
    `scale_rule`, the `block_size` and `block_axis`, the `channel_axes` of float scales, the `shape`, `packed_fp4`
    with its `nibble_order`, the `dtype`, and the input quantizer.

    **Arguments:**

    - `path`: the file to write (through a temporary file beside it, as [`eqx_quant.save`][] does).
    - `model`: a model from [`eqx_quant.convert`][].

    **Raises:**

    `ValueError` if `model` has no integer layer, or two of its integer layers have the same path (nothing is
    written).
    """
    layers = list(_unique_nodes(model, (AbstractIntLayer,), "model").items())
    if not layers:
        raise ValueError("`model` has no integer layer; convert it first with `eqx_quant.convert`.")
    tensors: dict[str, np.ndarray] = {}
    metadata: dict[str, str] = {"format": "eqx_quant", "nibble_order": NIBBLE_ORDER, "bit_order": BIT_ORDER}
    for name, layer in layers:
        name = name or "layer"
        w = layer.qweight
        if isinstance(w, FloatQuantizedTensor):
            tensors[f"{name}.weight"] = np.asarray(w.codes)
            tensors[f"{name}.weight_scale"] = np.asarray(w.scale)
            if w.tensor_scale is not None:
                tensors[f"{name}.weight_tensor_scale"] = np.asarray(w.tensor_scale)
            metadata[name] = json.dumps(_float_layer_metadata(layer))
        else:
            tensors[f"{name}.weight"] = np.asarray(w.values)
            tensors[f"{name}.weight_scale"] = np.asarray(w.scale)
            if w.zero_point is not None:
                tensors[f"{name}.weight_zero_point"] = np.asarray(w.zero_point)
            metadata[name] = json.dumps(_layer_metadata(layer))
        bias = getattr(layer.layer, "bias", None)
        if bias is not None:
            tensors[f"{name}.bias"] = np.asarray(bias)
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

    def write(f):
        f.write(struct.pack("<Q", len(encoded)))
        f.write(encoded)
        for data in blobs:
            f.write(data)

    _write_replacing(path, write)
