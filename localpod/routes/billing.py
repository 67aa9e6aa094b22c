"""Control plane API v2: billing (`/v2/billing/serverless`, `/v2/billing/network-volumes`).

Serverless billing is computed from this server's own workers: each started worker's seconds × the serverless
price of the pool it was placed on × the endpoint's `gpu.count` (`gpuAmount`), or × its CPU flavor's serverless
price per vCPU × its vCPU count for a CPU endpoint (`cpuAmount`). Network volume billing is computed from each
volume's bill (`volumes.VolumeBill`): its size over time at its tier's price per GB-month (`billing.py`),
deleted volumes included, on the storage clock that `/_localpod/clock` moves forward. RunPod's billing can lag;
localpod's is immediate (a lag is the caller's to model).

Query parameters are checked as RunPod's schema states them, and every answer is checked against its response
schema before it leaves.
"""

from __future__ import annotations

import time
from collections import defaultdict
from datetime import UTC, datetime
from typing import Any

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse

from localpod.auth import require_api_key
from localpod.billing import SECONDS_PER_MONTH, billing_window, rfc3339, spread, step_bucket, volume_usd_per_month
from localpod.catalog import tables
from localpod.problems import ProblemError
from localpod.routes.faults import route_fault
from localpod.state.account import LocalpodState, get_state

router = APIRouter(prefix="/v2/billing", tags=["billing"], dependencies=[Depends(require_api_key)])


@router.get("/serverless")
async def serverless_billing(request: Request, state: LocalpodState = Depends(get_state)) -> JSONResponse:
    """`ListServerlessBillingResponse`: one record per endpoint per bucket it was billed in, within the
    bucket-aligned window (startTime/endTime, or the lastN buckets up to the current one)."""
    fault = await route_fault(request, "serverless_billing")
    size, start, end = _window(state, request, datetime.now(UTC))
    serverless_id = request.query_params.get("serverlessId")
    amounts = _serverless_amounts(state, start, end, size, serverless_id)
    records = [
        {"startTime": rfc3339(bucket), "endTime": rfc3339(step_bucket(bucket, size)), "serverlessId": endpoint_id,
         **_serverless_amounts_document(gpu, cpu)}
        for (bucket, endpoint_id), (gpu, cpu) in sorted(amounts.items())
    ]
    body = {
        "records": records,
        "metadata": {
            "query": {"startTime": rfc3339(start), "endTime": rfc3339(end), "bucketSize": size,
                      "serverlessId": serverless_id},
            "recordCount": len(records),
            "uniqueServerlessCount": len({endpoint_id for _, endpoint_id in amounts}),
            "totals": _serverless_amounts_document(sum(g for g, _ in amounts.values()),
                                                   sum(c for _, c in amounts.values())),
        },
    }
    fault.after_action()
    return _answer(state, "ListServerlessBillingResponse", body)


@router.get("/network-volumes")
async def network_volume_billing(request: Request, state: LocalpodState = Depends(get_state)) -> JSONResponse:
    """`ListNetworkVolumeBillingResponse` (RunPod's listNetworkVolumeBilling): one record per volume per bucket it
    existed in, within the bucket-aligned window resolved on the storage clock; `networkVolumeId` narrows it to one
    volume (a deleted one still has its records; an unknown id has none)."""
    fault = await route_fault(request, "network_volume_billing")
    now = state.storage_clock.now()
    size, start, end = _window(state, request, datetime.fromtimestamp(now, UTC))
    volume_id = request.query_params.get("networkVolumeId")
    amounts: dict[tuple[datetime, str], list[float]] = defaultdict(lambda: [0.0, 0.0])
    for bill in state.volumes.bills.values():
        if volume_id not in (None, bill.volume_id):
            continue
        tier = 1 if bill.type == "HIGH_PERFORMANCE" else 0
        for began, ended, gb in bill.spans(now):
            usd_per_second = volume_usd_per_month(bill.type, gb) / SECONDS_PER_MONTH
            for bucket, seconds in spread(began, ended, start, end, size):
                amounts[(bucket, bill.volume_id)][tier] += seconds * usd_per_second
    records = [
        {"startTime": rfc3339(bucket), "endTime": rfc3339(step_bucket(bucket, size)), "networkVolumeId": vid,
         **_storage_amounts_document(standard, high_performance)}
        for (bucket, vid), (standard, high_performance) in sorted(amounts.items())
    ]
    body = {
        "records": records,
        "metadata": {
            "query": {"startTime": rfc3339(start), "endTime": rfc3339(end), "bucketSize": size,
                      "networkVolumeId": volume_id},
            "recordCount": len(records),
            "uniqueNetworkVolumeCount": len({vid for _, vid in amounts}),
            "totals": _storage_amounts_document(sum(r["standardAmount"] for r in records),
                                                sum(r["highPerformanceAmount"] for r in records)),
        },
    }
    fault.after_action()
    return _answer(state, "ListNetworkVolumeBillingResponse", body)


def _window(state: LocalpodState, request: Request, now: datetime) -> tuple[str, datetime, datetime]:
    """bucketSize (default day) and the resolved window, from the query's startTime/endTime/lastN."""
    params = request.query_params
    size = params.get("bucketSize", "day")
    errors = state.schemas.errors("BillingBucketSize", size)
    if errors:
        raise ProblemError(400, f"query parameter bucketSize: {size!r} does not match BillingBucketSize", errors)
    start, end = billing_window(params.get("startTime"), params.get("endTime"), params.get("lastN"), size, now)
    return size, start, end


def _serverless_amounts(
    state: LocalpodState, start: datetime, end: datetime, size: str, serverless_id: str | None
) -> dict[tuple[datetime, str], tuple[float, float]]:
    """USD (GPU, CPU) per (bucket start, endpoint id). Only workers localpod started bill, as in the account's
    `billed_worker_seconds`; a pool without a serverless price bills nothing here."""
    amounts: dict[tuple[datetime, str], list[float]] = defaultdict(lambda: [0.0, 0.0])
    now = time.time()
    for worker in state.workers.values():
        placement = state.faults.placements.get(worker.id)
        if worker.process is None or placement is None or serverless_id not in (None, worker.endpoint_id):
            continue
        flavor = tables.cpu_type(placement.cpu_flavor_id or "")
        if flavor is not None:  # a CPU worker: the flavor's serverless price per vCPU, times its vCPUs
            kind, usd_per_hour = 1, flavor.serverless_usd_per_vcpu * (placement.vcpu_count or 0)
        else:
            rate = tables.POOL_SERVERLESS_USD_PER_HOUR.get(placement.pool or "")
            if rate is None:
                continue
            gpus = int((state.endpoints[worker.endpoint_id].spec.get("gpu") or {}).get("count", 1))
            kind, usd_per_hour = 0, rate * gpus
        for bucket, seconds in spread(worker.started_at, worker.ended_at or now, start, end, size):
            amounts[(bucket, worker.endpoint_id)][kind] += seconds * usd_per_hour / 3600
    return {key: (gpu, cpu) for key, (gpu, cpu) in amounts.items()}


def _serverless_amounts_document(gpu: float, cpu: float) -> dict[str, float]:
    """`ServerlessBillingAmounts`: localpod bills GPU and CPU time only (no disk or platform fee)."""
    return {"totalAmount": round(gpu + cpu, 6), "gpuAmount": round(gpu, 6), "cpuAmount": round(cpu, 6),
            "diskAmount": 0.0, "feeAmount": 0.0}


def _storage_amounts_document(standard: float, high_performance: float) -> dict[str, float]:
    """`NetworkVolumeBillingAmounts`."""
    return {"totalAmount": round(standard + high_performance, 6), "standardAmount": round(standard, 6),
            "highPerformanceAmount": round(high_performance, 6)}


def _answer(state: LocalpodState, schema: str, body: dict[str, Any]) -> JSONResponse:
    """The answer, once it matches RunPod's response schema: a mismatch is localpod's bug, answered 500."""
    errors = state.schemas.errors(schema, body)
    if errors:
        raise ProblemError(500, f"localpod built an answer that does not match {schema}", errors)
    return JSONResponse(body)
