"""The two compiler paths a graph takes: Inductor's ``compile_fx`` (kernels generated), or AOTAutograd
with Inductor's decompositions and joint passes and no code generation (``compiler="eager"``, and the
capture-only path of :func:`recompile_opt.plan`). Both run the same partitioner on the same joint graph.
"""

from __future__ import annotations

import contextlib
import functools

import torch
import torch.fx as fx

from recompile_opt import _torch_internals as ti
from recompile_opt.chunk_driver import Chunked, chunk_regions, compile_with_chunk_choice
from recompile_opt.options import Options
from recompile_opt.parallel.sequence_pass import add_sequence_parallel
from recompile_opt.partitioner import RecompilePartitioner
from recompile_opt.passes.approximate import offer_approximations
from recompile_opt.passes.meta_attention import fuse_attention_for
from recompile_opt.planning import pools_dead_buffers


def compile_inductor(gm: fx.GraphModule, example_inputs, partitioner: RecompilePartitioner):
    """Inductor's ``compile_fx`` with our partitioner, ``chunks="auto"`` chosen lazily."""
    capture = functools.partial(compile_eager, aten_random=False)
    return compile_with_chunk_choice(_compile_inductor_once, gm, example_inputs, partitioner, capture=capture)


def _compile_inductor_once(
    gm: fx.GraphModule, example_inputs, partitioner: RecompilePartitioner, chosen: dict | None
):
    """:func:`compile_inductor` with the graph chunked as ``chosen`` (or forced)."""
    chunked = chunk_regions(gm, partitioner.options, chosen)
    offered = offer_approximations_of(gm, partitioner.options)
    # where the plan taken is walked for its figures, the walk reads the code this compile
    # generates; only there is the backward lowered with the forward (a model run with grad enabled
    # but never backward, an evaluation, would otherwise build a backward it never runs)
    defer = partitioner.walks_plan_taken()
    with (
        ti.compiled_wrapper_code() as lowered,
        ti.layout_setting_restored(),
        ti.lower_backward_eagerly() if defer else contextlib.nullcontext(),
        partitioner.asked(chunked=chunked.chunked, compiling=defer),
    ):
        pool = ti.buffer_pool_patch(pools_dead_buffers(partitioner.options))
        compiled = ti.compile_fx(
            gm, example_inputs, config_patches={"custom_partitioner_fn": partitioner, **pool}
        )
    partitioner.finish_peak(lowered)
    note(partitioner, chunked)
    note(partitioner, offered)
    return compiled


def compile_eager(gm, example_inputs, partitioner, *, aten_random: bool = True):
    """AOTAutograd with Inductor's decompositions and joint passes, ``partitioner`` (ours, or any
    function of torch's partitioner signature), no codegen.

    Inductor's RNG prims only mean something to Inductor's code generator (their eager versions ignore
    the seed), so a graph run this way keeps random ops as aten ops (``fallback_random``) and replays
    them. ``aten_random=False`` keeps Inductor's setting: for capture only, the plan compile would make.
    On the meta device SDPA calls become the target device's fused kernel first
    (:mod:`recompile_opt.passes.meta_attention`).
    """
    once = functools.partial(_compile_eager_once, aten_random=aten_random)
    capture = functools.partial(compile_eager, aten_random=aten_random)
    return compile_with_chunk_choice(once, gm, example_inputs, partitioner, capture=capture)


def _compile_eager_once(gm, example_inputs, partitioner, chosen: dict | None, *, aten_random: bool):
    """:func:`compile_eager` with the graph chunked as ``chosen`` (or forced)."""

    def nop(g, _inputs):
        return ti.make_boxed_func(g.forward)

    ours = isinstance(partitioner, RecompilePartitioner)
    options = partitioner.options if ours else Options()  # torch's own partitioner (frontier) has none
    part = ti.inductor_partition_fn_with(partitioner)
    fake_mode = ti.detect_fake_mode(example_inputs) or ti.FakeTensorMode(allow_non_fake_inputs=True)
    patches = {"fallback_random": True if aten_random else ti.inductor_config.fallback_random}
    chunked = chunk_regions(gm, options, chosen)
    offered = offer_approximations_of(gm, options)
    fused = 0
    meta = any(isinstance(t, torch.Tensor) and t.device.type == "meta" for t in example_inputs)
    if meta:
        # Inductor's joint-graph constant folding treats every meta tensor as foldable and would
        # fold the whole graph away; on real devices it only folds true constants.
        patches["joint_graph_constant_folding"] = False
        fused = fuse_attention_for(gm, options.target_device)  # meta has no SDPA kernel of its own
    with (
        ti.V.set_fake_mode(fake_mode),
        ti.inductor_config.patch(patches),
        partitioner.asked(chunked=chunked.chunked) if ours else contextlib.nullcontext(),
        ti.composite_autograd_on_meta() if meta else contextlib.nullcontext(),
    ):
        # the decomposition table depends on fallback_random: build it inside the patch, or dropout
        # would decompose into Inductor's rand + compare and draw other masks than eager's
        backend = ti.aot_autograd(
            fw_compiler=nop,
            bw_compiler=nop,
            partition_fn=part,
            decompositions=ti.select_decomp_table(),
            keep_inference_input_mutations=True,
        )
        compiled = backend(gm, example_inputs)
    if fused:
        note(
            partitioner,
            [
                f"meta device: {fused} attention call(s) planned as the fused kernel "
                f"target_device={options.target_device!r} runs (its output and logsumexp, no s x s tensor)"
            ],
        )
    note(partitioner, chunked)
    note(partitioner, offered)
    return compiled


def sequence_parallel_of(gm: fx.GraphModule, options: Options) -> list[str]:
    """Option ``sequence_parallel``: a hand tensor-parallel Dynamo graph made tensor + sequence parallel
    in place, first of all passes (:mod:`recompile_opt.parallel.sequence_pass`); the plan's note lines."""
    return add_sequence_parallel(gm) if options.sequence_parallel else []


def offer_approximations_of(gm: fx.GraphModule, options: Options) -> list[str]:
    """Option ``approximate``: the Dynamo graph's activations and linears become sites the planner may
    approximate (:mod:`recompile_opt.passes.approximate`); the note lines say how many."""
    if not options.approximate:
        return []
    return [offer_approximations(gm, options.approximate).note(options.approximate)]


def note(partitioner, lines: list[str] | Chunked) -> None:
    """Add ``lines`` (and the chunked regions) to the plan just made for this graph (none on a cache hit,
    nor for torch's own partitioner)."""
    if not isinstance(partitioner, RecompilePartitioner) or not partitioner.plans:
        return
    plan = partitioner.plans[-1]
    if isinstance(lines, Chunked):  # a plan the chunk choice made has its chunks already
        plan.chunks = [*lines.records]
        _count_choice(plan, lines.solver)
        lines = lines.notes
    plan.notes.extend(line for line in lines if line not in plan.notes)


def _count_choice(plan, cost: dict) -> None:
    """A plan made anew after a chunk choice (``cost``: its figures) counts that choice's planning as
    the plan the choice made does. Why: where the choice's best misses a ``peak_memory`` limit the
    graph is planned once more to warn or raise, from what the trials found (an unmeetable limit on the
    tests' tiny GPT: 0.4 s), and that plan said its planning took 0.4 s where the choice took 60."""
    if not cost or "chunk_choice" in plan.solver:  # forced chunks, or the choice's own plan
        return
    plan.solver["plan_s"] = round(plan.solver.get("plan_s", 0.0) + cost["chunk_choice_s"], 3)
    plan.solver.update(cost)
