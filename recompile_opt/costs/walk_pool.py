"""Walks of Inductor's code for several plans at once, in forked copies of this process.

Why: a walk lowers a plan's graphs with Inductor (about 2 s here), and a search asks for up to nine at
once (``least_peak._walked_widely``) that do not depend on each other; one after another they were
most of a 0.0 planning of a chunked graph. Why forked copies rather than a pool of fresh workers: a
fork holds the graph, its fake tensors, Inductor's settings and every module already imported, so a
walk there is the walk this process would make (the same ints), with no pickling and no start-up (a
fresh worker imports torch and Inductor for seconds, on a machine of two cores). A copy lives for one
batch; nothing is kept warm.

Sized to the CPUs this process may use (``os.sched_getaffinity``), this process walking one share
itself; ``RECOMPILE_OPT_WALK_WORKERS`` sets the number (``1``: every walk in this process). Where a
copy cannot be made or fails (an error, no answer in time), its plans are left to the caller, which
walks them here as before: never a different answer. Where CUDA is initialised here, a copy walks
with the device's figures read before forking (``_torch_internals.in_forked_walker``); after one
such copy dies, hangs or meets CUDA, none is made again in this process.
"""

from __future__ import annotations

import gc
import logging
import os
import pickle
import select
import time
import warnings
from typing import Callable, TypeVar

from recompile_opt import _torch_internals as ti
from recompile_opt.costs import scratch

log = logging.getLogger(__name__)

T = TypeVar("T")
R = TypeVar("R")

ENV = "RECOMPILE_OPT_WALK_WORKERS"
# a copy still walking this long after this process finished its own share (times as long as that
# share took, at least WAIT_MIN_S) is given up on and killed: its plans are walked here
WAIT_FACTOR, WAIT_MIN_S = 4.0, 60.0
REFUSED = 2  # the exit code of a fork that left a kernel workspace to this process to measure


def workers() -> int:
    """Processes a batch of walks is spread over, this one included: ``RECOMPILE_OPT_WALK_WORKERS``, else
    the CPUs this process may run on; 1 where no copy of this process can walk
    (:func:`recompile_opt._torch_internals.forkable`)."""
    wanted = os.environ.get(ENV, "").strip()
    try:
        n = int(wanted) if wanted else len(os.sched_getaffinity(0))
    except (ValueError, AttributeError):
        n = os.cpu_count() or 1
    return max(1, n) if ti.forkable() else 1


def map_forked(
    walk_here: Callable[[T], R],
    walk_copy: Callable[[T], R],
    tasks: list[T],
    n: int | None = None,
    failures: list[str] | None = None,
) -> dict[int, R]:
    """``{i: result}`` for the tasks answered: ``tasks`` dealt round-robin over ``n`` processes
    (:func:`workers`), the first share walked here by ``walk_here``, the others each in a fork of this
    process by ``walk_copy``, whose result comes back pickled. A fork that raises, dies or does not
    answer in time answers none of its share (the caller walks them) and says why in ``failures``;
    ``walk_here`` is not guarded."""
    n = min(n or workers(), len(tasks))
    shares = [list(range(i, len(tasks), n)) for i in range(n)]
    state = ti.before_forking_walkers() if n > 1 else {}
    gc.freeze()  # the forks' collections leave this process's objects be: fewer pages copied on write
    try:
        children = [c for share in shares[1:] if (c := _fork(walk_copy, tasks, share, state)) is not None]
    finally:
        gc.unfreeze()
    found, deadline = {}, None
    try:
        start = time.perf_counter()
        found = {i: walk_here(tasks[i]) for i in shares[0]}
        deadline = time.monotonic() + max(WAIT_MIN_S, WAIT_FACTOR * (time.perf_counter() - start))
    finally:  # where this process's share raised, the forks are ended at once
        for pid, read in children:
            answers, why = _collect(pid, read, deadline=deadline or 0.0)
            found.update(answers)
            if why and failures is not None:
                failures.append(why)
    return found


def _fork(walk_copy, tasks: list, share: list[int], state: dict) -> tuple[int, int] | None:
    """A fork walking ``share`` (set up with ``state``, :func:`recompile_opt._torch_internals.
    in_forked_walker`): (its pid, the read end of its pipe); None where none could be made."""
    read, write = os.pipe()
    try:
        with warnings.catch_warnings():  # Python 3.12 warns of a fork with threads (HiGHS's are idle)
            warnings.simplefilter("ignore", DeprecationWarning)
            pid = os.fork()
    except OSError as e:
        log.debug("recompile_opt: no fork for walks: %s", e)
        os.close(read)
        os.close(write)
        return None
    if pid == 0:  # the copy: walk, write the answers (or why not), exit running nothing of the parent's
        code = 1
        try:
            os.close(read)
            try:
                # where CUDA is initialised here a fork may not run a kernel: workspaces are measured here
                if ti.in_forked_walker(state) > 1 or state:
                    scratch.refuse_measuring()
                answers, code = {i: walk_copy(tasks[i]) for i in share}, 0
            except scratch.NotMeasuredHere as e:  # not a failure of the fork: this process measures it
                answers, code = f"it left a workspace to this process: {e!r}"[:400], REFUSED
            except Exception as e:  # noqa: BLE001 - the reason goes back; the plans are walked there
                answers = f"it raised {e!r}"[:400]
            with os.fdopen(write, "wb") as out:
                pickle.dump(answers, out)
        finally:
            os._exit(code)
    os.close(write)
    return pid, read


def _collect(pid: int, read: int, *, deadline: float) -> tuple[dict, str]:
    """A fork's answers and "", or none and why: it failed, or passed ``deadline`` (then it is
    killed)."""
    chunks, why = [], ""
    try:
        while True:
            # past the deadline, what a fork has written already is still read
            if not select.select([read], [], [], max(deadline - time.monotonic(), 0.0))[0]:
                why = "it did not answer in time"
                os.kill(pid, 9)
                break
            chunk = os.read(read, 1 << 20)
            if not chunk:
                break
            chunks.append(chunk)
    finally:
        os.close(read)
        _, status = os.waitpid(pid, 0)
    answers = None
    if chunks and not why:
        try:
            answers = pickle.loads(b"".join(chunks))
        except Exception as e:  # noqa: BLE001 - a garbled answer: its plans are walked here
            why = f"its answer was unreadable: {e!r}"
    if status == 0 and isinstance(answers, dict):
        return answers, ""
    why = why or (answers if isinstance(answers, str) else f"it exited with status {status}")
    log.info("recompile_opt: a walk's fork failed (%s); walking its plans here", why)
    refused = os.waitstatus_to_exitcode(status) == REFUSED  # a workspace left here: not the fork's failure
    if not refused and (not why.startswith("it raised") or "cuda" in why.lower()):
        ti.fork_failed()  # it died, hung or met CUDA: not a graph this process could not walk either
    return {}, why
