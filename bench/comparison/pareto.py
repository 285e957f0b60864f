"""The Pareto check on the measured (peak, median step time) plane: is ours on or below the others?

Why a noise allowance: step times of separate processes on a shared CPU differ by a few percent run to
run, so a point only *dominates* another when it is more than ``noise`` faster at no more peak; our
point *covers* (is on or below) another at no more peak and at most ``noise`` slower.
"""

from __future__ import annotations

from .config import MiB


def is_ours(name: str) -> bool:
    return name.startswith("ours-")


def dominates(a: dict, b: dict, noise: float = 0.10) -> bool:
    """``a``'s peak is at most ``b``'s and ``a``'s step is more than ``noise`` faster."""
    return a["peak_bytes"] <= b["peak_bytes"] and a["step_ms"] < (1 - noise) * b["step_ms"]


def covers(a: dict, b: dict, noise: float = 0.10) -> bool:
    """``a`` is on or below ``b``: peak at most ``b``'s, step at most ``noise`` slower."""
    return a["peak_bytes"] <= b["peak_bytes"] and a["step_ms"] <= (1 + noise) * b["step_ms"]


def pareto_check(rows: list[dict], noise: float = 0.10) -> dict:
    """Dominance between measured points. ``ours``: each ``ours-*`` row, on the frontier or dominated
    by which rows; ``others``: each other row, dominated / matched / not covered by our points, and
    for "not covered" the ours point of least peak at or below its peak (``nearest``) if any."""
    pts = [r for r in rows if r.get("peak_bytes") is not None and r.get("step_ms") is not None]
    mine = [r for r in pts if is_ours(r["strategy"])]
    theirs = [r for r in pts if not is_ours(r["strategy"])]
    out: dict = {
        "noise": noise,
        "ours": [],
        "others": [],
        "no_figures": [r["strategy"] for r in rows if r not in pts],
    }
    for r in mine:
        by = [o["strategy"] for o in pts if o is not r and dominates(o, r, noise)]
        out["ours"].append({"strategy": r["strategy"], "status": "dominated" if by else "frontier", "by": by})
    for r in theirs:
        entry: dict = {"strategy": r["strategy"]}
        dom = [o["strategy"] for o in mine if dominates(o, r, noise)]
        match = [o["strategy"] for o in mine if covers(o, r, noise)]
        if dom:
            entry.update(status="dominated", by=dom)
        elif match:
            entry.update(status="matched", by=match)
        else:
            below = [o for o in mine if o["peak_bytes"] <= r["peak_bytes"]]
            entry.update(status="not covered", by=[])
            if below:
                best = min(below, key=lambda o: o["step_ms"])
                entry["nearest"] = {"strategy": best["strategy"], "slowdown": best["step_ms"] / r["step_ms"]}
            elif mine:
                entry["least_ours_peak_bytes"] = min(o["peak_bytes"] for o in mine)
        out["others"].append(entry)
    return out


def pareto_markdown(rows: list[dict], check: dict) -> str:
    by_name = {r["strategy"]: r for r in rows}

    def pt(name: str) -> str:
        r = by_name[name]
        return f"`{name}` ({r['peak_bytes'] / MiB:.2f} MiB, {r['step_ms']:.1f} ms)"

    pct = f"{check['noise']:.0%}"
    lines = [
        f"Pareto check on the measured plane (peak MiB, median step ms). A point *dominates* another "
        f"when its peak is at most the other's and its step is more than {pct} faster (the noise "
        f"allowance); ours is *on or below* a point when an ours point has at most its peak and a "
        f"step at most {pct} slower.",
        "",
        "Ours:",
    ]
    for e in check["ours"]:
        what = (
            "on the frontier"
            if e["status"] == "frontier"
            else "dominated by " + ", ".join(pt(n) for n in e["by"])
        )
        lines.append(f"- {pt(e['strategy'])}: {what}")
    lines += ["", "Other strategies against ours:"]
    missing = []
    for e in check["others"]:
        if e["status"] == "dominated":
            what = "dominated by " + ", ".join(f"`{n}`" for n in e["by"])
        elif e["status"] == "matched":
            what = "ours on or below it (within the noise): " + ", ".join(f"`{n}`" for n in e["by"])
        else:
            missing.append(e["strategy"])
            if "nearest" in e:
                n = e["nearest"]
                what = (
                    f"**not covered**: the fastest ours point at or below its peak, {pt(n['strategy'])}, "
                    f"is {n['slowdown']:.2f}x slower"
                )
            elif "least_ours_peak_bytes" in e:
                what = (
                    f"**not covered**: no ours point reaches its peak (least ours peak "
                    f"{e['least_ours_peak_bytes'] / MiB:.2f} MiB)"
                )
            else:
                what = "**not covered**: no ours point has figures"
        lines.append(f"- {pt(e['strategy'])}: {what}")
    if check["no_figures"]:
        lines.append("- no figures (failed or not run): " + ", ".join(f"`{n}`" for n in check["no_figures"]))
    n = len(check["others"])
    lines += [
        "",
        f"Summary: ours is on or below {n - len(missing)} of {n} other measured points"
        + (f"; not below {', '.join(f'`{m}`' for m in missing)}." if missing else "."),
    ]
    return "\n".join(lines)
