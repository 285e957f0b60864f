"""Walks spread over forks of the process (recompile_opt/costs/walk_pool.py): the same answers as one by
one, and a fork that fails, dies or hangs leaves its walks to this process."""

from __future__ import annotations

import os
import threading
import time

import pytest
import torch
from helpers import forget_searches, tiny_gpt

from recompile_opt.costs import scratch, walk_pool

pytestmark = pytest.mark.skipif(not hasattr(os, "fork"), reason="walks are spread over forks")


def test_every_task_is_answered_in_its_place():
    tasks = list(range(7))
    found = walk_pool.map_forked(lambda t: (t * t, os.getpid()), lambda t: (t * t, os.getpid()), tasks, 3)
    assert {i: sq for i, (sq, _) in found.items()} == {i: i * i for i in tasks}
    here = {i for i, (_, pid) in found.items() if pid == os.getpid()}
    assert here == {0, 3, 6}  # the first share walked here, the others in two forks


def test_a_fork_that_raises_or_hangs_answers_nothing_and_says_why(monkeypatch):
    monkeypatch.setattr(walk_pool, "WAIT_MIN_S", 15.0)  # a fork answers within it on a busy machine

    def copy(t):
        if t == 1:
            raise RuntimeError("no walk here")
        if t == 2:
            time.sleep(300)
        return t

    start = time.perf_counter()
    failures = []
    found = walk_pool.map_forked(lambda t: t, copy, [0, 1, 2, 3], 4, failures)
    assert found == {0: 0, 3: 3}
    assert time.perf_counter() - start < 120  # the hanging fork was killed
    assert failures == ["it raised RuntimeError('no walk here')", "it did not answer in time"]


def test_a_fork_sends_no_kernel_to_this_processs_compile_workers():
    """Inductor's compile workers are this process's (a fork holds copies of their pipes): a fork
    walks with ``compile_threads`` 1, so that no kernel it generates is sent to them."""
    from torch._inductor import config as inductor_config

    with inductor_config.patch(compile_threads=4):
        found = walk_pool.map_forked(
            lambda t: inductor_config.compile_threads, lambda t: inductor_config.compile_threads, [0, 1], 2
        )
    assert found == {0: 4, 1: 1}


def test_where_cuda_is_initialised_a_fork_walks_without_initialising_it(monkeypatch):
    """Where CUDA was initialised in this process, torch refuses to initialise it in a fork; the fork
    skips that (its device figures were read before forking). Here the stand-in state says so on a
    CPU: a call that initialises CUDA lazily returns in the fork, and raises without that state."""
    from recompile_opt import _torch_internals as ti

    def lazy_init(t):
        torch.cuda._lazy_init()
        return "initialised"

    failures = []
    monkeypatch.setattr(ti, "before_forking_walkers", lambda: {})  # as on a CPU, also on a GPU host
    assert walk_pool.map_forked(lambda t: None, lazy_init, [0, 1], 2, failures) == {0: None}
    assert len(failures) == 1 and "raised" in failures[0]
    monkeypatch.setattr(ti, "before_forking_walkers", lambda: {"cuda_device": 0})
    assert walk_pool.map_forked(lambda t: None, lazy_init, [0, 1], 2) == {0: None, 1: "initialised"}


def test_after_a_fork_fails_with_cuda_initialised_walks_stay_here(monkeypatch):
    from recompile_opt import _torch_internals as ti

    monkeypatch.setattr(ti, "_CUDA_FORK_FAILED", threading.Event())
    monkeypatch.setenv(walk_pool.ENV, "3")
    ti.fork_failed()  # CUDA not initialised: forks go on
    assert walk_pool.workers() == 3
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(ti, "before_forking_walkers", lambda: {})
    assert walk_pool.workers() == 3
    # a workspace left to this process, or a graph no process could walk: forks go on
    for why in (scratch.NotMeasuredHere("sdpa"), RuntimeError("no lowering for this op")):

        def copy(t, why=why):
            raise why

        assert walk_pool.map_forked(lambda t: t, copy, [0, 1], 2) == {0: 0}
        assert walk_pool.workers() == 3
    # a fork that meets CUDA: none is made again
    walk_pool.map_forked(lambda t: t, lambda t: (_ for _ in ()).throw(RuntimeError("CUDA error")), [0, 1], 2)
    assert walk_pool.workers() == 1


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
    return plan.saved_names(), plan.predicted_peak_bytes, plan.notes, plan.solver["exact_peaks"], plan


def test_a_chunked_graphs_wide_walks_give_the_plan_walked_one_by_one(monkeypatch):
    """The tiny GPT, its loss in 2 chunks, at 0.0: its plans of least simulated peak are walked
    (``least_peak._walked_widely``) in 2 processes, and the plan, its walked peak, its notes and its
    walk count are those of the walks one by one."""
    answered = []
    collect = walk_pool._collect
    monkeypatch.setattr(
        walk_pool, "_collect", lambda *a, **k: answered.append(collect(*a, **k)) or answered[-1]
    )
    *spread, plan = _chunked_plan(monkeypatch, "2")
    assert any(answered), "no walk was answered by a fork"
    *one_by_one, alone = _chunked_plan(monkeypatch, "1")
    assert spread == one_by_one
    # the plan says how many of its walks forks made
    assert 0 < plan.solver["walked_in_forks"] <= plan.solver["exact_peaks"]
    assert f"({plan.solver['walked_in_forks']} in forks)" in plan.summary()
    assert alone.solver["walked_in_forks"] == 0 and "in forks" not in alone.summary()


@pytest.mark.slow
def test_walks_a_fork_could_not_make_are_made_here(monkeypatch):
    from recompile_opt.costs.simulator import PeakSimulator

    def fails(self, plan):
        raise RuntimeError("a fork that cannot lower")

    *one_by_one, _ = _chunked_plan(monkeypatch, "1")
    monkeypatch.setattr(PeakSimulator, "_walk_in_copy", fails)
    saved, peak, notes, walks, plan = _chunked_plan(monkeypatch, "2")
    # the plan says so in a note of its own
    failed = [n for n in notes if n.startswith("walks: ")]
    assert [saved, peak, [n for n in notes if n not in failed], walks] == one_by_one
    assert len(failed) == 1 and "RuntimeError('a fork that cannot lower')" in failed[0], notes
    assert plan.solver["walked_in_forks"] == 0
