"""The `remat-plan` command line: output, plan files, training, exit codes."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

import remat_planner as rp
from remat_planner.cli import main

TINY = "configs/gpt2-tiny.yaml"


@pytest.fixture(scope="module")
def verified_run(tmp_path_factory):
    """One full run on gpt2-tiny with XLA verification and policy comparison."""
    out = tmp_path_factory.mktemp("plan") / "plan.json"
    import contextlib
    import io

    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        code = main([TINY, "--budget", "20MB", "--json", "--out", str(out)])
    return code, json.loads(buf.getvalue()), out


def test_plan_json_report(verified_run):
    code, report, _ = verified_run
    assert code == 0
    assert {"config", "model", "budget_bytes", "fixed", "no_remat", "plan", "builtin_policies",
            "seconds"} <= set(report)
    plan = report["plan"]
    assert plan["fits"] is True
    assert plan["measured_peak_bytes"] <= report["budget_bytes"] == 20_000_000
    assert report["no_remat"]["measured_peak_bytes"] > report["budget_bytes"]  # remat needed
    assert set(report["builtin_policies"]) == {"no_remat", "nothing_saveable", "dots_saveable",
                                               "dots_with_no_batch_dims_saveable"}
    assert report["model"]["param_count"] > 0 and report["fixed"]["total_bytes"] > 0


def test_out_writes_a_loadable_plan(verified_run):
    _, report, out = verified_run
    text = out.read_text()
    plan = rp.Plan.from_json(text)
    assert plan.to_json() == text
    assert plan.measured_peak_bytes == report["plan"]["measured_peak_bytes"]


def test_table_output_and_overrides(capsys):
    assert main([TINY, "--budget", "20MB", "--no-verify", "--batch-size", "2", "--seq-len", "32"]) == 0
    out = capsys.readouterr().out
    assert "predicted peak" in out and "not verified" in out
    assert main([TINY, "--budget", "20MB", "--no-verify", "--json", "--batch-size", "2",
                 "--seq-len", "32"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["model"]["batch_size"] == 2 and report["model"]["seq_len"] == 32
    assert report["plan"]["measured_peak_bytes"] is None


def _write(tmp_path, text):
    p = tmp_path / "c.yaml"
    p.write_text(text)
    return str(p)


with open(TINY) as _f:
    GOOD = _f.read()


@pytest.mark.parametrize("args_fn, needle", [
    (lambda t: ["no/such.yaml", "--budget", "1GB"], "no such config"),
    (lambda t: [_write(t, "type: gpt2\nmodel: [unclosed\n"), "--budget", "1GB"], "YAML"),
    (lambda t: [_write(t, GOOD + "batchsize: 3\n"), "--budget", "1GB"], "batchsize"),
    (lambda t: [_write(t, GOOD.replace("type: gpt2", "type: gpt9")), "--budget", "1GB"], "gpt9"),
    (lambda t: [_write(t, GOOD.replace("n_layer: 4", "n_layer: four")), "--budget", "1GB"],
     "n_layer"),
    (lambda t: [TINY, "--budget", "12GBs"], "12GBs"),
    (lambda t: [TINY, "--budget=-5GB"], "-5GB"),
    (lambda t: [TINY, "--budget", "-5GB"], "-5GB"),
    (lambda t: [TINY, "--budget", "twelve"], "twelve"),
    (lambda t: [TINY, "--budget", "0"], "budget"),
    (lambda t: [TINY, "--budget", "1GB", "--batch-size", "0"], "batch_size"),
    (lambda t: [TINY, "--budget", "1GB", "--seq-len", "4096"], "seq_len"),
])
def test_bad_input_exits_2_with_one_line(tmp_path, capsys, args_fn, needle):
    assert main(args_fn(tmp_path)) == 2
    err = capsys.readouterr().err.strip()
    assert "Traceback" not in err
    assert len(err.splitlines()) == 1
    assert needle in err


def test_missing_budget_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as e:
        main([TINY])
    assert e.value.code == 2
    assert "--budget" in capsys.readouterr().err


def test_infeasible_budget_exits_3(capsys):
    assert main([TINY, "--budget", "1MB", "--no-verify"]) == 3
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1
    assert "smallest feasible" in err and "raise --budget to at least" in err


def test_train_loss_goes_down(capsys):
    assert main(["train", TINY, "--budget", "20MB", "--steps", "30", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["steps"] == 30 and len(result["losses"]) == 30
    assert result["last_loss"] < result["first_loss"]
    assert result["measured_peak_bytes"] <= result["budget_bytes"]


def test_train_rejects_zero_steps(capsys):
    assert main(["train", TINY, "--budget", "20MB", "--steps", "0"]) == 2
    assert "steps" in capsys.readouterr().err


def test_console_script_help_lists_exit_codes():
    proc = subprocess.run([sys.executable, "-m", "remat_planner.cli", "--help"],
                          capture_output=True, text=True, check=True)
    for code in ("0", "2", "3"):
        assert f"  {code}  " in proc.stdout
    assert "train" in proc.stdout
