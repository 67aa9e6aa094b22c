"""An attempt's teardown: by id first (only a 404 on GET proves absence), then by name, and a name that
is not listed right after a create proves nothing."""

from __future__ import annotations

import httpx
import pytest

from tasks.lifecycle.teardown import delete_attempt_endpoints
from tasks.runpod import errors
from tasks.runpod.client import RunpodClient

NAME = "loraflow-t-0123456789ab-abc123-a1"


def endpoint_doc(endpoint_id: str, name: str) -> dict:
    return {"id": endpoint_id, "name": name, "workers": {"min": 0, "max": 1}, "createdAt": "2026-11-01T00:00:00Z"}


class FakeControlPlane:
    """RunPod's endpoint routes over a dict, with the lags seen in the wild: a new endpoint is listed
    only after `listed_after` list calls, and a deleted one answers GET `get_after_delete` more times."""

    def __init__(self):
        self.endpoints: dict[str, dict] = {}
        self.unlisted: dict[str, int] = {}
        self.lingering: dict[str, int] = {}
        self.requests: list[str] = []

    def add(self, endpoint_id: str, name: str = NAME, listed_after: int = 0) -> None:
        self.endpoints[endpoint_id] = endpoint_doc(endpoint_id, name)
        self.unlisted[endpoint_id] = listed_after

    def client(self) -> RunpodClient:
        return RunpodClient("key", api_url="https://api.test/v2", transport=httpx.MockTransport(self.handle))

    def handle(self, request: httpx.Request) -> httpx.Response:
        self.requests.append(f"{request.method} {request.url.path}")
        parts = request.url.path.strip("/").split("/")  # v2, serverless[, id]
        if len(parts) == 2 and request.method == "GET":
            listed = []
            for endpoint_id, endpoint in self.endpoints.items():
                if self.unlisted[endpoint_id] > 0:
                    self.unlisted[endpoint_id] -= 1
                else:
                    listed.append(endpoint)
            return httpx.Response(200, json={"endpoints": listed})
        endpoint_id = parts[2]
        if request.method == "DELETE":
            if self.endpoints.pop(endpoint_id, None) is None:
                return httpx.Response(404, json={"detail": "not found"})
            return httpx.Response(204)
        if endpoint_id in self.endpoints:
            return httpx.Response(200, json=self.endpoints[endpoint_id])
        if self.lingering.get(endpoint_id, 0) > 0:
            self.lingering[endpoint_id] -= 1
            return httpx.Response(200, json=endpoint_doc(endpoint_id, NAME))
        return httpx.Response(404, json={"detail": "not found"})


def test_a_known_id_is_deleted_even_when_the_listing_does_not_show_it_yet():
    pod = FakeControlPlane()
    pod.add("ep1", listed_after=5)
    assert delete_attempt_endpoints(pod.client(), NAME, "ep1", sleep=pytest.fail) == ["ep1"]
    assert pod.endpoints == {}
    assert "GET /v2/serverless/ep1" in pod.requests, "absence is proved by a 404 on GET"


def test_without_an_id_the_name_is_listed_again_after_a_settle():
    pod = FakeControlPlane()
    pod.add("late", listed_after=1)  # made by a create that errored; not in the first listing
    slept = []
    assert delete_attempt_endpoints(pod.client(), NAME, None, settle_s=7, sleep=slept.append) == ["late"]
    assert slept == [7] and pod.endpoints == {}


def test_an_extra_endpoint_of_the_same_name_goes_too_and_others_stay():
    pod = FakeControlPlane()
    pod.add("ep1")
    pod.add("dup")
    pod.add("other", name="loraflow-t-0123456789ab-abc123-a2")
    assert sorted(delete_attempt_endpoints(pod.client(), NAME, "ep1", sleep=pytest.fail)) == ["dup", "ep1"]
    assert list(pod.endpoints) == ["other"]


def test_an_absent_endpoint_is_a_success():
    pod = FakeControlPlane()
    assert delete_attempt_endpoints(pod.client(), NAME, "gone", sleep=pytest.fail) == ["gone"]


def test_a_delete_that_gets_an_answer_but_leaves_the_endpoint_is_not_confirmed():
    pod = FakeControlPlane()
    pod.add("ep1")
    pod.lingering["ep1"] = 1  # GET still finds it right after the DELETE
    with pytest.raises(errors.ServerError, match="still exists") as e:
        delete_attempt_endpoints(pod.client(), NAME, "ep1", sleep=pytest.fail)
    assert errors.is_transient(e.value), "the delete task retries it"
    assert delete_attempt_endpoints(pod.client(), NAME, "ep1", sleep=pytest.fail) == ["ep1"]
