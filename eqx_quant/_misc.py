import functools
import math
import numbers
import os
import re
import sys
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array


FLOAT32_TINY = float(np.finfo(np.float32).tiny)  # the smallest positive normal float32


def check_int(name: str, value: object) -> int:
    """Returns `value` as a Python `int`, or raises a `TypeError` naming `name`.

    Python ints and NumPy integer scalars are accepted; bools are not.
    """
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Integral):
        raise TypeError(f"`{name}` must be an int, got {value!r} of type {type(value).__name__}.")
    return int(value)


def first_where(mask: np.ndarray) -> tuple[int, ...] | None:
    """The index of the first true entry of `mask` (in row-major order), or `None`: for messages naming it."""
    found = np.argwhere(mask)
    return tuple(int(i) for i in found[0]) if len(found) else None


def check_flags(**flags: object) -> None:
    """A `TypeError` naming the first of `flags` that is not a bool, and its value."""
    for name, flag in flags.items():
        if not isinstance(flag, bool):
            raise TypeError(f"`{name}` must be a bool, got {name}={flag!r}.")


_PACKAGE = os.path.dirname(os.path.abspath(__file__))


def caller_stacklevel() -> int:
    """The `stacklevel` for a `warnings.warn` in the calling function that names the first frame outside eqx_quant:
    the user's call, however deep inside the library the warning is raised. The frames of a runtime type checker
    wrapping the library's functions (jaxtyping's import hook with beartype: generated code, `<@beartype(...)>`)
    count as the library's."""
    frame = sys._getframe(1)
    while frame is not None and _wrapper(frame.f_code.co_filename):  # around this function itself
        frame = frame.f_back
    level = 1  # `frame` calls `warnings.warn`
    while frame is not None and (_wrapper(frame.f_code.co_filename) or _library(frame.f_code.co_filename)):
        frame, level = frame.f_back, level + 1
    return level


def _library(filename: str) -> bool:
    return os.path.abspath(filename).startswith(_PACKAGE + os.sep)


def _wrapper(filename: str) -> bool:
    parts = os.path.abspath(filename).split(os.sep)
    return filename.startswith("<") or "jaxtyping" in parts or "beartype" in parts


def named_sharding(x: object) -> jax.sharding.NamedSharding | None:
    """The `NamedSharding` of an array (or shape) placed over a mesh, else `None` (one device, a tracer, not an
    array)."""
    sharding = getattr(x, "sharding", None)
    if isinstance(x, jax.core.Tracer) or not isinstance(sharding, jax.sharding.NamedSharding):
        return None
    return sharding


def on_mesh_of(model: Any, reference: Any) -> Any:
    """`model` with its arrays that are on no mesh (made on one device: calibrated scales, input transforms)
    replicated over the mesh of `reference`'s arrays, where they are all on one; else `model` as it is (on one
    device, or split over several meshes, where an array made for one part would not know which)."""
    meshes = {s.mesh for leaf in jax.tree.leaves(reference) if (s := named_sharding(leaf)) is not None}
    if len(meshes) != 1:
        return model
    (mesh,) = meshes
    replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    place = lambda a: jax.device_put(a, replicated) if eqx.is_array(a) and named_sharding(a) is None else a  # noqa: E731
    return jax.tree.map(place, model)


def keeps_the_mesh(function: Callable) -> Callable:
    """Decorates a transformation of a model (its first argument) so that every array of the model it returns is
    on the model's mesh, where the model has one (see `on_mesh_of`)."""

    @functools.wraps(function)
    def transformed(model: Any, *args: Any, **kwargs: Any) -> Any:
        return on_mesh_of(function(model, *args, **kwargs), model)

    return transformed


def placed_like(new: Any, old: object) -> Any:
    """`new` (an array) with the sharding of `old` where that is placed over a mesh (a sharded model's weight), so
    that a weight computed again keeps the partitioning it had; else `new` as it is."""
    sharding = named_sharding(old)
    return new if sharding is None else jax.device_put(new, sharding)


def sharded_in_type(x: Array) -> bool:
    """Whether `x` is sharded in its type (over Explicit mesh axes), where JAX asks operations that gather from it
    for their output's sharding."""
    return any(axis is not None for axis in jax.typeof(x).sharding.spec)


def whole_along(x: Array, axis: int) -> Array:
    """`x`, gathered along `axis` where that axis is sharded in its type (over Explicit mesh axes, as a
    column-parallel layer's output features are), on `x`'s own mesh: for operations that need every index of the
    axis on each device (tiles of a contraction, a transform that mixes them), which JAX does not gather itself
    there. Under Auto axes (or on one device) `x` as it is: XLA gathers what it needs."""
    sharding = jax.typeof(x).sharding
    spec = tuple(sharding.spec) + (None,) * (x.ndim - len(sharding.spec))
    axis = axis % x.ndim
    if spec[axis] is None:
        return x
    whole = jax.sharding.PartitionSpec(*spec[:axis], None, *spec[axis + 1 :])
    return jax.sharding.reshard(x, jax.sharding.NamedSharding(sharding.mesh, whole))


def lookup(table: Array, indices: Array) -> Array:
    """`table[indices]` for a 1-D `table`, sharded as `indices` where they are sharded in their type (over Explicit
    mesh axes, where JAX asks a gather for its output's sharding)."""
    if sharded_in_type(indices):
        return table.at[indices].get(out_sharding=jax.typeof(indices).sharding)
    return table[indices]


def check_where(where: object) -> None:
    """Raises a `TypeError` unless `where` is a predicate `f(path, layer)` or `None`."""
    if where is not None and not callable(where):
        raise TypeError(
            f"`where` must be a function `f(path, layer)`, a regular expression or None, got where={where!r}."
        )


def as_where(where: object) -> Callable | None:
    """`where` as a predicate `f(path, layer)` (or `None`): a regular expression chooses the paths it matches whole
    (`re.fullmatch`, as a rule's pattern); raises a `ValueError` for a malformed one."""
    if not isinstance(where, str):
        check_where(where)
        return where  # pyright: ignore[reportReturnType]
    try:
        pattern = re.compile(where)
    except re.error as error:
        raise ValueError(f"`where`={where!r} is not a regular expression: {error}.") from None
    return lambda path, layer: pattern.fullmatch(path) is not None


def where_traced(where: Callable, name: str, weight: object) -> bool:
    """`where(name, weight)` for a traced weight (an array where a layer's predicate expects a layer): a predicate
    that reads a layer's attributes fails on it with a `TypeError` that says so."""
    try:
        return bool(where(name, weight))
    except AttributeError as error:
        raise TypeError(
            f"`where` raised {error!r} on the traced weight {name!r}, which it receives as `where(name, weight)` with "
            "the weight's array in place of a layer. Check `isinstance(layer, eqx.Module)` before reading a layer's "
            "attributes."
        ) from error


def check_real(name: str, value: object) -> float:
    """Returns `value` as a Python `float`, or raises a `TypeError` naming `name`.

    Python and NumPy real scalars are accepted; bools are not.
    """
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Real):
        raise TypeError(f"`{name}` must be a real number, got {value!r} of type {type(value).__name__}.")
    return float(value)


def is_concrete(x: object) -> bool:
    """Whether `x`'s value is known now (it is not a tracer inside `jit`, `vmap`, `grad`, ...)."""
    return not isinstance(x, jax.core.Tracer)


_Function = TypeVar("_Function", bound=Callable)
_program = eqx.filter_jit(lambda function, *args, **kwargs: function(*args, **kwargs))


def one_program(function: _Function) -> _Function:
    """`function`, run as one compiled program when none of its arguments is traced (an eager call), where its few
    dozen operations would otherwise each compile and run on their own. Traced (inside `jax.jit`, `jax.grad`, ...),
    it runs as it is, in the caller's program. Its checks of concrete values see tracers in an eager call, so make
    them before calling it."""

    @functools.wraps(function)
    def call(*args, **kwargs):
        if any(isinstance(leaf, jax.core.Tracer) for leaf in jax.tree.leaves((args, kwargs))):
            return function(*args, **kwargs)
        return _program(function, *args, **kwargs)

    return call  # pyright: ignore[reportReturnType]


def whole_batch(fn: Callable[[Any, Array], Array], *, batched_output: bool) -> Callable[[Any, Array], Array]:
    """`fn(w, x)`, a function of a weight and an input with any number of leading batch axes, which sees the whole
    batch of a `jax.vmap` (a `jax.custom_batching.custom_vmap`).

    Mapped over `x` alone, it is called again with the mapped axis in front of `x` (and so on for each enclosing
    `jax.vmap`), so that `fn` can choose its formulation by the batch it runs for; its result is mapped too if
    `batched_output`, else it is one result for the whole batch. Mapped over `w` (one weight per example: an
    ensemble), `fn` is mapped as it is. `w` may be a PyTree of arrays (a weight and its scales).
    """

    @jax.custom_batching.custom_vmap
    def call(w: Any, x: Array) -> Array:
        return fn(w, x)

    @call.def_vmap
    def rule(axis_size: int, in_batched: list[Any], w: Any, x: Array) -> tuple[Array, bool]:
        del axis_size
        w_batched, x_batched = in_batched
        if any(jax.tree.leaves(w_batched)):
            w_axes = jax.tree.map(lambda batched: 0 if batched else None, w_batched)
            return jax.vmap(fn, in_axes=(w_axes, 0 if x_batched else None))(w, x), True
        return call(w, x), x_batched and batched_output

    return call


def reshape_blocks(source: Sequence[int], target: Sequence[int]) -> list[tuple[list[int], list[int]]]:
    """A reshape from shape `source` to shape `target` as runs of axes of equal size: pairs `(into, outof)` of the
    axes of `source` that merge or split into the axes of `target`, in order (axes of length 1 are in none)."""
    left = [i for i, n in enumerate(source) if n != 1]
    right = [j for j, n in enumerate(target) if n != 1]
    blocks, i, j = [], 0, 0
    while i < len(left) and j < len(right):
        into, outof = [left[i]], [right[j]]
        size, other = source[left[i]], target[right[j]]
        i, j = i + 1, j + 1
        while size != other:
            if size < other:
                into.append(left[i])
                size, i = size * source[left[i]], i + 1
            else:
                outof.append(right[j])
                other, j = other * target[right[j]], j + 1
        blocks.append((into, outof))
    return blocks


def read_through(wrapper: object, field: str, name: str) -> Any:
    """The attribute `name` of the module that `wrapper` holds in `field`: what a wrapping module's `__getattr__`
    returns, so that it reads like the module it wraps. Private names and `field` itself (looked up before the
    wrapper is initialised) are not read through."""
    if name.startswith("_") or name == field:
        raise AttributeError(name)
    return getattr(getattr(wrapper, field), name)


def compute_dtype(dtype: np.dtype) -> np.dtype:
    """The dtype in which a floating `dtype` is quantized: float32 for half precision, else itself."""
    if jnp.finfo(dtype).bits < 32:
        return np.dtype(jnp.float32)
    return np.dtype(dtype)


def as_float_input(name: str, x: object) -> Array:
    """`x` as a JAX array: floating dtypes are kept, integers and bools become float32, others are a `TypeError`."""
    x = jnp.asarray(x)
    if jnp.issubdtype(x.dtype, jnp.floating):
        return x
    if jnp.issubdtype(x.dtype, jnp.integer) or x.dtype == jnp.bool_:
        return x.astype(jnp.float32)
    raise TypeError(f"`{name}` must have a real dtype, got {x.dtype}.")


def check_broadcastable(name: str, shape: tuple[int, ...], x_shape: tuple[int, ...]) -> None:
    """Raises a `ValueError` unless an array of `shape` broadcasts to `x_shape` without changing it."""
    ok = len(shape) <= len(x_shape) and all(
        s in (1, t) for s, t in zip(reversed(shape), reversed(x_shape), strict=False)
    )
    if not ok:
        raise ValueError(f"`{name}` of shape {shape} does not broadcast to the shape of `x`, {x_shape}.")


def expand_to_rank(a: Array, ndim: int) -> Array:
    """Prepends unit axes to `a` so that it has rank `ndim` (explicit, so rank promotion is never needed)."""
    return a.reshape((1,) * (ndim - a.ndim) + a.shape)


def is_zero_tangent(tangent: object) -> bool:
    """Whether a JVP rule's tangent is absent (a `None` operand) or a symbolic zero (an operand without a
    derivative)."""
    return tangent is None or isinstance(tangent, jax.custom_derivatives.SymbolicZero)


def sum_to_shape(a: Array, shape: tuple[int, ...]) -> Array:
    """Sums `a` over the axes along which an array of `shape` was broadcast to `a.shape` (the adjoint of a
    broadcast)."""
    lead = a.ndim - len(shape)
    axes = tuple(range(lead)) + tuple(lead + i for i, s in enumerate(shape) if s == 1 and a.shape[lead + i] != 1)
    return jnp.sum(a, axis=axes).reshape(shape) if axes else a.reshape(shape)


def _varying_axes(a: Array) -> frozenset[str]:
    """The manual mesh axes that `a` varies over inside `jax.shard_map` (empty outside it)."""
    aval = jax.typeof(a)
    manual = getattr(aval, "manual_axis_type", None)  # JAX 0.10
    if manual is not None:
        return frozenset(manual.varying)
    return frozenset(getattr(aval, "vma", ()))  # the same set, under its name in earlier JAX releases


def vary_alike(*arrays: Array | None) -> tuple[Array | None, ...]:
    """`arrays` (`None` entries kept), each marked as varying over every manual mesh axis that any of them varies over.

    Inside `jax.shard_map`, a value that is the same on every device (a replicated scale) and one that differs
    (a shard of `x`) have different types, and a custom derivative rule must return cotangents of its inputs'
    types. Casting the replicated inputs to varying first (`jax.lax.pcast`, whose transpose is a `psum`) makes the
    rule's per-device cotangents correct, and sums them across devices on the way back. Outside `shard_map` this
    returns `arrays` unchanged.
    """
    present = [a for a in arrays if a is not None]
    union = frozenset().union(*(_varying_axes(a) for a in present))
    if not union:
        return arrays

    def cast(a: Array | None) -> Array | None:
        missing = None if a is None else tuple(sorted(union - _varying_axes(a)))
        return jax.lax.pcast(a, missing, to="varying") if missing else a

    return tuple(cast(a) for a in arrays)


def check_float_input(x: Array) -> None:
    """Raises a `TypeError` unless `x` has a floating dtype: what a quantizer's call takes."""
    if not jnp.issubdtype(x.dtype, jnp.floating):
        raise TypeError(f"`x` must be a floating array, got dtype {x.dtype}.")


#
# Static configuration: numbers as hashable Python values, so that they can be static fields.
#


def as_static_floats(name: str, value: object) -> float | tuple:
    """A Python float, or nested tuples of them for an array: hashable, so that it can be a static field."""
    if isinstance(value, jax.Array) and not isinstance(value, jax.core.Tracer) and value.ndim == 0:
        value = value.item()
    if isinstance(value, (bool, np.bool_)) or isinstance(value, jax.core.Tracer):
        raise TypeError(f"`{name}` must be a Python float or a sequence of floats, got {value!r}.")
    a = np.asarray(value)
    if a.dtype.kind not in "iuf":
        raise TypeError(f"`{name}` must be a Python float or a sequence of floats, got {value!r}.")
    if a.ndim and a.size == 0:
        raise ValueError(f"`{name}` must be a float or a non-empty array of floats, got shape {a.shape}.")
    return float(a) if a.ndim == 0 else nested(a.astype(np.float64), float)


def as_static_ints(name: str, value: object) -> int | tuple:
    """A Python int, or nested tuples of them for an array (see `as_static_floats`)."""
    if isinstance(value, (int, np.integer)) and not isinstance(value, bool):
        return int(value)
    if isinstance(value, (str, bytes)) or not isinstance(value, (Sequence, np.ndarray)):
        raise TypeError(f"`{name}` must be an int or a sequence of ints, got {value!r}.")
    a = np.asarray(value, dtype=object)
    for v in a.ravel():
        check_int(name, v)
    if a.ndim == 0 or a.size == 0:
        raise ValueError(f"`{name}` must be an int or a non-empty array of ints, got {value!r}.")
    return nested(a, int)


def nested(a: np.ndarray, kind: type) -> tuple:
    """An array as nested tuples of Python numbers."""
    return tuple(nested(row, kind) if a.ndim > 1 else kind(row) for row in a)


def flat(value: float | int | tuple) -> list:
    """The numbers of a static value, flattened."""
    return [value] if not isinstance(value, tuple) else [v for row in value for v in flat(row)]


#
# Named axes: quantizers called inside `jax.shard_map` on one shard of a tensor.
#

AxisName = str | tuple[str, ...]


def axis_names(axis_name: object) -> tuple:
    """The named axes of an `axis_name` argument, as a tuple (empty for `None`)."""
    return () if axis_name is None else axis_name if isinstance(axis_name, tuple) else (axis_name,)


def check_axis_name(axis_name: object) -> None:
    """Raises a `TypeError` unless `axis_name` is `None`, a non-empty string or a tuple of them."""
    names = axis_names(axis_name)
    if axis_name is not None and not (names and all(isinstance(n, str) and n for n in names)):
        raise TypeError(f"`axis_name` must be None, a non-empty str or a tuple of them, got axis_name={axis_name!r}.")


def _unbound(axis_name: object, error: NameError) -> ValueError:
    return ValueError(
        f"`axis_name`={axis_name!r} names an axis that is not bound here: call the quantizer inside the "
        f"`jax.shard_map` (or `jax.vmap(..., axis_name=...)`) that defines it. ({error})"
    )


def shards(axis_name: AxisName | None) -> int:
    """The number of shards that a tensor is split into along the named axes (1 for none)."""
    try:
        return math.prod(jax.lax.axis_size(name) for name in axis_names(axis_name))
    except NameError as error:
        raise _unbound(axis_name, error) from error


def across_shards(axis_name: AxisName | None, maxima: tuple[Array, ...], minima: tuple[Array, ...] = ()) -> tuple:
    """The statistics of the whole tensor from those of each shard: `maxima` reduced with `pmax`, `minima` with
    `pmin`, returned in that order."""
    if axis_name is None:
        return maxima + minima
    shards(axis_name)  # an unbound name is a clear error here (inside `jax.shard_map`, `pmax` fails an assertion)
    try:
        return tuple(jax.lax.pmax(a, axis_name) for a in maxima) + tuple(jax.lax.pmin(a, axis_name) for a in minima)
    except NameError as error:
        raise _unbound(axis_name, error) from error


@jax.custom_jvp
def value_computed_before(value: Array, anchor: Array) -> Array:
    """`computed_before(value, anchor)`, whose derivative is the identity towards `value` with no conditional: the
    gradients of a training step do not pass through one. Under a `jax.vmap` that maps `anchor` too (layers stacked
    with `eqx.filter_vmap` and mapped over the stack), it stays one conditional, over the whole batch."""
    return _one_conditional(value, anchor)


@jax.custom_batching.custom_vmap
def _one_conditional(value: Array, anchor: Array) -> Array:
    return computed_before(value, anchor)


@_one_conditional.def_vmap
def _one_conditional_rule(axis_size: int, in_batched: list[bool], value: Array, anchor: Array) -> tuple[Array, bool]:
    # `jax.vmap` would turn a conditional on a mapped predicate into a selection of both branches, which XLA fuses:
    # one conditional over the whole batch instead, its predicate read from the whole anchor.
    del axis_size
    return _one_conditional(value, anchor), in_batched[0]


@value_computed_before.defjvp
def _value_computed_before_jvp(primals, tangents):
    (value, anchor), (value_dot, _) = primals, tangents
    return value_computed_before(value, anchor), value_dot


def computed_before(value: Array, anchor: Array) -> Array:
    """`value`, computed before the operations that read it: returned by a conditional whose two branches both return
    it.

    XLA fuses cheap computations into the operations that consume them, and then may round those consumers otherwise
    (it sums a reduction, or a matrix-vector product, in another order). A fake-quantized value and the same value
    dequantized from stored codes are computed by different operations, which XLA fuses differently into what reads
    them: the quantized and the converted model then differed in the last bit downstream of an embedding lookup, or
    of a matrix-vector product with a transposed weight. XLA does not fuse across a conditional, so behind one both
    models compute their consumers alike. The predicate is read from `anchor`, an array that `jax.vmap` does not map
    (a layer's weight), so that it stays one conditional whatever `jax.vmap` maps over the inputs.
    """
    if not anchor.size:
        first = jnp.zeros((), anchor.dtype)
    elif sharded_in_type(anchor):  # no entry of it can be sliced out alone: a reduction (of scales, a small array)
        first = jnp.max(anchor)
    else:
        first = anchor.reshape(-1)[0]
    # Both branches return the same value (up to the bits of a NaN): the predicate only has to be one that XLA cannot
    # work out while compiling. `first != first` (NaN) is one for a float anchor; for an integer one (the codes of MX
    # or NVFP4 block scales) it is always false, and XLA would drop the conditional, so there it compares with zero.
    floating = jnp.issubdtype(first.dtype, jnp.floating)
    return jax.lax.cond(first != first if floating else first == 0, _same, _identity, value)


# The branches of `computed_before`, defined once: `jax.lax.cond` caches its compiled branches by function, so that
# an eager call (a layer's `.weight` read outside `jit`) does not compile them again each time.
def _same(value: Array) -> Array:
    return jnp.where(jnp.isnan(value), jnp.nan, value).astype(value.dtype)


def _identity(value: Array) -> Array:
    return value
