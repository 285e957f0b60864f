"""FLOPs of a training step, counted by ``torch.utils.flop_counter``'s formulas.

Two routes to the same formulas, because a compiled step cannot be counted from outside: an eager step
runs under ``FlopCounterMode`` (:func:`count_flops`), while a compiled step's ops run inside Inductor's
generated code, so its forward and backward graphs are counted node by node in a post-grad pass
(:func:`graph_flops_pass`).  The recompute figure is a compiled backward's FLOPs minus eager's.
"""

from __future__ import annotations

import functools


@functools.cache
def _flop_mapping() -> dict:
    """Formulas for the CPU flash-attention ops, which ``FlopCounterMode`` lacks (torch 2.13)."""
    import torch
    from torch.utils.flop_counter import flop_registry

    aten = torch.ops.aten

    def raw(formula):  # registry entries already read shapes; don't let the mode wrap them again
        def f(*args, **kwargs):
            return formula(*args, **kwargs)

        f._get_raw = True
        return f

    return {
        aten._scaled_dot_product_flash_attention_for_cpu: raw(
            flop_registry[aten._scaled_dot_product_flash_attention]
        ),
        aten._scaled_dot_product_flash_attention_for_cpu_backward: raw(
            flop_registry[aten._scaled_dot_product_flash_attention_backward]
        ),
    }


def node_flops(node) -> int:
    """FLOPs of one node of an FX graph from its fake values, by ``torch.utils.flop_counter``'s formulas.

    A custom op that mutates (``auto_functionalized``: the chunks' in-place products), or an op run
    inside an RNG-state higher-order op (``run_and_save_rng_state``, ``run_with_rng_state``,
    ``graphsafe_run_with_rng_state``: a random op saved or replayed, e.g. SDPA, which takes a
    dropout_p), counts as that op."""
    import torch
    import torch.fx as fx
    import torch.utils._pytree as pytree
    from torch.utils.flop_counter import flop_registry

    from recompile_opt._torch_internals import functionalized_call

    if node.op != "call_function":
        return 0
    op, args, kwargs = node.target, node.args, dict(node.kwargs)
    wrapped = functionalized_call(node)  # a custom op that mutates, functionalised
    if wrapped is not None:
        (op, args), kwargs = wrapped, {}
    elif not isinstance(op, torch._ops.OpOverload):  # a HOP: find the op it runs
        inner = [i for i, a in enumerate(args) if isinstance(a, torch._ops.OpOverload)]
        if not inner:
            return 0
        op, args = args[inner[0]], args[inner[0] + 1 :]
        kwargs.pop("rng_state", None)
    packet = op._overloadpacket
    formula = _flop_mapping().get(packet) or flop_registry.get(packet)
    if formula is None:
        return 0
    args, kwargs = pytree.tree_map_only(fx.Node, lambda n: n.meta.get("val"), (args, kwargs))
    out = node.meta.get("val") if node.target is op else None
    return int(formula(*args, **kwargs, out_val=out))


@functools.cache
def graph_flops_pass():
    """An Inductor post-grad pass that sums the FLOPs of each forward and backward graph it sees."""
    from torch._inductor.custom_graph_pass import CustomGraphPass

    class GraphFlops(CustomGraphPass):
        def __init__(self):
            self.forward: list[int] = []
            self.backward: list[int] = []

        def __call__(self, graph) -> None:
            flops = sum(node_flops(n) for n in graph.nodes)
            backward = any(n.op == "placeholder" and n.name.startswith("tangents") for n in graph.nodes)
            (self.backward if backward else self.forward).append(flops)

        def uuid(self) -> str:  # constant: the pass changes nothing, caching stays on
            return "bench-compare-graph-flops-2"

    return GraphFlops()


def count_flops(fn, idx, tgt) -> tuple[int, int]:
    """(forward, backward) FLOPs of one eager step of ``fn``, counted separately."""
    import torch
    from torch.utils.flop_counter import FlopCounterMode

    mapping = _flop_mapping()
    torch.manual_seed(1234)
    with FlopCounterMode(display=False, custom_mapping=mapping) as fwd:
        loss = fn(idx, tgt)
    with FlopCounterMode(display=False, custom_mapping=mapping) as bwd:
        loss.backward()
    return fwd.get_total_flops(), bwd.get_total_flops()
