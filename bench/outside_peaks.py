"""Predicted against measured peaks on models written outside this project, each step compiled by
Inductor: the ViT with torchvision's names, ``nn.TransformerEncoder`` / ``Decoder``
(``tests/test_outside_models.py``) at every policy and budgets 0.0 / 0.5; a ResNet-18-style CNN and
Hugging Face T5, Gemma2, Qwen3-MoE and Whisper (``tests/test_hf_layers.py``, tiny random configs) at
0.0, 0.5, a byte budget and a ``peak_memory`` limit. Each model's eager and plain ``torch.compile``
peaks are measured too (``eager``, ``inductor`` rows).

The byte budget is halfway between the least-peak plan's kept bytes and save-all's; the limit is 5%
over the least-peak plan's predicted peak (the hardest place for a limit to hold). ``from``: walked in
Inductor's generated code, or simulated by the kernel model; ``kernel model``: the simulator's figure
for the same plan, the one the search ranks plans by.

Usage::

    python bench/outside_peaks.py                       # every model (~25 min cold on 2 cores)
    python bench/outside_peaks.py --models resnet,t5
"""

from __future__ import annotations

import argparse
import os
import sys

os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")
POLICIES = (
    {"memory_budget": 0.0},
    {"memory_budget": 0.5},
    {"policy": "full"},
    {"policy": "megatron-selective"},
    {"policy": "save-all"},
)
LIMITS = ("byte budget", "peak_memory")  # derived from the 0.0 plan (module docstring)


def builders() -> dict:
    """Every model this bench measures, by name: a function giving ``(model, inputs)``."""
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
    import test_hf_layers
    import test_outside_models

    out = {**test_outside_models.MODELS, **test_outside_models.CONV_MODELS}
    out.update({name: (lambda n=name: test_hf_layers.build(n, "loss")) for name in test_hf_layers.MODELS})
    return out


def measure(model, inputs, setting: dict):
    """``(plan, measured peak)`` of one recompile_opt step under ``setting`` after a training step."""
    import torch
    from helpers import train_side_by_side

    torch._dynamo.reset()
    return train_side_by_side(
        model, inputs, options=setting, steps=1, rtol=1e-4, atol=1e-5, measure_peak=True
    )


def rows(name: str, build):
    """The model's table rows: eager, plain Inductor, then each setting's plan."""
    from test_outside_models import _measured_peak

    model, inputs = build()
    for label, backend in (("eager", None), ("inductor", "inductor")):
        yield f"| {name} | {label} | | | | {_measured_peak(model, inputs, backend)} | |"
    settings = list(POLICIES) if name in ("vit", "encoder", "decoder") else list(POLICIES[:2]) + list(LIMITS)
    least = None
    for setting in settings:
        if setting == "byte budget":
            setting = {"memory_budget": (least.budget_bytes + least.baseline_bytes) // 2}
        elif setting == "peak_memory":
            setting = {"peak_memory": int(least.predicted_peak_bytes * 1.05)}
        plan, measured = measure(model, inputs, setting)
        least = least or plan
        predicted, limit = plan.predicted_peak_bytes, setting.get("peak_memory")
        held = "" if limit is None else (" (under the limit)" if measured <= limit else " **over the limit**")
        yield (
            f"| {name} | {setting} | {predicted} | {plan.solver.get('peak_from')} | "
            f"{plan.peak_breakdown['total']} | {measured}{held} | "
            f"{100 * (predicted - measured) / measured:+.1f}% |"
        )


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    every = builders()
    p.add_argument("--models", default=",".join(every), help=f"comma-separated, of: {', '.join(every)}")
    args = p.parse_args(argv)
    from recompile_opt.provenance import header_line

    print(header_line() + "\n")
    print("| model | setting | predicted B | from | kernel model B | measured B | error |")
    print("|---|---|---|---|---|---|---|")
    for name in args.models.split(","):
        for row in rows(name, every[name]):
            print(row, flush=True)


if __name__ == "__main__":
    main()
