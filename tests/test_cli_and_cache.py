"""The command line, plan_dir, the plan cache on an Inductor cache hit, and the multi-graph error."""

import json
import subprocess
import sys

import pytest
import torch

import recompile_opt
from recompile_opt.cli import main

from helpers import tiny_mlp


def test_plan_show_and_diff(tmp_path, capsys):
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    main(["plan", "helpers:tiny_mlp", "--json", str(a)])
    main(["plan", "helpers:tiny_mlp", "--budget", "0.0", "--json", str(b)])
    out = capsys.readouterr().out
    assert "recompile_opt plan" in out and "kept (" in out
    main(["show", str(b)])
    assert "budget=" in capsys.readouterr().out
    main(["diff", str(a), str(b)])
    diff = capsys.readouterr().out
    assert "plan diff: kept" in diff and "keep ->" in diff and "recompute" in diff


def test_diff_of_files_holding_several_graphs_plans(tmp_path, capsys):
    # `recompile-opt plan --json` writes a list for a model of several graphs: diff goes graph by graph
    model, inputs = tiny_mlp()
    plans = [recompile_opt.plan(model, inputs, memory_budget=f) for f in (None, 0.0)]
    a, b, one = tmp_path / "a.json", tmp_path / "b.json", tmp_path / "one.json"
    a.write_text(json.dumps([plans[0].to_dict(), plans[0].to_dict()]))
    b.write_text(json.dumps([plans[1].to_dict(), plans[1].to_dict()]))
    one.write_text(plans[1].to_json())
    main(["diff", str(a), str(b)])
    assert capsys.readouterr().out.count("plan diff: kept") == 2
    with pytest.raises(SystemExit, match="2 plan.*1"):
        main(["diff", str(a), str(one)])


def test_entry_point_backend_works_without_import():
    """backend="recompile_opt" resolves through the torch_dynamo_backends entry point."""
    code = ("import torch; from recompile_opt.models import MLP; m = MLP((4, 8, 4)); "
            "c = torch.compile(m, backend='recompile_opt', options={'compiler': 'eager'}); "
            "c(torch.randn(2, 4), torch.randn(2, 4)).backward(); print('ok')")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.stdout.strip().endswith("ok"), out.stderr[-2000:]


def test_plan_dir_writes_every_plan(tmp_path):
    model, inputs = tiny_mlp()
    compiled = torch.compile(model, backend="recompile_opt",
                             options={"compiler": "eager", "plan_dir": str(tmp_path), "memory_budget": 0.5})
    compiled(*inputs).backward()
    files = list(tmp_path.glob("plan_*.json"))
    assert len(files) == 1
    plan = recompile_opt.Plan.from_json(files[0].read_text())
    assert plan.saved_bytes == recompile_opt.last_plans()[-1].saved_bytes


def test_inductor_cache_hit_replays_the_plan_and_options_change_the_key(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    model, inputs = tiny_mlp()

    def compile_and_run(options):
        torch._dynamo.reset()
        recompile_opt.reset_plans()
        torch.compile(model, backend="recompile_opt", options=options)(*inputs).backward()
        return recompile_opt.last_plans()

    (cold,) = compile_and_run({"memory_budget": 0.0})
    (hit,) = compile_and_run({"memory_budget": 0.0})
    assert any("plan cache" in n for n in hit.notes), "expected an Inductor cache hit"
    assert hit.saved_names() == cold.saved_names()
    (other,) = compile_and_run({"memory_budget": 1.0})
    assert not any("plan cache" in n for n in other.notes)
    assert other.saved_bytes > cold.saved_bytes
