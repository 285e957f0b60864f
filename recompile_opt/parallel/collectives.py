"""Megatron's tensor- and sequence-parallel transitions as differentiable functions over torch's
functional collectives, so they trace into the joint graph as ``_c10d_functional`` ops the planner
can see, cost and (for an all-gather) recompute.

Why functions of our own: the transitions are conjugate pairs, and torch registers only some of them.
An all-gather's registered backward is a reduce-scatter and a reduce-scatter's is an all-gather
(``all_gather_single_autograd``, ``reduce_scatter_single_autograd``;
``_torch_internals.functional_collectives``): those are used as they are.
An all-reduce's registered backward is another all-reduce, not Megatron's identity, so tensor
parallelism without sequence parallelism needs its own pair (``f``: identity forward, all-reduce
backward; ``g``: all-reduce forward, identity backward); ``f`` is also what makes the gradient of a
replicated parameter used on a sequence shard (a norm weight) the sum over the ranks.

Every function takes the process group (or its name, or a 1-D ``DeviceMesh``) and works on the
sequence dimension ``dim`` of a ``[b, s, h]`` activation (Megatron's layout is ``[s, b, h]``; dim 1 costs
a copy in the gather's ``cat`` where b > 1).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from recompile_opt import _torch_internals as ti

funcol = ti.functional_collectives()


def copy_to_tensor_parallel(x: torch.Tensor, group) -> torch.Tensor:
    """Megatron's ``f``: ``x`` as it is, its gradient summed over the group."""
    return _CopyToGroup.apply(x, _name(group))


def copy_all_to_tensor_parallel(xs: list[torch.Tensor], group) -> tuple[torch.Tensor, ...]:
    """``f`` on several tensors of one dtype at once: each as it is, their gradients summed over the
    group by one all-reduce (the parameters a sequence-parallel rank reads on its rows, e.g. every norm
    weight: one collective per step, not one per weight)."""
    return _CopyAllToGroup.apply(_name(group), *xs)


def reduce_from_tensor_parallel(x: torch.Tensor, group) -> torch.Tensor:
    """Megatron's ``g``: the partial sums of a row-parallel layer added up on every rank; the gradient
    passes through as it is."""
    return _ReduceFromGroup.apply(x, _name(group))


def gather_sequence(x: torch.Tensor, group, dim: int = 1) -> torch.Tensor:
    """Every rank's sequence shard, concatenated along ``dim`` (before a column-parallel layer); the
    gradient is reduce-scattered back to the shards."""
    return funcol.all_gather_autograd(x.contiguous(), dim, _name(group))


def gather_sequence_for_replicated(
    x: torch.Tensor, group, dim: int = 1, *, size: int | None = None, rank: int | None = None
) -> torch.Tensor:
    """Every rank's sequence shard, concatenated along ``dim``, for a computation every rank then repeats
    whole (the LM head and the loss): each rank's gradient is already the whole one, so the backward
    keeps this rank's slice of it rather than summing the ranks' (which would count it t times).
    ``size``/``rank``: the group's, where the caller knows them (compiled code cannot look them up
    without a graph break)."""
    name, size, rank = _name_size_rank(group, size, rank)
    return _GatherToReplicated.apply(x, name, dim, size, rank)


def gather_features_for_replicated(
    x: torch.Tensor, group, dim: int = -1, *, size: int | None = None, rank: int | None = None
) -> torch.Tensor:
    """A column-parallel layer's output features whole, for an op every rank then repeats whole (the
    loss after the LM head, as ``ColwiseParallel(output_layouts=Replicate())``): the same exchange, and
    the same backward (this rank's slice of the whole gradient), as :func:`gather_sequence_for_replicated`."""
    return gather_sequence_for_replicated(x, group, dim % x.dim(), size=size, rank=rank)


def reduce_scatter_sequence(x: torch.Tensor, group, dim: int = 1) -> torch.Tensor:
    """The partial sums of a row-parallel layer added up and this rank's sequence shard kept (after a
    row-parallel layer); the gradient is all-gathered."""
    return funcol.reduce_scatter_autograd(x.contiguous(), "sum", dim, _name(group))


def split_sequence(
    x: torch.Tensor, group, dim: int = 1, *, size: int | None = None, rank: int | None = None
) -> torch.Tensor:
    """This rank's shard of a replicated ``x`` along ``dim``, as a tensor of its own (a view would keep
    the whole input alive for as long as the shard is kept); the gradient is all-gathered."""
    name, size, rank = _name_size_rank(group, size, rank)
    if x.shape[dim] % size:
        raise ValueError(
            f"recompile_opt.parallel: dimension {dim} of size {x.shape[dim]} does not split over {size} ranks"
        )
    return _SplitToShard.apply(x, name, dim, size, rank)


def _name(group) -> str:
    """The group's registered name, which the functional collectives and the traced graph carry."""
    return group if isinstance(group, str) else _group(group).group_name


def _name_size_rank(group, size: int | None, rank: int | None) -> tuple[str, int, int]:
    if size is not None and rank is not None:
        return _name(group), size, rank
    pg = _group(group)
    return pg.group_name, dist.get_world_size(pg), dist.get_rank(pg)


def _group(group) -> dist.ProcessGroup:
    if isinstance(group, torch.distributed.device_mesh.DeviceMesh):
        if group.ndim != 1:
            raise ValueError(f"recompile_opt.parallel: a 1-D device mesh is needed, got {group.ndim}-D")
        return group.get_group()
    if isinstance(group, str):
        return dist.distributed_c10d._resolve_process_group(group)
    return group


class _CopyToGroup(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, name):
        ctx.name = name
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return funcol.all_reduce(grad.contiguous(), "sum", ctx.name), None


class _CopyAllToGroup(torch.autograd.Function):
    @staticmethod
    def forward(ctx, name, *xs):
        ctx.name, ctx.shapes, ctx.dtype, ctx.device = name, [x.shape for x in xs], xs[0].dtype, xs[0].device
        return tuple(x.view_as(x) for x in xs)

    @staticmethod
    def backward(ctx, *grads):
        flat = torch.cat(
            [
                (g if g is not None else torch.zeros(s, dtype=ctx.dtype, device=ctx.device)).reshape(-1)
                for g, s in zip(grads, ctx.shapes)
            ]
        )  # None: an output the loss never read
        summed = funcol.all_reduce(flat, "sum", ctx.name)
        sizes = [s.numel() for s in ctx.shapes]
        return (None, *(piece.view(s) for piece, s in zip(summed.split(sizes), ctx.shapes)))


class _ReduceFromGroup(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, name):
        return funcol.all_reduce(x.contiguous(), "sum", name)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


def copy_of_rows(x: torch.Tensor, dim: int, start: int, length: int) -> torch.Tensor:
    """``x.narrow(dim, start, length)`` as a tensor of its own. Why not ``narrow(...).clone()``:
    Inductor's joint-graph pass ``remove_noop_ops`` drops a clone whose size and strides equal its
    input's, which a contiguous slice's do (the sequence rows of a ``[1, s, h]`` batch), so the kept
    shard was a view keeping the whole sequence alive (7x the bytes at t = 8). An ``index_select`` of
    the rows is a copy no pass removes; Inductor lowers it to one strided read."""
    return x.index_select(dim, torch.arange(start, start + length, device=x.device))


class _SplitToShard(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, name, dim, size, rank):
        ctx.name, ctx.dim = name, dim
        step = x.shape[dim] // size
        return copy_of_rows(x, dim, rank * step, step)

    @staticmethod
    def backward(ctx, grad):
        return funcol.all_gather(grad.contiguous(), ctx.dim, ctx.name), None, None, None, None


class _GatherToReplicated(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, name, dim, size, rank):
        ctx.dim, ctx.rank, ctx.rows = dim, rank, x.shape[dim]
        return funcol.all_gather(x.contiguous(), dim, name)

    @staticmethod
    def backward(ctx, grad):
        return grad.narrow(ctx.dim, ctx.rank * ctx.rows, ctx.rows).contiguous(), None, None, None, None


def waited(x):
    """``x`` waited for where it is a collective's pending result (an ``AsyncCollectiveTensor``, which
    eager functional collectives return), as a plain tensor whose gradient passes through; any other
    value as it is. Why: such a tensor handed to a module FSDP2 wraps, then to a compiled forward,
    lost its gradient (Hugging Face Llama's first layer, whose input is the embedding's
    reduce-scatter: the embedding's gradient came back zero)."""
    if isinstance(x, funcol.pending):
        return _Waited.apply(x)
    return x


class _Waited(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.trigger_wait()

    @staticmethod
    def backward(ctx, grad):
        return grad
