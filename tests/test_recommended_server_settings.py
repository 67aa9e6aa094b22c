"""The Prefect server settings docs/running-on-runpod.md recommends, with bench/quota.py's evidence, are the ones the
local stack runs."""

from pathlib import Path

from bench.quota import RECOMMENDED_WAIT_S
from bench.scale_lib import WAIT_SETTING
from deployments.local_stack import PREFECT_SERVER_ENV

README = Path(__file__).resolve().parent.parent / "docs" / "running-on-runpod.md"


def test_the_local_stack_runs_the_slot_wait_the_quota_bench_recommends():
    assert float(PREFECT_SERVER_ENV[WAIT_SETTING]) == RECOMMENDED_WAIT_S


def test_the_readme_recommends_the_slot_wait_the_local_stack_runs():
    assert f"{WAIT_SETTING}={PREFECT_SERVER_ENV[WAIT_SETTING]} prefect server start" in README.read_text()


def test_the_docs_recommend_the_lease_storage_and_the_task_run_and_event_batching_the_local_stack_runs():
    text = README.read_text()
    for name in ("PREFECT_SERVER_CONCURRENCY_LEASE_STORAGE", "PREFECT_SERVER_SERVICES_TASK_RUN_RECORDER_BATCH_SIZE",
                 "PREFECT_SERVER_SERVICES_TASK_RUN_RECORDER_FLUSH_INTERVAL",
                 "PREFECT_SERVER_SERVICES_EVENT_PERSISTER_BATCH_SIZE",
                 "PREFECT_SERVER_SERVICES_EVENT_PERSISTER_FLUSH_INTERVAL"):
        assert f"{name}={PREFECT_SERVER_ENV[name]} " in text
