"""Shared fixtures: a fresh Dynamo cache per test (so every test really compiles), quiet Inductor."""

import os

os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")
if "PYTEST_XDIST_WORKER_COUNT" in os.environ:
    # pytest -n N: each worker's share of the cores, for its OpenMP threads (2 workers of 2 threads each
    # on 2 cores spent a tenth of test_gradients.py waiting on each other) and for the processes a
    # least-peak search spreads its walks over (recompile_opt/costs/walk_pool.py; forked onto a core the
    # other worker holds, they cost more than they save: test_kernels.py's GPT at 0.0, its peaks not on
    # disk, on one core took 190 and 193 s walked by 2 processes, 166 s by 1:
    # taskset -c 0 with RECOMPILE_OPT_WALK_WORKERS=2 / 1, 2026-12-02); subprocesses inherit them.
    # The walk pool's own tests set their number
    share = str(max(1, (os.cpu_count() or 1) // int(os.environ["PYTEST_XDIST_WORKER_COUNT"])))
    os.environ.setdefault("OMP_NUM_THREADS", share)
    os.environ.setdefault("RECOMPILE_OPT_WALK_WORKERS", share)

import contextlib
import json
from pathlib import Path

import pytest
import torch
import torch._inductor.config as inductor_config
from multiprocess import SCALAR_KERNELS, scalar_kernels_where_asked

import recompile_opt

if "OMP_NUM_THREADS" in os.environ:
    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))  # in case torch was imported before this file


# Scalar C++ kernels. Inductor writes each CPU kernel twice, vectorised and as a scalar tail, and
# builds each with g++: the builds were 64% of an Inductor test's time (test_chunk_autocast.py's two
# through Inductor, one process, empty cache: 178 of 278 s; scalar, TORCHINDUCTOR_VEC_ISA_OK=0, which
# writes the same kernels as cpp.simdlen = 1: 115 of 192 s; 2026-12-02). What a plan decides and what
# the step allocates do not depend on it (the walks already lower scalar kernels:
# _torch_internals._scalar_cpp_kernels), so every test runs them but those that hold the walk against
# a step of the vectorised kernels users run (VECTORIZED). The ranks of multi-process tests read it
# from the environment (tests/multiprocess.py); a subprocess running the package (the CLI, the demo)
# is vectorised as users run it.
os.environ.setdefault(SCALAR_KERNELS, "1")
scalar_kernels_where_asked()
# modules, or module::test names, whose tests compile the kernels vectorised
VECTORIZED = {
    "test_kernels.py::test_predicted_peak_within_ten_percent_of_measured",
    "test_inductor_peak.py",
    "test_peak_accuracy_bench.py",
    "test_docs.py",
}


def _vectorized(item) -> bool:
    return item.path.name in VECTORIZED or f"{item.path.name}::{item.originalname}" in VECTORIZED


@pytest.fixture(autouse=True)
def fresh_dynamo(request):
    torch._dynamo.reset()
    recompile_opt.reset_plans()
    vectorized = _vectorized(request.node) and inductor_config.cpp.simdlen == 1
    with inductor_config.patch({"cpp.simdlen": None}) if vectorized else contextlib.nullcontext():
        yield
    torch._dynamo.reset()


# Default-run tests of a minute or more on the 2-core CI machine (pytest -n 2 --durations=60, torch 2.13,
# 2026-11-26), each with a lighter test of the same path beside it. CI's run on a second torch version
# leaves them out (-m "not slow and not heavy"): with them, CI took 90 minutes.
HEAVY = {
    "test_parallel_rewrite.py::test_sequence_parallel_budgets_equal_one_process[gpt-2]",
    "test_parallel_rewrite.py::test_tensor_parallel_equals_one_process[gpt-compiled-0.0]",
    "test_parallel_rewrite.py::test_tensor_and_sequence_parallel_equals_one_process[llama-compiled-0.0]",
    "test_parallel_rewrite.py::test_dropout_gives_each_rank_the_single_process_mask[gpt-tp+sp-compiled-0.0]",
    "test_parallel_api.py::test_parallelize_equals_one_process_and_explains_bad_input[eager]",
    "test_inductor.py::test_dropout_replayed_by_inductors_rng_equals_the_same_model_at_save_all"
    "[{'memory_budget': '1KiB'}]",
    "test_inductor.py::test_dropout_is_kept_not_replayed_under_fallback_random_and_gradients_equal_eager"
    "[{'policy': 'megatron-selective'}]",
    "test_inductor.py::test_byte_budget_through_inductor_holds_on_the_measured_step[48KiB]",
    "test_cli_and_cache.py::test_a_new_process_finds_the_peaks_the_last_one_simulated_and_walked",
    "test_partition.py::test_graphs_partitioned_for_simulation_are_torchs_graphs[llama]",
    "test_partition.py::test_graphs_partitioned_for_simulation_are_torchs_graphs[gpt-dropout]",
    "test_outside_models.py::test_a_vision_models_peak_counts_its_convolution_scratch_and_channels_last_copies",
    # 40-60 s on an idle machine
    "test_peak_memory.py::test_a_fraction_and_a_peak_limit_together",
    "test_peak_memory.py::test_a_plan_says_how_many_solves_and_simulations_its_planning_took",
    "test_partition.py::test_graphs_partitioned_for_simulation_are_torchs_graphs[gpt-dropout-compiled]",
    "test_sequence_parallel_option.py::test_a_hand_tensor_parallel_model_trains_as_tensor_and_sequence_parallel"
    "[eager-budgets0]",
}


# Seconds each module's tests took, per run (the default run, -m slow), as tests/record_module_seconds.py
# wrote them from a pytest -n 2 --durations=0 log. pytest -n 2 sends each module whole to one worker
# (below), most seconds first, so the last to start are short and the workers end together. A module
# not listed goes first (it may be long); one listed that no longer exists only loses its place.
MODULE_SECONDS = json.loads((Path(__file__).parent / "module_seconds.json").read_text())


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """xdist's ``--dist loadfile`` (each module a scope) under ``-n 2``, in the order the items were
    collected (:func:`pytest_collection_modifyitems`) rather than by their number. Why whole modules:
    a module's tests plan the same models, and a plan's walked peaks and solves are kept on disk for
    the next plan of that graph (recompile_opt.costs.simulator); split over two workers, neighbours
    planned them at the same time, each for itself (test_chunking.py's two logits-dominated GPT tests:
    63 s each in the run, 45 + 16 s one after the other on one core), and each worker computed the
    module-scoped fixtures (the paper's tensor-parallel bench ran twice, 150 and 207 s). (xdist_group
    marks would do it, but pytest-xdist 3.8 cannot group on pytest 9: it renames ``item._nodeid``,
    which pytest 9 no longer reads.)"""
    if config.getvalue("dist") != "load":
        return None
    from xdist.scheduler import LoadFileScheduling

    config.option.loadscopereorder = False  # the collection's order, longest modules first
    return LoadFileScheduling(config, log)


def pytest_collection_modifyitems(config, items):
    seconds = MODULE_SECONDS["slow" if config.option.markexpr == "slow" else "not slow"]
    items.sort(key=lambda item: -seconds.get(item.path.name, float("inf")))  # stable: a module's own order
    found = set()
    for item in items:
        key = f"{item.path.name}::{item.name}"
        if key in HEAVY:
            item.add_marker(pytest.mark.heavy)
            found.add(key)
    whole_suite = not config.option.keyword and all(os.path.isdir(a) for a in config.args or ["."])
    if (
        whole_suite and config.option.markexpr in ("", "not slow") and HEAVY - found
    ):  # a renamed test would drop out silently
        raise pytest.UsageError(
            f"tests/conftest.py HEAVY names tests that do not exist: {sorted(HEAVY - found)}"
        )
    vectorized = {item.path.name for item in items} | {f"{i.path.name}::{i.originalname}" for i in items}
    if whole_suite and config.option.markexpr in ("", "not slow") and VECTORIZED - vectorized:
        raise pytest.UsageError(
            f"tests/conftest.py VECTORIZED names no test: {sorted(VECTORIZED - vectorized)}"
        )
