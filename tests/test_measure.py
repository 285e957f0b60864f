"""Exact-unit tests of recompile_opt.costs.measure against hand-computed byte counts.

All shapes are multiples of a 512x512 fp32 block, which is exactly 1 MiB, so
expected values read as small integers of MiB.
"""

import gc
import os
import resource
import sys

import pytest
import torch
import torch.nn as nn

from recompile_opt.costs.measure import (
    SavedTensorsMeter,
    allocation_timeline,
    memory_profile,
    peak_memory,
    process_high_water_mark,
    saved_bytes,
    saved_report,
    step_time,
    storage_ptrs,
)

MiB = 1 << 20
N = 512  # N x N fp32 = 1 MiB


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


def test_unit_block_is_one_mib():
    assert torch.empty(N, N).untyped_storage().nbytes() == MiB


def test_relu_matmul_saved_bytes():
    # mm saves x (needed for dL/dw; w is not saved because x needs no grad),
    # relu saves its output, sum saves only sizes: 1 + 1 MiB.
    x = torch.randn(N, N)
    w = torch.randn(N, N, requires_grad=True)
    assert saved_bytes(lambda: torch.relu(x @ w).sum(), exclude=[w]) == 2 * MiB
    # excluding the input too leaves only the relu output
    assert saved_bytes(lambda: torch.relu(x @ w).sum(), exclude=[w, x]) == 1 * MiB


def test_parameters_excluded():
    # both operands need grad, so mm saves both x and w
    x = torch.randn(N, N, requires_grad=True)
    w = nn.Parameter(torch.randn(N, N))
    fn = lambda: torch.relu(x @ w).sum()  # noqa: E731
    assert saved_bytes(fn) == 3 * MiB
    assert saved_bytes(fn, exclude=[w]) == 2 * MiB
    report, _ = saved_report(fn, exclude=[w])
    assert report.n_excluded == 1


def test_excluded_by_storage_covers_views_of_parameters():
    w = nn.Parameter(torch.randn(N, N))
    x = torch.randn(N, N, requires_grad=True)
    # x @ w.t() saves the view w.t(), whose storage is w's
    assert saved_bytes(lambda: (x @ w.t()).sum(), exclude=[w]) == 1 * MiB


def test_views_of_one_buffer_counted_once():
    y = torch.randn(2, N, N, requires_grad=True)

    def fn():
        b = y * 2  # mul by a Python scalar saves no tensor
        return (b[0] * b[1]).sum()  # saves the views b[0], b[1] of b's 2 MiB storage

    report, _ = saved_report(fn)
    assert report.total_bytes == 2 * MiB
    assert report.n_packed == 2
    assert len(report.breakdown) == 1
    shape, dtype, nbytes = report.breakdown[0]
    assert (shape, dtype, nbytes) == ((N, N), torch.float32, 2 * MiB)


def test_two_layer_mlp_by_hand():
    # Linear -> ReLU -> Linear on a no-grad input, parameters excluded:
    # linear1 saves x (1 MiB); relu saves h (1 MiB); linear2 saves h again
    # (same storage, deduplicated) and its weight (a parameter).
    model = nn.Sequential(nn.Linear(N, N), nn.ReLU(), nn.Linear(N, N))
    x = torch.randn(N, N)
    assert saved_bytes(lambda: model(x).sum(), exclude=[model]) == 2 * MiB
    report, loss = saved_report(lambda: model(x).sum(), exclude=[model])
    assert report.n_packed == 4 and report.n_excluded == 1
    loss.backward()  # the graph is intact: the hooks return tensors unchanged
    assert model[0].weight.grad is not None


def test_meter_context_and_nonlinear_ignored():
    x = torch.randn(N, N, requires_grad=True)
    with SavedTensorsMeter(exclude=storage_ptrs(x)) as meter:
        loss = torch.exp(x).sum()  # exp saves its result (1 MiB)
        empty = torch.zeros(0, requires_grad=True)
        (empty * 3.0).sum()
    assert meter.total_bytes == 1 * MiB
    loss.backward()
    assert torch.allclose(x.grad, torch.exp(x))


def test_checkpoint_saves_only_its_inputs():
    from torch.utils.checkpoint import checkpoint

    model = nn.Sequential(nn.Linear(N, N), nn.ReLU(), nn.Linear(N, N))
    x = torch.randn(N, N, requires_grad=True)
    fn = lambda: checkpoint(model, x, use_reentrant=False).sum()  # noqa: E731
    assert saved_bytes(fn, exclude=[model]) == 1 * MiB  # just x


def test_peak_memory_known_pattern():
    def step():
        a = torch.empty(N, N)  # 1
        b = torch.empty(2 * N, N)  # 3
        del a  # 2
        c = torch.empty(N // 2, N)  # 2.5
        d = torch.empty(N, N)  # 3.5  <- peak
        del b, c, d

    report = memory_profile(step)
    assert report.peak_bytes == pytest.approx(3.5 * MiB, abs=4096)
    assert report.end_bytes == 0


def test_memory_profile_prints_no_usdt_lines(capfd, monkeypatch):
    """Kineto writes 'USDT: ... profiler_start' / 'profiler_stop' to fd 2 at each profiler start and
    stop; the demo printed them into its table. memory_profile's output holds none of them. Not every
    Kineto build writes them, so the profiler's start and stop here write one each on top of Kineto's
    (the test then sees what it claims to remove on every machine)."""
    from torch.profiler import profile

    for method in ("start", "stop"):
        real = getattr(profile, method)

        def noisy(self, real=real, method=method):
            os.write(
                2, f"USDT:2026-11-25 1:1 SyncActivityProfilerHandler.cpp:52] profiler_{method}\n".encode()
            )
            return real(self)

        monkeypatch.setattr(profile, method, noisy)
    assert memory_profile(lambda: torch.ones(N, N).sum()).peak_bytes == pytest.approx(MiB, abs=4096)
    out, err = capfd.readouterr()
    assert "USDT" not in err and "profiler_" not in err and "USDT" not in out, err


def test_usdt_filter_writes_back_every_other_line(capfd):
    """What fd 2 receives around the profiler's start and stop, other than Kineto's USDT lines (an
    error, say), still reaches fd 2."""
    from recompile_opt.costs.measure import _without_usdt_lines

    with _without_usdt_lines():
        os.write(2, b"USDT:2026-11-25 11049:11049 SyncActivityProfilerHandler.cpp:52] profiler_start\n")
        os.write(2, b"ERROR: something Kineto says\n")
    assert capfd.readouterr().err == "ERROR: something Kineto says\n"


def test_allocation_timeline_lists_the_counted_events_in_order():
    def step():
        a = torch.empty(N, N)
        b = torch.empty(2 * N, N)
        del a
        c = torch.empty(N // 2, N)
        del b, c

    assert allocation_timeline(step) == [MiB, 2 * MiB, -MiB, MiB // 2, -2 * MiB, -MiB // 2]


def test_peak_memory_matmul_chain():
    x, w = torch.randn(N, N), torch.randn(N, N)

    def chain():
        y = x @ w
        for _ in range(4):
            y = y @ w  # new result allocated before the old one is dropped
        return y

    assert peak_memory(chain) == pytest.approx(2 * MiB, abs=64 * 1024)


def test_peak_memory_forward_backward():
    # forward: mm out (1) -> relu out (2) -> mm out freed (1) + loss scalar;
    # backward: relu grad (2) -> relu out released -> w.grad (2), so peak 2 MiB.
    x = torch.randn(N, N)
    w = torch.randn(N, N, requires_grad=True)

    def step():
        torch.relu(x @ w).sum().backward()

    report = memory_profile(step)
    assert report.peak_bytes == pytest.approx(2 * MiB, abs=4096)
    assert report.end_bytes == 1 * MiB  # w.grad stays


def test_peak_memory_ignores_frees_of_older_blocks():
    # The CPU allocator cannot size blocks allocated before profiling started,
    # so their frees are not recorded: the balance never dips below baseline.
    holder = [torch.empty(N, N)]

    def step():
        holder.clear()
        gc.collect()
        torch.empty(N, N)  # 1 MiB allocated and freed inside the step

    report = memory_profile(step)
    assert report.peak_bytes == MiB
    assert report.end_bytes == 0


def test_peak_memory_ignores_frees_of_blocks_an_earlier_profile_sized():
    # The allocator learns a block's size when a profiling window sees it allocated, and reports its
    # free with that size later: a block kept from one profiled call and freed in the next must not
    # count as a free of the second call (it made that call's balance dip to -1 MiB).
    holder = []
    memory_profile(lambda: holder.append(torch.empty(N, N)))

    def step():
        holder.clear()
        torch.empty(N, N)

    report = memory_profile(step)
    assert report.peak_bytes == MiB
    assert report.end_bytes == 0


def _resident_bytes() -> int:
    """VmRSS, read here rather than through the code under test."""
    with open("/proc/self/status") as f:
        kib = next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))
    return kib * 1024


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/status")
def test_process_high_water_mark_covers_what_is_resident_now():
    # VmHWM is monotone, so "after >= before" cannot fail. What can: the mark is at least what is
    # resident now (64 MiB just touched included) and at most getrusage's maxrss, which the kernel takes
    # as the max of the same mark and the resident set -- a figure in KiB, of VmPeak (virtual) or
    # of VmRSS alone would break one side. The kernel reads its per-CPU RSS counters approximately,
    # so readings of the same mark differ by some pages (seen: 4 KiB, and 148 KiB lower after freeing
    # big): a MiB of slack.
    big = torch.ones(64 * N, N)  # 64 MiB touched
    resident = _resident_bytes()
    mark = process_high_water_mark()
    maxrss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    del big
    assert resident >= 64 * MiB
    assert resident - MiB <= mark <= maxrss + MiB, (resident, mark, maxrss)
    assert process_high_water_mark() >= mark - MiB  # freeing big does not lower it


def test_step_time_counts():
    calls = []
    times = step_time(lambda: calls.append(1), steps=5, warmup=2)
    assert len(times) == 5 and len(calls) == 7
    assert all(t >= 0 for t in times)


@pytest.mark.slow
def test_compiled_saved_bytes_seen():
    """A compiled autograd.Function saves through save_for_backward, so the hooks see it."""
    model = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 64))
    x = torch.randn(128, 64)
    compiled = torch.compile(model)
    compiled(x).sum().backward()  # compile first, outside the hooks
    eager = saved_bytes(lambda: model(x).sum(), exclude=[model])
    comp = saved_bytes(lambda: compiled(x).sum(), exclude=[model])
    assert eager == (128 * 64 + 128 * 256) * 4
    assert 0 < comp <= eager
