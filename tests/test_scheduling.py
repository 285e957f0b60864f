"""The order pytest -n 2 sends modules out in (tests/conftest.py): the seconds per module read from a
``--durations`` log (tests/record_module_seconds.py)."""

from record_module_seconds import module_seconds

LOG = """\
============================= slowest durations ==============================
275.98s call     tests/test_peak_memory.py::test_the_least_peak_plans_peak_is_a_limit_peak_memory_can_meet
20.01s setup    tests/test_paper_bench.py::test_kept_bytes_match_table_2[none-22B]
12.50s call     tests/test_peak_memory.py::test_a_fraction_and_a_peak_limit_together[x::y]
2.40s teardown tests/test_paper_bench.py::test_kept_bytes_match_table_2[none-22B]

(2189 durations < 2s hidden.)
814 passed, 85 warnings in 1841.07s (0:30:41)
"""


def test_a_modules_seconds_are_its_tests_setup_call_and_teardown_most_first():
    assert module_seconds(LOG) == {"test_peak_memory.py": 288, "test_paper_bench.py": 22}
    assert list(module_seconds(LOG)) == ["test_peak_memory.py", "test_paper_bench.py"]
    assert module_seconds("814 passed in 3.0s") == {}
