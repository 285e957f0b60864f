"""The save/recompute ILP, solved with PuLP: HiGHS by default (highspy; 10x faster than CBC on a
Llama layer's 11-level ladder), or the CBC that PuLP bundles.

Data (from :class:`recompile_opt.planner.problem.Problem`): values v with inputs in(v), storage S(v),
recompute time c_v, and the flags needed / can_save / can_recompute / random; storages S with bytes b_S and
save time w_S (write + read); B the byte budget.

Variables
    s_v ∈ {0,1}   v is kept from the forward for the backward          (only if can_save)
    r_v ∈ {0,1}   v is recomputed in the backward                       (only if can_recompute)
    z_S ∈ {0,1}   storage S stays alive between forward and backward    (only if b_S > 0)
    a_k ∈ {0,1}   site k's backward reads its approximation (codes, projection), not the exact values
    o_v ∈ {0,1}   kept v is offloaded: copied to the host after its last forward use, back before its
                  first backward use (only if offload is offered and v is a buffer of its own)
    x_d ≥ 0       the copy time of direction d (to the host, back) that no compute hides (seconds)

Objective (lexicographic, by weights)
    min  Σ_v c_v r_v + Σ_S w_S z_S                 recompute and saving time (µs)
       + W · Σ_{v: prefer tag violated} 1           user PREFER_* tags, W > any time total
       + Σ_k (d_k + δ) a_k                          an approximation's own time d_k, and δ
       + Σ_d x_d + δ Σ_v o_v                        exposed copy time, and δ per offload
       + ε · Σ_S b_S z_S                             then the fewest kept bytes
    (with no budget, a second solve finds the fewest bytes under a cap on the time terms:
    ``time_cap_s``, planner/search.py::_leanest_as_fast)
    (δ > ε · Σ_S b_S: an approximation or an offload is never taken for bytes the budget does not ask for)
    → implemented in set_objective()

Constraints
    s_v + r_v ≥ 1                 for v read by the backward                 → add_availability()
    r_v ≤ s_u + r_u               for u ∈ in(v): a recompute needs its inputs → add_dependencies()
    r_v ≤ r_u                     for u ∈ with(v): recomputed together (mixed precision)
    z_S ≥ s_v                     for S(v) = S: a kept view keeps its base    → add_storages()
    Σ_S b_S z_S - Σ_v b_v o_v + ρ Σ_{v random} r_v ≤ B                       → add_budget()
        (ρ: the RNG state a replayed random op keeps; an offloaded buffer is off the device between
        forward and backward)
    s_v = 0 / r_v = 0             user MUST_RECOMPUTE / MUST_SAVE tags      → add_user_tags()
    s_u + r_u ≥ 1 - a_k           for u read by site k's exact gradient     → add_sites()
    s_c + r_c ≥ a_k               for c read by its approximate gradient
    o_v ≤ s_v,  o_v + s_u ≤ 1     for u ≠ v of v's storage (a kept view holds it) → add_offload()
    Σ_{v: f_v ≤ t} b_v o_v / L ≤ t + x_down   for each forward window t: the bytes whose copy may only
        start in the forward's last t seconds (f_v: forward time after v's last use) move in t, or stall
    Σ_{v: g_v ≤ t} b_v o_v / L ≤ t + x_up     for each backward window t (g_v: backward time before v's
        first use): the bytes due in the backward's first t seconds    (L: the host link, each direction)
        (a block template's o_v stands for one copy per block of its group, each in its own window)
    o_v = 1                       user MUST_CPU_OFFLOAD (PREFER_CPU_OFFLOAD: a penalty on 1 - o_v)

There is no peak row. A step's peak depends on the kernels Inductor makes and the order it frees
buffers in, which no linear row over values can see (the node-by-node rows this model once had
over-estimated the simulated peak up to 2x and were used only where no simulator was at hand). So
``peak_memory`` and the least-peak plan are found around the ILP: by a search over byte budgets whose
plans are partitioned and simulated (recompile_opt.planner.search), the one peak model
(recompile_opt.costs.peak, checked in Inductor's code by recompile_opt.costs.inductor_peak).
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import os
import tempfile
import threading
import time
import warnings
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import pulp

from recompile_opt.planner import solutions
from recompile_opt.planner.problem import Problem, offload_choice

# HiGHS solves that may run at once (each HiGHS solve uses one thread; the least-peak search keeps
# this many going).
ILP_THREADS = max(1, min(4, os.cpu_count() or 1))
# δ, what an approximation costs besides its own time: above the whole kept-bytes tie-break (1e-3), so a
# budget met exactly is never met by approximating instead
APPROXIMATION_PRICE = 2e-3
OFFLOAD_PRICE = APPROXIMATION_PRICE  # δ of an offload, for the same reason
US = 1e6  # seconds -> microseconds keeps the objective's coefficients near 1


@dataclass
class Solution:
    recompute: set[str]  # values the solver chose to recompute
    keep: set[str] = field(default_factory=set)  # values the solver chose to keep
    status: str = "optimal"  # "optimal", "feasible" (time limit), "infeasible", "error: ..."
    solve_s: float = 0.0
    gap: float | None = None
    n_vars: int = 0
    n_constraints: int = 0


class SolveLog:
    """Solves and their summed wall time over one planning, from any thread. Why: a fractional budget's
    least-peak search runs ~20 solves on a pool next to its simulations; the plan reports both, so a
    user sees where the planning time went."""

    def __init__(self):
        self.solves, self.seconds, self.recalled, self._lock = 0, 0.0, 0, threading.Lock()

    def add(self, seconds: float, *, recalled: bool = False) -> None:
        """One solve of ``seconds``; ``recalled``: its answer was read from disk (``solutions``)."""
        with self._lock:
            self.solves += 1
            self.seconds += seconds
            self.recalled += recalled


def solve(
    problem: Problem,
    *,
    budget: int | None,
    solver: str = "highs",
    time_limit_s: float = 30.0,
    mip_gap: float = 0.0,
    minimize_memory: bool = False,
    log: SolveLog | None = None,
    max_nodes: int | None = None,
    time_cap_s: float | None = None,
) -> Solution:
    """Least recompute time under the limits; ``minimize_memory`` instead finds the least kept bytes.
    ``log`` counts the solve and its time (``Solution.solve_s``). ``max_nodes``: stop the branch and
    bound after this many nodes with the best plan found ("feasible", with its gap), a limit that,
    unlike time, gives the same plan on every machine. ``time_cap_s``: a limit on the recompute and
    saving time (the objective's time terms), for the least bytes within a time. Within a planning
    that keeps its solves (:mod:`solutions`), the answer an earlier process gave the same model is
    read instead of solving (``solve_s`` is then the read's)."""
    start = time.perf_counter()
    limits = (time_limit_s, mip_gap, max_nodes)
    # the prices are read here, not only through the code's hash: a caller may change them (the tests
    # that pay for every approximation), and an answer found under other prices is another model's
    prices = (APPROXIMATION_PRICE, OFFLOAD_PRICE, US)
    key = solutions.model_key(problem, (budget, solver, limits, minimize_memory, time_cap_s, prices))
    kept = solutions.recall(key)
    if kept is not None:
        sol = Solution(set(kept["recompute"]), set(kept["keep"]), kept["status"], 0.0, *kept["figures"])
        sol.solve_s = time.perf_counter() - start
    else:
        sol = _solve(problem, budget, solver, limits, minimize_memory, time_cap_s)
        if not sol.status.startswith("error"):
            figures = [sol.gap, sol.n_vars, sol.n_constraints]
            answer = {"recompute": sorted(sol.recompute), "keep": sorted(sol.keep), "status": sol.status}
            solutions.keep(key, {**answer, "figures": figures})
    if log is not None:
        log.add(sol.solve_s, recalled=kept is not None)
    return sol


def plan_seconds(problem: Problem, saved: set[str], recomputed: set[str]) -> float:
    """The objective's time terms for a plan: its recompute, the saving (write + read) of the
    storages it keeps and the copy time its offloads do not hide, summed in the problem's order (a
    set's order varies with the string hash seed, and ranks that round a limit differently plan
    differently: ``parallel/agreement.py``)."""
    storages = {problem.values[n].storage for n in saved}
    return (
        problem.recompute_seconds(recomputed)
        + sum(t for s, t in problem.save_s.items() if s in storages)
        + problem.offload_figures(saved, recomputed)["exposed_s"]
    )


def _solve(
    problem: Problem,
    budget,
    solver: str,
    limits: tuple,
    minimize_memory: bool,
    time_cap_s: float | None = None,
) -> Solution:
    start = time.perf_counter()
    m = _Model(problem)
    m.add_availability()
    m.add_dependencies()
    m.add_storages()
    m.add_user_tags()
    m.add_sites()
    m.add_offload()
    if budget is not None:
        m.add_budget(budget)
    if time_cap_s is not None:
        m.lp += m.time_expr() <= US * time_cap_s, "time_cap"
    # under a time cap the fewest bytes still honour the user's PREFER tags first (a soft tag must not
    # be broken for bytes no budget asked for)
    m.set_objective(minimize_memory=minimize_memory, preferences_first=time_cap_s is not None)
    if not m.s and not m.r:  # nothing the backward reads from the forward: nothing to decide
        return Solution(set(), set(), "optimal", time.perf_counter() - start, 0.0)
    status, gap = _run(m.lp, solver, *limits)
    if status.startswith("error") and solver == "highs":
        # HiGHS 1.x answers "Solve error" on some small infeasible models (found by the brute-force
        # property test): ask CBC before calling it a solver failure
        status, gap = _run(m.lp, "cbc", *limits)
    ok = status in ("optimal", "feasible")
    return Solution(
        (m.chosen(m.r) - m.chosen(m.s)) | m.chosen(m.a) | {offload_choice(n) for n in m.chosen(m.o)}
        if ok
        else set(),
        m.chosen(m.s) if ok else set(),
        status,
        time.perf_counter() - start,
        gap,
        m.lp.numVariables(),
        m.lp.numConstraints(),
    )


class _Model:
    def __init__(self, problem: Problem):
        self.p = problem
        self.lp = pulp.LpProblem("recompile_opt", pulp.LpMinimize)
        vals = problem.values.values()
        binary = functools.partial(self.lp.add_variable, lowBound=0, upBound=1, cat="Integer")
        self.s = {v.name: binary(f"s_{i}") for i, v in enumerate(vals) if v.can_save}
        self.r = {v.name: binary(f"r_{i}") for i, v in enumerate(vals) if v.can_recompute}
        self.z = {s: binary(f"z_{i}") for i, (s, b) in enumerate(problem.storage_bytes.items()) if b > 0}
        self.a = {site.choice: binary(f"a_{i}") for i, site in enumerate(problem.sites)}
        offloadable = set(problem.offloadable())
        self.o = {
            n: binary(f"o_{i}") for i, n in enumerate(problem.values) if n in offloadable and n in self.s
        }
        exposed = functools.partial(self.lp.add_variable, lowBound=0, cat="Continuous")
        self.x = [exposed("x_down"), exposed("x_up")] if self.o else []
        self.penalties = []
        self._rows = itertools.count()

    def row(self, family: str) -> str:
        return f"{family}_{next(self._rows)}"

    def avail(self, name: str):
        return self.s.get(name, 0) + self.r.get(name, 0)

    def add_availability(self):
        for v in self.p.values.values():
            if v.needed:
                self.lp += self.avail(v.name) >= 1, self.row("need")

    def add_dependencies(self):
        for v in self.p.values.values():
            if v.name not in self.r:
                continue
            for u in v.inputs:
                self.lp += self.r[v.name] <= self.avail(u), self.row("dep")
            for u in v.recompute_with:
                self.lp += self.r[v.name] <= self.r.get(u, 0), self.row("with")

    def add_storages(self):
        for v in self.p.values.values():
            if v.name in self.s and v.storage in self.z:
                self.lp += self.z[v.storage] >= self.s[v.name], self.row("sto")

    def add_sites(self):
        for site in self.p.sites:
            a = self.a[site.choice]
            for name in site.exact:
                self.lp += self.avail(name) >= 1 - a, self.row("exact")
            for name in site.approx:
                self.lp += self.avail(name) >= a, self.row("approx")
            if site.fixed is not None:
                self.lp += a == int(site.fixed), self.row("fixed")

    def add_offload(self):
        if not self.o:
            return
        link, p = self.p.host_bytes_per_s, self.p
        views: dict[str, list[str]] = {}
        for u, v in p.values.items():
            if v.storage in self.o and u != v.storage and u in self.s:
                views.setdefault(v.storage, []).append(u)
        for n, o in self.o.items():
            self.lp += o <= self.s[n], self.row("off")
            for u in views.get(n, ()):  # a kept view of its buffer holds the buffer on the device
                self.lp += o + self.s[u] <= 1, self.row("offview")
            if p.values[n].tag == "must_cpu_offload":
                self.lp += o == 1, self.row("tag")
            elif p.values[n].tag == "prefer_cpu_offload":
                self.penalties.append(1 - o)
        for d, x in enumerate(self.x):  # the window rows of each direction, in µs
            copies = {n: p.copies_of(n, d) for n in self.o}  # a block template: one per block
            for t in sorted({w for cs in copies.values() for w, _ in cs}):
                moved = pulp.lpSum(
                    US * sum(b for w, b in copies[n] if w <= t) / link * o
                    for n, o in self.o.items()
                    if any(w <= t for w, _ in copies[n])
                )
                self.lp += moved - x <= US * t, self.row("win")

    def kept_bytes_expr(self):
        rng = [
            v.copies * self.r[v.name]
            for v in self.p.values.values()
            if v.random and v.in_forward and v.name in self.r
        ]
        return (
            pulp.lpSum(self.p.storage_bytes[s] * z for s, z in self.z.items())
            - pulp.lpSum(self.p.storage_bytes[n] * o for n, o in self.o.items())
            + self.p.rng_state_bytes * pulp.lpSum(rng)
        )

    def add_budget(self, budget: int):
        self.lp += self.kept_bytes_expr() <= budget, "budget"

    def add_user_tags(self):
        for v in self.p.values.values():
            # an offload tag where offload is not offered (a CPU device, the value a view): kept instead
            kept_tag = v.tag == "must_save" or (v.tag == "must_cpu_offload" and v.name not in self.o)
            prefer_kept = v.tag == "prefer_save" or (v.tag == "prefer_cpu_offload" and v.name not in self.o)
            if kept_tag and v.name in self.r:
                self.lp += self.r[v.name] == 0, self.row("tag")
            elif v.tag == "must_recompute" and v.name in self.s and v.can_recompute:
                self.lp += self.s[v.name] == 0, self.row("tag")
            elif prefer_kept and v.name in self.r:
                self.penalties.append(self.r[v.name])
            elif v.tag == "prefer_recompute" and v.name in self.s and v.can_recompute:
                self.penalties.append(self.s[v.name])

    def time_expr(self):
        """Recompute, saving and exposed copy time, in µs (x_d is in µs: see add_offload)."""
        return (
            pulp.lpSum(
                US * self.p.values[n].recompute_s * r
                for n, r in self.r.items()
                if self.p.values[n].in_forward
            )
            + pulp.lpSum(US * self.p.save_s[s] * z for s, z in self.z.items())
            + pulp.lpSum(self.x)
        )

    def set_objective(self, *, minimize_memory: bool, preferences_first: bool = False):
        us = US
        time_cost = self.time_expr()
        copies = 2 * sum(self.p.storage_bytes[n] for n in self.o) / self.p.host_bytes_per_s if self.o else 0.0
        total_time = (
            us * (sum(v.recompute_s for v in self.p.values.values()) + sum(self.p.save_s.values()) + copies)
            + 1.0
        )
        # the tie-break's byte scale; bwd_byte_steps keeps it as it was when peak rows existed (why:
        # passes/joint_graph._bwd_live_bytes)
        total_bytes = sum(self.p.storage_bytes.values()) + self.p.bwd_byte_steps + 1
        pref = (total_time + 1.0) * pulp.lpSum(self.penalties)
        by_site = {site.choice: site for site in self.p.sites}
        approx = pulp.lpSum((us * by_site[c].cost_s + APPROXIMATION_PRICE) * a for c, a in self.a.items())
        if minimize_memory:  # the caller re-solves under the bytes found, for the least time
            broken = 2.0 * pulp.lpSum(self.penalties) if preferences_first else 0
            self.lp += broken + self.kept_bytes_expr() * (1.0 / total_bytes)
        else:
            offloads = OFFLOAD_PRICE * pulp.lpSum(self.o.values())
            self.lp += time_cost + pref + approx + offloads + 1e-3 * self.kept_bytes_expr() / total_bytes

    @staticmethod
    def chosen(variables: dict) -> set[str]:
        return {n for n, x in variables.items() if (x.varValue or 0) > 0.5}


_SOLVER_THREADS: tuple[int, ThreadPoolExecutor] | None = None  # (pid, pool)
_SOLVER_THREADS_LOCK = threading.Lock()  # the search's first solves ask for the pool at once


def _solver_threads() -> ThreadPoolExecutor:
    """The process's long-lived threads on which every HiGHS solve runs.

    Why: HiGHS builds a task scheduler, with worker threads of its own, for each thread that first
    solves on it, and shuts it down when that thread exits; a thread that exits soon after its solve
    can deadlock that shutdown (HiGHS PR #1886: "running HiGHS in a temporary thread ... will randomly
    deadlock", C++ too). The planning runs on a fresh thread per compile and the least-peak search on a
    pool per search, so without these, every compile ended threads that had solved. A forked child gets
    a pool of its own (the parent's threads are not in it)."""
    global _SOLVER_THREADS
    with _SOLVER_THREADS_LOCK:
        if _SOLVER_THREADS is None or _SOLVER_THREADS[0] != os.getpid():
            pool = ThreadPoolExecutor(ILP_THREADS, thread_name_prefix="recompile_opt-highs")
            _SOLVER_THREADS = (os.getpid(), pool)
        return _SOLVER_THREADS[1]


def _run(
    lp: pulp.LpProblem, solver: str, time_limit_s: float, mip_gap: float, max_nodes: int | None
) -> tuple[str, float | None]:
    """Status and gap; "optimal" with gap g means proven within a relative gap g (the tolerance).
    CBC's files go to a folder of the solve's own, removed after it: PuLP removes them only when
    CBC wrote a solution, and the first try below left an .mps and an empty .sol in /tmp."""
    folder = (
        tempfile.TemporaryDirectory(prefix="recompile_opt-cbc-")
        if solver == "cbc"
        else contextlib.nullcontext()
    )
    # CBC runs as a process of its own; HiGHS in this one, on its long-lived threads
    run = (
        lp.solve if solver == "cbc" else lambda command: _solver_threads().submit(lp.solve, command).result()
    )
    with folder as files:
        try:
            run(_command(solver, time_limit_s, mip_gap, max_nodes, presolve=False, files=files))
        except pulp.PulpSolverError:
            # CBC without preprocessing can stop at an early infeasibility proof without writing a
            # solution file; with preprocessing it reports the status properly.
            try:
                run(_command(solver, time_limit_s, mip_gap, max_nodes, presolve=True, files=files))
            except pulp.PulpSolverError as e:
                return f"error: {e}", None
    if lp.status == pulp.LpStatusInfeasible:
        return "infeasible", None
    if lp.sol_status == pulp.LpSolutionOptimal:
        return "optimal", mip_gap
    if lp.sol_status == pulp.LpSolutionIntegerFeasible:
        return "feasible", _reported_gap(lp, solver)
    return f"error: solver status {pulp.LpStatus.get(lp.status, lp.status)}", None


def _reported_gap(lp: pulp.LpProblem, solver: str) -> float | None:
    """The relative gap at which a time-limited solve stopped: HiGHS reports it; PuLP does not pass
    CBC's bound on, so there it is unknown (None)."""
    model = getattr(lp, "solverModel", None)
    if solver != "highs" or model is None:
        return None
    try:
        return float(model.getInfo().mip_gap)
    except Exception:  # noqa: BLE001 - an older highspy without the field: say unknown
        return None


def _command(
    solver: str,
    time_limit_s: float,
    mip_gap: float,
    max_nodes: int | None,
    *,
    presolve: bool,
    files: str | None,
):
    if solver == "highs":
        nodes = {"mip_max_nodes": max_nodes} if max_nodes else {}
        return _HiGHS(msg=False, timeLimit=time_limit_s, gapRel=mip_gap, **nodes)
    with warnings.catch_warnings():  # PuLP 3 deprecates its bundled CBC in favour of pulp[cbc]
        warnings.simplefilter("ignore", DeprecationWarning)
        # CBC's preprocessing can return a slightly worse plan labelled optimal ("postprocessing
        # changed objective ... possible tolerance issue"); the problems are small, so turn it off.
        cbc = pulp.PULP_CBC_CMD(
            msg=False,
            timeLimit=time_limit_s,
            gapRel=mip_gap,
            maxNodes=max_nodes,
            options=[] if presolve else ["preprocess off"],
        )
    cbc.tmpDir = files  # where it writes the model and reads the solution
    return cbc


class _HiGHS(pulp.HiGHS):
    """PuLP's HiGHS interface, which (PuLP 3.3) has no status for a stop at the node limit (HiGHS's
    ``kSolutionLimit``) and raises KeyError after it has read the solution: read it as PuLP reads a
    stop at the time limit (the best plan found, if any). Its model is handed over in batches."""

    def buildSolverModel(self, lp):
        """PuLP's model, the same columns and rows in the same order, in three calls instead of one
        per column and one per row. Why: those calls hold the GIL, and the least-peak search's ~20
        solves run beside its simulations: on the benchmark's GPT (766 columns, 675 rows) PuLP's
        loop took 1.5 s of a 7.8 s planning."""
        import highspy
        import numpy as np

        inf, sign = highspy.kHighsInf, -1 if lp.sense == pulp.LpMaximize else 1
        variables = lp.variables()
        for i, var in enumerate(variables):
            var.index = i
        bound = [
            (-inf if v.lowBound is None else v.lowBound, inf if v.upBound is None else v.upBound)
            for v in variables
        ]
        model, empty = lp.solverModel, np.array([], dtype=np.int32)
        model.addCols(
            len(variables),
            np.array([sign * lp.objective.get(v, 0.0) for v in variables], dtype=np.float64),
            np.array([b[0] for b in bound], dtype=np.float64),
            np.array([b[1] for b in bound], dtype=np.float64),
            0,
            empty,
            empty,
            np.array([], dtype=np.float64),
        )
        if self.mip:
            integer = np.array([v.index for v in variables if v.cat == pulp.LpInteger], dtype=np.int32)
            model.changeColsIntegrality(
                len(integer),
                integer,
                np.full(len(integer), int(highspy.HighsVarType.kInteger), dtype=np.uint8),
            )
        starts, indices, values, lower, upper = [], [], [], [], []
        for i, constraint in enumerate(lp._constraints.values()):
            constraint.index = i
            starts.append(len(indices))
            for var, coefficient in constraint.items():
                if coefficient != 0:
                    indices.append(var.index)
                    values.append(coefficient)
            lb, ub = constraint.getLb(), constraint.getUb()
            lower.append(-inf if lb is None else lb)
            upper.append(inf if ub is None else ub)
        model.addRows(
            len(starts),
            np.array(lower, dtype=np.float64),
            np.array(upper, dtype=np.float64),
            len(indices),
            np.array(starts, dtype=np.int32),
            np.array(indices, dtype=np.int32),
            np.array(values, dtype=np.float64),
        )

    def findSolutionValues(self, lp):
        try:
            return super().findSolutionValues(lp)
        except KeyError:
            model = lp.solverModel
            status = model.getModelStatus()
            if status != type(status).kSolutionLimit:  # highspy's HighsModelStatus
                raise
            if model.getInfo().primal_solution_status != 2:  # no feasible point found
                return pulp.LpStatusNotSolved, pulp.LpSolutionNoSolutionFound
            return pulp.LpStatusOptimal, pulp.LpSolutionIntegerFeasible
