"""Each rank's forward, written from the exported graph and a found layout (issue 22, step 5 of
docs/parallel-design.md: tensor parallel; sequence parallel is step 6).

Why a rewrite of the captured graph rather than running the module's code on shards: the code's
literal sizes are global (``view(b, s, self.n_head, h // self.n_head)``, ``split(h)``), so on a rank's
shard it fails, or silently splits wrong. In the graph each such size is a constant the rewrite
divides by the rank count where the layout says the value is sharded on that dimension. The rest
is Megatron's: ``f`` before each column-parallel linear (one per input), the partial sums of each
row-parallel linear added up by ``g`` before its bias, and a vocabulary-parallel embedding looking up
only its own rows (the others masked to zero) before ``g``. Every rank's graph differs only in
constants (its rows' offset), so the planner sees the same graph on every rank.
"""

from __future__ import annotations

import operator
import types

import torch
import torch.fx as fx
import torch.utils._pytree as pytree
from torch.distributed.tensor import DTensor

from recompile_opt.ops import PER_TOKEN, PYTHON_SPELLINGS, op_name
from recompile_opt.parallel import collectives as C
from recompile_opt.parallel import dropout as D
from recompile_opt.parallel import pieces as P
from recompile_opt.parallel.layout import Layout, from_input
from recompile_opt.parallel.signatures import Derive, RankGraph, signature

aten = torch.ops.aten
# ops whose literal size arguments name the sharded dimension's global size
_SIZED = {"view", "reshape", "_unsafe_view", "expand"}


def local_forward(
    layout: Layout, group_name: str, rank: int, device: torch.device | str = "cpu"
) -> fx.GraphModule:
    """Rank ``rank``'s graph: the exported graph with local sizes and the transitions inserted. A graph
    captured on the meta device makes its tensors (``arange`` positions) on ``device`` instead.

    With sequence parallelism (:class:`_SequencePlan`) the values between the pairs hold this rank's
    rows of the sequence: a column-parallel linear's input is all-gathered first (instead of ``f``),
    a row-parallel linear's partial sums are reduce-scattered (instead of ``g``)."""
    source = layout.program.graph_module
    vocab = {m.module for m in layout.modules if m.style == "vocab"}
    params = {
        s.arg.name: s.target for s in layout.program.graph_signature.input_specs if s.kind.name == "PARAMETER"
    }
    seq = _SequencePlan(source.graph, layout, params) if layout.sequence_parallel else None
    if seq is not None and seq.length is not None and seq.length % layout.tp:
        raise ValueError(
            f"recompile_opt.parallel: sequence parallelism splits the sequence over the ranks: "
            f"length {seq.length} is not divisible by {layout.tp} ranks (pad it, or pass "
            "sequence_parallel=False)"
        )
    graph, env, copies, gathered, gathered_for_columns = _TracedGraph(), {}, {}, {}, {}

    def gather(x: fx.Node) -> fx.Node:  # a sequence-sharded value whole, for replicated work (once per value)
        if x not in gathered:
            gathered[x] = graph.call_function(
                C.gather_sequence_for_replicated,
                (env[x], group_name, seq.dim(x)),
                {"size": layout.tp, "rank": rank},
            )
        return gathered[x]

    summed = []  # replicated parameters read on shards: their gradients summed by one f after the inputs
    for node in source.graph.nodes:
        graph.origin = {k: node.meta[k] for k in ("stack_trace", "nn_module_stack") if k in node.meta}
        if node.op != "placeholder" and summed:
            _sum_gradients(graph, env, summed, group_name)
            summed = []
        if node.op == "placeholder":
            env[node] = graph.placeholder(node.name)
            if seq is not None and node in seq.summed:
                summed.append(node)
            elif seq is not None and node in seq.seeds:  # a bare block's hidden states: this rank's rows
                env[node] = graph.call_function(
                    C.split_sequence,
                    (env[node], group_name, seq.dim(node)),
                    {"size": layout.tp, "rank": rank},
                )
            continue
        if node.op == "output":
            graph.output(
                fx.map_arg(node.args[0], lambda n: gather(n) if seq and n in seq.sharded else env[n])
            )
            continue
        if node.op == "get_attr":
            env[node] = graph.get_attr(node.target)
            continue
        args, kwargs = fx.map_arg(node.args, env.__getitem__), fx.map_arg(node.kwargs, env.__getitem__)
        if kwargs.get("device") is not None and torch.device(kwargs["device"]).type == "meta":
            kwargs = {**kwargs, "device": torch.device(device)}
        # ``aten.to.device(x, device, ...)``: Hugging Face's rotary embedding moves its table to the input's
        if any(isinstance(a, torch.device) and a.type == "meta" for a in args):
            args = tuple(
                torch.device(device) if isinstance(a, torch.device) and a.type == "meta" else a for a in args
            )
        role, op = layout.roles.get(node.name), op_name(node)
        sharded_in = [a for a in node.all_input_nodes if seq is not None and a in seq.sharded]
        if role == "column":
            x = node.args[0]
            if x in sharded_in:  # its gradient comes back partial from each rank: reduce-scattered
                if x not in gathered_for_columns:
                    gathered_for_columns[x] = graph.call_function(
                        C.gather_sequence, (env[x], group_name, seq.dim(x))
                    )
                x_local = gathered_for_columns[x]
            else:
                if x not in copies:  # one f per input: its backward all-reduces the input's gradient once
                    copies[x] = graph.call_function(C.copy_to_tensor_parallel, (env[x], group_name))
                x_local = copies[x]
            env[node] = graph.call_function(node.target, (x_local, *args[1:]), kwargs)
        elif role == "row":
            partial = graph.call_function(node.target, tuple(args[:2]))
            out = (
                graph.call_function(C.reduce_scatter_sequence, (partial, group_name, seq.dim(node)))
                if seq is not None
                else graph.call_function(C.reduce_from_tensor_parallel, (partial, group_name))
            )
            bias = args[2] if len(args) > 2 else None
            env[node] = out if bias is None else graph.call_function(aten.add.Tensor, (out, bias))
        elif op in ("dropout", "native_dropout") and (
            slices := _rank_slices(node.args[0], layout, seq, rank)
        ):
            fn = D.sliced_dropout if op == "dropout" else D.sliced_native_dropout
            env[node] = graph.call_function(fn, (*args[:3], list(node.args[0].meta["val"].shape), slices))
        elif (
            op == "scaled_dot_product_attention"
            and _attention_dropout(node) > 0
            and (slices := _rank_slices(node.args[0], layout, seq, rank))
        ):
            q, k = (a.meta["val"].shape for a in node.args[:2])
            env[node] = graph.call_function(
                D.sliced_attention, args, {**kwargs, "full_shape": [*q[:-1], k[-2]], "slices": slices}
            )
        elif op == "embedding" and params.get(node.args[0].name, "").rsplit(".", 1)[0] in vocab:
            env[node] = _vocab_lookup(
                graph,
                node,
                args,
                layout.tp,
                rank,
                group_name,
                seq.dim(node) if seq is not None and node in seq.sharded else None,
            )
        elif node.name in layout.gathered:  # needs every feature of a lone column linear's output: gathered
            whole = {
                x: graph.call_function(
                    C.gather_features_for_replicated,
                    (env[x], group_name, dim),
                    {"size": layout.tp, "rank": rank},
                )
                for x in node.all_input_nodes
                if (dim := layout.gathered[node.name].get(x.name)) is not None
            }
            args = fx.map_arg(node.args, lambda n: whole.get(n, env[n]))
            env[node] = graph.call_function(node.target, _local_args(node, args, layout), kwargs)
        elif seq is not None and node in seq.sharded and node in seq.seeds:  # a replicated token embedding
            whole = graph.call_function(node.target, args, kwargs)
            env[node] = graph.call_function(
                C.split_sequence, (whole, group_name, seq.dim(node)), {"size": layout.tp, "rank": rank}
            )
        elif seq is not None and node in seq.sharded:  # per-token op on shards: full-length operands narrowed
            env[node] = graph.call_function(
                node.target, seq.narrowed(node, args, env, graph, rank, group_name), kwargs
            )
        else:
            if sharded_in:  # anything else reads the whole sequence
                args = fx.map_arg(node.args, lambda n: gather(n) if n in sharded_in else env[n])
            env[node] = graph.call_function(node.target, _local_args(node, args, layout), kwargs)
    out = fx.GraphModule(source, graph)
    out.meta = {}
    return out


def _sum_gradients(graph: fx.Graph, env: dict, params: list[fx.Node], group_name: str) -> None:
    """Megatron's ``f`` on every parameter a rank reads on its sequence rows (norm weights, biases): one
    all-reduce of their gradients per dtype, not one each (on the Llama, 5 collectives a step become 1)."""
    by_dtype: dict = {}
    for p in params:
        by_dtype.setdefault(p.meta["val"].dtype, []).append(p)
    for group in by_dtype.values():
        copies = graph.call_function(C.copy_all_to_tensor_parallel, ([env[p] for p in group], group_name))
        for i, p in enumerate(group):
            env[p] = graph.call_function(operator.getitem, (copies, i))


class _TracedGraph(fx.Graph):
    """A graph whose new nodes carry the user's source line and module path of the node they stand for
    (Dynamo keeps a GraphModule's node metadata when it traces one), so plans of the rank's graph show
    the model's own lines and modules."""

    origin: dict = {}

    def create_node(self, *args, **kwargs) -> fx.Node:
        node = super().create_node(*args, **kwargs)
        node.meta.update(self.origin)
        return node


# ops that act on each token alone, so they run on a rank's rows of the sequence: the per-token class as
# the exported graph spells it, less the ops the sequence plan was never tried with (of the reductions only
# ``mean``, whose dimension it does not check)
_PER_TOKEN = (
    PER_TOKEN
    - PYTHON_SPELLINGS
    - {"sum", "amax", "softmax", "log_softmax"}
    - {
        "square",
        "softplus",
        "relu6",
        "leaky_relu",
        "elu",
        "hardswish",
        "mish",
        "erf",
        "exp",
        "sigmoid",
        "gelu_",
    }
    - {"contiguous", "lift_fresh_copy", "where", "masked_fill", "scalar_tensor", "logical_not", "bitwise_not"}
)


class _SequencePlan:
    """Which values hold a rank's rows of the sequence: from the token embedding on, through the
    per-token ops between the pairs (norms, residual adds, dropout), and out of each row-parallel
    linear; a full-length replicated operand they combine with is narrowed to the rank's rows (GPT's
    position embedding), and the parameters read on shards (norm weights, row biases, the position
    table) get their gradients summed over the ranks (``summed``)."""

    def __init__(self, graph: fx.Graph, layout: Layout, params: dict[str, str]):
        self.tp, self.sharded, self.seeds, self.summed, self.resplit = layout.tp, set(), set(), set(), set()
        self.length: int | None = None
        self.to_narrow: dict[fx.Node, list[fx.Node]] = {}
        users = set(layout.program.graph_signature.user_inputs)
        for node in graph.nodes:
            if node.op == "placeholder" and node.name in users and _hidden_states(node):
                self.sharded.add(node)  # a bare block's [b, s, h] input: split along the sequence on entry
                self.seeds.add(node)
                self.length = node.meta["val"].shape[1]
            if node.op != "call_function":
                continue
            op = op_name(node)
            if op == "embedding" and node.args[0].name in params and from_input(node.args[1]):
                self.sharded.add(node)
                self.seeds.add(node)
                self.length = node.meta["val"].shape[1]
            elif layout.roles.get(node.name) == "row":
                self.sharded.add(node)  # reduce-scattered; its bias is then added on the rank's rows
                self.summed |= {a for a in node.args[2:3] if isinstance(a, fx.Node) and a.name in params}
            elif (
                op == "getitem"
                and node.args[0] in self.sharded
                and layout.roles.get(node.args[0].name) != "column"
            ):
                self.sharded.add(node)  # getitem of a per-token multi-output op (its output, mean, rstd)
            elif (
                op in _PER_TOKEN
                and any(a in self.sharded for a in node.all_input_nodes)
                and layout.roles.get(node.name) is None
            ):
                self.sharded.add(node)
                full = [a for a in node.all_input_nodes if a not in self.sharded and self._spans(a, node)]
                self.to_narrow[node] = full
                for a in full:
                    behind, from_rows = _parameters_behind(a, params, self.sharded)
                    if from_rows:  # replicated work on gathered rows (a pair kept replicated): resplit
                        self.resplit.add(a)
                    else:
                        self.summed |= behind
                self.summed |= {a for a in node.all_input_nodes if a.op == "placeholder" and a.name in params}

    def dim(self, node: fx.Node) -> int:
        return 1 if len(node.meta["val"].shape) >= 2 else 0

    def _spans(self, a: fx.Node, node: fx.Node) -> bool:
        """Whether operand ``a`` runs the whole sequence where ``node``'s value runs its rows."""
        val = a.meta.get("val")
        if not isinstance(val, torch.Tensor):
            return False
        d = self.dim(node) - (len(node.meta["val"].shape) - val.dim())
        return 0 <= d < val.dim() and val.shape[d] == self.length

    def narrowed(self, node: fx.Node, args, env, graph: fx.Graph, rank: int, group_name: str):
        """``node``'s arguments with each full-length operand cut to this rank's rows. A narrow leaves the
        operand's gradient partial (this rank's rows only): right for a value computed from replicated
        inputs alone, whose parameters' gradients are then summed (``summed``). A value computed from
        gathered rows (``resplit``: work every rank repeats whole, e.g. attention kept replicated) is
        split instead, its gradient all-gathered, so every rank's gradient of it is the whole one, as the
        gather before it (:func:`~recompile_opt.parallel.collectives.gather_sequence_for_replicated`)
        expects: a narrow there lost the other ranks' rows' share of each row's gradient."""
        rows = self.length // self.tp
        swap = {}
        for a in self.to_narrow.get(node, []):
            d = self.dim(node) - (len(node.meta["val"].shape) - a.meta["val"].dim())
            if a in self.resplit:
                swap[env[a]] = graph.call_function(
                    C.split_sequence, (env[a], group_name, d), {"size": self.tp, "rank": rank}
                )
                continue
            swap[env[a]] = graph.call_function(aten.narrow.default, (env[a], d, rank * rows, rows))
        return fx.map_arg(args, lambda n: swap.get(n, n))


def _rank_slices(x: fx.Node, layout: Layout, seq: _SequencePlan | None, rank: int) -> tuple:
    """Where this rank's value of ``x`` lies in the global one: ``(dim, start, length)`` for each of its
    sharded dimensions (the sequence's rows, the features or heads); empty where it is replicated."""
    shape, out = x.meta["val"].shape, []
    if seq is not None and x in seq.sharded:
        dim = seq.dim(x)
        out.append((dim, rank * (shape[dim] // layout.tp), shape[dim] // layout.tp))
    if x.name in layout.sharded:
        dim = layout.sharded[x.name]
        out.append((dim, rank * (shape[dim] // layout.tp), shape[dim] // layout.tp))
    return tuple(out)


def _attention_dropout(node: fx.Node) -> float:
    """The ``dropout_p`` of a ``scaled_dot_product_attention`` node."""
    return node.args[4] if len(node.args) > 4 else node.kwargs.get("dropout_p", 0.0)


def _hidden_states(node: fx.Node) -> bool:
    """A float ``[b, s, h]`` input: hidden states entering a bare transformer block."""
    val = node.meta.get("val")
    return isinstance(val, torch.Tensor) and val.dim() == 3 and val.is_floating_point()


def _parameters_behind(node: fx.Node, params: dict, stop: set) -> tuple[set, bool]:
    """The parameter inputs a replicated value is computed from (its gradient is then a rank's part),
    and whether it is computed from sequence-sharded values (``stop``) too."""
    found, todo, seen, reached = set(), [node], set(), False
    while todo:
        n = todo.pop()
        if n in stop:
            reached = True
        if n in seen or n in stop:
            continue
        seen.add(n)
        if n.op == "placeholder" and n.name in params:
            found.add(n)
        todo.extend(n.all_input_nodes)
    return found, reached


def _local_args(node: fx.Node, args: tuple, layout: Layout) -> tuple:
    """A size-taking op's arguments with the sharded dimension's size divided by the rank count."""
    op, tp = op_name(node), layout.tp
    if op in _SIZED and node.name in layout.sharded:
        dim, sizes = layout.sharded[node.name], list(args[1])
        if sizes[dim] != -1:
            sizes[dim] //= tp
        return (args[0], sizes, *args[2:])
    if op in ("split", "split_with_sizes") and node.args[0].name in layout.sharded:
        dim = (args[2] if len(args) > 2 else 0) % len(node.args[0].meta["val"].shape)
        if dim == layout.sharded[node.args[0].name]:
            size = [s // tp for s in args[1]] if isinstance(args[1], (list, tuple)) else args[1] // tp
            return (args[0], size, *args[2:])
    return args


def _vocab_lookup(
    graph: fx.Graph,
    node: fx.Node,
    args: tuple,
    tp: int,
    rank: int,
    group_name: str,
    seq_dim: int | None = None,
) -> fx.Node:
    """Megatron's vocabulary-parallel embedding: this rank's rows looked up, the others zero, summed by g
    (or, with sequence parallelism, reduce-scattered over the sequence).

    A token's row on this rank is ``(id - rank * rows) mod vocab``, written ``(id + (tp - rank) * rows)
    mod vocab`` so that no rank adds zero: rank 0's ``id - 0`` was folded away (torch 2.14), its graph
    lost a node the others have, and the ranks planned differently (a hang or wrong collectives).
    The rows outside this rank's share land at ``rows`` and above."""
    weight, ids = args[0], args[1]
    vocab = node.args[0].meta["val"].shape[0]
    rows = vocab // tp
    local = graph.call_function(
        aten.remainder.Scalar, (graph.call_function(aten.add.Tensor, (ids, (tp - rank) * rows)), vocab)
    )
    outside = graph.call_function(aten.ge.Scalar, (local, rows))
    local = graph.call_function(aten.masked_fill.Scalar, (local, outside, 0))
    found = graph.call_function(aten.embedding.default, (weight, local, *args[2:]))
    found = graph.call_function(
        aten.masked_fill.Scalar, (found, graph.call_function(aten.unsqueeze.default, (outside, -1)), 0.0)
    )
    if seq_dim is not None:
        return graph.call_function(C.reduce_scatter_sequence, (found, group_name, seq_dim))
    return graph.call_function(C.reduce_from_tensor_parallel, (found, group_name))


def install(
    model: torch.nn.Module, layout: Layout, graph: fx.GraphModule, derive: Derive | None = None
) -> None:
    """``model.forward`` replaced by the rank's graph, fed with the local shards of its parameters (a
    DTensor's ``to_local()``: its gradient comes back as a DTensor of the same placement), its buffers
    and the caller's inputs; the outputs returned as the model returns them. A call of another input
    signature or mode gets its own rank's graph from ``derive`` (kept for later calls), or where there is
    none, an error. Where submodules the forward calls have hooks (FSDP2 per block), the graph runs in
    pieces, each hooked module called for its own (:mod:`.pieces`)."""
    first = RankGraph.of(layout, graph)
    # read here, not in the forward: Dynamo does not trace into ExportedProgram (a graph break per call)
    graphs = {(first.signature, model.training): first}
    called = {path for n in graph.graph.nodes for path, _ in (n.meta.get("nn_module_stack") or {}).values()}

    def forward(self, *args, **kwargs):
        hooked = _hooked_calls(self, called)
        leaves = pytree.tree_leaves((args, kwargs))
        key = (tuple(signature(x) for x in leaves), self.training)
        entry = graphs.get(key)
        if entry is None:
            entry = _derived(graphs, key, derive, args, kwargs)
        user = iter(leaves)
        inputs = []
        for spec in entry.specs:
            kind = spec.kind.name
            if kind == "PARAMETER":
                p = self.get_parameter(spec.target)
                inputs.append(p.to_local() if isinstance(p, DTensor) else p)
            elif kind == "BUFFER":
                inputs.append(self.get_buffer(spec.target))
            elif kind == "CONSTANT_TENSOR":
                inputs.append(entry.constants[spec.target])
            else:
                inputs.append(next(user))
        rank_graph = graph if entry is first else entry.graph
        if hooked:  # run module by module, each hooked one called for its piece
            pieces, names = entry.pieces.get(hooked) or _pieces(self, entry, hooked)
            values = dict(zip((spec.arg.name for spec in entry.specs), inputs))
            outputs = P.run(pieces, self, values, names)
        else:
            # the first graph from the closure: Dynamo names a module it reaches through the dict by
            # that path, and its nodes then sit under it in the plans (``policy="full"`` found no blocks)
            outputs = rank_graph(*inputs)
        outputs = outputs if isinstance(outputs, (tuple, list)) else (outputs,)
        mine = [o for o, s in zip(outputs, entry.out_specs) if s.kind.name == "USER_OUTPUT"]
        return pytree.tree_unflatten(mine, entry.out_tree)

    model.forward = types.MethodType(forward, model)
    for module in model.modules():
        if module is not model:  # a hooked module runs its piece of the rank's graph when called for it
            module.forward = types.MethodType(P.piece_forward, module)


@torch.compiler.disable
def _derived(graphs: dict, key: tuple, derive: Derive | None, args: tuple, kwargs: dict) -> RankGraph:
    """The rank's graph for a signature met for the first time, made outside Dynamo's trace. Why
    outside: an export cannot run inside one, and an exception Dynamo traces to the top of a compiled
    frame makes it skip that frame's code for good (torch 2.13: ``Module._wrapped_call_impl``, every
    module's), so a compiled model that caught such an error ran afterwards as pieces that the
    partitioner failed on (issue 49). A disabled function is a graph break Dynamo resumes from
    instead; once the graph is kept, a retrace finds it and runs in one piece."""
    signatures, training = key
    if derive is None:
        (captured, was_training), *_ = graphs
        raise ValueError(
            f"recompile_opt.parallelize: the model was laid out for inputs {list(captured)} in "
            f"{'training' if was_training else 'eval'} mode; called with {list(signatures)} in "
            f"{'training' if training else 'eval'} mode, and no other signature can be derived here"
        )
    graphs[key] = derive(args, kwargs, training)
    return graphs[key]


@torch.compiler.disable
def _pieces(model: torch.nn.Module, entry: RankGraph, hooked: tuple[str, ...]) -> tuple:
    """The rank's graph cut at the ``hooked`` modules (:func:`pieces.split`), kept with it; made outside
    Dynamo's trace, where an error it raises is raised as written (see :func:`_derived`)."""
    P.warn_strided_resharded(model)
    params = {s.arg.name: s.target for s in entry.specs if s.kind.name == "PARAMETER"}
    entry.pieces[hooked] = P.split(entry.graph, params, list(hooked))
    return entry.pieces[hooked]


def _hooked_calls(model: torch.nn.Module, called: set[str]) -> tuple[str, ...]:
    """The submodules with hooks that the model's forward calls (``called``: the paths in the graph's
    module stacks); a hooked module called inside another is refused."""
    hooked = [name for name, m in model.named_modules() if m is not model and _has_hooks(m)]
    if not hooked:
        return ()
    hooked = [name for name in hooked if name in called]
    outer = tuple(n for n in hooked if not any(n.startswith(o + ".") for o in hooked))
    inner = [n for n in hooked if n not in outer]
    if inner:
        _refuse_hooks(inner)
    return outer


def _has_hooks(module: torch.nn.Module) -> bool:
    return bool(
        module._forward_pre_hooks
        or module._forward_hooks
        or module._backward_pre_hooks
        or module._backward_hooks
    )


@torch.compiler.disable
def _refuse_hooks(bypassed: list[str]) -> None:
    """A hook inside a hooked module would not fire: that module is called for its piece of the rank's
    graph (:mod:`.pieces`), whose nodes call no module within it. Raised outside Dynamo's trace (see
    :func:`_derived`)."""
    raise ValueError(
        f"recompile_opt.parallelize: module {bypassed[0]!r} has forward or backward hooks"
        + (f" (and {len(bypassed) - 1} more modules)" if len(bypassed) > 1 else "")
        + " inside a module that has hooks too, which the parallelized model would bypass: it calls each "
        "outermost hooked module for its part of the graph, not the modules within it. Hook the outer "
        "module only (FSDP2: fully_shard per block and on the root works)"
    )
