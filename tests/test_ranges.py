import numpy as np
import pytest

from eqx_quant import int_range


def _brute_force(bits, signed, narrow):
    """All values of the two's complement (or unsigned) `bits`-bit integers, by enumerating bit patterns."""
    values = []
    for pattern in range(2**bits):
        if signed and pattern >= 2 ** (bits - 1):
            pattern -= 2**bits
        values.append(pattern)
    lo, hi = min(values), max(values)
    return (lo + 1 if narrow else lo), hi


def test_documented_values():
    assert int_range(8) == (-128, 127)
    assert int_range(8, narrow=True) == (-127, 127)
    assert int_range(8, signed=False) == (0, 255)
    assert int_range(4) == (-8, 7)
    assert int_range(2) == (-2, 1)
    assert int_range(1, signed=False) == (0, 1)
    assert int_range(16) == (-32768, 32767)


@pytest.mark.parametrize("bits", range(1, 17))
def test_against_enumeration(bits):
    assert int_range(bits, signed=False) == _brute_force(bits, False, False)
    if bits >= 2:
        assert int_range(bits) == _brute_force(bits, True, False)
        assert int_range(bits, narrow=True) == _brute_force(bits, True, True)
        # The signed range matches NumPy's integer types where they exist.
        if bits in (8, 16):
            info = np.iinfo(f"int{bits}")
            assert int_range(bits) == (info.min, info.max)


def test_returns_python_ints():
    lo, hi = int_range(np.int64(8))
    assert type(lo) is int and type(hi) is int


@pytest.mark.parametrize("bits", [0, 1, 17, -3])
def test_bad_signed_bits(bits):
    with pytest.raises(ValueError, match=f"`bits`.*{bits}"):
        int_range(bits)


@pytest.mark.parametrize("bits", [0, 17])
def test_bad_unsigned_bits(bits):
    with pytest.raises(ValueError, match=f"`bits`.*{bits}"):
        int_range(bits, signed=False)


def test_narrow_unsigned_is_an_error():
    with pytest.raises(ValueError, match="`narrow`"):
        int_range(8, signed=False, narrow=True)


@pytest.mark.parametrize("bits", [8.0, True, "8", None])
def test_bad_bits_type(bits):
    with pytest.raises(TypeError, match="bits"):
        int_range(bits)


def test_bad_flag_types():
    with pytest.raises(TypeError, match="signed"):
        int_range(8, signed=1)
    with pytest.raises(TypeError, match="narrow"):
        int_range(8, narrow="no")
