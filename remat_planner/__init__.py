"""remat-planner: fit a JAX training step into a byte budget with the least recomputation.

    import remat_planner as rp
    plan = rp.plan(loss_fn, params, batch, budget="12GB", optimizer=optax.adamw(1e-3))
    planned_loss = plan.apply(loss_fn)
    step = rp.train_step(loss_fn, optimizer, plan)
    m = rp.measure(planned_loss, params, batch, optimizer=optimizer)

Pipeline, one module per stage: trace -> graph -> memory -> solve -> apply -> verify.
"""

from .budget import parse_budget
from .errors import (BudgetError, ConfigError, InfeasibleBudgetError, PlanMismatchError,
                     RematPlannerError, UnsupportedModelError)
from .export import FlaxExport, PrimitivePolicy, export_flax, module_plan
from .plan import Plan, Segment
from .policies import dots_narrow_saveable
from .planner import Analysis, analyze, measure_builtin_policies, plan
from .sharding import ShardingSpec, shard_arrays
from .step import Step
from .units import format_bytes
from .verify import Measurement, measure, train_step

__version__ = "0.1.0"

__all__ = [
    "Analysis", "BudgetError", "ConfigError", "FlaxExport", "InfeasibleBudgetError",
    "Measurement", "Plan", "PrimitivePolicy", "export_flax", "module_plan",
    "PlanMismatchError", "RematPlannerError", "Segment", "ShardingSpec", "Step",
    "UnsupportedModelError",
    "analyze", "dots_narrow_saveable", "format_bytes", "measure", "measure_builtin_policies", "parse_budget", "plan",
    "shard_arrays", "train_step",
]
