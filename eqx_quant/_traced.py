"""Products found by tracing: the weight-by-activation products a model computes with its own array leaves, however
its code writes them (`W @ x`, `x @ W.T`, `jnp.dot`, `jnp.einsum`, `lax.dot_general`, `lax.conv_general_dilated`).

A model's call is traced to a jaxpr with its array leaves as inputs. Each value of the program remembers whether it
is a view of a leaf (through transposes, reshapes, casts, slices, the slicing of `lax.scan` over a stacked leaf,
`jit`, `checkpoint`, `cond` and custom-derivative functions) and which of the leaf's axes its own axes hold. A
`dot_general` or `conv_general_dilated` with such a view as one operand is a product of that weight: the leaf axes it
sums over are the weight's contraction, the others its channels. [`eqx_quant.nn.QuantTraced`][] runs the program
again with those weights quantized at the leaf and the other operand of their products quantized at the product.
"""

import dataclasses
import functools
import math
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import equinox as eqx
import jax
import jax.numpy as jnp
from jax.extend import core as jcore
from jaxtyping import PyTree

from ._format import IntFormat
from ._int_ops import INT32_MAX, any_float64, group_sums, integer_grid, opaque, sum_in_order, unfused
from ._layout import Layout
from ._misc import computed_before, flat, one_program, reshape_blocks, whole_along, whole_batch
from ._qarray import QuantizedArray, quantize_array
from ._quantizers import AbstractQuantizer, DynamicFakeQuant, FakeQuant
from ._scales import Scales
from ._tree import nodes, path_string
from .nn._layers import per_layer


class _View(NamedTuple):
    """A value that is a view of leaf `leaf`: `axes[i]` are the leaf axes that the value's axis `i` spans (none for
    an axis made by broadcasting, several where a reshape merged axes). `sliced` counts the leading leaf axes that
    enclosing `lax.scan`s have sliced off one after the other (the layers of a stack), `None` once a scan sliced
    the leaf along another axis or a slice shortened it. With `axes` `None`, the value is computed from the model's
    arrays (and constants) alone, by operations that are not views (a concatenation, a gather, arithmetic): neither
    a weight that tracing can lay scales out on nor an activation; `also` then holds the other leaves it was
    computed from (the second array of a concatenation), reported with `leaf`."""

    leaf: int
    axes: tuple[tuple[int, ...], ...] | None
    sliced: int | None = 0
    layer: bool = False  # a view of a leaf of a layer that `quantize` wraps as a layer: its products are the layer's
    also: tuple[int, ...] = ()


class TracedProduct(eqx.Module):
    """One product of a model's weight leaf with an activation, as tracing found it; what a rule's factory receives
    as its `layer` argument for a traced weight (see [`eqx_quant.quantize`][]).

    **Fields:**

    - `path`: the weight leaf's path in the model, e.g. `"layers.1.weights"`.
    - `weight`: the leaf (its array).
    - `contracted`: the leaf axes the product sums over (for a convolution, the input channels and the kernel's
        spatial axes); the other axes are the weight's channels (a stacked leaf's layer axis among them).
    - `input_shape`: the shape of the activation operand.
    - `input_contracted`: the axes of the activation operand that the product sums over.
    - `primitive`: `"dot_general"` or `"conv_general_dilated"`.
    - `stack`: the lengths of the weight's leading axes that `jax.lax.scan`s step through before the product (a
        stack of layers, one layer per step), `()` if none.
    - `pairing`: the contracted axes of the weight in the order the product pairs them with `input_contracted`, or
        `None` where that is not one axis to one axis (a reshape merged or split them; a convolution).

    A product of two activations (named `products.k`, for a rule's `products`) is described alike, with `weight`
    `None`: `input_shape` and `input_contracted` describe its left operand, `contracted` the right operand's
    contracted axes, and `rhs_shape` is the right operand's shape. Left and right are the operands of the
    `dot_general` as the program computes it: `jnp.einsum` may take its two operands in the other order than they
    are written (it picks the order that spares a transpose), so a rule's `(lhs, rhs)` pair follows these shapes,
    which [`eqx_quant.summary`][] shows.
    """

    path: str = eqx.field(static=True)
    weight: Any
    contracted: tuple[int, ...] = eqx.field(static=True)
    input_shape: tuple[int, ...] = eqx.field(static=True)
    input_contracted: tuple[int, ...] = eqx.field(static=True)
    primitive: str = eqx.field(static=True)
    stack: tuple[int, ...] = eqx.field(static=True, default=())
    pairing: tuple[int, ...] | None = eqx.field(static=True, default=None)
    rhs_shape: tuple[int, ...] | None = eqx.field(static=True, default=None)

    @property
    def input_free(self) -> tuple[int, ...]:
        """The activation operand's axes that the product does not sum over: one scale per index along them is one
        per token."""
        return free_axes(len(self.input_shape), self.input_contracted)

    @property
    def channels(self) -> tuple[int, ...]:
        """The weight's axes that the product does not sum over: one scale per index along them is one per output
        channel."""
        return tuple(a for a in range(self.weight.ndim) if a not in self.contracted)

    def describe(self) -> str:
        """A one-line description: the primitive, the operand shapes and the contraction."""
        shape = "x".join(map(str, self.weight.shape))
        return (
            f"{self.primitive}: weight {self.path!r} ({shape}) summed over its axes {self.contracted}, input "
            f"{self.input_shape} over {self.input_contracted}"
        )


def free_axes(ndim: int, contracted: Sequence[int]) -> tuple[int, ...]:
    """The axes of an operand of rank `ndim` that a product does not sum over."""
    return tuple(a for a in range(ndim) if a not in contracted)


class _Use(NamedTuple):
    leaf: int
    contracted: tuple[int, ...]
    input_shape: tuple[int, ...]
    input_contracted: tuple[int, ...]
    primitive: str
    loop: bool  # inside a while loop
    sliced: int | None  # the weight's leading axes sliced off by scans (see `_View`)
    eqn: Any = None
    outer: tuple[int, ...] = ()  # the ids of the equations that hold this one (a scan, a jit, ...)
    pairing: tuple[int, ...] | None = None  # the contracted leaf axes, paired in order with `input_contracted`
    batch: tuple[tuple[int, int], ...] = ()  # `(leaf axis, input axis)` of each batch dimension of a dot_general
    also: tuple[int, ...] = ()  # an "unfollowed" use: the other leaves the weight operand was computed from


class _Where(NamedTuple):
    """Where in the program an equation is: inside a while loop, inside one of eqx_quant's own modules (whose products
    are theirs), inside which equations."""

    loop: bool = False
    scoped: bool = False
    outer: tuple[int, ...] = ()


_PRODUCTS = ("dot_general", "conv_general_dilated")
_SAME = frozenset(
    {"convert_element_type", "copy", "copy_p", "neg", "reduce_precision", "optimization_barrier", "stop_gradient"}
)
_SHORTENING = frozenset({"slice", "rev", "pad", "dynamic_slice"})  # the same axes, maybe shorter
_INDEXING = frozenset({"gather", "dynamic_slice", "slice"})  # part of the operand, at the indices given
_CALLS = frozenset({"jit", "pjit", "closed_call", "core_call", "remat2", "checkpoint", "custom_jvp_call",
                    "custom_vjp_call", "custom_vjp_call_jaxpr", "custom_lin"})  # fmt: skip


_CONSTANT = _View(-1, None)  # a value computed from constants alone


def _reshape_axes(src: _View, shape_in: tuple[int, ...], shape_out: tuple[int, ...]) -> _View | None:
    """The view after a reshape: axes that merge or split share their leaf axes; unit axes hold none. `None` where
    it merges axes that hold parts of one leaf axis: those parts may have been put in another order in between (a
    transpose between two reshapes), which a view does not record."""
    axes: list[tuple[int, ...]] = [()] * len(shape_out)
    for group_in, group_out in reshape_blocks(shape_in, shape_out):
        parts = [a for k in group_in for a in src.axes[k]]
        if len(parts) != len(set(parts)):
            return None
        spanned = tuple(sorted(set(parts)))
        for k in group_out:
            axes[k] = spanned
    return src._replace(axes=tuple(axes))


def _derived(eqn: Any, views: list[_View | None]) -> _View | None:
    """The output of an operation that is not a view, if it is computed from the model's arrays and constants alone
    (or indexes into one of them): a derived value, not an activation."""
    operands = [v for v, var in zip(views, eqn.invars, strict=True) if not isinstance(var, jcore.Literal)]
    if eqn.primitive.name in _INDEXING and views and views[0] is not None:
        # Rows of an array picked by indices: derived from it if the indices are, an activation if they depend on
        # the input (an embedding's lookup, and so also a mixture of experts' weights picked by its router).
        indices = [v for v, var in zip(views[1:], eqn.invars[1:], strict=True) if not isinstance(var, jcore.Literal)]
        if any(v is None for v in indices):
            return None
        return _View(views[0].leaf, None, layer=views[0].layer, also=views[0].also)
    if all(v is not None for v in operands):
        leaves = [v for v in operands if v is not None and v.leaf >= 0]
        # Computed from a layer's arrays alone (a learned quantizer's weight and scale): still the layer's.
        layer = bool(leaves) and all(v.layer for v in leaves)
        own = [v for v in leaves if not v.layer] or leaves  # a bare weight is the one to name, not a layer's array
        if not own:
            return _CONSTANT
        indices = dict.fromkeys(i for v in own for i in (v.leaf, *v.also))  # in order, once each
        first, *others = indices
        return _View(first, None, layer=layer, also=tuple(others))
    return None


def _view_after(eqn: Any, views: list[_View | None]) -> _View | None:
    """The view the output of a one-output structural operation is, if its first operand is one; else whether it is
    derived from the model's arrays (`_derived`)."""
    src = views[0] if views else None
    if src is None or src.axes is None:
        return _derived(eqn, views)
    name, params = eqn.primitive.name, eqn.params
    if name in _SAME:
        return src
    if name in _SHORTENING:
        shorter = tuple(eqn.outvars[0].aval.shape) != tuple(eqn.invars[0].aval.shape)
        return src._replace(sliced=None) if shorter else src
    if name == "transpose":
        return src._replace(axes=tuple(src.axes[p] for p in params["permutation"]))
    if name == "squeeze":
        return src._replace(axes=tuple(a for i, a in enumerate(src.axes) if i not in params["dimensions"]))
    if name == "expand_dims":
        axes = list(src.axes)
        for d in sorted(params["dimensions"]):
            axes.insert(d, ())
        return src._replace(axes=tuple(axes))
    if name == "broadcast_in_dim":
        where = {d: i for i, d in enumerate(params["broadcast_dimensions"])}
        return src._replace(axes=tuple(src.axes[where[k]] if k in where else () for k in range(len(params["shape"]))))
    if name == "reshape" and params.get("dimensions") is None:
        reshaped = _reshape_axes(src, tuple(eqn.invars[0].aval.shape), tuple(params["new_sizes"]))
        if reshaped is not None:
            return reshaped
    return _derived(eqn, views)


def _sub_jaxpr(eqn: Any) -> Any:
    """The closed jaxpr that a call-like equation (`jit`, `checkpoint`, a custom derivative, a scan) runs, or
    `None`."""
    for key in ("jaxpr", "call_jaxpr", "fun_jaxpr"):
        if key in eqn.params:
            sub = eqn.params[key]
            return sub if isinstance(sub, jcore.ClosedJaxpr) else jcore.ClosedJaxpr(sub, ())
    return None


_weight_pairs: list[set[int]] = []  # `_multiplied_by_weights`: the leaves of products of two weights


def _multiplied_by_weights(jaxpr: Any, views: Sequence[_View | None]) -> set[int]:
    """The leaves of `jaxpr`'s products of two of the model's arrays (or of values computed from them alone)."""
    _weight_pairs.append(set())
    try:
        walk(jaxpr, views, [])
        return _weight_pairs[-1]
    finally:
        _weight_pairs.pop()


def _product(eqn: Any, views: list[_View | None], where: _Where) -> _Use | None:
    """The use of a product equation that sums over something: of a weight, if one operand is a view of a leaf and
    the other an activation; of two activations (`leaf` -1), if both are and the equation is a `dot_general` outside
    eqx_quant's own modules. A weight read through operations that are not views (`primitive` "unfollowed") is
    reported, to be left in floating point."""
    lhs, rhs = views[0], views[1]
    if (lhs is not None and lhs.layer) or (rhs is not None and rhs.layer):
        return None
    if eqn.primitive.name == "dot_general":
        (contract_l, contract_r), _ = eqn.params["dimension_numbers"]
        if not contract_l:
            return None  # an outer or elementwise product (a gain written with `einsum`): nothing is summed
    if lhs is None and rhs is None:
        if eqn.primitive.name != "dot_general" or where.scoped:
            return None
        shape = tuple(eqn.invars[0].aval.shape)
        return _Use(-1, tuple(contract_r), shape, tuple(contract_l), "dot_general", where.loop, None, eqn, where.outer)
    derived = [v for v in (lhs, rhs) if v is not None and v.axes is None]
    if derived or (lhs is not None and rhs is not None):
        if len(derived) == 1 and (lhs is None or rhs is None) and derived[0].leaf >= 0:
            return _Use(
                derived[0].leaf, (), (), (), "unfollowed", where.loop, None, eqn, where.outer, also=derived[0].also
            )
        pair = {v.leaf for v in (lhs, rhs) if v is not None and v.leaf >= 0}
        if _weight_pairs and len(pair) == 2:  # two arrays (not a constant, nor an array with itself: `w.T @ w`)
            _weight_pairs[-1].update(pair)
        return None  # products of two weights (or of values computed from them alone)
    if eqn.primitive.name == "dot_general":
        weight_side = 0 if lhs is not None else 1
        dims = (contract_l, contract_r)[weight_side]
        input_dims = (contract_l, contract_r)[1 - weight_side]
    else:
        if rhs is None:
            return None  # an activation used as the kernel of a convolution over a weight: not a weight product
        weight_side = 1
        _, rhs_spec, _ = eqn.params["dimension_numbers"]
        dims = tuple(rhs_spec[1:])  # input channels and the kernel's spatial axes
        lhs_spec = eqn.params["dimension_numbers"][0]
        input_dims = tuple(lhs_spec[1:])
    view = views[weight_side]
    assert view is not None and view.axes is not None
    contracted = tuple(sorted({a for d in dims for a in view.axes[d]}))
    free = {a for d in range(len(view.axes)) if d not in dims for a in view.axes[d]}
    if free & set(contracted):  # a reshape merged a summed and a kept axis: no scale layout follows the product
        return _Use(view.leaf, (), (), (), "unfollowed", where.loop, None, eqn, where.outer)
    input_shape = tuple(eqn.invars[1 - weight_side].aval.shape)
    pairing, batch = None, ()
    if eqn.primitive.name == "dot_general":
        if all(len(view.axes[d]) == 1 for d in dims):
            pairing = tuple(view.axes[d][0] for d in dims)
            pairing = pairing if len(set(pairing)) == len(pairing) else None
        batch = _batch_pairs(eqn, weight_side, view)
    return _Use(view.leaf, contracted, input_shape, tuple(input_dims), eqn.primitive.name, where.loop, view.sliced, eqn,
                where.outer, pairing, batch)  # fmt: skip


def _batch_pairs(eqn: Any, weight_side: int, view: _View) -> tuple[tuple[int, int], ...]:
    """The batch dimensions of a weight's `dot_general` that are leaf axes of the weight (an expert axis of stacked
    experts, say), as `(leaf axis, input axis)` pairs in the order of the leaf axes: each index along them is a
    product of its own. A batch dimension along which the weight is broadcast is left out (one weight for all
    indices), and a reshape that merged leaf axes into one leaves none (`()`, as if each were)."""
    assert view.axes is not None
    _, batch_dims = eqn.params["dimension_numbers"]
    pairs = []
    for w, x in zip(batch_dims[weight_side], batch_dims[1 - weight_side], strict=True):
        if len(view.axes[w]) > 1:
            return ()
        pairs += [(view.axes[w][0], x)] if view.axes[w] else []
    return tuple(sorted(pairs))


def _slice(view: _View | None) -> _View | None:
    """The view of one step of a scan over `view`'s first axis."""
    if view is None or view.axes is None:
        return view
    regular = view.sliced is not None and view.axes[0] == (view.sliced,)
    return view._replace(axes=view.axes[1:], sliced=view.sliced + 1 if regular else None)  # pyright: ignore


def _scan_views(eqn: Any, views: list[_View | None]) -> list[_View | None]:
    """The views a scan's body sees: its constants as they are, no carry, one slice of each scanned input."""
    consts, carry = eqn.params["num_consts"], eqn.params["num_carry"]
    return [*views[:consts], *([None] * carry), *map(_slice, views[consts + carry :])]


def walk(jaxpr: Any, views: Sequence[_View | None], uses: list[_Use], where: _Where = _Where()) -> list[_View | None]:
    """Propagates leaf views through `jaxpr`, appending every product to `uses`; returns the outputs' views."""
    env: dict[Any, _View | None] = dict(zip(jaxpr.invars, views, strict=True))
    read = lambda v: None if isinstance(v, jcore.Literal) else env.get(v)  # noqa: E731
    for eqn in jaxpr.eqns:
        ins = [read(v) for v in eqn.invars]
        outs = eqn_views(eqn, ins, uses, where)
        env.update(zip(eqn.outvars, outs, strict=True))
    return [read(v) for v in jaxpr.outvars]


def eqn_views(eqn: Any, ins: list[_View | None], uses: list[_Use], where: _Where = _Where()) -> list[_View | None]:
    """The views of an equation's outputs, appending the products it computes (itself or inside) to `uses`."""
    name = eqn.primitive.name
    nothing = [None] * len(eqn.outvars)
    where = where._replace(scoped=where.scoped or "eqx_quant." in str(eqn.source_info.name_stack))
    if name in _PRODUCTS:
        use = _product(eqn, ins, where)
        if use is not None:
            uses.append(use)
        # Its output counts as an activation, also that of a product of the model's arrays alone (learned queries
        # `latents @ wq`, whose product with the keys is then one of two activations).
        return nothing
    inner = where._replace(outer=(*where.outer, id(eqn)))
    if name == "scan":
        walk(eqn.params["jaxpr"].jaxpr, _scan_views(eqn, ins), uses, inner)
        return nothing
    if name == "cond":
        outs = [walk(branch.jaxpr, ins[1:], uses, inner) for branch in eqn.params["branches"]]
        # A value computed from the model's other arrays alone leaves every branch alike (a quantized layer's
        # `.weight`, which passes a conditional, a tied head's): its products stay no products of two activations.
        alike = lambda i, v: v is not None and v.layer and all(o[i] == v for o in outs)  # noqa: E731
        return [v if alike(i, v) else None for i, v in enumerate(outs[0])]
    if name == "while":
        cond_n, body_n = eqn.params["cond_nconsts"], eqn.params["body_nconsts"]
        carry = [None] * (len(ins) - cond_n - body_n)
        looped = inner._replace(loop=True)
        walk(eqn.params["body_jaxpr"].jaxpr, [*ins[cond_n : cond_n + body_n], *carry], uses, looped)
        walk(eqn.params["cond_jaxpr"].jaxpr, [*ins[:cond_n], *carry], uses, looped)
        return nothing
    closed = _sub_jaxpr(eqn)
    if closed is not None:
        sub = closed.jaxpr
        if name in _CALLS or len(sub.invars) == len(ins):
            # A constant passed in (`jnp.where(w > 0, w, 0.0)` passes its 0.0) is a constant inside, not an input.
            ins = [_CONSTANT if isinstance(v, jcore.Literal) else view for v, view in zip(eqn.invars, ins, strict=True)]
            return walk(sub, ins[-len(sub.invars) :] if sub.invars else [], uses, inner)[: len(eqn.outvars)]
        return nothing
    if len(eqn.outvars) == 1:
        return [_view_after(eqn, ins)]
    if name == "split" and ins[0] is not None and ins[0].axes is not None:  # pieces along one axis: the same axes
        return [ins[0]._replace(sliced=None)] * len(eqn.outvars)
    derived = _derived(eqn, ins)
    return [derived] * len(eqn.outvars)


_REORDERING = frozenset({"rev", "pad", "reduce_precision"})  # reverse, shift or round a weight's entries


def _whole_product(eqn: Any, views: list[_View | None], watched: dict[int, tuple]) -> int | None:
    """The watched leaf that a product equation multiplies as an input transform of it needs (or `None`): a
    `dot_general` summing over the leaf's contracted axes whole, paired one to one with its input's as `watched`
    says."""
    use = _product(eqn, views, _Where())
    if use is None or use.primitive != "dot_general" or use.leaf not in watched or use.pairing is None:
        return None
    shape, pairing = watched[use.leaf]
    side = 0 if views[0] is not None else 1
    view = views[side]
    dims = eqn.params["dimension_numbers"][0][side]
    whole = all(eqn.invars[side].aval.shape[d] == shape[view.axes[d][0]] for d in dims)  # pyright: ignore
    return use.leaf if whole and pairing is not None and sorted(use.pairing) == sorted(pairing) else None


def _strays(jaxpr: Any, views: Sequence[_View | None], watched: dict[int, tuple], bad: set[int],
            used: set[int]) -> list:  # fmt: skip
    """Adds to `bad` the watched leaves that `jaxpr` reads otherwise than through views (not reversed, padded or
    rounded) into whole products (`_whole_product`), and to `used` those it reads in such products; returns the views
    of its outputs."""
    env: dict[Any, _View | None] = dict(zip(jaxpr.invars, views, strict=True))
    read = lambda v: None if isinstance(v, jcore.Literal) else env.get(v)  # noqa: E731
    leaves = lambda vs: {v.leaf for v in vs if v is not None and v.leaf in watched}  # noqa: E731
    for eqn in jaxpr.eqns:
        ins = [read(v) for v in eqn.invars]
        outs: list[_View | None] = [None] * len(eqn.outvars)
        mine, name = leaves(ins), eqn.primitive.name
        sub = _sub_jaxpr(eqn)
        if not mine:
            pass
        elif name in _PRODUCTS:
            whole = _whole_product(eqn, ins, watched)
            bad |= {leaf for leaf in mine if leaf != whole}
            if whole is not None:
                used.add(whole)
        elif name == "scan":  # a weight carried from step to step is read unseen: only constants and slices are
            consts, carried = eqn.params["num_consts"], eqn.params["num_carry"]
            bad |= leaves(ins[consts : consts + carried])
            bad |= leaves(_strays(eqn.params["jaxpr"].jaxpr, _scan_views(eqn, ins), watched, bad, used))
        elif name == "cond":
            for branch in eqn.params["branches"]:
                bad |= leaves(_strays(branch.jaxpr, ins[1:], watched, bad, used))
        elif name in _CALLS and sub is not None:
            n = len(sub.jaxpr.invars)
            bad |= leaves(_strays(sub.jaxpr, ins[len(ins) - n :] if n else [], watched, bad, used))
        elif len(eqn.outvars) == 1 and name not in _REORDERING and not leaves(ins[1:]):
            out = _view_after(eqn, ins)
            if out is not None and out.axes is not None:
                outs = [out]
            else:
                bad |= mine
        else:
            bad |= mine
        env.update(zip(eqn.outvars, outs, strict=True))
    return [read(v) for v in jaxpr.outvars]


def stray_reads(jaxpr: Any, views: Sequence[_View | None], watched: dict[int, tuple]) -> tuple[set[int], set[int]]:
    """The leaves of `watched` (program inputs, each with its shape and the contracted axes of its products) that
    the program reads otherwise than as the weight of `dot_general`s summing over those axes whole (through
    transposes, reshapes that keep those axes, casts, slices of other axes, scans, conds and calls), or returns:
    where the weight's transformed value would be read with no transform of the other operand; and those it reads
    in such products."""
    bad: set[int] = set()
    used: set[int] = set()
    outs = _strays(jaxpr, views, watched, bad, used)
    return bad | {v.leaf for v in outs if v is not None and v.leaf in watched}, used


# Layers with weights that `quantize` reaches only by tracing their products (`example=`): float otherwise.
TRACED_ONLY = (eqx.nn.ConvTranspose, eqx.nn.GRUCell, eqx.nn.LSTMCell)


_probes: list[dict[str, str | None]] = []  # `probe_reads`: by traced weight path, why it cannot be transformed


class probe_reads:
    """A context in which each call of a [`eqx_quant.nn.QuantTraced`][] records, by traced weight path, whether the
    program reads the weight as the weight of whole products alone (`stray_reads`), so that an input transform of
    its products would keep the model's function: `None` if so, else `"stray"` (read otherwise) or `"unused"` (in
    no product). Traced, say by `eqx.filter_eval_shape`, inside it."""

    def __enter__(self) -> dict[str, str | None]:
        _probes.append({})
        return _probes[-1]

    def __exit__(self, *exc: object) -> None:
        _probes.pop()


_batch_probes: list[dict[str, set]] = []  # `probe_batches`: by traced weight path, its products' batch axes


class probe_batches:
    """A context in which each call of a [`eqx_quant.nn.QuantTraced`][] records, by traced weight path, the axes of
    the weight that are batch dimensions of its products (`_batch_pairs`): the set of the tuples of leaf axes its
    products have, `None` among them for a product whose batch dimension holds part of such an axis (a slice of the
    experts). Traced, say by `eqx.filter_eval_shape`, inside it."""

    def __enter__(self) -> dict[str, set]:
        _batch_probes.append({})
        return _batch_probes[-1]

    def __exit__(self, *exc: object) -> None:
        _batch_probes.pop()


class Codes(NamedTuple):
    """What an integer product needs of a weight view besides its value: its integer levels, its scales broadcast
    to its shape, and where its levels are NaN (`None`: nowhere). Structural operations apply to them as to the
    value."""

    levels: Any
    scale: Any
    nan: Any


class IntWeight(NamedTuple):
    """What an integer product needs to know of a weight leaf on a symmetric integer grid: the largest magnitude of
    its levels, and its tiles (`group` elements along leaf axis `axis`, of length `length`), if it has any."""

    bound: int
    group: int | None = None
    axis: int | None = None
    length: int | None = None


class Inputs(NamedTuple):
    """For each leaf (by program input), the input transform and quantizer of its products and the stack axes their
    arrays carry; the leaves whose input quantizers are per token (laid out at each product); for the leaves whose
    products may compute on integers, their grid (`IntWeight`); the quantizers of the products of two activations
    to quantize, and the equations that hold them, each by its chain of equation ids (see `evaluate`); and each
    leaf's `pairings` entry."""

    quantizers: dict[int, tuple[Any, int]]  # by leaf: `(input transform, input quantizer)`, and the stack's depth
    tokens: frozenset[int]
    integer: dict[int, IntWeight]
    products: dict[tuple[int, ...], tuple[Any, Any]]
    holders: frozenset[tuple[int, ...]]
    pairings: dict[int, tuple[int, ...] | None]  # by leaf: its contracted axes in the order its inputs' are laid


_CODES_SAME = frozenset({"copy", "copy_p", "optimization_barrier", "stop_gradient"})
_CODES_MOVED = frozenset({"transpose", "squeeze", "expand_dims", "broadcast_in_dim", "reshape", "slice", "rev",
                          "dynamic_slice"})  # fmt: skip


def _codes_after(eqn: Any, codes: Codes | None, ins: list[Any]) -> Codes | None:
    """The codes of an operation's output view: the same operation on the levels, scales and NaN mask. A cast to
    another dtype (which may round the values) and other operations drop them: the product then computes in float."""
    name = eqn.primitive.name
    if codes is None or (name == "convert_element_type" and eqn.params["new_dtype"] != eqn.invars[0].aval.dtype):
        return None
    if name in _CODES_SAME or name == "convert_element_type":
        return codes
    if name not in _CODES_MOVED:
        return None
    params = eqn.primitive.get_bind_params(eqn.params)
    move = lambda a: None if a is None else eqn.primitive.bind(a, *ins[1:], **params)  # noqa: E731
    return Codes(move(codes.levels), move(codes.scale), move(codes.nan))


def evaluate(jaxpr: Any, consts: Sequence[Any], args: Sequence[Any], views: Sequence[_View | None],
             codes: Sequence[Codes | None], inputs: Inputs, chain: tuple[int, ...] = (),
             followed: set[int] | None = None) -> list[Any]:  # fmt: skip
    """Runs `jaxpr` on `args`, quantizing with `inputs` the activation operand of every product of a leaf view (on
    integers, from the view's `codes`, where the formats allow it); everything else runs as traced. Adds to
    `followed` the leaves of every product of a leaf view it finds (inside the equations that hold them too)."""
    env: dict[Any, Any] = dict(zip(jaxpr.constvars, consts, strict=True))
    env.update(zip(jaxpr.invars, args, strict=True))
    seen: dict[Any, _View | None] = dict(zip(jaxpr.invars, views, strict=True))
    held: dict[Any, Codes | None] = dict(zip(jaxpr.invars, codes, strict=True))
    read = lambda v: v.val if isinstance(v, jcore.Literal) else env[v]  # noqa: E731
    view = lambda v: None if isinstance(v, jcore.Literal) else seen.get(v)  # noqa: E731
    code = lambda v: None if isinstance(v, jcore.Literal) else held.get(v)  # noqa: E731
    for eqn in jaxpr.eqns:
        ins, in_views, in_codes = (
            [read(v) for v in eqn.invars],
            [view(v) for v in eqn.invars],
            [code(v) for v in eqn.invars],
        )
        uses: list[_Use] = []
        out_views = eqn_views(eqn, in_views, uses)
        if followed is not None:
            followed.update(use.leaf for use in uses if use.leaf >= 0)
        out_codes: list[Codes | None] = [None] * len(eqn.outvars)
        key = (*chain, id(eqn))  # an equation of a jaxpr that several calls share is one per call: by its chain
        if _holds_products(key, uses, inputs):
            outs = _evaluate_with_products(eqn, key, ins, in_views, in_codes, inputs)
        else:
            outs = eqn.primitive.bind(*ins, **eqn.primitive.get_bind_params(eqn.params))
            outs = outs if eqn.primitive.multiple_results else [outs]
            if out_views[0] is not None and out_views[0].axes is not None and len(outs) == 1:
                out_codes = [_codes_after(eqn, in_codes[0], ins)]
        env.update(zip(eqn.outvars, outs, strict=True))
        seen.update(zip(eqn.outvars, out_views, strict=True))
        held.update(zip(eqn.outvars, out_codes, strict=True))
    return [read(v) for v in jaxpr.outvars]


def _evaluate_with_products(eqn: Any, key: tuple[int, ...], ins: list[Any], views: list[_View | None],
                            codes: list[Codes | None],
                            inputs: Inputs) -> list:  # fmt: skip
    name, params = eqn.primitive.name, eqn.params
    if name in _PRODUCTS:
        return [_product_value(eqn, key, ins, views, codes, inputs)]
    if name == "scan":
        body = params["jaxpr"]
        n_consts, n_carry = params["num_consts"], params["num_carry"]
        consts, init, xs = ins[:n_consts], ins[n_consts : n_consts + n_carry], ins[n_consts + n_carry :]
        body_views = _scan_views(eqn, views)
        # The input quantizers of the weights this scan steps through layer by layer, whose arrays hold one entry
        # per layer (a calibrated stack): scanned alongside, one layer's entries per step; and the codes of the
        # scanned weights, sliced like them.
        quantizers = inputs.quantizers
        stepped = {
            v.leaf: eqx.partition(quantizers[v.leaf][0], eqx.is_array)
            for v, inner in zip(views[n_consts + n_carry :], body_views[n_consts + n_carry :], strict=True)
            if v is not None
            and not v.layer
            and inner is not None
            and inner.sliced is not None
            and quantizers[v.leaf][1] > 0
        }
        arrays = {leaf: dynamic for leaf, (dynamic, _) in stepped.items()}
        const_codes, xs_codes = codes[:n_consts], codes[n_consts + n_carry :]

        def step(carry, x):
            x, x_codes, layer = x
            inner = dict(quantizers)
            for leaf, (_, static) in stepped.items():
                inner[leaf] = (eqx.combine(layer[leaf], static), quantizers[leaf][1] - 1)
            body_codes = [*const_codes, *([None] * n_carry), *x_codes]
            outs = evaluate(body.jaxpr, body.consts, [*consts, *carry, *x], body_views, body_codes,
                            inputs._replace(quantizers=inner), key)  # fmt: skip
            return outs[:n_carry], outs[n_carry:]

        carry, ys = jax.lax.scan(step, init, (xs, xs_codes, arrays), length=params["length"],
                                 reverse=params["reverse"], unroll=params["unroll"])  # fmt: skip
        return [*carry, *ys]
    if name == "cond":
        branches = [
            lambda ops, c, b=b: evaluate(b.jaxpr, b.consts, ops, views[1:], c, inputs, key) for b in params["branches"]
        ]
        return jax.lax.switch(ins[0], branches, ins[1:], codes[1:])
    # A while loop never holds one: `quantize` leaves its weights float and does not name its activation products.
    assert name != "while"
    sub = _sub_jaxpr(eqn)
    n = len(sub.jaxpr.invars)
    args, arg_views, arg_codes = ins[len(ins) - n :], views[len(ins) - n :], codes[len(ins) - n :]
    run = lambda a, c: evaluate(sub.jaxpr, sub.consts, a, arg_views, c, inputs, key)  # noqa: E731
    if name in ("remat2", "checkpoint"):
        run = jax.checkpoint(run, prevent_cse=params["prevent_cse"], policy=params["policy"])
    # Calls (`jit`) run inline; a custom-derivative function whose body holds a quantized product runs its body, so
    # that its product is quantized (its own derivative rule then gives way to the quantized body's).
    return run(args, arg_codes)[: len(eqn.outvars)]


def _holds_products(key: tuple[int, ...], uses: list[_Use], inputs: Inputs) -> bool:
    """Whether the equation at `key`, whose products (its own or inside it) are `uses`, is or holds a product to
    quantize."""
    if key in inputs.products or key in inputs.holders:
        return True
    return any(use.leaf >= 0 and use.primitive != "unfollowed" for use in uses)


def _activation_product(eqn: Any, ins: list[Any], quantizers: tuple[Any, Any]) -> Any:
    """A product of two activations with its operands quantized: on the integers where both are on symmetric integer
    grids with one scale per tensor and the int32 sums are exact, else the float product."""
    lhs, rhs = ins
    lq, rq = quantizers
    (contract_l, _), _ = eqn.params["dimension_numbers"]
    length = math.prod(lhs.shape[a] for a in contract_l)
    integer = all(_symmetric_integer(q) and q.layout.is_per_tensor() for q in quantizers)  # pyright: ignore
    if (
        integer
        and not any_float64(*(a.dtype for a in ins))
        and length * _bound(lq.format) * _bound(rq.format) <= INT32_MAX
    ):  # pyright: ignore
        fl, tl, nl = lq.fake_quant_and_array(lhs)  # pyright: ignore[reportAttributeAccessIssue]
        fr, tr, nr = rq.fake_quant_and_array(rhs)  # pyright: ignore[reportAttributeAccessIssue]
        scale = jnp.broadcast_to(tr.scale.reshape(()), rhs.shape)
        dims = eqn.params["dimension_numbers"]
        y = _integer_dot(dims, 0, False, None, fl, fr, tl.values, tl.scale, nl, tr.values, scale,
                         nr.reshape(rhs.shape))  # fmt: skip
        return y.astype(eqn.outvars[0].aval.dtype)
    lhs = lhs if lq is None else lq(lhs)
    rhs = rhs if rq is None else rq(rhs)
    return eqn.primitive.bind(lhs, rhs, **eqn.primitive.get_bind_params(eqn.params))


def _product_value(eqn: Any, key: tuple[int, ...], ins: list[Any], views: list[_View | None],
                   codes: list[Codes | None],
                   inputs: Inputs) -> Any:  # fmt: skip
    """A product of a weight view with an activation: the activation quantized, then the integer product where both
    operands are on integer grids with scales constant along the contraction, else the float product. Or a product
    of two activations."""
    if key in inputs.products:
        return _activation_product(eqn, ins, inputs.products[key])
    use = _product(eqn, views, _Where())
    assert use is not None
    side = 1 if views[0] is not None else 0  # the activation's
    transform, quantizer = inputs.quantizers[use.leaf][0]
    if use.leaf in inputs.tokens and use.primitive == "dot_general":
        tokens = Layout(axes=free_axes(ins[side].ndim, use.input_contracted))  # this call's
        per_token = lambda q: dataclasses.replace(q, layout=tokens) if isinstance(q, DynamicFakeQuant) else q  # noqa: E731
        if hasattr(quantizer, "product_input"):  # an observer holding the input quantizer (GPTQ's quantized inputs)
            quantizer = dataclasses.replace(quantizer, data=per_token(quantizer.data))  # pyright: ignore
        else:
            quantizer = per_token(quantizer)
    ins = list(ins)
    contracted = _laid_out(use, inputs.pairings.get(use.leaf))
    if transform is not None:
        ins[side] = apply_transform(transform, ins[side], contracted)
    if hasattr(quantizer, "product_input"):  # an observer that wants to know the contraction (GPTQ's Hessian)
        ins[side] = quantizer.product_input(ins[side], contracted, use.batch)  # pyright: ignore
    elif quantizer is not None:
        weight_codes, weight = codes[1 - side], inputs.integer.get(use.leaf)
        if (
            eqn.primitive.name == "dot_general"
            and weight is not None
            and weight_codes is not None
            and not any_float64(*(a.dtype for a in ins))
        ):
            dims = eqn.params["dimension_numbers"]
            group = _group_along(weight, dims[0][1 - side], views[1 - side], eqn.invars[1 - side].aval.shape)
            if group != 0 and _integer_input(quantizer, ins[side], use.input_contracted, weight.bound, group):
                fx, tx, nx = quantizer.fake_quant_and_array(ins[side])  # pyright: ignore[reportAttributeAccessIssue]
                x_scale = tx.scale if quantizer.layout.is_per_tensor() else _full_scale(tx)  # pyright: ignore
                y = _integer_dot(dims, side, True, group, fx, ins[1 - side], tx.values, x_scale, nx, *weight_codes)
                return y.astype(eqn.outvars[0].aval.dtype)
        if use.primitive == "dot_general" and two_level(quantizer):
            ins[side] = each_token(quantizer, ins[side], use.input_contracted)
        else:
            ins[side] = quantizer(ins[side])
    return eqn.primitive.bind(*ins, **eqn.primitive.get_bind_params(eqn.params))


def two_level(quantizer: object) -> bool:
    """Whether `quantizer` computes a dynamic second-level scale of its whole input (NVFP4's tensor scale)."""
    return isinstance(quantizer, DynamicFakeQuant) and quantizer.format.scale == "e4m3"


def layer_quantizer(quantizer: DynamicFakeQuant, depth: int) -> DynamicFakeQuant:
    """`quantizer` of a traced weight stacked `depth` times as it applies to one layer of the stack: its axes
    (counted from the start) shifted past the stack's."""
    layout = quantizer.layout
    shift = lambda a: a - depth if a >= 0 else a  # noqa: E731
    one = layout._replace(axes=tuple(shift(a) for a in layout.axes), group_axis=shift(layout.group_axis))
    return dataclasses.replace(quantizer, layout=one)


def each_layer(quantizer: DynamicFakeQuant, weight: Any, depth: int) -> Any:
    """A two-level `quantizer` (NVFP4) of a traced weight stacked `depth` times applied to each layer of the stack on
    its own, as to the weight of a stack of layers built with `eqx.filter_vmap`: one tensor scale per layer, where the
    whole leaf at once would share one among the layers (a layer's values would depend on the others')."""
    return per_layer(lambda q, w: q(w), depth)(layer_quantizer(quantizer, depth), weight)


def each_layer_array(quantizer: DynamicFakeQuant, weight: Any, depth: int) -> QuantizedArray:
    """The [`eqx_quant.QuantizedArray`][] of `each_layer`: the whole leaf, its layout `stacked` `depth` times (one
    tensor scale per layer), with the scales each layer takes on its own; its `dequantize()` is `each_layer`'s value
    bit for bit."""
    block, _, tensor = per_layer(lambda q, w: q.scales(w), depth)(layer_quantizer(quantizer, depth), weight)
    layout = quantizer.layout._replace(stacked=depth)
    return quantize_array(weight, Scales(block, None, tensor), quantizer.format, layout, mask=False)[0]


def each_token(quantizer: DynamicFakeQuant, x: Any, contracted: Sequence[int]) -> Any:
    """`quantizer` applied to each token of a product's activation operand `x` on its own (each index of the axes
    that the product does not sum over, `contracted` the others), as it is applied to the input of a linear layer
    mapped over the tokens; as it is, to the whole operand, where its blocks or channels run along a token axis.

    Applied to the whole operand at once, NVFP4's second-level scale would be one for all the tokens of a call: a
    token's quantized input would depend on the tokens after it, and a causal model's decoding step would differ
    from its whole-sequence call. Each token keeps the contracted axes in their order, and the blocks their axis."""
    free = free_axes(x.ndim, contracted)
    layout = quantizer.layout
    if not free or layout.axes or layout.stacked:
        return quantizer(x)
    if layout.group_size is not None:
        axis, kept = layout.group_axis % x.ndim, sorted(a % x.ndim for a in contracted)
        if axis not in kept:
            return quantizer(x)
        quantizer = dataclasses.replace(quantizer, layout=layout._replace(group_axis=kept.index(axis) - len(kept)))
    moved = jnp.moveaxis(x, free, tuple(range(len(free))))
    tokens = moved.reshape((-1,) + moved.shape[len(free) :])
    out = jax.vmap(quantizer)(tokens).reshape(moved.shape)
    return jnp.moveaxis(out, tuple(range(len(free))), free)


def _laid_out(use: _Use, pairing: tuple[int, ...] | None) -> tuple[int, ...]:
    """The axes of a product's activation operand that it sums over, in the order `pairing` (the weight's contracted
    axes as the traced weight's inputs are laid out: `QuantTraced.pairings`) pairs them, where this product pairs
    the same axes; else as the product lists them."""
    if pairing is None or use.pairing is None or sorted(use.pairing) != sorted(pairing):
        return use.input_contracted
    return tuple(use.input_contracted[use.pairing.index(a)] for a in pairing)


def apply_transform(transform: Any, x: Any, contracted: tuple[int, ...]) -> Any:
    """An input transform (of the channels of a traced weight's inputs, flattened in the order of `contracted`) on
    the activation operand `x` of a product summing over its axes `contracted`."""
    n = len(contracted)
    moved = jnp.moveaxis(x, contracted, tuple(range(-n, 0)))
    flat = moved.reshape(moved.shape[: moved.ndim - n] + (-1,))
    if flat.shape[-1] != transform_size(transform):
        raise ValueError(
            f"A traced weight's input transform {type(transform).__name__} acts on {transform_size(transform)} "
            f"channels, but one of its products sums over {flat.shape[-1]} (axes {contracted} of an input of shape "
            f"{x.shape}): the model computes another product with the weight than the one it was transformed for."
        )
    return jnp.moveaxis(transform(flat).reshape(moved.shape), tuple(range(-n, 0)), contracted)


def transform_size(transform: Any) -> int:
    """The number of channels an input transform acts on (the last axis of its arrays)."""
    return jax.tree.leaves(transform)[0].shape[-1]


def _symmetric_integer(quantizer: object, tiles: bool = False) -> bool:
    """Whether a quantizer (or a stored array) gives an integer product an operand: a symmetric integer grid with
    float32 scales, one per tensor or channel (or, with `tiles`, per tile along one axis)."""
    layout = getattr(quantizer, "layout", None)
    if not integer_grid(quantizer) or layout is None or layout.stacked:
        return False
    if layout.group_size is not None and not (tiles and not layout.axes):
        return False
    zero_point = getattr(quantizer, "zero_point", None)
    if isinstance(quantizer, DynamicFakeQuant):
        return quantizer.symmetric
    return zero_point is None or (not isinstance(zero_point, jax.Array) and not any(flat(zero_point)))


def _group_along(weight: IntWeight | None, contracted: Sequence[int], view: _View | None,
                 shape: tuple[int, ...]) -> int | None:  # fmt: skip
    """The tile size of an integer product's sums for a weight view (`None`: one sum over the whole contraction), or
    0 where the weight's tiles do not run along the product's contraction as whole tiles (it then computes in float):
    its one contracted axis must be the leaf's tiled axis, at its full length (slices of other axes keep whole
    tiles)."""
    if weight is None or weight.group is None:
        return None
    if view is None or view.axes is None or len(contracted) != 1:
        return 0
    (axis,) = contracted
    return weight.group if view.axes[axis] == (weight.axis,) and shape[axis] == weight.length else 0


def _integer_input(quantizer: object, x: Any, contracted: tuple[int, ...], weight_bound: int,
                   group: int | None) -> bool:  # fmt: skip
    """Whether the activation quantizer gives an integer product its operand: a symmetric integer grid with float32
    scales constant along the contraction (one per tensor, or per index of free axes: per token), and sums (over
    the contraction, or over each of the weight's tiles) that int32 holds exactly."""
    if not _symmetric_integer(quantizer):
        return False
    layout: Layout = quantizer.layout  # pyright: ignore[reportAttributeAccessIssue]
    if set(a % x.ndim for a in layout.axes) & set(contracted):
        return False
    length = group or math.prod(x.shape[a] for a in contracted)
    return length * _bound(quantizer.format) * weight_bound <= INT32_MAX  # pyright: ignore[reportAttributeAccessIssue]


def _bound(fmt: IntFormat) -> int:
    """The largest magnitude of a symmetric grid's levels."""
    return max(-fmt.qmin, fmt.qmax)


def _arranged(a: Any, side: int, dims: Any, other_free: int, reduce: Callable) -> Any:
    """An operand-shaped array constant along the contracted axes (scales), or to be reduced over them (NaN masks),
    on the non-contracted axes in the output's order: batch axes, then the left operand's free axes, then the
    right's (`other_free` unit axes for the other operand's)."""
    (lc, rc), (lb, rb) = dims
    contract, batch = (lc, lb) if side == 0 else (rc, rb)
    free = [d for d in range(a.ndim) if d not in contract and d not in batch]
    a = reduce(jnp.transpose(a, (*batch, *free, *contract)), tuple(range(a.ndim - len(contract), a.ndim)))
    n = len(batch)
    units = (1,) * other_free
    return a.reshape(a.shape + units) if side == 0 else a.reshape(a.shape[:n] + units + a.shape[n:])


def _first(a: Any, axes: tuple[int, ...]) -> Any:
    return a[(Ellipsis,) + (0,) * len(axes)] if axes else a


def _any(a: Any, axes: tuple[int, ...]) -> Any:
    return jnp.any(a, axis=axes) if axes else a


def _canonical(a: Any, contracted: Sequence[int], batch: Sequence[int]) -> Any:
    """An operand of `dot_general` laid out as (batch, free, contracted) axes."""
    free = (d for d in range(a.ndim) if d not in contracted and d not in batch)
    return jnp.transpose(a, (*batch, *free, *contracted))


def _integer_sums(lhs: Any, rhs: Any, dims: Any, group: int | None) -> Any:
    """The `dot_general` of two integer arrays with int32 accumulation (exact), as float32; with `group`, one sum per
    tile of `group` elements along the (one) contraction, the tiles along a new leading axis.

    Each operand is first laid out as (batch, free, contracted) axes, as a linear layer's operands are: XLA's CPU
    integer product takes its fast path for that form, which a transpose in front of it (a weight read as `W.T`) kept
    it from (four times slower on the benchmark's MLP). The output's axes are in `dot_general`'s order either way."""
    (lc, rc), (lb, rb) = dims
    lhs, rhs = _canonical(lhs, lc, lb), _canonical(rhs, rc, rb)
    nb, nc = len(lb), len(lc)
    if group is None:
        dims = ((tuple(range(lhs.ndim - nc, lhs.ndim)), tuple(range(rhs.ndim - nc, rhs.ndim))),
                (tuple(range(nb)), tuple(range(nb))))  # fmt: skip
        return jax.lax.dot_general(lhs, rhs, dims, preferred_element_type=jnp.int32).astype(jnp.float32)
    # The tiles as a batch axis, first: (tiles, batch, free, free); each device needs every tile of its rows.
    tiled = lambda a: whole_along(a, -1).reshape(a.shape[:-1] + (a.shape[-1] // group, group))  # noqa: E731
    lhs, rhs = tiled(lhs), tiled(rhs)
    dims = (((lhs.ndim - 1,), (rhs.ndim - 1,)), ((lhs.ndim - 2, *range(nb)), (rhs.ndim - 2, *range(nb))))
    return group_sums(lhs, rhs, dims, group)


def _tile_scales(w_scale: Any, side: int, dims: Any, other_free: int, group: int) -> Any:
    """A weight's scales (broadcast to its shape, constant within each tile of its one contracted axis) with one
    entry per tile and non-contracted index, laid out as `_integer_sums`' tiled sums: (tiles, batch, free, free)."""
    (lc, rc), (lb, rb) = dims
    contract, batch = (lc, lb) if side == 0 else (rc, rb)
    a = _canonical(w_scale, contract, batch)
    a = jnp.moveaxis(a.reshape(a.shape[:-1] + (a.shape[-1] // group, group))[..., 0], -1, 0)
    n, units = len(batch) + 1, (1,) * other_free
    return a.reshape(a.shape + units) if side == 0 else a.reshape(a.shape[:n] + units + a.shape[n:])


def _integer_value(dims, side, weight_first, group, x_levels, x_scale, x_nan, w_levels, w_scale, w_nan):
    """The product from the integers: an int32 `dot_general`, rescaled per output element; NaN where a contracted
    slice of either operand holds one, as in the float product.

    With `weight_first` (a weight's product) the sums are multiplied by the weight's scale and then by the input's,
    as [`eqx_quant.nn.QuantLinear`][] rescales them (so that a product of two scales below float32's smallest normal
    never stands in for them, and a bare weight computes what the same weight in a linear layer computes); otherwise
    (two activations) by the product of the two scales, as [`eqx_quant.nn.QuantEinsum`][] does. A weight in tiles
    along the contraction (`group`) has one int32 sum per tile, each multiplied by its tile's scale and rounded, the
    tiles' terms added in float32 in order (`sum_in_order`) and then multiplied by the input's scale, as a linear
    layer sums its groups (for the whole batch of a `jax.vmap` at once, see `_tiled_sums`). The input's scale is one
    per tensor, or (broadcast to its shape) constant along the contraction."""
    lhs, rhs = (w_levels, x_levels) if side == 1 else (x_levels, w_levels)
    (lc, rc), (lb, rb) = dims
    free = [len([d for d in range(o.ndim) if d not in c and d not in b]) for o, c, b in ((lhs, lc, lb), (rhs, rc, rb))]
    w_side = 1 - side
    nan = _arranged(x_nan, side, dims, free[w_side], _any)
    if w_nan is not None:
        nan = nan | _arranged(w_nan, w_side, dims, free[side], _any)
    x_arranged = x_scale.reshape(()) if x_scale.size == 1 else _arranged(x_scale, side, dims, free[w_side], _first)
    if group is not None:
        y = _tiled_sums(dims, side, group, x_levels.ndim)((w_levels, w_scale), x_levels) * x_arranged
    else:
        w_arranged = _arranged(w_scale, w_side, dims, free[side], _first)
        y = _integer_sums(lhs, rhs, dims, None).astype(w_arranged.dtype)
        y = (y * w_arranged) * x_arranged if weight_first else y * (x_arranged * w_arranged)
    y = opaque(jnp.where(nan, jnp.nan, y))
    # A weight's product, computed before what reads it, as a linear layer's is (see `unfused`).
    return unfused(y, w_scale) if weight_first else y


@functools.cache
def _tiled_sums(dims: Any, side: int, group: int, x_ndim: int) -> Callable[[Any, Any], Any]:
    """The tiles' scaled int32 sums of a weight in tiles, added in order: `f((w_levels, w_scale), x_levels)`, which
    sees the whole batch of a `jax.vmap` around it (`whole_batch`): the batch's axes join the input's free axes, so
    that the sums (tiles x batch x outputs) are computed tiles first and never moved; only the result is."""

    def sums(weight: Any, x: Any) -> Any:
        w_levels, w_scale = weight
        extra = x.ndim - x_ndim  # leading axes of the batch
        (lc, rc), (lb, rb) = dims
        shift = lambda axes: tuple(a + extra for a in axes)  # noqa: E731
        mapped = ((shift(lc), rc), (shift(lb), rb)) if side == 0 else ((lc, shift(rc)), (lb, shift(rb)))
        lhs, rhs = (w_levels, x) if side == 1 else (x, w_levels)
        (mlc, mrc), (mlb, mrb) = mapped
        free = [o.ndim - len(c) - len(b) for o, c, b in ((lhs, mlc, mlb), (rhs, mrc, mrb))]
        terms = _integer_sums(lhs, rhs, mapped, group) * _tile_scales(w_scale, 1 - side, mapped, free[side], group)
        y = sum_in_order(opaque(terms))  # (batch, left free, right free), the mapped axes first among the input's
        first = len(lb) + (0 if side == 0 else free[0])
        return jnp.moveaxis(y, tuple(range(first, first + extra)), tuple(range(extra)))

    return whole_batch(sums, batched_output=True)


@functools.partial(jax.custom_jvp, nondiff_argnums=(0, 1, 2, 3))
def _integer_dot(dims, side, weight_first, group, fx, fw, x_levels, x_scale, x_nan, w_levels, w_scale, w_nan):
    del fx, fw
    return _integer_value(dims, side, weight_first, group, x_levels, x_scale, x_nan, w_levels, w_scale, w_nan)


@_integer_dot.defjvp
def _integer_dot_jvp(dims, side, weight_first, group, primals, tangents):
    fx, fw = primals[:2]
    dfx, dfw = tangents[:2]
    y = _integer_dot(dims, side, weight_first, group, *primals)  # through the function itself, for a second derivative
    pair = lambda x, w: (w, x) if side == 1 else (x, w)  # noqa: E731
    dy = jax.lax.dot_general(*pair(dfx, fw), dims) + jax.lax.dot_general(*pair(fx, dfw), dims)
    return y, dy.astype(y.dtype)


@functools.cache
def layer_types() -> tuple[type, ...]:
    """The modules whose arrays compute their own products (the layers `quantize` wraps, quantized or converted):
    their arrays are no traced weights, and their products no products of two activations."""
    from .nn._attention import QuantMultiheadAttention  # here: `eqx_quant.nn` imports this module
    from .nn._converted import AbstractConvertedLayer
    from .nn._einsum import Einsum, QuantEinsum
    from .nn._layers import AbstractQuantLayer

    return (eqx.nn.Linear, eqx.nn.Conv, eqx.nn.Embedding, eqx.nn.MultiheadAttention, AbstractQuantLayer,
            AbstractConvertedLayer, Einsum, QuantEinsum, QuantMultiheadAttention)  # fmt: skip


def _under(path: str, roots: Sequence[str]) -> bool:
    """Whether `path` lies in the subtree at one of the paths `roots`."""
    return any(root == "" or path == root or path.startswith(root + ".") for root in roots)


def _candidate(leaf: Any) -> bool:
    """Whether a leaf may be a traced weight: a floating-point array of rank 1 or more."""
    return eqx.is_array(leaf) and jnp.issubdtype(leaf.dtype, jnp.floating) and leaf.ndim >= 1


def _leaf_view(leaf: Any, index: int, layer: bool = False) -> _View:
    return _View(index, tuple((a,) for a in range(jnp.ndim(leaf))), layer=layer)


class _Traced(NamedTuple):
    """A call traced with the array leaves of its inputs as the program's inputs."""

    jaxpr: Any  # closed
    leaves: list[Any]
    paths: list[tuple]  # the key path of each leaf in the inputs
    out: tuple[Any, Any]  # the dynamic and static parts of the output


def _trace(fn: Callable[..., Any], inputs: PyTree) -> _Traced:
    """The program of `fn(inputs)`, its inputs being the array leaves of `inputs`."""
    dynamic, static = eqx.partition(inputs, eqx.is_array)
    with_paths, treedef = jax.tree_util.tree_flatten_with_path(dynamic)
    leaves = [leaf for _, leaf in with_paths]

    def run(*flat):
        return fn(eqx.combine(jax.tree.unflatten(treedef, flat), static))

    shapes = [jax.ShapeDtypeStruct(jnp.shape(x), jnp.result_type(x), sharding=_typed_sharding(x)) for x in leaves]
    closed, out_dynamic, out_static = eqx.filter_make_jaxpr(run)(*shapes)
    return _Traced(closed, leaves, [p for p, _ in with_paths], (out_dynamic, out_static))


def _typed_sharding(x: Any) -> Any:
    """The sharding of `x` in its type where it is sharded over Explicit mesh axes (the program then computes with
    it, as the call does), else `None`."""
    sharding = getattr(jax.typeof(x), "sharding", None)
    spec = getattr(sharding, "spec", None)
    return sharding if spec is not None and any(p is not None for p in spec) else None


class Found(NamedTuple):
    """What tracing found: the products of weights (by program order), the products of two activations, and the
    weights that cannot be quantized product by product, with why (for a rule that reaches them)."""

    weights: list[TracedProduct]
    activations: list[TracedProduct]
    problems: dict[str, tuple[TracedProduct, str]]


def find_products(model: PyTree, call: Callable[[PyTree], Any], layers: Sequence[str]) -> Found:
    """The products of `call(model)` in the order the program computes them: those of a floating-point leaf outside
    the subtrees at the `layers` paths (whose own products are theirs) with an activation, and the `dot_general`s of
    two activations outside eqx_quant's modules (outside while loops), named `products.0`, `products.1`, ... (for
    these, `weight` is `None`, `input_*` describe the left operand and `contracted` the right operand's contracted
    axes); and the weights whose products cannot be quantized one by one (inside a `while_loop`, or read through
    operations that are not views)."""
    traced = _trace(call, model)
    paths = [path_string(p) for p in traced.paths]
    views = [
        _leaf_view(x, i, layer=_under(p, layers)) if _under(p, layers) or _candidate(x) else None
        for i, (p, x) in enumerate(zip(paths, traced.leaves, strict=True))
    ]
    uses: list[_Use] = []
    walk(traced.jaxpr.jaxpr, views, uses)
    found = Found([], [], {})
    for use in uses:
        if use.leaf < 0:
            if not use.loop:
                name = f"products.{len(found.activations)}"
                rhs = tuple(use.eqn.invars[1].aval.shape)
                found.activations.append(TracedProduct(name, None, use.contracted, use.input_shape,
                                                       use.input_contracted, use.primitive, rhs_shape=rhs))  # fmt: skip
            continue
        if use.primitive == "unfollowed":
            for index in (use.leaf, *use.also):  # each array the product's weight operand was computed from
                path = paths[index]
                product = TracedProduct(path, traced.leaves[index], (), use.input_shape, (), use.primitive)
                found.problems.setdefault(path, (product, (
                    f"The weight {path!r} reaches a product through operations that are not views of it (a "
                    "concatenation, a gather, arithmetic, a masking `jnp.where`, a reshape that merges a summed axis "
                    "with a kept one, or one that puts back together the parts of an axis that an earlier reshape "
                    "split): no scale layout follows the product from the leaf. Leave it out of the rules (a rule "
                    f"`Rule({path!r}, weight=None, input=None)` before the others keeps it float)."
                )))  # fmt: skip
            continue
        path, leaf = paths[use.leaf], traced.leaves[use.leaf]
        stack = tuple(leaf.shape[: use.sliced or 0])
        product = TracedProduct(path, leaf, use.contracted, use.input_shape, use.input_contracted, use.primitive, stack,
                                use.pairing)  # fmt: skip
        if use.loop:
            found.problems.setdefault(path, (product, (
                f"The weight {path!r} enters a {use.primitive} inside a `jax.lax.while_loop`, whose trip count is "
                "not known when tracing: it cannot be quantized product by product. Write the loop with "
                "`jax.lax.scan` (or `jax.lax.fori_loop` with static bounds), or leave the weight out of the rules (a "
                f"rule `Rule({path!r}, weight=None, input=None)` before the others keeps it float)."
            )))  # fmt: skip
        else:
            found.weights.append(product)
    return found


def _follows(layout: Layout, product: TracedProduct) -> bool:
    """Whether `layout` already lays scales out along `product`: per tensor, per index of its channel axes, or in
    tiles along its one contracted axis."""
    ndim = product.weight.ndim
    axes = tuple(sorted(a % ndim for a in layout.axes))
    if layout.stacked:
        return False
    if layout.group_size is None:
        return axes in ((), product.channels)
    return not axes and (layout.group_axis % ndim,) == product.contracted


def weight_layout(quantizer: AbstractQuantizer, product: TracedProduct) -> AbstractQuantizer:
    """A weight quantizer for a traced weight: one already laid out along the product as it is; a dynamic one written
    for layers (`axis=0` for one scale per output channel, tiles along the last axis, the contraction) with the same
    meaning here: one scale per index of the weight's channel axes, tiles along its contracted axis."""
    layout = getattr(quantizer, "layout", None)
    if isinstance(quantizer, DynamicFakeQuant) and layout is not None and layout.is_per_tensor() and product.stack:
        # One scale per tensor of a stack that a scan steps through: one per layer, as for stacked layers.
        return dataclasses.replace(quantizer, layout=Layout(axes=tuple(range(len(product.stack)))))
    if layout is None or _follows(layout, product):
        return quantizer
    if isinstance(quantizer, DynamicFakeQuant) and not layout.stacked:
        if layout.group_size is None and layout.axes == (0,):
            return dataclasses.replace(quantizer, layout=Layout(axes=product.channels))
        if not layout.axes and layout.group_size is not None and layout.group_axis == -1:
            if len(product.contracted) == 1:
                tiles = Layout(group_size=layout.group_size, group_axis=product.contracted[0])
                return dataclasses.replace(quantizer, layout=tiles)
    raise ValueError(
        f"The weight {product.path!r} is a traced weight (its product sums over its axes {product.contracted} of "
        f"{product.weight.shape}); its {type(quantizer).__name__}'s layout {layout} does not follow that product. "
        "Give it one scale per tensor, a DynamicFakeQuant with `axis=0` (one scale per output channel) or "
        "`group_size=g` (tiles along a single contracted axis), or a factory such as eqx_quant.LayerQuantizer."
    )


class QuantTraced(eqx.Module):
    """A model whose weight-by-activation products, found by tracing its call, are quantized: made by
    [`eqx_quant.quantize`][] with `example=` for the products a model writes with its own array leaves (bare
    weight arrays, custom layer classes, `jnp.einsum`), which no `eqx.nn` layer wraps.

    Calling it calls the model (its `__call__`: other methods of the model run unquantized on `model`, or, after
    [`eqx_quant.convert`][], whose traced weights are stored codes, on `eqx_quant.float_model(traced)`): the program
    of `model(*args, **kwargs)` is traced (once per compilation: an eager call is compiled as under `eqx.filter_jit`,
    see `__call__`) and run again with each quantized weight leaf replaced by its
    fake-quantized value (or, after [`eqx_quant.convert`][], the dequantized stored codes, bit for bit the same) and
    the activation operand of each of its products replaced by that operand's quantized value. Everything else in
    the program runs as traced. Where both operands are on symmetric integer grids with float32 scales, the input's
    constant along the contraction (per tensor or per token) and the weight's per tensor, per output channel or in
    tiles along its one summed axis, and `matmuls` says `"int"`, a `dot_general` is computed on the integers: an int32
    `dot_general` of the two operands' levels (one per tile), rescaled as [`eqx_quant.nn.QuantLinear`][] rescales
    (NaN where a contracted slice of either operand holds one), so that eager and compiled calls and the converted
    model give the same bits, and the same as a quantized linear layer; its derivatives are those of the float
    product of the fake-quantized operands. Other products (weight-only, float formats, convolutions) are the float
    product of the quantized operands, the weight computed before the product (see
    [Parity](../concepts/parity.md#fallbacks)).

    **Fields:**

    - `model`: the model, with its `eqx.nn` layers quantized as [`eqx_quant.quantize`][] quantizes them.
    - `weight_paths`: the paths of the traced weights in `model` (static).
    - `weight_quants`: the quantizer of each traced weight, applied to the whole leaf wherever the program reads it;
        a dynamic two-level one (NVFP4) of a stacked weight (see `stacks`) to each layer of the stack on its own, as
        to a stack of linear layers: one tensor scale per layer ([`eqx_quant.convert`][] stores the leaf with its
        layout `stacked` along the stack's axes).
    - `input_quants`: the quantizer of the activation operand of each traced weight's products, or `None`.
    - `stacks`: for each traced weight, the lengths of its leading axes that `jax.lax.scan`s step through (a stack
        of layers; see [`eqx_quant.TracedProduct`][]), `()` if none (static). An input quantizer whose arrays carry
        these leading axes (as [`eqx_quant.calibrate`][] makes them: one scale per layer) is stepped through with the
        weight, one layer's entries per step.
    - `matmuls`: for each traced weight, `"int"` for the integer product where the quantizers allow it, `"float"`
        for the float product of the quantized operands (static).
    - `product_quants`: the quantizers `(lhs, rhs)` of the products of two activations that the configuration
        reaches (`jnp.einsum` attention, say), each `None` for a float operand; such a product computes on the
        integers where both are on symmetric integer grids with one scale per tensor (and its int32 sums are exact),
        else as the float product of the quantized operands.
    - `product_indices`: which products of two activations those are: `k` for `products.k`, the `k`-th `dot_general`
        of two activations in the program's order (static; see [`eqx_quant.TracedProduct`][]).
    - `product_shapes`: the shapes `(lhs, rhs)` of the operands of each of those products in the example (static;
        see [`eqx_quant.TracedProduct`][] for which operand is which), or `()` where not known.
    - `product_count`: how many products of two activations the example computed (static), or `None`: a call that
        computes another number of them (another path through the model) is a `ValueError`, since `products.k`
        would name other products.
    - `pairings`: for each traced weight, its contracted axes in the order its products pair them with their input's
        (see [`eqx_quant.TracedProduct`][]), or `None` (static): what [`eqx_quant.gptq`][] needs to lay the weight out
        as a matrix.
    - `per_token`: for each traced weight, whether the [`eqx_quant.DynamicFakeQuant`][] input quantizer of its
        products has one scale per token (static): per index of the axes of each product's activation operand that
        the product does not sum over, whatever the rank of the call's inputs. `quantize` sets it where the input
        quantizer has one scale per index of exactly those axes of the example's first product (as
        [`eqx_quant.LayerQuantizer`][]`(..., per_token=True)` makes it); its own layout is then that product's.
        Convolutions keep the quantizer as it is.
    - `float_paths`: the paths of the model's other leaves that tracing found multiplied with activations, left in
        floating point (by the rules, or read through operations other than views, such as a concatenation of two
        leaves, each listed) (static): [`eqx_quant.summary`][] lists them. Rows picked from a leaf by indices that
        depend on the input (experts gathered by token) are activations, not listed here.
    - `input_transforms`: for each traced weight, an input transform `T` of its products' activation operand (from
        [`eqx_quant.smoothquant`][], [`eqx_quant.awq`][] or [`eqx_quant.rotate`][]), applied before its input
        quantizer, or `None`. It acts on the axes the products sum over, flattened in the order of the weight's
        `pairings` (with a stack's leading axes, stepped through with the weight), as a layer's transform acts on
        its input features; the weight leaf holds `W T⁻¹` along those axes (see [`eqx_quant.float_model`][]). A call
        in which the program reads such a weight otherwise than as the weight of `dot_general`s summing over those
        axes whole (a gather of a tied embedding, say) is a `ValueError`: that read would see the transformed weight.
    """

    model: PyTree
    weight_quants: tuple[AbstractQuantizer | None, ...]
    input_quants: tuple[AbstractQuantizer | None, ...]
    weight_paths: tuple[str, ...] = eqx.field(static=True)
    stacks: tuple[tuple[int, ...], ...] = eqx.field(static=True)
    matmuls: tuple[str, ...] = eqx.field(static=True)
    product_quants: tuple[tuple[AbstractQuantizer | None, AbstractQuantizer | None], ...]
    product_indices: tuple[int, ...] = eqx.field(static=True)
    product_count: int | None = eqx.field(static=True)
    pairings: tuple[tuple[int, ...] | None, ...] = eqx.field(static=True)
    per_token: tuple[bool, ...] = eqx.field(static=True)
    input_transforms: tuple[Any, ...]
    float_paths: tuple[str, ...] = eqx.field(static=True)
    product_shapes: tuple[tuple[tuple[int, ...], tuple[int, ...]], ...] = eqx.field(static=True)

    def __init__(
        self,
        model: PyTree,
        weight_quants: Sequence[AbstractQuantizer | None],
        input_quants: Sequence[AbstractQuantizer | None],
        weight_paths: Sequence[str],
        stacks: Sequence[tuple[int, ...]] | None = None,
        matmuls: Sequence[str] | None = None,
        product_quants: Sequence[tuple[AbstractQuantizer | None, AbstractQuantizer | None]] = (),
        product_indices: Sequence[int] = (),
        product_count: int | None = None,
        pairings: Sequence[tuple[int, ...] | None] | None = None,
        per_token: Sequence[bool] | None = None,
        input_transforms: Sequence[Any] | None = None,
        float_paths: Sequence[str] = (),
        product_shapes: Sequence[tuple[tuple[int, ...], tuple[int, ...]]] = (),
    ):
        """**Arguments:** the fields, in order; by default `stacks` is `()`, `matmuls` `"int"`, `per_token` `False`
        and `input_transforms` `None` for every weight, no product of two activations is quantized and no other
        weight is listed."""
        self.model = model
        self.weight_quants = tuple(weight_quants)
        self.input_quants = tuple(input_quants)
        self.weight_paths = tuple(weight_paths)
        n = len(self.weight_paths)
        self.stacks = tuple(tuple(s) for s in stacks) if stacks is not None else ((),) * n
        self.matmuls = tuple(matmuls) if matmuls is not None else ("int",) * n
        self.product_quants = tuple(tuple(pair) for pair in product_quants)  # pyright: ignore[reportAttributeAccessIssue]
        self.product_indices = tuple(product_indices)
        self.product_count = product_count
        self.pairings = (
            tuple(None if p is None else tuple(p) for p in pairings) if pairings is not None else (None,) * n
        )
        self.per_token = tuple(bool(t) for t in per_token) if per_token is not None else (False,) * n
        self.input_transforms = tuple(input_transforms) if input_transforms is not None else (None,) * n
        self.float_paths = tuple(float_paths)
        self.product_shapes = tuple((tuple(lhs), tuple(rhs)) for lhs, rhs in product_shapes)

    def __check_init__(self):
        from .nn._transforms import AbstractInputTransform  # here: `eqx_quant.nn` imports this module

        counts = [len(self.weight_paths), len(self.weight_quants), len(self.input_quants), len(self.stacks),
                  len(self.matmuls), len(self.pairings), len(self.per_token), len(self.input_transforms)]  # fmt: skip
        if len(set(counts)) != 1:
            raise ValueError(
                "`weight_paths`, `weight_quants`, `input_quants`, `stacks`, `matmuls`, `pairings`, `per_token` and "
                f"`input_transforms` must have one entry per traced weight, got {counts}."
            )
        for path, transform, pairing in zip(self.weight_paths, self.input_transforms, self.pairings, strict=True):
            if transform is None:
                continue
            if not isinstance(transform, AbstractInputTransform):
                raise TypeError(
                    f"`input_transforms` must hold input transforms or None, got {transform!r} for {path!r}."
                )
            if pairing is None:
                raise ValueError(
                    f"Traced weight {path!r} has an input transform but no `pairings` entry: the transform needs to "
                    "know how its products lay out the axes they sum over."
                )
        for matmul in self.matmuls:
            if matmul not in ("int", "float"):
                raise ValueError(f"`matmuls` must hold 'int' or 'float', got {matmul!r}.")
        shapes = len(self.product_shapes)
        if len(self.product_quants) != len(self.product_indices) or shapes not in (0, len(self.product_indices)):
            raise ValueError(
                f"`product_quants` and `product_indices` (and `product_shapes`, unless empty) must have one entry "
                f"per product, got {len(self.product_quants)}, {len(self.product_indices)} and "
                f"{len(self.product_shapes)}."
            )

    def quantized_model(self) -> PyTree:
        """`model` with each traced weight replaced by its quantized value: fake-quantized, or dequantized from its
        stored codes."""
        return self._quantized()[0]

    def _quantized(self) -> tuple[PyTree, dict[str, Codes], dict[str, IntWeight]]:
        """`quantized_model()`; the codes of the traced weights whose products may compute on integers (a symmetric
        integer grid per tensor, channel or tile, stored or fake-quantized, and `matmuls` `"int"`), and their
        grids."""
        index = {path: i for i, path in enumerate(self.weight_paths)}
        codes: dict[str, Codes] = {}
        bounds: dict[str, IntWeight] = {}

        def replace(key_path, leaf):
            path = path_string(key_path)
            i = index.get(path)
            if i is None:
                return leaf
            source = leaf if isinstance(leaf, QuantizedArray) else self.weight_quants[i]
            integer = self.matmuls[i] == "int" and _symmetric_integer(source, tiles=True)
            if integer:
                layout: Layout = source.layout  # pyright: ignore[reportOptionalMemberAccess]
                axis = layout.tile_axis(leaf.shape)
                length = None if axis is None else leaf.shape[axis]
                bounds[path] = IntWeight(_bound(source.format), layout.group_size, axis, length)  # pyright: ignore
            # The value passes a conditional in every case: a product that computes in float reads it (one without
            # an integer input, or after a cast), and XLA would fuse its computation into that product and sum it
            # in an order that differs between the fake-quant and the converted model. So do the integer products'
            # scales of a static quantizer: constants, which XLA would multiply with the input's constant scale
            # first, rounding otherwise than with the converted model's stored scales.
            if isinstance(leaf, QuantizedArray):
                if integer:
                    scale = _full_scale(leaf)
                    codes[path] = Codes(leaf.unpacked().reshape(leaf.shape), scale, None)
                return computed_before(leaf.dequantize(), leaf.scale)
            quantizer = self.weight_quants[i]
            if quantizer is None:
                return leaf
            if two_level(quantizer) and self.stacks[i]:  # one tensor scale per layer of the stack
                return computed_before(each_layer(quantizer, leaf, len(self.stacks[i])), leaf)  # pyright: ignore[reportArgumentType]
            if not integer:
                return computed_before(quantizer(leaf), leaf)
            value, array, nan = quantizer.fake_quant_and_array(leaf)  # pyright: ignore[reportAttributeAccessIssue]
            scale = _full_scale(array, leaf if isinstance(quantizer, FakeQuant) else None)
            codes[path] = Codes(array.values.reshape(leaf.shape), scale, nan.reshape(leaf.shape))
            return computed_before(value, leaf)

        is_stored = lambda x: isinstance(x, QuantizedArray)  # noqa: E731
        return jax.tree_util.tree_map_with_path(replace, self.model, is_leaf=is_stored), codes, bounds

    def _check_reads(self, jaxpr: Any, views: list[_View | None], owner: dict[int, int], leaves: list) -> None:
        """Raises if the program reads a weight with an input transform otherwise than through its products; inside
        `probe_reads`, records for every traced weight whether it does."""
        watched = {
            i: (jnp.shape(leaves[i]), self.pairings[k])
            for i, k in owner.items()
            if _probes or self.input_transforms[k] is not None
        }
        if not watched:
            return
        stray, used = stray_reads(jaxpr, views, watched)
        for i, k in owner.items():
            path = self.weight_paths[k]
            if _probes:  # read in whole products, and in no other way, by every call
                why = "stray" if i in stray else None if i in used else "unused"
                _probes[-1][path] = _probes[-1].get(path) or why
            if i in stray and self.input_transforms[k] is not None:
                raise ValueError(
                    f"Traced weight {path!r} has an input transform ({type(self.input_transforms[k]).__name__}), "
                    "but this call reads the weight otherwise than as the weight of products summing over its "
                    f"contracted axes {self.pairings[k]} whole (a gather, arithmetic, a reversal, padding or rounding "
                    "of it, a slice of those axes, another pairing): that read would see the transformed weight on "
                    "an untransformed input."
                )

    def _record_batches(self, jaxpr: Any, views: list[_View | None], owner: dict[int, int], leaves: list) -> None:
        """Inside `probe_batches`, records the batch axes of every product of each traced weight."""
        uses: list[_Use] = []
        walk(jaxpr, views, uses)
        for use in uses:
            if use.leaf in owner and use.primitive != "unfollowed":
                shape = jnp.shape(leaves[use.leaf])
                whole = all(shape[a] == use.input_shape[x] for a, x in use.batch)
                axes = tuple(a for a, _ in use.batch) if whole else None
                _batch_probes[-1].setdefault(self.weight_paths[owner[use.leaf]], set()).add(axes)

    def _activation_products(self, jaxpr: Any, views: list[_View | None]) -> tuple[dict, frozenset]:
        """The quantizers of the products of two activations to quantize, by the chain of ids of their equation and
        of the equations that hold it in `jaxpr`, and the chains of those holders."""
        if not self.product_indices:
            return {}, frozenset()
        uses: list[_Use] = []
        walk(jaxpr, views, uses)
        found = [use for use in uses if use.leaf < 0 and not use.loop]
        if self.product_count is not None and len(found) != self.product_count:
            raise ValueError(
                f"This call computes {len(found)} products of two activations where the example computed "
                f"{self.product_count}: the rules' `products.k` name them in the example's order, which this call "
                "does not follow. Quantize with an example that takes the same path through the model."
            )
        chosen = dict(zip(self.product_indices, self.product_quants, strict=True))
        if max(self.product_indices) >= len(found):
            raise ValueError(
                f"The model computes {len(found)} products of two activations in this call, but quantizers were "
                f"given to products.{max(self.product_indices)}: the call does not follow the example's structure."
            )
        products = {(*use.outer, id(use.eqn)): chosen[k] for k, use in enumerate(found) if k in chosen}
        holders = frozenset(
            use.outer[: i + 1] for k, use in enumerate(found) if k in chosen for i in range(len(use.outer))
        )
        return products, holders

    def float_model(self) -> PyTree:
        """`model` with its traced weights as float arrays again: the float leaves, or the stored codes
        dequantized; a weight with an input transform `T` becomes `W T` along its contracted axes, the weight that
        computes on the input what the transformed weight computes on `T x` (the weight it was made from, to
        rounding error)."""
        from .nn._transforms import restored  # here: `eqx_quant.nn` imports this module

        index = {path: i for i, path in enumerate(self.weight_paths)}
        is_stored = lambda x: isinstance(x, QuantizedArray)  # noqa: E731

        def float_leaf(key_path: Any, leaf: Any) -> Any:
            i = index.get(path_string(key_path))
            if i is None:
                return leaf
            leaf = leaf.dequantize() if is_stored(leaf) else leaf
            transform = self.input_transforms[i]
            if transform is None:
                return leaf
            depth, pairing = len(self.stacks[i]), self.pairings[i]
            return from_matrix(restored(transform, as_matrix(leaf, depth, pairing)), leaf.shape, depth, pairing)

        return jax.tree_util.tree_map_with_path(float_leaf, self.model, is_leaf=is_stored)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """`model(*args, **kwargs)` with the traced weights and their products' inputs quantized.

        Called eagerly (no argument traced) with arrays, PyTrees of arrays, `None`, booleans and strings, it runs as
        one program compiled once per shape, as under `eqx.filter_jit` (whose cache keeps the model's non-array
        parts, not its arrays); with other Python values (numbers a call may branch on), or a model whose non-array
        parts cannot be hashed or compared, it runs the model's operations one by one, tracing the model at every
        call."""
        if _probes or _batch_probes or not all(_static_free(leaf) for leaf in jax.tree.leaves((args, kwargs))):
            return self._call(*args, **kwargs)
        try:
            return _one_call(self, *args, **kwargs)
        except ValueError as error:
            # Non-array parts that do not hash or compare (a mutable dataclass, a NumPy array in a static field): the
            # compiled programs' cache cannot key on them. Refused before any tracing, so nothing has run.
            if not any(why in str(error) for why in _UNKEYED):
                raise
            return self._call(*args, **kwargs)

    def _call(self, *args: Any, **kwargs: Any) -> Any:
        index = {path: i for i, path in enumerate(self.weight_paths)}
        model, codes, bounds = self._quantized()
        traced = _trace(lambda inputs: inputs[0](*inputs[1], **inputs[2]), (model, args, kwargs))
        layers = [path for path, _ in nodes(model, layer_types())]
        owner: dict[int, int] = {}  # program input -> traced weight
        integer: dict[int, IntWeight] = {}  # program input -> its grid, for integer products
        views: list[_View | None] = []
        held: list[Codes | None] = []
        for i, (key_path, leaf) in enumerate(zip(traced.paths, traced.leaves, strict=True)):
            path = path_string(key_path[1:]) if key_path[0].idx == 0 else None
            k = index.get(path) if path is not None else None
            held.append(codes.get(path) if path is not None else None)
            if k is not None:
                owner[i] = k
                views.append(_leaf_view(leaf, i))
                if path in bounds:
                    integer[i] = bounds[path]
            else:  # the model's other arrays: their products are not products of two activations
                other = path is not None and (_candidate(leaf) or _under(path, layers))  # a converted layer's codes too
                views.append(_leaf_view(leaf, i, layer=True) if other else None)
        quantizers = {
            leaf: ((self.input_transforms[k], self.input_quants[k]), len(self.stacks[k])) for leaf, k in owner.items()
        }
        closed = traced.jaxpr
        self._check_reads(closed.jaxpr, views, owner, traced.leaves)
        if _batch_probes:
            self._record_batches(closed.jaxpr, views, owner, traced.leaves)
        products, holders = self._activation_products(closed.jaxpr, views)
        tokens = frozenset(leaf for leaf, k in owner.items() if self.per_token[k])
        pairings = {leaf: self.pairings[k] for leaf, k in owner.items()}
        inputs = Inputs(quantizers, tokens, integer, products, holders, pairings)
        followed: set[int] = set()
        outs = evaluate(closed.jaxpr, closed.consts, traced.leaves, views, held, inputs, followed=followed)
        # A traced weight with an input quantizer, in no product with an activation in this call but in a product
        # with another weight: the example's products of it, whose inputs its quantizer quantizes, were computed
        # in another order (a `jnp.einsum` of three operands orders its products by the operands' shapes).
        unseen = [i for i, k in owner.items() if i not in followed and self.input_quants[k] is not None]
        paired = _multiplied_by_weights(closed.jaxpr, views) if unseen else set()
        for i in unseen:
            if i in paired:
                raise ValueError(
                    f"This call multiplies the traced weight {self.weight_paths[owner[i]]!r} by another of the "
                    "model's arrays, and by no activation: the example's products of it, whose inputs its quantizer "
                    "quantizes, are not computed. A `jnp.einsum` of three or more operands chooses the order of its "
                    "products from the operands' shapes: give it `optimize=False` (left to right) or write it as "
                    "products of two operands, or quantize with an example of the shapes the model is called with."
                )
        out_dynamic, out_static = traced.out
        return eqx.combine(jax.tree.unflatten(jax.tree.structure(out_dynamic), outs), out_static)


def _static_free(leaf: object) -> bool:
    """Whether an argument's leaf is one that `jax.jit` would not compile a program for each value of."""
    return eqx.is_array(leaf) or leaf is None or isinstance(leaf, (bool, str))


# JAX's refusals of static arguments that its compiled programs' cache cannot key on.
_UNKEYED = ("Non-hashable static arguments", "static arguments should be comparable")


_one_call = one_program(lambda traced, *args, **kwargs: traced._call(*args, **kwargs))


def replaced(traced: QuantTraced, **changes: Any) -> QuantTraced:
    """`traced` with some of its fields replaced, the others as they are."""
    fields = dict(model=traced.model, weight_quants=traced.weight_quants, input_quants=traced.input_quants,
                  weight_paths=traced.weight_paths, stacks=traced.stacks, matmuls=traced.matmuls,
                  product_quants=traced.product_quants, product_indices=traced.product_indices,
                  product_count=traced.product_count, pairings=traced.pairings,
                  per_token=traced.per_token, input_transforms=traced.input_transforms,
                  float_paths=traced.float_paths, product_shapes=traced.product_shapes)  # fmt: skip
    return QuantTraced(**(fields | changes))


def leaves_by_path(model: PyTree) -> dict[str, Any]:
    """The leaves of `model` by path, a stored [`eqx_quant.QuantizedArray`][] as one leaf: a traced model's weights
    as `weight_paths` names them."""
    is_stored = lambda x: isinstance(x, QuantizedArray)  # noqa: E731
    return {path_string(p): x for p, x in jax.tree_util.tree_flatten_with_path(model, is_leaf=is_stored)[0]}


def as_matrix(weight: Any, depth: int, pairing: tuple[int, ...]) -> Any:
    """A traced weight as a stack of linear layers' weights `(*stack, rows, columns)`: its contracted leaf axes
    `pairing` last, in that order, flattened into the columns; its other axes after the stack's `depth` leading
    ones flattened into the rows."""
    n = len(pairing)
    moved = jnp.moveaxis(weight, pairing, tuple(range(-n, 0)))
    columns = math.prod(weight.shape[a] for a in pairing)
    return moved.reshape(weight.shape[:depth] + (-1, columns))


def from_matrix(matrix: Any, shape: tuple[int, ...], depth: int, pairing: tuple[int, ...]) -> Any:
    """The inverse of `as_matrix`: the weight of `shape` from its matrix."""
    n = len(pairing)
    others = tuple(shape[a] for a in range(len(shape)) if a not in pairing)
    moved = matrix.reshape(others + tuple(shape[a] for a in pairing))
    return jnp.moveaxis(moved, tuple(range(-n, 0)), pairing)


def _full_scale(array: QuantizedArray, anchor: Any = None) -> Any:
    """The float32 scales of an integer array broadcast to its shape; with an `anchor`, computed before (see
    `computed_before`), so that XLA does not fold them with other constants."""
    scale = array.scale if anchor is None else computed_before(array.scale, anchor)
    return jnp.broadcast_to(scale, array.view_shape).reshape(array.shape)


def trace_call(example: object) -> Callable[[PyTree], Any]:
    """The call `f(model)` that `quantize`'s `example` describes: a tuple of positional arguments, or a function."""
    if callable(example):
        return example  # pyright: ignore[reportReturnType]
    if isinstance(example, tuple):
        # Shapes stand for arrays: tracing reads nothing but their shapes and dtypes.
        concrete = jax.tree.map(
            lambda a: jnp.zeros(a.shape, a.dtype) if isinstance(a, jax.ShapeDtypeStruct) else a, example
        )
        return lambda model: model(*concrete)
    raise TypeError(
        f"`example` must be a tuple of arguments for one call `model(*example)`, or a function f(model) that calls "
        f"the model, got {example!r}."
    )
