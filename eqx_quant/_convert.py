"""Conversion of a fake-quantized model into one that stores its weights quantized."""

import dataclasses
import functools
import math
from collections.abc import Callable
from typing import Any, Literal

import equinox as eqx
import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec
from jaxtyping import PyTree

from ._misc import first_where, named_sharding
from ._qarray import QuantizedArray
from ._quantizers import AbstractFakeQuantizer, FakeQuant, LearnedFakeQuant
from ._traced import QuantTraced, each_layer_array, replaced, two_level
from ._tree import map_nodes, nodes, path_string
from .nn._converted import AbstractConvertedLayer, ConvertedConv, ConvertedEmbedding, ConvertedLinear
from .nn._einsum import QuantEinsum
from .nn._layers import AbstractQuantLayer, QuantEmbedding, QuantLinear, per_layer, stack_depth


def _frozen_input_quant(quantizer: Any) -> Any:
    """A per-tensor learned input quantizer with float32 scales becomes the static quantizer with its current
    values."""
    if (
        isinstance(quantizer, LearnedFakeQuant)
        and quantizer.layout.is_per_tensor()
        and quantizer.scale.ndim == 0
        and quantizer.format.scale == "float32"
    ):
        scale = max(float(quantizer.scale), quantizer.min_scale)
        zero_point = 0
        if quantizer.zero_point is not None:
            zero_point = int(np.round(np.clip(float(quantizer.zero_point), quantizer.qmin, quantizer.qmax)))
        return FakeQuant(scale, format=quantizer.format, zero_point=zero_point)
    return quantizer


def _whole_tensor(quantizer: AbstractFakeQuantizer) -> AbstractFakeQuantizer:
    """The quantizer as it applies to a whole weight: without the `axis_name` that let it see one shard of it inside
    `jax.shard_map` (conversion sees the whole weight, and the grid is the same)."""
    if getattr(quantizer, "axis_name", None) is None:
        return quantizer
    return dataclasses.replace(quantizer, axis_name=None)  # pyright: ignore[reportArgumentType]


def sharded_like(tensor: QuantizedArray, weight: Any) -> QuantizedArray:
    """`tensor` with its integers, scales and zero points sharded like the weight they come from.

    Each axis of a leaf that runs along an axis of the weight takes that axis' partitioning: with its length, the
    stacked layers' axes, the weight's own axes in the codes and the channel axes in the scales; and where it
    divides evenly among the axis' devices, the tiles of the tiled axis in the scales, and in packed codes (one row
    of bytes per index along the first axis, the other axes flattened) the bytes, as the weight's second axis is
    split, where the axes after it are not (a matrix's input features, a kernel's input channels: contiguous runs of
    bytes). The other axes are replicated, as everything is where the weight has no `NamedSharding` (on one device,
    or traced).
    """
    sharding = named_sharding(weight)
    if sharding is None:
        return tensor
    spec = tuple(sharding.spec) + (None,) * (weight.ndim - len(sharding.spec))
    depth = tensor.stack_depth
    whole = [(a, True) for a in range(weight.ndim)]  # (weight axis, whether the leaf's axis has its length)
    own = whole[depth:]  # the weight's axes of one tensor
    none = (None, True)
    if tensor.packed:  # rows, then the bytes of the other axes flattened: their first axis' when it alone is split
        alone = len(own) >= 2 and all(spec[a] is None for a, _ in own[2:])
        codes = whole[:depth] + [own[0] if own else none, (own[1][0], False) if alone else none]
    else:
        codes = whole
    tile = tensor.layout.tile_axis(tensor.shape)
    scales = whole[:depth] + (own if tile is None else own[:tile] + [(own[tile][0], False), none] + own[tile + 1 :])

    def devices(entry: Any) -> int:
        names = () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)
        return math.prod(sharding.mesh.shape[name] for name in names)

    def place(leaf: Any, axes: list[tuple[int | None, bool]]) -> Any:
        if leaf is None:
            return None
        leaf_spec = []
        for n, (a, exact) in zip(leaf.shape, axes, strict=True):
            fits = a is not None and (n == weight.shape[a] if exact else n % devices(spec[a]) == 0)
            leaf_spec.append(spec[a] if fits else None)
        return jax.device_put(leaf, NamedSharding(sharding.mesh, PartitionSpec(*leaf_spec)))

    return dataclasses.replace(
        tensor,
        values=place(tensor.values, codes),
        scale=place(tensor.scale, scales),
        zero_point=place(tensor.zero_point, scales),
        tensor_scale=place(tensor.tensor_scale, whole[: depth + tensor.layout.stacked]),
    )


def _placed(tensor: QuantizedArray, weight: Any) -> QuantizedArray:
    """Where `convert` puts the stored `tensor` of `weight`: sharded like it (`sharded_like`), but a tiled or stacked
    tensor stays where the program that computed it put it, from the weight's partitioning (its dequantized weight
    then computes as the fake-quantized one does, bit for bit, where the mapping of `sharded_like` did not always)."""
    return tensor if tensor.view_shape != weight.shape else sharded_like(tensor, weight)


@functools.cache
def _weight_quantization(depth: int) -> Callable[[Any, Any], Any]:
    """`quantizer.quantize(weight)` for a layer stacked `depth` times, compiled: one program per layer (reused across
    layers of the same shapes and an equal quantizer), rather than one per operation of an eager call."""
    return eqx.filter_jit(per_layer(lambda quantizer, weight: quantizer.quantize_array(weight), depth))


@functools.cache
def _layers_quantization(depth: int) -> Callable[[Any, Any], Any]:
    """`each_layer_array` of a traced weight stacked `depth` times, compiled."""
    return eqx.filter_jit(lambda quantizer, weight: each_layer_array(quantizer, weight, depth))


def convert(model: PyTree, *, matmul: Literal["int", "float"] | None = None) -> PyTree:
    """Converts a fake-quantized model into one that stores its weights quantized.

    Every [`eqx_quant.nn.QuantLinear`][], [`eqx_quant.nn.QuantConv`][] and [`eqx_quant.nn.QuantEmbedding`][] becomes
    a [`eqx_quant.nn.ConvertedLinear`][], [`eqx_quant.nn.ConvertedConv`][] or [`eqx_quant.nn.ConvertedEmbedding`][].
    The weight is stored as a [`eqx_quant.QuantizedArray`][]: the codes that the weight quantizer's forward pass
    rounded it to (same format, same rounding, same arithmetic), with its scales. Integers are stored as int8
    (int16/int32 for wider grids) or, for grids of at most 4 bits, packed at their width (see
    [`eqx_quant.pack_bits`][]); low-precision float elements as their codes, one byte per FP8 or FP6 element, two FP4
    elements per byte, with float32, E8M0 (MX) or `float8_e4m3fn` (NVFP4) scales. No float copy of the weight is
    kept. Biases stay float32.

    Input quantizers are kept; a per-tensor [`eqx_quant.LearnedFakeQuant`][] is frozen into a static
    [`eqx_quant.FakeQuant`][] with its current scale and zero point (except in a stack of layers built with
    `eqx.filter_vmap`, whose scan needs the scales as arrays: it stays, computing what that static quantizer
    would). Layers whose input quantizer has
    one scale for the whole input (static, or a per-tensor dynamic one) and whose integer weight has one scale per
    tensor, per output channel or (linear layers) per group along the contraction then compute on integers (see
    [`eqx_quant.nn.ConvertedLinear`][]); the others (float formats among them) on the dequantized weight, which is
    bit for bit the fake-quantized one; so do the layers quantized with `matmul="float"`, unless `matmul` says
    otherwise. A layer without a weight quantizer becomes
    its float layer, or, if its input is quantized, stays as it is (the quantized input shapes the output). All
    other leaves are kept as they are (shardings included).

    **Sharding.** The integers, scales and zero points of a weight with a `NamedSharding` are sharded like it: the
    weight's axes keep their partitioning and per-channel scales follow their channels; packed 4-bit integers (one
    row of bytes per output channel) keep the partitioning of the first axis, and of a matrix's input features where
    the bytes divide evenly; tiled and stacked weights are left where the conversion's program put them. A weight
    quantizer's `axis_name` (for statistics across the shards of a `jax.shard_map`) is dropped: conversion sees the
    whole weight. Input quantizers keep theirs. See
    [Sharded training](../how-to/sharded.md).

    **Arguments:**

    - `model`: a model from [`eqx_quant.quantize`][] (trained or calibrated).
    - `matmul`: `None` (default) keeps each layer's (traced weight's, [`eqx_quant.nn.QuantEinsum`][]'s) `matmul`;
        `"int"` makes every converted product compute on the integers where the formats allow it, as if quantized
        with `matmul="int"` (a model trained with the float product, deployed on integers: its outputs then differ
        from the fake-quant model's by rounding); `"float"` makes them all compute the float product of the
        quantized operands. (The products of two activations found by tracing have no `matmul`: they compute on the
        integers where the formats allow it, either way.)

    **Returns:**

    The converted model. With `matmul=None`, its outputs equal the fake-quant model's bit for bit (see
    [Parity with integer inference](../concepts/parity.md)).

    **Raises:**

    `ValueError` if `model` has no quantized layer (nothing to convert), or, naming the layer, if a weight holds NaN
    (which no integer represents; the check needs concrete weights, so call `convert` outside `jax.jit`); `TypeError`
    for a weight quantizer without a number format (a [`eqx_quant.PassthroughClip`][]).

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
        print(real.layers[0].qweight.values.dtype)  # int8
        x = data[0][0]
        print(jnp.max(jnp.abs(real(x) - fake(x))))
        ```
    """

    if matmul not in (None, "int", "float"):
        raise ValueError(f"`matmul` must be None, 'int' or 'float', got matmul={matmul!r}.")
    if not nodes(model, (AbstractQuantLayer, QuantTraced)):
        if nodes(model, (AbstractConvertedLayer,)):
            raise ValueError(
                "`model` is converted already: its layers store their weights quantized, and there is nothing left to "
                "convert. `convert` takes the fake-quantized model of `eqx_quant.quantize` (and of PTQ or QAT)."
            )
        if nodes(model, (QuantEinsum,)):
            raise ValueError(
                "`model` quantizes products of two activations alone (eqx_quant.nn.QuantEinsum), which hold no "
                "weights to store: it runs as it is, and `convert` has nothing to do. Its layers are quantized by "
                "rules that reach them (`eqx_quant.recipe('w8a8_attn')` gives both)."
            )
        raise ValueError(
            "`model` has no quantized layer to convert (an eqx_quant.nn.QuantLinear, QuantConv, QuantEmbedding or "
            "QuantTraced); quantize it first with `eqx_quant.quantize`."
        )

    def to_int(path: str, layer: AbstractQuantLayer) -> Any:
        if layer.weight_quant is None:
            # No integers to store; a quantized (or transformed) input still shapes the output, so the layer stays.
            keep = layer.input_quant is not None or getattr(layer, "input_transform", None) is not None
            return layer if keep else layer.layer
        if not isinstance(layer.weight_quant, AbstractFakeQuantizer):
            raise TypeError(
                f"Layer {path!r} has weight quantizer {type(layer.weight_quant).__name__}, which has no number "
                "format; only fake quantizers (FakeQuant, DynamicFakeQuant, LearnedFakeQuant) can be converted."
            )
        weight = layer.layer.weight  # pyright: ignore[reportAttributeAccessIssue]
        if not eqx.is_array(weight):
            # The placeholder of an `eqx.nn.Shared` tie: the weight is another layer's, restored at call time; the
            # layer stays as it is and quantizes what it receives (the other layer's dequantized weight).
            return layer
        _check_finite_weight(f"Layer {path or '(the model itself)'!r}", weight)
        depth = stack_depth(layer.layer, weight.shape)
        tensor = _weight_quantization(depth)(_whole_tensor(layer.weight_quant), weight)
        tensor = _placed(tensor, weight)
        skeleton = eqx.tree_at(lambda l: l.weight, layer.layer, None)
        if isinstance(layer, QuantEmbedding):
            return ConvertedEmbedding(skeleton, tensor)
        if isinstance(layer, QuantLinear):
            inputs = _frozen_input_quant(layer.input_quant)
            return ConvertedLinear(skeleton, tensor, inputs, layer.input_transform, matmul or layer.matmul)
        return ConvertedConv(skeleton, tensor, _frozen_input_quant(layer.input_quant), matmul or layer.matmul)

    model = map_nodes(model, (AbstractQuantLayer,), to_int)
    if matmul is not None and nodes(model, (QuantEinsum,)):
        model = map_nodes(model, (QuantEinsum,), lambda path, e: QuantEinsum(
            e.einsum, lhs_quant=e.lhs_quant, rhs_quant=e.rhs_quant, matmul=matmul))  # fmt: skip
    if not nodes(model, (QuantTraced,)):
        return model  # rebuilt no further: its other nodes stay the very objects they were
    return map_nodes(model, (QuantTraced,), lambda path, traced: _convert_traced(traced, matmul))


def _check_finite_weight(what: str, weight: Any) -> None:
    """A `ValueError` naming `what` if the concrete `weight` holds NaN, which no integer stores."""
    index = None if isinstance(weight, jax.core.Tracer) else first_where(np.isnan(np.asarray(weight)))
    if index is not None:
        raise ValueError(
            f"{what} has a NaN weight entry at index {index}, which converted weights do not store (no integer holds "
            "NaN); the fake-quant weight is NaN there. Replace the NaN entries before converting."
        )


def _convert_traced(traced: QuantTraced, matmul: str | None) -> QuantTraced:
    """The traced weights stored as their codes (the leaf becomes a QuantizedArray), the input quantizers frozen,
    `matmuls` all `matmul` unless it is `None`."""
    index = {path: i for i, path in enumerate(traced.weight_paths)}
    for path, quantizer in zip(traced.weight_paths, traced.weight_quants, strict=True):
        if quantizer is not None and not isinstance(quantizer, AbstractFakeQuantizer):
            raise TypeError(
                f"Traced weight {path!r} has weight quantizer {type(quantizer).__name__}, which has no number "
                "format; only fake quantizers (FakeQuant, DynamicFakeQuant, LearnedFakeQuant) can be converted."
            )

    def store(key_path: Any, leaf: Any) -> Any:
        i = index.get(path_string(key_path))
        quantizer = None if i is None else traced.weight_quants[i]
        if quantizer is None or isinstance(leaf, QuantizedArray):
            return leaf
        _check_finite_weight(f"Traced weight {path_string(key_path)!r}", leaf)
        depth = len(traced.stacks[i])  # pyright: ignore[reportArgumentType]  # `i` names a traced weight here
        if two_level(quantizer) and depth:  # one tensor scale per layer of the stack, as the traced model takes them
            return _placed(_layers_quantization(depth)(_whole_tensor(quantizer), leaf), leaf)
        return _placed(_weight_quantization(0)(_whole_tensor(quantizer), leaf), leaf)

    is_stored = lambda x: isinstance(x, QuantizedArray)  # noqa: E731
    model = jax.tree_util.tree_map_with_path(store, traced.model, is_leaf=is_stored)
    inputs = tuple(_frozen_input_quant(q) for q in traced.input_quants)
    matmuls = traced.matmuls if matmul is None else (matmul,) * len(traced.matmuls)
    return replaced(traced, model=model, input_quants=inputs, matmuls=matmuls)
