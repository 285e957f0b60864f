"""``recompile-opt``: plan a model, show or diff saved plans, and run the demo.

recompile-opt plan recompile_opt.models:gpt3_175b_layer --budget 0.3 [--policy P] [--json out.json]
    (FACTORY returns (model, example_inputs): a tuple of positional inputs, or a dict of keyword inputs)
recompile-opt show plan.json
recompile-opt diff a.json b.json
recompile-opt demo [--budget 0.3]
recompile-opt frontier [MODULE:FACTORY] [--budgets 0,0.1,...] [--out frontier] [--md table.md] [--measure]
                       [--no-pytorch]
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys
from collections.abc import Mapping
from pathlib import Path

from recompile_opt.options import POLICIES, SOLVERS, OptionError, parse_options


class UsageError(Exception):
    """Bad input on the command line (a file, a factory, a value): :func:`main` prints it as one line,
    ``recompile-opt COMMAND: error: ...``, and exits with status 2, as argparse does for a bad flag."""


def parse_budget_arg(text: str | None):
    """ "0.3" is a fraction, "1000000" bytes, "512MiB" a size with units."""
    if text is None:
        return None
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text


def load_factory(spec: str):
    module_name, _, attr = spec.partition(":")
    if not module_name or not attr:
        raise UsageError(
            f"expected MODULE:FACTORY, got {spec!r} (a function returning (model, example_inputs), "
            "e.g. recompile_opt.models:demo_gpt)"
        )
    sys.path.insert(0, str(Path.cwd()))
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as e:  # the module named, or a package above it; not one it imports
        if e.name is None or not (module_name == e.name or module_name.startswith(e.name + ".")):
            raise
        raise UsageError(f"cannot import {module_name!r} (in {spec!r}): no module named {e.name!r}") from None
    factory = getattr(module, attr, None)
    if not callable(factory):
        found = _factories(module)
        raise UsageError(
            f"module {module_name!r} has no factory {attr!r}"
            + (f"; its functions without required arguments: {', '.join(found)}" if found else "")
        )
    model, inputs = factory()
    if isinstance(inputs, Mapping):  # keyword inputs, as Hugging Face models are called
        return model, dict(inputs)
    return model, inputs if isinstance(inputs, (tuple, list)) else (inputs,)


def _factories(module) -> list[str]:
    """The public functions of ``module`` that can be called without arguments (factory candidates)."""
    import inspect

    names = []
    for name, fn in vars(module).items():
        if name.startswith("_") or not inspect.isfunction(fn) or fn.__module__ != module.__name__:
            continue
        params = inspect.signature(fn).parameters.values()
        if all(p.default is not p.empty or p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD) for p in params):
            names.append(name)
    return names[:12]


def _check(options: dict) -> None:
    """Read the options before building the model, so a bad --budget or --peak fails at once."""
    parse_options({k: v for k, v in options.items() if v is not None})


def cmd_plan(args) -> None:
    import recompile_opt

    options = {"policy": args.policy, "solver": args.solver}
    if args.peak:
        options["peak_memory"] = parse_budget_arg(args.peak)
    budget = parse_budget_arg(args.budget)
    _check({**options, "memory_budget": budget})
    model, inputs = load_factory(args.factory)
    plans = recompile_opt.plan(model, inputs, memory_budget=budget, **options)
    plans = plans if isinstance(plans, list) else [plans]
    for i, plan in enumerate(plans):
        if len(plans) > 1:
            print(f"== graph {i + 1} of {len(plans)} ==")
        print(plan)
    if args.json:  # one plan: a plan object; several graphs: a list of them
        data = [p.to_dict() for p in plans]
        try:
            Path(args.json).write_text(json.dumps(data[0] if len(data) == 1 else data, indent=2))
        except OSError as e:
            raise UsageError(f"cannot write {args.json}: {e.strerror}") from None
        print(f"wrote {args.json}")


def _read_plans(path: str) -> list:
    """The plans of a JSON file: one plan, or a list of them (a model of several graphs)."""
    from recompile_opt.plan import Plan

    try:
        data = json.loads(Path(path).read_text())
    except OSError as e:
        raise UsageError(f"cannot read {path}: {e.strerror}") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise UsageError(f"{path} is not JSON ({e})") from None
    try:
        return [Plan.from_json(json.dumps(d)) for d in (data if isinstance(data, list) else [data])]
    except (KeyError, TypeError) as e:
        raise UsageError(
            f"{path} holds no plan written by 'recompile-opt plan --json' ({type(e).__name__}: {e})"
        ) from None


def cmd_show(args) -> None:
    for plan in _read_plans(args.plan):
        print(plan)


def cmd_diff(args) -> None:
    a, b = _read_plans(args.a), _read_plans(args.b)
    if len(a) != len(b):
        raise UsageError(
            f"{args.a} holds {len(a)} plan(s), {args.b} {len(b)}; "
            "diff compares files of the same model, graph by graph"
        )
    print("\n\n".join(pa.diff(pb) for pa, pb in zip(a, b)))


def cmd_demo(args) -> None:
    from recompile_opt.demo import run_demo

    budget = parse_budget_arg(args.budget)
    _check({"memory_budget": budget})
    run_demo(budget=budget, steps=args.steps, compiler=args.compiler)


def cmd_frontier(args) -> None:
    import time

    from recompile_opt import frontier

    budgets = frontier.BUDGETS if args.budgets is None else [_fraction(b) for b in args.budgets.split(",")]
    model, inputs = load_factory(args.factory)
    if isinstance(inputs, dict):
        raise UsageError(
            f"{args.factory} returns keyword inputs: 'recompile-opt plan' takes them, 'frontier' "
            "takes positional inputs only (return a tuple, or wrap the model)"
        )
    t0 = time.perf_counter()
    points = frontier.sweep(
        model,
        inputs,
        budgets,
        measure=args.measure,
        steps=args.steps,
        pytorch_budgets=() if args.no_pytorch else frontier.PYTORCH_BUDGETS,
        compiler=args.compiler,
    )
    print(frontier.table(points))
    print(f"\n{len(points)} points in {time.perf_counter() - t0:.1f} s")
    for path in frontier.draw(points, args.out, title=args.factory):
        print(f"wrote {path}")
    if args.md:
        Path(args.md).write_text(frontier.markdown(points, title=args.factory))
        print(f"wrote {args.md}")


def _fraction(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = None
    if value is None or not 0.0 <= value <= 1.0:
        raise UsageError(f"--budgets: {text.strip()!r} is not a fraction in [0, 1]")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="recompile-opt", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser(
        "plan",
        help="plan MODULE:FACTORY (returns model and a tuple of inputs, or a dict of "
        "keyword inputs) and print the plan",
    )
    p.add_argument("factory")
    p.add_argument("--budget", help="bytes, a size like 512MiB, or a fraction in [0, 1]")
    p.add_argument("--peak", help="limit on the predicted step peak (bytes or size with units)")
    p.add_argument("--policy", default="auto", choices=POLICIES)
    p.add_argument("--solver", default="highs", choices=SOLVERS)
    p.add_argument("--json", help="also write the plan as JSON here")
    p.set_defaults(func=cmd_plan)
    p = sub.add_parser("show", help="print a plan saved as JSON")
    p.add_argument("plan")
    p.set_defaults(func=cmd_show)
    p = sub.add_parser("diff", help="what changes between two JSON plans")
    p.add_argument("a")
    p.add_argument("b")
    p.set_defaults(func=cmd_diff)
    p = sub.add_parser("demo", help="plan and train a small GPT on the CPU next to plain torch.compile")
    p.add_argument("--budget", default="0.0")
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--compiler", default="inductor", choices=("inductor", "eager"))
    p.set_defaults(func=cmd_demo)
    p = sub.add_parser(
        "frontier",
        help="sweep the budget: kept memory against recompute, with the fixed "
        "policies and PyTorch's knapsack; a table, PNG and SVG",
    )
    p.add_argument("factory", nargs="?", default="recompile_opt.models:demo_gpt")
    p.add_argument("--budgets", help="comma-separated fractions in [0, 1] (default 0,0.05,...,1)")
    p.add_argument("--out", default="frontier", help="path stem: writes STEM.png and STEM.svg")
    p.add_argument(
        "--md",
        metavar="FILE",
        help="also write the table as markdown here, opening with one "
        "provenance line (versions, machine, load, date)",
    )
    p.add_argument("--measure", action="store_true", help="also train each strategy a few steps and measure")
    p.add_argument("--steps", type=int, default=3, help="measured steps per strategy")
    p.add_argument(
        "--compiler",
        default="eager",
        choices=("inductor", "eager"),
        help="how measured strategies compile (eager: same partitions, no code generation)",
    )
    p.add_argument("--no-pytorch", action="store_true", help="leave out PyTorch's knapsack")
    p.set_defaults(func=cmd_frontier)
    return parser


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    try:
        args.func(args)
    except (UsageError, OptionError) as e:  # bad input: one line and status 2, as argparse's own errors
        lines = str(e).strip().splitlines() or [type(e).__name__]
        print(f"recompile-opt {args.command}: error: {lines[0]}", file=sys.stderr)
        raise SystemExit(2) from None


if __name__ == "__main__":
    main()
