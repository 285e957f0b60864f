"""Read an AOTAutograd joint forward+backward graph into a plain-data :class:`Problem`.

Which nodes are forward and which backward comes from torch's own ``classify_nodes`` (the same split
the min-cut partitioner uses). Every non-backward tensor node becomes a candidate value; the backward's
node order (AOTAutograd emits it in autograd-engine order) is the schedule the peak model follows.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import math
import operator
import re
from pathlib import Path

import torch
import torch.fx as fx

from recompile_opt import _torch_internals as ti
from recompile_opt.approximate.actions import MARKERS
from recompile_opt.costs.cost_model import (
    base_of,
    collective_bytes,
    demanded_fraction,
    node_cost,
    storage_bytes,
    tensor_bytes,
)
from recompile_opt.costs.kernels import consumers, kernel_seconds, phase_kernels
from recompile_opt.ops import (
    TORCH_SCRATCH,
    is_fusible_pointwise,
    is_generated_random,
    is_pointwise,
    is_random_op,
    is_seeded_op,
    is_view_node,
    op_name,
)
from recompile_opt.planner.policies import block_of
from recompile_opt.planner.problem import Problem, Site, Value


def sizes_before_gathers(gm: fx.GraphModule) -> int:
    """Read a gathered tensor's symbolic size off what made it (the gather's input, ``t`` times its first
    dimension; through views and matmuls), and drop what only that size kept alive; the number of sizes
    rewritten.

    Why: under dynamic shapes the backward reads the size of an all-gather's output. The all-gather, and
    the LM head's matmul feeding it, are then in neither the forward nor the backward of torch's
    classification, the plan had no place for the matmul's weight, and torch's graph extraction failed
    ("Node _unsafe_masked_index_put_accumulate_1 was invalid, but is output"). Read off the inputs, the
    size needs neither the collective nor the matmul."""
    rewritten, dead = 0, []
    for node in list(gm.graph.nodes):
        if not (node.op == "call_function" and node.target is torch.ops.aten.sym_size.int):
            continue
        gather, dim = node.args
        if not _made_by_gather(gather):
            continue
        with gm.graph.inserting_before(node):
            size = _size_from_makers(gm, gather, dim, node.meta)
        node.replace_all_uses_with(size)
        gm.graph.erase_node(node)
        dead.append(gather)
        rewritten += 1
    _erase_unused(gm, dead)
    return rewritten


def _made_by_gather(node) -> bool:
    return isinstance(node, fx.Node) and node.op == "call_function" and ti.is_all_gather(node.target)


_VIEWS_WITH_SHAPE = {
    torch.ops.aten.view.default,
    torch.ops.aten.reshape.default,
    torch.ops.aten._unsafe_view.default,
}


def _size_from_makers(gm: fx.GraphModule, tensor: fx.Node, dim: int, meta: dict):
    """Dimension ``dim`` of ``tensor`` as a size expression of the nodes that made it, inserted here."""

    def call(fn, *args):
        out = gm.graph.call_function(fn, args)
        out.meta.update(meta)
        return out

    def product(factors):
        ints = [f for f in factors if isinstance(f, int)]
        out = math.prod(ints)
        for f in factors:
            if not isinstance(f, int):
                out = f if out == 1 else call(operator.mul, out, f)
        return out

    target = tensor.target if tensor.op == "call_function" else None
    if _made_by_gather(tensor):
        inner = _size_from_makers(gm, tensor.args[0], dim, meta)
        return call(operator.mul, inner, tensor.args[1]) if dim == 0 else inner
    if target in _VIEWS_WITH_SHAPE:
        shape = tensor.args[1]
        if shape[dim] != -1:
            return shape[dim]
        source = tensor.args[0]
        numel = product([_size_from_makers(gm, source, i, meta) for i in range(source.meta["val"].dim())])
        return call(operator.floordiv, numel, product([d for i, d in enumerate(shape) if i != dim]))
    if target is torch.ops.aten.mm.default:
        return _size_from_makers(gm, tensor.args[0] if dim == 0 else tensor.args[1], dim, meta)
    return call(torch.ops.aten.sym_size.int, tensor, dim)


def _erase_unused(gm: fx.GraphModule, roots: list[fx.Node]) -> None:
    """Erase ``roots`` that nothing reads any more (a gather with only its wait left, the wait unread),
    and then their inputs that nothing else reads, if they are plain computations."""
    work = list(roots)
    while work:
        node = work.pop()
        if getattr(node, "_erased", False) or node.op != "call_function":
            continue
        users = list(node.users)
        if users and not all(ti.is_wait_tensor(u.target) and not u.users for u in users):
            continue
        if not ti.is_collective_op(node.target) and node.is_impure():
            continue
        inputs = node.all_input_nodes
        for u in users:
            gm.graph.erase_node(u)
        gm.graph.erase_node(node)
        work.extend(inputs)


class JointGraph:
    """The joint graph, split into primals, forward nodes and the backward schedule."""

    def __init__(self, gm: fx.GraphModule, *, num_fwd_outputs: int, static_lifetime_input_indices=None):
        self.gm = gm
        self.num_fwd_outputs = num_fwd_outputs
        self.static_indices = list(static_lifetime_input_indices or [])
        self.info = info = ti.classify_nodes(gm, self.static_indices, num_fwd_outputs)
        self.required_fw = set(info.required_fw_nodes)
        self.bwd_nodes = [n for n in gm.graph.nodes if n in info.required_bw_nodes and n.op != "output"]
        self.bwd_set = set(self.bwd_nodes)
        self.primals = [n for n in gm.graph.nodes if n.op == "placeholder" and ti._is_primal(n)]
        self.static_primals = {p for i, p in enumerate(self.primals) if i in self.static_indices}
        self.fwd_nodes = [
            n
            for n in gm.graph.nodes
            if n.op in ("placeholder", "call_function", "get_attr")
            and n not in self.bwd_set
            and not ti._is_tangent(n)
        ]
        self.name_to_node = {n.name: n for n in gm.graph.nodes}

    def device(self) -> torch.device:
        for n in self.fwd_nodes:
            val = n.meta.get("val")
            if isinstance(val, torch.Tensor) and n.op != "placeholder":
                return val.device
        return torch.device("cpu")


def _is_value(node: fx.Node) -> bool:
    if ti.is_sym_node(node):
        return False
    val = node.meta.get("val")
    return isinstance(val, (torch.Tensor, tuple, list)) or node.op == "get_attr"


_TORCH_DIR = str(Path(torch.__file__).resolve().parent)


def _source(node: fx.Node) -> str:
    """``file:line`` of the innermost frame of the node's stack trace, and, where that line only called
    a torch library module, the torch function the op came from: ``model.py:7 (layer_norm)``.

    Why the function: Dynamo leaves the frames of ``torch/nn/modules`` out of stack traces and puts
    functions such as ``F.dropout`` or ``F.multi_head_attention_forward`` into its graph whole, so every
    op of ``nn.TransformerEncoderLayer`` had the user's one line. The function is the finest place the
    graph still records (the Dynamo node each op was traced from)."""
    frames = re.findall(r'File "([^"]+)", line (\d+)', node.meta.get("stack_trace") or "")
    if not frames:
        return ""
    path, line = frames[-1]
    where = f"{path.rsplit('/', 1)[-1]}:{line}"
    if str(Path(path).resolve()).startswith(_TORCH_DIR) or not _in_torch_module(node):
        return where  # a user module's own line, or already a line of torch's code
    function = _traced_from(node)
    return f"{where} ({function})" if function else where


def _in_torch_module(node: fx.Node) -> bool:
    """The innermost module of the node is one of torch's (``nn.Linear``, ``nn.MultiheadAttention``)."""
    stack = node.meta.get("nn_module_stack") or node.meta.get("fwd_nn_module_stack") or {}
    if not stack:
        return False
    cls = list(stack.values())[-1][1]
    name = f"{cls.__module__}.{cls.__qualname__}" if isinstance(cls, type) else str(cls)
    return re.match(r"(<class ')?torch\.", name) is not None


def _traced_from(node: fx.Node) -> str:
    """The name of the function or method behind the Dynamo graph node ``node`` was traced from:
    ``from_node``'s root target (``<function dropout at 0x..>``, ``<built-in function linear>``,
    ``transpose``), else the name ``source_fn_stack`` records (``dropout_1`` -> ``dropout``)."""
    sources = node.meta.get("from_node") or []
    while sources and getattr(sources[0], "from_node", None):
        sources = sources[0].from_node
    target = str(getattr(sources[0], "target", "")) if sources else ""
    m = re.fullmatch(r"<(?:function|built-in function|built-in method|method) '?([\w.]+)'?.*>", target, re.S)
    if m:
        return m.group(1)
    if re.fullmatch(r"[A-Za-z_]\w*", target):
        return target
    fn_stack = node.meta.get("source_fn_stack") or node.meta.get("fwd_source_fn_stack") or []
    return re.sub(r"_\d+$", "", str(fn_stack[-1][0])) if fn_stack else ""


def module_path(node: fx.Node) -> str:
    stack = node.meta.get("nn_module_stack") or node.meta.get("fwd_nn_module_stack") or {}
    if not stack:
        return ""
    path = list(stack.values())[-1][0]
    return clean_module_path(path)


def clean_module_path(path: str) -> str:
    """``L['self'].blocks[0].attn`` or ``L__self___blocks_0`` -> ``blocks.0.attn``; a model called with
    keywords is ``L['args'][0]`` (Dynamo traces ``Module._call_impl(*args, **kwargs)``, its ``self`` the
    first of ``args``), else every path would start with ``0.``."""
    path = re.sub(r"^L\['args'\]\[0\]\.?", "", path)
    path = re.sub(r"^L\['[^']+'\]\.?", "", path)
    path = re.sub(r"\[(\d+)\]", r".\1", path)
    path = re.sub(r"\['([^']+)'\]", r".\1", path)
    return path.strip(".")


def _info(node: fx.Node) -> dict:
    val = node.meta.get("val")
    info = {"op": op_name(node, qualified=True), "module": module_path(node), "source": _source(node)}
    if op_name(node) in TORCH_SCRATCH:
        info["scratch"] = True  # the least-peak check keeps a margin on such graphs (planner/least_peak.py)
    if isinstance(val, torch.Tensor):
        info["shape"] = [int(s) if not isinstance(s, torch.SymInt) else str(s) for s in val.shape]
        info["dtype"] = str(val.dtype).replace("torch.", "")
        info["nbytes"] = tensor_bytes(val)
    return info


def _user_tag(node: fx.Node) -> str | None:
    tag = node.meta.get("recompute")
    if isinstance(tag, ti.CheckpointPolicy):
        return tag.name.lower()
    return None


def build_problem(
    jg: JointGraph, roofline: dict, *, replay_random: bool = True, random_fuses: bool = False
) -> Problem:
    """One :class:`Value` per forward tensor node; bytes per storage; costs from the roofline.

    ``replay_random=False`` makes random ops keep-only (where RNG-state replay cannot be compiled).
    ``random_fuses``: the graph is compiled by Inductor with its own RNG, which draws ``rand`` element
    by element inside the kernel that reads it (eager's replay draws the whole tensor).
    """
    pos = {n: i for i, n in enumerate(jg.bwd_nodes)}
    values: dict[str, Value] = {}
    storage_bytes_: dict[str, int] = {}
    first_use: dict[str, int] = {}  # backward step of a value's first direct use

    def fuses(n):
        return is_fusible_pointwise(n) or (random_fuses and is_generated_random(n))

    memo: dict = {}
    demand = lambda n: demanded_fraction(n, fuses, memo)  # noqa: E731 - one graph's memo
    for node in jg.fwd_nodes:
        if not _is_value(node):
            continue
        value = values[node.name] = _make_value(jg, node, pos, storage_bytes_, roofline, demand)
        first_use[node.name] = min((pos[u] for u in node.users if u in pos), default=len(jg.bwd_nodes))
        if value.random and not replay_random:
            value.can_recompute = False
    _inherit_modules(jg, values)
    clock = _Clock.of(jg, roofline)
    _offload_windows(jg, values, storage_bytes_, clock)
    _propagate_last_use(jg, values, first_use)
    save_s = {s: 2 * b / roofline["bytes_per_s"] for s, b in storage_bytes_.items()}
    device = jg.device()
    sites, approximation_s = approximation_sites(jg, values, roofline)
    return Problem(
        values=values,
        storage_bytes=storage_bytes_,
        save_s=save_s,
        rng_state_bytes=ti.rng_state_bytes(device),
        bwd_steps=len(jg.bwd_nodes),
        bwd_byte_steps=sum(_bwd_live_bytes(jg)),
        step_s=clock.step_s - approximation_s,
        device=device.type,
        collectives=_collectives(jg),
        sites=sites,
        offload_ops=ti.offload_ops_available(),
        offload_checked=device.type != "cuda",
        forward_done_s={n.name: t for n, t in clock.done_at.items()},
        backward_start_s={n.name: t for n, t in clock.starts.items()},
    )


def _is_marker(node: fx.Node) -> bool:
    return node.op == "call_function" and node.target in MARKERS


def approximation_sites(jg: JointGraph, values: dict[str, Value], roofline: dict) -> tuple[list[Site], float]:
    """One :class:`Site` per marker of ``passes/approximate.py`` whose inputs are forward values, and the
    forward time all their approximations take (the step estimate leaves it out: a site kept exact
    computes none of it once settled)."""
    sites, total = [], 0.0
    for node in jg.bwd_nodes:
        if not _is_marker(node):
            continue
        grad, x, approx, *rest = node.args
        few_bit = node.target == MARKERS[0]
        reads = [x, approx] + ([] if few_bit else [rest[0]])  # a linear's seed too
        if any(not isinstance(n, fx.Node) or n.name not in values for n in reads):
            continue  # left exact when settled
        forward_s = _fused_seconds(_made_only_for(jg, reads[1:]), reads[1:], roofline)
        total += forward_s
        if few_bit:
            detail, cost = {"activation": rest[0], "bits": rest[1]}, forward_s
        else:
            detail, cost = {"ratio": rest[1]}, _randomized_cost(x, approx, grad, forward_s, roofline)
        if not few_bit:
            # the projection's seed is kept, never drawn again: through Inductor's own RNG a random op
            # recomputed in the backward draws anew (its graph gets a seed of its own), and the
            # backward's S would not be the forward's (gradients of cosine 0.02, seen)
            values[rest[0].name].can_recompute = False
        sites.append(
            Site(
                choice=f"approximate:{node.name}",
                marker=node.name,
                kind="few-bit" if few_bit else "randomized",
                exact=(x.name,),
                approx=tuple(n.name for n in reads[1:]),
                replaced=x.name,
                detail=detail,
                cost_s=cost,
            )
        )
    return sites, total


def _made_only_for(jg: JointGraph, roots: list[fx.Node]) -> set[fx.Node]:
    """The forward nodes that exist only to make ``roots`` (a site's codes, or its projection and
    seed): those whose every user is one of them or a marker."""
    ancestors, todo = set(), list(roots)
    while todo:
        node = todo.pop()
        if node not in ancestors and node not in jg.bwd_set:
            ancestors.add(node)
            todo.extend(node.all_input_nodes)
    own = set(roots)
    for node in reversed(jg.fwd_nodes):
        if (
            node in ancestors
            and node not in own
            and node.op == "call_function"
            and all(u in own or _is_marker(u) for u in node.users)
        ):
            own.add(node)
    return own


def _fused_seconds(own: set[fx.Node], roots: list[fx.Node], roofline: dict) -> float:
    """Time of the nodes ``own`` as Inductor runs them: matmuls on their own, the elementwise rest fused
    into kernels that read what comes from outside once and write ``roots`` once. Why: priced node by
    node, a 3-bit code's thirty comparisons, shifts and sums each wrote a tensor as large as the
    activation (8.5 ms for a GPT MLP's, where its one kernel reads 4 MiB and writes 0.4 MiB)."""
    pointwise = {n for n in own if is_fusible_pointwise(n) or is_view_node(n)}
    seconds = sum(node_cost(n, roofline).seconds for n in own - pointwise)
    flops = sum(node_cost(n, roofline, fused=True).flops for n in pointwise)
    outside = {a for n in pointwise for a in n.all_input_nodes if a not in pointwise}
    traffic = sum(
        tensor_bytes(a.meta["val"])
        for a in outside | set(roots)
        if isinstance(a.meta.get("val"), torch.Tensor)
    )
    return seconds + max(flops / roofline["flops_per_s"], traffic / roofline["bytes_per_s"])


def _randomized_cost(
    x: fx.Node, projected: fx.Node, grad: fx.Node, forward_s: float, roofline: dict
) -> float:
    """A randomized linear's added time: the forward's projection of its input, the backward's of the
    output gradient (as many rows, the output's width), less the weight gradient's shorter matmul."""
    rows, width = x.meta["val"].numel() // x.meta["val"].shape[-1], x.meta["val"].shape[-1]
    out = grad.meta["val"].shape[-1]
    kept_rows = projected.meta["val"].shape[0]
    shorter = 2 * (rows - kept_rows) * width * out / roofline["flops_per_s"]
    return max(0.0, forward_s * (1 + out / width) - shorter)


def _collectives(jg: JointGraph) -> list[dict]:
    """Each collective the step runs (waits left out), with the bytes one rank sends."""
    phases = [(n, "forward") for n in jg.fwd_nodes if n in jg.required_fw] + [
        (n, "backward") for n in jg.bwd_nodes
    ]
    return [
        {
            **_info(n),
            "name": n.name,
            "phase": phase,
            "bytes": collective_bytes(n),
            "group": n.args[-1] if n.args and isinstance(n.args[-1], str) else None,
        }
        for n, phase in phases
        if ti.collective_name(n.target) not in ("", "wait_tensor")
    ]


@dataclasses.dataclass
class _Clock:
    """The step's estimated clock: every node once (the forward's, the backward's, and those only the
    backward reads that need no gradient: an upcast weight, the chunked loss's recomputed head), in
    Inductor's kernels (:func:`~recompile_opt.costs.kernels.phase_kernels`), each priced by
    :func:`~recompile_opt.costs.kernels.kernel_seconds`. ``done_at``: a forward node's time once its
    kernel has run; ``starts``: a backward node's time, from the backward's start, when its kernel
    begins (a node of no kernel, a view: the time reached before it in graph order). Why kernels: priced
    op by op, the H200 GPT's step was estimated at 4.9x its measured 39.8 ms, most of it pointwise ops'
    traffic that Inductor fuses, and offload windows priced so hid copies the GPU would expose."""

    step_s: float
    forward_s: float
    done_at: dict[fx.Node, float]
    starts: dict[fx.Node, float]

    @classmethod
    def of(cls, jg: JointGraph, roofline: dict) -> _Clock:
        kernels = phase_kernels([jg.fwd_nodes, jg.bwd_nodes], list(jg.gm.graph.nodes))
        start, end, elapsed, forward_s = {}, {}, 0.0, 0.0
        for k in kernels:  # run order, the forward's all first
            seconds = kernel_seconds(k, roofline)
            for n in k.nodes:
                start[n], end[n] = elapsed, elapsed + seconds
            elapsed += seconds
            if k.nodes[0] not in jg.bwd_set:
                forward_s = elapsed
        done_at, reached = {}, 0.0
        for n in jg.fwd_nodes:
            reached = done_at[n] = max(reached, end.get(n, reached))
        starts, reached = {}, forward_s
        for n in jg.bwd_nodes:
            starts[n] = start.get(n, reached) - forward_s
            reached = max(reached, end.get(n, reached))
        return cls(elapsed, forward_s, done_at, starts)


def _make_value(
    jg: JointGraph, node: fx.Node, pos: dict, storage_bytes_: dict, roofline: dict, demand
) -> Value:
    val = node.meta.get("val")
    is_tensor = isinstance(val, torch.Tensor)
    base = base_of(node)
    storage = base.name if is_tensor else ""
    if is_tensor and storage not in storage_bytes_:
        free = base.op == "get_attr" or base in jg.static_primals
        storage_bytes_[storage] = 0 if free else storage_bytes(base.meta["val"])
    bwd_uses = [pos[u] for u in node.users if u in pos]
    cost = node_cost(node, roofline, fused=_fuses_when_recomputed(jg, node))
    share = demand(node)  # of its elements a recompute makes (a fused chain a gather reads)
    is_primal = node.op == "placeholder"
    target = node.target
    # a wait is "impure" to FX (DCE must not drop it); whether it may run again is
    # _unrepeatable_collective's call
    impure = node.op == "call_function" and (
        node.is_impure() and not is_seeded_op(target) and not ti.is_wait_tensor(target)
    )
    return Value(
        name=node.name,
        storage=storage,
        inputs=tuple(a.name for a in node.all_input_nodes if _is_value(a) and a not in jg.bwd_set),
        needed=any(u in pos and not _is_marker(u) for u in node.users),  # a marker: see Site
        can_save=is_tensor and not _unwaited(node),
        can_recompute=not (is_primal or node.op == "get_attr" or impure or _unrepeatable_collective(node)),
        recompute_with=tuple(
            a.name for a in _low_precision_inputs(node) if _is_value(a) and a not in jg.bwd_set
        ),
        in_forward=_made_by_forward(jg, node),
        random=node.op == "call_function" and is_random_op(node),
        recompute_s=cost.seconds * share,
        flops=int(cost.flops * share),
        last_use=max(bwd_uses, default=-1),
        tag=_user_tag(node),
        info=_info(node),
    )


def _unwaited(node: fx.Node) -> bool:
    """A collective's own output, before its ``wait_tensor``: a handle still in flight, never kept (the
    wait's output, the same buffer, is what a plan keeps)."""
    return ti.is_collective_op(node.target) and not ti.is_wait_tensor(node.target)


def _unrepeatable_collective(node: fx.Node) -> bool:
    """A collective the backward may not run again: every one but an all-gather (with its wait), which
    re-gathers the kept shards at a communication cost (what Megatron's sequence parallelism does for
    the weight gradients). A reduction re-run from its inputs would be exact too, but needs their
    full-size partial sums (kept or recomputed): not offered yet, so ``full`` keeps each
    reduce-scatter's output (docs/paper.md)."""
    if not ti.is_collective_op(node.target):
        return False
    if ti.is_wait_tensor(node.target):
        return not ti.is_all_gather(node.args[0].target)
    return not ti.is_all_gather(node.target)


def _made_by_forward(jg: JointGraph, node: fx.Node) -> bool:
    """Whether the forward makes this value anyway: a node the forward's outputs need, a primal, or an
    element of a tuple the forward makes (SDPA's logsumexp, dropout's mask: read only by the backward,
    so not "required" by the forward, yet free to keep). Why: as backward-only values they were
    recomputed by every fixed policy, so ``save-all`` re-ran each layer's SDPA in the backward and
    replayed every dropout instead of keeping its mask."""
    if node in jg.required_fw or node.op == "placeholder":
        return True
    return node.target is operator.getitem and node.args[0] in jg.required_fw


_LOW_PRECISION = (torch.bfloat16, torch.float16)


def _low_precision_inputs(node: fx.Node) -> list[fx.Node]:
    """Mixed-precision arithmetic: where ``node`` reads a computed bf16/fp16 float and a wider float and
    makes the wider one (under autocast: the fp32 residual add of a bf16 projection; an upcast, or a
    bf16 parameter times an fp32 value, is not one), the computed narrow inputs and the views between
    each and its buffer; else none. ``node`` is recomputed only with them (``Value.recompute_with``).

    Why: Inductor can fuse the producer's rounding away in the forward (its bias add done in fp32,
    unrounded into the fp32 sum), while a recompute that read the kept narrow value would read it
    rounded: the backward would see a different value than the forward made (a tiny GPT under bf16
    autocast through Inductor failed tests/test_mixed_precision.py's bf16 tolerance; the eager
    compiler path was exact). Recomputed together, the backward runs the forward's own fusion. It was
    kept, never recomputed, until the performance GPT's least-peak plan kept both fp32 residual sums
    of every block for it (16 x 64 MiB at 8 layers, its whole floor)."""
    out = node.meta.get("val")
    if not isinstance(out, torch.Tensor) or not out.is_floating_point() or out.dtype in _LOW_PRECISION:
        return []
    tensors = [a for a in node.all_input_nodes if isinstance(a.meta.get("val"), torch.Tensor)]
    if not any(a.meta["val"].dtype == out.dtype for a in tensors):
        return []
    chain = []
    for a in tensors:
        if a.meta["val"].dtype in _LOW_PRECISION and base_of(a).op == "call_function":
            while True:  # the input, the views it is made by, and their buffer
                chain.append(a)
                if not is_view_node(a):
                    break
                a = a.all_input_nodes[0]
    return list(dict.fromkeys(chain))


def _fuses_when_recomputed(jg: JointGraph, node: fx.Node) -> bool:
    """A pointwise op whose backward readers are all fusible too: recomputed, it lives inside their
    kernel. One that a backward matmul reads (a GELU output for the weight gradient) is written out."""
    if not is_fusible_pointwise(node):
        return False
    readers = [u for u in consumers(node) if u in jg.bwd_set]
    return all(is_fusible_pointwise(u) for u in readers)


def _package_dir(name: str) -> str:
    """The directory package ``name`` is imported from, as its modules' stack traces name it, found
    without importing it (``recompile_opt.parallel`` imports torch.distributed). Why not a path
    relative to this file: this module is ``passes/`` in the source tree but ``recompile_opt/passes/``
    in an installed wheel."""
    return importlib.util.find_spec(name).submodule_search_locations[0]


_PARALLEL_DIR = _package_dir("recompile_opt.parallel")
_DROPOUT_HELPERS = str(Path(_PARALLEL_DIR) / "dropout.py")


def _inherit_modules(jg: JointGraph, values: dict[str, Value]) -> None:
    """Ops that tensor/sequence parallelism's helpers add (a dropout's sliced mask, a gather's cat, a
    shard's copy) have no module of their own (Dynamo traced them inside our functions): they take the
    module of the value they work on, so blocks and plans see them where the user's op was."""
    helpers = [
        n
        for n, v in values.items()
        if not v.info.get("module") and _PARALLEL_DIR in (jg.name_to_node[n].meta.get("stack_trace") or "")
    ]
    for name in helpers:  # from what they read (a gather's cat: the gathered norm's module)
        values[name].info["module"] = next(
            (values[i].info["module"] for i in values[name].inputs if values[i].info.get("module")), ""
        )
    for name in reversed(helpers):  # else a dropout's mask from what reads it (a shard split off the
        # model's input stays outside every module: it is the first block's input, kept by ``full``)
        if not values[name].info["module"] and _DROPOUT_HELPERS in jg.name_to_node[name].meta["stack_trace"]:
            values[name].info["module"] = next(
                (
                    values[u.name].info["module"]
                    for u in jg.name_to_node[name].users
                    if u.name in values and values[u.name].info.get("module")
                ),
                "",
            )


def _offload_windows(jg: JointGraph, values: dict[str, Value], storage_bytes_: dict, clock: _Clock) -> None:
    """Each offloadable value's windows (``Value.offload_windows``): the forward's compute after its last
    forward use, and the backward's before its first use, each through its views, as torch's offloading
    places the copies, on the step's kernel clock (:class:`_Clock`). Offloadable: what that pass accepts
    (``activation_offloading.can_offload``: a contiguous buffer of its own, no getitem, not returned to
    the caller, not a graph input)."""
    done_at, before, total_fwd = clock.done_at, clock.starts, clock.forward_s
    output = next(n for n in reversed(jg.gm.graph.nodes) if n.op == "output")
    returned = {a for a in output.args[0][: jg.num_fwd_outputs] if isinstance(a, fx.Node)}
    for name, v in values.items():
        node = jg.name_to_node[name]
        val = node.meta.get("val")
        if not (
            node.op == "call_function"
            and node.target is not operator.getitem
            and isinstance(val, torch.Tensor)
            and all(isinstance(d, int) for d in val.shape)  # (is_contiguous on symbols would guard)
            and v.storage == name
            and v.in_forward
            and storage_bytes_.get(name, 0) > 0
            and node not in returned
            and val.is_contiguous()
        ):
            continue
        users, todo = set(), list(node.users)
        while todo:  # through views, as torch's pass finds a value's last use
            u = todo.pop()
            if u.op != "output" and u not in users:
                users.add(u)
                todo.extend(u.users if is_view_node(u) else ())
        fwd = [done_at[u] for u in users if u in done_at] + [done_at.get(node, 0.0)]
        bwd = [before[u] for u in users if u in before]
        if bwd:
            v.offload_windows = (total_fwd - max(fwd), min(bwd))


def _propagate_last_use(jg: JointGraph, values: dict[str, Value], first_use: dict[str, int]) -> None:
    """A value could be needed as soon as anything recomputed from it is: its first use flows backwards
    through forward users, within a transformer block (good plans keep block boundaries, so a block's
    values are recomputed in that block's backward, not when the next block's backward starts), and a
    value is alive at least until then (``last_use``)."""
    for name in reversed(list(values)):
        v = values[name]
        block = block_of(v.info.get("module", ""))
        for u in jg.name_to_node[name].users:
            if u.name in values and (
                block is None or block_of(values[u.name].info.get("module", "")) == block
            ):
                first_use[name] = min(first_use[name], first_use[u.name])
        v.last_use = max(v.last_use, first_use[name])


def _bwd_live_bytes(jg: JointGraph) -> list[int]:
    """Live bytes of tensors the backward itself creates, at each backward step, counted node by node
    (plan-independent). Only the ILP's kept-bytes tie-break uses it, as a byte scale (ilp.set_objective):
    peaks are priced by recompile_opt.costs.peak alone. Why it stays: the tie-break's scale picks among
    plans within the 1% MIP gap; scaled by kept bytes alone, 5 of the 16 stored plans of
    bench/measured_peaks.json moved (bench/plan_digest.py), peak_memory="27MiB" to a plan predicted
    at 28.1 MiB instead of 26.8."""
    last_use: dict[fx.Node, int] = {}
    for i, n in enumerate(jg.bwd_nodes):
        for a in n.all_input_nodes:
            last_use[base_of(a)] = i
    outputs = {base_of(a) for a in jg.gm.graph.find_nodes(op="output")[0].all_input_nodes}
    live, out, frees = 0, [], {}
    for n, i in last_use.items():
        if n in jg.bwd_set and n not in outputs:
            frees.setdefault(i, []).append(n)
    for i, n in enumerate(jg.bwd_nodes):
        live += _own_bytes(n)
        out.append(live)
        for dead in frees.get(i, ()):
            live -= _own_bytes(dead)
    return out


def _own_bytes(node: fx.Node) -> int:
    """Bytes a node allocates: its tensor unless it is a view (tuples count through their getitems)
    or a pointwise op whose one consumer is pointwise too (fused)."""
    val = node.meta.get("val")
    if isinstance(val, torch.Tensor) and not is_view_node(node) and _materialised(node):
        return tensor_bytes(val)
    return 0


def _materialised(node: fx.Node) -> bool:
    if not is_pointwise(node):
        return True
    users = _consumers_through_getitem(node)
    return len(users) > 1 or any(not is_pointwise(u) for u in users if u.op != "output")


def _consumers_through_getitem(node: fx.Node) -> list[fx.Node]:
    out = []
    for u in node.users:
        if is_view_node(u) or u.target is operator.getitem:
            out.extend(_consumers_through_getitem(u))
        else:
            out.append(u)
    return out
