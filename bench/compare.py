"""Compare activation save/recompute strategies on CPU, one fresh process per run.

Usage::

    python bench/compare.py                              # all strategies, default config
    python bench/compare.py --strategies eager,compile,ours-0.2 --repeats 3 --json out.json

Methodology
-----------
* **Fresh process per (strategy, round).**  Dynamo/Inductor keep global state
  (caches, config, compiled kernels) and the CPU allocator keeps freed memory,
  so each strategy runs in its own ``python bench/compare.py --worker NAME``
  process that prints one JSON line.  Every worker gets an empty
  ``TORCHINDUCTOR_CACHE_DIR`` with the FX-graph and AOTAutograd caches off
  (``TORCHINDUCTOR_FX_GRAPH_CACHE=0``, ``TORCHINDUCTOR_AUTOGRAD_CACHE=0``) and
  ``TORCHINDUCTOR_COMPILE_THREADS=1``, so the compile time is a *cold* compile.
* **One thread.**  Workers run ``torch.set_num_threads(--threads)``, 1 by
  default: on a small shared machine an OpenMP team stalls whenever another
  process holds one of its cores (steps 100x slower were seen), while
  single-threaded timings stay comparable.  The 1-minute load average at the
  start of timing is recorded and a row is flagged "busy machine" when it
  exceeds the core count.
* **Interleaved repeats.**  ``--repeats R`` runs R rounds; each round runs every
  strategy once, in a shuffled order (seeded by ``--order-seed``), so slow
  drifts of the machine (thermal, other load) spread over all strategies
  instead of biasing whichever ran last.
* **Same model, same data.**  Each worker builds the model under
  ``torch.manual_seed(0)`` and draws the batch from a fixed generator, so all
  processes start from identical weights.  The worker also keeps an untouched
  eager copy of the model and compares the first step's gradients with it
  (``max|dgrad|``).  The RNG is reseeded identically before every step; with
  ``--dropout > 0`` Inductor's ``fallback_random`` is turned on so compiled
  dropout draws the same masks as eager (``--native-rng`` turns that off, and
  then the gradient difference of compiled rows is not meaningful).
* **Figures per worker.**
  - *first step s*: wall time of the first forward+backward call, which
    includes Dynamo tracing, partitioning and Inductor compilation (cold).
  - *step ms*: per-step wall time of forward + backward + ``SGD.step()`` (with
    ``zero_grad(set_to_none=True)``), ``--warmup`` steps discarded, then
    ``--steps`` (>= 5) timed; the worker reports their median and min/max.
  - *saved MiB*: bytes packed for backward during one forward
    (``recompile_opt.measure.saved_report``), deduplicated by storage,
    excluding parameters, buffers and the input batch.
  - *peak MiB*: most live CPU bytes above the pre-step baseline during one
    forward+backward (no optimizer step) entered with grads ``None``, from the
    profiler's allocator records (``recompile_opt.measure.memory_profile``).
    It includes gradients and backward temporaries.
  - for ``ours-*`` rows, the plan's own predictions from
    ``recompile_opt.last_plans()[-1]`` (saved bytes, peak, recompute FLOPs)
    when the backend exposes them.
* **Aggregation.**  Across rounds the table shows the median of the per-process
  medians, with min–max over every timed step of every process; compile time
  as median with min–max over processes; memory figures are medians (they are
  deterministic, a spread is flagged in the notes).
A failing strategy (exception, crash or timeout) shows ``ERROR: ...`` in its
row and is not retried in later rounds; the run always finishes.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import random
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

MARKER = "@@COMPARE_RESULT@@ "
MiB = 1 << 20

# name -> how to build it: kind (eager | compile | ours), block checkpointing,
# functorch config overrides, backend options.
STRATEGIES: dict[str, dict] = {
    "eager": {"kind": "eager"},
    "eager-full-ckpt": {"kind": "eager", "ckpt": True},
    "compile": {"kind": "compile"},
    "compile-amb-0.5": {"kind": "compile", "functorch": {"activation_memory_budget": 0.5}},
    "compile-amb-0.2": {"kind": "compile", "functorch": {"activation_memory_budget": 0.2}},
    "compile-amb-0.05": {"kind": "compile", "functorch": {"activation_memory_budget": 0.05}},
    "compile-amb-ilp-0.2": {"kind": "compile", "needs": ["scipy"], "functorch": {
        "activation_memory_budget": 0.2, "activation_memory_budget_solver": "ilp"}},
    "compile-full-ckpt": {"kind": "compile", "ckpt": True},
    "ours-none": {"kind": "ours", "options": {}},
    "ours-0.5": {"kind": "ours", "options": {"memory_budget": 0.5}},
    "ours-0.2": {"kind": "ours", "options": {"memory_budget": 0.2}},
    "ours-0.0": {"kind": "ours", "options": {"memory_budget": 0.0}},
    "ours-full": {"kind": "ours", "options": {"policy": "full"}},
    "ours-megatron-selective": {"kind": "ours", "options": {"policy": "megatron-selective"}},
}

# flags forwarded verbatim from the driver to each worker
WORKER_FLAGS = ["model", "layers", "embd", "seq", "batch", "heads", "vocab", "dropout",
                "steps", "warmup", "threads"]


# --------------------------------------------------------------------------
# Worker: one strategy in this process
# --------------------------------------------------------------------------


def build_model(args):
    """Model and batch from ``recompile_opt.models``, weights drawn under seed 0."""
    import torch
    from recompile_opt import models

    if args.model == "gpt":
        config = models.GPTConfig(n_layer=args.layers, n_head=args.heads, n_embd=args.embd,
                                  block_size=args.seq, vocab_size=args.vocab, dropout=args.dropout)
        cls = models.GPT
    else:
        if args.dropout:
            raise ValueError("--dropout applies to --model gpt only (Llama has no dropout)")
        config = models.LlamaConfig(n_layer=args.layers, n_head=args.heads, n_embd=args.embd,
                                    block_size=args.seq, vocab_size=args.vocab)
        cls = models.Llama
    torch.manual_seed(0)
    model = cls(config)
    g = torch.Generator().manual_seed(1)
    idx = torch.randint(0, args.vocab, (args.batch, args.seq), generator=g)
    tgt = torch.randint(0, args.vocab, (args.batch, args.seq), generator=g)
    return model, idx, tgt


def checkpoint_blocks(model) -> None:
    """Wrap every module of ``model.blocks`` in non-reentrant activation checkpointing."""
    import torch.nn as nn
    from torch.utils.checkpoint import checkpoint

    class Checkpointed(nn.Module):
        def __init__(self, block):
            super().__init__()
            self.block = block

        def forward(self, *args):
            return checkpoint(self.block, *args, use_reentrant=False)

    for i, block in enumerate(model.blocks):
        model.blocks[i] = Checkpointed(block)


def prepare(spec: dict, model, args):
    """Apply the strategy: returns the callable ``fn(idx, tgt) -> loss``."""
    import torch

    if spec.get("ckpt"):
        checkpoint_blocks(model)
    for mod in spec.get("needs", []):
        __import__(mod)  # fail early and clearly, e.g. "No module named 'scipy'"
    for key, value in spec.get("functorch", {}).items():
        setattr(torch._functorch.config, key, value)
    if args.dropout and not args.native_rng:
        torch._inductor.config.fallback_random = True
    if spec["kind"] == "eager":
        return model
    if spec["kind"] == "compile":
        return torch.compile(model)
    import recompile_opt  # registers the backend

    return torch.compile(model, backend="recompile_opt", options=dict(spec["options"]))


def plan_figures() -> dict:
    """Predictions of the last plan made by our backend, when it exposes them."""
    import recompile_opt

    last_plans = getattr(recompile_opt, "last_plans", None)
    plans = last_plans() if callable(last_plans) else None
    if not plans:
        return {}
    plan = plans[-1]
    names = ("saved_bytes", "predicted_peak_bytes", "recompute_flops")
    return {f"plan_{n}": getattr(plan, n) for n in names if getattr(plan, n, None) is not None}


def graph_count() -> int:
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


def make_steps(model, fn, idx, tgt):
    """The closures the worker times and measures; RNG reseeded identically each step."""
    import torch

    opt = torch.optim.SGD(model.parameters(), lr=1e-3)

    def fwd_bwd():
        torch.manual_seed(1234)
        fn(idx, tgt).backward()

    def train_step():
        model.zero_grad(set_to_none=True)
        fwd_bwd()
        opt.step()

    return fwd_bwd, train_step


def grad_diff(model, ref) -> float:
    """Max abs difference between the grads of two identically-ordered models."""
    worst = 0.0
    for p, q in zip(model.parameters(), ref.parameters(), strict=True):
        if p.grad is None and q.grad is None:
            continue
        if p.grad is None or q.grad is None:
            return float("inf")
        worst = max(worst, (p.grad - q.grad).abs().max().item())
    return worst


def run_worker(name: str, args) -> dict:
    """Run one strategy; fill ``out`` stage by stage so a failure keeps partial figures."""
    out: dict = {"strategy": name}
    try:
        measure_strategy(name, args, out)
    except BaseException as exc:  # noqa: BLE001 -- report, never crash the driver
        traceback.print_exc(file=sys.stderr)
        out["error"] = f"{type(exc).__name__}: {exc}".strip()
    return out


def measure_strategy(name: str, args, out: dict) -> None:
    import copy
    import gc

    import torch
    from recompile_opt import measure

    if args.threads:
        torch.set_num_threads(args.threads)
    out.update(torch=torch.__version__, threads=torch.get_num_threads())
    model, idx, tgt = build_model(args)
    ref = copy.deepcopy(model)  # untouched eager copy for the gradient check
    fwd_bwd_ref, _ = make_steps(ref, ref, idx, tgt)
    fwd_bwd_ref()
    spec = STRATEGIES[name]
    fn = prepare(spec, model, args)
    fwd_bwd, train_step = make_steps(model, fn, idx, tgt)

    t0 = time.perf_counter()
    fwd_bwd()  # the cold call: trace + compile forward and backward
    out["first_step_s"] = time.perf_counter() - t0
    out["max_grad_diff"] = grad_diff(model, ref)
    graphs = out["graphs"] = graph_count()

    out["loadavg_1m"] = os.getloadavg()[0]  # other load skews CPU timings; flagged in notes
    times = measure.step_time(train_step, steps=args.steps, warmup=args.warmup)
    out.update(step_s=times, step_median_s=statistics.median(times))

    model.zero_grad(set_to_none=True)
    torch.manual_seed(1234)
    report, loss = measure.saved_report(lambda: fn(idx, tgt), exclude=[model, idx, tgt])
    loss.backward()
    del loss
    out.update(saved_bytes=report.total_bytes, saved_storages=len(report.breakdown))

    model.zero_grad(set_to_none=True)
    gc.collect()
    peak = measure.memory_profile(fwd_bwd)
    out.update(peak_bytes=peak.peak_bytes, alloc_bytes=peak.alloc_bytes)
    out["recompiles"] = graph_count() - graphs
    if spec["kind"] == "ours":
        out.update(plan_figures())
    out["rss_hwm_bytes"] = measure.process_high_water_mark()


# --------------------------------------------------------------------------
# Driver: fresh processes, interleaved rounds
# --------------------------------------------------------------------------


def worker_env(cache_dir: str) -> dict:
    env = dict(os.environ)
    env.update(TORCHINDUCTOR_CACHE_DIR=cache_dir, TORCHINDUCTOR_FX_GRAPH_CACHE="0",
               TORCHINDUCTOR_AUTOGRAD_CACHE="0", TORCHINDUCTOR_COMPILE_THREADS="1",
               PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")])))
    return env


def spawn_worker(name: str, args) -> dict:
    """Run ``--worker name`` in a fresh interpreter with a private, empty Inductor cache."""
    cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", name]
    for flag in WORKER_FLAGS:
        cmd += [f"--{flag}", str(getattr(args, flag))]
    if args.native_rng:
        cmd.append("--native-rng")
    cache_dir = tempfile.mkdtemp(prefix="compare_inductor_")
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(cmd, env=worker_env(cache_dir), capture_output=True, text=True,
                              timeout=args.timeout, cwd=REPO)
    except subprocess.TimeoutExpired:
        return {"strategy": name, "error": f"timeout after {args.timeout}s"}
    finally:
        shutil.rmtree(cache_dir, ignore_errors=True)
    wall = time.perf_counter() - t0
    for line in reversed(proc.stdout.splitlines()):
        if line.startswith(MARKER):
            result = json.loads(line[len(MARKER):])
            result["process_wall_s"] = wall
            if args.verbose and proc.stderr.strip():
                print(proc.stderr, file=sys.stderr)
            return result
    tail = [ln for ln in proc.stderr.strip().splitlines() if ln.strip()][-1:] or ["no output"]
    return {"strategy": name, "error": f"worker exited rc={proc.returncode}: {tail[0]}"}


def progress_line(rnd: int, rounds: int, res: dict) -> str:
    head = f"[round {rnd}/{rounds}] {res['strategy']:<24}"
    if "error" in res:
        return f"{head} ERROR: {res['error']}"
    parts = [f"{res['step_median_s'] * 1e3:8.1f} ms/step",
             f"first step {res['first_step_s']:6.1f} s",
             f"saved {res['saved_bytes'] / MiB:7.2f} MiB",
             f"peak {res['peak_bytes'] / MiB:7.2f} MiB",
             f"({res['process_wall_s']:.0f} s wall)"]
    return head + "  " + "  ".join(parts)


def _raise_interrupt(signum, frame):
    raise KeyboardInterrupt


def run_rounds(names: list[str], args, runs: list[dict]) -> None:
    """Append one result per (round, strategy) to ``runs`` (in place, so an interrupt keeps them)."""
    failed: set[str] = set()
    for rnd in range(1, args.repeats + 1):
        order = [n for n in names if n not in failed]
        random.Random(args.order_seed + rnd).shuffle(order)
        for name in order:
            res = spawn_worker(name, args)
            res["round"] = rnd
            runs.append(res)
            print(progress_line(rnd, args.repeats, res), file=sys.stderr, flush=True)
            if "error" in res:
                failed.add(name)


# --------------------------------------------------------------------------
# Aggregation and output
# --------------------------------------------------------------------------


def _median(values: list) -> float | None:
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def aggregate(name: str, runs: list[dict]) -> dict:
    """One table row from all processes of one strategy."""
    mine = [r for r in runs if r["strategy"] == name]
    ok = [r for r in mine if "error" not in r]
    row: dict = {"strategy": name, "processes": len(ok)}
    errors = [r["error"] for r in mine if "error" in r]
    if errors:
        row["error"] = errors[0]
    if not mine:
        row["notes"] = ["not run (interrupted)"]
    if not ok:
        return row
    steps = [t for r in ok for t in r["step_s"]]
    firsts = [r["first_step_s"] for r in ok]
    row.update(step_ms=1e3 * _median([r["step_median_s"] for r in ok]),
               step_ms_min=1e3 * min(steps), step_ms_max=1e3 * max(steps),
               compile_s=_median(firsts), compile_s_min=min(firsts), compile_s_max=max(firsts),
               max_grad_diff=max(r["max_grad_diff"] for r in ok),
               recompiles=max(r["recompiles"] for r in ok), graphs=ok[0]["graphs"],
               loadavg_1m=max(r["loadavg_1m"] for r in ok))
    for key in ("saved_bytes", "peak_bytes", "plan_saved_bytes", "plan_predicted_peak_bytes",
                "plan_recompute_flops", "rss_hwm_bytes"):
        vals = [r[key] for r in ok if r.get(key) is not None]
        if vals:
            row[key] = _median(vals)
            if key in ("saved_bytes", "peak_bytes") and max(vals) != min(vals):
                row.setdefault("notes", []).append(f"{key} varies {min(vals)}..{max(vals)}")
    return row


def _mib(v) -> str:
    return "—" if v is None else f"{v / MiB:.2f}"


def _notes(row: dict) -> str:
    notes = list(row.get("notes", []))
    if row.get("recompiles"):
        notes.append(f"{row['recompiles']} recompile(s) while measuring")
    if row.get("loadavg_1m", 0) > (os.cpu_count() or 1):
        notes.append(f"busy machine (load {row['loadavg_1m']:.1f})")
    if row.get("graphs", 1) > 1:
        notes.append(f"{row['graphs']} graphs")
    if "error" in row:
        msg = " ".join(row["error"].split())
        notes.append("ERROR: " + (msg if len(msg) <= 160 else msg[:157] + "..."))
    return "; ".join(notes).replace("|", "\\|")


COLUMNS = ["strategy", "step ms (median)", "step ms min–max", "first step s (cold compile)",
           "saved MiB", "peak MiB", "max abs dgrad", "plan saved MiB", "plan peak MiB",
           "plan recompute GFLOP", "notes"]


def markdown_table(rows: list[dict]) -> str:
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    for r in rows:
        ok = "step_ms" in r
        flops = r.get("plan_recompute_flops")
        cells = [r["strategy"],
                 f"{r['step_ms']:.1f}" if ok else "—",
                 f"{r['step_ms_min']:.1f}–{r['step_ms_max']:.1f}" if ok else "—",
                 f"{r['compile_s']:.1f} ({r['compile_s_min']:.1f}–{r['compile_s_max']:.1f})"
                 if ok else "—",
                 _mib(r.get("saved_bytes")), _mib(r.get("peak_bytes")),
                 f"{r['max_grad_diff']:.1e}" if ok else "—",
                 _mib(r.get("plan_saved_bytes")), _mib(r.get("plan_predicted_peak_bytes")),
                 "—" if flops is None else f"{flops / 1e9:.3f}",
                 _notes(r)]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def write_csv(path: str, rows: list[dict]) -> None:
    keys = ["strategy", "processes", "step_ms", "step_ms_min", "step_ms_max", "compile_s",
            "compile_s_min", "compile_s_max", "saved_bytes", "peak_bytes", "max_grad_diff",
            "plan_saved_bytes", "plan_predicted_peak_bytes", "plan_recompute_flops",
            "rss_hwm_bytes", "graphs", "recompiles", "loadavg_1m", "error"]
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=keys, extrasaction="ignore")
        writer.writeheader()
        writer.writerows(rows)


# --------------------------------------------------------------------------
# CLI
# --------------------------------------------------------------------------


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--strategies", default=",".join(STRATEGIES),
                   help="comma-separated subset of: " + ", ".join(STRATEGIES))
    p.add_argument("--repeats", type=int, default=3, help="rounds of fresh processes")
    p.add_argument("--steps", type=int, default=5, help="timed steps per process (>= 5)")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps after the compile step")
    p.add_argument("--model", choices=["gpt", "llama"], default="gpt")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--embd", type=int, default=256)
    p.add_argument("--seq", type=int, default=256, help="sequence length (= block_size)")
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--vocab", type=int, default=512)
    p.add_argument("--dropout", type=float, default=0.0, help="GPT dropout, e.g. 0.1")
    p.add_argument("--native-rng", action="store_true",
                   help="with dropout, keep Inductor's own RNG (grads then differ from eager)")
    p.add_argument("--threads", type=int, default=1,
                   help="torch.set_num_threads in workers (0: torch's default). Default 1: on a "
                        "shared machine, OpenMP teams stall when another process takes a core "
                        "(seen: 100x slower steps), single-threaded timings stay comparable")
    p.add_argument("--timeout", type=int, default=1800, help="seconds per worker process")
    p.add_argument("--order-seed", type=int, default=0, help="seed of the per-round shuffle")
    p.add_argument("--json", help="write raw runs and aggregated rows to this JSON file")
    p.add_argument("--csv", help="write aggregated rows to this CSV file")
    p.add_argument("--verbose", action="store_true", help="echo workers' stderr")
    p.add_argument("--worker", metavar="STRATEGY", choices=list(STRATEGIES), help=argparse.SUPPRESS)
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.worker:
        print(MARKER + json.dumps(run_worker(args.worker, args)), flush=True)
        return 0
    names = [s.strip() for s in args.strategies.split(",") if s.strip()]
    unknown = [n for n in names if n not in STRATEGIES]
    if unknown:
        raise SystemExit(f"unknown strategies {unknown}; choose from {list(STRATEGIES)}")
    if args.steps < 5:
        print(f"note: --steps {args.steps} < 5, medians will be noisy", file=sys.stderr)
    signal.signal(signal.SIGTERM, _raise_interrupt)  # a killed run still prints its table
    runs: list[dict] = []
    try:
        run_rounds(names, args, runs)
    except KeyboardInterrupt:
        print("interrupted: reporting the runs finished so far", file=sys.stderr)
    rows = [aggregate(n, runs) for n in names]
    config = {k: getattr(args, k) for k in WORKER_FLAGS + ["repeats", "native_rng"]}
    print(f"\nconfig: {json.dumps(config)}; step = fwd+bwd+SGD; peak = fwd+bwd from grads=None\n")
    print(markdown_table(rows))
    if args.json:
        Path(args.json).write_text(json.dumps({"config": config, "rows": rows, "runs": runs},
                                              indent=1))
    if args.csv:
        write_csv(args.csv, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
