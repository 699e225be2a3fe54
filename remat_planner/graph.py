"""Stage 2: the cost graph of a traced program, and the stages the solver works on.

The graph is a networkx DiGraph with one node per equation ("eqn", i) and one per value
("val", id): edges run value -> consuming equation and equation -> produced value.
Equation nodes carry the primitive, analytic FLOPs and the Flax module path; value
nodes carry bytes, shape and dtype. Stages are contiguous ranges of equations between
cut points where little crosses (the residual stream between transformer blocks, or
between attention and MLP inside a block).
"""

from __future__ import annotations

import dataclasses
import math
from collections import Counter

import networkx as nx
import numpy as np

from .trace import Literal, Program

# ---------------------------------------------------------------------------------------
# FLOPs
# ---------------------------------------------------------------------------------------

_FREE_PRIMITIVES = frozenset({
    "reshape", "squeeze", "expand_dims", "broadcast_in_dim", "convert_element_type",
    "transpose", "slice", "dynamic_slice", "concatenate", "pad", "iota", "copy", "copy_p",
    "stop_gradient", "name", "optimization_barrier", "rev", "bitcast_convert_type",
    "gather", "dynamic_update_slice", "scatter", "select_n", "squeeze", "split",
})


def _size(aval) -> int:
    return int(np.prod(getattr(aval, "shape", ()), dtype=np.int64))


def eqn_flops(primitive_name: str, params: dict, in_avals, out_avals) -> float:
    """Analytic FLOPs of one equation: exact for dot_general and convolutions,
    output size for elementwise ops, input size for reductions, recursive for calls."""
    if primitive_name == "dot_general":
        (lhs_contract, _), _ = params["dimension_numbers"]
        contract = math.prod(in_avals[0].shape[d] for d in lhs_contract)
        return 2.0 * _size(out_avals[0]) * contract
    if primitive_name == "conv_general_dilated":
        rhs = in_avals[1].shape
        dn = params["dimension_numbers"]
        rhs_spec = dn.rhs_spec  # (out feature dim, in feature dim, *spatial)
        per_output = rhs[rhs_spec[1]] * math.prod(rhs[d] for d in rhs_spec[2:])
        return 2.0 * _size(out_avals[0]) * per_output
    sub = _subjaxpr_cost(primitive_name, params, jaxpr_flops)
    if sub is not None:
        return sub
    if primitive_name in _FREE_PRIMITIVES:
        return 0.0
    if primitive_name.startswith("reduce") or primitive_name in ("argmax", "argmin", "cumsum"):
        return float(sum(_size(a) for a in in_avals[:1]))
    return float(sum(_size(a) for a in out_avals))


# Primitives that move no data of their own: XLA folds them into their consumer (views,
# layout changes, casts fused into the op reading them) or they produce no array.
_VIEW_PRIMITIVES = frozenset({
    "reshape", "squeeze", "expand_dims", "broadcast_in_dim", "convert_element_type",
    "bitcast_convert_type", "iota", "name", "stop_gradient", "optimization_barrier",
})


def _nbytes(aval) -> int:
    dtype = getattr(aval, "dtype", None)
    itemsize = getattr(dtype, "itemsize", None) or 4
    return _size(aval) * int(itemsize)


def eqn_bytes(primitive_name: str, params: dict, in_avals, out_avals) -> float:
    """Memory traffic of one equation as if run alone: bytes of its operands read plus
    its results written; 0 for views and casts; recursive for calls and loops (a scan
    body times its length). It overcounts what XLA fuses (an elementwise chain reads and
    writes memory once, not once per op); the fitted machine balance of
    costmodel.CostModel absorbs that on average."""
    sub = _subjaxpr_cost(primitive_name, params, jaxpr_bytes)
    if sub is not None:
        return sub
    if primitive_name in _VIEW_PRIMITIVES:
        return 0.0
    return float(sum(_nbytes(a) for a in in_avals) + sum(_nbytes(a) for a in out_avals))


def jaxpr_bytes(jaxpr) -> float:
    """Memory traffic (eqn_bytes) of a (closed) jaxpr, recursing into sub-jaxprs."""
    jaxpr = getattr(jaxpr, "jaxpr", jaxpr)
    return float(sum(eqn_bytes(e.primitive.name, e.params, [v.aval for v in e.invars],
                               [v.aval for v in e.outvars]) for e in jaxpr.eqns))


def jaxpr_flops(jaxpr) -> float:
    """Analytic FLOPs of a (closed) jaxpr, recursing into sub-jaxprs."""
    jaxpr = getattr(jaxpr, "jaxpr", jaxpr)
    total = 0.0
    for e in jaxpr.eqns:
        total += eqn_flops(e.primitive.name, e.params, [v.aval for v in e.invars],
                           [v.aval for v in e.outvars])
    return total


def _subjaxpr_cost(name: str, params: dict, measure):
    """`measure` (jaxpr_flops or jaxpr_bytes) of a call or loop equation; None otherwise."""
    if name == "scan":
        return params["length"] * measure(params["jaxpr"])
    if name == "while":
        # Trip count unknown at trace time: count one iteration of body and condition.
        return measure(params["body_jaxpr"]) + measure(params["cond_jaxpr"])
    if name == "cond":
        return max(measure(b) for b in params["branches"])
    for key in ("jaxpr", "call_jaxpr", "fun_jaxpr"):
        if key in params and hasattr(params[key], "eqns") or (
                key in params and hasattr(getattr(params[key], "jaxpr", None), "eqns")):
            return measure(params[key])
    return None


# ---------------------------------------------------------------------------------------
# Graph
# ---------------------------------------------------------------------------------------

def build_graph(program: Program) -> nx.DiGraph:
    """The program as a bipartite DiGraph of equations and values with costs."""
    g = nx.DiGraph()
    free = program.free
    for vid, aval in program.avals.items():
        g.add_node(("val", vid), bytes=program.nbytes(vid), shape=tuple(aval.shape),
                   dtype=str(aval.dtype), free=vid in free,
                   param=vid in program.invars[:program.n_param_leaves])
    for i, e in enumerate(program.eqns):
        in_avals = [program.avals[v] if isinstance(v, int) else _literal_aval(v)
                    for v in e.invars]
        out_avals = [program.avals[v] for v in e.outvars]
        g.add_node(("eqn", i), primitive=e.name, module=e.module_path,
                   flops=eqn_flops(e.name, e.params, in_avals, out_avals),
                   bytes_accessed=eqn_bytes(e.name, e.params, in_avals, out_avals))
        for v in e.invars:
            if isinstance(v, int):
                g.add_edge(("val", v), ("eqn", i))
        for v in e.outvars:
            g.add_edge(("eqn", i), ("val", v))
    return g


def _literal_aval(lit: Literal):
    return np.asarray(lit.val)


def last_uses(program: Program) -> dict[int, int]:
    """value id -> index of the last equation using it (len(eqns) for program outputs)."""
    last: dict[int, int] = {}
    for i, e in enumerate(program.eqns):
        for v in e.invars:
            if isinstance(v, int):
                last[v] = i
    for v in program.outvars:
        if isinstance(v, int):
            last[v] = len(program.eqns)
    return last


def definitions(program: Program) -> dict[int, int]:
    """value id -> index of the defining equation (-1 for arguments and constants)."""
    d = {v: -1 for v in program.invars}
    d.update({v: -1 for v in program.consts})
    for i, e in enumerate(program.eqns):
        for v in e.outvars:
            d[v] = i
    return d


def crossing_bytes(program: Program, graph: nx.DiGraph) -> np.ndarray:
    """crossing[k]: bytes of activations (not params, batch or constants) defined before
    equation k and used at or after it, for k = 0..len(eqns). Aux outputs (returned by
    the step, e.g. new batch statistics) are counted with fixed memory, not here."""
    n = len(program.eqns)
    diff = np.zeros(n + 2, dtype=np.int64)
    last = last_uses(program)
    aux = program.aux_outputs
    for i, e in enumerate(program.eqns):
        for v in e.outvars:
            if v in last and last[v] > i and v not in aux:
                diff[i + 1] += graph.nodes[("val", v)]["bytes"]
                diff[last[v] + 1] -= graph.nodes[("val", v)]["bytes"]
    return np.cumsum(diff)[: n + 1]


# ---------------------------------------------------------------------------------------
# Stages
# ---------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Stage:
    """Equations [start, stop) of the program, named by their Flax module path."""

    start: int
    stop: int
    name: str
    flops: float
    bytes_accessed: float = 0.0  # memory traffic of its forward (graph.eqn_bytes)


@dataclasses.dataclass(frozen=True)
class CostGraph:
    """The graph plus the chain of stages the solver plans over."""

    graph: nx.DiGraph
    stages: tuple[Stage, ...]
    crossing: np.ndarray  # bytes crossing each equation boundary
    total_flops: float

    def boundary_bytes(self, k: int) -> int:
        """Bytes crossing the cut after stage k-1 (k=0: before the first stage)."""
        if k == 0:
            return 0
        return int(self.crossing[self.stages[k - 1].stop]) if k < len(self.stages) else 0


def _scope(path: str, depth: int) -> str:
    parts = [p for p in path.split("/") if p]
    return "/".join(parts[:depth])


def find_stages(program: Program, graph: nx.DiGraph, *, max_stages: int = 48) -> tuple[Stage, ...]:
    """Cut the equation order where a single activation (or little) crosses.

    Candidate cuts are module-scope changes (down to three levels of Flax module path) or,
    for a program without module paths, every equation boundary. A candidate is kept when
    what crosses it is no bigger than 1.25 x its largest single value: one residual stream,
    not a stream plus a side branch. In a network that is not a chain (U-Net skips, any
    long-range value) tensors also pass over cuts untouched: a candidate is kept too when
    the same holds once the values that pass its neighbourhood untouched are set aside
    (`_passing_bytes`); they still count in the boundary bytes of every cut they cross.
    Too many cuts are thinned to the `max_stages` with the least crossing, spread evenly.
    """
    n = len(program.eqns)
    crossing = crossing_bytes(program, graph)
    largest = _largest_crossing_value(program, graph, n)
    has_paths = any(e.module_path for e in program.eqns)
    boundaries = []
    for k in range(1, n):
        if has_paths:
            a, b = program.eqns[k - 1].module_path, program.eqns[k].module_path
            if all(_scope(a, d) == _scope(b, d) for d in (1, 2, 3)):
                continue
        boundaries.append(k)
    passing, largest_local = _passing_bytes(program, graph, boundaries)
    candidates = []
    for k in boundaries:
        if crossing[k] == 0 or crossing[k] <= 1.25 * largest[k]:
            candidates.append(k)
        elif k in passing and crossing[k] - passing[k] <= 1.25 * largest_local[k]:
            candidates.append(k)
    candidates = _thin(candidates, crossing, n, max_stages - 1)
    flops = [graph.nodes[("eqn", i)]["flops"] for i in range(n)]
    candidates = _merge_trivial(candidates, flops, n)
    bounds = [0, *candidates, n]
    stages = []
    for lo, hi in zip(bounds[:-1], bounds[1:]):
        stages.append(Stage(lo, hi, _stage_name(program, lo, hi), float(sum(flops[lo:hi])),
                            stage_bytes(graph, lo, hi)))
    return tuple(stages)


def stage_bytes(graph: nx.DiGraph, lo: int, hi: int) -> float:
    """Memory traffic (eqn_bytes) of equations [lo, hi)."""
    return float(sum(graph.nodes[("eqn", i)]["bytes_accessed"] for i in range(lo, hi)))


def _merge_trivial(cuts: list[int], flops: list[float], n: int) -> list[int]:
    """Drop cuts that leave a stage with almost no compute (index arithmetic, embedding
    lookups): such a stage gives the solver nothing to trade and only costs time."""
    bounds = [0, *cuts, n]
    work = [sum(flops[lo:hi]) for lo, hi in zip(bounds[:-1], bounds[1:])]
    floor = 0.005 * max(work, default=0.0)
    kept = []
    acc = 0.0
    for cut, w in zip(cuts, work[:-1]):
        acc += w
        if acc > floor:
            kept.append(cut)
            acc = 0.0
    if kept and sum(work[len(work) - 1:]) <= floor:
        kept.pop()  # fold a trivial tail stage into the one before it
    return kept


def _largest_crossing_value(program: Program, graph: nx.DiGraph, n: int) -> np.ndarray:
    """largest[k]: bytes of the biggest single activation crossing boundary k."""
    largest = np.zeros(n + 1, dtype=np.int64)
    last = last_uses(program)
    aux = program.aux_outputs
    for i, e in enumerate(program.eqns):
        for v in e.outvars:
            if v in last and last[v] > i and v not in aux:
                b = graph.nodes[("val", v)]["bytes"]
                seg = largest[i + 1: last[v] + 1]
                np.maximum(seg, b, out=seg)
    return largest


def _passing_bytes(program: Program, graph: nx.DiGraph, cuts: list[int]):
    """Per candidate cut k: bytes of the values that pass its neighbourhood untouched
    (defined before the previous candidate, not used until after the next: skip tensors),
    and the largest single value crossing k that does not.

    Returns two dicts keyed by cut; cuts without passing values are left out.
    """
    n = len(program.eqns)
    uses: dict[int, list[int]] = {}
    defs = definitions(program)
    for i, e in enumerate(program.eqns):
        for v in e.invars:
            if isinstance(v, int):
                uses.setdefault(v, []).append(i)
    skip = program.free | program.aux_outputs
    cut_arr = np.asarray(cuts, dtype=np.int64)
    passing: dict[int, int] = {}
    crossing_vals: dict[int, list[tuple[int, bool]]] = {}
    for v, where in uses.items():
        d = defs[v]
        if v in skip or where[-1] <= d:
            continue
        b = graph.nodes[("val", v)]["bytes"]
        # candidate cuts k with d < k <= last use
        lo, hi = np.searchsorted(cut_arr, d + 1), np.searchsorted(cut_arr, where[-1], side="right")
        for ci in range(lo, hi):
            k = cuts[ci]
            p = cuts[ci - 1] if ci > 0 else 0
            q = cuts[ci + 1] if ci + 1 < len(cuts) else n
            untouched = d < p and _first_at_or_after(where, p) >= q
            crossing_vals.setdefault(k, []).append((b, untouched))
            if untouched:
                passing[k] = passing.get(k, 0) + b
    largest_local = {k: max((b for b, untouched in crossing_vals[k] if not untouched), default=0)
                     for k in passing}
    return passing, largest_local


def _first_at_or_after(sorted_uses: list[int], pos: int) -> int:
    import bisect
    i = bisect.bisect_left(sorted_uses, pos)
    return sorted_uses[i] if i < len(sorted_uses) else 1 << 62


def _thin(candidates: list[int], crossing: np.ndarray, n: int, keep: int) -> list[int]:
    if len(candidates) <= keep:
        return candidates
    # Keep the cheapest cuts, but spread: split the order into `keep` equal windows and
    # take the least-crossing candidate in each.
    chosen = []
    for w in range(keep):
        lo, hi = n * w / keep, n * (w + 1) / keep
        window = [k for k in candidates if lo <= k < hi]
        if window:
            chosen.append(min(window, key=lambda k: (crossing[k], k)))
    return sorted(set(chosen))


def _stage_name(program: Program, lo: int, hi: int) -> str:
    scopes = Counter()
    order = []
    for e in program.eqns[lo:hi]:
        s = _scope(e.module_path, 3)
        if s and s not in scopes:
            order.append(s)
        scopes[s] += 1
    if not order:
        return f"eqns[{lo}:{hi}]"
    prefix = order[0].split("/")
    for s in order[1:]:
        parts = s.split("/")
        i = 0
        while i < min(len(prefix), len(parts)) and prefix[i] == parts[i]:
            i += 1
        prefix = prefix[:i]
    head = "/".join(prefix)
    tails = [s[len(head):].strip("/") for s in order if s[len(head):].strip("/")]
    if not tails:
        return head
    return f"{head}[{','.join(dict.fromkeys(tails))}]" if head else ",".join(dict.fromkeys(tails))


def build_cost_graph(program: Program, *, max_stages: int = 48) -> CostGraph:
    """Graph, crossing profile and stages of a traced program."""
    graph = build_graph(program)
    stages = find_stages(program, graph, max_stages=max_stages)
    total = float(sum(d["flops"] for node, d in graph.nodes(data=True) if node[0] == "eqn"))
    return CostGraph(graph, stages, crossing_bytes(program, graph), total)
