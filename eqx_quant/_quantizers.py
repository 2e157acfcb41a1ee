import abc
import math
from collections.abc import Sequence
from typing import Literal

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, ArrayLike, Float, PRNGKeyArray, Real

from ._clip import clip_passthrough
from ._fake_quant import check_range, fake_quant, round_ste, scale_gradient, straight_through
from ._layout import Layout
from ._misc import FLOAT32_TINY, as_float_input, check_int, check_real, compute_dtype
from ._qtensor import QuantizedTensor, quantize_tensor
from ._ranges import int_range
from ._scales import (
    absmax_scale,
    check_method,
    finite_absmax,
    finite_or,
    least_error_scale,
    minmax_scale,
    percentile_threshold,
    stats,
)


StaticFloats = float | int | np.number | Sequence | np.ndarray | jax.Array
StaticInts = int | np.integer | Sequence | np.ndarray


# ---------------------------------------------------------------------------------------------------------------------
# Small helpers.


def _as_static_floats(name: str, value: object) -> float | tuple:
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
    return float(a) if a.ndim == 0 else _nested(a.astype(np.float64), float)


def _as_static_ints(name: str, value: object) -> int | tuple:
    if isinstance(value, (int, np.integer)) and not isinstance(value, bool):
        return int(value)
    if isinstance(value, (str, bytes)) or not isinstance(value, (Sequence, np.ndarray)):
        raise TypeError(f"`{name}` must be an int or a sequence of ints, got {value!r}.")
    a = np.asarray(value, dtype=object)
    for v in a.ravel():
        check_int(name, v)
    if a.ndim == 0 or a.size == 0:
        raise ValueError(f"`{name}` must be an int or a non-empty array of ints, got {value!r}.")
    return _nested(a, int)


def _nested(a: np.ndarray, kind: type) -> tuple:
    """An array as nested tuples of Python numbers."""
    return tuple(_nested(row, kind) if a.ndim > 1 else kind(row) for row in a)


def _flat(value: float | int | tuple) -> list:
    """The numbers of a static value, flattened."""
    return [value] if not isinstance(value, tuple) else [v for row in value for v in _flat(row)]


def _check_scale_values(name: str, values: list[float]) -> None:
    for v in values:
        if not (math.isfinite(v) and FLOAT32_TINY <= v <= 1 / FLOAT32_TINY):
            raise ValueError(f"`{name}` must be finite, positive and a normal float32, got {name}={v!r}.")


def _static_array(name: str, value: float | int | tuple, layout: Layout, x: Array) -> Array:
    """A static scale or zero point as an array that broadcasts against `layout`'s view of `x`."""
    a = jnp.asarray(value, compute_dtype(x.dtype))
    if a.ndim == 0 and layout.scale_shape(x.shape) != ():
        a = jnp.broadcast_to(a, layout.scale_shape(x.shape))  # one value for every channel or group
    try:
        return layout.expand(a, x.shape)
    except ValueError as error:
        raise ValueError(f"`{name}` does not fit `x`: {error}") from None


def _sample_data(x: object, layout: Layout) -> tuple[Array, Array]:
    """Calibration data as float32 and its view under `layout`, checked."""
    x = as_float_input("x", x).astype(jnp.float32)
    if x.size == 0:
        raise ValueError(f"`x` is empty (shape {x.shape}): fitting a scale needs data.")
    return x, layout.view(x)


def _percentile_of_data(view: Array, axes: tuple[int, ...], percentile: float) -> np.ndarray:
    """The `"percentile"` threshold of the finite `|view|` over `axes` (kept as unit axes)."""
    view = np.asarray(view, np.float32)
    kept = [i for i in range(view.ndim) if i not in axes]
    rows = np.transpose(view, kept + list(axes)).reshape([view.shape[i] for i in kept] + [-1])
    finite = np.isfinite(rows)
    threshold = percentile_threshold(np.where(finite, np.abs(rows), 0.0), finite, percentile)
    return threshold.reshape([1 if i in axes else n for i, n in enumerate(view.shape)])


def _check_float_input(x: Array) -> None:
    if not jnp.issubdtype(x.dtype, jnp.floating):
        raise TypeError(f"`x` must be a floating array, got dtype {x.dtype}.")


AxisName = str | tuple[str, ...]


def _axis_names(axis_name: object) -> tuple:
    return () if axis_name is None else axis_name if isinstance(axis_name, tuple) else (axis_name,)


def _check_axis_name(axis_name: object) -> None:
    names = _axis_names(axis_name)
    if axis_name is not None and not (names and all(isinstance(n, str) and n for n in names)):
        raise TypeError(f"`axis_name` must be None, a non-empty str or a tuple of them, got axis_name={axis_name!r}.")


def _unbound(axis_name: AxisName, error: NameError) -> ValueError:
    return ValueError(
        f"`axis_name`={axis_name!r} names an axis that is not bound here: call the quantizer inside the "
        f"`jax.shard_map` (or `jax.vmap(..., axis_name=...)`) that defines it. ({error})"
    )


def _shards(axis_name: AxisName | None) -> int:
    """The number of shards that `x` is split into along the named axes (1 for none)."""
    try:
        return math.prod(jax.lax.axis_size(name) for name in _axis_names(axis_name))
    except NameError as error:
        raise _unbound(axis_name, error) from error  # pyright: ignore[reportArgumentType]


def _across_shards(axis_name: AxisName | None, maxima: tuple[Array, ...], minima: tuple[Array, ...] = ()) -> tuple:
    """The statistics of the whole tensor from those of each shard: `maxima` reduced with `pmax`, `minima` with
    `pmin`, returned in that order."""
    if axis_name is None:
        return maxima + minima
    try:
        return tuple(jax.lax.pmax(a, axis_name) for a in maxima) + tuple(jax.lax.pmin(a, axis_name) for a in minima)
    except NameError as error:
        raise _unbound(axis_name, error) from error


# ---------------------------------------------------------------------------------------------------------------------
# The quantizers.


class AbstractQuantizer(eqx.Module):
    """Base class of the quantizer modules.

    A quantizer maps an array to an array of the same shape and dtype whose values lie on a quantization grid (or,
    for [`eqx_quant.PassthroughClip`][], in a range), with gradients defined by [`eqx_quant.fake_quant`][] or
    [`eqx_quant.clip_passthrough`][].
    """

    @abc.abstractmethod
    def __call__(self, x: Float[Array, "*shape"], *, key: PRNGKeyArray | None = None) -> Float[Array, "*shape"]:
        """Quantizes `x`.

        **Arguments:**

        - `x`: a floating array.
        - `key`: ignored; present for compatibility with the Equinox layer API.

        **Returns:**

        An array with the shape and dtype of `x`.
        """


class AbstractFakeQuantizer(AbstractQuantizer):
    """Base class of the quantizers that put their input on an integer grid (all but
    [`eqx_quant.PassthroughClip`][]); their output is [`eqx_quant.fake_quant`][] with the step size and zero point
    that `params` returns, and `quantize` stores the same integers as a [`eqx_quant.nn.QuantizedTensor`][].

    Every fake quantizer has an integer range `qmin`, `qmax` and a `layout` (an [`eqx_quant.Layout`][]: per tensor,
    per channel along any axes, or per group of `group_size` along the last axis).
    """

    qmin: eqx.AbstractVar[int]
    qmax: eqx.AbstractVar[int]
    layout: eqx.AbstractVar[Layout]

    @abc.abstractmethod
    def params(self, x: Float[Array, "*shape"]) -> tuple[float | Array, int | Array]:
        """The step size and zero point of a call on `x`, as they enter [`eqx_quant.fake_quant`][]: shaped to
        broadcast against `self.layout.view(x)`, the zero point the int 0 for a symmetric grid. Learned parameters
        carry their gradients; [`eqx_quant.AbstractFakeQuantizer.quantization_params`][] gives them compact.

        **Arguments:**

        - `x`: a floating array.

        **Returns:**

        `(scale, zero_point)`.
        """

    def quantization_params(self, x: Float[Array, "*shape"]) -> tuple[Array, Array]:
        """The scale and zero point that a call on `x` uses, in the compact shape of the layout.

        **Arguments:**

        - `x`: a floating array.

        **Returns:**

        `(scale, zero_point)`, float32 arrays in the compact shape of the layout
        ([`eqx_quant.Layout.scale_shape`][]): `()` per tensor, `(x.shape[axis],)` per channel, and
        `x.shape[:-1] + (x.shape[-1] // group_size,)` per group. The zero point is integer-valued (0 when symmetric).
        No gradient flows through them.
        """
        tensor = self.quantize(x)
        zero_point = jnp.zeros_like(tensor.scale) if tensor.zero_point is None else tensor.zero_point
        return tuple(self.layout.compact(a, x.shape).astype(jnp.float32) for a in (tensor.scale, zero_point))  # pyright: ignore

    def quantize(self, x: Float[Array, "*shape"], *, pack: bool = True) -> QuantizedTensor:
        """The integers that a call on `x` puts it on, with their scale, zero point, grid and layout: the
        [`eqx_quant.nn.QuantizedTensor`][] whose `dequantize()` is, bit for bit, this quantizer's output for `x`.
        No gradient flows through it.

        **Arguments:**

        - `x`: a floating array.
        - `pack`: pack grids of at most 4 bits at their width ([`eqx_quant.pack_bits`][]), as stored weights are;
            `False` keeps one integer per element.

        **Returns:**

        A [`eqx_quant.nn.QuantizedTensor`][].
        """
        return self.quantize_with_mask(x, pack=pack)[0]

    def quantize_with_mask(self, x: Float[Array, "*shape"], *, pack: bool = False) -> tuple[QuantizedTensor, Array]:
        """[`eqx_quant.AbstractFakeQuantizer.quantize`][] (unpacked by default), and where the levels are NaN (no
        integer holds NaN; the integer products take those positions apart)."""
        _check_float_input(x)
        return quantize_tensor(x, *self.params(x), self.qmin, self.qmax, self.layout, pack=pack)

    def fake_quant_and_tensor(
        self, x: Float[Array, "*shape"], *, value: bool = True, mask: bool = True
    ) -> tuple[Array, QuantizedTensor, Array | None]:
        """A call on `x` and [`eqx_quant.AbstractFakeQuantizer.quantize_with_mask`][] (unpacked), from one
        computation of the parameters: what the integer forward of a quantized layer needs of each operand.
        With `value=False`, the first is `x` itself with the call's derivatives (for products that use only the
        fake-quantized operand's tangent); with `mask=False`, the NaN mask is `None` (not computed)."""
        _check_float_input(x)
        scale, zero_point = self.params(x)
        apply = fake_quant if value else straight_through
        fake = apply(self.layout.view(x), scale, self.qmin, self.qmax, zero_point).reshape(x.shape)
        tensor, nan = quantize_tensor(x, scale, zero_point, self.qmin, self.qmax, self.layout, pack=False, mask=mask)
        return fake, tensor, nan

    def __call__(self, x: Float[Array, "*shape"], *, key: PRNGKeyArray | None = None) -> Float[Array, "*shape"]:
        """Fake-quantizes `x`: `fake_quant(view, scale, qmin, qmax, zero_point)` with the view of `x` under the
        layout and the parameters of `self.params(x)`, reshaped back.

        **Arguments:**

        - `x`: a floating array.
        - `key`: ignored; present for compatibility with the Equinox layer API.

        **Returns:**

        An array with the shape and dtype of `x`.
        """
        del key
        _check_float_input(x)
        with jax.named_scope(f"eqx_quant.{type(self).__name__}"):
            scale, zero_point = self.params(x)
            return fake_quant(self.layout.view(x), scale, self.qmin, self.qmax, zero_point).reshape(x.shape)


class FakeQuant(AbstractFakeQuantizer):
    """A fixed fake quantizer: scale, zero point and integer range are static configuration.

    `FakeQuant(scale, qmin, qmax)(x)` is `fake_quant(x, scale, qmin, qmax)`. Per-channel scales and zero points are
    tuples with one entry per index of `x.shape[axis]`; per-group ones (`group_size=g`) nested tuples of the shape
    `x.shape[:-1] + (x.shape[-1] // g,)`: the compact shapes of [`eqx_quant.Layout`][].

    The module has no array leaves: optimizers never change it and gradients never reach it, which suits a frozen,
    calibrated quantizer (see [`eqx_quant.FakeQuant.calibrate`][]). Because its configuration is static, it is part of
    the compiled program: repeated calls under `eqx.filter_jit` with the same module compile once, and a module with
    another scale compiles again. Use [`eqx_quant.LearnedFakeQuant`][] for scales that change during training.

    !!! example

        ```python
        import jax.numpy as jnp
        import eqx_quant

        q = eqx_quant.FakeQuant.from_bits(4, 0.5)
        print(q(jnp.array([0.3, 1.25, 9.0])))  # [0.5 1.  3.5]
        ```
    """

    scale: float | tuple = eqx.field(static=True)
    qmin: int = eqx.field(static=True)
    qmax: int = eqx.field(static=True)
    zero_point: int | tuple = eqx.field(static=True)
    axis: int | tuple[int, ...] | None = eqx.field(static=True)
    group_size: int | None = eqx.field(static=True)

    def __init__(
        self,
        scale: StaticFloats,
        qmin: int | np.integer,
        qmax: int | np.integer,
        *,
        zero_point: StaticInts = 0,
        axis: int | tuple[int, ...] | None = None,
        group_size: int | None = None,
    ):
        """**Arguments:**

        - `scale`: the step size, a positive float, or an array of them in the compact shape of the layout (one per
            channel along `axis`, or one per group).
        - `qmin`, `qmax`: the inclusive integer range; see [`eqx_quant.int_range`][].
        - `zero_point`: the integer that represents 0, in `[qmin, qmax]`; an int or an array of ints shaped like
            `scale`.
        - `axis`: the channel axis (or axes) of the input for per-channel `scale` / `zero_point`; negative values
            count from the end.
        - `group_size`: the size of the groups along the last axis for per-group `scale` / `zero_point`.

        A per-channel or per-group `scale` needs `axis` or `group_size`; a scalar applies to every channel or group.
        """
        self.scale = _as_static_floats("scale", scale)
        self.qmin, self.qmax = check_range(qmin, qmax)
        self.zero_point = _as_static_ints("zero_point", zero_point)
        self.axis = Layout.of(axis, group_size).axis
        self.group_size = group_size

    def __check_init__(self):
        _check_scale_values("scale", _flat(self.scale))
        for zp in _flat(self.zero_point):
            if not self.qmin <= zp <= self.qmax:
                raise ValueError(
                    f"`zero_point` must lie in [qmin, qmax] = [{self.qmin}, {self.qmax}], got zero_point={zp}."
                )
        arrays = [name for name in ("scale", "zero_point") if isinstance(getattr(self, name), tuple)]
        if arrays and self.layout.is_per_tensor():
            raise ValueError(f"`axis` or `group_size` is required for an array `{arrays[0]}`, got neither.")
        if len(arrays) == 2 and np.shape(self.scale) != np.shape(self.zero_point):
            raise ValueError(
                f"`scale` and `zero_point` must have one shape, got {np.shape(self.scale)} and "
                f"{np.shape(self.zero_point)}."
            )

    @property
    def layout(self) -> Layout:
        return Layout.of(self.axis, self.group_size)

    def params(self, x: Float[Array, "*shape"]) -> tuple[Array, int | Array]:
        scale = _static_array("scale", self.scale, self.layout, x)
        zero_point = self.zero_point
        if zero_point != 0:
            zero_point = _static_array("zero_point", zero_point, self.layout, x)
        return scale, zero_point

    @classmethod
    def from_bits(
        cls,
        bits: int | np.integer,
        scale: StaticFloats,
        *,
        signed: bool = True,
        narrow: bool = False,
        axis: int | tuple[int, ...] | None = None,
        group_size: int | None = None,
    ) -> "FakeQuant":
        """A symmetric quantizer on the `bits`-bit grid of [`eqx_quant.int_range`][].

        **Arguments:**

        - `bits`, `signed`, `narrow`: the integer grid, as for [`eqx_quant.int_range`][].
        - `scale`: the step size, a float or an array of them (per channel or per group).
        - `axis`, `group_size`: the layout of an array `scale`, as for the constructor.

        **Returns:**

        A [`eqx_quant.FakeQuant`][] with zero point 0.
        """
        qmin, qmax = int_range(bits, signed=signed, narrow=narrow)
        return cls(scale, qmin, qmax, axis=axis, group_size=group_size)

    @classmethod
    def calibrate(
        cls,
        x: Real[ArrayLike, "*shape"],
        bits: int | np.integer,
        *,
        signed: bool = True,
        narrow: bool = False,
        axis: int | tuple[int, ...] | None = None,
        group_size: int | None = None,
        method: Literal["absmax", "minmax", "percentile", "mse"] = "absmax",
        percentile: float = 99.99,
        num_candidates: int = 100,
    ) -> "FakeQuant":
        """Fits a quantizer to sample data (post-training quantization).

        The statistics ignore NaN and infinite entries of `x`.

        **Arguments:**

        - `x`: the sample data, e.g. a weight or a batch of activations.
        - `bits`, `signed`, `narrow`: the integer grid, as for [`eqx_quant.int_range`][].
        - `axis`: `None` for one scale for the whole tensor, or the channel axis (or axes) for one scale per index
            along it.
        - `group_size`: one scale per group of this many contiguous elements along the last axis (per-group scales
            of shape `x.shape[:-1] + (x.shape[-1] // group_size,)`), or `None`.
        - `method`:
            - `"absmax"`: symmetric, `scale ≈ max|x| / qmax`, nudged up by at most a few ulps so that the largest
                magnitude maps inside `[qmin, qmax]` with the arithmetic of [`eqx_quant.fake_quant`][] (so it lands on
                the grid and keeps its gradient).
            - `"minmax"`: asymmetric, covering `[min(x, 0), max(x, 0)]` with an integer zero point, so that 0 is
                exactly representable and both extremes map inside the range.
            - `"percentile"`: symmetric, clipping at the `percentile`-th percentile of the finite `|x|`: the smallest
                magnitude at or below which `percentile` percent of them lie (the inverted empirical distribution,
                NumPy's `method="inverted_cdf"`), the definition [`eqx_quant.calibrate`][] applies to its histograms.
            - `"mse"`: symmetric, the clipping threshold among `num_candidates` fractions of `max|x|` that minimises
                the mean squared quantization error on `x`.
        - `percentile`: in `(0, 100]`, for `method="percentile"`.
        - `num_candidates`: the number of thresholds tried by `method="mse"`.

        **Returns:**

        A [`eqx_quant.FakeQuant`][] with float32-representable scales.
        """
        check_method(method, percentile, num_candidates)
        qmin, qmax = int_range(bits, signed=signed, narrow=narrow)
        layout = Layout.of(axis, group_size)
        x, view = _sample_data(x, layout)
        axes = layout.reduction_axes(x.shape)
        absmax, lo, hi = stats(view, axes)
        zero_point = jnp.zeros_like(absmax)
        if method == "absmax":
            scale = absmax_scale(absmax, qmin, qmax)
        elif method == "minmax":
            scale, zero_point = minmax_scale(lo, hi, qmin, qmax)
        elif method == "percentile":
            scale = absmax_scale(jnp.asarray(_percentile_of_data(view, axes, percentile), jnp.float32), qmin, qmax)
        else:
            scale = least_error_scale(view, None, absmax, axes, qmin, qmax, int(num_candidates))
        scale = np.asarray(layout.compact(scale, x.shape))
        zero_point = np.asarray(layout.compact(zero_point, x.shape)).astype(np.int64)
        if layout.is_per_tensor():
            return cls(float(scale), qmin, qmax, zero_point=int(zero_point))
        return cls(scale, qmin, qmax, zero_point=zero_point, axis=layout.axis, group_size=group_size)


class PassthroughClip(AbstractQuantizer):
    """A static clip to `[lo, hi]` whose gradient is the identity: [`eqx_quant.clip_passthrough`][] as a module.

    Forward-mode differentiation (`jax.jvp`, `jax.jacfwd`) works through it, unlike the custom-VJP quantizers.

    !!! example

        ```python
        import jax
        import jax.numpy as jnp
        import eqx_quant

        clip = eqx_quant.PassthroughClip(0.0, 6.0)
        print(jax.grad(lambda x: clip(x).sum())(jnp.array([-1.0, 3.0, 8.0])))  # [1. 1. 1.]
        ```
    """

    lo: float = eqx.field(static=True)
    hi: float = eqx.field(static=True)

    def __init__(self, lo: float | int, hi: float | int):
        """**Arguments:**

        - `lo`, `hi`: the bounds, Python numbers with `lo <= hi`; infinite bounds clip on one side only.
        """
        for name, bound in (("lo", lo), ("hi", hi)):
            if isinstance(bound, (bool, np.bool_)) or not isinstance(bound, (int, float, np.integer, np.floating)):
                raise TypeError(f"`{name}` must be a real number, got {bound!r}.")
        self.lo = float(lo)
        self.hi = float(hi)

    def __check_init__(self):
        if math.isnan(self.lo) or math.isnan(self.hi) or self.lo > self.hi:
            raise ValueError(f"`lo` and `hi` must satisfy lo <= hi and not be NaN, got lo={self.lo} and hi={self.hi}.")

    def __call__(self, x: Float[Array, "*shape"], *, key: PRNGKeyArray | None = None) -> Float[Array, "*shape"]:
        del key
        _check_float_input(x)
        with jax.named_scope("eqx_quant.PassthroughClip"):
            return clip_passthrough(x, self.lo, self.hi)


class DynamicFakeQuant(AbstractFakeQuantizer):
    """A fake quantizer that computes its scale from its input at every call: the usual weight quantizer in QAT.

    The scale is `max|x| / qmax` (symmetric), nudged up by at most a few ulps so that the largest magnitude always
    maps inside the range and keeps its gradient, whichever way the program is compiled; or, with
    `symmetric=False`, an asymmetric scale and integer zero point covering `[min(x, 0), max(x, 0)]`. Scale and zero
    point are computed in float32 from the finite entries of `x` and are `stop_gradient`-ed: gradients reach `x`
    through the straight-through estimator only. An all-zero tensor (channel, group) quantizes to exact zeros.

    Granularity:

    - per tensor (`axis=None`, `group_size=None`): one scale;
    - per channel (`axis=k`, or a tuple of axes): one scale per index along axis `k`;
    - per group (`group_size=g`): the last axis is split into contiguous groups of `g`, and every group of every
        index of the other axes has its own scale: scales of shape `x.shape[:-1] + (x.shape[-1] // g,)`. These are
        already separate for every channel, so `axis` (if given) only has to name another axis than the last.

    !!! example

        ```python
        import jax.numpy as jnp
        import eqx_quant

        q = eqx_quant.DynamicFakeQuant(8, axis=0)  # one scale per row
        w = jnp.array([[0.1, -0.2, 0.3], [10.0, 5.0, -2.5]])
        print(q(w))
        ```
    """

    bits: int = eqx.field(static=True)
    signed: bool = eqx.field(static=True)
    narrow: bool = eqx.field(static=True)
    axis: int | tuple[int, ...] | None = eqx.field(static=True)
    group_size: int | None = eqx.field(static=True)
    symmetric: bool = eqx.field(static=True)
    axis_name: AxisName | None = eqx.field(static=True)

    def __init__(
        self,
        bits: int | np.integer,
        *,
        signed: bool = True,
        narrow: bool = False,
        axis: int | tuple[int, ...] | None = None,
        group_size: int | None = None,
        symmetric: bool = True,
        axis_name: AxisName | None = None,
    ):
        """**Arguments:**

        - `bits`, `signed`, `narrow`: the integer grid, as for [`eqx_quant.int_range`][].
        - `axis`: the channel axis for per-channel scales, or `None`.
        - `group_size`: the size of the groups along the last axis for per-group scales, or `None`.
        - `symmetric`: `True` for a zero point of 0 and `scale = max|x| / qmax`; `False` for a min/max range with an
            integer zero point.
        - `axis_name`: for calls inside `jax.shard_map` (or a `jax.vmap` with an `axis_name`) where `x` is one shard
            of a larger tensor: the named axes along which the tensor is split. The statistics are then reduced
            across them (`jax.lax.pmax`, `jax.lax.pmin`), so that every shard uses the scale of the whole tensor. Name
            only axes that split the elements sharing a scale, never the channel axis. Not needed under `jax.jit`
            with sharded arrays, where reductions are global already.
        """
        self.bits = check_int("bits", bits)
        self.signed = signed
        self.narrow = narrow
        self.axis = Layout.of(axis, group_size).axis
        self.group_size = group_size
        self.symmetric = symmetric
        self.axis_name = axis_name

    def __check_init__(self):
        int_range(self.bits, signed=self.signed, narrow=self.narrow)
        _check_axis_name(self.axis_name)
        if not isinstance(self.symmetric, bool):
            raise TypeError(f"`symmetric` must be a bool, got {self.symmetric!r}.")

    @property
    def layout(self) -> Layout:
        return Layout.of(self.axis, self.group_size)

    @property
    def qmin(self) -> int:
        return int_range(self.bits, signed=self.signed, narrow=self.narrow)[0]

    @property
    def qmax(self) -> int:
        return int_range(self.bits, signed=self.signed, narrow=self.narrow)[1]

    def params(self, x: Float[Array, "*shape"]) -> tuple[Array, int | Array]:
        layout = self.layout
        view, axes = layout.view(x), layout.reduction_axes(x.shape)
        if self.symmetric:  # only the absolute maximum: fewer operations to trace and compile
            (absmax,) = _across_shards(self.axis_name, (finite_absmax(view, axes),))
            return absmax_scale(absmax, self.qmin, self.qmax), 0
        _, lo, hi = stats(view, axes)
        hi, lo = _across_shards(self.axis_name, (hi,), (lo,))
        return minmax_scale(lo, hi, self.qmin, self.qmax)


class LearnedFakeQuant(AbstractFakeQuantizer):
    """A fake quantizer with a learned step size (LSQ, Esser et al., ICLR 2020), and optionally a learned zero point.

    `scale` is an array leaf in the compact shape of the layout: per tensor (shape `()`), per channel (shape
    `(channels,)` along `axis`) or per group (`group_size=g`: shape `x.shape[:-1] + (x.shape[-1] // g,)`), trained
    through the scale gradient of [`eqx_quant.fake_quant`][]. That gradient is multiplied by the LSQ gradient scale
    `1 / sqrt(numel * qmax)`, where `numel` is the number of elements that share one scale in the call (`x.size` per
    tensor, `x.size / channels` per channel, `g` per group); the forward value is unchanged.

    **Positivity.** The forward pass uses `clip_passthrough(scale, min_scale, inf)`: whatever an optimizer does to the
    leaf, the step size used is at least `min_scale`, and since the clip passes its gradient straight through, a leaf
    pushed below the floor still receives gradients and can recover.

    **Zero point (LSQ+).** With a `zero_point` leaf (asked for by `init_from(..., symmetric=False)`), the forward
    uses `round(clip(zero_point, qmin, qmax))`, with a straight-through gradient for both the round and the clip, and
    the same gradient scale as the step size. Symmetric quantizers have `zero_point=None`.

    !!! example

        ```python
        import jax
        import jax.numpy as jnp
        import eqx_quant

        x = jax.random.normal(jax.random.key(0), (64,))
        q = eqx_quant.LearnedFakeQuant.init_from(x, 4)
        grads = jax.grad(lambda q: jnp.sum((q(x) - x) ** 2))(q)
        print(q.scale, grads.scale)
        ```
    """

    scale: Float[Array, "*channels"]
    zero_point: Float[Array, "*channels"] | None
    qmin: int = eqx.field(static=True)
    qmax: int = eqx.field(static=True)
    axis: int | tuple[int, ...] | None = eqx.field(static=True)
    group_size: int | None = eqx.field(static=True)
    min_scale: float = eqx.field(static=True)
    axis_name: AxisName | None = eqx.field(static=True)

    def __init__(
        self,
        scale: Real[ArrayLike, "*channels"],
        qmin: int | np.integer,
        qmax: int | np.integer,
        *,
        zero_point: Real[ArrayLike, "*channels"] | None = None,
        axis: int | tuple[int, ...] | None = None,
        group_size: int | None = None,
        min_scale: float = 1e-8,
        axis_name: AxisName | None = None,
    ):
        """**Arguments:**

        - `scale`: the initial step size: a positive scalar, or an array in the compact shape of the layout (one
            entry per channel along `axis`, or one per group). Stored as a float32 array.
        - `qmin`, `qmax`: the inclusive integer range; see [`eqx_quant.int_range`][].
        - `zero_point`: `None` for a symmetric quantizer, or the initial zero point (same shape as `scale`), stored
            as a float32 array and learned.
        - `axis`: the channel axis (or axes) for a per-channel `scale`, or `None`.
        - `group_size`: the size of the groups along the last axis for a per-group `scale`, or `None`.
        - `min_scale`: the smallest step size the forward pass uses; a positive, normal float32.
        - `axis_name`: for calls inside `jax.shard_map` where `x` is one shard of a larger tensor: the named axes
            along which the elements sharing a scale are split. The gradient scale then counts the elements of
            every shard, as it would for the whole tensor. (The scale's gradient itself is summed across shards by
            `shard_map`'s transpose when the scale is replicated along those axes.)
        """
        # An explicit dtype: Python numbers would otherwise make weakly typed leaves (which recompile once updated).
        # A JAX array stays where it is, so a scale computed from a sharded weight keeps the weight's sharding.
        self.scale = jnp.asarray(scale, jnp.float32)
        self.zero_point = None if zero_point is None else jnp.asarray(zero_point, jnp.float32)
        self.qmin, self.qmax = check_range(qmin, qmax)
        self.axis = Layout.of(axis, group_size).axis
        self.group_size = group_size
        self.min_scale = check_real("min_scale", min_scale)
        self.axis_name = axis_name

    def __check_init__(self):
        _check_scale_values("min_scale", [self.min_scale])
        _check_axis_name(self.axis_name)
        layout = self.layout
        if layout.group_size is None and self.scale.ndim != len(layout.axes):
            raise ValueError(
                f"`scale` must have {len(layout.axes)} dimension(s) for axis={self.axis}, got shape {self.scale.shape}."
            )
        if self.zero_point is not None and self.zero_point.shape != self.scale.shape:
            raise ValueError(
                f"`zero_point` must have the shape of `scale`, {self.scale.shape}, got {self.zero_point.shape}."
            )
        if not isinstance(self.scale, jax.core.Tracer):
            s = np.asarray(self.scale)
            if not np.all(np.isfinite(s) & (s > 0)):
                raise ValueError(f"`scale` must be finite and positive, got scale={s.tolist()!r}.")

    @property
    def layout(self) -> Layout:
        return Layout.of(self.axis, self.group_size)

    def params(self, x: Float[Array, "*shape"]) -> tuple[Array, int | Array]:
        layout = self.layout
        numel = layout.group_numel(x.shape) * _shards(self.axis_name)
        factor = 1.0 / math.sqrt(numel * max(self.qmax, 1)) if numel else 1.0
        scale = clip_passthrough(self._expand("scale", self.scale, x), self.min_scale, math.inf)
        scale = scale_gradient(scale, factor)
        if self.zero_point is None:
            return scale, 0
        zero_point = self._expand("zero_point", self.zero_point, x)
        return scale, round_ste(clip_passthrough(scale_gradient(zero_point, factor), self.qmin, self.qmax))

    def _expand(self, name: str, leaf: Array, x: Array) -> Array:
        try:
            return self.layout.expand(leaf, x.shape)
        except ValueError as error:
            raise ValueError(f"`{name}` does not fit `x`: {error}") from None

    @classmethod
    def init_from(
        cls,
        x: Real[ArrayLike, "*shape"],
        bits: int | np.integer,
        *,
        signed: bool = True,
        narrow: bool = False,
        axis: int | tuple[int, ...] | None = None,
        group_size: int | None = None,
        symmetric: bool = True,
        min_scale: float = 1e-8,
        axis_name: AxisName | None = None,
        stacked: int = 0,
    ) -> "LearnedFakeQuant":
        """Initialises the step size from data as LSQ does: `2 * mean|x| / sqrt(qmax)`, per tensor, per channel or
        per group.

        **Arguments:**

        - `x`: sample data (e.g. the weight it will quantize). Non-finite entries are ignored.
        - `bits`, `signed`, `narrow`: the integer grid, as for [`eqx_quant.int_range`][].
        - `axis`: the channel axis (or axes) for per-channel step sizes, or `None`.
        - `group_size`: one step size per group of this many contiguous elements along the last axis, or `None`.
        - `symmetric`: `False` adds a learned zero point, initialised so that `min(x, 0)` maps to `qmin`.
        - `min_scale`: as for the constructor; the initial step size is at least this.
        - `axis_name`: as for the constructor (the initial step size is computed from `x` as given).
        - `stacked`: the number of leading axes of `x` along which whole tensors are stacked (the weight of a layer
            built with `eqx.filter_vmap`, of shape `(layers, *weight_shape)`). The quantizer is then made for one
            tensor (`axis` and `group_size` refer to its axes) and stacked like the layer: its arrays get the same
            leading axes, so that a `jax.lax.scan` over the layers hands each layer its own step sizes.

        **Returns:**

        A [`eqx_quant.LearnedFakeQuant`][].
        """
        if check_int("stacked", stacked) < 0:
            raise ValueError(f"`stacked` must be a non-negative int, got stacked={stacked}.")
        if stacked:
            x = as_float_input("x", x)
            if x.ndim < stacked:
                raise ValueError(f"`stacked`={stacked} leading axes do not fit `x` of shape {x.shape}.")
            kwargs = dict(signed=signed, narrow=narrow, axis=axis, group_size=group_size, symmetric=symmetric)
            init = lambda w: cls.init_from(w, bits, **kwargs, min_scale=min_scale, axis_name=axis_name)  # noqa: E731
            for _ in range(stacked):
                init = eqx.filter_vmap(init)
            return init(x)
        qmin, qmax = int_range(bits, signed=signed, narrow=narrow)
        layout = Layout.of(axis, group_size)
        x, view = _sample_data(x, layout)
        axes = layout.reduction_axes(x.shape)
        finite = jnp.isfinite(view)
        magnitudes = jnp.where(finite, jnp.abs(view), 0.0)
        count = jnp.maximum(jnp.sum(finite, axis=axes, keepdims=True), 1).astype(jnp.float32)
        mean = jnp.sum(magnitudes, axis=axes, keepdims=True) / count
        # Past float32's range the sum overflows where the mean does not: then the sum of pre-divided magnitudes.
        mean = jnp.where(jnp.isfinite(mean), mean, jnp.sum(magnitudes / count, axis=axes, keepdims=True))
        scale = layout.compact(jnp.maximum(2 * mean / math.sqrt(qmax), min_scale), x.shape)
        zero_point = None
        if not symmetric:
            lo = jnp.minimum(jnp.min(finite_or(view, 0.0), axis=axes, initial=0.0), 0.0)
            zero_point = jnp.clip(jnp.round(qmin - lo / scale), qmin, qmax)  # `lo` without unit axes, like `scale`
        return cls(
            scale, qmin, qmax, zero_point=zero_point, axis=layout.axis, group_size=group_size, min_scale=min_scale,
            axis_name=axis_name,
        )  # fmt: skip
