"""Input transforms of a linear layer: an invertible linear map `T` applied to the layer's input before its input
quantizer, whose inverse the stored weight has absorbed, `y = (W T⁻¹)(T x) + b`."""

import functools
import math

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Int8

from .._misc import whole_along


class AbstractInputTransform(eqx.Module):
    """An invertible linear map `T` of a linear layer's input (the last axis), applied before the input quantizer.

    A layer holding one computes `(W T⁻¹)(T x) + b`: its stored weight is `W T⁻¹` (see `absorb`), so that the
    float function is unchanged up to rounding, and only the quantized operands differ. The transform's arrays hold a
    leading axis per layer of a stack (layers built with `eqx.filter_vmap`), like the layer's weight; they never
    train (their gradient is zero, and [`eqx_quant.trainable`][] never selects them).
    """

    def __call__(self, x: Float[Array, "*batch n"]) -> Float[Array, "*batch n"]:
        """`T x` along the last axis of `x`."""
        raise NotImplementedError

    def absorb(self, weight: Float[Array, "*stack out n"]) -> Float[Array, "*stack out n"]:
        """`W T⁻¹`: the weight that computes on `T x` what `weight` computes on `x`."""
        raise NotImplementedError

    def restore(self, weight: Float[Array, "*stack out n"]) -> Float[Array, "*stack out n"]:
        """`W T`: the inverse of `absorb`, the weight that computes on `x` what `weight` computes on `T x`."""
        raise NotImplementedError


def _concrete(array: object) -> bool:
    """Whether `array`'s values are known now (not a tracer, not a shape)."""
    return isinstance(array, (np.ndarray, jax.Array)) and not isinstance(array, jax.core.Tracer)


def _per_row(array: Array, weight: Array) -> Array:
    """A transform's array of shape `(*stack, n)` against a weight of shape `(*stack, out, n)`."""
    return jnp.expand_dims(array, -2) if weight.ndim > array.ndim else array


def _against(array: Array, x: Array) -> Array:
    """A transform's array of shape `(n,)` against an input of shape `(*batch, n)`."""
    return array.reshape((1,) * (x.ndim - array.ndim) + array.shape)


class ScaleInput(AbstractInputTransform):
    """Multiplies the input by a per-channel factor, `T = diag(multiplier)`, and the weight's columns by its inverse:
    the smoothing of [`eqx_quant.smoothquant`][] and [`eqx_quant.awq`][].

    `T x` is the single product `x * multiplier`, the same operation eagerly, under `jax.jit` and in the converted
    layer.
    """

    multiplier: Float[Array, "*stack n"]

    def __check_init__(self):
        if not (eqx.is_array(self.multiplier) or isinstance(self.multiplier, jax.ShapeDtypeStruct)):
            raise TypeError(f"`multiplier` must be an array, got {self.multiplier!r}.")
        if not jnp.issubdtype(self.multiplier.dtype, jnp.floating) or self.multiplier.ndim < 1:
            raise ValueError(
                "`multiplier` must be a floating array with one entry per input channel (and leading stack axes), "
                f"got dtype {self.multiplier.dtype} and shape {self.multiplier.shape}."
            )
        if _concrete(self.multiplier):
            values = np.asarray(self.multiplier)
            if not np.all(np.isfinite(values) & (values > 0)):
                raise ValueError(f"`multiplier` must be positive and finite, got {values.ravel()[:8]}...")

    def __call__(self, x: Float[Array, "*batch n"]) -> Float[Array, "*batch n"]:
        return x * _against(jax.lax.stop_gradient(self.multiplier).astype(x.dtype), x)

    def absorb(self, weight: Float[Array, "*stack out n"]) -> Float[Array, "*stack out n"]:
        return (weight / _per_row(self.multiplier, weight)).astype(weight.dtype)

    def restore(self, weight: Float[Array, "*stack out n"]) -> Float[Array, "*stack out n"]:
        return (weight * _per_row(self.multiplier, weight)).astype(weight.dtype)


@functools.cache
def paley_hadamard(order: int) -> np.ndarray:
    """A Hadamard matrix of `order` `q + 1` for a prime `q ≡ 3 (mod 4)` (Paley's first construction), or of order
    1: `H Hᵀ = order * I`, entries ±1."""
    if order == 1:
        return np.ones((1, 1), np.int8)
    q = order - 1
    squares = {(i * i) % q for i in range(1, q)}
    chi = np.array([0] + [1 if i in squares else -1 for i in range(1, q)], np.int64)
    jacobsthal = chi[(np.arange(q)[None, :] - np.arange(q)[:, None]) % q]
    matrix = np.ones((order, order), np.int64)
    matrix[1:, 0] = -1
    matrix[1:, 1:] = jacobsthal + np.eye(q, dtype=np.int64)
    return matrix.astype(np.int8)


def _is_prime(n: int) -> bool:
    return n >= 2 and all(n % d for d in range(2, math.isqrt(n) + 1))


MAX_PALEY_ORDER = 256  # the small factor is one dense product of this size per element


def hadamard_order(n: int) -> int | None:
    """The order `m` of the small Hadamard factor of a rotation of size `n = m * 2**k`: 1 for a power of two, else
    the least `m = q + 1 <= 256` dividing `n` with `q ≡ 3 (mod 4)` prime and `n / m` a power of two; `None` when
    there is none."""
    if n < 1:
        return None
    power = n & -n  # the largest power of two dividing n
    rest = n // power
    for m in sorted({rest * 2**i for i in range(power.bit_length())}):
        if m == 1 or (m <= MAX_PALEY_ORDER and m % 4 == 0 and _is_prime(m - 1)):
            return m
    return None


def walsh_hadamard(x: Array, order: int, *, transpose: bool = False) -> Array:
    """`H x` along the last axis of `x` (unnormalised), for `H = H_order ⊗ H_(2**k)` with Sylvester's `H_(2**k)` and
    Paley's `H_order` (`Hᵀ x` with `transpose`): `log2(2**k)` butterfly stages of sums and differences, then the
    small factor as one product."""
    n = x.shape[-1]
    lead = x.shape[:-1]
    power = n // order
    x = whole_along(x, -1)  # every output mixes every input
    y = x.reshape(*lead, order, power)
    h = 1
    while h < power:  # Sylvester's H is symmetric: one butterfly stage per bit of the index
        y = y.reshape(*lead, order, power // (2 * h), 2, h)
        a, b = y[..., 0, :], y[..., 1, :]
        y = jnp.stack([a + b, a - b], axis=-2).reshape(*lead, order, power)
        h *= 2
    if order > 1:
        small = paley_hadamard(order)
        small = jnp.asarray(small.T if transpose else small, x.dtype)
        y = jnp.einsum("ij,...jk->...ik", small, y, precision=jax.lax.Precision.HIGHEST)
    return y.reshape(*lead, n)


class RotateInput(AbstractInputTransform):
    """Rotates the input by a randomized Hadamard matrix, `T = H D / sqrt(n)`, with `D = diag(signs)` of random
    ±1 and `H` a Hadamard matrix of size `n` (Sylvester's for powers of two, times a small Paley factor for
    `n = m * 2**k` with `m - 1` a prime `≡ 3 mod 4`, `m <= 256`: 12, 20, 24, 40, 44, 48, 60, ...): the rotation of
    [`eqx_quant.rotate`][]. `T` is orthogonal, so the weight absorbs `Tᵀ`.

    `T x` is computed with a fast Walsh-Hadamard transform, `O(n log n)` sums and differences (and one small dense
    product for a Paley factor), the same operations eagerly, under `jax.jit` and in the converted layer.
    """

    signs: Int8[Array, "*stack n"]
    order: int = eqx.field(static=True)

    def __init__(self, signs: Int8[Array, "*stack n"]):
        """**Arguments:**

        - `signs`: the diagonal of `D`, an int8 array of ±1 with one entry per input channel (and leading stack
            axes).
        """
        if not isinstance(signs, (jax.Array, np.ndarray)):
            raise TypeError(f"`signs` must be an int8 array of ±1, got {signs!r} of type {type(signs).__name__}.")
        n = signs.shape[-1] if signs.ndim else 0
        order = hadamard_order(n)
        if signs.dtype != jnp.int8 or order is None:
            raise ValueError(
                "`signs` must be an int8 array of ±1 whose last axis has a size `m * 2**k` with m = 1 or m - 1 a "
                f"prime ≡ 3 (mod 4), got dtype {signs.dtype} and shape {signs.shape}."
            )
        if _concrete(signs) and not np.all(np.abs(np.asarray(signs)) == 1):
            raise ValueError(f"`signs` must hold only -1 and 1, got {np.unique(np.asarray(signs))}.")
        self.signs = signs
        self.order = order

    def _scaled(self, x: Array) -> Array:
        n = x.shape[-1]
        return x * jnp.asarray(1 / math.sqrt(n), x.dtype)

    def __call__(self, x: Float[Array, "*batch n"]) -> Float[Array, "*batch n"]:
        signs = _against(self.signs.astype(x.dtype), x)
        return self._scaled(walsh_hadamard(x * signs, self.order))

    def absorb(self, weight: Float[Array, "*stack out n"]) -> Float[Array, "*stack out n"]:
        # Each row w becomes T w: (W Tᵀ) (T x) = W x.
        signs = _per_row(self.signs, weight).astype(weight.dtype)
        return self._scaled(walsh_hadamard(weight * signs, self.order))

    def restore(self, weight: Float[Array, "*stack out n"]) -> Float[Array, "*stack out n"]:
        # Each row w becomes Tᵀ w = D Hᵀ w / sqrt(n).
        signs = _per_row(self.signs, weight).astype(weight.dtype)
        return self._scaled(walsh_hadamard(weight, self.order, transpose=True)) * signs


@eqx.filter_jit
def absorbed(transform: AbstractInputTransform, weight: Array) -> Array:
    """`transform.absorb(weight)` as one compiled program (eagerly, a rotation would compile each butterfly stage)."""
    return transform.absorb(weight)


@eqx.filter_jit
def restored(transform: AbstractInputTransform, weight: Array) -> Array:
    """`transform.restore(weight)` as one compiled program."""
    return transform.restore(weight)
