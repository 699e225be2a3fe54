"""Parse and format memory budgets (pydantic ByteSize semantics: GB = 10^9, GiB = 2^30)."""

from __future__ import annotations

import math

from pydantic import ByteSize, TypeAdapter, ValidationError

from remat_planner.errors import BudgetError

_BYTE_SIZE = TypeAdapter(ByteSize)
_EXAMPLE = "use a positive size such as '12GB', '11.5GiB' or 12000000000 (bytes)"
_DECIMAL_UNITS = (("TB", 10**12), ("GB", 10**9), ("MB", 10**6), ("KB", 10**3))
_BINARY_UNITS = (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10))


def parse_budget(value: int | str) -> int:
    """Parse a memory budget into bytes.

    Args:
        value: Bytes as an int, or a size string like "12GB", "12 GB" or "11.5GiB".

    Returns:
        The budget in bytes, always > 0.

    Raises:
        BudgetError: If the value is not a size, or is zero or negative.
    """
    # bool is an int subclass and ByteSize would read True as 1 byte.
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        raise BudgetError(f"invalid budget {value!r}: {_EXAMPLE}")
    if isinstance(value, float) and not math.isfinite(value):
        raise BudgetError(f"invalid budget {value!r}: {_EXAMPLE}")
    if isinstance(value, (int, float)) and value <= 0:
        raise BudgetError(f"budget must be positive, got {value!r}: {_EXAMPLE}")
    try:
        parsed = int(_BYTE_SIZE.validate_python(value))
    except ValidationError:
        raise BudgetError(f"invalid budget {value!r}: {_EXAMPLE}") from None
    if parsed <= 0:
        raise BudgetError(f"budget must be positive, got {value!r}: {_EXAMPLE}")
    return parsed


def _scaled(n: int, units: tuple[tuple[str, int], ...]) -> str:
    """Format `n` bytes with two decimals in the largest unit not exceeding it."""
    for name, size in units:
        if abs(n) >= size:
            return f"{n / size:.2f} {name}"
    return f"{n} B"


def format_bytes_decimal(n: int) -> str:
    """Format bytes in decimal units, e.g. `12.00 GB`."""
    return _scaled(n, _DECIMAL_UNITS)


def format_bytes_short(n: int) -> str:
    """Format bytes in binary units for tables, e.g. `11.18 GiB`."""
    return _scaled(n, _BINARY_UNITS)


def format_bytes(n: int) -> str:
    """Format bytes in both unit systems, e.g. `12.00 GB (11.18 GiB)`."""
    decimal, binary = format_bytes_decimal(n), format_bytes_short(n)
    # Below 1 KB both read "N B"; printing it twice would be noise.
    return decimal if decimal == binary else f"{decimal} ({binary})"


def round_up_display(n: int) -> int:
    """Round `n` up to the precision `format_bytes_decimal` shows (0.01 of its unit).

    Returns:
        The smallest displayable value >= n, so a printed suggestion never undershoots.
    """
    step = next((size // 100 for _, size in _DECIMAL_UNITS if n >= size), 1)
    return -(-n // step) * step
