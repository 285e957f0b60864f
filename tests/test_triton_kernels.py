"""The Triton kernels of the approximate backward (issue 24, part 3), run by Triton's interpreter on the
CPU (``TRITON_INTERPRET=1``, in a process of its own: the flag is read when a kernel is defined) against
the torch versions Inductor compiles on the CPU: codes and unpacking bit for bit, S bit for bit, the
projection to fp32 rounding."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

pytest.importorskip("triton")

CHECKS = textwrap.dedent('''
    import torch
    from recompile_opt.approximate import few_bit, randomized_linear as rl, triton_kernels as tk
    from recompile_opt.approximate.tables import table

    g = torch.Generator().manual_seed(0)
    for name in ("gelu", "silu"):
        for bits in (1, 2, 3, 4):
            for numel in (1, 8, 1000, 4099):  # a partial group of eight, and a partial program
                x = torch.randn(numel, generator=g) * 3
                breakpoints, values = table(name, bits)
                packed = tk.encode(x, torch.tensor(breakpoints, dtype=x.dtype), bits)
                assert torch.equal(packed, few_bit.encode(x, name, bits)), (name, bits, numel)
                grad = torch.randn(numel, generator=g)
                got = tk.decode_mul(packed, grad, torch.tensor(values, dtype=grad.dtype), bits)
                want = grad * few_bit.decode_derivative(packed, name, bits, grad.shape, grad.dtype)
                assert torch.equal(got, want), (name, bits, numel)
    seed = torch.tensor(11)
    for r in (6, 16, 32):
        signs = tk.signs(seed, 3, r)
        s = rl.projection_block(seed, 0, 3 * rl.BLOCK, r, torch.float64, "cpu")
        assert torch.equal(signs.double() / r ** 0.5, s), r
    for ratio, n, d in ((0.5, 3 * rl.BLOCK, 96), (0.25, 2 * rl.BLOCK + 20, 40), (0.5, 30, 8)):
        rows = torch.randn(n, d, generator=g)
        torch.testing.assert_close(tk.project(seed, rows, ratio), rl.project(seed, rows, ratio),
                                   rtol=1e-5, atol=1e-5)
    print("KERNELS OK")
''')


def test_the_triton_kernels_match_the_torch_versions_under_the_interpreter():
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    run = subprocess.run([sys.executable, "-c", CHECKS], env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0 and "KERNELS OK" in run.stdout, run.stdout[-3000:] + run.stderr[-3000:]
