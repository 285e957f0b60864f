"""Every private PyTorch API recompile_opt depends on, in one place.

A torch upgrade should touch only this module. Each name is re-exported under a stable local name
and grouped by the torch module it comes from. Supported: ``2.11 <= torch < 2.16`` (checked on import,
:func:`check_torch_version`; ``pyproject.toml`` states the same range). Where an API changed inside the
range, the wrapper here feature-detects the installed form (a parameter, an attribute) rather than
comparing versions, and says which torch has which.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import inspect
import os
import re
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, NamedTuple

import torch

SUPPORTED_TORCH = ((2, 11), (2, 16))  # (major, minor): the first supported, the first not supported


def parse_torch_version(version) -> tuple[int, int, int]:
    """``(major, minor, patch)`` of a torch version string: ``"2.14.1+cu130"`` -> ``(2, 14, 1)``; a
    pre-release or local build counts as its release (``"2.16.0a0+git1234"`` -> ``(2, 16, 0)``)."""
    m = re.match(r"\s*(\d+)\.(\d+)(?:\.(\d+))?", str(version))
    if m is None:
        raise ImportError(f"recompile_opt: cannot read the installed torch's version {str(version)!r}")
    return int(m.group(1)), int(m.group(2)), int(m.group(3) or 0)


def check_torch_version(version=None) -> tuple[int, int, int]:
    """The installed torch's (or ``version``'s) ``(major, minor, patch)``; ImportError outside the
    supported range. Runs on import, before the private imports below, so an unsupported torch fails
    with this message rather than with whichever private name it lacks."""
    version = str(torch.__version__ if version is None else version)
    parsed = parse_torch_version(version)
    (lo_major, lo_minor), (hi_major, hi_minor) = SUPPORTED_TORCH
    if not (lo_major, lo_minor) <= parsed[:2] < (hi_major, hi_minor):
        raise ImportError(
            f"recompile_opt supports {lo_major}.{lo_minor} <= torch < {hi_major}.{hi_minor}; "
            f"torch {version} is installed "
            f"(pip install 'torch>={lo_major}.{lo_minor},<{hi_major}.{hi_minor}')"
        )
    return parsed


TORCH_VERSION = check_torch_version()

# the private imports below come after the version check (E402 is off for this project)
from torch._C import DispatchKey
from torch._decomp import global_decomposition_table
from torch._dynamo import config as dynamo_config
from torch._dynamo.backends.common import aot_autograd
from torch._dynamo.exc import BackendCompilerFailed
from torch._functorch import config as functorch_config
from torch._functorch._aot_autograd import graph_compile as _graph_compile
from torch._functorch._aot_autograd.graph_compile import collect_fw_donated_buffer_idxs
from torch._functorch._aot_autograd.utils import _is_primal, _is_tangent
from torch._functorch.aot_autograd import make_boxed_func
from torch._functorch.compile_utils import raise_getitems
from torch._functorch.partitioners import (
    _extract_fwd_bwd_modules,
    _extract_fwd_bwd_outputs,
    _extract_graph_with_inputs_outputs,
    _is_backward_state,
    _is_bwd_seed_offset,
    _is_fwd_seed_offset,
    _must_be_in_backward,
    _must_be_in_forward,
    classify_nodes,
    functionalize_rng_ops,
    min_cut_rematerialization_partition,
    reordering_to_mimic_autograd_engine,
)
from torch._guards import TracingContext, detect_fake_mode, tracing
from torch._inductor import compile_fx as _compile_fx_module
from torch._inductor import config as inductor_config
from torch._inductor import cpu_vec_isa
from torch._inductor import ir as inductor_ir
from torch._inductor.compile_fx import _recursive_post_grad_passes, compile_fx
from torch._inductor.compile_fx import fake_tensor_prop as inductor_fake_tensor_prop
from torch._inductor.compile_fx import partition_fn as inductor_partition_fn
from torch._inductor.cpp_builder import CppBuilder
from torch._inductor.custom_graph_pass import CustomPartitionerFn, get_hash_for_files
from torch._inductor.debug import DebugContext
from torch._inductor.decomposition import select_decomp_table
from torch._inductor.fx_passes.post_grad import view_to_reshape
from torch._inductor.graph import GraphLowering
from torch._inductor.runtime.cache_dir_utils import cache_dir
from torch._inductor.virtualized import V
from torch._ops import OpOverload
from torch._subclasses.fake_tensor import FakeTensorMode, unset_fake_temporarily
from torch.fx.experimental.proxy_tensor import is_sym_node, make_fx
from torch.utils.checkpoint import CheckpointPolicy
from torch.utils.flop_counter import flop_registry, register_flop_formula


def _is_opaque_node(node) -> bool:
    """Whether ``node``'s value is an opaque object (a script object, a registered opaque type such as a
    process group) rather than a tensor or a symbol. torch 2.12 and later define this as
    ``graph_compile.is_opaque_node``; this is the same test for 2.11, which lacks it."""
    from torch._library.fake_class_registry import FakeScriptObject
    from torch._library.opaque_object import is_opaque_value

    if not isinstance(node, torch.fx.Node) or "val" not in node.meta:
        return False
    val = node.meta["val"]
    return is_opaque_value(val) or isinstance(val, (torch.ScriptObject, FakeScriptObject))


is_opaque_node = getattr(_graph_compile, "is_opaque_node", _is_opaque_node)


_EXTRACT_PARAMETERS = inspect.signature(_extract_fwd_bwd_modules).parameters


def extract_fwd_bwd_modules(
    gm,
    saved_values,
    *,
    saved_sym_nodes,
    saved_opaque_nodes,
    num_fwd_outputs,
    static_lifetime_input_nodes=None,
):
    """torch's ``_extract_fwd_bwd_modules``: the forward outputs the saved values, symbols and opaque
    nodes, the backward takes them first. torch 2.12 and later take the opaque nodes apart
    (``saved_opaque_nodes``); 2.11 has no such parameter and instead moves the fake script objects it
    finds among ``saved_values`` after the tensors (and before the symbols), where its runtime looks for
    them, so there they go in with the saved values."""
    if "saved_opaque_nodes" in _EXTRACT_PARAMETERS:
        return _extract_fwd_bwd_modules(
            gm,
            saved_values,
            saved_sym_nodes=saved_sym_nodes,
            saved_opaque_nodes=saved_opaque_nodes,
            num_fwd_outputs=num_fwd_outputs,
            static_lifetime_input_nodes=static_lifetime_input_nodes,
        )
    return _extract_fwd_bwd_modules(
        gm,
        [*saved_values, *saved_opaque_nodes],
        saved_sym_nodes,
        num_fwd_outputs=num_fwd_outputs,
        static_lifetime_input_nodes=static_lifetime_input_nodes,
    )


def inductor_partition_fn_with(partitioner):
    """Inductor's partition function (its joint-graph passes, then a partitioner) with ``partitioner``
    in place of Inductor's own, for an ``aot_autograd`` backend that is not Inductor. torch 2.13 and
    later take it as ``partitioner_fn_override``; on 2.11 and 2.12 the same steps are written out here
    from their ``compile_fx.partition_fn``. Either way ``partitioner`` gets no ``compiler`` argument."""
    if "partitioner_fn_override" in inspect.signature(inductor_partition_fn).parameters:
        return functools.partial(inductor_partition_fn, partitioner_fn_override=partitioner)
    return functools.partial(_partition_with, partitioner)


def _partition_with(partitioner, gm, joint_inputs, **kwargs):
    """torch 2.11/2.12's ``compile_fx.partition_fn`` up to its choice of partitioner, then ``partitioner``."""
    with _compile_fx_module.get_cuda_device_context(gm):
        devices = _compile_fx_module.get_inputs_devices(joint_inputs, gm)
        gm = _compile_fx_module._recursive_joint_graph_passes(
            gm, skip_invoke_subgraph=True, input_device=next(iter(devices))
        )
    return partitioner(gm, joint_inputs, **kwargs)


__all__ = [
    "BackendCompilerFailed",
    "TORCH_VERSION",
    "SUPPORTED_TORCH",
    "check_torch_version",
    "parse_torch_version",
    "concrete_size",
    "CheckpointPolicy",
    "CustomPartitionerFn",
    "cache_dir",
    "FakeTensorMode",
    "V",
    "_extract_fwd_bwd_modules",
    "_extract_fwd_bwd_outputs",
    "_extract_graph_with_inputs_outputs",
    "_is_backward_state",
    "_is_bwd_seed_offset",
    "_is_fwd_seed_offset",
    "_must_be_in_backward",
    "_must_be_in_forward",
    "dce_impure_random",
    "_is_primal",
    "_is_tangent",
    "aot_autograd",
    "classify_nodes",
    "compile_fx",
    "detect_fake_mode",
    "dynamo_config",
    "flop_registry",
    "register_flop_formula",
    "functionalize_rng_ops",
    "functorch_config",
    "get_hash_for_files",
    "inductor_config",
    "inductor_partition_fn",
    "inductor_partition_fn_with",
    "extract_fwd_bwd_modules",
    "is_sym_node",
    "make_boxed_func",
    "make_fx",
    "min_cut_rematerialization_partition",
    "raise_getitems",
    "reordering_to_mimic_autograd_engine",
    "select_decomp_table",
    "schema_argument",
    "functionalized_call",
    "functionalized_writes",
    "is_collective_op",
    "collective_name",
    "is_all_gather",
    "is_wait_tensor",
    "group_size",
    "inner_static_indices",
    "rng_state_bytes",
    "no_graph_codegen",
    "composite_autograd_on_meta",
    "allocator_records",
    "cpp_build_timer",
    "on_fresh_stack",
    "inductor_wrapper_code",
    "compiled_wrapper_code",
    "lower_backward_eagerly",
    "bw_donated_inputs",
    "codegen_settings",
    "buffer_pool",
    "buffer_pool_patch",
    "CPU_OFFLOAD_PREFIX",
    "offload_ops_available",
    "offload_activations",
    "offload_copies_overlap",
    "offload_waits",
    "offload_wait_after",
    "offload_reloads",
    "is_offload_wait",
    "real_tensors",
    "WrapperCode",
    "strided_shard",
    "is_strided_shard",
    "functional_collectives",
    "FunctionalCollectives",
    "is_opaque_node",
    "layout_optimized",
]


def allocator_records(prof) -> list[tuple[int, int, int, torch.device]]:
    """``(time_ns, address, signed_bytes, device)`` of every allocator report in a finished
    ``torch.profiler.profile`` run, in time order. Why the experimental event tree rather than the kineto
    ``[memory]`` events: only the tree carries the block's address, and the address is what tells a free
    of a block allocated inside the window from a free of an older block (whose size the CPU allocator
    may still know from an earlier profiling window, so it is reported)."""
    from torch._C._profiler import _EventType

    records, stack = [], list(reversed(prof.profiler.kineto_results.experimental_event_tree()))
    while stack:  # pre-order, so records with equal times keep the tree's order
        node = stack.pop()
        stack.extend(reversed(node.children))
        if node.tag == _EventType.Allocation:
            f = node.extra_fields
            records.append((node.start_time_ns, f.ptr, f.alloc_size, f.device))
    records.sort(key=lambda r: r[0])  # stable
    return records


@contextlib.contextmanager
def cpp_build_timer():
    """Yields ``{"builds": n, "s": seconds}``, filled in as the block runs: Inductor's in-process calls of
    the C++ compiler (``CppBuilder.build``) and the wall time during which at least one ran. Why: on
    the CPU a cold compile is mostly these builds (about 1.3 s per kernel module with one compile
    thread), so the bench shows how much of a compile is kernels and how much is ours. Builds in
    compile worker processes (``TORCHINDUCTOR_COMPILE_THREADS`` > 1) are not seen."""
    stats, lock, original = {"builds": 0, "s": 0.0}, threading.Lock(), CppBuilder.build
    running, since = 0, 0.0

    def build(self):
        nonlocal running, since
        with lock:
            since = time.perf_counter() if not running else since
            running += 1
            stats["builds"] += 1
        try:
            return original(self)
        finally:
            with lock:
                running -= 1
                if not running:
                    stats["s"] += time.perf_counter() - since

    CppBuilder.build = build
    try:
        yield stats
    finally:
        CppBuilder.build = original


@contextlib.contextmanager
def no_graph_codegen():
    """GraphModules built inside skip their Python code generation (``GraphModule.recompile``): the
    least-peak search partitions a graph 10-20 times only to read the partitioned graphs' nodes, and
    codegen was a third of that time. Such modules cannot be called."""
    saved = torch.fx.GraphModule.recompile
    torch.fx.GraphModule.recompile = lambda self: None
    try:
        yield
    finally:
        torch.fx.GraphModule.recompile = saved


@functools.cache
def _composite_ops() -> tuple:
    """The ops of torch's decomposition tables with a C++ CompositeImplicitAutograd kernel; those with a
    Python Meta kernel over it are torch's refs and meta registrations (``nll_loss``, ``var_mean``,
    ``where``, ...: 108 on 2.13, 152 on 2.11)."""
    ops = {op for table in global_decomposition_table.values() for op in table if isinstance(op, OpOverload)}
    return tuple(
        op
        for op in ops
        if torch._C._dispatch_has_kernel_for_dispatch_key(op.name(), "CompositeImplicitAutograd")
    )


@contextlib.contextmanager
def composite_autograd_on_meta():
    """Inside, the ops of :func:`_composite_ops` have no Python Meta kernel, so on meta tensors they
    decompose above autograd as on every other device, and as eager meta does.

    Why: under the Python dispatcher (AOTAutograd's tracing) a Python kernel for the Meta key counts as
    a backend kernel of AutogradMeta, so the op skips its composite and reaches autograd's
    not-implemented fallback (torch's warning: "aten::nll_loss: an autograd kernel was not
    registered"): on meta ``F.cross_entropy``, ``torch.where`` and ``var`` traced joint graphs whose
    backward never read the tangent. Restored on exit, each op's dispatch cache cleared both ways; one
    inside another finds nothing to set aside. Not for two threads at once: the kernels are global
    (Dynamo's compile lock serialises captures)."""
    removed = {}
    try:
        for op in _composite_ops():
            if DispatchKey.Meta in op.py_kernels:
                removed[op] = op.py_kernels.pop(DispatchKey.Meta)
                op._dispatch_cache.clear()
        yield
    finally:
        for op, kernel in removed.items():
            op.py_kernels[DispatchKey.Meta] = kernel
            op._dispatch_cache.clear()


@contextlib.contextmanager
def real_tensors():
    """Real tensors made and ops run inside, even within a compile's fake mode (the planner measures a
    kernel's scratch while Inductor traces with fake tensors)."""
    with unset_fake_temporarily():
        yield


# raised by a torch.compile'd function before any of its kernels ran: its compile failed (Dynamo's or
# Inductor's error), or it hit Dynamo's recompile limit (fullgraph=True raises there)
COMPILE_ERRORS = (torch._dynamo.exc.TorchDynamoException, torch._dynamo.exc.FailOnRecompileLimitHit)


def is_recompile_limit(error: BaseException) -> bool:
    """Whether ``error`` is Dynamo's recompile limit, reached by a function compiled with fullgraph."""
    return isinstance(error, torch._dynamo.exc.FailOnRecompileLimitHit)


def mark_rows_dynamic(*tensors: torch.Tensor) -> None:
    """Dim 0 of each tensor compiled as a symbolic size where it is not 0 or 1 (Dynamo's
    ``maybe_mark_dynamic``): one compile of a chunk body serves chunks of any rows."""
    for t in tensors:
        torch._dynamo.maybe_mark_dynamic(t, 0)


def concrete_size(x) -> int:
    """A number for a possibly symbolic size: its upper bound where the shape environment has a finite
    one (``torch._dynamo.mark_dynamic(t, dim, max=...)``), else its hint (its value at the first call)."""
    if not isinstance(x, torch.SymInt):
        return int(x)
    node = x.node
    try:
        upper = node.shape_env.bound_sympy(node.expr).upper
        if upper.is_number and upper.is_finite and int(upper) < 2**62:
            return int(upper)
    except (AttributeError, TypeError, ValueError):
        pass
    return int(node.hint) if node.hint is not None else 1


def copy_dynamo_graph(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """A deep copy of a Dynamo graph that AOTAutograd still reads as Dynamo's: ``copy.deepcopy`` drops
    the module's ``_param_name_to_source`` and each placeholder's ``_dynamo_source``, from which
    AOTAutograd learns which inputs are parameters (``frontend_utils``: static inputs). Without them a
    copy's plan counted the parameters its chunked MLPs read as kept bytes (4.1 MiB on the Llama)."""
    import copy

    out = copy.deepcopy(gm)
    if hasattr(gm, "_param_name_to_source"):
        out._param_name_to_source = gm._param_name_to_source
    for mine, theirs in zip(gm.graph.find_nodes(op="placeholder"), out.graph.find_nodes(op="placeholder")):
        if hasattr(mine, "_dynamo_source"):
            theirs._dynamo_source = mine._dynamo_source
    return out


def rename_node(node: torch.fx.Node, name: str) -> None:
    """Give ``node`` the name of a node erased from its graph (fx's ``Node._rename`` would add a suffix:
    a graph's namespace keeps every name it has handed out)."""
    node.name = name
    node.graph._graph_namespace._rename_object(node, name)


def on_fresh_stack(fn, *args, **kwargs):
    """``fn(*args, **kwargs)`` on a thread of its own, under this thread's tracing context and
    context variables; waits.

    Why: CPython 3.11 keeps frames in chunks of a per-thread stack and frees a chunk as soon as the
    stack drops back below it. A partitioner runs some 50 frames deep inside Dynamo and Inductor, and
    where a chunk boundary falls at the depth of the least-peak search's hot loops, every call across
    it maps and unmaps memory: in the benchmark's worker the 2-layer GPT's planning took 7-12 s
    instead of 4 s (900k page faults against 225k, almost all in ``_PyThreadState_BumpFramePointerSlow``;
    ``perf record -e page-faults``), depending only on how deep the caller's stack was. A fresh
    thread's stack starts empty. The tracing context is thread-local (``torch._guards``), so it is
    carried over: the planning asks it what dead-code elimination keeps. So are the context variables
    (as ``asyncio.to_thread`` carries them): from torch 2.12 on, torch's config settings, patched or
    assigned, live in them, and a bare thread saw the defaults (a compile's ``fallback_random``, the
    walks' Inductor settings) where torch 2.11's global settings were seen. This thread waits
    meanwhile, so the two never change the copied state at once."""
    context, variables = TracingContext.try_get(), contextvars.copy_context()

    def run():
        with tracing(context):
            return fn(*args, **kwargs)

    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="recompile_opt-plan") as pool:
        return pool.submit(variables.run, run).result()


def dce_impure_random() -> bool:
    """Whether ``Graph.eliminate_dead_code`` keeps an unused random op, as it decides inside
    ``_extract_graph_with_inputs_outputs``: under a tracing context, Inductor's ``fallback_random``."""
    return bool(inductor_config.fallback_random) if TracingContext.try_get() else True


def schema_argument(node, name: str) -> tuple[bool, object]:
    """``(True, value)`` of the argument ``name`` an op's schema declares (from the call's keywords, its
    positional arguments, else the schema's default); ``(False, None)`` where the schema has none."""
    schema = getattr(node.target, "_schema", None)
    for i, arg in enumerate(schema.arguments if schema is not None else ()):
        if arg.name == name:
            return True, node.kwargs.get(name, node.args[i] if i < len(node.args) else arg.default_value)
    return False, None


def functionalized_call(node) -> tuple[object, list] | None:
    """``(op, args)`` of a functionalised mutation (``auto_functionalized`` or its v2, as AOTAutograd
    writes a custom op that mutates an input): the op it wraps and its arguments in the op's schema order,
    a mutated one as the node it mutates (v2: its base); None for any other node. Why: a cost read off
    the wrapped op (its FLOPs), which the higher-order op does not state."""
    if getattr(node.target, "__name__", None) not in ("auto_functionalized", "auto_functionalized_v2"):
        return None
    op, kwargs = node.args[0], node.kwargs
    bases = kwargs.get("_all_bases", [])
    args = []
    for arg in op._schema.arguments:
        if arg.name in kwargs:
            args.append(kwargs[arg.name])
        else:
            index = kwargs.get(f"_{arg.name}_base_index")
            args.append(bases[index] if index is not None else arg.default_value)
    return op, args


def functionalized_writes(node) -> dict[int, object]:
    """``{output index: the node it is the new value of}`` for a functionalised mutation
    (``auto_functionalized``: the mutated arguments; v2: its bases); ``{}`` for any other node. Its
    outputs are the op's own, then one per mutated buffer, in that order (the last ones of ``val``).
    Why: Inductor writes the op over that buffer where nothing reads it afterwards
    (``reinplace_inplaceable_ops``), so the peak model allocates nothing for it there."""
    name = getattr(node.target, "__name__", None)
    if name not in ("auto_functionalized", "auto_functionalized_v2"):
        return {}
    if name == "auto_functionalized_v2":
        written = list(node.kwargs.get("_all_bases", []))
    else:
        schema = node.args[0]._schema
        written = [node.kwargs[a.name] for a in schema.arguments if a.alias_info and a.alias_info.is_write]
    val = node.meta.get("val")
    count = len(val) if isinstance(val, (tuple, list)) else 0
    offset = count - len(written)
    if offset < 0:
        return {}
    return {offset + j: w for j, w in enumerate(written) if isinstance(w, torch.fx.Node)}


def is_collective_op(target) -> bool:
    """Functional collectives (and their waits). Only an all-gather is ever recomputed: every rank runs
    the same plan, so a re-gather in the backward is matched on every rank, and it reads a kept shard;
    a reduction recomputed would add the ranks' partial sums a second time."""
    namespace = getattr(target, "namespace", "")
    return namespace in ("_c10d_functional", "c10d_functional", "_dtensor")


def collective_name(target) -> str:
    """``all_gather_into_tensor``, ``reduce_scatter_tensor``, ``all_reduce``, ``wait_tensor``,
    ... ('' if none)."""
    if not is_collective_op(target):
        return ""
    packet = getattr(target, "_overloadpacket", None)
    return getattr(packet, "__name__", str(target)).rsplit(".", 1)[-1]


def inner_static_indices(gm: torch.fx.GraphModule, static: list[int] | None) -> list[int] | None:
    """The primals of the joint graph that are static inputs (parameters, buffers), as indices of its
    placeholders. Why: where an input is a tensor subclass (a DTensor parameter: its local tensor and
    its mesh), AOTAutograd (2.13) hands the partitioner ``static_lifetime_input_indices`` counted over
    the wrapped inputs, though the graph's placeholders are the unwrapped ones; read as they are, the
    wrong placeholders were static (a mesh among them) and every sharded weight was charged as a kept
    activation. Each placeholder's ``desc`` names the wrapped input it comes from."""
    if not static:
        return static
    primals = [n for n in gm.graph.find_nodes(op="placeholder") if _is_primal(n)]
    outer = [_wrapped_index(n.meta.get("desc")) for n in primals]
    if all(o == i for i, o in enumerate(outer)) or any(o is None for o in outer):
        return static  # nothing unwrapped (or no descriptors): the indices are the placeholders'
    wanted = set(static)
    return [
        i for i, o in enumerate(outer) if o in wanted and isinstance(primals[i].meta.get("val"), torch.Tensor)
    ]


def _wrapped_index(desc) -> int | None:
    """The index of the wrapped input an AOT input descriptor comes from (through subclass attributes)."""
    while desc is not None and not hasattr(desc, "idx"):
        desc = getattr(desc, "base", None)
    return getattr(desc, "idx", None)


def process_group(group_name):
    """The process group a traced collective names (its last argument), or None where this process has
    none by that name (a graph planned on a fake or absent group)."""
    try:
        import torch.distributed.distributed_c10d as c10d

        return c10d._resolve_process_group(group_name)
    except Exception:
        return None


def default_store():
    """The key-value store the default process group met through (TCP or file), or None."""
    try:
        import torch.distributed.distributed_c10d as c10d

        return c10d._get_default_store()
    except Exception:
        return None


def group_size(group_name) -> int:
    """The size of the process group a traced collective names (2 where this process has no such group)."""
    try:
        import torch.distributed.distributed_c10d as c10d

        return c10d._get_group_size_by_name(group_name)
    except Exception:
        return 2


def is_all_gather(target) -> bool:
    return collective_name(target) in ("all_gather_into_tensor", "all_gather_into_tensor_out")


def is_wait_tensor(target) -> bool:
    """``wait_tensor``: returns its input once the collective that makes it is done (an alias)."""
    return collective_name(target) == "wait_tensor"


def graph_changing_state() -> str:
    """The process state, besides the Dynamo graph and its inputs, that changes the joint graph
    AOTAutograd traces, as its own cache keys it (``AOTAutogradCacheDetails._record_runtime_state``):
    grad mode, each device's autocast dtype, deterministic algorithms. Why: a model compiled under
    ``torch.autocast`` outside the compiled region has the same Dynamo graph as without it."""
    autocast = {
        d: str(torch.get_autocast_dtype(d))
        for d in torch._C._autocast_supported_devices()
        if torch.is_autocast_enabled(d)
    }
    return repr(
        (torch.is_grad_enabled(), sorted(autocast.items()), torch.are_deterministic_algorithms_enabled())
    )


def rng_state_bytes(device: torch.device) -> int:
    """Bytes of the RNG state that replaying one random op keeps (CPU: the whole Mersenne state)."""
    if device.type == "cuda":
        return 16  # seed + offset of the Philox generator
    return int(torch.get_rng_state().numel())


class WrapperCode(NamedTuple):
    """What :func:`inductor_wrapper_code` reads off Inductor's lowering of one graph."""

    code: str  # the Python wrapper's source
    sizes: dict[str, int]  # buffer -> bytes
    multi: dict[str, list[str]]  # a multi-output call -> its output buffers, in order
    # an extern kernel's buffer -> (the FX nodes it runs, the (size, stride) of its tensor inputs as
    # Inductor lays them out: channels-last where it chose so)
    externs: dict[str, tuple[list, list | None]]
    output_strides: list[tuple | None]  # each graph output's strides (None: not a tensor)
    origins: dict[str, str]  # buffer -> the name of the FX node whose value it holds, where one does
    pooled: frozenset[str]  # dead buffers the wrapper held for a later allocation (not in place)


def inductor_wrapper_code(
    gm: torch.fx.GraphModule,
    *,
    backward: bool,
    donated: list[int] | None = None,
    input_strides: dict[str, tuple] | None = None,
) -> WrapperCode:
    """The Python wrapper Inductor generates for ``gm`` (a partitioned forward or backward whose nodes
    carry fake ``val``s), without compiling any kernel, and what it says about buffers (:class:`WrapperCode`).

    The steps are ``fx_codegen_and_compile``'s up to code generation: Inductor's post-grad passes, then
    lowering, scheduling (fusion) and code generation (kernels as source, buffer reuse planned). ``gm``
    is changed by the post-grad passes. ``donated``: the backward's inputs AOTAutograd donates (saved
    activations nothing else holds; :func:`bw_donated_inputs`), which Inductor may write over.
    ``input_strides``: placeholder name -> the strides its tensor really has (AOTAutograd restrides the
    backward's saved inputs to the forward's output strides where Inductor chose another layout,
    ``graph_compile``'s "saved activations can have different stride")."""
    example = [n.meta["val"] for n in gm.graph.find_nodes(op="placeholder")]
    fake_mode = detect_fake_mode(example)
    if input_strides:
        example = [
            v.as_strided(v.shape, input_strides[n.name]) if n.name in input_strides else v
            for n, v in zip(gm.graph.find_nodes(op="placeholder"), example)
        ]
    # outside the caller's tracing context: lowering may record into it (output strides) for the
    # graph the caller is compiling
    # a user's custom post-grad passes are the real compile's: run on candidate graphs they would count
    # or log graphs that never run (the benchmark's FLOP counter summed the walks' backward graphs)
    no_custom = {"post_grad_custom_pre_pass": None, "post_grad_custom_post_pass": None}
    with (
        tracing(None),
        V.set_fake_mode(fake_mode),
        DebugContext(),
        inductor_config.patch(no_custom),
        _scalar_cpp_kernels(),
        not_recorded(),
    ):
        if input_strides:  # as fx_codegen_and_compile does: the graph's values re-derived from its inputs
            view_to_reshape(gm)
            with torch.no_grad():
                inductor_fake_tensor_prop(gm, example)
        _recursive_post_grad_passes(gm, is_inference=False)
        graph = GraphLowering(
            gm,
            example_inputs=example,
            shape_env=fake_mode.shape_env,
            is_inference=False,
            is_backward=backward,
        )
        if backward:
            graph.bw_donated_idxs = list(donated or ())
        with V.set_graph_handler(graph):
            graph.run(*example)
            return _wrapper_code_of(graph, graph.codegen()[0].value)


def _wrapper_code_of(graph: GraphLowering, code: str) -> WrapperCode:
    """What a lowered graph's buffers say, beside its wrapper ``code`` (:class:`WrapperCode`)."""
    sizes, outputs, externs, origins = {}, {}, {}, {}
    for name, buf in graph.name_to_buffer.items():
        node = getattr(buf, "origin_node", None) or next(iter(getattr(buf, "origins", ()) or ()), None)
        if node is not None:
            origins[name] = node.name
        if isinstance(buf, inductor_ir.ExternKernel) and not isinstance(buf, inductor_ir.MultiOutput):
            externs[name] = (list(buf.origins), _input_layouts(buf, graph))
        layout = getattr(buf, "layout", None)
        if layout is None or isinstance(layout, (inductor_ir.MultiOutputLayout, inductor_ir.NoneLayout)):
            continue
        sizes[name] = int(graph.sizevars.optimization_hint(layout.storage_size())) * layout.dtype.itemsize
        if node is not None and node.meta.get("host_resident"):  # a copy on the host (offload_activations)
            sizes[name] = 0
        if isinstance(buf, inductor_ir.MultiOutput) and buf.inputs:
            outputs.setdefault(buf.inputs[0].get_name(), []).append(name)
    strides = [_output_stride(graph, out) for out in graph.graph_outputs]
    return WrapperCode(code, sizes, outputs, externs, strides, origins, _pool_reuses(graph))


def _pool_reuses(graph: GraphLowering) -> frozenset[str]:
    """The dead buffers the wrapper's memory planning handed to a later allocation: their free line
    (``FreeIfNotReusedLine``) marked reused. A buffer written over in place by the kernel that reads
    it last (``inplace_buffers``) has no such line: the same ``# reuse`` in the code is no pool's."""
    lines = getattr(getattr(graph, "wrapper_code", None), "lines", ())
    return frozenset(
        line.node.get_name()
        for line in lines
        if type(line).__name__ == "FreeIfNotReusedLine" and getattr(line, "is_reused", False)
    )


# Graphs Inductor generates code for while :func:`compiled_wrapper_code` records on this thread.
_RECORDING = threading.local()


@contextlib.contextmanager
def compiled_wrapper_code():
    """Yields a list that receives ``(is_backward, WrapperCode)`` for each graph Inductor compiles on
    this thread while the block runs; the planner's own lowerings (:func:`inductor_wrapper_code`) are
    not recorded, nor C++-wrapper code (not Python).

    Why: a plan's exact peak is read off the code Inductor generates for it (costs/inductor_peak.py).
    Where the plan is final before that code exists (the plan a fractional budget takes), lowering it
    a second time for the walk cost as much as Inductor's own lowering (1.5-3 s a plan, both graphs on
    this machine); the compile's own code is the same code, with its real strides and donations.
    ``GraphLowering.codegen`` is wrapped for the block's duration (the compile holds Dynamo's lock)."""
    original, records = GraphLowering.codegen, []

    def codegen(self):
        result = original(self)
        if (
            getattr(_RECORDING, "records", None) is not None
            and not getattr(_RECORDING, "paused", False)
            and not self.cpp_wrapper
        ):
            try:
                _RECORDING.records.append((bool(self.is_backward), _wrapper_code_of(self, result[0].value)))
            except Exception:  # noqa: BLE001 - a record missed: the caller lowers the plan itself
                pass
        return result

    GraphLowering.codegen, outer = codegen, getattr(_RECORDING, "records", None)
    _RECORDING.records = records
    try:
        yield records
    finally:
        GraphLowering.codegen, _RECORDING.records = original, outer


@contextlib.contextmanager
def not_recorded():
    """Graphs Inductor compiles inside the block are not recorded by :func:`compiled_wrapper_code`
    (the planner's own lowerings, a body compiled inside an op that the plan runs)."""
    paused = getattr(_RECORDING, "paused", False)
    _RECORDING.paused = True
    try:
        yield
    finally:
        _RECORDING.paused = paused


def lower_backward_eagerly():
    """AOTAutograd compiles the backward with the forward, not at the first ``backward()`` (static
    shapes only; symbolic ones always are). Why: the plan's figures read off the backward's code are
    then known when ``torch.compile`` returns its first result, and stored with the plan."""
    return functorch_config.patch(force_non_lazy_backward_lowering=True)


def _output_stride(graph, out) -> tuple | None:
    try:
        return _hinted(graph, out.get_stride())
    except (AttributeError, NotImplementedError):  # None, a constant
        return None


def _hinted(graph, dims) -> tuple | None:
    try:
        return tuple(int(graph.sizevars.optimization_hint(d)) for d in dims)
    except (AttributeError, NotImplementedError, TypeError):
        return None


def _input_layouts(buf, graph) -> list[tuple[tuple, tuple]] | None:
    """(size, stride) of an extern kernel's tensor inputs, in order; None where one is symbolic."""
    out = []
    for inp in buf.inputs:
        try:
            size, stride = _hinted(graph, inp.get_size()), _hinted(graph, inp.get_stride())
        except (AttributeError, NotImplementedError):
            return None
        if size is None or stride is None:
            return None
        out.append((size, stride))
    return out


class FunctionalCollectives(NamedTuple):
    """torch's functional collectives, which trace into graphs as ``_c10d_functional`` ops; each takes
    the process group's name. torch 2.13 names them ``*_single``; 2.11 and 2.12 ``*_tensor``, which 2.13
    keeps as deprecated aliases that warn outside a compile."""

    all_gather: Callable  # (x, gather_dim, group): the ranks' x concatenated along gather_dim
    all_gather_autograd: Callable  # the same, its gradient reduce-scattered
    reduce_scatter_autograd: Callable  # (x, reduce_op, scatter_dim, group); its gradient all-gathered
    all_reduce: Callable  # (x, reduce_op, group)
    pending: type  # what eager calls return until waited for (``AsyncCollectiveTensor``, ``trigger_wait()``)


def functional_collectives() -> FunctionalCollectives:
    """The installed torch's :class:`FunctionalCollectives`. Imported here, when asked: torch.distributed
    is not in every build."""
    import torch.distributed._functional_collectives as funcol

    _trace_into_view_chunk_cat()

    def named(new: str, old: str):
        return getattr(funcol, new, None) or getattr(funcol, old)

    return FunctionalCollectives(
        named("all_gather_single", "all_gather_tensor"),
        named("all_gather_single_autograd", "all_gather_tensor_autograd"),
        named("reduce_scatter_single_autograd", "reduce_scatter_tensor_autograd"),
        funcol.all_reduce,
        funcol.AsyncCollectiveTensor,
    )


_VIEW_CHUNK_CAT = "torch._utils._maybe_view_chunk_cat"


def _trace_into_view_chunk_cat() -> None:
    """Let Dynamo trace into ``torch._utils._maybe_view_chunk_cat``, as torch 2.13's trace rules do; once,
    nothing where the rule is there.

    Why: the functional all-gather along a dimension other than 0 (the sequence gather) calls it, and
    torch 2.11's Dynamo skips it, so a compiled sequence-parallel model broke into a graph per gather."""
    from torch._dynamo import trace_rules
    from torch._dynamo.variables import UserFunctionVariable

    if _VIEW_CHUNK_CAT in trace_rules.manual_torch_name_rule_map:
        return
    trace_rules.manual_torch_name_rule_map[_VIEW_CHUNK_CAT] = UserFunctionVariable
    trace_rules.get_torch_obj_rule_map.cache_clear()


def strided_shard(dim: int, pieces: int):
    """DTensor's interleaved shard: a fused ``[q | k | v]`` weight split so that each rank holds its heads
    of each of the ``pieces`` (private in torch 2.13, docs/parallel-design.md Q1). Imported here, when
    asked: torch.distributed is not in every build."""
    from torch.distributed.tensor.placement_types import _StridedShard

    _redistribute_strided_shards_without_order()
    return _StridedShard(dim, split_factor=pieces)


def _redistribute_strided_shards_without_order() -> None:
    """torch 2.13's redistribution of a strided shard that encodes no shard order, installed into 2.11
    and 2.12 (which lack ``_dtensor_spec._StridedShardNotDecodableError``); once, nothing on 2.13.

    Why: 2.11 and 2.12 read every ``_StridedShard`` as FSDP2 + TP's encoding of a shard order and plan
    its redistribution by the graph-based planner, which raises ValueError where the split factor is
    no product of mesh sizes, as ours on a 1-D mesh always is: ``full_tensor()`` of a fused QKV weight
    failed. 2.13 falls back to the greedy planner there (``_gen_transform_infos_non_cached``); so does
    this, for that error only."""
    from torch.distributed.tensor import _dtensor_spec, _redistribute

    original = _redistribute._gen_transform_infos_non_cached
    if hasattr(_dtensor_spec, "_StridedShardNotDecodableError") or getattr(original, "_recompile_opt", False):
        return

    def gen_transform_infos(src_spec, dst_spec, use_graph_based_transform=None):
        try:
            return original(src_spec, dst_spec, use_graph_based_transform)
        except ValueError as e:
            if "unable to be interpreted into a corresponding shard_order" not in str(e):
                raise
            planner = _redistribute.get_redistribute_planner(src_spec.device_mesh, src_spec.tensor_meta)
            return planner.generate_greedy_transform_infos(src_spec, dst_spec)

    gen_transform_infos._recompile_opt = True
    _redistribute._gen_transform_infos_non_cached = gen_transform_infos


def is_strided_shard(placement) -> bool:
    """Whether a DTensor placement is the interleaved shard of :func:`strided_shard`."""
    return type(placement).__name__ == "_StridedShard"


def layout_optimized(gm: torch.fx.GraphModule) -> bool:
    """Whether Inductor lays this graph's convolutions out channels-last (``decide_layout_opt``: always
    on CPU with MKL-DNN). Why it matters: it copies a convolution's input and weight into that layout
    and the forward then keeps the copies for the backward, bytes the graph itself does not show."""
    return GraphLowering.decide_layout_opt(gm, is_inference=False)


@contextlib.contextmanager
def layout_optimization(enabled: bool):
    """Inductor's channels-last layout for convolutions (``config.layout_optimization``) switched on or
    off while the block runs (a plan's graphs walked in either layout)."""
    with inductor_config.patch(layout_optimization=enabled):
        yield


def buffer_pool_patch(enabled: bool) -> dict:
    """Inductor's config setting under which its wrapper may (``enabled``) or may not hand a dead buffer
    to a later allocation of the same size (``allow_buffer_reuse``; the wrapper's memory planning,
    ``FreeIfNotReusedLine`` / ``AllocateLine.should_reuse_buffer``), as ``compile_fx``'s
    ``config_patches`` take it: they hold for the backward compiled at the first backward as well.
    Writing an output in place over a dying input (``inplace_buffers``) is another setting, kept."""
    return {"allow_buffer_reuse": enabled}


def pools_buffers() -> bool:
    """Whether Inductor's wrapper may hand dead buffers to later allocations under the settings in force."""
    return bool(inductor_config.allow_buffer_reuse)


@contextlib.contextmanager
def buffer_pool(enabled: bool):
    """:func:`buffer_pool_patch` while the block runs (a plan's graphs walked as they will compile)."""
    with inductor_config.patch(buffer_pool_patch(enabled)):
        yield


def layout_setting_restored():
    """A block at whose end Inductor's layout setting is what it was at its start: around a compile
    whose partitioner may switch the layout off for the rest of that compile
    (:func:`switch_layout_optimization_off`)."""
    return inductor_config.patch(layout_optimization=inductor_config.layout_optimization)


def switch_layout_optimization_off() -> None:
    """Inductor's channels-last layout off for the rest of the compile that calls our partitioner: the
    forward and backward it lowers next read the setting (``GraphLowering.decide_layout_opt``). The one
    place where our choice crosses into Inductor's compile other than through the graphs; the backend
    restores it (:func:`layout_setting_restored`)."""
    inductor_config.layout_optimization = False


def layout_settings() -> str:
    """Inductor's layout settings, for keys of figures that depend on them."""
    return repr((inductor_config.layout_optimization, inductor_config.force_layout_optimization))


@contextlib.contextmanager
def _scalar_cpp_kernels():
    """C++ kernels written as scalar loops only, while a wrapper is generated for reading.

    Why: the C++ backend writes each kernel twice, vectorised and as a scalar tail, and that is a
    third of a walk's time; which buffers the wrapper allocates, reuses and frees does not depend on
    it (the 16 stored plans walk to the same bytes either way, ``bench/peak_accuracy.py --exact``).
    Why not ``cpp.vec_isa_ok=False``: Inductor caches the ISA list it computes under that setting
    (``valid_vec_isa_list`` is ``functools.cache``d), and every later kernel of the process came out
    scalar. Here the module's ``pick_vec_isa`` is replaced, not called, so no cache learns of it; the
    walk runs inside a compile (Dynamo's compile lock held), so no other kernel is written meanwhile."""
    real = cpu_vec_isa.pick_vec_isa
    cpu_vec_isa.pick_vec_isa = lambda: cpu_vec_isa.invalid_vec_isa
    try:
        yield
    finally:
        cpu_vec_isa.pick_vec_isa = real


def codegen_settings() -> str:
    """Inductor's and AOTAutograd's settings in force, as text: besides the graph, what decides the
    code Inductor generates for it (and so a walk of that code). The partitioner and the custom passes
    are left out: ours differs per compile, and walks run no custom pass."""
    ours = {"custom_partitioner_fn", "post_grad_custom_pre_pass", "post_grad_custom_post_pass"}
    inductor = sorted((k, repr(v)) for k, v in inductor_config.get_config_copy().items() if k not in ours)
    return repr((inductor, sorted((k, repr(v)) for k, v in functorch_config.get_config_copy().items())))


def bw_donated_inputs(fw: torch.fx.GraphModule, bw: torch.fx.GraphModule, num_fwd_outputs: int) -> list[int]:
    """The backward inputs AOTAutograd donates to Inductor (``collect_bw_donated_buffer_idxs``): saved
    tensors whose storage no forward input, user output or gradient shares. Our backward graphs take
    the saved tensors first (no symints: shapes are static)."""
    if not functorch_config.donated_buffer:
        return []

    def vals(nodes):
        return [n.meta.get("val") if isinstance(n, torch.fx.Node) else None for n in nodes]

    fw_outs = vals(fw.graph.find_nodes(op="output")[0].args[0])
    return collect_fw_donated_buffer_idxs(
        vals(fw.graph.find_nodes(op="placeholder")),
        fw_outs[:num_fwd_outputs],
        vals(bw.graph.find_nodes(op="output")[0].args[0]),
        fw_outs[num_fwd_outputs:],
    )


def cuda_allocator_settings() -> tuple[str, str]:
    """The CUDA caching allocator's settings string (``"expandable_segments:True"``) and its backend
    (``native``, ``cudaMallocAsync``): torch's own getter where it has one (2.13 has; 2.11 not, and
    there the environment tells: ``PYTORCH_ALLOC_CONF``, else ``PYTORCH_CUDA_ALLOC_CONF``)."""
    getter = getattr(torch._C, "_accelerator_getAllocatorSettings", None)
    if getter is not None:
        conf = getter()
    else:
        conf = os.environ.get("PYTORCH_ALLOC_CONF") or os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "")
    backend = torch.cuda.get_allocator_backend() if torch.cuda.is_initialized() else "native"
    return conf, backend


def backward_frees_tangents() -> bool:
    """Whether AOTAutograd hands a backward's tangents over to the compiled backward, which then frees
    each after its last use: torch 2.13 on generates a backward prologue that clears its argument list;
    before (2.11), that list holds them until the backward returns. Measured: a GPT returning its logits
    as well as its loss peaks 8 KiB (the logits' tangent) higher on 2.11 than on 2.13."""
    from torch._functorch._aot_autograd import runtime_wrappers

    return hasattr(runtime_wrappers, "_codegen_backward_prologue")


# Set where a fork failed to walk while CUDA was initialised in this process: no more are made.
_CUDA_FORK_FAILED = threading.Event()


def forkable() -> bool:
    """Whether a fork of this process may lower and walk a plan as this process would
    (:mod:`recompile_opt.costs.walk_pool`): where ``os.fork`` exists, and where CUDA is initialised
    here, until a fork has failed (:func:`fork_failed`).

    Why a fork may walk a CUDA graph: a walk lowers fake tensors and generates code; it allocates
    nothing and launches nothing. What it reads of the device (its properties, capability and index)
    is read here before forking (:func:`before_forking_walkers`) and served from torch's caches there
    (:func:`in_forked_walker`), as a DataLoader's fork works beside CUDA without touching it. torch
    refuses to initialise CUDA in a fork ("Cannot re-initialize CUDA in forked subprocess"); where a
    walk still reaches the driver there, the fork fails or does not answer in time, and its plans are
    walked here. Unchecked on a GPU so far: the GPU check's planning column says whether forks walked,
    and its fidelity part would show a walk that read the device wrongly (predicted against measured
    peaks)."""
    return hasattr(os, "fork") and not (_CUDA_FORK_FAILED.is_set() and torch.cuda.is_initialized())


def fork_failed() -> None:
    """A fork failed to walk: where CUDA is initialised here, no more forks walk (:func:`forkable`)."""
    if torch.cuda.is_initialized():
        _CUDA_FORK_FAILED.set()


def before_forking_walkers() -> dict:
    """Read here what a fork needs of the device to walk as this process would, and return it for
    :func:`in_forked_walker`. Where CUDA is initialised: every device's properties and capability are
    read now, into the caches a fork then serves them from (torch's own and Inductor's), and the
    current device's index is returned."""
    if not torch.cuda.is_initialized():
        return {}
    from torch._dynamo.device_interface import get_interface_for_device
    from torch._inductor.runtime.hints import DeviceProperties

    worker = get_interface_for_device("cuda").Worker
    for index in range(torch.cuda.device_count()):
        torch.cuda.get_device_properties(index)
        worker.get_device_properties(index)
        DeviceProperties.create(torch.device("cuda", index))
    return {"cuda_device": torch.cuda.current_device()}


def in_forked_walker(state: dict) -> int:
    """Set up a fork of this process for walks (``state`` from :func:`before_forking_walkers`);
    returns the intra-op threads this process had.

    Why: OpenMP's threads do not survive a fork, and the fork's first parallel region with more than one
    thread hangs (GNU libgomp), so the fork runs kernels on one thread; Inductor reads the thread count
    into the code it generates (``parallel_num_threads``), so it is pinned to this process's there.
    Inductor's compile workers are this process's (their pipes were copied), so the fork sends them no
    kernel (``compile_threads`` 1: on CUDA a kernel's code starts compiling where it is generated).
    Where this process had CUDA initialised, torch's lazy initialisation is skipped in the fork (it
    would raise) and the device's index and properties come from the caches read before forking."""
    inductor_config.compile_threads = 1
    index = state.get("cuda_device")
    if index is not None:  # as in a DataLoader's fork: nothing here may reach the CUDA driver
        from torch._dynamo.device_interface import get_interface_for_device

        torch.cuda._tls.is_initializing = True  # torch.cuda._lazy_init returns at once on this thread
        interface = get_interface_for_device("cuda")
        torch.cuda.current_device = torch.cuda.random.current_device = lambda: index
        interface.current_device = staticmethod(lambda: index)
        interface.Worker.set_device(index)
    threads = torch.get_num_threads()
    if threads > 1:
        if inductor_config.cpp.threads < 1:
            inductor_config.cpp.threads = threads
        torch.set_num_threads(1)
    return threads


# -- torch._functorch._activation_offloading: offloaded activations (issue 50) --------------------------
# torch 2.11-2.15 all have ``enable_activation_offloading(fw, bw, num_fwd_outputs, static_lifetime_inputs)``,
# which offloads the forward outputs whose node carries ``meta["should_offload"]``. Its forms differ: 2.11
# and 2.12 copy with ``prims.device_put`` and, on a separate stream, wrap each copy in ``torch.ops.streams``
# events; 2.13 on copies with its own ``ao::offload`` / ``ao::reload`` ops and an ``ao::wait_tensor`` that
# frees the source once the copy is done. Without a separate stream both copy with ``device_put`` (the
# only form a CPU runs: the async ops need pinned memory). Names: the forward's copy is
# ``cpu_offload_<value>``, the backward's input keeps that name and its reload is ``gpu_reload_<value>``.
try:
    from torch._functorch._activation_offloading import activation_offloading as _offloading
except ImportError:  # a torch without it: the plan's notes say offload does not apply
    _offloading = None

CPU_OFFLOAD_PREFIX = "cpu_offload_"


def offload_ops_available() -> bool:
    """Whether this torch has the activation-offloading pass the partition emits offload through."""
    return _offloading is not None and hasattr(_offloading, "enable_activation_offloading")


def _has_async_offload_ops() -> bool:
    """torch 2.12 on: ``ao::offload`` / ``ao::wait_tensor``, whose wait holds the device tensor."""
    import importlib.util

    return importlib.util.find_spec("torch._functorch._activation_offloading.offload_ops") is not None


def offload_copies_overlap() -> bool:
    """Whether this torch's offload copies may run on a stream of their own under Inductor, each copied
    buffer held until its copy is waited on: by its async ``ao::wait_tensor`` (2.12 on), or on 2.11 by
    :func:`_wait_offload_copy_op`, which replaces the pass's own wait (an event wait that holds nothing:
    Inductor reused the buffer once its copy was issued, the H200's NaN loss)."""
    return offload_ops_available() and (_has_async_offload_ops() or hasattr(torch.ops.streams, "wait_event"))


def offload_activations(
    fw: torch.fx.GraphModule,
    bw: torch.fx.GraphModule,
    names: set[str],
    *,
    num_fwd_outputs: int,
    static_lifetime_input_nodes,
    separate_stream: bool,
) -> set[str]:
    """Offload the forward outputs named ``names`` through torch's pass, marked as it expects; returns the
    names it offloaded (it refuses views, getitems, non-contiguous tensors and the caller's outputs).

    ``separate_stream`` (CUDA): copies on a stream of their own, each waited for (on 2.11 by
    :func:`_wait_offload_copy_op`, which holds the copied buffer); without it each copy runs where it
    stands (the CPU). Every node that holds a host copy gets ``meta["host_resident"]``: the peak model
    counts it off the device.

    The copies are left where torch's pass issues them by itself: each forward wait right after its copy
    (not sunk to the forward's end, where torch would hold every copied buffer through the whole
    forward), each reload just before its first use (not prefetched by torch's own bandwidth setting and
    kernels timed on the device while partitioning). The caller moves them (:func:`offload_waits`,
    :func:`offload_reloads`)."""
    for n in fw.graph.find_nodes(op="output")[0].args[0][num_fwd_outputs:]:
        if isinstance(n, torch.fx.Node) and n.name in names:
            n.meta["should_offload"] = True
    patches = {
        "activation_offload_separate_stream": separate_stream,
        "activation_offload_sink_wait": False,
    }
    if hasattr(functorch_config, "activation_reload_prefetch"):
        patches["activation_reload_prefetch"] = False
    with functorch_config.patch(patches):
        _offloading.enable_activation_offloading(fw, bw, num_fwd_outputs, static_lifetime_input_nodes)
    if separate_stream and not _has_async_offload_ops():
        _hold_copied_buffers(fw)
    done = set()
    for n in fw.graph.nodes:
        n.meta.pop("should_offload", None)
        if n.op == "call_function" and CPU_OFFLOAD_PREFIX in n.name:  # the copy and, 2.13 on, its wait
            n.meta["host_resident"] = True
            if n.name.startswith(CPU_OFFLOAD_PREFIX):
                done.add(n.name[len(CPU_OFFLOAD_PREFIX) :])
    for n in bw.graph.find_nodes(op="placeholder"):
        if n.meta.get("saved_for_offloading"):
            n.meta["host_resident"] = True
    return done


def offload_waits(fw: torch.fx.GraphModule) -> dict[str, torch.fx.Node]:
    """Each value offloaded on a stream of its own -> the forward's wait for its copy to the host: a node
    whose arguments are the copy, the device tensor and a tensor it runs after (``ao::wait_tensor`` on
    2.12 on, :func:`_wait_offload_copy_op` on 2.11), so that Inductor frees the device tensor, or hands
    its buffer on, only after it. Moving the wait moves that free (:func:`offload_wait_after`)."""
    waits = {}
    for n in fw.graph.nodes:
        if n.op == "call_function" and (is_offload_wait(n.target) or n.target is _wait_offload_copy_op()):
            waits[n.args[1].name] = n
    return waits


def offload_wait_after(wait: torch.fx.Node, node: torch.fx.Node) -> None:
    """Make Inductor run ``wait`` (from :func:`offload_waits`, placed after ``node``, a tensor's) after
    ``node``: the wait reads it (2.12 on: ``ao::wait_tensor``'s ``last_use_of_storage``). Why: nothing
    else orders a wait after the compute its copy is to hide behind, and Inductor's peak-memory
    reordering pulls each wait up to its copy, to free the buffer sooner: the compute stream then waits
    for every copy where it is issued."""
    args = list(wait.args) + [None] * (3 - len(wait.args))
    args[2] = node
    wait.args = tuple(args)


def offload_reloads(bw: torch.fx.GraphModule) -> dict[str, list[torch.fx.Node]]:
    """Each value offloaded on a stream of its own -> the backward's nodes that issue its copy back to
    the device, in order (2.12 on: its ``ao::reload``; 2.11: ``fork -> wait_stream -> device_put ->
    record_event -> join``), which may move together to any point before the wait its first use reads
    after and after the backward's inputs."""
    reloads = {}
    if _has_async_offload_ops():
        for n in bw.graph.find_nodes(op="call_function", target=torch.ops.ao.reload.default):
            reloads[n.args[0].name.removeprefix(CPU_OFFLOAD_PREFIX)] = [n]
        return reloads
    nodes = list(bw.graph.nodes)
    patterns = _offloading.identify_reload_patterns(bw.graph, nodes, {n: i for i, n in enumerate(nodes)})
    for put, info in patterns.items():
        reloads[put.args[0].name.removeprefix(CPU_OFFLOAD_PREFIX)] = list(info.reload_group_nodes)
    return reloads


@functools.cache
def _wait_offload_copy_op():
    """``recompile_opt::wait_offload_copy(copy, source, after, event, stream)``: the current stream waits
    for the copy's event (``torch.ops.streams.wait_event``, torch 2.11). It reads the copy, so Inductor
    runs it after the copy is issued, the source, so Inductor frees that only after it (torch 2.11's
    own wait takes neither), and ``after``, a tensor it is to run after (:func:`offload_wait_after`).
    None where torch has no stream ops."""
    if not hasattr(torch.ops.streams, "wait_event"):
        return None

    @torch.library.custom_op("recompile_opt::wait_offload_copy", mutates_args=())
    def wait_offload_copy(
        copy: torch.Tensor, source: torch.Tensor, after: torch.Tensor | None, event: int, stream: int
    ) -> None:
        torch.ops.streams.wait_event.default(event, stream)

    @wait_offload_copy.register_fake
    def _(copy, source, after, event, stream) -> None:
        return None

    op = torch.ops.recompile_opt.wait_offload_copy.default
    torch.fx.node.has_side_effect(op)
    return op


def _hold_copied_buffers(fw: torch.fx.GraphModule) -> None:
    """torch 2.11's side-stream offload, each copy's completion wait (``record_event -> join ->
    wait_event`` after its ``device_put``) replaced by :func:`_wait_offload_copy_op`, which holds the
    copied buffer until the wait. Its ``record_stream`` before the copy is dropped: with the buffer freed
    only after the compute stream has waited for the copy, the allocator needs no word of the side stream
    (and 2.11's fake ``streams::record_stream`` takes three arguments where the op has two: Inductor
    cannot lower it)."""
    graph = fw.graph
    nodes = list(graph.nodes)
    for i, put in enumerate(nodes):
        if not (
            put.op == "call_function"
            and put.target is torch.ops.prims.device_put.default
            and CPU_OFFLOAD_PREFIX in put.name
        ):
            continue
        wait = nodes[i + 3]  # where torch 2.11's activation_offload_sink_wait finds it
        if wait.target is not torch.ops.streams.wait_event.default:
            raise RuntimeError(f"recompile_opt: no wait_event three nodes after {put.name} (torch's offload)")
        with graph.inserting_after(wait):
            held = graph.call_function(
                _wait_offload_copy_op(), (put, put.args[0], None, *wait.args), name=f"wait_{put.name}"
            )
        held.meta["val"] = None
        graph.erase_node(wait)
        recorded = nodes[i - 1]
        if recorded.target is torch.ops.streams.record_stream.default and recorded.args[0] is put.args[0]:
            graph.erase_node(recorded)


def is_offload_wait(target) -> bool:
    """torch 2.13's ``ao::wait_tensor``: returns its input once its copy is done (an alias)."""
    return isinstance(target, torch._ops.OpOverload) and str(target) == "ao.wait_tensor.default"
