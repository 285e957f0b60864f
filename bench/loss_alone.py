"""The LM head + cross-entropy alone: measured peak and step time of each way to compute it.

Inputs: ``x`` ``[N, D]`` fp32 hidden states and ``W`` ``[V, D]`` head weight, both requiring grad, and
``targets`` ``[N]`` int64 (seeded; ``W`` scaled by ``D**-0.5`` so the logits are of order one). One step is
the loss's forward and backward (``x.grad`` and ``W.grad`` set to ``None`` before). Strategies:

* ``plain``: ``F.cross_entropy(F.linear(x, W), t)`` eager -- the logits, their log-softmax and the
  gradients of both exist at full size ``[N, V]``.
* ``compile``: the same function under ``torch.compile`` (Inductor, default settings).
* ``ours-K``: ``recompile_opt.passes.chunking.chunked_linear_cross_entropy`` eager, K chunks of the
  tokens (the ``recompile_opt::chunked_head_loss`` op: each chunk's loss and gradients in the forward).
* ``cce``: cut-cross-entropy's ``linear_cross_entropy(x, W, t, impl="torch_compile")`` (Apple's "Cut Your
  Losses"); on a CPU only this impl runs, and it is ``torch.compile(dynamic=True)`` of ``e @ c.T`` and
  the cross-entropy, not the paper's kernel.
* ``cce-triton``: its ``impl="cce"`` Triton kernels under Triton's interpreter (``TRITON_INTERPRET=1``).
* ``liger``: liger-kernel's ``LigerFusedLinearCrossEntropyLoss``, Triton kernels under the interpreter.
  Why only at a small size (``LIGER_MAX_LOGITS``): the interpreter runs each kernel block in NumPy, so
  its time says nothing about the kernel's, and its block temporaries are NumPy arrays the torch
  allocator never sees (on a GPU they would be registers and shared memory anyway).

Every strategy runs in a fresh process (its own Inductor cache, one thread): a warm-up step (which
compiles where there is anything to compile), a check of the loss and both gradients against ``plain``
(``torch.testing.assert_close``, rtol 1e-4, atol 1e-5), the step's peak
(``recompile_opt.costs.measure.memory_profile``: live bytes above the pre-step baseline, from the
allocator's records; the step's own ``x.grad`` and ``W.grad`` included), then the median of ``--steps``
timed steps after one more warm-up.

Usage::

    python bench/loss_alone.py --tokens 4096 --vocab 32000 --dim 256 \\
        --strategies plain,compile,ours-8,ours-32,ours-128,cce --md out.md

The third-party packages are optional: a strategy whose package is missing or fails is a row with the
reason, not a crash.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shlex
import subprocess
import sys
import tempfile
from pathlib import Path

MARKER = "@@LOSS_ALONE@@ "
MiB = 2**20
RTOL, ATOL = 1e-4, 1e-5
INTERPRETED = ("liger", "cce-triton")  # run with TRITON_INTERPRET=1
LIGER_MAX_LOGITS = 2**22  # N * V above which the interpreted strategies are skipped (too slow)


# --------------------------------------------------------------------------
# Worker: one strategy, in its own process
# --------------------------------------------------------------------------


def make_inputs(n: int, v: int, d: int, seed: int = 0):
    """Seeded ``x [n, d]``, ``W [v, d]`` (both requiring grad) and ``t [n]``; the same in every process."""
    import torch

    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, d, generator=g).requires_grad_()
    w = (torch.randn(v, d, generator=g) * d**-0.5).requires_grad_()
    t = torch.randint(0, v, (n,), generator=g)
    return x, w, t


def _version(dist: str) -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(dist)
    except PackageNotFoundError:
        return "not installed"


def loss_function(name: str, n: int, v: int, d: int):
    """``(f(x, W, t) -> loss, note)`` for strategy ``name``; raises ImportError where its package is
    missing."""
    import torch
    import torch.nn.functional as F

    def plain(x, w, t):
        return F.cross_entropy(F.linear(x, w), t)

    if name == "plain":
        return plain, "eager"
    if name == "compile":
        return torch.compile(plain), "Inductor, default settings"
    if name.startswith("ours-"):
        from recompile_opt.passes.chunking import chunked_linear_cross_entropy

        k = int(name.split("-", 1)[1])
        return (
            lambda x, w, t: chunked_linear_cross_entropy(x, w, None, t, chunks=k, dtype=torch.float32),
            f"{k} chunks of <= {math.ceil(n / k)} tokens",
        )
    if name in ("cce", "cce-triton"):
        from cut_cross_entropy import linear_cross_entropy

        impl = "torch_compile" if name == "cce" else "cce"
        note = f"cut-cross-entropy {_version('cut-cross-entropy')}, impl={impl!r}"
        note += (
            ": torch.compile(dynamic=True) of e @ c.T + cross_entropy"
            if name == "cce"
            else ", Triton interpreted: time meaningless"
        )
        return (lambda x, w, t: linear_cross_entropy(x, w, t, impl=impl)), note
    if name == "liger":
        from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss

        liger = LigerFusedLinearCrossEntropyLoss()
        inc = -(-v // d)  # Liger's own chunking: about n*d logits a chunk, a power of two of rows
        rows = min(n, 1 << (math.ceil(n / inc) - 1).bit_length())
        return (
            lambda x, w, t: liger(w, x, t),
            f"liger-kernel {_version('liger-kernel')}, triton {_version('triton')}, interpreted "
            f"(TRITON_INTERPRET=1): time meaningless, kernel blocks are NumPy (not counted); "
            f"{math.ceil(n / rows)} chunks of {rows} tokens",
        )
    raise ValueError(f"unknown strategy {name!r}")


def check(loss, grads, ref) -> str:
    """``yes``, or the first mismatch of the loss / ``x.grad`` / ``W.grad`` against ``plain``'s."""
    import torch

    for what, got, want in zip(("loss", "x.grad", "W.grad"), (loss, *grads), ref):
        try:
            torch.testing.assert_close(got, want, rtol=RTOL, atol=ATOL)
        except AssertionError as e:
            lines = [line.strip() for line in str(e).splitlines() if line.strip()]
            return f"no: {what}: " + "; ".join(lines[:3])
    return "yes"


def worker(name: str, n: int, v: int, d: int, steps: int) -> dict:
    """Warm up, check against ``plain``, measure the step's peak, time ``steps`` steps."""
    import statistics
    import time

    import torch

    from recompile_opt.costs import measure

    torch.set_num_threads(1)
    out = {"strategy": name}
    try:
        fn, out["note"] = loss_function(name, n, v, d)
    except ImportError as e:
        return {**out, "skipped": f"{type(e).__name__}: {e}"}
    x, w, t = make_inputs(n, v, d)

    def step():
        x.grad = w.grad = None
        fn(x, w, t).backward()

    ref_loss = torch.nn.functional.cross_entropy(torch.nn.functional.linear(x, w), t)
    ref_loss.backward()
    ref = (ref_loss.detach(), x.grad, w.grad)
    x.grad = w.grad = None
    try:
        t0 = time.perf_counter()
        loss = fn(x, w, t)
        loss.backward()
        out["first_s"] = time.perf_counter() - t0
        out["matches"] = check(loss.detach(), (x.grad, w.grad), ref)
        del loss
        x.grad = w.grad = None
        report = measure.memory_profile(lambda: fn(x, w, t).backward())
        out["peak_bytes"], out["end_bytes"] = report.peak_bytes, report.end_bytes
        out["step_s"] = statistics.median(measure.step_time(step, steps=steps, warmup=1))
    except Exception as e:  # noqa: BLE001 -- a failing third-party strategy is a row, not a crash
        out["error"] = describe_error(e)
    return out


def describe_error(e: BaseException) -> str:
    """The root cause of ``e`` (Triton's interpreter wraps it twice) and the last frame outside torch and
    triton that raised it: where a third-party package fails, which line of it."""
    import traceback

    chain = [e]
    while chain[-1].__cause__ is not None and len(chain) < 10:
        chain.append(chain[-1].__cause__)
    frames = [
        f
        for exc in chain
        for f in traceback.extract_tb(exc.__traceback__)
        if not any(f"/{lib}/" in f.filename for lib in ("torch", "triton"))
    ]
    root = chain[-1]
    last = str(root).strip().splitlines()[-1:] or [""]
    where = ""
    if frames:
        f = frames[-1]
        where = f" (in {'/'.join(Path(f.filename).parts[-2:])}:{f.lineno} {f.name})"
    return f"{type(root).__name__}: {last[0]}"[:240] + where


# --------------------------------------------------------------------------
# Driver
# --------------------------------------------------------------------------


def probe(name: str, args) -> dict:
    """Run :func:`worker` for ``name`` in a fresh process (interpreted Triton where the strategy needs it)."""
    if name in INTERPRETED and args.tokens * args.vocab > LIGER_MAX_LOGITS:
        return {
            "strategy": name,
            "skipped": f"N*V = {args.tokens * args.vocab} > {LIGER_MAX_LOGITS}: "
            "Triton's interpreter is too slow here; run it at a small size",
        }
    with tempfile.TemporaryDirectory() as cache:
        env = {
            **os.environ,
            "TORCHINDUCTOR_CACHE_DIR": cache,
            "TORCHINDUCTOR_COMPILE_THREADS": "1",
            "OMP_NUM_THREADS": "1",
        }
        if name in INTERPRETED:
            env["TRITON_INTERPRET"] = "1"  # read when triton is imported: hence a process of its own
        cmd = [
            sys.executable,
            __file__,
            "--worker",
            name,
            "--tokens",
            str(args.tokens),
            "--vocab",
            str(args.vocab),
            "--dim",
            str(args.dim),
            "--steps",
            str(args.steps),
        ]
        run = subprocess.run(cmd, env=env, capture_output=True, text=True)
    lines = [line for line in run.stdout.splitlines() if line.startswith(MARKER)]
    if not lines:
        tail = run.stderr.strip().splitlines()[-1:] or [f"exit {run.returncode}, no output"]
        return {"strategy": name, "error": f"worker died: {tail[0]}"[:300]}
    return json.loads(lines[-1][len(MARKER) :])


def table(rows: list[dict], args) -> str:
    from recompile_opt.provenance import header_line

    n, v, d = args.tokens, args.vocab, args.dim
    lines = [
        header_line(),
        "",
        f"N={n} tokens, V={v}, D={d}, fp32, one thread. For scale: the logits [N, V] are "
        f"{n * v * 4 / MiB:.1f} MiB; x.grad + W.grad (counted in every peak) "
        f"{(n + v) * d * 4 / MiB:.1f} MiB.",
        "",
        "| strategy | peak MiB (measured) | step ms (median) | matches plain | note |",
        "|---|---|---|---|---|",
    ]
    for r in rows:
        peak = f"{r['peak_bytes'] / MiB:.2f}" if "peak_bytes" in r else "-"
        ms = f"{r['step_s'] * 1e3:.1f}" if "step_s" in r else "-"
        if r["strategy"] in INTERPRETED and "step_s" in r:
            ms += " (interpreter)"
        matches = r.get("matches") or (
            f"skipped: {r['skipped']}" if "skipped" in r else f"error: {r.get('error')}"
        )
        if "error" in r and "matches" in r:
            matches += f"; then error: {r['error']}"
        note = r.get("note", "")
        if "first_s" in r and r["strategy"] in ("compile", "cce"):
            note += f"; first step (compile) {r['first_s']:.1f} s"
        cells = [r["strategy"], peak, ms, matches, note]
        lines.append("| " + " | ".join(c.replace("|", "/") for c in cells) + " |")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=int, default=4096, help="N")
    p.add_argument("--vocab", type=int, default=32000, help="V")
    p.add_argument("--dim", type=int, default=256, help="D")
    p.add_argument(
        "--strategies",
        help="comma-separated: plain, compile, ours-K, cce, cce-triton, liger "
        "(default: plain,compile,ours-8,ours-32,ours-<ceil(V/D)>,cce,liger)",
    )
    p.add_argument("--steps", type=int, default=5, help="timed steps per strategy")
    p.add_argument("--md", help="write the command and the table here")
    p.add_argument("--json", help="write the raw rows here")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        print(
            MARKER + json.dumps(worker(args.worker, args.tokens, args.vocab, args.dim, args.steps)),
            flush=True,
        )
        return 0
    names = (
        args.strategies or f"plain,compile,ours-8,ours-32,ours-{-(-args.vocab // args.dim)},cce,liger"
    ).split(",")
    rows = []
    for name in (s.strip() for s in names):
        r = probe(name, args)
        rows.append(r)
        print(f"{name:<12} " + " ".join(f"{k}={r[k]}" for k in r if k != "strategy"), flush=True)
    report = table(rows, args)
    print(report)
    if args.md:
        Path(args.md).write_text(
            "```bash\npython bench/loss_alone.py " + shlex.join(sys.argv[1:]) + "\n```\n\n" + report + "\n"
        )
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
