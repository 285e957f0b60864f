"""The planner's choice of mini-sequence chunking (``chunks="auto"``): which regions to chunk and in how
many chunks, costed by the same plans as keep/recompute.

Why a choice between whole plans: a chunked region is a different graph (the rewrite runs before
AOTAutograd), so its cost is known only by planning that graph: the least-peak search, and the peak of
the plan it finds (walked in Inductor's generated code where the search walked it). Chunking buys
memory only where the step peaks in or around the region; elsewhere it costs smaller matmuls and,
for the MLP, the recompute of its up-projections. So: plan without chunks, then add one region kind
at a time (the loss first: it needs no recompute) and keep it only where the plan it gives peaks
lower by at least :data:`GAIN` (against a chunked plan already taken: or no higher with a shorter
estimated step; under ``peak_memory``: fits where the other does not, or fits with less recompute). Under
a limit the unchunked plan meets, chunks are tried where it meets it by recomputing: they may leave room
under the limit to keep what it recomputes.

A kind not chunked yet is planned only where one of its full-length tensors is alive at the best plan's
peak so far (:meth:`Candidate.alive_at_peak`): elsewhere chunking cannot lower that peak, and each try
plans the graph again; at the least peak or under a limit the unchunked plan misses, the first kind is
tried anyway where recomputed values hold part of an unchunked peak (:func:`probes`: chunks elsewhere
may let the plan keep them). Where a kind
tried was not taken, the kinds passed over are tried with it once:
its chunks may have moved the peak to them. The compile's own plan of the unchunked graph is the first
(:func:`worth_trying`), so a graph where no kind is worth trying is planned once (``"auto"`` is the
default).

Where the forward goes on after the loss (more than scalar ops), the loss is tried two ways: its
gradients made in the forward (Liger's, kind ``loss``) or its head recomputed in the backward (MST's,
``loss_recompute``), whose forward does a third of the head's work and holds no gradient.

The number of chunks follows Liger's rule (the chunk's logits no larger than the head's input: k = V / h,
to a power of two; the MLP's hidden the same way: k = hidden / h; attention's keys: k = s / head dim),
with a floor on the rows of a chunk from the roofline (:func:`min_rows`): each chunk passes over the
region's weights whatever its rows, so chunks of a few rows are memory-bound (measured,
``bench/chunk_rows.py``: the LM head's loss in 128 chunks of 4 rows took about 9x its unchunked time; at
128 rows, about 1.1x). Where the floor lowers Liger's k,
a kind is tried at the floor first and at Liger's k after every kind's first try: the least-peak plan takes it
where it peaks at least :data:`GAIN` lower still, a plan under ``peak_memory`` only where the limit is not met
yet (fitting first, then the shorter step, which the op's k-aware traffic prices: ``passes/chunking.py``).
Attention, tried last (:data:`LAST`), goes the other way at the least peak: its most chunks first,
then Liger's k, the floor's only where those are refused; under a limit, the floor's k first, then its
most chunks, Liger's k only where those are refused (:func:`_order`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable

from recompile_opt.plan import Plan, fmt_bytes
from recompile_opt.planner.least_peak import EXACT_TIE

# a chunked plan must peak this much lower to be taken. Why the least-peak search's exact tie: the
# search keeps any plan within it of the least walked peak (less recompute wins), so two plannings of
# one graph differ by up to that much (seen: 27.08 and 28.16 MiB on the GPT with vocabulary 2048, where
# a 2% gain took loss chunks that measured 27.22 MiB against 27.08 unchunked)
GAIN = EXACT_TIE
# the MLP's chunks are unrolled in the joint graph, a few dozen nodes each, and the planning time grows
# with them; the loss is one op whatever k (passes/chunking.py), so only the matmuls' size bounds it
MAX_CHUNKS = {"loss": 256, "mlp": 8, "attention": 8}  # attention's chunks are unrolled too
# the region each kind chunks: the loss's two ways exclude each other
FAMILY = {"loss": "loss", "loss_recompute": "loss", "mlp": "mlp", "attention": "attention"}
# kinds tried only after the others are settled, against the plan they made. Why: on the benchmark GPT
# (s=256, h=256) attention tried among the first was taken (25.58 -> 23.80 MiB), then dropped by the MLP
# + loss plan (21.80 MiB) that the choice reaches without it: two plannings (2.3x the planning) for nothing
LAST = frozenset({"attention"})
# kinds planned only where their full-length tensors hold at least this share of the walked peak. Why:
# a chunked attention has buffers that do not shrink with k (a contiguous copy of Q, K and V each; the
# K and V gradients' accumulators, two buffers each while a baddbmm ran: one each, added in place), so
# its chunks lower a peak only where the [b, heads, s, s] buffers hold much of it. The demo GPT (s=256)
# least-peak plan with its MLPs chunked, 8 of 21.78 MiB (Inductor's pool off, as at the peak goals):
# attention in 2 walked 19.29 MiB, in 4 17.79 (with the pool on, 8 of 21.80 and 21.30 in 2: the pool
# held the gain); a GPT with s=512, 24 of 26.04 MiB, chunked in 8 walked 11.51 (docs/design.md, attention
# chunking)
SHARE_FLOOR = {"attention": 1 / 3}
# kinds that also offer their most chunks (MAX_CHUNKS), below the floor of rows, tried first at the least
# peak, each coarser k only where a finer one is not taken. Why: one chunk's s x s buffers are what a
# chunked attention still holds at the floor: the demo GPT's least peak with its attention in 4 chunks
# (Liger's k) walked 15.54 MiB, in 8 14.66 (measured the same; bench/compare.py's step 192.2 ms against
# 193.8), and tried first, 8 costs no planning where it is taken. Not the MLP: the GPT's MLPs in 8
# chunks (128 rows each) walked 23.57 MiB where 4 walked 21.78, and then cost two plannings more
FINEST = frozenset({"attention"})
# the share of a chunk's matmul time its passes over the weights may take at the floor of rows
OVERHEAD = 1 / 8
# at the least peak, a chunked plan whose peak is the fraction g below the unchunked plan's may take
# at most max(STEP_SLACK, g) more estimated step time: a similar peak is not bought with a far slower
# step (the project's target for the least-peak step is 1.15x plain torch.compile's)
STEP_SLACK = 0.15


@dataclass(frozen=True)
class Candidate:
    kind: str  # "loss", "loss_recompute", "mlp" or "attention"
    chunks: int
    below_floor: bool = False  # chunks of fewer rows than min_rows: which goals try them, see for_goal
    finest: bool = False  # the most chunks, above Liger's k (FINEST): tried first at the least peak
    tokens: int = 0  # the widest region's tokens and width (vocabulary, MLP hidden, attention's keys): its
    width: int = 0  # full-length tensors have tokens x width elements (logits, hidden, probabilities, ...)
    # the rows its chunks divide (attention: its queries), held against the floor (min_rows); for notes
    rows: int = field(default=0, compare=False)

    def alive_at_peak(self, plan: Plan) -> bool:
        """Whether one of the region's full-length tensors is alive at ``plan``'s peak, simulated or
        walked (either: the walk names only the buffers whose values it finds in the graph): a buffer
        with the region's width among its dims and tokens x width elements (exactly: attention's
        ``[b, heads, s, s]`` has a width among its dims where the sequence equals it). Where none is,
        chunking the region cannot lower that peak (so it is not planned). A plan without the shapes
        at its peak: unknown, so yes. Attention: where the walk knows, only at :data:`SHARE_FLOOR`."""
        walked = getattr(plan, "walked_breakdown", None) or {}
        if FAMILY[self.kind] in SHARE_FLOOR and walked.get("shape_bytes"):
            share = sum(n for shape, n in walked["shape_bytes"] if self._full_length(shape)) / walked["total"]
            return share >= SHARE_FLOOR[FAMILY[self.kind]]
        simulated = plan.peak_breakdown.get("shapes")
        if simulated is None:
            return True
        return any(self._full_length(shape) for shape in simulated + walked.get("shapes", []))

    def _full_length(self, shape) -> bool:
        return self.width in shape and math.prod(shape) == self.tokens * self.width


def min_rows(itemsize: int, roofline: dict) -> int:
    """The fewest rows (a power of two) a chunk may have: its passes over the region's weights (4: read
    for the forward and for the input's gradient, the weight's gradient read and written by ``addmm_``)
    take at most :data:`OVERHEAD` of its matmuls' time (6 FLOPs per weight element and row). The MLP's
    ratio is about the same (5 passes, 8 FLOPs). 128 rows for fp32 on the CPU constants."""
    rows = 4 * itemsize * roofline["flops_per_s"] / (6 * OVERHEAD * roofline["bytes_per_s"])
    return 2 ** math.ceil(math.log2(rows))


def chunks_for(kind: str, width: int, model_width: int, tokens: int) -> int:
    """Liger's k: a power of two at least ``width / model_width``, at least 2, at most
    :data:`MAX_CHUNKS` and the tokens."""
    k = 2 ** max(1, math.ceil(math.log2(max(width / max(model_width, 1), 2))))
    return max(2, min(k, MAX_CHUNKS[kind], tokens))


def candidates(
    loss_regions: list, mlp_regions: list, roofline: dict, *, attention_regions: list = ()
) -> list[Candidate]:
    """Per region kind whose regions can all be chunked (the loss first; both its ways where the forward
    goes on after it; attention last), Liger's k for its widest region, capped by the floor on rows;
    where the floor lowered it, Liger's k as a second candidate below the floor, after every kind's
    first; for a kind in :data:`FINEST`, its most chunks where more than both. Attention's rows are its
    queries (each chunk passes over a head's K and V as the MLP's over its weights) and its k is keys /
    head dim (a chunk's scores no larger than the queries)."""
    out = []
    for kind, regions, width, model_width, rows in (
        ("loss", loss_regions, lambda r: r.vocab, lambda r: r.width, lambda r: r.tokens),
        ("mlp", mlp_regions, lambda r: r.hidden, lambda r: r.width, lambda r: r.tokens),
        ("attention", attention_regions, lambda r: r.keys, lambda r: r.head_dim, lambda r: r.queries),
    ):
        if regions and all(r.why_not is None for r in regions):
            r = max(regions, key=width)
            liger = chunks_for(kind, width(r), model_width(r), rows(r))
            floored = min(liger, 2 ** int(math.log2(max(rows(r) // min_rows(r.itemsize, roofline), 1))))
            finest = min(MAX_CHUNKS[kind], 2 ** int(math.log2(max(rows(r), 1)))) if kind in FINEST else 0
            # where more of the forward runs after the loss, its gradients made in the forward wait
            # through it: the head recomputed in the backward is costed too
            kinds = [kind] if kind != "loss" or all(r.last for r in regions) else [kind, "loss_recompute"]
            shape = {"tokens": r.tokens, "width": width(r), "rows": rows(r)}
            for way in kinds:
                if floored >= 2:
                    out.append(Candidate(way, floored, **shape))
                if liger > floored:
                    out.append(Candidate(way, liger, below_floor=True, **shape))
                if finest > max(liger, floored):
                    out.append(Candidate(way, finest, below_floor=True, finest=True, **shape))
    return sorted(out, key=lambda c: c.below_floor)  # stable: the floor's candidates first, the loss first


def for_goal(candidates: list[Candidate], peak_limit: int | None) -> list[Candidate]:
    """The candidates a goal tries: under a peak limit all (those below the floor only to meet it:
    :func:`choose`); at the least peak, a kind below the floor only where the kind has chunks at the
    floor too (tried first), so a region shorter than two chunks of the floor's rows is not chunked
    there (its only chunks are memory-bound: 4-row chunks took 9x the loss's time)."""
    if peak_limit is not None:
        return candidates
    at_floor = {FAMILY[c.kind] for c in candidates if not c.below_floor}
    return [c for c in candidates if FAMILY[c.kind] in at_floor]


def below_floor_note(every: list[Candidate], tried: list[Candidate]) -> str | None:
    """The note where the least peak passes over a kind of ``every`` region candidate (``tried``: those
    :func:`for_goal` kept) for its chunks' rows, else None. Why say it: such a plan shows no chunk
    line, and a forced ``chunks`` or a ``peak_memory`` limit may still find a lower peak with those
    chunks (the tests' DeBERTa-v2 of 2 x 16 tokens: 581.00 KiB at 0.0, 516.25 with its MLPs in 2
    chunks; docs/design.md has the command)."""
    kept = {FAMILY[c.kind] for c in tried}
    passed = {FAMILY[c.kind]: c for c in every if FAMILY[c.kind] not in kept}
    if not passed:
        return None
    kinds = ", ".join(f"{kind} ({c.rows} rows)" for kind, c in passed.items())
    return (
        f"chunks (auto): {kinds} not tried at the least peak: too short for two chunks of the floor on "
        "a chunk's rows (fewer rows leave its matmuls memory-bound); option chunks forces them, and a "
        "peak_memory limit tries them where it must"
    )


def worth_trying(candidates: list[Candidate], plan: Plan, peak: int, peak_limit: int | None) -> str | None:
    """Whether chunking may serve the unchunked ``plan``'s goal (``peak``: its peak in bytes): None where
    it may (a first candidate's full-length tensors are alive at that peak; under ``peak_memory``,
    wherever the plan misses the limit: :func:`choose` tries the kinds alive at its peak, and a plan
    that still misses is made again to warn as usual; where it meets the limit by recomputing, a
    shorter step: :func:`_why_not_under_a_met_limit`), else the note line that says why nothing is
    tried. This
    is the test that lets a compile plan its graph once where chunks cannot help
    (:func:`recompile_opt.chunk_driver.compile_with_chunk_choice`)."""
    if peak_limit is not None:
        return None if peak > peak_limit else _why_not_under_a_met_limit(candidates, plan)
    if any(c.alive_at_peak(plan) for c in candidates) or probes(candidates, plan, peak_limit):
        return None
    kinds = ", ".join(dict.fromkeys(FAMILY[c.kind] for c in candidates))
    return f"chunks (auto): {kinds} not tried: none of their full-length tensors is alive at the peak"


def _why_not_under_a_met_limit(candidates: list[Candidate], plan: Plan) -> str | None:
    """Under a ``peak_memory`` limit the unchunked ``plan`` meets: None where chunks may make the step
    shorter (the plan recomputes at least :data:`GAIN` of its estimated step, and a candidate's
    full-length tensors are alive at its peak, where the limit binds: chunking them leaves room to keep
    what it recomputes), else the note that says why nothing is tried. Why: the limit's goal is the
    least recompute that fits, and the GPU check's GPT (planned on meta) under the full policy's
    peak recomputed 11.0 ms of a 51.6 ms est. step unchunked, 1.8 of 39.0 with its loss in 8 chunks."""
    share = plan.recompute_s / max(_time(plan), 1e-12)
    if share < GAIN:
        return (
            "chunks (auto): not tried: the unchunked plan meets peak_memory, recomputing "
            f"{share:.1%} of its est. step"
        )
    at_floor = [c for c in candidates if not c.below_floor]  # the others only to meet a limit (_greedy)
    if any(c.alive_at_peak(plan) for c in at_floor):
        return None
    if not at_floor:
        return (
            "chunks (auto): not tried: the unchunked plan meets peak_memory, and chunks of fewer rows "
            "than the floor are tried only to meet a limit"
        )
    kinds = ", ".join(dict.fromkeys(FAMILY[c.kind] for c in at_floor))
    return (
        "chunks (auto): not tried: the unchunked plan meets peak_memory, and none of the full-length "
        f"tensors of {kinds} is alive at its peak"
    )


def recomputes_at_peak(plan: Plan) -> bool:
    """Whether recomputed values hold at least :data:`GAIN` of ``plan``'s walked peak (the kernel model's
    where not walked): the plan balances keeping against recomputing there, so chunks that let it keep
    more elsewhere may lower that peak though none of their tensors is alive at it. Why: without
    Inductor's pool the GPT with vocabulary 2048 peaks unchunked in an attention backward (26.32 MiB, 7
    of it recomputed, no loss or MLP tensor alive), and with its loss and MLPs chunked at 23.31."""
    bd = getattr(plan, "walked_breakdown", None) or plan.peak_breakdown or {}
    total = bd.get("total") or 0
    return total > 0 and bd.get("bytes", {}).get("recomputed", 0) >= GAIN * total


def probes(candidates: list[Candidate], plan: Plan, peak_limit: int | None) -> bool:
    """Whether the choice tries its first candidate though none is alive at ``plan``'s peak
    (:func:`recomputes_at_peak`), at the least peak or under a ``peak_memory`` limit ``plan`` misses;
    the kinds passed over are then tried with it (:func:`_combined`). Why under a missed limit too: a
    Hugging Face Qwen3-MoE peaked unchunked at 1.93 MiB with no loss tensor alive there, and its loss
    in 2 chunks at 1.64 (its least peak); under a limit of 1.72 MiB the loss was not tried and the
    limit was said to be below the least peak."""
    missed = peak_limit is None or plan.predicted_peak_bytes > peak_limit
    return missed and bool(candidates) and recomputes_at_peak(plan)


def choose(
    candidates: list[Candidate],
    plan_with: Callable[[dict], Plan],
    peak_limit: int | None,
    unchunked: Plan | None = None,
) -> tuple[dict, Plan, Plan, list[str]]:
    """Greedy over ``candidates`` (in order): ``plan_with(chunks)`` plans the graph chunked so; returns
    the chunks taken, the unchunked plan (``unchunked`` where it is made already), the plan taken, and
    one note line per candidate tried. A kind not chunked yet is planned only where its full-length
    tensors are alive at the best plan's peak so far (:meth:`Candidate.alive_at_peak`); one passed
    over is tried again with the chunks of a trial not taken (:func:`_combined`), and after attention
    where its tensors are alive at the peak by then. Attention comes after the loss and the MLP are
    settled (:data:`LAST`)."""
    taken: dict = {}
    unchunked = best = unchunked or plan_with({})
    notes, passed = [], []
    for late in (False, True):
        stage = [c for c in candidates if (FAMILY[c.kind] in LAST) == late]
        stage.sort(key=lambda c: _order(c, peak_limit))  # stable
        # a probe where none of the stage's kinds is alive at the peak; under a limit, none of any stage's
        # (attention's neither): where one is, its trial moves the peak (the demo GPT under its least
        # peak: the loss probed first took 2 chunks, and the plan it led to peaked 1.7% above the limit)
        seen = stage if peak_limit is None else candidates
        probe = not late and not any(c.alive_at_peak(best) for c in seen) and probes(stage, best, peak_limit)
        taken, best, missed = _greedy(
            stage,
            plan_with,
            peak_limit,
            taken,
            best,
            unchunked,
            notes,
            passed,
            probe=probe,
        )
        if not late:
            passed, (taken, best) = _combined(
                passed, missed, plan_with, peak_limit, taken, best, notes, unchunked
            )
    # a kind passed over, tried once more where the chunks taken after it (attention) moved the peak
    # onto its tensors: under its own least peak as a limit, the demo GPT's unchunked plan peaked in an
    # attention backward, so its MLPs were passed over, and attention in 8 chunks moved the peak into
    # an MLP's GELU backward (19.29 MiB walked, "cannot be met"); the MLPs in 4 chunks meet it (14.66)
    again, passed = passed, []
    taken, best, _ = _greedy(again, plan_with, peak_limit, taken, best, unchunked, notes, passed)
    if passed:
        notes.append(
            f"chunks (auto): {', '.join(dict.fromkeys(c.kind for c in passed))} not tried: none "
            "of their full-length tensors is alive at the peak"
        )
    return taken, unchunked, best, notes


def _order(c: Candidate, peak_limit: int | None) -> tuple:
    """The order :func:`choose` tries a stage's candidates in (a stable sort's key): a :data:`FINEST`
    kind's candidates most chunks first, at the least peak all of them ahead of the rest; under a
    limit only those below the floor, after the floor's k (the fewest chunks, tried first).
    Why: each try is a planning; tried floor first, the demo GPT's attention took 2 chunks and then 4
    (19.29 then 17.78 MiB: one planning more), and a coarser k is tried only where a finer one is not
    taken (:func:`_finer_taken`; under a limit, not met). Under its least peak as a limit the GPT's
    attention took 2 chunks, then 4 (51 s of planning, still above the limit), then 8 (met); tried
    before 4, 8 is met one planning sooner, at the step 4 would have had (FINEST: measured alike)."""
    finest = c.kind in FINEST
    if peak_limit is None:
        return (-c.chunks if finest else 0,)
    return (c.below_floor, -c.chunks if finest and c.below_floor else 0)


def _greedy(stage, plan_with, peak_limit, taken, best, unchunked, notes, passed, *, probe=False):
    """:func:`choose`'s loop over one stage's candidates (in :func:`_order`); returns the chunks taken,
    the best plan and the trials not taken (``notes`` and ``passed`` grow). At the least peak a
    :data:`FINEST` kind's coarser chunks are tried only where finer ones were not taken (a finer k may
    be refused for a step too slow for its peak: :func:`affordable`). Under a limit a k below the
    floor is tried only while the best plan misses it (small chunks cost time), so a coarser k after a
    finer one taken only where that one still misses (a peak need not fall with every chunk more).
    ``probe``: the first candidate is tried though none of its tensors is alive at the peak
    (:func:`probes`)."""
    missed = []
    for i, c in enumerate(stage):
        if c.below_floor and peak_limit is not None and best.predicted_peak_bytes <= peak_limit:
            continue
        if peak_limit is None and _finer_taken(c, taken, notes):
            continue
        # a region chunked already (another k, the loss's other way) is tried as before: its chunks run
        # inside one op, whose buffers the peak does not list
        chunked = any(FAMILY[kind] == FAMILY[c.kind] for kind in taken)
        if not chunked and not (probe and i == 0) and not c.alive_at_peak(best):
            passed.append(c)
            continue
        others = {kind: k for kind, k in taken.items() if FAMILY[kind] != FAMILY[c.kind]}
        chunks = {**others, c.kind: c.chunks}
        trial = plan_with(chunks)
        better = _better(trial, best, peak_limit, unchunked)
        notes.append(_tried(c.kind, c.chunks, best, trial, better, unchunked, peak_limit))
        if better:
            taken, best = chunks, trial
        else:
            missed.append((chunks, trial))
    return taken, best, missed


def _finer_taken(c: Candidate, taken: dict, notes: list[str]) -> bool:
    """Whether a :data:`FINEST` kind is taken already in more chunks than ``c`` (:func:`_order` tries
    them finest first); says so in ``notes``."""
    if c.kind not in FINEST or taken.get(c.kind, 0) <= c.chunks:
        return False
    notes.append(
        f"chunks (auto): {c.kind} in {c.chunks} chunks not tried: {taken[c.kind]} chunks (finer) were taken"
    )
    return True


def _combined(
    passed: list[Candidate],
    missed: list[tuple[dict, Plan]],
    plan_with,
    peak_limit,
    taken: dict,
    best: Plan,
    notes: list[str],
    unchunked: Plan,
) -> tuple[list[Candidate], tuple[dict, Plan]]:
    """The candidates passed over, each tried once more with the chunks of the first trial not taken.
    Why: chunking one region moves the peak to another, so neither alone may lower it (the GPT with
    vocabulary 2048: its MLPs chunked moved the peak from the MLP's backward to the logits' gradient,
    26.30 -> 27.34 MiB walked; the loss chunked too, 23.30). Not only where its tensors are alive at
    the trial's peak: the kernel model locates a chunked plan's walked peak elsewhere."""
    still = []
    for c in passed:
        for chunks, _ in missed:
            if any(FAMILY[kind] == FAMILY[c.kind] for kind in chunks):
                continue
            both = {**chunks, c.kind: c.chunks}
            combo = plan_with(both)
            better = _better(combo, best, peak_limit, unchunked)
            notes.append(
                _tried(
                    " + ".join(f"{kind} in {k}" for kind, k in chunks.items()) + f" + {c.kind}",
                    c.chunks,
                    best,
                    combo,
                    better,
                    unchunked,
                    peak_limit,
                )
            )
            if better:
                taken, best = both, combo
            break
        else:
            still.append(c)
    return still, (taken, best)


def _tried(
    what: str, chunks: int, best: Plan, trial: Plan, better: bool, unchunked: Plan, peak_limit: int | None
) -> str:
    if better:
        verdict = "taken"
    elif peak_limit is not None:  # _better's test under a limit: fitting, then the step
        verdict = "not taken: " + (
            "misses peak_memory" if trial.predicted_peak_bytes > peak_limit else "no shorter est. step"
        )
    elif not affordable(trial, unchunked):
        verdict = "not taken: its step is too slow for its peak (chunk_choice.STEP_SLACK)"
    else:
        verdict = "not taken"
    return (
        f"chunks (auto): {what} in {chunks} chunks: predicted peak {fmt_bytes(best.predicted_peak_bytes)}"
        f" -> {fmt_bytes(trial.predicted_peak_bytes)}, est. step {_time(best) * 1e3:.1f}"
        f" -> {_time(trial) * 1e3:.1f} ms{_planned_in(trial)}: " + verdict
    )


def _planned_in(trial: Plan) -> str:
    """How long the trial's planning took, for its note. Why: each trial plans the graph again, and a
    chunked graph's planning costs more than the unchunked one's (the demo GPT's attention trial: 43.2 of
    its least-peak planning's 68.7 s, ``print(recompile_opt.plan(*models.demo_gpt(), memory_budget=0.0))``),
    so the user sees where the compile's time went."""
    seconds = trial.solver.get("plan_s")
    return "" if seconds is None else f", planned in {seconds:.1f} s"


def _time(plan: Plan) -> float:
    """Estimated step with recompute: a chunked MLP's recompute is in its backward, so in ``step_s``."""
    return plan.step_s + plan.recompute_s


def _better(trial: Plan, best: Plan, peak_limit: int | None, unchunked: Plan) -> bool:
    """Whether ``trial`` replaces ``best``: under a limit, it fits where ``best`` does not, or both fit
    and it is faster; at the least peak, it peaks :data:`GAIN` lower (or no higher and faster, chunked
    for chunked) at a step not far above ``unchunked``'s (:func:`affordable`)."""
    if peak_limit is not None:
        fits = trial.predicted_peak_bytes <= peak_limit, best.predicted_peak_bytes <= peak_limit
        if fits == (True, True):  # the unchunked plan (a limit it met) only for a step GAIN shorter
            return _time(trial) < (1 if best.chunks else 1 - GAIN) * _time(best)
        if fits != (False, False):
            return fits[0]
    if not affordable(trial, unchunked):
        return False
    if trial.predicted_peak_bytes < (1 - GAIN) * best.predicted_peak_bytes:
        return True
    # one chunked plan for another: no higher peak and a shorter step
    return (
        bool(best.chunks)
        and trial.predicted_peak_bytes <= best.predicted_peak_bytes
        and _time(trial) < _time(best)
    )


def affordable(trial: Plan, unchunked: Plan) -> bool:
    """Whether ``trial``'s estimated step is at most ``1 + max(STEP_SLACK, g)`` times the unchunked
    plan's, ``g`` the fraction by which its peak is lower (:data:`STEP_SLACK`)."""
    base_peak, base_time = unchunked.predicted_peak_bytes, _time(unchunked)
    if base_peak <= 0 or base_time <= 0:
        return True
    gain = 1 - trial.predicted_peak_bytes / base_peak
    return _time(trial) <= (1 + max(STEP_SLACK, gain)) * base_time
