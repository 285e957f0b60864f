"""One planning step: a joint graph and a request in, a plan and its forward and backward graphs out.

:func:`plan_joint_graph` is what both partitioners call
(:class:`~recompile_opt.partitioner.RecompilePartitioner`
in a compile, :class:`~recompile_opt.frontier.FrontierPartitioner` in a sweep): it reads the joint
graph once (:func:`read_joint_graph`: cost model, peak oracle), plans it (``planner.search.make_plan``),
partitions it to match and sets the plan's figures. What a planning is asked is a frozen
:class:`Request`; what it remembers from earlier plannings is the caller's
:class:`~recompile_opt.planner.memory.PlanningMemory`. It changes neither. Why: the chunk choice, the
compiler paths and the plan cache each ask it something different, and each question is then a value
one can read, not state set on an object from outside.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import re
import time
import warnings
from pathlib import Path
from types import MappingProxyType
from typing import Callable, Mapping

import torch
import torch.fx as fx

from recompile_opt import _torch_internals as ti
from recompile_opt.costs import allocated, cuda_allocator
from recompile_opt.costs.inductor_peak import output_names, tangent_bytes
from recompile_opt.costs.peak import caller_outputs_bytes, peak_breakdown, pool_rule
from recompile_opt.costs.simulator import PeakSimulator, simulator_for
from recompile_opt.options import Options, cuda_device_roofline
from recompile_opt.passes.joint_graph import JointGraph, build_problem, sizes_before_gathers
from recompile_opt.passes.partition import partition
from recompile_opt.plan import Plan, fmt_bytes
from recompile_opt.planner import budget_split, chunk_choice, offload, solutions
from recompile_opt.planner.least_peak import range_walked
from recompile_opt.planner.memory import PlanningMemory
from recompile_opt.planner.problem import Problem
from recompile_opt.planner.search import make_plan, range_oracle
from recompile_opt.planner.solving import one_tensor_per_storage
from recompile_opt.provenance import code_hash

POOL_OFF_NOTE = (
    "Inductor's buffer pool off for this memory request (allow_buffer_reuse=False): each dead buffer is "
    "freed where it dies, not held for a later allocation of its size, which only adds to the peak"
)


@dataclasses.dataclass(frozen=True)
class Request:
    """What one planning is asked, beside its options.

    ``chunked``: the graph was chunked along the sequence (its pool is simulated by Inductor's rule
    and its plans walked more widely). ``candidates``: under ``chunks="auto"``, the chunk candidates
    of the unchunked graph: where one may lower the plan's peak, the planning answers
    ``wants_chunks`` instead of a plan to compile. ``known``: plans the chunk choice already made, by
    graph id (taken as they are). ``walk_every_plan``: the plan is walked in Inductor's code whatever
    its option (the chunk choice compares candidates by that peak). ``compiling``: Inductor compiles
    the graphs returned, so the plan's walk reads that compile's code (:class:`DeferredWalk`)."""

    chunked: bool = False
    candidates: tuple = ()
    known: Mapping[str, Plan] = dataclasses.field(default_factory=lambda: MappingProxyType({}))
    walk_every_plan: bool = False
    compiling: bool = False


@dataclasses.dataclass
class Joint:
    """A joint graph read once: its cost-model problem and its peak oracle (what every partitioner
    plans from)."""

    gm: fx.GraphModule
    num_fwd_outputs: int
    static: list[int] | None
    graph: JointGraph
    problem: Problem
    simulate: PeakSimulator
    gid: str


@dataclasses.dataclass
class Planned:
    """A planning's answer: the plan and its partition; ``wants_chunks`` where the plan may peak lower
    with the graph chunked (``Request.candidates``; the plan is then not to be compiled); ``deferred``
    where the plan's walk waits for Inductor's compile of ``fw`` and ``bw``."""

    plan: Plan
    fw: fx.GraphModule
    bw: fx.GraphModule
    wants_chunks: bool = False
    deferred: DeferredWalk | None = None


def roofline_of(options: Options, device: torch.device) -> dict:
    """The roofline constants for ``device`` (a CUDA device's by its name), option ``roofline`` over them."""
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else ""
    return options.roofline_for(device.type, name)


def roofline_notes(options: Options, device: torch.device) -> list[str]:
    """The plan's note of the CUDA device whose constants priced it (none for other devices)."""
    if device.type != "cuda":
        return []
    name = torch.cuda.get_device_name(device)
    r = roofline_of(options, device)
    known = (
        "its own"
        if cuda_device_roofline(name)
        else "generic CUDA (the device is not in options.CUDA_DEVICES)"
    )
    return [
        f"cost model: {name}, {known} roofline: {r['flops_per_s'] / 1e12:.0f} TFLOP/s, "
        f"{r['bytes_per_s'] / 1e12:.2f} TB/s"
        + (f" (option roofline sets {sorted(options.roofline)})" if options.roofline else "")
    ]


def read_joint_graph(gm: fx.GraphModule, kwargs: dict, options: Options, memory: PlanningMemory) -> Joint:
    """The joint graph AOTAutograd hands a partitioner (``kwargs``: its keywords), read into a
    problem and a peak oracle that shares the peaks found for the same graph before (``memory``)."""
    num_fwd_outputs = kwargs["num_fwd_outputs"]
    static = ti.inner_static_indices(gm, kwargs.get("static_lifetime_input_indices"))
    sizes_before_gathers(gm)
    jg = JointGraph(gm, num_fwd_outputs=num_fwd_outputs, static_lifetime_input_indices=static)
    problem = build_problem(
        jg,
        roofline_of(options, jg.device()),
        replay_random=replay_random(options),
        random_fuses=random_fuses(options),
    )
    simulate = simulator_for(
        gm,
        num_fwd_outputs=num_fwd_outputs,
        static_lifetime_input_indices=static,
        info=jg.info,
        found=memory.peaks,
    )
    simulate.offer(problem.sites)
    simulate.copy_clock = offload.copy_clock(problem, options)  # where the plans' offload copies go
    return Joint(gm, num_fwd_outputs, static, jg, problem, simulate, graph_id(gm))


def solves_kept():
    """Within the block, the planning's ILP answers are kept on disk beside Inductor's caches and read
    from there (:mod:`recompile_opt.planner.solutions`), as its peaks are (:func:`simulator_for`)."""
    return solutions.kept_in(Path(ti.cache_dir()) / "recompile_opt_solves", code_hash())


def oracle_pooled(joint: Joint, pooled: bool, memory: PlanningMemory) -> PeakSimulator:
    """``joint``'s peak oracle for plans compiled with Inductor's buffer pool on or off (``pooled``):
    its own where it was read so, else another of the same graph, keyed and walked under that setting.
    Why two: the kernel model's and the walks' peaks depend on the setting, and an oracle keeps its
    figures by plan alone (a caller planning under both, the frontier sweep, would mix them)."""
    if joint.simulate.pooled == pooled and ti.pools_buffers() == pooled:
        joint.simulate.walk_context = functools.partial(ti.buffer_pool, pooled)
        return joint.simulate
    with ti.buffer_pool(pooled):
        simulate = simulator_for(
            joint.gm,
            num_fwd_outputs=joint.num_fwd_outputs,
            static_lifetime_input_indices=joint.static,
            info=joint.graph.info,
            found=memory.peaks,
        )
    simulate.pooled, simulate.copy_clock = pooled, joint.simulate.copy_clock
    simulate.walk_context = functools.partial(ti.buffer_pool, pooled)  # where the planner switches oracles
    simulate.offer(joint.problem.sites)
    return simulate


def range_twin(joint: Joint, options: Options, memory: PlanningMemory) -> PeakSimulator | None:
    """For a fraction planned with Inductor's buffer pool on, the oracle its range's 0.0 end is searched
    with: the least-peak plan's, the pool off (:func:`pools_dead_buffers`); None where they agree."""
    budget = options.memory_budget
    if not (isinstance(budget, float) and 0.0 < budget < 1.0):
        return None
    pooled = pools_dead_buffers(dataclasses.replace(options, memory_budget=0.0, peak_memory=None))
    return None if pooled == joint.simulate.pooled else oracle_pooled(joint, pooled, memory)


def plan_joint_graph(
    gm: fx.GraphModule, kwargs: dict, options: Options, request: Request, memory: PlanningMemory
) -> Planned:
    """Plan the joint graph ``gm`` (``kwargs``: AOTAutograd's partitioner keywords) as ``request``
    asks, and partition it to match. The plan's predicted peak is its walk in Inductor's code where
    one was made (now, or for ``deferred`` once the compile's code exists), else the kernel model's;
    its code is walked with Inductor's buffer pool as the compile will set it (:func:`pools_dead_buffers`)."""
    with ti.buffer_pool(pools_dead_buffers(options)):
        return _plan_joint_graph(gm, kwargs, options, request, memory)


def _plan_joint_graph(
    gm: fx.GraphModule, kwargs: dict, options: Options, request: Request, memory: PlanningMemory
) -> Planned:
    start = time.perf_counter()
    joint = read_joint_graph(gm, kwargs, options, memory)
    simulate, problem = joint.simulate, joint.problem
    simulate.chunked, simulate.pooled = request.chunked, pools_dead_buffers(options)
    graph_options, split_note = budget_split.options_for_graph(memory, options, joint.gid)
    simulate.range_twin = range_twin(joint, graph_options, memory)
    used = usage(simulate)  # it shares the figures found by earlier compiles of this graph
    known = request.known.get(joint.gid)
    layout_note = _choose_layout(joint, request)
    if known is not None:
        plan, release = known, None
    else:
        plan, release = _new_plan(joint, graph_options, request, memory)
        plan.notes[:0] = [split_note] if split_note else []
        plan.notes += [layout_note] if layout_note else []
        plan.notes += [] if simulate.pooled else [POOL_OFF_NOTE]
        plan.notes += roofline_notes(options, joint.graph.device())
        if not replay_random(options) and any(v.random for v in problem.values.values()):
            plan.notes.append(
                "random ops are kept, not replayed: Inductor cannot yet compile CPU RNG-state "
                "replay with fallback_random=True (use compiler='eager' or Inductor's RNG)"
            )
    saved = {e.name for e in plan.saved if e.op != "rng_state"}
    recomputed = plan.recomputed_names()
    settled, _ = simulate.graph_for(recomputed)  # markers replaced (approximate backward)
    fw, bw = partition(
        settled,
        saved=saved,
        recomputed=recomputed,
        num_fwd_outputs=joint.num_fwd_outputs,
        static_lifetime_input_indices=joint.static,
        copy_clock=simulate.copy_clock,
    )
    plan.peak_breakdown = peak_breakdown(fw, bw, recomputed, pool=pool_rule(simulate.pooled, request.chunked))
    plan.solver["buffer_pool"] = simulate.pooled
    plan.outputs_bytes = caller_outputs_bytes(fw, joint.num_fwd_outputs)
    exact = simulate.known_exact(saved, recomputed)
    if exact is None and known is not None and known.solver.get("peak_from", "").startswith("inductor-code"):
        # the same joint graph (its id), the same saved set
        exact = known.solver.get("walked_peak_bytes", known.predicted_peak_bytes)
    budget = graph_options.memory_budget
    fraction = isinstance(budget, float) and budget < 1.0
    searched = (
        fraction
        and graph_options.peak_memory is None
        and range_walked(problem, graph_options, memory.range_ends, range_oracle(simulate).walk_setting)
    )
    # walked: every plan Inductor compiles (its own code, once it exists: DeferredWalk), a plan made
    # without a compile that answers a memory request (walks_plan), one whose search walked this
    # graph, and where Inductor copies convolutions' inputs channels-last (only its code shows it)
    walk = exact is None and (searched or ti.layout_optimized(fw) or walks_plan(options, request))
    wants_chunks = (
        known is None and bool(request.candidates) and _worth_chunking(plan, exact, options, request, release)
    )
    if (wants_chunks and exact is None) or (walk and not request.compiling):
        exact = simulate.exact(saved, recomputed)  # candidates are compared by walked peaks
    if wants_chunks:
        set_peak(plan, exact, simulate, used, time.perf_counter() - start, (fw, bw))
        return Planned(plan, fw, bw, wants_chunks=True)
    deferred = None
    # on CUDA a walked plan's figure is the allocator's blocks, read off the compile's code as well;
    # not a chunk choice's candidate's: candidates are compared by their walks, as the search's plans
    blocks = exact is not None and not request.walk_every_plan and allocated.on_cuda(simulate.gm)
    # a plan walked before its compile (by its search, or as a chunk choice's candidate) is walked
    # again in the compile's code: a search's walk simulates the forward, and the code is what runs
    if (walk or exact is not None) and request.compiling:
        deferred = DeferredWalk(
            plan, fw, bw, (output_names(fw), tangent_bytes(bw)), saved, simulate, used, options
        )
    choice_s = known.solver.get("chunk_choice_s", 0.0) if known is not None else 0.0
    set_peak(plan, exact, simulate, used, choice_s + time.perf_counter() - start, (fw, bw))
    if deferred is None:  # its figures are final now
        if blocks:
            in_allocator_blocks(plan, allocator_blocks(plan, simulate, saved, recomputed, None))
        check_limit(plan, options, _why_unwalked(exact, walk, simulate, saved, recomputed, options))
    return Planned(plan, fw, bw, deferred=deferred)


def _why_unwalked(exact, walk: bool, simulate, saved: set, recomputed: set, options: Options) -> str | None:
    """Why a plan whose figures are final has no walked peak (None: it has one)."""
    if exact is not None:
        return None
    if walk:
        return simulate.why_unwalked(saved, recomputed)
    if options.compiler != "inductor":
        return f"compiler={options.compiler!r} runs no Inductor code"
    return "planned without a compile; compiling it walks its code"


def _new_plan(
    joint: Joint, options: Options, request: Request, memory: PlanningMemory
) -> tuple[Plan, Callable | None]:
    """The search's plan, and where chunks may still be tried under a ``peak_memory`` limit, how to
    make its miss the user's after all. A miss is not yet the user's there: the plan is made without
    ``strict`` and its limit warnings held back, to be raised (or, under ``strict``, its error) only
    if chunking is not tried (:func:`_worth_chunking`); else the chunk choice decides. Returns the
    plan and that release (None where nothing is held)."""

    def plan_with(opts: Options) -> Plan:
        with solves_kept():
            return ti.on_fresh_stack(
                make_plan, joint.problem, opts, graph=joint.gid, simulate=joint.simulate, memory=memory
            )

    if not (request.candidates and options.peak_memory is not None):
        return plan_with(options), None
    with warnings.catch_warnings(record=True) as held:
        warnings.simplefilter("always")
        plan = plan_with(dataclasses.replace(options, strict=False))
    plan.options = {**plan.options, "strict": options.strict}

    def release() -> None:
        if options.strict:  # the plan is the user's after all: its strict error
            plan_with(options)
        for w in held:  # or its warnings
            warnings.warn(w.message, w.category)

    return plan, release if held else None


def _worth_chunking(plan: Plan, exact, options: Options, request: Request, release: Callable | None) -> bool:
    """``chunks="auto"``: whether chunking may serve this unchunked plan's goal
    (:func:`chunk_choice.worth_trying`: a lower peak, or under a ``peak_memory`` limit it meets, less
    recompute), judged by its walked peak where one is known (the figure a limit is finally checked
    against), else the kernel model's; where not, the plan's notes say why nothing was tried, and what
    :func:`_new_plan` held back is the user's (``release``). A plan that meets its limit with something
    held back (a byte budget below the least, a limit met only inside the scratch margin) is the user's
    as it is: the chunk choice hands back the plan it takes without planning again, so what it held
    would never be said."""
    peak = plan.peak_breakdown["total"] if exact is None else exact
    limit = options.peak_memory
    if release is not None and limit is not None and peak <= limit:
        why_not = "chunks (auto): not tried: the unchunked plan meets peak_memory, with a warning of its own"
    else:
        why_not = chunk_choice.worth_trying(list(request.candidates), plan, peak, limit)
    if why_not:
        plan.notes.append(why_not)
        if release is not None:
            release()
    return why_not is None


def _choose_layout(joint: Joint, request: Request) -> str | None:
    """Where Inductor would lay this graph's convolutions out channels-last, its save-all plan walked
    in both layouts; where the convolutions' own layout peaks lower, every plan is walked in it and
    Inductor's layout switched off for the rest of this compile. Returns the plan's note, else None.

    Why: the channels-last copies Inductor makes of a convolution's input and weight are kept for
    the backward. A ViT's images and patch weights: every plan measured 203,824 B against eager's
    133,332, its save-all plan 146,660 in the plain layout. A ResNet's channels-last convolution
    backward needs less scratch than the plain one: there it stays. Why before the search: its
    plans are compared by their walks, and in the copies' layout they all tie. Under
    ``compiler="eager"`` too: it plans the graph Inductor would, and its walked figures are Inductor's
    compile's (they had stayed channels-last: a ViT's plans all walked 514,092 B, compiled 382,508)."""
    if not ti.layout_optimized(joint.gm):
        return None
    saved, recomputed = one_tensor_per_storage(joint.problem, set(), set())
    channels_last = joint.simulate.exact(saved, recomputed)
    plain = joint.simulate.exact_in_plain_layout(saved, recomputed)
    if channels_last is None or plain is None or plain >= channels_last:
        return None
    joint.simulate.walk_in_plain_layout()
    if request.compiling:
        ti.switch_layout_optimization_off()
    return (
        "convolutions in their own layout: Inductor's channels-last copies, kept for the backward, "
        f"would raise the save-all plan's peak to {fmt_bytes(channels_last)} (walked) from "
        f"{fmt_bytes(plain)}; every plan is walked in this layout"
    )


@dataclasses.dataclass
class DeferredWalk:
    """A plan whose walk waits for Inductor's compile of its graphs: :meth:`finish` reads it off the
    code that compile generated. Why: lowering the plan a second time for the walk cost as much as
    Inductor's own lowering; the compile's own code is the same code, with its real strides."""

    plan: Plan
    fw: fx.GraphModule
    bw: fx.GraphModule
    # the forward's output names and the backward's tangents' bytes, read before Inductor's compile
    # rewrites the graphs (its inputs then have no values)
    outputs: tuple[list, dict]
    saved: set
    simulate: PeakSimulator
    used: tuple
    options: Options

    def finish(self, compiled: list) -> None:
        """The plan's exact peak from ``compiled`` (``_torch_internals.compiled_wrapper_code``'s
        records), or from a lowering of its own where none was recorded (a graph from Inductor's
        cache); then its limit checked."""
        start = time.perf_counter()
        recomputed = self.plan.recomputed_names()
        codes = {backward: code for backward, code in reversed(compiled)}  # the first of each
        walked = (self.fw, self.bw, (codes[False], codes[True], *self.outputs)) if len(codes) == 2 else None
        with ti.buffer_pool(pools_dead_buffers(self.options)):  # a lowering of its own as compiled
            exact = self.simulate.exact(self.saved, recomputed, compiled=walked)
            cuda = exact is not None and allocated.on_cuda(self.simulate.gm)
            found = (
                allocator_blocks(self.plan, self.simulate, self.saved, recomputed, walked) if cuda else None
            )
        seconds = self.plan.solver["plan_s"] + time.perf_counter() - start
        set_peak(self.plan, exact, self.simulate, self.used, seconds, (self.fw, self.bw))
        if found is not None:
            in_allocator_blocks(self.plan, found)
        why = None if exact is not None else self.simulate.why_unwalked(self.saved, recomputed)
        check_limit(self.plan, self.options, why)


ALLOCATOR_NOTE = "CUDA caching allocator:"


def allocator_blocks(plan: Plan, simulate, saved: set, recomputed: set, compiled) -> tuple[int | None, str]:
    """The plan's peak in the CUDA caching allocator's blocks (:func:`allocated.blocks_peak`), or None and
    why not: a plan that offloads copies on a stream of its own, whose blocks the one-stream model of
    the allocator does not follow (a block freed there waits for the copy's event)."""
    if plan.offloaded:
        return None, "the offload copies' stream not modelled"
    return allocated.blocks_peak(simulate, saved, recomputed, compiled)


def in_allocator_blocks(plan: Plan, found: tuple[int | None, str]) -> None:
    """On a CUDA device, the walked plan's predicted peak as the caching allocator counts it
    (``found``: :func:`recompile_opt.costs.allocated.blocks_peak`), the walk's figure kept in
    ``solver["walked_peak_bytes"]``, both in a note; where the allocator is not modelled, the walk's
    figure stays and the note says why. Why: what users read (``max_memory_allocated``) and
    ``peak_memory`` is held to are the blocks, not the code's requests."""
    blocks, how = found
    walked = plan.solver.get("walked_peak_bytes", plan.predicted_peak_bytes)  # blocks set before
    plan.notes[:] = [n for n in plan.notes if not n.startswith(ALLOCATOR_NOTE)]  # a plan planned again
    if blocks is None:
        plan.notes.append(
            f"{ALLOCATOR_NOTE} {how}: the predicted peak is the code's requests "
            f"({fmt_bytes(walked)}, walked); the allocator's blocks may hold more"
        )
        return
    plan.solver.update(walked_peak_bytes=walked, peak_from="inductor-code+cuda-allocator")
    plan.predicted_peak_bytes = blocks
    plan.notes.append(
        f"{ALLOCATOR_NOTE} the code's requests peak at {fmt_bytes(walked)} (walked), the "
        f"allocator's blocks at {fmt_bytes(blocks)} in a steady step ({how}); the predicted peak is "
        "the blocks'"
    )


def check_limit(plan: Plan, options: Options, unwalked: str | None) -> None:
    """The plan taken against its figures' promise: a ``peak_memory`` limit over the code's walked
    peak, or held to the kernel model's estimate where the code could not be walked (``unwalked``:
    why), is said so in a warning and a note. Why: a user's hard limit is the one check README
    promises in Inductor's code; a miss must never be silent."""
    if unwalked:
        plan.solver["unwalked"] = unwalked
    limit = options.peak_memory
    # under compiler="eager" the figures are the kernel model's, and say so
    if limit is None or plan.predicted_peak_bytes is None or options.compiler != "inductor":
        return
    msg = None
    if unwalked:
        msg = (
            f"recompile_opt: peak_memory={fmt_bytes(limit)} was held to the kernel model's estimate "
            f"({fmt_bytes(plan.predicted_peak_bytes)}), not checked in Inductor's code: {unwalked}"
        )
    elif plan.predicted_peak_bytes > limit and "walked_peak_bytes" in plan.solver:
        split = cuda_allocator.parse(*ti.cuda_allocator_settings()).expandable_segments
        msg = (
            f"recompile_opt: peak_memory={fmt_bytes(limit)} is not met: the code Inductor generated "
            f"asks for {fmt_bytes(plan.solver['walked_peak_bytes'])} at its peak (walked), which the "
            f"CUDA caching allocator holds in {fmt_bytes(plan.predicted_peak_bytes)} of blocks"
            + ("" if split else "; PYTORCH_ALLOC_CONF=expandable_segments:True splits every block")
        )
    elif plan.predicted_peak_bytes > limit:
        msg = (
            f"recompile_opt: peak_memory={fmt_bytes(limit)} is not met: the code Inductor generated "
            f"peaks at {fmt_bytes(plan.predicted_peak_bytes)} (walked)"
        )
    if msg and not any(msg[len("recompile_opt: ") :] in n for n in plan.notes):
        warnings.warn(msg)
        plan.notes.append(msg)


def set_peak(plan: Plan, exact, simulate, used, seconds: float, graphs: tuple = (None, None)) -> None:
    """The plan's predicted peak (walked where ``exact`` is known, else the kernel model's) and what
    its planning cost: ``seconds`` (cost model, search, partition, walks) and the oracle's calls since
    ``used``. ``graphs``: the plan's forward and backward, which name the values alive at a walked peak."""
    plan.predicted_peak_bytes = plan.peak_breakdown["total"] if exact is None else exact
    plan.solver["peak_from"] = "simulator" if exact is None else "inductor-code"
    plan.solver.pop("walked_peak_bytes", None)  # the blocks' figure of an earlier set: in_allocator_blocks
    recomputed = plan.recomputed_names()
    trace = simulate.walked_peak({e.name for e in plan.saved if e.op != "rng_state"}, recomputed)
    if exact is None:
        plan.walked_breakdown = {}
    elif trace is not None:  # else a plan made earlier keeps its own (the chunk choice's)
        plan.walked_breakdown = trace.breakdown(recomputed, graphs[trace.phase == "backward"])
    plan.solver["plan_s"] = round(seconds, 3)
    for oracle in (simulate, getattr(simulate, "range_twin", None)):
        if oracle is not None:
            oracle.store()
    simulations, simulate_s, exact_peaks, exact_s, in_forks, failed = (
        a - b for a, b in zip(usage(simulate), used)
    )
    plan.solver.update(
        simulations=simulations,
        simulate_s=round(simulate_s, 3),
        exact_peaks=exact_peaks,
        exact_s=round(exact_s, 3),
        walked_in_forks=in_forks,
    )
    if failed:
        plan.notes.append(fork_failure_note(failed, simulate))


def fork_failure_note(failed: int, simulate) -> str:
    """The plan's note where ``failed`` forks of this process could not walk its candidates
    (costs/walk_pool.py): its planning took longer for it, and where CUDA is initialised no fork
    walks again in this process."""
    whys = [
        w for o in (simulate, getattr(simulate, "range_twin", None)) for w in getattr(o, "fork_failures", ())
    ]
    again = "" if ti.forkable() else "; with CUDA initialised here, no fork walks again in this process"
    return (
        f"walks: {failed} fork{'s' * (failed != 1)} of this process walked nothing (the last: "
        f"{whys[-1] if whys else 'no reason given'}); their plans were walked here{again}"
    )


def usage(simulate) -> tuple:
    """``simulate.usage()`` with its range twin's (:func:`range_twin`): the plans a planning simulated
    and walked, and their seconds, whichever oracle it asked."""
    twin = getattr(simulate, "range_twin", None)
    own = simulate.usage()
    return own if twin is None else tuple(a + b for a, b in zip(own, twin.usage()))


def walks_plan(options: Options, request: Request) -> bool:
    """Whether the plan taken is walked in Inductor's generated code for its predicted peak even where
    the search did not walk: in Inductor's compile (``request.compiling``); where a plan is made
    without one (``recompile_opt.plan``), a plan that answers a memory request (a byte budget, a
    fraction below 1.0, ``peak_memory``: one lowering, seconds) and every candidate of the chunk
    choice (compared by that peak). A fixed policy's or save-all's plan made without a compile, and
    any under ``compiler="eager"`` (no such code runs), give the kernel model's figures where their
    search walked no such plan, and say so."""
    if request.walk_every_plan or request.compiling:
        return True
    budget = options.memory_budget
    asks_memory = (
        options.peak_memory is not None
        or isinstance(budget, int)
        or (isinstance(budget, float) and budget < 1.0)
    ) and options.policy == "auto"
    return options.compiler == "inductor" and asks_memory


def pools_dead_buffers(options: Options) -> bool:
    """Whether Inductor's wrapper may hold a dead buffer for a later allocation of its size
    (``allow_buffer_reuse``) in the graphs planned under ``options``: not where the plan's goal is the
    step's peak (``memory_budget=0.0``, ``peak_memory``); the planning walks, the kernel model, the
    frontier sweep and the compile all follow this answer. Why: a held buffer never lowers the peak
    (the allocation it serves takes its bytes either way) and Inductor decides it against its own
    estimate of one graph's peak: the demo Llama's least-peak plan held 2.32 MiB of dead buffers at
    its peak, the demo GPT's with chunked attention 5.25 MiB (docs/design.md, "Inductor's buffer
    pool"). A budget on the kept bytes (a fraction, bytes) keeps Inductor's setting: off there, the
    demo Llama's 0.5 plan kept less and peaked higher (41.05 against 36.80 MiB, not understood)."""
    return options.peak_memory is None and not least_peak(options)


def least_peak(options: Options) -> bool:
    """Whether ``options`` ask for the least-peak plan (``memory_budget=0.0``, a float)."""
    return isinstance(options.memory_budget, float) and options.memory_budget == 0.0


def replay_random(options: Options) -> bool:
    """Replaying a random op from a saved CPU RNG state (``run_with_rng_state``) works in the eager
    path and through Inductor's own RNG (its seeds make recompute deterministic). With
    ``fallback_random`` Inductor keeps ``native_dropout``, and its lowering of the replay HOP around
    a tuple-returning op fails (torch 2.13), so there random ops are kept."""
    return options.compiler == "eager" or not ti.inductor_config.fallback_random


def random_fuses(options: Options) -> bool:
    """Inductor with its own RNG draws a recomputed ``rand`` inside the kernel that reads it, only
    where it reads (the cost model's demanded share); the eager path replays the whole draw."""
    return options.compiler == "inductor" and not ti.inductor_config.fallback_random


def graph_id(gm: fx.GraphModule) -> str:
    """A hash of the graph's code with device names removed, so a graph captured on the meta device
    has the id it has on the device it trains on (the budget split is keyed by it)."""
    code = re.sub(r"device\(type='[a-z]+'(, index=\d+)?\)", "device", gm.code)
    return hashlib.sha256(code.encode()).hexdigest()[:12]
