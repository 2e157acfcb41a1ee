"""Exporting converted models to files other programs read."""

import json
import os
import re
import struct
from collections.abc import Callable, Mapping
from typing import Any

import equinox as eqx
import jax
import numpy as np
from jaxtyping import PyTree

from ._format import FloatFormat, IntFormat, StretchedFormat
from ._packing import BIT_ORDER, NIBBLE_ORDER
from ._qarray import QuantizedArray
from ._quantizers import AbstractFakeQuantizer, AbstractQuantizer, DynamicFakeQuant, FakeQuant, LearnedFakeQuant
from ._serialise import write_replacing
from ._traced import QuantTraced
from ._tree import join_path, nodes, path_string, unique_nodes
from .nn._converted import AbstractConvertedLayer
from .nn._layers import AbstractQuantLayer


#
# The tensors of a model by name, as the exporters to other programs' files name them.
#

Names = Callable[[str], "str | None"] | Mapping[str, "str | None"] | None
LAYER = "{layer}"


def _layer_prefixes(model: PyTree) -> list[str]:
    """The paths of the quantized and converted layers of `model` as prefixes of their tensors' paths (`""` for the
    model itself), longest first."""
    found = [path for path, _ in nodes(model, (AbstractQuantLayer, AbstractConvertedLayer))]
    return [f"{path}." if path else "" for path in sorted(found, key=len, reverse=True)]


def _tensor_name(path: str, prefixes: list[str]) -> str:
    """The name of a leaf at `path`: its path, with a quantized or converted layer's float layer (`.layer`) left out
    and its `qweight` called `weight`, so that a layer's tensors have the names of the float layer's."""
    for prefix in prefixes:
        if not path.startswith(prefix):
            continue
        inner = path[len(prefix) :]
        if inner == "qweight":
            return f"{prefix}weight"
        if inner.startswith("layer."):
            return prefix + inner.removeprefix("layer.")
    return path


def check_exportable(model: PyTree, what: str) -> tuple[str, ...]:
    """Raises, naming the layer, if `model` has traced weights or input transforms, or a layer of it is quantized
    but not converted. The head of an `eqx.nn.Shared` tie, whose weight is the placeholder of another layer's (it
    stays a quantized layer after `convert`), has nothing of its own to write and is left out: a reader of tied
    weights uses the table for it. With an input quantizer, which the file would not describe, or a weight quantizer
    that moves the table it reads (`_check_tied_grid`), it is refused.
    Returns the prefixes (`"path."`) of the names of those heads' leaves, for the exporter to leave out."""
    refuse_input_transforms(model, what)
    tied = tied_heads(model)
    for path, layer in nodes(model, (AbstractQuantLayer,)):
        name = path or "(the model itself)"
        if path in tied:
            if layer.input_quant is None:
                _check_tied_grid(name, layer.weight_quant, tied[path], what)
                continue
            raise ValueError(
                f"Layer {name!r} reads its weight through an `eqx.nn.Shared` tie and quantizes its input, which {what} "
                f"has no place for in a layer without a weight of its own. Quantize it without an input quantizer "
                f"(a rule `eqx_quant.Rule({path!r}, input=None)` before the others) or export the model untied."
            )
        raise ValueError(f"Layer {name!r} is quantized but not converted: call `eqx_quant.convert` on the model first.")
    return tuple(f"{path}." for path in tied)


def tied_heads(model: PyTree) -> dict[str, Any]:
    """The quantized layers of `model` whose weight is the placeholder of an `eqx.nn.Shared` tie, by path: the
    weight each reads through the tie (the other layer's `.weight`, the dequantized table after `convert`)."""
    tied = {}

    def visit(tree: PyTree, prefix: str) -> None:
        for at, shared in nodes(tree, (eqx.nn.Shared,)):
            restored = dict(nodes(shared(), (AbstractQuantLayer,)))
            for path, layer in nodes(shared.pytree, (AbstractQuantLayer,)):
                weight = restored[path].layer.weight
                if not eqx.is_array(layer.layer.weight) and eqx.is_array(weight):  # else a tie of a `Shared` inside
                    tied[join_path(prefix, at, "pytree", path)] = weight
            visit(shared.pytree, join_path(prefix, at, "pytree"))

    visit(model, "")
    return tied


def _check_tied_grid(name: str, quantizer: AbstractQuantizer | None, weight: Any, what: str) -> None:
    """Raises unless the tied layer's weight quantizer leaves each entry of the weight it reads as it is, up to the
    float32 rounding of scales (the same grid): the file holds that weight once, and a reader computes with it."""
    if quantizer is None:
        return
    w = np.asarray(weight, np.float32)
    change = np.abs(np.asarray(quantizer(weight), np.float32) - w)
    if np.any(change > 2.0**-20 * np.abs(w)):  # each entry: beyond its own float32 rounding
        moved = float(np.max(change))
        raise ValueError(
            f"Layer {name!r} reads its weight through an `eqx.nn.Shared` tie and quantizes it again with "
            f"{type(quantizer).__name__} in format {getattr(quantizer, 'format', None) and quantizer.format.name}, "
            f"which moves it by up to {moved:.3g}: {what} holds the tied weight once, as the other layer stores it. "
            "Quantize both layers of the tie with one format and layout, or the reading one with `weight=None`."
        )


def refuse_input_transforms(model: PyTree, what: str) -> None:
    """Raises, naming the layer, if a layer of `model` has an input transform: its stored weight computes on the
    transformed input `T x`, which a reader of the file would not apply; or if `model` has traced weights (an
    [`eqx_quant.nn.QuantTraced`][]), whose products no tensor name of the file places."""
    for path, traced in nodes(model, (QuantTraced,)):
        where = f"The model at {path or '(the root)'!r} is an eqx_quant.nn.QuantTraced"
        if not traced.weight_paths:  # products of two activations alone: quantizers computed at every call
            inner = f"{path}.model" if path else "model.model"
            raise ValueError(
                f"{where} of no traced weight, only products of two activations (`products` rules), whose dynamic "
                f"quantizers {what} does not store. Export the model it wraps, `{inner}`, whose layers hold every "
                "stored weight (a reader then computes those products in float), or save it with `eqx_quant.save`."
            )
        raise ValueError(
            f"{where}: its traced weights {list(traced.weight_paths)} are products of the model's own code, which "
            f"{what} has no layer names for. Export a model built from eqx.nn layers, or save it with "
            "`eqx_quant.save`."
        )
    for path, layer in nodes(model, (AbstractQuantLayer, AbstractConvertedLayer)):
        transform = getattr(layer, "input_transform", None)
        if transform is not None:
            raise ValueError(
                f"Layer {path or '(the model itself)'!r} has the input transform {type(transform).__name__} (from "
                f"`smoothquant`, `awq` or `rotate`): its weight computes on the transformed input, which {what} has "
                "no way to record. Export a model without input transforms, or save it with `eqx_quant.save`."
            )


def named_leaves(model: PyTree) -> tuple[list[tuple[str, Any]], Any]:
    """The leaves of `model` (quantized arrays and quantizers whole) with their tensor names, and its treedef: a
    layer's weight and bias are `<layer path>.weight` and `<layer path>.bias`, quantized or not."""
    prefixes = _layer_prefixes(model)
    is_node = lambda node: isinstance(node, (QuantizedArray, AbstractQuantizer))  # noqa: E731
    flat, treedef = jax.tree_util.tree_flatten_with_path(model, is_leaf=is_node)
    return [(_tensor_name(path_string(key), prefixes), leaf) for key, leaf in flat], treedef


def is_tensor(leaf: Any) -> bool:
    """Whether a leaf is written as a tensor: an array or a quantized array."""
    return isinstance(leaf, QuantizedArray) or eqx.is_array(leaf)


def resolve_names(names: Names, paths: list[str], what: str) -> dict[str, str | None]:
    """The file's name of each path (`None`: left out), from `names`; a mapping must name every path, and only them,
    and `names` must keep at least one."""
    if names is None:
        return {path: path for path in paths}
    if isinstance(names, Mapping):
        missing = [p for p in paths if p not in names]
        extra = [k for k in names if k not in paths]
        if missing or extra:
            problems = ([f"it misses {missing}"] if missing else []) + (
                [f"it names {extra}, which `{what}` does not have"] if extra else []
            )
            raise ValueError(
                f"`names` must map every tensor of `{what}` (to None to leave one out) and nothing else: "
                f"{'; '.join(problems)}. The tensors are {paths}."
            )
        out = dict(names)
    elif callable(names):
        out = {path: names(path) for path in paths}
    else:
        raise TypeError(f"`names` must be a mapping, a function of the path, or None, got names={names!r}.")
    for path, name in out.items():
        if name is not None and not isinstance(name, str):
            raise TypeError(f"`names` must give a string (or None) for each tensor, got {name!r} for {path!r}.")
    if paths and all(out[path] is None for path in paths):
        raise ValueError(f"`names` leaves out every tensor of `{what}` (None for each of {paths}), which leaves "
                         f"nothing to write or read, got names={names!r}.")  # fmt: skip
    return out  # pyright: ignore[reportReturnType]


def stack_length(leaf: Any) -> int:
    """The length of the first (stacked) axis of an array or a stacked quantized array."""
    return leaf.scale.shape[0] if isinstance(leaf, QuantizedArray) else np.shape(leaf)[0]


def split_stacked(name: str, leaf: Any, path: str) -> list[tuple[str, Any]]:
    """`[(name, leaf)]`, or with `{layer}` in the name, a tensor per index of the leaf's first (stacked) axis."""
    if LAYER not in name:
        return [(name, leaf)]
    depth = leaf.stack_depth if isinstance(leaf, QuantizedArray) else np.ndim(leaf)
    if re.sub(r"\{layer\}", "", name).count("{") or name.count(LAYER) != 1 or depth < 1:
        raise ValueError(f"The name {name!r} of {path!r} must hold `{LAYER}` once, for a stacked axis (the tensor "
                         f"has {depth} axes to split).")  # fmt: skip
    return [(name.replace(LAYER, str(i)), jax.tree.map(lambda a, i=i: a[i], leaf)) for i in range(stack_length(leaf))]


def _json_axis(axes: tuple[int, ...]) -> int | list[int] | None:
    return None if not axes else axes[0] if len(axes) == 1 else list(axes)


def _input_metadata(quantizer: Any) -> dict[str, Any] | None:
    """What an exported file says of a layer's input quantizer (`None` for none, or for one it cannot describe)."""
    if not isinstance(quantizer, AbstractFakeQuantizer):
        return None
    fmt, layout = quantizer.format, quantizer.layout
    info: dict[str, Any] = {"kind": type(quantizer).__name__, "format": fmt.name, "axis": quantizer.axis,
                            "group_size": layout.group_size, "group_axis": layout.group_axis}  # fmt: skip
    if isinstance(fmt, (IntFormat, StretchedFormat)):
        info |= {"qmin": fmt.qmin, "qmax": fmt.qmax}
        if isinstance(fmt, StretchedFormat):
            info["level_offset"] = 0.5
    else:
        info["element"] = fmt.element
    if isinstance(quantizer, FakeQuant):
        info |= {"scale": quantizer.scale, "zero_point": quantizer.zero_point, "tensor_scale": quantizer.tensor_scale}
    elif isinstance(quantizer, LearnedFakeQuant):
        scale = np.maximum(np.asarray(quantizer.scale), np.float32(quantizer.min_scale)).tolist()  # the scale in use
        info["scale"] = scale
    elif isinstance(quantizer, DynamicFakeQuant):
        info["symmetric"] = quantizer.symmetric
    return info


def _layer_metadata(layer: AbstractConvertedLayer) -> dict[str, Any]:
    w = layer.qweight
    fmt, layout = w.format, w.layout
    tile = layout.tile_axis(w.shape)
    info: dict[str, Any] = {"kind": type(layer).__name__, "format": fmt.name, "shape": list(w.shape),
                            "stack": list(w.values.shape[: w.stack_depth]), "view_shape": list(w.view_shape),
                            "dtype": w.dtype}  # fmt: skip
    if isinstance(fmt, (IntFormat, StretchedFormat)) and fmt.scale == "float32":
        if isinstance(fmt, StretchedFormat):  # the level of a code q is q + 1/2
            info["level_offset"] = 0.5
        info |= {
            "qmin": fmt.qmin,
            "qmax": fmt.qmax,
            "packed_bits": w.packed_bits,
            "bit_order": BIT_ORDER if w.packed else None,
            "packed_int4": w.packed_bits == 4,
            "nibble_order": NIBBLE_ORDER if w.packed_bits == 4 else None,
            "group_size": layout.group_size,
            # Per-group scales vary along every axis but the grouped one: a channel axis adds nothing to them.
            "axis": None if layout.group_size else _json_axis(layout.channel_axes(w.shape)),
        }
    else:
        assert isinstance(fmt, (FloatFormat, IntFormat))
        info |= {
            "element": fmt.element if isinstance(fmt, FloatFormat) else f"int[{fmt.qmin}, {fmt.qmax}]",
            "scale_format": {"e8m0": "float8_e8m0fnu", "e4m3": "float8_e4m3fn"}.get(fmt.scale, w.scale.dtype.name),
            "scale_rule": fmt.scale_rule,
            "block_size": layout.group_size,
            "block_axis": tile,
            "channel_axes": list(layout.channel_axes(w.shape)),
            "packed_fp4": w.packed,
            "nibble_order": NIBBLE_ORDER if w.packed else None,
        }
    info["input"] = _input_metadata(layer.input_quant)
    return info


# Every dtype of NumPy, JAX and ml_dtypes that safetensors' format holds, one byte or more an element: sub-byte
# types (int4, float4_e2m1fn, the FP6 types), which it packs, and complex128 and PRNG keys, which it lacks, are not.
_SAFETENSORS_DTYPES = {
    "bool": "BOOL", "int8": "I8", "uint8": "U8", "int16": "I16", "uint16": "U16", "int32": "I32", "uint32": "U32",
    "int64": "I64", "uint64": "U64", "float16": "F16", "bfloat16": "BF16", "float32": "F32", "float64": "F64",
    "complex64": "C64", "float8_e4m3fn": "F8_E4M3", "float8_e5m2": "F8_E5M2", "float8_e8m0fnu": "F8_E8M0",
    "float8_e4m3fnuz": "F8_E4M3FNUZ", "float8_e5m2fnuz": "F8_E5M2FNUZ",
}  # fmt: skip


def safetensors_dtype(name: str, dtype: Any, advice: str = "") -> str:
    """The safetensors name of `dtype` (`"F32"`, ...), or raises naming the tensor `name` for a dtype the format does
    not hold, with `advice` after the reason."""
    if jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key):
        raise ValueError(f"{name!r} is an array of PRNG keys (dtype {dtype}), which safetensors does not store: hold "
                         f"`jax.random.key_data(key)` (its uint32 words) in the model instead.{advice}")  # fmt: skip
    found = _SAFETENSORS_DTYPES.get(np.dtype(dtype).name)
    if found is None:
        raise ValueError(f"{name!r} has dtype {np.dtype(dtype).name}, which safetensors does not store (it stores "
                         f"{', '.join(_SAFETENSORS_DTYPES)}).{advice}")  # fmt: skip
    return found


def export_safetensors(path: str | os.PathLike, model: PyTree) -> None:
    """Writes the converted layers of a model to a safetensors file.

    For a layer at path `p` (as named by [`eqx_quant.quantize`][]) with integer weights, the file holds `p.weight`
    (the stored integers: int8/int16/int32, or uint8 rows of 2-, 3- or 4-bit values packed by
    [`eqx_quant.pack_bits`][]),
    `p.weight_scale`, `p.weight_zero_point` (if any) and `p.bias` (if any). The header's metadata maps `p` to a JSON
    object with the weight's `format`, `shape` (of one layer), `stack` (the leading axes of a stack of layers built
    with `eqx.filter_vmap`, which every tensor of the layer carries before its own axes; `[]` for a single layer),
    the grid (`qmin`, `qmax`), the per-channel `axis`, the `group_size`,
    `packed_bits` (2, 3, 4, or `null` for unpacked integers) and its `bit_order` (`"low-first"`: element `j` of a
    row in bits `j * packed_bits` onwards of the row's little-endian bit stream), and the input quantizer's
    parameters. For readers of 4-bit files, `packed_int4` (whether the weight holds two 4-bit values per byte) and
    its `nibble_order` (element `2i` of a row in the low nibble) are kept. Weights on a stretched grid
    ([`eqx_quant.stretched_format`][]) are stored the same way, their codes `q` in `[qmin, qmax]`, and their metadata
    adds `level_offset` (0.5): the weight is `scale * (q + level_offset)`. It is readable with the `safetensors`
    library alone (`safetensors.numpy.load_file`).

    A layer whose weight is in a low-precision float format (or in MXINT8, with E8M0 scales) has
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

    `ValueError` if `model` has no converted layer, holds traced weights (an [`eqx_quant.nn.QuantTraced`][]) or a
    layer with an input transform, or two of its converted layers have the same path (nothing is written).
    """
    refuse_input_transforms(model, "a safetensors file")
    layers = list(unique_nodes(model, (AbstractConvertedLayer,), "model").items())
    if not layers:
        raise ValueError("`model` has no converted layer; convert it first with `eqx_quant.convert`.")
    tensors: dict[str, np.ndarray] = {}
    metadata: dict[str, str] = {"format": "eqx_quant", "nibble_order": NIBBLE_ORDER, "bit_order": BIT_ORDER}
    for name, layer in layers:
        name = name or "layer"
        w: QuantizedArray = layer.qweight
        tensors[f"{name}.weight"] = np.asarray(w.values)
        # Integer grids keep the scales' unit axes (they broadcast against the view); block scales come compact.
        compact = w.format.scale != "float32" or not isinstance(w.format, (IntFormat, StretchedFormat))
        scale = np.asarray(w.scale)
        if compact and w.layout.group_size is not None:
            scale = scale.reshape(scale.shape[: w.stack_depth] + w.layout.scale_shape(w.shape))
        tensors[f"{name}.weight_scale"] = scale
        if w.zero_point is not None:
            tensors[f"{name}.weight_zero_point"] = np.asarray(w.zero_point)
        if w.tensor_scale is not None:
            tensors[f"{name}.weight_tensor_scale"] = np.asarray(w.tensor_scale)
        metadata[name] = json.dumps(_layer_metadata(layer))
        bias = getattr(layer.layer, "bias", None)
        if bias is not None:
            tensors[f"{name}.bias"] = np.asarray(bias)
    write_safetensors(path, tensors, metadata)


def write_safetensors(path: str | os.PathLike, tensors: dict[str, np.ndarray], metadata: dict[str, str]) -> None:
    """The safetensors format: an 8-byte little-endian header length, a JSON header, then the raw bytes."""
    header: dict[str, Any] = {"__metadata__": metadata}
    offset = 0
    blobs = []
    for name in sorted(tensors):
        array = np.ascontiguousarray(tensors[name])
        data = array.astype(array.dtype.newbyteorder("<"), copy=False).tobytes()
        header[name] = {
            "dtype": safetensors_dtype(name, array.dtype),
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

    write_replacing(path, write)
