"""Which elements of a tensor share a scale: channel axes, tiles of a size along an axis (groups and the blocks of the
MX and NVFP4 formats), leading stacked axes."""

from typing import NamedTuple

from jaxtyping import Array

from ._misc import check_int


class Layout(NamedTuple):
    """How the scales of a quantizer cover a tensor: which elements share one scale (and zero point).

    - `axes`: channel axes; every index along them has its own scale (negative axes count from the end).
    - `group_size`: if set, axis `group_axis` is cut into contiguous tiles of this many elements (the groups of an
        integer weight, the blocks of an MX or NVFP4 format), and every tile of every index of the other axes has its
        own scale.
    - `stacked`: the number of leading axes along which whole tensors are stacked (layers built with
        `eqx.filter_vmap` and run with `jax.lax.scan`): every index along them has its own scales.
    - `group_axis`: the axis that `group_size` tiles; the last by default (negative axes count from the end).

    With none of them, one scale covers the whole tensor. A tensor is seen through its *view*: its shape, or with
    the tiled axis of length `n` split into `(n // group_size, group_size)` in place. Scales broadcast against the
    view, with unit axes where they are shared ([`eqx_quant.Layout.expand`][]); their compact shape
    ([`eqx_quant.Layout.scale_shape`][]) drops those unit axes.
    """

    axes: tuple[int, ...] = ()
    group_size: int | None = None
    stacked: int = 0
    group_axis: int = -1

    @classmethod
    def of(
        cls,
        axis: int | tuple[int, ...] | None = None,
        group_size: int | None = None,
        stacked: int = 0,
        group_axis: int = -1,
    ) -> "Layout":
        """A layout from the arguments quantizers take, checked: `axis` an int, a tuple of ints or `None`,
        `group_size` a positive int or `None`, `stacked` a non-negative int, `group_axis` an int."""
        if axis is None:
            axes = ()
        elif isinstance(axis, tuple):
            axes = tuple(check_int("axis", a) for a in axis)
        else:
            axes = (check_int("axis", axis),)
        if len(set(axes)) != len(axes):
            raise ValueError(f"`axis` names an axis twice, got axis={axis!r}.")
        if group_size is not None and check_int("group_size", group_size) < 1:
            raise ValueError(f"`group_size` must be a positive int, got group_size={group_size}.")
        if check_int("stacked", stacked) < 0:
            raise ValueError(f"`stacked` must be a non-negative int, got stacked={stacked}.")
        group_axis = check_int("group_axis", group_axis)
        return cls(axes, None if group_size is None else int(group_size), int(stacked), group_axis)

    @property
    def axis(self) -> int | tuple[int, ...] | None:
        """The channel axes as quantizers take them: `None`, one int, or a tuple of ints."""
        return None if not self.axes else self.axes[0] if len(self.axes) == 1 else self.axes

    def tile_axis(self, shape: tuple[int, ...]) -> int | None:
        """The tiled axis as a non-negative index into `shape` (`None` without tiles), checked against it."""
        if self.group_size is None:
            return None
        ndim = len(shape)
        if ndim <= self.stacked:
            raise ValueError(f"`group_size` needs an axis to tile beyond the stacked ones, got shape {shape}.")
        if not -ndim <= self.group_axis < ndim:
            raise ValueError(
                f"`group_axis` must be in [{-ndim}, {ndim}) for an input of rank {ndim}, got group_axis="
                f"{self.group_axis}."
            )
        axis = self.group_axis % ndim
        if axis < self.stacked:
            raise ValueError(f"`group_axis`={self.group_axis} names a stacked axis of shape {shape}.")
        if shape[axis] % self.group_size:
            where = "the last axis" if axis == ndim - 1 else f"axis {self.group_axis}"
            raise ValueError(
                f"`group_size`={self.group_size} does not divide {where} of `x`, of size {shape[axis]} (shape {shape})."
            )
        return axis

    def channel_axes(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        """The channel axes as non-negative indices into `shape`, checked against it."""
        ndim = len(shape)
        normalized = []
        for axis in self.axes:
            if not -ndim <= axis < ndim:
                raise ValueError(f"`axis` must be in [{-ndim}, {ndim}) for an input of rank {ndim}, got axis={axis}.")
            normalized.append(axis % ndim)
        if len(set(normalized)) != len(normalized):
            raise ValueError(f"`axis`={self.axis!r} names an axis twice for an input of rank {ndim}.")
        if self.stacked > ndim:
            raise ValueError(f"`stacked`={self.stacked} leading axes do not fit an input of shape {shape}.")
        if any(a < self.stacked for a in normalized):
            raise ValueError(f"`axis`={self.axis!r} names a stacked axis (the first {self.stacked}) of shape {shape}.")
        tile = self.tile_axis(shape)
        if tile is not None and tile in normalized:
            raise ValueError(
                f"`axis` must not be the tiled axis when `group_size` is given, got axis={self.axis!r} and "
                f"group_axis={self.group_axis} for an input of rank {ndim}."
            )
        return tuple(normalized)

    def view_shape(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        """The shape against which scales broadcast: `shape`, or with the tiled axis split into tiles."""
        self.channel_axes(shape)
        tile = self.tile_axis(shape)
        if tile is None:
            return tuple(shape)
        assert self.group_size is not None
        return (*shape[:tile], shape[tile] // self.group_size, self.group_size, *shape[tile + 1 :])

    def view(self, x: Array) -> Array:
        """`x` reshaped to [`eqx_quant.Layout.view_shape`][]."""
        return x.reshape(self.view_shape(x.shape))

    def _kept(self, shape: tuple[int, ...]) -> tuple[bool, ...]:
        """For each axis of the view, whether scales vary along it."""
        tile = self.tile_axis(shape)
        if tile is not None:
            return tuple(i != tile + 1 for i in range(len(shape) + 1))
        channels = self.channel_axes(shape)
        return tuple(i < self.stacked or i in channels for i in range(len(shape)))

    def reduction_axes(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        """The axes of the view over which the elements sharing a scale lie (statistics reduce over them)."""
        return tuple(i for i, kept in enumerate(self._kept(shape)) if not kept)

    def scale_shape(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        """The compact shape of the scales for a tensor of `shape`."""
        view = self.view_shape(shape)
        return tuple(n for n, kept in zip(view, self._kept(shape), strict=True) if kept)

    def broadcast_shape(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        """The shape of scales that broadcast against the view: the view's, with unit axes where scales are shared."""
        view = self.view_shape(shape)
        return tuple(n if kept else 1 for n, kept in zip(view, self._kept(shape), strict=True))

    def expand(self, scale: Array, shape: tuple[int, ...]) -> Array:
        """Compact scales (of [`eqx_quant.Layout.scale_shape`][]) reshaped to broadcast against the view."""
        expected = self.scale_shape(shape)
        if tuple(scale.shape) != expected:
            raise ValueError(
                f"Scales of shape {tuple(scale.shape)} do not fit an input of shape {tuple(shape)}, which needs scales "
                f"of shape {expected} for axis={self.axis!r}, group_size={self.group_size!r}, stacked={self.stacked}"
                + ("." if self.group_size is None else f", group_axis={self.group_axis}.")
            )
        return scale.reshape(self.broadcast_shape(shape))

    def compact(self, scale: Array, shape: tuple[int, ...]) -> Array:
        """Scales that broadcast against the view (with unit axes where they are shared) in their compact shape."""
        return scale.reshape(self.scale_shape(shape))

    def group_numel(self, shape: tuple[int, ...]) -> int:
        """The number of elements that share one scale."""
        view = self.view_shape(shape)
        size = 1
        for axis in self.reduction_axes(shape):
            size *= view[axis]
        return size

    def is_per_tensor(self) -> bool:
        """Whether one scale covers each (stacked) tensor."""
        return not self.axes and self.group_size is None
