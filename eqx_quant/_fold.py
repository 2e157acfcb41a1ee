"""Where a per-channel factor on a layer's input can be folded into the model: layers whose input is a
normalisation's output `a * γ` or `a * γ + β` (`γ`, `β` array leaves of the model, one entry per channel), read by
those layers only; and layers whose input is a preceding linear layer's output, or a part of its channels (the values
of a fused query-key-value projection), seen through operations that commute with a positive per-channel factor
(ReLU, a gate's product, attention's mixing of the tokens, reshapes). Found on the model's program (its jaxpr), so
that any model written that way is found: `eqx.nn.LayerNorm`, `eqx.nn.RMSNorm`, `eqx.nn.MLP`,
`eqx.nn.MultiheadAttention` and a model's own."""

import functools
import itertools
import warnings
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jax.extend import core as jex
from jaxtyping import Array, PyTree

from ._misc import caller_stacklevel, reshape_blocks
from ._tree import map_nodes, path_string
from .nn._layers import QuantLinear
from .nn._transforms import AbstractInputTransform


_INPUT, _OUTPUT = "eqx_quant.fold_input", "eqx_quant.fold_output"  # the scopes of the marks


@functools.cache
def _marker(scope: str, index: int) -> Callable[[Array, Array], Array]:
    """The mark of layer `index`'s input or output (`scope`): an identity of the value (kept by XLA, inside a named
    scope holding the index), with the layer's weight beside it. Under `jax.vmap` it is marked again with the batch
    axes in front (JAX moves them there for a `custom_vmap` rule), so that in the program the marked value holds the
    layer's channels on its last axis, and is the value the model computed only where no axis had to move."""

    @jax.custom_batching.custom_vmap
    def mark(x: Array, weight: Array) -> Array:
        with jax.named_scope(f"{scope}[{index}]"):
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
        return _marker(_INPUT, self.index)(x, self.weight)

    def absorb(self, weight: Array) -> Array:
        return weight

    def restore(self, weight: Array) -> Array:
        return weight


class _Produces(eqx.Module):
    """A layer whose output is marked, with its weight: used only to trace the model, never to run it. The layer it
    wraps holds stand-ins (`jax.ShapeDtypeStruct`s) for its weight and bias, so that any read of them besides the
    call (`tree_leaves` of the layer, its `.weight` in a tied head) reads a stand-in, which the walk counts; its
    other attributes read through."""

    wrapped: QuantLinear
    real_weight: Array  # names no model reads: `.weight` and `.bias` read through to the stand-ins
    real_bias: Array | None
    index: int = eqx.field(static=True)

    def __call__(self, x: Array, *args: Any, **kwargs: Any) -> Array:
        layer = eqx.tree_at(lambda l: l.layer.weight, self.wrapped, self.real_weight)
        if self.real_bias is not None:
            layer = eqx.tree_at(lambda l: l.layer.bias, layer, self.real_bias)
        return _marker(_OUTPUT, self.index)(layer(x, *args, **kwargs), self.real_weight)

    def __getattr__(self, name: str) -> Any:
        if name == "wrapped" or name.startswith("_"):  # not set yet, or probed by Python (`inspect.signature`)
            raise AttributeError(name)
        return getattr(self.wrapped, name)


def _produces(layer: QuantLinear, index: int) -> tuple[_Produces, list[jax.ShapeDtypeStruct]]:
    """`layer` wrapped to mark its output, and the stand-ins of its weight and bias."""
    inner = layer.layer
    stand_ins = [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in (inner.weight, inner.bias) if a is not None]
    wrapped = eqx.tree_at(lambda l: l.layer.weight, layer, stand_ins[0])
    if inner.bias is not None:
        wrapped = eqx.tree_at(lambda l: l.layer.bias, wrapped, stand_ins[1])
    return _Produces(wrapped, inner.weight, inner.bias, index), stand_ins


class Fold(NamedTuple):
    """Layers whose common input is `a * γ (+ β)` (the paths of the leaves `γ` and `β`, or None) or the output of
    the linear layer at `producer` (seen through operations that commute with a positive per-channel factor): the
    paths of those and of the layers, and the producer's output channels (`rows` of its weight) that the layers'
    input channels are, in order (None: all of them, in order)."""

    gamma: str | None
    beta: str | None
    layers: tuple[str, ...]
    producer: str | None = None
    rows: tuple[int, ...] | None = None


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


def _marked_layer(eqn: Any) -> tuple[str, int] | None:
    """The scope (`_INPUT` or `_OUTPUT`) and the index of the layer whose input or output `eqn` marks, if it is a
    mark (the `custom_vmap` call around the named barrier)."""
    if eqn.primitive.name != "custom_vmap_call":
        return None
    for inner in eqn.params["call"].jaxpr.eqns:
        stack = str(inner.source_info.name_stack)
        for scope in (_INPUT, _OUTPUT):
            start = stack.rfind(f"{scope}[")
            if inner.primitive.name == "optimization_barrier" and start >= 0:
                start += len(scope) + 1
                return scope, int(stack[start : stack.index("]", start)])
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


# The operations whose program is called on their operands, one for one (an inner `jax.jit`, `jax.checkpoint`, a
# custom derivative's function); not a reduction's or a window's program, which combines elements of one operand.
_CALLS = {"jit", "pjit", "closed_call", "core_call", "remat2", "checkpoint", "custom_jvp_call", "custom_vjp_call",
          "custom_vjp_call_jaxpr", "custom_vmap_call"}  # fmt: skip


def _inner(eqn: Any) -> Iterator[tuple[Any, list | None]]:
    """The sub-programs of `eqn`, each with, per input, the position of the operand of `eqn` it takes and whether a
    scan slices it (None where no operand is taken as it is: a scan's carries); or with None where the operands are
    not followed into it (a `while` loop's, a reduction's, and any other program but a call's, `_CALLS`)."""
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
            followed = eqn.primitive.name in _CALLS and len(jaxpr.invars) == len(eqn.invars)
            yield jaxpr, [(i, False) for i in range(len(eqn.invars))] if followed else None


class Found(NamedTuple):
    """What `find_folds` finds: the folds, and the layers (of the targets and producers) whose weight or bias the
    model reads besides calling them."""

    folds: list[Fold]
    read_elsewhere: frozenset[str]


def find_folds(
    model: PyTree, targets: list[str], batch: PyTree, batched: bool, producers: list[str] | None = None
) -> Found:
    """The groups of `targets` (paths of `QuantLinear` layers of `model`) whose input is a normalisation's output
    `a * γ (+ β)`, or channels of the output of one of `producers` (paths of `QuantLinear` layers), that nothing else
    reads, found in the program of one call on `batch` (as calibration calls the model):

    - after a normalisation, every call of each layer of a group reads that value (with its input channels on the
        value's last axis), `γ` and `β` are leaves of one entry per input channel read by that operation alone, and
        in a scan they are sliced together with the layers' weights;
    - after a producer, the model calls the producer and each layer of the group once, the layers' inputs (channels
        on their last axes) are the same channels of the producer's output (all, or a part: `Fold.rows`) seen only
        through operations that commute with a positive factor per channel (`_through`), nothing else reads those
        channels or what those operations make of them (the other channels may be read in any way), and in a scan
        the producer's and the layers' weights are sliced together.

    A layer reached from two sources is left out of both, and so is a stack whose layers are not computed one at a
    time (a scan stepping through their weights). Producers and targets are wrapped to count the reads of their
    weights and biases besides their calls (`tree_leaves` of a layer, its `.weight` in a tied head): a producer
    read so is left out, and those layers are returned. If the model cannot be traced with the wrappers at all, no
    layer folds into a producer and no read is counted."""
    producers = list(producers or [])
    wrapped = list(dict.fromkeys(producers + targets))  # the layers whose reads are counted
    index = {path: i for i, path in enumerate(targets)}

    def trace(produced: dict[str, int]):
        owner_of: dict[int, int] = {}  # the id of each stand-in, to the index of its layer in `wrapped`

        def mark(path: str, layer: QuantLinear) -> eqx.Module:
            if path in index:
                marked = _Mark(layer.layer.weight, index[path])
                layer = eqx.tree_at(lambda l: l.input_transform, layer, marked, is_leaf=lambda x: x is None)
            if path not in produced:
                return layer
            wrapper, arrays = _produces(layer, produced[path])
            owner_of.update({id(a): produced[path] for a in arrays})
            return wrapper

        is_input = lambda x: eqx.is_array(x) or isinstance(x, jax.ShapeDtypeStruct)  # noqa: E731
        dynamic, static = eqx.partition(map_nodes(model, (QuantLinear,), mark), is_input)

        def call(d: PyTree, b: PyTree) -> PyTree:
            m = eqx.combine(d, static)
            return m(b) if batched else jax.vmap(m)(b)

        flat = jax.tree_util.tree_flatten_with_path(dynamic)[0]
        owners = {path_string(p): owner_of[id(leaf)] for p, leaf in flat if id(leaf) in owner_of}
        return jax.make_jaxpr(call)(dynamic, batch), [path_string(p) for p, _ in flat], owners

    try:
        closed, paths, stand_ins = trace({path: i for i, path in enumerate(wrapped)})
    except Exception as error:  # the model reads a layer in a way the wrapper does not pass on: trace it without
        if wrapped:
            warnings.warn(
                f"The model could not be traced with its layers wrapped to see what reads them ({type(error).__name__}"
                f": {error}). No layer's factors fold into a linear layer before it, and reads of a layer's weight "
                "besides its call go unseen.",
                stacklevel=caller_stacklevel(),
            )
        producers, wrapped = [], []
        closed, paths, stand_ins = trace({})
    ndims = {p: v.aval.ndim for v, p in zip(closed.jaxpr.invars, paths, strict=False)}
    top = {v: _Origin(p, v.aval.ndim - 1) for v, p in zip(closed.jaxpr.invars, paths, strict=False)}
    uses: dict[str, int] = {}  # per leaf: the reads of it (or of its views) other than views and sub-programs
    calls: dict[int, list[_Call]] = {}  # per target: the marks of its input
    outputs: dict[int, list[_Call]] = {}  # per producer: the marks of its output
    walks: list[tuple[Any, dict]] = []  # each walk of a program (one may be walked at several call sites)
    scans = itertools.count()  # a number per scan operation walked
    liveness: dict = {}  # `_live`'s answers, per program

    def read(origin: _Origin | None) -> None:
        if origin is not None:
            uses[origin.path] = uses.get(origin.path, 0) + 1

    def walk(jaxpr: Any, origins: dict) -> None:
        number = len(walks)
        walks.append((jaxpr, origins))
        live = _live(jaxpr, liveness)[0]
        for eqn in jaxpr.eqns:
            viewed = [origins.get(v) if isinstance(v, jex.Var) else None for v in eqn.invars]
            name, marked = eqn.primitive.name, _marked_layer(eqn)
            if marked is not None:
                scope, i = marked
                value = eqn.invars[0] if scope == _INPUT else eqn.outvars[0]
                (calls if scope == _INPUT else outputs).setdefault(i, []).append(_Call(number, value, viewed[1]))
                continue
            if eqn not in live:  # its result is never used: its reads change nothing
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
    read_elsewhere = {i for path, i in stand_ins.items() if uses.get(path, 0)}

    def one_at_a_time(weight: _Origin | None) -> bool:  # a call with one layer's weight, the stack scanned through
        return weight is not None and len(weight.scans) == ndims[weight.path] - 2

    for i, produced in outputs.items():
        if wrapped[i] not in producers or i in read_elsewhere:
            continue
        if len(produced) != 1 or not one_at_a_time(produced[0].weight):
            continue
        (out,) = produced
        scans = out.weight.scans  # pyright: ignore[reportOptionalMemberAccess]
        n = out.value.aval.shape[-1]
        spoilt = np.zeros(n, bool)
        start = {out.value: _Track((out.value.aval.ndim - 1,), np.arange(n))}
        readers = {}  # per part of the producer's channels, the layers reading it
        for j, value, channels in _follow(walks[out.walk][0], start, spoilt, top=True).reached:
            (call, *more) = calls[j]
            stepped = one_at_a_time(call.weight) and call.weight.scans == scans  # pyright: ignore[reportOptionalMemberAccess]
            if not more and call.value is value and stepped:
                readers.setdefault(channels.tobytes(), (channels, set()))[1].add(j)
            else:  # a layer that will not fold reads these channels: they must stay as they are
                spoilt[channels] = True
        counts = np.zeros(n, int)  # per channel, the groups reading it
        for channels, _ in readers.values():
            counts[np.unique(channels)] += 1
        for channels, layers in readers.values():
            if not spoilt[channels].any() and np.all(counts[channels] == 1):
                rows = None if np.array_equal(channels, np.arange(n)) else tuple(channels.tolist())
                folds.append(Fold(None, None, tuple(targets[j] for j in sorted(layers)), wrapped[i], rows))
    claims: dict[str, int] = {}
    for f in folds:
        for layer in f.layers:
            claims[layer] = claims.get(layer, 0) + 1
    unique = [f for f in folds if all(claims[layer] == 1 for layer in f.layers)]
    return Found(unique, frozenset(wrapped[i] for i in read_elsewhere))


def _live(jaxpr: Any, memo: dict) -> tuple[set, set]:
    """The operations of `jaxpr` whose results the program uses (towards its outputs) or that have effects, and the
    inputs of `jaxpr` they use. An operation holding programs uses the operands its programs use (a scan's carries
    and a conditional's index always). `memo` keeps the answer for each program (by its id, while it is alive)."""
    if id(jaxpr) not in memo:
        needed = {v for v in jaxpr.outvars if isinstance(v, jex.Var)}
        live = set()
        for eqn in reversed(jaxpr.eqns):
            if eqn.effects or any(v in needed for v in eqn.outvars):
                live.add(eqn)
                needed.update(_used_operands(eqn, memo))
        memo[id(jaxpr)] = live, {v for v in jaxpr.invars if v in needed}
    return memo[id(jaxpr)]


def _used_operands(eqn: Any, memo: dict) -> list:
    """The operands of `eqn` that its computation uses: all, but those that its programs take and never use."""
    operands = [v for v in eqn.invars if isinstance(v, jex.Var)]
    subs = list(_inner(eqn))
    if not subs or any(mapping is None for _, mapping in subs):
        return operands
    used, mapped = set(), set()
    for sub, mapping in subs:
        inputs = _live(sub, memo)[1]
        for v, operand in zip(sub.invars, mapping, strict=False):
            if operand is not None:
                mapped.add(operand[0])
                if v in inputs:
                    used.add(operand[0])
    return [v for i, v in enumerate(eqn.invars) if isinstance(v, jex.Var) and (i in used or i not in mapped)]


# The operations that commute with a positive per-channel factor on one operand, keeping its channels where they are.
_ELEMENTWISE = {"convert_element_type", "copy", "neg", "abs", "reduce_precision"}
_CONTROL_FLOW = {"scan", "while", "cond"}
_COMPARISONS = {"gt", "ge", "lt", "le", "eq", "ne"}  # with 0: a positive factor changes no sign


class _Track(NamedTuple):
    """A followed value: its axes that hold a producer's channels (most significant first), and the producer's
    channel at each position of those axes (an array of their sizes)."""

    axes: tuple[int, ...]
    channels: np.ndarray

    def same(self, other: "_Track") -> bool:
        return self.axes == other.axes and np.array_equal(self.channels, other.channels)


class _Followed(NamedTuple):
    """What `_follow` finds: the marked layer inputs reached (`(index, value, channels)`, the producer's channel of
    each of the layer's input channels), and the program's outputs reached (by position)."""

    reached: list
    returned: dict


def _follow(
    jaxpr: Any, tracked: dict, spoilt: np.ndarray, zeros: frozenset = frozenset(), top: bool = False
) -> _Followed:
    """Follows the values of `tracked` (`_Track`s) through `jaxpr`, whose inputs `zeros` are zeros. An operation
    that reads one in a way that does not commute with a positive per-channel factor spoils the channels it reads
    (`spoilt`, a mask over the producer's channels), and so does (`top`) returning one. A value of spoilt channels
    alone is no longer followed: they keep their values, and so does it."""
    made_by = {v: e for e in jaxpr.eqns for v in e.outvars}
    reached: list = []
    for eqn in jaxpr.eqns:
        tracks = [tracked.get(v) if isinstance(v, jex.Var) else None for v in eqn.invars]
        tracks = [None if t is None or spoilt[t.channels].all() else t for t in tracks]
        if all(t is None for t in tracks):
            continue
        out = _through(eqn, tracks, reached, spoilt, lambda v: _zero(v, made_by, zeros))
        if out is None:
            for t in tracks:
                if t is not None:
                    spoilt[t.channels] = True
            continue
        tracked.update({v: t for v, t in zip(eqn.outvars, out, strict=True) if t is not None})
    returned = {i: tracked[v] for i, v in enumerate(jaxpr.outvars) if isinstance(v, jex.Var) and v in tracked}
    if top:
        for t in returned.values():
            spoilt[t.channels] = True
        returned = {}
    return _Followed(reached, returned)


def _zero(v: Any, made_by: dict, zeros: frozenset) -> bool:
    """Whether `v` is a literal 0, one of `zeros`, or a broadcast or cast of one."""
    if isinstance(v, jex.Literal):
        return bool(np.all(np.asarray(v.val) == 0))
    if v in zeros:
        return True
    eqn = made_by.get(v)
    if eqn is not None and eqn.primitive.name in ("broadcast_in_dim", "convert_element_type"):
        return _zero(eqn.invars[0], made_by, zeros)
    return False


def _through(eqn: Any, tracks: list, reached: list, spoilt: np.ndarray, zero: Callable[[Any], bool]) -> list | None:
    """The `_Track`s of the outputs of `eqn` (`None` where an output is not followed), given those of its inputs
    (`None` where an input is not followed), if it commutes with a positive per-channel factor on the followed
    inputs; `None` otherwise. A marked layer input is recorded in `reached`; a sub-program is followed with the
    channels already `spoilt`; `zero(v)` tells whether an operand is zero."""
    if not eqn.outvars:  # an effect (a debug print, say): not followed
        return None
    name, shapes = eqn.primitive.name, [v.aval.shape for v in eqn.invars]
    out_shape = eqn.outvars[0].aval.shape
    followed = [i for i, t in enumerate(tracks) if t is not None]
    first = tracks[followed[0]]
    one = len(followed) == 1
    marked = _marked_layer(eqn)
    if marked is not None:
        if marked[0] == _INPUT and followed == [0] and first.axes == (len(shapes[0]) - 1,):
            reached.append((marked[1], eqn.invars[0], first.channels))
            return [None] * len(eqn.outvars)
        return None
    if name in _ELEMENTWISE:
        floating = jnp.issubdtype(eqn.outvars[0].aval.dtype, jnp.floating)
        return [first] if floating else None  # a cast to integers rounds
    if name in ("mul", "div", "max", "min") and one and shapes[followed[0]] == out_shape:
        other = eqn.invars[1 - followed[0]]
        if name == "mul" or (name == "div" and followed == [0]) or (name in ("max", "min") and zero(other)):
            return [first]
        return None
    if name in _COMPARISONS and one:
        return [None] if zero(eqn.invars[1 - followed[0]]) else None  # a sign, which the factor keeps
    if name == "sign":
        return [None]
    if name == "select_n" and 0 not in followed:
        cases = [i for i in range(1, len(tracks)) if i not in followed]
        same = all(tracks[i].same(first) and shapes[i] == out_shape for i in followed)
        return [first] if same and all(zero(eqn.invars[i]) for i in cases) else None
    if name in ("add", "sub", "add_any") and len(followed) == 2 and first.same(tracks[1]) and shapes[0] == shapes[1]:
        return [first]  # both carry the same factor
    subs = list(_inner(eqn))
    if subs:  # a call of a program (an inner `jax.jit`, a custom derivative's function): followed into it
        if name in _CONTROL_FLOW or len(subs) != 1 or subs[0][1] is None or len(subs[0][0].outvars) != len(eqn.outvars):
            return None
        sub, operands = subs[0]
        inner = {
            v: tracks[position]
            for v, (position, _) in zip(sub.invars, operands, strict=True)
            if tracks[position] is not None
        }
        zeros = frozenset(
            v for v, (position, _) in zip(sub.invars, operands, strict=True) if zero(eqn.invars[position])
        )
        found = _follow(sub, inner, spoilt, zeros)
        reached.extend(found.reached)
        return [found.returned.get(i) for i in range(len(eqn.outvars))]
    if not one:
        return None
    if name == "transpose":
        permutation = list(eqn.params["permutation"])
        return [first._replace(axes=tuple(permutation.index(a) for a in first.axes))]
    if name == "broadcast_in_dim":  # a channel axis of length 1 spread along its axis: one channel, repeated
        dims, kept = (
            eqn.params["broadcast_dimensions"],
            _without_single(first, {a for a in first.axes if shapes[0][a] == 1}),
        )
        return [kept._replace(axes=tuple(dims[a] for a in kept.axes))]
    if name in ("squeeze", "reduce_sum", "reduce_max", "reduce_min"):
        dropped = eqn.params["dimensions" if name == "squeeze" else "axes"]
        if name != "squeeze" and any(a in dropped for a in first.axes):
            return None  # a sum or maximum over channels
        kept = _without_single(first, set(dropped))
        return [kept._replace(axes=tuple(a - sum(d < a for d in dropped) for a in kept.axes))]
    if name == "reshape" and eqn.params.get("dimensions") is None:
        return [_reshaped(shapes[0], out_shape, first)]
    if name == "slice":
        strides = eqn.params["strides"] or (1,) * len(out_shape)
        taken = tuple(
            slice(eqn.params["start_indices"][a], eqn.params["limit_indices"][a], strides[a]) for a in first.axes
        )
        return [first._replace(channels=first.channels[taken])]
    if name == "split":
        axis, sizes = eqn.params["axis"], eqn.params["sizes"]
        if axis not in first.axes:
            return [first] * len(sizes)
        j, starts = first.axes.index(axis), np.cumsum([0, *sizes])
        return [
            first._replace(channels=np.take(first.channels, range(a, b), axis=j)) for a, b in itertools.pairwise(starts)
        ]
    if name == "dot_general":
        return _dot_general(eqn, followed[0], first)
    return None


def _without_single(track: _Track, axes: set) -> _Track:
    """`track` without those of `axes` that are its channel axes (each of size 1: one channel, then held by no axis)."""
    keep = [j for j, a in enumerate(track.axes) if a not in axes]
    gone = tuple(j for j in range(len(track.axes)) if j not in keep)
    return _Track(tuple(track.axes[j] for j in keep), track.channels.squeeze(gone) if gone else track.channels)


def _dot_general(eqn: Any, side: int, track: _Track) -> list | None:
    """The `_Track` of a `dot_general`'s output, with that of operand `side` given (the other not followed): the
    channels must not be contracted."""
    (contracting, batch) = [pair[side] for pair in eqn.params["dimension_numbers"]]
    ndims = [v.aval.ndim for v in eqn.invars]
    if any(a in contracting for a in track.axes):
        return None
    free = [
        [i for i in range(ndims[s]) if i not in eqn.params["dimension_numbers"][0][s]
         and i not in eqn.params["dimension_numbers"][1][s]]
        for s in (0, 1)
    ]  # fmt: skip
    offset = len(batch) + (len(free[0]) if side == 1 else 0)
    position = {b: k for k, b in enumerate(batch)} | {f: offset + k for k, f in enumerate(free[side])}
    return [track._replace(axes=tuple(position[a] for a in track.axes))]


def _reshaped(source: tuple, target: tuple, track: _Track) -> _Track:
    """`track` after a reshape of `source` into `target`: each run of axes that merge or split (`reshape_blocks`)
    and hold a channel axis holds channels after it too. Its other axes (the query heads that a key's and a value's
    heads are repeated over, say) repeat the channels along them: the factor is the same along them. The channel
    axes come out in the order of their positions."""
    track = _without_single(track, {a for a in track.axes if source[a] == 1})
    order = sorted(track.axes)
    channels = np.transpose(track.channels, [track.axes.index(a) for a in order])  # in the order of the positions
    runs = [(into, outof) for into, outof in reshape_blocks(source, target) if set(into) & set(track.axes)]
    inputs = [a for into, _ in runs for a in into]
    spread = channels.reshape([source[a] if a in track.axes else 1 for a in inputs])
    spread = np.broadcast_to(spread, [source[a] for a in inputs])
    axes = tuple(b for _, outof in runs for b in outof)
    return _Track(axes, spread.reshape([target[b] for b in axes]))


class _Affine(NamedTuple):
    """The leaves of `a * γ + β` (`beta` None for `a * γ`), and the view of `γ` that the product reads."""

    gamma: str
    beta: str | None
    view: Any


def _pooled(eqn: Any) -> bool:
    """Whether `eqn` keeps the channels of its first operand on the last axis and commutes with a factor per channel
    there: a sum, maximum or minimum over other axes, a division by a constant (a mean over tokens), a slice or
    squeeze of other axes (a class token's row)."""
    x = eqn.invars[0] if eqn.invars else None
    if not isinstance(x, jex.Var) or x.aval.ndim == 0:
        return False
    name, last, params = eqn.primitive.name, x.aval.ndim - 1, eqn.params
    if name in ("reduce_sum", "reduce_max", "reduce_min", "squeeze"):
        return last not in params["axes" if name != "squeeze" else "dimensions"]
    if name == "div":
        return isinstance(eqn.invars[1], jex.Literal)
    if name == "slice":
        strides = params["strides"] or (1,) * (last + 1)
        return (
            params["start_indices"][last] == 0
            and params["limit_indices"][last] == x.aval.shape[last]
            and (strides[last] == 1)
        )
    return False


def _affine(jaxpr: Any, value: Any, marks: int, origins: dict, uses: dict) -> _Affine | None:
    """`value` as `a * γ + β` or `a * γ` in `jaxpr`, or as that pooled over other axes than the channels (`_pooled`,
    each step read by the next alone), if it is read by the `marks` marked calls alone, each of `γ`, `β` a
    per-channel view of a leaf read by that operation alone, and the intermediate product read by the sum alone."""
    made_by = {v: e for e in jaxpr.eqns for v in e.outvars}
    readers: dict = {}
    for v in [v for e in jaxpr.eqns for v in e.invars] + list(jaxpr.outvars):
        if isinstance(v, jex.Var):
            readers[v] = readers.get(v, 0) + 1
    if readers.get(value) != marks:
        return None  # something besides the chosen layers reads it
    eqn = made_by.get(value)
    while eqn is not None and _pooled(eqn):
        value = eqn.invars[0]
        if readers.get(value) != 1:
            return None
        eqn = made_by.get(value)
    last = value.aval.ndim - 1

    def per_channel(v: Any) -> str | None:
        o = origins.get(v) if isinstance(v, jex.Var) else None
        if o is None or o.axis != last or uses.get(o.path) != 1 or v.aval.shape[-1] != value.aval.shape[-1]:
            return None
        return o.path if all(d == 1 for d in v.aval.shape[:-1]) else None

    beta = None
    if eqn is not None and eqn.primitive.name == "add":
        a, b = eqn.invars
        beta, product = (per_channel(b), a) if per_channel(b) is not None else (per_channel(a), b)
        if beta is None or not isinstance(product, jex.Var) or readers.get(product) != 1:
            return None
        eqn = made_by.get(product)
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
