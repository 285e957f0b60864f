"""Tensor + sequence parallelism found from the graph (Megatron-LM's layout, Korthikanti et al. 2022):

    mesh = init_device_mesh("cuda", (world_size,))
    model = recompile_opt.parallelize(model, mesh, (tokens, targets))   # parameters become DTensors
    model = torch.compile(model, backend="recompile_opt", options={"memory_budget": "6GiB"})
    print(recompile_opt.parallel_plan(model))

The modules: :mod:`.layout` finds the column/row-parallel pairs and the sequence-parallel regions in
the exported graph, :mod:`.module` places the parameters, :mod:`.rewrite` writes each rank's forward,
:mod:`.collectives` holds the transitions' autograd rules and :mod:`.dropout` the masks on shards.
The design and what is still to come: docs/parallel-design.md.
"""

from __future__ import annotations

import functools

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from recompile_opt.parallel.layout import Layout, find_layout
from recompile_opt.parallel.module import distribute_parameters
from recompile_opt.parallel.rewrite import install, local_forward
from recompile_opt.parallel.signatures import Derive, meta_twin

__all__ = ["parallelize", "parallel_plan"]


def parallelize(
    model: torch.nn.Module, mesh: DeviceMesh, example_inputs, *, sequence_parallel: bool = True
) -> torch.nn.Module:
    """``model`` laid out over the 1-D ``mesh`` as Megatron's tensor (+ sequence) parallelism, in place:
    its parameters become DTensors under their own names (``full_tensor()`` is the unsharded tensor),
    and its forward takes the same full inputs on every rank and returns the same full outputs.

    ``example_inputs``: inputs like those the model will be called with (only their shapes and dtypes
    matter; meta tensors are fine). The layout is found once, in the graph captured with them in the
    model's current train/eval mode; a call with other shapes (any batch size, any sequence length
    divisible by the mesh) or in the other mode gets its own rank's graph in the same layout, made at
    its first call (:mod:`recompile_opt.parallel.signatures`).
    Every rank must hold the same parameter values (the same seed or checkpoint) and draw from the
    same generator state (dropout's masks are one process's masks, each rank applying its slice)."""
    tp, rank = _check_mesh(mesh)
    device = _device_of(model)
    if device.type not in ("meta", mesh.device_type):
        raise ValueError(
            f"recompile_opt.parallelize: the model is on {device.type!r} and the mesh on "
            f"{mesh.device_type!r}; move the model to the mesh's device (or to 'meta' to plan)"
        )
    inputs = tuple(example_inputs) if isinstance(example_inputs, (tuple, list)) else (example_inputs,)
    inputs = tuple(_on(t, device) for t in inputs)
    layout = find_layout(model, inputs, tp, sequence_parallel=sequence_parallel)
    rank_graph = functools.partial(
        local_forward, group_name=mesh.get_group().group_name, rank=rank, device=device
    )
    graph = rank_graph(layout)  # checks the sequence splits
    derive = Derive(meta_twin(model), layout, rank_graph, device)  # before the parameters are sharded
    distribute_parameters(model, layout, mesh)
    install(model, layout, graph, derive)
    model._recompile_opt_layout = layout
    return model


def parallel_plan(model: torch.nn.Module) -> Layout:
    """The layout :func:`parallelize` gave ``model``: each module's style (column, row, sequence, vocab,
    replicated), its weight's placement and why; ``print`` it for a table."""
    layout = getattr(model, "_recompile_opt_layout", None)
    if layout is None:
        layout = getattr(getattr(model, "_orig_mod", None), "_recompile_opt_layout", None)  # torch.compile'd
    if layout is None:
        raise ValueError(
            "recompile_opt.parallel_plan: this model was not laid out by recompile_opt.parallelize"
        )
    return layout


def _check_mesh(mesh) -> tuple[int, int]:
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError(
            "recompile_opt.parallelize: torch.distributed is not initialised: call "
            "torch.distributed.init_process_group (torchrun sets its environment), then "
            "make the mesh with torch.distributed.device_mesh.init_device_mesh"
        )
    if not isinstance(mesh, DeviceMesh):
        raise TypeError(
            f"recompile_opt.parallelize: mesh must be a DeviceMesh (init_device_mesh), got "
            f"{type(mesh).__name__}"
        )
    if mesh.ndim != 1:
        raise ValueError(
            f"recompile_opt.parallelize: a 1-D device mesh is needed (the tensor-parallel group), "
            f"got a {mesh.ndim}-D mesh of shape {tuple(mesh.shape)}; pass mesh['tp'] of a larger one"
        )
    return mesh.size(), mesh.get_local_rank()


def _device_of(model: torch.nn.Module) -> torch.device:
    for t in list(model.parameters()) + list(model.buffers()):
        return t.device
    return torch.device("cpu")


def _on(t, device: torch.device):
    """An example input on the model's device (only its shape and dtype matter to the capture)."""
    if not isinstance(t, torch.Tensor) or t.device == device:
        return t
    if t.device.type == "meta":
        return torch.zeros(t.shape, dtype=t.dtype, device=device)
    return t.to(device)
