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
PAPER_OVERHEAD = {("175B", "selective"): (0.027, 1), ("530B", "selective"): (0.016, 1),
                  **{(m, "full"): (1 / 3, 3) for m in MODELS}}


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

