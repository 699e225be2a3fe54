"""The package's import graph has no cycle (docs/architecture.md).

Every import inside `remat_planner` counts, at module level or inside a function, except
the few a public method of the plan data needs to reach the stages above it (ALLOWED:
`Plan.apply` replays, `Plan.summary` describes, `Plan.as_flax_names` / `Plan.to_flax`
export). Read from the source with `ast`, so nothing is imported to check it.
"""

from __future__ import annotations

import ast
from pathlib import Path

import networkx as nx

PACKAGE = Path(__file__).resolve().parent.parent / "remat_planner"

# (module, function, imported module): the documented lazy imports, one per public method.
ALLOWED = {
    ("remat_planner.plan", "apply", "remat_planner.apply"),
    ("remat_planner.plan", "as_flax_names", "remat_planner.explain"),
    ("remat_planner.plan", "summary", "remat_planner.describe"),
    ("remat_planner.plan", "to_flax", "remat_planner.export"),
}


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path):
    """(imported module, enclosing function or None) for every import in `path`."""
    module = _module_name(path)
    package = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
    tree = ast.parse(path.read_text())

    def walk(node, function):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                yield from walk(child, child.name)
                continue
            if isinstance(child, ast.ImportFrom):
                if child.level:
                    base = package[:len(package) - (child.level - 1)]
                    targets = ([".".join(base + [child.module])] if child.module
                               else [".".join(base + [a.name]) for a in child.names])
                else:
                    targets = [child.module or ""]
                for t in targets:
                    yield t, function
            elif isinstance(child, ast.Import):
                for a in child.names:
                    yield a.name, function
            yield from walk(child, function)

    yield from walk(tree, None)


def import_graph(allowed=frozenset(ALLOWED)) -> tuple[nx.DiGraph, set]:
    """The graph of imports between the package's modules, and the allowed lazy imports
    that were found (so a renamed method cannot leave a stale entry behind)."""
    files = sorted(PACKAGE.rglob("*.py"))
    modules = {_module_name(f) for f in files}
    graph, seen = nx.DiGraph(), set()
    graph.add_nodes_from(modules)
    for f in files:
        src = _module_name(f)
        for target, function in _imports(f):
            while target and target not in modules:  # `from .models.layers import x`
                target = target.rpartition(".")[0]
            if not target or target == src or target == "remat_planner":
                continue
            if (src, function, target) in allowed:
                seen.add((src, function, target))
                continue
            graph.add_edge(src, target)
    return graph, seen


def test_no_import_cycle():
    graph, seen = import_graph()
    cycles = list(nx.simple_cycles(graph))
    assert not cycles, "import cycles in remat_planner: " + "; ".join(
        " -> ".join(c + [c[0]]) for c in cycles[:5])
    assert seen == ALLOWED, f"allowed lazy imports not found: {ALLOWED - seen}"


def test_the_check_sees_a_cycle_through_a_function_level_import():
    """Without the allowance, Plan.apply's import closes a cycle (plan -> apply -> plan):
    the check reads imports inside functions too."""
    graph, _ = import_graph(allowed=frozenset())
    assert any({"remat_planner.plan", "remat_planner.apply"} <= set(c)
               for c in nx.simple_cycles(graph))


def test_pipeline_order():
    """The stages import only what is below them: trace <- graph <- memory <- solve <-
    scan <- apply <- verify <- planner, and the front ends sit above the planner."""
    graph, _ = import_graph()
    order = ["trace", "graph", "memory", "solve", "scan", "apply", "verify", "planner"]
    rank = {f"remat_planner.{m}": i for i, m in enumerate(order)}
    for a, b in graph.edges:
        if a in rank and b in rank:
            assert rank[b] < rank[a], f"{a} imports {b}, a later stage"
    for front in ("cli", "frontier", "maxbatch", "explain", "export"):
        assert not any(graph.has_edge(f"remat_planner.{m}", f"remat_planner.{front}")
                       for m in order), f"a pipeline stage imports the front end {front}"


def test_describe_sits_below_the_planner():
    """describe.py, the plan in words, is read by the planner (the labels a plan records)
    as well as by the front ends: it reaches neither the planner nor a front end, so the
    planner may import it."""
    graph, _ = import_graph()
    below = nx.descendants(graph, "remat_planner.describe")
    above = {f"remat_planner.{m}" for m in ("planner", "cli", "frontier", "maxbatch",
                                             "explain", "export", "baselines")}
    assert not below & above, f"describe reaches {sorted(below & above)}"


def test_baselines_sit_between_verify_and_the_planner():
    """baselines.py, the one home of JAX's built-in comparison points, is read by the
    planner (measure_builtin_policies) and by the front ends: it reaches neither the
    planner nor a front end, and no pipeline stage below the planner imports it."""
    graph, _ = import_graph()
    below = nx.descendants(graph, "remat_planner.baselines")
    above = {f"remat_planner.{m}" for m in ("planner", "cli", "frontier", "maxbatch",
                                             "explain", "export")}
    assert not below & above, f"baselines reaches {sorted(below & above)}"
    stages = ("trace", "graph", "memory", "solve", "scan", "apply", "verify")
    readers = {a for a, b in graph.in_edges("remat_planner.baselines")}
    assert not readers & {f"remat_planner.{m}" for m in stages}, sorted(readers)
    assert "remat_planner.planner" in readers


# The base of the pipeline: the plan data and what it is made of. Nothing here traces,
# measures or decides.
BASE = {f"remat_planner.{m}" for m in ("options", "sharding_spec", "errors", "units")}


def test_plan_data_and_step_sit_at_the_base():
    """plan.py (the plan data: Plan, Segment, the keep options) and step.py (the training
    step as one value: loss, optimizer, has_aux, sharding) import only the base: the
    keep-option kinds, the sharding as data (sharding_spec.py), the errors and units. Not
    the tracer, not a stage, not sharding.py's decisions (plan.py's four documented lazy
    imports aside)."""
    graph, _ = import_graph()
    for module in ("remat_planner.plan", "remat_planner.step"):
        below = nx.descendants(graph, module)
        assert below <= BASE, f"{module} reaches {sorted(below - BASE)}"
    assert "remat_planner.sharding_spec" in nx.descendants(graph, "remat_planner.step")


def _numeric(node) -> bool:
    """A number, or arithmetic on numbers (`1 << 20`, `6 - 2`, names of constants aside)."""
    if isinstance(node, ast.Constant):
        return isinstance(node.value, (int, float)) and not isinstance(node.value, bool)
    if isinstance(node, ast.BinOp):
        return all(_numeric(n) or isinstance(n, ast.Name) for n in (node.left, node.right)) \
            and (_numeric(node.left) or _numeric(node.right))
    if isinstance(node, ast.UnaryOp):
        return _numeric(node.operand)
    return False


# Numbers at module level that are not tuning: the plan file format's version.
NOT_TUNING = {("remat_planner.plan", "PLAN_FORMAT_VERSION")}


def test_margins_and_limits_live_in_constants_py():
    """Every margin, tolerance, limit and machine constant is a module-level name in
    constants.py, each with a comment above it saying where its value comes from; no
    other module of the pipeline defines one (the sample models aside)."""
    stray, bare = [], []
    for f in sorted(PACKAGE.rglob("*.py")):
        module = _module_name(f)
        if module.startswith("remat_planner.models"):
            continue
        lines = f.read_text().splitlines()
        for node in ast.parse(f.read_text()).body:
            if not (isinstance(node, ast.Assign) and len(node.targets) == 1
                    and isinstance(node.targets[0], ast.Name) and _numeric(node.value)):
                continue
            name = node.targets[0].id
            if module == "remat_planner.constants":
                if not lines[node.lineno - 2].lstrip().startswith("#") and \
                        not lines[node.lineno - 2].rstrip().endswith(")") and \
                        not _follows_commented(lines, node.lineno):
                    bare.append(name)
            elif (module, name) not in NOT_TUNING:
                stray.append(f"{module}.{name}")
    assert not stray, f"constants outside constants.py: {stray}"
    assert not bare, f"constants without a comment giving their source: {bare}"


def _follows_commented(lines: list[str], lineno: int) -> bool:
    """Whether the assignment on `lineno` (1-based) belongs to a run of assignments that a
    comment opens (`MAX_COMPILES = 6` then `MAX_VERIFY_COMPILES = MAX_COMPILES - 2`)."""
    i = lineno - 2
    while i >= 0 and lines[i].strip() and not lines[i].lstrip().startswith("#"):
        if "=" not in lines[i]:
            return False
        i -= 1
    return i >= 0 and lines[i].lstrip().startswith("#")


# ---------------------------------------------------------------------------------------
# Tests use the package's public API only (issue 19)
# ---------------------------------------------------------------------------------------

TESTS = Path(__file__).resolve().parent

# (test file, private name) -> why that test may use it. Empty: no test reaches inside a
# module; what a test needs is public.
PRIVATE_ALLOWED: dict[tuple[str, str], str] = {}


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _ours(module: str) -> bool:
    return module == "remat_planner" or module.startswith("remat_planner.")


def private_uses(source: str) -> list[tuple[int, str]]:
    """(line, name) for every underscore-prefixed name of remat_planner that `source`
    imports or reaches: `from remat_planner.m import _x`, a private module in an import
    path, an attribute `obj._x` (on anything but `self` or `cls`, which are the test's own
    classes: a plan, an analysis or a module reached through a name cannot be told from
    ours by reading), `setattr`/`getattr`/`monkeypatch.setattr(obj, "_x", ...)`, and a
    dotted string `"remat_planner.m._x"` (monkeypatch, importlib). Dunder names are
    public."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom) and not node.level and _ours(node.module or ""):
            parts = node.module.split(".")
            found += [(node.lineno, p) for p in parts if _private(p)]
            found += [(node.lineno, a.name) for a in node.names if _private(a.name)]
        elif isinstance(node, ast.Import):
            found += [(node.lineno, p) for a in node.names if _ours(a.name)
                      for p in a.name.split(".") if _private(p)]
        elif isinstance(node, ast.Attribute) and _private(node.attr):
            if not (isinstance(node.value, ast.Name) and node.value.id in ("self", "cls")):
                found.append((node.lineno, node.attr))
        elif isinstance(node, ast.Call):
            fn = node.func
            name = fn.id if isinstance(fn, ast.Name) else fn.attr if isinstance(
                fn, ast.Attribute) else None
            if name in ("setattr", "getattr", "hasattr", "delattr") and len(node.args) >= 2:
                arg = node.args[1]
                if isinstance(arg, ast.Constant) and isinstance(arg.value, str) \
                        and _private(arg.value):
                    found.append((node.lineno, arg.value))
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) \
                and _ours(node.value.split(" ")[0]):
            found += [(node.lineno, p) for p in node.value.split(" ")[0].split(".")
                      if _private(p)]
    return sorted(set(found))


def test_tests_use_public_api_only():
    """No test file imports or reaches a private name of remat_planner: what the tests
    need is public (and documented), so the tests pin the interface, not its insides."""
    found, used = [], set()
    for f in sorted(TESTS.glob("*.py")):
        for line, name in private_uses(f.read_text()):
            if (f.name, name) in PRIVATE_ALLOWED:
                used.add((f.name, name))
            else:
                found.append(f"{f.name}:{line}: {name}")
    assert not found, "tests reach private names of remat_planner:\n" + "\n".join(found)
    assert used == set(PRIVATE_ALLOWED), f"stale allowances: {set(PRIVATE_ALLOWED) - used}"


def test_the_public_api_check_sees_each_kind_of_private_use():
    source = '''
import remat_planner._hidden
from remat_planner.plan import _checksum, Plan
from remat_planner._impl import thing
from remat_planner import planner as pl
pl._plan_from_segments(an, segs)
an._cache
monkeypatch.setattr(pl, "_make_plan", None)
getattr(pl, "_PlanCosts")
monkeypatch.setattr("remat_planner.frontier._threads", lambda: True)
'''
    names = [n for _, n in private_uses(source)]
    assert sorted(names) == sorted(["_hidden", "_checksum", "_impl", "_plan_from_segments",
                                    "_cache", "_make_plan", "_PlanCosts", "_threads"])
    clean = '''
from jax._src.ad_checkpoint import saved_residuals
from test_reliability import _params
class Layer:
    def __call__(self, x):
        return self._block(x)
type(x).__name__, plan.__dict__
monkeypatch.setattr(pl, "measure", None)
"remat_planner/plan.py _private words"
'''
    assert private_uses(clean) == []


def cross_module_private_uses(source: str) -> list[tuple[int, str]]:
    """(line, name) for every private name a package module takes from another package
    module: `from .m import _x`, or `m._x` where `m` is a package module it imported
    (`from . import planner as pl`). A module's own privates are its business."""
    found, modules = [], set()
    tree = ast.parse(source)
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.level or _ours(node.module or "")):
            if node.module is None or node.module == "remat_planner":  # `from . import m`
                modules |= {a.asname or a.name for a in node.names}
            found += [(node.lineno, a.name) for a in node.names if _private(a.name)]
    for node in ast.walk(tree):
        if (isinstance(node, ast.Attribute) and _private(node.attr)
                and isinstance(node.value, ast.Name) and node.value.id in modules):
            found.append((node.lineno, f"{node.value.id}.{node.attr}"))
    return sorted(set(found))


def test_modules_use_each_others_public_names_only():
    """What one module of the package uses of another is public (and documented there):
    the front ends call the planner's plan-measuring functions by their public names."""
    found = [f"{f.relative_to(PACKAGE.parent)}:{line}: {name}"
             for f in sorted(PACKAGE.rglob("*.py"))
             for line, name in cross_module_private_uses(f.read_text())]
    assert not found, "modules reach each other's private names:\n" + "\n".join(found)


def test_the_cross_module_check_sees_private_imports_and_attributes():
    source = '''
from .memory import _run, simulate
from . import planner as pl
pl._make_plan(an)
self._cache
other._x
'''
    assert cross_module_private_uses(source) == [(2, "_run"), (4, "pl._make_plan")]
