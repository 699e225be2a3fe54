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
import re

import networkx as nx
import numpy as np

from .constants import (MAX_STAGES, MIN_BLOCK_FLOPS_SHARE, MIN_SUB_STAGE_SHARE, STREAM_RATIO,
                        TRIVIAL_STAGE_SHARE, VARIANT_EXTRA)
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


def value_uses(program: Program) -> dict[int, list[int]]:
    """value id -> the indices of the equations using it, in order (an index once per
    operand slot); values no equation uses are absent."""
    uses: dict[int, list[int]] = {}
    for i, e in enumerate(program.eqns):
        for v in e.invars:
            if isinstance(v, int):
                uses.setdefault(v, []).append(i)
    return uses


def crossing_bytes(program: Program, graph: nx.DiGraph, only=None) -> np.ndarray:
    """crossing[k]: bytes of activations (not params, batch or constants) defined before
    equation k and used at or after it, for k = 0..len(eqns). Aux outputs (returned by
    the step, e.g. new batch statistics) are counted with fixed memory, not here.
    With `only` (a set of value ids), only those values count."""
    n = len(program.eqns)
    diff = np.zeros(n + 2, dtype=np.int64)
    for first, last, b in crossing_values(program, graph, only):
        diff[first] += b
        diff[last + 1] -= b
    return np.cumsum(diff)[: n + 1]


def crossing_values(program: Program, graph: nx.DiGraph, only=None):
    """(first, last, bytes) per activation that crosses a boundary: it is defined before
    equation `first` and last used at equation `last` (first <= last), so it crosses
    boundaries first..last. Parameters, batch, constants and aux outputs are left out;
    with `only` (a set of value ids), only those values count."""
    last = last_uses(program)
    aux = program.aux_outputs
    for i, e in enumerate(program.eqns):
        for v in e.outvars:
            if v in last and last[v] > i and v not in aux and (only is None or v in only):
                yield i + 1, last[v], graph.nodes[("val", v)]["bytes"]


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
    # Stage ranges [a, c) that are one copy of a repeated block cut into several stages:
    # the planner may also checkpoint such a copy whole, as nn.remat per block does.
    spans: tuple[tuple[int, int], ...] = ()
    # Per group of repeated blocks (graph.find_blocks), the stage ranges [a, c) of its
    # copies whose ends are cuts, one stage (c = a + 1) or several (then also in `spans`):
    # what nn.remat per block wraps.
    blocks: tuple[tuple[tuple[int, int], ...], ...] = ()

    def boundary_bytes(self, k: int) -> int:
        """Bytes crossing the cut after stage k-1 (k=0: before the first stage)."""
        if k == 0:
            return 0
        return int(self.crossing[self.stages[k - 1].stop]) if k < len(self.stages) else 0


def _scope(path: str, depth: int) -> str:
    parts = [p for p in path.split("/") if p]
    return "/".join(parts[:depth])


def varying_values(program: Program) -> frozenset[int]:
    """Values that depend on a parameter: the ones the step's backward pass reaches.
    Batch arguments (data, frozen parameters), constants and whatever is computed from
    them alone (masks, position ids, rotary tables, RNG keys, the blocks before the first
    trainable parameter) get no gradient."""
    varying = set(program.invars[:program.n_param_leaves])
    for e in program.eqns:
        if any(not isinstance(v, Literal) and v in varying for v in e.invars):
            varying.update(e.outvars)
    return frozenset(varying)


# ---------------------------------------------------------------------------------------
# Repeated blocks, by structure
# ---------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class BlockGroup:
    """Copies of one block: equations [starts[j], starts[j] + length) for each copy j,
    every copy the same primitives with the same parameters in the same order. Copies
    are consecutive and of the same shapes (a transformer's layers), or, where a model
    repeats a block at several widths (a U-Net's or a ResNet's conv blocks, with pooling
    or upsampling between them), the same up to shapes (_shape_free_tokens). Found from
    the program's structure alone, whatever the module names."""

    starts: tuple[int, ...]
    length: int
    # Copies with something added: a stretch next to a copy holding every equation of
    # the block in order, up to shapes, plus at most half as many more (a ResNet stage's
    # first block, whose shortcut has a projection). The user's block class is the same,
    # so `nn.remat(Block)` wraps it too (_variants).
    variants: tuple[tuple[int, int], ...] = ()

    @property
    def ranges(self) -> tuple[tuple[int, int], ...]:
        return tuple(sorted([(s, s + self.length) for s in self.starts] + list(self.variants)))

    @property
    def stop(self) -> int:
        return self.starts[-1] + self.length


_ADDRESS = re.compile(r" at 0x[0-9a-fA-F]+")


def _eqn_tokens(program: Program) -> np.ndarray:
    """One integer per equation, equal for equations that do the same thing on values of
    the same shapes (value ids and function addresses in parameters left out)."""
    ids: dict[str, int] = {}
    out = np.empty(len(program.eqns), dtype=np.int64)
    for i, e in enumerate(program.eqns):
        # A literal by its type only: a block's RNG stream is folded with a constant of
        # its own (Flax's dropout), which makes no other block.
        ins = ",".join(program.avals[v].str_short() if isinstance(v, int)
                       else f"L{np.asarray(v.val).dtype}{np.shape(v.val)}" for v in e.invars)
        outs = ",".join(program.avals[v].str_short() for v in e.outvars)
        params = _ADDRESS.sub("", repr(sorted((k, repr(p)) for k, p in e.params.items())))
        out[i] = ids.setdefault(f"{e.name}|{params}|{ins}|{outs}", len(ids))
    return out


_INTEGER = re.compile(r"-?\b\d+\b")


def _shape_free_tokens(program: Program) -> np.ndarray:
    """_eqn_tokens up to shapes: operands by rank and dtype, and every integer in the
    parameters (sizes, paddings, strides, a reshape's new sizes) left out, so that the
    same block at another width (a U-Net's conv block after pooling) reads the same."""
    ids: dict[str, int] = {}
    out = np.empty(len(program.eqns), dtype=np.int64)

    def kind(v) -> str:
        if isinstance(v, int):
            aval = program.avals[v]
            return f"{aval.dtype}[{len(aval.shape)}]"
        return f"L{np.asarray(v.val).dtype}{np.ndim(v.val)}"

    for i, e in enumerate(program.eqns):
        params = _INTEGER.sub("#", _ADDRESS.sub("", repr(sorted((k, repr(p))
                                                                 for k, p in e.params.items()))))
        key = (f"{e.name}|{params}|{','.join(map(kind, e.invars))}"
               f"|{','.join(map(kind, e.outvars))}")
        out[i] = ids.setdefault(key, len(ids))
    return out


def find_blocks(program: Program, flops=None, crossing=None) -> tuple[BlockGroup, ...]:
    """Groups of repeated blocks, from the equation sequence alone.

    First the longest tandem repeats: the sequence of equation tokens (_eqn_tokens) is
    searched for the period whose run of consecutive copies covers the most equations; a
    copy starts where the least crosses (`crossing`, by default every activation) among
    the phases that keep the most whole copies. What is left before and after the group
    is searched the same way (an encoder then a decoder, a CNN's stages of different
    widths).

    Then the same block at other widths: up to shapes (_shape_free_tokens), a copy of a
    group's block found elsewhere joins the group (a ResNet stage's last block, after the
    stage's first changed the width). Where no block repeats in a row at all, the block
    whose copies, wherever they are, cover the most equations forms a group (a U-Net's
    conv blocks, with pooling, upsampling and skip concatenations between them), searched
    again until none is left (_best_spread_repeat).
    """
    n = len(program.eqns)
    if flops is None:
        flops = [eqn_flops(e.name, e.params, [_aval(program, v) for v in e.invars],
                           [program.avals[v] for v in e.outvars]) for e in program.eqns]
    flops_prefix = np.concatenate([[0.0], np.cumsum(flops)])
    floor = MIN_BLOCK_FLOPS_SHARE * flops_prefix[-1]
    if crossing is None:
        crossing = np.zeros(n + 1)
    tok, shape_free = _eqn_tokens(program), _shape_free_tokens(program)
    groups: list[BlockGroup] = []
    covered = np.zeros(n, dtype=bool)
    searched: set[tuple[int, int]] = set()  # uncovered runs holding no tandem repeat

    def claim(g: BlockGroup) -> None:
        for lo, hi in g.ranges:
            covered[lo:hi] = True
        groups.append(g)

    while (run := next((r for r in _uncovered_runs(covered) if r not in searched), None)):
        g = _best_repeat(tok, *run, flops_prefix, floor, crossing, program)
        if g is None:
            searched.add(run)
            continue
        claim(g)
    if groups:
        # The model's block (the group covering the most) at another width, where it
        # does not repeat in a row (copies in a row are a group of their own, with their
        # own cuts inside: a ResNet-50's stages), even over a smaller group's copies (the
        # corpus CNN's last block, which a phase-shifted pair of its halves had taken).
        main = max(groups, key=lambda g: (len(g.starts) * g.length, g.length))
        held = np.zeros(n, dtype=bool)
        for g in groups:
            if g.length >= main.length:
                for lo, hi in g.ranges:
                    held[lo:hi] = True
        more = _occurrences(shape_free, shape_free[main.starts[0]:main.starts[0] + main.length],
                            held)
        more = [s for s in more if s - main.length not in more and s + main.length not in more]
        if more:
            grown = BlockGroup(tuple(sorted((*main.starts, *more))), main.length)
            groups[:] = _take_over(groups, main, grown,
                                   [(s, s + main.length) for s in more], n)
        # Each group's block with a branch added, next to its copies (every ResNet
        # stage's first block, whose shortcut has a projection), largest groups first.
        weights = _weights(program)
        for first in [g.starts[0] for g in sorted(groups, key=lambda g: -len(g.starts) * g.length)]:
            g = next((g for g in groups if g.starts[0] == first), None)
            if g is None:
                continue
            held = np.zeros(n, dtype=bool)
            for other in groups:
                if other.length >= g.length or other.variants:
                    for lo, hi in other.ranges:
                        held[lo:hi] = True
            variants = _variants(program, shape_free, g, held, crossing, weights)
            if variants:
                groups[:] = _take_over(groups, g, dataclasses.replace(g, variants=variants),
                                       variants, n)
    # Where no block repeats in a row, copies of one block anywhere (a U-Net). Where one
    # does, the rest is its surroundings: a ResNet's stem and the first half of its
    # projection block are alike up to shapes, but cutting there took the cuts the
    # projection block had (the corpus CNN at dots_saveable's peak: 2.87% against
    # -0.10%).
    if not groups:
        while (g := _best_spread_repeat(shape_free, covered, flops_prefix, floor)) is not None:
            claim(g)
    return tuple(sorted(groups, key=lambda g: g.starts[0]))


def _is_subsequence(block: np.ndarray, window: np.ndarray) -> bool:
    it = iter(window.tolist())
    return all(any(t == w for w in it) for t in block.tolist())


def _weights(program: Program) -> set[int]:
    """Values computed from parameters alone (and constants): a layer's weights, also
    where the model casts or slices them first."""
    out = set(program.invars[:program.n_param_leaves])
    for e in program.eqns:
        ins = [v for v in e.invars if isinstance(v, int)]
        if ins and all(v in out or v in program.consts for v in ins):
            out.update(e.outvars)
    return out


def _reads(program: Program, values: set[int], lo: int, hi: int) -> int:
    """How many distinct `values` equations [lo, hi) read."""
    return len({v for e in program.eqns[lo:hi] for v in e.invars
                if isinstance(v, int) and v in values})


def _take_over(groups: list[BlockGroup], g: BlockGroup, grown: BlockGroup, ranges,
               n: int) -> list[BlockGroup]:
    """`groups` with `g` replaced by `grown`, which adds `ranges` to it: the copies of
    smaller groups (without variants of their own) overlapping those ranges go, and a
    group left with fewer than two copies goes."""
    taken = np.zeros(n, dtype=bool)
    for lo, hi in ranges:
        taken[lo:hi] = True
    kept = []
    for other in groups:
        if other is g:
            other = grown
        elif other.length < g.length and not other.variants:
            other = BlockGroup(tuple(s for s in other.starts
                                     if not taken[s:s + other.length].any()), other.length)
        if len(other.starts) >= 2:
            kept.append(other)
    return kept


def _variants(program: Program, tok: np.ndarray, main: BlockGroup, held: np.ndarray,
              crossing: np.ndarray, weights: set[int]) -> tuple[tuple[int, int], ...]:
    """Stretches right before a copy of `main`, or right after one, that hold every
    equation of its block in order, up to shapes (`tok`), plus at most VARIANT_EXTRA x
    its length more, and no equation of a copy or of another group's (`held`): the same
    block class with an added branch (a ResNet stage's first block). What is added has
    weights of its own: the stretch reads more `weights` (_weights) than the block (a
    projection, not the activation of the block before). The free end is put
    where the least crosses (`crossing`), among the stretches that hold the block: the
    block's input, not its input and a projection of it."""
    block = tok[main.starts[0]:main.starts[0] + main.length]
    L, n = main.length, len(tok)
    block_weights = _reads(program, weights, main.starts[0], main.starts[0] + L)
    longest = L + int(VARIANT_EXTRA * L)
    taken = held.copy()
    for lo, hi in main.ranges:
        taken[lo:hi] = True
    found = []
    for s in main.starts:
        for anchor, direction in ((s, -1), (s + L, 1)):
            best = None
            for size in range(L + 1, longest + 1):
                lo, hi = (anchor - size, anchor) if direction < 0 else (anchor, anchor + size)
                if lo < 0 or hi > n or taken[lo:hi].any():
                    break
                # the free end's first (or last) equation is the block's
                end = lo if direction < 0 else hi - 1
                if tok[end] != (block[0] if direction < 0 else block[-1]):
                    continue
                if (not _is_subsequence(block, tok[lo:hi])
                        or _reads(program, weights, lo, hi) <= block_weights):
                    continue
                free = lo if direction < 0 else hi
                if best is None or crossing[free] < best[0]:
                    best = (crossing[free], lo, hi)
            if best is not None:
                found.append((best[1], best[2]))
                taken[best[1]:best[2]] = True
    return tuple(sorted(found))


def _uncovered_runs(covered: np.ndarray) -> list[tuple[int, int]]:
    """Maximal runs [lo, hi) of equations no group covers."""
    edges = np.flatnonzero(np.diff(np.concatenate([[1], covered.astype(np.int8), [1]])))
    return [(int(a), int(b)) for a, b in zip(edges[0::2], edges[1::2])]


def _occurrences(tok: np.ndarray, block: np.ndarray, covered: np.ndarray) -> list[int]:
    """Starts of non-overlapping occurrences of `block` in `tok` on equations not
    `covered`, left to right."""
    p, n = len(block), len(tok)
    out, s = [], 0
    while s + p <= n:
        if not covered[s:s + p].any() and np.array_equal(tok[s:s + p], block):
            out.append(s)
            s += p
        else:
            s += 1
    return out


def _best_spread_repeat(tok, covered, flops_prefix, floor) -> BlockGroup | None:
    """Among windows of equations no group covers, the block whose non-overlapping copies
    (two or more, anywhere, each with at least `floor` FLOPs) cover the most equations; on
    a tie the longer block (a U-Net's conv block, not each of its conv-norm-activation
    halves). None when there is none."""
    n = len(tok)
    if n < 2:
        return None
    # Polynomial hashes of every window (wrapping uint64 arithmetic): equal windows hash
    # equal; a collision is ruled out by comparing the tokens themselves.
    base = np.uint64(1_000_003)
    with np.errstate(over="ignore"):
        powers = np.cumprod(np.full(n, base, dtype=np.uint64), dtype=np.uint64)
        powers = np.concatenate([[np.uint64(1)], powers[:-1]])
        prefix = np.concatenate([[np.uint64(0)],
                                 np.cumsum(tok.astype(np.uint64) * powers, dtype=np.uint64)])
    blocked = np.concatenate([[0], np.cumsum(covered)])
    longest = max((hi - lo for lo, hi in _uncovered_runs(covered)), default=0)
    best = None  # (covered equations, period, starts)
    for p in range(1, min(longest, n // 2) + 1):
        starts = np.arange(0, n - p + 1)
        ok = (blocked[starts + p] - blocked[starts]) == 0
        ok &= flops_prefix[starts + p] - flops_prefix[starts] >= floor
        starts = starts[ok]
        if len(starts) < 2:
            continue
        with np.errstate(over="ignore"):
            # windows compared at the same offset: hash(s) * base^(n - s)
            h = (prefix[starts + p] - prefix[starts]) * powers[n - 1 - starts]
        values, inverse, counts = np.unique(h, return_inverse=True, return_counts=True)
        for v in np.argsort(-counts, kind="stable"):
            if counts[v] < 2 or (best is not None and counts[v] * p < best[0]):
                break
            chosen, last = [], -1
            for s in starts[inverse == v]:
                if s >= last and (not chosen or np.array_equal(tok[s:s + p],
                                                               tok[chosen[0]:chosen[0] + p])):
                    chosen.append(int(s))
                    last = s + p
            if len(chosen) >= 2 and (best is None or len(chosen) * p >= best[0]):
                best = (len(chosen) * p, p, tuple(chosen))
    if best is None:
        return None
    return BlockGroup(best[2], best[1])


def _shared_depth(program: Program, k: int) -> int:
    """Module path levels equations k-1 and k share (0 at the ends of the program)."""
    if not 0 < k < len(program.eqns):
        return 0
    a = program.eqns[k - 1].module_path.split("/")
    b = program.eqns[k].module_path.split("/")
    i = 0
    while i < min(len(a), len(b)) and a[i] == b[i] and a[i]:
        i += 1
    return i


def _aval(program: Program, v):
    return program.avals[v] if isinstance(v, int) else _literal_aval(v)


def _best_repeat(tok, lo, hi, flops_prefix, floor, crossing, program) -> BlockGroup | None:
    seq = tok[lo:hi]
    m = len(seq)
    best = None  # (covered, -period, run start, run stop, period)
    for p in range(1, m // 2 + 1):
        same = np.concatenate([[False], seq[:-p] == seq[p:], [False]])
        edges = np.flatnonzero(np.diff(same.astype(np.int8)))
        if not len(edges):
            continue
        starts, stops = edges[0::2], edges[1::2]
        runs = stops - starts
        i = int(np.argmax(runs))
        if runs[i] < p:
            continue
        covered = (runs[i] // p + 1) * p
        key = (covered, -p)
        if best is None or key > best[0]:
            best = (key, lo + int(starts[i]), lo + int(stops[i]) + p, p)
    if best is None:
        return None
    _, s, e, p = best
    options = []
    for r in range(p):
        starts = tuple(range(s + r, e - p + 1, p))
        if len(starts) < 2:
            continue
        cuts = [*starts, starts[-1] + p]
        # Between phases the dataflow cannot tell apart (a post-LN block starts before or
        # after its norm), take the one whose copies start where module paths part
        # earliest: the copies are then the user's modules, for naming only.
        shared = sum(_shared_depth(program, k) for k in cuts)
        options.append((-len(starts), float(sum(crossing[k] for k in cuts)), shared, r, starts))
    if not options:
        return None
    *_, starts = min(options)
    if flops_prefix[starts[0] + p] - flops_prefix[starts[0]] < floor:
        return None
    return BlockGroup(starts, p)


def find_stages(program: Program, graph: nx.DiGraph, *,
                max_stages: int = MAX_STAGES) -> tuple[Stage, ...]:
    """Cut the equation order where little crosses, from the dataflow alone
    (_stages_and_blocks)."""
    return _stages_and_blocks(program, graph, max_stages)[0]


def _stages_and_blocks(program: Program, graph: nx.DiGraph, max_stages: int):
    """The stages, and the repeated blocks (find_blocks) they were cut around.

    Cut the equation order where little crosses, from the dataflow alone.

    What decides a cut is the activations crossing it, less those that the copies of a
    repeated block all read (masks, position ids, rotary tables, RNG keys passed into
    every block): such values never prevent a cut, though they count in the boundary
    bytes of every cut they cross. Module names play no part.

    Repeated blocks (find_blocks) are cut at every copy's boundary, and inside every copy
    at the same offsets where no more crosses than into the block (between attention and
    MLP of a transformer block); values passing a block untouched (a U-Net's skips) are
    set aside there. Elsewhere, at any equation boundary, a cut is kept when what crosses
    is no bigger than 1.25 x its largest single value (one stream, not a stream plus a
    side branch), or when that holds once the values passing its neighbourhood untouched
    are set aside (`_passing_bytes`). Too many cuts are thinned to `max_stages`: cuts
    inside blocks go first, then blocks are grouped, then the other cuts are spread.
    """
    n = len(program.eqns)
    flops = [graph.nodes[("eqn", i)]["flops"] for i in range(n)]
    groups = find_blocks(program, flops, crossing_bytes(program, graph))
    units = unit_groups(program, groups, flops)
    counted = _activations(program) - _shared_by_copies(program, groups) - program.aux_outputs
    crossing = crossing_bytes(program, graph, counted)
    largest = _largest_crossing_value(program, graph, n, counted)
    # The copies of the same shapes as each group's first share its cuts inside; a copy
    # at another width is cut inside where the dataflow says, as any other stretch (the
    # corpus CNN's last block; a ResNet-50 stage's blocks, whose cuts inside are not at
    # the same places as those of the first stage's)
    tok = _eqn_tokens(program)
    exact = [BlockGroup(tuple(s for s in g.starts
                              if np.array_equal(tok[s:s + g.length],
                                                tok[g.starts[0]:g.starts[0] + g.length])),
                        g.length) for g in groups]
    block_cuts = _block_cuts(program, graph, exact, counted, flops)
    inside = np.zeros(n + 1, dtype=bool)
    for g in exact:
        for lo, hi in g.ranges:
            inside[lo + 1:hi] = True
    boundaries = [k for k in range(1, n) if not inside[k]]
    passing, largest_local = _passing_bytes(program, graph, boundaries, counted)
    others = []
    for k in boundaries:
        if crossing[k] == 0 or crossing[k] <= STREAM_RATIO * largest[k]:
            others.append(k)
        elif k in passing and crossing[k] - passing[k] <= STREAM_RATIO * largest_local[k]:
            others.append(k)
    protected = sorted({c for g in (*groups, *units) for r in g.ranges for c in r} - {0, n})
    cuts = _limit_cuts(exact, block_cuts, protected, others, crossing, n, max_stages - 1)
    cuts = _merge_trivial(cuts, flops, n, frozenset(protected))
    cuts = drop_split_readers(program, cuts, counted, frozenset(protected))
    if _returns_scalar(program):  # a step's loss, not a scan body's carry
        cuts = merge_loss_tail(cuts, crossing, frozenset(protected))
    bounds = [0, *cuts, n]
    stages = []
    for lo, hi in zip(bounds[:-1], bounds[1:]):
        stages.append(Stage(lo, hi, stage_name(program, lo, hi), float(sum(flops[lo:hi])),
                            stage_bytes(graph, lo, hi)))
    return tuple(stages), (*groups, *units)


def unit_groups(program: Program, groups, flops) -> tuple[BlockGroup, ...]:
    """Per group whose block is itself two or more consecutive copies of a smaller unit
    up to shapes (_shape_free_tokens), the group of those units, in every copy.

    Structure cannot tell which of the two the user wraps in `nn.remat`: a U-Net's conv
    block is two conv-norm-activation units at two widths, a DenseNet's dense block
    three dense layers each reading a wider concatenation, and the same token pattern
    is either. find_blocks takes the longer; the units' boundaries are cut too and
    their copies are blocks of their own (graph.block_stages), so that either choice,
    and every mix, is in the plan space. A unit carries at least MIN_BLOCK_FLOPS_SHARE
    of the program's FLOPs, as a block does."""
    shape_free = _shape_free_tokens(program)
    prefix = np.concatenate([[0.0], np.cumsum(flops)])
    floor = MIN_BLOCK_FLOPS_SHARE * prefix[-1]
    out = []
    for g in groups:
        p = g.length
        for q in range(1, p // 2 + 1):
            if p % q:
                continue
            starts = tuple(s + j * q for s in g.starts for j in range(p // q))
            first = shape_free[g.starts[0]:g.starts[0] + q]
            if all(np.array_equal(shape_free[s:s + q], first)
                   and prefix[s + q] - prefix[s] >= floor for s in starts):
                out.append(BlockGroup(starts, q))
                break
    return tuple(out)


def _returns_scalar(program: Program) -> bool:
    """Whether the program's first output is a scalar (a loss)."""
    out = program.outvars[0] if program.outvars else None
    return isinstance(out, int) and program.avals[out].shape == ()


def merge_loss_tail(cuts: list[int], crossing, protected: frozenset[int] = frozenset()) -> list[int]:
    """Drop the cuts after the narrowest one from the last `protected` cut (block
    boundary) on: the loss head after it (the logits' matmul, the softmax, the loss) is one
    stage. Every such cut crosses more than the narrowest (the logits, where a cut before
    the head crosses a block's output), the tail's forward runs right before its
    backward, so a checkpoint inside it saves little, and XLA fuses across those cuts in
    the step: it makes the logits' cotangent and its transpose from the softmax's
    buffers with them all live, which stages profiled apart do not hold (docs/jax-facts.md,
    fact 13). Of equally narrow cuts the last is kept."""
    last_protected = max((c for c in cuts if c in protected), default=0)
    tail = [c for c in cuts if c > last_protected]
    if not last_protected or not tail:  # no blocks: no head to tell apart
        return list(cuts)
    candidates = [last_protected, *tail]
    narrowest = min(candidates, key=lambda c: (crossing[c], -c))
    return [c for c in cuts if c <= narrowest]


def drop_split_readers(program: Program, cuts: list[int], counted: set[int],
                        protected: frozenset[int] = frozenset()) -> list[int]:
    """Drop each cut that two stages read the same activation across: one computed before
    the stage ending at the cut, read in it and in the stage starting there (a
    BatchNorm's input, read by its statistics and by its normalisation). Checkpointed,
    both stages would keep that array as their input, which XLA holds once; and
    recomputing either stage starts from it, so the cut saves nothing the merged stage
    does not. The `protected` cuts (block boundaries) stay; values all copies of a block
    read (masks, position ids: not in `counted`) never drop a cut."""
    defs = definitions(program)
    uses = {v: us for v, us in value_uses(program).items() if v in counted}
    n = len(program.eqns)
    kept = list(cuts)
    j = 0
    while j < len(kept):
        bounds = [0, *kept, n]
        lo, k, hi = bounds[j], bounds[j + 1], bounds[j + 2]
        if k not in protected and any(
                defs[v] < lo and _first_at_or_after(us, lo) < k
                and _first_at_or_after(us, k) < hi for v, us in uses.items()):
            del kept[j]  # the stage before it grows: check the same position again
        else:
            j += 1
    return kept


def _activations(program: Program) -> set[int]:
    """Values computed by equations."""
    return {v for e in program.eqns for v in e.outvars}


def _shared_by_copies(program: Program, groups) -> set[int]:
    """Values read by two or more copies of a repeated block: what every block is given
    besides its input stream (an attention mask, position ids, an RNG key)."""
    copy_of = np.full(len(program.eqns), -1, dtype=np.int64)
    for gi, g in enumerate(groups):
        for j, (lo, hi) in enumerate(g.ranges):
            copy_of[lo:hi] = gi * 1_000_000 + j
    readers: dict[int, set[int]] = {}
    for i, e in enumerate(program.eqns):
        if copy_of[i] >= 0:
            for v in e.invars:
                if isinstance(v, int):
                    readers.setdefault(v, set()).add(int(copy_of[i]))
    return {v for v, copies in readers.items() if len(copies) >= 2}


def block_stages(stages, groups) -> tuple[tuple[tuple[int, int], ...], ...]:
    """Per group, the stage ranges [a, c) that are exactly one copy of its block."""
    first = {s.start: k for k, s in enumerate(stages)}
    stop = {s.stop: k + 1 for k, s in enumerate(stages)}
    out = (tuple((first[lo], stop[hi]) for lo, hi in g.ranges if lo in first and hi in stop)
           for g in groups)
    return tuple(g for g in out if g)


def block_spans(stages, groups) -> tuple[tuple[int, int], ...]:
    """Stage ranges [a, c), c - a >= 2, each exactly one copy of a repeated block."""
    return tuple(sorted((a, c) for g in block_stages(stages, groups) for a, c in g
                        if c - a >= 2))


def _block_cuts(program: Program, graph: nx.DiGraph, groups, counted,
                flops) -> list[list[int]]:
    """Per group: the offsets inside a block where, in every copy, the `counted` values
    that the copy touches and that cross the offset are no more than 1.25 x those
    crossing into the copy (the residual stream between attention and MLP)."""
    defs = definitions(program)
    last = last_uses(program)
    uses = value_uses(program)
    out = []
    for g in groups:
        ok = worst = None
        for lo, hi in g.ranges:
            local = np.zeros(hi - lo + 1, dtype=np.int64)  # offsets 0..length
            diff = np.zeros(hi - lo + 2, dtype=np.int64)
            for v, where in uses.items():
                if v not in counted or v in program.free:
                    continue  # parameters are live anyway; shared inputs set aside
                d, l = defs[v], last.get(v, -1)
                if l < lo or d >= hi:
                    continue
                # used in the copy, or defined in it and used after it: touched by the copy
                if d < lo and not any(lo <= w < hi for w in where):
                    continue  # passes the copy untouched (a skip around it)
                b = graph.nodes[("val", v)]["bytes"]
                first = max(d + 1, lo) - lo
                stop = min(l, hi) - lo
                if stop >= first:
                    diff[first] += b
                    diff[stop + 1] -= b
            local = np.cumsum(diff)[: hi - lo + 1]
            good = local[1:-1] <= STREAM_RATIO * max(local[0], 1)
            ok = good if ok is None else ok & good
            worst = local if worst is None else np.maximum(worst, local)
        out.append(_spread_offsets(ok, worst, flops[g.starts[0]:g.starts[0] + g.length]))
    return out




def _spread_offsets(ok: np.ndarray, crossing: np.ndarray, flops) -> list[int]:
    """One offset per run of acceptable offsets (the least crossing, the latest on a tie),
    keeping only those that leave MIN_SUB_STAGE_SHARE of the block's FLOPs on each side."""
    prefix = np.concatenate([[0.0], np.cumsum(flops)])
    total = prefix[-1]
    picks, run = [], []
    for o in [*(int(i) + 1 for i in np.flatnonzero(ok)), None]:
        if run and (o is None or o != run[-1] + 1):
            picks.append(min(run, key=lambda k: (crossing[k], -k)))
            run = []
        if o is not None:
            run.append(o)
    kept, prev = [], 0
    for o in picks:
        if prefix[o] - prefix[prev] >= MIN_SUB_STAGE_SHARE * total and \
                total - prefix[o] >= MIN_SUB_STAGE_SHARE * total:
            kept.append(o)
            prev = o
    return kept


def _limit_cuts(groups, block_cuts, protected, others, crossing, n, keep) -> list[int]:
    """At most `keep` cuts: block boundaries first, then the cuts inside blocks, then
    the rest spread over the equation order (_thin). When the block boundaries alone are
    too many, consecutive blocks are grouped."""
    inner = sorted({s + o for g, offs in zip(groups, block_cuts) for s in g.starts for o in offs})
    chosen = list(protected)
    if len(chosen) > keep:
        stride = -(-len(chosen) // keep)
        firsts = {g.starts[0] for g in groups} | {g.stop for g in groups}
        chosen = sorted({c for i, c in enumerate(chosen) if i % stride == 0 or c in firsts})
        return [c for c in chosen if 0 < c < n][:keep]
    if len(chosen) + len(inner) <= keep:
        chosen += inner
    room = keep - len(chosen)
    if room > 0 and others:
        chosen += _thin(others, crossing, n, room)
    return sorted(set(chosen) - {0, n})


def stage_bytes(graph: nx.DiGraph, lo: int, hi: int) -> float:
    """Memory traffic (eqn_bytes) of equations [lo, hi)."""
    return float(sum(graph.nodes[("eqn", i)]["bytes_accessed"] for i in range(lo, hi)))


def _merge_trivial(cuts: list[int], flops: list[float], n: int,
                   protected: frozenset[int] = frozenset()) -> list[int]:
    """Drop cuts that leave a stage with almost no compute (index arithmetic, embedding
    lookups): such a stage gives the solver nothing to trade and only costs time. The
    `protected` cuts (block boundaries) stay, so every copy of a block is one range."""
    bounds = [0, *cuts, n]
    work = [sum(flops[lo:hi]) for lo, hi in zip(bounds[:-1], bounds[1:])]
    floor = TRIVIAL_STAGE_SHARE * max(work, default=0.0)
    kept = []
    acc = 0.0
    for cut, w in zip(cuts, work[:-1]):
        acc += w
        if acc > floor or cut in protected:
            kept.append(cut)
            acc = 0.0
    if kept and sum(work[len(work) - 1:]) <= floor and kept[-1] not in protected:
        kept.pop()  # fold a trivial tail stage into the one before it
    return kept


def _largest_crossing_value(program: Program, graph: nx.DiGraph, n: int,
                            only=None) -> np.ndarray:
    """largest[k]: bytes of the biggest single activation (of `only`, if given) crossing
    boundary k."""
    largest = np.zeros(n + 1, dtype=np.int64)
    for first, last, b in crossing_values(program, graph, only):
        seg = largest[first: last + 1]
        np.maximum(seg, b, out=seg)
    return largest


def _passing_bytes(program: Program, graph: nx.DiGraph, cuts: list[int], only=None):
    """Per candidate cut k: bytes of the values that pass its neighbourhood untouched
    (defined before the previous candidate, not used until after the next: skip tensors),
    and the largest single value crossing k that does not.

    Returns two dicts keyed by cut; cuts without passing values are left out.
    """
    n = len(program.eqns)
    uses = value_uses(program)
    defs = definitions(program)
    skip = program.free | program.aux_outputs
    cut_arr = np.asarray(cuts, dtype=np.int64)
    passing: dict[int, int] = {}
    crossing_vals: dict[int, list[tuple[int, bool]]] = {}
    for v, where in uses.items():
        d = defs[v]
        if v in skip or where[-1] <= d or (only is not None and v not in only):
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


def stage_name(program: Program, lo: int, hi: int) -> str:
    """The module path the stage's equations share, with the distinct modules one level
    below it in order: `Model/transformer/h/0[ln_1,attn]`. A stage without module paths
    (plain JAX) is named by its equation range."""
    paths = [p for p in dict.fromkeys(e.module_path.strip("/") for e in program.eqns[lo:hi]) if p]
    if not paths:
        return f"eqns[{lo}:{hi}]"
    prefix = paths[0].split("/")
    for s in paths[1:]:
        parts = s.split("/")
        i = 0
        while i < min(len(prefix), len(parts)) and prefix[i] == parts[i]:
            i += 1
        prefix = prefix[:i]
    head = "/".join(prefix)
    depth = len(prefix)
    tails = [s.split("/")[depth] for s in paths if len(s.split("/")) > depth]
    if not tails:
        return head
    tails = ",".join(dict.fromkeys(tails))
    return f"{head}[{tails}]" if head else tails


def build_cost_graph(program: Program, *, max_stages: int = MAX_STAGES) -> CostGraph:
    """Graph, crossing profile and stages of a traced program."""
    graph = build_graph(program)
    stages, groups = _stages_and_blocks(program, graph, max_stages)
    total = float(sum(d["flops"] for node, d in graph.nodes(data=True) if node[0] == "eqn"))
    return CostGraph(graph, stages, crossing_bytes(program, graph), total,
                     block_spans(stages, groups), block_stages(stages, groups))
