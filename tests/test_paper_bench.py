"""``bench/paper.py`` against Korthikanti et al. 2022, with the paper's numbers written out here.

Per layer (s=2048, b=1, 16-bit activations, t=1), Table 2: no recompute sbh(34 + 5as/h), selective
34sbh, full 2sbh; ours within 0.25%, as README and docs/paper.md say (the largest gap is 22B's no
recompute, 0.24%: the kept causal mask and LayerNorm statistics). Appendix A: a forward is
24bsh^2 + 4bs^2h. Sec. 5 / App. A: selective recompute costs 2.7% (GPT-3 175B) and 1.6% (MT-NLG
530B) = the attention core's 4bs^2h over one forward; full recompute 33% = one forward over forward +
backward. Within 0.2 percentage points.
"""

import contextlib
import importlib.util
import io
import json
from pathlib import Path

import pytest

S, B = 2048, 1
MODELS = {"22B": (6144, 64), "175B": (12288, 96), "530B": (20480, 128), "1T": (25600, 160)}
PP = 0.002  # 0.2 percentage points
BYTES_REL = 0.0025  # the claimed 0.25%


def table_2(strategy, h, a):
    sbh = S * B * h
    return {"none": sbh * (34 + 5 * a * S / h), "selective": 34 * sbh, "full": 2 * sbh}[strategy]


def forward_flops(h):
    return 24 * B * S * h * h + 4 * B * S * S * h


# (model, strategy) -> (the paper's overhead, its basis as a multiple of one forward)
PAPER_OVERHEAD = {
    ("175B", "selective"): (0.027, 1),
    ("530B", "selective"): (0.016, 1),
    **{(m, "full"): (1 / 3, 3) for m in MODELS},
}


@pytest.fixture(scope="module")
def rows():
    path = Path(__file__).resolve().parents[1] / "bench" / "paper.py"
    spec = importlib.util.spec_from_file_location("bench_paper", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert bench.main(["--json", "--models", ",".join(MODELS)]) == 0
    return {(r["model"], r["strategy"]): r for r in json.loads(out.getvalue())}


@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize("strategy", ["none", "selective", "full"])
def test_kept_bytes_match_table_2(rows, model, strategy):
    r = rows[model, strategy]
    assert r["plan_bytes"] == pytest.approx(table_2(strategy, *MODELS[model]), rel=BYTES_REL), r


@pytest.mark.parametrize("model", MODELS)
def test_ilp_keeps_within_selectives_bytes_and_no_more_recompute(rows, model):
    ilp, sel = rows[model, "ilp-selective-budget"], rows[model, "selective"]
    assert ilp["plan_bytes"] <= sel["plan_bytes"]
    assert ilp["recompute_flops"] <= sel["recompute_flops"]


@pytest.mark.parametrize("model", MODELS)
def test_forward_flops_match_appendix_a(rows, model):
    for strategy in ("none", "selective", "full"):
        assert rows[model, strategy]["forward_flops"] == forward_flops(MODELS[model][0])


@pytest.mark.parametrize("key", sorted(PAPER_OVERHEAD))
def test_megatrons_rerun_costs_what_the_paper_says(rows, key):
    # what Megatron re-executes (core 4bs^2h / whole forward), counted by our FLOP counter
    paper, basis = PAPER_OVERHEAD[key]
    h = MODELS[key[0]][0]
    assert abs(rows[key]["megatron_recompute_flops"] / (basis * forward_flops(h)) - paper) <= PP


@pytest.mark.parametrize("model", MODELS)
def test_plans_recompute_only_what_backward_reads(rows, model):
    h = MODELS[model][0]
    # selective: QK^T only (2bs^2h), not attention-over-V, whose output is kept for the out-projection
    assert rows[model, "selective"]["recompute_flops"] == 2 * B * S * S * h
    # full: the forward but the MLP's second linear (8bsh^2), whose output no backward op reads
    assert rows[model, "full"]["recompute_flops"] == forward_flops(h) - 8 * B * S * h * h


# -- tensor and sequence parallelism: Table 2 per rank (bench/paper.py --tp) -------------------------

T = 8


def table_2_per_rank(strategy, h, a, sp, t=T):
    """Korthikanti et al. Table 2, per rank: TP sbh(10 + 24/t + 5as/(ht)), TP+SP sbh(34/t + 5as/(ht));
    selective recompute drops the 5as/(ht) term."""
    sbh = S * B * h
    core = 5 * a * S * S * B / t if strategy == "none" else 0
    return (34 * sbh / t if sp else sbh * (10 + 24 / t)) + core


@pytest.fixture(scope="module")
def tp_rows():
    """22B and 175B at t = 8, in a process of its own (the bench starts a fake process group)."""
    import subprocess
    import sys

    path = Path(__file__).resolve().parents[1] / "bench" / "paper.py"
    out = subprocess.run(
        [sys.executable, str(path), "--tp", str(T), "--models", "22B,175B", "--json"],
        capture_output=True,
        text=True,
        timeout=1500,
        check=True,
    ).stdout
    return {(r["model"], r["sp"], r["strategy"]): r for r in json.loads(out)}


@pytest.mark.slow
@pytest.mark.parametrize("sp", [False, True], ids=["tp", "tp+sp"])
@pytest.mark.parametrize("strategy", ["none", "selective"])
@pytest.mark.parametrize("model", ["22B", "175B"])
def test_per_rank_bytes_match_table_2(tp_rows, model, strategy, sp):
    """Per-rank kept bytes within 3% of the paper's TP and TP+SP rows (no recompute, selective)."""
    h, a = MODELS[model]
    r = tp_rows[(model, sp, strategy)]
    assert r["plan_bytes"] == pytest.approx(table_2_per_rank(strategy, h, a, sp), rel=0.03)


@pytest.mark.slow
@pytest.mark.parametrize("model", ["22B", "175B"])
def test_tensor_parallel_sends_four_all_reduces_per_layer(tp_rows, model):
    """TP without recompute: two all-reduces in the forward, two in the backward, each of the layer's
    [s, b, h] 16-bit activations, a ring sending 2(t-1)/t of it (Megatron's communication per layer)."""
    h, _ = MODELS[model]
    assert tp_rows[(model, False, "none")]["sent_bytes"] == 4 * 2 * (T - 1) * (2 * S * B * h) // T


@pytest.mark.slow
@pytest.mark.parametrize("model", ["22B", "175B"])
def test_the_ilp_at_selectives_bytes_recomputes_only_the_attention_core(tp_rows, model):
    """TP+SP, the ILP at 1.01 x 34sbh/t: it finds Megatron's selective recompute by itself, keeping no
    s x s tensor (the rank's slice of the attention dropout mask included: under Inductor's RNG its
    recompute draws only the rank's heads) and recomputing matmuls of the attention core only."""
    h, _ = MODELS[model]
    r = tp_rows[(model, True, "ilp")]
    assert r["plan_bytes"] <= 1.01 * 34 * S * B * h / T
    assert r["s2_kept_bytes"] == 0, r
    assert r["recomputed_modules"] == ["block.attn"], r


@pytest.mark.slow
@pytest.mark.parametrize("sp", [False, True], ids=["tp", "tp+sp"])
def test_full_recompute_keeps_no_attention_sized_tensor(tp_rows, sp):
    """``full`` keeps a layer's boundaries, never the attention dropout mask (a cast of it that only
    the backward reads once made the mask look like the block's output)."""
    assert tp_rows[("22B", sp, "full")]["s2_kept_bytes"] == 0
