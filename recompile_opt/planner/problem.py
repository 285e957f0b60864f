"""The save/recompute problem as plain data keyed by node name: no FX objects, so solvers and policies
are pure functions that tests can build by hand (see tests/test_ilp.py).

A *value* is one forward node whose result the backward may need. A *storage* is the buffer a value
lives in: views share their base's storage, and memory is charged per storage.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

OFFLOAD = "offload:"  # a plan offloads value v when "offload:v" is in its recomputed set (see Problem)
# a plan recomputes value v a second time for its late readers when "twice:v" is in its recomputed set
# (passes/partition.py, _recompute_twice)
TWICE = "twice:"
# FLOPs an output element above which a value is compute-bound (Value.compute_bound)
COMPUTE_BOUND_FLOPS = 4


def offload_choice(name: str) -> str:
    return OFFLOAD + name


def twice_values(recomputed) -> set[str]:
    """The values a plan's recomputed set recomputes twice."""
    return {n[len(TWICE) :] for n in recomputed if n.startswith(TWICE)}


def offloaded_values(recomputed) -> set[str]:
    """The values a plan's recomputed set offloads."""
    return {n[len(OFFLOAD) :] for n in recomputed if n.startswith(OFFLOAD)}


@dataclass
class Value:
    name: str
    storage: str  # storage name ("" for tuples and other non-tensors: nothing to keep)
    inputs: tuple[str, ...] = ()  # the values it is computed from
    needed: bool = False  # read directly by the backward
    can_save: bool = True
    can_recompute: bool = True
    # values recomputed whenever this one is (never read kept by its recompute): a mixed-precision op's
    # computed low-precision inputs, which Inductor's forward may not have rounded as a kept copy is
    # (passes/joint_graph._low_precision_inputs)
    recompute_with: tuple[str, ...] = ()
    in_forward: bool = True  # the forward computes it anyway; False: only the backward needs it
    random: bool = False  # recompute replays a saved RNG state (charged rng_state_bytes)
    recompute_s: float = 0.0
    flops: int = 0
    # backward step of its last use (direct, or through a value of its block recomputed from it); the
    # least-peak search weighs a kept byte by how long it stays alive (least_peak._lifetime_weighted)
    last_use: int = 0
    copies: int = 1  # identical blocks this value stands for (a reduced problem, see blocks.py)
    # user SAC tag: must_save, prefer_save, must_recompute, prefer_recompute, must_cpu_offload,
    # prefer_cpu_offload
    tag: str | None = None
    # (forward seconds after its last forward use, backward seconds before its first backward use): the
    # windows its copies to the host and back may overlap; None: it cannot be offloaded (a view, a getitem,
    # non-contiguous, an input or an output of the graph: what torch's activation offloading refuses)
    offload_windows: tuple[float, float] | None = None
    # a block template's (blocks.py) members' windows, one per block it stands for, each moving
    # 1/copies of its bytes; empty: its own ``offload_windows`` for all of them
    member_windows: tuple[tuple[float, float], ...] = ()
    info: dict = field(default_factory=dict)  # op, module, source, shape, dtype: for the Plan only

    @property
    def compute_bound(self) -> bool:
        """More than :data:`COMPUTE_BOUND_FLOPS` FLOPs an output element (a matmul: 2K; attention),
        where an elementwise op or a random op's replay does one or two: what recomputing costs real
        time, not a pass over memory. A symbolic dimension counts as 1."""
        elements = math.prod(d for d in self.info.get("shape") or () if isinstance(d, int))
        return self.flops > COMPUTE_BOUND_FLOPS * elements


@dataclass
class Site:
    """A place where the backward may read an approximation instead of exact values (issue 24): a
    third and fourth action next to keep and recompute. The plan approximates it when its ``choice``
    is in the plan's recomputed set (so every search that passes sets of names around carries it)."""

    choice: str  # "approximate:<marker>": the name the plan's recomputed set holds when approximated
    marker: str  # the joint graph's marker node (passes/approximate.py)
    kind: str  # "few-bit" (an activation's codes) or "randomized" (a linear input's projection)
    exact: tuple[str, ...]  # the values the exact gradient reads
    approx: tuple[str, ...]  # the values the approximate gradient reads
    replaced: str  # the value the approximation stands for (the activation's / the linear's input)
    detail: dict = field(default_factory=dict)  # bits and activation, or ratio
    cost_s: float = 0.0  # what approximating adds to the step (codes, projections): its price in the ILP
    fixed: bool | None = (
        None  # True: approximated, False: exact, whatever its price (the least-peak searches)
    )


@dataclass
class Problem:
    values: dict[str, Value]  # in topological order
    storage_bytes: dict[str, int]  # 0 for parameters and buffers (they live anyway)
    save_s: dict[str, float]  # time to write + read a kept storage
    rng_state_bytes: int = 0
    bwd_steps: int = 0  # nodes in the backward (the scale of last_use); 0: no schedule (a reduced problem)
    bwd_byte_steps: int = 0  # Σ over backward steps of the bytes its own tensors hold: the ILP's byte scale
    step_s: float = 0.0  # estimated forward + backward time without recompute
    device: str = "cpu"
    # the step's collectives (tensor/sequence parallelism), for the Plan: name, op, shape, dtype, phase
    # (forward/backward), bytes (what one rank sends); a forward all-gather may be recomputed (a re-gather)
    collectives: list[dict] = field(default_factory=list)
    sites: list[Site] = field(default_factory=list)  # approximate actions offered (option ``approximate``)
    # the host link's bandwidth per direction where offload is offered (option ``offload``); 0: not
    # offered. A plan offloads value v by holding "offload:v" in its recomputed set, as it names an
    # approximated site, so every search that passes (saved, recomputed) sets around carries the choice
    host_bytes_per_s: float = 0.0
    # user MUST_/PREFER_CPU_OFFLOAD tags are offered offload even with the option off, where the device
    # has a host link (``host_bytes_per_s`` is then theirs alone)
    offload_only_tagged: bool = False
    offload_ops: bool = True  # the installed torch has the activation-offloading ops (passes/joint_graph.py)
    # the emitted offload gave eager's loss where last checked on this device (False on CUDA: docs/gpu.md)
    offload_checked: bool = True
    # on the step's kernel clock (passes/joint_graph._Clock), by node name: each forward node's kernel's
    # end from the forward's start, each backward node's kernel's start from the backward's: where an
    # offloaded value's copies are issued and done (planner/offload.py)
    forward_done_s: dict[str, float] = field(default_factory=dict)
    backward_start_s: dict[str, float] = field(default_factory=dict)

    def offloadable(self) -> list[str]:
        """Values the ILP may offload: a buffer of its own (a view would keep its base on the device),
        in the windows torch's offloading accepts, with bytes to move."""
        if self.host_bytes_per_s <= 0:
            return []
        return [
            n
            for n, v in self.values.items()
            if v.offload_windows is not None
            and v.can_save
            and v.storage == n
            and self.storage_bytes.get(n, 0) > 0
            and (not self.offload_only_tagged or (v.tag or "").endswith("cpu_offload"))
        ]

    def offload_figures(self, saved: set[str], recomputed: set[str]) -> dict:
        """Bytes a plan moves each way per step, and the copy time hidden behind compute and exposed.

        Each direction's copies share one link. A copy to the host may start after its value's last
        forward use and must end by the forward's end; a copy back may start when the backward does and
        must end by the value's first use. With every copy released at its window's start, the least
        stall is the largest excess of bytes over the link's reach in any window that closes the
        direction: ``max(0, max_t (sum of bytes whose window is at most t) / bandwidth - t)``
        (earliest-deadline-first meets every other deadline). The ILP's window rows are the same
        formula (``ilp.add_offload``)."""
        off = sorted(offloaded_values(recomputed) & saved)
        out = {
            "values": len(off),
            "bytes_to_host": 0,
            "bytes_to_device": 0,
            "hidden_s": 0.0,
            "exposed_s": 0.0,
        }
        if not off or self.host_bytes_per_s <= 0:
            return out
        total = sum(self.storage_bytes[self.values[n].storage] for n in off)
        exposed = sum(
            exposed_seconds([c for n in off for c in self.copies_of(n, d)], self.host_bytes_per_s)
            for d in (0, 1)
        )
        out.update(
            bytes_to_host=total,
            bytes_to_device=total,
            hidden_s=2 * total / self.host_bytes_per_s - exposed,
            exposed_s=exposed,
            host_bytes_per_s=self.host_bytes_per_s,
        )
        return out

    def copies_of(self, name: str, direction: int) -> list[tuple[float, int]]:
        """(window seconds, bytes) of each copy offloading ``name`` makes in ``direction`` (0: to the
        host, 1: back): one, or one per block a template stands for (its bytes split evenly). Why:
        each block's copy has its own window, and a reduced problem must price them as the full one
        does."""
        v = self.values[name]
        nbytes = self.storage_bytes[v.storage]
        windows = v.member_windows or (v.offload_windows,)
        return [(w[direction], nbytes // len(windows)) for w in windows]

    def with_sites_fixed(self, fixed: bool) -> "Problem":
        """This problem with every site's choice fixed: all approximated (True) or none (False)."""
        return dataclasses.replace(self, sites=[dataclasses.replace(s, fixed=fixed) for s in self.sites])

    def with_recompute_barred(self, names: set[str]) -> "Problem":
        """This problem with the values ``names`` kept wherever the backward needs them, never recomputed."""
        barred = {n: dataclasses.replace(self.values[n], can_recompute=False) for n in names}
        return dataclasses.replace(self, values={**self.values, **barred})

    def needed_closure(
        self, recompute: set[str], keep: set[str] = frozenset(), *, feasible: set[str] | None = None
    ) -> tuple[set[str], set[str]]:
        """Given which values are recomputed, derive (saved, recomputed) — what the backward reads.

        Values only the backward uses (``in_forward=False``, e.g. a transposed weight or an upcast for a
        backward formula) are computed in the backward, as eager autograd would, unless they cannot be.
        A value whose ``recompute_with`` would be read kept is kept itself (the ILP never asks for that;
        a hand policy or a search's move may). ``feasible``: :meth:`recomputable`, passed in by callers
        that ask many times.
        """
        feasible = self.recomputable() if feasible is None else feasible
        for _ in range(len(self.values) + 1):
            saved, recomputed = self._closure(recompute, keep, feasible)
            coupled = {
                n
                for n in recomputed & set(recompute)
                if n in self.values  # not a site's or an offload's choice
                and self.values[n].can_save
                and any(u in saved for u in self.values[n].recompute_with)
            }
            if not coupled:
                break
            recompute = set(recompute) - coupled
        return saved, recomputed

    def _closure(self, recompute: set[str], keep, feasible: set[str]) -> tuple[set[str], set[str]]:
        saved, recomputed, todo = set(), set(), [n for n, v in self.values.items() if v.needed]
        for site in self.sites:  # an approximated site reads its codes or projection instead
            if site.choice in recompute:
                recomputed.add(site.choice)
                todo.extend(site.approx)
            else:
                todo.extend(site.exact)
        offloaded = offloaded_values(recompute)
        while todo:
            name = todo.pop()
            if name in saved or name in recomputed:
                continue
            v = self.values[name]
            wanted = name in recompute or not (v.in_forward or name in keep) or not v.can_save
            if wanted and name in feasible:
                recomputed.add(name)
                todo.extend(v.inputs)
            else:
                saved.add(name)
        # an offloaded value is kept (on the host): its choice holds where it is kept
        recomputed |= {offload_choice(n) for n in offloaded & saved}
        # a value recomputed twice: its choice holds where it is recomputed
        recomputed |= {TWICE + n for n in twice_values(recompute) & recomputed}
        return saved, recomputed

    def recomputable(self) -> set[str]:
        """Values whose recomputation is possible at all: every input can be kept or recomputed
        (a tuple output of a keep-only op, e.g. a random op without replay, cannot be kept)."""
        ok: set[str] = set()
        for name, v in self.values.items():  # topological order
            if (
                v.can_recompute
                and all(self.values[u].can_save or u in ok for u in v.inputs)
                and all(u in ok for u in v.recompute_with)
            ):
                ok.add(name)
        return ok

    def kept_bytes(self, saved: set[str], recomputed: set[str] = frozenset()) -> int:
        """Device bytes kept from the forward for the backward: an offloaded value's buffer is on the host
        then, unless another kept value (a view) holds it on the device."""
        offloaded = offloaded_values(recomputed) & saved
        on_device = {self.values[n].storage for n in saved - offloaded}
        storages = (
            {self.values[n].storage for n in saved}
            - {""}
            - ({self.values[n].storage for n in offloaded} - on_device)
        )
        rng = sum(
            self.values[n].copies
            for n in recomputed  # (a site's choice is no value)
            if n in self.values and self.values[n].random and self.values[n].in_forward
        )
        return sum(self.storage_bytes[s] for s in storages) + rng * self.rng_state_bytes

    def recompute_seconds(self, recomputed: set[str]) -> float:
        """Summed in the values' (graph) order, not the set's: a set of names iterates in an order that
        varies with each process's string hash seed, float sums then differ in the last bit, and two
        ranks broke a tie between equal plans differently (tests/test_parallel_rewrite.py)."""
        twice = twice_values(recomputed)
        return sum(
            v.recompute_s * (1 + (n in twice))
            for n, v in self.values.items()
            if n in recomputed and v.in_forward
        )


def exposed_seconds(windows: list[tuple[float, int]], bytes_per_s: float) -> float:
    """The least stall of copies over one link, each (window seconds, bytes) released at its window's
    start and due at a common end (to the host: the forward's end) or, read backwards, released at a
    common start and due at its window's end (back: each first use). See ``offload_figures``."""
    worst, moved = 0.0, 0
    for window, nbytes in sorted(windows):
        moved += nbytes
        worst = max(worst, moved / bytes_per_s - window)
    return worst
