"""The names users and scripts reach for keep working whatever the package's inner layout: the
top-level API, the entry point torch.compile finds the backend by, the CLI's model factories, and the
layering the packages promise (the planner decides on plain data: it never imports torch)."""

import importlib
import importlib.metadata
import subprocess
import sys

import recompile_opt


def test_top_level_names():
    for name in (
        "plan",
        "last_plans",
        "reset_plans",
        "Plan",
        "PlanEntry",
        "Options",
        "OptionError",
        "InfeasibleBudget",
        "recompile_opt_backend",
    ):
        assert hasattr(recompile_opt, name), name
    assert issubclass(recompile_opt.InfeasibleBudget, recompile_opt.OptionError)


def test_the_entry_point_names_the_backend():
    (ep,) = [
        e for e in importlib.metadata.entry_points(group="torch_dynamo_backends") if e.name == "recompile_opt"
    ]
    assert ep.load() is recompile_opt.recompile_opt_backend


def test_the_cli_factories_resolve():
    models = importlib.import_module("recompile_opt.models")
    assert callable(models.demo_gpt) and callable(models.gpt3_175b_layer)


def test_the_planner_imports_no_torch():
    """recompile_opt.planner's contract (its __init__): solvers and policies run on plain data, so a
    fresh interpreter that imports every planner module has not imported torch."""
    code = (
        "import sys, importlib, pkgutil, recompile_opt.planner as p\n"
        "for m in pkgutil.iter_modules(p.__path__):\n"
        "    importlib.import_module('recompile_opt.planner.' + m.name)\n"
        "print('torch' in sys.modules)"
    )
    # importing recompile_opt.planner runs recompile_opt/__init__, which imports the backend (and torch):
    # block that one import, so only the planner's own imports count
    guard = (
        "import sys, types; pkg = types.ModuleType('recompile_opt'); "
        "import importlib.util as u; spec = u.find_spec('recompile_opt'); "
        "pkg.__path__ = list(spec.submodule_search_locations); sys.modules['recompile_opt'] = pkg\n"
    )
    out = subprocess.run([sys.executable, "-c", guard + code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "False"


def test_the_cache_key_covers_every_source_of_ours():
    """The partitioner's uuid() (the compile caches' key) hashes our sources: a file moved into a
    sub-package (planner/, costs/) must still count, or a cache hit could replay a partition that
    older planner code made."""
    from pathlib import Path

    from recompile_opt.provenance import source_files

    package = Path(recompile_opt.__file__).parent
    hashed = set(source_files())
    for sub in (
        "planner/ilp.py",
        "planner/least_peak.py",
        "costs/peak.py",
        "costs/simulator.py",
        "options.py",
    ):
        assert str(package / sub) in hashed, sub
