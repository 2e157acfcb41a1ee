"""eqx_quant's own file: a model with its quantizers' static configuration and its quantized arrays."""

import dataclasses
import json
import math
import os
import secrets
import stat
import struct
from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import PyTree

from ._backward import QuantizedBackward, UnquantizedBackward
from ._convert import sharded_like
from ._format import Format, format_from_json, format_named
from ._layout import Layout
from ._misc import on_mesh_of, placed_like
from ._qarray import QuantizedArray, quantize_array
from ._quantizers import AbstractQuantizer, DynamicFakeQuant, FakeQuant, LearnedFakeQuant, PassthroughClip
from ._scales import Scales
from ._traced import QuantTraced, leaves_by_path
from ._tree import join_path, map_nodes, path_string, unique_nodes
from .nn._attention import QuantMultiheadAttention
from .nn._converted import AbstractConvertedLayer, ConvertedConv, ConvertedEmbedding, ConvertedLinear
from .nn._einsum import Einsum, QuantEinsum
from .nn._layers import AbstractQuantLayer, QuantConv, QuantEmbedding, QuantLinear, per_layer, stack_shape
from .nn._transforms import AbstractInputTransform, RotateInput, ScaleInput


_MAGIC = b"EQXQUANT"
_VERSION = 4
_HINT = (
    " Load into the float model instead (or its `eqx.filter_eval_shape` skeleton), which `load` quantizes as the file "
    "says, or into a model of the saved structure (quantized with the saved configuration, and converted if the "
    "saved model was)."
)


def _header_nodes(model: PyTree, name: str) -> dict[str, Any]:
    """The static [`eqx_quant.FakeQuant`][]s and the [`eqx_quant.QuantizedArray`][]s of `model` by path."""
    return unique_nodes(model, (FakeQuant, QuantizedArray), name)


def _named(name: str) -> Format | None:
    try:
        return format_named(name)
    except ValueError:
        return None


def _static_quantizers(found: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """The configuration of every static [`eqx_quant.FakeQuant`][] by path: it lives in the treedef, which
    `eqx.tree_serialise_leaves` does not write."""
    out = {}
    for path, q in found.items():
        if isinstance(q, FakeQuant):  # the defaults (per tensor, zero point 0, no tensor scale) left out
            fields = _static_fields(q)
            out[path] = {k: v for k, v in fields.items() if (k, v) not in _STATIC_DEFAULTS}
    return out


_STATIC_DEFAULTS = (("zero_point", 0), ("tensor_scale", None), ("layout", [[], None, 0]))


def _restore_static(c: dict[str, Any]) -> FakeQuant:
    layout = Layout(*_tuples(c.get("layout", [[], None, 0])))
    return FakeQuant(
        _tuples(c["scale"]), format=_format(c), zero_point=_tuples(c.get("zero_point", 0)),
        tensor_scale=c.get("tensor_scale"), layout=layout,
    )  # fmt: skip


def _tuples(value: Any) -> Any:
    """JSON lists back as the tuples they were written from."""
    return tuple(_tuples(v) for v in value) if isinstance(value, list) else value


def _format(info: dict[str, Any]) -> Format:
    """The format that `_json_value` described: by its name, or by its fields where the name does not say it all."""
    fields = {k.removeprefix("format_"): v for k, v in info.items() if k.startswith("format_")}
    return format_from_json(fields) if fields else format_named(info["format"])


def _backward(value: Any) -> QuantizedBackward | UnquantizedBackward | None:
    """A layer's `backward` from its JSON value (see `_json_value`)."""
    if value is None:
        return None
    if value == "unquantized":
        return UnquantizedBackward()
    return QuantizedBackward(value[0], rounding=value[1])


def _json_value(value: Any) -> Any:
    """A static field's value as JSON: numbers, strings, `None` and (nested) lists of them; anything else (a function,
    an object) by its name, so that the file never depends on a memory address or a printer's layout."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, Format):  # its name, and its fields where the name does not say them all
        if _named(value.name) == value:
            return {"format": value.name}
        return {"format": value.name, **{f"format_{k}": v for k, v in value.to_json().items()}}
    if isinstance(value, Layout) and value.group_axis == -1:  # the default last entry left out
        return _json_value(tuple(value)[:-1])
    if isinstance(value, QuantizedBackward):
        return [value.bits, value.rounding]
    if isinstance(value, UnquantizedBackward):
        return "unquantized"
    if isinstance(value, (np.bool_, np.integer, np.floating)):
        return value.item()
    if isinstance(value, (tuple, list)):  # a `Layout` too (a named tuple)
        return [_json_value(v) for v in value]
    return f"<{getattr(value, '__qualname__', type(value).__qualname__)}>"


def _other_quantizers(model: PyTree, name: str) -> dict[str, dict[str, Any]]:
    """The configuration of every other quantizer of `model` (dynamic, learned, ...) by path: its type and its static
    fields. Its arrays (a learned scale) are saved with the others and checked by their shapes and dtypes, but these
    fields live in the treedef, which the file does not carry: `load` checks that `like` has the same."""
    found = unique_nodes(model, (AbstractQuantizer,), name)
    out = {}
    for path, q in found.items():
        if isinstance(q, FakeQuant):
            continue
        out[path] = {"type": type(q).__name__, **_static_fields(q)}
        arrays = {
            f.name: list(getattr(q, f.name).shape) for f in dataclasses.fields(q) if _is_array(getattr(q, f.name))
        }
        if arrays:
            out[path]["arrays"] = arrays
    return out


def _is_array(value: Any) -> bool:
    return eqx.is_array(value) or isinstance(value, jax.ShapeDtypeStruct)


def _modules(model: PyTree, name: str) -> list[dict[str, Any]]:
    """Every quantized, converted and product module of `model`: its type and static fields, and the paths of the
    modules that have them, what `load` needs to rebuild the model from the float one."""
    kinds: dict[str, dict[str, Any]] = {}
    for types in ((AbstractQuantLayer, AbstractConvertedLayer), (QuantEinsum,), (QuantMultiheadAttention,),
                  (QuantTraced,)):  # fmt: skip
        for path, module in unique_nodes(model, types, name).items():
            record = {"type": type(module).__name__, **_static_fields(module)}
            transform = getattr(module, "input_transform", None)
            if transform is not None:  # its arrays are saved with the others; its type says how to rebuild it
                record["input_transform"] = type(transform).__name__
            transforms = getattr(module, "input_transforms", ())
            if any(t is not None for t in transforms):  # a traced weight's, alike
                record["input_transforms"] = [None if t is None else type(t).__name__ for t in transforms]
            kinds.setdefault(json.dumps(record, sort_keys=True), record | {"paths": []})["paths"].append(path)
    return list(kinds.values())


def _static_fields(module: Any) -> dict[str, Any]:
    """The static fields of `module` as JSON values (a format's flattened into its name and fields)."""
    out = {}
    for field in dataclasses.fields(module):
        if field.metadata.get("static"):
            value = _json_value(getattr(module, field.name))
            out.update(value if isinstance(value, dict) else {field.name: value})
    return out


def _tensor_descriptions(found: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """The static fields of every [`eqx_quant.QuantizedArray`][] (format, layout, shape, dtype, packing, and whether
    it has a zero point and a tensor scale) by path: what the stored codes mean, which the arrays alone do not say."""
    out = {}
    for path, array in found.items():
        if isinstance(array, QuantizedArray):
            info = _static_fields(array)
            info["zero_point"] = array.zero_point is not None
            if array.tensor_scale is not None:
                info["tensor_scale"] = True
            out[path] = json.loads(json.dumps(info))  # as the header reads back: tuples become lists
    return out


def _tensor_table(descriptions: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """The descriptions as the header stores them: the field names once, then a row of values per array (`null`
    for a field that an array of another format has)."""
    fields = sorted({field for info in descriptions.values() for field in info})
    return {"fields": fields, "tensors": {path: [info.get(f) for f in fields] for path, info in descriptions.items()}}


def _from_table(table: dict[str, Any]) -> dict[str, dict[str, Any]]:
    fields = table["fields"]
    return {path: dict(zip(fields, row, strict=True)) for path, row in table["tensors"].items()}


def save(path: str | os.PathLike, model: PyTree) -> None:
    """Saves a model (quantized weights as stored: integers, packed 2-, 3- and 4-bit codes, the codes and scales of
    float formats) to a file.

    The file starts with a small JSON header holding the static configuration that the arrays alone do not carry:
    the format, layout, scales and zero points of every static [`eqx_quant.FakeQuant`][] (e.g. calibrated input
    quantizers); the configuration of every other quantizer (dynamic ones such as [`eqx_quant.DynamicFakeQuant`][],
    and the static fields of learned ones); and the format, layout, shape, dtype and packing width of every
    [`eqx_quant.QuantizedArray`][]. [`eqx_quant.load`][] checks them against the model it loads into. The arrays
    follow, written by `eqx.tree_serialise_leaves`; codes of at most 4 bits are already packed at their width in a
    converted model, so they read back exactly. Each array carries a NumPy header of about 128 bytes.

    `eqx.tree_serialise_leaves` alone does not store the scales of static quantizers (they are static configuration,
    part of the model's structure, not its leaves): a calibrated model saved so computes with the scales of whatever
    model it is loaded into. Save with this function.

    The file is written to a temporary file beside `path` and then renamed over it, so a save that fails leaves an
    existing file at `path` as it was. A file replaced so keeps its permission bits, and a symbolic link at `path`
    keeps pointing where it did (its target is replaced), as when writing with `open(path, "wb")`.

    Quantizers and quantized arrays are named in the header by their path, keys joined with `.` as
    [`eqx_quant.quantize`][] names layers: a dict key holding a `.` may make two of them share a name (the key
    `"a.b"` and the attributes `a.b`), which is refused.

    **Arguments:**

    - `path`: the file to write.
    - `model`: any model, typically from [`eqx_quant.convert`][].

    **Raises:**

    `ValueError` if two quantizers or quantized arrays of `model` have the same path, or if `model` holds no array
    nor quantizer; `TypeError` for a PRNG key array among its leaves (save `jax.random.key_data(key)` instead);
    `FileNotFoundError` or `IsADirectoryError` for a `path` in a directory that does not exist or naming a
    directory. Nothing is written then.
    """
    check_file_path(path)
    leaves = jax.tree_util.tree_leaves_with_path(model)
    for key_path, leaf in leaves:
        if eqx.is_array(leaf) and jax.dtypes.issubdtype(leaf.dtype, jax.dtypes.prng_key):
            raise TypeError(
                f"`model` holds a PRNG key array at {jax.tree_util.keystr(key_path)}, which cannot be saved: save "
                "`jax.random.key_data(key)` and rebuild the key with `jax.random.wrap_key_data` after loading."
            )
    found = _header_nodes(model, "model")
    header = {
        "format": "eqx_quant",
        "version": _VERSION,
        "static_quantizers": _static_quantizers(found),
        "quantized_arrays": _tensor_table(_tensor_descriptions(found)),
        "modules": _modules(model, "model"),
    }
    others = _other_quantizers(model, "model")
    if others:  # none in a converted, calibrated model
        header["other_quantizers"] = others
    if not (found or others or any(eqx.is_array(leaf) for _, leaf in leaves)):
        raise ValueError(f"`model` holds no array nor quantizer to save, got {type(model).__name__} {_short(model)}.")
    encoded = json.dumps(header, separators=(",", ":")).encode()

    def write(f):
        f.write(_MAGIC + struct.pack("<Q", len(encoded)) + encoded)
        eqx.tree_serialise_leaves(f, model)

    write_replacing(path, write)


def _stored_shapes(path: str | os.PathLike, start: int) -> list[tuple[int, ...]] | None:
    """The shapes of the arrays that `eqx.tree_serialise_leaves` wrote from byte `start` of the file (in NumPy's
    format, one after another), or `None` where the file ends within one (cut short)."""
    shapes = []
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        f.seek(start)
        while True:
            if f.tell() == size:
                return shapes  # the end of the file, after a whole array
            try:
                major, _ = np.lib.format.read_magic(f)
                read = np.lib.format.read_array_header_1_0 if major == 1 else np.lib.format.read_array_header_2_0
                shape, _, dtype = read(f)
            except ValueError:  # an array cut short within its header
                return None
            end = f.tell() + math.prod(shape) * dtype.itemsize
            if end > size:
                return None
            shapes.append(tuple(shape))
            f.seek(end)


def _arrays_note(path: str | os.PathLike, start: int, like: PyTree) -> str:
    """Where the arrays of the file and those of `like` first differ in shape or number, as a clause ("the file
    holds ..."), or `""` where they do not, or the file is cut short within an array."""
    stored = _stored_shapes(path, start)
    if stored is None:
        return ""
    leaves = jax.tree_util.tree_flatten_with_path(like)[0]
    stored_kinds = (jax.Array, jax.ShapeDtypeStruct, np.ndarray, np.generic, bool, int, float, complex)
    ours = [(path_string(p), tuple(np.shape(leaf))) for p, leaf in leaves if isinstance(leaf, stored_kinds)]
    if stored == [shape for _, shape in ours]:
        return ""
    pairs = list(zip(stored, (shape for _, shape in ours), strict=False))  # up to the shorter
    i = next((k for k, (a, b) in enumerate(pairs) if a != b), len(pairs))
    there = f"an array of shape {stored[i]}" if i < len(stored) else "no more arrays"
    here = f"`like`'s {ours[i][0]!r}, of shape {ours[i][1]}" if i < len(ours) else "the end of `like`'s arrays"
    return (
        f"the file holds {len(stored)} arrays and `like` {len(ours)}; the first that differ are {here} and, in the "
        f"file, {there}"
    )


def _short(value: object) -> str:
    """`repr(value)`, cut to 80 characters."""
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def check_file_path(path: object, name: str = "path") -> None:
    """Raises, naming `name` and its value, unless `path` names a file that can be created or replaced: an existing
    directory holds it, and it is not a directory itself."""
    if not isinstance(path, (str, os.PathLike)):
        raise TypeError(f"`{name}` must be a str or an os.PathLike, got {path!r} of type {type(path).__name__}.")
    text = os.fspath(path)
    if not isinstance(text, str) or not text:
        raise ValueError(f"`{name}` must name a file, got {name}={path!r}.")
    if os.path.isdir(text):
        raise IsADirectoryError(f"`{name}` must name a file, got the directory {name}={text!r}.")
    directory = os.path.dirname(os.path.realpath(text))
    if not os.path.isdir(directory):
        raise FileNotFoundError(f"`{name}` is in a directory that does not exist, got {name}={text!r}.")


def write_replacing(path: str | os.PathLike, write: Callable[[Any], None]) -> None:
    """Calls `write` on a fresh temporary file beside `path`, then renames it over `path`: a write that fails leaves
    an existing file at `path` as it was (and no temporary file behind). An existing file keeps its permission bits,
    and a symbolic link at `path` keeps pointing where it did (its target is replaced), as `open(path, "wb")`
    would."""
    check_file_path(path)
    path = os.path.realpath(os.fspath(path))
    directory, base = os.path.split(path)
    while True:  # a fresh name beside `path`, created with the permissions `open(path, "wb")` would give
        temporary = os.path.join(directory, f".{base}.{secrets.token_hex(6)}.tmp")
        try:
            fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_BINARY", 0), 0o666)
            break
        except FileExistsError:
            continue
    try:
        with os.fdopen(fd, "wb") as f:
            if os.path.isfile(path):
                mode = stat.S_IMODE(os.stat(path).st_mode)
                try:
                    os.chmod(f.fileno() if os.chmod in os.supports_fd else temporary, mode)
                except OSError:  # a file system without permission bits: the new file's, as `open` gives
                    pass
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
            f"The {what} saved in {str(path)!r} are at {sorted(saved)}, but `like` has them at {sorted(like)}." + _HINT
        )


def _check_tensors(saved: dict[str, Any], like: dict[str, Any], path: str | os.PathLike) -> None:
    _check_paths("quantized arrays", saved, like, path)
    for name, expected in like.items():
        _check_fields(f"The quantized array at {name!r}", saved[name], expected, path,
                      "the file holds codes of another format, layout, shape or packing.")  # fmt: skip


def _check_fields(what: str, saved: dict[str, Any], like: dict[str, Any], path: str | os.PathLike, why: str) -> None:
    """Raises unless the description `saved`, read from the file at `path`, is `like`'s, naming the fields that
    differ."""
    keys = [k for k in saved | like if saved.get(k) != like.get(k)]
    if keys:
        ours = ", ".join(f"{k}={saved.get(k)!r}" for k in keys)
        theirs = ", ".join(f"{k}={like.get(k)!r}" for k in keys)
        raise ValueError(f"{what} has {ours} in {str(path)!r} but {theirs} in `like`: {why}" + _HINT)


def _check_other_quantizers(saved: dict[str, Any], like: dict[str, Any], path: str | os.PathLike) -> None:
    _check_paths("dynamic and learned quantizers", saved, like, path)
    for name, config in saved.items():
        _check_fields(
            f"The quantizer at {name!r}", config, like[name], path, "the saved model computes with the former."
        )


def _rebuilt(
    like: PyTree, modules: dict[str, Any], saved: dict[str, Any], others: dict[str, Any], tensors: dict[str, Any]
) -> PyTree:
    """The float model `like` quantized (or converted) as the file's `modules` and quantizers say, with arrays of
    the saved shapes (their values are read afterwards)."""
    attentions = [p for p, record in modules.items() if record["type"] == "QuantMultiheadAttention"]

    def float_path(path: str) -> str:  # a projection inside a wrapped attention, at its float path
        for a in attentions:
            inner = join_path(a, "attention") + "."
            if path.startswith(inner):
                return join_path(a, path.removeprefix(inner))
        return path

    at = {float_path(p): (p, record) for p, record in modules.items()}

    def quantizer(path: str, stack: tuple[int, ...]) -> AbstractQuantizer | None:
        if path in saved:
            return _restore_static(saved[path])
        if path not in others:
            return None
        c = others[path]
        kind, arrays = c["type"], c.get("arrays", {})
        if kind == "PassthroughClip":
            return PassthroughClip(c["lo"], c["hi"])
        layout, axis_name = Layout(*_tuples(c["layout"])), _tuples(c["axis_name"])
        if kind == "DynamicFakeQuant":
            return DynamicFakeQuant(_format(c), layout=layout, symmetric=c["symmetric"], axis_name=axis_name)
        if kind == "LearnedFakeQuant":  # made for one layer, and stacked like the layer (as `calibrate` makes it)
            # Placeholders for the file's values (a zero point's on the grid, where the quantizer computes).
            fmt = _format(c)
            zero = min(max(0, getattr(fmt, "qmin", 0)), getattr(fmt, "qmax", 0))
            ones = {name: jnp.full(shape, zero if name == "zero_point" else 1, jnp.float32)
                    for name, shape in arrays.items()}  # fmt: skip

            def learned(scale, zero_point, tensor_scale):
                return LearnedFakeQuant(scale, format=fmt, zero_point=zero_point, tensor_scale=tensor_scale,
                                        layout=layout, min_scale=c["min_scale"], axis_name=axis_name)  # fmt: skip

            stacked = per_layer(learned, len(stack)) if stack else learned
            return stacked(ones["scale"], ones.get("zero_point"), ones.get("tensor_scale"))
        raise ValueError(
            f"The quantizer at {path!r} is a {kind}, which `load` cannot rebuild from a float model: pass as `like` a "
            "model quantized as the saved one was."
        )

    def layer(path: str, node: Any) -> Any:
        if path not in at:
            return node
        saved_path, record = at[path]
        kind = record["type"]
        stack = stack_shape(node)
        inputs = None if isinstance(node, eqx.nn.Embedding) else quantizer(join_path(saved_path, "input_quant"), stack)
        transform = _empty_transform(record.get("input_transform"), stack + (getattr(node, "in_features", 0),))
        if kind.startswith("Converted"):
            # Sharded as `convert` shards it, from the float weight's partitioning.
            qweight = sharded_like(_empty_array(tensors[join_path(saved_path, "qweight")], stack), node.weight)
            skeleton = eqx.tree_at(lambda l: l.weight, node, None)
            if kind == "ConvertedEmbedding":
                return ConvertedEmbedding(skeleton, qweight)
            matmul = record.get("matmul", "int")  # files written before converted layers kept it: "int"
            if kind == "ConvertedLinear":
                return ConvertedLinear(skeleton, qweight, inputs, transform, matmul)
            return ConvertedConv(skeleton, qweight, inputs, matmul)
        weights = quantizer(join_path(saved_path, "weight_quant"), stack)
        if kind == "QuantEmbedding":
            return QuantEmbedding(node, weight_quant=weights)
        backward = _backward(record.get("backward"))
        if kind == "QuantConv":
            return QuantConv(node, weight_quant=weights, input_quant=inputs, matmul=record["matmul"], backward=backward)
        return QuantLinear(node, weight_quant=weights, input_quant=inputs, matmul=record["matmul"], backward=backward,
                           input_transform=transform)  # fmt: skip

    def product(path: str, einsum: Any) -> Any:
        if path not in at:
            return einsum
        saved_path, record = at[path]
        lhs, rhs = quantizer(join_path(saved_path, "lhs_quant"), ()), quantizer(join_path(saved_path, "rhs_quant"), ())
        return QuantEinsum(einsum, lhs_quant=lhs, rhs_quant=rhs, matmul=record["matmul"])

    def attention(path: str, node: Any) -> Any:
        if path not in at:
            return node
        wrapped = QuantMultiheadAttention(node)
        scores = product(join_path(path, "scores"), wrapped.scores)
        values = product(join_path(path, "values"), wrapped.values)
        return QuantMultiheadAttention(node, scores=scores, values=values)

    traced = [(p, record) for p, record in modules.items() if record["type"] == "QuantTraced"]
    if traced:
        like = _rebuilt_traced(like, traced, quantizer, tensors)
    like = map_nodes(like, (eqx.nn.Linear, eqx.nn.Conv, eqx.nn.Embedding), layer)
    like = map_nodes(like, (eqx.nn.MultiheadAttention,), attention)
    return map_nodes(like, (Einsum,), product)


def _rebuilt_traced(like: PyTree, records: list, quantizer: Callable, tensors: dict[str, Any]) -> QuantTraced:
    """The float model `like` inside the saved [`eqx_quant.nn.QuantTraced`][]: its quantizers, and an empty stored
    array in place of each traced weight that the file stores."""
    if len(records) != 1 or records[0][0] != "":
        raise ValueError(
            f"The file has traced-weight models at {[p for p, _ in records]}, which `load` rebuilds only at the "
            "root of the model (where `quantize` puts it)." + _HINT
        )
    record = records[0][1]
    paths, stacks, matmuls = tuple(record["weight_paths"]), _tuples(record["stacks"]), tuple(record["matmuls"])

    def empty(key_path: Any, leaf: Any) -> Any:
        name = f"model.{path_string(key_path)}"
        return sharded_like(_empty_array(tensors[name], ()), leaf) if name in tensors else leaf

    model = jax.tree_util.tree_map_with_path(empty, like)
    weights = tuple(quantizer(f"weight_quants.{i}", ()) for i in range(len(paths)))
    inputs = tuple(quantizer(f"input_quants.{i}", stack) for i, stack in enumerate(stacks))
    indices = tuple(record["product_indices"])
    pairs = tuple((quantizer(f"product_quants.{j}.0", ()), quantizer(f"product_quants.{j}.1", ()))
                  for j in range(len(indices)))  # fmt: skip
    pairings = [None if p is None else tuple(p) for p in record["pairings"]]
    per_token = record.get("per_token")  # files written before it: inputs as they are
    leaves = leaves_by_path(like)
    kinds = record.get("input_transforms") or [None] * len(paths)
    transforms = [
        None if kind is None else _empty_transform(kind, stack + (math.prod(leaves[path].shape[a] for a in pairing),))
        for kind, path, stack, pairing in zip(kinds, paths, stacks, pairings, strict=True)
    ]
    return QuantTraced(model, weights, inputs, paths, stacks, matmuls, pairs, indices, record.get("product_count"),
                       pairings, per_token, transforms, record.get("float_paths", ()),
                       _tuples(record.get("product_shapes", [])))  # fmt: skip


def _empty_transform(kind: str | None, shape: tuple[int, ...]) -> AbstractInputTransform | None:
    """An input transform of the saved type, with arrays of `shape` (`(*stack, in_features)`) to read into."""
    if kind is None:
        return None
    if kind == "ScaleInput":
        return ScaleInput(jnp.ones(shape, jnp.float32))
    if kind == "RotateInput":
        return RotateInput(jnp.ones(shape, jnp.int8))
    raise ValueError(f"The file has an input transform of type {kind!r}, which this release cannot rebuild." + _HINT)


def _empty_array(description: dict[str, Any], stack: tuple[int, ...]) -> QuantizedArray:
    """A [`eqx_quant.QuantizedArray`][] of the described format, layout, shape and packing, stacked `stack` times:
    the shapes and dtypes of the saved one, its values zeros."""
    fmt, layout = _format(description), Layout(*_tuples(description["layout"]))
    shape, dtype = tuple(description["shape"]), description["dtype"]
    scale_shape = layout.broadcast_shape(shape)

    def one() -> QuantizedArray:
        scales = Scales(
            jnp.ones(scale_shape), jnp.zeros(scale_shape) if description["zero_point"] else None,
            jnp.ones(()) if description.get("tensor_scale") else None,
        )  # fmt: skip
        x = jnp.zeros(shape, dtype)
        return quantize_array(x, scales, fmt, layout, pack=description["packed_bits"] is not None, mask=False)[0]

    make = lambda _: one()  # noqa: E731
    array = per_layer(make, len(stack))(jnp.zeros(stack)) if stack else one()
    return array


def load(path: str | os.PathLike, like: PyTree) -> PyTree:
    """Loads what [`eqx_quant.save`][] wrote.

    **Arguments:**

    - `path`: the file.
    - `like`: the float model the saved one was made from (a freshly initialised one, or its
        `eqx.filter_eval_shape` skeleton): `load` quantizes (or converts) it as the file records, layer by layer,
        and reads the saved arrays into it. Or a model with the saved structure already, e.g. the converted model of
        a freshly initialised and calibrated network: its arrays and the configuration of its static
        [`eqx_quant.FakeQuant`][]s are replaced by the saved ones, so its calibration need not match; its other
        quantizers (dynamic, learned) must be of the saved types and have their static fields (format, layout, ...),
        since the saved model computes with those; its [`eqx_quant.QuantizedArray`][]s must have the formats,
        layouts, shapes, packing widths and dtypes of the saved ones, since the stored codes mean nothing in another
        format. An array of `like` sharded over a mesh (a `NamedSharding`) gives the loaded array at its place the
        same sharding; the others are loaded onto the default device.

    **Returns:**

    The saved model.

    **Raises:**

    `ValueError` if the file was not written by [`eqx_quant.save`][] (or by a release whose file format this one
    does not read), is cut short or holds more than `like` reads; if its quantizers or quantized arrays are not at
    the places of those in `like`, or a dynamic or learned quantizer or a quantized array differs from the one in
    `like` (the message names the path and the fields, and says what to do); or if an array does not match the one
    in `like`.

    !!! example

        ```python
        import os
        import tempfile

        import equinox as eqx
        import jax
        import eqx_quant

        mlp = eqx.nn.MLP(32, 2, 32, 1, key=jax.random.key(0))
        data = [jax.random.normal(jax.random.key(1), (16, 32))]
        real = eqx_quant.convert(eqx_quant.calibrate(eqx_quant.quantize(mlp, **eqx_quant.recipe("w4a8_g32")), data))
        path = os.path.join(tempfile.mkdtemp(), "model.eqx")
        eqx_quant.save(path, real)
        # The float model's skeleton is all it takes: the file says how each layer was quantized.
        skeleton = eqx.filter_eval_shape(eqx.nn.MLP, 32, 2, 32, 1, key=jax.random.key(0))
        loaded = eqx_quant.load(path, skeleton)
        x = data[0][0]
        print(type(loaded.layers[0]).__name__, bool((loaded(x) == real(x)).all()))  # ConvertedLinear True
        ```
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
            version = header["version"]
        except (ValueError, KeyError, TypeError, AttributeError) as error:
            raise ValueError(f"`path`={str(path)!r} has a damaged `eqx_quant.save` header.") from error
        if version != _VERSION:
            raise ValueError(
                f"`path`={str(path)!r} has format version {version!r}; this release reads version {_VERSION} (files "
                "of earlier development versions: save the model again with this one)."
            )
        try:
            saved, others = header["static_quantizers"], header.get("other_quantizers", {})
            tensors = _from_table(header["quantized_arrays"])
            modules = {path: record for record in header["modules"] for path in record["paths"]}
        except (ValueError, KeyError, TypeError, AttributeError) as error:
            raise ValueError(f"`path`={str(path)!r} has a damaged `eqx_quant.save` header.") from error
        wrappers = (AbstractQuantLayer, AbstractConvertedLayer, QuantEinsum, QuantMultiheadAttention, QuantTraced)
        if modules and not unique_nodes(like, wrappers, "like"):  # a float `like`: the file says how to quantize it
            like = _rebuilt(like, modules, saved, others, tensors)
        found = _header_nodes(like, "like")
        _check_paths("static quantizers", saved, _static_quantizers(found), path)
        _check_tensors(tensors, _tensor_descriptions(found), path)
        _check_other_quantizers(others, _other_quantizers(like, "like"), path)
        like = map_nodes(like, (FakeQuant,), lambda name, quantizer: _restore_static(saved[name]))
        start = len(_MAGIC) + 8 + length
        try:
            model = eqx.tree_deserialise_leaves(f, like)
        except (ValueError, EOFError, RuntimeError) as error:
            note = _arrays_note(path, start, like)
            raise ValueError(
                f"The arrays in `path`={str(path)!r} are cut short or do not match those of `like`: "
                + (f"{note}.{_HINT}" if note else str(error))
            ) from error
        if f.read(1):
            note = _arrays_note(path, start, like)
            raise ValueError(
                f"`path`={str(path)!r} holds more data than `like` reads: it was saved from another model."
                + (f" {note[:1].upper()}{note[1:]}." if note else "")
            )
        return on_mesh_of(jax.tree.map(placed_like, model, like), like)
