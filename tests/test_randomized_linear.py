"""Randomized backward of a linear layer (issue 24, the op only): the input's gradient exact, the
weight's unbiased from a projection that is regenerated, never stored."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from recompile_opt.approximate import randomized_linear as rl


def _layer(rows=512, d_in=64, d_out=32):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(rows, d_in, generator=g, requires_grad=True)
    w = torch.randn(d_out, d_in, generator=g, requires_grad=True)
    b = torch.randn(d_out, generator=g, requires_grad=True)
    return x, w, b, torch.randn(rows, d_out, generator=g)


def test_the_output_and_the_inputs_gradient_are_exact():
    x, w, b, grad_out = _layer()
    y = rl.randomized_linear(x, w, b, 0.5, torch.tensor(7))
    assert torch.equal(y, F.linear(x, w, b))
    got, ref = (torch.autograd.grad(out, (x, w, b), grad_out) for out in (y, F.linear(x, w, b)))
    assert torch.equal(got[0], ref[0])
    torch.testing.assert_close(got[2], ref[2])
    assert not torch.allclose(got[1], ref[1])  # the weight's is the approximate one


@pytest.mark.parametrize("ratio", [0.25, 0.5, 1.0])
def test_the_weights_gradient_is_unbiased(ratio):
    """Averaged over seeds the weight's gradient tends to the exact one (its error falls like
    1/sqrt(draws)), which a projection that ignored the seed, or a biased one, would not."""
    x, w, b, grad_out = _layer()
    (exact,) = torch.autograd.grad(F.linear(x, w, b), w, grad_out)
    draws = [
        torch.autograd.grad(rl.randomized_linear(x, w, b, ratio, torch.tensor(s)), w, grad_out)[0]
        for s in range(400)
    ]

    def error(g):
        return float((g - exact).norm() / exact.norm())

    single = sum(error(d) for d in draws) / len(draws)
    assert error(torch.stack(draws).mean(0)) < 2.0 * single / 400**0.5


def test_the_projection_is_kept_not_the_input_nor_s():
    """What the backward keeps: ``S^T X`` (``r`` rows), the weight and the seed; the same seed gives
    the same gradient, another seed another."""
    x, w, b, grad_out = _layer()
    y = rl.randomized_linear(x, w, b, 0.25, torch.tensor(3))
    kept = sorted(tuple(t.shape) for t in y.grad_fn.saved_tensors)
    assert kept == sorted([(rl.kept_rows(512, 0.25), 64), (32, 64), ()]), kept
    assert rl.kept_rows(512, 0.25) == 128
    same, other = (
        torch.autograd.grad(rl.randomized_linear(x, w, b, 0.25, torch.tensor(s)), w, grad_out)[0]
        for s in (3, 4)
    )
    assert torch.equal(torch.autograd.grad(y, w, grad_out)[0], same) and not torch.equal(same, other)


def test_s_is_made_in_blocks_alike_and_has_rademacher_entries():
    seed = torch.tensor(11)
    whole = rl.projection_block(seed, 0, 3000, 40, torch.float64, "cpu")
    assert set(whole.unique().tolist()) == {-(40**-0.5), 40**-0.5}
    assert torch.equal(rl.projection_block(seed, 1024, 1000, 40, torch.float64, "cpu"), whole[1024:2024])


def test_s_s_transpose_averages_to_the_identity_over_seeds():
    """E[S S^T] = I entry by entry, not only on average: over 40k seeds the off-diagonal means of one
    block's S S^T are as far from 0 as chance makes them (rms within 1.2x of 1/sqrt(r N)). An index
    only xor-ed with the seed's hash left entries a small xor apart correlated: 1.8x here."""
    rows, r, n = rl.BLOCK, 32, 40_000
    seeds = torch.randint(0, 2**31 - 1, (n, 1, 1), generator=torch.Generator().manual_seed(0))
    total = torch.zeros(rows, rows, dtype=torch.float64)
    for part in seeds.split(4000):
        s = rl.projection_block(part, 0, rows, r, torch.float64, "cpu")
        total += (s @ s.transpose(1, 2)).sum(0)
    mean = total / n
    off = mean[~torch.eye(rows, dtype=torch.bool)]
    assert torch.allclose(mean.diagonal(), torch.ones(rows, dtype=torch.float64), atol=1e-12)
    assert off.pow(2).mean().sqrt().item() * (r * n) ** 0.5 < 1.2


def test_s_is_block_diagonal_each_block_projected_on_its_own():
    """``project`` is ``S^T X`` for the block-diagonal S of :func:`projection_block`'s rows: blocks of
    ``BLOCK`` rows to ``ratio * BLOCK`` rows each, and a last, shorter block to its own share."""
    seed, ratio, n = torch.tensor(11), 0.25, 3 * rl.BLOCK + 20
    rows = torch.randn(n, 5, dtype=torch.float64)
    r, last = rl.projected_rows(rl.BLOCK, ratio), rl.projected_rows(20, ratio)
    dense = torch.zeros(n, 3 * r + last, dtype=torch.float64)
    full = rl.projection_block(seed, 0, 3 * rl.BLOCK, r, torch.float64, "cpu")
    for b in range(3):
        dense[b * rl.BLOCK : (b + 1) * rl.BLOCK, b * r : (b + 1) * r] = full[
            b * rl.BLOCK : (b + 1) * rl.BLOCK
        ]
    dense[3 * rl.BLOCK :, 3 * r :] = rl.projection_block(seed, 3 * rl.BLOCK, 20, last, torch.float64, "cpu")
    torch.testing.assert_close(rl.project(seed, rows, ratio), dense.t() @ rows)
    assert rl.kept_rows(n, ratio) == 3 * r + last


def test_the_seed_comes_from_torchs_rng_so_a_replay_draws_it_again():
    x, w, b, grad_out = _layer()
    grads = []
    for _ in range(2):
        torch.manual_seed(5)
        grads.append(torch.autograd.grad(rl.randomized_linear(x, w, b, 0.5), w, grad_out)[0])
    assert torch.equal(*grads)


@pytest.mark.parametrize("ratio", [0, 1.5, True, "half"])
def test_a_bad_ratio_names_the_accepted_values(ratio):
    x, w, b, _ = _layer()
    with pytest.raises(ValueError, match=r"accepted: a number in \(0, 1\]"):
        rl.randomized_linear(x, w, b, ratio)


@pytest.mark.slow
def test_through_inductor_the_randomized_backward_is_the_eager_one():
    """The hash that makes S compiled by Inductor gives the eager S bit for bit; the gradients are the
    eager ones up to the order of fp32 sums (Inductor fuses the blocks' products differently)."""
    torch._dynamo.reset()
    x, w, b, grad_out = _layer(rows=1500)
    seed = torch.tensor(9)

    def f(x, w, b):
        return rl.randomized_linear(x, w, b, 0.5, seed)

    eager = torch.autograd.grad(f(x, w, b), (x, w, b), grad_out)
    compiled = torch.autograd.grad(torch.compile(f)(x, w, b), (x, w, b), grad_out)
    for got, ref in zip(compiled, eager):
        torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-4)
    make = torch.compile(lambda s: rl.projection_block(s, 1024, 476, 750, torch.float32, "cpu"))
    assert torch.equal(make(seed), rl.projection_block(seed, 1024, 476, 750, torch.float32, "cpu"))
