"""The recompute cost model: FLOPs alone, or a roofline estimate of time.

FLOPs undercount memory-bound work: a layer norm or a GELU recomputed in the backward
pass costs almost no FLOPs but reads and writes whole activations. The `time` model
charges every equation

    seconds(eqn) = flops(eqn) / flops_per_second + bytes(eqn) / bytes_per_second

with `bytes` the operands read plus results written (graph.eqn_bytes). The solver
works in FLOP-equivalents, `flops + balance * bytes` with balance = flops_per_second /
bytes_per_second (FLOPs the machine does in the time it moves one byte), so only the
balance changes which plan is cheapest and what overhead ratio is predicted; the
FLOP rate only turns costs into seconds.

The constants are machine facts: `measure_machine()` times a matmul (compute-bound) and
a fused elementwise op (memory-bound) on this backend; the defaults are what it gave
on the 2-core development CPU. scripts/benchmark.py fits the balance to measured step
times of remat variants instead (least squares on their overhead ratios). On that CPU
the whole-step fit found no support for the byte term (fitted balance 0: the per-
equation traffic is counted unfused, while XLA fuses recomputed elementwise ops into
the backward's kernels), so the planner minimises FLOPs unless asked for "time"
(docs/benchmarks.md).
"""

from __future__ import annotations

import dataclasses
import time
from typing import Literal

import numpy as np

from .constants import DEFAULT_BYTES_PER_SECOND, DEFAULT_FLOPS_PER_SECOND

COST_MODELS = ("flops", "time")



@dataclasses.dataclass(frozen=True)
class CostModel:
    """How the planner prices recomputation.

    kind: "flops" minimises recompute FLOPs (the balance is ignored by the solver);
      "time" minimises flops / flops_per_second + bytes / bytes_per_second.
    Predicted seconds are reported with either kind.
    """

    kind: Literal["flops", "time"] = "flops"
    flops_per_second: float = DEFAULT_FLOPS_PER_SECOND
    bytes_per_second: float = DEFAULT_BYTES_PER_SECOND

    def __post_init__(self):
        if self.kind not in COST_MODELS:
            raise ValueError(f"cost model must be one of {', '.join(COST_MODELS)}, "
                             f"got {self.kind!r}")
        if not (self.flops_per_second > 0 and self.bytes_per_second > 0):
            raise ValueError("machine constants must be positive")

    @property
    def balance(self) -> float:
        """FLOPs per byte moved: the weight of one byte of traffic in FLOP-equivalents."""
        return self.flops_per_second / self.bytes_per_second

    @property
    def bytes_weight(self) -> float:
        """The weight the solver puts on a byte of traffic (0 for the FLOPs model)."""
        return self.balance if self.kind == "time" else 0.0

    def seconds(self, flops: float, nbytes: float) -> float:
        return flops / self.flops_per_second + nbytes / self.bytes_per_second

    def with_balance(self, balance: float, kind: str | None = None) -> "CostModel":
        """Same FLOP rate, bandwidth set so that the balance is `balance`."""
        return CostModel(kind or self.kind, self.flops_per_second,
                         self.flops_per_second / max(balance, 1e-12))


def resolve(cost_model) -> CostModel:
    """A CostModel from a CostModel, a kind name, or None (the default: "flops")."""
    if cost_model is None:
        return CostModel()
    if isinstance(cost_model, CostModel):
        return cost_model
    return CostModel(str(cost_model))


def predicted_overhead(balance: float, flops: float, nbytes: float, base_flops: float,
                       base_bytes: float) -> float:
    """Relative extra time of a step costing (flops, nbytes) over one costing
    (base_flops, base_bytes), at a machine balance (FLOPs per byte)."""
    return (flops + balance * nbytes) / (base_flops + balance * base_bytes) - 1.0


def fit_balance(points, lo: float = 0.0, hi: float = 1e4) -> tuple[float, float]:
    """The balance minimising the squared error of predicted_overhead against measured
    overheads. `points`: (flops, bytes, base_flops, base_bytes, measured_overhead) per
    variant. Returns (balance, rms error). A 1-D least squares, solved on a log grid and
    refined by golden-section search (the error is smooth in the balance)."""
    pts = [tuple(map(float, p)) for p in points]
    if not pts:
        raise ValueError("no points to fit")

    def err(b):
        return float(np.mean([(predicted_overhead(b, *p[:4]) - p[4]) ** 2 for p in pts]))

    grid = np.concatenate([[lo], np.geomspace(max(lo, 1e-3), hi, 200)])
    errs = [err(b) for b in grid]
    i = int(np.argmin(errs))
    a, c = grid[max(i - 1, 0)], grid[min(i + 1, len(grid) - 1)]
    g = (np.sqrt(5) - 1) / 2
    for _ in range(60):
        x1, x2 = c - g * (c - a), a + g * (c - a)
        if err(x1) < err(x2):
            c = x2
        else:
            a = x1
    best = min([(err(b), b) for b in ((a + c) / 2, grid[i])])
    return float(best[1]), float(np.sqrt(best[0]))


def measure_machine(repeats: int = 7, n: int = 1024, elems: int = 1 << 23) -> CostModel:
    """Time a float32 n x n matmul (compute-bound) and a fused elementwise
    `x * 1.5 + y` over `elems` values (memory-bound: 12 bytes per element) on the
    default backend; medians of `repeats` runs after a warm-up. Returns a time model."""
    import jax
    import jax.numpy as jnp

    def timed(f, *args):
        jax.block_until_ready(f(*args))
        ts = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            jax.block_until_ready(f(*args))
            ts.append(time.perf_counter() - t0)
        return float(np.median(ts))

    k = jax.random.key(0)
    a = jax.random.normal(k, (n, n), jnp.float32)
    b = jax.random.normal(jax.random.fold_in(k, 1), (n, n), jnp.float32)
    t_mm = timed(jax.jit(jnp.matmul), a, b)
    x = jax.random.normal(k, (elems,), jnp.float32)
    y = jax.random.normal(jax.random.fold_in(k, 2), (elems,), jnp.float32)
    t_ew = timed(jax.jit(lambda x, y: x * 1.5 + y), x, y)
    return CostModel("time", 2.0 * n ** 3 / t_mm, 12.0 * elems / t_ew)
