"""Predicted against measured peaks on models written outside this project (the ViT with torchvision's
names, ``nn.TransformerEncoder``, ``nn.TransformerDecoder`` of ``tests/test_outside_models.py``), each
compiled by Inductor at every policy and budgets 0.0 / 0.5: the figures behind the 10% check of
``test_outside_models.py::test_predicted_peak_is_within_10_percent_of_the_measured_step``.

Usage::

    python bench/outside_peaks.py                 # all three models (~3 min cold)
    python bench/outside_peaks.py --models vit
"""

from __future__ import annotations

import argparse
import os
import sys

os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")
SETTINGS = ({"memory_budget": 0.0}, {"memory_budget": 0.5}, {"policy": "full"}, {"policy": "megatron-selective"},
            {"policy": "save-all"})


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", default="vit,encoder,decoder")
    args = p.parse_args(argv)
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
    from test_outside_models import _predicted_and_measured

    from recompile_opt.provenance import header_line

    print(header_line() + "\n")
    print("| model | setting | predicted B | from | measured B | error |\n|---|---|---|---|---|---|")
    for name in args.models.split(","):
        for setting in SETTINGS:
            predicted, measured, source = _predicted_and_measured(name, setting, with_source=True)
            print(f"| {name} | {setting} | {predicted} | {source} | {measured} | "
                  f"{100 * (predicted - measured) / measured:+.1f}% |", flush=True)


if __name__ == "__main__":
    main()
