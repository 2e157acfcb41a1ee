"""The configuration of a quantized model: one ordered list of rules, and `quantize`, which applies it."""

import dataclasses
import re
import warnings
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Literal, TypeAlias

import equinox as eqx
from jaxtyping import PyTree

from ._backward import QuantizedBackward, UnquantizedBackward, check_backward
from ._format import Format, as_format, float_format
from ._int_ops import integer_grid
from ._layout import Layout
from ._misc import caller_stacklevel, check_flags, check_int
from ._observe import shapes_of
from ._quantizers import AbstractQuantizer, DynamicFakeQuant, LearnedFakeQuant, paretoq_divisor
from ._traced import TRACED_ONLY, QuantTraced, TracedProduct, find_products, layer_types, trace_call, weight_layout
from ._tree import join_path, map_nodes, nodes
from .nn._attention import QuantMultiheadAttention
from .nn._converted import AbstractConvertedLayer
from .nn._einsum import Einsum, QuantEinsum
from .nn._layers import (
    AbstractQuantLayer,
    QuantConv,
    QuantEmbedding,
    QuantLinear,
    check_floating_weight,
    default_input_quant,
    default_weight_quant,
    stack_depth,
)
from .nn._transforms import restored


Factory: TypeAlias = Callable[[str, eqx.Module], AbstractQuantizer | None]
QuantizerSpec: TypeAlias = AbstractQuantizer | Factory | Mapping[str, "AbstractQuantizer | Factory | None"] | None
Where: TypeAlias = Callable[[str, eqx.Module], bool] | str | None
Pair: TypeAlias = tuple[AbstractQuantizer | None, AbstractQuantizer | None]
ProductSpec: TypeAlias = (
    AbstractQuantizer | Pair | Callable[[str, eqx.Module], Any] | Mapping[str, "AbstractQuantizer | Pair | None"] | None
)

FLOAT_LAYERS = (eqx.nn.Linear, eqx.nn.Conv, eqx.nn.Embedding)


def contraction_axis(layer: eqx.Module) -> int:
    """The axis a layer's product sums over, counted from the end so that it holds for stacked weights too: the last
    axis of a linear weight `(out, in)` and of its input, the input channels of a convolution's weight
    `(out, in, *kernel)` and of its input `(in, *spatial)`, the features of an embedding table."""
    return -(layer.num_spatial_dims + 1) if isinstance(layer, eqx.nn.Conv) else -1  # pyright: ignore


def _tiles_fit(layer: eqx.Module, size: int) -> bool:
    """Whether the contraction of `layer`, in its weight and in its input, splits into tiles of `size`."""
    if isinstance(layer, eqx.nn.Conv):
        return (layer.in_channels // layer.groups) % size == 0  # then `in_channels`, a multiple of it, splits too
    if isinstance(layer, eqx.nn.Linear):
        return layer.in_features != "scalar" and layer.in_features % size == 0
    return layer.embedding_size % size == 0  # pyright: ignore  # an embedding (its weight may be a tie's placeholder)


_FP8 = float_format("float8_e4m3fn")


@dataclasses.dataclass(frozen=True)
class LayerQuantizer:
    """A quantizer made for each layer a rule reaches, from the layer itself: the layout follows the layer's product,
    and a learned quantizer starts from the layer's weight. The recipes are written with these.

    - Weights (`input=False`): per tile of `group_size` along the product's contraction (a linear layer's input
        features, an embedding's features, a convolution's input channels for block formats), or per output channel
        when `group_size` is `None`. Where the tiles do not fit, an integer format falls back to one scale per output
        channel (so does every convolution with an integer format, by design: its integer forward takes no groups),
        and a block format (MX, NVFP4) to `float8_e4m3fn` per output channel, with a warning naming the layer. A GGML
        format (`"q4_0"`, ...) tiles the last axis of linear and embedding weights (the rows of a GGUF tensor); where
        its blocks do not fit the weight stays float (the factory returns `None`, with a warning), and so do
        convolutions, by design (with a warning too).
    - Inputs (`input=True`): per tile along the contraction (block formats), else per tensor; where blocks do not
        fit, `float8_e4m3fn` per tensor. With `per_token=True` (formats with float32 scales), one scale per token:
        per index of the free axes of the product's input, the axes it does not sum over (for a traced product,
        each row of `x` in `x @ W.T`; see [Quantizing any model](../how-to/any-model.md)). A linear layer sees one
        token per call, so its input has one scale per tensor, which is one per token when the model maps the layer
        over tokens with `jax.vmap`; a convolution's windows overlap, so its input keeps one scale per tensor.
    - `learned=True` makes a weight's quantizer a [`eqx_quant.LearnedFakeQuant`][] initialised from the weight by
        [`eqx_quant.LearnedFakeQuant.init_from`][] with `method="absmax"`: the scales round to nearest would use, so
        that training starts from the round-to-nearest model (stacked layers get one set of scales per layer); block
        formats keep their dynamic block scales. Otherwise the quantizer is a [`eqx_quant.DynamicFakeQuant`][].
        `method` is the rule of `init_from` for learned weights: `"absmax"`, or `"paretoq"` (ParetoQ's, for the
        ternary grid `[-1, 1]` and the stretched grids only).

    A call `quantizer(path, layer)` makes the layer's quantizer, so a `LayerQuantizer` is a factory for
    [`eqx_quant.Rule`][].
    """

    format: Format | str | int  # a Format after construction
    group_size: int | None = None
    learned: bool = False
    input: bool = False
    method: Literal["absmax", "paretoq"] = "absmax"
    per_token: bool = False

    def __post_init__(self):
        object.__setattr__(self, "format", as_format(self.format))  # a name or a number of bits too
        if self.group_size is not None and check_int("group_size", self.group_size) < 1:
            raise ValueError(f"`group_size` must be None or a positive int, got group_size={self.group_size}.")
        check_flags(learned=self.learned, input=self.input, per_token=self.per_token)
        if self.per_token and not self.input:
            raise ValueError("`per_token=True` lays out an input's scales; it needs input=True.")
        if self.per_token and self.format.scale != "float32":  # pyright: ignore[reportAttributeAccessIssue]
            raise ValueError(
                f"`per_token=True` needs a format with float32 scales; {self.format.name} computes its scales per "  # pyright: ignore
                "block along the contraction, already finer than per token."
            )
        if self.method not in ("absmax", "paretoq"):
            raise ValueError(f"`method` must be 'absmax' or 'paretoq', got method={self.method!r}.")
        if self.method == "paretoq" and not (self.learned and paretoq_divisor(self.format) is not None):
            raise ValueError(
                "`method`='paretoq' initialises learned weights on the ternary grid [-1, 1] or a stretched grid: it "
                f"needs learned=True and such a grid, got learned={self.learned} and {self.format.name}."
            )

    def __call__(self, path: str, layer: eqx.Module) -> AbstractQuantizer | None:
        if isinstance(layer, TracedProduct):
            return self._traced(layer)
        fmt, group = self.format, self.group_size
        assert isinstance(fmt, Format)  # made one by `__post_init__`
        blocks = fmt.scale != "float32"
        fits = group is not None and _tiles_fit(layer, group)
        # Tiles of a float32-scaled grid: a linear layer's or an embedding's weight (an input takes one scale).
        tileable = blocks or (isinstance(layer, (eqx.nn.Linear, eqx.nn.Embedding)) and not self.input)
        ggml = fmt.scale == "float16"
        if group is not None and not fits and tileable and not (ggml and isinstance(layer, eqx.nn.Conv)):
            instead = "stays float" if ggml else "gets float8_e4m3fn" if blocks else "gets one scale per output channel"
            warnings.warn(
                f"Layer {path!r}: its contraction does not split into tiles of {group}, so its "
                f"{'input' if self.input else 'weight'} {instead} instead of {fmt.name} in tiles of {group}.",
                stacklevel=caller_stacklevel(),
            )
        if ggml and isinstance(layer, eqx.nn.Conv) and not self.input:
            warnings.warn(
                f"Layer {path!r} is a convolution, whose weight {fmt.name} does not quantize (GGUF's blocks run along "
                "the rows of linear and embedding weights): it stays float.",
                stacklevel=caller_stacklevel(),
            )
        if ggml and (not fits or isinstance(layer, eqx.nn.Conv)):
            return None  # GGML's blocks run along a tensor's rows: a layer they do not fit stays float, as in llama.cpp
        if blocks and not fits:
            fmt, group, blocks = _FP8, None, False
        if self.input:
            if group is None or not blocks:
                return DynamicFakeQuant(fmt)
            return DynamicFakeQuant(fmt, group_size=group, group_axis=contraction_axis(layer))
        tiled = fits and tileable
        layout = dict(group_size=group, group_axis=contraction_axis(layer)) if tiled else dict(axis=0)
        # The placeholder of an `eqx.nn.Shared` tie has no values to learn scales from: that layer quantizes the
        # tied weight with dynamic scales.
        if self.learned and not blocks and eqx.is_array(layer.weight):  # pyright: ignore[reportAttributeAccessIssue]
            weight = layer.weight  # pyright: ignore[reportAttributeAccessIssue]
            depth = stack_depth(layer, weight.shape)
            if tiled:  # the keyword arguments of earlier releases, so that the quantizer compares equal to theirs
                layout = dict(group_size=group)
            return LearnedFakeQuant.init_from(weight, fmt, stacked=depth, method=self.method, **layout)  # pyright: ignore
        if tiled and not blocks:
            layout = dict(group_size=group)
        return DynamicFakeQuant(fmt, **layout)  # pyright: ignore[reportArgumentType]

    def _traced(self, product: TracedProduct) -> AbstractQuantizer | None:
        """The quantizer of a traced weight (or of its products' input), laid out along the product: tiles along the
        contracted axis when there is one and they fit, else one scale per channel (weights) or per tensor (inputs),
        with the same fallbacks as layers."""
        fmt, group = self.format, self.group_size
        assert isinstance(fmt, Format)
        blocks, ggml = fmt.scale != "float32", fmt.scale == "float16"
        shape, axes = (product.input_shape, product.input_contracted) if self.input else (
            product.weight.shape, product.contracted)  # fmt: skip
        fits = group is not None and len(axes) == 1 and shape[axes[0]] % group == 0
        fell_back = False  # a block format's input that takes float8_e4m3fn instead: one scale per token
        if group is not None and not fits:
            per = "tensor" if self.input or not product.channels else "channel"  # a vector weight has no channel
            instead = "stays float" if ggml else "gets float8_e4m3fn" if blocks else f"gets one scale per {per}"
            operand = "the input of its product" if self.input else "its product"
            why = (
                f"{operand} sums over {len(axes)} of its axes ({axes} of {shape}), and tiles run along one"
                if len(axes) > 1
                else f"{operand}'s contraction (axes {axes} of {shape}) does not split into tiles of {group}"
            )
            warnings.warn(
                f"Traced weight {product.path!r}: {why}, so it {instead} instead of {fmt.name} in tiles of {group}.",
                stacklevel=caller_stacklevel(),
            )
            if ggml:
                return None
            if blocks:
                fmt, blocks, fell_back = _FP8, False, True
        # An input's axis counts from the end: a call whose operand has more (or fewer) leading axes than the
        # example's (a batch of tokens where the example had one) still tiles the contracted axis.
        tiles = dict(group_size=group, group_axis=axes[0] - len(shape) if self.input else axes[0]) if fits else {}
        if self.input and (self.per_token or fell_back):  # as the input of a linear layer mapped over the tokens
            if product.primitive != "dot_general":
                return DynamicFakeQuant(fmt)  # a convolution's windows overlap: per tensor
            # The example's tokens; `QuantTraced` lays the scales out again along each call's (`per_token`).
            return DynamicFakeQuant(fmt, axis=product.input_free or None)
        if self.input:
            return DynamicFakeQuant(fmt, **tiles) if blocks else DynamicFakeQuant(fmt)  # pyright: ignore
        layout = tiles or dict(axis=product.channels)
        if self.learned and not blocks:
            return LearnedFakeQuant.init_from(product.weight, fmt, method=self.method, **layout)  # pyright: ignore
        return DynamicFakeQuant(fmt, **layout)  # pyright: ignore[reportArgumentType]


_DEFAULT: Any = object()


@dataclasses.dataclass(frozen=True)
class Rule:
    """One entry of a quantization configuration: which layers (and products) it reaches, and how they are quantized.

    [`eqx_quant.quantize`][] gives each layer the first rule of the list whose `pattern` matches its path (a regular
    expression matched against the whole path, `re.fullmatch`: `"layers\\.1"` names `layers.1` and not
    `layers.10`; `".*"` reaches everything); layers that no rule reaches stay in floating point. A rule that reaches
    no layer is an error: the message lists the paths there are.

    **Fields:**

    - `pattern`: the regular expression of the paths the rule reaches.
    - `weight`: the weight quantizer: a quantizer module (shared by every layer the rule reaches), a factory
        `f(path, layer) -> quantizer | None` (such as [`eqx_quant.LayerQuantizer`][]), or `None` for a float weight.
        By default 8 bits, one scale per output channel.
    - `input`: the input quantizer of a `Linear` or `Conv`, in the same forms; by default 8 bits per tensor.
        Embeddings take integer indices and never get one.
    - `products`: the quantizers of the products of two activations that the rule reaches: every
        [`eqx_quant.nn.Einsum`][] and the two products (`<path>.scores`, `<path>.values`) of every
        `eqx.nn.MultiheadAttention`. A quantizer (for both operands), a pair `(lhs, rhs)`, a factory returning either,
        or `None` (the default) to leave them in floating point.
    - `backward`: an [`eqx_quant.QuantizedBackward`][] for the linear layers whose weight and input are both on
        integer grids (the input's gradient is then an integer product), an [`eqx_quant.UnquantizedBackward`][] for
        every linear layer and convolution (the float layer's gradients at the original operands), or `None`.
    - `matmul`: `"int"` for the integer forward where the quantizers allow it, `"float"` for the float product of the
        fake-quantized operands.

    !!! example

        ```python
        import equinox as eqx
        import jax
        import eqx_quant

        mlp = eqx.nn.MLP(4, 2, 8, 2, key=jax.random.key(0))
        rules = [
            eqx_quant.Rule("layers\\\\.0", weight=eqx_quant.DynamicFakeQuant(4, axis=0)),
            eqx_quant.Rule("layers\\\\.1"),
        ]
        qmlp = eqx_quant.quantize(mlp, rules)
        print([type(layer).__name__ for layer in qmlp.layers])  # ['QuantLinear', 'QuantLinear', 'Linear']
        ```
    """

    pattern: str = ".*"
    weight: Any = _DEFAULT
    input: Any = _DEFAULT
    products: Any = None
    backward: QuantizedBackward | UnquantizedBackward | None = None
    matmul: Literal["int", "float"] = "int"

    def __post_init__(self):
        if self.weight is _DEFAULT:
            object.__setattr__(self, "weight", default_weight_quant())
        if self.input is _DEFAULT:
            object.__setattr__(self, "input", default_input_quant())
        _compiled("pattern", self.pattern)
        for name in ("weight", "input"):
            value = getattr(self, name)
            if not (value is None or isinstance(value, AbstractQuantizer) or callable(value)):
                raise TypeError(f"`{name}` must be a quantizer, a factory f(path, layer) or None, got {value!r}.")
        if not (self.products is None or _is_pair(self.products) or isinstance(self.products, AbstractQuantizer)
                or callable(self.products)):  # fmt: skip
            raise TypeError(
                f"`products` must be a quantizer, a pair of them, a factory or None, got {self.products!r}."
            )
        check_backward(self.backward)
        if self.matmul not in ("int", "float"):
            raise ValueError(f"`matmul` must be 'int' or 'float', got matmul={self.matmul!r}.")
        if isinstance(self.backward, QuantizedBackward) and self.matmul != "int":
            raise ValueError(f"`backward` needs the integer forward, matmul='int'; got matmul={self.matmul!r}.")


def _compiled(name: str, pattern: object) -> re.Pattern:
    """`pattern` compiled, or a `ValueError` naming the argument it came from."""
    if not isinstance(pattern, str):
        raise TypeError(f"The layer patterns of `{name}` must be strings, got {pattern!r}.")
    try:
        return re.compile(pattern)
    except re.error as error:
        raise ValueError(f"`{name}`: {pattern!r} is not a valid regular expression ({error}).") from None


def _matches(pattern: str, path: str, match: str) -> bool:
    return (re.fullmatch if match == "full" else re.search)(pattern, path) is not None


def _is_pair(value: object) -> bool:
    return (
        isinstance(value, tuple)
        and len(value) == 2
        and all(v is None or isinstance(v, AbstractQuantizer) for v in value)
    )


class _Used:
    """The mapping patterns that matched a layer, to tell the ones that matched none."""

    def __init__(self):
        self.patterns: set[tuple[str, str]] = set()


def _resolve(name: str, spec: object, path: str, layer: eqx.Module, match: str, used: _Used, pairs: bool = False):
    """The quantizer (or, with `pairs`, the quantizer or pair of quantizers) that `spec` gives the layer at `path`."""
    if spec is None or isinstance(spec, AbstractQuantizer) or (pairs and _is_pair(spec)):
        return spec
    if isinstance(spec, Mapping):
        for pattern, value in spec.items():
            if _matches(pattern, path, match):
                if isinstance(value, Mapping):
                    raise TypeError(f"`{name}` mappings cannot be nested, got {value!r} under {pattern!r}.")
                used.patterns.add((name, pattern))
                return _resolve(name, value, path, layer, match, used, pairs)
        return None
    if callable(spec):
        quantizer = spec(path, layer)
        if not (quantizer is None or isinstance(quantizer, AbstractQuantizer) or (pairs and _is_pair(quantizer))):
            kind = "a quantizer, a pair of them or None" if pairs else "a quantizer or None"
            raise TypeError(f"The `{name}` factory returned {quantizer!r} for layer {path!r}, not {kind}.")
        return quantizer
    kind = "a quantizer, a pair of them" if pairs else "a quantizer"
    raise TypeError(f"`{name}` must be {kind}, a factory, a mapping from patterns to them, or None; got {spec!r}.")


_EXACT = (eqx.nn.Linear, eqx.nn.Conv, eqx.nn.Conv1d, eqx.nn.Conv2d, eqx.nn.Conv3d, eqx.nn.Embedding)


def _overrides_call(layer: eqx.Module) -> bool:
    """Whether `layer`'s class is a subclass of a float layer that computes its own forward pass (which the quantized
    wrapper, running the base layer's computation, would silently replace)."""
    if type(layer) in _EXACT:
        return False
    base = next(cls for cls in _EXACT[::-1] if isinstance(layer, cls))
    return type(layer).__call__ is not base.__call__


def _candidates_message(candidates: Sequence[str]) -> str:
    if not candidates:  # e.g. traced arrays that multiply only each other (`x @ (U @ V)`): no weight of a product
        return "; the model has none (an array multiplied only by other arrays of the model is no product's weight)."
    return "; the paths there are: " + ", ".join(repr(path) for path in candidates) + "."


@dataclasses.dataclass(frozen=True)
class _Decision:
    """What one layer (or product) gets: a rule resolved for it."""

    weight: Any
    input: Any
    products: Any
    backward: QuantizedBackward | UnquantizedBackward | None
    matmul: str
    kept_float: bool = False  # by a rule that says so (`weight=None, input=None`), not by a factory's choice


def _legacy_rules(
    weights, activations, where, matmul, products, match, backward
) -> tuple[Callable, Callable, Callable]:
    """The decision of the keyword arguments of `quantize` for each layer, a check of their patterns at the end, and
    whether they reach a path."""
    for name, spec in (("weights", weights), ("activations", activations), ("products", products)):
        if isinstance(spec, Mapping):
            for pattern in spec:
                _compiled(name, pattern)
    if where is None:
        select = lambda path, layer: True  # noqa: E731
    elif isinstance(where, str):
        _compiled("where", where)
        select = lambda path, layer: _matches(where, path, match)  # noqa: E731
    elif callable(where):
        select = where
    else:
        raise TypeError(f"`where` must be None, a regular expression or a predicate on (path, layer), got {where!r}.")
    used = _Used()

    def decide(path: str, layer: eqx.Module, product: bool, aliases: Sequence[str] = ()) -> _Decision | None:
        del aliases  # the keyword arguments' patterns read the path the layer has as found
        if not select(path, layer):
            return None
        if product:
            quantizers = _resolve("products", products, path, layer, match, used, pairs=True)
            return _Decision(None, None, quantizers, None, matmul)
        weight = _resolve("weights", weights, path, layer, match, used)
        inputs = None if isinstance(layer, eqx.nn.Embedding) else _resolve("activations", activations, path, layer,
                                                                          match, used)  # fmt: skip
        return _Decision(weight, inputs, None, backward, matmul)

    def check(paths: list[str]) -> None:
        if where is not None and isinstance(where, str) and not any(_matches(where, p, match) for p in paths):
            raise ValueError(f"`where`={where!r} matches none of the layers" + _candidates_message(paths))
        for name, spec in (("weights", weights), ("activations", activations), ("products", products)):
            if isinstance(spec, Mapping):
                for pattern in spec:
                    if (name, pattern) not in used.patterns:
                        raise ValueError(
                            f"`{name}`: the pattern {pattern!r} matches none of the layers" + _candidates_message(paths)
                        )

    return decide, check, select


def _rule_list(rules: Sequence[Rule]) -> tuple[Callable, Callable, Callable]:
    if isinstance(rules, Rule) or not isinstance(rules, Sequence) or not all(isinstance(r, Rule) for r in rules):
        if isinstance(rules, str):
            raise TypeError(
                f"`rules` must be a list of eqx_quant.Rule, got the string {rules!r}: pass a recipe as keyword "
                f"arguments, `eqx_quant.quantize(model, **eqx_quant.recipe({rules!r}))`."
            )
        if isinstance(rules, dict) and "rules" in rules:  # what `recipe` returns
            raise TypeError(
                f"`rules` must be a list of eqx_quant.Rule, got a dict with keys {sorted(rules)}: pass a recipe as "
                "keyword arguments, `eqx_quant.quantize(model, **eqx_quant.recipe(name))`."
            )
        raise TypeError(f"`rules` must be a list of eqx_quant.Rule, got {rules!r}.")
    used: set[int] = set()

    def decide(path: str, layer: eqx.Module, product: bool, aliases: Sequence[str] = ()) -> _Decision | None:
        for i, rule in enumerate(rules):
            if all(re.fullmatch(rule.pattern, p) is None for p in (path, *aliases)):
                continue
            used.add(i)
            if product:
                quantizers = _resolve("products", rule.products, path, layer, "full", _Used(), pairs=True)
                return _Decision(None, None, quantizers, None, rule.matmul)
            weight = _resolve("weight", rule.weight, path, layer, "full", _Used())
            inputs = None if isinstance(layer, eqx.nn.Embedding) else _resolve("input", rule.input, path, layer,
                                                                              "full", _Used())  # fmt: skip
            return _Decision(weight, inputs, None, rule.backward, rule.matmul, rule.weight is rule.input is None)
        return None

    def check(paths: list[str]) -> None:
        for i, rule in enumerate(rules):
            if i not in used:
                earlier = "; an earlier rule may take them all" if i else ""
                raise ValueError(f"Rule {i} (pattern {rule.pattern!r}) reaches none of the layers{earlier}"
                                 + _candidates_message(paths)
                                 + " A rule's pattern must match a whole path (`re.fullmatch`).")  # fmt: skip

    def reaches(path: str, layer: eqx.Module) -> bool:
        del layer
        return any(re.fullmatch(rule.pattern, path) is not None for rule in rules)

    return decide, check, reaches


def quantize(
    model: PyTree,
    rules: Sequence[Rule] | None = None,
    *,
    weights: QuantizerSpec = default_weight_quant(),
    activations: QuantizerSpec = default_input_quant(),
    where: Where = None,
    matmul: Literal["int", "float"] = "int",
    products: ProductSpec = None,
    match: Literal["search", "full"] = "search",
    subclasses: Literal["error", "wrap", "skip"] = "error",
    backward: QuantizedBackward | UnquantizedBackward | None = None,
    example: tuple | Callable[[PyTree], Any] | None = None,
) -> PyTree:
    """Replaces the layers of a model by their quantized wrappers.

    Every `eqx.nn.Linear`, `eqx.nn.Conv` (any dimensionality) and `eqx.nn.Embedding` in `model` that the
    configuration reaches becomes a [`eqx_quant.nn.QuantLinear`][], [`eqx_quant.nn.QuantConv`][] or
    [`eqx_quant.nn.QuantEmbedding`][] holding the original layer. The model can be any PyTree: nested modules, lists,
    tuples, dicts, `eqx.nn.Sequential`, `eqx.nn.MLP`; every other leaf is kept as it is (shardings included), and
    layers that are already quantized are left alone.

    Layers are named by their path in the PyTree, as a dotted string: `layers.0` for the first layer of an
    `eqx.nn.MLP`, `blocks.1.conv` for `model.blocks[1].conv`, `heads.key` for a dict entry.

    **The configuration** is either a list of [`eqx_quant.Rule`][]s (the first rule whose pattern matches a path
    wins; [`eqx_quant.recipe`][] returns such lists), or the keyword arguments below, which make one rule: `where`
    selects the layers, `weights` and `activations` give their quantizers. Either way, a pattern that matches no
    layer is a `ValueError` naming it and listing the paths there are: a typo never leaves a model silently in float.

    **Patterns.** A rule's pattern is matched against the whole path (`re.fullmatch`). The patterns of the keyword
    arguments (a key of a `weights`, `activations` or `products` mapping, or a string `where`) are *searched* anywhere
    in the path (`re.search`) by default: `r"layers\\.1"` selects `layers.1`, but also `layers.10` and
    `encoder.layers.1.conv`; anchor them (`r"^layers\\.1$"`), or pass `match="full"`.

    **Attention.** The products of two activations are quantized where a rule (or `products`) gives them
    quantizers: every [`eqx_quant.nn.Einsum`][] in the model (write attention's `QKᵀ` and softmax·V with it) becomes a
    [`eqx_quant.nn.QuantEinsum`][], and every `eqx.nn.MultiheadAttention` a
    [`eqx_quant.nn.QuantMultiheadAttention`][] whose two products (at `<path>.scores` and `<path>.values`) are
    quantized (its four projections are linear layers, quantized like any other, at
    `<path>.attention.query_proj` and so on once wrapped; a rule may name them by either path). Otherwise both stay
    in floating point.

    **Subclasses.** A subclass of `eqx.nn.Linear`, `eqx.nn.Conv` or `eqx.nn.Embedding` that overrides `__call__`
    computes something the quantized wrapper (which runs the base layer's computation) would not: by default
    (`subclasses="error"`) such a layer raises a `ValueError` naming it; `"skip"` leaves it in floating point and
    `"wrap"` wraps it anyway. Subclasses that keep the base `__call__` are wrapped as usual.

    **Products however written** (`example=`). With an example call, `quantize` also traces the model and finds every
    product of one of its own floating-point array leaves (outside the layers above) with an activation:
    `W @ x`, `x @ W.T`, `jnp.dot`, `jnp.matmul`, `jnp.einsum`, `lax.dot_general`, `lax.conv_general_dilated`, in
    methods of any class, through transposes, reshapes, casts, slices, `jit`, `checkpoint`, `cond`, custom-derivative
    functions and `lax.scan` over a stacked leaf. Such a weight is named by its leaf's path (`layers.1.weights`,
    `gnn.w_self`), rules reach it like a layer, and a factory receives an [`eqx_quant.TracedProduct`][] as its
    `layer`; the model comes back wrapped in an [`eqx_quant.nn.QuantTraced`][] (see there for what a call computes).
    Scales follow the product: one per output channel means one per index of the axes it does not sum over, tiles run
    along the axis it sums over. A quantizer module written for layers keeps its meaning (`axis=0`: per output
    channel; `group_size=g`: tiles along the contraction). The input of a traced weight's products is quantized at
    each product with the rule's `input` quantizer (a factory such as the recipes' lays it out along the product: one
    scale per token, per index of the axes the product does not sum over); such a product computes on the integers
    where both operands are on symmetric integer grids, the input's scales constant along the contraction and the
    weight's per tensor, channel or tile (and `matmul="int"`), as linear layers do, else in floating point
    on the quantized operands. Traced products keep the gradient of the float product of their quantized operands: a
    rule reaching a traced weight that sets `backward` is a `ValueError`. With a `products` rule, the products of
    two activations that the call computes (`jnp.einsum` attention) are quantized too: they are named `products.0`,
    `products.1`, ... in the order the program computes them. Without `example=`, the layers with weights that only
    tracing reaches (`eqx.nn.ConvTranspose`, `eqx.nn.GRUCell`, `eqx.nn.LSTMCell`) stay in floating point, with a
    warning naming them where the configuration's patterns reach their weights (`cell.weight_ih`).

    **Arguments:**

    - `model`: the float model.
    - `rules`: a list of [`eqx_quant.Rule`][]s, e.g. `recipe("w4a8_g32")["rules"]`; then the keyword arguments
        `weights`, `activations`, `where`, `matmul`, `products`, `match` and `backward` must be left as they are.
    - `weights`: the weight quantizer of each layer. One of: a quantizer module (shared by every layer; quantizers
        hold no per-layer state unless learned); a factory `f(path, layer) -> quantizer | None`; a mapping from
        patterns to either, where the first matching pattern wins and an unmatched layer gets `None`; or `None` for
        float weights. By default 8 bits, one scale per output channel.
    - `activations`: the input quantizer of each `Linear` and `Conv`, in the same forms; by default 8 bits per
        tensor.
    - `where`: which layers to quantize: `None` for all, a pattern, or a predicate `f(path, layer) -> bool`.
    - `matmul`: `"int"` for the integer forward where the quantizers allow it, `"float"` for the float product of the
        fake-quantized operands.
    - `products`: the quantizers of the products of two activations (see Attention above): a quantizer (for both
        operands), a pair `(lhs_quant, rhs_quant)`, a factory `f(path, module)` returning either (or `None`), a
        mapping from patterns to them, or `None` (the default) to keep them in floating point.
    - `match`: `"search"` (default) or `"full"`: how the patterns of the keyword arguments match paths.
    - `subclasses`: `"error"`, `"skip"` or `"wrap"`: what to do with subclasses of the float layers that override
        `__call__` (see Subclasses above).
    - `backward`: an [`eqx_quant.QuantizedBackward`][] for every [`eqx_quant.nn.QuantLinear`][] whose weight and
        input are both on integer grids (with `matmul="int"`): their input's gradient is then an integer product
        (which changes the gradient contract). A layer so configured whose quantizers cannot run the integer forward
        (an input quantizer per channel, say) raises a `ValueError` when called. Or an
        [`eqx_quant.UnquantizedBackward`][] for every `QuantLinear` and [`eqx_quant.nn.QuantConv`][]: their gradients
        are then the float layer's at the original operands (Qwix's contract; no learned quantizers).
    - `example`: to also quantize the products written with the model's own arrays (see above): a tuple of arguments
        for one call `model(*example)` (arrays or `jax.ShapeDtypeStruct`s), or a function `f(model)` that calls it
        (for keyword arguments, `lambda m: m(x, key=key)`). Only shapes and dtypes matter; nothing is computed.

    **Returns:**

    The model with the selected layers wrapped; with `example`, and traced weights that the configuration reaches,
    that model inside an [`eqx_quant.nn.QuantTraced`][].

    **Raises:**

    `ValueError` if a rule, `where` or a mapping pattern matches no layer (the message lists the paths), if a pattern
    is not a valid regular expression, if a traced weight enters products that sum over different axes of it, or a
    product inside a `jax.lax.while_loop`, or if the model has no layer to quantize (a model whose layers are all
    quantized already is returned as it is); `TypeError` for a malformed configuration.

    !!! example

        ```python
        import equinox as eqx
        import jax
        import eqx_quant

        mlp = eqx.nn.MLP(4, 2, 8, 2, key=jax.random.key(0))
        qmlp = eqx_quant.quantize(
            mlp,
            # The first matching pattern wins; anchored, so that "layers.0" cannot match "layers.01" or "a.layers.0".
            weights={r"^layers\\.0$": eqx_quant.DynamicFakeQuant(4, axis=0), "": eqx_quant.DynamicFakeQuant(8, axis=0)},
            where=r"^layers\\.[01]$",
        )
        print([type(layer).__name__ for layer in qmlp.layers])  # ['QuantLinear', 'QuantLinear', 'Linear']
        ```
    """
    if matmul not in ("int", "float"):
        raise ValueError(f"`matmul` must be 'int' or 'float', got matmul={matmul!r}.")
    check_backward(backward)
    if isinstance(backward, QuantizedBackward) and matmul != "int":
        raise ValueError(f"`backward` needs the integer forward, matmul='int'; got matmul={matmul!r}.")
    if match not in ("search", "full"):
        raise ValueError(f"`match` must be 'search' or 'full', got match={match!r}.")
    if subclasses not in ("error", "wrap", "skip"):
        raise ValueError(f"`subclasses` must be 'error', 'wrap' or 'skip', got subclasses={subclasses!r}.")
    if rules is not None:
        given = dict(weights=weights, activations=activations, where=where, matmul=matmul, products=products,
                     match=match, backward=backward)  # fmt: skip
        defaults = dict(weights=default_weight_quant(), activations=default_input_quant(), where=None, matmul="int",
                        products=None, match="search", backward=None)  # fmt: skip
        extra = [name for name in given if given[name] != defaults[name]]
        if extra:
            raise ValueError(
                f"`rules` is the whole configuration: leave {', '.join(map(repr, extra))} out of it. A rule holds "
                "its own `matmul`, `products` and `backward`; to leave layers in float, put "
                "`eqx_quant.Rule(pattern, weight=None, input=None)` before the others (a recipe's `keep=` argument "
                "keeps layers at a higher precision)."
            )
        decide, check, reaches = _rule_list(rules)
    else:
        decide, check, reaches = _legacy_rules(weights, activations, where, matmul, products, match, backward)

    # A converted layer holds its float layer without a weight: it is found whole, and left as it is.
    layer_types = FLOAT_LAYERS + (AbstractQuantLayer, AbstractConvertedLayer)
    wants_products = products is not None if rules is None else any(rule.products is not None for rule in rules)
    if isinstance(model, QuantTraced):
        raise ValueError(
            "`model` is an eqx_quant.nn.QuantTraced already; start from the float model "
            "(`eqx_quant.float_model(model)`)."
        )
    layers = nodes(model, layer_types)
    attentions = nodes(model, (eqx.nn.MultiheadAttention, QuantMultiheadAttention)) if wants_products else []
    einsums = nodes(model, (Einsum, QuantEinsum)) if wants_products else []
    converted = [path for path, layer in layers if isinstance(layer, AbstractConvertedLayer)]
    done = [(path, layer) for path, layer in layers if isinstance(layer, AbstractQuantLayer)]
    layers = [(path, layer) for path, layer in layers if isinstance(layer, FLOAT_LAYERS)]
    # The two products of an attention that is not wrapped yet, at the paths they take once it is.
    attentions = [
        (path, QuantMultiheadAttention(m)) for path, m in attentions if isinstance(m, eqx.nn.MultiheadAttention)
    ]
    products_of = [
        (f"{path}.{name}", getattr(m, name), path) for path, m in attentions for name in ("scores", "values")
    ]
    attention_paths = {path for path, _ in nodes(model, (QuantMultiheadAttention,))} if wants_products else set()
    products_of += [(path, m, path.rpartition(".")[0] if path.rpartition(".")[0] in attention_paths else None)
                    for path, m in einsums if isinstance(m, Einsum)]  # fmt: skip
    # The projections of an `eqx.nn.MultiheadAttention` at `a` also answer to `a.attention.query_proj` and so on,
    # their paths once `products` wrap it (as `summary` and the algorithms name them).
    unwrapped = [f"{path}." if path else "" for path, _ in nodes(model, (eqx.nn.MultiheadAttention,))]

    def aliases(path: str) -> tuple[str, ...]:
        return tuple(f"{a}attention.{path[len(a) :]}" for a in unwrapped if path.startswith(a))

    decisions = {}
    for path, layer in layers:
        decision = decide(path, layer, False, aliases(path))
        if decision is not None:
            decisions[path] = decision
    for path, einsum, attention in products_of:
        decision = decide(path, einsum, True)
        if (decision is None or decision.products is None) and attention is not None:
            decision = decide(attention, einsum, True)  # a product's own rule first, else its attention's
        if decision is not None and decision.products is not None:
            decisions[path] = decision
    # A weight normalisation replaces its layer's `weight` at every call (`eqx.tree_at` on the layer): its layer stays
    # the float one, and quantizing it is an error.
    normalised = set()
    for path, norm in nodes(model, (eqx.nn.WeightNorm, eqx.nn.SpectralNorm)):
        inner = f"{path}.layer" if path else "layer"
        normalised.add(inner)
        decision = decisions.get(inner)
        if decision is not None and (decision.weight is not None or decision.input is not None):
            pattern = re.escape(path) + r"\..*" if path else re.escape(inner)  # with `example=`, its own arrays too
            raise ValueError(
                f"Layer {inner!r} is wrapped by the eqx.nn.{type(norm).__name__} at {path or '(the model itself)'!r}, "
                "which replaces the layer's `weight` at every call: a quantized layer computes its product from its "
                f"own weight and cannot take that one. Keep the layer float: a rule `Rule({pattern!r}, weight=None, "
                "input=None)` before the others, or a `where` that leaves it out."
            )
    if subclasses == "error":
        for path, layer in layers:
            if path in decisions and _overrides_call(layer):
                raise ValueError(
                    f"Layer {path!r} is a {type(layer).__name__}, a subclass of {type(layer).__mro__[1].__name__} "
                    "with its own `__call__`, which the quantized wrapper would replace by the base computation. "
                    "Exclude it with `where`, or pass subclasses='skip' (keep it float) or subclasses='wrap'."
                )

    float_backward = []  # layers a `QuantizedBackward` reaches that cannot take it

    def wrap(path: str, layer: Any) -> Any:
        decision = decisions.get(path)
        if decision is None or not isinstance(layer, FLOAT_LAYERS) or path in normalised:
            return layer
        if subclasses == "skip" and _overrides_call(layer):
            return layer
        _check_weight_fits(path, decision.weight, layer)
        _check_input_fits(path, decision.input, layer)
        if isinstance(layer, eqx.nn.Embedding):
            return QuantEmbedding(layer, weight_quant=decision.weight)
        unquantized = decision.backward if isinstance(decision.backward, UnquantizedBackward) else None
        integer = all(integer_grid(q) for q in (decision.weight, decision.input))
        if isinstance(decision.backward, QuantizedBackward) and (isinstance(layer, eqx.nn.Conv) or not integer):
            float_backward.append(path)
        if isinstance(layer, eqx.nn.Conv):
            return QuantConv(
                layer, weight_quant=decision.weight, input_quant=decision.input, matmul=decision.matmul,
                backward=unquantized,
            )  # fmt: skip
        return QuantLinear(
            layer, weight_quant=decision.weight, input_quant=decision.input, matmul=decision.matmul,
            backward=decision.backward if integer else unquantized,
        )  # fmt: skip

    # The layers are wrapped first and the products traced on the wrapped model, so that the products the wrapped
    # layers compute are theirs (a quantized attention's, say), at quantize time as at every call.
    wrapped = map_nodes(model, layer_types, wrap)
    if float_backward:
        warnings.warn(
            f"`QuantizedBackward` computes the backward products of linear layers whose weight and input are both on "
            f"integer grids: the layers at {float_backward} (convolutions, or operands not both on such grids) keep "
            "the float backward of the fake-quantized operands.",
            stacklevel=caller_stacklevel(),
        )
    if wants_products:
        wrapped = _wrap_products(wrapped, decisions)
    traced, activations, problems, operands = _traced_products(wrapped, example)
    if not (layers or done or converted or attentions or einsums or traced or activations or problems):
        found = " nor, tracing `example`, a product of one of its arrays" if example is not None else ""
        raise ValueError(
            "`model` contains no eqx.nn.Linear, eqx.nn.Conv or eqx.nn.Embedding layer (nor, with `products`, an "
            f"Einsum or MultiheadAttention{found}) to quantize. Products written with bare arrays (`x @ W.T`, "
            "`jnp.einsum`), and those of eqx.nn.ConvTranspose, GRUCell and LSTMCell layers, are found with "
            "`example=`."
        )
    if products is not None or (rules is not None and wants_products):
        if not attentions and not einsums and not activations:
            found = "nor, tracing `example`, a product of two activations" if example is not None else (
                "and products written with `jnp.einsum` or `@` are found only with `example=`")  # fmt: skip
            raise ValueError(
                "The configuration gives products quantizers, but `model` has no eqx_quant.nn.Einsum nor "
                f"eqx.nn.MultiheadAttention, {found}."
            )
    if example is None and not callable(where):  # a predicate chooses for itself, and reads layers of its own kind
        untraced = [
            f"{path or 'the model itself'!r} ({type(node).__name__})"
            for path, node in nodes(model, (*TRACED_ONLY, QuantTraced))  # not inside a traced model
            if isinstance(node, TRACED_ONLY)
            and any(reaches(join_path(path, w), node) for w in ("weight", "weight_ih", "weight_hh"))
        ]
        if untraced:
            warnings.warn(
                f"`quantize` leaves in floating point the layers it quantizes only by tracing their products: "
                f"{', '.join(untraced)}. Pass `example=` (an example call of the model) to quantize them too, or "
                "leave them out of the configuration's patterns.",
                stacklevel=caller_stacklevel(),
            )
    if converted:
        warnings.warn(
            f"The layers at {converted} are converted already (their weights stored as codes, by "
            "`eqx_quant.convert`) and stay as they are; to quantize them anew, start from the float model.",
            stacklevel=caller_stacklevel(),
        )
    reached = [path for path, layer in done if reaches(path, layer)]
    if reached:
        warnings.warn(
            f"The layers at {reached} are quantized already and keep their quantizers; to quantize them anew, "
            "start from the float model (`eqx_quant.float_model(model)`).",
            stacklevel=caller_stacklevel(),
        )
    if not (layers or products_of or traced or activations or problems):
        return model  # every layer is quantized already
    chosen_weight = lambda d: d is not None and (d.weight is not None or d.input is not None)  # noqa: E731
    unquantizable = []  # weights that a rule reaches, which their reads keep in floating point
    for path, (product, why) in problems.items():
        decision = decide(path, product, False)
        if chosen_weight(decision):
            raise ValueError(why)
        if decision is not None and not decision.kept_float:
            unquantizable.append(path)
    if unquantizable:
        warnings.warn(
            f"The rules reach the model's arrays {unquantizable}, which reach their products through operations "
            "other than views of them (a gather, as of experts chosen per token; a concatenation; arithmetic): no "
            "scale layout follows them there, and they stay in floating point (`summary` lists them). A rule "
            "`Rule(path, weight=None, input=None)` keeps them so without this warning.",
            stacklevel=caller_stacklevel(),
        )
    unreached = []  # traced weights that no rule reaches
    for path, product in traced.items():
        decision = decide(path, product, False)
        if decision is None:
            unreached.append(path)
        if chosen_weight(decision):
            assert decision is not None
            if decision.backward is not None:
                raise ValueError(
                    f"The rule reaching the traced weight {path!r} sets `backward`, which applies to "
                    "eqx_quant.nn.QuantLinear and QuantConv layers only; traced products keep the gradient of the "
                    "float product of their quantized operands. Leave it out of that rule."
                )
            decisions[path] = decision
    if wants_products:
        for product in activations:
            decision = decide(product.path, product, True)
            if decision is not None and decision.products is not None:
                decisions[product.path] = decision
    paths = [path for path, _ in layers] + [path for path, _, _ in products_of] + list(traced) + list(problems)
    paths += [product.path for product in activations] if wants_products else []
    check(paths)
    if not decisions:
        raise ValueError("The configuration reaches none of the layers" + _candidates_message(paths))
    chosen = [(path, decisions[path]) for path in traced if path in decisions]
    pairs = [(k, decisions[p.path].products) for k, p in enumerate(activations) if p.path in decisions]
    if not chosen and not pairs:
        if unreached:
            warnings.warn(
                f"`example` found products of the model's own arrays {unreached}, but no rule of the configuration "
                "reaches them: they stay in floating point, and `quantize` returns the model with its layers "
                "quantized alone. Add rules for their paths (a recipe's rules reach every path), or leave "
                "`example` out.",
                stacklevel=caller_stacklevel(),
            )
        return wrapped
    weights = tuple(None if d.weight is None else weight_layout(d.weight, traced[path]) for path, d in chosen)
    for (path, _), quantizer in zip(chosen, weights, strict=True):
        layout, shape = getattr(quantizer, "layout", None), traced[path].weight.shape
        if isinstance(layout, Layout):  # here, not when the model first runs, where the error named no weight
            what = f"Traced weight {path!r}: its weight quantizer does not fit it, of shape {shape}"
            _check_layout(layout, shape, what)
    inputs = tuple(d.input for _, d in chosen)
    per_token = tuple(_per_token(d.input, traced[path]) for path, d in chosen)
    for (path, decision), tokens in zip(chosen, per_token, strict=True):
        if not tokens:  # per-token inputs are laid out at each product
            _check_fits(path, decision.input, operands[path])
    stacks = tuple(traced[path].stack for path, _ in chosen)
    matmuls = tuple(d.matmul for _, d in chosen)
    quantizers = tuple(q if isinstance(q, tuple) else (q, q) for _, q in pairs)
    pairings = tuple(traced[path].pairing for path, _ in chosen)
    left = tuple(path for path in (*traced, *problems) if path not in decisions)
    shapes = tuple((activations[k].input_shape, activations[k].rhs_shape) for k, _ in pairs)
    for (k, _), pair, operand_shapes in zip(pairs, quantizers, shapes, strict=True):
        for side, quantizer, shape in zip(("lhs", "rhs"), pair, operand_shapes, strict=True):
            layout = getattr(quantizer, "layout", None)
            if not isinstance(layout, Layout):
                continue
            # Its axes against the operand's rank; not its tiles against the example's lengths, which may be shorter
            # than a call's.
            widened = tuple(n * (layout.group_size or 1) for n in shape)
            what = f"The {side} quantizer of products.{k} ({layout}) does not fit its {side} operand, of shape {shape}"
            _check_layout(layout, widened, what)
    return QuantTraced(wrapped, weights, inputs, tuple(path for path, _ in chosen), stacks, matmuls, quantizers,
                       tuple(k for k, _ in pairs), len(activations), pairings, per_token, None, left,
                       shapes)  # fmt: skip


def _per_token(quantizer: object, product: TracedProduct) -> bool:
    """Whether an input quantizer has one dynamic scale per token of its (first) product: per index of the axes of
    the activation operand that the product does not sum over, as `LayerQuantizer(..., per_token=True)` makes it
    (directly or inside a factory). `QuantTraced` then lays its scales out along each call's tokens."""
    if not isinstance(quantizer, DynamicFakeQuant) or product.primitive != "dot_general":
        return False
    layout, ndim, tokens = quantizer.layout, len(product.input_shape), product.input_free
    if layout.group_size is not None or layout.stacked or not tokens or any(not -ndim <= a < ndim for a in layout.axes):
        return False
    return tuple(sorted(a % ndim for a in layout.axes)) == tokens


def _check_fits(path: str, quantizer: object, operands: list[tuple[tuple[int, ...], tuple[int, ...]]]) -> None:
    """Raises a `ValueError` if the input quantizer of the traced weight at `path` does not fit the activation operand
    of one of its products (`operands`: their shapes and summed axes)."""
    layout = getattr(quantizer, "layout", None)
    if layout is None:
        return
    for shape, contracted in operands:
        try:
            layout.view_shape(shape)
        except ValueError as error:
            raise ValueError(
                f"The input quantizer of the traced weight {path!r} ({layout}) does not fit the input of one of its "
                f"products (shape {shape}, summed over its axes {contracted}): {error} A weight whose products take "
                "inputs of different ranks needs an input quantizer that fits them all, such as one scale per tensor: "
                f"a rule `Rule({path!r}, input=eqx_quant.DynamicFakeQuant(8))` before the others."
            ) from None


def _axis_name_note(error: BaseException) -> str:
    """For an error naming an unbound axis: how to trace a model whose layers read a named axis of a `jax.vmap`."""
    if not (isinstance(error, NameError) and "unbound axis name" in str(error)):
        return ""
    return (
        " A model whose layers read a named axis (such as `eqx.nn.BatchNorm(..., axis_name=...)` in training mode) "
        "needs it bound: pass `example` as a function of the model that calls it on a small batch under "
        "`jax.vmap(..., axis_name=...)`, or trace the model in inference mode (`eqx.nn.inference_mode`)."
    )


def _traced_products(model: PyTree, example: object) -> tuple[
    dict[str, TracedProduct], list[TracedProduct], dict[str, tuple[TracedProduct, str]],
    dict[str, list[tuple[tuple[int, ...], tuple[int, ...]]]],
]:  # fmt: skip
    """The traced weights of `model` (outside its layers) called as `example` says, by path (each weight's first
    product), its products of two activations, the weights that cannot be quantized product by product (a product
    inside a while loop, operations that are not views, products summing over different axes) with why, and the
    shapes and summed axes of the activation operands of each weight's products."""
    if example is None:
        return {}, [], {}, {}
    call = trace_call(example)
    excluded = [path for path, _ in nodes(model, layer_types())]
    found: dict[str, TracedProduct] = {}
    try:
        traced = find_products(model, call, excluded)
    except Exception as error:
        given = (
            "the function `example`" if callable(example) else f"`model(*example)` with `example` {shapes_of(example)}"
        )
        error.add_note(
            f"eqx_quant: raised tracing {given}. `example` is one call of the model as it runs: for a model written "
            "for one example (mapped over a batch with `jax.vmap`), one example's arguments, without the batch axis."
            + _axis_name_note(error)
        )
        raise
    problems = dict(traced.problems)
    operands: dict[str, list[tuple[tuple[int, ...], tuple[int, ...]]]] = {}
    for product in traced.weights:
        if product.path in problems:
            continue
        operands.setdefault(product.path, []).append((product.input_shape, product.input_contracted))
        first = found.setdefault(product.path, product)
        if first.stack != product.stack:  # stepped through in one product and not in another: one set of inputs
            found[product.path] = first = dataclasses.replace(first, stack=())
        if first.pairing != product.pairing:  # paired otherwise with another product's input: no one matrix
            found[product.path] = first = dataclasses.replace(first, pairing=None)
        if first.contracted != product.contracted:
            problems[product.path] = (first, (
                f"The weight {product.path!r} enters two products that sum over different axes of it: "
                f"{first.describe()}; and {product.describe()}. One quantized leaf has one scale layout; leave it out "
                f"of the rules (a rule `Rule({product.path!r}, weight=None, input=None)` before the others keeps it "
                "float), or write one of the products with a copy of the weight."
            ))  # fmt: skip
    return {path: p for path, p in found.items() if path not in problems}, traced.activations, problems, operands


def _check_weight_fits(path: str, quantizer: object, layer: Any) -> None:
    """A `ValueError` naming the layer for a weight quantizer whose layout does not fit the layer's weight (a group
    size that does not divide the tiled axis), and a `TypeError` for a weight that is not floating, raised here
    rather than when the model first runs."""
    layout, weight = getattr(quantizer, "layout", None), getattr(layer, "weight", None)
    try:
        check_floating_weight(layer, quantizer)
    except TypeError as error:
        raise TypeError(f"Layer {path!r}: {error}") from None
    if not isinstance(layout, Layout) or not eqx.is_array(weight):
        return
    # A quantizer of stacked layers sees one layer's weight, unless its layout has the stacked axes itself.
    shape = weight.shape if layout.stacked else weight.shape[stack_depth(layer, weight.shape) :]
    _check_layout(layout, shape, f"Layer {path!r}: its weight quantizer does not fit its weight")


def _check_layout(layout: Layout, shape: tuple[int, ...], what: str) -> None:
    """A `ValueError` saying `what` and why, where `layout` does not fit an array of `shape`."""
    try:
        layout.view_shape(shape)
    except ValueError as error:
        raise ValueError(f"{what}: {error}") from None


def _check_input_fits(path: str, quantizer: object, layer: Any) -> None:
    """A `ValueError` naming the layer for an input quantizer whose layout does not fit a linear layer's input (one
    example, `(in_features,)`), raised here rather than when the model first runs."""
    layout = getattr(quantizer, "layout", None)
    if not isinstance(layout, Layout) or layout.stacked or not isinstance(layer, eqx.nn.Linear):
        return
    shape = () if layer.in_features == "scalar" else (layer.in_features,)
    _check_layout(layout, shape, f"Layer {path!r}: its input quantizer does not fit its input, of shape {shape}")


def _wrap_products(model: PyTree, decisions: dict[str, _Decision]) -> PyTree:
    """`model` with the einsums and attentions that `decisions` gives product quantizers wrapped."""

    def product(path: str, einsum: Einsum) -> Einsum | QuantEinsum:
        decision = decisions.get(path)
        if decision is None:
            return einsum
        quantizers = decision.products
        lhs, rhs = quantizers if isinstance(quantizers, tuple) else (quantizers, quantizers)
        return QuantEinsum(einsum, lhs_quant=lhs, rhs_quant=rhs, matmul=decision.matmul)  # pyright: ignore

    def wrap_attention(path: str, module: Any) -> Any:
        if not isinstance(module, eqx.nn.MultiheadAttention):
            return module
        wrapped = QuantMultiheadAttention(module)
        scores, values = product(f"{path}.scores", wrapped.scores), product(f"{path}.values", wrapped.values)
        if scores is wrapped.scores and values is wrapped.values:
            return module
        return QuantMultiheadAttention(module, scores=scores, values=values)

    model = map_nodes(model, (eqx.nn.MultiheadAttention, QuantMultiheadAttention), wrap_attention)
    return map_nodes(model, (Einsum, QuantEinsum), lambda path, m: product(path, m) if isinstance(m, Einsum) else m)


def float_model(model: PyTree) -> PyTree:
    """Replaces every quantized layer by the float layer it wraps: the inverse of [`eqx_quant.quantize`][].

    **Arguments:**

    - `model`: a model containing [`eqx_quant.nn.QuantLinear`][], [`eqx_quant.nn.QuantConv`][],
        [`eqx_quant.nn.QuantEmbedding`][], [`eqx_quant.nn.QuantEinsum`][] or
        [`eqx_quant.nn.QuantMultiheadAttention`][] modules.

    **Returns:**

    The float model, whose leaves are exactly the wrapped layers' leaves (after training, the trained ones), except
    the weight of a layer with an input transform `T` ([`eqx_quant.smoothquant`][], [`eqx_quant.awq`][],
    [`eqx_quant.rotate`][]), which becomes `layer.weight @ T`: the weight that computes on the input what the
    transformed layer computed in floating point (the float weight it was made from, to rounding error, unless
    `awq` clipped it: its clipping, `clip=True`, stays). A
    [`eqx_quant.nn.QuantTraced`][] becomes its model, each traced weight float (its stored codes dequantized) and,
    with an input transform, restored alike along the axes its products sum over. A converted layer (of
    [`eqx_quant.convert`][]) becomes its float layer with the dequantized weight: the fake-quantized weight it was
    converted from, bit for bit (restored alike with an input transform).
    """

    def unwrap(path: str, module: Any) -> Any:
        del path
        if isinstance(module, QuantEinsum):
            return module.einsum
        layer = module.dequantized_layer() if isinstance(module, AbstractConvertedLayer) else module.layer
        transform = getattr(module, "input_transform", None)
        if transform is not None:
            return eqx.tree_at(lambda l: l.weight, layer, restored(transform, layer.weight))
        return layer

    model = map_nodes(model, (QuantTraced,), lambda path, module: module.float_model())
    model = map_nodes(model, (AbstractQuantLayer, AbstractConvertedLayer, QuantEinsum), unwrap)
    return map_nodes(model, (QuantMultiheadAttention,), lambda path, module: module.attention)


def dequantize(model: PyTree) -> PyTree:
    """An alias of [`eqx_quant.float_model`][] (the name of earlier releases)."""
    return float_model(model)
