"""Fixtures shared by the tests of git: builds and bisect, and the kill -9 harness of
the recorder tests."""

from __future__ import annotations

import os

# One intra-op thread for torch here and in every process a test starts (the CLI,
# workers): the pools' tensors are small, and an idle OpenMP worker spinning on the
# second core slows the whole suite. Set before torch is imported.
os.environ.setdefault("OMP_NUM_THREADS", "1")

import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from kvreplay.workload.synth import SynthConfig, synthesize

torch.set_num_threads(1)


def run_in_process(capsys, *argv: str) -> subprocess.CompletedProcess[str]:
    """The kvreplay command run in this process (no interpreter or torch start-up)."""
    from kvreplay.cli.app import main

    code = 0
    try:
        main(list(argv))
    except SystemExit as e:
        code = int(e.code or 0)
    cap = capsys.readouterr()
    return subprocess.CompletedProcess(list(argv), code, cap.out, cap.err)


@pytest.fixture
def cli(capsys):
    """``cli("replay", ...)``: a CompletedProcess with the exit code and output."""
    return lambda *argv: run_in_process(capsys, *argv)


@pytest.fixture(scope="session")
def swa_trace_80(tmp_path_factory):
    """A small disagg-mtp trace (80 requests) that builtin:swa replays clean and the
    stale-tail family of bugs breaks."""
    out = tmp_path_factory.mktemp("swa80") / "t.parquet"
    synthesize(SynthConfig(scenario="disagg-mtp", out=out, requests=80, full_size=512, swa_size=256))
    return out


@pytest.fixture
def git_tree_cache(tmp_path_factory, monkeypatch):
    """Exported git trees go under this session's temporary directory, not ~/.cache."""
    monkeypatch.setenv("KVREPLAY_CACHE", str(tmp_path_factory.getbasetemp() / "cache"))


def kill_a_second_after_its_mark(script: str, wait_for: Path | None = None) -> int:
    """Run ``script`` in a child Python, read the number it prints once its marked
    calls are done, SIGKILL it 1.05 s later (no atexit, no flush) and return that
    number. ``wait_for``: a file the writer process finishes once its pipe closes."""
    child = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        done = int(child.stdout.readline())
        time.sleep(1.05)
        child.kill()
        child.wait(timeout=30)
        deadline = time.monotonic() + 30
        while wait_for is not None and not wait_for.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
    finally:
        child.kill()
    return done


# The slow tier, in this one place: `python -m pytest -m slow` runs what is named here (a
# test by name: all its cases; or one case as name[params]), and every case whose
# parameters include a corpus trace of more than SMALL_CALLS calls (those replay in
# .ci/run's kvreplay ci step too). Nothing else in tests/ marks a test slow.
SMALL_CALLS = 6_000
SLOW_TESTS = {
    # benches, end to end
    "test_recorder_overhead_prints_a_ratio_for_every_setup_and_the_trace_size",
    "test_report_open_prints_size_and_open_time",
    # bisect and git bisect run over a 31-commit repository
    "test_bisect_names_the_culprit_within_the_replay_budget_and_skips_the_broken_commit",
    "test_cli_bisect_prints_the_commit_and_the_step_log",
    "test_git_bisect_run_with_kvreplay_replay",
    "test_a_crashing_or_hanging_build_does_not_take_kvreplay_down",
    # the demo's 2,000 requests in a browser; S3 and Ray fleets
    "test_demo_writes_the_bug_runs_report_and_it_opens",
    "test_a_hive_partitioned_dump_is_a_corpus",
    "test_ci_on_s3_with_ray_stores_the_same_runs",
    # the README's tour, as written and on a vLLM trace (eleven commands, each its own
    # interpreter: 35-40 s apiece, the fast tier's longest), a vLLM minimize
    "test_the_readme_tour_runs_in_order",
    "test_the_readme_tour_runs_on_a_vllm_trace",
    "test_minimize_shrinks_a_vllm_trace_to_calls_that_still_leak",
    # the docs pages' commands, run as written (the production-size synth among them)
    "test_the_docs_commands_of_this_tier_run",
    # 2,000 fuzzed traces, 500 manifests
    "test_damaged_traces_many",
    "test_damaged_manifests_many",
    # signals and kills with timing
    "test_synth_stopped_by_a_signal_leaves_no_file_under_its_name",
    "test_one_sigusr2_writes_one_dump",
    "test_killed_with_its_writer_a_rotated_trace_keeps_its_closed_parts",
    "test_a_recording_attached_mid_life_starts_with_a_snapshot_and_replays_clean",
    "test_eight_replays_writing_at_once_lose_nothing",
    # the long browser walks (a report opened on its answer, the dashboard, the matrix and
    # bisect pages); a small report and the hostile-name pages stay in the fast tier
    "test_a_run_report_opens_on_its_answer",
    "test_dashboard_walk_runs_run_compare",
    "test_matrix_bisect_and_assertion_pages",
    # ten to twenty seconds each on a 2-core machine: reuse across bisect and matrix, a
    # process tree killed whole, the demo outliving its command, a recorded kv-cache
    # dtype, SIGTERM to replay --jobs
    "test_bisect_and_matrix_reuse_exactly_the_same_runs",
    "test_a_server_that_sigkills_its_whole_process_tree_still_leaves_every_call",
    "test_what_the_demo_writes_outlives_the_command",
    "test_a_pool_built_with_the_kv_cache_dtype_is_recorded_and_replays",
    "test_sigterm_to_replay_jobs_ends_its_workers",
}
# Single cases: the SIGKILL timing matrix (the fast tier keeps
# test_sigkill_keeps_a_small_last_batch[native], a kill -9 of its own), and more.
SLOW_CASES = {
    # Each hostile case starts a CLI process that imports torch: two kinds of each class
    # stay in the fast tier, the rest run here.
    "test_a_damaged_attention_spec_is_the_traces_fault_not_the_builds[sliding_window:-5]",
    "test_a_damaged_attention_spec_is_the_traces_fault_not_the_builds[sliding_window:]",
    "test_a_damaged_attention_spec_is_the_traces_fault_not_the_builds[sliding_window]",
    "test_a_damaged_attention_spec_is_the_traces_fault_not_the_builds[sliding_window:0]",
    "test_a_damaged_attention_spec_is_the_traces_fault_not_the_builds[full,,full]",
    "test_rows_of_the_other_engines_methods_are_damage[50-free_group_begin-trace1-builtin:vllm]",
    "test_rows_of_the_other_engines_methods_are_damage[0-get_new_blocks-trace3-builtin:swa]",
    # the watch across parts stays in the fast tier (carries its state); retired parts here
    "test_a_clean_pool_watched_across_retired_parts_stays_clean",
    # 2,000 cases of the other surfaces' fuzz (workloads, answers, build specs, serve URLs)
    "test_hostile_workload_files[slow]",
    "test_hostile_server_answers[slow]",
    "test_hostile_build_specs[slow]",
    "test_hostile_dashboard_urls[slow]",
    "test_other_corpus_bugs_shrink_too[radix-swa-800-builtin:swa@deferred-lookup]",
    "test_jobs_give_the_serial_run[remap-builtin:swa@page-partial-clear]",
    "test_jobs_give_the_serial_run[remap-builtin:swa@unfiltered-page0]",
    "test_jobs_give_the_serial_run[strict-builtin:swa@page-partial-clear]",
    "test_jobs_give_the_serial_run[strict-builtin:swa@unfiltered-page0]",
    "test_sigkill_loses_no_call_older_than_a_second[native-busy]",
    "test_sigkill_loses_no_call_older_than_a_second[native-idle]",
    "test_sigkill_loses_no_call_older_than_a_second[python-busy]",
    "test_sigkill_loses_no_call_older_than_a_second[python-idle]",
    "test_sigkill_keeps_a_small_last_batch[python]",
    # Minimization is covered in the fast tier by the 223-call page-0 trace (the seed
    # bug's 37,830 calls shrink in the slow tier); the plugin by its own items.
    "test_the_seed_bug_trace_shrinks_to_a_reproducer_that_fails_only_on_the_bug",
    "test_the_pytest_plugin_fails_an_item_whose_expectation_does_not_hold",
    # Worker builds, live recording and the recorder's exit paths: each starts interpreters
    # that import torch; one case of each kind stays in the fast tier.
    "test_a_native_crash_says_what_killed_it_and_where_and_the_next_trace_gets_a_fresh_worker",
    "test_two_revisions_replay_in_their_own_processes",
    "test_matrix_from_the_command_line",
    "test_record_flight_writes_only_the_last_calls_when_the_server_fails",
    "test_record_counters_every_reaches_each_recorded_process",
    "test_interpreter_exit_flushes_an_open_recording[python]",
    "test_gpu_recorder_says_plainly_that_it_measured_nothing_without_cuda",
    "test_a_build_that_cannot_take_the_snapshot_is_unloadable",
    # Kept within the README's three minutes on a slower day: a matrix is replayed fast by
    # the CLI's bad-input and report tests, kvreplay ci by test_report's corpus run, live
    # recording by its SIGTERM case, and the benches all run in the slow tier.
    "test_matrix_stores_one_run_per_cell_and_reuses_exact_builds",
    "test_the_correct_pool_passes_and_the_junit_file_is_well_formed",
    "test_replay_overhead_prints_both_modes_clean",
    "test_every_process_records_its_allocator_and_the_exit_code_passes_through",
    "test_without_its_snapshot_the_attached_trace_would_not_replay",
    # the vllm family: the corpus' live trace replays in .ci/run's kvreplay ci step; one damaged
    # constructor argument stays in the fast tier
    "test_the_live_server_trace_replays_strict_clean_on_the_builtin_manager",
    "test_a_hybrid_managers_trace_reads_and_says_which_builds_cannot_take_it",
    "test_damaged_constructor_arguments_are_one_line_errors[changes1-num_blocks must be a whole number]",
    "test_damaged_constructor_arguments_are_one_line_errors[changes2-enable_caching must be true or false]",
    "test_damaged_constructor_arguments_are_one_line_errors[changes3-watermark must be a number in 0..1]",
    "test_damaged_constructor_arguments_are_one_line_errors[changes4-use_eagle must be true or false]",
    "test_hash_words_that_make_no_whole_hash_are_a_divergence_not_a_crash",
    "test_what_does_not_speak_the_family_says_so_in_one_line[args1-nothing to minimize]",
    "test_what_does_not_speak_the_family_says_so_in_one_line[args2-the minimal trace itself is the reproducer]",
    # half a minute of minimize; the other corpus bugs' shrinks stay in the fast tier
    "test_other_corpus_bugs_shrink_too[sglang-0.5.23-swa-page0-builtin:swa@unfiltered-page0]",
}


_CALLS: dict[Path, int] = {}


def _big_corpus_trace(item: pytest.Item) -> bool:
    from kvreplay.corpus.manifest import CorpusEntry
    from kvreplay.trace.reader import TraceReader

    for value in getattr(getattr(item, "callspec", None), "params", {}).values():
        if isinstance(value, CorpusEntry):
            if value.file not in _CALLS:
                _CALLS[value.file] = TraceReader(value.file).count_calls()
            if _CALLS[value.file] > SMALL_CALLS:
                return True
    return False


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    for item in items:
        if item.name in SLOW_CASES or getattr(item, "originalname", item.name) in SLOW_TESTS or _big_corpus_trace(item):
            item.add_marker(pytest.mark.slow)


@pytest.fixture(scope="session")
def postgres_admin(tmp_path_factory):
    """A running PostgreSQL server (started here unless .ci/run started one)."""
    from servers import postgres

    with postgres(tmp_path_factory.mktemp("pg")) as url:
        yield url


@pytest.fixture(params=["sqlite", "postgresql"])
def db_url(request, tmp_path):
    """A fresh, empty store of each kind: a SQLite file, a new PostgreSQL database."""
    if request.param == "sqlite":
        return str(tmp_path / "r.db")
    from servers import fresh_database

    return fresh_database(request.getfixturevalue("postgres_admin"))
