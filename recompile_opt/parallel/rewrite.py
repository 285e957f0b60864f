"""Each rank's forward, written from the exported graph and a found layout (issue 22, step 5 of
docs/parallel-design.md: tensor parallel; sequence parallel is step 6).

Why a rewrite of the captured graph rather than running the module's code on shards: the code's
literal sizes are global (``view(b, s, self.n_head, h // self.n_head)``, ``split(h)``), so on a rank's
shard it fails, or silently splits wrong. In the graph each such size is a constant the rewrite
divides by the rank count where the layout says the value is sharded on that dimension. The rest
is Megatron's: ``f`` before each column-parallel linear (one per input), the partial sums of each
row-parallel linear added up by ``g`` before its bias, and a vocabulary-parallel embedding looking up
only its own rows (the others masked to zero) before ``g``. Every rank's graph differs only in
constants (its rows' offset), so the planner sees the same graph on every rank.
"""

from __future__ import annotations

import types

import torch
import torch.fx as fx
import torch.utils._pytree as pytree
from torch.distributed.tensor import DTensor

from recompile_opt.parallel import collectives as C
from recompile_opt.parallel.layout import Layout

aten = torch.ops.aten
# ops whose literal size arguments name the sharded dimension's global size
_SIZED = {"view", "reshape", "_unsafe_view", "expand"}


def local_forward(layout: Layout, group_name: str, rank: int, device: torch.device | str = "cpu") -> fx.GraphModule:
    """Rank ``rank``'s graph: the exported graph with local sizes and the transitions inserted. A graph
    captured on the meta device makes its tensors (``arange`` positions) on ``device`` instead."""
    if layout.sequence_parallel:
        raise NotImplementedError("recompile_opt.parallel: sequence parallelism is not built yet (step 6)")
    source = layout.program.graph_module
    vocab = {m.module for m in layout.modules if m.style == "vocab"}
    params = {s.arg.name: s.target for s in layout.program.graph_signature.input_specs if s.kind.name == "PARAMETER"}
    graph, env, copies = fx.Graph(), {}, {}
    for node in source.graph.nodes:
        if node.op == "placeholder":
            env[node] = graph.placeholder(node.name)
            continue
        if node.op == "output":
            graph.output(fx.map_arg(node.args[0], env.__getitem__))
            continue
        if node.op == "get_attr":
            env[node] = graph.get_attr(node.target)
            continue
        args, kwargs = fx.map_arg(node.args, env.__getitem__), fx.map_arg(node.kwargs, env.__getitem__)
        if kwargs.get("device") is not None and torch.device(kwargs["device"]).type == "meta":
            kwargs = {**kwargs, "device": torch.device(device)}
        role, op = layout.roles.get(node.name), _op(node)
        if role == "column":
            x = node.args[0]
            if x not in copies:  # one f per input: its backward all-reduces the input's gradient once
                copies[x] = graph.call_function(C.copy_to_tensor_parallel, (env[x], group_name))
            env[node] = graph.call_function(node.target, (copies[x], *args[1:]), kwargs)
        elif role == "row":
            partial = graph.call_function(node.target, tuple(args[:2]))
            out = graph.call_function(C.reduce_from_tensor_parallel, (partial, group_name))
            bias = args[2] if len(args) > 2 else None
            env[node] = out if bias is None else graph.call_function(aten.add.Tensor, (out, bias))
        elif op == "embedding" and params.get(node.args[0].name, "").rsplit(".", 1)[0] in vocab:
            env[node] = _vocab_lookup(graph, node, args, layout.tp, rank, group_name)
        else:
            env[node] = graph.call_function(node.target, _local_args(node, args, layout), kwargs)
    out = fx.GraphModule(source, graph)
    out.meta = {}
    return out


def _local_args(node: fx.Node, args: tuple, layout: Layout) -> tuple:
    """A size-taking op's arguments with the sharded dimension's size divided by the rank count."""
    op, tp = _op(node), layout.tp
    if op in _SIZED and node.name in layout.sharded:
        dim, sizes = layout.sharded[node.name], list(args[1])
        if sizes[dim] != -1:
            sizes[dim] //= tp
        return (args[0], sizes, *args[2:])
    if op in ("split", "split_with_sizes") and node.args[0].name in layout.sharded:
        dim = (args[2] if len(args) > 2 else 0) % len(node.args[0].meta["val"].shape)
        if dim == layout.sharded[node.args[0].name]:
            size = [s // tp for s in args[1]] if isinstance(args[1], (list, tuple)) else args[1] // tp
            return (args[0], size, *args[2:])
    return args


def _vocab_lookup(graph: fx.Graph, node: fx.Node, args: tuple, tp: int, rank: int, group_name: str) -> fx.Node:
    """Megatron's vocabulary-parallel embedding: this rank's rows looked up, the others zero, summed by g."""
    weight, ids = args[0], args[1]
    rows = node.args[0].meta["val"].shape[0] // tp
    local = graph.call_function(aten.sub.Tensor, (ids, rank * rows))
    outside = graph.call_function(aten.logical_or.default, (
        graph.call_function(aten.lt.Scalar, (local, 0)), graph.call_function(aten.ge.Scalar, (local, rows))))
    local = graph.call_function(aten.masked_fill.Scalar, (local, outside, 0))
    found = graph.call_function(aten.embedding.default, (weight, local, *args[2:]))
    found = graph.call_function(aten.masked_fill.Scalar, (found, graph.call_function(aten.unsqueeze.default,
                                                                                     (outside, -1)), 0.0))
    return graph.call_function(C.reduce_from_tensor_parallel, (found, group_name))


def install(model: torch.nn.Module, layout: Layout, graph: fx.GraphModule) -> None:
    """``model.forward`` replaced by the rank's graph, fed with the local shards of its parameters (a
    DTensor's ``to_local()``: its gradient comes back as a DTensor of the same placement), its buffers
    and the caller's inputs; the outputs returned as the model returns them."""
    program = layout.program
    specs = program.graph_signature.input_specs
    out_specs = program.graph_signature.output_specs

    def forward(self, *args, **kwargs):
        user = iter(pytree.tree_leaves((args, kwargs)))
        inputs = []
        for spec in specs:
            kind = spec.kind.name
            if kind == "PARAMETER":
                p = self.get_parameter(spec.target)
                inputs.append(p.to_local() if isinstance(p, DTensor) else p)
            elif kind == "BUFFER":
                inputs.append(self.get_buffer(spec.target))
            elif kind == "CONSTANT_TENSOR":
                inputs.append(program.constants[spec.target])
            else:
                inputs.append(next(user))
        outputs = graph(*inputs)
        outputs = outputs if isinstance(outputs, (tuple, list)) else (outputs,)
        mine = [o for o, s in zip(outputs, out_specs) if s.kind.name == "USER_OUTPUT"]
        return pytree.tree_unflatten(mine, program.call_spec.out_spec)

    model.forward = types.MethodType(forward, model)


def _op(node: fx.Node) -> str | None:
    packet = getattr(node.target, "_overloadpacket", None)
    return packet.__name__ if packet is not None else None
