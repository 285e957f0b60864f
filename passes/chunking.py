"""Mini-sequence chunking (Luo et al. 2024, "Mini-Sequence Transformer") of the LM head and its loss.

Why: at the least-peak plan of a language model the step peaks at the loss, where the logits
``[tokens, vocab]``, their log-softmax and their gradient each exist at full length, whatever the plan
keeps; they grow with the vocabulary (Llama 3: 128k). Cut the tokens into k chunks and each of them
exists for one chunk at a time.

A region is ``linear(x, W[, b])`` followed only by ops that keep the token order (``view`` / ``reshape``
to ``[tokens, vocab]``, ``float`` / ``to`` / ``contiguous``) or select tokens before any reshape (a
causal LM's ``logits[:, :-1]``: moved onto ``x``, since the head is row-wise) into
``F.cross_entropy(logits, target)`` with a ``mean`` or ``sum`` reduction. The rewrite runs on the Dynamo
graph, before AOTAutograd: the region becomes :func:`chunked_linear_cross_entropy`, a loop over
``tensor_split`` chunks of the tokens (k need not divide them) that sums each chunk's summed loss and divides
by the count of counted tokens (``mean`` with ``ignore_index`` exactly, up to the order of the float sums).
Each chunk computes its loss and its gradients in the forward (:class:`_ChunkedHeadLoss`, Liger's way), so the
backward only scales them; or (``recompute=True``, MST's way, :class:`_RecomputedHeadLoss`) the forward
computes the loss only and the backward runs the chunks again for the gradients: twice the head's logits, but
no gradient held from the forward to the backward, which matters where more of the forward runs after the loss
(:attr:`LossRegion.last`). The chunks' head matmuls are separate extern kernels, so Inductor cannot fuse them
back into one full-length buffer.

Refused, with the reason in the region's ``why_not``: logits read anywhere else (returned, or a second
loss: the head would be computed twice), class weights, a reduction of ``none``, inputs that are not
``[tokens, vocab]`` / ``[tokens]``.
"""

from __future__ import annotations

import math
import operator
from dataclasses import dataclass

import torch
import torch.fx as fx
import torch.nn.functional as F
from recompile_opt.passes import loss_body, precision

from recompile_opt import _torch_internals as ti
from recompile_opt.costs.cost_model import register_traffic_formula, tensor_bytes
from recompile_opt.ops import arguments

LINEAR = {F.linear, torch._C._nn.linear}
_CROSS_ENTROPY = {F.cross_entropy}
_ORDER_KEEPING_METHODS = {"view", "reshape", "flatten"}  # reshapes; casts: float, to, contiguous
_ORDER_KEEPING_FUNCTIONS = {torch.reshape, torch.flatten}
_REDUCTIONS = ("mean", "sum")


@dataclass
class LossRegion:
    """One LM head + cross-entropy found in a Dynamo graph."""

    loss: fx.Node  # the cross_entropy call
    linear: fx.Node | None  # the head's linear (None: not found)
    chain: list[fx.Node]  # from the linear's output to the loss's input, in order
    tokens: int
    vocab: int
    why_not: str | None = None  # why it cannot be chunked
    width: int = 0  # the head's input width (hidden size)
    itemsize: int = 4  # bytes of an element of the head's input
    last: bool = True  # nothing but scalar ops runs after the loss in the forward
    device: str | None = None  # the logits' device type (None: unknown)

    @property
    def name(self) -> str:
        return f"loss {self.loss.name}"

    def describe(self, chunks: int, recompute: bool = False, fused: bool = False) -> str:
        per = math.ceil(self.tokens / chunks)
        return (
            f"{self.name}: LM head + cross-entropy in {chunks} chunks of <= {per} of {self.tokens} "
            f"tokens (vocabulary {self.vocab}): logits, log-softmax and their gradient one chunk "
            "at a time, "
            + ("the head recomputed in the backward" if recompute else "the gradients made in the forward")
            + (", each chunk's softmax and gradient in Inductor's fused kernels" if fused else "")
        )

    def record(self, chunks: int, recompute: bool = False, fused: bool = False) -> dict:
        """The plan's entry: the gradients made in the forward (nothing recomputed), or the head's
        logits recomputed in the backward; ``fused``: the body's kernels (:mod:`.loss_body`)."""
        return {
            "region": self.name,
            "kind": "loss_recompute" if recompute else "loss",
            "chunks": chunks,
            "tokens": self.tokens,
            "width": self.vocab,
            "recompute_flops": 2 * self.tokens * self.width * self.vocab if recompute else 0,
            "body": "fused" if fused else "aten",
        }


def find_loss_regions(gm: fx.GraphModule) -> list[LossRegion]:
    """Every cross-entropy call of ``gm``, each with its head or the reason it cannot be chunked."""
    return [_region(n) for n in gm.graph.nodes if n.op == "call_function" and n.target in _CROSS_ENTROPY]


def chunk_loss(
    gm: fx.GraphModule, region: LossRegion, chunks: int, recompute: bool = False, fused: bool = False
) -> fx.Node:
    """Rewrite ``region`` of ``gm`` as ``chunks`` serial chunks (``recompute``: the head recomputed in
    the backward; ``fused``: each chunk's loss body compiled by Inductor, :mod:`.loss_body`); returns
    the new loss node."""
    if region.why_not is not None:
        raise ValueError(f"{region.name} cannot be chunked: {region.why_not}")
    x, weight, bias = _linear_args(region.linear)
    target = _ce_arg(region.loss, "target")
    kwargs = {
        "chunks": chunks,
        **region_dtypes(region),
        "ignore_index": _ce_arg(region.loss, "ignore_index", -100),
        "reduction": _ce_arg(region.loss, "reduction", "mean"),
        "label_smoothing": _ce_arg(region.loss, "label_smoothing", 0.0),
        "recompute": recompute,
        "fused": fused,
    }
    graph = gm.graph
    with graph.inserting_before(region.loss):
        for node in region.chain:  # the head is row-wise: select the tokens before it
            if _selects_tokens(node):
                x = graph.call_function(operator.getitem, (x, node.args[1]))
        new = graph.call_function(chunked_linear_cross_entropy, (x, weight, bias, target), kwargs)
    new.meta = dict(region.loss.meta)
    region.loss.replace_all_uses_with(new)
    for node in [region.loss, *reversed(region.chain), region.linear]:
        graph.erase_node(node)
    gm.recompile()
    return new


def region_dtypes(region: LossRegion) -> dict:
    """The dtypes eager PyTorch gives the region, read off Dynamo's example values (so autocast's
    decisions are in them): the head's matmul (``mm_dtype``: bf16 under bf16 autocast), the logits the
    loss reads (``logits_dtype``: after the chain's casts) and the cross-entropy's (``dtype``: fp32 under
    autocast, which runs the loss in fp32). Why: the chunked op runs outside autocast's reach, and a
    loss computed in the logits' dtype trains another model (bf16 instead of fp32)."""
    logits = value_of(region.chain[-1] if region.chain else region.linear)
    return {
        "mm_dtype": value_of(region.linear).dtype,
        "logits_dtype": logits.dtype,
        "dtype": value_of(region.loss).dtype,
    }


def chunked_linear_cross_entropy(
    x,
    weight,
    bias,
    target,
    *,
    chunks: int,
    dtype: torch.dtype,
    mm_dtype: torch.dtype | None = None,
    logits_dtype: torch.dtype | None = None,
    ignore_index: int = -100,
    reduction: str = "mean",
    label_smoothing: float = 0.0,
    recompute: bool = False,
    fused: bool = False,
):
    """``F.cross_entropy(F.linear(x, weight, bias).to(logits_dtype).view(-1, V).to(dtype), target.view(-1),
    ...)`` computed over ``chunks`` chunks of the tokens, one after the other (:class:`_ChunkedHeadLoss`,
    or :class:`_RecomputedHeadLoss` with ``recompute``); the head's matmul in ``mm_dtype`` (default: the
    dtype of ``x``), the loss and its result in ``dtype``."""
    tokens = x.reshape(-1, x.shape[-1])
    flat_target = target.reshape(-1)
    count = (flat_target != ignore_index).sum() if reduction == "mean" else None
    function = _RecomputedHeadLoss if recompute else _ChunkedHeadLoss
    dtypes = (mm_dtype or x.dtype, logits_dtype or dtype, dtype)
    return function.apply(
        tokens, weight, bias, flat_target, count, chunks, dtypes, ignore_index, label_smoothing, fused
    )


class _ChunkedHeadLoss(torch.autograd.Function):
    """The loss and its gradients, chunk by chunk, in the forward (Liger's fused linear cross-entropy),
    as one op of the graph (:func:`chunked_head_loss`); the backward scales the kept gradients.

    Why not let autograd differentiate a loop of chunks: the head's weight gradient is then a sum of k
    partial ``[vocab, hidden]`` products, and Inductor fuses the sum into one kernel that reads all k
    of them (measured in the plan's peak: k weight-sized buffers alive at once). And why one op rather
    than the loop in the graph: unrolled, each chunk is a few dozen nodes that the planner plans and
    Inductor may fuse across chunks; the planning time grew with k (a 1-layer GPT's least-peak plan:
    2 s unchunked, 13 s at k=4, 32 s at k=32). The loss is a scalar, so the head is never recomputed.
    Kept: the gradients of the head's input ``[tokens, hidden]`` and of its parameters, not the logits."""

    @staticmethod
    def forward(
        ctx, tokens, weight, bias, target, count, chunks, dtypes, ignore_index, label_smoothing, fused
    ):
        needs = ctx.needs_input_grad[:3]  # a frozen head keeps no gradient
        mm_dtype, logits_dtype, dtype = dtypes
        total, *grads = torch.ops.recompile_opt.chunked_head_loss(
            tokens,
            weight,
            bias,
            target,
            chunks,
            dtype,
            ignore_index,
            label_smoothing,
            *needs,
            mm_dtype,
            logits_dtype,
            _scale(count, dtype),
            fused,
        )
        ctx.save_for_backward(*(g if need else None for g, need in zip(grads, needs)))
        return _mean(total, count, dtype)

    @staticmethod
    def backward(ctx, grad_loss):
        grads = [None if g is None else g * grad_loss.to(g.dtype) for g in ctx.saved_tensors]
        return (*grads, None, None, None, None, None, None, None)


class _RecomputedHeadLoss(torch.autograd.Function):
    """The loss chunk by chunk in the forward, which keeps only the head's input (MST's way); the
    backward runs the chunks again (:func:`chunked_head_loss`, gradients asked this time). Why besides
    :class:`_ChunkedHeadLoss`: its gradients (a ``[vocab, hidden]`` one among them) live from the loss
    to the backward, through whatever the forward still runs after the loss."""

    @staticmethod
    def forward(
        ctx, tokens, weight, bias, target, count, chunks, dtypes, ignore_index, label_smoothing, fused
    ):
        mm_dtype, logits_dtype, dtype = dtypes
        args = chunks, dtype, ignore_index, label_smoothing
        total = torch.ops.recompile_opt.chunked_head_loss(
            tokens, weight, bias, target, *args, False, False, False, mm_dtype, logits_dtype, fused=fused
        )[0]
        ctx.args, ctx.dtypes, ctx.fused = args, (mm_dtype, logits_dtype), fused
        ctx.save_for_backward(_scale(count, dtype), tokens, weight, bias, target)
        return _mean(total, count, dtype)

    @staticmethod
    def backward(ctx, grad_loss):
        scale, tokens, weight, bias, target = ctx.saved_tensors
        needs = ctx.needs_input_grad[:3]
        factor = grad_loss if scale is None else grad_loss * scale
        _, *grads = torch.ops.recompile_opt.chunked_head_loss(
            tokens, weight, bias, target, *ctx.args, *needs, *ctx.dtypes, factor, ctx.fused
        )
        return (*(g if need else None for g, need in zip(grads, needs)), *(None,) * 7)


def _mean(total, count, dtype):
    """A ``mean`` reduction's loss; the sum where ``count`` is None (``sum``). 0 / 0 = nan where every
    token is ignored, as torch's."""
    return total if count is None else total / count.to(dtype)


def _scale(count, dtype):
    """The logits' gradients' factor of a ``mean`` reduction (``1 / count``; None for ``sum``), applied
    before they are rounded to the matmul's dtype, as eager's backward applies it."""
    return None if count is None else 1.0 / count.clamp(min=1).to(dtype)


@torch.library.custom_op("recompile_opt::chunked_head_loss", mutates_args=())
def chunked_head_loss(
    tokens: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    target: torch.Tensor,
    chunks: int,
    dtype: torch.dtype,
    ignore_index: int,
    label_smoothing: float,
    need_tokens: bool,
    need_weight: bool,
    need_bias: bool,
    mm_dtype: torch.dtype | None = None,
    logits_dtype: torch.dtype | None = None,
    scale: torch.Tensor | None = None,
    fused: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`head_loss_in_chunks` as one op: Inductor runs it as one extern kernel; its chunk-sized
    working set is its workspace, which the peak model measures (``recompile_opt.costs.scratch``)."""
    return head_loss_in_chunks(
        tokens,
        weight,
        bias,
        target,
        chunks,
        dtype,
        ignore_index,
        label_smoothing,
        need_tokens,
        need_weight,
        need_bias,
        mm_dtype,
        logits_dtype,
        scale,
        fused,
    )


def head_loss_in_chunks(
    tokens,
    weight,
    bias,
    target,
    chunks,
    dtype,
    ignore_index,
    label_smoothing,
    need_tokens,
    need_weight,
    need_bias,
    mm_dtype=None,
    logits_dtype=None,
    scale=None,
    fused=False,
):
    """The summed cross-entropy of ``F.linear(tokens, weight, bias)`` over ``chunks`` chunks of rows, and
    its gradients with respect to the tokens, the weight and the bias (empty where not needed), those
    scaled by ``scale`` (a ``mean``'s ``1 / count``, times the loss's gradient where known).

    Each op runs in the dtype eager autocast gives it: the matmuls in ``mm_dtype`` (default: the
    weight's), the logits rounded to ``logits_dtype``, the loss and its gradient in ``dtype``; the
    weight's and bias's gradients summed over the chunks in fp32 and rounded once
    (:mod:`recompile_opt.passes.precision`). The dtypes are explicit, since compiled code runs with
    autocast off (AOTAutograd disables it around its graphs): left to autocast, the head's matmuls ran
    in fp32 there (3 of the GPU GPT's 1.7 TFLOP products at fp32's rate)."""
    mm_dtype, logits_dtype = mm_dtype or weight.dtype, logits_dtype or dtype
    loss_args = ignore_index, label_smoothing, scale
    with precision.autocast_off(tokens.device.type):
        w = weight.to(mm_dtype)  # once, not once a chunk
        b = bias.to(mm_dtype) if bias is not None else None
        total = tokens.new_zeros((), dtype=dtype)
        grad_tokens = []
        grad_weight = precision.accumulator(weight, mm_dtype) if need_weight else None
        grad_bias = precision.accumulator(bias, mm_dtype) if need_bias else None
        for x_chunk, t_chunk in zip(tokens.tensor_split(chunks), target.tensor_split(chunks)):
            x_mm = x_chunk.to(mm_dtype)
            raw = F.linear(x_mm, w, b)
            if fused:  # the gradient written into the matmul's output, in its dtype
                total += loss_body.fused_loss_and_grad_(raw, t_chunk, *loss_args, logits_dtype, dtype)
                grad_mm = raw
                del raw  # only grad_mm holds the chunk's buffer, dropped before the next chunk's is made
            else:  # in the fp32 logits' buffer (the matmul's output where it is fp32), then rounded
                logits = raw.to(logits_dtype).to(dtype)
                del raw  # a bf16 output is freed here: the loss reads its fp32 copy
                loss, grad_logits = loss_body.aten_loss_and_grad(logits, t_chunk, *loss_args)
                del logits  # the same buffer as grad_logits, dropped below before the next chunk's is made
                total += loss
                grad_mm = grad_logits.to(logits_dtype).to(mm_dtype)  # the casts' backward, as eager
                del grad_logits
            if need_tokens:
                grad_tokens.append((grad_mm @ w).to(tokens.dtype))
            if need_weight:
                precision.accumulate_(grad_weight, grad_mm.t(), x_mm)
            if need_bias:
                grad_bias += grad_mm.sum(0, dtype=grad_bias.dtype)
            del grad_mm
    return (
        total,  # an empty tensor for a gradient not needed (an op's outputs may not alias)
        torch.cat(grad_tokens) if need_tokens else tokens.new_empty(0),
        precision.rounded_(grad_weight, mm_dtype, weight.dtype) if need_weight else tokens.new_empty(0),
        precision.rounded_(grad_bias, mm_dtype, bias.dtype) if need_bias else tokens.new_empty(0),
    )


@chunked_head_loss.register_fake
def _(
    tokens,
    weight,
    bias,
    target,
    chunks,
    dtype,
    ignore_index,
    label_smoothing,
    need_tokens,
    need_weight,
    need_bias,
    mm_dtype=None,
    logits_dtype=None,
    scale=None,
    fused=False,
):
    return (
        tokens.new_empty((), dtype=dtype),
        torch.empty_like(tokens) if need_tokens else tokens.new_empty(0),
        torch.empty_like(weight) if need_weight else tokens.new_empty(0),
        torch.empty_like(bias) if need_bias else tokens.new_empty(0),
    )


@ti.register_flop_formula(torch.ops.recompile_opt.chunked_head_loss)
def _flops(
    tokens_shape,
    weight_shape,
    bias_shape,
    target_shape,
    chunks,
    dtype,
    ignore_index,
    label_smoothing,
    need_tokens,
    need_weight,
    need_bias,
    *args,
    out_shape=None,
    **kwargs,
) -> int:
    """The head's matmuls: the logits, and the gradients of the tokens and of the weight where asked."""
    return (
        2 * tokens_shape[0] * tokens_shape[1] * weight_shape[0] * (1 + bool(need_tokens) + bool(need_weight))
    )


@register_traffic_formula(torch.ops.recompile_opt.chunked_head_loss)
def _traffic(node: fx.Node) -> int:
    """What makes chunks cost: each chunk reads the head's weight twice (its logits, its tokens'
    gradient) and reads and writes the weight's gradient (``addmm_``), whatever its rows; besides, the
    tokens and their gradient once, the body's passes over the logits (:func:`loss_body.bytes_per_logit`:
    on the H200 the ATen body's took 15-17 ms of the GPU GPT's 70 ms step) and the gradient matmuls'
    reads of the logits' gradient. The roofline prices the op by the larger of its FLOPs' time and
    this traffic's, so the body's bytes show in the estimated step where they dominate. Measured
    (T=512, V=32000, h=256, fp32, 2 CPU cores): the op takes about 1.1x its unchunked time at 128 rows
    a chunk, 1.3-1.4x at 64, 9x at 4 (``bench/chunk_rows.py``)."""
    tokens, weight = (a.meta["val"] for a in node.args[:2])
    need_tokens, need_weight = (
        _op_arg(node, i, name) for i, name in ((8, "need_tokens"), (9, "need_weight"))
    )
    mm_dtype = _op_arg(node, 11, "mm_dtype", None) or weight.dtype
    per_logit = loss_body.bytes_per_logit(
        bool(_op_arg(node, 14, "fused", False)), mm_dtype.itemsize, _op_arg(node, 5, "dtype").itemsize
    ) + mm_dtype.itemsize * (bool(need_tokens) + bool(need_weight))
    logits = ti.concrete_size(tokens.shape[0]) * ti.concrete_size(weight.shape[0])  # no guard on a SymInt
    passes = 1 + bool(need_tokens) + 2 * bool(need_weight)
    return chunks_of(node) * passes * tensor_bytes(weight) + 2 * tensor_bytes(tokens) + logits * per_logit


def chunks_of(node: fx.Node) -> int:
    """The ``chunks`` argument of a :func:`chunked_head_loss` node."""
    return int(_op_arg(node, 4, "chunks"))


def _op_arg(node: fx.Node, index: int, name: str, *default):
    """The op's argument ``name`` (position ``index``); ``default`` where the call leaves it out."""
    if len(node.args) > index:
        return node.args[index]
    return node.kwargs[name] if name in node.kwargs or not default else default[0]


def _region(loss: fx.Node) -> LossRegion:
    logits, target = _ce_arg(loss, "input"), _ce_arg(loss, "target")
    lv, tv = value_of(logits), value_of(target)
    tokens = int(lv.shape[0]) if lv is not None and lv.dim() == 2 else 0
    vocab = int(lv.shape[1]) if lv is not None and lv.dim() == 2 else 0
    region = LossRegion(loss, None, [], tokens, vocab, device=lv.device.type if lv is not None else None)
    if lv is None or lv.dim() != 2 or tv is None or tv.dim() != 1:
        return _refuse(region, "the loss's input is not logits [tokens, vocab] with targets [tokens]")
    if _ce_arg(loss, "weight") is not None:
        return _refuse(region, "class weights (the mean would divide by the weights' sum)")
    for legacy in ("size_average", "reduce"):
        if _ce_arg(loss, legacy) is not None:
            return _refuse(region, f"the legacy argument {legacy!r}")
    if _ce_arg(loss, "reduction", "mean") not in _REDUCTIONS:
        return _refuse(region, f"reduction {_ce_arg(loss, 'reduction')!r} (accepted: {list(_REDUCTIONS)})")
    chain, node = [], logits
    while not (node.op == "call_function" and node.target in LINEAR):
        if node.op == "placeholder":
            return _refuse(
                region,
                f"the logits are an input of this graph ({node.name}): a graph break "
                "lies between the head and the loss (Hugging Face models without a "
                "loss_type, e.g. GPT2LMHeadModel, break at a logging call there: set "
                "model.loss_type = 'ForCausalLM')",
            )
        if not _keeps_token_order(node, vocab):
            return _refuse(
                region,
                f"{node.name} ({node.target}) between the head and the loss is not a reshape or a cast",
            )
        chain.append(node)
        node = node.args[0]
        if not isinstance(node, fx.Node):
            return _refuse(region, "no linear layer (the LM head) before the loss")
    chain.reverse()
    region.linear, region.chain = node, chain
    selects = [i for i, n in enumerate(chain) if _selects_tokens(n)]
    reshapes = [
        i for i, n in enumerate(chain) if n.target in _ORDER_KEEPING_METHODS | _ORDER_KEEPING_FUNCTIONS
    ]
    if selects and reshapes and min(reshapes) < max(selects):
        return _refuse(region, f"{chain[max(selects)].name} selects tokens after a reshape of the logits")
    for producer, consumer in zip([node, *chain], [*chain, loss]):
        if set(producer.users) != {consumer}:
            return _refuse(
                region,
                f"the logits ({producer.name}) are also read elsewhere (returned, or "
                "another loss): the head would be computed twice",
            )
    x = value_of(chain[max(selects)] if selects else _linear_args(node)[0])
    if x is None or math.prod(int(s) for s in x.shape[:-1]) != tokens:
        return _refuse(region, "the head's input does not hold one row per token of the loss")
    region.width, region.itemsize = int(x.shape[-1]), x.element_size()
    region.last = _nothing_after(loss)
    return region


def _nothing_after(loss: fx.Node) -> bool:
    """Whether every computation after ``loss`` in the forward is on scalars (``loss * w + aux``)."""
    after = False
    for node in loss.graph.nodes:
        if node is loss:
            after = True
        elif after and node.op in ("call_function", "call_method", "call_module"):
            values = [
                v
                for v in torch.utils._pytree.tree_leaves(node.meta.get("example_value"))
                if isinstance(v, torch.Tensor)
            ]
            if any(v.dim() > 0 for v in values):
                return False
    return True


def _keeps_token_order(node: fx.Node, vocab: int) -> bool:
    """A cast, a reshape to ``[tokens, vocab]`` (rows stay tokens, in order), or a selection of tokens."""
    value = value_of(node)
    if node.op == "call_method" and node.target in ("float", "to", "contiguous") or _selects_tokens(node):
        return True
    reshape = (node.op == "call_method" and node.target in _ORDER_KEEPING_METHODS) or (
        node.op == "call_function" and node.target in _ORDER_KEEPING_FUNCTIONS
    )
    return reshape and value is not None and value.dim() <= 2 and value.shape[-1] == vocab


def _selects_tokens(node: fx.Node) -> bool:
    """``logits[i, j:k]``: slices and integers over the leading (token) dimensions only."""
    if not (node.op == "call_function" and node.target is operator.getitem):
        return False
    index, value = node.args[1], value_of(node.args[0])
    index = index if isinstance(index, tuple) else (index,)
    if value is not None and len(index) == value.dim() and index[-1] == slice(None):
        index = index[:-1]  # logits[:, :-1, :]
    return (
        value is not None
        and len(index) < value.dim()
        and all(isinstance(i, (int, slice)) and not isinstance(i, bool) for i in index)
        and all(
            not isinstance(v, fx.Node)
            for i in index
            if isinstance(i, slice)
            for v in (i.start, i.stop, i.step)
        )
    )


def _refuse(region: LossRegion, why: str) -> LossRegion:
    region.why_not = why
    return region


def _linear_args(node: fx.Node):
    kw = arguments(node)
    return kw["input"], kw["weight"], kw["bias"]


def _ce_arg(node: fx.Node, name: str, default=None):
    """An argument of a ``F.cross_entropy`` call, by name (given by position, name or default)."""
    value = arguments(node).get(name, default)
    return default if value is None else value


def value_of(node) -> torch.Tensor | None:
    val = node.meta.get("example_value") if isinstance(node, fx.Node) else None
    return val if isinstance(val, torch.Tensor) else None
