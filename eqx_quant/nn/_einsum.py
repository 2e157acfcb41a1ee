"""Products of two activations (attention's QKᵀ and softmax·V) written as einsums, on integer grids."""

import functools
import math
import re
from typing import Literal

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Float

from .._format import IntFormat
from .._int_ops import INT32_MAX, any_float64, integer_grid, opaque
from .._qarray import QuantizedArray
from .._quantizers import AbstractQuantizer
from ._layers import check_matmul, check_quantizer


_OPERAND = re.compile(r"^[a-zA-Z]*$")


def _parse(equation: object) -> tuple[str, str, str]:
    """`(lhs, rhs, out)` labels of a two-operand einsum equation with an explicit output, or a `ValueError`."""
    if not isinstance(equation, str):
        raise TypeError(f"`equation` must be a string, got {equation!r}.")
    spec = equation.replace(" ", "")
    inputs, arrow, out = spec.partition("->")
    operands = inputs.split(",")
    if not arrow or len(operands) != 2 or not all(_OPERAND.match(s) for s in (*operands, out)):
        raise ValueError(
            f"`equation` must name two operands and the output with letters, as 'td,sd->ts', got equation={equation!r}."
        )
    lhs, rhs = operands
    for name, labels in (("lhs", lhs), ("rhs", rhs), ("output", out)):
        if len(set(labels)) != len(labels):
            raise ValueError(f"`equation`={equation!r} repeats a label in its {name}.")
    if set(out) - set(lhs) - set(rhs):
        raise ValueError(f"`equation`={equation!r} has output labels that no operand has.")
    return lhs, rhs, out


class Einsum(eqx.Module):
    """A product of two arrays written as an einsum, as a module: `Einsum("td,sd->ts")(a, b)` is
    `jnp.einsum("td,sd->ts", a, b)`.

    Write the products of two activations (attention's scores and its weighted values) with it instead of
    `jnp.einsum`, and [`eqx_quant.quantize`][] can find them and turn them into [`eqx_quant.nn.QuantEinsum`][]s.
    """

    equation: str = eqx.field(static=True)

    def __init__(self, equation: str):
        """**Arguments:**

        - `equation`: an einsum equation with two operands and an explicit output, e.g. `"td,sd->ts"`.
        """
        _parse(equation)
        self.equation = equation

    def __call__(self, a: Array, b: Array) -> Array:
        """`jnp.einsum(equation, a, b)`."""
        with jax.named_scope("eqx_quant.Einsum"):  # a product of this module's, not one that tracing may take
            return jnp.einsum(self.equation, a, b)


def _summed(lhs: str, rhs: str, out: str) -> set[str]:
    """The labels the einsum sums over: those of either operand missing from the output (a label of one operand
    only is summed too, as in `"ij,jk->k"`)."""
    return (set(lhs) | set(rhs)) - set(out)


def _free_scale(tensor: QuantizedArray, labels: str, summed: set[str]) -> tuple[Array, str]:
    """An operand's scale over its free (output) labels: the scales are constant along the summed ones."""
    scale = jnp.broadcast_to(tensor.scale, tensor.shape)
    index = tuple(0 if label in summed else slice(None) for label in labels)
    return scale[index], "".join(label for label in labels if label not in summed)


def integer_einsum_possible(equation: str, a: QuantizedArray, b: QuantizedArray) -> bool:
    """Whether the integer einsum of two quantized operands computes their product: symmetric grids, scales
    constant along the summed labels (no groups), and sums whose int32 accumulation is exact. A float64 operand
    (with `jax_enable_x64`) computes in floating point, as the layers' products do (see `plan`)."""
    if any_float64(a.dtype, b.dtype):
        return False
    lhs, rhs, out = _parse(equation)
    summed = _summed(lhs, rhs, out)
    for tensor, labels in ((a, lhs), (b, rhs)):
        if not integer_grid(tensor) or tensor.zero_point is not None or tensor.layout.group_size is not None:
            return False
        if tensor.layout.stacked:
            return False
        channels = tensor.layout.channel_axes(tensor.shape)
        if any(labels[axis] in summed for axis in channels):
            return False
    sizes: dict[str, int] = {}  # a label's length: the larger of its operands' (a length of 1 broadcasts)
    for labels, shape in ((lhs, a.shape), (rhs, b.shape)):
        for label, size in zip(labels, shape, strict=True):
            sizes[label] = max(sizes.get(label, 1), size)
    length = math.prod(sizes[label] for label in summed)  # the terms of each output's int32 sum
    assert isinstance(a.format, IntFormat) and isinstance(b.format, IntFormat)
    bound = a.format.largest * b.format.largest
    return length * bound <= INT32_MAX


def _int32_einsum(equation: str, a: Array, b: Array, widen: bool) -> Array:
    """`jnp.einsum` of two integer arrays with int32 sums. `widen` where a label is summed in one operand alone:
    `jnp.einsum` sums it first, into int32, which then meets the other operand's int8, a pair that strict dtype
    promotion refuses; both are widened to int32 instead."""
    if widen:
        a, b = a.astype(jnp.int32), b.astype(jnp.int32)
    return jnp.einsum(equation, a, b, preferred_element_type=jnp.int32)


def integer_value(equation: str, a: QuantizedArray, b: QuantizedArray, a_nan: Array, b_nan: Array) -> Array:
    """The product from the integers: an int32 einsum, rescaled once by the outer product of the free scales."""
    lhs, rhs, out = _parse(equation)
    summed = _summed(lhs, rhs, out)
    widen = bool(summed - (set(lhs) & set(rhs)))  # a label summed in one operand alone
    acc = _int32_einsum(equation, a.values, b.values, widen)
    scale_a, free_a = _free_scale(a, lhs, summed)
    scale_b, free_b = _free_scale(b, rhs, summed)
    # One product per output element (no label is summed), so eager and compiled calls round alike.
    scale = jnp.einsum(f"{free_a},{free_b}->{out}", scale_a, scale_b)
    y = acc.astype(scale.dtype) * scale
    # NaN where a summed slice of either operand holds one, as in the float product.
    ones_a, ones_b = jnp.ones(a.shape, jnp.int8), jnp.ones(b.shape, jnp.int8)
    nan = _int32_einsum(equation, a_nan.astype(jnp.int8), ones_b, widen) > 0
    nan = nan | (_int32_einsum(equation, ones_a, b_nan.astype(jnp.int8), widen) > 0)
    return opaque(jnp.where(nan, jnp.nan, y))


@functools.partial(jax.custom_jvp, nondiff_argnums=(0,))
def _integer_einsum(equation, fa, fb, a, b, a_nan, b_nan):
    del fa, fb
    return integer_value(equation, a, b, a_nan, b_nan)


@_integer_einsum.defjvp
def _integer_einsum_jvp(equation, primals, tangents):
    fa, fb, a, b, a_nan, b_nan = primals
    dfa, dfb = tangents[:2]
    y = _integer_einsum(equation, *primals)  # through the function itself, for a second derivative
    dy = jnp.einsum(equation, dfa, fb) + jnp.einsum(equation, fa, dfb)
    return y, dy.astype(y.dtype)


class QuantEinsum(eqx.Module):
    """A product of two activations, [`eqx_quant.nn.Einsum`][], computed on fake-quantized operands.

    **Integer forward.** With `matmul="int"` (the default), when both quantizers are fake quantizers on symmetric
    grids whose scales are constant along the summed labels (per tensor; per token, per head or per any output
    label, e.g. `DynamicFakeQuant(8, axis=0)` for one scale per row of a `(tokens, features)` operand contracted
    over features), and the int32 sums are exact (`K * max|a| * max|b| <= 2**31 - 1` for a contraction of length
    `K`: `K <= 131071` for int8 operands), the forward is the int32 einsum of the two operands' integers, rescaled
    once per output element by the product of their scales. NaN in an operand makes NaN the outputs whose
    contraction it enters. Otherwise (or with `matmul="float"`) the forward is the float einsum of the
    fake-quantized operands. The backward pass is that of the float einsum of the fake-quantized operands either way.

    Both operands are activations: nothing is stored, and [`eqx_quant.convert`][] keeps the module as it is, so that
    the converted model computes exactly this.
    """

    einsum: Einsum
    lhs_quant: AbstractQuantizer | None
    rhs_quant: AbstractQuantizer | None
    matmul: Literal["int", "float"] = eqx.field(static=True)

    def __init__(
        self,
        einsum: Einsum,
        *,
        lhs_quant: AbstractQuantizer | None,
        rhs_quant: AbstractQuantizer | None,
        matmul: Literal["int", "float"] = "int",
    ):
        """**Arguments:**

        - `einsum`: the float product.
        - `lhs_quant`, `rhs_quant`: the quantizers of the two operands, or `None` for a float operand.
        - `matmul`: `"int"` for the integer einsum where the quantizers allow it, `"float"` for the float one.
        """
        self.einsum = einsum
        self.lhs_quant = lhs_quant
        self.rhs_quant = rhs_quant
        self.matmul = matmul

    def __check_init__(self):
        if not isinstance(self.einsum, Einsum):
            raise TypeError(f"`einsum` must be an eqx_quant.nn.Einsum, got {type(self.einsum).__name__}.")
        check_quantizer("lhs_quant", self.lhs_quant)
        check_quantizer("rhs_quant", self.rhs_quant)
        check_matmul(self.matmul)

    def __call__(self, a: Float[Array, "..."], b: Float[Array, "..."]) -> Float[Array, "..."]:
        """`einsum(lhs_quant(a), rhs_quant(b))`, on the integers where possible."""
        equation = self.einsum.equation
        with jax.named_scope("eqx_quant.QuantEinsum"):
            quantizers = (self.lhs_quant, self.rhs_quant)
            if self.matmul == "int" and all(integer_grid(q) for q in quantizers):
                fa, ta, na = self.lhs_quant.fake_quant_and_array(a)  # pyright: ignore[reportOptionalMemberAccess]
                fb, tb, nb = self.rhs_quant.fake_quant_and_array(b)  # pyright: ignore[reportOptionalMemberAccess]
                if integer_einsum_possible(equation, ta, tb):
                    return _integer_einsum(equation, fa, fb, ta, tb, na, nb).astype(jnp.result_type(fa, fb))
            a = a if self.lhs_quant is None else self.lhs_quant(a)
            b = b if self.rhs_quant is None else self.rhs_quant(b)
            return self.einsum(a, b)
