"""Issue 3's comparison at real size: GPT-2 small (124M parameters, batch 8 x 1024, scanned
layers, AdamW), planned on abstract shapes; nothing is allocated. With each JAX policy's
XLA peak as the budget, the planner's XLA peak fits it and its XLA-measured recompute is
no more than the policy's, and at dots_with_no_batch_dims_saveable's at least 10% less
(measured 2026-12-04: 3.87% against 4.58%; docs/benchmarks.md)."""

from __future__ import annotations

import pytest

from remat_planner import planner as pl
from remat_planner.config import build_workload, load_config, make_optimizer


@pytest.mark.slow
@pytest.mark.extended
def test_gpt2_small_planner_fits_each_builtin_peak_and_recomputes_no_more():
    cfg = load_config("configs/gpt2-small.yaml")
    wl = build_workload(cfg)
    opt = make_optimizer(cfg.optimizer)
    P, B = wl.abstract_params, wl.abstract_batch
    an = pl.analyze(wl.loss_fn, P, B, opt)
    base = pl.measure_builtin_policies(wl.loss_fn, P, B, opt)
    nr = base["no_remat"].flops
    table = []
    for name in ("dots_saveable", "dots_with_no_batch_dims_saveable", "nothing_saveable"):
        policy = base[name]
        p = pl.plan(wl.loss_fn, P, B, policy.peak_bytes, opt, analysis=an)
        ours, theirs = p.measured_flops - nr, policy.flops - nr
        table.append((name, policy.peak_bytes, p.measured_peak_bytes, theirs / nr, ours / nr))
        assert p.measured_peak_bytes <= policy.peak_bytes, table
        assert ours <= theirs, table
        if name == "dots_with_no_batch_dims_saveable":
            assert ours <= 0.9 * theirs, table
    print("\n" + "\n".join(f"{n}: budget {b}, planner peak {m}, policy {t:.3%}, planner {o:.3%}"
                           for n, b, m, t, o in table))
