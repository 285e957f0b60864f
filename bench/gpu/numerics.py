"""One training step of a compiled model against eager: the loss and every gradient, and the measured
peak of a step as the plan's prediction counts it.

Deviations are normwise relative: ``max|ours - eager| / max|eager|`` per tensor (the loss; the worst
parameter gradient), so fp32 and bf16 rows read on one scale. The fp32 verdict is elementwise
``torch.allclose`` at the issue's tolerance; the bf16 verdict compares with plain ``torch.compile``'s
deviation on the same model (see :func:`verdict`).
"""

from __future__ import annotations

import contextlib
import copy
import gc

FP32_TOL = {"rtol": 1e-4, "atol": 1e-5}
BF16_FACTOR = 2.0  # ours may deviate from eager by twice what plain torch.compile does ...
BF16_FLOOR = 1e-5  # ... and never needs to beat this relative deviation
APPROX_GRAD_LIMIT = 1.0  # approximated gradients: the same order as eager's (normwise relative below 1)
# on CUDA, the steps run before the measured one, the allocator's cache emptied first: the steady step a
# plan's predicted peak models (recompile_opt.costs.cuda_allocator), whatever ran in the process before
WARM_STEPS = 2


def autocast(device: str, dtype: str):
    """The step's precision context: bf16 autocast on ``device``, or nothing for fp32."""
    import torch

    if dtype == "bf16":
        return torch.autocast(device, dtype=torch.bfloat16)
    return contextlib.nullcontext()


def one_step(fn, params: list, batch: tuple, ctx_factory) -> tuple:
    """Forward (under a fresh ``ctx_factory()``) and backward from ``grad=None`` and seed 1234; the loss
    and the gradients as fp32 copies."""
    import torch

    for p in params:
        p.grad = None
    torch.manual_seed(1234)
    with ctx_factory():
        loss = fn(*batch)
    loss.backward()
    return loss.detach().float().clone(), [
        None if p.grad is None else p.grad.detach().float().clone() for p in params
    ]


def relative(a, b) -> float:
    """``max|a - b| / max|b|`` (inf when one is missing)."""
    if a is None or b is None:
        return 0.0 if a is None and b is None else float("inf")
    scale = b.abs().max().item() or 1.0
    return (a - b).abs().max().item() / scale


def compare(ours: tuple, eager: tuple, names: list[str]) -> dict:
    """Deviation figures of ``ours`` ``(loss, grads)`` from ``eager``'s, and whether they are within the
    fp32 tolerance elementwise."""
    import torch

    (loss, grads), (ref_loss, ref_grads) = ours, eager
    devs = [relative(g, r) for g, r in zip(grads, ref_grads, strict=True)]
    worst = max(range(len(devs)), key=devs.__getitem__)
    close = all(
        g is not None and r is not None and torch.allclose(g, r, **FP32_TOL)
        for g, r in zip(grads, ref_grads)
        if g is not None or r is not None
    )
    return {
        "loss": loss.item(),
        "eager_loss": ref_loss.item(),
        "loss_dev": relative(loss, ref_loss),
        "grad_dev": devs[worst],
        "worst_grad": names[worst],
        "fp32_close": close and torch.allclose(loss, ref_loss, **FP32_TOL),
    }


def against_eager(model, fn, batch: tuple, *, device: str, dtype: str) -> dict:
    """One step of ``fn`` (``model`` compiled) against one of an untouched eager copy of ``model``,
    taken before the first call."""
    ref = copy.deepcopy(model)
    names = [n for n, _ in model.named_parameters()]
    ctx = lambda: autocast(device, dtype)  # noqa: E731
    eager = one_step(ref, list(ref.parameters()), batch, ctx)
    ours = one_step(fn, list(model.parameters()), batch, ctx)
    return compare(ours, eager, names)


def verdict(row: dict, reference: dict | None) -> tuple[bool, str]:
    """Pass or fail of a correctness row, and why. fp32: elementwise within ``FP32_TOL``. bf16: loss and
    worst gradient within ``BF16_FACTOR`` x plain torch.compile's deviation, floor ``BF16_FLOOR``.
    An approximating plan: the loss as above (the forward is exact), gradients of eager's order, and on
    CUDA at least one launch of its Triton kernels."""
    approx = bool(row.get("approximated"))
    launches = row.get("triton_launches")  # measured on CUDA only: the plan's Triton kernels must run there
    if approx and launches is not None and not sum(launches.values()):
        return False, "approximate: no Triton kernel of the approximate backward launched"
    if row["dtype"] == "fp32":
        loss_ok = row["loss_dev"] <= FP32_TOL["rtol"] + FP32_TOL["atol"]
        if not approx:
            return row["fp32_close"], "allclose rtol 1e-4 atol 1e-5"
        return (
            loss_ok and row["grad_dev"] < APPROX_GRAD_LIMIT,
            f"approximate: loss exact, gradients < {APPROX_GRAD_LIMIT} relative",
        )
    if reference is None or "error" in reference:
        return False, "no torch.compile reference"
    loss_lim = max(BF16_FACTOR * reference["loss_dev"], BF16_FLOOR)
    grad_lim = max(BF16_FACTOR * reference["grad_dev"], BF16_FLOOR)
    if approx:
        return (
            row["loss_dev"] <= loss_lim and row["grad_dev"] < APPROX_GRAD_LIMIT,
            f"approximate: loss <= {loss_lim:.1e}, gradients < {APPROX_GRAD_LIMIT}",
        )
    return (
        row["loss_dev"] <= loss_lim and row["grad_dev"] <= grad_lim,
        f"loss <= {loss_lim:.1e}, gradients <= {grad_lim:.1e}",
    )


def measured_peak(step, device: str) -> int:
    """Most bytes allocated above the start during ``step()``: the CUDA allocator's counters on a GPU,
    ``recompile_opt.costs.measure.peak_memory`` (the profiler's allocator records) on the CPU."""
    return measured_peaks(step, device)[0]


def measured_peaks(step, device: str) -> tuple[int, int | None]:
    """:func:`measured_peak`, and on CUDA the most bytes the step's requests held (the allocator's
    ``requested_bytes``: no rounding, no block held whole; what the walk of the code counts); None on
    the CPU, whose allocator records are the requests."""
    import torch

    gc.collect()
    if device != "cuda":
        from recompile_opt.costs.measure import peak_memory

        return peak_memory(step), None
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base, requested = torch.cuda.memory_allocated(), torch.cuda.memory_stats()["requested_bytes.all.current"]
    step()
    torch.cuda.synchronize()
    stats = torch.cuda.memory_stats()
    return torch.cuda.max_memory_allocated() - base, stats["requested_bytes.all.peak"] - requested


def step_peaks(model, fn, batch: tuple, *, device: str, dtype: str) -> dict:
    """The measured peak of a forward and backward entered with ``grad=None`` (what a plan's predicted
    peak counts: the gradients are part of it), in blocks and in requests, and of one entered with the
    gradients allocated. On CUDA in a steady step: the allocator's cache emptied, :data:`WARM_STEPS`
    run, then the one measured."""
    import torch

    def step():
        with autocast(device, dtype):
            loss = fn(*batch)
        loss.backward()

    model.zero_grad(set_to_none=True)
    if device == "cuda":
        gc.collect()
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        for _ in range(WARM_STEPS):
            step()
            model.zero_grad(set_to_none=True)
    peak, requested = measured_peaks(step, device)
    return {
        "peak_bytes": peak,
        "peak_requested_bytes": requested,
        "peak_grads_allocated_bytes": measured_peak(step, device),
    }


def kernel_launches(step, names: list[str]) -> dict:
    """How many CUDA kernels whose name contains one of ``names`` ``step()`` launched, per name
    (``torch.profiler``'s device events)."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        step()
    counts = dict.fromkeys(names, 0)
    for event in prof.events():
        if event.device_type == DeviceType.CUDA:
            for name in names:
                counts[name] += name in event.name
    return counts
