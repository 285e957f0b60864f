"""Identical transformer blocks, solved once.

A 24-layer GPT's joint graph has ~7k candidate values, but its blocks are copies of one another. We
find blocks (repeated ``<path>.<index>`` module prefixes), check they are structurally identical (same
ops, shapes, dtypes and wiring, relative to the block), and build a *reduced* problem: the values
outside blocks plus one template block whose bytes and times count ``n`` times. A reference from a
block to the previous block's value becomes a reference to the template's own value at that position,
so "recompute through the previous block" stays expressible. The template's decisions are copied to
every block and the full problem's closure derives the exact kept set; the planner checks the result
against the budget and falls back to the full solve if it does not fit.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from recompile_opt.policies import find_blocks
from recompile_opt.problem import Problem, Value

MIN_REPEATS = 3


@dataclass
class BlockReduction:
    reduced: Problem
    members: dict[str, list[str]]  # template value -> the same value in every block (incl. itself)
    repeats: int

    def expand(self, names: set[str]) -> set[str]:
        out = set()
        for n in names:
            out.update(self.members.get(n, [n]))
        return out


def reduce_blocks(problem: Problem) -> BlockReduction | None:
    """The reduced problem, or None when fewer than MIN_REPEATS identical blocks exist."""
    block_of = find_blocks(problem)
    blocks: dict[str, list[str]] = {}
    for name, b in block_of.items():
        if b is not None:
            blocks.setdefault(b, []).append(name)
    order = list(blocks)
    if len(order) < MIN_REPEATS:
        return None
    local = {n: (b, i) for b, names in blocks.items() for i, n in enumerate(names)}
    sigs = [_signature(problem, blocks[b], local, order) for b in order]
    if any(s != sigs[0] for s in sigs):
        return None  # not all identical: solve in full
    template = order[1]
    members = {t: [blocks[b][i] for b in order] for i, t in enumerate(blocks[template])}
    to_template = {n: blocks[template][i] for b in order for i, n in enumerate(blocks[b])}
    return BlockReduction(_build(problem, block_of, template, to_template, len(order)), members, len(order))


def _signature(problem: Problem, names: list[str], local: dict, order: list[str]) -> list[tuple]:
    """A block's structure relative to itself: references leaving the block are only marked "out"
    (block 0 reads the embedding where block 1 reads block 0), references inside are by position."""
    sig = []
    for n in names:
        v = problem.values[n]
        block = local[n][0]
        refs = tuple(("in", local[u][1]) if local.get(u, (None,))[0] == block else ("out",) for u in v.inputs)
        storage = ("in", local[v.storage][1]) if local.get(v.storage, (None,))[0] == block else ("out",)
        sig.append((v.info.get("op"), tuple(v.info.get("shape", ())), v.info.get("dtype"), refs, storage,
                    v.needed, v.can_save, v.can_recompute, v.in_forward, v.random, v.tag))
    return sig


def _build(problem: Problem, block_of: dict, template: str, to_template: dict, n: int) -> Problem:
    values: dict[str, Value] = {}
    for name, v in problem.values.items():
        b = block_of[name]
        if b is not None and b != template:
            continue
        scale = n if b == template else 1
        inputs = tuple(dict.fromkeys(to_template.get(u, u) for u in v.inputs))
        values[name] = replace(v, inputs=inputs, recompute_s=v.recompute_s * scale, flops=v.flops * scale,
                               storage=to_template.get(v.storage, v.storage), copies=scale)
    storages = {values[n].storage for n in values} - {""}
    scale_of = {s: (n if block_of.get(s) == template else 1) for s in storages}
    return replace(problem, values=values,
                   storage_bytes={s: problem.storage_bytes[s] * scale_of[s] for s in storages},
                   save_s={s: problem.save_s[s] * scale_of[s] for s in storages},
                   rng_state_bytes=problem.rng_state_bytes, bwd_background=[])
