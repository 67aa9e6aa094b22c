"""`/_localpod/answer-shapes`: how localpod shapes the answers RunPod does not shape one documented way (the quota
refusal's status and wording, the lists' page size), changed while the server runs, so that one server serves tests
of each shape. Started from `--quota-refusal-status`, `--quota-refusal-text` and `--page-size`. Not part of RunPod's
API, so it needs no key."""

from __future__ import annotations

from typing import Literal

from fastapi import APIRouter, Depends
from pydantic import BaseModel, ConfigDict, Field

from localpod.state.account import LocalpodState, get_state

router = APIRouter(prefix="/_localpod", tags=["localpod"])


class AnswerShapes(BaseModel):
    """The shapes in force; in a `POST`, the ones to change (an omitted field stays as it is)."""

    model_config = ConfigDict(extra="forbid")

    quota_refusal_status: Literal[400, 500] | None = Field(
        default=None, description="400: the quota refusal as an ErrorResponse; 500: REST v1's `{\"error\": ...}`.")
    quota_refusal_text: str | None = Field(
        default=None, min_length=1, description="The quota refusal's message; `{quota}` becomes the worker quota.")
    page_size: int | None = Field(default=None, ge=1, description="Items per page of the endpoint, network "
                                  "volume and secret lists.")


@router.get("/answer-shapes")
async def get_answer_shapes(state: LocalpodState = Depends(get_state)) -> AnswerShapes:
    return AnswerShapes(quota_refusal_status=state.config.quota_refusal_status,
                        quota_refusal_text=state.config.quota_refusal_text, page_size=state.config.page_size)


@router.post("/answer-shapes")
async def set_answer_shapes(change: AnswerShapes, state: LocalpodState = Depends(get_state)) -> AnswerShapes:
    if change.quota_refusal_status is not None:
        state.config.quota_refusal_status = change.quota_refusal_status
    if change.quota_refusal_text is not None:
        state.config.quota_refusal_text = change.quota_refusal_text
    if change.page_size is not None:
        state.config.page_size = change.page_size
    return await get_answer_shapes(state)
