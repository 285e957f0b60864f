"""The longest sequence each strategy trains under a memory cap (issue 23: mini-sequence chunking).

A Llama-style model with a large vocabulary (``recompile_opt.models.Llama``: width 256, 2 layers, 4
heads, vocabulary 32000, batch 1, fp32, CPU). Attention has no dropout, so SDPA runs the CPU flash
kernel and attention stays linear in the sequence for every strategy: what grows is the activations
and, above all, the logits (``[tokens, 32000]``, 125 KiB a token in fp32, and their softmax and gradient).

For each strategy: sequence lengths doubling from ``--start`` while the measured step peak stays under
``--cap``, then ``--bisect`` halvings between the last length that fits and the first that does not.
Every probe is a fresh process with an empty Inductor cache (a cold compile), one training step to
compile, then the step's peak (``recompile_opt.costs.measure.memory_profile``: live bytes above the
pre-step baseline, from the allocator's records) and the median of ``--steps`` timed steps.

Usage::

    python bench/long_context.py --cap 256MiB --md docs/long_context.md --plot docs/long_context.png

Prints one line per probe and a table (longest length under the cap per strategy; step times at the
lengths every strategy reaches), and writes the plot (sequence length vs measured peak per strategy).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from comparison.strategies import build_model, prepare, strategy  # noqa: E402

MARKER = "@@LONG_CONTEXT@@ "
STRATEGIES = {  # label -> bench/compare.py strategy
    "torch.compile": "compile",
    "torch.compile + full checkpointing": "compile-full-ckpt",
    "activation_memory_budget 0.0": "compile-amb-0.0",
    "ours 0.0 (no chunks)": "ours-0.0+nochunks",
    "ours 0.0 (chunks auto)": "ours-0.0",  # chunks="auto" is the default
    "ours peak_memory=cap (chunks auto)": "ours-peak-CAP",  # CAP: the --cap given
}
MODEL = {"model": "llama", "layers": 2, "heads": 4, "embd": 256, "vocab": 32000, "batch": 1, "dropout": 0.0}
MiB = 2**20


def probe(name: str, seq: int, steps: int) -> dict:
    """One fresh process: compile ``name`` at ``seq`` tokens, measure the step's peak and time."""
    with tempfile.TemporaryDirectory() as cache:
        env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": cache, "TORCHINDUCTOR_COMPILE_THREADS": "1"}
        cmd = [sys.executable, __file__, "--worker", name, "--seq", str(seq), "--steps", str(steps)]
        run = subprocess.run(cmd, env=env, capture_output=True, text=True)
    lines = [line for line in run.stdout.splitlines() if line.startswith(MARKER)]
    if not lines:
        return {"strategy": name, "seq": seq, "error": run.stderr.strip().splitlines()[-1:] or ["no output"]}
    return json.loads(lines[-1][len(MARKER) :])


def worker(name: str, seq: int, steps: int) -> dict:
    import statistics

    import torch

    from recompile_opt.costs import measure

    torch.set_num_threads(1)
    model, idx, tgt = build_model({**MODEL, "seq": seq})
    args = argparse.Namespace(dropout=0.0, native_rng=False, ours_compiler="inductor")
    fn = prepare(strategy(name), model, args)

    def step():
        model.zero_grad(set_to_none=True)
        fn(idx, tgt).backward()

    t0 = time.perf_counter()
    step()
    out = {"strategy": name, "seq": seq, "compile_s": time.perf_counter() - t0}
    model.zero_grad(set_to_none=True)
    out["peak_bytes"] = measure.memory_profile(lambda: fn(idx, tgt).backward()).peak_bytes
    out["step_s"] = statistics.median(measure.step_time(step, steps=steps, warmup=0))
    if name.startswith("ours"):
        import recompile_opt

        plans = recompile_opt.last_plans()
        out["predicted_peak_bytes"] = max((p.predicted_peak_bytes for p in plans), default=None)
        out["chunks"] = [{k: c[k] for k in ("kind", "chunks")} for p in plans for c in p.chunks]
    return out


def longest(name: str, args, log) -> tuple[int, list[dict]]:
    """Doubling while the peak fits, then ``args.bisect`` halvings of the gap."""
    runs, good, bad = [], 0, None
    seq = args.start
    while seq <= args.max_seq:
        r = probe(name, seq, args.steps)
        runs.append(r)
        log(r)
        if r.get("peak_bytes") is None or r["peak_bytes"] > args.cap:
            bad = seq
            break
        good, seq = seq, seq * 2
    for _ in range(args.bisect if bad else 0):
        mid = (good + bad) // 2 // 64 * 64
        if mid in (good, bad):
            break
        r = probe(name, mid, args.steps)
        runs.append(r)
        log(r)
        if r.get("peak_bytes") is not None and r["peak_bytes"] <= args.cap:
            good = mid
        else:
            bad = mid
    return good, runs


def table(results: dict, args) -> str:
    from recompile_opt.provenance import header_line

    base = results.get("torch.compile", next(iter(results.values())))["longest"] or 1
    lines = [
        header_line(),
        "",
        f"Cap {args.cap / MiB:.0f} MiB (measured step peak above the pre-step baseline); model: "
        f"{json.dumps(MODEL)}.",
        "",
        "| strategy | longest sequence under the cap | x torch.compile | peak MiB there | step s there "
        "| chunks |",
        "|---|---|---|---|---|---|",
    ]
    for label, r in results.items():
        at = next((x for x in r["runs"] if x["seq"] == r["longest"]), {})
        chunks = ", ".join(sorted({f"{c['kind']} {c['chunks']}" for c in at.get("chunks", [])})) or "-"
        lines.append(
            f"| {label} | {r['longest']} | {r['longest'] / base:.1f}x | "
            f"{at.get('peak_bytes', 0) / MiB:.1f} | {at.get('step_s', float('nan')):.2f} | {chunks} |"
        )
    common = sorted(
        set.intersection(*[{x["seq"] for x in r["runs"] if "step_s" in x} for r in results.values()])
    )
    if common:
        lines += [
            "",
            "Step time (s, median) at the lengths every strategy ran:",
            "",
            "| strategy | " + " | ".join(str(s) for s in common) + " |",
            "|---|" + "---|" * len(common),
        ]
        for label, r in results.items():
            by = {x["seq"]: x for x in r["runs"]}
            lines.append(f"| {label} | " + " | ".join(f"{by[s]['step_s']:.2f}" for s in common) + " |")
    return "\n".join(lines)


def plot(results: dict, path: str, cap: int) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for label, r in results.items():
        pts = sorted((x["seq"], x["peak_bytes"] / MiB) for x in r["runs"] if x.get("peak_bytes"))
        ax.plot(*zip(*pts), marker="o", label=label)
    ax.axhline(cap / MiB, color="gray", linestyle="--", label="cap")
    ax.set(
        xscale="log",
        yscale="log",
        xlabel="sequence length (tokens, batch 1)",
        ylabel="measured step peak (MiB)",
        title="Llama-style, width 256, 2 layers, vocabulary 32000, fp32, CPU",
    )
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cap", default="256MiB", help="memory cap on the measured step peak")
    p.add_argument("--start", type=int, default=256)
    p.add_argument("--max-seq", type=int, default=32768)
    p.add_argument("--bisect", type=int, default=2, help="halvings between the last fit and the first miss")
    p.add_argument("--steps", type=int, default=2, help="timed steps per probe")
    p.add_argument(
        "--strategies",
        default=",".join(STRATEGIES),
        help="comma-separated labels from: " + "; ".join(STRATEGIES),
    )
    p.add_argument("--md")
    p.add_argument("--json")
    p.add_argument("--plot")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    p.add_argument("--seq", type=int, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        print(MARKER + json.dumps(worker(args.worker, args.seq, args.steps)), flush=True)
        return 0
    from recompile_opt.options import parse_bytes

    args.cap_text, args.cap = args.cap, parse_bytes("cap", args.cap)
    results = {}
    for label in [s.strip() for s in args.strategies.split(",")]:

        def log(r, label=label):
            peak = f"{r['peak_bytes'] / MiB:8.1f} MiB" if "peak_bytes" in r else f"error {r.get('error')}"
            print(
                f"{label:<36} seq {r['seq']:>6}: {peak}  step {r.get('step_s', float('nan')):.2f} s  "
                f"compile {r.get('compile_s', float('nan')):.0f} s {r.get('chunks', '')}",
                flush=True,
            )

        good, runs = longest(STRATEGIES[label].replace("CAP", args.cap_text), args, log)
        results[label] = {"longest": good, "runs": runs}
        if args.json:
            Path(args.json).write_text(json.dumps(results, indent=1))
    report = table(results, args)
    print(report)
    if args.md:
        Path(args.md).write_text(
            "```bash\npython bench/long_context.py " + shlex.join(sys.argv[1:]) + "\n```\n\n" + report + "\n"
        )
    if args.plot:
        plot(results, args.plot, args.cap)
    return 0


if __name__ == "__main__":
    sys.exit(main())
