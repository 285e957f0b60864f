"""Hand-written Triton kernels of the approximate backward, for CUDA tensors (issue 24, part 3).

On the CPU the torch versions (:mod:`recompile_opt.approximate.few_bit`,
:mod:`~recompile_opt.approximate.randomized_linear`) are what runs: Inductor fuses their comparisons,
shifts and sums into one C++ loop. On the GPU one kernel each does the same in one pass, never
materialising the int32 codes or the projection matrix ``S``:

- :func:`encode`: each element's piece (breakpoints below it) and eight codes packed into ``bits`` bytes;
- :func:`decode_mul`: unpack, look up the table's value, multiply by the incoming gradient;
- :func:`project`: ``S_b^T X_b`` for every full ``BLOCK``-row block, ``S_b`` made in registers from the
  seed's integer hash (the rows after the last full block go through the torch version).

They run inside the plan's custom ops (:mod:`recompile_opt.approximate.actions`: ``few_bit_encode``,
``few_bit_grad``, ``randomized_project``), which stay in the compiled graph where :func:`use_triton`
holds (CUDA tensors) and become the torch versions elsewhere (``passes/approximate.py``). Under Triton's
interpreter (``TRITON_INTERPRET=1``) they are used on the CPU too: that is how the tests run the GPU path
here, against the torch versions: the codes, their unpacking and ``S`` bit for bit; the projection's
sums to fp32 rounding (a matmul's order of addition).
"""

from __future__ import annotations

import math
import os

import torch
from torch import Tensor

from recompile_opt.approximate import randomized_linear
from recompile_opt.approximate.randomized_linear import BLOCK, projected_rows

GROUP = 8  # codes per packed group, as few_bit.pack_codes
GROUPS_PER_PROGRAM = 128


try:  # the kernels are defined only where Triton is installed (Triton's jit reads this module's names)
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - CPU installs without Triton use the torch versions
    triton = None


def available() -> bool:
    """Triton importable (the GPU path; on the CPU only the interpreter runs these)."""
    return triton is not None


def use_triton(t: Tensor) -> bool:
    """Whether the approximate ops on ``t`` run as these kernels: CUDA tensors where Triton is installed,
    or under Triton's interpreter any tensor but bf16."""
    if not available():
        return False
    if os.environ.get("TRITON_INTERPRET") == "1":
        # the interpreter holds bf16 as its raw bits (comparisons, products and dots on the integers):
        # bf16 runs the torch versions there, and is untested on the kernels
        return t.dtype != torch.bfloat16
    return t.device.type == "cuda"


if triton is not None:

    @triton.jit
    def encode_kernel(
        x_ptr, bp_ptr, out_ptr, numel, n_groups, BITS: tl.constexpr, PIECES: tl.constexpr, G: tl.constexpr
    ):
        group = (tl.program_id(0) * G + tl.arange(0, G)).to(tl.int64)  # offsets past 2**31 elements
        lane = tl.arange(0, 8)
        offs = group[:, None] * 8 + lane[None, :]
        x = tl.load(x_ptr + offs, mask=offs < numel, other=0.0)
        codes = tl.zeros((G, 8), dtype=tl.int32)
        for k in tl.static_range(PIECES - 1):
            codes += (x > tl.load(bp_ptr + k)).to(tl.int32)
        codes = tl.where(offs < numel, codes, 0)  # padding packs as code 0, as pack_codes' zeros
        words = tl.sum(codes << (lane[None, :] * BITS), axis=1)
        for b in tl.static_range(BITS):
            tl.store(
                out_ptr + group * BITS + b, ((words >> (8 * b)) & 0xFF).to(tl.uint8), mask=group < n_groups
            )

    @triton.jit
    def decode_mul_kernel(
        packed_ptr, grad_ptr, values_ptr, out_ptr, numel, n_groups, BITS: tl.constexpr, G: tl.constexpr
    ):
        group = (tl.program_id(0) * G + tl.arange(0, G)).to(tl.int64)
        lane = tl.arange(0, 8)
        words = tl.zeros((G,), dtype=tl.int32)
        for b in tl.static_range(BITS):
            byte = tl.load(packed_ptr + group * BITS + b, mask=group < n_groups, other=0).to(tl.int32)
            words += byte << (8 * b)
        codes = (words[:, None] >> (lane[None, :] * BITS)) & ((1 << BITS) - 1)
        offs = group[:, None] * 8 + lane[None, :]
        grad = tl.load(grad_ptr + offs, mask=offs < numel, other=0.0)
        value = tl.load(values_ptr + codes)
        tl.store(out_ptr + offs, grad * value, mask=offs < numel)

    @triton.jit
    def _hash(h):
        for _ in tl.static_range(2):
            h = (((h >> 16) ^ h) * 0x45D9F3B) & 0xFFFFFFFF
        return (h >> 16) ^ h

    @triton.jit
    def s_block(seed, block, R, BLOCK_ROWS: tl.constexpr, RP: tl.constexpr):
        """Rows ``block * BLOCK_ROWS ...`` of S, as randomized_linear.projection_block: [BLOCK_ROWS, RP]."""
        i = (block * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)).to(tl.int64)[:, None]
        j = tl.arange(0, RP).to(tl.int64)[None, :]
        h = _hash((((i * R + j) & 0xFFFFFFFF) * 0x61C88647) & 0xFFFFFFFF ^ _hash(seed & 0xFFFFFFFF))
        return tl.where(j < R, (h & 1) * 2 - 1, 0)

    @triton.jit
    def s_kernel(seed_ptr, out_ptr, R, BLOCK_ROWS: tl.constexpr, RP: tl.constexpr):
        block = tl.program_id(0)
        sign = s_block(tl.load(seed_ptr), block, R, BLOCK_ROWS, RP)
        rows = (block * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)).to(tl.int64)
        cols = tl.arange(0, RP)
        tl.store(out_ptr + rows[:, None] * R + cols[None, :], sign.to(tl.int8), mask=cols[None, :] < R)

    @triton.jit
    def project_kernel(
        seed_ptr, x_ptr, out_ptr, d, R, scale, BLOCK_ROWS: tl.constexpr, RP: tl.constexpr, TD: tl.constexpr
    ):
        block, tile = tl.program_id(0), tl.program_id(1)
        rows = (block * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)).to(tl.int64)
        cols = tile * TD + tl.arange(0, TD)
        x = tl.load(x_ptr + rows[:, None] * d + cols[None, :], mask=cols[None, :] < d, other=0.0)
        s = s_block(tl.load(seed_ptr), block, R, BLOCK_ROWS, RP).to(x.dtype)
        # "ieee": fp32 inputs as torch's matmul takes them (not TF32); other dtypes ignore it
        acc = tl.dot(tl.trans(s), x, input_precision="ieee", out_dtype=tl.float32) * scale
        r = tl.arange(0, RP)
        out_rows = (block * R + r).to(tl.int64)
        tl.store(
            out_ptr + out_rows[:, None] * d + cols[None, :],
            acc.to(out_ptr.dtype.element_ty),
            mask=(r[:, None] < R) & (cols[None, :] < d),
        )


def encode(x: Tensor, breakpoints: Tensor, bits: int) -> Tensor:
    """``few_bit.encode`` in one kernel: ``breakpoints`` (ascending, in ``x``'s dtype) -> packed codes."""
    x = x.contiguous().view(-1)
    n_groups = triton.cdiv(x.numel(), GROUP)
    out = torch.empty(n_groups * bits, dtype=torch.uint8, device=x.device)
    grid = (triton.cdiv(n_groups, GROUPS_PER_PROGRAM),)
    encode_kernel[grid](
        x,
        breakpoints,
        out,
        x.numel(),
        n_groups,
        BITS=bits,
        PIECES=breakpoints.numel() + 1,
        G=GROUPS_PER_PROGRAM,
    )
    return out


def decode_mul(packed: Tensor, grad: Tensor, values: Tensor, bits: int) -> Tensor:
    """``grad * few_bit.decode_derivative(packed, ...)`` in one kernel (``values`` in ``grad``'s dtype)."""
    flat = grad.contiguous().view(-1)
    out = torch.empty_like(flat)
    n_groups = triton.cdiv(flat.numel(), GROUP)
    grid = (triton.cdiv(n_groups, GROUPS_PER_PROGRAM),)
    decode_mul_kernel[grid](
        packed, flat, values, out, flat.numel(), n_groups, BITS=bits, G=GROUPS_PER_PROGRAM
    )
    return out.view(grad.shape)


def signs(seed: Tensor, blocks: int, r: int) -> Tensor:
    """The signs of S's first ``blocks`` full blocks (``[blocks * BLOCK, r]`` int8), for the tests."""
    out = torch.empty(blocks * BLOCK, r, dtype=torch.int8, device=seed.device)
    s_kernel[(blocks,)](seed, out, r, BLOCK_ROWS=BLOCK, RP=_pow2(r))
    return out


def project(seed: Tensor, rows: Tensor, ratio: float) -> Tensor:
    """``randomized_linear.project`` with its full blocks in one kernel."""
    n, d = rows.shape
    blocks, r = n // BLOCK, projected_rows(BLOCK, ratio)
    rows = rows.contiguous()
    out = torch.empty(blocks * r, d, dtype=rows.dtype, device=rows.device)
    if blocks:
        td = 64
        project_kernel[(blocks, triton.cdiv(d, td))](
            seed, rows, out, d, r, 1.0 / math.sqrt(r), BLOCK_ROWS=BLOCK, RP=_pow2(r), TD=td
        )
    if blocks * BLOCK == n:
        return out
    start = blocks * BLOCK  # a shorter last block, its own r, by torch
    last = randomized_linear.projection_block(
        seed, start, n - start, projected_rows(n - start, ratio), rows.dtype, rows.device
    )
    rest = last.t() @ rows[start:]
    return torch.cat([out, rest]) if blocks else rest


def _pow2(r: int) -> int:
    """``tl.dot`` wants power-of-two sides of at least 16: the columns past ``r`` are zero."""
    return max(16, 1 << (r - 1).bit_length())
