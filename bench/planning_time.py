"""How long our planning takes against plain ``torch.compile``'s whole cold compile of the same model.

Usage::

    python bench/planning_time.py                      # GPT, Llama, nn.TransformerEncoder; 3 rounds (~40 min)
    python bench/planning_time.py --models encoder --repeats 1

Each setting runs in a fresh process with an empty Inductor cache and an empty plan cache (a new
``TORCHINDUCTOR_CACHE_DIR``: both live there), one compile thread, one intra-op thread, one at a time.
The process compiles the model (``recompile_opt.models.demo_gpt`` / ``demo_llama`` / ``demo_encoder``)
and runs one training step; the compile time is that first step's wall time less a later step's.
Planning is our partitioner's own wall time summed over the model's graphs (``plan.solver["plan_s"]``:
cost model, least-peak search, walks of Inductor's code, partition). Settings: plain ``torch.compile``
(Inductor's own partitioner), ours at ``memory_budget`` 0.0, 0.5 and a byte budget (about half of
what save-all keeps), and 0.5 in a second process after one at 0.0 has run with the same cache
directory (the least-peak search's simulated and walked peaks are then on disk). The table gives
medians over the rounds and the ratios the targets are set in: planning / plain compile (target at
most 0.25) and our whole compile at 0.0 / plain compile (at most 1.25).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

MODELS = ("gpt", "llama", "encoder")
# a byte budget per model: about half of what save-all keeps (44.2, 47.1 and 8.3 MiB)
BYTE_BUDGET = {"gpt": "24MiB", "llama": "24MiB", "encoder": "4MiB"}
SETTINGS = ("plain", "0.0", "0.5", "bytes", "0.5-after-0.0")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", default=",".join(MODELS))
    p.add_argument("--settings", default=",".join(SETTINGS))
    p.add_argument("--repeats", type=int, default=3, help="fresh processes per setting")
    p.add_argument("--worker", nargs=2, metavar=("MODEL", "SETTING"), help=argparse.SUPPRESS)
    return p.parse_args(argv)


def _options(model: str, setting: str) -> dict | None:
    if setting == "plain":
        return None
    if setting == "bytes":
        return {"memory_budget": BYTE_BUDGET[model]}
    return {"memory_budget": float(setting.split("-")[0])}


def worker(model_name: str, setting: str) -> dict:
    """One cold compile, in this (fresh) process."""
    import torch

    import recompile_opt
    from recompile_opt import _torch_internals as ti
    from recompile_opt import models

    torch.set_num_threads(1)
    model, inputs = getattr(models, f"demo_{model_name}")()
    options = _options(model_name, setting)
    compiled = (
        torch.compile(model)
        if options is None
        else torch.compile(model, backend="recompile_opt", options=options)
    )

    def step():
        model.zero_grad(set_to_none=True)
        compiled(*inputs).backward()

    with ti.cpp_build_timer() as builds:
        start = time.perf_counter()
        step()
        first = time.perf_counter() - start
    start = time.perf_counter()
    step()
    again = time.perf_counter() - start
    plans = recompile_opt.last_plans() if options is not None else []
    return {
        "model": model_name,
        "setting": setting,
        "compile_s": first - again,
        "plan_s": sum(p.solver.get("plan_s", 0.0) for p in plans),
        "cpp_s": builds["s"],
        "graphs": len(plans),
    }


def run_one(model: str, setting: str) -> dict:
    with tempfile.TemporaryDirectory(prefix="planning_time_") as cache:
        env = {
            **os.environ,
            "TORCHINDUCTOR_CACHE_DIR": cache,
            "TORCHINDUCTOR_COMPILE_THREADS": "1",
            "OMP_NUM_THREADS": "1",
        }
        if setting.endswith("-after-0.0"):  # a process at 0.0 first, in the same cache directory
            subprocess.run(
                [sys.executable, __file__, "--worker", model, "0.0"],
                env=env,
                capture_output=True,
                text=True,
                check=True,
            )
        out = subprocess.run(
            [sys.executable, __file__, "--worker", model, setting],
            env=env,
            capture_output=True,
            text=True,
            check=True,
        )
    return json.loads(out.stdout.strip().splitlines()[-1])


def table(rows: list[dict], models: list[str], settings: list[str]) -> str:
    def med(model, setting, key):
        values = [r[key] for r in rows if r["model"] == model and r["setting"] == setting]
        return statistics.median(values) if values else float("nan")

    head = ["model", "plain compile s"]
    for s in settings[1:]:
        head += [f"ours {s} compile s", f"planning {s} s (x plain)"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for m in models:
        plain = med(m, "plain", "compile_s")
        cells = [m, f"{plain:.1f}"]
        for s in settings[1:]:
            total, plan = med(m, s, "compile_s"), med(m, s, "plan_s")
            label = BYTE_BUDGET[m] if s == "bytes" else s
            cells += [f"{total:.1f} ({total / plain:.2f}x)", f"{plan:.2f} ({plan / plain:.2f}x) [{label}]"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.worker:
        print(json.dumps(worker(*args.worker)))
        return
    models, settings = args.models.split(","), args.settings.split(",")
    if settings[0] != "plain":
        settings = ["plain", *settings]
    rows = []
    for round_ in range(args.repeats):
        for m in models:
            for s in settings:
                rows.append(run_one(m, s))
                r = rows[-1]
                print(
                    f"round {round_ + 1}: {m:8s} {s:6s} compile {r['compile_s']:6.1f} s, planning "
                    f"{r['plan_s']:5.2f} s, C++ builds {r['cpp_s']:5.1f} s",
                    file=sys.stderr,
                    flush=True,
                )
    from recompile_opt.provenance import header_line

    print(header_line() + "\n")
    print(
        f"`python bench/planning_time.py --models {args.models} --repeats {args.repeats}` "
        f"(medians of {args.repeats} fresh processes, cold caches; 'x plain': over plain torch.compile's "
        "cold compile)\n"
    )
    print(table(rows, models, settings))


if __name__ == "__main__":
    main()
