"""The planning step's contract (recompile_opt.planning): what a planning is asked is a frozen Request,
scoped to one compile, and what it remembers is the PlanningMemory value its caller passes in."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from helpers import tiny_mlp

from recompile_opt.compile_paths import compile_eager
from recompile_opt.costs import simulator
from recompile_opt.options import parse_options
from recompile_opt.partitioner import MEMORY, RecompilePartitioner
from recompile_opt.planner.memory import PlanningMemory
from recompile_opt.planning import Request


def _planned(options: dict, memory: PlanningMemory) -> RecompilePartitioner:
    """One training step's graph planned on the eager path by a partitioner with ``memory``."""
    model, inputs = tiny_mlp()
    part = RecompilePartitioner(parse_options({**options, "compiler": "eager"}), memory)
    torch._dynamo.reset()
    torch.compile(model, backend=lambda gm, ex: compile_eager(gm, ex, part))(*inputs).backward()
    return part


def test_what_planning_remembers_is_the_memory_value_passed_in(monkeypatch):
    """A graph's fraction range is searched once per memory: planned again with the same value, its
    search and simulations are reused; with a fresh one, searched again, to the same plan. The
    process's own memory is not touched."""
    monkeypatch.setattr(simulator, "_load", lambda key: None)  # nor what an earlier run left on disk
    before = (dict(MEMORY.range_ends), list(MEMORY.peaks))
    mine = PlanningMemory()
    first = _planned({"memory_budget": 0.5}, mine).plans[-1]
    assert mine.range_ends and mine.peaks and first.solver["simulations"] > 0
    again = _planned({"memory_budget": 0.5}, mine).plans[-1]
    fresh = _planned({"memory_budget": 0.5}, PlanningMemory()).plans[-1]
    assert again.solver["simulations"] == 0 < fresh.solver["simulations"], (again.solver, fresh.solver)
    for plan in (again, fresh):
        assert (plan.saved_names(), plan.recomputed_names()) == (
            first.saved_names(),
            first.recomputed_names(),
        )
    assert (dict(MEMORY.range_ends), list(MEMORY.peaks)) == before


def test_a_request_is_a_frozen_value_asked_for_one_compile():
    """The partitioner is asked a request for the span of a block, then is back to what it was asked
    before; the request itself cannot be changed."""
    part = RecompilePartitioner(parse_options({"compiler": "eager"}), PlanningMemory())
    with part.asked(chunked=True, walk_every_plan=True):
        assert part.request == Request(chunked=True, walk_every_plan=True)
        with part.asked(compiling=True):
            assert part.request.chunked and part.request.compiling
        assert not part.request.compiling
    assert part.request == Request()
    with pytest.raises(dataclasses.FrozenInstanceError):
        part.request.chunked = True
