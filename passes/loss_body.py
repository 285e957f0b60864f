"""One chunk's cross-entropy and the gradient of its logits: the body of the chunked head loss
(:func:`recompile_opt.passes.chunking.head_loss_in_chunks`), two ways.

:func:`aten_loss_and_grad` runs ATen's kernels one after the other, in the logits' own buffer. Each is
a pass over the chunk: under bf16 autocast the upcast copy, the max, the subtraction, the exponential,
the sum, the row factor and the downcast (the one-hot's ``scatter_add`` touches one logit a row), 46
bytes moved per logit where the fused kernels move 10 (:func:`bytes_per_logit`); on the H200 those
passes took 15-17 ms of the GPU GPT's 70 ms least-peak step (docs/gpu.md).

:func:`fused_loss_and_grad_` is the same arithmetic written as one functional body for Inductor
(``torch.compile``: on the CPU a reduction kernel and a pointwise kernel that reads the mm-dtype logits
and writes their gradient back into them; on CUDA expected alike, not measured there yet), compiled
once per dtype, vocabulary and loss settings, its rows dynamic (the last chunk is a row shorter where
k does not divide the tokens). Why Inductor and not a kernel of ours: it is the project's kernel
generator; the body stays PyTorch. Where it cannot compile, the ATen body runs instead, with a
warning. Why not on the CPU by default: Inductor's C++ kernels of this body measured no faster than
ATen's there (``bench/chunk_rows.py --ms``).
"""

from __future__ import annotations

import warnings

import torch

from recompile_opt import _torch_internals as ti

_BROKEN: set[str] = set()  # device types where the fused body failed to compile: the ATen body runs


def aten_loss_and_grad(logits, target, ignore_index: int, label_smoothing: float, scale=None):
    """Summed cross-entropy of one chunk and its gradient with respect to the logits, times ``scale``
    (None: 1), the gradient made in the logits' own buffer. Why in place: this runs eagerly inside one
    op, where each elementwise op would allocate a chunk-sized buffer (six of them alive at once,
    measured as the op's workspace), and the step's peak at the loss is this workspace. Why the row
    factors folded into one multiply (the softmax's ``1 / sum``, the ignored rows' 0, the ``mean``'s
    scale): each is a pass over the chunk."""
    counted = target != ignore_index
    safe = torch.where(counted, target, 0).unsqueeze(1)
    vocab = logits.shape[-1]
    picked = logits.gather(1, safe).squeeze(1)
    mean = logits.mean(-1) if label_smoothing else None
    top = logits.amax(-1, keepdim=True)
    grad = logits.sub_(top).exp_()  # torch.logsumexp would allocate this chunk-sized buffer besides
    total = grad.sum(-1, keepdim=True)
    lse = (top + total.log()).squeeze(1)
    nll = lse - picked
    if label_smoothing:  # the mean over the classes of -log p = lse - mean(logits)
        nll = (1 - label_smoothing) * nll + label_smoothing * (lse - mean)
    loss = torch.where(counted, nll, 0).sum()
    row = counted.unsqueeze(1).to(grad.dtype)  # each row's factor: 0 where ignored, else scale
    if scale is not None:
        row = row * scale
    grad.mul_(row / total)  # softmax times the row's factor, in one pass
    grad.scatter_add_(1, safe, row * (label_smoothing - 1))
    if label_smoothing:
        grad.sub_(row * (label_smoothing / vocab))
    return loss, grad


def bytes_per_logit(fused: bool, mm_itemsize: int, itemsize: int) -> int:
    """Bytes the body moves per logit, the head's matmul writing them included (the gradient matmuls'
    reads of the result are theirs: ``chunking._traffic``). ATen's: the upcast (where the loss's dtype
    is wider), the max, subtract, exp, sum and multiply in the loss's dtype (8 of its elements), the
    downcast (fp32 36 B; bf16 logits and an fp32 loss 46 B). Fused: the matmul's write, two
    reductions' reads and the gradient's read and write, in the matmul's dtype (fp32 20 B, bf16 10 B)."""
    if fused:
        return 5 * mm_itemsize
    cast = 2 * (mm_itemsize + itemsize) if itemsize != mm_itemsize else 0
    return mm_itemsize + cast + 8 * itemsize


def _functional_body(raw, target, ignore_index: int, label_smoothing: float, scale, logits_dtype, dtype):
    """:func:`aten_loss_and_grad` on ``raw.to(logits_dtype).to(dtype)`` without a buffer of its own:
    the gradient, rounded as eager rounds it (to ``logits_dtype``, then to ``raw``'s dtype), written back
    into ``raw``; returns the summed loss. The one-hot of the targets is a comparison with the class
    index, which fuses, where ``scatter_add`` would be a kernel of its own. The softmax is
    ``exp(logits - lse)``, as eager's log-softmax backward has it: reusing the sum's ``exp`` made
    Inductor keep it, an fp32 buffer of the chunk (measured on the CPU)."""
    logits = raw.to(logits_dtype).to(dtype)
    counted = target != ignore_index
    safe = torch.where(counted, target, 0).unsqueeze(1)
    vocab = logits.shape[-1]
    top = logits.amax(-1, keepdim=True)
    lse = top + (logits - top).exp().sum(-1, keepdim=True).log()
    nll = (lse - logits.gather(1, safe)).squeeze(1)
    if label_smoothing:
        nll = (1 - label_smoothing) * nll + label_smoothing * (lse.squeeze(1) - logits.mean(-1))
    loss = torch.where(counted, nll, 0).sum()
    row = counted.unsqueeze(1).to(dtype)
    if scale is not None:
        row = row * scale
    hit = torch.arange(vocab, device=raw.device) == safe
    grad = (logits - lse).exp() * row + torch.where(hit, row * (label_smoothing - 1), 0)
    if label_smoothing:
        grad = grad - row * (label_smoothing / vocab)
    raw.copy_(grad.to(logits_dtype).to(raw.dtype))
    return loss


# emulate_precision_casts: Inductor rounds at each ``.to`` as eager does, rather than keeping fp32
_COMPILED = torch.compile(_functional_body, fullgraph=True, options={"emulate_precision_casts": True})


def fused_loss_and_grad_(raw, target, ignore_index: int, label_smoothing: float, scale, logits_dtype, dtype):
    """Summed cross-entropy of one chunk of ``raw`` logits (the head's matmul's output, in its dtype:
    read as ``raw.to(logits_dtype).to(dtype)``, as eager's loss reads them) and its gradient times
    ``scale``, written into ``raw`` in ``raw``'s dtype: the matmuls' operand. Returns the loss, in
    ``dtype``. By Inductor's kernels; by :func:`aten_loss_and_grad` where they could not be compiled
    (raised before any of them ran, so ``raw`` holds the logits still): for the rest of the process
    after a compile error, for this call after Dynamo's recompile limit. A graph compiled here inside
    a plan's compile (its workspace measured) is not taken for the plan's own code."""
    device = raw.device.type
    if device not in _BROKEN:
        ti.mark_rows_dynamic(raw, target)
        try:
            with ti.not_recorded():
                return _COMPILED(raw, target, ignore_index, label_smoothing, scale, logits_dtype, dtype)
        except ti.COMPILE_ERRORS as e:
            if not ti.is_recompile_limit(e):
                _BROKEN.add(device)
            warnings.warn(
                f"recompile_opt: the chunked loss's fused body did not compile on {device} ({e!r:.300}); "
                "its ATen body runs instead (the same result, more passes over the logits)",
                stacklevel=2,
            )
    logits = raw.to(logits_dtype).to(dtype)
    loss, grad = aten_loss_and_grad(logits, target, ignore_index, label_smoothing, scale)
    raw.copy_(grad.to(logits_dtype))
    return loss
