"""Each rank's forward written from the exported graph (recompile_opt.parallel.rewrite, issue 22 step 5:
tensor parallel, no sequence parallelism yet), on 2 gloo ranks: the benchmark's GPT (fused QKV, head
count hard-coded in its views, vocabulary-parallel token embedding) and Llama give one process's loss
and, through ``full_tensor()``, its gradients over 3 SGD steps, eager and compiled by recompile_opt."""

from __future__ import annotations

import copy
import os
import warnings

import pytest
import torch
from multiprocess import gloo_rank, progress, run_ranks

from recompile_opt import models

WORLD, SEQ, STEPS = 2, 16, 3


def complex_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Meta's reference Llama's and torchtitan's rotary embedding: each (even, odd) pair of a head's
    features viewed as a complex number, turned by its angle, viewed back; ``models.apply_rotary``'s
    values, through ``view_as_complex`` / ``view_as_real``."""
    pairs = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2))
    return torch.view_as_real(pairs * torch.complex(cos, sin)).flatten(3).type_as(x)


class ComplexRotaryAttention(models.LlamaAttention):
    """The Llama attention with :func:`complex_rotary` (a model family written with complex numbers)."""

    rotate = staticmethod(complex_rotary)


def _model(name: str, dropout: float = 0.0):
    torch.manual_seed(0)
    if name == "llama-complex":  # the Llama with complex rotary embeddings, dropout off
        model = _model("llama")
        for block in model.blocks:
            block.attention.__class__ = ComplexRotaryAttention
        return model
    if name == "block":  # a bare GPT block: hidden states in, hidden states out
        return models.Block(models.GPTConfig(n_layer=1, n_head=4, n_embd=32, block_size=SEQ, dropout=dropout))
    if name == "gpt":
        return models.GPT(
            models.GPTConfig(n_layer=2, n_head=4, n_embd=32, block_size=SEQ, vocab_size=64, dropout=dropout)
        )
    return models.Llama(
        models.LlamaConfig(n_layer=2, n_head=4, n_embd=32, block_size=SEQ, vocab_size=64, dropout=dropout)
    )


def _batch():
    g = torch.Generator().manual_seed(1)
    return torch.randint(0, 64, (2, SEQ), generator=g), torch.randint(0, 64, (2, SEQ), generator=g)


def _inputs(name: str):
    """Token ids and targets; for the bare block, hidden states ``[b, s, h]``."""
    if name != "block":
        return _batch()
    return (torch.randn(2, SEQ, 32, generator=torch.Generator().manual_seed(1)),)


def _train(model, step_fn, steps=STEPS, inputs=_batch):
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    torch.manual_seed(2)  # dropout's masks: the same generator state on every rank and in one process
    losses, grads = [], []
    for _ in range(steps):
        opt.zero_grad(set_to_none=True)
        out = step_fn(*inputs())
        loss = out if out.dim() == 0 else out.square().mean()  # a bare block's hidden states
        loss.backward()
        losses.append(float(loss))
        grads.append(
            {
                n: (p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad).clone()
                for n, p in model.named_parameters()
            }
        )
        opt.step()
    return losses, grads


def _worker(
    rank: int,
    name: str,
    options,
    out: str,
    sequence_parallel: bool = False,
    world: int = WORLD,
    dropout: float = 0.0,
):
    """Train the parallelized model once per entry of ``options`` (one dict, None: eager, or a list of
    them), each from a fresh model; save losses, gradients, the number of graphs and the plans."""
    with gloo_rank(rank, world, out):
        from torch.distributed.device_mesh import init_device_mesh

        import recompile_opt
        from recompile_opt.parallel.layout import find_layout
        from recompile_opt.parallel.module import distribute_parameters
        from recompile_opt.parallel.rewrite import install, local_forward

        mesh = init_device_mesh("cpu", (world,))
        for i, opts in enumerate(options if isinstance(options, list) else [options]):
            torch._dynamo.reset()
            torch._dynamo.utils.counters.clear()
            recompile_opt.reset_plans()
            model = _model(name, dropout)
            meta = [t.to("meta") for t in _inputs(name)]
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # the LM head's "kept replicated"
                layout = find_layout(
                    copy.deepcopy(model).to("meta"), meta, world, sequence_parallel=sequence_parallel
                )
            distribute_parameters(model, layout, mesh)
            install(model, layout, local_forward(layout, mesh.get_group().group_name, rank))
            step_fn = (
                model
                if opts is None
                else torch.compile(model, backend="recompile_opt", options={**opts, "compiler": "eager"})
            )
            losses, grads = _train(model, step_fn, inputs=lambda: _inputs(name))
            graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
            plans = [
                {
                    "saved": sorted(p.saved_names()),
                    "recomputed": sorted(p.recomputed_names()),
                    "saved_bytes": p.saved_bytes,
                    "sent": p.communication_bytes(),
                    "gathers": [
                        c["name"]
                        for c in p.collectives
                        if c["phase"] == "forward" and "all_gather" in c["op"]
                    ],
                    # the hidden states' gathers, [b, s, h] (the LM head's logits, [b * s, vocab], are
                    # gathered on the vocabulary)
                    "hidden_gathers": [
                        c["name"]
                        for c in p.collectives
                        if c["phase"] == "forward" and "all_gather" in c["op"] and len(c["shape"]) == 3
                    ],
                    "regathered": [c["name"] for c in p.collectives if c.get("regathered")],
                }
                for p in recompile_opt.last_plans()
            ]
            torch.save(
                {
                    "losses": losses,
                    "grads": grads,
                    "graphs": graphs,
                    "plans": plans,
                    "str_hash": hash("recompile_opt"),
                    "replicated": [m.module for m in layout.modules if m.style == "replicated"],
                },  # differs per rank: PYTHONHASHSEED unset
                os.path.join(out, f"rank{rank}_{i}.pt"),
            )
            progress(out, rank, f"results {i} saved")


def _check_equals_one_process(
    name: str, tmp_path, world: int, dropout: float = 0.0, compiled: bool = False, run: int = 0
) -> list:
    """Every rank's losses and ``full_tensor()`` gradients against one process's, step by step; a
    compiled rank's graph in one piece (no graph break at a collective) and planned as every other
    rank planned it. Returns rank 0's plans."""
    model = _model(name, dropout)
    losses, grads = _train(model, model, inputs=lambda: _inputs(name))
    first = torch.load(tmp_path / f"rank0_{run}.pt")
    for rank in range(world):
        res = torch.load(tmp_path / f"rank{rank}_{run}.pt")
        assert res["graphs"] == (1 if compiled else 0)
        assert res["plans"] == first["plans"], f"rank {rank} planned differently from rank 0"
        assert res["losses"] == pytest.approx(losses, rel=1e-5)
        for step in range(STEPS):
            for n, g in grads[step].items():
                torch.testing.assert_close(
                    res["grads"][step][n],
                    g,
                    rtol=1e-4,
                    atol=1e-5,
                    msg=lambda m: f"rank {rank}, step {step}, {n}: {m}",
                )
    return first["plans"]


def _cases(names, cases: dict, slow=(), elsewhere=()) -> list:
    """``pytest.param(name, *case)`` for each model and case, with id ``{name}-{case id}``; the ids in
    ``slow`` (each with a lighter case of the same path in the default run) marked slow; those in
    ``elsewhere`` (run as they are by another test) left out."""
    return [
        pytest.param(
            name, *case, id=f"{name}-{cid}", marks=pytest.mark.slow if f"{name}-{cid}" in slow else ()
        )
        for name in names
        for cid, case in cases.items()
        if f"{name}-{cid}" not in elsewhere
    ]


@pytest.mark.parametrize(
    ("name", "options"),
    _cases(
        ["gpt", "llama"],
        {
            "eager": (None,),
            "compiled-0.0": ({"memory_budget": 0.0},),
            "compiled-save-all": ({"policy": "save-all"},),
        },
        slow={"gpt-compiled-save-all", "llama-compiled-save-all"},
    ),
)  # save-all: the budgets test, TP+SP
def test_tensor_parallel_equals_one_process(name, options, tmp_path):
    run_ranks(_worker, (name, options, str(tmp_path)), str(tmp_path), WORLD)
    _check_equals_one_process(name, tmp_path, WORLD, compiled=options is not None)


@pytest.mark.parametrize(
    ("name", "options", "world"),
    _cases(
        ["gpt", "llama", "block"],
        {
            "eager": (None, 2),
            "compiled-0.0": ({"memory_budget": 0.0}, 2),
            "eager-4-ranks": (None, 4),
            "compiled-0.0-4-ranks": ({"memory_budget": 0.0}, 4),
        },
        slow={"llama-compiled-0.0-4-ranks", "block-compiled-0.0-4-ranks"},
        # the same worker at 0.0 among its budgets: test_sequence_parallel_budgets_equal_one_process[gpt-2];
        # the GPT at 0.0 on 4 ranks, at several shapes: test_parallel_shapes.py (gpt-4)
        elsewhere={"gpt-compiled-0.0", "gpt-compiled-0.0-4-ranks"},
    ),
)
def test_tensor_and_sequence_parallel_equals_one_process(name, options, world, tmp_path):
    run_ranks(_worker, (name, options, str(tmp_path), True, world), str(tmp_path), world)
    _check_equals_one_process(name, tmp_path, world, compiled=options is not None)


@pytest.mark.parametrize(
    ("name", "sequence_parallel", "options"),
    _cases(
        ["gpt", "llama"],
        {
            "tp": (False, None),
            "tp+sp": (True, None),
            "tp+sp-compiled-0.0": (True, {"memory_budget": 0.0}),
            "tp+sp-compiled-save-all": (True, {"policy": "save-all"}),
        },
        slow={"gpt-tp+sp-compiled-save-all", "llama-tp+sp-compiled-save-all", "llama-tp+sp-compiled-0.0"},
    ),
)
def test_dropout_gives_each_rank_the_single_process_mask(name, sequence_parallel, options, tmp_path):
    """Dropout 0.1 everywhere (embeddings, attention probabilities: GPT's explicit dropout, Llama's SDPA
    ``dropout_p``; residuals): each rank applies one process's mask to its rows or heads, so three
    steps equal one process's, eager and compiled (at 0.0 every mask is replayed in the backward)."""
    run_ranks(_worker, (name, options, str(tmp_path), sequence_parallel, WORLD, 0.1), str(tmp_path), WORLD)
    _check_equals_one_process(name, tmp_path, WORLD, dropout=0.1, compiled=options is not None)


BUDGETS = [
    {"policy": "save-all"},
    {"memory_budget": 1.0},
    {"memory_budget": 0.3},
    {"memory_budget": 0.0},
    {"policy": "megatron-selective"},
]


@pytest.mark.parametrize(
    ("name", "world"),
    [
        ("gpt", 2),
    ],
    ids=["gpt-2"],
)  # 4 ranks, and Llama: the TP+SP test above (eager, 0.0); Llama's dropout at 0.0 and save-all: below
def test_sequence_parallel_budgets_equal_one_process(name, world, tmp_path):
    """Tensor + sequence parallel through the planner under save-all, at memory_budget 1.0, 0.3, 0.0
    and under Megatron's selective policy: one process's losses and gradients on every rank, the same
    plan on every rank. Save-all and the selective policy keep each gathered input as the rank's shard
    and gather it again in the backward (Megatron's layout); the budgets keep no more than save-all
    (1.0 is its bytes), and a lower budget never keeps more."""
    # spawned: each rank hashes strings its own way (forked ranks share one seed)
    run_ranks(
        _worker, (name, BUDGETS, str(tmp_path), True, world), str(tmp_path), world, start_method="spawn"
    )
    if "PYTHONHASHSEED" not in os.environ:  # each rank hashed strings its own way, and still planned alike
        assert len({torch.load(tmp_path / f"rank{r}_0.pt")["str_hash"] for r in range(world)}) == world
    plans = [
        _check_equals_one_process(name, tmp_path, world, compiled=True, run=i)[0] for i in range(len(BUDGETS))
    ]
    save_all, one, point_three, zero, selective = plans
    for plan in (save_all, selective):
        # every gathered hidden state kept as the rank's shard (the logits' gather feeds only the loss's
        # log-softmax, whose output the backward reads instead)
        assert plan["hidden_gathers"] and plan["regathered"] == plan["hidden_gathers"]
    assert save_all["saved_bytes"] >= one["saved_bytes"] >= point_three["saved_bytes"] >= zero["saved_bytes"]
    # every re-gather sends its bytes a second time
    assert save_all["sent"] > one["sent"] or one["regathered"] == save_all["regathered"]


def test_complex_rotary_embeddings_are_sharded_by_heads_and_equal_one_process(tmp_path):
    """Between the attention's linears, the rotary embedding of Meta's reference Llama and torchtitan
    (``view_as_complex``, a complex product, ``view_as_real``) keeps each rank's heads apart: the
    attention is sharded by heads (torchtitan's Llama was kept replicated before), and TP + SP at 0.0
    equals one process."""
    run_ranks(_worker, ("llama-complex", {"memory_budget": 0.0}, str(tmp_path), True), str(tmp_path), WORLD)
    _check_equals_one_process("llama-complex", tmp_path, WORLD, compiled=True)
    assert torch.load(tmp_path / "rank0_0.pt")["replicated"] == []


def _diverging_worker(rank: int, out: str):
    """Each rank compiles the bare block with its own budget (a user error): planned differently."""
    with gloo_rank(rank, WORLD, out):
        from torch.distributed.device_mesh import init_device_mesh

        import recompile_opt

        model = recompile_opt.parallelize(
            _model("block"), init_device_mesh("cpu", (WORLD,)), _inputs("block")
        )
        step = torch.compile(
            model, backend="recompile_opt", options={"compiler": "eager", "memory_budget": [1.0, 0.0][rank]}
        )
        try:
            step(*_inputs("block"))
            message = None
        except Exception as e:  # Dynamo wraps the backend's error
            message = str(e)
        torch.save(message, os.path.join(out, f"rank{rank}.pt"))


def test_ranks_that_plan_differently_fail_at_compile_time_instead_of_hanging(tmp_path):
    run_ranks(_diverging_worker, (str(tmp_path),), str(tmp_path), WORLD)
    for rank in range(WORLD):
        message = torch.load(tmp_path / f"rank{rank}.pt")
        assert message is not None and "planned graph" in message and "differently" in message, message
