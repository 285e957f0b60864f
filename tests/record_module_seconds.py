"""Write tests/module_seconds.json from a pytest log: ``pytest -q -n 2 --durations=0 [-m slow] > LOG``, then
``python tests/record_module_seconds.py LOG [--slow]``. The seconds of each module's tests (setup, call and
teardown, those the log lists) replace that run's entry; tests/conftest.py sends the modules out in
that order, most seconds first."""

from __future__ import annotations

import argparse
import collections
import json
import re
from pathlib import Path

TABLE = Path(__file__).with_name("module_seconds.json")
LINE = re.compile(r"^([0-9.]+)s (?:call|setup|teardown)\s+tests/([^:]+)::")


def module_seconds(log: str) -> dict[str, int]:
    """Seconds per test module in a ``--durations`` listing, most first."""
    seconds: collections.Counter = collections.Counter()
    for line in log.splitlines():
        if m := LINE.match(line):
            seconds[m.group(2)] += float(m.group(1))
    return {module: round(s) for module, s in seconds.most_common()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("log")
    parser.add_argument("--slow", action="store_true", help="the log is of the slow run (-m slow)")
    args = parser.parse_args()
    table = json.loads(TABLE.read_text()) if TABLE.exists() else {}
    table["slow" if args.slow else "not slow"] = module_seconds(Path(args.log).read_text())
    TABLE.write_text(json.dumps(table, indent=1) + "\n")


if __name__ == "__main__":
    main()
