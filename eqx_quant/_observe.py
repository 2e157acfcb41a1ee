"""Observing a model's layers while it runs on calibration data: the observers that stand in for input quantizers,
the jit-compiled statistics step, and the folding of per-batch statistics on the host. Calibration and GPTQ read
the statistics of the layers' inputs through it."""

import functools
import math
import sys
import threading
import warnings
from collections.abc import Callable, Iterable, Iterator
from typing import Any, NamedTuple

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import io_callback
from jax.sharding import NamedSharding, PartitionSpec
from jaxtyping import Array, PRNGKeyArray, PyTree

from ._misc import FLOAT32_TINY, caller_stacklevel, check_float_input, sharded_in_type
from ._qarray import QuantizedArray
from ._quantizers import AbstractQuantizer
from ._scales import finite_or, stats
from ._traced import QuantTraced, each_token, leaves_by_path, replaced, two_level
from ._tree import join_path, map_nodes, nodes
from .nn._converted import AbstractConvertedLayer
from .nn._layers import AbstractQuantLayer, QuantConv, stack_shape


class _Recording:
    """The statistics that observers report while the calibration step runs: by layer path, by position in the
    layer's stack (0 for a layer that is not stacked), folded over every call."""

    def __init__(self):
        self.totals: dict[str, dict[int, dict[str, np.ndarray]]] = {}
        self.lock = threading.Lock()

    def add(self, path: str, index: Any, record: dict[str, Any]) -> None:
        with self.lock:
            layers = self.totals.setdefault(path, {})
            index = int(index)
            if index in layers:
                old = layers[index]
                layers[index] = {name: np.asarray(_HOST_FOLDS[name](old[name], v)) for name, v in record.items()}
            else:
                layers[index] = {name: np.asarray(v) for name, v in record.items()}


_active: list[_Recording] = []  # the recording of the calibration step in progress; empty outside of one
_HOST_FOLDS = {
    "absmax": np.maximum, "max": np.maximum, "min": np.minimum, "hist": np.add, "gram": np.add, "cross": np.add,
    "nonfinite": np.add, "finite": np.add, "channel_absmax": np.maximum, "channel_abssum": np.add, "count": np.add,
    "errors": np.add, "rows": np.add,
}  # fmt: skip
_REDUCTIONS = {
    "absmax": jnp.max, "max": jnp.max, "min": jnp.min, "hist": jnp.sum, "gram": jnp.sum, "cross": jnp.sum,
    "nonfinite": jnp.sum, "finite": jnp.sum, "channel_absmax": jnp.max, "channel_abssum": jnp.sum, "count": jnp.sum,
    "errors": jnp.sum,
}  # fmt: skip


def _report(path: str, index: Any, record: dict[str, Any]) -> None:
    if not _active:
        raise RuntimeError("A calibration observer ran outside `eqx_quant.calibrate`.")
    _active[-1].add(path, index, record)


@functools.cache
def _tap_for(path: str) -> Callable[[Array, dict[str, Array]], Array]:
    """`_tap` for one layer: a function of arrays only, as `custom_vmap` needs."""

    @jax.custom_batching.custom_vmap
    def tap(index: Array, record: dict[str, Array]) -> Array:
        if "vector" in record:  # one input vector: its outer products
            record = _outer_products(record, _outer)
        io_callback(functools.partial(_report, path), None, index, record, ordered=False)
        return index

    @tap.def_vmap
    def tap_batched(axis_size: int, in_batched: list, index: Array, record: dict[str, Array]):
        index_batched, record_batched = in_batched
        if not index_batched:  # one layer: reduce over the mapped axis, then report once
            vectors = {}
            if any(record_batched.get(name) for name in _VECTORS):
                vectors = {name: v if record_batched[name] else jnp.broadcast_to(v, (axis_size,) + v.shape)
                           for name, v in record.items() if name in _VECTORS}  # fmt: skip
                record = {name: v for name, v in record.items() if name not in vectors}
            record = {name: _REDUCTIONS[name](v, axis=0) if record_batched[name] else v for name, v in record.items()}
            if "rows" in record and not record_batched["rows"]:  # the same rows for each of the mapped calls
                record["rows"] = record["rows"] * axis_size
            if vectors:
                # The sums of the outer products of a batch of vectors, without materialising each of them.
                record |= _outer_products(vectors, _summed_outer)
            return tap(index, record), False
        # Several layers along the mapped axis (a model that maps a stack of layers with `vmap`): one at a time.
        record = {
            name: v if record_batched[name] else jnp.broadcast_to(v, (axis_size,) + v.shape)
            for name, v in record.items()
        }
        return jax.lax.map(lambda args: tap(*args), (index, record)), True

    return tap


_VECTORS = ("vector", "quantized")  # the input vectors of a record, whose outer products the tap sums


def _outer(a: Array, b: Array) -> Array:
    """`a ⊗ b`, replicated where an operand is sharded in its type (see `_replicated`)."""
    replicated = _replicated(a, b)
    return jnp.einsum("i,j->ij", a, b, **replicated) if replicated else jnp.outer(a, b)


def _summed_outer(a: Array, b: Array) -> Array:
    """`Σ_n a[n] ⊗ b[n]` over the leading axis of both."""
    return jnp.einsum("ni,nj->ij", a, b, precision=jax.lax.Precision.HIGHEST, **_replicated(a, b))


def _summed_outer_per_index(a: Array, b: Array) -> Array:
    """`Σ_n a[k, n] ⊗ b[k, n]` for each index `k` of the leading axis of both."""
    return jnp.einsum("kni,knj->kij", a, b, precision=jax.lax.Precision.HIGHEST, **_replicated(a, b))


def _replicated(*operands: Array) -> dict[str, Any]:
    """The keyword that makes an outer product (or a sum of them) replicated where an operand is sharded in its type
    (examples or features split over Explicit mesh axes), where JAX asks how to shard the result: the statistics of
    the whole batch, on every device."""
    if not any(sharded_in_type(a) for a in operands):
        return {}
    return {"out_sharding": NamedSharding(jax.typeof(operands[0]).sharding.mesh, PartitionSpec())}


def _outer_products(record: dict[str, Array], outer: Callable[[Array, Array], Array]) -> dict[str, Array]:
    """`record` with its input vectors replaced by their outer products: `"gram"`, of the quantized vector where
    there is one (else of the vector), and `"cross"`, of the vector with the quantized vector, where there is one."""
    record = dict(record)
    vector, quantized = record.pop("vector", None), record.pop("quantized", None)
    if quantized is None:
        return {**record, "gram": outer(vector, vector)}
    return {**record, "gram": outer(quantized, quantized), "cross": outer(vector, quantized)}


def _tensor_stats(x: Array, top: Array | None, num_bins: int) -> dict[str, Array]:
    """The finite `|x|`'s maximum, the minimum and maximum (with 0), and how many entries `x` has and how many of
    them are NaN or infinite (counted in float32: exact up to 2**24 per call, and then as floats)."""
    del top, num_bins
    absmax, lo, hi = stats(x, tuple(range(jnp.ndim(x))))
    finite = jnp.isfinite(jax.lax.stop_gradient(x))
    return {"absmax": absmax.reshape(()), "min": lo.reshape(()), "max": hi.reshape(()),
            "finite": jnp.sum(finite, dtype=jnp.float32), "nonfinite": jnp.sum(~finite, dtype=jnp.float32)}  # fmt: skip


def _histogram(x: Array, top: Array | None, num_bins: int) -> dict[str, Array]:
    """Counts of the finite |x| in `num_bins` equal bins over `[0, top]` (values above `top` go to the last)."""
    assert top is not None
    x = jnp.abs(jax.lax.stop_gradient(x).astype(jnp.float32)).ravel()
    finite = jnp.isfinite(x)
    width = jnp.maximum(top, FLOAT32_TINY) / num_bins
    index = jnp.clip(jnp.floor(finite_or(x, 0.0) / width), 0, num_bins - 1).astype(jnp.int32)
    counts = jnp.zeros(num_bins, jnp.float32).at[index].add(finite.astype(jnp.float32), **_replicated(index))
    return {"hist": counts}


def _gram(x: Array, top: Array | None, num_bins: int) -> dict[str, Array]:
    """The input vector (finite entries; others as 0), in float32, whose outer products `x xᵀ` the tap sums: the
    Hessian of GPTQ; how many entries are not finite; and one row."""
    del top, num_bins
    x = jax.lax.stop_gradient(x).astype(jnp.float32).ravel()
    return {"vector": finite_or(x, 0.0), "nonfinite": _count_nonfinite(x), "rows": jnp.float32(1)}


def _flat(x: Array) -> Array:
    """A quantized input as `_gram`'s vectors: float32, without gradient, non-finite entries as 0."""
    return finite_or(jax.lax.stop_gradient(x).astype(jnp.float32), 0.0)


def _channels(x: Array, top: Array | None, num_bins: int) -> dict[str, Array]:
    """Per input channel (the last axis), the largest finite `|x|`, the sum of the finite `|x|` and the number of
    finite entries: the statistics of SmoothQuant and AWQ; and how many entries are not finite."""
    del top, num_bins
    x = jax.lax.stop_gradient(x).astype(jnp.float32)
    x = x.reshape(-1, x.shape[-1])
    count = jnp.sum(jnp.isfinite(x), axis=0, dtype=jnp.float32)  # per channel: its finite entries
    nonfinite = _count_nonfinite(x)
    x = jnp.abs(finite_or(x, 0.0))
    return {"channel_absmax": jnp.max(x, axis=0), "channel_abssum": jnp.sum(x, axis=0), "count": count,
            "nonfinite": nonfinite}  # fmt: skip


def _count_nonfinite(x: Array) -> Array:
    """How many entries of `x` are NaN or infinite, in float32 (as `_tensor_stats` counts them)."""
    return jnp.sum(~jnp.isfinite(x), dtype=jnp.float32)


_STATISTICS = {"stats": _tensor_stats, "hist": _histogram, "gram": _gram, "channels": _channels}


Statistic = str | Callable[[Array, Any, int], dict[str, Array]]


class _Observer(AbstractQuantizer):
    """Stands in for an input quantizer during calibration: passes `x` through and reports a statistic of it.

    `statistic` is a name of `_STATISTICS` or a function `f(x, data, num_bins) -> record` (whose entries are named
    in `_REDUCTIONS`), or `"gram_quantized"`: `"gram"`'s of the input as the layer's input quantizer, held as
    `data`, quantizes it, with its products with the input (`"cross"`), passing the quantized input on. `index` is
    the layer's position in its stack and `data` what the statistic needs of that layer (the histogram range of
    `"hist"`): arrays with the stack's shape in front, so that a `jax.lax.scan` over stacked layers hands each step
    its own. `batch`: the axes of a traced weight that are batch dimensions of its products (stacked experts),
    along which `"gram"` keeps one matrix per index (see `product_input`).
    """

    index: Array
    data: Any
    path: str = eqx.field(static=True)
    statistic: Statistic = eqx.field(static=True)
    num_bins: int = eqx.field(static=True)
    batch: tuple[int, ...] = eqx.field(static=True, default=())

    def __call__(self, x: Array, *, key: PRNGKeyArray | None = None) -> Array:
        del key
        if self.statistic in ("stats", "hist"):  # `calibrate`'s, of an input quantizer: the model takes no other input
            check_float_input(x)
        if self.index.ndim:
            raise ValueError(
                f"The stacked layer {self.path!r} was called on the whole stack at once; `calibrate` observes stacked "
                "layers called one layer at a time (inside `jax.lax.scan`, or a `jax.vmap` over the layers)."
            )
        if self.statistic == "gram_quantized":
            record, out = _gram(x, None, 0), x
            if self.data is not None:  # the layer's input quantizer (else the Gram matrix of its input alone)
                out = self.data(x)
                record["quantized"] = _flat(out.ravel())
            _tap_for(self.path)(self.index, record)
            return out
        compute = _STATISTICS[self.statistic] if isinstance(self.statistic, str) else self.statistic
        record = compute(x, self.data, self.num_bins)
        _tap_for(self.path)(self.index, record)
        return x

    def product_input(self, x: Array, contracted: tuple[int, ...], batch: tuple[tuple[int, int], ...] = ()) -> Array:
        """Observes `x` as the activation operand of a traced product summing over its axes `contracted`, as the
        rows of a linear layer's input: the contracted axes flattened in that order into its channels, the others
        counting rows. `"gram"`: the Gram matrix of the rows (and their number), GPTQ's Hessian of the product
        (`"gram_quantized"`: of the rows of the input quantizer's output, held as `data`, and their products with the
        rows of `x`);
        `"channels"`: the statistics per channel; a function: applied to each row; other statistics: of the whole
        of `x`. `batch`: the product's `(weight axis, input axis)` batch dimensions; where the observer's `batch`
        names those weight axes, `"gram"` has one matrix per index along them (the rows of each expert apart)."""
        if self.index.ndim or self.statistic in ("stats", "hist"):
            return self(x)  # the whole tensor's statistics, or the error of a stack observed at once
        channels = math.prod(x.shape[a] for a in contracted)
        apart = tuple(i for _, i in batch) if self.batch else ()
        assert not self.batch or tuple(w for w, _ in batch) == self.batch, (self.path, batch, self.batch)
        leading = tuple(range(len(apart)))
        moved = lambda v: jnp.moveaxis(v, apart + contracted, leading + tuple(range(-len(contracted), 0)))  # noqa: E731
        as_rows = lambda v: moved(v).reshape(-1, channels)  # noqa: E731
        rows = as_rows(x)
        if self.statistic == "channels":
            self(rows)
            return x
        if self.statistic not in ("gram", "gram_quantized"):  # a function of one input vector, as a layer's sees it
            jax.vmap(self)(rows)
            return x
        # With batch axes apart, one block of rows per index along them.
        blocks = lambda v: v.reshape(math.prod(x.shape[a] for a in apart), -1, channels) if apart else v  # noqa: E731
        rows = jax.lax.stop_gradient(rows).astype(jnp.float32)
        record = {"nonfinite": _count_nonfinite(rows), "vector": blocks(finite_or(rows, 0.0))}
        record["rows"] = jnp.float32(record["vector"].shape[-2])  # of each index's block, with batch axes apart
        out = x
        if self.statistic == "gram_quantized" and self.data is not None:
            # The whole operand, as the product quantizes it (NVFP4's tensor scale: per token, see `each_token`).
            out = each_token(self.data, x, contracted) if two_level(self.data) else self.data(x)
            record["quantized"] = blocks(_flat(as_rows(out)))
        _tap_for(self.path)(self.index, _outer_products(record, _summed_outer_per_index if apart else _summed_outer))
        return out


@eqx.filter_jit
def _calibration_step(observed: PyTree, batch: PyTree, batched: bool, one_by_one: bool = False) -> PyTree:
    """Runs the observed model on one batch; the observers report to the host as it runs. `one_by_one` runs the
    examples one after another (`jax.lax.map`) instead of under `jax.vmap`."""
    if batched:
        return observed(batch)
    return jax.lax.map(observed, batch) if one_by_one else jax.vmap(observed)(batch)


def _vmapped_cond(error: BaseException) -> bool:
    """Whether `error` is JAX's refusal of a callback (an observer's report) inside a `jax.lax.cond` or
    `jax.lax.switch` under `jax.vmap`."""
    return isinstance(error, NotImplementedError) and "vmap-of-cond" in str(error)


class TracedInput(NamedTuple):
    """The input quantizer of the products of a traced weight of an [`eqx_quant.nn.QuantTraced`][] (at `root`, the
    weight `index` of it), as observers and calibration see it: like a layer's, with the stack it is stepped through
    along."""

    root: str
    index: int
    stack: tuple[int, ...]
    input_quant: Any


def traced_inputs(model: PyTree) -> list[tuple[str, TracedInput]]:
    """The input quantizers of every traced weight of `model`, named `<root>.model.<weight path>`, as the weight."""
    found = []
    for root, traced in nodes(model, (QuantTraced,)):
        for i, (path, stack) in enumerate(zip(traced.weight_paths, traced.stacks, strict=True)):
            name = join_path(root, "model", path)
            found.append((name, TracedInput(root, i, stack, traced.input_quants[i])))
    return found


def with_traced_inputs(model: PyTree, replace: Callable[[str, TracedInput], Any]) -> PyTree:
    """`model` with each traced weight's input quantizer replaced by `replace(name, target)` (named as
    `traced_inputs` names them)."""

    def swap(root: str, traced: QuantTraced) -> QuantTraced:
        inputs = list(traced.input_quants)
        for name, target in traced_inputs(traced):
            name = join_path(root, name)
            inputs[target.index] = replace(name, target._replace(root=root))
        return replaced(traced, input_quants=inputs)

    if not nodes(model, (QuantTraced,)):
        return model  # rebuilt no further
    return map_nodes(model, (QuantTraced,), swap)


def layer_stack(layer: AbstractQuantLayer | TracedInput) -> tuple[int, ...]:
    """The shape of the stack a quantized layer belongs to: `()` for a single layer, `(layers,)` for layers built
    with `eqx.filter_vmap`."""
    if isinstance(layer, TracedInput):
        return layer.stack
    return stack_shape(layer.layer)  # pyright: ignore[reportAttributeAccessIssue]


def observe(
    model: PyTree,
    targets: list[tuple[str, AbstractQuantLayer | TracedInput]],
    statistic: Statistic,
    data: dict[str, Any] | None = None,
    num_bins: int = 0,
    apart: dict[str, tuple[int, ...]] | None = None,
) -> PyTree:
    """`model` with the input quantizer of each target layer (or traced weight) replaced by an observer of
    `statistic`, holding `data[path]` (arrays with the layer's stack shape in front); a traced weight in `apart`
    with the axes of it that are batch dimensions of its products, kept apart by `"gram"`."""
    chosen = dict(targets)

    def observer(path: str, layer: AbstractQuantLayer | TracedInput) -> _Observer:
        stack = layer_stack(layer)
        index = jnp.arange(math.prod(stack), dtype=jnp.int32).reshape(stack)
        axes = () if apart is None else apart.get(path, ())
        return _Observer(index, None if data is None else data[path], path, statistic, num_bins, axes)

    def swap(path: str, layer: AbstractQuantLayer) -> AbstractQuantLayer:
        if path not in chosen:
            return layer
        return eqx.tree_at(lambda l: l.input_quant, layer, observer(path, layer), is_leaf=lambda x: x is None)

    model = map_nodes(model, (AbstractQuantLayer,), swap)
    return with_traced_inputs(model, lambda p, t: observer(p, t) if p in chosen else t.input_quant)


def progress_bar(items: Iterable, enabled: bool, description: str) -> Iterable:
    """`items`, with a progress bar when `enabled`: tqdm's when it is installed, else a line per item on stderr."""
    if not enabled:
        return items
    try:
        from tqdm.auto import tqdm
    except ImportError:
        return _lines(items, description)
    return tqdm(items, desc=description, leave=False)


def _lines(items: Iterable, description: str) -> Iterator:
    for i, item in enumerate(items):
        print(f"{description}: {i + 1}", file=sys.stderr, flush=True)
        yield item


def check_called(targets: list[tuple[str, Any]], found: dict[str, Any], where: bool = True) -> None:
    """Raises, naming them, if some of the target layers have no statistics: they were never called. The way out
    names `where` if the algorithm takes one."""
    never = [path for path, _ in targets if path not in found]
    if never:
        leave = "a `where` that leaves them out, or " if where else ""
        raise ValueError(
            f"The layers at {never} were never called on the calibration batches: pass batches that reach them, or "
            f"leave them out ({leave}at `quantize`, a rule `Rule(pattern, input=None)` before the others, which "
            "keeps their inputs float)."
        )


def _takes(where: Callable[[str, Any], bool], path: str, layer: Any) -> bool:
    """Whether `where` chooses a convolution: a predicate written for linear layers (that reads `in_features`, say)
    may fail on one, and then does not choose it."""
    try:
        return bool(where(path, layer))
    except (AttributeError, TypeError, ValueError):
        return False


def check_convolutions(
    model: PyTree, where: Callable[[str, Any], bool] | None, what: str, kept: Callable[[QuantConv], bool]
) -> None:
    """For the quantized convolutions that the algorithm `what` would transform if it transformed convolutions
    (those `kept` keeps): a `ValueError` naming those that `where` chooses, as for traced convolutions; where it
    chose its layers by default (`where` None), a warning that it leaves them as they are."""
    if where is not None:
        chosen = [
            path or "(the model itself)"
            for path, layer in nodes(model, (QuantConv,))
            if kept(layer) and _takes(where, path, layer)
        ]
        if chosen:
            raise ValueError(
                f"`where` chooses the convolutions {chosen}, which `{what}` does not transform (it transforms "
                "linear layers). Exclude them with `where`."
            )
        return
    convolutions = [path or "(the model itself)" for path, layer in nodes(model, (QuantConv,)) if kept(layer)]
    if convolutions:
        warnings.warn(
            f"`{what}` does not transform convolutions: the quantized convolutions {convolutions} are left as they "
            "are. Choose the layers with `where` to silence this.",
            stacklevel=caller_stacklevel(),
        )


def check_callable(model: PyTree) -> None:
    """A `TypeError` for a model that cannot run on the batches, before they are read: it names the model's type
    (and a dict's keys), not the whole tree."""
    if not callable(model):
        keys = f" with keys {list(model)}" if isinstance(model, dict) else ""
        raise TypeError(
            f"`model` must be callable, as it runs on the batches, got a {type(model).__name__}{keys}. Wrap its "
            "parts in a module whose `__call__` runs them."
        )


def check_not_converted(model: PyTree, what: str) -> None:
    """A `ValueError` for a converted model, which `what` cannot change: one with layers or traced weights stored as
    codes and none left fake-quantized (a model converted in part keeps its fake-quant layers and weights to work
    on, where `what` says why it leaves the others)."""
    stored = []
    for _, traced in nodes(model, (QuantTraced,)):
        leaves = leaves_by_path(traced.model)
        stored += [isinstance(leaves[path], QuantizedArray) for path in traced.weight_paths]
    if nodes(model, (AbstractQuantLayer,)) or not all(stored):  # something left to work on
        return
    if nodes(model, (AbstractConvertedLayer,)) or any(stored):
        raise ValueError(
            f"`model` is converted (its weights are stored as codes, by `eqx_quant.convert`): `{what}` works on the "
            "fake-quant model. Run it before `convert`, then convert the result."
        )


def check_examples(batch: PyTree, i: int) -> None:
    """A `ValueError` for a batch of no examples (every array of it with a leading axis of length 0), whose
    statistics would be reductions over nothing."""
    arrays = [a for a in jax.tree.leaves(batch) if getattr(a, "ndim", 0)]
    if not arrays:
        raise ValueError(
            f"`batches` holds a batch without arrays: batch {i} is {batch!r}; each batch is the model's input (an "
            "array, or a PyTree of them) with a leading batch axis."
        )
    if all(a.shape[0] == 0 for a in arrays):
        shapes = ", ".join(f"{a.dtype}{list(a.shape)}" for a in arrays)
        raise ValueError(
            f"`batches` holds a batch of no examples: batch {i} has arrays {shapes}, whose leading (batch) axis has "
            "length 0. Leave such batches out."
        )


def check_not_one_array(batches: object) -> None:
    """A `TypeError` for `batches` that are not an iterable of batches, or one array: iterating it would take its
    rows for the batches. Nothing is iterated: what Python iterates (`__iter__`, or `__getitem__` alone) passes."""
    if isinstance(batches, (jax.Array, np.ndarray, np.generic)):
        raise TypeError(
            "`batches` must be an iterable of batches (a list of arrays, each with a leading batch axis), got one "
            f"array of shape {tuple(batches.shape)}: pass `[x]` for one batch, or `list(x)` for a stack of batches."
        )
    iterable = isinstance(batches, Iterable) or hasattr(type(batches), "__getitem__")
    if not iterable or isinstance(batches, (str, bytes)):
        raise TypeError(
            "`batches` must be an iterable of batches (a list of arrays, each with a leading batch axis), got "
            f"{batches!r} of type {type(batches).__name__}."
        )


def checked(batches: Iterable[PyTree]) -> list[PyTree]:
    """`batches` as a list, checked to hold batches, each of them examples (`check_examples`)."""
    check_not_one_array(batches)
    batches = list(batches)
    if not batches:
        raise ValueError("`batches` is empty: at least one batch is needed.")
    for i, batch in enumerate(batches):
        check_examples(batch, i)
    return batches


class _Bare(str):
    """A string shown without quotes inside a container's repr."""

    def __repr__(self) -> str:
        return str(self)


def shapes_of(tree: PyTree) -> PyTree:
    """`tree` with each array as its dtype and shape (`float32[8, 8]`), for messages."""
    return jax.tree.map(lambda a: _Bare(f"{a.dtype}{list(a.shape)}" if hasattr(a, "shape") else type(a).__name__), tree)


def add_batch_note(error: BaseException, batch: PyTree, batched: bool, which: str = "the first batch") -> None:
    """Adds to an error raised running the model on `batch` (`which`: the first of `batches`, by default) a note of
    the batch and of how the algorithms call the model with it, unless it has one already (an error passing through
    two steps that each run the model)."""
    if any(note.startswith("eqx_quant: raised running") for note in getattr(error, "__notes__", [])):
        return
    leaves = shapes_of(batch)
    call = "`model(batch)` (`batched=True`)" if batched else "`jax.vmap(model)(batch)`"
    pairs = (
        " A tuple or list is one argument too: for (inputs, labels) pairs from a data loader, pass the inputs alone."
        if isinstance(batch, (tuple, list))
        else ""
    )
    unbound = (
        " A model whose layers read a named axis (`eqx.nn.BatchNorm(..., axis_name=...)` in training mode) runs on "
        "its batches in inference mode: pass `eqx.nn.inference_mode(model)`, whose batch statistics are the stored "
        "ones, as served."
        if isinstance(error, NameError) and "unbound axis name" in str(error)
        else ""
    )
    error.add_note(
        f"eqx_quant: raised running the model on {which}, {leaves}. Each batch is the model's one argument, its "
        f"examples along the leading axis, called as {call}; wrap a model that takes more (a state, a key, a mask) in "
        f"a module or an `eqx.Partial` whose call takes the batch alone.{pairs}{unbound}"
    )


def fold(
    model, targets, batches, batched, statistic, data=None, num_bins=0, progress=False, description="calibrate",
    apart=None,
) -> dict[str, list[dict[str, Any]]]:  # fmt: skip
    """Runs the observed model over all batches: per target layer, the statistics folded over every call, one
    record per layer of its stack (in stack order, flattened); `apart` as for `observe`."""
    check_callable(model)
    check_not_one_array(batches)
    observed = observe(model, targets, statistic, data, num_bins, apart)
    recording = _Recording()
    seen = one_by_one = False
    for i, batch in enumerate(progress_bar(batches, progress, description)):
        first, seen = not seen, True
        check_examples(batch, i)
        _active.append(recording)
        try:
            try:
                jax.block_until_ready(_calibration_step(observed, batch, batched, one_by_one))
            except NotImplementedError as error:
                # Raised tracing the step, before any observer reported: a quantized layer in a branch of a
                # `jax.lax.cond` under the `jax.vmap` over the batch, where JAX refuses callbacks. Run the examples
                # one after another instead, each through its own branch.
                if not (first and not batched and _vmapped_cond(error)):
                    raise
                one_by_one = True
                jax.block_until_ready(_calibration_step(observed, batch, batched, one_by_one))
            jax.effects_barrier()
        except Exception as error:
            if first:
                add_batch_note(error, batch, batched)
                if _vmapped_cond(error):
                    error.add_note(
                        "eqx_quant: a `jax.lax.cond` or `jax.lax.switch` holding quantized layers runs under a "
                        "`jax.vmap` of the model's own (over tokens, say, or over the batch with `batched=True`), "
                        "where JAX refuses the observers' reports to the host. Without a `jax.vmap` around the "
                        "branch (a model written for one example, `batched=False`, whose examples then run one after "
                        "another), or with both branches computed and one chosen by `jnp.where`, they can be observed."
                    )
            raise
        finally:
            _active.pop()
    if not seen:
        raise ValueError("`batches` is empty: calibration needs at least one batch.")
    results = {}
    for path, layer in targets:
        size = math.prod(layer_stack(layer))
        layers = recording.totals.get(path, {})
        if not layers:
            continue  # never called
        missing = [i for i in range(size) if i not in layers]
        if missing:
            raise ValueError(f"Layers {missing} of the stacked layer {path!r} were never called during calibration.")
        results[path] = [layers[i] for i in range(size)]
    if _seen:  # a layer's inputs are the same in every pass over the same batches: counted once
        nonfinite, rows = _seen[-1]
        for path, records in results.items():
            for i, record in enumerate(records):
                count = float(record.get("nonfinite", 0.0))
                if count:
                    nonfinite[path, i] = max(nonfinite.get((path, i), 0.0), count)
                if "rows" in record:  # a Gram matrix's, of `features` input features
                    counted, features = float(record["rows"]), record["gram"].shape[-1]
                    rows[path, i] = (max(rows.get((path, i), (0.0, 0))[0], counted), features)
    return results


# What `fold` counted while a function that `warns_of_calibration_data` decorates runs: per `(path, index in the
# stack)`, the NaN and infinite inputs, and the rows of input with the number of input features.
_seen: list[tuple[dict[tuple[str, int], float], dict[tuple[str, int], tuple[float, int]]]] = []


def warns_of_calibration_data(what: str) -> Callable[[Callable], Callable]:
    """Decorates the algorithm `what`: once it has returned, it warns of the NaN or infinite inputs that its
    calibration passes (`fold`) counted, per layer (a stack's layers together), which its statistics take as zeros
    or leave out, as `calibrate` warns of those it leaves out; and of the layers whose Gram matrix (GPTQ's Hessian)
    summed fewer rows of input (examples, or tokens) than they have input features: it is then singular, and what
    the algorithm fits to those few rows can do worse than rounding to nearest."""

    def decorate(function: Callable) -> Callable:
        @functools.wraps(function)
        def run(*args, **kwargs):
            nonfinite: dict[tuple[str, int], float] = {}
            rows: dict[tuple[str, int], tuple[float, int]] = {}
            _seen.append((nonfinite, rows))
            try:
                result = function(*args, **kwargs)
            finally:
                _seen.pop()
            _warn_of_nonfinite(what, nonfinite)
            _warn_of_few_rows(what, rows)
            return result

        return run

    return decorate


def _warn_of_nonfinite(what: str, counts: dict[tuple[str, int], float]) -> None:
    per_layer: dict[str, float] = {}
    for (path, _), count in counts.items():
        per_layer[path] = per_layer.get(path, 0.0) + count
    if per_layer:
        listed = ", ".join(f"{path!r} {int(count):,}" for path, count in per_layer.items())
        warnings.warn(
            f"`{what}`: the calibration inputs held NaN or inf values, which its statistics take as zeros or leave "
            f"out: {listed}.",
            stacklevel=caller_stacklevel(),
        )


def _warn_of_few_rows(what: str, rows: dict[tuple[str, int], tuple[float, int]]) -> None:
    few: dict[str, tuple[float, int]] = {}  # a stack's layers together: the fewest rows
    for (path, _), (count, features) in rows.items():
        if count < features:
            few[path] = min(few.get(path, (count, features)), (count, features))
    if few:
        listed = ", ".join(f"{path!r} {int(count):,} of {features:,}" for path, (count, features) in few.items())
        warnings.warn(
            f"`{what}`: layers saw fewer rows of calibration input (examples, or tokens) than they have input features "
            f"(rows of features): {listed}. Statistics of so few rows fit them alone, and `{what}` can then do worse "
            "than rounding to nearest; pass more calibration data.",
            stacklevel=caller_stacklevel(),
        )
