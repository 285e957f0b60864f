"""User tags from torch.utils.checkpoint's selective-checkpoint contexts: MUST_* are hard constraints,
PREFER_* hold unless the budget forces otherwise (and the plan says so)."""

import functools

import pytest
import torch
from helpers import train_side_by_side
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

import recompile_opt


def _policy(tags: dict):
    def policy(ctx, op, *args, **kwargs):
        return tags.get(op, CheckpointPolicy.PREFER_SAVE)

    return functools.partial(create_selective_checkpoint_contexts, policy)


class Tagged(torch.nn.Module):
    def __init__(self, tags: dict):
        super().__init__()
        self.context_fn = _policy(tags)
        self.a = torch.nn.Linear(16, 64)
        self.b = torch.nn.Linear(64, 16)

    def inner(self, x):
        return self.b(torch.relu(self.a(x)).sin())

    def forward(self, x):
        return checkpoint(self.inner, x, use_reentrant=False, context_fn=self.context_fn).pow(2).sum()


def _model(tags):
    torch.manual_seed(0)
    return Tagged(tags), (torch.randn(8, 16),)


def _op(plan, op, action):
    entries = plan.saved if action == "keep" else plan.recomputed
    return [e for e in entries if e.op == op]


def test_must_recompute_holds_even_without_budget():
    model, x = _model(
        {
            torch.ops.aten.relu.default: CheckpointPolicy.MUST_RECOMPUTE,
            torch.ops.aten.sin.default: CheckpointPolicy.MUST_RECOMPUTE,
        }
    )
    plan = recompile_opt.plan(model, x)
    assert [e.reason for e in _op(plan, "relu", "recompute")] == ["user"]
    assert not _op(plan, "relu", "keep") and not _op(plan, "sin", "keep")


def test_must_save_holds_at_the_least_memory_budget():
    # relu must be recomputed, so its input is read; MUST_SAVE forbids recomputing that matmul
    model, x = _model(
        {
            torch.ops.aten.addmm.default: CheckpointPolicy.MUST_SAVE,
            torch.ops.aten.relu.default: CheckpointPolicy.MUST_RECOMPUTE,
        }
    )
    plan = recompile_opt.plan(model, x, memory_budget=0.0)
    kept = _op(plan, "addmm", "keep")
    assert kept and all(e.reason == "user" for e in kept)
    assert not _op(plan, "addmm", "recompute")


def test_prefer_save_gives_way_to_the_budget_and_the_plan_says_so():
    model, x = _model({})  # everything PREFER_SAVE
    free = recompile_opt.plan(model, x)
    assert not free.recomputed
    tight = recompile_opt.plan(model, x, memory_budget=0.0)
    assert tight.recomputed
    assert any("PREFER_SAVE overridden" in n for n in tight.notes)


@pytest.mark.parametrize("policy", ["save-all", "full", "megatron-selective"])
def test_must_tags_hold_under_a_fixed_policy(policy):
    model, x = _model(
        {
            torch.ops.aten.relu.default: CheckpointPolicy.MUST_RECOMPUTE,
            torch.ops.aten.sin.default: CheckpointPolicy.MUST_RECOMPUTE,
        }
    )
    plan = recompile_opt.plan(model, x, policy=policy)
    assert not _op(plan, "relu", "keep") and not _op(plan, "sin", "keep"), plan
    model, x = _model({torch.ops.aten.addmm.default: CheckpointPolicy.MUST_SAVE})
    plan = recompile_opt.plan(model, x, policy=policy)
    assert not _op(plan, "addmm", "recompute"), plan


@pytest.mark.parametrize("budget", [None, 0.0])
def test_tagged_model_gradients_equal_eager(budget):
    model, x = _model(
        {
            torch.ops.aten.addmm.default: CheckpointPolicy.MUST_SAVE,
            torch.ops.aten.relu.default: CheckpointPolicy.PREFER_RECOMPUTE,
        }
    )
    train_side_by_side(model, x, options={"memory_budget": budget, "compiler": "eager"})


@pytest.mark.slow
@pytest.mark.parametrize("budget", [None, 0.0], ids=str)
def test_must_tags_hold_through_inductor(budget):
    """The tags through Inductor's code. Each binds at one of the budgets: with none the planner alone
    keeps sin's output for the second matmul's backward (MUST_RECOMPUTE makes it recompute sin, and
    relu under it), at 0.0 it recomputes the first matmul too (MUST_SAVE keeps it). Gradients equal
    eager's, and what the compiled step really saves is what the plan keeps."""
    model, x = _model(
        {
            torch.ops.aten.addmm.default: CheckpointPolicy.MUST_SAVE,
            torch.ops.aten.relu.default: CheckpointPolicy.MUST_RECOMPUTE,
            torch.ops.aten.sin.default: CheckpointPolicy.MUST_RECOMPUTE,
        }
    )
    reports = []
    plan = train_side_by_side(model, x, options={"memory_budget": budget}, steps=3, saved=reports)
    recomputed = {e.op: e.reason for e in plan.recomputed}
    kept = {e.op: e.reason for e in plan.saved}
    assert {"relu", "sin"} <= recomputed.keys() and not {"relu", "sin"} & kept.keys(), plan
    assert "addmm" in kept and "addmm" not in recomputed, plan
    assert recomputed["relu"] == recomputed["sin"] == kept["addmm"] == "user", plan
    for report in reports:
        assert report.total_bytes == pytest.approx(plan.saved_bytes, rel=0.02), report.summary()
