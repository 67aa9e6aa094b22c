"""The endpoint-slot quota: a Prefect global concurrency limit, one slot per live RunPod endpoint.

RunPod counts `workers.max` of every endpoint of the account against a worker quota (30 at a $300
balance), scaled-to-zero endpoints included. Each run's endpoint has `workers.max = 1`, so holding one
slot of this limit around create → train → delete keeps the account under its quota across every
Prefect worker that shares the server.
"""

from __future__ import annotations

from prefect import get_client
from prefect.client.schemas.actions import GlobalConcurrencyLimitCreate
from prefect.exceptions import ObjectAlreadyExists, ObjectNotFound

ENDPOINT_LIMIT = "runpod-endpoints"
DEFAULT_ENDPOINT_SLOTS = 28
"""Two under the 30-worker quota of a $300 balance, leaving room for a hand-made endpoint."""
SLOT_LEASE_SECONDS = 120
"""A crashed holder's slot frees after this (+ ≤15 s) once the server's repossessor sees the lease
expire; the holder renews it in the background while alive."""


def ensure_endpoint_limit(name: str = ENDPOINT_LIMIT, slots: int = DEFAULT_ENDPOINT_SLOTS) -> int:
    """Create the limit if it is missing; never change one that exists (an operator may have tuned it).

    Returns the limit in force. Runs take slots with `strict=True`, so a missing limit is an error
    rather than "unlimited".
    """
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


def slots_in_use(name: str = ENDPOINT_LIMIT) -> int:
    with get_client(sync_client=True) as client:
        return client.read_global_concurrency_limit_by_name(name).active_slots
