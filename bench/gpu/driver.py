"""The driver's side: every case in a fresh interpreter, a pool of them at once, a timeout each.

Why fresh processes: Dynamo, Inductor and the CUDA allocator keep global state (compiled graphs, config,
peak counters, cached blocks), so a second case in one process would inherit the first's. Cases whose
options come from another's result (``needs``) run in a second wave. Starts and compiles overlap; every
timed section holds the lock file exclusively (``comparison.joblock``), so it runs alone. Performance
and profile cases get a private, empty Inductor cache (their first call is a cold compile); the others
share the caller's.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from comparison.joblock import LOCK_ENV

from .cases import case_name, fill_needs
from .worker import MARKER

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


def spawn(case: dict, args, *, lock: str) -> dict:
    """Run one case in a fresh interpreter: its result dict, with ``wall_s``; ``error`` on a timeout,
    a crash or a failure inside the case."""
    env = dict(os.environ, **{LOCK_ENV: lock})
    own_cache = case["part"] in ("performance", "profile")
    if own_cache:
        env["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp(prefix="gpu_check_inductor_")
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(
            worker_command(case, args), env=env, capture_output=True, text=True, timeout=args.timeout
        )
    except subprocess.TimeoutExpired:
        return {"error": f"timeout after {args.timeout} s", "wall_s": time.perf_counter() - t0}
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
    """Every case's result by :func:`case_name`, in the order of ``cases``: those without ``needs`` run
    first (``args.jobs`` at a time), then the rest with their options filled in from the first wave's."""
    results: dict[str, dict] = {}
    fd, lock = tempfile.mkstemp(prefix="gpu_check_lock_")
    os.close(fd)
    try:
        # the long compiles first: their timed sections wait for every other case to finish anyway
        first = sorted(
            (c for c in cases if not c.get("needs")),
            key=lambda c: c["part"] not in ("performance", "profile"),
        )
        _run_wave(first, args, lock, results)
        second = []
        for case in cases:
            if case.get("needs"):
                filled = fill_needs(case, results)
                if isinstance(filled, str):
                    results[case_name(case)] = {"case": case, "error": filled}
                else:
                    second.append(filled)
        _run_wave(second, args, lock, results)
    finally:
        os.unlink(lock)
    return {case_name(c): results[case_name(c)] for c in cases if case_name(c) in results}


def _run_wave(cases: list[dict], args, lock: str, results: dict) -> None:
    """Run ``cases`` in a pool; each result (with its case) goes into ``results`` as it ends."""

    def one(case):
        res = spawn(case, args, lock=lock)
        results[case_name(case)] = {"case": case, **res}
        state = f"ERROR {res['error']}" if "error" in res else "ok"
        print(
            f"[gpu_check] {case_name(case):<48} {res['wall_s']:6.1f} s  {state}", file=sys.stderr, flush=True
        )

    with ThreadPoolExecutor(max_workers=max(1, args.jobs)) as pool:
        list(pool.map(one, cases))
