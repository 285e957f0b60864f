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
    generation): each row has a first call, a step time, a peak and a loss."""
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
    for row in rows:
        assert all(number.match(cell) for cell in row[1:5]), row
        assert row[-1] == "ok", row
    assert number.match(rows[2][5]) and number.match(rows[2][6])  # ours: the estimated step and its ratio
