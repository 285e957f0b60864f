"""The chunked LM-head loss op's time against its rows per chunk (issue 23: why the planner keeps a floor
of rows per chunk, ``recompile_opt.planner.chunk_choice.min_rows``).

``torch.ops.recompile_opt.chunked_head_loss`` at T=512 tokens, vocabulary 32000, width 256, fp32, two
threads, in k = 1..128 chunks; best of five calls each, over the unchunked call. Prints the provenance
line and a Markdown table (docs/design.md, "The planner's choice").

Usage::

    python bench/chunk_rows.py
"""

import time

import torch

from recompile_opt.provenance import header_line

torch.set_num_threads(2)
T, V, h = 512, 32000, 256
x, w, t = torch.randn(T, h), torch.randn(V, h) * 0.02, torch.randint(0, V, (T,))


def best(k):
    def run():
        return torch.ops.recompile_opt.chunked_head_loss(
            x, w, None, t, k, torch.float32, -100, 0.0, True, True, False
        )

    run()
    times = []
    for _ in range(5):
        t0 = time.perf_counter()
        run()
        times.append(time.perf_counter() - t0)
    return min(times)


ks = [1, 2, 4, 8, 16, 32, 64, 128]
s = {k: best(k) for k in ks}
print(header_line())
print()
print("| rows per chunk | " + " | ".join(str(T // k) for k in ks) + " |")
print("|---|" + "---|" * len(ks))
print("| time | " + " | ".join(f"{s[k] / s[1]:.2f}x" for k in ks) + " |")
