"""The `reconcile` flow: find this control plane's endpoints that no live run owns, and delete them.

The backstop for anything a crash left behind (a killed flow process, a lost server, a delete that
was never confirmed). Scheduled on an interval (`prefect.yaml`), also started by the train flow's
crash and cancellation hooks. Run it by hand, looking first:

    .venv/bin/python -m flows.reconcile '{"dry_run": true}'
    .venv/bin/python -m flows.reconcile '{"silent_after_minutes": 30}'

It judges only endpoints tagged with this control plane's namespace (`LORAFLOW_NAMESPACE`, or the
Prefect Variable `loraflow-namespace`); other control planes' endpoints on the same RunPod account
are listed in its report and never deleted.
"""

# No `from __future__ import annotations` here: Prefect builds the parameter model (the UI form) from
# the flow signature when it loads the entrypoint, and cannot resolve postponed annotations.
import sys
from datetime import datetime, timezone

from prefect import flow, get_run_logger
from prefect.artifacts import create_table_artifact

from flows.spec import ReconcilePolicy
from tasks.reconcile import Finding, decide, read_live_runs, read_loraflow_endpoints
from tasks.runpod.steps import delete_endpoint_by_id, make_client
from tasks.settings import Settings
from tasks.teardown import settle_undeleted_endpoint, undeleted_endpoints


@flow(name="reconcile", log_prints=True)
def reconcile(policy: ReconcilePolicy = ReconcilePolicy()) -> list[Finding]:
    """Delete our endpoints whose run is final, missing or silent, and endpoints idle past a grace.

    1. Find this control plane's namespace: the tag in the names of the endpoints it may delete.
    2. List loraflow's endpoints (name prefix) and read the job counts of ours; a `/health` that fails
       is recorded in that endpoint's finding and the sweep goes on.
    3. Read every live flow run (all pages) and the newest heartbeat events of runs and endpoints.
    4. Decide per endpoint; delete (confirmed) unless `dry_run`. Untagged endpoints and other control
       planes' are kept and reported.
    5. Retry the deletes runs could not confirm (each record holds a slot until its endpoint is proved gone).
    6. Report what was found and done as a table artifact.
    """
    logger = get_run_logger()
    namespace = Settings().control_plane_namespace()
    seen = read_loraflow_endpoints(namespace)
    silent_after_s = policy.silent_after_minutes * 60
    runs = read_live_runs(lookback_s=2 * silent_after_s)
    findings = decide(seen, runs, namespace, datetime.now(timezone.utc), silent_after_s=silent_after_s,
                      idle_grace_s=policy.idle_grace_minutes * 60, min_age_s=policy.min_age_minutes * 60)
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
    create_table_artifact(
        key="reconcile-report",
        table=[f.model_dump() for f in findings] or [{"result": "no loraflow endpoints found"}],
        description=f"Reconcile of control plane `{namespace}` at {datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC, "
        f"{len(runs.runs)} live runs" + (" (dry run)" if policy.dry_run else ""),
    )
    return findings


if __name__ == "__main__":
    reconcile(ReconcilePolicy.model_validate_json(sys.argv[1] if len(sys.argv) > 1 else "{}"))
