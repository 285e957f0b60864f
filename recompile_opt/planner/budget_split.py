"""One byte budget for a whole model that Dynamo splits into several graphs.

Dynamo hands the backend one graph at a time, and each graph is partitioned (its kept set fixed) before
the next one is even traced, so no compile-time choice can know what later graphs need. The budget is
therefore split from a capture pass: :func:`recompile_opt.plan` captures every graph without running a
step, learns each graph's least possible kept bytes L_i and its save-all bytes A_i, and gives graph i

    share_i = L_i + (B - sum L) * (A_i - L_i) / sum (A_j - L_j)

(what each graph can save, in proportion), so the shares sum to B and every share is feasible whenever
B is. The shares are registered in the planning memory (:class:`~recompile_opt.planner.memory.PlanningMemory`,
the driver's), keyed by the budget and the graph's id, and any later compilation
with the same byte budget (``torch.compile(..., options={"memory_budget": B})``) uses them graph by
graph. Without a capture pass the budget holds per graph, and a second unsplit graph warns.

A float budget needs no split: a fraction of each graph's own range is that fraction of the model's.
"""

from __future__ import annotations

import dataclasses
import warnings

from recompile_opt.options import Options
from recompile_opt.plan import fmt_bytes
from recompile_opt.planner.memory import PlanningMemory


def split(budget: int, graphs: list[tuple[str, int, int]]) -> dict[str, int]:
    """Shares of ``budget`` for graphs given as (id, least bytes, save-all bytes)."""
    least = sum(lo for _, lo, _ in graphs)
    room = sum(hi - lo for _, lo, hi in graphs)
    spare = max(budget - least, 0)
    if room <= 0 or spare >= room:
        return {gid: hi if spare >= room else lo for gid, lo, hi in graphs}
    return {gid: lo + spare * (hi - lo) // room for gid, lo, hi in graphs}


def register(memory: PlanningMemory, budget: int, shares: dict[str, int]) -> None:
    for gid, share in shares.items():
        memory.budget_shares[(budget, gid)] = share


def options_for_graph(memory: PlanningMemory, options: Options, graph: str) -> tuple[Options, str | None]:
    """The options one graph is planned with, and a note for its plan when the budget was split."""
    budget = options.memory_budget
    if not isinstance(budget, int):
        return options, None
    share = memory.budget_shares.get((budget, graph))
    if share is not None:
        return (
            dataclasses.replace(options, memory_budget=share),
            f"whole-model memory_budget {fmt_bytes(budget)} split over the model's graphs "
            f"(learned by recompile_opt.plan): this graph's share is {fmt_bytes(share)}",
        )
    seen = memory.unsplit.setdefault(budget, set())
    seen.add(graph)
    if len(seen) == 2:
        warnings.warn(
            f"recompile_opt: a second graph with memory_budget={fmt_bytes(budget)}: the budget "
            "holds per graph; to hold it for the whole model, call recompile_opt.plan(model, "
            "example_inputs, memory_budget=...) once before compiling, which splits it"
        )
    return options, None


def state_key(memory: PlanningMemory, options: Options) -> str:
    """What of the registry a compilation with these options depends on (enters the cache key)."""
    budget = options.memory_budget
    if not isinstance(budget, int):
        return ""
    return repr(sorted((gid, s) for (b, gid), s in memory.budget_shares.items() if b == budget))
