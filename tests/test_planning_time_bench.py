"""bench/planning_time.py: its settings, its table's medians and ratios, and one real cold run (slow)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


def _bench():
    spec = importlib.util.spec_from_file_location("bench_planning_time", REPO / "bench" / "planning_time.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_settings_map_to_the_options_they_name():
    bench = _bench()
    assert bench._options("gpt", "plain") is None
    assert bench._options("gpt", "0.5") == {"memory_budget": 0.5}
    assert bench._options("gpt", "0.5-after-0.0") == {"memory_budget": 0.5}
    assert bench._options("encoder", "bytes") == {"memory_budget": bench.BYTE_BUDGET["encoder"]}


def test_the_table_gives_medians_and_ratios_to_the_plain_compile():
    bench = _bench()
    rows = [{"model": "gpt", "setting": "plain", "compile_s": c, "plan_s": 0.0} for c in (10.0, 30.0, 20.0)]
    rows += [
        {"model": "gpt", "setting": "0.0", "compile_s": c, "plan_s": p}
        for c, p in ((25.0, 4.0), (26.0, 6.0), (99.0, 5.0))
    ]
    text = bench.table(rows, ["gpt"], ["plain", "0.0"])
    assert "| gpt | 20.0 | 26.0 (1.30x) | 5.00 (0.25x) [0.0] |" in text, text


@pytest.mark.slow
def test_a_cold_run_reports_its_planning_inside_its_compile():
    row = _bench().run_one("encoder", "bytes")
    assert row["graphs"] == 1 and 0 < row["plan_s"] < row["compile_s"] and row["cpp_s"] > 0, row
