"""RunPod's billing arithmetic: what storage costs, the time buckets and windows of `/v2/billing/*`, and the
storage clock that tests move forward to see volumes' costs accrue.

Network volumes bill by size and time, whether used or not, at RunPod's documented prices: standard storage
$0.07 per GB-month for the first TB and $0.05 per GB-month above it; a month here is 30 days. RunPod bills
volumes hourly at that monthly rate; localpod bills to the second, so a test sees a cost after seconds.

Nothing here touches HTTP; `localpod/routes/billing.py` answers `/v2/billing/serverless` and
`/v2/billing/network-volumes` with it.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta

from pydantic import BaseModel, ConfigDict, Field

from localpod.problems import ProblemError

STANDARD_USD_PER_GB_MONTH = 0.07  # RunPod's storage docs: network volumes, $0.07/GB-month for the first 1 TB
STANDARD_ABOVE_1TB_USD_PER_GB_MONTH = 0.05  # ... and $0.05/GB-month for the storage beyond it
# RunPod's docs say only that high-performance storage "costs more"; no figure was found: twice standard stands in.
HIGH_PERFORMANCE_USD_PER_GB_MONTH = 0.14
GB_PER_TB = 1000  # RunPod's "first 1TB", read as 1,000 GB
SECONDS_PER_MONTH = 30 * 24 * 3600  # a billing month of 30 days

BILLING_WINDOW_DEFAULT = timedelta(days=30)  # RunPod: startTime "defaults to 30 days ago"
_FIXED_BUCKETS = {"hour": timedelta(hours=1), "day": timedelta(days=1), "week": timedelta(weeks=1)}


def volume_usd_per_month(volume_type: str, size_gb: int) -> float:
    """What a volume of this tier and size costs for a 30-day month."""
    if volume_type == "HIGH_PERFORMANCE":
        return size_gb * HIGH_PERFORMANCE_USD_PER_GB_MONTH
    return (min(size_gb, GB_PER_TB) * STANDARD_USD_PER_GB_MONTH
            + max(0, size_gb - GB_PER_TB) * STANDARD_ABOVE_1TB_USD_PER_GB_MONTH)


class ClockAdvance(BaseModel):
    """Body of `POST /_localpod/clock`: let storage time pass, so network volumes accrue their cost."""

    model_config = ConfigDict(extra="forbid")

    advance_days: float = Field(
        gt=0, le=3650,
        description="Days to move the storage clock forward (fractions allowed: 1/24 is an hour). Every network "
        "volume alive now is billed for them at its current size and tier; later creations, growths and deletions "
        "are recorded at the advanced time, and `/v2/billing/network-volumes` resolves its window (its default "
        "end, lastN) against it. Workers, jobs and `/v2/billing/serverless` keep real time. The clock never goes "
        "back.",
    )


class ClockReading(BaseModel):
    """What `POST`/`GET /_localpod/clock` answer."""

    now: datetime = Field(description="The storage clock's time now (UTC): real time plus what was advanced.")
    advanced_days: float = Field(description="Days advanced so far in all (0 for a fresh server).")


class StorageClock:
    """The time network volumes are billed by: real time plus what `/_localpod/clock` advanced."""

    def __init__(self) -> None:
        self.advanced_s = 0.0

    def now(self) -> float:
        return time.time() + self.advanced_s

    def advance(self, change: ClockAdvance) -> ClockReading:
        self.advanced_s += change.advance_days * 24 * 3600
        return self.reading()

    def reading(self) -> ClockReading:
        return ClockReading(now=datetime.fromtimestamp(self.now(), UTC), advanced_days=self.advanced_s / 86400)


# --- windows and buckets ----------------------------------------------------------------------------


def billing_window(
    start_text: str | None, end_text: str | None, last_n_text: str | None, size: str, now: datetime
) -> tuple[datetime, datetime]:
    """The window RunPod resolves: startTime snapped down and endTime snapped up to bucket boundaries
    (defaults: 30 days before `now`, `now`), or the lastN buckets ending with the current one."""
    try:
        if last_n_text is not None:
            if start_text is not None or end_text is not None:
                raise ProblemError(400, "lastN is mutually exclusive with startTime/endTime")
            current = floor_bucket(now, size)
            return step_bucket(current, size, 1 - positive_int(last_n_text, "lastN")), step_bucket(current, size)
        start = floor_bucket(_timestamp(start_text, "startTime") if start_text else now - BILLING_WINDOW_DEFAULT, size)
        end = _timestamp(end_text, "endTime") if end_text else now
        floor = floor_bucket(end, size)
        end = floor if floor == end else step_bucket(floor, size)
    except (OverflowError, ValueError) as e:  # a window reaching past the calendar's years
        raise ProblemError(400, f"billing window out of range: {e}") from e
    if start >= end:
        raise ProblemError(400, f"startTime {rfc3339(start)} is not before endTime {rfc3339(end)}")
    return start, end


def spread(began: float, ended: float, start: datetime, end: datetime, size: str) -> Iterator[tuple[datetime, float]]:
    """The seconds of [began, ended) (epoch seconds) that fall in each bucket of the window [start, end): (bucket
    start, seconds), for the buckets it touches."""
    lo = max(datetime.fromtimestamp(began, UTC), start)
    hi = min(datetime.fromtimestamp(ended, UTC), end)
    bucket = floor_bucket(lo, size)
    while bucket < hi:
        following = step_bucket(bucket, size)
        seconds = (min(hi, following) - max(lo, bucket)).total_seconds()
        if seconds > 0:
            yield bucket, seconds
        bucket = following


def floor_bucket(t: datetime, size: str) -> datetime:
    """The start of the bucket holding `t` (weeks start on Monday, UTC)."""
    t = t.replace(minute=0, second=0, microsecond=0)
    if size == "hour":
        return t
    t = t.replace(hour=0)
    if size == "day":
        return t
    if size == "week":
        return t - timedelta(days=t.weekday())
    t = t.replace(day=1)
    return t if size == "month" else t.replace(month=1)


def step_bucket(bucket: datetime, size: str, n: int = 1) -> datetime:
    """The start of the bucket `n` buckets after this one (before it, for a negative `n`)."""
    if size in _FIXED_BUCKETS:
        return bucket + n * _FIXED_BUCKETS[size]
    months = bucket.year * 12 + bucket.month - 1 + n * (12 if size == "year" else 1)
    return bucket.replace(year=months // 12, month=months % 12 + 1)


def rfc3339(t: datetime) -> str:
    return t.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _timestamp(text: str, name: str) -> datetime:
    try:
        value = datetime.fromisoformat(text)
    except ValueError:
        value = None
    if value is None or value.tzinfo is None:
        raise ProblemError(400, f"{name} must be an RFC 3339 date-time with a time zone, not {text!r}")
    return value.astimezone(UTC)


def positive_int(raw: str, name: str) -> int:
    """A query parameter that must be a whole number of at least 1; 400 naming it otherwise."""
    try:
        value = int(raw)
    except ValueError:
        value = 0
    if value < 1:
        raise ProblemError(400, f"{name} must be an integer of at least 1, not {raw!r}")
    return value
