"""Every rank of a group must run the same plan: a rank that re-gathers a value the others keep calls an
all-gather they never call, and the step hangs (or, with equal shapes, exchanges the wrong tensors).
The planner is deterministic for this (no wall-clock limit, sums in graph order, no rank-dependent
constant in the graph; tests/test_parallel_rewrite.py gives each rank its own hash seed), and this
check turns any divergence left into an error at compile time, naming the ranks, instead of a hang.

It runs where the partitioner runs: a graph every rank finds in the compile cache is not checked again
(it was when it was planned), and one only some ranks find (a cache dir cleared on one node) leaves the
others waiting in the check until the process group's timeout: an error, late, where it was a hang."""

from __future__ import annotations

import hashlib

import torch.distributed as dist

from recompile_opt import _torch_internals as ti
from recompile_opt.plan import Plan


def fingerprint(plan: Plan) -> str:
    """What the plan keeps, recomputes and gathers again, and the collectives it runs, as a short hash.
    Not the graph's code: each rank's holds constants of its own (its rows' offsets)."""
    parts = [*sorted(plan.saved_names()), "|", *sorted(plan.recomputed_names()), "|",
             *(f"{c['name']} {c['op']} {c.get('shape')} {bool(c.get('regathered'))}" for c in plan.collectives)]
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:16]


def check_same_plan(plan: Plan, graph_id: str) -> None:
    """Raise if the ranks of the plan's collectives' group planned this graph differently. One small
    all-gather per compiled graph with collectives; nothing where there are none (or no live group)."""
    groups = {c.get("group") for c in plan.collectives} - {None}
    if len(groups) != 1 or not dist.is_available() or not dist.is_initialized():
        return
    group = ti.process_group(groups.pop())
    if group is None or dist.get_backend(group) == "fake":  # planned on a fake group (bench/paper.py --tp)
        return
    mine = fingerprint(plan)
    every = [None] * dist.get_world_size(group)
    with ti.real_tensors():  # the partitioner runs under the compile's fake mode
        dist.all_gather_object(every, mine, group=group)
    if len(set(every)) > 1:
        ranks = "; ".join(f"rank {r}: {h}" for r, h in enumerate(every))
        raise RuntimeError(f"recompile_opt: the ranks planned graph {graph_id} differently ({ranks}); their "
                           "collectives would not match. Every rank must compile with the same options and "
                           "inputs; if they did, this is a bug: please report it with each rank's "
                           "recompile_opt.last_plans()")
