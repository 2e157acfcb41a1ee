"""Quantized layers: Equinox layers computed on fake-quantized weights and inputs."""

from ._attention import (
    Einsum as Einsum,
    QuantEinsum as QuantEinsum,
    QuantKVCache as QuantKVCache,
    QuantMultiheadAttention as QuantMultiheadAttention,
)
from ._int_layers import (
    AbstractIntLayer as AbstractIntLayer,
    FloatQuantizedTensor as FloatQuantizedTensor,
    IntConv as IntConv,
    IntEmbedding as IntEmbedding,
    IntLinear as IntLinear,
    QuantizedTensor as QuantizedTensor,
)
from ._layers import (
    AbstractQuantLayer as AbstractQuantLayer,
    QuantConv as QuantConv,
    QuantEmbedding as QuantEmbedding,
    QuantLinear as QuantLinear,
)
