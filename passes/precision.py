"""Autocast's dtype decisions inside the regions the chunking passes rewrite.

Why: a rewritten region runs its ops where autocast no longer decides for them (inside a custom op, or
in an autograd Function's backward, traced with whatever autocast state AOTAutograd gives it), and a
chunk loop changes how a matmul's reduction is rounded. Eager autocast runs a head's or an MLP's
weight gradient as one bf16 GEMM over every token: accumulated in fp32, rounded to bf16 once. Summed
over k chunks in bf16 it is rounded k times (a 0.2-0.6% gradient error on a 2-layer GPT, where plain
``torch.compile`` differs from eager by 3e-7). So the regions state their dtypes explicitly, read off
Dynamo's example values (where autocast's choices are), run with autocast off, and accumulate reductions
across chunks in fp32 with :func:`add_transposed_product_` (on CUDA cuBLAS's bf16 GEMM with an fp32 output,
elsewhere upcast operands), rounding once at the end as eager's single GEMM does.
"""

from __future__ import annotations

import contextlib
import functools
import math

import torch

from recompile_opt import _torch_internals as ti


def autocast_state(device_type: str) -> tuple[bool, torch.dtype | None]:
    """``(enabled, dtype)`` of autocast for ``device_type`` now (what a backward must run under to
    recompute a forward's ops as eager autocast ran them); ``(False, None)`` on a device autocast does
    not know (``meta``: planning without a step)."""
    if not torch.amp.is_autocast_available(device_type):
        return False, None
    return torch.is_autocast_enabled(device_type), torch.get_autocast_dtype(device_type)


def autocast_as(device_type: str, state: tuple[bool, torch.dtype | None]):
    """A context with autocast for ``device_type`` as ``state`` (:func:`autocast_state`)."""
    enabled, dtype = state
    if not torch.amp.is_autocast_available(device_type):
        return contextlib.nullcontext()
    return torch.autocast(device_type, dtype=dtype, enabled=enabled)


def autocast_off(device_type: str):
    """A context with autocast off for ``device_type`` (the ops inside state their dtypes)."""
    if not (torch.amp.is_autocast_available(device_type) and torch.is_autocast_enabled(device_type)):
        return contextlib.nullcontext()
    return torch.autocast(device_type, enabled=False)


@functools.cache
def _gemm_out_dtype() -> bool:
    """Whether this torch's ``addmm`` takes ``out_dtype`` (a bf16 GEMM with an fp32 result: its
    ``dtype`` overload, in torch 2.11 to 2.15); elsewhere the operands are upcast."""
    return "dtype" in torch.ops.aten.addmm.overloads()


def add_transposed_product(total: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``total += a^T @ b`` (the last two dims transposed) for traced code, in place
    (:func:`add_transposed_product_`), accumulated in ``total``'s dtype; returns ``total``, a fresh
    accumulator of the traced code (Inductor then writes each chunk's product into its buffer)."""
    torch.ops.recompile_opt.add_transposed_product_(total, a, b)
    return total


@torch.library.custom_op(
    "recompile_opt::add_transposed_product_", mutates_args=("total",), tags=(torch.Tag.flexible_layout,)
)
def add_transposed_product_(total: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """``total += a^T @ b`` in place, accumulated in ``total``'s dtype; ``a`` and ``b`` matrices or
    batches of them (a ``total`` of one dim fewer takes the one-row product). Why an op that mutates:
    Inductor reinplaces it into the accumulator's own buffer (its ``auto_functionalized`` pass), where
    ``addmm(total, a.t(), b)`` allocates each chunk's sum while the last is alive: one accumulator
    more at the demo GPT's peak (its attention backward). An extern kernel, so Inductor never fuses k
    partial products into one sum that holds all k alive. Why ``a`` untransposed: a transposed view
    is handed to a custom op as a buffer of its own, a copy of ``a`` (the attention's probabilities)."""
    accumulate_(total if total.dim() == a.dim() else total.unsqueeze(0), a.transpose(-2, -1), b)


@add_transposed_product_.register_fake
def _(total, a, b):
    return None


@ti.register_flop_formula(torch.ops.recompile_opt.add_transposed_product_)
def _product_flops(total=None, a=(), b=(0,), *args, out_shape=None, **kwargs) -> int:
    """``a`` and ``b`` are shapes here (the formula's wrapper passes them so), by position or by the
    op's argument names (Inductor's flop count of a fallback kernel names them)."""
    return 2 * math.prod(a) * b[-1]


def accumulate_(total: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``total += a @ b`` in place, eagerly (inside an op), accumulated in ``total``'s dtype; ``a``,
    ``b`` matrices or batches of matrices."""
    if a.dim() == 3:
        return total.baddbmm_(a.to(total.dtype), b.to(total.dtype))
    if a.dtype == total.dtype:
        return total.addmm_(a, b)
    if a.is_cuda and _gemm_out_dtype():
        return torch.addmm(total, a, b, out_dtype=total.dtype, out=total)
    return total.addmm_(a.to(total.dtype), b.to(total.dtype))


def accumulator(like: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Zeros of ``like``'s shape for a sum over chunks: fp32 where ``dtype`` is narrower."""
    return torch.zeros(like.shape, dtype=torch.promote_types(dtype, torch.float32), device=like.device)


@torch.library.custom_op("recompile_opt::round_to", mutates_args=())
def round_to(total: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``total.to(dtype)`` as one op. Why: Inductor elides a downcast inside a fused kernel whose value
    is upcast again (``emulate_precision_casts`` is off by default: ``x.to(bf16).to(fp32)`` came back
    unrounded, 8e-3 apart), so the one rounding eager's GEMM makes is made where Inductor cannot fuse."""
    return total.to(dtype)


@round_to.register_fake
def _(total, dtype):
    return torch.empty_like(total, dtype=dtype)


def rounded(total: torch.Tensor, mm_dtype: torch.dtype, dtype: torch.dtype) -> torch.Tensor:
    """A sum over chunks as eager's single GEMM gives it: rounded once to ``mm_dtype``, then cast to
    ``dtype`` (the parameter's, as autocast's cast backward does). For traced code (:func:`round_to`)."""
    if mm_dtype == total.dtype:
        return total.to(dtype)
    return torch.ops.recompile_opt.round_to(total, mm_dtype).to(dtype)


def rounded_(total: torch.Tensor, mm_dtype: torch.dtype, dtype: torch.dtype) -> torch.Tensor:
    """:func:`rounded`, eagerly (inside an op): in place, an eighth at a time, where ``total`` (a fresh
    accumulator) already has ``dtype``, so that no second weight-sized buffer is made."""
    if total.dtype != dtype or not total.is_contiguous():
        return total.to(mm_dtype).to(dtype)
    if mm_dtype != dtype:
        for piece in total.view(-1).split(max(1, total.numel() // 8)):
            piece.copy_(piece.to(mm_dtype))
    return total
