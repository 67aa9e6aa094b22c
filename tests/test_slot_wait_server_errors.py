"""A run waiting for an endpoint slot outlasts the Prefect server failing its requests (`tasks/lifecycle/quota.py`,
`endpoint_slot`): 60 runs queued on one SQLite server made it answer 503 past the client's own retries,
and the waiting runs failed, though they had rented nothing.

The server is the stack's real Prefect server; between it and the waiting process stands a small real
proxy that answers 503 to the first slot requests, as the busy server did. The waiting process runs
`endpoint_slot` with Prefect's client retries off, so each 503 reaches it.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import httpx
import pytest
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from tests.conftest import REPO, prefect_api

SLOT_REQUEST = "/api/v2/concurrency_limits/increment-with-lease"

WAITER = """
import json, sys, time
from tasks.lifecycle.quota import endpoint_slot
import httpx

name, api, give_up_in = sys.argv[1], sys.argv[2], float(sys.argv[3])
with endpoint_slot(60, name=name, give_up_at=time.time() + give_up_in, retry_s=0.5):
    held = httpx.get(f"{api}/v2/concurrency_limits/{name}").json()["active_slots"]
print(json.dumps({"slots_held_inside": held}))
"""


class FailingProxy:
    """Forwards everything to the Prefect server, but answers 503 to the first `failures` slot requests."""

    def __init__(self, upstream: str, failures: int):
        self.upstream, self.failures, self.refused = upstream.removesuffix("/api"), failures, 0
        self.app = Starlette(routes=[Route("/{path:path}", self.forward, methods=["GET", "POST", "PATCH", "PUT",
                                                                                  "DELETE"])])

    async def forward(self, request: Request) -> Response:
        if request.url.path == SLOT_REQUEST and self.refused < self.failures:
            self.refused += 1
            return JSONResponse({"exception_message": "Service Unavailable"}, status_code=503)
        async with httpx.AsyncClient(timeout=60) as http:
            answer = await http.request(request.method, f"{self.upstream}{request.url.path}",
                                        params=request.query_params, content=await request.body(),
                                        headers={"content-type": request.headers.get("content-type", "")})
        return Response(answer.content, status_code=answer.status_code,
                        headers={k: v for k, v in answer.headers.items() if k.lower() == "content-type"})


@contextmanager
def running(proxy: FailingProxy) -> Iterator[str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(proxy.app, host="127.0.0.1", port=port, log_level="warning",
                                           lifespan="off"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started and time.monotonic() < deadline:
        time.sleep(0.05)
    try:
        yield f"http://127.0.0.1:{port}/api"
    finally:
        server.should_exit = True
        thread.join(10)


@pytest.fixture
def limit(local_stack, request) -> str:
    name = f"test-slot-wait-{request.node.name[-40:]}".replace("_", "-")
    prefect_api(local_stack, "POST", "/v2/concurrency_limits/", json={"name": name, "limit": 1})
    yield name
    prefect_api(local_stack, "DELETE", f"/v2/concurrency_limits/{name}")


def wait_for_slot(stack, api_url: str, name: str, give_up_in_s: float) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_")} | stack.client_env | {
        "PREFECT_API_URL": api_url, "PREFECT_CLIENT_MAX_RETRIES": "0"}
    return subprocess.run([sys.executable, "-c", WAITER, name, stack.prefect_api_url, str(give_up_in_s)], cwd=REPO,
                          env=env, capture_output=True, text=True, timeout=120)


def test_a_slot_wait_outlasts_the_server_failing_its_requests(local_stack, limit):
    proxy = FailingProxy(local_stack.prefect_api_url, failures=3)
    with running(proxy) as api_url:
        waited = wait_for_slot(local_stack, api_url, limit, give_up_in_s=600)
    assert waited.returncode == 0, waited.stderr[-3000:]
    assert json.loads(waited.stdout.splitlines()[-1]) == {"slots_held_inside": 1}
    warnings = [line for line in waited.stderr.splitlines() if "loraflow.quota - The Prefect server failed" in line]
    assert len(warnings) == 3 and "503" in warnings[0] and limit in warnings[0], waited.stderr[-3000:]
    assert prefect_api(local_stack, "GET", f"/v2/concurrency_limits/{limit}").json()["active_slots"] == 0


def test_a_slot_wait_gives_up_at_the_runs_deadline_naming_the_server(local_stack, limit):
    proxy = FailingProxy(local_stack.prefect_api_url, failures=1000)
    with running(proxy) as api_url:
        waited = wait_for_slot(local_stack, api_url, limit, give_up_in_s=5)
    assert waited.returncode != 0
    assert "ConcurrencySlotAcquisitionError" in waited.stderr and "503" in waited.stderr
    assert "the run's deadline leaves no time to wait longer" in waited.stderr, waited.stderr[-3000:]
    assert 1 < proxy.refused < 10


def test_a_missing_limit_fails_at_once(local_stack):
    proxy = FailingProxy(local_stack.prefect_api_url, failures=0)
    with running(proxy) as api_url:
        waited = wait_for_slot(local_stack, api_url, "no-such-limit-for-slot-wait", give_up_in_s=600)
    assert waited.returncode != 0
    assert "must be created before acquiring slots" in waited.stderr, waited.stderr[-3000:]
    assert "asking again" not in waited.stderr
