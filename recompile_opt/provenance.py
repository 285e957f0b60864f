"""One header line for every measured table: the versions, the machine and the date it was made on;
and the hash of this package's code, which keys every cache of figures it computed (plans, peaks).

Why: docs/ holds tables written by the command above each; a reader must tell a measured figure from
prose and know whether a figure could still hold on their setup, without a commit hash or time of day.
"""

from __future__ import annotations

import datetime
import functools
import importlib.metadata
import os
import platform
from pathlib import Path


@functools.cache
def code_hash() -> str:
    """A hash of every source file of the package and of ``passes``: a cached plan or peak is only
    reused by the code that computed it."""
    from recompile_opt import _torch_internals as ti

    return ti.get_hash_for_files(source_files()).hex()[:16]


def source_files() -> tuple[str, ...]:
    """Every source file :func:`code_hash` covers: the package's, sub-packages included, and ``passes``."""
    from recompile_opt import passes

    files = sorted([*Path(__file__).parent.rglob("*.py"), *Path(passes.__file__).parent.glob("*.py")])
    return tuple(str(f) for f in files)


def _version(package: str) -> str:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return "-"


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def header_line(*, device: str | None = None) -> str:
    """E.g. ``torch 2.13.0+cpu, Python 3.11.7, recompile_opt 0.1.0, highspy 1.15.1, PuLP 3.3.0; CPU:
    2 cores (AMD EPYC ...), Linux x86_64, load 1.9; 2026-11-25``. ``device``: the accelerator, if one ran."""
    import torch

    load = f", load {os.getloadavg()[0]:.1f}" if hasattr(os, "getloadavg") else ""
    machine = device or f"CPU: {os.cpu_count()} cores ({_cpu_name()})"
    return (
        f"torch {torch.__version__}, Python {platform.python_version()}, recompile_opt "
        f"{_version('recompile_opt')}, highspy {_version('highspy')}, PuLP {_version('pulp')}; "
        f"{machine}, {platform.system()} {platform.machine()}{load}; {datetime.date.today().isoformat()}"
    )
