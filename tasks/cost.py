"""What a run may cost, decided before anything is rented."""

from __future__ import annotations

from tasks.runpod.catalog import GpuClass


def worst_case_cost_usd(gpus: list[GpuClass], gpu_count: int, deadline_minutes: int) -> float:
    """The most the run can be billed: the dearest GPU of its fallback list, for the whole deadline.

    The worker stops at the deadline and the endpoint's execution timeout is set from it, so billed
    worker time cannot exceed it.
    """
    price = max(g.usd_per_hour for g in gpus)
    return round(price * gpu_count * deadline_minutes / 60.0, 2)


def check_budget(cost_usd: float, budget_usd: float | None) -> None:
    if budget_usd is not None and cost_usd > budget_usd:
        raise ValueError(
            f"the run may cost up to ${cost_usd:.2f} (GPU price × GPUs × deadline), above budget_usd "
            f"${budget_usd:.2f}: lower deadline_minutes, pick a cheaper GPU, or raise budget_usd"
        )
