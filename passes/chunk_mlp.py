"""Mini-sequence chunking (MST, Luo et al. 2024) of the MLP: ``down(act(up(x)[, gate(x)]))`` in k token
chunks.

Why: in a transformer's backward the MLP's hidden-width values (``[tokens, 4h]`` for a GELU MLP, three of
them for SwiGLU) are the largest working set after the logits; at the least-peak plan the step peaks
there whatever the plan keeps, because the backward needs the recomputed activation, its gradient and
the gradient of the up-projection's output at once. Processed k tokens-chunks at a time, each exists for
one chunk only.

A region is found in the Dynamo graph: a ``linear`` (the down-projection) whose input is computed by
elementwise ops (:data:`POINTWISE`, at least one of them an activation) from the outputs of one or more
``linear`` layers that all read the same input ``x`` (GELU MLP: one; SwiGLU: gate and up). Hugging
Face's ``Conv1D`` (GPT-2: ``addmm(b, x.view(-1, in), W).view(...)``, ``W`` of shape ``[in, out]``) counts as a
linear of ``W.t()`` (:class:`Projection`). Nothing
inside may be read outside it. The region becomes :func:`chunked_mlp`, an autograd Function whose
forward runs the chunks one after the other and keeps only ``x``, and whose backward recomputes each
chunk's up-projections and activation and accumulates the weights' gradients in place with a product op
(an extern kernel: Inductor cannot fuse k weight-sized partial products into one sum, which letting autograd
differentiate a loop of chunks did). The elementwise part is differentiated by autograd, one chunk at a
time, so any activation written as torch ops (Hugging Face's tanh GELU) works.

Between the projections, besides elementwise ops: a dropout that draws nothing (``p`` 0 or not training)
and a split of the features along the last dim (a fused gate-and-up projection, Phi-3's ``gate_up_proj``).
Refused, with the reason in ``why_not``: a random op (dropout) or any other op between the
projections, an intermediate value read elsewhere, up-projections that read different inputs, a tensor
from outside the region that is not a scalar.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.fx as fx
import torch.nn.functional as F
from recompile_opt.passes import precision
from recompile_opt.passes.chunking import LINEAR, value_of

from recompile_opt import ops
from recompile_opt.ops import arguments, op_name

# splits that keep rows whole where they cut the last dimension (:func:`_splits_features`)
_SPLITS = frozenset({"chunk", "split"})
# elementwise ops a chunk may run (by name: Dynamo's graph has no tags): the class less random ops (a chunk
# would draw other numbers than the whole; an MLP with dropout inside is still found, so that a forced
# ``chunks`` names it and says why) and the ops the chunked body was never tried with
POINTWISE = (
    ops.ELEMENTWISE
    - ops.RANDOM
    - {
        "_to_copy",
        "alias",
        "lift_fresh_copy",
        "gelu_",
        "iadd",
        "imul",
        "half",
        "bfloat16",
        "rsqrt",
        "sqrt",
        "clone",
        "contiguous",
        "detach",
        "where",
        "masked_fill",
        "scalar_tensor",
        "logical_not",
        "bitwise_not",
    }
)


@dataclass(frozen=True)
class Projection:
    """A linear layer in a Dynamo graph: ``F.linear(x, weight, bias)``, or Hugging Face's ``Conv1D``,
    ``addmm(bias, x.view(-1, in), weight).view(...)``, whose weight is transposed (``[in, out]``)."""

    out: fx.Node  # the node of the projection's output
    x: fx.Node
    weight: fx.Node
    bias: fx.Node | None
    transposed: bool = False
    inner: tuple = ()  # a Conv1D's flattening view and addmm, before ``out``

    @property
    def nodes(self) -> list[fx.Node]:
        return [*self.inner, self.out]


def projection(node) -> Projection | None:
    """``node`` as a :class:`Projection`, or None."""
    if not isinstance(node, fx.Node):
        return None
    if node.op == "call_function" and node.target in LINEAR:
        kw = arguments(node)
        return Projection(node, kw["input"], kw["weight"], kw["bias"])
    mm = (
        node.args[0]
        if node.op == "call_method" and node.target in ("view", "reshape") and node.args
        else None
    )
    if not (
        isinstance(mm, fx.Node)
        and mm.op == "call_function"
        and mm.target is torch.addmm
        and len(mm.args) == 3
        and not mm.kwargs
    ):
        return None
    bias, flat, weight = mm.args
    if not (
        isinstance(flat, fx.Node)
        and flat.op == "call_method"
        and flat.target == "view"
        and isinstance(flat.args[0], fx.Node)
    ):
        return None
    x, w, out = value_of(flat.args[0]), value_of(weight), value_of(node)
    if x is None or w is None or out is None or w.dim() != 2 or tuple(out.shape[:-1]) != tuple(x.shape[:-1]):
        return None
    return Projection(node, flat.args[0], weight, bias, transposed=True, inner=(flat, mm))


@dataclass
class MLPRegion:
    """One MLP found in a Dynamo graph."""

    down: Projection
    ups: list[Projection] = field(default_factory=list)  # the up-projections (gate first, as read by the act)
    body: list[fx.Node] = field(default_factory=list)  # the elementwise ops between, in graph order
    tokens: int = 0
    hidden: int = 0
    why_not: str | None = None
    width: int = 0  # the input's (model) width
    itemsize: int = 4  # bytes of an element of the input
    up_width: int = 0  # the up-projections' output features, summed (their matmuls' recompute)

    @property
    def name(self) -> str:
        return f"mlp {self.down.out.name}"

    def describe(self, chunks: int) -> str:
        per = math.ceil(self.tokens / chunks)
        return (
            f"{self.name}: MLP ({len(self.ups)} up-projection{'s' * (len(self.ups) > 1)}, hidden "
            f"{self.hidden}) in {chunks} chunks of <= {per} of {self.tokens} tokens, recomputed "
            "chunk by chunk in the backward"
        )

    def record(self, chunks: int) -> dict:
        """The plan's entry; the recompute is the up-projections' matmuls (the activation is free)."""
        return {
            "region": self.name,
            "kind": "mlp",
            "chunks": chunks,
            "tokens": self.tokens,
            "width": self.hidden,
            "recompute_flops": 2 * self.tokens * self.width * self.up_width,
        }


def find_mlp_regions(gm: fx.GraphModule) -> list[MLPRegion]:
    """Every down-projection of ``gm`` fed by an activation of up-projections, each with its parts or
    the reason it cannot be chunked. A linear fed by anything else (attention's out-projection) is no
    candidate and is not listed, nor is an MLP whose up-projection is the down-projection of an MLP
    listed before it (a stack of linears and activations): the two would share that projection, and
    the first one's rewrite replaces it."""
    regions, downs = [], set()
    for node in gm.graph.nodes:
        down = projection(node)
        if down is not None:
            region = _region(down)
            if region is not None and not any(u.out in downs for u in region.ups):
                regions.append(region)
                downs.add(down.out)
    return regions


def _region(down: Projection) -> MLPRegion | None:
    a = down.x
    if not (isinstance(a, fx.Node) and _is_activation(a)) and not _feeds_from_activation(a):
        return None
    region = MLPRegion(down)
    body, ups, stack = set(), {}, [a]
    while stack:
        node = stack.pop()
        if node in body or node in ups:
            continue
        up = projection(node)
        if up is not None:
            ups[node] = up
            continue
        if not _is_pointwise(node):
            return _refuse(
                region,
                f"{node.name} ({op_name(node) or node.target}) between the projections is not an "
                "elementwise op (dropout and other random ops are not chunked)",
            )
        body.add(node)
        for arg in node.all_input_nodes:
            stack.append(arg)
    order = {n: i for i, n in enumerate(down.out.graph.nodes)}
    region.body = sorted(body, key=order.__getitem__)
    region.ups = [ups[n] for n in sorted(ups, key=order.__getitem__)]
    inputs = {u.x for u in region.ups}
    if len(inputs) != 1:
        return _refuse(region, "the up-projections read different inputs")
    x = value_of(next(iter(inputs)))
    out = value_of(a)
    if x is None or out is None:
        return _refuse(region, "shapes unknown")
    region.tokens, region.hidden = math.prod(int(s) for s in x.shape[:-1]), int(out.shape[-1])
    region.width, region.itemsize = int(x.shape[-1]), x.element_size()
    region.up_width = sum(int(value_of(u.out).shape[-1]) for u in region.ups)
    inside = {*body, *down.nodes, *(n for u in region.ups for n in u.nodes)}
    for node in [*region.body, *(n for u in region.ups for n in u.nodes), *down.inner]:
        outside = [u.name for u in node.users if u not in inside]
        if outside:
            return _refuse(region, f"{node.name} is also read by {', '.join(outside)}")
    for node in region.body + [u.out for u in region.ups]:
        vals = node.meta.get("example_value")
        vals = vals if isinstance(vals, tuple) else (value_of(node),)
        if any(not isinstance(v, torch.Tensor) or v.shape[:-1] != out.shape[:-1] for v in vals):
            return _refuse(region, f"{node.name} is not [tokens, ...] like the down-projection's input")
    return region


def _feeds_from_activation(node) -> bool:
    """An elementwise chain ending in an activation (a tanh GELU written as torch ops, ``silu(g) * u``)."""
    seen, stack = set(), [node]
    while stack:
        n = stack.pop()
        if not isinstance(n, fx.Node) or n in seen or not (_is_pointwise(n) or op_name(n) in ops.RANDOM):
            continue
        if _is_activation(n):
            return True
        seen.add(n)
        stack.extend(n.all_input_nodes)
    return False


def _is_activation(node: fx.Node) -> bool:
    return op_name(node) in ops.ACTIVATIONS


def _is_pointwise(node: fx.Node) -> bool:
    """An op the chunks may run row by row: elementwise, a dropout that draws nothing, or a split of a
    fused up-projection's features (Phi-3's ``gate_up_proj(x).chunk(2, dim=-1)``) and its parts."""
    if op_name(node) == "getitem":
        return isinstance(node.args[0], fx.Node) and _splits_features(node.args[0])
    return op_name(node) in POINTWISE or ops.is_idle_dropout(node) or _splits_features(node)


def _splits_features(node: fx.Node) -> bool:
    """``chunk`` / ``split`` (method or function) of a tensor along its last dimension, the only one the
    rows of a chunk keep whole (the body runs on ``[rows, features]``, :func:`_add_body_module`)."""
    if node.op not in ("call_function", "call_method") or op_name(node) not in _SPLITS or not node.args:
        return False
    dim = node.kwargs.get("dim", node.args[2] if len(node.args) > 2 else 0)
    val = value_of(node.args[0])
    return val is not None and isinstance(dim, int) and dim in (-1, val.dim() - 1)


def _refuse(region: MLPRegion, why: str) -> MLPRegion:
    region.why_not = why
    return region


def chunk_mlp(gm: fx.GraphModule, region: MLPRegion, chunks: int) -> fx.Node:
    """Rewrite ``region`` of ``gm`` as :func:`chunked_mlp` over ``chunks`` chunks; returns the new node.
    The elementwise body becomes a submodule of ``gm`` (``chunked_mlp_act_<i>``) the chunks call."""
    if region.why_not is not None:
        raise ValueError(f"{region.name} cannot be chunked: {region.why_not}")
    act_name = _add_body_module(gm, region)
    graph, down = gm.graph, region.down
    with graph.inserting_before(down.out):
        act = graph.get_attr(act_name)
        # a Conv1D's weight as a linear's: a transposed view, which autograd differentiates
        weights = tuple(
            graph.call_function(torch.t, (p.weight,)) if p.transposed else p.weight
            for p in (*region.ups, down)
        )
        biases = tuple(p.bias for p in region.ups)
        new = graph.call_function(
            chunked_mlp,
            (region.ups[0].x, weights[:-1], biases, weights[-1], down.bias, act),
            {"chunks": chunks, "mm_dtypes": mlp_dtypes(region)},
        )
    new.meta = dict(down.out.meta)
    down.out.replace_all_uses_with(new)
    for node in [
        *reversed(down.nodes),
        *reversed(region.body),
        *(n for u in reversed(region.ups) for n in reversed(u.nodes)),
    ]:
        graph.erase_node(node)
    gm.recompile()
    return new


def _add_body_module(gm: fx.GraphModule, region: MLPRegion) -> str:
    """The elementwise body as a GraphModule of the up-projections' outputs."""
    body = fx.Graph()
    env = {up.out: body.placeholder(f"up_{i}") for i, up in enumerate(region.ups)}
    for node in region.body:
        env[node] = body.node_copy(node, env.__getitem__)
        if _splits_features(node):  # the chunk's rows are [rows, features]: the last dim is -1
            env[node].args, env[node].kwargs = env[node].args[:2], {**node.kwargs, "dim": -1}
    body.output(env[region.down.x])
    i = 0
    while hasattr(gm, f"chunked_mlp_act_{i}"):
        i += 1
    name = f"chunked_mlp_act_{i}"
    gm.add_submodule(name, fx.GraphModule(torch.nn.Module(), body))
    return name


def mlp_dtypes(region: MLPRegion) -> tuple[torch.dtype, ...]:
    """The dtypes of the region's matmuls as eager gives them, read off Dynamo's example values (bf16
    under bf16 autocast): each up-projection's, then the down-projection's."""
    return tuple(value_of(p.out).dtype for p in (*region.ups, region.down))


def chunked_mlp(
    x,
    up_weights,
    up_biases,
    down_weight,
    down_bias,
    act,
    *,
    chunks: int,
    mm_dtypes: tuple[torch.dtype, ...] | None = None,
):
    """``linear(act(*[linear(x, w, b) for w, b in ups]), down_weight, down_bias)`` over ``chunks`` token
    chunks, recomputed chunk by chunk in the backward (:class:`_ChunkedMLP`); each projection's matmul in
    its ``mm_dtypes`` entry (default: the input's dtype), the activation under the autocast state of the
    call, as eager runs them."""
    tokens = x.reshape(-1, x.shape[-1])
    mm_dtypes = mm_dtypes or (x.dtype,) * (len(up_weights) + 1)
    out = _ChunkedMLP.apply(tokens, down_weight, down_bias, act, chunks, mm_dtypes, *up_weights, *up_biases)
    return out.view(*x.shape[:-1], out.shape[-1])


class _ChunkedMLP(torch.autograd.Function):
    """The chunks one after the other, only ``x`` kept; the backward recomputes each chunk. Autocast is
    off inside but for the activation, which runs under the forward's autocast state; the matmuls cast
    to their eager dtypes, the weights' gradients summed over the chunks in fp32 and rounded once
    (:mod:`recompile_opt.passes.precision`)."""

    @staticmethod
    def forward(ctx, tokens, down_weight, down_bias, act, chunks, mm_dtypes, *up_params):
        n_up = len(mm_dtypes) - 1
        device = tokens.device.type
        ctx.autocast = precision.autocast_state(device)
        ctx.act, ctx.chunks, ctx.mm_dtypes = act, chunks, mm_dtypes
        ctx.has_bias = [b is not None for b in up_params[n_up:]], down_bias is not None
        ctx.save_for_backward(tokens, down_weight, down_bias, *up_params)
        with precision.autocast_off(device):
            ups = _cast_params(up_params, mm_dtypes[:-1])
            down_w, down_b = (_cast(p, mm_dtypes[-1]) for p in (down_weight, down_bias))
            outs = []
            for c in tokens.tensor_split(chunks):
                hidden = [F.linear(c.to(dt), w, b) for (w, b), dt in zip(ups, mm_dtypes)]
                with precision.autocast_as(device, ctx.autocast):
                    activated = act(*hidden)
                outs.append(F.linear(activated.to(mm_dtypes[-1]), down_w, down_b))
        return torch.cat(outs)

    @staticmethod
    def backward(ctx, grad_out):
        tokens, down_weight, down_bias, *up_params = ctx.saved_tensors
        mm_dtypes, device = ctx.mm_dtypes, tokens.device.type
        with precision.autocast_off(device):
            return _ChunkedMLPBackward(ctx, tokens, down_weight, down_bias, up_params).run(
                grad_out.to(mm_dtypes[-1])
            )


def _cast(tensor, dtype):
    return None if tensor is None else tensor.to(dtype)


def _cast_params(up_params, dtypes) -> list[tuple]:
    """The up-projections' ``(weight, bias)`` in their matmuls' dtypes."""
    n = len(dtypes)
    return [(_cast(w, dt), _cast(b, dt)) for w, b, dt in zip(up_params[:n], up_params[n:], dtypes)]


class _ChunkedMLPBackward:
    """One backward of :class:`_ChunkedMLP`: per chunk, the up-projections and the activation again,
    the activation's gradient by autograd, and the weights' gradients accumulated with matmuls only
    (Inductor fuses pointwise sums of k chunk gradients into one kernel that reads all k alive)."""

    def __init__(self, ctx, tokens, down_weight, down_bias, up_params):
        self.ctx, self.tokens, self.mm_dtypes = ctx, tokens, ctx.mm_dtypes
        self.down_weight, self.down_bias = down_weight, down_bias
        n_up = len(self.mm_dtypes) - 1
        self.weights, self.biases = up_params[:n_up], up_params[n_up:]
        self.ups = _cast_params(up_params, self.mm_dtypes[:-1])
        self.down_w = down_weight.to(self.mm_dtypes[-1])

    def run(self, grad_out):
        ctx, dts = self.ctx, self.mm_dtypes
        up_bias, down_has_bias = ctx.has_bias
        grad_down = precision.accumulator(self.down_weight, dts[-1])
        grad_ups = [precision.accumulator(w, dt) for w, dt in zip(self.weights, dts)]
        grad_up_biases = [
            precision.accumulator(b, dt) if has else None for b, dt, has in zip(self.biases, dts, up_bias)
        ]
        # the down-projection's bias too, summed from each chunk's gradient as an extern kernel reads it
        # (Inductor fused a whole-length sum into the kernel making the gradient, before its rounding)
        grad_down_bias = precision.accumulator(self.down_bias, dts[-1]) if down_has_bias else None
        grad_tokens = []
        for x_c, g_c in zip(self.tokens.tensor_split(ctx.chunks), grad_out.tensor_split(ctx.chunks)):
            xs = [x_c.to(dt) for dt in dts[:-1]]
            hidden, activated = self._recompute(xs)
            grad_down = precision.add_transposed_product(grad_down, g_c, activated.detach().to(dts[-1]))
            if down_has_bias:
                grad_down_bias = add_column_sums(grad_down_bias, g_c)
            grad_activated = (g_c @ self.down_w).to(activated.dtype)
            grad_hidden = torch.autograd.grad(activated, hidden, grad_activated)
            grad_x = None
            for i, (g_h, x_mm, (w, _)) in enumerate(zip(grad_hidden, xs, self.ups)):
                g_h = g_h.to(dts[i])
                grad_ups[i] = precision.add_transposed_product(grad_ups[i], g_h, x_mm)
                if up_bias[i]:
                    grad_up_biases[i] = add_column_sums(grad_up_biases[i], g_h)
                grad_x = _add_input_gradient(grad_x, g_h, w, self.tokens.dtype)
            grad_tokens.append(grad_x)
        grad_down_bias = (
            precision.rounded(grad_down_bias, dts[-1], self.down_bias.dtype) if down_has_bias else None
        )
        weights = [precision.rounded(g, dt, w.dtype) for g, w, dt in zip(grad_ups, self.weights, dts)]
        biases = [
            None if g is None else precision.rounded(g, dt, b.dtype)
            for g, b, dt in zip(grad_up_biases, self.biases, dts)
        ]
        return (
            torch.cat(grad_tokens),
            precision.rounded(grad_down, dts[-1], self.down_weight.dtype),
            grad_down_bias,
            None,
            None,
            None,
            *weights,
            *biases,
        )

    def _recompute(self, xs):
        """The chunk's up-projections (leaves for autograd) and its activation, as the forward ran them."""
        with torch.enable_grad():
            hidden = [F.linear(x, w, b).detach().requires_grad_() for x, (w, b) in zip(xs, self.ups)]
            with precision.autocast_as(self.tokens.device.type, self.ctx.autocast):
                activated = self.ctx.act(*hidden)
        return hidden, activated


def _add_input_gradient(total, g_h, w, dtype):
    """``total + (g_h @ w)`` in the input's ``dtype``: each up-projection's product rounded and cast
    back on its own, then summed, as autograd sums the gradients of an input read twice."""
    part = (g_h @ w).to(dtype)
    return part if total is None else total + part


def add_column_sums(total: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
    """``total + grad.sum(0)`` as a matrix product with a row of ones, accumulated in ``total``'s dtype.
    Why: summed as a reduction, Inductor fuses the k chunks' bias-gradient sums into one kernel
    that reads every chunk's gradient, so all k are alive at once (seen in the generated code of a
    chunked MLP's backward); a matmul is an extern kernel that runs alone, one chunk at a time."""
    ones = grad.new_ones(grad.shape[0], 1)
    return precision.add_transposed_product(total, ones, grad)
