"""HiGHS against CBC on the planner's real work: the least-bytes solve and the least-peak ladder
(``least_peak.PEAK_LADDER``: the solves behind a fractional budget's 0.0 end) of one joint graph.

Usage::

    python bench/solvers.py                       # 2-layer Llama, the benchmark's small size
    python bench/solvers.py --model gpt --solvers highs,cbc
    python bench/solvers.py --md solvers.md       # also write a markdown table, under a provenance line

The graph is captured once (``recompile_opt.plan`` with ``policy="save-all"``: no ILP, no step); each
solver then solves the same :class:`~recompile_opt.planner.problem.Problem` at the same levels, 1% gap, the
planner's settings. Prints the seconds per level and in all, and each level's recompute estimate, so
that equal plans (or equally good ones) can be seen next to the times. Solve seconds depend on the
machine's load (the header line of ``--md`` gives it); the recompute estimates do not.
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
from depth import grab_problems  # noqa: E402  (bench/depth.py: records each graph's Problem)

import recompile_opt  # noqa: E402
from recompile_opt import models  # noqa: E402
from recompile_opt.planner import ilp, least_peak, solving  # noqa: E402
from recompile_opt.provenance import header_line  # noqa: E402

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


def ladder(problem, solver: str) -> tuple[float, list[tuple[float, float, float, str]]]:
    """Seconds in all, and per level of the ladder: (level, seconds, estimated recompute s, status)."""
    kw = dict(solver=solver, time_limit_s=60, mip_gap=0.01)
    start = time.perf_counter()
    least = solving.least_bytes(problem, None, kw)
    baseline = problem.kept_bytes(*problem.needed_closure(set()))
    rows = []
    for f in least_peak.PEAK_LADDER:
        t = time.perf_counter()
        sol = ilp.solve(problem, budget=int(least + f * (baseline - least)), **kw)
        _, recomputed = problem.needed_closure(sol.recompute, sol.keep)
        rows.append((f, time.perf_counter() - t, problem.recompute_seconds(recomputed), sol.status))
    return time.perf_counter() - start, rows


def markdown(model: str, n_values: int, results: dict[str, tuple[float, list]]) -> str:
    """One table: per ladder level, each solver's seconds and the plan's estimated recompute; then the
    totals (the least-bytes solve and the ladder) and the statuses met. ``results``: solver -> the
    return of :func:`ladder`."""
    solvers = list(results)
    head = ["level"] + [f"{s} {what}" for s in solvers for what in ("s", "recompute ms (est.)")]
    lines = [
        f"{model}, 2 layers, h=256, s=256, b=4: {n_values} values; 1% MIP gap, 60 s limit per solve",
        "",
        "| " + " | ".join(head) + " |",
        "|" + "---|" * len(head),
    ]
    for i, (level, *_) in enumerate(results[solvers[0]][1]):
        cells = [f"{level:g}"]
        for s in solvers:
            _, secs, rec, _ = results[s][1][i]
            cells += [f"{secs:.2f}", f"{rec * 1e3:.2f}"]
        lines.append("| " + " | ".join(cells) + " |")
    total = ["**all** (least-bytes solve + ladder)"]
    for s in solvers:
        total += [f"**{results[s][0]:.2f}**", ""]
    lines.append("| " + " | ".join(total) + " |")
    lines.append("")
    lines += [f"{s}: status {', '.join(sorted({st for *_, st in results[s][1]}))}" for s in solvers]
    return "\n".join(lines)


def markdown_document(model: str, n_values: int, results: dict[str, tuple[float, list]]) -> str:
    """What ``--md`` writes: the provenance line, then :func:`markdown`."""
    return f"{header_line()}\n\n{markdown(model, n_values, results)}\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="llama", choices=["llama", "gpt"])
    ap.add_argument("--solvers", default="highs,cbc")
    ap.add_argument(
        "--md",
        metavar="FILE",
        help="also write a markdown table here, opening with "
        "recompile_opt.provenance.header_line() (versions, machine, load, date)",
    )
    args = ap.parse_args(argv)
    problem = capture(args.model)
    print(f"{args.model}: {len(problem.values)} values; levels {least_peak.PEAK_LADDER}")
    results = {}
    for solver in args.solvers.split(","):
        total, rows = results[solver] = ladder(problem, solver)
        secs = " ".join(f"{s:.2f}" for _, s, _, _ in rows)
        rec = " ".join(f"{r * 1e3:.2f}" for _, _, r, _ in rows)
        print(
            f"{solver:5s} {total:6.2f} s in all (least-bytes solve + ladder)\n"
            f"      s per level:            {secs}\n"
            f"      recompute ms per level: {rec}\n"
            f"      status: {sorted({st for *_, st in rows})}"
        )
    if args.md:
        Path(args.md).write_text(markdown_document(args.model, len(problem.values), results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
