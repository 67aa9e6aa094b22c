"""Billed cost settled later: runs that RunPod had not billed when they ended, and the reconciler filling
their figure in.

RunPod's billing (`GET /v2/billing/serverless`) lags behind its workers, so the read a run makes right
after deleting its endpoints may find nothing billed yet (or not be answered). The run's summary then
says "not billed yet; the reconciler fills this in" and the run sends `loraflow.run.billing-pending`
(`mark_billing_pending`). On each sweep the reconciler reads those events back (no run's artifact is read
until its billing is there), reads RunPod's billing for the run's endpoints, writes the figure into that
run's own summary artifact (found by its flow run id and key, updated in place: the key's other versions,
other runs', are left alone), and sends `loraflow.run.billing-settled`, so the next sweep skips the run.

| event | resource (`prefect.resource.id`) | payload |
|---|---|---|
| `loraflow.run.billing-pending` | `loraflow.run.<flow run id>` | `endpoint_ids`, `since` (ISO time), `summary_key` |
| `loraflow.run.billing-settled` | `loraflow.run.<flow run id>` | `billed_usd` |

Events, not a Variable: runs ending together never read-modify-write one shared record.
"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

from prefect import get_client, get_run_logger, task
from prefect.cache_policies import NO_CACHE
from prefect.client.schemas.actions import ArtifactUpdate
from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterFlowRunId, ArtifactFilterKey
from prefect.events import Event, emit_event
from prefect.events.filters import EventFilter, EventNameFilter, EventOccurredFilter, EventResourceFilter
from pydantic import BaseModel, Field, ValidationError

from tasks.reports.events import RUN_RESOURCE
from tasks.reports.summary import billed_later
from tasks.runpod import errors
from tasks.runpod.live_catalog import billed_usd
from tasks.settings import make_client

BILLING_PENDING = "loraflow.run.billing-pending"
BILLING_SETTLED = "loraflow.run.billing-settled"
SETTLE_WITHIN = timedelta(days=3)
"""How long after a run ended the reconciler keeps asking RunPod for its billed cost. RunPod does not document
how far its billing lags; a run still unbilled after this keeps "not billed yet" in its summary."""
_PAGE = 50  # the most events Prefect's server answers per page


class PendingBilling(BaseModel):
    """A run whose summary waits for RunPod's billed figure."""

    run_id: str = Field(description="Its flow run id.")
    run_name: str
    endpoint_ids: list[str] = Field(description="The endpoints it rented, whose billing makes its cost.")
    since: datetime = Field(description="When the run began: billing is read from there.")
    summary_key: str = Field(description="The key of its summary artifact.")


class Settlement(BaseModel):
    """What a sweep did about one pending run."""

    run_id: str
    run_name: str
    result: str = Field(description="`filled in`, `would fill in (dry run)`, or why not yet.")
    billed_usd: float | None = None


def mark_billing_pending(run_id: str, run_name: str, endpoint_ids: list[str], since_epoch_s: float,
                         summary_key: str) -> Event | None:
    """Send `loraflow.run.billing-pending` once the run's summary is published: its endpoints were billed
    nothing yet (or billing could not be read) since the run began at `since_epoch_s`. Never raises."""
    resource = {"prefect.resource.id": f"{RUN_RESOURCE}{run_id}", "prefect.resource.name": run_name,
                "loraflow.run-name": run_name}
    since = datetime.fromtimestamp(since_epoch_s, UTC).isoformat()
    return emit_event(event=BILLING_PENDING, resource=resource,
                      payload={"endpoint_ids": endpoint_ids, "since": since, "summary_key": summary_key})


def pending_billings(client: Any, since: datetime, until: datetime) -> list[PendingBilling]:
    """The runs marked pending between `since` and `until` and not settled since, oldest first. `client` is a
    sync Prefect client."""
    settled = {e.resource.id for e in _events(client, BILLING_SETTLED, since, until)}
    pending: dict[str, PendingBilling] = {}
    for event in _events(client, BILLING_PENDING, since, until):
        if event.resource.id in settled or event.resource.id in pending:
            continue
        try:
            pending[event.resource.id] = PendingBilling(
                run_id=event.resource.id.removeprefix(RUN_RESOURCE), run_name=event.resource.name or "",
                **event.payload)
        except ValidationError:
            continue  # not written by `mark_billing_pending`: nothing to settle it from
    return sorted(pending.values(), key=lambda p: p.since)


@task(name="settle-billed-costs", cache_policy=NO_CACHE)
def settle_billed_costs(dry_run: bool) -> list[Settlement]:
    """For each run pending within `SETTLE_WITHIN`: read what RunPod billed its endpoints and, once that is
    more than nothing, write it into the run's summary artifact (unless `dry_run`). A run RunPod still has not
    billed, or whose billing cannot be read, waits for the next sweep."""
    logger = get_run_logger()
    now = datetime.now(UTC)
    done = []
    with get_client(sync_client=True) as prefect:
        pending = pending_billings(prefect, now - SETTLE_WITHIN, now + timedelta(minutes=10))
        if not pending:
            return []
        try:
            runpod = make_client()
        except (RuntimeError, errors.AuthError) as e:  # no RunPod key here: the next sweep may have one
            logger.warning("%d runs wait for their billed cost, but RunPod cannot be asked: %s", len(pending), e)
            return [Settlement(run_id=p.run_id, run_name=p.run_name, result=f"RunPod not asked: {e}")
                    for p in pending]
        with runpod:
            for p in pending:
                settlement = Settlement(run_id=p.run_id, run_name=p.run_name, result="")
                done.append(settlement)
                billed = billed_usd(runpod, p.endpoint_ids, p.since)
                if billed is None or billed.usd <= 0:
                    settlement.result = "not billed yet" if billed else "billing could not be read"
                    continue
                settlement.billed_usd = billed.usd
                # The run's own version of the key: other runs of the same name publish under it too.
                summaries = prefect.read_artifacts(artifact_filter=ArtifactFilter(
                    flow_run_id=ArtifactFilterFlowRunId(any_=[p.run_id]), key=ArtifactFilterKey(any_=[p.summary_key])))
                summary = summaries[0] if summaries else None
                filled = None
                if summary is not None and isinstance(summary.data, str):
                    filled = billed_later(summary.data, billed.usd, now)
                if filled is None:
                    settlement.result = "no summary waiting for it" if summary else "its summary was not found"
                elif dry_run:
                    settlement.result = "would fill in (dry run)"
                    continue
                else:
                    prefect.update_artifact(summary.id, ArtifactUpdate(data=filled))
                    settlement.result = "filled in"
                if summary is not None:  # filled in now, or before by a sweep whose event was lost
                    emit_event(event=BILLING_SETTLED, resource={"prefect.resource.id": f"{RUN_RESOURCE}{p.run_id}",
                                                                "prefect.resource.name": p.run_name},
                               payload={"billed_usd": billed.usd})
    for s in done:
        logger.info("billed cost of run %s (%s): %s%s", s.run_name, s.run_id, s.result,
                    f", ${s.billed_usd:.4f}" if s.billed_usd is not None else "")
    return done


def _events(client: Any, name: str, since: datetime, until: datetime) -> list[Any]:
    event_filter = EventFilter(occurred=EventOccurredFilter(since=since, until=until),
                               event=EventNameFilter(name=[name]),
                               resource=EventResourceFilter(id_prefix=[RUN_RESOURCE]))
    page = client.read_events(event_filter, limit=_PAGE)
    found = list(page.events)
    while page.next_page:
        page = client.read_events_page(page.next_page)
        found.extend(page.events)
    return found
