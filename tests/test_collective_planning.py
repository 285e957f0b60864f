"""The planner's view of collectives (issue 22, step 8), on hand-built graphs and problems: a ``wait_tensor``
aliases its collective's buffer, each collective is priced by the bytes a rank sends, only an
all-gather may run again in the backward, and the plans say which were gathered again and what a step
sends. The multi-rank runs of the same planner are in test_parallel_rewrite.py."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.fx as fx
from test_ilp import MiB, inp, op, problem

from recompile_opt.costs.cost_model import base_of, collective_bytes, node_cost
from recompile_opt.ops import is_view_node
from recompile_opt.options import DEFAULT_ROOFLINE, Options
from recompile_opt.plan import Plan
from recompile_opt.planner import ilp
from recompile_opt.planner.policies import POLICIES, regathers
from recompile_opt.planner.search import make_plan

c10d = torch.ops._c10d_functional


def _graph():
    """x [4, 8] fp32 on a group of 4: all-gather -> wait, reduce-scatter, all-reduce."""
    g = fx.Graph()
    x = g.placeholder("x")
    x.meta["val"] = torch.empty(4, 8)
    nodes = {"x": x}
    for name, target, args, shape in (
        ("ag", c10d.all_gather_into_tensor.default, (x, 4, "0"), (16, 8)),
        ("rs", c10d.reduce_scatter_tensor.default, (x, "sum", 4, "0"), (1, 8)),
        ("ar", c10d.all_reduce.default, (x, "sum", "0"), (4, 8)),
    ):
        n = g.call_function(target, args)
        n.meta["val"] = torch.empty(shape)
        nodes[name] = n
    wait = g.call_function(c10d.wait_tensor.default, (nodes["ag"],))
    wait.meta["val"] = torch.empty(16, 8)
    nodes["wait"] = wait
    return nodes


def test_a_wait_is_its_collectives_buffer():
    nodes = _graph()
    assert is_view_node(nodes["wait"]) and base_of(nodes["wait"]) is nodes["ag"]
    assert not is_view_node(nodes["ag"])


def test_collectives_cost_the_bytes_a_rank_sends():
    """Ring collectives over t = 4 ranks of a [4, 8] fp32 tensor (128 bytes): an all-gather sends 3/4 of
    its [16, 8] output, a reduce-scatter 3/4 of its input, an all-reduce twice (t-1)/t of its tensor
    (no process group here: the group's size defaults to 2)."""
    nodes = _graph()
    assert collective_bytes(nodes["ag"]) == 3 * 512 // 4
    assert collective_bytes(nodes["rs"]) == 3 * 128 // 4
    assert collective_bytes(nodes["ar"]) == 2 * 128 // 2
    assert collective_bytes(nodes["wait"]) == 0
    roofline = DEFAULT_ROOFLINE["cpu"]
    cost = node_cost(nodes["ag"], roofline)
    assert cost.flops == 0
    assert cost.seconds == roofline["collective_latency_s"] + 384 / roofline["link_bytes_per_s"]


def _sequence_parallel_block(gather_us: float = 50):
    """A rank's norm output shard (1 MiB) all-gathered (2 MiB; its raw output cannot be kept, its wait
    is a view of it), re-laid out by a cat (2 MiB) that the backward reads for the weight gradient."""
    return problem(
        inp("x", 1),
        op("ln", ["x"], 1, 1, needed=False),
        op(
            "ag",
            ["ln"],
            2,
            gather_us,
            needed=False,
            can_save=False,
            info={"op": "c10d.all_gather_into_tensor"},
        ),
        op("wait", ["ag"], 0, 0, needed=False, storage="ag", info={"op": "c10d.wait_tensor"}),
        op("cat", ["wait"], 2, 1, info={"op": "cat"}),
        op("mm", ["cat"], 2, 100, needed=False, flops=10**6, info={"op": "mm"}),
    )


def test_save_all_keeps_the_shard_and_gathers_again():
    """Megatron's no-recompute layout: the gathered value is kept as the rank's shard (1 MiB, not 2)."""
    p = _sequence_parallel_block()
    assert regathers(p) == {"ag", "wait", "cat"}
    saved, recomputed = p.needed_closure(POLICIES["save-all"](p))
    assert saved == {"ln"} and recomputed == {"ag", "wait", "cat"}
    assert p.kept_bytes(saved, recomputed) == 1 * MiB
    assert POLICIES["megatron-selective"](p) == {"ag", "wait", "cat"}


def test_the_ilp_gathers_again_only_when_the_budget_needs_it():
    """Unlimited, keeping the gathered value (free to save here) beats a 50 us re-gather; at 1 MiB only
    the re-gather fits."""
    p = _sequence_parallel_block()
    unlimited = ilp.solve(p, budget=None)
    assert "ag" not in unlimited.recompute and p.needed_closure(unlimited.recompute, unlimited.keep)[0] == {
        "cat"
    }
    tight = ilp.solve(p, budget=1 * MiB)
    saved, recomputed = p.needed_closure(tight.recompute, tight.keep)
    assert saved == {"ln"} and {"ag", "wait", "cat"} <= recomputed


def test_the_plan_says_what_was_gathered_again_and_what_a_step_sends():
    p = _sequence_parallel_block()
    p.collectives = [
        {
            "name": "ag",
            "op": "c10d.all_gather_into_tensor",
            "phase": "forward",
            "bytes": 1 * MiB,
            "shape": [2, 8],
            "dtype": "float32",
        },
        {
            "name": "rs_bw",
            "op": "c10d.reduce_scatter_tensor",
            "phase": "backward",
            "bytes": 1 * MiB,
            "shape": [1, 8],
            "dtype": "float32",
        },
    ]
    plan = make_plan(p, Options(policy="save-all"))
    assert [c["regathered"] for c in plan.collectives] == [True, False]
    assert (
        plan.communication_bytes() == 3 * MiB
    )  # the forward gather, its re-gather, the backward's reduce-scatter
    text = str(plan)
    assert "communication     : 3.00 MiB sent per rank per step" in text
    assert "gathered again in the backward" in text
    assert Plan.from_json(plan.to_json()).collectives == plan.collectives


def test_a_gathered_size_is_read_off_what_made_it():
    """Under dynamic shapes the backward reads the size of the gathered logits; the size is rebuilt from
    the gather's input (2 ranks times its rows, through ``view(-1, n)`` and the matmul), and the
    gather, its wait and the matmul that only the size kept alive are gone (they were in neither
    the forward nor the backward, and the partition failed)."""
    from recompile_opt.passes.joint_graph import sizes_before_gathers

    g = fx.Graph()
    a, b = g.placeholder("a"), g.placeholder("b")
    a.meta["val"], b.meta["val"] = torch.empty(3, 4), torch.empty(4, 2)
    mm = g.call_function(torch.ops.aten.mm.default, (a, b))
    mm.meta["val"] = torch.empty(3, 2)
    flat = g.call_function(torch.ops.aten.view.default, (mm, [-1, 2]))
    flat.meta["val"] = torch.empty(3, 2)
    gathered = g.call_function(c10d.all_gather_into_tensor.default, (flat, 2, "0"))
    gathered.meta["val"] = torch.empty(6, 2)
    wait = g.call_function(c10d.wait_tensor.default, (gathered,))
    wait.meta["val"] = torch.empty(6, 2)
    rows = g.call_function(torch.ops.aten.sym_size.int, (gathered, 0))
    g.output(rows)
    gm = fx.GraphModule(torch.nn.Module(), g)
    assert sizes_before_gathers(gm) == 1
    targets = {n.target for n in gm.graph.nodes if n.op == "call_function"}
    assert not targets & {
        c10d.all_gather_into_tensor.default,
        c10d.wait_tensor.default,
        torch.ops.aten.mm.default,
    }
    gm.recompile()
    assert gm(torch.randn(3, 4), torch.randn(4, 2)) == 6


def test_under_sequence_parallelism_save_all_warns_of_nothing_and_selective_of_no_core():
    """Save-all's own re-gathers are no recompute a policy is warned of: counted as one, save-all warned
    that it kept no less than itself, and a graph without attention under megatron-selective was
    told it recomputed its "0 attention cores"."""
    p = _sequence_parallel_block()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        make_plan(p, Options(policy="save-all"))
    assert not [str(w.message) for w in caught if "recompile_opt" in str(w.message)]
    with pytest.warns(UserWarning, match="no attention core found.*nothing is recomputed"):
        make_plan(p, Options(policy="megatron-selective"))
