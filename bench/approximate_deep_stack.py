"""Planning a deep stack with approximations offered: the ILP's size and the planning time of a 12-layer
GPT whose identical blocks are solved as a few groups (planner/blocks.py), each template's
approximation site standing for the same site in every block of its group.

A 12-layer GPT (h=32, s=16, b=2), ``approximate={"activations": 2}`` (2-bit GELU codes), at a byte budget
and at ``memory_budget=0.0``; nothing is run. Prints each plan's solver figures, the activations it
approximates, what it keeps and its predicted peak and recompute. Run it with a fresh
``TORCHINDUCTOR_CACHE_DIR``: the planner keeps its solves beside Inductor's cache, and a second run
recalls them.

Usage::

    TORCHINDUCTOR_CACHE_DIR=$(mktemp -d) python bench/approximate_deep_stack.py
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
    print(
        "| memory_budget | planning s | ILP variables | ILP constraints | approximated | kept "
        "| predicted peak | est. recompute ms |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for label, budget in BUDGETS.items():
        start = time.perf_counter()
        opts = dict(approximate={"activations": 2}, compiler="eager")
        plan = recompile_opt.plan(model, batch, memory_budget=budget, **opts)
        seconds = time.perf_counter() - start
        print(
            f"| {label} | {seconds:.1f} | {plan.solver.get('n_vars')} | {plan.solver.get('n_constraints')} | "
            f"{len(plan.approximated)} of {cfg.n_layer} | {fmt_bytes(plan.saved_bytes)} | "
            f"{fmt_bytes(plan.predicted_peak_bytes)} | {plan.recompute_s * 1e3:.3f} |"
        )


if __name__ == "__main__":
    main()
