"""Piecewise-constant approximations of activation derivatives for the few-bit backward, and the
optimisation that makes them (``python -m recompile_opt.approximate.tables`` rewrites
``derivative_tables.json``).

Why an optimisation: with ``2**bits`` pieces the backward multiplies the incoming gradient by ``q(x)``
instead of ``f'(x)``; the pieces minimising the expected squared error ``E[(f'(x) - q(x))^2]`` under the
distribution of the activation's input give the smallest gradient error. The input of an MLP's
activation is a linear layer of a normalised vector, so we weigh by the standard normal density (the
weight is a choice: Novikov et al. 2022 optimise the same L2 objective). The optimum over contiguous
pieces is exact on a grid by dynamic programming (each piece's value is the weighted mean of ``f'`` over
it, its cost the weighted variance; a piece may not split the grid's tails, which hold the normal's
mass beyond the grid). Stored as data so that a plan never depends on a solver run.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch
import torch.nn.functional as F

PATH = Path(__file__).with_name("derivative_tables.json")
BITS = (1, 2, 3, 4)
GRID = 2001  # points on [-SPAN, SPAN]; beyond it every derivative here is constant to 1e-6
SPAN = 6.0


def _gelu_tanh(x):
    return F.gelu(x, approximate="tanh")


ACTIVATIONS = {"gelu": F.gelu, "gelu_tanh": _gelu_tanh, "silu": F.silu}


def derivative(name: str, x: torch.Tensor) -> torch.Tensor:
    """``f'(x)`` by autograd, in float64."""
    x = x.detach().double().requires_grad_()
    (grad,) = torch.autograd.grad(ACTIVATIONS[name](x).sum(), x)
    return grad


def optimise(name: str, bits: int) -> dict:
    """The ``2**bits`` pieces of least expected squared error: ``{"breakpoints": [...], "values": [...],
    "mse": ...}`` (``breakpoints`` ascending, one fewer than ``values``)."""
    x = torch.linspace(-SPAN, SPAN, GRID, dtype=torch.float64)
    step = x[1] - x[0]
    weight = torch.exp(-(x**2) / 2) / math.sqrt(2 * math.pi) * step
    tail = 0.5 * math.erfc((SPAN + float(step) / 2) / math.sqrt(2))
    weight[0] += tail  # the normal's mass beyond the grid, at its ends
    weight[-1] += tail
    d = derivative(name, x)
    pieces, n = 2**bits, GRID
    # prefix sums: the weighted variance of d over grid[i:j] in O(1)
    s0, s1, s2 = (
        torch.cat([torch.zeros(1, dtype=torch.float64), torch.cumsum(v, 0)])
        for v in (weight, weight * d, weight * d * d)
    )

    # cost[i, j]: the weighted variance of d over grid[i:j] (infinite unless i < j)
    w = s0[None, :] - s0[:, None]
    m = s1[None, :] - s1[:, None]
    cost = (s2[None, :] - s2[:, None]) - m * m / w.clamp(min=1e-300)
    cost = cost.masked_fill(~torch.ones(n + 1, n + 1, dtype=torch.bool).triu(1), math.inf)
    best = torch.full((n + 1,), math.inf, dtype=torch.float64)
    best[0] = 0.0
    cuts = []
    for _ in range(pieces):  # best[j]: the least cost of grid[:j] in this many pieces
        best, arg = (best[:, None] + cost).min(dim=0)
        cuts.append(arg)
    bounds, j = [n], n
    for arg in reversed(cuts):
        j = int(arg[j])
        bounds.append(j)
    bounds.reverse()  # grid indices 0 = b0 < b1 < ... < b_pieces = n
    values = [float((s1[b] - s1[a]) / (s0[b] - s0[a])) for a, b in zip(bounds, bounds[1:])]
    breakpoints = [float((x[b - 1] + x[b]) / 2) for b in bounds[1:-1]]
    return {"breakpoints": breakpoints, "values": values, "mse": float(best[n])}


def make_all() -> dict:
    return {name: {str(bits): optimise(name, bits) for bits in BITS} for name in ACTIVATIONS}


def table(name: str, bits: int) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """The stored ``(breakpoints, values)`` of ``name``'s derivative in ``2**bits`` pieces."""
    if name not in ACTIVATIONS or bits not in BITS:
        raise ValueError(
            f"no derivative table for {name!r} at {bits} bits (activations: {list(ACTIVATIONS)}, "
            f"bits: {list(BITS)})"
        )
    entry = _STORED[name][str(bits)]
    return tuple(entry["breakpoints"]), tuple(entry["values"])


# read once at import: a compiled region that calls table() then reads no file
_STORED = json.loads(PATH.read_text()) if PATH.exists() else {}


if __name__ == "__main__":
    PATH.write_text(json.dumps(make_all(), indent=1) + "\n")
    print(f"wrote {PATH}")
