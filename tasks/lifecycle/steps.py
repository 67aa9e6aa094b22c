"""The RunPod steps of a run, as Prefect tasks: create the endpoint, submit the job, wait for it,
delete the endpoint. Each wraps a plain function from `endpoints.py` / `jobs.py` / `tasks/lifecycle/teardown.py`.

Retries of RunPod calls live here and only here: exponential backoff with jitter, and only for
transient failures (429, 5xx, transport errors, timeouts). `submit_job` is never retried: `/run` is not
idempotent. (The job watch tolerates transient errors in its own loop, for a time budget: a long poll
is not a call to retry from the start.)

Prefect runs these tasks even once the flow run is CANCELLING (3.x orchestrates task runs on the client
side), so the teardown below also runs after a cancel from the UI.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any

import httpx
from prefect import get_client, get_run_logger, task
from prefect.artifacts import create_progress_artifact, update_progress_artifact
from prefect.cache_policies import NO_CACHE
from prefect.client.orchestration import SyncPrefectClient
from prefect.exceptions import ObjectNotFound
from prefect.runtime import flow_run
from prefect.tasks import exponential_backoff

from tasks.lifecycle.liveness import beat
from tasks.lifecycle.secret_key import secret_name_key
from tasks.lifecycle.secret_retention import secret_used
from tasks.lifecycle.teardown import delete_attempt_endpoints
from tasks.lifecycle.worker_env import endpoint_env, run_secret_env
from tasks.placement.history import record_placement
from tasks.reports import events
from tasks.reports.summary import finished_description, progress_description
from tasks.runpod import errors
from tasks.runpod.endpoints import delete_endpoint_confirmed, ensure_endpoint
from tasks.runpod.jobs import JobOutcome, WatchLimits, watch_job
from tasks.runpod.models import CreateEndpoint, Endpoint, JobPolicy, JobStatus, RunRequest
from tasks.runpod.secrets import HUB_TOKEN_PURPOSE, referenced_secrets, value_secret_env
from tasks.settings import Settings, make_client

log = logging.getLogger("loraflow.steps")


def retry_transient(task: Any, task_run: Any, state: Any) -> bool:
    """Prefect `retry_condition_fn`: retry only the transient class; honour a 429's Retry-After."""
    exc = state.data if isinstance(state.data, BaseException) else None
    if not errors.is_transient(exc):
        return False
    if isinstance(exc, errors.RateLimitError) and exc.retry_after:
        time.sleep(min(exc.retry_after, 60.0))
    return True


_RETRIES = dict(
    retries=5,
    retry_delay_seconds=exponential_backoff(backoff_factor=2),
    retry_jitter_factor=0.5,
    retry_condition_fn=retry_transient,
    cache_policy=NO_CACHE,
)


@task(name="prepare-worker-env", **_RETRIES)
def prepare_worker_env(hub_token_secret: str | None = None, env: dict[str, str] | None = None,
                       secrets: dict[str, str] | None = None, token_env: str = "HF_TOKEN") -> dict[str, str]:
    """The env every endpoint of the run gets: the Hub's URL; `HF_TOKEN` (or `token_env`: RunPod's vLLM worker
    logs `HF_TOKEN` as `--hf-token`, so a serving endpoint gets `HUGGING_FACE_HUB_TOKEN`) as a reference to the
    RunPod account secret that holds the run's token (one secret per token, created here when missing, never
    changed), never the token itself; and the run's own variables (`worker.env`, as they are) and secrets
    (`worker.secrets`: ENV_NAME → Prefect Secret block, each value read here and referenced the same way,
    `tasks/lifecycle/worker_env.py`). The token is the one in the Prefect Secret block `hub_token_secret` names, else
    the flow's own (`Settings.hub_token`); with none, the workers get no token."""
    settings = Settings()
    logger = get_run_logger()
    token = settings.hub_token(hub_token_secret)
    sources = {env_name: f"the Secret block {block!r}" for env_name, block in (secrets or {}).items()}
    references: dict[str, str] = {}
    if secrets or token is not None:
        namespace = settings.control_plane_namespace()
        key = secret_name_key(namespace)
        with make_client(settings) as client:
            if secrets:
                references |= run_secret_env(client, secrets, namespace, key)
            if token is not None:
                references |= value_secret_env(client, token_env, token, purpose=HUB_TOKEN_PURPOSE,
                                               namespace=namespace, key=key)
                sources[token_env] = (f"the token in the Secret block {hub_token_secret!r}" if hub_token_secret
                                       else "this control plane's own token: the run names no hub_token_secret")
    if token is None:
        logger.info("No Hugging Face token: workers reach public models and file:// stores only")
    for env_name, reference in references.items():
        for name in referenced_secrets({env_name: reference}):
            secret_used(name, env_name=env_name)  # before any endpoint refers to it: pruning keeps it
            logger.info("Workers read %s (%s) from the RunPod account secret %s", env_name, sources[env_name], name)
    return endpoint_env(settings.worker_env() | (env or {}), references)


# Rented nothing yet and looked up by name first (each try is idempotent): a run rides out two and a half minutes of
# a flaky API here rather than fail on it (the chaos batches' api-storm under 12 % noise outlasted 5 retries).
_CREATE_RETRIES = _RETRIES | dict(retries=8, retry_delay_seconds=[2, 4, 8, 16, 30, 30, 30, 30])


@task(name="create-endpoint", **_CREATE_RETRIES)
def create_endpoint(request: CreateEndpoint) -> Endpoint:
    """Idempotent: returns the endpoint of this name if it already exists."""
    with make_client() as client:
        endpoint = ensure_endpoint(client, request)
    get_run_logger().info("Endpoint %s (%s) is up", endpoint.name, endpoint.id)
    events.endpoint_created(endpoint.id, endpoint.name, flow_run.id, pools=request.gpu.pools if request.gpu else [])
    return endpoint


@task(name="submit-job", cache_policy=NO_CACHE)
def submit_job(endpoint: Endpoint, job_input: dict[str, Any], policy: JobPolicy) -> str:
    """POST /run once. Not retried: a retried POST can start a second job on the same endpoint."""
    with make_client() as client:
        job = client.run(endpoint.id, RunRequest(input=job_input, policy=policy))
    get_run_logger().info("Submitted job %s to endpoint %s", job.id, endpoint.id)
    return job.id


@dataclass
class WatchedJob:
    """A job `wait_for_job` watched to its end: its outcome, and what `report_job_end` needs once the endpoint is
    deleted (the progress artifact, the evaluations already announced)."""

    outcome: JobOutcome
    artifact_id: Any
    evaluations: events.Evaluations
    run_name: str | None = None


@task(name="wait-for-job", cache_policy=NO_CACHE)
def wait_for_job(endpoint: Endpoint, job_id: str, limits: WatchLimits, *, poll_interval_s: float = 2.0,
                 progress_key: str | None = None, run_name: str | None = None) -> WatchedJob:
    """Poll the job to its end, mirroring the worker's progress into a progress artifact and the log,
    sending the endpoint's heartbeat event (`tasks/lifecycle/liveness.py`) the reconciler reads, and
    `loraflow.run.evaluated` for each held-out evaluation the worker reports (`run_name`: the run's, for the event's
    labels). What the completed job's result adds to both (its last evaluations, and each task and benchmark score)
    is left to `report_job_end`, after the endpoint's delete: nothing that can come after the delete lies between the
    job's end and it.

    Reads this flow run's state from the Prefect API as it goes: a cancel (UI, CLI or API) cancels the
    job here, whether a worker, `serve` or a plain `python -m flows.train` runs the flow.
    """
    logger = get_run_logger()
    heartbeat_s = Settings().loraflow_heartbeat_seconds
    artifact_id = create_progress_artifact(progress=0.0, key=progress_key, description="Training progress")
    last: dict[str, Any] = {"status": None, "progress": None, "logged": time.monotonic(), "error_logged": None,
                            "percent": 0.0, "shown": {}, "placement_reads": 0}
    evaluations = events.Evaluations()

    def announce(seen: list[events.Evaluation]) -> None:
        _announce(seen, run_name)

    def on_status(status: JobStatus) -> None:
        beat(endpoint, status.status, interval_s=heartbeat_s)  # the settings read once: polls come 10 a second
        # Where the job runs, once it runs (a few reads: the worker list can lag the job's status), for the
        # preload sweep's default datacenters (`tasks/placement/history.py`). `client`: the watch's, bound below.
        if status.running and 0 <= last["placement_reads"] < 3:
            last["placement_reads"] += 1
            if record_placement(client, endpoint, status.worker_id, flow_run.id) is not None:
                last["placement_reads"] = -1
        now = time.monotonic()
        last["error_logged"] = None
        progress = status.progress
        if status.status != last["status"]:
            logger.info("Job %s is %s", job_id, status.status)
            last.update(status=status.status, logged=now)
        if progress and progress != last["progress"]:
            last.update(progress=progress, logged=now)
            # An update carries what its stage knows (a `saving` one has no loss): the rest keeps its last value.
            last["shown"] = last["shown"] | {k: v for k, v in progress.items() if v is not None} \
                | {"message": progress.get("message", "")}
            step, total = last["shown"].get("step", 0), last["shown"].get("total_steps")
            line = progress_description(last["shown"])
            logger.info("%s", line)
            if total:
                last["percent"] = min(100.0, 100.0 * step / total)
            # The bar says how far; the description says how fast, how well and how long still.
            update_progress_artifact(artifact_id=artifact_id, progress=last["percent"], description=line)
            announce(evaluations.from_progress(progress))
        elif now - last["logged"] >= heartbeat_s:
            logger.info("Job %s still %s", job_id, status.status)
            last["logged"] = now

    def on_read_error(error: errors.RunpodError, unreadable_s: float) -> None:
        # The first error of a streak, then one line per heartbeat: the run stays visibly alive.
        beat(endpoint, interval_s=heartbeat_s)
        now = time.monotonic()
        if last["error_logged"] is None or now - last["error_logged"] >= heartbeat_s:
            logger.warning("Job %s: status unreadable for %.0f s (tolerated up to %.0f s): %s", job_id, unreadable_s,
                           limits.read_error_budget_s, error)
            last.update(error_logged=now, logged=now)

    with make_client() as client, get_client(sync_client=True) as prefect:
        outcome = watch_job(client, endpoint.id, job_id, limits, poll_interval_s=poll_interval_s, on_status=on_status,
                            on_read_error=on_read_error, cancel_requested=lambda: run_cancel_requested(prefect),
                            on_unknown_status=lambda name: logger.warning(
                                "Job %s: RunPod sent status %r, which loraflow does not know; treated as running "
                                "(the stall limits still apply)", job_id, name),
                            on_requeued=lambda times: logger.warning(
                                "Job %s went back to RunPod's queue after it had started (time %d: its worker was "
                                "lost): waiting on the same endpoint for another worker, which resumes from the last "
                                "checkpoint or returns the stored results", job_id, times))
    logger.info("Job %s ended: %s%s", job_id, outcome.kind, f" ({outcome.error})" if outcome.error else "")
    return WatchedJob(outcome=outcome, artifact_id=artifact_id, evaluations=evaluations, run_name=run_name)


def report_job_end(watched: WatchedJob) -> None:
    """After the endpoint's delete: a completed job's final progress line from its result's metrics (polls may miss
    the last updates of a short run), and `loraflow.run.evaluated` for the evaluations only its result shows and for
    each of its task and benchmark scores."""
    outcome = watched.outcome
    if outcome.kind != "completed":
        return
    update_progress_artifact(artifact_id=watched.artifact_id, progress=100.0,
                             description=finished_description(outcome.output))
    _announce(watched.evaluations.from_result(outcome.output), watched.run_name)
    for payload in events.score_payloads(outcome.output) if flow_run.id else []:
        events.run_scored(flow_run.id, watched.run_name, payload)


def _announce(seen: list[events.Evaluation], run_name: str | None) -> None:
    for evaluation in seen if flow_run.id else []:
        events.run_evaluated(flow_run.id, run_name, evaluation)


def run_cancel_requested(prefect: SyncPrefectClient | None = None) -> bool:
    """Whether this flow run has been asked to stop: its Prefect state is CANCELLING or CANCELLED.

    Runners and workers watch for that state and kill the process; a run started as a plain script has
    no such watcher, so the run asks for itself. Outside a flow run: False. A Prefect API that cannot
    be read counts as "not cancelled" (the next check asks again). Returns quickly.
    """
    if flow_run.id is None:
        return False
    try:
        if prefect is None:
            with get_client(sync_client=True) as client:
                state = client.read_flow_run(flow_run.id).state
        else:
            state = prefect.read_flow_run(flow_run.id).state
    except (httpx.HTTPError, ObjectNotFound) as e:
        log.warning("Could not read flow run %s's state to check for a cancel: %s", flow_run.id, e)
        return False
    return state is not None and (state.is_cancelling() or state.is_cancelled())


# A leaked endpoint bills and holds quota: deletes get a longer retry budget (~7 min) than other calls.
_DELETE_RETRIES = _RETRIES | dict(retries=10, retry_delay_seconds=[2, 4, 8, 16, 30, 60, 60, 60, 60, 60])


@task(name="delete-endpoint", **_DELETE_RETRIES)
def delete_endpoint(name: str, endpoint_id: str | None) -> list[str]:
    """Delete an attempt's endpoint: by id when known (a 404 on GET proves it gone), then any endpoint of
    this name (a create that errored may still have made one). Safe to call when absent. Raises while any
    deletion is unconfirmed (retried when transient)."""
    with make_client() as client:
        deleted = delete_attempt_endpoints(client, name, endpoint_id)
    get_run_logger().info("Deleted endpoint(s) %s named %s", deleted or "(none)", name)
    for deleted_id in deleted:
        events.endpoint_deleted(deleted_id, name, flow_run.id)
    return deleted


@task(name="delete-endpoint-by-id", **_RETRIES)
def delete_endpoint_by_id(endpoint_id: str) -> None:
    """Delete one endpoint, confirmed by a 404 on GET. Safe to call when absent."""
    with make_client() as client:
        delete_endpoint_confirmed(client, endpoint_id)
    events.endpoint_deleted(endpoint_id, None, None)
