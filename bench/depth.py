"""Deep stacks: a small-width GPT of 12, 24, 48 and 96 layers planned with identical blocks solved as groups
(``recompile_opt.planner.blocks``) and in full, at the same byte budget.

Usage::

    python bench/depth.py                          # 12, 24, 48, 96 layers: markdown tables
    python bench/depth.py --layers 12,24 --json    # JSON list of rows
    python bench/depth.py --problem-dir /tmp/depth # keep the captured problems (capture is the slow part)
    python bench/depth.py --md depth.md            # also write the tables, under a provenance line

Each depth is captured once on the CPU (``recompile_opt.plan`` with ``policy="save-all"``: Dynamo,
AOTAutograd, Inductor's joint passes and our partition run, no step is computed and no ILP is solved)
and the captured :class:`~recompile_opt.planner.problem.Problem` is then planned twice with
:func:`recompile_opt.planner.search.make_plan`, the function the partitioner calls:

* ``reuse``: as shipped — ``reduce_blocks`` finds the identical blocks and solves one template per group
  of blocks;
* ``full``: ``search.reduce_blocks`` patched to return None, so the whole graph is one ILP.

Both see one int byte budget: ``least + fraction * (save_all - least)`` (``least`` from the reduced
min-memory solve, an upper bound of the true least, so the budget is feasible for both). An int budget
runs one solve; a float budget would run the 0.0 ladder (``least_peak._least_peak``) on top.

Quality is the ILP's own objective, estimated recompute time plus the write and read of each kept
tensor, and ``plan.recompute_s`` alone. A full solve that stops at the time limit reports a plan
but no gap (PuLP does not pass CBC's bound on), so CBC's log is read here for its lower bound:
"vs bound" is the reuse plan's objective over the full problem's proven lower bound, i.e. how far it
can at most be from the true optimum. With ``mip_gap`` 0.01 (the default option) "optimal" means
proven within 1%.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import pickle
import re
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

import torch  # noqa: E402

import recompile_opt  # noqa: E402
from recompile_opt import planning  # noqa: E402
from recompile_opt.models import GPT, GPTConfig, example_batch  # noqa: E402
from recompile_opt.options import parse_options  # noqa: E402
from recompile_opt.planner import ilp, search  # noqa: E402
from recompile_opt.planner.problem import Problem  # noqa: E402
from recompile_opt.provenance import header_line  # noqa: E402

LAYERS = (12, 24, 48, 96)
WIDTH = dict(n_head=4, n_embd=64, block_size=64, vocab_size=128)  # small width: depth is the point
BATCH = 2
QUALITY = 0.01  # the reuse plan must be within 1% of the full solve


def gpt(n_layer: int):
    cfg = GPTConfig(n_layer=n_layer, **WIDTH)
    torch.manual_seed(0)
    return GPT(cfg), example_batch(cfg, BATCH)


@contextlib.contextmanager
def grab_problems():
    """Record the Problem every graph's partitioner builds (``planning.make_plan`` is the hook)."""
    problems: list[Problem] = []
    original = planning.make_plan

    def recording(problem, options, **kw):
        problems.append(problem)
        return original(problem, options, **kw)

    planning.make_plan = recording
    try:
        yield problems
    finally:
        planning.make_plan = original


def capture(n_layer: int, problem_dir: Path | None = None) -> tuple[Problem, float]:
    """The joint-graph problem of an ``n_layer`` GPT and the seconds its capture took."""
    cached = problem_dir / f"gpt{n_layer}.pkl" if problem_dir else None
    if cached and cached.exists():
        with cached.open("rb") as f:
            return pickle.load(f)
    model, inputs = gpt(n_layer)
    torch._dynamo.reset()
    start = time.perf_counter()
    with grab_problems() as problems:
        recompile_opt.plan(model, inputs, policy="save-all")
    result = (problems[-1], time.perf_counter() - start)
    if cached:
        cached.parent.mkdir(parents=True, exist_ok=True)
        with cached.open("wb") as f:
            pickle.dump(result, f)
    return result


@contextlib.contextmanager
def cbc_log():
    """Send every CBC run's log to a file; yields a function returning the last run's lower bound."""
    path = Path(tempfile.mkstemp(prefix="depth_cbc_", suffix=".log")[1])
    original = ilp._command

    def logging_command(*args, **kw):
        cmd = original(*args, **kw)
        cmd.optionsDict["logPath"] = str(path)
        return cmd

    def bound() -> float | None:
        text = path.read_text() if path.exists() else ""
        found = re.findall(r"Lower bound:\s+(-?[\d.eE+]+)", text) or re.findall(
            r"best possible (-?[\d.eE+]+)", text
        )
        return float(found[-1]) if found else None

    ilp._command = logging_command
    try:
        yield bound
    finally:
        ilp._command = original
        path.unlink(missing_ok=True)


@contextlib.contextmanager
def count_solves():
    """Every ILP solve a plan makes (the reduced solve may be repeated with a tightened budget, or
    followed by a full one): yields the list of their times."""
    times: list[float] = []
    original = ilp.solve

    def timed(*args, **kw):
        sol = original(*args, **kw)
        times.append(sol.solve_s)
        return sol

    ilp.solve = timed
    try:
        yield times
    finally:
        ilp.solve = original


@contextlib.contextmanager
def block_reuse(enabled: bool):
    original = search.reduce_blocks
    if not enabled:
        search.reduce_blocks = lambda problem: None
    try:
        yield
    finally:
        search.reduce_blocks = original


def objective_s(problem: Problem, plan) -> float:
    """The ILP's objective for a plan: recompute time plus the save (write + read) time of kept storages."""
    storages = {problem.values[e.name].storage for e in plan.saved if e.name in problem.values} - {""}
    return plan.recompute_s + sum(problem.save_s.get(s, 0.0) for s in storages)


def solve(problem: Problem, budget: int, *, reuse: bool, time_limit_s: float, mip_gap: float) -> dict:
    options = parse_options(
        {"memory_budget": budget, "time_limit_s": time_limit_s, "mip_gap": mip_gap, "compiler": "eager"}
    )
    with block_reuse(reuse), cbc_log() as bound, count_solves() as solves:
        start = time.perf_counter()
        plan = search.make_plan(problem, options)
        wall = time.perf_counter() - start
        lower = bound()
    s = plan.solver
    return {
        "plan_s": round(wall, 3),
        "ilp_s": round(sum(solves), 3),
        "n_solves": len(solves),
        "status": s["status"],
        "gap": s["gap"],
        "n_vars": s["n_vars"],
        "n_constraints": s["n_constraints"],
        "reused": any("identical blocks solved as" in n for n in plan.notes),
        "recompute_us": plan.recompute_s * 1e6,
        "objective_us": objective_s(problem, plan) * 1e6,
        "saved_bytes": plan.saved_bytes,
        "cbc_lower_bound_us": lower,
        "notes": plan.notes,
    }


def reduced_size(problem: Problem) -> tuple[int | None, int | None]:
    """Values of the reduced problem, and of those the ones with a cost (not zero-byte inputs)."""
    reduction = search.reduce_blocks(problem)
    if reduction is None:
        return None, None
    values = reduction.reduced.values.values()
    costly = [v for v in values if v.can_recompute or reduction.reduced.storage_bytes.get(v.storage, 0) > 0]
    return len(reduction.reduced.values), len(costly)


def row(
    n_layer: int, *, fraction: float, time_limit_s: float, mip_gap: float, problem_dir: Path | None
) -> dict:
    problem, capture_s = capture(n_layer, problem_dir)
    ends = search.make_plan(problem, parse_options({"memory_budget": 1.0, "compiler": "eager"}))
    budget = int(ends.min_bytes + fraction * (ends.baseline_bytes - ends.min_bytes))
    reduced, reduced_costly = reduced_size(problem)
    out = {
        "layers": n_layer,
        "values": len(problem.values),
        "reduced_values": reduced,
        "reduced_costly_values": reduced_costly,
        "capture_s": round(capture_s, 1),
        "least_bytes": ends.min_bytes,
        "save_all_bytes": ends.baseline_bytes,
        "fraction": fraction,
        "budget_bytes": budget,
    }
    for name, reuse in (("reuse", True), ("full", False)):
        out[name] = solve(problem, budget, reuse=reuse, time_limit_s=time_limit_s, mip_gap=mip_gap)
        out[name]["total_s"] = round(capture_s + out[name]["plan_s"], 1)
    out.update(quality(out["reuse"], out["full"], mip_gap))
    return out


def quality(reuse: dict, full: dict, mip_gap: float) -> dict:
    """Reuse against the full solve: its plan, and its proven lower bound where CBC gave one."""
    rec = reuse["recompute_us"] / full["recompute_us"] - 1 if full["recompute_us"] else 0.0
    obj = reuse["objective_us"] / full["objective_us"] - 1
    lower = full["cbc_lower_bound_us"]
    vs_bound = reuse["objective_us"] / lower - 1 if lower else None
    if full["status"] == "optimal":
        verdict = "ok" if rec <= QUALITY else "WORSE"
        basis = f"full optimal (within {mip_gap:.0%})"
    elif vs_bound is not None:
        verdict = "ok" if vs_bound <= QUALITY else ("WORSE" if obj > QUALITY else "unproven")
        basis = "full hit the time limit: against its lower bound"
    else:
        verdict, basis = "unknown", f"full {full['status']}, no bound"
    return {
        "recompute_vs_full": rec,
        "objective_vs_full": obj,
        "objective_vs_full_bound": vs_bound,
        "within_1pct": verdict,
        "quality_basis": basis,
    }


def _pct(x: float | None) -> str:
    return "—" if x is None else f"{x:+.2%}"


def _status(r: dict) -> str:
    if r["status"] == "optimal":
        return f"optimal ≤{r['gap']:.0%}" if r["gap"] else "optimal"
    if r["status"].startswith("error"):  # no solution within the time limit: the greedy fallback
        return r["status"].removeprefix("error: ") + " → greedy plan"
    return r["status"] + ("" if r["gap"] is None else f" gap {r['gap']:.2%}")


def markdown(rows: list[dict]) -> str:
    head = (
        "| layers | values | reduced (costly) | capture s | budget | reuse ILP s (solves) / plan s "
        "| reuse status | reuse vars | full ILP s (solves) / plan s | full status | full vars "
        "| total s reuse / full |"
    )
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in rows:
        u, f = r["reuse"], r["full"]
        lines.append(
            f"| {r['layers']} | {r['values']} | {r['reduced_values']} ({r['reduced_costly_values']}) "
            f"| {r['capture_s']:.0f} | {r['budget_bytes'] / 2**20:.2f} MiB ({r['fraction']:g}) "
            f"| {u['ilp_s']:.1f} ({u['n_solves']}) / {u['plan_s']:.1f} | {_status(u)} | {u['n_vars']} "
            f"| {f['ilp_s']:.1f} ({f['n_solves']}) / {f['plan_s']:.1f} | {_status(f)} | {f['n_vars']} "
            f"| {u['total_s']:.0f} / {f['total_s']:.0f} |"
        )
    head2 = (
        "| layers | reuse recompute µs | full recompute µs | recompute vs full | reuse objective µs "
        "| full objective µs | objective vs full | full lower bound µs | objective vs bound "
        "| reuse kept MiB | full kept MiB | within 1% |"
    )
    lines += ["", head2, "|" + "---|" * (head2.count("|") - 1)]
    for r in rows:
        u, f = r["reuse"], r["full"]
        bound = f["cbc_lower_bound_us"]
        lines.append(
            f"| {r['layers']} | {u['recompute_us']:.1f} | {f['recompute_us']:.1f} "
            f"| {_pct(r['recompute_vs_full'])} | {u['objective_us']:.1f} | {f['objective_us']:.1f} "
            f"| {_pct(r['objective_vs_full'])} | {'—' if bound is None else f'{bound:.1f}'} "
            f"| {_pct(r['objective_vs_full_bound'])} | {u['saved_bytes'] / 2**20:.3f} "
            f"| {f['saved_bytes'] / 2**20:.3f} | {r['within_1pct']} ({r['quality_basis']}) |"
        )
    return "\n".join(lines)


def markdown_document(rows: list[dict]) -> str:
    """What ``--md`` writes: the provenance line, the model and settings, then :func:`markdown`. The
    capture and solve seconds depend on the machine's load (the provenance line gives it)."""
    width = ", ".join(f"{k}={v}" for k, v in WIDTH.items())
    fractions = sorted({r["fraction"] for r in rows})
    return (
        f"{header_line()}\n\nGPT ({width}, batch {BATCH}), one int byte budget for both solves "
        f"(fraction {', '.join(f'{f:g}' for f in fractions)} of the range), HiGHS\n\n{markdown(rows)}\n"
    )


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", default=",".join(map(str, LAYERS)), help="comma-separated depths")
    ap.add_argument(
        "--fraction",
        type=float,
        default=0.3,
        help="budget = least + fraction * (save-all - least), as an int for both solves",
    )
    ap.add_argument("--time-limit", type=float, default=60.0, help="solver time limit per solve (s)")
    ap.add_argument("--mip-gap", type=float, default=0.01, help="relative gap at which a solve stops")
    ap.add_argument("--problem-dir", type=Path, help="cache captured problems here (pickles)")
    ap.add_argument("--json", action="store_true", help="print JSON rows instead of markdown")
    ap.add_argument(
        "--md",
        metavar="FILE",
        help="also write the markdown tables here, opening with "
        "recompile_opt.provenance.header_line() (versions, machine, load, date)",
    )
    args = ap.parse_args(argv)
    rows = []
    for n in (int(x) for x in args.layers.split(",")):
        rows.append(
            row(
                n,
                fraction=args.fraction,
                time_limit_s=args.time_limit,
                mip_gap=args.mip_gap,
                problem_dir=args.problem_dir,
            )
        )
        print(f"# {n} layers done: {rows[-1]['within_1pct']}", file=sys.stderr, flush=True)
    print(json.dumps(rows, indent=2) if args.json else markdown(rows))
    if args.md:
        Path(args.md).write_text(markdown_document(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
