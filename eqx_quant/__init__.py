"""Equinox-native fake quantization and quantization-aware training for JAX."""

from . import nn as nn
from ._auto import (
    AutoRecipe as AutoRecipe,
    AutoRecipeReport as AutoRecipeReport,
    AutoRecipeRow as AutoRecipeRow,
    auto_recipe as auto_recipe,
)
from ._autoround import autoround as autoround
from ._backward import (
    QuantizedBackward as QuantizedBackward,
    UnquantizedBackward as UnquantizedBackward,
)
from ._calibrate import calibrate as calibrate
from ._clip import clip_passthrough as clip_passthrough
from ._compressed_tensors import export_compressed_tensors as export_compressed_tensors
from ._convert import convert as convert
from ._export import export_safetensors as export_safetensors
from ._fake_quant import (
    fake_quant as fake_quant,
    fake_quant_float as fake_quant_float,
    fake_quant_format as fake_quant_format,
    fake_quant_vjp as fake_quant_vjp,
    mx_fake_quant as mx_fake_quant,
    nvfp4_fake_quant as nvfp4_fake_quant,
)
from ._format import (
    FloatFormat as FloatFormat,
    Format as Format,
    IntFormat as IntFormat,
    StretchedFormat as StretchedFormat,
    float_format as float_format,
    format_named as format_named,
    int_format as int_format,
    int_range as int_range,
    mx_format as mx_format,
    stretched_format as stretched_format,
)
from ._gguf import export_gguf as export_gguf, load_gguf as load_gguf
from ._gptq import gptq_quantize as gptq_quantize
from ._gptq_model import gptq as gptq
from ._layout import Layout as Layout
from ._packing import (
    NIBBLE_ORDER as NIBBLE_ORDER,
    pack_bits as pack_bits,
    pack_int4 as pack_int4,
    unpack_bits as unpack_bits,
    unpack_int4 as unpack_int4,
)
from ._qarray import QuantizedArray as QuantizedArray
from ._quantizers import (
    AbstractFakeQuantizer as AbstractFakeQuantizer,
    AbstractQuantizer as AbstractQuantizer,
    DynamicFakeQuant as DynamicFakeQuant,
    DynamicFloatFakeQuant as DynamicFloatFakeQuant,
    FakeQuant as FakeQuant,
    FloatFakeQuant as FloatFakeQuant,
    LearnedFakeQuant as LearnedFakeQuant,
    LearnedFloatFakeQuant as LearnedFloatFakeQuant,
    MXFakeQuant as MXFakeQuant,
    NVFP4FakeQuant as NVFP4FakeQuant,
    PassthroughClip as PassthroughClip,
)
from ._recipes import recipe as recipe
from ._rules import (
    LayerQuantizer as LayerQuantizer,
    Rule as Rule,
    dequantize as dequantize,
    float_model as float_model,
    quantize as quantize,
)
from ._serialise import load as load, save as save
from ._smoothing import awq as awq, rotate as rotate, smoothquant as smoothquant
from ._summary import Summary as Summary, SummaryRow as SummaryRow, summary as summary
from ._traced import TracedProduct as TracedProduct
from ._train import (
    distillation_loss as distillation_loss,
    learn_scales as learn_scales,
    quantized_after as quantized_after,
    trainable as trainable,
)


# The name of earlier releases: every quantizer onto a number format, float formats among them.
AbstractFloatQuantizer = AbstractFakeQuantizer

__version__ = "0.1.0"
