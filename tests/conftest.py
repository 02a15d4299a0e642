"""Test set-up: 8 simulated CPU devices, configured once before JAX starts its backend.

The backend is started here, so no test can change the device count for the tests after it
(a CLI test that asks for another count must meet the "already started" error, in any order).
"""

import os
import sys
import tempfile

import pytest

os.environ.setdefault("JAX_PLATFORMS", "cpu")
# One persistent compilation cache for the whole run, fresh each run: the controller makes it before
# the xdist workers start, and they and every process a test starts (meshkit commands, launched
# ranks, docs blocks) inherit it. The same tiny step compiled by many tests and subprocesses is then
# compiled once (a tiny `meshkit train`: 17 s of CPU cold, 7 s warm). Executables read from the cache
# keep their HLO text, memory and cost analyses, which the ledgers read.
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    os.environ["JAX_COMPILATION_CACHE_DIR"] = tempfile.mkdtemp(prefix="meshkit-tests-jax-cache-")
    os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"
    os.environ["JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES"] = "0"

# The tests' programs are tiny and run a few steps: compiling them is most of the suite's CPU time, and
# XLA's backend optimisations (LLVM's passes) are most of a compile, so the suite turns them off, as
# JAX's own test suite does (JAX_DISABLE_MOST_OPTIMIZATIONS: backend optimisation level 0, no
# expensive LLVM passes; the HLO passes, hence sharding, collectives and buffer assignment, are
# unchanged). Inherited by every process a test starts; the docs blocks run as a user runs them.
os.environ.setdefault("JAX_DISABLE_MOST_OPTIMIZATIONS", "1")

import jax

jax.config.update("jax_num_cpu_devices", 8)
assert jax.device_count() == 8


@pytest.fixture
def folder(tmp_path, monkeypatch):
    """A user's folder as the current one (for ``module:function`` targets); sys.path and the
    modules the test imported from it (named ``mk_user_*`` or ``mk_pkg*``) as they were afterwards."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", str(tmp_path))])
    names = set(sys.modules)
    yield tmp_path
    for name in set(sys.modules) - names:
        if name.startswith(("mk_user_", "mk_pkg")):
            del sys.modules[name]


# -- scheduling ---------------------------------------------------------------------------------------
# pytest-xdist's default `--dist load` hands each worker a consecutive chunk of the collection (a quarter
# of its share), then more chunks as it frees up: a file's tests are split over both workers (each
# builds the file's module fixtures and in-process caches: verify's references, compiled trainers), and
# a long file or test that starts late makes the run's tail. The suite instead hands out whole files
# (`--dist loadfile`), the longest first, in that order (`--no-loadscope-reorder`; xdist's own reorder
# is by number of tests): longest processing time first, so the two workers end within about a short
# file's length of each other, and every file's fixtures and caches are built once.
#
# A file's length: its recorded tests' seconds, from the last full run's `--durations=60` (2 loaded
# cores), plus UNRECORDED_S for each other test (that run's mean of the unlisted ones). A renamed test
# only loses its weight (tests/test_suite_order.py names a stale entry); record again with `make test`
# (its --durations) when the list changes much.
UNRECORDED_S = 1.8
RECORDED_SECONDS = """
   83 tests/test_fuzz.py::test_every_configuration_trains_right_or_is_refused_in_one_line[data]
   76 tests/test_fuzz.py::test_every_configuration_trains_right_or_is_refused_in_one_line[sharded]
   66 tests/test_launch.py::test_a_killed_process_is_restarted_and_a_preempted_job_resumes_both_ending_as_an_uninterrupted_run
   53 tests/test_planner_auto.py::test_gpt_auto_is_the_fastest_layout_meshkit_runs
   46 tests/test_multiprocess.py::test_a_killed_process_ends_the_survivor_with_its_name
   45 tests/test_docs.py::test_shell_block_runs[docs/training.md:63]
   43 tests/test_context.py::test_context_plan_matches_one_device_in_float64_and_its_ledger_the_model[gpt-cp-ring]
   40 tests/test_faults.py::test_two_processes_agree_on_the_step_when_only_one_cannot_read_the_latest
   39 tests/test_docs.py::test_shell_block_runs[docs/llama.md:11]
   39 tests/test_pipeline.py::test_dp_pp_over_two_processes_one_stage_each_and_spanning_matches_one_device
   35 tests/test_data_resume.py::test_sigkill_then_resume_gives_the_same_losses_also_on_two_processes
   34 tests/test_pipeline.py::test_meshkit_train_dp_pp_resumes_under_fsdp_and_back_bitwise_and_writes_the_schedule
   31 tests/test_signals.py::test_a_stranger_claiming_a_rank_is_refused_and_sigterm_to_one_rank_stops_both_at_one_step
   30 tests/test_docs.py::test_shell_block_runs[docs/data.md:12]
   30 tests/test_signals.py::test_a_local_job_listens_on_loopback_only_and_a_stalled_rank_ends_it_in_one_line
   28 tests/test_docs.py::test_python_blocks_run[docs/your-model.md]
   27 tests/test_context.py::test_context_plan_matches_one_device_in_float64_and_its_ledger_the_model[llama-dp+cp-ring]
   26 tests/test_multiprocess.py::test_meshkit_train_under_launch_writes_once
   25 tests/test_verify.py::test_the_issues_pp_plan_on_8_stages_is_certified_by_a_derived_float32_bound
   23 tests/test_fsdp.py::test_certificate_per_layer[zero3-gpt-scan-None-none-2]
   22 tests/test_pipeline.py::test_trainer_3d_interleaved_matches_one_device_and_its_report_measures_the_schedule
   22 tests/test_llama_plans.py::test_llama_plan_matches_one_device_in_float64_and_its_cost_model[dp+tp+pp]
   21 tests/test_plans.py::test_plan_certificate[zero3-gpt-None-2]
   21 tests/test_fsdp.py::test_gathered_parameters_live_one_layer_at_a_time[False]
   21 tests/test_planner_auto.py::test_meshkit_train_plan_auto_says_which_and_why
   20 tests/test_plans.py::test_plan_certificate[dp+tp-gpt-data=4,model=2-2]
   20 tests/test_cli_train.py::test_resume_may_switch_the_gpt_form_and_continues_the_same_run
   20 tests/test_cli_train.py::test_resume_takes_the_runs_config_and_changes_only_what_is_safe
   19 tests/test_user_transformers.py::test_equinox_bert_layers_through_meshkit_layer_and_tensor_parallel_equal_one_device
   19 tests/test_context.py::test_a_long_sequence_that_does_not_fit_a_budget_under_dp_fits_under_context_8
   19 tests/test_pipeline.py::test_remat_matches_one_device_in_float64_and_lowers_the_temporaries
   18 tests/test_docs.py::test_shell_block_runs[README.md:54]
   18 tests/test_pipeline.py::test_gpt_loss_and_every_gradient_equal_one_device_in_float64
   18 tests/test_fsdp.py::test_gathered_parameters_live_one_layer_at_a_time[True]
   18 tests/test_faults.py::test_thirty_sigkills_mid_save_each_resume_continues_bit_for_bit
   18 tests/test_multiprocess.py::test_meshkit_verify_under_launch
   18 tests/test_hsdp.py::test_certificate_one_device_float64_ledger_and_memory[gpt-replica=2,data=4-layer-2]
   17 tests/test_launch.py::test_a_process_that_stops_making_progress_is_restarted
   17 tests/test_docs.py::test_shell_block_runs[docs/migrating.md:18]
   17 tests/test_golden_steps.py::test_step_compiles_as_recorded[tp+pp-1f1b]
   16 tests/test_peak.py::test_sharded_gradient_accumulator_of_zero2_and_zero3_is_in_the_model[zero2-none]
   15 tests/test_docs.py::test_shell_block_runs[docs/plans.md:279]
   15 tests/test_checkpoint.py::test_restore_onto_another_mesh_and_plan
   14 tests/test_planner_compile.py::test_a_subprocess_with_its_own_device_count_measures_the_same_step
   14 tests/test_plans.py::test_plan_certificate[fsdp+tp-gpt-data=4,model=2-1]
   14 tests/test_fsdp.py::test_certificate_per_layer[zero3-gpt-None-layer-2]
   14 tests/test_golden_steps.py::test_step_compiles_as_recorded[pp-gpipe]
   14 tests/test_signals.py::test_sigterm_to_meshkit_train_saves_at_the_next_step_and_a_second_stops_at_once
   13 tests/test_async_save.py::test_sigkill_during_a_background_save_leaves_no_visible_step_and_resume_continues
   13 tests/test_golden_steps.py::test_step_compiles_as_recorded[fsdp+tp+pp-gpipe]
   13 tests/test_fsdp.py::test_certificate_per_layer[fsdp+tp-gpt-data=4,model=2-layer-1]
   13 tests/test_fsdp.py::test_certificate_per_layer[zero1-gpt-None-layer-1]
   13 tests/test_llama_cli.py::test_llama_run_trains_proves_its_cost_and_exports
   13 tests/test_signals.py::test_sigterm_to_the_launcher_reaches_every_rank_which_saves_and_exits
   13 tests/test_plans.py::test_plan_certificate[tp-gpt-model=8-1]
   13 tests/test_multiprocess.py::test_two_processes_under_meshkit_launch_match_one_process[fsdp]
   13 tests/test_plans.py::test_plan_certificate[dp-gpt-None-1]
   12 tests/test_rundir.py::test_a_live_run_gets_its_own_directory_and_a_second_resume_beside_it_is_refused
   12 tests/test_user_transformers.py::test_equinox_bert_layers_as_pipeline_stages_equal_one_device
   12 tests/test_peak.py::test_gradient_accumulator_of_dp_and_zero1_is_in_the_model[False-zero1]
"""


def recorded_seconds() -> dict[str, float]:
    """Node id -> seconds, from ``RECORDED_SECONDS``."""
    rows = (line.split(maxsplit=1) for line in RECORDED_SECONDS.strip().splitlines())
    return {nodeid: float(seconds) for seconds, nodeid in rows}


def longest_files_first(items: list, seconds: dict[str, float]) -> list:
    """The items grouped by file, the files in order of their estimated length, longest first (ties
    and each file's tests in collected order: the same order on every xdist worker, which xdist
    requires)."""
    length: dict[str, float] = {}
    for item in items:
        file = item.nodeid.partition("::")[0]
        length[file] = length.get(file, 0.0) + seconds.get(item.nodeid, UNRECORDED_S)
    return sorted(items, key=lambda item: -length[item.nodeid.partition("::")[0]])


def pytest_configure(config):
    """Under xdist, whole files in the collected order (see above), unless another --dist was asked."""
    if config.pluginmanager.hasplugin("xdist") and config.getoption("dist") == "load":
        config.option.dist = "loadfile"
        config.option.loadscopereorder = False


@pytest.hookimpl(trylast=True)  # after -k and -m deselect: the lengths are those of the tests that run
def pytest_collection_modifyitems(config, items):
    items[:] = longest_files_first(items, recorded_seconds())
