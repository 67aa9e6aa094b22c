"""What is warm where: the record of the weight cache that the `preload` flow writes and training reads.

One Prefect Variable per datacenter, `loraflow-weight-cache-<datacenter>`, holding that datacenter's
volume and the models on it. A Variable lives in the Prefect server's database, so the record follows
the control plane (as its endpoint-name tag does); one per datacenter keeps each under Prefect's 5,000
character limit for a Variable's value.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Collection, Mapping
from datetime import UTC, datetime

from pydantic import BaseModel, Field, ValidationError

VARIABLE_PREFIX = "loraflow-weight-cache-"

log = logging.getLogger(__name__)


class WarmVolumeGone(Exception):
    """RunPod refused an endpoint for its warm volume, and the volume no longer exists: the attempt goes cold."""

    def __init__(self, volume_id: str, refusal: str):
        super().__init__(f"network volume {volume_id} is gone (RunPod refused the endpoint: {refusal[:300]})")
        self.volume_id = volume_id


class WarmModel(BaseModel):
    revision: str = Field(description="The commit on the volume.")
    size_bytes: int = Field(ge=0, description="Bytes of the model's kept files.")
    warmed_at: datetime = Field(description="When a preload last found or put it there.")


class DataCenterCache(BaseModel):
    """One datacenter's weight cache."""

    data_center: str
    volume_id: str = Field(description="The network volume that holds the Hub cache.")
    volume_gb: int
    models: dict[str, WarmModel] = Field(default_factory=dict, description="Hub model id → what is on the volume.")

    def holds(self, model_id: str, revision: str | None) -> bool:
        warm = self.models.get(model_id)
        return warm is not None and (revision is None or warm.revision == revision)

    @property
    def last_warmed(self) -> datetime | None:
        """When a preload last found or put a model there: a use of the volume older than any event may tell."""
        return max((m.warmed_at for m in self.models.values()), default=None)


def gone_volume(refusal: Exception, volume_ids: list[str] | None,
                exists: Callable[[str], bool]) -> WarmVolumeGone | None:
    """RunPod's refusal (4xx) of an endpoint that attaches a warm volume, read as "the volume is gone" when
    `exists` says it no longer does; None for any other refusal (the quota, auth, a volume still there), which
    stands as the error. `refusal`: a `tasks.runpod.errors` exception."""
    from tasks.runpod.errors import BadRequestError, NotFoundError, QuotaExceededError

    if not volume_ids or not isinstance(refusal, BadRequestError | NotFoundError) \
            or isinstance(refusal, QuotaExceededError) or exists(volume_ids[0]):
        return None
    return WarmVolumeGone(volume_ids[0], str(refusal))


def variable_name(data_center: str) -> str:
    # Prefect Variable names: lowercase letters, digits, dashes and underscores.
    return f"{VARIABLE_PREFIX}{data_center.lower()}"


def record_preload(previous: DataCenterCache | None, data_center: str, volume_id: str, volume_gb: int,
                   warm: dict[str, tuple[str, int]], now: datetime | None = None) -> DataCenterCache:
    """The datacenter's record after a preload found or put `warm` (model id → (revision, bytes)) on the
    volume. Models it did not touch stay as they were; a new volume forgets the old one's models."""
    now = now or datetime.now(UTC)
    models = dict(previous.models) if previous is not None and previous.volume_id == volume_id else {}
    models |= {model_id: WarmModel(revision=revision, size_bytes=size, warmed_at=now)
               for model_id, (revision, size) in warm.items()}
    return DataCenterCache(data_center=data_center, volume_id=volume_id, volume_gb=volume_gb, models=models)


def read_cache(data_center: str, logger: logging.Logger | logging.LoggerAdapter = log) -> DataCenterCache | None:
    """The datacenter's record, or None when nothing was preloaded there. Never raises: a record that cannot
    be read (the Prefect API failing, a value that is not a record) is a warning and None, so a run goes cold
    rather than failing over a hint."""
    from prefect.variables import Variable

    name = variable_name(data_center)
    try:
        value = Variable.get(name, default=None)
    except Exception as e:  # noqa: BLE001 - any failure to read a hint means "not warm"
        logger.warning("The weight-cache record %s could not be read (%s: %s): treating %s as cold", name,
                       type(e).__name__, str(e)[:200], data_center)
        return None
    return parse_cache(name, value, logger)


def parse_cache(name: str, value: object, logger: logging.Logger | logging.LoggerAdapter = log
                ) -> DataCenterCache | None:
    """A Variable's value as a record; None, with a warning naming the Variable, when it is not one."""
    if value is None:
        return None
    try:
        return DataCenterCache.model_validate(value)
    except ValidationError as e:
        logger.warning("The Prefect Variable %s does not hold a weight-cache record (%s): ignored, its datacenter "
                       "is cold until a preload writes it again", name, str(e).splitlines()[0][:200])
        return None


def read_all_caches(logger: logging.Logger | logging.LoggerAdapter = log) -> dict[str, DataCenterCache]:
    """Every datacenter's record on this Prefect server (datacenter → record), in one request."""
    from prefect import get_client

    with get_client(sync_client=True) as client:
        response = client.request("POST", "/variables/filter", json={
            "variables": {"name": {"like_": VARIABLE_PREFIX}}, "limit": None})
    caches = (parse_cache(v["name"], v.get("value"), logger) for v in response.json()
              if v["name"].startswith(VARIABLE_PREFIX))
    return {cache.data_center: cache for cache in caches if cache is not None}


def write_cache(cache: DataCenterCache) -> None:
    from prefect.variables import Variable

    Variable.set(variable_name(cache.data_center), cache.model_dump(mode="json"), overwrite=True)


def clear_cache(data_center: str, volume_id: str | None = None) -> bool:
    """Delete the datacenter's record: its volume is gone or deleted. With `volume_id`, only a record that
    still names that volume (a sweep may have written a new one meanwhile). True when a record was deleted."""
    from prefect.variables import Variable

    if volume_id is not None:
        current = read_cache(data_center)
        if current is None or current.volume_id != volume_id:
            return False
    return Variable.unset(variable_name(data_center))


def warm_data_centers(model_id: str, revision: str | None, data_centers: list[str],
                      logger: logging.Logger | logging.LoggerAdapter = log,
                      records: Mapping[str, DataCenterCache] | None = None) -> list[DataCenterCache]:
    """The records of those datacenters whose volume holds the model at this revision, in the given order: read
    in one request (a GPU in stock in many datacenters would cost one each), or taken from `records` (datacenter →
    record, as `read_all_caches` read them a moment ago). Never raises: records that cannot be read are a warning
    and none (a run goes cold rather than failing over a hint)."""
    try:
        caches = read_all_caches(logger) if records is None else records
    except Exception as e:  # noqa: BLE001 - any failure to read a hint means "not warm"
        logger.warning("The weight-cache records could not be read (%s: %s): treating every datacenter as cold",
                       type(e).__name__, str(e)[:200])
        return []
    return [caches[dc] for dc in data_centers if dc in caches and caches[dc].holds(model_id, revision)]


def warm_cache_for(model_id: str, revision: str | None, in_stock: list[str],
                   existing_volumes: Callable[[], Collection[str] | None] | None = None,
                   logger: logging.Logger | logging.LoggerAdapter = log,
                   records: Mapping[str, DataCenterCache] | None = None) -> DataCenterCache | None:
    """The first of the datacenters with stock of the run's GPU (`in_stock`, best stocked first) whose
    volume holds the model at its revision; None when there is none (the run goes cold).

    `existing_volumes`: called once, only when a record is found, for the ids of the volumes that exist now
    (None: unknown, trust the records). A record whose volume is gone (deleted by hand, or by the volumes
    flow) is cleared and skipped, with a warning: a record is a hint, never a requirement. `records`: as
    `warm_data_centers` takes them."""
    warm = warm_data_centers(model_id, revision, in_stock, logger, records)
    if not warm or existing_volumes is None:
        return warm[0] if warm else None
    existing = existing_volumes()
    for cache in warm:
        if existing is None or cache.volume_id in existing:
            return cache
        logger.warning("The weight-cache record of %s names network volume %s, which no longer exists: record "
                       "cleared, not warm there", cache.data_center, cache.volume_id)
        forget(cache, logger)
    return None


def forget(cache: DataCenterCache, logger: logging.Logger | logging.LoggerAdapter = log) -> None:
    """Clear a record whose volume is gone; a failure to clear is a warning (the next reader checks again)."""
    try:
        clear_cache(cache.data_center, cache.volume_id)
    except Exception as e:  # noqa: BLE001 - the record stays a stale hint, which every reader checks
        logger.warning("The weight-cache record of %s could not be cleared (%s: %s)", cache.data_center,
                       type(e).__name__, str(e)[:200])
