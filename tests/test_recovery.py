"""A compiled model still compiles, and trains as eager does, after a call that raised and was caught
(issue 49): on a plain model, after a shape error in its own forward and after a strict limit our
backend refused; on a model laid out by ``recompile_opt.parallelize`` over 2 gloo ranks, after the
layout refused a call at another shape (Dynamo then skipped the model's frame for good, and the
partitioner failed on the pieces it compiled instead)."""

from __future__ import annotations

import copy
import os

import pytest
import torch
from helpers import tiny_mlp
from multiprocess import gloo_rank, progress, run_ranks
from test_parallel_rewrite import STEPS, _batch, _model, _train

import recompile_opt

WORLD = 2
EAGER = {"compiler": "eager"}


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    """Each test starts and leaves with Dynamo's caches and its frames' skip marks cleared."""
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _trains_as_eager(model, compiled, inputs, steps: int = 2) -> None:
    """``steps`` SGD steps of ``compiled`` (over ``model``) give an eager copy's gradients."""
    ref = copy.deepcopy(model)
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (ref, model)]
    for step in range(steps):
        for fn, opt in zip((ref, compiled), opts):
            opt.zero_grad(set_to_none=True)
            fn(*inputs).backward()
        for (name, a), b in zip(ref.named_parameters(), model.parameters()):
            torch.testing.assert_close(
                b.grad, a.grad, rtol=1e-4, atol=1e-5, msg=lambda m: f"step {step}, {name}: {m}"
            )
        for opt in opts:
            opt.step()


def test_plain_model_compiles_after_a_caught_shape_error():
    model, (x, y) = tiny_mlp()
    compiled = torch.compile(model, backend="recompile_opt", options=EAGER)
    with pytest.raises(Exception, match="must have same reduction dim"):  # 8 features where 16 go in
        compiled(x[:, :8], y)
    recompile_opt.reset_plans()
    _trains_as_eager(model, compiled, (x, y))
    assert len(recompile_opt.last_plans()) == 1


def test_plain_model_compiles_after_a_caught_strict_limit():
    model, inputs = tiny_mlp()
    strict = torch.compile(
        model, backend="recompile_opt", options={**EAGER, "memory_budget": 1, "strict": True}
    )
    with pytest.raises(recompile_opt.InfeasibleBudget):
        strict(*inputs)
    recompile_opt.reset_plans()
    _trains_as_eager(model, torch.compile(model, backend="recompile_opt", options=EAGER), inputs)
    assert len(recompile_opt.last_plans()) == 1


def _recovery_worker(rank: int, out: str):
    """A fresh compile's plans first (before any error: Dynamo's skip marks are per process), then a
    model compiled alike that is called at a length the ranks cannot split, training and in eval mode
    (both refused, caught), then
    trained at the shape it was laid out for."""
    with gloo_rank(rank, WORLD, out):
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh("cpu", (WORLD,))

        def compiled_model():
            model = recompile_opt.parallelize(_model("gpt"), mesh, [t.to("meta") for t in _batch()])
            return model, torch.compile(model, backend="recompile_opt", options=EAGER)

        model, fn = compiled_model()
        recompile_opt.reset_plans()
        fn(*_batch()).backward()
        fresh = [(p.graph, sorted(e.name for e in p.saved)) for p in recompile_opt.last_plans()]
        progress(out, rank, "fresh compile planned")

        model, fn = compiled_model()
        errors = []
        odd = [t[:, 1:] for t in _batch()]  # a length the 2 ranks cannot split
        for inputs, mode in ((odd, "train"), (odd, "eval")):
            model.train(mode == "train")
            try:
                fn(*inputs)
            except ValueError as e:
                errors.append(str(e))
        model.train()
        recompile_opt.reset_plans()
        losses, grads = _train(model, fn)
        after = [(p.graph, sorted(e.name for e in p.saved)) for p in recompile_opt.last_plans()]
        torch.save(
            {"errors": errors, "losses": losses, "grads": grads, "fresh": fresh, "after": after},
            os.path.join(out, f"rank{rank}.pt"),
        )
        progress(out, rank, "results saved")


def test_parallelized_model_compiles_after_a_caught_refusal(tmp_path):
    run_ranks(_recovery_worker, (str(tmp_path),), str(tmp_path), WORLD)
    model = _model("gpt")
    losses, grads = _train(model, model)
    for rank in range(WORLD):
        res = torch.load(tmp_path / f"rank{rank}.pt")
        assert len(res["errors"]) == 2 and all("not divisible by 2" in e for e in res["errors"])
        # the same graph as a fresh compile's, planned alike: not the pieces of a skipped frame
        assert res["after"] == res["fresh"], rank
        assert res["losses"] == pytest.approx(losses, rel=1e-5)
        for step in range(STEPS):
            for name, g in grads[step].items():
                torch.testing.assert_close(
                    res["grads"][step][name],
                    g,
                    rtol=1e-4,
                    atol=1e-5,
                    msg=lambda m: f"rank {rank}, step {step}, {name}: {m}",
                )
