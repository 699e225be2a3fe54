"""Issue 20, "speak the user's language", through the command line: each test runs
`remat-plan` on configs/gpt2-tiny.yaml (model-only: --no-verify) and reads its report, in
the budget's unit family, in FLOP units, with the model's table. The rest of the issue's
checks, on the API and a saved plan, are in tests/test_user_language.py."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from remat_planner.budget import parse_budget
from remat_planner.cli import main

ROOT = Path(__file__).resolve().parents[1]
TINY = str(ROOT / "configs" / "gpt2-tiny.yaml")
SMALL = ["--batch-size", "2", "--seq-len", "16"]


def run(capsys, *argv):
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def _one_line(err: str) -> str:
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert "Traceback" not in err and lines[0].startswith("remat-plan: error: "), err
    return lines[0]


@pytest.mark.parametrize(("budget", "ours", "other"), [("19.5MiB", "MiB", " MB"),
                                                       ("20MB", " MB", "MiB"),
                                                       ("20000000", " MB", "MiB")])
def test_cli_report_in_the_family_typed_json_in_bytes(capsys, budget, ours, other):
    code, out, err = run(capsys, TINY, "--budget", budget, "--no-verify", "--no-compare")
    assert code == 0, err
    assert ours in out and other not in out, out
    code, out, err = run(capsys, TINY, "--budget", budget, "--no-verify", "--no-compare",
                         "--json")
    assert code == 0, err
    assert json.loads(out)["budget_bytes"] == parse_budget(budget)


def test_model_table_reads_booleans_and_says_no_remat_needed(capsys):
    code, out, err = run(capsys, TINY, "--budget", "1GB", "--no-verify", "--no-compare")
    assert code == 0, err
    assert re.search(r"scan_layers\s*│\s*no\s", out), out
    assert "no remat needed" in out
    code, out, err = run(capsys, TINY, "--budget", "20MB", "--no-verify", "--no-compare")
    assert "no remat needed" not in out


def test_time_prediction_shown_only_under_the_time_cost_model(capsys):
    code, out, err = run(capsys, TINY, "--budget", "20MB", *SMALL, "--no-verify", "--no-compare")
    assert code == 0, err
    assert "recompute time" not in out and "plan: recompute overhead" in out
    code, out, err = run(capsys, TINY, "--budget", "20MB", *SMALL, "--no-verify", "--no-compare",
                         "--cost-model", "time")
    assert code == 0, err
    line = next(l for l in out.splitlines() if "plan: recompute time" in l)
    assert "predicted" in line and "roofline" in line  # shown with what it means


def test_explain_speaks_in_flops_units_and_names(capsys):
    code, out, err = run(capsys, "explain", TINY, "--budget", "12MiB", *SMALL, "--no-verify")
    assert code == 0, err
    assert "0.0 GFLOP" not in out and "eqns[" not in out and "named value" not in out
    assert re.search(r"recomputes \d+\.\d\d [kM]FLOP \(\d+\.\d\d% of the step\)", out), out
    assert "loss (softmax cross-entropy)" in out and "MiB" in out and " MB" not in out


def test_infeasible_budget_names_sizes_in_the_budgets_family(capsys):
    code, out, err = run(capsys, TINY, "--budget", "11MiB", *SMALL, "--no-verify")
    assert code == 3 and out == ""
    line = _one_line(err)
    assert "budget 11.00 MiB is below the smallest feasible plan" in line
    suggested = re.search(r"raise --budget to at least ([0-9.]+ MiB)$", line)
    assert suggested and " GB" not in line and " MB" not in line, line
    assert parse_budget(suggested.group(1).replace(" ", "")) > parse_budget("11MiB")
