"""Validation against RunPod's official API v2 OpenAPI document.

The whole document goes into a `referencing` registry, so a component schema's
`#/components/schemas/...` references resolve inside it, and Draft 2020-12 keywords such as
`unevaluatedProperties: false` reject unknown fields exactly as RunPod does.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from jsonschema import Draft202012Validator, ValidationError
from jsonschema.exceptions import best_match
from referencing import Registry, Resource
from referencing.jsonschema import DRAFT202012

from localpod.problems import ProblemError

_DOCUMENT_URI = "urn:runpod:api-v2-openapi"


class OpenApiSchemas:
    """The component schemas of one OpenAPI 3.1 document, ready to validate JSON values."""

    def __init__(self, document: Mapping[str, Any]) -> None:
        resource = Resource.from_contents(document, default_specification=DRAFT202012)
        self._registry: Registry = Registry().with_resource(_DOCUMENT_URI, resource)
        self._names = set(document.get("components", {}).get("schemas", {}))
        self._validators: dict[str, Draft202012Validator] = {}

    @classmethod
    def load(cls, path: Path) -> OpenApiSchemas:
        try:
            return cls(json.loads(path.read_text(encoding="utf-8")))
        except FileNotFoundError as e:
            raise FileNotFoundError(
                f"RunPod's OpenAPI document is not at {path}; localpod ships a copy beside its code "
                "(pass --openapi PATH to use another)"
            ) from e

    def errors(self, schema_name: str, instance: Any) -> list[str]:
        """Every way `instance` breaks the named schema, as `"$.path: message"`; [] when valid."""
        found = sorted(self._validator(schema_name).iter_errors(instance), key=lambda e: e.json_path)
        return list(dict.fromkeys(_describe(e) for e in found))

    def check_request(self, schema_name: str, body: Any) -> None:
        """Raise a 400 `ErrorResponse` listing the violations when `body` breaks the named schema."""
        errors = self.errors(schema_name, body)
        if errors:
            raise ProblemError(400, f"request body does not match {schema_name}", errors)

    def _validator(self, schema_name: str) -> Draft202012Validator:
        if schema_name not in self._names:
            raise KeyError(f"no component schema {schema_name!r} in the OpenAPI document")
        if schema_name not in self._validators:
            root = {"$ref": f"{_DOCUMENT_URI}#/components/schemas/{schema_name}"}
            self._validators[schema_name] = Draft202012Validator(root, registry=self._registry)
        return self._validators[schema_name]


def _describe(error: ValidationError) -> str:
    text = f"{error.json_path}: {error.message}"
    if error.context:  # a failed oneOf/anyOf: name the closest branch's complaint, not just "no branch"
        closest = best_match(error.context)
        text += f" (closest: {closest.json_path}: {closest.message})"
    return text
