"""Issue 20, "speak the user's language": sizes in the budget's unit family, plans a person
can read, `--plan FILE`, output that survives pipes, memory.png's layout, error wording.

Planning here is model-only on a small gpt2-tiny (batch 2 x 16) except the `--plan` round
trip, which compiles the saved plan once with XLA, as the command does.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

import remat_planner as rp
from remat_planner import planner as pl
from remat_planner.budget import parse_budget, units_of
from remat_planner.cli import main
from remat_planner.config import build_workload, load_config, make_optimizer
from remat_planner.describe import scan_words, stage_label
from remat_planner.errors import InfeasibleBudgetError
from remat_planner.units import DEFAULT_UNITS, Units, format_flops, round_up_display

ROOT = Path(__file__).resolve().parents[1]
TINY = str(ROOT / "configs" / "gpt2-tiny.yaml")
GOOD = Path(TINY).read_text()
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


@pytest.fixture(scope="module")
def small():
    """Model-only analysis and a plan that checkpoints something, on gpt2-tiny 2 x 16."""
    cfg = load_config(TINY, batch_size=2, seq_len=16)
    wl, opt = build_workload(cfg), make_optimizer(cfg.optimizer)
    an = pl.analyze(wl.loss_fn, wl.abstract_params, wl.abstract_batch, opt, measure_xla=False,
                    calibrate=False)
    budget = (an.min_feasible_budget() + an.noremat_predicted_peak) // 2
    plan = rp.plan(wl.loss_fn, wl.abstract_params, wl.abstract_batch, budget, opt,
                   verify=False, analysis=an)
    assert any(s.is_checkpoint for s in plan.segments)
    return wl, opt, an, plan


# ------------------------------------------------------------------------------------------
# 1. one unit family, the user's
# ------------------------------------------------------------------------------------------

@pytest.mark.parametrize(("typed", "family"), [
    ("12GB", Units.DECIMAL), ("20 MB", Units.DECIMAL), ("1kb", Units.DECIMAL),
    ("11GiB", Units.BINARY), ("19.5 MiB", Units.BINARY), (" 3gib ", Units.BINARY),
    ("12000000000", DEFAULT_UNITS), (12_000_000_000, DEFAULT_UNITS), (None, DEFAULT_UNITS),
])
def test_unit_family_is_read_from_the_budget(typed, family):
    assert units_of(typed) is family
    assert DEFAULT_UNITS is Units.DECIMAL  # documented: plain bytes are shown in GB / MB


def test_sizes_format_in_the_family_typed():
    assert Units.DECIMAL.format(parse_budget("12GB")) == "12.00 GB"
    assert Units.BINARY.format(parse_budget("11GiB")) == "11.00 GiB"
    assert Units.DECIMAL.scale(27.6e6) == (1e6, "MB")
    assert Units.BINARY.scale(3 * 2**30) == (2**30, "GiB")
    # a suggested budget rounds up in the family it is printed in, never below the need
    need = 1_234_567_891
    for units in Units:
        shown = units.format(round_up_display(need, units))
        assert parse_budget(shown.replace(" ", "")) >= need
        assert shown.endswith("GiB" if units is Units.BINARY else " GB")


def test_infeasible_budget_error_speaks_the_budgets_family():
    e = InfeasibleBudgetError(11 * 2**30, 12 * 2**30 + 5).in_units(Units.BINARY)
    text = str(e)
    assert "budget 11.00 GiB" in text and "at least 12.01 GiB" in text
    assert " GB" not in text and e.exit_code == 3


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


def test_flops_shown_in_a_unit_that_shows_them():
    assert format_flops(6.17e6) == "6.17 MFLOP"
    assert format_flops(1.39e9) == "1.39 GFLOP"
    assert format_flops(0) == "0 FLOP"


# ------------------------------------------------------------------------------------------
# 2. plans a person can read
# ------------------------------------------------------------------------------------------

def test_print_plan_is_a_table_not_a_dataclass_dump(small):
    _, _, _, plan = small
    text = str(plan)
    assert text == plan.summary()
    assert repr(plan).startswith("Plan(segments=")  # repr stays the dataclass's
    assert "Segment(" not in text and "eqns[" not in text and "stages 0-0" not in text
    assert "GPT2/h_0 (ln_1, attn)" in text and "GPT2 (ln_f, wte.attend) + loss" in text
    assert "inputs + projections" in text or "its inputs only" in text
    for meaning in ("budget", "predicted peak", "XLA peak", "recompute"):
        assert re.search(rf"^  {meaning} +\S", text, re.M), (meaning, text)
    assert "recompute time" not in text  # a FLOPs plan: no time prediction shown


def test_summary_with_analysis_has_bytes_flops_and_names_the_loss(small):
    _, _, an, plan = small
    text = plan.summary(an, Units.BINARY)
    lines = text.splitlines()
    assert lines[1].split() == ["segment", "(modules)", "keeps", "kept", "recomputes", "of",
                                "step"]
    assert "loss (softmax cross-entropy)" in text and "eqns[" not in text
    rows = [l for l in lines[3:] if re.search(r"\d%$", l)]
    assert len(rows) >= len(plan.segments)
    assert all(re.search(r"[KMG]iB|\d B", r) for r in rows), rows
    assert any(re.search(r"\d+\.\d\d [kMG]FLOP +\d+\.\d\d%$", r) for r in rows), rows
    assert " MB" not in text and "MiB" in text


def test_nested_regions_are_indented(small):
    wl, opt, an, _ = small
    plan = rp.plan(wl.loss_fn, wl.abstract_params, wl.abstract_batch,
                   an.min_feasible_budget(), opt, verify=False, analysis=an)
    assert any(s.children for s in plan.segments)
    text = plan.summary(an)
    assert "one checkpoint around the segments below" in text
    assert re.search(r"^  +\S.*to .*\(\d+ stages\)|^    \S", text, re.M), text


def test_no_remat_needed_is_said(small):
    wl, opt, an, _ = small
    plan = rp.plan(wl.loss_fn, wl.abstract_params, wl.abstract_batch,
                   an.noremat_predicted_peak * 2, opt, verify=False, analysis=an)
    assert "no remat needed" in plan.summary(an)


def test_scan_scheme_in_words():
    text = scan_words("scan:12x2*dots_narrow|dots_no_batch;dots|dots_no_batch",
                      ["attention", "MLP"])
    # `2*a;b`: three layers per iteration, the first two with plan a
    assert text.startswith("12 layers, 3 per iteration: layers 1-2 of each iteration: "
                           "attention keeps projections and probs @ V, MLP keeps projections; "
                           "layer 3 of each iteration: attention keeps dots, MLP keeps "
                           "projections"), text
    assert scan_words("scan:12x2*dots|dots_no_batch", ["attention", "MLP"]) == (
        "12 layers, 2 per iteration: attention keeps dots, MLP keeps projections")
    text = scan_words("scan:4x[nothing]/2")
    assert text.startswith("4 layers, in 2 checkpointed groups of 2 iterations")
    assert text.endswith("each layer is one checkpoint that keeps its inputs only")


def test_unnamed_code_named_by_what_it_computes(small):
    _, _, an, plan = small
    last = plan.stages[-1]  # the head's modules and the loss after them: one stage
    assert stage_label(last.name, an.program, span=(last.start, last.stop)) == \
        "GPT2 (ln_f, wte.attend) + loss (softmax cross-entropy)"
    head = [i for i, e in enumerate(an.program.eqns) if e.module_path.strip("/")][-1] + 1
    assert stage_label(f"eqns[{head}:{len(an.program.eqns)}]", an.program) == \
        "loss (softmax cross-entropy)"
    assert stage_label("eqns[3:9]").startswith("code outside any module (equations 3-8)")


# ------------------------------------------------------------------------------------------
# 3. --plan FILE
# ------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def saved_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("plans") / "tiny.plan.json"
    code = main([TINY, "--budget", "20MiB", *SMALL, "--no-verify", "--no-compare", "--json",
                 "--out", str(path)])
    assert code == 0
    return path


def test_plan_file_round_trip_verified_with_xla(capsys, saved_file):
    code, out, err = run(capsys, TINY, "--plan", saved_file, *SMALL, "--no-compare", "--json")
    assert code == 0, err
    report = json.loads(out)
    saved = rp.Plan.from_json(saved_file.read_text())
    assert report["budget_bytes"] == saved.budget_bytes == 20 * 2**20
    assert report["plan"]["segments"] and report["plan"]["fits"] is True
    assert 0 < report["plan"]["measured_peak_bytes"] <= report["budget_bytes"]
    # the human report of the same: MiB, as the budget was typed when the plan was made
    code, out, err = run(capsys, TINY, "--plan", saved_file, *SMALL, "--no-verify")
    assert code == 0, err
    assert f"plan loaded from {saved_file}" in out and "MiB" in out and " MB" not in out


@pytest.mark.parametrize("command", [[], ["train", "--steps", "1"], ["explain"]],
                         ids=["plan", "train", "explain"])
def test_plan_file_for_another_step_exits_2_naming_the_difference(capsys, saved_file, command):
    argv = [*command[:1], TINY, "--plan", saved_file, "--batch-size", "3", "--seq-len", "16",
            *command[1:]]
    code, out, err = run(capsys, *argv)
    assert code == 2 and out == ""
    line = _one_line(err)
    assert "batch[0]: int32[3, 17] (plan: int32[2, 17])" in line, line


def test_plan_file_over_the_budget_exits_3(capsys, saved_file):
    code, out, err = run(capsys, TINY, "--plan", saved_file, *SMALL, "--budget", "1MiB",
                         "--no-compare", "--json")
    assert code == 3
    line = _one_line(err)
    assert "does not fit the budget" in line and "MiB" in line and "re-plan" in line


def test_plan_file_unreadable_or_damaged_exits_2(capsys, tmp_path, saved_file):
    code, _, err = run(capsys, TINY, "--plan", tmp_path / "none.json", *SMALL)
    assert code == 2 and "cannot read --plan" in _one_line(err)
    bad = tmp_path / "edited.json"
    bad.write_text(saved_file.read_text().replace('"budget_bytes": ', '"budget_bytes": 1'))
    code, _, err = run(capsys, TINY, "--plan", bad, *SMALL)
    assert code == 2 and "changed after it was written" in _one_line(err)


# ------------------------------------------------------------------------------------------
# 5. output that survives pipes
# ------------------------------------------------------------------------------------------

def test_piped_output_cuts_no_cell(capsys):
    code, out, err = run(capsys, TINY, "--budget", "20MB", "--no-verify", "--no-compare")
    assert code == 0, err
    assert "…" not in out and "..." not in out.replace(" ... ", "")
    for name in ("GPT2/h_3 (ln_2, mlp)", "loss (softmax cross-entropy)",
                 "of which live only in their stage's backward", "plan: XLA-verified peak"):
        assert name in out, name
    # A built-in's name long enough that its table (six columns) needs some 150 columns:
    # piped (capsys's stdout is not a terminal), the console is wide enough for it, where
    # rich's default of 80 columns would fold or cut the name.
    import dataclasses

    from remat_planner.cli import print_frontier
    long = "dots_with_no_batch_dims_saveable_and_then_some_more_words"
    fr = _small_frontier()
    (cmp_,) = fr.comparisons
    fr = dataclasses.replace(fr, comparisons=[
        dataclasses.replace(cmp_, builtin=dataclasses.replace(cmp_.builtin, label=long))])
    print_frontier(fr, DEFAULT_UNITS)
    out = capsys.readouterr().out
    assert long in out and "…" not in out


# ------------------------------------------------------------------------------------------
# 6. memory.png: legend and notes off the curves, tick labels inside the figure
# ------------------------------------------------------------------------------------------

def test_memory_png_layout(small):
    import matplotlib.pyplot as plt

    from remat_planner.explain import memory_figure
    _, _, an, plan = small
    fig = memory_figure(an, plan, Units.BINARY)
    try:
        fig.canvas.draw()
        renderer = fig.canvas.get_renderer()
        (ax,) = fig.axes
        axes_box = ax.get_window_extent(renderer)
        figure_box = fig.bbox
        legends = fig.legends + ([ax.get_legend()] if ax.get_legend() else [])
        assert legends
        for legend in legends:  # the legend (with the peak note in it) never covers the plot
            box = legend.get_window_extent(renderer)
            assert not box.overlaps(axes_box), (box, axes_box)
            assert figure_box.contains(box.x0, box.y0) and figure_box.contains(box.x1 - 1, box.y1 - 1)
        assert not [t for t in ax.texts if t.get_window_extent(renderer).overlaps(axes_box)]
        (x0, x1), (y0, y1) = ax.get_xlim(), ax.get_ylim()
        labels = [l for l in ax.get_xticklabels() if x0 <= l.get_position()[0] <= x1] + \
                 [l for l in ax.get_yticklabels() if y0 <= l.get_position()[1] <= y1]
        assert len(labels) > 10
        for label in labels:
            box = label.get_window_extent(renderer)
            assert box.x0 >= 0 and box.y0 >= 0, (label.get_text(), box)
            assert box.x1 <= figure_box.x1 and box.y1 <= figure_box.y1, (label.get_text(), box)
        assert ax.get_ylabel() == "live bytes (MiB)"
        # the head and the loss (one stage) by its modules' names, not eqns[...]
        assert any("GPT2 (ln_f, wte.attend)" in t.get_text() for t in ax.get_xticklabels())
    finally:
        plt.close(fig)


# ------------------------------------------------------------------------------------------
# 7. errors name their cause
# ------------------------------------------------------------------------------------------

def test_unknown_field_is_reported_first(capsys, tmp_path):
    path = tmp_path / "typo.yaml"
    path.write_text(GOOD.replace("batch_size: 4", "bach_size: 4"))
    code, out, err = run(capsys, path, "--budget", "1GB")
    line = _one_line(err)
    assert code == 2
    assert "unknown field 'bach_size'" in line and "did you mean 'batch_size'" in line
    assert line.index("unknown field") < line.find("missing") if "missing" in line else True


@pytest.mark.parametrize(("flags", "flag"), [(["--batch-size", "0"], "--batch-size 0"),
                                             (["--seq-len", "-2"], "--seq-len -2"),
                                             (["--seq-len", "129"], "--seq-len 129")])
def test_bad_flag_value_names_the_flag(capsys, flags, flag):
    code, out, err = run(capsys, TINY, "--budget", "1GB", "--no-verify", *flags)
    line = _one_line(err)
    assert code == 2 and out == ""
    assert line.startswith(f"remat-plan: error: {flag}: "), line


def test_model_table_reads_booleans_and_says_no_remat_needed(capsys):
    code, out, err = run(capsys, TINY, "--budget", "1GB", "--no-verify", "--no-compare")
    assert code == 0, err
    assert re.search(r"scan_layers\s*│\s*no\s", out), out
    assert "no remat needed" in out
    code, out, err = run(capsys, TINY, "--budget", "20MB", "--no-verify", "--no-compare")
    assert "no remat needed" not in out


# ------------------------------------------------------------------------------------------
# 1. frontier.md and frontier.png in one family (formatting of a small hand-made frontier)
# ------------------------------------------------------------------------------------------

def _small_frontier():
    from remat_planner import frontier as fr_mod
    flops = 1e9
    noremat = fr_mod.Point("builtin", "no_remat", None, 28_770_000, flops, flops)
    sweep = [fr_mod.Point("planner", f"sweep {i + 1}/3", b, peak, flops * (1 + o), flops)
             for i, (b, peak, o) in enumerate([(16_000_000, 15_900_000, 0.12),
                                               (18_000_000, 17_900_000, 0.02),
                                               (28_770_000, 27_000_000, 0.0)])]
    fr_mod.mark_frontier(sweep)
    builtin = fr_mod.Point("builtin", "dots_with_no_batch_dims_saveable", None, 17_970_000,
                           flops * 1.032, flops, plan="per block")
    planner = fr_mod.Point("planner", "at dots_with_no_batch_dims_saveable peak", 17_970_000,
                           17_500_000, flops * 1.02, flops)
    return fr_mod.Frontier("configs/gpt2-tiny.yaml", {"n_layer": 4}, noremat, sweep + [planner],
                           [noremat, builtin], [fr_mod.Comparison(builtin, planner)], 1.0, 1.0)


@pytest.mark.parametrize(("units", "unit"), [(Units.DECIMAL, "MB"), (Units.BINARY, "MiB")])
def test_frontier_md_and_png_axis_share_the_family(monkeypatch, tmp_path, capsys, units, unit):
    import matplotlib.pyplot as plt

    from remat_planner import frontier as fr_mod
    from remat_planner.cli import print_frontier
    fr = _small_frontier()
    md = fr_mod.markdown(fr, "remat-plan frontier ...", units)
    other = "MiB" if unit == "MB" else " MB"
    assert f" {unit}" in md and other not in md
    knee = fr.knee
    assert knee is not None
    shown = units.format(knee.peak_bytes)
    assert f"XLA peak {shown}" in md
    figures = []
    monkeypatch.setattr(plt, "close", lambda fig=None: figures.append(fig))
    fr_mod.plot(fr, str(tmp_path / "frontier.png"), units)
    (fig,) = figures
    ax = fig.axes[0]
    assert ax.get_xlabel() == f"XLA peak of the training step ({unit})"
    star = [l for l in ax.get_lines() if l.get_marker() == "*"]
    assert star and f"{star[0].get_xdata()[0]:.2f} {unit}" == shown  # the knee sits where the .md says
    print_frontier(fr, units)
    out = capsys.readouterr().out
    assert f" {unit}" in out and other not in out and "…" not in out
    assert "dots_with_no_batch_dims_saveable" in out


def test_saved_scan_plan_prints_its_layers_in_words(capsys, tmp_path):
    config = tmp_path / "gpt2-tiny-scan.yaml"
    config.write_text(GOOD.replace("scan_layers: false", "scan_layers: true"))
    path = tmp_path / "scan.plan.json"
    code, out, err = run(capsys, config, "--budget", "20MB", "--no-verify", "--no-compare",
                         "--out", path)
    assert code == 0, err
    plan = rp.Plan.from_json(path.read_text())
    (scheme,) = [s.option for s in plan.segments if s.option.startswith("scan:")]
    text = str(plan)
    assert scheme not in text and "4 layers" in text
    assert "attention keeps" in text and "MLP keeps" in text, text
    assert "4 layers" in out and "attention keeps" in out


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


def test_plain_jax_code_is_named_by_what_it_computes():
    import jax
    import jax.numpy as jnp

    def loss(p, x, y):
        h = x
        for w in p:
            h = jnp.tanh(h @ w)
        return jnp.mean((h - y) ** 2)

    params = [jax.ShapeDtypeStruct((64, 64), jnp.float32) for _ in range(4)]
    x = jax.ShapeDtypeStruct((32, 64), jnp.float32)
    an = pl.analyze(loss, params, (x, x), None, measure_xla=False, calibrate=False)
    plan = rp.plan(loss, params, (x, x), (an.min_feasible_budget() + an.noremat_predicted_peak)
                   // 2, None, verify=False, analysis=an)
    text = plan.summary(an)
    assert "eqns[" not in text
    assert "code outside any module (stage 0): dot_general, tanh" in text, text
    assert re.search(r"^loss \((mean|mean squared error)\)", text, re.M), text


@pytest.mark.slow
def test_the_example_prints_the_exported_flax_form(capsys):
    """examples/own_training_loop.py prints what to write by hand (issue 20, point 5): the
    policy functions and the blocks to wrap, one nn.remat per module, none overlapping;
    not as_flax_names' 'nn.remat over [...]' module lists."""
    from example_runner import run_example

    result = run_example(steps=1, name="own_training_loop_printed")
    out = capsys.readouterr().out
    exported = result["exported"]
    assert exported.exact and exported.wraps
    assert "nn.remat over" not in out
    assert exported.to_python() in out
    assert "def policy_0(prim, *avals, **params)" in out
    wrapped = re.findall(r"^# (block_\d+): nn\.remat\(ResidualBlock, policy=policy_\d+\)", out,
                         re.MULTILINE)
    assert wrapped == [w.scope for w in exported.wraps]
    assert len(set(wrapped)) == len(wrapped)
