"""DistributedDataParallel over a model compiled with recompile_opt: 2 processes on gloo, a few SGD steps,
and every rank's gradients equal a single process's on the concatenated batch.

With ``torch._dynamo.config.optimize_ddp`` at its default (``"ddp_optimizer"``), Dynamo's DDPOptimizer
splits the graph at the gradient-bucket boundaries and hands each piece to the backend on its own, so
``last_plans()`` shows one plan per bucket on every rank (a float budget is then that fraction of each
graph's range). That happens both for ``torch.compile(DDP(model))`` and for ``DDP(torch.compile(model))``
(DDP's forward is active while Dynamo traces). With ``optimize_ddp=False`` there is one graph.
"""

from __future__ import annotations

import os

import pytest
import torch
from multiprocess import gloo_rank, progress, run_ranks

import recompile_opt
from recompile_opt.costs.measure import saved_report
from recompile_opt.models import GPT, GPTConfig, example_batch

WORLD = 2
STEPS = 3
ROWS = 2  # per rank
N_BUCKETS = 2  # 1.6 MiB of parameters: DDP's first 1 MiB bucket and the rest


# wide enough (1.6 MiB of parameters) to fill more than DDP's first 1 MiB bucket, so that Dynamo's
# DDPOptimizer splits the graph; short and shallow, so it compiles fast
CONFIG = GPTConfig(n_layer=2, n_head=2, n_embd=128, block_size=16, vocab_size=64)


def _model():
    torch.manual_seed(0)
    return GPT(CONFIG)


def _batch():
    """The whole batch; rank r trains on rows [r * ROWS, (r + 1) * ROWS)."""
    return example_batch(CONFIG, WORLD * ROWS)


def _worker(rank: int, wrap: str, options: dict, optimize_ddp: bool, out: str):
    torch._dynamo.config.optimize_ddp = optimize_ddp
    with gloo_rank(rank, WORLD, out):
        model = _model()
        idx, tgt = (t[rank * ROWS : (rank + 1) * ROWS] for t in _batch())
        if wrap == "compile(ddp)":  # the order PyTorch recommends: DDPOptimizer splits the graph
            step_fn = torch.compile(DDP(model), backend="recompile_opt", options=options)
        else:  # DDP over a compiled module
            step_fn = DDP(torch.compile(model, backend="recompile_opt", options=options))
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        grads, saved = [], []
        for step in range(STEPS):
            opt.zero_grad(set_to_none=True)
            if step == 0:  # compiles
                step_fn(idx, tgt).backward()
            else:  # the bytes every graph of the step really keeps for backward, parameters excluded
                report, loss = saved_report(lambda: step_fn(idx, tgt), exclude=[model])
                saved.append(report.total_bytes)
                loss.backward()
            progress(out, rank, f"step {len(grads)} done")
            grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
            opt.step()
        plans = recompile_opt.last_plans()
        torch.save(
            {
                "grads": grads,
                "n_plans": len(plans),
                "saved": saved,
                "plans": [(p.saved_bytes, p.budget_bytes, p.baseline_bytes) for p in plans],
            },
            os.path.join(out, f"rank{rank}.pt"),
        )
        progress(out, rank, "gradients saved")


def DDP(module):
    """1 MiB buckets (DDP's first bucket is 1 MiB, and DDPOptimizer wants no later one smaller)."""
    return torch.nn.parallel.DistributedDataParallel(module, bucket_cap_mb=1)


def _reference_grads():
    """Eager, one process, the whole batch: the mean loss over it is the mean of the ranks' losses."""
    model = _model()
    idx, tgt = _batch()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    grads = []
    for _ in range(STEPS):
        opt.zero_grad(set_to_none=True)
        model(idx, tgt).backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
        opt.step()
    return grads


CASES = {
    # the order PyTorch recommends; DDPOptimizer splits the graph at the buckets
    "compile(ddp)": ("compile(ddp)", {}, True),
    # the same, each graph planned at half its own range (each runs the least-peak ladder: slower)
    "compile(ddp)-budget0.5": ("compile(ddp)", {"memory_budget": 0.5}, True),
    # DDP's forward is active while Dynamo traces the inner compiled module, so DDPOptimizer splits too
    "ddp(compile)": ("ddp(compile)", {}, True),
    # without DDPOptimizer: one graph, DDP's reducer hooks all-reduce the gradients outside it
    "ddp(compile)-optimize_ddp-off": ("ddp(compile)", {}, False),
}
SLOW = {"compile(ddp)-budget0.5", "ddp(compile)", "ddp(compile)-optimize_ddp-off"}  # 15-80 s each here


@pytest.mark.parametrize(
    "case", [pytest.param(c, marks=[pytest.mark.slow] if c in SLOW else []) for c in CASES]
)
def test_ddp_gradients_equal_single_process(case, tmp_path):
    wrap, options, optimize_ddp = CASES[case]
    options = {**options, "compiler": "eager"}
    run_ranks(_worker, (wrap, options, optimize_ddp, str(tmp_path)), str(tmp_path), WORLD)
    _check_ranks(tmp_path, options, optimize_ddp)


@pytest.mark.slow
def test_ddp_with_a_budget_through_inductor(tmp_path):
    """compile(DDP(model)) through Inductor's code, each of DDPOptimizer's graphs planned at half its own
    range: every rank's gradients equal one process's, and the bytes the compiled graphs really keep
    for backward stay within their plans and so within the budgets."""
    options = {"memory_budget": 0.5}
    run_ranks(_worker, ("compile(ddp)", options, True, str(tmp_path)), str(tmp_path), WORLD)
    _check_ranks(tmp_path, options, True)


def _check_ranks(tmp_path, options: dict, optimize_ddp: bool) -> None:
    ref = _reference_grads()
    results = [torch.load(tmp_path / f"rank{r}.pt") for r in range(WORLD)]
    for rank, res in enumerate(results):
        for step in range(STEPS):
            for name, g in ref[step].items():
                torch.testing.assert_close(
                    res["grads"][step][name],
                    g,
                    rtol=1e-5,
                    atol=1e-6,
                    msg=lambda m: f"rank {rank}, step {step}, {name}: {m}",
                )
        if options.get("memory_budget") is not None:
            assert all(saved <= budget for saved, budget, _ in res["plans"]), res["plans"]
            # one step's report spans every graph: a storage two graphs keep counts once
            kept, budgets = (sum(p[i] for p in res["plans"]) for i in (0, 1))
            assert all(measured <= kept <= budgets for measured in res["saved"]), (res["saved"], res["plans"])
    n_plans = [r["n_plans"] for r in results]
    assert n_plans[0] == n_plans[1], n_plans
    # DDPOptimizer makes one graph per bucket, each compiled once (no recompiles over the steps);
    # without it, one graph
    if optimize_ddp:
        assert n_plans[0] == N_BUCKETS, results[0]["plans"]
    else:
        assert n_plans[0] == 1, results[0]["plans"]


def test_reference_is_the_average_of_the_ranks():
    """The premise of the comparison: the whole-batch gradient is the mean of the per-rank ones."""
    model = _model()
    idx, tgt = _batch()
    model(idx, tgt).backward()
    whole = {n: p.grad.clone() for n, p in model.named_parameters()}
    parts = []
    for r in range(WORLD):
        m = _model()
        m(idx[r * ROWS : (r + 1) * ROWS], tgt[r * ROWS : (r + 1) * ROWS]).backward()
        parts.append({n: p.grad for n, p in m.named_parameters()})
    for n, g in whole.items():
        torch.testing.assert_close(sum(p[n] for p in parts) / WORLD, g, rtol=1e-5, atol=1e-7)
