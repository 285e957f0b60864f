"""What ``chunks="auto"`` (the default) costs the least-peak planning, and what it buys (issue 23).

Each cell is a fresh process with an empty Inductor cache and plan cache:
``recompile_opt.plan(*models.demo_MODEL(), memory_budget=0.0, compiler="eager", chunks=C)`` for C in
False and "auto", one compile thread. Prints the provenance line and a Markdown table (docs/design.md,
"The planner's choice"): the wall time of the call, the predicted peak (walked in Inductor's code, or the
kernel model's where the plan was not walked), the chunks taken, and the unchunked plan "auto" compared
them with (always walked).

Usage::

    python bench/chunk_auto_cost.py [--models gpt,llama]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

MARKER = "@@CHUNK_AUTO@@ "


def worker(model: str, chunks) -> None:
    import recompile_opt
    from recompile_opt import models

    m, inputs = getattr(models, f"demo_{model}")()
    start = time.perf_counter()
    plan = recompile_opt.plan(m, inputs, memory_budget=0.0, compiler="eager", chunks=chunks)
    seconds = time.perf_counter() - start
    taken = sorted({f"{c['kind']} in {c['chunks']}" for c in plan.chunks})
    tried = [n for n in plan.notes if n.startswith("chunks (auto)")]
    saved = (
        plan.chunks[0]["peak_saved_bytes"] if plan.chunks else 0
    )  # against the unchunked plan, both walked
    print(
        MARKER
        + json.dumps(
            {
                "s": seconds,
                "peak": plan.predicted_peak_bytes,
                "taken": taken,
                "tried": tried,
                "saved": saved,
                "walked": plan.solver.get("peak_from") == "inductor-code",
            }
        )
    )


def probe(model: str, chunks) -> dict:
    with tempfile.TemporaryDirectory() as cache:
        env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": cache, "TORCHINDUCTOR_COMPILE_THREADS": "1"}
        cmd = [sys.executable, __file__, "--worker", model, json.dumps(chunks)]
        run = subprocess.run(cmd, env=env, capture_output=True, text=True)
    lines = [line for line in run.stdout.splitlines() if line.startswith(MARKER)]
    if not lines:
        raise SystemExit(f"{model} chunks={chunks!r} failed: {run.stderr.strip().splitlines()[-1:]}")
    return json.loads(lines[-1][len(MARKER) :])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", default="gpt,llama")
    p.add_argument("--worker", nargs=2, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        worker(args.worker[0], json.loads(args.worker[1]))
        return
    from recompile_opt.provenance import header_line

    rows = []
    for model in args.models.split(","):
        off, auto = probe(model, False), probe(model, "auto")
        how = {True: "walked", False: "kernel model"}
        rows.append(
            f"| {model} | {off['s']:.1f} s, {off['peak'] / 2**20:.2f} MiB ({how[off['walked']]}) | "
            f"{auto['s']:.1f} s ({auto['s'] / off['s']:.1f}x), {auto['peak'] / 2**20:.2f} MiB "
            f"({how[auto['walked']]}) | {', '.join(auto['taken']) or 'nothing'} | "
            f"{(auto['peak'] + auto['saved']) / 2**20:.2f} MiB |"
        )
        for line in auto["tried"]:
            print(f"# {model}: {line}", file=sys.stderr)
    print(header_line())
    print()
    print(
        '| model | chunks=False: planning, predicted peak | "auto": planning, predicted peak | chunks taken '
        '| "auto"\'s unchunked plan, walked |'
    )
    print("|---|---|---|---|---|")
    print("\n".join(rows))


if __name__ == "__main__":
    main()
