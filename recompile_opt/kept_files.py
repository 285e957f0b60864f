"""JSON files the package keeps beside Inductor's caches (plans, peaks, ILP answers): written whole or not
at all, read as missing where unreadable.

Why one place: several processes share those directories at once (the ranks of a node, test workers, a
restarted run), so a reader may meet a file while it is written, and a write cut short (a full disk, a
killed process) must not leave a file that stops every later compile.
"""

from __future__ import annotations

import json
import logging
import os
import tempfile
from pathlib import Path

log = logging.getLogger(__name__)


def write_json(path: Path, data) -> bool:
    """Write ``data`` as JSON to ``path`` through a temporary file in its directory and one rename, so a
    reader sees the old file or the new one, never part of one. Returns whether it was written: a file
    that cannot be (an OS error, data that is not JSON-able) is only not kept, and no temporary file is
    left behind."""
    tmp = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile("w", dir=path.parent, suffix=".tmp", delete=False) as f:
            tmp = f.name
            json.dump(data, f)
        os.replace(tmp, path)
        return True
    except (OSError, TypeError, ValueError) as e:
        log.debug("recompile_opt: could not keep %s: %s", path, e)
        if tmp is not None:
            Path(tmp).unlink(missing_ok=True)
        return False


def read_json(path: Path):
    """What :func:`write_json` wrote at ``path``, or None where the file is missing or not JSON."""
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as e:
        if path.exists():
            log.debug("recompile_opt: could not read %s: %s", path, e)
        return None
