"""The partitioner Inductor and AOTAutograd call: ``(joint graph, inputs) -> (forward, backward)``.

It adapts :func:`recompile_opt.planning.plan_joint_graph` to the call torch makes
(``torch._inductor.config.custom_partitioner_fn``, or AOTAutograd's ``partition_fn``) and keeps what each
call planned. What it is asked is its :attr:`RecompilePartitioner.request`, a frozen value the compile
paths set for the span of one compile (:meth:`RecompilePartitioner.asked`).

Control flow that crosses Inductor: under ``chunks="auto"`` a planning may answer that the graph should
be chunked first; the partitioner then raises :class:`ChunkingWanted` through Inductor's ``compile_fx``,
and :func:`recompile_opt.chunk_driver.compile_with_chunk_choice` catches it. Nothing else crosses.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib

import torch.fx as fx

from recompile_opt import _torch_internals as ti
from recompile_opt.options import Options
from recompile_opt.parallel.agreement import check_same_plan
from recompile_opt.plan import Plan
from recompile_opt.planner import budget_split
from recompile_opt.planner.memory import PlanningMemory
from recompile_opt.planning import Planned, Request, plan_joint_graph, random_fuses, replay_random
from recompile_opt.provenance import code_hash

# What planning remembers in this process (the least-peak searches, a whole-model budget's shares, the
# peaks found per graph): owned here, the one place every compile path reaches, and passed in.
MEMORY = PlanningMemory()


class ChunkingWanted(Exception):
    """Raised by the partitioner under ``chunks="auto"`` where the unchunked graph's plan may peak lower
    chunked (:func:`recompile_opt.chunk_driver.compile_with_chunk_choice` catches it); carries that plan."""

    def __init__(self, plan: Plan):
        super().__init__(f"chunks (auto): graph {plan.graph} may peak lower chunked")
        self.plan = plan


class RecompilePartitioner(ti.CustomPartitionerFn):
    """Plans each joint graph it is called with (:func:`plan_joint_graph`) and partitions it to match.
    ``plans``: what it planned, oldest first; ``last_forward`` / ``last_backward``: the graphs of its
    last partition."""

    def __init__(self, options: Options, memory: PlanningMemory = MEMORY):
        self.options, self.memory = options, memory
        self.request = Request()
        self.planned: list[Planned] = []
        self.last_forward: fx.GraphModule | None = None
        self.last_backward: fx.GraphModule | None = None

    @property
    def plans(self) -> list[Plan]:
        return [p.plan for p in self.planned]

    @contextlib.contextmanager
    def asked(self, **request):
        """Within the block, the partitioner is asked ``request`` (:class:`Request`'s fields)."""
        before, self.request = self.request, dataclasses.replace(self.request, **request)
        try:
            yield self
        finally:
            self.request = before

    def __call__(self, gm: fx.GraphModule, joint_inputs, **kwargs):
        planned = plan_joint_graph(gm, kwargs, self.options, self.request, self.memory)
        self.last_forward, self.last_backward = planned.fw, planned.bw
        if planned.wants_chunks:
            raise ChunkingWanted(planned.plan)
        self.planned.append(planned)
        check_same_plan(planned.plan, planned.plan.graph)
        return planned.fw, planned.bw

    def finish_peak(self, compiled: list) -> None:
        """The figures of the plans whose walk waited for Inductor's compile, read off the code that
        compile generated (``compiled``: ``_torch_internals.compiled_wrapper_code``'s records)."""
        for planned in self.planned:
            if planned.deferred is not None:
                planned.deferred.finish(compiled)
                planned.deferred = None

    def walks_plan_taken(self) -> bool:
        """Whether Inductor's compile of the plan taken is walked for its figures (the walk waits for
        the compile's own code: no lowering of its own, so every plan Inductor compiles is walked; the
        peak a user reads, and a limit is held to, is the code's: the kernel model alone was 14-58% off
        on models the tests had not seen)."""
        return self.options.compiler == "inductor"

    def replay_random(self) -> bool:
        return replay_random(self.options)

    def random_fuses(self) -> bool:
        return random_fuses(self.options)

    def uuid(self) -> str:
        """Our code, the options and the budget shares they read: the compile caches' key."""
        split = budget_split.state_key(self.memory, self.options)
        mine = hashlib.sha256((code_hash() + self.options.key()).encode()).hexdigest()[:16]
        return mine + (hashlib.sha256(split.encode()).hexdigest()[:8] if split else "")

    def __deepcopy__(self, memo):
        """Itself, and pickled as its :meth:`uuid`. Why: Inductor deep-copies and pickles its config for
        the compile cache's key (``save_config_portable``), this object included, while it holds the
        graphs and simulator of a plan whose peak waits for the compile (fake tensors, which cannot be
        copied; cycles, which the key's pickler refuses). What it computes depends on the uuid alone."""
        return self

    def __reduce__(self):
        return str, (self.uuid(),)
