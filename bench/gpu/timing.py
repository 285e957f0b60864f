"""A strategy on the performance GPT: its first call, step time, peak and loss; a profile of its kernels.

The step is a training step as a user writes it: gradients zeroed in place (``set_to_none=False``, so
they are allocated before every step after the first), forward under bf16 autocast with fp32
parameters, backward, SGD. Steps are timed with CUDA events on a GPU (wall clock on the CPU), each
after the warm-up; the timed section holds the worker's lock (``comparison.joblock``) exclusively, so no
other case compiles or runs beside it.
"""

from __future__ import annotations

import os
import statistics
import time
from collections import defaultdict

from comparison.joblock import JobLock
from comparison.strategies import checkpoint_blocks

from .driver import STOP_ENV
from .models import perf_gpt
from .numerics import autocast, measured_peak

WARMUP, STEPS, PROFILED = 3, 10, 3
TOP_KERNELS = 15


def prepare(spec: dict, model, *, compiler: str):
    """The callable ``fn(idx, tgt) -> loss`` of a strategy spec (``cases.STRATEGIES``). ``compiler``
    ``"eager"`` compiles without Inductor (plain compiles: ``aot_eager``; ours: ``compiler="eager"``)."""
    import torch

    if spec.get("ckpt"):
        checkpoint_blocks(model)
    for key, value in spec.get("functorch", {}).items():
        # torch's own knob for its partitioner's budget: no public API sets it
        setattr(torch._functorch.config, key, value)
    if spec["kind"] == "eager":
        return model
    if spec["kind"] == "compile":
        return torch.compile(model) if compiler == "inductor" else torch.compile(model, backend="aot_eager")
    import recompile_opt  # noqa: F401 -- registers the backend

    options = dict(spec.get("options", {}))
    if compiler != "inductor":
        options["compiler"] = compiler
    return torch.compile(model, backend="recompile_opt", options=options)


def make_step(fn, model, batch: tuple, device: str):
    """A training step: zero the gradients in place, forward (bf16 autocast), backward, SGD; returns
    the loss, detached."""
    import torch

    opt = torch.optim.SGD(model.parameters(), lr=1e-3)

    def step():
        opt.zero_grad(set_to_none=False)
        with autocast(device, "bf16"):
            loss = fn(*batch)
        loss.backward()
        opt.step()
        return loss.detach()

    return step


def sync(device: str) -> None:
    import torch

    if device == "cuda":
        torch.cuda.synchronize()


def timed_steps(step, device: str, steps: int) -> tuple[list[float], list]:
    """Seconds of each of ``steps`` calls (CUDA events on a GPU, read once at the end) and their losses."""
    import torch

    if device != "cuda":
        times, losses = [], []
        for _ in range(steps):
            t0 = time.perf_counter()
            losses.append(step())
            times.append(time.perf_counter() - t0)
        return times, losses
    marks = [
        (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(steps)
    ]
    losses = []
    for start, end in marks:
        start.record()
        losses.append(step())
        end.record()
    torch.cuda.synchronize()
    return [start.elapsed_time(end) / 1e3 for start, end in marks], losses


def first_call(step, device: str) -> tuple[float, object]:
    """Wall seconds of the first step (trace, compile, run) and its loss."""
    sync(device)
    t0 = time.perf_counter()
    loss = step()
    sync(device)
    return time.perf_counter() - t0, loss


TIMED_SECTION_S = 45.0  # what a timed section needs at most, a slow plan's 30 steps and peak included


def lock_wait_s() -> float | None:
    """How long a timed section may wait to run alone: until ``TIMED_SECTION_S`` before the driver
    stops this case (None: without a stop time, as long as it takes)."""
    stop = os.environ.get(STOP_ENV)
    return None if stop is None else max(0.0, float(stop) - time.time() - TIMED_SECTION_S)


def measure_strategy(case: dict, *, device: str, tiny: bool, compiler: str, lock: JobLock) -> dict:
    """First call, median of ``STEPS`` timed steps after ``WARMUP``, peak above a step's start (its
    gradients allocated) and the loss of the 10th step (the first call is step 1)."""
    model, batch = perf_gpt(device=device, tiny=tiny)
    step = make_step(prepare(case, model, compiler=compiler), model, batch, device)
    out = {}
    out["first_call_s"], loss = first_call(step, device)
    losses = [loss]
    with lock.exclusive(lock_wait_s()) as alone:
        out["timed_alone"] = alone
        for _ in range(WARMUP):
            losses.append(step())
        times, timed_losses = timed_steps(step, device, STEPS)
        losses += timed_losses
        out["peak_bytes"] = measured_peak(step, device)
    out.update(step_s=times, step_median_s=statistics.median(times), loss_after_10=losses[9].item())
    return out


def profile_strategy(case: dict, *, device: str, tiny: bool, compiler: str, lock: JobLock) -> dict:
    """The top kernels by total device time over ``PROFILED`` steps after a warm-up (on the CPU: ops by
    self CPU time), and device kernels (CPU ops) per step."""
    from torch.profiler import ProfilerActivity, profile

    model, batch = perf_gpt(device=device, tiny=tiny)
    step = make_step(prepare(case, model, compiler=compiler), model, batch, device)
    out = {}
    out["first_call_s"], _ = first_call(step, device)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    with lock.exclusive(lock_wait_s()) as alone:
        out["timed_alone"] = alone
        for _ in range(WARMUP):
            step()
        sync(device)
        with profile(activities=activities) as prof:
            for _ in range(PROFILED):
                step()
            sync(device)
    totals, launches = kernel_totals(prof.events(), device)
    top = sorted(totals.items(), key=lambda kv: -kv[1][1])[:TOP_KERNELS]
    out.update(
        kernels=[{"name": n, "calls": c, "total_us": us} for n, (c, us) in top],
        launches_per_step=launches / PROFILED,
        profiled_us_per_step=sum(us for _, us in totals.values()) / PROFILED,
    )
    return out


def kernel_totals(events, device: str) -> tuple[dict, int]:
    """``{name: (calls, total microseconds)}`` of the device kernels among profiler ``events`` (on the
    CPU: the aten ops, by self time), and how many there were."""
    from torch.autograd import DeviceType

    totals: dict = defaultdict(lambda: [0, 0.0])
    n = 0
    for e in events:
        if device == "cuda":
            if e.device_type != DeviceType.CUDA:
                continue
            us = e.time_range.elapsed_us()
        else:
            if not e.name.startswith("aten::"):
                continue
            us = e.self_cpu_time_total
        totals[e.name][0] += 1
        totals[e.name][1] += us
        n += 1
    return {k: tuple(v) for k, v in totals.items()}, n
