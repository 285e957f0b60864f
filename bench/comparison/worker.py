"""The measured child process: one strategy, one model, one JSON line of figures.

Each run is its own interpreter (``python bench/compare.py --worker NAME``) because Dynamo and
Inductor keep global state and the CPU allocator keeps freed memory: a second strategy in the same
process would inherit both.  The worker fills its result dict stage by stage, so a failure late in a
run still reports what was measured before it; the driver reads the line after :data:`MARKER`.
"""

from __future__ import annotations

import os
import pathlib
import statistics
import sys
import time
import traceback

from .config import group_configs
from .flops import count_flops, graph_flops_pass
from .joblock import JobLock
from .strategies import build_model, prepare, strategy

MARKER = "@@COMPARE_RESULT@@ "


def plan_figures() -> dict:
    """Estimates of our backend's plans in this process (one per graph, the latest of each)."""
    import recompile_opt

    plans = {p.graph: p for p in recompile_opt.last_plans()}.values()
    if not plans:
        return {}
    return {
        "plan_saved_bytes": sum(p.saved_bytes for p in plans),
        "plan_recompute_flops": sum(p.recompute_flops for p in plans),
        "plan_predicted_peak_bytes": max(p.predicted_peak_bytes for p in plans),
        "plan_s": sum(p.solver.get("plan_s", 0.0) for p in plans),
        "plans": len(plans),
    }


def graph_count() -> int:
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


def make_steps(model, fn, idx, tgt):
    """The closures the worker times and measures; RNG reseeded identically each step."""
    import torch

    opt = torch.optim.SGD(model.parameters(), lr=1e-3)

    def fwd_bwd():
        torch.manual_seed(1234)
        fn(idx, tgt).backward()

    def train_step():
        model.zero_grad(set_to_none=True)
        fwd_bwd()
        opt.step()

    return fwd_bwd, train_step


def grad_diff(model, ref) -> float:
    """Max abs difference between the grads of two identically-ordered models."""
    worst = 0.0
    for p, q in zip(model.parameters(), ref.parameters(), strict=True):
        if p.grad is None and q.grad is None:
            continue
        if p.grad is None or q.grad is None:
            return float("inf")
        worst = max(worst, (p.grad - q.grad).abs().max().item())
    return worst


def _proc_status_kib(key: str) -> int | None:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1])
    except OSError:
        pass
    return None


def rss_rise(step_fn) -> int | None:
    """Resident high-water mark during ``step_fn()`` minus the resident size before (Linux)."""
    before = _proc_status_kib("VmRSS")
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # resets VmHWM to the current VmRSS
    except OSError:
        return None
    step_fn()
    hwm = _proc_status_kib("VmHWM")
    return None if before is None or hwm is None else (hwm - before) * 1024


def kernels_built() -> int | None:
    """Shared objects in this worker's Inductor cache: one per C++ kernel module it compiled (on the
    CPU each takes ~1 s of a cold compile with one compile thread, the bulk of it), so a plan that
    recomputes in the backward shows here what its extra kernels cost. None without a private cache."""
    cache = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    return sum(1 for _ in pathlib.Path(cache).rglob("*.so")) if cache else None


def run_worker(name: str, args) -> dict:
    """Run one strategy; fill ``out`` stage by stage so a failure keeps partial figures."""
    out: dict = {"strategy": name}
    lock = JobLock()
    lock.shared()
    try:
        measure_strategy(name, args, out, lock)
    except BaseException as exc:  # noqa: BLE001 -- report, never crash the driver
        traceback.print_exc(file=sys.stderr)
        out["error"] = f"{type(exc).__name__}: {exc}".strip()
    return out


def measure_strategy(name: str, args, out: dict, lock: JobLock | None = None) -> None:
    """Build, compile and measure one strategy into ``out``: the cold first step outside the lock
    (compiles may overlap), then every timed and memory figure under the exclusive lock."""
    import copy

    import torch

    # imported before the model is built: the import order of every past run
    from recompile_opt.costs import measure

    if args.threads:
        torch.set_num_threads(args.threads)
    out.update(torch=torch.__version__, threads=torch.get_num_threads())
    spec = strategy(name)
    cfg = group_configs(args)[0]
    model, idx, tgt = build_model(cfg)
    ref = copy.deepcopy(model)  # untouched eager copy: gradient check and save-all FLOPs
    eager_fwd, eager_bwd = count_flops(ref, idx, tgt)
    out.update(eager_fwd_flops=eager_fwd, eager_bwd_flops=eager_bwd)
    fn = prepare(spec, model, args)
    compiled = spec["kind"] != "eager"
    if compiled:
        torch._inductor.config.post_grad_custom_post_pass = graph_flops_pass()
    fwd_bwd, train_step = make_steps(model, fn, idx, tgt)
    graphs = first_step(out, fwd_bwd, model=model, ref=ref)
    if compiled:
        counter = graph_flops_pass()
        if counter.backward:  # empty on an Inductor cache hit: the pass did not run
            out.update(fwd_flops=sum(counter.forward), bwd_flops=sum(counter.backward))
    else:
        model.zero_grad(set_to_none=True)
        out["fwd_flops"], out["bwd_flops"] = count_flops(fn, idx, tgt)
    if "bwd_flops" in out:
        out["recompute_flops"] = out["bwd_flops"] - eager_bwd

    with (lock or JobLock("")).exclusive():
        timed_figures(out, args, model=model, fn=fn, batch=(idx, tgt), fwd_bwd=fwd_bwd, train_step=train_step)
    out["recompiles"] = graph_count() - graphs
    if spec["kind"] == "ours":
        out.update(plan_figures())
    out["rss_hwm_bytes"] = measure.process_high_water_mark()


def first_step(out: dict, fwd_bwd, *, model, ref) -> int:
    """The cold call (trace and compile forward and backward): its wall time, C++ build time, kernels
    built and gradient difference from eager go into ``out``; returns Dynamo's graph count after it."""
    from recompile_opt._torch_internals import cpp_build_timer

    built = kernels_built()
    t0 = time.perf_counter()
    with cpp_build_timer() as builds:
        fwd_bwd()
    out["first_step_s"] = time.perf_counter() - t0
    out["kernel_build_s"] = builds["s"]
    if built is not None:
        out["kernels_built"] = kernels_built() - built
    out["max_grad_diff"] = grad_diff(model, ref)
    graphs = out["graphs"] = graph_count()
    return graphs


def timed_figures(out: dict, args, *, model, fn, batch, fwd_bwd, train_step) -> None:
    """Step times, saved bytes, profiler peak and RSS rise, in that order (call under the exclusive lock:
    other load skews CPU timings, and the load average at the start is kept to flag it in the notes)."""
    import gc

    import torch

    from recompile_opt.costs import measure

    idx, tgt = batch
    out["loadavg_1m"] = os.getloadavg()[0]
    times = measure.step_time(train_step, steps=args.steps, warmup=args.warmup)
    out.update(step_s=times, step_median_s=statistics.median(times))

    model.zero_grad(set_to_none=True)
    torch.manual_seed(1234)
    report, loss = measure.saved_report(lambda: fn(idx, tgt), exclude=[model, idx, tgt])
    loss.backward()
    del loss
    out.update(saved_bytes=report.total_bytes, saved_storages=len(report.breakdown))

    model.zero_grad(set_to_none=True)
    gc.collect()
    peak = measure.memory_profile(fwd_bwd)
    out.update(peak_bytes=peak.peak_bytes, alloc_bytes=peak.alloc_bytes)
    model.zero_grad(set_to_none=True)
    gc.collect()
    out["rss_rise_bytes"] = rss_rise(fwd_bwd)
