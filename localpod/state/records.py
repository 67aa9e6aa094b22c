"""The records of one localpod account: an endpoint, a job, a worker and a secret, each as the server keeps it, and
the ids and timestamps RunPod gives them. `LocalpodState` (`account.py`) makes every change to them."""

from __future__ import annotations

import secrets
import string
import subprocess
from collections import deque
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from localpod.faults.book import ArmedFault
from localpod.faults.rules import DeadWorkerJobs

TERMINAL_STATUSES = frozenset({"COMPLETED", "FAILED", "CANCELLED", "TIMED_OUT"})
_ID_ALPHABET = string.ascii_lowercase + string.digits
_ID_LENGTH = 14  # RunPod endpoint and pod ids are 14 lowercase alphanumerics, e.g. "jpnw0v75y3qoql"


def new_id() -> str:
    return "".join(secrets.choice(_ID_ALPHABET) for _ in range(_ID_LENGTH))


def iso(t: float) -> str:
    """RunPod's timestamp form: `2026-06-01T12:00:00.000Z`."""
    return datetime.fromtimestamp(t, UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")


@dataclass
class SecretRecord:
    """An account secret (`/v2/account/secrets`); `value` leaves the server only into a booting worker's env."""

    id: str
    name: str
    value: str
    description: str | None
    created_at: float
    value_updated_at: float


@dataclass
class EndpointRecord:
    id: str
    spec: dict[str, Any]
    """Every Endpoint field except id, requestUrls and createdAt, defaults applied."""
    created_at: float
    deleted_at: float | None = None
    queue: deque[str] = field(default_factory=deque)
    spawn_not_before: float = 0.0
    version: int = 1
    """Its configuration version: 1 at creation, one more per update (`endpointVersion` in the workers list)."""
    unplaceable_reason: str | None = None
    """Why no worker of it could start at the supervisor's last try, once logged; None since one could."""

    @property
    def live(self) -> bool:
        return self.deleted_at is None

    @property
    def workers_max(self) -> int:
        return int(self.spec["workers"]["max"])

    @property
    def workers_min(self) -> int:
        return int(self.spec["workers"]["min"])

    @property
    def idle_timeout_s(self) -> float:
        return float(self.spec["workers"]["idleTimeout"])


@dataclass
class JobRecord:
    id: str
    endpoint_id: str
    input: dict[str, Any]
    created_at: float
    ttl_ms: int
    execution_timeout_ms: int | None
    """None: the endpoint's `timeout` applies, read when the job starts."""
    webhook: str | None
    status: str = "IN_QUEUE"
    started_at: float | None = None
    finished_at: float | None = None
    worker_id: str | None = None
    output: Any = None
    error: str | None = None
    expired: bool = False
    retries: int = 0
    stream: list[Any] = field(default_factory=list)
    progress_updates: int = 0
    fault: ArmedFault | None = None
    """A worker fault armed for this job when a worker took it; the supervisor fires it."""

    @property
    def terminal(self) -> bool:
        return self.status in TERMINAL_STATUSES


@dataclass
class WorkerRecord:
    id: str
    endpoint_id: str
    token: str
    started_at: float
    process: subprocess.Popen[bytes] | None
    """None for a worker localpod did not start (someone ran it by hand with the account key)."""
    endpoint_version: int = 1
    """The endpoint's configuration version it started under (an update since makes it stale)."""
    log_path: Path | None = None
    contacted: bool = False
    job_id: str | None = None
    idle_since: float | None = None
    unhealthy: bool = False
    stop_reason: str | None = None
    """Set when localpod wants this worker gone; the supervisor then signals it."""
    signalled_at: float | None = None
    killed: bool = False
    ended_at: float | None = None
    exit_code: int | None = None
    suspended: bool = False
    """SIGSTOPped by a hang fault: a stop must send SIGCONT too, or SIGTERM never reaches it."""
    dead_worker_jobs: DeadWorkerJobs | None = None
    """Set by a crash fault that says what happens to its job; None: the server's `dead_worker_jobs`."""
    pending_stops: dict[str, float] = field(default_factory=dict)
    """Jobs this worker must stop, with when each was last sent (monotonic; -inf: never). runpod 1.12 drops a stop
    that arrives before its job's task exists, so a stop is re-sent until the worker is free."""

    @property
    def live(self) -> bool:
        return self.ended_at is None

    @property
    def stopping(self) -> bool:
        return self.stop_reason is not None
