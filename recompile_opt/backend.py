"""The ``recompile_opt`` torch.compile backend: Inductor's ``compile_fx`` with our partitioner.

Inductor's decompositions, joint-graph passes and code generation all still run; we only replace the
partitioner (``torch._inductor.config.custom_partitioner_fn``), which sees the joint graph after
Inductor's joint passes, plans it, and splits it. ``compiler="eager"`` runs the same decompositions,
joint passes and partitioner through AOTAutograd without code generation (fast tests, and the
capture-only path of :func:`recompile_opt.plan`). This module is the entry point and its errors; the
steps are :mod:`recompile_opt.driver`'s.

Caching: the partitioner's ``uuid()`` hashes our source files and the options, so Inductor's caches
never replay another configuration's partition; plans are cached beside them
(:mod:`recompile_opt.plan_cache`).
"""

from __future__ import annotations

import inspect

import torch.fx as fx

from recompile_opt import _torch_internals as ti
from recompile_opt.driver import compile_graph
from recompile_opt.options import OptionError
from recompile_opt.plan_cache import last_plans, reset_plans
from recompile_opt.planner.search import InfeasibleBudget

__all__ = ["recompile_opt_backend", "last_plans", "reset_plans", "OptionErrorInCompile"]


class OptionErrorInCompile(OptionError, ti.BackendCompilerFailed):
    """An :class:`OptionError` raised inside ``torch.compile``, that is also Dynamo's own
    ``BackendCompilerFailed``: Dynamo wraps any other exception of a backend in a new
    ``BackendCompilerFailed`` (``except OptionError`` then missed it; the error was only its
    ``inner_exception``), but re-raises its own as they are. So ``except recompile_opt.OptionError``
    catches it, and so does code that catches Dynamo's wrapper; ``str()`` opens with our message."""

    def __init__(self, error: OptionError, frame=None):
        # frame: where Dynamo starts the traceback it shows (ours, not its own internals)
        ti.BackendCompilerFailed.__init__(self, recompile_opt_backend, error, frame)
        self.args = (str(error),)  # Dynamo appends its hints after this first line


class InfeasibleBudgetInCompile(InfeasibleBudget, OptionErrorInCompile):
    """:class:`InfeasibleBudget` (``strict=True``) raised inside ``torch.compile``; see
    :class:`OptionErrorInCompile`."""


def _in_compile(error: OptionError, frame) -> OptionErrorInCompile:
    cls = InfeasibleBudgetInCompile if isinstance(error, InfeasibleBudget) else OptionErrorInCompile
    return cls(error, frame).with_traceback(error.__traceback__)


def recompile_opt_backend(gm: fx.GraphModule, example_inputs, options=None, **kwargs):
    """The entry point torch.compile calls: ``torch.compile(m, backend="recompile_opt", options={...})``.

    Options are read here, at the first call (``torch.compile`` is lazy); a bad one, or an unmeetable
    limit under ``strict=True``, raises an error that ``except recompile_opt.OptionError`` (or
    ``InfeasibleBudget``) catches through Dynamo (:class:`OptionErrorInCompile`)."""
    try:
        return compile_graph(gm, example_inputs, options)
    except OptionErrorInCompile:
        raise
    except OptionError as e:
        raise _in_compile(e, inspect.currentframe()) from None
