"""Chunked attention (recompile_opt.passes.chunk_attention, issue 48 part 2): explicit attention and SDPA's
CPU math path found in Dynamo's graph, rewritten into query chunks recomputed in the backward, with
gradients equal to eager's with dropout on (the keep-mask drawn as eager's dropout draws it); refused
with a reason where it does not apply; chosen by the planner where the probabilities make the peak."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from helpers import tiny_gpt, tiny_llama, train_side_by_side
from recompile_opt.passes.chunk_attention import chunk_attention, chunked_attention, find_attention_regions
from test_chunking import EAGER, _dynamo_graph

from recompile_opt import models
from recompile_opt.compile_paths import compile_eager
from recompile_opt.ops import is_view_node
from recompile_opt.options import OptionError, parse_options
from recompile_opt.partitioner import RecompilePartitioner

PROBS = (2, 2, 16, 16)  # tiny_gpt / tiny_llama: batch 2, 2 heads, block 16


def _run(gm, example_inputs, seed=0):
    """Loss and the gradients of every floating-point input, the RNG seeded first (dropout)."""
    args = [a.detach().clone().requires_grad_(a.is_floating_point()) for a in example_inputs]
    torch.manual_seed(seed)
    out = gm(*args)
    loss = out[0] if isinstance(out, (tuple, list)) else out
    loss.backward()
    return loss.detach(), [a.grad for a in args if a.grad is not None]


def test_explicit_attention_and_sdpas_math_path_are_regions():
    gm, _ = _dynamo_graph(*tiny_gpt(dropout=0.1))
    explicit = find_attention_regions(gm)
    assert len(explicit) == 2 and all(r.why_not is None and r.sdpa is None for r in explicit)
    assert {(r.shape, r.dropout_p, r.head_dim) for r in explicit} == {(PROBS, 0.1, 16)}
    assert all(len(r.externals) == 1 for r in explicit)  # the causal mask
    gm, _ = _dynamo_graph(*tiny_llama(dropout=0.1))
    sdpa = find_attention_regions(gm)
    assert len(sdpa) == 2 and all(r.why_not is None and r.sdpa is not None for r in sdpa)
    assert {(r.shape, r.dropout_p) for r in sdpa} == {(PROBS, 0.1)}


def test_an_sdpa_that_runs_a_fused_kernel_is_refused_by_name():
    """Without dropout the CPU runs SDPA's flash kernel: no [b, heads, s, s] exists to chunk."""
    model, inputs = tiny_llama()
    gm, _ = _dynamo_graph(model, inputs)
    assert all("fused kernel" in r.why_not for r in find_attention_regions(gm))
    with pytest.raises(OptionError, match="option 'chunks': attention .*cannot be chunked: .*fused kernel"):
        torch.compile(model, backend="recompile_opt", options={"chunks": {"attention": 2}, **EAGER})(*inputs)


@pytest.mark.parametrize("build", [tiny_gpt, tiny_llama], ids=["gpt", "llama"])
@pytest.mark.parametrize("chunks", [2, 5])  # 5 does not divide the 16 queries
def test_the_rewritten_graph_gives_the_same_loss_and_gradients_with_dropout(build, chunks):
    gm, inputs = _dynamo_graph(*build(dropout=0.1))
    chunked = copy.deepcopy(gm)
    for region in find_attention_regions(chunked):
        chunk_attention(chunked, region, chunks)
    targets = [n.target for n in chunked.graph.nodes if n.op == "call_function"]
    assert targets.count(chunked_attention) == 2 and F.softmax not in targets
    assert F.scaled_dot_product_attention not in targets
    (loss, grads), (got_loss, got_grads) = _run(gm, inputs), _run(chunked, inputs)
    torch.testing.assert_close(got_loss, loss, rtol=1e-6, atol=1e-6)  # the same dropout masks
    for g, ref in zip(got_grads, grads, strict=True):
        torch.testing.assert_close(g, ref, rtol=1e-5, atol=1e-6)


def test_no_float_value_of_the_backward_holds_more_than_one_chunk_of_probabilities():
    """After AOTAutograd: no float value of the backward is ``[.., queries, keys]`` (each holds one
    chunk of the queries); what the plan keeps of that shape is the bool keep-mask only (4 heads of 8:
    the head dim is not the sequence's 16, so K and V are not mistaken for probabilities)."""
    cfg = models.GPTConfig(n_layer=1, n_head=4, n_embd=32, block_size=16, vocab_size=64, dropout=0.1)
    torch.manual_seed(0)
    model, inputs = models.GPT(cfg), models.example_batch(cfg, 2)
    chunks, probs = 4, (2, 4, 16, 16)
    partitioner = RecompilePartitioner(parse_options({"chunks": {"attention": chunks}, **EAGER}))
    torch.compile(model, backend=lambda gm, ex: compile_eager(gm, ex, partitioner))(*inputs).backward()
    wide = [
        n.name
        for n in partitioner.last_backward.graph.nodes
        if isinstance(n.meta.get("val"), torch.Tensor)
        and n.meta["val"].is_floating_point()
        and tuple(n.meta["val"].shape[-2:]) == probs[-2:]  # a chunk's are [.., 4, 16]
    ]
    assert not wide, f"full-length probabilities in the backward: {wide}"
    kept = [e for e in partitioner.plans[-1].saved if list(e.shape) == list(probs)]
    assert kept and all("bool" in e.dtype for e in kept), kept  # the keep-mask, 1 byte an element


def _source(node):
    """The value ``node`` views (through views, splits and their ``getitem``)."""
    while is_view_node(node):
        node = node.args[0]
    return node.name


def test_the_backward_copies_each_operand_at_most_once_not_once_per_chunk():
    """A GPT's Q, K and V are views of one fused projection that a batched matmul cannot read: each
    is copied once for all chunks. Copied per chunk, Inductor fused the k copies of one source into
    one kernel and all were alive through the loop (the demo GPT's chunked backward: 15 MiB of
    temporaries at its peak, 10 of them copies)."""
    cfg = models.GPTConfig(n_layer=1, n_head=4, n_embd=32, block_size=16, vocab_size=64, dropout=0.1)
    torch.manual_seed(0)
    model, inputs = models.GPT(cfg), models.example_batch(cfg, 2)
    partitioner = RecompilePartitioner(parse_options({"chunks": {"attention": 4}, **EAGER}))
    torch.compile(model, backend=lambda gm, ex: compile_eager(gm, ex, partitioner))(*inputs).backward()
    whole = 2 * 16 * 32  # an operand: batch x heads x tokens x head dim
    copies: dict[str, int] = {}
    for n in partitioner.last_backward.graph.nodes:
        if n.target == torch.ops.aten.clone.default and n.meta["val"].numel() == whole:
            copies[_source(n.args[0])] = copies.get(_source(n.args[0]), 0) + 1
    assert all(count == 1 for count in copies.values()), copies


class _Attention(torch.nn.Module):
    """Explicit attention with a learned bias on the scores, or its probabilities returned too."""

    def __init__(self, learned_bias=False, returns_probs=False):
        super().__init__()
        self.bias = torch.nn.Parameter(torch.zeros(6, 6)) if learned_bias else None
        self.returns_probs = returns_probs

    def forward(self, q, k, v):
        scores = q @ k.transpose(-2, -1) / 4
        if self.bias is not None:
            scores = scores + self.bias
        probs = scores.softmax(-1)
        out = (probs @ v).sum()
        return (out, probs) if self.returns_probs else out


@pytest.mark.parametrize(
    "module, why",
    [(_Attention(learned_bias=True), "needs a gradient"), (_Attention(returns_probs=True), "also read by")],
)
def test_an_attention_that_cannot_be_chunked_is_refused_by_name(module, why):
    inputs = tuple(torch.randn(2, 3, 6, 4, requires_grad=True) for _ in range(3))
    gm, _ = _dynamo_graph(module, inputs)
    (region,) = find_attention_regions(gm)
    assert why in region.why_not
    with pytest.raises(OptionError, match=f"option 'chunks': attention .*cannot be chunked: .*{why}"):
        torch.compile(module, backend="recompile_opt", options={"chunks": {"attention": 2}, **EAGER})(*inputs)


def test_the_option_takes_attention_and_names_it_among_the_accepted():
    assert parse_options({"chunks": {"attention": 4}}).chunks == {"attention": 4}
    with pytest.raises(OptionError, match="'attention'"):
        parse_options({"chunks": {"queries": 4}})


def test_attentions_candidate_is_keys_over_head_dim_with_a_floor_on_the_queries():
    """Liger's rule for attention: a chunk's scores no larger than its queries (k = keys / head dim);
    each chunk passes over a head's K and V, so it keeps the floor of rows on the queries."""
    from types import SimpleNamespace

    from recompile_opt.planner import chunk_choice
    from recompile_opt.planner.chunk_choice import Candidate

    roofline = parse_options({}).roofline_for("cpu")
    floor = chunk_choice.min_rows(4, roofline)
    attention = SimpleNamespace(
        why_not=None, keys=8 * floor, head_dim=64, queries=8 * floor, tokens=32 * 8 * floor, itemsize=4
    )
    liger = 8 * floor // 64
    assert chunk_choice.candidates([], [], roofline, attention_regions=[attention]) == [
        Candidate("attention", min(8, liger), tokens=attention.tokens, width=attention.keys)
    ]
    short = SimpleNamespace(**{**vars(attention), "queries": floor, "keys": floor})
    assert all(c.below_floor for c in chunk_choice.candidates([], [], roofline, attention_regions=[short]))


def test_attention_is_planned_only_where_its_probabilities_hold_a_third_of_the_walked_peak():
    """Where the walk says what is alive at the peak, attention's chunks are planned only where its
    ``[b, heads, s, s]`` buffers hold :data:`SHARE_FLOOR` of it (the demo GPT's 37%, Inductor's pool
    off: 21.78 -> 17.79 MiB in 4 chunks); without a walk, wherever they are alive (the simulated shapes)."""
    from types import SimpleNamespace

    from recompile_opt.planner.chunk_choice import SHARE_FLOOR, Candidate

    probs = [2, 4, 512, 512]
    attention = Candidate("attention", 4, tokens=2 * 4 * 512, width=512)
    mib = 2**20

    def plan(held: int, total: int = 26 * mib, walked: bool = True):
        breakdown = {"total": total, "shapes": [probs], "shape_bytes": [[probs, held], [[2, 512, 64], mib]]}
        return SimpleNamespace(
            peak_breakdown={"shapes": [probs]}, walked_breakdown=breakdown if walked else {}
        )

    assert SHARE_FLOOR["attention"] == 1 / 3
    assert attention.alive_at_peak(plan(24 * mib))  # the s=512 GPT: 24 of 26 MiB
    assert attention.alive_at_peak(plan(8 * mib, total=22 * mib))  # the demo GPT: 8 of 22
    assert not attention.alive_at_peak(plan(6 * mib, total=22 * mib))
    assert attention.alive_at_peak(plan(8 * mib, total=22 * mib, walked=False))


# -- end to end -------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "build, budget, k",
    [
        pytest.param(tiny_gpt, None, 3, id="gpt"),
        pytest.param(tiny_gpt, None, 8, id="gpt-8"),  # 8: the benchmark GPT's first try at 0.0
        pytest.param(tiny_llama, None, 3, id="llama"),
        pytest.param(tiny_gpt, 0.0, 8, id="gpt-least-peak-8", marks=pytest.mark.slow),
    ],
)
def test_gradients_equal_eager_with_dropout(build, budget, k):
    """Dropout on, eager compiler: the keep-mask is eager's, kept or replayed from a saved RNG state."""
    model, inputs = build(dropout=0.1)
    plan = train_side_by_side(
        model,
        inputs,
        options={"chunks": {"attention": k}, "memory_budget": budget, **EAGER},
        rtol=1e-4,
        atol=1e-5,
    )
    lines = [n for n in plan.notes if n.startswith("chunk: attention ")]
    assert len(lines) == 2 and all(f"in {k} chunks" in n and "keep-mask" in n for n in lines), plan.notes
    assert f"2 attention regions in {k} chunks" in plan.summary()
    assert {c["kind"] for c in plan.chunks} == {"attention"}


@pytest.mark.slow
@pytest.mark.parametrize(
    "build, k", [(tiny_gpt, 3), (tiny_gpt, 8), (tiny_llama, 3)], ids=["gpt", "gpt-8", "llama"]
)
def test_through_inductor_gradients_equal_eager_with_fallback_random(build, k):
    model, inputs = build(dropout=0.1)
    torch._dynamo.reset()
    with torch._inductor.config.patch(fallback_random=True):
        plan = train_side_by_side(model, inputs, options={"chunks": {"attention": k}}, rtol=1e-4, atol=1e-5)
    assert [c["chunks"] for c in plan.chunks if c["kind"] == "attention"] == [k, k]


@pytest.mark.slow
@pytest.mark.parametrize("name, attn", [("gpt2", "eager"), ("llama", "sdpa"), ("bert", "eager")])
def test_hugging_face_attention_chunks_with_dropout(name, attn):
    """GPT-2 (causal, eager), Llama (SDPA's math path) and BERT (bidirectional, eager) with dropout on
    the probabilities: gradients equal eager's."""
    pytest.importorskip("transformers")
    from test_hf_models import build

    model, inputs = build(name, dropout=0.1, attn=attn)
    model.model.loss_type = "ForCausalLM"  # GPT-2: one graph (no break at the loss's logging call)
    plan = train_side_by_side(
        model, inputs, options={"chunks": {"attention": 3}, **EAGER}, rtol=1e-4, atol=1e-5
    )
    assert len([c for c in plan.chunks if c["kind"] == "attention"]) == 2, plan.notes


@pytest.mark.slow
def test_through_inductor_the_planner_chunks_attention_and_the_measured_peak_falls():
    """Long sequence for the width (s=512, h=64, 4 heads, batch 2; probabilities 8 MiB a layer against
    0.25 MiB of hidden states): the least-peak plan without chunks peaks in the attention's backward.
    With ``chunks="auto"`` the planner chunks the attention by itself; the measured peak falls below
    0.8x and the gradients are eager's."""
    from helpers import least_peaks_without_and_with_auto_chunks

    cfg = models.GPTConfig(n_layer=1, n_head=4, n_embd=64, block_size=512, vocab_size=128)
    peaks, plan = least_peaks_without_and_with_auto_chunks(cfg, 2)
    assert any(c["kind"] == "attention" for c in plan.chunks), plan.summary()
    assert peaks["auto"] < 0.8 * peaks[False], peaks


def test_through_inductor_the_k_and_v_gradients_accumulate_in_place():
    """Each chunk's product is added into the K and V gradients' own buffers: one buffer each for all
    chunks, in the code Inductor generates. Why: ``baddbmm(total, ...)`` allocated each chunk's sum
    while the last was alive, one accumulator more at the demo GPT's peak (its attention backward)."""
    from torch._inductor.utils import run_and_get_code

    cfg = models.GPTConfig(n_layer=1, n_head=2, n_embd=32, block_size=16, vocab_size=64)
    torch.manual_seed(0)
    model, inputs = models.GPT(cfg), models.example_batch(cfg, 2)
    compiled = torch.compile(model, backend="recompile_opt", options={"chunks": {"attention": 4}})
    _, codes = run_and_get_code(lambda: compiled(*inputs).backward())
    calls = [
        line.strip()
        for code in codes
        for line in code.splitlines()
        if "add_transposed_product_.default(" in line and not line.strip().startswith("#")
    ]
    totals = {line.split("(", 1)[1].split(",", 1)[0] for line in calls}
    assert len(calls) == 2 * 4 and len(totals) == 2, calls  # K's and V's: one buffer each, 4 chunks
