"""Recording what RunPod answered the preflight (`python -m flows.preflight RUN_FILE --record DIR`), so that one
real account's catalog can be replayed by localpod (`python -m localpod --catalog-from DIR`).

While `recording(DIR)` is on, the preflight's RunPod client sends its requests through a `RecordingTransport`: every
GET passes through and its answer is written to DIR, one JSON file per answer, scrubbed of secrets; anything but a
GET is refused before it leaves (the preflight changes nothing, so a write would be a bug to stop, not a fact to
record). On leaving, `manifest.json` lists what was recorded. The format is the contract with localpod, which
imports nothing of this: docs/local-stand-ins.md ("A recorded catalog") describes it.

What the scrub removes, from every answer and query:
- the values of members whose names say they hold a secret (TOKEN, SECRET, KEY, PASSWORD, CREDENTIAL: the
  worker's own rule, `loraflow_worker.runtime.environment.is_secret_name`);
- every value of an endpoint's `env`, except a value that is exactly a RunPod secret reference
  (`{{ RUNPOD_SECRET_<name> }}`): that is a secret's name, not its value, and loraflow's secret names carry a
  fingerprint that reveals nothing of the value (`tasks/runpod/secrets.py`);
- the RunPod key, the Hub token, the values of this process's secret-looking variables, and known token shapes,
  wherever they appear in a string (`loraflow_worker.runtime.redaction.redact_secrets`).
Request headers (the key travels in `Authorization`) are never written, and the manifest names the API's host, not
its URL.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import re
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from contextvars import ContextVar
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Literal

import httpx
from loraflow_worker.runtime.environment import is_secret_name
from loraflow_worker.runtime.redaction import REDACTED, redact_secrets
from pydantic import BaseModel, Field

from tasks.runpod import errors
from tasks.runpod.live_catalog import clear_catalog_cache
from tasks.runpod.secrets import referenced_secrets, secret_reference
from tasks.settings import Settings

MANIFEST = "manifest.json"
RECORDING_FORMAT = 1


class RecordingError(RuntimeError):
    """A recording that cannot be made as asked (a folder in use), or a request a recording refuses to send."""


class RecordedAnswer(BaseModel):
    """One answer RunPod gave the preflight, as `manifest.json` lists it."""

    file: str = Field(description="The answer's file in the recording's folder, e.g. `001-catalog-gpus.json`.")
    api: Literal["control", "job"] = Field(
        description="control: RunPod's API v2 (`RUNPOD_API_URL`); job: the per-endpoint job API (`RUNPOD_JOB_URL`).")
    route: str = Field(description="The path asked, from `/v2` on whatever the base URL, e.g. `/v2/catalog/gpus`.")
    query: dict[str, str] = Field(description="The query parameters asked, e.g. `{\"minCudaVersion\": \"12.8\"}`.")
    status: int = Field(description="RunPod's HTTP status; the body of an error answer is recorded too.")


class RecordingManifest(BaseModel):
    """`manifest.json`: what a recording holds, when and where from."""

    format: int = Field(default=RECORDING_FORMAT, description="This layout's version; localpod refuses others.")
    recorded_at: datetime = Field(description="When the recording ended (UTC).")
    api_host: str = Field(description="The host of the API answered, e.g. `api.runpod.io` (never the key).")
    loraflow_version: str = Field(description="The loraflow that recorded it.")
    scrubbed: str = Field(description="What was removed from the answers before they were written.")
    answers: list[RecordedAnswer] = Field(description="Every answer recorded, in the order they came.")


SCRUBBED = ("values of members named like a secret (token, secret, key, password, credential); every endpoint env "
            "value but secret references ({{ RUNPOD_SECRET_<name> }}); the RunPod key, the Hub token, this "
            f"process's secret variables and token shapes wherever they appear; each replaced by {REDACTED}")


class Recorder:
    """Writes answers into one folder, numbered in the order they come, and the manifest at the end."""

    def __init__(self, folder: Path):
        if folder.exists() and (not folder.is_dir() or any(folder.iterdir())):
            raise RecordingError(f"--record {folder}: not an empty folder; name a new one (a recording is never "
                                 "mixed with another)")
        folder.mkdir(parents=True, exist_ok=True)
        self.folder = folder
        self.answers: list[RecordedAnswer] = []
        self.api_host = ""

    def transport(self, api_url: str, job_url: str, secrets: Mapping[str, str],
                  inner: httpx.BaseTransport | None = None) -> RecordingTransport:
        """A transport for a RunPod client of these base URLs; `secrets`: name → value of what must never be
        written (the client's key, the Hub token); `inner`: what sends the requests (default: the network)."""
        self.api_host = httpx.URL(api_url).host
        return RecordingTransport(self, api_url, job_url, secrets, inner)

    def keep(self, api: Literal["control", "job"], route: str, query: dict[str, str], status: int,
             body: Any) -> None:
        slug = re.sub(r"[^a-z0-9]+", "-", route.removeprefix("/v2").lower()).strip("-") or "root"
        name = f"{len(self.answers) + 1:03d}-{slug}.json"
        (self.folder / name).write_text(json.dumps(body, indent=1, sort_keys=True) + "\n")
        self.answers.append(RecordedAnswer(file=name, api=api, route=route, query=query, status=status))

    def write_manifest(self) -> Path:
        manifest = RecordingManifest(recorded_at=datetime.now(UTC), api_host=self.api_host,
                                     loraflow_version=importlib.metadata.version("loraflow"), scrubbed=SCRUBBED,
                                     answers=self.answers)
        path = self.folder / MANIFEST
        path.write_text(manifest.model_dump_json(indent=1) + "\n")
        return path


class RecordingTransport(httpx.BaseTransport):
    """Passes GETs through to the network and records their answers; refuses every other method."""

    def __init__(self, recorder: Recorder, api_url: str, job_url: str, secrets: Mapping[str, str],
                 inner: httpx.BaseTransport | None = None):
        self._recorder = recorder
        self._bases: list[tuple[Literal["control", "job"], str]] = [
            ("control", httpx.URL(api_url).path.rstrip("/")), ("job", httpx.URL(job_url).path.rstrip("/"))]
        self._hosts = {"control": httpx.URL(api_url).host, "job": httpx.URL(job_url).host}
        self._secrets = {name: value for name, value in secrets.items() if value}
        self._inner = inner or httpx.HTTPTransport()

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        if request.method != "GET":
            raise RecordingError(f"a recording sends only reads: {request.method} {request.url.path} refused")
        response = self._inner.handle_request(request)
        response.read()
        api, route = self._route(request.url)
        query = {k: self._scrub_text(v) for k, v in request.url.params.items()}
        try:
            body: Any = json.loads(response.content)
        except ValueError:  # not JSON (an HTML error page, say): kept as scrubbed text
            body = {"text": response.text}
        self._recorder.keep(api, route, query, response.status_code, scrub(body, self._scrub_text))
        return response

    def close(self) -> None:
        self._inner.close()

    def _route(self, url: httpx.URL) -> tuple[Literal["control", "job"], str]:
        for api, prefix in self._bases:
            if url.host == self._hosts[api] and url.path.startswith(prefix + "/"):
                return api, "/v2" + url.path.removeprefix(prefix)
        return "control", url.path

    def _scrub_text(self, text: str) -> str:
        # The process's own secret variables are removed too (redact_secrets' default environment), and the named
        # values whatever their length.
        return redact_secrets(text, env={**os.environ, **self._secrets}, secret_names=self._secrets)


def scrub(value: Any, scrub_text: Callable[[str], str], member: str | None = None) -> Any:
    """`value` (a JSON document) with secrets removed, as the module's docstring says; `member`: the name it is the
    value of."""
    if isinstance(value, dict):
        if member == "env":
            return {k: _env_value(v, scrub_text) for k, v in value.items()}
        return {k: scrub(v, scrub_text, k) for k, v in value.items()}
    if isinstance(value, list):
        if member == "env":  # env as a list of {key, value}
            return [{**item, "value": _env_value(item.get("value"), scrub_text)} if isinstance(item, dict) else REDACTED
                    for item in value]
        return [scrub(v, scrub_text) for v in value]
    if member is not None and is_secret_name(member) and isinstance(value, str | int | float) \
            and not isinstance(value, bool):
        return REDACTED
    return scrub_text(value) if isinstance(value, str) else value


def _env_value(value: Any, scrub_text: Callable[[str], str]) -> Any:
    if isinstance(value, str):
        names = referenced_secrets({"": value})
        if len(names) == 1 and value.strip() == secret_reference(next(iter(names))):
            return scrub_text(value)
    return REDACTED if value is not None else None


_active: ContextVar[Recorder | None] = ContextVar("loraflow_preflight_recorder", default=None)


@contextmanager
def recording(folder: Path) -> Iterator[Recorder]:
    """Record the RunPod answers of the preflight run inside; the manifest is written on leaving, whatever
    happened. The catalog is read afresh: a recording holds what RunPod answers now, not a cached read."""
    recorder = Recorder(folder)
    token = _active.set(recorder)
    clear_catalog_cache()
    try:
        yield recorder
    finally:
        _active.reset(token)
        recorder.write_manifest()


def recording_transport(settings: Settings) -> httpx.BaseTransport | None:
    """The transport the preflight's RunPod client records through while `recording` is on; None otherwise (the
    client's own)."""
    recorder = _active.get()
    if recorder is None:
        return None
    secrets = {"RUNPOD_API_KEY": _key(settings)}
    if settings.hf_token is not None:
        secrets["HF_TOKEN"] = settings.hf_token.get_secret_value()
    return recorder.transport(settings.runpod_api_url, settings.runpod_job_url, secrets)


def _key(settings: Settings) -> str:
    try:
        return settings.api_key()
    except (RuntimeError, errors.AuthError):  # no key anywhere: the preflight then opens no client to record
        return ""
