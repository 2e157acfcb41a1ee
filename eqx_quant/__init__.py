"""Equinox-native fake quantization and quantization-aware training for JAX."""

from ._clip import clip_passthrough as clip_passthrough
from ._fake_quant import fake_quant as fake_quant, fake_quant_vjp as fake_quant_vjp
from ._ranges import int_range as int_range


__version__ = "0.1.0"
