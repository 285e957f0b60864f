"""Where the offload copies go, and what the device holds: torch's placement against the plan's clock.

On a CUDA device the copies run on a stream of their own, and each copy's wait frees its value's device
buffer. torch's pass sinks every wait to the forward's end and issues each reload just before its first
use (or prefetches it by its own bandwidth setting over kernels timed on the device, which a CPU cannot
run); the partition places both on the clock the ILP priced the copies on (``passes/partition.py``).
This plans the demo GPT with offload at a byte budget, its copies put on a stream of their own as on
CUDA (the graphs are only read here: the side-stream ops run on a GPU), and partitions the same plan
both ways. Prints, for each, the forward's peak simulated (the graph's order) and walked in the code
Inductor generates for it (Inductor's order), the step's walked peak, and how many kernels run between
each copy and its wait in that code: its peak-memory reordering pulls a wait up to its copy unless the
wait reads the kernel it is to follow, and then the compute stream waits for the copy where it starts.

Usage::

    TORCHINDUCTOR_CACHE_DIR=$(mktemp -d) python bench/offload_placement.py
"""

from __future__ import annotations

import importlib.util
import itertools

import torch
from recompile_opt.passes import partition

import recompile_opt
from recompile_opt import models, planning
from recompile_opt.costs.inductor_peak import _walked_forward, exact_peak
from recompile_opt.costs.peak import forward_state
from recompile_opt.plan import fmt_bytes
from recompile_opt.provenance import header_line

BUDGET = "10MiB"  # kept bytes
LINK = "1GB/s"


def _as_on_cuda() -> list:
    """Offload copies on a stream of their own (torch 2.11's stream ops given ids a CPU lacks); the
    planner's final partitions recorded (their arguments)."""
    partition._copies_on_a_stream_of_their_own = lambda device: True
    if importlib.util.find_spec("torch._functorch._activation_offloading.offload_ops") is None:
        from torch._functorch._activation_offloading import activation_offloading

        ids = itertools.count(1)
        for name in ("get_current_stream", "new_stream", "new_event"):
            setattr(activation_offloading, name, lambda *a, **k: next(ids))
    calls = []
    real = planning.partition
    planning.partition = lambda *a, **k: calls.append((a, k)) or real(*a, **k)
    return calls


def _kernels_behind(fw) -> list[int]:
    """For each copy's wait in the code Inductor generates for ``fw``: the kernels run between its copy
    and it (0: the compute stream waits for the copy where it is issued)."""
    import ast

    from recompile_opt import _torch_internals as ti
    from recompile_opt.costs.inductor_peak import _call, _statements

    waits = {"torch.ops.ao.wait_tensor.default", "torch.ops.recompile_opt.wait_offload_copy.default"}
    kernels, made, behind = 0, {}, []
    for stmt in _statements(_call(ti.inductor_wrapper_code(fw, backward=False).code)):
        call = getattr(stmt, "value", None)
        func = ast.unparse(call.func) if isinstance(call, ast.Call) else ""
        if func in waits:
            behind.append(kernels - made[ast.unparse(call.args[0])])
        elif func.startswith(("cpp_", "triton_", "extern_kernels.", "torch.ops.aten.")):
            kernels += 1
        if isinstance(stmt, ast.Assign):
            made.setdefault(ast.unparse(stmt.targets[0]), kernels)
    return behind


def main() -> None:
    calls = _as_on_cuda()
    model, batch = models.demo_gpt()
    opts = dict(memory_budget=BUDGET, offload=LINK, offload_on_cpu=True, compiler="eager")
    plan = recompile_opt.plan(model, batch, **opts)
    args, kwargs = calls[-1]
    print(header_line())
    print()
    print(
        f"demo GPT, memory_budget={BUDGET!r}, offload={LINK!r}: kept {fmt_bytes(plan.saved_bytes)} on the "
        f"device, {len(plan.offloaded)} values offloaded ({fmt_bytes(plan.offload['bytes_to_host'])}), "
        f"exposed copy time {plan.offload['exposed_s'] * 1e6:.1f} µs"
    )
    print()
    print(
        "| copies placed | forward peak, simulated | forward peak, walked | step peak, walked "
        "| kernels between a copy and its wait (Inductor's code) |"
    )
    print("|---|---|---|---|---|")
    for label, clock in (("torch's (waits at the forward's end)", None), ("on the plan's clock", "plan")):
        place = {**kwargs, "copy_clock": kwargs["copy_clock"] if clock else None}
        fw, bw = partition.partition(*args, **place)
        simulated = forward_state(fw)[0]
        walked = _walked_forward(fw)[0]
        behind = _kernels_behind(fw)
        fw, bw = partition.partition(*args, **place)  # the walks change the graphs (post-grad passes)
        step = exact_peak(fw, bw, num_fwd_outputs=kwargs["num_fwd_outputs"])
        row = (fmt_bytes(simulated), fmt_bytes(walked), fmt_bytes(step), " ".join(map(str, behind)))
        print(f"| {label} | " + " | ".join(row) + " |")


if __name__ == "__main__":
    torch.manual_seed(0)
    main()
