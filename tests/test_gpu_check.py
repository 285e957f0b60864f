"""The GPU check's tooling, run on the CPU: bench/gpu_check.py's tiny CPU run writes a document whose rows
all pass. (The offline install of the package's wheel, as bench/gpu_install.sh makes it on the GPU
machine, is tests/test_install.py.)

The downloads of bench/fetch_wheels.sh are not run here (a test stays offline)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
CHECK = REPO / "bench" / "gpu_check.py"


def _run(cmd: list[str], *, timeout: int, **kw) -> subprocess.CompletedProcess:
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, **kw)
    assert proc.returncode == 0, (
        f"{cmd} exited {proc.returncode}:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}"
    )
    return proc


def _table_rows(doc: str, heading: str) -> list[list[str]]:
    """The body rows of the first table after ``heading``, as cells."""
    section = doc.split(heading, 1)[1].split("\n## ", 1)[0]
    first = section[section.index("\n| ") :].split("\n\n", 1)[0]
    lines = [ln for ln in first.splitlines() if ln.startswith("| ")]
    return [[c.strip() for c in ln.strip("|").split(" | ")] for ln in lines[1:]]


def test_the_tiny_cpu_check_passes_every_row(tmp_path):
    """Correctness and fidelity of the tiny GPT, fp32, at three options (one needs another's predicted
    peak), without code generation: every row passes or is measured, the header names the machine."""
    out = tmp_path / "gpu.md"
    _run(
        [
            sys.executable,
            str(CHECK),
            "--device",
            "cpu",
            "--tiny",
            "--compiler",
            "eager",
            "--parts",
            "correctness,fidelity",
            "--models",
            "gpt",
            "--dtypes",
            "fp32",
            "--options",
            "0.0,peak,full",
            "--out",
            str(out),
        ],
        timeout=600,
    )
    doc = out.read_text()
    for field in ("| device | cpu |", "| driver / CUDA |", "| torch |", "| Triton |", "| recompile_opt |"):
        assert field in doc
    correct = _table_rows(doc, "## Correctness")
    assert [r[2].split()[0] for r in correct] == ["0.0", "peak", "full"]
    assert all(r[6] == "pass" for r in correct), doc
    fidelity = _table_rows(doc, "## Fidelity")
    assert len(fidelity) == 3 and all(r[-1] == "ok" for r in fidelity), doc
    assert all(float(r[3]) > 0 and float(r[4]) > 0 for r in fidelity)


@pytest.mark.slow
def test_the_tiny_performance_part_measures_each_strategy(tmp_path):
    """Three strategies on the tiny performance GPT (plain compiles through aot_eager, ours without code
    generation): each row has a first call, a step time, a peak and a loss; ours its planning time."""
    out = tmp_path / "gpu.md"
    _run(
        [
            sys.executable,
            str(CHECK),
            "--device",
            "cpu",
            "--tiny",
            "--compiler",
            "eager",
            "--parts",
            "performance",
            "--strategies",
            "eager,compile,ours-none",
            "--out",
            str(out),
        ],
        timeout=600,
    )
    rows = _table_rows(out.read_text(), "## Performance")
    assert [r[0] for r in rows] == ["eager", "compile", "ours-none"]
    number = re.compile(r"^-?\d+(\.\d+)?$")
    for row in rows:  # first call, step, peak and loss
        assert all(number.match(row[i]) for i in (1, 3, 4, 5)), row
        assert row[-1] == "ok", row
    assert number.match(rows[2][6]) and number.match(rows[2][7])  # ours: the estimated step and its ratio
    # ours: its planning's seconds, walks and those made in forks (the eager compiler walks none)
    assert re.match(r"^\d+\.\d \(0, 0 in forks\)$", rows[2][2]) and rows[0][2] == rows[1][2] == "", rows


def _joblock():
    """bench/comparison/joblock.py's JobLock (bench/ is not on the path of the tests)."""
    sys.path.insert(0, str(REPO / "bench"))
    try:
        from comparison.joblock import JobLock
    finally:
        sys.path.remove(str(REPO / "bench"))
    return JobLock


def test_a_timed_section_waits_a_bounded_time_and_never_beside_another(tmp_path):
    """With a wait limit (a run with ``--deadline``), a timed section that cannot have the lock alone
    runs after the limit, beside the compile, but still one timed section at a time: on the first GPU
    run every section gave up at once and all ran together (steps 10x slower)."""
    import threading
    import time

    JobLock = _joblock()
    path = str(tmp_path / "lock")
    compiling = JobLock(path)
    compiling.shared()  # another case still compiling
    spans, alone_flags = [], []

    def timed_section():
        lock = JobLock(path)
        lock.shared()
        with lock.exclusive(0.3) as alone:
            start = time.monotonic()
            time.sleep(0.3)
            spans.append((start, time.monotonic()))
            alone_flags.append(alone)
        lock.release()

    threads = [threading.Thread(target=timed_section) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert alone_flags == [False, False, False]  # the compile held on past every wait limit
    spans.sort()
    assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:])), spans  # one at a time
    compiling.release()
    lock = JobLock(path)
    lock.shared()
    with lock.exclusive(0.3) as alone:
        assert alone  # nothing else holds the lock: alone at once
