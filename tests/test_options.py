"""Every option: each accepted value reaches the planner and does what README's "Options" table says;
bad input gets a clear error naming the option and what it accepts, also through torch.compile."""

import warnings
from pathlib import Path

import pytest
import torch
from helpers import solve_anew, tiny_gpt, tiny_mlp, train_side_by_side

import recompile_opt
from recompile_opt.options import (
    DEFAULT_ROOFLINE,
    OptionError,
    Options,
    parse_budget,
    parse_bytes,
    parse_options,
)
from recompile_opt.planner import ilp


@pytest.mark.parametrize(
    "raw,match",
    [
        ({"memroy_budget": 1}, r"unknown recompile_opt option\(s\) \['memroy_budget'\].*accepted options"),
        ({"memory_budget": -5}, r"'memory_budget'.*-5.*>= 0"),
        ({"memory_budget": "512"}, r"'memory_budget'.*'512' has no units"),
        ({"memory_budget": "5 parsecs"}, r"unknown unit 'parsecs'.*accepted units"),
        ({"memory_budget": 1.5}, r"'memory_budget'.*outside \[0, 1\]"),
        (
            {"memory_budget": True},
            r"'memory_budget'.*bool.*float fraction in \[0, 1\].*int of bytes.*'512MiB'",
        ),
        ({"memory_budget": [1]}, r"'memory_budget'.*list \[1\].*float fraction in \[0, 1\].*int of bytes"),
        ({"peak_memory": "lots"}, r"'peak_memory'.*cannot read 'lots'"),
        ({"policy": "magic"}, r"'policy'.*'magic'.*\['auto', 'save-all', 'full', 'megatron-selective'\]"),
        ({"solver": "gurobi"}, r"'solver'.*\['cbc', 'highs'\]"),
        ({"strict": "yes"}, r"'strict'.*True, False"),
        ({"time_limit_s": 0}, r"'time_limit_s'.*positive"),
        ({"time_limit_s": "30"}, r"'time_limit_s'.*'30'.*positive number of seconds"),
        ({"mip_gap": 1.0}, r"'mip_gap'.*1\.0.*relative gap in \[0, 1\)"),
        ({"mip_gap": -0.01}, r"'mip_gap'.*-0\.01.*\[0, 1\)"),
        ({"mip_gap": "1%"}, r"'mip_gap'.*'1%'.*\[0, 1\)"),
        ({"compiler": "aot_eager"}, r"'compiler'.*'aot_eager'.*accepted values: \['inductor', 'eager'\]"),
        (
            {"roofline": 1e12},
            r"'roofline'.*expected a dict with keys from \['flops_per_s', 'bytes_per_s', "
            r"'link_bytes_per_s', 'collective_latency_s', 'host_bytes_per_s'\]",
        ),
        ({"roofline": {"flops": 1e12}}, r"'roofline'.*'flops'.*keys from \['flops_per_s', 'bytes_per_s', "),
        ({"roofline": {"flops_per_s": 0}}, r"'roofline': flops_per_s=0 must be a positive number"),
        ({"peak_memory": -1}, r"'peak_memory'.*-1.*>= 0"),
        (
            {"policy": "full", "memory_budget": 0.2},
            r"'policy'.*'full' is a fixed baseline.*memory_budget.*'auto'",
        ),
        ({"policy": "save-all", "peak_memory": "1GiB"}, r"'policy'.*'save-all'.*peak_memory"),
    ],
)
def test_bad_options_name_the_option_and_the_accepted_values(raw, match):
    with pytest.raises(OptionError, match=match):
        parse_options(raw)


@pytest.mark.parametrize(
    "raw,field,value",
    [
        ({}, "memory_budget", None),
        ({"memory_budget": 0.25}, "memory_budget", 0.25),
        ({"memory_budget": 0}, "memory_budget", 0),
        ({"memory_budget": 65536}, "memory_budget", 65536),
        ({"memory_budget": "64KiB"}, "memory_budget", 65536),
        ({"memory_budget": "2GB"}, "memory_budget", 2 * 10**9),
        ({"peak_memory": 65536}, "peak_memory", 65536),
        ({"peak_memory": "64KiB"}, "peak_memory", 65536),
        ({}, "strict", False),
        ({"strict": True}, "strict", True),
        *[({"policy": p}, "policy", p) for p in ("auto", "save-all", "full", "megatron-selective")],
        ({}, "solver", "highs"),
        ({"solver": "cbc"}, "solver", "cbc"),
        ({}, "time_limit_s", 30.0),
        ({"time_limit_s": 5}, "time_limit_s", 5.0),
        ({}, "mip_gap", 0.01),
        ({"mip_gap": 0}, "mip_gap", 0.0),
        ({"mip_gap": 0.5}, "mip_gap", 0.5),
        ({"plan_dir": Path("/tmp/plans")}, "plan_dir", "/tmp/plans"),
        ({"roofline": {"flops_per_s": 10**12}}, "roofline", {"flops_per_s": 1e12}),
        ({}, "compiler", "inductor"),
        ({"compiler": "eager"}, "compiler", "eager"),
    ],
)
def test_every_accepted_value_is_read(raw, field, value):
    opts = parse_options(raw)
    assert getattr(opts, field) == value and type(getattr(opts, field)) is type(value)
    assert parse_options(opts) is opts


def test_roofline_overrides_only_the_constants_it_names():
    opts = parse_options({"roofline": {"flops_per_s": 1e9}})
    assert opts.roofline_for("cpu") == {**DEFAULT_ROOFLINE["cpu"], "flops_per_s": 1e9}
    assert opts.roofline_for("cuda")["bytes_per_s"] == DEFAULT_ROOFLINE["cuda"]["bytes_per_s"]
    assert Options().roofline_for("xpu") == DEFAULT_ROOFLINE["cuda"]  # an unknown device: the GPU's
    assert opts.key() != Options().key()  # the compile caches never replay another cost model's plan


def test_units():
    assert parse_bytes("x", "512MiB") == 512 * 2**20
    assert parse_bytes("x", "2GB") == 2 * 10**9
    assert parse_bytes("x", "1.5 KiB") == 1536
    assert parse_budget(0.25) == 0.25 and parse_budget(1024) == 1024 and parse_budget(None) is None


def test_decimal_sizes_are_read_exactly():
    # the number times the unit in floats lost a byte: "2.01GB" read as 2009999999, "1.001kB" as 1000
    assert parse_bytes("x", "2.01GB") == 2_010_000_000
    assert parse_bytes("x", "1.001kB") == 1001
    assert parse_budget("122.88kB") == 122_880
    assert all(parse_bytes("x", f"{i / 1000}kB") == i for i in range(1, 20_000))
    assert parse_bytes("x", "0.3GiB") == int(0.3 * 2**30)  # a fraction of a byte is dropped


def test_bad_option_through_torch_compile_is_caught_as_option_error():
    """README's way: ``except recompile_opt.OptionError`` around the first call catches a bad option
    (Dynamo wrapped it in a BackendCompilerFailed, which that missed), and the message's first line is
    ours. Code that catches Dynamo's wrapper still catches it, and finds our error as inner_exception."""
    model, inputs = tiny_mlp()
    compiled = torch.compile(model, backend="recompile_opt", options={"memory_budget": True})
    try:
        compiled(*inputs)
    except recompile_opt.OptionError as e:
        error = e
    else:
        pytest.fail("a bad option compiled")
    assert str(error).splitlines()[0] == (
        "option 'memory_budget': got a bool (True); expected a float fraction in [0, 1] (0.0 the "
        "least-memory plan, 1.0 save-all), an int of bytes, or a string with units such as '512MiB' or '2GB'"
    )
    assert isinstance(error, torch._dynamo.exc.BackendCompilerFailed)
    assert type(error.inner_exception) is OptionError
    assert str(error.inner_exception) == str(error).splitlines()[0]


@pytest.mark.parametrize(
    "raw,match",
    [
        ({"memory_budget": "512"}, r"option 'memory_budget': '512' has no units"),
        (
            {"compiler": "aot_eager"},
            r"option 'compiler': got 'aot_eager'; accepted values: \['inductor', 'eager'\]",
        ),
        ({"mip_gap": 1}, r"option 'mip_gap': got 1; expected a relative gap in \[0, 1\)"),
    ],
)
def test_bad_option_through_torch_compile_and_plan(raw, match):
    """torch.compile is lazy: the error comes at the first call, an OptionError whose message opens with
    ours; recompile_opt.plan raises the OptionError at once."""
    model, inputs = tiny_mlp()
    compiled = torch.compile(model, backend="recompile_opt", options=raw)
    with pytest.raises(OptionError, match="^" + match) as info:
        compiled(*inputs)
    assert isinstance(info.value, torch._dynamo.exc.BackendCompilerFailed)
    torch._dynamo.reset()
    with pytest.raises(OptionError, match=match):
        recompile_opt.plan(model, inputs, **raw)


def test_infeasible_budget_warns_with_the_smallest_feasible_budget():
    model, inputs = tiny_mlp()
    with pytest.warns(UserWarning, match=r"below the least any plan can keep \(.*, (\d+) bytes\)") as rec:
        plan = recompile_opt.plan(model, inputs, memory_budget=1)
    least = int(__import__("re").search(r"(\d+) bytes\)", str(rec[0].message)).group(1))
    assert plan.saved_bytes == least == plan.min_bytes


def test_infeasible_budget_raises_when_strict():
    model, inputs = tiny_mlp()
    with pytest.raises(recompile_opt.InfeasibleBudget, match="memory_budget=1 B is below"):
        recompile_opt.plan(model, inputs, memory_budget=1, strict=True)


def test_feasible_budget_does_not_warn():
    model, inputs = tiny_mlp()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        plan = recompile_opt.plan(model, inputs, memory_budget=0.5)
    assert plan.saved_bytes <= plan.budget_bytes


# -- each value reaches the planner ----------------------------------------------------------------


@pytest.mark.parametrize("compiler", ["eager", "inductor"])
@pytest.mark.parametrize(
    "limit,match",
    [
        (
            {"memory_budget": 1},
            r"memory_budget=1 B is below the least any plan can keep \(768 B, 768 bytes\)",
        ),
        (
            {"peak_memory": 1},
            r"peak_memory=1 B cannot be met; the least peak found is .* \(walked in Inductor.s code\)",
        ),
    ],
    ids=["memory_budget", "peak_memory"],
)
def test_strict_raises_through_torch_compile(compiler, limit, match):
    """An unmeetable limit with strict=True fails the first call (the plan is made before any code is
    generated, so through Inductor too): ``except recompile_opt.InfeasibleBudget`` catches it through
    Dynamo, and it is Dynamo's BackendCompilerFailed too, holding our InfeasibleBudget."""
    model, inputs = tiny_mlp()
    options = {**limit, "strict": True, "compiler": compiler}
    compiled = torch.compile(model, backend="recompile_opt", options=options)
    match = r"^recompile_opt: " + match + r" \(strict=True\)"
    with pytest.raises(recompile_opt.InfeasibleBudget, match=match) as info:
        compiled(*inputs)
    assert isinstance(info.value, torch._dynamo.exc.BackendCompilerFailed)
    assert type(info.value.inner_exception) is recompile_opt.InfeasibleBudget
    assert not recompile_opt.last_plans()


def test_not_strict_through_torch_compile_warns_and_trains_the_least_memory_plan():
    model, inputs = tiny_mlp()
    with pytest.warns(UserWarning, match=r"memory_budget=1 B is below the least any plan can keep"):
        plan = train_side_by_side(model, inputs, options={"memory_budget": 1, "compiler": "eager"}, steps=1)
    assert plan.budget_bytes == 1 and plan.saved_bytes == plan.min_bytes == 768
    assert any("using the least-memory plan" in n for n in plan.notes)


@pytest.fixture
def solver_calls(monkeypatch):
    """(solver, time_limit_s, mip_gap) of every solver command the planning builds."""
    calls, original = [], ilp._command

    def spy(solver, time_limit_s, mip_gap, *args, **kwargs):
        calls.append((solver, time_limit_s, mip_gap))
        return original(solver, time_limit_s, mip_gap, *args, **kwargs)

    monkeypatch.setattr(ilp, "_command", spy)
    solve_anew(monkeypatch)  # every solve reaches the solver
    return calls


def test_time_limit_and_mip_gap_reach_every_solve(solver_calls):
    model, inputs = tiny_mlp()
    plan = recompile_opt.plan(model, inputs, memory_budget=7000)
    assert solver_calls and set(solver_calls) == {("highs", 30.0, 0.01)}  # the defaults
    assert plan.solver["gap"] == 0.01 and "gap <= 1.00%" in plan.summary()
    solver_calls.clear()
    plan = recompile_opt.plan(model, inputs, memory_budget=7000, time_limit_s=7.5, mip_gap=0.05)
    assert solver_calls and set(solver_calls) == {("highs", 7.5, 0.05)}
    # an optimal status means proven within the gap asked for, and the plan says so
    assert plan.solver["status"] == "optimal" and plan.solver["gap"] == 0.05
    assert "gap <= 5.00%" in plan.summary()
    assert plan.options["time_limit_s"] == 7.5 and plan.options["mip_gap"] == 0.05


BUDGET = 120_000  # bytes: between the least the tiny GPT can keep (~100 KB) and save-all (~150 KB)


def test_cbc_through_plan_keeps_what_highs_keeps(solver_calls):
    model, inputs = tiny_gpt()
    plans = {}
    for solver in ("highs", "cbc"):
        solver_calls.clear()
        plans[solver] = recompile_opt.plan(model, inputs, memory_budget=BUDGET, solver=solver)
        assert {c[0] for c in solver_calls} == {solver}
        assert plans[solver].solver["name"] == solver and plans[solver].solver["status"] == "optimal"
    highs, cbc = plans["highs"], plans["cbc"]
    assert highs.saved_bytes <= BUDGET < highs.baseline_bytes
    assert cbc.saved_bytes == highs.saved_bytes  # the same optimum here; each is within its 1% gap
    assert cbc.recompute_s == pytest.approx(highs.recompute_s, rel=0.01)


def test_cbc_through_torch_compile(solver_calls):
    model, inputs = tiny_gpt()
    plan = train_side_by_side(
        model, inputs, options={"solver": "cbc", "memory_budget": BUDGET, "compiler": "eager"}, steps=1
    )
    assert {c[0] for c in solver_calls} == {"cbc"}
    assert plan.solver["name"] == "cbc" and plan.saved_bytes <= BUDGET < plan.baseline_bytes
    assert plan.recomputed  # the budget binds: something is recomputed


@pytest.mark.parametrize("budget", [122_880, "120KiB", "122.88kB"])
def test_a_byte_budget_in_any_form_through_torch_compile(budget):
    model, inputs = tiny_gpt()
    plan = train_side_by_side(model, inputs, options={"memory_budget": budget, "compiler": "eager"}, steps=1)
    assert plan.budget_bytes == 122_880
    assert plan.saved_bytes <= 122_880 < plan.baseline_bytes


def _full_plan(route: str, roofline: dict | None) -> recompile_opt.Plan:
    model, inputs = tiny_gpt()
    options = {"policy": "full", **({"roofline": roofline} if roofline else {})}
    if route == "plan":
        return recompile_opt.plan(model, inputs, **options)
    torch.compile(model, backend="recompile_opt", options={**options, "compiler": "eager"})(
        *inputs
    ).backward()
    return recompile_opt.last_plans()[-1]


@pytest.mark.parametrize("route", ["plan", "compile"])
def test_roofline_scales_the_estimates(route):
    """A fixed policy recomputes the same values under any cost model: a device 10x slower in both
    constants makes every estimate 10x; a slower FLOP rate alone reprices only the ops that have FLOPs."""
    base = _full_plan(route, None)
    torch._dynamo.reset()
    cpu = DEFAULT_ROOFLINE["cpu"]
    slow = _full_plan(route, {k: v / 10 for k, v in cpu.items()})
    assert slow.recomputed_names() == base.recomputed_names() and base.recompute_s > 0
    assert slow.recompute_s == pytest.approx(10 * base.recompute_s, rel=1e-9)
    assert slow.step_s == pytest.approx(10 * base.step_s, rel=1e-9)
    for a, b in zip(base.recomputed, slow.recomputed):
        assert b.recompute_s == pytest.approx(10 * a.recompute_s, rel=1e-9), a.name
    if route == "compile":
        return  # the same options reach the same partitioner: one route is enough for the rest
    flops_bound = _full_plan(route, {"flops_per_s": 1e6})  # so slow that every matmul is FLOP-bound
    matmuls = [e for e in flops_bound.recomputed if e.flops]
    assert matmuls, "expected the full policy to recompute some matmul"
    for a, b in zip(base.recomputed, flops_bound.recomputed):
        assert b.recompute_s == (pytest.approx(b.flops / 1e6) if b.flops else a.recompute_s), a.name
