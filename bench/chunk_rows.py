"""The chunked LM-head loss op's time against its rows per chunk (issue 23: why the planner keeps a floor
of rows per chunk, ``recompile_opt.planner.chunk_choice.min_rows``).

``torch.ops.recompile_opt.chunked_head_loss`` at T=512 tokens, vocabulary 32000, width 256, fp32, two
threads, in k = 1..128 chunks; best of five calls each, over the unchunked call. Prints the provenance
line and a Markdown table (docs/design.md, "The planner's choice").

``--ms``: milliseconds instead, at T=2048 with a ``mean``'s scale and every 7th token ignored, in 1, 8
and 32 chunks: to compare two versions of the op's body (its passes over each chunk's logits), where the
ratios above stay put.

Usage::

    python bench/chunk_rows.py [--ms]
"""

import sys
import time

import torch

from recompile_opt.provenance import header_line

torch.set_num_threads(2)
V, h = 32000, 256


def inputs(tokens: int, ignored: bool):
    """Tokens, head weight, targets (every 7th ignored if ``ignored``) and a mean's scale (or None)."""
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(tokens, h, generator=g), torch.randn(V, h, generator=g) * 0.02
    t = torch.randint(0, V, (tokens,), generator=g)
    if not ignored:
        return x, w, t, None
    t[::7] = -100
    return x, w, t, torch.tensor(1.0 / (t != -100).sum().item())


def best(k: int, x, w, t, scale) -> float:
    """Seconds of the best of five calls in ``k`` chunks, after one call."""

    def run():
        return torch.ops.recompile_opt.chunked_head_loss(
            x, w, None, t, k, torch.float32, -100, 0.0, True, True, False, scale=scale
        )

    run()
    times = []
    for _ in range(5):
        t0 = time.perf_counter()
        run()
        times.append(time.perf_counter() - t0)
    return min(times)


def main(ms: bool) -> None:
    tokens, ks = (2048, [1, 8, 32]) if ms else (512, [1, 2, 4, 8, 16, 32, 64, 128])
    data = inputs(tokens, ignored=ms)
    s = {k: best(k, *data) for k in ks}
    print(header_line())
    print()
    if ms:
        print("| chunks | " + " | ".join(str(k) for k in ks) + " |")
        print("|---|" + "---|" * len(ks))
        print("| ms | " + " | ".join(f"{s[k] * 1e3:.1f}" for k in ks) + " |")
    else:
        print("| rows per chunk | " + " | ".join(str(tokens // k) for k in ks) + " |")
        print("|---|" + "---|" * len(ks))
        print("| time | " + " | ".join(f"{s[k] / s[1]:.2f}x" for k in ks) + " |")


if __name__ == "__main__":
    main("--ms" in sys.argv[1:])
