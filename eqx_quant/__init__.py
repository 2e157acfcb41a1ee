"""Equinox-native fake quantization and quantization-aware training for JAX."""

from . import nn as nn
from ._backward import QuantizedBackward as QuantizedBackward
from ._calibrate import calibrate as calibrate
from ._clip import clip_passthrough as clip_passthrough
from ._convert import convert as convert
from ._fake_quant import fake_quant as fake_quant, fake_quant_vjp as fake_quant_vjp
from ._float_formats import (
    fake_quant_float as fake_quant_float,
    mx_fake_quant as mx_fake_quant,
    nvfp4_fake_quant as nvfp4_fake_quant,
)
from ._float_quantizers import (
    AbstractFloatQuantizer as AbstractFloatQuantizer,
    DynamicFloatFakeQuant as DynamicFloatFakeQuant,
    FloatFakeQuant as FloatFakeQuant,
    LearnedFloatFakeQuant as LearnedFloatFakeQuant,
    MXFakeQuant as MXFakeQuant,
    NVFP4FakeQuant as NVFP4FakeQuant,
)
from ._gptq import gptq as gptq, gptq_quantize as gptq_quantize
from ._io import export_safetensors as export_safetensors, load as load, save as save
from ._layout import Layout as Layout
from ._packing import (
    NIBBLE_ORDER as NIBBLE_ORDER,
    pack_bits as pack_bits,
    pack_int4 as pack_int4,
    unpack_bits as unpack_bits,
    unpack_int4 as unpack_int4,
)
from ._quantizers import (
    AbstractFakeQuantizer as AbstractFakeQuantizer,
    AbstractQuantizer as AbstractQuantizer,
    DynamicFakeQuant as DynamicFakeQuant,
    FakeQuant as FakeQuant,
    LearnedFakeQuant as LearnedFakeQuant,
    PassthroughClip as PassthroughClip,
)
from ._ranges import int_range as int_range
from ._recipes import recipe as recipe
from ._transform import dequantize as dequantize, quantize as quantize


__version__ = "0.1.0"
