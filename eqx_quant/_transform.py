import re
from collections.abc import Callable, Mapping
from typing import Any, Literal, TypeAlias

import equinox as eqx
from jaxtyping import PyTree

from ._quantizers import AbstractQuantizer
from ._tree import map_nodes, nodes
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


def _resolve(name: str, spec: object, path: str, layer: eqx.Module) -> AbstractQuantizer | None:
    if spec is None or isinstance(spec, AbstractQuantizer):
        return spec
    if isinstance(spec, Mapping):
        for pattern, value in spec.items():
            if re.search(pattern, path):
                if isinstance(value, Mapping):
                    raise TypeError(f"`{name}` mappings cannot be nested, got {value!r} under {pattern!r}.")
                return _resolve(name, value, path, layer)
        return None
    if callable(spec):
        quantizer = spec(path, layer)
        if quantizer is not None and not isinstance(quantizer, AbstractQuantizer):
            raise TypeError(f"The `{name}` factory returned {quantizer!r} for layer {path!r}, not a quantizer or None.")
        return quantizer
    raise TypeError(f"`{name}` must be a quantizer, a factory, a mapping from patterns to them, or None; got {spec!r}.")


def _selector(where: Where) -> Callable[[str, eqx.Module], bool]:
    if where is None:
        return lambda path, layer: True
    if isinstance(where, str):
        pattern = _compiled("where", where)
        return lambda path, layer: pattern.search(path) is not None
    if callable(where):
        return where
    raise TypeError(f"`where` must be None, a regular expression or a predicate on (path, layer), got {where!r}.")


def quantize(
    model: PyTree,
    *,
    weights: QuantizerSpec = default_weight_quant(),
    activations: QuantizerSpec = default_input_quant(),
    where: Where = None,
    matmul: Literal["int", "float"] = "int",
) -> PyTree:
    """Replaces the layers of a model by their quantized wrappers.

    Every `eqx.nn.Linear`, `eqx.nn.Conv` (any dimensionality) and `eqx.nn.Embedding` in `model` (or only those that
    `where` selects) becomes a [`eqx_quant.nn.QuantLinear`][], [`eqx_quant.nn.QuantConv`][] or
    [`eqx_quant.nn.QuantEmbedding`][] holding the original layer. The model can be any PyTree: nested modules, lists,
    tuples, dicts, `eqx.nn.Sequential`, `eqx.nn.MLP`; every other leaf is kept as it is (shardings included), and
    layers that are already quantized are left alone.

    Layers are named by their path in the PyTree, as a dotted string: `layers.0` for the first layer of an
    `eqx.nn.MLP`, `blocks.1.conv` for `model.blocks[1].conv`, `heads.key` for a dict entry.

    **Patterns.** A layer pattern (a key of a `weights` or `activations` mapping, or a string `where`) is a regular
    expression *searched* anywhere in the path (`re.search`): `r"layers\\.1"` selects `layers.1`, but also
    `layers.10` and `encoder.layers.1.conv`. Anchor it to name one layer: `r"^layers\\.1$"`.

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
    select = _selector(where)
    _check_patterns("weights", weights)
    _check_patterns("activations", activations)
    layers = nodes(model, _FLOAT_LAYERS + (AbstractQuantLayer,))
    if not layers:
        raise ValueError("`model` contains no eqx.nn.Linear, eqx.nn.Conv or eqx.nn.Embedding layer to quantize.")
    candidates = [(path, layer) for path, layer in layers if isinstance(layer, _FLOAT_LAYERS)]
    if not candidates:
        return model  # every layer is quantized already
    chosen = {path for path, layer in candidates if select(path, layer)}
    if not chosen:
        raise ValueError(
            f"`where`={where!r} matches none of the layers; the candidate paths are: "
            + ", ".join(repr(path) for path, _ in candidates)
            + "."
        )

    def wrap(path: str, layer: Any) -> Any:
        if path not in chosen or isinstance(layer, AbstractQuantLayer):
            return layer
        weight_quant = _resolve("weights", weights, path, layer)
        if isinstance(layer, eqx.nn.Embedding):
            return QuantEmbedding(layer, weight_quant=weight_quant)
        input_quant = _resolve("activations", activations, path, layer)
        wrapper = QuantLinear if isinstance(layer, eqx.nn.Linear) else QuantConv
        return wrapper(layer, weight_quant=weight_quant, input_quant=input_quant, matmul=matmul)

    return map_nodes(model, _FLOAT_LAYERS + (AbstractQuantLayer,), wrap)


def dequantize(model: PyTree) -> PyTree:
    """Replaces every quantized layer by the float layer it wraps: the inverse of [`eqx_quant.quantize`][].

    **Arguments:**

    - `model`: a model containing [`eqx_quant.nn.QuantLinear`][], [`eqx_quant.nn.QuantConv`][] or
        [`eqx_quant.nn.QuantEmbedding`][] layers.

    **Returns:**

    The float model, whose leaves are exactly the wrapped layers' leaves (after training, the trained ones).
    """
    return map_nodes(model, (AbstractQuantLayer,), lambda path, layer: layer.layer)
