"""The plan of one compiled graph: plain data keyed by node name that prints, diffs and round-trips
through JSON. ``print(plan)`` reads like JAX's ``print_saved_residuals``: one line per kept or
recomputed value with its shape, op, module, source line, bytes and why.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, fields

# Actions a plan can take on a value: keep it on the device, recompute it, or offload it (kept on the
# host between forward and backward: an entry of ``Plan.saved``, as the backward reads it; its device bytes
# are 0). Chunks and approximations are described in lists of their own.
KEEP, RECOMPUTE, OFFLOAD = "keep", "recompute", "offload"


@dataclass
class PlanEntry:
    name: str
    op: str
    action: str
    reason: str  # ilp, policy, user, rng, collective, input, required
    shape: list = field(default_factory=list)
    dtype: str = ""
    bytes: int = 0  # bytes this entry adds to the kept total (0: a view of another kept storage, a param)
    flops: int = 0  # FLOPs of recomputing it (recomputed entries)
    recompute_s: float = 0.0
    module: str = ""
    source: str = ""


@dataclass(repr=False)  # the dataclass repr printed every entry: ~15 KB for a 2-layer GPT
class Plan:
    graph: str  # the compiled graph's id (hash of its joint graph)
    policy: str
    saved: list[PlanEntry]
    recomputed: list[PlanEntry]
    saved_bytes: int  # activation bytes kept for backward (the quantity the budget limits)
    baseline_bytes: int  # what save-all keeps
    min_bytes: int | None  # the least any plan can keep (None if not computed)
    budget_bytes: int | None
    peak_limit_bytes: int | None
    recompute_flops: int
    recompute_s: float  # estimated recompute time
    step_s: float  # estimated forward + backward time without recompute
    predicted_peak_bytes: int
    # the forward's outputs to the caller that the backward does not read (costs.peak.caller_outputs_bytes):
    # the predicted peak assumes the caller drops them before the backward
    outputs_bytes: int = 0
    # where the predicted peak lies and what is alive there, by kind (recompile_opt.costs.peak.peak_breakdown)
    peak_breakdown: dict = field(default_factory=dict)
    # the same, read off the walk of Inductor's code where the predicted peak is walked (what the
    # step holds there: recompile_opt.costs.inductor_peak.WalkedPeak)
    walked_breakdown: dict = field(default_factory=dict)
    # name, status, solve_s (the final solve), gap, n_vars, n_constraints; plan_s: all our planning for
    # the graph (cost model, every solve and simulation of the search, partition), when compiled;
    # solves / solves_s: every ILP solve of the planning and their summed time (on a pool: they
    # overlap), solves_recalled of them answered by an earlier process's (planner/solutions.py);
    # simulations / simulate_s: the plans partitioned and simulated for their peak; exact_peaks / exact_s:
    # the plans walked in Inductor's code, walked_in_forks of them by forks of this process (walk_pool)
    solver: dict = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    options: dict = field(default_factory=dict)
    # the step's collectives (tensor/sequence parallelism): name, op, shape, dtype, phase, bytes one rank
    # sends, regathered (a forward all-gather run again in the backward from the kept shard)
    collectives: list[dict] = field(default_factory=list)
    # mini-sequence chunking: region, kind (loss, loss_recompute, mlp, attention), chunks, tokens, width
    # (vocabulary, hidden, keys), recompute_flops (the region's recompute in the backward), a loss's body
    # ("fused" by Inductor or "aten"), peak_saved_bytes (against the unchunked plan, where the planner
    # chose the chunks; None where forced); attention's
    # dropout_mask_bytes (its bool keep-mask, drawn whole in the forward: kept, or replayed by the plan)
    chunks: list[dict] = field(default_factory=list)
    # approximate backward (option ``approximate``): one entry per value the backward reads approximately:
    # value, kind (few-bit, randomized), bits and activation or ratio, shape, dtype, bytes (the exact
    # value's), kept_as (the values read instead) and kept_as_bytes, choice (its name in the plan's
    # recomputed set), marker, cost_s (the time it adds), module, source
    approximated: list[dict] = field(default_factory=list)
    # values the backward recomputes twice: for the recomputation that reads them, and again for their
    # late readers (passes/partition.py, _recompute_twice); chosen by the least-peak search's walks
    recomputed_twice: list[str] = field(default_factory=list)
    # offload (option ``offload``, user CPU_OFFLOAD tags): one entry per offloaded value: value, op, shape,
    # dtype, bytes (moved each way), forward_window_s / backward_window_s (the compute its copies may
    # overlap: after its last forward use, before its first backward use), module, source
    offloaded: list[dict] = field(default_factory=list)
    # the step's copies: values, bytes_to_host, bytes_to_device, host_bytes_per_s, hidden_s and exposed_s
    # (the estimated copy time compute hides and the stall it adds; planner/problem.offload_figures)
    offload: dict = field(default_factory=dict)

    @property
    def recompute_share(self) -> float:
        """Recompute time as a share of the estimated step."""
        return self.recompute_s / self.step_s if self.step_s else 0.0

    def saved_names(self) -> set[str]:
        return {e.name for e in self.saved}

    def recomputed_names(self) -> set[str]:
        """The recomputed values, the choice of each approximated site (its name, as the planner's
        sets hold it: :class:`recompile_opt.planner.problem.Site`), of each offloaded value and of each
        value recomputed twice."""
        return (
            {e.name for e in self.recomputed}
            | {a["choice"] for a in self.approximated}
            | {"offload:" + e.name for e in self.saved if e.action == OFFLOAD}
            | {"twice:" + name for name in self.recomputed_twice}
        )

    # -- JSON -------------------------------------------------------------------------------------
    def to_dict(self) -> dict:
        d = asdict(self)
        d["recompute_share"] = self.recompute_share
        return d

    def to_json(self, indent: int | None = 2) -> str:
        return json.dumps(self.to_dict(), indent=indent)

    @classmethod
    def from_json(cls, text: str) -> "Plan":
        d = json.loads(text)
        d.pop("recompute_share", None)
        names = {f.name for f in fields(cls)}
        d = {k: v for k, v in d.items() if k in names}
        d["saved"] = [PlanEntry(**e) for e in d["saved"]]
        d["recomputed"] = [PlanEntry(**e) for e in d["recomputed"]]
        return cls(**d)

    # -- text -------------------------------------------------------------------------------------
    def summary(self) -> str:
        budget = "none" if self.budget_bytes is None else fmt_bytes(self.budget_bytes)
        gap = self.solver.get("gap")
        lines = [
            f"recompile_opt plan  graph={self.graph}  policy={self.policy}  budget={budget}",
            f"  kept for backward : {fmt_bytes(self.saved_bytes)} of {fmt_bytes(self.baseline_bytes)} "
            f"save-all ({_pct(self.saved_bytes, self.baseline_bytes)})"
            + (f", least possible {fmt_bytes(self.min_bytes)}" if self.min_bytes is not None else ""),
            f"  recompute         : {fmt_flops(self.recompute_flops)}, est. {self.recompute_s * 1e3:.3f} ms "
            f"= {100 * self.recompute_share:.1f}% of the est. step ({self.step_s * 1e3:.3f} ms)",
            (
                "  predicted peak    : not simulated (planned without its graphs)"
                if not self.predicted_peak_bytes
                else f"  predicted peak    : {fmt_bytes(self.predicted_peak_bytes)}"
                " above the pre-step baseline"
            )
            + (
                f" (walked in Inductor's generated code; the kernel model below says "
                f"{fmt_bytes(self.peak_breakdown.get('total', 0))})"
                if self.solver.get("peak_from") == "inductor-code"
                else " (the kernel model's estimate, not walked in Inductor's code: "
                f"{self.solver['unwalked']})"
                if self.solver.get("unwalked")
                else ""
            ),
            *(
                [
                    f"  outputs held      : the peak assumes the caller drops the forward's outputs "
                    f"but the loss ({fmt_bytes(self.outputs_bytes)}) before backward; holding them adds "
                    "up to that"
                ]
                if self.outputs_bytes
                else []
            ),
            *self._peak_lines(),
            *self._communication_lines(),
            *self._chunk_lines(),
            *(
                [
                    f"  recomputed twice  : {', '.join(self.recomputed_twice)} (for the recomputation that "
                    "reads it, and again for its readers after the longest stretch without one)"
                ]
                if self.recomputed_twice
                else []
            ),
            *self._approximation_lines(),
            *self._offload_lines(),
            f"  solver            : {self.solver.get('name', '-')} {self.solver.get('status', '-')}"
            f" in {self.solver.get('solve_s', 0.0):.2f} s"
            + (f", gap <= {gap:.2%}" if isinstance(gap, float) and gap > 0 else "")
            + f" ({self.solver.get('n_vars', 0)} vars, {self.solver.get('n_constraints', 0)} constraints)"
            + (f"; planning took {self.solver['plan_s']:.2f} s in all" if "plan_s" in self.solver else "")
            + self._search_line(),
        ]
        lines += [f"  note: {n}" for n in self.notes]
        return "\n".join(lines)

    def _search_line(self) -> str:
        """How the planning time divides: ILP solves and peak simulations (both run at once in the
        least-peak search, so their times overlap)."""
        s = self.solver
        if not s.get("solves") and not s.get("simulations"):
            return ""
        n, m = s.get("solves", 0), s.get("simulations", 0)
        forked = f" ({s['walked_in_forks']} in forks)" if s.get("walked_in_forks") else ""
        walks = (
            f", {s['exact_peaks']} walked in Inductor's code{forked}, {s.get('exact_s', 0.0):.2f} s"
            if s.get("exact_peaks")
            else ""
        )
        recalled = f" ({s['solves_recalled']} read from disk)" if s.get("solves_recalled") else ""
        choice = s.get("chunk_choice")  # the trials' own planning: the figures before count only the last
        tried = (
            (
                f"; choosing chunks: {choice['plannings']} plannings, "
                f"{choice['simulations']} plans simulated, {choice['walks']} walked"
            )
            if choice
            else ""
        )
        return (
            f" ({n} solve{'s' * (n != 1)}{recalled}, {s.get('solves_s', 0.0):.2f} s summed; "
            f"{m} plan{'s' * (m != 1)} simulated, {s.get('simulate_s', 0.0):.2f} s{walks}{tried})"
        )

    def communication_bytes(self) -> int:
        """Bytes one rank sends in a step: every collective once, and each re-gather a second time."""
        return sum(c["bytes"] * (2 if c.get("regathered") else 1) for c in self.collectives)

    def _communication_lines(self) -> list[str]:
        if not self.collectives:
            return []
        parts = []
        for phase in ("forward", "backward"):
            ops = [c for c in self.collectives if c["phase"] == phase]
            parts.append(f"{phase} {len(ops)} collectives {fmt_bytes(sum(c['bytes'] for c in ops))}")
        again = [c for c in self.collectives if c.get("regathered")]
        parts.append(f"{len(again)} re-gathered in the backward {fmt_bytes(sum(c['bytes'] for c in again))}")
        return [
            f"  communication     : {fmt_bytes(self.communication_bytes())} sent per rank per step ("
            + ", ".join(parts)
            + ")"
        ]

    def _chunk_lines(self) -> list[str]:
        """One line: the chunked regions by kind, with k and the recompute they cost, and whether the
        planner chose them (with the peak they save) or the option forced them."""
        if not self.chunks:
            return []
        parts = []
        for kind in ("loss", "loss_recompute", "mlp", "attention"):
            regions = [c for c in self.chunks if c["kind"] == kind]
            if regions:
                ks = "/".join(str(k) for k in sorted({c["chunks"] for c in regions}))
                flops = sum(c["recompute_flops"] for c in regions)
                fused = any(c.get("body") == "fused" for c in regions)
                parts.append(
                    f"{len(regions)} {kind} region{'s' * (len(regions) > 1)} in {ks} chunks"
                    + (f" (recompute {fmt_flops(flops)})" if flops else "")
                    + (", body fused by Inductor" if fused else "")
                )
        saved = self.chunks[0].get("peak_saved_bytes")
        how = (
            "forced by option 'chunks'"
            if saved is None
            else f"chosen by the planner: predicted peak {fmt_bytes(saved)} below the unchunked plan's"
        )
        return [f"  chunked           : {', '.join(parts)}; {how}"]

    def _approximation_lines(self) -> list[str]:
        """One line: how many values the backward reads approximately, and the bytes that saves."""
        if not self.approximated:
            return []
        parts = []
        for kind, what in (
            ("few-bit", "activation inputs as {}-bit codes"),
            ("randomized", "linear inputs as projections of ratio {}"),
        ):
            mine = [a for a in self.approximated if a["kind"] == kind]
            if mine:
                detail = "/".join(sorted({f"{a.get('bits', a.get('ratio'))}" for a in mine}))
                parts.append(f"{len(mine)} {what.format(detail)}")
        exact = sum(a["bytes"] for a in self.approximated)
        kept = sum(a["kept_as_bytes"] for a in self.approximated)
        cost = sum(a.get("cost_s", 0.0) for a in self.approximated)
        return [
            f"  approximated      : {', '.join(parts)}: {fmt_bytes(kept)} read by the backward instead of "
            f"{fmt_bytes(exact)} (est. +{cost * 1e3:.3f} ms)"
        ]

    def _offload_lines(self) -> list[str]:
        """One line: the values offloaded, the bytes moved each way and the copy time hidden and exposed."""
        o = self.offload
        if not o.get("values"):
            return []
        link = o.get("host_bytes_per_s", 0.0)
        return [
            f"  offloaded         : {o['values']} value{'s' * (o['values'] != 1)}, "
            f"{fmt_bytes(o['bytes_to_host'])} to the host and {fmt_bytes(o['bytes_to_device'])} back per "
            f"step over {link / 1e9:g} GB/s; copies est. {o['hidden_s'] * 1e3:.3f} ms hidden, "
            f"{o['exposed_s'] * 1e3:.3f} ms exposed"
        ]

    def _peak_lines(self) -> list[str]:
        """One line: the kernel at the peak and the bytes alive there by kind (which of them a lower
        budget could still remove: kept and recomputed; the rest is the floor any plan pays there),
        and always the share of dead buffers Inductor's pool holds there for a later allocation (where
        the pool is off, none: the line says so rather than leaving it out)."""
        bd = self.walked_breakdown or self.peak_breakdown
        if not bd.get("bytes"):
            return []
        alive = {kind: n for kind, n in bd["bytes"].items() if n and kind != "pooled"}
        kinds = ", ".join(f"{kind} {fmt_bytes(n)}" for kind, n in alive.items())
        total = bd.get("total")  # both breakdowns carry it
        pooled = bd["bytes"].get("pooled", 0)
        kinds += f"; pooled {fmt_bytes(pooled)} ({pooled / total:.1%} of the peak)" if total else ""
        ops = "+".join(bd.get("kernel_ops", [])[:4]) or "-"
        where = (
            f"{bd['phase']} kernel {bd['kernel'] + 1}/{bd['kernels']} ({ops})"
            if bd.get("kernel", -1) >= 0
            else f"start of the {bd['phase']}"
        )
        source = "walked" if self.walked_breakdown else "kernel model"
        return [f"  at the peak       : {where}, {source}: {kinds}"]

    def table(self) -> str:
        """One line per kept or recomputed value (parameters counted, not listed): dtype[shape], bytes
        kept or FLOPs recomputed, op, node name, reason, module path, source line; columns aligned
        across both sections."""
        sections = []
        for title, entries, show in (("kept", self.saved, "bytes"), ("recomputed", self.recomputed, "flops")):
            entries = [e for e in entries if e.action != OFFLOAD]
            params = [e for e in entries if e.reason == "param"]
            header = (
                f"{title} ({len(entries)}"
                + (
                    f", of which {len(params)} parameters and their views, free and not listed"
                    if params
                    else ""
                )
                + "):"
            )
            rows = [
                (
                    fmt_type(e.dtype, e.shape),
                    fmt_bytes(e.bytes) if show == "bytes" else fmt_flops(e.flops),
                    e.op,
                    e.name,
                    e.reason,
                    e.module,
                    e.source,
                )
                for e in entries
                if e.reason != "param"
            ]
            sections.append((header, rows))
        if self.approximated:
            sections.append(
                (
                    f"approximated ({len(self.approximated)}; bytes: what the backward reads instead):",
                    [
                        (
                            fmt_type(a["dtype"], a["shape"]),
                            fmt_bytes(a["kept_as_bytes"]),
                            f"{a['bits']}-bit {a['activation']}"
                            if a["kind"] == "few-bit"
                            else f"ratio {a['ratio']:g} linear",
                            a["value"],
                            f"of {fmt_bytes(a['bytes'])}",
                            a.get("module", ""),
                            a.get("source", ""),
                        )
                        for a in self.approximated
                    ],
                )
            )
        if self.offloaded:
            sections.append(
                (
                    f"offloaded ({len(self.offloaded)}; bytes: moved to the host and back each step):",
                    [
                        (
                            fmt_type(o["dtype"], o["shape"]),
                            fmt_bytes(o["bytes"]),
                            o["op"],
                            o["value"],
                            f"windows {o['forward_window_s'] * 1e3:.3f}"
                            f"/{o['backward_window_s'] * 1e3:.3f} ms",
                            o.get("module", ""),
                            o.get("source", ""),
                        )
                        for o in self.offloaded
                    ],
                )
            )
        forward = [c for c in self.collectives if c["phase"] == "forward"]
        if forward:
            sections.append(
                (
                    f"collectives in the forward ({len(forward)}; bytes: sent by each rank):",
                    [
                        (
                            fmt_type(c.get("dtype", ""), c.get("shape", [])),
                            fmt_bytes(c["bytes"]),
                            c["op"],
                            c["name"],
                            "gathered again in the backward" if c.get("regathered") else "",
                            c.get("module", ""),
                            c.get("source", ""),
                        )
                        for c in forward
                    ],
                )
            )
        rows = [row for _, section in sections for row in section]
        widths = [max([len(row[i]) for row in rows], default=0) for i in range(6)]
        out = []
        for header, section in sections:
            out.append(header)
            for row in section:
                cells = [row[0].rjust(widths[0]), row[1].rjust(widths[1])]
                cells += [cell.ljust(w) for cell, w in zip(row[2:6], widths[2:])] + [row[6]]
                out.append(("  " + "  ".join(cells)).rstrip())
        return "\n".join(out)

    def __str__(self) -> str:
        return self.summary() + "\n" + self.table()

    def __repr__(self) -> str:
        """One line: ``print(recompile_opt.last_plans())`` lists the plans, ``print(plan)`` shows one."""
        limits = "".join(
            f"{name}={fmt_bytes(n)}, "
            for name, n in (("budget", self.budget_bytes), ("peak_memory", self.peak_limit_bytes))
            if n is not None
        )
        peak = fmt_bytes(self.predicted_peak_bytes) if self.predicted_peak_bytes else "not simulated"
        return (
            f"Plan(graph={self.graph}, policy={self.policy}, {limits}kept {fmt_bytes(self.saved_bytes)} "
            f"of {fmt_bytes(self.baseline_bytes)}, recomputes {len(self.recomputed)} values "
            f"({fmt_flops(self.recompute_flops)}, est. {self.recompute_s * 1e3:.3f} ms), peak {peak})"
        )

    def diff(self, other: "Plan") -> str:
        """What changes from this plan to ``other``: values that move between kept and recomputed."""
        mine = {e.name: e for e in self.saved + self.recomputed}
        theirs = {e.name: e for e in other.saved + other.recomputed}
        lines = [
            f"plan diff: kept {fmt_bytes(self.saved_bytes)} -> {fmt_bytes(other.saved_bytes)}, "
            f"recompute {fmt_flops(self.recompute_flops)} -> {fmt_flops(other.recompute_flops)}, "
            f"peak {fmt_bytes(self.predicted_peak_bytes)} -> {fmt_bytes(other.predicted_peak_bytes)}"
        ]
        if self.graph != other.graph:
            lines.append(
                f"  note: different graphs ({self.graph} and {other.graph}): values are matched by "
                "node name only"
            )
        header = len(lines)
        for name in sorted(set(mine) | set(theirs), key=lambda n: _node_order(n)):
            a, b = mine.get(name), theirs.get(name)
            before = a.action if a else "-"
            after = b.action if b else "-"
            if before != after:  # the bytes of the side that keeps it (a recomputed entry has none)
                e = a if a is not None and a.action == KEEP else (b or a)
                lines.append(
                    f"  {name:<24} {before:>9} -> {after:<9} {e.op:<20} {fmt_bytes(e.bytes):>10} {e.module}"
                )
        mine_k, theirs_k = ({c["region"]: c["chunks"] for c in p.chunks} for p in (self, other))
        for region in sorted(set(mine_k) | set(theirs_k)):
            if mine_k.get(region, 1) != theirs_k.get(region, 1):
                lines.append(
                    f"  {region:<24} {mine_k.get(region, 1):>3} chunks -> {theirs_k.get(region, 1)} chunks"
                )
        mine_a, theirs_a = ({a["value"]: a for a in p.approximated} for p in (self, other))
        for value in sorted(set(mine_a) ^ set(theirs_a), key=_node_order):
            a = mine_a.get(value) or theirs_a[value]
            how = f"{a['bits']}-bit" if a["kind"] == "few-bit" else f"ratio {a['ratio']:g}"
            before, after = ("approx", "exact") if value in mine_a else ("exact", "approx")
            lines.append(
                f"  {value:<24} {before:>9} -> {after:<9} {how:<20} "
                f"{fmt_bytes(a['bytes']):>10} {a.get('module', '')}"
            )
        if len(lines) == header:
            lines.append("  (same decisions)")
        return "\n".join(lines)


def _node_order(name: str):
    base, _, num = name.rpartition("_")
    return (base, int(num)) if num.isdigit() else (name, -1)


def _pct(a: int, b: int) -> str:
    return f"{100 * a / b:.1f}%" if b else "-"


def fmt_type(dtype: str, shape: list) -> str:
    """``float32[4x256x64]``; a 0-d tensor (a seed, a scalar) is ``int64[]``; no dtype (not a tensor):
    ``-``."""
    if not dtype:
        return "-"
    return f"{dtype}[{'x'.join(str(s) for s in shape)}]"


def fmt_bytes(n: int | None) -> str:
    if n is None:
        return "-"
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n} B"


def fmt_flops(n: int) -> str:
    for unit, size in (("TFLOP", 1e12), ("GFLOP", 1e9), ("MFLOP", 1e6), ("KFLOP", 1e3)):
        if n >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n} FLOP"
