"""Predict a training step's peak memory from the partitioned forward and backward graphs.

"Peak" is the most live bytes above the pre-step baseline during forward + backward, starting from
``grad=None``: parameters and inputs are baseline; kept activations, the backward's working set and
the parameter gradients count.

The graphs run as Inductor's kernels (fusion, buffers and order from :mod:`recompile_opt.costs.kernels`),
with Inductor's buffer reuse (:func:`sweep_kernels`). Against the measured peak of a 2-layer GPT and
Llama (h=256, s=256, b=4; every policy and budget 0.0/0.2/0.5/none, 14 plans) the prediction is
within -7.4% .. +9.2%; the node-by-node walk it replaces was off by up to -31% on the Llama, whose
SwiGLU backward makes three gradients in one kernel.

The pool span (``POOL_SPAN``) is fitted to those measurements: Inductor's pool hands out the most
recently freed buffer, so where a size is common (4 MiB: GELU, attention scores, the MLP's matmuls)
a buffer freed long ago is never taken again and is freed where it died; a dead buffer is counted
as held for a later allocation only within ``POOL_SPAN`` kernels.
"""

from __future__ import annotations

import math
import operator
from dataclasses import dataclass, field

import torch
import torch.fx as fx

from recompile_opt import _torch_internals as ti
from recompile_opt.costs.cost_model import base_of
from recompile_opt.costs.kernels import Kernel, is_extern, nbytes, schedule
from recompile_opt.costs.scratch import scratch_bytes
from recompile_opt.ops import has_scratch, op_name

SCRATCH = " (workspace)"  # the name of a kernel's workspace among the buffers alive at the peak


@dataclass
class PeakTrace:
    """What is alive at the peak of a sweep: buffer (node, or kept base name) -> bytes, and the kernel
    that was running (``at``: its index; -1 before the first)."""

    start: dict = field(default_factory=dict)  # buffers alive before the first kernel
    at: int = -1
    kernel: Kernel | None = None  # the kernel at ``at``
    kernels: int = 0  # kernels in the sweep
    alive: dict = field(default_factory=dict)
    dead: set = field(default_factory=set)  # alive buffers no kernel reads again (pooled for reuse)
    # every allocation and free of the sweep: (kernel index, signed bytes, live bytes after, buffer)
    events: list = field(default_factory=list)


def predict_peak(fw: fx.GraphModule, bw: fx.GraphModule) -> int:
    """Simulated peak of running ``fw`` then ``bw`` as Inductor's kernels (recompile_opt.costs.kernels);
    forward outputs stay alive into the backward.

    A kept value may be a view: the backward's input then holds its base's whole buffer, shared with
    every other kept view of that base and freed after the last of them is used."""
    return _simulate(fw, bw)[0]


def peak_breakdown(
    fw: fx.GraphModule, bw: fx.GraphModule, recomputed: set[str] = frozenset(), *, pool: str = "span"
) -> dict:
    """Where the predicted peak lies and what is alive there, by kind: ``kept`` (forward buffers kept
    for backward), ``tangents``, ``gradients`` (what the backward returns), ``recomputed`` (values
    the plan recomputes), ``scratch`` (an extern kernel's own workspace), ``temporaries`` (the
    backward's other buffers; in the forward, everything not kept) and ``pooled`` (dead buffers
    Inductor's pool holds for a later allocation). Why: it tells a user what a lower budget can still
    remove (kept, recomputed) and what it cannot
    (gradients, the backward's own working set), i.e. the floor of the peak. ``pool``: as
    :func:`sweep_kernels` takes it."""
    peak, phase, gm, trace = _simulate(fw, bw, traced=True, pool=pool)
    outs = {base_of(a) for a in next(iter(reversed(gm.graph.nodes))).all_input_nodes}
    kinds: dict[str, int] = {}
    largest = []
    for buf, size in trace.alive.items():
        kind = "pooled" if buf in trace.dead else _kind(buf, phase, outs, recomputed)
        kinds[kind] = kinds.get(kind, 0) + size
        largest.append((size, buf if isinstance(buf, str) else buf.name, kind))
    return {
        "phase": phase,
        "kernel": trace.at,
        "kernels": trace.kernels,
        "kernel_ops": sorted({op_name(n, qualified=True) for n in trace.kernel.nodes})
        if trace.kernel
        else [],
        "bytes": dict(sorted(kinds.items(), key=lambda kv: -kv[1])),
        "total": peak,
        "largest": [[name, size, kind] for size, name, kind in sorted(largest, reverse=True)[:6]],
        "shapes": _alive_shapes(trace),
    }


def _alive_shapes(trace: PeakTrace, most: int = 32) -> list[list[int]]:
    """The shapes of the buffers alive at the peak (pooled ones too), largest first, each once. Why:
    a region whose full-length tensors are not among them cannot lower the peak by being chunked
    (planner/chunk_choice.py)."""
    shapes = set()
    for buf in trace.alive:
        val = None if isinstance(buf, str) else buf.meta.get("val")
        if isinstance(val, torch.Tensor) and all(isinstance(d, int) for d in val.shape):
            shapes.add(tuple(val.shape))
    return [list(s) for s in sorted(shapes, key=lambda s: (-math.prod(s), s))[:most]]


def peak_and_recomputed_at_peak(
    fw: fx.GraphModule, bw: fx.GraphModule, recomputed: set[str], *, pool: str = "span"
) -> tuple[int, list[str]]:
    """The predicted peak, and the names of the recomputed values alive where it lies, largest first.
    Why: a value recomputed early, only because a value needed before the peak is recomputed from it,
    sits under the peak; keeping one of these instead moves its inputs' recomputation past the peak
    (the planner's least-peak refinement tries that)."""
    peak, phase, _, trace = _simulate(fw, bw, traced=True, pool=pool)
    if phase != "backward":
        return peak, []
    alive = [
        (size, buf.name)
        for buf, size in trace.alive.items()
        if not isinstance(buf, str) and buf.name in recomputed
    ]
    return peak, [name for _, name in sorted(alive, reverse=True)]


def _kind(buf, phase: str, outs: set, recomputed: set[str]) -> str:
    if isinstance(buf, str) and buf.endswith(SCRATCH):
        return "scratch"
    if isinstance(buf, str) or (phase == "forward" and buf in outs):
        return "kept"
    if buf.op == "placeholder":
        return "tangents" if buf.name.startswith("tangents") else "kept"
    if buf in outs:
        return "gradients"
    return "recomputed" if buf.name in recomputed else "temporaries"


def timeline(fw: fx.GraphModule, bw: fx.GraphModule) -> list[tuple[str, int, int, int, str]]:
    """Every simulated allocation and free, in order: (phase, kernel index, signed bytes, live bytes
    after, buffer name). Why: set against the measured allocator records of the same step
    (``bench/peak_timeline.py``) it shows where the simulation departs from Inductor."""
    _, fw_trace, _, bw_trace = _run_step(fw, bw, traced=True)
    return [
        (phase, i, nbytes, live, name)
        for phase, trace in (("forward", fw_trace), ("backward", bw_trace))
        for i, nbytes, live, name in trace.events
    ]


def _simulate(fw: fx.GraphModule, bw: fx.GraphModule, traced: bool = False, pool: str = "span"):
    """(peak, phase of the peak, that phase's graph, its PeakTrace or None)."""
    fw_peak, fw_trace, bw_peak, bw_trace = _run_step(fw, bw, traced, pool)
    if fw_peak > bw_peak:
        return fw_peak, "forward", fw, fw_trace
    return bw_peak, "backward", bw, bw_trace


def _run_step(fw: fx.GraphModule, bw: fx.GraphModule, traced: bool, pool: str = "span"):
    """The forward's peak and PeakTrace (None unless ``traced``), then the backward's."""
    fw_trace = PeakTrace() if traced else None
    live, peak, buffers, owner = _run_forward(fw, fw_trace, pool)
    keys = {n: owner[n.name] for n in bw.graph.find_nodes(op="placeholder") if n.name in owner}
    used = set(keys.values())
    live -= sum(size for key, size in buffers.items() if key not in used)  # kept but never read
    bw_trace = PeakTrace(start={k: buffers[k] for k in used}) if traced else None
    return peak, fw_trace, _run_backward(bw, live, keys, buffers, bw_trace, pool), bw_trace


def caller_outputs_bytes(fw: fx.GraphModule, num_fwd_outputs: int) -> int:
    """Bytes of the storages the forward returns to the caller, the loss aside, that the backward does
    not read (a model's logits, a cache, hidden states). Every predicted peak assumes the caller drops
    them before the backward (``model(**batch).loss.backward()``); one that holds them (``out =
    model(**batch); out.loss.backward()``) adds up to this much, and the plan says so. Why: T5's
    output object held through its backward measured 64 KiB (8.6%) over its walked peak."""
    outputs = [a for a in next(iter(reversed(fw.graph.nodes))).args[0] if isinstance(a, fx.Node)]
    backward_reads = {base_of(a) for a in outputs[num_fwd_outputs:]}
    bases = {base_of(a) for a in outputs[:num_fwd_outputs]} - backward_reads
    return sum(
        nbytes(b)
        for b in bases
        if b.op != "placeholder" and isinstance(v := b.meta.get("val"), torch.Tensor) and v.dim() > 0
    )


def forward_state(fw: fx.GraphModule) -> tuple[int, int, dict[str, int], dict[str, str]]:
    """The forward as the backward starts from it: its simulated peak, the live bytes at its end, the
    bytes of each buffer it outputs (by base name), and each output name's base name (views of one
    buffer share it)."""
    live, peak, buffers, owner = _run_forward(fw)
    return peak, live, buffers, owner


def _run_forward(
    gm: fx.GraphModule, trace: PeakTrace | None = None, pool: str = "span"
) -> tuple[int, int, dict[str, int], dict[str, str]]:
    """Live bytes at the end, the peak, kept buffers by base name, and output name -> base name."""
    order, sizes, outs = schedule(gm)
    live, peak = sweep_kernels(order, sizes, keep=outs, live=0, trace=trace, pool=pool)
    output = next(iter(reversed(gm.graph.nodes)))
    buffers = {n.name: sizes.get(n, 0) for n in outs if n.op != "placeholder"}
    owner = {a.name: base_of(a).name for a in output.all_input_nodes if base_of(a).name in buffers}
    return live, peak, buffers, owner


def _run_backward(
    gm: fx.GraphModule,
    live: int,
    keys: dict[fx.Node, str],
    buffers: dict[str, int],
    trace: PeakTrace | None = None,
    pool: str = "span",
) -> int:
    order, sizes, outs = schedule(gm)
    tangents = {n: nbytes(n) for n in gm.graph.find_nodes(op="placeholder") if n.name.startswith("tangents")}
    sizes.update(tangents)
    if trace is not None:
        trace.start.update(tangents)
    _, peak = sweep_kernels(
        order,
        sizes,
        keep=outs,
        live=live + sum(tangents.values()),
        shared=(keys, buffers),
        trace=trace,
        pool=pool,
    )
    return peak


def sweep_kernels(
    order: list[Kernel],
    sizes: dict[fx.Node, int],
    *,
    keep: set[fx.Node],
    live: int,
    shared: tuple[dict[fx.Node, str], dict[str, int]] | None = None,
    trace: PeakTrace | None = None,
    pool: str = "span",
) -> tuple[int, int]:
    """Run the kernels as Inductor's wrapper code does: allocate a kernel's output buffers before it,
    free the buffers it was the last to read after it (unless kept). ``shared`` maps graph inputs to
    the kept buffer they view: one buffer, freed after the last of them is read.

    Two of Inductor's buffer reuses change the peak (read off its generated code):
    * in place: a fused kernel writes an output into an input buffer of the same size that dies with
      it (``buf34 = buf9; del buf9  # reuse``, a GELU backward writing over its incoming gradient);
    * the wrapper's memory planning (``memory_plan_reuse``) does not free a dead buffer that a later
      allocation of the same dtype and size can take: it stays allocated until then (last freed,
      first taken). Measured on a 2-layer Llama: the last layer's 2.75 MiB SwiGLU buffers stay
      allocated until the first layer's backward takes them over.

    ``trace``: filled with what is alive at the peak (its ``start`` must hold what ``live`` counts).
    ``pool``: how Inductor's wrapper hands dead buffers to later allocations: ``"span"`` the fitted
    span (:func:`_span_reuse`), ``"inductor"`` its own rule (:func:`_inductor_reuse`), ``"none"`` not at
    all (``allow_buffer_reuse`` off: :func:`_in_place_only`)."""
    keys, buffers = shared or ({}, {})
    last: dict = {}
    for i, k in enumerate(order):
        for r in k.reads:
            last[keys.get(r, r)] = i
    size = {**{n: sizes.get(n, 0) for n in sizes}, **buffers}
    reuse = REUSE_RULES[pool]
    free_after, taken = reuse(order, size, last, keep, keys)
    peak = live
    alive = dict(trace.start) if trace is not None else None
    if trace is not None:
        trace.alive, trace.kernels = dict(alive), len(order)
    for i, k in enumerate(order):
        made = [n for n in k.outputs if n not in taken]
        if trace is not None:
            _log(trace, i, [(n, size.get(n, 0)) for n in made], live)
        live += sum(size.get(n, 0) for n in made)
        scratch = _scratch(k)  # the kernel's own workspace, while it runs
        if alive is not None:
            alive.update((n, size.get(n, 0)) for n in made)
            alive.update((n, alive.pop(taken[n], 0)) for n in k.outputs if n in taken)
            if live + scratch > peak:
                trace.at, trace.kernel = i, k
                trace.alive = {**alive, **({f"{k.nodes[0].name}{SCRATCH}": scratch} if scratch else {})}
                trace.dead = {b for b in alive if b not in made and b not in keep and last.get(b, i) < i}
        peak = max(peak, live + scratch)
        if trace is not None:
            _log(trace, i, [(b, -size.get(b, 0)) for b in free_after.get(i, ())], live)
        live -= sum(size.get(b, 0) for b in free_after.get(i, ()))
        if alive is not None:
            for b in free_after.get(i, ()):
                alive.pop(b, None)
    return live, peak


def _scratch(k: Kernel) -> int:
    return sum(scratch_bytes(n) for n in k.nodes if has_scratch(n)) if k.extern else 0


def _log(trace: PeakTrace, kernel: int, changes: list, live: int) -> None:
    for buf, n_bytes in changes:
        if n_bytes:
            live += n_bytes
            trace.events.append((kernel, n_bytes, live, buf if isinstance(buf, str) else buf.name))


POOL_SPAN = 16  # kernels: see the module docstring


def _span_reuse(
    order: list[Kernel], size: dict, last: dict, keep: set[fx.Node], keys: dict
) -> tuple[dict[int, list], dict]:
    """Which kernel frees each buffer, and which outputs take over which buffer instead of allocating:
    in place (a fused kernel's dying input of the same size), or from Inductor's pool of dead
    buffers (per dtype and size, last in first out), taken only within ``POOL_SPAN`` kernels of its
    death. Graph outputs and kept buffers are never freed."""
    inplace = _inplace_takes(order, size, last, keep, keys)
    pool: dict[tuple, list] = {}
    free_after: dict[int, list] = {}
    taken: dict = dict(inplace)  # output -> the dead buffer it writes into
    for i, k in enumerate(order):
        for n in k.outputs:
            key = _key(n, size)
            if (
                n not in taken
                and _wrapper_allocated(n)
                and pool.get(key)
                and i - pool[key][-1][1] <= POOL_SPAN
            ):
                taken[n] = pool[key].pop()[0]
        _release(_dying(k, i, last, keep, keys, size, inplace), i, size, pool, free_after)
    _free_unclaimed(pool, last, order, free_after)
    return free_after, taken


# Inductor's own pool rule is used only where asked (``pool="inductor"``): on the 16 stored plans of
# ``bench/peak_accuracy.py`` it is closer on the mean (|error| 2.7% against 3.5%; the GPT's plans within 1%
# but its 0.0 plan, +7.1%) and farther on the Llama's least-peak plan (+11.9% against +7.9%); on graphs
# chunked along the sequence, where the span is far off, it ranks the least-peak search's plans
# (:mod:`recompile_opt.costs.simulator`).
def _inductor_reuse(
    order: list[Kernel], size: dict, last: dict, keep: set[fx.Node], keys: dict
) -> tuple[dict[int, list], dict]:
    """:func:`_plan_reuse` as Inductor's wrapper decides it (``AllocateLine.should_reuse_buffer``): the
    most recently freed buffer of the size is taken by the next kernel outright, and by a later one
    only where holding it in between does not raise the graph's peak as Inductor estimates it without
    the pool (:func:`_peaks_without_pool`; each buffer taken then counts as held over its span); where
    it would, the allocation is new and the dead buffer is freed where it died. Why: a chunked MLP's
    backward leaves six 1 MiB buffers to later allocations across the attention backward (the GPT
    with vocabulary 2048: walked 30.09 MiB, the span's simulation 24.10)."""
    inplace = _inplace_takes(order, size, last, keep, keys)
    held = _peaks_without_pool(order, size, last, keep, keys, inplace)
    overall = max(held, default=0)
    pool: dict[tuple, list] = {}
    free_after: dict[int, list] = {}
    taken: dict = dict(inplace)
    for i, k in enumerate(order):
        for n in k.outputs:
            key = _key(n, size)
            if n in taken or not (_wrapper_allocated(n) and pool.get(key)):
                continue
            dead, died = pool[key].pop()
            between = held[died + 1 : i]
            if not between or size.get(n, 0) + max(between) <= overall:
                taken[n] = dead
                held[died + 1 : i] = [h + size.get(n, 0) for h in between]
            else:
                pool[key].append((dead, died))
        _release(_dying(k, i, last, keep, keys, size, inplace), i, size, pool, free_after)
    _free_unclaimed(pool, last, order, free_after)
    return free_after, taken


def _in_place_only(
    order: list[Kernel], size: dict, last: dict, keep: set[fx.Node], keys: dict
) -> tuple[dict[int, list], dict]:
    """No pool: every dead buffer freed where it dies; only a fused kernel's output written in place
    over its dying input (``inplace_buffers``, a setting apart from the pool)."""
    inplace = _inplace_takes(order, size, last, keep, keys)
    free_after: dict[int, list] = {}
    for i, k in enumerate(order):
        free_after.setdefault(i, []).extend(_dying(k, i, last, keep, keys, size, inplace))
    return free_after, dict(inplace)


REUSE_RULES = {"span": _span_reuse, "inductor": _inductor_reuse, "none": _in_place_only}


def pool_rule(pooled: bool, chunked: bool) -> str:
    """The :func:`sweep_kernels` ``pool`` of a plan's code: none where Inductor's pool is off
    (``pooled`` False), else Inductor's own rule on a graph chunked along the sequence (where the
    fitted span is far off) and the span elsewhere (see :func:`_inductor_reuse`)."""
    return "none" if not pooled else "inductor" if chunked else "span"


def _release(dying: list, i: int, size: dict, pool: dict, free_after: dict) -> None:
    """The buffers dying with kernel ``i``: into the pool (per dtype and size, with the kernel they
    died at) where Inductor's wrapper pools them, else freed after ``i``."""
    for d in dying:
        if _poolable(d):
            pool.setdefault(_key(d, size), []).append((d, i))
        else:
            free_after.setdefault(i, []).append(d)


def _free_unclaimed(pool: dict, last: dict, order: list[Kernel], free_after: dict) -> None:
    """Pooled buffers no later allocation took: freed where they died."""
    for bufs in pool.values():
        for d, _ in bufs:
            free_after.setdefault(_death(d, last, order), []).append(d)


def _dying(k: Kernel, i: int, last: dict, keep: set, keys: dict, size: dict, inplace: dict) -> list:
    """The buffers that die with kernel ``i`` (last read there, or made and never read), less those an
    output of it writes over in place."""
    over = {inplace[n] for n in k.outputs if n in inplace}
    dying = [keys.get(r, r) for r in k.reads if last.get(keys.get(r, r)) == i]
    dying = [d for d in dict.fromkeys(dying) if d not in keep and size.get(d, 0) and d not in over]
    return dying + [n for n in k.outputs if n not in last and n not in keep]


def _inplace_takes(order: list[Kernel], size: dict, last: dict, keep: set, keys: dict) -> dict:
    """Output -> the dying input of its fused kernel it is written over (same dtype and size, no other
    reader left when it is written: :func:`_written_last`); and a functionalised mutation's new value
    -> the buffer it mutates, where that buffer dies with it (:func:`_mutated_in_place`)."""
    taken = {}
    for i, k in enumerate(order):
        if k.extern:
            taken.update(_mutated_in_place(k, i, size, last, keep, keys))
            continue
        dying = [keys.get(r, r) for r in k.reads if last.get(keys.get(r, r)) == i]
        dying = [d for d in dict.fromkeys(dying) if d not in keep and size.get(d, 0)]
        readers = _readers(k, keys)
        for n in k.outputs:
            same = [
                d for d in dying if _key(d, size) == _key(n, size) and _written_last(k, n, readers.get(d, ()))
            ]
            if same:
                dying.remove(same[0])
                taken[n] = same[0]
    return taken


def _written_last(k: Kernel, n: fx.Node, readers: set) -> bool:
    """Whether output ``n`` of fused kernel ``k`` may be written over an input that ``readers`` (outputs
    of ``k``) read: every other reader is computed before ``n`` in a kernel of its own or is one of
    ``n``'s ancestors. Inductor's rule (``decide_inplace_update``): no use of the input may remain but
    ``n``'s, uses by ``n``'s ancestors and by nodes already generated not counting. Why not the sole
    reader alone: a loss's softmax kept for its backward is written over the logits that the NLL's
    gather read before it (a reduction over the rows, a node of its own): read by three outputs, the
    kernel model counted both buffers, and a Hugging Face OPT's save-all plan was simulated at 17.71
    MiB where its code peaks at 12.51."""
    if n not in readers:
        return False
    if len(readers) == 1:
        return True
    position = {node: i for i, node in enumerate(k.nodes)}
    ancestors = _ancestors_in(k, n)
    span = _iterations(k, n)
    return all(
        r is n or r in ancestors or (position[r] < position[n] and _iterations(k, r) != span) for r in readers
    )


def _ancestors_in(k: Kernel, n: fx.Node) -> set:
    """The nodes of ``k`` that ``n``'s computation reads, transitively."""
    members, seen, todo = set(k.nodes), set(), [n]
    while todo:
        for a in todo.pop().all_input_nodes:
            b = base_of(a)
            if b in members and b not in seen:
                seen.add(b)
                todo.append(b)
    return seen


def _iterations(k: Kernel, out: fx.Node) -> int:
    """How many elements the loop that computes output ``out`` runs over: its nearest reductions'
    inputs (within ``k``, not through its other outputs), else its own. Two outputs Inductor can fuse
    into one node iterate alike; where they do not, neither is in the other's node."""
    members, outputs = set(k.nodes), set(k.outputs)
    spans, seen, todo = [], set(), [out]
    while todo:
        node = todo.pop()
        if torch.Tag.reduction in getattr(node.target, "tags", ()):
            spans.append(_numel(node.args[0]))
            continue
        for a in node.all_input_nodes:
            b = base_of(a)
            if b in members and b not in outputs and b not in seen:
                seen.add(b)
                todo.append(b)
    return max(spans, default=_numel(out))


def _numel(node) -> int:
    val = node.meta.get("val") if isinstance(node, fx.Node) else None
    return val.numel() if isinstance(val, torch.Tensor) else 1


def _mutated_in_place(k: Kernel, i: int, size: dict, last: dict, keep: set, keys: dict) -> dict:
    """For an extern kernel running a custom op that mutates (``auto_functionalized``), each new value
    -> the buffer it mutates, where kernel ``i`` is that buffer's last reader. Why: Inductor's reinplace
    pass then runs the op on the buffer itself; counted as a new buffer, the chunked attention's K and V
    gradient accumulators put the demo GPT's simulated peak at 19.34 MiB, in the backward's last
    kernels, where its code peaks at 15.54 MiB under the first block's attention."""
    out = {}
    for node in k.nodes:
        for index, written in ti.functionalized_writes(node).items():
            base = keys.get(base_of(written), base_of(written))
            result = next(
                (n for n in k.outputs if n.target is operator.getitem and n.args[:2] == (node, index)), None
            )
            if (
                result is not None
                and isinstance(base, fx.Node)
                and base.op != "placeholder"  # a graph input: Inductor copies rather than mutate it
                and last.get(base) == i
                and base not in keep
                and _key(base, size) == _key(result, size)
            ):
                out[result] = base
    return out


def _peaks_without_pool(
    order: list[Kernel], size: dict, last: dict, keep: set, keys: dict, inplace: dict
) -> list[int]:
    """Each kernel's live bytes with its outputs allocated, every dead buffer freed where it dies, as
    Inductor estimates them (``EfficientPeakEstimate``) to decide a reuse: every graph input it may
    free counts apart at its own bytes until its last read (views of one kept buffer, and of the
    parameters: ``permute_33``, a weight transposed, as much as an activation), which puts its
    estimate's peak at the backward's start (a 2-layer GPT: 35.1 MiB there against 30.6 at the next
    peak), so that dead buffers are held across later peaks."""
    made = {n for k in order for n in k.outputs}
    first_read: dict = {}
    for i, k in enumerate(order):
        for r in k.reads:
            first_read.setdefault(r, i)
    inputs = [r for r in first_read if r not in made and _freeable_input(r)]
    final = {r: max(i for i, k in enumerate(order) if r in k.reads) for r in inputs}
    live, out = sum(nbytes(r) for r in inputs), []
    for i, k in enumerate(order):
        live += sum(size.get(n, 0) for n in k.outputs)
        out.append(live)
        dying = [d for d in _dying(k, i, last, keep, keys, size, {}) if d in made]
        live -= sum(size.get(d, 0) for d in dying) + sum(nbytes(r) for r in inputs if final[r] == i)
    return out


def _freeable_input(node) -> bool:
    """A graph input Inductor counts as freed after its last read (``is_nonfreeable_buffers``: not the
    parameters, tangents or RNG states)."""
    return (
        isinstance(node, fx.Node)
        and node.op == "placeholder"
        and not node.name.startswith(("primals_", "arg", "fwd_rng_state", "bwd_rng_state", "tangents"))
    )


def _readers(k: Kernel, keys: dict) -> dict:
    """Input buffer -> the outputs of fused kernel ``k`` whose computation reads it (through the
    kernel's other nodes, not through its other outputs)."""
    members = set(k.nodes)
    outputs = set(k.outputs)
    readers: dict = {}
    for o in k.outputs:
        seen, todo = set(), [o]
        while todo:
            n = todo.pop()
            for a in n.all_input_nodes:
                b = base_of(a)
                if b in members and b not in outputs:
                    if b not in seen:
                        seen.add(b)
                        todo.append(b)
                else:
                    readers.setdefault(keys.get(b, b), set()).add(o)
    return readers


def _death(node, last: dict, order: list[Kernel]) -> int:
    if node in last:
        return last[node]
    return next(i for i, k in enumerate(order) if node in k.outputs)


def _poolable(buf) -> bool:
    """Kept buffers and other graph inputs, and what the wrapper allocated (not fallback tuples)."""
    return isinstance(buf, str) or buf.op == "placeholder" or _wrapper_allocated(buf)


def _wrapper_allocated(node: fx.Node) -> bool:
    return node.target is not operator.getitem and not (is_extern(node) and not _single_tensor(node))


def _single_tensor(node: fx.Node) -> bool:
    return isinstance(node.meta.get("val"), torch.Tensor)


def _key(buf, size: dict) -> tuple:
    val = buf.meta.get("val") if isinstance(buf, fx.Node) else None
    return (getattr(val, "dtype", torch.float32), size.get(buf, 0))
