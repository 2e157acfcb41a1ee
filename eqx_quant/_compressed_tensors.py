"""compressed-tensors, the checkpoint layout vLLM reads: a converted model's linear layers in safetensors, described
by the `quantization_config` of a `config.json`."""

import json
import os
import warnings
from collections.abc import Mapping
from typing import Any

import equinox as eqx
import ml_dtypes
import numpy as np
from jaxtyping import PyTree

from ._export import (
    Names,
    check_exportable,
    is_tensor,
    named_leaves,
    resolve_names,
    safetensors_dtype,
    split_stacked,
    write_safetensors,
)
from ._format import FloatFormat, Format, IntFormat
from ._layout import Layout
from ._misc import caller_stacklevel
from ._qarray import QuantizedArray
from ._quantizers import AbstractQuantizer, DynamicFakeQuant, FakeQuant, LearnedFakeQuant
from ._serialise import write_replacing
from ._tree import nodes
from .nn._converted import AbstractConvertedLayer, ConvertedLinear


# The release of compressed-tensors whose layout this follows (its 4- and 8-bit packing is that of earlier releases).
_VERSION = "0.20.0"
_PACKED_WIDTHS = (2, 4, 8)  # where compressed-tensors' dense int32 packing has always been the same


def _args(num_bits: int, kind: str, strategy: str, **extra: Any) -> dict[str, Any]:
    """A `QuantizationArgs` as compressed-tensors writes it into `config.json`."""
    args = {"num_bits": num_bits, "type": kind, "symmetric": True, "group_size": None, "strategy": strategy,
            "block_structure": None, "dynamic": False, "actorder": None, "observer": "minmax", "observer_kwargs": {},
            "scale_dtype": None, "zp_dtype": None}  # fmt: skip
    args.update(extra)
    return args


def _signed_bits(fmt: IntFormat) -> int | None:
    """The width of the signed grid `[-2**(b-1), 2**(b-1) - 1]` that holds `fmt`'s, or `None` for an unsigned one."""
    if fmt.qmin >= 0:
        return None
    return fmt.bits


def _strategy(layout: Layout, shape: tuple[int, ...], stack: int) -> tuple[str, int | None] | None:
    """compressed-tensors' strategy (and group size) of a weight layout: one scale per tensor, per output channel
    (the first axis), or per group along the last axis; `None` for another layout."""
    rank = len(shape)
    if layout.is_per_tensor():
        return "tensor", None
    if layout.group_size is None:
        return ("channel", None) if layout.channel_axes(shape) == (0,) and rank == 2 else None
    if layout.tile_axis(shape) == rank - 1 and not layout.axes and rank == 2:
        return "group", layout.group_size
    del stack
    return None


def _weight_scheme(path: str, w: QuantizedArray, inputs: dict[str, Any] | None) -> tuple[dict[str, Any], str]:
    """The `weights` arguments and the compression format of a converted linear layer's weight."""
    fmt = w.format
    stack = w.stack_depth
    found = _strategy(w.layout, w.shape, stack)
    why = ""
    if found is not None:
        strategy, group = found
        if isinstance(fmt, IntFormat) and fmt.scale == "float32":
            bits = _signed_bits(fmt)
            if bits is not None and bits <= 8:
                zp = None if w.zero_point is None else "torch.int8"
                args = _args(bits, "int", strategy, group_size=group, symmetric=w.zero_point is None, zp_dtype=zp)
                if inputs is not None:
                    return args, "int-quantized"
                if bits in _PACKED_WIDTHS:
                    return args, "pack-quantized"
                why = f" (packed int32 words of {bits}-bit values have no layout shared by compressed-tensors releases)"
        elif isinstance(fmt, FloatFormat) and fmt.element == "float8_e4m3fn" and fmt.scale == "float32":
            return _args(8, "float", strategy), "naive-quantized" if inputs is None else "float-quantized"
        elif isinstance(fmt, FloatFormat) and fmt.element == "float4_e2m1fn" and strategy == "group":
            if fmt.scale == "e4m3" and group == 16:
                fp8 = "torch.float8_e4m3fn"
                args = _args(4, "float", "tensor_group", group_size=16, scale_dtype=fp8, zp_dtype=fp8)
                return args, "nvfp4-pack-quantized"
            if fmt.scale == "e8m0" and group == 32:
                args = _args(4, "float", "group", group_size=32, scale_dtype="torch.uint8", zp_dtype="torch.uint8")
                return args, "mxfp4-pack-quantized"
    raise ValueError(
        f"Layer {path!r} has weights in format {fmt.name} with axis={w.layout.axis!r}, group_size="
        f"{w.layout.group_size!r} (shape {w.shape}), which compressed-tensors does not store{why}. It stores signed "
        "integers of up to 8 bits (packed: 2, 4 or 8) per tensor, per output channel or per group along the input "
        "features, FP8 (float8_e4m3fn) per tensor or channel, NVFP4 (blocks of 16) and MXFP4 (blocks of 32)."
    )


def _input_scheme(path: str, q: Any) -> tuple[dict[str, Any] | None, dict[str, np.ndarray]]:
    """The `input_activations` arguments of a layer's input quantizer, and the tensors a static one needs."""
    if q is None:
        return None, {}
    fmt: Format | None = getattr(q, "format", None)
    kind = None
    if isinstance(fmt, IntFormat) and fmt.scale == "float32" and _signed_bits(fmt) is not None and fmt.bits <= 8:
        kind, bits = "int", fmt.bits
    elif isinstance(fmt, FloatFormat) and fmt.element == "float8_e4m3fn" and fmt.scale == "float32":
        kind, bits = "float", 8
    elif isinstance(fmt, FloatFormat) and fmt.scale == "e8m0" and fmt.element in ("float8_e4m3fn", "float4_e2m1fn"):
        kind, bits = "mx", fmt.bits
    layout = getattr(q, "layout", None)
    if isinstance(q, DynamicFakeQuant) and kind in ("int", "float") and layout.is_per_tensor():  # pyright: ignore
        # An Equinox linear layer sees one token at a time: its per-tensor dynamic scale is compressed-tensors' per
        # token one.
        symmetric = q.symmetric
        zp = None if symmetric else "torch.int8"
        args = _args(bits, kind, "token", dynamic=True, observer=None, symmetric=symmetric, zp_dtype=zp)  # pyright: ignore
        return args, {}
    if isinstance(q, DynamicFakeQuant) and kind == "mx" and layout.group_axis in (-1, 0):  # pyright: ignore
        u8 = "torch.uint8"
        size = layout.group_size  # pyright: ignore
        return _args(bits, "float", "group", group_size=size, dynamic=True, observer=None, scale_dtype=u8,  # pyright: ignore
                     zp_dtype=u8), {}  # fmt: skip
    if isinstance(q, (FakeQuant, LearnedFakeQuant)) and kind in ("int", "float") and q.layout.is_per_tensor():
        # Static scales: a calibrated FakeQuant's, or the step size a LearnedFakeQuant uses (floored at `min_scale`;
        # one per layer of a stack, as `calibrate` makes them) with its zero point rounded into the grid; the stack's
        # axes, if any, in front of compressed-tensors' one entry.
        if isinstance(q, FakeQuant):
            scale, zero_point = np.float32(q.scale), None if q.zero_point == 0 else np.asarray(q.zero_point)
        else:
            scale = np.maximum(np.asarray(q.scale, np.float32), np.float32(q.min_scale))
            zero_point = None if q.zero_point is None else np.round(np.clip(q.zero_point, fmt.qmin, fmt.qmax))  # pyright: ignore
        tensors: dict[str, np.ndarray] = {"input_scale": np.asarray(scale, np.float32)[..., None]}
        if zero_point is not None:
            tensors["input_zero_point"] = np.asarray(zero_point).astype(np.int8)[..., None]
        zp = None if zero_point is None else "torch.int8"
        return _args(bits, kind, "tensor", symmetric=zero_point is None, zp_dtype=zp), tensors  # pyright: ignore
    raise ValueError(
        f"Layer {path!r} quantizes its input with {type(q).__name__}"
        + (f" in format {fmt.name}" if fmt is not None else "")
        + ", which compressed-tensors does not describe. It describes dynamic int8 and FP8 scales per token "
        "(eqx_quant's per-tensor DynamicFakeQuant in a layer that sees one token), dynamic MX blocks, and static "
        "per-tensor int8 and FP8 scales (a calibrated FakeQuant, or the LearnedFakeQuant that `calibrate` gives a "
        "stack, one scale per layer); NVFP4 activations need a calibrated global scale."
    )


def _pack_int32(values: np.ndarray, bits: int) -> np.ndarray:
    """compressed-tensors' packing along the last axis: `value + 2**(bits - 1)` (unsigned), element `i` of a row in
    bits `i * bits` onwards of the row's stream of little-endian int32 words (the last word zero-padded)."""
    per = 32 // bits
    u = (values.astype(np.int64) + (1 << (bits - 1))).astype(np.uint64)
    pad = -u.shape[-1] % per
    u = np.concatenate([u, np.zeros((*u.shape[:-1], pad), np.uint64)], axis=-1)
    u = u.reshape(*u.shape[:-1], -1, per) << (np.arange(per, dtype=np.uint64) * np.uint64(bits))
    return np.bitwise_or.reduce(u, axis=-1).astype(np.uint32).view(np.int32)


def _weight_tensors(w: QuantizedArray, args: dict[str, Any], compression: str) -> dict[str, np.ndarray]:
    """The tensors of a quantized weight, by their names after the layer's name (`weight_packed`, `weight_scale`,
    ...)."""
    stack = tuple(w.scale.shape[: w.stack_depth])
    if args["type"] == "int":
        codes = np.asarray(w.unpacked()).reshape(*stack, *w.shape).astype(np.int8)
        scale = np.asarray(w.scale, np.float32)
        zero_point = None if w.zero_point is None else np.asarray(w.zero_point).astype(np.int8)
        compact = (*stack, *w.layout.scale_shape(w.shape))
        if args["strategy"] == "tensor":
            compact = (*stack, 1)
        elif args["strategy"] == "channel":
            compact = (*stack, w.shape[0], 1)
        scale = scale.reshape(compact)
        zero_point = None if zero_point is None else zero_point.reshape(compact)
        if compression == "int-quantized":
            out: dict[str, np.ndarray] = {"weight": codes, "weight_scale": scale}
            if zero_point is not None:
                out["weight_zero_point"] = zero_point
            return out
        bits = args["num_bits"]
        out = {"weight_packed": _pack_int32(codes, bits), "weight_scale": scale,
               "weight_shape": np.asarray((*stack, *w.shape), np.int64)}  # fmt: skip
        if zero_point is not None:
            if args["strategy"] == "tensor":
                out["weight_zero_point"] = zero_point
            else:  # packed along the output channels: the transpose of a row-wise packing
                out["weight_zero_point"] = np.swapaxes(_pack_int32(np.swapaxes(zero_point, -1, -2), bits), -1, -2)
        return out
    if compression in ("naive-quantized", "float-quantized"):
        codes = np.asarray(w.unpacked()).reshape(*stack, *w.shape).astype(np.uint8).view(ml_dtypes.float8_e4m3fn)
        scale = np.asarray(w.scale, np.float32)
        scale = scale.reshape(*stack, 1) if args["strategy"] == "tensor" else scale.reshape(*stack, w.shape[0], 1)
        return {"weight": codes, "weight_scale": scale}
    # FP4 codes, packed two a byte, element 2i in the low nibble: eqx_quant's own packing of a row
    scale = np.asarray(w.scale).reshape(*stack, *w.layout.scale_shape(w.shape)).astype(np.uint8)
    out: dict[str, np.ndarray] = {"weight_packed": np.asarray(w.values, np.uint8)}
    if compression == "nvfp4-pack-quantized":
        out["weight_scale"] = scale.view(ml_dtypes.float8_e4m3fn)
        t = np.asarray(w.tensor_scale, np.float32).reshape(*stack, 1)
        with np.errstate(divide="ignore"):
            out["weight_global_scale"] = (np.float32(1) / t).astype(np.float32)  # the reciprocal of the tensor scale
    else:
        out["weight_scale"] = scale  # E8M0: the exponent plus 127
    return out


def _check_config(config: Any) -> dict[str, Any]:
    """`config` as a dict that `config.json` can hold (JSON, without NaN or infinity), or raises naming the key."""
    if config is None:
        return {}
    if not isinstance(config, Mapping):
        raise TypeError(f"`config` must be a mapping (the model's configuration) or None, got config={config!r} of "
                        f"type {type(config).__name__}.")  # fmt: skip
    for key, value in config.items():
        if not isinstance(key, str):
            raise TypeError(f"`config` keys must be strings, got {key!r} of type {type(key).__name__}.")
        if key == "quantization_config":
            raise ValueError(f"`config` holds 'quantization_config' (={value!r}), which export_compressed_tensors "
                             "writes itself, describing `model`: leave it out of `config`.")  # fmt: skip
        try:
            json.dumps(value, sort_keys=True, allow_nan=False)
        except TypeError as error:
            raise TypeError(f"`config`[{key!r}]={value!r} is not JSON: {error}.") from None
        except ValueError as error:  # NaN or infinity (or a circular reference), which JSON has no value for
            raise ValueError(f"`config`[{key!r}]={value!r} is not valid JSON: {error}.") from None
    return dict(config)


def _check_directory(directory: str | os.PathLike) -> None:
    """Raises, naming them, if `directory` holds safetensors files that a loader would read beside the
    `model.safetensors` written, or instead of it: vLLM reads every `*.safetensors` file of a directory, or, where
    there is a `model.safetensors.index.json` (a sharded checkpoint's index), only the files it lists."""
    if not os.path.isdir(directory):
        return
    index = "model.safetensors.index.json"
    held = os.listdir(directory)
    stale = sorted(f for f in held if f == index or (f.endswith(".safetensors") and f != "model.safetensors"))
    if stale:
        raise ValueError(
            f"`directory`={os.fspath(directory)!r} holds {stale}, which loaders read beside the model.safetensors "
            f"written, or instead of it (vLLM reads every .safetensors file of a directory, or those that {index} "
            "lists): write into a new directory, or remove them first."
        )


def export_compressed_tensors(
    directory: str | os.PathLike,
    model: PyTree,
    *,
    names: Names = None,
    config: Mapping[str, Any] | None = None,
) -> None:
    """Writes a converted model as a compressed-tensors checkpoint, the layout vLLM (and Hugging Face
    `transformers`) reads: `model.safetensors` and a `config.json` whose `quantization_config` describes each
    quantized linear layer.

    Each converted linear layer is stored in the compression format compressed-tensors would choose for it:

    - signed integers of 2, 4 or 8 bits (per tensor, per output channel or per group along the input features)
        with float inputs: `pack-quantized`, with `weight_packed` (int32 words), `weight_scale`, `weight_shape` and,
        for an asymmetric grid, `weight_zero_point` (packed along the output channels);
    - signed integers of up to 8 bits with quantized inputs: `int-quantized`, with `weight` (int8), `weight_scale`
        and `weight_zero_point`;
    - FP8 (`float8_e4m3fn`, per tensor or channel): `naive-quantized` (float inputs) or `float-quantized`, with
        `weight` (F8_E4M3) and `weight_scale`;
    - NVFP4: `nvfp4-pack-quantized`, with `weight_packed` (uint8, two codes a byte, the first in the low nibble),
        `weight_scale` (F8_E4M3 per block of 16) and `weight_global_scale`;
    - MXFP4: `mxfp4-pack-quantized`, with `weight_packed` and `weight_scale` (uint8 E8M0 per block of 32);

    with `<layer>.bias` where the layer has one. Scales are float32; the integer and FP8 weights dequantize to the
    model's weights bit for bit (`(weight - zero_point) * weight_scale`), as do MXFP4's (`2**(scale - 127)` times the
    E2M1 value). NVFP4's `weight_global_scale` is the reciprocal of eqx_quant's tensor scale (compressed-tensors
    divides the block scale by it, where eqx_quant multiplies): its codes and block scales are exact, its values within
    a float32 rounding. Input quantizers become `input_activations`: a dynamic per-tensor int8 or FP8 scale is
    compressed-tensors' per-token one (an Equinox linear layer sees one token at a time), dynamic MX blocks are a
    dynamic `group` strategy, and a calibrated per-tensor [`eqx_quant.FakeQuant`][] is a static `tensor` strategy
    with an `input_scale` (and `input_zero_point`). So is a per-tensor [`eqx_quant.LearnedFakeQuant`][] (learned, or
    the one [`eqx_quant.calibrate`][] gives a stack of layers): the step size it uses (at least its `min_scale`) and
    its zero point rounded into the grid, one `input_scale` per layer where `{layer}` splits a stack.

    Layers that share a scheme share a config group, targeted by their names; float linear layers are listed in
    `ignore`. Other converted layers (embeddings, convolutions) are written with their dequantized weights, with a
    warning that names them, and every other array as it is, in its own dtype (F32 for float32, U32 for uint32; any
    dtype of one byte or more that safetensors holds). See
    [Serving a quantized model](../how-to/serving.md).

    **Arguments:**

    - `directory`: where to write `model.safetensors` and `config.json` (created if need be; those two are replaced).
        It must hold no other `.safetensors` file and no `model.safetensors.index.json`, which loaders would read
        beside the checkpoint written or instead of it.
    - `model`: a model from [`eqx_quant.convert`][].
    - `names`: the name of each tensor, as for [`eqx_quant.export_gguf`][]: a function of the path (as
        [`eqx_quant.quantize`][] names layers; `<layer>.weight`, `<layer>.bias`) or a mapping from every path;
        `None` leaves a tensor out. A quantized weight's name must end in `weight`: the layer's name (vLLM's module
        name, e.g. `model.layers.0.self_attn.q_proj`) is what comes before, and its tensors are named after it.
        `{layer}` splits stacked layers as for [`eqx_quant.export_gguf`][]; without it a stack (of
        `eqx.filter_vmap`) is written whole, each tensor with the stack's axes in front (and `weight_shape` saying
        so), which vLLM's modules, one layer each, do not load.
    - `config`: the model's own configuration (`architectures`, `hidden_size`, ...), a mapping with string keys and
        JSON values (finite numbers), to which the `quantization_config` is added; it must not hold one itself.

    **Raises:**

    `ValueError`, before anything is written, for a model without a converted layer, a linear layer whose weight
    format or input quantizer compressed-tensors does not store (naming the layer and the format), a layer that is
    quantized but not converted, any other quantizer in the model, names that repeat, miss a tensor, leave out every
    tensor, or (for a quantized weight) do not end in `weight`, an array whose dtype safetensors does not store (PRNG
    keys, int4, complex128; naming it), a `directory` that holds a `model.safetensors.index.json` or another
    `.safetensors` file (naming them; nothing is removed), or a `config` that holds a `quantization_config` or a
    NaN or infinity (naming the key). `TypeError` for a `config` that is not a mapping with string keys and JSON
    values.

    !!! example

        ```python
        import os
        import tempfile

        import equinox as eqx
        import jax
        import eqx_quant

        mlp = eqx.nn.MLP(64, 8, 64, 1, key=jax.random.key(0))
        model = eqx_quant.convert(eqx_quant.quantize(mlp, **eqx_quant.recipe("w4a16_g32")))
        directory = os.path.join(tempfile.mkdtemp(), "mlp-w4a16")
        eqx_quant.export_compressed_tensors(directory, model, config={"architectures": ["MLP"]})
        print(sorted(os.listdir(directory)))  # ['config.json', 'model.safetensors']
        ```
    """
    user_config = _check_config(config)
    _check_directory(directory)
    tied = check_exportable(model, "a compressed-tensors checkpoint")
    converted = dict(nodes(model, (AbstractConvertedLayer,)))
    if not converted:
        raise ValueError("`model` has no converted layer; convert it first with `eqx_quant.convert`.")
    leaves, _ = named_leaves(model)
    tensors_of = [name for name, leaf in leaves if is_tensor(leaf)]
    mapped = resolve_names(names, tensors_of, "model")
    linear_weights = {("weight" if not path else f"{path}.weight"): path for path in converted}
    groups: dict[str, dict[str, Any]] = {}
    formats: set[str] = set()
    tensors: dict[str, np.ndarray] = {}
    sources: dict[str, str] = {}
    dequantized: list[str] = []

    def put(name: str, array: np.ndarray, source: str) -> None:
        if name in tensors:
            raise ValueError(f"Two tensors are named {name!r}: {sources[name]!r} and {source!r}.")
        tensors[name], sources[name] = np.ascontiguousarray(array), source

    for name, leaf in leaves:
        if isinstance(leaf, AbstractQuantizer) and not name.startswith(tied):  # (a tied head's: left out)
            layer = converted.get(name.rsplit(".", 1)[0] if "." in name else "")
            if not (isinstance(layer, ConvertedLinear) and name.endswith("input_quant")):
                owner = name.rsplit(".", 1)[0] if "." in name else ""
                raise ValueError(f"{name!r} is a {type(leaf).__name__}, which a compressed-tensors checkpoint does "
                                 "not describe (only the inputs of converted linear layers). Quantize the model "
                                 f"without it: a rule `Rule({owner!r}, input=None)` before the others leaves that "
                                 "input float.")  # fmt: skip
        if is_tensor(leaf) and mapped[name] is not None and not isinstance(leaf, QuantizedArray):
            safetensors_dtype(name, leaf.dtype, " Or leave it out: `names` giving None for it.")
    for name, leaf in leaves:
        if not is_tensor(leaf) or mapped[name] is None:
            continue
        target = mapped[name]
        assert target is not None
        layer = converted.get(linear_weights.get(name, "\0"))
        if not isinstance(leaf, QuantizedArray):
            for part, piece in split_stacked(target, leaf, name):
                put(part, np.asarray(piece), name)
            continue
        if not isinstance(layer, ConvertedLinear):  # an embedding or a convolution: its weight as the model uses it
            for part, piece in split_stacked(target, leaf, name):
                put(part, np.asarray(piece.dequantize()), name)
            dequantized.append(name)
            continue
        layer_path = linear_weights[name]
        if not target.endswith("weight"):
            raise ValueError(f"The name {target!r} of the quantized weight {name!r} must end in 'weight' (the "
                             "layer's tensors are named after what comes before).")  # fmt: skip
        inputs, input_tensors = _input_scheme(layer_path or "(the model itself)", layer.input_quant)
        args, compression = _weight_scheme(layer_path or "(the model itself)", leaf, inputs)
        formats.add(compression)
        scheme = json.dumps({"weights": args, "input_activations": inputs, "format": compression}, sort_keys=True)
        group = groups.setdefault(scheme, {"targets": []})
        parts = split_stacked(target, leaf, name)
        split = len(parts) > 1 or parts[0][0] != target  # a stack split by `{layer}`: per layer, its input scale
        for i, (part, piece) in enumerate(parts):
            module = part.removesuffix("weight").removesuffix(".")
            group["targets"].append(module)
            prefix = f"{module}." if module else ""
            inputs_here = {k: v[i] if split and v.ndim > 1 else v for k, v in input_tensors.items()}
            for suffix, array in {**_weight_tensors(piece, args, compression), **inputs_here}.items():
                put(prefix + suffix, array, name)
    if dequantized:
        warnings.warn(
            f"compressed-tensors describes quantized linear layers only: the quantized weights {dequantized} (of "
            "embeddings or convolutions) are written dequantized, in floating point, at the size of float weights.",
            stacklevel=caller_stacklevel(),
        )
    ignore = []
    for path, linear in nodes(model, (eqx.nn.Linear,)):
        if path.removesuffix(".layer") in converted or (path == "layer" and "" in converted):
            continue
        weight = f"{path}.weight" if path else "weight"
        target = mapped.get(weight)
        if target is not None:
            pieces = split_stacked(target, linear.weight, weight)
            ignore += [part.removesuffix("weight").removesuffix(".") for part, _ in pieces]
    config_groups = {}
    for i, (scheme, group) in enumerate(groups.items()):
        config_groups[f"group_{i}"] = {"targets": group["targets"], "output_activations": None, **json.loads(scheme)}
    quantization_config = {
        "config_groups": config_groups,
        "format": formats.pop() if len(formats) == 1 else "mixed-precision" if formats else "dense",
        "global_compression_ratio": None,
        "ignore": ignore,
        "kv_cache_scheme": None,
        "quant_method": "compressed-tensors",
        "quantization_status": "compressed",
        "sparsity_config": {},
        "transform_config": {},
        "version": _VERSION,
    }
    full = {**user_config, "quantization_config": quantization_config}
    encoded = json.dumps(full, indent=2, sort_keys=True, allow_nan=False).encode()
    os.makedirs(directory, exist_ok=True)
    write_safetensors(os.path.join(directory, "model.safetensors"), tensors, {"format": "pt"})
    write_replacing(os.path.join(directory, "config.json"), lambda f: f.write(encoded))
