"""Bad input gets a clear error naming the option and what it accepts, also through torch.compile."""

import warnings

import pytest
import torch

import recompile_opt
from recompile_opt.options import OptionError, parse_budget, parse_bytes, parse_options

from helpers import tiny_mlp


@pytest.mark.parametrize("raw,match", [
    ({"memroy_budget": 1}, r"unknown recompile_opt option\(s\) \['memroy_budget'\].*accepted options"),
    ({"memory_budget": -5}, r"'memory_budget'.*-5.*>= 0"),
    ({"memory_budget": "512"}, r"'memory_budget'.*'512' has no units"),
    ({"memory_budget": "5 parsecs"}, r"unknown unit 'parsecs'.*accepted units"),
    ({"memory_budget": 1.5}, r"'memory_budget'.*outside \[0, 1\]"),
    ({"memory_budget": True}, r"'memory_budget'.*bool"),
    ({"peak_memory": "lots"}, r"'peak_memory'.*cannot read 'lots'"),
    ({"policy": "magic"}, r"'policy'.*'magic'.*\['auto', 'save-all', 'full', 'megatron-selective'\]"),
    ({"solver": "gurobi"}, r"'solver'.*\['cbc', 'highs'\]"),
    ({"strict": "yes"}, r"'strict'.*True, False"),
    ({"time_limit_s": 0}, r"'time_limit_s'.*positive"),
    ({"policy": "full", "memory_budget": 0.2}, r"'policy'.*'full' is a fixed baseline.*memory_budget.*'auto'"),
    ({"policy": "save-all", "peak_memory": "1GiB"}, r"'policy'.*'save-all'.*peak_memory"),
])
def test_bad_options_name_the_option_and_the_accepted_values(raw, match):
    with pytest.raises(OptionError, match=match):
        parse_options(raw)


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


def test_bad_option_surfaces_readably_through_torch_compile():
    model, inputs = tiny_mlp()
    compiled = torch.compile(model, backend="recompile_opt", options={"memory_budget": "512"})
    with pytest.raises(Exception, match=r"option 'memory_budget': '512' has no units"):
        compiled(*inputs)


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
