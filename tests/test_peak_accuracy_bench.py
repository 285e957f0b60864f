"""bench/peak_accuracy.py: the settings' options, and a real measure-then-check round trip on the
benchmark GPT with the eager compiler (same plans, no code generation; < 60 s): a stored plan
predicted again by an unchanged simulator gives the plan's own prediction, and a changed simulator
shows in the ``now`` column. And (slow) the claim made of ``bench/measured_peaks.json``: walked in
Inductor's code, its 16 stored plans give their measured peaks."""

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
    accuracy.main(
        ["--measure", str(path), "--models", "gpt", "--settings", "none,full", "--compiler", "eager"]
    )
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


@pytest.mark.slow
def test_the_stored_plans_walked_give_their_measured_peaks():
    """docs/design.md and recompile_opt/costs/inductor_peak.py: the 16 stored plans' peaks walked in
    Inductor's generated code are their measured peaks within 0.4%, 14 of them to the byte -- on
    torch 2.13 to 4 bytes (one fp32 scalar the walk leaves out; every one of the 14 is 4 bytes low);
    the other two are the Llama's, where SDPA's own scratch is missed (-0.34%, -0.36%). ~30 s."""
    rows = json.loads((_PATH.parent / "measured_peaks.json").read_text())
    assert len(rows) == 16
    off = {}  # walked - measured, bytes
    for stored, row in zip(rows, accuracy.check(rows, exact=True)):
        off[stored["model"], stored["setting"]] = round(row["exact"] * 2**20) - stored["measured_bytes"]
    table = "\n".join(f"{m:6s} {s:20s} {d:+9d} B" for (m, s), d in off.items())
    for stored in rows:
        d = off[stored["model"], stored["setting"]]
        assert abs(d) <= 0.004 * stored["measured_bytes"], f"{stored['model']} {stored['setting']}:\n{table}"
    assert sum(abs(d) <= 4 for d in off.values()) >= 14, table
