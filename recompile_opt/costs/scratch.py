"""Scratch of extern kernels: the bytes a convolution or an SDPA kernel allocates inside itself, above
its outputs, measured once per argument layout on the device it runs on.

Why: neither the graph nor Inductor's wrapper code shows a kernel's internal workspace, and on
convolutions it is large. On CPU, ``aten.convolution`` over 2x3x32x32 images in 8x8 patches makes
an im2col buffer of 24 KiB for a 4 KiB output, and ``convolution_backward`` allocates 48 KiB besides
its gradients; a tiny ViT measured 37% above its walked peak before this module. The workspace
depends on the backend's algorithm choice (im2col, MKL-DNN, cuDNN), not on a formula we could keep
true across versions, so it is measured: the op is run once on empty tensors of the node's layouts
under the allocator profiler (:func:`recompile_opt.costs.measure.allocation_timeline`; on CUDA the
caching allocator's peak of requested bytes), after one call unmeasured where the op compiles on its
first call (the chunked loss's fused body: ``ops.compiles_on_first_call``), and its peak within the
call less the bytes of its outputs is the scratch. A few milliseconds per distinct layout, cached for
the process.

Only ops known to allocate workspace are measured (:data:`recompile_opt.ops.SCRATCH`): every other
kernel's outputs are all it allocates. The meta device (planning without a step) has no kernel to
measure: 0.
"""

from __future__ import annotations

import logging

import torch
import torch.fx as fx

from recompile_opt import _torch_internals as ti
from recompile_opt.ops import compiles_on_first_call, has_scratch

log = logging.getLogger(__name__)

_MEASURED: dict[tuple, int] = {}
# set in a fork that walks plans with fewer threads than this process (costs/walk_pool.py): a workspace
# measured there could differ (SDPA's CPU kernel allocates per thread), so one not known yet raises
_REFUSED = False


class NotMeasuredHere(RuntimeError):
    """A workspace that this process may not measure (:func:`refuse_measuring`)."""


def refuse_measuring() -> None:
    """From now on a workspace not measured yet raises :class:`NotMeasuredHere` (in a walk's fork)."""
    global _REFUSED
    _REFUSED = True


def scratch_bytes(node: fx.Node, layouts: list[tuple[tuple, tuple]] | None = None) -> int:
    """Bytes ``node``'s kernel allocates above its outputs at its busiest, on the device of its
    arguments (0 for ops without workspace, the meta device, and symbolic shapes). ``layouts``: the
    (size, stride) its tensor arguments really have, in order, where the compiler changed them
    (Inductor's channels-last convolutions: their workspace differs)."""
    if not has_scratch(node):
        return 0
    strides = _strides(node, layouts)
    args = _layouts((node.args, node.kwargs), strides)
    if args is None:
        return 0
    key = (str(node.target), args)
    if key not in _MEASURED and _REFUSED:
        raise NotMeasuredHere(key[0])
    if key not in _MEASURED:
        try:
            warm_up = compiles_on_first_call(node)
            _MEASURED[key] = _measure(node.target, node.args, node.kwargs, strides, warm_up)
        except Exception as e:  # noqa: BLE001 - a refinement of the peak: a failure counts no scratch
            log.info("recompile_opt: the scratch of %s could not be measured: %r", node.target, e)
            _MEASURED[key] = 0
    return _MEASURED[key]


def _strides(node: fx.Node, layouts) -> list[tuple] | None:
    """The strides of ``node``'s tensor arguments from ``layouts``, where they describe the same
    tensors (as many, of the same sizes)."""
    tensors = [_val(leaf) for leaf in torch.utils._pytree.tree_leaves((node.args, node.kwargs))]
    tensors = [t for t in tensors if isinstance(t, torch.Tensor)]
    if (
        layouts is None
        or len(layouts) != len(tensors)
        or any(tuple(t.shape) != tuple(size) for t, (size, _) in zip(tensors, layouts))
    ):
        return None
    return [tuple(stride) for _, stride in layouts]


def _val(leaf):
    return leaf.meta.get("val") if isinstance(leaf, fx.Node) else leaf


def _layouts(tree, strides: list[tuple] | None) -> tuple | None:
    """The arguments as a hashable key: tensors by layout, everything else by value; None where a
    tensor cannot be made (meta, symbolic shapes)."""
    out, strides = [], iter(strides or ())
    for leaf in torch.utils._pytree.tree_leaves(tree):
        val = _val(leaf)
        if isinstance(val, torch.Tensor):
            layout = (tuple(val.shape), next(strides, tuple(val.stride())), val.storage_offset())
            if val.device.type == "meta" or any(
                isinstance(d, torch.SymInt) for d in (*layout[0], *layout[1])
            ):
                return None
            out.append((layout, str(val.dtype), str(val.device), val.requires_grad))
        elif isinstance(val, (torch.SymInt, torch.SymFloat)) or isinstance(leaf, fx.Node):
            return None
        else:
            out.append(repr(val))
    return tuple(out)


def _measure(target, args, kwargs, strides: list[tuple] | None, warm_up: bool = False) -> int:
    """The op run once on tensors of its arguments' layouts: its peak above the call less its outputs;
    ``warm_up``: after one call unmeasured (an op that compiles on its first call)."""
    from recompile_opt.costs.measure import allocation_timeline

    strides = iter(strides or ())

    def real(leaf):
        val = _val(leaf)
        if not isinstance(val, torch.Tensor):
            return val
        t = torch.empty_strided(val.shape, next(strides, val.stride()), dtype=val.dtype, device=val.device)
        return t.normal_() if t.is_floating_point() else t.zero_()

    with ti.real_tensors():
        args, kwargs = torch.utils._pytree.tree_map(real, (args, kwargs))
        device = next(
            (a.device for a in torch.utils._pytree.tree_leaves(args) if isinstance(a, torch.Tensor)),
            torch.device("cpu"),
        )
        if warm_up:  # first-call allocations (a compiled body compiling) are not the step's
            target(*args, **kwargs)
        outputs = []
        if device.type == "cuda":  # the caching allocator's own counters (exact, and no profiler)
            # its requested bytes, not its blocks: the scratch is replayed as a request of the walk,
            # which the allocator model (costs/cuda_allocator.py) rounds and places as it would
            torch.cuda.synchronize(device)
            torch.cuda.reset_peak_memory_stats(device)
            before = torch.cuda.memory_stats(device)["requested_bytes.all.current"]
            outputs.append(target(*args, **kwargs))
            torch.cuda.synchronize(device)
            peak = torch.cuda.memory_stats(device)["requested_bytes.all.peak"] - before
        else:
            peak = live = 0
            for nbytes in allocation_timeline(lambda: outputs.append(target(*args, **kwargs)), device):
                live += nbytes
                peak = max(peak, live)
    made = {
        t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
        for t in torch.utils._pytree.tree_leaves(outputs)
        if isinstance(t, torch.Tensor)
    }
    return max(peak - sum(made.values()), 0)
