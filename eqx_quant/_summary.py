"""A table of what a quantized or converted model quantizes, with which format, and at what size."""

import dataclasses
import math
from typing import Any

import equinox as eqx
import jax
import numpy as np
from jaxtyping import PyTree

from ._layout import Layout
from ._qarray import QuantizedArray
from ._quantizers import AbstractFakeQuantizer, AbstractQuantizer, DynamicFakeQuant, FakeQuant, LearnedFakeQuant
from ._traced import TRACED_ONLY, QuantTraced, leaves_by_path
from ._tree import join_path, nodes
from .nn._converted import AbstractConvertedLayer
from .nn._einsum import QuantEinsum
from .nn._layers import AbstractQuantLayer, per_layer, stack_depth


_FLOAT_LAYERS = (eqx.nn.Linear, eqx.nn.Conv, eqx.nn.Embedding)


def _layout(layout: Layout) -> str:
    if layout.group_size is not None:
        return f"tiles of {layout.group_size} along axis {layout.group_axis}"
    if layout.axes:
        return f"per channel (axis {layout.axis})"
    return "per tensor"


def describe_quantizer(quantizer: AbstractQuantizer | None) -> str:
    """A quantizer in a few words: its format, kind (static, dynamic or learned; asymmetric where it has a zero
    point) and layout (`"float"` for none)."""
    if quantizer is None:
        return "float"
    if not isinstance(quantizer, AbstractFakeQuantizer):
        return type(quantizer).__name__
    kind = {FakeQuant: "static", DynamicFakeQuant: "dynamic", LearnedFakeQuant: "learned"}.get(type(quantizer), "")
    if _asymmetric(quantizer):
        kind += " asymmetric"
    return f"{quantizer.format.name} {kind}, {_layout(quantizer.layout)}".replace(" ,", ",")


def _asymmetric(quantizer: AbstractFakeQuantizer) -> bool:
    """Whether the quantizer has a zero point (other than 0)."""
    if isinstance(quantizer, FakeQuant):
        return any(zp != 0 for zp in jax.tree.leaves(quantizer.zero_point))
    if isinstance(quantizer, DynamicFakeQuant):
        return not quantizer.symmetric
    return getattr(quantizer, "zero_point", None) is not None


def _nbytes(tree: Any) -> int:
    return sum(math.prod(leaf.shape) * np.dtype(leaf.dtype).itemsize for leaf in jax.tree.leaves(tree))


@dataclasses.dataclass(frozen=True)
class SummaryRow:
    """One layer or product of a [`eqx_quant.Summary`][]: `path`, `kind` (its type), the `weight` and `input`
    quantizers in words, the weight's `bits` per element (`None` in float), and its bytes in float (`float_bytes`) and
    as stored (`stored_bytes`: the converted model's codes and scales; `None` where there is no weight)."""

    path: str
    kind: str
    weight: str
    input: str
    bits: int | None
    float_bytes: int | None
    stored_bytes: int | None


@dataclasses.dataclass(frozen=True)
class Summary:
    """What [`eqx_quant.summary`][] returns: a row per layer (and product), `rows`, and the totals of their weights'
    bytes. `print` it for a table."""

    rows: tuple[SummaryRow, ...]

    @property
    def float_bytes(self) -> int:
        """The bytes of every weight in float."""
        return sum(row.float_bytes or 0 for row in self.rows)

    @property
    def stored_bytes(self) -> int:
        """The bytes of every weight as a converted model stores it (float weights at their own size)."""
        return sum(row.stored_bytes or 0 for row in self.rows)

    def __str__(self) -> str:
        header = ("path", "kind", "weight", "input", "bits", "float B", "stored B")
        cells = [header] + [
            (r.path or "(model)", r.kind, r.weight, r.input, "-" if r.bits is None else str(r.bits),
             "-" if r.float_bytes is None else f"{r.float_bytes:,}",
             "-" if r.stored_bytes is None else f"{r.stored_bytes:,}")
            for r in self.rows
        ]  # fmt: skip
        quantized = sum(_quantizes(r) for r in self.rows)
        ratio = f" ({self.stored_bytes / self.float_bytes:.1%})" if self.float_bytes else ""  # no weights: no ratio
        cells.append(("total", f"{quantized} of {len(self.rows)} quantized", "", "", "", f"{self.float_bytes:,}",
                      f"{self.stored_bytes:,}{ratio}"))  # fmt: skip
        return text_table(cells, numeric=(4, 5, 6))


def _quantizes(row: SummaryRow) -> bool:
    """Whether `row` quantizes anything: its weight, its input, or an operand of its product (whatever its kind: a
    float subclass of a layer counts as float)."""
    described = [row.weight.removeprefix("tied, "), *row.input.rsplit(", then ", 1)[-1].split(" x ")]
    return any(d not in ("float", "tied", "-") for d in described)


def text_table(cells: list[tuple[str, ...]], numeric: tuple[int, ...]) -> str:
    """`cells` (a header, rows, a total) as aligned text columns, the `numeric` ones right-aligned, with rules under
    the header and above the total."""
    widths = [max(len(row[i]) for row in cells) for i in range(len(cells[0]))]
    lines = [
        "  ".join(
            c.rjust(w) if i in numeric else c.ljust(w) for i, (c, w) in enumerate(zip(row, widths, strict=True))
        ).rstrip()
        for row in cells
    ]
    rule = "  ".join("-" * w for w in widths)
    return "\n".join([lines[0], rule, *lines[1:-1], rule, lines[-1]])


def _with_transform(row: SummaryRow, layer: Any) -> SummaryRow:
    """`row` of a layer with an input transform: named before its input quantizer, its arrays counted as stored."""
    transform = getattr(layer, "input_transform", None)
    if transform is None:
        return row
    extra = _transform_bytes(transform)
    stored = None if row.stored_bytes is None else row.stored_bytes + extra
    return dataclasses.replace(row, input=f"{type(transform).__name__}, then {row.input}", stored_bytes=stored)


def _transform_bytes(transform: Any) -> int:
    return sum(leaf.size * leaf.dtype.itemsize for leaf in jax.tree.leaves(transform))


def _row(path: str, layer: Any) -> SummaryRow:
    return _with_transform(_layer_row(path, layer), layer)


def _layer_row(path: str, layer: Any) -> SummaryRow:
    kind = type(layer).__name__
    if isinstance(layer, QuantEinsum):
        operands = f"{describe_quantizer(layer.lhs_quant)} x {describe_quantizer(layer.rhs_quant)}"
        return SummaryRow(path, kind, "-", operands, None, None, None)
    if isinstance(layer, AbstractConvertedLayer):
        w = layer.qweight
        float_bytes = math.prod(w.values.shape[: w.stack_depth]) * math.prod(w.shape) * np.dtype(w.dtype).itemsize
        inputs = describe_quantizer(layer.input_quant) if not isinstance(layer.layer, eqx.nn.Embedding) else "-"
        weight = f"{w.format.name}, {_layout(w.layout)}"
        return SummaryRow(path, kind, weight, inputs, w.format.bits, float_bytes, w.nbytes)
    float_layer = layer.layer if isinstance(layer, AbstractQuantLayer) else layer
    weight = float_layer.weight
    inputs = "-" if isinstance(float_layer, eqx.nn.Embedding) else "float"
    if isinstance(layer, AbstractQuantLayer) and not isinstance(float_layer, eqx.nn.Embedding):
        inputs = describe_quantizer(layer.input_quant)
    if not eqx.is_array(weight):  # the placeholder of an `eqx.nn.Shared` tie: the weight is another layer's
        quantizer = layer.weight_quant if isinstance(layer, AbstractQuantLayer) else None
        tied = "tied" if quantizer is None else f"tied, {describe_quantizer(quantizer)}"  # quantized again here
        return SummaryRow(path, kind, tied, inputs, None, None, None)
    float_bytes = weight.size * weight.dtype.itemsize
    if not isinstance(layer, AbstractQuantLayer):
        return SummaryRow(path, kind, "float", inputs, None, float_bytes, float_bytes)
    quantizer = layer.weight_quant
    if not isinstance(quantizer, AbstractFakeQuantizer):
        return SummaryRow(path, kind, describe_quantizer(quantizer), inputs, None, float_bytes, float_bytes)
    depth = stack_depth(float_layer, weight.shape)
    stored = eqx.filter_eval_shape(per_layer(lambda q, w: q.quantize_array(w), depth), quantizer, weight)
    return SummaryRow(path, kind, describe_quantizer(quantizer), inputs, quantizer.format.bits, float_bytes,
                      _nbytes(stored))  # fmt: skip


def summary(model: PyTree) -> Summary:
    """A table of the layers of a model (float, quantized or converted): for each `Linear`, `Conv` and `Embedding`
    (and each quantized product of activations, and each traced weight of an [`eqx_quant.nn.QuantTraced`][], kind
    `traced`, and its quantized products of two activations, kind `traced product`), its path, kind, weight and
    input quantizers, the weight's bits per element, and the weight's bytes in float and as a converted model stores
    it (codes, scales and zero points), with the totals. A `ConvTranspose`, `GRUCell` or `LSTMCell` that is not
    traced (which [`eqx_quant.quantize`][] reaches only with `example=`) has a float row of its own, its bytes those
    of its weights. Rows come in the model's order (the traced weights' last); the printed total counts those that
    quantize a weight, an input or an operand.

    It reads only the model's structure and the shapes of its arrays (the stored sizes of a fake-quantized model are
    worked out without quantizing anything), so it is cheap for any model.

    **Arguments:**

    - `model`: any model: float, from [`eqx_quant.quantize`][], or from [`eqx_quant.convert`][].

    **Returns:**

    A [`eqx_quant.Summary`][]: `print` it for the table; its `rows`, `float_bytes` and `stored_bytes` hold the
    figures. A linear layer with an input transform ([`eqx_quant.smoothquant`][], [`eqx_quant.awq`][],
    [`eqx_quant.rotate`][]) names it before its input quantizer, and its stored bytes count the transform's arrays.

    !!! example

        ```python
        import equinox as eqx
        import jax
        import eqx_quant

        mlp = eqx.nn.MLP(64, 10, 64, 2, key=jax.random.key(0))
        qmlp = eqx_quant.quantize(mlp, **eqx_quant.recipe("w4a8_g32", keep=r"layers\\.2"))
        table = eqx_quant.summary(qmlp)
        print(table.stored_bytes, table.float_bytes)  # 5800 35328
        print(table)
        ```
    """
    traced = nodes(model, (QuantTraced,))
    traced_weights = {join_path(root, "model", leaf)
                      for root, module in traced for leaf in module.weight_paths}  # fmt: skip
    covered = set()  # the weights of the float layers that have rows of their own
    rows = []
    for path, layer in nodes(model, _FLOAT_LAYERS + TRACED_ONLY + (AbstractQuantLayer, AbstractConvertedLayer,
                                                                        QuantEinsum)):  # fmt: skip
        if not isinstance(layer, TRACED_ONLY):
            rows.append(_row(path, layer))
            continue
        names = [name for name in ("weight", "weight_ih", "weight_hh") if hasattr(layer, name)]
        if not any(join_path(path, name) in traced_weights for name in names):  # else its traced weights have rows
            rows.append(_untraced_row(path, layer, [getattr(layer, name) for name in names]))
            covered.update(join_path(path, name) for name in names)
    for path, module in traced:
        rows += _traced_rows(path, module, covered)
    return Summary(tuple(rows))


def _untraced_row(path: str, layer: Any, weights: list[Any]) -> SummaryRow:
    """The float row of a layer of `TRACED_ONLY` whose `weights` are not traced."""
    if not all(eqx.is_array(w) for w in weights):  # the placeholder of an `eqx.nn.Shared` tie
        return SummaryRow(path, type(layer).__name__, "tied", "float", None, None, None)
    size = sum(w.size * w.dtype.itemsize for w in weights)
    return SummaryRow(path, type(layer).__name__, "float", "float", None, size, size)


def _traced_rows(path: str, traced: QuantTraced, covered: set[str]) -> list[SummaryRow]:
    """A row per traced weight of a [`eqx_quant.nn.QuantTraced`][] at `path`, named by the leaf's path in it, and
    per weight it leaves float (but those of `covered`, whose layers have rows)."""
    leaves = leaves_by_path(traced.model)
    rows = []
    for leaf_path, quantizer, inputs, transform, per_token in zip(
        traced.weight_paths, traced.weight_quants, traced.input_quants, traced.input_transforms, traced.per_token,
        strict=True,
    ):  # fmt: skip
        weight, extra = leaves[leaf_path], 0
        name = join_path(path, "model", leaf_path)
        if per_token and isinstance(inputs, DynamicFakeQuant):  # laid out at each product: one scale per token
            inputs = f"{inputs.format.name} dynamic, per token"
        else:
            inputs = describe_quantizer(inputs)
        if transform is not None:  # named before the input quantizer, its arrays counted as stored (as a layer's)
            extra = _transform_bytes(transform)
            inputs = f"{type(transform).__name__}, then {inputs}"
        if isinstance(weight, QuantizedArray):
            float_bytes = math.prod(weight.shape) * np.dtype(weight.dtype).itemsize
            rows.append(SummaryRow(name, "traced (converted)", f"{weight.format.name}, {_layout(weight.layout)}",
                                   inputs, weight.format.bits, float_bytes, weight.nbytes + extra))  # fmt: skip
            continue
        float_bytes = weight.size * weight.dtype.itemsize
        if not isinstance(quantizer, AbstractFakeQuantizer):
            rows.append(SummaryRow(name, "traced", describe_quantizer(quantizer), inputs, None, float_bytes,
                                   float_bytes + extra))  # fmt: skip
            continue
        stored = eqx.filter_eval_shape(lambda q, w: q.quantize_array(w), quantizer, weight)
        rows.append(SummaryRow(name, "traced", describe_quantizer(quantizer), inputs, quantizer.format.bits,
                               float_bytes, _nbytes(stored) + extra))  # fmt: skip
    for leaf_path in traced.float_paths:  # found multiplied with activations, left in floating point
        name = join_path(path, "model", leaf_path)
        size = leaves[leaf_path].size * leaves[leaf_path].dtype.itemsize
        if name not in covered:
            rows.append(SummaryRow(name, "traced", "float", "float", None, size, size))
    shapes = traced.product_shapes or ((None, None),) * len(traced.product_indices)
    for k, (lhs, rhs), (lhs_shape, rhs_shape) in zip(
        traced.product_indices, traced.product_quants, shapes, strict=True
    ):
        name = join_path(path, f"products.{k}")
        if lhs_shape is None:
            operands = f"{describe_quantizer(lhs)} x {describe_quantizer(rhs)}"
        else:  # which operand is which: `jnp.einsum` may take them in the other order than written
            operands = f"lhs {lhs_shape}: {describe_quantizer(lhs)}; rhs {rhs_shape}: {describe_quantizer(rhs)}"
        rows.append(SummaryRow(name, "traced product", "-", operands, None, None, None))
    return rows
