"""PyTorch's CUDA caching allocator, modelled: the bytes ``torch.cuda.max_memory_allocated`` counts for
a step whose allocations and frees the walk of Inductor's code lists.

Why: the walk counts the bytes the code asks for; the allocator hands out blocks. A request is rounded
to 512 B, and in the large pool (requests above 1 MiB) a free block is split only where more than
1 MiB would remain: a 2 MiB request served by a free 3 MiB block holds all 3 MiB, and the allocated
counter counts them. On the H200 (docs/gpu.md, 2026-12-04) the demo GPT's plans measured 0.3-2.0 MiB
above their walks (up to 4.9%, against a 3% target), in such steps.

The model (torch 2.11-2.15's native backend, ``CUDACachingAllocator.cpp``, one stream): two pools of
free blocks, best fit (the smallest free block that holds the rounded request, the lower address on a
tie); a new segment where none fits (2 MiB for requests up to 1 MiB, 20 MiB up to 10 MiB, else the
request rounded to 2 MiB); a block split where the pool's rule allows (small: 512 B or more remain;
large: more than 1 MiB remains and the request is under ``max_split_size_mb``; every pool with
``expandable_segments``); a freed block merged with its free neighbours in its segment; segments never
returned. Where a setting it does not model is set (another backend, ``roundup_power2_divisions``),
``Settings.unmodelled`` says which, and the caller keeps the walked figure.

A step is modelled in steady state: the baseline (parameters, inputs) allocated first and held, then
:data:`STEPS` steps, each freeing what it still holds at its end (its gradients go with
``zero_grad``), and the last step's most allocated bytes above its start are the figure: the first
step creates the segments, the later ones reuse them as a training loop does.
"""

from __future__ import annotations

import bisect
import itertools
from dataclasses import dataclass, field

MIN_BLOCK = 512  # kMinBlockSize: every request is rounded up to a multiple of it
SMALL_SIZE = 1 << 20  # kSmallSize: the largest request of the small pool
SMALL_BUFFER = 2 << 20  # kSmallBuffer: a small pool's segment
LARGE_BUFFER = 20 << 20  # kLargeBuffer: the segment of a request up to MIN_LARGE_ALLOC
MIN_LARGE_ALLOC = 10 << 20  # kMinLargeAlloc
ROUND_LARGE = 2 << 20  # kRoundLarge: larger segments are the request rounded to it
STEPS = 3  # steps modelled; the last one's peak is the figure (the second already reuses segments)
# settings that do not change one step's blocks: the cache's release under memory pressure (the
# model's device never fills), the host's pinned memory, the lock around cudaMalloc, graph capture
UNAFFECTED = frozenset(
    {
        "garbage_collection_threshold",
        "release_lock_on_cudamalloc",
        "pinned_use_cuda_host_register",
        "pinned_num_register_threads",
        "pinned_use_background_threads",
        "pinned_reserve_segment_size_mb",
        "graph_capture_record_stream_reuse",
    }
)


@dataclass
class Block:
    ptr: int
    size: int
    small: bool  # in the small pool's segments (requests up to SMALL_SIZE)
    free: bool = True
    prev: Block | None = field(default=None, repr=False)
    next: Block | None = field(default=None, repr=False)


@dataclass
class Settings:
    """What the model reads of ``PYTORCH_CUDA_ALLOC_CONF`` (:func:`parse`)."""

    expandable_segments: bool = False
    max_split_size: int | None = None  # bytes; None: no limit (torch's default)
    unmodelled: tuple[str, ...] = ()  # settings set that the model does not follow


def parse(conf: str, backend: str = "native") -> Settings:
    """The allocator settings string (``"expandable_segments:True,max_split_size_mb:128"``) as the
    model reads it; ``backend``: ``torch.cuda.get_allocator_backend()``."""
    out = Settings(unmodelled=() if backend == "native" else (f"backend:{backend}",))
    for item in filter(None, (s.strip() for s in conf.split(","))):
        name, _, value = item.partition(":")
        name = name.strip()
        if name == "expandable_segments":
            out.expandable_segments = value.strip().lower() == "true"
        elif name == "max_split_size_mb":
            out.max_split_size = int(float(value)) << 20
        elif name == "backend":  # the string's, read before CUDA is initialised
            unmodelled = f"backend:{value.strip()}"
            if value.strip() != "native" and unmodelled not in out.unmodelled:
                out.unmodelled += (unmodelled,)
        elif name not in UNAFFECTED:
            out.unmodelled += (name,)
    return out


def round_size(nbytes: int) -> int:
    """A request's bytes as the allocator rounds them (``round_size``, default settings)."""
    return max(MIN_BLOCK, -(-nbytes // MIN_BLOCK) * MIN_BLOCK)


def segment_size(size: int) -> int:
    """The bytes of a new segment for a rounded request (``get_allocation_size``)."""
    if size <= SMALL_SIZE:
        return SMALL_BUFFER
    if size < MIN_LARGE_ALLOC:
        return LARGE_BUFFER
    return -(-size // ROUND_LARGE) * ROUND_LARGE


class CachingAllocator:
    """One stream's small and large pools; ``allocated`` and ``peak`` as torch's counters count them."""

    def __init__(self, settings: Settings | None = None):
        self.settings = settings or Settings()
        self.pools: dict[bool, list[tuple[int, int, Block]]] = {True: [], False: []}  # small? -> free
        self.live: dict[object, Block] = {}
        self.allocated = self.peak = 0
        self._addresses = itertools.count(1 << 40, 1 << 36)  # each segment far from the others

    def malloc(self, key: object, nbytes: int) -> None:
        """Allocate ``nbytes`` for ``key`` (0 bytes: nothing, as a CUDA tensor with no elements)."""
        if nbytes <= 0:
            return
        size = round_size(nbytes)
        small = size <= SMALL_SIZE
        block = self._best_fit(small, size) or Block(next(self._addresses), segment_size(size), small)
        if self._splits(small, block.size, size):
            rest = Block(block.ptr + size, block.size - size, small, prev=block, next=block.next)
            if block.next is not None:
                block.next.prev = rest
            block.next, block.size = rest, size
            self._insert(small, rest)
        block.free = False
        self.live[key] = block
        self.allocated += block.size
        self.peak = max(self.peak, self.allocated)

    def free(self, key: object) -> None:
        """Free ``key``'s block (a key never allocated, or of 0 bytes: nothing)."""
        block = self.live.pop(key, None)
        if block is None:
            return
        self.allocated -= block.size
        block.free = True
        small = block.small
        for neighbour in (block.prev, block.next):
            if neighbour is not None and neighbour.free:
                self._remove(small, neighbour)
                block = self._merge(block, neighbour)
        self._insert(small, block)

    def _splits(self, small: bool, block_size: int, size: int) -> bool:
        remaining = block_size - size
        if small or self.settings.expandable_segments:
            return remaining >= MIN_BLOCK
        limit = self.settings.max_split_size
        return (limit is None or size < limit) and remaining > SMALL_SIZE

    def _best_fit(self, small: bool, size: int) -> Block | None:
        pool = self.pools[small]
        i = bisect.bisect_left(pool, (size, -1))
        if i == len(pool):
            return None
        block = pool[i][2]
        limit = self.settings.max_split_size
        if limit is not None and not small:  # no oversize block for a request below the limit, and
            if (size < limit <= block.size) or (size >= limit and block.size >= size + LARGE_BUFFER):
                return None  # none far larger for one above it
        del pool[i]
        return block

    def _merge(self, block: Block, other: Block) -> Block:
        first, second = (other, block) if other.ptr < block.ptr else (block, other)
        first.size += second.size
        first.next = second.next
        if second.next is not None:
            second.next.prev = first
        first.free = True
        return first

    def _insert(self, small: bool, block: Block) -> None:
        bisect.insort(self.pools[small], (block.size, block.ptr, block))

    def _remove(self, small: bool, block: Block) -> None:
        pool = self.pools[small]
        i = bisect.bisect_left(pool, (block.size, block.ptr))
        if i < len(pool) and pool[i][2] is block:
            del pool[i]


def step_peak(events: list[tuple], baseline: list[int] = (), settings: Settings | None = None) -> int:
    """The most bytes the allocator counts above a step's start, in steady state (module docstring).
    ``events``: the step's ``("alloc", key, bytes)`` and ``("free", key)`` in order; ``baseline``: the
    bytes of the tensors held throughout (parameters, inputs), allocated first in this order."""
    allocator = CachingAllocator(settings)
    for i, nbytes in enumerate(baseline):
        allocator.malloc(("baseline", i), nbytes)
    peak = 0
    for _ in range(STEPS):
        start = allocator.peak = allocator.allocated
        for event in events:
            if event[0] == "alloc":
                allocator.malloc(event[1], event[2])
            else:
                allocator.free(event[1])
        for key in [k for k in allocator.live if not (isinstance(k, tuple) and k[0] == "baseline")]:
            allocator.free(key)
        peak = allocator.peak - start
    return peak


def requested_peak(events: list[tuple]) -> int:
    """The most bytes the step's requests hold at once, each rounded to 512 B: what the allocator
    counts where every block is split (``expandable_segments``), and the walk's figure rounded."""
    live: dict[object, int] = {}
    now = peak = 0
    for event in events:
        if event[0] == "alloc" and event[2] > 0:
            live[event[1]] = round_size(event[2])
            now += live[event[1]]
            peak = max(peak, now)
        elif event[0] == "free":
            now -= live.pop(event[1], 0)
    return peak
