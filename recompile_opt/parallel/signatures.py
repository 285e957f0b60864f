"""The rank's graph for every input signature and mode, from one layout (issue 49).

A layout is a property of the model (which linears pair, which weights split, which regions run on
sequence shards), not of one batch; the rank's graph, exported with fixed shapes, is. So the layout is
found once (:func:`recompile_opt.parallelize`), and for each new (input shapes and dtypes, train/eval)
the rank's graph is derived as ``torch.compile`` recompiles: the model's meta twin (its structure, no
storage) is exported at those shapes and in that mode, its layout found again and checked to be the
same, and the rank's graph written from it. Why not symbolic sizes: the exported graph's views spell
the local sizes out, and one export per signature costs a fraction of a second against a compile.
"""

from __future__ import annotations

import copy
import itertools
import warnings
from dataclasses import dataclass, field

import torch
import torch.fx as fx
import torch.utils._pytree as pytree

from recompile_opt.parallel.layout import Layout, find_layout


@dataclass
class RankGraph:
    """The rank's graph for one signature, with what feeding it needs: the exported program's input
    and output specs, its lifted constants and the outputs' tree."""

    graph: fx.GraphModule
    specs: list
    out_specs: list
    constants: dict
    out_tree: object
    signature: tuple  # the user inputs' signatures it was exported with (:func:`signature`)
    pieces: dict = field(default_factory=dict)  # cut at hooked modules, by their paths (pieces.split)

    @classmethod
    def of(cls, layout: Layout, graph: fx.GraphModule) -> RankGraph:
        program = layout.program
        specs = list(program.graph_signature.input_specs)
        constants = lifted_constants(program)
        vals = [n.meta.get("val") for n in program.graph.find_nodes(op="placeholder")]
        captured = tuple(signature(v) for v, s in zip(vals, specs) if s.kind.name == "USER_INPUT")
        outputs = list(program.graph_signature.output_specs)
        return cls(graph, specs, outputs, constants, program.call_spec.out_spec, captured)


def lifted_constants(program) -> dict:
    """The tensors an exported program's code made (a scale, a mask's fill value), by name."""
    specs = program.graph_signature.input_specs
    return {s.target: program.constants[s.target] for s in specs if s.kind.name == "CONSTANT_TENSOR"}


def signature(x):
    """What an exported graph fixes about an input: a tensor's shape and dtype, else its value."""
    if isinstance(x, torch.Tensor):
        return (tuple(int(d) for d in x.shape), str(x.dtype).replace("torch.", ""))
    return x


def meta_twin(model: torch.nn.Module) -> torch.nn.Module:
    """A copy of ``model`` whose parameters and buffers are on the meta device (tied ones still tied),
    made without copying their storage: what a later export at other shapes reads."""
    memo: dict[int, torch.Tensor] = {}
    for t in itertools.chain(model.parameters(), model.buffers()):
        meta = t.detach().to("meta")
        memo[id(t)] = torch.nn.Parameter(meta, t.requires_grad) if isinstance(t, torch.nn.Parameter) else meta
    return copy.deepcopy(model, memo)


class Derive:
    """The rank's graph for inputs of another signature or mode, from ``layout`` (see the module)."""

    def __init__(self, twin: torch.nn.Module, layout: Layout, local_forward, device: torch.device):
        self.twin, self.layout, self.local_forward, self.device = twin, layout, local_forward, device
        # the constants the model's code makes (a scale, a mask's fill value), as the first capture made
        # them on the model's device: the twin's are made on the meta device and hold no value
        self.constants = lifted_constants(layout.program)

    def __call__(self, args: tuple, kwargs: dict, training: bool) -> RankGraph:
        meta_args, meta_kwargs = pytree.tree_map(_on_meta, (tuple(args), dict(kwargs)))
        self.twin.train(training)
        with warnings.catch_warnings(), torch.enable_grad():
            warnings.simplefilter("ignore")  # the pairs kept replicated were warned of at parallelize
            layout = find_layout(
                self.twin,
                meta_args,
                self.layout.tp,
                sequence_parallel=self.layout.sequence_parallel,
                kwargs=meta_kwargs,
            )
        _check_same(self.layout, layout, training)
        entry = RankGraph.of(layout, self.local_forward(layout))
        entry.constants = {k: self._valued(k, v) for k, v in entry.constants.items()}
        return entry

    def _valued(self, name: str, t: torch.Tensor) -> torch.Tensor:
        """A constant of the new capture with its value: the first capture's of that name, shape and
        dtype where the twin made it on the meta device."""
        if t.device.type != "meta":
            return t.to(self.device)
        first = self.constants.get(name)
        if first is None or first.shape != t.shape or first.dtype != t.dtype or first.device.type == "meta":
            raise ValueError(
                f"recompile_opt.parallelize: the model's constant {name} {tuple(t.shape)} made in its "
                "forward differs at these inputs from the one captured first; make it a buffer "
                "(register_buffer) so that its value is kept"
            )
        return first


def _on_meta(x):
    return torch.empty(x.shape, dtype=x.dtype, device="meta") if isinstance(x, torch.Tensor) else x


def _check_same(first: Layout, again: Layout, training: bool) -> None:
    """The layout found at the new signature places every module as the first did."""
    want = {m.module: (m.style, m.placement) for m in first.modules}
    got = {m.module: (m.style, m.placement) for m in again.modules}
    for module in sorted(set(want) | set(got)):
        if want.get(module) != got.get(module):
            raise ValueError(
                f"recompile_opt.parallelize: at these inputs ({'training' if training else 'eval'} mode) "
                f"module {module!r} would be laid out as {got.get(module)}, not as the model's layout "
                f"{want.get(module)}; parallelize a fresh model for these inputs"
            )
