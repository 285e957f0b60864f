"""One graph's compile, from the options to the published plan: the order of the steps, nothing else.

Options are parsed; a hand tensor-parallel graph is made sequence parallel; the graph is compiled on the
path the options name (:mod:`recompile_opt.compile_paths`, ``chunks="auto"`` chosen there by
:mod:`recompile_opt.chunk_driver`), its partitioner planning each joint graph
(:mod:`recompile_opt.partitioner`, :func:`recompile_opt.planning.plan_joint_graph`) with the process's
:data:`~recompile_opt.partitioner.MEMORY`; the plans are published and cached
(:mod:`recompile_opt.plan_cache`).
"""

from __future__ import annotations

import torch.fx as fx

from recompile_opt.compile_paths import compile_eager, compile_inductor, note, sequence_parallel_of
from recompile_opt.options import parse_options
from recompile_opt.partitioner import RecompilePartitioner
from recompile_opt.plan_cache import plan_key, record


def compile_graph(gm: fx.GraphModule, example_inputs, options):
    """The backend's work for one Dynamo graph: a compiled callable, its plans published."""
    opts = parse_options(options)
    partitioner = RecompilePartitioner(opts)
    sequence = sequence_parallel_of(gm, opts)
    key = plan_key(gm, example_inputs, partitioner)
    if opts.compiler == "eager":
        compiled = compile_eager(gm, example_inputs, partitioner)
    else:
        compiled = compile_inductor(gm, example_inputs, partitioner)
    note(partitioner, sequence)
    record(partitioner, key, opts)
    return compiled
