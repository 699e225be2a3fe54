"""The plan space (remat_planner/options.py): a segment's keep option is typed, one frozen
class per kind (Store, KeepRule, ScanOption), each named by the string plan files use.

Public API only: build options, parse every kind, round-trip plans through JSON, refuse
a malformed name with a clear message, and check that the kinds are a closed set which
validate_segments and apply both handle (every kind replayed on a tiny model), and that
no module outside options.py tells kinds apart by their names (read from the source).
"""

from __future__ import annotations

import ast
import dataclasses
import json
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import remat_planner as rp
from remat_planner import apply, scan
from remat_planner.options import (DOTS, DOTS_NARROW, DOTS_NO_BATCH, KEEP_RULES, NOTHING, STORE,
                                   KeepRule, Option, ScanOption, ScanPart, ScanScheme, Store,
                                   option_kinds, parse_option)
from remat_planner.plan import Plan, Segment, StageInfo, validate_segments
from remat_planner.trace import trace


# ---------------------------------------------------------------------------------------
# Building and parsing options
# ---------------------------------------------------------------------------------------

def test_options_are_built_typed_and_named_by_their_strings():
    assert Store().name == STORE == "store"
    assert [KeepRule(r).name for r in KEEP_RULES] == [NOTHING, DOTS_NO_BATCH, DOTS_NARROW, DOTS]
    scheme = ScanScheme((ScanPart(8, "nothing|dots", (2,)), ScanPart(4, "[dots]")))
    assert ScanOption(scheme).name == "scan:8xnothing|dots/2+4x[dots]"
    # frozen values: equal by content, hashable, immutable
    assert KeepRule(DOTS) == KeepRule(DOTS) and len({Store(), Store(), KeepRule(DOTS)}) == 2
    with pytest.raises(dataclasses.FrozenInstanceError):
        KeepRule(DOTS).rule = NOTHING
    assert not Store().checkpoints and KeepRule(NOTHING).checkpoints
    assert ScanOption(scheme).checkpoints


@pytest.mark.parametrize("name, kind", [
    ("store", Store()),
    *((r, KeepRule(r)) for r in KEEP_RULES),
    ("scan:12x[dots]/2", ScanOption(ScanScheme((ScanPart(12, "[dots]", (2,)),)))),
    ("scan:5xstore|store+7xnothing|dots_no_batch/7", None),
    ("scan:12x2*nothing|nothing;dots|store/2", None),
    ("scan:12x(nothing|nothing)/2/3", None),
])
def test_every_kind_parses_and_keeps_its_name(name, kind):
    option = parse_option(name)
    assert option.name == name and str(option) == name
    assert parse_option(option) is option
    if kind is not None:
        assert option == kind
    else:
        assert isinstance(option, ScanOption) and option.scheme == ScanScheme.parse(name)
    assert type(option) in option_kinds()


@pytest.mark.parametrize("name, needle", [
    ("bogus", "unknown keep option 'bogus'"),
    ("Store", "unknown keep option 'Store'"),
    ("", "unknown keep option ''"),
    ("dots_saveable", "unknown keep option 'dots_saveable'"),
    ("scan:", "bad scan scheme part"),
    ("scan:3xnothing/2", "groups must be >= 2"),
    ("scan:4x0*nothing", "bad per-iteration plan"),
])
def test_a_malformed_name_is_refused_with_a_clear_message(name, needle):
    with pytest.raises(ValueError) as info:
        parse_option(name)
    assert needle in str(info.value), str(info.value)
    if "unknown" in needle:  # the message lists what a keep option can be
        assert all(r in str(info.value) for r in (STORE, *KEEP_RULES, "scan:"))


def test_a_keep_rule_is_one_of_the_rules():
    with pytest.raises(ValueError, match="unknown keep rule 'dots_saveable'"):
        KeepRule("dots_saveable")


def test_segment_parses_its_option_once_and_keeps_the_string():
    seg = Segment(0, 1, "scan:4xnothing/2")
    assert seg.option == "scan:4xnothing/2" and isinstance(seg.kind, ScanOption)
    assert seg.kind is seg.kind  # parsed once
    typed = Segment(0, 3, KeepRule(NOTHING), (), (Segment(0, 1, Store()), Segment(1, 3, DOTS)))
    assert typed.option == NOTHING and typed == Segment(0, 3, NOTHING, (), (
        Segment(0, 1, STORE), Segment(1, 3, DOTS)))
    assert typed.to_dict()["option"] == NOTHING and typed.children[0].kind == Store()
    assert typed.is_checkpoint and not typed.children[0].is_checkpoint
    assert Segment(0, 1, "bogus").option == "bogus"  # checked by validate_segments, not here
    with pytest.raises(ValueError, match="unknown keep option"):
        Segment(0, 1, "bogus").kind


# ---------------------------------------------------------------------------------------
# Plans in files
# ---------------------------------------------------------------------------------------

def _plan(segments, n_stages: int) -> Plan:
    stages = tuple(StageInfo(i, i + 1, f"s{i}") for i in range(n_stages))
    return Plan(tuple(segments), stages, "0" * 16, 100, 90, 1.0, 10, 2.0)


def test_plans_round_trip_through_json_with_the_same_strings():
    segments = (Segment(0, 1, STORE), Segment(1, 2, "scan:4x[dots]/2"),
                Segment(2, 4, NOTHING, (), (Segment(2, 3, DOTS, (7, 8)), Segment(3, 4, STORE))),
                Segment(4, 5, KeepRule(DOTS_NARROW), (9,)))
    plan = _plan(segments, 5)
    text = plan.to_json()
    options = [s["option"] for s in json.loads(text)["segments"]]
    assert options == ["store", "scan:4x[dots]/2", "nothing", "dots_narrow"]
    back = Plan.from_json(text)
    assert back == plan
    assert [type(s.kind) for s in back.segments] == [Store, ScanOption, KeepRule, KeepRule]
    assert back.segments[2].children[0].kind == KeepRule(DOTS)


def test_an_unknown_option_in_a_file_is_refused():
    text = _plan((Segment(0, 1, STORE),), 1).to_json()
    d = json.loads(text)
    d.pop("checksum")
    d["segments"][0]["option"] = "keep_everything"
    from remat_planner.plan import plan_checksum
    d["checksum"] = plan_checksum(d)
    with pytest.raises(rp.PlanMismatchError, match="unknown keep option 'keep_everything'"):
        Plan.from_json(json.dumps(d))


# ---------------------------------------------------------------------------------------
# The kinds are a closed set: validate_segments and apply handle each
# ---------------------------------------------------------------------------------------

def _loss(params, x):
    h = jnp.tanh(x @ params["w_in"])

    def layer(h, w):
        return jnp.tanh(h @ w) + h, None

    h, _ = jax.lax.scan(layer, h, params["w"])
    return jnp.mean(jnp.tanh(h @ params["w_out"]) ** 2)


@pytest.fixture(scope="module")
def tiny():
    """A tiny step with a 4-layer scan, cut into three stages: before, the scan, after."""
    k = jax.random.split(jax.random.key(0), 4)
    params = {"w_in": jax.random.normal(k[0], (8, 16)) / 3,
              "w": jax.random.normal(k[1], (4, 16, 16)) / 4,
              "w_out": jax.random.normal(k[2], (16, 8)) / 4}
    x = jax.random.normal(k[3], (2, 8))
    program = trace(_loss, params, x)
    index = scan.find_layer_scan(program)
    assert index is not None and 0 < index < len(program.eqns) - 1
    stages = (StageInfo(0, index, "in"), StageInfo(index, index + 1, "scan"),
              StageInfo(index + 1, len(program.eqns), "out"))
    sub_stages = scan.body_chain(scan.layer_body(program.eqns[index]), measure_xla=False).n
    return params, x, program, stages, sub_stages


def _examples(sub_stages: int) -> dict[type, list[Option]]:
    """Options of every kind for the tiny step's stages (the scan one for ScanOption)."""
    per_iteration = "|".join([NOTHING] * sub_stages)
    return {Store: [Store()], KeepRule: [KeepRule(r) for r in KEEP_RULES],
            ScanOption: [parse_option(f"scan:4x{per_iteration}"),
                         parse_option(f"scan:4x{per_iteration}/2"),
                         parse_option(f"scan:2x{per_iteration}+2x{'|'.join([STORE] * sub_stages)}")]}


def test_every_kind_has_a_replay_and_an_example(tiny):
    *_, sub_stages = tiny
    assert set(option_kinds()) == {Store, KeepRule, ScanOption}
    assert set(apply.REPLAY) == set(option_kinds()), "a kind without a replay in apply"
    assert set(_examples(sub_stages)) == set(option_kinds()), "a kind without a test example"


def test_validate_accepts_every_kind_in_its_place_and_refuses_misplaced_ones():
    for option in (Store(), KeepRule(NOTHING), parse_option("scan:4xnothing")):
        validate_segments((Segment(0, 1, option), Segment(1, 2, STORE)), 2)
    validate_segments((Segment(0, 2, KeepRule(DOTS), (), (Segment(0, 1, STORE),
                                                          Segment(1, 2, NOTHING))),), 2)
    for option, what in ((Store(), "a store segment"), (parse_option("scan:4xnothing"),
                                                         "a scan scheme segment")):
        with pytest.raises(ValueError, match=f"{what} is exactly one stage without children"):
            validate_segments((Segment(0, 2, option),), 2)
    with pytest.raises(ValueError, match="unknown keep option 'nope'"):
        validate_segments((Segment(0, 1, "nope"),), 1)


def test_every_kind_is_replayed_by_apply_on_a_tiny_model(tiny):
    params, x, program, stages, sub_stages = tiny
    want = jax.value_and_grad(_loss)(params, x)
    replayed = set()
    for kind, options in _examples(sub_stages).items():
        for option in options:
            k = 1 if kind is ScanOption else 0
            segments = [Segment(i, i + 1, option if i == k else STORE) for i in range(3)]
            if kind is KeepRule:  # also as a region over several stages, nesting the rest
                segments = [Segment(0, 2, option, (), (Segment(0, 1, option),
                                                       Segment(1, 2, STORE))), segments[2]]
            plan = Plan(tuple(segments), stages, program.fingerprint(), 0, 0, 0.0, 0, 0.0)
            validate_segments(plan.segments, len(stages))
            plan = Plan.from_json(plan.to_json())
            planned = plan.apply(_loss)
            jaxpr = str(jax.make_jaxpr(jax.grad(planned))(params, x))
            assert ("remat" in jaxpr) == option.checkpoints, option  # jax.checkpoint regions
            got = jax.value_and_grad(planned)(params, x)
            np.testing.assert_allclose(got[0], want[0], rtol=1e-5)
            for a, b in zip(jax.tree.leaves(got[1]), jax.tree.leaves(want[1])):
                np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-6)
            replayed.add(type(plan.segments[k if kind is not KeepRule else 0].kind))
    assert replayed == set(option_kinds())


def test_a_stage_option_of_the_memory_model_has_its_kind():
    """memory.KeepOption, like Segment, keeps the name and gives the typed option."""
    from remat_planner.memory import KeepOption
    built = KeepOption(KeepRule(DOTS), (3,), 10, 1.0)
    assert built.name == DOTS and built.kind == KeepRule(DOTS)
    assert built == KeepOption(DOTS, (3,), 10, 1.0)
    assert isinstance(KeepOption(STORE, (), 1, 0.0).kind, Store)
    scanned = KeepOption("scan:4xnothing/2", (), 1, 0.0)
    assert scanned.kind == ScanOption(ScanScheme((ScanPart(4, NOTHING, (2,)),)))
    assert dataclasses.replace(built, saved=()).kind == KeepRule(DOTS)


# ---------------------------------------------------------------------------------------
# Dispatch on kinds is by type (docs/architecture.md, "Where a new kind of keep option
# goes"): outside options.py no module tells kinds apart by their names
# ---------------------------------------------------------------------------------------

_PACKAGE = pathlib.Path(rp.__file__).parent
# Names and strings that say which kind an option is: `store` is Store's only name and
# `scan:` starts every ScanOption's.
_KIND_NAMES = {"STORE", "SCAN_PREFIX"}
_RULE_NAMES = {"NOTHING", "DOTS_NO_BATCH", "DOTS_NARROW", "DOTS", "KEEP_RULES"}
# What holds an option's name: `o.name`, `seg.option`, or a variable called so.
_NAME_HOLDERS = {"name", "option"}


def _is_kind_literal(node: ast.AST) -> bool:
    if isinstance(node, ast.Name):
        return node.id in _KIND_NAMES
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value == STORE or node.value.startswith("scan:")
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        return any(_is_kind_literal(e) for e in node.elts)
    return False


def _is_rule_literal(node: ast.AST) -> bool:
    if isinstance(node, ast.Name):
        return node.id in _RULE_NAMES
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value in KEEP_RULES
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        return any(_is_rule_literal(e) for e in node.elts)
    return False


def _holds_option_name(node: ast.AST) -> bool:
    return ((isinstance(node, ast.Attribute) and node.attr in _NAME_HOLDERS)
            or (isinstance(node, ast.Name) and node.id in _NAME_HOLDERS))


def string_dispatch_sites(source: str) -> list[tuple[int, str]]:
    """(line, code) of each place in `source` that tells option kinds apart by name: a
    comparison with `store` / `scan:...` (STORE, SCAN_PREFIX or the strings), an option's
    name (`.name`, `.option`, `name`, `option`) compared with a keep rule's name,
    `is_scan_option`, `startswith` / `endswith` on a kind's name, and any other use of
    SCAN_PREFIX (scan names built or matched by hand)."""
    tree = ast.parse(source)
    sites = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Compare):
            sides = [node.left, *node.comparators]
            if any(_is_kind_literal(s) for s in sides) or (
                    any(_holds_option_name(s) for s in sides)
                    and any(_is_rule_literal(s) for s in sides)):
                sites.add(node.lineno)
        elif isinstance(node, ast.Call):
            f = node.func
            if (isinstance(f, ast.Name) and f.id == "is_scan_option") or (
                    isinstance(f, ast.Attribute) and f.attr == "is_scan_option"):
                sites.add(node.lineno)
            elif isinstance(f, ast.Attribute) and f.attr in ("startswith", "endswith") and any(
                    _is_kind_literal(n) for a in node.args for n in ast.walk(a)):
                sites.add(node.lineno)
        elif isinstance(node, ast.Name) and node.id == "SCAN_PREFIX" and isinstance(
                node.ctx, ast.Load):
            sites.add(node.lineno)
    lines = source.splitlines()
    return [(n, lines[n - 1].strip()) for n in sorted(sites)]


def test_the_sniffer_finds_string_dispatch():
    """string_dispatch_sites finds each way of telling kinds apart by name (so the test
    below can fail), and none of the typed ways."""
    by_name = """
if o.name == STORE: pass
if name != STORE: pass
if seg.option == "store": pass
if option.name == NOTHING and not option.saved: pass
if s.option in (DOTS, NOTHING): pass
if is_scan_option(o.name): pass
if o.name.startswith(SCAN_PREFIX): pass
pattern = re.compile(rf"^{SCAN_PREFIX}(\\d+)x")
name = f"scan:{layers}x{plan}"
if keeps.startswith(KEEP_WORDS[STORE]): pass
"""
    assert [n for n, _ in string_dispatch_sites(by_name)] == [2, 3, 4, 5, 6, 7, 8, 9, 11]
    typed = """
if isinstance(o.kind, Store): pass
if seg.kind == KeepRule(NOTHING): pass
if rule == DOTS_NO_BATCH and lhs_batch: pass
match seg.kind:
    case ScanOption(scheme=scheme): pass
segments = [Segment(i, i + 1, STORE) for i in range(n)]
name = ScanOption(ScanScheme((ScanPart(layers, plan),))).name
"""
    assert string_dispatch_sites(typed) == []


def test_no_module_tells_option_kinds_apart_by_name():
    """Outside options.py (the kinds' own home), code dispatches on an option's class
    (`isinstance`, `match`, a table keyed by it), never on its name: a new kind then
    touches options.py, the memory model and apply.REPLAY, not every `== STORE`."""
    found = {}
    for path in sorted(_PACKAGE.rglob("*.py")):
        if path.name == "options.py":
            continue
        sites = string_dispatch_sites(path.read_text())
        if sites:
            found[str(path.relative_to(_PACKAGE))] = sites
    assert not found, "option kinds told apart by name:\n" + "\n".join(
        f"  {f}:{n}: {code}" for f, sites in found.items() for n, code in sites)
