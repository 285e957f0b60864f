"""Measurement utilities for activation memory and step time.

Used by the tests and by ``bench/compare.py`` to check what a save/recompute
plan *actually* does, independently of what the planner predicts.  Everything
here uses public PyTorch APIs only, so the numbers mean the same thing for
eager code, ``torch.utils.checkpoint`` and any ``torch.compile`` backend.

Three kinds of figures:

* **Saved bytes** (:func:`saved_bytes`, :class:`SavedTensorsMeter`): the bytes
  held alive *for backward* at the end of the forward pass.  Every tensor that
  autograd packs for backward goes through
  ``torch.autograd.graph.saved_tensors_hooks`` -- including the tensors a
  compiled ``autograd.Function`` (AOTAutograd) hands to ``save_for_backward``
  -- so one hook sees eager, checkpointed and compiled code alike.  Tensors
  are deduplicated by *storage*, because a saved view keeps its whole base
  storage alive: saving ``a[0]`` and ``a[1]`` costs ``a``'s storage once.
  Parameters/buffers (and anything else the caller lists) are excluded, since
  they are alive regardless of the plan.

* **Peak memory** (:func:`peak_memory`, :func:`memory_profile`): the most live
  bytes above the pre-step baseline during a training step, integrated from
  the allocator's alloc/free records captured by ``torch.profiler``.  This is
  the ground truth that saved-bytes only approximates (it includes gradients,
  backward temporaries and recomputation buffers).

* **Step time** (:func:`step_time`): wall-clock seconds per step after warm-up.

:func:`process_high_water_mark` is a coarse cross-check (RSS high-water mark
of the whole process, monotone, includes allocator caching and the Python heap).
"""

from __future__ import annotations

import contextlib
import os
import resource
import sys
import tempfile
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable

import torch
from torch.autograd.graph import saved_tensors_hooks

from recompile_opt._torch_internals import allocator_records

__all__ = [
    "SavedTensorsMeter",
    "SavedReport",
    "saved_bytes",
    "saved_report",
    "storage_ptrs",
    "PeakReport",
    "memory_profile",
    "peak_memory",
    "process_high_water_mark",
    "step_time",
]

MiB = 1 << 20


# --------------------------------------------------------------------------
# Saved-for-backward bytes
# --------------------------------------------------------------------------


def storage_ptrs(*objs: Any) -> set[int]:
    """Storage data pointers of modules' parameters/buffers and of tensors.

    Accepts ``nn.Module`` (all parameters and buffers), tensors, or iterables
    of those.  The result is meant for the ``exclude`` argument of
    :class:`SavedTensorsMeter`: identifying by storage (not by tensor object)
    also excludes views of parameters, e.g. the transposed weight a compiled
    graph saves for the backward matmul.
    """
    ptrs: set[int] = set()
    for obj in objs:
        if isinstance(obj, torch.nn.Module):
            tensors: Iterable[Any] = list(obj.parameters()) + list(obj.buffers())
        elif isinstance(obj, torch.Tensor):
            tensors = [obj]
        elif isinstance(obj, int):  # already a pointer
            ptrs.add(obj)
            continue
        else:
            ptrs |= storage_ptrs(*obj)
            continue
        for t in tensors:
            ptr = _storage_ptr(t)
            if ptr:
                ptrs.add(ptr)
    return ptrs


def _storage_ptr(t: torch.Tensor) -> int:
    try:
        return t.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):  # e.g. tensor subclasses without storage
        return 0


@dataclass
class SavedReport:
    """Result of a saved-tensor measurement.

    ``total_bytes`` counts each distinct storage once; ``breakdown`` has one
    ``(shape, dtype, storage_bytes)`` row per distinct storage (the shape is
    that of the first saved tensor seen on it), largest first.
    ``n_packed`` is the number of pack-hook calls (before deduplication),
    ``n_excluded`` how many of them hit an excluded storage.
    """

    total_bytes: int = 0
    breakdown: list[tuple[tuple[int, ...], torch.dtype, int]] = field(default_factory=list)
    n_packed: int = 0
    n_excluded: int = 0

    def summary(self, top: int = 10) -> str:
        lines = [
            f"saved {self.total_bytes / MiB:.3f} MiB in {len(self.breakdown)} storages "
            f"({self.n_packed} packs, {self.n_excluded} excluded)"
        ]
        for shape, dtype, nbytes in self.breakdown[:top]:
            lines.append(f"  {str(tuple(shape)):>24} {str(dtype):>15} {nbytes / MiB:9.3f} MiB")
        return "\n".join(lines)


class SavedTensorsMeter:
    """Context manager recording every tensor packed for backward.

    Usage::

        with SavedTensorsMeter(exclude=storage_ptrs(model)) as meter:
            loss = model(x)
        meter.total_bytes, meter.report().breakdown

    The pack hook returns the tensor unchanged, so autograd behaves exactly as
    without the meter.  While the context is open the meter also keeps a
    reference to each recorded storage; this guarantees a storage freed early
    (e.g. a graph dropped inside the block) cannot be reused by a later
    allocation at the same address and be wrongly deduplicated.  The
    references are dropped on exit.

    Caveat: hooks installed *inside* the block take precedence over this one
    (``torch.utils.checkpoint(use_reentrant=False)`` does that), so tensors
    those hooks swallow are not seen -- which is correct for checkpointing,
    whose inner activations are indeed not kept.  Checkpoint's saved *inputs*
    are packed outside its hooks and are counted.
    A compiled model must be compiled (called once) before measuring: if hooks
    are active while AOTAutograd traces, it may inline them into the graph.
    """

    def __init__(self, exclude: Iterable[int] | None = None):
        self.exclude = set(exclude or ())
        self._rows: dict[int, tuple[tuple[int, ...], torch.dtype, int]] = {}
        self._keepalive: list[Any] = []
        self.n_packed = 0
        self.n_excluded = 0
        self._hooks: saved_tensors_hooks | None = None

    def _pack(self, t: Any) -> Any:
        if not isinstance(t, torch.Tensor) or t.numel() == 0:
            return t
        self.n_packed += 1
        try:  # a wrapper subclass (a DTensor) has no storage of its own to count (under FSDP2: invalid)
            storage = t.untyped_storage()
            ptr = storage.data_ptr()
        except (RuntimeError, NotImplementedError):
            return t
        if ptr == 0 or storage.nbytes() == 0:
            return t
        if ptr in self.exclude:
            self.n_excluded += 1
            return t
        if ptr not in self._rows:
            self._rows[ptr] = (tuple(t.shape), t.dtype, storage.nbytes())
            self._keepalive.append(storage)
        return t

    @staticmethod
    def _unpack(t: Any) -> Any:
        return t

    def __enter__(self) -> "SavedTensorsMeter":
        self._hooks = saved_tensors_hooks(self._pack, self._unpack)
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        assert self._hooks is not None
        self._hooks.__exit__(*exc)
        self._hooks = None
        self._keepalive.clear()

    @property
    def total_bytes(self) -> int:
        return sum(row[2] for row in self._rows.values())

    def report(self) -> SavedReport:
        rows = sorted(self._rows.values(), key=lambda r: -r[2])
        return SavedReport(self.total_bytes, rows, self.n_packed, self.n_excluded)


def saved_report(fn: Callable[[], Any], exclude: Iterable[Any] = ()) -> tuple[SavedReport, Any]:
    """Run ``fn()`` (a forward pass) under a :class:`SavedTensorsMeter`.

    ``exclude`` takes modules, tensors or storage pointers (see
    :func:`storage_ptrs`).  Returns ``(report, fn's return value)`` so the
    caller can still run backward on the returned loss.
    """
    with SavedTensorsMeter(storage_ptrs(*exclude) if exclude else None) as meter:
        out = fn()
    return meter.report(), out


def saved_bytes(fn: Callable[[], Any], exclude: Iterable[Any] = ()) -> int:
    """Bytes of distinct storages saved for backward by ``fn()``, parameters excluded.

    Convenience wrapper over :func:`saved_report`; ``fn``'s result (and with
    it the autograd graph) is discarded.
    """
    report, _ = saved_report(fn, exclude)
    return report.total_bytes


# --------------------------------------------------------------------------
# Peak memory from the profiler's allocator records
# --------------------------------------------------------------------------

_CPU_LIKE = ("CPU", "MKLDNN", "IDEEP")


@dataclass
class PeakReport:
    """Allocator activity of one profiled call, relative to its start.

    ``peak_bytes``: max over time of (bytes allocated - bytes freed) since the
    start, never below 0.  ``alloc_bytes``: total bytes allocated.  ``end_bytes``: the same balance at
    the end (what the call left allocated, e.g. gradients).  ``n_events``: memory records used.
    """

    peak_bytes: int
    end_bytes: int
    n_events: int
    alloc_bytes: int


def _device_matches(record_device: torch.device, device: torch.device) -> bool:
    if device.type == "cpu":
        return record_device.type.upper() in _CPU_LIKE
    if record_device.type != device.type and not (device.type == "cuda" and record_device.type == "hip"):
        return False
    return device.index is None or record_device.index == device.index


def memory_profile(step_fn: Callable[[], Any], device: str | torch.device = "cpu") -> PeakReport:
    """Profile ``step_fn()`` and integrate its allocation/free records in time order.

    Why the allocator records (``_torch_internals.allocator_records``): ``prof.events()`` /
    ``key_averages()`` only attribute memory to the op *enclosing* an allocation and drop many of the
    standalone ``[memory]`` rows, so the live-bytes curve cannot be rebuilt from them.  Only allocations
    on ``device`` count (CPU includes MKLDNN/IDEEP).

    Only frees of blocks allocated inside the call count: the figure is "peak of bytes allocated during
    the call and still live", which equals the true peak above baseline when the call frees nothing that
    existed before it -- e.g. a training step entered with grads set to ``None`` and no previous graph
    alive.  Why match by address: the CPU allocator reports a free of an older block with its size when
    an earlier profiling window saw that block (or one at the same address) allocated, and 0 otherwise,
    so counting every reported free made the figure depend on what ran before.
    """
    events = allocation_timeline(step_fn, device)
    live = peak = allocated = 0
    for nbytes in events:
        allocated += max(nbytes, 0)
        live += nbytes
        peak = max(peak, live)
    return PeakReport(peak_bytes=peak, end_bytes=live, n_events=len(events), alloc_bytes=allocated)


def allocation_timeline(step_fn: Callable[[], Any], device: str | torch.device = "cpu") -> list[int]:
    """The signed sizes of the allocations and frees :func:`memory_profile` counts, in time order
    (frees only of blocks allocated inside the call)."""
    from torch.profiler import ProfilerActivity, profile

    device = torch.device(device)
    activities = [ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(ProfilerActivity.CUDA)
    prof = profile(activities=activities, profile_memory=True)
    with _without_usdt_lines():
        prof.start()
    try:
        step_fn()
    finally:
        with _without_usdt_lines():
            prof.stop()
    events: list[int] = []
    allocated_here: dict[int, int] = {}  # address -> bytes, for blocks allocated inside the call
    for _, address, nbytes, where in allocator_records(prof):
        if not _device_matches(where, device):
            continue
        if nbytes > 0:
            allocated_here[address] = nbytes
        elif nbytes < 0 and allocated_here.pop(address, None) is None:
            continue  # a block from before the call
        if nbytes:
            events.append(nbytes)
    return events


_KINETO_THREAD_LINE = b"External init callback must run in same thread as registerClient"


@contextlib.contextmanager
def _without_usdt_lines():
    """Kineto writes ``USDT: ... profiler_start`` and ``profiler_stop`` to fd 2 at every profiler start
    and stop, into the middle of the demo's table. ``KINETO_LOG_LEVEL=6`` would hide them, but also
    Kineto's errors, and it is read once per process, at the first profile. So fd 2 is caught around
    the start and the stop only (not around the profiled call) and every other line is written back.
    Also dropped: the "External init callback must run in same thread as registerClient" line Kineto
    writes when a process's first profile starts on a thread other than the one that loaded it (the
    planner measures kernels' scratch on its own thread, :mod:`recompile_opt.costs.scratch`); the CPU
    allocator's records, all we read, are PyTorch's own and come through regardless."""
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as caught:
        os.dup2(caught.fileno(), 2)
        try:
            yield
        finally:
            os.dup2(saved, 2)
            os.close(saved)
            caught.seek(0)
            kept = [
                line
                for line in caught.read().splitlines(keepends=True)
                if not line.startswith(b"USDT:") and _KINETO_THREAD_LINE not in line
            ]
            if kept:
                os.write(2, b"".join(kept))


def peak_memory(step_fn: Callable[[], Any], device: str | torch.device = "cpu") -> int:
    """Most live bytes above the pre-call baseline during ``step_fn()``; see :func:`memory_profile`."""
    return memory_profile(step_fn, device).peak_bytes


def process_high_water_mark() -> int:
    """Peak resident set size of this process in bytes (coarse cross-check).

    Reads ``VmHWM`` from ``/proc/self/status`` (Linux), else ``ru_maxrss``
    (KiB on Linux, bytes on macOS).  Monotone over the process lifetime and it
    includes the Python heap, libraries and allocator caches, so only compare
    it between fresh processes doing the same thing apart from the plan.
    """
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    value, unit = line.split()[1:3]
                    assert unit.lower() == "kb"
                    return int(value) * 1024
    except OSError:
        pass
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss if sys.platform == "darwin" else rss * 1024


# --------------------------------------------------------------------------
# Step time
# --------------------------------------------------------------------------


def _default_sync() -> None:
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()


def step_time(
    step_fn: Callable[[], Any],
    steps: int = 5,
    warmup: int = 1,
    sync: Callable[[], None] | None = _default_sync,
) -> list[float]:
    """Wall-clock seconds of each of ``steps`` calls to ``step_fn()`` after ``warmup`` calls.

    ``sync`` (default: CUDA synchronize when CUDA is in use) runs before each
    clock read so asynchronous device work is attributed to its step.  Return
    the raw list; report a median and spread, not a mean, since single steps
    on a shared machine have outliers.
    """
    sync = sync or (lambda: None)
    for _ in range(warmup):
        step_fn()
    sync()
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        step_fn()
        sync()
        times.append(time.perf_counter() - t0)
    return times
