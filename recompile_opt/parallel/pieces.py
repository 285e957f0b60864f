"""The rank's graph run module by module where submodules have hooks (issue 49): FSDP2's ``fully_shard``
per block, an activation hook, anything that must fire when a block is called.

Why: the rank's graph is the whole model's forward in one, so it calls no submodule, and a hook on a
block would be bypassed (FSDP2 would never gather the block's parameters). Here the graph is cut into
pieces at the hooked modules' boundaries, as the nodes' module paths say: a hooked module's nodes (and
any of the root's between its first and last) form one piece, run by calling that module, so its
hooks fire around it and it reads its own parameters inside the call, where FSDP2 has just gathered
them. The root's pieces run in the root's forward. Nothing is recomputed or reordered: the pieces, run
in order, are the graph.
"""

from __future__ import annotations

import operator
import warnings
from dataclasses import dataclass

import torch
import torch.fx as fx
from torch.distributed.tensor import DTensor

from recompile_opt import _torch_internals as ti
from recompile_opt.parallel import collectives as C
from recompile_opt.parallel.layout import _stack_path

PIECE = "_recompile_opt_piece"  # the keyword a hooked module's forward is called with


@dataclass
class Piece:
    """One run of the rank's graph: ``module`` ("" for the root) calls ``graph`` on ``inputs`` (values
    named as in the rank's graph) followed by its own parameters ``own`` (targets relative to it), and
    its results are the values ``outputs``."""

    module: str
    graph: fx.GraphModule
    inputs: list[str]
    own: list[str]
    outputs: list[str]


def split(
    rank_graph: fx.GraphModule, params: dict[str, str], hooked: list[str]
) -> tuple[list[Piece], object]:
    """``rank_graph`` cut into pieces for the ``hooked`` module paths (none inside another); ``params``
    maps each parameter placeholder to its target. Raises where a hooked module's nodes are not one
    run, or a piece reads a parameter of a hooked module outside that module's call. Also returns the
    graph's outputs as the names of the values they are."""
    gm = fx.GraphModule(rank_graph, _copied(rank_graph.graph))
    _split_gradient_sums(gm.graph, params, hooked)
    ops = [n for n in gm.graph.nodes if n.op not in ("placeholder", "output")]
    units = [_unit(n, hooked) for n in ops]
    spans = _spans(units, hooked)
    pieces, start = [], 0
    for module, (first, last) in sorted(spans.items(), key=lambda kv: kv[1][0]):
        if first > start:
            pieces.append(("", ops[start:first]))
        pieces.append((module, ops[first : last + 1]))
        start = last + 1
    if start < len(ops):
        pieces.append(("", ops[start:]))
    (output,) = gm.graph.find_nodes(op="output")
    names = fx.map_arg(output.args[0], lambda n: n.name)
    return [_piece(gm, module, nodes, params, hooked) for module, nodes in pieces], names


def piece_forward(self, *args, **kwargs):
    """The forward every submodule of a parallelized model gets: called with a piece (:data:`PIECE`) it
    runs it on its own parameters; called by anything else, the module's own forward."""
    piece = kwargs.pop(PIECE, None)
    if piece is None:
        return type(self).forward(self, *args, **kwargs)
    own = [_local(self.get_parameter(target)) for target in piece.own]
    return piece.graph(*args, *own)


def run(pieces: list[Piece], root: torch.nn.Module, values: dict[str, object], outputs) -> object:
    """The pieces run in order from the rank graph's placeholder ``values`` (the root's parameters read
    by the caller); ``outputs`` (the rank graph's output argument, as names) filled in."""
    for piece in pieces:
        args = [values[name] for name in piece.inputs]
        if piece.module:
            args = [C.waited(a) for a in args]
            results = root.get_submodule(piece.module)(*args, **{PIECE: piece})
        else:
            results = piece.graph(*args)
        values.update(zip(piece.outputs, (results,) if len(piece.outputs) == 1 else results))
    return fx.node.map_aggregate(outputs, lambda n: values[n] if isinstance(n, str) else n)


def warn_strided_resharded(model: torch.nn.Module) -> None:
    """A warning naming the parameters FSDP2 shards again on the dimension of a strided tensor-parallel
    shard (a fused QKV's ``_StridedShard(0, 3)``). Why: FSDP2 (torch 2.11-2.13) describes its dim-0
    shard of such a parameter with placements that read the tensor-parallel shard as split after it,
    not before (2.13: as if it were a plain ``Shard``); its local shards are what training needs (the
    steps are exact), but ``full_tensor()``, ``redistribute`` and a checkpoint loaded into another
    layout read the parameter with its rows permuted."""
    strided = [
        name
        for name, p in model.named_parameters()
        if isinstance(p, DTensor) and p.device_mesh.ndim > 1 and _resharded_stride(p.placements)
    ]
    if strided:
        warnings.warn(
            f"recompile_opt.parallelize: FSDP shards {strided[0]!r}"
            + (f" (and {len(strided) - 1} more)" if len(strided) > 1 else "")
            + " again on the dimension its tensor-parallel layout splits with a stride (a fused "
            "projection's parts); training is exact, but its DTensor placements do not describe its "
            "shards: full_tensor(), redistribute and a checkpoint loaded into another layout read its rows "
            "permuted (torch's FSDP2 limit). Unfuse the projection to avoid it",
            stacklevel=2,
        )


def _resharded_stride(placements) -> bool:
    """The tensor-parallel placement (the last) a strided shard, and another placement sharding its
    dimension (FSDP2 puts ``Shard(0)`` there on torch 2.11, ``_StridedShard(0, dp)`` on 2.13; over a
    plain ``Shard(0)`` its ``_StridedShard(0, dp)`` describes the shards right)."""
    last = placements[-1]
    return ti.is_strided_shard(last) and any(getattr(p, "dim", None) == last.dim for p in placements[:-1])


def _local(p):
    return p.to_local() if isinstance(p, DTensor) else p


def _copied(graph: fx.Graph) -> fx.Graph:
    out = fx.Graph()
    out.output(out.graph_copy(graph, {}))
    return out


def _owner(path: str, hooked: list[str]) -> str:
    """The hooked module ``path`` (a module's or a parameter's) lies in, "" for none."""
    return next((m for m in hooked if path == m or path.startswith(m + ".")), "")


def _unit(node: fx.Node, hooked: list[str]) -> str:
    return _owner(_stack_path(node), hooked)


def _spans(units: list[str], hooked: list[str]) -> dict[str, tuple[int, int]]:
    """Each hooked module's first and last node; another hooked module's node between them is an error
    (its calls would interleave)."""
    spans: dict[str, tuple[int, int]] = {}
    for i, unit in enumerate(units):
        if unit:
            first, _ = spans.get(unit, (i, i))
            spans[unit] = (first, i)
    for unit, (first, last) in spans.items():
        inside = {u for u in units[first : last + 1] if u and u != unit}
        if inside:
            raise ValueError(
                f"recompile_opt.parallelize: module {unit!r} has hooks, but its forward's work is "
                f"interleaved with that of {sorted(inside)[0]!r}, which has hooks too; the parallelized "
                "model calls each hooked module once, for one run of its work"
            )
    return spans


def _split_gradient_sums(graph: fx.Graph, targets: dict[str, str], hooked: list[str]) -> None:
    """The one all-reduce of the shard-read parameters' gradients (``rewrite._sum_gradients``) made one
    per hooked module, placed before its first use there: each block's parameters exist (FSDP2 has them
    gathered) only inside the block's call."""
    for node in list(graph.find_nodes(op="call_function", target=C.copy_all_to_tensor_parallel)):
        params, group = node.args
        reads = {i: g for g in node.users for i in [g.args[1]]}
        by_unit: dict[str, list[int]] = {}
        for i, param in enumerate(params):
            unit = _owner(targets.get(param.name, ""), hooked) or _owner(_first_use(reads.get(i)), hooked)
            by_unit.setdefault(unit, []).append(i)
        if len(by_unit) == 1 and "" in by_unit:
            continue
        for indices in by_unit.values():
            uses = [u for i in indices if i in reads for u in reads[i].users]
            first = min(uses, key=_order(graph)) if uses else node
            with graph.inserting_before(first):
                copy = graph.call_function(node.target, ([params[i] for i in indices], group))
                copy.meta.update(first.meta)
                for j, i in enumerate(indices):
                    if i in reads:
                        get = graph.call_function(operator.getitem, (copy, j))
                        get.meta.update(first.meta)
                        reads[i].replace_all_uses_with(get)
        for g in list(node.users):
            graph.erase_node(g)
        graph.erase_node(node)


def _first_use(get: fx.Node | None) -> str:
    users = list(get.users) if get is not None else []
    return _stack_path(users[0]) if users else ""


def _order(graph: fx.Graph):
    index = {n: i for i, n in enumerate(graph.nodes)}
    return index.__getitem__


def _piece(gm: fx.GraphModule, module: str, nodes: list[fx.Node], params: dict, hooked: list[str]) -> Piece:
    inside = set(nodes)
    inputs = [a for a in dict.fromkeys(a for n in nodes for a in n.all_input_nodes) if a not in inside]
    own, outer = [], []
    for a in inputs:
        target = params.get(a.name)
        owner = _owner(target, hooked) if target is not None else ""
        if owner and owner == module:
            own.append(a)
        elif owner:
            raise ValueError(
                f"recompile_opt.parallelize: parameter {target!r} of module {owner!r}, which has hooks, is "
                f"read outside that module's forward (by {module or 'the model itself'!r}); a tied "
                "weight's modules can't have hooks of their own (FSDP2: shard them together)"
            )
        else:
            outer.append(a)
    outputs = [n for n in nodes if any(u not in inside for u in n.users)]
    graph, env = fx.Graph(), {}
    for a in [*outer, *own]:
        env[a] = graph.placeholder(a.name)
        env[a].meta.update(a.meta)
    for n in nodes:
        env[n] = graph.node_copy(n, env.__getitem__)
    # one result bare, as a block returns its hidden states (a hook on it sees this rank's tensor)
    graph.output(env[outputs[0]] if len(outputs) == 1 else tuple(env[n] for n in outputs))
    prefix = len(module) + 1
    return Piece(
        module,
        fx.GraphModule(gm, graph),
        [a.name for a in outer],
        [params[a.name][prefix:] for a in own],
        [n.name for n in outputs],
    )
