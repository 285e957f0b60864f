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

from recompile_opt.cost_model import base_of, is_view_node, tensor_bytes


def predict_peak(fw: fx.GraphModule, bw: fx.GraphModule) -> int:
    """Simulated peak of running ``fw`` then ``bw``; forward outputs stay alive into the backward.

    A kept value may be a view: the backward's input then holds its base's whole buffer, shared with
    every other kept view of that base and freed after the last of them is used."""
    live, peak, buffers, owner = _run_forward(fw)
    keys = {n: owner[n.name] for n in bw.graph.find_nodes(op="placeholder") if n.name in owner}
    used = set(keys.values())
    live -= sum(size for key, size in buffers.items() if key not in used)  # kept but never read
    return max(peak, _run_backward(bw, live, keys, buffers))


def _run_forward(gm: fx.GraphModule) -> tuple[int, int, dict[str, int], dict[str, str]]:
    """Live bytes at the end, the peak, kept buffers by base name, and output name -> base name."""
    nodes, output, outs, sizes = _buffers(gm)
    live, peak = sweep(nodes, sizes, keep=outs, live=0)
    buffers = {n.name: sizes.get(n, 0) for n in outs if n.op != "placeholder"}
    owner = {a.name: base_of(a).name for a in output.all_input_nodes if base_of(a).name in buffers}
    return live, peak, buffers, owner


def _run_backward(gm: fx.GraphModule, live: int, keys: dict[fx.Node, str], buffers: dict[str, int]) -> int:
    nodes, _, outs, sizes = _buffers(gm)
    tangents = {n: _nbytes(n) for n in nodes if n.op == "placeholder" and n.name.startswith("tangents")}
    sizes.update(tangents)
    _, peak = sweep(nodes, sizes, keep=outs, live=live + sum(tangents.values()), shared=(keys, buffers))
    return peak


def _buffers(gm: fx.GraphModule):
    """Nodes, the output node, the bases it returns, and the bytes of every buffer Inductor would make."""
    nodes = list(gm.graph.nodes)
    output = nodes[-1]
    outs = {base_of(a) for a in output.all_input_nodes}
    sizes = {n: _nbytes(n) for n in nodes
             if n.op == "call_function" and not is_view_node(n) and materialised(n, outs)}
    return nodes, output, outs, sizes


def sweep(nodes: list[fx.Node], sizes: dict[fx.Node, int], *, keep: set[fx.Node], live: int,
          shared: tuple[dict[fx.Node, str], dict[str, int]] | None = None) -> tuple[int, int]:
    """Run the schedule: allocate each buffer when made, free it after its last use unless kept.
    ``shared`` maps inputs to the kept buffer they view: one buffer, freed after the last of them."""
    keys, buffers = shared or ({}, {})
    last = _last_uses(nodes)
    last_of_key: dict[str, int] = {}
    for n, i in last.items():
        if n in keys:
            last_of_key[keys[n]] = max(last_of_key.get(keys[n], -1), i)
    sizes, buffers = dict(sizes), dict(buffers)
    peak = live
    for i, n in enumerate(nodes):
        live += sizes.get(n, 0) if n.op == "call_function" else 0
        peak = max(peak, live)
        for a in {base_of(a) for a in n.all_input_nodes}:
            if a in keys:
                if last_of_key[keys[a]] == i:
                    live -= buffers.pop(keys[a], 0)
            elif last.get(a) == i and a not in keep and a in sizes:
                live -= sizes.pop(a)
    return live, peak


def _last_uses(nodes: list[fx.Node]) -> dict[fx.Node, int]:
    last = {}
    for i, n in enumerate(nodes):
        for a in n.all_input_nodes:
            last[base_of(a)] = i
    return last



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
