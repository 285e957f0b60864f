"""From a :class:`Problem` and the options to a :class:`Plan`: resolve the budget, run the ILP or a fixed
policy, handle infeasible limits and solver failures, and describe every decision.

Budget semantics: an int is bytes; a float f in [0, 1] is ``min + f * (save_all - min)`` where min is
the least any plan can keep (found by a first, memory-minimising solve) and save_all what eager keeps.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import warnings

from recompile_opt.options import Options
from recompile_opt.plan import KEEP, OFFLOAD, RECOMPUTE, Plan, PlanEntry, fmt_bytes
from recompile_opt.planner import ilp, offload
from recompile_opt.planner.blocks import reduce_blocks
from recompile_opt.planner.least_peak import _fit_peak, _range_search
from recompile_opt.planner.memory import PlanningMemory
from recompile_opt.planner.policies import POLICIES, attention_cores, blocks_and_origin, find_blocks
from recompile_opt.planner.problem import Problem, offloaded_values, twice_values
from recompile_opt.planner.solving import (
    InfeasibleBudget,
    Simulate,
    below_least,
    greedy_recompute,
    least_bytes,
    one_tensor_per_storage,
    solve_reduced,
    solver_info,
)

__all__ = ["InfeasibleBudget", "make_plan"]

log = logging.getLogger(__name__)

# A graph with collectives runs on several ranks, each planning it alone: a wall-clock limit could stop
# one rank's solver and not another's, and their plans (so their collectives) would differ. There a node
# limit, which gives the same plan on every machine, binds instead (the search's, see least_peak), and
# the time limit only guards against a solver that hangs.
RANK_SAFE_MAX_NODES, RANK_SAFE_TIME_LIMIT_S = 2000, 3600.0


def make_plan(
    problem: Problem,
    options: Options,
    *,
    graph: str = "",
    simulate: Simulate | None = None,
    memory: PlanningMemory | None = None,
) -> Plan:
    """``simulate`` predicts a plan's peak (the partitioner passes one that partitions and simulates
    the graphs); with it, a fractional budget's 0.0 end is the plan of least predicted peak.
    ``memory``: what earlier plannings in this process found (the least-peak searches); none: plan
    from nothing."""
    memory = PlanningMemory() if memory is None else memory
    save_all = problem.needed_closure(POLICIES["save-all"](problem))  # (saved, recomputed)
    baseline = problem.kept_bytes(*save_all)  # memory_budget 1.0
    problem, notes = offload.offer(problem, options)
    keep: set[str] = set()
    if options.policy == "auto":
        solves = ilp.SolveLog()
        sol, solver_info, budget, min_bytes = _solve_auto(
            problem, options, baseline, notes, simulate, solves, memory.range_ends
        )
        solver_info.update(
            solves=solves.solves, solves_s=round(solves.seconds, 3), solves_recalled=solves.recalled
        )
        recompute, keep = sol.recompute, sol.keep
    else:  # the user's MUST_* tags hold under a fixed policy too
        tagged = {
            t: {n for n, v in problem.values.items() if v.tag == t} for t in ("must_save", "must_recompute")
        }
        own = POLICIES[options.policy](problem)
        recompute = (own | tagged["must_recompute"]) - tagged["must_save"] | offload.tagged_offloads(problem)
        solver_info = {"name": "policy", "status": options.policy, "solve_s": 0.0, "gap": None}
        budget, min_bytes = None, None
        _note_policy(problem, options.policy, own, save_all, notes, graph)
    saved, recomputed = one_tensor_per_storage(problem, recompute, keep)
    _note_prefer_tags(problem, saved, recomputed, notes)
    plan = _describe(
        problem,
        options,
        graph,
        saved,
        recomputed,
        baseline=baseline,
        budget=budget,
        min_bytes=min_bytes,
        solver_info=solver_info,
        notes=notes,
    )
    plan.approximated = _approximated(problem, recomputed)
    plan.recomputed_twice = sorted(twice_values(recomputed))
    plan.offloaded = offload.offloaded_entries(problem, saved, recomputed)
    plan.offload = problem.offload_figures(saved, recomputed) if plan.offloaded else {}
    log.info(
        "recompile_opt: graph %s keeps %s of %s (%s), recomputes %d values",
        graph,
        fmt_bytes(plan.saved_bytes),
        fmt_bytes(baseline),
        options.policy,
        len(recomputed),
    )
    return plan


def _solve_auto(
    problem: Problem,
    options: Options,
    baseline: int,
    notes: list[str],
    simulate: Simulate | None = None,
    solves: ilp.SolveLog | None = None,
    known_ranges: dict | None = None,
):
    kw = dict(solver=options.solver, time_limit_s=options.time_limit_s, mip_gap=options.mip_gap, log=solves)
    if problem.collectives:  # every rank must reach the same plan (a different one hangs the collectives)
        kw.update(
            max_nodes=RANK_SAFE_MAX_NODES, time_limit_s=max(options.time_limit_s, RANK_SAFE_TIME_LIMIT_S)
        )
    fit_peak = options.peak_memory is not None
    if fit_peak and simulate is None:  # the ILP has no peak rows: a peak is only known by simulation
        raise ValueError(
            "recompile_opt: peak_memory needs plans simulated on the graphs (recompile_opt.plan "
            "or torch.compile); make_plan was given no simulator"
        )
    reduction = reduce_blocks(problem)  # identical blocks are solved as a few groups
    min_bytes = None
    budget = options.memory_budget
    if isinstance(budget, float):
        # the range's ends know no peak limit: a limit is applied below, by _fit_peak
        if simulate is not None and budget < 1.0:
            ranger = range_oracle(simulate)
            with getattr(ranger, "walk_context", contextlib.nullcontext)():
                ends = _range_search(
                    problem, reduction, kw, baseline, ranger, options, known_ranges=known_ranges
                )
            if problem.sites and budget == 0.0 and not fit_peak:
                ends = _least_peak_approximating(
                    problem, reduction, kw, baseline, simulate, options, ends, known_ranges=known_ranges
                )
            min_bytes, floor, least_peak = ends.min_bytes, ends.floor, ends.least_peak
        else:
            min_bytes = least_bytes(problem, reduction, kw)
            floor, least_peak = min_bytes, None
        if budget == 0.0 and least_peak is not None and not fit_peak:
            notes.extend([ends.note] if ends.note else [])  # the search's note: this plan is its answer
            return least_peak, solver_info(options, least_peak), floor, min_bytes
        fraction, budget = budget, int(floor + budget * (baseline - floor))
        if least_peak is not None:  # a plan of the range, not the least-peak plan that is its 0.0 end
            notes.append(
                f"memory_budget {fraction}: keeps at most {fmt_bytes(budget)}, {fraction:.0%} of the "
                f"way from the least-peak plan's {fmt_bytes(floor)} (memory_budget 0.0) to save-all's "
                f"{fmt_bytes(baseline)} (1.0)"
            )
    if fit_peak:
        return _fit_peak(
            problem, reduction, options, budget, baseline, min_bytes, kw, notes, simulate, known_ranges
        )
    sol = solve_reduced(problem, reduction, budget, kw, notes)
    if budget is None and sol.status in ("optimal", "feasible"):
        sol = _leanest_as_fast(problem, reduction, sol, options, kw)
    if sol.status == "infeasible":
        sol, min_bytes = _infeasible(problem, options, budget, kw, notes, reduction)
    elif sol.status.startswith("error"):
        msg = f"recompile_opt: the ILP solver failed ({sol.status}); using a greedy plan instead"
        warnings.warn(msg)
        notes.append(msg)
        greedy = ilp.Solution(greedy_recompute(problem, budget), status=sol.status)
        return greedy, solver_info(options, sol), budget, min_bytes
    if sol.status == "feasible":
        notes.append(
            f"time limit {options.time_limit_s:g} s reached: best plan found, gap "
            + (f"{sol.gap:.2%}" if sol.gap is not None else "not reported by the solver")
        )
    return sol, solver_info(options, sol), budget, min_bytes


def range_oracle(simulate: Simulate) -> Simulate:
    """The oracle a fraction's range (its 0.0 end: the least-peak search) is searched with: the one the
    least-peak plan itself is planned with (``simulate.range_twin``, set by the planning where Inductor's
    buffer pool differs between the two: ``planning.pools_dead_buffers``; searched inside its
    ``walk_context``, the Inductor settings its walks lower under), else ``simulate``. Why: a fraction
    is a share of the way from the plan ``memory_budget=0.0`` gives to save-all."""
    return getattr(simulate, "range_twin", None) or simulate


def _leanest_as_fast(
    problem: Problem, reduction, fastest: ilp.Solution, options: Options, kw: dict
) -> ilp.Solution:
    """No budget: of the plans within ``mip_gap`` of the fastest one's estimated step (the tolerance the
    solver already allows that plan), the one keeping the fewest bytes, then the fastest at those
    bytes. Why: the fastest plan keeps whatever costs any time to recompute, however little; a
    fused elementwise op (SiLU's output, a product) costs a pass or two over its output, so it was kept
    where PyTorch's min-cut partitioner, with no budget either, recomputes it inside the backward's
    kernels (the Llama's SiLU outputs: 1.38 MiB a layer per rank, docs/parallel.md). A compute-bound
    value (``Value.compute_bound``: a matmul, attention) that the fastest plan does not recompute is not
    recomputed here either: the GPU check's GPT on meta recomputed two MLP up-projections and an
    attention projection so, 0.52 ms of a 40.6 ms estimated step (1.3%), inside the solver's 1% only by
    the saving time it credits, where issue 45 allows the whole no-budget step 2% over
    torch.compile's."""
    saved, recomputed = problem.needed_closure(fastest.recompute, fastest.keep)
    step = problem.step_s + problem.recompute_seconds(recomputed)
    cap = ilp.plan_seconds(problem, saved, recomputed) + options.mip_gap * step
    # no matmul or attention recomputed for bytes no budget asked for (PyTorch's partitioner, with none,
    # recomputes none either): they are the step's time, where a fused elementwise op's is a pass or two;
    # a user's tag still decides its value
    barred = {
        n for n, v in problem.values.items() if v.compute_bound and v.in_forward and v.tag is None
    } - recomputed
    lean_problem = problem.with_recompute_barred(barred) if barred else problem
    if problem.sites or problem.offloadable():  # approximations and offloads only where a budget asks
        # for bytes (ilp.APPROXIMATION_PRICE, OFFLOAD_PRICE); a user's offload tags still hold
        lean_problem = dataclasses.replace(lean_problem.with_sites_fixed(False), offload_only_tagged=True)
    if lean_problem is not problem:
        problem, reduction = lean_problem, reduce_blocks(lean_problem)
    lean = solve_reduced(problem, reduction, None, kw, [], minimize_memory=True, time_cap_s=cap)
    if lean.status not in ("optimal", "feasible"):
        return fastest
    kept = problem.kept_bytes(*problem.needed_closure(lean.recompute, lean.keep))
    if kept >= problem.kept_bytes(saved, recomputed):
        return fastest
    best = solve_reduced(problem, reduction, kept, kw, [])
    return best if best.status in ("optimal", "feasible") else fastest


def _least_peak_approximating(
    problem: Problem,
    reduction,
    kw: dict,
    baseline: int,
    simulate: Simulate,
    options: Options,
    ends,
    *,
    known_ranges: dict,
):
    """The least-peak search again with every site approximated and with none, and the ends of the
    lowest peak of the three. Why: the ILP prices an approximation by the recompute it saves, and the
    search's ladders are budgets of kept bytes, which codes and projections barely change; but their
    gain is the backward's working set (no recomputed activation, no recomputed MLP input), which only
    the walked peak sees. On the benchmark GPT the priced search peaked at 24.8 MiB, every site
    approximated at 21.8 (exact: 25.6); on the Llama the priced search at 26.1, above exact's 25.1."""
    searches = [ends]
    for fixed in (True, False):
        # fixed by a row, not paid for in the objective: a price large enough to force them swamped
        # the recompute times within the solver's relative gap, and the ladder's plans recomputed at random
        variant = problem.with_sites_fixed(fixed)
        # not verified: its least simulated peak is walked below, against the others'
        fixed_reduction = reduction and reduction.with_sites_fixed(fixed)
        found = _range_search(
            variant, fixed_reduction, kw, baseline, simulate, options, verify=False, known_ranges=known_ranges
        )
        if found.least_peak is not None:
            searches.append(found)
    searches = [e for e in searches if e.least_peak is not None] or [ends]

    def peak(e) -> int:  # walked in Inductor's code where it can be, as the plan taken is (the kernel
        # model over-predicted the approximated plan: 25.2 against 21.8 MiB walked)
        saved, recomputed = one_tensor_per_storage(problem, e.least_peak.recompute, e.least_peak.keep)
        return (simulate.can_walk and simulate.exact(saved, recomputed)) or simulate(saved, recomputed)

    return min(searches, key=peak)


def _infeasible(problem: Problem, options: Options, budget, kw: dict, notes: list[str], reduction):
    min_bytes = least_bytes(problem, reduction, kw)
    what = []
    if budget is not None and (min_bytes is None or budget < min_bytes):
        what.append(below_least(budget, min_bytes))
    if options.peak_memory is not None:
        what.append(f"peak_memory={fmt_bytes(options.peak_memory)} cannot be met")
    msg = "recompile_opt: " + "; ".join(what or ["the limits cannot be met"])
    if options.strict:
        raise InfeasibleBudget(msg + " (strict=True)")
    msg += "; using the least-memory plan"
    warnings.warn(msg)
    notes.append(msg)
    sol = solve_reduced(problem, reduction, min_bytes, kw, notes)
    if sol.status not in ("optimal", "feasible"):
        sol = ilp.Solution(greedy_recompute(problem, 0), status=sol.status, solve_s=sol.solve_s)
    return sol, min_bytes


def _note_policy(
    problem: Problem, policy: str, own: set[str], save_all: tuple, notes: list[str], graph: str = ""
) -> None:
    """Say where a fixed policy cannot act (it keeps what ``save-all`` keeps: a warning and a note, never
    a silent save-all), where it remakes buffers but keeps no less than ``save-all`` (``save_all``: its
    saved and recomputed sets), or acts on blocks it is unsure of; ``own``: what the policy alone
    recomputes. The warning
    names the graph (``graph``, its id): a model Dynamo splits is planned graph by graph, and a policy
    may act in one (the attention's) and not in another (a mixture of experts' router, Mixtral's second
    graph), which read as if about the whole model."""
    saved, recomputed = problem.needed_closure(own)
    kept, baseline = problem.kept_bytes(saved, recomputed), problem.kept_bytes(*save_all)
    acts = kept < baseline
    where = f" in this graph ({graph[:12]})" if graph else ""
    # buffers of their own made again, not only views (a weight's transpose: free either way), beyond
    # what save-all's plan makes in the backward too (its gathers under sequence parallelism, the
    # values only the backward reads)
    remade = {
        n
        for n in recomputed - save_all[1]
        if problem.values[n].storage == n and problem.storage_bytes.get(n, 0) > 0
    }
    msg = None
    if remade and not acts:
        msg = _no_gain_message(problem, policy, remade, kept, baseline, where)
    elif policy == "full":
        msg = _blocks_message(problem, acts, where)
    elif policy == "megatron-selective":
        msg = _cores_message(problem, acts, where, notes)
    if msg:
        warnings.warn("recompile_opt: " + msg)
        notes.append(msg)


def _no_gain_message(
    problem: Problem, policy: str, remade: set[str], kept: int, baseline: int, where: str
) -> str:
    """A policy that recomputes (``remade``: the buffers it makes again) and yet keeps no less than
    ``save-all``: what it recomputes has to be made from inputs kept for it, no smaller at these sizes
    (GPT-NeoX at 16 tokens: its attention cores' 16 x 16 scores against the fused QKV output their
    rotary recompute reads). Why said: the plan is the policy's as asked, and the old message called
    it save-all while it recomputed 82 values."""
    if policy == "megatron-selective":
        cores = [c for c in attention_cores(problem) if c & remade]
        what = f"the {len(cores)} attention core{'s' * (len(cores) != 1)} found{where}"
    else:
        blocks = find_blocks(problem)
        found = {blocks[n] for n in remade if blocks.get(n)}
        what = f"the values inside the {len(found)} block{'s' * (len(found) != 1)} found{where}"
    return (
        f"policy={policy!r}: recomputing {what} keeps {fmt_bytes(kept)}, no less than save-all's "
        f"{fmt_bytes(baseline)}: the inputs kept for the recompute weigh no less than what it frees "
        "at these sizes; the policy is applied as asked"
    )


def _cores_message(problem: Problem, acts: bool, where: str, notes: list[str]) -> str | None:
    """``megatron-selective``'s message where it finds no attention core to recompute (None where it
    acts); with SDPA cores, a note that no s x s tensor exists."""
    cores = attention_cores(problem)
    if not acts:
        why = (
            f"no attention core found{where} (no QK^T matmul feeding softmax and @V, no SDPA call)"
            if not cores
            else f"none of the {len(cores)} attention cores found{where} can be recomputed"
        )
        there = " there" if where else ""
        return f"policy='megatron-selective': {why}; nothing is recomputed{there}, as under save-all"
    if any("scaled_dot_product" in problem.values[n].info.get("op", "") for c in cores for n in c):
        notes.append(
            "megatron-selective: attention is SDPA, so no s x s tensor exists to save; "
            "the SDPA call itself is recomputed"
        )
    return None


def _blocks_message(problem: Problem, acts: bool, where: str = "") -> str | None:
    """Where ``full`` has no blocks to checkpoint, has blocks with nothing inside to recompute, or only
    blocks named by module indices whose subgraphs are not copies of one another (a split that may not
    be the model's layers). ``where``: which graph, for the message."""
    there = " there" if where else ""
    blocks, origin = blocks_and_origin(problem)
    found = sorted({b for b in blocks.values() if b})
    named = f"{', '.join(found[:3])}{', ...' if len(found) > 3 else ''}"
    if not found:
        return (
            f"policy='full': no repeated blocks found{where} (by the graph's structure or by indexed "
            f"module names); nothing is recomputed{there}, as under save-all"
        )
    if not acts:
        return (
            f"policy='full': every value inside the {len(found)} blocks found{where} ({named}) is read "
            "outside its block (each makes only its outputs, as a single linear does), so nothing is "
            f"recomputed{there}, as under save-all"
        )
    if origin == "names":
        return (
            f"policy='full': {len(found)} blocks taken from indexed module names ({named}), but no "
            "module's children repeat in the graph: check that these are the model's layers"
        )
    return None


def _note_prefer_tags(problem: Problem, saved: set[str], recomputed: set[str], notes: list[str]) -> None:
    kept_storages = {problem.values[n].storage for n in saved}
    for name, v in problem.values.items():
        remade_view = v.storage != name and v.storage in kept_storages  # same memory as keeping it
        if v.tag in ("prefer_save", "must_save") and name in recomputed and remade_view:
            notes.append(
                f"{name}: {v.tag.upper()} met by keeping its buffer {v.storage} (the view is "
                "remade from it: no two kept tensors share memory)"
            )
        elif v.tag == "prefer_save" and name in recomputed:
            notes.append(f"{name}: PREFER_SAVE overridden, the budget forces a recompute")
        elif v.tag == "prefer_recompute" and name in saved and v.can_recompute:
            notes.append(f"{name}: PREFER_RECOMPUTE overridden, kept (cheaper or required)")


def _reason(v, action: str, policy: str, free: bool) -> str:
    if free:
        return "param"
    if v.tag:
        return "user"
    if v.random and action == RECOMPUTE:
        return "rng"
    if not v.can_recompute:
        op = v.info.get("op", "")
        return "input" if op == "input" else ("collective" if "c10d" in op else "required")
    return "ilp" if policy == "auto" else "policy"


def _describe(
    problem: Problem,
    options: Options,
    graph: str,
    saved: set[str],
    recomputed: set[str],
    *,
    baseline,
    budget,
    min_bytes,
    solver_info,
    notes,
) -> Plan:
    kept_entries, rec_entries, charged = [], [], set()
    kept_storages = {problem.values[n].storage for n in saved}
    offloaded = offloaded_values(recomputed) & saved
    for name, v in problem.values.items():
        if name in offloaded:  # handed to the backward through the host: no device bytes kept
            kept_entries.append(_entry(v, OFFLOAD, _reason(v, OFFLOAD, options.policy, False), 0))
        elif name in saved:
            b = 0 if v.storage in charged else problem.storage_bytes.get(v.storage, 0)
            charged.add(v.storage)
            free = problem.storage_bytes.get(v.storage, 0) == 0
            kept_entries.append(_entry(v, KEEP, _reason(v, KEEP, options.policy, free), b))
        elif name in recomputed and v.in_forward:  # backward-only values are not recomputation
            view = v.storage != name and v.storage in kept_storages and not v.flops and not v.tag
            reason = (
                "view" if view else _reason(v, RECOMPUTE, options.policy, False)
            )  # remade from a kept buffer
            rec_entries.append(_entry(v, RECOMPUTE, reason, 0))
            if v.random and v.in_forward:
                kept_entries.append(
                    PlanEntry(
                        name=f"{name}.rng_state",
                        op="rng_state",
                        action=KEEP,
                        reason="rng",
                        bytes=problem.rng_state_bytes,
                        dtype="uint8",
                        shape=[problem.rng_state_bytes],
                    )
                )
    forward_recomputed = {n for n in recomputed if n in problem.values and problem.values[n].in_forward}
    twice = twice_values(recomputed)  # made twice: counted twice
    kept = problem.kept_bytes(saved, recomputed)
    return Plan(
        graph=graph,
        policy=options.policy,
        saved=kept_entries,
        recomputed=rec_entries,
        saved_bytes=kept,
        baseline_bytes=baseline,
        min_bytes=min_bytes,
        budget_bytes=budget,
        peak_limit_bytes=options.peak_memory,
        recompute_flops=sum(problem.values[n].flops * (1 + (n in twice)) for n in forward_recomputed),
        recompute_s=problem.recompute_seconds(recomputed),
        step_s=problem.step_s,
        predicted_peak_bytes=0,
        solver=solver_info,
        notes=notes,  # the caller simulates it (backend)
        options={k: v for k, v in vars(options).items() if v not in (None, {}, "")},
        collectives=[{**c, "regathered": c["name"] in forward_recomputed} for c in problem.collectives],
    )


def _approximated(problem: Problem, recomputed: set[str]) -> list[dict]:
    """The plan's entries of the sites it approximates (``Plan.approximated``)."""
    out = []
    for site in problem.sites:
        if site.choice not in recomputed:
            continue
        v = problem.values[site.replaced]
        kept_as = [problem.values[n] for n in site.approx]
        out.append(
            {
                "value": site.replaced,
                "kind": site.kind,
                **site.detail,
                "shape": list(v.info.get("shape", [])),
                "dtype": v.info.get("dtype", ""),
                "bytes": problem.storage_bytes.get(v.storage, 0),
                "kept_as": [u.name for u in kept_as],
                "kept_as_bytes": sum(problem.storage_bytes.get(u.storage, 0) for u in kept_as),
                "choice": site.choice,
                "marker": site.marker,
                "cost_s": site.cost_s,
                # where the approximation is made: the activation's or the linear layer's module
                "module": kept_as[0].info.get("module", ""),
                "source": kept_as[0].info.get("source", ""),
            }
        )
    return out


def _entry(v, action: str, reason: str, nbytes: int) -> PlanEntry:
    i = v.info
    return PlanEntry(
        name=v.name,
        op=i.get("op", ""),
        action=action,
        reason=reason,
        shape=list(i.get("shape", [])),
        dtype=i.get("dtype", ""),
        bytes=nbytes,
        flops=v.flops if action == RECOMPUTE else 0,
        recompute_s=v.recompute_s if action == RECOMPUTE else 0.0,
        module=i.get("module", ""),
        source=i.get("source", ""),
    )
