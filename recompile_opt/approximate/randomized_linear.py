"""Randomized backward of a linear layer (Bershatsky et al. 2022): the forward keeps ``S^T X`` (a
random projection of the layer's input along its rows, ``ratio`` of them) instead of ``X``, and the
backward computes the weight's gradient as ``(dY^T S)(S^T X)``: unbiased, since ``E[S S^T] = I``. The
input's gradient (``dY W``) stays exact.

``S`` is never stored: its entries are ``+-1/sqrt(r)`` (Rademacher) from an integer hash of (seed,
row, column), so the backward makes the same ``S`` from the seed alone, in eager and in Inductor's
code alike (integer shifts, xors and multiplies, no generator state). The seed is one draw of torch's
RNG per forward, so an RNG replay (``fallback_random``) draws the same one and each step's projection
is independent of the last.

``S`` is block-diagonal: each ``BLOCK`` rows of ``X`` are projected to ``ratio * BLOCK`` rows of their
own. Why: a dense ``S`` (``n x ratio n``) costs ``2 ratio n^2 d`` FLOPs, quadratic in the tokens: on a
GPT MLP of 1024 tokens its down-projection's ``S^T X`` cost twice the layer's own matmul, more than
recomputing the layer, so no plan would take it. Blocks of 64 rows cost ``ratio * 64 / d_out`` of the
layer. The estimate stays unbiased (``E[S_b S_b^T] = I`` per block), and for rows that are not
correlated its variance is the dense one's: the cross terms a block sees number ``BLOCK^2`` per block
instead of ``n^2``, each weighed by ``1/(ratio BLOCK)`` instead of ``1/(ratio n)``.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

BLOCK = 64  # rows of X projected together (a diagonal block of S)
_MASK = 0xFFFFFFFF
_MIX = 0x45D9F3B  # a 32-bit integer hash's multiplier (below 2**31: products fit in int64)
_SPREAD = 0x61C88647  # odd, 2**32 / golden ratio (mod 2**32), below 2**31 as _MIX


def projected_rows(rows: int, ratio: float) -> int:
    """``r``: the rows ``S^T X`` keeps, at least one."""
    return max(1, min(rows, round(ratio * rows)))


def projection_block(seed: torch.Tensor, start: int, rows: int, r: int, dtype, device) -> torch.Tensor:
    """Rows ``start : start + rows`` of the ``[n, r]`` projection ``S`` of ``seed`` (a 0-dim int64)."""
    i = torch.arange(start, start + rows, device=device, dtype=torch.int64)[:, None]
    j = torch.arange(r, device=device, dtype=torch.int64)[None, :]
    # the index spread by an odd multiplier, xor-ed with the *hashed* seed, then hashed. The seed
    # unhashed would only permute one S's entries (seeds below r: its columns), and S S^T would not
    # change with it; the index unspread leaves entries a small xor apart, where the hash's output bit
    # is measurably correlated (E[S S^T] off the identity by 2.4x chance over 80k seeds; spread: 1.0x).
    # One hash on the index's path: each xor-shift reads h twice, which Inductor's lowering expands as
    # a tree (two nested hashes: 64-fold), where walking or compiling an approximated graph spent most
    # of its time; the multiply reads it once
    h = _hash((((i * r + j) & _MASK) * _SPREAD) & _MASK ^ _hash(seed & _MASK))
    return ((h & 1) * 2 - 1).to(dtype) / math.sqrt(r)


def _hash(h: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer hash (xor-shift-multiply) in int64 arithmetic."""
    for _ in range(2):
        h = (((h >> 16) ^ h) * _MIX) & _MASK
    return (h >> 16) ^ h


def kept_rows(rows: int, ratio: float) -> int:
    """Rows of :func:`project`'s output for ``rows`` rows of input."""
    full = rows // BLOCK
    return full * projected_rows(BLOCK, ratio) + (projected_rows(rows % BLOCK, ratio) if rows % BLOCK else 0)


def project(seed: torch.Tensor, rows: torch.Tensor, ratio: float) -> torch.Tensor:
    """``S^T @ rows`` for ``rows`` of shape ``[n, d]``, S block-diagonal: ``[kept_rows(n, ratio), d]``,
    each block's projection after the last's (one batched matmul for the full blocks)."""
    n, d = rows.shape
    full = n // BLOCK * BLOCK
    parts = []
    if full:
        r = projected_rows(BLOCK, ratio)
        s = projection_block(seed, 0, full, r, rows.dtype, rows.device).view(-1, BLOCK, r)
        parts.append((s.transpose(1, 2) @ rows[:full].view(-1, BLOCK, d)).reshape(-1, d))
    if full < n:
        r = projected_rows(n - full, ratio)
        parts.append(projection_block(seed, full, n - full, r, rows.dtype, rows.device).t() @ rows[full:])
    return parts[0] if len(parts) == 1 else torch.cat(parts)


def weight_grad(
    grad: torch.Tensor, projected: torch.Tensor, seed: torch.Tensor, ratio: float, project=project
) -> torch.Tensor:
    """The weight's gradient ``(dY^T S)(S^T X)`` from the kept ``projected`` (``S^T X``) and the seed;
    ``project``: this module's, or the plan's op of it (``actions.randomized_project``)."""
    return project(seed, grad.reshape(-1, grad.shape[-1]), ratio).t() @ projected


class RandomizedLinear(torch.autograd.Function):
    """``F.linear(x, weight, bias)`` whose backward makes the weight's gradient from ``S^T X``."""

    @staticmethod
    def forward(ctx, x, weight, bias, ratio: float, seed):
        rows = x.reshape(-1, x.shape[-1])
        ctx.ratio, ctx.has_bias = ratio, bias is not None
        ctx.save_for_backward(project(seed, rows.detach(), ratio), weight, seed)
        return F.linear(x, weight, bias)

    @staticmethod
    def backward(ctx, grad):
        x_proj, weight, seed = ctx.saved_tensors
        grad_rows = grad.reshape(-1, grad.shape[-1])
        grad_x = grad @ weight if ctx.needs_input_grad[0] else None
        grad_w = weight_grad(grad, x_proj, seed, ctx.ratio) if ctx.needs_input_grad[1] else None
        grad_b = grad_rows.sum(0) if ctx.has_bias and ctx.needs_input_grad[2] else None
        return grad_x, grad_w, grad_b, None, None


def randomized_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    ratio: float,
    seed: torch.Tensor | None = None,
) -> torch.Tensor:
    """A linear layer whose backward keeps ``ratio`` of its input's rows as a random projection.
    ``seed``: a 0-dim int64 tensor (drawn from torch's RNG when None)."""
    if isinstance(ratio, bool) or not isinstance(ratio, (int, float)) or not 0 < ratio <= 1:
        raise ValueError(f"randomized linear: ratio {ratio!r}; accepted: a number in (0, 1]")
    if seed is None:
        seed = torch.randint(0, 2**31 - 1, (), device=x.device)
    return RandomizedLinear.apply(x, weight, bias, float(ratio), seed)
