"""bench/compare.py (its pieces in bench/comparison/, re-exported by the script): aggregation, the
headline and full markdown tables, the report's provenance line, the Pareto check on synthetic rows,
and one tiny real run through ``main()`` (eager-selective and ours with the eager compiler: no Inductor
code generation; two workers at once, < 60 s)."""

import importlib.util
import json
import sys
from pathlib import Path

import pytest

MiB = 1 << 20
_PATH = Path(__file__).resolve().parents[1] / "bench" / "compare.py"
_spec = importlib.util.spec_from_file_location("bench_compare", _PATH)
compare = importlib.util.module_from_spec(_spec)
sys.modules["bench_compare"] = compare
_spec.loader.exec_module(compare)


def run(name, step_ms, peak_mib, *, rnd=1, cache="cold", **extra):
    """A fake worker result: every step takes ``step_ms``."""
    return {
        "strategy": name,
        "round": rnd,
        "cache": cache,
        "first_step_s": 60.0 if cache == "cold" else 5.0,
        "step_s": [step_ms / 1e3] * 5,
        "step_median_s": step_ms / 1e3,
        "max_grad_diff": 0.0,
        "graphs": 1,
        "recompiles": 0,
        "loadavg_1m": 0.0,
        "saved_bytes": peak_mib * MiB // 2,
        "peak_bytes": peak_mib * MiB,
        **extra,
    }


def point(name, step_ms, peak_mib):
    return {"strategy": name, "step_ms": step_ms, "peak_bytes": peak_mib * MiB}


def test_aggregate_medians_spread_and_cold_warm_compile():
    runs = [
        run(
            "ours-0.5",
            100,
            30,
            recompute_flops=2e9,
            plan_recompute_flops=2e9,
            kernels_built=30,
            kernel_build_s=40.0,
            plan_s=6.0,
        ),
        run("ours-0.5", 120, 30, rnd=2, cache="warm", kernels_built=0, kernel_build_s=0.0, plan_s=6.0),
        run("ours-0.5", 110, 30, rnd=3, cache="warm", kernels_built=0, kernel_build_s=0.0, plan_s=6.0),
    ]
    runs[1]["step_s"] = [0.09, 0.12, 0.15]
    row = compare.aggregate("ours-0.5", runs)
    assert row["processes"] == 3
    assert row["step_ms"] == pytest.approx(110)  # median of the process medians
    assert (row["step_ms_min"], row["step_ms_max"]) == (pytest.approx(90), pytest.approx(150))
    assert row["compile_s"] == 60.0 and row["warm_first_s"] == 5.0  # compile time from the cold run only
    assert row["kernels_built"] == 30  # and the kernels it built (the warm runs built none)
    assert (row["kernel_build_s"], row["plan_s"]) == (40.0, 6.0)  # and what its compile spent
    assert row["recompute_flops"] == 2e9  # counted in round 1 only (warm caches skip the pass)
    assert "notes" not in row


def test_aggregate_error_row_and_partial_failure():
    runs = [{"strategy": "rockmate", "error": "RuntimeError: rockmate 1.0.1: no solution", "round": 1}]
    row = compare.aggregate("rockmate", runs)
    assert row["processes"] == 0 and row["error"].startswith("RuntimeError")
    table = compare.markdown_table([row])
    assert "ERROR: RuntimeError: rockmate 1.0.1: no solution" in table
    assert table.splitlines()[-1].count("—") >= 10  # no figures, no crash

    row = compare.aggregate("ours-0.2", [run("ours-0.2", 100, 30), {"strategy": "ours-0.2", "error": "x"}])
    assert row["processes"] == 1 and row["error"] == "x" and row["step_ms"] == 100

    row = compare.aggregate("compile", [])
    assert row["notes"] == ["not run (interrupted)"]


def test_aggregate_flags_memory_spread():
    row = compare.aggregate("eager", [run("eager", 100, 30), run("eager", 100, 31, rnd=2)])
    assert any("peak_bytes varies" in n for n in row["notes"])


def test_markdown_header_marks_measured_counted_estimated():
    header = compare.markdown_table([]).splitlines()[0]
    assert "peak MiB [M]" in header and "recompute GFLOP [C]" in header and "plan peak MiB [E]" in header
    assert "**M** measured" in compare.LEGEND and "**E** our" in compare.LEGEND


def cells(table: str) -> dict:
    """A markdown table as {strategy: {column header: cell}}."""
    head, _, *body = [[c.strip() for c in line.strip("|").split("|")] for line in table.splitlines()]
    return {row[0]: dict(zip(head, row, strict=True)) for row in body}


def test_headline_table_repeats_the_full_tables_figures():
    rows = [
        compare.aggregate("ours-0.5", [run("ours-0.5", 100, 30, recompute_flops=2e9)]),
        compare.aggregate("rockmate", [{"strategy": "rockmate", "error": "boom"}]),
    ]
    head = compare.headline_table(rows).splitlines()[0]
    assert head == (
        "| strategy | peak MiB [M] | step ms median [M] | recompute GFLOP [C] | kept (saved) MiB [M] |"
    )
    short, full = cells(compare.headline_table(rows)), cells(compare.markdown_table(rows))
    assert short["ours-0.5"] == {
        "strategy": "ours-0.5",
        "peak MiB [M]": "30.00",
        "step ms median [M]": "100.0",
        "recompute GFLOP [C]": "2.000",
        "kept (saved) MiB [M]": "15.00",
    }
    for name, row in short.items():  # the same figures, formatted the same, as the full table's
        assert row["kept (saved) MiB [M]"] == full[name]["saved MiB [M]"]
        assert all(row[k] == full[name][k] for k in row if k != "kept (saved) MiB [M]"), name
    assert set(short["rockmate"].values()) == {"rockmate", "—"}


def test_report_opens_with_the_provenance_line_then_the_headlines():
    args = compare.parse_args(["--layers", "1"])
    rows = [compare.aggregate("eager", [run("eager", 100, 30)])]
    group = {"config": compare.group_configs(args)[0], "rows": rows, "pareto": compare.pareto_check(rows)}
    text = compare.report_markdown(
        [group],
        header="torch X; CPU; 2026-01-01",
        command="python bench/compare.py",
        settings={},
        wall_s=60.0,
    )
    lines = text.splitlines()
    assert lines[0] == "torch X; CPU; 2026-01-01" and lines[1] == ""
    assert lines[2] == f"**{compare.group_title(group['config'])}**"
    assert lines[4].startswith("| strategy | peak MiB [M] |")
    assert text.index("| strategy | peak MiB [M] |") < text.index("### gpt small") < text.index("Columns:")


def test_dominance_needs_lower_peak_and_more_than_noise_faster():
    a, b = point("a", 100, 30), point("b", 115, 30)
    assert compare.dominates(a, b)  # same peak, 13% faster
    assert not compare.dominates(a, point("c", 105, 30))  # within the 10% noise
    assert not compare.dominates(a, point("d", 200, 29))  # faster but more memory
    assert compare.covers(point("e", 108, 29), point("f", 100, 30))  # on or below: 8% slower counts
    assert not compare.covers(point("g", 112, 29), point("h", 100, 30))


def test_pareto_check_statuses():
    rows = [
        point("eager", 200, 48),
        point("compile", 180, 46),
        point("compile-amb-0.5", 158, 30),
        point("eager-full-ckpt", 300, 29),
        point("compile-amb-0.0", 250, 20),
        point("ours-none", 175, 46),
        point("ours-0.5", 220, 32),
        point("ours-0.0", 260, 24),
        {"strategy": "rockmate", "error": "boom"},
    ]
    check = compare.pareto_check(rows, noise=0.10)
    ours = {e["strategy"]: e for e in check["ours"]}
    assert ours["ours-none"]["status"] == "frontier"
    assert ours["ours-0.5"] == {"strategy": "ours-0.5", "status": "dominated", "by": ["compile-amb-0.5"]}
    assert ours["ours-0.0"]["status"] == "frontier"  # compile-amb-0.0 has less memory but is not faster

    others = {e["strategy"]: e for e in check["others"]}
    assert others["eager"]["status"] == "dominated" and others["eager"]["by"] == ["ours-none"]
    assert others["compile"] == {"strategy": "compile", "status": "matched", "by": ["ours-none"]}
    assert others["eager-full-ckpt"]["status"] == "dominated" and others["eager-full-ckpt"]["by"] == [
        "ours-0.0"
    ]
    amb = others["compile-amb-0.5"]
    assert amb["status"] == "not covered"
    assert amb["nearest"]["strategy"] == "ours-0.0" and amb["nearest"]["slowdown"] == pytest.approx(260 / 158)
    assert others["compile-amb-0.0"] == {
        "strategy": "compile-amb-0.0",
        "status": "not covered",
        "by": [],
        "least_ours_peak_bytes": 24 * MiB,
    }
    assert check["no_figures"] == ["rockmate"]

    text = compare.pareto_markdown(rows, check)
    assert "`ours-0.5` (32.00 MiB, 220.0 ms): dominated by `compile-amb-0.5` (30.00 MiB, 158.0 ms)" in text
    assert "`ours-none` (46.00 MiB, 175.0 ms): on the frontier" in text
    assert "is 1.65x slower" in text and "no ours point reaches its peak (least ours peak 24.00 MiB)" in text
    assert (
        "Summary: ours is on or below 3 of 5 other measured points; not below `compile-amb-0.5`, "
        "`compile-amb-0.0`." in text
    )


def test_group_configs_presets_and_overrides():
    args = compare.parse_args(
        ["--model", "gpt,llama", "--size", "small,medium", "--layers", "3", "--dropout", "0.1"]
    )
    cfgs = compare.group_configs(args)
    assert [(c["model"], c["size"]) for c in cfgs] == [
        ("gpt", "small"),
        ("gpt", "medium"),
        ("llama", "small"),
        ("llama", "medium"),
    ]
    assert all(c["layers"] == 3 for c in cfgs)  # an explicit flag overrides every preset
    assert cfgs[1]["embd"] == compare.SIZES["medium"]["embd"]
    assert cfgs[0]["dropout"] == 0.1 and cfgs[2]["dropout"] == 0.0  # Llama has no dropout
    with pytest.raises(SystemExit):
        compare.group_configs(compare.parse_args(["--size", "huge"]))


def test_external_runner_missing_is_an_error_row(tmp_path, monkeypatch):
    args = compare.parse_args(["--rockmate-python", sys.executable])
    cfg = compare.group_configs(args)[0]
    monkeypatch.setitem(
        compare.STRATEGIES,
        "rockmate",
        {**compare.STRATEGIES["rockmate"], "runner": compare.REPO / "bench" / "nope.py"},
    )
    assert compare.spawn_worker("rockmate", cfg, args) == {
        "strategy": "rockmate",
        "error": "bench/nope.py missing",
    }
    args = compare.parse_args(["--rockmate-python", str(tmp_path / "python")])
    monkeypatch.setitem(
        compare.STRATEGIES,
        "rockmate",
        {**compare.STRATEGIES["rockmate"], "runner": compare.REPO / "bench" / "compare.py"},
    )
    assert "no interpreter at" in compare.spawn_worker("rockmate", cfg, args)["error"]


def test_tiny_run_through_main(tmp_path, capsys):
    out = tmp_path / "out.json"
    argv = [
        "--layers",
        "1",
        "--embd",
        "32",
        "--seq",
        "16",
        "--batch",
        "2",
        "--steps",
        "2",
        "--warmup",
        "1",
        "--repeats",
        "1",
        "--strategies",
        "eager-selective,ours-0.5,ours-peak-64MiB",
        "--ours-compiler",
        "eager",
        "--jobs",
        "2",
        "--timeout",
        "600",  # a stuck worker fails this test before pytest's limit
        "--json",
        str(out),
        "--csv",
        str(tmp_path / "out.csv"),
        "--md",
        str(tmp_path / "out.md"),
    ]
    assert compare.main(argv) == 0
    data = json.loads(out.read_text())
    (group,) = data["groups"]
    assert group["config"]["model"] == "gpt" and group["config"]["embd"] == 32
    rows = {r["strategy"]: r for r in group["rows"]}
    for name, row in rows.items():
        assert "error" not in row, (name, row)
        for key in ("step_ms", "compile_s", "saved_bytes", "peak_bytes", "max_grad_diff", "kernels_built"):
            assert row[key] is not None, (name, key)
        assert row["max_grad_diff"] < 1e-5
    # selective recompute reruns QK^T, 2 (b heads) s^2 d FLOPs; checkpoint's early stop skips @V,
    # whose output no backward reads
    assert rows["eager-selective"]["recompute_flops"] == 2 * (2 * 4) * 16 * 16 * 8
    assert rows["eager-selective"]["saved_bytes"] < 148612  # eager's saved bytes (torch 2.13)
    assert rows["ours-0.5"]["plan_saved_bytes"] > 0 and rows["ours-0.5"]["plan_recompute_flops"] >= 0
    assert rows["ours-0.5"]["plan_s"] > 0 and "plan_s" not in rows["eager-selective"]
    assert all(row["kernel_build_s"] == 0.0 for row in rows.values())  # no Inductor: no C++ builds
    assert "recompute_flops" not in rows["ours-0.5"]  # no Inductor post-grad pass with compiler=eager
    assert 0 < rows["ours-peak-64MiB"]["plan_predicted_peak_bytes"] <= 64 * MiB  # the limit reached the plan
    assert {e["strategy"] for e in group["pareto"]["ours"]} == {"ours-0.5", "ours-peak-64MiB"}
    report = (tmp_path / "out.md").read_text()
    assert "| eager-selective |" in report and "Pareto check" in report
    header = report.splitlines()[0]  # provenance.header_line(): versions, machine, load, date
    assert header.startswith("torch ") and "recompile_opt" in header and "load" in header
    assert group["config"]["provenance"] == header
    assert capsys.readouterr().out.startswith(header + "\n")
    assert report.index("| strategy | peak MiB [M] |") < report.index("| strategy | step ms median [M] |")
    assert (tmp_path / "out.csv").read_text().startswith("model,size,strategy,")


def test_peak_strategies_take_any_size_with_units_and_bad_names_say_what_is_accepted():
    assert compare.strategy("ours-peak-27MiB") == {"kind": "ours", "options": {"peak_memory": "27MiB"}}
    assert compare.strategy("ours-0.2") is compare.STRATEGIES["ours-0.2"]
    with pytest.raises(KeyError, match="peak_memory.*units"):
        compare.strategy("ours-peak-27")
    with pytest.raises(KeyError, match="ours-peak-SIZE"):
        compare.strategy("ours-0.3")
    with pytest.raises(SystemExit, match="unknown strategy 'nope'"):
        compare.main(["--strategies", "compile,nope"])


def test_job_lock_keeps_timed_sections_alone(tmp_path):
    import fcntl

    path = str(tmp_path / "lock")
    compiling, timing, probe = compare.JobLock(path), compare.JobLock(path), compare.JobLock(path)
    compiling.shared()
    timing.shared()  # starts and compiles overlap
    with pytest.raises(BlockingIOError):  # a timed section waits while anyone compiles
        fcntl.flock(probe.file, fcntl.LOCK_EX | fcntl.LOCK_NB)
    compiling.release()
    with timing.exclusive():
        with pytest.raises(BlockingIOError):  # and a new start waits while someone is timed
            fcntl.flock(probe.file, fcntl.LOCK_SH | fcntl.LOCK_NB)
    fcntl.flock(probe.file, fcntl.LOCK_SH | fcntl.LOCK_NB)
    probe.release()
    timing.release()
    with compare.JobLock("").exclusive():  # --jobs 1: no lock file, nothing to wait for
        pass


def test_rockmate_runner_loads_measure_without_our_package():
    """Rockmate's venv has torch but not recompile_opt (nor PuLP): the runner loads models.py and
    measure.py by path, and measure.py reaches our _torch_internals through a bare package."""
    import subprocess
    import textwrap

    code = textwrap.dedent(f"""
        import importlib.abc, sys
        class NotInstalled(importlib.abc.MetaPathFinder):
            def find_spec(self, name, path=None, target=None):
                if name == "recompile_opt":
                    raise ImportError("recompile_opt is not installed here")
        sys.meta_path.insert(0, NotInstalled())
        sys.path.insert(0, {str(_PATH.parent)!r})
        import rockmate_runner, torch
        measure = rockmate_runner.load_file_module(
            "ro_measure", rockmate_runner.REPO / "recompile_opt" / "costs" / "measure.py")
        print(measure.memory_profile(lambda: torch.empty(1024, 256)).peak_bytes, "pulp" in sys.modules)
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == [str(MiB), "False"]


def test_the_chunks_in_place_products_count_their_flops():
    """A chunked MLP's backward accumulates its weights' gradients with a custom op that mutates
    (functionalised in the graph): each counts as its matmul, so the benchmark's recompute figure
    is not short of them (it raised on them before)."""
    import torch
    from helpers import tiny_gpt
    from test_chunking import EAGER

    from recompile_opt._torch_internals import functionalized_call
    from recompile_opt.compile_paths import compile_eager
    from recompile_opt.options import parse_options
    from recompile_opt.partitioner import RecompilePartitioner

    model, inputs = tiny_gpt()
    partitioner = RecompilePartitioner(parse_options({"chunks": {"mlp": 4}, **EAGER}))
    torch.compile(model, backend=lambda gm, ex: compile_eager(gm, ex, partitioner))(*inputs).backward()
    products = [n for n in partitioner.last_backward.graph.nodes if functionalized_call(n)]
    assert products
    for n in products:
        _, (total, a, b) = functionalized_call(n)
        rows, m = a.meta["val"].shape[-2:]
        want = 2 * rows * m * b.meta["val"].shape[-1]
        assert compare.node_flops(n) == want, (n.name, compare.node_flops(n), want)
