"""Where a per-channel factor on a layer's input can be folded into the model: layers whose input is a
normalisation's output `a * γ` or `a * γ + β` (`γ`, `β` array leaves of the model, one entry per channel), read by
those layers only. Found on the model's program (its jaxpr), so that any normalisation written that way is found:
`eqx.nn.LayerNorm`, `eqx.nn.RMSNorm` and a model's own."""

import functools
import itertools
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

import equinox as eqx
import jax
import jax.numpy as jnp
from jax.extend import core as jex
from jaxtyping import Array, PyTree

from ._tree import map_nodes, path_string
from .nn._layers import QuantLinear
from .nn._transforms import AbstractInputTransform


_SCOPE = "eqx_quant.fold_mark"


@functools.cache
def _marker(index: int) -> Callable[[Array, Array], Array]:
    """The mark of layer `index`: an identity of its input (kept by XLA, inside a named scope holding the index),
    with the layer's weight beside it. Under `jax.vmap` it is marked again with the batch axes in front (JAX moves
    them there for a `custom_vmap` rule), so that in the program the marked operand holds the layer's input channels
    on its last axis, and is the value the model computed only where no axis had to move."""

    @jax.custom_batching.custom_vmap
    def mark(x: Array, weight: Array) -> Array:
        with jax.named_scope(f"{_SCOPE}[{index}]"):
            return jax.lax.optimization_barrier((x, weight))[0]

    @mark.def_vmap
    def rule(axis_size: int, in_batched: list, x: Array, weight: Array) -> tuple[Array, bool]:
        x_batched, weight_batched = in_batched
        x = x if x_batched else jnp.broadcast_to(x, (axis_size, *x.shape))
        weight = weight if weight_batched else jnp.broadcast_to(weight, (axis_size, *weight.shape))
        return mark(x, weight), True

    return mark


class _Mark(AbstractInputTransform):
    """Marks a layer's input in the model's program, with the layer's weight (which tells which layer of a stack a
    call computes with): used only to trace the model, never to run it."""

    weight: Array
    index: int = eqx.field(static=True)

    def __call__(self, x: Array) -> Array:
        return _marker(self.index)(x, self.weight)

    def absorb(self, weight: Array) -> Array:
        return weight

    def restore(self, weight: Array) -> Array:
        return weight


class Fold(NamedTuple):
    """Layers whose common input is `a * γ (+ β)`: the paths of the leaves `γ` and `β` (or None) and of the layers."""

    gamma: str
    beta: str | None
    layers: tuple[str, ...]


class _Origin(NamedTuple):
    """A value that is a view of the model's leaf `path` (broadcast, cast; sliced by scans), the leaf's last axis at
    `axis` of the value; `scans` the scan operations that sliced it (at their step's index), outermost first."""

    path: str
    axis: int
    scans: tuple[int, ...] = ()


class _Call(NamedTuple):
    """A marked call of a layer: the walk of the program it is in, its input, and the origin of its weight."""

    walk: int
    value: Any
    weight: _Origin | None


def _marked_layer(eqn: Any) -> int | None:
    """The index of the layer whose input `eqn` marks, if it is a mark (the `custom_vmap` call around the named
    barrier)."""
    if eqn.primitive.name != "custom_vmap_call":
        return None
    for inner in eqn.params["call"].jaxpr.eqns:
        stack = str(inner.source_info.name_stack)
        start = stack.rfind(f"{_SCOPE}[")
        if inner.primitive.name == "optimization_barrier" and start >= 0:
            start += len(_SCOPE) + 1
            return int(stack[start : stack.index("]", start)])
    return None


def _jaxprs(value: Any) -> Iterator[Any]:
    """The programs in a parameter of an operation (itself, or in a tuple or list of them)."""
    if isinstance(value, (tuple, list)):
        for item in value:
            yield from _jaxprs(item)
    elif isinstance(value, jex.ClosedJaxpr):
        yield value.jaxpr
    elif isinstance(value, jex.Jaxpr):
        yield value


def _inner(eqn: Any) -> Iterator[tuple[Any, list | None]]:
    """The sub-programs of `eqn`, each with, per input, the position of the operand of `eqn` it takes and whether a
    scan slices it (None where no operand is taken as it is: a scan's carries); or with None where the operands are
    not followed into it (a `while` loop's, and any program whose inputs are not the operands one for one)."""
    if eqn.primitive.name == "scan":
        consts, carries = eqn.params["num_consts"], eqn.params["num_carry"]
        operands: list = [(i, i >= consts + carries) for i in range(len(eqn.invars))]
        operands[consts : consts + carries] = [None] * carries
        yield eqn.params["jaxpr"].jaxpr, operands
        return
    if eqn.primitive.name == "cond":
        for branch in eqn.params["branches"]:
            yield branch.jaxpr, [(i, False) for i in range(1, len(eqn.invars))]
        return
    for value in eqn.params.values():
        for jaxpr in _jaxprs(value):
            followed = eqn.primitive.name != "while" and len(jaxpr.invars) == len(eqn.invars)
            yield jaxpr, [(i, False) for i in range(len(eqn.invars))] if followed else None


def find_folds(model: PyTree, targets: list[str], batch: PyTree, batched: bool) -> list[Fold]:
    """The groups of `targets` (paths of `QuantLinear` layers of `model`) whose input is a normalisation's output
    `a * γ (+ β)` that nothing else reads, found in the program of one call on `batch` (as calibration calls the
    model): every call of each layer of a group reads that value (with its input channels on the value's last axis),
    `γ` and `β` are leaves of one entry per input channel read by that operation alone, and in a scan they are
    sliced together with the layers' weights."""
    index = {path: i for i, path in enumerate(targets)}

    def mark(path: str, layer: QuantLinear) -> QuantLinear:
        if path not in index:
            return layer
        marked = _Mark(layer.layer.weight, index[path])
        return eqx.tree_at(lambda l: l.input_transform, layer, marked, is_leaf=lambda x: x is None)

    dynamic, static = eqx.partition(map_nodes(model, (QuantLinear,), mark), eqx.is_array)
    paths = [path_string(p) for p, _ in jax.tree_util.tree_flatten_with_path(dynamic)[0]]

    def call(d: PyTree, b: PyTree) -> PyTree:
        m = eqx.combine(d, static)
        return m(b) if batched else jax.vmap(m)(b)

    closed = jax.make_jaxpr(call)(dynamic, batch)
    top = {v: _Origin(p, v.aval.ndim - 1) for v, p in zip(closed.jaxpr.invars, paths, strict=False)}
    uses: dict[str, int] = {}  # per leaf: the reads of it (or of its views) other than views and sub-programs
    calls: dict[int, list[_Call]] = {}
    walks: list[tuple[Any, dict]] = []  # each walk of a program (one may be walked at several call sites)
    scans = itertools.count()  # a number per scan operation walked

    def read(origin: _Origin | None) -> None:
        if origin is not None:
            uses[origin.path] = uses.get(origin.path, 0) + 1

    def walk(jaxpr: Any, origins: dict) -> None:
        number = len(walks)
        walks.append((jaxpr, origins))
        for eqn in jaxpr.eqns:
            viewed = [origins.get(v) if isinstance(v, jex.Var) else None for v in eqn.invars]
            name, layer = eqn.primitive.name, _marked_layer(eqn)
            if layer is not None:
                calls.setdefault(layer, []).append(_Call(number, eqn.invars[0], viewed[1]))
                continue
            if name == "convert_element_type" and viewed[0] is not None:
                origins[eqn.outvars[0]] = viewed[0]
                continue
            if name == "broadcast_in_dim" and viewed[0] is not None:
                axis = eqn.params["broadcast_dimensions"][viewed[0].axis]
                origins[eqn.outvars[0]] = viewed[0]._replace(axis=axis)
                continue
            passed = set()
            scan = next(scans) if name == "scan" else None
            for sub, operands in _inner(eqn):
                inner = {}
                for v, operand in zip(sub.invars, operands or [], strict=False):
                    if operand is None or viewed[operand[0]] is None:
                        continue
                    position, sliced = operand
                    o = viewed[position]
                    if sliced and o.axis == 0:
                        continue  # the scan runs along the channels: not a per-channel view in the body
                    if sliced:
                        o = o._replace(axis=o.axis - 1, scans=(*o.scans, scan))
                    inner[v] = o
                    passed.add(position)
                walk(sub, inner)
            for position, o in enumerate(viewed):
                if position not in passed:
                    read(o)
        for v in jaxpr.outvars:  # a value the program returns is read by its caller
            read(origins.get(v) if isinstance(v, jex.Var) else None)

    walk(closed.jaxpr, top)
    groups: dict[tuple[int, Any], list[str]] = {}
    for i, layer_calls in calls.items():
        inputs = {(c.walk, c.value) for c in layer_calls}
        if len(inputs) == 1:  # every call of the layer reads one value
            groups.setdefault(next(iter(inputs)), []).append(targets[i])
    folds = []
    for (number, value), layers in groups.items():
        jaxpr, origins = walks[number]
        layer_calls = [c for layer in layers for c in calls[index[layer]]]
        found = _affine(jaxpr, value, len(layer_calls), origins, uses)
        if found is None:
            continue
        if all(c.weight is not None and c.weight.scans == origins[found.view].scans for c in layer_calls):
            folds.append(Fold(found.gamma, found.beta, tuple(layers)))
    return folds


class _Affine(NamedTuple):
    """The leaves of `a * γ + β` (`beta` None for `a * γ`), and the view of `γ` that the product reads."""

    gamma: str
    beta: str | None
    view: Any


def _affine(jaxpr: Any, value: Any, marks: int, origins: dict, uses: dict) -> _Affine | None:
    """`value` as `a * γ + β` or `a * γ` in `jaxpr`, if it is read by the `marks` marked calls alone, each of `γ`,
    `β` a per-channel view of a leaf read by that operation alone, and the intermediate product read by the sum
    alone."""
    producers = {v: e for e in jaxpr.eqns for v in e.outvars}
    readers: dict = {}
    for v in [v for e in jaxpr.eqns for v in e.invars] + list(jaxpr.outvars):
        if isinstance(v, jex.Var):
            readers[v] = readers.get(v, 0) + 1
    if readers.get(value) != marks:
        return None  # something besides the chosen layers reads it
    last = value.aval.ndim - 1

    def per_channel(v: Any) -> str | None:
        o = origins.get(v) if isinstance(v, jex.Var) else None
        if o is None or o.axis != last or uses.get(o.path) != 1 or v.aval.shape[-1] != value.aval.shape[-1]:
            return None
        return o.path if all(d == 1 for d in v.aval.shape[:-1]) else None

    eqn = producers.get(value)
    beta = None
    if eqn is not None and eqn.primitive.name == "add":
        a, b = eqn.invars
        beta, product = (per_channel(b), a) if per_channel(b) is not None else (per_channel(a), b)
        if beta is None or not isinstance(product, jex.Var) or readers.get(product) != 1:
            return None
        eqn = producers.get(product)
    if eqn is None or eqn.primitive.name != "mul":
        return None
    for g in eqn.invars:
        gamma = per_channel(g)
        if gamma is not None:
            return _Affine(gamma, beta, g)
    return None


def scale_leaves(model: PyTree, factors: dict[str, Array]) -> PyTree:
    """`model` with each leaf at a path of `factors` multiplied by its factor (in the leaf's dtype)."""
    leaves, treedef = jax.tree_util.tree_flatten_with_path(model)
    new = []
    for path, leaf in leaves:
        factor = factors.get(path_string(path))
        new.append(leaf if factor is None else (leaf * jnp.asarray(factor, leaf.dtype)).astype(leaf.dtype))
    return jax.tree_util.tree_unflatten(treedef, new)
