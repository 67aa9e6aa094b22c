"""The endpoint-slot quota: a Prefect global concurrency limit, one slot per live RunPod endpoint.

RunPod counts `workers.max` of every endpoint of the account against a worker quota (5 on a new
account, 30 at a $300 balance), scaled-to-zero endpoints included. Each run's endpoint has
`workers.max = 1`, so holding one slot of this limit from before the create until the delete is
confirmed keeps the account under its quota across every Prefect worker that shares the server; a serving
endpoint holds as many slots as its `workers.max` (`endpoint_slot(slots=N)`).

Three things keep that true when something goes wrong:
- an endpoint whose delete is never confirmed keeps a slot under a long lease of its own
  (`take_slot_lease`), released once the endpoint is proved gone (`tasks/lifecycle/teardown.py`);
- RunPod's own quota error (the limit set above the account's quota, or endpoints made outside
  loraflow) makes the run wait and try again (`wait_for_runpod_quota`), not fail;
- a Prefect server that fails a run's slot request for a while (a busy database, a restart) is asked
  again until the run's deadline (`endpoint_slot`, which every run holds its slot through).
"""

from __future__ import annotations

import contextvars
import logging
import os
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from datetime import UTC, datetime
from typing import TypeVar

import httpx
from prefect import get_client
from prefect.client.schemas.actions import GlobalConcurrencyLimitCreate, VariableCreate, VariableUpdate
from prefect.concurrency._asyncio import ConcurrencySlotAcquisitionError  # Prefect 3.9 defines it only there
from prefect.concurrency.sync import concurrency
from prefect.exceptions import ObjectAlreadyExists, ObjectNotFound

from tasks.runpod import errors
from tasks.runpod.client import retry_after_s

ENDPOINT_LIMIT = "runpod-endpoints"
NEW_ACCOUNT_WORKER_QUOTA = 5
"""RunPod's worker quota on a new account (10 to 60 with the balance): the limit's slots unless
`LORAFLOW_WORKER_QUOTA` names the account's own. A limit above the quota holds runs at RunPod's refusal
instead of in Prefect's queue; one below it only leaves workers unused."""
WORKER_QUOTA_ENV = "LORAFLOW_WORKER_QUOTA"
"""The account's worker quota as RunPod's console shows it (RunPod's API does not expose it)."""
NAMED_QUOTA_VARIABLE = "runpod-named-worker-quota"
"""The Prefect Variable holding the quota RunPod named in the latest quota refusal a run met
(`{"quota": N, "at": ISO time}`): the preflight reads it when it is given no quota."""
UNDELETED_LEASE_SECONDS = 24 * 3600
"""Lease of the slot kept for an endpoint whose delete is unconfirmed: the longest Prefect's server
grants. Whoever retries the delete renews it; unrenewed, the slot frees after a day at worst."""
SERVER_RETRY_S = 10.0
"""Wait before a run asks for a slot again after the Prefect server failed the request. Prefect's client has
by then retried 503/429/502 and lost connections for about a minute (5 tries, 2-32 s apart); a server whose
SQLite database is busy with 60 waiting runs, or one being restarted, can take longer than that."""
SERVER_UNAVAILABLE = {408, 429, 502, 503, 504}
QUOTA_WAITS_S = (15, 30, 60, 120)
"""Waits between creates refused by RunPod's quota error; the last one repeats."""

T = TypeVar("T")
log = logging.getLogger("loraflow.quota")


def configured_worker_quota() -> int | None:
    """The account's worker quota from `LORAFLOW_WORKER_QUOTA`; None when it is unset."""
    text = os.environ.get(WORKER_QUOTA_ENV, "").strip()
    if not text:
        return None
    try:
        quota = int(text)
    except ValueError:
        quota = 0
    if quota < 1:
        raise ValueError(f"{WORKER_QUOTA_ENV}={text!r} is not a worker quota: set it to the whole number RunPod's "
                         f"console shows for the account (5 on a new account), or unset it")
    return quota


def default_endpoint_slots() -> int:
    """The slots a missing limit is created with: `LORAFLOW_WORKER_QUOTA`, else a new account's quota."""
    return configured_worker_quota() or NEW_ACCOUNT_WORKER_QUOTA


def worker_quota_in_force(name: str = ENDPOINT_LIMIT) -> tuple[int, str]:
    """The most endpoints this control plane's runs hold at once, and where the figure comes from:
    `LORAFLOW_WORKER_QUOTA` (the account's quota) when set, else the limit's slots, else the slots a run would create
    the limit with (a new account's quota)."""
    if (quota := configured_worker_quota()) is not None:
        return quota, WORKER_QUOTA_ENV
    with get_client(sync_client=True) as client:
        try:
            return client.read_global_concurrency_limit_by_name(name).limit, f"the {name} limit's slots"
        except ObjectNotFound:
            return NEW_ACCOUNT_WORKER_QUOTA, f"a new account's: neither {WORKER_QUOTA_ENV} nor the {name} limit is set"


def ensure_endpoint_limit(name: str = ENDPOINT_LIMIT, slots: int | None = None) -> int:
    """Create the limit if it is missing, with `slots` (default: `default_endpoint_slots()`); never change one
    that exists (an operator may have tuned it).

    Returns the limit in force. Runs take slots with `strict=True`, so a missing limit is an error
    rather than "unlimited".
    """
    slots = default_endpoint_slots() if slots is None else slots
    with get_client(sync_client=True) as client:
        try:
            return client.read_global_concurrency_limit_by_name(name).limit
        except ObjectNotFound:
            pass
        try:
            client.create_global_concurrency_limit(GlobalConcurrencyLimitCreate(name=name, limit=slots, active=True))
        except ObjectAlreadyExists:
            pass  # another run created it first
        return client.read_global_concurrency_limit_by_name(name).limit


@contextmanager
def endpoint_slot(lease_seconds: float, *, give_up_at: float, name: str = ENDPOINT_LIMIT,
                  logger: logging.Logger | logging.LoggerAdapter = log,
                  retry_s: float = SERVER_RETRY_S, slots: int = 1) -> Iterator[None]:
    """Hold `slots` slots of the limit for the block (one per worker the endpoint may run: a serving endpoint's
    `workers.max`), as one acquisition: Prefect's `concurrency(strict=True)` (a missing limit is an error), under a
    lease it renews in the background.

    The wait for the slot is asked again every `retry_s` when the Prefect server fails it transiently (a
    busy database, a restart), until `give_up_at` (Unix time): a waiting run has rented nothing yet, and a
    server that is back finds it still in the queue. Any other failure is raised at once. A slot this process is still
    giving back (`release_meanwhile`) is given back first.
    """
    wait_for_slot_releases()
    started = time.time()
    with ExitStack() as slot:
        while True:
            try:
                slot.enter_context(concurrency(name, occupy=slots, strict=True, lease_duration=lease_seconds,
                                               raise_on_lease_renewal_failure=False))
                break
            except ConcurrencySlotAcquisitionError as e:
                if not server_unavailable(e):
                    raise
                if time.time() + retry_s > give_up_at:
                    raise ConcurrencySlotAcquisitionError(
                        f"{e}. The Prefect server failed this run's requests for a slot of {name} for "
                        f"{time.time() - started:.0f} s; the run's deadline leaves no time to wait longer.") from e
                logger.warning("The Prefect server failed this run's request for a slot of %s (%s); asking again "
                               "in %g s", name, e, retry_s)
                time.sleep(retry_s)
        yield


_releases: list[threading.Thread] = []
_releases_lock = threading.Lock()


def release_meanwhile(release: Callable[[], None], logger: logging.Logger | logging.LoggerAdapter = log) -> None:
    """Give a held slot back (`release`: the close of what holds it, one request to the Prefect server: 40-60 ms) in a
    thread of its own, in a copy of this context, while the caller goes on: a training attempt collects and reports
    its results meanwhile. `wait_for_slot_releases` waits for it; so do the next `endpoint_slot` and the interpreter's
    exit (the thread is not a daemon). A release that fails is a warning: the slot's lease runs out by itself."""
    context = contextvars.copy_context()

    def run() -> None:
        try:
            context.run(release)
        except Exception as e:  # noqa: BLE001 - the lease expires on its own; nothing else is the worse for it
            logger.warning("An endpoint slot could not be given back (%s: %s); its lease frees it when it runs out",
                           type(e).__name__, str(e)[:300])

    thread = threading.Thread(target=run, name="loraflow-slot-release")
    with _releases_lock:
        _releases.append(thread)
    thread.start()


def wait_for_slot_releases() -> None:
    """Return once every slot `release_meanwhile` began giving back in this process is given back (a flow's end)."""
    with _releases_lock:
        pending, _releases[:] = list(_releases), []
    for thread in pending:
        thread.join()

def server_unavailable(error: ConcurrencySlotAcquisitionError) -> bool:
    """Whether a slot request failed because the server could not answer (worth asking again), not because
    it refused (a missing limit)."""
    cause = error.__cause__
    if isinstance(cause, httpx.HTTPStatusError):
        return cause.response.status_code in SERVER_UNAVAILABLE
    return isinstance(cause, httpx.TransportError)


def slots_in_use(name: str = ENDPOINT_LIMIT) -> int:
    with get_client(sync_client=True) as client:
        return client.read_global_concurrency_limit_by_name(name).active_slots


def take_slot_lease(wait_s: float = 0.0, *, name: str = ENDPOINT_LIMIT, lease_seconds: float = UNDELETED_LEASE_SECONDS,
                    sleep: Callable[[float], None] = time.sleep, slots: int = 1) -> str | None:
    """Take `slots` slots of the limit under one lease of its own, outside any `concurrency()` block; its id,
    or None when they did not come free within `wait_s` (423 from the server, retried after its Retry-After).

    For an endpoint that outlives its attempt: the lease holds the slot until `release_slot_lease`.
    """
    deadline = time.monotonic() + wait_s
    with get_client(sync_client=True) as client:
        while True:
            try:
                response = client.increment_concurrency_slots_with_lease(
                    names=[name], slots=slots, mode="concurrency", lease_duration=lease_seconds)
                return str(response.json()["lease_id"])
            except httpx.HTTPStatusError as e:
                left = deadline - time.monotonic()
                if e.response.status_code != 423 or left <= 0:
                    log.warning("No slot of %s could be taken: %s", name, e)
                    return None
                sleep(min(_retry_after(e.response), left, 5.0))


def renew_slot_lease(lease_id: str, lease_seconds: float = UNDELETED_LEASE_SECONDS) -> bool:
    """Extend a lease from `take_slot_lease` by `lease_seconds` from now; False if it has already expired."""
    with get_client(sync_client=True) as client:
        try:
            client.renew_concurrency_lease(lease_id=lease_id, lease_duration=lease_seconds)
        except httpx.HTTPStatusError as e:
            if e.response.status_code in (404, 410):
                return False
            raise
    return True


def release_slot_lease(lease_id: str) -> None:
    """Give back a lease's slot. Safe to call twice (an unknown lease is ignored by the server)."""
    with get_client(sync_client=True) as client:
        client.release_concurrency_slots_with_lease(lease_id=lease_id)


def wait_for_runpod_quota(
    create: Callable[[], T],
    *,
    give_up_at: float,
    cancel_requested: Callable[[], bool],
    logger: logging.Logger | logging.LoggerAdapter = log,
    on_quota_named: Callable[[int], None] = lambda quota: None,
    check_every_s: float = 5.0,
    clock: Callable[[], float] = time.time,
    sleep: Callable[[float], None] = time.sleep,
) -> T | None:
    """`create()`, tried again after RunPod's quota error (`QuotaExceededError`) until it goes through.

    Waits `QUOTA_WAITS_S` between tries, asking `cancel_requested` every `check_every_s` meanwhile.
    Returns None when the run is cancelled while it waits. Raises the quota error, saying how long the
    run waited, when the next try would come after `give_up_at` (Unix time). Any other error is
    raised at once. `on_quota_named` hears the quota the first refusal named, if it named one (e.g.
    `remember_named_quota`).
    """
    started, tries = clock(), 0
    while True:
        try:
            return create()
        except errors.QuotaExceededError as e:
            tries += 1
            now = clock()
            delay = QUOTA_WAITS_S[min(tries, len(QUOTA_WAITS_S)) - 1]
            if now + delay > give_up_at:
                raise errors.QuotaExceededError(
                    f"{e} Waited {now - started:.0f} s for room in the account's worker quota; the run's deadline "
                    "leaves no time to wait longer.", status=e.status, body=e.body, request_id=e.request_id) from e
            if tries == 1:
                if e.quota is not None:
                    on_quota_named(e.quota)
                logger.warning("RunPod refused the endpoint: the account's worker quota%s is full (endpoints made "
                               "outside loraflow, or the %s limit set above the account's quota). Waiting for room; "
                               "%s to queue runs in Prefect instead.", f" ({e.quota})" if e.quota else "",
                               ENDPOINT_LIMIT, limit_fix(e.quota))
            logger.info("Waiting %d s for room in RunPod's worker quota (try %d)", delay, tries)
            until = now + delay
            while (left := until - clock()) > 0:
                if cancel_requested():
                    return None
                sleep(min(check_every_s, left))


def remember_named_quota(quota: int) -> None:
    """Keep the quota RunPod named in a refusal in the Prefect Variable `NAMED_QUOTA_VARIABLE`, for the preflight.
    A hint only: a failure to store it is logged, never raised."""
    value = {"quota": quota, "at": datetime.now(UTC).isoformat(timespec="seconds")}
    try:
        with get_client(sync_client=True) as client:
            if client.read_variable_by_name(NAMED_QUOTA_VARIABLE) is None:
                try:
                    client.create_variable(VariableCreate(name=NAMED_QUOTA_VARIABLE, value=value))
                    return
                except ObjectAlreadyExists:
                    pass  # another run stored it first: the newer value wins
            client.update_variable(VariableUpdate(name=NAMED_QUOTA_VARIABLE, value=value))
    except Exception as e:  # noqa: BLE001 - a hint for the preflight must not fail the run that waits
        log.warning("The quota RunPod named (%d) could not be kept for the preflight: %s", quota, e)


def read_named_quota() -> tuple[int, str] | None:
    """The quota RunPod named in the latest refusal a run met, and when; None when no refusal named one."""
    with get_client(sync_client=True) as client:
        variable = client.read_variable_by_name(NAMED_QUOTA_VARIABLE)
    value = variable.value if variable is not None else None
    if not isinstance(value, dict) or not isinstance(value.get("quota"), int):
        return None
    return value["quota"], str(value.get("at") or "")


def limit_fix(quota: int | None) -> str:
    """How to size the limit to the account's quota: the command when the quota is known."""
    if quota is None:
        return f"set the {ENDPOINT_LIMIT} limit to the account's quota (prefect gcl update {ENDPOINT_LIMIT} --limit N)"
    return (f"set the limit to it with `prefect gcl update {ENDPOINT_LIMIT} --limit {quota}` (and "
            f"{WORKER_QUOTA_ENV}={quota} where runs start)")


def _retry_after(response: httpx.Response) -> float:
    asked = retry_after_s(response)
    return 1.0 if asked is None else asked
