"""`GET /_localpod/account`: what the account holds and has spent, for tests and benchmarks.
Not part of RunPod's API, so it needs no key."""

from __future__ import annotations

from fastapi import APIRouter, Depends

from localpod.models import Account
from localpod.state.account import LocalpodState, get_state

router = APIRouter(prefix="/_localpod", tags=["localpod"])


@router.get("/account")
async def get_account(state: LocalpodState = Depends(get_state)) -> Account:
    # The state reports endpoints, workers and jobs; the volume book, its own volumes.
    return state.account().model_copy(update={"volumes": state.volumes.account_rows()})
