"""Every rank of a group must run the same plan: a rank that re-gathers a value the others keep calls an
all-gather they never call, and the step hangs (or, with equal shapes, exchanges the wrong tensors).
The planner is deterministic for this (no wall-clock limit, sums in graph order, no rank-dependent
constant in the graph; tests/test_parallel_rewrite.py gives each rank its own hash seed), and this
check turns any divergence left into an error at compile time, naming the ranks, instead of a hang.

It runs where the partitioner runs: a graph every rank finds in the compile cache is not checked again
(it was when it was planned), and one only some ranks find (a cache dir cleared on one node) leaves the
others waiting in the check for up to ``WAIT``: an error, late, where it was a hang."""

from __future__ import annotations

import hashlib
from datetime import timedelta

import torch.distributed as dist

from recompile_opt import _torch_internals as ti
from recompile_opt.plan import Plan


def fingerprint(plan: Plan) -> str:
    """What the plan keeps, recomputes and gathers again, and the collectives it runs, as a short hash.
    Not the graph's code: each rank's holds constants of its own (its rows' offsets)."""
    parts = [
        *sorted(plan.saved_names()),
        "|",
        *sorted(plan.recomputed_names()),
        "|",
        *(f"{c['name']} {c['op']} {c.get('shape')} {bool(c.get('regathered'))}" for c in plan.collectives),
    ]
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:16]


def check_same_plan(plan: Plan, graph_id: str) -> None:
    """Raise if the ranks of the plan's collectives' group planned this graph differently. Each rank
    posts its fingerprint in the process group's key-value store and reads the others' (no tensor
    collective: inside a compile, one through gloo hung both ranks under Inductor); nothing where the
    graph has no collectives, or no live group."""
    groups = {c.get("group") for c in plan.collectives} - {None}
    if len(groups) != 1 or not dist.is_available() or not dist.is_initialized():
        return
    name = groups.pop()
    group, store = ti.process_group(name), ti.default_store()
    if (
        group is None or store is None or dist.get_backend(group) == "fake"
    ):  # a fake group: bench/paper.py --tp
        return
    every = _exchange(store, name, dist.get_rank(group), dist.get_world_size(group), fingerprint(plan))
    if len(set(every)) > 1:
        ranks = "; ".join(f"rank {r}: {h}" for r, h in enumerate(every))
        raise RuntimeError(
            f"recompile_opt: the ranks planned graph {graph_id} differently ({ranks}); their "
            "collectives would not match. Every rank must compile with the same options and "
            "inputs; if they did, this is a bug: please report it with each rank's "
            "recompile_opt.last_plans()"
        )


_CHECKS: dict[str, int] = {}  # checks made per group in this process: ranks compile graphs in one order
WAIT = timedelta(minutes=30)  # a slower rank may still be compiling (gloo's own default timeout)


def _exchange(store, group: str, rank: int, size: int, mine: str) -> list[str]:
    _CHECKS[group] = _CHECKS.get(group, 0) + 1
    prefix = f"recompile_opt/plan/{group}/{_CHECKS[group]}"
    store.set(f"{prefix}/{rank}", mine)
    keys = [f"{prefix}/{r}" for r in range(size)]
    store.wait(keys, WAIT)
    return [store.get(k).decode() for k in keys]
