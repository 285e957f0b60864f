"""The cost model's charge for recomputing fused pointwise ops (recompile_opt.costs.cost_model)."""

from __future__ import annotations

import recompile_opt
from recompile_opt import models


def _ops(entries, module_part: str) -> set[str]:
    return {e.op for e in entries if module_part in e.module}


def test_no_budget_plan_recomputes_a_norm_output_that_fuses_into_its_backward():
    # RMSNorm's x * rsqrt(...) is one pointwise op over values the backward keeps anyway, read in the
    # backward only by fused pointwise ops: recomputed there it costs one pass, kept it costs a write
    # and a read, so with no budget it is recomputed (charged its full traffic, it was kept)
    model, batch = models.demo_llama(n_layer=1, n_embd=64, seq=32, batch=2)
    plan = recompile_opt.plan(model, batch)
    assert {"attention_norm", "ffn_norm"} <= {e.module.rsplit(".", 1)[-1] for e in plan.recomputed
                                              if e.op == "mul"}, plan
    assert plan.recompute_flops == 0  # nothing else: no matmul is worth recomputing without a budget


def test_no_budget_plan_keeps_a_pointwise_output_that_a_backward_matmul_reads():
    # the product silu(gate) * up feeds the down projection's weight gradient (a matmul): recomputed,
    # it would be written out again, so it is not cheap and the no-budget plan keeps it
    model, batch = models.demo_llama(n_layer=1, n_embd=64, seq=32, batch=2)
    plan = recompile_opt.plan(model, batch)
    kept = [e for e in plan.saved if "feed_forward.w2" in e.module and e.bytes > 0]
    assert kept, plan
