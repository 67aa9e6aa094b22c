"""The `reconcile` flow: find loraflow's endpoints that no live run owns, and delete them.

The backstop for anything a crash left behind (a killed flow process, a lost server, a delete that
was never confirmed). Scheduled on an interval (`prefect.yaml`), also started by the train flow's
crash and cancellation hooks. Run it by hand, looking first:

    .venv/bin/python -m flows.reconcile '{"dry_run": true}'
    .venv/bin/python -m flows.reconcile '{"silent_after_minutes": 30}'
"""

# No `from __future__ import annotations` here: Prefect builds the parameter model (the UI form) from
# the flow signature when it loads the entrypoint, and cannot resolve postponed annotations.
import sys
from datetime import datetime, timezone

from prefect import flow, get_run_logger
from prefect.artifacts import create_table_artifact

from flows.spec import ReconcilePolicy
from tasks.reconcile import Finding, decide, read_live_train_runs, read_our_endpoints
from tasks.runpod.steps import delete_endpoint_by_id


@flow(name="reconcile", log_prints=True)
def reconcile(policy: ReconcilePolicy = ReconcilePolicy()) -> list[Finding]:
    """Delete our endpoints whose run is final, missing or silent, and endpoints idle past a grace.

    1. List our endpoints (name prefix match only; any other endpoint is never touched).
    2. Read the live train runs and when each last logged.
    3. Decide per endpoint; delete (confirmed) unless `dry_run`.
    4. Report what was found and done as a table artifact.
    """
    logger = get_run_logger()
    endpoints, health = read_our_endpoints()
    runs = read_live_train_runs()
    findings = decide(endpoints, runs, health, datetime.now(timezone.utc),
                      silent_after_s=policy.silent_after_minutes * 60, idle_grace_s=policy.idle_grace_minutes * 60,
                      min_age_s=policy.min_age_minutes * 60)
    for finding in findings:
        if finding.action == "keep":
            finding.result = "kept"
        elif policy.dry_run:
            finding.result = "would delete (dry run)"
        else:
            state = delete_endpoint_by_id(finding.endpoint_id, return_state=True)
            # An unconfirmed delete is reported, not raised: the next reconcile tries it again.
            finding.result = "deleted" if state.is_completed() else f"delete not confirmed: {state.message}"
        logger.info("%s %s: %s (%s)", finding.result, finding.name, finding.reason, finding.endpoint_id)
    create_table_artifact(
        key="reconcile-report",
        table=[f.model_dump() for f in findings] or [{"result": "no loraflow endpoints found"}],
        description=f"Reconcile at {datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC"
        + (" (dry run)" if policy.dry_run else ""),
    )
    return findings


if __name__ == "__main__":
    reconcile(ReconcilePolicy.model_validate_json(sys.argv[1] if len(sys.argv) > 1 else "{}"))
