"""Megatron's tensor-parallel layout found from the graph (issue 22, step 3 of docs/parallel-design.md):
which linear layers are column-parallel, which row-parallel, which modules run on sequence shards,
and why; a pair it cannot shard stays replicated, with a warning naming the module and the reason.

Why from the graph and not from module types or names: what makes two linears a Megatron pair is
the dataflow between them. The first's output features may be split over the ranks only if every op
up to the second keeps each rank's features apart: elementwise ops, views that split the features
into whole heads (``view(b, s, n_head, h // n_head)``, even with the head count hard-coded), the
attention core over heads, a fused ``[q | k | v]`` output split into equal pieces (then each rank
needs its slice of each piece: a strided shard). The second must contract over exactly those
features, leaving partial sums that one all-reduce (or reduce-scatter) adds up. So the model is
captured once (``torch.export``, meta tensors are fine) and each value's feature sharding is
propagated through the ATen graph.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field

import torch
import torch.fx as fx

from recompile_opt.ops import ELEMENTWISE, NORMS, PYTHON_SPELLINGS, op_name

aten = torch.ops.aten

# ops that act on each element (or broadcast), so a sharded operand stays sharded the same way: the
# elementwise class as the exported graph spells it, less the activations no layout was tried with
_ELEMENTWISE = (
    ELEMENTWISE - PYTHON_SPELLINGS - {"square", "softplus", "relu6", "leaky_relu", "elu", "hardswish"}
)
_VIEWS = {"view", "reshape", "_unsafe_view", "flatten", "unflatten"}
_LINEAR = {"linear"}
_ATTENTION = {
    "scaled_dot_product_attention",
    "_scaled_dot_product_flash_attention_for_cpu",
    "_scaled_dot_product_efficient_attention",
    "_scaled_dot_product_flash_attention",
}
_NORMS = NORMS


@dataclass
class ModuleLayout:
    """One module's place in the layout."""

    module: str
    style: str  # column, row, sequence, vocab, replicated
    placement: str  # of its weight: Shard(0), _StridedShard(0, 3), Shard(1), Replicate
    why: str


@dataclass
class Layout:
    """The layout of a model over ``tp`` ranks: module -> style, the pairs it could not shard."""

    tp: int
    sequence_parallel: bool
    modules: list[ModuleLayout] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    # the graph it was found in, and per node what the rewrite needs: the dimension a node's value is
    # sharded on, and each linear's role (column, row; absent: replicated)
    program: object = field(default=None, repr=False)
    sharded: dict[str, int] = field(default_factory=dict, repr=False)
    roles: dict[str, str] = field(default_factory=dict, repr=False)
    # node -> {input: its sharded dimension}: inputs gathered whole first (a lone column linear's output
    # before an op that needs every feature: the LM head's logits before the loss)
    gathered: dict[str, dict[str, int]] = field(default_factory=dict, repr=False)

    def __str__(self) -> str:
        width = max((len(m.module) for m in self.modules), default=6)
        lines = [
            f"tensor parallel over {self.tp} ranks"
            + (", sequence parallel" if self.sequence_parallel else ""),
            f"  {'module':{width}s}  {'style':10s}  {'weight':20s}  why",
        ]
        lines += [f"  {m.module:{width}s}  {m.style:10s}  {m.placement:20s}  {m.why}" for m in self.modules]
        return "\n".join(lines + [f"  warning: {w}" for w in self.warnings])


@dataclass(frozen=True)
class _Sharded:
    """A value whose dimension ``dim`` is split over the ranks; ``group``: the column-parallel linears
    it came from (one pair: they share their row-parallel partner)."""

    dim: int
    group: int


@dataclass(frozen=True)
class _Partial:
    """Partial sums of a row-parallel linear: one all-reduce (or reduce-scatter) makes them whole."""

    group: int


@dataclass(frozen=True)
class _Replicated:
    """A replicated value that a pair kept replicated computes: the linear it reaches is that pair's
    partner, kept replicated too."""

    group: int


class _Failed(Exception):
    def __init__(self, group: int, why: str, node: fx.Node | None = None):
        super().__init__(why)
        self.group, self.why, self.node = group, why, node


def find_layout(
    model: torch.nn.Module,
    example_inputs: tuple,
    tp: int,
    *,
    sequence_parallel: bool = True,
    kwargs: dict | None = None,
) -> Layout:
    """The Megatron layout of ``model`` over ``tp`` ranks, found in its exported graph (meta inputs are
    fine: nothing runs). Pairs it cannot shard stay replicated, each with a warning."""
    if not isinstance(tp, int) or tp < 1:
        raise ValueError(f"recompile_opt.parallel: tp must be a positive int, got {tp!r}")
    program = torch.export.export(model, tuple(example_inputs), kwargs=kwargs, strict=False)
    params = {
        spec.arg.name: spec.target
        for spec in program.graph_signature.input_specs
        if spec.kind.name == "PARAMETER"
    }
    _addmm_as_linear(program.graph_module, params)
    layout = _Finder(program.graph_module.graph, params, tp).layout(sequence_parallel)
    layout.program = program
    return layout


class _Finder:
    """Propagates feature sharding through the graph. Where a pair cannot be sharded, its linears are
    marked replicated (with the reason) and the propagation runs again."""

    def __init__(self, graph: fx.Graph, params: dict[str, str], tp: int):
        self.graph, self.params, self.tp = graph, params, tp
        self.linears = [n for n in graph.nodes if op_name(n) in _LINEAR and _weight(n, params) is not None]
        self.index = {n: i for i, n in enumerate(self.linears)}
        self.excluded: dict[int, str] = {}  # a column linear's index -> why its pair stays replicated
        self.gather_at: set[fx.Node] = set()  # nodes whose sharded inputs are gathered whole first

    def layout(self, sequence_parallel: bool) -> Layout:
        for _ in range(len(self.linears) + 1):
            try:
                roles, strided, partners = self._propagate()
                break
            except _Failed as failed:
                if self._gatherable(failed):
                    self.gather_at.add(failed.node)
                    continue
                for i in self._members(failed.group):
                    self.excluded.setdefault(i, failed.why)
        else:  # every round excluded a pair and none came clean: nothing is sharded
            self.excluded = {
                i: self.excluded.get(i, "no consistent layout found") for i in range(len(self.linears))
            }
            roles, strided, partners = self._propagate()
        out = Layout(self.tp, sequence_parallel)
        gathered = {
            node: {a: self.state[a] for a in node.all_input_nodes if isinstance(self.state.get(a), _Sharded)}
            for node in self.gather_at
        }
        ends = {self._find(v.group) for ins in gathered.values() for v in ins.values()}
        out.gathered = {node.name: {a.name: v.dim for a, v in ins.items()} for node, ins in gathered.items()}
        closed = {g for g, role in roles.values() if role == "row"} | ends
        open_groups = {g for g, role in roles.values()} - closed
        out.sharded = {
            n.name: v.dim
            for n, v in self.state.items()
            if isinstance(v, _Sharded) and self._find(v.group) not in open_groups
        }
        out.roles = {n.name: role for n, (g, role) in roles.items() if g in closed}
        for node in self.linears:
            name = self._name(node)
            i = self.index[node]
            if i in self.excluded or i in partners:
                why = self.excluded.get(i) or self.excluded.get(partners.get(i), "")
                out.modules.append(ModuleLayout(name, "replicated", "Replicate", why))
                if i in self.excluded:
                    out.warnings.append(f"{name}: kept replicated: {why}")
                continue
            group, role = roles.get(node, (None, None))
            if role == "column" and group not in closed:
                out.modules.append(ModuleLayout(name, "replicated", "Replicate", "no row-parallel partner"))
                out.warnings.append(
                    f"{name}: its output features reach no row-parallel linear; kept replicated"
                )
            # a weight laid out [in, out] (GPT-2's Conv1D) is split on the other dimension
            out_dim, in_dim = (1, 0) if _transposed(node, self.params) else (0, 1)
            if role == "column" and group in ends:
                at = next(
                    n for n in gathered if any(self._find(v.group) == group for v in gathered[n].values())
                )
                out.modules.append(
                    ModuleLayout(
                        name,
                        "column",
                        f"Shard({out_dim})",
                        f"output features sharded, gathered whole for {op_name(at)} (it reads every feature)",
                    )
                )
            elif role == "column":
                k = strided.get(node, 1)
                out.modules.append(
                    ModuleLayout(
                        name,
                        "column",
                        f"_StridedShard({out_dim}, {k})" if k > 1 else f"Shard({out_dim})",
                        f"fused output split into {k} pieces, each sharded by heads"
                        if k > 1
                        else "output features sharded",
                    )
                )
            elif role == "row":
                out.modules.append(
                    ModuleLayout(
                        name,
                        "row",
                        f"Shard({in_dim})",
                        "contracts the sharded features; "
                        "partial sums " + ("reduce-scattered" if sequence_parallel else "all-reduced"),
                    )
                )
        out.modules += self._others(sequence_parallel)
        out.warnings += self._unrecognised()
        for w in out.warnings:
            warnings.warn("recompile_opt.parallel: " + w, stacklevel=3)
        return out

    def _name(self, linear: fx.Node) -> str:
        return _module(self.params[_weight(linear, self.params).name])

    def _members(self, group: int) -> list[int]:
        root = self._find(group)
        return [i for i in range(len(self.linears)) if self._find(i) == root]

    # -- propagation ---------------------------------------------------------------------------

    def _propagate(self):
        self.parent = list(range(len(self.linears)))
        state: dict[fx.Node, object] = {}
        self.state = state  # as far as it got, where a pair fails (_gatherable reads it)
        roles: dict[fx.Node, tuple[int, str]] = {}
        strided: dict[fx.Node, int] = {}
        source: dict[fx.Node, fx.Node] = {}  # a value still laid out as a column linear's output
        partners: dict[int, int] = {}  # a linear that a replicated pair reaches -> that pair
        for node in self.graph.nodes:
            if node.op != "call_function":
                continue
            if node in self.index:
                self._linear(node, state, roles, source, partners)
                continue
            if (op_name(node) or "").startswith(
                "_assert"
            ):  # checks of a value's metadata: no value of their own
                continue
            ins = [a for a in node.all_input_nodes if isinstance(state.get(a), (_Sharded, _Partial))]
            if node in self.gather_at:  # its inputs gathered whole: it computes a replicated value
                continue
            if ins:
                try:
                    state[node] = self._rule(node, op_name(node), ins, state, strided, source)
                except _Failed as failed:
                    failed.node = failed.node or node
                    raise
            else:
                kept = [state[a] for a in node.all_input_nodes if isinstance(state.get(a), _Replicated)]
                if kept:
                    state[node] = kept[0]
        roles = {n: (self._find(g), role) for n, (g, role) in roles.items()}
        return roles, strided, partners

    def _linear(self, node, state, roles, source, partners):
        i, x = self.index[node], state.get(node.args[0])
        if isinstance(x, _Replicated):  # the partner of a pair kept replicated
            partners[i] = x.group
            return
        if i in self.excluded:
            if isinstance(x, (_Sharded, _Partial)):
                raise _Failed(x.group, f"{self._name(node)} is kept replicated but reads a sharded value")
            state[node] = _Replicated(i)
            return
        if x is None:  # a replicated input: column-parallel
            state[node] = _Sharded(_ndim(node) - 1, i)
            roles[node], source[node] = (i, "column"), node
            self._check_divisible(node, _ndim(node) - 1, 1, i)
        elif isinstance(x, _Sharded) and x.dim == _ndim(node.args[0]) - 1:  # row-parallel
            self._union(x.group, i)
            roles[node], state[node] = (i, "row"), _Partial(self._find(i))
        else:
            raise _Failed(x.group, f"{self._name(node)} reads a value not sharded on its features")

    def _rule(self, node, op, ins, state, strided, source):
        first = state[ins[0]]
        for other in ins[1:]:  # values of several pairs meet: one group
            self._union(first.group, state[other].group)
        group = self._find(first.group)
        if isinstance(first, _Partial):
            if op in ("dropout", "native_dropout") or (op == "getitem" and node.args[1] == 0):
                return _Partial(group)  # a mask is linear: applied to each rank's partial sum
            if op == "add":
                return None  # the reduction point (Megatron's g): whole sums, replicated
            raise _Failed(group, f"partial sums reach {op} before they are added up")
        dim = first.dim
        if any(
            isinstance(state[a], _Partial) or (state[a].dim != dim and _ndim(a) == _ndim(ins[0])) for a in ins
        ):
            raise _Failed(group, f"{op} combines values sharded on different dimensions")
        if op in _ELEMENTWISE or op in ("matmul", "bmm") or op in _ATTENTION:
            self._check_replicated_operands(node, op, ins, _out_dim(node, ins[0], dim), group)
        if op == "getitem":  # every piece of a split, else a multi-output op's first output
            whole = (
                op_name(node.args[0]) in ("split", "split_with_sizes", "chunk", "unbind") or node.args[1] == 0
            )
            return _Sharded(dim, group) if whole else None
        if op in _ELEMENTWISE:
            return _Sharded(_out_dim(node, ins[0], dim), group)
        if op in _VIEWS:
            new = _view_dim(_shape(ins[0]), _shape(node), dim, self.tp)
            if new is None:
                raise _Failed(
                    group,
                    f"{op} {list(_shape(ins[0]))} -> {list(_shape(node))} splits the sharded "
                    f"dimension into parts not divisible by {self.tp}",
                )
            if ins[0] in source:
                source[node] = source[ins[0]]
            return _Sharded(new, group)
        if op == "transpose":
            a, b = (d % _ndim(node) for d in node.args[1:3])
            return _Sharded(b if dim == a else a if dim == b else dim, group)
        if op == "permute":
            return _Sharded([d % _ndim(node) for d in node.args[1]].index(dim), group)
        if op in ("split", "split_with_sizes", "chunk"):
            return self._split(node, op, ins[0], dim, group, strided, source)
        if op in ("matmul", "bmm"):
            if dim >= _ndim(node) - 2:
                raise _Failed(group, f"{op} contracts or spans the sharded dimension")
            return _Sharded(dim, group)
        if op in ("softmax", "_softmax", "log_softmax", "_log_softmax"):
            if node.args[1] % _ndim(node) == dim:
                raise _Failed(group, f"{op} over the sharded dimension")
            return _Sharded(dim, group)
        if op in _ATTENTION:
            if dim != 1:
                raise _Failed(group, f"{op} with its inputs sharded on dimension {dim}, not the heads")
            return _Sharded(1, group)
        if op == "stack":
            along = _dim_arg(node, op) % _ndim(node)
            return _Sharded(dim + (1 if along <= dim else 0), group)
        if op in ("slice", "narrow", "select", "cat"):
            if _dim_arg(node, op) % max(_ndim(ins[0]), 1) == dim:
                raise _Failed(group, f"{op} along the sharded dimension")
            return _Sharded(dim - (1 if op == "select" and node.args[1] % _ndim(ins[0]) < dim else 0), group)
        if op == "expand":
            return _Sharded(_out_dim(node, ins[0], dim), group)
        if op == "unsqueeze":
            return _Sharded(dim + (1 if node.args[1] % _ndim(node) <= dim else 0), group)
        if op in ("view_as_complex", "view_as_real"):  # complex rotary embeddings (Llama's reference code)
            if op == "view_as_complex" and dim == _ndim(ins[0]) - 1:
                raise _Failed(group, f"{op} pairs up the sharded dimension")
            return _Sharded(dim, group)  # the last dimension's (real, imaginary) pairs, the others kept
        raise _Failed(group, f"{op} is not known to keep each rank's features apart")

    def _check_replicated_operands(self, node, op, ins, dim, group):
        """A sharded value may meet a replicated one only where the replicated one is broadcast along the
        sharded dimension (rotary tables, masks): a replicated operand that spans it (the keys of a pair
        kept replicated, e.g. 2 KV heads over 4 ranks, against this rank's query heads) would be read
        whole against this rank's part."""
        for a in node.all_input_nodes:
            if a in ins or not isinstance(a.meta.get("val"), torch.Tensor):
                continue
            d = dim - (_ndim(node) - _ndim(a))
            if 0 <= d < _ndim(a) and _shape(a)[d] != 1:
                raise _Failed(
                    group,
                    f"{op} combines this rank's part with a value replicated across the sharded "
                    f"dimension ({a.name}, {list(_shape(a))})",
                )

    def _split(self, node, op, x, dim, group, strided, source):
        along = (node.args[2] if len(node.args) > 2 else 0) % _ndim(x)
        if along != dim:
            return _Sharded(dim, group)
        pieces = len(node.meta["val"])
        sizes = {tuple(v.shape) for v in node.meta["val"]}
        column = source.get(x)
        if column is None or len(sizes) != 1 or strided.get(column, 1) not in (1, pieces):
            raise _Failed(
                group, f"{op} along the sharded dimension into unequal pieces, or not of a linear's output"
            )
        strided[column] = pieces
        self._check_divisible(node.args[0], dim, pieces, group)
        return _Sharded(dim, group)

    def _check_divisible(self, node, dim, pieces, group):
        size = _shape(node)[dim] // pieces
        if size % self.tp:
            raise _Failed(group, f"{size} features are not divisible by {self.tp} ranks")

    def _gatherable(self, failed: _Failed) -> bool:
        """A lone column linear (no partner: the LM head) whose sharded output reaches an op that needs
        every feature, and nothing after that op is a linear: its output is gathered whole there, as
        ``ColwiseParallel(output_layouts=Replicate())`` does, rather than the linear kept replicated
        (every rank computing all the logits: on the benchmark GPT at t = 2, 20% of the step)."""
        if failed.node is None or len(self._members(failed.group)) != 1:
            return False
        if any(isinstance(self.state.get(a), _Partial) for a in failed.node.all_input_nodes):
            return False
        seen, todo = set(), [failed.node]
        while todo:
            n = todo.pop()
            if n in self.index and n is not failed.node:
                return False
            todo.extend(u for u in n.users if u not in seen)
            seen.update(n.users)
        return True

    # groups: a union-find over the column linears' indices
    def _find(self, i):
        while self.parent[i] != i:
            self.parent[i] = self.parent[self.parent[i]]
            i = self.parent[i]
        return i

    def _union(self, a, b):
        ra, rb = self._find(a), self._find(b)
        if ra != rb:
            self.parent[max(ra, rb)] = min(ra, rb)

    def _unrecognised(self) -> list[str]:
        """Weights multiplied outside ``aten.linear`` other than as :func:`_addmm_as_linear` rewrites
        them: not paired, so say so rather than leave them replicated silently."""
        found = {}
        for node in self.graph.nodes:
            if op_name(node) in ("addmm", "mm", "matmul", "bmm"):
                for arg in node.args:
                    if isinstance(arg, fx.Node) and arg.name in self.params and _ndim(arg) == 2:
                        found.setdefault(_module(self.params[arg.name]), op_name(node))
        return [
            f"{m}: its weight is multiplied by {op}, not recognised as a linear layer yet; kept replicated"
            for m, op in found.items()
        ]

    # -- the modules between the pairs ------------------------------------------------------------

    def _others(self, sequence_parallel: bool) -> list[ModuleLayout]:
        """The embeddings (vocabulary-parallel where their indices are the model's token inputs) and the
        norms (on sequence shards under SP; a norm is a module whose ops reduce over the features)."""
        out, seen = [], set()
        for node in self.graph.nodes:
            op = op_name(node)
            if op == "embedding" and _param(node, 0, self.params):
                name = _module(self.params[node.args[0].name])
                rows = _shape(node.args[0])[0]
                if not from_input(node.args[1]):
                    out.append(
                        ModuleLayout(name, "replicated", "Replicate", "indexed by positions, not tokens")
                    )
                elif rows % self.tp == 0:
                    out.append(ModuleLayout(name, "vocab", "Shard(0)", "rows split; partial sums added up"))
                else:
                    out.append(ModuleLayout(name, "replicated", "Replicate", f"{rows} rows not divisible"))
            elif sequence_parallel and _is_norm(node):
                path = _stack_path(node)
                if path and path not in seen:
                    seen.add(path)
                    out.append(
                        ModuleLayout(path, "sequence", "Replicate", "runs on this rank's sequence shard")
                    )
        return out


def _is_norm(node: fx.Node) -> bool:
    """A norm's op: layer/RMS norm, or a mean over the last dimension (a hand-written RMSNorm)."""
    op = op_name(node)
    if op in _NORMS:
        return True
    return op == "mean" and len(node.args) > 1 and list(node.args[1]) in ([-1], [_ndim(node.args[0]) - 1])


def from_input(node: fx.Node) -> bool:
    """Whether ``node`` is a user input (through views): token ids, not positions made in the graph."""
    while node.op == "call_function" and op_name(node) in _VIEWS | {"slice", "_to_copy", "clone"}:
        node = node.args[0]
    return node.op == "placeholder"


def _addmm_as_linear(gm: fx.GraphModule, params: dict) -> None:
    """GPT-2's ``Conv1D`` (``addmm(bias, x.view(-1, in), W).view(*lead, out)``, W a parameter laid out
    ``[in, out]``) rewritten in place as ``linear(x, t(W), bias)``: the same values, and then it pairs
    as any linear does (its weight split on dimension 1 where a linear's is on 0, :func:`_transposed`)."""
    graph = gm.graph
    for mm in list(graph.nodes):
        if (
            op_name(mm) != "addmm"
            or mm.kwargs
            or len(mm.args) != 3
            or not _param(mm, 2, params)
            or _ndim(mm.args[2]) != 2
            or len(mm.users) != 1
        ):
            continue
        flat, unflat = mm.args[1], next(iter(mm.users))
        if op_name(flat) not in _VIEWS or op_name(unflat) not in _VIEWS:
            continue
        x = flat.args[0]
        if _shape(x)[:-1] != _shape(unflat)[:-1] or _shape(x)[-1:] != _shape(flat)[-1:]:
            continue
        with graph.inserting_before(mm):
            weight = graph.call_function(aten.t.default, (mm.args[2],))
            linear = graph.call_function(aten.linear.default, (x, weight, mm.args[0]))
        weight.meta = {**mm.meta, "val": mm.args[2].meta["val"].t()}
        linear.meta = {**mm.meta, "val": unflat.meta["val"]}
        unflat.replace_all_uses_with(linear)
        graph.erase_node(unflat)
        graph.erase_node(mm)
        if not flat.users:
            graph.erase_node(flat)
    gm.recompile()


def _weight(linear: fx.Node, params: dict) -> fx.Node | None:
    """The parameter a linear multiplies by: its weight, or a weight it transposes
    (:func:`_addmm_as_linear`)."""
    if len(linear.args) < 2 or not isinstance(linear.args[1], fx.Node):
        return None
    w = linear.args[1]
    if op_name(w) == "t" and isinstance(w.args[0], fx.Node):
        w = w.args[0]
    return w if w.name in params else None


def _transposed(linear: fx.Node, params: dict) -> bool:
    return _weight(linear, params) is not linear.args[1]


def _param(node: fx.Node, i: int, params: dict) -> bool:
    return len(node.args) > i and isinstance(node.args[i], fx.Node) and node.args[i].name in params


def _module(fqn: str) -> str:
    return fqn.rsplit(".", 1)[0] if "." in fqn else fqn


def _stack_path(node: fx.Node) -> str:
    stack = node.meta.get("nn_module_stack") or {}
    return list(stack.values())[-1][0] if stack else ""


def _shape(node: fx.Node) -> tuple:
    val = node.meta.get("val")
    return tuple(val.shape) if isinstance(val, torch.Tensor) else ()


def _ndim(node: fx.Node) -> int:
    return len(_shape(node))


def _out_dim(node: fx.Node, x: fx.Node, dim: int) -> int:
    """The sharded dimension of a broadcasting op's output (right-aligned)."""
    return dim + _ndim(node) - _ndim(x)


def _dim_arg(node: fx.Node, op: str) -> int:
    if op in ("cat", "stack"):
        return node.args[1] if len(node.args) > 1 else node.kwargs.get("dim", 0)
    return node.args[1] if len(node.args) > 1 else 0


def _view_dim(src: tuple, dst: tuple, dim: int, tp: int) -> int | None:
    """Where the sharded dimension ``dim`` of ``src`` lands in ``dst``: the outermost of the dims it is
    split into (whole heads), or the dim it is merged into as the outermost part; None if the split
    leaves a part not divisible by ``tp``."""
    i = j = 0
    while i < len(src) and j < len(dst):
        a, b, gi, gj = src[i], dst[j], [i], [j]
        while a != b:
            if a < b:
                i += 1
                a *= src[i]
                gi.append(i)
            else:
                j += 1
                b *= dst[j]
                gj.append(j)
        if dim in gi:
            if gi[0] != dim:  # the sharded dim is an inner part of a merge: ranks' pieces interleave
                return None
            outer = next((d for d in gj if dst[d] != 1), gj[0])  # the heads, where features split into them
            return outer if dst[outer] % tp == 0 else None
        i, j = i + 1, j + 1
    return None
