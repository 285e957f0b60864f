"""Repeated blocks found from the graph's structure, whatever the modules are called.

Why: the fixed policies (``full`` checkpoints each block) and the block reduction of deep stacks need
a model's transformer blocks. Module paths up to their first index (``blocks.3``, ``h.0``,
``layers.12``) find them in most models, but not all: torchvision's ViT names its layers
``encoder.layers.encoder_layer_0``, and its first index is inside each layer's MLP (``mlp.0`` ...
``mlp.4``), so ``full`` checkpointed single linears and recomputed nothing; an ``nn.ModuleDict`` of
layers, or ``block0``, ``block1``, has no index at all.

What a block is here: among the children of one module (all values whose module path continues the
parent's by one name), those whose forward subgraphs are copies of one another, the same ops, shapes
and dtypes wired the same way (a Weisfeiler-Lehman hash of the subgraph, networkx). The parents taken
are the shallowest whose repeated children hold at least ``MIN_FLOP_SHARE`` of the forward's FLOPs,
so a pair of identical embeddings or norms does not count, and an encoder and a decoder are each a
stack of their own.

The indexed children of a ``ModuleList`` or ``nn.Sequential`` (``encoder.block.3``, ``model.layers.3``)
are taken as layers before that, copies or not, when their submodules are named alike: T5's block 0
alone owns ``relative_attention_bias`` and Gemma2 alternates sliding and global attention, so their
layers are not copies, and the repeated q/k/v/o linears inside them were taken instead (``full`` then
kept every linear's output and recomputed nothing). Neither rule takes a child that makes one tensor
(a linear makes its output and nothing else): checkpointing it recomputes nothing.
"""

from __future__ import annotations

import warnings
from collections import defaultdict

import networkx as nx

from recompile_opt.planner.problem import Problem

# Repeated children must hold this share of the forward's FLOPs to be blocks: two identical norms or
# embeddings (BERT's word, position and token-type embeddings) hold none, a stack of layers nearly all.
MIN_FLOP_SHARE = 0.1


def structural_blocks(problem: Problem) -> dict[str, str | None]:
    """Block of each value (its module path up to the block's name), None outside every block; every
    value None when no module's children repeat."""
    modules = {n: _path(v.info.get("module", "")) for n, v in problem.values.items()}
    forward = [n for n, v in problem.values.items() if v.in_forward and modules[n]]
    total = sum(problem.values[n].flops for n in forward) or 1
    chosen: list[tuple[str, ...]] = []
    for depth in range(1, max((len(m) for m in modules.values()), default=0) + 1):
        children: dict[tuple[str, ...], dict[tuple[str, ...], list[str]]] = defaultdict(
            lambda: defaultdict(list)
        )
        for n in forward:
            path = modules[n]
            if len(path) >= depth and not any(path[: len(c)] == c for c in chosen):
                children[path[: depth - 1]][path[:depth]].append(n)
        for kids in children.values():
            kids = {k: names for k, names in kids.items() if _makes_several(problem, names)}
            taken = _layers(kids, modules) or _repeated(problem, kids)
            if sum(problem.values[n].flops for k in taken for n in kids[k]) >= MIN_FLOP_SHARE * total:
                chosen.extend(taken)
    owner = {c: ".".join(c) for c in chosen}
    return {
        n: next((owner[m[: len(c)]] for c in chosen if m[: len(c)] == c), None) for n, m in modules.items()
    }


def _path(module: str) -> tuple[str, ...]:
    return tuple(module.split(".")) if module else ()


def _makes_several(problem: Problem, names: list[str]) -> bool:
    """The values make two tensors or more (a view or a tuple's item is not one): inside a module that
    makes only its output there is nothing for a checkpoint to recompute."""
    return sum(problem.values[n].storage == n for n in names) >= 2


def _layers(
    kids: dict[tuple[str, ...], list[str]], modules: dict[str, tuple[str, ...]]
) -> list[tuple[str, ...]]:
    """The indexed children (``layers.0``, ``layers.1``: a ``ModuleList``'s or ``nn.Sequential``'s
    entries) whose submodule names half match another's at least, in their order; none if fewer than
    two. Why the names: ``nn.Sequential(backbone, head)`` is indexed too, and its entries are no layers."""
    subs = {k: {modules[n][len(k) :] for n in names} for k, names in kids.items() if k[-1].isdigit()}
    alike = [
        k
        for k, s in subs.items()
        if any(len(s & t) >= 0.5 * min(len(s), len(t)) for j, t in subs.items() if j != k)
    ]
    return alike if len(alike) >= 2 else []


def _repeated(problem: Problem, kids: dict[tuple[str, ...], list[str]]) -> list[tuple[str, ...]]:
    """The children whose subgraph hash at least one sibling shares, in their order."""
    if len(kids) < 2:
        return []
    hashes = {k: _hash(problem, names) for k, names in kids.items()}
    counts = defaultdict(int)
    for h in hashes.values():
        counts[h] += 1
    return [k for k in kids if counts[hashes[k]] > 1]


def _hash(problem: Problem, names: list[str]) -> str:
    """A Weisfeiler-Lehman hash of the values' subgraph: each labelled by op, shape and dtype and by
    how many of its inputs come from outside (block 0 reads the embedding where block 1 reads block 0:
    both are one outside input)."""
    inside = set(names)
    graph = nx.DiGraph()
    for n in names:
        v = problem.values[n]
        outside = sum(u not in inside for u in v.inputs)
        graph.add_node(n, label=f"{v.info.get('op')}|{v.info.get('shape')}|{v.info.get('dtype')}|{outside}")
        graph.add_edges_from((u, n) for u in v.inputs if u in inside)
    with warnings.catch_warnings():  # networkx >= 3.5 says its directed hashes changed: only compared
        warnings.simplefilter("ignore", UserWarning)  # with each other within one call, so harmless
        return nx.weisfeiler_lehman_graph_hash(graph, node_attr="label")
