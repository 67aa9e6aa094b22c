"""What is warm where: the record of the weight cache that the `preload` flow writes and training reads.

One Prefect Variable per datacenter, `loraflow-weight-cache-<datacenter>`, holding that datacenter's
volume and the models on it. A Variable lives in the Prefect server's database, so the record follows
the control plane (as its endpoint-name tag does); one per datacenter keeps each under Prefect's 5,000
character limit for a Variable's value.
"""

from __future__ import annotations

from datetime import UTC, datetime

from pydantic import BaseModel, Field

VARIABLE_PREFIX = "loraflow-weight-cache-"


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


def read_cache(data_center: str) -> DataCenterCache | None:
    """The datacenter's record, or None when nothing was preloaded there (or the record is unreadable)."""
    from prefect.variables import Variable

    value = Variable.get(variable_name(data_center), default=None)
    if not isinstance(value, dict):
        return None
    try:
        return DataCenterCache.model_validate(value)
    except ValueError:
        return None


def write_cache(cache: DataCenterCache) -> None:
    from prefect.variables import Variable

    Variable.set(variable_name(cache.data_center), cache.model_dump(mode="json"), overwrite=True)


def warm_data_centers(model_id: str, revision: str | None, data_centers: list[str]) -> list[DataCenterCache]:
    """The records of those datacenters whose volume holds the model at this revision, in the given order."""
    caches = (read_cache(dc) for dc in data_centers)
    return [cache for cache in caches if cache is not None and cache.holds(model_id, revision)]


def warm_cache_for(model_id: str, revision: str | None, in_stock: list[str]) -> DataCenterCache | None:
    """The first of the datacenters with stock of the run's GPU (`in_stock`, best stocked first) whose
    volume holds the model at its revision; None when there is none (the run goes cold)."""
    warm = warm_data_centers(model_id, revision, in_stock)
    return warm[0] if warm else None
