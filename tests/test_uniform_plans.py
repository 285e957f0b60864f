"""Uniform plans: the least-peak search also tries every plan it meets with one block's decisions given
to every identical block (``blocks.BlockMirror``), because Inductor builds identical code once."""

from helpers import forget_searches, tiny_llama, train_side_by_side
from test_ilp import MiB, inp, op, problem

from recompile_opt.options import parse_options
from recompile_opt.planner import least_peak, search
from recompile_opt.planner.blocks import block_mirror
from recompile_opt.planner.policies import block_of
from recompile_opt.planner.solving import SimulateOnly


def at(module, shape=(4,)):
    """A value's op, shape and dtype in ``module`` (what tells identical blocks apart)."""
    return {"info": {"module": module, "op": "mul", "shape": shape, "dtype": "float32"}}


def two_blocks(second_shape=(4,)):
    """x -> e (the embedding, outside any block) -> block 0: a0, b0 -> block 1: a1, b1 -> y."""
    return problem(
        inp("x", 1, needed=True),
        op("e", ["x"], 1, 1, **at("wte")),
        op("a0", ["e"], 2, 50, **at("h.0.mlp")),
        op("b0", ["a0"], 1, 50, **at("h.0.mlp")),
        # a costly a1 (a block's cost is not part of its structure): the ILP keeps it
        op("a1", ["b0"], 2, 500, **at("h.1.mlp", second_shape)),
        op("b1", ["a1"], 1, 50, **at("h.1.mlp")),
        op("y", ["b1"], 1, 1, **at("head")),
        bwd_steps=0,
    )


def test_the_mirror_pairs_blocks_by_position_and_the_first_blocks_input_with_its_twin():
    mirror = block_mirror(two_blocks())
    assert mirror.positions == [["a0", "a1"], ["b0", "b1"]]
    assert mirror.entry_twins == {"e": ("b0",)}  # block 1 reads b0 where block 0 reads e
    assert mirror.mirror({"a1", "b0", "e"}, 1) == {"a0", "a1", "e"}  # block 1 recomputes a, keeps b
    # e is kept where its twin b0 is: the first block then reads a kept input as the others do
    assert mirror.keep_entries({"a0", "a1", "e"}, {"a0", "a1", "e"}) == {"a0", "a1"}
    everything = {"a0", "a1", "b0", "b1", "e"}
    assert mirror.keep_entries(everything, everything) == everything
    # judged on the closure: a twin the plan names but remakes from a kept buffer counts as kept
    assert mirror.keep_entries({"a0", "a1", "b0", "e"}, {"a0", "a1", "e"}) == {"a0", "a1", "b0"}


def test_an_input_with_two_twins_is_kept_only_where_neither_is_recomputed():
    # two streams: block 0 makes x0 and h0 from e, block 1 makes x1 from x0 and h1 from h0
    p = problem(
        inp("x", 1, needed=True),
        op("e", ["x"], 1, 1, **at("wte")),
        op("x0", ["e"], 1, 5, **at("h.0")),
        op("h0", ["e"], 1, 5, **at("h.0")),
        op("x1", ["x0"], 1, 5, **at("h.1")),
        op("h1", ["h0"], 1, 5, **at("h.1")),
        bwd_steps=0,
    )
    mirror = block_mirror(p)
    assert mirror.entry_twins == {"e": ("x0", "h0")}
    stream = {"e", "x0", "x1"}  # the x stream recomputed, the h stream kept: e is still needed
    assert mirror.keep_entries(stream, stream) == stream
    assert mirror.keep_entries({"e"}, {"e"}) == set()


def test_blocks_that_differ_have_no_mirror():
    assert block_mirror(two_blocks(second_shape=(8,))) is None


class _PeakOf(SimulateOnly):
    """A fake simulator: every plan peaks at 8 MiB, or at 6 MiB where ``low(recomputed)``."""

    def __init__(self, low=lambda recomputed: False):
        super().__init__()
        self.low = low

    def __call__(self, saved, recomputed):
        return (6 if self.low(recomputed) else 8) * MiB

    def recomputed_at_peak(self, saved, recomputed):
        return []


def uniform(recomputed) -> bool:
    return all((f"{p}0" in recomputed) == (f"{p}1" in recomputed) for p in "ab")


def search_one_level(monkeypatch, simulate):
    """The 0.0 plan of ``two_blocks`` from a single ladder level, and the ILP's plan at that level."""
    forget_searches(monkeypatch)
    for name, value in (("PEAK_LADDER", (0.3,)), ("PEAK_PROBES", 0), ("REFINE_ROUNDS", 0)):
        monkeypatch.setattr(least_peak, name, value)
    monkeypatch.setattr(least_peak, "_policy_plans", lambda *a: [])  # the ladder's level alone
    met = []
    original = least_peak._mirrored

    def spy(problem, mirror, found, sim):
        met.extend(problem.needed_closure(c.sol.recompute, c.sol.keep)[1] for c in found)
        return original(problem, mirror, found, sim)

    monkeypatch.setattr(least_peak, "_mirrored", spy)
    p = two_blocks()
    plan = search.make_plan(p, parse_options({"memory_budget": 0.0}), simulate=simulate)
    (ladder,) = met
    assert not uniform(ladder), f"the ILP's plan is uniform already: the test shows nothing ({ladder})"
    return plan, ladder, p


def test_a_uniform_plan_that_peaks_as_low_and_recomputes_less_replaces_the_searchs(monkeypatch):
    # the ILP keeps the costly a1 and recomputes a0; given block 1's decisions, block 0 keeps a0 too
    plan, ladder, p = search_one_level(monkeypatch, _PeakOf())
    assert uniform(plan.recomputed_names()), plan.recomputed_names()
    assert plan.recompute_s < p.recompute_seconds(ladder)
    assert any("every identical block takes block 1's decisions" in n for n in plan.notes), plan.notes


def test_a_uniform_plan_that_peaks_lower_but_recomputes_more_does_not(monkeypatch):
    # block 0's decisions for both blocks recompute a1 too: a lower "peak" here, for a1's 500 us
    low = _PeakOf(lambda r: {"a0", "a1"} <= r)
    plan, ladder, p = search_one_level(monkeypatch, low)
    assert not {"a0", "a1"} <= plan.recomputed_names(), plan.recomputed_names()
    assert plan.recompute_s <= p.recompute_seconds(ladder)


def test_a_uniform_least_peak_plan_of_a_model_with_dropout_gives_eagers_gradients():
    # the tiny Llama with dropout takes a mirrored plan at 0.0: each block replays its own masks (the
    # tiny GPT took one while 0.0 planned with Inductor's buffer pool; without it, one not mirrored)
    model, inputs = tiny_llama(dropout=0.1)
    plan = train_side_by_side(
        model, inputs, options={"memory_budget": 0.0, "compiler": "eager"}, rtol=1e-4, atol=1e-5
    )
    assert any("takes block" in n for n in plan.notes), plan.notes
    by_block = {}
    for entry in plan.recomputed:
        if block_of(entry.module):
            by_block.setdefault(block_of(entry.module), []).append(entry.op)
    assert len(by_block) == 2 and len({tuple(ops) for ops in by_block.values()}) == 1, by_block
