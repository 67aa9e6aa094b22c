"""Runs the local Hub stand-in (localpod.hub) as a real server process for tests.

    with running_hub(tmp_path / "hub", commits_per_hour=3) as hub:
        HfApi(endpoint=hub.url, token=hub.token).create_repo(...)
        hub.arm_commit_faults("dataset", "org/name", status=429, count=2, retry_after_s=1)

or, in a test module, `from tests.hub_fixture import hub  # noqa: F401` for a module-scoped `hub` fixture.
huggingface_hub reads HF_ENDPOINT at import, so in-process clients pass `endpoint=hub.url` on every
call; `hub.client_env()` is the environment for a client in a subprocess.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]
READY_LINE = "hub stand-in listening on "
START_TIMEOUT_S = 30.0
STOP_TIMEOUT_S = 10.0
TEST_TOKEN = "hf_test_token_for_the_stand_in"
READ_ONLY_TEST_TOKEN = "hf_read_only_token_for_the_stand_in"


@dataclass
class HubStandIn:
    url: str
    """Endpoint, e.g. http://127.0.0.1:41234 (no trailing slash)."""
    data_dir: Path
    token: str
    """A token the stand-in accepts (it accepts any token unless started with require_token)."""
    process: subprocess.Popen
    read_only_token: str | None = None
    """A token that reads but cannot write (the Hub's "read" token): its writes answer 403."""

    def commits(self, repo_type: str, repo_id: str) -> list[dict]:
        """Commits on main, newest first, from the stand-in's test hook (initial commit included)."""
        response = httpx.get(f"{self.url}/_hub/commits/{repo_type}/{repo_id}", timeout=10)
        response.raise_for_status()
        return response.json()["commits"]

    def downloads(self, repo_type: str, repo_id: str) -> int:
        """File GETs the stand-in served for this repo since it started."""
        response = httpx.get(f"{self.url}/_hub/downloads/{repo_type}/{repo_id}", timeout=10)
        response.raise_for_status()
        return response.json()["count"]

    def arm_commit_faults(self, repo_type: str, repo_id: str, *, status: int, count: int = 1,
                          retry_after_s: int | None = None) -> None:
        """Make the repo's next `count` commit requests answer `status` (after any already armed)."""
        rule = {"status": status, "count": count, "retry_after_s": retry_after_s}
        response = httpx.post(f"{self.url}/_hub/commit-faults/{repo_type}/{repo_id}", json=rule, timeout=10)
        response.raise_for_status()

    def armed_commit_faults(self, repo_type: str, repo_id: str) -> int:
        """Commit requests of the repo still armed to be refused."""
        response = httpx.get(f"{self.url}/_hub/commit-faults/{repo_type}/{repo_id}", timeout=10)
        response.raise_for_status()
        return sum(rule["count"] for rule in response.json()["armed"])

    def client_env(self, **extra: str) -> dict[str, str]:
        """Environment for a huggingface_hub client in a subprocess, pointed at this stand-in."""
        env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "HUGGING_FACE_"))}
        env.update(HF_ENDPOINT=self.url, HF_TOKEN=self.token, HF_HUB_DISABLE_TELEMETRY="1",
                   HF_HOME=str(self.data_dir.parent / "hf-home"), PYTHONPATH=_pythonpath())
        env.update(extra)
        return env


@contextmanager
def running_hub(data_dir: Path, *, require_token: str | None = None, commits_per_hour: int = 128,
                commit_window_s: float = 3600.0, python: str | Path = sys.executable,
                read_only_token: str | None = READ_ONLY_TEST_TOKEN) -> Iterator[HubStandIn]:
    """Start `python -m localpod.hub --port 0` on `data_dir`, wait until it listens, stop it on exit.
    `python`: an interpreter with localpod's dependencies (the worker's tests pass the control plane's).
    `read_only_token`: a token the stand-in lets read but not write (None: none)."""
    data_dir = Path(data_dir)
    data_dir.mkdir(parents=True, exist_ok=True)
    log_path = data_dir.parent / f"{data_dir.name}.log"
    command = [str(python), "-m", "localpod.hub", "--host", "127.0.0.1", "--port", "0",
               "--data-dir", str(data_dir), "--commits-per-hour", str(commits_per_hour),
               "--commit-window-s", str(commit_window_s)]
    if require_token is not None:
        command += ["--require-token", require_token]
    if read_only_token is not None:
        command += ["--read-only-token", read_only_token]
    # Output goes to a file, not a pipe: a pipe nobody drains would block the server once full.
    with open(log_path, "wb") as log:
        process = subprocess.Popen(command, cwd=REPO_ROOT, stdout=log, stderr=subprocess.STDOUT,
                                   env={**os.environ, "PYTHONPATH": _pythonpath()})
    try:
        url = _wait_until_listening(process, log_path)
        yield HubStandIn(url=url, data_dir=data_dir, token=require_token or TEST_TOKEN, process=process,
                         read_only_token=read_only_token)
    finally:
        process.terminate()
        try:
            process.wait(timeout=STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


@pytest.fixture(scope="module")
def hub(tmp_path_factory: pytest.TempPathFactory) -> Iterator[HubStandIn]:
    """A stand-in with default settings, shared by the tests of one module."""
    with running_hub(tmp_path_factory.mktemp("hub") / "data") as stand_in:
        yield stand_in


def _wait_until_listening(process: subprocess.Popen, log_path: Path) -> str:
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        for line in log_path.read_text(errors="replace").splitlines():
            if line.startswith(READY_LINE):
                return line[len(READY_LINE):].strip()
        if process.poll() is not None:
            break
        time.sleep(0.05)
    raise RuntimeError(f"Hub stand-in did not start (exit code {process.poll()}):\n{log_path.read_text()[-3000:]}")


def _pythonpath() -> str:
    # The stand-in is `localpod` (repo root); the artifact store is `loraflow_worker` (worker_image/).
    paths = [str(REPO_ROOT), str(REPO_ROOT / "worker_image")]
    return os.pathsep.join(paths + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p])
