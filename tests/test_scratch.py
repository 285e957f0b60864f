"""The workspace of extern kernels (recompile_opt.costs.scratch): measured on the device, once per layout."""

from __future__ import annotations

import torch
from torch.fx.experimental.proxy_tensor import make_fx

from recompile_opt.costs import scratch
from recompile_opt.costs.measure import allocation_timeline


def _conv_backward(x, w, g):
    return torch.ops.aten.convolution_backward.default(
        g, x, w, [32], [8, 8], [0, 0], [1, 1], False, [0, 0], 1, [False, True, True]
    )


def _node(fn, *args, mode="fake"):
    gm = make_fx(fn, tracing_mode=mode)(*args)
    return next(n for n in gm.graph.nodes if n.op == "call_function" and "convolution" in str(n.target))


def _args(device="cpu", channels_last=False):
    fmt = torch.channels_last if channels_last else torch.contiguous_format
    return (
        torch.randn(2, 3, 32, 32, device=device).to(memory_format=fmt),
        torch.randn(32, 3, 8, 8, device=device).to(memory_format=fmt),
        torch.randn(2, 32, 4, 4, device=device),
    )


def _measured_here(*args) -> int:
    """The op's busiest moment above its call, less its outputs, read off the allocator by this test."""
    out = []
    events = allocation_timeline(lambda: out.append(_conv_backward(*args)))
    live = top = 0
    for nbytes in events:
        live += nbytes
        top = max(top, live)
    return top - sum(t.untyped_storage().nbytes() for t in out[0] if t is not None)


def test_a_convolution_backward_is_measured_at_its_layout_and_cached(monkeypatch):
    node = _node(_conv_backward, *_args())
    got = scratch.scratch_bytes(node)
    assert got == _measured_here(*_args()) and got > 0
    # Inductor lays the input and weight out channels-last: a measurement of its own
    x, w, _ = _args(channels_last=True)
    layouts = [((2, 32, 4, 4), (512, 16, 4, 1)), ((2, 3, 32, 32), x.stride()), ((32, 3, 8, 8), w.stride())]
    assert scratch.scratch_bytes(node, layouts) == _measured_here(*_args(channels_last=True))
    monkeypatch.setattr(scratch, "_measure", lambda *a: 1 / 0)  # a second question is answered from the cache
    assert scratch.scratch_bytes(node) == got


def test_no_scratch_without_a_kernel_to_measure():
    meta = _node(_conv_backward, *_args("meta"), mode="real")
    assert scratch.has_scratch(meta) and scratch.scratch_bytes(meta) == 0
    gm = make_fx(lambda a, b: a @ b, tracing_mode="fake")(torch.randn(4, 4), torch.randn(4, 4))
    mm = next(n for n in gm.graph.nodes if n.op == "call_function")
    assert not scratch.has_scratch(mm) and scratch.scratch_bytes(mm) == 0


def test_only_an_op_that_compiles_on_its_first_call_runs_once_unmeasured(monkeypatch):
    """The chunked loss with its fused body compiles on its first call, so its scratch is measured on a
    second; every other op is run once (one run of the GPU check's chunked loss takes minutes on the CPU)."""
    from recompile_opt.passes.chunking import chunked_head_loss  # noqa: F401 - registers the op

    from recompile_opt import ops

    op = torch.ops.recompile_opt.chunked_head_loss.default
    tokens, weight, target = torch.randn(8, 4), torch.randn(16, 4), torch.randint(0, 16, (8,))

    def loss_node(fused):
        def fn(t, w, y):
            return op(t, w, None, y, 2, torch.float32, -100, 0.0, True, True, False, None, None, None, fused)

        gm = make_fx(fn, tracing_mode="fake")(tokens, weight, target)
        return next(n for n in gm.graph.nodes if n.target is op)

    calls = []
    real_op = scratch._measure

    def counted(target, *rest):
        def counting(*a, **k):
            calls.append(1)
            return target(*a, **k)

        return real_op(counting, *rest)

    monkeypatch.setattr(scratch, "_measure", counted)
    monkeypatch.setattr(scratch, "_MEASURED", {})
    for fused, runs in ((False, 1), (True, 2)):
        node = loss_node(fused)
        assert ops.compiles_on_first_call(node) is fused
        calls.clear()
        scratch.scratch_bytes(node)
        assert len(calls) == runs, fused
