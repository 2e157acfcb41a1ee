from typing import Any, Literal

import equinox as eqx
import jax
from jaxtyping import Array, ArrayLike, Float, Int, PRNGKeyArray

from .._int_ops import integer_grid, integer_product, plan
from .._misc import computed_before, one_program, read_through
from .._qarray import QuantizedArray
from .._quantizers import AbstractQuantizer
from ._layers import as_vector, check_input, check_matmul, check_transform, scalar_output, weight_for_product
from ._transforms import AbstractInputTransform


@one_program
def converted_forward(layer: "AbstractConvertedLayer", x: Array, key: PRNGKeyArray | None) -> Array:
    """The forward pass of a converted `Linear` or `Conv` (`x` one example, checked): the integer computation where
    the same decision as the quantized layer's allows it, else the float layer on the dequantized weight."""
    float_layer = layer.layer
    vector = as_vector(float_layer, x)
    integer = layer.matmul == "int"  # pyright: ignore[reportAttributeAccessIssue]  # linear and conv layers have it
    if not (integer and integer_grid(layer.input_quant) and integer_grid(layer.qweight)):
        return layer._float_path(x, key)
    x_int, x_nan = layer.input_quant.quantize_with_mask(vector)  # pyright: ignore[reportOptionalMemberAccess]
    spec = plan(float_layer, layer.qweight.shape, layer.qweight, x_int)
    if spec is None:
        return layer._float_path(x, key)
    bias = float_layer.bias  # pyright: ignore[reportAttributeAccessIssue]
    y = integer_product(spec, layer.qweight, x_int, bias, None, x_nan)
    return scalar_output(float_layer, y.astype(layer.qweight.dtype))


def check_qweight(qweight: object) -> None:
    """A `TypeError` unless `qweight` is a [`eqx_quant.QuantizedArray`][]."""
    if not isinstance(qweight, QuantizedArray):
        raise TypeError(f"`qweight` must be a QuantizedArray, got {qweight!r} of type {type(qweight).__name__}.")


class AbstractConvertedLayer(eqx.Module):
    """Base class of the layers produced by [`eqx_quant.convert`][], which store their weight quantized.

    `layer` is the float layer with its weight removed (set to `None`): it keeps the configuration (strides,
    padding, bias, ...) and the bias; `qweight` holds the weight as a [`eqx_quant.QuantizedArray`][] (integers, or
    the codes of a low-precision float format); for stacked layers, built with `eqx.filter_vmap`, its arrays carry the
    stack in front. A call runs the integer computation of the quantized layer's integer forward when the weight is
    stored as integers and the input quantizer has a single integer scale for the whole input, and the dequantized
    weight in floating point otherwise (float formats always).

    Every attribute of the wrapped float layer reads through (`bias`, `in_features`, `out_features`, `use_bias`,
    a convolution's `stride` and `padding`, ...), and `weight` is the dequantized weight, so model code that reads
    them works on a converted layer as on the float one.
    """

    layer: eqx.AbstractVar[eqx.Module]
    qweight: eqx.AbstractVar[QuantizedArray]
    input_quant: eqx.AbstractVar[AbstractQuantizer | None]

    @property
    def weight(self) -> Array:
        """The dequantized weight, as a float array: bit for bit the `.weight` of the quantized layer it was
        converted from (the fake-quantized weight), so that model code reading `.weight` (a tied language-model head)
        computes the same before and after [`eqx_quant.convert`][]. It is computed before what reads it
        (`computed_before`), as the quantized layer's `.weight` is, so that XLA sums a product with it alike in both
        models (a tied head's product of one row fused the dequantization into its sum)."""
        return computed_before(self.qweight.dequantize(), self.qweight.scale)

    def __getattr__(self, name: str) -> Any:
        """Every other public attribute of the wrapped layer reads through (`bias`, `in_features`,
        `out_features`, `use_bias`, a convolution's `stride`, ...), so that model code reading them works on the
        converted layer as on the float layer."""
        return read_through(self, "layer", name)

    def dequantized_layer(self) -> eqx.Module:
        """The float layer with the dequantized weight: what the fake-quant model computed with."""
        return self._with_weight(self.qweight.dequantize())

    def _with_weight(self, weight: Array) -> eqx.Module:
        return eqx.tree_at(lambda l: l.weight, self.layer, weight, is_leaf=lambda x: x is None)

    def _float_path(self, x: Array, key: PRNGKeyArray | None) -> Array:
        weight = weight_for_product(self.qweight.dequantize(), x, self.qweight.scale)  # as the quantized layer's
        if self.input_quant is not None:
            x = self.input_quant(x)
        return self._with_weight(weight)(x, key=key)  # pyright: ignore[reportCallIssue]


class ConvertedLinear(AbstractConvertedLayer):
    """A linear layer with integer weights.

    When its input quantizer has one scale for the whole input (a calibrated [`eqx_quant.FakeQuant`][], or a
    per-tensor [`eqx_quant.DynamicFakeQuant`][], which computes it at every call) and the weight has one scale per
    tensor or per output channel, a call quantizes the input to integers, multiplies the weight's and the input's
    integers minus their zero points with `jax.lax.dot_general(..., preferred_element_type=jnp.int32)`, rescales
    the sum and adds the bias, `y = (acc * scale_w) * scale_x + bias`: the same computation as
    [`eqx_quant.nn.QuantLinear`][]'s integer forward, bit for bit. A weight with one scale per
    group along the contraction runs on integers too (each group's int32 sum scaled by its group's scale). Otherwise
    (per-channel inputs, say, or `matmul="float"`) it runs the dequantized weight in floating point, as the quantized
    layer does. An
    `input_transform` (from [`eqx_quant.smoothquant`][], [`eqx_quant.awq`][] or [`eqx_quant.rotate`][]) is applied to
    the input first, as the quantized layer applies it; the stored weight is the transformed one.

    **Overflow.** The int32 accumulator is exact while `K * max|w - zw| * max|x - zx| <= 2**31 - 1` for a
    contraction of length `K`: `K <= 131071` for int8 weights and inputs. Longer contractions are split into chunks
    within that bound, whose int32 results are summed in float32; where a single product can exceed int32 (two
    asymmetric 16-bit grids), the layer runs in floating point.
    """

    layer: eqx.nn.Linear
    qweight: QuantizedArray
    input_quant: AbstractQuantizer | None
    input_transform: AbstractInputTransform | None = None
    matmul: Literal["int", "float"] = eqx.field(static=True, default="int")  # the quantized layer's

    def __check_init__(self):
        check_qweight(self.qweight)
        check_transform(self.layer, self.input_transform)
        check_matmul(self.matmul)

    def __call__(self, x: Float[Array, "*in"], *, key: PRNGKeyArray | None = None) -> Float[Array, "*out"]:
        """Like `eqx.nn.Linear.__call__` (after the input transform of the quantized layer, if it has one)."""
        with jax.named_scope("eqx_quant.ConvertedLinear"):
            check_input(self.layer, x)
            if self.input_transform is not None:
                x = self.input_transform(x)
            return converted_forward(self, x, key)


class ConvertedConv(AbstractConvertedLayer):
    """A convolution (any dimensionality) with integer weights.

    With an input quantizer that has one scale for the whole input, zero padding, per-tensor or per-output-channel
    weight scales and a contraction `K = in_channels / groups * prod(kernel_size)` within the int32 bound of
    [`eqx_quant.nn.ConvertedLinear`][], a call runs `jax.lax.conv_general_dilated` on the integers minus their zero
    points (so that padding stays real zero) with `preferred_element_type=jnp.int32`, rescales the sums and adds the
    bias: the computation of [`eqx_quant.nn.QuantConv`][]'s integer forward. Otherwise (or with `matmul="float"`) it
    runs the dequantized weight in floating point.
    """

    layer: eqx.nn.Conv
    qweight: QuantizedArray
    input_quant: AbstractQuantizer | None
    matmul: Literal["int", "float"] = eqx.field(static=True, default="int")  # the quantized layer's

    def __check_init__(self):
        check_qweight(self.qweight)
        check_matmul(self.matmul)

    def __call__(
        self, x: Float[Array, "in_channels *spatial"], *, key: PRNGKeyArray | None = None
    ) -> Float[Array, "out_channels *out_spatial"]:
        """Like `eqx.nn.Conv.__call__`."""
        with jax.named_scope("eqx_quant.ConvertedConv"):
            check_input(self.layer, x)
            return converted_forward(self, x, key)


class ConvertedEmbedding(AbstractConvertedLayer):
    """An embedding with an integer table: a call dequantizes the one row it looks up (bit for bit the row of the
    fake-quantized table)."""

    layer: eqx.nn.Embedding
    qweight: QuantizedArray

    def __check_init__(self):
        check_qweight(self.qweight)

    @property
    def input_quant(self) -> None:
        """`None`: an embedding's input is an index, which is never quantized."""
        return None

    def __call__(self, x: Int[ArrayLike, ""], *, key: PRNGKeyArray | None = None) -> Float[Array, " embedding_size"]:
        """Like `eqx.nn.Embedding.__call__`."""
        del key
        with jax.named_scope("eqx_quant.ConvertedEmbedding"):
            # Computed before what reads it, as the fake-quant embedding's row is (see `computed_before`).
            return computed_before(self.qweight.dequantize_row(x), self.qweight.scale)
