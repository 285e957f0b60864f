"""The demo GPT's plans in the CUDA caching allocator's blocks: the walked peak of the code Inductor
generates for each (the bytes its requests hold) against the allocator model's count of blocks for
that step (``recompile_opt.costs.cuda_allocator``), the figure a plan on CUDA predicts.

On a GPU (``--device cuda``) the model runs as it does for users, and each step is measured too, in
steady state (the allocator's cache emptied, two steps, the third measured): ``max_memory_allocated``
and the allocator's ``requested_bytes``. On the CPU the plans' graphs are taken for CUDA graphs (the
code is the CPU's, the allocator CUDA's): what the model makes of this code, measured nowhere.

Usage::

    python bench/allocator_blocks.py [--device cpu|cuda] [--options 0.0,0.5,bytes,full]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

import recompile_opt
from recompile_opt.costs import allocated
from recompile_opt.models import demo_gpt
from recompile_opt.provenance import header_line

sys.path.insert(0, str(Path(__file__).parent))
from gpu.numerics import step_peaks  # noqa: E402

OPTIONS = {
    "0.0": {"memory_budget": 0.0},
    "0.5": {"memory_budget": 0.5},
    "bytes": {"memory_budget": "4MiB"},
    "full": {"policy": "full"},
}
MiB = 2**20


def row(name: str, device: str) -> list[str]:
    """One option's plan: walked, blocks, and on CUDA the measured step."""
    model, batch = demo_gpt()
    model, batch = model.to(device), tuple(t.to(device) for t in batch)
    torch._dynamo.reset()
    recompile_opt.reset_plans()
    step = torch.compile(model, backend="recompile_opt", options=OPTIONS[name])
    step(*batch).backward()
    plan = recompile_opt.last_plans()[-1]
    walked = plan.solver.get("walked_peak_bytes", plan.predicted_peak_bytes)
    cells = [name, f"{walked / MiB:.2f}", f"{plan.predicted_peak_bytes / MiB:.2f}"]
    cells.append(f"{(plan.predicted_peak_bytes - walked) / MiB:+.2f}")
    if device == "cuda":
        measured = step_peaks(model, step, batch, device=device, dtype="fp32")
        cells += [f"{measured['peak_bytes'] / MiB:.2f}", f"{measured['peak_requested_bytes'] / MiB:.2f}"]
    return cells


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    p.add_argument("--options", default=",".join(OPTIONS))
    args = p.parse_args()
    if args.device == "cpu":
        allocated.on_cuda = lambda gm: True  # this device's code, CUDA's allocator
    head = ["option", "walked requests MiB", "blocks MiB", "blocks - walked MiB"]
    head += ["measured MiB", "measured requests MiB"] if args.device == "cuda" else []
    rows = [row(name, args.device) for name in args.options.split(",")]
    print(header_line())
    print()
    print("| " + " | ".join(head) + " |")
    print("|" + "---|" * len(head))
    for cells in rows:
        print("| " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
