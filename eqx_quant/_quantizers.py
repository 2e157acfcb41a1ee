"""The quantizer modules: static, dynamic and learned scales, each for every format and layout."""

import abc
import math
from typing import Literal

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, ArrayLike, Float, PRNGKeyArray, Real

from ._clip import clip_passthrough
from ._fake_quant import (
    check_blocks,
    check_zero_points,
    e4m3_ste,
    fake_quant_scales,
    pow2_ste,
    round_ste,
    scale_gradient,
    valid_scales,
)
from ._format import (
    NVFP4,
    NVFP4_BLOCK,
    Format,
    IntFormat,
    StretchedFormat,
    as_format,
    check_range,
    float_format,
    int_format,
    integer_grid_of,
    mx_format,
)
from ._layout import Layout
from ._misc import (
    AxisName,
    as_float_input,
    as_static_floats,
    as_static_ints,
    check_axis_name,
    check_float_input,
    check_int,
    check_real,
    compute_dtype,
    flat,
    is_concrete,
    one_program,
    shards,
)
from ._qarray import QuantizedArray, check_storable, quantize_array
from ._scales import (
    Scales,
    absmax_scale,
    check_method,
    finite_absmax,
    finite_or,
    fit_scales,
    least_error_scale,
    minmax_scale,
    percentile_threshold,
    stats,
)


StaticFloats = float | int | np.number | tuple | list | np.ndarray | jax.Array
StaticInts = int | np.integer | tuple | list | np.ndarray
FormatLike = Format | str | int | np.integer


class AbstractQuantizer(eqx.Module):
    """Base class of the quantizer modules.

    A quantizer maps an array to an array of the same shape and dtype whose values lie on a number format's grid
    (or, for [`eqx_quant.PassthroughClip`][], in a range), with gradients defined by [`eqx_quant.fake_quant`][] or
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
    """Base class of the quantizers that put their input on a number format's grid: [`eqx_quant.FakeQuant`][]
    (static scales), [`eqx_quant.DynamicFakeQuant`][] (computed from the input) and [`eqx_quant.LearnedFakeQuant`][]
    (trained).

    Every one has a `format` (a [`eqx_quant.Format`][]: an integer grid, a float element type, an MX format, NVFP4)
    and a `layout` (an [`eqx_quant.Layout`][]: per tensor, per channel along any axes, or per tile of `group_size`
    elements along an axis, as groups and MX or NVFP4 blocks are). A call is
    [`eqx_quant.fake_quant_format`][] with the scales of `scales`; `quantize_array` stores the same codes as a
    [`eqx_quant.QuantizedArray`][].
    """

    format: eqx.AbstractVar[Format]
    layout: eqx.AbstractVar[Layout]

    @abc.abstractmethod
    def scales(self, x: Float[Array, "*shape"]) -> Scales:
        """The scales of a call on `x`, broadcasting against `self.layout.view(x)`: the scale, the zero point of an
        asymmetric integer grid (else `None`), and the tensor scale of two-level formats (else `None`). Learned
        parameters carry their gradients; [`eqx_quant.AbstractFakeQuantizer.quantization_params`][] gives the
        scales compact.

        **Arguments:**

        - `x`: a floating array.

        **Returns:**

        A named tuple `(scale, zero_point, tensor_scale)`.
        """

    @property
    def bits(self) -> int:
        """The width of one element of the format."""
        return self.format.bits

    @property
    def qmin(self) -> int:
        """The lowest level of an integer grid."""
        return integer_grid_of(self.format).qmin

    @property
    def qmax(self) -> int:
        """The highest level of an integer grid."""
        return integer_grid_of(self.format).qmax

    @property
    def axis(self) -> int | tuple[int, ...] | None:
        """The channel axes of the layout: `None`, one int, or a tuple of ints."""
        return self.layout.axis

    @property
    def group_size(self) -> int | None:
        """The tile size of the layout, or `None`."""
        return self.layout.group_size

    def params(self, x: Float[Array, "*shape"]) -> tuple[Array, int | Array]:
        """`(scale, zero_point)` of a call on `x`, as they enter [`eqx_quant.fake_quant`][]: broadcasting against the
        view of `x`, the zero point the int 0 for a symmetric grid, and for two-level formats the product of the two
        scales."""
        s = self.scales(x)
        scale = s.scale if s.tensor_scale is None else s.scale * s.tensor_scale
        return scale, 0 if s.zero_point is None else s.zero_point

    def _view(self, x: Array) -> Array:
        if self.format.scale != "float32":
            assert self.layout.group_size is not None
            check_blocks(x.shape, self.layout.group_axis, self.layout.group_size, self.format)
        return self.layout.view(x)

    def __call__(self, x: Float[Array, "*shape"], *, key: PRNGKeyArray | None = None) -> Float[Array, "*shape"]:
        """Fake-quantizes `x`: [`eqx_quant.fake_quant_format`][] of the view of `x` under the layout, with the
        scales of `self.scales(x)`, reshaped back.

        **Arguments:**

        - `x`: a floating array.
        - `key`: ignored; present for compatibility with the Equinox layer API.

        **Returns:**

        An array with the shape and dtype of `x`.
        """
        del key
        check_input(x)
        return one_program(AbstractFakeQuantizer._call)(self, x)

    def _call(self, x: Array) -> Array:
        view = self._view(x)
        with jax.named_scope(f"eqx_quant.{type(self).__name__}"):
            return fake_quant_scales(view, self.scales(x), self.format).reshape(x.shape)

    def quantization_params(self, x: Float[Array, "*shape"]) -> tuple[Array, Array]:
        """The scale and zero point that a call on `x` uses, in the compact shape of the layout.

        **Arguments:**

        - `x`: a floating array.

        **Returns:**

        `(scale, zero_point)`, float32 arrays in the compact shape of the layout
        ([`eqx_quant.Layout.scale_shape`][]): `()` per tensor, `(x.shape[axis],)` per channel, and the tiled axis
        shortened by `group_size` per tile. The zero point is integer-valued (0 when symmetric); a two-level scale is
        given as the product of its two levels, an E8M0 scale `2**-127` as 0. No gradient flows through them.
        """
        check_input(x)
        return one_program(AbstractFakeQuantizer._quantization_params)(self, x)

    def _quantization_params(self, x: Array) -> tuple[Array, Array]:
        self._view(x)
        scale, zero_point = self.params(jax.lax.stop_gradient(x))
        scale = jax.lax.stop_gradient(jnp.broadcast_to(scale, self.layout.broadcast_shape(x.shape)))
        zero_point = jnp.broadcast_to(jax.lax.stop_gradient(jnp.asarray(zero_point, scale.dtype)), scale.shape)
        return tuple(self.layout.compact(a, x.shape).astype(jnp.float32) for a in (scale, zero_point))  # pyright: ignore

    def quantize_array(self, x: Float[Array, "*shape"], *, pack: bool = True) -> QuantizedArray:
        """The codes that a call on `x` puts it on, with their scales, format and layout: the
        [`eqx_quant.QuantizedArray`][] whose `dequantize()` is, bit for bit, this quantizer's output for `x`. No
        gradient flows through it.

        **Arguments:**

        - `x`: a floating array.
        - `pack`: pack codes of at most 4 bits at their width ([`eqx_quant.pack_bits`][]), as stored weights are;
            `False` keeps one code per element.

        **Returns:**

        A [`eqx_quant.QuantizedArray`][].
        """
        return self.quantize_with_mask(x, pack=pack)[0]

    def quantize(self, x: Float[Array, "*shape"], *, pack: bool = True) -> QuantizedArray:
        """An alias of [`eqx_quant.AbstractFakeQuantizer.quantize_array`][] (the name of earlier releases)."""
        return self.quantize_array(x, pack=pack)

    def quantize_with_mask(self, x: Float[Array, "*shape"], *, pack: bool = False) -> tuple[QuantizedArray, Array]:
        """[`eqx_quant.AbstractFakeQuantizer.quantize_array`][] (unpacked by default), and where its grid points are
        NaN (no integer holds NaN; the integer products take those positions apart)."""
        check_input(x)
        check_storable(x, self.format)
        return one_program(AbstractFakeQuantizer._quantize_with_mask)(self, x, pack)

    def _quantize_with_mask(self, x: Array, pack: bool) -> tuple[QuantizedArray, Array]:
        self._view(x)
        array, nan = quantize_array(x, self.scales(x), self.format, self.layout, pack=pack)
        assert nan is not None
        return array, nan

    def fake_quant_and_array(
        self, x: Float[Array, "*shape"], *, value: bool = True, mask: bool = True
    ) -> tuple[Array, QuantizedArray, Array | None]:
        """A call on `x` and [`eqx_quant.AbstractFakeQuantizer.quantize_with_mask`][] (unpacked), from one
        computation of the scales: what the integer forward of a quantized layer needs of each operand. With
        `value=False`, the first is `x` itself with the call's derivatives (for products that use only the
        fake-quantized operand's tangent); with `mask=False`, the NaN mask is `None` (not computed)."""
        check_input(x)
        check_storable(x, self.format)
        return one_program(AbstractFakeQuantizer._fake_quant_and_array)(self, x, value, mask)

    def _fake_quant_and_array(self, x: Array, value: bool, mask: bool) -> tuple[Array, QuantizedArray, Array | None]:
        view = self._view(x)
        scales = self.scales(x)
        fake = fake_quant_scales(view, scales, self.format, value=value).reshape(x.shape)
        array, nan = quantize_array(x, scales, self.format, self.layout, pack=False, mask=mask)
        return fake, array, nan


def check_input(x: object) -> None:
    """Raises a `TypeError` unless `x` is a floating JAX or NumPy array: what every quantizer's call takes (checked
    before the call is compiled, which would take a list apart)."""
    if not isinstance(x, (jax.Array, np.ndarray, np.generic)):
        raise TypeError(f"`x` must be a floating array, got {x!r} of type {type(x).__name__}.")
    check_float_input(x)


def _format_of(value: object, qmin: object, qmax: object, signed: bool = True, narrow: bool = False) -> Format:
    """The format of quantizer arguments: `qmin` and `qmax` (an integer grid), or a format (a
    [`eqx_quant.Format`][], its name, or a number of bits with `signed` and `narrow`)."""
    if value is not None and (qmin is not None or qmax is not None):
        raise ValueError(f"Give `qmin` and `qmax` or `format`, not both: got format={value!r}, qmin={qmin!r}.")
    if value is None:
        if qmin is None or qmax is None:
            raise ValueError("`qmin` and `qmax` (an integer grid) or `format` is needed.")
        return IntFormat(*check_range(qmin, qmax))
    if isinstance(value, (int, np.integer)) and not isinstance(value, bool):
        return int_format(value, signed=signed, narrow=narrow)
    if not (signed and not narrow):
        raise ValueError(f"`signed` and `narrow` apply to a number of bits, got format={value!r}.")
    return as_format(value)


def _layout_of(layout: object, axis: object, group_size: object, group_axis: object) -> Layout:
    """The layout of quantizer arguments: `layout` itself (checked), or the one `axis`, `group_size` and
    `group_axis` describe."""
    if layout is None:
        return Layout.of(axis, group_size, group_axis=group_axis)  # pyright: ignore[reportArgumentType]
    if not isinstance(layout, Layout):
        raise TypeError(f"`layout` must be an eqx_quant.Layout or None, got layout={layout!r}.")
    if (axis, group_size, group_axis) != (None, None, -1):
        raise ValueError(f"Give `layout` or `axis` / `group_size` / `group_axis`, not both: got layout={layout!r}.")
    return Layout.of(layout.axis, layout.group_size, layout.stacked, layout.group_axis)


def _check_scale_values(name: str, values: list[float], kind: str) -> None:
    """Raises unless static or initial scales are ones of the scale format `kind` (see `SCALE_FORMATS`)."""
    for v in values:
        ok, requirement = valid_scales(np.asarray(v), kind)
        if not ok:
            raise ValueError(f"`{name}` must be {requirement}, got {name}={v!r}.")


def _static_array(name: str, value: float | int | tuple, layout: Layout, x: Array) -> Array:
    """A static scale or zero point as an array that broadcasts against `layout`'s view of `x`."""
    a = jnp.asarray(value, compute_dtype(x.dtype))
    if a.ndim == 0 and layout.scale_shape(x.shape) != ():
        a = jnp.broadcast_to(a, layout.scale_shape(x.shape))  # one value for every channel or tile
    try:
        return layout.expand(a, x.shape)
    except ValueError as error:
        raise ValueError(f"`{name}` does not fit `x`: {error}") from None


def _check_layout(fmt: Format, layout: Layout) -> None:
    if fmt.scale != "float32" and layout.group_size is None:
        raise ValueError(f"{fmt.name} has block scales: give its block size as `group_size` (and its axis as "
                         "`group_axis`).")  # fmt: skip
    if fmt.scale == "e4m3" and layout.group_size != NVFP4_BLOCK:
        raise ValueError(f"NVFP4 has blocks of {NVFP4_BLOCK}, got group_size={layout.group_size}.")
    if fmt.scale != "float32" and layout.axes:
        raise ValueError(f"{fmt.name} has a scale per block: `axis` does not apply, got axis={layout.axis!r}.")


class FakeQuant(AbstractFakeQuantizer):
    """A fixed fake quantizer: format, layout and scales are static configuration.

    `FakeQuant(scale, qmin, qmax)(x)` is `fake_quant(x, scale, qmin, qmax)`; `FakeQuant(scale,
    format="float8_e4m3fn")(x)` is `fake_quant_float(x, scale, "float8_e4m3fn")`. Per-channel scales and zero points
    are tuples with one entry per index of `x.shape[axis]`; per-tile ones (`group_size=g`) nested tuples in the
    compact shape of [`eqx_quant.Layout`][]. Block formats hold their block scales so (powers of two for MX,
    `float8_e4m3fn` values and a `tensor_scale` for NVFP4): GPTQ's result on such a weight, say.

    The module has no array leaves: optimizers never change it and gradients never reach it, which suits a frozen,
    calibrated quantizer (see [`eqx_quant.FakeQuant.fit`][]). Because its configuration is static, it is part of the
    compiled program: repeated calls under `eqx.filter_jit` with the same module compile once, and a module with
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
    zero_point: int | tuple = eqx.field(static=True)
    tensor_scale: float | None = eqx.field(static=True)
    format: Format = eqx.field(static=True)
    layout: Layout = eqx.field(static=True)

    def __init__(
        self,
        scale: StaticFloats,
        qmin: int | np.integer | None = None,
        qmax: int | np.integer | None = None,
        *,
        format: FormatLike | None = None,
        zero_point: StaticInts = 0,
        tensor_scale: float | None = None,
        axis: int | tuple[int, ...] | None = None,
        group_size: int | None = None,
        group_axis: int = -1,
        layout: Layout | None = None,
    ):
        """**Arguments:**

        - `scale`: the step size, a positive float, or an array of them in the compact shape of the layout (one per
            channel along `axis`, or one per tile).
        - `qmin`, `qmax`: the inclusive integer range (see [`eqx_quant.int_range`][]); or, instead of them,
        - `format`: a [`eqx_quant.Format`][] or its name.
        - `zero_point`: the integer that represents 0, in `[qmin, qmax]`; an int or an array of ints shaped like
            `scale`. Integer grids with float32 scales only.
        - `tensor_scale`: the float32 scale of the whole tensor of a two-level format (NVFP4).
        - `axis`: the channel axis (or axes) of the input for per-channel `scale` / `zero_point`; negative values
            count from the end.
        - `group_size`, `group_axis`: the size of the tiles along axis `group_axis` (the last by default) for
            per-tile `scale` / `zero_point`.

        - `layout`: instead of `axis`, `group_size` and `group_axis`, the [`eqx_quant.Layout`][] itself.

        A per-channel or per-tile `scale` needs `axis` or `group_size`; a scalar applies to every channel or tile.
        """
        self.format = _format_of(format, qmin, qmax)
        self.scale = as_static_floats("scale", scale)
        self.zero_point = as_static_ints("zero_point", zero_point)
        self.tensor_scale = None if tensor_scale is None else check_real("tensor_scale", tensor_scale)
        self.layout = _layout_of(layout, axis, group_size, group_axis)

    def __check_init__(self):
        fmt = self.format
        _check_layout(fmt, self.layout)
        _check_scale_values("scale", flat(self.scale), fmt.scale)
        if (fmt.scale == "e4m3") != (self.tensor_scale is not None):
            raise ValueError(f"`tensor_scale` is given exactly for two-level scales (NVFP4), got format={fmt.name!r} "
                             f"and tensor_scale={self.tensor_scale!r}.")  # fmt: skip
        if self.tensor_scale is not None:
            _check_scale_values("tensor_scale", [self.tensor_scale], "float32")
        if not fmt.zero_points and any(zp != 0 for zp in flat(self.zero_point)):
            raise ValueError(f"{fmt.name} has no zero point, got zero_point={self.zero_point!r}.")
        if isinstance(fmt, IntFormat):
            check_zero_points(self.zero_point, fmt)
        arrays = [name for name in ("scale", "zero_point") if isinstance(getattr(self, name), tuple)]
        if arrays and self.layout.is_per_tensor():
            if fmt.scale == "float32" and not isinstance(fmt, IntFormat) and arrays == ["scale"]:
                raise ValueError(f"A per-channel `scale` needs `axis`, got scale={self.scale!r} and axis=None.")
            raise ValueError(f"`axis` or `group_size` is required for an array `{arrays[0]}`, got neither.")
        if len(arrays) == 2 and np.shape(self.scale) != np.shape(self.zero_point):
            raise ValueError(
                f"`scale` and `zero_point` must have one shape, got {np.shape(self.scale)} and "
                f"{np.shape(self.zero_point)}."
            )

    def scales(self, x: Float[Array, "*shape"]) -> Scales:
        zero_point = None
        if self.zero_point != 0:
            zero_point = _static_array("zero_point", self.zero_point, self.layout, x)
        tensor_scale = None if self.tensor_scale is None else jnp.asarray(self.tensor_scale, jnp.float32)
        return Scales(_static_array("scale", self.scale, self.layout, x), zero_point, tensor_scale)

    @property
    def dtype(self) -> str:
        """The element type of a float format (as [`eqx_quant.FloatFakeQuant`][] took it)."""
        return self.format.element

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
        return cls(scale, format=int_format(bits, signed=signed, narrow=narrow), axis=axis, group_size=group_size)

    @classmethod
    def fit(
        cls,
        x: Real[ArrayLike, "*shape"],
        format: FormatLike,
        *,
        signed: bool = True,
        narrow: bool = False,
        axis: int | tuple[int, ...] | None = None,
        group_size: int | None = None,
        group_axis: int = -1,
        method: Literal["absmax", "minmax", "percentile", "mse"] = "absmax",
        percentile: float = 99.99,
        num_candidates: int = 100,
    ) -> "FakeQuant":
        """Fits a quantizer to sample data (post-training quantization).

        The statistics ignore NaN and infinite entries of `x`.

        **Arguments:**

        - `x`: the sample data, e.g. a weight or a batch of activations.
        - `format`: the number of bits of an integer grid (with `signed` and `narrow`, as for
            [`eqx_quant.int_range`][]), or a [`eqx_quant.Format`][] or its name.
        - `axis`: `None` for one scale for the whole tensor, or the channel axis (or axes) for one scale per index
            along it.
        - `group_size`, `group_axis`: one scale per tile of this many contiguous elements along axis `group_axis`,
            or `None`. Block formats (MX, NVFP4) need their blocks so.
        - `method`:
            - `"absmax"`: symmetric, `scale ≈ max|x| / bound` (`bound` the grid's `qmax`, or the largest value of a
                float format), nudged up by at most a few ulps so that the largest magnitude maps inside the grid
                with the arithmetic of [`eqx_quant.fake_quant`][] (so it lands on the grid and keeps its gradient).
                Block formats take their own rule (E8M0 or two-level scales).
            - `"minmax"`: asymmetric, covering `[min(x, 0), max(x, 0)]` with an integer zero point, so that 0 is
                exactly representable and both extremes map inside the range. Integer grids only.
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
        fmt = _format_of(format, None, None, signed, narrow)
        layout = Layout.of(axis, group_size, group_axis=group_axis)
        _check_layout(fmt, layout)
        check_fit_method(fmt, method)
        x, view = _sample_data(x, layout)
        axes = layout.reduction_axes(x.shape)
        if fmt.scale != "float32":
            check_blocks(x.shape, layout.group_axis, layout.group_size, fmt)  # pyright: ignore[reportArgumentType]
        threshold = None
        if method == "percentile":
            threshold = jnp.asarray(_percentile_of_data(view, axes, percentile), jnp.float32)
        scale, zero_point, tensor_scale = _fitted_scales(view, threshold, axes, fmt, method, int(num_candidates))
        scale = np.asarray(layout.compact(scale, x.shape))
        tensor_scale = None if tensor_scale is None else float(tensor_scale)
        if zero_point is None and fmt.zero_points:  # zeros in the shape of the scales, as minmax gives them
            zero_point = jnp.zeros(np.shape(scale), jnp.float32)
        zp = 0 if zero_point is None else np.asarray(layout.compact(zero_point, x.shape)).astype(np.int64)
        if layout.is_per_tensor():
            return cls(float(scale), format=fmt, zero_point=int(np.asarray(zp)))
        return cls(scale, format=fmt, zero_point=zp, tensor_scale=tensor_scale, axis=layout.axis,
                   group_size=layout.group_size, group_axis=layout.group_axis)  # fmt: skip

    @classmethod
    def calibrate(cls, x: Real[ArrayLike, "*shape"], bits: FormatLike, **kwargs) -> "FakeQuant":
        """An alias of [`eqx_quant.FakeQuant.fit`][] (the name of earlier releases)."""
        return cls.fit(x, bits, **kwargs)


@one_program
def _fitted_scales(
    view: Array, threshold: Array | None, axes: tuple[int, ...], fmt: Format, method: str, num_candidates: int
) -> Scales:
    """The arithmetic of [`eqx_quant.FakeQuant.fit`][] on checked data: its scales for `view` (the sample data under
    the layout), reduced over `axes`; `threshold` is the percentile of `method="percentile"`."""
    if fmt.scale != "float32":
        return Scales(*fit_scales(view, axes, fmt))
    if method == "minmax":
        assert isinstance(fmt, IntFormat)
        _, lo, hi = stats(view, axes)
        return Scales(*minmax_scale(lo, hi, fmt))
    if method == "absmax":
        return Scales(absmax_scale(stats(view, axes)[0], fmt))
    if method == "percentile":
        assert threshold is not None
        return Scales(absmax_scale(threshold, fmt))
    return Scales(least_error_scale(view, None, stats(view, axes)[0], axes, fmt, num_candidates))


def check_fit_method(fmt: Format, method: str) -> None:
    """Raises unless `method` can fit a static scale of `fmt`."""
    if method == "minmax" and not fmt.zero_points:
        raise ValueError(
            f"`method`='minmax' fits an asymmetric grid with a zero point, which {fmt.name} does not have; use "
            "'absmax', 'percentile' or 'mse'."
        )
    if fmt.scale != "float32" and method != "absmax":
        raise ValueError(f"{fmt.name} computes its block scales by its own rule: only `method`='absmax' fits them, "
                         f"got method={method!r}.")  # fmt: skip


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
        check_input(x)
        with jax.named_scope("eqx_quant.PassthroughClip"):
            return clip_passthrough(x, self.lo, self.hi)


class DynamicFakeQuant(AbstractFakeQuantizer):
    """A fake quantizer that computes its scales from its input at every call: the usual weight quantizer in QAT,
    and the usual activation quantizer of integer and float inference.

    The scale of an integer grid is `max|x| / qmax` (symmetric), nudged up by at most a few ulps so that the largest
    magnitude always maps inside the range and keeps its gradient, whichever way the program is compiled; or, with
    `symmetric=False`, an asymmetric scale and integer zero point covering `[min(x, 0), max(x, 0)]`. A float format
    with float32 scales takes `max|x| / M` (`M` its largest value: 448 for `float8_e4m3fn`), nudged alike. MX blocks
    take the power of two of their scale rule, NVFP4 blocks their two levels (see [`eqx_quant.mx_fake_quant`][] and
    [`eqx_quant.nvfp4_fake_quant`][]). Scales are computed from the finite entries of `x` and are `stop_gradient`-ed:
    gradients reach `x` through the straight-through estimator only. An all-zero tensor (channel, tile) quantizes to
    exact zeros.

    Granularity:

    - per tensor (`axis=None`, `group_size=None`): one scale;
    - per channel (`axis=k`, or a tuple of axes): one scale per index along axis `k`;
    - per tile (`group_size=g`): axis `group_axis` (the last by default) is split into contiguous tiles of `g`, and
        every tile of every index of the other axes has its own scale: the groups of an integer weight, the blocks
        of MX (32) and NVFP4 (16) formats.

    !!! example

        ```python
        import jax.numpy as jnp
        import eqx_quant

        q = eqx_quant.DynamicFakeQuant(8, axis=0)  # one scale per row
        w = jnp.array([[0.1, -0.2, 0.3], [10.0, 5.0, -2.5]])
        print(q(w))
        mxfp4 = eqx_quant.DynamicFakeQuant("mxfp4", group_size=4)  # blocks of 4 with power-of-two scales
        print(mxfp4(jnp.array([0.1, -0.7, 3.0, 7.0])))  # [ 0.  -0.5  3.   6. ]
        ```
    """

    format: Format = eqx.field(static=True)
    layout: Layout = eqx.field(static=True)
    symmetric: bool = eqx.field(static=True)
    axis_name: AxisName | None = eqx.field(static=True)

    def __init__(
        self,
        format: FormatLike,
        *,
        signed: bool = True,
        narrow: bool = False,
        axis: int | tuple[int, ...] | None = None,
        group_size: int | None = None,
        group_axis: int = -1,
        symmetric: bool = True,
        axis_name: AxisName | None = None,
        layout: Layout | None = None,
    ):
        """**Arguments:**

        - `format`: the number of bits of an integer grid (with `signed` and `narrow`, as for
            [`eqx_quant.int_range`][]), or a [`eqx_quant.Format`][] or its name (`"float8_e4m3fn"`, `"mxfp4"`,
            `"nvfp4"`, ...).
        - `axis`: the channel axis for per-channel scales, or `None`.
        - `group_size`, `group_axis`: the size of the tiles along axis `group_axis` for per-tile scales, or `None`.
        - `symmetric`: `True` for a zero point of 0 and `scale = max|x| / bound`; `False` for a min/max range with an
            integer zero point (integer grids with float32 scales only).
        - `axis_name`: for calls inside `jax.shard_map` (or a `jax.vmap` with an `axis_name`) where `x` is one shard
            of a larger tensor: the named axes along which the tensor is split. The statistics are then reduced
            across them (`jax.lax.pmax`, `jax.lax.pmin`), so that every shard uses the scale of the whole tensor. Name
            only axes that split the elements sharing a scale, never the channel axis. Not needed under `jax.jit`
            with sharded arrays, where reductions are global already.
        - `layout`: instead of `axis`, `group_size` and `group_axis`, the [`eqx_quant.Layout`][] itself.
        """
        if format is None:  # this quantizer takes no `qmin` and `qmax`
            raise TypeError("`format` must be a Format, a format's name or a number of bits, got None.")
        self.format = _format_of(format, None, None, signed, narrow)
        self.layout = _layout_of(layout, axis, group_size, group_axis)
        self.symmetric = symmetric
        self.axis_name = axis_name

    def __check_init__(self):
        _check_layout(self.format, self.layout)
        check_axis_name(self.axis_name)
        if not isinstance(self.symmetric, bool):
            raise TypeError(f"`symmetric` must be a bool, got {self.symmetric!r}.")
        if not self.symmetric and not self.format.zero_points:
            raise ValueError(f"`symmetric`=False needs a zero point, which {self.format.name} does not have.")

    @property
    def signed(self) -> bool:
        """Whether the integer grid has negative levels."""
        return self.qmin < 0

    @property
    def narrow(self) -> bool:
        """Whether the signed integer grid is symmetric about zero."""
        return self.qmin == -self.qmax and self.qmin < 0

    def scales(self, x: Float[Array, "*shape"]) -> Scales:
        view = self.layout.view(x).astype(compute_dtype(x.dtype))
        axes = self.layout.reduction_axes(x.shape)
        return fit_scales(view, axes, self.format, symmetric=self.symmetric, axis_name=self.axis_name)


class LearnedFakeQuant(AbstractFakeQuantizer):
    """A fake quantizer with learned scales (LSQ, Esser et al., ICLR 2020), and optionally a learned zero point.

    `scale` is an array leaf in the compact shape of the layout: per tensor (shape `()`), per channel (shape
    `(channels,)` along `axis`) or per tile (the tiled axis shortened by `group_size`), trained through the scale
    gradient of [`eqx_quant.fake_quant_format`][]. That gradient is multiplied by the LSQ gradient scale
    `1 / sqrt(numel * level)`, where `numel` is the number of elements that share one scale in the call (`x.size` per
    tensor, `x.size / channels` per channel, `g` per tile) and `level` the grid's `qmax` (or a float format's largest
    value); the forward value is unchanged.

    **Positivity.** The forward pass uses `clip_passthrough(scale, min_scale, inf)`: whatever an optimizer does to the
    leaf, the step size used is at least `min_scale`, and since the clip passes its gradient straight through, a leaf
    pushed below the floor still receives gradients and can recover.

    **Block formats.** An MX format's scale in use is the power of two nearest the leaf (in the log domain), an
    NVFP4 block scale the nearest `float8_e4m3fn` value of the leaf, under the learned float32 `tensor_scale`; both
    roundings pass gradients straight through.

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
    tensor_scale: Float[Array, ""] | None
    format: Format = eqx.field(static=True)
    layout: Layout = eqx.field(static=True)
    min_scale: float = eqx.field(static=True)
    axis_name: AxisName | None = eqx.field(static=True)

    def __init__(
        self,
        scale: Real[ArrayLike, "*channels"],
        qmin: int | np.integer | None = None,
        qmax: int | np.integer | None = None,
        *,
        format: FormatLike | None = None,
        zero_point: Real[ArrayLike, "*channels"] | None = None,
        tensor_scale: Real[ArrayLike, ""] | None = None,
        axis: int | tuple[int, ...] | None = None,
        group_size: int | None = None,
        group_axis: int = -1,
        min_scale: float = 1e-8,
        axis_name: AxisName | None = None,
        layout: Layout | None = None,
    ):
        """**Arguments:**

        - `scale`: the initial step size: a positive scalar, or an array in the compact shape of the layout (one
            entry per channel along `axis`, or one per tile). Stored as a float32 array.
        - `qmin`, `qmax`: the inclusive integer range (see [`eqx_quant.int_range`][]); or, instead of them,
        - `format`: a [`eqx_quant.Format`][] or its name.
        - `zero_point`: `None` for a symmetric quantizer, or the initial zero point (same shape as `scale`), stored
            as a float32 array and learned. Integer grids with float32 scales only.
        - `tensor_scale`: the initial float32 tensor scale of a two-level format (NVFP4), learned too.
        - `axis`: the channel axis (or axes) for a per-channel `scale`, or `None`.
        - `group_size`, `group_axis`: the size of the tiles along axis `group_axis` for a per-tile `scale`, or `None`.
        - `min_scale`: the smallest step size the forward pass uses; a positive, normal float32.
        - `axis_name`: for calls inside `jax.shard_map` where `x` is one shard of a larger tensor: the named axes
            along which the elements sharing a scale are split. The gradient scale then counts the elements of
            every shard, as it would for the whole tensor. (The scale's gradient itself is summed across shards by
            `shard_map`'s transpose when the scale is replicated along those axes.)
        - `layout`: instead of `axis`, `group_size` and `group_axis`, the [`eqx_quant.Layout`][] itself.
        """
        self.scale = _learned_leaf("scale", scale)
        self.zero_point = None if zero_point is None else _learned_leaf("zero_point", zero_point)
        self.tensor_scale = None if tensor_scale is None else _learned_leaf("tensor_scale", tensor_scale)
        self.format = _format_of(format, qmin, qmax)
        self.layout = _layout_of(layout, axis, group_size, group_axis)
        self.min_scale = check_real("min_scale", min_scale)
        self.axis_name = axis_name

    def __check_init__(self):
        fmt, layout = self.format, self.layout
        _check_layout(fmt, layout)
        if fmt.scale_rule == "signed_max":
            raise ValueError(f"{fmt.name}'s scales are signed (`d = m / {integer_grid_of(fmt).qmin}`, from the "
                             "block's element of largest magnitude): they are computed from each block, not learned. "
                             f"Use DynamicFakeQuant({fmt.name!r}, group_size=32).")  # fmt: skip
        _check_scale_values("min_scale", [self.min_scale], "float32")
        check_axis_name(self.axis_name)
        if layout.group_size is None and self.scale.ndim != len(layout.axes):
            raise ValueError(
                f"`scale` must have {len(layout.axes)} dimension(s) for axis={self.axis}, got shape {self.scale.shape}."
            )
        if self.zero_point is not None:
            if not fmt.zero_points:
                raise ValueError(f"{fmt.name} has no zero point, got a `zero_point`.")
            if self.zero_point.shape != self.scale.shape:
                raise ValueError(
                    f"`zero_point` must have the shape of `scale`, {self.scale.shape}, got {self.zero_point.shape}."
                )
            if is_concrete(self.zero_point):  # a real number, rounded and clipped into the grid where it is used
                check_zero_points(self.zero_point, integer=False)
        if (fmt.scale == "e4m3") != (self.tensor_scale is not None):
            raise ValueError(f"`tensor_scale` is given exactly for two-level scales (NVFP4), got format={fmt.name!r}.")
        if not isinstance(self.scale, jax.core.Tracer):
            s = np.asarray(self.scale)
            positive = s > 0 if fmt.scale == "float32" else s >= 0
            if not np.all(np.isfinite(s) & positive):
                raise ValueError(f"`scale` must be finite and positive, got scale={s.tolist()!r}.")

    def scales(self, x: Float[Array, "*shape"]) -> Scales:
        layout, fmt = self.layout, self.format
        numel = layout.group_numel(x.shape) * shards(self.axis_name)
        factor = 1.0 / math.sqrt(numel * fmt.lsq_level) if numel else 1.0
        scale = self._expand("scale", self.scale, x)
        if fmt.scale == "e4m3":
            scale = e4m3_ste(clip_passthrough(scale, 0.0, math.inf))
        else:
            scale = clip_passthrough(scale, self.min_scale, math.inf)
            if fmt.scale == "e8m0":
                scale = pow2_ste(scale)
        scale = scale_gradient(scale, factor)
        tensor_scale = None
        if self.tensor_scale is not None:
            tensor_scale = scale_gradient(clip_passthrough(self.tensor_scale, self.min_scale, math.inf), factor)
        if self.zero_point is None:
            return Scales(scale, None, tensor_scale)
        assert isinstance(fmt, IntFormat)
        zero_point = self._expand("zero_point", self.zero_point, x)
        return Scales(scale, round_ste(clip_passthrough(scale_gradient(zero_point, factor), fmt.qmin, fmt.qmax)))

    def _expand(self, name: str, leaf: Array, x: Array) -> Array:
        try:
            return self.layout.expand(leaf, x.shape)
        except ValueError as error:
            raise ValueError(f"`{name}` does not fit `x`: {error}") from None

    @property
    def dtype(self) -> str:
        """The element type of a float format (as [`eqx_quant.LearnedFloatFakeQuant`][] took it)."""
        return self.format.element

    @classmethod
    def init_from(
        cls,
        x: Real[ArrayLike, "*shape"],
        format: FormatLike,
        *,
        signed: bool = True,
        narrow: bool = False,
        axis: int | tuple[int, ...] | None = None,
        group_size: int | None = None,
        group_axis: int = -1,
        symmetric: bool = True,
        min_scale: float = 1e-8,
        axis_name: AxisName | None = None,
        stacked: int = 0,
        method: Literal["lsq", "absmax", "paretoq"] | None = None,
    ) -> "LearnedFakeQuant":
        """Initialises the scales from data: by default as round to nearest does (the scales of
        [`eqx_quant.DynamicFakeQuant`][]: `max|x| / qmax` for an integer grid, `max|x| / M` for a float format, the
        block scales of MX and NVFP4), so that training starts from the round-to-nearest model; for an integer grid
        also as LSQ does (`2 * mean|x| / sqrt(qmax)`, and the default with a zero point), or for ternary and stretched
        grids as ParetoQ does. Per tensor, per channel or per tile.

        **Arguments:**

        - `x`: sample data (e.g. the weight it will quantize). Non-finite entries are ignored.
        - `format`: the number of bits of an integer grid (with `signed` and `narrow`, as for
            [`eqx_quant.int_range`][]), or a [`eqx_quant.Format`][] or its name.
        - `axis`: the channel axis (or axes) for per-channel step sizes, or `None`.
        - `group_size`, `group_axis`: one step size per tile of this many contiguous elements along axis
            `group_axis`, or `None`.
        - `symmetric`: `False` adds a learned zero point, initialised so that `min(x, 0)` maps to `qmin`.
        - `min_scale`: as for the constructor; the initial step size is at least this.
        - `axis_name`: as for the constructor (the initial step size is computed from `x` as given).
        - `stacked`: the number of leading axes of `x` along which whole tensors are stacked (the weight of a layer
            built with `eqx.filter_vmap`, of shape `(layers, *weight_shape)`). The quantizer is then made for one
            tensor (`axis` and `group_size` refer to its axes) and stacked like the layer: its arrays get the same
            leading axes, so that a `jax.lax.scan` over the layers hands each layer its own step sizes.
        - `method`: for an integer grid, `"absmax"`: the scales of [`eqx_quant.DynamicFakeQuant`][] with the same
            format and layout (symmetric only), so that training starts exactly from the round-to-nearest model;
            `"lsq"`: LSQ's rule above, with LSQ+'s zero point when `symmetric=False` (on a stretched grid with the
            top level `2**(b-1) - 1/2` for `qmax`); `None` (the default):
            `"absmax"` when symmetric, `"lsq"` otherwise; `"paretoq"`, the initialisation of ParetoQ (Liu et al.,
            2025), for two grids: the ternary grid `[-1, 1]` (`int_format(2, narrow=True)`) takes `max|x| / 1.5`,
            whose levels `±max|x| / 1.5` sit at two thirds of the largest magnitude and round entries below a third
            of it to zero, and a stretched grid ([`eqx_quant.stretched_format`][]) of `b` bits takes
            `max|x| / 2**(b-1)`, whose top level is `(1 - 2**-b) max|x|` (three quarters of it at 2 bits).
            Symmetric only. Float formats always start from their dynamic scales.

        **Returns:**

        A [`eqx_quant.LearnedFakeQuant`][].
        """
        if check_int("stacked", stacked) < 0:
            raise ValueError(f"`stacked` must be a non-negative int, got stacked={stacked}.")
        fmt = _format_of(format, None, None, signed, narrow)
        layout = Layout.of(axis, group_size, group_axis=group_axis)
        _check_layout(fmt, layout)
        if not symmetric and not fmt.zero_points:
            raise ValueError(f"`symmetric`=False needs a zero point, which {fmt.name} does not have.")
        if method is None:
            method = "absmax" if symmetric else "lsq"
        if method not in ("lsq", "absmax", "paretoq"):
            raise ValueError(f"`method` must be 'lsq', 'absmax' or 'paretoq', got method={method!r}.")
        if method != "lsq" and not symmetric:
            raise ValueError(f"`method`={method!r} starts from symmetric scales; it needs `symmetric`=True.")
        if method == "paretoq" and paretoq_divisor(fmt) is None:
            raise ValueError(
                "`method`='paretoq' is the rule of the ternary grid [-1, 1] and of the stretched grids "
                f"(int2_stretched, ...), got {fmt.name}."
            )
        if stacked:
            x = as_float_input("x", x)
            if x.ndim < stacked:
                raise ValueError(f"`stacked`={stacked} leading axes do not fit `x` of shape {x.shape}.")
            kwargs = dict(axis=axis, group_size=group_size, group_axis=group_axis, symmetric=symmetric, method=method)
            init = lambda w: cls.init_from(w, fmt, **kwargs, min_scale=min_scale, axis_name=axis_name)  # noqa: E731
            for _ in range(stacked):
                init = eqx.filter_vmap(init)
            return one_program(init)(x)
        x, view = _sample_data(x, layout)
        if fmt.scale != "float32":
            check_blocks(x.shape, group_axis, group_size, fmt)  # pyright: ignore[reportArgumentType]
        scale, zero_point, tensor_scale = _initial_scales(view, layout, x.shape, fmt, min_scale, symmetric, method)
        return cls(scale, zero_point=zero_point, tensor_scale=tensor_scale, format=fmt, axis=layout.axis,
                   group_size=group_size, group_axis=group_axis, min_scale=min_scale, axis_name=axis_name)  # fmt: skip


def _learned_leaf(name: str, value: object) -> Array:
    """A learned quantizer's initial `scale`, `zero_point` or `tensor_scale` as a float32 array, or a `TypeError`
    naming it."""
    dtype = value.dtype if isinstance(value, jax.Array) else np.asarray(value).dtype
    real = jnp.issubdtype(dtype, jnp.integer) or jnp.issubdtype(dtype, jnp.floating)  # ml_dtypes' floats too
    if isinstance(value, (bool, np.bool_)) or not real:
        raise TypeError(f"`{name}` must be a real number or an array of them, got {value!r} of type "
                        f"{type(value).__name__}.")  # fmt: skip
    # An explicit dtype: Python numbers would otherwise make weakly typed leaves (which recompile once updated).
    # A JAX array stays where it is, so a scale computed from a sharded weight keeps the weight's sharding.
    return jnp.asarray(value, jnp.float32)


def paretoq_divisor(fmt: Format) -> float | None:
    """ParetoQ's initial scale is `max|x|` over this: 1.5 for the ternary grid, `2**(b-1)` for a stretched grid of
    `b` bits; `None` for other formats."""
    if isinstance(fmt, IntFormat) and fmt.grid == (-1, 1) and fmt.scale == "float32":
        return 1.5
    if isinstance(fmt, StretchedFormat):
        return float(fmt.qmax + 1)
    return None


@one_program
def _initial_scales(
    view: Array, layout: Layout, shape: tuple[int, ...], fmt: Format, min_scale: float, symmetric: bool, method: str
) -> Scales:
    """The arithmetic of [`eqx_quant.LearnedFakeQuant.init_from`][] on checked data: its initial scales for `view`
    (the sample data of shape `shape` under `layout`), compacted to the layout's shape."""
    axes = layout.reduction_axes(shape)
    if method == "paretoq":
        divisor = paretoq_divisor(fmt)
        assert divisor is not None
        scale = jnp.maximum(finite_absmax(view, axes) / np.float32(divisor), min_scale)
        return Scales(layout.compact(scale, shape))
    lsq = isinstance(fmt, (IntFormat, StretchedFormat)) and fmt.scale == "float32" and method == "lsq"
    if not lsq:
        scale, _, tensor_scale = fit_scales(view, axes, fmt)
        if fmt.scale == "float32":
            scale = jnp.maximum(scale, min_scale)
        return Scales(layout.compact(scale, shape), None, tensor_scale)
    finite = jnp.isfinite(view)
    magnitudes = jnp.where(finite, jnp.abs(view), 0.0)
    count = jnp.maximum(jnp.sum(finite, axis=axes, keepdims=True), 1).astype(jnp.float32)
    mean = jnp.sum(magnitudes, axis=axes, keepdims=True) / count
    # Past float32's range the sum overflows where the mean does not: then the sum of pre-divided magnitudes.
    mean = jnp.where(jnp.isfinite(mean), mean, jnp.sum(magnitudes / count, axis=axes, keepdims=True))
    scale = layout.compact(jnp.maximum(2 * mean / math.sqrt(fmt.lsq_level), min_scale), shape)
    zero_point = None
    if not symmetric:
        assert isinstance(fmt, IntFormat)
        lo = jnp.minimum(jnp.min(finite_or(view, 0.0), axis=axes, initial=0.0), 0.0)
        zero_point = jnp.clip(jnp.round(fmt.qmin - lo / scale), fmt.qmin, fmt.qmax)  # `lo` without unit axes
    return Scales(scale, zero_point)


#
# The constructors of earlier releases: the same modules, with a float format.
#


def FloatFakeQuant(dtype: object, scale: StaticFloats, *, axis: int | tuple[int, ...] | None = None) -> FakeQuant:
    """A [`eqx_quant.FakeQuant`][] onto an FP8, FP6 or FP4 element type with a static float32 scale, per tensor or
    per channel: `FakeQuant(scale, format=dtype, axis=axis)`.

    `FloatFakeQuant(dtype, scale)(x)` is [`eqx_quant.fake_quant_float`][]`(x, scale, dtype)`.

    !!! example

        ```python
        import jax.numpy as jnp
        import eqx_quant

        q = eqx_quant.FloatFakeQuant("float8_e4m3fn", 0.5)
        print(q(jnp.array([0.3, 1.25, -2.6, 5.5, 1000.0])))  # [  0.3125   1.25    -2.5      5.5    224.    ]
        ```
    """
    return FakeQuant(scale, format=float_format(dtype), axis=axis)


def DynamicFloatFakeQuant(dtype: object, *, axis: int | tuple[int, ...] | None = None) -> DynamicFakeQuant:
    """A [`eqx_quant.DynamicFakeQuant`][] onto an FP8, FP6 or FP4 element type, per tensor or per channel:
    `DynamicFakeQuant(dtype, axis=axis)`. The scale is `amax / M` (`M` the format's largest value), nudged so that
    `amax` lands inside the range.

    !!! example

        ```python
        import jax.numpy as jnp
        import eqx_quant

        q = eqx_quant.DynamicFloatFakeQuant("float4_e2m1fn", axis=0)  # one scale per row
        w = jnp.array([[0.25, -0.7, 1.5], [12.0, 5.0, -2.5]])  # scales 1.5 / 6 and 12 / 6
        print(q(w))  # [[ 0.25 -0.75  1.5 ] [12.    4.   -2.  ]]
        ```
    """
    return DynamicFakeQuant(float_format(dtype), axis=axis)


def LearnedFloatFakeQuant(
    dtype: object, scale: Real[ArrayLike, "*channels"], *, axis: int | tuple[int, ...] | None = None,
    min_scale: float = 1e-8,
) -> LearnedFakeQuant:  # fmt: skip
    """A [`eqx_quant.LearnedFakeQuant`][] onto an FP8, FP6 or FP4 element type with a learned float32 scale, per
    tensor or per channel: `LearnedFakeQuant(scale, format=dtype, axis=axis, min_scale=min_scale)`.
    `LearnedFloatFakeQuant.init_from(x, dtype, axis=, min_scale=, stacked=)` is
    [`eqx_quant.LearnedFakeQuant.init_from`][]`(x, dtype, ...)`: the scale [`eqx_quant.DynamicFakeQuant`][] would use.

    !!! example

        ```python
        import jax
        import jax.numpy as jnp
        import eqx_quant

        x = jax.random.normal(jax.random.key(0), (64,))
        q = eqx_quant.LearnedFloatFakeQuant.init_from(x, "float8_e4m3fn")
        grads = jax.grad(lambda q: jnp.sum((q(x) - x) ** 2))(q)
        print(q.scale, grads.scale)
        ```
    """
    return LearnedFakeQuant(scale, format=float_format(dtype), axis=axis, min_scale=min_scale)


def _learned_float_init_from(
    x: Real[ArrayLike, "*shape"], dtype: object, *, axis: int | tuple[int, ...] | None = None,
    min_scale: float = 1e-8, stacked: int = 0,
) -> LearnedFakeQuant:  # fmt: skip
    return LearnedFakeQuant.init_from(x, float_format(dtype), axis=axis, min_scale=min_scale, stacked=stacked)


LearnedFloatFakeQuant.init_from = _learned_float_init_from  # pyright: ignore[reportFunctionMemberAccess]


def MXFakeQuant(fmt: str, *, axis: int = -1, block_size: int = 32, scale_rule: str = "floor") -> DynamicFakeQuant:
    """A [`eqx_quant.DynamicFakeQuant`][] onto an OCP Microscaling (MX v1.0) format: blocks of `block_size`
    contiguous elements along `axis` share a power-of-two scale (E8M0), computed from the block at every call:
    `DynamicFakeQuant(mx_format(fmt, scale_rule=scale_rule), group_size=block_size, group_axis=axis)`.

    A call is [`eqx_quant.mx_fake_quant`][]`(x, fmt, axis=axis, block_size=block_size, scale_rule=scale_rule)`:
    see it for the formats, the two scale rules and the gradients. For a matrix product, block along its
    contraction: the last axis of a linear layer's weight `(out, in)` and of its input, axis 1 of a convolution's
    weight `(out, in, *kernel)` and axis 0 of its input `(in, *spatial)`.

    !!! example

        ```python
        import jax.numpy as jnp
        import eqx_quant

        q = eqx_quant.MXFakeQuant("mxfp4", block_size=4)
        print(q(jnp.array([0.1, -0.7, 3.0, 7.0])))  # [ 0.  -0.5  3.   6. ]
        ```
    """
    format = mx_format(fmt, scale_rule=scale_rule)
    axis, block_size = check_int("axis", axis), check_int("block_size", block_size)
    if block_size < 1:
        raise ValueError(f"`block_size` must be >= 1, got block_size={block_size}.")
    return DynamicFakeQuant(format, group_size=block_size, group_axis=axis)


def NVFP4FakeQuant(*, axis: int = -1) -> DynamicFakeQuant:
    """A [`eqx_quant.DynamicFakeQuant`][] onto NVFP4: `float4_e2m1fn` elements in blocks of 16 along `axis`, each
    block with a `float8_e4m3fn` scale, under one float32 scale for the whole tensor, all computed from the input at
    every call: `DynamicFakeQuant("nvfp4", group_size=16, group_axis=axis)`.

    A call is [`eqx_quant.nvfp4_fake_quant`][]`(x, axis=axis)`: see it for the two levels of scales and the
    gradients. Under `jax.vmap` (an Equinox model that maps a layer over tokens), each mapped slice has its own
    tensor scale. For a matrix product, block along its contraction, as for [`eqx_quant.MXFakeQuant`][].

    !!! example

        ```python
        import jax.numpy as jnp
        import eqx_quant

        q = eqx_quant.NVFP4FakeQuant()
        x = jnp.linspace(-3.0, 3.0, 16)
        print(q(x)[:4])  # [-3. -3. -2. -2.]
        ```
    """
    return DynamicFakeQuant(NVFP4, group_size=NVFP4_BLOCK, group_axis=check_int("axis", axis))
