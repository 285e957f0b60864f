"""Planning a deep stack with offload offered: the ILP's size and the planning time of a 12-layer GPT
whose identical blocks are solved as a few groups (planner/blocks.py) with their copy windows.

A 12-layer GPT (h=32, s=16, b=2), offload offered on the CPU (``offload_on_cpu``: the copies run host
to host, as the tests run them), at a byte budget and at ``memory_budget=0.0``; nothing is run. Prints
each plan's solver figures and what it offloads. Run it with a fresh ``TORCHINDUCTOR_CACHE_DIR``: the
planner keeps its solves beside Inductor's cache, and a second run recalls them.

Usage::

    TORCHINDUCTOR_CACHE_DIR=$(mktemp -d) python bench/offload_deep_stack.py
"""

from __future__ import annotations

import time

import torch

import recompile_opt
from recompile_opt import models
from recompile_opt.plan import fmt_bytes
from recompile_opt.provenance import header_line

BUDGETS = {"200 KiB": "200KiB", "0.0": 0.0}


def main() -> None:
    cfg = models.GPTConfig(n_layer=12, n_head=2, n_embd=32, block_size=16, vocab_size=64, dropout=0.0)
    torch.manual_seed(0)
    model, batch = models.GPT(cfg), models.example_batch(cfg, 2)
    print(header_line())
    print()
    print("| memory_budget | planning s | ILP variables | ILP constraints | offloaded | kept | groups |")
    print("|---|---|---|---|---|---|---|")
    for label, budget in BUDGETS.items():
        start = time.perf_counter()
        opts = dict(offload="1GB/s", offload_on_cpu=True, compiler="eager")
        plan = recompile_opt.plan(model, batch, memory_budget=budget, **opts)
        seconds = time.perf_counter() - start
        groups = next((n.split(" (")[0] for n in plan.notes if "identical blocks solved as" in n), "no note")
        print(
            f"| {label} | {seconds:.1f} | {plan.solver.get('n_vars')} | {plan.solver.get('n_constraints')} | "
            f"{len(plan.offloaded)} values, {fmt_bytes(plan.offload.get('bytes_to_host', 0))} | "
            f"{fmt_bytes(plan.saved_bytes)} | {groups} |"
        )


if __name__ == "__main__":
    main()
