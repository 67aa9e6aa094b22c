"""The RunPod client: one status → exception mapping, typed payloads, no retries of its own."""

import httpx
import pytest

from tasks.runpod import errors
from tasks.runpod.client import RunpodClient
from tasks.runpod.models import CreateEndpoint, GpuRequest, RunRequest


def client_answering(status: int, body=None, headers=None, calls=None) -> RunpodClient:
    def handler(request: httpx.Request) -> httpx.Response:
        if calls is not None:
            calls.append(request)
        return httpx.Response(status, json=body if body is not None else {}, headers=headers)

    return RunpodClient("key", api_url="https://api.test/v2", job_url="https://jobs.test/v2",
                        transport=httpx.MockTransport(handler))


@pytest.mark.parametrize(
    ("status", "error_class"),
    [
        (400, errors.BadRequestError),
        (401, errors.AuthError),
        (403, errors.AuthError),
        (404, errors.NotFoundError),
        (409, errors.ConflictError),
        (422, errors.BadRequestError),
        (429, errors.RateLimitError),
        (500, errors.ServerError),
        (503, errors.ServerError),
    ],
)
def test_status_maps_to_its_error_class(status, error_class):
    client = client_answering(status, {"title": "x", "status": status, "detail": "something"})
    with pytest.raises(error_class) as e:
        client.get_endpoint("ep1")
    assert e.value.status == status
    assert "something" in str(e.value)


def test_transient_errors_are_exactly_429_5xx_and_transport():
    assert errors.is_transient(errors.RateLimitError("x", status=429))
    assert errors.is_transient(errors.ServerError("x", status=502))
    assert errors.is_transient(errors.RunpodTimeoutError("x"))
    assert not errors.is_transient(errors.BadRequestError("x", status=400))
    assert not errors.is_transient(errors.NotFoundError("x", status=404))
    assert not errors.is_transient(errors.AuthError("x", status=401))


def test_quota_text_becomes_quota_error_with_a_fix():
    detail = "Max workers across all endpoints must not exceed your workers quota (30)"
    client = client_answering(400, {"title": "Bad Request", "status": 400, "detail": detail})
    with pytest.raises(errors.QuotaExceededError, match="Delete unused endpoints"):
        client.list_endpoints()


@pytest.mark.parametrize(
    ("status", "body"),
    [
        # REST v1's answer to the same refusal: a 500 with its own body shape.
        (500, {"error": "create endpoint: graphql: Max workers across all endpoints must not exceed your workers "
                        "quota (5)"}),
        (500, {"title": "Internal Server Error", "status": 500,
               "detail": "Max workers across all endpoints must not exceed your workers quota (5)"}),
        (400, {"title": "Bad Request", "status": 400,
               "detail": "Max workers across all endpoints must not exceed your workers quota (5)"}),
        # RunPod's other wording of the same refusal (issue 37): taken as a refused GPU class, it failed the run.
        (400, {"title": "Bad Request", "status": 400,
               "detail": "Max workers across all endpoints will exceed your worker quota of 5 ... at most 4"}),
    ],
)
def test_the_quota_refusal_is_known_by_its_text_at_any_status(status, body):
    client = client_answering(status, body)
    with pytest.raises(errors.QuotaExceededError) as e:
        client.create_endpoint(CreateEndpoint(name="n", image="i", gpu=GpuRequest(pools=["ADA_24"]), timeout=60_000))
    assert e.value.status == status and e.value.quota == 5
    assert not errors.is_transient(e.value)  # waited out by the run, not retried as a 5xx


def test_rate_limit_carries_retry_after():
    client = client_answering(429, {"detail": "slow down"}, headers={"Retry-After": "7"})
    with pytest.raises(errors.RateLimitError) as e:
        client.list_endpoints()
    assert e.value.retry_after == 7.0


def test_transport_failure_is_a_connection_error():
    def handler(request):
        raise httpx.ConnectError("refused", request=request)

    client = RunpodClient("key", transport=httpx.MockTransport(handler))
    with pytest.raises(errors.RunpodConnectionError):
        client.list_endpoints()


def test_timeout_is_a_timeout_error():
    def handler(request):
        raise httpx.ReadTimeout("slow", request=request)

    client = RunpodClient("key", transport=httpx.MockTransport(handler))
    with pytest.raises(errors.RunpodTimeoutError):
        client.list_endpoints()


def test_client_does_not_retry_by_itself():
    calls = []
    client = client_answering(503, {"detail": "down"}, calls=calls)
    with pytest.raises(errors.ServerError):
        client.list_endpoints()
    assert len(calls) == 1


def test_auth_error_message_names_the_key_not_its_value():
    client = client_answering(401, {"detail": "invalid token"})
    with pytest.raises(errors.AuthError) as e:
        client.list_endpoints()
    assert "RUNPOD_API_KEY" in str(e.value)
    assert "Bearer" not in str(e.value)


def test_missing_key_is_refused_before_any_request():
    with pytest.raises(errors.AuthError, match="RUNPOD_API_KEY"):
        RunpodClient("")


def test_create_sends_the_camel_case_v2_body():
    calls = []
    created = {"id": "ep1", "name": "loraflow-x", "workers": {"min": 0, "max": 1}, "createdAt": "2026-11-30T00:00:00Z",
               "scaling": {"type": "QUEUE_DELAY", "queueDelay": 4}, "dataCenterIds": [], "networkVolumes": [],
               "timeout": 1000, "flashboot": "FLASHBOOT"}
    client = client_answering(201, created, calls=calls)
    body = CreateEndpoint(name="loraflow-x", image="img", gpu=GpuRequest(pools=["ADA_24"], min_cuda_version="12.8"),
                          timeout=1000)
    endpoint = client.create_endpoint(body)
    sent = calls[0]
    assert sent.method == "POST" and sent.url.path == "/v2/serverless"
    assert sent.headers["authorization"] == "Bearer key"
    payload = __import__("json").loads(sent.content)
    assert payload["gpu"] == {"pools": ["ADA_24"], "count": 1, "minCudaVersion": "12.8"}
    assert payload["workers"] == {"min": 0, "max": 1, "idleTimeout": 5}
    assert payload["scaling"] == {"type": "QUEUE_DELAY", "queueDelay": 4}
    assert endpoint.id == "ep1" and endpoint.workers.max == 1


def test_job_calls_go_to_the_job_api():
    calls = []
    client = client_answering(200, {"id": "job1", "status": "IN_QUEUE"}, calls=calls)
    job = client.run("ep1", RunRequest(input={"a": 1}))
    assert calls[0].url == httpx.URL("https://jobs.test/v2/ep1/run")
    assert job.status == "IN_QUEUE" and not job.terminal


@pytest.fixture
def paged_runpod(tmp_path):
    """loraflow's client against an in-process localpod whose lists page at 2 items."""
    import sys

    from fastapi.testclient import TestClient

    from localpod import LocalpodConfig, create_app

    config = LocalpodConfig(api_key="key", worker_quota=20, page_size=2, log_dir=tmp_path / "logs",
                            worker_command=[sys.executable, "-c", "raise SystemExit('no workers')"])
    with TestClient(create_app(config)) as pod:
        def forward(request: httpx.Request) -> httpx.Response:
            answer = pod.request(request.method, request.url.raw_path.decode(), content=request.content,
                                 headers=request.headers)
            return httpx.Response(answer.status_code, headers=answer.headers, content=answer.content)

        yield RunpodClient("key", api_url="http://localpod/v2", job_url="http://localpod/v2",
                           transport=httpx.MockTransport(forward))


def test_every_list_reads_every_page(paged_runpod):
    from tasks.runpod.models import CreateNetworkVolume, CreateSecret

    names = [f"loraflow-page-{n}" for n in range(5)]
    for name in names:
        paged_runpod.create_endpoint(CreateEndpoint(name=name, image="i", gpu=GpuRequest(pools=["ADA_24"]),
                                                    timeout=60_000))
        paged_runpod.create_network_volume(CreateNetworkVolume(name=name, size=10, data_center="EU-RO-1"))
        paged_runpod.create_secret(CreateSecret(name=name, value="v"))
    assert [e.name for e in paged_runpod.list_endpoints()] == names
    assert [v.name for v in paged_runpod.list_network_volumes()] == names
    assert [s.name for s in paged_runpod.list_secrets()] == names
    assert paged_runpod.find_endpoint(names[-1]) is not None  # on the third page


def test_a_cursor_answered_twice_is_an_error_not_an_endless_read():
    pages = iter([{"endpoints": [], "pagination": {"nextCursor": "a"}}] * 3)
    client = RunpodClient("key", api_url="https://api.test/v2",
                          transport=httpx.MockTransport(lambda request: httpx.Response(200, json=next(pages))))
    with pytest.raises(errors.ServerError, match="cursor 'a' twice"):
        client.list_endpoints()
