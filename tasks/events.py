"""The events a run sends for automations to match: its endpoints' lives, its given-up attempts, its end.

| event | resource (`prefect.resource.id`) | when |
|---|---|---|
| `loraflow.endpoint.created` | `loraflow.endpoint.<endpoint id>` | an attempt's endpoint exists (made, or found by name) |
| `loraflow.endpoint.deleted` | `loraflow.endpoint.<endpoint id>` | its deletion is confirmed |
| `loraflow.attempt.given-up` | `loraflow.run.<flow run id>` | an attempt ended without stored results |
| `loraflow.run.finished` | `loraflow.run.<flow run id>` | the run ended: completed, failed or cancelled |

Every resource carries `prefect.resource.name` and `loraflow.*` labels that an automation's `match` can
test (labels, unlike payloads, are what Prefect's triggers match on): `loraflow.run-name`, and
`loraflow.status` on `loraflow.run.finished`, `loraflow.outcome` and `loraflow.retry` on
`loraflow.attempt.given-up`. Events about a run's endpoints name the run as a related resource (role
`run`); Prefect adds the flow run itself (and its flow, deployment and tags) when the event is sent from
inside it, so every event also shows on the flow run's page.

Sending never raises and returns quickly: Prefect's events worker sends in the background, and a lost
event is a missed notification, not a failed run. (`tasks/liveness.py` sends the endpoint heartbeat.)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal, TypeVar

from prefect.events import Event, emit_event

ENDPOINT_CREATED = "loraflow.endpoint.created"
ENDPOINT_DELETED = "loraflow.endpoint.deleted"
ATTEMPT_GIVEN_UP = "loraflow.attempt.given-up"
RUN_FINISHED = "loraflow.run.finished"
ENDPOINT_RESOURCE = "loraflow.endpoint."
RUN_RESOURCE = "loraflow.run."

RunStatus = Literal["completed", "failed", "cancelled"]

_T = TypeVar("_T")

# Event payloads are stored and shown; a worker's error can be long (tracebacks travel in the run's state).
_MAX_TEXT = 1000


def endpoint_created(endpoint_id: str, endpoint_name: str, run_id: str | None, *,
                     pools: list[str] | None = None) -> Event | None:
    """Send `loraflow.endpoint.created` for one of `run_id`'s endpoints (None: sent outside a run)."""
    return emit_event(event=ENDPOINT_CREATED, resource=_endpoint(endpoint_id, endpoint_name),
                      related=[_run(run_id, "run")] if run_id else None, payload={"gpu_pools": pools or []})


def endpoint_deleted(endpoint_id: str, endpoint_name: str | None, run_id: str | None) -> Event | None:
    """Send `loraflow.endpoint.deleted` once a deletion is confirmed. `run_id`, `endpoint_name`: None when
    the deleter does not know them (the reconciler deleting by id)."""
    return emit_event(event=ENDPOINT_DELETED, resource=_endpoint(endpoint_id, endpoint_name or endpoint_id),
                      related=[_run(run_id, "run")] if run_id else None)


def attempt_given_up(run_id: str, run_name: str, *, attempt: int, outcome: str, reason: str, retry: bool,
                     error: str | None = None, endpoint_id: str | None = None,
                     endpoint_name: str | None = None) -> Event | None:
    """Send `loraflow.attempt.given-up`: attempt `attempt` ended `outcome` (a `JobOutcome.kind`) without
    stored results; `reason` says why the run retries (`retry`) or stops."""
    resource = _run(run_id, None, run_name) | {"loraflow.outcome": outcome, "loraflow.retry": str(retry).lower()}
    related = [_endpoint(endpoint_id, endpoint_name or endpoint_id) | {"prefect.resource.role": "endpoint"}] \
        if endpoint_id else None
    return emit_event(event=ATTEMPT_GIVEN_UP, resource=resource, related=related,
                      payload={"attempt": attempt, "outcome": outcome, "reason": reason, "retry": retry,
                               "error": (error or "")[:_MAX_TEXT]})


def run_finished(run_id: str, run_name: str, *, status: RunStatus, attempts: int, cost_usd: float | None,
                 cost_ceiling_usd: float | None = None, message: str = "",
                 adapter_url: str | None = None) -> Event | None:
    """Send `loraflow.run.finished`. `cost_usd`: the estimate from the seconds the run's workers ran
    (None: unknown); `attempts`: the attempts started (0: refused before renting)."""
    payload: dict[str, Any] = {"status": status, "attempts": attempts, "cost_usd": cost_usd,
                               "cost_ceiling_usd": cost_ceiling_usd, "message": message[:_MAX_TEXT]}
    if adapter_url:
        payload["adapter_url"] = adapter_url
    return emit_event(event=RUN_FINISHED, resource=_run(run_id, None, run_name) | {"loraflow.status": status},
                      payload=payload)


@dataclass
class RunSpend:
    """What a run has spent so far, for its one `loraflow.run.finished`."""

    attempts: int = 0
    usd: float = 0.0
    ceiling_usd: float | None = None
    sent: bool = False

    def finish(self, run_id: str, run_name: str, status: RunStatus, value: _T, *, message: str = "",
               adapter_url: str | None = None) -> _T:
        """Send `loraflow.run.finished` (once: a later call sends nothing) and return `value`, so that a
        flow can `return spent.finish(..., its_result)`."""
        if not self.sent:
            self.sent = True
            run_finished(run_id, run_name, status=status, attempts=self.attempts, cost_usd=round(self.usd, 4),
                         cost_ceiling_usd=self.ceiling_usd, message=message, adapter_url=adapter_url)
        return value


def _endpoint(endpoint_id: str, name: str) -> dict[str, str]:
    return {"prefect.resource.id": f"{ENDPOINT_RESOURCE}{endpoint_id}", "prefect.resource.name": name}


def _run(run_id: str, role: str | None, name: str | None = None) -> dict[str, str]:
    resource = {"prefect.resource.id": f"{RUN_RESOURCE}{run_id}"}
    if name:
        resource |= {"prefect.resource.name": name, "loraflow.run-name": name}
    if role:
        resource["prefect.resource.role"] = role
    return resource
