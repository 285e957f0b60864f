"""Approximate backward (issue 24): what the least-peak plan gains with few-bit activations and randomized
linear backward, predicted and measured, and what training with them loses.

Memory (``--memory``): the benchmark GPT and Llama (``bench/compare.py``'s "small" size: 2 layers,
width 256, 4 heads, sequence 256, batch 4, vocabulary 512, fp32, CPU) compiled by Inductor at
``memory_budget=0.0`` (the least-peak plan), exact and with ``approximate`` allowing 3-bit activation
codes, randomized linear at ratio 0.5, or both. For each: the plan's kept bytes and predicted peak, the
measured bytes saved for the backward (``recompile_opt.costs.measure.saved_bytes``) and the measured
step peak (``memory_profile``: live bytes above the pre-step baseline), the median step time, what the
plan approximated, and the whole gradient's cosine similarity to exact (one step, same batch).

Training (``--training``): ``bench/approximate_training.py``: a small GPT trained on a learnable synthetic
task, exact and with the approximate ops at every site, several seeds (loss curves, final losses).

Usage (the training options, e.g. ``--steps``, ``--seeds``, ``--plot``, go to ``approximate_training``)::

    python bench/approximate.py --memory --md
    python bench/approximate.py --training --steps 300 --seeds 0,1,2 --plot docs/approximate_training.png
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

MiB = 1 << 20
SIZE = {"layers": 2, "embd": 256, "heads": 4, "seq": 256, "batch": 4, "vocab": 512, "dropout": 0.0}
VARIANTS = {  # label -> option ``approximate``
    "exact": None,
    "3-bit activations": {"activations": 3},
    "randomized linear 0.5": {"linear": 0.5},
    "both": {"activations": 3, "linear": 0.5},
}


def measure_variant(model_name: str, approximate: dict | None, steps: int) -> dict:
    import torch
    from comparison.strategies import build_model

    import recompile_opt
    from recompile_opt.costs import measure

    torch._dynamo.reset()
    recompile_opt.reset_plans()
    model, idx, tgt = build_model({"model": model_name, **SIZE})
    options = {"memory_budget": 0.0, "approximate": approximate}
    fn = torch.compile(model, backend="recompile_opt", options=options)

    def step():
        model.zero_grad(set_to_none=True)
        fn(idx, tgt).backward()

    start = time.perf_counter()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        step()
    out = {"compile_s": time.perf_counter() - start}
    torch.manual_seed(0)
    step()
    out["grad"] = torch.cat([p.grad.flatten() for p in model.parameters()])
    out["saved_bytes"] = measure.saved_bytes(lambda: fn(idx, tgt), exclude=list(model.parameters()))
    model.zero_grad(set_to_none=True)
    out["peak_bytes"] = measure.memory_profile(lambda: fn(idx, tgt).backward()).peak_bytes
    out["step_s"] = statistics.median(measure.step_time(step, steps=steps, warmup=1))
    plans = recompile_opt.last_plans()
    out["plan_saved_bytes"] = sum(p.saved_bytes for p in plans)
    out["predicted_peak_bytes"] = max(p.predicted_peak_bytes for p in plans)
    out["approximated"] = [a for p in plans for a in p.approximated]
    return out


def memory_table(models: list[str], steps: int, log=print) -> list[dict]:
    import torch.nn.functional as F

    rows = []
    for model_name in models:
        exact = None
        for label, approximate in VARIANTS.items():
            r = measure_variant(model_name, approximate, steps)
            exact = exact or r
            r.update(
                model=model_name,
                variant=label,
                cosine=float(F.cosine_similarity(r["grad"], exact["grad"], dim=0)),
                peak_vs_exact=r["peak_bytes"] / exact["peak_bytes"] - 1,
                predicted_vs_exact=r["predicted_peak_bytes"] / exact["predicted_peak_bytes"] - 1,
            )
            rows.append(r)
            log(_line(r))
    return rows


def _approximated(r: dict) -> str:
    bits = sum(a["kind"] == "few-bit" for a in r["approximated"])
    linear = sum(a["kind"] == "randomized" for a in r["approximated"])
    return f"{bits} codes, {linear} projections" if bits or linear else "-"


def _line(r: dict) -> str:
    return (
        f"{r['model']:<6} {r['variant']:<22} kept {r['plan_saved_bytes'] / MiB:6.2f} (measured "
        f"{r['saved_bytes'] / MiB:6.2f}) MiB  peak predicted {r['predicted_peak_bytes'] / MiB:6.2f} measured "
        f"{r['peak_bytes'] / MiB:6.2f} MiB ({100 * r['peak_vs_exact']:+.1f}% vs exact)  step "
        f"{1e3 * r['step_s']:.1f} ms  cosine {r['cosine']:.4f}  approximated: {_approximated(r)}"
    )


def markdown(rows: list[dict]) -> str:
    from recompile_opt.provenance import header_line

    lines = [
        header_line(),
        "",
        "| model | allowed | approximated | kept MiB (measured) | predicted peak MiB | measured peak MiB "
        "| peak vs exact | step ms | gradient cosine |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['model']} | {r['variant']} | {_approximated(r)} | {r['plan_saved_bytes'] / MiB:.2f} "
            f"({r['saved_bytes'] / MiB:.2f}) | {r['predicted_peak_bytes'] / MiB:.2f} | "
            f"{r['peak_bytes'] / MiB:.2f} | {100 * r['peak_vs_exact']:+.1f}% | {1e3 * r['step_s']:.1f} | "
            f"{r['cosine']:.4f} |"
        )
    return "\n".join(lines)


def cosine_by_bits(models: list[str]) -> list[str]:
    """The whole gradient's cosine to exact with *every* activation's backward at 1-4 bits (eager, one
    step): the most error a plan allowing that width can add, whatever the planner chooses."""
    from unittest import mock

    import torch
    import torch.nn.functional as F
    from comparison.strategies import build_model

    from recompile_opt import models as zoo
    from recompile_opt.approximate.few_bit import few_bit_activation

    lines = ["| model | 1 bit | 2 bits | 3 bits | 4 bits |", "|---|---|---|---|---|"]
    for name in models:
        model, idx, tgt = build_model({"model": name, **SIZE})

        def grad():
            model.zero_grad(set_to_none=True)
            model(idx, tgt).backward()
            return torch.cat([p.grad.flatten() for p in model.parameters()])

        exact, cells = grad(), []
        for bits in (1, 2, 3, 4):
            act = "silu" if name == "llama" else "gelu"
            patch = (
                mock.patch.object(
                    F, "silu", lambda x, inplace=False, b=bits: few_bit_activation(x, "silu", b)
                )
                if act == "silu"
                else mock.patch.object(
                    zoo.F, "gelu", lambda x, approximate="none", b=bits: few_bit_activation(x, "gelu", b)
                )
            )
            with patch:
                cells.append(f"{float(F.cosine_similarity(grad(), exact, dim=0)):.5f}")
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return lines


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--memory", action="store_true", help="least-peak plans, exact and approximate")
    parser.add_argument("--training", action="store_true", help="loss curves (bench/approximate_training.py)")
    parser.add_argument(
        "--cosine", action="store_true", help="gradient cosine with every activation at 1-4 bits"
    )
    parser.add_argument("--models", default="gpt,llama")
    parser.add_argument("--timed-steps", type=int, default=5, help="timed steps per variant (--memory)")
    parser.add_argument("--md", action="store_true", help="print the memory table as markdown (--memory)")
    args, rest = parser.parse_known_args(argv)
    if not (args.memory or args.training or args.cosine):
        args.memory = True
    if args.cosine:
        from recompile_opt.provenance import header_line

        print(
            "\n".join(
                [header_line(), "", *cosine_by_bits([m.strip() for m in args.models.split(",") if m.strip()])]
            )
        )
    if args.memory:
        import torch

        torch.set_num_threads(1)
        rows = memory_table([m.strip() for m in args.models.split(",") if m.strip()], args.timed_steps)
        if args.md:
            print(markdown(rows))
    if args.training:
        import approximate_training

        return approximate_training.main(rest)
    return 0


if __name__ == "__main__":
    sys.exit(main())
