"""Tearing a run's endpoints down, and what is kept when a delete cannot be confirmed.

- `delete_attempt_endpoints`: the flow body's `finally` (layer 1), through the `delete-endpoint` task.
  By id first, where only a 404 on GET proves absence; then by name, for a create that errored after
  RunPod acted.
- `UndeletedEndpoint`: the record an attempt leaves when its delete stays unconfirmed after every
  retry (`keep_undeleted_endpoint`). It names the endpoint and the slot lease kept for it (the slot is
  the endpoint: it is held until the endpoint is proved gone). `settle_undeleted_endpoint` retries the
  delete and frees both; the reconciler calls it for every record (`undeleted_endpoints`).
- `delete_run_endpoints_hook`: the crash/cancellation/failure hooks (layer 2). Prefect runs them in the
  process that reports the final state, possibly not the one that created the endpoints, so they find
  the run's endpoints by name.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from datetime import datetime, timezone

import httpx
from prefect import get_client
from prefect.client.schemas.actions import VariableCreate, VariableUpdate
from prefect.exceptions import ObjectAlreadyExists, ObjectNotFound
from pydantic import BaseModel, Field

from tasks.lifecycle.quota import UNDELETED_LEASE_SECONDS, release_slot_lease, renew_slot_lease, take_slot_lease
from tasks.runpod.client import RunpodClient
from tasks.runpod.endpoints import delete_endpoint_confirmed, delete_endpoints_named, run_endpoints
from tasks.runpod.errors import RunpodError
from tasks.settings import make_client

log = logging.getLogger("loraflow.teardown")

NAME_SETTLE_S = 10.0
"""With no endpoint id, the name is looked up twice this far apart: an endpoint made a moment ago may
not be listed yet, so one listing without it proves nothing."""
UNDELETED_VARIABLE_PREFIX = "undeleted-"
UNDELETED_TAG = "loraflow-undeleted-endpoint"


def delete_attempt_endpoints(client: RunpodClient, name: str, endpoint_id: str | None, *,
                             settle_s: float = NAME_SETTLE_S, sleep: Callable[[float], None] = time.sleep) -> list[str]:
    """Delete an attempt's endpoint, confirmed; returns the ids deleted (absent ones included).

    By id when the create returned one: DELETE, then a 404 on GET proves it gone. Then every endpoint
    listed under `name` (a create retried after an ambiguous error can have made one more). Without an
    id, the name is listed again after `settle_s`. Safe to call again; raises `RunpodError` while a
    deletion is unconfirmed.
    """
    deleted: list[str] = []
    if endpoint_id is not None:
        delete_endpoint_confirmed(client, endpoint_id)
        deleted.append(endpoint_id)
    deleted += [i for i in delete_endpoints_named(client, name) if i not in deleted]
    if endpoint_id is None:
        sleep(settle_s)
        deleted += [i for i in delete_endpoints_named(client, name) if i not in deleted]
    return deleted


class UndeletedEndpoint(BaseModel):
    """An attempt's endpoint whose delete was never confirmed, kept as the Prefect Variable
    `undeleted-<endpoint name>` (tag `loraflow-undeleted-endpoint`) holding this model as JSON."""

    endpoint_name: str = Field(description="The attempt's endpoint name (unique per run and attempt).")
    endpoint_id: str | None = Field(description="Its RunPod id; None when the create never returned one "
                                    "(then every endpoint of that name is deleted).")
    run_id: str = Field(description="The flow run that made it.")
    lease_id: str | None = Field(description="Lease of the `runpod-endpoints` slot held for the endpoint until it "
                                 "is proved gone; None when no slot could be taken (the limit was full).")
    lease_seconds: float = Field(default=UNDELETED_LEASE_SECONDS,
                                 description="The lease's duration: renew it within this, or the slot frees.")
    slots: int = Field(default=1, ge=1, description="Slots the lease holds: the endpoint's `workers.max` (1 but for "
                       "a serving endpoint).")
    recorded_at: datetime = Field(default_factory=lambda: datetime.now(timezone.utc))
    error: str = Field(description="Why the last delete was not confirmed.")

    @property
    def variable_name(self) -> str:
        return f"{UNDELETED_VARIABLE_PREFIX}{self.endpoint_name}"


def take_slot_for_undeleted(wait_s: float, slots: int = 1) -> str | None:
    """A lease of `slots` slots for an undeleted endpoint (`take_slot_lease`), or None when the limit stayed full
    for `wait_s` or the Prefect API could not be reached (the reconciler's sweep still finds the endpoint by name
    then)."""
    try:
        return take_slot_lease(wait_s, slots=slots)
    except httpx.HTTPError as e:
        log.error("Could not take a slot for an undeleted endpoint: %s", e)
        return None


def keep_undeleted_endpoint(record: UndeletedEndpoint, logger: logging.Logger | logging.LoggerAdapter = log) -> None:
    """Keep what an attempt leaves when its delete stays unconfirmed: a slot (taken now if the attempt
    could not take one while it still held its own: the limit was full, and its slot was given back a
    moment ago) and the record. Never raises for an unreachable Prefect API: it says so in the log."""
    if record.lease_id is None:
        record.lease_id = take_slot_for_undeleted(60.0, record.slots)
    try:
        keep_undeleted_record(record)
    except httpx.HTTPError as e:
        logger.error("Could not record undeleted endpoint %s: %s", record.endpoint_name, e)
    slot = f"a slot (lease {record.lease_id})" if record.lease_id else "no slot (the limit stayed full)"
    logger.error("Endpoint %s (%s) could not be confirmed deleted (%s); it keeps %s and is recorded as the Prefect "
                 "Variable %s for the reconciler", record.endpoint_name, record.endpoint_id or "id unknown",
                 record.error, slot, record.variable_name)


def keep_undeleted_record(record: UndeletedEndpoint) -> None:
    """Write (or overwrite) the record's Prefect Variable."""
    value = record.model_dump(mode="json")
    with get_client(sync_client=True) as client:
        try:
            client.create_variable(VariableCreate(name=record.variable_name, value=value, tags=[UNDELETED_TAG]))
        except ObjectAlreadyExists:
            client.update_variable(VariableUpdate(name=record.variable_name, value=value, tags=[UNDELETED_TAG]))


def undeleted_endpoints() -> list[UndeletedEndpoint]:
    """Every record still kept, oldest first."""
    with get_client(sync_client=True) as client:
        variables = client.read_variables()
    records = [UndeletedEndpoint.model_validate(v.value) for v in variables
               if v.name.startswith(UNDELETED_VARIABLE_PREFIX) and UNDELETED_TAG in (v.tags or [])]
    return sorted(records, key=lambda r: r.recorded_at)


def settle_undeleted_endpoint(client: RunpodClient, record: UndeletedEndpoint) -> bool:
    """Retry the record's delete. Confirmed: release its slot lease, drop the record, return True.
    Still unconfirmed: renew the lease, or take a new slot if it expired or there was none (the endpoint
    still counts against the quota), keep the record with the new error, return False. Safe to call
    again, and from any process; call it well within `lease_seconds` of the last call."""
    try:
        delete_attempt_endpoints(client, record.endpoint_name, record.endpoint_id, settle_s=0.0)
    except RunpodError as e:
        lease_id = record.lease_id
        if lease_id is None or not renew_slot_lease(lease_id, record.lease_seconds):
            lease_id = take_slot_for_undeleted(0.0, record.slots)
        keep_undeleted_record(record.model_copy(update={"error": str(e)[:500], "lease_id": lease_id}))
        return False
    if record.lease_id is not None:
        release_slot_lease(record.lease_id)
    with get_client(sync_client=True) as prefect:
        try:
            prefect.delete_variable_by_name(record.variable_name)
        except ObjectNotFound:
            pass
    return True


def delete_run_endpoints(run_id: str) -> list[str]:
    """Delete (confirmed) every endpoint of every attempt of the run; returns the ids deleted."""

    with make_client() as client:
        endpoints = run_endpoints(client, run_id)
        for endpoint in endpoints:
            delete_endpoint_confirmed(client, endpoint.id)
    return [e.id for e in endpoints]


RECONCILE_DEPLOYMENT = "reconcile/interval"


def delete_run_endpoints_hook(flow, flow_run, state) -> None:
    """A Prefect state hook. Its two steps are independent and neither raises: whatever stops the
    delete (RunPod, the Secret block, settings, a bug) is logged with its type and the reconcile flow,
    the next layer, is still started when its deployment exists."""
    try:
        deleted = delete_run_endpoints(str(flow_run.id))
        log.warning("Run %s ended %s: deleted its endpoints %s", flow_run.id, state.name, deleted or "(none left)")
    except Exception as e:  # noqa: BLE001 - a hook must not stop before start_reconcile
        log.error("Run %s ended %s and its endpoints could not be deleted (%s: %s); reconcile will retry",
                  flow_run.id, state.name, type(e).__name__, e)
    start_reconcile()


def start_reconcile() -> None:
    """Start the reconcile deployment now, without waiting for it; skipped when it is not deployed.
    Never raises: it runs inside Prefect's state hooks, and the interval schedule still runs reconcile."""
    from prefect.deployments import run_deployment

    try:
        run_deployment(RECONCILE_DEPLOYMENT, timeout=0, as_subflow=False)
    except ObjectNotFound:
        log.info("No %s deployment: the crash hook did the teardown alone", RECONCILE_DEPLOYMENT)
    except Exception as e:  # noqa: BLE001 - never raised into Prefect's hook machinery
        log.error("Could not start the %s deployment (%s: %s); its schedule will run it",
                  RECONCILE_DEPLOYMENT, type(e).__name__, e)
