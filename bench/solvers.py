"""HiGHS against CBC on the planner's real work: the least-bytes solve and the least-peak ladder
(``search.PEAK_LADDER``: the solves behind a fractional budget's 0.0 end) of one joint graph.

Usage::

    python bench/solvers.py                       # 2-layer Llama, the benchmark's small size
    python bench/solvers.py --model gpt --solvers highs,cbc

The graph is captured once (``recompile_opt.plan`` with ``policy="save-all"``: no ILP, no step); each
solver then solves the same :class:`~recompile_opt.planner.problem.Problem` at the same levels, 1% gap, the
planner's settings. Prints the seconds per level and in all, and each level's recompute estimate, so
that equal plans (or equally good ones) can be seen next to the times.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")
REPO = Path(__file__).resolve().parents[1]
for path in (REPO, REPO / "bench"):
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))

import torch  # noqa: E402

import recompile_opt  # noqa: E402
from depth import grab_problems  # noqa: E402  (bench/depth.py: records each graph's Problem)
from recompile_opt import models  # noqa: E402
from recompile_opt.planner import ilp, search  # noqa: E402

SMALL = dict(n_layer=2, n_head=4, n_embd=256, block_size=256, vocab_size=512)


def capture(model_name: str):
    cls, cfg = (models.Llama, models.LlamaConfig) if model_name == "llama" else (models.GPT, models.GPTConfig)
    torch.manual_seed(0)
    model = cls(cfg(**SMALL))
    g = torch.Generator().manual_seed(1)
    idx, tgt = (torch.randint(0, 512, (4, 256), generator=g) for _ in range(2))
    with grab_problems() as problems:
        recompile_opt.plan(model, (idx, tgt), policy="save-all")
    return problems[-1]


def ladder(problem, solver: str) -> tuple[float, list[tuple[float, float, str]]]:
    kw = dict(solver=solver, time_limit_s=60, mip_gap=0.01, peak=None)
    start = time.perf_counter()
    least = search._least_bytes(problem, None, kw)
    baseline = problem.kept_bytes(*problem.needed_closure(set()))
    rows = []
    for f in search.PEAK_LADDER:
        t = time.perf_counter()
        sol = ilp.solve(problem, budget=int(least + f * (baseline - least)), **kw)
        _, recomputed = problem.needed_closure(sol.recompute, sol.keep)
        rows.append((time.perf_counter() - t, problem.recompute_seconds(recomputed), sol.status))
    return time.perf_counter() - start, rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="llama", choices=["llama", "gpt"])
    ap.add_argument("--solvers", default="highs,cbc")
    args = ap.parse_args(argv)
    problem = capture(args.model)
    print(f"{args.model}: {len(problem.values)} values; levels {search.PEAK_LADDER}")
    for solver in args.solvers.split(","):
        total, rows = ladder(problem, solver)
        secs = " ".join(f"{s:.2f}" for s, _, _ in rows)
        rec = " ".join(f"{r * 1e3:.2f}" for _, r, _ in rows)
        print(f"{solver:5s} {total:6.2f} s in all (least-bytes solve + ladder)\n"
              f"      s per level:            {secs}\n"
              f"      recompute ms per level: {rec}\n"
              f"      status: {sorted({st for _, _, st in rows})}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
