"""The driver's side: every run in a fresh process, rounds interleaved in a shuffled order.

Why this shape: Dynamo/Inductor state and the allocator's kept memory make a process measure only one
strategy (see ``worker``); slow drifts of a shared machine are spread over all strategies by running
every strategy once per round in a seeded shuffled order; each (model, size, strategy) keeps a private
Inductor cache, empty in round 1 (the cold compile reported) and reused after (warm), so kernels are
never shared between strategies.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor, as_completed
from pathlib import Path

from .config import REPO, WORKER_FLAGS, MiB
from .joblock import LOCK_ENV, JobLock
from .strategies import strategy
from .worker import MARKER

# the script a worker runs: it re-invokes itself with ``--worker NAME``
COMPARE_SCRIPT = REPO / "bench" / "compare.py"


def worker_env(cache_dir: str, *, warm_cache: bool, lock: str | None) -> dict:
    env = dict(os.environ)
    cache = "1" if warm_cache else "0"
    env.update(
        TORCHINDUCTOR_CACHE_DIR=cache_dir,
        TORCHINDUCTOR_FX_GRAPH_CACHE=cache,
        TORCHINDUCTOR_AUTOGRAD_CACHE=cache,
        TORCHINDUCTOR_COMPILE_THREADS="1",
        PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")])),
    )
    env.pop(LOCK_ENV, None)
    if lock:
        env[LOCK_ENV] = lock
    return env


def worker_command(name: str, cfg: dict, args) -> list[str]:
    """The command of one run; raises ``FileNotFoundError`` when an external runner cannot start."""
    spec = strategy(name)
    flags = [a for flag in WORKER_FLAGS for a in (f"--{flag}", str(cfg[flag]))]
    if spec["kind"] != "external":
        return [
            sys.executable,
            str(COMPARE_SCRIPT),
            "--worker",
            name,
            *flags,
            "--ours-compiler",
            args.ours_compiler,
        ] + (["--native-rng"] if args.native_rng else [])
    runner = Path(spec["runner"])
    if not runner.is_file():
        raise FileNotFoundError(f"{runner.relative_to(REPO)} missing")
    python = args.rockmate_python
    if not (os.path.isfile(python) and os.access(python, os.X_OK)):
        raise FileNotFoundError(
            f"no interpreter at {python} (set --rockmate-python or "
            "RECOMPILE_OPT_ROCKMATE_PYTHON; see bench/ROCKMATE.md)"
        )
    return [python, str(runner), "--strategy", name, *spec.get("runner_args", []), *flags]


def spawn_worker(
    name: str, cfg: dict, args, *, cache_dir: str | None = None, lock: str | None = None
) -> dict:
    """Run one strategy in a fresh interpreter; ``cache_dir`` None: a private, empty cache, caches off."""
    try:
        cmd = worker_command(name, cfg, args)
    except FileNotFoundError as exc:
        return {"strategy": name, "error": str(exc)}
    warm = cache_dir is not None
    own_dir = cache_dir or tempfile.mkdtemp(prefix="compare_inductor_")
    cached = warm and any(Path(own_dir).iterdir())
    # an external runner knows nothing of the lock: hold it shared for the whole of its run
    held = JobLock(lock or "") if strategy(name)["kind"] == "external" else JobLock("")
    held.shared()
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(
            cmd,
            env=worker_env(own_dir, warm_cache=warm, lock=lock),
            capture_output=True,
            text=True,
            timeout=args.timeout,
            cwd=REPO,
        )
    except subprocess.TimeoutExpired:
        return {"strategy": name, "error": f"timeout after {args.timeout}s"}
    finally:
        held.release()
        if not warm:
            shutil.rmtree(own_dir, ignore_errors=True)
    wall = time.perf_counter() - t0
    for line in reversed(proc.stdout.splitlines()):
        if line.startswith(MARKER):
            result = json.loads(line[len(MARKER) :])
            result.update(strategy=name, process_wall_s=wall, cache="warm" if cached else "cold")
            if args.verbose and proc.stderr.strip():
                print(proc.stderr, file=sys.stderr)
            return result
    tail = [ln for ln in proc.stderr.strip().splitlines() if ln.strip()][-1:] or ["no output"]
    return {"strategy": name, "error": f"worker exited rc={proc.returncode}: {tail[0]}"}


def progress_line(label: str, res: dict) -> str:
    head = f"[{label}] {res['strategy']:<24}"
    if "error" in res:
        return f"{head} ERROR: {res['error']}"
    parts = [
        f"{res['step_median_s'] * 1e3:8.1f} ms/step",
        f"first step {res['first_step_s']:6.1f} s ({res.get('cache', 'cold')})",
    ]
    if res.get("saved_bytes") is not None:
        parts.append(f"saved {res['saved_bytes'] / MiB:7.2f} MiB")
    parts += [f"peak {res['peak_bytes'] / MiB:7.2f} MiB", f"({res['process_wall_s']:.0f} s wall)"]
    return head + "  " + "  ".join(parts)


def run_rounds(names: list[str], cfg: dict, args, runs: list[dict], label: str = "") -> None:
    """Append one result per (round, strategy) to ``runs`` (in place, so an interrupt keeps them)."""
    failed: set[str] = set()
    caches = (
        {}
        if args.cold_every_round
        else {n: tempfile.mkdtemp(prefix=f"compare_{cfg['model']}_{cfg['size']}_{n}_") for n in names}
    )
    lock = tempfile.mkstemp(prefix="compare_lock_")[1] if args.jobs > 1 else None
    print_lock = threading.Lock()
    try:
        for rnd in range(1, args.repeats + 1):
            order = [n for n in names if n not in failed]
            random.Random(args.order_seed + rnd).shuffle(order)
            with ThreadPoolExecutor(max_workers=args.jobs) as pool:
                futures = [
                    pool.submit(spawn_worker, n, cfg, args, cache_dir=caches.get(n), lock=lock) for n in order
                ]
                for fut in as_completed(futures):
                    res = fut.result()
                    res["round"] = rnd
                    with print_lock:
                        runs.append(res)
                        print(
                            progress_line(f"{label}round {rnd}/{args.repeats}", res),
                            file=sys.stderr,
                            flush=True,
                        )
                    if "error" in res:
                        failed.add(res["strategy"])
    finally:
        for d in caches.values():
            shutil.rmtree(d, ignore_errors=True)
        if lock:
            os.unlink(lock)
