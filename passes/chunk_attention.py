"""Chunked attention (Rabe & Staats 2021, "Self-attention Does Not Need O(n^2) Memory", without their
key chunking): ``softmax(mask(scale(q @ k^T))) [-> dropout] @ v`` in k chunks of the queries.

Why: where a graph materialises the probabilities ``[b, heads, s, s]`` (explicit attention, SDPA's math
path on the CPU with dropout), the backward holds several of them at once (the scores recomputed or
kept, the probabilities, the dropout mask, their gradients). Each query chunk's softmax runs over all the
keys, so each chunk is exact as it is (no online softmax); processed k chunks of queries at a time, each
``[b, heads, s / k, s]`` exists for one chunk only.

A region is found in the Dynamo graph: a ``softmax`` over the last dim whose input is computed by
elementwise ops (scale, mask add, ``masked_fill``, ``where``, casts) from one batched matmul of its shape
(the scores ``a @ b``), and whose output, through casts and at most one ``dropout``, is the left operand of
a second matmul (``@ v``); or a ``scaled_dot_product_attention`` call where torch runs its math path (on
the CPU with dropout, :func:`recompile_opt.passes.meta_attention.runs_math_path`). It becomes
:func:`chunked_attention`, an autograd Function whose forward runs the chunks one after the other and keeps
``a``, ``b``, ``v`` (contiguous copies), the masks and the dropout's keep-mask, and whose backward
recomputes each chunk's scores and probabilities, differentiates the elementwise part and the softmax
by autograd (any mask written as torch ops works) and accumulates the gradients of ``b`` and ``v`` with
one in-place product op a chunk (``precision.add_transposed_product_``: Inductor writes each into the
accumulator's own buffer; pointwise sums of k chunk gradients it fused into one kernel that held all k,
see ``chunk_mlp``).

Dropout: the keep-mask is drawn whole in the forward, once, as eager's ``dropout`` draws it (``bernoulli_``
on a tensor of the probabilities' shape and dtype: the same numbers from the same generator state), and
kept as bool (1 byte an element); the planner may instead replay it in the backward from a saved RNG state,
as any random op. Each chunk applies its rows.

Refused, with the reason in ``why_not``: a value inside read elsewhere, a mask or bias that needs a
gradient, operands whose batch dims broadcast, mixed dtypes (autocast), an SDPA call that runs a fused
kernel (no ``[b, heads, s, s]`` exists to chunk).
"""

from __future__ import annotations

import math
import operator
from dataclasses import dataclass, field

import torch
import torch.fx as fx
from recompile_opt.passes import meta_attention, precision
from recompile_opt.passes.chunking import value_of

from recompile_opt import ops
from recompile_opt.ops import arguments, op_name

# the ops between the scores and the softmax: elementwise, not random
_SCORE_OPS = ops.ELEMENTWISE - ops.RANDOM
_SDPA_ARGS = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")
_SDPA_DEFAULTS = (None, 0.0, False, None, False)


@dataclass
class AttentionRegion:
    """One attention found in a Dynamo graph: ``probs = body(a @ b, *externals)``, ``out = dropout(probs)
    @ v``; for an SDPA call, ``a, b, v`` are its query, key and value and ``sdpa`` its other arguments."""

    out: fx.Node  # the region's result: the second matmul, or the SDPA call
    scores: fx.Node | None = None  # explicit: the first matmul, ``a @ b``
    a: fx.Node | None = None
    b: fx.Node | None = None
    v: fx.Node | None = None
    nodes: list[fx.Node] = field(default_factory=list)  # explicit: the region's nodes in graph order
    body: list[fx.Node] = field(default_factory=list)  # explicit: scores to probabilities, dropout left out
    externals: list[fx.Node] = field(default_factory=list)  # tensors the body reads besides the scores
    dropout_p: float = 0.0
    sdpa: dict | None = None
    shape: tuple = ()  # the probabilities' [..., queries, keys]
    head_dim: int = 0
    itemsize: int = 4
    why_not: str | None = None

    @property
    def name(self) -> str:
        return f"attention {self.out.name}"

    @property
    def tokens(self) -> int:
        """Rows of the probabilities (batch x heads x queries): their full tensors are tokens x keys."""
        return math.prod(self.shape[:-1])

    @property
    def queries(self) -> int:
        return self.shape[-2]

    @property
    def keys(self) -> int:
        return self.shape[-1]

    def describe(self, chunks: int) -> str:
        per = math.ceil(self.queries / chunks)
        kind = "SDPA's math path" if self.sdpa is not None else "explicit"
        dropout = (
            f"; dropout's keep-mask drawn whole in the forward and kept as bool ({math.prod(self.shape)} "
            "B) unless the plan replays it"
            if self.dropout_p
            else ""
        )
        return (
            f"{self.name}: attention ({kind}, probabilities {list(self.shape)}) in {chunks} chunks of <= "
            f"{per} of {self.queries} queries, scores and softmax recomputed chunk by chunk in the "
            f"backward{dropout}"
        )

    def record(self, chunks: int) -> dict:
        """The plan's entry; the recompute is the scores' matmul (the softmax is memory-bound)."""
        return {
            "region": self.name,
            "kind": "attention",
            "chunks": chunks,
            "tokens": self.tokens,
            "width": self.keys,
            "recompute_flops": 2 * math.prod(self.shape) * self.head_dim,
            "dropout_mask_bytes": math.prod(self.shape) if self.dropout_p else 0,
        }


def find_attention_regions(gm: fx.GraphModule) -> list[AttentionRegion]:
    """Every attention of ``gm`` (a softmax between two matmuls, or an SDPA call), each with its parts
    or the reason it cannot be chunked. A softmax that is not between two matmuls is not listed."""
    regions = []
    for node in gm.graph.nodes:
        name = op_name(node)
        region = _explicit(node) if name in ops.SOFTMAX else _sdpa(node) if name in ops.SDPA else None
        if region is not None:
            regions.append(region)
    return regions


def _softmax_dim(node: fx.Node):
    if len(node.args) > 1:
        return node.args[1]
    return node.kwargs.get("dim")


def _explicit(softmax: fx.Node) -> AttentionRegion | None:
    x = value_of(softmax)
    if x is None or x.dim() < 3 or _softmax_dim(softmax) not in (-1, x.dim() - 1):
        return None
    up, matmuls, stack = set(), [], [softmax.args[0]]
    while stack:  # elementwise ops up from the softmax's input, to matmuls of its shape
        node = stack.pop()
        if not isinstance(node, fx.Node) or node in up or node in matmuls:
            continue
        val = value_of(node)
        if op_name(node) in ops.MATMULS and val is not None and val.shape == x.shape:
            matmuls.append(node)
        elif op_name(node) in _SCORE_OPS:
            up.add(node)
            stack.extend(node.all_input_nodes)
    if len(matmuls) != 1:
        return None
    scores = matmuls[0]
    body, stack = set(), [scores]  # the ops of `up` that read the scores
    while stack:
        for user in stack.pop().users:
            if user in up and user not in body:
                body.add(user)
                stack.append(user)
    if softmax.args[0] is not scores and softmax.args[0] not in body:
        return None
    chain, dropout, node = [softmax], None, softmax
    while len(node.users) == 1:
        (user,) = node.users
        if not (user.args and user.args[0] is node):
            break
        if op_name(user) in ops.CASTS and dropout is None:
            chain.append(user)
        elif op_name(user) == "dropout" and dropout is None:
            dropout = user
        else:
            break
        node = user
    pv = next((u for u in node.users if op_name(u) in ops.MATMULS and u.args[0] is node), None)
    if pv is None:
        return None
    order = {n: i for i, n in enumerate(softmax.graph.nodes)}
    a, b = scores.args[:2] if len(scores.args) == 2 else (None, None)
    region = AttentionRegion(pv, scores, a, b, pv.args[1], shape=tuple(int(s) for s in x.shape))
    region.body = sorted(body, key=order.__getitem__) + chain
    region.nodes = sorted({scores, *region.body, pv, *([dropout] if dropout else [])}, key=order.__getitem__)
    inside = set(region.nodes)
    region.externals = list(
        dict.fromkeys(a for n in region.body for a in n.all_input_nodes if a not in inside)
    )
    for n in region.nodes[:-1]:
        outside = [u.name for u in n.users if u not in inside]
        if outside:
            return _refuse(region, f"{n.name} is also read by {', '.join(outside)}")
    if dropout is not None:
        why = _dropout_p(region, dropout)
        if why:
            return _refuse(region, why)
    return _check(region, [value_of(n) for n in (region.a, region.b, region.v, scores, softmax, pv)])


def _dropout_p(region: AttentionRegion, dropout: fx.Node) -> str | None:
    kw = arguments(dropout)
    p, training, inplace = kw["p"], kw["training"], kw["inplace"]
    if not isinstance(p, (int, float)) or not isinstance(training, bool) or inplace is not False:
        return f"{dropout.name}: a dropout whose p or training is not a constant, or in place"
    region.dropout_p = float(p) if training else 0.0
    return None


def _check(region: AttentionRegion, values: list) -> AttentionRegion:
    """Shapes and dtypes the chunked op assumes: ``a [.., L, d]``, ``b [.., d, S]``, ``v [.., S, e]`` of
    one batch shape and one dtype; masks that need no gradient and broadcast over the query chunks."""
    if any(v is None for v in values):
        return _refuse(region, "shapes unknown")
    a, b, v, *_ = values
    region.head_dim, region.itemsize = int(a.shape[-1]), a.element_size()
    batch = tuple(region.shape[:-2])
    if any(tuple(t.shape[:-2]) != batch for t in (a, b, v)):
        return _refuse(region, "the operands' batch dims broadcast (chunked only where they are equal)")
    if len({t.dtype for t in values}) != 1:
        return _refuse(region, "mixed dtypes (autocast) are not chunked yet")
    for node in region.externals:
        e = value_of(node)
        if e is None:
            return _refuse(region, f"{node.name}: shape unknown")
        if e.requires_grad:
            return _refuse(region, f"{node.name} (a mask or bias) needs a gradient")
        if e.dim() >= 2 and e.shape[-2] not in (1, region.queries):
            return _refuse(region, f"{node.name} does not broadcast over chunks of the queries")
    return region


def _sdpa(node: fx.Node) -> AttentionRegion:
    given = dict(zip(_SDPA_ARGS, node.args))
    given.update(node.kwargs)
    args = {**dict(zip(_SDPA_ARGS[3:], _SDPA_DEFAULTS)), **given}
    q, k, v = (value_of(args[n]) for n in _SDPA_ARGS[:3])
    region = AttentionRegion(node, None, args["query"], args["key"], args["value"], sdpa=args)
    if q is None or k is None or v is None or q.dim() < 3:
        return _refuse(region, "shapes unknown")
    region.shape = (*(int(s) for s in q.shape[:-1]), int(k.shape[-2]))
    region.head_dim, region.itemsize = int(q.shape[-1]), q.element_size()
    consts = [args[n] for n in ("dropout_p", "is_causal", "scale", "enable_gqa")]
    if any(isinstance(c, fx.Node) for c in consts):
        return _refuse(region, "dropout_p, is_causal, scale or enable_gqa is not a constant")
    region.dropout_p = float(args["dropout_p"])
    if not meta_attention.runs_math_path(q, k, v, region.dropout_p):
        return _refuse(
            region, f"on {q.device.type} SDPA runs a fused kernel here: no [b, heads, s, s] to chunk"
        )
    if {q.dtype, k.dtype, v.dtype} != {torch.float32}:
        return _refuse(region, "SDPA's math path is chunked in fp32 only (its upcasts are not reproduced)")
    mask = value_of(args["attn_mask"])
    if mask is not None and mask.requires_grad:
        return _refuse(region, "the attention mask needs a gradient")
    if k.shape[-3] != q.shape[-3] and not (args["enable_gqa"] and q.shape[-3] % k.shape[-3] == 0):
        return _refuse(region, "query and key heads differ without enable_gqa")
    if tuple(q.shape[:-3]) != tuple(k.shape[:-3]) or tuple(k.shape[:-3]) != tuple(v.shape[:-3]):
        return _refuse(region, "the operands' batch dims broadcast (chunked only where they are equal)")
    return region


def _refuse(region: AttentionRegion, why: str) -> AttentionRegion:
    region.why_not = why
    return region


def chunk_attention(gm: fx.GraphModule, region: AttentionRegion, chunks: int) -> fx.Node:
    """Rewrite ``region`` of ``gm`` as :func:`chunked_attention` over ``chunks`` query chunks; returns the
    new node. The body becomes a submodule of ``gm`` (``chunked_attention_body_<i>``)."""
    if region.why_not is not None:
        raise ValueError(f"{region.name} cannot be chunked: {region.why_not}")
    graph = gm.graph
    with graph.inserting_before(region.out):
        if region.sdpa is None:
            a, b, v, externals, body = region.a, region.b, region.v, region.externals, _body_module(region)
        else:
            a, b, v, externals, body = _sdpa_operands(graph, region)
        name = _add_submodule(gm, body)
        new = graph.call_function(
            chunked_attention,
            (a, b, v, graph.get_attr(name), tuple(externals)),
            {"chunks": chunks, "dropout_p": region.dropout_p},
        )
    new.meta = dict(region.out.meta)
    region.out.replace_all_uses_with(new)
    for node in reversed(region.nodes or [region.out]):
        graph.erase_node(node)
    gm.recompile()
    return new


def _body_module(region: AttentionRegion) -> fx.GraphModule:
    """The ops from the scores to the probabilities as a GraphModule of (scores, *externals)."""
    body = fx.Graph()
    env = {region.scores: body.placeholder("scores")}
    env.update({e: body.placeholder(f"external_{i}") for i, e in enumerate(region.externals)})
    for node in region.body:
        env[node] = body.node_copy(node, env.__getitem__)
    body.output(env[region.body[-1]])
    return fx.GraphModule(torch.nn.Module(), body)


def _sdpa_operands(graph: fx.Graph, region: AttentionRegion):
    """An SDPA call's math path as the chunked op's operands: grouped K and V repeated to the query's
    heads, K transposed, the causal mask made (top-left aligned, as torch's), and its body: the scores
    scaled, masked, softmax."""
    args = region.sdpa
    q, k = value_of(args["query"]), value_of(args["key"])
    key, value = args["key"], args["value"]
    groups = q.shape[-3] // k.shape[-3]
    if groups > 1:
        key, value = (graph.call_method("repeat_interleave", (t, groups, -3)) for t in (key, value))
    b = graph.call_method("transpose", (key, -2, -1))
    scale = args["scale"] if args["scale"] is not None else 1 / math.sqrt(q.shape[-1])
    masks = []
    if args["is_causal"]:
        ones = graph.call_function(
            torch.ones, (region.queries, region.keys), {"dtype": torch.bool, "device": q.device}
        )
        masks.append((graph.call_method("tril", (ones,)), True))
    mask = value_of(args["attn_mask"])
    if mask is not None:
        masks.append((args["attn_mask"], mask.dtype == torch.bool))
    return (
        args["query"],
        b,
        value,
        [m for m, _ in masks],
        _sdpa_body(scale, [boolean for _, boolean in masks]),
    )


def _sdpa_body(scale: float, boolean: list[bool]) -> fx.GraphModule:
    """``softmax(scores * scale`` with each mask applied ``, -1)``: a bool mask keeps where True, a float
    one is added (SDPA's math path)."""
    g = fx.Graph()
    x = g.call_function(operator.mul, (g.placeholder("scores"), scale))
    for i, is_bool in enumerate(boolean):
        m = g.placeholder(f"mask_{i}")
        if is_bool:
            x = g.call_method("masked_fill", (x, g.call_function(operator.invert, (m,)), -math.inf))
        else:
            x = g.call_function(operator.add, (x, m))
    g.output(g.call_function(torch.softmax, (x, -1)))
    return fx.GraphModule(torch.nn.Module(), g)


def _add_submodule(gm: fx.GraphModule, body: fx.GraphModule) -> str:
    i = 0
    while hasattr(gm, f"chunked_attention_body_{i}"):
        i += 1
    gm.add_submodule(f"chunked_attention_body_{i}", body)
    return f"chunked_attention_body_{i}"


def chunked_attention(a, b, v, body, externals=(), *, chunks: int, dropout_p: float = 0.0):
    """``dropout(body(a @ b, *externals), dropout_p) @ v`` over ``chunks`` chunks of ``a``'s rows (the
    queries), recomputed chunk by chunk in the backward (:class:`_ChunkedAttention`). The dropout's
    keep-mask is drawn whole, as eager's ``dropout`` draws it on the probabilities."""
    return _ChunkedAttention.apply(a, b, v, body, chunks, dropout_p, *externals)


def keep_mask(shape, p: float, like: torch.Tensor) -> torch.Tensor:
    """Eager's dropout mask for a tensor of ``shape`` like ``like``, as bool: CPU ``dropout`` draws
    ``empty_like(x).bernoulli_(1 - p)`` (``native_dropout`` the same), so this draws the same numbers
    from the same generator state."""
    return torch.empty(shape, dtype=like.dtype, device=like.device).bernoulli_(1 - p).bool()


def _dropped(probs, keep, p: float):
    """``probs`` through the dropout of ``keep``: kept elements scaled by ``1 / (1 - p)``, as eager's."""
    return probs * (keep.to(probs.dtype) / (1 - p))


def _row_chunks(rows: int, chunks: int) -> list[slice]:
    """``tensor_split``'s chunks of ``rows`` as slices (the first ``rows % chunks`` one longer)."""
    cuts = [0]
    for i in range(chunks):
        cuts.append(cuts[-1] + rows // chunks + (i < rows % chunks))
    return [slice(lo, hi) for lo, hi in zip(cuts, cuts[1:]) if hi > lo]


def _rows(externals, rows: slice, queries: int) -> list:
    """Each mask's rows of one query chunk (a mask broadcast over the queries as it is)."""
    return [e[..., rows, :] if e.dim() >= 2 and e.shape[-2] == queries else e for e in externals]


def _flat(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1, *t.shape[-2:])


def _operands(a, b, v):
    """The three operands contiguous, each copied once for all chunks, in the forward; the backward reads
    these copies. Why once: a view of them that a batched matmul cannot read (the heads of a fused QKV
    projection) is copied per chunk otherwise, and Inductor fuses the k copies of one source into one
    kernel, so all k are alive through the loop (the demo GPT's chunked backward held 4 copies each of
    K, K^T and V, 10 of its 15 MiB of temporaries). Why saved: copied again in the backward from the
    saved views, the copies were alive there beside the projection they view (3 MiB of the demo GPT's
    attention backward); saved, the plan keeps them or recomputes them, the projection freed once
    copied."""
    return a.contiguous(), b.contiguous(), v.contiguous()


class _ChunkedAttention(torch.autograd.Function):
    """The query chunks one after the other; kept: ``a``, ``b``, ``v`` (contiguous: :func:`_operands`),
    the masks and the keep-mask.
    The backward recomputes each chunk's probabilities and accumulates the gradients of ``b`` and ``v``
    in place (:func:`precision.add_transposed_product`, in fp32 where they are narrower)."""

    @staticmethod
    def forward(ctx, a, b, v, body, chunks, p, *externals):
        shape, queries = (*a.shape[:-1], b.shape[-1]), a.shape[-2]
        keep = keep_mask(shape, p, v) if p > 0 else None
        a, b, v = _operands(a, b, v)
        outs = []
        for rows in _row_chunks(queries, chunks):
            probs = body(a[..., rows, :] @ b, *_rows(externals, rows, queries))
            if keep is not None:
                probs = _dropped(probs, keep[..., rows, :], p)
            outs.append(probs @ v)
        ctx.body, ctx.chunks, ctx.p = body, chunks, p
        ctx.save_for_backward(a, b, v, keep, *externals)
        return torch.cat(outs, -2)

    @staticmethod
    def backward(ctx, grad_out):
        a, b, v, keep, *externals = ctx.saved_tensors
        queries, acc = a.shape[-2], torch.promote_types(a.dtype, torch.float32)
        grad_b = _flat(b).new_zeros(_flat(b).shape, dtype=acc)
        grad_v = _flat(v).new_zeros(_flat(v).shape, dtype=acc)
        grad_a = []
        for rows in _row_chunks(queries, ctx.chunks):
            a_c, g_c = a[..., rows, :], grad_out[..., rows, :].contiguous()  # one copy, two readers
            with torch.enable_grad():
                scores = (a_c @ b).detach().requires_grad_()
                probs = ctx.body(scores, *_rows(externals, rows, queries))
            dropped = probs.detach() if keep is None else _dropped(probs.detach(), keep[..., rows, :], ctx.p)
            grad_v = precision.add_transposed_product(grad_v, _flat(dropped), _flat(g_c))
            grad_probs = g_c @ v.transpose(-2, -1)
            if keep is not None:
                grad_probs = _dropped(grad_probs, keep[..., rows, :], ctx.p)
            (grad_scores,) = torch.autograd.grad(probs, scores, grad_probs.to(probs.dtype))
            grad_scores = grad_scores.to(a.dtype)
            grad_a.append(grad_scores @ b.transpose(-2, -1))
            grad_b = precision.add_transposed_product(grad_b, _flat(a_c), _flat(grad_scores))
        return (
            torch.cat(grad_a, -2),
            grad_b.to(b.dtype).view(b.shape),
            grad_v.to(v.dtype).view(v.shape),
            None,
            None,
            None,
            *(None for _ in externals),
        )
