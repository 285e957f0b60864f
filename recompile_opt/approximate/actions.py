"""The approximate actions as the planner sees them: each site's backward reads a *marker*, one custom op
that takes both what the exact gradient reads and what the approximate one reads.

Why a marker: whether a value is kept exactly, recomputed, or kept approximately is the ILP's choice
(:mod:`recompile_opt.planner.ilp`), made on the joint graph, so the joint graph must offer both ways
until the plan is made. The Dynamo graph's activations and linear layers become the autograd Functions
below (``passes/approximate.py``): their forward makes the codes or the projection besides the output,
and their backward reads both the exact input and the approximation through the marker. Once the plan
is chosen, :func:`exact_backward` or :func:`approximate_backward` (torch ops, and the ops below, which
become torch ops too where the Triton kernels do not run) replaces each marker, and the side the plan
does not read is dead code.

The codes, their backward and the projection are custom ops too (``few_bit_encode``, ``few_bit_grad``,
``randomized_project``), each one node of the joint graph whatever its formula's length. Why: written
out, a 3-bit code is ~25 ops and a projection's S ~35, each a value of the ILP: the benchmark GPT's
problem had 2243 variables against 766 exact (788 with one op each). Once the
plan is chosen, ``passes/approximate.py`` lowers each op to its torch formula (which Inductor fuses on
the CPU) or, on CUDA, leaves it to run its Triton kernel (:mod:`~recompile_opt.approximate.triton_kernels`).

A marker that is never resolved (a graph compiled by another backend) computes the exact gradient.
"""

from __future__ import annotations

import contextlib
import functools

import torch
import torch.nn.functional as F
from torch import Tensor

from recompile_opt import _torch_internals as ti
from recompile_opt.approximate import few_bit, randomized_linear, triton_kernels
from recompile_opt.approximate.randomized_linear import BLOCK, kept_rows, projected_rows
from recompile_opt.approximate.tables import ACTIVATIONS, table


def exact_activation_grad(grad: Tensor, x: Tensor, name: str) -> Tensor:
    if name == "silu":
        return torch.ops.aten.silu_backward(grad, x)
    return torch.ops.aten.gelu_backward(grad, x, approximate="tanh" if name == "gelu_tanh" else "none")


def exact_weight_grad(grad: Tensor, x: Tensor) -> Tensor:
    return grad.reshape(-1, grad.shape[-1]).t() @ x.reshape(-1, x.shape[-1])


@torch.library.custom_op("recompile_opt::activation_grad", mutates_args=())
def activation_grad(grad: Tensor, x: Tensor, codes: Tensor, name: str, bits: int) -> Tensor:
    """Marker: the gradient of ``ACTIVATIONS[name]`` at ``x``, or from ``codes`` at ``bits`` bits."""
    return exact_activation_grad(grad, x, name)


@activation_grad.register_fake
def _(grad, x, codes, name, bits):
    return torch.empty_like(grad)


@torch.library.custom_op("recompile_opt::weight_grad", mutates_args=())
def weight_grad(grad: Tensor, x: Tensor, projected: Tensor, seed: Tensor, ratio: float) -> Tensor:
    """Marker: a linear layer's weight gradient from its input ``x``, or from ``projected`` (S^T x)."""
    return exact_weight_grad(grad, x)


@weight_grad.register_fake
def _(grad, x, projected, seed, ratio):
    return grad.new_empty((grad.shape[-1], x.shape[-1]))


MARKERS = (torch.ops.recompile_opt.activation_grad.default, torch.ops.recompile_opt.weight_grad.default)


# -- the codes, their backward and the projection: one op each ------------------------------------------


@torch.library.custom_op("recompile_opt::few_bit_encode", mutates_args=())
def few_bit_encode(x: Tensor, name: str, bits: int) -> Tensor:
    """:func:`few_bit.encode <recompile_opt.approximate.few_bit.encode>`: the packed codes of ``x``."""
    if triton_kernels.use_triton(x):
        return triton_kernels.encode(x, _table_tensor(name, bits, 0, x.dtype, x.device), bits)
    return few_bit.encode(x, name, bits)


@few_bit_encode.register_fake
def _(x, name, bits):
    return x.new_empty(-(-x.numel() // few_bit.GROUP) * bits, dtype=torch.uint8)


@torch.library.custom_op("recompile_opt::few_bit_grad", mutates_args=())
def few_bit_grad(grad: Tensor, packed: Tensor, name: str, bits: int) -> Tensor:
    """:func:`few_bit.few_bit_grad <recompile_opt.approximate.few_bit.few_bit_grad>`: the few-bit backward."""
    if triton_kernels.use_triton(grad):
        return triton_kernels.decode_mul(
            packed, grad, _table_tensor(name, bits, 1, grad.dtype, grad.device), bits
        )
    return few_bit.few_bit_grad(grad, packed, name, bits).contiguous()  # as the fake says


@few_bit_grad.register_fake
def _(grad, packed, name, bits):
    return torch.empty_like(grad, memory_format=torch.contiguous_format)


@torch.library.custom_op("recompile_opt::randomized_project", mutates_args=())
def randomized_project(seed: Tensor, rows: Tensor, ratio: float) -> Tensor:
    """:func:`randomized_linear.project <recompile_opt.approximate.randomized_linear.project>`:
    ``S^T rows``."""
    if triton_kernels.use_triton(rows):
        return triton_kernels.project(seed, rows, ratio)
    return randomized_linear.project(seed, rows, ratio)


@randomized_project.register_fake
def _(seed, rows, ratio):
    return rows.new_empty(kept_rows(rows.shape[0], ratio), rows.shape[1])


@ti.register_flop_formula(torch.ops.recompile_opt.randomized_project)
def _(seed_shape, rows_shape, ratio, *args, **kwargs) -> int:
    """Each row meets its block's columns of S (the cost model's FLOPs): ``ratio * BLOCK`` of them, the
    rows after the last full block their own block's."""
    n, d = rows_shape
    tail = n % BLOCK
    return (
        2
        * d
        * ((n - tail) * projected_rows(BLOCK, ratio) + (tail * projected_rows(tail, ratio) if tail else 0))
    )


@functools.lru_cache(maxsize=None)
def _table_tensor(name: str, bits: int, which: int, dtype: torch.dtype, device: torch.device) -> Tensor:
    """The breakpoints (``which`` 0) or the derivative values (1) of ``name`` at ``bits`` bits."""
    return torch.tensor(table(name, bits)[which], dtype=dtype, device=device)


# each op's torch formula, what it becomes where the Triton kernels do not run (passes/approximate.py)
TORCH_FORMULAS = {
    torch.ops.recompile_opt.few_bit_encode.default: few_bit.encode,
    torch.ops.recompile_opt.few_bit_grad.default: few_bit.few_bit_grad,
    torch.ops.recompile_opt.randomized_project.default: randomized_linear.project,
}


def exact_backward(target, args: tuple) -> tuple:
    """The function that replaces a marker when the plan keeps its site exact, and the arguments it reads."""
    if target == MARKERS[0]:
        grad, x, _codes, name, _bits = args
        return (lambda g, v: exact_activation_grad(g, v, name)), (grad, x)
    grad, x, _projected, _seed, _ratio = args
    return exact_weight_grad, (grad, x)


def approximate_backward(target, args: tuple) -> tuple:
    """As :func:`exact_backward`, where the plan approximates the site."""
    if target == MARKERS[0]:
        grad, _x, codes, name, bits = args
        return (lambda g, c: few_bit_grad(g, c, name, bits)), (grad, codes)
    grad, _x, projected, seed, ratio = args
    return (lambda g, p, s: randomized_linear.weight_grad(g, p, s, ratio, randomized_project)), (
        grad,
        projected,
        seed,
    )


class ApproximableActivation(torch.autograd.Function):
    """``ACTIVATIONS[name](x)``, whose backward is exact or few-bit as the plan chooses."""

    @staticmethod
    def forward(ctx, x, name: str, bits: int):
        ctx.name, ctx.bits = name, bits
        ctx.save_for_backward(x, few_bit_encode(x, name, bits))
        return ACTIVATIONS[name](x)

    @staticmethod
    def backward(ctx, grad):
        x, codes = ctx.saved_tensors
        return activation_grad(grad, x, codes, ctx.name, ctx.bits), None, None


class ApproximableLinear(torch.autograd.Function):
    """``F.linear(x, weight, bias)`` in ``mm_dtype``, whose weight gradient is exact or randomized as the
    plan chooses; the input's gradient is exact either way. The casts are explicit, as eager autocast
    makes them (the bf16 input and weight kept for the backward, each gradient cast back to its
    tensor's dtype), since compiled code runs with autocast off."""

    @staticmethod
    def forward(ctx, x, weight, bias, ratio: float, seed, mm_dtype: torch.dtype):
        with _autocast_off(x.device.type):
            x_mm, w_mm = x.to(mm_dtype), weight.to(mm_dtype)
            b_mm = bias.to(mm_dtype) if bias is not None else None
            projected = randomized_project(seed, x_mm.reshape(-1, x.shape[-1]), ratio)
            out = F.linear(x_mm, w_mm, b_mm)
        ctx.ratio, ctx.has_bias = ratio, bias is not None
        ctx.dtypes = x.dtype, weight.dtype, bias.dtype if bias is not None else None
        ctx.save_for_backward(x_mm, projected, seed, w_mm)
        return out

    @staticmethod
    def backward(ctx, grad):
        x, projected, seed, weight = ctx.saved_tensors
        x_dtype, w_dtype, b_dtype = ctx.dtypes
        with _autocast_off(grad.device.type):
            grad = grad.to(weight.dtype)
            grad_x = (grad @ weight).to(x_dtype) if ctx.needs_input_grad[0] else None
            grad_w = (
                weight_grad(grad, x, projected, seed, ctx.ratio).to(w_dtype)
                if ctx.needs_input_grad[1]
                else None
            )
            grad_b = (
                grad.reshape(-1, grad.shape[-1]).sum(0).to(b_dtype)
                if ctx.has_bias and ctx.needs_input_grad[2]
                else None
            )
        return grad_x, grad_w, grad_b, None, None, None


def _autocast_off(device_type: str):
    if not torch.amp.is_autocast_available(device_type):  # meta: planning without a step
        return contextlib.nullcontext()
    return torch.autocast(device_type, enabled=False)


def approximable_activation(x: Tensor, name: str, bits: int) -> Tensor:
    table(name, bits)  # a clear error for an unknown activation or width
    return ApproximableActivation.apply(x, name, bits)


def approximable_linear(
    x: Tensor, weight: Tensor, bias: Tensor | None, ratio: float, mm_dtype: torch.dtype | None = None
) -> Tensor:
    seed = torch.randint(0, 2**31 - 1, (), device=x.device)
    return ApproximableLinear.apply(x, weight, bias, float(ratio), seed, mm_dtype or x.dtype)
