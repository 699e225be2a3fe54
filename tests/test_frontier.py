"""`remat-plan frontier` and `--max-batch` (issue 3): files, frontier shape, knee, every
planner point within its budget by XLA, the built-in points, the max-batch search and the
one-line errors.

One frontier run on gpt2-tiny (module fixture) feeds the file and frontier tests; one
max-batch search on gpt2-tiny feeds the max-batch tests. Both are real XLA-verified runs.
"""

from __future__ import annotations

import contextlib
import csv
import io
import json
import random
from pathlib import Path

import pytest

from remat_planner import Plan, baselines
from remat_planner import frontier as fr_mod
from remat_planner import planner as pl
from remat_planner.cli import main
from remat_planner.config import build_workload, load_config, make_optimizer
from remat_planner.constants import MAX_COMPILES, MIN_POINTS
from remat_planner.frontier import sweep_budgets
from remat_planner.maxbatch import Probe, builtin_probe, largest_fitting
from remat_planner.step import Step
from remat_planner.verify import measure, step_digest

# Whole-step compiles at several budgets: left out of the README's test command, run by
# .ci/run's second part (`-m slow`).
pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
TINY = str(ROOT / "configs" / "gpt2-tiny.yaml")
BUDGET = 14_000_000  # max-batch budget for the two-layer config: a handful of probes


@pytest.fixture(scope="module")
def two_layer(tmp_path_factory):
    """gpt2-tiny with 2 blocks: the same code paths at half the compile time."""
    text = Path(TINY).read_text()
    assert "n_layer: 4" in text
    path = tmp_path_factory.mktemp("cfg") / "gpt2-two.yaml"
    path.write_text(text.replace("n_layer: 4", "n_layer: 2"))
    return str(path)


def run(capsys, *argv):
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


# Whole-step compiles of the module's frontier run, counted where they happen: the
# planner's (analysis and plan() calls) and the built-in policies'.
COMPILES: dict[str, int] = {}


@pytest.fixture(scope="module")
def frontier_run(tmp_path_factory, two_layer):
    out = tmp_path_factory.mktemp("frontier") / "out"
    stdout, stderr = io.StringIO(), io.StringIO()
    counts = {"planner": 0, "builtin": 0}

    def counting(where, real):
        def m(*a, **k):  # a compile: not a step found in verify.measure's `programs`
            programs = k.get("programs")
            before = None if programs is None else len(programs)
            out = real(*a, **k)
            counts[where] += programs is None or len(programs) > before
            return out
        return m

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(pl, "measure_step", counting("planner", pl.measure_step))
        mp.setattr(fr_mod, "measure_step", counting("builtin", fr_mod.measure_step))
        mp.setattr(fr_mod, "THREADS", True)  # the worker thread's path, whatever the load
        with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
            code = main(["frontier", two_layer, "--out", str(out), "--json"])
    assert code == 0, stderr.getvalue()
    COMPILES.update(counts)
    report = json.loads(stdout.getvalue())
    with open(out / "frontier.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    return report, rows, out


def _planner(rows):
    return [r for r in rows if r["kind"] == "planner"]


def _feasible(rows):
    return [r for r in _planner(rows) if r["xla_peak_bytes"]]


def test_writes_three_files(frontier_run):
    report, rows, out = frontier_run
    assert sorted(p.name for p in out.iterdir()) == ["frontier.csv", "frontier.md", "frontier.png"]
    assert (out / "frontier.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert (out / "frontier.png").stat().st_size > 10_000
    md = (out / "frontier.md").read_text()
    for name in baselines.NAMES:
        assert name in md
    assert "**knee**" in md
    assert report["files"]["csv"].endswith("frontier.csv")


def test_at_least_12_sweep_points_all_within_budget(frontier_run):
    report, rows, _ = frontier_run
    sweep = [r for r in _planner(rows) if r["label"].startswith("sweep")]
    assert len(sweep) >= MIN_POINTS
    assert all(r["xla_peak_bytes"] for r in sweep), "a sweep point was infeasible"
    budgets = [int(r["budget_bytes"]) for r in sweep]
    assert budgets == sorted(budgets) and len(set(budgets)) == len(budgets)
    # The sweep ends at the no-remat peak, measured in the same run.
    noremat = next(r for r in rows if r["label"] == baselines.NO_REMAT)
    assert budgets[-1] == int(noremat["xla_peak_bytes"])
    for r in _feasible(rows):
        assert int(r["xla_peak_bytes"]) <= int(r["budget_bytes"]), r["label"]


def test_frontier_is_monotone_and_undominated(frontier_run):
    _, rows, _ = frontier_run
    pts = [(int(r["xla_peak_bytes"]), float(r["overhead_pct"]), r["on_frontier"] == "1")
           for r in _feasible(rows)]
    front = sorted({(p, o) for p, o, on in pts if on})
    assert len(front) >= 3
    # Overhead strictly decreases as the peak grows along the frontier.
    assert all(o1 > o2 for (_, o1), (_, o2) in zip(front, front[1:])), front
    # No measured point beats a frontier point; every other point is beaten by one.
    for p, o, on in pts:
        beaten = any((q <= p and qo < o) or (q < p and qo <= o) for q, qo, _ in pts)
        assert beaten != on, (p, o, on)
        if not on:  # beaten by a frontier point in particular
            assert any((q <= p and qo < o) or (q < p and qo <= o) for q, qo in front)
    # The frontier reaches (about) zero overhead at its top.
    assert abs(front[-1][1]) < 0.5


def test_knee_is_marked_where_memory_stops_being_cheap(frontier_run):
    report, rows, _ = frontier_run
    knees = [r for r in rows if r["knee"] == "1"]
    assert len(knees) == 1 and knees[0]["on_frontier"] == "1"
    front = {(int(r["xla_peak_bytes"]), float(r["overhead_pct"]))
             for r in _feasible(rows) if r["on_frontier"] == "1"}
    top = max(front, key=lambda f: (f[0], -f[1]))
    lowest = min(f[0] for f in front)
    highest = max(f[1] for f in front)
    score = lambda f: (top[0] - f[0]) / (top[0] - lowest) - (f[1] - top[1]) / (highest - top[1])
    knee = (int(knees[0]["xla_peak_bytes"]), float(knees[0]["overhead_pct"]))
    assert score(knee) == pytest.approx(max(map(score, front)), abs=1e-6)
    assert lowest < knee[0] < top[0]  # strictly inside: neither end of the frontier
    assert [p["label"] for p in report["points"] if p["knee"]] == [knees[0]["label"]]


def test_builtin_points_and_comparison_at_their_peaks(frontier_run):
    report, rows, _ = frontier_run
    builtin = {r["label"]: r for r in rows if r["kind"] == "builtin"}
    assert set(builtin) == set(baselines.NAMES)
    assert float(builtin[baselines.NO_REMAT]["overhead_pct"]) == 0.0
    noremat_peak = int(builtin[baselines.NO_REMAT]["xla_peak_bytes"])
    for name in baselines.NAMES[1:]:
        # Every built-in policy trades memory for recompute on this model.
        assert int(builtin[name]["xla_peak_bytes"]) < noremat_peak, name
        assert float(builtin[name]["overhead_pct"]) > 0, name
    comps = {c["builtin"]: c for c in report["comparisons"]}
    assert set(comps) == set(baselines.NAMES[1:])
    for name, c in comps.items():
        assert c["budget_bytes"] == int(builtin[name]["xla_peak_bytes"])
        if c["planner_peak_bytes"] is not None:
            assert c["planner_peak_bytes"] <= c["budget_bytes"]
            row = next(r for r in rows if r["label"] == f"at {name} peak")
            pol = float(builtin[name]["recompute_flops"])
            mine = float(row["recompute_flops"])
            assert c["relative_recompute"] == pytest.approx((mine - pol) / pol, rel=1e-4)


def test_compiles_per_point_are_bounded(frontier_run):
    """Each planner call of the sweep spends at most its share of whole-step compiles
    (issue 20: 82 compiles for 17 calls made `frontier` on gpt2-tiny take 110 s); the
    `compiles` column is what was spent, every compile counted."""
    report, rows, _ = frontier_run
    planner = _planner(rows)
    spent = {r["label"]: int(r["compiles"]) for r in planner}
    n = len(spent) - (len(baselines.NAMES) - 1)
    low = f"sweep 1/{n}"
    for label, c in spent.items():
        if label == low:  # may retry twice at XLA's smallest feasible budget
            assert c <= fr_mod.SWEEP_COMPILES + 2 * fr_mod.LOW_END_COMPILES, (label, c)
        elif label.startswith("sweep"):
            assert c <= fr_mod.SWEEP_COMPILES, (label, c)
        else:  # at a built-in's peak: once more with a call's compiles if worse than it
            assert c <= fr_mod.SWEEP_COMPILES + MAX_COMPILES, (label, c)
            if c > fr_mod.SWEEP_COMPILES:
                comp = next(x for x in report["comparisons"] if label == f"at {x['builtin']} peak")
                assert comp["planner_peak_bytes"] is not None
    # Every compile is in the column (the rest are the analysis's: no remat and the
    # calibration), and the built-ins are measured once each.
    # (the per-block plans are measured where the built-ins are: frontier.measure)
    assert COMPILES["builtin"] == len(baselines.NAMES) - 1 + report["per_block_compiles"]
    assert 0 <= report["per_block_compiles"] <= len(pl.PER_BLOCK_RULES)
    assert report["per_block_compiles"] + report["per_block_shared"] <= len(pl.PER_BLOCK_RULES)
    analysis = COMPILES["planner"] - sum(spent.values())
    assert 1 <= analysis <= 3, (COMPILES, report["per_block_compiles"])
    # Far below what one plan() call per point may spend (constants.MAX_COMPILES each; the
    # sweep made 4.8 a call on gpt2-tiny before issue 20).
    assert sum(spent.values()) + report["per_block_compiles"] \
        <= 2 * len(spent) + MAX_COMPILES, spent
    assert sum(spent.values()) <= 2 * fr_mod.LOW_END_COMPILES \
        + (n + len(baselines.NAMES) - 1) * fr_mod.SWEEP_COMPILES \
        + sum(c > fr_mod.SWEEP_COMPILES for l, c in spent.items()
              if l.startswith("at ")) * MAX_COMPILES
    # Issue 20, point 8: the points between the ends aim below their budgets by the
    # model's measured error and compile nothing where the frontier is flat by the model
    # (aim); the no-remat end's plan stores every stage, so it is the step as written
    # (apply.apply_plan) and the analysis's no-remat compile is its measurement.
    # The two-layer frontier made 16 whole-step compiles before (analysis 2, built-ins 4,
    # planner points 10), 15 with the aiming, 14 with the no-remat end shared.
    assert spent[f"sweep {n}/{n}"] == 0
    assert COMPILES["planner"] + COMPILES["builtin"] <= 14, (COMPILES, spent)


def test_per_block_plans_share_the_builtins_programs(frontier_run, two_layer):
    """A per-block plan is the built-in policy per block, replayed: its step lowers to the
    same XLA program as the built-in's, so the sweep takes the built-in's measurement for
    it instead of compiling it again, and the digest tells different programs apart."""
    report, rows, _ = frontier_run
    # On gpt2-tiny every per-block plan is one of the built-ins' programs.
    assert report["per_block_shared"] == len(pl.PER_BLOCK_RULES)
    assert report["per_block_compiles"] == 0
    cfg = load_config(two_layer)
    wl, opt = build_workload(cfg), make_optimizer(cfg.optimizer)
    P, B = wl.abstract_params, wl.abstract_batch
    an = pl.analyze(wl.loss_fn, P, B, opt, calibrate=False)
    digests = {name: step_digest(baselines.builtin_loss(name, Step(wl.loss_fn), P, B), P, B, opt)
               for name in baselines.POLICIES}
    assert len(set(digests.values())) == len(digests)  # three different programs
    assert step_digest(wl.loss_fn, P, B, opt) not in digests.values()
    plans = []
    for segments in pl.per_block_plans(an):
        p = pl.plan_from_segments(an, segments, 10**9, 0, P, B)
        plans.append(step_digest(p.apply(wl.loss_fn), P, B, opt))
    assert sorted(plans) == sorted(digests.values())


def test_sweep_shots_aim_below_the_budget_by_the_last_error(two_layer):
    """Issue 20, point 8 (frontier speed): a sweep point between the ends compiles the
    model's plan at its budget less the error XLA measured on the model's last plan
    (per-block plans left out), and nothing where that plan was measured already or the
    frontier is flat by the model. XLA's figures are stand-ins here: no whole-step
    compile."""
    from remat_planner.verify import Measurement

    cfg = load_config(two_layer)
    wl, opt = build_workload(cfg), make_optimizer(cfg.optimizer)
    P, B = wl.abstract_params, wl.abstract_batch
    an = pl.analyze(wl.loss_fn, P, B, opt, calibrate=False)
    skip = set(pl.per_block_plans(an))
    assert skip
    top = an.noremat_predicted_peak
    budget = (an.min_feasible_budget() + top) // 2
    model_at = lambda b: pl.plan(wl.loss_fn, P, B, b, opt, analysis=an, verify=False)

    def measured(segments, peak, flops):
        an.verified[(segments, opt)] = Measurement(peak, flops, 0, 0, 0, 0, 0.0)

    # Nothing measured: the model's plan at the budget itself, to compile.
    model, error, need = fr_mod.aim(wl, opt, an, budget, skip=skip)
    assert error == 0 and need and model.segments == model_at(budget).segments
    # XLA puts it 3% over the model: the next point aims that much lower.
    over = top * 3 // 100
    measured(model.segments, model.predicted_peak_bytes + over, 2e9)
    assert fr_mod.model_error(an, skip) == over
    # A per-block plan measured after it (the model overstates those) does not count.
    measured(next(iter(skip)), 1, 1e9)
    assert fr_mod.model_error(an, skip) == over
    del an.verified[(next(iter(skip)), opt)]
    later = budget + 2 * over
    aimed, error, need = fr_mod.aim(wl, opt, an, later, skip=skip)
    assert error == over and aimed.segments == model_at(later - over).segments
    # It needs a compile unless it is the plan measured already, within `later`, or
    # recomputes less than it by under FLAT_GAIN (both by the model: flat)
    gain = model.recompute_overhead - aimed.recompute_overhead
    assert need == (aimed.segments != model.segments and gain >= fr_mod.FLAT_GAIN)
    # Measured already: no compile.
    measured(aimed.segments, later, 1.5e9)
    assert fr_mod.aim(wl, opt, an, later, skip=skip)[2] is False
    # Flat: the model's plan recomputes less than the cheapest measured within the budget
    # by under FLAT_GAIN of the step (both by the model). Within later + over XLA measured
    # the model's first plan (2e9 FLOPs) and the aimed one (1.5e9): the aimed is cheapest.
    nxt, _, need = fr_mod.aim(wl, opt, an, later + over, skip=skip)
    gain = aimed.recompute_overhead - nxt.recompute_overhead
    assert need == (gain >= fr_mod.FLAT_GAIN and (nxt.segments, opt) not in an.verified)


def test_sweep_threads_only_with_a_core_free(monkeypatch):
    """The sweep compiles on a worker thread only where the load average is below the core
    count (on 2 busy cores two compiles at once only compete), unless THREADS says."""
    import os

    monkeypatch.setattr(os, "cpu_count", lambda: 2)
    monkeypatch.setattr(fr_mod, "THREADS", None)
    monkeypatch.setattr(os, "getloadavg", lambda: (1.7, 1.0, 1.0))
    assert fr_mod.use_threads()
    monkeypatch.setattr(os, "getloadavg", lambda: (2.5, 1.0, 1.0))
    assert not fr_mod.use_threads()
    monkeypatch.setattr(fr_mod, "THREADS", True)
    assert fr_mod.use_threads()
    pool = fr_mod.InlineExecutor()
    assert pool.submit(lambda a, b: a + b, 1, b=2).result() == 3
    with pytest.raises(ZeroDivisionError):
        pool.submit(lambda: 1 / 0).result()


def test_plan_max_compiles_caps_one_call(two_layer):
    """planner.plan(max_compiles=k) makes at most k whole-step compiles on a given
    analysis, and a plan the analysis measured before costs none."""
    from remat_planner.errors import InfeasibleBudgetError

    cfg = load_config(two_layer)
    wl, opt = build_workload(cfg), make_optimizer(cfg.optimizer)
    P, B = wl.abstract_params, wl.abstract_batch
    an = pl.analyze(wl.loss_fn, P, B, opt)
    budget = (an.min_feasible_budget() + 3 * an.noremat.peak_bytes) // 4
    calls = []
    with pytest.MonkeyPatch.context() as mp:
        real = pl.measure_step
        mp.setattr(pl, "measure_step", lambda *a, **k: calls.append(1) or real(*a, **k))
        try:
            p = pl.plan(wl.loss_fn, P, B, budget, opt, analysis=an, max_compiles=1)
            assert p.metadata["compiles"] == 1 and p.measured_peak_bytes <= budget
        except InfeasibleBudgetError:  # the model's plan at the budget was over it
            p = None
        assert len(calls) == 1
        # Again with two: the first round is the plan measured above (no compile).
        again = pl.plan(wl.loss_fn, P, B, budget, opt, analysis=an, max_compiles=2)
        assert len(calls) == 1 + again.metadata["compiles"] <= 3
        assert again.measured_peak_bytes <= budget
        if p is not None:
            assert again.measured_flops <= p.measured_flops
        # The default: up to constants.MAX_COMPILES.
        n = len(calls)
        most = pl.plan(wl.loss_fn, P, B, (budget + an.noremat.peak_bytes) // 2, opt,
                       analysis=an)
        assert len(calls) - n == most.metadata["compiles"] <= MAX_COMPILES
    with pytest.raises(ValueError, match="max_compiles"):
        pl.plan(wl.loss_fn, P, B, budget, opt, analysis=an, max_compiles=0)


def test_sweep_budgets_are_geometric_and_span_the_range():
    b = sweep_budgets(1000, 64000, 13)
    assert b[0] == 1000 and b[-1] == 64000 and len(b) == 13
    ratios = [y / x for x, y in zip(b, b[1:])]
    assert max(ratios) - min(ratios) < 0.01


# ------------------------------------------------------------------------------------------
# --max-batch
# ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("fixed,per,budget,start", [
    (2e9, 3.2e9, 12e9, 8), (2e9, 0.51e9, 12e9, 8), (1, 1, 5.5, 1), (0, 1, 1000.5, 3),
    (10, 7, 100, 64)])
def test_search_finds_the_boundary(fixed, per, budget, start):
    rng = random.Random(0)
    calls = []

    def probe(b):
        calls.append(b)
        need = fixed + per * b
        noisy = need * (1 + 0.01 * rng.random())  # what a probe reports is not exactly affine
        return Probe(b, need <= budget, int(noisy), int(need))

    s = largest_fitting(probe, start, int(budget))
    truth = int((budget - fixed) // per)
    assert s.batch == truth
    assert s.probe(truth + 1) is not None and not s.probe(truth + 1).fits
    assert len(calls) == len(set(calls)) and len(calls) <= 12


def test_search_reports_nothing_when_batch_1_does_not_fit():
    s = largest_fitting(lambda b: Probe(b, False, 100 * b, 100 * b), 4, 50)
    assert s.best is None and s.batch == 0 and s.probe(1) is not None


@pytest.fixture(scope="module")
def max_batch_run(two_layer, tmp_path_factory):
    """`remat-plan CONFIG --budget B --max-batch --no-compare --json --out plan.json`."""
    out = tmp_path_factory.mktemp("maxbatch") / "plan.json"
    stdout, stderr = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
        code = main([two_layer, "--budget", str(BUDGET), "--max-batch", "--no-compare",
                     "--json", "--out", str(out)])
    assert code == 0, stderr.getvalue()
    return json.loads(stdout.getvalue()), out, two_layer


def test_max_batch_fits_and_the_next_does_not(max_batch_run):
    report, out, cfg_path = max_batch_run
    planner = report["planner"]
    probes = {p["batch_size"]: p for p in planner["probes"]}
    batch = planner["batch_size"]
    assert batch >= 1 and probes[batch]["fits"]
    assert planner["xla_peak_bytes"] <= BUDGET and planner["overhead"] >= 0
    assert batch + 1 in probes and not probes[batch + 1]["fits"]
    assert all(p["fits"] == (b <= batch) for b, p in probes.items())  # the search is consistent
    assert report["model"]["batch_size"] == batch
    assert report["builtin_policies"] == {}  # --no-compare
    # The plan written for that batch, applied to the step and compiled again by XLA.
    cfg = load_config(cfg_path, batch_size=batch)
    wl = build_workload(cfg)
    plan = Plan.from_json(out.read_text())
    m = measure(plan.apply(wl.loss_fn), wl.abstract_params, wl.abstract_batch,
                make_optimizer(cfg.optimizer))
    assert m.peak_bytes == planner["xla_peak_bytes"] <= BUDGET


def test_max_batch_without_remat_is_smaller_and_tight(max_batch_run):
    report, _, cfg_path = max_batch_run
    cfg = load_config(cfg_path)
    make = lambda b: build_workload(load_config(cfg_path, batch_size=b))
    nr = largest_fitting(builtin_probe(baselines.NO_REMAT, make, make_optimizer(cfg.optimizer),
                                       BUDGET), cfg.batch_size, BUDGET)
    assert 1 <= nr.batch < report["planner"]["batch_size"]
    assert nr.best.peak_bytes <= BUDGET < nr.probe(nr.batch + 1).peak_bytes


# ------------------------------------------------------------------------------------------
# Errors: one line, documented exit code, no traceback
# ------------------------------------------------------------------------------------------

def _one_line(err: str) -> str:
    lines = [l for l in err.splitlines() if l.strip()]
    assert len(lines) == 1, err
    assert "Traceback" not in err
    assert lines[0].startswith("remat-plan: error: ")
    return lines[0]


def test_points_below_12_exit_2(capsys, tmp_path):
    code, _, err = run(capsys, "frontier", TINY, "--out", tmp_path / "f", "--points", "5")
    assert code == 2
    assert "--points must be at least 12, got 5" in _one_line(err)


@pytest.mark.parametrize("under_a_file", [False, True])
def test_bad_out_exits_2_before_planning(capsys, tmp_path, under_a_file):
    file = tmp_path / "file.txt"
    file.write_text("x")
    code, stdout, err = run(capsys, "frontier", TINY, "--out",
                            file / "sub" if under_a_file else file)
    assert code == 2 and stdout == ""
    assert "cannot write --out" in _one_line(err)


def test_max_batch_infeasible_at_batch_1_exits_3(capsys):
    code, _, err = run(capsys, TINY, "--budget", "1MB", "--max-batch", "--batch-size", "1")
    assert code == 3
    line = _one_line(err)
    assert "even at batch size 1" in line and "raise --budget to at least" in line


def test_max_batch_refuses_no_verify(capsys):
    code, _, err = run(capsys, TINY, "--budget", "20MB", "--max-batch", "--no-verify")
    assert code == 2
    assert "--max-batch verifies every answer with XLA" in _one_line(err)


def test_frontier_help_lists_exit_codes(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["frontier", "--help"])
    assert exc.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: remat-plan frontier") and "exit codes:" in out
    assert "--points below 12" in out


@pytest.mark.parametrize("scan_layers", [False, True], ids=["unrolled", "scanned"])
def test_sqrt_n_grouping_is_exact_and_saves_memory(tmp_path, scan_layers):
    """The sqrt(n) comparison point computes the same loss and gradients, and (scanned) its
    XLA peak is below the step without remat."""
    import jax
    import numpy as np

    cfg_path = tmp_path / "four.yaml"
    cfg_path.write_text(Path(TINY).read_text()
                        .replace("scan_layers: false", f"scan_layers: {str(scan_layers).lower()}")
                        .replace("d_model: 128", "d_model: 32").replace("vocab_size: 512",
                                                                        "vocab_size: 64"))
    cfg = load_config(cfg_path, batch_size=2, seq_len=16)
    wl = build_workload(cfg)
    loss, how = baselines.sqrt_grouping_loss(wl.loss_fn, wl.abstract_params, wl.abstract_batch)
    assert ("scan of 4 layers in 2" if scan_layers else "4 blocks in 2") in how
    key = jax.random.key(0)
    params, batch = wl.init_params(key), wl.synthetic_batch(key)
    opts = {"xla_disable_hlo_passes": "cse_barrier_expander"}
    want = jax.jit(jax.value_and_grad(wl.loss_fn), compiler_options=opts)(params, *batch)
    got = jax.jit(jax.value_and_grad(loss), compiler_options=opts)(params, *batch)
    for a, b in zip(jax.tree.leaves(want), jax.tree.leaves(got)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=2e-5, atol=1e-6)
    if not scan_layers:
        return  # the unrolled grouping's XLA figures are checked by the frontier run
    opt = make_optimizer(cfg.optimizer)
    plain = measure(wl.loss_fn, wl.abstract_params, wl.abstract_batch, opt)
    grouped = measure(loss, wl.abstract_params, wl.abstract_batch, opt)
    assert grouped.peak_bytes < plain.peak_bytes
    assert grouped.flops > plain.flops
