"""A layout applied to a module's parameters (issue 22, step 4 of docs/parallel-design.md): each becomes
a DTensor over the mesh, under its own name, holding this rank's shard.

Why in place and under the same names: optimizer state, ``state_dict`` and checkpoints then see the
model's own parameter names, and ``full_tensor()`` of each (and of its gradient) is the unsharded
tensor of that name; a fused ``[q | k | v]`` weight keeps that global layout through DTensor's strided
shard. (The forward on the shards is step 5: until then a module with these parameters does not run.)
"""

from __future__ import annotations

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, Shard, distribute_tensor

from recompile_opt import _torch_internals as ti
from recompile_opt.parallel.layout import Layout, ModuleLayout


def distribute_parameters(model: torch.nn.Module, layout: Layout, mesh: DeviceMesh) -> None:
    """Every parameter of ``model`` replaced by a DTensor placed as ``layout`` says (any module it does
    not name: replicated). The values are this rank's copy of the full tensors, which every rank must
    hold alike (the same seed or checkpoint), as for ``distribute_tensor``."""
    if mesh.ndim != 1:
        raise ValueError(f"recompile_opt.parallel: a 1-D device mesh is needed, got {mesh.ndim}-D")
    if mesh.size() != layout.tp:
        raise ValueError(f"recompile_opt.parallel: the layout is for {layout.tp} ranks, the mesh has {mesh.size()}")
    by_module = {m.module: m for m in layout.modules}
    for path, module in model.named_modules():
        entry = by_module.get(path)
        for name, param in list(module.named_parameters(recurse=False)):
            placement = placement_of(entry, name)
            shard = distribute_tensor(param.detach(), mesh, [placement])
            module.register_parameter(name, torch.nn.Parameter(shard, requires_grad=param.requires_grad))


def placement_of(entry: ModuleLayout | None, name: str):
    """A parameter's placement: a column's weight and bias split by output features (strided for a fused
    output), a row's weight by input features (its bias added once, after the sum: replicated), a
    vocabulary-parallel embedding's rows; everything else replicated."""
    if entry is None:
        return Replicate()
    if entry.style == "column":
        if entry.placement.startswith("_StridedShard"):
            return ti.strided_shard(0, int(entry.placement.split(",")[1].rstrip(")")))
        return Shard(0)
    if entry.style == "row" and name == "weight":
        return Shard(1)
    if entry.style == "vocab":
        return Shard(0)
    return Replicate()
