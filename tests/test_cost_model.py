"""The cost model's charge for recomputing fused pointwise ops (recompile_opt.costs.cost_model)."""

from __future__ import annotations

import recompile_opt
from recompile_opt import models


def _ops(entries, module_part: str) -> set[str]:
    return {e.op for e in entries if module_part in e.module}


def test_no_budget_plan_recomputes_a_norm_output_that_fuses_into_its_backward():
    # RMSNorm's x * rsqrt(...) is one pointwise op over values the backward keeps anyway, read in the
    # backward only by fused pointwise ops: recomputed there it costs one pass, kept it costs a write
    # and a read, so with no budget it is recomputed (charged its full traffic, it was kept)
    model, batch = models.demo_llama(n_layer=1, n_embd=64, seq=32, batch=2)
    plan = recompile_opt.plan(model, batch)
    assert {"attention_norm", "ffn_norm"} <= {
        e.module.rsplit(".", 1)[-1] for e in plan.recomputed if e.op == "mul"
    }, plan
    assert plan.recompute_flops == 0  # nothing else: no matmul is worth recomputing without a budget


def test_the_fastest_plan_keeps_a_pointwise_output_that_a_backward_matmul_reads():
    # the product silu(gate) * up feeds the down projection's weight gradient (a matmul): recomputed,
    # it would be written out again, so it is not cheap and the fastest plan keeps it (mip_gap=0: the
    # no-budget plan then is the fastest one; with the default gap it trades that time for bytes,
    # planner/search.py::_leanest_as_fast, and recomputes the product: the plan below)
    model, batch = models.demo_llama(n_layer=1, n_embd=64, seq=32, batch=2)
    plan = recompile_opt.plan(model, batch, mip_gap=0.0)
    kept = [e for e in plan.saved if "feed_forward.w2" in e.module and e.bytes > 0]
    assert kept, plan
    lean = recompile_opt.plan(model, batch)
    assert not [e for e in lean.saved if "feed_forward.w2" in e.module and e.bytes > 0], lean
    assert lean.saved_bytes < plan.saved_bytes and lean.recompute_flops == 0


def _mask_slice_graph():
    """One process's dropout mask for 8 heads and a rank's 2 of them, as the rewrite writes it
    (``rand(full) > p`` gathered by an ``index`` along the head dimension)."""
    import torch
    from torch.fx.experimental.proxy_tensor import make_fx

    def rank_mask(x):
        keep = torch.rand(1, 8, 16, 16) > 0.1
        return keep[:, torch.arange(2, 4)] & (x > 0)

    return make_fx(rank_mask)(torch.randn(1, 2, 16, 16))


def test_a_fused_chain_a_gather_reads_costs_the_slice_it_reads():
    # Inductor draws rand inside the gather's kernel, only at the rank's heads: the chain costs 2/8
    from recompile_opt.costs.cost_model import demanded_fraction
    from recompile_opt.ops import is_fusible_pointwise, is_generated_random

    gm = _mask_slice_graph()
    nodes = {n.name: n for n in gm.graph.nodes}
    fuses_with_inductors_rng = lambda n: is_fusible_pointwise(n) or is_generated_random(n)  # noqa: E731
    assert demanded_fraction(nodes["rand"], fuses_with_inductors_rng, {}) == 2 / 8
    assert demanded_fraction(nodes["gt"], fuses_with_inductors_rng, {}) == 2 / 8
    # eager's replay draws the whole tensor; a value a non-gathering op reads is made whole
    assert demanded_fraction(nodes["rand"], is_fusible_pointwise, {}) == 1.0
    assert demanded_fraction(nodes["arange"], fuses_with_inductors_rng, {}) == 1.0


def test_a_gather_reads_one_source_element_per_element_it_writes():
    from recompile_opt.costs.cost_model import node_cost

    gm = _mask_slice_graph()
    index = next(n for n in gm.graph.nodes if n.op == "call_function" and "index" in str(n.target))
    roofline = {"flops_per_s": 1e12, "bytes_per_s": 1e9}
    # writes 2*16*16 bools, reads as many bools of the 8-head mask and the 2 int64 indices
    assert node_cost(index, roofline).traffic_bytes == 2 * 16 * 16 + 2 * 16 * 16 + 2 * 8


def test_a_chain_of_pointwise_ops_and_a_reduction_costs_the_bytes_its_one_kernel_moves():
    """``x * 2 -> exp -> + y -> sum(-1)`` and a matmul of the exp: Inductor's kernels read x and y once
    and write the exp (the matmul, an extern kernel, reads it) and the sum, not each op's inputs and
    output (a step estimated op by op was 4.9x the H200 GPT's measured step)."""
    import torch
    from torch.fx.experimental.proxy_tensor import make_fx

    from recompile_opt.costs.cost_model import node_cost
    from recompile_opt.costs.kernels import kernel_seconds, phase_kernels

    def step(x, y, w):
        e = (x * 2).exp()
        return (e + y).sum(-1), e @ w

    x, y, w = torch.randn(64, 32), torch.randn(64, 32), torch.randn(32, 32)
    gm = make_fx(step)(x, y, w)
    nodes = list(gm.graph.nodes)
    roofline = {"flops_per_s": 1e30, "bytes_per_s": 1.0}  # seconds = bytes
    kernels = phase_kernels([nodes], nodes)
    fused = [k for k in kernels if not k.extern]
    assert len(fused) == 1 and len(kernels) == 2, kernels
    assert kernel_seconds(fused[0], roofline) == 4 * (64 * 32 * 3 + 64), fused[0]  # x, y; exp, sum
    op_by_op = sum(node_cost(n, roofline).seconds for k in fused for n in k.nodes)
    assert op_by_op == 4 * (64 * 32 * 8 + 64)  # mul, exp, add: 2 + 2 + 3 passes, the sum's 1 and 64
    matmul = next(k for k in kernels if k.extern)
    assert kernel_seconds(matmul, roofline) == node_cost(matmul.nodes[0], roofline).seconds


def test_the_cuda_roofline_is_the_devices_own_where_its_name_is_known():
    from recompile_opt.options import CUDA_DEVICES, CUDA_REACHED, DEFAULT_ROOFLINE, Options, parse_options

    h200 = Options().roofline_for("cuda", "NVIDIA H200")
    assert h200["bytes_per_s"] == CUDA_DEVICES["H200"][1] * CUDA_REACHED["bytes_per_s"]
    assert h200["link_bytes_per_s"] == DEFAULT_ROOFLINE["cuda"]["link_bytes_per_s"]  # not per device
    # the longest name that matches: a GH200 is not an H200, an H100 PCIe not an SXM H100
    assert Options().roofline_for("cuda", "NVIDIA GH200 480GB")["bytes_per_s"] == 4.0e12 * 0.8
    assert Options().roofline_for("cuda", "NVIDIA H100 PCIe")["flops_per_s"] == 756e12 * 0.6
    assert Options().roofline_for("cuda", "NVIDIA H100 80GB HBM3")["bytes_per_s"] == 3.35e12 * 0.8
    assert Options().roofline_for("cuda", "Some Future GPU") == DEFAULT_ROOFLINE["cuda"]
    # a whole word only: an RTX A1000 is no A100; a 40 GB PCIe A100 has its own bandwidth
    assert Options().roofline_for("cuda", "NVIDIA RTX A1000") == DEFAULT_ROOFLINE["cuda"]
    assert Options().roofline_for("cuda", "NVIDIA A100-PCIE-40GB")["bytes_per_s"] == 1.555e12 * 0.8
    assert Options().roofline_for("cuda", "NVIDIA A100-SXM4-80GB")["bytes_per_s"] == 2.0e12 * 0.8
    assert Options().roofline_for("cpu", "NVIDIA H200") == DEFAULT_ROOFLINE["cpu"]
    mine = parse_options({"roofline": {"bytes_per_s": 1e12}}).roofline_for("cuda", "NVIDIA H200")
    assert mine["bytes_per_s"] == 1e12 and mine["flops_per_s"] == h200["flops_per_s"]  # the option wins


def test_a_cuda_plan_names_the_roofline_that_priced_it(monkeypatch):
    import torch

    from recompile_opt.options import Options, parse_options
    from recompile_opt.planning import roofline_notes

    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H200")
    cuda = torch.device("cuda", 0)
    assert roofline_notes(Options(), cuda) == [
        "cost model: NVIDIA H200, its own roofline: 593 TFLOP/s, 3.84 TB/s"
    ]
    mine = roofline_notes(parse_options({"roofline": {"bytes_per_s": 1e12}}), cuda)[0]
    assert mine.endswith("1.00 TB/s (option roofline sets ['bytes_per_s'])"), mine
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "Some Future GPU")
    assert "generic CUDA" in roofline_notes(Options(), cuda)[0]
    assert roofline_notes(Options(), torch.device("cpu")) == []
