"""Dynamic sequence length: one plan, made from symbolic sizes, right at every length.

Budget semantics: sizes are costed at their upper bound when Dynamo has one
(``mark_dynamic(t, dim, max=...)``), so an int budget holds at every allowed length; otherwise at the
first call's sizes (Dynamo's hints), and kept bytes then grow with the length.
"""

import copy

import pytest
import torch
from helpers import tiny_gpt

import recompile_opt
from recompile_opt.costs.measure import saved_bytes, saved_report


def _batch(idx, tgt, length, bound=None):
    i, t = idx[:, :length].contiguous(), tgt[:, :length].contiguous()
    if bound is not None:
        for x in (i, t):
            torch._dynamo.mark_dynamic(x, 1, min=2, max=bound)
    return i, t


@pytest.mark.parametrize("budget", [None, 0.5, 0.0])
def test_one_plan_serves_every_length_with_eager_gradients(budget):
    model, (idx, tgt) = tiny_gpt()
    ref, ours = copy.deepcopy(model), copy.deepcopy(model)
    compiled = torch.compile(
        ours, backend="recompile_opt", dynamic=True, options={"memory_budget": budget, "compiler": "eager"}
    )
    recompile_opt.reset_plans()
    for length in (12, 8, 10, 15):
        i, t = _batch(idx, tgt, length)
        ref.zero_grad(set_to_none=True)
        ours.zero_grad(set_to_none=True)
        ref(i, t).backward()
        compiled(i, t).backward()
        for (name, a), b in zip(ref.named_parameters(), ours.parameters()):
            torch.testing.assert_close(
                b.grad, a.grad, rtol=1e-5, atol=1e-6, msg=lambda m: f"T={length} {name}: {m}"
            )
    plans = recompile_opt.last_plans()
    assert len(plans) == 1, "a new length recompiled"
    assert any(isinstance(d, str) for e in plans[0].saved for d in e.shape), "sizes are not symbolic"


def test_an_int_budget_holds_at_every_length_up_to_the_bound():
    model, (idx, tgt) = tiny_gpt()
    bound = 15
    static = recompile_opt.plan(model, _batch(idx, tgt, bound), memory_budget=1.0)
    budget = static.saved_bytes // 2
    recompile_opt.reset_plans()
    compiled = torch.compile(
        copy.deepcopy(model), backend="recompile_opt", options={"memory_budget": budget, "compiler": "eager"}
    )
    measured = {}
    for length in (8, 12, bound):
        i, t = _batch(idx, tgt, length, bound)
        measured[length] = saved_bytes(lambda: compiled(i, t), exclude=[compiled])
    (plan,) = recompile_opt.last_plans()
    assert plan.saved_bytes <= budget
    assert measured[bound] <= budget, (measured, plan.summary())
    assert measured[bound] == pytest.approx(plan.saved_bytes, rel=0.02)  # costed at the bound
    assert measured[8] < measured[bound]


@pytest.mark.slow
def test_an_int_budget_holds_at_every_length_through_inductor():
    """One Inductor compile with a symbolic length bounded by ``mark_dynamic``: gradients equal eager's at
    every length, and the bytes the compiled steps really keep for backward stay within an int budget,
    the plan's figure at the bound."""
    model, (idx, tgt) = tiny_gpt()
    bound = 15
    static = recompile_opt.plan(model, _batch(idx, tgt, bound), memory_budget=1.0)
    budget = static.saved_bytes // 2
    recompile_opt.reset_plans()
    ref, ours = copy.deepcopy(model), copy.deepcopy(model)
    compiled = torch.compile(ours, backend="recompile_opt", options={"memory_budget": budget})
    measured = {}
    for step, length in enumerate((12, 8, bound)):  # the first call compiles: measure the later ones
        i, t = _batch(idx, tgt, length, bound)
        ref.zero_grad(set_to_none=True)
        ours.zero_grad(set_to_none=True)
        ref(i, t).backward()
        if step == 0:
            compiled(i, t).backward()
        else:
            report, loss = saved_report(lambda: compiled(i, t), exclude=[ours])
            measured[length] = report.total_bytes
            loss.backward()
        for (name, a), b in zip(ref.named_parameters(), ours.parameters()):
            torch.testing.assert_close(
                b.grad, a.grad, rtol=1e-5, atol=1e-6, msg=lambda m: f"T={length} {name}: {m}"
            )
    plans = recompile_opt.last_plans()
    assert len(plans) == 1, "a new length recompiled"
    (plan,) = plans
    assert any(isinstance(d, str) for e in plan.saved for d in e.shape), "sizes are not symbolic"
    assert plan.saved_bytes <= budget < plan.baseline_bytes
    assert measured[bound] <= budget, (measured, plan.summary())
    assert measured[bound] == pytest.approx(plan.saved_bytes, rel=0.02)  # costed at the bound
    assert measured[8] < measured[bound]
