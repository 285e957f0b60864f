"""Plan every setting stored in bench/measured_peaks.json afresh and print one line per plan (kept
bytes, recompute FLOPs, predicted peak, the saved/recomputed names' hash): a check that a change which
should not move plans (a refactor, a module move) moves none. Compare two runs with diff.

    python bench/plan_digest.py > before.txt; ...; python bench/plan_digest.py > after.txt;
    diff before.txt after.txt
"""

from __future__ import annotations

import hashlib
import json
import os
import sys

os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")


def main() -> None:
    import torch

    import recompile_opt
    from recompile_opt import models

    torch.set_num_threads(1)
    here = os.path.dirname(os.path.abspath(__file__))
    stored = json.load(open(os.path.join(here, "measured_peaks.json")))
    sys.path.insert(0, here)
    from peak_accuracy import options

    for row in stored:
        factory = {"gpt": models.demo_gpt, "llama": models.demo_llama}[row["model"]]
        model, inputs = factory()
        recompile_opt.reset_plans()
        plans = recompile_opt.plan(model, inputs, **options(row["setting"]))
        for p in plans if isinstance(plans, list) else [plans]:
            names = sorted(
                [e.name + ":keep" for e in p.saved] + [e.name + ":recompute" for e in p.recomputed]
            )
            digest = hashlib.sha256("\n".join(names).encode()).hexdigest()[:12]
            print(
                f"{row['model']:6s} {row['setting']:20s} kept {p.saved_bytes:>10d} recompute_flops "
                f"{p.recompute_flops:>12d} peak {p.predicted_peak_bytes} names {digest}",
                flush=True,
            )


if __name__ == "__main__":
    main()
