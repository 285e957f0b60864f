"""A plan's peak on a CUDA device as the caching allocator counts it: the walk of the code Inductor
generated for it replayed through :mod:`recompile_opt.costs.cuda_allocator`.

Why: ``torch.cuda.max_memory_allocated``, what users and the GPU check read, counts the allocator's
blocks, not the bytes the code asks for; a block of its large pool is split only where more than 1 MiB
would remain, so a step can hold up to that much more per large buffer than its walk. The plan states
the blocks' figure (its predicted peak, the one ``peak_memory`` is held to) and the walk's beside it
(``planning.in_allocator_blocks``).
"""

from __future__ import annotations

import logging

import torch
import torch.fx as fx

from recompile_opt import _torch_internals as ti
from recompile_opt.costs import cuda_allocator
from recompile_opt.costs.inductor_peak import exact_peak, why_not_walkable
from recompile_opt.costs.kernels import nbytes

log = logging.getLogger(__name__)


def on_cuda(gm: fx.GraphModule) -> bool:
    """Whether ``gm``'s tensors live on a CUDA device (the inputs tell)."""
    vals = (n.meta.get("val") for n in gm.graph.find_nodes(op="placeholder"))
    return any(isinstance(v, torch.Tensor) and v.device.type == "cuda" for v in vals)


def baseline_bytes(gm: fx.GraphModule) -> list[int]:
    """The bytes of the joint graph's primal inputs (parameters, buffers, data) in their order: what
    the device holds before a step (``model.to("cuda")`` allocates the parameters in about this order)."""
    return [
        nbytes(n)
        for n in gm.graph.find_nodes(op="placeholder")
        if not n.name.startswith("tangents") and isinstance(n.meta.get("val"), torch.Tensor)
    ]


def step_events(simulate, saved: set, recomputed: set, compiled: tuple | None) -> list | None:
    """The plan's allocations and frees over a step, in order (:mod:`.cuda_allocator`'s events):
    ``compiled``'s code walked again (``fw, bw, codes``, ``planning.DeferredWalk``: no lowering), else
    the plan partitioned and both its graphs lowered here. None where it cannot be walked."""
    events: list = []
    try:
        if compiled is not None:
            fw, bw, codes = compiled
            exact_peak(fw, bw, num_fwd_outputs=simulate.num_fwd_outputs, compiled=codes, allocations=events)
            return events
        with simulate.lowering_layout():  # lowered as the walk lowered it
            fw, bw = simulate.partitioned(saved, recomputed)
            if why_not_walkable(fw, bw):
                return None
            exact_peak(fw, bw, num_fwd_outputs=simulate.num_fwd_outputs, allocations=events)
    except Exception as e:  # noqa: BLE001 - a refinement: without it the walked figure stands
        log.info("recompile_opt: the plan's allocations could not be listed: %r", e)
        return None
    return events


def blocks_peak(simulate, saved: set, recomputed: set, compiled: tuple | None) -> tuple[int | None, str]:
    """The plan's peak in the caching allocator's blocks over a steady step (its baseline: the joint
    graph's primals) and how the blocks were split; or None and why it is not modelled (a setting the
    model does not follow, the code's allocations not listed)."""
    settings = cuda_allocator.parse(*ti.cuda_allocator_settings())
    if settings.unmodelled:
        return None, f"{', '.join(settings.unmodelled)} not modelled"
    events = step_events(simulate, saved, recomputed, compiled)
    if events is None:
        return None, "the code's allocations could not be listed"
    blocks = cuda_allocator.step_peak(events, baseline_bytes(simulate.gm), settings)
    if settings.expandable_segments:
        return blocks, "every block split: expandable_segments"
    return blocks, "large-pool blocks split only where more than 1 MiB remains"
