"""Rockmate (Zhao et al., ICML 2023) on our GPT on the CPU, in its own venv.

Run with the Rockmate venv's interpreter, never with the project's::

    /work/rockmate-venv/bin/python bench/rockmate_runner.py [--budget-frac 0.5] [compare.py worker flags]

It prints one line ``@@COMPARE_RESULT@@ {json}`` (``--plain``: the bare JSON), the
same form as a ``bench/compare.py --worker`` process, so the driver can parse it.
When Rockmate cannot be imported, built or run, the JSON is
``{"strategy": ..., "error": "<exact reason>"}``; ``attempts`` lists every
version tried with its exception verbatim. See bench/ROCKMATE.md.

What it tries, in order (``--version`` picks one):

* ``2.0.0`` -- PyPI's current rockmate, installed in the venv's site-packages.
  It does not import: the rkgb 2.0.0 sdist ships only ``rkgb/__init__.py`` and
  ``rkgb/rkgb.py``, ``import rkgb`` fails on ``from .core import base``.
* ``1.0.1`` -- PyPI's previous rockmate + rkgb (complete packages), installed
  with ``pip install --target`` in ``$ROCKMATE_101_PATH``
  (default ``/work/rockmate-venv/rockmate-1.0.1``). Small monkeypatches, each
  named in the output's ``patches``, get it past torch-2.x TorchScript output and
  past its CUDA-only RNG bookkeeping; its block ILPs are solved with python-mip/CBC
  (``ModelMIP``, which ships in rockmate 1.0.1 but is stale) because the PyPI
  gurobipy licence is size-limited ("Model too large for size-limited license").

Figures mirror compare.py's worker: first step (includes Rockmate's graph
building and ILP/DP solve), median step time of forward+backward+SGD, saved bytes
packed for backward (``recompile_opt.costs.measure.saved_report``; Rockmate keeps its
activations in its own storage, not in autograd's saved tensors, so this is
reported as ``saved_bytes_autograd`` only), peak bytes from the profiler, and
max |dgrad| against an eager copy.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import importlib.util
import json
import os
import statistics
import sys
import time
import traceback
import types
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
MARKER = "@@COMPARE_RESULT@@ "
V101_PATH = os.environ.get("ROCKMATE_101_PATH", "/work/rockmate-venv/rockmate-1.0.1")


def load_file_module(name: str, path: Path):
    """Import one of our modules by path, as ``recompile_opt.<dotted path>`` of bare packages (our
    source folders as their paths, their ``__init__`` not run): ``recompile_opt/__init__`` pulls the
    whole package (PuLP, networkx and the ``passes`` sub-package mapped by pyproject), which the
    Rockmate venv does not install; models.py needs only torch, costs/measure.py torch and our
    ``_torch_internals`` (found through the bare package). ``name`` is an alias kept in sys.modules."""
    root = REPO / "recompile_opt"
    parts = path.relative_to(root).with_suffix("").parts
    for i in range(len(parts)):  # recompile_opt, then each sub-package above the module
        package_name = ".".join(("recompile_opt", *parts[:i]))
        if package_name not in sys.modules:
            package = types.ModuleType(package_name)
            package.__path__ = [str(root.joinpath(*parts[:i]))]
            sys.modules[package_name] = package
    spec = importlib.util.spec_from_file_location(".".join(("recompile_opt", *parts)), path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


def exc_text(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}".strip()


def forget(prefixes=("rockmate", "rkgb")) -> None:
    for key in [k for k in sys.modules if k.split(".")[0] in prefixes]:
        del sys.modules[key]


# --------------------------------------------------------------------------
# Rockmate 2.0.0
# --------------------------------------------------------------------------


def build_v200(model, idx, tgt, budget, args, out):
    import rockmate  # noqa: F401 -- fails: "No module named 'rkgb.core'"

    out["rockmate_version"] = "2.0.0"
    return rockmate.Rockmate(model, {"idx": idx, "targets": tgt}, budget=budget)


# --------------------------------------------------------------------------
# Rockmate 1.0.1 (+ rkgb 1.0.1), with small monkeypatches
# --------------------------------------------------------------------------


def patch_v101(args, patches: list[str]):
    import ast

    import torch
    from rkgb.utils import ast_add_on, global_vars

    # 1. torch>=2 TorchScript prints ``torch.arange(..., dtype=None, ...)``;
    #    rkgb 1.0.1 expects an int code there:
    #    "Exception: TorchScript usually changes torch.dtype by weird integers,
    #     but here it's neither a dtype nor an integer, what is it ??? : None"
    orig_dtype = global_vars.get_torchscript_dtype
    global_vars.get_torchscript_dtype = lambda t: None if t is None else orig_dtype(t)
    patches.append("rkgb get_torchscript_dtype(None) -> None")

    # 2. ``masked_fill(..., -inf)`` traces to ``-inf`` (USub of the *name* inf);
    #    rkgb asserts the operand of a unary minus is a constant (AssertionError).
    orig_is_constant = ast_add_on.is_constant

    def is_constant(v):
        if isinstance(v, ast.Name) and v.id in ("inf", "nan"):
            v.__class__ = ast.Constant  # astunparse prints 1e309 for inf
            v.value, v.kind = float(v.id), None
        return orig_is_constant(v)

    ast_add_on.is_constant = is_constant
    patches.append("rkgb ast is_constant: name inf/nan -> float constant")

    # 3. Block ILPs: gurobipy's PyPI licence is size-limited (GurobiError "Model too
    #    large for size-limited license"); use rockmate's own python-mip model
    #    (CBC) instead, which expects MemSize objects (``.v``) where rkgb 1.0.1 has
    #    ints, imports a ``solver_name`` rkgb 1.0.1 lacks, and treats a timed-out
    #    solve as feasible.
    global_vars.solver_name = ["CBC"]
    from mip import OptimizationStatus
    from rockmate import ILP_MIP, def_chain

    class IntV(int):
        v = property(int)

    def model_mip(kg, budget, save_budget, gcd=None, gurobi_params=None):
        for kcn in kg.list_kcn:
            if not hasattr(kcn.overhead, "v"):
                kcn.overhead = IntV(kcn.overhead)
        for kdn in kg.list_kdn:
            if not hasattr(kdn.mem, "v"):
                kdn.mem = IntV(kdn.mem)
        md = ILP_MIP.ModelMIP(kg, budget, save_budget, gcd=gcd)
        md.md.verbose = 0
        md.md.threads = 1

        def solve():
            md.md.optimize(max_seconds=args.ilp_seconds)
            md.feasible = md.md.status in (OptimizationStatus.OPTIMAL, OptimizationStatus.FEASIBLE)
            out_ilp.append(str(md.md.status).split(".")[-1])

        md.solve = solve
        return md

    out_ilp: list[str] = []
    def_chain.ModelGurobi = model_mip
    patches.append(f"block ILP: ModelMIP/CBC, {args.ilp_seconds}s per solve (not gurobipy)")

    # 4. The compiler saves/restores ``torch.cuda.get_rng_state()`` around random
    #    ops (dropout) -- CUDA-only; keep the CPU generator part only.
    from rockmate import compiler

    def rng_get(self, op_name):
        if op_name not in self.cpu_states:
            self.cpu_states[op_name] = torch.get_rng_state()

    def rng_restore(self, op_name):
        torch.set_rng_state(self.cpu_states[op_name])

    compiler.RngState.get, compiler.RngState.restore = rng_get, rng_restore
    patches.append("compiler RngState: CPU generator only (was torch.cuda.get/set_rng_state)")
    return out_ilp


def build_v101(model, idx, tgt, budget, args, out):
    if not Path(V101_PATH, "rockmate").is_dir():
        raise ModuleNotFoundError(
            f"rockmate 1.0.1 not installed at {V101_PATH} "
            "(pip install --no-deps --target ... rockmate==1.0.1 rkgb==1.0.1)"
        )
    forget()
    sys.path.insert(0, V101_PATH)
    import rockmate

    out["rockmate_version"] = "1.0.1"
    patches: list[str] = []
    ilp_status = patch_v101(args, patches)
    out["patches"] = patches
    out["ilp_status"] = ilp_status
    # budget=None would read torch.cuda.get_device_properties(0); always pass one.
    return rockmate.Rockmate(
        model,
        {"idx": idx, "targets": tgt},
        budget=budget,
        nb_budget_save=args.nb_budget_save,
        nb_budget_peak=args.nb_budget_peak,
    )


# --------------------------------------------------------------------------
# Measurement
# --------------------------------------------------------------------------


def run(args, out: dict) -> None:
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    out.update(torch=torch.__version__, threads=torch.get_num_threads())
    models = load_file_module("ro_models", REPO / "recompile_opt" / "models.py")
    measure = load_file_module("ro_measure", REPO / "recompile_opt" / "costs" / "measure.py")
    if args.model == "gpt":
        config = models.GPTConfig(
            n_layer=args.layers,
            n_head=args.heads,
            n_embd=args.embd,
            block_size=args.seq,
            vocab_size=args.vocab,
            dropout=args.dropout,
        )
    elif args.model == "llama":
        config = models.LlamaConfig(
            n_layer=args.layers,
            n_head=args.heads,
            n_embd=args.embd,
            block_size=args.seq,
            vocab_size=args.vocab,
        )
    else:
        raise ValueError(f"rockmate runner: --model gpt or llama, got {args.model!r}")
    if min(args.seq, args.vocab) < 128:
        # rkgb 1.0.1 re-creates integer inputs as torch.randint(128, ...) to time each
        # node: torch.embedding then raises "IndexError: index out of range in self".
        out["warning"] = "rkgb 1.0.1 needs --seq and --vocab >= 128"
    torch.manual_seed(0)
    model = models.GPT(config) if args.model == "gpt" else models.Llama(config)
    g = torch.Generator().manual_seed(1)
    idx = torch.randint(0, args.vocab, (args.batch, args.seq), generator=g)
    tgt = torch.randint(0, args.vocab, (args.batch, args.seq), generator=g)
    ref = copy.deepcopy(model)

    # eager reference: grads and saved bytes (the budget is a fraction of them)
    torch.manual_seed(1234)
    report, loss = measure.saved_report(lambda: ref(idx, tgt), exclude=[ref, idx, tgt])
    loss.backward()
    eager_saved = report.total_bytes
    budget = int(args.budget_mib * 2**20) if args.budget_mib else int(args.budget_frac * eager_saved)
    out.update(eager_saved_bytes=eager_saved, budget_bytes=budget)

    attempts = []
    versions = ["2.0.0", "1.0.1"] if args.version == "auto" else [args.version]
    rk = None
    t0 = time.perf_counter()
    for version in versions:
        builder = build_v200 if version == "2.0.0" else build_v101
        try:
            with contextlib.redirect_stdout(sys.stderr):  # rkgb prints its CUDA warning
                rk = builder(model, idx, tgt, budget, args, out)
            attempts.append({"version": version, "ok": True})
            break
        except BaseException as exc:  # noqa: BLE001
            traceback.print_exc(file=sys.stderr)
            error = exc_text(exc)
            if version == "1.0.1" and out.get("ilp_status"):
                error += (
                    f" [the block ILP, solved with CBC because PyPI gurobipy's licence is "
                    f"size-limited, ended {'/'.join(sorted(set(out['ilp_status'])))} in "
                    f"{len(out['ilp_status'])} solves of {args.ilp_seconds:g}s]"
                )
            attempts.append({"version": version, "error": error})
    out["attempts"] = attempts
    if rk is None:
        raise RuntimeError("; ".join(f"rockmate {a['version']}: {a['error']}" for a in attempts))
    out["build_s"] = time.perf_counter() - t0

    def fwd_bwd():
        torch.manual_seed(1234)
        loss = rk(idx, tgt)
        rk.backward()
        return loss

    opt = torch.optim.SGD(model.parameters(), lr=1e-3)

    def train_step():
        model.zero_grad(set_to_none=False)  # rockmate 1.0.1 pre-allocates p.grad
        fwd_bwd()
        opt.step()

    model.zero_grad(set_to_none=False)
    t1 = time.perf_counter()
    loss = fwd_bwd()
    out["first_step_s"] = out["build_s"] + time.perf_counter() - t1
    out["loss"] = float(loss)
    worst = 0.0
    for p, q in zip(model.parameters(), ref.parameters(), strict=True):
        if p.grad is None or q.grad is None:
            worst = float("inf") if (p.grad is None) != (q.grad is None) else worst
            continue
        worst = max(worst, (p.grad - q.grad).abs().max().item())
    out["max_grad_diff"] = worst

    out["loadavg_1m"] = os.getloadavg()[0]
    times = measure.step_time(train_step, steps=args.steps, warmup=args.warmup)
    out.update(step_s=times, step_median_s=statistics.median(times))

    model.zero_grad(set_to_none=False)
    report, _ = measure.saved_report(fwd_bwd, exclude=[model, idx, tgt])
    out["saved_bytes_autograd"] = report.total_bytes
    model.zero_grad(set_to_none=False)
    peak = measure.memory_profile(fwd_bwd)
    out.update(peak_bytes=peak.peak_bytes, alloc_bytes=peak.alloc_bytes)
    for name in ("simulation_time", "simulation_overhead", "ILP_solve_time", "DP_solve_time"):
        if hasattr(rk, name):
            out[f"rockmate_{name}"] = float(getattr(rk, name))
    out["rss_hwm_bytes"] = measure.process_high_water_mark()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--strategy", default="rockmate", help="name put in the result row")
    p.add_argument("--version", choices=["auto", "2.0.0", "1.0.1"], default="auto")
    p.add_argument(
        "--budget-frac", type=float, default=0.5, help="Rockmate budget as a fraction of eager's saved bytes"
    )
    p.add_argument("--budget-mib", type=float, default=None, help="absolute budget (overrides)")
    p.add_argument("--nb-budget-save", type=int, default=2, help="rockmate 1.0.1 nb_budget_save")
    p.add_argument("--nb-budget-peak", type=int, default=2, help="rockmate 1.0.1 nb_budget_peak")
    p.add_argument("--ilp-seconds", type=float, default=30.0, help="CBC time limit per block ILP")
    p.add_argument("--plain", action="store_true", help="print bare JSON, without the marker")
    # compare.py's WORKER_FLAGS, same defaults
    p.add_argument("--model", default="gpt")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--embd", type=int, default=256)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--vocab", type=int, default=512)
    p.add_argument("--dropout", type=float, default=0.0)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--threads", type=int, default=1)
    args, unknown = p.parse_known_args(argv)
    out: dict = {"strategy": args.strategy, "python": sys.executable}
    if unknown:
        out["ignored_flags"] = unknown
    try:
        run(args, out)
    except BaseException as exc:  # noqa: BLE001 -- report, never crash the driver
        traceback.print_exc(file=sys.stderr)
        out["error"] = exc_text(exc)
    print(("" if args.plain else MARKER) + json.dumps(out), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
