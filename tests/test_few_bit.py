"""Few-bit backward of activations (issue 24, first part): the derivative tables, the packed codes, and
the gradient error per bit width. Not yet a plan action (the planner does not choose it yet)."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from recompile_opt.approximate import tables
from recompile_opt.approximate.few_bit import few_bit_activation, pack_codes, unpack_codes


@pytest.mark.parametrize("bits", tables.BITS)
@pytest.mark.parametrize("numel", [1, 8, 9, 1000])
def test_codes_round_trip_eight_to_bits_bytes(bits, numel):
    codes = torch.randint(0, 2**bits, (numel,), generator=torch.Generator().manual_seed(numel))
    packed = pack_codes(codes, bits)
    assert packed.dtype == torch.uint8 and packed.numel() == math.ceil(numel / 8) * bits
    assert torch.equal(unpack_codes(packed, bits, numel), codes)


@pytest.mark.parametrize("name", list(tables.ACTIVATIONS))
@pytest.mark.parametrize("bits", tables.BITS)
def test_the_backward_multiplies_by_the_tables_value_exactly(name, bits):
    g = torch.Generator().manual_seed(bits)
    x = (3 * torch.randn(4, 333, generator=g)).requires_grad_()
    grad_out = torch.randn(4, 333, generator=g)
    y = few_bit_activation(x, name, bits)
    torch.testing.assert_close(y, tables.ACTIVATIONS[name](x), rtol=0, atol=0)  # the forward is exact
    (grad,) = torch.autograd.grad(y, x, grad_out)
    breakpoints, values = tables.table(name, bits)
    piece = (x.detach()[..., None] > torch.tensor(breakpoints)).sum(-1)  # the piece each input falls in
    assert torch.equal(grad, grad_out * torch.tensor(values)[piece])


@pytest.mark.parametrize("name", list(tables.ACTIVATIONS))
def test_the_gradient_error_is_the_tables_and_falls_with_the_bits(name):
    """On standard normal inputs (the distribution the tables are optimised for), the relative squared
    error of the input's gradient is the table's expected error over E[f'(x)^2] (within sampling
    noise); cosine similarity to the exact gradient at least 0.99 from 3 bits (measured here: GELU
    0.956 / 0.991 / 0.998 / 0.9994 at 1-4 bits, SiLU 0.9895 at 2)."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(400_000, generator=g, dtype=torch.float64).requires_grad_()
    grad_out = torch.ones_like(x)
    exact = tables.derivative(name, x)
    errors = []
    for bits in tables.BITS:
        (got,) = torch.autograd.grad(few_bit_activation(x, name, bits), x, grad_out)
        rel = float((got - exact).square().mean() / exact.square().mean())
        expected = json_mse(name, bits) / float(exact.square().mean())
        assert rel == pytest.approx(expected, rel=0.05), (bits, rel, expected)
        errors.append(rel)
        if bits >= 3:
            assert F.cosine_similarity(got, exact, dim=0) >= 0.99, bits
    assert errors == sorted(errors, reverse=True)


def json_mse(name, bits):
    import json

    return json.loads(tables.PATH.read_text())[name][str(bits)]["mse"]


def test_the_stored_tables_are_what_the_script_makes_and_beat_even_pieces():
    """Regenerated, a table equals the stored one; its error is below that of pieces evenly spaced
    over [-3, 3] with the best value in each (a simpler quantiser the optimisation must beat)."""
    made = tables.optimise("gelu", 2)
    stored_breakpoints, stored_values = tables.table("gelu", 2)
    assert made["breakpoints"] == pytest.approx(stored_breakpoints) and made["values"] == pytest.approx(
        stored_values
    )
    x = torch.linspace(-8, 8, 200_001, dtype=torch.float64)
    weight = torch.exp(-(x**2) / 2)
    d = tables.derivative("gelu", x)
    even = torch.bucketize(x, torch.linspace(-3, 3, 5, dtype=torch.float64)[1:-1])
    optimal = torch.bucketize(x, torch.tensor(stored_breakpoints, dtype=torch.float64))

    def mse(piece):
        total = 0.0
        for p in piece.unique():
            w, v = weight[piece == p], d[piece == p]
            total += float((w * (v - (w * v).sum() / w.sum()).square()).sum())
        return total / float(weight.sum())

    assert mse(optimal) < 0.8 * mse(even)
    assert mse(optimal) == pytest.approx(made["mse"], rel=0.02)


@pytest.mark.parametrize("name, bits", [("relu", 3), ("gelu", 5), ("silu", 0)])
def test_an_unknown_activation_or_width_names_the_accepted_ones(name, bits):
    with pytest.raises(
        ValueError, match=r"activations: \['gelu', 'gelu_tanh', 'silu'\], bits: \[1, 2, 3, 4\]"
    ):
        few_bit_activation(torch.randn(3), name, bits)


@pytest.mark.slow
def test_through_inductor_the_few_bit_backward_is_the_eager_one():
    """Encoding, packing, unpacking and the table lookup compiled by Inductor (C++ on the CPU) give
    the eager op's gradient bit for bit."""
    torch._dynamo.reset()
    x = torch.randn(3, 1001, requires_grad=True)
    grad_out = torch.randn(3, 1001)

    def f(t):
        return few_bit_activation(t, "gelu", 3)

    (eager,) = torch.autograd.grad(f(x), x, grad_out)
    (compiled,) = torch.autograd.grad(torch.compile(f)(x), x, grad_out)
    assert torch.equal(compiled, eager)
