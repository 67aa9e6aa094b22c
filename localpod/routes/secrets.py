"""Account secrets: `/v2/account/secrets` (create, list, get, update, delete).

RunPod's API v2 reference documents these routes (docs.runpod.io, api-reference-v2/account, 2026-09)
but the vendored OpenAPI file predates them, so the bodies are checked against the models below,
written from that reference: a secret's value is write-only (no answer ever holds it), and an
endpoint's env refers to it as `{{ RUNPOD_SECRET_<name> }}`, replaced by the value when a worker boots
(`resolve_secret_references`).
"""

from __future__ import annotations

import re
import time
from typing import Any

from fastapi import APIRouter, Depends, Request, Response
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from localpod.auth import require_api_key
from localpod.paging import page
from localpod.problems import ProblemError
from localpod.state.account import LocalpodState, get_state
from localpod.state.records import SecretRecord, iso, new_id

router = APIRouter(prefix="/v2/account/secrets", tags=["secrets"], dependencies=[Depends(require_api_key)])

NAME_PATTERN = r"^[a-zA-Z_][a-zA-Z0-9_.\-/]*$"
"""RunPod's rule for a secret's name: starts with a letter or `_`; letters, digits and `_.-/`; 1-191 characters."""
MAX_VALUE_BYTES = 16 * 1024 * 1024
"""RunPod refuses a value of 16 MiB of UTF-8 or more."""
_REFERENCE = re.compile(r"\{\{\s*RUNPOD_SECRET_([a-zA-Z_][a-zA-Z0-9_.\-/]*)\s*\}\}")


def _value_fits(value: str | None) -> str | None:
    if value is not None and len(value.encode()) >= MAX_VALUE_BYTES:
        raise ValueError("must be smaller than 16 MiB of UTF-8 text")
    return value


class CreateSecretRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str = Field(min_length=1, max_length=191, pattern=NAME_PATTERN,
                      description="Unique; referenced as `{{ RUNPOD_SECRET_<name> }}`; immutable.")
    value: str = Field(min_length=1, description="Write-only: never returned.")
    description: str | None = Field(default=None, max_length=65535)

    @field_validator("name")
    @classmethod
    def _not_reserved(cls, name: str) -> str:
        if name.upper().startswith("RUNPOD"):
            raise ValueError("names beginning with RUNPOD are reserved")
        return name

    _value = field_validator("value")(_value_fits)


class UpdateSecretRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    value: str | None = Field(default=None, min_length=1, description="A new value: rotation.")
    description: str | None = Field(default=None, max_length=65535)

    _value = field_validator("value")(_value_fits)


def _parse(model: type[BaseModel], body: Any) -> Any:
    try:
        return model.model_validate(body)
    except ValidationError as e:
        errors = [f"$.{'.'.join(str(p) for p in err['loc'])}: {err['msg']}" for err in e.errors()]
        raise ProblemError(400, "request does not match the expected shape", errors) from None


def secret_document(secret: SecretRecord) -> dict[str, Any]:
    """A secret as RunPod answers it: metadata only."""
    return {"id": secret.id, "name": secret.name, "description": secret.description,
            "createdAt": iso(secret.created_at), "valueLastUpdatedAt": iso(secret.value_updated_at)}


def _secret(state: LocalpodState, secret_id: str) -> SecretRecord:
    secret = state.secrets.get(secret_id)
    if secret is None:
        raise ProblemError(404, f"secret {secret_id} not found")
    return secret


@router.post("", status_code=201)
async def create_secret(request: Request, state: LocalpodState = Depends(get_state)) -> JSONResponse:
    body = _parse(CreateSecretRequest, await _json(request))
    if any(s.name == body.name for s in state.secrets.values()):
        raise ProblemError(409, f"a secret named {body.name!r} already exists")
    now = time.time()
    secret = SecretRecord(id=new_id(), name=body.name, value=body.value, description=body.description,
                          created_at=now, value_updated_at=now)
    state.secrets[secret.id] = secret
    return JSONResponse(secret_document(secret), status_code=201)


@router.get("")
async def list_secrets(request: Request, state: LocalpodState = Depends(get_state)) -> JSONResponse:
    # Wrapped and paged like API v2's other lists (`{"endpoints": [...], "pagination": {"nextCursor": ...}}`).
    secrets, more = page(list(state.secrets.values()), request, state.config.page_size)
    return JSONResponse({"secrets": [secret_document(s) for s in secrets], **more})


@router.get("/{secret_id}")
async def get_secret(secret_id: str, state: LocalpodState = Depends(get_state)) -> JSONResponse:
    return JSONResponse(secret_document(_secret(state, secret_id)))


@router.patch("/{secret_id}")
async def update_secret(secret_id: str, request: Request, state: LocalpodState = Depends(get_state)) -> JSONResponse:
    secret = _secret(state, secret_id)
    body = _parse(UpdateSecretRequest, await _json(request))
    if "description" in body.model_fields_set:
        secret.description = body.description
    if body.value is not None:
        secret.value, secret.value_updated_at = body.value, time.time()
    return JSONResponse(secret_document(secret))


@router.delete("/{secret_id}", status_code=204)
async def delete_secret(secret_id: str, state: LocalpodState = Depends(get_state)) -> Response:
    del state.secrets[_secret(state, secret_id).id]
    return Response(status_code=204)


async def _json(request: Request) -> Any:
    try:
        return await request.json()
    except ValueError:
        raise ProblemError(400, "the request body is not JSON") from None


def resolve_secret_references(env: dict[str, str], secrets: dict[str, str]) -> tuple[dict[str, str], list[str]]:
    """`env` with every `{{ RUNPOD_SECRET_<name> }}` replaced by that secret's value, as a booting worker
    sees it, and the names it referred to that the account has no secret for (replaced by nothing)."""
    missing: list[str] = []

    def value(match: re.Match[str]) -> str:
        if match[1] not in secrets:
            missing.append(match[1])
        return secrets.get(match[1], "")

    return {key: _REFERENCE.sub(value, text) for key, text in env.items()}, missing
