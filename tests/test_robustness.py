"""Solver failure, mutated buffers, SDPA under megatron-selective, and the solver time limit."""

import pytest
import torch
from helpers import solve_anew, tiny_gpt, tiny_llama, tiny_mlp, train_side_by_side

import recompile_opt
from recompile_opt.planner import ilp


def test_solver_failure_falls_back_to_a_correct_plan_with_a_warning(monkeypatch):
    monkeypatch.setattr(ilp, "_run", lambda *a, **k: ("error: solver exploded", None))
    solve_anew(monkeypatch)
    model, inputs = tiny_gpt(dropout=0.1)
    with (
        torch._inductor.config.patch(fallback_random=True),
        pytest.warns(UserWarning, match="the ILP solver failed .*greedy plan"),
    ):
        plan = train_side_by_side(
            model, inputs, options={"memory_budget": 0.3, "compiler": "eager"}, rtol=1e-4, atol=1e-5
        )
    assert plan.budget_bytes is not None and plan.saved_bytes <= plan.budget_bytes


class WithBatchNorm(torch.nn.Module):
    """BatchNorm mutates its running statistics in the forward: the joint graph has copy_ nodes."""

    def __init__(self):
        super().__init__()
        self.a, self.bn, self.b = torch.nn.Linear(8, 32), torch.nn.BatchNorm1d(32), torch.nn.Linear(32, 4)

    def forward(self, x, y):
        return torch.nn.functional.mse_loss(self.b(torch.relu(self.bn(self.a(x)))), y)


@pytest.mark.parametrize("budget", [None, 0.0])
def test_mutated_buffers_keep_gradients_and_running_stats_equal(budget):
    torch.manual_seed(0)
    model, inputs = WithBatchNorm(), (torch.randn(16, 8), torch.randn(16, 4))
    ref = __import__("copy").deepcopy(model)
    train_side_by_side(model, inputs, options={"memory_budget": budget, "compiler": "eager"})
    # train_side_by_side trains copies; run once more here to compare the running statistics
    compiled = torch.compile(
        model, backend="recompile_opt", options={"memory_budget": budget, "compiler": "eager"}
    )
    compiled(*inputs).backward()
    ref(*inputs).backward()
    torch.testing.assert_close(model.bn.running_mean, ref.bn.running_mean)
    torch.testing.assert_close(model.bn.running_var, ref.bn.running_var)


def test_megatron_selective_on_sdpa_recomputes_the_sdpa_call_and_says_so():
    model, inputs = tiny_llama()
    plan = recompile_opt.plan(model, inputs, policy="megatron-selective")
    sdpa = [e for e in plan.recomputed if "scaled_dot_product" in e.op]
    assert sdpa and all(e.flops == 4 * 2 * 16 * 16 * 32 for e in sdpa)  # 4bs^2h: b=2, s=16, h=32
    assert any("no s x s tensor exists" in n for n in plan.notes)


def test_time_limit_returns_a_plan_and_reports_it():
    """Out of time, the solver's best plan is used (and noted), or, with none found, the greedy one."""
    model, inputs = tiny_gpt()
    with __import__("warnings").catch_warnings(record=True):
        plan = recompile_opt.plan(model, inputs, memory_budget=0.3, time_limit_s=0.01, mip_gap=0.0)
    status = plan.solver["status"]
    if status == "feasible":
        assert any("time limit" in n for n in plan.notes)
    elif status != "optimal":
        assert any("greedy plan" in n for n in plan.notes)
    assert plan.saved_bytes <= plan.budget_bytes


def test_plan_can_be_called_more_often_than_dynamos_recompile_limit():
    model, inputs = tiny_mlp()
    budgets = [i / 10 for i in range(11)]  # 11 captures of the same code; Dynamo's limit is 8
    saved = [recompile_opt.plan(model, inputs, memory_budget=b).saved_bytes for b in budgets]
    assert saved == sorted(saved)


def test_a_failed_search_is_not_remembered_for_the_next_plan(monkeypatch):
    # the range ends of a fractional budget are kept per graph and options; a search whose solves all
    # failed must not stand in for a real one later (a 0.0 plan then came without its least-peak search)
    model, inputs = tiny_gpt()
    with monkeypatch.context() as failing:
        failing.setattr(ilp, "_run", lambda *a, **k: ("error: solver exploded", None))
        solve_anew(failing)
        with pytest.warns(UserWarning, match="the ILP solver failed"):
            recompile_opt.plan(model, inputs, memory_budget=0.3)
    plan = recompile_opt.plan(model, inputs, memory_budget=0.0)
    assert any(n.startswith("memory_budget 0.0 = the least-peak plan") for n in plan.notes), plan.notes
