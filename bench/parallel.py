"""Tensor (+ sequence) parallel training on gloo CPU ranks, measured per rank: no parallelism (one
process), hand-written DTensor TP and TP+SP (the torchtitan recipe: ``parallelize_module`` with
``ColwiseParallel`` / ``RowwiseParallel`` / ``SequenceParallel`` / ``PrepareModuleInput``, compiled by
plain ``torch.compile``), and ``recompile_opt.parallelize`` + ``backend="recompile_opt"`` at several
budgets, and the hand TP model compiled with ``options={"sequence_parallel": True}`` (made TP+SP by our
backend; ``hand-tp+sp-option@budget``). Each configuration runs in fresh processes: two warm-up (compiling)
steps, the median peak of seven steps (the allocator's records above the step's start: activations, gradients,
temporaries; the sharded parameters live before it), then the median of ``--steps`` timed steps, and the bytes
one step keeps for backward (its saved tensors, parameters excluded).

    python bench/parallel.py --world 2 4 --md out.md   (docs/parallel.md)

At 4 ranks and more it adds 2-D rows (dp 2 x tp): torchtitan's order, each block compiled (plain
``torch.compile`` for the hand TP+SP, our backend for ours), then FSDP2's ``fully_shard`` per block and
on the root over dp, each dp rank taking half the batch. The "vs hand" columns compare a row with the
hand-written configuration of its kind: the 2-D rows with hand-2d, the others with hand TP+SP.

``--models titan``: torchtitan's own Llama 3 (``bench/torchtitan_llama.py``; needs ``pip install
torchtitan==0.3.0 triton``) at the demo Llama's sizes, laid out by torchtitan's own TP + SP (its
``hand-tp+sp`` row, compiled by plain ``torch.compile``) and by ours from the plain model.

Dropout is off (the hand-written recipes do not slice one process's mask; ours does, see
tests/test_parallel_rewrite.py). Every configuration's first loss is printed next to one process's:
a layout that computed something else would show there.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import tempfile
import time
import types
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from recompile_opt import models  # noqa: E402
from recompile_opt.costs.measure import peak_memory, saved_report, step_time  # noqa: E402

MiB = 2**20
OURS_BUDGETS = (None, 0.5, 0.0)  # None: no budget (the least recompute; keeps all, shards gathered again)
# the hand TP model made TP+SP by our option sequence_parallel=True (no budget, and the least peak)
OPTION_BUDGETS = (None, 0.0)
# 2-D (dp 2 x tp world/2, 4 ranks and more): torchtitan's order, each block compiled, then fully_shard per
# block and on the root over dp, the batch split over dp; hand TP+SP against ours
TWO_D_BUDGETS = (None, 0.0)
TWO_D = ("hand-2d", *(f"ours-2d@{b}" for b in TWO_D_BUDGETS))
# torchtitan's Llama 3: its own TP + SP recipe (in the hand-tp+sp row) and ours from the plain model
TITAN_CONFIGS = ("hand-tp+sp", *(f"ours@{b}" for b in OURS_BUDGETS))
CONFIGS = (
    "hand-tp",
    "hand-tp+sp",
    *(f"ours@{b}" for b in OURS_BUDGETS),
    *(f"hand-tp+sp-option@{b}" for b in OPTION_BUDGETS),
    *TWO_D,
)


# ---------------------------------------------------------------------------------------------------
# The hand-written baselines. DTensor's styles shard the linears; the model code must then work on a
# rank's heads, which the benchmark models (nanoGPT style: ``view(b, s, n_head, h // n_head)``, a fused
# [q|k|v] projection) do not: as a user of parallelize_module would, the attention is rewritten to
# take the head count from the local shard, and GPT's fused projection split into q, k and v.


def _gpt_attention(self, x: torch.Tensor) -> torch.Tensor:
    b, s, _ = x.shape
    q, k, v = (p(x).view(b, s, -1, self.head_dim).transpose(1, 2) for p in (self.q, self.k, self.v))
    att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(self.head_dim))
    att = att.masked_fill(~self.causal_mask[:, :, :s, :s], float("-inf"))
    y = (self.attn_dropout(F.softmax(att, dim=-1)) @ v).transpose(1, 2).contiguous().view(b, s, -1)
    return self.resid_dropout(self.c_proj(y))


def _llama_attention(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    b, s, _ = x.shape
    q = models.apply_rotary(self.wq(x).view(b, s, -1, self.head_dim), cos, sin).transpose(1, 2)
    k = models.apply_rotary(self.wk(x).view(b, s, -1, self.head_dim), cos, sin).transpose(1, 2)
    v = self.wv(x).view(b, s, -1, self.head_dim).transpose(1, 2)
    y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    return self.resid_dropout(self.wo(y.transpose(1, 2).reshape(b, s, -1)))


def _split_fused_qkv(attn: nn.Module) -> None:
    h = attn.c_proj.in_features
    for i, name in enumerate("qkv"):
        lin = nn.Linear(h, h, bias=attn.c_attn.bias is not None)
        with torch.no_grad():
            lin.weight.copy_(attn.c_attn.weight[i * h : (i + 1) * h])
            if lin.bias is not None:
                lin.bias.copy_(attn.c_attn.bias[i * h : (i + 1) * h])
        setattr(attn, name, lin)
    del attn.c_attn


def hand_parallel(name: str, model: nn.Module, mesh, sequence_parallel: bool) -> nn.Module:
    """``model`` laid out by hand with DTensor's parallel styles (torchtitan's Llama plan, and the same
    for GPT), TP or TP+SP."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        SequenceParallel,
        parallelize_module,
    )

    sp = sequence_parallel
    row_out = {"output_layouts": Shard(1)} if sp else {}
    if name == "gpt":
        embed, head, final_norm = "wte", "lm_head", "ln_f"
        attn, mlp, norms = "attn", "mlp", ("ln_1", "ln_2")
        cols, rows = ("attn.q", "attn.k", "attn.v", "mlp.c_fc"), ("attn.c_proj", "mlp.c_proj")
    else:
        embed, head, final_norm = "tok_embeddings", "output", "norm"
        attn, mlp, norms = "attention", "feed_forward", ("attention_norm", "ffn_norm")
        cols, rows = (
            ("attention.wq", "attention.wk", "attention.wv", "feed_forward.w1", "feed_forward.w3"),
            ("attention.wo", "feed_forward.w2"),
        )
    top = {
        embed: RowwiseParallel(input_layouts=Replicate(), **row_out),
        head: ColwiseParallel(input_layouts=Shard(1) if sp else Replicate(), output_layouts=Replicate()),
    }
    if sp:
        top[final_norm] = SequenceParallel()
        if name == "gpt":  # positions: a [s, h] table, its rows reduce-scattered like the tokens'
            top["wpe"] = RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(0))
    parallelize_module(model, mesh, top)
    for block in model.blocks:
        module = getattr(block, attn)
        module.head_dim = model.config.n_embd // model.config.n_head
        if name == "gpt":
            _split_fused_qkv(module)
            module.forward = types.MethodType(_gpt_attention, module)
        else:
            module.forward = types.MethodType(_llama_attention, module)
        plan = {**{c: ColwiseParallel() for c in cols}, **{r: RowwiseParallel(**row_out) for r in rows}}
        if sp:
            extra = (None, None) if name == "llama" else ()
            plan.update({n: SequenceParallel() for n in norms})
            plan[attn] = PrepareModuleInput(
                input_layouts=(Shard(1), *extra), desired_input_layouts=(Replicate(), *extra)
            )
            plan[mlp] = PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),))
        parallelize_module(block, mesh, plan)
    return model


# ---------------------------------------------------------------------------------------------------


def _model(name: str):
    if name == "titan":
        from torchtitan_llama import build

        return build()
    return models.demo_gpt() if name == "gpt" else models.demo_llama()


# steps whose peaks give the median: one step's peak varies between steps and runs of one configuration
# here (gloo's own thread allocates, and frees land before or after the other rank's part of a
# collective): ours at no budget on the Llama at 2 ranks peaked 29.82, 25.82 and 24.82 MiB in three steps
# of one run (predicted 22.78), and medians of three differed by up to 4.5 MiB between fresh runs
PEAK_STEPS = 7


def _measure(step, steps: int) -> dict:
    """The median of :data:`PEAK_STEPS` steps' peaks, then the median of ``steps`` timed steps."""
    peak = statistics.median(peak_memory(step) for _ in range(PEAK_STEPS))
    times = step_time(step, steps=steps, warmup=0)
    return {"peak": peak, "step_s": statistics.median(times)}


def _kept(model, fn, batch) -> int:
    """Bytes one step keeps for backward: the distinct storages of its saved tensors, the parameters
    (a DTensor's local shard) and buffers excluded. Where two layouts peak apart, this tells whether
    they keep different bytes or free them in a different order."""
    from torch.distributed.tensor import DTensor

    params = [p.to_local() if isinstance(p, DTensor) else p for p in model.parameters()]
    report, loss = saved_report(lambda: fn(*batch), exclude=[params, list(model.buffers())])
    loss.backward()
    for p in model.parameters():
        p.grad = None
    return report.total_bytes


def _step_fn(model, fn, batch):
    losses = []

    def step():
        for p in model.parameters():
            p.grad = None
        loss = fn(*batch)
        loss.backward()
        losses.append(float(loss.full_tensor() if hasattr(loss, "full_tensor") else loss))

    return step, losses


def _rank(rank: int, name: str, config: str, world: int, out: str, args) -> None:
    torch.set_num_threads(1)
    os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")
    dist.init_process_group(
        "gloo",
        init_method=f"file://{os.path.join(out, 'store')}",
        rank=rank,
        world_size=world,
        timeout=timedelta(seconds=600),
    )
    from torch.distributed.device_mesh import init_device_mesh

    import recompile_opt

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))  # torchtitan reads the name
    model, batch = _model(name)
    budget = config.split("@", 1)[1] if "@" in config else "None"
    options = {} if budget == "None" else {"memory_budget": float(budget)}
    if config in TWO_D:
        model, fn, batch = _two_d(name, config, model, batch, world, options)
    elif config.startswith("hand-tp+sp-option"):
        model = hand_parallel(name, model, mesh, sequence_parallel=False)
        fn = torch.compile(model, backend="recompile_opt", options={**options, "sequence_parallel": True})
    elif name == "titan" and config == "hand-tp+sp":
        from torchtitan_llama import torchtitan_tp_sp

        model = torchtitan_tp_sp(model, mesh)
        fn = torch.compile(model)
    elif config.startswith("hand"):
        model = hand_parallel(name, model, mesh, sequence_parallel=config.endswith("+sp"))
        fn = torch.compile(model)
    else:
        model = recompile_opt.parallelize(model, mesh, batch)
        fn = torch.compile(model, backend="recompile_opt", options=options)
    step, losses = _step_fn(model, fn, batch)
    start = time.perf_counter()
    for _ in range(2):
        step()
    compile_s = time.perf_counter() - start
    res = {
        **_measure(step, args.steps),
        "kept": _kept(model, fn, batch),
        "compile_s": compile_s,
        "loss": losses[0],
        "rank": rank,
    }
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump(res, f)
    dist.barrier()
    dist.destroy_process_group()


def _two_d(name: str, config: str, model, batch, world: int, options: dict):
    """``model`` laid out over dp 2 x tp world/2 (:data:`TWO_D`); its step function and this rank's rows."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    import recompile_opt

    mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("dp", "tp"))
    dp = mesh["dp"].get_local_rank()
    batch = tuple(t.chunk(2)[dp].contiguous() for t in batch)
    if config == "hand-2d":
        model = hand_parallel(name, model, mesh["tp"], sequence_parallel=True)
    else:
        model = recompile_opt.parallelize(model, mesh["tp"], batch)
    for block in model.blocks:
        block.compile(**({} if config == "hand-2d" else {"backend": "recompile_opt", "options": options}))
        fully_shard(block, mesh=mesh["dp"])
    fully_shard(model, mesh=mesh["dp"])
    return model, model, batch


def _single(name: str, steps: int) -> dict:
    """No parallelism: the whole model in this process, plain torch.compile."""
    torch.set_num_threads(1)
    torch._dynamo.reset()
    model, batch = _model(name)
    fn = torch.compile(model)
    step, losses = _step_fn(model, fn, batch)
    for _ in range(2):
        step()
    return {**_measure(step, steps), "kept": _kept(model, fn, batch), "loss": losses[0]}


def run(name: str, config: str, world: int, args) -> dict:
    """One configuration on ``world`` fresh processes: the largest per-rank peak, the slowest rank's
    median step."""
    with tempfile.TemporaryDirectory() as out:
        mp.start_processes(_rank, args=(name, config, world, out, args), nprocs=world, start_method="spawn")
        ranks = [json.load(open(os.path.join(out, f"rank{r}.json"))) for r in range(world)]
    return {
        "peak": max(r["peak"] for r in ranks),
        "step_s": max(r["step_s"] for r in ranks),
        "kept": max(r["kept"] for r in ranks),
        "compile_s": max(r["compile_s"] for r in ranks),
        # 2-D: each dp rank's loss is its half's mean, so the global batch's is their mean
        "loss": statistics.mean(r["loss"] for r in ranks) if config in TWO_D else ranks[0]["loss"],
    }


def _label(row: dict) -> str:
    return (
        "torchtitan's own TP+SP"
        if row["model"] == "titan" and row["config"] == "hand-tp+sp"
        else row["config"]
    )


def markdown(rows: list[dict]) -> str:
    lines = [
        "| model | ranks | configuration | per-rank peak (MiB) | vs hand | kept (MiB) | step (ms) "
        "| vs hand | first loss |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        ref = next(
            (
                x
                for x in rows
                if x["model"] == r["model"]
                and x["world"] == r["world"]
                and x["config"] == ("hand-2d" if r["config"] in TWO_D else "hand-tp+sp")
            ),
            None,
        )
        ratio = (lambda k: f"{r[k] / ref[k]:.2f}x" if ref else "") if r["world"] > 1 else (lambda k: "")
        lines.append(
            f"| {r['model']} | {r['world']} | {_label(r)} | {r['peak'] / MiB:.2f} | {ratio('peak')} "
            f"| {r['kept'] / MiB:.2f} | {r['step_s'] * 1e3:.1f} | {ratio('step_s')} | {r['loss']:.5f} |"
        )
    return "\n".join(lines)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--models", nargs="+", default=["gpt", "llama"], choices=["gpt", "llama", "titan"]
    )  # titan: torchtitan's Llama 3 (pip install torchtitan==0.3.0 triton)
    p.add_argument("--world", nargs="+", type=int, default=[2, 4])
    p.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=CONFIGS)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--md", help="write the table (with the command that made it) to this file")
    p.add_argument("--json", help="write every row to this file")
    args = p.parse_args(argv)
    rows = []
    for name in args.models:
        rows.append({"model": name, "world": 1, "config": "no parallelism", **_single(name, args.steps)})
        print(markdown(rows[-1:]).splitlines()[-1], flush=True)
        for world in args.world:
            configs = [c for c in args.configs if (world >= 4 or c not in TWO_D)]
            for config in [c for c in configs if name != "titan" or c in TITAN_CONFIGS]:
                rows.append(
                    {"model": name, "world": world, "config": config, **run(name, config, world, args)}
                )
                print(markdown(rows[-1:]).splitlines()[-1], flush=True)
    print(markdown(rows))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    if args.md:
        with open(args.md, "w") as f:
            f.write(markdown_document(rows))


def markdown_document(rows: list[dict]) -> str:
    """What ``--md`` writes: the provenance line (versions, machine, load, date), then the table."""
    from recompile_opt.provenance import header_line

    return f"{header_line()}\n\n{markdown(rows)}\n"


if __name__ == "__main__":
    main()
