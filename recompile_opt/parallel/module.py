"""A layout applied to a module's parameters (issue 22, step 4 of docs/parallel-design.md): each becomes
a DTensor over the mesh, under its own name, holding this rank's shard.

Why in place and under the same names: optimizer state, ``state_dict`` and checkpoints then see the
model's own parameter names, and ``full_tensor()`` of each (and of its gradient) is the unsharded
tensor of that name; a fused ``[q | k | v]`` weight keeps that global layout through DTensor's strided
shard. (The forward on the shards is step 5: until then a module with these parameters does not run.)
"""

from __future__ import annotations

import re
import weakref

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.optim.optimizer import register_optimizer_step_pre_hook

from recompile_opt import _torch_internals as ti
from recompile_opt.parallel.layout import Layout, ModuleLayout


def distribute_parameters(model: torch.nn.Module, layout: Layout, mesh: DeviceMesh) -> None:
    """Every parameter of ``model`` replaced by a DTensor placed as ``layout`` says (any module it does
    not name: replicated). The values are this rank's copy of the full tensors, which every rank must
    hold alike (the same seed or checkpoint), as for ``distribute_tensor``."""
    if mesh.ndim != 1:
        raise ValueError(f"recompile_opt.parallel: a 1-D device mesh is needed, got {mesh.ndim}-D")
    if mesh.size() != layout.tp:
        raise ValueError(
            f"recompile_opt.parallel: the layout is for {layout.tp} ranks, the mesh has {mesh.size()}"
        )
    by_module = {m.module: m for m in layout.modules}
    holders: dict[int, list] = {}  # a parameter -> the (module, name) holding it: tied weights share one
    for path, module in model.named_modules(remove_duplicate=False):
        for name, param in module.named_parameters(recurse=False):
            holders.setdefault(id(param), []).append((path, module, name, param))
    for held in holders.values():
        placements = {placement_of(by_module.get(path), name) for path, _, name, _ in held} - {Replicate()}
        if len(placements) > 1:
            raise ValueError(
                f"recompile_opt.parallel: the tied parameter {', '.join(p + '.' + n for p, _, n, _ in held)} "
                f"would be split in different ways ({sorted(map(str, placements))})"
            )
        param = held[0][3]
        shard = distribute_tensor(param.detach(), mesh, [placements.pop() if placements else Replicate()])
        new = torch.nn.Parameter(shard, requires_grad=param.requires_grad)
        for _, module, name, _ in held:  # one DTensor for every holder: a tie stays a tie
            module.register_parameter(name, new)
    model.register_state_dict_post_hook(_replicate_strided)
    model.register_load_state_dict_pre_hook(_placed)
    _hook_optimizers()


# Checkpoints. DCP cannot save a strided shard (torch 2.13): it writes one chunk per rank at the
# shard's first offset, so a fused [q | k | v] weight's chunks overlap and ``dcp.save`` raises
# ("overlapping chunks"; docs/parallel-design.md, Q1). So ``state_dict()`` gives each strided parameter
# replicated (one transient full copy per parameter, as a checkpoint of it reads anyway), and
# ``load_state_dict`` puts a value back in its parameter's placement: a replicated one, or a full
# plain tensor (the unparallelized model's own state dict, which DTensor's ``copy_`` refuses). Every
# other saved parameter stays as DTensor made it. A fix in DCP would make the first hook unneeded.


def _replicate_strided(module: torch.nn.Module, state_dict: dict, prefix: str, local_metadata) -> None:
    for name, param in module.named_parameters(prefix=prefix.rstrip("."), remove_duplicate=False):
        if _strided(param) and name in state_dict:
            state_dict[name] = _replicated(state_dict[name], param)


def _placed(module: torch.nn.Module, state_dict: dict, prefix: str, *args) -> None:
    for name, param in module.named_parameters(prefix=prefix.rstrip("."), remove_duplicate=False):
        value = state_dict.get(name)
        if (
            not isinstance(param, DTensor)
            or not isinstance(value, torch.Tensor)
            or value.shape != param.shape
        ):
            continue  # (a wrong shape is load_state_dict's to report)
        if isinstance(value, DTensor):
            state_dict[name] = _placed_as(value, param)
        else:
            state_dict[name] = distribute_tensor(value.to(param.device), param.device_mesh, param.placements)


# An optimizer's state of a strided parameter (Adam's ``exp_avg``) is strided too. The optimizer is made
# after ``parallelize``, so a global step hook gives each optimizer that steps a strided parameter the
# same pair of hooks on its own state dict (DCP's ``get_optimizer_state_dict`` steps it once first).
_OPTIMIZERS_HOOKED: weakref.WeakSet = weakref.WeakSet()
_STEP_HOOK = []


def _hook_optimizers() -> None:
    if not _STEP_HOOK:
        _STEP_HOOK.append(register_optimizer_step_pre_hook(_on_step))


def _on_step(optimizer: torch.optim.Optimizer, *_) -> None:
    if optimizer in _OPTIMIZERS_HOOKED:
        return
    _OPTIMIZERS_HOOKED.add(optimizer)
    if any(_strided(p) for group in optimizer.param_groups for p in group["params"]):
        optimizer.register_state_dict_post_hook(_optimizer_state_replicated)
        optimizer.register_load_state_dict_pre_hook(_optimizer_state_placed)


def _optimizer_state_replicated(optimizer: torch.optim.Optimizer, state_dict: dict) -> dict:
    return _optimizer_state_mapped(optimizer, state_dict, _replicated)


def _optimizer_state_placed(optimizer: torch.optim.Optimizer, state_dict: dict) -> dict:
    return _optimizer_state_mapped(optimizer, state_dict, _placed_as)


def _optimizer_state_mapped(optimizer, state_dict: dict, change) -> dict:
    """``state_dict`` with ``change(value, param)`` for each DTensor of a strided parameter's state
    shaped as the parameter (``step`` and other scalars are left), without changing the caller's dict."""
    # the state's keys are the groups' entries (ids from ``state_dict()``, names from DCP's functions),
    # in the order of the optimizer's own groups, as ``load_state_dict`` pairs them
    keys = [key for group in state_dict.get("param_groups", ()) for key in group["params"]]
    by_key = dict(zip(keys, (p for group in optimizer.param_groups for p in group["params"])))
    state = {}
    for key, entry in state_dict["state"].items():
        param = by_key.get(key)
        if param is not None and _strided(param):
            entry = {
                k: change(v, param) if isinstance(v, DTensor) and v.shape == param.shape else v
                for k, v in entry.items()
            }
        state[key] = entry
    return {**state_dict, "state": state}


def _replicated(value: DTensor, param: DTensor) -> DTensor:
    return value.redistribute(param.device_mesh, [Replicate()] * param.device_mesh.ndim)


def _placed_as(value: DTensor, param: DTensor) -> DTensor:
    return (
        value
        if value.placements == param.placements
        else value.redistribute(param.device_mesh, param.placements)
    )


def _strided(param: torch.Tensor) -> bool:
    return isinstance(param, DTensor) and any(ti.is_strided_shard(p) for p in param.placements)


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
