"""Train a model eagerly and compiled side by side; compare losses and gradients step by step."""

from __future__ import annotations

import copy

import torch

import recompile_opt
from recompile_opt.costs.measure import peak_memory, saved_report
from recompile_opt.models import GPT, MLP, GPTConfig, Llama, LlamaConfig, example_batch

TINY_GPT = dict(n_layer=2, n_head=2, n_embd=32, block_size=16, vocab_size=64)


def tiny_gpt(dropout: float = 0.0):
    cfg = GPTConfig(**TINY_GPT, dropout=dropout)
    torch.manual_seed(0)
    return GPT(cfg), example_batch(cfg, 2)


def tiny_llama(dropout: float = 0.0):
    cfg = LlamaConfig(n_layer=2, n_head=2, n_embd=32, block_size=16, vocab_size=64, dropout=dropout)
    torch.manual_seed(0)
    return Llama(cfg), example_batch(cfg, 2)


def tiny_mlp():
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    return MLP((16, 64, 64, 8)), (torch.randn(8, 16, generator=g), torch.randn(8, 8, generator=g))


def max_grad_diff(a: torch.nn.Module, b: torch.nn.Module) -> float:
    return max((pa.grad - pb.grad).abs().max().item() for pa, pb in zip(a.parameters(), b.parameters()))


def train_side_by_side(
    model,
    inputs,
    *,
    options=None,
    reference_options=None,
    steps=3,
    rtol=1e-5,
    atol=1e-6,
    saved: list | None = None,
    measure_peak=False,
):
    """``steps`` SGD steps on an eager copy (or, with ``reference_options``, a second recompile_opt
    copy) and on the compiled model with identical seeds; assert every step's gradients match.
    Returns the last plan; with ``measure_peak``, also the measured peak of one more compiled step
    (entered with gradients None, as every predicted peak assumes).

    ``saved``: a list that gets, for every step after the first (the model is compiled by then), the
    :class:`~recompile_opt.costs.measure.SavedReport` of the compiled model's forward: the bytes it
    really kept for backward, its parameters excluded (as a plan's ``saved_bytes`` charges them 0)."""
    plan, ours, ours_fn = _train(model, inputs, options, reference_options, steps, rtol, atol, saved)
    if not measure_peak:
        return plan
    ours.zero_grad(set_to_none=True)
    return plan, peak_memory(lambda: ours_fn(*inputs).backward())


def train_and_measure_saved(model, inputs, *, options=None, steps=3, rtol=1e-5, atol=1e-6):
    """:func:`train_side_by_side`, then one more forward of the compiled copy under autograd's
    saved-tensor hooks: ``(plan, bytes it hands the backward)``, parameters and their views excluded
    (the plan lists them free). The figure is autograd's, not the planner's, so a check of a plan's
    kept bytes against it does not take the planner's word. (Measured after training: hooks active
    while AOTAutograd traces may be inlined into the graph.)"""
    plan, ours, ours_fn = _train(model, inputs, options, None, steps, rtol, atol)
    report, _ = saved_report(lambda: ours_fn(*inputs), exclude=[ours])
    return plan, report.total_bytes


def _train(model, inputs, options, reference_options, steps, rtol, atol, saved=None):
    ref, ours = copy.deepcopy(model), copy.deepcopy(model)
    ref_fn = (
        ref
        if reference_options is None
        else torch.compile(ref, backend="recompile_opt", options=reference_options)
    )
    ours_fn = torch.compile(ours, backend="recompile_opt", options=options or {})
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (ref, ours)]
    for step in range(steps):
        for fn, opt in zip((ref_fn, ours_fn), opts):
            opt.zero_grad(set_to_none=True)
            torch.manual_seed(100 + step)
            if fn is ours_fn and saved is not None and step > 0:
                report, loss = saved_report(lambda: fn(*inputs), exclude=[ours])
                saved.append(report)
                loss.backward()
            else:
                fn(*inputs).backward()
        for (name, pa), pb in zip(ref.named_parameters(), ours.parameters()):
            torch.testing.assert_close(
                pb.grad, pa.grad, rtol=rtol, atol=atol, msg=lambda m: f"step {step}, {name}: {m}"
            )
        for opt in opts:
            opt.step()
    plans = recompile_opt.last_plans()
    assert plans, "no plan recorded: the model was not compiled by recompile_opt"
    return plans[-1], ours, ours_fn


def partitioned(model, inputs, options: dict):
    """Run one forward and backward through our partitioner with the eager compiler; its
    ``RecompilePartitioner`` (``plans``, ``last_forward``, ``last_backward``) for the last graph."""
    return partitioned_and_compiled(model, inputs, options)[0]


def partitioned_and_compiled(model, inputs, options: dict):
    """:func:`partitioned`, and the compiled model it ran (to run or measure more steps of)."""
    from recompile_opt.compile_paths import compile_eager
    from recompile_opt.options import parse_options
    from recompile_opt.partitioner import RecompilePartitioner

    parts = []

    def backend(gm, example_inputs):
        parts.append(RecompilePartitioner(parse_options({**options, "compiler": "eager"})))
        return compile_eager(gm, example_inputs, parts[-1])

    torch._dynamo.reset()
    compiled = torch.compile(model, backend=backend)
    compiled(*inputs).backward()
    return parts[-1], compiled


def forget_searches(monkeypatch) -> None:
    """Plan as if no earlier test had: forget every graph's least-peak search and the peaks simulated
    and walked for its plans (both are kept per graph for the process), and solve every ILP anew."""
    from collections import OrderedDict

    from recompile_opt.costs import simulator
    from recompile_opt.partitioner import MEMORY

    monkeypatch.setattr(MEMORY, "range_ends", {})
    monkeypatch.setattr(MEMORY, "peaks", OrderedDict())
    monkeypatch.setattr(simulator, "_load", lambda key: None)  # nor what an earlier test left on disk
    solve_anew(monkeypatch)


def solve_anew(monkeypatch) -> None:
    """Every ILP of a planning solved by the solver, none read from what an earlier test's planning
    kept on disk (``planner/solutions.py``): for the tests that fake the solver or count its work."""
    from recompile_opt.planner import solutions

    monkeypatch.setattr(solutions, "recall", lambda key: None)


def least_peaks_without_and_with_auto_chunks(cfg: GPTConfig, batch: int) -> tuple[dict, object]:
    """A GPT of ``cfg`` compiled at 0.0 with ``chunks`` False and "auto": each step's gradients checked
    against eager's (within 1e-5), its measured peak by setting, and the "auto" compile's last plan."""
    torch.manual_seed(0)
    base, inputs = GPT(cfg), example_batch(cfg, batch)
    ref = copy.deepcopy(base)
    ref(*inputs).backward()
    peaks = {}
    for chunks in (False, "auto"):
        torch._dynamo.reset()
        model = copy.deepcopy(base)
        step = torch.compile(model, backend="recompile_opt", options={"memory_budget": 0.0, "chunks": chunks})
        step(*inputs).backward()
        assert max_grad_diff(model, ref) < 1e-5
        model.zero_grad(set_to_none=True)
        peaks[chunks] = peak_memory(lambda: step(*inputs).backward())
    return peaks, recompile_opt.last_plans()[-1]
