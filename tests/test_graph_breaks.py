"""A model that Dynamo splits into several graphs: one plan per graph, one byte budget for them all."""

import copy
import warnings

import pytest
import torch
from helpers import train_side_by_side

import recompile_opt
from recompile_opt.partitioner import MEMORY
from recompile_opt.planner import budget_split
from recompile_opt.planner.search import InfeasibleBudget


class TwoHalves(torch.nn.Module):
    """Two MLP halves with a graph break between them; the second half is twice as wide."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.first = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.Linear(64, 32))
        self.second = torch.nn.Sequential(
            torch.nn.Linear(32, 128),
            torch.nn.GELU(),
            torch.nn.Linear(128, 128),
            torch.nn.GELU(),
            torch.nn.Linear(128, 1),
        )

    def forward(self, x):
        x = torch.tanh(self.first(x))
        torch._dynamo.graph_break()
        return self.second(x).square().mean()


@pytest.fixture(autouse=True)
def fresh_split():
    MEMORY.forget_budget_shares()
    yield
    MEMORY.forget_budget_shares()


def _inputs():
    return (torch.randn(64, 32, generator=torch.Generator().manual_seed(1)),)


def test_split_gives_each_graph_its_least_plus_a_proportional_share():
    shares = budget_split.split(1000, [("a", 100, 300), ("b", 200, 800)])
    assert shares == {"a": 100 + 700 * 200 // 800, "b": 200 + 700 * 600 // 800}
    assert sum(shares.values()) <= 1000
    assert budget_split.split(5000, [("a", 100, 300), ("b", 200, 800)]) == {"a": 300, "b": 800}
    assert budget_split.split(10, [("a", 100, 300), ("b", 200, 800)]) == {"a": 100, "b": 200}


def test_plan_returns_one_plan_per_graph():
    recompile_opt.reset_plans()
    plans = recompile_opt.plan(TwoHalves(), _inputs())
    assert isinstance(plans, list) and len(plans) == 2
    assert [p.graph for p in recompile_opt.last_plans()] == [p.graph for p in plans]
    assert plans[0].graph != plans[1].graph


def test_a_byte_budget_holds_for_the_whole_model_and_compile_uses_the_split():
    model, inputs = TwoHalves(), _inputs()
    save_all = recompile_opt.plan(model, inputs)
    total_save_all = sum(p.saved_bytes for p in save_all)
    budget = total_save_all // 2
    planned = recompile_opt.plan(model, inputs, memory_budget=budget)
    assert sum(p.saved_bytes for p in planned) <= budget
    # each graph alone would have taken the whole budget: the split is what keeps the sum under it
    assert all(p.budget_bytes < budget for p in planned)
    assert all(any("split over the model's graphs" in n for n in p.notes) for p in planned)

    recompile_opt.reset_plans()
    ref, ours = copy.deepcopy(model), copy.deepcopy(model)
    compiled = torch.compile(
        ours, backend="recompile_opt", options={"memory_budget": budget, "compiler": "eager"}
    )
    ref(*inputs).backward()
    compiled(*inputs).backward()
    for a, b in zip(ref.parameters(), ours.parameters()):
        torch.testing.assert_close(b.grad, a.grad, rtol=1e-5, atol=1e-6)
    compiled_plans = recompile_opt.last_plans()
    assert len(compiled_plans) == 2
    assert sum(p.saved_bytes for p in compiled_plans) <= budget
    assert sorted(p.saved_names() for p in compiled_plans) == sorted(p.saved_names() for p in planned)


@pytest.mark.slow
def test_a_split_byte_budget_holds_on_the_measured_step_through_inductor():
    """The whole-model byte budget through Inductor's code: recompile_opt.plan splits it (capturing the
    graphs Inductor will see), the compiled model uses the shares, gradients equal eager's over SGD
    steps, and the bytes both graphs really keep for backward add up to at most the budget."""
    model, inputs = TwoHalves(), _inputs()
    budget = sum(p.saved_bytes for p in recompile_opt.plan(model, inputs)) // 2
    recompile_opt.plan(model, inputs, memory_budget=budget)  # learns the graphs, registers the split
    recompile_opt.reset_plans()
    reports = []
    train_side_by_side(model, inputs, options={"memory_budget": budget}, steps=3, saved=reports)
    plans = recompile_opt.last_plans()
    assert len(plans) == 2, [p.graph for p in plans]
    for report in reports:  # one report spans both graphs' forwards (a storage both keep counts once)
        assert report.total_bytes <= budget, report.summary()
        assert report.total_bytes <= sum(p.saved_bytes for p in plans), report.summary()
    assert sum(p.saved_bytes for p in plans) <= budget
    assert all(any("split over the model's graphs" in n for n in p.notes) for p in plans), (
        "a graph compiled by Inductor did not find its share of the budget"
    )


def test_an_unmeetable_whole_model_budget_warns_or_raises_with_strict():
    model, inputs = TwoHalves(), _inputs()
    with pytest.raises(InfeasibleBudget, match="2 graphs can keep together"):
        recompile_opt.plan(model, inputs, memory_budget=1, strict=True)
    with pytest.warns(UserWarning, match="2 graphs can keep together"):
        plans = recompile_opt.plan(model, inputs, memory_budget=1)
    assert len(plans) == 2


def test_compiling_without_a_capture_pass_warns_that_the_budget_holds_per_graph():
    model, inputs = TwoHalves(), _inputs()
    compiled = torch.compile(
        model, backend="recompile_opt", options={"memory_budget": 10**6, "compiler": "eager"}
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        compiled(*inputs).backward()
    assert any("holds per graph" in str(w.message) for w in caught)


class AttentionThenRouter(torch.nn.Module):
    """Explicit attention, a graph break, then a mixture-of-experts-like gate (no attention): Dynamo
    plans two graphs, as it does Mixtral's and Qwen2-MoE's."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.qkv, self.gate = torch.nn.Linear(16, 48), torch.nn.Linear(16, 4)
        self.experts = torch.nn.Linear(16, 64)

    def forward(self, x):
        q, k, v = self.qkv(x).split(16, dim=-1)
        h = x + (q @ k.transpose(-2, -1) / 4).softmax(-1) @ v
        torch._dynamo.graph_break()
        weights = self.gate(h).softmax(-1).repeat_interleave(16, dim=-1)
        return (self.experts(h).relu() * weights).sum()


def test_a_policy_that_cannot_act_in_one_graph_says_which_graph():
    """megatron-selective on a model split in two: the attention's graph recomputes its core, and the
    warning that nothing is recomputed names the other graph, not the model (it read "no attention core
    found" for Mixtral, whose attention it had recomputed)."""
    recompile_opt.reset_plans()
    inputs = (torch.randn(2, 8, 16, generator=torch.Generator().manual_seed(1)),)
    with pytest.warns(UserWarning, match="no attention core found in this graph") as record:
        train_side_by_side(
            AttentionThenRouter(),
            inputs,
            options={"policy": "megatron-selective", "compiler": "eager"},
            steps=2,
        )
    attention, router = recompile_opt.last_plans()
    warned = [str(w.message) for w in record if "megatron-selective" in str(w.message)]
    assert len(warned) == 1 and f"in this graph ({router.graph[:12]})" in warned[0], warned
    assert attention.recompute_flops > 0 and router.recompute_flops == 0
    assert not any("no attention core" in n for n in attention.notes)
