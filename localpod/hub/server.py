"""A local stand-in for the Hugging Face Hub: the part of the HTTP API that huggingface_hub 2.4.0 uses.

Point the client at it with `HF_ENDPOINT=http://127.0.0.1:PORT` (read at import, so set it in the
environment of a fresh process) or with `endpoint=` on every call. It creates repos, takes commits
(every file as a plain "regular" upload: no LFS, no Xet), lists trees and serves files with the headers
the client's cache needs. The wire facts come from ../shared/hf-hub-api/README.md (§n below).

    python -m localpod.hub --host 127.0.0.1 --port 8765 --data-dir /tmp/hub
    python -m localpod.hub --port 0 --data-dir /tmp/hub --require-token secret --commits-per-hour 3
    python -m localpod.hub --port 0 --data-dir /tmp/hub --commits-per-hour 1 --commit-window-s 2
    python -m localpod.hub --port 0 --data-dir /tmp/hub --read-only-token hf_reader

Auth: any bearer token is accepted (unless --require-token). Without a token, public repos can be
read; private repos and every write answer 401 RepoNotFound, as the Hub does for anonymous callers.
A token given with --read-only-token is a Hub "read" token: it reads what any token reads, and every
write (repo create, settings, preupload, commit) answers 403 without an X-Error-Code, which the client
raises as a plain `HfHubHTTPError` (§8) — as the Hub refuses a read token's writes.
A commit past the per-repo limit (`--commits-per-hour` in a rolling `--commit-window-s`) answers 429 with
the Hub's text and a `Retry-After` (§9); a refused commit changes nothing.
A commit that adds a `README.md` is preceded by the client's check of the card's metadata
(`POST /api/validate-yaml`, localpod/hub/cards.py).
Test hooks (not Hub API): `GET /_hub/commits/{repo_type}/{ns}/{name}` (commit count and list, from
disk), `GET /_hub/downloads/{repo_type}/{ns}/{name}` (file GETs served since start, in memory) and
`POST|GET|DELETE /_hub/commit-faults/{repo_type}/{ns}/{name}` (arm the next commits to answer 429, 5xx
or 403; localpod/hub/limits.py).
"""

from __future__ import annotations

import argparse
import base64
import json
from collections import Counter
from collections.abc import Collection
from pathlib import Path
from urllib.parse import parse_qs

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import FileResponse, JSONResponse, Response
from pydantic import BaseModel, ConfigDict, Field

from localpod.hub.cards import validate_yaml_router
from localpod.hub.limits import CommitFaults, commit_faults_router
from localpod.hub.repos import (
    DEFAULT_BRANCH,
    REPO_TYPES,
    CommitOps,
    HubError,
    HubRepos,
    RepoRef,
    check_repo_path,
    paths_info,
    tree_entries,
)

TREE_PAGE_SIZE = 1000
"""Entries per tree page; the Hub pages at 1000 (with `expand=false`) and links the next page (§4)."""
# The Hub's answers to a read token's writes (seen in users' reports): a create in a namespace the token
# cannot write, and an upload (preupload, commit) with a token that is not a write token.
READ_ONLY_CREATE_MESSAGE = "You don't have the rights to create a {kind} under the namespace \"{namespace}\""
READ_ONLY_WRITE_MESSAGE = "Forbidden: you must use a write token to upload to a repository."


class CreateRepoRequest(BaseModel):
    """Body of `POST /api/repos/create` as huggingface_hub sends it (§3)."""

    model_config = ConfigDict(extra="allow")
    name: str = Field(description="Repo name without the namespace.")
    organization: str | None = Field(default=None, description="Namespace; the stand-in requires one.")
    type: str = Field(default="model", description="`dataset` or `space`; left out for models.")
    visibility: str | None = Field(default=None, description="`private` or `public` (2.4.0 sends this).")
    private: bool | None = Field(default=None, description="Older clients' form of the visibility.")


class RepoSettingsRequest(BaseModel):
    """Body of `PUT /api/{t}s/{id}/settings` (§3)."""

    model_config = ConfigDict(extra="allow")
    visibility: str | None = Field(default=None, description="`private` or `public`.")
    private: bool | None = Field(default=None, description="Older clients' form of the visibility.")


class PreuploadFile(BaseModel):
    path: str = Field(description="Path in the repo.")
    size: int = Field(description="Size in bytes.")
    sample: str = Field(default="", description="Base64 of the first 512 bytes (unused: every file is regular).")


class PreuploadRequest(BaseModel):
    files: list[PreuploadFile] = Field(description="Files about to be committed.")


def create_hub_app(
    data_dir: Path, *, require_token: str | None = None, commits_per_hour: int = 128, commit_window_s: float = 3600.0,
    read_only_tokens: Collection[str] = (),
) -> FastAPI:
    """The stand-in as an ASGI app; all state lives under `data_dir`. `read_only_tokens`: tokens that may read but
    not write (the Hub's "read" tokens)."""
    read_only = frozenset(read_only_tokens)
    repos = HubRepos(Path(data_dir), commits_per_hour=commits_per_hour, commit_window_s=commit_window_s)
    app = FastAPI(title="loraflow local Hub stand-in", docs_url=None, redoc_url=None)
    app.state.repos = repos
    downloads: Counter[str] = Counter()  # file GETs per repo since start (test hook; not persisted)
    commit_faults = CommitFaults(commits_per_hour)
    app.include_router(commit_faults_router(commit_faults, repos))
    app.include_router(validate_yaml_router())  # a commit adding README.md is checked there first

    @app.exception_handler(HubError)
    async def _hub_error(request: Request, err: HubError) -> JSONResponse:
        # The client builds its typed exceptions from X-Error-Code and shows X-Error-Message (§2, §8).
        headers = {"X-Error-Message": err.message, **err.headers}
        if err.code:
            headers["X-Error-Code"] = err.code
        return JSONResponse({"error": err.message}, status_code=err.status, headers=headers)

    def caller_token(request: Request) -> str | None:
        header = request.headers.get("authorization", "")
        token = header[len("Bearer "):].strip() if header.lower().startswith("bearer ") else None
        if require_token is not None and token != require_token:
            raise HubError(401, "Invalid username or password.", "RepoNotFound")
        return token or None

    def readable(request: Request, ref: RepoRef) -> None:
        token = caller_token(request)
        if repos.state(ref).private and token is None:
            raise HubError(401, "Repository not found", "RepoNotFound")

    def writable(request: Request, ref: RepoRef) -> None:
        token = caller_token(request)
        if token is None:
            raise HubError(401, "Repository not found", "RepoNotFound")
        repos.state(ref)
        if token in read_only:
            raise HubError(403, READ_ONLY_WRITE_MESSAGE)

    def base_url(request: Request) -> str:
        return str(request.base_url).rstrip("/")

    @app.get("/api/agent-harnesses")
    async def agent_harnesses() -> dict:
        # Fetched once per client process (§1); an empty registry disables agent detection.
        return {"standardEnvVars": [], "harnesses": {}}

    @app.post("/api/repos/create")
    async def create_repo(request: Request, body: CreateRepoRequest) -> JSONResponse:
        token = caller_token(request)
        if token is None:
            raise HubError(401, "You must be authenticated to create a repo: send a bearer token.")
        if body.organization is None:
            raise HubError(400, "The stand-in has no user accounts: give the repo id as `namespace/name`.")
        ref = RepoRef(f"{body.type}s", body.organization, body.name)
        if token in read_only:
            # Refused whether or not the repo exists; `exist_ok=True` then falls back to reading it (§3).
            raise HubError(403, READ_ONLY_CREATE_MESSAGE.format(kind=REPO_TYPES[ref.plural], namespace=ref.namespace))
        private = body.visibility == "private" if body.visibility is not None else bool(body.private)
        url = f"{base_url(request)}/{ref.url_prefix}"
        if not repos.create(ref, private=private):
            # The `url` is required even on the 409, or `exist_ok=True` fails in the client (§4).
            kind = REPO_TYPES[ref.plural]
            return JSONResponse({"error": f"You already created this {kind} repo", "url": url}, status_code=409,
                                headers={"X-Error-Message": f"You already created this {kind} repo"})
        return JSONResponse({"url": url, "name": ref.id, "id": ref.id})

    @app.get("/api/{plural}/{namespace}/{name}")
    async def repo_info(request: Request, plural: str, namespace: str, name: str) -> dict:
        return _repo_info(request, RepoRef(plural, namespace, name), DEFAULT_BRANCH)

    @app.get("/api/{plural}/{namespace}/{name}/revision/{revision:path}")
    async def repo_info_at(request: Request, plural: str, namespace: str, name: str, revision: str) -> dict:
        return _repo_info(request, RepoRef(plural, namespace, name), revision)

    def _repo_info(request: Request, ref: RepoRef, revision: str) -> dict:
        readable(request, ref)
        state = repos.state(ref)
        commit = repos.resolve(ref, revision)
        return {
            "_id": ref.id, "id": ref.id, "author": ref.namespace, "sha": commit.id, "private": state.private,
            "gated": False, "disabled": False, "createdAt": state.created_at, "lastModified": commit.date,
            "tags": [], "downloads": 0, "likes": 0,
            "siblings": [{"rfilename": p, "size": e.size, "blobId": e.oid} for p, e in sorted(commit.files.items())],
        }

    @app.put("/api/{plural}/{namespace}/{name}/settings")
    async def update_settings(request: Request, plural: str, namespace: str, name: str,
                              body: RepoSettingsRequest) -> dict:
        ref = RepoRef(plural, namespace, name)
        writable(request, ref)
        private = body.visibility == "private" if body.visibility is not None else body.private
        if private is not None:
            repos.set_private(ref, private)
        return {"private": repos.state(ref).private}

    @app.get("/api/{plural}/{namespace}/{name}/tree/{revision}")
    @app.get("/api/{plural}/{namespace}/{name}/tree/{revision}/{folder:path}")
    async def list_tree(request: Request, plural: str, namespace: str, name: str, revision: str,
                        folder: str = "", recursive: bool = False, cursor: int = 0) -> JSONResponse:
        ref = RepoRef(plural, namespace, name)
        readable(request, ref)
        entries = tree_entries(repos.resolve(ref, revision).files, folder, recursive=recursive)
        page = entries[cursor:cursor + TREE_PAGE_SIZE]
        headers = {}
        if cursor + TREE_PAGE_SIZE < len(entries):
            # The client follows the next link verbatim, so it carries every query parameter (§4).
            next_url = request.url.include_query_params(cursor=cursor + TREE_PAGE_SIZE)
            headers["Link"] = f'<{next_url}>; rel="next"'
        return JSONResponse(page, headers=headers)

    @app.post("/api/{plural}/{namespace}/{name}/paths-info/{revision}")
    async def get_paths_info(request: Request, plural: str, namespace: str, name: str, revision: str) -> list:
        ref = RepoRef(plural, namespace, name)
        readable(request, ref)
        raw = await request.body()
        if request.headers.get("content-type", "").startswith("application/json"):
            paths = json.loads(raw or b"{}").get("paths", [])
        else:  # the client posts a form: paths=a&paths=b&expand=false (§4)
            paths = parse_qs(raw.decode()).get("paths", [])
        return paths_info(repos.resolve(ref, revision).files, [paths] if isinstance(paths, str) else paths)

    @app.post("/api/{plural}/{namespace}/{name}/preupload/{revision}")
    async def preupload(request: Request, plural: str, namespace: str, name: str, revision: str,
                        body: PreuploadRequest) -> dict:
        ref = RepoRef(plural, namespace, name)
        writable(request, ref)
        files = repos.resolve(ref, revision).files
        # Always "regular": the file then travels base64 inside the commit, and no LFS/Xet is needed (§5).
        # `oid` lets the client drop unchanged files from the commit.
        return {"files": [
            {"path": f.path, "uploadMode": "regular", "shouldIgnore": False,
             "oid": files[f.path].oid if f.path in files else None}
            for f in body.files
        ]}

    @app.post("/api/{plural}/{namespace}/{name}/commit/{revision}")
    async def commit(request: Request, plural: str, namespace: str, name: str, revision: str) -> dict:
        ref = RepoRef(plural, namespace, name)
        writable(request, ref)
        commit_faults.check(ref)
        if request.query_params.get("create_pr"):
            raise HubError(400, "The stand-in does not support pull requests (create_pr).")
        header, ops = _parse_commit(await request.body())
        new = repos.commit(ref, revision, ops, title=header.get("summary") or "",
                           message=header.get("description") or "", parent=header.get("parentCommit"))
        # commitUrl is split on `/commit/` and parsed as a repo URL by the client (§4).
        return {"commitOid": new.id, "commitUrl": f"{base_url(request)}/{ref.url_prefix}/commit/{new.id}"}

    @app.get("/api/{plural}/{namespace}/{name}/commits/{revision}")
    async def list_commits(request: Request, plural: str, namespace: str, name: str, revision: str) -> list:
        ref = RepoRef(plural, namespace, name)
        readable(request, ref)
        return [_commit_json(c) for c in repos.history(ref, revision)]

    @app.get("/_hub/commits/{repo_type}/{namespace}/{name}")
    async def commit_log(repo_type: str, namespace: str, name: str) -> dict:
        """Test hook: every commit on main, newest first (the initial system commit included)."""
        ref = RepoRef.of(repo_type, namespace, name)
        commits = repos.history(ref, DEFAULT_BRANCH)
        return {"repo": ref.id, "count": len(commits), "commits": [_commit_json(c) for c in commits]}

    @app.get("/_hub/downloads/{repo_type}/{namespace}/{name}")
    async def download_count(repo_type: str, namespace: str, name: str) -> dict:
        """Test hook: file GETs (not HEADs) served for this repo since the server started."""
        ref = RepoRef.of(repo_type, namespace, name)
        return {"repo": ref.id, "count": downloads[ref.url_prefix]}

    async def resolve_file(request: Request, ref: RepoRef, revision: str, path: str) -> Response:
        readable(request, ref)
        commit = repos.resolve(ref, revision)
        # X-Repo-Commit is what the client files the download under; it also wants it on a 404 to
        # record the miss in its cache (§4, §7).
        headers = {"X-Repo-Commit": commit.id}
        entry = commit.files.get(path)
        if entry is None:
            raise HubError(404, "Entry not found", "EntryNotFound", headers)
        # The ETag is the git blob sha1: the client reuses any cached blob with the same ETag (§7).
        headers["ETag"] = f'"{entry.oid}"'
        if request.method == "GET":
            downloads[ref.url_prefix] += 1
        return FileResponse(repos.blob_path(entry.oid), headers=headers, media_type="application/octet-stream")

    @app.api_route("/{namespace}/{name}/resolve/{revision}/{path:path}", methods=["GET", "HEAD"])
    async def resolve_model_file(request: Request, namespace: str, name: str, revision: str, path: str) -> Response:
        return await resolve_file(request, RepoRef("models", namespace, name), revision, path)

    @app.api_route("/{kind}/{namespace}/{name}/resolve/{revision}/{path:path}", methods=["GET", "HEAD"])
    async def resolve_repo_file(request: Request, kind: str, namespace: str, name: str, revision: str,
                                path: str) -> Response:
        if kind not in ("datasets", "spaces"):
            raise HubError(404, "Repository not found", "RepoNotFound")
        return await resolve_file(request, RepoRef(kind, namespace, name), revision, path)

    return app


def _parse_commit(body: bytes) -> tuple[dict, CommitOps]:
    """The NDJSON commit payload (§4): a header line, then deletions and additions."""
    header: dict | None = None
    ops = CommitOps(deleted_files=[], deleted_folders=[], added={})
    for line in body.splitlines():
        if not line.strip():
            continue
        item = json.loads(line)
        key, value = item.get("key"), item.get("value") or {}
        if key == "header":
            header = value
        elif key == "deletedFile":
            ops.deleted_files.append(check_repo_path(value["path"]))
        elif key == "deletedFolder":
            ops.deleted_folders.append(check_repo_path(value["path"].rstrip("/")))
        elif key == "file":
            if value.get("encoding", "base64") != "base64":
                raise HubError(400, f"Unsupported file encoding '{value.get('encoding')}'")
            ops.added[check_repo_path(value["path"])] = base64.b64decode(value["content"])
        elif key == "lfsFile":
            raise HubError(400, "The stand-in stores every file as regular (preupload never answers lfs).")
        else:
            raise HubError(400, f"Unknown commit operation '{key}'")
    if header is None:
        raise HubError(400, "Commit payload has no header line")
    return header, ops


def _commit_json(commit) -> dict:
    # The shape `list_repo_commits` parses.
    return {"id": commit.id, "title": commit.title, "message": commit.message, "date": commit.date,
            "authors": [{"user": commit.author}], "parents": commit.parents, "files": len(commit.files)}


class _AnnouncingServer(uvicorn.Server):
    """Prints the bound address once the socket listens (with --port 0 that is how callers learn it)."""

    async def startup(self, sockets=None) -> None:
        await super().startup(sockets=sockets)
        host, port = self.servers[0].sockets[0].getsockname()[:2]
        print(f"hub stand-in listening on http://{host}:{port}", flush=True)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m localpod.hub", description=__doc__.splitlines()[0])
    parser.add_argument("--host", default="127.0.0.1", help="Interface to bind.")
    parser.add_argument("--port", type=int, default=8765, help="Port to bind; 0 picks a free one (printed).")
    parser.add_argument("--data-dir", type=Path, required=True, help="Where repos and blobs are kept.")
    parser.add_argument("--require-token", default=None,
                        help="Accept only this bearer token; others (and none) get 401 RepoNotFound.")
    parser.add_argument("--commits-per-hour", type=int, default=128,
                        help="Commits per repo per sliding hour before 429 (the Hub's default quota is 128).")
    parser.add_argument("--commit-window-s", type=float, default=3600.0,
                        help="Length of that sliding window in seconds (the Hub's is an hour; tests shorten it).")
    parser.add_argument("--read-only-token", action="append", default=[], metavar="TOKEN",
                        help="A token that may read but not write (repeatable): its writes answer 403, as the Hub "
                        "answers a read token's.")
    parser.add_argument("--log-level", default="warning", help="uvicorn log level.")
    args = parser.parse_args(argv)
    app = create_hub_app(args.data_dir, require_token=args.require_token, commits_per_hour=args.commits_per_hour,
                         commit_window_s=args.commit_window_s, read_only_tokens=args.read_only_token)
    _AnnouncingServer(uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level)).run()

