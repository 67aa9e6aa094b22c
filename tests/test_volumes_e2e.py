"""The `volumes` flow and the warm-cache records on the local stack: a real Prefect server (its Variables and
events) and localpod's network volumes and endpoints. Uses are `loraflow.volume.used` events sent with an
explicit `occurred`, so that "unused for days" takes no waiting."""

from __future__ import annotations

import json
import logging
import os
import re
import subprocess
import sys
import time
import uuid
from datetime import UTC, datetime, timedelta

import httpx
import pytest
from prefect.events import Event

from deployments.local_stack import LOCALPOD_API_KEY
from tasks.reports.events import VOLUME_RESOURCE, VOLUME_USED
from tasks.runpod.volumes import volume_name
from tasks.placement.weight_cache import DataCenterCache, WarmModel, read_cache, variable_name, warm_cache_for
from tests.conftest import REPO, prefect_api

pytestmark = pytest.mark.timeout(600)

DC = "US-KS-2"  # no other end-to-end test keeps a volume or a weight-cache record here
AUTH = {"Authorization": f"Bearer {LOCALPOD_API_KEY}"}


def test_retention_deletes_an_unused_volume_and_its_record_and_keeps_used_attached_and_foreign_ones(local_stack):
    ns = namespace(local_stack)
    unused, used, attached = (create_volume(local_stack, volume_name(DC, ns)) for _ in range(3))
    foreign = create_volume(local_stack, volume_name(DC, "zz9other"))
    holder = localpod(local_stack, "POST", "/v2/serverless", json={
        "name": "e2e-volumes-holder", "type": "QUEUE", "scaling": {"type": "QUEUE_DELAY", "queueDelay": 4},
        "image": "localpod/unused:latest", "gpu": {"pools": ["ADA_24"]}, "workers": {"max": 0},
        "networkVolumes": [attached]}).json()
    try:
        write_record(local_stack, unused)
        now = datetime.now(UTC)
        send_uses(local_stack, {unused: now - timedelta(days=3), attached: now - timedelta(days=3), used: now})

        table = run_volumes(local_stack, {"retain_days": 1})
        assert table[unused]["action"] == "delete" and table[unused]["result"] == "deleted with its record", table
        assert table[used]["action"] == table[attached]["action"] == table[foreign]["action"] == "keep"
        assert "attached to e2e-volumes-holder" in table[attached]["reason"]
        assert table[foreign]["namespace"] == "zz9other" and table[foreign]["$/month"] == 1.4
        assert table[foreign]["cost source"] in ("billed", "documented price")
        assert set(volume_ids(local_stack)) >= {used, attached, foreign} and unused not in volume_ids(local_stack)
        assert prefect_api_status(local_stack, f"/variables/name/{variable_name(DC)}") == 404

        table = run_volumes(local_stack, {"retain_days": 1, "delete_namespaces": ["zz9other"], "confirm": True})
        assert table[foreign]["result"] == "deleted" and foreign not in volume_ids(local_stack)
        assert {used, attached} <= set(volume_ids(local_stack))
    finally:
        localpod(local_stack, "DELETE", f"/v2/serverless/{holder['id']}")
        for volume_id in (unused, used, attached, foreign):
            httpx.delete(f"{local_stack.localpod_url}/v2/network-volumes/{volume_id}", headers=AUTH, timeout=10)


def test_a_record_whose_volume_is_gone_is_cleared_and_the_run_goes_cold(local_stack, caplog):
    from prefect.settings import PREFECT_API_URL, temporary_settings

    volume = create_volume(local_stack, "loraflow-cache-stale")
    write_record(local_stack, volume)
    localpod(local_stack, "DELETE", f"/v2/network-volumes/{volume}")
    with temporary_settings({PREFECT_API_URL: local_stack.prefect_api_url}), caplog.at_level(logging.WARNING):
        assert warm_cache_for("acme/tiny", None, [DC], existing_volumes=lambda: volume_ids(local_stack)) is None
        assert read_cache(DC) is None
    assert "no longer exists: record cleared" in caplog.text


def test_an_unreadable_record_means_cold_with_a_warning(local_stack, caplog):
    from prefect.settings import PREFECT_API_URL, temporary_settings

    prefect_api(local_stack, "POST", "/variables/", json={"name": variable_name("XX-BAD-1"), "value": "not a record"})
    try:
        with temporary_settings({PREFECT_API_URL: local_stack.prefect_api_url}), caplog.at_level(logging.WARNING):
            assert warm_cache_for("acme/tiny", None, ["XX-BAD-1"]) is None
        assert f"{variable_name('XX-BAD-1')} does not hold a weight-cache record" in caplog.text
    finally:
        prefect_api(local_stack, "DELETE", f"/variables/name/{variable_name('XX-BAD-1')}")


def test_a_record_the_prefect_api_cannot_answer_means_cold_with_a_warning(caplog):
    from prefect.settings import PREFECT_API_URL, PREFECT_CLIENT_MAX_RETRIES, temporary_settings

    with temporary_settings({PREFECT_API_URL: "http://127.0.0.1:9/api", PREFECT_CLIENT_MAX_RETRIES: 0}), \
            caplog.at_level(logging.WARNING):
        assert read_cache("EU-RO-1") is None
    assert "could not be read" in caplog.text and "treating EU-RO-1 as cold" in caplog.text


# helpers


def namespace(stack) -> str:
    """The stack's control-plane tag, made as `Settings.control_plane_namespace` makes it when missing."""
    answer = httpx.get(f"{stack.prefect_api_url}/variables/name/loraflow-namespace", timeout=10)
    if answer.status_code == 404:
        prefect_api(stack, "POST", "/variables/", json={"name": "loraflow-namespace", "value": "e2evol"})
        answer = httpx.get(f"{stack.prefect_api_url}/variables/name/loraflow-namespace", timeout=10)
    return answer.json()["value"]


def localpod(stack, method: str, path: str, **kwargs) -> httpx.Response:
    answer = httpx.request(method, f"{stack.localpod_url}{path}", headers=AUTH, timeout=30, **kwargs)
    assert answer.is_success, answer.text
    return answer


def create_volume(stack, name: str) -> str:
    return localpod(stack, "POST", "/v2/network-volumes", json={"name": name, "size": 20, "dataCenter": DC}).json()["id"]


def volume_ids(stack) -> list[str]:
    return [v["id"] for v in localpod(stack, "GET", "/v2/network-volumes").json()["networkVolumes"]]


def write_record(stack, volume_id: str) -> None:
    cache = DataCenterCache(data_center=DC, volume_id=volume_id, volume_gb=20, models={
        "acme/tiny": WarmModel(revision="abc", size_bytes=1, warmed_at=datetime.now(UTC) - timedelta(days=30))})
    name = variable_name(DC)
    httpx.delete(f"{stack.prefect_api_url}/variables/name/{name}", timeout=10)
    prefect_api(stack, "POST", "/variables/", json={"name": name, "value": cache.model_dump(mode="json")})


def prefect_api_status(stack, path: str) -> int:
    return httpx.get(f"{stack.prefect_api_url}{path}", timeout=10).status_code


def send_uses(stack, uses: dict[str, datetime]) -> None:
    """`loraflow.volume.used` for each volume at the given time, and wait until the server has stored them."""
    events = [Event(occurred=at, event=VOLUME_USED, id=uuid.uuid4(),
                    resource={"prefect.resource.id": f"{VOLUME_RESOURCE}{volume_id}", "loraflow.used-by": "e2e"})
              for volume_id, at in uses.items()]
    prefect_api(stack, "POST", "/events", json=[e.model_dump(mode="json") for e in events])
    ids = [str(e.id) for e in events]
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        stored = prefect_api(stack, "POST", "/events/filter", json={"filter": {
            "id": {"id": ids}, "occurred": {"since": (datetime.now(UTC) - timedelta(days=30)).isoformat(),
                                            "until": (datetime.now(UTC) + timedelta(days=1)).isoformat()}},
            "limit": 50}).json()["events"]
        if len(stored) == len(ids):
            return
        time.sleep(1)
    raise AssertionError("the use events were not stored within 60 s")


def run_volumes(stack, policy: dict) -> dict[str, dict]:
    """Run `python -m flows.volumes POLICY` against the stack; its table, by volume id."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PREFECT_", "RUNPOD_"))} | stack.client_env
    proc = subprocess.run([sys.executable, "-m", "flows.volumes", json.dumps(policy)], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=300)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output[-5000:]
    flow_run_id = re.search(r"flow run ([0-9a-f-]{36}):", output).group(1)
    [artifact] = prefect_api(stack, "POST", "/artifacts/filter", json={
        "artifacts": {"flow_run_id": {"any_": [flow_run_id]}, "key": {"any_": ["volumes"]}}}).json()
    rows = artifact["data"] if isinstance(artifact["data"], list) else json.loads(artifact["data"])
    return {row["volume id"]: row for row in rows}
