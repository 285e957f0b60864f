"""Option ``sequence_parallel=True``: a model a user laid out by hand as tensor parallel (DTensor's
``parallelize_module`` with ``ColwiseParallel`` / ``RowwiseParallel``) made tensor + sequence parallel
in its Dynamo graph, before AOTAutograd (issue 22, step 11).

Why the Dynamo graph: the parallel styles' hooks trace into it as DTensor calls whose placements are
plain arguments (``DTensor.from_local(x, mesh, (Replicate(),))`` before a column-parallel linear,
``y.redistribute((Replicate(),)).to_local()`` after a row-parallel one), so Megatron's sequence
parallelism is a change of three kinds of node, and autograd derives the conjugate backward (an
all-gather's is a reduce-scatter) as for a hand-written TP+SP model:

* a row-parallel output (a ``Partial`` DTensor, also the vocabulary-parallel embedding's) redistributed
  to ``Shard(1)`` instead of ``Replicate()``: a reduce-scatter, each rank keeps its rows of the sequence;
* the per-token ops after it (norms, residual adds, dropout, casts, activations: :data:`PER_TOKEN`) run
  on those rows; an operand that runs the whole sequence (GPT's position embedding) is split to the
  rank's rows (its gradient all-gathered back), and one that is broadcast over the sequence and needs a
  gradient (a norm's weight) has that gradient summed over the ranks (Megatron's ``f``);
* a column-parallel linear's input ``from_local(rows, mesh, (Replicate(),))`` becomes
  ``from_local(rows, mesh, (Shard(1),)).redistribute((Replicate(),))``: an all-gather; any other reader
  of a rank's rows (a reshape, the loss, the graph's output) reads them gathered, with a backward that
  keeps the rank's slice of a gradient every rank computes whole.

A dropout on the rows draws the mask the tensor-parallel model drew (the full one, every rank alike) and
applies the rank's slice (:mod:`recompile_opt.parallel.dropout`), so the step equals the TP model's.
"""

from __future__ import annotations

import operator

import torch
import torch.fx as fx

from recompile_opt import ops
from recompile_opt.ops import op_name
from recompile_opt.options import OptionError
from recompile_opt.parallel import collectives as C
from recompile_opt.parallel.dropout import sliced_dropout

SEQ = 1  # the sequence dimension of a [b, s, h] activation (torchtitan's and Hugging Face's layout)

# ops whose every output row depends only on the same row of their inputs (reductions only over the
# last dimension, checked by :func:`_per_token`): the per-token class as Dynamo's graph spells it (functions'
# and methods' names), less the ops this pass was never tried with
PER_TOKEN = (
    ops.PER_TOKEN
    - {"_to_copy", "alias", "detach", "lift_fresh_copy", "gelu_", "native_dropout", "native_layer_norm"}
    - {"square", "softplus", "relu6", "leaky_relu", "elu", "hardswish", "mish", "erf"}
    - {"where", "masked_fill", "scalar_tensor", "logical_not", "bitwise_not"}
)
_LAST_DIM = ops.DIM_REDUCTIONS


def add_sequence_parallel(gm: fx.GraphModule) -> list[str]:
    """Rewrite ``gm`` (a Dynamo graph of a tensor-parallel model) in place as tensor + sequence parallel;
    returns the plan's note lines. A graph without a row-parallel output is left as it is (a note says
    so); dynamic shapes and meshes of more than one dimension are refused."""
    seeds = [n for n in gm.graph.nodes if _row_parallel_output(n)]
    if not seeds:
        return [
            "sequence parallel: no row-parallel output redistributed to Replicate() in this graph; "
            "left as it is"
        ]
    mesh = _dtensor(seeds[0].args[0]).device_mesh
    if mesh.ndim != 1:
        raise OptionError(
            f"option 'sequence_parallel': needs a 1-D tensor-parallel mesh, got a {mesh.ndim}-D one"
        )
    lengths = sorted({_shape(seed.args[0])[SEQ] for seed in seeds}, key=str)
    if not all(isinstance(n, int) for n in lengths):
        raise OptionError(
            "option 'sequence_parallel': the sequence length is dynamic in this graph; "
            "compile with dynamic=False"
        )
    for n in lengths:
        if n % mesh.size():
            raise OptionError(
                f"option 'sequence_parallel': the sequence length {n} does not split over {mesh.size()} ranks"
            )
    return _Rewrite(gm, mesh, lengths).run(seeds)


class _Rewrite:
    def __init__(self, gm: fx.GraphModule, mesh, lengths: list[int]):
        self.gm, self.graph, self.lengths = gm, gm.graph, lengths
        self.tp, self.rank = mesh.size(), mesh.get_local_rank()
        self.group = mesh.get_group().group_name
        self.rows: set[fx.Node] = set()  # nodes whose value is now this rank's rows of the sequence
        self.summed: dict[fx.Node, fx.Node] = {}  # operand -> f(operand): its gradient summed over the ranks
        self.gathered: dict[fx.Node, fx.Node] = {}  # rows -> their all-gathered DTensor (q, k, v share one)
        self.whole: dict[fx.Node, fx.Node] = {}  # rows -> the whole sequence, for replicated readers
        self.batches: dict[torch.dtype, fx.Node] = {}  # dtype -> the parameters' one f (see _summed)
        self.counts = {
            "reduce-scatter": 0,
            "all-gather": 0,
            "gathered for a replicated reader": 0,
            "split to rows": 0,
            "dropout sliced": 0,
        }

    def run(self, seeds: list[fx.Node]) -> list[str]:
        from torch.distributed.tensor import Shard

        for redistribute in seeds:
            if "placements" in redistribute.kwargs:
                redistribute.update_kwarg("placements", (Shard(SEQ),))
            else:
                redistribute.update_arg(2, (Shard(SEQ),))
            self.rows.add(next(iter(redistribute.users)))  # its to_local()
            self.counts["reduce-scatter"] += 1
        for node in list(self.graph.nodes):
            if node in self.rows or not any(a in self.rows for a in node.all_input_nodes):
                continue
            if _per_token(node) and _ndim(node) >= 2:
                self._on_rows(node)
            elif _from_local_replicated(node):
                self._gather_into_dtensor(node)
            else:
                self._gather_for(node)
        self.graph.lint()
        self.gm.recompile()
        counts = ", ".join(f"{v} {k}" for k, v in self.counts.items() if v)
        return [
            f"sequence parallel (option sequence_parallel=True, t = {self.tp}): {counts}; "
            f"{len(self.rows)} values run on the rank's 1/{self.tp} of the rows "
            f"(sequence length {', '.join(map(str, self.lengths))})"
        ]

    def _on_rows(self, node: fx.Node) -> None:
        """``node`` runs on the rank's rows: its full-length operands split, its broadcast ones summed."""
        out_ndim, length = _ndim(node), _shape(node)[SEQ]
        operands = (
            node.all_input_nodes[:1] if op_name(node) == "type_as" else node.all_input_nodes
        )  # (a dtype)
        for a in list(operands):
            if a in self.rows:
                continue
            d = SEQ - (out_ndim - _ndim(a))
            if 0 <= d < _ndim(a) and _shape(a)[d] == length:
                node.replace_input_with(a, self._split(a, node, d))
            elif _requires_grad(a):
                node.replace_input_with(a, self._summed(a))
        if op_name(node) == "dropout":
            self._slice_dropout(node)
        self.rows.add(node)

    def _split(self, a: fx.Node, before: fx.Node, d: int) -> fx.Node:
        with self.graph.inserting_before(before):
            self.counts["split to rows"] += 1
            return self.graph.call_function(
                C.split_sequence, (a, self.group, d), {"size": self.tp, "rank": self.rank}
            )

    def _summed(self, a: fx.Node) -> fx.Node:
        """``a`` with its gradient summed over the ranks. The parameters (graph inputs) of one dtype share
        one all-reduce in the backward, as in ``parallelize``'s graphs (one collective a step for every
        norm weight, not one each: each gloo collective also allocates buffers of its own)."""
        if a in self.summed:
            return self.summed[a]
        if a.op != "placeholder":
            with self.graph.inserting_after(a):
                self.summed[a] = self.graph.call_function(C.copy_to_tensor_parallel, (a, self.group))
            return self.summed[a]
        dtype = _value(a).dtype
        batch = self.batches.get(dtype)
        if batch is None:
            with self.graph.inserting_after(self.graph.find_nodes(op="placeholder")[-1]):
                batch = self.batches[dtype] = self.graph.call_function(
                    C.copy_all_to_tensor_parallel, ([], self.group)
                )
        batch.update_arg(0, [*batch.args[0], a])
        with self.graph.inserting_after(batch):
            self.summed[a] = self.graph.call_function(operator.getitem, (batch, len(batch.args[0]) - 1))
        return self.summed[a]

    def _slice_dropout(self, node: fx.Node) -> None:
        """The TP model's dropout mask (full, alike on every rank), the rank's rows of it applied."""
        x, p, train = _dropout_args(node)
        if not train or p == 0:
            return
        rows = _shape(node)[SEQ] // self.tp
        node.target = sliced_dropout
        node.args, node.kwargs = (x, p, True, tuple(_shape(node)), ((SEQ, self.rank * rows, rows),)), {}
        self.counts["dropout sliced"] += 1

    def _gather_into_dtensor(self, node: fx.Node) -> None:
        """A column-parallel linear's replicated input, all-gathered from the rows: its gradient is
        reduce-scattered back (DTensor's redistribute from ``Shard`` and its backward)."""
        from torch.distributed.tensor import Replicate, Shard

        rows = node.args[0]
        if rows in self.gathered:  # another linear of the same input (q, k and v): one gather for all
            node.replace_all_uses_with(self.gathered[rows])
            self.graph.erase_node(node)
            return
        node.update_arg(2, (Shard(SEQ),))
        with self.graph.inserting_after(node):
            gathered = self.graph.call_method("redistribute", (node,), {"placements": (Replicate(),)})
        node.replace_all_uses_with(gathered, delete_user_cb=lambda user: user is not gathered)
        self.gathered[rows] = gathered
        self.counts["all-gather"] += 1

    def _gather_for(self, node: fx.Node) -> None:
        """Any other reader of rows reads the whole sequence, as every rank computes it whole (one
        gather per value, before its first such reader)."""
        for a in [a for a in node.all_input_nodes if a in self.rows]:
            if a not in self.whole:
                with self.graph.inserting_before(node):
                    self.whole[a] = self.graph.call_function(
                        C.gather_sequence_for_replicated,
                        (a, self.group, SEQ),
                        {"size": self.tp, "rank": self.rank},
                    )
                self.counts["gathered for a replicated reader"] += 1
            node.replace_input_with(a, self.whole[a])


def _row_parallel_output(node: fx.Node) -> bool:
    """``redistribute(partial, placements=(Replicate(),))`` read only by its ``to_local()``, on a
    ``[b, s, h]`` value: RowwiseParallel's output hook (and a vocabulary-parallel embedding's)."""
    from torch.distributed.tensor import Partial, Replicate

    if node.op != "call_method" or node.target != "redistribute":
        return False
    value = _dtensor(node.args[0])
    placements = _arg(node, 2, "placements", None)  # redistribute(self, device_mesh, placements)
    return (
        value is not None
        and len(value.shape) == 3
        and tuple(placements or ()) == (Replicate(),)
        and all(isinstance(p, Partial) for p in value.placements)
        and len(node.users) == 1
        and next(iter(node.users)).target == "to_local"
    )


def _from_local_replicated(node: fx.Node) -> bool:
    from torch.distributed.tensor import Replicate

    return (
        node.op == "call_function"
        and getattr(node.target, "__name__", "") == "from_local"
        and len(node.args) >= 3
        and tuple(node.args[2] or ()) == (Replicate(),)
    )


def _per_token(node: fx.Node) -> bool:
    """Whether each row of ``node``'s value depends only on the same row of its inputs: a reduction or
    norm only over dimensions after the sequence's (a mean over the last dimension of a ``[b, s]`` value
    is a mean over the sequence); an in-place op is not rewritten."""
    name = op_name(node)
    if name not in PER_TOKEN or _arg(node, 3, "inplace", False):
        return False
    ndim = _ndim(_arg(node, 0, "input", None))
    if name in _LAST_DIM:
        dim = _arg(node, 1, "dim", None)
        return isinstance(dim, int) and ndim > 0 and dim % ndim > SEQ
    if name in ("layer_norm", "rms_norm"):
        shape = _arg(node, 1, "normalized_shape", ())
        return len(shape) < ndim - SEQ
    return True


def _arg(node: fx.Node, i: int, name: str, default):
    """Argument ``i`` (or keyword ``name``) of a call, the method's ``self`` being argument 0."""
    if name in node.kwargs:
        return node.kwargs[name]
    return node.args[i] if i < len(node.args) else default


def _dropout_args(node: fx.Node) -> tuple:
    """``(input, p, training)`` of ``F.dropout`` or ``torch.dropout`` (whose keyword is ``train``)."""
    train = _arg(node, 2, "training", node.kwargs.get("train", True))
    return _arg(node, 0, "input", None), _arg(node, 1, "p", 0.5), train


def _value(node):
    return node.meta.get("example_value") if isinstance(node, fx.Node) else None


def _dtensor(node):
    from torch.distributed.tensor import DTensor

    value = _value(node)
    return value if isinstance(value, DTensor) else None


def _shape(node) -> tuple:
    value = _value(node)
    return tuple(value.shape) if isinstance(value, torch.Tensor) else ()


def _ndim(node) -> int:
    return len(_shape(node))


def _requires_grad(node) -> bool:
    value = _value(node)
    return isinstance(value, torch.Tensor) and value.requires_grad
