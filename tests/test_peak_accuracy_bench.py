"""bench/peak_accuracy.py: the settings' options, and a real measure-then-check round trip on the
benchmark GPT with the eager compiler (same plans, no code generation; < 60 s): a stored plan
predicted again by an unchanged simulator gives the plan's own prediction, and a changed simulator
shows in the ``now`` column."""

import importlib.util
import json
import sys
from pathlib import Path

import pytest

_PATH = Path(__file__).resolve().parents[1] / "bench" / "peak_accuracy.py"
_spec = importlib.util.spec_from_file_location("bench_peak_accuracy", _PATH)
accuracy = importlib.util.module_from_spec(_spec)
sys.modules["bench_peak_accuracy"] = accuracy
_spec.loader.exec_module(accuracy)


def test_settings_become_backend_options():
    assert accuracy.options("none") == {}
    assert accuracy.options("0.2") == {"memory_budget": 0.2}
    assert accuracy.options("full") == {"policy": "full"}
    assert accuracy.options("peak=27MiB") == {"peak_memory": "27MiB"}


@pytest.fixture(scope="module")
def stored(tmp_path_factory):
    path = tmp_path_factory.mktemp("peaks") / "peaks.json"
    accuracy.main(["--measure", str(path), "--models", "gpt", "--settings", "none,full", "--compiler", "eager"])
    return json.loads(path.read_text())


def test_a_stored_plan_is_predicted_again_as_it_was(stored):
    assert [r["setting"] for r in stored] == ["none", "full"]
    assert all(r["measured_bytes"] > 0 and r["saved"] for r in stored)
    assert len(stored[1]["recomputed"]) > len(stored[0]["recomputed"])  # full recomputes whole blocks
    for row in accuracy.check(stored):
        assert row["now"] == pytest.approx(row["stored"], abs=1e-6)


def test_a_changed_simulator_shows_in_the_now_column(stored, monkeypatch):
    from recompile_opt.costs.simulator import PeakSimulator

    simulate = PeakSimulator._simulate
    monkeypatch.setattr(PeakSimulator, "_simulate", lambda self, s, r: (simulate(self, s, r)[0] + 2**20, []))
    rows = accuracy.check(stored)
    assert all(row["now"] == pytest.approx(row["stored"] + 1, abs=1e-6) for row in rows)
    assert "mean |error|" in accuracy.report(rows)


def test_the_exact_column_walks_inductors_code_for_each_stored_plan(stored):
    rows = accuracy.check(stored[:1], exact=True)
    # save-all-but-cheap: the forward's last kept buffers and the first gradients, the same in both
    assert 0.8 < rows[0]["exact"] / rows[0]["now"] < 1.2
    assert "exact: mean |error|" in accuracy.report(rows)
