"""Split a joint graph into forward and backward graphs that keep exactly a given set of values.

Torch's ``_extract_fwd_bwd_modules`` does the extraction: the forward outputs the kept values, and the
backward, whose inputs are those values and the tangents, recomputes whatever else it reads. Random ops
that the backward recomputes are replayed from an RNG state the forward saves (torch's
``functionalize_rng_ops``: ``run_and_save_rng_state`` / ``run_with_rng_state``, which have CPU
implementations), so the recomputed dropout mask is this step's mask, not a fresh one. Finally the
backward is reordered as the autograd engine would run it, so each recomputation happens just before
its first use instead of all at the start (what the peak model assumes).
"""

from __future__ import annotations

import contextlib

import torch.fx as fx

from recompile_opt import _torch_internals as ti


def partition(gm: fx.GraphModule, *, saved: set[str], recomputed: set[str], num_fwd_outputs: int,
              static_lifetime_input_indices=None, info=None, for_simulation: bool = False
              ) -> tuple[fx.GraphModule, fx.GraphModule]:
    """``info``: ``classify_nodes`` of ``gm``, for callers that partition one graph many times.
    ``for_simulation``: graphs only to read (recompile_opt.peak), made faster: no Python code is
    generated for them, so they cannot run."""
    nodes = list(gm.graph.nodes)
    if info is None:
        info = ti.classify_nodes(gm, list(static_lifetime_input_indices or []), num_fwd_outputs)
    bwd = set(info.required_bw_nodes)
    replayed = _tag_replayed_random_ops(nodes, recomputed)
    saved_values = [n for n in nodes if n.name in saved]
    saved_sym_nodes = [n for n in nodes if ti.is_sym_node(n) and n not in bwd
                       and any(u in bwd or u.name in recomputed for u in n.users)]
    with ti.no_graph_codegen() if for_simulation else contextlib.nullcontext():
        fw, bw = ti._extract_fwd_bwd_modules(
            gm, saved_values, saved_sym_nodes=saved_sym_nodes, num_fwd_outputs=num_fwd_outputs,
            static_lifetime_input_nodes=info.static_lifetime_input_nodes)
        if replayed:
            fw, bw = ti.functionalize_rng_ops(gm, fw, bw, len(saved_sym_nodes))
        bw = ti.reordering_to_mimic_autograd_engine(bw)
        return ti.raise_getitems(fw), ti.raise_getitems(bw)


def _tag_replayed_random_ops(nodes: list[fx.Node], recomputed: set[str]) -> list[fx.Node]:
    """Mark the random ops we recompute so ``functionalize_rng_ops`` wraps them; clear stale marks."""
    replayed = []
    for n in nodes:
        if n.op != "call_function" or not ti.is_random_op(n.target):
            continue
        if n.name in recomputed:
            n.meta["recompute"] = ti.CheckpointPolicy.MUST_RECOMPUTE
            replayed.append(n)
        elif n.meta.get("recompute") in (ti.CheckpointPolicy.MUST_RECOMPUTE,
                                         ti.CheckpointPolicy.PREFER_RECOMPUTE):
            n.meta["recompute"] = ti.CheckpointPolicy.MUST_SAVE
    return replayed


def backward_saved_inputs(bw: fx.GraphModule) -> list[str]:
    """Names of the backward graph's inputs that the forward kept (not tangents, not symbols)."""
    return [n.name for n in bw.graph.find_nodes(op="placeholder")
            if not n.name.startswith("tangents") and not ti.is_sym_node(n)]
