"""Bytes and recompute cost of one FX node, from its fake-tensor metadata.

* Bytes are counted per *storage*: a view keeps its whole base alive, so views cost nothing of their own
  and the base is charged once (q, k, v split from one QKV buffer cost that buffer once).
* Recompute cost is a roofline estimate: ``max(flops / flops_per_s, traffic / bytes_per_s)``. FLOPs come
  from ``torch.utils.flop_counter``'s formulas (mm, bmm, addmm, conv, SDPA, ...); memory traffic is the
  bytes an op reads plus writes. The constants are fixed per device type so that plans are
  deterministic; the ``roofline`` option overrides them.
* A pointwise op that Inductor fuses costs one pass over its output, not its reads and writes: recomputed
  in the backward it fuses into the kernel that consumes it, which reads that op's inputs anyway, and its
  own output never goes to memory. Charging it the full traffic of an unfused op made a recomputed
  SwiGLU cost 4x what Inductor pays, and the no-budget plan kept 46 MiB of a 2-layer Llama where
  torch.compile's min-cut keeps 36.6 MiB at the same measured step time.
* A gather (``index``) reads one source element per element it writes; and a fused chain that only a
  gather or slice reads is computed only where it is read (:func:`demanded_fraction`): Inductor, with its
  own RNG, draws a rank's heads of one process's dropout mask, ``rand(full) > p`` then ``index``, inside
  the gathering kernel, at the slice's cost.
* Saving a tensor is not free either: it is written in the forward and read in the backward, so the
  planner charges ``2 * bytes / bytes_per_s`` per kept storage (this is why recomputing a cheap
  pointwise op can beat saving its output, as Inductor's own min-cut partitioner also finds).
* An op that loops inside (our chunked LM-head loss) reads some inputs once per iteration: it registers
  its traffic (:func:`register_traffic_formula`), as torch's flop counter lets an op register its FLOPs.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass

import torch
import torch.fx as fx
import torch.utils._pytree as pytree

from recompile_opt._torch_internals import (
    collective_name,
    concrete_size,
    flop_registry,
    functionalized_call,
    group_size,
)
from recompile_opt.ops import is_fusible_pointwise, is_view_node


@dataclass(frozen=True)
class NodeCost:
    flops: int
    traffic_bytes: int
    seconds: float


def _hint(x) -> int:
    """A concrete number for a possibly symbolic size, so costs stay numbers: its upper bound when
    Dynamo was given one (then a byte budget holds at every allowed size), else its hint."""
    return concrete_size(x)


def elements(t: torch.Tensor) -> int:
    """The tensor's number of elements, symbolic sizes replaced by hints."""
    numel = 1
    for s in t.shape:
        numel *= _hint(s)
    return numel


def tensor_bytes(t: torch.Tensor) -> int:
    """Bytes of the tensor's own elements (numel * itemsize), symbolic sizes replaced by hints."""
    return elements(t) * t.element_size()


def storage_bytes(t: torch.Tensor) -> int:
    """Bytes of the storage a tensor lives in (its base's elements), with hints for symbolic sizes."""
    try:
        nbytes = t.untyped_storage().nbytes()
        return _hint(nbytes)
    except (NotImplementedError, RuntimeError):
        return tensor_bytes(t)


def base_of(node: fx.Node) -> fx.Node:
    """The node that owns the buffer ``node`` views (itself unless it is a view)."""
    while is_view_node(node):
        node = node.all_input_nodes[0]
    return node


def _tensors(vals) -> list[torch.Tensor]:
    return [t for t in pytree.tree_leaves(vals) if isinstance(t, torch.Tensor)]


# op overload packet -> f(node) -> the bytes one call reads and writes, for ops whose traffic is not
# their inputs' and outputs' bytes once each
_TRAFFIC_FORMULAS: dict = {}


def register_traffic_formula(op):
    """Decorator: ``f(node) -> bytes`` is the memory traffic of one call of ``op`` (an OpOverloadPacket)."""

    def register(formula):
        _TRAFFIC_FORMULAS[op] = formula
        return formula

    return register


def node_cost(node: fx.Node, roofline: dict, *, fused: bool = False) -> NodeCost:
    """FLOPs, memory traffic and roofline time of computing ``node`` once; ``fused``: a pointwise op
    inside a fused kernel (one pass over its output, see the module docstring)."""
    if node.op != "call_function" or is_view_node(node) or node.target is operator.getitem:
        return NodeCost(0, 0, 0.0)
    out = node.meta.get("val")
    if collective_name(node.target):
        sent = collective_bytes(node)
        return NodeCost(0, sent, roofline["collective_latency_s"] + sent / roofline["link_bytes_per_s"])
    flops = _flops(node, out)
    in_vals = [a.meta.get("val") for a in node.all_input_nodes]
    own = _TRAFFIC_FORMULAS.get(getattr(node.target, "_overloadpacket", None))
    traffic = (
        own(node)
        if own
        else sum(tensor_bytes(t) for t in _tensors(out) + ([] if fused else _tensors(in_vals)))
    )
    seconds = max(flops / roofline["flops_per_s"], traffic / roofline["bytes_per_s"])
    return NodeCost(int(flops), int(traffic), seconds)


@register_traffic_formula(torch.ops.aten.index)
def _gather_traffic(node: fx.Node) -> int:
    """A gather reads one element of its source per element it writes (and its indices), not the
    whole source."""
    out, source = node.meta.get("val"), node.args[0].meta.get("val")
    indices = _tensors([a.meta.get("val") for a in node.all_input_nodes[1:]])
    read = elements(out) * source.element_size() if isinstance(source, torch.Tensor) else 0
    return tensor_bytes(out) + read + sum(tensor_bytes(t) for t in indices)


def collective_bytes(node: fx.Node) -> int:
    """Bytes one rank sends in a ring collective: all-gather (t-1)/t of its output, reduce-scatter
    (t-1)/t of its input, all-reduce 2(t-1)/t of its tensor (a reduce-scatter then an all-gather)."""
    kind = collective_name(node.target)
    if kind in ("", "wait_tensor"):
        return 0
    size = _group_size(node)
    if kind.startswith("all_gather"):
        n, factor = tensor_bytes(node.meta["val"]), 1
    elif kind.startswith("reduce_scatter"):
        n, factor = tensor_bytes(node.args[0].meta["val"]), 1
    else:
        n, factor = sum(tensor_bytes(t) for t in _tensors(node.meta.get("val"))), 2
    return factor * n * (size - 1) // max(size, 1)


def _group_size(node: fx.Node) -> int:
    """The group size an all-gather / reduce-scatter carries as an argument; an all-reduce's from its
    group."""
    for a in list(node.args[1:]) + list(node.kwargs.values()):
        if isinstance(a, int) and not isinstance(a, bool):
            return a
    return group_size(node.args[-1] if node.args else None)


_aten = torch.ops.aten
# Ops without a formula of their own that share another's argument layout (torch 2.13).
_SAME_FLOPS_AS = {
    _aten._scaled_dot_product_flash_attention_for_cpu: _aten._scaled_dot_product_flash_attention,
    _aten._scaled_dot_product_flash_attention_for_cpu_backward: (
        _aten._scaled_dot_product_flash_attention_backward
    ),
}


_SLICING_VIEWS = {"slice", "select", "narrow"}


def demanded_fraction(node: fx.Node, fuses, memo: dict) -> float:
    """The share of ``node``'s elements its readers read, when it is fused into them (``fuses(n)``:
    whether ``n`` is computed inside its reader's kernel). Why: a fused producer is computed only where
    its reader loads it, so a chain that a gather or slice reads (a rank's heads of one process's
    dropout mask, ``rand(full) > p`` then ``index``) costs the slice, not the whole (Inductor computes
    only the slice); charged whole, the ILP kept a 32 MiB mask slice of the 22B layer at t = 8 rather
    than recompute a draw it priced 8x too high. 1.0 when any reader needs the whole."""
    if node not in memo:
        memo[node] = _share_of_readers(node, fuses, memo) if fuses(node) else 1.0
    return memo[node]


def _share_of_readers(node: fx.Node, fuses, memo: dict) -> float:
    return min(1.0, max((_share_read(node, u, fuses, memo) for u in node.users), default=1.0))


def _share_read(node: fx.Node, user: fx.Node, fuses, memo: dict) -> float:
    numel, user_numel = _numel(node), _numel(user)
    if not numel or user_numel is None:
        return 1.0
    name = getattr(getattr(user.target, "_overloadpacket", None), "__name__", "")
    if name == "index" and user.args and user.args[0] is node:  # a gather: one element read per output
        return user_numel / numel
    if name in _SLICING_VIEWS and user.args and user.args[0] is node:
        return (user_numel / numel) * _share_of_readers(user, fuses, memo)  # a view: no kernel of its own
    if is_fusible_pointwise(user) and user_numel == numel:
        return demanded_fraction(user, fuses, memo)
    return 1.0


def _numel(node: fx.Node) -> int | None:
    val = node.meta.get("val")
    return elements(val) if isinstance(val, torch.Tensor) else None


def _flops(node: fx.Node, out) -> int:
    target, args, kwargs = node.target, node.args, node.kwargs
    wrapped = functionalized_call(node)  # a custom op that mutates: its own formula
    if wrapped is not None:
        (target, args), kwargs, out = wrapped, {}, None
    packet = getattr(target, "_overloadpacket", None)
    formula = flop_registry.get(_SAME_FLOPS_AS.get(packet, packet))
    if formula is None:
        return 0
    args, kwargs = pytree.tree_map_only(fx.Node, lambda n: n.meta.get("val"), (args, kwargs))
    try:
        return _hint(formula(*args, **kwargs, out_val=out))
    except Exception:  # a formula that cannot read these args: count it as memory-bound
        return 0
