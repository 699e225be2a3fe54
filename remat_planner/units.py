"""Sizes and FLOPs for people: the unit families (`Units`: GB = 10^9, GiB = 2^30) and
their formatting. Human output speaks the family the budget was typed in
(budget.units_of); JSON stays in bytes. Imports nothing from the package.
"""

from __future__ import annotations

import enum
import math

_DECIMAL_UNITS = (("TB", 10**12), ("GB", 10**9), ("MB", 10**6), ("KB", 10**3))
_BINARY_UNITS = (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10))


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


def round_up_display(n: int, units: "Units | None" = None) -> int:
    """Round `n` up to the precision `format_bytes_decimal` (or `units.format`) shows:
    0.01 of its unit.

    Returns:
        The smallest displayable value >= n, so a printed suggestion never undershoots.
    """
    table = (units or Units.DECIMAL).table
    size = next((size for _, size in table if n >= size), None)
    if size is None:
        return n
    if size % 100 == 0:  # decimal units: exact in integers
        return -(-n // (size // 100)) * (size // 100)
    return max(n, math.ceil(math.ceil(n * 100 / size) * size / 100))


class Units(enum.Enum):
    """A unit family for human output: DECIMAL (kB, MB, GB: powers of 10^3) or BINARY
    (KiB, MiB, GiB: powers of 2^10)."""

    DECIMAL = "decimal"
    BINARY = "binary"

    @property
    def table(self) -> tuple[tuple[str, int], ...]:
        return _DECIMAL_UNITS if self is Units.DECIMAL else _BINARY_UNITS

    def format(self, n: int | float | None) -> str:
        """`n` bytes with two decimals in the largest unit of this family not above it,
        e.g. `12.00 GB` or `11.18 GiB`; "-" for None."""
        if n is None:
            return "-"
        return _scaled(int(n), self.table)

    def scale(self, top: float) -> tuple[float, str]:
        """(bytes per unit, unit name) to draw values up to `top` bytes on an axis: GB/GiB
        from 1 GB/GiB up, MB/MiB below (KB/KiB under 1 MB/MiB)."""
        for name, size in self.table[1:]:
            if top >= size:
                return float(size), name
        return float(self.table[-1][1]), self.table[-1][0]

    @property
    def example(self) -> str:
        return "GB = 10^9 bytes" if self is Units.DECIMAL else "GiB = 2^30 bytes"


# A budget given as a plain number of bytes (or not given at all: `frontier`) is shown in
# decimal units, as the README's and the guide's figures are.
DEFAULT_UNITS = Units.DECIMAL


def format_flops(flops: float) -> str:
    """FLOPs with a unit that shows the figure: `1.23 GFLOP`, `4.56 MFLOP`, `789 FLOP`."""
    for name, size in (("TFLOP", 1e12), ("GFLOP", 1e9), ("MFLOP", 1e6), ("kFLOP", 1e3)):
        if abs(flops) >= size:
            return f"{flops / size:.2f} {name}"
    return f"{flops:.0f} FLOP"
