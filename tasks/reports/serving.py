"""The serving endpoints on the account, as the `reconcile` and `volumes` reports list them: each one's age, its cost
so far (RunPod's billing) and its expiry, read from its name (`tasks/runpod/endpoints.py` `serving_endpoint_name`).

A serving endpoint bills while its workers run and idle, and holds `workers.max` of the account's worker quota for as
long as it lives: the reports show them beside the rest so that none is forgotten.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import UTC, datetime
from typing import Any

from prefect import task
from prefect.cache_policies import NO_CACHE
from pydantic import BaseModel, Field

from tasks.runpod.client import RunpodClient
from tasks.runpod.endpoints import parse_endpoint_name
from tasks.runpod.live_catalog import billed_usd
from tasks.runpod.models import Endpoint
from tasks.settings import make_client


class ServingEndpoint(BaseModel):
    """One serving endpoint of the account."""

    name: str
    endpoint_id: str
    control_plane: str = Field(description="`ours`, or the other control plane's tag in its name.")
    workers_max: int = Field(description="Its `workers.max`: what it holds of the account's worker quota.")
    age_minutes: float
    expires_at: datetime
    billed_usd: float | None = Field(description="What RunPod billed it since its creation; None: unreadable.")

    def table_row(self, now: datetime) -> dict[str, Any]:
        left = (self.expires_at - now).total_seconds() / 60
        return {"serving endpoint": self.name, "endpoint id": self.endpoint_id, "control plane": self.control_plane,
                "workers max": self.workers_max, "age (min)": round(self.age_minutes, 1),
                "expires": f"{self.expires_at:%Y-%m-%d %H:%M} UTC" + (" (past)" if left < 0 else f" (in {left:.0f} min)"),
                "billed $": "unknown" if self.billed_usd is None else round(self.billed_usd, 4)}


def serving_endpoints(client: RunpodClient, endpoints: Sequence[Endpoint], namespace: str,
                      now: datetime) -> list[ServingEndpoint]:
    """The serving endpoints among `endpoints`, of any control plane, each with its billed cost (one billing read
    each)."""
    found = []
    for endpoint in endpoints:
        parsed = parse_endpoint_name(endpoint.name)
        if parsed is None or parsed.expires_at is None:
            continue
        created = datetime.fromisoformat(endpoint.created_at.replace("Z", "+00:00"))
        billed = billed_usd(client, [endpoint.id], created)
        found.append(ServingEndpoint(
            name=endpoint.name, endpoint_id=endpoint.id, workers_max=endpoint.workers.max,
            control_plane="ours" if parsed.namespace == namespace else parsed.namespace,
            age_minutes=(now - created).total_seconds() / 60, expires_at=datetime.fromtimestamp(parsed.expires_at, UTC),
            billed_usd=billed.usd if billed is not None else None))
    return found


@task(name="read-serving-endpoints", cache_policy=NO_CACHE, retries=2, retry_delay_seconds=[5, 30])
def read_serving_endpoints(namespace: str, endpoints: list[Endpoint] | None = None) -> list[dict[str, Any]]:
    """The account's serving endpoints as table rows (`endpoints`: as listed already; None: listed here)."""
    now = datetime.now(UTC)
    with make_client() as client:
        listed = client.list_endpoints() if endpoints is None else endpoints
        return [row.table_row(now) for row in serving_endpoints(client, listed, namespace, now)]
