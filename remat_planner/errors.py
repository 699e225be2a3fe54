"""Typed exceptions for remat-planner; each carries the CLI exit code it maps to."""

from __future__ import annotations

from .units import Units, format_bytes_short, round_up_display


class RematPlannerError(Exception):
    """Base class for every error the planner reports to the user as one line."""

    exit_code: int = 1


class ConfigError(RematPlannerError):
    """Bad input: missing file, bad YAML, unknown model or field, wrong type, bad budget."""

    exit_code = 2


class BudgetError(ConfigError):
    """A memory budget that cannot be parsed or is not positive."""


class InfeasibleBudgetError(RematPlannerError):
    """The budget is below the peak memory of even the most aggressive remat plan."""

    exit_code = 3

    def __init__(self, budget_bytes: int, min_feasible_bytes: int, detail: str = "",
                 units=None) -> None:
        """Build the one-line message.

        Args:
            budget_bytes: The budget the user asked for.
            min_feasible_bytes: Peak bytes of the smallest feasible plan.
            detail: Optional extra context appended to the message.
            units: units.Units to state sizes in (the family the budget was typed in);
                None: decimal, with the binary figure beside the smallest feasible plan.
        """

        self.budget_bytes = budget_bytes
        self.min_feasible_bytes = min_feasible_bytes
        self.detail = detail
        self.units = units
        fmt = (units or Units.DECIMAL).format
        need = fmt(min_feasible_bytes)
        if units is None:
            need += f" = {format_bytes_short(min_feasible_bytes)}"
        message = (
            f"budget {fmt(budget_bytes)} is below the smallest feasible plan ({need}); "
            # Rounded up so that passing the suggested value really is feasible.
            f"raise --budget to at least "
            f"{fmt(round_up_display(min_feasible_bytes, units))}"
        )
        if detail:
            message += "; " + " ".join(detail.split())
        super().__init__(message)

    def in_units(self, units) -> "InfeasibleBudgetError":
        """The same error with its sizes in `units` (a units.Units)."""
        return InfeasibleBudgetError(self.budget_bytes, self.min_feasible_bytes, self.detail,
                                     units)


class PlanOverBudgetError(RematPlannerError):
    """A saved plan (`--plan FILE`) whose XLA peak is above the budget it is held to."""

    exit_code = 3


class PlanMismatchError(RematPlannerError):
    """A saved plan does not match the model that was traced."""

    exit_code = 2


class UnsupportedModelError(RematPlannerError):
    """The workload cannot be planned, e.g. its loss is not a scalar."""

    exit_code = 2
