"""The slow corpus checks of tests/test_corpus.py for the models in its SECOND_HALF: a file
of its own so that the two halves run on different pytest-xdist workers."""

from __future__ import annotations

import pytest

from test_corpus import (SMALLEST_CHECKED, cases, check_five_budgets, check_model_error,
                         check_never_worse, check_planned_gradients, check_smallest_feasible,
                         half)

# Whole-step compiles at several budgets: left out of the README's test command, run by
# .ci/run's second part (`-m slow`).
pytestmark = pytest.mark.slow


@pytest.mark.parametrize("name,policy", cases(second=True))
def test_never_worse_than_a_builtin_policy(name, policy):
    check_never_worse(name, policy)


@pytest.mark.parametrize("name", half(second=True))
def test_planned_gradients_equal_unplanned(name):
    check_planned_gradients(name)


@pytest.mark.parametrize("name", half(second=True))
def test_five_budgets_fit_and_beat_every_builtin_that_fits(name):
    check_five_budgets(name)


@pytest.mark.parametrize("name", half(second=True))
def test_model_predicts_xla_within_tolerance(name):
    check_model_error(name)


@pytest.mark.parametrize("name", SMALLEST_CHECKED)
def test_smallest_feasible_no_higher_than_every_builtin(name):
    check_smallest_feasible(name)
