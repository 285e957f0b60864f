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
    def exclusive(self):
        self._flock("LOCK_EX")  # converting shared -> exclusive drops the shared lock first: no deadlock
        try:
            yield
        finally:
            self._flock("LOCK_UN")
