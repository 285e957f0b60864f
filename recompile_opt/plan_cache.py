"""The plans a process made, and the plan cache beside Inductor's.

On an Inductor cache hit our partitioner is not called, so each compile's plans are stored on disk
under a key of the Dynamo graph, its inputs and the partitioner's uuid (our code, the options), and
replayed from there; :func:`last_plans` is what the user reads.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from pathlib import Path

import torch
import torch.fx as fx

from recompile_opt import _torch_internals as ti
from recompile_opt import kept_files
from recompile_opt.options import Options
from recompile_opt.partitioner import RecompilePartitioner
from recompile_opt.plan import Plan
from recompile_opt.planning import replay_random

log = logging.getLogger(__name__)

_PLANS: list[Plan] = []


def last_plans() -> list[Plan]:
    """Every plan recorded since the process started or :func:`reset_plans`, oldest first."""
    return list(_PLANS)


def reset_plans() -> None:
    _PLANS.clear()


def publish(plans: list[Plan]) -> None:
    """Add ``plans`` to what :func:`last_plans` returns."""
    _PLANS.extend(plans)


def plan_key(gm: fx.GraphModule, example_inputs, partitioner: RecompilePartitioner) -> str:
    """The Dynamo graph, its inputs, our code and options, and the Inductor settings that change the
    joint graph we plan. Why the settings: Inductor's own caches key on its config, so a compile under
    ``fallback_random=True`` hits the artifact made under True, but without them here it replayed the
    plan last stored for False. And the state AOTAutograd's cache keys on (autocast above all: a
    model compiled under ``torch.autocast`` outside the compiled region has the same Dynamo graph).
    And Inductor's layout settings, which its figures depend on."""
    meta = [
        (tuple(t.shape), str(t.dtype), str(t.device)) if isinstance(t, torch.Tensor) else repr(t)
        for t in example_inputs
    ]
    blob = (
        gm.code
        + repr(meta)
        + partitioner.uuid()
        + f"replay_random={replay_random(partitioner.options)}"
        + ti.graph_changing_state()
        + ti.layout_settings()
    )
    return hashlib.sha256(blob.encode()).hexdigest()[:20]


def _plan_cache_dir() -> Path:
    return Path(ti.cache_dir()) / "recompile_opt_plans"


def record(partitioner: RecompilePartitioner, key: str, opts: Options) -> None:
    """Publish this compilation's plans; on a cache hit (partitioner not called) replay the stored ones."""
    path = _plan_cache_dir() / f"{key}.json"
    plans = partitioner.plans
    if plans:
        kept_files.write_json(path, [p.to_dict() for p in plans])
    elif (stored := kept_files.read_json(path)) is not None:
        plans = [Plan.from_json(json.dumps(d)) for d in stored]
        for p in plans:
            p.notes.append("replayed from the plan cache (Inductor cache hit)")
    publish(plans)
    if opts.plan_dir:
        os.makedirs(opts.plan_dir, exist_ok=True)
        for p in plans:
            Path(opts.plan_dir, f"plan_{p.graph}.json").write_text(p.to_json())
