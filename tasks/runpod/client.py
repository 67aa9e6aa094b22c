"""A small typed client for RunPod's control-plane API v2 and its per-endpoint job API.

HTTP only: no retries here (Prefect tasks own retries, see `tasks/lifecycle/steps.py`), no lifecycle
decisions (see `tasks/runpod/endpoints.py`). Every response goes through `raise_for_status`, the one
place that turns RunPod answers into `tasks.runpod.errors` exceptions.

The same client talks to RunPod or to localpod: only the base URLs differ.
"""

from __future__ import annotations

import functools
import json
import ssl
from collections.abc import Iterator
from typing import Any

import httpx

from tasks.runpod import errors
from tasks.runpod.models import (
    CreateEndpoint,
    CreateNetworkVolume,
    CreateSecret,
    Endpoint,
    EndpointList,
    EndpointWorker,
    EndpointWorkerList,
    Health,
    JobStatus,
    NetworkVolume,
    NetworkVolumeBilling,
    NetworkVolumeList,
    RunRequest,
    Secret,
    UpdateNetworkVolume,
)

API_URL = "https://api.runpod.io/v2"
"""Control plane (REST API v2). REST v1 at rest.runpod.io was retired on 2026-11-15."""
JOB_URL = "https://api.runpod.ai/v2"
"""Per-endpoint job API: `{JOB_URL}/{endpoint_id}/run` etc."""

# Explicit timeouts: short connects, reads long enough for a slow create; long waits are poll loops.
DEFAULT_TIMEOUT = httpx.Timeout(connect=5.0, read=30.0, write=30.0, pool=10.0)


def raise_for_status(response: httpx.Response) -> None:
    """Raise the typed error for a failed response; return quietly for a 2xx."""
    if response.is_success:
        return
    status = response.status_code
    body = response.text[:2000]
    detail = _detail(response)
    request_id = response.headers.get("x-request-id")
    where = f"{response.request.method} {response.request.url.path}"
    message = f"RunPod answered {status} to {where}: {detail}"
    kwargs: dict[str, Any] = {"status": status, "body": body, "request_id": request_id}
    # RunPod's quota refusal has no documented status: REST v1 sent it as a 500, a v2 client recorded 400. Its
    # text decides, before any status does, so a 500 is waited out rather than retried and failed.
    if errors.is_quota_refusal(detail) or errors.is_quota_refusal(body):
        raise errors.QuotaExceededError(
            f"{message}. Delete unused endpoints (every endpoint's workers.max counts, even scaled to zero) "
            "or raise the account balance.",
            **kwargs,
        )
    if status == 429:
        raise errors.RateLimitError(message, retry_after=retry_after_s(response), **kwargs)
    if status >= 500:
        raise errors.ServerError(message, **kwargs)
    if status in (401, 403):
        raise errors.AuthError(f"{message}. Check RUNPOD_API_KEY (or the Secret block it comes from).", **kwargs)
    if status == 404:
        raise errors.NotFoundError(message, **kwargs)
    if status == 409:
        raise errors.ConflictError(message, **kwargs)
    raise errors.BadRequestError(message, **kwargs)


def _detail(response: httpx.Response) -> str:
    try:
        payload = response.json()
    except ValueError:
        return response.text[:500] or response.reason_phrase
    if isinstance(payload, dict):
        parts = [str(payload.get(k)) for k in ("detail", "error", "message") if payload.get(k)]
        if payload.get("errors"):
            parts.append("; ".join(map(str, payload["errors"])))
        if parts:
            return " — ".join(parts)
    return json.dumps(payload)[:500]


def retry_after_s(response: httpx.Response) -> float | None:
    """The seconds an answer's `Retry-After` header asks for; None: no header, or not a number of seconds."""
    try:
        return float(response.headers["retry-after"])
    except (KeyError, ValueError):
        return None


@functools.cache
def tls_context() -> ssl.SSLContext:
    """The process's one TLS context for RunPod's APIs, as httpx makes it (certifi's roots, or `SSL_CERT_FILE` /
    `SSL_CERT_DIR` when set). Loading a CA bundle costs 75-250 ms of CPU on a 2-core machine, and a client is made per
    step: per client, that sat between a job's end and its endpoint's delete (bench/overhead.py)."""
    return httpx.create_ssl_context()


class RunpodClient:
    """One method per remote operation. Methods return quickly; none of them retries.

    `delete_endpoint` raises `NotFoundError` for an absent endpoint; callers that want idempotent
    deletes treat that as success (see `endpoints.delete_endpoint_confirmed`).
    """

    def __init__(
        self,
        api_key: str,
        *,
        api_url: str = API_URL,
        job_url: str = JOB_URL,
        timeout: httpx.Timeout = DEFAULT_TIMEOUT,
        transport: httpx.BaseTransport | None = None,
    ):
        if not api_key:
            raise errors.AuthError("no RunPod API key: set RUNPOD_API_KEY", status=401)
        self._api_url = api_url.rstrip("/")
        self._job_url = job_url.rstrip("/")
        self._http = httpx.Client(
            headers={"Authorization": f"Bearer {api_key}", "User-Agent": "loraflow"},
            timeout=timeout,
            transport=transport,
            verify=tls_context(),
        )

    @property
    def api_url(self) -> str:
        """The control-plane base URL: which RunPod (or localpod) this client talks to."""
        return self._api_url

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> RunpodClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _request(self, method: str, url: str, **kwargs: Any) -> httpx.Response:
        try:
            response = self._http.request(method, url, **kwargs)
        except httpx.TimeoutException as e:
            raise errors.RunpodTimeoutError(f"{method} {httpx.URL(url).path} timed out: {e}") from e
        except httpx.TransportError as e:
            raise errors.RunpodConnectionError(f"{method} {httpx.URL(url).path} failed: {e}") from e
        raise_for_status(response)
        return response

    # Control plane (API v2)

    def create_endpoint(self, body: CreateEndpoint) -> Endpoint:
        """Not idempotent: look the name up first (`find_endpoint`)."""
        response = self._request("POST", f"{self._api_url}/serverless", json=body.to_wire())
        return Endpoint.model_validate(response.json())

    def get_endpoint(self, endpoint_id: str) -> Endpoint:
        response = self._request("GET", f"{self._api_url}/serverless/{endpoint_id}")
        return Endpoint.model_validate(response.json())

    def _every_page(self, path: str) -> Iterator[Any]:
        """Each page's JSON of a list route, following `pagination.nextCursor` (RunPod pages lists, 1000 items
        by default) until a page names no next cursor."""
        cursor: str | None = None
        seen: set[str] = set()
        while True:
            params = {"cursor": cursor} if cursor is not None else None
            payload = self._request("GET", f"{self._api_url}{path}", params=params).json()
            yield payload
            pagination = payload.get("pagination") if isinstance(payload, dict) else None
            cursor = pagination.get("nextCursor") if isinstance(pagination, dict) else None
            if not cursor:
                return
            if cursor in seen:  # a server that hands back a cursor twice would page forever
                raise errors.ServerError(f"GET {path} answered the cursor {cursor!r} twice: its pages loop",
                                         status=502)
            seen.add(cursor)

    def list_endpoints(self) -> list[Endpoint]:
        """Every endpoint of the account, every page."""
        return [e for page in self._every_page("/serverless") for e in EndpointList.model_validate(page).endpoints]

    def find_endpoint(self, name: str) -> Endpoint | None:
        """The endpoint with exactly this name, or None."""
        return next((e for e in self.list_endpoints() if e.name == name), None)

    def delete_endpoint(self, endpoint_id: str) -> None:
        self._request("DELETE", f"{self._api_url}/serverless/{endpoint_id}")

    def list_endpoint_workers(self, endpoint_id: str) -> list[EndpointWorker]:
        """The endpoint's active workers, with where each was placed (`GET /v2/serverless/{id}/workers`)."""
        response = self._request("GET", f"{self._api_url}/serverless/{endpoint_id}/workers")
        return EndpointWorkerList.model_validate(response.json()).workers

    def list_network_volumes(self) -> list[NetworkVolume]:
        """Every network volume of the account, every page."""
        return [v for page in self._every_page("/network-volumes")
                for v in NetworkVolumeList.model_validate(page).network_volumes]

    def create_network_volume(self, body: CreateNetworkVolume) -> NetworkVolume:
        """Not idempotent (names need not be unique): look the volume up first."""
        response = self._request("POST", f"{self._api_url}/network-volumes", json=body.to_wire())
        return NetworkVolume.model_validate(response.json())

    def grow_network_volume(self, volume_id: str, size_gb: int) -> NetworkVolume:
        response = self._request("PATCH", f"{self._api_url}/network-volumes/{volume_id}",
                                 json=UpdateNetworkVolume(size=size_gb).to_wire())
        return NetworkVolume.model_validate(response.json())

    def rename_network_volume(self, volume_id: str, name: str) -> NetworkVolume:
        response = self._request("PATCH", f"{self._api_url}/network-volumes/{volume_id}",
                                 json=UpdateNetworkVolume(name=name).to_wire())
        return NetworkVolume.model_validate(response.json())

    def delete_network_volume(self, volume_id: str) -> None:
        """Gone at once, with its files. `NotFoundError` when absent. RunPod's schema documents no refusal for a
        volume an endpoint attaches: list the endpoints first (`volumes.delete_unattached_volume`)."""
        self._request("DELETE", f"{self._api_url}/network-volumes/{volume_id}")

    def network_volume_billing(self, params: dict[str, Any]) -> NetworkVolumeBilling:
        """`GET /v2/billing/network-volumes` (`startTime`/`endTime` or `lastN`, `bucketSize`, `networkVolumeId`):
        one record per volume per bucket."""
        response = self._request("GET", f"{self._api_url}/billing/network-volumes", params=params)
        return NetworkVolumeBilling.model_validate(response.json())

    # The catalog and billing answer JSON documents: `live_catalog` parses them, since a document of an
    # unexpected shape is one of the failures it falls back from.

    def catalog_gpus(self, params: dict[str, Any]) -> Any:
        return self._request("GET", f"{self._api_url}/catalog/gpus", params=params).json()

    def catalog_cpus(self, params: dict[str, Any]) -> Any:
        return self._request("GET", f"{self._api_url}/catalog/cpus", params=params).json()

    def catalog_data_centers(self, params: dict[str, Any]) -> Any:
        return self._request("GET", f"{self._api_url}/catalog/datacenters", params=params).json()

    def serverless_billing(self, params: dict[str, Any]) -> Any:
        return self._request("GET", f"{self._api_url}/billing/serverless", params=params).json()

    def list_secrets(self) -> list[Secret]:
        """Every account secret (metadata only), every page."""
        secrets = []
        for payload in self._every_page("/account/secrets"):
            # API v2 wraps its lists (`{"endpoints": [...]}`); a bare array is read too, the reference shows neither.
            items = payload.get("secrets", []) if isinstance(payload, dict) else payload
            secrets += [Secret.model_validate(item) for item in items]
        return secrets

    def create_secret(self, body: CreateSecret) -> Secret:
        """409 (`ConflictError`) when the name is taken."""
        response = self._request("POST", f"{self._api_url}/account/secrets", json=body.to_wire())
        return Secret.model_validate(response.json())

    def delete_secret(self, secret_id: str) -> None:
        """`NotFoundError` when absent."""
        self._request("DELETE", f"{self._api_url}/account/secrets/{secret_id}")

    # Job API (per endpoint)

    def run(self, endpoint_id: str, body: RunRequest) -> JobStatus:
        """Submit a job. Not idempotent: a retried POST can start a second job."""
        response = self._request("POST", f"{self._job_url}/{endpoint_id}/run", json=body.to_wire())
        return JobStatus.model_validate(response.json())

    def status(self, endpoint_id: str, job_id: str) -> JobStatus:
        response = self._request("GET", f"{self._job_url}/{endpoint_id}/status/{job_id}")
        return JobStatus.model_validate(response.json())

    def cancel(self, endpoint_id: str, job_id: str) -> JobStatus:
        response = self._request("POST", f"{self._job_url}/{endpoint_id}/cancel/{job_id}")
        return JobStatus.model_validate(response.json())

    def health(self, endpoint_id: str) -> Health:
        response = self._request("GET", f"{self._job_url}/{endpoint_id}/health")
        return Health.model_validate(response.json())
