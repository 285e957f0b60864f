"""The Triton kernels of the approximate backward (issue 24, part 3), run by Triton's interpreter on the
CPU (``TRITON_INTERPRET=1``, in a process of its own: the flag is read when a kernel is defined) against
the torch versions Inductor compiles on the CPU: codes and unpacking bit for bit, S bit for bit, the
projection to fp32 rounding; and a compiled step whose plan runs them (the GPU path: under the
interpreter the plan's formulas take the kernels' ops on the CPU too) against eager with the torch
versions."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

pytest.importorskip("triton")

CHECKS = textwrap.dedent("""
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
""")


PLAN_PATH = textwrap.dedent("""
    import sys
    import torch
    sys.path.insert(0, {tests!r})
    import recompile_opt
    from recompile_opt import models
    from recompile_opt.approximate import triton_kernels as tk
    from helpers import TINY_GPT
    from test_approximate_plans import BOTH, _eager_approximate_grads, _every_site_approximated, _grads

    launched = set()
    for name in ("encode", "decode_mul", "project"):  # what the kernels' ops call
        setattr(tk, name, lambda *a, _real=getattr(tk, name), _name=name: launched.add(_name) or _real(*a))
    cfg = models.GPTConfig(**TINY_GPT)
    torch.manual_seed(0)
    model, inputs = models.GPT(cfg), models.example_batch(cfg, 8)  # 128 rows: two of S's blocks
    want = _eager_approximate_grads(model, inputs, bits=3, ratio=0.5)
    assert not launched  # eager's autograd Functions run the torch versions
    for budget in {budgets!r}:
        recompile_opt.reset_plans()
        # fallback_random: Inductor draws the seeds as eager does
        with _every_site_approximated(), torch._inductor.config.patch(fallback_random=True):
            got = _grads(
                model, inputs, {{"memory_budget": budget, "compiler": {compiler!r}, "approximate": BOTH}}
            )
        assert recompile_opt.last_plans()[0].approximated
        for n in want:
            torch.testing.assert_close(got[n], want[n], rtol=1e-5, atol=1e-6, msg=n)
    assert launched == {{"encode", "decode_mul", "project"}}, launched
    print("PLAN PATH OK")
""")


def _interpreted(script: str, expect: str) -> None:
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    run = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=900)
    assert run.returncode == 0 and expect in run.stdout, run.stdout[-3000:] + run.stderr[-3000:]


def test_the_triton_kernels_match_the_torch_versions_under_the_interpreter():
    _interpreted(CHECKS, "KERNELS OK")


@pytest.mark.parametrize(
    "compiler,budgets", [("eager", (0.0, 1.0)), pytest.param("inductor", (0.0,), marks=pytest.mark.slow)]
)
def test_a_plan_that_approximates_runs_the_kernels_and_trains_as_eager(compiler, budgets):
    """Every site approximated (3-bit GELUs, randomized linears at 0.5), the compiled step whose settled
    formulas are the kernels' ops gives eager's gradients with the torch versions."""
    tests = os.path.dirname(os.path.abspath(__file__))
    _interpreted(PLAN_PATH.format(tests=tests, compiler=compiler, budgets=budgets), "PLAN PATH OK")
