"""Megatron's transitions (recompile_opt.parallel.collectives) on 2 gloo processes: an MLP block laid out
tensor parallel, and tensor + sequence parallel, by hand with them gives every rank the single
process's loss and the slices of its gradients, eager and compiled by recompile_opt (every collective
in the graph, none lost or duplicated by the planner)."""

from __future__ import annotations

import functools
import os

import pytest
import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.nn.functional as F
from multiprocess import gloo_rank, progress, run_ranks

from recompile_opt.compile_paths import compile_eager
from recompile_opt.options import parse_options
from recompile_opt.parallel import collectives as C
from recompile_opt.partitioner import RecompilePartitioner

WORLD, B, S, H, FF = 2, 2, 8, 8, 16


def _weights():
    g = torch.Generator().manual_seed(0)
    return {
        "ln": 1 + 0.1 * torch.randn(H, generator=g),
        "w1": torch.randn(FF, H, generator=g) / H**0.5,
        "b1": 0.1 * torch.randn(FF, generator=g),
        "w2": torch.randn(H, FF, generator=g) / FF**0.5,
        "b2": 0.1 * torch.randn(H, generator=g),
    }


def _input():
    return torch.randn(B, S, H, generator=torch.Generator().manual_seed(1))


def _block(x, p):
    """The single-process block: LayerNorm, fc1, GELU, fc2, residual."""
    y = F.layer_norm(x, (H,), p["ln"])
    return x + F.linear(F.gelu(F.linear(y, p["w1"], p["b1"])), p["w2"], p["b2"])


def _tensor_parallel(x, p, group):
    """Megatron's TP: fc1 column-parallel (this rank's rows), fc2 row-parallel (its columns); f before,
    g after; the rest replicated."""
    y = C.copy_to_tensor_parallel(F.layer_norm(x, (H,), p["ln"]), group)
    partial = F.linear(F.gelu(F.linear(y, p["w1"], p["b1"])), p["w2"])
    return x + C.reduce_from_tensor_parallel(partial, group) + p["b2"]


def _sequence_parallel(x, p, group):
    """TP + SP: the norm, the residual and fc2's bias on this rank's sequence shard; all-gather before
    fc1, reduce-scatter after fc2; the replicated norm weight and bias summed over the ranks (f)."""
    x = C.split_sequence(x, group)
    y = C.gather_sequence(F.layer_norm(x, (H,), C.copy_to_tensor_parallel(p["ln"], group)), group)
    partial = F.linear(F.gelu(F.linear(y, p["w1"], p["b1"])), p["w2"])
    return x + C.reduce_scatter_sequence(partial, group) + C.copy_to_tensor_parallel(p["b2"], group)


def _sequence_parallel_gathered(x, p, group, rank: int):
    """TP + SP, then the output gathered whole for a computation every rank repeats (an LM head's): the
    all-gather along the sequence that is no autograd collective (torch 2.11's Dynamo skipped the
    chunk-and-concatenate inside it: a graph break, an error under ``fullgraph``)."""
    return C.gather_sequence_for_replicated(_sequence_parallel(x, p, group), group, size=WORLD, rank=rank)


def _shard(p: dict, rank: int) -> dict:
    rows = slice(rank * FF // WORLD, (rank + 1) * FF // WORLD)
    return {"ln": p["ln"], "w1": p["w1"][rows], "b1": p["b1"][rows], "w2": p["w2"][:, rows], "b2": p["b2"]}


# collectives per step, forward and backward: TP's g and f's backward; SP's gather and reduce-scatter and
# their conjugates, and f's backward for the norm weight and the bias (the input needs no gradient)
COUNTS = {
    "tp": {"all_reduce": 2},
    "sp": {"all_gather_into_tensor": 2, "reduce_scatter_tensor": 2, "all_reduce": 2},
    # and the output's gather (its backward keeps this rank's slice: no collective)
    "sp-gathered": {"all_gather_into_tensor": 3, "reduce_scatter_tensor": 2, "all_reduce": 2},
}


def _plain(t: torch.Tensor) -> torch.Tensor:
    """A tensor to save: eager functional collectives return tensors that wait when first read."""
    return (t.wait() if isinstance(t, funcol.AsyncCollectiveTensor) else t).detach().clone()


def _collectives(gm) -> dict:
    found = {}
    for node in gm.graph.nodes:
        if getattr(node.target, "namespace", "") == "_c10d_functional" and "wait" not in str(node.target):
            name = node.target._overloadpacket.__name__
            found[name] = found.get(name, 0) + 1
    return found


def _worker(rank: int, layout: str, compiled: bool, options: dict, out: str):
    with gloo_rank(rank, WORLD, out):
        group = dist.group.WORLD
        params = {k: v.clone().requires_grad_() for k, v in _shard(_weights(), rank).items()}
        fn = {
            "tp": _tensor_parallel,
            "sp": _sequence_parallel,
            "sp-gathered": functools.partial(_sequence_parallel_gathered, rank=rank),
        }[layout]
        parts = []

        def backend(gm, example_inputs):  # our partitioner, its graphs kept for counting
            parts.append(RecompilePartitioner(parse_options({**options, "compiler": "eager"})))
            return compile_eager(gm, example_inputs, parts[-1])

        if compiled:
            fn = torch.compile(fn, backend=backend, fullgraph=True)
        out_local = fn(_input(), params, group)
        loss = (out_local**2).sum()
        loss.backward()
        counts = [_collectives(g) for part in parts for g in (part.last_forward, part.last_backward)]
        torch.save(
            {
                "out": _plain(out_local),
                "grads": {k: _plain(v.grad) for k, v in params.items()},
                "counts": counts,
                # the all-gathers the plans say their backward runs again (a re-gather of a kept shard)
                "regathered": sum(
                    1
                    for part in parts
                    for plan in part.plans
                    for c in plan.collectives
                    if c.get("regathered")
                ),
            },
            os.path.join(out, f"rank{rank}.pt"),
        )
        progress(out, rank, "results saved")


CASES = {
    "tp-eager": ("tp", False, {}),
    "sp-eager": ("sp", False, {}),
    "tp-save-all": ("tp", True, {"memory_budget": 1.0}),
    "sp-budget-0.0": ("sp", True, {"memory_budget": 0.0}),
    "sp-full": ("sp", True, {"policy": "full"}),
    "sp-gathered-0.0": ("sp-gathered", True, {"memory_budget": 0.0}),
}


@pytest.mark.parametrize("case", CASES)
def test_a_block_laid_out_by_hand_equals_one_process(case, tmp_path):
    layout, compiled, options = CASES[case]
    run_ranks(_worker, (layout, compiled, options, str(tmp_path)), str(tmp_path), WORLD)
    p = {k: v.clone().requires_grad_() for k, v in _weights().items()}
    x = _input()
    ref = _block(x, p)
    (ref**2).sum().backward()
    for rank in range(WORLD):
        res = torch.load(tmp_path / f"rank{rank}.pt")
        whole = layout in ("tp", "sp-gathered")  # every rank's output (and loss) the whole one
        expected_out = ref if whole else ref[:, rank * S // WORLD : (rank + 1) * S // WORLD]
        torch.testing.assert_close(res["out"], expected_out.detach(), rtol=1e-5, atol=1e-6)
        # every layout gives each rank its slices of the whole gradients: where every rank computes the
        # whole loss (tp, sp-gathered) they are the whole ones sliced; where each rank's loss is its
        # shard's (sp), the sharded weights' are its slices and f sums the rest
        expected = _shard({k: v.grad for k, v in p.items()}, rank)
        for name, grad in res["grads"].items():
            torch.testing.assert_close(
                grad, expected[name], rtol=1e-5, atol=1e-6, msg=lambda m: f"rank {rank}, {name}: {m}"
            )
        if compiled:
            total = {}
            for c in res["counts"]:
                for k, n in c.items():
                    total[k] = total.get(k, 0) + n
            # the layout's collectives, and one more all-gather for each re-gather its plans state
            expected = dict(COUNTS[layout])
            if res["regathered"]:
                expected["all_gather_into_tensor"] = (
                    expected.get("all_gather_into_tensor", 0) + res["regathered"]
                )
            assert total == expected, (res["counts"], res["regathered"])
