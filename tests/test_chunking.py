"""Mini-sequence chunking of the LM head + loss (recompile_opt.passes.chunking, issue 23 part 1):
the region found in Dynamo's graph, rewritten into k serial chunks whose loss and gradients equal the
unchunked model's, refused with a reason where it does not apply, and through Inductor a lower
measured peak with the predicted one on it."""

from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.nn.functional as F
from helpers import tiny_gpt, tiny_llama, train_side_by_side
from recompile_opt.passes.chunking import chunk_loss, chunked_linear_cross_entropy, find_loss_regions

import recompile_opt
from recompile_opt import models
from recompile_opt.compile_paths import compile_eager
from recompile_opt.options import parse_options
from recompile_opt.partitioner import RecompilePartitioner

EAGER = {"compiler": "eager"}


def _dynamo_graph(model, inputs):
    graphs = []

    def grab(gm, example_inputs):
        graphs.append((gm, example_inputs))
        return gm.forward

    torch.compile(model, backend=grab)(*inputs)
    return graphs[0]


def _run(gm, example_inputs):
    """Loss and the gradients of every floating-point input (the parameters among them)."""
    args = [a.detach().clone().requires_grad_(a.is_floating_point()) for a in example_inputs]
    out = gm(*args)
    loss = out[0] if isinstance(out, (tuple, list)) else out
    loss.backward()
    return loss.detach(), [a.grad for a in args if a.grad is not None]


def _assert_runs_alike(chunked, gm, example_inputs):
    """The rewritten graph's loss and gradients equal the original's."""
    (loss, grads), (got_loss, got_grads) = _run(gm, example_inputs), _run(chunked, example_inputs)
    torch.testing.assert_close(got_loss, loss, rtol=1e-6, atol=1e-6)
    for g, ref in zip(got_grads, grads, strict=True):
        torch.testing.assert_close(g, ref, rtol=1e-5, atol=1e-6)


# -- the pass on small graphs -----------------------------------------------------------------------


def test_the_benchmark_gpts_head_and_loss_are_one_region():
    gm, _ = _dynamo_graph(*tiny_gpt())
    (region,) = find_loss_regions(gm)
    assert region.why_not is None
    assert region.tokens == 2 * 16 and region.vocab == 64  # tiny_gpt: batch 2, block 16, vocabulary 64
    assert "lm_head" in str(region.linear.args[1])
    assert [n.target for n in region.chain] == ["view"]  # logits.view(-1, V)


@pytest.mark.parametrize("chunks", [2, 5, 8])  # 5 does not divide the 32 tokens: chunks of 7, 7, 6, 6, 6
def test_the_rewritten_graph_gives_the_same_loss_and_gradients(chunks):
    gm, inputs = _dynamo_graph(*tiny_gpt())
    chunked = copy.deepcopy(gm)
    chunk_loss(chunked, find_loss_regions(chunked)[0], chunks)
    targets = [n.target for n in chunked.graph.nodes if n.op == "call_function"]
    assert F.cross_entropy not in targets and targets.count(chunked_linear_cross_entropy) == 1
    _assert_runs_alike(chunked, gm, inputs)


@pytest.mark.parametrize("chunks", [3, 4])
def test_the_graphs_hold_one_chunked_op_and_no_full_length_logits(chunks):
    """After AOTAutograd the region is one op of the forward (the planner plans one node, whatever k),
    and no value of the vocabulary's width is left in either graph but the head's weight gradient."""
    model, inputs = tiny_gpt()
    partitioner = RecompilePartitioner(parse_options({"chunks": {"loss": chunks}, **EAGER}))
    torch.compile(model, backend=lambda gm, ex: compile_eager(gm, ex, partitioner))(*inputs).backward()
    vocab, width = 64, 32
    (op,) = [
        n
        for n in partitioner.last_forward.graph.nodes
        if n.target == torch.ops.recompile_opt.chunked_head_loss.default
    ]
    assert op.args[4] == chunks
    for graph in (partitioner.last_forward.graph, partitioner.last_backward.graph):
        wide = [
            n.name
            for n in graph.nodes
            if n.op == "call_function"
            and isinstance(n.meta.get("val"), torch.Tensor)
            and vocab in n.meta["val"].shape
            and tuple(n.meta["val"].shape) != (vocab, width)
        ]
        assert not wide, f"values of the vocabulary's width: {wide}"


@pytest.mark.parametrize("chunks", [4, 16])
def test_the_chunked_op_allocates_one_chunk_of_logits_besides_its_outputs(chunks):
    """The op's own memory, measured by the allocator profiler: its peak less its outputs is one chunk
    of logits (turned into their gradient in place; small per-row values aside)."""
    from recompile_opt.costs.measure import allocation_timeline

    tokens, width, vocab = 512, 16, 4096
    x, w, t = torch.randn(tokens, width), torch.randn(vocab, width), torch.randint(0, vocab, (tokens,))
    outputs = []
    live = peak = 0
    for nbytes in allocation_timeline(
        lambda: outputs.append(
            torch.ops.recompile_opt.chunked_head_loss(
                x, w, None, t, chunks, torch.float32, -100, 0.0, True, True, False
            )
        ),
        torch.device("cpu"),
    ):
        live += nbytes
        peak = max(peak, live)
    made = sum(o.untyped_storage().nbytes() for o in outputs[0])
    chunk_logits = math.ceil(tokens / chunks) * vocab * 4
    assert peak - made <= 1.1 * chunk_logits, (peak - made, chunk_logits)


@pytest.mark.parametrize("recompute", [False, True], ids=["gradients-in-forward", "head-recomputed"])
@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("label_smoothing", [0.0, 0.1])
def test_ignored_tokens_label_smoothing_and_the_sum_are_exact(reduction, label_smoothing, recompute):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 10, 8, generator=g, requires_grad=True)
    w = torch.randn(50, 8, generator=g, requires_grad=True)
    b = torch.randn(50, generator=g, requires_grad=True)
    t = torch.randint(0, 50, (3, 10), generator=g)
    t[0, :4] = -100  # HF's shifted labels end in ignore_index; here some rows of each chunk are ignored
    t[2, 7:] = -100
    kw = {"ignore_index": -100, "reduction": reduction, "label_smoothing": label_smoothing}
    ref = F.cross_entropy(F.linear(x, w, b).view(-1, 50), t.view(-1), **kw)
    ref_grads = torch.autograd.grad(ref, (x, w, b))
    got = chunked_linear_cross_entropy(x, w, b, t, chunks=4, dtype=torch.float32, recompute=recompute, **kw)
    torch.testing.assert_close(got, ref)
    for a, r in zip(torch.autograd.grad(got, (x, w, b)), ref_grads):
        torch.testing.assert_close(a, r)


def test_a_frozen_head_keeps_no_weight_gradient():
    x, w = torch.randn(6, 8, requires_grad=True), torch.randn(16, 8)
    t = torch.randint(0, 16, (6,))
    loss = chunked_linear_cross_entropy(x, w, None, t, chunks=3, dtype=torch.float32)
    kept = [n for n in loss.grad_fn.saved_tensors if n is not None]
    assert [tuple(k.shape) for k in kept] == [(6, 8)]  # the input's gradient, the mean's scale in it already
    (grad,) = torch.autograd.grad(loss, x)
    torch.testing.assert_close(grad, torch.autograd.grad(F.cross_entropy(F.linear(x, w), t), x)[0])


def test_every_token_ignored_gives_torchs_nan():
    x, w = torch.randn(4, 8, requires_grad=True), torch.randn(16, 8)
    t = torch.full((4,), -100)
    assert torch.isnan(F.cross_entropy(F.linear(x, w), t))
    assert torch.isnan(chunked_linear_cross_entropy(x, w, None, t, chunks=2, dtype=torch.float32))


class _Head(torch.nn.Module):
    def __init__(self, returns_logits=False, **loss_kw):
        super().__init__()
        self.body, self.head = torch.nn.Linear(8, 8), torch.nn.Linear(8, 32, bias=False)
        self.returns_logits, self.loss_kw = returns_logits, loss_kw

    def forward(self, x, t):
        logits = self.head(torch.relu(self.body(x)))
        loss = F.cross_entropy(logits.view(-1, 32), t.view(-1), **self.loss_kw)
        return (loss, logits) if self.returns_logits else loss


@pytest.mark.parametrize(
    "module, why",
    [
        (_Head(returns_logits=True), "also read elsewhere"),
        (_Head(weight=torch.rand(32)), "class weights"),
        (_Head(reduction="none"), "reduction 'none'"),
    ],
)
def test_a_region_that_cannot_be_chunked_is_refused_by_name(module, why):
    inputs = (torch.randn(2, 6, 8), torch.randint(0, 32, (2, 6)))
    gm, _ = _dynamo_graph(module, inputs)
    (region,) = find_loss_regions(gm)
    assert why in region.why_not
    with pytest.raises(
        recompile_opt.OptionError, match=f"option 'chunks': loss .*cannot be chunked: .*{why}"
    ):
        torch.compile(module, backend="recompile_opt", options={"chunks": {"loss": 2}, **EAGER})(*inputs)
    torch._dynamo.reset()  # without chunks, the same model compiles
    torch.compile(module, backend="recompile_opt", options={"chunks": False, **EAGER})(*inputs)


@pytest.mark.parametrize("bad", [True, {"loss": 0}, {"loss": 2.0}, {"queries": 2}, {}])
def test_bad_chunks_values_name_the_option_and_what_it_accepts(bad):
    with pytest.raises(recompile_opt.OptionError, match="option 'chunks'"):
        parse_options({"chunks": bad})


# -- end to end -------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "build, chunks, budget",
    [
        pytest.param(
            build,
            chunks,
            budget,
            id=f"{name}-{chunks}-{budget}",
            marks=[pytest.mark.slow] if (name, budget) == ("llama", 0.0) else [],
        )  # the GPT's beside it
        for name, build in (("gpt", tiny_gpt), ("llama", tiny_llama))
        for chunks, budget in ((2, None), (8, None), (5, 0.0))
    ],
)
def test_gradients_equal_eager_with_dropout_replayed(build, chunks, budget):
    """Dropout on, Inductor's fallback_random: chunking draws no random number of its own, so the
    masks are eager's; at 0.0 the least-peak plan recomputes (and replays) what it can."""
    model, inputs = build(dropout=0.1)
    with torch._inductor.config.patch(fallback_random=True):
        plan = train_side_by_side(
            model,
            inputs,
            options={"chunks": {"loss": chunks}, "memory_budget": budget, **EAGER},
            rtol=1e-4,
            atol=1e-5,
        )
    assert any(n.startswith("chunk: ") and f"in {chunks} chunks" in n for n in plan.notes), plan.notes
    assert f"in {chunks} chunks" in str(plan)


@pytest.mark.parametrize("name", ["llama", "qwen2", "mistral"])
def test_hugging_face_causal_lm_losses_chunk_with_their_shifted_labels(name):
    """Their own loss path (labels given): logits upcast, labels shifted and padded with ignore_index."""
    pytest.importorskip("transformers")
    from test_hf_models import build

    model, inputs = build(name)
    plan = train_side_by_side(model, inputs, options={"chunks": {"loss": 3}, **EAGER}, rtol=1e-4, atol=1e-5)
    assert any("in 3 chunks" in n for n in plan.notes), plan.notes


def test_a_graph_break_between_head_and_loss_is_named():
    """Hugging Face GPT-2 breaks the graph before its loss (tests/test_hf_models.py): the loss's graph
    gets the logits as an input, so there is no head to chunk with it; the error says so and how
    Hugging Face's break goes away."""
    pytest.importorskip("transformers")
    from test_hf_models import build

    model, inputs = build("gpt2")
    with pytest.raises(
        recompile_opt.OptionError, match="a graph break lies between the head and the loss.*loss_type"
    ):
        torch.compile(model, backend="recompile_opt", options={"chunks": {"loss": 3}, **EAGER})(*inputs)


@pytest.mark.parametrize("chunks", [2, 3, 8])  # 3 does not divide the 2 x 16 tokens
def test_hugging_face_gpt2_chunks_its_loss_and_conv1d_mlps_with_dropout(chunks):
    """GPT-2 in one graph (``loss_type`` set, its own shifted-label loss), dropout on, replayed: the loss
    and both ``Conv1D`` MLPs (``addmm`` of a ``[in, out]`` weight, tanh GELU) chunked, gradients eager's."""
    pytest.importorskip("transformers")
    from test_hf_models import build

    model, inputs = build("gpt2", dropout=0.1)
    model.model.loss_type = "ForCausalLM"
    with torch._inductor.config.patch(fallback_random=True):
        plan = train_side_by_side(
            model, inputs, options={"chunks": {"loss": chunks, "mlp": chunks}, **EAGER}, rtol=1e-4, atol=1e-5
        )
    mlps = [n for n in plan.notes if n.startswith("chunk: mlp ")]
    assert len(mlps) == 2 and all(f"1 up-projection, hidden 256) in {chunks} chunks" in n for n in mlps), (
        plan.notes
    )
    assert any(n.startswith("chunk: loss ") and f"in {chunks} chunks" in n for n in plan.notes), plan.notes


@pytest.mark.slow
def test_through_inductor_hugging_face_gpt2_chunks_with_eagers_gradients():
    """The Conv1D MLPs (their weights handed to the chunks transposed) and the loss through Inductor."""
    pytest.importorskip("transformers")
    from helpers import max_grad_diff
    from test_hf_models import build

    torch._dynamo.reset()
    model, inputs = build("gpt2")
    model.model.loss_type = "ForCausalLM"
    ref = copy.deepcopy(model)
    ref(*inputs).backward()
    step = torch.compile(
        model, backend="recompile_opt", options={"memory_budget": 0.0, "chunks": {"loss": 3, "mlp": 3}}
    )
    step(*inputs).backward()
    assert max_grad_diff(model, ref) < 1e-5
    notes = recompile_opt.last_plans()[-1].notes
    assert sum(n.startswith("chunk: mlp ") for n in notes) == 2 and any(
        n.startswith("chunk: loss ") for n in notes
    )


class _SlicedLogitsLoss(torch.nn.Module):
    """A user's causal-LM loss on the returned logits: ``logits[:, :-1]`` against ``ids[:, 1:]``."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, ids, labels):
        logits = self.model(input_ids=ids).logits
        return F.cross_entropy(logits[:, :-1, :].reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1))


def test_a_users_cross_entropy_on_sliced_logits_is_chunked():
    """The slice of the logits moves before the head (row-wise): the head runs on the kept tokens only."""
    pytest.importorskip("transformers")
    from test_hf_models import build

    model, inputs = build("gpt2")
    model = _SlicedLogitsLoss(model.model)
    gm, example_inputs = _dynamo_graph(model, inputs)
    (region,) = find_loss_regions(gm)
    assert region.why_not is None and region.tokens == 2 * 15, region.why_not
    plan = train_side_by_side(model, inputs, options={"chunks": {"loss": 4}, **EAGER}, rtol=1e-4, atol=1e-5)
    assert any(
        n.startswith("chunk: loss ") and "in 4 chunks of <= 8 of 30 tokens" in n for n in plan.notes
    ), plan.notes


def test_chunks_false_is_accepted_by_plan_and_changes_nothing():
    model, inputs = tiny_gpt()
    plain, off = (
        recompile_opt.plan(model, inputs, memory_budget="40KiB", **kw) for kw in ({}, {"chunks": False})
    )
    assert off.saved_names() == plain.saved_names() and off.saved_bytes == plain.saved_bytes
    assert not any("chunk" in n for n in off.notes)


@pytest.mark.slow
def test_through_inductor_the_chunked_loss_lowers_the_measured_peak_the_plan_predicts():
    """A vocabulary of 8192 over 256 tokens (hidden 64): the least-peak plan's measured step peak
    falls with 4 chunks, the predicted peak is the measured one within 10%, and the gradients are
    eager's."""
    from helpers import max_grad_diff

    from recompile_opt.costs.measure import peak_memory

    cfg = models.GPTConfig(n_layer=1, n_head=4, n_embd=64, block_size=128, vocab_size=8192)
    torch.manual_seed(0)
    base, inputs = models.GPT(cfg), models.example_batch(cfg, 2)
    ref = copy.deepcopy(base)
    ref(*inputs).backward()
    peaks = {}
    for chunks in (1, 4):
        torch._dynamo.reset()
        model = copy.deepcopy(base)
        step = torch.compile(
            model, backend="recompile_opt", options={"memory_budget": 0.0, "chunks": {"loss": chunks}}
        )
        step(*inputs).backward()
        assert max_grad_diff(model, ref) < 1e-5
        model.zero_grad(set_to_none=True)
        peaks[chunks] = peak_memory(lambda: step(*inputs).backward())
        plan = recompile_opt.last_plans()[-1]
        assert plan.predicted_peak_bytes == pytest.approx(peaks[chunks], rel=0.10), (chunks, plan.summary())
    assert peaks[4] < 0.8 * peaks[1], peaks


# -- the planner's choice (chunks="auto") ----------------------------------------------------------


def _logits_dominated():
    """A vocabulary of 8192 over 256 tokens of width 64: the logits are the step's largest values."""
    cfg = models.GPTConfig(n_layer=1, n_head=4, n_embd=64, block_size=128, vocab_size=8192)
    torch.manual_seed(0)
    return models.GPT(cfg), models.example_batch(cfg, 2)


def test_where_the_logits_dominate_the_least_peak_plan_chunks_by_itself():
    model, inputs = _logits_dominated()
    off = recompile_opt.plan(model, inputs, memory_budget=0.0, chunks=False)
    auto = recompile_opt.plan(model, inputs, memory_budget=0.0, chunks="auto")
    assert auto.predicted_peak_bytes <= 0.9 * off.predicted_peak_bytes, (auto.summary(), off.summary())
    (loss,) = [c for c in auto.chunks if c["kind"] == "loss"]
    # Liger's rule (vocabulary / width: 128 chunks of 2 rows) is tried below the floor of rows, and at
    # the least peak not taken where its step is too slow for its peak (issue 51): the floor's chunks are
    from recompile_opt.options import DEFAULT_ROOFLINE
    from recompile_opt.planner.chunk_choice import min_rows

    liger = [n for n in auto.notes if n.startswith(f"chunks (auto): loss in {8192 // 64} chunks: ")]
    assert len(liger) == 1, auto.notes
    if loss["chunks"] != 8192 // 64:
        assert loss["chunks"] == 256 // min_rows(4, DEFAULT_ROOFLINE["cpu"]), auto.chunks
        assert liger[0].endswith("its step is too slow for its peak (chunk_choice.STEP_SLACK)"), liger
    assert loss["peak_saved_bytes"] > 0.1 * off.predicted_peak_bytes
    assert "chunked" in str(auto) and "chosen by the planner" in str(auto)
    assert any(n.startswith("chunks (auto): loss in ") and n.endswith("taken") for n in auto.notes), (
        auto.notes
    )
    tried = [n for n in auto.notes if n.startswith("chunks (auto): loss in ") and "est. step" in n]
    assert tried and all(", planned in " in n for n in tried), tried  # each trial's planning time
    # the plan's planning line counts the trials' planning too (the unchunked plan and the loss's trial;
    # their simulations and walks are those not found on disk already, so may be none here)
    choice = auto.solver["chunk_choice"]
    assert choice["plannings"] >= 2, choice
    assert (
        f"choosing chunks: {choice['plannings']} plannings, {choice['simulations']} plans simulated"
        in str(auto)
    )
    assert "chunk_choice" not in off.solver
    assert "chunks" in off.diff(auto) and not off.chunks
    assert recompile_opt.Plan.from_json(auto.to_json()).chunks == auto.chunks
    assert not any("loss_recompute" in n for n in auto.notes)  # nothing runs after this loss


def test_a_region_is_planned_chunked_only_where_its_full_length_tensors_are_alive_at_the_peak():
    """A candidate is planned only where a tensor of ``tokens x width`` elements with the region's width
    among its dims is alive at the best plan's peak: elsewhere chunking cannot lower that peak, and
    each try plans the graph again. (A kind passed over is tried once more with a trial not taken:
    ``test_a_kind_passed_over_is_tried_with_a_trial_not_taken``.)"""
    from types import SimpleNamespace

    from recompile_opt.planner import chunk_choice
    from recompile_opt.planner.chunk_choice import Candidate

    loss, mlp = Candidate("loss", 4, tokens=512, width=8192), Candidate("mlp", 4, tokens=512, width=1024)
    plan = {}
    for where, shapes in (
        ("loss", [[512, 8192], [2, 4, 256, 256]]),
        ("attention", [[2, 4, 256, 256], [512, 64]]),
    ):
        plan[where] = SimpleNamespace(
            peak_breakdown={"shapes": shapes},
            predicted_peak_bytes=100,
            chunks=[],
            step_s=1.0,
            recompute_s=0.0,
            solver={},
        )
    assert loss.alive_at_peak(plan["loss"]) and not mlp.alive_at_peak(plan["loss"])
    assert not loss.alive_at_peak(plan["attention"])
    assert mlp.alive_at_peak(SimpleNamespace(peak_breakdown={"shapes": [[2, 256, 1024]]}))  # [b, s, hidden]
    assert not mlp.alive_at_peak(
        SimpleNamespace(peak_breakdown={"shapes": [[256, 1024]]})
    )  # a weight: fewer rows
    # attention's scores where the sequence equals the width: not the region's
    assert not mlp.alive_at_peak(SimpleNamespace(peak_breakdown={"shapes": [[2, 16, 1024, 1024]]}))
    assert loss.alive_at_peak(SimpleNamespace(peak_breakdown={}))  # not known: planned
    for where, tried in (("attention", [{}]), ("loss", [{}, {"loss": 4}, {"loss": 4, "mlp": 4}])):
        planned = []

        def plan_with(chunks):
            planned.append(chunks)
            return plan[where]

        taken, _, _, notes = chunk_choice.choose([loss, mlp], plan_with, None)
        assert (taken, planned) == ({}, tried), where
    assert notes[0].startswith("chunks (auto): loss in 4 chunks: ") and notes[0].endswith("not taken"), notes
    assert notes[1].startswith("chunks (auto): loss in 4 + mlp in 4 chunks: "), notes
    planned = []
    chunk_choice.choose([loss, mlp], lambda chunks: planned.append(chunks) or plan["attention"], None)
    assert planned == [{}]  # nothing tried, so nothing to try with
    notes = chunk_choice.choose([loss, mlp], lambda chunks: plan["attention"], None)[3]
    assert notes == [
        "chunks (auto): loss, mlp not tried: none of their full-length tensors is alive at the peak"
    ]


def test_a_kind_passed_over_is_tried_with_a_trial_not_taken():
    """Chunking one region moves the peak to another, so neither alone may lower it (the GPT with
    vocabulary 2048: its MLPs chunked, the peak moved to the logits' gradient; with the loss chunked
    too, 3.8 MiB lower). The kind passed over is tried with the chunks of the trial not taken, and
    taken where that peaks lower."""
    from types import SimpleNamespace

    from recompile_opt.planner import chunk_choice
    from recompile_opt.planner.chunk_choice import Candidate

    loss, mlp = Candidate("loss", 4, tokens=512, width=8192), Candidate("mlp", 4, tokens=512, width=1024)
    at_mlp = [[512, 1024]]
    peaks = {(): (100, at_mlp), (("mlp", 4),): (101, at_mlp), (("loss", 4), ("mlp", 4)): (80, at_mlp)}
    planned = []

    def plan_with(chunks):
        planned.append(chunks)
        peak, shapes = peaks[tuple(sorted(chunks.items()))]
        return SimpleNamespace(
            peak_breakdown={"shapes": shapes},
            predicted_peak_bytes=peak,
            chunks=list(chunks),
            step_s=1.0,
            recompute_s=0.0,
            solver={},
        )

    taken, unchunked, best, notes = chunk_choice.choose([loss, mlp], plan_with, None)
    assert planned == [{}, {"mlp": 4}, {"mlp": 4, "loss": 4}]
    assert (
        taken == {"mlp": 4, "loss": 4}
        and best.predicted_peak_bytes == 80
        and unchunked.predicted_peak_bytes == 100
    )
    assert notes[-1].startswith("chunks (auto): mlp in 4 + loss in 4 chunks: ") and notes[-1].endswith(
        ": taken"
    )
    assert not loss.alive_at_peak(
        plan_with({"mlp": 4})
    )  # tried though the kernel model's peak does not show it


def test_a_plan_recomputing_at_its_peak_probes_the_first_kind_at_the_least_peak_or_a_missed_limit():
    """Without Inductor's pool the GPT with vocabulary 2048 peaks unchunked in an attention backward, 7
    of its 26.32 MiB recomputed and no loss or MLP tensor alive; chunked (loss and MLPs) it keeps more
    and walks at 23.31. Where recomputed values hold :data:`GAIN` of the walked peak, the least-peak
    choice tries its first kind anyway and the kinds passed over with it, and so does a limit the
    unchunked plan misses (a Hugging Face Qwen3-MoE: 1.93 MiB unchunked, 1.64 with its loss chunked,
    and a limit of 1.72 was said to be below the least peak); not under a limit it meets, and not
    where nothing is recomputed there."""
    from types import SimpleNamespace

    from recompile_opt.planner import chunk_choice
    from recompile_opt.planner.chunk_choice import GAIN, Candidate

    loss, mlp = Candidate("loss", 4, tokens=512, width=8192), Candidate("mlp", 4, tokens=512, width=1024)
    at_attention = [[2, 4, 256, 256]]
    peaks = {(): 100, (("loss", 4),): 99, (("loss", 4), ("mlp", 4)): 80}

    def plan_with(recomputed):
        def plan(chunks):
            planned.append(chunks)
            peak = peaks[tuple(sorted(chunks.items()))]
            walked = {
                "total": peak,
                "bytes": {"recomputed": recomputed * peak, "kept": (1 - recomputed) * peak},
            }
            return SimpleNamespace(
                peak_breakdown={"shapes": at_attention},
                walked_breakdown=walked,
                predicted_peak_bytes=peak,
                chunks=list(chunks),
                step_s=1.0,
                recompute_s=0.0,
                solver={},
            )

        return plan

    planned = []
    unchunked = plan_with(0.27)({})
    assert chunk_choice.recomputes_at_peak(unchunked) and not loss.alive_at_peak(unchunked)
    assert chunk_choice.worth_trying([loss, mlp], unchunked, 100, None) is None
    planned.clear()
    taken, _, best, notes = chunk_choice.choose([loss, mlp], plan_with(0.27), None)
    assert planned == [{}, {"loss": 4}, {"loss": 4, "mlp": 4}]
    assert taken == {"loss": 4, "mlp": 4} and best.predicted_peak_bytes == 80, notes
    planned.clear()  # a limit the unchunked plan misses
    assert chunk_choice.worth_trying([loss, mlp], unchunked, 100, 90) is None
    taken, _, best, notes = chunk_choice.choose([loss, mlp], plan_with(0.27), 90)
    assert planned == [{}, {"loss": 4}, {"loss": 4, "mlp": 4}], notes
    assert taken == {"loss": 4, "mlp": 4} and best.predicted_peak_bytes == 80, notes
    for recomputed, limit in ((GAIN / 2, None), (0.27, 100)):
        planned.clear()
        plan = plan_with(recomputed)({})
        assert chunk_choice.worth_trying([loss, mlp], plan, 100, limit) is not None
        planned.clear()
        assert chunk_choice.choose([loss, mlp], plan_with(recomputed), limit)[0] == {}
        assert planned == [{}]


def test_at_the_least_peak_a_similar_peak_is_not_bought_with_a_far_slower_step():
    """Issue 51: on an H200 the chunked least-peak plan stepped 5.8x slower than the unchunked one. A
    trial whose peak is the fraction g lower may take at most max(STEP_SLACK, g) more estimated time;
    under ``peak_memory`` fitting comes first, whatever the time."""
    from types import SimpleNamespace

    from recompile_opt.planner import chunk_choice
    from recompile_opt.planner.chunk_choice import STEP_SLACK, Candidate

    loss = Candidate("loss", 4, tokens=512, width=8192)

    def plan(peak, step):
        return SimpleNamespace(
            peak_breakdown={"shapes": [[512, 8192]]},
            predicted_peak_bytes=peak,
            chunks=[],
            step_s=step,
            recompute_s=0.0,
            solver={},
        )

    for peak, step, taken in (
        (90, 1.0 + STEP_SLACK * 0.99, True),
        (90, 1.0 + STEP_SLACK * 1.01, False),
        (60, 1.39, True),
        (60, 1.41, False),
        (60, 5.8, False),
    ):
        result = chunk_choice.choose(
            [loss], lambda chunks: plan(peak, step) if chunks else plan(100, 1.0), None
        )
        assert (result[0] == {"loss": 4}) == taken, (peak, step, result[3])
        assert taken or result[3][0].endswith("its step is too slow for its peak (chunk_choice.STEP_SLACK)")
    fits = chunk_choice.choose([loss], lambda chunks: plan(60, 5.8) if chunks else plan(100, 1.0), 70)
    assert fits[0] == {"loss": 4}  # a limit met only chunked: taken, slow or not


def test_at_the_least_peak_attention_tries_its_finest_chunks_first_and_coarser_only_where_refused():
    """Each try is a planning: attention in its most chunks (MAX_CHUNKS) is planned first, then Liger's k
    (both below the floor of rows), then the floor's k, each only where the finer one is not taken (here:
    a step too slow for its peak). Under a peak limit the floor's k comes first (the fewest chunks that
    meet it), then the most chunks, then Liger's k."""
    from types import SimpleNamespace

    from recompile_opt.planner import chunk_choice
    from recompile_opt.planner.chunk_choice import Candidate

    floor = Candidate("attention", 2, tokens=2048, width=256)
    liger = Candidate("attention", 4, below_floor=True, tokens=2048, width=256)
    finest = Candidate("attention", 8, below_floor=True, finest=True, tokens=2048, width=256)

    def planner(slow):
        asked = []

        def plan_with(chunks):
            asked.append(chunks)
            k = chunks.get("attention", 1)
            peak, step = {1: (100, 1.0), 2: (85, 1.05), 4: (75, 1.1), 8: (70, 1.2)}[k]
            shapes = [[2, 4, 256, 256]] if k == 1 else []
            return SimpleNamespace(
                peak_breakdown={"shapes": shapes},
                predicted_peak_bytes=peak,
                chunks=[1] * (k > 1),
                step_s=3.0 if k in slow else step,
                recompute_s=0.0,
                solver={},
            )

        return plan_with, asked

    plan_with, asked = planner(slow=())
    taken, _, best, notes = chunk_choice.choose([floor, liger, finest], plan_with, None)
    assert (taken, asked) == ({"attention": 8}, [{}, {"attention": 8}]), notes
    assert notes[-1].endswith("not tried: 8 chunks (finer) were taken"), notes
    plan_with, asked = planner(slow=(8,))
    taken, _, best, notes = chunk_choice.choose([floor, liger, finest], plan_with, None)
    assert (taken, asked) == ({"attention": 4}, [{}, {"attention": 8}, {"attention": 4}]), notes
    plan_with, asked = planner(slow=(8, 4))
    taken, _, best, notes = chunk_choice.choose([floor, liger, finest], plan_with, None)
    assert taken == {"attention": 2} and asked[-1] == {"attention": 2}, notes
    plan_with, asked = planner(slow=())
    taken, *_ = chunk_choice.choose([floor, liger, finest], plan_with, 90)
    assert (taken, asked) == ({"attention": 2}, [{}, {"attention": 2}])
    # a limit the floor's k misses: its most chunks next, Liger's k not planned once they meet it (it
    # was planned first: a planning more, and under the GPT's least peak 51 s of it)
    plan_with, asked = planner(slow=())
    taken, _, best, notes = chunk_choice.choose([floor, liger, finest], plan_with, 72)
    assert (taken, asked) == ({"attention": 8}, [{}, {"attention": 2}, {"attention": 8}]), notes
    # the most chunks refused (too slow for a limit still missed): Liger's k is tried after them
    plan_with, asked = planner(slow=(8,))
    taken, *_ = chunk_choice.choose([floor, liger, finest], plan_with, 60)
    assert asked == [{}, {"attention": 2}, {"attention": 8}, {"attention": 4}] and taken == {"attention": 4}
    # the most chunks taken but the limit still missed: Liger's k is tried too (a peak need not fall
    # with every chunk more)
    plan_with, asked = planner(slow=())
    taken, *_ = chunk_choice.choose([floor, liger, finest], plan_with, 65)
    assert asked == [{}, {"attention": 2}, {"attention": 8}, {"attention": 4}] and taken == {"attention": 8}


def test_attention_offers_its_most_chunks_beside_ligers_k_and_the_mlp_does_not():
    """Beside Liger's k and the floor's, attention (``FINEST``) offers ``MAX_CHUNKS``, below the floor
    as its Liger's k is; the MLP keeps to its floor's and Liger's k."""
    from types import SimpleNamespace

    from recompile_opt.planner import chunk_choice
    from recompile_opt.planner.chunk_choice import MAX_CHUNKS

    roofline = parse_options({}).roofline_for("cpu")
    floor = chunk_choice.min_rows(4, roofline)
    attention = SimpleNamespace(
        why_not=None, keys=2 * floor, head_dim=64, queries=2 * floor, tokens=8 * floor, itemsize=4
    )
    mlp = SimpleNamespace(why_not=None, hidden=1024, width=256, tokens=8 * floor, itemsize=4)
    out = chunk_choice.candidates([], [mlp], roofline, attention_regions=[attention])
    assert [(c.kind, c.chunks, c.below_floor, c.finest) for c in out] == [
        ("mlp", 4, False, False),
        ("attention", 2, False, False),
        ("attention", 4, True, False),
        ("attention", MAX_CHUNKS["attention"], True, True),
    ]


def test_chunks_are_worth_trying_where_a_kind_at_the_floor_is_alive_at_the_peak_or_a_limit_is_missed():
    """The lazy test of ``"auto"`` (the default) on the compile's own unchunked plan."""
    from types import SimpleNamespace

    from recompile_opt.planner.chunk_choice import Candidate, for_goal, worth_trying

    loss, mlp = Candidate("loss", 4, tokens=512, width=8192), Candidate("mlp", 4, tokens=512, width=1024)
    small = Candidate("loss", 64, below_floor=True, tokens=128, width=8192)
    at_loss, at_attention = (
        SimpleNamespace(peak_breakdown={"shapes": shapes}, step_s=1.0, recompute_s=0.01)
        for shapes in ([[512, 8192]], [[2, 4, 256, 256]])
    )
    assert worth_trying([loss, mlp], at_loss, 100, None) is None
    assert worth_trying([loss, mlp], at_attention, 100, None) == (
        "chunks (auto): loss, mlp not tried: none of their full-length tensors is alive at the peak"
    )
    # a region shorter than two chunks of the floor's rows: not tried at the least peak, only under a limit
    assert for_goal([small], None) == [] and for_goal([small], 100) == [small]
    finer = Candidate("loss", 128, below_floor=True, tokens=512, width=8192)
    assert for_goal([loss, mlp, finer], None) == [loss, mlp, finer]  # after chunks at the floor
    assert worth_trying([small], at_attention, 101, 100) is None  # a missed limit: tried, whatever is alive
    # a limit met: tried only where the plan recomputes at least GAIN of its step and a kind is alive at
    # its peak (chunks then leave room to keep what it recomputes)
    assert worth_trying([loss], at_loss, 100, 100) == (
        "chunks (auto): not tried: the unchunked plan meets peak_memory, recomputing 1.0% of its est. step"
    )
    at_loss.recompute_s = at_attention.recompute_s = 0.1
    assert worth_trying([loss], at_loss, 100, 100) is None
    assert worth_trying([small], at_loss, 100, 100).endswith("tried only to meet a limit")
    assert worth_trying([loss, mlp], at_attention, 100, 100) == (
        "chunks (auto): not tried: the unchunked plan meets peak_memory, and none of the full-length "
        "tensors of loss, mlp is alive at its peak"
    )


def test_the_least_peak_says_which_kinds_it_passes_over_for_their_rows():
    """A kind whose regions are too short for two chunks of the floor's rows is not tried at the least
    peak (:func:`for_goal`); the plan says so, since forced chunks or a limit may still lower its peak
    (tests/test_hf_models.py's DeBERTa-v2: 581.00 KiB at 0.0, 516.25 with its MLPs in 2 chunks)."""
    from recompile_opt.planner.chunk_choice import Candidate, below_floor_note, for_goal

    loss = Candidate("loss", 4, tokens=512, width=8192, rows=512)
    short_mlp = Candidate("mlp", 2, below_floor=True, tokens=32, width=128, rows=32)
    note = below_floor_note([loss, short_mlp], for_goal([loss, short_mlp], None))
    assert note.startswith("chunks (auto): mlp (32 rows) not tried at the least peak: too short"), note
    assert below_floor_note([loss], for_goal([loss], None)) is None
    assert below_floor_note([loss, short_mlp], for_goal([loss, short_mlp], 100)) is None  # a limit tries it
    # the tiny GPT's 2 x 16 tokens: every kind is passed over, and its least-peak plan says so
    plan = recompile_opt.plan(*tiny_gpt(), memory_budget=0.0, compiler="eager")
    said = [n for n in plan.notes if n.startswith("chunks (auto): ")]
    assert len(said) == 1 and said[0].startswith("chunks (auto): loss (32 rows), mlp (32 rows)"), said
    assert not plan.chunks


def test_by_default_a_graph_whose_peak_holds_no_regions_tensors_is_planned_once(monkeypatch):
    """``chunks="auto"`` is the default and lazy: 16 heads over 2 x 128 tokens of width 64 and a
    vocabulary of 128 peak in attention, whose 128 queries are fewer than two chunks of the floor's
    rows (not tried at the least peak), so the compile plans its graph once and says why nothing was
    tried; a logits-dominated GPT is chunked by the same default (and planned more than once)."""
    from recompile_opt import planning

    calls = []
    real = planning.make_plan
    monkeypatch.setattr(planning, "make_plan", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    cfg = models.GPTConfig(n_layer=1, n_head=16, n_embd=64, block_size=128, vocab_size=128)
    torch.manual_seed(0)
    plan = train_side_by_side(
        models.GPT(cfg), models.example_batch(cfg, 2), options={"memory_budget": 0.0, **EAGER}, steps=1
    )
    assert len(calls) == 1 and not plan.chunks
    assert (
        "chunks (auto): loss, mlp not tried: none of their full-length tensors is alive at the peak"
        in plan.notes
    )
    calls.clear()
    torch._dynamo.reset()  # another shape of GPT.forward's inputs would be compiled symbolic (no "auto")
    plan = train_side_by_side(*_logits_dominated(), options={"memory_budget": 0.0, **EAGER}, steps=1)
    assert len(calls) > 1 and any(c["kind"] == "loss" for c in plan.chunks), plan.summary()
    # the plan handed over was made on a copy of the graph: its parameters are still no kept bytes
    assert not [e.name for e in plan.saved if e.op == "input" and e.bytes and e.dtype.startswith("float")]


def test_a_copy_of_a_dynamo_graph_keeps_what_tells_aotautograd_its_parameters():
    from recompile_opt import _torch_internals as ti

    gm, _ = _dynamo_graph(*_logits_dominated())
    copied = ti.copy_dynamo_graph(gm)
    assert copied._param_name_to_source == gm._param_name_to_source
    sources = [
        [getattr(n, "_dynamo_source", None) for n in g.graph.find_nodes(op="placeholder")]
        for g in (gm, copied)
    ]
    assert sources[0] == sources[1] and None not in sources[0]


def test_chunks_keep_a_floor_of_rows_and_go_below_it_after_every_kind_at_it():
    """Chunks of few rows are memory-bound (each passes over the weights): the first candidate of a
    kind keeps every chunk at least ``min_rows`` rows; Liger's k, below that floor, comes after every
    kind's first candidate."""
    from types import SimpleNamespace

    from recompile_opt.planner import chunk_choice
    from recompile_opt.planner.chunk_choice import Candidate

    roofline = parse_options({}).roofline_for("cpu")
    floor = chunk_choice.min_rows(4, roofline)
    loss = SimpleNamespace(why_not=None, vocab=32000, width=256, tokens=4 * floor, itemsize=4, last=True)
    mlp = SimpleNamespace(why_not=None, hidden=1024, width=256, tokens=4 * floor, itemsize=4)
    assert chunk_choice.candidates([loss], [mlp], roofline) == [
        Candidate("loss", 4, tokens=loss.tokens, width=32000),
        Candidate("mlp", 4, tokens=mlp.tokens, width=1024),
        Candidate("loss", 128, below_floor=True, tokens=loss.tokens, width=32000),
    ]
    assert chunk_choice.min_rows(2, roofline) == floor // 2  # bf16: half the bytes per pass
    few = SimpleNamespace(why_not=None, vocab=32000, width=256, tokens=floor, itemsize=4, last=True)
    assert chunk_choice.candidates([few], [], roofline) == [
        Candidate("loss", 128, below_floor=True, tokens=floor, width=32000)
    ]


def test_under_a_peak_limit_the_fewest_chunks_that_meet_it_are_taken():
    """Where the loss in 2 chunks meets the limit, the planner stops there: 128 chunks would peak
    lower, but their passes over the head's weight make the step longer (the op's k-aware cost)."""
    model, inputs = _logits_dominated()
    off, two, many = (
        recompile_opt.plan(model, inputs, memory_budget=0.0, chunks=c)
        for c in (False, {"loss": 2}, {"loss": 128})
    )
    assert many.predicted_peak_bytes < two.predicted_peak_bytes < off.predicted_peak_bytes
    assert many.step_s > 2 * two.step_s, (many.step_s, two.step_s)
    limit = (two.predicted_peak_bytes + off.predicted_peak_bytes) // 2
    auto = recompile_opt.plan(model, inputs, peak_memory=limit, chunks="auto")
    assert [(c["kind"], c["chunks"]) for c in auto.chunks] == [("loss", 2)], auto.notes
    assert auto.predicted_peak_bytes <= limit


def _deep_logits_dominated():
    """:func:`_logits_dominated` 4 layers deep: more to recompute under a limit near its least peak."""
    cfg = models.GPTConfig(n_layer=4, n_head=4, n_embd=64, block_size=128, vocab_size=8192)
    torch.manual_seed(0)
    return models.GPT(cfg), models.example_batch(cfg, 2)


def _limit_the_unchunked_plan_meets_by_recomputing(model, inputs) -> tuple[int, object]:
    """A limit 5% of the way from the unchunked least peak to save-all's, and the unchunked plan under
    it, which meets it by recomputing (the limit binds). Why 5% of the way and 4 layers: with the
    softmax kept over the logits in place (as Inductor writes it), the 1-layer model's least-peak plan
    recomputes under 5% of its step, and no limit above it binds harder."""
    least, save_all = (recompile_opt.plan(model, inputs, memory_budget=f, chunks=False) for f in (0.0, 1.0))
    limit = int(
        least.predicted_peak_bytes + 0.05 * (save_all.predicted_peak_bytes - least.predicted_peak_bytes)
    )
    unchunked = recompile_opt.plan(model, inputs, peak_memory=limit, chunks=False)
    assert unchunked.predicted_peak_bytes <= limit
    assert unchunked.recompute_s >= 0.1 * (unchunked.step_s + unchunked.recompute_s), unchunked.summary()
    return limit, unchunked


def test_under_a_limit_the_unchunked_plan_meets_chunks_that_cut_its_recompute_are_taken():
    """``peak_memory`` asks for the least recompute that fits: where the unchunked plan meets the limit by
    recomputing and the logits are alive at its peak, the loss in chunks leaves room to keep what it
    recomputed (before: "not tried: the unchunked plan meets peak_memory"; the GPU check's GPT planned
    on meta under the full policy's peak went from 51.6 to 39.0 ms, est.)."""
    model, inputs = _deep_logits_dominated()
    limit, unchunked = _limit_the_unchunked_plan_meets_by_recomputing(model, inputs)
    auto = recompile_opt.plan(model, inputs, peak_memory=limit)
    assert any(c["kind"] == "loss" for c in auto.chunks), auto.notes
    assert auto.predicted_peak_bytes <= limit
    est = lambda p: p.step_s + p.recompute_s  # noqa: E731
    assert est(auto) < est(unchunked) and auto.recompute_s < unchunked.recompute_s, (
        auto.notes,
        unchunked.notes,
    )
    assert any(n.startswith("chunks (auto): loss in ") and n.endswith(": taken") for n in auto.notes)


def test_under_a_limit_the_unchunked_plan_meets_recomputing_little_nothing_is_tried():
    model, inputs = _logits_dominated()
    save_all = recompile_opt.plan(model, inputs, memory_budget=1.0, chunks=False)
    plan = recompile_opt.plan(model, inputs, peak_memory=save_all.predicted_peak_bytes)
    assert not plan.chunks
    assert any(
        n.startswith("chunks (auto): not tried: the unchunked plan meets peak_memory, recomputing ")
        for n in plan.notes
    ), plan.notes


def test_under_a_met_limit_what_the_unchunked_plan_must_say_is_said_and_nothing_is_tried():
    """A byte budget below the least beside a limit the plan meets (by recomputing everything): the
    byte budget's error under ``strict`` and its warning reach the user, and no chunks are tried. Why:
    the unchunked plan is made with its warnings held back, and a chunk choice hands the plan it takes
    back without planning again, so what was held would never have been said."""
    model, inputs = _logits_dominated()
    with pytest.warns(UserWarning, match="below the least"):  # the limit: that least plan's own peak
        least = recompile_opt.plan(model, inputs, memory_budget=300, chunks=False)
    limit = least.predicted_peak_bytes
    with pytest.raises(recompile_opt.InfeasibleBudget, match="memory_budget=300 B is below the least"):
        recompile_opt.plan(model, inputs, memory_budget=300, peak_memory=limit, strict=True)
    with pytest.warns(UserWarning, match="memory_budget=300 B is below the least"):
        plan = recompile_opt.plan(model, inputs, memory_budget=300, peak_memory=limit)
    assert plan.predicted_peak_bytes <= limit and not plan.chunks
    assert (
        "chunks (auto): not tried: the unchunked plan meets peak_memory, with a warning of its own"
        in plan.notes
    )


def test_a_byte_budget_below_the_least_is_said_where_chunks_meet_the_limit():
    """A byte budget below the least beside a limit the unchunked plan misses: chunks are tried, and the
    chunked plan that meets the limit still reports the byte budget (its error under ``strict``, else its
    warning). Before, the trials' warnings were ignored and the plan taken as it was: neither reached
    the user."""
    model, inputs = _logits_dominated()
    limit = recompile_opt.plan(model, inputs, memory_budget=1.0, chunks=False).predicted_peak_bytes
    with pytest.raises(recompile_opt.InfeasibleBudget, match="memory_budget=300 B is below the least"):
        recompile_opt.plan(model, inputs, memory_budget=300, peak_memory=limit, strict=True)
    with pytest.warns(UserWarning, match="memory_budget=300 B is below the least"):
        plan = recompile_opt.plan(model, inputs, memory_budget=300, peak_memory=limit)
    assert plan.chunks and plan.predicted_peak_bytes <= limit, plan.notes


@pytest.mark.slow
def test_through_inductor_chunks_taken_under_a_met_limit_hold_it_on_the_measured_step():
    """The product's path for the choice above: compiled by Inductor under the limit, the loss chunked,
    gradients equal eager's and the measured step peaks at most the limit."""
    model, inputs = _deep_logits_dominated()
    limit, _ = _limit_the_unchunked_plan_meets_by_recomputing(model, inputs)
    plan, measured = train_side_by_side(
        model, inputs, options={"peak_memory": limit}, measure_peak=True, rtol=1e-4, atol=1e-5
    )
    assert any(c["kind"] == "loss" for c in plan.chunks), plan.notes
    assert plan.solver["peak_from"] == "inductor-code", plan.notes
    assert plan.predicted_peak_bytes <= limit and measured <= limit, (measured, limit, plan.summary())


class _LossThenStatistic(torch.nn.Module):
    """The forward goes on after the loss: a statistic of the (detached) hidden states with a
    ``[tokens, tokens]`` temporary, returned beside the loss."""

    def __init__(self, width=64, vocab=8192, dropout=0.0):
        super().__init__()
        self.body, self.head = torch.nn.Linear(width, width), torch.nn.Linear(width, vocab, bias=False)
        self.drop = torch.nn.Dropout(dropout)

    def forward(self, x, t):
        h = self.drop(torch.relu(self.body(x)))
        loss = F.cross_entropy(self.head(h), t)
        e = h.detach()
        return loss + 0.0 * torch.cdist(e, e).mean()


def test_where_the_forward_goes_on_after_the_loss_the_planner_costs_the_head_recomputed_too():
    """Both ways of the chunked loss are planned; recomputing the head in the backward peaks no higher
    here and its forward does a third of the work, so it is taken; its gradients are eager's."""
    torch.manual_seed(0)
    model = _LossThenStatistic()
    inputs = (torch.randn(512, 64), torch.randint(0, 8192, (512,)))
    (region,) = find_loss_regions(_dynamo_graph(model, inputs)[0])
    assert region.why_not is None and not region.last
    auto = recompile_opt.plan(model, inputs, memory_budget=0.0, chunks="auto")
    tried = [n for n in auto.notes if n.startswith("chunks (auto): ")]
    assert any(n.startswith("chunks (auto): loss in ") for n in tried), tried
    assert [c["kind"] for c in auto.chunks] == ["loss_recompute"], tried
    k = auto.chunks[0]["chunks"]
    liger = recompile_opt.plan(model, inputs, memory_budget=0.0, chunks={"loss": k})
    assert auto.predicted_peak_bytes <= liger.predicted_peak_bytes
    assert auto.step_s + auto.recompute_s < liger.step_s + liger.recompute_s
    assert auto.chunks[0]["recompute_flops"] == 2 * 512 * 64 * 8192  # the head's logits once more


@pytest.mark.parametrize("build", [tiny_gpt, _LossThenStatistic], ids=["gpt", "loss-then-statistic"])
def test_the_head_recomputed_in_the_backward_gives_eagers_gradients_with_dropout(build):
    inputs = None
    if build is _LossThenStatistic:
        torch.manual_seed(0)
        model, inputs = (
            build(width=32, vocab=256, dropout=0.1),
            (torch.randn(40, 32), torch.randint(0, 256, (40,))),
        )
    else:
        model, inputs = build(dropout=0.1)
    with torch._inductor.config.patch(fallback_random=True):
        plan = train_side_by_side(
            model,
            inputs,
            options={"chunks": {"loss_recompute": 3}, "memory_budget": 0.0, **EAGER},
            rtol=1e-4,
            atol=1e-5,
        )
    assert any(
        n.startswith("chunk: loss ") and "the head recomputed in the backward" in n for n in plan.notes
    )
    assert "1 loss_recompute region in 3 chunks" in str(plan), str(plan)


def test_the_two_ways_of_chunking_the_loss_exclude_each_other():
    with pytest.raises(recompile_opt.OptionError, match="'loss' and 'loss_recompute'"):
        parse_options({"chunks": {"loss": 4, "loss_recompute": 4}})


def test_auto_chunks_nothing_where_the_goal_is_not_memory():
    """A fraction above 0.0 trades kept bytes against recompute: no peak to lower, no chunks tried."""
    model, inputs = tiny_gpt()
    auto, off = (recompile_opt.plan(model, inputs, memory_budget=0.5, chunks=c) for c in ("auto", False))
    assert not auto.chunks and not any("chunk" in n for n in auto.notes)
    assert auto.saved_names() == off.saved_names()


@pytest.mark.parametrize("bad", ["yes", "AUTO", 4])
def test_chunks_accepts_auto_and_names_it_in_the_error(bad):
    with pytest.raises(recompile_opt.OptionError, match="'auto'"):
        parse_options({"chunks": bad})


def test_dynamic_sequence_lengths_keep_chunking_with_eagers_gradients():
    """``dynamic=True``: three sequence lengths (one of them not divisible by the chunks), the loss and
    the MLPs chunked in each graph Dynamo makes, gradients equal eager's at every length."""
    from helpers import max_grad_diff

    cfg = models.GPTConfig(n_layer=2, n_head=2, n_embd=32, block_size=32, vocab_size=64)
    torch.manual_seed(0)
    base = models.GPT(cfg)
    model = copy.deepcopy(base)
    recompile_opt.reset_plans()
    step = torch.compile(
        model, backend="recompile_opt", dynamic=True, options={"chunks": {"loss": 3, "mlp": 2}, **EAGER}
    )
    for seq in (16, 23, 32):
        g = torch.Generator().manual_seed(seq)
        idx, tgt = (torch.randint(0, 64, (2, seq), generator=g) for _ in range(2))
        ref = copy.deepcopy(base)
        ref(idx, tgt).backward()
        model.zero_grad(set_to_none=True)
        step(idx, tgt).backward()
        assert max_grad_diff(model, ref) < 1e-5, seq
    plans = recompile_opt.last_plans()
    assert plans and all(sorted(c["chunks"] for c in p.chunks) == [2, 2, 3] for p in plans)


def test_under_a_peak_limit_only_chunks_meet_auto_chunks_quietly_even_when_strict():
    """A ``peak_memory`` below the unchunked least-peak plan's: the planner chunks the loss and meets
    it; the unchunked candidate that missed it neither warns nor raises (``strict=True``)."""
    import warnings

    model, inputs = _logits_dominated()
    off = recompile_opt.plan(model, inputs, memory_budget=0.0, chunks=False)
    limit = int(0.7 * off.predicted_peak_bytes)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        auto = recompile_opt.plan(model, inputs, peak_memory=limit, strict=True, chunks="auto")
    assert auto.predicted_peak_bytes <= limit and any(c["kind"] == "loss" for c in auto.chunks), (
        auto.summary()
    )
    with pytest.raises(recompile_opt.InfeasibleBudget):
        recompile_opt.plan(model, inputs, peak_memory=limit, strict=True, chunks=False)
