"""The second half of the reliability sweep (tests/test_sweep.py, SECOND_HALF): a file of
its own so that the two halves run on different pytest-xdist workers."""

from __future__ import annotations

import pytest

from test_reliability import model  # noqa: F401  (the shared fixture)
from test_reliability import check_gradients
from test_sweep import check_sweep, sweep_params

# Whole-step compiles at several budgets: left out of the README's test command, run by
# .ci/run's second part (`-m slow`).
pytestmark = pytest.mark.slow


@pytest.mark.slow
@pytest.mark.parametrize("model", sweep_params(second_half=True), indirect=True)
def test_sweep_never_over_budget_and_recompute_never_rises(model):
    check_sweep(model)


@pytest.mark.slow
@pytest.mark.parametrize("model", sweep_params(second_half=True, known_failures=False),
                         indirect=True)
def test_planned_loss_and_gradients_equal_unplanned(model):
    """Reliability, guarantee 2: see test_reliability.check_gradients."""
    check_gradients(model)
