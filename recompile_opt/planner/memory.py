"""What planning remembers between compiles in one process, as one value its owner passes in.

The driver (:mod:`recompile_opt.driver`) owns the process's :class:`PlanningMemory` and hands it to every
planning; a caller that passes none plans from nothing. Why one value: the planner is a function of its
inputs; what it reuses from earlier compiles (a graph's least-peak search, a whole-model budget's
shares, a graph's simulated and walked peaks) is one of those inputs, visible, and cleared in one place.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field


@dataclass
class PlanningMemory:
    """``range_ends``: each graph's fraction range (:func:`recompile_opt.planner.least_peak._range_search`:
    a frontier sweep's fractions and a peak sweep's limits on one graph search once), by fingerprint.
    ``budget_shares``: (byte budget, graph id) -> that graph's share of a whole-model budget, learned by
    :func:`recompile_opt.plan` (:mod:`recompile_opt.planner.budget_split`); ``unsplit``: budget -> the
    graphs that got all of it. ``peaks``: the simulated and walked peaks found per graph
    (:func:`recompile_opt.costs.simulator.simulator_for`), the most recently used last."""

    range_ends: dict = field(default_factory=dict)
    budget_shares: dict[tuple[int, str], int] = field(default_factory=dict)
    unsplit: dict[int, set[str]] = field(default_factory=dict)
    peaks: OrderedDict = field(default_factory=OrderedDict)

    def forget_budget_shares(self) -> None:
        self.budget_shares.clear()
        self.unsplit.clear()
