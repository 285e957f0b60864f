"""What Inductor's buffer pool costs at the step's peak and what it saves in time.

Usage::

    python bench/buffer_pool.py                          # demo GPT and Llama (~12 min cold on 2 cores)
    python bench/buffer_pool.py --models gpt --steps 20

Inductor's wrapper may hold a dead buffer for a later allocation of its size (``allow_buffer_reuse``,
decided against its own estimate of one graph's peak). Our least-peak plan (``memory_budget=0.0``)
compiles with the pool off (``planning.pools_dead_buffers``). Rows, each model in a fresh compile:
plain ``torch.compile`` with the pool on (Inductor's default) and off, and our least-peak plan
planned and compiled with the pool on (the behaviour before, forced here) and off. Columns: the
plan's predicted peak (walked in Inductor's code), the dead buffers the pool holds there (the walk's
``pooled``), the measured peak of one training step (allocator records, gradients ``None`` before
it), and the step's wall time (median of ``--steps`` after one warm-up). One compile thread.
Below the table, each of our plans' chunk choice (its trials give the unchunked plan's walked peak).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics

os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")


def _step(compiled, model, inputs):
    def run():
        model.zero_grad(set_to_none=True)
        compiled(*inputs).backward()

    return run


@contextlib.contextmanager
def _pool_forced(pooled: bool | None):
    """Our planning with Inductor's pool as Inductor's default (``pooled`` True) or off; None: ours."""
    from recompile_opt import compile_paths, planning

    if pooled is None:
        yield
        return
    saved = planning.pools_dead_buffers, compile_paths.pools_dead_buffers
    planning.pools_dead_buffers = compile_paths.pools_dead_buffers = lambda options: pooled
    try:
        yield
    finally:
        planning.pools_dead_buffers, compile_paths.pools_dead_buffers = saved


def _row(name: str, setting: str, build, steps: int) -> dict:
    import copy

    import torch
    import torch._inductor.config as inductor_config

    import recompile_opt
    from recompile_opt.costs.measure import peak_memory, step_time

    torch._dynamo.reset()
    recompile_opt.reset_plans()
    model, inputs = build()
    model = copy.deepcopy(model)
    predicted = pooled = None
    notes = []
    if setting.startswith("torch.compile"):
        with inductor_config.patch(allow_buffer_reuse=setting.endswith("pool on")):
            compiled = torch.compile(model)
            run = _step(compiled, model, inputs)
            run()
            peak = peak_memory(run)
            seconds = step_time(run, steps=steps)
    else:
        with _pool_forced(setting.endswith("pool on")):
            compiled = torch.compile(model, backend="recompile_opt", options={"memory_budget": 0.0})
            run = _step(compiled, model, inputs)
            run()
        plan = recompile_opt.last_plans()[-1]
        predicted, walked = plan.predicted_peak_bytes, plan.walked_breakdown
        pooled = walked.get("bytes", {}).get("pooled", 0) if walked else None
        notes = [n for n in plan.notes if n.startswith("chunks (auto)")]
        peak = peak_memory(run)
        seconds = step_time(run, steps=steps)
    return {
        "model": name,
        "setting": setting,
        "predicted": predicted,
        "pooled": pooled,
        "measured": peak,
        "step_ms": 1e3 * statistics.median(seconds),
        "notes": notes,
    }


def main() -> None:
    from recompile_opt import models
    from recompile_opt.plan import fmt_bytes
    from recompile_opt.provenance import header_line

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="gpt,llama", help="comma-separated: gpt, llama")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument(
        "--settings", default="", help="comma-separated indices into the four settings (default: all)"
    )
    args = parser.parse_args()
    builders = {"gpt": models.demo_gpt, "llama": models.demo_llama}
    settings = (
        "torch.compile, pool on",
        "torch.compile, pool off",
        "ours 0.0, pool on",
        "ours 0.0, pool off",
    )
    if args.settings:
        settings = [settings[int(i)] for i in args.settings.split(",")]
    rows = [_row(m, s, builders[m], args.steps) for m in args.models.split(",") for s in settings]
    print(header_line())
    print()
    print("| model | setting | predicted | pooled at the walked peak | measured | step ms |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        predicted, pooled = (fmt_bytes(r[k]) if r[k] is not None else "" for k in ("predicted", "pooled"))
        print(
            f"| {r['model']} | {r['setting']} | {predicted} | {pooled} | {fmt_bytes(r['measured'])} "
            f"| {r['step_ms']:.1f} |"
        )
    print()
    for r in rows:  # the chunk choice's trials: the unchunked plan's walked peak with the pool and without
        for n in r["notes"]:
            print(f"{r['model']}, {r['setting']}: {n}")


if __name__ == "__main__":
    main()
