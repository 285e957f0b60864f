"""Measure, through Inductor, the peak of plans the least-peak search meets (not only the one it takes).

Usage::

    python bench/candidate_peaks.py --list                  # the candidates: index, predicted peak, recompute
    python bench/candidate_peaks.py --index 3               # compile candidate 3 as the 0.0 plan, measure
    python bench/candidate_peaks.py --index 3 --keep add    # the same with the value ``add`` kept too
    python bench/candidate_peaks.py --list --walk --vocab 2048 --chunks '{"loss": 4, "mlp": 4}'
                                                              # each listed plan walked in Inductor's code

The search (``least_peak._least_peak``, the 0.0 end of a fractional budget) ranks plans by the simulated
peak; this swaps its choice for a chosen candidate (caches off, so the partitioner runs), compiles the
benchmark's model through Inductor and measures its peak as ``bench/peak_accuracy.py`` does. Why: to
see whether a plan that recomputes less than the chosen one really peaks higher, and where the
simulator misses.
Candidates are listed once per recompute set, by predicted peak, then estimated recompute. ``--list``
plans with ``compiler="eager"`` (the same partition, no code generated); ``--walk`` adds each listed
plan's peak walked in the code Inductor generates for it (about 3 s a plan), to see how the simulator
ranks the plans of a graph (``--vocab``: the model's vocabulary; ``--chunks``: option ``chunks``).
"""

from __future__ import annotations

import argparse
import json
import os

MiB = 2**20


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", choices=("gpt", "llama"), default="gpt")
    g = p.add_mutually_exclusive_group(required=True)
    g.add_argument("--list", action="store_true", help="print the candidates and stop")
    g.add_argument("--index", type=int, help="compile this candidate and measure its peak")
    p.add_argument("--keep", default="", help="comma-separated values to keep on top of the candidate")
    p.add_argument("--max-peak-mib", type=float, default=28.0, help="list only candidates predicted below")
    p.add_argument("--walk", action="store_true", help="with --list: walk each plan in Inductor's code")
    p.add_argument(
        "--vocab", type=int, default=None, help="with --list: the model's vocabulary (default 512)"
    )
    p.add_argument(
        "--chunks", default=None, help="with --list: option chunks, as JSON (default: the default)"
    )
    return p.parse_args(argv)


def _candidates(found, max_peak_mib: float) -> list:
    unique = {}
    for c in found:
        unique.setdefault(frozenset(c.sol.recompute), c)
    return sorted(
        (c for c in unique.values() if c.peak / MiB <= max_peak_mib), key=lambda c: (c.peak, c.recompute_s)
    )


def _ranks(xs: list) -> list[float]:
    """Each value's rank (ties: their mean rank)."""
    order = sorted(range(len(xs)), key=lambda i: xs[i])
    ranks = [0.0] * len(xs)
    i = 0
    while i < len(order):
        j = i
        while j + 1 < len(order) and xs[order[j + 1]] == xs[order[i]]:
            j += 1
        for k in range(i, j + 1):
            ranks[order[k]] = (i + j) / 2
        i = j + 1
    return ranks


def _ranking(pairs: list[tuple[int, int]]) -> str:
    """How the simulator ranks the listed plans against their walks: the rank correlation (Spearman's),
    where the plans within 5% of the least walked peak (the search's tie) stand in the simulated order,
    and the simulator's error."""
    import statistics

    sim, walked = zip(*pairs)
    least = min(walked)
    near = [i for i, w in enumerate(walked) if w <= least * 1.05]
    errors = [abs(s - w) / w for s, w in pairs]
    return (
        f"simulated against walked, {len(pairs)} plans: rank correlation "
        f"{statistics.correlation(_ranks(list(sim)), _ranks(list(walked))):.2f}; the least walked "
        f"({least / MiB:.2f} MiB) and its ties at simulated ranks {near}; |error| mean "
        f"{100 * statistics.mean(errors):.1f}%, max {100 * max(errors):.1f}%"
    )


def main(argv=None) -> None:
    args = parse_args(argv)
    os.environ["TORCHINDUCTOR_FX_GRAPH_CACHE"] = "0"  # the patched choice must reach the partitioner
    os.environ["TORCHINDUCTOR_AUTOGRAD_CACHE"] = "0"
    import dataclasses

    from peak_accuracy import measure_one  # this script's folder is on the path

    from recompile_opt.planner import least_peak

    search, chosen = least_peak._least_peak, {}

    def pick(problem, reduction, kw, min_bytes, baseline, simulate, notes, verify=True):
        kept, sol, found = search(problem, reduction, kw, min_bytes, baseline, simulate, notes, verify)
        cands = _candidates(found, args.max_peak_mib)
        if args.list:
            pairs = []
            for i, c in enumerate(cands):
                walked = simulate.exact(*least_peak._as_compiled(problem, c)) if args.walk else None
                print(
                    f"{i:3d}  predicted {c.peak / MiB:6.2f} MiB  recompute {c.recompute_s * 1e3:5.1f} ms"
                    f"  kept {c.kept / MiB:6.2f} MiB  uniform from block {c.mirrored}"
                    + (f"  walked {walked / MiB:6.2f} MiB" if walked is not None else ""),
                    flush=True,
                )
                if walked is not None:
                    pairs.append((c.peak, walked))
            if len(pairs) > 1:
                print(_ranking(pairs))
            raise SystemExit(0)
        c = cands[args.index]
        keep = {n for n in args.keep.split(",") if n}
        sol = dataclasses.replace(c.sol, recompute=c.sol.recompute - keep)
        chosen.update(index=args.index, recompute_ms=round(c.recompute_s * 1e3, 1), kept_on_top=sorted(keep))
        return kept, sol, found

    least_peak._least_peak = pick
    if args.list:
        _plan(args)
    row = measure_one(args.model, "0.0", "inductor")
    print(
        json.dumps(
            {
                **chosen,
                "kept_mib": round(row["kept_bytes"] / MiB, 2),
                "predicted_mib": round(row["predicted_bytes"] / MiB, 2),
                "measured_mib": round(row["measured_bytes"] / MiB, 2),
            }
        )
    )


def _plan(args) -> None:
    """The benchmark's model planned at 0.0 with the eager compiler (its search lists, then exits)."""
    import torch

    import recompile_opt
    from recompile_opt import models

    cls, config = (
        (models.GPT, models.GPTConfig) if args.model == "gpt" else (models.Llama, models.LlamaConfig)
    )
    cfg = config(n_layer=2, n_head=4, n_embd=256, block_size=256, vocab_size=args.vocab or 512)
    torch.manual_seed(0)
    options = {} if args.chunks is None else {"chunks": json.loads(args.chunks)}
    recompile_opt.plan(cls(cfg), models.example_batch(cfg, 4), memory_budget=0.0, compiler="eager", **options)


if __name__ == "__main__":
    main()
