"""Option ``chunks``: the Dynamo graph chunked along the sequence before AOTAutograd, forced or chosen.

Forced (``chunks={"loss": k, "mlp": k}``) the regions are rewritten (:func:`chunk_regions`) and the graph
compiled. Under ``"auto"`` the choice is lazy (:func:`compile_with_chunk_choice`): the graph is compiled
unchunked, and only where its plan may peak lower chunked does the partitioner stop that compile
(:class:`~recompile_opt.partitioner.ChunkingWanted`); the chunked versions are then planned against it
(:func:`chunk_choice.choose`) and the graph compiled as chosen, the plan taken handed to the partitioner.
"""

from __future__ import annotations

import dataclasses
import functools
import time
import warnings
from types import MappingProxyType

import torch
import torch.fx as fx

from recompile_opt import _torch_internals as ti
from recompile_opt.options import OptionError, Options
from recompile_opt.partitioner import ChunkingWanted, RecompilePartitioner
from recompile_opt.passes.chunk_attention import chunk_attention, find_attention_regions
from recompile_opt.passes.chunk_mlp import chunk_mlp, find_mlp_regions
from recompile_opt.passes.chunking import chunk_loss, find_loss_regions
from recompile_opt.plan import Plan
from recompile_opt.planner import chunk_choice
from recompile_opt.planner.chunk_choice import FAMILY
from recompile_opt.planning import least_peak, roofline_of

# each region kind of option 'chunks': how its regions are found, how one is rewritten, and the
# keywords that rewrite (and the region's description and plan entry) take
CHUNKERS = {
    "loss": (find_loss_regions, chunk_loss, {}),
    "loss_recompute": (find_loss_regions, chunk_loss, {"recompute": True}),
    "mlp": (find_mlp_regions, chunk_mlp, {}),
    "attention": (find_attention_regions, chunk_attention, {}),
}


@dataclasses.dataclass
class Chunked:
    """What :func:`chunk_regions` did: note lines, one plan entry per chunked region, whether any
    region was chunked, and what the chunk choice that chose them cost (``solver``: its
    ``chunk_choice_s`` and ``chunk_choice`` figures; empty where the chunks were forced)."""

    notes: list = dataclasses.field(default_factory=list)
    records: list = dataclasses.field(default_factory=list)
    chunked: bool = False
    solver: dict = dataclasses.field(default_factory=dict)


def compile_with_chunk_choice(compile_once, gm: fx.GraphModule, example_inputs, partitioner, *, capture):
    """``compile_once(gm, example_inputs, partitioner, chosen)``, with ``chunks="auto"`` chosen lazily;
    ``capture(gm, example_inputs, partitioner)`` plans a chunked candidate without code generation.

    Where the plan's goal is memory and the graph has regions that can be chunked, the partitioner plans
    the graph unchunked as usual, and only where a region's full-length tensors are alive at that plan's
    peak (under ``peak_memory``: where it misses the limit, or meets it by recomputing) does it raise
    ``ChunkingWanted``; then the graph's chunked versions are planned against that plan
    (:func:`chunk_choice.choose`) and the graph is compiled again as chosen, its plan handed to the
    partitioner. Why lazily: a graph whose peak holds none of the regions' tensors pays nothing for
    ``"auto"``."""
    options = partitioner.options if isinstance(partitioner, RecompilePartitioner) else None
    candidates, passed = _auto_candidates(gm, example_inputs, options)
    once = functools.partial(compile_once, gm, example_inputs, partitioner, None)
    if not candidates:
        return _noted(once, partitioner, passed)
    pristine = ti.copy_dynamo_graph(gm)  # the passes below and Inductor's change the graph they compile
    try:
        with partitioner.asked(candidates=tuple(candidates)):
            return _noted(once, partitioner, passed)
    except ChunkingWanted as wanted:
        unchunked = wanted.plan
    chosen, known = _choose_chunks(pristine, example_inputs, partitioner, candidates, unchunked, capture)
    chosen["notes"] += [passed] if passed else []
    with partitioner.asked(known=MappingProxyType(known)):
        return compile_once(pristine, example_inputs, partitioner, chosen)


def _noted(compile_now, partitioner, line: str | None):
    """``compile_now()``, the plan it made (none on a cache hit, or without a backward) given the note
    ``line`` where there is one."""
    made = len(getattr(partitioner, "plans", ()))
    compiled = compile_now()
    plans = getattr(partitioner, "plans", ())
    if line and len(plans) > made and line not in plans[-1].notes:
        plans[-1].notes.append(line)
    return compiled


def _auto_candidates(gm: fx.GraphModule, example_inputs, options: Options | None) -> tuple[list, str | None]:
    """``chunks="auto"``: the chunk candidates of the graph's regions where the plan's goal is memory
    (``memory_budget=0.0``, the least-peak plan, or a ``peak_memory`` limit), else none; and the note
    where the goal passes over a kind (:func:`chunk_choice.below_floor_note`)."""
    if options is None or options.chunks != "auto" or options.policy != "auto" or _symbolic(example_inputs):
        return [], None
    if not (least_peak(options) or options.peak_memory is not None):
        return [], None
    device = next((t.device for t in example_inputs if isinstance(t, torch.Tensor)), torch.device("cpu"))
    meta = device.type == "meta"  # planning for the target's type: no device to ask its name
    roofline = options.roofline_for(options.target_device) if meta else roofline_of(options, device)
    every = chunk_choice.candidates(
        find_loss_regions(gm), find_mlp_regions(gm), roofline, attention_regions=find_attention_regions(gm)
    )
    tried = chunk_choice.for_goal(every, options.peak_memory)
    return tried, chunk_choice.below_floor_note(every, tried)


def _symbolic(example_inputs) -> bool:
    """Whether the graph has symbolic sizes (``dynamic=True``): ``"auto"`` leaves it unchunked, since
    reading a region's tokens as a number would specialise the graph to this length (a recompile per
    length); forced chunks work there."""
    return any(
        isinstance(x, torch.SymInt)
        or isinstance(x, torch.Tensor)
        and any(isinstance(d, torch.SymInt) for d in x.shape)
        for x in example_inputs
    )


def chunk_regions(gm: fx.GraphModule, options: Options, chosen: dict | None) -> Chunked:
    """Mini-sequence chunking of the Dynamo graph before AOTAutograd (:mod:`recompile_opt.passes.chunking`,
    :mod:`~recompile_opt.passes.chunk_mlp`, :mod:`~recompile_opt.passes.chunk_attention`): forced by
    ``chunks={"loss": k, "mlp": k, "attention": k}``, or ``chosen`` by :func:`_choose_chunks`
    (``{"chunks": {...}, "notes": [...], "saved": bytes, "solver": {...}}``).
    A forced region that cannot be chunked raises, naming it and why."""
    chunks, notes, saved, cost = options.chunks, [], None, {}
    if chosen is not None:
        chunks, notes, saved, cost = chosen["chunks"], chosen["notes"], chosen["saved"], chosen["solver"]
    chunks = chunks if isinstance(chunks, dict) else {}
    done = Chunked(notes=notes, chunked=any(k != 1 for k in chunks.values()), solver=cost)
    for kind, k in chunks.items():
        if k == 1:
            continue
        find, rewrite, how = CHUNKERS[kind]
        regions = find(gm)
        for region in regions:
            if region.why_not is not None:
                raise OptionError(f"option 'chunks': {region.name} cannot be chunked: {region.why_not}")
        for region in regions:
            region_how = {**how, **_loss_body(region, options)} if FAMILY[kind] == "loss" else how
            done.notes.append("chunk: " + region.describe(k, **region_how))
            done.records.append({**region.record(k, **region_how), "peak_saved_bytes": saved})
            rewrite(gm, region, k, **region_how)
    return done


def _loss_body(region, options: Options) -> dict:
    """How a loss region's chunks run their body (option ``fused_loss``): ``{"fused": bool}``; "auto"
    fuses on CUDA (and on the meta device where the plan targets CUDA) where Inductor compiles."""
    if options.fused_loss != "auto":
        return {"fused": options.fused_loss}
    if options.compiler != "inductor":
        return {"fused": False}
    device = region.device or "cpu"
    return {"fused": (options.target_device if device == "meta" else device) == "cuda"}


def _choose_chunks(
    gm: fx.GraphModule,
    example_inputs,
    partitioner: RecompilePartitioner,
    candidates: list,
    unchunked: Plan,
    capture,
) -> tuple[dict, dict[str, Plan]]:
    """Plan ``gm`` chunked as the candidates say, against its ``unchunked`` plan
    (:func:`chunk_choice.choose`). Returns the choice (:func:`chunk_regions`'s ``chosen``) and the plan
    taken by graph id, for the partitioner to take as it is (none where it misses a ``peak_memory``
    limit, or one that warned: planned again, to warn or raise as usual)."""
    options = partitioner.options
    planned, warned = [unchunked], set()

    def plan_with(chunks: dict) -> Plan:
        # a candidate that misses a limit is not the user's plan: no warning, no strict error from it
        trial = RecompilePartitioner(
            dataclasses.replace(options, chunks=chunks or False, strict=False), partitioner.memory
        )
        with warnings.catch_warnings(record=True) as caught, trial.asked(walk_every_plan=True):
            warnings.simplefilter("always")
            capture(ti.copy_dynamo_graph(gm), example_inputs, trial)
        plan = trial.plans[-1]
        if caught:  # a byte budget below the least: the user's warning, or under strict their error
            warned.add(id(plan))
        plan.options = {**plan.options, "strict": options.strict, "chunks": options.chunks}
        planned.append(plan)
        return plan

    start = time.perf_counter()
    taken, unchunked, best, notes = chunk_choice.choose(candidates, plan_with, options.peak_memory, unchunked)
    planned = list({id(p): p for p in planned if p is not None}.values())
    cost = {  # the planning this choice took, the unchunked plan's included: the plan's planning counts it
        "chunk_choice_s": round(unchunked.solver["plan_s"] + time.perf_counter() - start, 3),
        "chunk_choice": {
            "plannings": len(planned),
            "simulations": sum(p.solver.get("simulations", 0) for p in planned),
            "walks": sum(p.solver.get("exact_peaks", 0) for p in planned),
        },
    }
    best.solver.update(cost)
    fits = options.peak_memory is None or best.predicted_peak_bytes <= options.peak_memory
    fits = fits and id(best) not in warned
    saved = unchunked.predicted_peak_bytes - best.predicted_peak_bytes if taken else None
    chosen = {"chunks": taken, "notes": notes, "saved": saved, "solver": cost}
    return chosen, ({best.graph: best} if fits else {})
