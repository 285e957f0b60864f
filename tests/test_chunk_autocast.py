"""Chunked (and approximating) regions under autocast (issue 51): every op of a chunk in the dtype eager
autocast gives it, and every sum over chunks rounded as eager's one GEMM rounds it. Loss and gradients are
checked against eager under the same autocast, within the deviation plain ``torch.compile`` (Inductor) shows
on the same model and step: before the fix the chunked loss was computed in bf16 (7.8125 where eager
gives 7.795475) and the chunked weights' gradients were rounded once a chunk (0.2-0.6% off, where
Inductor is 3e-7 off on the tiny GPT)."""

from __future__ import annotations

import functools

import pytest
import torch
import torch.nn.functional as F
from helpers import tiny_gpt, tiny_llama
from recompile_opt.passes.chunk_mlp import chunked_mlp
from recompile_opt.passes.chunking import chunked_linear_cross_entropy, head_loss_in_chunks
from torch.overrides import TorchFunctionMode

import recompile_opt
from recompile_opt import models

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
# fp32 reorderings (a chunk's sum, a loss summed in parts) are allowed where compile itself is exact
FLOOR = 1e-5


def _logits_dominated():
    """A vocabulary of 8192 over 1024 tokens of width 64: ``chunks="auto"`` chunks its loss at 0.0 (at
    256 tokens, under autocast, two chunks of the floor's 128 rows hold more than the unchunked loss)."""
    cfg = models.GPTConfig(n_layer=1, n_head=4, n_embd=64, block_size=128, vocab_size=8192)
    torch.manual_seed(0)
    return models.GPT(cfg), models.example_batch(cfg, 8)


def _stack_under_a_large_head():
    """The GPU check's GPT in small (``bench/gpu/models.perf_gpt``'s SDPA attention, 4 layers, a
    vocabulary 128x the width): unchunked, its least peak lies under the head's backward."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parents[1] / "bench"))
    from gpu.models import _sdpa_attention_class

    cfg = models.GPTConfig(n_layer=4, n_head=2, n_embd=64, block_size=256, vocab_size=8192, dropout=0.0)
    torch.manual_seed(0)
    model = models.GPT(cfg)
    for block in model.blocks:
        block.attn.__class__ = _sdpa_attention_class()
        del block.attn.causal_mask
    return model, models.example_batch(cfg, 4)


BUILDS = {
    "gpt": tiny_gpt,
    "llama": tiny_llama,
    "logits": _logits_dominated,
    "stack": _stack_under_a_large_head,
}


def _step(build: str, dtype: str, compile_model=None):
    """One forward and backward under CPU autocast: ``(loss, {name: gradient})``."""
    torch._dynamo.reset()
    model, inputs = BUILDS[build]()
    fn = compile_model(model) if compile_model else model
    with torch.autocast("cpu", dtype=DTYPES[dtype]):
        loss = fn(*inputs)
    loss.backward()
    return loss.detach().float(), {n: p.grad for n, p in model.named_parameters()}


def _deviation(got, ref) -> tuple[float, float]:
    """The loss's relative error and the largest of the gradients' (max |a - b| over max |b|)."""
    (loss, grads), (ref_loss, ref_grads) = got, ref
    worst = max(
        ((grads[n] - g).abs().max() / g.abs().max().clamp(min=1e-30)).item() for n, g in ref_grads.items()
    )
    return abs(loss - ref_loss).item() / abs(ref_loss).item(), worst


@functools.cache
def _eager_and_compiles_deviation(build: str, dtype: str):
    """Eager's step, and how far plain ``torch.compile`` (Inductor) lands from it:
    ``(eager, (loss, grad))``."""
    eager = _step(build, dtype)
    return eager, _deviation(_step(build, dtype, torch.compile), eager)


def _assert_like_eager(build: str, dtype: str, options: dict):
    eager, (loss_dev, grad_dev) = _eager_and_compiles_deviation(build, dtype)
    ours = _step(build, dtype, lambda m: torch.compile(m, backend="recompile_opt", options=options))
    got_loss, got_grad = _deviation(ours, eager)
    assert got_loss <= max(2 * loss_dev, FLOOR), (
        f"{options}: loss {ours[0].item()} against eager's "
        f"{eager[0].item()} (torch.compile's relative error {loss_dev:.2g})"
    )
    assert got_grad <= max(2 * grad_dev, FLOOR), (
        f"{options}: gradients {got_grad:.3g} off, torch.compile {grad_dev:.3g}"
    )
    return recompile_opt.last_plans()[-1]


def _assert_rounded_once(got, ref, dtype):
    """``got`` is eager's gradient but where an fp32 sum taken in another order rounds to the
    neighbouring ``dtype`` value: one unit in the last place, in a few elements (a gradient rounded once
    a chunk differs in most of them)."""
    off = (got - ref).abs() > 1e-6 * ref.abs() + 1e-9
    assert ((got - ref).abs() <= torch.finfo(dtype).eps * ref.abs() + 1e-9).all(), (got - ref).abs().max()
    assert off.float().mean() < 0.01, f"{int(off.sum())} of {off.numel()} elements differ"


# -- the ops on their own: exact against eager autocast ----------------------------------------------------


@pytest.mark.parametrize("recompute", [False, True], ids=["gradients-in-forward", "head-recomputed"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_the_chunked_loss_runs_the_head_in_autocasts_dtype_and_the_loss_in_fp32(dtype, recompute):
    torch.manual_seed(0)
    x = torch.randn(40, 16, requires_grad=True)
    head = torch.nn.Linear(16, 96)
    target = torch.randint(0, 96, (40,))
    with torch.autocast("cpu", dtype=DTYPES[dtype]):
        logits = head(x)
        loss = F.cross_entropy(logits, target)
    assert logits.dtype == DTYPES[dtype] and loss.dtype == torch.float32  # what eager autocast does
    ref = torch.autograd.grad(loss, [x, head.weight, head.bias])
    with torch.autocast("cpu", dtype=DTYPES[dtype]):
        got = chunked_linear_cross_entropy(
            x,
            head.weight,
            head.bias,
            target,
            chunks=3,
            dtype=torch.float32,
            mm_dtype=DTYPES[dtype],
            recompute=recompute,
        )
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, loss, rtol=1e-6, atol=1e-6)
    for g, r in zip(torch.autograd.grad(got, [x, head.weight, head.bias]), ref, strict=True):
        assert g.dtype == r.dtype
        _assert_rounded_once(g, r, DTYPES[dtype])


def test_compiled_code_runs_the_chunked_heads_matmuls_in_autocasts_dtype_though_autocast_is_off():
    """AOTAutograd runs compiled graphs with autocast off, so the op decides its dtypes itself: the
    head's matmuls in bf16 (fp32 before: 5x the step on an H200), the loss in fp32."""
    matmuls = []
    products = {
        F.linear: "linear",
        torch.Tensor.__matmul__: "matmul",
        torch.Tensor.matmul: "matmul",
        torch.matmul: "matmul",
    }

    class Matmuls(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            if func in products:
                matmuls.append((products[func], {a.dtype for a in args if isinstance(a, torch.Tensor)}))
            return func(*args, **(kwargs or {}))

    x, w, t = torch.randn(8, 4), torch.randn(16, 4), torch.randint(0, 16, (8,))
    with Matmuls():
        total, *grads = head_loss_in_chunks(
            x, w, None, t, 2, torch.float32, -100, 0.0, True, True, False, torch.bfloat16, torch.bfloat16
        )
    # a chunk's logits and its input's gradient (the weight's is summed over chunks in fp32)
    assert matmuls == [("linear", {torch.bfloat16}), ("matmul", {torch.bfloat16})] * 2, matmuls
    assert total.dtype == torch.float32 and [g.dtype for g in grads[:2]] == [torch.float32, torch.float32]


@pytest.mark.parametrize("swiglu", [False, True], ids=["gelu", "swiglu"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_the_chunked_mlp_runs_its_matmuls_in_autocasts_dtype_and_rounds_each_gradient_once(dtype, swiglu):
    torch.manual_seed(0)
    leaf = torch.randn(48, 16, requires_grad=True)
    x = leaf * 1  # an MLP's input is a layer's output: autocast casts it at each read (a leaf, once)
    ups = [torch.nn.Linear(16, 64) for _ in range(1 + swiglu)]
    down = torch.nn.Linear(64, 16)
    act = (lambda g, u: F.silu(g) * u) if swiglu else F.gelu
    params = [leaf, *(p for u in ups for p in u.parameters()), *down.parameters()]
    with torch.autocast("cpu", dtype=DTYPES[dtype]):
        hidden = [u(x) for u in ups]
        out = down(act(*hidden))
    ref = torch.autograd.grad(out.float().square().sum(), params, retain_graph=True)
    with torch.autocast("cpu", dtype=DTYPES[dtype]):
        got = chunked_mlp(
            x,
            [u.weight for u in ups],
            [u.bias for u in ups],
            down.weight,
            down.bias,
            act,
            chunks=3,
            mm_dtypes=(DTYPES[dtype],) * (len(ups) + 1),
        )
    assert got.dtype == out.dtype == DTYPES[dtype]
    torch.testing.assert_close(got, out, rtol=0, atol=0)
    for g, r in zip(torch.autograd.grad(got.float().square().sum(), params), ref, strict=True):
        assert g.dtype == r.dtype
        _assert_rounded_once(g, r, DTYPES[dtype])


# -- compiled, against eager within torch.compile's own deviation ----------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("build", ["gpt", pytest.param("llama", marks=pytest.mark.slow)])
def test_every_chunk_kind_trains_eagers_loss_and_gradients_under_autocast(build, dtype):
    for kind in ("loss", "loss_recompute", "mlp"):
        plan = _assert_like_eager(build, dtype, {"chunks": {kind: 4}, "compiler": "eager"})
        assert any(n.startswith(f"chunk: {kind.split('_')[0]} ") for n in plan.notes), plan.notes


@pytest.mark.parametrize("dtype", ["bf16"])  # fp16 too through Inductor: the slow test below
def test_auto_chunks_at_the_least_peak_train_eagers_loss_under_autocast(dtype):
    plan = _assert_like_eager("logits", dtype, {"memory_budget": 0.0, "compiler": "eager"})
    assert any(c["kind"] == "loss" for c in plan.chunks), plan.summary()  # chunked by itself


@pytest.mark.slow
@pytest.mark.parametrize("dtype", DTYPES)
def test_through_inductor_chunks_train_eagers_loss_and_gradients_under_autocast(dtype):
    plan = _assert_like_eager("gpt", dtype, {"chunks": {"loss": 4, "mlp": 4}})
    assert {c["kind"] for c in plan.chunks} == {"loss", "mlp"}, plan.chunks
    plan = _assert_like_eager("logits", dtype, {"memory_budget": 0.0})
    assert any(c["kind"] == "loss" for c in plan.chunks), plan.summary()


@pytest.mark.parametrize(
    "approximate", [{"activations": 2}, {"linear": 0.5}], ids=["few-bit", "randomized-linear"]
)
def test_approximations_under_autocast_run_eagers_forward_in_its_dtypes(approximate):
    """The approximating rewrites build their own ops too: the randomized linear casts as autocast does
    (it failed with "expected m1 and m2 to have the same dtype" before); the forward is exact."""
    eager = _step("gpt", "bf16")
    loss, grads = _step(
        "gpt",
        "bf16",
        lambda m: torch.compile(
            m,
            backend="recompile_opt",
            options={"approximate": approximate, "memory_budget": 0.0, "compiler": "eager"},
        ),
    )
    assert abs(loss - eager[0]).item() <= FLOOR * abs(eager[0]).item()
    assert all(g.dtype == torch.float32 and torch.isfinite(g).all() for g in grads.values())
    assert any(n.startswith("approximate: ") for n in recompile_opt.last_plans()[-1].notes)


def test_the_unchunked_least_peak_takes_a_policy_in_the_blocks_and_the_ilps_choice_outside(monkeypatch):
    """Under autocast the ``full`` policy keeps the loss's fp32 shifted logits and the ILP's plans keep
    attention outputs that sit under the head's backward; the search also meets ``full`` inside the
    blocks with the ILP's least-peak choice outside them, and that plan peaks lower than any other it
    meets, with eager's loss and gradients (the GPU GPT, planned the same way: 2.53 -> 2.26 GiB,
    ``bench/unchunked_floor.py``)."""
    from helpers import forget_searches

    from recompile_opt.planner import least_peak

    options = {"memory_budget": 0.0, "chunks": False, "compiler": "eager"}
    plan = _assert_like_eager("stack", "bf16", options)
    assert any("'full' policy's plan inside the blocks" in n for n in plan.notes), plan.notes
    mixed = least_peak._policy_plans
    monkeypatch.setattr(
        least_peak,
        "_policy_plans",
        lambda *a: [c for c in mixed(*a) if not c.policy.endswith(least_peak.IN_BLOCKS)],
    )
    forget_searches(monkeypatch)
    model, inputs = _stack_under_a_large_head()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        without = recompile_opt.plan(model, inputs, **options)
    assert plan.predicted_peak_bytes < without.predicted_peak_bytes
