"""The GPU check: correctness, peak fidelity, performance and a kernel profile of recompile_opt, written
to one markdown file (docs/gpu.md by default). At most about 8 minutes on one H200.

Usage::

    python bench/gpu_check.py                                  # every part on CUDA -> docs/gpu.md
    python bench/gpu_check.py --parts correctness,fidelity --models gpt --dtypes bf16
    python bench/gpu_check.py --device cpu --tiny --compiler eager --parts correctness,fidelity \\
        --models gpt --dtypes fp32 --options 0.0,peak,full --out /tmp/gpu.md     # the CPU test's run

Every case runs in a fresh process with a timeout (``--timeout``); a failure is its row's result. The
correctness and fidelity parts share their cases (one compiled step each). See ``bench/gpu/``.
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys
from pathlib import Path

from gpu import cases, driver, report

REPO = Path(__file__).resolve().parents[1]


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", choices=("cuda", "cpu"), default=None, help="default: cuda when available")
    p.add_argument("--tiny", action="store_true", help="tiny models (2 layers, h=32): the CPU test")
    p.add_argument("--out", default=str(REPO / "docs" / "gpu.md"))
    p.add_argument(
        "--parts", default=",".join(cases.PARTS), help=f"comma-separated of {','.join(cases.PARTS)}"
    )
    p.add_argument(
        "--models", default="", help=f"correctness/fidelity models (default all: {','.join(cases.MODELS)})"
    )
    p.add_argument("--dtypes", default="", help="fp32,bf16 (default both)")
    p.add_argument("--options", default="", help=f"backend options (default all: {','.join(cases.OPTIONS)})")
    p.add_argument(
        "--strategies", default="", help=f"performance strategies (default all: {','.join(cases.STRATEGIES)})"
    )
    p.add_argument(
        "--profiles", default="", help=f"profiled strategies (default all: {','.join(cases.PROFILES)})"
    )
    p.add_argument(
        "--compiler",
        choices=("inductor", "eager"),
        default="inductor",
        help="eager: no code generation (ours: compiler=eager; plain compiles: aot_eager)",
    )
    p.add_argument("--jobs", type=int, default=None, help="cases at once (default: 8 on CUDA, 2 on the CPU)")
    p.add_argument("--timeout", type=int, default=420, help="seconds per case")
    p.add_argument(
        "--deadline", type=float, default=None, help="seconds for the whole run: later cases do not start"
    )
    p.add_argument("--results", default=None, help="append each case's result here as JSON lines")
    p.add_argument(
        "--ckpt-peak-mib",
        type=float,
        default=None,
        help="ours-peak's limit in MiB instead of this run's compile-ckpt peak (it compiles at once)",
    )
    p.add_argument("--verbose", action="store_true", help="print a failed case's stderr")
    p.add_argument("--worker", help=argparse.SUPPRESS)  # a case's JSON: run it here and print its line
    args = p.parse_args(argv)
    if args.device is None:
        args.device = "cuda" if _cuda_available() else "cpu"
    if args.jobs is None:
        args.jobs = min(8, os.cpu_count() // 2) if args.device == "cuda" else 2
    return args


def _cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


def select(args) -> tuple[list[str], list[dict]]:
    """The parts asked for and their cases (the environment first)."""
    parts = cases.pick(args.parts, cases.PARTS, "parts")
    todo = [{"part": "environment"}]
    if {"correctness", "fidelity"} & set(parts):
        models = cases.pick(args.models, cases.MODELS, "models")
        todo += cases.numeric_cases(
            models,
            cases.pick(args.dtypes, cases.DTYPES, "dtypes"),
            cases.pick(args.options, tuple(cases.OPTIONS), "options"),
            tiny=args.tiny,
        )
    if "performance" in parts:
        todo += cases.strategy_cases(
            cases.pick(args.strategies, tuple(cases.STRATEGIES), "strategies"),
            cases.STRATEGIES,
            "performance",
        )
    if args.ckpt_peak_mib:
        todo = [_limit_given(c, args.ckpt_peak_mib) for c in todo]
    if "profile" in parts:
        todo += cases.strategy_cases(
            cases.pick(args.profiles, tuple(cases.PROFILES), "profiles"), cases.PROFILES, "profile"
        )
    return parts, todo


def _limit_given(case: dict, mib: float) -> dict:
    """A case that needs compile-ckpt's measured peak, given that peak instead (``--ckpt-peak-mib``)."""
    if case.get("needs") != "performance:compile-ckpt":
        return case
    rest = {k: v for k, v in case.items() if k != "needs"}
    return {**rest, "options": {**case.get("options", {}), "peak_memory": int(mib * 2**20)}}


def command_for(args, parts: list[str]) -> str:
    """The command that remakes ``parts`` with this run's settings."""
    argv = ["python", "bench/gpu_check.py", "--device", args.device, "--parts", ",".join(parts)]
    argv += ["--tiny"] if args.tiny else []
    argv += ["--compiler", args.compiler] if args.compiler != "inductor" else []
    argv += (
        ["--ckpt-peak-mib", str(args.ckpt_peak_mib)] if args.ckpt_peak_mib and "performance" in parts else []
    )
    numeric = {"correctness", "fidelity"} & set(parts)
    for flag, used in (
        ("models", numeric),
        ("dtypes", numeric),
        ("options", numeric),
        ("strategies", "performance" in parts),
        ("profiles", "profile" in parts),
    ):
        if getattr(args, flag) and used:
            argv += [f"--{flag}", getattr(args, flag)]
    return shlex.join(argv)


def render(results: dict, parts: list[str], args) -> str:
    """The document: header, then each part asked for."""
    env = results.get("environment", {})
    lines = report.header(env, command_for(args, parts))
    if "error" in env:
        lines += [f"Environment: ERROR {env['error']}", ""]
    for part in parts:
        cmd = command_for(
            args, ["correctness", "fidelity"] if part in ("correctness", "fidelity") else [part]
        )
        if part == "performance":
            title = (
                "GPT (recompile_opt.models.GPT, SDPA attention): "
                + ("tiny" if args.tiny else "vocab 50304, h=1024, 16 heads, 8 layers, s=2048, b=8")
                + ", fp32 parameters under bf16 autocast, SGD."
            )
            lines += report.performance(results, cmd, title=title)
        else:
            lines += getattr(report, part)(results, cmd)
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.worker:
        from gpu import worker

        return worker.main(args.worker, device=args.device, tiny=args.tiny, compiler=args.compiler)
    parts, todo = select(args)
    results = driver.run_cases(todo, args)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(render(results, parts, args))
    failed = [name for name, res in results.items() if "error" in res]
    print(f"[gpu_check] wrote {out}; {len(results)} cases, {len(failed)} errors", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
