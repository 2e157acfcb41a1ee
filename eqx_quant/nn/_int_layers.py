import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, ArrayLike, Float, Int, PRNGKeyArray

from .._int_ops import int_conv, int_linear, integer_operand, linear_spec, per_tensor_grid
from .._qtensor import QuantizedTensor
from .._quantizers import AbstractFakeQuantizer, AbstractQuantizer
from ._layers import check_input, conv_spec, scalar_output


def _input_operand(quantizer: AbstractQuantizer | None, x: Array):
    """The input's integers, if its quantizer has one scale and zero point for the whole input; else `None`."""
    if not isinstance(quantizer, AbstractFakeQuantizer):
        return None
    grid = quantizer.grid(x)
    return integer_operand(grid) if per_tensor_grid(grid, x.shape) else None


def _per_channel_scale(weight: QuantizedTensor) -> bool:
    """Whether the weight has scales per tensor or per output channel, as the integer products need."""
    return weight.view_shape == weight.shape and all(n == 1 for n in weight.scale.shape[1:])


class AbstractIntLayer(eqx.Module):
    """Base class of the integer layers produced by [`eqx_quant.convert`][].

    `layer` is the float layer with its weight removed (set to `None`): it keeps the configuration (strides,
    padding, bias, ...) and the bias; `weight` holds the integers. A call runs the integer computation of the
    quantized layer's integer forward when the input quantizer has a single scale for the whole input, and the
    dequantized weight in floating point otherwise.
    """

    layer: eqx.AbstractVar[eqx.Module]
    weight: eqx.AbstractVar[QuantizedTensor]
    input_quant: eqx.AbstractVar[AbstractQuantizer | None]

    def dequantized_layer(self) -> eqx.Module:
        """The float layer with the dequantized weight: what the fake-quant model computed with."""
        return eqx.tree_at(lambda l: l.weight, self.layer, self.weight.dequantize(), is_leaf=lambda x: x is None)

    def _float_path(self, x: Array, key: PRNGKeyArray | None) -> Array:
        if self.input_quant is not None:
            x = self.input_quant(x)
        return self.dequantized_layer()(x, key=key)  # pyright: ignore[reportCallIssue]


class IntLinear(AbstractIntLayer):
    """A linear layer with integer weights.

    When its input quantizer has one scale for the whole input (a calibrated [`eqx_quant.FakeQuant`][], or a
    per-tensor [`eqx_quant.DynamicFakeQuant`][], which computes it at every call) and the weight has one scale per
    tensor or per output channel, a call quantizes the input to integers, multiplies the weight's and the input's
    integers minus their zero points with `jax.lax.dot_general(..., preferred_element_type=jnp.int32)`, adds the
    bias in the accumulator's units and rescales once, `y = (acc + bias / s) * s` with `s = scale_w * scale_x`: the
    same computation as [`eqx_quant.nn.QuantLinear`][]'s integer forward, bit for bit. Otherwise (grouped weights,
    per-channel inputs) it runs the dequantized weight in floating point, as the quantized layer does.

    **Overflow.** The int32 accumulator is exact while `K * max|w - zw| * max|x - zx| <= 2**31 - 1` for a
    contraction of length `K`: `K <= 131071` for int8 weights and inputs. Longer contractions are split into chunks
    within that bound, whose int32 results are summed in float32; where a single product can exceed int32 (two
    asymmetric 16-bit grids), the layer runs in floating point.
    """

    layer: eqx.nn.Linear
    weight: QuantizedTensor
    input_quant: AbstractQuantizer | None

    def __call__(self, x: Float[Array, "*in"], *, key: PRNGKeyArray | None = None) -> Float[Array, "*out"]:
        """Like `eqx.nn.Linear.__call__`."""
        with jax.named_scope("eqx_quant.IntLinear"):
            layer = self.layer
            check_input(layer, x)
            vector = jnp.broadcast_to(x, (1,)) if layer.in_features == "scalar" else x
            grouped = self.weight.view_shape != self.weight.shape or not _per_channel_scale(self.weight)
            x_int = None if grouped else _input_operand(self.input_quant, vector)
            if x_int is None:
                return self._float_path(x, key)
            w_values, w_bound = self.weight.shifted()
            spec = linear_spec(w_bound, x_int.bound)
            if spec is None:
                return self._float_path(x, key)
            y = int_linear(spec, w_values, x_int.values, self.weight.scale, x_int.scale, layer.bias, x_nan=x_int.nan)
            return scalar_output(layer, y.astype(self.weight.dtype))


class IntConv(AbstractIntLayer):
    """A convolution (any dimensionality) with integer weights.

    With an input quantizer that has one scale for the whole input, zero padding, per-tensor or per-output-channel
    weight scales and a contraction `K = in_channels / groups * prod(kernel_size)` within the int32 bound of
    [`eqx_quant.nn.IntLinear`][], a call runs `jax.lax.conv_general_dilated` on the integers minus their zero points
    (so that padding stays real zero) with `preferred_element_type=jnp.int32`, and rescales once: the computation of
    [`eqx_quant.nn.QuantConv`][]'s integer forward. Otherwise it runs the dequantized weight in floating point.
    """

    layer: eqx.nn.Conv
    weight: QuantizedTensor
    input_quant: AbstractQuantizer | None

    def __call__(
        self, x: Float[Array, "in_channels *spatial"], *, key: PRNGKeyArray | None = None
    ) -> Float[Array, "out_channels *out_spatial"]:
        """Like `eqx.nn.Conv.__call__`."""
        with jax.named_scope("eqx_quant.IntConv"):
            layer = self.layer
            check_input(layer, x)
            usable = layer.padding_mode == "ZEROS" and _per_channel_scale(self.weight)
            x_int = _input_operand(self.input_quant, x) if usable else None
            if x_int is None:
                return self._float_path(x, key)
            w_values, w_bound = self.weight.shifted()
            spec = conv_spec(layer, self.weight.shape, w_bound, x_int.bound)
            if spec is None:
                return self._float_path(x, key)
            y = int_conv(spec, w_values, x_int.values, self.weight.scale, x_int.scale, layer.bias, x_nan=x_int.nan)
            return y.astype(self.weight.dtype)


class IntEmbedding(AbstractIntLayer):
    """An embedding with an integer table: a call dequantizes the one row it looks up (bit for bit the row of the
    fake-quantized table)."""

    layer: eqx.nn.Embedding
    weight: QuantizedTensor
    input_quant: None

    def __call__(self, x: Int[ArrayLike, ""], *, key: PRNGKeyArray | None = None) -> Float[Array, " embedding_size"]:
        """Like `eqx.nn.Embedding.__call__`."""
        del key
        with jax.named_scope("eqx_quant.IntEmbedding"):
            return self.weight.dequantize_row(x)
