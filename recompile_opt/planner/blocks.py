"""Identical transformer blocks, solved as a few groups.

A 24-layer GPT's joint graph has ~7k candidate values, but its blocks are copies of one another. We
find blocks (repeated ``<path>.<index>`` module prefixes), check they are structurally identical (same
ops, shapes, dtypes and wiring, relative to the block), and build a *reduced* problem: the values
outside blocks plus one *template* per group of consecutive blocks, whose bytes and times count once
per block of the group. Every block of a group gets its template's decisions; the full problem's
closure then derives the exact kept set, and the planner checks it against the budget (re-solving
tighter, or in full, if it does not fit).

Why groups and not one template: one plan forced on every block spends bytes in steps of n copies of
a tensor, while the optimum mixes block plans (keeps the GELU output in 3 of 12 blocks, say) and uses
the budget to the byte; one template cost 1.5-4.5% more recompute than the full solve. Groups of
1, 2, 4, ... blocks, the remainder, and a last single block let the ILP give any number of blocks
their own plan (sums of the group sizes reach every count), with about log2(n) + 2 templates, so the
solve grows with the log of the depth. The first and last blocks are groups of their own: the first
reads the embedding and the last feeds the head, so their templates are exact.

A template is its group's first block. A reference to the previous block becomes a reference to that
position in the previous group's template (what the group's first block reads) and, when the group
has more blocks, also in its own template (what the others read): a recompute needs both available.

For stacks too short to reduce, :class:`BlockMirror` pairs the blocks' values by position, so the
least-peak search can try each plan it meets with one block's decisions given to every block: a
uniform plan, whose kernels Inductor builds once for all blocks.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from functools import cached_property

from recompile_opt.planner.policies import find_blocks
from recompile_opt.planner.problem import OFFLOAD, TWICE, Problem, Site, Value

MIN_REPEATS = 4  # fewer blocks make as many groups as blocks (1+1+1): nothing to gain
_CHOICES = (OFFLOAD, TWICE)  # a plan's choices on a value, named "<choice>:<value>"


@dataclass
class BlockReduction:
    reduced: Problem
    members: dict[str, list[str]]  # template value -> the same value in every block of its group
    repeats: int  # identical blocks
    group_sizes: list[int]  # blocks per group, in order (one template each)

    def expand(self, names: set[str]) -> set[str]:
        """The full problem's names for a reduced plan's: each template value, and each choice on
        one (``offload:<value>``), given to every block of its group."""
        out = set()
        for n in names:
            choice = next((c for c in _CHOICES if n.startswith(c)), "")
            value = n[len(choice) :]
            out.update(choice + m for m in self.members.get(value, [value]))
        return out

    def with_sites_fixed(self, fixed: bool) -> BlockReduction:
        """This reduction with every template site's choice fixed, as :meth:`Problem.with_sites_fixed`
        fixes the full problem's: a search over the fixed problem solves this one."""
        return replace(self, reduced=self.reduced.with_sites_fixed(fixed))

    def note(self, total_values: int) -> str:
        return (
            f"{self.repeats} identical blocks solved as {len(self.group_sizes)} groups "
            f"of {'+'.join(map(str, self.group_sizes))} ({len(self.reduced.values)} of "
            f"{total_values} values)"
        )


def group_sizes(n: int) -> list[int]:
    """1, 2, 4, ... blocks while they fit, the remainder, then 1: e.g. 12 -> [1, 2, 4, 4, 1]."""
    sizes, k = [1], 2
    while sum(sizes) + k + 1 <= n:
        sizes.append(k)
        k *= 2
    rest = n - sum(sizes) - 1
    return sizes + ([rest] if rest > 0 else []) + [1]


def reduce_blocks(problem: Problem) -> BlockReduction | None:
    """The reduced problem, or None when there are too few identical blocks to gain from it, or when
    a block's approximation sites do not match its template's (:func:`_template_sites`). An
    offloadable template carries its members' copy windows (``Value.member_windows``); a template's
    site stands for the same site in every block of its group."""
    found = _identical_blocks(problem)
    if found is None or len(found[2]) < MIN_REPEATS:
        return None  # too few, or not all identical: solve in full
    block_of, blocks, order, local = found
    sizes = group_sizes(len(order))
    groups, start = [], 0
    for k in sizes:
        groups.append(order[start : start + k])
        start += k
    template_of = {b: g[0] for g in groups for b in g}  # block -> its group's template block
    size_of = {g[0]: len(g) for g in groups}
    to_template = {n: blocks[template_of[b]][i] for b in order for i, n in enumerate(blocks[b])}
    members = {blocks[g[0]][i]: [blocks[b][i] for b in g] for g in groups for i in range(len(blocks[g[0]]))}
    sites = _template_sites(problem, block_of, local, groups, size_of)
    if sites is None:
        return None
    reduced = _build(problem, block_of, local, blocks, to_template, size_of, members)
    members.update({site.choice: choices for site, choices in sites})
    reduced = replace(reduced, sites=[site for site, _ in sites])
    return BlockReduction(reduced, members, len(order), sizes)


def _template_sites(
    problem: Problem, block_of: dict, local: dict, groups: list[list[str]], size_of: dict
) -> list[tuple[Site, list[str]]] | None:
    """The reduced problem's approximation sites, each with the choices it stands for: a site outside
    the blocks as it is; a template block's site, its cost once per block of its group, for the site
    at the same place in each of them; none for the other blocks' sites. None where that pairing
    fails: a site reading values of another block, or blocks whose sites differ (solve in full).
    Why: with ``approximate`` offered, a 12-layer GPT's least-peak planning took 109 s solved in
    full, against 11 s for the same stack without it, solved as block groups."""
    in_block: dict[str, list[Site]] = {}
    out = []
    for site in problem.sites:
        names = (*site.exact, *site.approx, site.replaced)
        owners = {block_of.get(n) for n in names} - {None}
        if len(owners) > 1:
            return None
        if owners:
            in_block.setdefault(owners.pop(), []).append(site)
        else:
            out.append((site, [site.choice]))
    for group in groups:
        template = in_block.get(group[0], [])
        if any(len(in_block.get(b, [])) != len(template) for b in group):
            return None
        for i, site in enumerate(template):
            twins = [in_block[b][i] for b in group]
            if any(not _same_site(site, twin, local) for twin in twins):
                return None
            k = size_of[group[0]]
            out.append((replace(site, cost_s=site.cost_s * k), [twin.choice for twin in twins]))
    return out


def _same_site(a: Site, b: Site, local: dict) -> bool:
    """Whether two blocks' sites are the same site: its kind and detail, and the values it reads at
    the same places in their blocks."""

    def places(site: Site) -> tuple:
        return tuple(local[n][1] if n in local else n for n in (*site.exact, *site.approx, site.replaced))

    return (a.kind, a.detail, places(a)) == (b.kind, b.detail, places(b))


@dataclass
class BlockMirror:
    """Every identical block's values by position, to give one block's decisions to all of them.

    Why: Inductor generates each block's kernels from its plan, and identical code is built once, so
    a plan that treats identical blocks alike builds the kernels of one block. The first block reads
    its input from outside (the embedding) where later blocks read the previous block: ``entry_twins``
    maps that input to the first block's values the second block reads in its place, and a uniform
    plan keeps the input where it keeps the twins (else the first block's kernels differ)."""

    positions: list[list[str]]  # per value position in a block: that value in every block, in order
    entry_twins: dict[str, tuple[str, ...]]  # outside value the first block reads -> its twins there

    @property
    def repeats(self) -> int:
        return len(self.positions[0])

    @cached_property
    def inside(self) -> frozenset[str]:
        """Every value of every block (asked once per mirrored plan, built once)."""
        return frozenset(n for members in self.positions for n in members)

    def mirror(self, names: set[str], source: int) -> set[str]:
        """``names`` (values to recompute, or to keep) with block ``source``'s decisions given to every
        block; outside values as they are."""
        out = {n for n in names if n not in self.inside}
        for members in self.positions:
            if members[source] in names:
                out.update(members)
        return out

    def keep_entries(self, recompute: set[str], recomputed: set[str]) -> set[str]:
        """``recompute`` less the first block's inputs none of whose twins is recomputed
        (``recomputed``: the plan's closure, where a view of a kept buffer counts as kept)."""
        return recompute - {u for u, twins in self.entry_twins.items() if not recomputed & set(twins)}


def block_mirror(problem: Problem) -> BlockMirror | None:
    """The identical blocks of ``problem`` by position, or None when there are not two of them."""
    found = _identical_blocks(problem)
    if found is None:
        return None
    block_of, blocks, order, _ = found
    first, second = blocks[order[0]], blocks[order[1]]
    twins: dict[str, tuple[str, ...]] = {}
    for a, b in zip(first, second):
        for u, w in zip(problem.values[a].inputs, problem.values[b].inputs):
            if (
                block_of.get(u) is None
                and block_of.get(w) == order[0]
                and problem.values[u].can_save
                and problem.values[u].tag not in ("must_recompute", "prefer_recompute")
            ):
                twins[u] = tuple(dict.fromkeys((*twins.get(u, ()), w)))
    return BlockMirror([list(ns) for ns in zip(*(blocks[b] for b in order))], twins)


def _identical_blocks(problem: Problem):
    """(block of each value, each block's values in order, the blocks in order, value -> (block,
    position)) when the problem has two or more blocks and all are identical, else None."""
    block_of = find_blocks(problem)
    blocks: dict[str, list[str]] = {}
    for name, b in block_of.items():
        if b is not None:
            blocks.setdefault(b, []).append(name)
    order = list(blocks)
    local = {n: (b, i) for b, names in blocks.items() for i, n in enumerate(names)}
    sigs = [_signature(problem, blocks[b], local) for b in order]
    if len(order) < 2 or any(s != sigs[0] for s in sigs):
        return None
    return block_of, blocks, order, local


def _signature(problem: Problem, names: list[str], local: dict) -> list[tuple]:
    """A block's structure relative to itself: references leaving the block are only marked "out"
    (block 0 reads the embedding where block 1 reads block 0), references inside are by position."""
    sig = []
    for n in names:
        v = problem.values[n]
        block = local[n][0]
        refs = tuple(
            tuple(("in", local[u][1]) if local.get(u, (None,))[0] == block else ("out",) for u in names)
            for names in (v.inputs, v.recompute_with)
        )
        storage = ("in", local[v.storage][1]) if local.get(v.storage, (None,))[0] == block else ("out",)
        sig.append(
            (
                v.info.get("op"),
                tuple(v.info.get("shape", ())),
                v.info.get("dtype"),
                refs,
                storage,
                v.needed,
                v.can_save,
                v.can_recompute,
                v.in_forward,
                v.random,
                v.tag,
            )
        )
    return sig


def _build(
    problem: Problem,
    block_of: dict,
    local: dict,
    blocks: dict,
    to_template: dict,
    size_of: dict,
    members: dict,
) -> Problem:
    """Outside values as they are, each template's values scaled by its group's size, an offloadable
    one with every member's copy windows."""
    values: dict[str, Value] = {}
    for name, v in problem.values.items():
        b = block_of[name]
        if b is not None and b not in size_of:
            continue  # a non-template block: its template stands for it
        k = size_of.get(b, 1)
        inputs = [to_template.get(u, u) for u in v.inputs]
        if k > 1:  # the group's other blocks read the previous block of the same group: its template
            inputs += [blocks[b][local[u][1]] for u in v.inputs if block_of.get(u) not in (None, b)]
        inputs = tuple(u for u in dict.fromkeys(inputs) if u != name)
        windows = [problem.values[m].offload_windows for m in members.get(name, [])] if k > 1 else []
        offloadable = v.offload_windows is not None and None not in windows
        values[name] = replace(
            v,
            offload_windows=v.offload_windows if offloadable else None,
            member_windows=tuple(windows) if offloadable else (),
            inputs=inputs,
            recompute_with=tuple(to_template.get(u, u) for u in v.recompute_with),
            recompute_s=v.recompute_s * k,
            flops=v.flops * k,
            storage=to_template.get(v.storage, v.storage),
            copies=k,
        )
    # in the full problem's order, not a set's: the ILP's columns follow this order, and with a MIP gap
    # the solver's answer depends on it (a set made plans differ between processes: hash seeds)
    used = {v.storage for v in values.values()}
    storages = [s for s in problem.storage_bytes if s in used]
    scale = {s: size_of.get(block_of.get(s), 1) for s in storages}
    return replace(
        problem,
        values=values,
        storage_bytes={s: problem.storage_bytes[s] * scale[s] for s in storages},
        save_s={s: problem.save_s[s] * scale[s] for s in storages},
        rng_state_bytes=problem.rng_state_bytes,
        bwd_steps=0,
    )
