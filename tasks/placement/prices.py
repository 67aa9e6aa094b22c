"""What a RunPod network volume costs by the month, from RunPod's documented prices: the fallback when
`GET /v2/billing/network-volumes` has no figures for a volume (a new one, billing lag, a key without billing
access). The one price table of loraflow's storage; the volumes flow and the run summary read it.

RunPod's storage docs (docs.runpod.io/serverless/storage/network-volumes, /pods/storage/types): a network
volume "is billed hourly at a rate of $0.07 per GB per month for the first 1TB, and $0.05 per GB per month
for additional storage beyond that", whether anything uses it or not.
"""

from __future__ import annotations

from typing import Literal

VolumeType = Literal["STANDARD", "HIGH_PERFORMANCE"]

STANDARD_USD_PER_GB_MONTH = 0.07
"""Standard network volume storage, the first 1 TB (RunPod's storage docs)."""
STANDARD_ABOVE_TB_USD_PER_GB_MONTH = 0.05
"""Standard network volume storage past the first 1 TB (RunPod's storage docs)."""
TB_GB = 1000
"""Where RunPod's lower rate starts: "the first 1TB"."""
HIGH_PERFORMANCE_USD_PER_GB_MONTH = 0.14
"""High-performance network volume storage. RunPod's docs say only that it costs more than standard; this
figure (twice standard) is an assumption, used until billing reports the volume's real figure."""

DAYS_PER_MONTH = 30
"""A billed day × 30 is the monthly figure (RunPod bills volumes hourly: every day of a month costs the same)."""


def documented_usd_per_month(size_gb: int, volume_type: str | None = "STANDARD") -> float:
    """The documented monthly price of a volume of `size_gb` GB of this type (None or unknown: standard,
    RunPod's default tier in most datacenters)."""
    if volume_type == "HIGH_PERFORMANCE":
        return round(size_gb * HIGH_PERFORMANCE_USD_PER_GB_MONTH, 2)
    first, rest = min(size_gb, TB_GB), max(size_gb - TB_GB, 0)
    return round(first * STANDARD_USD_PER_GB_MONTH + rest * STANDARD_ABOVE_TB_USD_PER_GB_MONTH, 2)
