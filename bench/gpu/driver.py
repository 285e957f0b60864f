"""The driver's side: every case in a fresh interpreter, a pool of them at once, a timeout each.

Why fresh processes: Dynamo, Inductor and the CUDA allocator keep global state (compiled graphs, config,
peak counters, cached blocks), so a second case in one process would inherit the first's. Cases whose
options come from another's result (``needs``) start once that one has ended. Starts and compiles
overlap; every timed section holds the lock file exclusively (``comparison.joblock``), so it runs
alone. Performance and profile cases get a private, empty Inductor cache (their first call is a cold
compile); the others share the caller's.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from concurrent.futures import FIRST_COMPLETED, ThreadPoolExecutor, wait
from pathlib import Path

from comparison.joblock import LOCK_ENV

from .cases import case_name, fill_needs
from .worker import MARKER

# a worker's environment: the wall time (time.time()) at which the driver stops it (bench/gpu/timing.py)
STOP_ENV = "GPU_CHECK_STOP_AT"
SCRIPT = Path(__file__).resolve().parents[1] / "gpu_check.py"


def worker_command(case: dict, args) -> list[str]:
    return [
        sys.executable,
        str(SCRIPT),
        "--worker",
        json.dumps(case),
        "--device",
        args.device,
        "--compiler",
        args.compiler,
    ] + (["--tiny"] if args.tiny else [])


def spawn(case: dict, args, *, lock: str, timeout: float | None = None) -> dict:
    """Run one case in a fresh interpreter (stopped after ``timeout`` s, default ``args.timeout``): its
    result dict, with ``wall_s``; ``error`` on a timeout, a crash or a failure inside the case."""
    timeout = args.timeout if timeout is None else timeout
    env = dict(os.environ, **{LOCK_ENV: lock, STOP_ENV: str(time.time() + timeout)})
    own_cache = case["part"] in ("performance", "profile")
    if own_cache:
        env["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp(prefix="gpu_check_inductor_")
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(
            worker_command(case, args), env=env, capture_output=True, text=True, timeout=timeout
        )
    except subprocess.TimeoutExpired:
        return {"error": f"timeout after {timeout:.0f} s", "wall_s": time.perf_counter() - t0}
    finally:
        if own_cache:
            shutil.rmtree(env["TORCHINDUCTOR_CACHE_DIR"], ignore_errors=True)
    wall = time.perf_counter() - t0
    for line in reversed(proc.stdout.splitlines()):
        if line.startswith(MARKER):
            result = json.loads(line[len(MARKER) :])
            if "error" in result and args.verbose:
                print(proc.stderr, file=sys.stderr)
            return {**result, "wall_s": wall}
    tail = [ln for ln in proc.stderr.strip().splitlines() if ln.strip()][-1:] or ["no output"]
    return {"error": f"worker exited rc={proc.returncode}: {tail[0][:300]}", "wall_s": wall}


def run_cases(cases: list[dict], args) -> dict[str, dict]:
    """Every case's result by :func:`case_name`, in the order of ``cases``. At most ``args.jobs`` run at
    once, performance and profile first; a case with ``needs`` starts as soon as the case it needs has
    ended, its options filled in from that result. Past ``args.deadline`` seconds no case starts and a
    running one is stopped, so the report is always written; each result is also appended to
    ``args.results`` (JSON lines) as it lands, for a run cut short from outside."""
    t_end = time.perf_counter() + (args.deadline or float("inf"))
    results: dict[str, dict] = {}
    ready = sorted((c for c in cases if not c.get("needs")), key=_priority)
    waiting = [c for c in cases if c.get("needs")]
    fd, lock = tempfile.mkstemp(prefix="gpu_check_lock_")
    os.close(fd)
    try:
        with ThreadPoolExecutor(max_workers=max(1, args.jobs)) as pool:
            running: dict = {}
            while ready or running:
                while ready and len(running) < max(1, args.jobs):
                    case = ready.pop(0)
                    left = t_end - time.perf_counter()
                    if left < MIN_CASE_S:
                        _record(
                            results, case, {"error": "not started: the run's --deadline", "wall_s": 0.0}, args
                        )
                        continue
                    running[pool.submit(spawn, case, args, lock=lock, timeout=min(args.timeout, left))] = case
                done, _ = wait(running, return_when=FIRST_COMPLETED)
                for fut in done:
                    _record(results, running.pop(fut), fut.result(), args)
                for case in [c for c in waiting if c["needs"] in results]:
                    waiting.remove(case)
                    filled = fill_needs(case, results)
                    if isinstance(filled, str):
                        _record(results, case, {"error": filled, "wall_s": 0.0}, args)
                    else:
                        ready = sorted(ready + [filled], key=_priority)
        for case in waiting:
            _record(
                results, case, {"error": f"needs {case['needs']}, which did not run", "wall_s": 0.0}, args
            )
    finally:
        os.unlink(lock)
    return {case_name(c): results[case_name(c)] for c in cases if case_name(c) in results}


# a case is not started with less than this many seconds before the deadline: it could not compile
MIN_CASE_S = 20.0


def _priority(case: dict) -> bool:
    """Sort key: performance and profile cases first (their long compiles overlap the others')."""
    return case["part"] not in ("performance", "profile")


def _record(results: dict, case: dict, res: dict, args) -> None:
    """Keep one case's result, print its line, and append it to ``args.results`` when set."""
    results[case_name(case)] = {"case": case, **res}
    state = f"ERROR {res['error']}" if "error" in res else "ok"
    print(f"[gpu_check] {case_name(case):<48} {res['wall_s']:6.1f} s  {state}", file=sys.stderr, flush=True)
    if getattr(args, "results", None):
        with open(args.results, "a") as fh:
            fh.write(json.dumps({"name": case_name(case), "case": case, **res}, default=str) + "\n")
