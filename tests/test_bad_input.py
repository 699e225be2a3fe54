"""Bad input, CLI and API: one line naming the problem and the fix, the documented exit
code (2 bad input, 3 infeasible), no traceback; in the API a typed RematPlannerError.

tests/test_cli.py already covers, on the plan command: missing config, invalid YAML, empty
file, top-level list, unknown field / model field / model type, missing field, wrong field
types, budgets 12GBs / -5GB / twelve / 0, batch size and seq len 0, budget 1MB (exit 3).
This file adds what that leaves out: unreadable configs, more wrong types, the explain
and train commands, a budget one byte below the smallest feasible, the API's answers
(non-scalar loss, integer-only params, non-array arguments, empty batch, every budget
form), and real processes through the installed console script.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest

import remat_planner as rp
from remat_planner import planner as pl
from remat_planner.budget import parse_budget
from remat_planner.cli import main
from remat_planner.config import build_workload, load_config, make_optimizer

ROOT = Path(__file__).resolve().parents[1]
TINY = str(ROOT / "configs" / "gpt2-tiny.yaml")
GOOD = Path(TINY).read_text()
SMALL = ["--batch-size", "2", "--seq-len", "16"]


def _one_line(err: str) -> str:
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert "Traceback" not in err and lines[0].startswith("remat-plan: error: "), err
    return lines[0]


def _cfg(tmp_path: Path, text: str | bytes, name: str = "bad.yaml") -> str:
    path = tmp_path / name
    path.write_bytes(text if isinstance(text, bytes) else text.encode())
    return str(path)


# ------------------------------------------------------------------------------------------
# CLI, in process
# ------------------------------------------------------------------------------------------

CLI_BAD = {
    # name: (argv builder taking tmp_path, texts the one line must contain)
    "config-is-a-directory": (lambda t: [str(t), "--budget", "1GB"],
                              ["is a directory", "pass a YAML file"]),
    "config-not-utf8": (lambda t: [_cfg(t, b"type: gpt2\n\xff\xfe\n"), "--budget", "1GB"],
                        ["not UTF-8", "save it as UTF-8"]),
    "config-tab-indent": (lambda t: [_cfg(t, GOOD.replace("  n_layer", "\tn_layer")),
                                     "--budget", "1GB"], ["invalid YAML at line"]),
    "model-not-a-mapping": (lambda t: [_cfg(t, "type: gpt2\nmodel: 5\nbatch_size: 2\n"
                                              "seq_len: 8\n"), "--budget", "1GB"],
                            ["field 'model'", "dictionary"]),
    "optimizer-not-a-mapping": (lambda t: [_cfg(t, GOOD.split("optimizer:")[0]
                                                + "optimizer: adamw\n"), "--budget", "1GB"],
                                ["field 'optimizer'"]),
    "batch-size-bool": (lambda t: [_cfg(t, GOOD.replace("batch_size: 4", "batch_size: true")),
                                   "--budget", "1GB"], ["field 'batch_size'", "(got True)"]),
    "batch-size-float": (lambda t: [_cfg(t, GOOD.replace("batch_size: 4", "batch_size: 4.5")),
                                    "--budget", "1GB"], ["field 'batch_size'", "(got 4.5)"]),
    "batch-size-negative-flag": (lambda t: [TINY, "--budget", "1GB", "--batch-size", "-1"],
                                 ["field 'batch_size'", "greater than 0"]),
    "heads-do-not-divide-width": (lambda t: [_cfg(t, GOOD.replace("n_head: 4", "n_head: 3")),
                                             "--budget", "1GB"], ["divisible by n_head"]),
    "unknown-dtype": (lambda t: [_cfg(t, GOOD.replace("  dtype: float32", "  dtype: float16")),
                                 "--budget", "1GB"], ["model.dtype", "'float16'"]),
    "negative-learning-rate": (lambda t: [_cfg(t, GOOD.replace("learning_rate: 3.0e-4",
                                                               "learning_rate: -1.0")),
                                          "--budget", "1GB"], ["optimizer.learning_rate"]),
    "budget-empty": (lambda t: [TINY, "--budget", ""], ["invalid budget ''", "12GB"]),
    "budget-fraction-of-a-byte": (lambda t: [TINY, "--budget", "0.4"], ["'0.4'"]),
    "budget-nan": (lambda t: [TINY, "--budget", "nan"], ["'nan'"]),
    "budget-exponent": (lambda t: [TINY, "--budget", "1e9"], ["'1e9'", "12GB"]),
    "budget-minus-zero": (lambda t: [TINY, "--budget", "-0"], ["positive"]),
    "explain-missing-config": (lambda t: ["explain", str(t / "nope.yaml"), "--budget", "1GB"],
                               ["no such config file"]),
    "explain-budget-12GBs": (lambda t: ["explain", TINY, "--budget", "12GBs"], ["'12GBs'"]),
    "explain-budget-negative": (lambda t: ["explain", TINY, "--budget", "-5GB"], ["'-5GB'"]),
    "explain-budget-twelve": (lambda t: ["explain", TINY, "--budget", "twelve"], ["'twelve'"]),
    "explain-budget-zero": (lambda t: ["explain", TINY, "--budget", "0"], ["positive"]),
    "explain-batch-size-0": (lambda t: ["explain", TINY, "--budget", "1GB", "--batch-size", "0"],
                             ["batch_size"]),
    "explain-unknown-field": (lambda t: ["explain", _cfg(t, GOOD + "batchsize: 3\n"),
                                         "--budget", "1GB"], ["unknown field 'batchsize'"]),
    "train-batch-size-0": (lambda t: ["train", TINY, "--budget", "1GB", "--batch-size", "0"],
                           ["batch_size"]),
    "train-budget-negative": (lambda t: ["train", TINY, "--budget", "-5GB"], ["'-5GB'"]),
    "train-invalid-yaml": (lambda t: ["train", _cfg(t, "type: [gpt2\n"), "--budget", "1GB"],
                           ["invalid YAML"]),
}


@pytest.mark.parametrize("argv_of, needles", CLI_BAD.values(), ids=CLI_BAD.keys())
def test_cli_bad_input_exits_2_with_one_line(tmp_path, capsys, argv_of, needles):
    code = main([str(a) for a in argv_of(tmp_path)])
    out, err = capsys.readouterr()
    assert code == 2, err
    assert out == ""
    line = _one_line(err)
    for needle in needles:
        assert needle in line, line


def test_cli_explain_infeasible_budget_exits_3(capsys):
    code = main(["explain", TINY, "--budget", "2MB", "--no-verify", *SMALL])
    out, err = capsys.readouterr()
    assert code == 3 and out == ""
    line = _one_line(err)
    assert "below the smallest feasible plan" in line and "raise --budget to at least" in line


# ------------------------------------------------------------------------------------------
# Budget just below the smallest feasible: API and CLI agree on the edge
# ------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def small_gpt2():
    cfg = load_config(TINY, batch_size=2, seq_len=16)
    wl, opt = build_workload(cfg), make_optimizer(cfg.optimizer)
    an = pl.analyze(wl.loss_fn, wl.abstract_params, wl.abstract_batch, opt, calibrate=False)
    return wl, opt, an


def test_budget_one_byte_below_the_smallest_feasible(small_gpt2, capsys):
    wl, opt, an = small_gpt2
    smallest = an.min_feasible_budget()
    plan = rp.plan(wl.loss_fn, wl.abstract_params, wl.abstract_batch, smallest, opt,
                   verify=False, analysis=an)
    assert plan.predicted_peak_bytes <= smallest
    with pytest.raises(rp.InfeasibleBudgetError) as info:
        rp.plan(wl.loss_fn, wl.abstract_params, wl.abstract_batch, smallest - 1, opt,
                verify=False, analysis=an)
    err = info.value
    assert err.exit_code == 3 and err.budget_bytes == smallest - 1
    assert err.min_feasible_bytes == smallest
    assert "\n" not in str(err)
    # The CLI (same analysis, model only) gives the same answer, and the budget it
    # suggests is feasible.
    code = main([TINY, "--budget", str(smallest - 1), "--no-verify", *SMALL])
    out, stderr = capsys.readouterr()
    assert code == 3 and out == ""
    line = _one_line(stderr)
    suggested = re.search(r"raise --budget to at least ([0-9.]+ [KMGT]?B)", line)
    assert suggested, line
    assert parse_budget(suggested.group(1).replace(" ", "")) >= smallest


# ------------------------------------------------------------------------------------------
# API
# ------------------------------------------------------------------------------------------

BAD_BUDGETS = ["12GBs", "-5GB", "twelve", "0", "", "   ", "nan", "inf", "1e9", "0.4", "-0",
               "12 GiBs", 0, -1, -0.5, 0.4, float("nan"), float("inf"), None, True, [12],
               b"12GB"]


@pytest.mark.parametrize("budget", BAD_BUDGETS, ids=[repr(b) for b in BAD_BUDGETS])
def test_api_bad_budget_is_a_budget_error(budget):
    with pytest.raises(rp.BudgetError) as info:
        parse_budget(budget)
    err = info.value
    assert isinstance(err, rp.ConfigError) and isinstance(err, rp.RematPlannerError)
    assert err.exit_code == 2
    text = str(err)
    assert "\n" not in text and "use a positive size such as '12GB'" in text, text


def test_api_plan_checks_the_budget_before_any_work():
    def loss_fn(w, x):
        raise AssertionError("traced before the budget was checked")
    with pytest.raises(rp.BudgetError, match="twelve"):
        rp.plan(loss_fn, jnp.ones(3), jnp.ones(3), "twelve")


W = jax.ShapeDtypeStruct((8, 8), jnp.float32)
X = jax.ShapeDtypeStruct((4, 8), jnp.float32)
mlp = lambda w, x: jnp.mean(jnp.tanh(x @ w))

API_BAD = {
    # name: (loss_fn, params, batch, texts the message must contain)
    "non-scalar-loss": (lambda w, x: jnp.tanh(x @ w), W, (X,),
                        ["one scalar", "float32[4,8]", "jnp.mean"]),
    "integer-loss": (lambda w, x: jnp.sum(x @ w).astype(jnp.int32), W, (X,),
                     ["floating scalar", "int32[]"]),
    "tuple-loss-without-has-aux": (lambda w, x: (jnp.mean(x @ w), jnp.sum(x)), W, (X,),
                                   ["one scalar"]),
    "integer-only-params": (lambda w, x: jnp.mean(x * w.sum()),
                            jax.ShapeDtypeStruct((8, 8), jnp.int32), (X,),
                            ["no floating-point leaves", "trainable parameters"]),
    "no-params": (lambda w, x: jnp.mean(x), {}, (X,), ["no floating-point leaves"]),
    "string-argument": (mlp, W, ("tokens.txt",), ["batch[0] is a str, not an array",
                                                  "jnp.asarray"]),
    "python-number-argument": (lambda w, x: jnp.mean(w) * x, W, (1.5,),
                               ["batch[0] is a float, not an array"]),
    "nested-list-argument": (mlp, W, ([[1.0] * 8] * 4,), ["batch[0][0][0] is a float"]),
    "python-list-params": (mlp, {"w": [1.0, 2.0]}, (X,), ["params['w'][0] is a float"]),
    "empty-batch": (mlp, W, (jax.ShapeDtypeStruct((0, 8), jnp.float32),),
                    ["the batch is empty", "float32[0, 8]", "at least one example"]),
}


@pytest.mark.parametrize("loss_fn, params, batch, needles", API_BAD.values(), ids=API_BAD.keys())
def test_api_bad_model_input_is_an_unsupported_model_error(loss_fn, params, batch, needles):
    with pytest.raises(rp.UnsupportedModelError) as info:
        rp.plan(loss_fn, params, batch, "1GB", verify=False)
    err = info.value
    assert isinstance(err, rp.RematPlannerError) and err.exit_code == 2
    text = str(err)
    assert "\n" not in text, text
    for needle in needles:
        assert needle in text, text


def test_api_empty_batch_from_a_workload_is_refused():
    """Batch size 0 in the API (the CLI refuses it in the config): a gpt2 step on zero
    sequences."""
    cfg = load_config(TINY, batch_size=2, seq_len=16)
    wl = build_workload(cfg)
    empty = (jax.ShapeDtypeStruct((0, 17), jnp.int32),)
    with pytest.raises(rp.UnsupportedModelError, match=r"the batch is empty \(int32\[0, 17\]\)"):
        rp.plan(wl.loss_fn, wl.abstract_params, empty, "1GB", verify=False)


@pytest.mark.parametrize("path_of, needle", [
    (lambda t: t / "nope.yaml", "no such config file"),
    (lambda t: t, "is a directory"),
    (lambda t: Path(_cfg(t, b"\xff\xfe")), "not UTF-8"),
    (lambda t: Path(_cfg(t, "type: gpt2\nbatch_size: [\n")), "invalid YAML"),
], ids=["missing", "directory", "not-utf8", "invalid-yaml"])
def test_api_load_config_errors_are_config_errors(tmp_path, path_of, needle):
    with pytest.raises(rp.ConfigError) as info:
        load_config(path_of(tmp_path))
    assert info.value.exit_code == 2 and needle in str(info.value)
    assert "\n" not in str(info.value)


# ------------------------------------------------------------------------------------------
# Real processes: the installed console script's exit codes and stderr
# ------------------------------------------------------------------------------------------

def _script() -> str:
    script = Path(sys.executable).with_name("remat-plan")
    found = str(script) if script.exists() else shutil.which("remat-plan")
    assert found, "the remat-plan console script is not installed (pip install -e .)"
    return found


@pytest.mark.parametrize("args, code", [
    (["configs/gpt2-tiny.yaml", "--budget", "-5GB"], 2),
    (["configs/gpt2-tiny.yaml", "--budget", "1MB", "--no-verify", *SMALL], 3),
], ids=["negative-budget", "infeasible"])
def test_console_script_exit_code_and_one_line(args, code):
    proc = subprocess.run([_script(), *args], capture_output=True, text=True, timeout=300,
                          cwd=ROOT)
    assert proc.returncode == code, proc.stderr
    assert proc.stdout == ""
    _one_line(proc.stderr)
