"""Per-kernel time of one compiled training step of the benchmark's 2-layer model, one thread.

Usage::

    python bench/kernel_profile.py --model gpt                 # plain torch.compile
    python bench/kernel_profile.py --model gpt --budget 0.0    # recompile_opt at memory_budget=0.0

Prints the total self time per step and the costliest ops and Inductor kernels (Inductor's
``cpp.enable_kernel_profile`` names each C++ kernel), averaged over 5 profiled steps after 3 warm-up
steps. Why: the planner's recompute estimates come from a roofline; set against this, a plan's extra
kernels show what recomputation really costs (e.g. a recomputed softmax against its traffic estimate).
"""

from __future__ import annotations

import argparse

STEPS = 5


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", choices=("gpt", "llama"), default="gpt")
    p.add_argument(
        "--budget", type=float, default=None, help="recompile_opt's memory_budget (else plain torch.compile)"
    )
    p.add_argument("--top", type=int, default=30)
    args = p.parse_args(argv)

    import torch
    import torch._inductor.config as inductor_config
    from torch.profiler import ProfilerActivity, profile

    from recompile_opt import models

    torch.set_num_threads(1)
    inductor_config.cpp.enable_kernel_profile = True
    model, inputs = (models.demo_gpt if args.model == "gpt" else models.demo_llama)()
    compiled = (
        torch.compile(model)
        if args.budget is None
        else torch.compile(model, backend="recompile_opt", options={"memory_budget": args.budget})
    )

    def step():
        model.zero_grad(set_to_none=True)
        compiled(*inputs).backward()

    for _ in range(3):
        step()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(STEPS):
            step()
    rows = sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)
    total = sum(e.self_cpu_time_total for e in rows) / STEPS / 1e3
    what = "torch.compile" if args.budget is None else f"recompile_opt memory_budget={args.budget}"
    print(f"{args.model}, {what}: {total:.1f} ms self time per step ({STEPS} steps)")
    print(f"{'ms/step':>8} {'calls':>5}  op or kernel")
    for e in rows[: args.top]:
        print(f"{e.self_cpu_time_total / STEPS / 1e3:8.2f} {e.count // STEPS:5d}  {e.key[:100]}")


if __name__ == "__main__":
    main()
