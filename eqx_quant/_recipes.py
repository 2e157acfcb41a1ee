"""Named quantization schemes: the arguments of `quantize` for the usual weight / activation pairs."""

import re
from collections.abc import Sequence
from typing import Any

import equinox as eqx

from ._float_quantizers import DynamicFloatFakeQuant, LearnedFloatFakeQuant, MXFakeQuant, NVFP4FakeQuant
from ._misc import check_int
from ._quantizers import AbstractQuantizer, DynamicFakeQuant, LearnedFakeQuant
from .nn._layers import stack_depth


# name: (weight bits, default group size, activation bits, quantized attention products)
_RECIPES: dict[str, tuple[int, int | None, int | None, bool]] = {
    "w8a8": (8, None, 8, False),
    "w8a8_attn": (8, None, 8, True),
    "w8a16": (8, None, None, False),
    "w4a8_g32": (4, 32, 8, False),
    "w4a16_g32": (4, 32, None, False),
    "w3a16_g32": (3, 32, None, False),
    "w2a16_g32": (2, 32, None, False),
}

# name: (weight format, activation format); "fp8" is float8_e4m3fn with float32 scales.
_FLOAT_RECIPES: dict[str, tuple[str, str]] = {
    "fp8": ("fp8", "fp8"),
    "mxfp4": ("mxfp4", "mxfp8_e4m3"),
    "nvfp4": ("nvfp4", "nvfp4"),
}
_BLOCK_SIZES = {"mxfp4": 32, "mxfp8_e4m3": 32, "nvfp4": 16}

RECIPE_NAMES = (*_RECIPES, *_FLOAT_RECIPES)


def _weight_quantizer(layer: eqx.Module, bits: int, group_size: int | None, learned: bool) -> AbstractQuantizer:
    """Per group of `group_size` along the input axis for linear layers and embedding rows whose last axis it
    divides, otherwise per output channel (row)."""
    weight = layer.weight  # pyright: ignore[reportAttributeAccessIssue]
    grouped = (
        group_size is not None
        and isinstance(layer, (eqx.nn.Linear, eqx.nn.Embedding))
        and weight.shape[-1] % group_size == 0
    )
    layout = dict(group_size=group_size) if grouped else dict(axis=0)
    if learned:
        return LearnedFakeQuant.init_from(weight, bits, stacked=stack_depth(layer, weight.shape), **layout)
    return DynamicFakeQuant(bits, **layout)  # pyright: ignore[reportArgumentType]


def _contraction_axis(layer: eqx.Module) -> int:
    """The axis a layer's product sums over, counted from the end so that it holds for stacked weights too: the last
    axis of a linear weight `(out, in)` and of its input, the input channels of a convolution's weight
    `(out, in, *kernel)` and of its input `(in, *spatial)`, the features of an embedding table."""
    return -(layer.num_spatial_dims + 1) if isinstance(layer, eqx.nn.Conv) else -1  # pyright: ignore


def _blocks_fit(layer: eqx.Module, block: int) -> bool:
    """Whether the contraction of `layer`, in its weight and in its input, splits into blocks of `block`."""
    if isinstance(layer, eqx.nn.Conv):
        return (layer.in_channels // layer.groups) % block == 0  # then `in_channels`, a multiple of it, splits too
    if isinstance(layer, eqx.nn.Linear):
        return layer.in_features != "scalar" and layer.in_features % block == 0
    return layer.weight.shape[-1] % block == 0  # pyright: ignore  # an embedding: blocks along its features


def _float_quantizer(fmt: str, layer: eqx.Module, *, weight: bool, learned: bool) -> AbstractQuantizer:
    """The weight (`weight=True`) or input quantizer of `fmt` for `layer`: FP8 E4M3 per output channel (weights) or
    per tensor (inputs); MX and NVFP4 in blocks along the contraction, or FP8 where it does not split into blocks."""
    if fmt != "fp8" and _blocks_fit(layer, _BLOCK_SIZES[fmt]):
        axis = _contraction_axis(layer)
        return NVFP4FakeQuant(axis=axis) if fmt == "nvfp4" else MXFakeQuant(fmt, axis=axis)
    if not weight:
        return DynamicFloatFakeQuant("float8_e4m3fn")
    w = layer.weight  # pyright: ignore[reportAttributeAccessIssue]
    if learned:
        return LearnedFloatFakeQuant.init_from(w, "float8_e4m3fn", axis=0, stacked=stack_depth(layer, w.shape))
    return DynamicFloatFakeQuant("float8_e4m3fn", axis=0)


def recipe(
    name: str,
    *,
    group_size: int | None = None,
    keep: str | Sequence[str] = (),
    learned: bool = False,
) -> dict[str, Any]:
    """The arguments of [`eqx_quant.quantize`][] for a named scheme: `eqx_quant.quantize(model, **recipe("w4a8_g32"))`.

    | name | weights | activations | use |
    |---|---|---|---|
    | `"w8a8"` | int8 per output channel | int8 dynamic | integer inference on int8 hardware |
    | `"w8a8_attn"` | as `"w8a8"` | as `"w8a8"`, and attention's two products | integer attention too |
    | `"w8a16"` | int8 per output channel | float | weight-only, near lossless |
    | `"w4a8_g32"` | int4 per group of 32 | int8 dynamic | the usual LLM weights, integer activations |
    | `"w4a16_g32"` | int4 per group of 32 | float | weight-only, 4 bits |
    | `"w3a16_g32"` | int3 per group of 32 | float | weight-only, 3 bits |
    | `"w2a16_g32"` | int2 per group of 32 | float | weight-only, 2 bits: needs QAT or GPTQ |
    | `"fp8"` | FP8 E4M3 per output channel | FP8 E4M3 dynamic, per tensor | FP8 inference |
    | `"mxfp4"` | MXFP4, blocks of 32 along the contraction | MXFP8 E4M3, blocks of 32 | OCP MX hardware |
    | `"nvfp4"` | NVFP4, blocks of 16 along the contraction | NVFP4 | NVFP4 hardware (W4A4) |

    Activations are the inputs of `Linear` and `Conv` layers; with `"w8a8_attn"` both operands of every
    [`eqx_quant.nn.Einsum`][] and of the two products of every `eqx.nn.MultiheadAttention` are quantized too (8 bits,
    dynamic, per tensor).

    The float recipes block MX and NVFP4 along each product's contraction (a linear layer's input features, a
    convolution's input channels); a layer whose contraction does not split into blocks gets the `"fp8"`
    quantizers instead. Their block scales are always computed from the block, so `learned=True` only gives FP8
    weights a [`eqx_quant.LearnedFloatFakeQuant`][], and `group_size` does not apply to them.

    Weights are symmetric. Groups run along a linear layer's input axis (and along an embedding's rows); a layer
    whose input size the group size does not divide, and every convolution, gets one scale per output channel.
    Dynamic activation scales are computed at every call from the input the layer sees: in a model that maps its
    layers over tokens with `jax.vmap`, as Equinox transformers do, that is one scale per token, the standard
    activation scheme of LLM W8A8 and W4A8 inference. [`eqx_quant.calibrate`][] turns them into static ones.

    **Arguments:**

    - `name`: one of the names above.
    - `group_size`: the group size of the grouped recipes (default: the number in the name); `None` keeps it. For
        a per-channel recipe it is ignored unless given, in which case its weights are grouped too.
    - `keep`: patterns (regular expressions matched against the whole path, see [`eqx_quant.quantize`][]) of layers
        kept at 8 bits, weights per output channel and activations dynamic (W8A8): typically the first and last
        layers, e.g. `keep=("embed", "head")`.
    - `learned`: weights get a [`eqx_quant.LearnedFakeQuant`][] initialised from each layer's weight (stacked layers
        get one per layer), for quantization-aware training, instead of a [`eqx_quant.DynamicFakeQuant`][].

    **Returns:**

    A dict with the keys `weights`, `activations` and `products`, the arguments of [`eqx_quant.quantize`][].
    """
    if name not in RECIPE_NAMES:
        raise ValueError(f"`name` must be one of {RECIPE_NAMES}, got name={name!r}.")
    if name in _FLOAT_RECIPES and group_size is not None:
        raise ValueError(f"`group_size` does not apply to the float recipe {name!r}, got group_size={group_size}.")
    if group_size is not None and check_int("group_size", group_size) < 1:
        raise ValueError(f"`group_size` must be a positive int, got group_size={group_size}.")
    patterns = (keep,) if isinstance(keep, str) else tuple(keep)
    for pattern in patterns:
        if not isinstance(pattern, str):
            raise TypeError(f"`keep` must be a pattern or a sequence of patterns, got {keep!r}.")
        try:
            re.compile(pattern)
        except re.error as error:
            raise ValueError(f"`keep`: {pattern!r} is not a valid regular expression ({error}).") from None
    if not isinstance(learned, bool):
        raise TypeError(f"`learned` must be a bool, got learned={learned!r}.")

    def kept(path: str) -> bool:
        return any(re.fullmatch(pattern, path) for pattern in patterns)

    if name in _FLOAT_RECIPES:
        weight_format, input_format = _FLOAT_RECIPES[name]

        def weight_quant(layer: eqx.Module) -> AbstractQuantizer:
            return _float_quantizer(weight_format, layer, weight=True, learned=learned)

        def input_quant(layer: eqx.Module) -> AbstractQuantizer | None:
            return _float_quantizer(input_format, layer, weight=False, learned=learned)

        products = None
    else:
        bits, default_group, activation_bits, attention = _RECIPES[name]
        group = default_group if group_size is None else group_size

        def weight_quant(layer: eqx.Module) -> AbstractQuantizer:
            return _weight_quantizer(layer, bits, group, learned)

        def input_quant(layer: eqx.Module) -> AbstractQuantizer | None:
            return None if activation_bits is None else DynamicFakeQuant(activation_bits)

        products = DynamicFakeQuant(8) if attention else None

    def weights(path: str, layer: eqx.Module) -> AbstractQuantizer:
        return _weight_quantizer(layer, 8, None, learned) if kept(path) else weight_quant(layer)

    def activations(path: str, layer: eqx.Module) -> AbstractQuantizer | None:
        return DynamicFakeQuant(8) if kept(path) else input_quant(layer)

    return {"weights": weights, "activations": activations, "products": products}
