"""Walks spread over forks of the process (recompile_opt/costs/walk_pool.py): the same answers as one by
one, and a fork that fails, dies or hangs leaves its walks to this process."""

from __future__ import annotations

import os
import time

import pytest
from helpers import forget_searches, tiny_gpt

from recompile_opt.costs import walk_pool

pytestmark = pytest.mark.skipif(not hasattr(os, "fork"), reason="walks are spread over forks")


def test_every_task_is_answered_in_its_place():
    tasks = list(range(7))
    found = walk_pool.map_forked(lambda t: (t * t, os.getpid()), lambda t: (t * t, os.getpid()), tasks, 3)
    assert {i: sq for i, (sq, _) in found.items()} == {i: i * i for i in tasks}
    here = {i for i, (_, pid) in found.items() if pid == os.getpid()}
    assert here == {0, 3, 6}  # the first share walked here, the others in two forks


def test_a_fork_that_raises_or_hangs_answers_nothing(monkeypatch):
    monkeypatch.setattr(walk_pool, "WAIT_MIN_S", 15.0)  # a fork answers within it on a busy machine

    def copy(t):
        if t == 1:
            raise RuntimeError("no walk here")
        if t == 2:
            time.sleep(300)
        return t

    start = time.perf_counter()
    found = walk_pool.map_forked(lambda t: t, copy, [0, 1, 2, 3], 4)
    assert found == {0: 0, 3: 3}
    assert time.perf_counter() - start < 120  # the hanging fork was killed


def test_the_number_of_processes_follows_the_variable(monkeypatch):
    monkeypatch.setenv(walk_pool.ENV, "1")
    assert walk_pool.workers() == 1
    monkeypatch.setenv(walk_pool.ENV, "3")
    assert walk_pool.workers() == 3


def _chunked_plan(monkeypatch, workers: str):
    import recompile_opt

    forget_searches(monkeypatch)
    monkeypatch.setenv(walk_pool.ENV, workers)
    model, inputs = tiny_gpt()
    plan = recompile_opt.plan(model, inputs, memory_budget=0.0, chunks={"loss": 2})
    return plan.saved_names(), plan.predicted_peak_bytes, plan.notes, plan.solver["exact_peaks"]


def test_a_chunked_graphs_wide_walks_give_the_plan_walked_one_by_one(monkeypatch):
    """The tiny GPT, its loss in 2 chunks, at 0.0: its plans of least simulated peak are walked
    (``least_peak._walked_widely``) in 2 processes, and the plan, its walked peak, its notes and its
    walk count are those of the walks one by one."""
    answered = []
    collect = walk_pool._collect
    monkeypatch.setattr(
        walk_pool, "_collect", lambda *a, **k: answered.append(collect(*a, **k)) or answered[-1]
    )
    spread = _chunked_plan(monkeypatch, "2")
    assert any(answered), "no walk was answered by a fork"
    assert spread == _chunked_plan(monkeypatch, "1")


@pytest.mark.slow
def test_walks_a_fork_could_not_make_are_made_here(monkeypatch):
    from recompile_opt.costs.simulator import PeakSimulator

    def fails(self, plan):
        raise RuntimeError("a fork that cannot lower")

    one_by_one = _chunked_plan(monkeypatch, "1")
    monkeypatch.setattr(PeakSimulator, "_walk_in_copy", fails)
    assert _chunked_plan(monkeypatch, "2") == one_by_one
