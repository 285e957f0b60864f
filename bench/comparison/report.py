"""From runs to the report: one row per strategy, then markdown (headline and full tables), CSV, JSON.

A row aggregates every process of one strategy: medians of the per-process figures, min–max over every
timed step, compile time over the cold processes only (a warm cache's first step is no compile).
Memory figures repeat exactly from process to process, so a spread is flagged rather than averaged.
The markdown report opens with the provenance line (versions, machine, load, date): its figures hold
only for a setup like that one.
"""

from __future__ import annotations

import csv
import json
import os
import statistics
from pathlib import Path

from .config import MiB, group_title
from .pareto import pareto_markdown
from .strategies import STRATEGIES


def _median(values: list) -> float | None:
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def aggregate(name: str, runs: list[dict]) -> dict:
    """One table row from all processes of one strategy."""
    mine = [r for r in runs if r["strategy"] == name]
    ok = [r for r in mine if "error" not in r]
    row: dict = {"strategy": name, "processes": len(ok)}
    errors = [r["error"] for r in mine if "error" in r]
    if errors:
        row["error"] = errors[0]
    if not mine:
        row["notes"] = ["not run (interrupted)"]
    if note := STRATEGIES.get(name, {}).get("note"):  # ours-peak-SIZE has none
        row.setdefault("notes", []).append(note)
    if not ok:
        return row
    steps = [t for r in ok for t in r["step_s"]]
    cold = [r["first_step_s"] for r in ok if r.get("cache", "cold") == "cold"]
    warm = [r["first_step_s"] for r in ok if r.get("cache") == "warm"]
    row.update(
        step_ms=1e3 * _median([r["step_median_s"] for r in ok]),
        step_ms_min=1e3 * min(steps),
        step_ms_max=1e3 * max(steps),
        max_grad_diff=max(r["max_grad_diff"] for r in ok),
        recompiles=max(r.get("recompiles", 0) for r in ok),
        graphs=max(r.get("graphs", 1) for r in ok),
        loadavg_1m=max(r.get("loadavg_1m", 0.0) for r in ok),
    )
    if cold:
        row.update(compile_s=_median(cold), compile_s_min=min(cold), compile_s_max=max(cold))
    for key in ("kernels_built", "kernel_build_s", "plan_s"):  # what a cold compile spent, and on what
        vals = [r[key] for r in ok if r.get("cache", "cold") == "cold" and r.get(key) is not None]
        if vals:
            row[key] = _median(vals)
    if warm:
        row["warm_first_s"] = _median(warm)
    for key in (
        "saved_bytes",
        "peak_bytes",
        "rss_rise_bytes",
        "recompute_flops",
        "plan_saved_bytes",
        "plan_predicted_peak_bytes",
        "plan_recompute_flops",
        "rss_hwm_bytes",
        "saved_bytes_autograd",
    ):
        vals = [r[key] for r in ok if r.get(key) is not None]
        if vals:
            row[key] = _median(vals)
            if key in ("saved_bytes", "peak_bytes", "recompute_flops") and max(vals) != min(vals):
                row.setdefault("notes", []).append(f"{key} varies {min(vals)}..{max(vals)}")
    fwd = {(r["fwd_flops"], r["eager_fwd_flops"]) for r in ok if "fwd_flops" in r}
    if any(a != b for a, b in fwd):
        a, b = fwd.pop()
        row.setdefault("notes", []).append(f"forward FLOPs {a / 1e9:.3f} G vs eager {b / 1e9:.3f} G")
    if "saved_bytes_autograd" in row and "saved_bytes" not in row:
        row.setdefault("notes", []).append(
            f"{row['saved_bytes_autograd'] / MiB:.2f} MiB packed by autograd (keeps its own storage)"
        )
    return row


def _mib(v) -> str:
    return "—" if v is None else f"{v / MiB:.2f}"


def _gflop(v) -> str:
    return "—" if v is None else f"{v / 1e9:.3f}"


def _notes(row: dict, cpus: int | None = None) -> str:
    notes = list(row.get("notes", []))
    if row.get("recompiles"):
        notes.append(f"{row['recompiles']} recompile(s) while measuring")
    if row.get("loadavg_1m", 0) > (cpus or os.cpu_count() or 1):
        notes.append(f"busy machine (load {row['loadavg_1m']:.1f})")
    if row.get("graphs", 1) > 1:
        notes.append(f"{row['graphs']} graphs")
    if "error" in row:
        msg = " ".join(row["error"].split())
        notes.append("ERROR: " + (msg if len(msg) <= 300 else msg[:297] + "..."))
    return "; ".join(notes).replace("|", "\\|")


# (header, kind) -- kind is what the legend says: measured, counted or estimated
COLUMNS = [
    ("strategy", ""),
    ("step ms median", "M"),
    ("step ms min–max", "M"),
    ("compile s cold (min–max)", "M"),
    ("of it C++ builds s", "M"),
    ("of it planning s", "M"),
    ("kernels built cold", "M"),
    ("first step s warm", "M"),
    ("saved MiB", "M"),
    ("peak MiB", "M"),
    ("RSS rise MiB", "M"),
    ("max abs dgrad", "M"),
    ("recompute GFLOP", "C"),
    ("plan saved MiB", "E"),
    ("plan peak MiB", "E"),
    ("plan recompute GFLOP", "E"),
    ("notes", ""),
]
LEGEND = """\
Columns: **M** measured in the worker process; **C** counted (FLOP formulas of
`torch.utils.flop_counter` over the ops that ran: eager backward under `FlopCounterMode`, compiled
backward graphs from an Inductor post-grad pass), minus eager's save-all backward; **E** our
planner's estimates (`recompile_opt.last_plans()`). Step = forward + backward + SGD, median of the
processes' medians, min–max over every timed step. Compile = first forward+backward with an empty
Inductor cache; "warm" = later rounds, cache reused; of it C++ builds = wall time during which
Inductor's C++ compiler ran in that cold compile; of it planning = our partitioner's wall time (cost
model, least-peak search, partition; `plan.solver["plan_s"]`); kernels built = C++ kernel modules
that cold compile produced (shared objects in its private cache). Peak = forward + backward from
grads `None`, integrated from the profiler's allocation records; RSS rise = resident high-water mark
of another such call minus the resident size before it (a cross-check: lower where the C allocator
reuses memory it kept). Saved = `saved_tensors_hooks`, storages deduplicated, parameters excluded."""


def markdown_table(rows: list[dict], cpus: int | None = None) -> str:
    head = [f"{h} [{k}]" if k else h for h, k in COLUMNS]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(COLUMNS)]
    for r in rows:
        ok = "step_ms" in r
        compile_s = (
            f"{r['compile_s']:.1f} ({r['compile_s_min']:.1f}–{r['compile_s_max']:.1f})"
            if "compile_s" in r
            else "—"
        )
        cells = [
            r["strategy"],
            f"{r['step_ms']:.1f}" if ok else "—",
            f"{r['step_ms_min']:.1f}–{r['step_ms_max']:.1f}" if ok else "—",
            compile_s,
            f"{r['kernel_build_s']:.1f}" if "kernel_build_s" in r else "—",
            f"{r['plan_s']:.1f}" if "plan_s" in r else "—",
            f"{r['kernels_built']:g}" if "kernels_built" in r else "—",
            f"{r['warm_first_s']:.1f}" if "warm_first_s" in r else "—",
            _mib(r.get("saved_bytes")),
            _mib(r.get("peak_bytes")),
            _mib(r.get("rss_rise_bytes")),
            f"{r['max_grad_diff']:.1e}" if ok else "—",
            _gflop(r.get("recompute_flops")),
            _mib(r.get("plan_saved_bytes")),
            _mib(r.get("plan_predicted_peak_bytes")),
            _gflop(r.get("plan_recompute_flops")),
            _notes(r, cpus),
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


# (header, kind) of the headline table: the figures a README quotes, formatted as in the full table
HEADLINE_COLUMNS = [
    ("strategy", ""),
    ("peak MiB", "M"),
    ("step ms median", "M"),
    ("recompute GFLOP", "C"),
    ("kept (saved) MiB", "M"),
]


def headline_table(rows: list[dict]) -> str:
    """Peak, median step, recompute and bytes kept for backward per strategy: the same figures as
    :func:`markdown_table`, fewer columns, short enough for a README."""
    head = [f"{h} [{k}]" if k else h for h, k in HEADLINE_COLUMNS]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(HEADLINE_COLUMNS)]
    for r in rows:
        cells = [
            r["strategy"],
            _mib(r.get("peak_bytes")),
            f"{r['step_ms']:.1f}" if "step_ms" in r else "—",
            _gflop(r.get("recompute_flops")),
            _mib(r.get("saved_bytes")),
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


CSV_KEYS = [
    "model",
    "size",
    "strategy",
    "processes",
    "step_ms",
    "step_ms_min",
    "step_ms_max",
    "compile_s",
    "compile_s_min",
    "compile_s_max",
    "kernel_build_s",
    "plan_s",
    "kernels_built",
    "warm_first_s",
    "saved_bytes",
    "peak_bytes",
    "rss_rise_bytes",
    "max_grad_diff",
    "recompute_flops",
    "plan_saved_bytes",
    "plan_predicted_peak_bytes",
    "plan_recompute_flops",
    "rss_hwm_bytes",
    "graphs",
    "recompiles",
    "loadavg_1m",
    "error",
]


def write_csv(path: str, groups: list[dict]) -> None:
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=CSV_KEYS, extrasaction="ignore")
        writer.writeheader()
        for g in groups:
            writer.writerows(
                {"model": g["config"]["model"], "size": g["config"]["size"], **r} for r in g["rows"]
            )


def group_markdown(group: dict, args=None) -> str:
    cfg = group["config"]
    wall = f" ({group['wall_s'] / 60:.1f} min)" if "wall_s" in group else ""
    return "\n".join(
        [
            f"### {group_title(cfg)}{wall}",
            "",
            markdown_table(group["rows"]),
            "",
            pareto_markdown(group["rows"], group["pareto"]),
        ]
    )


def report_markdown(groups: list[dict], *, header: str, command: str, settings: dict, wall_s: float) -> str:
    """The whole report: the provenance line, a headline table per group, the command and its settings,
    each group's full table and Pareto check, the legend."""
    headlines = [f"**{group_title(g['config'])}**\n\n{headline_table(g['rows'])}" for g in groups]
    return "\n\n".join(
        [
            header,
            *headlines,
            f"`{command}`: {json.dumps(settings)}; {wall_s / 60:.1f} min on {os.cpu_count()} CPUs",
            *(group_markdown(g) for g in groups),
            LEGEND,
        ]
    )


def write_json(
    path: str, groups: list[dict], *, header: str, command: str, settings: dict, wall_s: float
) -> None:
    """Config, rows, Pareto check and raw runs of every group; each config also records the provenance
    line, so a JSON file read on its own still says what it was measured on."""
    groups = [{**g, "config": {**g["config"], "provenance": header}} for g in groups]
    Path(path).write_text(
        json.dumps({"command": command, "settings": settings, "wall_s": wall_s, "groups": groups}, indent=1)
    )
