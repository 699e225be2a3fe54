"""Budget parsing and formatting."""

from __future__ import annotations

import math

import pytest

from remat_planner.budget import parse_budget

from remat_planner.units import format_bytes, format_bytes_short
from remat_planner.errors import BudgetError, ConfigError, InfeasibleBudgetError


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ("12GB", 12 * 10**9),
        ("12 GB", 12 * 10**9),
        ("12gb", 12 * 10**9),
        (" 12 GB ", 12 * 10**9),
        ("11.5GiB", int(11.5 * 2**30)),
        ("512MiB", 512 * 2**20),
        ("100", 100),
        (12_000_000_000, 12 * 10**9),
        (1, 1),
    ],
)
def test_parse_budget_good(value: int | str, expected: int) -> None:
    assert parse_budget(value) == expected


@pytest.mark.parametrize(
    "value",
    ["twelve", "12GBs", "", "GB", "-5GB", "0", "0GB", "0.1B", 0, -5, True, False, math.nan, math.inf, None, [12]],
)
def test_parse_budget_bad(value: object) -> None:
    with pytest.raises(BudgetError) as info:
        parse_budget(value)  # type: ignore[arg-type]
    message = str(info.value)
    assert "\n" not in message
    assert repr(value) in message
    assert "12GB" in message  # names a good example
    assert isinstance(info.value, ConfigError) and info.value.exit_code == 2


@pytest.mark.parametrize(
    ("n", "long", "short"),
    [
        (12 * 10**9, "12.00 GB (11.18 GiB)", "11.18 GiB"),
        (3_500_000, "3.50 MB (3.34 MiB)", "3.34 MiB"),
        (512, "512 B", "512 B"),
    ],
)
def test_format_bytes(n: int, long: str, short: str) -> None:
    assert format_bytes(n) == long
    assert format_bytes_short(n) == short


def test_infeasible_message_suggests_a_feasible_budget() -> None:
    err = InfeasibleBudgetError(10**9, 3_200_000_000)
    assert str(err) == (
        "budget 1.00 GB is below the smallest feasible plan (3.20 GB = 2.98 GiB); "
        "raise --budget to at least 3.20 GB"
    )
    assert (err.budget_bytes, err.min_feasible_bytes, err.exit_code) == (10**9, 3_200_000_000, 3)
    # 3.2045 GB prints as 3.20 GB, which would still be infeasible, so the hint rounds up.
    rounded = InfeasibleBudgetError(10**9, 3_204_500_000, detail="peak in\nlayer 3")
    assert "at least 3.21 GB; peak in layer 3" in str(rounded)
    assert parse_budget("3.21GB") >= rounded.min_feasible_bytes
