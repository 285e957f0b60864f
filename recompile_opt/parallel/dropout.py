"""Dropout on a rank's shard that applies the single-process mask's slice (issue 22, part 3).

Why not let each rank draw its own mask: the generator a rank draws from is the one every rank shares
(the same seed on each rank of the group, as the replicated values need), so a mask drawn at the
shard's size would be the first rows of the full mask on every rank (the same rows over and over),
and the generator would advance less than in one process, shifting every later draw. Drawing the full
mask (the same op on the same shape as one process: ``native_dropout`` draws what ``dropout`` draws)
and keeping the rank's slice gives each rank exactly the mask one process gives its rows or heads, and
every rank's generator stays where one process's would be. Inductor computes only the slice of a
fused ``rand(full) > p``; in eager the full mask exists for a moment (one bool per element).

Attention with an in-kernel dropout (SDPA's ``dropout_p``) on a rank's heads is computed as SDPA's
own math path computes it with an explicit mask (softmax of the scaled scores, masked, times v): the
mask is then the slice of the one the single-process math path draws.
"""

from __future__ import annotations

import math

import torch

from recompile_opt.parallel.collectives import copy_of_rows

aten = torch.ops.aten

Slices = tuple  # of (dim, start, length): the rank's part of each sharded dimension


def kept_slice(full_shape, p: float, like: torch.Tensor, slices: Slices) -> torch.Tensor:
    """The rank's slice of the keep-mask one process draws for a tensor of ``full_shape``, as a bool
    tensor of its own (a view would keep the whole mask alive wherever the slice is kept; a clone of a
    contiguous slice is dropped by Inductor as a no-op, see ``collectives.copy_of_rows``)."""
    _, keep = aten.native_dropout(torch.ones(full_shape, dtype=like.dtype, device=like.device), p, True)
    for dim, start, length in slices:
        keep = copy_of_rows(keep, dim, start, length)
    return keep


def sliced_dropout(x: torch.Tensor, p: float, train: bool, full_shape, slices: Slices) -> torch.Tensor:
    """``aten.dropout(x, p, train)`` for a rank's shard ``x`` of a tensor of ``full_shape``."""
    return sliced_native_dropout(x, p, train, full_shape, slices)[0]


def sliced_native_dropout(x: torch.Tensor, p: float, train: bool | None, full_shape, slices: Slices):
    """``aten.native_dropout(x, p, train)``: the output and the rank's slice of the keep-mask. The mask
    is applied by ``native_dropout_backward`` (x * mask * scale), whose own backward reads the bool
    mask: what a plan keeps is 1 byte per element, as for one process's dropout, not a scaled copy."""
    if train is False or p == 0:
        return x.clone(), torch.ones_like(x, dtype=torch.bool)
    if p == 1:
        return x * 0, torch.zeros_like(x, dtype=torch.bool)
    keep = kept_slice(full_shape, p, x, slices)
    return aten.native_dropout_backward(x, keep, 1 / (1 - p)), keep


def sliced_attention(
    q,
    k,
    v,
    attn_mask=None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    *,
    scale: float | None = None,
    enable_gqa: bool = False,
    full_shape=(),
    slices: Slices = (),
):
    """``F.scaled_dot_product_attention`` on a rank's heads with the slice of one process's dropout mask
    (``full_shape``: the attention probabilities' global shape ``[b, heads, L, S]``)."""
    if enable_gqa and k.shape[-3] != q.shape[-3]:
        k = k.repeat_interleave(q.shape[-3] // k.shape[-3], -3)
        v = v.repeat_interleave(q.shape[-3] // v.shape[-3], -3)
    scores = q @ k.transpose(-2, -1) * (scale if scale is not None else 1 / math.sqrt(q.shape[-1]))
    length, source = q.shape[-2], k.shape[-2]
    if is_causal:
        causal = torch.ones(length, source, dtype=torch.bool, device=q.device).tril()
        scores = scores.masked_fill(causal.logical_not(), float("-inf"))
    if attn_mask is not None:
        scores = (
            scores.masked_fill(attn_mask.logical_not(), float("-inf"))
            if attn_mask.dtype == torch.bool
            else scores + attn_mask
        )
    probs = torch.softmax(scores, -1)
    if dropout_p > 0:
        keep = kept_slice(full_shape, dropout_p, probs, slices)
        probs = probs.masked_fill(keep.logical_not(), 0.0) * (1 / (1 - dropout_p))
    return probs @ v
