"""The memory/recompute frontier: activation bytes kept for backward against recompute cost, over a sweep of
budgets, with the fixed policies and PyTorch's own knapsack on the same axes (``recompile-opt frontier``).

Points (all estimated by our cost model, so they are comparable; measured figures only when asked):

* **ilp** — our ILP at each fraction of ``budgets`` (0.0 = the least-peak plan, 1.0 = save-all; see
  docs/design.md, "Budgets, and the least-peak search"). Fractions that give the same plan (same kept and
  recomputed values in every graph) make one point. With 0.0 swept, a few more ILP points under byte budgets
  between the least any plan can keep and the 0.0 plan's bytes (``BELOW_FLOOR``): they keep less at a higher
  peak, and show our curve where PyTorch's knapsack at small budgets lands.
* **policy** — ``save-all``, ``full`` and ``megatron-selective``, run through the same pipeline.
* **pytorch** — torch's ``min_cut_rematerialization_partition`` with
  ``torch._functorch.config.activation_memory_budget = b`` (its knapsack, default solver ``dp``; at 1.0
  it is plain ``torch.compile``'s partition). It runs on the very joint graph our partitioner sees
  (after Inductor's decompositions and joint passes). Its backward graph's inputs are the forward values
  it saves and are named like them; the forward nodes it recomputes appear in its backward under their
  joint-graph names. Both map by name onto our :class:`~recompile_opt.planner.problem.Problem`, which then
  gives kept bytes (``Problem.kept_bytes``), recompute FLOPs and time; the peak is our simulation of torch's
  own forward and backward graphs. Every PyTorch point is checked three ways: every backward input is a known
  forward value; the kept bytes equal the bytes of the distinct non-parameter storages of the backward's
  inputs, read from their fake tensors without the Problem; and every value our Problem says the backward
  reads is kept or recomputed, or was merged away by torch's CSE. On the demo GPT and the test models all
  three hold exactly, and trained, the bytes saved for backward (saved_tensors_hooks) equal the mapped kept
  bytes to the byte; a point that fails a check says so in its note (and warns), and ``measure=True`` gives
  measured figures for it regardless.

One capture serves the whole sweep: Dynamo and AOTAutograd run once, and each joint graph is planned
for every point. A fraction f is planned as :func:`recompile_opt.plan` would (``make_plan`` after the
same capture), except that the least-peak search behind 0.0 runs once: f becomes the byte budget
``floor + f * (save_all - floor)`` that the planner itself derives from f, with ``floor`` the 0.0 plan's
kept bytes; ``tests/test_frontier.py`` checks the plans equal ``recompile_opt.plan``'s. A model that
Dynamo splits into several graphs gets each fraction per graph (as a float budget does) and its figures
are summed over the graphs (summed predicted peaks over-estimate a step whose graphs peak apart).

**The knee** is the point of the fraction sweep (ILP points with a fraction, sorted by kept bytes)
farthest *below* the chord between the sweep's two ends, with kept bytes and estimated recompute time
each normalised to [0, 1] over the sweep: the point of the convex frontier where giving up more memory
starts to cost recompute fast. Fewer than three distinct points, or none below the chord (a straight or
concave curve), give no knee.
"""

from __future__ import annotations

import copy
import dataclasses
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.fx as fx

from recompile_opt import _torch_internals as ti
from recompile_opt.api import _empty_outputs
from recompile_opt.compile_paths import compile_eager
from recompile_opt.costs.peak import predict_peak
from recompile_opt.options import Options, parse_options
from recompile_opt.partitioner import MEMORY
from recompile_opt.passes.joint_graph import JointGraph
from recompile_opt.plan import Plan, fmt_bytes
from recompile_opt.planner.search import make_plan
from recompile_opt.planning import oracle_pooled, pools_dead_buffers, read_joint_graph, solves_kept

BUDGETS = tuple(round(0.05 * i, 2) for i in range(21))
POLICIES = ("save-all", "full", "megatron-selective")
PYTORCH_BUDGETS = (1.0, 0.5, 0.2, 0.05)
# With 0.0 swept, byte budgets below the least-peak plan's kept bytes: this far from the least possible
# kept bytes (0.0) to the least-peak plan's. They keep less at a higher peak (docs/design.md, "Budgets,
# and the least-peak search").
BELOW_FLOOR = (0.0, 0.25, 0.5, 0.75)
MiB = 2**20


@dataclass
class Point:
    label: str
    kind: str  # "ilp", "policy" or "pytorch"
    budgets: tuple = ()  # the fractions that give this point (ilp, pytorch)
    budget_bytes: int | None = None  # an ILP point below the least-peak plan: its byte budget
    kept_bytes: int = 0
    predicted_peak_bytes: int = 0
    recompute_flops: int = 0
    recompute_s: float = 0.0  # estimated
    step_s: float = 0.0  # estimated forward + backward without recompute
    measured_saved_bytes: int | None = None
    measured_peak_bytes: int | None = None
    measured_step_s: float | None = None
    notes: list = field(default_factory=list)

    @property
    def recompute_share(self) -> float:
        return self.recompute_s / self.step_s if self.step_s else 0.0


@dataclass
class _Figures:
    """One strategy on one graph."""

    key: tuple  # (kept names, recomputed names): equal keys are equal plans
    kept: int
    peak: int
    flops: int
    recompute_s: float
    step_s: float
    note: str = ""
    budget_bytes: int | None = None


def sweep(
    model: torch.nn.Module,
    inputs,
    budgets=BUDGETS,
    *,
    policies=POLICIES,
    pytorch_budgets=PYTORCH_BUDGETS,
    measure: bool = False,
    compiler: str = "eager",
    steps: int = 3,
    **options,
) -> list[Point]:
    """Estimated frontier points of ``model`` on ``inputs`` (``options``: recompile_opt options such as
    ``solver`` or ``roofline``). ``measure=True`` also trains every strategy ``steps`` steps, compiled
    with ``compiler``, and fills the measured fields (:func:`measure_points`)."""
    module = getattr(model, "_orig_mod", model)
    inputs = tuple(inputs) if isinstance(inputs, (tuple, list)) else (inputs,)
    part = FrontierPartitioner(
        parse_options({**options, "compiler": "eager"}), sorted(set(budgets)), policies, pytorch_budgets
    )

    def capture(gm, graph_inputs):  # as recompile_opt.plan: the graphs Inductor would see, no step run
        compile_eager(gm, graph_inputs, part, aten_random=False)
        return _empty_outputs(gm)

    limits = {"recompile_limit": 10**6, "accumulated_recompile_limit": 10**6}
    with torch.enable_grad(), ti.dynamo_config.patch(limits):
        torch.compile(module, backend=capture, dynamic=False)(*inputs)
    if not part.graphs:
        raise RuntimeError("recompile_opt.frontier: no graph with a backward was captured")
    points = _combine(part.graphs)
    if measure:
        measure_points(module, inputs, points, compiler=compiler, steps=steps, options=options)
    return points


class FrontierPartitioner:
    """For each joint graph: our plan for every point, and torch's partition at each knapsack budget."""

    def __init__(self, options: Options, budgets, policies, pytorch_budgets):
        self.options, self.budgets, self.policies = options, budgets, policies
        self.pytorch_budgets = pytorch_budgets
        self.graphs: list[dict[tuple, _Figures]] = []  # per graph: (kind, fraction or policy) -> figures

    def __call__(self, gm: fx.GraphModule, joint_inputs, **kwargs):
        pristine = _copy(gm.graph)  # our partitions tag random ops; torch's rewrite the graph
        joint = read_joint_graph(gm, kwargs, self.options, MEMORY)  # as RecompilePartitioner
        jg, problem = joint.graph, joint.problem
        oracles = {pooled: oracle_pooled(joint, pooled, MEMORY) for pooled in (True, False)}
        oracles[True].range_twin = oracles[False]  # a fraction's range: the least-peak plan's oracle
        nfo, static = joint.num_fwd_outputs, kwargs.get("static_lifetime_input_indices")  # torch's own

        def ours(**changes) -> tuple[_Figures, Plan]:
            opts = dataclasses.replace(self.options, **changes)
            pooled = pools_dead_buffers(opts)  # as the plan compiles: the pool off at the peak goals
            oracle = oracles[pooled]
            with ti.buffer_pool(pooled), solves_kept():
                plan = make_plan(problem, opts, graph=joint.gid, simulate=oracle, memory=MEMORY)
            saved = {e.name for e in plan.saved if e.op != "rng_state"}  # as RecompilePartitioner
            figures = _Figures(
                (frozenset(saved), frozenset(plan.recomputed_names())),
                plan.saved_bytes,
                oracle(saved, plan.recomputed_names()),
                plan.recompute_flops,
                plan.recompute_s,
                plan.step_s,
            )
            return figures, plan

        out = self._ilp(ours)
        for policy in self.policies:
            out["policy", policy], _ = ours(policy=policy, memory_budget=None)
        for b in self.pytorch_budgets:
            out["pytorch", b] = _torch_figures(
                fx.GraphModule(gm, _copy(pristine)),
                joint_inputs,
                jg,
                problem,
                b,
                num_fwd_outputs=nfo,
                static=static,
            )
            if b == 1.0 and not out["pytorch", b].note:
                out["pytorch", b].note = "plain torch.compile"
        self.graphs.append(out)
        return _torch_partition(gm, joint_inputs, num_fwd_outputs=nfo, static_lifetime_input_indices=static)

    def _ilp(self, ours) -> dict[tuple, _Figures]:
        """The fraction sweep, and with 0.0 in it, byte budgets below the least-peak plan."""
        out: dict[tuple, _Figures] = {}
        floor = baseline = least = None
        for f in self.budgets:  # sorted: 0.0, when swept, comes first and fixes the floor
            if floor is None or f == 1.0:
                out["ilp", f], plan = ours(policy="auto", memory_budget=float(f))
                if f == 0.0:
                    floor, baseline, least = plan.budget_bytes, plan.baseline_bytes, plan.min_bytes
                    out["ilp", f].note = "least-peak plan"
            else:  # the byte budget make_plan derives from f, without repeating the least-peak search
                out["ilp", f], _ = ours(policy="auto", memory_budget=int(floor + f * (baseline - floor)))
        if floor is not None and least is not None and least < floor:
            for g in BELOW_FLOOR:
                level = int(least + g * (floor - least))
                out["bytes", g], _ = ours(policy="auto", memory_budget=level)
                out["bytes", g].budget_bytes = level
        return out


def _copy(graph: fx.Graph) -> fx.Graph:
    """A copy of a joint graph (node metadata shallow-copied: the same fake tensors)."""
    with warnings.catch_warnings():  # torch's own pytree specs in the metadata warn when copied (2.13)
        warnings.simplefilter("ignore", FutureWarning)
        return copy.deepcopy(graph)


def _torch_partition(gm: fx.GraphModule, joint_inputs, **kwargs):
    """Inductor's default partitioner: min-cut with the knapsack under ``activation_memory_budget``."""
    return ti.min_cut_rematerialization_partition(gm, joint_inputs, compiler="inductor", **kwargs)


def _torch_figures(
    gm: fx.GraphModule, joint_inputs, jg: JointGraph, problem, budget: float, *, num_fwd_outputs: int, static
) -> _Figures:
    """Torch's partition of ``gm`` (a copy of the joint graph) at ``budget``, in our Problem's terms."""
    with ti.functorch_config.patch(activation_memory_budget=budget):
        fw, bw = _torch_partition(
            gm, joint_inputs, num_fwd_outputs=num_fwd_outputs, static_lifetime_input_indices=static
        )
    inputs = [
        n for n in bw.graph.find_nodes(op="placeholder") if not ti._is_tangent(n) and not ti.is_sym_node(n)
    ]
    saved = {n.name for n in inputs}
    recomputed = {n.name for n in bw.graph.nodes if n.op == "call_function" and n.name in problem.values}
    known = saved & set(problem.values)
    kept = problem.kept_bytes(known, recomputed)
    # the checks (module docstring): names, bytes read independently of the Problem, coverage
    problems = []
    if saved - known:
        problems.append(f"backward inputs unknown to the Problem: {sorted(saved - known)}")
    direct = _input_storage_bytes(inputs, jg)
    if direct != kept:
        problems.append(f"kept bytes {kept} != {direct} bytes of the backward's non-parameter inputs")
    after_cse = {n.name for n in gm.graph.nodes}  # torch's partitioner CSEs the joint graph in place
    uncovered = [
        n
        for n, v in problem.values.items()
        if v.needed and n not in known and n not in recomputed and n in after_cse
    ]
    if uncovered:
        problems.append(f"values the backward reads, neither kept nor recomputed: {uncovered[:5]}")
    note = ""
    if problems:
        note = "mapping check failed: " + "; ".join(problems)
        warnings.warn(f"recompile_opt.frontier: PyTorch knapsack at {budget:g}: {note}")
    flops = sum(
        problem.values[n].flops for n in recomputed if n in problem.values and problem.values[n].in_forward
    )
    return _Figures(
        (frozenset(saved), frozenset(recomputed)),
        kept,
        predict_peak(fw, bw),
        flops,
        problem.recompute_seconds(recomputed),
        problem.step_s,
        note,
    )


def _input_storage_bytes(inputs: list[fx.Node], jg: JointGraph) -> int:
    """Bytes of the distinct storages of ``inputs``' fake tensors, parameters and constants excluded."""
    free = [
        n.meta["val"]
        for n in jg.fwd_nodes
        if (n in jg.static_primals or n.op == "get_attr") and isinstance(n.meta.get("val"), torch.Tensor)
    ]
    free_ids = {id(t.untyped_storage()) for t in free}
    storages = {}
    for n in inputs:
        val = n.meta.get("val")
        if isinstance(val, torch.Tensor) and id(val.untyped_storage()) not in free_ids:
            storages[id(val.untyped_storage())] = val.untyped_storage()
    return sum(int(s.nbytes()) for s in storages.values())


def _combine(graphs: list[dict[tuple, _Figures]]) -> list[Point]:
    """Sum each strategy over the graphs; ILP budgets (and knapsack budgets) with equal plans merge."""
    points: dict[tuple, Point] = {}
    for kind, what in graphs[0]:
        figs = [g[kind, what] for g in graphs]
        group = "ilp" if kind == "bytes" else kind
        key = (kind, what) if kind == "policy" else (group, tuple(f.key for f in figs))
        if key in points:
            if kind == "bytes":
                points[key].notes.append(f"also byte budget {fmt_bytes(sum(f.budget_bytes for f in figs))}")
            else:
                points[key].budgets += (what,)
            continue
        points[key] = Point(
            label=what,
            kind=group,
            budgets=(what,) if kind in ("ilp", "pytorch") else (),
            budget_bytes=sum(f.budget_bytes for f in figs) if kind == "bytes" else None,
            kept_bytes=sum(f.kept for f in figs),
            predicted_peak_bytes=sum(f.peak for f in figs),
            recompute_flops=sum(f.flops for f in figs),
            recompute_s=sum(f.recompute_s for f in figs),
            step_s=sum(f.step_s for f in figs),
            notes=sorted({f.note for f in figs if f.note}),
        )
    for p in points.values():
        if p.budget_bytes is not None:
            p.label = f"ilp {fmt_bytes(p.budget_bytes)}"
            p.notes.insert(0, "byte budget below the least-peak plan")
        elif p.kind == "ilp":  # fractions come sorted: a run of equal plans is a range
            p.label = f"ilp {p.budgets[0]:g}" + (f"-{p.budgets[-1]:g}" if len(p.budgets) > 1 else "")
        elif p.budgets:
            p.label = "pytorch " + ",".join(f"{b:g}" for b in p.budgets)
    order = {"ilp": 0, "policy": 1, "pytorch": 2}
    return sorted(points.values(), key=lambda p: (order[p.kind], p.kept_bytes if p.kind == "ilp" else 0))


def knee(points: list[Point]) -> Point | None:
    """The ILP point farthest below the chord between the sweep's ends (normalised kept bytes and
    estimated recompute time); None for fewer than three points or no point below the chord."""
    ilp = sorted(_fractions(points), key=lambda p: (p.kept_bytes, -p.recompute_s))
    if len(ilp) < 3:
        return None
    xs, ys = [p.kept_bytes for p in ilp], [p.recompute_s for p in ilp]
    if max(xs) == min(xs) or max(ys) == min(ys):
        return None

    def norm(p: Point) -> tuple[float, float]:
        return (
            (p.kept_bytes - min(xs)) / (max(xs) - min(xs)),
            (p.recompute_s - min(ys)) / (max(ys) - min(ys)),
        )

    (ax, ay), (bx, by) = norm(ilp[0]), norm(ilp[-1])

    def below(p: Point) -> float:  # distance below the chord (positive: towards less of both)
        px, py = norm(p)
        return ((by - ay) * (px - ax) - (bx - ax) * (py - ay)) / ((bx - ax) ** 2 + (by - ay) ** 2) ** 0.5

    best = max(ilp[1:-1], key=below)
    return best if below(best) > 1e-9 else None


def measure_points(
    model: torch.nn.Module,
    inputs: tuple,
    points: list[Point],
    *,
    compiler: str = "eager",
    steps: int = 3,
    options: dict | None = None,
) -> None:
    """Train each point's strategy for a few steps and fill its measured fields: bytes saved for backward
    (saved_tensors_hooks, storages counted once, parameters excluded), the step's peak above its
    baseline (profiler allocation records) and the median step time (forward + backward + SGD).

    Ours compile with ``backend="recompile_opt"`` (the fraction itself, so compilation plans as usual);
    PyTorch's knapsack compiles with Inductor, or with ``compiler="eager"`` through the same
    decompositions and joint passes without code generation, under ``activation_memory_budget``.
    Saved bytes mean the same either way; peaks and times do not: without code generation nothing is
    fused, so every pointwise op holds a buffer and runs alone (on the demo GPT, peaks about 20 MiB
    above Inductor's and recompute-heavy steps several times slower). The predicted peaks assume
    Inductor's fusion: compare them with ``compiler="inductor"``."""
    import recompile_opt
    from recompile_opt.demo import _measure

    for p in points:
        torch._dynamo.reset()
        m = copy.deepcopy(model)
        budget = p.budgets[0] if p.kind == "pytorch" else 1.0
        patch = ti.functorch_config.patch(activation_memory_budget=budget)
        if p.kind == "pytorch":
            compiled = (
                torch.compile(m, backend="inductor")
                if compiler == "inductor"
                else torch.compile(m, backend=lambda gm, ex: compile_eager(gm, ex, _torch_partition))
            )
        else:
            opts = {**(options or {}), "compiler": compiler}
            opts.update(
                {"memory_budget": p.budgets[0] if p.budgets else p.budget_bytes}
                if p.kind == "ilp"
                else {"policy": p.label}
            )
            if p.budget_bytes is not None:  # a whole-model byte budget: learn the graphs, split it
                recompile_opt.plan(m, inputs, **opts)
            compiled = torch.compile(m, backend="recompile_opt", options=opts)
        with patch:
            r = _measure(p.label, m, compiled, inputs, steps)
        p.measured_saved_bytes, p.measured_peak_bytes, p.measured_step_s = r["saved"], r["peak"], r["step_s"]
    torch._dynamo.reset()


def table(points: list[Point]) -> str:
    """The points as a markdown table (measured columns when any point was measured)."""
    measured = any(p.measured_peak_bytes is not None for p in points)
    k = knee(points)
    head = [
        "point",
        "kind",
        "kept MiB",
        "pred. peak MiB",
        "recompute GFLOP",
        "est. recompute ms",
        "% of est. step",
    ]
    head += ["meas. saved MiB", "meas. peak MiB", "meas. step ms"] if measured else []
    rows = ["| " + " | ".join(head + ["notes"]) + " |", "|" + "---|" * (len(head) + 1)]
    for p in points:
        cells = [
            p.label,
            p.kind,
            f"{p.kept_bytes / MiB:.3f}",
            f"{p.predicted_peak_bytes / MiB:.3f}",
            f"{p.recompute_flops / 1e9:.3f}",
            f"{p.recompute_s * 1e3:.3f}",
            f"{100 * p.recompute_share:.1f}",
        ]
        if measured:
            cells += [
                _mib(p.measured_saved_bytes),
                _mib(p.measured_peak_bytes),
                "-" if p.measured_step_s is None else f"{p.measured_step_s * 1e3:.1f}",
            ]
        cells.append("; ".join((["knee"] if p is k else []) + list(p.notes)))
        rows.append("| " + " | ".join(cells) + " |")
    return "\n".join(rows)


def markdown(points: list[Point], *, title: str = "") -> str:
    """What ``recompile-opt frontier --md FILE`` writes: one provenance line (versions, machine, load,
    date: :func:`recompile_opt.provenance.header_line`), the model, then :func:`table`."""
    from recompile_opt.provenance import header_line

    what = f"{title}: " if title else ""
    return (
        f"{header_line()}\n\n{what}{len(points)} points; kept bytes, recompute and peaks estimated "
        f"by our cost model and simulator\n\n{table(points)}\n"
    )


def _mib(n: int | None) -> str:
    return "-" if n is None else f"{n / MiB:.3f}"


_MARKERS = {"save-all": "s", "full": "D", "megatron-selective": "^"}


def draw(points: list[Point], path_stem: str | Path, *, title: str = "") -> list[Path]:
    """Write ``<stem>.png`` and ``<stem>.svg``: kept MiB against estimated recompute (% of the estimated
    step), the knee marked; with measured figures, a second panel of measured peak against step time."""
    try:
        from matplotlib.figure import Figure  # no pyplot: no global backend, no display needed
    except ImportError as e:
        raise ImportError(
            "recompile_opt.frontier.draw needs matplotlib: pip install recompile_opt[plots]"
        ) from e
    measured = [p for p in points if p.measured_peak_bytes is not None]
    fig = Figure(figsize=(13 if measured else 7.5, 5.2), layout="constrained")
    axes = fig.subplots(1, 2 if measured else 1, squeeze=False)[0]
    _panel(axes[0], points, lambda p: p.kept_bytes / MiB, lambda p: 100 * p.recompute_share)
    axes[0].set(
        xlabel="activation memory kept for backward (MiB)",
        ylabel="estimated recompute (% of the estimated step)",
        title="estimated (our cost model)",
    )
    k = knee(points)
    if k is not None:
        axes[0].annotate(
            f"knee: {k.label}",
            xy=(k.kept_bytes / MiB, 100 * k.recompute_share),
            xytext=(25, 30),
            textcoords="offset points",
            fontsize=9,
            arrowprops={"arrowstyle": "->", "color": "k"},
        )
    if measured:
        _panel(
            axes[1],
            measured,
            lambda p: p.measured_peak_bytes / MiB,
            lambda p: p.measured_step_s * 1e3,
            lines=False,
        )
        axes[1].set(
            xlabel="measured step peak above baseline (MiB)",
            ylabel="measured step time (ms, median)",
            title="measured",
        )
    if title:
        fig.suptitle(title)
    stem = Path(path_stem)
    stem.parent.mkdir(parents=True, exist_ok=True)
    paths = [stem.with_name(stem.name + ".png"), stem.with_name(stem.name + ".svg")]
    for path in paths:
        fig.savefig(path, dpi=150)
    return paths


def _fractions(points: list[Point]) -> list[Point]:
    return [p for p in points if p.kind == "ilp" and p.budgets]


def _panel(ax, points: list[Point], x, y, *, lines: bool = True) -> None:
    """One panel; ``lines=False`` (measured figures, not ordered along x) draws markers only."""
    ilp = sorted(_fractions(points), key=lambda p: p.kept_bytes)
    below = sorted((p for p in points if p.budget_bytes is not None), key=lambda p: p.kept_bytes)
    solid, dotted, dashed = ("-o", ":o", "X--") if lines else ("o", "o", "X")
    if ilp:
        ax.plot(
            [x(p) for p in ilp],
            [y(p) for p in ilp],
            solid,
            color="C0",
            ms=5,
            label="recompile_opt ILP, memory_budget 0.0 ... 1.0",
        )
        step = max(1, round(len(ilp) / 6))  # label about six fractions
        for p in ilp[::step] + ([ilp[-1]] if (len(ilp) - 1) % step else []):
            ax.annotate(
                f"{p.budgets[0]:g}",
                (x(p), y(p)),
                xytext=(4, 5),
                textcoords="offset points",
                fontsize=7,
                color="C0",
            )
    if below:
        line = below + (ilp[:1] if lines else [])  # joined to the 0.0 point
        ax.plot(
            [x(p) for p in line],
            [y(p) for p in line],
            dotted,
            color="C0",
            ms=4,
            mfc="white",
            label="recompile_opt ILP, byte budgets below 0.0 (higher peak)",
        )
    for i, p in enumerate(p for p in points if p.kind == "policy"):
        ax.scatter(
            [x(p)],
            [y(p)],
            marker=_MARKERS.get(p.label, "o"),
            s=70,
            color=f"C{i + 1}",
            zorder=3,
            label=f"policy {p.label}",
        )
    torch_pts = sorted((p for p in points if p.kind == "pytorch"), key=lambda p: p.kept_bytes)
    if torch_pts:
        ax.plot(
            [x(p) for p in torch_pts],
            [y(p) for p in torch_pts],
            dashed,
            color="C3",
            ms=8,
            lw=1,
            label="PyTorch knapsack, activation_memory_budget",
        )
        for p in torch_pts:
            ax.annotate(
                f"{p.budgets[0]:g}",
                (x(p), y(p)),
                xytext=(5, -12),
                textcoords="offset points",
                fontsize=7,
                color="C3",
            )
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
