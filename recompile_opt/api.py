"""``recompile_opt.plan``: the plan compile would use, without running a training step.

Dynamo captures the model; each graph goes through AOTAutograd with Inductor's decompositions and
joint-graph passes and our partitioner (so the plan is the one compilation makes), and is then replaced
by a stub that returns empty tensors of the right shapes: no forward or backward is computed. Model
and inputs may live on the ``meta`` device, so a GPT-3-sized layer plans on a laptop CPU.
"""

from __future__ import annotations

import torch
import torch.fx as fx

from recompile_opt.backend import _PLANS, RecompilePartitioner, compile_eager
from recompile_opt.options import OptionError, parse_options
from recompile_opt.plan import Plan


class MultipleGraphsError(RuntimeError):
    """The model breaks into several graphs; multi-graph plans are not supported yet."""


def plan(model: torch.nn.Module, example_inputs, memory_budget=None, **options) -> Plan:
    """Plan ``model`` (or its ``torch.compile`` wrapper) for ``example_inputs`` under the options."""
    module = getattr(model, "_orig_mod", model)
    raw = {**options, "memory_budget": memory_budget}
    raw.setdefault("compiler", "eager")
    opts = parse_options(raw)
    partitioner = RecompilePartitioner(opts)
    graphs: list[fx.GraphModule] = []

    def capture(gm: fx.GraphModule, inputs):
        graphs.append(gm)
        compile_eager(gm, inputs, partitioner, aten_random=False)
        return _empty_outputs(gm)

    inputs = example_inputs if isinstance(example_inputs, (tuple, list)) else (example_inputs,)
    try:
        with torch.enable_grad():
            torch.compile(module, backend=capture, dynamic=False)(*inputs)
    except torch._dynamo.exc.BackendCompilerFailed as e:  # show our own error, not Dynamo's wrapper
        if isinstance(e.inner_exception, OptionError):
            raise e.inner_exception from None
        raise
    if len(graphs) != 1:
        raise MultipleGraphsError(
            f"recompile_opt.plan: the model breaks into {len(graphs)} graphs; plans for several graphs "
            "are not supported yet (see torch._dynamo.explain for the breaks)")
    if not partitioner.plans:
        raise RuntimeError("recompile_opt.plan: the graph needs no backward (no input requires grad)")
    _PLANS.extend(partitioner.plans)
    return partitioner.plans[0]


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
    return torch.empty(shape, dtype=meta.dtype, device=meta.device)
