"""2-D parallelism the torchtitan way on 4 gloo ranks (issue 49): ``recompile_opt.parallelize`` on the
``tp`` half of a dp 2 x tp 2 mesh, then FSDP2's ``fully_shard`` on each block and on the root over
``dp``, the global batch split over ``dp``. The blocks' hooks fire because each block runs its own piece
of the rank's graph (:mod:`recompile_opt.parallel.pieces`): 3 AdamW steps give one process's losses,
gradients and parameters, eager, with each block compiled by recompile_opt (torchtitan's per-block
compile) and with the whole model compiled; a forward hook on a block fires once a step. Through
Inductor (each block compiled) in the slow run."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.distributed as dist
from multiprocess import gloo_rank, progress, run_ranks
from test_parallel_rewrite import SEQ
from test_parallel_rewrite import _model as benchmark_model

import recompile_opt

WORLD, DP, TP, STEPS, BATCH = 4, 2, 2, 3, 4
LR = 1e-2
# Adam's step is normalised by the gradient's own size, so gradients equal within fp32 tolerance (checked
# at every step) leave parameters up to 1.4e-5 apart after 3 steps (Hugging Face Llama and GPT-2, 1-2
# elements of an embedding or MLP weight; the benchmark models within 1e-5): a 200th of one step
PARAM_ATOL = LR / 200
BLOCKS_AT_0 = {"memory_budget": 0.0, "compiler": "eager"}
WHOLE_AT_HALF = {"memory_budget": 0.5, "compiler": "eager"}


def _model(name: str) -> torch.nn.Module:
    """The benchmark GPT or Llama, or a Hugging Face model (``hf-llama``, ``hf-gpt2``) returning its loss."""
    if name.startswith("hf-"):
        from test_hf_models import build

        return build(name[3:])[0]
    return benchmark_model(name)


def _blocks(model: torch.nn.Module) -> torch.nn.ModuleList:
    if hasattr(model, "blocks"):
        return model.blocks
    inner = model.model  # Hugging Face: WithLoss -> *ForCausalLM -> its body
    return inner.model.layers if hasattr(inner, "model") else inner.transformer.h


def _batches(dp_rank: int | None = None) -> list:
    """The global batches, or data-parallel rank ``dp_rank``'s half of each."""
    g = torch.Generator().manual_seed(1)
    out = []
    for _ in range(STEPS):
        x, y = (torch.randint(0, 64, (BATCH, SEQ), generator=g) for _ in range(2))
        rows = slice(None) if dp_rank is None else slice(dp_rank * BATCH // DP, (dp_rank + 1) * BATCH // DP)
        out.append((x[rows], y[rows]))
    return out


def _train(model, step_fn, batches, read=lambda t: t.detach().clone()) -> tuple[list, list]:
    """Losses and, per step, every parameter's gradient (``read`` of it) over AdamW steps."""
    # eps 1e-6, not 1e-8: the key's bias gets no gradient in exact arithmetic (softmax ignores a shift),
    # and at 1e-8 Adam turns the rounding left in its place into steps of full size (2e-4 apart)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, eps=1e-6)
    losses, grads = [], []
    for x, y in batches:
        opt.zero_grad(set_to_none=True)
        loss = step_fn(x, y)
        loss.backward()
        losses.append(loss.detach().clone())
        grads.append({n: read(p.grad) for n, p in model.named_parameters()})
        opt.step()
    return losses, grads


def _shards(t: torch.Tensor) -> torch.Tensor:
    """A DTensor as training sees it: its full value, or where FSDP re-shards a strided tensor-parallel
    shard (placements it does not describe, pieces.warn_strided_resharded) this rank's local shard."""
    *dp, tp = t.placements
    resharded = type(tp).__name__ == "_StridedShard" and any(getattr(p, "dim", None) == tp.dim for p in dp)
    return t.to_local().clone() if resharded else t.full_tensor().clone()


def _worker(rank: int, out: str, name: str, modes: list[str]):
    with gloo_rank(rank, WORLD, out):
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (DP, TP), mesh_dim_names=("dp", "tp"))
        dp = mesh["dp"].get_local_rank()
        results = {}
        for mode in modes:
            torch._dynamo.reset()
            recompile_opt.reset_plans()
            meta = [t.to("meta") for t in _batches(0)[0]]
            model = recompile_opt.parallelize(_model(name), mesh["tp"], meta)
            calls = []
            _blocks(model)[0].register_forward_hook(lambda m, args, output: calls.append(len(args)))
            for block in _blocks(model):
                if mode.startswith("blocks"):
                    options = BLOCKS_AT_0 if mode == "blocks compiled" else {"memory_budget": 0.0}
                    block.compile(backend="recompile_opt", options=options)
                fully_shard(block, mesh=mesh["dp"])
            fully_shard(model, mesh=mesh["dp"])
            step_fn = model
            if mode == "whole compiled":
                step_fn = torch.compile(model, backend="recompile_opt", options=WHOLE_AT_HALF)
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                losses, grads = _train(model, step_fn, _batches(dp), read=_shards)
            for loss in losses:  # each dp rank's mean over its half: the global mean is theirs averaged
                dist.all_reduce(loss, group=mesh["dp"].get_group())
            results[mode] = {
                "losses": [float(loss) / DP for loss in losses],
                "grads": grads,
                "params": {n: _shards(p.detach()) for n, p in model.named_parameters()},
                "hook calls": calls,
                "plans": len(recompile_opt.last_plans()),
                "warned": [str(w.message) for w in caught if "FSDP shards" in str(w.message)],
            }
            progress(out, rank, f"{mode} done")
        torch.save({"results": results, "dp": dp, "tp": mesh["tp"].get_local_rank()}, f"{out}/rank{rank}.pt")


def _local_of_strided(full: torch.Tensor, dp: int, tp: int) -> torch.Tensor:
    """What FSDP holds on rank (dp, tp) of a fused QKV tensor: the tensor-parallel shard (each of q, k, v
    split over tp) split again on dim 0 over dp."""
    tp_shard = torch.cat([part.chunk(TP)[tp] for part in full.chunk(3)])
    return tp_shard.chunk(DP)[dp]


def _check(tmp_path, name: str, modes: list[str]) -> None:
    run_ranks(_worker, (str(tmp_path), name, modes), str(tmp_path), WORLD)
    model = _model(name)
    losses, grads = _train(model, model, _batches())
    params = {n: p.detach() for n, p in model.named_parameters()}
    for rank in range(WORLD):
        saved = torch.load(tmp_path / f"rank{rank}.pt")
        for mode, run in saved["results"].items():
            where = f"{name}, {mode}, rank {rank}"
            assert run["losses"] == pytest.approx([float(x) for x in losses], rel=1e-5), where
            assert len(run["hook calls"]) == STEPS, where  # the block's forward hook fired once a step
            assert run["plans"] > 0 if mode != "eager" else run["plans"] == 0, where
            for step, want in [*enumerate(grads), (STEPS, params)]:
                for n, value in want.items():
                    got = run["grads"][step][n] if step < STEPS else run["params"][n]
                    if got.shape != value.shape:  # a fused QKV's local shard
                        assert run["warned"], where
                        value = _local_of_strided(value, saved["dp"], saved["tp"])
                    atol = 1e-5 if step < STEPS else PARAM_ATOL
                    torch.testing.assert_close(
                        got, value, rtol=1e-4, atol=atol, msg=lambda m: f"{where}, step {step}, {n}: {m}"
                    )


@pytest.mark.parametrize("name", ["gpt", "llama"])
def test_fsdp_per_block_on_tensor_parallel_blocks_equals_one_process(name, tmp_path):
    _check(tmp_path, name, ["eager", "blocks compiled", "whole compiled"])


@pytest.mark.slow
def test_fsdp_per_block_on_blocks_compiled_by_inductor_equals_one_process(tmp_path):
    _check(tmp_path, "llama", ["blocks through inductor"])


@pytest.mark.slow
@pytest.mark.parametrize("name", ["hf-llama", "hf-gpt2"])
def test_fsdp_per_block_on_hugging_face_models_equals_one_process(name, tmp_path):
    pytest.importorskip("transformers")
    _check(tmp_path, name, ["eager", "blocks compiled"])
