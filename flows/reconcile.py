"""The `reconcile` flow: find this control plane's endpoints that no live run owns, and delete them.

The backstop for anything a crash left behind (a killed flow process, a lost server, a delete that
was never confirmed). Scheduled on an interval (`prefect.yaml`), also started by the train flow's
crash and cancellation hooks. Run it by hand, looking first:

    .venv/bin/python -m flows.reconcile '{"dry_run": true}'
    .venv/bin/python -m flows.reconcile '{"silent_after_minutes": 30}'

It judges only endpoints tagged with this control plane's namespace (`LORAFLOW_NAMESPACE`, or the
Prefect Variable `loraflow-namespace`); other control planes' endpoints on the same RunPod account
are listed in its report and never deleted. A `silent_after_minutes` below 3 × the heartbeat intervals
in force where it runs (LORAFLOW_HEARTBEAT_SECONDS, PREFECT_FLOWS_HEARTBEAT_FREQUENCY) is refused: the
flow fails before it reads or deletes anything.
"""

# No `from __future__ import annotations` here: Prefect builds the parameter model (the UI form) from
# the flow signature when it loads the entrypoint, and cannot resolve postponed annotations.
import sys
from datetime import datetime, timezone

from prefect import flow, get_run_logger
from prefect.artifacts import create_table_artifact
from pydantic import BaseModel, ConfigDict, Field

from tasks.lifecycle.liveness import intervals_in_force
from tasks.lifecycle.pending_billing import settle_billed_costs
from tasks.lifecycle.reconcile import (
    Finding,
    check_silence_threshold,
    decide,
    lookback_s,
    read_live_runs,
    read_loraflow_endpoints,
)
from tasks.lifecycle.secret_retention import prune_secrets
from tasks.lifecycle.steps import delete_endpoint_by_id
from tasks.lifecycle.teardown import settle_undeleted_endpoint, undeleted_endpoints
from tasks.reports.serving import read_serving_endpoints
from tasks.runpod.endpoints import parse_endpoint_name
from tasks.settings import Settings, make_client, startup_problem


class ReconcilePolicy(BaseModel):
    """What the `reconcile` flow deletes. Endpoints without loraflow's name prefix are never touched, nor those
    tagged with another control plane's namespace (`LORAFLOW_NAMESPACE` or the Prefect Variable
    `loraflow-namespace`)."""

    model_config = ConfigDict(extra="forbid")

    dry_run: bool = Field(default=False, description="Report what would be deleted, delete nothing.")
    silent_after_minutes: float = Field(
        default=10, ge=0.1, le=7 * 24 * 60,
        description="Delete the endpoints of a run that has sent no heartbeat event for this long, or for 3 × its "
        "own heartbeat interval if longer: its process is gone. A live run sends Prefect's flow-run heartbeat every "
        "PREFECT_FLOWS_HEARTBEAT_FREQUENCY (default 180 s) and, while it watches its job, loraflow's endpoint "
        "heartbeat every LORAFLOW_HEARTBEAT_SECONDS (default 60 s); logging settings change neither. A value below "
        "3 × the longer of the two where the reconcile runs (9 min with the defaults) is refused.",
    )
    idle_grace_minutes: int = Field(
        default=45, ge=5, le=7 * 24 * 60,
        description="Delete an endpoint older than this that has no queued or running job.",
    )
    min_age_minutes: float = Field(
        default=2, ge=0, le=24 * 60,
        description="Never delete an endpoint younger than this: its run may not have sent a heartbeat for it yet.",
    )
    secret_retain_days: float = Field(
        default=14, ge=7, le=3650,
        description="Delete this control plane's account secrets (one per distinct Hub token or run secret) that "
        "no endpoint refers to and no run used for this long; at least 7 days, a run's longest life. Another "
        "control plane's secrets are never touched.",
    )


@flow(name="reconcile", log_prints=True)
def reconcile(policy: ReconcilePolicy = ReconcilePolicy()) -> list[Finding]:
    """Delete our endpoints whose run is final, missing or silent, and endpoints idle past a grace.

    0. Refuse a silence threshold below 3 × the heartbeat intervals in force here, before anything else.
    1. Find this control plane's namespace: the tag in the names of the endpoints it may delete.
    2. List loraflow's endpoints (name prefix) and read the job counts of ours; a `/health` that fails
       is recorded in that endpoint's finding and the sweep goes on.
    3. Read every live flow run (all pages), the recently Crashed ones, and the newest heartbeat events of
       runs and endpoints.
    4. Decide per endpoint, each run judged by its own heartbeat interval; delete (confirmed) unless
       `dry_run`. Untagged endpoints and other control planes' are kept and reported. A serving endpoint is kept
       until the expiry its name carries, and deleted after.
    5. Retry the deletes runs could not confirm (each record holds a slot until its endpoint is proved gone).
    6. Fill in the billed cost of runs RunPod had not billed when they ended (`tasks/lifecycle/pending_billing.py`).
    7. Delete this control plane's account secrets unused for `secret_retain_days` and referred to by no
       endpoint (`tasks/lifecycle/secret_retention.py`).
    8. Report what was found and done as a table artifact, and the serving endpoints with their age, cost and
       expiry (`reconcile-serving`).
    """
    logger = get_run_logger()
    intervals = intervals_in_force()
    check_silence_threshold(policy.silent_after_minutes, intervals)
    namespace = Settings().control_plane_namespace()
    seen = read_loraflow_endpoints(namespace)
    silent_after_s = policy.silent_after_minutes * 60
    ours = [e.id for e in seen.endpoints
            if (parsed := parse_endpoint_name(e.name)) is not None and parsed.namespace == namespace]
    runs = read_live_runs(lookback_s=lookback_s(silent_after_s), endpoint_ids=ours, doubtful_after_s=silent_after_s)
    findings = decide(seen, runs, namespace, datetime.now(timezone.utc), silent_after_s=silent_after_s,
                      idle_grace_s=policy.idle_grace_minutes * 60, min_age_s=policy.min_age_minutes * 60,
                      intervals=intervals)
    for finding in findings:
        if finding.action == "keep":
            finding.result = "kept"
        elif policy.dry_run:
            finding.result = "would delete (dry run)"
        else:
            state = delete_endpoint_by_id(finding.endpoint_id, return_state=True)
            # An unconfirmed delete is reported, not raised: the next reconcile tries it again.
            finding.result = "deleted" if state.is_completed() else f"delete not confirmed: {state.message}"
        logger.info("%s %s: %s (%s%s)", finding.result, finding.name, finding.reason, finding.endpoint_id,
                    f"; jobs: {finding.jobs}" if finding.jobs else "")
    for record in undeleted_endpoints():
        if policy.dry_run:
            logger.info("would retry the unconfirmed delete of %s (run %s): %s", record.endpoint_name, record.run_id,
                        record.error)
            continue
        with make_client() as client:
            confirmed = settle_undeleted_endpoint(client, record)
        logger.info("%s %s (run %s)", "deleted, its slot freed:" if confirmed else "delete still not confirmed, slot kept:",
                    record.endpoint_name, record.run_id)
    # A run's billed figure is a report, not cleanup: a failure here is logged, and the next sweep tries again.
    settled, filled = settle_billed_costs(policy.dry_run, return_state=True), []
    if settled.is_completed():
        filled = [s for s in settled.result() if s.result == "filled in"]
    else:
        logger.warning("billed costs not settled this sweep: %s", settled.message)
    billing = f", billed cost filled in for {len(filled)} runs" if filled else ""
    # Secrets cost nothing while kept: a failure to prune is logged, and the next sweep tries again.
    pruned = prune_secrets(policy.secret_retain_days, policy.dry_run, return_state=True)
    if pruned.is_completed():
        gone = [v for v in pruned.result() if v.action in ("deleted", "would delete")]
        billing += f", {len(gone)} unused account secrets {'would be ' if policy.dry_run else ''}deleted" if gone else ""
    else:
        logger.warning("unused account secrets not pruned this sweep: %s", pruned.message)
    # Serving endpoints bill while idle and hold their workers.max of the quota: listed with age, cost and expiry.
    serving = read_serving_endpoints(namespace, seen.endpoints, return_state=True)
    if serving.is_completed() and serving.result():
        create_table_artifact(key="reconcile-serving", table=serving.result(),
                              description=f"Serving endpoints on the account, as control plane `{namespace}` sees them")
    create_table_artifact(
        key="reconcile-report",
        table=[f.model_dump(mode="json") for f in findings] or [{"result": "no loraflow endpoints found"}],
        description=f"Reconcile of control plane `{namespace}` at {datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC, "
        f"{sum(not r.crashed for r in runs.runs)} live runs{billing}" + (" (dry run)" if policy.dry_run else ""),
    )
    return findings


if __name__ == "__main__":
    if len(sys.argv) > 2:
        sys.exit("usage: python -m flows.reconcile ['{\"dry_run\": true}']")
    try:
        reconcile_policy = ReconcilePolicy.model_validate_json(sys.argv[1] if len(sys.argv) == 2 else "{}")
    except ValueError as e:  # pydantic's ValidationError is one
        sys.exit(f"bad reconcile policy: {e}")
    if problem := startup_problem():
        sys.exit(problem)
    final = reconcile(reconcile_policy, return_state=True)
    print(f"flow run {final.state_details.flow_run_id}: {final.name}", flush=True)
    sys.exit(0 if final.is_completed() else 1)
