"""Parse memory budgets (pydantic ByteSize semantics: GB = 10^9, GiB = 2^30); units.py
formats sizes.

Human output speaks the unit family the budget was typed in (`Units`): a budget given as
"12GB" (or MB, KB, TB) is shown in decimal units, one given as "11GiB" in binary units,
and one given as a plain number of bytes in DEFAULT_UNITS (decimal). JSON stays in bytes.
"""

from __future__ import annotations

import math
import re

from pydantic import ByteSize, TypeAdapter, ValidationError

from .errors import BudgetError
from .units import DEFAULT_UNITS, Units

_BYTE_SIZE = TypeAdapter(ByteSize)
_EXAMPLE = "use a positive size such as '12GB', '11.5GiB' or 12000000000 (bytes)"


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


_BINARY_SUFFIX = re.compile(r"[0-9.\s]*[kmgtpe]ib\s*$", re.IGNORECASE)


def units_of(value: int | str | None) -> Units:
    """The unit family a budget was written in: BINARY for "11GiB", "512 MiB"; DECIMAL for
    "12GB", "20MB"; DEFAULT_UNITS (decimal) for plain bytes, an int or None."""
    if isinstance(value, str) and _BINARY_SUFFIX.match(value.strip()):
        return Units.BINARY
    return DEFAULT_UNITS
