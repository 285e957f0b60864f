"""The exact peak of a plan: its graphs lowered by Inductor, and the generated code's buffers counted.

Why: the kernel model of :mod:`recompile_opt.costs.peak` guesses Inductor's fusion, inlining and buffer
reuse, and is off by -10%..+9% on the benchmark's plans. That is enough to pick the wrong plan where
candidates lie a few percent apart: on the 2-layer GPT it ranked a plan that measured 25.58 MiB 13%
above one that measured 24.80 MiB, and three that measured 28.56 MiB below it. Inductor itself decides
all of this before compiling a single kernel: its Python wrapper allocates every buffer
(``empty_strided``), hands a dead one to a new one (``# reuse``), and frees it (``del``). So lower the
plan's forward and backward through Inductor's own passes (:func:`_torch_internals.inductor_wrapper_code`,
no C++ is built) and walk the two wrappers' ``call`` functions in order, counting live bytes per
storage. On the 16 stored plans of ``bench/measured_peaks.json`` (GPT and Llama, every budget and
policy) this gives the measured peak to within 0.4% (14 of them within 4 bytes). What the wrapper does
not show is added: an extern kernel's workspace while it runs (:mod:`recompile_opt.costs.scratch`), and
the channels-last copies Inductor makes of convolutions' inputs (:func:`exact_peak`). It costs about a
second and a half per graph on this machine, so the planner asks it only about the few candidates that
decide the least-peak plan (``planner._verified``).

The step as the walk sees it: the forward starts with its inputs (parameters, data: the baseline, not
counted); its outputs (the loss and the saved tensors) stay alive into the backward, which receives
the saved tensors as inputs it may free (``del``) or write over (donated buffers); the backward's
outputs (parameter gradients) stay alive. Multi-output calls (SDPA) allocate all their outputs at once
and free the ones never unpacked when the tuple is dropped; a custom op's one output is unpacked by
name (``buf1 = buf0``), not by index.
"""

from __future__ import annotations

import ast
import math
from dataclasses import dataclass, field

import torch
import torch.fx as fx

from recompile_opt import _torch_internals as ti
from recompile_opt.costs.cost_model import base_of
from recompile_opt.costs.kernels import nbytes
from recompile_opt.costs.peak import forward_state
from recompile_opt.costs.scratch import scratch_bytes
from recompile_opt.ops import has_scratch

_ALLOCATORS = {"empty_strided_cpu", "empty_strided_cuda", "empty_strided"}
_ALIASES = {"reinterpret_tensor", "as_strided"}
TANGENT = "tangent:"  # the storage key of a backward's tangent input (:func:`_walked_backward`)


def exact_peak(
    fw: fx.GraphModule,
    bw: fx.GraphModule,
    *,
    num_fwd_outputs: int,
    compiled: tuple[ti.WrapperCode, ti.WrapperCode, list, dict] | None = None,
    traces: list | None = None,
    allocations: list | None = None,
) -> int:
    """Most live bytes above the pre-step baseline over the step: the backward Inductor generates for
    ``bw`` walked, after the forward as :mod:`recompile_opt.costs.peak` simulates it (its peak and the
    buffers it keeps: the graphs from ``partition``, not made ``for_simulation``). ``bw`` is changed
    (Inductor's post-grad passes run on it).

    Why the forward is simulated: lowering it too costs 45% more time, and a plan that recomputes has
    its peak in the backward. Where the simulated forward peaks above the walked backward, the forward's
    code is walked as well (the Llama's save-all-but-norms plan: simulated 43.05 MiB, measured 41.55).
    Where Inductor lays convolutions out channels-last (:func:`_torch_internals.layout_optimized`), the
    forward keeps copies the graph does not show (a ViT's images and patch weights, twice 24 KiB of a
    204 KiB peak): its code is walked first, and the backward starts from what it returns; so too where
    the forward returns an expanded view of a buffer it computes (:func:`returns_expanded_view`).

    ``compiled``: the forward's and the backward's code as Inductor's compile of ``fw`` and ``bw``
    generated them (``_torch_internals.compiled_wrapper_code``), the names of ``fw``'s outputs as
    partitioned (that compile's post-grad passes rewrote ``fw`` in place) and :func:`tangent_bytes` of
    ``bw`` before its compile (which leaves its inputs no values): both codes are walked, nothing is
    lowered.

    ``traces``: receives a :class:`WalkedPeak` for each graph walked (what is alive at its peak).
    ``allocations``: receives the step's allocations and frees in order (:mod:`.cuda_allocator`'s
    events): both graphs' code is then walked."""
    if compiled is not None:
        fw_code, bw_code, fw_outputs, tangents = compiled
        fw_peak, fw_end, kept, owner, _ = _walked_forward(fw, fw_code, fw_outputs, traces, allocations)
        return max(fw_peak, _walked_backward(bw_code, tangents, fw_end, kept, owner, traces, allocations))
    strides = None  # the saved tensors' strides where Inductor's forward chose them
    if ti.layout_optimized(fw) or allocations is not None or returns_expanded_view(fw):
        fw_peak, fw_end, kept, owner, strides = _walked_forward(fw, traces=traces, events=allocations)
    else:
        fw_peak, fw_end, kept, owner = forward_state(fw)
    donated = ti.bw_donated_inputs(fw, bw, num_fwd_outputs)
    bw_peak = _walked_backward(
        ti.inductor_wrapper_code(bw, backward=True, donated=donated, input_strides=strides),
        tangent_bytes(bw),
        fw_end,
        kept,
        owner,
        traces,
        allocations,
    )
    if fw_peak <= bw_peak or strides is not None or allocations is not None:
        return max(fw_peak, bw_peak)
    # the simulated forward holds the peak (a plan that recomputes little): walk the forward's code too
    return max(_walked_forward(fw, traces=traces)[0], bw_peak)


def returns_expanded_view(fw: fx.GraphModule) -> bool:
    """Whether the forward returns an expanded view (a stride 0 over a dim of more than one element) of
    a buffer it computes. Why: the kernel model counts such a view as its base's storage, but Inductor's
    forward may return it as a buffer of its own, every element written: a Gemma 3's key saved as
    expanded for grouped-query attention (``repeat_kv``) was 32 KiB in the model and 64 KiB in the
    code, and the backward started that much higher than walked (a ``peak_memory`` limit exceeded on
    the measured step). Where it does, :func:`exact_peak` walks the forward's code too."""
    output = next(iter(reversed(fw.graph.nodes)))
    for arg in output.all_input_nodes:
        val, base = arg.meta.get("val"), base_of(arg)
        if isinstance(val, torch.Tensor) and base is not arg and base.op != "placeholder":
            if any(stride == 0 and size > 1 for stride, size in zip(val.stride(), val.shape)):
                return True
    return False


def tangent_bytes(bw: fx.GraphModule) -> dict[str, tuple[int, bool]]:
    """Each tangent input of ``bw`` (the gradients of the forward's outputs): its bytes, and whether the
    caller holds it to the backward's end: a scalar's, the gradient ``loss.backward()`` makes, which
    its call to autograd keeps (walked without it, the stored plans measured 8 B over their walks); the
    others the autograd engine makes for the outputs the caller dropped."""
    return {
        n.name: (nbytes(n), isinstance(n.meta.get("val"), torch.Tensor) and n.meta["val"].dim() == 0)
        for n in bw.graph.find_nodes(op="placeholder")
        if n.name.startswith("tangents")
    }


def _walked_backward(
    wrapper: ti.WrapperCode,
    tangents: dict[str, tuple[int, bool]],
    fw_end: int,
    kept: dict,
    owner: dict,
    traces: list | None = None,
    events: list | None = None,
) -> int:
    """The backward's peak from its code: it starts with the forward's kept storages, what else the
    forward left alive (the loss) and the ``tangents`` (:func:`tangent_bytes`). Each tangent the
    caller does not hold is freed where the code drops it, as the kept storages are, where AOTAutograd
    hands the tangents over (``_torch_internals.backward_frees_tangents``), else held throughout. Why
    it matters: T5's output object (logits, a cache) takes 64 KiB of tangents that torch 2.13's
    backward frees early; held to the end, its walked peak was 8.6% over the measured one."""
    trace = WalkedPeak("backward") if traces is not None else None
    frees = ti.backward_frees_tangents()
    freed = {name: size for name, (size, held) in tangents.items() if frees and not held}
    if events is not None:  # the tangents the backward holds throughout; the loss is the forward's
        events += [("alloc", ("tangent", n), size) for n, (size, _) in tangents.items() if n not in freed]
    peak = walk(
        wrapper.code,
        inputs={**owner, **{name: TANGENT + name for name in freed}},
        storage_bytes={**kept, **{TANGENT + name: size for name, size in freed.items()}},
        sizes=wrapper.sizes,
        multi=wrapper.multi,
        scratch=_scratch(wrapper.externs),
        other=fw_end - sum(kept.values()) + sum(size for size, _ in tangents.values()) - sum(freed.values()),
        trace=trace,
        origins=wrapper.origins,
        pooled=wrapper.pooled,
        events=events,
        inherited={key: ("forward", int(key[1:])) for key in kept} if events is not None else None,
    )
    if trace is not None:
        traces.append(trace)
    return peak


def _walked_forward(
    fw: fx.GraphModule,
    wrapper: ti.WrapperCode | None = None,
    outputs: list | None = None,
    traces: list | None = None,
    events: list | None = None,
):
    """:func:`recompile_opt.costs.peak.forward_state` read off the forward's code (``wrapper``, or
    lowered here): its peak, the live bytes at its end, the bytes of each storage it returns, each
    output name's storage; and each output name's strides (the backward receives them so).
    ``outputs``: the names of ``fw``'s outputs (None for a non-tensor), where not read off ``fw``.
    ``events``: receives its allocations and frees, each storage keyed ``("forward", id)``."""
    wrapper = wrapper or ti.inductor_wrapper_code(fw, backward=False)
    code, sizes, multi, externs, out_strides = wrapper[:5]
    live = _Storages(events=events, tag="forward")
    call = _call(code)
    returned = _run(call, live, {}, sizes, multi, _scratch(externs))
    if events is not None:  # what it does not return dies as it returns
        out_sids = {live.names.get(name) for name in returned if name}
        events += [("free", live.keys[sid]) for sid in list(live.refs) if sid not in out_sids]
    if traces is not None:
        traces.append(_peak_trace("forward", call, live, returned, set(), wrapper.origins, wrapper.pooled))
    kept, owner, strides = {}, {}, {}
    for output, name, stride in zip(outputs or output_names(fw), returned, out_strides):
        if output is None:
            continue
        if stride is not None:
            strides[output] = stride
        sid = live.names.get(name) if name else None
        if sid is not None:
            kept[f"s{sid}"], owner[output] = live.size[sid], f"s{sid}"
    # what the forward returns outlives it; its last temporaries (never ``del``'d: ``call`` returns)
    # die with it
    end = sum(
        live.size[sid] for sid in {live.names.get(name) for name in returned if name} if sid is not None
    )
    return live.peak, end, kept, owner, strides


def output_names(fw: fx.GraphModule) -> list[str | None]:
    """The names of a graph's outputs, None where one is not a node."""
    return [n.name if isinstance(n, fx.Node) else None for n in next(iter(reversed(fw.graph.nodes))).args[0]]


def _scratch(externs: dict[str, tuple[list[fx.Node], list | None]]) -> dict[str, int]:
    """Extern kernel buffer -> the workspace its kernel allocates (:mod:`recompile_opt.costs.scratch`), at
    the layouts Inductor gives its inputs."""
    found = {
        name: max((scratch_bytes(n, layouts) for n in nodes if has_scratch(n)), default=0)
        for name, (nodes, layouts) in externs.items()
    }
    return {name: n for name, n in found.items() if n}


def walk(
    code: str,
    *,
    inputs: dict[str, str] | None = None,
    storage_bytes: dict[str, int] | None = None,
    sizes: dict[str, int],
    multi: dict[str, list[str]] | None = None,
    scratch: dict[str, int] | None = None,
    other: int = 0,
    trace: WalkedPeak | None = None,
    origins: dict[str, str] | None = None,
    pooled: frozenset[str] = frozenset(),
    events: list | None = None,
    inherited: dict[str, object] | None = None,
) -> int:
    """The most live bytes while Inductor's wrapper ``code`` runs its ``call``. ``inputs``: input name
    -> the storage it holds (views of one buffer name the same), ``storage_bytes`` their bytes, live
    from the start until their last name is dropped (an input not named: the baseline's; a storage no
    input of ``call`` holds is freed at the start); ``sizes``:
    bytes of buffers allocated by a kernel rather than ``empty_strided``; ``multi``: a multi-output
    call's output buffers; ``scratch``: an extern kernel's workspace, alive while it runs, above
    its outputs; ``other``: bytes alive throughout. ``trace``: filled with what is alive at the peak
    (``origins``: buffer -> the FX node it holds; ``pooled``: the dead buffers the wrapper handed on,
    :class:`_torch_internals.WrapperCode`). ``events``: receives the allocations and frees
    (``inherited``: the event key of a storage of ``storage_bytes`` an earlier walk allocated)."""
    call, inputs, inherited = _call(code), inputs or {}, inherited or {}
    live = _Storages(events=events, tag="backward")
    storage = {
        key: live.new("#" + key, n, event_key=inherited.get(key))
        for key, n in sorted((storage_bytes or {}).items())
    }
    live.live += other
    returned = _run(
        call,
        live,
        {name: storage[key] for name, key in inputs.items() if key in storage},
        sizes,
        multi or {},
        scratch or {},
        release=["#" + key for key in storage],
    )
    if trace is not None:
        found = _peak_trace(
            trace.phase, call, live, returned, set(storage.values()), origins or {}, pooled, other
        )
        trace.__dict__.update(found.__dict__)
    return live.peak


def why_not_walkable(fw: fx.GraphModule, bw: fx.GraphModule) -> str | None:
    """Why the code Inductor generates for these graphs cannot be walked, or None where it can (static
    shapes on a device Inductor generates code for). Symbolic shapes: the saved symints shift the
    backward's inputs and sizes are hints, not bytes; the meta device (a plan without a step) has no
    code generator."""
    for g in (fw, bw):
        for node in g.graph.find_nodes(op="placeholder"):
            val = node.meta.get("val")
            if isinstance(val, torch.SymInt) or (
                isinstance(val, torch.Tensor) and any(isinstance(d, torch.SymInt) for d in val.shape)
            ):
                return "symbolic shapes"
            if isinstance(val, torch.Tensor) and val.device.type not in ("cpu", "cuda"):
                return f"the {val.device.type} device has no Inductor code"
    return None


@dataclass
class _Storages:
    """Live storages: each Python name in the wrapper refers to one; a storage is freed with its last
    reference. Storages of the baseline (parameters, data) are never entered."""

    names: dict[str, int] = field(default_factory=dict)  # wrapper name -> storage id
    refs: dict[int, set[str]] = field(default_factory=dict)  # storage id -> names (and holders)
    size: dict[int, int] = field(default_factory=dict)
    held: dict[str, list[int]] = field(default_factory=dict)  # multi-output tuple -> its outputs
    pending: dict[str, int] = field(default_factory=dict)  # an output not unpacked yet -> its storage
    live: int = 0
    peak: int = 0
    next_id: int = 0
    stmt: int = 0  # the statement running (an index into the flattened ``call``)
    at_peak: dict[int, tuple[frozenset, int]] = field(default_factory=dict)  # storage -> (names, bytes)
    peak_stmt: int = 0
    peak_workspace: tuple[str, int] | None = None  # an extern kernel's workspace, at the peak
    # where asked (cuda_allocator): each allocation and free in order, ("alloc", key, bytes) / ("free",
    # key); a storage's key is (tag, id), or the one it was given where an earlier walk allocated it
    events: list | None = None
    tag: str = ""
    keys: dict[int, object] = field(default_factory=dict)

    def raise_to(self, level: int, workspace: tuple[str, int] | None = None) -> None:
        """``level`` live bytes now: a new peak is remembered with what is alive at it."""
        if level > self.peak:
            self.peak, self.peak_stmt, self.peak_workspace = level, self.stmt, workspace
            self.at_peak = {sid: (frozenset(self.refs[sid]), self.size[sid]) for sid in self.refs}

    def new(self, name: str, nbytes: int, holder: str | None = None, event_key: object = None) -> int:
        """A storage allocated now, referred to by ``name`` (or, unnamed yet, held by ``holder``);
        ``event_key``: the key of an allocation an earlier walk made (no new one in ``events``)."""
        self.drop(name) if holder is None else None
        sid, self.next_id = self.next_id, self.next_id + 1
        if self.events is not None:
            self.keys[sid] = event_key if event_key is not None else (self.tag, sid)
            if event_key is None:
                self.events.append(("alloc", self.keys[sid], nbytes))
        self.refs[sid], self.size[sid] = {holder or name}, nbytes
        if holder is None:
            self.names[name] = sid
        self.live += nbytes
        self.raise_to(self.live)
        return sid

    def alias(self, name: str, other: str | None) -> None:
        if other is None or other not in self.names or name == other:
            return
        self.drop(name)
        sid = self.names[other]
        self.names[name] = sid
        self.refs[sid].add(name)

    def hold(self, tuple_name: str, outputs: list[tuple[str, int]]) -> None:
        """A multi-output call allocates every output at once; only the tuple holds them until unpacked."""
        self.drop(tuple_name)
        self.held[tuple_name] = []
        for name, n_bytes in outputs:
            self.pending[name] = self.new(name, n_bytes, holder="#" + tuple_name)
            self.held[tuple_name].append(self.pending[name])

    def unpack(self, name: str, nbytes: int) -> None:
        """``name = tuple[i]``: the output the call allocated (or, for a call not known, one now)."""
        sid = self.pending.pop(name, None)
        if sid is None or sid not in self.refs:
            self.new(name, nbytes)
            return
        self.drop(name)
        self.names[name] = sid
        self.refs[sid].add(name)

    def drop(self, name: str) -> None:
        for sid in self.held.pop(name, ()):
            self._release(sid, "#" + name)
        if name in self.names:
            self._release(self.names.pop(name), name)

    def _release(self, sid: int, ref: str) -> None:
        refs = self.refs.get(sid)
        if refs is None:
            return
        refs.discard(ref)
        if not refs:
            self.live -= self.size.pop(sid)
            del self.refs[sid]
            if self.events is not None:
                self.events.append(("free", self.keys[sid]))

    def workspace(self, name: str, nbytes: int) -> None:
        """An extern kernel's workspace: alive while it runs, above what is live."""
        self.raise_to(self.live + nbytes, workspace=(name, nbytes))
        if self.events is not None:
            key = (self.tag, "workspace", self.stmt)
            self.events += [("alloc", key, nbytes), ("free", key)]


@dataclass
class WalkedPeak:
    """What is alive at the peak of one graph's walked code. ``alive``: (buffer, bytes, role, the FX
    node it holds or None), ``role`` one of ``kept`` (the forward's outputs the backward reads; in the
    forward, what it returns), ``tangents`` (the loss and tangents, what else the forward left),
    ``gradients`` (what the backward returns), ``pooled`` (dead: no later statement reads it, Inductor's
    wrapper holds it for a later allocation), ``scratch`` (an extern kernel's workspace) and ``working``
    (the rest). ``kernel``: the kernels run before the peak, of ``kernels``; ``at``: the one running."""

    phase: str
    peak: int = 0
    kernel: int = 0
    kernels: int = 0
    at: str = ""
    alive: list = field(default_factory=list)

    def breakdown(self, recomputed: set[str], graph: fx.GraphModule | None = None) -> dict:
        """:func:`recompile_opt.costs.peak.peak_breakdown`'s figures for this peak: a working buffer
        holding a value the plan recomputes is ``recomputed``, any other ``temporaries``; with the
        walked ``graph`` (its nodes name the buffers' values), the shapes alive there."""
        kinds: dict[str, int] = {}
        largest = []
        vals = {n.name: n.meta.get("val") for n in graph.graph.nodes} if graph is not None else {}
        shapes: dict[tuple, int] = {}  # shape -> the bytes of the buffers of that shape
        for buf, size, _, origin in self.alive:
            val = vals.get(origin or buf)
            if isinstance(val, torch.Tensor) and all(isinstance(d, int) for d in val.shape):
                shapes[tuple(val.shape)] = shapes.get(tuple(val.shape), 0) + size
        for buf, size, role, origin in self.alive:
            kind = role if role != "working" else "recomputed" if origin in recomputed else "temporaries"
            kinds[kind] = kinds.get(kind, 0) + size
            largest.append((size, origin or buf, kind))
        return {
            "phase": self.phase,
            "kernel": self.kernel,
            "kernels": self.kernels,
            "kernel_ops": [self.at] if self.at else [],
            "bytes": dict(sorted(kinds.items(), key=lambda kv: -kv[1])),
            "total": self.peak,
            "largest": [[name, size, kind] for size, name, kind in sorted(largest, reverse=True)[:6]],
            "from": "inductor-code",
            **(_shape_figures(shapes) if graph is not None else {}),
        }


def _shape_figures(shapes: dict[tuple, int]) -> dict:
    """The shapes alive at a walked peak, largest first, and the bytes held in each."""
    ordered = sorted(shapes, key=lambda s: (-math.prod(s), s))
    return {"shapes": [list(s) for s in ordered], "shape_bytes": [[list(s), shapes[s]] for s in ordered]}


def _peak_trace(
    phase: str,
    call: ast.FunctionDef,
    live: _Storages,
    returned: list,
    inputs: set,
    origins: dict,
    pooled: frozenset,
    other: int = 0,
) -> WalkedPeak:
    """What :class:`_Storages` saw alive at its peak, each storage given its role (:class:`WalkedPeak`)."""
    statements = _statements(call)
    later = _names_read(statements[live.peak_stmt :], pooled)
    kernels = [i for i, stmt in enumerate(statements) if _kernel_name(stmt)]
    running = next((i for i in kernels if i >= live.peak_stmt), None)
    out_sids = {live.names.get(name) for name in returned if name}
    trace = WalkedPeak(phase, live.peak, sum(i < live.peak_stmt for i in kernels), len(kernels))
    trace.at = _kernel_name(statements[running]) if running is not None else ""
    trace.alive = [("loss and held tangents", other, "tangents", None)] if other else []
    for sid, (names, size) in live.at_peak.items():
        name = min((n for n in names if not n.startswith("#")), default=next(iter(names)))
        if not {n.lstrip("#") for n in names} & later:
            role = "pooled"
        elif sid in inputs:
            role = "tangents" if any(n.startswith("#" + TANGENT) for n in names) else "kept"
        elif sid in out_sids:
            role = "kept" if phase == "forward" else "gradients"
        else:
            role = "working"
        trace.alive.append((name, size, role, origins.get(name)))
    if live.peak_workspace:
        trace.alive.append((f"{live.peak_workspace[0]} (workspace)", live.peak_workspace[1], "scratch", None))
    return trace


def _names_read(statements: list[ast.stmt], pooled: frozenset) -> set[str]:
    """The names ``statements`` read, less the frees (``del buf3``) and the pool's hand-overs of a
    ``pooled`` buffer (``buf7 = buf3``, ``reinterpret_tensor(buf3, ...)``): a buffer only these name
    is dead."""
    read = set()
    for stmt in statements:
        handed_on = isinstance(stmt, ast.Assign) and _root(stmt.value) in pooled
        if isinstance(stmt, ast.Delete) or handed_on:
            continue
        read |= {n.id for n in ast.walk(stmt) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load)}
    return read


def _kernel_name(stmt: ast.stmt) -> str | None:
    """The kernel a statement runs (a generated kernel's call, an extern kernel's), else None."""
    value = getattr(stmt, "value", None)
    if not isinstance(stmt, (ast.Expr, ast.Assign)) or not isinstance(value, ast.Call):
        return None
    func = value.func
    while isinstance(func, ast.Attribute) and func.attr == "run":  # a Triton kernel: name.run(...)
        func = func.value
    name = ast.unparse(func)
    if (
        name in _ALLOCATORS
        or name in _ALIASES
        or name.startswith(("args.", "assert_", "empty_", "torch.cuda"))
    ):
        return None
    return name


def _call(code: str) -> ast.FunctionDef:
    for node in ast.walk(ast.parse(code)):
        if isinstance(node, ast.FunctionDef) and node.name == "call":
            return node
    raise ValueError("no call() in Inductor's wrapper code")


def _arg_names(call: ast.FunctionDef) -> list[str]:
    """The names ``call`` unpacks its inputs into (``a, b, c = args``), in input order."""
    for stmt in call.body:
        if isinstance(stmt, ast.Assign) and isinstance(stmt.value, ast.Name) and stmt.value.id == "args":
            target = stmt.targets[0]
            return [e.id for e in target.elts] if isinstance(target, ast.Tuple) else [target.id]
    return []


def _run(
    call: ast.FunctionDef,
    live: _Storages,
    inputs: dict[str, int],
    sizes: dict[str, int],
    multi: dict[str, list[str]],
    scratch: dict[str, int],
    release: list[str] = (),
) -> list[str | None]:
    """Walk ``call``'s statements up to its ``return``; ``inputs``: input name -> its storage;
    ``release``: names that held the inputs until ``call`` took them. Returns the buffer each returned
    value refers to (None for one that is not a buffer)."""
    for name in _arg_names(call):
        if name in inputs:
            live.names[name] = inputs[name]
            live.refs[inputs[name]].add(name)
    for name in release:
        live.drop(name)
    live.peak = -1
    live.raise_to(live.live)
    for live.stmt, stmt in enumerate(_statements(call)):
        if isinstance(stmt, ast.Return):
            values = stmt.value.elts if isinstance(stmt.value, (ast.Tuple, ast.List)) else [stmt.value]
            return [_root(v) for v in values]
        _step(stmt, live, sizes, multi, scratch)
    return []


def _statements(call: ast.FunctionDef) -> list[ast.stmt]:
    """``call``'s statements in the order they run, the bodies of its ``with`` blocks (CUDA's device
    guard) and ``if`` blocks inlined."""
    out, todo = [], list(reversed(call.body))
    while todo:
        stmt = todo.pop()
        if isinstance(stmt, (ast.If, ast.With)):
            todo.extend(reversed(stmt.body))
        else:
            out.append(stmt)
    return out


def _step(
    stmt: ast.stmt,
    live: _Storages,
    sizes: dict[str, int],
    multi: dict[str, list[str]],
    scratch: dict[str, int],
) -> None:
    if isinstance(stmt, ast.Delete):
        for target in stmt.targets:
            if isinstance(target, ast.Name):
                live.drop(target.id)
    elif isinstance(stmt, ast.Assign) and len(stmt.targets) == 1 and isinstance(stmt.targets[0], ast.Name):
        name, value = stmt.targets[0].id, stmt.value
        func = getattr(getattr(value, "func", None), "id", None)
        if func in _ALLOCATORS:
            live.new(name, _allocated_bytes(value))
        elif isinstance(value, ast.Name) and name in live.pending:  # a one-output call's result
            live.unpack(name, sizes.get(name, 0))
        elif func in _ALIASES or isinstance(value, ast.Name):
            live.alias(name, _root(value))
        elif _returns_its_first_input(value):
            live.alias(name, _root(value.args[0]))
        elif isinstance(value, ast.Subscript):  # an output of a multi-output call, allocated with it
            live.unpack(name, sizes.get(name, 0))
        elif isinstance(value, ast.Call):  # an extern or fallback kernel that allocates its result
            if name in multi:
                live.hold(name, [(out, sizes.get(out, 0)) for out in multi[name]])
            else:
                live.new(name, sizes.get(name, 0))
            if scratch.get(name):  # its workspace, while it runs
                live.workspace(name, scratch[name])


def _returns_its_first_input(value: ast.expr) -> bool:
    """A call of torch's offload wait (``ao::wait_tensor``): it returns the copy it waited for."""
    return isinstance(value, ast.Call) and bool(value.args) and ast.unparse(value.func) == _OFFLOAD_WAIT


_OFFLOAD_WAIT = "torch.ops.ao.wait_tensor.default"


def _root(expr: ast.expr) -> str | None:
    """The buffer an expression refers to: ``buf3``, ``reinterpret_tensor(buf3, ...)``."""
    while isinstance(expr, ast.Call) and getattr(expr.func, "id", None) in _ALIASES and expr.args:
        expr = expr.args[0]
    return expr.id if isinstance(expr, ast.Name) else None


def _allocated_bytes(call: ast.Call) -> int:
    """Bytes of ``empty_strided_*(size, stride, dtype)``: the storage its strides span."""
    size, stride = (ast.literal_eval(a) for a in call.args[:2])
    dtype = getattr(torch, call.args[2].attr) if isinstance(call.args[2], ast.Attribute) else torch.float32
    if any(s == 0 for s in size):
        return 0
    return (sum((s - 1) * st for s, st in zip(size, stride)) + 1) * dtype.itemsize
