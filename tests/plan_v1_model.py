"""The small step of tests/data/plan-v1.json, a plan file in format version 1 (the signature,
has_aux, sharding and pinned values inside "metadata"), kept to test that such files still
load (tests/test_plan_files.py).

The file was written by the code of commit 775b036 (the last to write version 1) with

    XLA_FLAGS=--xla_force_host_platform_device_count=8 PYTHONPATH=. python tests/plan_v1_model.py

run from the repository root at that commit with this module added; with the code of
today the same command would write the current version, so do not rerun it to update the
file.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

WIDTH, DEPTH, BATCH = 64, 4, 16
MESH, SCHEME = "data=4,model=2", "fsdp+tp"


def loss_fn(params, x, y):
    """DEPTH residual MLP blocks (tensor-parallel by their kernels' names, so the down
    projections' outputs are all-reduced: the plan's pinned values); returns (loss, aux)."""
    h = x
    for block in params["blocks"]:
        h = h + jnp.tanh(h @ block["up_proj"]["kernel"]) @ block["down_proj"]["kernel"]
    out = h @ params["head"]
    loss = jnp.mean((out - y) ** 2)
    return loss, {"mean_h": jnp.mean(h)}


def abstract_inputs():
    f32 = jnp.float32
    block = {"up_proj": {"kernel": jax.ShapeDtypeStruct((WIDTH, 2 * WIDTH), f32)},
             "down_proj": {"kernel": jax.ShapeDtypeStruct((2 * WIDTH, WIDTH), f32)}}
    params = {"blocks": [block for _ in range(DEPTH)],
              "head": jax.ShapeDtypeStruct((WIDTH, 8), f32)}
    batch = (jax.ShapeDtypeStruct((BATCH, WIDTH), f32), jax.ShapeDtypeStruct((BATCH, 8), f32))
    return params, batch


def make_plan():
    import remat_planner as rp
    params, batch = abstract_inputs()
    an = rp.analyze(loss_fn, params, batch, measure_xla=False, calibrate=False, has_aux=True,
                    mesh=MESH, sharding=SCHEME)
    budget = (an.min_feasible_budget() + an.noremat_predicted_peak) // 2
    return rp.plan(loss_fn, params, batch, budget, verify=False, analysis=an, has_aux=True,
                   mesh=MESH, sharding=SCHEME)


if __name__ == "__main__":
    from pathlib import Path
    plan = make_plan()
    out = Path(__file__).resolve().parent / "data" / "plan-v1.json"
    out.write_text(plan.to_json() + "\n")
    print(out, plan.segments, plan.metadata)
