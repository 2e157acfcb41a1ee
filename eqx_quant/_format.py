"""Number formats: the grid each element is rounded onto, and how the scales that map a tensor onto it are stored.

A [`eqx_quant.Format`][] is an element grid (integers `[qmin, qmax]`, or a low-precision float) and a scale format:
float32 scales, power-of-two E8M0 scales (the OCP Microscaling formats) or `float8_e4m3fn` scales under a float32
tensor scale (NVFP4). Everything a format does to numbers lives here: rounding onto the grid, the reciprocal and the
application of its scales, and the codes it is stored as. Every operation is written with exact float32 arithmetic
(powers of two built from bit patterns, no logarithms), so that every backend and every path rounds alike.
"""

import abc
import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from jaxtyping import Array

from ._misc import check_int, expand_to_rank, lookup


SCALE_FORMATS = ("float32", "e8m0", "e4m3", "float16")
"""How a format's scales are stored: `"float32"` (any positive float32), `"e8m0"` (a power of two `2**e`,
`-127 <= e <= 127`, one byte), `"e4m3"` (a non-negative `float8_e4m3fn` value, one byte, times a float32 scale of the
whole tensor), `"float16"` (the `d` of the GGML block formats: a float32 scale, of either sign, that divides the
values onto the grid and is stored, and multiplies the levels back, rounded to float16)."""

SCALE_RULES = ("floor", "rceil")
FLOAT16_SCALE_RULES = ("absmax", "signed_max")
ROUNDINGS = ("half_even", "half_away", "shifted_trunc")
"""How an integer grid rounds `v = x / scale`: `"half_even"` (to the nearest integer, halves to even),
`"half_away"` (halves away from zero, C's `roundf`: GGML's Q8_0), `"shifted_trunc"` (`trunc(v - qmin + 0.5)` computed
in float32, then `+ qmin`: GGML's Q4_0 and Q5_0, which round halves up and, through the float32 sum, values within
half a float32 step below a half too)."""

_E8M0_NAN = 0xFF
_INT32_MIN, _INT32_MAX = -(2**31), 2**31 - 1


def int_range(bits: int | np.integer, *, signed: bool = True, narrow: bool = False) -> tuple[int, int]:
    """The integer grid `(qmin, qmax)` of a `bits`-bit integer.

    **Arguments:**

    - `bits`: the bit width; 2 to 16 for signed grids, 1 to 16 for unsigned ones.
    - `signed`: two's complement range `[-2^(bits-1), 2^(bits-1) - 1]` if `True`, else `[0, 2^bits - 1]`.
    - `narrow`: drop the most negative value of a signed range, so that it is symmetric about zero:
        `[-(2^(bits-1) - 1), 2^(bits-1) - 1]`. Only meaningful for signed ranges.

    **Returns:**

    A tuple of Python ints `(qmin, qmax)`, both inclusive.

    **Raises:**

    `TypeError` if `bits` is not an int (bools are rejected); `ValueError` if `bits` is out of range or `narrow=True`
    is asked for an unsigned range.

    !!! example

        ```python
        import eqx_quant

        assert eqx_quant.int_range(8) == (-128, 127)
        assert eqx_quant.int_range(8, narrow=True) == (-127, 127)
        assert eqx_quant.int_range(8, signed=False) == (0, 255)
        assert eqx_quant.int_range(4) == (-8, 7)
        ```
    """
    bits = check_int("bits", bits)
    if not isinstance(signed, bool):
        raise TypeError(f"`signed` must be a bool, got {signed!r}.")
    if not isinstance(narrow, bool):
        raise TypeError(f"`narrow` must be a bool, got {narrow!r}.")
    if signed:
        if not 2 <= bits <= 16:
            raise ValueError(f"`bits` must be between 2 and 16 for a signed range, got {bits}.")
        half = 2 ** (bits - 1)
        return (-half + 1 if narrow else -half), half - 1
    if narrow:
        raise ValueError("`narrow` applies to signed ranges only, got narrow=True with signed=False.")
    if not 1 <= bits <= 16:
        raise ValueError(f"`bits` must be between 1 and 16 for an unsigned range, got {bits}.")
    return 0, 2**bits - 1


def check_range(qmin: object, qmax: object) -> tuple[int, int]:
    """Validates an integer grid and returns it as Python ints."""
    qmin = check_int("qmin", qmin)
    qmax = check_int("qmax", qmax)
    for name, value in (("qmin", qmin), ("qmax", qmax)):
        if not _INT32_MIN <= value <= _INT32_MAX:
            raise ValueError(f"`{name}` must be an int32, in [{_INT32_MIN}, {_INT32_MAX}], got {name}={value}.")
    if qmin > qmax:
        raise ValueError(f"`qmin` must be <= `qmax`, got qmin={qmin} and qmax={qmax}.")
    return qmin, qmax


def int_dtype(lo: int, hi: int) -> np.dtype:
    """The narrowest of int8, int16 and int32 that holds every integer in `[lo, hi]`."""
    for dtype in (np.int8, np.int16, np.int32):
        info = np.iinfo(dtype)
        if info.min <= lo and hi <= info.max:
            return np.dtype(dtype)
    raise ValueError(f"The integer range [{lo}, {hi}] does not fit in int32.")


#
# Exact arithmetic on the bits of the compute dtype (float32, or float64 when enabled).
#


def _int_for(dtype: np.dtype) -> type:
    return jnp.int32 if jnp.finfo(dtype).bits == 32 else jnp.int64


def exponent(a: Array) -> Array:
    """`floor(log2(a))` for a normal `a >= 0`, as an integer array; zeros and subnormals give the exponent just below
    the smallest normal (-127 in float32). Meaningless for NaN and inf."""
    info = jnp.finfo(a.dtype)
    itype = _int_for(a.dtype)
    bits = jax.lax.bitcast_convert_type(a, itype)
    return jax.lax.shift_right_logical(bits, jnp.asarray(info.nmant, itype)) - (info.maxexp - 1)


def pow2(n: Array, dtype: np.dtype) -> Array:
    """`2.0 ** n`, exactly, for integers `n` in the normal range of `dtype` (`n` one below it gives 0)."""
    info = jnp.finfo(dtype)
    itype = _int_for(dtype)
    return jax.lax.bitcast_convert_type(
        jax.lax.shift_left(n.astype(itype) + (info.maxexp - 1), jnp.asarray(info.nmant, itype)), dtype
    )


def divide(a: Array, b: Array | float | int) -> Array:
    """`a / b`, correctly rounded on every path. XLA turns a division by a scalar (a constant, or a broadcast one)
    into a multiplication by its reciprocal, which differs in the last bit for some values, and under `jax.vmap` an
    unmapped divisor is broadcast. So the divisor enters at the shape (and mapping) of `a`, computed from `a` (`a * 0`
    is 0 for the finite `a` this is used on), behind an optimization barrier that keeps XLA from seeing through it."""
    divisor = jax.lax.optimization_barrier(a * jnp.zeros((), a.dtype) + jnp.asarray(b, a.dtype))
    return a / divisor


#
# The formats.
#


class Format(abc.ABC):
    """A number format: an element grid and the way its scales are stored.

    Formats are immutable and hashable (quantizers keep them as static configuration). Make them with
    [`eqx_quant.int_format`][], [`eqx_quant.float_format`][], [`eqx_quant.stretched_format`][] or by name with
    [`eqx_quant.format_named`][]:

    | name | elements | scales |
    |---|---|---|
    | `"int8"`, `"int4"`, ..., `"uint8"`, ... | integers `[qmin, qmax]` | float32 (with an optional zero point) |
    | `"int2_narrow_wide"`, ... | integers, gradients half a step beyond the ends | float32 |
    | `"int2_stretched"`, ... | half-integers `q + 1/2` (see [`eqx_quant.stretched_format`][]) | float32 |
    | `"float8_e4m3fn"`, `"float8_e5m2"`, `"float6_e2m3fn"`, `"float6_e3m2fn"`, `"float4_e2m1fn"` | floats | float32 |
    | `"mxfp8_e4m3"`, `"mxfp8_e5m2"`, `"mxfp6_e2m3"`, `"mxfp6_e3m2"`, `"mxfp4"`, `"mxint8"` | as named | E8M0 |
    | `"nvfp4"` | `float4_e2m1fn` | `float8_e4m3fn` blocks times a float32 tensor scale |
    | `"q8_0"`, `"q4_0"`, `"q5_0"` | integers `[-127, 127]`, `[-8, 7]`, `[-16, 15]` | float16 (GGML's `d`) |

    The MX formats, NVFP4 and the GGML formats need block scales: a [`eqx_quant.Layout`][] with `group_size` (32 in
    the MX specification and in GGUF files, 16 for NVFP4) along the axis a product contracts.

    Every format rounds `v = x / scale` to the nearest point of its grid (halves to even), saturating at its ends:
    for integers `clip(round(v) + zero_point, qmin, qmax)`, for floats the value of a saturating cast to the element
    type. `x / scale` is `x * (1 / scale)`, with the reciprocal taken on the scales.

    The GGML formats round as llama.cpp's reference quantizers (`gguf.quants.quantize`) do, bit for bit: Q8_0 takes
    `d = max|x| / 127` and rounds halves away from zero; Q4_0 and Q5_0 take `d = m / qmin` (`m` the block's first
    element of largest magnitude, with its sign: `d` is negative when `m` is positive) and the levels
    `trunc(v - qmin + 1/2) + qmin` with that sum rounded to float32. The levels are computed with the float32 `d`,
    the values with `d` rounded to float16 (as it is stored). Their gradients pass where the rounding does not
    saturate: `v` within half a step beyond the grid's ends.
    """

    scale: str
    scale_rule: str | None

    @property
    @abc.abstractmethod
    def name(self) -> str:
        """The format's name, as [`eqx_quant.format_named`][] reads it."""

    @property
    @abc.abstractmethod
    def bits(self) -> int:
        """The width of one element (before any scales)."""

    @property
    @abc.abstractmethod
    def bound(self) -> int | float:
        """The grid point a symmetric scale maps the largest magnitude to: `qmax` (or `-qmin` on a grid without
        positive levels), or the largest finite value of a float format."""

    @property
    @abc.abstractmethod
    def largest(self) -> int | float:
        """The largest magnitude of a grid point."""

    @property
    @abc.abstractmethod
    def lsq_level(self) -> int | float:
        """The level in the LSQ gradient scale `1 / sqrt(numel * level)` of a learned scale."""

    @abc.abstractmethod
    def nearest(self, v: Array) -> Array:
        """`v` rounded to the nearest grid point, halves to even, without saturating (`v` lies in the range)."""

    @abc.abstractmethod
    def levels(self, v: Array, zero_point: Array | None) -> Array:
        """The grid points of `v = x / scale` (plus the zero point of an integer grid), saturated at the grid's ends,
        as floats of `v`'s dtype. NaN stays NaN."""

    @abc.abstractmethod
    def limits(self, zero_point: Array | None, ndim: int) -> tuple:
        """`(low, high)`: the range of `v` that lies inside the grid (where gradients pass), the zero point expanded
        to rank `ndim`."""

    def ends(self, zero_point: Array | None, ndim: int) -> tuple:
        """`(low, high)`: the levels (minus the zero point) that `v` below and above `limits` saturates to. The
        limits themselves, but for the GGML roundings, whose limits lie half a step beyond their ends."""
        return self.limits(zero_point, ndim)

    @abc.abstractmethod
    def encode(self, levels: Array) -> Array:
        """The stored codes of `levels` (from `levels`), one per element."""

    @abc.abstractmethod
    def decode(self, codes: Array, dtype: np.dtype) -> Array:
        """The levels of stored `codes`, as floats of `dtype`."""

    @property
    @abc.abstractmethod
    def packed_width(self) -> int | None:
        """The width at which codes are packed into bytes (2, 3 or 4), or `None` for one code per byte or more."""

    @property
    def zero_points(self) -> bool:
        """Whether the format takes a zero point (integer grids with float32 scales do)."""
        return False

    @property
    def signed_codes(self) -> bool:
        """Whether packed codes are read as two's complement."""
        return False

    def __repr__(self) -> str:
        return f"Format({self.name!r})"

    def to_json(self) -> dict:
        """The format's fields, as JSON values: what files record of it."""
        return {"kind": type(self).__name__, **dataclasses.asdict(self)}  # pyright: ignore[reportArgumentType]


def _check_scale(fmt: Format) -> None:
    if fmt.scale not in SCALE_FORMATS:
        raise ValueError(f"`scale` must be one of {SCALE_FORMATS}, got scale={fmt.scale!r}.")
    if (fmt.scale in ("e8m0", "float16")) != (fmt.scale_rule is not None):
        raise ValueError(f"`scale_rule` is given exactly for E8M0 and float16 scales, got scale={fmt.scale!r} and "
                         f"scale_rule={fmt.scale_rule!r}.")  # fmt: skip
    rules = FLOAT16_SCALE_RULES if fmt.scale == "float16" else SCALE_RULES
    if fmt.scale_rule is not None and fmt.scale_rule not in rules:
        raise ValueError(f"`scale_rule` must be one of {rules} for {fmt.scale} scales, got "
                         f"scale_rule={fmt.scale_rule!r}.")  # fmt: skip


@dataclasses.dataclass(frozen=True, repr=False)
class IntFormat(Format):
    """Integers in `[qmin, qmax]`: see [`eqx_quant.int_format`][]. `scale` says how the scales are stored
    (`"float32"`, `"e8m0"`, or `"float16"` for the GGML formats), `scale_rule` how E8M0 and float16 scales are chosen
    from a block, and `rounding` how `x / scale` is rounded (`"half_even"`; GGML's `"half_away"` and
    `"shifted_trunc"`, with float16 scales only). `window` is where gradients pass: `"levels"`, between the grid's
    ends (the clipped straight-through estimator of LSQ), or `"rounding"`, wherever rounding does not saturate, half
    a step beyond the ends (ParetoQ's, for its ternary grid; float32 scales without zero points only; the name gains
    `_wide`: `"int2_narrow_wide"`)."""

    qmin: int
    qmax: int
    scale: str = "float32"
    scale_rule: str | None = None
    rounding: str = "half_even"
    window: str = "levels"

    def __post_init__(self):
        object.__setattr__(self, "qmin", check_range(self.qmin, self.qmax)[0])
        object.__setattr__(self, "qmax", int(self.qmax))
        _check_scale(self)
        if self.scale == "e4m3":
            raise ValueError("`scale`='e4m3' (NVFP4's two-level scales) takes float elements only.")
        if self.rounding not in ROUNDINGS:
            raise ValueError(f"`rounding` must be one of {ROUNDINGS}, got rounding={self.rounding!r}.")
        if (self.rounding != "half_even") != (self.scale == "float16"):
            raise ValueError(f"`rounding`={self.rounding!r} goes with float16 scales (the GGML block formats) and "
                             f"'half_even' with the others, got scale={self.scale!r}.")  # fmt: skip
        if self.scale == "float16" and not self.qmin < 0 < self.qmax:
            raise ValueError(f"float16 scales take a signed grid, got [{self.qmin}, {self.qmax}].")
        if self.window not in ("levels", "rounding"):
            raise ValueError(f"`window` must be 'levels' or 'rounding', got window={self.window!r}.")
        if self.window == "rounding" and self.scale != "float32":
            raise ValueError(f"`window`='rounding' takes float32 scales, got scale={self.scale!r}.")

    @property
    def name(self) -> str:
        grid = f"int[{self.qmin}, {self.qmax}]"
        kinds = ((True, False, "int", ""), (True, True, "int", "_narrow"), (False, False, "uint", ""))
        for bits in range(1, 17):
            for signed, narrow, prefix, suffix in kinds:
                if (bits >= 2 or not signed) and int_range(bits, signed=signed, narrow=narrow) == self.grid:
                    grid = f"{prefix}{bits}{suffix}"
        if self.scale == "float32":
            return grid + ("_wide" if self.window == "rounding" else "")
        if self.scale == "float16":
            known = {fmt: name for name, fmt in GGML_FORMATS.items()}
            return known.get(self, f"{grid} with float16 scales ({self.scale_rule}, {self.rounding})")
        rule = "" if self.scale_rule == "floor" else f"_{self.scale_rule}"
        return f"mxint8{rule}" if grid == "int8_narrow" else f"{grid} with e8m0 scales ({self.scale_rule})"

    @property
    def grid(self) -> tuple[int, int]:
        """`(qmin, qmax)`."""
        return self.qmin, self.qmax

    @property
    def bits(self) -> int:
        if self.qmin < 0:
            return max((-self.qmin - 1).bit_length(), self.qmax.bit_length()) + 1
        return max(self.qmax.bit_length(), 1)

    @property
    def bound(self) -> int | float:
        return self.qmax if self.qmax > 0 else max(-self.qmin, 1)

    @property
    def largest(self) -> int | float:
        return max(-self.qmin, self.qmax)

    @property
    def lsq_level(self) -> int | float:
        return max(self.qmax, 1)

    @property
    def zero_points(self) -> bool:
        return self.scale == "float32" and self.window == "levels"

    @property
    def signed_codes(self) -> bool:
        return self.qmin < 0

    def nearest(self, v: Array) -> Array:
        if self.rounding == "half_even" and self.window == "levels":
            return jnp.round(v)
        return self.levels(v, None)  # asked inside the limits: half a step beyond the ends, this saturates

    def levels(self, v: Array, zero_point: Array | None) -> Array:
        if self.rounding == "half_away":
            r = jax.lax.round(v, jax.lax.RoundingMethod.AWAY_FROM_ZERO)
            r = jax.lax.clamp(np.asarray(self.qmin, r.dtype), r, np.asarray(self.qmax, r.dtype))
            return jnp.where(r == 0, jnp.zeros((), r.dtype), r)  # +0 for -0: an integer has no signed zero
        if self.rounding == "shifted_trunc":
            return self._shifted_trunc(v)
        # `jax.lax` directly (what `jnp.round` and `jnp.clip` call): the hottest lines of every quantizer.
        r = jax.lax.round(v, jax.lax.RoundingMethod.TO_NEAREST_EVEN)
        if zero_point is not None:
            r = r + expand_to_rank(zero_point, v.ndim)
        return jax.lax.clamp(np.asarray(self.qmin, r.dtype), r, np.asarray(self.qmax, r.dtype))

    def _shifted_trunc(self, v: Array) -> Array:
        # `clip(trunc(v + c), 0, qmax - qmin) + qmin` with `c = 0.5 - qmin` and the sum rounded to float32, computed
        # as the number of thresholds `v` reaches (`t_k` the least float32 whose sum reaches `k`), so that no sum
        # follows the product that made `v`: XLA contracts such a pair into a fused multiply-add under `jit` (on CPU
        # and GPU), which rounds once where GGML rounds twice.
        count = jnp.zeros(v.shape, v.dtype)
        one = jnp.ones((), v.dtype)
        zero = jnp.zeros((), v.dtype)
        for t in _shifted_thresholds(self.qmin, self.qmax)[:-1]:
            count = count + jnp.where(v >= t, one, zero)
        return jnp.where(jnp.isnan(v), v, count + self.qmin)

    def limits(self, zero_point: Array | None, ndim: int) -> tuple:
        if self.rounding == "half_away":  # the open range (qmin - 1/2, qmax + 1/2), as float32 ends
            return _next_float32(self.qmin - 0.5, up=True), _next_float32(self.qmax + 0.5)
        if self.rounding == "shifted_trunc":  # from the sum 0 up to the last float32 whose sum stays below the top
            return float(self.qmin - 0.5), _next_float32(_shifted_thresholds(self.qmin, self.qmax)[-1])
        if self.window == "rounding":  # no zero point: half a step beyond the ends
            return self.qmin - 0.5, self.qmax + 0.5
        # The exact integers `qmin - zero_point` and `qmax - zero_point`, compared with `v`: a sum `v + zero_point`
        # would be contracted into a fused multiply-add under `jit` only, and round differently there.
        zp = 0 if zero_point is None else expand_to_rank(zero_point, ndim)
        return self.qmin - zp, self.qmax - zp

    def ends(self, zero_point: Array | None, ndim: int) -> tuple:
        if self.rounding == "half_even" and self.window == "levels":
            return self.limits(zero_point, ndim)
        return self.qmin, self.qmax

    def encode(self, levels: Array) -> Array:
        return levels.astype(int_dtype(self.qmin, self.qmax))

    def decode(self, codes: Array, dtype: np.dtype) -> Array:
        return codes.astype(dtype)

    @property
    def packed_width(self) -> int | None:
        for bits in (2, 3, 4):
            half = 1 << (bits - 1)
            if (-half <= self.qmin and self.qmax < half) if self.qmin < 0 else self.qmax < 2 * half:
                return bits
        return None


@dataclasses.dataclass(frozen=True, repr=False)
class StretchedFormat(Format):
    """The `2**bits` half-integers `q + 1/2`, `q` in `[-2**(bits-1), 2**(bits-1) - 1]`, with float32 scales: see
    [`eqx_quant.stretched_format`][]."""

    width: int
    scale: str = "float32"
    scale_rule: str | None = None

    def __post_init__(self):
        if isinstance(self.width, bool) or not isinstance(self.width, (int, np.integer)):
            raise TypeError(f"`bits` must be an int in [1, 8], got bits={self.width!r}.")  # `width` is `bits`
        if not 1 <= self.width <= 8:
            raise ValueError(f"`bits` must be an int in [1, 8], got bits={self.width!r}.")
        object.__setattr__(self, "width", int(self.width))
        if self.scale != "float32" or self.scale_rule is not None:
            raise ValueError(
                f"A stretched grid takes float32 scales and no scale rule, got scale={self.scale!r} and "
                f"scale_rule={self.scale_rule!r}."
            )

    @property
    def name(self) -> str:
        return f"int{self.width}_stretched"

    @property
    def bits(self) -> int:
        return self.width

    @property
    def qmin(self) -> int:
        """The lowest code `q` (the level `qmin + 1/2`)."""
        return -(1 << (self.width - 1))

    @property
    def qmax(self) -> int:
        """The highest code `q` (the level `qmax + 1/2`)."""
        return (1 << (self.width - 1)) - 1

    @property
    def bound(self) -> float:
        return self.qmax + 0.5

    largest = bound
    lsq_level = bound

    @property
    def signed_codes(self) -> bool:
        return True

    def _codes(self, v: Array) -> Array:
        # The nearest half-integer `q + 1/2` of `v` is `q = floor(v)`; at a tie (`v` an integer) the even `q`. No sum
        # follows the product that made `v` (`round(v - 1/2)` would be contracted into a fused multiply-add under
        # `jit`, and round differently there).
        q = jnp.floor(v)
        odd = jnp.remainder(q, 2) == 1
        return jnp.where((v == q) & odd, q - 1, q)

    def nearest(self, v: Array) -> Array:
        return self.levels(v, None)  # asked inside the limits: half a step beyond the ends, this saturates

    def levels(self, v: Array, zero_point: Array | None) -> Array:
        del zero_point
        q = jax.lax.clamp(np.asarray(self.qmin, v.dtype), self._codes(v), np.asarray(self.qmax, v.dtype))
        return q + 0.5

    def limits(self, zero_point: Array | None, ndim: int) -> tuple:
        # Gradients pass wherever rounding does not saturate: half a step beyond the outermost levels (ParetoQ's
        # window for this grid).
        del zero_point, ndim
        return float(self.qmin), float(self.qmax + 1)

    def ends(self, zero_point: Array | None, ndim: int) -> tuple:
        del zero_point, ndim
        return -self.bound, self.bound

    def encode(self, levels: Array) -> Array:
        return jnp.floor(levels).astype(jnp.int8)

    def decode(self, codes: Array, dtype: np.dtype) -> Array:
        return codes.astype(dtype) + np.asarray(0.5, dtype)

    @property
    def packed_width(self) -> int | None:
        return max(self.width, 2) if self.width <= 4 else None


def _next_float32(value: float, up: bool = False) -> float:
    """The float32 just below the float32 `value` (just above it with `up`)."""
    return float(np.nextafter(np.float32(value), np.float32(np.inf if up else -np.inf)))


@functools.cache
def _shifted_thresholds(qmin: int, qmax: int) -> tuple[float, ...]:
    """For `k = 1 ... qmax - qmin + 1`: the least float32 `v` whose float32 sum `v + (0.5 - qmin)` is at least `k`,
    found with NumPy's float32 arithmetic (the sum is monotone in `v`, so the `v` that reach `k` are those from it
    on)."""
    shift = np.float32(0.5 - qmin)
    out = []
    for k in range(1, qmax - qmin + 2):
        v = np.float32(k) - shift  # exact: a half-integer of a few bits
        while np.float32(np.nextafter(v, np.float32(-np.inf))) + shift >= k:
            v = np.nextafter(v, np.float32(-np.inf))
        out.append(float(v))
    return tuple(out)


def integer_grid_of(fmt: Format) -> IntFormat:
    """`fmt`, checked to be an integer grid (an `AttributeError` otherwise: what asking for its `qmin` raises)."""
    if not isinstance(fmt, IntFormat):
        raise AttributeError(f"{fmt} is not an integer grid: it has no `qmin` and `qmax`.")
    return fmt


_ELEMENTS = ("float8_e4m3fn", "float8_e5m2", "float6_e2m3fn", "float6_e3m2fn", "float4_e2m1fn")


@functools.cache
def _table(element: str) -> np.ndarray:
    """The value of every code of `element` (NaN for NaN codes), indexed by the code, as float64."""
    dtype = getattr(ml_dtypes, element)
    return np.arange(2 ** ml_dtypes.finfo(dtype).bits, dtype=np.uint8).view(dtype).astype(np.float64)


@dataclasses.dataclass(frozen=True, repr=False)
class FloatFormat(Format):
    """Low-precision floats of the `ml_dtypes` type `element`: see [`eqx_quant.float_format`][]."""

    element: str
    scale: str = "float32"
    scale_rule: str | None = None

    def __post_init__(self):
        if self.element not in _ELEMENTS:
            raise ValueError(f"`dtype` must be one of {', '.join(_ELEMENTS)} (or its name), got {self.element!r}.")
        _check_scale(self)
        if self.scale == "e4m3" and self.element != "float4_e2m1fn":
            raise ValueError(f"`scale`='e4m3' (NVFP4) takes float4_e2m1fn elements, got {self.element!r}.")

    @functools.cached_property
    def _info(self):
        return ml_dtypes.finfo(getattr(ml_dtypes, self.element))

    @property
    def name(self) -> str:
        if self.scale == "float32":
            return self.element
        if self.scale == "e4m3":
            return "nvfp4"
        short = {v: k for k, v in _MX_ELEMENTS.items()}[self.element]
        return short if self.scale_rule == "floor" else f"{short}_rceil"

    @property
    def bits(self) -> int:
        return int(self._info.bits)

    @property
    def nmant(self) -> int:
        """Explicit mantissa bits."""
        return int(self._info.nmant)

    @property
    def emin(self) -> int:
        """The exponent of the smallest normal number."""
        return int(math.log2(float(self._info.smallest_normal)))

    @property
    def emax(self) -> int:
        """The exponent of the largest normal number."""
        return math.frexp(float(self._info.max))[1] - 1

    @property
    def bound(self) -> int | float:
        return float(self._info.max)

    largest = bound
    lsq_level = bound

    @property
    def has_nan(self) -> bool:
        """Whether the element type has a NaN code (the 8-bit types do; the 6- and 4-bit ones do not)."""
        return bool(np.isnan(_table(self.element)).any())

    def nearest(self, v: Array) -> Array:
        # The grid step around `a` is 2**(k - nmant), with k the exponent of `a`, or `emin` among subnormals.
        a = jnp.abs(v)
        step = jnp.maximum(exponent(a), self.emin) - self.nmant
        return jnp.copysign(jnp.round(a * pow2(-step, a.dtype)) * pow2(step, a.dtype), v)

    def levels(self, v: Array, zero_point: Array | None) -> Array:
        del zero_point
        return self.nearest(jnp.clip(v, -self.bound, self.bound))

    def limits(self, zero_point: Array | None, ndim: int) -> tuple:
        del zero_point, ndim
        return -self.bound, self.bound

    def encode(self, levels: Array) -> Array:
        """The bit patterns of an `ml_dtypes` cast of `levels` (points of the grid, or NaN), as `uint8`, computed
        exactly from the bits of `levels`."""
        bits = self.bits
        a = jnp.abs(levels)
        k = jnp.maximum(exponent(a), self.emin)
        normal = a >= 2.0**self.emin
        # On the grid, `a * 2**(nmant - k)` is an integer: the significand with its leading bit for normal numbers.
        significand = (a * pow2(self.nmant - k, a.dtype)).astype(jnp.int32)
        mantissa = significand - jnp.where(normal, 1 << self.nmant, 0)
        exp = jnp.where(normal, k.astype(jnp.int32) - self.emin + 1, 0)
        sign = jnp.signbit(levels).astype(jnp.int32)
        code = (sign << (bits - 1)) | (exp << self.nmant) | mantissa
        return jnp.where(jnp.isnan(levels), self.nan_code, code).astype(jnp.uint8)

    def decode(self, codes: Array, dtype: np.dtype) -> Array:
        return lookup(jnp.asarray(_table(self.element), dtype), codes.astype(jnp.int32))

    @property
    def nan_code(self) -> int:
        """The code `ml_dtypes` gives NaN: a NaN code for the 8-bit types, the code of -0 for the others."""
        nan = np.array(np.nan, np.float32).astype(getattr(ml_dtypes, self.element))
        return int(nan.view(np.uint8))

    @property
    def packed_width(self) -> int | None:
        return 4 if self.bits == 4 else None


_MX_ELEMENTS = {
    "mxfp8_e4m3": "float8_e4m3fn",
    "mxfp8_e5m2": "float8_e5m2",
    "mxfp6_e2m3": "float6_e2m3fn",
    "mxfp6_e3m2": "float6_e3m2fn",
    "mxfp4": "float4_e2m1fn",
}
MX_FORMATS = (*_MX_ELEMENTS, "mxint8")
"""The names of the OCP Microscaling formats."""

NVFP4_BLOCK = 16
MX_BLOCK = 32  # the MX specification's block size
E4M3 = FloatFormat("float8_e4m3fn")


def int_format(bits: int | np.integer, *, signed: bool = True, narrow: bool = False) -> IntFormat:
    """The format of `bits`-bit integers (the grid of [`eqx_quant.int_range`][]) with float32 scales.

    !!! example

        ```python
        import eqx_quant

        print(eqx_quant.int_format(4))  # Format('int4')
        print(eqx_quant.int_format(4).qmin, eqx_quant.int_format(4).qmax)  # -8 7
        ```
    """
    return IntFormat(*int_range(bits, signed=signed, narrow=narrow))


def stretched_format(bits: int | np.integer) -> StretchedFormat:
    """The stretched grid of `bits` bits, with float32 scales: the `2**bits` levels `q + 1/2` for the codes `q` in
    `[-2**(bits-1), 2**(bits-1) - 1]`, symmetric about zero and without it. At 2 bits the levels are
    `{-1.5, -0.5, 0.5, 1.5}`: ParetoQ's Stretched Elastic Quant grid (Liu et al., 2025), which spends all four codes of
    2-bit weights on nonzero levels, where the integers `[-2, 1]` spend one on zero and are lopsided. At 1 bit the
    levels are `{-0.5, 0.5}` (binary weights).

    `v = x / scale` goes to its nearest level, saturating at `±(2**(bits-1) - 1/2)`; a tie (`v` an integer) goes to
    the level of the even code, as ParetoQ's `round(v - 1/2) + 1/2` does, so that ties do not round symmetrically
    about zero (`v = 0` goes to `+1/2`, `v = 1` to `1/2`, `v = -1` to `-3/2`). A symmetric scale maps the largest
    magnitude to the top level: `max|x| / (2**(bits-1) - 1/2)`. The codes `q` are stored, packed at 2, 3 or 4 bits
    like integers, and the level is `q + 1/2`. Gradients pass wherever rounding does not saturate, `|v| <=
    2**(bits-1)`: half a step beyond the outermost levels, as in ParetoQ (the scale's learned-step-size gradient
    there is `level - v`).

    !!! example

        ```python
        import jax.numpy as jnp
        import eqx_quant

        fmt = eqx_quant.stretched_format(2)
        print(fmt)  # Format('int2_stretched')
        x = jnp.array([-3.0, -0.2, 0.1, 0.9, 1.2])
        print(eqx_quant.fake_quant_format(x, 1.0, fmt))  # [-1.5 -0.5  0.5  0.5  1.5]
        ```
    """
    return StretchedFormat(bits)  # pyright: ignore[reportArgumentType]


def float_format(dtype: object) -> FloatFormat:
    """The format of a low-precision float type with float32 scales: `float8_e4m3fn`, `float8_e5m2`,
    `float6_e2m3fn`, `float6_e3m2fn` or `float4_e2m1fn`, as a dtype (`jnp.float8_e4m3fn`) or its name."""
    if isinstance(dtype, str):
        name = dtype
    else:
        try:
            name = np.dtype(dtype).name  # pyright: ignore[reportArgumentType]
        except TypeError as e:
            raise TypeError(f"`dtype` must be a float format dtype or its name, got {dtype!r}.") from e
    if name not in _ELEMENTS:
        raise ValueError(f"`dtype` must be one of {', '.join(_ELEMENTS)} (or its name), got {dtype!r}.")
    return FloatFormat(name)


def mx_format(name: str, *, scale_rule: str = "floor") -> Format:
    """An OCP Microscaling (MX v1.0) format: `"mxfp8_e4m3"`, `"mxfp8_e5m2"`, `"mxfp6_e2m3"`, `"mxfp6_e3m2"`,
    `"mxfp4"` or `"mxint8"` (integers in `[-127, 127]`), with power-of-two E8M0 scales chosen by `scale_rule`
    (see [`eqx_quant.mx_fake_quant`][])."""
    if name not in MX_FORMATS:
        raise ValueError(f"`fmt` must be one of {', '.join(map(repr, MX_FORMATS))}, got fmt={name!r}.")
    if scale_rule not in SCALE_RULES:
        raise ValueError(f"`scale_rule` must be 'floor' or 'rceil', got scale_rule={scale_rule!r}.")
    if name == "mxint8":
        return IntFormat(-127, 127, scale="e8m0", scale_rule=scale_rule)
    return FloatFormat(_MX_ELEMENTS[name], scale="e8m0", scale_rule=scale_rule)


NVFP4 = FloatFormat("float4_e2m1fn", scale="e4m3")

GGML_FORMATS = {
    "q8_0": IntFormat(-127, 127, scale="float16", scale_rule="absmax", rounding="half_away"),
    "q4_0": IntFormat(-8, 7, scale="float16", scale_rule="signed_max", rounding="shifted_trunc"),
    "q5_0": IntFormat(-16, 15, scale="float16", scale_rule="signed_max", rounding="shifted_trunc"),
}
"""The GGML block formats (llama.cpp's GGUF files) whose quantization is an integer grid with a float16 scale per
block of 32: the formats of the recipes `"q8_0"`, `"q4_0"` and `"q5_0"`."""
GGML_BLOCK = 32


def format_named(name: str) -> Format:
    """The format of a name: `"int8"`, `"int4"`, ..., `"int8_narrow"`, `"uint8"`, ... (with `"_wide"`: gradients
    half a step beyond the ends, see [`eqx_quant.IntFormat`][]), the stretched grids `"int2_stretched"`, ..., the
    float element types, the MX formats (`"mxfp4"`; `"mxfp4_rceil"` for the `rceil` scale rule), `"nvfp4"`, and the
    GGML block formats `"q8_0"`, `"q4_0"`, `"q5_0"` (see [`eqx_quant.Format`][])."""
    if not isinstance(name, str):
        raise TypeError(f"`format` must be a Format or its name, got {name!r}.")
    if name == "nvfp4":
        return NVFP4
    if name in GGML_FORMATS:
        return GGML_FORMATS[name]
    if name in _ELEMENTS:
        return FloatFormat(name)
    base, rceil = name.removesuffix("_rceil"), name.endswith("_rceil")
    if base in MX_FORMATS:
        return mx_format(base, scale_rule="rceil" if rceil else "floor")
    if name.startswith("int") and name.endswith("_stretched") and name[3:-10].isdigit():
        try:
            return stretched_format(int(name[3:-10]))
        except ValueError as error:
            raise ValueError(f"`format`={name!r} names no stretched grid: {error}") from None
    if name.endswith("_wide") and name.startswith(("int", "uint")) and "_stretched" not in name:
        try:
            base = format_named(name.removesuffix("_wide"))
        except ValueError as error:
            raise ValueError(f"`format`={name!r} names no integer grid: {error}") from None
        assert isinstance(base, IntFormat)
        return dataclasses.replace(base, window="rounding")
    for prefix, signed in (("uint", False), ("int", True)):
        digits = name.removeprefix(prefix).removesuffix("_narrow")
        if name.startswith(prefix) and digits.isdigit():
            try:
                return IntFormat(*int_range(int(digits), signed=signed, narrow=name.endswith("_narrow")))
            except ValueError as error:
                raise ValueError(f"`format`={name!r} names no integer grid: {error}") from None
    raise ValueError(
        f"`format` must be a Format or one of the names int2 ... int16 (with _narrow), uint1 ... uint16 (either "
        "with _wide), int1_stretched ... int8_stretched, "
        f"{', '.join(_ELEMENTS)}, {', '.join(MX_FORMATS)} (with _rceil), nvfp4, {', '.join(GGML_FORMATS)}; got "
        f"{name!r}."
    )


def as_format(value: object) -> Format:
    """`value` as a format: a [`eqx_quant.Format`][] itself, a name, or an int (signed integers of that many bits)."""
    if isinstance(value, Format):
        return value
    if isinstance(value, (int, np.integer)) and not isinstance(value, bool):
        return int_format(value)
    if not isinstance(value, str):
        raise TypeError(
            f"`format` must be a Format, a format's name or a number of bits, got {value!r} of type "
            f"{type(value).__name__}."
        )
    return format_named(value)


def format_from_json(info: dict) -> Format:
    """The format that [`eqx_quant.Format.to_json`][] described."""
    info = dict(info)
    kind = info.pop("kind")
    return {"IntFormat": IntFormat, "FloatFormat": FloatFormat, "StretchedFormat": StretchedFormat}[kind](**info)


#
# Scales: how a scale divides a value onto the grid and multiplies a grid point back. `scale` broadcasts against the
# values (unit axes where it is shared); `tensor_scale` is the second level of E4M3 scales.
#


def effective_scale(scale: Array, tensor_scale: Array | None) -> Array:
    """The scale that multiplies a grid point: `scale`, or `scale * tensor_scale` for two-level scales."""
    if tensor_scale is None:
        return scale
    return scale * expand_to_rank(tensor_scale, scale.ndim)


def reciprocal(fmt: Format, scale: Array, tensor_scale: Array | None, ndim: int) -> Array:
    """`1 / scale` as `fmt` takes it, expanded to rank `ndim`: a float32 scale's reciprocal; the exact `2**-e` of an
    E8M0 scale `2**e` (whose `2**-127` is held as 0); `1 / (b * t)` of a two-level scale, 0 where that is 0. NaN where
    the scale is NaN (a block holding NaN or inf); a float16 scale's is that of its float32 value (0 for 0), as GGML
    takes it."""
    if fmt.scale == "float32":
        return expand_to_rank(1 / scale, ndim)
    if fmt.scale == "float16":  # GGML's `id = d == 0 ? 0 : 1 / d`, from the float32 `d`
        zero = jnp.zeros((), scale.dtype)
        return expand_to_rank(jnp.where(scale == 0, zero, 1 / jnp.where(scale == 0, 1, scale)), ndim)
    if fmt.scale == "e8m0":
        inv = jnp.where(jnp.isnan(scale), jnp.asarray(jnp.nan, scale.dtype), pow2(-exponent(scale), scale.dtype))
        return expand_to_rank(inv, ndim)
    s = effective_scale(scale, tensor_scale)
    zero = jnp.zeros((), s.dtype)
    inv = jnp.where(s > 0, 1 / jnp.where(s > 0, s, 1), zero)
    return expand_to_rank(jnp.where(jnp.isnan(s), jnp.asarray(jnp.nan, s.dtype), inv), ndim)


def apply_scale(fmt: Format, values: Array, scale: Array, tensor_scale: Array | None) -> Array:
    """`values * scale` as `fmt` computes it: an E8M0 scale `2**e` in two factors applied one after the other (its
    `2**-127` is subnormal in float32; the halves are not), a two-level scale as the product `b * t`, a float16 scale
    rounded to float16 first."""
    if fmt.scale == "float32":
        return expand_to_rank(scale, values.ndim) * values
    if fmt.scale == "float16":
        return expand_to_rank(scale.astype(jnp.float16).astype(scale.dtype), values.ndim) * values
    if fmt.scale == "e8m0":
        e = exponent(scale)
        half = jax.lax.shift_right_arithmetic(e, jnp.asarray(1, e.dtype))
        first = jnp.where(jnp.isnan(scale), jnp.asarray(jnp.nan, scale.dtype), pow2(half, scale.dtype))
        return values * expand_to_rank(first, values.ndim) * expand_to_rank(pow2(e - half, scale.dtype), values.ndim)
    return values * expand_to_rank(effective_scale(scale, tensor_scale), values.ndim)


def encode_scale(fmt: Format, scale: Array) -> Array:
    """The stored form of `scale`: itself (float32), its float16 rounding, or one byte (E8M0: the exponent plus 127,
    255 for NaN; E4M3: its `float8_e4m3fn` code)."""
    if fmt.scale == "float32":
        return scale
    if fmt.scale == "float16":
        return scale.astype(jnp.float16)
    if fmt.scale == "e8m0":
        return jnp.where(jnp.isnan(scale), _E8M0_NAN, exponent(scale) + 127).astype(jnp.uint8)
    return E4M3.encode(scale)


def decode_scale(fmt: Format, stored: Array, dtype: np.dtype) -> Array:
    """The scale of a stored one, in `dtype`: the inverse of `encode_scale` (a float16 scale as it is applied)."""
    if fmt.scale == "float32":
        return stored
    if fmt.scale == "float16":
        return stored.astype(dtype)
    if fmt.scale == "e8m0":
        e = stored.astype(jnp.int32) - 127
        return jnp.where(stored == _E8M0_NAN, jnp.asarray(jnp.nan, dtype), pow2(e, dtype))
    return E4M3.decode(stored, dtype)
