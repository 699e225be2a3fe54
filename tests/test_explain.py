"""`explain`: per-segment kept tensors add up, memory.png is written, Flax names, guide example."""

from __future__ import annotations

import json
import pathlib

import pytest

from example_runner import run_example
from remat_planner import planner as pl
from remat_planner.cli import main
from remat_planner.config import build_workload, load_config, make_optimizer
from remat_planner.explain import explain, flax_names

ROOT = pathlib.Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def explained(tmp_path_factory):
    out = tmp_path_factory.mktemp("explain")
    code = main(["explain", str(ROOT / "configs/gpt2-tiny.yaml"), "--budget", "20MB",
                 "--out", str(out)])
    return code, out


def _all_segments(segs):
    for s in segs:
        yield s
        yield from _all_segments(s["children"])


def test_explain_json_adds_up_and_png_written(explained):
    code, out = explained
    assert code == 0
    report = json.loads((out / "explain.json").read_text())
    segs = list(_all_segments(report["segments"]))
    assert segs
    for s in segs:
        assert s["saved_bytes"] == sum(t["nbytes"] for t in s["kept"])
        for t in s["kept"]:
            assert t["nbytes"] > 0 and t["primitive"] and t["dtype"]
    assert report["saved_bytes"] == sum(s["saved_bytes"] for s in segs)
    assert report["measured_peak_bytes"] <= report["budget_bytes"]
    png = out / "memory.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000


def test_kept_tensors_match_the_plan():
    cfg = load_config(str(ROOT / "configs/gpt2-tiny.yaml"))
    wl, opt = build_workload(cfg), make_optimizer(cfg.optimizer)
    an = pl.analyze(wl.loss_fn, wl.abstract_params, wl.abstract_batch, opt, calibrate=False)
    budget = (an.noremat_predicted_peak + an.min_feasible_budget()) // 2
    plan = pl.plan(wl.loss_fn, wl.abstract_params, wl.abstract_batch, budget, opt, analysis=an,
                   verify=False)
    ex = explain(an, plan)
    for seg, s in zip(plan.segments, ex.segments):
        named = [t for t in s.kept if t.what == "named value"]
        assert len(named) == len(seg.saved)  # every value the policy keeps is listed
        if seg.option == "nothing" and not seg.children:
            assert all(t.what == "input" for t in s.kept)
    names = flax_names(an, plan)
    assert names == plan.as_flax_names(an)
    assert len(names) == len(plan.segments)
    for entry, seg in zip(names, plan.segments):
        assert entry["remat"] == (seg.option != "store")
        if entry["remat"]:
            assert entry["policy"].startswith("jax.checkpoint_policies.")
            assert len(entry["checkpoint_names"]) == len(seg.saved)


def test_explain_bad_budget_exits_2(capsys):
    assert main(["explain", str(ROOT / "configs/gpt2-tiny.yaml"), "--budget", "lots"]) == 2
    assert len(capsys.readouterr().err.strip().splitlines()) == 1


def test_guide_example_runs():
    result = run_example(steps=5)
    plan = result["plan"]
    assert plan.measured_peak_bytes <= result["budget"]
    assert result["losses"][-1] < result["losses"][0]
    assert any(e["remat"] for e in result["flax_names"])
