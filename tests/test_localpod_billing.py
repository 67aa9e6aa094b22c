"""localpod bills network volumes as RunPod does, by size and time whether used or not, and reports it at
`GET /v2/billing/network-volumes` as the official schema states it: standard storage at $0.07/GB-month ($0.05
above 1 TB), high-performance at its own price, a month of 30 days; growing a volume changes its rate from that
moment, and a deleted volume keeps what it was billed. `POST /_localpod/clock` lets storage time pass.

The tests drive the app in-process; no worker starts.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

from localpod import LocalpodConfig, create_app
from localpod.billing import HIGH_PERFORMANCE_USD_PER_GB_MONTH
from tests.test_localpod import API_KEY, AUTH, SCHEMAS, assert_problem

MONTH_DAYS = 30  # localpod's billing month
# Real seconds pass between the creation and the read: a cent's slack covers them many times over.
CENT = 0.01


@pytest.fixture
def pod(tmp_path: Path) -> Iterator[TestClient]:
    config = LocalpodConfig(api_key=API_KEY, log_dir=tmp_path / "logs",
                            worker_command=[sys.executable, "-c", "raise SystemExit('no workers here')"])
    with TestClient(create_app(config)) as c:
        yield c


def create_volume(pod: TestClient, size: int, data_center: str = "EU-RO-1", **extra: Any) -> str:
    answer = pod.post("/v2/network-volumes", json={"name": "weights", "size": size, "dataCenter": data_center,
                                                   **extra}, headers=AUTH)
    assert answer.status_code == 201, answer.text
    return answer.json()["id"]


def advance(pod: TestClient, days: float) -> dict[str, Any]:
    answer = pod.post("/_localpod/clock", json={"advance_days": days})
    assert answer.status_code == 200, answer.text
    return answer.json()


def billing(pod: TestClient, **params: Any) -> dict[str, Any]:
    answer = pod.get("/v2/billing/network-volumes", params={"bucketSize": "month", "lastN": 3, **params},
                     headers=AUTH)
    assert answer.status_code == 200, answer.text
    assert SCHEMAS.errors("ListNetworkVolumeBillingResponse", answer.json()) == []
    return answer.json()


def billed(pod: TestClient, volume_id: str | None = None) -> float:
    params = {"networkVolumeId": volume_id} if volume_id else {}
    return billing(pod, **params)["metadata"]["totals"]["totalAmount"]


# --- prices ------------------------------------------------------------------------------------------


def test_a_standard_volume_costs_7_cents_per_gb_for_a_30_day_month(pod: TestClient) -> None:
    create_volume(pod, 50)
    advance(pod, MONTH_DAYS)
    assert billed(pod) == pytest.approx(50 * 0.07, abs=CENT)


def test_the_storage_above_1_tb_costs_5_cents_per_gb_month(pod: TestClient) -> None:
    create_volume(pod, 2000)
    advance(pod, MONTH_DAYS)
    assert billed(pod) == pytest.approx(1000 * 0.07 + 1000 * 0.05, abs=CENT)


def test_high_performance_storage_is_billed_apart_at_its_own_price(pod: TestClient) -> None:
    create_volume(pod, 100, type="HIGH_PERFORMANCE")
    advance(pod, MONTH_DAYS)
    totals = billing(pod)["metadata"]["totals"]
    assert totals["highPerformanceAmount"] == pytest.approx(100 * HIGH_PERFORMANCE_USD_PER_GB_MONTH, abs=CENT)
    assert totals["standardAmount"] == 0
    assert HIGH_PERFORMANCE_USD_PER_GB_MONTH > 0.07


def test_a_volume_accrues_cost_in_proportion_to_time(pod: TestClient) -> None:
    create_volume(pod, 300)
    advance(pod, 3)
    assert billed(pod) == pytest.approx(300 * 0.07 * 3 / MONTH_DAYS, abs=CENT)


def test_a_volume_bills_from_its_creation_only(pod: TestClient) -> None:
    advance(pod, 10)  # time before the volume existed costs nothing
    create_volume(pod, 100)
    assert billed(pod) < CENT


# --- growth and deletion -----------------------------------------------------------------------------


def test_growing_a_volume_changes_its_rate_from_that_moment(pod: TestClient) -> None:
    volume_id = create_volume(pod, 50)
    advance(pod, 10)
    pod.patch(f"/v2/network-volumes/{volume_id}", json={"size": 200}, headers=AUTH).raise_for_status()
    advance(pod, 20)
    assert billed(pod) == pytest.approx(50 * 0.07 * 10 / MONTH_DAYS + 200 * 0.07 * 20 / MONTH_DAYS, abs=CENT)


def test_a_renamed_volume_keeps_its_rate(pod: TestClient) -> None:
    volume_id = create_volume(pod, 100)
    pod.patch(f"/v2/network-volumes/{volume_id}", json={"name": "renamed"}, headers=AUTH).raise_for_status()
    advance(pod, MONTH_DAYS)
    assert billed(pod) == pytest.approx(100 * 0.07, abs=CENT)


def test_a_deleted_volume_stops_accruing_and_keeps_its_billed_history(pod: TestClient) -> None:
    volume_id = create_volume(pod, 100)
    advance(pod, 15)
    assert pod.delete(f"/v2/network-volumes/{volume_id}", headers=AUTH).status_code == 204
    advance(pod, 15)
    assert billed(pod, volume_id) == pytest.approx(100 * 0.07 / 2, abs=CENT)
    assert {r["networkVolumeId"] for r in billing(pod)["records"]} == {volume_id}


# --- records and query -------------------------------------------------------------------------------


def test_records_are_one_per_volume_per_bucket_it_existed_in(pod: TestClient) -> None:
    first, second = create_volume(pod, 100), create_volume(pod, 10, "US-KS-2")
    advance(pod, 2)
    body = billing(pod, bucketSize="day", lastN=5)
    per_volume = {v: [r for r in body["records"] if r["networkVolumeId"] == v] for v in (first, second)}
    # The creation's day and the two days the clock moved on (a fourth if real midnight passed meanwhile).
    assert all(len(records) in (3, 4) for records in per_volume.values())
    assert all(r["totalAmount"] <= 100 * 0.07 / MONTH_DAYS + 1e-6 for r in per_volume[first])
    assert all(datetime.fromisoformat(r["endTime"]) - datetime.fromisoformat(r["startTime"]) == timedelta(days=1)
               for r in body["records"])
    metadata = body["metadata"]
    assert (metadata["recordCount"], metadata["uniqueNetworkVolumeCount"]) == (len(body["records"]), 2)
    assert metadata["totals"]["totalAmount"] == pytest.approx(sum(r["totalAmount"] for r in body["records"]))


def test_the_volume_filter_narrows_the_records_to_that_volume(pod: TestClient) -> None:
    wanted, _ = create_volume(pod, 100), create_volume(pod, 200)
    advance(pod, 1)
    body = billing(pod, networkVolumeId=wanted)
    assert {r["networkVolumeId"] for r in body["records"]} == {wanted}
    assert body["metadata"]["query"]["networkVolumeId"] == wanted
    assert body["metadata"]["uniqueNetworkVolumeCount"] == 1


def test_an_unknown_volume_has_no_records(pod: TestClient) -> None:
    create_volume(pod, 100)
    assert billing(pod, networkVolumeId="nosuchvol1")["records"] == []


def test_the_billing_window_is_resolved_on_the_storage_clock(pod: TestClient) -> None:
    advance(pod, 40)
    body = billing(pod, bucketSize="day", lastN=1)
    tomorrow = datetime.now(UTC) + timedelta(days=41)  # the end of the storage clock's current day
    assert body["metadata"]["query"]["endTime"] == tomorrow.strftime("%Y-%m-%dT00:00:00Z")


def test_an_account_without_volumes_has_no_records_over_a_bucket_aligned_window(pod: TestClient) -> None:
    answer = pod.get("/v2/billing/network-volumes", params={"startTime": "2026-06-01T10:30:00Z",
                                                            "endTime": "2026-06-03T01:00:00Z"}, headers=AUTH)
    assert answer.status_code == 200 and SCHEMAS.errors("ListNetworkVolumeBillingResponse", answer.json()) == []
    assert answer.json()["records"] == []
    assert answer.json()["metadata"]["query"] == {"startTime": "2026-06-01T00:00:00Z",
                                                  "endTime": "2026-06-04T00:00:00Z", "bucketSize": "day",
                                                  "networkVolumeId": None}


@pytest.mark.parametrize(("params", "complaint"), [
    ({"lastN": "3", "startTime": "2026-06-01T00:00:00Z"}, "mutually exclusive"),
    ({"bucketSize": "fortnight"}, "BillingBucketSize"),
    ({"startTime": "2026-06-01"}, "time zone"),
    ({"lastN": "0"}, "lastN"),
])
def test_billing_queries_runpod_would_refuse_are_refused(pod: TestClient, params, complaint) -> None:
    body = assert_problem(pod.get("/v2/billing/network-volumes", params=params, headers=AUTH), 400)
    assert complaint in body["detail"]


def test_volume_billing_needs_the_account_key(pod: TestClient) -> None:
    assert_problem(pod.get("/v2/billing/network-volumes"), 401)


def test_a_route_fault_can_make_volume_billing_fail(pod: TestClient) -> None:
    pod.post("/_localpod/faults", json={"route": "network_volume_billing", "action": "status_500"}).raise_for_status()
    assert_problem(pod.get("/v2/billing/network-volumes", headers=AUTH), 500)
    billing(pod)  # the fault applied once


# --- the storage clock -------------------------------------------------------------------------------


def test_the_clock_says_how_far_it_was_advanced(pod: TestClient) -> None:
    assert pod.get("/_localpod/clock").json()["advanced_days"] == 0
    advance(pod, 2)
    reading = advance(pod, 0.5)
    assert reading["advanced_days"] == pytest.approx(2.5)
    now = datetime.fromisoformat(reading["now"])
    assert now - datetime.now(UTC) == pytest.approx(timedelta(days=2.5), abs=timedelta(minutes=1))


@pytest.mark.parametrize("body", [{"advance_days": 0}, {"advance_days": -1}, {"days": 1}])
def test_the_clock_never_goes_back_and_refuses_other_bodies(pod: TestClient, body: dict[str, Any]) -> None:
    assert_problem(pod.post("/_localpod/clock", json=body), 400)
    assert pod.get("/_localpod/clock").json()["advanced_days"] == 0


def test_advancing_the_clock_leaves_serverless_billing_on_real_time(pod: TestClient) -> None:
    advance(pod, 40)
    query = pod.get("/v2/billing/serverless", params={"lastN": 1}, headers=AUTH).json()["metadata"]["query"]
    assert query["endTime"] == (datetime.now(UTC) + timedelta(days=1)).strftime("%Y-%m-%dT00:00:00Z")
