"""What a run may cost, decided before anything is rented, and what it was billed.

Prices come from RunPod's live catalog when it answers, else from loraflow's fallback list prices (RunPod's published
serverless rates, `tasks/runpod/catalog.py`); the ceiling and the budget error say which.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from datetime import UTC, datetime
from typing import Literal, Protocol

from loraflow_worker.contract import TrainingSettings
from prefect import get_run_logger, task
from prefect.cache_policies import NO_CACHE
from pydantic import BaseModel, Field

from tasks.runpod import errors
from tasks.runpod.catalog import GpuClass
from tasks.runpod.live_catalog import (
    PRICE_SOURCE_WORDS,
    BilledAmount,
    GpuOffer,
    PriceSource,
    billed_usd,
    gpu_offers,
    static_offer,
)
from tasks.settings import make_client


class Priced(Protocol):
    """A GPU with a price per GPU-hour: a `GpuOffer`, or a `GpuClass` at its static price."""

    @property
    def usd_per_hour(self) -> float: ...


def worst_case_cost_usd(gpus: Sequence[Priced], gpu_count: int, deadline_minutes: int) -> float:
    """The most the run can be billed: the dearest GPU of its fallback list, for the whole deadline.

    The worker stops at the deadline and the endpoint's execution timeout is set from it, so billed
    worker time cannot exceed it.
    """
    price = max(g.usd_per_hour for g in gpus)
    return round(price * gpu_count * deadline_minutes / 60.0, 2)


class CostCeiling(BaseModel):
    """The most a run can be billed, and the price it was worked out from."""

    usd: float = Field(description="Dearest GPU of the fallback list × GPUs × deadline, USD.")
    gpu: str = Field(description="The GPU class that sets the ceiling.")
    usd_per_hour: float = Field(description="Its price per GPU-hour, USD.")
    price_source: PriceSource = Field(description="Where that price came from.")

    def describe(self) -> str:
        return (f"${self.usd:.2f} ({self.gpu} at ${self.usd_per_hour:.2f}/GPU-hour, price source: "
                f"{PRICE_SOURCE_WORDS[self.price_source]})")


def cost_ceiling(offers: Sequence[GpuOffer], gpu_count: int, deadline_minutes: int) -> CostCeiling:
    """`worst_case_cost_usd` over the offers, naming the GPU and the price source that set it."""
    dearest = max(offers, key=lambda o: o.usd_per_hour)
    return CostCeiling(usd=worst_case_cost_usd(offers, gpu_count, deadline_minutes), gpu=dearest.gpu,
                       usd_per_hour=dearest.usd_per_hour, price_source=dearest.source)


def check_cost_cap(cost_usd: float, cap_usd: float | None, what: str = "the run",
                   fix: str = "lower deadline_minutes or pick a cheaper GPU") -> None:
    """Refuse `what` (a run, a study's child, a merge, a serve, a preload sweep) whose cost ceiling passes the
    operator's cap (`LORAFLOW_MAX_RUN_USD`), whatever its own budget says; `fix` names the fields that lower it."""
    if cap_usd is not None and cost_usd > cap_usd:
        raise ValueError(
            f"{what} may cost up to ${cost_usd:.2f}, above this server's cap of ${cap_usd:.2f} per run "
            f"(LORAFLOW_MAX_RUN_USD, set by its operator): {fix}, or ask the operator"
        )


def check_budget(cost_usd: float, budget_usd: float | None, price_source: PriceSource | None = None,
                 cap_usd: float | None = None) -> None:
    """Refuse a run whose ceiling passes its budget, or the operator's cap (`cap_usd`); the message names the price
    source when given."""
    check_cost_cap(cost_usd, cap_usd)
    if budget_usd is not None and cost_usd > budget_usd:
        source = f", price source: {PRICE_SOURCE_WORDS[price_source]}" if price_source else ""
        raise ValueError(
            f"the run may cost up to ${cost_usd:.2f} (GPU price × GPUs × deadline{source}), above budget_usd "
            f"${budget_usd:.2f}: lower deadline_minutes, pick a cheaper GPU, or raise budget_usd"
        )


def check_study_budget(ceilings: dict[str, CostCeiling], budget_usd: float | None,
                       cap_usd: float | None = None) -> None:
    """Refuse, before anything is rented, a study with a child (child name → its ceiling) that could never start: one
    whose ceiling alone passes the study's budget, or the operator's cap (`cap_usd`). The budget as a whole is kept
    as children start (`study_budget_decision`): a study may hold more children than its budget covers at their
    ceilings, as most end well below them."""
    for name, ceiling in ceilings.items():
        check_cost_cap(ceiling.usd, cap_usd, f"the study's child {name}")
    if budget_usd is None or not ceilings:
        return
    name, dearest = max(ceilings.items(), key=lambda item: item[1].usd)
    if dearest.usd > budget_usd:
        too_dear = sum(1 for c in ceilings.values() if c.usd > budget_usd)
        raise ValueError(
            f"{too_dear} of the study's {len(ceilings)} children may each cost more than study.budget_usd "
            f"${budget_usd:.2f} alone (GPU price × GPUs × deadline; the dearest, {name}: {dearest.describe()}), so "
            "they could never start: nothing was rented. Lower deadline_minutes, pick a cheaper GPU, or raise "
            "study.budget_usd"
        )


def study_spend_ceiling(children_ceilings_usd: Sequence[float], budget_usd: float | None) -> float:
    """The most a whole study can spend: its children's cost ceilings together, or its `study.budget_usd` where that
    is less (children start only while the budget has room for their ceilings: `study_budget_decision`)."""
    together = round(sum(children_ceilings_usd), 2)
    return together if budget_usd is None else min(together, budget_usd)


def check_study_cap(children_ceilings_usd: Sequence[float], budget_usd: float | None, cap_usd: float | None) -> None:
    """Refuse, before any child starts, a study whose whole spend (`study_spend_ceiling`) passes the operator's cap
    for a study (`LORAFLOW_MAX_STUDY_USD`): each child below `LORAFLOW_MAX_RUN_USD` is not enough when there are
    many of them."""
    if cap_usd is None:
        return
    spend = study_spend_ceiling(children_ceilings_usd, budget_usd)
    if spend <= cap_usd + 1e-9:
        return
    what = ("its study.budget_usd" if budget_usd is not None and spend >= budget_usd else
            f"its {len(children_ceilings_usd)} children's cost ceilings together, GPU price × GPUs × deadline each"
            + ("; it names no study.budget_usd" if budget_usd is None else ""))
    raise ValueError(
        f"the study may cost up to ${spend:.2f} ({what}), above this server's cap of ${cap_usd:.2f} per study "
        f"(LORAFLOW_MAX_STUDY_USD, set by its operator), so no child was started: set study.budget_usd to at most "
        f"${cap_usd:.2f} (children start only while it has room), run fewer children, or ask the operator"
    )


BudgetDecision = Literal["start", "wait", "skip"]


def study_budget_decision(budget_usd: float | None, spent_usd: float, running_ceilings_usd: Sequence[float],
                          ceiling_usd: float) -> tuple[BudgetDecision, str]:
    """Whether the study's next child may start now, and why not.

    `spent_usd`: what the children that ended cost (their `loraflow.run.finished`; a child whose cost is unknown
    counts at its ceiling); `running_ceilings_usd`: the ceilings of the children still running (or ended with their
    cost not yet read). The child starts when the spent, the running children's ceilings and its own ceiling fit the
    budget: then no combination of outcomes passes it. Otherwise it waits while any child runs (their real cost, below
    their ceilings, may leave room), and is skipped when none does (the room left is final)."""
    if budget_usd is None:
        return "start", ""
    committed = spent_usd + sum(running_ceilings_usd)
    if committed + ceiling_usd <= budget_usd + 1e-9:
        return "start", ""
    left = max(0.0, budget_usd - spent_usd)
    if running_ceilings_usd:
        return "wait", (f"waits for room in study.budget_usd ${budget_usd:.2f}: ${spent_usd:.2f} spent, "
                        f"{len(running_ceilings_usd)} running may cost up to ${sum(running_ceilings_usd):.2f}, its "
                        f"ceiling ${ceiling_usd:.2f}")
    return "skip", (f"study.budget_usd ${budget_usd:.2f} reached: ${spent_usd:.2f} spent by the children before it, "
                    f"${left:.2f} left, below its cost ceiling ${ceiling_usd:.2f}")


EVAL_COST_PER_EXAMPLE = {"sft": 1 / 3, "grpo": 1 / 2, "dpo": 1 / 3}
"""What evaluating one example costs next to training on one, roughly. SFT evaluates with a forward pass, about a
third of a training step's forward and backward; DPO too (a pair's forward through the adapter and the reference, a
third of its training's forward, backward and reference forward). GRPO evaluates by generating one completion per
prompt and trains on none of them; generation is most of a GRPO step, and training generates and trains on each
completion."""
EVAL_SHARE_WARNING = 0.25
"""An evaluation taking more than this share of the training's compute is probably a mistake: the flow warns."""


class EvaluationCost(BaseModel):
    """What a run's held-out evaluation adds to its work, estimated before renting. Evaluation runs inside the
    run's deadline, so the cost ceiling (GPU price × deadline) already bounds it: the estimate says how much of the
    deadline's training it takes."""

    evaluations: int = Field(description="Evaluations: before the first step, every N steps and after the last.")
    examples: int = Field(description="Examples evaluated each time (at most `max_samples`).")
    share: float = Field(description="Evaluation's compute as a share of the training's (0.1: 10% more work).")

    def describe(self) -> str:
        return (f"{self.evaluations} evaluations of {self.examples} examples, about {self.share:.0%} on top of the "
                "training's compute (inside the deadline, so inside the cost ceiling)")


def evaluation_cost(algorithm: str, training: TrainingSettings, *, every_steps: int, max_samples: int,
                    fraction: float | None, dataset_examples: int | None,
                    eval_file_examples: int | None) -> EvaluationCost | None:
    """A proportional estimate of a run's evaluation work (`EVAL_COST_PER_EXAMPLE` per example evaluated against one
    per example trained on). `dataset_examples` / `eval_file_examples`: the lines of a local dataset / evaluation
    file (None: a Hub dataset, or no evaluation file). None when the run's steps are not known before it runs
    (`training.epochs` over a Hub dataset)."""
    held_out = eval_file_examples  # held out of the dataset: none, with an evaluation file
    trained = dataset_examples
    if fraction is not None:
        # datasets' `train_test_split` rounds the held-out count up.
        held_out = math.ceil(dataset_examples * fraction) if dataset_examples is not None else None
        trained = dataset_examples - held_out if dataset_examples is not None else None
    examples = max_samples if held_out is None else min(max_samples, held_out)
    batch = training.batch_size * training.gradient_accumulation_steps
    steps = training.max_steps
    if steps is None and trained is not None:
        steps = max(1, math.ceil(training.epochs * trained / batch))
    if steps is None:
        return None
    # Before the first step, at every multiple of every_steps, and after the last unless that was a multiple.
    evaluations = 1 + steps // every_steps + (1 if steps % every_steps else 0)
    share = evaluations * examples * EVAL_COST_PER_EXAMPLE[algorithm] / (steps * batch)
    return EvaluationCost(evaluations=evaluations, examples=examples, share=round(share, 4))


@task(name="read-gpu-prices", cache_policy=NO_CACHE)
def read_gpu_prices(gpus: list[GpuClass], cuda_floors: list[str] | None = None, *, log: bool = True) -> list[GpuOffer]:
    """Each GPU's serverless price and hosts' CUDA versions from RunPod's live catalog, with its stock on hosts
    that meet its CUDA floor (given `cuda_floors`), or the static table where it cannot be read. Not retried as a
    task: the read itself is tried again on transient errors (`live_catalog.read_retried`), and the static table
    is the answer to a read that still fails."""
    logger = get_run_logger()
    try:
        client = make_client()
    except (RuntimeError, errors.AuthError) as e:  # no RunPod key where the flow runs (Settings / the client)
        offers = [static_offer(g, f"no RunPod client to read the catalog with: {e}") for g in gpus]
    else:
        with client:
            offers = gpu_offers(client, gpus, cuda_floors)
    for offer in offers if log else ():
        if offer.source == "catalog":
            floor = f" on hosts with CUDA >= {offer.cuda_floor}" if offer.cuda_floor else ""
            logger.info("%s: $%.2f/GPU-hour from RunPod's catalog; hosts run CUDA %s; stock%s in %s", offer.gpu,
                        offer.usd_per_hour, ", ".join(offer.cuda_versions) or "(none listed)", floor,
                        ", ".join(offer.in_stock_data_centers()) or "no datacenter now")
        else:
            logger.warning("%s: $%.2f/GPU-hour, the fallback list price, not the live catalog (%s)", offer.gpu,
                           offer.usd_per_hour, offer.fallback_reason)
    return offers


@task(name="read-billed-cost", cache_policy=NO_CACHE)
def read_billed_cost(endpoint_ids: list[str], since_epoch_s: float) -> BilledAmount | None:
    """What RunPod billed the run's endpoints since the run began; None when billing cannot be read."""
    try:
        client = make_client()
    except (RuntimeError, errors.AuthError):
        return None
    with client:
        return billed_usd(client, endpoint_ids, datetime.fromtimestamp(since_epoch_s, UTC))
