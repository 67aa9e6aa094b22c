"""`POST /api/validate-yaml` of the Hub stand-in: the check of a repo card's YAML metadata.

huggingface_hub 2.4.0 posts `{"content": <README.md>, "repoType": "model"}` there before any commit that adds a
`README.md` (`HfApi.create_commit` → `_validate_yaml`, read in its source), and refuses to commit when the answer
is a 400: it raises `ValueError("Invalid metadata in README.md. - <each errors[].message>")`, and turns each
`warnings[].message` of any answer into a Python warning. The Hub checks the metadata against its schema; the
stand-in checks the part loraflow's cards use: the front matter is a YAML mapping, and `base_model`,
`datasets`, `tags` and `library_name` have the types the Hub's model-card spec gives them.
"""

from __future__ import annotations

import re

import yaml
from fastapi import APIRouter
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field

_FRONT_MATTER = re.compile(r"\A\s*---\s*\n(.*?)\n---\s*(\n|\Z)", re.DOTALL)
# A Hub repo id: `name` or `namespace/name`, letters, digits, `.`, `_`, `-`.
_REPO_ID = re.compile(r"^([A-Za-z0-9][A-Za-z0-9._-]*/)?[A-Za-z0-9][A-Za-z0-9._-]*$")
# The Hub's warning for a card without metadata (its text, as users see it in the warning).
EMPTY_METADATA_WARNING = "Empty or missing yaml metadata in repo card"


class ValidateYamlRequest(BaseModel):
    """Body of `POST /api/validate-yaml`."""

    model_config = ConfigDict(extra="allow")
    content: str = Field(description="The whole README.md, front matter included.")
    repoType: str = Field(default="model", description="`model`, `dataset` or `space`.")  # noqa: N815 (wire name)


def card_metadata_problems(content: str) -> tuple[list[str], list[str]]:
    """(errors, warnings) of a card's front matter; no errors means the Hub would take the card."""
    match = _FRONT_MATTER.match(content)
    if match is None:
        return [], [EMPTY_METADATA_WARNING]
    try:
        meta = yaml.safe_load(match.group(1))
    except yaml.YAMLError as e:
        return [f"Invalid YAML in the metadata: {str(e).splitlines()[0]}"], []
    if meta is None:
        return [], [EMPTY_METADATA_WARNING]
    if not isinstance(meta, dict):
        return ["The metadata must be a YAML mapping (key: value)"], []
    errors = []
    for key in ("base_model", "datasets"):
        value = meta.get(key)
        if value is None:
            continue
        ids = value if isinstance(value, list) else [value]
        bad = [v for v in ids if not isinstance(v, str) or not _REPO_ID.match(v)]
        if bad:
            errors.append(f'"{key}" must be a Hub repo id or a list of them (got {bad[0]!r})')
    tags = meta.get("tags")
    if tags is not None and not (isinstance(tags, list) and all(isinstance(t, str) for t in tags)):
        errors.append('"tags" must be a list of strings')
    if meta.get("library_name") is not None and not isinstance(meta["library_name"], str):
        errors.append('"library_name" must be a string')
    return errors, []


def validate_yaml_router() -> APIRouter:
    router = APIRouter(tags=["hub repo cards"])

    @router.post("/api/validate-yaml")
    async def validate_yaml(body: ValidateYamlRequest) -> JSONResponse:
        errors, warnings = card_metadata_problems(body.content)
        answer = {"errors": [{"message": m} for m in errors], "warnings": [{"message": m} for m in warnings]}
        return JSONResponse(answer, status_code=400 if errors else 200)

    return router
