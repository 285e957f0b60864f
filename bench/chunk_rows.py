"""The chunked LM-head loss op's time against its rows per chunk (issue 23: why the planner keeps a floor
of rows per chunk, ``recompile_opt.planner.chunk_choice.min_rows``).

``torch.ops.recompile_opt.chunked_head_loss`` at T=512 tokens, vocabulary 32000, width 256, fp32, two
threads, in k = 1..128 chunks; best of five calls each, over the unchunked call. Prints the provenance
line and a Markdown table (docs/design.md, "The planner's choice").

``--ms``: milliseconds instead, at T=2048 with a ``mean``'s scale and every 7th token ignored, in 1, 8
and 32 chunks, one row per body of the op (ATen's kernels; ``fused``: Inductor's, passes/loss_body.py,
compiled before the timing): to compare the bodies' passes over each chunk's logits, where the ratios
above stay put. On CUDA where there is one, in bf16 as autocast runs the head (CPU: fp32).

Usage::

    python bench/chunk_rows.py [--ms]
"""

import sys
import time

import torch

from recompile_opt.provenance import header_line

torch.set_num_threads(2)
V, h = 32000, 256


DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def inputs(tokens: int, ignored: bool):
    """Tokens, head weight, targets (every 7th ignored if ``ignored``) and a mean's scale (or None)."""
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(tokens, h, generator=g), torch.randn(V, h, generator=g) * 0.02
    t = torch.randint(0, V, (tokens,), generator=g)
    if not ignored:
        return x, w, t, None
    t[::7] = -100
    scale = torch.tensor(1.0 / (t != -100).sum().item())
    return tuple(a.to(DEVICE) for a in (x, w, t, scale))


def best(k: int, x, w, t, scale, fused: bool = False) -> float:
    """Seconds of the best of five calls in ``k`` chunks, after one call; the head's matmuls in bf16
    on CUDA (as under autocast), the loss in fp32."""
    mm_dtype = torch.bfloat16 if x.is_cuda else torch.float32

    def run():
        out = torch.ops.recompile_opt.chunked_head_loss(
            x, w, None, t, k, torch.float32, -100, 0.0, True, True, False, mm_dtype, mm_dtype, scale, fused
        )
        if x.is_cuda:
            torch.cuda.synchronize()
        return out

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
    print(header_line())
    print()
    if ms:
        print(f"| body ({DEVICE}), chunks | " + " | ".join(str(k) for k in ks) + " |")
        print("|---|" + "---|" * len(ks))
        for fused in (False, True):
            s = {k: best(k, *data, fused=fused) for k in ks}
            print(
                f"| {'fused' if fused else 'aten'} ms | " + " | ".join(f"{s[k] * 1e3:.1f}" for k in ks) + " |"
            )
    else:
        s = {k: best(k, *data) for k in ks}
        print("| rows per chunk | " + " | ".join(str(tokens // k) for k in ks) + " |")
        print("|---|" + "---|" * len(ks))
        print("| time | " + " | ".join(f"{s[k] / s[1]:.2f}x" for k in ks) + " |")


if __name__ == "__main__":
    main("--ms" in sys.argv[1:])
