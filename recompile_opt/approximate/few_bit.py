"""Few-bit backward of an elementwise activation (Novikov et al. 2022): the forward keeps, instead of the
activation's input, a ``bits``-bit code of which piece of a piecewise-constant approximation of the
derivative (:mod:`recompile_opt.approximate.tables`) the input falls in; the backward multiplies the
incoming gradient by that piece's value. 3 bits keep 3/32 of an fp32 input's bytes.

The codes are packed eight to ``bits`` bytes (eight 3-bit codes are 24 bits: three bytes), with
integer shifts and sums that Inductor fuses into the kernels around them on the CPU.
"""

from __future__ import annotations

import torch

from recompile_opt.approximate.tables import ACTIVATIONS, table

GROUP = 8  # codes per packed group: ``bits`` bytes each


def pack_codes(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """``codes`` (integers in ``[0, 2**bits)``, any shape) as a flat uint8 tensor of
    ``ceil(numel / 8) * bits`` bytes."""
    flat = codes.reshape(-1).to(torch.int32)
    flat = torch.nn.functional.pad(flat, (0, -flat.numel() % GROUP))
    shifts = torch.arange(GROUP, dtype=torch.int32, device=codes.device) * bits
    words = (flat.view(-1, GROUP) << shifts).sum(1, dtype=torch.int32)  # 8 * bits <= 32 bits a group
    byte_shifts = torch.arange(bits, dtype=torch.int32, device=codes.device) * 8
    return ((words[:, None] >> byte_shifts) & 0xFF).to(torch.uint8).reshape(-1)


def unpack_codes(packed: torch.Tensor, bits: int, numel: int) -> torch.Tensor:
    """The first ``numel`` codes of :func:`pack_codes`'s output, as int64 (an index)."""
    byte_shifts = torch.arange(bits, dtype=torch.int32, device=packed.device) * 8
    words = (packed.view(-1, bits).to(torch.int32) << byte_shifts).sum(1, dtype=torch.int32)
    shifts = torch.arange(GROUP, dtype=torch.int32, device=packed.device) * bits
    return ((words[:, None] >> shifts) & (2**bits - 1)).reshape(-1)[:numel].long()


def encode(x: torch.Tensor, name: str, bits: int) -> torch.Tensor:
    """The packed codes of ``x`` for ``name``'s derivative table at ``bits`` bits: each element's piece
    is the number of breakpoints below it (``torch.bucketize``'s index), counted with comparisons to
    scalars so that no tensor constant enters a traced graph (the backend inlines these functions
    into the joint graph, passes/approximate.py) and Inductor fuses them into one kernel."""
    breakpoints, _ = table(name, bits)
    codes = torch.zeros_like(x, dtype=torch.int32)
    for b in breakpoints:
        codes = codes + (x > b).to(torch.int32)
    return pack_codes(codes, bits)


def decode_derivative(packed: torch.Tensor, name: str, bits: int, shape, dtype: torch.dtype) -> torch.Tensor:
    """The approximate derivative at each element of an input of ``shape`` and ``dtype``: the table's
    value of each code, chosen with ``where`` against scalars (no tensor constant, as in :func:`encode`)."""
    _, values = table(name, bits)
    codes = unpack_codes(packed, bits, torch.Size(shape).numel()).view(shape)
    out = torch.full(tuple(shape), values[0], dtype=dtype, device=packed.device)
    for code, value in enumerate(values[1:], start=1):
        out = torch.where(codes == code, value, out)
    return out


def few_bit_grad(grad: torch.Tensor, packed: torch.Tensor, name: str, bits: int) -> torch.Tensor:
    """The backward: the incoming gradient times the table's value of each element's code."""
    return grad * decode_derivative(packed, name, bits, grad.shape, grad.dtype)


class FewBitActivation(torch.autograd.Function):
    """``ACTIVATIONS[name](x)`` whose backward uses the ``bits``-bit derivative table."""

    @staticmethod
    def forward(ctx, x, name: str, bits: int):
        ctx.name, ctx.bits = name, bits
        ctx.save_for_backward(encode(x, name, bits))
        return ACTIVATIONS[name](x)

    @staticmethod
    def backward(ctx, grad):
        (packed,) = ctx.saved_tensors
        return few_bit_grad(grad, packed, ctx.name, ctx.bits), None, None


def few_bit_activation(x: torch.Tensor, name: str, bits: int) -> torch.Tensor:
    """``name`` in :data:`ACTIVATIONS` ("gelu", "gelu_tanh", "silu"), its backward at ``bits`` bits."""
    table(name, bits)  # a clear error for an unknown activation or width
    return FewBitActivation.apply(x, name, bits)
