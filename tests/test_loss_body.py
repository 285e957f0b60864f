"""The chunked loss's fused body (passes/loss_body.py, option ``fused_loss``): Inductor's kernels give
the ATen body's loss and gradients (bf16 gradients bit for bit, fp32 within a few roundings), write the
gradient into the logits' buffer (no fp32 copy of a chunk), fall back to ATen's kernels with a warning
where they do not compile, and train eager's loss through Inductor."""

from __future__ import annotations

import contextlib
import functools
import itertools

import pytest
import torch
from recompile_opt.passes import loss_body
from recompile_opt.passes.chunking import head_loss_in_chunks
from test_chunk_autocast import _assert_like_eager

import recompile_opt
from recompile_opt.costs.measure import allocation_timeline
from recompile_opt.options import parse_options


def _inputs(rows=37, vocab=100, width=16):
    """A head over ``rows`` tokens (every 5th ignored) with a bias, and a ``mean``'s scale."""
    g = torch.Generator().manual_seed(0)
    x, w, b = (
        torch.randn(rows, width, generator=g),
        torch.randn(vocab, width, generator=g),
        torch.randn(vocab, generator=g),
    )
    t = torch.randint(0, vocab, (rows,), generator=g)
    t[::5] = -100
    return x, w, b, t, torch.tensor(1 / 30)


def _op(fused, mm_dtype, label_smoothing, inputs, chunks=4, needs=(True, True, True)):
    """The op's loss and gradients of the tokens, weight and bias (``needs``), in fp32 from ``mm_dtype``
    logits, by the fused body or ATen's."""
    x, w, b, t, scale = inputs
    args = chunks, torch.float32, -100, label_smoothing, *needs, mm_dtype, mm_dtype, scale, fused
    return head_loss_in_chunks(x, w, b, t, *args)


@pytest.mark.parametrize("label_smoothing", [0.0, 0.1])
@pytest.mark.parametrize("mm_dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_the_fused_body_gives_the_aten_bodys_loss_and_gradients(mm_dtype, label_smoothing):
    inputs = _inputs()  # 37 rows in 4 chunks: 10, 9, 9, 9 rows, one compile (rows dynamic)
    with _no_fallback():
        got = _op(True, mm_dtype, label_smoothing, inputs)
    ref = _op(False, mm_dtype, label_smoothing, inputs)
    for g, r in zip(got, ref, strict=True):
        assert g.dtype == r.dtype and g.shape == r.shape
        if g.dim() and mm_dtype == torch.bfloat16:  # fp32 inside, rounded to bf16 as eager: the same bits
            torch.testing.assert_close(g, r, rtol=0, atol=0)
        else:  # a row's sums in another order, the softmax as exp(x - lse): a few fp32 roundings off
            torch.testing.assert_close(
                g, r, rtol=0, atol=16 * torch.finfo(g.dtype).eps * r.abs().max().item()
            )


@contextlib.contextmanager
def _no_fallback():
    """Fails where the fused body fell back to ATen's inside (a compile failure)."""
    yield
    assert not loss_body._BROKEN, f"the fused body fell back to ATen's on {loss_body._BROKEN}"


def test_the_fused_body_writes_the_gradient_into_the_logits_buffer():
    """No buffer of a chunk's fp32 logits: the ATen body's bf16 run makes one (the loss's upcast copy)
    and so did a first fused body (Inductor kept its ``exp`` for the gradient); the workspace (the op's
    allocations at their peak, less its outputs) lower by more than a chunk's bf16 logits. The tokens'
    gradient only: on the CPU the weight's upcasts its operands, a larger workspace of its own."""
    inputs = _inputs(rows=512, vocab=4096)
    logits_bytes = 128 * 4096 * 2  # one chunk of 128 rows, bf16

    def allocations(fused):
        run = functools.partial(_op, fused, torch.bfloat16, 0.0, inputs, needs=(True, False, False))
        run()  # compiled before it is measured
        outputs = []
        sizes = allocation_timeline(lambda: outputs.append(run()))
        peak = max(itertools.accumulate(sizes))
        return peak - sum(t.untyped_storage().nbytes() for t in outputs[0]), max(sizes)

    (fused, fused_largest), (aten, aten_largest) = allocations(True), allocations(False)
    assert fused_largest < 2 * logits_bytes <= aten_largest, (fused_largest, aten_largest)
    assert fused < aten - logits_bytes, (fused, aten)


def test_a_body_that_does_not_compile_falls_back_to_atens_with_a_warning(monkeypatch):
    """A compile error turns the fused body off on that device; Dynamo's recompile limit only for the
    call; an error of the kernels themselves (raised after the gradient may be half written) is the
    caller's, not retried on clobbered logits."""
    import recompile_opt._torch_internals as ti

    def raises(error):
        def call(*args):
            raise error

        return call

    monkeypatch.setattr(loss_body, "_BROKEN", set())
    inputs = _inputs()
    ref = _op(False, torch.float32, 0.1, inputs)
    for error, broken in (
        (ti.COMPILE_ERRORS[1]("recompile limit"), set()),
        (ti.COMPILE_ERRORS[0]("no"), {"cpu"}),
    ):
        monkeypatch.setattr(loss_body, "_COMPILED", raises(error))
        with pytest.warns(UserWarning, match="fused body did not compile on cpu"):
            got = _op(True, torch.float32, 0.1, inputs)
        assert loss_body._BROKEN == broken
        for g, r in zip(got, ref, strict=True):
            torch.testing.assert_close(g, r, rtol=0, atol=0)
    monkeypatch.setattr(loss_body, "_BROKEN", set())
    monkeypatch.setattr(loss_body, "_COMPILED", raises(RuntimeError("index out of bounds")))
    with pytest.raises(RuntimeError, match="index out of bounds"):
        _op(True, torch.float32, 0.1, inputs)


def test_option_fused_loss_names_its_accepted_values():
    with pytest.raises(recompile_opt.OptionError, match="option 'fused_loss': got 1; accepted values"):
        parse_options({"fused_loss": 1})


def test_through_inductor_the_fused_body_trains_eagers_loss_under_bf16_autocast():
    """The body compiled inside the compiled step (its workspace measured at plan time, its kernels run
    by the step's extern op): loss and gradients against eager's, within plain torch.compile's own
    deviation; the plan says how its chunks run, and its peak is walked in the step's own code."""
    with _no_fallback(), torch._inductor.config.patch(fx_graph_cache=False):  # the body's code generated
        plan = _assert_like_eager("gpt", "bf16", {"chunks": {"loss": 4}, "fused_loss": True})
    # its compile, nested in the step's (the op's workspace measured at plan time), is not the plan's code
    assert plan.solver.get("peak_from") == "inductor-code" and not plan.solver.get("unwalked"), plan.solver
    assert [c["body"] for c in plan.chunks] == ["fused"], plan.chunks
    assert "body fused by Inductor" in plan.summary()
    assert any("Inductor's fused kernels" in n for n in plan.notes), plan.notes


def test_the_head_recomputed_in_the_backward_runs_the_fused_body_too():
    with _no_fallback():
        plan = _assert_like_eager(
            "gpt", "bf16", {"chunks": {"loss_recompute": 4}, "fused_loss": True, "compiler": "eager"}
        )
    assert [(c["kind"], c["body"]) for c in plan.chunks] == [("loss_recompute", "fused")], plan.chunks
