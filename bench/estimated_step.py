"""The cost model's estimated step of the GPU check's GPT, planned on the meta device (no GPU needed), to
hold against the step docs/gpu.md measured on the H200.

The performance GPT of ``bench/gpu_check.py`` (vocabulary 50304, h=1024, 8 layers, s=2048, b=8, SDPA) in
bf16 (the measured run's matmuls and activations are bf16 under autocast; its fp32 parameters are not
what the step's traffic is made of), planned with no budget and at ``memory_budget=0.0`` on each
roofline: the generic CUDA constants and the H200's (``options.CUDA_DEVICES``). Estimated: the plans'
``step_s + recompute_s``.

``--policies``: on the H200's roofline only, the estimated step, its recompute and the predicted peak of
the plans with no budget, the hand policies (``full``: every block checkpointed, as compile with
per-block checkpointing; ``megatron-selective``), the least-peak plan with and without chunks, and
``peak_memory`` at the ``full`` plan's predicted peak with and without chunks (the GPU check's
``ours-peak`` asks for compile-with-checkpoint's measured peak).

Usage::

    python bench/estimated_step.py [--policies]
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

import recompile_opt
from recompile_opt.options import DEFAULT_ROOFLINE, cuda_device_roofline
from recompile_opt.provenance import header_line

sys.path.insert(0, str(Path(__file__).parent))
from gpu.models import perf_gpt  # noqa: E402

ROOFLINES = {
    "generic CUDA": {k: DEFAULT_ROOFLINE["cuda"][k] for k in ("flops_per_s", "bytes_per_s")},
    "NVIDIA H200": cuda_device_roofline("NVIDIA H200"),
}
BUDGETS = {"no budget": None, "0.0": 0.0}
POLICIES = {
    "no budget": {},
    "policy full": {"policy": "full"},
    "policy megatron-selective": {"policy": "megatron-selective"},
    "0.0": {"memory_budget": 0.0},
    "0.0, chunks=False": {"memory_budget": 0.0, "chunks": False},
}


def planned(roofline: dict, **options) -> list:
    """The GPT's plans on the meta device in bf16 under ``options``."""
    model, batch = perf_gpt(device="cpu", tiny=False)
    model = model.to(device="meta", dtype=torch.bfloat16)
    batch = tuple(t.to("meta") for t in batch)
    plans = recompile_opt.plan(model, batch, roofline=roofline, **options)
    return plans if isinstance(plans, list) else [plans]


def estimated_ms(roofline: dict, budget) -> float:
    return sum(p.step_s + p.recompute_s for p in planned(roofline, memory_budget=budget)) * 1e3


# planned under a peak_memory limit at the ``policy full`` plan's predicted peak
AT_FULLS_PEAK = {
    "peak_memory = full's peak": {},
    "peak_memory = full's peak, chunks=False": {"chunks": False},
}


def policies() -> None:
    print(header_line())
    print()
    print("| plan (H200 roofline) | estimated step ms | of it recompute ms | predicted peak MiB |")
    print("|---|---|---|---|")
    peaks = {name: _policy_row(name, options) for name, options in POLICIES.items()}
    for name, options in AT_FULLS_PEAK.items():
        _policy_row(name, {**options, "peak_memory": peaks["policy full"]})


def _policy_row(name: str, options: dict) -> int:
    """Prints the row of the plans made under ``options``; returns their predicted peak."""
    plans = planned(ROOFLINES["NVIDIA H200"], **options)
    step = sum(p.step_s + p.recompute_s for p in plans) * 1e3
    recompute = sum(p.recompute_s for p in plans) * 1e3
    peak = max(p.predicted_peak_bytes for p in plans)
    print(f"| {name} | {step:.1f} | {recompute:.1f} | {peak / 2**20:.1f} |", flush=True)
    return peak


def main() -> None:
    rows = {name: {b: estimated_ms(r, v) for b, v in BUDGETS.items()} for name, r in ROOFLINES.items()}
    print(header_line())
    print()
    print("| roofline | " + " | ".join(f"estimated step ms, {b}" for b in BUDGETS) + " |")
    print("|---|" + "---|" * len(BUDGETS))
    for name, ms in rows.items():
        print(f"| {name} | " + " | ".join(f"{ms[b]:.1f}" for b in BUDGETS) + " |")


if __name__ == "__main__":
    policies() if "--policies" in sys.argv[1:] else main()
