"""Quantizer modules onto low-precision float formats: FP8, FP6 and FP4 elements with float scales per tensor or per
channel (static, dynamic, learned), the OCP Microscaling formats, and NVFP4."""

import abc
import math
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, ArrayLike, Float, PRNGKeyArray, Real

from ._clip import clip_passthrough
from ._fake_quant import scale_gradient
from ._float_formats import (
    _FORMATS,
    _MX_ELEMENTS,
    _NVFP4_BLOCK,
    _check_blocks,
    _float_format,
    check_nvfp4_blocks,
    fake_quant_float,
    mx_fake_quant,
    nvfp4_fake_quant,
)
from ._float_tensor import FloatQuantizedTensor, block_tensor, scaled_tensor
from ._layout import Layout
from ._misc import FLOAT32_TINY, as_float_input, check_int, check_real, expand_to_rank
from ._quantizers import (
    AbstractQuantizer,
    StaticFloats,
    _as_static_floats,
    _check_float_input,
    _check_scale_values,
    _flat,
    _static_array,
)
from ._scales import _first_fitting, finite_absmax


def _format_name(dtype: object) -> str:
    return _float_format(dtype).name


def absmax_float_scale(x: Array, layout: Layout, largest: float) -> Array:
    """The dynamic scale of a float format whose largest value is `largest`: `amax / largest` over the finite entries
    sharing a scale, in float32, the smallest such float32 for which `amax * (1 / scale) <= largest` (so that the
    largest magnitude lands inside the range and keeps its gradient), at least the smallest normal float32. Shaped
    to broadcast against `x` (unit axes where shared); no gradient flows through it."""
    amax = finite_absmax(x, layout.reduction_axes(x.shape))
    # Every format's largest value is at least 4, so the scale is at most `2**126`, as `_first_fitting` needs.
    scale = jnp.maximum(amax * (np.float32(1) / np.float32(largest)), FLOAT32_TINY)
    return _first_fitting(scale, lambda s: expand_to_rank(amax, s.ndim) * (1 / s) <= largest)


class AbstractFloatQuantizer(AbstractQuantizer):
    """Base class of the quantizers onto low-precision float formats: [`eqx_quant.FloatFakeQuant`][],
    [`eqx_quant.DynamicFloatFakeQuant`][], [`eqx_quant.LearnedFloatFakeQuant`][], [`eqx_quant.MXFakeQuant`][] and
    [`eqx_quant.NVFP4FakeQuant`][].

    A call rounds its input onto the format's grid with one of the primitives [`eqx_quant.fake_quant_float`][],
    [`eqx_quant.mx_fake_quant`][] and [`eqx_quant.nvfp4_fake_quant`][]; `quantize` keeps the codes and scales of
    the same computation as a [`eqx_quant.nn.FloatQuantizedTensor`][], which is what [`eqx_quant.convert`][] stores.
    """

    @abc.abstractmethod
    def quantize(self, x: Float[Array, "*shape"]) -> FloatQuantizedTensor:
        """The codes and scales of a call on `x`: the [`eqx_quant.nn.FloatQuantizedTensor`][] whose `dequantize()`
        is, bit for bit, this quantizer's output for `x`. No gradient flows through it.

        **Arguments:**

        - `x`: a floating array.

        **Returns:**

        A [`eqx_quant.nn.FloatQuantizedTensor`][].
        """


class _ScaledFloatQuantizer(AbstractFloatQuantizer):
    """A float format with one float scale per tensor or per channel: [`eqx_quant.fake_quant_float`][] with the
    scale of `_scale`."""

    dtype: eqx.AbstractVar[str]

    @property
    @abc.abstractmethod
    def layout(self) -> Layout:
        """Per tensor, or per channel along `axis`."""

    @abc.abstractmethod
    def _scale(self, x: Array) -> Array:
        """The scale in use for `x`, broadcastable against it."""

    def __call__(self, x: Float[Array, "*shape"], *, key: PRNGKeyArray | None = None) -> Float[Array, "*shape"]:
        """Fake-quantizes `x`: `fake_quant_float(x, scale, dtype)`.

        **Arguments:**

        - `x`: a floating array.
        - `key`: ignored; present for compatibility with the Equinox layer API.

        **Returns:**

        An array with the shape and dtype of `x`.
        """
        del key
        _check_float_input(x)
        with jax.named_scope(f"eqx_quant.{type(self).__name__}"):
            return fake_quant_float(x, self._scale(x), self.dtype)

    def quantize(self, x: Float[Array, "*shape"]) -> FloatQuantizedTensor:
        _check_float_input(x)
        return scaled_tensor(x, self._scale(x), self.dtype, self.layout.channel_axes(x.shape))


class FloatFakeQuant(_ScaledFloatQuantizer):
    """A fixed float quantizer: an FP8, FP6 or FP4 element format with a static scale, per tensor or per channel.

    `FloatFakeQuant(dtype, scale)(x)` is [`eqx_quant.fake_quant_float`][]`(x, scale, dtype)`. A per-channel scale
    is a tuple with one entry per index of `x.shape[axis]` (nested tuples for several axes: the compact shape of
    [`eqx_quant.Layout`][]). Like [`eqx_quant.FakeQuant`][], the module has no array leaves: its configuration is part
    of the compiled program, and neither optimizers nor gradients change it.

    !!! example

        ```python
        import jax.numpy as jnp
        import eqx_quant

        q = eqx_quant.FloatFakeQuant("float8_e4m3fn", 0.5)
        print(q(jnp.array([0.3, 1.25, -2.6, 5.5, 1000.0])))  # [  0.3125   1.25    -2.5      5.5    224.    ]
        ```
    """

    dtype: str = eqx.field(static=True)
    scale: float | tuple = eqx.field(static=True)
    axis: int | tuple[int, ...] | None = eqx.field(static=True)

    def __init__(self, dtype: str | type | np.dtype, scale: StaticFloats, *, axis: int | tuple[int, ...] | None = None):
        """**Arguments:**

        - `dtype`: the element format: `float8_e4m3fn`, `float8_e5m2`, `float6_e2m3fn`, `float6_e3m2fn` or
            `float4_e2m1fn`, as a dtype or its name.
        - `scale`: the scale, a positive float, or one per channel along `axis` (each a finite, positive, normal
            float32 whose reciprocal is normal too).
        - `axis`: the channel axis (or axes) of a per-channel `scale`; negative values count from the end. A scalar
            `scale` with an `axis` applies to every channel.
        """
        self.dtype = _format_name(dtype)
        self.scale = _as_static_floats("scale", scale)
        self.axis = Layout.of(axis).axis

    def __check_init__(self):
        _check_scale_values("scale", _flat(self.scale))
        if isinstance(self.scale, tuple) and self.axis is None:
            raise ValueError(f"A per-channel `scale` needs `axis`, got scale={self.scale!r} and axis=None.")

    @property
    def layout(self) -> Layout:
        """Per tensor, or per channel along `axis`."""
        return Layout.of(self.axis)

    def _scale(self, x: Array) -> Array:
        return _static_array("scale", self.scale, self.layout, x)


class DynamicFloatFakeQuant(_ScaledFloatQuantizer):
    """A float quantizer whose scale is computed from its input at every call, per tensor or per channel: the usual
    FP8 activation quantizer (and weight quantizer in QAT).

    The scale is `amax / M`, with `amax` the largest finite `|x|` of the tensor (or channel) and `M` the largest
    value of the format (448 for `float8_e4m3fn`, 57344 for `float8_e5m2`, 7.5, 28 and 6 for `float6_e2m3fn`,
    `float6_e3m2fn` and `float4_e2m1fn`), computed in float32 and nudged up by at most a few ulps so that `amax`
    lands inside the range (and keeps its gradient) whichever way the program is compiled; it is at least the
    smallest normal float32, so a zero tensor quantizes to zeros. The scale is `stop_gradient`-ed: gradients reach
    `x` through the straight-through estimator of [`eqx_quant.fake_quant_float`][] only.

    !!! example

        ```python
        import jax.numpy as jnp
        import eqx_quant

        q = eqx_quant.DynamicFloatFakeQuant("float4_e2m1fn", axis=0)  # one scale per row
        w = jnp.array([[0.25, -0.7, 1.5], [12.0, 5.0, -2.5]])  # scales 1.5 / 6 and 12 / 6
        print(q(w))  # [[ 0.25 -0.75  1.5 ] [12.    4.   -2.  ]]
        ```
    """

    dtype: str = eqx.field(static=True)
    axis: int | tuple[int, ...] | None = eqx.field(static=True)

    def __init__(self, dtype: str | type | np.dtype, *, axis: int | tuple[int, ...] | None = None):
        """**Arguments:**

        - `dtype`: the element format, as for [`eqx_quant.FloatFakeQuant`][].
        - `axis`: the channel axis (or axes) for one scale per channel, or `None` for one scale per tensor.
        """
        self.dtype = _format_name(dtype)
        self.axis = Layout.of(axis).axis

    @property
    def layout(self) -> Layout:
        """Per tensor, or per channel along `axis`."""
        return Layout.of(self.axis)

    def _scale(self, x: Array) -> Array:
        return absmax_float_scale(x, self.layout, _FORMATS[self.dtype].max)


class LearnedFloatFakeQuant(_ScaledFloatQuantizer):
    """A float quantizer with a learned scale, per tensor or per channel.

    `scale` is a float32 array leaf in the compact shape of the layout (`()` per tensor, `(channels,)` per channel
    along `axis`), trained through the scale gradient of [`eqx_quant.fake_quant_float`][]. As for
    [`eqx_quant.LearnedFakeQuant`][], that gradient is multiplied by `1 / sqrt(numel * M)`, `numel` the number of
    elements sharing a scale and `M` the largest value of the format (the LSQ gradient scale, with `M` in place of
    the largest integer level); the forward value is unchanged. The forward pass uses
    `clip_passthrough(scale, min_scale, inf)`, so the scale in use is at least `min_scale` and a leaf pushed below it
    still receives gradients.

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

    scale: Float[Array, "*channels"]
    dtype: str = eqx.field(static=True)
    axis: int | tuple[int, ...] | None = eqx.field(static=True)
    min_scale: float = eqx.field(static=True)

    def __init__(
        self,
        dtype: str | type | np.dtype,
        scale: Real[ArrayLike, "*channels"],
        *,
        axis: int | tuple[int, ...] | None = None,
        min_scale: float = 1e-8,
    ):
        """**Arguments:**

        - `dtype`: the element format, as for [`eqx_quant.FloatFakeQuant`][].
        - `scale`: the initial scale: a positive scalar, or one per channel along `axis`. Stored as a float32 array.
        - `axis`: the channel axis (or axes) for a per-channel `scale`, or `None`.
        - `min_scale`: the smallest scale the forward pass uses; a positive, normal float32.
        """
        self.scale = jnp.asarray(scale, jnp.float32)
        self.dtype = _format_name(dtype)
        self.axis = Layout.of(axis).axis
        self.min_scale = check_real("min_scale", min_scale)

    def __check_init__(self):
        _check_scale_values("min_scale", [self.min_scale])
        axes = Layout.of(self.axis).axes
        if self.scale.ndim != len(axes):
            raise ValueError(
                f"`scale` must have {len(axes)} dimension(s) for axis={self.axis}, got shape {self.scale.shape}."
            )
        if not isinstance(self.scale, jax.core.Tracer):
            s = np.asarray(self.scale)
            if not np.all(np.isfinite(s) & (s > 0)):
                raise ValueError(f"`scale` must be finite and positive, got scale={s.tolist()!r}.")

    @property
    def layout(self) -> Layout:
        """Per tensor, or per channel along `axis`."""
        return Layout.of(self.axis)

    def _scale(self, x: Array) -> Array:
        """The scale in use, expanded against `x`, with the forward clip and the gradient scale."""
        layout = self.layout
        try:
            scale = layout.expand(self.scale, x.shape)
        except ValueError as error:
            raise ValueError(f"`scale` does not fit `x`: {error}") from None
        numel = layout.group_numel(x.shape)
        factor = 1.0 / math.sqrt(numel * _FORMATS[self.dtype].max) if numel else 1.0
        return scale_gradient(clip_passthrough(scale, self.min_scale, math.inf), factor)

    @classmethod
    def init_from(
        cls,
        x: Real[ArrayLike, "*shape"],
        dtype: str | type | np.dtype,
        *,
        axis: int | tuple[int, ...] | None = None,
        min_scale: float = 1e-8,
        stacked: int = 0,
    ) -> "LearnedFloatFakeQuant":
        """Initialises the scale from data: the scale [`eqx_quant.DynamicFloatFakeQuant`][] would use for `x`
        (`max|x| / M`, per tensor or per channel), at least `min_scale`.

        **Arguments:**

        - `x`: sample data (e.g. the weight it will quantize). Non-finite entries are ignored.
        - `dtype`: the element format, as for [`eqx_quant.FloatFakeQuant`][].
        - `axis`: the channel axis (or axes) for per-channel scales, or `None`.
        - `min_scale`: as for the constructor.
        - `stacked`: the number of leading axes of `x` along which whole tensors are stacked (the weight of a layer
            built with `eqx.filter_vmap`): the quantizer is made for one tensor and stacked like the layer, as
            [`eqx_quant.LearnedFakeQuant.init_from`][] does.

        **Returns:**

        A [`eqx_quant.LearnedFloatFakeQuant`][].
        """
        if check_int("stacked", stacked) < 0:
            raise ValueError(f"`stacked` must be a non-negative int, got stacked={stacked}.")
        name = _format_name(dtype)
        layout = Layout.of(axis)
        x = as_float_input("x", x)
        if x.ndim < stacked:
            raise ValueError(f"`stacked`={stacked} leading axes do not fit `x` of shape {x.shape}.")

        def init(w):
            if w.size == 0:
                raise ValueError(f"`x` is empty (shape {w.shape}): fitting a scale needs data.")
            scale = jnp.maximum(absmax_float_scale(w, layout, _FORMATS[name].max), min_scale)
            return cls(name, layout.compact(scale, w.shape), axis=layout.axis, min_scale=min_scale)

        for _ in range(stacked):
            init = eqx.filter_vmap(init)
        return init(x)


class MXFakeQuant(AbstractFloatQuantizer):
    """A quantizer onto an OCP Microscaling (MX v1.0) format: blocks of `block_size` contiguous elements along
    `axis` share a power-of-two scale (E8M0), computed from the block at every call.

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

    fmt: str = eqx.field(static=True)
    axis: int = eqx.field(static=True)
    block_size: int = eqx.field(static=True)
    scale_rule: str = eqx.field(static=True)

    def __init__(self, fmt: str, *, axis: int = -1, block_size: int = 32, scale_rule: str = "floor"):
        """**Arguments:**

        - `fmt`: `"mxfp8_e4m3"`, `"mxfp8_e5m2"`, `"mxfp6_e2m3"`, `"mxfp6_e3m2"` or `"mxfp4"`.
        - `axis`: the axis along which blocks are formed; negative values count from the end.
        - `block_size`: the number of elements sharing a scale (32 in the specification); it must divide the
            length of `axis` of every input.
        - `scale_rule`: `"floor"` (the specification's) or `"rceil"` (no element saturates).
        """
        self.fmt = fmt
        self.axis = check_int("axis", axis)
        self.block_size = check_int("block_size", block_size)
        self.scale_rule = scale_rule

    def __check_init__(self):
        if self.fmt not in _MX_ELEMENTS:
            raise ValueError(f"`fmt` must be one of {', '.join(map(repr, _MX_ELEMENTS))}, got fmt={self.fmt!r}.")
        if self.scale_rule not in ("floor", "rceil"):
            raise ValueError(f"`scale_rule` must be 'floor' or 'rceil', got scale_rule={self.scale_rule!r}.")
        if self.block_size < 1:
            raise ValueError(f"`block_size` must be >= 1, got block_size={self.block_size}.")

    def __call__(self, x: Float[Array, "*shape"], *, key: PRNGKeyArray | None = None) -> Float[Array, "*shape"]:
        """Fake-quantizes `x` to the MX format.

        **Arguments:**

        - `x`: a floating array with at least one axis; `block_size` divides the length of `axis`.
        - `key`: ignored; present for compatibility with the Equinox layer API.

        **Returns:**

        An array with the shape and dtype of `x`.
        """
        del key
        _check_float_input(x)
        with jax.named_scope("eqx_quant.MXFakeQuant"):
            return mx_fake_quant(
                x, self.fmt, axis=self.axis, block_size=self.block_size, scale_rule=self.scale_rule
            )  # fmt: skip

    def quantize(self, x: Float[Array, "*shape"]) -> FloatQuantizedTensor:
        _check_float_input(x)
        axis = _check_blocks(x, self.axis, self.block_size)
        return block_tensor(x, self.fmt, axis, self.block_size, self.scale_rule)


class NVFP4FakeQuant(AbstractFloatQuantizer):
    """A quantizer onto NVFP4: `float4_e2m1fn` elements in blocks of 16 along `axis`, each block with a
    `float8_e4m3fn` scale, under one float32 scale for the whole tensor, all computed from the input at every call.

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

    axis: int = eqx.field(static=True)

    def __init__(self, *, axis: int = -1):
        """**Arguments:**

        - `axis`: the axis along which blocks of 16 are formed; negative values count from the end.
        """
        self.axis = check_int("axis", axis)

    def __call__(self, x: Float[Array, "*shape"], *, key: PRNGKeyArray | None = None) -> Float[Array, "*shape"]:
        """Fake-quantizes `x` to NVFP4.

        **Arguments:**

        - `x`: a floating array with at least one axis; the length of `axis` is a multiple of 16.
        - `key`: ignored; present for compatibility with the Equinox layer API.

        **Returns:**

        An array with the shape and dtype of `x`.
        """
        del key
        _check_float_input(x)
        with jax.named_scope("eqx_quant.NVFP4FakeQuant"):
            return nvfp4_fake_quant(x, axis=self.axis)

    def quantize(self, x: Float[Array, "*shape"]) -> FloatQuantizedTensor:
        _check_float_input(x)
        axis = check_nvfp4_blocks(x, self.axis)
        return block_tensor(x, "nvfp4", axis, _NVFP4_BLOCK, None)


def quantizer_metadata(quantizer: AbstractFloatQuantizer) -> dict[str, Any]:
    """The configuration of a float quantizer as JSON values: what an exported file says of a layer's input
    quantizer."""
    kind = type(quantizer).__name__
    if isinstance(quantizer, FloatFakeQuant):
        return {"kind": kind, "dtype": quantizer.dtype, "scale": quantizer.scale, "axis": quantizer.axis}
    if isinstance(quantizer, DynamicFloatFakeQuant):
        return {"kind": kind, "dtype": quantizer.dtype, "axis": quantizer.axis}
    if isinstance(quantizer, LearnedFloatFakeQuant):
        scale = np.maximum(np.asarray(quantizer.scale), np.float32(quantizer.min_scale)).tolist()  # the scale in use
        return {"kind": kind, "dtype": quantizer.dtype, "scale": scale, "axis": quantizer.axis}
    if isinstance(quantizer, MXFakeQuant):
        rule = quantizer.scale_rule
        return {"kind": kind, "format": quantizer.fmt, "axis": quantizer.axis, "block_size": quantizer.block_size,
                "scale_rule": rule}  # fmt: skip
    if isinstance(quantizer, NVFP4FakeQuant):
        return {"kind": kind, "format": "nvfp4", "axis": quantizer.axis, "block_size": _NVFP4_BLOCK}
    raise TypeError(f"`quantizer` must be a float quantizer, got {quantizer!r}.")
