"""Plans under ``peak_memory`` limits between a model's least peak and save-all's: the recompute each
limit costs, which should fall as the limit rises, and never exceed the 0.0 plan's where that fits.

Why: the limit search walks few plans (two on a deep stack) and takes the least recompute among those
that fit; where it spends its walks decides what it finds (docs/design.md, "peak_memory").

    python bench/limit_sweep.py [--models gpt-v8192,olmo] [--shares 0.02,0.05,0.2,0.5]

Each limit is the least-peak plan's predicted peak plus the share of the way to save-all's; unchunked
plans (``chunks=False``), so that recompute is the only price. Prints a markdown table.
"""

from __future__ import annotations

import argparse
import time
import warnings

import torch

import recompile_opt
from recompile_opt import models
from recompile_opt.provenance import header_line


def gpt_v8192():
    """A 4-layer GPT whose logits dominate (vocabulary 8192, h 64, s 128, b 2)."""
    cfg = models.GPTConfig(n_layer=4, n_head=4, n_embd=64, block_size=128, vocab_size=8192)
    torch.manual_seed(0)
    return models.GPT(cfg), models.example_batch(cfg, 2)


def olmo():
    """A Hugging Face OLMo (4 layers, h 64, vocabulary 4096, SDPA, its own loss), s 128, b 2."""
    import transformers

    cfg = transformers.OlmoConfig(
        vocab_size=4096,
        hidden_size=64,
        intermediate_size=256,
        num_hidden_layers=4,
        num_attention_heads=4,
        max_position_embeddings=256,
        eos_token_id=None,
    )
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    ids = torch.randint(0, cfg.vocab_size, (2, 128))
    return _LabelsLoss(transformers.OlmoForCausalLM(cfg)), (ids,)


class _LabelsLoss(torch.nn.Module):
    """A causal LM's own loss on its inputs as labels."""

    def __init__(self, lm):
        super().__init__()
        self.lm = lm

    def forward(self, ids):
        return self.lm(input_ids=ids, labels=ids).loss


MODELS = {"gpt-v8192": gpt_v8192, "olmo": olmo}


def sweep(name: str, shares: list[float]) -> list[str]:
    model, inputs = MODELS[name]()

    def plan(**options):
        start = time.perf_counter()
        return recompile_opt.plan(model, inputs, chunks=False, **options), time.perf_counter() - start

    (least, t0), (save_all, _) = plan(memory_budget=0.0), plan(memory_budget=1.0)
    rows = [_row(name, "memory_budget 0.0", least, t0)]
    for share in shares:
        span = save_all.predicted_peak_bytes - least.predicted_peak_bytes
        limit = int(least.predicted_peak_bytes + share * span)
        p, seconds = plan(peak_memory=limit)
        rows.append(_row(name, f"{share:.0%} of the way: {limit / 2**20:.2f} MiB", p, seconds))
    return rows


def _row(name: str, request: str, p, seconds: float) -> str:
    return (
        f"| {name} | {request} | {p.predicted_peak_bytes / 2**20:.2f} ({p.solver.get('peak_from')}) "
        f"| {p.recompute_s * 1e3:.3f} | {seconds:.1f} |"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--shares", default="0.02,0.05,0.2,0.5")
    args = ap.parse_args()
    shares = [float(s) for s in args.shares.split(",")]
    print(header_line(), end="\n\n")
    print("| model | request | predicted peak MiB | recompute ms (est.) | planning s |")
    print("|---|---|---|---|---|")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for name in args.models.split(","):
            for row in sweep(name, shares):
                print(row, flush=True)


if __name__ == "__main__":
    main()
