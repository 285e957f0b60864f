"""Compare activation save/recompute strategies on CPU, one fresh process per run.

Usage::

    python bench/compare.py                                   # default strategies, small GPT
    python bench/compare.py --model gpt,llama --size small,medium --json out.json --csv out.csv
    python bench/compare.py --strategies eager,compile,ours-0.2 --repeats 3

Strategies (``--strategies``; the default set is :data:`DEFAULT_STRATEGIES`)
-----------------------------------------------------------------------------
* ``eager``; ``eager-full-ckpt`` (``torch.utils.checkpoint`` around every block);
  ``eager-selective`` (Megatron's selective recompute: checkpoint around the attention
  core only -- GPT: QK^T, scale, mask, softmax, dropout, @V; Llama: the SDPA call).
* ``compile`` (Inductor, default partitioner); ``compile-amb-B``
  (``torch._functorch.config.activation_memory_budget = B``, its knapsack);
  ``compile-full-ckpt`` (``torch.compile`` of the block-checkpointed model).
* ``ours-B`` (``memory_budget=B``, the same budgets B as ``compile-amb-B``), ``ours-none``
  (no budget: the fewest bytes within ``mip_gap`` of the fastest plan) and ``ours-<policy>`` for each
  fixed policy.
* ``ours-...+nochunks`` (any ``ours-`` strategy with ``chunks=False``, e.g. ``ours-0.0+nochunks``):
  the planner does not chunk the LM head + loss and the MLPs along the tokens (``chunks="auto"``, the
  default, lets it where the goal is memory; ``+chunks`` says so explicitly).
* ``ours-peak-SIZE`` (``peak_memory=SIZE``, any size with units, e.g. ``ours-peak-27MiB``): the
  least recompute whose predicted peak fits SIZE -- how a user asks for a peak rather than kept bytes.
* ``rockmate``: ``bench/rockmate_runner.py`` run by another interpreter (``--rockmate-python``,
  default ``$RECOMPILE_OPT_ROCKMATE_PYTHON`` or ``/work/rockmate-venv/bin/python``); when it
  cannot run, its row carries the runner's exact error (see ``bench/ROCKMATE.md``).

Methodology
-----------
* **Fresh process per (model, size, strategy, round).**  Dynamo/Inductor keep global
  state and the CPU allocator keeps freed memory, so each run is its own
  ``python bench/compare.py --worker NAME`` process that prints one JSON line.
* **Compile caches.**  Each (model, size, strategy) gets a private
  ``TORCHINDUCTOR_CACHE_DIR``, empty in round 1 (*cold* compile: the reported compile
  time) and reused by later rounds (*warm*: Inductor's FX-graph and AOTAutograd caches
  hit, our plans are replayed), which cuts a compiled run from ~1 min to ~10 s.  Kernels
  are never shared between strategies.  ``--cold-every-round`` gives every process an
  empty cache with the caches off.  ``TORCHINDUCTOR_COMPILE_THREADS=1`` always.
* **One thread.**  Workers run ``torch.set_num_threads(--threads)``, 1 by default: on a
  small shared machine an OpenMP team stalls whenever another process holds one of its
  cores (steps 100x slower were seen).  The 1-minute load average at the start of timing
  is recorded and a row is flagged "busy machine" when it exceeds the core count.
* **Interleaved repeats.**  ``--repeats R`` rounds; each round runs every strategy once in a
  shuffled order (seeded by ``--order-seed``), so slow drifts of the machine spread over all
  strategies.  ``--jobs N`` runs N workers at once, but a shared/exclusive file lock
  (:class:`JobLock`) keeps each *timed* section (steps, saved bytes, peak) alone: it waits
  until no other worker is starting or compiling and makes them wait, so only compiles
  overlap (and the compile times then share the cores).  ``rockmate`` runs under the shared
  lock: its own timings are not protected.
* **Same model, same data.**  Each worker builds the model under ``torch.manual_seed(0)``
  and draws the batch from a fixed generator.  It keeps an untouched eager copy and compares
  the first step's gradients with it (``max|dgrad|``).  The RNG is reseeded before every
  step; with ``--dropout > 0`` (GPT only) Inductor's ``fallback_random`` is on so compiled
  dropout draws eager's masks (``--native-rng`` turns that off).
* **Figures per worker** (the table legend says which are measured, counted or estimated).
  - *compile s*: wall time of the first forward+backward (Dynamo, partitioning, Inductor).
  - *step ms*: forward + backward + ``SGD.step()`` after ``--warmup`` steps; median and
    min/max of ``--steps`` steps.
  - *saved MiB*: bytes packed for backward during one forward (``saved_tensors_hooks``),
    storages deduplicated, parameters, buffers and the batch excluded.
  - *peak MiB*: most live CPU bytes above the pre-step baseline during one forward+backward
    entered with grads ``None``, integrated from the profiler's allocation records
    (``recompile_opt.costs.measure.memory_profile``).  Cross-check: *RSS rise MiB*, the process's
    resident high-water mark during another such call (``/proc/self/clear_refs`` resets it)
    minus its resident size before; it is lower when the C allocator reuses memory it kept.
  - *recompute GFLOP*: FLOPs executed in the backward beyond eager's save-all backward,
    i.e. recomputation.  Eager strategies: ``FlopCounterMode`` around the backward.  Compiled
    ones: a dispatch mode makes Dynamo run the model eagerly, so the FLOPs of the compiled
    backward graphs are summed instead, read by an Inductor post-grad pass (round-1 runs only:
    a warm cache skips the pass).  Formulas of ``torch.utils.flop_counter`` (matmuls,
    attention); pointwise ops count 0.  Eager ``torch.utils.checkpoint`` stops recomputing
    once the backward has what it needs (its early stop), so it reruns less than the same
    checkpoint compiled (e.g. not a block's last matmul).
  - ``ours-*``: the plans' own estimates over ``recompile_opt.last_plans()``.
* **Aggregation.**  The median of the per-process medians, with min–max over every timed
  step of every process; compile time over the cold processes.  Memory figures repeat
  exactly; a spread is flagged in the notes.
* **Pareto check.**  After each table, on the measured (peak, median step) plane: point A
  *dominates* B when A's peak <= B's and A's step is more than ``--noise`` (10%) faster.
  Each ``ours-*`` row is "on the frontier" or "dominated by ..."; each other row is dominated
  by, matched by (peak <= and step within the noise) or *not covered* by our points, with the
  figures that say why.
A failing run (exception, crash, timeout) shows ``ERROR: ...`` in its row and is not retried
in later rounds; the run always finishes.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
from pathlib import Path

BENCH = Path(__file__).resolve().parent
REPO = BENCH.parent
for _path in (REPO, BENCH):  # recompile_opt, and the comparison package beside this script
    if str(_path) not in sys.path:
        sys.path.insert(0, str(_path))

# The pieces live in bench/comparison/ (one concept per module); their public names are re-exported
# here because callers and tests import them from this script.
from comparison.config import (  # noqa: F401
    SHAPE_FLAGS,
    SIZES,
    WORKER_FLAGS,
    MiB,
    group_configs,
    group_title,
)
from comparison.flops import count_flops, graph_flops_pass, node_flops  # noqa: F401
from comparison.joblock import LOCK_ENV, JobLock  # noqa: F401
from comparison.pareto import covers, dominates, is_ours, pareto_check, pareto_markdown  # noqa: F401
from comparison.report import (  # noqa: F401
    COLUMNS,
    CSV_KEYS,
    HEADLINE_COLUMNS,
    LEGEND,
    aggregate,
    group_markdown,
    headline_table,
    markdown_table,
    report_markdown,
    write_csv,
    write_json,
)
from comparison.runner import (  # noqa: F401
    COMPARE_SCRIPT,
    progress_line,
    run_rounds,
    spawn_worker,
    worker_command,
    worker_env,
)
from comparison.strategies import (  # noqa: F401
    BUDGETS,
    DEFAULT_STRATEGIES,
    PEAK_PREFIX,
    ROCKMATE_PYTHON,
    ROCKMATE_RUNNER,
    STRATEGIES,
    build_model,
    checkpoint_attention_cores,
    checkpoint_blocks,
    prepare,
    strategy,
)
from comparison.worker import (  # noqa: F401
    MARKER,
    grad_diff,
    graph_count,
    kernels_built,
    make_steps,
    measure_strategy,
    plan_figures,
    rss_rise,
    run_worker,
)

# CLI
# --------------------------------------------------------------------------


def parse_args(argv=None):
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--strategies",
        default=",".join(DEFAULT_STRATEGIES),
        help="comma-separated subset of: "
        + ", ".join(STRATEGIES)
        + f", {PEAK_PREFIX}SIZE; any ours-* with +nochunks (chunks=False)",
    )
    p.add_argument("--model", default="gpt", help="gpt, llama or both: gpt,llama")
    p.add_argument("--size", default="small", help=f"comma-separated presets from {list(SIZES)}")
    p.add_argument("--repeats", type=int, default=2, help="rounds of fresh processes")
    p.add_argument("--steps", type=int, default=5, help="timed steps per process (>= 5)")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps after the compile step")
    for flag, text in (
        ("layers", "layers"),
        ("embd", "hidden size"),
        ("heads", "attention heads"),
        ("seq", "sequence length (= block_size)"),
        ("batch", "batch size"),
    ):
        p.add_argument(f"--{flag}", type=int, default=None, help=f"{text} (overrides the --size preset)")
    p.add_argument("--vocab", type=int, default=512)
    p.add_argument("--dropout", type=float, default=0.0, help="GPT dropout, e.g. 0.1 (Llama has none)")
    p.add_argument(
        "--native-rng",
        action="store_true",
        help="with dropout, keep Inductor's own RNG (grads then differ from eager)",
    )
    p.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch.set_num_threads in workers (0: torch's default). Default 1: on a "
        "shared machine, OpenMP teams stall when another process takes a core "
        "(seen: 100x slower steps), single-threaded timings stay comparable",
    )
    p.add_argument(
        "--jobs",
        type=int,
        default=1,
        help="workers at once: their starts and compiles overlap, no timed section overlaps "
        "any other work of this run (a shared/exclusive file lock)",
    )
    p.add_argument(
        "--cold-every-round",
        action="store_true",
        help="empty Inductor cache (caches off) in every round, not only the first",
    )
    p.add_argument(
        "--ours-compiler",
        choices=["inductor", "eager"],
        default="inductor",
        help="our backend's compiler option; eager: same partition, no code generation "
        "(seconds instead of a minute: for tests, not for timings)",
    )
    p.add_argument("--noise", type=float, default=0.10, help="step-time allowance of the Pareto check")
    p.add_argument(
        "--rockmate-python",
        default=os.environ.get("RECOMPILE_OPT_ROCKMATE_PYTHON", ROCKMATE_PYTHON),
        help="interpreter of the Rockmate venv (runs bench/rockmate_runner.py)",
    )
    p.add_argument("--timeout", type=int, default=1800, help="seconds per worker process")
    p.add_argument("--order-seed", type=int, default=0, help="seed of the per-round shuffle")
    p.add_argument("--json", help="write config, rows, Pareto check and raw runs to this JSON file")
    p.add_argument("--csv", help="write aggregated rows (all groups) to this CSV file")
    p.add_argument("--md", help="write the markdown report to this file")
    p.add_argument("--verbose", action="store_true", help="echo workers' stderr")
    p.add_argument("--worker", metavar="STRATEGY", help=argparse.SUPPRESS)
    return p.parse_args(argv)


def _raise_interrupt(signum, frame):
    raise KeyboardInterrupt


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.worker:
        print(MARKER + json.dumps(run_worker(args.worker, args)), flush=True)
        return 0
    names = [s.strip() for s in args.strategies.split(",") if s.strip()]
    for n in names:
        try:
            strategy(n)
        except KeyError as e:
            raise SystemExit(e.args[0]) from None
    configs = group_configs(args)
    if args.steps < 5:
        print(f"note: --steps {args.steps} < 5, medians will be noisy", file=sys.stderr)
    print(
        f"{len(configs)} model size(s) x {len(names)} strategies x {args.repeats} round(s), "
        f"{args.jobs} at a time",
        file=sys.stderr,
        flush=True,
    )
    # lazy (it imports torch); taken before the runs, so the load it records is the machine's, not
    # this run's own
    from recompile_opt.provenance import header_line

    header = header_line()
    signal.signal(signal.SIGTERM, _raise_interrupt)  # a killed run still prints its tables
    t0 = time.perf_counter()
    groups = [{"config": cfg, "runs": []} for cfg in configs]
    try:
        for g in groups:
            cfg, t1 = g["config"], time.perf_counter()
            run_rounds(names, cfg, args, g["runs"], label=f"{cfg['model']} {cfg['size']} ")
            g["wall_s"] = time.perf_counter() - t1
    except KeyboardInterrupt:
        print("interrupted: reporting the runs finished so far", file=sys.stderr)
    wall = time.perf_counter() - t0
    for g in groups:
        g["rows"] = [aggregate(n, g["runs"]) for n in names]
        g["pareto"] = pareto_check(g["rows"], args.noise)
    write_outputs(groups, args, argv=argv, header=header, wall_s=wall)
    return 0


def write_outputs(groups: list[dict], args, *, argv, header: str, wall_s: float) -> None:
    """Print the markdown report (its first line the provenance header) and write the files asked for."""
    settings = {
        k: getattr(args, k)
        for k in (
            "repeats",
            "steps",
            "warmup",
            "threads",
            "jobs",
            "native_rng",
            "cold_every_round",
            "noise",
            "order_seed",
            "ours_compiler",
        )
    }
    command = "python bench/compare.py " + " ".join(sys.argv[1:] if argv is None else argv)
    report = report_markdown(groups, header=header, command=command, settings=settings, wall_s=wall_s)
    print(report)
    print(f"\ntotal wall {wall_s / 60:.1f} min", file=sys.stderr)
    if args.md:
        Path(args.md).write_text(report + "\n")
    if args.json:
        write_json(args.json, groups, header=header, command=command, settings=settings, wall_s=wall_s)
    if args.csv:
        write_csv(args.csv, groups)


if __name__ == "__main__":
    sys.exit(main())
