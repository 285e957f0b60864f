"""Absolute time of the chunked LM-head loss op (``torch.ops.recompile_opt.chunked_head_loss``) with a
``mean``'s scale and ignored tokens, at T=2048 tokens, vocabulary 32000, width 256, fp32, two threads, in
1, 8 and 32 chunks; best of five calls. Where ``bench/chunk_rows.py`` gives the time over the unchunked
call, this gives milliseconds, to compare two versions of the op's body (the passes over each chunk's
logits).

Usage::

    python bench/head_loss_time.py
"""

import time

import torch

import recompile_opt  # noqa: F401 -- registers the op
from recompile_opt.provenance import header_line

torch.set_num_threads(2)
T, V, h = 2048, 32000, 256
g = torch.Generator().manual_seed(0)
x, w = torch.randn(T, h, generator=g), torch.randn(V, h, generator=g) * 0.02
t = torch.randint(0, V, (T,), generator=g)
t[::7] = -100
scale = torch.tensor(1.0 / (t != -100).sum().item())


def best(k: int) -> float:
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


ks = [1, 8, 32]
ms = {k: best(k) * 1e3 for k in ks}
print(header_line())
print()
print("| chunks | " + " | ".join(str(k) for k in ks) + " |")
print("|---|" + "---|" * len(ks))
print("| ms | " + " | ".join(f"{ms[k]:.1f}" for k in ks) + " |")
