"""The frontier: the budget sweep, the knee, PyTorch's knapsack in our terms, the pictures and the CLI."""

import pytest
import torch
from helpers import partitioned, tiny_gpt

import recompile_opt
from recompile_opt import frontier
from recompile_opt.cli import main
from recompile_opt.costs import inductor_peak
from recompile_opt.frontier import Point, draw, knee, sweep, table
from recompile_opt.planner.least_peak import EXACT_TIE

BUDGETS = (0.0, 0.3, 0.6, 1.0)


@pytest.fixture(scope="module")
def points():
    torch._dynamo.reset()
    model, inputs = tiny_gpt()
    return sweep(model, inputs, BUDGETS)


def _ilp(points):
    return sorted((p for p in points if p.kind == "ilp" and p.budgets), key=lambda p: p.budgets[0])


def test_sweep_is_monotone(points):
    """More budget never keeps fewer bytes; among plans made under a byte budget, keeping more never
    costs more estimated recompute. The least-peak plan (0.0) is judged by its peak instead: it may
    keep more bytes than a cheaper plan (its refinement keeps values alive at its peak), but no plan
    of the sweep peaks lower: walked in Inductor's code, within the tie that lets it recompute less
    (EXACT_TIE; the sweep's points carry the simulator's peaks, which may rank them otherwise)."""
    ilp = _ilp(points)
    assert [b for p in ilp for b in p.budgets] == list(BUDGETS)
    kept = [p.kept_bytes for p in ilp]
    assert kept == sorted(kept) and kept[0] < kept[-1]
    least_peak = next(p for p in points if p.kind == "ilp" and p.budgets[:1] == (0.0,))
    by_bytes = sorted(
        (p for p in points if p.kind == "ilp" and p is not least_peak), key=lambda p: p.kept_bytes
    )
    rec = [p.recompute_s for p in by_bytes]
    assert all(a >= b - 1e-12 for a, b in zip(rec, rec[1:])), rec
    assert rec[0] > rec[-1]
    lowest = min((p for p in points if p.kind == "ilp"), key=lambda p: p.predicted_peak_bytes)
    if lowest is not least_peak:
        assert _walked_peak(least_peak) <= _walked_peak(lowest) * (1 + EXACT_TIE)


def _walked_peak(point: Point) -> int:
    """The peak of a sweep point's plan, walked in the code Inductor generates for it."""
    model, inputs = tiny_gpt()
    budget = point.budgets[0] if point.budgets else point.budget_bytes
    part = partitioned(model, inputs, {"memory_budget": budget})
    assert part.plans[-1].saved_bytes == point.kept_bytes
    return inductor_peak.exact_peak(part.last_forward, part.last_backward, num_fwd_outputs=1)


def test_sweep_points_are_the_plans_of_recompile_opt_plan(points):
    """One capture and byte budgets derived from the 0.0 plan give exactly what plan(f) gives."""
    model, inputs = tiny_gpt()
    for f in (0.3, 0.6):
        p = next(p for p in points if f in p.budgets and p.kind == "ilp")
        torch._dynamo.reset()
        plan = recompile_opt.plan(model, inputs, memory_budget=f)
        # the sweep's peaks are the simulator's; a plan's own may be walked in Inductor's code
        assert (p.kept_bytes, p.recompute_flops, p.predicted_peak_bytes) == (
            plan.saved_bytes,
            plan.recompute_flops,
            plan.peak_breakdown["total"],
        ), f


def test_policies_and_points_below_the_least_peak_plan(points):
    by_label = {p.label: p for p in points}
    assert {"save-all", "full", "megatron-selective"} <= set(by_label)
    save_all = by_label["save-all"]
    assert save_all.recompute_flops == 0 and save_all.kept_bytes >= max(p.kept_bytes for p in _ilp(points))
    zero = _ilp(points)[0]
    below = [p for p in points if p.budget_bytes is not None]
    assert below, "0.0 swept: expected ILP points under byte budgets below the least-peak plan"
    for p in below:
        assert p.kind == "ilp" and p.kept_bytes <= p.budget_bytes < zero.kept_bytes, p.label


def test_pytorch_points_mapped_and_checked(points):
    """Torch's knapsack partitions, read in our Problem's terms: the mapping checks pass and its kept
    bytes lie between our least-kept plan and save-all, falling as its budget falls."""
    torch_pts = {p.budgets[0]: p for p in points if p.kind == "pytorch"}
    assert set(torch_pts) == set(frontier.PYTORCH_BUDGETS)
    least = min(p.kept_bytes for p in points if p.kind == "ilp")
    save_all = next(p for p in points if p.label == "save-all").kept_bytes
    for b, p in torch_pts.items():
        assert not any("check failed" in n for n in p.notes), p.notes
        assert least <= p.kept_bytes <= save_all, (b, p.kept_bytes)
        assert p.predicted_peak_bytes > p.kept_bytes and p.step_s > 0
    kept = [torch_pts[b].kept_bytes for b in sorted(torch_pts)]
    assert kept == sorted(kept) and kept[0] < kept[-1]
    assert torch_pts[0.05].recompute_flops > torch_pts[1.0].recompute_flops


class TwoHalves(torch.nn.Module):
    """Two MLP halves with a graph break between them: Dynamo makes two graphs."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.first = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.Linear(64, 32))
        self.second = torch.nn.Sequential(torch.nn.Linear(32, 128), torch.nn.GELU(), torch.nn.Linear(128, 1))

    def forward(self, x):
        x = torch.tanh(self.first(x))
        torch._dynamo.graph_break()
        return self.second(x).square().mean()


def test_graph_breaks_sum_over_the_graphs():
    model, inputs = TwoHalves(), (torch.randn(64, 32, generator=torch.Generator().manual_seed(1)),)
    pts = sweep(model, inputs, (0.5,), policies=("save-all",), pytorch_budgets=(0.5,))
    torch._dynamo.reset()
    plans = recompile_opt.plan(model, inputs, memory_budget=0.5)
    assert len(plans) == 2
    ilp = next(p for p in pts if p.kind == "ilp")
    assert ilp.kept_bytes == sum(p.saved_bytes for p in plans)
    # the sweep ranks every point, torch's too, by the kernel model; a plan's predicted peak is walked
    assert ilp.predicted_peak_bytes == sum(p.peak_breakdown["total"] for p in plans)
    knapsack = next(p for p in pts if p.kind == "pytorch")
    assert knapsack.kept_bytes > 0 and not knapsack.notes, knapsack.notes


def _pt(kept, rec, label=None):
    return Point(
        label=label or f"ilp {kept}",
        kind="ilp",
        budgets=(kept / 100,),
        kept_bytes=kept,
        recompute_s=rec,
        step_s=10.0,
    )


def test_knee_of_a_convex_curve_is_an_interior_point():
    curve = [_pt(0, 10.0), _pt(10, 4.0), _pt(20, 1.5), _pt(40, 0.5), _pt(100, 0.0)]
    k = knee(curve)
    # normalised: (0, 1) (.1, .4) (.2, .15) (.4, .05) (1, 0); below the chord x + y = 1 by
    # (1 - x - y) / sqrt 2, i.e. .5, .65, .55 over sqrt 2: the knee is the third point
    assert k is curve[2]
    assert knee(curve[:2]) is None
    assert knee([_pt(0, 10.0), _pt(50, 5.0), _pt(100, 0.0)]) is None  # a straight line has no knee


def test_knee_of_the_sweep(points):
    k = knee(points)
    ilp = sorted((p for p in points if p.kind == "ilp"), key=lambda p: p.kept_bytes)
    if k is not None:
        assert k in ilp[1:-1]
    assert ("knee" in table(points)) == (k is not None)


def test_table_and_draw(points, tmp_path):
    text = table(points)
    lines = text.splitlines()
    assert lines[0].startswith("| point | kind | kept MiB") and len(lines) == len(points) + 2
    assert "meas. peak" not in text
    paths = draw(points, tmp_path / "sub" / "frontier")
    assert [p.suffix for p in paths] == [".png", ".svg"]
    assert paths[0].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and paths[0].stat().st_size > 10_000
    assert b"<svg" in paths[1].read_bytes()[:2000] and b"knapsack" in paths[1].read_bytes()


def test_measured_panel_and_columns(points, tmp_path):
    measured = [Point(**{**vars(p), "notes": list(p.notes)}) for p in points]
    for i, p in enumerate(measured):
        p.measured_saved_bytes, p.measured_peak_bytes, p.measured_step_s = p.kept_bytes, 2**20 + i, 0.01
    assert "meas. peak MiB" in table(measured)
    one = draw(points, tmp_path / "one")[0].stat().st_size
    two = draw(measured, tmp_path / "two")[0].stat().st_size
    assert two > one  # the second panel


def test_cli_frontier(tmp_path, capsys):
    main(["frontier", "helpers:tiny_mlp", "--budgets", "0,1", "--out", str(tmp_path / "f"), "--no-pytorch"])
    out = capsys.readouterr().out
    assert "| ilp 0 |" in out and "| save-all | policy |" in out and "pytorch" not in out
    assert (tmp_path / "f.png").stat().st_size > 0 and (tmp_path / "f.svg").stat().st_size > 0


@pytest.mark.slow
def test_measured_sweep_matches_the_estimates():
    """Train each strategy (eager compiler): the bytes saved for backward are the estimated kept bytes."""
    model, inputs = tiny_gpt()
    pts = sweep(model, inputs, (0.5, 1.0), policies=("full",), pytorch_budgets=(0.5,), measure=True, steps=1)
    for p in pts:
        assert p.measured_step_s > 0 and p.measured_peak_bytes > 0, p.label
        assert p.measured_saved_bytes == p.kept_bytes, p.label  # exact, PyTorch's knapsack included
