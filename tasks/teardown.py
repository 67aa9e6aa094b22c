"""Teardown hooks for the `train` flow: the second layer after the flow body's `finally`.

Prefect runs `on_crashed` / `on_cancellation` hooks in the process that reports the final state,
possibly not the one that created the endpoints, so they find the run's endpoints by name.
"""

from __future__ import annotations

import logging

from tasks.runpod.endpoints import delete_endpoint_confirmed, run_endpoints
from tasks.runpod.errors import RunpodError
from tasks.runpod.steps import make_client

log = logging.getLogger("loraflow.teardown")


def delete_run_endpoints(run_id: str) -> list[str]:
    """Delete (confirmed) every endpoint of every attempt of the run; returns the ids deleted."""
    with make_client() as client:
        endpoints = run_endpoints(client, run_id)
        for endpoint in endpoints:
            delete_endpoint_confirmed(client, endpoint.id)
    return [e.id for e in endpoints]


RECONCILE_DEPLOYMENT = "reconcile/interval"


def delete_run_endpoints_hook(flow, flow_run, state) -> None:
    """A Prefect state hook. A failure here is logged, not raised: the reconcile flow is the next
    layer, and is started now when its deployment exists."""
    try:
        deleted = delete_run_endpoints(str(flow_run.id))
        log.warning("Run %s ended %s: deleted its endpoints %s", flow_run.id, state.name, deleted or "(none left)")
    except RunpodError as e:
        log.error("Run %s ended %s and its endpoints could not be deleted (%s); reconcile will retry", flow_run.id, state.name, e)
    start_reconcile()


def start_reconcile() -> None:
    """Start the reconcile deployment now, without waiting for it; skipped when it is not deployed."""
    from prefect.deployments import run_deployment
    from prefect.exceptions import ObjectNotFound

    try:
        run_deployment(RECONCILE_DEPLOYMENT, timeout=0, as_subflow=False)
    except ObjectNotFound:
        log.info("No %s deployment: the crash hook did the teardown alone", RECONCILE_DEPLOYMENT)
