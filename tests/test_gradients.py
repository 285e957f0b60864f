"""Gradients equal eager PyTorch over several optimizer steps, for every budget and policy, dropout on
and off. Runs through the same joint passes and partitioner as Inductor, with the eager code path
(``compiler="eager"``); tests/test_inductor.py runs a subset through Inductor's code generation."""

import functools

import pytest
import torch
from helpers import TINY_GPT, tiny_gpt, tiny_llama, tiny_mlp, train_and_measure_saved, train_side_by_side

from recompile_opt.models import GPT, GPTConfig, example_batch

BUDGETS = [None, 0.5, 0.1, 0.0]
POLICIES = ["save-all", "full", "megatron-selective"]
MODELS = {"gpt": tiny_gpt, "llama": tiny_llama, "mlp": tiny_mlp}


def _options(setting):
    if isinstance(setting, str):
        return {"policy": setting, "compiler": "eager"}
    return {"memory_budget": setting, "compiler": "eager"}


@functools.cache
def _kept_measured(model: str, setting) -> int:
    """What a compile with ``setting`` hands the backward, by autograd's saved-tensor hooks."""
    module, inputs = MODELS[model]()
    return train_and_measure_saved(module, inputs, options=_options(setting), steps=1)[1]


@pytest.mark.parametrize("setting", BUDGETS + POLICIES, ids=str)
@pytest.mark.parametrize("model", sorted(MODELS))
def test_gradients_equal_eager(model, setting):
    """...and the plan's kept bytes are what autograd holds for the backward, and a fraction F keeps
    at most its budget as README defines it, F of the way from the 0.0 plan to save-all, both ends
    measured by the hooks in compiles of their own (the plan's own ``budget_bytes`` is no check: at
    0.0 it is the plan's kept bytes by definition)."""
    module, inputs = MODELS[model]()
    plan, kept = train_and_measure_saved(module, inputs, options=_options(setting))
    assert kept == plan.saved_bytes, plan.summary()
    if setting == 0.0:  # the least-peak plan: at least the least possible, less than save-all
        assert plan.min_bytes <= kept < _kept_measured(model, "save-all"), plan.summary()
        assert any("least-peak plan" in n for n in plan.notes)
    elif isinstance(setting, float):
        least, save_all = _kept_measured(model, 0.0), _kept_measured(model, "save-all")
        budget = least + setting * (save_all - least)
        assert kept <= budget, f"kept {kept} B, budget {budget:.0f} B ({least}..{save_all})\n{plan.summary()}"


@pytest.mark.parametrize("setting", BUDGETS + POLICIES, ids=str)
def test_dropout_replays_the_same_mask(setting):
    """A recomputed dropout must replay this step's mask: a fresh mask (PyTorch's knapsack below 1.0)
    or the first step's mask (Rockmate) shows as errors near 0.1."""
    module, inputs = tiny_gpt(dropout=0.1)
    with torch._inductor.config.patch(fallback_random=True):
        plan = train_side_by_side(module, inputs, options=_options(setting), steps=3, rtol=1e-4, atol=1e-5)
    if setting == "full":
        assert any(e.reason == "rng" for e in plan.recomputed), "expected a replayed random op"


@pytest.mark.parametrize("setting", [0.0, "full"], ids=str)
def test_llama_dropout_replays_the_same_mask(setting):
    """The Llama's dropout, SDPA's own ``dropout_p`` among it (the math kernel's dropout of the
    attention probabilities): the replayed masks are this step's."""
    module, inputs = tiny_llama(dropout=0.1)
    with torch._inductor.config.patch(fallback_random=True):
        plan = train_side_by_side(module, inputs, options=_options(setting), steps=3, rtol=1e-4, atol=1e-5)
    sdpa = [e for e in plan.recomputed if e.reason == "rng" and e.module.endswith(".attention")]
    assert sdpa, f"expected SDPA's dropout replayed\n{plan}"


def test_least_peak_plan_replays_a_dropout_whose_mask_outweighs_its_rng_state():
    # at s=64 an attention dropout's bool mask (16 KiB) outweighs the 5 KiB CPU RNG state a replay
    # keeps, so the 0.0 plan replays it (at s=16 its 1 KiB mask is kept instead); same masks as eager
    cfg = GPTConfig(**{**TINY_GPT, "block_size": 64}, dropout=0.1)
    torch.manual_seed(0)
    module, inputs = GPT(cfg), example_batch(cfg, 2)
    with torch._inductor.config.patch(fallback_random=True):
        plan = train_side_by_side(module, inputs, options=_options(0.0), steps=3, rtol=1e-4, atol=1e-5)
    replayed = [e.module for e in plan.recomputed if e.reason == "rng"]
    assert any("attn_dropout" in m for m in replayed), plan


def test_eager_compiler_draws_eagers_dropout_masks_without_a_config_patch():
    """compiler="eager" keeps aten's random ops, so even without fallback_random the masks are eager's."""
    module, inputs = tiny_gpt(dropout=0.1)
    train_side_by_side(
        module, inputs, options={"memory_budget": 0.0, "compiler": "eager"}, steps=2, rtol=1e-4, atol=1e-5
    )
