"""Traced weights as linear layers: the products of a traced weight (of [`eqx_quant.nn.QuantTraced`][]) seen as one
linear layer on the matrix `as_matrix` lays the weight out as, so that the per-layer input transforms (SmoothQuant,
AWQ, rotations) apply to them; and their results put back into the traced model."""

import dataclasses
from collections.abc import Callable
from typing import Any, NamedTuple

import equinox as eqx
import jax
from jaxtyping import PyTree

from ._layout import Layout
from ._misc import where_traced
from ._observe import add_batch_note
from ._qarray import QuantizedArray
from ._quantizers import AbstractQuantizer, DynamicFakeQuant
from ._traced import QuantTraced, as_matrix, from_matrix, leaves_by_path, probe_batches, probe_reads, replaced
from ._tree import join_path, map_nodes, nodes, path_string
from .nn._layers import QuantLinear


class TracedLayer(NamedTuple):
    """A traced weight chosen for an input transform: where it lives, and how it lies as a matrix."""

    root: str  # the QuantTraced's path in the model
    index: int  # the weight's index in it
    path: str  # the leaf's path in the QuantTraced's model
    depth: int  # the stack axes a scan steps through
    pairing: tuple[int, ...]  # the contracted leaf axes, in the order of the matrix's columns
    shape: tuple[int, ...]


def _matrix_quantizer(quantizer: AbstractQuantizer | None, shape: tuple[int, ...], depth: int,
                      pairing: tuple[int, ...]) -> AbstractQuantizer | None | bool:  # fmt: skip
    """The traced weight's quantizer as the matrix's (one layer of a stack's, as a stacked layer's quantizer sees
    it): per tensor (per layer of a stack), per row (per index of the weight's other axes) or in tiles along the
    columns (its one contracted axis); `False` where the quantizer's layout is none of those or it is not a dynamic
    quantizer."""
    if quantizer is None:
        return None
    if not isinstance(quantizer, DynamicFakeQuant) or quantizer.layout.stacked:
        return False
    layout, ndim = quantizer.layout, len(shape)
    axes = tuple(sorted(a % ndim for a in layout.axes))
    if layout.group_size is None and axes == tuple(range(depth)):
        return dataclasses.replace(quantizer, layout=Layout())
    if layout.group_size is None and axes == tuple(a for a in range(ndim) if a not in pairing):
        return dataclasses.replace(quantizer, layout=Layout(axes=(0,)))
    if layout.group_size is not None and not axes and (layout.group_axis % ndim,) == pairing:
        return dataclasses.replace(quantizer, layout=Layout(group_size=layout.group_size, group_axis=-1))
    return False


def traced_reads(model: PyTree, batch: PyTree, batched: bool, which: str = "the first batch") -> dict[str, str | None]:
    """By traced weight path, whether the model's call on `batch` reads the weight as the weight of whole products
    alone (traced, not run): see `probe_reads`."""
    return traced_probes(model, batch, batched, which)[0]


def traced_probes(
    model: PyTree, batch: PyTree, batched: bool, which: str = "the first batch"
) -> tuple[dict[str, str | None], dict[str, set]]:
    """`traced_reads`, and by traced weight path the batch axes of its products (`probe_batches`), from one trace
    of the model's call on `batch`."""
    with probe_reads() as reads, probe_batches() as batches:
        try:
            eqx.filter_eval_shape(lambda m, b: m(b) if batched else jax.vmap(m)(b), model, batch)
        except Exception as error:
            add_batch_note(error, batch, batched, which)
            raise
    return reads, batches


def _why_left(traced: QuantTraced, i: int, leaf: Any, matrix_quant: Any, reads: dict[str, str | None] | None,
              where: Callable | None, what: str) -> str | None:  # fmt: skip
    """Why `what` cannot transform the traced weight `i` (whose leaf is `leaf`, whose matrix's quantizer is
    `matrix_quant`, read by the model as `reads` says: `None` if not traced), or `None` if it can."""
    transform, input_quant, weight_quant = traced.input_transforms[i], traced.input_quants[i], traced.weight_quants[i]
    if isinstance(leaf, QuantizedArray):
        return "is stored as codes (converted): transform the model before `convert`"
    if traced.pairings[i] is None:
        return ("has products that do not pair the axes they sum over one to one with their input's (a convolution, "
                "a reshape merging summed axes)")  # fmt: skip
    if transform is not None:
        return f"already has the input transform {type(transform).__name__}"
    if input_quant is not None and not isinstance(input_quant, DynamicFakeQuant):
        return (f"has the input quantizer {type(input_quant).__name__}, whose scales were fitted to the input as it "
                f"is: run `{what}` before `calibrate`")  # fmt: skip
    if matrix_quant is False:
        layout = getattr(weight_quant, "layout", None)
        return (f"has the weight quantizer {type(weight_quant).__name__} (layout {layout}); `{what}` needs a "
                "dynamic one (before `gptq`, `learn_scales`), per tensor (per layer of a stack), per index of the "
                "weight's axes that its products do not sum over, or in tiles along the one axis they sum "
                "over")  # fmt: skip
    if reads is None and where is not None:  # no batch: on trust where `where` chose it
        return None
    if reads is None:
        return "is taken only where `where` chooses it or a `batch` is given to find how the model reads it"
    read = reads.get(traced.weight_paths[i], "unused")
    if read == "stray":
        return ("is read by the model otherwise than as the weight of products summing over its contracted axes whole "
                "(a tied embedding's gather, arithmetic, a reversal, padding or rounding of it, a slice or split of "
                "those axes, a scan's carry): that read would see the transformed weight")  # fmt: skip
    if read == "unused":
        return "is in none of the products that the model computes on the first batch: it has no statistics"
    return None


def traced_layers(
    model: PyTree,
    where: Callable | None,
    default: Callable[[AbstractQuantizer | None, AbstractQuantizer | None], bool],
    what: str,
    wanted: str,
    batch: PyTree | None,
    batched: bool,
    which: str = "the first batch",
) -> tuple[list[tuple[str, QuantLinear]], dict[str, TracedLayer], dict[str, str]]:
    """The traced weights of `model` that `what` transforms, each as a stack of linear layers (named
    `<root>.model.<path>`, its weight the matrix of `as_matrix`, its quantizers the traced weight's), where they lie;
    and the traced weights left as they are, with why. Chosen: those `where(name, weight)` selects, else those whose
    quantizers `default(weight_quant, input_quant)` keeps (`wanted` says which, in the errors). A chosen weight that
    cannot be transformed (`_why_left`) is a `ValueError` if `where` chose it, else left out with its reason. `batch`
    is traced to find the weights the model reads besides their products; without it (`None`), only the weights
    `where` chooses are taken, on trust (a call that reads one otherwise is then a `ValueError`), and the others are
    left out."""
    found = [(root, traced, i) for root, traced in nodes(model, (QuantTraced,))
             for i in range(len(traced.weight_paths))]  # fmt: skip
    reads = traced_reads(model, batch, batched, which) if batch is not None and found else None
    leaves = {root: leaves_by_path(traced.model) for root, traced, _ in found}
    chosen, where_of, left = [], {}, {}
    for root, traced, i in found:
        path = traced.weight_paths[i]
        name = join_path(root, "model", path)
        leaf = leaves[root][path]
        weight_quant, input_quant = traced.weight_quants[i], traced.input_quants[i]
        if where is None and not default(weight_quant, input_quant):
            continue
        if where is not None and not where_traced(where, name, leaf):
            continue
        if not default(weight_quant, input_quant):  # chosen by `where`
            raise ValueError(f"Traced weight {name!r} is not a traced weight {wanted}, so `{what}` would do nothing "
                             "for it. Exclude it with `where`.")  # fmt: skip
        depth, pairing, shape = len(traced.stacks[i]), traced.pairings[i], tuple(getattr(leaf, "shape", ()))
        matrix_quant = _matrix_quantizer(weight_quant, shape, depth, pairing) if pairing is not None else False
        why = _why_left(traced, i, leaf, matrix_quant, reads, where, what)
        if why is not None:
            if where is not None:
                raise ValueError(f"Traced weight {name!r} {why}; `{what}` cannot transform it. Exclude it with "
                                 "`where`.")  # fmt: skip
            left[name] = why
            continue
        weight = as_matrix(leaf, depth, pairing)  # pyright: ignore[reportArgumentType]
        skeleton = eqx.filter_eval_shape(eqx.nn.Linear, weight.shape[-1], weight.shape[-2], use_bias=False,
                                         key=jax.random.key(0))  # fmt: skip
        linear = eqx.tree_at(lambda l: l.weight, skeleton, weight)
        chosen.append((name, QuantLinear(linear, weight_quant=matrix_quant, input_quant=input_quant)))
        where_of[name] = TracedLayer(root, i, path, depth, pairing, shape)  # pyright: ignore[reportArgumentType]
    return chosen, where_of, left


def put_traced(model: PyTree, where_of: dict[str, TracedLayer], done: dict[str, QuantLinear]) -> PyTree:
    """`model` with each traced weight of `done` (named as `traced_layers` names them) holding its layer's weight,
    laid out as the leaf, and its input transform."""
    by_root: dict[str, dict[int, tuple[TracedLayer, QuantLinear]]] = {}
    for name, layer in done.items():
        place = where_of[name]
        by_root.setdefault(place.root, {})[place.index] = (place, layer)

    def put(root: str, traced: QuantTraced) -> QuantTraced:
        mine = by_root.get(root, {})
        if not mine:
            return traced
        paths = {place.path: (place, layer) for place, layer in mine.values()}

        def leaf(key_path, x):
            found = paths.get(path_string(key_path))
            if found is None:
                return x
            place, layer = found
            return from_matrix(layer.layer.weight, place.shape, place.depth, place.pairing).astype(x.dtype)

        transforms = list(traced.input_transforms)
        for i, (_, layer) in mine.items():
            transforms[i] = layer.input_transform
        inner = jax.tree_util.tree_map_with_path(leaf, traced.model)
        return replaced(traced, model=inner, input_transforms=transforms)

    return map_nodes(model, (QuantTraced,), put)
