"""ILP solutions kept on disk by the model they solve, for the plannings of later processes.

A planning that walks its candidates finds their peaks on disk the next time (``costs/simulator.py``);
its ILP solves were then what a new process planning the same graph paid again: a restart, another
budget of the same graph (the range's ends are solved for every fraction), each rank of a node, a test
run's many plannings of one model. Here each solve's answer is kept under a key of everything the
model is built from (every field of the problem but its ``info``, which only the Plan reads; the
budget, solver, limits and goal; the package's code; the solver's version), so a stored answer is the
one the solver gave that model, never one of another.

Kept only within :func:`kept_in` (the planning holds it around a planning, with the directory beside
Inductor's caches): direct ``ilp.solve`` calls neither read nor write. A time-limited solve's answer is
kept like any other: the next planning takes the same plan, as it would its peaks.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import hashlib
import importlib.metadata
import os
from pathlib import Path

from recompile_opt import kept_files
from recompile_opt.planner.problem import Problem, Value

_VALUE_FIELDS = tuple(f.name for f in dataclasses.fields(Value) if f.name != "info")
_PROBLEM_FIELDS = tuple(f.name for f in dataclasses.fields(Problem) if f.name != "values")

# (directory, salt) while a planning keeps its solves; a module global, not a context variable: the
# solves run on the search's and HiGHS's pool threads, which do not inherit context variables
_KEPT: tuple[Path, str] | None = None


@contextlib.contextmanager
def kept_in(directory: str | os.PathLike, salt: str):
    """Within the block, :func:`recall` and :func:`keep` use ``directory``; ``salt``: the code that builds
    the model (the package's hash), so another version's answers are never read."""
    global _KEPT
    before, _KEPT = _KEPT, (Path(directory), salt + _solver_versions())
    try:
        yield
    finally:
        _KEPT = before


def model_key(problem: Problem, asked: tuple) -> str | None:
    """The key of the model ``problem`` and ``asked`` (budget, solver, limits, goal) build; None outside
    :func:`kept_in`. A field's repr, so a set in it (ordered by the hash seed) can only miss."""
    if _KEPT is None:
        return None
    values = [tuple(getattr(v, f) for f in _VALUE_FIELDS) for v in problem.values.values()]
    rest = [getattr(problem, f) for f in _PROBLEM_FIELDS]
    blob = repr((values, rest, asked, _KEPT[1]))
    return hashlib.sha256(blob.encode()).hexdigest()


def recall(key: str | None) -> dict | None:
    """The answer kept under ``key`` (as :func:`keep` was given it), or None."""
    path = _path(key)
    return None if path is None else kept_files.read_json(path)


def keep(key: str | None, answer: dict) -> None:
    """Keep ``answer`` (JSON-able) under ``key``; written whole or not at all (another rank or test
    worker may read it at once). An answer that cannot be written is only not kept."""
    path = _path(key)
    if path is not None:
        kept_files.write_json(path, answer)


def _path(key: str | None) -> Path | None:
    if key is None or _KEPT is None:
        return None
    directory, salt = _KEPT
    return directory / hashlib.sha256(salt.encode()).hexdigest()[:12] / f"{key[:32]}.json"


@functools.cache
def _solver_versions() -> str:
    """PuLP's and highspy's versions: another release may break a tie another way."""
    found = []
    for package in ("pulp", "highspy"):
        try:
            found.append(importlib.metadata.version(package))
        except importlib.metadata.PackageNotFoundError:
            found.append("-")
    return "/".join(found)
