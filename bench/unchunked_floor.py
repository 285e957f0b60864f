"""The least peak of an unchunked plan of the GPU check's GPT, planned on the CPU under bf16 autocast:
what ``peak_memory`` can reach without chunks, against compile with per-block checkpointing's
measured 2320.6 MiB on the H200 (docs/gpu.md).

The performance GPT of ``bench/gpu_check.py`` (vocabulary 50304, h=1024, 8 layers, s=2048, b=8, SDPA,
fp32 parameters), planned at ``memory_budget=0.0`` with ``chunks=False``; nothing is compiled or run
(the plan's peak is walked in the code Inductor generates for the CPU). Prints the plan's kept bytes,
predicted peak, where it lies, its recompute and the search's note.

Usage::

    python bench/unchunked_floor.py
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch

import recompile_opt
from recompile_opt.plan import fmt_bytes, fmt_flops
from recompile_opt.provenance import header_line

sys.path.insert(0, str(Path(__file__).parent))
from gpu.models import perf_gpt  # noqa: E402


def main() -> None:
    model, batch = perf_gpt(device="cpu", tiny=False)
    start = time.perf_counter()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        plan = recompile_opt.plan(model, batch, memory_budget=0.0, chunks=False)
    seconds = time.perf_counter() - start
    bd = plan.walked_breakdown or plan.peak_breakdown
    print(header_line())
    print()
    print("| kept | predicted peak | at the peak | recompute | planning s |")
    print("|---|---|---|---|---|")
    where = f"{bd['phase']} kernel {bd['kernel'] + 1}/{bd['kernels']}: " + ", ".join(
        f"{kind} {fmt_bytes(n)}" for kind, n in bd["bytes"].items() if n > 1 << 20
    )
    print(
        f"| {fmt_bytes(plan.saved_bytes)} | {fmt_bytes(plan.predicted_peak_bytes)} | {where} | "
        f"{fmt_flops(plan.recompute_flops)} | {seconds:.1f} |"
    )
    print()
    print(next(n for n in plan.notes if n.startswith("memory_budget 0.0")))


if __name__ == "__main__":
    main()
