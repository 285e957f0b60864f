"""Inductor's kernels, approximated from an FX graph: which nodes fuse into one kernel, which outputs
get a buffer, and the order the kernels run in.

Why: the peak of a step depends on which buffers live at once, and Inductor does not run the FX graph
node by node. Measured on a Llama layer's backward, one generated kernel computed the SwiGLU's three
gradients at once (``cpp_fused_..._silu_backward``: six 2.75 MiB buffers alive together), where a
node-by-node walk frees each before the next is made; the node-by-node prediction was 25 MiB against
32.5 MiB measured. This module follows the scheduler's rules closely enough for memory:

* **Extern kernels** run alone: matmuls, attention, convolutions, random ops and other fallbacks, and
  higher-order ops. Their tuple outputs are buffers of their own (the ``getitem`` nodes).
* **Fusion**: every other op (pointwise, reductions, indexing) fuses with a fusible producer
  (vertical) and with a fusible node of the same size that reads the same buffer (horizontal), unless
  the two would then lie on both sides of some other kernel (a cycle), the group would exceed
  ``MAX_FUSION`` nodes (``torch._inductor.config.max_fusion_size``), or they are more than ``WINDOW``
  nodes apart. Views are indexing, not kernels.
* **Buffers**: an extern output always; a fused node's output only when something outside its
  kernel reads it, or the graph returns it.
* **Order**: kernels sorted by their first node, then each pulls in what it depends on first
  (``Scheduler.topological_sort_schedule`` after ``fuse_nodes_once``).
"""

from __future__ import annotations

import operator
from dataclasses import dataclass, field

import torch
import torch.fx as fx

from recompile_opt._torch_internals import flop_registry
from recompile_opt.costs.cost_model import base_of, node_cost, tensor_bytes
from recompile_opt.ops import is_seeded_op, is_view_node

MAX_FUSION = 64
WINDOW = 96  # nodes; Inductor fuses near neighbours in practice, and this bounds the cycle checks


@dataclass
class Kernel:
    nodes: list[fx.Node]  # in graph order
    extern: bool
    outputs: list[fx.Node] = field(default_factory=list)  # nodes whose buffer this kernel writes
    # buffers (base nodes) it reads, in graph order: an ordered set, because a set of nodes iterates
    # in the order of their addresses, and the buffer reuse that follows depends on the order
    reads: dict[fx.Node, None] = field(default_factory=dict)


def is_extern(node: fx.Node) -> bool:
    """A node Inductor runs as its own kernel (never fused)."""
    target = node.target
    if target is operator.getitem:
        return False
    if not isinstance(target, torch._ops.OpOverload):
        return True  # higher-order ops (RNG-state replay, ...), Python callables
    if target.namespace in ("recompile_opt", "ao"):
        return True  # our own ops (a chunked region), torch's offload copies: Inductor's fallback kernels
    name = str(target)
    if target._overloadpacket in flop_registry or "scaled_dot_product" in name or "convolution" in name:
        return True
    return is_seeded_op(target)  # random ops: fallbacks with fallback_random


def nbytes(node: fx.Node) -> int:
    """Device bytes of a node's output: none for a copy on the host (an offloaded value, its backward
    input: ``_torch_internals.offload_activations`` marks them)."""
    if node.meta.get("host_resident"):
        return 0
    val = node.meta.get("val")
    return tensor_bytes(val) if isinstance(val, torch.Tensor) else 0


def schedule(gm: fx.GraphModule) -> tuple[list[Kernel], dict[fx.Node, int], set[fx.Node]]:
    """Kernels in run order, the bytes of every buffer, and the buffers the graph returns."""
    nodes = list(gm.graph.nodes)
    facts = _GraphFacts.of(nodes)
    outs = {base_of(a) for a in facts.inputs[nodes[-1]]}
    compute = [n for n in nodes if n.op == "call_function" and not facts.view[n]]
    groups = _fuse(compute, facts)
    kernels = _kernels(compute, groups, outs)
    sizes = {n: nbytes(n) for k in kernels for n in k.outputs}
    return _order(kernels, facts.pos), sizes, outs


def phase_kernels(phases: list[list[fx.Node]], every: list[fx.Node]) -> list[Kernel]:
    """The kernels of each of ``phases`` (a joint graph's forward and backward nodes, each in graph
    order; ``every``: all of the graph's nodes, which the fusion's cycle checks walk): nothing fuses
    across phases, and a node that the other phase or the graph's output reads gets a buffer, as at
    a graph's end after partitioning."""
    facts = _GraphFacts.of(every)
    kernels = []
    for nodes in phases:
        compute = [n for n in nodes if n.op == "call_function" and not facts.view[n]]
        kernels += _kernels(compute, _fuse(compute, facts), set())
    return kernels


def kernel_seconds(kernel: Kernel, roofline: dict) -> float:
    """Roofline time of one kernel: an extern one's op as priced alone
    (:func:`~recompile_opt.costs.cost_model.node_cost`); a fused one's FLOPs against the bytes it moves,
    the buffers it reads from outside and those it writes, each once."""
    if kernel.extern:
        return sum(node_cost(n, roofline).seconds for n in kernel.nodes)
    flops = sum(node_cost(n, roofline, fused=True).flops for n in kernel.nodes)
    moved = sum(nbytes(r) for r in kernel.reads) + sum(nbytes(n) for n in kernel.outputs)
    return max(flops / roofline["flops_per_s"], moved / roofline["bytes_per_s"])


class _Groups:
    """Union-find over fusible nodes, refusing unions that would put another kernel inside a group."""

    def __init__(self, fusible: list[fx.Node], facts: _GraphFacts):
        self.root = {n: n for n in fusible}
        self.members = {n: [n] for n in fusible}
        self.facts = facts

    def find(self, n: fx.Node) -> fx.Node:
        while self.root[n] is not n:
            self.root[n] = self.root[self.root[n]]
            n = self.root[n]
        return n

    def try_union(self, a: fx.Node, b: fx.Node) -> None:
        ra, rb = self.find(a), self.find(b)
        if ra is rb:
            return
        pos, a, b = self.facts.pos, self.members[ra], self.members[rb]  # each in graph order
        if len(a) + len(b) > MAX_FUSION or max(pos[a[-1]], pos[b[-1]]) - min(pos[a[0]], pos[b[0]]) > WINDOW:
            return
        if self._path_between(ra, rb) or self._path_between(rb, ra):
            return
        self.root[rb] = ra
        self.members[ra] = sorted(a + b, key=pos.__getitem__)
        del self.members[rb]

    def _path_between(self, src_root: fx.Node, dst_root: fx.Node) -> bool:
        """Is group ``dst`` reached from group ``src`` through something outside both (a cycle if
        they fused)? Another group counts as one kernel: reaching any of its nodes reaches all of
        them. Views are indexing and do not count as outside. A node before src's first (the graph's
        order is topological) lies on such a path only through its group, where a later member of
        that group is src's descendant: the search goes no further back than that."""
        facts = self.facts
        src, dst = self.members[src_root], self.members[dst_root]
        lo, src, inside = facts.pos[src[0]], set(src), set(src).union(dst)
        stack = [(u, False) for d in dst for u in facts.inputs[d]]
        seen: set[tuple[fx.Node, bool]] = set()
        while stack:
            u, outside = stack.pop()
            if (u, outside) in seen or u.op != "call_function":
                continue
            if facts.pos[u] < lo and (u not in self.root or facts.pos[self.members[self.find(u)][-1]] < lo):
                continue
            seen.add((u, outside))
            if u in src:
                if outside:
                    return True
                continue  # a direct edge from src
            if u in inside:
                continue  # another dst node: its own inputs are on the stack already
            through = outside or not facts.view[u]
            group = self.members[self.find(u)] if u in self.root else (u,)
            stack.extend((w, through) for m in group for w in facts.inputs[m])
        return False


@dataclass
class _GraphFacts:
    """What the fusion's cycle checks ask of each node, computed once per graph: ``Node.all_input_nodes``
    builds a new list per call, and the checks ask it of the same nodes thousands of times (the
    Llama's 0.5 planning: 240k calls, half of its 1.7 s of scheduling, with the views asked the same way)."""

    pos: dict[fx.Node, int]  # position in the graph
    inputs: dict[fx.Node, list[fx.Node]]
    view: dict[fx.Node, bool]

    @classmethod
    def of(cls, nodes: list[fx.Node]) -> _GraphFacts:
        return cls(
            {n: i for i, n in enumerate(nodes)},
            {n: n.all_input_nodes for n in nodes},
            {n: is_view_node(n) for n in nodes},
        )


def _fuse(compute: list[fx.Node], facts: _GraphFacts) -> _Groups:
    fusible = [n for n in compute if not is_extern(n) and n.target is not operator.getitem]
    groups = _Groups(fusible, facts)
    readers: dict[fx.Node, list[fx.Node]] = {}  # buffer -> fusible nodes that read it, so far
    size = {n: nbytes(n) for n in fusible}
    for n in fusible:
        for u in dict.fromkeys(base_of(a) for a in facts.inputs[n]):  # in order (fusion is greedy)
            if u in groups.root:
                groups.try_union(n, u)  # vertical: a fusible producer
            for r in readers.get(u, []):  # horizontal: same buffer read, same size
                if size[r] == size[n] and facts.pos[n] - facts.pos[r] <= WINDOW:
                    groups.try_union(n, r)
            readers.setdefault(u, []).append(n)
    return groups


def consumers(node: fx.Node) -> list[fx.Node]:
    """Users of a buffer, looking through views."""
    out = []
    for u in node.users:
        out.extend(consumers(u) if is_view_node(u) else [u])
    return out


def _kernels(compute: list[fx.Node], groups: _Groups, outs: set[fx.Node]) -> list[Kernel]:
    kernel_of: dict[fx.Node, Kernel] = {}
    kernels = []
    for n in compute:
        if n in groups.root:
            root = groups.find(n)
            if root not in kernel_of:
                kernel_of[root] = Kernel(groups.members[root], extern=False)
                kernels.append(kernel_of[root])
            kernel_of[n] = kernel_of[root]
        elif n.target is operator.getitem and n.args[0] in kernel_of:
            kernel_of[n] = kernel_of[n.args[0]]  # a tuple element: the producing kernel's output
            kernel_of[n].nodes.append(n)
        else:
            kernel_of[n] = Kernel([n], extern=True)
            kernels.append(kernel_of[n])
    for n in compute:
        k = kernel_of[n]
        if n.target is not operator.getitem:
            k.reads.update(dict.fromkeys(base_of(a) for a in n.all_input_nodes))
        val = n.meta.get("val")
        if not isinstance(val, torch.Tensor):
            continue
        if k.extern or n in outs or any(kernel_of.get(c) is not k for c in consumers(n)):
            k.outputs.append(n)
    for k in kernels:
        own = set(k.nodes)
        k.reads = {r: None for r in k.reads if r not in own}
    return kernels


def _order(kernels: list[Kernel], pos: dict[fx.Node, int]) -> list[Kernel]:
    """Sorted by first node (``pos``: each node's place in the graph), each kernel preceded by the
    kernels it depends on (iterative DFS)."""

    def first(k: Kernel) -> int:
        return pos[k.nodes[0]]

    producer = {n: k for k in kernels for n in k.nodes}
    deps = {
        id(k): sorted({id(producer[r]): producer[r] for r in k.reads if r in producer}.values(), key=first)
        for k in kernels
    }
    done: set[int] = set()
    result = []
    for k in sorted(kernels, key=first):
        stack = [(k, iter(deps[id(k)]))]
        active = {id(k)}
        while stack:
            top, it = stack[-1]
            if id(top) in done:
                stack.pop()
                continue
            # a dependency already on the stack would be a cycle (the fusion rules should prevent
            # one): skip it rather than loop
            nxt = next((d for d in it if id(d) not in done and id(d) not in active), None)
            if nxt is not None:
                stack.append((nxt, iter(deps[id(nxt)])))
                active.add(id(nxt))
            else:
                done.add(id(top))
                active.discard(id(top))
                result.append(top)
                stack.pop()
    return result
