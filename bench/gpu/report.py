"""The markdown of a GPU check: a header naming the machine and software, then one section per part,
each under the exact command that remakes it. Rows are built from the workers' result dicts only.
"""

from __future__ import annotations

import datetime
import math

from .cases import case_name
from .numerics import verdict
from .timing import PROFILED

MiB = 1 << 20
FIDELITY_TARGET = 0.03
# the published run (H200, torch 2.11): strategy -> (first call s, median step ms, peak MiB)
PUBLISHED = {
    "eager": ("0.5", "45.37", "12864.4"),
    "torch.compile": ("20.5", "37.40", "6681.6"),
    "compile, activation_memory_budget 0.5": ("", "42.55", "4618.8"),
    "compile, activation_memory_budget 0.2": ("", "44.96", "5009.4"),
    "compile, activation_memory_budget 0.0": ("", "49.14", "6546.1"),
    "compile + per-block checkpoint": ("17.4", "43.45", "2320.6"),
}


def table(head: list[str], rows: list[list]) -> list[str]:
    return [
        "| " + " | ".join(head) + " |",
        "|" + "---|" * len(head),
        *("| " + " | ".join(str(c) for c in row) + " |" for row in rows),
    ]


def fmt(x, spec: str = ".2e") -> str:
    return "" if x is None else format(x, spec)


def header(env: dict, command: str) -> list[str]:
    """Title, command, date and the machine: device, driver / CUDA, torch, Triton and the rest."""
    dev = env.get("device_name") or env.get("device", "?")
    if env.get("device_mib"):
        dev += f" ({env['device_mib']} MiB, compute capability {env.get('capability')})"
    facts = [
        ["device", dev],
        ["driver / CUDA", f"{env.get('driver') or 'n/a'} / {env.get('cuda') or 'n/a'}"],
        ["torch", env.get("torch", "?")],
        ["Triton", env.get("triton", "?")],
        ["transformers", env.get("transformers", "?")],
        ["PuLP / highspy", f"{env.get('pulp')} / {env.get('highspy')}"],
        ["recompile_opt", env.get("recompile_opt", "?")],
        ["Python", env.get("python", "?")],
    ]
    return [
        "# recompile_opt on a GPU: correctness, peak fidelity, performance",
        "",
        *source(command, env),
        "Each case ran in a fresh process.",
        "",
        *table(["", ""], facts),
        "",
    ]


def source(command: str, env: dict) -> list[str]:
    """The command in a code block and the provenance line under it (docs/ tables say where they came
    from: tests/test_docs.py)."""
    return ["```bash", command, "```", "", provenance(env), ""]


def provenance(env: dict) -> str:
    """``recompile_opt.provenance.header_line()``'s form, from the machine the cases ran on."""
    ours = str(env.get("recompile_opt", "?")).split()[0] or "?"
    machine = env.get("device_name") or env.get("device", "?")
    date = env.get("date") or datetime.date.today().isoformat()
    return (
        f"torch {env.get('torch', '?')}, Python {env.get('python', '?')}, recompile_opt {ours}, "
        f"highspy {env.get('highspy', '?')}, PuLP {env.get('pulp', '?')}; {machine}, "
        f"{env.get('cpus', '?')} CPU cores, {env.get('system', 'Linux')} {env.get('cpu', '?')}; {date}"
    )


def status(res: dict, ok: bool | None = None) -> str:
    """A row's result: its error, else pass / FAIL by ``ok``, else (nothing judged) ``ok``."""
    if "error" in res:
        return "ERROR: " + res["error"].replace("|", "/")
    return "ok" if ok is None else ("pass" if ok else "FAIL")


def correctness(results: dict, command: str) -> list[str]:
    """One row per (model, dtype, option): deviations from eager, plain torch.compile's, the verdict."""
    rows = []
    for res in _numeric_rows(results):
        case = res["case"]
        ref = results.get(case_name({**case, "part": "reference"}), {})
        ok, why = (None, "") if "error" in res else verdict({**res, "dtype": case["dtype"]}, ref)
        launches = res.get("triton_launches")
        note = why + (f"; Triton launches {launches}" if launches is not None else "")
        rows.append(
            [
                case["model"],
                case["dtype"],
                _option(case),
                fmt(res.get("loss_dev")),
                f"{fmt(res.get('grad_dev'))} {res.get('worst_grad', '')}",
                f"{fmt(ref.get('loss_dev'))} / {fmt(ref.get('grad_dev'))}",
                status(res, ok),
                note,
            ]
        )
    return [
        "## Correctness: one step against eager",
        "",
        *source(command, results.get("environment", {})),
        "Normwise relative deviation from eager (`max|ours - eager| / max|eager|`) of the loss and of "
        "the worst parameter gradient; compile's: plain `torch.compile` on the same model and dtype "
        "(loss / gradient). fp32 passes at `allclose(rtol=1e-4, atol=1e-5)` elementwise; bf16 within "
        "2x compile's deviation (floor 1e-5).",
        "",
        *table(
            [
                "model",
                "dtype",
                "option",
                "loss dev",
                "worst grad dev",
                "compile's dev",
                "result",
                "criterion",
            ],
            rows,
        ),
        "",
    ]


def fidelity(results: dict, command: str) -> list[str]:
    """One row per plan: predicted peak against measured, the error, and whether a peak_memory held."""
    rows = []
    for res in _numeric_rows(results):
        case = res["case"]
        pred, meas = res.get("predicted_peak_bytes"), res.get("peak_bytes")
        err = (pred - meas) / meas if pred and meas else None
        walked, requested = res.get("walked_peak_bytes"), res.get("peak_requested_bytes")
        walked_err = (walked - requested) / requested if walked and requested else None
        limit = case["options"].get("peak_memory")
        held = "" if limit is None or meas is None else ("yes" if meas <= limit else "NO")
        rows.append(
            [
                case["model"],
                case["dtype"],
                _option(case),
                _mib(pred),
                _mib(meas),
                fmt(None if err is None else 100 * err, "+.1f"),
                "" if err is None else ("yes" if abs(err) <= FIDELITY_TARGET else "no"),
                _mib(walked),
                _mib(requested),
                fmt(None if walked_err is None else 100 * walked_err, "+.1f"),
                _mib(res.get("peak_grads_allocated_bytes")),
                _mib(limit),
                held,
                status(res),
            ]
        )
    return [
        "## Fidelity: predicted against measured peak",
        "",
        *source(command, results.get("environment", {})),
        "Predicted: the most of the process's plans' `predicted_peak_bytes` (on CUDA, the caching "
        "allocator's blocks for the code's requests: `recompile_opt.costs.cuda_allocator`). Measured: "
        "the most bytes allocated above the start of a forward and backward entered with `grad=None`, "
        "as the plan counts it (gradients included); on CUDA in a steady step (the allocator's cache "
        "emptied, two steps run, the third measured). Walked: the code's requests at their peak (the "
        "walk of Inductor's code), against the allocator's `requested_bytes` peak (CUDA only). Beside "
        f"them the same step entered with the gradients allocated. Target: within {FIDELITY_TARGET:.0%}.",
        "",
        *table(
            [
                "model",
                "dtype",
                "option",
                "predicted MiB",
                "measured MiB",
                "error %",
                "within 3%",
                "walked requests MiB",
                "measured requests MiB",
                "requests error %",
                "measured, grads allocated MiB",
                "peak_memory MiB",
                "held",
                "result",
            ],
            rows,
        ),
        "",
    ]


def _numeric_rows(results: dict) -> list[dict]:
    return [r for r in results.values() if r["case"]["part"] == "correctness"]


def _option(case: dict) -> str:
    opts = ", ".join(f"{k}={v}" for k, v in case["options"].items())
    return f"{case['option']} ({opts})" if opts else case["option"]


def _planning(res: dict) -> str:
    """Our planning's seconds, with its walks and those forks made: "41.2 (23, 18 in forks)"."""
    if not res.get("plans") or "planning_s" not in res:
        return ""
    return f"{res['planning_s']:.1f} ({res['walks']}, {res['walked_in_forks']} in forks)"


def _mib(n) -> str:
    return "" if n is None else f"{n / MiB:.2f}"


def performance(results: dict, command: str, *, title: str) -> list[str]:
    """One row per strategy; the targets judged beside; the issue's published table."""
    rows = {r["case"]["strategy"]: r for r in results.values() if r["case"]["part"] == "performance"}
    body = []
    for name, res in rows.items():
        est, step = res.get("estimated_step_s"), res.get("step_median_s")
        limit = res["case"].get("options", {}).get("peak_memory")
        body.append(
            [
                name + (f" (peak_memory {_mib(limit)} MiB)" if limit else ""),
                fmt(res.get("first_call_s"), ".1f"),
                _planning(res),
                fmt(None if step is None else step * 1e3, ".2f"),
                _mib(res.get("peak_bytes")),
                fmt(res.get("loss_after_10"), ".4f"),
                fmt(None if est is None else est * 1e3, ".2f"),
                fmt(est / step if est and step else None, ".2f"),
                _performance_status(res),
            ]
        )
    return [
        "## Performance",
        "",
        title,
        "",
        *source(command, results.get("environment", {})),
        "First call: wall seconds of step 1 (cold Inductor cache). Planning: our plans' planning "
        "seconds in it, with the plans walked in Inductor's code and how many of them forks of the "
        "process walked. Step: median of 10 steps after 3 "
        "warm-up (CUDA events). Peak: most bytes above a step's start, gradients allocated. Loss: step "
        "10's. Estimated: the plans' `step_s + recompute_s` summed; its ratio to the measured step.",
        "",
        *[f"* {r['case']['strategy']}: {n}" for r in rows.values() for n in r.get("walk_notes", [])],
        *table(
            [
                "strategy",
                "first call s",
                "planning s (walks, in forks)",
                "step ms",
                "peak MiB",
                "loss after 10",
                "estimated step ms",
                "estimated / measured",
                "result",
            ],
            body,
        ),
        "",
        *targets(rows),
        "",
        "Published (the issue; H200, torch 2.11):",
        "",
        *table(["strategy", "first call s", "step ms", "peak MiB"], [[k, *v] for k, v in PUBLISHED.items()]),
        "",
    ]


def _performance_status(res: dict) -> str:
    """A strategy's result: its error, FAIL for a loss that is not finite, else ok; and whether its
    timed section ran beside other cases' compiles (``--deadline``)."""
    loss = res.get("loss_after_10")
    finite = loss is None or math.isfinite(loss)
    out = status(res) if finite or "error" in res else "FAIL: the loss is not finite"
    return out + (" (timed beside other cases' compiles)" if res.get("timed_alone") is False else "")


def targets(rows: dict) -> list[str]:
    """The issue's targets for our strategies, each with its measured ratio and met / missed."""

    def get(name, key):
        return rows.get(name, {}).get(key)

    checks = [
        ("ours-0.0 peak <= 0.5x compile-ckpt's", "ours-0.0", "compile-ckpt", "peak_bytes", 0.5),
        ("ours-0.0 step <= 1.15x torch.compile's", "ours-0.0", "compile", "step_median_s", 1.15),
        ("ours-none step <= 1.02x torch.compile's", "ours-none", "compile", "step_median_s", 1.02),
        ("ours-none peak <= torch.compile's", "ours-none", "compile", "peak_bytes", 1.0),
        ("ours-0.0 first call <= 2x torch.compile's", "ours-0.0", "compile", "first_call_s", 2.0),
    ]
    lines = ["Targets:", ""]
    for text, ours, base, key, factor in checks:
        a, b = get(ours, key), get(base, key)
        if a is None or b is None:
            lines.append(f"* {text}: not measured")
        else:
            lines.append(f"* {text}: {a / b:.2f}x, {'met' if a <= factor * b else 'MISSED'}")
    return lines


def profile(results: dict, command: str) -> list[str]:
    """Per profiled strategy: launches per step, the chunk notes, the top kernels by total time."""
    out = [
        "## Profile: where a chunked plan's step goes",
        "",
        *source(command, results.get("environment", {})),
    ]
    for res in (r for r in results.values() if r["case"]["part"] == "profile"):
        name = res["case"]["strategy"]
        if "error" in res:
            out += [f"### {name}", "", status(res), ""]
            continue
        out += [
            f"### {name}",
            "",
            f"Kernel launches per step: {res['launches_per_step']:.0f}; kernel time per "
            f"step {res['profiled_us_per_step'] / 1e3:.2f} ms.",
            "",
        ]
        out += [f"* {n}" for n in res.get("chunk_notes", [])] or ["* no chunk notes"]
        total = res["profiled_us_per_step"] * PROFILED or 1.0
        out += [
            "",
            *table(
                ["kernel", "calls / step", f"total ms ({PROFILED} steps)", "share"],
                [
                    [
                        k["name"][:90].replace("|", "/"),
                        f"{k['calls'] / PROFILED:.0f}",
                        f"{k['total_us'] / 1e3:.2f}",
                        f"{100 * k['total_us'] / total:.1f}%",
                    ]
                    for k in res["kernels"]
                ],
            ),
            "",
        ]
    return out
