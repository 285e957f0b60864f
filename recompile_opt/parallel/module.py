"""A layout applied to a module's parameters (issue 22, step 4 of docs/parallel-design.md): each becomes
a DTensor over the mesh, under its own name, holding this rank's shard.

Why in place and under the same names: optimizer state, ``state_dict`` and checkpoints then see the
model's own parameter names, and ``full_tensor()`` of each (and of its gradient) is the unsharded
tensor of that name; a fused ``[q | k | v]`` weight keeps that global layout through DTensor's strided
shard. (The forward on the shards is step 5: until then a module with these parameters does not run.)
"""

from __future__ import annotations

import re

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
    holders: dict[int, list] = {}  # a parameter -> the (module, name) holding it: tied weights share one
    for path, module in model.named_modules(remove_duplicate=False):
        for name, param in module.named_parameters(recurse=False):
            holders.setdefault(id(param), []).append((path, module, name, param))
    for held in holders.values():
        placements = {placement_of(by_module.get(path), name) for path, _, name, _ in held} - {Replicate()}
        if len(placements) > 1:
            raise ValueError(f"recompile_opt.parallel: the tied parameter {', '.join(p + '.' + n for p, _, n, _ in held)} "
                             f"would be split in different ways ({sorted(map(str, placements))})")
        param = held[0][3]
        shard = distribute_tensor(param.detach(), mesh, [placements.pop() if placements else Replicate()])
        new = torch.nn.Parameter(shard, requires_grad=param.requires_grad)
        for _, module, name, _ in held:  # one DTensor for every holder: a tie stays a tie
            module.register_parameter(name, new)


def placement_of(entry: ModuleLayout | None, name: str):
    """A parameter's placement: a column's weight and bias split by output features (strided for a fused
    output), a row's weight by input features (its bias added once, after the sum: replicated), a
    vocabulary-parallel embedding's rows; everything else replicated. The weight's dimension is the
    layout's (1 for a column weight laid out ``[in, out]``, GPT-2's Conv1D); a bias has one dimension."""
    if entry is None:
        return Replicate()
    dim, pieces = _dim_and_pieces(entry.placement)
    if entry.style == "column":
        dim = dim if name == "weight" else 0
        return ti.strided_shard(dim, pieces) if pieces > 1 else Shard(dim)
    if entry.style == "row" and name == "weight":
        return Shard(dim)
    if entry.style == "vocab":
        return Shard(0)
    return Replicate()


def _dim_and_pieces(placement: str) -> tuple[int, int]:
    """``"Shard(1)"`` -> (1, 1); ``"_StridedShard(0, 3)"`` -> (0, 3); ``"Replicate"`` -> (0, 1)."""
    numbers = [int(n) for n in re.findall(r"\d+", placement)]
    return (numbers + [0, 1])[0], (numbers[1:] + [1])[0]
