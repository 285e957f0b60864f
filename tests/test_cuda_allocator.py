"""The CUDA caching allocator's model (recompile_opt.costs.cuda_allocator) and the plan's peak in its blocks
(recompile_opt.costs.allocated, planning.in_allocator_blocks).

Expected figures follow by hand from the allocator's rules (torch's CUDACachingAllocator.cpp): requests
rounded to 512 B; the small pool (up to 1 MiB) in 2 MiB segments, split where 512 B remain; the large
pool in 20 MiB segments up to 10 MiB requests (else the request rounded to 2 MiB), a block split only
where more than 1 MiB remains; best fit; freed neighbours merged. Units are MiB.
"""

from __future__ import annotations

import pytest
from test_ilp import MiB
from test_inductor_peak import WRAPPER

from recompile_opt.costs import cuda_allocator as ca


def alloc(key, mib: float) -> tuple:
    return ("alloc", key, int(mib * MiB))


def test_requests_round_to_512_bytes_and_small_ones_share_segments():
    a = ca.CachingAllocator()
    a.malloc("x", 1)
    a.malloc("y", 513)
    assert a.allocated == 512 + 1024
    a.malloc("z", MiB)  # the small pool's largest request: in the 2 MiB segment's rest, split exactly
    assert a.allocated == 512 + 1024 + MiB


def test_a_large_block_is_split_only_where_more_than_a_mib_remains():
    a = ca.CachingAllocator()
    a.malloc("a", 3 * MiB)  # a 20 MiB segment: 3 taken, 17 left
    a.malloc("b", 16 * MiB)  # 17 MiB free: 1 MiB would remain, not more, so b holds all 17
    assert a.allocated == 20 * MiB
    a.free("a")
    a.malloc("c", int(1.5 * MiB))  # the 3 MiB hole: 1.5 MiB remain, more than 1: split
    assert a.allocated == int(18.5 * MiB)
    e = ca.CachingAllocator(ca.Settings(expandable_segments=True))
    e.malloc("a", 3 * MiB)
    e.malloc("b", 16 * MiB)  # expandable segments split every block
    assert e.allocated == 19 * MiB


def test_the_best_fitting_free_block_is_taken_and_freed_neighbours_merge():
    a = ca.CachingAllocator()
    for key, mib in (("a", 3), ("x", 1.5), ("b", 6), ("y", 1.5), ("rest", 8)):
        a.malloc(key, int(mib * MiB))  # one 20 MiB segment, in this order
    a.free("a")
    a.free("b")  # holes of 3 and 6 MiB
    a.malloc("c", int(2.5 * MiB))  # the 3 MiB hole (0.5 remains: not split), not the 6 MiB one
    assert a.allocated == (1.5 + 1.5 + 8 + 3) * MiB
    a.free("x")  # 1.5 MiB between the 3 MiB block (c) and the 6 MiB hole: merged into 7.5
    a.malloc("d", 7 * MiB)  # fits the merged 7.5 MiB hole alone (0.5 remains: not split)
    assert a.allocated == (1.5 + 8 + 3 + 7.5) * MiB


def test_a_request_below_max_split_size_takes_no_block_above_it():
    a = ca.CachingAllocator(ca.Settings(max_split_size=8 * MiB))
    a.malloc("big", 12 * MiB)  # its own 12 MiB segment
    a.free("big")
    a.malloc("small", 4 * MiB)  # the free 12 MiB block is oversize for it: a new 20 MiB segment
    a.malloc("big", 12 * MiB)  # takes the 12 MiB block again
    assert a.allocated == 16 * MiB and len(a.pools[False]) == 1  # one free block: the new segment's rest


def test_a_step_is_taken_in_steady_state_not_as_its_first_run():
    """First run: a (3) and b (9.75) in a new 20 MiB segment, c (10) in a new 10 MiB one: 22.75 MiB.
    Every later run finds both segments free: a takes the smaller (10 MiB, split), b the 20 MiB one
    (split, 10.25 left), c the 10.25 MiB rest whole: 23 MiB."""
    events = [alloc("a", 3), alloc("b", 9.75), alloc("c", 10)]
    assert ca.requested_peak(events) == int(22.75 * MiB)
    assert ca.step_peak(events) == 23 * MiB
    expandable = ca.step_peak(events, settings=ca.Settings(expandable_segments=True))
    assert expandable == ca.requested_peak(events)


def test_the_baseline_stays_allocated_and_its_segments_rest_is_used():
    """A 2 MiB parameter leaves 18 MiB of its 20 MiB segment free; a 17.5 MiB activation takes that
    block whole (0.5 MiB remains): 18 MiB above the step's start."""
    assert ca.step_peak([alloc("act", 17.5), ("free", "act")], baseline=[2 * MiB]) == 18 * MiB
    assert ca.step_peak([alloc("act", 0.5), ("free", "act")], baseline=[2 * MiB]) == MiB // 2


def test_settings_are_read_and_those_not_modelled_named():
    s = ca.parse("expandable_segments:True, max_split_size_mb:64,roundup_power2_divisions:4")
    assert s.expandable_segments and s.max_split_size == 64 * MiB
    assert s.unmodelled == ("roundup_power2_divisions",)
    assert ca.parse("", backend="cudaMallocAsync").unmodelled == ("backend:cudaMallocAsync",)
    assert ca.parse("garbage_collection_threshold:0.6") == ca.Settings()
    # settings that leave one step's blocks as they are, and the backend named in the string
    assert ca.parse("backend:native,release_lock_on_cudamalloc:True,pinned_num_register_threads:8") == (
        ca.Settings()
    )
    assert ca.parse("backend:cudaMallocAsync").unmodelled == ("backend:cudaMallocAsync",)
    assert ca.parse("backend:cudaMallocAsync", "cudaMallocAsync").unmodelled == ("backend:cudaMallocAsync",)


def test_the_settings_come_from_torch_or_the_environment(monkeypatch):
    import torch

    from recompile_opt import _torch_internals as ti

    getter = "_accelerator_getAllocatorSettings"
    monkeypatch.setattr(torch._C, getter, lambda: "expandable_segments:True", raising=False)
    assert ti.cuda_allocator_settings() == ("expandable_segments:True", "native")
    monkeypatch.delattr(torch._C, getter)  # torch 2.11: the environment
    monkeypatch.delenv("PYTORCH_ALLOC_CONF", raising=False)
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "max_split_size_mb:32")
    assert ti.cuda_allocator_settings() == ("max_split_size_mb:32", "native")


def test_the_walks_allocations_replay_its_peak():
    """The events a walk lists give back its peak (every buffer of the wrapper is a whole MiB): an
    input the caller held is no allocation of this walk; the fallback's third output is allocated with
    the other two and freed with the tuple."""
    from recompile_opt.costs import inductor_peak

    events: list = []
    peak = inductor_peak.walk(
        WRAPPER,
        inputs={"saved_a": "a", "saved_b": "b", "view_of_b": "b"},
        storage_bytes={"a": MiB, "b": MiB},
        sizes={"buf3": MiB, "buf4": MiB, "buf5": MiB},
        multi={"buf2": ["buf3", "buf4", "buf5"]},
        events=events,
        inherited={"a": ("forward", 0), "b": ("forward", 1)},
    )
    allocated = [e for e in events if e[0] == "alloc"]
    assert len(allocated) == 5  # buf0, buf3-5 together, buf7: a and b were the forward's
    frees = {e[1] for e in events if e[0] == "free"}
    assert {("forward", 0), ("forward", 1)} <= frees  # the saved inputs, freed after their last use
    forward = [alloc(("forward", 0), 1), alloc(("forward", 1), 1)]
    assert ca.requested_peak(forward + events) == peak


@pytest.mark.parametrize(
    ("options", "recorded"),
    [({"memory_budget": 0.5}, True), ({"memory_budget": 0.0, "chunks": False}, False)],
    ids=["0.5-compiled-code", "0.0-lowered-again"],
)
def test_a_plan_on_cuda_states_its_peak_in_the_allocators_blocks(monkeypatch, options, recorded):
    """Through Inductor (on the CPU, the graph taken for a CUDA one): the plan's predicted peak is the
    model's count of blocks for its walked step, the walk's figure beside it in the solver and the
    note; the walk's events give its peak back (rounded), and the blocks hold at least those bytes.
    Also where the compile's code was not recorded (a graph from Inductor's cache), the plan lowered
    again with Inductor's buffer pool as compiled (off at 0.0). A GPT of 1 MiB activations (1024
    tokens, h=256) so that large-pool blocks occur."""
    import contextlib

    import torch

    import recompile_opt
    from recompile_opt import _torch_internals as ti
    from recompile_opt.costs import allocated, measure
    from recompile_opt.models import GPT, GPTConfig, example_batch

    seen = []
    real = ca.step_peak
    monkeypatch.setattr(allocated, "on_cuda", lambda gm: True)
    if not recorded:
        monkeypatch.setattr(ti, "compiled_wrapper_code", lambda: contextlib.nullcontext([]))
    monkeypatch.setattr(ca, "step_peak", lambda ev, base, st: seen.append((ev, base)) or real(ev, base, st))
    cfg = GPTConfig(n_layer=1, n_head=4, n_embd=256, block_size=128, vocab_size=512, dropout=0.0)
    torch.manual_seed(0)
    model, inputs = GPT(cfg), example_batch(cfg, 8)
    torch._dynamo.reset()
    recompile_opt.reset_plans()
    compiled = torch.compile(model, backend="recompile_opt", options=options)
    with (  # compiled anew, whatever an earlier run left in the caches (a hit plans nothing)
        torch._functorch.config.patch(enable_autograd_cache=False),
        torch._inductor.config.patch(fx_graph_cache=False),
    ):
        compiled(*inputs).backward()
    model.zero_grad(set_to_none=True)
    measured = measure.peak_memory(lambda: compiled(*inputs).backward())
    plan = recompile_opt.last_plans()[-1]
    torch._dynamo.reset()

    assert plan.solver["peak_from"] == "inductor-code+cuda-allocator", plan.notes
    walked = plan.solver["walked_peak_bytes"]
    assert abs(walked / measured - 1) <= 0.005, (walked, measured)  # the CPU allocator counts requests
    ((events, baseline),) = seen
    n_allocs = sum(e[0] == "alloc" for e in events)
    assert 0 <= ca.requested_peak(events) - walked <= 512 * n_allocs
    assert plan.predicted_peak_bytes >= ca.requested_peak(events)
    assert len(baseline) == len(list(model.parameters())) + len(list(model.buffers())) + 2  # + idx, targets
    assert any(n.startswith("CUDA caching allocator: the code's requests peak at") for n in plan.notes)
    # the events are a step's: each buffer allocated once and freed at most once, after its allocation;
    # what is left at the end is what the step returns (the parameters' gradients)
    allocs = [e[1] for e in events if e[0] == "alloc"]
    frees = [e[1] for e in events if e[0] == "free"]
    assert len(set(allocs)) == len(allocs) and len(set(frees)) == len(frees)
    assert set(frees) <= set(allocs)
    where = {(e[0], e[1]): i for i, e in enumerate(events)}
    assert all(where["alloc", k] < where["free", k] for k in frees)
    left = sum(e[2] for e in events if e[0] == "alloc" and e[1] not in frees)
    grads = sum(p.numel() * p.element_size() for p in model.parameters())
    assert grads <= left <= grads + 512 * 4, (left, grads)
    _the_limit_and_a_second_reading(monkeypatch, plan, walked)


def _the_limit_and_a_second_reading(monkeypatch, plan, walked):
    """A ``peak_memory`` under the blocks names the walk and the blocks, and expandable_segments only
    where it is off; the blocks read in again keep the walk's figure (not the blocks' as the walk's)."""
    from recompile_opt import _torch_internals as ti
    from recompile_opt import planning
    from recompile_opt.options import Options

    blocks = plan.predicted_peak_bytes
    for conf, named in (("", True), ("expandable_segments:True", False)):
        monkeypatch.setattr(ti, "cuda_allocator_settings", lambda conf=conf: (conf, "native"))
        plan.notes[:] = []
        with pytest.warns(UserWarning, match="is not met") as caught:
            planning.check_limit(plan, Options(peak_memory=blocks - 1), None)
        (msg,) = [str(w.message) for w in caught]
        assert planning.fmt_bytes(walked) in msg and planning.fmt_bytes(blocks) in msg
        assert ("expandable_segments:True" in msg) == named, msg
    planning.in_allocator_blocks(plan, (blocks + MiB, "again"))
    assert plan.solver["walked_peak_bytes"] == walked and plan.predicted_peak_bytes == blocks + MiB
    assert sum(n.startswith(planning.ALLOCATOR_NOTE) for n in plan.notes) == 1


def test_a_plan_that_offloads_keeps_its_walked_peak():
    """Offload copies run on a stream of their own, which the one-stream model does not follow: the
    plan's blocks are not modelled, and its note says why (the walk's figure stands)."""
    from types import SimpleNamespace

    from recompile_opt import planning

    plan = SimpleNamespace(offloaded=[{"value": "mm"}])
    blocks, why = planning.allocator_blocks(plan, None, set(), {"offload:mm"}, None)
    assert blocks is None and "offload" in why
