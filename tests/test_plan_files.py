"""Plan files: a plan is refused, in one line naming what differs, for another model, batch
size or dtype; a truncated or edited file is refused cleanly (PlanMismatchError).

The CLI has no command that reads a plan file (`--out` only writes one), so loading is
tested through the API: `Plan.from_json`, `plan.apply`, `measure`, `train_step`.
Planning here is model-only on a small gpt2 (no XLA compile but the optimizer update's).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import jax
import pytest

import remat_planner as rp
from remat_planner import planner as pl
from remat_planner.config import build_workload, load_config, make_optimizer
from remat_planner.plan import plan_checksum

ROOT = Path(__file__).resolve().parents[1]
GPT2_TINY = ROOT / "configs" / "gpt2-tiny.yaml"
SMALL = {"batch_size": 2, "seq_len": 16}


def _workload(tmp_path=None, config=GPT2_TINY, edit=None, **overrides):
    path = config
    if edit is not None:
        path = tmp_path / f"edited-{config.name}"
        text = config.read_text()
        for old, new in edit:
            assert old in text, old
            text = text.replace(old, new)
        path.write_text(text)
    cfg = load_config(path, **{**SMALL, **overrides})
    return build_workload(cfg), make_optimizer(cfg.optimizer)


@pytest.fixture(scope="module")
def saved():
    """A model-only plan of a small gpt2 that checkpoints something, and its JSON text."""
    wl, opt = _workload()
    an = pl.analyze(wl.loss_fn, wl.abstract_params, wl.abstract_batch, opt, measure_xla=False,
                    calibrate=False)
    budget = (an.min_feasible_budget() + an.noremat_predicted_peak) // 2
    plan = rp.plan(wl.loss_fn, wl.abstract_params, wl.abstract_batch, budget, opt,
                   verify=False, analysis=an)
    assert any(s.is_checkpoint for s in plan.segments)
    return wl, opt, plan, plan.to_json()


def _assert_refused(exc_info) -> str:
    err = exc_info.value
    assert isinstance(err, rp.PlanMismatchError) and err.exit_code == 2
    text = str(err)
    assert "\n" not in text and "Traceback" not in text, text
    return text


def _apply_abstract(plan, wl):
    """Trace the planned loss on the workload's shapes (nothing is computed)."""
    return jax.eval_shape(plan.apply(wl.loss_fn), wl.abstract_params, *wl.abstract_batch)


# ------------------------------------------------------------------------------------------
# The same computation loads and applies; the file is stable
# ------------------------------------------------------------------------------------------

def test_round_trip_and_reformatting_are_accepted(saved):
    _, _, plan, text = saved
    loaded = rp.Plan.from_json(text)
    assert loaded == plan and loaded.to_json() == text
    # Re-indented or reordered by an editor: same content, still accepted.
    reformatted = json.dumps(json.loads(text), indent=4)
    assert rp.Plan.from_json(reformatted) == plan
    # A fresh build of the same config traces to the same fingerprint.
    again, _ = _workload()
    assert _apply_abstract(loaded, again).shape == ()


# ------------------------------------------------------------------------------------------
# Another model, batch size or dtype: refused, naming what differs
# ------------------------------------------------------------------------------------------

MISMATCHES = {
    # name: (config, edits of the YAML, overrides, texts the message must contain)
    "batch-size": (GPT2_TINY, None, {"batch_size": 3},
                   ["batch[0]: int32[3, 17] (plan: int32[2, 17])"]),
    "seq-len": (GPT2_TINY, None, {"seq_len": 8}, ["batch[0]: int32[2, 9] (plan: int32[2, 17])"]),
    "fewer-layers": (GPT2_TINY, [("n_layer: 4", "n_layer: 2")], {}, ["params: ", "(plan: "]),
    "other-model-type": (ROOT / "configs" / "llama-tiny.yaml", None, {}, ["params: "]),
    "compute-dtype": (GPT2_TINY, [("  dtype: float32", "  dtype: bfloat16")], {},
                      ["compute dtypes: bfloat16", "(plan: float32)"]),
    "param-dtype": (GPT2_TINY, [("param_dtype: float32", "param_dtype: bfloat16")], {},
                    ["values (bfloat16) (plan: ", "values (float32))"]),
}


@pytest.mark.parametrize("config, edit, overrides, needles", MISMATCHES.values(),
                         ids=MISMATCHES.keys())
def test_plan_for_another_computation_is_refused(saved, tmp_path, config, edit, overrides,
                                                 needles):
    _, _, _, text = saved
    other, _ = _workload(tmp_path, config, edit, **overrides)
    plan = rp.Plan.from_json(text)
    with pytest.raises(rp.PlanMismatchError) as info:
        _apply_abstract(plan, other)
    message = _assert_refused(info)
    assert message.startswith("plan does not match this computation: ")
    assert "re-plan for these inputs" in message
    for needle in needles:
        assert needle in message, message


def test_measure_and_train_step_refuse_a_mismatched_plan(saved, tmp_path):
    _, _, _, text = saved
    other, opt = _workload(tmp_path, batch_size=3)
    plan = rp.Plan.from_json(text)
    with pytest.raises(rp.PlanMismatchError, match=r"batch\[0\]"):
        rp.measure(plan.apply(other.loss_fn), other.abstract_params, other.abstract_batch, opt)
    step = rp.train_step(other.loss_fn, opt, plan)
    opt_state = jax.eval_shape(opt.init, other.abstract_params)
    with pytest.raises(rp.PlanMismatchError, match=r"batch\[0\]"):
        step.lower(other.abstract_params, opt_state, other.abstract_batch)


# ------------------------------------------------------------------------------------------
# Truncated or edited files
# ------------------------------------------------------------------------------------------

def test_truncated_file_is_refused_at_every_length(saved):
    _, _, _, text = saved
    cuts = sorted({0, 1, len(text) - 1, len(text) - 2,
                   *range(0, len(text), max(1, len(text) // 40))})
    for cut in cuts:
        with pytest.raises(rp.PlanMismatchError) as info:
            rp.Plan.from_json(text[:cut])
        assert "re-run remat-plan --out" in _assert_refused(info)


def _edit(text: str, fn, rechecksum: bool = False) -> str:
    d = json.loads(text)
    fn(d)
    if rechecksum:  # a writer that recomputes the checksum: the structure is checked too
        d.pop("checksum", None)
        d["checksum"] = plan_checksum(d)
    return json.dumps(d, indent=1, sort_keys=True)


def _set(path, value):
    def fn(d):
        *head, last = path
        for p in head:
            d = d[p]
        d[last] = value
    return fn


EDITS = {
    # name: (edit of the parsed JSON, recompute the checksum, text the message must contain)
    "budget-number": (_set(["budget_bytes"], 1), False, "checksum mismatch"),
    "measured-peak": (_set(["measured_peak_bytes"], 0), False, "checksum mismatch"),
    "segment-option": (lambda d: d["segments"][0].update(
        option="nothing" if d["segments"][0]["option"] == "store" else "store"),
        False, "checksum mismatch"),
    "fingerprint": (_set(["fingerprint"], "0" * 16), False, "checksum mismatch"),
    "checksum-removed": (lambda d: d.pop("checksum"), False, "checksum missing"),
    "checksum-forged": (_set(["checksum"], "f" * 16), False, "checksum mismatch"),
    "unknown-option": (_set(["segments", 0, "option"], "bogus"), True, "unknown keep option"),
    "segment-gap": (_set(["segments", 0, "start"], 1), True, "does not continue"),
    "segments-short": (lambda d: d["segments"].pop(), True, "segments end at stage"),
    "stage-gap": (_set(["stages", 0, 1], 10**6), True, "does not continue at equation"),
    "no-stages": (_set(["stages"], []), True, "at least one stage"),
    "stage-not-a-triple": (_set(["stages", 0], [0, 5]), True, "damaged"),
    "segments-not-a-list": (_set(["segments"], 7), True, "damaged"),
    "missing-field": (lambda d: d.pop("fingerprint"), True, "missing field 'fingerprint'"),
    "wrong-version": (_set(["version"], 99), False, "version 99"),
    "has-aux-not-a-bool": (_set(["has_aux"], "yes"), True, "has_aux is 'yes'"),
    "unknown-sharding-scheme": (_set(["sharding"], {"mesh": "data=8", "scheme": "zero"}), True,
                                "unknown sharding scheme 'zero'"),
    "pinned-not-numbers": (_set(["pinned"], ["x"]), True, "damaged"),
    "wrong-format": (_set(["format"], "something/else"), False, "something/else"),
}


@pytest.mark.parametrize("fn, rechecksum, needle", EDITS.values(), ids=EDITS.keys())
def test_edited_file_is_refused(saved, fn, rechecksum, needle):
    _, _, _, text = saved
    with pytest.raises(rp.PlanMismatchError) as info:
        rp.Plan.from_json(_edit(text, fn, rechecksum))
    message = _assert_refused(info)
    assert needle in message, message


@pytest.mark.parametrize("text", ["", "   ", "[]", "null", "42", '"plan"', "{}", "\x00\x01",
                                  "{\"format\": \"remat-planner/plan\"}"],
                         ids=["empty", "blank", "list", "null", "number", "string", "empty-object",
                              "binary", "header-only"])
def test_not_a_plan_is_refused(text):
    with pytest.raises(rp.PlanMismatchError) as info:
        rp.Plan.from_json(text)
    _assert_refused(info)


def test_hand_made_plan_with_wrong_stages_is_refused_on_apply(saved):
    """A Plan built in code (no file) whose stages do not cover the computation."""
    wl, _, plan, _ = saved
    short = dataclasses.replace(plan, stages=plan.stages[:-1] + (
        dataclasses.replace(plan.stages[-1], stop=plan.stages[-1].stop - 1),))
    with pytest.raises(rp.PlanMismatchError) as info:
        _apply_abstract(short, wl)
    assert "equations" in _assert_refused(info)


# ------------------------------------------------------------------------------------------
# The step's typed fields (signature, has_aux, sharding, pinned): in JSON at top level
# (format version 2); a version-1 file, which kept them in "metadata", still loads
# ------------------------------------------------------------------------------------------

V1_FILE = ROOT / "tests" / "data" / "plan-v1.json"


def test_typed_fields_survive_a_json_round_trip(saved):
    _, _, plan, text = saved
    assert plan.signature and plan.signature[0].startswith("params: ")
    assert plan.has_aux is False and plan.sharding is None and plan.pinned == ()
    d = json.loads(text)
    assert d["version"] == 2 and d["signature"] == list(plan.signature)
    assert not set(d["metadata"]) & {"signature", "has_aux", "sharding", "pinned"}

    spec = dataclasses.replace(rp.ShardingSpec.make("data=4,model=2", "fsdp+tp"),
                               replicated=("params/lm_head/kernel",))
    typed = dataclasses.replace(plan, has_aux=True, sharding=spec, pinned=[30, 7, 12])
    assert typed.pinned == (7, 12, 30)  # sorted, a tuple
    loaded = rp.Plan.from_json(typed.to_json())
    assert loaded == typed and loaded.to_json() == typed.to_json()
    assert (loaded.signature, loaded.has_aux, loaded.sharding, loaded.pinned) == (
        plan.signature, True, spec, (7, 12, 30))
    assert json.loads(typed.to_json())["sharding"] == {
        "mesh": "data=4,model=2", "scheme": "fsdp+tp", "replicated": ["params/lm_head/kernel"]}
    # part of equality, unlike metadata
    assert dataclasses.replace(plan, has_aux=True) != plan
    assert dataclasses.replace(plan, pinned=(1,)) != plan
    assert dataclasses.replace(plan, metadata={"units": "binary"}) == plan


def test_version_1_file_loads_into_the_typed_fields():
    """tests/data/plan-v1.json: written by the version-1 code (tests/plan_v1_model.py), an
    fsdp+tp plan of a step with aux whose tp all-reduces are pinned."""
    import plan_v1_model as model

    text = V1_FILE.read_text()
    assert json.loads(text)["version"] == 1 and "has_aux" in json.loads(text)["metadata"]
    plan = rp.Plan.from_json(text)
    assert plan.has_aux is True
    assert plan.sharding == rp.ShardingSpec.make(model.MESH, model.SCHEME)
    assert plan.pinned == (13, 17, 21, 25, 30)
    assert plan.signature == ("params: 66048 values (float32)", "batch[0]: float32[16, 64]",
                              "batch[1]: float32[16, 8]", "compute dtypes: float32",
                              "equations: 23")
    assert not set(plan.metadata) & {"signature", "has_aux", "sharding", "pinned"}
    assert plan.metadata["units"] == "decimal"
    # written again, it is a version-2 file of the same plan
    again = plan.to_json()
    assert json.loads(again)["version"] == 2 and rp.Plan.from_json(again) == plan
    # the version-1 checksum still guards the file
    edited = json.loads(text)
    edited["metadata"]["pinned"] = [13]
    with pytest.raises(rp.PlanMismatchError, match="checksum mismatch"):
        rp.Plan.from_json(json.dumps(edited))

    params, batch = model.abstract_inputs()
    if jax.__version__ == plan.metadata["jax_version"]:  # the same trace, the same fingerprint
        # has_aux from the file: the planned loss returns (loss, aux)
        loss, aux = jax.eval_shape(plan.apply(model.loss_fn), params, *batch)
        assert loss.shape == () and set(aux) == {"mean_h"}
    # the signature from the file names what differs
    other = (jax.ShapeDtypeStruct((8, model.WIDTH), batch[0].dtype),
             jax.ShapeDtypeStruct((8, 8), batch[1].dtype))
    with pytest.raises(rp.PlanMismatchError) as info:
        jax.eval_shape(plan.apply(model.loss_fn), params, *other)
    assert "batch[0]: float32[8, 64] (plan: float32[16, 64])" in _assert_refused(info)
