"""Automatic mixed precision: a weight format per layer, chosen to minimise the predicted loss under a size budget."""

import dataclasses
import math
import re
import warnings
from collections.abc import Callable, Iterable, Sequence
from typing import Any, Literal

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, PRNGKeyArray, PyTree

from ._format import Format, format_named
from ._misc import check_int
from ._quantizers import AbstractQuantizer
from ._rules import LayerQuantizer, Rule, quantize
from ._summary import _FLOAT_LAYERS, describe_quantizer, summary
from ._tree import nodes, path_string
from .nn._layers import AbstractQuantLayer, _quantized_weight, stack_depth


DEFAULT_CANDIDATES = ("int8", "int4_g32", "int3_g32", "int2_g32", "float8_e4m3fn", "mxfp4", "nvfp4", "float")
_BLOCK_OF_SCALE = {"e8m0": 32, "e4m3": 16, "float16": 32}  # MX, NVFP4 and GGML blocks: their formats' own sizes
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
        widths = [max(len(row[i]) for row in cells) for i in range(len(header))]
        numeric = (1, 4, 5, 6, 7)
        lines = [
            "  ".join(
                c.rjust(w) if i in numeric else c.ljust(w) for i, (c, w) in enumerate(zip(row, widths, strict=True))
            ).rstrip()
            for row in cells
        ]
        rule = "  ".join("-" * w for w in widths)
        return "\n".join([lines[0], rule, *lines[1:-1], rule, lines[-1]])


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
    units of their greatest common divisor; where the budget holds more than `2**17` of those, in units of
    `budget / 2**17` rounded up, each size rounded up to a whole unit (the budget is then still met, and the choice
    is optimal for the rounded sizes)."""
    costs, sizes = np.asarray(costs, np.float64), np.asarray(sizes, np.int64)
    step = math.gcd(*(int(s) for s in sizes.ravel()), int(budget)) or 1
    if budget // step > _MAX_STATES:
        step = -(-budget // _MAX_STATES)
    units = -(-sizes // step)  # rounded up
    capacity = budget // step
    best = np.full(capacity + 1, np.inf)
    best[0] = 0.0
    choice = np.zeros((len(costs), capacity + 1), np.int32)
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
        raise ValueError("no choice of the candidates fits the budget")
    used = int(np.argmin(best))  # the least cost; among equal costs, the smallest size
    picks = []
    for u in reversed(range(len(costs))):
        c = int(choice[u, used])
        picks.append(c)
        used -= int(units[u, c])
    return tuple(reversed(picks))


def _weight_leaves(model: PyTree, paths: Sequence[str]) -> tuple[list[int], list, Any]:
    """The positions, among the leaves of `model`, of the weights of the layers at `paths`; the leaves; the treedef."""
    leaves_with_path, treedef = jax.tree_util.tree_flatten_with_path(model)
    names = {f"{path}.weight" if path else "weight": i for i, path in enumerate(paths)}
    positions = [-1] * len(paths)
    for i, (key_path, _) in enumerate(leaves_with_path):
        j = names.get(path_string(key_path))
        if j is not None:
            positions[j] = i
    assert all(p >= 0 for p in positions)
    return positions, [leaf for _, leaf in leaves_with_path], treedef


def _output_mse(model: PyTree, batch: PyTree, reference: PyTree, batched: bool) -> Array:
    """The mean squared difference of the model's outputs (any PyTree of arrays) from `reference`, summed over the
    output's leaves."""
    out = model(batch) if batched else jax.vmap(model)(batch)
    pairs = zip(jax.tree.leaves(out), jax.tree.leaves(reference), strict=True)
    return sum((jnp.mean(jnp.square(a - b)) for a, b in pairs), jnp.zeros((), jnp.float32))


def auto_recipe(
    model: PyTree,
    batches: Iterable[PyTree],
    *,
    average_bits: int | float | None = None,
    budget_bytes: int | None = None,
    candidates: Sequence[str] = DEFAULT_CANDIDATES,
    method: Literal["hessian", "measured"] = "hessian",
    loss: Callable[[PyTree, PyTree], Array] | None = None,
    activations: AbstractQuantizer | Callable | None = None,
    learned: bool = False,
    keep: str | Sequence[str] = (),
    probes: int = 16,
    key: PRNGKeyArray | None = None,
    batched: bool = False,
) -> AutoRecipe:
    r"""Mixed precision chosen for you: a weight format per layer, minimising the predicted increase of a loss under
    a size budget. `eqx_quant.quantize(model, **auto_recipe(model, batches, average_bits=4))`.

    Every `Linear`, `Conv` and `Embedding` of the float `model` (but those `keep` names) is a unit of the allocation;
    a stack of layers (built with `eqx.filter_vmap`, run with `jax.lax.scan`) is one unit. For each unit $u$ and
    candidate format $c$ the weight is quantized as `quantize` would quantize it (round to nearest, with the
    candidate's [`eqx_quant.LayerQuantizer`][]), and the loss increase $\Delta_{u,c}$ is predicted:

    - `method="hessian"` (HAWQ-v2/v3): $\Delta_{u,c} = \frac{\operatorname{tr} H_u}{n_u}\,\lVert Q_c(W_u) -
        W_u\rVert^2$, with $H_u$ the Hessian of the loss towards the unit's $n_u$ weights (its block of the whole
        Hessian), its trace estimated by Hutchinson's method: the mean of $z^\top H_u z$ over `probes` Rademacher
        vectors $z$ of the unit's shape, each a Hessian-vector product (forward over reverse mode) on every batch,
        the probes of a unit together under `jax.vmap`: `probes` products per unit and batch. A negative estimate
        (for a loss that is not convex there) counts as 0.
    - `method="measured"`: $\Delta_{u,c}$ is the loss with only unit $u$ quantized at $c$, minus the float loss,
        averaged over the batches: one evaluation per unit, candidate and batch.

    Then one candidate per unit is chosen to minimise $\sum_u \Delta_{u,c_u}$ under the budget, exactly, by dynamic
    programming (see below). Deterministic for a given `key`.

    **The budget**, exactly one of:

    - `average_bits`: the bits per weight element, averaged over the units' weights, at most this (the elements
        only: a scale's bits are not counted; `"float"` counts the float weight's own bits, 32 for float32);
    - `budget_bytes`: the bytes the converted model stores for the units' weights (codes, scales, zero points;
        `"float"` at the float weight's size), at most this: what [`eqx_quant.summary`][] reports as `stored_bytes`.

    The dynamic program counts sizes in units of their greatest common divisor, exact whenever the budget holds at
    most `2**17` of them; beyond that, in units of `budget / 2**17`, each size rounded up (the budget is still met).

    **Arguments:**

    - `model`: a float model (quantize its result, not a quantized model).
    - `batches`: an iterable of inputs, each with a leading batch axis (as for [`eqx_quant.calibrate`][]); read
        once, so a generator will do.
    - `average_bits`, `budget_bytes`: the budget, as above.
    - `candidates`: the formats a unit may take, by name: `"int8"` (one scale per output channel), `"int4_g32"` (per
        group of 32 along the contraction; any integer format and group), `"float8_e4m3fn"`, `"mxfp4"`,
        `"mxfp8_e4m3"`, `"nvfp4"` (their own blocks), `"q4_0"`, ..., and `"float"` (the layer stays float).
        Where a candidate's groups do not fit a layer, that layer gets the fallback the candidate's
        [`eqx_quant.LayerQuantizer`][] describes, with its warning, and the report names what it gets; a GGML
        candidate that does not fit at all is left out for that layer.
    - `method`: `"hessian"` or `"measured"`, as above.
    - `loss`: `loss(model, batch) -> scalar`, the loss whose increase is predicted. By default the mean squared
        difference between the model's outputs and the float model's, on each batch (`model` called per example
        under `jax.vmap`, or on the whole batch with `batched=True`); its Hessian at the float model is then twice
        the Gauss-Newton matrix.
    - `activations`: the input quantizer of every quantized layer in the returned rules (a quantizer or a factory
        `f(path, layer)`); `None` (the default) leaves inputs in float: the allocation is about weights.
    - `learned`: the returned rules make [`eqx_quant.LearnedFakeQuant`][] weights (as [`eqx_quant.recipe`][] does with
        `learned=True`: starting from the round-to-nearest scales), for quantization-aware training of the choice.
        The allocation itself is the same.
    - `keep`: patterns (regular expressions matched against whole paths) of layers to leave out: they stay float
        and count towards no budget.
    - `probes`: the number of Hutchinson probes per unit (`method="hessian"`), computed together under `jax.vmap`.
    - `key`: the PRNG key of the probes; `jax.random.key(0)` by default.
    - `batched`: whether the default loss calls the model on whole batches.

    **Returns:**

    An [`eqx_quant.AutoRecipe`][]: `{"rules": [...]}` (one [`eqx_quant.Rule`][] per chosen format, naming its layers;
    units chosen `"float"` get none and stay float), with the [`eqx_quant.AutoRecipeReport`][] as `.report`: each
    layer's choice, trace, predicted cost and bytes.

    **Raises:**

    `ValueError` for no budget or both, a non-positive budget or one that no choice meets (naming the least it could
    be), an unknown candidate, no candidates, a `keep` pattern that matches no layer, a model without layers to
    allocate or with quantized layers, or `probes < 1`; `TypeError` for arguments of the wrong type.

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
    else:
        budget_bytes = check_int("budget_bytes", budget_bytes)
        if budget_bytes <= 0:
            raise ValueError(f"`budget_bytes` must be positive, got budget_bytes={budget_bytes}.")
    if isinstance(candidates, str) or not isinstance(candidates, Sequence):
        raise TypeError(f"`candidates` must be a sequence of format names, got candidates={candidates!r}.")
    options = [_candidate(name) for name in candidates]
    if not options:
        raise ValueError("`candidates` is empty: give at least one format name.")
    if len({o.name for o in options}) != len(options):
        raise ValueError(f"`candidates` names a format twice: {tuple(candidates)!r}.")
    if method not in ("hessian", "measured"):
        raise ValueError(f"`method` must be 'hessian' or 'measured', got method={method!r}.")
    probes = check_int("probes", probes)
    if probes < 1:
        raise ValueError(f"`probes` must be at least 1, got probes={probes}.")
    if not isinstance(learned, bool):
        raise TypeError(f"`learned` must be a bool, got learned={learned!r}.")
    if loss is not None and not callable(loss):
        raise TypeError(f"`loss` must be a function loss(model, batch) -> scalar, got loss={loss!r}.")
    patterns = (keep,) if isinstance(keep, str) else tuple(keep)
    for pattern in patterns:
        if not isinstance(pattern, str):
            raise TypeError(f"`keep` must be a pattern or a sequence of patterns, got keep={keep!r}.")
    if nodes(model, (AbstractQuantLayer,)):
        raise ValueError("`model` already holds quantized layers: give auto_recipe the float model.")

    found = [(p, layer) for p, layer in nodes(model, _FLOAT_LAYERS) if eqx.is_array(layer.weight)]
    for pattern in patterns:
        if not any(re.fullmatch(pattern, p) for p, _ in found):
            raise ValueError(f"`keep`: {pattern!r} matches no layer; the layers are {[p for p, _ in found]}.")
    units = [(p, layer) for p, layer in found if not any(re.fullmatch(k, p) for k in patterns)]
    if not units:
        raise ValueError("`model` has no Linear, Conv or Embedding layer to allocate formats to (outside `keep`).")
    paths = [p for p, _ in units]

    # What each candidate makes of each unit: its quantizer, fake-quantized weight and stored bytes.
    quantized = {}  # (unit, candidate) -> (description, bits, bytes, fake-quantized weight)
    for c, option in enumerate(options):
        for u, (_, layer) in enumerate(units):
            weight = layer.weight
            if option.format is None:
                quantized[u, c] = ("float", weight.dtype.itemsize * 8, weight.size * weight.dtype.itemsize, weight)
        if option.format is None:
            continue
        factory = LayerQuantizer(option.format, option.group_size)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            makers = {path: factory(path, layer) for path, layer in units}
        for message in {str(w.message) for w in caught}:
            warnings.warn(f"auto_recipe, candidate {option.name!r}: {message}", stacklevel=2)
        rules = [Rule(re.escape(p), weight=q, input=None) for p, q in makers.items() if q is not None]
        if not rules:
            continue
        qmodel = quantize(model, rules)
        stored = {row.path: row for row in summary(qmodel).rows}
        qlayers = dict(nodes(qmodel, (AbstractQuantLayer,)))
        for u, (path, layer) in enumerate(units):
            if makers[path] is None:
                continue
            qlayer = qlayers[path]
            depth = stack_depth(layer, layer.weight.shape)
            fake = _quantized_weight(depth)(qlayer.weight_quant, layer.weight)
            row = stored[path]
            quantized[u, c] = (describe_quantizer(qlayer.weight_quant), row.bits, row.stored_bytes, fake)

    # The loss, as a function of the units' weights.
    positions, leaves, treedef = _weight_leaves(model, paths)

    def with_weights(weights):
        new = list(leaves)
        for p, w in zip(positions, weights, strict=True):
            new[p] = w
        return jax.tree_util.tree_unflatten(treedef, new)

    float_weights = [leaves[p] for p in positions]
    if loss is None:
        reference_of = eqx.filter_jit(lambda m, b: m(b) if batched else jax.vmap(m)(b))
        objective = lambda weights, batch, ref: _output_mse(with_weights(weights), batch, ref, batched)  # noqa: E731
    else:
        reference_of = lambda m, b: None  # noqa: E731
        objective = lambda weights, batch, ref: loss(with_weights(weights), batch)  # noqa: E731
    objective = eqx.filter_jit(objective)

    batches = [(batch, reference_of(model, batch)) for batch in batches]
    if not batches:
        raise ValueError("`batches` is empty: give at least one batch of inputs.")

    costs = np.full((len(units), len(options)), np.inf)
    traces: list[float | None] = [None] * len(units)
    if method == "hessian":
        key = jax.random.key(0) if key is None else key
        keys = jax.random.split(key, len(units))
        z = [jax.random.rademacher(k, (probes, *w.shape), w.dtype) for k, w in zip(keys, float_weights, strict=True)]

        @eqx.filter_jit
        def quadratic_forms(weights, batch, ref, tangents):
            # `sum_v t_v . (H t)_v` per probe, for tangents that are zero but on one unit: that unit's block of the
            # Hessian, with no cross terms from the others.
            grad = jax.grad(objective)
            hvp = lambda t: jax.jvp(lambda w: grad(w, batch, ref), (weights,), (t,))[1]  # noqa: E731
            ht = jax.vmap(hvp)(tangents)
            return sum(jnp.sum(a * b, axis=tuple(range(1, a.ndim))) for a, b in zip(tangents, ht, strict=True))

        zeros = [jnp.zeros((probes, *w.shape), w.dtype) for w in float_weights]
        total = [np.zeros(probes) for _ in units]
        for batch, ref in batches:
            for u in range(len(units)):
                tangents = [z[u] if v == u else zeros[v] for v in range(len(units))]
                total[u] += np.asarray(quadratic_forms(float_weights, batch, ref, tangents), np.float64)
        for u, (_, layer) in enumerate(units):
            trace = float(np.mean(total[u]) / len(batches))
            traces[u] = trace
            for c in range(len(options)):
                if (u, c) in quantized:
                    w = np.asarray(layer.weight, np.float64)
                    error = float(np.sum((np.asarray(quantized[u, c][3], np.float64) - w) ** 2))
                    costs[u, c] = max(trace, 0.0) / layer.weight.size * error
    else:
        base = sum(float(objective(float_weights, batch, ref)) for batch, ref in batches)
        for (u, c), entry in quantized.items():
            weights = list(float_weights)
            weights[u] = entry[3]
            value = sum(float(objective(weights, batch, ref)) for batch, ref in batches)
            costs[u, c] = (value - base) / len(batches)

    if average_bits is not None:
        sizes = np.array([[quantized[u, c][1] * units[u][1].weight.size if (u, c) in quantized else 0
                           for c in range(len(options))] for u in range(len(units))])  # fmt: skip
        budget = math.floor(average_bits * sum(layer.weight.size for _, layer in units) + 1e-9)
        unit = "bits"
    else:
        sizes = np.array([[quantized[u, c][2] if (u, c) in quantized else 0 for c in range(len(options))]
                          for u in range(len(units))])  # fmt: skip
        budget, unit = int(budget_bytes), "bytes"  # pyright: ignore[reportArgumentType]
    try:
        picks = allocate(costs, sizes, budget)
    except ValueError:
        least = int(sum(min(sizes[u, c] for c in range(len(options)) if np.isfinite(costs[u, c]))
                        for u in range(len(units))))  # fmt: skip
        given = f"average_bits={average_bits}" if average_bits is not None else f"budget_bytes={budget_bytes}"
        raise ValueError(
            f"no choice among the candidates {tuple(candidates)} fits {given}: the smallest takes {least:,} {unit} "
            f"against a budget of {budget:,}."
        ) from None

    rows = []
    for u, (path, layer) in enumerate(units):
        c = picks[u]
        description, bits, nbytes, _ = quantized[u, c]
        unit_costs = {options[k].name: float(costs[u, k]) for k in range(len(options)) if (u, k) in quantized}
        rows.append(AutoRecipeRow(path, int(layer.weight.size), options[c].name, description, int(bits), int(nbytes),
                                  float(costs[u, c]), traces[u], unit_costs))  # fmt: skip
    rules = []
    for c, option in enumerate(options):
        chosen = [re.escape(paths[u]) for u in range(len(units)) if picks[u] == c]
        if option.format is None or not chosen:
            continue
        factory = LayerQuantizer(option.format, option.group_size, learned=learned)
        rules.append(Rule("|".join(chosen), weight=factory, input=activations))
    return AutoRecipe(rules, AutoRecipeReport(tuple(rows), budget, unit, method))
