"""Automatic mixed precision: a weight format per layer, chosen to minimise the predicted loss under a size budget."""

import dataclasses
import math
import re
import warnings
from collections.abc import Callable, Iterable, Sequence
from typing import Literal

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, PRNGKeyArray, PyTree

from ._format import GGML_BLOCK, MX_BLOCK, NVFP4_BLOCK, Format, format_named
from ._misc import caller_stacklevel, check_int
from ._observe import add_batch_note, check_not_one_array, checked
from ._quantizers import AbstractQuantizer
from ._rules import LayerQuantizer, Rule, quantize
from ._summary import _FLOAT_LAYERS, describe_quantizer, summary, text_table
from ._traced import TRACED_ONLY, find_products, layer_types
from ._tree import nodes
from .nn._layers import AbstractQuantLayer, _quantized_weight, stack_depth


DEFAULT_CANDIDATES = ("int8", "int4_g32", "int3_g32", "int2_g32", "float8_e4m3fn", "mxfp4", "nvfp4", "float")
_BLOCK_OF_SCALE = {"e8m0": MX_BLOCK, "e4m3": NVFP4_BLOCK, "float16": GGML_BLOCK}  # the block formats' own sizes
_MAX_STATES = 1 << 17


@dataclasses.dataclass(frozen=True)
class _Candidate:
    name: str
    format: Format | None  # None: the layer stays float
    group_size: int | None


def _candidate(name: object) -> _Candidate:
    if not isinstance(name, str):
        raise TypeError(f"`candidates` must hold format names such as 'int4_g32' or 'float', got {name!r}.")
    if name == "float":
        return _Candidate(name, None, None)
    match = re.fullmatch(r"(.+?)(?:_g(\d+))?", name)
    assert match is not None
    base, group = match.group(1), match.group(2)
    try:
        fmt = format_named(base)
    except ValueError:
        raise ValueError(
            f"`candidates`: {name!r} is not a format name, optionally with a group size ('int4_g32'), or 'float'."
        ) from None
    block = _BLOCK_OF_SCALE.get(fmt.scale)
    if block is not None:
        if group is not None and int(group) != block:
            raise ValueError(f"`candidates`: {fmt.name} has blocks of {block}, got {name!r}.")
        return _Candidate(name, fmt, block)
    if group is not None and int(group) < 1:
        raise ValueError(f"`candidates`: the group size of {name!r} must be at least 1.")
    return _Candidate(name, fmt, None if group is None else int(group))


@dataclasses.dataclass(frozen=True)
class AutoRecipeRow:
    """One layer of an [`eqx_quant.AutoRecipeReport`][]: its `path`, number of `weights`, the `choice` (a candidate's
    name) and the quantizer it makes there (`quantizer`, in words), the weight's `bits` per element (of the float
    weight for `"float"`) and stored `bytes`, the `predicted` loss increase of that choice, the layer's Hessian
    `trace` (method `"hessian"`; `None` for `"measured"`), and `costs`: the predicted loss increase of every
    candidate the layer can take, by name."""

    path: str
    weights: int
    choice: str
    quantizer: str
    bits: int
    bytes: int
    predicted: float
    trace: float | None
    costs: dict[str, float]


@dataclasses.dataclass(frozen=True)
class AutoRecipeReport:
    """What [`eqx_quant.auto_recipe`][] chose and why: a row per layer (`rows`), the `budget` it met (in bytes, or in
    bits of the weights' elements for `average_bits`) and its `unit` (`"bytes"` or `"bits"`). `print` it for a
    table."""

    rows: tuple[AutoRecipeRow, ...]
    budget: int
    unit: str
    method: str

    @property
    def bytes(self) -> int:
        """The stored bytes of the weights of every layer considered (codes, scales and zero points)."""
        return sum(row.bytes for row in self.rows)

    @property
    def average_bits(self) -> float:
        """The bits per weight element, averaged over the weights of every layer considered (scales excluded)."""
        return sum(row.bits * row.weights for row in self.rows) / sum(row.weights for row in self.rows)

    @property
    def predicted(self) -> float:
        """The predicted loss increase of the whole choice: the sum over the layers."""
        return sum(row.predicted for row in self.rows)

    def __str__(self) -> str:
        header = ("path", "weights", "choice", "quantizer", "bits", "bytes", "trace", "predicted")
        cells = [header] + [
            (r.path, f"{r.weights:,}", r.choice, r.quantizer, str(r.bits), f"{r.bytes:,}",
             "-" if r.trace is None else f"{r.trace:.4g}", f"{r.predicted:.4g}")
            for r in self.rows
        ]  # fmt: skip
        cells.append(("total", f"{sum(r.weights for r in self.rows):,}", "", f"method={self.method}",
                      f"{self.average_bits:.3g}", f"{self.bytes:,}", "", f"{self.predicted:.4g}"))  # fmt: skip
        return text_table(cells, numeric=(1, 4, 5, 6, 7))


class AutoRecipe(dict):
    """`{"rules": [...]}`, the keyword argument of [`eqx_quant.quantize`][] as [`eqx_quant.recipe`][] returns it,
    with the [`eqx_quant.AutoRecipeReport`][] of the choice as `.report`."""

    report: AutoRecipeReport

    def __init__(self, rules: list[Rule], report: AutoRecipeReport):
        super().__init__(rules=rules)
        self.report = report


def allocate(costs: np.ndarray, sizes: np.ndarray, budget: int) -> tuple[int, ...]:
    """The choice of one candidate per unit (row) that minimises the summed `costs` with summed `sizes` at most
    `budget` (ties: the smaller total size, then the earlier candidates), by dynamic programming over the budget.

    `costs` is float, `inf` where a unit cannot take a candidate; `sizes` non-negative ints. The sizes are counted in
    units of their greatest common divisor: exact whenever the budget holds at most `2**17` of those. Beyond that they
    are counted in units of `budget / 2**17`, rounded down, and the program is solved again with one unit less of
    budget until the choice's exact sizes fit (if none does, each unit's smallest candidate is taken): the budget is
    always met, and the choice is optimal up to one unit of `budget / 2**17` per row."""
    costs, sizes = np.asarray(costs, np.float64), np.asarray(sizes, np.int64)
    feasible = np.isfinite(costs)
    if not feasible.any(axis=1).all() or sum(sizes[u][feasible[u]].min() for u in range(len(costs))) > budget:
        raise ValueError("no choice of the candidates fits the budget")
    step = math.gcd(*(int(s) for s in sizes[feasible]), int(budget)) or 1
    if budget // step > _MAX_STATES:
        step = -(-budget // _MAX_STATES)
    units = sizes // step  # exact when `step` divides every size
    capacity = budget // step
    while capacity >= 0:
        picks = _knapsack(costs, units, capacity)
        if picks is not None and sum(int(sizes[u, c]) for u, c in enumerate(picks)) <= budget:
            return picks
        capacity -= 1
    smallest = np.where(feasible, sizes, np.iinfo(np.int64).max)
    return tuple(int(c) for c in np.argmin(smallest, axis=1))


def _knapsack(costs: np.ndarray, units: np.ndarray, capacity: int) -> tuple[int, ...] | None:
    """The multiple-choice knapsack of `allocate` on integer sizes, or `None` if nothing fits `capacity`."""
    best = np.full(capacity + 1, np.inf)
    best[0] = 0.0
    choice = np.zeros((len(costs), capacity + 1), np.int16)
    for u in range(len(costs)):
        new = np.full(capacity + 1, np.inf)
        for c in range(costs.shape[1]):
            s = int(units[u, c])
            if not np.isfinite(costs[u, c]) or s > capacity:
                continue
            shifted = np.full(capacity + 1, np.inf)
            shifted[s:] = best[: capacity + 1 - s] + costs[u, c]
            better = shifted < new
            new = np.where(better, shifted, new)
            choice[u, better] = c
        best = new
    if not np.isfinite(best).any():
        return None
    used = int(np.argmin(best))  # the least cost; among equal costs, the smallest size
    picks = []
    for u in reversed(range(len(costs))):
        c = int(choice[u, used])
        picks.append(c)
        used -= int(units[u, c])
    return tuple(reversed(picks))


def _with_weights(model: PyTree, paths: Sequence[str], weights: Sequence[Array]) -> PyTree:
    """`model` with the weights of its layers at `paths` replaced by `weights`."""

    def where(m: PyTree) -> list:
        layers = dict(nodes(m, _FLOAT_LAYERS))
        return [layers[p].weight for p in paths]

    return eqx.tree_at(where, model, list(weights))


def _float_leaves(tree: PyTree) -> list[Array]:
    return [leaf for leaf in jax.tree.leaves(tree) if jnp.issubdtype(leaf.dtype, jnp.inexact)]


def _distance(kind: str, out: PyTree, reference: PyTree) -> Array:
    """The mean squared difference (`"mse"`) or the mean KL divergence from the reference's softmax over the last axis
    (`"kl"`) of the floating leaves of `out` and `reference`, summed over the leaves."""
    total = jnp.zeros((), jnp.float32)
    for a, b in zip(_float_leaves(out), _float_leaves(reference), strict=True):
        if kind == "mse":
            total = total + jnp.mean(jnp.square(a - b))
        else:
            log_p, log_q = jax.nn.log_softmax(b, axis=-1), jax.nn.log_softmax(a, axis=-1)
            total = total + jnp.mean(jnp.sum(jnp.exp(log_p) * (log_p - log_q), axis=-1))
    return total


def _warn_of_traced_weights(model: PyTree, batch: PyTree, loss: object, batched: bool | None) -> None:
    """Warns, naming them, of the model's own arrays that are weights of products outside its layers (bare arrays,
    custom layer classes, `jnp.einsum`), found by tracing one batch: they stay float, outside the budget."""
    call = (
        (lambda m: loss(m, batch))  # pyright: ignore[reportCallIssue]
        if callable(loss)
        else (lambda m: m(batch) if batched else jax.vmap(m)(batch))
    )
    layers = [path for path, _ in nodes(model, (*layer_types(), *TRACED_ONLY))]  # warned of apart
    found = find_products(model, call, layers)
    sizes = {p.path: p.weight.size for p in found.weights} | {p: t.weight.size for p, (t, _) in found.problems.items()}
    if sizes:
        names = ", ".join(repr(path) for path in sizes)
        warnings.warn(
            f"auto_recipe allocates among Linear, Conv and Embedding layers: the model's arrays {names} "
            f"({sum(sizes.values()):,} weights) are weights of products outside them and stay in floating point, "
            "outside the budget and the report (`quantize(..., example=)` quantizes them, with rules of your own).",
            stacklevel=caller_stacklevel(),
        )


def _batch_list(batches: Iterable[PyTree], loss: object) -> list[PyTree]:
    """`batches` as a list, not empty, checked to hold examples for the built-in losses (a loss of its own reads
    them its own way)."""
    batches = list(batches) if callable(loss) else checked(batches)
    if not batches:
        raise ValueError("`batches` is empty: at least one batch is needed.")
    return batches


def auto_recipe(
    model: PyTree,
    batches: Iterable[PyTree] | AutoRecipeReport,
    *,
    average_bits: int | float | None = None,
    budget_bytes: int | None = None,
    candidates: Sequence[str] = DEFAULT_CANDIDATES,
    method: Literal["hessian", "measured"] | None = None,
    loss: Literal["mse", "kl"] | Callable[[PyTree, PyTree], Array] = "mse",
    activations: AbstractQuantizer | Callable | None = None,
    learned: bool = False,
    keep: str | Sequence[str] = (),
    probes: int | None = None,
    key: PRNGKeyArray | None = None,
    batched: bool | None = None,
) -> AutoRecipe:
    r"""Mixed precision chosen for you: a weight format per layer, minimising the predicted increase of a loss under
    a size budget. `eqx_quant.quantize(model, **auto_recipe(model, batches, average_bits=4))`.

    Every `Linear`, `Conv` and `Embedding` of the float `model` (but those `keep` names) is a unit of the allocation;
    a stack of layers (built with `eqx.filter_vmap`, run with `jax.lax.scan`) is one unit. Weights the model
    multiplies outside such layers (bare arrays, custom layer classes, `jnp.einsum`; found by tracing the first
    batch) and layers that only tracing quantizes (`ConvTranspose`, `GRUCell`, `LSTMCell`) stay float, outside the
    budget, with a warning naming them. For each unit $u$ and
    candidate format $c$ the weight is quantized as `quantize` would quantize it (round to nearest, with the
    candidate's [`eqx_quant.LayerQuantizer`][]), and the loss increase $\Delta_{u,c}$ is predicted:

    - `method="hessian"` (HAWQ-v2/v3): $\Delta_{u,c} = \frac{\operatorname{tr} H_u}{n_u}\,\lVert Q_c(W_u) -
        W_u\rVert^2$, with $H_u$ the Hessian of the loss towards the unit's $n_u$ weights (its block of the whole
        Hessian), its trace estimated by Hutchinson's method: the mean of $z^\top H_u z$ over `probes` Rademacher
        vectors $z$ of the unit's shape, each a Hessian-vector product (forward over reverse mode) on every batch,
        the probes of a unit together under `jax.vmap`: `probes` products of the whole model per unit and batch.
        A negative estimate (for a loss that is not convex there) counts as 0. It sees the weights only: it
        predicts nothing of `activations`.
    - `method="measured"`: $\Delta_{u,c}$ is the loss with only unit $u$ quantized at $c$ (and, with
        `activations`, its input quantized too), minus the float loss, averaged over the batches: one evaluation
        per unit, candidate and batch (with `activations`, one compilation per unit and candidate as well).

    Then one candidate per unit is chosen to minimise $\sum_u \Delta_{u,c_u}$ under the budget, exactly, by dynamic
    programming (see below). Deterministic for a given `key`.

    **The budget**, exactly one of:

    - `average_bits`: the bits per weight element, averaged over the units' weights, at most this (the elements
        only: a scale's bits are not counted; `"float"` counts the float weight's own bits, 32 for float32);
    - `budget_bytes`: the bytes the converted model stores for the units' weights (codes, scales, zero points;
        `"float"` at the float weight's size), at most this: what [`eqx_quant.summary`][] reports as `stored_bytes`.

    The dynamic program counts sizes in units of their greatest common divisor, exact whenever the budget holds at
    most `2**17` of them; beyond that, in units of `budget / 2**17` (the budget is still met exactly, and the choice
    is optimal up to one such unit per layer; see `allocate` in the source).

    **Arguments:**

    - `model`: a float model (quantize its result, not a quantized model).
    - `batches`: an iterable of inputs, each with a leading batch axis (as for [`eqx_quant.calibrate`][]); read
        once, so a generator will do. Or the `.report` of an earlier call on the same model: its predictions are
        used again (no data is read, no Hessian computed), for another budget, say; `method`, `loss`, `probes`,
        `key` and `batched` are then the report's.
    - `average_bits`, `budget_bytes`: the budget, as above.
    - `candidates`: the formats a unit may take, by name: `"int8"` (one scale per output channel), `"int4_g32"` (per
        group of 32 along the contraction; any integer format and group), `"float8_e4m3fn"`, `"mxfp4"`,
        `"mxfp8_e4m3"`, `"nvfp4"` (their own blocks), `"q4_0"`, ..., and `"float"` (the layer stays float).
        Where a candidate's groups do not fit a layer, that layer gets the fallback the candidate's
        [`eqx_quant.LayerQuantizer`][] describes, with its warning, and the report names what it gets; a GGML
        candidate that does not fit at all is left out for that layer.
    - `method`: `"hessian"` (the default) or `"measured"`, as above.
    - `loss`: the loss whose increase is predicted: `"mse"` (the default), the mean squared difference between the
        model's outputs and the float model's on each batch; `"kl"`, the mean KL divergence from the float model's
        outputs read as logits (a softmax over their last axis); or a function `loss(model, batch) -> scalar`. The
        built-in losses call the model per example under `jax.vmap` (or on the whole batch with `batched=True`),
        compare every floating leaf of its output and sum over the leaves; at the float model their Hessians are
        Gauss-Newton matrices (the Fisher information for `"kl"`).
    - `activations`: the input quantizer of every quantized layer in the returned rules (a quantizer or a factory
        `f(path, layer)`); `None` (the default) leaves inputs in float: the allocation is about weights.
    - `learned`: the returned rules make [`eqx_quant.LearnedFakeQuant`][] weights (as [`eqx_quant.recipe`][] does with
        `learned=True`: starting from the round-to-nearest scales), for quantization-aware training of the choice.
        The allocation itself is the same.
    - `keep`: patterns (regular expressions matched against whole paths) of layers to leave out: they stay float
        and count towards no budget.
    - `probes`: the number of Hutchinson probes per unit (`method="hessian"` only), computed together under
        `jax.vmap`; 16 by default.
    - `key`: the PRNG key of the probes (`method="hessian"` only); `jax.random.key(0)` by default.
    - `batched`: whether the built-in losses call the model on whole batches (`False` by default); not for a `loss`
        function.

    **Returns:**

    An [`eqx_quant.AutoRecipe`][]: `{"rules": [...]}` (one [`eqx_quant.Rule`][] per chosen format, naming its layers;
    units chosen `"float"` get none and stay float), with the [`eqx_quant.AutoRecipeReport`][] as `.report`: each
    layer's choice, trace, predicted cost and bytes.

    **Raises:**

    Before any data is read: `ValueError` for no budget or both, a non-positive budget or one that no choice meets
    (naming the least it could be), an unknown candidate, no candidates or only `"float"`, a `keep` pattern that is
    not a regular expression or matches no layer, a layer that can take none of the candidates, a model without
    layers to allocate or with quantized layers, `probes` or `key` with `method="measured"`, `batched` with a `loss`
    function, or `probes < 1`; `TypeError` for arguments of the wrong type (one array for `batches`). After:
    `ValueError` if a predicted cost is not finite (NaN or inf in the data or outputs), naming the layer.

    !!! example

        ```python
        import equinox as eqx
        import jax
        import eqx_quant

        mlp = eqx.nn.MLP(32, 4, 64, 2, key=jax.random.key(0))
        batches = [jax.random.normal(jax.random.key(i), (16, 32)) for i in range(2)]
        auto = eqx_quant.auto_recipe(mlp, batches, average_bits=4, candidates=("int8", "int4_g32", "int2_g32"))
        print([row.choice for row in auto.report.rows])
        qmlp = eqx_quant.quantize(mlp, **auto)
        ```
    """
    budget_name = _check_budget(average_bits, budget_bytes)
    options = _check_candidates(candidates)
    earlier = batches if isinstance(batches, AutoRecipeReport) else None
    if earlier is not None:
        if method is not None and method != earlier.method:
            raise ValueError(f"`method`: the report was made with method={earlier.method!r}, got method={method!r}.")
        if not (loss == "mse" and probes is None and key is None and batched is None):
            raise ValueError("`loss`, `probes`, `key` and `batched` were decided when the report was made; leave them.")
        method = earlier.method
    method = "hessian" if method is None else method
    if method not in ("hessian", "measured"):
        raise ValueError(f"`method` must be 'hessian' or 'measured', got method={method!r}.")
    if method == "measured" and (probes is not None or key is not None):
        raise ValueError("`probes` and `key` are for method='hessian'; method='measured' draws no probes.")
    probes = 16 if probes is None else check_int("probes", probes)
    if probes < 1:
        raise ValueError(f"`probes` must be at least 1, got probes={probes}.")
    if key is not None and not (isinstance(key, jax.Array) and jax.dtypes.issubdtype(key.dtype, jax.dtypes.prng_key)):
        raise TypeError(f"`key` must be a JAX PRNG key (`jax.random.key(0)`), got key={key!r}.")
    for name, flag in (("learned", learned), ("batched", batched)):
        if flag is not None and not isinstance(flag, bool):
            raise TypeError(f"`{name}` must be a bool, got {name}={flag!r}.")
    if not (loss in ("mse", "kl") or callable(loss)):
        raise TypeError(f"`loss` must be 'mse', 'kl' or a function loss(model, batch) -> scalar, got loss={loss!r}.")
    if callable(loss) and batched is not None:
        raise ValueError("`batched` is for the built-in losses; a `loss` function calls the model itself.")
    if not (activations is None or isinstance(activations, AbstractQuantizer) or callable(activations)):
        raise TypeError(f"`activations` must be a quantizer, a factory f(path, layer) or None, got {activations!r}.")
    if earlier is None:
        check_not_one_array(batches)
    if isinstance(batches, Sequence):  # checked now (an iterator is read once the other arguments are)
        batches = _batch_list(batches, loss)
    patterns = _check_patterns(keep)
    if nodes(model, (AbstractQuantLayer,)):
        raise ValueError("`model` already holds quantized layers: give auto_recipe the float model.")

    found = [(p, layer) for p, layer in nodes(model, _FLOAT_LAYERS) if eqx.is_array(layer.weight)]
    for pattern in patterns:
        if not any(re.fullmatch(pattern, p) for p, _ in found):
            raise ValueError(f"`keep`: {pattern!r} matches no layer; the layers are {[p for p, _ in found]}.")
    units = [(p, layer) for p, layer in found if not any(re.fullmatch(k, p) for k in patterns)]
    if not units:
        raise ValueError(
            "`model` has no Linear, Conv or Embedding layer to allocate formats to (outside `keep`). `auto_recipe` "
            "allocates among those layers only: products written with bare arrays take the rules you give "
            "`quantize(..., example=)`."
        )

    untraced = [f"{p or '(the model itself)'!r} ({type(layer).__name__})" for p, layer in nodes(model, TRACED_ONLY)]
    if untraced:
        warnings.warn(
            f"auto_recipe allocates among Linear, Conv and Embedding layers: the layers {', '.join(untraced)} stay in "
            "floating point, outside the budget (`quantize(..., example=)` quantizes them by tracing, with rules of "
            "your own).",
            stacklevel=caller_stacklevel(),
        )
    quantized = _what_candidates_make(model, units, options)
    for u, (path, _) in enumerate(units):
        if not any((u, c) in quantized for c in range(len(options))):
            raise ValueError(f"Layer {path!r} can take none of the candidates {tuple(candidates)}.")
    if average_bits is not None:
        sizes = np.array([[quantized[u, c].bits * units[u][1].weight.size if (u, c) in quantized else 0
                           for c in range(len(options))] for u in range(len(units))])  # fmt: skip
        budget = math.floor(average_bits * sum(layer.weight.size for _, layer in units) + 1e-9)
        unit = "bits"
    else:
        sizes = np.array([[quantized[u, c].bytes if (u, c) in quantized else 0 for c in range(len(options))]
                          for u in range(len(units))])  # fmt: skip
        budget, unit = int(budget_bytes), "bytes"  # pyright: ignore[reportArgumentType]
    least = sum(min(int(sizes[u, c]) for c in range(len(options)) if (u, c) in quantized) for u in range(len(units)))
    if least > budget:
        raise ValueError(
            f"no choice among the candidates {tuple(candidates)} fits {budget_name}: the smallest takes {least:,} "
            f"{unit} against a budget of {budget:,}."
        )

    if earlier is not None:
        costs, traces = _earlier_costs(earlier, units, quantized, options)
        return _choose(units, options, quantized, costs, traces, sizes, budget, unit, method, learned, activations)
    kind = "mse" if callable(loss) else loss
    evaluate = eqx.filter_jit(
        (lambda m, batch, ref: loss(m, batch))  # pyright: ignore[reportCallIssue]
        if callable(loss)
        else (lambda m, batch, ref: _distance(kind, m(batch) if batched else jax.vmap(m)(batch), ref))
    )
    reference_of = eqx.filter_jit(lambda m, b: None if callable(loss) else (m(b) if batched else jax.vmap(m)(b)))
    batches = _batch_list(batches, loss)
    data = []
    for i, batch in enumerate(batches):
        try:
            data.append((batch, reference_of(model, batch)))
        except Exception as error:
            add_batch_note(error, batch, bool(batched), "the first batch" if i == 0 else f"batch {i}")
            raise
    if not data:
        raise ValueError("`batches` is empty: give at least one batch of inputs.")
    _warn_of_traced_weights(model, data[0][0], loss, batched)
    if method == "hessian":
        costs, traces = _hessian_costs(model, units, quantized, len(options), data, evaluate, probes, key)
    else:
        costs, traces = _measured_costs(model, units, quantized, options, data, evaluate, activations)
    for u, c in quantized:
        if not np.isfinite(costs[u, c]):
            raise ValueError(
                f"The predicted cost of layer {units[u][0]!r} at {options[c].name!r} is {costs[u, c]}: the loss is "
                "not finite on these batches (NaN or inf in the data or the outputs)."
            )
    return _choose(units, options, quantized, costs, traces, sizes, budget, unit, method, learned, activations)


def _choose(units, options, made, costs, traces, sizes, budget, unit, method, learned, activations) -> AutoRecipe:
    """The allocation, its rules and its report (`costs` is `inf` where a layer cannot take a candidate)."""
    picks = allocate(costs, sizes, budget)
    rows = []
    for u, (path, layer) in enumerate(units):
        c = picks[u]
        unit_costs = {options[k].name: float(costs[u, k]) for k in range(len(options)) if (u, k) in made}
        rows.append(AutoRecipeRow(path, int(layer.weight.size), options[c].name, made[u, c].description,
                                  int(made[u, c].bits), int(made[u, c].bytes), float(costs[u, c]), traces[u],
                                  unit_costs))  # fmt: skip
    rules = []
    for c, option in enumerate(options):
        chosen = [re.escape(units[u][0]) for u in range(len(units)) if picks[u] == c]
        if option.format is None or not chosen:
            continue
        factory = LayerQuantizer(option.format, option.group_size, learned=learned)
        rules.append(Rule("|".join(chosen), weight=factory, input=activations))
    return AutoRecipe(rules, AutoRecipeReport(tuple(rows), budget, unit, method))


def _earlier_costs(report: AutoRecipeReport, units: list, made: dict, options: list[_Candidate]):
    """The costs and traces of an earlier report, for the same layers and candidates."""
    paths = [p for p, _ in units]
    if [row.path for row in report.rows] != paths:
        raise ValueError(
            f"`batches`: the report's layers {[row.path for row in report.rows]} are not this model's {paths} "
            "(outside `keep`)."
        )
    costs = np.full((len(units), len(options)), np.inf)
    for u, row in enumerate(report.rows):
        for c, option in enumerate(options):
            if (u, c) not in made:
                continue
            if option.name not in row.costs:
                raise ValueError(f"`batches`: the report has no prediction for {option.name!r} at layer {row.path!r}.")
            costs[u, c] = row.costs[option.name]
    return costs, [row.trace for row in report.rows]


def _check_budget(average_bits: object, budget_bytes: object) -> str:
    if (average_bits is None) == (budget_bytes is None):
        raise ValueError(
            f"give exactly one budget, `average_bits` or `budget_bytes`; got average_bits={average_bits!r} and "
            f"budget_bytes={budget_bytes!r}."
        )
    if average_bits is not None:
        if isinstance(average_bits, bool) or not isinstance(average_bits, (int, float, np.integer, np.floating)):
            raise TypeError(f"`average_bits` must be a number, got average_bits={average_bits!r}.")
        if not (math.isfinite(average_bits) and average_bits > 0):
            raise ValueError(f"`average_bits` must be positive and finite, got average_bits={average_bits!r}.")
        return f"average_bits={average_bits}"
    if check_int("budget_bytes", budget_bytes) <= 0:
        raise ValueError(f"`budget_bytes` must be positive, got budget_bytes={budget_bytes}.")
    return f"budget_bytes={budget_bytes}"


def _check_candidates(candidates: object) -> list[_Candidate]:
    if isinstance(candidates, str) or not isinstance(candidates, Sequence):
        raise TypeError(f"`candidates` must be a sequence of format names, got candidates={candidates!r}.")
    options = [_candidate(name) for name in candidates]
    if not options:
        raise ValueError("`candidates` is empty: give at least one format name.")
    if len({o.name for o in options}) != len(options):
        raise ValueError(f"`candidates` names a format twice: {tuple(candidates)!r}.")
    if all(o.format is None for o in options):
        raise ValueError("`candidates` holds only 'float': nothing would be quantized.")
    return options


def _check_patterns(keep: object) -> tuple[str, ...]:
    if isinstance(keep, str):
        keep = (keep,)
    if not isinstance(keep, Sequence) or not all(isinstance(p, str) for p in keep):
        raise TypeError(f"`keep` must be a pattern or a sequence of patterns, got keep={keep!r}.")
    for pattern in keep:
        try:
            re.compile(pattern)
        except re.error as error:
            raise ValueError(f"`keep`: {pattern!r} is not a valid regular expression ({error}).") from None
    return tuple(keep)


@dataclasses.dataclass(frozen=True)
class _Made:
    """What a candidate makes of a unit: the quantizer in words, bits per element, stored bytes, the weight as the
    quantized model computes with it."""

    description: str
    bits: int
    bytes: int
    weight: Array


def _what_candidates_make(model: PyTree, units: list, options: list[_Candidate]) -> dict[tuple[int, int], _Made]:
    made = {}
    for c, option in enumerate(options):
        if option.format is None:
            for u, (_, layer) in enumerate(units):
                w = layer.weight
                made[u, c] = _Made("float", w.dtype.itemsize * 8, w.size * w.dtype.itemsize, w)
            continue
        factory = LayerQuantizer(option.format, option.group_size)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            makers = {path: factory(path, layer) for path, layer in units}
        for message in sorted({str(w.message) for w in caught}):
            warnings.warn(f"auto_recipe, candidate {option.name!r}: {message}", stacklevel=3)
        rules = [Rule(re.escape(p), weight=q, input=None) for p, q in makers.items() if q is not None]
        if not rules:
            continue
        stored = {row.path: row for row in summary(quantize(model, rules)).rows}
        for u, (path, layer) in enumerate(units):
            quantizer = makers[path]
            if quantizer is None:
                continue
            weight = _quantized_weight(stack_depth(layer, layer.weight.shape))(quantizer, layer.weight)
            row = stored[path]
            made[u, c] = _Made(describe_quantizer(quantizer), row.bits, row.stored_bytes, weight)
    return made


def _hessian_costs(model, units, made, count, data, evaluate, probes, key):
    """HAWQ's predicted costs from Hutchinson estimates of each unit's Hessian trace, and the traces."""
    paths = [p for p, _ in units]

    def objective(weights, batch, ref):
        return evaluate(_with_weights(model, paths, weights), batch, ref)

    @eqx.filter_jit
    def quadratic_forms(weights, batch, ref, tangents):
        # `sum_v t_v . (H t)_v` per probe, for tangents that are zero but on one unit: that unit's block of the
        # Hessian, with no cross terms from the others.
        grad = jax.grad(objective)
        hvp = lambda t: jax.jvp(lambda w: grad(w, batch, ref), (weights,), (t,))[1]  # noqa: E731
        ht = jax.vmap(hvp)(tangents)
        return sum(jnp.sum(a * b, axis=tuple(range(1, a.ndim))) for a, b in zip(tangents, ht, strict=True))

    weights = [layer.weight for _, layer in units]
    keys = jax.random.split(jax.random.key(0) if key is None else key, len(units))
    zeros = [jnp.zeros((probes, *w.shape), w.dtype) for w in weights]
    costs = np.full((len(units), count), np.inf)
    traces = []
    for u, (_, layer) in enumerate(units):
        z = jax.random.rademacher(keys[u], (probes, *layer.weight.shape), layer.weight.dtype)
        tangents = [z if v == u else zeros[v] for v in range(len(units))]
        forms = sum(np.asarray(quadratic_forms(weights, batch, ref, tangents), np.float64) for batch, ref in data)
        trace = float(np.mean(forms) / len(data))
        traces.append(trace)
        w = np.asarray(layer.weight, np.float64)
        for c in range(count):  # `max` keeps a NaN trace (its first argument): the caller reports it
            if (u, c) in made:
                error = float(np.sum((np.asarray(made[u, c].weight, np.float64) - w) ** 2))
                costs[u, c] = max(trace, 0.0) / w.size * error
    return costs, traces


def _measured_costs(model, units, made, options, data, evaluate, activations):
    """The loss with each unit alone quantized at each candidate (its input too, with `activations`), minus the float
    model's."""
    base = sum(float(evaluate(model, batch, ref)) for batch, ref in data)
    costs = np.full((len(units), len(options)), np.inf)
    if activations is None:  # only a weight changes: one compiled program for every unit and candidate
        for (u, c), entry in made.items():
            trial = _with_weights(model, [units[u][0]], [entry.weight])
            costs[u, c] = (sum(float(evaluate(trial, batch, ref)) for batch, ref in data) - base) / len(data)
        return costs, [None] * len(units)
    for u, c in made:
        option = options[c]
        if option.format is None:
            costs[u, c] = 0.0
            continue
        path = units[u][0]
        rule = Rule(re.escape(path), weight=LayerQuantizer(option.format, option.group_size), input=activations)
        trial = quantize(model, [rule])
        costs[u, c] = (sum(float(evaluate(trial, batch, ref)) for batch, ref in data) - base) / len(data)
    return costs, [None] * len(units)
