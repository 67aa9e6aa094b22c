"""Shared fixtures for the end-to-end tests: one real local stack (Prefect server + localpod + the real
worker) for the whole session, and the tiny model built offline.

Flows run in subprocesses pointed at the stack (Prefect reads its settings at import), the way a
Prefect worker would run them; the tests read the outcome back from the Prefect API and localpod.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from bench.prefect_rest import PrefectServerClient
from tests.hub_fixture import hub  # noqa: F401  (the local Hub stand-in, a module-scoped fixture)

REPO = Path(__file__).resolve().parent.parent
DATASET = REPO / "deployments" / "data" / "tiny-chat.jsonl"


_FIGURES: list[str] = []


@pytest.fixture(scope="session")
def figures():
    """`figures(text)` shows `text` in the run's closing summary, where CI's log keeps it (captured
    output of passing tests is not shown)."""
    return _FIGURES.append


def pytest_sessionfinish(session):
    workeroutput = getattr(session.config, "workeroutput", None)
    if workeroutput is not None:  # a pytest-xdist worker: the controller prints them
        workeroutput["loraflow_figures"] = list(_FIGURES)


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node, error):
    """pytest-xdist's controller: the figures of a worker that finished."""
    _FIGURES.extend(getattr(node, "workeroutput", {}).get("loraflow_figures", []))


def pytest_terminal_summary(terminalreporter):
    if _FIGURES:
        terminalreporter.section("loraflow figures")
        for text in _FIGURES:
            terminalreporter.write_line(text)


ONE_AFTER_THE_OTHER = ("test_chaos_e2e.py", "test_team_stack_e2e.py")
"""The two batches that keep both cores busy for minutes (23 chaos runs at once; the team stack's PostgreSQL,
Redis, server and 3 Prefect workers, then 12 runs): one pytest-xdist worker runs them, one after the other."""
THEN = (
    "test_preload_e2e.py", "test_ui_browser.py", "test_study_e2e.py", "test_serve_e2e.py", "test_train_e2e.py",
    "test_cli_overrides.py", "test_hub_e2e.py",
    "test_grpo_files_e2e.py", "test_dataset_mix_e2e.py", "test_run_events.py", "test_placement_e2e.py",
    "test_localpod.py", "test_preflight.py", "test_reconcile_e2e.py", "test_run_watch_e2e.py", "test_crash_recovery_e2e.py", "test_cancel_e2e.py",
    "test_server_restart_e2e.py", "test_slot_wait_server_errors.py", "test_localpod_vllm.py",
)
"""The other long modules (bench/README.md, "The test suite's duration"), in the order the other worker takes them:
first those whose waits have room to spare, while the chaos batch holds the CPU, then those whose bounds are
tighter (a lease, a reconcile interval, 40 s of errors). A module not named runs after these, in the usual order."""


def pytest_collection_modifyitems(items):
    """The long modules first, in the order above (a stable sort: each module keeps its own order)."""
    order = {name: i for i, name in enumerate(ONE_AFTER_THE_OTHER + THEN)}
    items.sort(key=lambda item: order.get(item.path.name, len(order)))


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """pytest-xdist's `--dist loadfile` (a test module is one unit of work: its module-scoped stacks and batches are
    set up once), but with the modules of `ONE_AFTER_THE_OTHER` one unit together. Units go to the workers in the
    collection's order as each finishes one (xdist's own reordering, by number of tests, is off: pyproject.toml): the
    longest first, so that no worker is left running a long module alone at the end. (xdist's `loadgroup` would
    group by mark, but its group names never reach the node ids under pytest 9.)"""
    from xdist.scheduler import LoadFileScheduling

    class Schedule(LoadFileScheduling):
        def _split_scope(self, nodeid: str) -> str:
            path = super()._split_scope(nodeid)
            return "one-after-the-other" if Path(path).name in ONE_AFTER_THE_OTHER else path

    return Schedule(config, log)


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> Path:
    from deployments.local_stack import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("tiny-model"))


@pytest.fixture(scope="session")
def local_stack(tmp_path_factory):
    from deployments.local_stack import LocalStack

    with LocalStack(tmp_path_factory.mktemp("stack"), worker_quota=30, with_hub=True) as stack:
        yield stack


@dataclass
class FlowRun:
    returncode: int
    output: str
    flow_run_id: str | None


def run_train_flow(stack, run_file: Path, timeout_s: float = 300) -> FlowRun:
    """Run `python -m flows.train RUN_FILE` against the stack, as a Prefect worker would."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PREFECT_", "RUNPOD_"))} | stack.client_env
    proc = subprocess.run([sys.executable, "-m", "flows.train", str(run_file)], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=timeout_s)
    output = proc.stdout + proc.stderr
    match = re.search(r"flow run ([0-9a-f-]{36}):", output)
    return FlowRun(proc.returncode, output, match.group(1) if match else None)


def prefect_api(stack, method: str, path: str, **kwargs) -> httpx.Response:
    """One call to the stack's Prefect REST API, retried as Prefect's own client retries (a loaded server
    answers 503 now and then; see `bench/prefect_rest.py`); an error answer left after that is raised."""
    with PrefectServerClient(timeout=30) as client:
        return client.request(method, f"{stack.prefect_api_url}{path}", **kwargs).raise_for_status()


def localpod_account(stack) -> dict:
    return httpx.get(f"{stack.localpod_url}/_localpod/account", timeout=10).json()


def stop_process_group(proc: subprocess.Popen, grace_s: float = 30) -> None:
    """End a process started with `start_new_session=True` and everything it started: SIGTERM to its group,
    SIGKILL after `grace_s`."""
    try:
        os.killpg(proc.pid, signal.SIGTERM)
    except ProcessLookupError:  # the group has already ended
        proc.wait()
        return
    try:
        proc.wait(grace_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
