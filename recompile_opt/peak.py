"""Predict a training step's peak memory from the partitioned forward and backward graphs.

"Peak" is the most live bytes above the pre-step baseline during forward + backward, starting from
``grad=None``: parameters and inputs are baseline; kept activations, the backward's working set and
the parameter gradients count. The schedule is the graphs' own node order (the backward already
reordered so that recomputation happens just before first use), with every buffer freed after its last
use, as Inductor's generated code does.

Inductor does not materialise every FX node: pointwise ops fuse into their consumers. We approximate
its choice: a node gets a buffer if it is a graph output, is not pointwise (matmuls, reductions,
fallback kernels), has several consumers, or feeds a non-pointwise op. Views share their base's buffer.
"""

from __future__ import annotations

import operator

import torch
import torch.fx as fx

from recompile_opt.cost_model import is_view_node, tensor_bytes


def predict_peak(fw: fx.GraphModule, bw: fx.GraphModule) -> int:
    """Simulated peak of running ``fw`` then ``bw``; forward outputs stay alive into the backward."""
    live, peak, kept = _run_graph(fw, live=0, keep_outputs=True, inputs_baseline=True)
    saved = {n.name for n in bw.graph.find_nodes(op="placeholder") if n.name in kept}
    live = sum(kept[name] for name in saved) + (live - sum(kept.values()))
    bw_live, bw_peak, _ = _run_graph(bw, live=live, keep_outputs=True, inputs_baseline=False,
                                     input_sizes={k: kept[k] for k in saved})
    return max(peak, bw_peak)


def _run_graph(gm: fx.GraphModule, *, live: int, keep_outputs: bool, inputs_baseline: bool,
               input_sizes: dict[str, int] | None = None) -> tuple[int, int, dict[str, int]]:
    nodes = list(gm.graph.nodes)
    output = next(n for n in nodes if n.op == "output")
    outs = {_base(a) for a in output.all_input_nodes}
    last = {}
    for i, n in enumerate(nodes):
        for a in n.all_input_nodes:
            last[_base(a)] = i
    sizes: dict[fx.Node, int] = {}
    for n in nodes:
        if n.op == "placeholder" and not inputs_baseline:
            sizes[n] = (input_sizes or {}).get(n.name, _nbytes(n) if n.name.startswith("tangents") else 0)
        elif n.op == "call_function" and not is_view_node(n) and materialised(n, outs):
            sizes[n] = _nbytes(n)
    peak = live
    for i, n in enumerate(nodes):
        if n.op == "call_function":
            live += sizes.get(n, 0)
            peak = max(peak, live)
        for a in {_base(a) for a in n.all_input_nodes}:
            if last.get(a) == i and a not in outs and a in sizes:
                live -= sizes.pop(a)
    kept = {n.name: sizes.get(n, 0) for n in outs if n.op != "placeholder"}
    return live, peak, kept


def _base(node: fx.Node) -> fx.Node:
    while is_view_node(node):
        node = node.all_input_nodes[0]
    return node


def _nbytes(node: fx.Node) -> int:
    val = node.meta.get("val")
    return tensor_bytes(val) if isinstance(val, torch.Tensor) else 0


def _is_pointwise(node: fx.Node) -> bool:
    return node.op == "call_function" and torch.Tag.pointwise in getattr(node.target, "tags", ())


def _consumers(node: fx.Node) -> list[fx.Node]:
    """Users of a buffer, looking through views and getitems."""
    out = []
    for u in node.users:
        if is_view_node(u) or u.target is operator.getitem:
            out.extend(_consumers(u))
        else:
            out.append(u)
    return out


def materialised(node: fx.Node, outs: set[fx.Node]) -> bool:
    if node in outs or not _is_pointwise(node):
        return True
    users = _consumers(node)
    return len(users) > 1 or any(not _is_pointwise(u) for u in users if u.op != "output")
