"""bench/parallel.py's hand-written baselines compute what one process computes: the loss, and the
gradient of every weight DTensor shards (a layout that split GPT's fused [q|k|v] or the heads wrong
fails here, not silently in a benchmark table). Eager, 2 gloo ranks; the benchmark itself compiles
and is run by hand (docs/parallel.md)."""

from __future__ import annotations

import os
import sys

import pytest
import torch
from multiprocess import gloo_rank, progress, run_ranks

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "bench"))
import parallel as bench  # noqa: E402

WORLD = 2


def _grads(model) -> dict:
    from torch.distributed.tensor import DTensor, Shard

    return {
        n: p.grad.full_tensor()
        for n, p in model.named_parameters()
        if isinstance(p, DTensor) and any(isinstance(q, Shard) for q in p.placements)
    }


def _worker(rank: int, out: str):
    with gloo_rank(rank, WORLD, out):
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh("cpu", (WORLD,))
        results = {}
        for name in ("gpt", "llama"):
            for sp in (False, True):
                model, batch = bench._model(name)
                model = bench.hand_parallel(name, model, mesh, sequence_parallel=sp)
                loss = model(*batch)
                loss.backward()
                results[name, sp] = (loss.item(), _grads(model))
                progress(out, rank, f"{name} sp={sp} done")
        torch.save(results, os.path.join(out, f"rank{rank}.pt"))


def test_hand_written_tp_and_tp_sp_equal_one_process(tmp_path):
    run_ranks(_worker, (str(tmp_path),), str(tmp_path), WORLD)
    results = torch.load(tmp_path / "rank0.pt")
    for name in ("gpt", "llama"):
        model, batch = bench._model(name)
        loss = model(*batch)
        loss.backward()
        params = dict(model.named_parameters())
        for sp in (False, True):
            got_loss, grads = results[name, sp]
            assert got_loss == pytest.approx(loss.item(), rel=1e-5)
            assert (
                len(grads) >= 6 * model.config.n_layer
            )  # every block's q, k, v (split from GPT's c_attn), ...
            for n, g in grads.items():
                if n.endswith((".q.weight", ".k.weight", ".v.weight", ".q.bias", ".k.bias", ".v.bias")):
                    i = "qkv".index(n.split(".")[-2])
                    full = params[n.rsplit(".", 2)[0] + ".c_attn." + n.rsplit(".", 1)[1]].grad
                    want = full.chunk(3, 0)[i]
                else:
                    want = params[n].grad
                torch.testing.assert_close(
                    g, want, rtol=1e-4, atol=1e-5, msg=lambda m: f"{name} sp={sp} {n}: {m}"
                )


def test_the_md_output_opens_with_the_provenance_line():
    from test_docs import PROVENANCE

    rows = [
        {
            "model": "gpt",
            "world": 1,
            "config": "no parallelism",
            "peak": 2**20,
            "kept": 2**19,
            "step_s": 0.1,
            "loss": 6.4,
        },
        {
            "model": "gpt",
            "world": 2,
            "config": "hand-tp+sp",
            "peak": 2**19,
            "kept": 2**18,
            "step_s": 0.2,
            "loss": 6.4,
        },
        {
            "model": "gpt",
            "world": 2,
            "config": "ours@0.0",
            "peak": 2**18,
            "kept": 2**17,
            "step_s": 0.3,
            "loss": 6.4,
        },
    ]
    text = bench.markdown_document(rows)
    assert PROVENANCE.match(text.splitlines()[0])
    assert "| gpt | 2 | ours@0.0 | 0.25 | 0.50x | 0.12 | 300.0 | 1.50x | 6.40000 |" in text
