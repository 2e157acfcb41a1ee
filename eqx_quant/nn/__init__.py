"""Quantized layers: Equinox layers computed on fake-quantized weights and inputs, and the layers that
[`eqx_quant.convert`][] makes of them."""

from .._qarray import QuantizedArray as QuantizedArray
from .._traced import QuantTraced as QuantTraced
from ._attention import QuantMultiheadAttention as QuantMultiheadAttention
from ._converted import (
    AbstractConvertedLayer as AbstractConvertedLayer,
    ConvertedConv as ConvertedConv,
    ConvertedEmbedding as ConvertedEmbedding,
    ConvertedLinear as ConvertedLinear,
)
from ._einsum import Einsum as Einsum, QuantEinsum as QuantEinsum
from ._kv_cache import QuantKVCache as QuantKVCache
from ._layers import (
    AbstractQuantLayer as AbstractQuantLayer,
    QuantConv as QuantConv,
    QuantEmbedding as QuantEmbedding,
    QuantLinear as QuantLinear,
)
from ._transforms import (
    AbstractInputTransform as AbstractInputTransform,
    RotateInput as RotateInput,
    ScaleInput as ScaleInput,
)


# The names of earlier releases.
AbstractIntLayer = AbstractConvertedLayer
IntLinear = ConvertedLinear
IntConv = ConvertedConv
IntEmbedding = ConvertedEmbedding
QuantizedTensor = QuantizedArray
FloatQuantizedTensor = QuantizedArray
