"""The Plan a compiled graph gets: built through the real pipeline (``make_plan`` on a hand-built
Problem, ILP included), round-tripped through JSON, printed and diffed.

The problem is one MLP block, y = dropout(relu(x @ w1)) @ w2, in exact units: x is 512x512 fp32
(1 MiB), the hidden activations 512x2048 fp32 (4 MiB), the weights are parameters (free). Saving is
free, so the budget alone decides:

    value      op              bytes  recompute  read by the backward at step
    primals_1  x (input)       1 MiB  -          2
    primals_2  w1 (param)      0      -          2
    primals_3  w2 (param)      0      -          0
    mm         x @ w1          4 MiB  10 us      (only to recompute relu)
    relu       relu(mm)        4 MiB  1 us       1
    t          relu.t() view   -      0.1 us     1
    dropout    dropout(relu)   4 MiB  1 us       0   (random: recomputing keeps a 16 B RNG state)
    mm_1       dropout @ w2    1 MiB  10 us      never

Save-all keeps x + relu (shared by t) + dropout = 9 MiB; so does the fastest plan (no budget,
``mip_gap=0``). The step is 100 us, so with no budget and the default gap (1%) dropout's 1 us of
recompute is within the gap: that plan replays it and keeps 5 MiB + 16 B. Under 6 MiB the cheapest plan
recomputes dropout (kept 5 MiB + 16 B); under 5 MiB that no longer fits and mm, relu and t are
recomputed instead.
"""

from __future__ import annotations

import dataclasses
import json
import re
import warnings

import pytest

from recompile_opt.options import parse_options
from recompile_opt.plan import KEEP, RECOMPUTE, Plan, PlanEntry, fmt_bytes, fmt_type
from recompile_opt.planner.problem import Problem, Value
from recompile_opt.planner.search import InfeasibleBudget, make_plan

MiB = 1 << 20
US = 1e-6
RNG = 16
MLP = "blocks.0.mlp"


def info(op, shape, module=MLP):
    return {"op": op, "shape": shape, "dtype": "float32", "module": module, "source": "model.py:12"}


def mlp_problem(**tags) -> Problem:
    def v(name, storage, op, shape, **kw):
        return Value(name, storage, tag=tags.get(name), info=info(op, shape, kw.pop("module", MLP)), **kw)

    values = [
        v(
            "primals_1",
            "primals_1",
            "input",
            [512, 512],
            needed=True,
            can_recompute=False,
            last_use=2,
            module="",
        ),
        v(
            "primals_2",
            "primals_2",
            "input",
            [512, 2048],
            needed=True,
            can_recompute=False,
            last_use=2,
            module="",
        ),
        v(
            "primals_3",
            "primals_3",
            "input",
            [2048, 512],
            needed=True,
            can_recompute=False,
            last_use=0,
            module="",
        ),
        v(
            "mm",
            "mm",
            "mm",
            [512, 2048],
            inputs=("primals_1", "primals_2"),
            recompute_s=10 * US,
            flops=2 * 512 * 512 * 2048,
            last_use=1,
        ),
        v(
            "relu",
            "relu",
            "relu",
            [512, 2048],
            inputs=("mm",),
            needed=True,
            recompute_s=1 * US,
            flops=512 * 2048,
            last_use=1,
        ),
        v(
            "t",
            "relu",
            "t",
            [2048, 512],
            inputs=("relu",),
            needed=True,
            recompute_s=0.0,  # a view
            last_use=1,
        ),
        v(
            "dropout",
            "dropout",
            "native_dropout",
            [512, 2048],
            inputs=("relu",),
            needed=True,
            random=True,
            recompute_s=1 * US,
            flops=512 * 2048,
            last_use=0,
        ),
        v(
            "mm_1",
            "mm_1",
            "mm",
            [512, 512],
            inputs=("dropout", "primals_3"),
            recompute_s=10 * US,
            flops=2 * 512 * 512 * 2048,
            last_use=4,
        ),
    ]
    storage_bytes = {
        "primals_1": MiB,
        "primals_2": 0,
        "primals_3": 0,
        "mm": 4 * MiB,
        "relu": 4 * MiB,
        "dropout": 4 * MiB,
        "mm_1": MiB,
    }
    return Problem(
        values={x.name: x for x in values},
        storage_bytes=storage_bytes,
        save_s={s: 0.0 for s in storage_bytes},
        rng_state_bytes=RNG,
        bwd_steps=4,
        step_s=100 * US,
    )


def plan_for(problem=None, **options) -> Plan:
    return make_plan(problem or mlp_problem(), parse_options(options), graph="g0")


@pytest.fixture(scope="module")
def plans() -> dict[str, Plan]:
    return {
        "none": plan_for(mip_gap=0.0),
        "lean": plan_for(),
        "6MiB": plan_for(memory_budget="6MiB"),
        "5MiB": plan_for(memory_budget="5MiB"),
        "0.0": plan_for(memory_budget=0.0),
    }


# -- the plans themselves --------------------------------------------------------------------------


def test_the_fastest_plan_keeps_what_eager_keeps(plans):
    p = plans["none"]
    # eager keeps relu and its view t; a compiled backward must not get two kept tensors of one
    # storage (Inductor may write over one while the other is still to be read): t is recomputed
    # from relu, free, for the same bytes
    assert p.saved_names() == {"primals_1", "primals_2", "primals_3", "relu", "dropout"}
    assert [(e.name, e.flops) for e in p.recomputed] == [("t", 0)]
    assert p.saved_bytes == p.baseline_bytes == 9 * MiB
    assert p.budget_bytes is None and p.min_bytes is None
    assert p.solver["name"] == "highs" and p.solver["status"] == "optimal"
    # planned without graphs to simulate: no peak is claimed (the backend fills it in)
    assert p.predicted_peak_bytes == 0 and "not simulated" in str(p)


def test_no_budget_recomputes_what_costs_no_more_than_the_solvers_gap_of_the_step(plans):
    p = plans["lean"]
    assert p.budget_bytes is None
    assert p.recomputed_names() == {"dropout", "t"}  # 1 us of a 100 us step: within mip_gap (1%)
    assert p.saved_bytes == 5 * MiB + RNG
    assert p.recompute_s == pytest.approx(1 * US)


def test_budget_6mib_recomputes_dropout_with_its_rng_state(plans):
    p = plans["6MiB"]
    assert p.budget_bytes == 6 * MiB
    assert p.recomputed_names() == {"dropout", "t"}  # t: a view of the kept relu (see above)
    assert p.saved_names() == {"primals_1", "primals_2", "primals_3", "relu", "dropout.rng_state"}
    assert p.saved_bytes == 5 * MiB + RNG
    rng = next(e for e in p.saved if e.name == "dropout.rng_state")
    assert (rng.op, rng.action, rng.reason, rng.bytes) == ("rng_state", KEEP, "rng", RNG)
    assert p.recompute_flops == 512 * 2048
    assert p.recompute_s == pytest.approx(1 * US)
    assert p.recompute_share == pytest.approx(0.01)


def test_budget_5mib_recomputes_the_block_instead(plans):
    p = plans["5MiB"]
    assert p.recomputed_names() == {"mm", "relu", "t"}
    assert p.saved_names() == {"primals_1", "primals_2", "primals_3", "dropout"}
    assert p.saved_bytes == 5 * MiB
    assert p.recompute_flops == 2 * 512 * 512 * 2048 + 512 * 2048
    assert p.recompute_s == pytest.approx(11 * US)


def test_fraction_zero_is_the_least_possible(plans):
    p = plans["0.0"]
    assert p.min_bytes == MiB + RNG  # x, and the RNG state to replay dropout
    assert p.budget_bytes == p.saved_bytes == MiB + RNG
    assert p.recomputed_names() == {"mm", "relu", "t", "dropout"}


def test_entries_describe_each_value(plans):
    p = plans["6MiB"]
    kept = {e.name: e for e in p.saved}
    assert (kept["primals_1"].reason, kept["primals_1"].bytes) == ("input", MiB)
    assert (kept["primals_2"].reason, kept["primals_2"].bytes) == ("param", 0)
    assert (kept["relu"].reason, kept["relu"].bytes) == ("ilp", 4 * MiB)
    assert "t" not in kept  # a view of the kept relu: recomputed from it, free
    assert sum(e.bytes for e in p.saved) == p.saved_bytes
    recomputed = {e.name: e for e in p.recomputed}
    assert (recomputed["t"].flops, recomputed["t"].bytes) == (0, 0)
    d = recomputed["dropout"]
    assert (d.name, d.op, d.action, d.shape, d.dtype, d.module, d.source) == (
        "dropout",
        "native_dropout",
        RECOMPUTE,
        [512, 2048],
        "float32",
        MLP,
        "model.py:12",
    )
    assert d.flops == 512 * 2048 and d.recompute_s == pytest.approx(US) and d.bytes == 0


# -- JSON ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["none", "6MiB", "5MiB", "0.0"])
def test_json_round_trip(plans, name):
    p = plans[name]
    back = Plan.from_json(p.to_json())
    assert back == p
    for f in (
        "saved",
        "recomputed",
        "saved_bytes",
        "baseline_bytes",
        "min_bytes",
        "budget_bytes",
        "recompute_flops",
        "recompute_s",
        "predicted_peak_bytes",
        "solver",
        "notes",
        "options",
    ):
        assert getattr(back, f) == getattr(p, f), f
    assert all(isinstance(e, PlanEntry) for e in back.saved + back.recomputed)
    assert Plan.from_json(p.to_json(indent=None)) == p


def test_json_keys(plans):
    d = json.loads(plans["6MiB"].to_json())
    for key in (
        "saved",
        "recomputed",
        "saved_bytes",
        "baseline_bytes",
        "recompute_flops",
        "predicted_peak_bytes",
        "solver",
        "recompute_share",
        "graph",
        "policy",
        "notes",
    ):
        assert key in d, key
    entry_keys = {
        "name",
        "op",
        "action",
        "reason",
        "shape",
        "dtype",
        "bytes",
        "flops",
        "recompute_s",
        "module",
        "source",
    }
    assert d["saved"] and all(set(e) >= entry_keys for e in d["saved"])
    assert d["recomputed"] and all(set(e) >= entry_keys for e in d["recomputed"])
    relu = next(e for e in d["saved"] if e["name"] == "relu")
    assert relu == {
        "name": "relu",
        "op": "relu",
        "action": "keep",
        "reason": "ilp",
        "shape": [512, 2048],
        "dtype": "float32",
        "bytes": 4 * MiB,
        "flops": 0,
        "recompute_s": 0.0,
        "module": MLP,
        "source": "model.py:12",
    }
    drop = next(e for e in d["recomputed"] if e["name"] == "dropout")
    assert (drop["name"], drop["op"], drop["flops"]) == ("dropout", "native_dropout", 512 * 2048)
    assert (d["saved_bytes"], d["baseline_bytes"]) == (5 * MiB + RNG, 9 * MiB)
    assert (d["recompute_flops"], d["predicted_peak_bytes"]) == (512 * 2048, 0)
    assert d["solver"]["name"] == "highs" and d["solver"]["status"] == "optimal"
    assert {"solve_s", "gap", "n_vars", "n_constraints"} <= set(d["solver"])
    assert d["options"]["memory_budget"] == 6 * MiB


def test_from_json_ignores_unknown_keys(plans):
    d = json.loads(plans["5MiB"].to_json())
    d["added_by_a_later_version"] = 1
    assert Plan.from_json(json.dumps(d)) == plans["5MiB"]


# -- diff ------------------------------------------------------------------------------------------


def diff_rows(text: str) -> dict[str, tuple[str, str]]:
    rows = {}
    for line in text.splitlines()[1:]:
        m = re.match(r"^\s+(\S+)\s+(\S+) -> (\S+)", line)
        if m:
            rows[m.group(1)] = (m.group(2), m.group(3))
    return rows


def test_diff_lists_what_moves(plans):
    # peaks as a simulator would give them (a bare Problem is planned without one)
    a, b = (
        dataclasses.replace(plans[k], predicted_peak_bytes=m * MiB) for k, m in (("6MiB", 10), ("5MiB", 11))
    )
    text = a.diff(b)
    first = text.splitlines()[0]
    assert first == (
        "plan diff: kept 5.00 MiB -> 5.00 MiB, recompute 1.05 MFLOP -> 1.07 GFLOP, "
        "peak 10.00 MiB -> 11.00 MiB"
    )
    assert diff_rows(text) == {
        "relu": ("keep", "recompute"),
        "mm": ("-", "recompute"),
        "dropout": ("recompute", "keep"),
        "dropout.rng_state": ("keep", "-"),
    }
    assert "(same decisions)" not in text
    relu_line = next(line for line in text.splitlines() if line.strip().startswith("relu "))
    assert "relu" in relu_line and MLP in relu_line
    kept = next(e for e in plans["6MiB"].saved if e.name == "relu")  # the bytes it stops keeping
    assert kept.bytes > 0 and fmt_bytes(kept.bytes) in relu_line


def test_diff_from_save_all(plans):
    rows = diff_rows(plans["none"].diff(plans["6MiB"]))
    assert rows == {"dropout": ("keep", "recompute"), "dropout.rng_state": ("-", "keep")}


def test_diff_of_identical_plans(plans):
    for p in plans.values():
        text = p.diff(p)
        assert text.splitlines()[1:] == ["  (same decisions)"]
    # the ILP without a budget and with free saving decides what the save-all policy does
    text = plan_for(policy="save-all").diff(plans["none"])
    assert text.splitlines()[1:] == ["  (same decisions)"]


def other_graph_problem() -> Problem:
    """Another graph: x @ w1 -> relu -> gelu, relu and gelu read by the backward; it shares the names
    primals_1, primals_2, mm and relu with the MLP block, not dropout, t, mm_1 or primals_3."""

    def v(name, op, **kw):
        return Value(name, kw.pop("storage", name), info=info(op, [512, 2048]), **kw)

    values = [
        v("primals_1", "input", needed=True, can_recompute=False, last_use=1),
        v("primals_2", "input", needed=True, can_recompute=False, last_use=1),
        v(
            "mm",
            "mm",
            inputs=("primals_1", "primals_2"),
            recompute_s=10 * US,
            flops=2 * 512 * 512 * 2048,
            last_use=0,
        ),
        v("relu", "relu", inputs=("mm",), needed=True, recompute_s=1 * US, flops=512 * 2048, last_use=1),
        v("gelu", "gelu", inputs=("relu",), needed=True, recompute_s=1 * US, flops=512 * 2048, last_use=0),
    ]
    storage_bytes = {"primals_1": MiB, "primals_2": 0, "mm": 4 * MiB, "relu": 4 * MiB, "gelu": 4 * MiB}
    return Problem(
        values={x.name: x for x in values},
        storage_bytes=storage_bytes,
        save_s={s: 0.0 for s in storage_bytes},
        rng_state_bytes=RNG,
        bwd_steps=2,
        step_s=100 * US,
    )


def test_diff_across_graphs_says_so_and_matches_values_by_name(plans):
    other = make_plan(other_graph_problem(), parse_options({"memory_budget": "5MiB"}), graph="g1")
    assert other.saved_names() == {"primals_1", "primals_2", "relu"} and other.recomputed_names() == {"gelu"}
    text = plans["6MiB"].diff(other)
    lines = text.splitlines()
    assert lines[0] == (
        "plan diff: kept 5.00 MiB -> 5.00 MiB, recompute 1.05 MFLOP -> 1.05 MFLOP, peak 0 B -> 0 B"
    )
    assert lines[1] == "  note: different graphs (g0 and g1): values are matched by node name only"
    # primals_1, primals_2 and relu are kept in both: matched by name, not listed
    assert diff_rows(text) == {
        "dropout": ("recompute", "-"),
        "dropout.rng_state": ("keep", "-"),
        "gelu": ("-", "recompute"),
        "primals_3": ("keep", "-"),
        "t": ("recompute", "-"),
    }
    assert "(same decisions)" not in text
    # the same graph under another name is still said to be another graph, even with the same decisions
    renamed = dataclasses.replace(plans["6MiB"], graph="g2")
    assert plans["6MiB"].diff(renamed).splitlines()[1:] == [
        "  note: different graphs (g0 and g2): values are matched by node name only",
        "  (same decisions)",
    ]


# -- printing --------------------------------------------------------------------------------------


def table_sections(text: str) -> dict[str, list[str]]:
    sections, current = {}, None
    for line in text.splitlines():
        m = re.match(r"^(kept|recomputed) \((\d+)", line)
        if m:
            current = m.group(1)
            sections[current] = []
        elif current:
            sections[current].append(line)
    return sections


def names_in(lines: list[str]) -> list[str]:
    # columns: dtype[shape]  size  op  name  reason  module  source
    return [re.split(r"\s{1,}", line.split("]", 1)[1].strip())[3] for line in lines]


@pytest.mark.parametrize(
    "name, kept, recomputed",
    [
        ("none", ["primals_1", "relu", "dropout"], ["t"]),
        ("6MiB", ["primals_1", "relu", "dropout.rng_state"], ["t", "dropout"]),
        ("5MiB", ["primals_1", "dropout"], ["mm", "relu", "t"]),
    ],
)
def test_str_has_one_line_per_non_parameter_value(plans, name, kept, recomputed):
    p = plans[name]
    text = str(p)
    sections = table_sections(text)
    assert names_in(sections["kept"]) == kept
    assert names_in(sections["recomputed"]) == recomputed
    assert f"kept ({len(p.saved)}, of which 2 parameters and their views, free and not listed):" in text
    assert f"recomputed ({len(p.recomputed)}):" in text
    assert "primals_2" not in text and "primals_3" not in text


def test_str_summary_lines(plans):
    lines = str(plans["6MiB"]).splitlines()
    assert lines[0] == "recompile_opt plan  graph=g0  policy=auto  budget=6.00 MiB"
    assert lines[1] == "  kept for backward : 5.00 MiB of 9.00 MiB save-all (55.6%)"
    assert lines[2] == ("  recompute         : 1.05 MFLOP, est. 0.001 ms = 1.0% of the est. step (0.100 ms)")
    assert lines[3] == "  predicted peak    : not simulated (planned without its graphs)"
    simulated = str(dataclasses.replace(plans["6MiB"], predicted_peak_bytes=10 * MiB)).splitlines()
    assert simulated[3] == "  predicted peak    : 10.00 MiB above the pre-step baseline"
    assert re.fullmatch(
        r"  solver            : highs optimal in \d+\.\d\d s, gap <= 1\.00% \(\d+ vars, \d+ constraints\)"
        r" \(1 solve, \d+\.\d\d s summed; 0 plans simulated, 0\.00 s\)",
        lines[4],
    )
    assert lines[5].startswith("kept (")
    zero = str(plans["0.0"]).splitlines()
    assert zero[1] == "  kept for backward : 1.00 MiB of 9.00 MiB save-all (11.1%), least possible 1.00 MiB"


def test_str_line_columns(plans):
    sections = table_sections(str(plans["6MiB"]))
    relu = next(line for line in sections["kept"] if " relu " in line and "native" not in line)
    assert re.match(
        r"^\s+float32\[512x2048\]\s+4\.00 MiB\s+relu\s+relu\s+ilp\s+blocks\.0\.mlp\s+"
        r"model\.py:12$",
        relu,
    )
    drop = next(line for line in sections["recomputed"] if "native_dropout" in line)
    assert re.match(
        r"^\s+float32\[512x2048\]\s+1\.05 MFLOP\s+native_dropout\s+dropout\s+rng\s+"
        r"blocks\.0\.mlp\s+model\.py:12$",
        drop,
    )


def test_table_columns_align_across_both_sections(plans):
    """dtype[shape] and the size end, op, name and reason start, at the same place on every line, kept
    and recomputed alike (a long shape or op used to push the rest of its line right)."""
    sections = table_sections(str(plans["6MiB"]))
    lines = sections["kept"] + sections["recomputed"]
    # cells are two or more spaces apart; a cell holds at most single spaces ("1.00 MiB")
    cells = [[m.span() for m in re.finditer(r"\S+(?: \S+)*", line)] for line in lines]
    assert len({c[0][1] for c in cells}) == len({c[1][1] for c in cells}) == 1, lines
    assert all(len({c[i][0] for c in cells}) == 1 for i in (2, 3, 4)), lines


def test_fmt_type_of_a_scalar_and_of_a_non_tensor():
    assert fmt_type("int64", []) == "int64[]"  # a seed: was int64[-]
    assert fmt_type("float32", [4, 256, 64]) == "float32[4x256x64]"
    assert fmt_type("", []) == "-"


def test_repr_is_one_short_line(plans):
    p = plans["6MiB"]
    assert repr(p) == (
        "Plan(graph=g0, policy=auto, budget=6.00 MiB, kept 5.00 MiB of 9.00 MiB, recomputes 2 values "
        "(1.05 MFLOP, est. 0.001 ms), peak not simulated)"
    )
    assert str(p) == p.summary() + "\n" + p.table()  # print(plan) is still the whole table
    limited = dataclasses.replace(p, predicted_peak_bytes=10 * MiB, peak_limit_bytes=12 * MiB)
    assert repr(limited).endswith(
        "peak_memory=12.00 MiB, kept 5.00 MiB of 9.00 MiB, recomputes 2 values "
        "(1.05 MFLOP, est. 0.001 ms), peak 10.00 MiB)"
    )


def test_a_real_plans_repr_and_table():
    """Issue 26: ``print(recompile_opt.last_plans())`` printed ~15 KB of dataclass repr for the 2-layer
    demo GPT. Each plan is one line of at most 300 characters now; its table prints a 0-d value (a
    seed, a scalar) as ``dtype[]``, not ``dtype[-]``."""
    import torch

    import recompile_opt
    from recompile_opt.models import demo_gpt

    model, inputs = demo_gpt(n_layer=2, n_embd=64, seq=32, batch=2)
    plan = recompile_opt.plan(model, inputs, memory_budget="256KiB")
    text = repr(plan)
    assert "\n" not in text and len(text) <= 300, text
    assert text.startswith(f"Plan(graph={plan.graph}, policy=auto, budget=256.00 KiB, kept ")
    assert f"recomputes {len(plan.recomputed)} values" in text and "peak " in text
    assert len(repr([plan, plan])) <= 2 * 300 + 4
    scalars = [e for e in plan.saved + plan.recomputed if e.dtype and not e.shape and e.reason != "param"]
    assert scalars, "the demo GPT's plan has no 0-d value to print"
    table = plan.table()
    for e in scalars:
        assert re.search(rf"\s{e.dtype}\[\]\s.*\s{re.escape(e.name)}\s", table), e.name
    assert "[-]" not in table
    torch._dynamo.reset()


class _Encoder:  # built lazily (torch.nn): a torch-library model, nothing of its own but the call
    @staticmethod
    def build():
        import torch

        class Encoder(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.layer = torch.nn.TransformerEncoderLayer(32, 4, 64, batch_first=True)

            def forward(self, x):
                return self.layer(x).sum()  # the one line every op has

        return Encoder(), Encoder.forward.__code__.co_firstlineno + 1  # the line after the def


def test_a_torch_library_models_sources_tell_its_ops_apart():
    """Issue 26: every op of nn.TransformerEncoderLayer had the user's one forward line as its source
    (Dynamo drops torch.nn.modules frames). After that line comes the torch function each op came from;
    a user module's own lines stay as they are."""
    import torch

    import recompile_opt
    from recompile_opt.models import demo_gpt

    torch.manual_seed(0)
    model, line = _Encoder.build()
    plan = recompile_opt.plan(model, (torch.randn(2, 8, 32),))
    at = f"test_plan.py:{line}"
    expected = {
        "layer.self_attn": f"{at} (multi_head_attention_forward)",
        "layer.norm1": f"{at} (layer_norm)",
        "layer.norm2": f"{at} (layer_norm)",
        "layer.linear1": f"{at} (linear)",
        "layer.dropout1": f"{at} (dropout)",
        "layer.dropout": f"{at} (dropout)",
    }
    entries = [e for e in plan.saved + plan.recomputed if e.reason not in ("param", "input")]
    seen = {e.module: e.source for e in entries if e.module in expected}
    assert seen == {m: expected[m] for m in seen} and len(seen) >= 5, str(plan)
    assert {e.source for e in entries if e.op == "le" and e.module == "layer"} == {f"{at} (relu)"}, str(plan)
    assert len({e.source for e in entries}) >= 5

    gpt, inputs = demo_gpt(n_layer=1, n_embd=64, seq=32, batch=2)
    gpt_plan = recompile_opt.plan(gpt, inputs)
    attn = [
        e for e in gpt_plan.saved + gpt_plan.recomputed if e.module == "blocks.0.attn"
    ]  # ours, not torch's
    assert attn and all(re.fullmatch(r"models\.py:\d+", e.source) for e in attn), attn
    torch._dynamo.reset()


# -- tags, notes and limits through the pipeline ---------------------------------------------------


def test_prefer_save_overridden_is_noted():
    p = plan_for(mlp_problem(relu="prefer_save"), memory_budget="5MiB")
    assert "relu" in p.recomputed_names()
    relu = next(e for e in p.recomputed if e.name == "relu")
    assert relu.reason == "user"
    assert "relu: PREFER_SAVE overridden, the budget forces a recompute" in p.notes
    assert "  note: relu: PREFER_SAVE overridden, the budget forces a recompute" in str(p)
    assert Plan.from_json(p.to_json()) == p


def test_must_save_changes_the_plan():
    p = plan_for(mlp_problem(dropout="must_save"), memory_budget="6MiB")
    assert p.recomputed_names() == {"mm", "relu", "t"}  # as under 5 MiB: dropout may not be recomputed
    assert next(e for e in p.saved if e.name == "dropout").reason == "user"


def test_infeasible_budget_strict_raises():
    with pytest.raises(InfeasibleBudget, match="below the least any plan can keep"):
        plan_for(memory_budget=MiB, strict=True)


def test_infeasible_budget_falls_back_to_the_least_memory_plan():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        p = plan_for(memory_budget=MiB)
    assert any("below the least any plan can keep" in str(w.message) for w in caught)
    assert p.saved_bytes == p.min_bytes == MiB + RNG
    assert any("using the least-memory plan" in n for n in p.notes)
    assert Plan.from_json(p.to_json()) == p


def test_a_peak_limit_needs_a_simulator():
    """The ILP has no peak rows: a peak is known only by simulating the partitioned graphs, so planning a
    bare Problem under peak_memory is refused rather than answered with an unchecked plan."""
    with pytest.raises(ValueError, match="peak_memory needs plans simulated"):
        plan_for(peak_memory="8MiB")


def test_the_peak_line_always_gives_the_pooled_share(plans):
    """Issue 48: the share of the peak that Inductor's pool holds (dead buffers kept for a later
    allocation) is printed, also where it is none (the pool off at the peak goals)."""
    p = plans["6MiB"]
    at = {"phase": "backward", "kernel": 3, "kernels": 10, "kernel_ops": ["bmm"], "total": 4 * MiB}
    held = dataclasses.replace(
        p, walked_breakdown={**at, "bytes": {"kept": 2 * MiB, "pooled": MiB, "temporaries": MiB}}
    )
    line = next(line for line in held.summary().splitlines() if "at the peak" in line)
    assert line.endswith("walked: kept 2.00 MiB, temporaries 1.00 MiB; pooled 1.00 MiB (25.0% of the peak)")
    none = dataclasses.replace(p, walked_breakdown={**at, "bytes": {"kept": 3 * MiB, "temporaries": MiB}})
    assert "; pooled 0 B (0.0% of the peak)" in none.summary()
