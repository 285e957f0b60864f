"""The child process: one case in (JSON on the command line), one JSON line of figures out.

The result is filled stage by stage, so a failure late in a case still reports what was measured
before it; the driver reads the line after :data:`MARKER`.
"""

from __future__ import annotations

import json
import sys
import traceback

from comparison.joblock import JobLock

MARKER = "@@GPU_CHECK_RESULT@@ "


def run_case(case: dict, *, device: str, tiny: bool, compiler: str) -> dict:
    """Figures of one case; ``error`` set (and the traceback on stderr) when it raised."""
    out: dict = {}
    lock = JobLock()
    # held shared until the process ends; a timed section converts this same lock to exclusive (a second
    # JobLock would open the file again, and flock would make it wait for this process's own shared lock)
    lock.shared()
    try:
        import torch

        torch.manual_seed(0)
        runner = RUNNERS[case["part"]]
        if case["part"] in ("performance", "profile"):  # their timed sections take this lock exclusively
            out.update(runner(case, device=device, tiny=tiny, compiler=compiler, lock=lock))
        else:
            out.update(runner(case, device=device, tiny=tiny, compiler=compiler))
    except BaseException as exc:  # noqa: BLE001 -- report it in the row, never crash the driver
        traceback.print_exc(file=sys.stderr)
        out["error"] = f"{type(exc).__name__}: {exc}".strip().splitlines()[0][:300]
    return out


def environment(case: dict, *, device: str, tiny: bool, compiler: str) -> dict:
    """The header's facts: torch, Triton, transformers, the device, CUDA and driver, and whether and from
    where ``recompile_opt`` imports."""
    import datetime
    import os
    import platform

    import torch

    env = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "device": device,
        "cuda": torch.version.cuda,
        "cpu": platform.processor() or platform.machine(),
        "cpus": os.cpu_count(),
        "system": platform.system(),
        "date": datetime.date.today().isoformat(),
    }
    for mod in ("triton", "transformers", "pulp", "highspy"):
        env[mod] = _version_of(mod)
    if device == "cuda":
        props = torch.cuda.get_device_properties(0)
        env.update(
            device_name=props.name,
            device_mib=props.total_memory >> 20,
            capability=f"{props.major}.{props.minor}",
            driver=_driver_version(),
        )
    try:
        import recompile_opt

        env["recompile_opt"] = f"{recompile_opt.__version__} ({recompile_opt.__file__})"
    except Exception as exc:  # noqa: BLE001 -- the header says why every case will fail
        env["recompile_opt"] = f"import failed: {type(exc).__name__}: {exc}"
    return env


def _version_of(distribution: str) -> str:
    """The installed version of a distribution, or ``missing``."""
    from importlib import metadata

    try:
        return metadata.version(distribution)
    except metadata.PackageNotFoundError:
        return "missing"


def _driver_version() -> str:
    """The NVIDIA driver's version from ``nvidia-smi`` (empty when it cannot be asked)."""
    import subprocess

    try:
        proc = subprocess.run(
            ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=30,
        )
        return proc.stdout.strip().splitlines()[0] if proc.returncode == 0 else ""
    except (OSError, subprocess.TimeoutExpired, IndexError):
        return ""


def reference(case: dict, *, device: str, tiny: bool, compiler: str) -> dict:
    """Plain ``torch.compile`` (``aot_eager`` with compiler eager) against eager: the bf16 yardstick."""
    import torch

    from .models import build
    from .numerics import against_eager

    model, batch = build(case["model"], device=device, tiny=tiny)
    fn = torch.compile(model) if compiler == "inductor" else torch.compile(model, backend="aot_eager")
    return against_eager(model, fn, batch, device=device, dtype=case["dtype"])


def correctness(case: dict, *, device: str, tiny: bool, compiler: str) -> dict:
    """Our backend at the case's options: one step against eager, the plans' figures, the measured peaks,
    and (an approximating plan on CUDA) how many Triton kernels of the approximate backward launched."""
    import torch

    import recompile_opt

    from .models import build
    from .numerics import against_eager, step_peaks

    model, batch = build(case["model"], device=device, tiny=tiny)
    options = {**case["options"], **({} if compiler == "inductor" else {"compiler": compiler})}
    fn = torch.compile(model, backend="recompile_opt", options=options)
    out = against_eager(model, fn, batch, device=device, dtype=case["dtype"])
    out.update(plan_figures(recompile_opt.last_plans()))
    out.update(step_peaks(model, fn, batch, device=device, dtype=case["dtype"]))
    if out.get("approximated") and device == "cuda":
        out["triton_launches"] = approximate_launches(model, fn, batch, dtype=case["dtype"])
    return out


def approximate_launches(model, fn, batch: tuple, *, dtype: str) -> dict:
    """Launches per Triton kernel of ``recompile_opt.approximate.triton_kernels`` in one CUDA step."""
    from recompile_opt.approximate import triton_kernels

    from .numerics import autocast, kernel_launches

    names = [n for n in dir(triton_kernels) if n.endswith("_kernel")]

    def step():
        with autocast("cuda", dtype):
            loss = fn(*batch)
        loss.backward()

    model.zero_grad(set_to_none=True)
    return kernel_launches(step, names)


def plan_figures(plans: list) -> dict:
    """What the plans of this process predicted: the peak (the most of any graph's), the estimated step
    (forward + backward + recompute, summed over graphs), approximated sites and the chunk notes; what
    their planning took: seconds, plans walked in Inductor's code, of them by forks, and why a fork
    could not walk (on CUDA, a fork walks with the device's figures read before forking)."""
    latest = list({p.graph: p for p in plans}.values())
    if not latest:
        return {"plans": 0}
    return {
        "plans": len(latest),
        "predicted_peak_bytes": max(p.predicted_peak_bytes for p in latest),
        # the code's requests, walked, where the predicted peak is the CUDA allocator's blocks of them
        "walked_peak_bytes": max(p.solver.get("walked_peak_bytes", p.predicted_peak_bytes) for p in latest),
        "estimated_step_s": sum(p.step_s + p.recompute_s for p in latest),
        "approximated": sum(len(p.approximated) for p in latest),
        "chunk_notes": [n for p in latest for n in p.notes if n.startswith("chunk")],
        "planning_s": sum(p.solver.get("plan_s", 0.0) for p in latest),
        "walks": sum(p.solver.get("exact_peaks", 0) for p in latest),
        "walked_in_forks": sum(p.solver.get("walked_in_forks", 0) for p in latest),
        "walk_notes": [n for p in latest for n in p.notes if n.startswith("walks:")],
    }


def performance(case: dict, *, device: str, tiny: bool, compiler: str, lock: JobLock) -> dict:
    from .timing import measure_strategy

    out = measure_strategy(case, device=device, tiny=tiny, compiler=compiler, lock=lock)
    return {**out, **_our_plans(case)}


def profile(case: dict, *, device: str, tiny: bool, compiler: str, lock: JobLock) -> dict:
    from .timing import profile_strategy

    out = profile_strategy(case, device=device, tiny=tiny, compiler=compiler, lock=lock)
    return {**out, **_our_plans(case)}


def _our_plans(case: dict) -> dict:
    if case["kind"] != "ours":
        return {}
    import recompile_opt

    return plan_figures(recompile_opt.last_plans())


RUNNERS = {
    "environment": environment,
    "reference": reference,
    "correctness": correctness,
    "performance": performance,
    "profile": profile,
}


def main(case_json: str, *, device: str, tiny: bool, compiler: str) -> int:
    """Run the case and print its result line; always exit 0 (the error is in the line)."""
    case = json.loads(case_json)
    out = run_case(case, device=device, tiny=tiny, compiler=compiler)
    print(MARKER + json.dumps(out), flush=True)
    return 0
