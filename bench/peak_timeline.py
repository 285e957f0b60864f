"""The measured allocations of one compiled training step next to the peak simulator's, to see where
the prediction departs from Inductor.

Usage::

    python bench/peak_timeline.py --model llama --budget 0.0
    python bench/peak_timeline.py --model gpt --policy full --min-mib 1

Compiles the benchmark's 2-layer model (``recompile_opt.models.demo_gpt`` / ``demo_llama``) through
Inductor with the given options, Inductor's caches off, runs two steps, then records the allocator
events of a third (forward + backward from grads ``None``, as ``bench/compare.py`` measures the peak)
and prints, for each phase, the sizes allocated (+) and freed (-) with the live MiB after each, then
the simulator's events (``recompile_opt.costs.peak.timeline``: kernel index, buffer) for the same graphs.
Why: the prediction is judged by its peak alone elsewhere; where it misses, the two sequences show
which buffers Inductor held or freed otherwise (e.g. a pooled buffer held across a block).
"""

from __future__ import annotations

import argparse
import os

MiB = 2**20


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", choices=("gpt", "llama"), default="gpt")
    p.add_argument("--budget", default=None, help="memory_budget: a fraction, or bytes with units")
    p.add_argument("--policy", default="auto")
    p.add_argument("--peak", default=None, help="peak_memory, with units")
    p.add_argument("--min-mib", type=float, default=0.25, help="leave out events smaller than this")
    return p.parse_args(argv)


def _options(args) -> dict:
    out = {"policy": args.policy}
    if args.budget is not None:
        try:  # a fraction, else bytes with units (the option's own parser judges either)
            out["memory_budget"] = float(args.budget)
        except ValueError:
            out["memory_budget"] = args.budget
    if args.peak is not None:
        out["peak_memory"] = args.peak
    return out


def main(argv=None) -> None:
    args = parse_args(argv)
    os.environ["TORCHINDUCTOR_FX_GRAPH_CACHE"] = "0"  # a cache hit would skip our partitioner
    os.environ["TORCHINDUCTOR_AUTOGRAD_CACHE"] = "0"
    import torch

    from recompile_opt import _torch_internals as ti
    from recompile_opt import models
    from recompile_opt.costs import peak
    from recompile_opt.costs.measure import allocation_timeline
    from recompile_opt.options import parse_options
    from recompile_opt.partitioner import RecompilePartitioner

    torch.set_num_threads(1)
    model, inputs = (models.demo_gpt if args.model == "gpt" else models.demo_llama)()
    partitioners = []

    def backend(gm, example_inputs):
        part = RecompilePartitioner(parse_options(_options(args)))
        partitioners.append(part)
        return ti.compile_fx(gm, example_inputs, config_patches={"custom_partitioner_fn": part})

    compiled = torch.compile(model, backend=backend)

    def step():
        model.zero_grad(set_to_none=True)
        compiled(*inputs).backward()

    step(), step()
    model.zero_grad(set_to_none=True)
    measured = allocation_timeline(lambda: compiled(*inputs).backward())
    part = partitioners[-1]
    plan = part.plans[-1]
    simulated = peak.timeline(part.last_forward, part.last_backward)
    big = args.min_mib * MiB
    live = top = 0
    shown = []
    for nbytes in measured:
        live += nbytes
        top = max(top, live)
        if abs(nbytes) >= big:
            shown.append(f"{nbytes / MiB:+.2f}[{live / MiB:.1f}]")
    print(
        f"{args.model}, options {_options(args)}: kept {plan.saved_bytes / MiB:.2f} MiB; "
        f"peak measured {top / MiB:.2f} MiB, predicted {plan.predicted_peak_bytes / MiB:.2f} MiB"
    )
    print(f"\nmeasured (allocator records, +/-MiB[live MiB after], events of {args.min_mib:g} MiB or more):")
    print(" ".join(shown))
    print("\nsimulated (phase, kernel, +/-MiB, live MiB after, buffer):")
    for phase, kernel, nbytes, live, name in simulated:
        if abs(nbytes) >= big:
            print(f"  {phase:8s} k{kernel:<4d} {nbytes / MiB:+6.2f} {live / MiB:7.2f}  {name}")


if __name__ == "__main__":
    main()
