"""Offload (issue 50): the option, the ILP's third choice on hand-built problems, the plan's figures, and
the graphs torch's activation offloading rewrites, run on the CPU against eager.

Units as in test_ilp.py: bytes in whole MiB, times in whole microseconds, and the host link in MiB per
microsecond, so every expected figure is a small number one can check by hand.
"""

from __future__ import annotations

import ast
import dataclasses
import importlib.util

import pytest
import torch

from recompile_opt import _torch_internals as ti
from recompile_opt.options import OptionError, Options, parse_options
from recompile_opt.plan import OFFLOAD, Plan
from recompile_opt.planner import ilp
from recompile_opt.planner.problem import Problem, Value, exposed_seconds, offload_choice
from recompile_opt.planner.search import make_plan

KiB, MiB = 1 << 10, 1 << 20
US = 1e-6
LINK = MiB / US  # 1 MiB per µs


def value(name, mib, us, *, inputs=("x",), windows=None, tag=None):
    """A forward op of its own ``mib`` MiB buffer that the backward reads, recomputed in ``us`` µs;
    ``windows``: (forward µs after its last use, backward µs before its first use), None: not
    offloadable."""
    w = None if windows is None else (windows[0] * US, windows[1] * US)
    return Value(name, name, inputs=inputs, needed=True, recompute_s=us * US, offload_windows=w, tag=tag), mib


def problem(*entries, link=LINK) -> Problem:
    x = Value("x", "x", can_recompute=False)
    values, storage = {"x": x}, {"x": 0}
    for v, mib in entries:
        values[v.name], storage[v.name] = v, mib * MiB
    return Problem(
        values=values,
        storage_bytes=storage,
        save_s={s: 0.0 for s in storage},
        device="cuda",
        host_bytes_per_s=link,
        step_s=100 * US,
    )


# -- the ILP's choice ------------------------------------------------------------------------------


def test_a_copy_that_hides_is_offloaded_before_anything_is_recomputed():
    # keeping both is 8 MiB; at 4 MiB one must go: recomputing either costs 10 µs, offloading `a`
    # moves 4 MiB each way in 4 µs, inside its 8 µs windows: no stall
    p = problem(value("a", 4, 10, windows=(8, 8)), value("b", 4, 10, inputs=("a",)))
    sol = ilp.solve(p, budget=4 * MiB)
    assert sol.status == "optimal"
    assert sol.recompute == {offload_choice("a")}
    saved, recomputed = p.needed_closure(sol.recompute, sol.keep)
    assert saved == {"a", "b"} and p.kept_bytes(saved, recomputed) == 4 * MiB
    assert p.offload_figures(saved, recomputed)["exposed_s"] == 0.0


def test_a_link_too_slow_to_hide_the_copy_makes_recompute_win():
    # the same problem over a link of 1/4 MiB per µs: each copy takes 16 µs, its windows 1 µs, so
    # 2 x 15 µs exposed against a 10 µs recompute
    p = problem(value("a", 4, 10, windows=(1, 1)), value("b", 4, 10, inputs=("a",)), link=LINK / 4)
    sol = ilp.solve(p, budget=4 * MiB)
    saved, recomputed = p.needed_closure(sol.recompute, sol.keep)
    assert not any(n.startswith("offload:") for n in recomputed)
    assert recomputed & {"a", "b"} and p.kept_bytes(saved, recomputed) <= 4 * MiB
    # with windows long enough for 16 µs the same slow link hides it again
    p = problem(value("a", 4, 10, windows=(16, 16)), value("b", 4, 10, inputs=("a",)), link=LINK / 4)
    assert ilp.solve(p, budget=4 * MiB).recompute == {offload_choice("a")}


def test_the_windows_share_the_link():
    # two 4 MiB values whose copies each fit their 5 µs windows alone, but not together: 8 µs of copies
    # in 5 µs stalls 3 µs each way (6 µs), cheaper than a 10 µs recompute, dearer than a 5 µs one
    for us, offloads, seconds in ((10, 2, 6 * US), (5, 1, 5 * US)):
        p = problem(value("a", 4, us, windows=(5, 5)), value("b", 4, us, inputs=("a",), windows=(5, 5)))
        sol = ilp.solve(p, budget=0)
        saved, recomputed = p.needed_closure(sol.recompute, sol.keep)
        assert len([n for n in recomputed if n.startswith("offload:")]) == offloads, us
        assert p.kept_bytes(saved, recomputed) == 0
        assert ilp.plan_seconds(p, saved, recomputed) == pytest.approx(seconds), us


def test_a_block_template_prices_each_blocks_copy_in_its_own_window():
    # a template standing for 2 blocks (planner/blocks.py): 8 MiB, 4 per block; the first block's copy
    # has 8 µs, the second's 1 µs. Each way: 4 MiB due in 1 µs stalls 3 µs, 8 MiB in 8 µs does not, so
    # 6 µs exposed in all. Its own window alone (8 µs) would have hidden everything.
    def template(us):
        v, _ = value("a", 8, us, windows=(8, 8))
        return dataclasses.replace(v, copies=2, member_windows=((8 * US, 8 * US), (1 * US, 1 * US)))

    p = problem((template(20), 8))
    assert p.copies_of("a", 0) == [(8 * US, 4 * MiB), (1 * US, 4 * MiB)]
    assert p.offload_figures({"a"}, {offload_choice("a")})["exposed_s"] == pytest.approx(6 * US)
    sol = ilp.solve(p, budget=0)  # 6 µs of stall against 20 µs of recompute: offloaded
    assert sol.recompute == {offload_choice("a")}
    assert ilp.plan_seconds(p, *p.needed_closure(sol.recompute, sol.keep)) == pytest.approx(6 * US)
    assert ilp.solve(problem((template(5), 8)), budget=0).recompute == {"a"}  # 5 µs: recomputed


def test_no_budget_offloads_nothing_and_views_keep_their_buffer_on_the_device():
    p = problem(value("a", 4, 10, windows=(8, 8)), value("b", 4, 10, inputs=("a",), windows=(8, 8)))
    assert ilp.solve(p, budget=None).recompute == set()  # an offload is never taken for free bytes
    # a kept view of `a` holds its buffer: offloading `a` then frees nothing
    view = Value("v", "a", inputs=("a",), needed=True, can_recompute=False)
    p = problem(value("a", 4, 10, windows=(8, 8)))
    p.values["v"] = view
    saved, recomputed = p.needed_closure({offload_choice("a")})
    assert p.kept_bytes(saved, recomputed) == 4 * MiB
    sol = ilp.solve(p, budget=0)
    assert sol.status == "infeasible"


def test_user_offload_tags():
    # MUST_CPU_OFFLOAD holds with no budget at all; PREFER_CPU_OFFLOAD holds unless the copy costs
    p = problem(value("a", 4, 10, windows=(8, 8), tag="must_cpu_offload"), value("b", 4, 10, inputs=("a",)))
    assert ilp.solve(p, budget=None).recompute == {offload_choice("a")}
    p = problem(value("a", 4, 10, windows=(8, 8), tag="prefer_cpu_offload"))
    assert ilp.solve(p, budget=None).recompute == {offload_choice("a")}
    # where offload is not offered (host_bytes_per_s 0: a CPU device), MUST_CPU_OFFLOAD keeps it
    p = dataclasses.replace(
        problem(value("a", 4, 10, windows=(8, 8), tag="must_cpu_offload")), host_bytes_per_s=0.0
    )
    assert ilp.solve(p, budget=0).status == "infeasible"


# -- the plan's figures ----------------------------------------------------------------------------


def test_exposed_seconds_by_hand():
    # 2 MiB due in 1 µs, then 4 more due in 8: the first stalls 1 µs, the link then catches up
    assert exposed_seconds([(8 * US, 4 * MiB), (1 * US, 2 * MiB)], LINK) == pytest.approx(1 * US)
    assert exposed_seconds([(8 * US, 4 * MiB)], LINK) == 0.0  # 4 µs of copy in 8: nothing exposed


def test_plan_figures_on_a_case_computed_by_hand():
    # a: 4 MiB, its copy out may overlap 8 µs of the forward, its copy back 2 µs of the backward;
    # c: 2 MiB, 1 µs and 20 µs. Over 1 MiB/µs: out, c alone is due in 1 µs (2 µs of copy: 1 exposed),
    # a and c in 8 (6 µs: hidden); back, a is due in 2 µs (4 µs: 2 exposed), both in 20 (6: hidden).
    p = problem(
        value("a", 4, 10, windows=(8, 2), tag="must_cpu_offload"),
        value("c", 2, 10, windows=(1, 20), tag="must_cpu_offload"),
    )
    plan = make_plan(p, Options(offload=LINK))
    assert {e.name for e in plan.saved if e.action == OFFLOAD} == {"a", "c"}
    assert plan.saved_bytes == 0 and plan.recomputed == []
    o = plan.offload
    assert o["values"] == 2 and o["bytes_to_host"] == o["bytes_to_device"] == 6 * MiB
    assert o["exposed_s"] == pytest.approx(3 * US) and o["hidden_s"] == pytest.approx(9 * US)
    assert [e["value"] for e in plan.offloaded] == ["a", "c"]
    assert plan.offloaded[0]["bytes"] == 4 * MiB and plan.offloaded[0]["forward_window_s"] == 8 * US
    text = str(plan)
    assert "offloaded         : 2 values, 6.00 MiB to the host and 6.00 MiB back" in text
    assert "0.009 ms hidden, 0.003 ms exposed" in text
    assert "offloaded (2; bytes: moved to the host and back each step):" in text
    again = Plan.from_json(plan.to_json())
    assert again.offload == o and again.offloaded == plan.offloaded
    assert {"offload:a", "offload:c"} <= again.recomputed_names()


def test_budgets_and_where_offload_does_not_apply():
    p = problem(value("a", 4, 10, windows=(8, 8)), value("b", 4, 10, inputs=("a",)))
    plan = make_plan(p, Options(offload=LINK, memory_budget=4 * MiB))
    assert plan.saved_bytes == 4 * MiB and plan.recomputed == [] and plan.offload["values"] == 1
    assert plan.offload["exposed_s"] == 0.0
    # offload off: recompute
    plan = make_plan(p, Options(memory_budget=4 * MiB))
    assert plan.recomputed and not plan.offloaded
    # a fixed policy never offloads by itself
    plan = make_plan(p, Options(offload=LINK, policy="save-all"))
    assert not plan.offloaded and any("fixed baseline" in n for n in plan.notes)
    # a CPU device: not offloaded, and the notes say why
    plan = make_plan(dataclasses.replace(p, device="cpu"), Options(offload=True, memory_budget=4 * MiB))
    assert not plan.offloaded and any("does not apply on a CPU device" in n for n in plan.notes)
    # a torch without the ops
    plan = make_plan(dataclasses.replace(p, offload_ops=False), Options(offload=True, memory_budget=4 * MiB))
    assert not plan.offloaded and any("no activation-offloading ops" in n for n in plan.notes)
    # a device where the emitted offload failed its check (CUDA: a NaN loss on the H200), unless asked
    unchecked = dataclasses.replace(p, offload_checked=False)
    plan = make_plan(unchecked, Options(offload=True, memory_budget=4 * MiB))
    assert not plan.offloaded and any("NaN loss" in n for n in plan.notes)
    plan = make_plan(unchecked, Options(offload=LINK, offload_unchecked=True, memory_budget=4 * MiB))
    assert plan.offload["values"] == 1


# -- the option ------------------------------------------------------------------------------------


def test_option_values():
    assert parse_options({}).offload is False
    assert parse_options({"offload": True}).offload is True
    assert parse_options({"offload": "25GB/s"}).offload == 25e9
    assert parse_options({"offload": "1GiB/s"}).offload == 2**30
    assert parse_options({"offload": 3e10}).offload == 3e10
    assert Options(offload=True).roofline_for("cuda")["host_bytes_per_s"] == 2.5e10
    assert (
        parse_options({"roofline": {"host_bytes_per_s": 1e9}}).roofline_for("cuda")["host_bytes_per_s"] == 1e9
    )


@pytest.mark.parametrize("bad", ["fast", "25GB", -1, 0, [1], "0GB/s", "2 parsecs/s", float("inf")])
def test_bad_option_values_raise_a_clear_error(bad):
    with pytest.raises(OptionError, match=r"option 'offload': got .*accepted values: False .*'25GB/s'"):
        parse_options({"offload": bad})


def test_offload_on_cpu_needs_offload():
    with pytest.raises(OptionError, match="offload_on_cpu"):
        parse_options({"offload_on_cpu": True})
    with pytest.raises(OptionError, match="offload_on_cpu"):
        parse_options({"offload_on_cpu": 1, "offload": True})


# -- the rewritten graphs, run on the CPU ----------------------------------------------------------
# A CPU device has no memory to relieve, so the option applies there only with ``offload_on_cpu``: the
# values are then copied host to host through torch's activation offloading (its ``device_put`` form),
# which is what these tests run and compare with eager.

ON_CPU = {"offload": "1GB/s", "offload_on_cpu": True, "memory_budget": "60KiB"}


def _gpt(dropout: float):
    from recompile_opt import models

    cfg = models.GPTConfig(n_layer=2, n_head=2, n_embd=32, block_size=16, vocab_size=64, dropout=dropout)
    torch.manual_seed(0)
    return models.GPT(cfg), models.example_batch(cfg, 2)


@pytest.mark.parametrize("dropout", [0.0, 0.1])
def test_offloaded_graphs_give_eager_gradients(dropout):
    from helpers import partitioned, train_side_by_side

    model, inputs = _gpt(dropout)
    options = {**ON_CPU, "compiler": "eager"}
    plan = train_side_by_side(model, inputs, options=options, rtol=1e-4, atol=1e-5)
    offloaded = {e.name for e in plan.saved if e.action == OFFLOAD}
    assert offloaded and plan.saved_bytes <= 60 * 1024
    assert plan.offload["bytes_to_host"] == sum(o["bytes"] for o in plan.offloaded) > 0
    # the graphs torch's pass rewrote: a copy to the host per offloaded value, a reload before its use
    part = partitioned(model, inputs, options)
    fw, bw = part.last_forward.graph, part.last_backward.graph
    copies = {n.name for n in fw.nodes if n.name.startswith("cpu_offload_")}
    reloads = {n.name for n in bw.nodes if n.name.startswith("gpu_reload_")}
    planned = {e.name for e in part.plans[-1].saved if e.action == OFFLOAD}
    assert copies == {"cpu_offload_" + n for n in planned} and reloads == {"gpu_reload_" + n for n in planned}
    # the peak model counts the host copies off the device and each reload where it is made
    assert all(n.meta.get("host_resident") for n in fw.nodes if n.name in copies)
    assert not any(n.meta.get("host_resident") for n in bw.nodes if n.name in reloads)


def test_a_deep_stack_with_offload_is_solved_as_block_groups():
    """Offered offload no longer makes a deep stack solve in full (the GPU GPT's ``peak_memory`` plan
    with offload outran 320 s of planning that way): each block of a group takes its template's
    choice, and the graphs still give eager's gradients."""
    from helpers import train_side_by_side

    from recompile_opt import models

    cfg = models.GPTConfig(n_layer=5, n_head=2, n_embd=32, block_size=16, vocab_size=64, dropout=0.1)
    torch.manual_seed(0)
    model, inputs = models.GPT(cfg), models.example_batch(cfg, 2)
    options = {**ON_CPU, "memory_budget": "120KiB", "compiler": "eager"}
    plan = train_side_by_side(model, inputs, options=options, rtol=1e-4, atol=1e-5)
    assert any("5 identical blocks solved as 4 groups" in n for n in plan.notes), plan.notes
    offloaded = {
        e.module.split(".")[1] for e in plan.saved if e.action == OFFLOAD and e.module.startswith("blocks.")
    }
    assert len(offloaded) >= 2, offloaded  # a template's offload given to more than one block
    assert plan.saved_bytes <= 120 * 1024 and plan.offload["bytes_to_host"] > 0


def test_a_cpu_device_plans_without_offload_and_says_so():
    import recompile_opt

    model, inputs = _gpt(0.0)
    plan = recompile_opt.plan(model, inputs, offload=True, memory_budget="60KiB", compiler="eager")
    assert not plan.offloaded and not any(e.action == OFFLOAD for e in plan.saved)
    assert any("offload: option 'offload' does not apply on a CPU device" in n for n in plan.notes)


def test_must_cpu_offload_tags_are_honoured():
    import functools

    from helpers import train_side_by_side
    from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

    def policy(ctx, op, *args, **kwargs):
        return (
            CheckpointPolicy.MUST_CPU_OFFLOAD
            if op == torch.ops.aten.sin.default
            else CheckpointPolicy.PREFER_SAVE
        )

    class Tagged(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = torch.nn.Linear(16, 64), torch.nn.Linear(64, 16)

        def forward(self, x):
            inner = lambda x: self.b(self.a(x).sin())  # noqa: E731
            ctx = functools.partial(create_selective_checkpoint_contexts, policy)
            return checkpoint(inner, x, use_reentrant=False, context_fn=ctx).pow(2).sum()

    torch.manual_seed(0)
    model, x = Tagged(), (torch.randn(8, 16),)
    # no budget: the tag alone asks for the offload (the options only let the CPU run it)
    opts = {"compiler": "eager", "offload": True, "offload_on_cpu": True}
    plan = train_side_by_side(model, x, options=opts, rtol=1e-4, atol=1e-5)
    assert [(e.op, e.reason) for e in plan.saved if e.action == OFFLOAD] == [("sin", "user")]
    # on a CPU device without the hook the tag keeps the value on the device, and the notes say so
    plan = train_side_by_side(model, x, options={"compiler": "eager"}, rtol=1e-4, atol=1e-5)
    assert not plan.offloaded and [e.op for e in plan.saved if e.op == "sin"] == ["sin"]
    assert any("CPU_OFFLOAD tags are kept on the device" in n for n in plan.notes)


@pytest.mark.slow
def test_offloaded_graphs_through_inductor():
    """Inductor compiles the host copies (``device_put``) and reloads; with ``fallback_random`` it draws
    dropout as eager does (random ops then kept, as in test_inductor.py), so the gradients compare."""
    from helpers import train_side_by_side

    model, inputs = _gpt(0.1)
    with torch._inductor.config.patch(fallback_random=True):
        plan = train_side_by_side(model, inputs, options=ON_CPU, rtol=1e-4, atol=1e-5)
    assert plan.offloaded and plan.saved_bytes <= 60 * 1024


# -- where the copies are placed on a stream of their own (CUDA) ---------------------------------------
# A copy's wait frees its device buffer, and a reload's issue allocates it: both are placed on the clock
# the ILP priced the copies on (passes/partition._place_copy_waits, _place_reloads). The graphs are
# hand-made here: a copy and a reload are clones, a wait reads the copy and the source.


def _wait(copy, source, after=None):
    return copy


def _graph(spec: list[tuple[str, object, tuple]], out: tuple[str, ...]) -> tuple[torch.fx.GraphModule, dict]:
    """A graph of ``(name, target, args)`` nodes (target None: a placeholder of 256 fp32 elements; args
    name earlier nodes), returning ``out``."""
    graph, nodes = torch.fx.Graph(), {}
    for name, target, args in spec:
        if target is None:
            nodes[name] = graph.placeholder(name)
        else:
            nodes[name] = graph.call_function(target, tuple(nodes[a] for a in args), name=name)
        nodes[name].meta["val"] = torch.empty(256)  # 1 KiB
    graph.output(tuple(nodes[o] for o in out))
    return torch.fx.GraphModule(torch.nn.Module(), graph), nodes


def _order(gm: torch.fx.GraphModule) -> list[str]:
    return [n.name for n in gm.graph.nodes if n.op not in ("placeholder", "output")]


@pytest.mark.parametrize(
    "kib_per_us, expected",
    [
        # a's copy: issued at 1 µs (a's end), done at 2; b's: issued at 2, done at 3
        (1, ["a", "copy_a", "b", "wait_a", "copy_b", "k1", "wait_b", "k2", "k3"]),
        # 2 µs each: a's done at 3; b's waits for the link until 3, done at 5
        (0.5, ["a", "copy_a", "b", "copy_b", "k1", "wait_a", "k2", "k3", "wait_b"]),
        # 4 µs each: a's done at 5; b's at 9, after the forward's end (5): after its last kernel
        (0.25, ["a", "copy_a", "b", "copy_b", "k1", "k2", "k3", "wait_a", "wait_b"]),
    ],
)
def test_each_copy_is_waited_for_where_it_is_done_on_the_plans_clock(kib_per_us, expected):
    """Kernel ends a 1, b 2, k1 3, k2 4, k3 5 µs; 1 KiB values; the copies share the link in issue order.
    torch sinks every wait to the forward's end, which holds every copied buffer through the forward."""
    from recompile_opt.passes.partition import _place_copy_waits

    from recompile_opt.planner.offload import CopyClock

    fw, nodes = _graph(
        [
            ("x", None, ()),
            ("a", torch.relu, ("x",)),
            ("copy_a", torch.clone, ("a",)),
            ("wait_a", _wait, ("copy_a", "a")),
            ("b", torch.cos, ("a",)),
            ("copy_b", torch.clone, ("b",)),
            ("wait_b", _wait, ("copy_b", "b")),
            ("k1", torch.sin, ("b",)),
            ("k2", torch.sin, ("k1",)),
            ("k3", torch.sin, ("k2",)),
        ],
        out=("k3", "wait_a", "wait_b"),
    )
    clock = CopyClock({"a": 1e-6, "b": 2e-6, "k1": 3e-6, "k2": 4e-6, "k3": 5e-6}, {}, kib_per_us * KiB / US)
    _place_copy_waits(fw, {"a": nodes["wait_a"], "b": nodes["wait_b"]}, clock)
    fw.graph.lint()
    assert _order(fw) == expected
    # each wait reads the kernel it follows, so that Inductor's reordering cannot pull it up to its copy
    for wait in (nodes["wait_a"], nodes["wait_b"]):
        kernel = wait.prev if wait.prev.name.startswith("k") or wait.prev.name in "ab" else wait.prev.prev
        assert wait.args[2] is kernel, (wait, wait.args)


@pytest.mark.parametrize(
    "kib_per_us, expected",
    [
        # from the last first use back: a's copy ends by u_a (5 µs), issued by 4, before j4; b's ends by
        # u_b (3), issued by 2, before j3
        (1, ["j1", "j2", "r_b", "j3", "u_b", "r_a", "j4", "u_a"]),
        # 2 µs each: a's issued by 3, before u_b; b's ends by 3 (a's start), issued by 1, before j2
        (0.5, ["j1", "r_b", "j2", "j3", "r_a", "u_b", "j4", "u_a"]),
        # 4 µs each: a's issued by 1, before j2; b's must end by 1: issued after the inputs, exposed
        (0.25, ["r_b", "j1", "r_a", "j2", "j3", "u_b", "j4", "u_a"]),
    ],
)
def test_each_reload_is_issued_as_late_as_its_first_use_allows(kib_per_us, expected):
    """Backward kernels start j1 0, j2 1, j3 2, u_b 3, j4 4, u_a 5 µs; torch issues each reload just
    before its first use (a stall of the whole copy) or, prefetching, by its own bandwidth setting."""
    from recompile_opt.passes.partition import _place_reloads

    from recompile_opt.planner.offload import CopyClock

    bw, nodes = _graph(
        [
            ("cpu_offload_a", None, ()),
            ("cpu_offload_b", None, ()),
            ("t", None, ()),
            ("j1", torch.sin, ("t",)),
            ("j2", torch.sin, ("j1",)),
            ("j3", torch.sin, ("j2",)),
            ("r_b", torch.clone, ("cpu_offload_b",)),
            ("u_b", torch.add, ("r_b", "j3")),
            ("j4", torch.sin, ("u_b",)),
            ("r_a", torch.clone, ("cpu_offload_a",)),
            ("u_a", torch.add, ("r_a", "j4")),
        ],
        out=("u_a",),
    )
    starts = {"j1": 0.0, "j2": 1e-6, "j3": 2e-6, "u_b": 3e-6, "j4": 4e-6, "u_a": 5e-6}
    _place_reloads(
        bw, {"a": [nodes["r_a"]], "b": [nodes["r_b"]]}, CopyClock({}, starts, kib_per_us * KiB / US)
    )
    bw.graph.lint()
    assert _order(bw) == expected


_WAIT_OPS = {"torch.ops.ao.wait_tensor.default", "torch.ops.recompile_opt.wait_offload_copy.default"}


def _side_stream_plan(monkeypatch, link: str):
    """The tiny GPT planned with offload as on CUDA (the copies on a stream of their own: torch's ``ao``
    ops, or on torch 2.11 its stream ops, given stream ids a CPU lacks), and its final graphs."""
    import itertools

    from recompile_opt.passes import partition

    import recompile_opt
    from recompile_opt import planning

    monkeypatch.setattr(partition, "_copies_on_a_stream_of_their_own", lambda device: True)
    if importlib.util.find_spec("torch._functorch._activation_offloading.offload_ops") is None:
        from torch._functorch._activation_offloading import activation_offloading

        ids = itertools.count(1)
        for name in ("get_current_stream", "new_stream", "new_event"):
            monkeypatch.setattr(activation_offloading, name, lambda *a, **k: next(ids))
    graphs = []
    real = planning.partition
    monkeypatch.setattr(planning, "partition", lambda *a, **k: graphs.append(real(*a, **k)) or graphs[-1])
    model, inputs = _gpt(0.0)
    plan = recompile_opt.plan(model, inputs, **{**ON_CPU, "offload": link}, compiler="eager")
    return plan, *graphs[-1]


def test_side_stream_copies_hold_their_buffer_until_waited_for_where_they_are_done(monkeypatch):
    """On the emitted forward, each offloaded value's last reader is its copy's wait, and Inductor's code
    frees or reuses its buffer only after that wait (torch 2.11's own wait read neither the copy nor
    the value: Inductor reused the buffer while its copy ran, the H200's NaN loss). The waits are where
    the copies are done, not all at the forward's end; the reloads are issued before their first use."""
    plan, fw, bw = _side_stream_plan(monkeypatch, "1GB/s")
    assert ti.offload_copies_overlap()
    waits = ti.offload_waits(fw)
    offloaded = {e.name for e in plan.saved if e.action == OFFLOAD}
    assert offloaded and set(waits) == offloaded and plan.offload["exposed_s"] == 0.0
    order = {n: i for i, n in enumerate(fw.graph.nodes)}
    for name, wait in waits.items():
        source = wait.args[1]
        assert source.name == name and max(source.users, key=order.get) is wait
    last_kernel = max(order[n] for n in fw.graph.nodes if n.op == "call_function" and n not in waits.values())
    at_the_end = [name for name, w in waits.items() if order[w] > last_kernel]
    assert len(at_the_end) <= 1, f"sunk to the forward's end: {at_the_end}"
    # Inductor's code: no buffer of an offloaded value is freed or handed on before its wait
    from recompile_opt.costs.inductor_peak import _call, _statements

    gone = set()  # buffers deleted or handed to another name so far
    kernels, made, behind = 0, {}, []  # kernels run so far, at each buffer's making; kernels per copy
    for stmt in _statements(_call(ti.inductor_wrapper_code(fw, backward=False).code)):
        call = getattr(stmt, "value", None)
        func = ast.unparse(call.func) if isinstance(call, ast.Call) else ""
        if func in _WAIT_OPS:
            assert ast.unparse(call.args[1]) not in gone, ast.unparse(stmt)
            behind.append(kernels - made[ast.unparse(call.args[0])])
        elif func.startswith(("cpp_", "extern_kernels.", "torch.ops.aten.")):
            kernels += 1
        if isinstance(stmt, ast.Assign):
            made.setdefault(ast.unparse(stmt.targets[0]), kernels)
        if isinstance(stmt, ast.Delete):
            gone |= {ast.unparse(t) for t in stmt.targets}
        elif isinstance(stmt, ast.Assign) and isinstance(stmt.value, ast.Name):
            gone.add(stmt.value.id)
    # and each wait runs behind compute its copy hides under: Inductor's reordering for its peak pulled
    # every wait up to its copy before the waits read the kernel they follow
    assert len(behind) == len(waits) and min(behind) >= 1, behind
    # the backward: each reload issued at least one kernel of its own before the first reader of what it
    # reloads (torch issues it just before that reader), and so in Inductor's code
    from recompile_opt.costs.kernels import is_extern
    from recompile_opt.ops import is_view_node

    bnodes = list(bw.graph.nodes)
    for name in offloaded:
        host = next(n for n in bnodes if n.name == ti.CPU_OFFLOAD_PREFIX + name)
        (issue,) = [
            u for u in host.users if not ti.is_offload_wait(u.target)
        ]  # ao::reload, 2.11's device_put
        waits = [u for u in issue.users if ti.is_offload_wait(u.target)]
        reloaded = [u for w in waits for u in w.users] or list(issue.users)  # its wait's readers, or its own
        between = bnodes[bnodes.index(issue) + 1 : min(bnodes.index(u) for u in reloaded)]
        kernels = [n for n in between if n.op == "call_function" and is_extern(n) and not is_view_node(n)]
        assert kernels, name
    if importlib.util.find_spec("torch._functorch._activation_offloading.offload_ops") is None:
        return  # torch 2.11: its reloads are device_put between stream ops, checked in the graph above
    made, kernels, behind = {}, 0, []
    for stmt in _statements(_call(ti.inductor_wrapper_code(bw, backward=True).code)):
        call = getattr(stmt, "value", None)
        func = ast.unparse(call.func) if isinstance(call, ast.Call) else ""
        if func == "torch.ops.ao.wait_tensor.default":
            behind.append(kernels - made[ast.unparse(call.args[0])])
        elif func.startswith(("cpp_", "extern_kernels.", "torch.ops.aten.")):
            kernels += 1
        if isinstance(stmt, ast.Assign):
            made.setdefault(ast.unparse(stmt.targets[0]), kernels)
    assert len(behind) == len(offloaded) and min(behind) >= 1, behind


@pytest.fixture
def side_stream_stand_ins(monkeypatch):
    """The copies on a stream of their own as on CUDA, run on the CPU by synchronous stand-ins: torch's
    ``ao`` ops (2.12 on) given CPU kernels that copy at once, or torch 2.11's stream ops given streams
    and events that do nothing. What is checked is the rewrite: the graphs with the waits and reloads
    where the plan placed them."""
    import itertools

    from recompile_opt.passes import partition

    monkeypatch.setattr(partition, "_copies_on_a_stream_of_their_own", lambda device: True)
    if importlib.util.find_spec("torch._functorch._activation_offloading.offload_ops") is not None:
        importlib.import_module("torch._functorch._activation_offloading.offload_ops")  # the ao ops

        def reload(t, device, size=None, stride=None):
            return torch.empty_strided(size or t.shape, stride or t.stride(), dtype=t.dtype).copy_(t)

        lib = torch.library.Library("ao", "IMPL")
        lib.impl("offload", lambda t: t.clone(), "CPU")
        lib.impl("reload", reload, "CPU")
        lib.impl("wait_tensor", lambda t, keepalive=None, last_use_of_storage=None: t, "CPU")
        yield "ao"
        lib._destroy()
        return
    from torch._dynamo.variables import streams
    from torch._functorch._activation_offloading import activation_offloading

    class Inert:
        def __getattr__(self, name):
            return lambda *args, **kwargs: None

    ids = itertools.count(1)
    for name in ("get_current_stream", "new_stream", "new_event"):
        monkeypatch.setattr(activation_offloading, name, lambda *a, **k: next(ids))
    monkeypatch.setattr(streams, "_get_stream_by_index", lambda index: Inert())
    monkeypatch.setattr(streams, "_get_event_by_index", lambda index: Inert())
    monkeypatch.setattr(torch.accelerator, "set_stream", lambda stream: None)
    yield "streams"


@pytest.mark.parametrize("dropout", [0.0, 0.1])
def test_side_stream_graphs_give_eager_gradients(side_stream_stand_ins, dropout):
    """The graphs as emitted for CUDA (copies on a stream of their own, waits and reloads placed on
    the plan's clock), run with synchronous stand-ins, give eager's gradients; dropout replayed."""
    from helpers import train_side_by_side

    model, inputs = _gpt(dropout)
    plan = train_side_by_side(model, inputs, options={**ON_CPU, "compiler": "eager"}, rtol=1e-4, atol=1e-5)
    assert plan.offloaded and plan.offload["bytes_to_host"] > 0


@pytest.mark.slow
def test_side_stream_graphs_through_inductor(side_stream_stand_ins):
    """The same through Inductor (``fallback_random``: random ops kept, as in test_inductor.py). On
    torch 2.11 its C++ backend emits a fused kernel's call after stream ops it was scheduled before,
    with the kernel's inputs freed first (``UnboundLocalError``): a CPU code generator's deferral that
    Triton's has not; its GPU run is the GPU check's."""
    from helpers import train_side_by_side

    if side_stream_stand_ins == "streams":
        pytest.skip("torch 2.11's C++ kernels are emitted after the stream ops (see the docstring)")
    model, inputs = _gpt(0.1)
    with torch._inductor.config.patch(fallback_random=True):
        plan = train_side_by_side(model, inputs, options=ON_CPU, rtol=1e-4, atol=1e-5)
    assert plan.offloaded


class _ScaledChain(torch.nn.Module):
    """``relu(x @ w1) @ w2``, then ``k`` times ``* 1.5 + 0.5``, summed: the chain's backward, before the
    matmul that reads the relu, is one fused kernel whatever ``k``."""

    def __init__(self, k: int):
        super().__init__()
        self.k = k
        self.w1 = torch.nn.Parameter(torch.randn(32, 64))
        self.w2 = torch.nn.Parameter(torch.randn(64, 64))

    def forward(self, x):
        h = (x @ self.w1).relu() @ self.w2
        for _ in range(self.k):
            h = h * 1.5 + 0.5
        return h.sum()


def test_offload_windows_are_timed_in_inductors_kernels(monkeypatch):
    """A copy hides behind kernels, not behind ops: the backward before the relu's first use is one
    kernel that reads the loss's scalar gradient and writes h's (128 x 64 fp32), whatever the chain's
    length. Timed op by op, each ``* 1.5`` read and wrote h again, and the window grew with ``k``
    (131072 and 524288 bytes' time for k = 2 and 8): the ILP would have hidden copies behind time
    Inductor's fused code does not take."""
    import recompile_opt
    from recompile_opt import planning

    problems = []
    build = planning.build_problem
    monkeypatch.setattr(
        planning, "build_problem", lambda *a, **k: problems.append(build(*a, **k)) or problems[-1]
    )
    seconds_are_bytes = {"flops_per_s": 1e30, "bytes_per_s": 1.0}
    for k in (2, 8):
        torch.manual_seed(0)
        recompile_opt.plan(
            _ScaledChain(k), (torch.randn(128, 32),), compiler="eager", roofline=seconds_are_bytes
        )
        windows = problems[-1].values["relu"].offload_windows
        assert windows is not None and windows[1] == 128 * 64 * 4 + 4, (k, windows)
