"""The least-peak search and ``peak_memory``: plans found around the ILP, each partitioned and simulated.

The ILP minimises recompute under a byte budget; a step's peak is not a linear function of what is
kept (recompile_opt.planner.ilp, "There is no peak row"). So a fractional budget's 0.0 end (the plan
of least predicted peak) and a ``peak_memory`` limit are met by solving at ladders of byte budgets
and simulating each plan (``Simulate``: recompile_opt.costs.simulator), then refining, mirroring and
checking the best in Inductor's own code. Each constant below says why it has its value.
"""

from __future__ import annotations

import dataclasses
import hashlib
import warnings
from concurrent.futures import Future, ThreadPoolExecutor
from typing import NamedTuple

from recompile_opt.options import Options
from recompile_opt.plan import fmt_bytes
from recompile_opt.planner import ilp, policies
from recompile_opt.planner.blocks import BlockMirror, block_mirror
from recompile_opt.planner.problem import OFFLOAD, TWICE, Problem, twice_values
from recompile_opt.planner.solving import (
    Candidate,
    InfeasibleBudget,
    Simulate,
    below_least,
    greedy_recompute,
    least_bytes,
    one_tensor_per_storage,
    solve_reduced,
    solver_info,
)

IN_BLOCKS = " in the blocks"  # a candidate's policy applied inside the blocks only (_policy_plans)
# Kept-byte levels (fractions of the range least-possible .. save-all) tried for the least peak.
PEAK_LADDER = (0.0, 0.05, 0.1, 0.15, 0.2, 0.25, 0.3, 0.35, 0.4, 0.45, 0.5)
# A second ladder over kept bytes weighted by how long they stay alive in the backward (see
# _lifetime_weighted): it finds plans of the same least peak that recompute less.
LIFETIME_LADDER = (0.1, 0.15, 0.2, 0.25)
# The lowest-peak levels found get probes this far on either side (a quarter of a ladder step).
PEAK_PROBES, PEAK_PROBE_STEP = 2, 0.0125
# Predicted peaks this close are ties, and a tie goes to the plan that recomputes less. 0.0 means the
# least memory, so the tie only absorbs near-equal predictions (it was 5%, which traded peak for speed).
PEAK_TIE = 0.02
# Branch-and-bound nodes a least-peak search solve may take. Its solves only propose candidates, so
# the best plan found by then will do; a node limit, unlike a time limit, gives every machine the same
# plan. The benchmark's GPT and Llama and the Hugging Face GPT-2, BERT and Llama need at most 85; two
# of a 2-layer T5's 22 took 4470 and 7948 nodes (30 s and 20 s: its planning took 36 s, 10 s with this
# limit, the benchmark models' plans unchanged).
SEARCH_MAX_NODES = 200
# Rounds of the least-peak refinement, and the recomputed values alive at the peak tried per round.
REFINE_ROUNDS, REFINE_MOVES = 2, 16
# A refinement move that keeps the peak must cut the recompute by this share to be taken.
REFINE_MIN_GAIN = 0.01
# Candidates of the least-peak search within this factor of its least peak are mirrored (_mirrored): the
# best uniform plans came from ones at 1.24x (GPT) and 1.10x (Llama); all of them took 5 s on the Llama.
MIRROR_RANGE = 1.25
# The least-peak plan is checked in the code Inductor generates (recompile_opt.costs.inductor_peak: within
# 0.4% of the measured peak on the benchmark's 16 stored plans, ~1.5 s of lowering per graph) against
# up to VERIFY_MAX plans that recompute VERIFY_GAIN less and whose simulated peak lies within
# VERIFY_RANGE of its own (the simulator's errors on those plans: -10%..+9%). An exact peak up to
# EXACT_TIE higher is taken for at least as large a share of the est. step saved (_worth_its_peak): on
# the benchmark's GPT 3.1% more peak (24.80 -> 25.58 MiB measured) for 43% less recompute (28.8 -> 16.4
# ms est.), the step 1.19x -> 1.06x of plain torch.compile's (python bench/compare.py, docs/benchmarks.md).
VERIFY_RANGE, VERIFY_GAIN, VERIFY_MAX = 1.15, 0.2, 2
EXACT_TIE = 0.05
# On a graph chunked along the sequence the simulator cannot rank the search's plans (the GPT with
# vocabulary 2048, its loss and MLPs chunked: 25 plans simulated within 22.3..23.9 MiB walked 24.1..30.1,
# the least simulated at 29.1): there the plans of least simulated peak are walked, up to this many.
WIDE_WALKS = 8
# Values alive at the least walked peak of a chunked graph's search, each tried recomputed (kept ones)
# or recomputed twice (recomputed ones): one walk each, in parallel (_recompute_moves); rounds of them
# while a round lowers the least walked peak (the demo GPT: the embedding sum recomputed, then the
# first block's normalised input twice)
WALKED_MOVES, MOVE_ROUNDS = 2, 2
# Kept-byte levels, from the byte budget down to the least possible, searched for a peak_memory limit.
PEAK_SEARCH = tuple(i / 10 for i in range(10, -1, -1))
# Between the first level that fits and the one above it, probes this far apart.
PEAK_SEARCH_PROBE = 0.025
# A peak_memory limit is checked in Inductor's code on at most this many plans per graph (the cheapest
# first): the least-recompute plan that fits by simulation fails the walk when the simulator under-
# estimates it, and the next one by recompute usually fits. Where none of them fits, up to PEAK_WALKS + 1
# more walk toward the least peak (_PeakCheck.least_walked), and a plan among those that fits is taken.
PEAK_WALKS = 6
# On a deep stack solved as block groups a walk lowers the whole graph (~1.5 s per 2 blocks here): its
# limit is checked in Inductor's code on this many plans.
DEEP_PEAK_WALKS = 2
# The share of the limit kept free on graphs with kernels that allocate scratch inside them: the
# walk counts their workspace as measured once per layout (costs/scratch.py; the stored plans measured
# at most 4 bytes above their walks and up to 0.4% below), and the margin is insurance for what such
# a measurement alone may miss (a workspace that depends on the allocator's state or the data).
SCRATCH_MARGIN = 0.01
# Plans simulated up to this factor over a peak_memory limit are walked too: the simulator is off by
# -10%..+9% on the stored plans, and on the benchmark's GPT the plan simulated at 26.85 MiB walks to
# 25.58 MiB (16.4 ms of recompute, est.), where "26MiB" otherwise takes one of 28.8 ms.
SIM_SLACK = 1.10


def _least_peak(
    problem: Problem,
    reduction,
    kw: dict,
    min_bytes: int,
    baseline: int,
    simulate: Simulate,
    notes: list[str],
    verify: bool = True,
) -> tuple[int, ilp.Solution | None, list[Candidate]]:
    """The plan with the least predicted peak over a ladder of kept-byte budgets, its kept bytes, and
    every plan the search met (``peak_memory`` takes the least recompute among those that fit).

    Two ladders (kept bytes, lifetime-weighted bytes), probes beside the lowest peaks, ties within
    ``PEAK_TIE`` won by the least recompute, the refinement (:func:`_keep_moves`), uniform plans for
    identical blocks (:func:`_mirrored`) and the check in Inductor's code (:func:`_verified`); what each
    step found on the benchmark models is in docs/design.md, "Budgets, and the least-peak search". A
    search, not a proof of the least peak.

    Why: below some budget keeping fewer bytes only raises the peak (a recomputed value lives from its
    first to its last use in the backward), so a fraction's 0.0 end is the least-peak plan."""
    # solves on threads (HiGHS releases the GIL: 11 ladder solves of a 2-layer GPT took 1.80 s in turn,
    # 0.93 s on 2 threads), each result simulated here as soon as it is in
    kw = {**kw, "max_nodes": SEARCH_MAX_NODES}
    with ThreadPoolExecutor(max_workers=ilp.ILP_THREADS) as pool:

        def solving(points: list[tuple[tuple, float]]) -> list[Future]:
            return [
                pool.submit(solve_reduced, prob, red, int(lo + f * (hi - lo)), kw, [])
                for (prob, red, lo, hi), f in points
            ]

        def candidates(points: list[tuple[tuple, float]], futures: list[Future]) -> list[Candidate]:
            out = []
            for (ladder, f), future in zip(points, futures):  # simulate each while later ones solve
                sol = future.result()
                if sol.status in ("optimal", "feasible"):
                    out.append(_met(problem, simulate, sol, ladder=ladder, level=f))
            return out

        points = [((problem, reduction, min_bytes, baseline), f) for f in PEAK_LADDER]
        if reduction is None and problem.bwd_steps:  # deep stacks: one ladder (compile time)
            weighted = _lifetime_weighted(problem)
            top = weighted.kept_bytes(weighted.needed_closure(set())[0])
            least = pool.submit(least_bytes, weighted, None, kw)
            futures = solving(points)
            more = [((weighted, None, least.result(), top), f) for f in LIFETIME_LADDER]
            points, futures = points + more, futures + solving(more)
        else:
            futures = solving(points)
        found = candidates(points, futures)
        if not found:
            return min_bytes, None, []
        lowest = sorted(found, key=lambda c: c.peak)[:PEAK_PROBES]  # the peak is spiky in the level
        probes = [
            (c.ladder, f)
            for c in lowest
            for f in (c.level - PEAK_PROBE_STEP, c.level + PEAK_PROBE_STEP)
            if 0 <= f <= 1
        ]
        found += candidates(probes, solving(probes))
    found += _policy_plans(problem, _least_of(found), simulate)
    best = _least_of(found)
    # deep stacks (solved as block groups) skip the refinement: a 12-layer GPT's partition takes 0.8 s,
    # and its two rounds cost 12 s
    for _ in range(REFINE_ROUNDS if reduction is None else 0):  # keep what only feeds an earlier recompute
        found += _keep_moves(problem, best, simulate)
        candidate = _least_of(found)
        if not _improves(candidate, best):
            break
        best = candidate
    least = min(c.peak for c in found)
    mirror = block_mirror(problem) if reduction is None else None
    if mirror is not None:  # uniform versions of the plans met; one that is as good on both counts wins
        uniform = _mirrored(problem, mirror, found, simulate)
        found += uniform
        rivals = [
            c for c in uniform if c.peak <= least * (1 + PEAK_TIE) and c.recompute_s <= best.recompute_s
        ]
        best = min(rivals, key=lambda c: (c.recompute_s, c.peak), default=best)
    checked = None
    if (
        reduction is None and verify
    ):  # deep stacks: lowering their graphs takes too long (~1.5 s per 2 blocks)
        best, checked = _verified(problem, best, found, simulate)
    refined = (
        "; kept on top of the ILP's choice, alive at its peak (a lower peak, or a tie that recomputes "
        f"less): {', '.join(best.refined)}"
    )
    same = (
        f"; every identical block takes block {best.mirrored}'s decisions, so Inductor builds one "
        "block's kernels"
    )
    hand = (best.policy or "").removesuffix(IN_BLOCKS)
    where = (
        " inside the blocks, the ILP's choice outside them"
        if hand != best.policy
        else ", met beside the ILP's"
    )
    policy = f"; the {hand!r} policy's plan{where}"
    # the plan's predicted peak is walked in Inductor's code where the search walked this graph (the
    # backend walks the plan taken too): a figure of the kernel model's says it is one
    peak = (
        f"peak walked in Inductor's code {fmt_bytes(best.peak)}"
        if checked
        else f"the kernel model's estimate of its peak {fmt_bytes(best.peak)}"
    )
    notes.append(
        f"memory_budget 0.0 = the least-peak plan: keeps {fmt_bytes(best.kept)}, {peak} "
        "(keeping less only raises the peak). Searched by simulated peaks "
        f"(least {fmt_bytes(least)}; within {PEAK_TIE:.0%} are ties, the least recompute wins"
        + (refined if best.refined else "")
        + (same if best.mirrored is not None else "")
        + (policy if best.policy else "")
        + ")"
        + (f"; {checked}" if checked else "")
    )
    return best.kept, best.sol, found


def _verified(
    problem: Problem, best: Candidate, found: list[Candidate], simulate: Simulate
) -> tuple[Candidate, str | None]:
    """``best`` checked against plans that recompute much less, by the peaks of the code Inductor
    generates for them (``simulate.exact``): the cheapest worth its peak (:func:`_worth_its_peak`)
    replaces it. Returns the choice (its peak the exact one where known) and a note.

    Why: the simulated peak is off by -10%..+9% on measured plans, so among plans a few percent apart
    it ranks by its errors: on the benchmark's GPT it put a plan that measured 25.58 MiB (16.4 ms of
    recompute, est.) 13% above the least-peak plan (24.80 MiB measured, 28.8 ms), and plans that
    measured 28.56 MiB between them. Inductor's own code is exact but costs a lowering per plan, so
    only up to ``VERIFY_MAX`` rivals are lowered, cheapest first."""
    if not simulate.can_walk:
        return best, None
    exact = simulate.exact
    if simulate.chunked:
        return _walked_widely(problem, best, found, simulate)
    rivals: dict[tuple, Candidate] = {}
    for c in sorted(found, key=lambda c: (c.recompute_s, c.peak)):
        if c.peak <= best.peak * VERIFY_RANGE and c.recompute_s <= best.recompute_s * (1 - VERIFY_GAIN):
            rivals.setdefault(_as_compiled(problem, c), c)
    if not rivals:
        return best, None
    # the choice and its first rival are walked whenever there is a rival (the second only where the
    # first is not taken): both at once
    simulate.walk_ahead([_as_compiled(problem, best), next(iter(rivals))])
    least = exact(*_as_compiled(problem, best))
    if least is None:
        return best, None
    for sets, c in list(rivals.items())[:VERIFY_MAX]:
        peak = exact(*sets)
        if peak is not None and _worth_its_peak(problem, (peak, c.recompute_s), (least, best.recompute_s)):
            return c._replace(peak=peak), (
                f"then checked in Inductor's generated code: the search's choice ({_ms(best)} of recompute, "
                f"est.) peaks at {fmt_bytes(least)}, this plan at {fmt_bytes(peak)} "
                f"({peak / least - 1:+.1%}, within the {EXACT_TIE:.0%} tie) for {_ms(c)}"
                f"{_share_saved(problem, best, c)}"
            )
    n = min(len(rivals), VERIFY_MAX)
    return best._replace(peak=least), (
        f"then checked in Inductor's generated code: peaks at {fmt_bytes(least)}; the {n} plan(s) that "
        f"recompute least peak more than {EXACT_TIE:.0%} above it, or above it by more than the share of the "
        "est. step they save"
    )


def _walked_widely(
    problem: Problem, best: Candidate, found: list[Candidate], simulate: Simulate
) -> tuple[Candidate, str]:
    """The search's choice and up to ``WIDE_WALKS`` plans of least simulated peak, walked in Inductor's
    code: the least walked peak, or the cheapest plan worth its peak (:func:`_worth_its_peak`)."""
    plans: dict[tuple, Candidate] = {_as_compiled(problem, best): best}
    for c in sorted(found, key=lambda c: (c.peak, c.recompute_s)):
        if len(plans) > WIDE_WALKS:
            break
        plans.setdefault(_as_compiled(problem, c), c)
    simulate.walk_ahead(list(plans))  # in parallel
    exact = simulate.exact
    walked = [c._replace(peak=peak) for sets, c in plans.items() if (peak := exact(*sets)) is not None]
    if not walked:
        return best, None
    lowest, unmoved = min(walked, key=lambda c: (c.peak, c.recompute_s)), len(walked)
    for _ in range(MOVE_ROUNDS):  # moves on the least walked plan, while they lower its walked peak
        moved = {_as_compiled(problem, c): c for c in _recompute_moves(problem, lowest, simulate)}
        moved = {sets: c for sets, c in moved.items() if sets not in plans}
        plans.update(moved)
        found += moved.values()  # met by the search: a peak_memory limit may take one
        simulate.walk_ahead(list(moved))
        walked += [c._replace(peak=peak) for sets, c in moved.items() if (peak := exact(*sets)) is not None]
        better = min(walked, key=lambda c: (c.peak, c.recompute_s))
        if better.peak >= lowest.peak:
            break
        lowest = better
    least = lowest.peak
    chosen = min(
        (c for c in walked if _worth_its_peak(problem, (c.peak, c.recompute_s), (least, lowest.recompute_s))),
        key=lambda c: (c.recompute_s, c.peak),
    )
    moves = len(walked) - unmoved
    return chosen, (
        f"then, the graph chunked, its {unmoved} plans of least simulated peak"
        + (f" and {moves} moved ones" if moves else "")
        + " checked in "
        f"Inductor's generated code: least {fmt_bytes(least)}; this plan peaks at "
        f"{fmt_bytes(chosen.peak)} for {_ms(chosen)}{_share_saved(problem, lowest, chosen)} (a peak up to "
        f"{EXACT_TIE:.0%} higher is taken for at least as large a share of the est. step saved)"
        + (
            "; on top of the ILP's choice, moved where alive at the walked peak: "
            + ", ".join(
                f"{m[len(TWICE) :]} recomputed twice" if m.startswith(TWICE) else f"{m} recomputed"
                for m in chosen.walked_moves
            )
            if chosen.walked_moves
            else ""
        )
    )


def _recompute_moves(problem: Problem, base: Candidate, simulate: Simulate) -> list[Candidate]:
    """``base`` with one value more recomputed, or recomputed twice, for each value alive at its walked
    peak that it keeps (then recomputed) or recomputes (then twice: :data:`problem.TWICE`), the largest
    ``WALKED_MOVES`` of them, each at least ``EXACT_TIE`` of the peak: a smaller one lowers the peak by
    less than the tie that :func:`_worth_its_peak` trades for recompute.

    Why: on a chunked graph the simulated peaks tie (every plan of the demo GPT's search at 20.34 MiB)
    and the walks go to the cheapest of the ties; the least walked peak (17.78 MiB) kept the embedding
    sum, 1 MiB alive under the first block's attention backward, where recomputing it with the norm
    that reads it costs an elementwise pass (16.78 MiB walked). And a value is recomputed once: the
    block's normalised input, recomputed for the QKV projection the attention's backward reads, was
    alive through that backward until its QKV weight's gradient read it (16.54 -> 15.54 MiB made
    twice)."""
    saved, recomputed = _as_compiled(problem, base)
    trace = simulate.walked_peak(saved, recomputed)
    if trace is None:
        return []
    feasible, twice = problem.recomputable(), twice_values(recomputed)
    moves = []
    for buf, size, role, origin in sorted(trace.alive, key=lambda a: -a[1]):
        name = origin or buf
        if size < EXACT_TIE * trace.peak or name not in problem.values:
            continue
        if problem.values[name].tag in ("must_save", "prefer_save"):  # the user's word
            continue
        if role == "kept" and name in feasible:
            moves.append((name, {name}))
        elif role == "working" and name in recomputed and name not in twice:
            moves.append((TWICE + name, set()))
    out = []
    for move, unkept in moves[:WALKED_MOVES]:
        trial = dataclasses.replace(
            base.sol, recompute=base.sol.recompute | {move}, keep=base.sol.keep - unkept
        )
        s2, r2 = problem.needed_closure(trial.recompute, trial.keep)
        if move in r2:
            out.append(
                base._replace(
                    peak=simulate(s2, r2),
                    recompute_s=problem.recompute_seconds(r2),
                    kept=problem.kept_bytes(s2, r2),
                    sol=trial,
                    walked_moves=(*base.walked_moves, move),
                )
            )
    return out


def _worth_its_peak(problem: Problem, rival: tuple[int, float], least: tuple[int, float]) -> bool:
    """Whether a plan of (walked peak, recompute seconds) ``rival`` is taken over ``least``'s: a peak no
    higher, or one within ``EXACT_TIE`` whose recompute saved, as a share of the estimated step, is at
    least the peak it adds, as a share.

    Why: 0.0 asks for the least memory, so peak is traded for time at one to one at best (the
    benchmark's GPT: +3.1% peak for 10% of its step; a tiny ViT's +3.5% for 2.7% is refused)."""
    added = rival[0] / least[0] - 1 if least[0] else 0.0
    if added <= 0:
        return True
    if added > EXACT_TIE or problem.step_s <= 0:
        return False
    return (least[1] - rival[1]) / problem.step_s >= added


def _share_saved(problem: Problem, least: Candidate, chosen: Candidate) -> str:
    """The recompute ``chosen`` saves against ``least``, as a share of the estimated step, for a note."""
    if chosen is least or problem.step_s <= 0 or chosen.recompute_s >= least.recompute_s:
        return ""
    return f", {(least.recompute_s - chosen.recompute_s) / problem.step_s:.1%} of the est. step less"


def _as_compiled(problem: Problem, c: Candidate) -> tuple[frozenset, frozenset]:
    """The (saved, recomputed) sets a candidate is compiled with (one kept value per storage)."""
    saved, recomputed = one_tensor_per_storage(problem, c.sol.recompute, c.sol.keep)
    return frozenset(saved), frozenset(recomputed)


def _ms(c: Candidate) -> str:
    return f"{c.recompute_s * 1e3:.3g} ms"


def _met(
    problem: Problem, simulate: Simulate, sol: ilp.Solution, closure: tuple[set, set] | None = None, **where
) -> Candidate:
    """``sol`` as a candidate of the search: the peak, recompute seconds and kept bytes of its closure
    (``closure``: ``problem.needed_closure`` of it, where the caller has it), ``where`` the candidate's
    other fields (its ladder and level, refinement, mirror or policy). One place that says what a
    candidate's figures are, for the five ways the search meets plans."""
    saved, recomputed = closure or problem.needed_closure(sol.recompute, sol.keep)
    return Candidate(
        simulate(saved, recomputed),
        problem.recompute_seconds(recomputed),
        problem.kept_bytes(saved, recomputed),
        sol,
        **where,
    )


def _mirrored(
    problem: Problem, mirror: BlockMirror, found: list[Candidate], simulate: Simulate
) -> list[Candidate]:
    """Every candidate with one block's decisions given to all blocks, for each block: uniform plans.
    Why not search uniform plans directly: on the 2-layer GPT the ILP over one template found a least
    peak of 26.60 MiB; mirroring the full search's plans found 23.84 MiB, and for less recompute than
    the full search's own least-peak plan (28.8 against 32.1 ms, est.)."""
    out: dict[tuple, Candidate] = {}
    least = min(c.peak for c in found)
    for c in (c for c in found if c.peak <= least * MIRROR_RANGE):
        for source in range(mirror.repeats):
            mirrored, keep = mirror.mirror(c.sol.recompute, source), mirror.mirror(c.sol.keep, source)
            saved, recomputed = problem.needed_closure(mirrored, keep)
            recompute = mirror.keep_entries(mirrored, recomputed)
            key = (frozenset(recompute), frozenset(keep))
            if key in out:
                continue
            if recompute != mirrored:  # an entry kept: the closure changes
                saved, recomputed = problem.needed_closure(recompute, keep)
            out[key] = _met(
                problem,
                simulate,
                dataclasses.replace(c.sol, recompute=recompute, keep=keep),
                (saved, recomputed),
                ladder=c.ladder,
                level=c.level,
                refined=tuple(sorted(mirror.mirror(set(c.refined), source))),
                mirrored=source,
            )
    return list(out.values())


def _policy_plans(problem: Problem, least: Candidate, simulate: Simulate) -> list[Candidate]:
    """The hand policies' plans (``policies.SEARCHED``: each block recomputed from its outputs,
    Megatron's attention cores) as candidates of the least-peak search, each also inside the blocks
    only, the ILP's ``least``-peak candidate deciding outside them (the embedding, the head, the loss);
    none where the user tagged a value (the ILP holds tags, the policies do not). Their solver figures
    are ``least``'s.

    Why: the ILP minimises recompute under a byte budget, so at any budget it keeps the bytes that are
    cheapest to keep, wherever they are; a plan that keeps only the blocks' outputs and recomputes
    each block in its own backward is never its answer, yet it can peak lowest. On the performance
    GPT (8 layers, bf16 autocast, its loss chunked, planned on the CPU) the ladders' least walked peak
    kept 1.25 GiB and peaked at 1.49 GiB at the forward's end; the ``full`` plan, its MLPs chunked
    too, keeps 837 MiB and walks to 1.20 GiB (docs/design.md, "Hand policies in the search"). And a
    policy knows nothing of the head: unchunked, the ``full`` plan kept the loss's fp32 shifted logits
    (3.1 GiB at b=8) where the ILP recomputes them from the bf16 logits, while the ILP's plan kept the
    attention outputs that are alive under the head's backward: the mix keeps neither (docs/design.md,
    "The floor of an unchunked plan")."""
    if any(v.tag for v in problem.values.values()):
        return []
    block_of = policies.find_blocks(problem)
    outside = {n for n, b in block_of.items() if b is None}
    chosen = least.sol
    ilp_outside = {n for n in chosen.recompute if _value_of(n) in outside}
    out = []
    for name in policies.SEARCHED:
        recompute = set(policies.POLICIES[name](problem))
        if not recompute:
            continue
        out.append(
            _met(problem, simulate, dataclasses.replace(chosen, recompute=recompute, keep=set()), policy=name)
        )
        inside = {n for n in recompute if n not in outside} | ilp_outside
        keep = {n for n in chosen.keep if n in outside}
        mixed = dataclasses.replace(chosen, recompute=inside, keep=keep)
        out.append(_met(problem, simulate, mixed, policy=name + IN_BLOCKS))
    return out


def _value_of(choice: str) -> str:
    """The value a plan's recomputed-set entry names (``offload:v``, ``twice:v`` or ``v`` itself)."""
    return choice.split(":", 1)[1] if choice.startswith((OFFLOAD, TWICE)) else choice


def _least_of(candidates: list[Candidate]) -> Candidate:
    """The candidate of least peak; peaks within PEAK_TIE of it are ties, won by the least recompute."""
    least = min(c.peak for c in candidates)
    return min(
        (c for c in candidates if c.peak <= least * (1 + PEAK_TIE)), key=lambda c: (c.recompute_s, c.peak)
    )


def _improves(new: Candidate, old: Candidate) -> bool:
    """A lower peak, or REFINE_MIN_GAIN less recompute. Why the margin: keeping a 2 KiB ``iota`` saves
    nanoseconds of recompute, and taking it cost the GPT search a second refinement round (1 s)."""
    return new.peak < old.peak or new.recompute_s < old.recompute_s * (1 - REFINE_MIN_GAIN)


def _keep_moves(problem: Problem, base: Candidate, simulate: Simulate) -> list[Candidate]:
    """``base`` with one more value kept, for each recomputed value alive at its predicted peak.

    Why: the ILP counts kept bytes, not when recomputation happens. On a 2-layer Llama the least-peak
    plan recomputed the first block's mid-block residual, so its MLP backward recomputed the block's
    embedding, norm and residual first, and those sat under the peak (the SwiGLU backward) until the
    attention backward; keeping that 1 MiB residual lowered the predicted peak from 29.09 to 28.05 MiB
    and the recompute from 16.4 to 15.0 ms. The search's ladders cannot find such a plan: no
    kept-byte budget makes the ILP prefer it."""
    sol = base.sol
    saved, recomputed = problem.needed_closure(sol.recompute, sol.keep)
    moves = [
        n
        for n in simulate.recomputed_at_peak(saved, recomputed)
        if problem.values[n].in_forward
        and problem.values[n].can_save
        and problem.values[n].tag not in ("must_recompute", "prefer_recompute")
    ]  # the user's word
    out = []
    for name in moves[:REFINE_MOVES]:
        trial = dataclasses.replace(sol, recompute=sol.recompute - {name}, keep=sol.keep | {name})
        out.append(_met(problem, simulate, trial, refined=(*base.refined, name)))
    return out


def _lifetime_weighted(problem: Problem) -> Problem:
    """The problem with each storage's bytes scaled by the share of the backward it stays alive (from
    the forward's end to its last use). Why: the plain ladder's budget counts a byte of the last
    block, freed early in the backward, like a byte of the first block, alive to its end, but only
    the latter sits under every later peak. On a 2-layer Llama the least predicted peak (29.1 MiB)
    comes at 16 ms of estimated recompute this way, 32 ms on the plain ladder."""
    steps = problem.bwd_steps
    last: dict[str, int] = {}
    for v in problem.values.values():
        if v.storage:
            last[v.storage] = max(last.get(v.storage, -1), v.last_use)
    share = {s: max((last.get(s, steps - 1) + 1) / steps, 0.02) for s in problem.storage_bytes}
    return dataclasses.replace(
        problem, storage_bytes={s: int(b * share[s]) for s, b in problem.storage_bytes.items()}
    )


class _RangeEnds(NamedTuple):
    """A fractional budget's range for one graph: the least any plan keeps, the least-peak plan (the 0.0
    end: its kept bytes and solution, None if every solve failed), its note, and every plan the
    least-peak search met (what a ``peak_memory`` limit picks from when no kept-byte level fits)."""

    min_bytes: int | None
    floor: int | None
    least_peak: ilp.Solution | None
    note: str | None
    found: list[Candidate]
    walked_keys: frozenset = frozenset()  # the plans it checked in Inductor's generated code (_verified)


def _range_search(
    problem: Problem,
    reduction,
    kw: dict,
    baseline: int,
    simulate: Simulate,
    options: Options,
    min_bytes: int | None = None,
    *,
    verify: bool = True,
    known_ranges: dict | None = None,
) -> _RangeEnds:
    """The range's ends from the least-peak search, searched once per graph and options (the byte
    and peak limits aside; a search whose solves all failed is not kept). ``min_bytes``: the least
    any plan keeps, when the caller has solved for it already. ``verify=False``: the least simulated
    peak, its cheaper rivals not walked (:func:`_verified`), for a caller that walks what it compares.
    ``known_ranges``: the ends found by earlier searches, by fingerprint (``PlanningMemory.range_ends``:
    fractions of one graph, a frontier sweep, and peak limits on it, a peak sweep, search once); this
    search's ends are added."""
    known_ranges = {} if known_ranges is None else known_ranges
    key = _fingerprint(problem, options, simulate.walk_setting) + ("" if verify else ":unverified")
    if key in known_ranges:
        simulate.mark_asked(
            known_ranges[key].walked_keys
        )  # as if searched again: its walks are this compile's
        return known_ranges[key]
    if min_bytes is None:
        min_bytes = least_bytes(problem, reduction, kw)
    notes: list[str] = []
    since = len(simulate.asked_log)  # questions to exact() before the search
    floor, least_peak, found = _least_peak(
        problem, reduction, kw, min_bytes, baseline, simulate, notes, verify
    )
    ends = _RangeEnds(
        min_bytes, floor, least_peak, notes[-1] if notes else None, found, simulate.walked_keys(since)
    )
    if least_peak is not None:
        known_ranges[key] = ends
    return ends


def range_walked(problem: Problem, options: Options, known_ranges: dict, walk_setting: str) -> bool:
    """Whether this graph's least-peak search (a fraction's range, searched once per graph and options)
    checked plans in Inductor's generated code. Why the backend asks: where it did, walking the plan
    finally taken costs one more lowering (~1.5 s), and its predicted peak is then exact."""
    ends = known_ranges.get(_fingerprint(problem, options, walk_setting))
    return ends is not None and bool(ends.walked_keys)


def _fingerprint(problem: Problem, options: Options, walk_setting: str) -> str:
    """Everything the range ends depend on: the problem's data and the options but the limits (the
    search runs without a peak limit: it is applied to the plans the search meets) and the compiler
    (the eager path plans the graph Inductor would get; where the two differ, e.g. random ops kept
    rather than replayed, the problem's data differs); and what the oracle walks under
    (``Simulate.walk_setting``: an eager-compiler search walked a ViT's convolutions channels-last, and
    Inductor's compile, walking them in their own layout, took its ends: 3.5% above its least peak)."""
    rest = dataclasses.replace(
        options, memory_budget=None, peak_memory=None, plan_dir=None, strict=False, compiler="inductor"
    )
    blob = repr(
        (
            sorted(problem.storage_bytes.items()),
            problem.bwd_steps,
            problem.bwd_byte_steps,
            problem.rng_state_bytes,
            [
                (dataclasses.astuple(v)[:-1], [str(v.info.get(k)) for k in ("op", "shape", "dtype")])
                for v in problem.values.values()
            ],
            problem.sites,
            rest.key(),
            walk_setting,
        )
    )
    return hashlib.sha256(blob.encode()).hexdigest()


def _fit_peak(
    problem: Problem,
    reduction,
    options: Options,
    budget,
    baseline: int,
    min_bytes,
    kw: dict,
    notes: list[str],
    simulate: Simulate,
    known_ranges: dict | None = None,
):
    """``peak_memory``: a hard limit on the step's peak. Kept-byte levels from the byte budget down to the
    first plan that may fit, probes between it and the level above, and the least recompute that fits,
    judged in Inductor's code (:class:`_PeakCheck`). Where that level lies within the least-peak search's
    ladder (``PEAK_LADDER``), or none fits, the plans the search met compete: the least recompute that
    fits of both, its choice walked first (:meth:`_PeakCheck.cheapest_fitting`); where none walked fits,
    more are walked toward the least peak (:meth:`_PeakCheck.least_walked`), and only then "cannot be
    met".

    Why the search's plans below the ladder's top: there keeping fewer bytes stops lowering the peak,
    and plans no kept-byte level gives (the policies', refined ones) peak as low for less recompute.

    Why walked: the simulated peak is off by -10%..+9%, so a plan that fits by it may not (the benchmark
    GPT's stored ``peak=26MiB`` plan: simulated 25.85 MiB, measured and walked 28.58); the steps'
    figures are in docs/design.md, "Budgets, and the least-peak search"."""
    if min_bytes is None:
        min_bytes = least_bytes(problem, reduction, kw)
    if budget is not None and min_bytes is not None and budget < min_bytes:  # the byte limit first
        msg = "recompile_opt: " + below_least(budget, min_bytes)
        if options.strict:
            raise InfeasibleBudget(msg + " (strict=True)")
        msg += "; planning for the peak limit at that least"
        warnings.warn(msg)
        notes.append(msg)
        budget = min_bytes
    top = baseline if budget is None else min(budget, baseline)
    limit = options.peak_memory
    check = _PeakCheck(problem, simulate, walks=PEAK_WALKS if reduction is None else DEEP_PEAK_WALKS)

    def at_level(f: float) -> Candidate | None:
        sol = solve_reduced(problem, reduction, int(min_bytes + f * max(top - min_bytes, 0)), kw, [])
        if sol.status not in ("optimal", "feasible"):
            return None
        c = _met(problem, simulate, sol, level=f)
        return None if budget is not None and c.kept > budget else c

    level, f, tried = _fitting_level(at_level, check, limit)
    # within the least-peak search's ladder (or where no level fits) its plans (the policies', the
    # lifetime ladder's, refined and mirrored ones) compete with the levels'; with approximations
    # offered, it searches again with every site approximated (the priced ILP rarely takes them for the
    # peak alone: planner.search._least_peak_approximating)
    within = level is None or f <= max(PEAK_LADDER)
    searched = [(problem, reduction)] if within else []
    if within and problem.sites:
        searched.append((problem.with_sites_fixed(True), reduction and reduction.with_sites_fixed(True)))
    # where a level fits, the search only offers plans that recompute less: it walks none of its own
    # (its choice is walked below where it is cheaper), unless a fraction's search walked them already.
    # Why: on the demo GPT under "20MiB" its chunk trials' searches, walked, cost 20 s of planning (63 ->
    # 83 s) and offered nothing cheaper; unwalked, 15 s (78 s)
    verify = level is None or _fingerprint(problem, options, simulate.walk_setting) in (known_ranges or {})
    ends = [
        _range_search(
            p,
            p_reduction,
            kw,
            baseline,
            simulate,
            options,
            min_bytes if p is problem else None,
            verify=p is problem and verify,
            known_ranges=known_ranges,
        )
        for p, p_reduction in searched
    ]
    found = [c for e in ends for c in e.found if budget is None or c.kept <= budget]
    anchors = [c for e in ends for c in found if c.sol is e.least_peak]
    chosen = check.cheapest_fitting(tried + found, anchors, limit, below=level) if within else None
    if chosen is not None:
        return _fitted(
            options,
            budget,
            min_bytes,
            notes,
            chosen,
            check,
            "the least-recompute plan that fits ({}) of the kept-byte levels' and the least-peak "
            "search's"
            + (
                f", cheaper than kept-byte level {f:.1f}'s ({_ms(level)}), which fits too"
                if level is not None
                else " (no level fits by the walks made for the levels)"
            ),
        )
    if level is not None:
        return _fitted(
            options,
            budget,
            min_bytes,
            notes,
            level,
            check,
            "the least-recompute plan whose peak fits ({}), over kept-byte levels"
            + (" and the least-peak search's plans" if within else ""),
        )
    # none fits among the plans walked for the limit (at most PEAK_WALKS): walk toward the least peak,
    # and a plan walked on the way that fits is the answer (a plan simulated far over the limit, never
    # worth a walk for it, may walk under it: the kernel model over-estimates convolution nets)
    least = check.least_walked(tried + found)
    chosen = check.least_recompute_walked(tried + found, limit)
    if chosen is not None:
        return _fitted(
            options,
            budget,
            min_bytes,
            notes,
            chosen,
            check,
            "no plan simulated within reach of the limit walks under it; the least-recompute "
            "plan walked on the way to the least peak that fits ({})",
        )
    msg = (
        f"recompile_opt: peak_memory={fmt_bytes(limit)} cannot be met; the least peak found is "
        + (f"{fmt_bytes(check.peak(least))} ({check.source(least)})" if least else "none")
        + (
            f", over the limit less the {check.margin:.0%} kept free for extern kernels' scratch"
            if least and check.margin and check.peak(least) <= limit
            else ""
        )
    )
    if options.strict:
        raise InfeasibleBudget(msg + " (strict=True)")
    warnings.warn(msg + "; using that plan")
    notes.append(msg)
    sol = least.sol if least else ilp.Solution(greedy_recompute(problem, budget))
    return sol, solver_info(options, sol), budget, min_bytes


def _fitting_level(at_level, check: "_PeakCheck", limit: int) -> tuple[Candidate | None, float | None, list]:
    """Kept-byte levels (``at_level``) from the top down to the first simulated within the limit, each
    that may fit with probes between it and the level above, and the least-recompute plan tried whose
    peak fits (:meth:`_PeakCheck.first_fitting`); while none does, the levels below. Returns that plan
    (None where none fits), the level it was found at, and every plan tried.

    Why not stop at the first level that may fit: one simulated over the limit (within ``SIM_SLACK``)
    and its probes used up a deep stack's two walks, and the level below, simulated within, was never
    walked (the 4-layer GPT with vocabulary 8192 half way from its least peak to save-all's: 2.50 ms of
    recompute, where level 0.7 fits for 1.52); gathered first, the one within is walked first."""
    tried: list[Candidate] = []
    for above, f in zip((None, *PEAK_SEARCH), PEAK_SEARCH):
        found = at_level(f)
        tried += [found] if found else []
        if found and check.may_fit(found, limit):
            between = [at_level(f + i * PEAK_SEARCH_PROBE) for i in range(1, 4)] if above is not None else []
            tried += [c for c in between if c]
            if found.peak > limit * (1 - check.margin) and f > PEAK_SEARCH[-1]:
                continue  # simulated over the limit: the level below is gathered too
            chosen = check.first_fitting(tried, limit)
            if chosen is not None:
                return chosen, f, tried
    return None, None, tried


class _PeakCheck:
    """Whether a plan's peak fits a limit, judged where possible by the code Inductor generates for it
    (``simulate.exact``), else by the simulated peak.

    The walk gives the measured peak of the 16 stored plans within 0.4% (``bench/peak_accuracy.py
    --check bench/measured_peaks.json --exact``), 14 within 4 bytes, extern kernels' workspace measured
    (:mod:`recompile_opt.costs.scratch`). A graph with such kernels must fit ``SCRATCH_MARGIN`` under the
    limit (insurance: values marked ``scratch``, ``recompile_opt.ops.TORCH_SCRATCH``). Walks cost a
    lowering each (~1.5 s per graph here): at most ``PEAK_WALKS`` per graph, cheapest plan first, none
    of a plan simulated at or above one that walked over the limit (on the benchmark's Llama at
    "36MiB" the four cheapest walked 0.3 to 5 MiB over, using up the walks).
    Where the walk cannot tell (symbolic shapes, the meta device) the simulated peak decides, and the
    plan's note says so. ``walks``: at most this many lowerings (deep stacks get fewer). Like every
    predicted peak, it is the peak of the code Inductor generates (``compiler="eager"`` runs the same
    graphs unfused)."""

    def __init__(self, problem: Problem, simulate: Simulate, walks: int = PEAK_WALKS):
        self.problem, self.simulate = problem, simulate
        self.walk = simulate.exact if walks and simulate.can_walk else None
        self.walks = walks
        scratch = any(v.info.get("scratch") for v in problem.values.values())
        self.margin = SCRATCH_MARGIN if scratch else 0.0
        self.walked: dict[tuple, int | None] = {}
        self.allowed = walks  # walks first_fitting may have made so far (cheapest_fitting adds its own)
        self.failed_at = float("inf")  # the least simulated peak of a plan that walked over the limit

    def peak(self, c: Candidate) -> int:
        """The walked peak where this plan was walked (here or by the least-peak search), else the
        simulated one."""
        walked = self._known(_as_compiled(self.problem, c))
        return c.peak if walked is None else walked

    def least_walked(self, candidates: list[Candidate]) -> Candidate | None:
        """The candidate of least peak where none walked for the limit fits, its peak walked: the least
        by :meth:`peak` is walked (beyond ``PEAK_WALKS``), and again while the least is a plan not walked
        yet, up to ``PEAK_WALKS`` more lowerings (a plan among them may fit after all:
        :meth:`least_recompute_walked`). Why not the least by :meth:`peak` alone: it mixes walked and
        simulated figures, and a plan simulated low may walk high. On the benchmark's GPT under
        "23MiB" the least was simulated at 23.79 MiB and walked 24.80 the first time; the second
        compile, knowing that walk from the disk, took the next, simulated at 24.54, which walked
        27.55: the same graph got a different plan from a warm cache. Of plans that peak alike (walks
        often agree to the byte), the one of least recompute, not the first listed. Where the walks run
        out, the least of the plans walked, not the last one walked: on a Hugging Face OPT under its own
        least walked peak, seven plans simulated low (4 ms of recompute each) walked to the peak of a
        plan the search had walked already (0.17 ms), and the seventh was taken."""
        least, order = None, lambda c: (self.peak(c), c.recompute_s)
        for _ in range(self.walks + 1):
            least = min(candidates, key=order, default=None)
            if least is None or self.walk is None or self._settled(least):
                break  # walked (or its walk cannot tell): the least is settled
            sets = _as_compiled(self.problem, least)
            self.walked[sets] = self.walk(*sets)
        else:  # the walks ran out
            least = min((c for c in candidates if self._settled(c)), key=order)
        return least and least._replace(peak=self.peak(least))

    def _settled(self, c: Candidate) -> bool:
        """Whether this compile walked the plan (or its walk cannot tell): its :meth:`peak` is final."""
        sets = _as_compiled(self.problem, c)
        return self._known(sets) is not None or sets in self.walked

    def least_recompute_walked(self, candidates: list[Candidate], limit: int) -> Candidate | None:
        """The least-recompute candidate whose walk, already made, fits ``limit`` less the margin; its
        peak the walked one. No walk is made here: what :meth:`least_walked` walked beyond
        :meth:`first_fitting`'s ``PEAK_WALKS`` is judged by the same rule."""
        fitting = []
        for c in candidates:
            sets = _as_compiled(self.problem, c)
            walked = self._known(sets)
            if walked is not None and walked <= limit * (1 - self.margin):
                fitting.append(c._replace(peak=walked))
            elif walked is None and sets in self.walked and c.peak <= limit:  # the walk cannot tell
                fitting.append(c)
        return min(fitting, key=lambda c: (c.recompute_s, c.peak), default=None)

    def source(self, c: Candidate) -> str:
        """Where :meth:`peak` has this plan's peak from."""
        return (
            "simulated" if self._known(_as_compiled(self.problem, c)) is None else "walked in Inductor's code"
        )

    def first_fitting(self, candidates: list[Candidate], limit: int) -> Candidate | None:
        """The least-recompute candidate whose walk (where one is made) fits ``limit`` less the margin,
        among those that may fit (:meth:`may_fit`) and those walks reach; its peak the walked one. None
        if none of those tried does (past the walks allowed, only plans already walked are tried).

        The walks go first to the cheapest plan simulated within the limit, then to the cheaper ones
        (simulated over it, within ``SIM_SLACK``), the closest to the limit first; where that first plan
        walks over, to the rest cheapest first. Why: walks are few (``DEEP_PEAK_WALKS`` on a deep
        stack), and cheapest first spent them on plans simulated over the limit: a 4-layer OLMo, its
        simulation exact to 4 bytes, under a limit half way from its least peak to save-all's walked
        two levels simulated 4.7% and 7.8% over, passed over the level simulated under it (0.62 ms of
        recompute), and took the least-peak search's plan (1.33 ms)."""
        pool = sorted(
            (c for c in candidates if self.may_fit(c, limit)), key=lambda c: (c.recompute_s, c.peak)
        )
        if self.walk is None:
            return pool[0] if pool else None
        under = next((c for c in pool if c.peak <= limit * (1 - self.margin)), None)
        best = self._fits(under, limit) if under is not None else None
        if best is None:
            return next((fit for c in pool if (fit := self._fits(c, limit)) is not None), None)
        for c in sorted((c for c in pool if c.recompute_s < best.recompute_s), key=lambda c: c.peak):
            if c.recompute_s < best.recompute_s:
                best = self._fits(c, limit) or best
        return best

    def _fits(self, c: Candidate, limit: int, always: bool = False) -> Candidate | None:
        """``c`` with its walked peak where that fits ``limit`` less the margin (walked now where walks
        are left and no plan simulated lower walked over the limit, or ``always``), else None; where no
        walk can tell, the simulated peak decides."""
        if self.walk is None:
            return c if c.peak <= limit else None
        sets = _as_compiled(self.problem, c)
        walked = self._known(sets)
        if walked is None and sets not in self.walked:
            if not always and (len(self.walked) >= self.allowed or c.peak >= self.failed_at):
                return None
            walked = self.walked[sets] = self.walk(*sets)
        if walked is None:  # the walk cannot tell for this graph: the simulation decides
            return c if c.peak <= limit else None
        if walked <= limit * (1 - self.margin):
            return c._replace(peak=walked)
        self.failed_at = min(self.failed_at, c.peak)
        return None

    def cheapest_fitting(
        self, candidates: list[Candidate], anchors: list[Candidate], limit: int, below: Candidate | None
    ) -> Candidate | None:
        """The least-recompute candidate that fits ``limit``, recomputing less than ``below`` where
        given: :meth:`first_fitting` with ``walks`` more lowerings, after the ``anchors`` (the least-peak
        search's choices) are walked, whatever the walks left, and the first that fits bounds the rest.
        So a limit the search's choice's walked peak fits never takes more recompute than it.

        Why the anchors first: the walks go to the cheapest plans that may fit. On a 4-layer GPT with
        vocabulary 8192, under a limit 5% of the way from its least peak to save-all's (10.67 MiB), the
        levels' plans used them up; the search's choice (2.50 ms of recompute, walked at 10.38 MiB) was
        never walked, and the walk toward the least peak took a plan of 6.04 ms at that same peak."""
        ceiling = below.recompute_s if below is not None else float("inf")
        fitting = None
        for c in sorted(anchors, key=lambda c: c.recompute_s):
            if c.recompute_s < ceiling and self.may_fit(c, limit):
                fitting = self._fits(c, limit, always=True)
                if fitting is not None:
                    ceiling = fitting.recompute_s
                    break
        self.allowed = len(self.walked) + self.walks
        cheaper = [c for c in candidates if c.recompute_s < ceiling]
        return self.first_fitting(cheaper, limit) or fitting

    def may_fit(self, c: Candidate, limit: int) -> bool:
        """Whether the plan is worth a walk: its simulated peak is within the simulator's error of the
        limit (where no walk can be made, it must fit)."""
        return c.peak <= limit * (SIM_SLACK if self.walk is not None else 1.0)

    def _known(self, sets: tuple) -> int | None:
        """The plan's walked peak if this compile walked it (not a figure left on the disk by an earlier
        one: :meth:`recompile_opt.costs.simulator.PeakSimulator.known_exact`)."""
        if sets in self.walked:
            return self.walked[sets]
        return self.simulate.known_exact(*sets, asked=True) if self.walk is not None else None

    def how(self, c: Candidate) -> str:
        """How the chosen plan's peak was judged, for its note."""
        if self.source(c) == "simulated":
            why = self.simulate.why_unwalked(*_as_compiled(self.problem, c))
            return f"simulated peak (not checked in Inductor's code: {why})"
        return "peak walked in Inductor's code" + (
            f", {self.margin:.0%} under the limit for the scratch of extern kernels" if self.margin else ""
        )


def _fitted(
    options: Options, budget, min_bytes, notes: list[str], chosen: Candidate, check: _PeakCheck, why: str
):
    """The chosen candidate as the search's answer, with a note saying how its peak was judged."""
    notes.append(
        f"peak_memory {fmt_bytes(options.peak_memory)}: "
        + why.format(f"{check.how(chosen)} {fmt_bytes(chosen.peak)}")
    )
    return chosen.sol, solver_info(options, chosen.sol), budget, min_bytes
