"""Approximate backward as plan actions (issue 24): the ILP chooses per site between the exact values and
their codes or projection; the plan lists each approximated value; compiled gradients are those of the
approximate ops the plan names; ``approximate`` off changes nothing."""

from __future__ import annotations

import contextlib
from unittest import mock

import pytest
import torch
import torch.nn.functional as F
from helpers import tiny_gpt

import recompile_opt
from recompile_opt import models
from recompile_opt.approximate.few_bit import few_bit_activation
from recompile_opt.approximate.randomized_linear import randomized_linear
from recompile_opt.options import OptionError, parse_options
from recompile_opt.planner import ilp, search
from recompile_opt.planner.problem import Problem, Site, Value

MiB = 1 << 20
US = 1e-6
BOTH = {"activations": 3, "linear": 0.5}


# -- the ILP on a hand-built site ------------------------------------------------------------------


def _site_problem(code_mib=1, cost_us=0.0):
    """x (8 MiB, recompute 100 us from the input) read by the backward through one site whose
    approximation reads ``codes`` (``code_mib``, recomputed from x)."""
    values = {
        "inp": Value("inp", "inp", can_recompute=False),
        "x": Value("x", "x", inputs=("inp",), recompute_s=100 * US),
        "codes": Value("codes", "codes", inputs=("x",), recompute_s=1 * US),
    }
    site = Site(
        choice="approximate:m",
        marker="m",
        kind="few-bit",
        exact=("x",),
        approx=("codes",),
        replaced="x",
        detail={"bits": 3, "activation": "gelu"},
        cost_s=cost_us * US,
    )
    return Problem(
        values=values,
        storage_bytes={"inp": 0, "x": 8 * MiB, "codes": code_mib * MiB},
        save_s={"inp": 0.0, "x": 0.0, "codes": 0.0},
        bwd_steps=4,
        sites=[site],
    )


def _kept(p: Problem, sol: ilp.Solution) -> int:
    return p.kept_bytes(*p.needed_closure(sol.recompute, sol.keep))


def test_a_budget_met_exactly_is_never_met_by_approximating():
    p = _site_problem()
    sol = ilp.solve(p, budget=8 * MiB)
    assert "approximate:m" not in sol.recompute and _kept(p, sol) == 8 * MiB


def test_under_a_tight_budget_the_codes_replace_the_recompute():
    """1 MiB: x cannot be kept; recomputing it costs 100 us, keeping its codes nothing."""
    p = _site_problem()
    sol = ilp.solve(p, budget=1 * MiB)
    saved, recomputed = p.needed_closure(sol.recompute, sol.keep)
    assert "approximate:m" in recomputed and saved == {"codes"} and "x" not in recomputed


def test_an_approximation_dearer_than_the_recompute_is_not_taken():
    p = _site_problem(cost_us=150)
    sol = ilp.solve(p, budget=1 * MiB)
    assert "approximate:m" not in sol.recompute and "x" in sol.recompute


# -- options -----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "value,match",
    [
        ({"activations": 5}, r"'approximate': activations=5; accepted: a bit width 1, 2, 3 or 4"),
        ({"activations": 3.0}, r"activations=3.0"),
        ({"linear": 0}, r"'approximate': linear=0; accepted: a ratio in \(0, 1\]"),
        ({"linear": True}, r"linear=True"),
        ({"bits": 3}, r"'approximate'.*accepted values: False, None, or a dict with 'activations'"),
        (3, r"'approximate': got 3"),
    ],
)
def test_a_bad_approximate_option_names_the_accepted_values(value, match):
    with pytest.raises(OptionError, match=match):
        parse_options({"approximate": value})


def test_false_and_none_are_off():
    assert parse_options({"approximate": False}).approximate is None
    assert parse_options({"approximate": {"activations": False, "linear": False}}).approximate is None
    assert parse_options({"approximate": {"activations": 2}}).approximate == {"activations": 2}


# -- plans of a model ---------------------------------------------------------------------------------


def _plan(model, inputs, budget, **options):
    torch._dynamo.reset()
    return recompile_opt.plan(model, inputs, memory_budget=budget, compiler="eager", **options)


@pytest.mark.parametrize("budget", [0.0, 0.5])
def test_approximate_off_plans_exactly_as_without_the_option(budget):
    model, inputs = tiny_gpt()
    plain = _plan(model, inputs, budget).to_dict()
    off = _plan(model, inputs, budget, approximate=False).to_dict()
    for plan in (plain, off):
        # the same decisions; how they were reached differs (the second planning reuses the peaks found)
        plan["solver"] = {k: plan["solver"][k] for k in ("name", "status", "gap", "n_vars", "n_constraints")}
        plan["options"].pop("approximate", None)
    assert off == plain and not off["approximated"]


@contextlib.contextmanager
def _every_site_approximated():
    """The ILP is paid for approximating instead of paying: every site is approximated (to test the
    rewrites on every site, whatever a budget would choose), and at 0.0 the least-peak search keeps
    that search's plan (not the lowest of it, every site approximated, and none)."""
    with (
        mock.patch.object(ilp, "APPROXIMATION_PRICE", -1e3),
        mock.patch.object(search, "_least_peak_approximating", lambda *args, **kwargs: args[-1]),
    ):
        yield


def test_the_plan_lists_every_approximated_value_with_its_width_or_ratio():
    model, inputs = tiny_gpt()
    with _every_site_approximated():
        plan = _plan(model, inputs, 1.0, approximate=BOTH)
    kinds = sorted((a["kind"], a.get("bits"), a.get("ratio")) for a in plan.approximated)
    linears = sum(isinstance(m, torch.nn.Linear) for m in model.modules())
    activations = len(model.blocks)  # one GELU per block
    assert kinds == sorted([("few-bit", 3, None)] * activations + [("randomized", None, 0.5)] * linears)
    for a in plan.approximated:
        assert a["kept_as_bytes"] < a["bytes"], a  # 3/32 of an fp32 input; half its rows (+ an 8-byte seed)
    text = str(plan)
    assert "approximated      : 2 activation inputs as 3-bit codes" in text
    assert "3-bit gelu" in text and "ratio 0.5 linear" in text
    again = recompile_opt.Plan.from_json(plan.to_json())
    assert again.approximated == plan.approximated
    exact = _plan(model, inputs, 1.0)
    assert "exact ->" in exact.diff(plan) or "-> approx" in exact.diff(plan)


def _grads(model, inputs, options=None):
    for p in model.parameters():
        p.grad = None
    torch._dynamo.reset()
    run = torch.compile(model, backend="recompile_opt", options=options) if options is not None else model
    torch.manual_seed(123)
    run(*inputs).backward()
    return {n: p.grad.clone() for n, p in model.named_parameters()}


def _eager_approximate_grads(model, inputs, *, bits=None, ratio=None):
    """Eager gradients with every GELU few-bit at ``bits`` and every linear randomized at ``ratio``."""
    with contextlib.ExitStack() as stack:
        if bits:
            stack.enter_context(
                mock.patch.object(
                    models.GPTMLP,
                    "forward",
                    lambda self, x: self.dropout(self.c_proj(few_bit_activation(self.c_fc(x), "gelu", bits))),
                )
            )
        if ratio:
            stack.enter_context(
                mock.patch.object(
                    torch.nn.Linear,
                    "forward",
                    lambda self, x: randomized_linear(x, self.weight, self.bias, ratio),
                )
            )
        return _grads(model, inputs)


@pytest.mark.parametrize("compiler", ["eager", pytest.param("inductor", marks=pytest.mark.slow)])
def test_compiled_gradients_are_those_of_the_few_bit_ops_the_plan_names(compiler):
    """Few-bit codes are deterministic: the compiled step's gradients equal, to fp32 rounding, eager
    training of the same model with exactly the plan's approximated activations made few-bit."""
    model, inputs = tiny_gpt()
    options = {"memory_budget": 1.0, "compiler": compiler, "approximate": {"activations": 2}}
    recompile_opt.reset_plans()
    with _every_site_approximated():
        got = _grads(model, inputs, options)
    plan = recompile_opt.last_plans()[0]
    assert [a["kind"] for a in plan.approximated] == ["few-bit"] * len(model.blocks)
    assert sorted(a["module"] for a in plan.approximated) == [
        f"blocks.{i}.mlp" for i in range(len(model.blocks))
    ]

    want = _eager_approximate_grads(model, inputs, bits=2)
    exact = _grads(model, inputs)
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=1e-5, atol=1e-6, msg=name)
    assert any(not torch.allclose(exact[n], want[n], rtol=1e-3, atol=1e-5) for n in want)  # not exact


@pytest.mark.parametrize("dropout,budget", [(0.0, 1.0), (0.1, 0.0)])
def test_compiled_gradients_are_those_of_the_randomized_ops_the_plan_names(dropout, budget):
    """Randomized linears draw one seed each from torch's RNG, in the order the model calls them, between
    the dropout masks; every site approximated (the eager compiler draws as eager does, and replays the
    recomputed masks), the compiled step's gradients equal eager training with every linear randomized
    and every GELU at 3 bits, with dropout on too."""
    model, inputs = tiny_gpt(dropout=dropout)
    options = {"memory_budget": budget, "compiler": "eager", "approximate": BOTH}
    recompile_opt.reset_plans()
    with _every_site_approximated():
        got = _grads(model, inputs, options)
    plan = recompile_opt.last_plans()[0]
    linears = {name for name, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
    assert sorted(a["module"] for a in plan.approximated if a["kind"] == "randomized") == sorted(linears)
    want = _eager_approximate_grads(model, inputs, bits=3, ratio=0.5)
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=1e-5, atol=1e-6, msg=name)


def test_every_activation_at_3_bits_keeps_the_gradient_within_cosine_0_99():
    """The whole gradient with every GELU's backward at 3 bits (the most a plan can approximate) stays
    within cosine 0.99 of exact."""
    model, inputs = tiny_gpt()
    exact = _grads(model, inputs)
    recompile_opt.reset_plans()
    with _every_site_approximated():
        got = _grads(
            model, inputs, {"memory_budget": 1.0, "compiler": "eager", "approximate": {"activations": 3}}
        )
    assert len(recompile_opt.last_plans()[0].approximated) == len(model.blocks)
    flat = [torch.cat([g[n].flatten() for n in sorted(g)]) for g in (got, exact)]
    assert 0.99 < F.cosine_similarity(*flat, dim=0) < 1 - 1e-7


@pytest.mark.slow
def test_through_inductor_every_approximation_is_the_eager_ops_at_the_least_peak_plan():
    """Inductor with ``fallback_random`` draws the seeds as eager does: every site approximated, the
    least-peak plan's compiled gradients equal eager training with 3-bit GELUs and randomized linears."""
    model, inputs = tiny_gpt()
    options = {"memory_budget": 0.0, "approximate": BOTH}
    with _every_site_approximated(), torch._inductor.config.patch(fallback_random=True):
        got = _grads(model, inputs, options)
    want = _eager_approximate_grads(model, inputs, bits=3, ratio=0.5)
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=1e-5, atol=1e-6, msg=name)


@pytest.mark.slow
def test_through_inductors_own_rng_the_backward_projects_with_the_forwards_seed():
    """With Inductor's RNG a seed recomputed in the backward is drawn anew; kept, the compiled weight
    gradient is as close to exact as eager's estimate (cosine 0.55-0.59 here; 0.02 with a new seed)."""
    torch.manual_seed(0)
    layer = torch.nn.Linear(64, 32)
    x, grad_out = torch.randn(256, 64), torch.randn(256, 32)

    def weight_grad(f):
        layer.zero_grad()
        f(x).backward(grad_out)
        return layer.weight.grad.flatten().clone()

    exact = weight_grad(layer)
    torch._dynamo.reset()
    with _every_site_approximated():
        got = weight_grad(
            torch.compile(
                layer, backend="recompile_opt", options={"memory_budget": 1.0, "approximate": {"linear": 0.5}}
            )
        )
    eager = [
        F.cosine_similarity(
            weight_grad(lambda v: randomized_linear(v, layer.weight, layer.bias, 0.5)), exact, dim=0
        )
        for _ in range(8)
    ]
    assert F.cosine_similarity(got, exact, dim=0) > min(eager) - 0.1


def test_the_least_peak_plan_with_approximations_allowed_peaks_no_higher_than_the_exact_one():
    """memory_budget=0.0 with approximations allowed searches three ways (the ILP's priced choice, every
    site approximated, none) and takes the lowest walked peak: never above the exact least-peak plan
    (on the tiny GPT no approximation lowers it, and none is taken)."""
    model, inputs = tiny_gpt()
    exact = _plan(model, inputs, 0.0)
    both = _plan(model, inputs, 0.0, approximate=BOTH)
    assert both.predicted_peak_bytes <= exact.predicted_peak_bytes


@pytest.mark.slow
@pytest.mark.parametrize("pooled", [True, False], ids=["inductors-pool", "pool-off"])
def test_on_the_benchmark_gpt_both_approximations_lower_the_least_peak_by_a_seventh(pooled, monkeypatch):
    """The benchmark GPT (2 layers, h=256, s=256, batch 4): with 3-bit codes and randomized linears at
    0.5 the least-peak plan approximates every site. Both unchunked, so that the approximations' own
    gain is what is measured: allowed to chunk, the exact plan reaches 21.80 MiB by itself (its MLPs and
    loss in chunks), and the approximating one keeps its unchunked plan, which ties it.

    With Inductor's buffer pool, as when the figure was set (issue 24), its walked peak is 14.8% below
    the exact least-peak plan's (21.80 against 25.58 MiB). Without it, the setting under memory requests
    since, the exact plan's peak held no dead buffers and falls more (24.55 against 21.78 MiB: 11.3%),
    so there the approximating plan is only asked to be lower."""
    from recompile_opt import compile_paths, planning

    monkeypatch.setattr(planning, "pools_dead_buffers", lambda options: pooled)
    monkeypatch.setattr(compile_paths, "pools_dead_buffers", lambda options: pooled)
    torch._dynamo.reset()
    cfg = models.GPTConfig(n_layer=2, n_head=4, n_embd=256, block_size=256, vocab_size=512)
    torch.manual_seed(0)
    model = models.GPT(cfg)
    inputs = models.example_batch(cfg, 4)
    exact = _plan(model, inputs, 0.0, chunks=False)
    both = _plan(model, inputs, 0.0, approximate=BOTH, chunks=False)
    assert both.approximated and exact.solver["buffer_pool"] is both.solver["buffer_pool"] is pooled
    bound = 0.86 if pooled else 1.0
    assert both.predicted_peak_bytes < bound * exact.predicted_peak_bytes


def test_hugging_face_gpt2s_conv1d_layers_are_randomized_as_linears():
    """GPT-2's ``Conv1D`` (``addmm`` of an ``[in, out]`` weight) is offered as a linear layer: every site
    approximated, the plan lists each Conv1D and the tied LM head, and the compiled gradients equal eager
    training with each of them randomized (its weight read transposed)."""
    transformers = pytest.importorskip("transformers")
    from test_hf_models import build

    model, inputs = build("gpt2")
    options = {"memory_budget": 1.0, "compiler": "eager", "approximate": {"linear": 0.5}}
    recompile_opt.reset_plans()
    with _every_site_approximated():
        got = _grads(model, inputs, options)
    approximated = sorted(a["module"] for p in recompile_opt.last_plans() for a in p.approximated)
    conv1d = {n for n, m in model.model.named_modules() if isinstance(m, transformers.pytorch_utils.Conv1D)}
    assert conv1d and conv1d <= set(approximated) and any(m.endswith("lm_head") for m in approximated), (
        approximated
    )

    def conv1d_randomized(self, x):
        return randomized_linear(x, self.weight.t(), self.bias, 0.5)

    with (
        mock.patch.object(transformers.pytorch_utils.Conv1D, "forward", conv1d_randomized),
        mock.patch.object(
            torch.nn.Linear, "forward", lambda self, x: randomized_linear(x, self.weight, self.bias, 0.5)
        ),
    ):
        want = _grads(model, inputs)
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=1e-5, atol=1e-6, msg=name)


@pytest.mark.parametrize("chunks,few_bit", [({"mlp": 2}, False), ({"loss": 2}, True)])
def test_chunked_regions_are_rewritten_first_and_offer_no_site(chunks, few_bit):
    """Chunking rewrites its regions before sites are offered: a chunked MLP recomputes its GELU chunk by
    chunk and keeps no code (no site, exact gradients); with only the loss chunked every GELU keeps its
    3-bit code and the gradients are eager's with few-bit GELUs."""
    model, inputs = tiny_gpt()
    options = {"memory_budget": 0.0, "compiler": "eager", "chunks": chunks, "approximate": {"activations": 3}}
    recompile_opt.reset_plans()
    with _every_site_approximated():
        got = _grads(model, inputs, options)
    plan = recompile_opt.last_plans()[0]
    assert {c["kind"] for c in plan.chunks} == set(chunks), plan.chunks
    assert len(plan.approximated) == (len(model.blocks) if few_bit else 0), plan.approximated
    want = _eager_approximate_grads(model, inputs, bits=3) if few_bit else _grads(model, inputs)
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=1e-5, atol=1e-6, msg=name)


@pytest.mark.slow
def test_a_peak_limit_only_approximations_meet_is_met_with_them():
    """The benchmark GPT under ``peak_memory="23MiB"``, unchunked: no exact plan fits (the least exact
    peak walks at 24.8 MiB), and with both approximations allowed the plan fits, approximating, its peak
    walked. Unchunked because chunks meet the limit exactly (loss and MLPs chunked: 21.80 MiB), and what
    is tested is the approximations' own reach."""
    torch._dynamo.reset()
    cfg = models.GPTConfig(n_layer=2, n_head=4, n_embd=256, block_size=256, vocab_size=512)
    torch.manual_seed(0)
    model, inputs = models.GPT(cfg), models.example_batch(cfg, 4)
    with pytest.warns(UserWarning, match="peak_memory=23.00 MiB cannot be met"):
        recompile_opt.plan(model, inputs, peak_memory="23MiB", compiler="eager", chunks=False)
    torch._dynamo.reset()
    plan = recompile_opt.plan(
        model, inputs, peak_memory="23MiB", compiler="eager", approximate=BOTH, chunks=False
    )
    assert plan.approximated and plan.predicted_peak_bytes <= 23 * MiB, plan.summary()
    assert "walked in Inductor's code" in " ".join(plan.notes), plan.notes


def test_a_linear_whose_weight_the_graph_computes_is_left_exact():
    """``addmm(b, x, tanh(v * s))`` and ``F.linear(x, tanh(v))``: the "weight" is an activation whose
    gradient must stay exact; neither is offered, each is named with why, and a parameter's is."""
    from recompile_opt.passes.approximate import offer_approximations

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.v = torch.nn.Parameter(torch.randn(16, 16))
            self.b = torch.nn.Parameter(torch.randn(16))
            self.w = torch.nn.Parameter(torch.randn(16, 16))

        def forward(self, x):
            h = torch.tanh(self.v * x.sum())
            return (torch.addmm(self.b, x, h) + F.linear(x, torch.tanh(self.v)) + F.linear(x, self.w)).sum()

    offered = []

    def backend(gm, example_inputs):
        offered.append(offer_approximations(gm, {"linear": 0.5}))
        return gm

    torch._dynamo.reset()
    torch.compile(Model(), backend=backend)(torch.randn(8, 16))
    (done,) = offered
    assert done.linears == 1, done
    assert [why for _, why in done.skipped] == [
        "its weight is computed in the graph, not a trained parameter"
    ] * 2


def test_a_deep_stack_with_approximations_is_solved_as_block_groups():
    """Offered approximations no longer make a deep stack solve in full (a 12-layer GPT's least-peak
    planning: 109 s in full, 42 s as groups): a template's site stands for the same site in every
    block of its group, and the compiled gradients are eager's with exactly the plan's activations
    made few-bit."""
    cfg = models.GPTConfig(n_layer=5, n_head=2, n_embd=32, block_size=16, vocab_size=64, dropout=0.0)
    torch.manual_seed(0)
    model, inputs = models.GPT(cfg), models.example_batch(cfg, 2)
    options = {"memory_budget": "80KiB", "compiler": "eager", "approximate": {"activations": 2}}
    recompile_opt.reset_plans()
    got = _grads(model, inputs, options)
    plan = recompile_opt.last_plans()[0]
    assert any("5 identical blocks solved as 4 groups of 1+2+1+1" in n for n in plan.notes), plan.notes
    assert plan.saved_bytes <= 80 * 1024
    approximated = {a["module"] for a in plan.approximated}
    assert approximated and approximated < {f"blocks.{i}.mlp" for i in range(5)}, approximated
    assert ("blocks.1.mlp" in approximated) == ("blocks.2.mlp" in approximated)  # one group's template
    mlps = {m for name, m in model.named_modules() if name in approximated}
    few_bit_there = mock.patch.object(
        models.GPTMLP,
        "forward",
        lambda self, x: self.dropout(
            self.c_proj(few_bit_activation(self.c_fc(x), "gelu", 2) if self in mlps else F.gelu(self.c_fc(x)))
        ),
    )
    with few_bit_there:
        want = _grads(model, inputs)
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=1e-5, atol=1e-6, msg=name)
