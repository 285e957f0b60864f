"""Compare activation save/recompute strategies on CPU, one fresh process per run.

Usage::

    python bench/compare.py                                   # default strategies, small GPT
    python bench/compare.py --model gpt,llama --size small,medium --json out.json --csv out.csv
    python bench/compare.py --strategies eager,compile,ours-0.2 --repeats 3

Strategies (``--strategies``; the default set is :data:`DEFAULT_STRATEGIES`)
-----------------------------------------------------------------------------
* ``eager``; ``eager-full-ckpt`` (``torch.utils.checkpoint`` around every block);
  ``eager-selective`` (Megatron's selective recompute: checkpoint around the attention
  core only -- GPT: QK^T, scale, mask, softmax, dropout, @V; Llama: the SDPA call).
* ``compile`` (Inductor, default partitioner); ``compile-amb-B``
  (``torch._functorch.config.activation_memory_budget = B``, its knapsack);
  ``compile-full-ckpt`` (``torch.compile`` of the block-checkpointed model).
* ``ours-B`` (``memory_budget=B``, the same budgets B as ``compile-amb-B``), ``ours-none``
  (no budget: the ILP's fastest plan) and ``ours-<policy>`` for each fixed policy.
* ``ours-peak-SIZE`` (``peak_memory=SIZE``, any size with units, e.g. ``ours-peak-27MiB``): the
  least recompute whose predicted peak fits SIZE -- how a user asks for a peak rather than kept bytes.
* ``rockmate``: ``bench/rockmate_runner.py`` run by another interpreter (``--rockmate-python``,
  default ``$RECOMPILE_OPT_ROCKMATE_PYTHON`` or ``/work/rockmate-venv/bin/python``); when it
  cannot run, its row carries the runner's exact error (see ``bench/ROCKMATE.md``).

Methodology
-----------
* **Fresh process per (model, size, strategy, round).**  Dynamo/Inductor keep global
  state and the CPU allocator keeps freed memory, so each run is its own
  ``python bench/compare.py --worker NAME`` process that prints one JSON line.
* **Compile caches.**  Each (model, size, strategy) gets a private
  ``TORCHINDUCTOR_CACHE_DIR``, empty in round 1 (*cold* compile: the reported compile
  time) and reused by later rounds (*warm*: Inductor's FX-graph and AOTAutograd caches
  hit, our plans are replayed), which cuts a compiled run from ~1 min to ~10 s.  Kernels
  are never shared between strategies.  ``--cold-every-round`` gives every process an
  empty cache with the caches off.  ``TORCHINDUCTOR_COMPILE_THREADS=1`` always.
* **One thread.**  Workers run ``torch.set_num_threads(--threads)``, 1 by default: on a
  small shared machine an OpenMP team stalls whenever another process holds one of its
  cores (steps 100x slower were seen).  The 1-minute load average at the start of timing
  is recorded and a row is flagged "busy machine" when it exceeds the core count.
* **Interleaved repeats.**  ``--repeats R`` rounds; each round runs every strategy once in a
  shuffled order (seeded by ``--order-seed``), so slow drifts of the machine spread over all
  strategies.  ``--jobs N`` runs N workers at once, but a shared/exclusive file lock
  (:class:`JobLock`) keeps each *timed* section (steps, saved bytes, peak) alone: it waits
  until no other worker is starting or compiling and makes them wait, so only compiles
  overlap (and the compile times then share the cores).  ``rockmate`` runs under the shared
  lock: its own timings are not protected.
* **Same model, same data.**  Each worker builds the model under ``torch.manual_seed(0)``
  and draws the batch from a fixed generator.  It keeps an untouched eager copy and compares
  the first step's gradients with it (``max|dgrad|``).  The RNG is reseeded before every
  step; with ``--dropout > 0`` (GPT only) Inductor's ``fallback_random`` is on so compiled
  dropout draws eager's masks (``--native-rng`` turns that off).
* **Figures per worker** (the table legend says which are measured, counted or estimated).
  - *compile s*: wall time of the first forward+backward (Dynamo, partitioning, Inductor).
  - *step ms*: forward + backward + ``SGD.step()`` after ``--warmup`` steps; median and
    min/max of ``--steps`` steps.
  - *saved MiB*: bytes packed for backward during one forward (``saved_tensors_hooks``),
    storages deduplicated, parameters, buffers and the batch excluded.
  - *peak MiB*: most live CPU bytes above the pre-step baseline during one forward+backward
    entered with grads ``None``, integrated from the profiler's allocation records
    (``recompile_opt.costs.measure.memory_profile``).  Cross-check: *RSS rise MiB*, the process's
    resident high-water mark during another such call (``/proc/self/clear_refs`` resets it)
    minus its resident size before; it is lower when the C allocator reuses memory it kept.
  - *recompute GFLOP*: FLOPs executed in the backward beyond eager's save-all backward,
    i.e. recomputation.  Eager strategies: ``FlopCounterMode`` around the backward.  Compiled
    ones: a dispatch mode makes Dynamo run the model eagerly, so the FLOPs of the compiled
    backward graphs are summed instead, read by an Inductor post-grad pass (round-1 runs only:
    a warm cache skips the pass).  Formulas of ``torch.utils.flop_counter`` (matmuls,
    attention); pointwise ops count 0.  Eager ``torch.utils.checkpoint`` stops recomputing
    once the backward has what it needs (its early stop), so it reruns less than the same
    checkpoint compiled (e.g. not a block's last matmul).
  - ``ours-*``: the plans' own estimates over ``recompile_opt.last_plans()``.
* **Aggregation.**  The median of the per-process medians, with min–max over every timed
  step of every process; compile time over the cold processes.  Memory figures repeat
  exactly; a spread is flagged in the notes.
* **Pareto check.**  After each table, on the measured (peak, median step) plane: point A
  *dominates* B when A's peak <= B's and A's step is more than ``--noise`` (10%) faster.
  Each ``ours-*`` row is "on the frontier" or "dominated by ..."; each other row is dominated
  by, matched by (peak <= and step within the noise) or *not covered* by our points, with the
  figures that say why.
A failing run (exception, crash, timeout) shows ``ERROR: ...`` in its row and is not retried
in later rounds; the run always finishes.
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import functools
import importlib
import json
import math
import os
import pathlib
import random
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from concurrent.futures import ThreadPoolExecutor, as_completed
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

MARKER = "@@COMPARE_RESULT@@ "
MiB = 1 << 20
ROCKMATE_RUNNER = REPO / "bench" / "rockmate_runner.py"
ROCKMATE_PYTHON = "/work/rockmate-venv/bin/python"
LOCK_ENV = "COMPARE_TIMING_LOCK"

BUDGETS = (0.5, 0.2, 0.0)  # torch's activation_memory_budget and our memory_budget alike

# name -> how to build it: kind (eager | compile | ours | external), block checkpointing
# ("full") or attention-core checkpointing ("selective"), functorch config, backend options.
STRATEGIES: dict[str, dict] = {
    "eager": {"kind": "eager"},
    "eager-full-ckpt": {"kind": "eager", "ckpt": "full"},
    "eager-selective": {"kind": "eager", "ckpt": "selective"},
    "compile": {"kind": "compile"},
    **{f"compile-amb-{b}": {"kind": "compile", "functorch": {"activation_memory_budget": b}}
       for b in BUDGETS + (0.05,)},
    "compile-amb-ilp-0.2": {"kind": "compile", "needs": ["scipy"], "functorch": {
        "activation_memory_budget": 0.2, "activation_memory_budget_solver": "ilp"}},
    "compile-full-ckpt": {"kind": "compile", "ckpt": "full"},
    "ours-none": {"kind": "ours", "options": {}},
    **{f"ours-{b}": {"kind": "ours", "options": {"memory_budget": b}} for b in BUDGETS},
    **{f"ours-{p}": {"kind": "ours", "options": {"policy": p}}
       for p in ("save-all", "full", "megatron-selective")},
    # one budget pair and 15 s per block ILP: a bounded attempt (bench/ROCKMATE.md: CBC found no
    # solution in 15 s or 90 s per solve, nor in 15 min without a limit); it holds the timing lock
    "rockmate": {"kind": "external", "runner": ROCKMATE_RUNNER,
                 "runner_args": ["--budget-frac", "0.5", "--nb-budget-save", "1", "--nb-budget-peak", "1",
                                 "--ilp-seconds", "15"],
                 "note": "budget 0.5 x eager's saved bytes"},
}
PEAK_PREFIX = "ours-peak-"


def strategy(name: str) -> dict:
    """The spec of a strategy: a fixed entry of STRATEGIES, or ``ours-peak-SIZE`` for any SIZE that
    ``peak_memory`` accepts. Raises KeyError naming the accepted strategies otherwise."""
    if name in STRATEGIES:
        return STRATEGIES[name]
    if name.startswith(PEAK_PREFIX):
        from recompile_opt.options import OptionError, parse_bytes  # lazy: the driver needs no torch

        size = name[len(PEAK_PREFIX):]
        try:
            parse_bytes("peak_memory", size)
        except OptionError as e:
            raise KeyError(f"strategy {name!r}: {e}") from None
        return {"kind": "ours", "options": {"peak_memory": size}}
    raise KeyError(f"unknown strategy {name!r}; choose from {list(STRATEGIES)} or {PEAK_PREFIX}SIZE "
                   "(SIZE with units, e.g. 27MiB)")


DEFAULT_STRATEGIES = [
    "eager", "eager-full-ckpt", "eager-selective", "compile", "compile-amb-0.5", "compile-amb-0.2",
    "compile-amb-0.0", "compile-full-ckpt", "ours-none", "ours-0.5", "ours-0.2", "ours-0.0",
    "ours-save-all", "ours-full", "ours-megatron-selective", "rockmate"]

# Model sizes that run on one CPU thread in seconds per step (vocab 512, fp32).
SIZES: dict[str, dict] = {
    "small": {"layers": 2, "embd": 256, "heads": 4, "seq": 256, "batch": 4},
    "medium": {"layers": 4, "embd": 384, "heads": 6, "seq": 256, "batch": 4},
}
SHAPE_FLAGS = ["layers", "embd", "heads", "seq", "batch"]
# flags forwarded verbatim from the driver to each worker (after resolving the size preset)
WORKER_FLAGS = ["model", "size", *SHAPE_FLAGS, "vocab", "dropout", "steps", "warmup", "threads"]


def group_configs(args) -> list[dict]:
    """One config per (model, size): the size preset, overridden by explicit shape flags."""
    models = [m.strip() for m in str(args.model).split(",") if m.strip()]
    sizes = [s.strip() for s in str(args.size).split(",") if s.strip()]
    bad = [m for m in models if m not in ("gpt", "llama")] + [s for s in sizes if s not in SIZES]
    if bad:
        raise SystemExit(f"unknown model/size {bad}; models: gpt, llama; sizes: {list(SIZES)}")
    groups = []
    for model in models:
        for size in sizes:
            cfg = {"model": model, "size": size, "vocab": args.vocab,
                   "dropout": args.dropout if model == "gpt" else 0.0,
                   "steps": args.steps, "warmup": args.warmup, "threads": args.threads}
            for flag in SHAPE_FLAGS:
                value = getattr(args, flag)
                cfg[flag] = SIZES[size][flag] if value is None else value
            groups.append(cfg)
    return groups


def group_title(cfg: dict) -> str:
    return (f"{cfg['model']} {cfg['size']}: {cfg['layers']} layers, h={cfg['embd']}, "
            f"{cfg['heads']} heads, s={cfg['seq']}, b={cfg['batch']}, vocab {cfg['vocab']}, fp32"
            + (f", dropout {cfg['dropout']}" if cfg["dropout"] else ""))


# --------------------------------------------------------------------------
# Worker: one strategy in this process
# --------------------------------------------------------------------------


def build_model(cfg: dict):
    """Model and batch from ``recompile_opt.models``, weights drawn under seed 0."""
    import torch
    from recompile_opt import models

    if cfg["model"] == "gpt":
        config = models.GPTConfig(n_layer=cfg["layers"], n_head=cfg["heads"], n_embd=cfg["embd"],
                                  block_size=cfg["seq"], vocab_size=cfg["vocab"], dropout=cfg["dropout"])
        cls = models.GPT
    else:
        config = models.LlamaConfig(n_layer=cfg["layers"], n_head=cfg["heads"], n_embd=cfg["embd"],
                                    block_size=cfg["seq"], vocab_size=cfg["vocab"])
        cls = models.Llama
    torch.manual_seed(0)
    model = cls(config)
    g = torch.Generator().manual_seed(1)
    idx = torch.randint(0, cfg["vocab"], (cfg["batch"], cfg["seq"]), generator=g)
    tgt = torch.randint(0, cfg["vocab"], (cfg["batch"], cfg["seq"]), generator=g)
    return model, idx, tgt


def checkpoint_blocks(model) -> None:
    """Wrap every module of ``model.blocks`` in non-reentrant activation checkpointing."""
    import torch.nn as nn
    from torch.utils.checkpoint import checkpoint

    class Checkpointed(nn.Module):
        def __init__(self, block):
            super().__init__()
            self.block = block

        def forward(self, *args):
            return checkpoint(self.block, *args, use_reentrant=False)

    for i, block in enumerate(model.blocks):
        model.blocks[i] = Checkpointed(block)


def _gpt_core(attn, q, k, v):
    """``CausalSelfAttention``'s core, as in ``recompile_opt.models`` (QK^T ... @V)."""
    import torch.nn.functional as F

    s = q.size(-2)
    att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))
    att = att.masked_fill(~attn.causal_mask[:, :, :s, :s], float("-inf"))
    return attn.attn_dropout(F.softmax(att, dim=-1)) @ v


def _gpt_attention_selective(attn, x):
    """``CausalSelfAttention.forward`` with its core under ``torch.utils.checkpoint``."""
    from torch.utils.checkpoint import checkpoint

    b, s, h = x.shape
    q, k, v = attn.c_attn(x).split(h, dim=2)
    q, k, v = (t.view(b, s, attn.n_head, h // attn.n_head).transpose(1, 2) for t in (q, k, v))
    y = checkpoint(_gpt_core, attn, q, k, v, use_reentrant=False)
    return attn.resid_dropout(attn.c_proj(y.transpose(1, 2).contiguous().view(b, s, h)))


def _llama_attention_selective(attn, x, cos, sin):
    """``LlamaAttention.forward`` with its SDPA call under ``torch.utils.checkpoint``."""
    import torch.nn.functional as F
    from recompile_opt.models import apply_rotary
    from torch.utils.checkpoint import checkpoint

    b, s, h = x.shape
    shape = (b, s, attn.n_head, h // attn.n_head)
    q = apply_rotary(attn.wq(x).view(shape), cos, sin).transpose(1, 2)
    k = apply_rotary(attn.wk(x).view(shape), cos, sin).transpose(1, 2)
    v = attn.wv(x).view(shape).transpose(1, 2)
    y = checkpoint(functools.partial(F.scaled_dot_product_attention, is_causal=True), q, k, v,
                   use_reentrant=False)
    return attn.wo(y.transpose(1, 2).reshape(b, s, h))


def checkpoint_attention_cores(model) -> int:
    """Megatron's selective recompute in eager: checkpoint each attention core, nothing else.

    A module with an ``attention_core(q, k, v)`` method gets that method checkpointed; the
    attention modules of ``recompile_opt.models`` (which have none) get a copy of their
    ``forward`` that checkpoints the core.  The gradient check against eager catches a copy
    that drifted from the model.  Returns the number of modules changed."""
    import types

    from recompile_opt import models
    from torch.utils.checkpoint import checkpoint

    n = 0
    for mod in model.modules():
        core = getattr(mod, "attention_core", None)
        if callable(core):
            mod.attention_core = functools.partial(checkpoint, core, use_reentrant=False)
        elif isinstance(mod, models.CausalSelfAttention):
            mod.forward = types.MethodType(_gpt_attention_selective, mod)
        elif isinstance(mod, models.LlamaAttention):
            mod.forward = types.MethodType(_llama_attention_selective, mod)
        else:
            continue
        n += 1
    if not n:
        raise RuntimeError("eager-selective: no attention module found in the model")
    return n


def prepare(spec: dict, model, args):
    """Apply the strategy: returns the callable ``fn(idx, tgt) -> loss``."""
    import torch

    if spec.get("ckpt") == "full":
        checkpoint_blocks(model)
    elif spec.get("ckpt") == "selective":
        checkpoint_attention_cores(model)
    for mod in spec.get("needs", []):
        __import__(mod)  # fail early and clearly, e.g. "No module named 'scipy'"
    for key, value in spec.get("functorch", {}).items():
        setattr(torch._functorch.config, key, value)
    if args.dropout and not args.native_rng:
        torch._inductor.config.fallback_random = True
    if spec["kind"] == "eager":
        return model
    if spec["kind"] == "compile":
        return torch.compile(model)
    importlib.import_module("recompile_opt")  # registers the backend

    options = dict(spec["options"])
    if args.ours_compiler != "inductor":
        options["compiler"] = args.ours_compiler
    return torch.compile(model, backend="recompile_opt", options=options)


@functools.cache
def _flop_mapping() -> dict:
    """Formulas for the CPU flash-attention ops, which ``FlopCounterMode`` lacks (torch 2.13)."""
    import torch
    from torch.utils.flop_counter import flop_registry

    aten = torch.ops.aten

    def raw(formula):  # registry entries already read shapes; don't let the mode wrap them again
        def f(*args, **kwargs):
            return formula(*args, **kwargs)
        f._get_raw = True
        return f

    return {aten._scaled_dot_product_flash_attention_for_cpu:
            raw(flop_registry[aten._scaled_dot_product_flash_attention]),
            aten._scaled_dot_product_flash_attention_for_cpu_backward:
            raw(flop_registry[aten._scaled_dot_product_flash_attention_backward])}


def node_flops(node) -> int:
    """FLOPs of one node of an FX graph from its fake values, by ``torch.utils.flop_counter``'s formulas.

    An op run inside an RNG-state higher-order op (``run_and_save_rng_state``, ``run_with_rng_state``,
    ``graphsafe_run_with_rng_state``: a random op saved or replayed, e.g. SDPA, which takes a
    dropout_p) counts as that op."""
    import torch
    import torch.fx as fx
    import torch.utils._pytree as pytree
    from torch.utils.flop_counter import flop_registry

    if node.op != "call_function":
        return 0
    op, args, kwargs = node.target, node.args, dict(node.kwargs)
    if not isinstance(op, torch._ops.OpOverload):  # a HOP: find the op it runs
        inner = [i for i, a in enumerate(args) if isinstance(a, torch._ops.OpOverload)]
        if not inner:
            return 0
        op, args = args[inner[0]], args[inner[0] + 1:]
        kwargs.pop("rng_state", None)
    packet = op._overloadpacket
    formula = _flop_mapping().get(packet) or flop_registry.get(packet)
    if formula is None:
        return 0
    args, kwargs = pytree.tree_map_only(fx.Node, lambda n: n.meta.get("val"), (args, kwargs))
    out = node.meta.get("val") if node.target is op else None
    return int(formula(*args, **kwargs, out_val=out))


@functools.cache
def _graph_flops_pass():
    """An Inductor post-grad pass that sums the FLOPs of each forward and backward graph it sees."""
    from torch._inductor.custom_graph_pass import CustomGraphPass

    class GraphFlops(CustomGraphPass):
        def __init__(self):
            self.forward: list[int] = []
            self.backward: list[int] = []

        def __call__(self, graph) -> None:
            flops = sum(node_flops(n) for n in graph.nodes)
            backward = any(n.op == "placeholder" and n.name.startswith("tangents") for n in graph.nodes)
            (self.backward if backward else self.forward).append(flops)

        def uuid(self) -> str:  # constant: the pass changes nothing, caching stays on
            return "bench-compare-graph-flops-2"

    return GraphFlops()


def count_flops(fn, idx, tgt) -> tuple[int, int]:
    """(forward, backward) FLOPs of one eager step of ``fn``, counted separately."""
    import torch
    from torch.utils.flop_counter import FlopCounterMode

    mapping = _flop_mapping()
    torch.manual_seed(1234)
    with FlopCounterMode(display=False, custom_mapping=mapping) as fwd:
        loss = fn(idx, tgt)
    with FlopCounterMode(display=False, custom_mapping=mapping) as bwd:
        loss.backward()
    return fwd.get_total_flops(), bwd.get_total_flops()


def plan_figures() -> dict:
    """Estimates of our backend's plans in this process (one per graph, the latest of each)."""
    import recompile_opt

    plans = {p.graph: p for p in recompile_opt.last_plans()}.values()
    if not plans:
        return {}
    return {"plan_saved_bytes": sum(p.saved_bytes for p in plans),
            "plan_recompute_flops": sum(p.recompute_flops for p in plans),
            "plan_predicted_peak_bytes": max(p.predicted_peak_bytes for p in plans),
            "plan_s": sum(p.solver.get("plan_s", 0.0) for p in plans),
            "plans": len(plans)}


def graph_count() -> int:
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


def make_steps(model, fn, idx, tgt):
    """The closures the worker times and measures; RNG reseeded identically each step."""
    import torch

    opt = torch.optim.SGD(model.parameters(), lr=1e-3)

    def fwd_bwd():
        torch.manual_seed(1234)
        fn(idx, tgt).backward()

    def train_step():
        model.zero_grad(set_to_none=True)
        fwd_bwd()
        opt.step()

    return fwd_bwd, train_step


def grad_diff(model, ref) -> float:
    """Max abs difference between the grads of two identically-ordered models."""
    worst = 0.0
    for p, q in zip(model.parameters(), ref.parameters(), strict=True):
        if p.grad is None and q.grad is None:
            continue
        if p.grad is None or q.grad is None:
            return float("inf")
        worst = max(worst, (p.grad - q.grad).abs().max().item())
    return worst


def _proc_status_kib(key: str) -> int | None:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1])
    except OSError:
        pass
    return None


def rss_rise(step_fn) -> int | None:
    """Resident high-water mark during ``step_fn()`` minus the resident size before (Linux)."""
    before = _proc_status_kib("VmRSS")
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # resets VmHWM to the current VmRSS
    except OSError:
        return None
    step_fn()
    hwm = _proc_status_kib("VmHWM")
    return None if before is None or hwm is None else (hwm - before) * 1024


class JobLock:
    """Shared/exclusive lock on the driver's lock file (``--jobs N``), so that no run is timed while
    another process does anything: a worker holds it *shared* from its start (import, model, compile)
    and *exclusive* for its timed section (steps, saved bytes, peak), which therefore waits until no
    other worker is starting or compiling, and makes them wait.  Without ``COMPARE_TIMING_LOCK``
    (``--jobs 1``) it does nothing."""

    def __init__(self, path: str | None = None):
        self.path = path if path is not None else os.environ.get(LOCK_ENV)
        self.file = open(self.path, "a") if self.path else None  # noqa: SIM115 -- held for the process

    def _flock(self, mode: str) -> None:
        if self.file is not None:
            import fcntl

            fcntl.flock(self.file, getattr(fcntl, mode))

    def shared(self) -> None:
        self._flock("LOCK_SH")

    def release(self) -> None:
        if self.file is not None:
            self.file.close()  # closing drops the lock
            self.file = None

    @contextlib.contextmanager
    def exclusive(self):
        self._flock("LOCK_EX")  # converting shared -> exclusive drops the shared lock first: no deadlock
        try:
            yield
        finally:
            self._flock("LOCK_UN")


def kernels_built() -> int | None:
    """Shared objects in this worker's Inductor cache: one per C++ kernel module it compiled (on the
    CPU each takes ~1 s of a cold compile with one compile thread, the bulk of it), so a plan that
    recomputes in the backward shows here what its extra kernels cost. None without a private cache."""
    cache = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    return sum(1 for _ in pathlib.Path(cache).rglob("*.so")) if cache else None


def run_worker(name: str, args) -> dict:
    """Run one strategy; fill ``out`` stage by stage so a failure keeps partial figures."""
    out: dict = {"strategy": name}
    lock = JobLock()
    lock.shared()
    try:
        measure_strategy(name, args, out, lock)
    except BaseException as exc:  # noqa: BLE001 -- report, never crash the driver
        traceback.print_exc(file=sys.stderr)
        out["error"] = f"{type(exc).__name__}: {exc}".strip()
    return out


def measure_strategy(name: str, args, out: dict, lock: JobLock | None = None) -> None:
    import copy
    import gc

    import torch
    from recompile_opt.costs import measure
    from recompile_opt._torch_internals import cpp_build_timer

    if args.threads:
        torch.set_num_threads(args.threads)
    out.update(torch=torch.__version__, threads=torch.get_num_threads())
    spec = strategy(name)
    cfg = group_configs(args)[0]
    model, idx, tgt = build_model(cfg)
    ref = copy.deepcopy(model)  # untouched eager copy: gradient check and save-all FLOPs
    eager_fwd, eager_bwd = count_flops(ref, idx, tgt)
    out.update(eager_fwd_flops=eager_fwd, eager_bwd_flops=eager_bwd)
    fn = prepare(spec, model, args)
    compiled = spec["kind"] != "eager"
    if compiled:
        torch._inductor.config.post_grad_custom_post_pass = _graph_flops_pass()
    fwd_bwd, train_step = make_steps(model, fn, idx, tgt)

    built = kernels_built()
    t0 = time.perf_counter()
    with cpp_build_timer() as builds:
        fwd_bwd()  # the cold call: trace + compile forward and backward
    out["first_step_s"] = time.perf_counter() - t0
    out["kernel_build_s"] = builds["s"]
    if built is not None:
        out["kernels_built"] = kernels_built() - built
    out["max_grad_diff"] = grad_diff(model, ref)
    graphs = out["graphs"] = graph_count()
    if compiled:
        counter = _graph_flops_pass()
        if counter.backward:  # empty on an Inductor cache hit: the pass did not run
            out.update(fwd_flops=sum(counter.forward), bwd_flops=sum(counter.backward))
    else:
        model.zero_grad(set_to_none=True)
        out["fwd_flops"], out["bwd_flops"] = count_flops(fn, idx, tgt)
    if "bwd_flops" in out:
        out["recompute_flops"] = out["bwd_flops"] - eager_bwd

    with (lock or JobLock("")).exclusive():
        out["loadavg_1m"] = os.getloadavg()[0]  # other load skews CPU timings; flagged in notes
        times = measure.step_time(train_step, steps=args.steps, warmup=args.warmup)
        out.update(step_s=times, step_median_s=statistics.median(times))

        model.zero_grad(set_to_none=True)
        torch.manual_seed(1234)
        report, loss = measure.saved_report(lambda: fn(idx, tgt), exclude=[model, idx, tgt])
        loss.backward()
        del loss
        out.update(saved_bytes=report.total_bytes, saved_storages=len(report.breakdown))

        model.zero_grad(set_to_none=True)
        gc.collect()
        peak = measure.memory_profile(fwd_bwd)
        out.update(peak_bytes=peak.peak_bytes, alloc_bytes=peak.alloc_bytes)
        model.zero_grad(set_to_none=True)
        gc.collect()
        out["rss_rise_bytes"] = rss_rise(fwd_bwd)
    out["recompiles"] = graph_count() - graphs
    if spec["kind"] == "ours":
        out.update(plan_figures())
    out["rss_hwm_bytes"] = measure.process_high_water_mark()


# --------------------------------------------------------------------------
# Driver: fresh processes, interleaved rounds
# --------------------------------------------------------------------------


def worker_env(cache_dir: str, *, warm_cache: bool, lock: str | None) -> dict:
    env = dict(os.environ)
    cache = "1" if warm_cache else "0"
    env.update(TORCHINDUCTOR_CACHE_DIR=cache_dir, TORCHINDUCTOR_FX_GRAPH_CACHE=cache,
               TORCHINDUCTOR_AUTOGRAD_CACHE=cache, TORCHINDUCTOR_COMPILE_THREADS="1",
               PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")])))
    env.pop(LOCK_ENV, None)
    if lock:
        env[LOCK_ENV] = lock
    return env


def worker_command(name: str, cfg: dict, args) -> list[str]:
    """The command of one run; raises ``FileNotFoundError`` when an external runner cannot start."""
    spec = strategy(name)
    flags = [a for flag in WORKER_FLAGS for a in (f"--{flag}", str(cfg[flag]))]
    if spec["kind"] != "external":
        return [sys.executable, str(Path(__file__).resolve()), "--worker", name, *flags,
                "--ours-compiler", args.ours_compiler] + (["--native-rng"] if args.native_rng else [])
    runner = Path(spec["runner"])
    if not runner.is_file():
        raise FileNotFoundError(f"{runner.relative_to(REPO)} missing")
    python = args.rockmate_python
    if not (os.path.isfile(python) and os.access(python, os.X_OK)):
        raise FileNotFoundError(f"no interpreter at {python} (set --rockmate-python or "
                                "RECOMPILE_OPT_ROCKMATE_PYTHON; see bench/ROCKMATE.md)")
    return [python, str(runner), "--strategy", name, *spec.get("runner_args", []), *flags]


def spawn_worker(name: str, cfg: dict, args, *, cache_dir: str | None = None,
                 lock: str | None = None) -> dict:
    """Run one strategy in a fresh interpreter; ``cache_dir`` None: a private, empty cache, caches off."""
    try:
        cmd = worker_command(name, cfg, args)
    except FileNotFoundError as exc:
        return {"strategy": name, "error": str(exc)}
    warm = cache_dir is not None
    own_dir = cache_dir or tempfile.mkdtemp(prefix="compare_inductor_")
    cached = warm and any(Path(own_dir).iterdir())
    # an external runner knows nothing of the lock: hold it shared for the whole of its run
    held = JobLock(lock or "") if strategy(name)["kind"] == "external" else JobLock("")
    held.shared()
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(cmd, env=worker_env(own_dir, warm_cache=warm, lock=lock),
                              capture_output=True, text=True, timeout=args.timeout, cwd=REPO)
    except subprocess.TimeoutExpired:
        return {"strategy": name, "error": f"timeout after {args.timeout}s"}
    finally:
        held.release()
        if not warm:
            shutil.rmtree(own_dir, ignore_errors=True)
    wall = time.perf_counter() - t0
    for line in reversed(proc.stdout.splitlines()):
        if line.startswith(MARKER):
            result = json.loads(line[len(MARKER):])
            result.update(strategy=name, process_wall_s=wall, cache="warm" if cached else "cold")
            if args.verbose and proc.stderr.strip():
                print(proc.stderr, file=sys.stderr)
            return result
    tail = [ln for ln in proc.stderr.strip().splitlines() if ln.strip()][-1:] or ["no output"]
    return {"strategy": name, "error": f"worker exited rc={proc.returncode}: {tail[0]}"}


def progress_line(label: str, res: dict) -> str:
    head = f"[{label}] {res['strategy']:<24}"
    if "error" in res:
        return f"{head} ERROR: {res['error']}"
    parts = [f"{res['step_median_s'] * 1e3:8.1f} ms/step",
             f"first step {res['first_step_s']:6.1f} s ({res.get('cache', 'cold')})"]
    if res.get("saved_bytes") is not None:
        parts.append(f"saved {res['saved_bytes'] / MiB:7.2f} MiB")
    parts += [f"peak {res['peak_bytes'] / MiB:7.2f} MiB", f"({res['process_wall_s']:.0f} s wall)"]
    return head + "  " + "  ".join(parts)


def _raise_interrupt(signum, frame):
    raise KeyboardInterrupt


def run_rounds(names: list[str], cfg: dict, args, runs: list[dict], label: str = "") -> None:
    """Append one result per (round, strategy) to ``runs`` (in place, so an interrupt keeps them)."""
    failed: set[str] = set()
    caches = {} if args.cold_every_round else {
        n: tempfile.mkdtemp(prefix=f"compare_{cfg['model']}_{cfg['size']}_{n}_") for n in names}
    lock = tempfile.mkstemp(prefix="compare_lock_")[1] if args.jobs > 1 else None
    print_lock = threading.Lock()
    try:
        for rnd in range(1, args.repeats + 1):
            order = [n for n in names if n not in failed]
            random.Random(args.order_seed + rnd).shuffle(order)
            with ThreadPoolExecutor(max_workers=args.jobs) as pool:
                futures = [pool.submit(spawn_worker, n, cfg, args, cache_dir=caches.get(n), lock=lock)
                           for n in order]
                for fut in as_completed(futures):
                    res = fut.result()
                    res["round"] = rnd
                    with print_lock:
                        runs.append(res)
                        print(progress_line(f"{label}round {rnd}/{args.repeats}", res),
                              file=sys.stderr, flush=True)
                    if "error" in res:
                        failed.add(res["strategy"])
    finally:
        for d in caches.values():
            shutil.rmtree(d, ignore_errors=True)
        if lock:
            os.unlink(lock)


# --------------------------------------------------------------------------
# Aggregation and output
# --------------------------------------------------------------------------


def _median(values: list) -> float | None:
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def aggregate(name: str, runs: list[dict]) -> dict:
    """One table row from all processes of one strategy."""
    mine = [r for r in runs if r["strategy"] == name]
    ok = [r for r in mine if "error" not in r]
    row: dict = {"strategy": name, "processes": len(ok)}
    errors = [r["error"] for r in mine if "error" in r]
    if errors:
        row["error"] = errors[0]
    if not mine:
        row["notes"] = ["not run (interrupted)"]
    if note := STRATEGIES.get(name, {}).get("note"):  # ours-peak-SIZE has none
        row.setdefault("notes", []).append(note)
    if not ok:
        return row
    steps = [t for r in ok for t in r["step_s"]]
    cold = [r["first_step_s"] for r in ok if r.get("cache", "cold") == "cold"]
    warm = [r["first_step_s"] for r in ok if r.get("cache") == "warm"]
    row.update(step_ms=1e3 * _median([r["step_median_s"] for r in ok]),
               step_ms_min=1e3 * min(steps), step_ms_max=1e3 * max(steps),
               max_grad_diff=max(r["max_grad_diff"] for r in ok),
               recompiles=max(r.get("recompiles", 0) for r in ok),
               graphs=max(r.get("graphs", 1) for r in ok),
               loadavg_1m=max(r.get("loadavg_1m", 0.0) for r in ok))
    if cold:
        row.update(compile_s=_median(cold), compile_s_min=min(cold), compile_s_max=max(cold))
    for key in ("kernels_built", "kernel_build_s", "plan_s"):  # what a cold compile spent, and on what
        vals = [r[key] for r in ok if r.get("cache", "cold") == "cold" and r.get(key) is not None]
        if vals:
            row[key] = _median(vals)
    if warm:
        row["warm_first_s"] = _median(warm)
    for key in ("saved_bytes", "peak_bytes", "rss_rise_bytes", "recompute_flops", "plan_saved_bytes",
                "plan_predicted_peak_bytes", "plan_recompute_flops", "rss_hwm_bytes",
                "saved_bytes_autograd"):
        vals = [r[key] for r in ok if r.get(key) is not None]
        if vals:
            row[key] = _median(vals)
            if key in ("saved_bytes", "peak_bytes", "recompute_flops") and max(vals) != min(vals):
                row.setdefault("notes", []).append(f"{key} varies {min(vals)}..{max(vals)}")
    fwd = {(r["fwd_flops"], r["eager_fwd_flops"]) for r in ok if "fwd_flops" in r}
    if any(a != b for a, b in fwd):
        a, b = fwd.pop()
        row.setdefault("notes", []).append(f"forward FLOPs {a / 1e9:.3f} G vs eager {b / 1e9:.3f} G")
    if "saved_bytes_autograd" in row and "saved_bytes" not in row:
        row.setdefault("notes", []).append(
            f"{row['saved_bytes_autograd'] / MiB:.2f} MiB packed by autograd (keeps its own storage)")
    return row


def _mib(v) -> str:
    return "—" if v is None else f"{v / MiB:.2f}"


def _gflop(v) -> str:
    return "—" if v is None else f"{v / 1e9:.3f}"


def _notes(row: dict, cpus: int | None = None) -> str:
    notes = list(row.get("notes", []))
    if row.get("recompiles"):
        notes.append(f"{row['recompiles']} recompile(s) while measuring")
    if row.get("loadavg_1m", 0) > (cpus or os.cpu_count() or 1):
        notes.append(f"busy machine (load {row['loadavg_1m']:.1f})")
    if row.get("graphs", 1) > 1:
        notes.append(f"{row['graphs']} graphs")
    if "error" in row:
        msg = " ".join(row["error"].split())
        notes.append("ERROR: " + (msg if len(msg) <= 300 else msg[:297] + "..."))
    return "; ".join(notes).replace("|", "\\|")


# (header, kind) -- kind is what the legend says: measured, counted or estimated
COLUMNS = [("strategy", ""), ("step ms median", "M"), ("step ms min–max", "M"),
           ("compile s cold (min–max)", "M"), ("of it C++ builds s", "M"), ("of it planning s", "M"),
           ("kernels built cold", "M"), ("first step s warm", "M"),
           ("saved MiB", "M"),
           ("peak MiB", "M"), ("RSS rise MiB", "M"), ("max abs dgrad", "M"),
           ("recompute GFLOP", "C"), ("plan saved MiB", "E"), ("plan peak MiB", "E"),
           ("plan recompute GFLOP", "E"), ("notes", "")]
LEGEND = """\
Columns: **M** measured in the worker process; **C** counted (FLOP formulas of
`torch.utils.flop_counter` over the ops that ran: eager backward under `FlopCounterMode`, compiled
backward graphs from an Inductor post-grad pass), minus eager's save-all backward; **E** our
planner's estimates (`recompile_opt.last_plans()`). Step = forward + backward + SGD, median of the
processes' medians, min–max over every timed step. Compile = first forward+backward with an empty
Inductor cache; "warm" = later rounds, cache reused; of it C++ builds = wall time during which
Inductor's C++ compiler ran in that cold compile; of it planning = our partitioner's wall time (cost
model, least-peak search, partition; `plan.solver["plan_s"]`); kernels built = C++ kernel modules
that cold compile produced (shared objects in its private cache). Peak = forward + backward from
grads `None`, integrated from the profiler's allocation records; RSS rise = resident high-water mark
of another such call minus the resident size before it (a cross-check: lower where the C allocator
reuses memory it kept). Saved = `saved_tensors_hooks`, storages deduplicated, parameters excluded."""


def markdown_table(rows: list[dict], cpus: int | None = None) -> str:
    head = [f"{h} [{k}]" if k else h for h, k in COLUMNS]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(COLUMNS)]
    for r in rows:
        ok = "step_ms" in r
        compile_s = (f"{r['compile_s']:.1f} ({r['compile_s_min']:.1f}–{r['compile_s_max']:.1f})"
                     if "compile_s" in r else "—")
        cells = [r["strategy"],
                 f"{r['step_ms']:.1f}" if ok else "—",
                 f"{r['step_ms_min']:.1f}–{r['step_ms_max']:.1f}" if ok else "—",
                 compile_s,
                 f"{r['kernel_build_s']:.1f}" if "kernel_build_s" in r else "—",
                 f"{r['plan_s']:.1f}" if "plan_s" in r else "—",
                 f"{r['kernels_built']:g}" if "kernels_built" in r else "—",
                 f"{r['warm_first_s']:.1f}" if "warm_first_s" in r else "—",
                 _mib(r.get("saved_bytes")), _mib(r.get("peak_bytes")), _mib(r.get("rss_rise_bytes")),
                 f"{r['max_grad_diff']:.1e}" if ok else "—",
                 _gflop(r.get("recompute_flops")),
                 _mib(r.get("plan_saved_bytes")), _mib(r.get("plan_predicted_peak_bytes")),
                 _gflop(r.get("plan_recompute_flops")),
                 _notes(r, cpus)]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


# --------------------------------------------------------------------------
# Pareto check on the measured (peak, step time) plane
# --------------------------------------------------------------------------


def is_ours(name: str) -> bool:
    return name.startswith("ours-")


def dominates(a: dict, b: dict, noise: float = 0.10) -> bool:
    """``a``'s peak is at most ``b``'s and ``a``'s step is more than ``noise`` faster."""
    return a["peak_bytes"] <= b["peak_bytes"] and a["step_ms"] < (1 - noise) * b["step_ms"]


def covers(a: dict, b: dict, noise: float = 0.10) -> bool:
    """``a`` is on or below ``b``: peak at most ``b``'s, step at most ``noise`` slower."""
    return a["peak_bytes"] <= b["peak_bytes"] and a["step_ms"] <= (1 + noise) * b["step_ms"]


def pareto_check(rows: list[dict], noise: float = 0.10) -> dict:
    """Dominance between measured points. ``ours``: each ``ours-*`` row, on the frontier or dominated
    by which rows; ``others``: each other row, dominated / matched / not covered by our points, and
    for "not covered" the ours point of least peak at or below its peak (``nearest``) if any."""
    pts = [r for r in rows if r.get("peak_bytes") is not None and r.get("step_ms") is not None]
    mine = [r for r in pts if is_ours(r["strategy"])]
    theirs = [r for r in pts if not is_ours(r["strategy"])]
    out: dict = {"noise": noise, "ours": [], "others": [],
                 "no_figures": [r["strategy"] for r in rows if r not in pts]}
    for r in mine:
        by = [o["strategy"] for o in pts if o is not r and dominates(o, r, noise)]
        out["ours"].append({"strategy": r["strategy"], "status": "dominated" if by else "frontier", "by": by})
    for r in theirs:
        entry: dict = {"strategy": r["strategy"]}
        dom = [o["strategy"] for o in mine if dominates(o, r, noise)]
        match = [o["strategy"] for o in mine if covers(o, r, noise)]
        if dom:
            entry.update(status="dominated", by=dom)
        elif match:
            entry.update(status="matched", by=match)
        else:
            below = [o for o in mine if o["peak_bytes"] <= r["peak_bytes"]]
            entry.update(status="not covered", by=[])
            if below:
                best = min(below, key=lambda o: o["step_ms"])
                entry["nearest"] = {"strategy": best["strategy"], "slowdown": best["step_ms"] / r["step_ms"]}
            elif mine:
                entry["least_ours_peak_bytes"] = min(o["peak_bytes"] for o in mine)
        out["others"].append(entry)
    return out


def pareto_markdown(rows: list[dict], check: dict) -> str:
    by_name = {r["strategy"]: r for r in rows}

    def pt(name: str) -> str:
        r = by_name[name]
        return f"`{name}` ({r['peak_bytes'] / MiB:.2f} MiB, {r['step_ms']:.1f} ms)"

    pct = f"{check['noise']:.0%}"
    lines = [f"Pareto check on the measured plane (peak MiB, median step ms). A point *dominates* another "
             f"when its peak is at most the other's and its step is more than {pct} faster (the noise "
             f"allowance); ours is *on or below* a point when an ours point has at most its peak and a "
             f"step at most {pct} slower.", "", "Ours:"]
    for e in check["ours"]:
        what = ("on the frontier" if e["status"] == "frontier"
                else "dominated by " + ", ".join(pt(n) for n in e["by"]))
        lines.append(f"- {pt(e['strategy'])}: {what}")
    lines += ["", "Other strategies against ours:"]
    missing = []
    for e in check["others"]:
        if e["status"] == "dominated":
            what = "dominated by " + ", ".join(f"`{n}`" for n in e["by"])
        elif e["status"] == "matched":
            what = "ours on or below it (within the noise): " + ", ".join(f"`{n}`" for n in e["by"])
        else:
            missing.append(e["strategy"])
            if "nearest" in e:
                n = e["nearest"]
                what = (f"**not covered**: the fastest ours point at or below its peak, {pt(n['strategy'])}, "
                        f"is {n['slowdown']:.2f}x slower")
            elif "least_ours_peak_bytes" in e:
                what = (f"**not covered**: no ours point reaches its peak (least ours peak "
                        f"{e['least_ours_peak_bytes'] / MiB:.2f} MiB)")
            else:
                what = "**not covered**: no ours point has figures"
        lines.append(f"- {pt(e['strategy'])}: {what}")
    if check["no_figures"]:
        lines.append("- no figures (failed or not run): " + ", ".join(f"`{n}`" for n in check["no_figures"]))
    n = len(check["others"])
    lines += ["", f"Summary: ours is on or below {n - len(missing)} of {n} other measured points"
              + (f"; not below {', '.join(f'`{m}`' for m in missing)}." if missing else ".")]
    return "\n".join(lines)


CSV_KEYS = ["model", "size", "strategy", "processes", "step_ms", "step_ms_min", "step_ms_max",
            "compile_s", "compile_s_min", "compile_s_max", "kernel_build_s", "plan_s", "kernels_built",
            "warm_first_s", "saved_bytes", "peak_bytes", "rss_rise_bytes", "max_grad_diff", "recompute_flops",
            "plan_saved_bytes", "plan_predicted_peak_bytes", "plan_recompute_flops", "rss_hwm_bytes", "graphs",
            "recompiles", "loadavg_1m", "error"]


def write_csv(path: str, groups: list[dict]) -> None:
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=CSV_KEYS, extrasaction="ignore")
        writer.writeheader()
        for g in groups:
            writer.writerows({"model": g["config"]["model"], "size": g["config"]["size"], **r}
                             for r in g["rows"])


def group_markdown(group: dict, args) -> str:
    cfg = group["config"]
    wall = f" ({group['wall_s'] / 60:.1f} min)" if "wall_s" in group else ""
    return "\n".join([f"### {group_title(cfg)}{wall}", "", markdown_table(group["rows"]), "",
                      pareto_markdown(group["rows"], group["pareto"])])


# --------------------------------------------------------------------------
# CLI
# --------------------------------------------------------------------------


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--strategies", default=",".join(DEFAULT_STRATEGIES),
                   help="comma-separated subset of: " + ", ".join(STRATEGIES) + f", {PEAK_PREFIX}SIZE")
    p.add_argument("--model", default="gpt", help="gpt, llama or both: gpt,llama")
    p.add_argument("--size", default="small", help=f"comma-separated presets from {list(SIZES)}")
    p.add_argument("--repeats", type=int, default=2, help="rounds of fresh processes")
    p.add_argument("--steps", type=int, default=5, help="timed steps per process (>= 5)")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps after the compile step")
    for flag, text in (("layers", "layers"), ("embd", "hidden size"), ("heads", "attention heads"),
                       ("seq", "sequence length (= block_size)"), ("batch", "batch size")):
        p.add_argument(f"--{flag}", type=int, default=None, help=f"{text} (overrides the --size preset)")
    p.add_argument("--vocab", type=int, default=512)
    p.add_argument("--dropout", type=float, default=0.0, help="GPT dropout, e.g. 0.1 (Llama has none)")
    p.add_argument("--native-rng", action="store_true",
                   help="with dropout, keep Inductor's own RNG (grads then differ from eager)")
    p.add_argument("--threads", type=int, default=1,
                   help="torch.set_num_threads in workers (0: torch's default). Default 1: on a "
                        "shared machine, OpenMP teams stall when another process takes a core "
                        "(seen: 100x slower steps), single-threaded timings stay comparable")
    p.add_argument("--jobs", type=int, default=1,
                   help="workers at once: their starts and compiles overlap, no timed section overlaps "
                        "any other work of this run (a shared/exclusive file lock)")
    p.add_argument("--cold-every-round", action="store_true",
                   help="empty Inductor cache (caches off) in every round, not only the first")
    p.add_argument("--ours-compiler", choices=["inductor", "eager"], default="inductor",
                   help="our backend's compiler option; eager: same partition, no code generation "
                        "(seconds instead of a minute: for tests, not for timings)")
    p.add_argument("--noise", type=float, default=0.10, help="step-time allowance of the Pareto check")
    p.add_argument("--rockmate-python",
                   default=os.environ.get("RECOMPILE_OPT_ROCKMATE_PYTHON", ROCKMATE_PYTHON),
                   help="interpreter of the Rockmate venv (runs bench/rockmate_runner.py)")
    p.add_argument("--timeout", type=int, default=1800, help="seconds per worker process")
    p.add_argument("--order-seed", type=int, default=0, help="seed of the per-round shuffle")
    p.add_argument("--json", help="write config, rows, Pareto check and raw runs to this JSON file")
    p.add_argument("--csv", help="write aggregated rows (all groups) to this CSV file")
    p.add_argument("--md", help="write the markdown report to this file")
    p.add_argument("--verbose", action="store_true", help="echo workers' stderr")
    p.add_argument("--worker", metavar="STRATEGY", help=argparse.SUPPRESS)
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.worker:
        print(MARKER + json.dumps(run_worker(args.worker, args)), flush=True)
        return 0
    names = [s.strip() for s in args.strategies.split(",") if s.strip()]
    for n in names:
        try:
            strategy(n)
        except KeyError as e:
            raise SystemExit(e.args[0]) from None
    configs = group_configs(args)
    if args.steps < 5:
        print(f"note: --steps {args.steps} < 5, medians will be noisy", file=sys.stderr)
    print(f"{len(configs)} model size(s) x {len(names)} strategies x {args.repeats} round(s), "
          f"{args.jobs} at a time", file=sys.stderr, flush=True)
    signal.signal(signal.SIGTERM, _raise_interrupt)  # a killed run still prints its tables
    t0 = time.perf_counter()
    groups = [{"config": cfg, "runs": []} for cfg in configs]
    try:
        for g in groups:
            cfg, t1 = g["config"], time.perf_counter()
            run_rounds(names, cfg, args, g["runs"], label=f"{cfg['model']} {cfg['size']} ")
            g["wall_s"] = time.perf_counter() - t1
    except KeyboardInterrupt:
        print("interrupted: reporting the runs finished so far", file=sys.stderr)
    wall = time.perf_counter() - t0
    for g in groups:
        g["rows"] = [aggregate(n, g["runs"]) for n in names]
        g["pareto"] = pareto_check(g["rows"], args.noise)
    settings = {k: getattr(args, k) for k in ("repeats", "steps", "warmup", "threads", "jobs", "native_rng",
                                              "cold_every_round", "noise", "order_seed", "ours_compiler")}
    command = "python bench/compare.py " + " ".join(sys.argv[1:] if argv is None else argv)
    report = "\n\n".join([f"`{command}`: {json.dumps(settings)}; {wall / 60:.1f} min on "
                          f"{os.cpu_count()} CPUs", *(group_markdown(g, args) for g in groups), LEGEND])
    print("\n" + report)
    print(f"\ntotal wall {wall / 60:.1f} min", file=sys.stderr)
    if args.md:
        Path(args.md).write_text(report + "\n")
    if args.json:
        Path(args.json).write_text(json.dumps({"command": command, "settings": settings, "wall_s": wall,
                                               "groups": groups}, indent=1))
    if args.csv:
        write_csv(args.csv, groups)
    return 0


if __name__ == "__main__":
    sys.exit(main())
