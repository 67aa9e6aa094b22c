"""Every loraflow network volume on the account, what it costs by the month, and what retention does with it.

RunPod bills a network volume by the GB-month whether anything uses it or not, so the volumes flow
(`flows/volumes.py`) lists them all — this control plane's and other control planes' (another tag in the
name) — and deletes this control plane's volumes that no run or sweep used within the retention.

- **Last use**: the newest `loraflow.volume.used` event (`tasks/reports/events.py`), read like the heartbeats, one
  request for all volumes (no shared Variable is read-modify-written by the runs); else the newest
  `warmed_at` of the datacenter's weight-cache record.
- **Evidence of no use**: a Prefect server keeps events for `PREFECT_SERVER_EVENTS_RETENTION_PERIOD` (7 days
  by default). A volume without a use in the retention window is deleted only when the server's oldest
  event is older than that window (else a use before it cannot be seen, and the volume is kept, saying so).
- **Cost**: `GET /v2/billing/network-volumes` (the larger of the last two full days × 30) where it has
  figures for the volume, else RunPod's documented price (`tasks/placement/prices.py`); the row says which.
- **Never**: a volume an endpoint attaches, or another control plane's volume unless the request names its tag
  (`delete_namespaces`, `adopt_namespaces`) and confirms. RunPod documents no refusal to delete an attached volume
  (the endpoint would keep naming a volume that is gone, and no worker of it could start), so the account's
  endpoints, every control plane's, are listed again right before each delete: one that attached the volume since
  the inventory keeps it.

Plain functions over `RunpodClient` and a sync Prefect client; the Prefect tasks at the bottom wrap them.
"""

from __future__ import annotations

import logging
from collections.abc import Collection
from datetime import UTC, datetime, timedelta
from typing import Any, Literal

from prefect import get_client, get_run_logger, task
from prefect.cache_policies import NO_CACHE
from prefect.events.filters import (
    EventFilter,
    EventNameFilter,
    EventOccurredFilter,
    EventOrder,
    EventResourceFilter,
)
from pydantic import BaseModel, Field

from tasks.lifecycle.steps import retry_transient
from tasks.reports.events import VOLUME_RESOURCE, VOLUME_USED
from tasks.runpod.client import RunpodClient
from tasks.runpod.errors import RunpodError, is_transient
from tasks.runpod.live_catalog import read_retried
from tasks.runpod.models import Endpoint, NetworkVolume, NetworkVolumeBillingRecord
from tasks.runpod.volumes import VOLUME_PREFIX, delete_unattached_volume, parse_volume_name, volume_name
from tasks.settings import make_client
from tasks.placement.prices import DAYS_PER_MONTH, documented_usd_per_month
from tasks.placement.weight_cache import DataCenterCache, clear_cache, read_all_caches

log = logging.getLogger(__name__)

CostSource = Literal["billed", "documented price"]
Action = Literal["keep", "delete", "adopt", "clear-record"]

EVENTS_LOOKBACK = timedelta(days=365)
"""How far back use events are read: past any server's event retention, under the events API's bucket cap."""
BILLED_DAYS = 2
"""Full days of billing read for the monthly figure: the larger of them (a volume grown or made yesterday)."""


class VolumeRow(BaseModel):
    """One network volume as the volumes flow reports it, with what retention does to it."""

    volume_id: str
    name: str
    data_center: str
    namespace: str = Field(description="The control plane's tag in its name; `?` for a loraflow name without one.")
    ours: bool = Field(description="This control plane's volume (its tag is ours).")
    size_gb: int
    type: str | None = Field(default=None, description="STANDARD or HIGH_PERFORMANCE; None: RunPod did not say.")
    models: list[str] | None = Field(default=None, description="Models on it per our weight-cache record; None: "
                                     "unknown (another control plane's, or no record names it).")
    attached_to: list[str] = Field(default_factory=list, description="Names of the endpoints that attach it.")
    last_used: datetime | None = Field(default=None, description="Newest use seen (event, or the record's preload).")
    billed_since: datetime | None = Field(default=None, description="Start of its oldest billed day in the "
                                          "window read: it existed then (its age, as far as billing tells).")
    usd_per_month: float
    cost_source: CostSource
    action: Action = "keep"
    reason: str = ""
    result: str = ""

    def table_row(self) -> dict[str, Any]:
        return {"datacenter": self.data_center, "name": self.name, "volume id": self.volume_id, "namespace": self.namespace
                + (" (ours)" if self.ours else ""), "size GB": self.size_gb, "type": self.type or "",
                "models": "unknown" if self.models is None else ", ".join(self.models) or "none",
                "attached to": ", ".join(self.attached_to),
                "last used": self.last_used.strftime("%Y-%m-%d %H:%M UTC") if self.last_used else "never seen",
                "$/month": round(self.usd_per_month, 2), "cost source": self.cost_source,
                "action": self.action, "reason": self.reason, "result": self.result}


class RetentionRequest(BaseModel):
    """What the volumes flow is asked to do (the flow's parameter model carries the descriptions)."""

    retain_days: float
    dry_run: bool = False
    delete_namespaces: list[str] = Field(default_factory=list)
    adopt_namespaces: list[str] = Field(default_factory=list)
    confirm: bool = False


# Reading


def newest_volume_uses(client: Any, since: datetime, until: datetime) -> dict[str, datetime]:
    """Volume id → its newest `loraflow.volume.used` between `since` and `until`, in one request however many
    volumes (`POST /events/count-by/resource`: each group's `end_time` is its newest event, as
    `liveness.newest_heartbeats` reads heartbeats). `client`: a sync Prefect client."""
    event_filter = EventFilter(occurred=EventOccurredFilter(since=since, until=until),
                               event=EventNameFilter(name=[VOLUME_USED]),
                               resource=EventResourceFilter(id_prefix=[VOLUME_RESOURCE]))
    response = client.request("POST", "/events/count-by/{countable}", path_params={"countable": "resource"},
                              json={"filter": event_filter.model_dump(mode="json"), "time_unit": "day",
                                    "time_interval": 1.0})
    return {count["value"].removeprefix(VOLUME_RESOURCE): datetime.fromisoformat(count["end_time"])
            for count in response.json() if count["value"].startswith(VOLUME_RESOURCE)}


def events_horizon(client: Any, since: datetime, until: datetime) -> datetime | None:
    """When the oldest event the Prefect server still holds occurred (any event: the server trims them all
    at its retention); None when it holds none. Uses older than this cannot be seen."""
    oldest = client.read_events(EventFilter(occurred=EventOccurredFilter(since=since, until=until),
                                            order=EventOrder.ASC), limit=1).events
    return oldest[0].occurred if oldest else None


def billed_figures(client: RunpodClient, now: datetime, days: int
                   ) -> tuple[dict[str, float], dict[str, datetime]] | None:
    """From `GET /v2/billing/network-volumes`, daily buckets over the last `days` days: volume id → its monthly
    cost (the larger of the last `BILLED_DAYS` full days × 30, where billed above 0), and volume id → the start
    of its oldest billed day. None when billing cannot be read (a key without billing access, an answer of
    another shape): the documented price stands in."""
    midnight = now.astimezone(UTC).replace(hour=0, minute=0, second=0, microsecond=0)
    params = {"bucketSize": "day", "startTime": _rfc3339(midnight - timedelta(days=max(days, BILLED_DAYS))),
              "endTime": _rfc3339(midnight + timedelta(days=1))}
    try:
        records = read_retried(lambda: client.network_volume_billing(params),
                               "RunPod's network volume billing").records
    except (RunpodError, ValueError) as e:
        log.warning("Network volume billing could not be read (%s: %s): documented prices instead",
                    type(e).__name__, str(e)[:200])
        return None
    monthly: dict[str, float] = {}
    since: dict[str, datetime] = {}
    last_full = midnight - timedelta(days=BILLED_DAYS)
    for record in records:
        start, end = _parse_time(record.start_time), _parse_time(record.end_time)
        if record.total_amount > 0:
            since[record.network_volume_id] = min(since.get(record.network_volume_id, start), start)
        if _full_day(record, start, end, last_full, midnight):
            monthly[record.network_volume_id] = max(monthly.get(record.network_volume_id, 0.0),
                                                    record.total_amount * DAYS_PER_MONTH)
    return monthly, since


def _full_day(record: NetworkVolumeBillingRecord, start: datetime, end: datetime, last_full: datetime,
              midnight: datetime) -> bool:
    return record.total_amount > 0 and start >= last_full and end <= midnight and end - start >= timedelta(days=1)


def inventory(volumes: list[NetworkVolume], endpoints: list[Endpoint], records: dict[str, DataCenterCache],
              uses: dict[str, datetime], billed: tuple[dict[str, float], dict[str, datetime]] | None,
              namespace: str) -> list[VolumeRow]:
    """A row per loraflow volume (name starting `loraflow-cache-`), before any decision."""
    attached: dict[str, list[str]] = {}
    for endpoint in endpoints:
        for volume_id in endpoint.network_volumes:
            attached.setdefault(volume_id, []).append(endpoint.name)
    monthly, since = billed or ({}, {})
    by_volume = {record.volume_id: record for record in records.values()}
    rows = []
    for volume in volumes:
        if not volume.name.startswith(VOLUME_PREFIX):
            continue
        parsed = parse_volume_name(volume.name)
        tag = parsed.namespace if parsed else "?"
        record = by_volume.get(volume.id) if tag == namespace else None
        last_used = max((t for t in (uses.get(volume.id), record.last_warmed if record else None) if t), default=None)
        billed_usd = monthly.get(volume.id)
        rows.append(VolumeRow(
            volume_id=volume.id, name=volume.name, data_center=volume.data_center, namespace=tag,
            ours=tag == namespace, size_gb=volume.size, type=volume.type,
            models=sorted(record.models) if record else None, attached_to=attached.get(volume.id, []),
            last_used=last_used, billed_since=since.get(volume.id),
            usd_per_month=billed_usd if billed_usd is not None else documented_usd_per_month(volume.size, volume.type),
            cost_source="billed" if billed_usd is not None else "documented price"))
    return rows


# Deciding


def decide(rows: list[VolumeRow], records: dict[str, DataCenterCache], request: RetentionRequest, namespace: str,
           now: datetime, horizon: datetime | None) -> list[VolumeRow]:
    """What retention does to each volume (`action`, `reason`), plus a `clear-record` row for each record whose
    volume no longer exists. Pure: nothing is changed here."""
    named = set(request.delete_namespaces) | set(request.adopt_namespaces)
    if namespace in named:
        raise ValueError(f"delete_namespaces/adopt_namespaces name {namespace!r}, this control plane's own tag: its "
                         "volumes follow retain_days; remove it from the list")
    both = set(request.delete_namespaces) & set(request.adopt_namespaces)
    if both:
        raise ValueError(f"{', '.join(sorted(both))} is named in both delete_namespaces and adopt_namespaces: "
                         "name each tag in one of them")
    cutoff = now - timedelta(days=request.retain_days)
    ours_by_dc = {row.data_center for row in rows if row.ours}
    decided = [_decide_one(row, request, cutoff, horizon, ours_by_dc) for row in rows]
    existing = {row.volume_id for row in rows}
    for record in records.values():
        if record.volume_id not in existing:
            decided.append(VolumeRow(
                volume_id=record.volume_id, name="", data_center=record.data_center, namespace=namespace, ours=True,
                size_gb=record.volume_gb, models=sorted(record.models), usd_per_month=0.0,
                cost_source="documented price", action="clear-record",
                reason="the weight-cache record names a volume that no longer exists"))
    return decided


def _decide_one(row: VolumeRow, request: RetentionRequest, cutoff: datetime, horizon: datetime | None,
                ours_by_dc: Collection[str]) -> VolumeRow:
    def keep(reason: str) -> VolumeRow:
        return row.model_copy(update={"action": "keep", "reason": reason})

    if row.attached_to:
        return keep(f"attached to {', '.join(row.attached_to)}: an endpoint's workers mount it")
    if not row.ours:
        if row.namespace in request.delete_namespaces:
            return row.model_copy(update={"action": "delete", "reason": f"tag {row.namespace} is named in "
                                          "delete_namespaces"})
        if row.namespace in request.adopt_namespaces:
            if row.data_center in ours_by_dc:
                return keep(f"tag {row.namespace} is named in adopt_namespaces, but this control plane already has "
                            f"a volume in {row.data_center}: delete one of the two instead")
            return row.model_copy(update={"action": "adopt", "reason": f"tag {row.namespace} is named in "
                                          "adopt_namespaces: renamed to ours"})
        return keep(f"another control plane's (tag {row.namespace}): name it in delete_namespaces or "
                    "adopt_namespaces to act on it")
    if row.last_used is not None and row.last_used >= cutoff:
        return keep(f"used within {request.retain_days:g} days")
    if row.last_used is None and row.billed_since is not None and row.billed_since >= cutoff:
        return keep(f"made within {request.retain_days:g} days (billed since {row.billed_since:%Y-%m-%d})")
    if horizon is None or horizon > cutoff:
        seen = f"since {horizon:%Y-%m-%d %H:%M} UTC" if horizon else "none"
        return keep(f"no use seen, but the Prefect server's events reach back {seen}, less than retain_days "
                    f"({request.retain_days:g}): an older use cannot be seen (raise "
                    "PREFECT_SERVER_EVENTS_RETENTION_PERIOD above retain_days)")
    unused = "never used" if row.last_used is None else f"last used {row.last_used:%Y-%m-%d}"
    return row.model_copy(update={"action": "delete", "reason": f"{unused}: not used within "
                                  f"{request.retain_days:g} days" + ("" if row.models is not None else
                                                                     " (no weight-cache record: an orphan)")})


# Acting


def apply(client: RunpodClient, rows: list[VolumeRow], request: RetentionRequest, namespace: str,
          logger: logging.Logger | logging.LoggerAdapter = log) -> list[VolumeRow]:
    """Carry the decisions out (nothing when `dry_run`; nothing to another control plane's volumes without
    `confirm`), each row's `result` saying what happened. One volume's failure is its row's result, not the
    sweep's end."""
    done = []
    for row in rows:
        if row.action == "keep":
            done.append(row)
            continue
        if request.dry_run:
            done.append(row.model_copy(update={"result": f"dry run: would {row.action}"}))
            continue
        if not row.ours and not request.confirm:
            done.append(row.model_copy(update={"result": f"not done: {row.action} of another control plane's volume "
                                               f"(${row.usd_per_month:.2f}/month) needs confirm: true"}))
            continue
        try:
            result = _act(client, row, namespace)
        except VolumeAttached as e:
            logger.warning("Volume %s (%s, %s) kept: %s", row.volume_id, row.name, row.data_center, e)
            done.append(row.model_copy(update={"action": "keep", "attached_to": e.endpoints, "reason": str(e),
                                               "result": "kept: attached"}))
            continue
        except RunpodError as e:
            result = f"failed: {type(e).__name__}: {str(e)[:300]}" + (" (transient: the next run retries)"
                                                                      if is_transient(e) else "")
        logger.info("Volume %s (%s, %s): %s — %s", row.volume_id, row.name, row.data_center, row.action, result)
        done.append(row.model_copy(update={"result": result}))
    return done


class VolumeAttached(Exception):
    """An endpoint references the volume about to be deleted (it attached it since the inventory): it is kept."""

    def __init__(self, endpoints: list[str]):
        super().__init__(f"attached to {', '.join(endpoints)} when it was about to be deleted (attached since the "
                         "inventory was read): an endpoint's workers mount it")
        self.endpoints = endpoints


def _act(client: RunpodClient, row: VolumeRow, namespace: str) -> str:
    if row.action == "clear-record":
        return "record cleared" if clear_cache(row.data_center, row.volume_id) else "record already changed"
    if row.action == "adopt":
        client.rename_network_volume(row.volume_id, volume_name(row.data_center, namespace))
        # The models on it are unknown: the next preload sweep finds them cached and records them.
        return f"renamed {volume_name(row.data_center, namespace)}"
    if users := delete_unattached_volume(client, row.volume_id):
        raise VolumeAttached(users)
    if row.ours and row.models is not None:  # a record names it (an orphan has none to clear)
        clear_cache(row.data_center, row.volume_id)
        return "deleted with its record"
    return "deleted"


def totals(rows: list[VolumeRow]) -> str:
    """The total $/month line: what the volumes cost before, what the deletions saved, what is left."""
    volumes = [row for row in rows if row.action != "clear-record"]
    total = sum(row.usd_per_month for row in volumes)
    deleted = [row for row in volumes if row.action == "delete" and row.result.startswith("deleted")]
    saved = sum(row.usd_per_month for row in deleted)
    ours = sum(row.usd_per_month for row in volumes if row.ours and row not in deleted)
    return (f"{len(volumes)} loraflow volumes, ${total:.2f}/month; deleted {len(deleted)}, saving ${saved:.2f}/month; "
            f"left ${total - saved:.2f}/month (this control plane's: ${ours:.2f}/month)")


# Prefect tasks


@task(name="read-volumes", cache_policy=NO_CACHE, retries=3, retry_delay_seconds=[2, 10, 30],
      retry_condition_fn=retry_transient)
def read_volumes(namespace: str, retain_days: float) -> tuple[list[VolumeRow], dict[str, DataCenterCache],
                                                              datetime | None]:
    """The rows of every loraflow volume, the weight-cache records, and the events' horizon."""
    logger = get_run_logger()
    now = datetime.now(UTC)
    with make_client() as client:
        volumes, endpoints = client.list_network_volumes(), client.list_endpoints()
        billed = billed_figures(client, now, days=int(retain_days) + 2)
    records = read_all_caches(logger)
    with get_client(sync_client=True) as prefect:
        # `until` a little ahead: `occurred` is the sender's clock.
        uses = newest_volume_uses(prefect, now - EVENTS_LOOKBACK, now + timedelta(minutes=10))
        horizon = events_horizon(prefect, now - EVENTS_LOOKBACK, now + timedelta(minutes=10))
    return inventory(volumes, endpoints, records, uses, billed, namespace), records, horizon


@task(name="apply-retention", cache_policy=NO_CACHE)
def apply_retention(rows: list[VolumeRow], request: RetentionRequest, namespace: str) -> list[VolumeRow]:
    with make_client() as client:
        return apply(client, rows, request, namespace, get_run_logger())


def volume_monthly_cost(client: RunpodClient, volume_id: str, now: datetime | None = None
                        ) -> tuple[float, CostSource] | None:
    """One volume's $/month and where the figure comes from; None when the volume is not listed."""
    volume = next((v for v in client.list_network_volumes() if v.id == volume_id), None)
    if volume is None:
        return None
    billed = billed_figures(client, now or datetime.now(UTC), days=BILLED_DAYS)
    if billed is not None and volume_id in billed[0]:
        return billed[0][volume_id], "billed"
    return documented_usd_per_month(volume.size, volume.type), "documented price"


def _rfc3339(moment: datetime) -> str:
    return moment.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _parse_time(text: str) -> datetime:
    return datetime.fromisoformat(text.replace("Z", "+00:00"))
