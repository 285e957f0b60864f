"""recompile_opt: a torch.compile backend that plans, per activation, keep or recompute — optimally
under a memory budget stated in bytes — and shows why.

    model = torch.compile(model, backend="recompile_opt", options={"memory_budget": "6GiB"})
    plan = recompile_opt.plan(model, (x, y), memory_budget=0.3)
"""

from recompile_opt.api import plan
from recompile_opt.backend import last_plans, recompile_opt_backend, reset_plans
from recompile_opt.options import OptionError, Options
from recompile_opt.parallel import parallel_plan, parallelize
from recompile_opt.plan import Plan, PlanEntry
from recompile_opt.planner.search import InfeasibleBudget

__all__ = [
    "InfeasibleBudget",
    "OptionError",
    "Options",
    "Plan",
    "PlanEntry",
    "last_plans",
    "parallel_plan",
    "parallelize",
    "plan",
    "recompile_opt_backend",
    "reset_plans",
]
__version__ = "0.1.0"
