import numpy as np

from ._misc import check_int


def int_range(bits: int | np.integer, *, signed: bool = True, narrow: bool = False) -> tuple[int, int]:
    """The integer grid `(qmin, qmax)` of a `bits`-bit integer.

    **Arguments:**

    - `bits`: the bit width; 2 to 16 for signed grids, 1 to 16 for unsigned ones.
    - `signed`: two's complement range `[-2^(bits-1), 2^(bits-1) - 1]` if `True`, else `[0, 2^bits - 1]`.
    - `narrow`: drop the most negative value of a signed range, so that it is symmetric about zero:
        `[-(2^(bits-1) - 1), 2^(bits-1) - 1]`. Only meaningful for signed ranges.

    **Returns:**

    A tuple of Python ints `(qmin, qmax)`, both inclusive.

    **Raises:**

    `TypeError` if `bits` is not an int (bools are rejected); `ValueError` if `bits` is out of range or `narrow=True`
    is asked for an unsigned range.

    !!! example

        ```python
        import eqx_quant

        assert eqx_quant.int_range(8) == (-128, 127)
        assert eqx_quant.int_range(8, narrow=True) == (-127, 127)
        assert eqx_quant.int_range(8, signed=False) == (0, 255)
        assert eqx_quant.int_range(4) == (-8, 7)
        ```
    """
    bits = check_int("bits", bits)
    if not isinstance(signed, bool):
        raise TypeError(f"`signed` must be a bool, got {signed!r}.")
    if not isinstance(narrow, bool):
        raise TypeError(f"`narrow` must be a bool, got {narrow!r}.")
    if signed:
        if not 2 <= bits <= 16:
            raise ValueError(f"`bits` must be between 2 and 16 for a signed range, got {bits}.")
        half = 2 ** (bits - 1)
        return (-half + 1 if narrow else -half), half - 1
    if narrow:
        raise ValueError("`narrow` applies to signed ranges only, got narrow=True with signed=False.")
    if not 1 <= bits <= 16:
        raise ValueError(f"`bits` must be between 1 and 16 for an unsigned range, got {bits}.")
    return 0, 2**bits - 1
