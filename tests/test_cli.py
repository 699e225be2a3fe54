"""The `remat-plan` command line: JSON report, plan files, overrides, exit codes 0/2/3, train.

Planning gpt2-tiny costs several XLA compiles, so exactly two runs here are verified with
XLA: the module-scoped `verified_run` (plan + built-in policies) and the `train` test.
Everything else uses `--no-verify` or fails before planning.
"""

from __future__ import annotations

import contextlib
import io
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import jax
import pytest

import remat_planner as rp
from remat_planner.budget import parse_budget
from remat_planner.cli import main
from remat_planner.config import build_workload, load_config

ROOT = Path(__file__).resolve().parents[1]
TINY = str(ROOT / "configs" / "gpt2-tiny.yaml")
GOOD = Path(TINY).read_text()
BUILTINS = {"no_remat", "nothing_saveable", "dots_saveable", "dots_with_no_batch_dims_saveable"}
REPORT_KEYS = {"config", "model", "budget_bytes", "fixed", "no_remat", "plan", "builtin_policies",
               "seconds"}


def run(capsys, *argv):
    """main(argv) in-process -> (exit code, stdout, stderr)."""
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


@pytest.fixture(scope="module")
def verified_run(tmp_path_factory):
    """One full run on gpt2-tiny: XLA-verified plan, built-in policy comparison, --out."""
    out = tmp_path_factory.mktemp("plan") / "plan.json"
    stdout, stderr = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
        code = main([TINY, "--budget", "20MB", "--json", "--out", str(out)])
    assert code == 0, stderr.getvalue()
    return json.loads(stdout.getvalue()), out


# ------------------------------------------------------------------------------------------
# exit 0: report, plan file, overrides
# ------------------------------------------------------------------------------------------

def test_verified_json_report(verified_run):
    report, _ = verified_run
    assert set(report) == REPORT_KEYS
    assert report["config"] == "gpt2"
    assert report["budget_bytes"] == 20_000_000
    model = report["model"]
    assert (model["batch_size"], model["seq_len"], model["n_layer"]) == (4, 64, 4)
    assert model["param_count"] > 0
    fixed = report["fixed"]
    # AdamW updates each parameter from its own gradient: the gradients of parameters
    # one stage uses live only through that stage's backward (memory.stage_gradient_bytes)
    assert 0 < fixed["staged_grads_bytes"] < fixed["grads_bytes"]
    # the others (the tied embedding's) exist from the backward on: charged along the step
    # (memory.with_gradient_timeline), not in the total either
    assert fixed["timed_grads_bytes"] == fixed["grads_bytes"] - fixed["staged_grads_bytes"]
    assert fixed["total_bytes"] == sum(fixed[k] for k in (
        "params_bytes", "grads_bytes", "opt_state_bytes", "batch_bytes")) - fixed[
        "staged_grads_bytes"] - fixed["timed_grads_bytes"]

    plan = report["plan"]
    assert plan["fits"] is True
    assert isinstance(plan["measured_peak_bytes"], int)
    assert 0 < plan["measured_peak_bytes"] <= report["budget_bytes"]
    # The budget is below the no-remat peak, so the plan must really recompute something.
    assert report["no_remat"]["measured_peak_bytes"] > report["budget_bytes"]
    assert plan["recompute_flops_predicted"] > 0
    assert plan["segments"]

    policies = report["builtin_policies"]
    assert set(policies) == BUILTINS
    assert policies["no_remat"]["measured_peak_bytes"] == report["no_remat"]["measured_peak_bytes"]
    for name, row in policies.items():
        assert row["measured_peak_bytes"] > 0 and row["flops"] > 0, name
    assert (policies["nothing_saveable"]["measured_peak_bytes"]
            < policies["no_remat"]["measured_peak_bytes"])


def test_out_writes_a_plan_that_round_trips(verified_run):
    report, out = verified_run
    text = out.read_text()
    plan = rp.Plan.from_json(text)
    assert plan.to_json() == text
    assert rp.Plan.from_json(plan.to_json()) == plan
    assert plan.budget_bytes == report["budget_bytes"]
    assert plan.measured_peak_bytes == report["plan"]["measured_peak_bytes"]
    assert plan.fits()
    # The report's top-level segments are the plan's, tiling all stages in order.
    spans = [tuple(s["stages"]) for s in report["plan"]["segments"]]
    assert spans == [(s.start, s.stop) for s in plan.segments]
    assert spans[0][0] == 0 and spans[-1][1] == len(plan.stages)
    assert all(a[1] == b[0] for a, b in zip(spans, spans[1:]))


def test_json_segment_names_are_the_plan_stage_names(verified_run):
    report, out = verified_run
    plan = rp.Plan.from_json(out.read_text())
    for row, seg in zip(report["plan"]["segments"], plan.segments):
        first = plan.stages[seg.start].name
        assert row["modules"].startswith(first), (row["modules"], first)


def test_overrides_reach_the_model_info(capsys, verified_run):
    code, out, err = run(capsys, TINY, "--budget", "20MB", "--no-verify", "--json",
                         "--batch-size", "2", "--seq-len", "32")
    assert code == 0, err
    report = json.loads(out)
    assert set(report) == REPORT_KEYS
    assert (report["model"]["batch_size"], report["model"]["seq_len"]) == (2, 32)
    # The fixed memory is that of the overridden batch, not of the config's 4 x 64.
    small = build_workload(load_config(TINY, batch_size=2, seq_len=32)).abstract_batch
    batch_bytes = sum(a.size * a.dtype.itemsize for a in jax.tree.leaves(small))
    assert report["fixed"]["batch_bytes"] == batch_bytes
    assert batch_bytes < verified_run[0]["fixed"]["batch_bytes"]
    # --no-verify: nothing measured, nothing compared.
    assert report["plan"]["measured_peak_bytes"] is None
    assert report["no_remat"]["measured_peak_bytes"] is None
    assert report["builtin_policies"] == {}


def test_table_output_without_json(capsys):
    code, out, err = run(capsys, TINY, "--budget", "20MB", "--no-verify")
    assert code == 0, err
    assert "step memory" in out and "predicted peak" in out and "not verified" in out
    with pytest.raises(json.JSONDecodeError):
        json.loads(out)


# ------------------------------------------------------------------------------------------
# exit 2: bad input, one line on stderr
# ------------------------------------------------------------------------------------------

def _cfg(tmp_path, text: str) -> str:
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    return str(path)


BAD_INPUT = {
    # name: (argv builder taking tmp_path, text the one line must contain)
    "missing-config": (lambda t: [str(t / "nope.yaml"), "--budget", "1GB"], "no such config"),
    "invalid-yaml": (lambda t: [_cfg(t, "type: gpt2\nmodel: [unclosed\n"), "--budget", "1GB"],
                     "invalid YAML"),
    "empty-file": (lambda t: [_cfg(t, ""), "--budget", "1GB"], "empty"),
    "top-level-list": (lambda t: [_cfg(t, "- type: gpt2\n"), "--budget", "1GB"], "mapping"),
    "unknown-field": (lambda t: [_cfg(t, GOOD + "batchsize: 3\n"), "--budget", "1GB"],
                      "unknown field 'batchsize'"),
    "unknown-model-field": (lambda t: [_cfg(t, GOOD.replace("n_layer:", "n_layers:")),
                                       "--budget", "1GB"], "model.n_layers"),
    "missing-field": (lambda t: [_cfg(t, GOOD.replace("batch_size: 4", "")), "--budget", "1GB"],
                      "missing required field 'batch_size'"),
    "unknown-model-type": (lambda t: [_cfg(t, GOOD.replace("type: gpt2", "type: gpt9")),
                                      "--budget", "1GB"], "gpt9"),
    "wrong-type-model-field": (lambda t: [_cfg(t, GOOD.replace("n_layer: 4", "n_layer: four")),
                                          "--budget", "1GB"], "model.n_layer"),
    "wrong-type-top-level": (lambda t: [_cfg(t, GOOD.replace("batch_size: 4", 'batch_size: "4"')),
                                        "--budget", "1GB"], "batch_size"),
    "wrong-type-optimizer": (lambda t: [_cfg(t, GOOD.replace("name: adamw", "name: lamb")),
                                        "--budget", "1GB"], "optimizer.name"),
    "budget-12GBs": (lambda t: [TINY, "--budget", "12GBs"], "'12GBs'"),
    "budget-negative": (lambda t: [TINY, "--budget", "-5GB"], "'-5GB'"),
    "budget-negative-equals": (lambda t: [TINY, "--budget=-5GB"], "'-5GB'"),
    "budget-twelve": (lambda t: [TINY, "--budget", "twelve"], "'twelve'"),
    "budget-zero": (lambda t: [TINY, "--budget", "0"], "positive"),
    "batch-size-0": (lambda t: [TINY, "--budget", "1GB", "--batch-size", "0"], "batch_size"),
    "seq-len-0": (lambda t: [TINY, "--budget", "1GB", "--seq-len", "0"], "seq_len"),
    "seq-len-above-max": (lambda t: [TINY, "--budget", "1GB", "--seq-len", "129"], "max_seq_len"),
    "train-bad-budget": (lambda t: ["train", TINY, "--budget", "twelve", "--steps", "1"],
                         "'twelve'"),
    "train-missing-config": (lambda t: ["train", str(t / "nope.yaml"), "--budget", "1GB"],
                             "no such config"),
}


@pytest.mark.parametrize("argv_of, needle", BAD_INPUT.values(), ids=BAD_INPUT.keys())
def test_bad_input_exits_2_with_one_line(tmp_path, capsys, argv_of, needle):
    code, out, err = run(capsys, *argv_of(tmp_path))
    assert code == 2, err
    assert out == ""
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("remat-plan: error: ")
    assert "Traceback" not in err
    assert needle in lines[0]


@pytest.mark.parametrize("argv", [
    [TINY],                                   # --budget is required
    ["train", TINY, "--steps", "3"],
    [TINY, "--budget", "1GB", "--batch-size", "two"],
    [TINY, "--budget", "1GB", "--no-such-flag"],
], ids=["plan-no-budget", "train-no-budget", "non-int-batch-size", "unknown-flag"])
def test_usage_errors_exit_2(capsys, argv):
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "usage: remat-plan" in err and "Traceback" not in err


# ------------------------------------------------------------------------------------------
# exit 3: infeasible budget
# ------------------------------------------------------------------------------------------

def test_infeasible_budget_exits_3_and_names_a_budget(capsys, verified_run):
    code, out, err = run(capsys, TINY, "--budget", "1MB", "--no-verify")
    assert code == 3
    assert out == ""
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in err, err
    assert "smallest feasible" in lines[0]
    match = re.search(r"raise --budget to at least ([0-9.]+ ?[KMGT]?B)\b", lines[0])
    assert match, lines[0]
    suggested = parse_budget(match.group(1).replace(" ", ""))
    # Above what was asked, and below the no-remat peak (remat can always do better).
    assert 1_000_000 < suggested < verified_run[0]["no_remat"]["measured_peak_bytes"]


# ------------------------------------------------------------------------------------------
# train
# ------------------------------------------------------------------------------------------

def test_train_loss_goes_down(capsys):
    code, out, err = run(capsys, "train", TINY, "--budget", "20MB", "--steps", "30", "--json")
    assert code == 0, err
    result = json.loads(out)
    assert result["steps"] == 30 and len(result["losses"]) == 30
    assert result["first_loss"] == result["losses"][0]
    assert result["last_loss"] == result["losses"][-1]
    assert result["last_loss"] < result["first_loss"]
    assert result["budget_bytes"] == 20_000_000
    assert result["measured_peak_bytes"] <= result["budget_bytes"]


@pytest.mark.parametrize("steps", ["0", "-3"])
def test_train_rejects_non_positive_steps(capsys, steps):
    code, out, err = run(capsys, "train", TINY, "--budget", "20MB", "--steps", steps)
    assert code == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "--steps" in lines[0] and "Traceback" not in err


# ------------------------------------------------------------------------------------------
# help and packaging
# ------------------------------------------------------------------------------------------

def _assert_lists_exit_codes(text: str) -> None:
    assert "exit codes:" in text
    for code, word in (("0", "success"), ("2", "bad input"), ("3", "budget infeasible")):
        assert re.search(rf"^\s+{code}\s+{word}", text, re.MULTILINE), (code, text)


@pytest.mark.parametrize("prefix", [[], ["train"]], ids=["plan", "train"])
def test_help_lists_exit_codes(capsys, prefix):
    with pytest.raises(SystemExit) as exc:
        main([*prefix, "--help"])
    assert exc.value.code == 0
    _assert_lists_exit_codes(capsys.readouterr().out)


def test_console_script_is_installed():
    script = Path(sys.executable).with_name("remat-plan")
    script = str(script) if script.exists() else shutil.which("remat-plan")
    assert script, "the remat-plan console script is not installed (pip install -e .)"
    proc = subprocess.run([script, "--help"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("usage: remat-plan")
    _assert_lists_exit_codes(proc.stdout)


@pytest.mark.parametrize("args", [
    [TINY, "--budget", "20MB", "--no-verify", "--out", "/nonexistent/dir/p.json"],
    ["explain", TINY, "--budget", "20MB", "--no-verify", "--out", "/etc/hostname/sub"],
])
def test_unwritable_out_fails_before_planning(capsys, args):
    assert main(args) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "cannot write --out" in err
