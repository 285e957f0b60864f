"""``recompile_opt.plan``: the plan compile would use, without running a training step.

Dynamo captures the model; each graph goes through AOTAutograd with Inductor's decompositions and
joint-graph passes and our partitioner (so the plan is the one compilation makes), and is then replaced
by a stub that returns empty tensors of the right shapes: no forward or backward is computed. Model
and inputs may live on the ``meta`` device, so a GPT-3-sized layer plans on a laptop CPU.
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Mapping

import torch
import torch.fx as fx

from recompile_opt import _torch_internals as ti
from recompile_opt.compile_paths import compile_eager, note, sequence_parallel_of
from recompile_opt.options import OptionError, Options, parse_options
from recompile_opt.partitioner import MEMORY, RecompilePartitioner
from recompile_opt.plan import Plan, fmt_bytes
from recompile_opt.plan_cache import publish
from recompile_opt.planner import budget_split
from recompile_opt.planner.search import InfeasibleBudget


def plan(
    model: torch.nn.Module, example_inputs=(), memory_budget=None, *, kwargs: Mapping | None = None, **options
) -> Plan | list[Plan]:
    """Plan ``model`` (or its ``torch.compile`` wrapper) for ``example_inputs`` under the options.

    ``example_inputs``: the positional inputs (a tuple or list, or one tensor), or a dict (any mapping:
    a tokenizer's ``BatchEncoding`` too) of keyword inputs, as Hugging Face models are called:
    ``plan(model, {"input_ids": ids, "labels": ids})`` runs ``model(input_ids=ids, labels=ids)``. A
    model whose one positional input is a dict takes ``(batch,)``. ``kwargs``: keyword inputs beside
    positional ones.

    A model that Dynamo breaks into several graphs gets a list, one plan per graph in execution order.
    An int budget is then one budget for the whole model: the graphs are learned first and the budget
    split over them (:mod:`recompile_opt.planner.budget_split`); the split is registered, so compiling the
    model with the same budget afterwards uses it."""
    module = getattr(model, "_orig_mod", model)
    inputs = call_inputs(example_inputs, kwargs)
    # The options are the ones compilation would get (compiler too): capture runs no code generation
    # whatever the compiler, but whether random ops are replayed or kept depends on it (and on
    # Inductor's fallback_random), and the plan must be the one compilation makes.
    opts = parse_options({**options, "memory_budget": memory_budget})
    aten_random = opts.compiler == "eager"  # capture the graphs that compilation will see
    if isinstance(opts.memory_budget, int) and opts.policy == "auto":
        learned = _capture(module, inputs, dataclasses.replace(opts, memory_budget=1.0), aten_random)
        if len(learned) > 1:
            _split_budget(opts, learned)
    plans = _capture(module, inputs, opts, aten_random)
    publish(plans)
    return plans[0] if len(plans) == 1 else plans


def call_inputs(example_inputs, kwargs: Mapping | None = None) -> tuple[tuple, dict]:
    """``(args, kwargs)`` to call a model with: a mapping of ``example_inputs`` is keywords, a tuple or
    list positional inputs, anything else the one positional input; ``kwargs`` adds keywords."""
    if isinstance(example_inputs, Mapping):
        args, keywords = (), dict(example_inputs)
    else:
        args = tuple(example_inputs) if isinstance(example_inputs, (tuple, list)) else (example_inputs,)
        keywords = {}
    twice = sorted(set(keywords) & set(kwargs or {}))
    if twice:
        raise TypeError(f"recompile_opt.plan: keyword inputs {twice} given in example_inputs and in kwargs")
    return args, {**keywords, **(kwargs or {})}


def _capture(module, inputs: tuple[tuple, dict], opts: Options, aten_random: bool) -> list[Plan]:
    """Run Dynamo over the model with a backend that plans each graph and computes nothing."""
    partitioner = RecompilePartitioner(opts)

    def capture(gm: fx.GraphModule, graph_inputs):
        sequence = sequence_parallel_of(gm, opts)
        compile_eager(gm, graph_inputs, partitioner, aten_random=aten_random)
        note(partitioner, sequence)
        return _empty_outputs(gm)

    # every capture is a new backend for the same code: lift Dynamo's recompile limit (8), or the
    # ninth plan of a model in one process would silently run eagerly and capture nothing
    limits = {"recompile_limit": 10**6, "accumulated_recompile_limit": 10**6}
    try:
        with torch.enable_grad(), ti.dynamo_config.patch(limits):
            args, kwargs = inputs
            torch.compile(module, backend=capture, dynamic=False)(*args, **kwargs)
    except ti.BackendCompilerFailed as e:  # show our own error, not Dynamo's wrapper
        if isinstance(e.inner_exception, OptionError):
            raise e.inner_exception from None
        raise
    if not partitioner.plans:
        raise RuntimeError(
            "recompile_opt.plan: no graph with a backward was captured (no parameter or "
            "input requires grad, or Dynamo ran the model eagerly: see TORCH_LOGS=graph_breaks)"
        )
    return partitioner.plans


def _split_budget(opts: Options, learned: list[Plan]) -> None:
    budget = opts.memory_budget
    graphs = [(p.graph, p.min_bytes, p.baseline_bytes) for p in learned]
    least = sum(lo for _, lo, _ in graphs)
    if budget < least:
        msg = (
            f"recompile_opt: memory_budget={fmt_bytes(budget)} is below the least the model's "
            f"{len(graphs)} graphs can keep together ({fmt_bytes(least)}, {least} bytes)"
        )
        if opts.strict:
            raise InfeasibleBudget(msg + " (strict=True)")
        warnings.warn(msg + "; each graph gets its least-memory plan")
    budget_split.register(MEMORY, budget, budget_split.split(budget, graphs))


def _empty_outputs(gm: fx.GraphModule):
    """A stand-in for the compiled graph: empty tensors shaped like its outputs."""
    out_node = next(iter(gm.graph.find_nodes(op="output")))
    metas = [a.meta.get("example_value") if isinstance(a, fx.Node) else a for a in out_node.args[0]]

    def run(*_args):
        return tuple(_empty_like(m) for m in metas)

    return run


def _empty_like(meta):
    if not isinstance(meta, torch.Tensor):
        return meta
    shape = [int(s.node.hint) if isinstance(s, torch.SymInt) else int(s) for s in meta.shape]
    # requires_grad as in the real run: a later graph that reads this output differentiates it
    return torch.empty(shape, dtype=meta.dtype, device=meta.device, requires_grad=meta.requires_grad)
