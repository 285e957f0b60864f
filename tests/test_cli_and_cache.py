"""The command line (every subcommand and flag), plan_dir, the plan cache on an Inductor cache hit, and
the multi-graph error."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import solve_anew, tiny_gpt, tiny_mlp
from test_graph_breaks import TwoHalves, _inputs

import recompile_opt
from recompile_opt import frontier, kept_files
from recompile_opt.cli import build_parser, main, parse_budget_arg
from recompile_opt.partitioner import MEMORY
from recompile_opt.plan import Plan


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
    with pytest.raises(SystemExit) as info:
        main(["diff", str(a), str(one)])
    assert info.value.code == 2 and re.search(r"a\.json holds 2 plan.*one\.json 1", capsys.readouterr().err)


def test_entry_point_backend_works_without_import():
    """backend="recompile_opt" resolves through the torch_dynamo_backends entry point."""
    code = (
        "import torch; from recompile_opt.models import MLP; m = MLP((4, 8, 4)); "
        "c = torch.compile(m, backend='recompile_opt', options={'compiler': 'eager'}); "
        "c(torch.randn(2, 4), torch.randn(2, 4)).backward(); print('ok')"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.stdout.strip().endswith("ok"), out.stderr[-2000:]


def test_plan_dir_writes_every_plan(tmp_path):
    model, inputs = tiny_mlp()
    compiled = torch.compile(
        model,
        backend="recompile_opt",
        options={"compiler": "eager", "plan_dir": str(tmp_path), "memory_budget": 0.5},
    )
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


def test_a_stored_plan_cut_short_is_read_as_missing_and_the_step_still_runs(tmp_path, monkeypatch):
    """A plan file cut short (a killed process, a full disk, or one read while another rank writes it)
    must not stop a compile that hits Inductor's cache: it read the file with ``json.loads`` and raised."""
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    model, inputs = tiny_mlp()

    def step():
        torch._dynamo.reset()
        recompile_opt.reset_plans()
        model.zero_grad()
        torch.compile(model, backend="recompile_opt", options={"memory_budget": 0.0})(*inputs).backward()
        return [p.grad.clone() for p in model.parameters()]

    cold = step()
    (stored,) = (tmp_path / "recompile_opt_plans").glob("*.json")
    stored.write_text(stored.read_text()[:40])
    hit = step()
    assert all(torch.equal(a, b) for a, b in zip(hit, cold, strict=True))
    assert recompile_opt.last_plans() == [], "a plan cut short is not replayed"


def test_kept_files_are_written_whole_or_not_at_all(tmp_path):
    """The files kept beside Inductor's caches: what cannot be written leaves the old file as it was and
    no temporary file; what cannot be read is missing."""
    path = tmp_path / "kept" / "answer.json"
    assert kept_files.write_json(path, {"x": [1, 2]}) and kept_files.read_json(path) == {"x": [1, 2]}
    assert not kept_files.write_json(path, {"x": object()})  # not JSON-able, found mid-write
    assert kept_files.read_json(path) == {"x": [1, 2]}
    assert sorted(p.name for p in path.parent.iterdir()) == ["answer.json"]
    path.write_text('{"x": [1,')
    assert kept_files.read_json(path) is None
    assert kept_files.read_json(tmp_path / "none.json") is None


def test_a_cache_hit_replays_the_plan_of_its_own_autocast_state(tmp_path, monkeypatch):
    """Under ``torch.autocast`` outside the compiled model the Dynamo graph is the same, the joint graph
    not (bf16 matmuls): compiled in fp32, then under bf16 autocast, then in fp32 again (an Inductor
    cache hit), the plan replayed is the fp32 one. It was the bf16 plan (CI: 48644 bytes planned where
    the compiled fp32 step kept 47620)."""
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    model, inputs = tiny_mlp()

    def compile_and_run(autocast: bool):
        torch._dynamo.reset()
        recompile_opt.reset_plans()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            loss = torch.compile(model, backend="recompile_opt", options={"memory_budget": 0.5})(*inputs)
        loss.backward()
        (plan,) = recompile_opt.last_plans()
        return plan

    fp32 = compile_and_run(False)
    bf16 = compile_and_run(True)
    assert {e.dtype for e in bf16.saved if e.bytes} != {e.dtype for e in fp32.saved if e.bytes}
    hit = compile_and_run(False)
    assert any("plan cache" in n for n in hit.notes), "expected an Inductor cache hit"
    assert hit.saved_names() == fp32.saved_names() and hit.saved_bytes == fp32.saved_bytes


@pytest.mark.slow
def test_a_cache_hit_replays_the_plan_of_its_own_fallback_random_setting(tmp_path, monkeypatch):
    """Inductor's caches key on ``fallback_random``; the plan cache must too. Compiled under True, then
    False, then True again (an Inductor cache hit), the plan replayed keeps eager's dropout as the
    compiled graph does; it was the plan stored under False, with Inductor's RNG prims recomputed."""
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    model, inputs = tiny_gpt(dropout=0.1)

    def compile_and_run(fallback_random):
        torch._dynamo.reset()
        recompile_opt.reset_plans()
        with torch._inductor.config.patch(fallback_random=fallback_random):
            torch.compile(model, backend="recompile_opt", options={"policy": "megatron-selective"})(
                *inputs
            ).backward()
        (plan,) = recompile_opt.last_plans()
        return plan

    def replayed(plan):  # Inductor's RNG prims recomputed (under True, eager's masks are kept instead)
        return [e.op for e in plan.recomputed if e.op == "prims.inductor_random"]

    assert not replayed(compile_and_run(True))
    assert replayed(compile_and_run(False))
    hit = compile_and_run(True)
    assert any("plan cache" in n for n in hit.notes), "expected an Inductor cache hit"
    assert not replayed(hit), hit.notes


# -- every subcommand and flag ---------------------------------------------------------------------


def two_halves():
    """A factory for the command line: a model Dynamo breaks into two graphs, and its inputs."""
    return TwoHalves(), _inputs()


def _plan_cli(tmp_path, capsys, *args) -> tuple[str, list[Plan]]:
    """``recompile-opt plan ARGS --json``: the printout and the plans written."""
    path = tmp_path / f"plan{len(list(tmp_path.glob('*.json')))}.json"
    main(["plan", *args, "--json", str(path)])
    data = json.loads(path.read_text())
    plans = [Plan.from_json(json.dumps(d)) for d in (data if isinstance(data, list) else [data])]
    return capsys.readouterr().out, plans


def test_budget_arg_reads_fractions_bytes_and_sizes():
    assert parse_budget_arg(None) is None
    assert parse_budget_arg("0.3") == 0.3 and isinstance(parse_budget_arg("0.0"), float)
    assert parse_budget_arg("65536") == 65536 and isinstance(parse_budget_arg("65536"), int)
    assert parse_budget_arg("64KiB") == "64KiB"  # the options parse the units


def test_plan_budget_in_bytes_and_in_units(tmp_path, capsys):
    """8 KiB binds on the tiny MLP: its no-budget plan keeps 8.75 KiB."""
    out_free, (free,) = _plan_cli(tmp_path, capsys, "helpers:tiny_mlp")
    out_int, (as_int,) = _plan_cli(tmp_path, capsys, "helpers:tiny_mlp", "--budget", "8192")
    out_unit, (as_unit,) = _plan_cli(tmp_path, capsys, "helpers:tiny_mlp", "--budget", "8KiB")
    assert "budget=none" in out_free and free.budget_bytes is None and free.saved_bytes > 8192
    for plan, out in ((as_int, out_int), (as_unit, out_unit)):
        assert plan.budget_bytes == plan.options["memory_budget"] == 8192
        assert plan.saved_bytes <= 8192 and plan.recomputed_names() - free.recomputed_names()
        assert "budget=8.00 KiB" in out
    assert as_unit.saved_names() == as_int.saved_names()


def test_plan_peak_flag(tmp_path, capsys):
    """The tiny MLP peaks at 26.28 KiB keeping everything, 24.53 KiB at least: 25 KiB needs a recompute."""
    _, (free,) = _plan_cli(tmp_path, capsys, "helpers:tiny_mlp")
    for peak in ("25KiB", "25600"):
        out, (plan,) = _plan_cli(tmp_path, capsys, "helpers:tiny_mlp", "--peak", peak)
        assert plan.peak_limit_bytes == plan.options["peak_memory"] == 25600, peak
        assert plan.predicted_peak_bytes <= 25600 < free.predicted_peak_bytes, peak
        assert (
            "peak_memory 25.00 KiB: the least-recompute plan whose peak fits (peak walked in Inductor" in out
        ), peak
        assert plan.recomputed_names() - free.recomputed_names(), peak


def test_plan_policy_flag(tmp_path, capsys):
    _, (auto,) = _plan_cli(tmp_path, capsys, "helpers:tiny_mlp")
    out, (save_all,) = _plan_cli(tmp_path, capsys, "helpers:tiny_mlp", "--policy", "save-all")
    assert "policy=save-all" in out and save_all.policy == "save-all" and save_all.solver["name"] == "policy"
    assert (
        save_all.recompute_flops == 0 and save_all.saved_bytes == save_all.baseline_bytes > auto.saved_bytes
    )
    with pytest.raises(SystemExit):  # argparse: not one of the choices
        main(["plan", "helpers:tiny_mlp", "--policy", "selective"])
    assert "invalid choice: 'selective'" in capsys.readouterr().err


def test_plan_solver_flag(tmp_path, capsys):
    """(CBC's plans against HiGHS's: test_options.test_cbc_through_plan_keeps_what_highs_keeps.)"""
    out, (cbc,) = _plan_cli(tmp_path, capsys, "helpers:tiny_mlp", "--budget", "7000", "--solver", "cbc")
    assert "solver            : cbc optimal" in out
    assert cbc.solver["name"] == cbc.options["solver"] == "cbc" and cbc.saved_bytes <= 7000
    _, (highs,) = _plan_cli(tmp_path, capsys, "helpers:tiny_mlp", "--budget", "7000")
    assert highs.solver["name"] == "highs" and highs.saved_names() == cbc.saved_names()


# -- bad input: one line on stderr, status 2, no traceback -------------------------------------------


@pytest.mark.parametrize(
    "args,message",
    [
        (
            ["show", "nonexist.json"],
            "recompile-opt show: error: cannot read nonexist.json: No such file or directory",
        ),
        (
            ["plan", "recompile_opt.models:nope"],
            "recompile-opt plan: error: module 'recompile_opt.models' has no factory 'nope'; its functions "
            "without required arguments: demo_gpt, demo_gpt_vocab_2048, demo_llama, demo_encoder, "
            "gpt3_175b_layer",
        ),
        (
            ["plan", "recompile_opt.models:demo_gpt", "--budget", "2 gigs"],
            "recompile-opt plan: error: option 'memory_budget': unknown unit 'gigs' in '2 gigs'; "
            "accepted units: ['b', 'gb', 'gib', 'kb', 'kib', 'mb', 'mib', 'tb', 'tib']",
        ),
    ],
    ids=["missing-file", "missing-factory", "bad-unit"],
)
def test_bad_input_from_the_shell_is_one_line_and_status_2(tmp_path, args, message):
    """Issue 26: each printed a raw traceback. The installed ``recompile-opt`` command, as a user runs it."""
    exe = Path(sys.executable).with_name("recompile-opt")
    run = subprocess.run([str(exe), *args], capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert (run.returncode, run.stderr, run.stdout) == (2, message + "\n", "")


@pytest.mark.parametrize(
    "args,message",
    [
        (["plan", "helpers.tiny_mlp"], "expected MODULE:FACTORY, got 'helpers.tiny_mlp'"),
        (
            ["plan", "no_such_module:f"],
            "cannot import 'no_such_module' (in 'no_such_module:f'): no module named 'no_such_module'",
        ),
        (
            ["plan", "recompile_opt.nope:f"],
            "cannot import 'recompile_opt.nope' (in 'recompile_opt.nope:f'): no "
            "module named 'recompile_opt.nope'",
        ),
        (["plan", "helpers:tiny_mlp", "--peak", "lots"], "option 'peak_memory': cannot read 'lots'"),
        (
            ["plan", "helpers:tiny_mlp", "--budget", "1.5"],
            "option 'memory_budget': the fraction 1.5 is outside [0, 1]",
        ),
        (["demo", "--budget", "2 gigs"], "option 'memory_budget': unknown unit 'gigs'"),
        (["frontier", "helpers:tiny_mlp", "--budgets", "0,x"], "--budgets: 'x' is not a fraction in [0, 1]"),
        (["show", "{tmp}"], "cannot read {tmp}: Is a directory"),
        (
            ["show", "{tmp}/text.json"],
            "{tmp}/text.json is not JSON (Expecting value: line 1 column 1 (char 0))",
        ),
        (
            ["show", "{tmp}/other.json"],
            "{tmp}/other.json holds no plan written by 'recompile-opt plan --json' (KeyError: 'saved')",
        ),
        (
            ["plan", "helpers:tiny_mlp", "--json", "{tmp}/no/such/dir/p.json"],
            "cannot write {tmp}/no/such/dir/p.json: No such file or directory",
        ),
    ],
)
def test_bad_input_is_one_line_and_status_2(tmp_path, capsys, args, message):
    (tmp_path / "text.json").write_text("not json")
    (tmp_path / "other.json").write_text('{"a": 1}')
    args = [a.format(tmp=tmp_path) for a in args]
    with pytest.raises(SystemExit) as info:
        main(args)
    err = capsys.readouterr().err
    assert info.value.code == 2 and err.count("\n") == 1, err
    assert err.startswith(f"recompile-opt {args[0]}: error: {message.format(tmp=tmp_path)}"), err


@pytest.fixture
def fresh_split():
    MEMORY.forget_budget_shares()
    yield
    MEMORY.forget_budget_shares()


def test_plan_and_show_a_model_of_several_graphs(tmp_path, capsys, fresh_split):
    """One byte budget for the model's two graphs; the file holds both plans, and show prints both."""
    out, plans = _plan_cli(tmp_path, capsys, "test_cli_and_cache:two_halves", "--budget", "100KiB")
    assert len(plans) == 2 and plans[0].graph != plans[1].graph
    assert [p.graph for p in recompile_opt.last_plans()[-2:]] == [p.graph for p in plans]
    assert (
        out.index("== graph 1 of 2 ==")
        < out.index(f"graph={plans[0].graph}")
        < out.index("== graph 2 of 2 ==")
        < out.index(f"graph={plans[1].graph}")
    )
    assert sum(p.saved_bytes for p in plans) <= 102_400 < sum(p.baseline_bytes for p in plans)
    path = sorted(tmp_path.glob("*.json"))[-1]
    main(["show", str(path)])
    shown = capsys.readouterr().out
    assert re.findall(r"recompile_opt plan  graph=(\w+)", shown) == [p.graph for p in plans]
    assert shown == "".join(str(p) + "\n" for p in plans)


def test_demo_flags_reach_the_demo(monkeypatch):
    from recompile_opt import demo

    calls = []
    monkeypatch.setattr(demo, "run_demo", lambda **kw: calls.append(kw))
    main(["demo"])
    main(["demo", "--budget", "64KiB", "--steps", "2", "--compiler", "eager"])
    main(["demo", "--budget", "65536"])
    assert calls == [
        {"budget": 0.0, "steps": 6, "compiler": "inductor"},
        {"budget": "64KiB", "steps": 2, "compiler": "eager"},
        {"budget": 65536, "steps": 6, "compiler": "inductor"},
    ]
    assert [type(c["budget"]) for c in calls] == [float, str, int]  # a fraction, a size, bytes


def test_the_demo_plans_once_at_its_first_call_and_shows_that_plan(monkeypatch, capsys):
    """The plan the demo prints is the one its compile made and trained, and the first call's time
    counts that planning: no planning before it left its peaks and solves on disk for the compile to
    read (the demo GPT's first call showed 93 s; cold it takes 171 s). Tiny sizes, and the plain
    variant on the eager backend: what is checked here is the demo, not Inductor."""
    from recompile_opt import demo, models

    monkeypatch.setattr(demo, "demo_gpt", lambda: models.demo_gpt(n_layer=1, n_embd=32, seq=16, batch=2))
    real = torch.compile
    monkeypatch.setattr(
        torch,
        "compile",
        lambda m, backend, options=None: real(
            m, backend="eager" if backend == "inductor" else backend, options=options
        ),
    )
    planned_before = []
    monkeypatch.setattr(recompile_opt, "plan", lambda *a, **kw: planned_before.append(kw))
    rows = demo.run_demo(budget=0.5, steps=1, compiler="eager")
    out = capsys.readouterr().out
    (plan,) = recompile_opt.last_plans()
    assert planned_before == []
    assert plan.summary() in out and out.index(plan.summary()) < out.index("variant")
    assert rows[1]["compile_s"] >= plan.solver["plan_s"] > 0


@pytest.mark.slow
def test_demo_runs_from_the_shell():
    """``recompile-opt demo`` as README's set-up runs it (about 2 minutes on 2 cores, most of it Inductor
    building plain torch.compile's kernels): both variants measured, then the plan; ours keeps for
    backward what its plan says, less than plain torch.compile."""
    exe = Path(sys.executable).with_name("recompile-opt")
    env = {**os.environ, "TORCHINDUCTOR_COMPILE_THREADS": "1"}
    run = subprocess.run(
        [str(exe), "demo", "--budget", "20MiB", "--steps", "1", "--compiler", "eager"],
        capture_output=True,
        text=True,
        timeout=900,
        env=env,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    out = run.stdout
    assert "budget='20MiB'; compiler=eager" in out and "budget=20.00 MiB" in out
    planned = re.search(r"kept for backward : (\S+ \w+) of", out).group(1)
    rows = {
        m.group(1).strip(): m.group(2)
        for m in re.finditer(
            r"^(torch\.compile \(inductor\)|recompile_opt budget=20MiB)\s+(\S+ \w+)\s", out, re.M
        )
    }
    assert rows["recompile_opt budget=20MiB"] == planned, out
    assert float(planned.split()[0]) <= 20 < float(rows["torch.compile (inductor)"].split()[0]), out


def test_frontier_flags_reach_the_sweep(tmp_path, capsys, monkeypatch):
    """--measure, --steps and --compiler go to the measurement (stubbed here: the real one is below).
    (--md: test_docs.test_frontier_md_opens_with_the_header_line.)"""
    calls = []
    monkeypatch.setattr(frontier, "measure_points", lambda model, inputs, points, **kw: calls.append(kw))
    main(
        [
            "frontier",
            "helpers:tiny_mlp",
            "--budgets",
            "1",
            "--no-pytorch",
            "--out",
            str(tmp_path / "f"),
            "--measure",
            "--steps",
            "2",
            "--compiler",
            "inductor",
        ]
    )
    assert [(c["compiler"], c["steps"]) for c in calls] == [("inductor", 2)]
    assert "| ilp 1 | ilp |" in capsys.readouterr().out
    calls.clear()
    main(["frontier", "helpers:tiny_mlp", "--budgets", "1", "--no-pytorch", "--out", str(tmp_path / "g")])
    assert calls == []  # no --measure: nothing trained


def test_frontier_defaults():
    args = build_parser().parse_args(["frontier"])
    assert (
        args.factory,
        args.budgets,
        args.out,
        args.md,
        args.measure,
        args.steps,
        args.compiler,
        args.no_pytorch,
    ) == ("recompile_opt.models:demo_gpt", None, "frontier", None, False, 3, "eager", False)
    assert frontier.BUDGETS[0] == 0.0 and frontier.BUDGETS[-1] == 1.0 and len(frontier.BUDGETS) == 21


def test_frontier_measure(tmp_path, capsys):
    """--measure trains every point (eager compiler): the bytes saved for backward are the kept bytes
    the table estimates, for each row."""
    md = tmp_path / "f.md"
    main(
        [
            "frontier",
            "helpers:tiny_mlp",
            "--budgets",
            "1",
            "--no-pytorch",
            "--out",
            str(tmp_path / "f"),
            "--measure",
            "--steps",
            "1",
            "--md",
            str(md),
        ]
    )
    head, _, *rows = [line.split(" | ") for line in md.read_text().splitlines() if line.startswith("|")]
    col = {name.strip("| "): i for i, name in enumerate(head)}
    assert len(rows) == 4
    for row in rows:
        assert row[col["meas. saved MiB"]] == row[col["kept MiB"]], row
        assert float(row[col["meas. peak MiB"]]) > 0 and float(row[col["meas. step ms"]]) > 0, row


@pytest.fixture
def new_process(monkeypatch, tmp_path):
    """Caches on disk under ``tmp_path``; calling the fixture forgets what this process keeps in memory,
    as a new process would start."""
    from collections import OrderedDict

    def forget():
        monkeypatch.setattr(MEMORY, "range_ends", {})
        monkeypatch.setattr(MEMORY, "peaks", OrderedDict())

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    forget()
    return forget


def test_a_new_process_finds_the_peaks_the_last_one_simulated_and_walked(monkeypatch, tmp_path, new_process):
    """The least-peak search's simulations and walks are kept on disk by graph, and its ILP answers by
    model: a later process planning the same graph at another budget simulates nothing again, solves
    only its own budget's models, and plans what it would have."""
    from recompile_opt.costs import simulator

    model, inputs = tiny_gpt()
    first = recompile_opt.plan(model, inputs, memory_budget=0.0)
    assert first.solver["simulations"] > 0 and list((tmp_path / "recompile_opt_peaks").glob("*.json"))
    assert first.solver["solves_recalled"] == 0 and list((tmp_path / "recompile_opt_solves").rglob("*.json"))
    new_process()
    second = recompile_opt.plan(model, inputs, memory_budget=0.5)
    assert second.solver["simulations"] == 0, second.solver
    # the range's ends (the least bytes, the least-peak search) were solved by the first process
    assert 0 < second.solver["solves_recalled"] < second.solver["solves"], second.solver
    assert f"({second.solver['solves_recalled']} read from disk)" in str(second)
    new_process()
    monkeypatch.setattr(simulator, "_load", lambda key: None)
    solve_anew(monkeypatch)
    unaided = recompile_opt.plan(model, inputs, memory_budget=0.5)
    assert unaided.solver["simulations"] > 0 and unaided.solver["solves_recalled"] == 0
    assert (second.saved_names(), second.recomputed_names()) == (
        unaided.saved_names(),
        unaided.recomputed_names(),
    )
    assert second.predicted_peak_bytes == unaided.predicted_peak_bytes


def test_a_new_process_finds_where_the_last_one_walked_each_peak(new_process):
    """What is alive at each walked peak is kept on disk with the peak: planned again in a new process,
    the least-peak plan says where it peaks as the first did, so the chunk choice (which reads it) makes
    the same plan. Without it the demo GPT got 21.78 MiB from a warm cache, 18.53 cold."""
    model, inputs = tiny_gpt()
    first = recompile_opt.plan(model, inputs, memory_budget=0.0)
    assert first.solver["peak_from"] == "inductor-code" and first.walked_breakdown["bytes"]
    new_process()
    second = recompile_opt.plan(model, inputs, memory_budget=0.0)
    assert second.walked_breakdown == first.walked_breakdown
    assert (second.saved_names(), second.chunks) == (first.saved_names(), first.chunks)
