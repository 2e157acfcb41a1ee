import re
from collections.abc import Callable, Mapping
from typing import Any, Literal, TypeAlias

import equinox as eqx
from jaxtyping import PyTree

from ._backward import QuantizedBackward
from ._quantizers import AbstractFakeQuantizer, AbstractQuantizer
from ._tree import map_nodes, nodes
from .nn._attention import Einsum, QuantEinsum, QuantMultiheadAttention
from .nn._layers import (
    AbstractQuantLayer,
    QuantConv,
    QuantEmbedding,
    QuantLinear,
    default_input_quant,
    default_weight_quant,
)


Factory: TypeAlias = Callable[[str, eqx.Module], AbstractQuantizer | None]
QuantizerSpec: TypeAlias = AbstractQuantizer | Factory | Mapping[str, "AbstractQuantizer | Factory | None"] | None
Where: TypeAlias = Callable[[str, eqx.Module], bool] | str | None
Pair: TypeAlias = tuple[AbstractQuantizer | None, AbstractQuantizer | None]
ProductSpec: TypeAlias = (
    AbstractQuantizer | Pair | Callable[[str, eqx.Module], Any] | Mapping[str, "AbstractQuantizer | Pair | None"] | None
)

_FLOAT_LAYERS = (eqx.nn.Linear, eqx.nn.Conv, eqx.nn.Embedding)


def _compiled(name: str, pattern: object) -> re.Pattern:
    """`pattern` compiled, or a `ValueError` naming the argument it came from."""
    if not isinstance(pattern, str):
        raise TypeError(f"The layer patterns of `{name}` must be strings, got {pattern!r}.")
    try:
        return re.compile(pattern)
    except re.error as error:
        raise ValueError(f"`{name}`: {pattern!r} is not a valid regular expression ({error}).") from None


def _check_patterns(name: str, spec: object) -> None:
    if isinstance(spec, Mapping):
        for pattern in spec:
            _compiled(name, pattern)


def _matches(pattern: str, path: str, match: str) -> bool:
    return (re.fullmatch if match == "full" else re.search)(pattern, path) is not None


def _is_pair(value: object) -> bool:
    return (
        isinstance(value, tuple)
        and len(value) == 2
        and all(v is None or isinstance(v, AbstractQuantizer) for v in value)
    )


def _resolve(name: str, spec: object, path: str, layer: eqx.Module, match: str = "search", pairs: bool = False) -> Any:
    """The quantizer (or, with `pairs`, the quantizer or pair of quantizers) that `spec` gives the layer at `path`."""
    if spec is None or isinstance(spec, AbstractQuantizer) or (pairs and _is_pair(spec)):
        return spec
    if isinstance(spec, Mapping):
        for pattern, value in spec.items():
            if _matches(pattern, path, match):
                if isinstance(value, Mapping):
                    raise TypeError(f"`{name}` mappings cannot be nested, got {value!r} under {pattern!r}.")
                return _resolve(name, value, path, layer, match, pairs)
        return None
    if callable(spec):
        quantizer = spec(path, layer)
        if not (quantizer is None or isinstance(quantizer, AbstractQuantizer) or (pairs and _is_pair(quantizer))):
            kind = "a quantizer, a pair of them or None" if pairs else "a quantizer or None"
            raise TypeError(f"The `{name}` factory returned {quantizer!r} for layer {path!r}, not {kind}.")
        return quantizer
    kind = "a quantizer, a pair of them" if pairs else "a quantizer"
    raise TypeError(f"`{name}` must be {kind}, a factory, a mapping from patterns to them, or None; got {spec!r}.")


def _selector(where: Where, match: str) -> Callable[[str, eqx.Module], bool]:
    if where is None:
        return lambda path, layer: True
    if isinstance(where, str):
        _compiled("where", where)
        return lambda path, layer: _matches(where, path, match)
    if callable(where):
        return where
    raise TypeError(f"`where` must be None, a regular expression or a predicate on (path, layer), got {where!r}.")


_EXACT = (eqx.nn.Linear, eqx.nn.Conv, eqx.nn.Conv1d, eqx.nn.Conv2d, eqx.nn.Conv3d, eqx.nn.Embedding)


def _overrides_call(layer: eqx.Module) -> bool:
    """Whether `layer`'s class is a subclass of a float layer that computes its own forward pass (which the quantized
    wrapper, running the base layer's computation, would silently replace)."""
    if type(layer) in _EXACT:
        return False
    base = next(cls for cls in _EXACT[::-1] if isinstance(layer, cls))
    return type(layer).__call__ is not base.__call__


def quantize(
    model: PyTree,
    *,
    weights: QuantizerSpec = default_weight_quant(),
    activations: QuantizerSpec = default_input_quant(),
    where: Where = None,
    matmul: Literal["int", "float"] = "int",
    products: ProductSpec = None,
    match: Literal["search", "full"] = "search",
    subclasses: Literal["error", "wrap", "skip"] = "error",
    backward: QuantizedBackward | None = None,
) -> PyTree:
    """Replaces the layers of a model by their quantized wrappers.

    Every `eqx.nn.Linear`, `eqx.nn.Conv` (any dimensionality) and `eqx.nn.Embedding` in `model` (or only those that
    `where` selects) becomes a [`eqx_quant.nn.QuantLinear`][], [`eqx_quant.nn.QuantConv`][] or
    [`eqx_quant.nn.QuantEmbedding`][] holding the original layer. The model can be any PyTree: nested modules, lists,
    tuples, dicts, `eqx.nn.Sequential`, `eqx.nn.MLP`; every other leaf is kept as it is (shardings included), and
    layers that are already quantized are left alone.

    Layers are named by their path in the PyTree, as a dotted string: `layers.0` for the first layer of an
    `eqx.nn.MLP`, `blocks.1.conv` for `model.blocks[1].conv`, `heads.key` for a dict entry.

    **Patterns.** A layer pattern (a key of a `weights`, `activations` or `products` mapping, or a string `where`)
    is a regular expression *searched* anywhere in the path (`re.search`) by default: `r"layers\\.1"` selects
    `layers.1`, but also `layers.10` and `encoder.layers.1.conv`. Anchor it to name one layer
    (`r"^layers\\.1$"`), or pass `match="full"`, with which every pattern must match the whole path
    (`re.fullmatch`), as in rule-based configurations of other toolkits.

    **Attention.** The products of two activations are quantized when `products` is given: every
    [`eqx_quant.nn.Einsum`][] in the model (write attention's `QKᵀ` and softmax·V with it) becomes a
    [`eqx_quant.nn.QuantEinsum`][], and every `eqx.nn.MultiheadAttention` a
    [`eqx_quant.nn.QuantMultiheadAttention`][] whose two products (at `<path>.scores` and `<path>.values`) are
    quantized (its four projections are linear layers, quantized like any other, at
    `<path>.attention.query_proj` and so on once wrapped). Without `products`, both stay in floating point.

    **Subclasses.** A subclass of `eqx.nn.Linear`, `eqx.nn.Conv` or `eqx.nn.Embedding` that overrides `__call__`
    computes something the quantized wrapper (which runs the base layer's computation) would not: by default
    (`subclasses="error"`) such a layer raises a `ValueError` naming it; `"skip"` leaves it in floating point and
    `"wrap"` wraps it anyway. Subclasses that keep the base `__call__` are wrapped as usual.

    **Arguments:**

    - `model`: the float model.
    - `weights`: the weight quantizer of each layer. One of: a quantizer module (shared by every layer; quantizers
        hold no per-layer state unless learned); a factory `f(path, layer) -> quantizer | None`; a mapping from
        patterns (regular expressions searched in the path, see above) to either, where the first matching pattern
        wins and an unmatched layer gets `None`; or `None` for float weights. By default 8 bits, one scale per output
        channel.
    - `activations`: the input quantizer of each `Linear` and `Conv`, in the same forms; by default 8 bits per
        tensor. Embeddings take integer indices and never get one.
    - `where`: which layers to quantize: `None` for all, a pattern (a regular expression searched in the path, see
        above), or a predicate `f(path, layer) -> bool`.
    - `matmul`: the `matmul` of every [`eqx_quant.nn.QuantLinear`][] and [`eqx_quant.nn.QuantConv`][]: `"int"` for
        the integer forward where the quantizers allow it, `"float"` for the float product of the fake-quantized
        operands.
    - `products`: the quantizers of the products of two activations (see Attention above): a quantizer (for both
        operands), a pair `(lhs_quant, rhs_quant)`, a factory `f(path, module)` returning either (or `None`), a
        mapping from patterns to them, or `None` (the default) to keep them in floating point.
    - `match`: `"search"` (default) or `"full"`: how layer patterns match paths (see Patterns above).
    - `subclasses`: `"error"`, `"skip"` or `"wrap"`: what to do with subclasses of the float layers that override
        `__call__` (see Subclasses above).
    - `backward`: an [`eqx_quant.QuantizedBackward`][] for every [`eqx_quant.nn.QuantLinear`][] whose weight and
        input both have an integer quantizer (with `matmul="int"`): their input's gradient is then an integer
        product (which changes the gradient contract). `None` (the default) keeps the float backward everywhere;
        convolutions always keep it. A layer so configured whose quantizers cannot run the integer forward (an
        input quantizer per channel, say) raises a `ValueError` when called. Layers that are already quantized
        are left as they are, their `backward` included.

    **Returns:**

    The model with the selected layers wrapped.

    **Raises:**

    `ValueError` if `where` selects no layer (the message lists the candidate paths), if a pattern is not a valid
    regular expression, or if the model has no layer to quantize (a model whose layers are all quantized already is
    returned as it is); `TypeError` for a malformed `weights`, `activations` or `where`.

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
    if backward is not None and not isinstance(backward, QuantizedBackward):
        raise TypeError(f"`backward` must be a QuantizedBackward or None, got backward={backward!r}.")
    if backward is not None and matmul != "int":
        raise ValueError(f"`backward` needs the integer forward, matmul='int'; got matmul={matmul!r}.")
    if match not in ("search", "full"):
        raise ValueError(f"`match` must be 'search' or 'full', got match={match!r}.")
    if subclasses not in ("error", "wrap", "skip"):
        raise ValueError(f"`subclasses` must be 'error', 'wrap' or 'skip', got subclasses={subclasses!r}.")
    select = _selector(where, match)
    for name, spec in (("weights", weights), ("activations", activations), ("products", products)):
        _check_patterns(name, spec)
    layer_types = _FLOAT_LAYERS + (AbstractQuantLayer,)
    product_types = (Einsum, eqx.nn.MultiheadAttention) if products is not None else ()
    found = nodes(model, layer_types) + (nodes(model, product_types) if product_types else [])
    if not found:
        raise ValueError(
            "`model` contains no eqx.nn.Linear, eqx.nn.Conv or eqx.nn.Embedding layer (nor, with `products`, an "
            "Einsum or MultiheadAttention) to quantize."
        )
    candidates = [(path, layer) for path, layer in found if not isinstance(layer, AbstractQuantLayer)]
    if not candidates:
        return model  # every layer is quantized already
    chosen = {path for path, layer in candidates if select(path, layer)}
    if not chosen:
        raise ValueError(
            f"`where`={where!r} matches none of the layers; the candidate paths are: "
            + ", ".join(repr(path) for path, _ in candidates)
            + "."
        )
    if subclasses == "error":
        for path, layer in candidates:
            if path in chosen and isinstance(layer, _FLOAT_LAYERS) and _overrides_call(layer):
                raise ValueError(
                    f"Layer {path!r} is a {type(layer).__name__}, a subclass of {type(layer).__mro__[1].__name__} "
                    "with its own `__call__`, which the quantized wrapper would replace by the base computation. "
                    "Exclude it with `where`, or pass subclasses='skip' (keep it float) or subclasses='wrap'."
                )

    def wrap(path: str, layer: Any) -> Any:
        if path not in chosen or not isinstance(layer, _FLOAT_LAYERS):
            return layer
        if subclasses == "skip" and _overrides_call(layer):
            return layer
        weight_quant = _resolve("weights", weights, path, layer, match)
        if isinstance(layer, eqx.nn.Embedding):
            return QuantEmbedding(layer, weight_quant=weight_quant)
        input_quant = _resolve("activations", activations, path, layer, match)
        if isinstance(layer, eqx.nn.Conv):
            return QuantConv(layer, weight_quant=weight_quant, input_quant=input_quant, matmul=matmul)
        integer = all(isinstance(q, AbstractFakeQuantizer) for q in (weight_quant, input_quant))
        return QuantLinear(
            layer, weight_quant=weight_quant, input_quant=input_quant, matmul=matmul,
            backward=backward if integer else None,
        )  # fmt: skip

    model = map_nodes(model, layer_types, wrap)
    if products is None:
        return model

    def wrap_attention(path: str, module: Any) -> Any:
        if path not in chosen or not isinstance(module, eqx.nn.MultiheadAttention):
            return module
        return QuantMultiheadAttention(module)

    def wrap_product(path: str, module: Any) -> Any:
        if isinstance(module, QuantEinsum) or not (path in chosen or path.rpartition(".")[0] in chosen):
            return module
        quantizers = _resolve("products", products, path, module, match, pairs=True)
        if quantizers is None:
            return module
        lhs, rhs = quantizers if isinstance(quantizers, tuple) else (quantizers, quantizers)
        return QuantEinsum(module, lhs_quant=lhs, rhs_quant=rhs, matmul=matmul)

    model = map_nodes(model, (eqx.nn.MultiheadAttention, QuantMultiheadAttention), wrap_attention)
    return map_nodes(model, (Einsum, QuantEinsum), wrap_product)


def dequantize(model: PyTree) -> PyTree:
    """Replaces every quantized layer by the float layer it wraps: the inverse of [`eqx_quant.quantize`][].

    **Arguments:**

    - `model`: a model containing [`eqx_quant.nn.QuantLinear`][], [`eqx_quant.nn.QuantConv`][] or
        [`eqx_quant.nn.QuantEmbedding`][] layers.

    **Returns:**

    The float model, whose leaves are exactly the wrapped layers' leaves (after training, the trained ones).
    """
    return map_nodes(model, (AbstractQuantLayer,), lambda path, layer: layer.layer)
