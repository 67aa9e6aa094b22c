"""The endpoint lifecycle: names derived from the run, idempotent create, confirmed delete.

Plain functions over `RunpodClient`; the Prefect tasks in `tasks/lifecycle/steps.py` wrap them. Every
function here is safe to call again after a crash: state lives at RunPod, found by name.
"""

from __future__ import annotations

import hashlib
import math
import re
from typing import NamedTuple

from tasks.runpod import errors
from tasks.runpod.catalog import GpuClass
from tasks.runpod.client import RunpodClient
from tasks.runpod.endpoint_match import endpoint_differences
from tasks.runpod.models import CpuRequest, CreateEndpoint, Endpoint, GpuRequest, Workers

ENDPOINT_PREFIX = "loraflow-"
"""Every endpoint loraflow creates starts with this; reconcile never touches any other, nor one tagged
with another control plane's namespace."""
MAX_ENDPOINT_NAME = 60
"""RunPod rejects longer endpoint names (limit seen in dstack's client; undocumented)."""
NAMESPACE_PATTERN = r"[a-z0-9]{1,8}"
"""A control plane's tag in endpoint names: the Prefect server or workspace its runs live in."""

_NAME = re.compile(
    rf"^{ENDPOINT_PREFIX}(?:(?P<label>.+)-)?(?P<run_hash>[0-9a-f]{{12}})-(?P<namespace>{NAMESPACE_PATTERN})"
    r"-(?:a(?P<attempt>[0-9]+)|s(?P<expires>[0-9]{10}))$"
)


class EndpointName(NamedTuple):
    """What an endpoint's name says about it."""

    label: str
    run_hash: str
    namespace: str
    attempt: int
    """The attempt of a job's endpoint; 0 for a serving endpoint."""
    expires_at: int | None = None
    """A serving endpoint's expiry (Unix seconds): the reconciler deletes it after, whatever its run; None for a job's."""

    @property
    def serving(self) -> bool:
        return self.expires_at is not None


def run_hash(run_id: str) -> str:
    """The short hash of a run id that every attempt's endpoint name carries."""
    return hashlib.sha256(run_id.encode()).hexdigest()[:12]


def endpoint_name(run_id: str, attempt: int, label: str, namespace: str) -> str:
    """`loraflow-<label>-<hash of run id>-<namespace>-a<attempt>`: unique per run and per attempt,
    recognisable, tagged with the control plane whose reconciler may delete it (`namespace`, this control
    plane's: `Settings.control_plane_namespace`), and derivable again from the run id alone (crash hooks and
    the reconciler hold no memory). The label comes first so that a run's endpoints share the prefix
    `loraflow-<label>-`.
    """
    return _name(run_id, label, namespace, f"a{attempt}")


def serving_endpoint_name(run_id: str, label: str, namespace: str, expires_at: float) -> str:
    """`loraflow-<label>-<hash of run id>-<namespace>-s<expiry>`: a serving endpoint's name, which says its kind and
    when its time runs out (Unix seconds, rounded up: the reconciler never deletes it early), so that the reconciler
    keeps it until then and deletes it after from its name alone. One per serve run (a serve has no attempts)."""
    return _name(run_id, label, namespace, f"s{math.ceil(expires_at):010d}")


def _name(run_id: str, label: str, namespace: str, tail: str) -> str:
    if not re.fullmatch(NAMESPACE_PATTERN, namespace):
        raise ValueError(f"namespace {namespace!r} must match {NAMESPACE_PATTERN}")
    clean = re.sub(r"-{2,}", "-", re.sub(r"[^a-z0-9-]", "-", label.lower())).strip("-")
    suffix = f"{run_hash(run_id)}-{namespace}-{tail}"
    room = MAX_ENDPOINT_NAME - len(ENDPOINT_PREFIX) - len(suffix) - 1
    clean = clean[: max(room, 0)].strip("-")
    return f"{ENDPOINT_PREFIX}{clean}-{suffix}" if clean else f"{ENDPOINT_PREFIX}{suffix}"


def parse_endpoint_name(name: str) -> EndpointName | None:
    """The parts of a name `endpoint_name` or `serving_endpoint_name` made; None for any other name, including
    loraflow names from before control-plane tags (`loraflow-<label>-<hash>-a<N>`), which no reconciler may claim."""
    match = _NAME.match(name)
    if match is None:
        return None
    if match["expires"] is not None:
        return EndpointName(match["label"] or "", match["run_hash"], match["namespace"], 0, int(match["expires"]))
    return EndpointName(match["label"] or "", match["run_hash"], match["namespace"], int(match["attempt"]))


def build_create_request(
    *,
    name: str,
    gpu: GpuClass,
    gpu_count: int,
    image: str,
    env: dict[str, str],
    disk_gb: int,
    execution_timeout_s: int,
    cuda_floor: str | None,
    data_center_ids: list[str] | None = None,
    network_volume_id: str | None = None,
) -> CreateEndpoint:
    """One endpoint per run attempt, capped at one worker: one quota slot = one endpoint. Hosts must run at
    least `cuda_floor` (`catalog.cuda_floor`: what both the card and the image need; None for a job that
    needs no CUDA, such as a preload). A network volume pins the workers to its datacenter (RunPod mounts
    it at `/runpod-volume`)."""
    return CreateEndpoint(
        name=name,
        image=image,
        env=env,
        disk=disk_gb,
        gpu=GpuRequest(
            pools=[gpu.pool],
            excluded_types=list(gpu.exclude) or None,
            count=gpu_count,
            min_cuda_version=cuda_floor,
        ),
        workers=Workers(min=0, max=1, idle_timeout=5),
        timeout=execution_timeout_s * 1000,
        data_center_ids=data_center_ids or None,
        network_volumes=[network_volume_id] if network_volume_id else None,
    )


def build_cpu_create_request(
    *,
    name: str,
    cpu_flavor: str,
    vcpu_count: int,
    image: str,
    env: dict[str, str],
    disk_gb: int,
    execution_timeout_s: int,
    data_center_ids: list[str] | None = None,
    network_volume_id: str | None = None,
) -> CreateEndpoint:
    """`build_create_request` for CPU workers (RunPod's CPU serverless: `cpu` in place of `gpu`), for jobs that
    need no GPU, such as a preload: one flavor at one vCPU count, one worker, one quota slot. A network volume
    attaches to a CPU endpoint as to a GPU one (`networkVolumes` does not depend on the compute family)."""
    return CreateEndpoint(
        name=name,
        image=image,
        env=env,
        disk=disk_gb,
        cpu=[CpuRequest(id=cpu_flavor, vcpu_count=vcpu_count)],
        workers=Workers(min=0, max=1, idle_timeout=5),
        timeout=execution_timeout_s * 1000,
        data_center_ids=data_center_ids or None,
        network_volumes=[network_volume_id] if network_volume_id else None,
    )


def ensure_endpoint(client: RunpodClient, request: CreateEndpoint) -> Endpoint:
    """The endpoint named `request.name`, created if missing, and as asked: the one endpoint of that name.

    A create that errors may still have created the endpoint (a timeout or 5xx after RunPod acted), so
    on a transient error the name is looked up before the error is passed on to the retry layer. More than one
    endpoint of the name (a create the client gave up on that RunPod carried out later) keeps the one as asked
    and deletes the others, confirmed. An endpoint unlike the request (found or created: `endpoint_differences`)
    is deleted at once and `EndpointMismatchError` names the differences, even when that delete is not yet
    confirmed (the attempt's teardown deletes by name): a difference is never retried as if it were transient.
    """
    endpoint = _the_one_named(client, request)
    if endpoint is None:
        try:
            endpoint = client.create_endpoint(request)
        except errors.TRANSIENT_ERRORS:
            endpoint = _the_one_named(client, request)
            if endpoint is None:
                raise
    return _as_asked(client, request, endpoint)


def _the_one_named(client: RunpodClient, request: CreateEndpoint) -> Endpoint | None:
    named = [e for e in client.list_endpoints() if e.name == request.name]
    if len(named) <= 1:
        return named[0] if named else None
    keep = next((e for e in named if not endpoint_differences(request, e)), named[0])
    for extra in named:
        if extra.id != keep.id:
            delete_endpoint_confirmed(client, extra.id)
    return keep


def _as_asked(client: RunpodClient, request: CreateEndpoint, endpoint: Endpoint) -> Endpoint:
    differences = endpoint_differences(request, endpoint)
    if not differences:
        return endpoint
    try:
        delete_endpoint_confirmed(client, endpoint.id)
        deleted = "so it was deleted at once"
    except errors.TRANSIENT_ERRORS as e:
        deleted = f"and its delete is not yet confirmed ({e}): the attempt's teardown deletes it by name"
    raise errors.EndpointMismatchError(
        f"RunPod made endpoint {endpoint.name} ({endpoint.id}) unlike the request, {deleted}: "
        f"{'; '.join(differences)}. RunPod's API answered a create with another endpoint than asked (REST v1 made "
        "GPU endpoints for CPU requests); check RUNPOD_API_URL is API v2, and report it to RunPod if it is.",
        endpoint_id=endpoint.id, differences=differences)


class EndpointStillExists(errors.ServerError):
    """A delete was accepted but the endpoint is still listed: not yet confirmed. Transient."""


def delete_endpoint_confirmed(client: RunpodClient, endpoint_id: str) -> None:
    """Delete and prove absence with a 404 on GET. Deleting an absent endpoint succeeds quietly."""
    try:
        client.delete_endpoint(endpoint_id)
    except errors.NotFoundError:
        pass
    try:
        client.get_endpoint(endpoint_id)
    except errors.NotFoundError:
        return
    raise EndpointStillExists(f"endpoint {endpoint_id} still exists after delete", status=503)


def delete_endpoints_named(client: RunpodClient, name: str) -> list[str]:
    """Delete (confirmed) every endpoint with this exact name; returns the ids deleted."""
    ids = [e.id for e in client.list_endpoints() if e.name == name]
    for endpoint_id in ids:
        delete_endpoint_confirmed(client, endpoint_id)
    return ids


def run_endpoints(client: RunpodClient, run_id: str) -> list[Endpoint]:
    """Every endpoint of any attempt of this run (found by name: no memory needed).

    Matched on the run hash whatever the name's control-plane tag: run ids are UUIDs, unique across
    control planes, and a crash hook must find its run's endpoints without asking the Prefect API.
    """
    wanted = run_hash(run_id)
    return [e for e in client.list_endpoints() if (parsed := parse_endpoint_name(e.name)) and parsed.run_hash == wanted]
