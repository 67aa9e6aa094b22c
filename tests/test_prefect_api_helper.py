"""The harness's Prefect REST client (`bench/prefect_rest.py`, behind the tests' `prefect_api` helper and the
chaos checks) retries a loaded server's 503/429 as Prefect's own client does, and passes every other answer
through."""

from __future__ import annotations

import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import SimpleNamespace

import httpx
import pytest

from bench.prefect_rest import PrefectServerClient
from tests.conftest import prefect_api


@pytest.fixture
def flaky_server():
    """A server on a free port answering the queued (status, headers) in order, then 200."""
    answers: list[tuple[int, dict[str, str]]] = []
    seen: list[str] = []

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 (http.server's name)
            seen.append(self.path)
            status, headers = answers.pop(0) if answers else (200, {})
            body = b'{"ok": true}' if status == 200 else b'{"detail": "busy"}'
            self.send_response(status)
            for key, value in headers.items():
                self.send_header(key, value)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        do_DELETE = do_GET  # noqa: N815 (http.server's name)

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield SimpleNamespace(stack=SimpleNamespace(prefect_api_url=f"http://127.0.0.1:{server.server_port}/api"),
                              answers=answers, seen=seen)
    finally:
        server.shutdown()
        server.server_close()
        thread.join(10)


def test_503_and_429_are_retried_after_retry_after(flaky_server):
    flaky_server.answers.extend([(503, {"Retry-After": "0"}), (429, {"Retry-After": "0"})])
    assert prefect_api(flaky_server.stack, "GET", "/flow_runs/x").json() == {"ok": True}
    assert len(flaky_server.seen) == 3


def test_other_errors_are_raised_at_once(flaky_server):
    flaky_server.answers.append((404, {}))
    with pytest.raises(httpx.HTTPStatusError):
        prefect_api(flaky_server.stack, "GET", "/flow_runs/x")
    assert len(flaky_server.seen) == 1


def test_a_server_that_stays_busy_fails_after_five_retries(flaky_server):
    flaky_server.answers.extend([(503, {"Retry-After": "0"})] * 6)
    with pytest.raises(httpx.HTTPStatusError, match="503"):
        prefect_api(flaky_server.stack, "GET", "/flow_runs/x")
    assert len(flaky_server.seen) == 6


def test_a_delete_refused_with_503_is_sent_again(flaky_server):
    flaky_server.answers.append((503, {"Retry-After": "0"}))
    with PrefectServerClient(base_url=flaky_server.stack.prefect_api_url) as client:
        assert client.delete("/variables/name/x").status_code == 200
    assert len(flaky_server.seen) == 2


def test_the_client_returns_an_error_answer_it_does_not_retry(flaky_server):
    flaky_server.answers.append((500, {}))
    with PrefectServerClient(base_url=flaky_server.stack.prefect_api_url) as client:
        assert client.delete("/variables/name/x").status_code == 500
    assert len(flaky_server.seen) == 1
