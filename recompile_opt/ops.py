"""Op classes, each defined once, and the one name every rule reads an op by (:func:`op_name`).

Why one module: the passes, the cost model and the parallel rewrites each kept their own table of
"pointwise" or "per-token" ops, and the copies drifted apart. A class is defined by ``torch.Tag`` or
an ``OpOverload``'s own property where torch has one, and by name only where a graph's calls carry no
tags (Dynamo's graph calls torch functions, ``operator`` functions and tensor methods; torch.export's
graph keeps composite ops such as ``dropout`` and ``layer_norm``). A pass that handles only part of a
class derives its part from the class here, with the exclusions written out, so the difference is
visible and deliberate.

========================  ==============================================  =============================
class                     defined by                                      read by
========================  ==============================================  =============================
view                      ``OpOverload.is_view``, and ``wait_tensor``     costs, joint_graph
pointwise                 ``torch.Tag.pointwise``                         joint_graph, cost_model
fusible pointwise         pointwise, not random                           cost_model, joint_graph
random (seeded)           ``torch.Tag.nondeterministic_seeded``           joint_graph, partition, simulator
generated random          :data:`GENERATED_RANDOM` (no tag says it)       cost_model, joint_graph
random, by name           :data:`RANDOM`                                  chunk_mlp, chunk_attention
elementwise, by name      :data:`ELEMENTWISE`, :data:`ACTIVATIONS`        chunk_mlp, layout
attention, by name        :data:`MATMULS`, :data:`SOFTMAX`, :data:`SDPA`  chunk_attention
cast, by name             :data:`CASTS`                                   chunk_attention
per-token, by name        :data:`PER_TOKEN`                               sequence_pass, rewrite
scratch                   :data:`SCRATCH` (packets; no tag says it)       scratch, peak, least_peak
collective                ``_torch_internals.is_collective_op``           cost_model, joint_graph
========================  ==============================================  =============================

The collective class stays in :mod:`recompile_opt._torch_internals`: it is keyed by the functional
collectives' namespaces, which are torch's private names.
"""

from __future__ import annotations

import functools
import operator

import torch
import torch.fx as fx
from torch.fx.operator_schemas import normalize_function

from recompile_opt import _torch_internals as ti


def op_name(node: fx.Node, *, qualified: bool = False) -> str | None:
    """The name the classes below match an op by: an ATen op's overload packet (``aten.add.Tensor``
    -> ``"add"``), a function's or a method's own name (``F.gelu`` -> ``"gelu"``, ``operator.truediv``
    -> ``"truediv"``, ``x.float()`` -> ``"float"``, ``getitem``); None for a node that calls nothing
    (placeholder, output, get_attr).

    ``qualified=True``: the label a plan prints, for any node: the op's namespace kept where it is not
    ATen's (``c10d.all_reduce``, ``recompile_opt.chunked_head_loss``), ``input`` for a placeholder, and
    ``str(target)`` for any other node and call of no op (a higher-order op prints its name)."""
    target = node.target
    if node.op == "call_method":
        return target
    if node.op != "call_function":
        return ("input" if node.op == "placeholder" else str(target)) if qualified else None
    packet = getattr(target, "_overloadpacket", None)
    if packet is not None:
        return (
            str(packet).replace("aten.", "").replace("_c10d_functional.", "c10d.")
            if qualified
            else packet.__name__
        )
    if qualified and target is not operator.getitem:
        return str(target)
    return getattr(target, "__name__", str(target))


# --- classes of ATen ops (AOTAutograd's joint graph), by tag ------------------------------------------


def is_view_node(node: fx.Node) -> bool:
    """True when the node's output aliases its first tensor input (views, and getitem of views; a
    collective's ``wait_tensor``, which returns the collective's buffer once it is filled, and a reload's
    from the host). A copy to the host's wait is not: it returns the host copy and reads the value it
    copies, which the device holds until then (``_torch_internals.offload_waits``)."""
    if node.op != "call_function":
        return False
    target = node.target
    if target is operator.getitem:
        parent = node.args[0]
        return isinstance(parent, fx.Node) and is_view_node(parent)
    return _aliasing_op(target) and not (_is_offload_wait(target) and node.meta.get("host_resident"))


@functools.lru_cache(maxsize=None)
def _is_offload_wait(target) -> bool:
    return ti.is_offload_wait(target)


@functools.lru_cache(maxsize=None)
def _aliasing_op(target) -> bool:
    """Whether an op's output aliases its first input, once per op: the peak model asks it of every
    node of every plan it simulates (150k times in a 2-layer GPT's planning)."""
    return isinstance(target, torch._ops.OpOverload) and (
        target.is_view or ti.is_wait_tensor(target) or ti.is_offload_wait(target)
    )


def is_pointwise(node: fx.Node) -> bool:
    """An op tagged ``torch.Tag.pointwise``: each output element from the same element of each input;
    random ones (``bernoulli``) included."""
    return node.op == "call_function" and torch.Tag.pointwise in getattr(node.target, "tags", ())


def is_fusible_pointwise(node: fx.Node) -> bool:
    """A pointwise ATen op that is not random: Inductor fuses it into its reader (it keeps random ones as
    fallback kernels of their own)."""
    return (
        is_pointwise(node)
        and isinstance(node.target, torch._ops.OpOverload)
        and not is_seeded_op(node.target)
    )


def is_seeded_op(target) -> bool:
    """Ops tagged as drawing from the RNG, which FX therefore calls impure (never dead-code
    eliminated); recomputable all the same, replayed when they do draw (:func:`is_random_op`)."""
    return torch.Tag.nondeterministic_seeded in getattr(target, "tags", ())


def is_random_op(node) -> bool:
    """A call whose result depends on the global RNG: recomputing it must replay a saved RNG state.
    An op tagged ``nondeterministic_seeded`` whose ``dropout_p`` argument is 0 draws nothing (SDPA
    without dropout): treated as random, each recomputed SDPA kept a 5 KiB CPU RNG state for nothing,
    and with ``fallback_random`` (no replay) it could not be recomputed at all."""
    target = getattr(node, "target", None)
    if not is_seeded_op(target):
        return False
    found, p = ti.schema_argument(node, "dropout_p")
    return not (found and isinstance(p, (int, float)) and p == 0)


# Random ops that make their values from the RNG alone, which Inductor's own RNG (not ``fallback_random``)
# generates element by element inside the kernel that reads them, as it does pointwise ops. No tag says
# "reads no tensor": by packet (``inductor_random``: Inductor's ``inductor_prims.random``).
GENERATED_RANDOM = frozenset({"rand", "randn", "rand_like", "randn_like", "inductor_random"})


def is_generated_random(node: fx.Node) -> bool:
    """``rand``/``randn`` (and Inductor's ``inductor_prims.random``): no tensor read, each element drawn
    on its own; Inductor's own RNG fuses them into their reader like a pointwise op."""
    packet = getattr(node.target, "_overloadpacket", None)
    return node.op == "call_function" and getattr(packet, "__name__", "") in GENERATED_RANDOM


# --- scratch: kernels that allocate workspace of their own (no tag says it) -------------------------------

# torch's extern kernels whose workspace depends on the backend's algorithm choice (im2col, cuDNN, ...)
TORCH_SCRATCH = frozenset(
    {
        "convolution",
        "convolution_backward",
        "_scaled_dot_product_flash_attention_for_cpu",
        "_scaled_dot_product_flash_attention_for_cpu_backward",
        "_scaled_dot_product_flash_attention",
        "_scaled_dot_product_flash_attention_backward",
        "_scaled_dot_product_efficient_attention",
        "_scaled_dot_product_efficient_attention_backward",
        "_scaled_dot_product_cudnn_attention",
        "_scaled_dot_product_cudnn_attention_backward",
    }
)
# ops (overload packets) whose kernels allocate workspace above their outputs: torch's, and our chunked
# LM-head loss (recompile_opt.passes.chunking: one chunk's logits and their gradient)
SCRATCH = TORCH_SCRATCH | {"chunked_head_loss"}


def has_scratch(node: fx.Node) -> bool:
    """Whether ``node`` runs a kernel that may allocate workspace (:data:`SCRATCH`)."""
    target = node.target
    return isinstance(target, torch._ops.OpOverload) and target._overloadpacket.__name__ in SCRATCH


def compiles_on_first_call(node: fx.Node) -> bool:
    """Whether ``node``'s op compiles code on its first call (the chunked loss with its fused body,
    ``passes/loss_body.py``): that call's allocations are the compile's, not the op's. Why ask: a
    scratch measurement then runs the op once unmeasured, and on the CPU one run of the GPU check's
    chunked loss takes minutes."""
    target = node.target
    if not (
        isinstance(target, torch._ops.OpOverload) and target._overloadpacket.__name__ == "chunked_head_loss"
    ):
        return False
    fused = node.kwargs.get("fused", node.args[14] if len(node.args) > 14 else False)
    return bool(fused)


# --- by name, for graphs whose calls carry no tags (Dynamo's; torch.export's before decomposition) ------
# Each table holds every spelling a graph may use: a Dynamo graph calls ``operator.truediv`` or ``x.float()``
# where an ATen graph calls ``div`` or ``_to_copy``.

# Python's spellings (``operator`` functions, tensor methods) that no ATen op is named by
PYTHON_SPELLINGS = frozenset({"iadd", "imul", "truediv", "float", "half", "bfloat16"})

# elementwise activations, as torch functions and tensor methods name them
ACTIVATIONS = frozenset(
    {
        "relu",
        "gelu",
        "silu",
        "tanh",
        "sigmoid",
        "erf",
        "mish",
        "softplus",
        "relu6",
        "leaky_relu",
        "elu",
        "hardswish",
    }
)

# ops that draw from the RNG (dropout: elementwise as well)
RANDOM = frozenset({"dropout", "native_dropout", "alpha_dropout", "feature_alpha_dropout"})


def arguments(node: fx.Node) -> dict | None:
    """A call's arguments by name, defaults filled in (torch.fx's own normalisation); None where torch.fx
    cannot match them to the target's signature."""
    call = normalize_function(
        node.target, tuple(node.args), dict(node.kwargs), normalize_to_only_use_kwargs=True
    )
    return None if call is None else call.kwargs


# the dropouts that return their input where they draw nothing
_IDENTITY_WHEN_IDLE = frozenset({"dropout", "alpha_dropout", "feature_alpha_dropout"})


def is_idle_dropout(node: fx.Node) -> bool:
    """A dropout call of a Dynamo graph that draws nothing and returns its input: ``p`` 0 or not
    training (constants, defaults filled in by torch.fx's ``normalize_function``), not in place. Why:
    Hugging Face models keep their ``nn.Dropout(config.dropout)`` at 0.0, and such a call between an
    MLP's projections refused its chunks as if it drew numbers (ATen's dropout returns its input where
    ``p == 0`` or not training)."""
    if node.op != "call_function" or op_name(node) not in _IDENTITY_WHEN_IDLE:
        return False
    kw = arguments(node)
    if kw is None:
        return False
    training, p = kw.get("training", kw.get("train")), kw.get("p")
    if kw.get("inplace", False) is not False or not isinstance(training, bool):
        return False
    return not training or (isinstance(p, (int, float)) and p == 0)


# ops whose each output element depends only on the same element of each (broadcast) input
ELEMENTWISE = ACTIVATIONS | {
    "add",
    "iadd",
    "sub",
    "mul",
    "imul",
    "truediv",
    "div",
    "neg",
    "pow",
    "square",
    "sqrt",
    "rsqrt",
    "exp",
    "gelu_",  # ATen's in-place GELU
    "dropout",
    "native_dropout",
    "float",
    "half",
    "bfloat16",
    "to",
    "type_as",
    "_to_copy",  # casts
    "contiguous",
    "clone",
    "alias",
    "detach",
    "lift_fresh_copy",  # copies
    "where",
    "masked_fill",
    "scalar_tensor",
    "logical_not",
    "bitwise_not",
}

# casts, as torch functions and tensor methods name them (``x.type(dtype)``: Hugging Face's GPT-2)
CASTS = frozenset({"float", "half", "bfloat16", "to", "type", "type_as", "_to_copy"})

# matrix products of batched operands (``q @ k.transpose(-2, -1)``: ``operator.matmul``)
MATMULS = frozenset({"matmul", "bmm"})
# the softmax as torch functions and tensor methods name it
SOFTMAX = frozenset({"softmax"})
# fused attention (its math path materialises the probabilities where no fused kernel runs)
SDPA = frozenset({"scaled_dot_product_attention"})

# normalisations over the last dimensions (``normalized_shape``)
NORMS = frozenset({"layer_norm", "native_layer_norm", "rms_norm"})
# reductions and normalisations over the dimension(s) their ``dim`` argument names
DIM_REDUCTIONS = frozenset({"mean", "sum", "amax", "softmax", "log_softmax"})

# ops whose each token's output depends only on the same token's inputs: elementwise ones, and norms and
# reductions where they run over dimensions after the sequence's (a reader checks the dimension)
PER_TOKEN = ELEMENTWISE | NORMS | DIM_REDUCTIONS
