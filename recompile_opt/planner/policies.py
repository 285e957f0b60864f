"""Fixed, hand-written policies run through the same pipeline as the ILP, for comparison.

Each policy is a pure function ``Problem -> set of values to recompute``; what is then kept follows
from :meth:`Problem.needed_closure`. They find their structure from the graph, not from module names:

* ``save-all``: recompute nothing (what eager PyTorch keeps); under sequence parallelism each gathered
  value is gathered again in the backward from the kept shard (Megatron's no-recompute layout).
* ``full``: keep only what crosses a transformer block boundary, recompute the rest of each block
  (``torch.utils.checkpoint`` around every block). Blocks are a module's children that repeat in the
  graph (:mod:`recompile_opt.planner.structure`: ``blocks.3``, ``encoder_layer_3``, an
  ``nn.ModuleDict``'s entries), else module paths up to their first index.
* ``megatron-selective``: recompute exactly the attention core (Korthikanti et al. 2022, §4.2): every
  value from the QK^T matmul to the input of the @V matmul (scale, mask, softmax, dropout), plus the
  values that only feed it. With SDPA the core is the SDPA call itself and no s x s tensor exists.
  Gathered values are gathered again, as under ``save-all``.
"""

from __future__ import annotations

import re

from recompile_opt.planner.problem import Problem
from recompile_opt.planner.structure import structural_blocks

_BLOCK = re.compile(r"^((?:.*?\.)??\d+)(?:\.|$)")  # "blocks.3.attn" -> "blocks.3"; "0.mlp.2" -> "0"
_MATMULS = ("bmm", "matmul", "baddbmm")


def save_all(problem: Problem) -> set[str]:
    """Nothing recomputed; under sequence parallelism every gathered value is gathered again in the
    backward from the kept shard (:func:`regathers`), as Megatron's no-recompute configuration does."""
    return regathers(problem)


# ops that only move what an all-gather brought in: its wait, the split into the ranks' pieces and
# their cat along the sequence, views
_MOVES = (
    "wait_tensor",
    "split",
    "split_with_sizes",
    "chunk",
    "getitem",
    "cat",
    "view",
    "_unsafe_view",
    "reshape",
    "clone",
    "permute",
    "t",
    "transpose",
    "expand",
    "alias",
    "contiguous",
)


def regathers(problem: Problem) -> set[str]:
    """Every all-gather's output and the copies that only re-arrange it, recomputed: each rank keeps
    its 1/t shard and the backward gathers it again (communication, not compute). Why not keep the
    gathered value: that is what makes tensor parallelism's activations ``sbh(10 + 24/t)`` per layer
    instead of sequence parallelism's ``34sbh/t`` (Korthikanti et al. 2022, Table 2)."""
    users = consumers(problem)
    found, todo = set(), [n for n, v in problem.values.items() if "all_gather" in v.info.get("op", "")]
    while todo:
        name = todo.pop()
        v = problem.values[name]
        if name in found or not v.can_recompute or v.flops:
            continue
        found.add(name)
        todo.extend(
            u for u in users[name] if problem.values[u].info.get("op", "").rsplit(".", 1)[-1] in _MOVES
        )
    return with_views(problem, found)


def block_of(module: str) -> str | None:
    m = _BLOCK.match(module or "")
    return m.group(1) if m else None


def find_blocks(problem: Problem) -> dict[str, str | None]:
    """Block of each value (see :func:`blocks_and_origin`)."""
    return blocks_and_origin(problem)[0]


def blocks_and_origin(problem: Problem) -> tuple[dict[str, str | None], str]:
    """Block of each value, and how the blocks were found: ``"structure"``, the children of a module
    that repeat in the graph (:mod:`recompile_opt.planner.structure`); else ``"names"``, the
    ``<path>.<index>`` module prefix; else ``"attention"``, in a single layer the top-level module that
    holds an attention core (every value None if none does)."""
    blocks = structural_blocks(problem)
    if any(blocks.values()):
        return blocks, "structure"
    blocks = {n: block_of(v.info.get("module", "")) for n, v in problem.values.items()}
    if any(blocks.values()):
        return blocks, "names"
    top = {n: (v.info.get("module") or "").split(".")[0] or None for n, v in problem.values.items()}
    with_attention = {top[n] for core in attention_cores(problem) for n in core}
    return {n: t if t in with_attention else None for n, t in top.items()}, "attention"


def consumers(problem: Problem) -> dict[str, list[str]]:
    users: dict[str, list[str]] = {n: [] for n in problem.values}
    for v in problem.values.values():
        for u in v.inputs:
            users.setdefault(u, []).append(v.name)
    return users


def full(problem: Problem) -> set[str]:
    """Everything inside a block but its outputs (values read outside it) and their storages: a block
    ending in a view (``out.view(b, s, h)``) keeps the view's base, else :func:`with_views` would
    recompute the output with its base and the whole stack became one recompute segment.

    Only the forward's readers make an output: a value only the backward reads (a mask's cast to the
    gradient's dtype, in no module) is made from the block's recomputed values like any other; counted,
    it kept each attention dropout mask (32 MiB of the 22B layer at t = 8)."""
    users = consumers(problem)
    blocks = find_blocks(problem)
    outputs = {
        problem.values[n].storage or n
        for n, b in blocks.items()
        if b is not None and any(blocks.get(u) != b for u in users[n] if problem.values[u].in_forward)
    }
    recompute = {
        n
        for n, v in problem.values.items()
        if blocks[n] is not None and v.can_recompute and (v.storage or n) not in outputs
    }
    return with_views(problem, recompute)


def attention_cores(problem: Problem) -> list[set[str]]:
    """Each attention core: values between a QK^T matmul and the lhs of the @V matmul it feeds."""
    users = consumers(problem)
    cores = []
    for name, v in problem.values.items():
        op = v.info.get("op", "")
        if "scaled_dot_product" in op:
            cores.append({name} | {u for u in users[name] if problem.values[u].info.get("op") == "getitem"})
            continue
        if op not in _MATMULS or not v.inputs:
            continue
        upstream = _ancestors_to_matmuls(problem, v.inputs[0])
        firsts = [a for a in upstream if problem.values[a].info.get("op") in _MATMULS]
        core = set()
        for first in firsts:
            core |= ({first} | _descendants(users, first)) & upstream
        if core:
            cores.append(_with_private_inputs(problem, users, core))
    return cores


def megatron_selective(problem: Problem) -> set[str]:
    recompute = regathers(problem)
    for core in attention_cores(problem):
        recompute |= {n for n in core if problem.values[n].can_recompute}
    return with_views(problem, recompute)


def with_views(problem: Problem, recompute: set[str]) -> set[str]:
    """Views of recomputed values are recomputed too: keeping a view would keep its whole base."""
    owners = {problem.values[n].storage for n in recompute if problem.values[n].storage == n}
    return recompute | {n for n, v in problem.values.items() if v.storage in owners and v.can_recompute}


def _ancestors_to_matmuls(problem: Problem, name: str) -> set[str]:
    """``name`` and its ancestors, not walking past any op with FLOPs (a matmul, addmm, SDPA), which is
    included as the boundary. Why: the lhs of block 1's @V descends from block 0's attention too; an
    unbounded walk made block 0's whole attention-to-block-1 path one "core" and recomputed it."""
    seen, todo = set(), [name]
    while todo:
        n = todo.pop()
        if n not in seen:
            seen.add(n)
            if n == name or not problem.values[n].flops:
                todo.extend(problem.values[n].inputs)
    return seen


def _descendants(users: dict[str, list[str]], name: str) -> set[str]:
    seen, todo = set(), list(users.get(name, ()))
    while todo:
        n = todo.pop()
        if n not in seen:
            seen.add(n)
            todo.extend(users.get(n, ()))
    return seen


def _with_private_inputs(problem: Problem, users, core: set[str]) -> set[str]:
    """Add recomputable values that feed only the core in the forward: the dropout mask and its seed,
    the causal mask's negation, the -inf constant. Megatron's checkpointed core recomputes them too."""
    grown = True
    while grown:
        grown = False
        for n in {i for c in core for i in problem.values[c].inputs} - core:
            v = problem.values[n]
            fwd_users = {u for u in users[n] if problem.values[u].in_forward}
            if v.can_recompute and fwd_users and fwd_users <= core:
                core.add(n)
                grown = True
    return core


POLICIES = {"save-all": save_all, "full": full, "megatron-selective": megatron_selective}
# the policies whose plans the least-peak search meets beside the ILP's (planner/least_peak.py)
SEARCHED = ("full", "megatron-selective")
