"""The fixed policies on multi-layer models: each block's structure is found on its own."""

import pytest

import recompile_opt
from recompile_opt.models import GPT, GPTConfig, example_batch

from helpers import TINY_GPT


@pytest.mark.parametrize("n_layer,dropout", [(1, 0.0), (3, 0.0), (3, 0.1)])
def test_megatron_selective_recomputes_each_layers_qk_matmul_and_nothing_outside_attention(n_layer, dropout):
    # a later layer's attention descends from an earlier one's: the core must not span layers
    cfg = GPTConfig(**{**TINY_GPT, "n_layer": n_layer}, dropout=dropout)
    model, inputs = GPT(cfg), example_batch(cfg, 2)
    b, s = inputs[0].shape
    plan = recompile_opt.plan(model, inputs, policy="megatron-selective")
    assert plan.recompute_flops == n_layer * 2 * b * s * s * cfg.n_embd, plan
    outside = [e.name for e in plan.recomputed if ".attn" not in e.module]
    assert not outside, plan
    assert not [e.name for e in plan.recomputed if e.op in ("addmm", "mm")], plan
