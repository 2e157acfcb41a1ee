"""Named quantization schemes: rule lists for the usual weight / activation pairs."""

import dataclasses
import re
from collections.abc import Sequence
from typing import Any

from ._backward import QuantizedBackward, UnquantizedBackward, check_backward
from ._format import (
    GGML_BLOCK,
    GGML_FORMATS,
    MX_BLOCK,
    NVFP4,
    NVFP4_BLOCK,
    Format,
    IntFormat,
    float_format,
    int_format,
    mx_format,
    stretched_format,
)
from ._misc import check_int
from ._quantizers import DynamicFakeQuant
from ._rules import LayerQuantizer, Rule


# name: (weight bits, default group size, activation bits, quantized attention products)
_RECIPES: dict[str, tuple[int, int | None, int | None, bool]] = {
    "w8a8": (8, None, 8, False),
    "w8a8_attn": (8, None, 8, True),
    "w8a16": (8, None, None, False),
    "w4a8_g32": (4, 32, 8, False),
    "w4a4_g32": (4, 32, 4, False),
    "w4a16_g32": (4, 32, None, False),
    "w3a16_g32": (3, 32, None, False),
    "w2a16_g32": (2, 32, None, False),
}

# name: the weight and input quantizers' formats and block sizes
_FLOAT_RECIPES = {
    "fp8": ((float_format("float8_e4m3fn"), None), (float_format("float8_e4m3fn"), None)),
    "mxfp4": ((mx_format("mxfp4"), MX_BLOCK), (mx_format("mxfp8_e4m3"), MX_BLOCK)),
    "nvfp4": ((NVFP4, NVFP4_BLOCK), (NVFP4, NVFP4_BLOCK)),
}

# The GGML block formats of llama.cpp's GGUF files: weights only (llama.cpp computes its activations in float).
_GGML_RECIPES = ("q8_0", "q4_0", "q5_0")

# name: the weight grid of ParetoQ's low-bit schemes, always with learned scales from ParetoQ's initialisation
_PARETOQ_RECIPES = {"ternary": IntFormat(-1, 1, window="rounding"), "w2a16_stretched": stretched_format(2)}

RECIPE_NAMES = (*_RECIPES, *_PARETOQ_RECIPES, *_FLOAT_RECIPES, *_GGML_RECIPES)


def recipe(
    name: str,
    *,
    group_size: int | None = None,
    keep: str | Sequence[str] = (),
    learned: bool = False,
    backward: QuantizedBackward | UnquantizedBackward | None = None,
) -> dict[str, Any]:
    """The configuration of a named scheme, as a list of [`eqx_quant.Rule`][]s:
    `eqx_quant.quantize(model, **recipe("w4a8_g32"))`.

    | name | weights | activations | use |
    |---|---|---|---|
    | `"w8a8"` | int8 per output channel | int8 dynamic | integer inference on int8 hardware |
    | `"w8a8_attn"` | as `"w8a8"` | as `"w8a8"`, and attention's two products | integer attention too |
    | `"w8a16"` | int8 per output channel | float | weight-only, near lossless |
    | `"w4a8_g32"` | int4 per group of 32 | int8 dynamic | the usual LLM weights, integer activations |
    | `"w4a4_g32"` | int4 per group of 32 | int4 dynamic | 4-bit activations: needs [`eqx_quant.rotate`][] |
    | `"w4a16_g32"` | int4 per group of 32 | float | weight-only, 4 bits |
    | `"w3a16_g32"` | int3 per group of 32 | float | weight-only, 3 bits |
    | `"w2a16_g32"` | int2 per group of 32 | float | weight-only, 2 bits: needs QAT or GPTQ |
    | `"ternary"` | {-1, 0, 1} per output channel, learned scales | float | weight-only, 1.58 bits: QAT only |
    | `"w2a16_stretched"` | {±1/2, ±3/2} per output channel, learned scales | float | weight-only, 2 bits: QAT only |
    | `"fp8"` | FP8 E4M3 per output channel | FP8 E4M3 dynamic, per tensor | FP8 inference |
    | `"mxfp4"` | MXFP4, blocks of 32 along the contraction | MXFP8 E4M3, blocks of 32 | OCP MX hardware |
    | `"nvfp4"` | NVFP4, blocks of 16 along the contraction | NVFP4 | NVFP4 hardware (W4A4) |
    | `"q8_0"` | GGML Q8_0, blocks of 32 along each row | float | llama.cpp (GGUF), near lossless |
    | `"q4_0"` | GGML Q4_0, blocks of 32 along each row | float | llama.cpp (GGUF), 4.5 bits per weight |
    | `"q5_0"` | GGML Q5_0, blocks of 32 along each row | float | llama.cpp (GGUF), 5.5 bits per weight |

    Activations are the inputs of `Linear` and `Conv` layers; with `"w8a8_attn"` both operands of every
    [`eqx_quant.nn.Einsum`][] and of the two products of every `eqx.nn.MultiheadAttention` are quantized too (8 bits,
    dynamic, per tensor). A scale per tensor is computed over every token of the call: in a causal decoder a later
    token moves the scale of the keys and values that earlier positions read, so those positions' outputs depend
    (by a rounding step) on tokens they do not attend to, and decoding one token at a time with a cache computes
    other values than the whole sequence at once. Where that matters, keep the products in float (the `"w8a8"`
    recipe) or give them static scales (an [`eqx_quant.FakeQuant`][] with a scale chosen beforehand).

    The quantizers are made for each layer by [`eqx_quant.LayerQuantizer`][]s: groups and blocks run along each
    product's contraction (a linear layer's input features, a convolution's input channels for the block formats).
    A linear layer whose input size the group size does not divide, and every convolution, gets one scale per output
    channel for its integer weights; a layer whose contraction does not split into MX or NVFP4 blocks gets the
    `"fp8"` quantizers instead. The block scales of MX and NVFP4 are always computed from the block, so
    `learned=True` only gives FP8 weights a learned scale, and `group_size` does not apply to them.

    `"ternary"` and `"w2a16_stretched"` are ParetoQ's 1.58-bit and 2-bit schemes (Liu et al., 2025) for
    quantization-aware training: weights on the ternary grid `[-1, 0, 1]` (`"int2_narrow_wide"`) or on the
    stretched 2-bit grid `{-3/2, -1/2, 1/2, 3/2}` (`"int2_stretched"`, [`eqx_quant.stretched_format`][]), both
    stored at 2 bits and both passing gradients wherever rounding does not saturate, half a step beyond the outermost
    levels, as ParetoQ does; with one learned scale per output channel (or per group, with `group_size`) initialised
    by ParetoQ's rule ([`eqx_quant.LearnedFakeQuant.init_from`][] with `method="paretoq"`: `max|w| / 1.5` and
    `max|w| / 2`), whatever `learned` says: without training such a model loses much of what the float one knew (its
    `rtn` is not round to nearest with absmax scales). Hold the scales fixed with
    [`eqx_quant.trainable`][]`(model, scales=False)`. `keep` layers get learned int8 weights.

    The GGML recipes fake-quantize each weight exactly as llama.cpp's reference quantizer (`gguf.quants.quantize`)
    stores it: the fake-quantized weight is bit for bit what `gguf` dequantizes from the file
    [`eqx_quant.export_gguf`][] writes. Their blocks run along the last axis of linear and embedding weights (the
    input features, a GGUF tensor's rows); a weight whose rows do not split into blocks of 32, and every
    convolution, stays float. Their scales are always computed from the block (`learned` does not apply), `keep`
    layers get Q8_0, and `group_size` does not apply. See [Serving a quantized model](../how-to/serving.md).

    Weights are symmetric. Dynamic activation scales are computed at every call from the input the layer sees: in a
    model that maps its layers over tokens with `jax.vmap`, as Equinox transformers do, that is one scale per token,
    the standard activation scheme of LLM W8A8 and W4A8 inference. A product found by tracing (see
    [Quantizing any model](../how-to/any-model.md)) sees all the tokens of a call at once (`x` of shape
    `(tokens, features)` in `x @ W.T`, or the tokens of the model's own `jax.vmap`): its inputs get one scale per
    token too, per index of the axes the product does not sum over ([`eqx_quant.LayerQuantizer`][] with
    `per_token=True`), so that the model computes what it would with linear layers mapped over the tokens.
    Convolutions have one scale per input tensor: a convolution over a whole sequence (a causal `Conv1d`, say)
    scales every position by the largest input anywhere in it, so an earlier position's output depends, by a
    rounding step, on later ones, and a prefix computes other values than the same positions of the whole sequence.
    [`eqx_quant.calibrate`][] turns dynamic scales into static ones, one per tensor, which keep such models causal.

    **Arguments:**

    - `name`: one of the names above.
    - `group_size`: the group size of the grouped recipes (default: the number in the name); `None` keeps it. For
        a per-channel recipe it is ignored unless given, in which case its weights are grouped too.
    - `keep`: patterns (regular expressions matched against the whole path, see [`eqx_quant.Rule`][]) of layers
        kept at 8 bits, weights per output channel, their activations dynamic int8 where the recipe quantizes
        activations (W8A8) and float where it does not (W8A16 for the weight-only recipes; Q8_0 weights for the GGML
        recipes): typically the first and last layers, e.g. `keep=("embed", "head")`. A pattern that reaches no
        layer is an error when the rules are applied.
    - `learned`: weights get a [`eqx_quant.LearnedFakeQuant`][] initialised from each layer's weight with the scales
        round to nearest uses (`init_from(..., method="absmax")`, so that training starts from the
        round-to-nearest model; stacked layers get one per layer), for quantization-aware training, instead of a
        [`eqx_quant.DynamicFakeQuant`][]. Block formats keep their dynamic block scales.
    - `backward`: the `backward` of every rule (see [`eqx_quant.Rule`][]): `None` for the gradients of the
        fake-quant formulation, an [`eqx_quant.UnquantizedBackward`][] for the float layers' gradients at the
        original operands (not with `learned=True`, whose scales it would never train), or an
        [`eqx_quant.QuantizedBackward`][] for integer input gradients where a layer runs on integers.

    **Returns:**

    `{"rules": [...]}`: the keyword argument of [`eqx_quant.quantize`][]. The rules can be printed, read and
    extended: `[eqx_quant.Rule("head", weight=None, input=None), *recipe("w4a8_g32")["rules"]]` keeps a head in
    float.

    !!! example

        ```python
        import eqx_quant

        for rule in eqx_quant.recipe("w4a8_g32", keep="embed")["rules"]:
            print(rule.pattern, rule.weight.format, rule.weight.group_size)
        ```
    """
    if name not in RECIPE_NAMES:
        raise ValueError(f"`name` must be one of {RECIPE_NAMES}, got name={name!r}.")
    if name in (*_FLOAT_RECIPES, *_GGML_RECIPES) and group_size is not None:
        raise ValueError(f"`group_size` does not apply to the recipe {name!r}, got group_size={group_size}.")
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
    check_backward(backward)
    if isinstance(backward, UnquantizedBackward) and name in _PARETOQ_RECIPES:
        raise ValueError(
            f"`backward=UnquantizedBackward()` gives the quantizers' scales no gradient, and the recipe {name!r} "
            "trains its scales; leave `backward` out."
        )
    if learned and isinstance(backward, UnquantizedBackward):
        raise ValueError(
            "`backward=UnquantizedBackward()` gives the quantizers' scales no gradient, so `learned=True` would train "
            "nothing in them; leave one of the two out."
        )

    def dynamic(fmt: Format) -> LayerQuantizer:
        """The dynamic input quantizer of `fmt`, one scale per token."""
        return LayerQuantizer(fmt, input=True, per_token=True)

    if name in _GGML_RECIPES:
        kept = [Rule(pattern, weight=LayerQuantizer(GGML_FORMATS["q8_0"], GGML_BLOCK), input=None)
                for pattern in patterns]  # fmt: skip
        rule = Rule(".*", weight=LayerQuantizer(GGML_FORMATS[name], GGML_BLOCK), input=None)
        return {"rules": [dataclasses.replace(r, backward=backward) for r in (*kept, rule)]}
    if name in _PARETOQ_RECIPES:
        learned = True
        weight = LayerQuantizer(_PARETOQ_RECIPES[name], group_size, learned=True, method="paretoq")
        inputs = products = None
    elif name in _FLOAT_RECIPES:
        (weight_format, weight_block), (input_format, input_block) = _FLOAT_RECIPES[name]
        weight = LayerQuantizer(weight_format, weight_block, learned=learned)
        if input_block is None:
            inputs = dynamic(input_format)
        else:
            inputs = LayerQuantizer(input_format, input_block, input=True)
        products = None
    else:
        bits, default_group, activation_bits, attention = _RECIPES[name]
        group = default_group if group_size is None else group_size
        weight = LayerQuantizer(int_format(bits), group, learned=learned)
        inputs = None if activation_bits is None else dynamic(int_format(activation_bits))
        products = DynamicFakeQuant(8) if attention else None
    kept_input = None if inputs is None else dynamic(int_format(8))  # a weight-only recipe keeps float inputs
    kept = [Rule(pattern, weight=LayerQuantizer(int_format(8), learned=learned), input=kept_input)
            for pattern in patterns]  # fmt: skip
    rule = Rule(".*", weight=weight, input=inputs, products=products)
    return {"rules": [dataclasses.replace(r, backward=backward) for r in (*kept, rule)]}
