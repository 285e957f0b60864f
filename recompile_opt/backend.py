"""The ``recompile_opt`` torch.compile backend: Inductor's ``compile_fx`` with our partitioner.

Inductor's decompositions, joint-graph passes and code generation all still run; we only replace the
partitioner (``torch._inductor.config.custom_partitioner_fn``), which sees the joint graph after
Inductor's joint passes, plans it, and splits it. ``compiler="eager"`` runs the same decompositions,
joint passes and partitioner through AOTAutograd without code generation (fast tests, and the
capture-only path of :func:`recompile_opt.plan`).

Caching: the partitioner's ``uuid()`` hashes our source files and the options, so Inductor's caches
never replay another configuration's partition. On a cache hit our partitioner is not called, so plans
are also stored on disk under a key of the Dynamo graph, its inputs and that uuid, and replayed.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import hashlib
import inspect
import json
import logging
import os
import re
import time
import warnings
from pathlib import Path

import torch
import torch.fx as fx

from recompile_opt import _torch_internals as ti
from recompile_opt.costs.inductor_peak import output_names
from recompile_opt.costs.peak import caller_outputs_bytes, inductor_pool, peak_breakdown
from recompile_opt.costs.simulator import simulator_for
from recompile_opt.options import OptionError, Options, parse_options
from recompile_opt.parallel.agreement import check_same_plan
from recompile_opt.parallel.sequence_pass import add_sequence_parallel
from recompile_opt.passes.approximate import offer_approximations
from recompile_opt.passes.chunk_mlp import chunk_mlp, find_mlp_regions
from recompile_opt.passes.chunking import chunk_loss, find_loss_regions
from recompile_opt.passes.joint_graph import JointGraph, build_problem, sizes_before_gathers
from recompile_opt.passes.meta_attention import fuse_attention_for
from recompile_opt.passes.partition import partition
from recompile_opt.plan import Plan, fmt_bytes
from recompile_opt.planner import budget_split, chunk_choice
from recompile_opt.planner.least_peak import range_walked
from recompile_opt.planner.search import InfeasibleBudget, make_plan
from recompile_opt.planner.solving import one_tensor_per_storage
from recompile_opt.provenance import code_hash

log = logging.getLogger(__name__)

_PLANS: list[Plan] = []


def last_plans() -> list[Plan]:
    """Every plan recorded since the process started or :func:`reset_plans`, oldest first."""
    return list(_PLANS)


def reset_plans() -> None:
    _PLANS.clear()


def _code_hash(options: Options) -> str:
    """Our code and the options: through the partitioner's uuid() it enters the compile caches' key."""
    return hashlib.sha256((code_hash() + options.key()).encode()).hexdigest()[:16]


class RecompilePartitioner(ti.CustomPartitionerFn):
    """Plans the joint graph (cost model -> ILP or policy -> Plan) and partitions it to match."""

    def __init__(self, options: Options):
        self.options = options
        self.plans: list[Plan] = []
        self.last_forward: fx.GraphModule | None = None  # the graphs of the last partition
        self.last_backward: fx.GraphModule | None = None
        # plans already made for a joint graph (by graph id): the chunk choice plans its candidates, and
        # the one taken is not planned a second time when its graph is compiled
        self.known: dict[str, Plan] = {}
        self.walk = False  # walk the plan taken in Inductor's code (see walk_plan)
        self.graph_chunked = False  # the graph compiled now is chunked along the sequence (chunk_regions)
        # set while Inductor compiles the graphs this partitioner returns: a plan's exact peak is then
        # read off that compile's code (finish_peak), not off a lowering of its own
        self.compiling = False
        self.unwalked = None  # what finish_peak needs: the plan, its graphs, its simulator, the start
        # chunks="auto": the regions' candidates while the unchunked graph is planned; where one may lower
        # its plan's peak, the partitioner raises ChunkingWanted (compile_with_chunk_choice)
        self.chunk_candidates: list[chunk_choice.Candidate] = []
        self.held_warnings: list = []  # the warnings of such a plan, until it is known to be the user's
        self.strict_again = None  # under strict=True, how to plan it again to raise its error

    def __call__(self, gm: fx.GraphModule, joint_inputs, **kwargs):
        start = time.perf_counter()
        num_fwd_outputs = kwargs["num_fwd_outputs"]
        static = ti.inner_static_indices(gm, kwargs.get("static_lifetime_input_indices"))
        sizes_before_gathers(gm)
        jg = JointGraph(gm, num_fwd_outputs=num_fwd_outputs, static_lifetime_input_indices=static)
        problem = build_problem(
            jg,
            self.options.roofline_for(jg.device().type),
            replay_random=self.replay_random(),
            random_fuses=self.random_fuses(),
        )
        simulate = simulator_for(
            gm, num_fwd_outputs=num_fwd_outputs, static_lifetime_input_indices=static, info=jg.info
        )
        simulate.offer(problem.sites)
        simulate.chunked = self.graph_chunked

        used = simulate.usage()  # it shares the figures found by earlier compiles of this graph
        gid = graph_id(gm)
        options, split_note = budget_split.options_for_graph(self.options, gid)
        known = self.known.pop(gid, None)  # made (notes and walked peak too) by the chunk choice
        layout_note = self._choose_layout(gm, problem, simulate, num_fwd_outputs, static)
        plan = known or self._make_plan(problem, options, gid, simulate)
        if layout_note and not known:
            plan.notes.append(layout_note)
        if split_note and not known:
            plan.notes.insert(0, split_note)
        if not known and not self.replay_random() and any(v.random for v in problem.values.values()):
            plan.notes.append(
                "random ops are kept, not replayed: Inductor cannot yet compile CPU RNG-state "
                "replay with fallback_random=True (use compiler='eager' or Inductor's RNG)"
            )
        saved = {e.name for e in plan.saved if e.op != "rng_state"}
        settled, _ = simulate.graph_for(plan.recomputed_names())  # markers replaced (approximate backward)
        fw, bw = partition(
            settled,
            saved=saved,
            recomputed=plan.recomputed_names(),
            num_fwd_outputs=num_fwd_outputs,
            static_lifetime_input_indices=static,
        )
        self.last_forward, self.last_backward = fw, bw
        with inductor_pool(self.graph_chunked):
            plan.peak_breakdown = peak_breakdown(fw, bw, plan.recomputed_names())
        plan.outputs_bytes = caller_outputs_bytes(fw, num_fwd_outputs)
        exact = simulate.known_exact(saved, plan.recomputed_names())
        if exact is None and known and known.solver.get("peak_from") == "inductor-code":
            exact = known.predicted_peak_bytes  # the same joint graph (its id), the same saved set
        fraction = isinstance(options.memory_budget, float) and options.memory_budget < 1.0
        searched = fraction and options.peak_memory is None and range_walked(problem, options)
        walk = exact is None and (searched or ti.layout_optimized(fw) or self.walk_plan())
        # walked: every plan Inductor compiles (its own code, once it exists: finish_peak), a plan made
        # without a compile that answers a memory request (walk_plan), one whose search walked this
        # graph, and where Inductor copies convolutions' inputs channels-last (only its code shows it)
        wanted = not known and self._wants_chunks(plan, exact)
        if wanted and exact is None or walk and not self.compiling:
            exact = simulate.exact(saved, plan.recomputed_names())  # candidates are compared by walked peaks
        if wanted:
            self._set_peak(plan, exact, simulate, used, time.perf_counter() - start)
            raise ChunkingWanted(plan)
        self.plans.append(plan)
        check_same_plan(plan, gid)
        self.unwalked = (
            (plan, fw, bw, output_names(fw), saved, simulate, used) if walk and self.compiling else None
        )
        choice_s = known.solver.get("chunk_choice_s", 0.0) if known else 0.0
        self._set_peak(plan, exact, simulate, used, choice_s + time.perf_counter() - start)
        if self.unwalked is None:  # its figures are final now (else: finish_peak)
            self._check_limit(
                plan,
                None
                if exact is not None
                else simulate.why_unwalked(saved, plan.recomputed_names())
                if walk
                else f"compiler={self.options.compiler!r} runs no Inductor code"
                if self.options.compiler != "inductor"
                else "planned without a compile; compiling it walks its code",
            )
        return fw, bw

    def _choose_layout(
        self, gm: fx.GraphModule, problem, simulate, num_fwd_outputs: int, static
    ) -> str | None:
        """Where Inductor would lay this graph's convolutions out channels-last, its save-all plan walked
        in both layouts; where the convolutions' own layout peaks lower, every plan is walked in it and
        Inductor's layout switched off for the rest of this compile. Returns the plan's note, else None.

        Why: the channels-last copies Inductor makes of a convolution's input and weight are kept for
        the backward. A ViT's images and patch weights: every plan measured 203,824 B against eager's
        133,332, its save-all plan 146,660 in the plain layout. A ResNet's channels-last convolution
        backward needs less scratch than the plain one: there it stays. Why before the search: its
        plans are compared by their walks, and in the copies' layout they all tie (the ViT's 0.0 plan,
        taken among those ties, walked 132,080 B plain where ``full`` walked 125,744)."""
        if self.options.compiler != "inductor" or not ti.layout_optimized(gm):
            return None
        saved, recomputed = one_tensor_per_storage(problem, set(), set())
        channels_last = simulate.exact(saved, recomputed)
        plain = simulate.exact_in_plain_layout(saved, recomputed)
        if channels_last is None or plain is None or plain >= channels_last:
            return None
        simulate.walk_in_plain_layout()
        if self.compiling:
            ti.switch_layout_optimization_off()
        return (
            "convolutions in their own layout: Inductor's channels-last copies, kept for the backward, "
            f"would raise the save-all plan's peak to {fmt_bytes(channels_last)} (walked) from "
            f"{fmt_bytes(plain)}; every plan is walked in this layout"
        )

    def _make_plan(self, problem, options: Options, gid: str, simulate) -> Plan:
        """The search's plan. Where chunks may still be tried under a ``peak_memory`` limit, a miss is
        not yet the user's: planned without ``strict``, its limit warning held back (it is planned
        again, strictly, if chunking cannot meet the limit either: :func:`_choose_chunks`)."""
        if not (self.chunk_candidates and options.peak_memory is not None):
            return ti.on_fresh_stack(make_plan, problem, options, graph=gid, simulate=simulate)
        with warnings.catch_warnings(record=True) as held:
            warnings.simplefilter("always")
            plan = ti.on_fresh_stack(
                make_plan, problem, dataclasses.replace(options, strict=False), graph=gid, simulate=simulate
            )
        plan.options = {**plan.options, "strict": options.strict}
        self.held_warnings = held
        if held and options.strict:  # if this plan is the user's after all, its strict error is raised
            self.strict_again = lambda: ti.on_fresh_stack(
                make_plan, problem, options, graph=gid, simulate=simulate
            )
        return plan

    def _wants_chunks(self, plan: Plan, exact: int | None) -> bool:
        """``chunks="auto"``: whether chunking may lower this unchunked plan's peak where the goal needs
        it (:func:`chunk_choice.worth_trying`), judged by its walked peak where one is known (``exact``:
        the figure a limit is finally checked against), else the kernel model's; where not, the plan's
        notes say why nothing was tried."""
        if not self.chunk_candidates:
            return False
        peak = plan.peak_breakdown["total"] if exact is None else exact
        why_not = chunk_choice.worth_trying(self.chunk_candidates, plan, peak, self.options.peak_memory)
        held, strict_again = self.held_warnings, self.strict_again
        self.held_warnings, self.strict_again = [], None
        if why_not:
            plan.notes.append(why_not)
            if strict_again is not None:  # the plan is the user's after all: its error (strict=True)
                strict_again()
            for w in held:  # or its warnings
                warnings.warn(w.message, w.category)
        return why_not is None

    def finish_peak(self, compiled: list) -> None:
        """The exact peak of a plan whose walk waited for Inductor's compile: read off the code that
        compile generated (``compiled``: ``_torch_internals.compiled_wrapper_code``'s records), or off a
        lowering of its own where none was recorded (a graph from Inductor's cache)."""
        if self.unwalked is None:
            return
        (plan, fw, bw, outputs, saved, simulate, used), self.unwalked = self.unwalked, None
        start = time.perf_counter()
        codes = {backward: code for backward, code in reversed(compiled)}  # the first of each
        walked = (fw, bw, (codes[False], codes[True], outputs)) if len(codes) == 2 else None
        exact = simulate.exact(saved, plan.recomputed_names(), compiled=walked)
        self._set_peak(plan, exact, simulate, used, plan.solver["plan_s"] + time.perf_counter() - start)
        self._check_limit(
            plan, None if exact is not None else simulate.why_unwalked(saved, plan.recomputed_names())
        )

    def _check_limit(self, plan: Plan, unwalked: str | None) -> None:
        """The plan taken against its figures' promise: a ``peak_memory`` limit over the code's walked
        peak, or held to the kernel model's estimate where the code could not be walked (``unwalked``:
        why), is said so in a warning and a note. Why: a user's hard limit is the one check README
        promises in Inductor's code; a miss must never be silent."""
        if unwalked:
            plan.solver["unwalked"] = unwalked
        limit = self.options.peak_memory
        # under compiler="eager" the figures are the kernel model's, and say so
        if limit is None or plan.predicted_peak_bytes is None or self.options.compiler != "inductor":
            return
        msg = None
        if unwalked:
            msg = (
                f"recompile_opt: peak_memory={fmt_bytes(limit)} was held to the kernel model's estimate "
                f"({fmt_bytes(plan.predicted_peak_bytes)}), not checked in Inductor's code: {unwalked}"
            )
        elif plan.predicted_peak_bytes > limit:
            msg = (
                f"recompile_opt: peak_memory={fmt_bytes(limit)} is not met: the code Inductor generated "
                f"peaks at {fmt_bytes(plan.predicted_peak_bytes)} (walked)"
            )
        if msg and not any(msg[len("recompile_opt: ") :] in n for n in plan.notes):
            warnings.warn(msg)
            plan.notes.append(msg)

    @staticmethod
    def _set_peak(plan: Plan, exact, simulate, used, seconds: float) -> None:
        plan.predicted_peak_bytes = plan.peak_breakdown["total"] if exact is None else exact
        plan.solver["peak_from"] = "simulator" if exact is None else "inductor-code"
        # the whole of our share of a compile (cost model, search, partition, walks), for users and the bench
        plan.solver["plan_s"] = round(seconds, 3)
        simulate.store()
        simulations, simulate_s, exact_peaks, exact_s = (a - b for a, b in zip(simulate.usage(), used))
        plan.solver.update(
            simulations=simulations,
            simulate_s=round(simulate_s, 3),
            exact_peaks=exact_peaks,
            exact_s=round(exact_s, 3),
        )

    def __deepcopy__(self, memo):
        """Itself, and pickled as its :meth:`uuid`. Why: Inductor deep-copies and pickles its config for
        the compile cache's key (``save_config_portable``), this object included, while it holds the
        graphs and simulator of a plan whose peak waits for the compile (fake tensors, which cannot be
        copied; cycles, which the key's pickler refuses). What it computes depends on the uuid alone."""
        return self

    def __reduce__(self):
        return str, (self.uuid(),)

    def walks_plan_taken(self) -> bool:
        """Whether Inductor's compile of the plan taken is walked for its figures (``__call__`` defers
        that walk to the compile's own code: no lowering of its own, so every plan Inductor compiles is
        walked; the peak a user reads, and a limit is held to, is the code's: the kernel model alone
        was 14-58% off on models the tests had not seen)."""
        return self.options.compiler == "inductor"

    def walk_plan(self) -> bool:
        """Whether the plan taken is walked in Inductor's generated code for its predicted peak even
        where the search did not walk: in Inductor's compile (:meth:`walks_plan_taken`); where a plan
        is made without one (``recompile_opt.plan``), a plan that answers a memory request (a byte
        budget, a fraction below 1.0, ``peak_memory``: one lowering, seconds) and every candidate of
        the chunk choice (compared by that peak). A fixed policy's or save-all's plan made without a
        compile, and any under ``compiler="eager"`` (no such code runs), give the kernel model's
        figures, and say so."""
        if self.walk or self.compiling:
            return True
        budget, options = self.options.memory_budget, self.options
        request = (
            options.peak_memory is not None
            or isinstance(budget, int)
            or (isinstance(budget, float) and budget < 1.0)
        ) and options.policy == "auto"
        return options.compiler == "inductor" and request

    def replay_random(self) -> bool:
        """Replaying a random op from a saved CPU RNG state (``run_with_rng_state``) works in the eager
        path and through Inductor's own RNG (its seeds make recompute deterministic). With
        ``fallback_random`` Inductor keeps ``native_dropout``, and its lowering of the replay HOP around
        a tuple-returning op fails (torch 2.13), so there random ops are kept."""
        return self.options.compiler == "eager" or not ti.inductor_config.fallback_random

    def random_fuses(self) -> bool:
        """Inductor with its own RNG draws a recomputed ``rand`` inside the kernel that reads it, only
        where it reads (the cost model's demanded share); the eager path replays the whole draw."""
        return self.options.compiler == "inductor" and not ti.inductor_config.fallback_random

    def uuid(self) -> str:
        split = budget_split.state_key(self.options)
        return _code_hash(self.options) + (hashlib.sha256(split.encode()).hexdigest()[:8] if split else "")


def graph_id(gm: fx.GraphModule) -> str:
    """A hash of the graph's code with device names removed, so a graph captured on the meta device
    has the id it has on the device it trains on (the budget split is keyed by it)."""
    code = re.sub(r"device\(type='[a-z]+'(, index=\d+)?\)", "device", gm.code)
    return hashlib.sha256(code.encode()).hexdigest()[:12]


class OptionErrorInCompile(OptionError, ti.BackendCompilerFailed):
    """An :class:`OptionError` raised inside ``torch.compile``, that is also Dynamo's own
    ``BackendCompilerFailed``: Dynamo wraps any other exception of a backend in a new
    ``BackendCompilerFailed`` (``except OptionError`` then missed it; the error was only its
    ``inner_exception``), but re-raises its own as they are. So ``except recompile_opt.OptionError``
    catches it, and so does code that catches Dynamo's wrapper; ``str()`` opens with our message."""

    def __init__(self, error: OptionError, frame=None):
        # frame: where Dynamo starts the traceback it shows (ours, not its own internals)
        ti.BackendCompilerFailed.__init__(self, recompile_opt_backend, error, frame)
        self.args = (str(error),)  # Dynamo appends its hints after this first line


class InfeasibleBudgetInCompile(InfeasibleBudget, OptionErrorInCompile):
    """:class:`InfeasibleBudget` (``strict=True``) raised inside ``torch.compile``; see
    :class:`OptionErrorInCompile`."""


def _in_compile(error: OptionError, frame) -> OptionErrorInCompile:
    cls = InfeasibleBudgetInCompile if isinstance(error, InfeasibleBudget) else OptionErrorInCompile
    return cls(error, frame).with_traceback(error.__traceback__)


def recompile_opt_backend(gm: fx.GraphModule, example_inputs, options=None, **kwargs):
    """The entry point torch.compile calls: ``torch.compile(m, backend="recompile_opt", options={...})``.

    Options are read here, at the first call (``torch.compile`` is lazy); a bad one, or an unmeetable
    limit under ``strict=True``, raises an error that ``except recompile_opt.OptionError`` (or
    ``InfeasibleBudget``) catches through Dynamo (:class:`OptionErrorInCompile`)."""
    try:
        return _compile(gm, example_inputs, options)
    except OptionErrorInCompile:
        raise
    except OptionError as e:
        raise _in_compile(e, inspect.currentframe()) from None


def _compile(gm: fx.GraphModule, example_inputs, options):
    opts = parse_options(options)
    partitioner = RecompilePartitioner(opts)
    sequence = sequence_parallel_of(gm, opts)
    key = _plan_key(gm, example_inputs, partitioner)
    if opts.compiler == "eager":
        compiled = compile_eager(gm, example_inputs, partitioner)
    else:
        compiled = compile_with_chunk_choice(
            _compile_inductor, gm, example_inputs, partitioner, aten_random=False
        )
    note(partitioner, sequence)
    _record(partitioner, key, opts)
    return compiled


def _compile_inductor(
    gm: fx.GraphModule, example_inputs, partitioner: RecompilePartitioner, chosen: dict | None
):
    """Inductor's ``compile_fx`` with our partitioner, the graph chunked as ``chosen`` (or forced)."""
    chunked = chunk_regions(gm, partitioner, chosen)
    offered = offer_approximations_of(gm, partitioner.options)
    # where the plan taken is walked for its figures, the walk reads the code this compile
    # generates; only there is the backward lowered with the forward (a model run with grad enabled
    # but never backward, an evaluation, would otherwise build a backward it never runs)
    defer = partitioner.walks_plan_taken()
    with (
        ti.compiled_wrapper_code() as lowered,
        ti.layout_setting_restored(),
        ti.lower_backward_eagerly() if defer else contextlib.nullcontext(),
    ):
        partitioner.compiling = defer
        try:
            compiled = ti.compile_fx(
                gm, example_inputs, config_patches={"custom_partitioner_fn": partitioner}
            )
        finally:
            partitioner.compiling = False
    partitioner.finish_peak(lowered)
    note(partitioner, chunked)
    note(partitioner, offered)
    return compiled


def compile_eager(gm, example_inputs, partitioner: RecompilePartitioner, *, aten_random: bool = True):
    """AOTAutograd with Inductor's decompositions and joint passes, our partitioner, no codegen.

    Inductor's RNG prims only mean something to Inductor's code generator (their eager versions ignore
    the seed), so a graph run this way keeps random ops as aten ops (``fallback_random``) and replays
    them. ``aten_random=False`` keeps Inductor's setting: for capture only, the plan compile would make.
    On the meta device SDPA calls become the target device's fused kernel first
    (:mod:`recompile_opt.passes.meta_attention`).
    """
    once = functools.partial(_compile_eager_once, aten_random=aten_random)
    return compile_with_chunk_choice(once, gm, example_inputs, partitioner, aten_random=aten_random)


def _compile_eager_once(gm, example_inputs, partitioner, chosen: dict | None, *, aten_random: bool):
    """:func:`compile_eager` with the graph chunked as ``chosen`` (or forced)."""

    def nop(g, _inputs):
        return ti.make_boxed_func(g.forward)

    part = ti.inductor_partition_fn_with(partitioner)
    fake_mode = ti.detect_fake_mode(example_inputs) or ti.FakeTensorMode(allow_non_fake_inputs=True)
    patches = {"fallback_random": True if aten_random else ti.inductor_config.fallback_random}
    # every caller's partitioner has options but torch's own (frontier's comparison)
    target = getattr(getattr(partitioner, "options", None), "target_device", Options.target_device)
    chunked = chunk_regions(gm, partitioner, chosen)
    offered = offer_approximations_of(gm, getattr(partitioner, "options", Options()))
    fused = 0
    if any(isinstance(t, torch.Tensor) and t.device.type == "meta" for t in example_inputs):
        # Inductor's joint-graph constant folding treats every meta tensor as foldable and would
        # fold the whole graph away; on real devices it only folds true constants.
        patches["joint_graph_constant_folding"] = False
        fused = fuse_attention_for(gm, target)  # meta has no SDPA kernel of its own
    with ti.V.set_fake_mode(fake_mode), ti.inductor_config.patch(patches):
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
                f"target_device={target!r} runs (its output and logsumexp, no s x s tensor)"
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


class ChunkingWanted(Exception):
    """Raised by the partitioner under ``chunks="auto"`` where the unchunked graph's plan may peak lower
    chunked (:func:`compile_with_chunk_choice` catches it); carries that plan."""

    def __init__(self, plan: Plan):
        super().__init__(f"chunks (auto): graph {plan.graph} may peak lower chunked")
        self.plan = plan


def compile_with_chunk_choice(
    compile_once, gm: fx.GraphModule, example_inputs, partitioner, *, aten_random: bool
):
    """``compile_once(gm, example_inputs, partitioner, chosen)``, with ``chunks="auto"`` chosen lazily.

    Where the plan's goal is memory and the graph has regions that can be chunked, the partitioner plans
    the graph unchunked as usual, and only where a region's full-length tensors are alive at that plan's
    peak (under ``peak_memory``: where it misses the limit) does it raise :class:`ChunkingWanted`; then
    the graph's chunked versions are planned against that plan (:func:`chunk_choice.choose`) and the
    graph is compiled again as chosen, its plan handed to the partitioner. Why lazily: a graph whose
    peak holds none of the regions' tensors pays nothing for ``"auto"`` (it planned each graph at
    least twice: measured 17.0 s against 7.6 on the benchmark GPT at 0.0, nothing taken)."""
    candidates = _auto_candidates(gm, example_inputs, getattr(partitioner, "options", None))
    if not candidates:
        return compile_once(gm, example_inputs, partitioner, None)
    pristine = ti.copy_dynamo_graph(gm)  # the passes below and Inductor's change the graph they compile
    partitioner.chunk_candidates = candidates
    try:
        return compile_once(gm, example_inputs, partitioner, None)
    except ChunkingWanted as wanted:
        unchunked = wanted.plan
    finally:
        partitioner.chunk_candidates = []
    chosen = _choose_chunks(pristine, example_inputs, partitioner, candidates, unchunked, aten_random)
    return compile_once(pristine, example_inputs, partitioner, chosen)


def _auto_candidates(gm: fx.GraphModule, example_inputs, options: Options | None) -> list:
    """``chunks="auto"``: the chunk candidates of the graph's regions where the plan's goal is memory
    (``memory_budget=0.0``, the least-peak plan, or a ``peak_memory`` limit), else none."""
    if options is None or options.chunks != "auto" or options.policy != "auto" or _symbolic(example_inputs):
        return []
    least_peak = isinstance(options.memory_budget, float) and options.memory_budget == 0.0
    if not (least_peak or options.peak_memory is not None):
        return []
    device = next((t.device.type for t in example_inputs if isinstance(t, torch.Tensor)), "cpu")
    roofline = options.roofline_for(options.target_device if device == "meta" else device)
    every = chunk_choice.candidates(find_loss_regions(gm), find_mlp_regions(gm), roofline)
    return chunk_choice.for_goal(every, options.peak_memory)


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


# each region kind of option 'chunks': how its regions are found, how one is rewritten, and the
# keywords that rewrite (and the region's description and plan entry) take
CHUNKERS = {
    "loss": (find_loss_regions, chunk_loss, {}),
    "loss_recompute": (find_loss_regions, chunk_loss, {"recompute": True}),
    "mlp": (find_mlp_regions, chunk_mlp, {}),
}


def chunk_regions(gm: fx.GraphModule, partitioner, chosen: dict | None) -> Chunked:
    """Mini-sequence chunking of the Dynamo graph before AOTAutograd (:mod:`recompile_opt.passes.chunking`,
    :mod:`recompile_opt.passes.chunk_mlp`): forced by ``chunks={"loss": k, "mlp": k}``, or ``chosen``
    by :func:`_choose_chunks` (``{"chunks": {...}, "notes": [...], "saved": bytes}``).
    A forced region that cannot be chunked raises, naming it and why."""
    options = getattr(partitioner, "options", Options())  # torch's own partitioner (frontier) has none
    chunks, notes, saved = options.chunks, [], None
    if chosen is not None:
        chunks, notes, saved = chosen["chunks"], chosen["notes"], chosen["saved"]
    done = Chunked(notes=notes)
    if isinstance(partitioner, RecompilePartitioner):
        partitioner.graph_chunked = isinstance(chunks, dict) and any(k != 1 for k in chunks.values())
    for kind, k in (chunks if isinstance(chunks, dict) else {}).items():
        if k == 1:
            continue
        find, rewrite, how = CHUNKERS[kind]
        regions = find(gm)
        for region in regions:
            if region.why_not is not None:
                raise OptionError(f"option 'chunks': {region.name} cannot be chunked: {region.why_not}")
        for region in regions:
            done.notes.append("chunk: " + region.describe(k, **how))
            done.records.append({**region.record(k, **how), "peak_saved_bytes": saved})
            rewrite(gm, region, k, **how)
    return done


@dataclasses.dataclass
class Chunked:
    """What :func:`chunk_regions` did: note lines and one plan entry per chunked region."""

    notes: list = dataclasses.field(default_factory=list)
    records: list = dataclasses.field(default_factory=list)


def _choose_chunks(
    gm: fx.GraphModule,
    example_inputs,
    partitioner: RecompilePartitioner,
    candidates: list,
    unchunked: Plan,
    aten_random: bool,
) -> dict:
    """Plan ``gm`` chunked as the candidates say, against its ``unchunked`` plan
    (:func:`chunk_choice.choose`). The plan taken is handed to ``partitioner``, which then does not plan
    its graph again."""
    options = partitioner.options
    planned = [unchunked]

    def plan_with(chunks: dict) -> Plan:
        # a candidate that misses a limit is not the user's plan: no warning, no strict error from it
        trial = RecompilePartitioner(dataclasses.replace(options, chunks=chunks or False, strict=False))
        trial.walk = True
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            compile_eager(ti.copy_dynamo_graph(gm), example_inputs, trial, aten_random=aten_random)
        plan = trial.plans[-1]
        plan.options = {**plan.options, "strict": options.strict, "chunks": options.chunks}
        planned.append(plan)
        return plan

    start = time.perf_counter()
    taken, unchunked, best, notes = chunk_choice.choose(candidates, plan_with, options.peak_memory, unchunked)
    # the planning this choice took, the unchunked plan's included: the plan's planning time counts it
    best.solver["chunk_choice_s"] = round(unchunked.solver["plan_s"] + time.perf_counter() - start, 3)
    planned = list({id(p): p for p in planned if p is not None}.values())
    best.solver["chunk_choice"] = {
        "plannings": len(planned),
        "simulations": sum(p.solver.get("simulations", 0) for p in planned),
        "walks": sum(p.solver.get("exact_peaks", 0) for p in planned),
    }
    if options.peak_memory is None or best.predicted_peak_bytes <= options.peak_memory:
        partitioner.known[best.graph] = best  # else planned again, to warn (or raise: strict) as usual
    saved = unchunked.predicted_peak_bytes - best.predicted_peak_bytes if taken else None
    return {"chunks": taken, "notes": notes, "saved": saved}


def note(partitioner, lines: list[str] | Chunked) -> None:
    """Add ``lines`` (and the chunked regions) to the plan just made for this graph (none on a cache hit)."""
    if not getattr(partitioner, "plans", None):
        return
    plan = partitioner.plans[-1]
    if isinstance(lines, Chunked):  # a plan the chunk choice made has its chunks already
        plan.chunks = [*lines.records]
        lines = lines.notes
    plan.notes.extend(line for line in lines if line not in plan.notes)


def _plan_key(gm: fx.GraphModule, example_inputs, partitioner: RecompilePartitioner) -> str:
    """The Dynamo graph, its inputs, our code and options, and the Inductor settings that change the
    joint graph we plan. Why the settings: Inductor's own caches key on its config, so a compile under
    ``fallback_random=True`` hits the artifact made under True, but without them here it replayed the
    plan last stored for False (Inductor's RNG prims recomputed, where the compiled graph kept
    eager's dropout). And the state AOTAutograd's cache keys on (autocast above all): a model compiled
    under ``torch.autocast`` outside the compiled region has the same Dynamo graph, and a later fp32
    compile that hit Inductor's cache replayed the bf16 plan (CI: a plan of 48644 bytes where the
    compiled step kept 47620). And Inductor's layout settings, which its figures depend on (a ViT's
    plan stored with the layout optimisation off was replayed with it on: 132,076 B for 203,824)."""
    meta = [
        (tuple(t.shape), str(t.dtype), str(t.device)) if isinstance(t, torch.Tensor) else repr(t)
        for t in example_inputs
    ]
    blob = (
        gm.code
        + repr(meta)
        + partitioner.uuid()
        + f"replay_random={partitioner.replay_random()}"
        + ti.graph_changing_state()
        + ti.layout_settings()
    )
    return hashlib.sha256(blob.encode()).hexdigest()[:20]


def _plan_cache_dir() -> Path:
    return Path(ti.cache_dir()) / "recompile_opt_plans"


def _record(partitioner: RecompilePartitioner, key: str, opts: Options) -> None:
    """Publish this compilation's plans; on a cache hit (partitioner not called) replay the stored ones."""
    path = _plan_cache_dir() / f"{key}.json"
    plans = partitioner.plans
    if plans:
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps([p.to_dict() for p in plans]))
        except OSError as e:
            log.debug("recompile_opt: could not store plan %s: %s", path, e)
    elif path.exists():
        plans = [Plan.from_json(json.dumps(d)) for d in json.loads(path.read_text())]
        for p in plans:
            p.notes.append("replayed from the plan cache (Inductor cache hit)")
    _PLANS.extend(plans)
    if opts.plan_dir:
        os.makedirs(opts.plan_dir, exist_ok=True)
        for p in plans:
            Path(opts.plan_dir, f"plan_{p.graph}.json").write_text(p.to_json())
