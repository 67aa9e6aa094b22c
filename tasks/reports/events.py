"""The events a run sends for automations to match: its endpoints' lives, its given-up attempts, its end.

| event | resource (`prefect.resource.id`) | when |
|---|---|---|
| `loraflow.endpoint.created` | `loraflow.endpoint.<endpoint id>` | an attempt's endpoint exists (made, or found by name) |
| `loraflow.endpoint.deleted` | `loraflow.endpoint.<endpoint id>` | its deletion is confirmed |
| `loraflow.attempt.given-up` | `loraflow.run.<flow run id>` | an attempt ended without stored results |
| `loraflow.run.evaluated` | `loraflow.run.<flow run id>` | an attempt's worker evaluated held-out rows or scored a task; an evaluate run scored an adapter |
| `loraflow.run.finished` | `loraflow.run.<flow run id>` | the run ended: completed, failed or cancelled |
| `loraflow.volume.used` | `loraflow.volume.<volume id>` | a run attached a warm volume, or a preload sweep used one |
| `loraflow.run.placed` | `loraflow.data-center.<datacenter id>` | a training run's worker started its job there |
| `loraflow.study.finished` | `loraflow.study.<flow run id>` | a study ended: its children compared, the best named |

Every resource carries `prefect.resource.name` and `loraflow.*` labels that an automation's `match` can
test (labels, unlike payloads, are what Prefect's triggers match on): `loraflow.run-name`, and
`loraflow.status` on `loraflow.run.finished`, `loraflow.outcome` and `loraflow.retry` on
`loraflow.attempt.given-up`. Events about a run's endpoints name the run as a related resource (role
`run`); Prefect adds the flow run itself (and its flow, deployment and tags) when the event is sent from
inside it, so every event also shows on the flow run's page.

Sending never raises and returns quickly: Prefect's events worker sends in the background, and a lost
event is a missed notification, not a failed run. (`tasks/lifecycle/liveness.py` sends the endpoint heartbeat;
`tasks/storage/volume_inventory.py` reads the volume uses back for retention; `tasks/placement/history.py` reads the
placements back, for the preload sweep's default datacenters.)
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal, TypeVar

from loraflow_worker.contract import EVAL_METRICS, PROGRESS_EVAL_FIELDS, JobResult, TrainMetrics
from pydantic import ValidationError
from prefect.events import Event, emit_event

ENDPOINT_CREATED = "loraflow.endpoint.created"
ENDPOINT_DELETED = "loraflow.endpoint.deleted"
ATTEMPT_GIVEN_UP = "loraflow.attempt.given-up"
RUN_FINISHED = "loraflow.run.finished"
RUN_EVALUATED = "loraflow.run.evaluated"
VOLUME_USED = "loraflow.volume.used"
RUN_PLACED = "loraflow.run.placed"
STUDY_FINISHED = "loraflow.study.finished"
ENDPOINT_RESOURCE = "loraflow.endpoint."
RUN_RESOURCE = "loraflow.run."
STUDY_RESOURCE = "loraflow.study."
VOLUME_RESOURCE = "loraflow.volume."
DATA_CENTER_RESOURCE = "loraflow.data-center."

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


@dataclass
class Evaluation:
    """One held-out evaluation of a run: its step (of `total_steps`, when known) and the metrics, by their names in
    `metrics.json` (`eval_loss`, `eval_reward`, `eval_reward_accuracies`, `eval_reward_margins`)."""

    step: int
    values: dict[str, float]
    total_steps: int | None = None


def run_evaluated(run_id: str, run_name: str | None, evaluation: Evaluation) -> Event | None:
    """Send `loraflow.run.evaluated`: the run's worker evaluated on the held-out examples; the payload holds `step`,
    `total_steps` and each metric by its name."""
    return emit_event(event=RUN_EVALUATED, resource=_run(run_id, None, run_name),
                      payload={"step": evaluation.step, "total_steps": evaluation.total_steps} | evaluation.values)


def score_payloads(output: Any) -> list[dict[str, Any]]:
    """Each task and benchmark score of a completed job's result (`JobResult`), as its `loraflow.run.evaluated`
    payload: `metric` (`task:<task>/<grader>`, `benchmark:<task>/<metric>`, as `study.metric` names it), `kind`
    (`task`, `benchmark`), `task`, `base`, `adapter`, `delta` with their standard errors, `n`, and a task's `grader`
    and `failed` or a benchmark's `harness_metric` and `higher_is_better`."""
    try:
        metrics = JobResult.model_validate(output).metrics
    except ValidationError:
        return []
    payloads = [{"metric": s.metric, "kind": "task"} | s.model_dump() for s in metrics.task_scores]
    payloads += [{"kind": "benchmark"} | s.model_dump(exclude={"metric"}) | {"metric": s.name,
                                                                              "harness_metric": s.metric}
                 for s in metrics.benchmark_scores]
    return payloads


def adapter_score_payloads(result: Any) -> list[dict[str, Any]]:
    """Each adapter's task and benchmark scores of an evaluate job's result (`EvaluateResult`), as `score_payloads`
    gives a run's, each with the adapter's `label`."""
    payloads = []
    for adapter in result.adapters:
        payloads += [{"metric": s.metric, "kind": "task", "label": adapter.label} | s.model_dump()
                     for s in adapter.task_scores]
        payloads += [{"kind": "benchmark", "label": adapter.label} | s.model_dump(exclude={"metric"})
                     | {"metric": s.name, "harness_metric": s.metric} for s in adapter.benchmark_scores]
    return payloads


def run_scored(run_id: str, run_name: str | None, payload: dict[str, Any]) -> Event | None:
    """Send `loraflow.run.evaluated` for one task or benchmark score (`score_payloads`)."""
    resource = _run(run_id, None, run_name) | {"loraflow.metric": payload["metric"]}
    return emit_event(event=RUN_EVALUATED, resource=resource, payload=payload)


@dataclass
class Evaluations:
    """The evaluations one attempt's watch has seen, each handed out once (to be sent as `loraflow.run.evaluated`):
    as the worker's progress shows them (`Progress.eval_step` names the step of the values it carries), and, when the
    job completed, those of its result that no progress showed (two evaluations between two polls, a short run's
    last ones), leaving out those before the checkpoint the attempt resumed from (an earlier attempt's)."""

    seen: set[int] = field(default_factory=set)

    def from_progress(self, progress: dict[str, Any]) -> list[Evaluation]:
        """The new evaluation a worker progress update (`Progress`, as a dict) shows, if any."""
        step = progress.get("eval_step")
        values = {metric: float(progress[name]) for name, metric in PROGRESS_EVAL_FIELDS.items()
                  if isinstance(progress.get(name), (int, float))}
        total = progress.get("total_steps")
        if not isinstance(step, int) or not values:
            return []
        return self._new([Evaluation(step, values, total if isinstance(total, int) else None)])

    def from_result(self, output: Any) -> list[Evaluation]:
        """The evaluations of a completed job's result (`JobResult`) that no progress update showed."""
        try:
            result = JobResult.model_validate(output)
        except ValidationError:
            return []  # the run is judged by what its store holds, not by this
        metrics = result.metrics
        by_step: dict[int, dict[str, float]] = {}
        for metric in EVAL_METRICS:
            for step, value in getattr(metrics, metric):
                by_step.setdefault(step, {})[metric] = value
        total = metrics.early_stopping.total_steps if metrics.early_stopping else metrics.steps
        return self._new([Evaluation(step, values, total) for step, values in sorted(by_step.items())
                          if step >= result.resumed_from_step])

    def _new(self, evaluations: list[Evaluation]) -> list[Evaluation]:
        new = [evaluation for evaluation in evaluations if evaluation.step not in self.seen]
        self.seen.update(evaluation.step for evaluation in new)
        return new


def run_finished(run_id: str, run_name: str, *, status: RunStatus, attempts: int, cost_usd: float | None,
                 cost_ceiling_usd: float | None = None, message: str = "",
                 adapter_url: str | None = None, published_model: str | None = None,
                 publish_error: str | None = None, metrics: TrainMetrics | None = None,
                 merged_model: str | None = None, merge_error: str | None = None) -> Event | None:
    """Send `loraflow.run.finished`. `cost_usd`: the estimate from the seconds the run's workers ran
    (None: unknown); `attempts`: the attempts started (0: refused before renting). `published_model`: the Hub
    model repo the adapter was published to (`[publish]`), with `publish_error` when that failed. `metrics`: a
    completed run's, whose last values the payload carries as `final_metrics`. `merged_model`: the Hub model repo
    of the base with the adapter merged (`publish.merged_model_id`), with `merge_error` when the merge failed."""
    payload: dict[str, Any] = {"status": status, "attempts": attempts, "cost_usd": cost_usd,
                               "cost_ceiling_usd": cost_ceiling_usd, "message": message[:_MAX_TEXT]}
    if adapter_url:
        payload["adapter_url"] = adapter_url
    if metrics is not None:
        payload["final_metrics"] = final_metrics(metrics)
    if published_model:
        payload["published_model"] = published_model
    if publish_error:
        payload["publish_error"] = publish_error[:_MAX_TEXT]
    if merged_model:
        payload["merged_model"] = merged_model
    if merge_error:
        payload["merge_error"] = merge_error[:_MAX_TEXT]
    return emit_event(event=RUN_FINISHED, resource=_run(run_id, None, run_name) | {"loraflow.status": status},
                      payload=payload)


def volume_used(volume_id: str, volume_name: str, data_center: str, *, by: str,
                run_id: str | None) -> Event | None:
    """Send `loraflow.volume.used`: `by` (`train`, `preload`) used the network volume now. The volumes flow
    reads the newest per volume (`tasks/storage/volume_inventory.py`, `newest_volume_uses`) to delete volumes no run
    or sweep used within the retention: an event, not a Variable, so that concurrent users never
    read-modify-write one shared record. `run_id`: the flow run that used it (None: unknown)."""
    resource = {"prefect.resource.id": f"{VOLUME_RESOURCE}{volume_id}", "prefect.resource.name": volume_name,
                "loraflow.data-center": data_center, "loraflow.used-by": by}
    return emit_event(event=VOLUME_USED, resource=resource,
                      related=[_run(run_id, "run")] if run_id else None,
                      payload={"data_center": data_center, "by": by})


def run_placed(run_id: str | None, data_center: str, *, endpoint_id: str, endpoint_name: str,
               gpu_type: str | None = None) -> Event | None:
    """Send `loraflow.run.placed`: a training run's worker runs its job in `data_center` (RunPod's
    `/v2/serverless/{id}/workers` said so). The resource is the datacenter, so that where this control
    plane's training ran is read back per datacenter in one request (`tasks/placement/history.py`)."""
    resource = {"prefect.resource.id": f"{DATA_CENTER_RESOURCE}{data_center}", "prefect.resource.name": data_center}
    related = [_endpoint(endpoint_id, endpoint_name) | {"prefect.resource.role": "endpoint"}]
    if run_id:
        related.append(_run(run_id, "run"))
    return emit_event(event=RUN_PLACED, resource=resource, related=related,
                      payload={"data_center": data_center, "gpu_type": gpu_type})


def final_metrics(metrics: TrainMetrics) -> dict[str, float | int]:
    """A completed run's last values, for automations to test: `steps`, and those the run logged of `loss`, `reward`
    (GRPO), `eval_loss` (SFT with evaluation) and `eval_reward` (GRPO with evaluation), and the adapter's score of
    each task and benchmark by its metric's name (`task:<task>/<grader>`, `benchmark:<task>/<metric>`)."""
    last = {"loss": metrics.final_loss, "reward": metrics.rewards[-1][1] if metrics.rewards else None,
            "eval_loss": metrics.eval_loss[-1][1] if metrics.eval_loss else None,
            "eval_reward": metrics.eval_reward[-1][1] if metrics.eval_reward else None}
    scores = {s.metric: s.adapter for s in metrics.task_scores} | {s.name: s.adapter for s in metrics.benchmark_scores}
    return {"steps": metrics.steps} | {name: value for name, value in last.items() if value is not None} | scores


@dataclass
class RunSpend:
    """What a run has spent so far, for its one `loraflow.run.finished`."""

    attempts: int = 0
    usd: float = 0.0
    ceiling_usd: float | None = None
    sent: bool = False
    clock: Callable[[], float] = time.monotonic
    _attempt: tuple[float, float] | None = None  # the attempt in progress: when it began (`clock`), USD per second

    def attempt_began(self, usd_per_hour: float) -> None:
        """An attempt rents its endpoint now, at `usd_per_hour` (its GPUs' price)."""
        self._attempt = (self.clock(), usd_per_hour / 3600)

    def attempt_ended(self, usd: float) -> None:
        """The attempt ended, having cost `usd` (its worker's running seconds × the price)."""
        self._attempt = None
        self.usd += usd

    def finish(self, run_id: str, run_name: str, status: RunStatus, value: _T, *, message: str = "",
               adapter_url: str | None = None, published_model: str | None = None,
               publish_error: str | None = None, metrics: TrainMetrics | None = None,
               merged_model: str | None = None, merge_error: str | None = None) -> _T:
        """Send `loraflow.run.finished` (once: a later call sends nothing) and return `value`, so that a
        flow can `return spent.finish(..., its_result)`."""
        if not self.sent:
            self.sent = True
            if self._attempt is not None:
                # Stopped within an attempt (its process told to stop: a cancel on a worker, a study pruning it):
                # the attempt's time so far at its price, more than its worker ran (the create is in it), never less.
                began, usd_per_s = self._attempt
                self.attempt_ended((self.clock() - began) * usd_per_s)
            run_finished(run_id, run_name, status=status, attempts=self.attempts, cost_usd=round(self.usd, 4),
                         cost_ceiling_usd=self.ceiling_usd, message=message, adapter_url=adapter_url,
                         published_model=published_model, publish_error=publish_error, metrics=metrics,
                         merged_model=merged_model, merge_error=merge_error)
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


def study_finished(study_run_id: str, study_name: str, *, status: RunStatus, report: Any) -> Event | None:
    """Send `loraflow.study.finished`: the study ended `status` (`completed` when any child completed). `report`: its
    `StudyReport` (tasks/reports/study.py); the payload carries the children's counts by state, the best child (its
    name, values, metric, adapter) and the summed cost and ceilings."""
    states: dict[str, int] = {}
    for row in report.rows:
        states[row.state] = states.get(row.state, 0) + 1
    best = report.best
    payload: dict[str, Any] = {
        "status": status, "children": len(report.rows), "states": states, "metric": report.metric,
        "cost_usd": report.cost_usd, "cost_ceiling_usd": report.cost_ceiling_usd, "budget_usd": report.budget_usd,
        "best": {"name": best.name, "values": best.values, "metric": best.metric, "flow_run_id": best.flow_run_id,
                 "adapter_url": best.adapter_url} if best is not None else None,
    }
    if report.published:
        payload["published_model"] = report.published
    if report.merged:
        payload["merged_model"] = report.merged
    resource = {"prefect.resource.id": f"{STUDY_RESOURCE}{study_run_id}", "prefect.resource.name": study_name,
                "loraflow.study-name": study_name, "loraflow.status": status}
    return emit_event(event=STUDY_FINISHED, resource=resource, payload=payload)
