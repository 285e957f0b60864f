"""Tests over several processes on gloo (loopback only) that fail instead of hanging: a rank that raises
fails the test with its traceback, ranks still running at the deadline are killed and reported with
their last progress line, and each rank dumps its stacks 30 s before the deadline.

Ranks fork from multiprocessing's fork server, which imports torch, Dynamo, Inductor and this package
once per test worker: a spawned rank imported them anew, 6-16 s before its first line on 2 cores (a
rank's process is still fresh: nothing the test worker ran is in it, and it gets the worker's sys.path).
Forked ranks share the server's string-hash seed; a test that needs ranks hashing differently spawns."""

from __future__ import annotations

import contextlib
import faulthandler
import os
import sys
import time
from datetime import timedelta

import pytest
import torch
import torch._inductor.config as inductor_config
import torch.distributed as dist
import torch.multiprocessing as mp

# gloo's own default is 30 min per collective, and mp.spawn's join has no deadline (a rank compiles for
# up to 80 s here, so both are generous)
COLLECTIVE_TIMEOUT = timedelta(seconds=300)
JOIN_DEADLINE_S = 480
# set by tests/conftest.py for the whole run: ranks write scalar C++ kernels as their test worker does
SCALAR_KERNELS = "RECOMPILE_OPT_TESTS_SCALAR_KERNELS"

# (a module that does not import is skipped by the server: transformers is a test extra)
mp.set_forkserver_preload(
    [
        "torch",
        "torch.distributed",
        "torch.distributed.device_mesh",
        "torch._dynamo",
        "torch._inductor.compile_fx",
        "recompile_opt",
        "recompile_opt.parallel",
        "transformers.models.llama.modeling_llama",
        "transformers.models.gpt2.modeling_gpt2",
    ]
)


def scalar_kernels_where_asked() -> None:
    """Inductor's C++ kernels as scalar loops where the test run asks (``tests/conftest.py``, "Scalar
    C++ kernels"): the setting lives in the process, and a rank's process is the fork server's."""
    if os.environ.get(SCALAR_KERNELS) == "1":
        inductor_config.cpp.simdlen = 1


def progress(out: str, rank: int, step: str) -> None:
    """A line in the rank's progress file: a rank killed at the deadline is reported with its last one."""
    with open(os.path.join(out, f"rank{rank}.progress"), "a") as f:
        f.write(f"{time.strftime('%H:%M:%S')} {step}\n")


def init_gloo(rank: int, world: int, out: str) -> None:
    """The rank's process group, met through a file of the test's own (not a TCP port another test could
    take meanwhile); its stacks dumped near the deadline."""
    faulthandler.enable()  # a crash (SIGSEGV) prints the rank's Python stacks
    scalar_kernels_where_asked()  # the fork server imported Inductor without the test worker's setting
    faulthandler.dump_traceback_later(JOIN_DEADLINE_S - 30, exit=False)
    dist.init_process_group(
        "gloo",
        init_method=f"file://{os.path.join(out, 'store')}",
        rank=rank,
        world_size=world,
        timeout=COLLECTIVE_TIMEOUT,
    )
    progress(out, rank, "process group up")


@contextlib.contextmanager
def gloo_rank(rank: int, world: int, out: str):
    """A rank's body: one thread, its gloo group up (:func:`init_gloo`); leaving the block normally
    destroys the group and exits the process at once (:func:`leave`); an exception destroys the group
    and propagates to mp.spawn, which fails the test with it."""
    torch.set_num_threads(1)
    init_gloo(rank, world, out)
    try:
        yield
    except BaseException:
        dist.destroy_process_group()
        raise
    leave(out, rank)


def leave(out: str, rank: int) -> None:
    """Destroy the group and exit at once, skipping the interpreter's teardown: in CI (torch 2.13, 2 cores
    under load) both ranks of a DDP test hung for 7 minutes in destructors after this point. The
    results are on disk by now; an exception before this still propagates to mp.spawn."""
    dist.destroy_process_group()
    progress(out, rank, "process group destroyed")
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def run_ranks(fn, args, out: str, world: int, start_method: str = "forkserver") -> None:
    """``fn(rank, *args)`` on ``world`` processes with a deadline (module docstring)."""
    ctx = mp.start_processes(fn, args=args, nprocs=world, join=False, start_method=start_method)
    deadline = time.monotonic() + JOIN_DEADLINE_S
    while not ctx.join(timeout=5):  # raises ProcessRaisedException / ProcessExitedException
        if time.monotonic() > deadline:
            for proc in ctx.processes:
                proc.kill()
            pytest.fail(
                f"ranks still running after {JOIN_DEADLINE_S} s: killed; last progress: "
                + "; ".join(f"rank {r}: {_last_progress(out, r)}" for r in range(world))
            )


def _last_progress(out: str, rank: int) -> str:
    try:
        with open(os.path.join(out, f"rank{rank}.progress")) as f:
            return f.read().splitlines()[-1]
    except (OSError, IndexError):
        return "none (before the process group was up)"
