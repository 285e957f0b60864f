"""Approximate backward as graph rewrites (issue 24): offer it in the Dynamo graph, settle it in the joint.

:func:`offer_approximations` rewrites the Dynamo graph before AOTAutograd: each GELU / SiLU becomes
:class:`~recompile_opt.approximate.actions.ApproximableActivation` (``approximate={"activations": bits}``)
and each linear layer with a trained weight (``F.linear``, or Hugging Face's ``Conv1D``: an ``addmm`` of
a ``[in, out]`` weight) :class:`~recompile_opt.approximate.actions.ApproximableLinear`
(``"linear": ratio``). Their joint graph holds a *site* per call: a marker op in the backward that reads
both the exact input and its codes or projection. The planner chooses per site
(:mod:`recompile_opt.planner.ilp`), and :func:`settle` replaces every marker by the exact or the
approximate formula, traced with Inductor's decompositions so Inductor fuses it, before the graph is
partitioned and simulated. The side a plan does not read is dead and removed, so an exact site costs
nothing at run time.
"""

from __future__ import annotations

import contextlib
import copy
from dataclasses import dataclass

import torch
import torch.fx as fx
import torch.nn.functional as F
from recompile_opt.passes.chunking import LINEAR, value_of

from recompile_opt import _torch_internals as ti
from recompile_opt.approximate import actions, triton_kernels
from recompile_opt.ops import arguments

ACTIVATION_NAMES = {F.silu: "silu"}  # F.gelu: "gelu" or "gelu_tanh" by its ``approximate`` argument


@dataclass
class Offered:
    """What :func:`offer_approximations` rewrote: one entry per call, for the plan's notes."""

    activations: int = 0
    linears: int = 0
    skipped: tuple = ()  # (call, why) of activations and linears left exact

    def note(self, allowed: dict) -> str:
        parts = []
        if allowed.get("activations"):
            parts.append(f"{self.activations} activation(s) may keep {allowed['activations']}-bit codes")
        if allowed.get("linear"):
            parts.append(
                f"{self.linears} linear layer(s) may keep a random projection of ratio {allowed['linear']:g}"
            )
        skipped = "; ".join(f"{name}: {why}" for name, why in self.skipped[:3])
        return "approximate: " + ", ".join(parts) + (f" (left exact: {skipped})" if skipped else "")


def offer_approximations(gm: fx.GraphModule, allowed: dict) -> Offered:
    """Rewrite ``gm`` (a Dynamo graph) in place so its activations / linears can be approximated."""
    done = Offered()
    skipped = []
    for node in list(gm.graph.nodes):
        if node.op != "call_function":
            continue
        if allowed.get("activations") and (name := _activation_name(node)):
            why = _why_not(node, arguments(node)["input"])
            if why:
                skipped.append((node.name, why))
                continue
            _replace(
                gm,
                node,
                actions.approximable_activation,
                (arguments(node)["input"], name, allowed["activations"]),
            )
            done.activations += 1
        elif allowed.get("linear") and (kw := _linear_arguments(node)):
            why = _why_not(node, kw["input"]) or _untrained(kw["weight"])
            if why:
                skipped.append((node.name, why))
                continue
            weight = _transposed(gm, node, kw["weight"]) if kw.get("transposed") else kw["weight"]
            # the matmul's dtype as eager gives it (bf16 under bf16 autocast): compiled code runs with
            # autocast off, so the Function casts itself
            _replace(
                gm,
                node,
                actions.approximable_linear,
                (kw["input"], weight, kw["bias"], allowed["linear"], getattr(value_of(node), "dtype", None)),
            )
            done.linears += 1
    done.skipped = tuple(skipped)
    if done.activations or done.linears:
        gm.graph.lint()
        gm.recompile()
    return done


def _linear_arguments(node: fx.Node) -> dict | None:
    """``F.linear``'s arguments (input, weight ``[out, in]``, bias) of a linear layer: an ``F.linear``, or
    an ``addmm(bias, x, W)`` with ``W`` ``[in, out]`` and a bias of one row (Hugging Face's ``Conv1D``,
    GPT-2's layers), whose weight is then read transposed."""
    if node.target in LINEAR:
        return arguments(node)
    if node.target is not torch.addmm:
        return None
    kw = arguments(node)
    bias = value_of(kw["input"])
    if kw["beta"] != 1 or kw["alpha"] != 1 or bias is None or bias.dim() != 1:
        return None
    return {"input": kw["mat1"], "weight": kw["mat2"], "bias": kw["input"], "transposed": True}


def _transposed(gm: fx.GraphModule, node: fx.Node, weight: fx.Node) -> fx.Node:
    with gm.graph.inserting_before(node):
        t = gm.graph.call_function(torch.t, (weight,))
    t.meta = {**node.meta, "example_value": value_of(weight).t()}
    return t


def _activation_name(node: fx.Node) -> str | None:
    if node.target is F.gelu:
        return "gelu_tanh" if arguments(node).get("approximate") == "tanh" else "gelu"
    return ACTIVATION_NAMES.get(node.target)


def _why_not(node: fx.Node, x) -> str | None:
    val = value_of(x)
    if val is None or not val.is_floating_point():
        return "its input is not a floating-point tensor"
    if any(isinstance(d, torch.SymInt) for d in val.shape):
        return "dynamic shapes (the codes' and projection's sizes must be static)"
    if val.dim() < 2 and node.target in LINEAR:
        return "a 1-d input (no rows to project)"
    return None


def _untrained(weight) -> str | None:
    """Why ``weight`` is no trained weight: one the graph computes (``x @ tanh(y)``: its "weight
    gradient" is an activation's, which must stay exact), or one without a gradient."""
    if not isinstance(weight, fx.Node) or weight.op not in ("placeholder", "get_attr"):
        return "its weight is computed in the graph, not a trained parameter"
    val = value_of(weight)
    return None if val is not None and val.requires_grad else "its weight has no gradient"


def _replace(gm: fx.GraphModule, node: fx.Node, fn, args: tuple) -> None:
    with gm.graph.inserting_before(node):
        new = gm.graph.call_function(fn, args)
    new.meta = dict(node.meta)
    node.replace_all_uses_with(new)
    gm.graph.erase_node(node)


def markers(gm: fx.GraphModule) -> list[fx.Node]:
    return [n for n in gm.graph.nodes if n.op == "call_function" and n.target in actions.MARKERS]


def settle(gm: fx.GraphModule, approximated: set[str]) -> fx.GraphModule:
    """A copy of the joint graph ``gm`` with each marker replaced: the approximate formula for the
    markers named in ``approximated``, the exact one for the rest; then what no one reads is dropped,
    and the codes' and projection's ops become their torch formulas where their Triton kernels do not
    run (:func:`lower`). Node names stay as they were (plans name them).

    Why lowered before the simulation too: left whole (one extern op each), the simulated peaks ranked
    the benchmark GPT's plans otherwise, and the search's pick walked at 23.6 MiB against 21.8."""
    out = fx.GraphModule(gm, _copy(gm.graph))
    for node in markers(out):
        make = actions.approximate_backward if node.name in approximated else actions.exact_backward
        fn, args = make(node.target, tuple(node.args))
        _inline(out.graph, node, fn, args)
    out.graph.eliminate_dead_code()
    lower(out)
    out.recompile()
    return out


def lower(gm: fx.GraphModule) -> None:
    """Each op of ``actions.TORCH_FORMULAS`` whose tensors are not on a device the Triton kernels run
    on becomes its torch formula, in place, its result keeping the op's name (a plan keeps codes by it)."""
    for node in list(gm.graph.nodes):
        formula = actions.TORCH_FORMULAS.get(node.target) if node.op == "call_function" else None
        if formula is None or triton_kernels.use_triton(node.args[0].meta["val"]):
            continue
        tensors = [i for i, a in enumerate(node.args) if isinstance(a, fx.Node)]

        def fn(*values, _args=node.args, _formula=formula, _at=tensors):
            args = list(_args)
            for i, v in zip(_at, values):
                args[i] = v
            return _formula(*args)

        _inline(gm.graph, node, fn, tuple(node.args[i] for i in tensors), keep_name=True)


def _copy(graph: fx.Graph) -> fx.Graph:
    """Node by node, metadata shared (fx's own ``Graph.__deepcopy__``: no fake tensor is copied)."""
    return copy.deepcopy(graph)


def _inline(graph: fx.Graph, node: fx.Node, fn, args: tuple, *, keep_name: bool = False) -> None:
    """Replace ``node`` by ``fn(*args)`` traced into aten ops (Inductor's decompositions), in place;
    ``keep_name``: the result takes ``node``'s name."""
    fakes = [a.meta["val"] for a in args]
    with ti.detect_fake_mode(fakes) or contextlib.nullcontext():
        traced = ti.make_fx(fn, decomposition_table=ti.select_decomp_table())(*fakes)
    value_map = dict(zip(traced.graph.find_nodes(op="placeholder"), args))
    with graph.inserting_before(node):
        result = graph.graph_copy(traced.graph, value_map)
    for new in value_map.values():
        if isinstance(new, fx.Node) and new not in args:
            new.meta.setdefault("nn_module_stack", node.meta.get("nn_module_stack", {}))
            new.meta.setdefault("stack_trace", node.meta.get("stack_trace"))
    node.replace_all_uses_with(result)
    name = node.name
    graph.erase_node(node)
    if keep_name:
        ti.rename_node(result, name)
