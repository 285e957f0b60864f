"""Split a joint graph into forward and backward graphs that keep exactly a given set of values.

Torch's ``_extract_fwd_bwd_modules`` does the extraction: the forward outputs the kept values, and the
backward, whose inputs are those values and the tangents, recomputes whatever else it reads. Random ops
that the backward recomputes are replayed from an RNG state the forward saves (torch's
``functionalize_rng_ops``: ``run_and_save_rng_state`` / ``run_with_rng_state``, which have CPU
implementations), so the recomputed dropout mask is this step's mask, not a fresh one. Finally the
backward is reordered as the autograd engine would run it, so each recomputation happens just before
its first use instead of all at the start (what the peak model assumes). Values the plan recomputes
twice (``twice:<value>`` in its recomputed set) are made again for their late readers
(:func:`_recompute_twice`). Values the plan offloads (``offload:<value>``) go through torch's own
activation offloading, called where torch's partitioners call it (``_torch_internals.offload_activations``).

The planner's searches partition one graph 20-30 times only to read the graphs
(``for_simulation``); that path builds the same graphs with a third of the node copies.
"""

from __future__ import annotations

import contextlib
import logging
import operator

import torch
import torch.fx as fx

from recompile_opt import _torch_internals as ti
from recompile_opt.costs.cost_model import tensor_bytes
from recompile_opt.costs.kernels import is_extern
from recompile_opt.ops import is_fusible_pointwise, is_random_op, is_view_node, op_name
from recompile_opt.planner.offload import CopyClock
from recompile_opt.planner.problem import offloaded_values, twice_values

log = logging.getLogger(__name__)


def partition(
    gm: fx.GraphModule,
    *,
    saved: set[str],
    recomputed: set[str],
    num_fwd_outputs: int,
    static_lifetime_input_indices=None,
    info=None,
    for_simulation: bool = False,
    copy_clock: CopyClock | None = None,
) -> tuple[fx.GraphModule, fx.GraphModule]:
    """``info``: ``classify_nodes`` of ``gm``, for callers that partition one graph many times.
    ``for_simulation``: graphs only to read (recompile_opt.costs.peak), made faster: no Python code is
    generated for them, so they cannot run. ``copy_clock``: where the plan's offload copies to the host
    are done (:func:`_place_copy_waits`, :func:`_place_reloads`); none: the waits at the forward's
    end, the reloads where torch issues them."""
    nodes = list(gm.graph.nodes)
    if info is None:
        info = ti.classify_nodes(gm, list(static_lifetime_input_indices or []), num_fwd_outputs)
    bwd = set(info.required_bw_nodes)
    replayed = _tag_replayed_random_ops(nodes, recomputed)
    # an opaque input (a mesh) a plan lists as kept goes over with the opaque objects below, not among
    # the saved tensors (AOTAutograd's runtime checks their types: a hand TP model's mesh at save-all)
    saved_values = [n for n in nodes if n.name in saved and not ti.is_opaque_node(n)]
    saved_sym_nodes = [
        n
        for n in nodes
        if ti.is_sym_node(n) and n not in bwd and any(u in bwd or u.name in recomputed for u in n.users)
    ]
    # opaque inputs the backward reads (a DTensor parameter's mesh, which its gradient is rebuilt with):
    # handed over as they are, never planned
    saved_opaque = [
        n
        for n in nodes
        if ti.is_opaque_node(n)
        and (n.op == "placeholder" or n not in bwd)
        and any(u in bwd or u.op == "output" or u.name in recomputed for u in n.users)
    ]
    with ti.no_graph_codegen() if for_simulation else contextlib.nullcontext():
        if for_simulation:
            fw, bw = _extract_for_reading(gm, saved_values, saved_sym_nodes + saved_opaque, num_fwd_outputs)
        else:
            fw, bw = ti.extract_fwd_bwd_modules(
                gm,
                saved_values,
                saved_sym_nodes=saved_sym_nodes,
                saved_opaque_nodes=saved_opaque,
                num_fwd_outputs=num_fwd_outputs,
                static_lifetime_input_nodes=info.static_lifetime_input_nodes,
            )
        if replayed:
            fw, bw = _functionalize_rng_ops(gm, fw, bw, saved_sym_nodes, saved_opaque)
        bw = _reorder_in_place(bw) if for_simulation else ti.reordering_to_mimic_autograd_engine(bw)
        twice = twice_values(recomputed)
        if twice:
            _recompute_twice(bw, twice)
        offloaded = offloaded_values(recomputed)
        if offloaded:  # torch's own offloading, where torch's partitioners call it
            _offload(fw, bw, offloaded, num_fwd_outputs, info, copy_clock)
        return ti.raise_getitems(fw), ti.raise_getitems(bw)


# ops cheap enough to run twice besides elementwise ones and views: a norm's statistics
_CHEAP_REDUCTIONS = frozenset({"var_mean", "mean", "sum", "amax", "native_layer_norm"})


def _recompute_twice(bw: fx.GraphModule, names: set[str]) -> None:
    """Each named value the backward recomputes is made a second time for its late readers: those
    after the longest stretch of the backward in which none reads it. The copy runs just before the
    first late reader, from what is alive there anyway; the inputs that would be dead by then are made
    again with it (a norm's output again from its input). A value made by anything but elementwise
    ops, views and a norm's reductions, or by a random op, is left made once.

    Why: a block's normalised input is recomputed for its QKV projection, which the attention's
    backward reads, and read again by the QKV weight's gradient after it: made once, it is alive
    through the attention backward, where the demo GPT's step peaks (1 of its 16.54 MiB)."""
    graph = bw.graph
    by_name = {n.name: n for n in graph.nodes}
    for name in sorted(names):
        x = by_name.get(name)
        if x is None or x.op != "call_function":
            continue  # kept: nothing to make twice
        order = {n: i for i, n in enumerate(graph.nodes)}
        reads = sorted(_reads(x), key=lambda r: order[r[0]])
        if len(reads) < 2 or any(r[0].op == "output" for r in reads):
            continue
        gaps = [order[b[0]] - order[a[0]] for a, b in zip(reads, reads[1:])]
        late = reads[gaps.index(max(gaps)) + 1 :]
        chain = _made_again(x, order[late[0][0]], order)
        if chain is None:
            continue
        views = list(dict.fromkeys(v for _, path in late for v in path))  # what the late readers read through
        env: dict[fx.Node, fx.Node] = {}
        with graph.inserting_before(late[0][0]):
            for n in chain + views:
                if n not in env:
                    env[n] = graph.node_copy(n, lambda a: env.get(a, a))
        for reader, path in late:
            read = path[-1] if path else x
            reader.replace_input_with(read, env[read])
        for view in reversed(views):  # erased where only the late readers read it
            if not view.users:
                graph.erase_node(view)
    graph.lint()
    bw.recompile()


def _reads(x: fx.Node) -> list[tuple[fx.Node, list[fx.Node]]]:
    """The nodes that read ``x`` or a view of it, each with the views from ``x`` to what it reads."""
    out, todo = [], [(x, [])]
    while todo:
        node, path = todo.pop()
        for user in node.users:
            if is_view_node(user):
                todo.append((user, path + [user]))
            else:
                out.append((user, path))
    return out


def _made_again(x: fx.Node, start: int, order: dict) -> list[fx.Node] | None:
    """``x`` and the inputs it is made from that are dead before position ``start`` (a tuple's
    producer always: its outputs die with their reads), in graph order; None where one is not cheap."""
    chain, todo, seen = [], [x], set()
    while todo:
        n = todo.pop()
        if n in seen:
            continue
        seen.add(n)
        cheap = n.target is operator.getitem or is_view_node(n) or is_fusible_pointwise(n)
        if is_random_op(n) or not (cheap or op_name(n) in _CHEAP_REDUCTIONS):
            return None
        chain.append(n)
        for a in n.all_input_nodes:
            tuple_of = n.target is operator.getitem and a is n.args[0]
            if a.op != "placeholder" and (tuple_of or max(order[u] for u in a.users) < start):
                todo.append(a)
    return sorted(chain, key=order.__getitem__)


def _offload(fw, bw, names: set[str], num_fwd_outputs: int, info, copy_clock: CopyClock | None) -> None:
    """The plan's offloaded values copied to the host after their last forward use and back before their
    first backward use (``ti.offload_activations``), on a stream of their own where the device has one and
    torch keeps a copied buffer alive until its copy is done (``ti.offload_copies_overlap``), each copy's
    wait where the copy is done (:func:`_place_copy_waits`) and each reload issued as late as its first
    use allows (:func:`_place_reloads`). A value torch refuses (the planner offers only what it
    accepts) is kept on the device instead."""
    device = next(
        (v.device for n in fw.graph.nodes if isinstance(v := n.meta.get("val"), torch.Tensor)), None
    )
    separate_stream = _copies_on_a_stream_of_their_own(device)
    done = ti.offload_activations(
        fw,
        bw,
        names,
        num_fwd_outputs=num_fwd_outputs,
        static_lifetime_input_nodes=info.static_lifetime_input_nodes,
        separate_stream=separate_stream,
    )
    if separate_stream:
        _place_copy_waits(fw, ti.offload_waits(fw), copy_clock)
        _place_reloads(bw, ti.offload_reloads(bw), copy_clock)
    if names - done:
        log.warning("recompile_opt: torch did not offload %s; kept on the device", sorted(names - done))


def _copies_on_a_stream_of_their_own(device: torch.device | None) -> bool:
    """Whether offload copies from ``device`` run beside the compute: CUDA, where torch holds a copied
    buffer until its copy is waited on (``ti.offload_copies_overlap``)."""
    return device is not None and device.type == "cuda" and ti.offload_copies_overlap()


def _place_copy_waits(fw: fx.GraphModule, waits: dict[str, fx.Node], clock: CopyClock | None) -> None:
    """Each offloaded value's wait (``ti.offload_waits``: the node after which its device buffer may be
    freed) moved to where its copy is done on the plan's ``clock``, as the ILP priced it: the copies
    share the link in the order they are issued, each from when it is issued or the one before it ends,
    and a wait goes after the first forward kernel of its own (:func:`_unfused`) that ends by then, or
    after the forward's last (where the rest of the copy is the plan's exposed time), made to run after
    it (``ti.offload_wait_after``). Without a clock, at the forward's end.

    Why: torch sinks every wait to the forward's end, which holds every copied buffer through the whole
    forward, while the plan counts them off the device at its end (a budget the emitted forward would
    break); a wait left where its copy is issued stalls the compute for the whole copy."""
    graph = fw.graph
    nodes = list(graph.nodes)
    output = nodes[-1]
    if clock is None:
        for wait in waits.values():
            output.prepend(wait)
        return
    at = _times(nodes, clock.forward_done)
    order = {n: i for i, n in enumerate(nodes)}
    kernels = [n for n in _unfused(nodes, clock.forward_done) if isinstance(n.meta.get("val"), torch.Tensor)]
    link_free, placed = 0.0, {}  # kernel -> the last wait placed after it
    for wait in sorted(waits.values(), key=lambda w: order[w.args[0]]):
        copy, source = wait.args[0], wait.args[1]
        link_free = max(link_free, at[copy]) + tensor_bytes(source.meta["val"]) / clock.link_bytes_per_s
        after = [n for n in kernels if order[n] > order[copy]]
        done = next((n for n in after if at[n] >= link_free), after[-1] if after else None)
        if done is None:
            output.prepend(wait)
            continue
        placed.get(done, done).append(wait)  # the waits after one kernel in the order of their copies
        placed[done] = wait
        ti.offload_wait_after(wait, done)


def _place_reloads(bw: fx.GraphModule, reloads: dict[str, list[fx.Node]], clock: CopyClock | None) -> None:
    """Each offloaded value's reload (``ti.offload_reloads``: the nodes that issue its copy back) issued
    as late as the plan's ``clock`` lets its copy end by its first use, as the ILP priced it: from the
    last first use back, each copy ends by its use or by the start of the copy after it on the link,
    and is issued before the last backward kernel of its own (:func:`_unfused`) that starts by then
    (right after the inputs where none does: the rest is the plan's exposed time). Without a clock (or
    one that times no such kernel), where torch issued it (just before its first use). Why: a reload's
    device buffer is allocated when it is issued; issued all at once at the backward's start they would
    be back on the device together, and issued at first use each stalls."""
    if clock is None or not reloads:
        return
    nodes = list(bw.graph.nodes)
    starts, at = clock.backward_starts, _times(nodes, clock.backward_starts)
    order = {n: i for i, n in enumerate(nodes)}
    clocked = [n for n in nodes if n.name in starts]
    unfused = _unfused(nodes, starts)
    if not unfused:
        return
    end = max(at.values(), default=0.0)

    def deadline(group: list[fx.Node]) -> float:  # the start of the first kernel after the issuing nodes
        last = order[group[-1]]
        return next((at[n] for n in clocked if order[n] > last), end)

    host = {n.name: n for n in nodes if n.op == "placeholder"}
    first = next(n for n in nodes if n.op != "placeholder")
    issue, link_busy_from = [], float("inf")
    for value, group in sorted(reloads.items(), key=lambda kv: -deadline(kv[1])):
        finish = min(deadline(group), link_busy_from)
        copy_s = tensor_bytes(host[ti.CPU_OFFLOAD_PREFIX + value].meta["val"]) / clock.link_bytes_per_s
        link_busy_from = finish - copy_s
        before = [n for n in unfused if order[n] < order[group[0]] and at[n] <= link_busy_from]
        issue.append((deadline(group), group, before[-1] if before else first))
    for _, group, before in sorted(issue, key=lambda i: i[0]):  # one point's reloads in link order
        if before is not group[0]:
            for n in group:
                before.prepend(n)


def _unfused(nodes: list[fx.Node], clock: dict[str, float]) -> list[fx.Node]:
    """The nodes ``clock`` times that Inductor runs as kernels of their own, never fused with a
    neighbour (a matrix product, an attention, a fallback), so their outputs are always buffers: the
    points a copy's wait and a reload's issue are placed at. Why not any kernel's node: a wait reading
    a node inside a fused kernel makes Inductor write that node out (a buffer it would not have), and
    stream ops placed inside a fused chain are emitted inside it."""
    return [
        n
        for n in nodes
        if n.name in clock and n.op == "call_function" and not is_view_node(n) and is_extern(n)
    ]


def _times(nodes: list[fx.Node], clock: dict[str, float]) -> dict[fx.Node, float]:
    """Each node's time on ``clock`` (by name); a node it does not name (a copy, a stream op), the time
    reached before it."""
    at, reached = {}, 0.0
    for n in nodes:
        reached = at[n] = max(reached, clock.get(n.name, reached))
    return at


def _functionalize_rng_ops(gm, fw, bw, saved_sym_nodes: list, saved_opaque: list):
    """``ti.functionalize_rng_ops`` with the RNG states placed among the saved tensors, before the opaque
    objects. Why: torch inserts them just before the saved symbols in the forward's outputs and just
    before the tangents in the backward's inputs, which is the saved tensors' end only where no opaque
    object is handed over; with one (a hand TP model's mesh), AOTAutograd's runtime read a state as the
    mesh and the mesh as a tensor ("expected all tensors_saved_with_vc_check to be Tensors")."""
    before = {n.name for n in bw.graph.find_nodes(op="placeholder")}
    fw, bw = ti.functionalize_rng_ops(gm, fw, bw, len(saved_sym_nodes) + len(saved_opaque))
    opaque = {n.name for n in saved_opaque}
    inputs = bw.graph.find_nodes(op="placeholder")
    first_opaque = next((n for n in inputs if n.name in opaque), None)
    if first_opaque is not None:
        # (only the CPU path's states: the graph-safe path's bwd_rng_state_* inputs stay last, as passed)
        for state in [n for n in inputs if n.name not in before and n.name.startswith("rng_state_output")]:
            first_opaque.prepend(state)
        bw.recompile()
    return fw, bw


def _extract_for_reading(
    gm: fx.GraphModule, saved_values: list[fx.Node], saved_sym_nodes: list[fx.Node], num_fwd_outputs: int
) -> tuple[fx.GraphModule, fx.GraphModule]:
    """The forward and backward of ``ti._extract_fwd_bwd_modules``, extracted once each. Why: torch
    extracts the backward twice, first only to drop saved values the backward never reads (a plan's
    saved set holds none: the planner keeps only what the backward or a recomputation reads), then
    re-orders saved values and symbols for the runtime; a graph only read needs none of that, and the
    node copies were two thirds of a partition's time."""
    fwd_outputs, bwd_outputs, _, _ = ti._extract_fwd_bwd_outputs(gm, num_fwd_outputs=num_fwd_outputs)
    inputs = gm.graph.find_nodes(op="placeholder")
    fw_in = [n for n in inputs if ti._is_primal(n) or ti._is_fwd_seed_offset(n)]
    bw_in = (
        saved_sym_nodes
        + saved_values
        + [n for n in inputs if ti._is_tangent(n) or ti._is_bwd_seed_offset(n) or ti._is_backward_state(n)]
    )
    fw_out = fwd_outputs + saved_values + saved_sym_nodes
    fw = _live_subgraph(gm.graph, fw_in, fw_out, "forward")
    bw = _live_subgraph(gm.graph, bw_in, bwd_outputs, "backward")
    return fx.GraphModule(gm, fw), fx.GraphModule(gm, bw)


def _live_subgraph(joint: fx.Graph, inputs: list[fx.Node], outputs: list, subgraph: str) -> fx.Graph:
    """``ti._extract_graph_with_inputs_outputs``'s graph, node for node, copying only the nodes it keeps.
    Why: torch copies every node computable from the inputs, then removes the dead ones
    (``eliminate_dead_code``) and checks the graph (``lint``). Here the nodes DCE would keep (those an
    output or an impure node needs) are found first, so no dead node is copied and neither pass runs.
    An output torch would have to replace (a backward-only ``copy_``) goes to torch's function."""
    given = set(inputs)
    valid = set(given)
    for n in joint.nodes:
        if (
            n in given
            or (subgraph != "backward" and ti._must_be_in_backward(n))
            or (subgraph != "forward" and ti._must_be_in_forward(n))
        ):
            continue
        if n.op == "get_attr" or (n.op == "call_function" and all(a in valid for a in n.all_input_nodes)):
            valid.add(n)
    if not all(o in valid for o in outputs if isinstance(o, fx.Node)):
        return ti._extract_graph_with_inputs_outputs(joint, inputs, outputs, [None] * len(outputs), subgraph)
    live = _needed(outputs, given, set())
    impure_random = ti.dce_impure_random()  # what DCE keeps though nothing reads it (asked of few nodes)
    impure = [n for n in valid - live - given if n.op == "call_function" and n.is_impure(impure_random)]
    live = _needed(impure, given, live)
    graph, env = fx.Graph(), {}
    for n in inputs:
        env[n] = graph.placeholder(n.name)
        env[n].meta = n.meta
    for n in joint.nodes:
        if n in live:
            env[n] = graph.node_copy(n, env.__getitem__)
    graph.output(tuple(env[o] if isinstance(o, fx.Node) else o for o in outputs))
    return graph


def _needed(roots: list, given: set[fx.Node], live: set[fx.Node]) -> set[fx.Node]:
    """``live`` grown by ``roots`` and everything they read, back to the ``given`` inputs."""
    stack = [n for n in roots if isinstance(n, fx.Node)]
    while stack:
        n = stack.pop()
        if n not in live and n not in given:
            live.add(n)
            stack.extend(n.all_input_nodes)
    return live


def _reorder_in_place(gm: fx.GraphModule) -> fx.GraphModule:
    """``ti.reordering_to_mimic_autograd_engine``'s order, made by moving nodes instead of copying them
    into a new graph: from the backward's first node (the first user of a tangent) on, each node is
    preceded by those of its inputs not yet placed, in graph order, so a recomputation runs just before
    its first use; forward ``copy_`` nodes before that point are placed first."""
    graph = gm.graph
    nodes = list(graph.nodes)
    order = {n: i for i, n in enumerate(nodes)}
    first = min((u for n in nodes if ti._is_tangent(n) for u in n.users), key=order.__getitem__, default=None)
    if first is None:
        return gm
    inputs = graph.find_nodes(op="placeholder")
    placed = set(inputs)
    new_order: list[fx.Node] = []

    def place(node: fx.Node) -> None:
        stack, found = [node], set()
        while stack:
            n = stack.pop()
            if n not in found and n not in placed:
                found.add(n)
                stack += n.all_input_nodes
        new_order.extend(sorted(found, key=order.__getitem__))
        placed.update(found)

    for n in nodes[: order[first]]:
        if n.op == "call_function" and n.target is torch.ops.aten.copy_.default:
            place(n)
    for n in nodes[order[first] :]:
        place(n)
    for n in reversed(nodes):  # what torch's copy leaves out: feeds nothing the backward runs
        if n not in placed:
            graph.erase_node(n)
    cursor = inputs[-1]
    for n in new_order:
        cursor.append(n)
        cursor = n
    return gm


def _tag_replayed_random_ops(nodes: list[fx.Node], recomputed: set[str]) -> list[fx.Node]:
    """Mark the random ops we recompute so ``functionalize_rng_ops`` wraps them; clear stale marks."""
    replayed = []
    for n in nodes:
        if n.op != "call_function" or not is_random_op(n):
            continue
        if n.name in recomputed:
            n.meta["recompute"] = ti.CheckpointPolicy.MUST_RECOMPUTE
            replayed.append(n)
        elif n.meta.get("recompute") in (
            ti.CheckpointPolicy.MUST_RECOMPUTE,
            ti.CheckpointPolicy.PREFER_RECOMPUTE,
        ):
            n.meta["recompute"] = ti.CheckpointPolicy.MUST_SAVE
    return replayed


def backward_saved_inputs(bw: fx.GraphModule) -> list[str]:
    """Names of the backward graph's inputs that the forward kept (not tangents, not symbols)."""
    return [
        n.name
        for n in bw.graph.find_nodes(op="placeholder")
        if not n.name.startswith("tangents") and not ti.is_sym_node(n)
    ]
