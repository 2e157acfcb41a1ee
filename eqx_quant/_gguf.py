"""GGUF, llama.cpp's file: writing a converted model's weights in their GGML types, and reading them back."""

import os
import struct
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from jaxtyping import PyTree

from ._export import (
    LAYER,
    Names,
    check_exportable,
    is_tensor,
    named_leaves,
    resolve_names,
    split_stacked,
    stack_length,
)
from ._format import GGML_BLOCK, GGML_FORMATS, FloatFormat, Format, IntFormat, mx_format
from ._layout import Layout
from ._qarray import QuantizedArray
from ._quantizers import AbstractQuantizer
from ._serialise import write_replacing


_MAGIC = b"GGUF"
_VERSION = 3
_ALIGNMENT = 32  # GGUF's default, which a file need not state
_MAX_NAME = 63  # GGML_MAX_NAME is 64 bytes with the terminating NUL

# GGML's tensor types that eqx_quant writes and reads (ids, names, bytes per block of 32, plain dtypes)
_F32, _F16, _BF16 = 0, 1, 30
_Q4_0, _Q5_0, _Q8_0, _MXFP4 = 2, 6, 8, 39
_TYPE_NAMES = {_F32: "F32", _F16: "F16", _BF16: "BF16", _Q4_0: "Q4_0", _Q5_0: "Q5_0", _Q8_0: "Q8_0", _MXFP4: "MXFP4",
               24: "I8", 25: "I16", 26: "I32", 27: "I64", 28: "F64"}  # fmt: skip
_BLOCK_BYTES = {_Q4_0: 18, _Q5_0: 22, _Q8_0: 34, _MXFP4: 17}
_PLAIN = {_F32: np.dtype("<f4"), _F16: np.dtype("<f2"), _BF16: np.dtype(ml_dtypes.bfloat16), 24: np.dtype("i1"),
          25: np.dtype("<i2"), 26: np.dtype("<i4"), 27: np.dtype("<i8"), 28: np.dtype("<f8")}  # fmt: skip
_INT_TYPES = {"int8": 24, "int16": 25, "int32": 26, "int64": 27}
_GGML_OF_FORMAT = {GGML_FORMATS["q8_0"]: _Q8_0, GGML_FORMATS["q4_0"]: _Q4_0, GGML_FORMATS["q5_0"]: _Q5_0}
_FORMAT_OF_GGML = {v: k for k, v in _GGML_OF_FORMAT.items()}

# GGUF's metadata value types
_UINT8, _INT8, _UINT16, _INT16, _UINT32, _INT32, _FLOAT32, _BOOL, _STRING, _ARRAY, _UINT64, _INT64, _FLOAT64 = range(13)
_SCALAR_CODES = {_UINT8: "<B", _INT8: "<b", _UINT16: "<H", _INT16: "<h", _UINT32: "<I", _INT32: "<i",
                 _FLOAT32: "<f", _BOOL: "<?", _UINT64: "<Q", _INT64: "<q", _FLOAT64: "<d"}  # fmt: skip
_NUMPY_VALUE_TYPES = {"uint8": _UINT8, "int8": _INT8, "uint16": _UINT16, "int16": _INT16, "uint32": _UINT32,
                      "int32": _INT32, "float32": _FLOAT32, "bool": _BOOL, "uint64": _UINT64, "int64": _INT64,
                      "float64": _FLOAT64}  # fmt: skip
# The types GGUF's specification gives the standard keys that llama.cpp reads while loading a file (and checks)
_STANDARD_KEYS = {"general.architecture": str, "general.name": str, "general.alignment": np.uint32,
                  "general.quantization_version": np.uint32, "general.file_type": np.uint32}  # fmt: skip


def _ggml_type(fmt: Format, layout: Layout, shape: tuple[int, ...]) -> int | None:
    """The GGML type that stores arrays of `fmt` and `layout` exactly, or `None`: blocks of 32 along the last axis
    (the rows of a GGUF tensor), in Q8_0, Q4_0, Q5_0 or (E2M1 elements with E8M0 scales, either scale rule) MXFP4."""
    if layout.group_size != GGML_BLOCK or layout.tile_axis(shape) != len(shape) - 1:
        return None
    if isinstance(fmt, IntFormat):
        return _GGML_OF_FORMAT.get(fmt)
    if isinstance(fmt, FloatFormat) and fmt.element == "float4_e2m1fn" and fmt.scale == "e8m0":
        return _MXFP4
    return None


#
# Blocks.
#


def _blocks(array: QuantizedArray, ggml: int) -> np.ndarray:
    """The GGML blocks of a quantized array, `(..., rows, bytes per row)` (stacked axes first)."""
    codes = np.asarray(array.unpacked()).astype(np.int32)  # (..., blocks, 32) along each row
    lead = codes.shape[:-1]  # (..., rows, blocks)
    if ggml == _MXFP4:
        head = np.asarray(array.scale, np.uint8).reshape(*lead, 1)  # the E8M0 byte: the exponent plus 127
        u = codes
    else:
        d = np.asarray(array.scale).astype("<f2").reshape(*lead, 1)
        head = d.view(np.uint8)
        u = codes - array.format.qmin  # pyright: ignore[reportAttributeAccessIssue]
    half = GGML_BLOCK // 2
    low, high = u[..., :half], u[..., half:]
    if ggml == _Q8_0:
        body = [codes.astype(np.int8).view(np.uint8)]
    elif ggml == _Q5_0:
        bits = ((u >> 4) & 1).astype(np.uint64) << np.arange(GGML_BLOCK, dtype=np.uint64)
        qh = np.sum(bits, axis=-1, keepdims=True).astype("<u4").view(np.uint8)
        body = [qh, ((low & 15) | ((high & 15) << 4)).astype(np.uint8)]
    else:  # Q4_0 and MXFP4: element j in the low nibble of byte j, element j + 16 in its high nibble
        body = [(low | (high << 4)).astype(np.uint8)]
    blocks = np.concatenate([head, *body], axis=-1)
    shape = array.shape
    rows = shape[:-1]
    stack = lead[: len(lead) - len(rows) - 1]
    return blocks.reshape(*stack, *rows, -1)


def _from_blocks(
    data: np.ndarray, ggml: int, stack: tuple[int, ...], shape: tuple[int, ...], fmt: Format, dtype: str
) -> QuantizedArray:
    """The quantized array that GGML blocks hold: a tensor of `shape` in `fmt`, stacked `stack` times."""
    blocks = data.reshape(*stack, *shape[:-1], shape[-1] // GGML_BLOCK, _BLOCK_BYTES[ggml])
    if ggml == _MXFP4:
        scale, body = blocks[..., :1].copy(), blocks[..., 1:]
    else:
        scale, body = np.ascontiguousarray(blocks[..., :2]).view("<f2").astype(np.float16), blocks[..., 2:]
    if ggml == _Q8_0:
        codes = body.view(np.int8).astype(np.int32)
    else:
        high_bits = 0
        if ggml == _Q5_0:
            qh = np.ascontiguousarray(body[..., :4]).view("<u4").astype(np.int64)
            high_bits = ((qh >> np.arange(GGML_BLOCK)) & 1).astype(np.int32)
            body = body[..., 4:]
        nibbles = body.astype(np.int32)
        codes = np.concatenate([nibbles & 15, nibbles >> 4], axis=-1) | (high_bits << 4)
        if isinstance(fmt, IntFormat):
            codes = codes + fmt.qmin
    layout = Layout(group_size=GGML_BLOCK)
    values = codes.reshape(*stack, *shape)
    bits = fmt.packed_width
    if bits is not None:  # two codes a byte, element 2i in the low nibble, a row of bytes per index of the first axis
        rows = shape[0] if len(shape) >= 2 else 1
        flat = values.reshape(*stack, rows, -1) & 15
        values = (flat[..., 0::2] | (flat[..., 1::2] << 4)).astype(np.uint8)
    else:
        values = values.astype(np.uint8 if isinstance(fmt, FloatFormat) else np.int8)
    scale = scale.reshape(*stack, *layout.broadcast_shape(shape))
    return QuantizedArray(jnp.asarray(values), jnp.asarray(scale), None, None, fmt, layout, shape, dtype, bits)


#
# The file.
#


def _string(text: str) -> bytes:
    data = text.encode()
    return struct.pack("<Q", len(data)) + data


def _int_type(items: list[int], key: str, value: Any) -> int:
    """INT32, else INT64, else UINT64: the first of GGUF's integer types that holds every item."""
    low, high = min(items, default=0), max(items, default=0)
    if -(2**31) <= low and high < 2**31:
        return _INT32
    if -(2**63) <= low and high < 2**63:
        return _INT64
    if 0 <= low and high < 2**64:
        return _UINT64
    raise ValueError(f"`metadata`[{key!r}]={value!r} holds an integer outside GGUF's 64-bit types (INT64 and UINT64: "
                     "-2**63 to 2**64 - 1).")  # fmt: skip


def _value_type(value: Any, key: str) -> int:
    if isinstance(value, np.generic | np.ndarray) and value.dtype.name in _NUMPY_VALUE_TYPES:
        return _ARRAY if isinstance(value, np.ndarray) and value.ndim else _NUMPY_VALUE_TYPES[value.dtype.name]
    if isinstance(value, bool):
        return _BOOL
    if isinstance(value, int):
        return _int_type([value], key, value)
    if isinstance(value, float):
        try:
            struct.pack("<f", value)
        except OverflowError:
            raise ValueError(f"`metadata`[{key!r}]={value!r} is beyond FLOAT32, the type of a Python float: pass "
                             "np.float64(value) for a FLOAT64.") from None  # fmt: skip
        return _FLOAT32
    if isinstance(value, str):
        return _STRING
    if isinstance(value, (list, tuple)):
        return _ARRAY
    raise TypeError(
        f"`metadata`[{key!r}] must be a bool, int, float, str, NumPy scalar, or a list or 1-D NumPy array of them, got "
        f"{value!r} of type {type(value).__name__}."
    )


def _encode_value(value: Any, kind: int, key: str) -> bytes:
    if kind == _STRING:
        return _string(value)
    if kind != _ARRAY:
        return struct.pack(_SCALAR_CODES[kind], value.item() if isinstance(value, np.generic) else value)
    items = list(value) if not isinstance(value, np.ndarray) else [value[i] for i in range(len(value))]
    if isinstance(value, np.ndarray):
        if value.ndim != 1:
            raise ValueError(f"`metadata`[{key!r}] must be a 1-D array, got shape {value.shape}.")
        inner = _NUMPY_VALUE_TYPES[value.dtype.name]
    else:
        if items and all(type(item) is int for item in items):  # Python ints: the type that holds them all
            inner = _int_type(items, key, value)
        else:
            kinds = {_value_type(item, key) for item in items}
            if _ARRAY in kinds or len(kinds) > 1:
                raise ValueError(f"`metadata`[{key!r}] must be a list of values of one type, got {value!r}.")
            inner = kinds.pop() if kinds else _INT32
    return struct.pack("<IQ", inner, len(items)) + b"".join(_encode_value(item, inner, key) for item in items)


def _write(
    path: str | os.PathLike,
    metadata: dict[str, Any],
    tensors: list[tuple[str, int, tuple[int, ...], bytes]],
    alignment: int,
):
    """A GGUF (version 3) file: the header, the metadata, the tensor descriptions, then the data, each tensor's at an
    offset aligned to `alignment` bytes."""
    head = [_MAGIC, struct.pack("<IQQ", _VERSION, len(tensors), len(metadata))]
    for key, value in metadata.items():
        kind = _value_type(value, key)
        head.append(_string(key) + struct.pack("<I", kind) + _encode_value(value, kind, key))
    offset = 0
    for name, ggml, shape, data in tensors:
        dims = tuple(reversed(shape)) or (1,)  # GGUF lists the fastest-varying axis first
        head.append(_string(name) + struct.pack("<I", len(dims)) + struct.pack(f"<{len(dims)}Q", *dims))
        head.append(struct.pack("<IQ", ggml, offset))
        offset += len(data) + (-len(data) % alignment)
    header = b"".join(head)
    header += b"\0" * (-len(header) % alignment)

    def write(f):
        f.write(header)
        for _, _, _, data in tensors:
            f.write(data)
            f.write(b"\0" * (-len(data) % alignment))

    write_replacing(path, write)


def export_gguf(
    path: str | os.PathLike,
    model: PyTree,
    *,
    names: Names = None,
    metadata: Mapping[str, Any] | None = None,
    float_type: str = "F32",
) -> None:
    """Writes a converted model to a GGUF file, llama.cpp's format: each quantized weight in its GGML type, every
    other array as a float (or integer) tensor.

    A weight whose [`eqx_quant.QuantizedArray`][] has a GGML type is written in it, blocks of 32 along its last axis
    (a linear weight's input features, a GGUF tensor's rows): the formats `"q8_0"`, `"q4_0"`, `"q5_0"` (of the
    recipes of those names) as Q8_0, Q4_0, Q5_0, and MXFP4 (`"mxfp4"`, either scale rule) as GGUF's MXFP4. The file
    holds the codes and scales the model computes with: `gguf`'s dequantization of each tensor is, bit for bit, the
    model's weight ([`eqx_quant.QuantizedArray.dequantize`][], the fake-quantized weight of the model that was
    converted), except for values below float32's normal range, which XLA flushes to zero. Other floating arrays
    (biases, norms, weights left float) are F32, or F16/BF16 with `float_type` for those of rank 2 or more; integer
    arrays I8 to I64, and boolean arrays (the flag in `eqx.nn.BatchNorm`'s state) I8 of 0 and 1, which
    [`eqx_quant.load_gguf`][] reads back as booleans. A tensor's name is its path (as [`eqx_quant.quantize`][]
    names layers; a layer's weight and bias are `<layer>.weight` and `<layer>.bias`), or what `names` makes of it.

    The file states nothing about a model's architecture: for llama.cpp to run it, give its tensors llama.cpp's names
    (`names`) and its architecture's keys (`metadata`: `general.architecture`, hyperparameters, tokenizer), as
    `convert_hf_to_gguf.py` writes them. See [Serving a quantized model](../how-to/serving.md).

    **Arguments:**

    - `path`: the file to write (through a temporary file beside it, as [`eqx_quant.save`][] does).
    - `model`: a model from [`eqx_quant.convert`][] (whose layers quantize weights only: llama.cpp computes
        activations in floating point).
    - `names`: the name of each tensor in the file: a function of the path (returning `None` leaves the tensor
        out), or a mapping from every path to a name (or `None`). A name holding `{layer}` splits a stacked tensor
        (layers built with `eqx.filter_vmap`) along its first axis into one tensor per layer,
        `"blk.{layer}.attn_q.weight"` becoming `blk.0.attn_q.weight`, `blk.1.attn_q.weight`, ...; without it, a
        stacked tensor is one tensor with the stack as its slowest axes.
    - `metadata`: key-value pairs written into the file, in order. Python values take `gguf`'s types (`bool`,
        `int` as INT32 (INT64, then UINT64, beyond it), `float` as FLOAT32, `str`, lists as arrays); NumPy scalars
        and 1-D arrays keep theirs (`np.uint32(4096)`: llama.cpp reads most integer keys as UINT32). The standard
        keys llama.cpp checks take GGUF's types: `general.architecture` and `general.name` a `str`;
        `general.alignment`, `general.quantization_version` and `general.file_type` UINT32 (a Python `int` is
        written so). `general.quantization_version` is 2 unless given; `general.alignment` (a power of two, 32
        unless given) is the alignment the tensors' data is written at. The file states no `general.architecture`
        unless given.
    - `float_type`: `"F32"`, `"F16"` or `"BF16"`: the type of float tensors of rank 2 or more (rank 0 and 1 are
        always F32, as llama.cpp reads its norms). The rank is the tensor's in the file: a stack of biases written
        whole has rank 2, each of one split by `{layer}` rank 1.

    **Raises:**

    `ValueError`, before anything is written: for a model without arrays; for a quantized weight whose format has no
    GGML type (naming the layer, the format and its blocks); for a layer that is quantized but not converted, or
    that quantizes its input (or any other quantizer in the model); for names that repeat, exceed 63 bytes, leave
    out every tensor, or a `names` mapping that misses a tensor or names one the model does not have; for a metadata
    integer outside INT64 and UINT64, a float beyond FLOAT32, or a `general.alignment` that is not a power of two of
    at least 8; for a float tensor with finite values beyond the range of the type it is written in (65504 for F16),
    naming it and its largest magnitude. `TypeError` for metadata of other types (and standard keys of other types
    than GGUF's).

    !!! example

        ```python
        import os
        import tempfile

        import equinox as eqx
        import jax
        import eqx_quant

        mlp = eqx.nn.MLP(64, 8, 64, 1, key=jax.random.key(0))
        model = eqx_quant.convert(eqx_quant.quantize(mlp, **eqx_quant.recipe("q4_0")))
        path = os.path.join(tempfile.mkdtemp(), "mlp.gguf")
        eqx_quant.export_gguf(path, model, metadata={"general.name": "mlp"})
        ```
    """
    if float_type not in ("F32", "F16", "BF16"):
        raise ValueError(f"`float_type` must be 'F32', 'F16' or 'BF16', got float_type={float_type!r}.")
    if metadata is not None and not isinstance(metadata, Mapping):
        raise TypeError(f"`metadata` must be a mapping or None, got metadata={metadata!r} of type "
                        f"{type(metadata).__name__}.")  # fmt: skip
    metadata = dict(metadata or {})
    for key in metadata:
        if not isinstance(key, str):
            raise TypeError(f"`metadata` keys must be strings, got {key!r}.")
    metadata.setdefault("general.quantization_version", np.uint32(2))
    for key, kind in _STANDARD_KEYS.items():
        if key not in metadata:
            continue
        value = metadata[key]
        if kind is np.uint32 and type(value) is int and 0 <= value < 2**32:
            value = metadata[key] = np.uint32(value)
        if not isinstance(value, kind):
            want = "a str" if kind is str else "an np.uint32 (or an int from 0 to 2**32 - 1)"
            raise TypeError(f"`metadata`[{key!r}] must be {want}, its type in GGUF, which llama.cpp checks; got "
                            f"{value!r} of type {type(value).__name__}.")  # fmt: skip
    alignment = int(metadata.get("general.alignment", _ALIGNMENT))
    if alignment < 8 or alignment & (alignment - 1):
        raise ValueError(f"`metadata`['general.alignment'] must be a power of two of at least 8, got {alignment}.")
    for key, value in metadata.items():
        _encode_value(value, _value_type(value, key), key)  # checked before anything is computed
    tied = check_exportable(model, "a GGUF file")  # tied heads: left out, the table written once
    leaves, _ = named_leaves(model)
    for name, leaf in leaves:
        if isinstance(leaf, AbstractQuantizer) and not name.startswith(tied):
            raise ValueError(
                f"{name!r} is a {type(leaf).__name__}, but llama.cpp computes activations in floating point: a GGUF "
                "file holds weights only. Quantize with rules that leave inputs float (`input=None`, as the recipes "
                "'q8_0', 'q4_0', 'q5_0' do)."
            )
    arrays = [(name, leaf) for name, leaf in leaves if is_tensor(leaf)]
    if not arrays:
        raise ValueError(f"`model` has no array to write to a GGUF file, got model={model!r}.")
    for name, leaf in arrays:
        if isinstance(leaf, QuantizedArray) and _ggml_type(leaf.format, leaf.layout, leaf.shape) is None:
            if leaf.layout.group_size is not None:
                scales = f"in groups of {leaf.layout.group_size} along axis {leaf.layout.tile_axis(leaf.shape)}"
            else:
                scales = (
                    f"one scale per index of axes {leaf.layout.axes}" if leaf.layout.axes else "one scale per tensor"
                )
            layer = name.removesuffix(".weight") or "(the model itself)"
            raise ValueError(
                f"Layer {layer!r} has weights in format {leaf.format.name}, {scales}, of shape {leaf.shape}, which has "
                "no GGML type. GGUF stores Q8_0, Q4_0, Q5_0 and "
                "MXFP4 in blocks of 32 along the last axis: quantize it with the recipes 'q8_0', 'q4_0', 'q5_0' or "
                "'mxfp4' (or leave it float)."
            )
        if not isinstance(leaf, QuantizedArray) and not (
            jnp.issubdtype(leaf.dtype, jnp.floating) or leaf.dtype.name in _INT_TYPES or leaf.dtype == bool
        ):
            raise ValueError(f"{name!r} has dtype {leaf.dtype}, which GGUF does not store.")
    mapped = resolve_names(names, [name for name, _ in arrays], "model")
    tensors: list[tuple[str, int, tuple[int, ...], bytes]] = []
    seen: dict[str, str] = {}
    for where, leaf in arrays:
        name = mapped[where]
        if name is None:
            continue
        for part, piece in split_stacked(name, leaf, where):
            if len(part.encode()) > _MAX_NAME:
                raise ValueError(f"The tensor name {part!r} (of {where!r}) is longer than GGUF's {_MAX_NAME} bytes.")
            if part in seen:
                raise ValueError(f"Two tensors are named {part!r}: {seen[part]!r} and {where!r}.")
            seen[part] = where
            label = repr(part) if part == where else f"{part!r} (of {where!r})"
            tensors.append((part, *_tensor_data(piece, float_type, label)))
    _write(path, metadata, tensors, alignment)


def _tensor_data(leaf: Any, float_type: str, name: str) -> tuple[int, tuple[int, ...], bytes]:
    """`(GGML type, shape, bytes)` of a leaf; raises, naming the tensor, where a float would narrow to infinities."""
    if isinstance(leaf, QuantizedArray):
        ggml = _ggml_type(leaf.format, leaf.layout, leaf.shape)
        assert ggml is not None
        shape = (*leaf.scale.shape[: leaf.stack_depth], *leaf.shape)
        return ggml, shape, _blocks(leaf, ggml).tobytes()
    array = np.asarray(leaf)
    if array.dtype == np.bool_:
        array = array.astype(np.int8)  # GGUF has no boolean type
    if array.dtype.name in _INT_TYPES:
        ggml = _INT_TYPES[array.dtype.name]
    else:
        ggml = {"F32": _F32, "F16": _F16, "BF16": _BF16}[float_type] if array.ndim >= 2 else _F32
    with np.errstate(over="ignore"):
        stored = array.astype(_PLAIN[ggml])
    if ggml in (_F32, _F16, _BF16):
        overflow = np.isinf(stored) & np.isfinite(array)
        if np.any(overflow):
            kind = _TYPE_NAMES[ggml]
            largest = float(np.max(np.abs(array[overflow])))
            wider = {"F16": " Export with float_type='F32' or 'BF16'.", "BF16": " Export with float_type='F32'."}
            raise ValueError(
                f"The tensor {name} holds values up to {largest:.7g} in magnitude, beyond the range of {kind} (at "
                f"most {float(ml_dtypes.finfo(_PLAIN[ggml]).max):.7g}), in which it is written (float_type="
                f"{float_type!r}): they would be infinities.{wider.get(kind, '')}"
            )
    return ggml, array.shape, np.ascontiguousarray(stored).tobytes()


class _Reader:
    """The parts of a GGUF file that loading needs: its tensors' types, shapes (slowest axis first) and bytes."""

    def __init__(self, path: str | os.PathLike):
        self.path = str(path)
        with open(path, "rb") as f:
            self.data = f.read()
        self.pos = 0
        if self.data[:4] != _MAGIC:
            raise ValueError(f"`path`={self.path!r} is not a GGUF file.")
        self.pos = 4
        version, n_tensors, n_kv = self._unpack("<IQQ")
        if version not in (2, 3):
            raise ValueError(f"`path`={self.path!r} is GGUF version {version}; versions 2 and 3 are read.")
        alignment = _ALIGNMENT
        for _ in range(n_kv):
            key = self._string()
            (kind,) = self._unpack("<I")
            value = self._value(kind)
            if key == "general.alignment":
                alignment = int(value)
        infos = []
        for _ in range(n_tensors):
            name = self._string()
            (ndim,) = self._unpack("<I")
            dims = self._unpack(f"<{ndim}Q")
            ggml, offset = self._unpack("<IQ")
            infos.append((name, ggml, tuple(reversed(dims)), offset))
        start = self.pos + (-self.pos % alignment)
        self.tensors: dict[str, tuple[int, tuple[int, ...], np.ndarray]] = {}
        for name, ggml, shape, offset in infos:
            count = int(np.prod(shape))
            if ggml in _BLOCK_BYTES:
                size = count // GGML_BLOCK * _BLOCK_BYTES[ggml]
            elif ggml in _PLAIN:
                size = count * _PLAIN[ggml].itemsize
            else:
                size = 0
            if start + offset + size > len(self.data):
                raise self._truncated(f"the data of tensor {name!r}")
            raw = np.frombuffer(self.data, np.uint8, size, start + offset)
            self.tensors[name] = (ggml, shape, raw)

    def _truncated(self, what: str) -> ValueError:
        return ValueError(f"`path`={self.path!r} is truncated or not a GGUF file: {what} would end past its "
                          f"{len(self.data)} bytes.")  # fmt: skip

    def _unpack(self, fmt: str) -> tuple:
        if self.pos + struct.calcsize(fmt) > len(self.data):
            raise self._truncated(f"the header's field at byte {self.pos}")
        out = struct.unpack_from(fmt, self.data, self.pos)
        self.pos += struct.calcsize(fmt)
        return out

    def _string(self) -> str:
        (n,) = self._unpack("<Q")
        if self.pos + n > len(self.data):
            raise self._truncated(f"the header's string at byte {self.pos}")
        try:
            text = self.data[self.pos : self.pos + n].decode()
        except UnicodeDecodeError:
            raise ValueError(f"`path`={self.path!r} is not a GGUF file: its string at byte {self.pos} is not "
                             "UTF-8.") from None  # fmt: skip
        self.pos += n
        return text

    def _value(self, kind: int) -> Any:
        if kind == _STRING:
            return self._string()
        if kind == _ARRAY:
            inner, n = self._unpack("<IQ")
            return [self._value(inner) for _ in range(n)]
        if kind not in _SCALAR_CODES:
            raise ValueError(f"`path`={self.path!r} is not a GGUF file: a metadata value has the unknown type {kind}.")
        return self._unpack(_SCALAR_CODES[kind])[0]


def _float_tensor(reader: _Reader, name: str, like: Any, path: str) -> np.ndarray:
    """The file's tensor `name`, as an array of `like`'s shape and dtype (a quantized tensor dequantized)."""
    ggml, shape, raw = reader.tensors[name]
    if np.ndim(like) == 0 and tuple(shape) == (1,):  # a scalar: GGUF gives every tensor an axis
        shape = ()
    if tuple(shape) != tuple(np.shape(like)):
        raise ValueError(f"{path!r} has shape {np.shape(like)} in `like`, but its tensor {name!r} in "
                         f"{reader.path!r} has shape {shape}.")  # fmt: skip
    if ggml in _PLAIN:
        return np.asarray(raw.view(_PLAIN[ggml]).reshape(shape)).astype(like.dtype)
    if ggml in _BLOCK_BYTES:
        fmt = _FORMAT_OF_GGML.get(ggml, mx_format("mxfp4"))
        array = _from_blocks(raw, ggml, (), tuple(shape), fmt, "float32")
        return np.asarray(array.dequantize()).astype(like.dtype)
    raise ValueError(
        f"The tensor {name!r} of {reader.path!r} has GGML type {_TYPE_NAMES.get(ggml, ggml)}, which eqx_quant does "
        "not read (it reads F32, F16, BF16, F64, I8 to I64, Q8_0, Q4_0, Q5_0 and MXFP4)."
    )


def _quantized_tensor(reader: _Reader, name: str, like: QuantizedArray, path: str) -> QuantizedArray:
    """The file's tensor `name` as a quantized array shaped like `like` (its stack included), in the file's type."""
    ggml, shape, raw = reader.tensors[name]
    stack = tuple(like.scale.shape[: like.stack_depth])
    if tuple(shape) != (*stack, *like.shape):
        raise ValueError(f"{path!r} has shape {(*stack, *like.shape)} in `like`, but its tensor {name!r} in "
                         f"{reader.path!r} has shape {shape}.")  # fmt: skip
    if ggml not in _BLOCK_BYTES:
        raise ValueError(
            f"{path!r} is a quantized array in `like`, but its tensor {name!r} in {reader.path!r} is "
            f"{_TYPE_NAMES.get(ggml, ggml)}: load into a model whose layer there is float (or not converted)."
        )
    if ggml == _MXFP4:
        fmt = like.format if _ggml_type(like.format, like.layout, like.shape) == _MXFP4 else mx_format("mxfp4")
    else:
        fmt = _FORMAT_OF_GGML[ggml]
    return _from_blocks(raw, ggml, stack, like.shape, fmt, like.dtype)


def load_gguf(path: str | os.PathLike, like: PyTree, *, names: Names = None) -> PyTree:
    """Reads a GGUF file into a model: the inverse of [`eqx_quant.export_gguf`][], and the way into JAX for a
    quantized checkpoint of llama.cpp.

    Every array of `like` is read from the tensor its name (as [`eqx_quant.export_gguf`][] names it, through
    `names`) gives:

    - a converted layer's [`eqx_quant.QuantizedArray`][] takes the file's codes and scales as they are, in the
        format of the tensor's GGML type (Q8_0, Q4_0, Q5_0 or MXFP4; the format of `like` is replaced): writing the
        model again with [`eqx_quant.export_gguf`][] gives the same bytes;
    - a float array (the weight of a float layer, or of a quantized layer of a model for quantization-aware
        training) takes the tensor's values, dequantized if the tensor is quantized, in the array's dtype.

    So a quantized checkpoint can be fine-tuned: load it into `eqx_quant.quantize(model, **recipe("q4_0"))`, train,
    [`eqx_quant.convert`][] and export. Each block that `gguf`'s reference quantizer (or eqx_quant) wrote is its own
    quantization again: where nothing was trained, the file written is the file read, except blocks of zeros (whose
    stored `d` may change sign) and blocks quantized otherwise (llama.cpp's importance-weighted quantization picks
    other scales).

    **Arguments:**

    - `path`: the GGUF file.
    - `like`: a model with the structure and shapes of the saved one: its arrays are replaced, its quantizers kept.
    - `names`: as for [`eqx_quant.export_gguf`][]; a name holding `{layer}` reads a stacked array from one tensor
        per layer.

    **Returns:**

    The model with the file's arrays.

    **Raises:**

    `ValueError` if `like` has no array (or `names` leaves out every one), the file is not GGUF or is truncated,
    lacks a tensor that `like` needs, holds one of another shape, of a type eqx_quant does not read, or a float
    tensor where `like` has a quantized array.

    !!! example

        ```python
        import os
        import tempfile

        import equinox as eqx
        import jax
        import eqx_quant

        mlp = eqx.nn.MLP(64, 8, 64, 1, key=jax.random.key(0))
        model = eqx_quant.convert(eqx_quant.quantize(mlp, **eqx_quant.recipe("q4_0")))
        path = os.path.join(tempfile.mkdtemp(), "mlp.gguf")
        eqx_quant.export_gguf(path, model)
        qat = eqx_quant.load_gguf(path, eqx_quant.quantize(mlp, **eqx_quant.recipe("q4_0")))
        print(bool((qat.layers[0].layer.weight == model.layers[0].weight).all()))  # True
        ```
    """
    leaves, treedef = named_leaves(like)
    arrays = [name for name, leaf in leaves if is_tensor(leaf)]
    if not arrays:
        raise ValueError(f"`like` has no array to read into, got like={like!r}: give the model whose arrays the file "
                         "holds.")  # fmt: skip
    mapped = resolve_names(names, arrays, "like")
    reader = _Reader(path)
    new = []
    for name, leaf in leaves:
        if not is_tensor(leaf) or mapped[name] is None:
            new.append(leaf)
            continue
        target = mapped[name]
        assert target is not None
        parts = [target.replace(LAYER, str(i)) for i in range(stack_length(leaf))] if LAYER in target else [target]
        for part in parts:
            if part not in reader.tensors:
                raise ValueError(f"{str(path)!r} has no tensor {part!r} (for {name!r} of `like`).")
        if LAYER in target:
            piece = jax.tree.map(lambda a: a[0], leaf)
            read = [_read_one(reader, part, piece, name) for part in parts]
            new.append(jax.tree.map(lambda *a: jnp.stack(a), *read))
        else:
            new.append(_read_one(reader, target, leaf, name))
    return jax.tree_util.tree_unflatten(treedef, new)


def _read_one(reader: _Reader, name: str, like: Any, path: str) -> Any:
    if isinstance(like, QuantizedArray):
        return _quantized_tensor(reader, name, like, path)
    return jnp.asarray(_float_tensor(reader, name, like, path))
