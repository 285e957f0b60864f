"""Offload, the third way to hold a kept value: on the host between its last forward use and its first
backward use (issue 50). Which values the ILP may offload, over which link, and what a plan moves.

The choice itself is the ILP's (``ilp.add_offload``: a binary per value, its bytes off the budget, its
copies in windows of compute); this module decides where it is offered and describes the result.
"""

from __future__ import annotations

import dataclasses

from recompile_opt.options import Options
from recompile_opt.planner.problem import Problem, offload_choice, offloaded_values

OFFLOAD_TAGS = ("must_cpu_offload", "prefer_cpu_offload")


def offer(problem: Problem, options: Options) -> tuple[Problem, list[str]]:
    """The problem with offload offered where it applies (``host_bytes_per_s`` set), and the notes that
    say where it does not: a CPU device (its memory is the host's), a torch without the offloading ops,
    a device where the emitted offload failed its check (CUDA, unless ``offload_unchecked``), a fixed
    policy (they never offload; a user's MUST_CPU_OFFLOAD tag still holds). With the option off, user
    offload tags are offered alone."""
    tagged = [n for n, v in problem.values.items() if v.tag in OFFLOAD_TAGS]
    without = dataclasses.replace(problem, host_bytes_per_s=0.0)
    if not options.offload and not tagged:
        return without, []
    asked = "option 'offload'" if options.offload else f"{len(tagged)} CPU_OFFLOAD tag(s)"
    why_not = None
    if problem.device == "cpu" and not options.offload_on_cpu:
        why_not = "does not apply on a CPU device (host memory is the device's memory)"
    elif not problem.offload_ops:
        why_not = "this torch has no activation-offloading ops (torch._functorch._activation_offloading)"
    elif not problem.offload_checked and not options.offload_unchecked:
        why_not = (
            f"is not offered on a {problem.device.upper()} device until a GPU check trains eager's loss "
            "with it: the first (H200, torch 2.11, docs/gpu.md) trained a NaN loss"
        )
    if why_not:
        tags = "; CPU_OFFLOAD tags are kept on the device instead" if tagged else ""
        return without, [f"offload: {asked} {why_not}; planned without offload{tags}"]
    link = link_bytes_per_s(problem, options)
    notes = []
    only_tagged = not options.offload or options.policy != "auto"
    if options.offload and options.policy != "auto":
        notes.append(f"offload: policy={options.policy!r} is a fixed baseline and offloads nothing by itself")
    if problem.device == "cpu":
        notes.append("offload: offload_on_cpu=True: CPU values copied host to host (a test of the rewrite)")
    return dataclasses.replace(problem, host_bytes_per_s=float(link), offload_only_tagged=only_tagged), notes


def link_bytes_per_s(problem: Problem, options: Options) -> float:
    """The host link's bandwidth per direction: the option's, else the device's roofline's."""
    link = options.offload if not isinstance(options.offload, bool) else None
    return float(link or options.roofline_for(problem.device)["host_bytes_per_s"])


@dataclasses.dataclass(frozen=True)
class CopyClock:
    """What places an offloaded value's copies (``passes/partition.py``): by node name, each forward
    node's kernel's end (``Problem.forward_done_s``) and each backward node's kernel's start
    (``Problem.backward_start_s``), and the link's bytes per second the plan was made with."""

    forward_done: dict[str, float]
    backward_starts: dict[str, float]
    link_bytes_per_s: float


def copy_clock(problem: Problem, options: Options) -> CopyClock:
    """The clock the plan's copies were priced on (the ILP's windows), to place them by."""
    return CopyClock(problem.forward_done_s, problem.backward_start_s, link_bytes_per_s(problem, options))


def tagged_offloads(problem: Problem) -> set[str]:
    """A fixed policy's offloads: the values a user tagged MUST_CPU_OFFLOAD, where offload is offered."""
    return {offload_choice(n) for n in problem.offloadable() if problem.values[n].tag == "must_cpu_offload"}


def offloaded_entries(problem: Problem, saved: set[str], recomputed: set[str]) -> list[dict]:
    """One entry per offloaded value (``Plan.offloaded``): its bytes, moved each way, and its windows."""
    out = []
    for name in sorted(offloaded_values(recomputed) & saved, key=list(problem.values).index):
        v = problem.values[name]
        after, before = v.offload_windows
        out.append(
            {
                "value": name,
                "op": v.info.get("op", ""),
                "shape": list(v.info.get("shape", [])),
                "dtype": v.info.get("dtype", ""),
                "bytes": problem.storage_bytes.get(v.storage, 0),
                "forward_window_s": after,
                "backward_window_s": before,
                "module": v.info.get("module", ""),
                "source": v.info.get("source", ""),
            }
        )
    return out
