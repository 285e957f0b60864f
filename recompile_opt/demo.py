"""``recompile-opt demo``: plan and train a small GPT on the CPU next to plain ``torch.compile``.

Prints one row per variant with measured figures: activation bytes kept for backward
(saved_tensors_hooks, storages deduplicated, parameters excluded), peak memory of a training step above
its baseline (profiler allocation records), median step time (forward + backward + SGD) and the first
call's time (a compile, our planning included), then the plan that compile made. Why from the compile,
not from a ``recompile_opt.plan`` call before it: that planning left its walked peaks and solves on
disk for the compile to read, and the first call's time understated a user's. Both variants run in
this one process; ``bench/compare.py`` is the careful comparison (fresh process per strategy,
interleaved repeats).
"""

from __future__ import annotations

import copy
import os
import statistics
import time

import torch

from recompile_opt.costs.measure import peak_memory, saved_report, step_time
from recompile_opt.models import demo_gpt
from recompile_opt.plan import fmt_bytes


def _measure(name: str, model: torch.nn.Module, compiled, inputs, steps: int) -> dict:
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)

    def step():
        opt.zero_grad(set_to_none=True)
        compiled(*inputs).backward()
        opt.step()

    t0 = time.perf_counter()
    step()  # the first call compiles
    compile_s = time.perf_counter() - t0
    opt.zero_grad(set_to_none=True)
    report, loss = saved_report(lambda: compiled(*inputs), exclude=[model])
    loss.backward()
    del loss
    opt.zero_grad(set_to_none=True)
    peak = peak_memory(lambda: compiled(*inputs).backward())
    opt.zero_grad(set_to_none=True)
    times = step_time(step, steps=steps, warmup=1)
    return {
        "name": name,
        "saved": report.total_bytes,
        "peak": peak,
        "step_s": statistics.median(times),
        "compile_s": compile_s,
    }


def run_demo(*, budget=0.0, steps: int = 6, compiler: str = "inductor") -> list[dict]:
    import recompile_opt

    os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")
    model, inputs = demo_gpt()
    print(f"model: 2-layer GPT, h=256, s=256, b=4, fp32; budget={budget!r}; compiler={compiler}\n")
    rows = []
    for name, backend, options in (
        ("torch.compile (inductor)", "inductor", None),
        (f"recompile_opt budget={budget}", "recompile_opt", {"memory_budget": budget, "compiler": compiler}),
    ):
        torch._dynamo.reset()
        before = len(recompile_opt.last_plans())
        m = copy.deepcopy(model)
        compiled = (
            torch.compile(m, backend=backend, options=options)
            if options
            else torch.compile(m, backend=backend)
        )
        rows.append(_measure(name, m, compiled, inputs, steps))
    for plan in recompile_opt.last_plans()[before:]:  # those ours (the last variant) made at its first call
        print(plan.summary() + "\n")
    print(f"{'variant':<34} {'kept for bwd':>12} {'step peak':>11} {'step (median)':>14} {'compile':>8}")
    for r in rows:
        print(
            f"{r['name']:<34} {fmt_bytes(r['saved']):>12} {fmt_bytes(r['peak']):>11} "
            f"{r['step_s'] * 1e3:>11.1f} ms {r['compile_s']:>7.1f}s"
        )
    print(
        f"\nmeasured on this machine; step time is the median of {steps} steps; compile: the first call's "
        "time, our planning included (cold where Inductor's cache held none of it)"
    )
    return rows
