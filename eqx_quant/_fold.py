"""Where a per-channel factor on a layer's input can be folded into the model: layers whose input is a
normalisation's output `a * γ` or `a * γ + β` (`γ`, `β` array leaves of the model, one entry per channel), read by
those layers only. Found on the model's program (its jaxpr), so that any normalisation written that way is found:
`eqx.nn.LayerNorm`, `eqx.nn.RMSNorm` and a model's own."""

from collections.abc import Iterator
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


class _Mark(AbstractInputTransform):
    """Marks a layer's input in the model's program (an identity that XLA keeps, inside a named scope): used only
    to trace the model, never to run it."""

    path: str = eqx.field(static=True)

    def __call__(self, x: Array) -> Array:
        with jax.named_scope(f"{_SCOPE}[{self.path}]"):
            return jax.lax.optimization_barrier(x)

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
    """A value that is a view of the model's leaf `path` (broadcast, cast; sliced by a scan), the leaf's last axis at
    `axis` of the value."""

    path: str
    axis: int


def _marked_layer(eqn: Any) -> str | None:
    """The layer whose input `eqn` marks, if it is a mark."""
    if eqn.primitive.name != "optimization_barrier":
        return None
    stack = str(eqn.source_info.name_stack)
    start = stack.rfind(f"{_SCOPE}[")
    if start < 0:
        return None
    return stack[start + len(_SCOPE) + 1 : stack.index("]", start)]


def _inner(eqn: Any) -> Iterator[tuple[Any, list]]:
    """The sub-programs of `eqn`, each with the outer values its inputs take (None where a value is not one of
    `eqn`'s operands as it is: a scan's carries)."""
    if eqn.primitive.name == "scan":
        body = eqn.params["jaxpr"].jaxpr
        consts, carries = eqn.params["num_consts"], eqn.params["num_carry"]
        outer: list = list(eqn.invars)
        outer[consts : consts + carries] = [None] * carries
        yield body, [("scan", v) if i >= consts + carries else v for i, v in enumerate(outer)]
        return
    if eqn.primitive.name == "cond":
        for branch in eqn.params["branches"]:
            yield branch.jaxpr, list(eqn.invars[1:])
        return
    if eqn.primitive.name == "while":
        return  # not followed: a value read at every step of a loop
    for value in eqn.params.values():
        jaxpr = value.jaxpr if isinstance(value, jex.ClosedJaxpr) else value
        if isinstance(jaxpr, jex.Jaxpr) and len(jaxpr.invars) == len(eqn.invars):
            yield jaxpr, list(eqn.invars)


def find_folds(model: PyTree, targets: list[str], batch: PyTree, batched: bool) -> list[Fold]:
    """The groups of `targets` (paths of `QuantLinear` layers of `model`) whose input is a normalisation's output
    `a * γ (+ β)` that nothing else reads, with `γ` and `β` leaves of one entry per input channel (per layer of a
    stack) used nowhere else, found in the program of one call on `batch` (as calibration calls the model)."""
    chosen = set(targets)

    def mark(path: str, layer: QuantLinear) -> QuantLinear:
        if path not in chosen:
            return layer
        return eqx.tree_at(lambda l: l.input_transform, layer, _Mark(path), is_leaf=lambda x: x is None)

    dynamic, static = eqx.partition(map_nodes(model, (QuantLinear,), mark), eqx.is_array)
    paths = [path_string(p) for p, _ in jax.tree_util.tree_flatten_with_path(dynamic)[0]]

    def call(d: PyTree, b: PyTree) -> PyTree:
        m = eqx.combine(d, static)
        return m(b) if batched else jax.vmap(m)(b)

    closed = jax.make_jaxpr(call)(dynamic, batch)
    origins = {v: _Origin(p, v.aval.ndim - 1) for v, p in zip(closed.jaxpr.invars, paths, strict=False)}
    uses: dict[str, int] = {}  # per leaf: the operations (other than views) that read it
    found: list[tuple[Any, Any, dict]] = []  # per program: (jaxpr, its marks by operand, its origins)

    def walk(jaxpr: Any, origins: dict) -> None:
        marks: dict = {}
        for eqn in jaxpr.eqns:
            layer = _marked_layer(eqn)
            if layer is not None:
                marks.setdefault(eqn.invars[0], []).append(layer)
            viewed = [origins.get(v) if isinstance(v, jex.Var) else None for v in eqn.invars]
            name = eqn.primitive.name
            if name == "convert_element_type" and viewed[0] is not None:
                origins[eqn.outvars[0]] = viewed[0]
                continue
            if name == "broadcast_in_dim" and viewed[0] is not None:
                axis = eqn.params["broadcast_dimensions"][viewed[0].axis]
                origins[eqn.outvars[0]] = viewed[0]._replace(axis=axis)
                continue
            subs = list(_inner(eqn))
            for sub, outer in subs:
                inner = {}
                for v, o in zip(sub.invars, outer, strict=True):
                    sliced = isinstance(o, tuple)
                    o = o[1] if sliced else o
                    if isinstance(o, jex.Var) and o in origins and not (sliced and origins[o].axis == 0):
                        inner[v] = origins[o]._replace(axis=origins[o].axis - sliced)
                walk(sub, inner)
            if not subs:
                for origin in {o.path for o in viewed if o is not None}:
                    uses[origin] = uses.get(origin, 0) + 1
        found.append((jaxpr, marks, origins))

    walk(closed.jaxpr, origins)
    folds = []
    for jaxpr, marks, origins in found:
        producers = {v: e for e in jaxpr.eqns for v in e.outvars}
        readers: dict = {}
        for eqn in jaxpr.eqns:
            for v in eqn.invars:
                if isinstance(v, jex.Var):
                    readers[v] = readers.get(v, 0) + 1
        for v in jaxpr.outvars:
            if isinstance(v, jex.Var):
                readers[v] = readers.get(v, 0) + 1
        for value, layers in marks.items():
            if readers.get(value) != len(layers):
                continue  # something besides the chosen layers reads it
            fold = _affine(value, producers, readers, origins, uses)
            if fold is not None:
                folds.append(Fold(fold[0], fold[1], tuple(layers)))
    return folds


def _affine(value: Any, producers: dict, readers: dict, origins: dict, uses: dict) -> tuple[str, str | None] | None:
    """`(γ, β)` if `value` is `a * γ + β` or `a * γ` (`β` None), each a per-channel view of a leaf read by that
    operation alone, and the intermediate product read by the sum alone."""
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
    a, b = eqn.invars
    gamma = per_channel(b) if per_channel(b) is not None else per_channel(a)
    return None if gamma is None else (gamma, beta)


def scale_leaves(model: PyTree, factors: dict[str, Array]) -> PyTree:
    """`model` with each leaf at a path of `factors` multiplied by its factor (in the leaf's dtype)."""
    leaves, treedef = jax.tree_util.tree_flatten_with_path(model)
    new = []
    for path, leaf in leaves:
        factor = factors.get(path_string(path))
        new.append(leaf if factor is None else (leaf * jnp.asarray(factor, leaf.dtype)).astype(leaf.dtype))
    return jax.tree_util.tree_unflatten(treedef, new)
