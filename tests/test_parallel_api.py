"""``recompile_opt.parallelize`` / ``parallel_plan``, the user's entry to tensor + sequence parallelism, on
2 gloo ranks: the benchmark GPT through the public calls equals one process (eager, and compiled by
recompile_opt at 0.0 through the eager compiler; the parallelized model through Inductor at 0.0:
test_parallel_fsdp.py, and at several shapes: test_parallel_shapes.py), and each bad input
is an error naming what is wrong. Compiled with ``dynamic=True`` too (the backward reads an all-gather's
symbolic size: ``passes/joint_graph.sizes_before_gathers``)."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
from multiprocess import gloo_rank, progress, run_ranks
from test_parallel_rewrite import SEQ, STEPS, _batch, _model, _train

import recompile_opt

WORLD = 2


def _errors(rank: int) -> dict:
    """Each bad input's error type and message (no exception escapes)."""
    from torch.distributed.device_mesh import init_device_mesh

    out = {}

    def attempt(key, fn):
        try:
            fn()
            out[key] = None
        except Exception as e:  # noqa: BLE001 - the test reads the type and the message
            out[key] = (type(e).__name__, str(e))

    mesh = init_device_mesh("cpu", (WORLD,))
    attempt(
        "2-D mesh",
        lambda: recompile_opt.parallelize(_model("gpt"), init_device_mesh("cpu", (1, WORLD)), _batch()),
    )
    attempt("not a mesh", lambda: recompile_opt.parallelize(_model("gpt"), mesh.get_group(), _batch()))
    short = tuple(t[:, : SEQ - 1].contiguous() for t in _batch())
    attempt("sequence", lambda: recompile_opt.parallelize(_model("gpt"), mesh, short))
    model = recompile_opt.parallelize(_model("gpt"), mesh, _batch())
    attempt("other batch", lambda: model(*(t[:1] for t in _batch())))  # served: a rank's graph of its own
    attempt("sequence at a call", lambda: model(*short))
    attempt("not parallelized", lambda: recompile_opt.parallel_plan(_model("gpt")))
    calls = []
    hook = model.blocks[1].register_forward_pre_hook(lambda m, args: calls.append(len(args)))  # as FSDP2's
    attempt("hook", lambda: model(*_batch()))  # served: the block is called for its piece of the graph
    out["hook calls"] = list(calls)
    inner = model.blocks[1].attn.register_forward_hook(lambda m, args, output: None)
    attempt("hook inside a hooked block", lambda: model(*_batch()))
    hook.remove()
    inner.remove()
    attempt("hooks removed", lambda: model(*_batch()))
    return out


def _worker(rank: int, out: str, compiler: str):
    with gloo_rank(rank, WORLD, out):
        from torch.distributed.device_mesh import init_device_mesh

        errors = _errors(rank)
        mesh = init_device_mesh("cpu", (WORLD,))
        results = {}
        compiled = {"memory_budget": 0.0, "compiler": compiler}
        for key, options, dynamic in (
            ("eager", None, False),
            ("compiled", compiled, False),
            ("dynamic", compiled, True),
        ):
            torch._dynamo.reset()
            model = recompile_opt.parallelize(_model("gpt"), mesh, [t.to("meta") for t in _batch()])
            step_fn = (
                model
                if options is None
                else torch.compile(model, backend="recompile_opt", options=options, dynamic=dynamic)
            )
            recompile_opt.reset_plans()
            losses, grads = _train(model, step_fn)
            # what the plan counts as kept inputs: never a sharded weight (a DTensor's local tensor is a
            # parameter, free to keep), only the token ids and targets
            inputs = [
                e.dtype
                for p in recompile_opt.last_plans()
                for e in p.saved
                if e.reason == "input" and e.bytes
            ]
            results[key] = {"losses": losses, "grads": grads, "kept_inputs": inputs}
        torch.save(
            {
                "errors": errors,
                "results": results,
                "layout": str(recompile_opt.parallel_plan(model)),
                "compiled_layout": str(recompile_opt.parallel_plan(step_fn)),
            },
            os.path.join(out, f"rank{rank}.pt"),
        )
        progress(out, rank, "results saved")


@pytest.mark.parametrize("compiler", ["eager"])
def test_parallelize_equals_one_process_and_explains_bad_input(compiler, tmp_path):
    run_ranks(_worker, (str(tmp_path), compiler), str(tmp_path), WORLD)
    model = _model("gpt")
    losses, grads = _train(model, model)
    for rank in range(WORLD):
        res = torch.load(tmp_path / f"rank{rank}.pt")
        for key, run in res["results"].items():
            assert run["losses"] == pytest.approx(losses, rel=1e-5), key
            for step in range(STEPS):
                for n, g in grads[step].items():
                    torch.testing.assert_close(
                        run["grads"][step][n],
                        g,
                        rtol=1e-4,
                        atol=1e-5,
                        msg=lambda m: f"{key}, rank {rank}, step {step}, {n}: {m}",
                    )
        assert set(res["results"]["compiled"]["kept_inputs"]) <= {
            "int64"
        }  # token ids at most, never a weight
        layout = res["layout"]
        assert res["compiled_layout"] == layout
        assert (
            "sequence parallel" in layout
            and "blocks.0.attn.c_attn" in layout
            and "_StridedShard(0, 3)" in layout
        )
        assert "row" in layout and "vocab" in layout
        errors = res["errors"]
        assert errors["2-D mesh"][0] == "ValueError" and "1-D device mesh" in errors["2-D mesh"][1]
        assert errors["not a mesh"][0] == "TypeError" and "DeviceMesh" in errors["not a mesh"][1]
        assert (
            errors["sequence"][0] == "ValueError"
            and f"length {SEQ - 1} is not divisible by 2" in errors["sequence"][1]
        )
        assert errors["other batch"] is None
        assert (
            errors["sequence at a call"][0] == "ValueError"
            and f"length {SEQ - 1} is not divisible by 2" in errors["sequence at a call"][1]
        )
        assert errors["not parallelized"][0] == "ValueError"
        # the block called once, with the values its piece of the graph reads (its hidden states' rows
        # and what the graph made before it and shares with it)
        assert errors["hook"] is None and len(errors["hook calls"]) == 1 and errors["hook calls"][0] >= 1
        assert (
            errors["hook inside a hooked block"][0] == "ValueError"
            and "module 'blocks.1.attn' has forward or backward hooks"
            in errors["hook inside a hooked block"][1]
        )
        assert errors["hooks removed"] is None


def test_parallelize_needs_torch_distributed():
    assert not dist.is_initialized()
    from torch.distributed.device_mesh import DeviceMesh

    with pytest.raises(RuntimeError, match="init_process_group"):
        recompile_opt.parallelize(_model("gpt"), object.__new__(DeviceMesh), _batch())
