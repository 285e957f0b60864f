"""What the planner's searches share: one ILP solve of a problem (its repeated blocks solved once and
expanded), the least bytes any plan keeps, the candidate plans a search meets, and a greedy fallback
for when the solver fails.
"""

from __future__ import annotations

from typing import NamedTuple, Protocol

from recompile_opt.options import OptionError, Options
from recompile_opt.plan import fmt_bytes
from recompile_opt.planner import ilp
from recompile_opt.planner.blocks import BlockReduction
from recompile_opt.planner.problem import Problem


class InfeasibleBudget(OptionError):
    """``strict=True`` and no plan meets ``memory_budget`` / ``peak_memory``."""


class Candidate(NamedTuple):
    """A plan met by the least-peak search: its predicted peak, recompute time and kept bytes, the ILP
    solution, where it came from (a ladder and level), and the values the refinement kept on top."""

    peak: int
    recompute_s: float
    kept: int
    sol: ilp.Solution
    ladder: tuple | None = None
    level: float | None = None
    refined: tuple[str, ...] = ()
    mirrored: int | None = None  # the block whose decisions every identical block took
    walked_moves: tuple[str, ...] = ()  # kept values alive at a walked peak, recomputed on top
    policy: str | None = None  # the hand policy whose plan it is (least_peak._policy_plans)


class Simulate(Protocol):
    """The peak oracle: everything the planner asks of it (recompile_opt.costs.simulator.PeakSimulator;
    :class:`SimulateOnly` for one that only simulates)."""

    can_walk: bool  # exact() may answer: plans can be checked in Inductor's generated code
    chunked: bool  # the graph is chunked along the sequence: simulated peaks cannot rank its plans
    asked_log: list  # each question to exact(), in order (what a search walked: walked_keys)
    walk_setting: str  # what its walks are made under (layout, buffer pool): keys what a search found

    def __call__(self, saved: set, recomputed: set) -> int: ...  # predicted peak bytes

    def recomputed_at_peak(self, saved: set, recomputed: set) -> list[str]: ...

    # the exact peak from Inductor's generated code, None where it cannot tell (see _verified)
    def exact(self, saved: set, recomputed: set) -> int | None: ...

    # walk these (saved, recomputed) plans now, in parallel where it can: exact() then answers from them
    def walk_ahead(self, plans: list[tuple]) -> None: ...

    # the exact peak if exact() has been asked about this plan (asked=True: by this compile), else
    # None (costs nothing)
    def known_exact(self, saved: set, recomputed: set, *, asked: bool = False) -> int | None: ...

    def why_unwalked(self, saved: set, recomputed: set) -> str: ...  # why exact() gave no peak

    # what is alive at this plan's walked peak (costs.inductor_peak.WalkedPeak), where walked; else None
    def walked_peak(self, saved: set, recomputed: set): ...

    def mark_asked(self, keys) -> None: ...  # plans walked by an earlier search count as this compile's

    def walked_keys(self, since: int = 0) -> frozenset: ...  # the plans walked since asked_log[since]


class SimulateOnly:
    """A :class:`Simulate` that only simulates (subclasses give ``__call__`` and
    ``recomputed_at_peak``): no plan is walked, the simulated peaks decide."""

    can_walk, chunked, walk_setting = False, False, ""

    def __init__(self):
        self.asked_log: list = []

    def exact(self, saved: set, recomputed: set) -> int | None:
        return None

    def walk_ahead(self, plans: list[tuple]) -> None:
        pass

    def known_exact(self, saved: set, recomputed: set, *, asked: bool = False) -> int | None:
        return None

    def why_unwalked(self, saved: set, recomputed: set) -> str:
        return "no walk for this graph"

    def walked_peak(self, saved: set, recomputed: set):
        return None

    def mark_asked(self, keys) -> None:
        pass

    def walked_keys(self, since: int = 0) -> frozenset:
        return frozenset()


def solve_reduced(
    problem: Problem, reduction: BlockReduction | None, budget, kw: dict, notes: list[str], **extra
) -> ilp.Solution:
    """Solve the reduced problem and expand it. The first block reads the embedding where the template
    reads its own copy, so the expanded plan can keep a little more than the reduced one claimed:
    tighten the budget by that excess and re-solve (twice at most), else solve in full."""
    target = budget
    for _ in range(3 if reduction is not None else 0):
        sol = ilp.solve(reduction.reduced, budget=target, **kw, **extra)
        if sol.status not in ("optimal", "feasible"):
            break
        full = ilp.Solution(
            reduction.expand(sol.recompute),
            reduction.expand(sol.keep),
            sol.status,
            sol.solve_s,
            sol.gap,
            sol.n_vars,
            sol.n_constraints,
        )
        kept = problem.kept_bytes(*problem.needed_closure(full.recompute, full.keep))
        if budget is None or extra.get("minimize_memory") or kept <= budget:
            note_once(notes, reduction.note(len(problem.values)))
            return full
        claimed = reduction.reduced.kept_bytes(*reduction.reduced.needed_closure(sol.recompute, sol.keep))
        target = claimed - (kept - budget) - 1
    return ilp.solve(problem, budget=budget, **kw, **extra)


def least_bytes(problem: Problem, reduction: BlockReduction | None, kw: dict) -> int | None:
    sol = solve_reduced(problem, reduction, None, kw, [], minimize_memory=True)
    if sol.status not in ("optimal", "feasible"):  # the greedy fallback's least, so budgets stay defined
        sol = ilp.Solution(greedy_recompute(problem, 0))
    saved, recomputed = problem.needed_closure(sol.recompute, sol.keep)
    return problem.kept_bytes(saved, recomputed)


def note_once(notes: list[str], note: str) -> None:
    if note not in notes:
        notes.append(note)


def below_least(budget: int, min_bytes: int | None) -> str:
    return (
        f"memory_budget={fmt_bytes(budget)} is below the least any plan can keep "
        f"({fmt_bytes(min_bytes)}, {min_bytes} bytes)"
    )


def solver_info(options: Options, sol: ilp.Solution) -> dict:
    return {
        "name": options.solver,
        "status": sol.status,
        "solve_s": round(sol.solve_s, 4),
        "gap": sol.gap,
        "n_vars": sol.n_vars,
        "n_constraints": sol.n_constraints,
    }


def greedy_recompute(problem: Problem, budget: int | None) -> set[str]:
    """Fallback: recompute the kept storage with the most bytes freed per second of recompute, until
    the plan fits.

    Always correct (the closure derives what must be kept); not optimal. Also the baseline that the
    property tests hold the ILP against. A move recomputes every kept value of one storage (a view
    alone frees nothing while its base stays kept). Moves are ranked by a local estimate (the storage
    freed, its inputs' storages newly kept) and the best is confirmed with the exact closure, so a
    step costs one closure, not one per candidate (that was cubic: 347 s for a 24-layer GPT).
    """
    recompute: set[str] = set()
    feasible = problem.recomputable()
    saved, rec = problem.needed_closure(recompute, feasible=feasible)
    kept = problem.kept_bytes(saved, rec)
    useless: set[str] = set()  # storages whose recompute frees nothing, as things stand
    while budget is not None and kept > budget:
        for storage, names in _ranked_moves(problem, saved, rec, useless):
            s2, r2 = problem.needed_closure(recompute | names, feasible=feasible)
            if problem.kept_bytes(s2, r2) < kept:
                recompute |= names
                saved, rec, kept = s2, r2, problem.kept_bytes(s2, r2)
                useless.clear()  # what is kept changed: earlier verdicts may not hold
                break
            useless.add(storage)
        else:
            break
    if budget is not None and kept > budget:  # stalled: no single move frees bytes; recompute all
        everything = problem.needed_closure(set(problem.values))
        if problem.kept_bytes(*everything) < kept:
            return everything[1]
    return rec


def _ranked_moves(
    problem: Problem, saved: set[str], rec: set[str], skip: set[str]
) -> list[tuple[str, set[str]]]:
    """For each kept storage, the values to recompute so that it is freed (its kept values, its base,
    and their ancestors back to kept values), by estimated bytes freed per second, best first (ties
    by name: every process breaks them alike)."""
    by_storage: dict[str, set[str]] = {}
    for n in saved:
        by_storage.setdefault(problem.values[n].storage, set()).add(n)
    scored = []
    for storage, names in by_storage.items():
        if storage in skip or not storage or not problem.storage_bytes.get(storage, 0):
            continue
        move, fresh = _move(problem, names | ({storage} & problem.values.keys()), saved, rec)
        if move is None:
            continue
        freed = (
            problem.storage_bytes[storage]
            - sum(problem.storage_bytes.get(s, 0) for s in fresh - set(by_storage) - {""})
            - sum(
                problem.rng_state_bytes * problem.values[n].copies for n in move if problem.values[n].random
            )
        )
        seconds = (
            sum(problem.values[n].recompute_s for n in sorted(move)) + 1e-12
        )  # a fixed order: same float on every rank
        scored.append((-freed / seconds, storage, move))
    return [(storage, move) for _, storage, move in sorted(scored, key=lambda t: t[:2])]


MAX_MOVE = 64  # values one greedy move may recompute (bounds the search in long unsaved chains)


def _move(problem: Problem, start: set[str], saved: set[str], rec: set[str]):
    """``start`` and its ancestors up to kept or recomputed values (and what each must be recomputed
    with: ``Value.recompute_with``, kept or not), and the storages of the inputs that would become
    kept; None when one of those cannot be recomputed or the move grows too large."""
    move, fresh, todo, forced = set(), set(), list(start), set(start)
    while todo:
        n = todo.pop()
        if n in move or n in rec:
            continue
        v = problem.values[n]
        if (n in saved and n not in forced) or not v.can_recompute:
            if n in forced:
                return None, set()
            fresh.add(v.storage)  # stays kept, or becomes kept
            continue
        move.add(n)
        if len(move) > MAX_MOVE:
            return None, set()
        forced.update(v.recompute_with)
        todo.extend((*v.inputs, *v.recompute_with))
    return move, fresh


def one_tensor_per_storage(
    problem: Problem, recompute: set[str], keep: set[str]
) -> tuple[set[str], set[str]]:
    """The plan's (saved, recomputed), with one kept value per storage: where it would keep several
    values of one buffer (``div`` and its view ``permute_61``; two views of one ``clone``), it keeps
    the buffer's own value and recomputes the views from it in the backward (free). Same bytes.

    Why: AOTAutograd marks every saved activation that does not alias a graph input or output as a
    *donated buffer* (``collect_bw_donated_buffer_idxs``; it does not look for aliasing among the
    saved tensors themselves), and Inductor may then write over it in the backward once that input
    is dead, while another saved tensor still reads the same memory: the tests' tiny GPT at
    ``memory_budget=0.5`` got gradients off by 0.024 through Inductor, right with
    ``donated_buffer=False`` or the eager compiler."""
    saved, recomputed = problem.needed_closure(recompute, keep)
    groups: dict[str, list[str]] = {}
    for name in saved:
        storage = problem.values[name].storage
        if storage and problem.storage_bytes.get(storage, 0) > 0:
            groups.setdefault(storage, []).append(name)
    shared = {
        s
        for s, names in groups.items()
        if len(names) > 1
        and s in problem.values
        and problem.values[s].can_save
        and problem.values[s].tag != "must_recompute"
    }
    if not shared:
        return saved, recomputed
    # every view of those storages, so that the chain from the kept value to a view the backward reads
    # (div -> expand -> view -> permute) is recomputed too: the closure keeps what it is not told to
    views = {n for n, v in problem.values.items() if v.storage in shared and n != v.storage}
    return problem.needed_closure((recompute | views) - shared, keep | shared)
