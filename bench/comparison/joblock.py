"""The shared/exclusive file lock that keeps every timed section alone while workers overlap.

Why a file lock: with ``--jobs N`` the workers are separate processes (fresh interpreters, see
``runner``), and only their starts and compiles may overlap; a timed step beside a compile would
measure the contention, not the strategy.
"""

from __future__ import annotations

import contextlib
import os

LOCK_ENV = "COMPARE_TIMING_LOCK"


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
    def exclusive(self, wait_s: float | None = None):
        """Hold the lock alone; yields True, or after ``wait_s`` seconds without it, False: the section
        then runs beside others' compiles rather than not at all (a run with a deadline still measures),
        but still never beside another timed section (a second lock file, ``<path>.timed``)."""
        import fcntl
        import time

        with contextlib.ExitStack() as stack:
            if wait_s is None or self.file is None:
                self._flock("LOCK_EX")  # converting shared -> exclusive drops the shared lock first
                alone = True
            else:
                end = time.monotonic() + wait_s
                self._flock("LOCK_UN")  # as LOCK_EX's conversion does, so that the one timing now can have it
                timed = stack.enter_context(open(self.path + ".timed", "a"))
                fcntl.flock(timed, fcntl.LOCK_EX)  # one timed section at a time, whatever happens below
                alone = self._poll_exclusive(end)
            try:
                yield alone
            finally:
                self._flock("LOCK_UN")

    def _poll_exclusive(self, end: float) -> bool:
        """Try for the exclusive lock until ``time.monotonic()`` reaches ``end``; whether it was had."""
        import fcntl
        import time

        while True:
            try:
                fcntl.flock(self.file, fcntl.LOCK_EX | fcntl.LOCK_NB)
                return True
            except BlockingIOError:
                if time.monotonic() >= end:
                    return False
                time.sleep(0.2)
