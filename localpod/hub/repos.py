"""On-disk state of the local Hub stand-in: repos, their commits, and content-addressed blobs.

Layout under the data dir (so the state survives a restart of the server):

    blobs/<oid[:2]>/<oid>                         file contents, named by git blob sha1
    repos/<models|datasets|spaces>/<ns>/<name>/
        repo.json                                 visibility, branch heads, recent commit times
        commits/<sha>.json                        one commit: parents, title, and the full file table

A commit stores the whole file table (path -> blob oid and size), so resolving any revision is one
file read and history is a walk over parents. Fine for a test server; the real Hub is git.
"""

from __future__ import annotations

import hashlib
import math
import os
import re
import secrets
import tempfile
import threading
import time
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

from pydantic import BaseModel, Field

REPO_TYPES = {"models": "model", "datasets": "dataset", "spaces": "space"}
"""URL plural (`/api/datasets/...`) -> repo type, as huggingface_hub spells both."""

DEFAULT_BRANCH = "main"
COMMIT_WINDOW_S = 3600.0
"""The Hub counts commits per repo per hour (hf-hub-api README §9)."""

# Hub text seen by users who hit the limit (hf-hub-api README §9); N depends on the plan.
RATE_LIMIT_MESSAGE = (
    "You have exceeded the rate limit for repository commits ({n} per hour). You can retry this action in "
    "about 1 hour. To reduce the number of commits, you can upload entire folders at once using the Hub "
    "Python library: https://huggingface.co/docs/huggingface_hub/guides/upload"
)
# The Hub's own answer when a delete names a path that is not there (hf-hub-api README §4).
MISSING_DELETE_MESSAGE = "A file with this name doesn't exist"

# A new Hub repo starts with a system commit holding `.gitattributes`; a short version of it.
INITIAL_GITATTRIBUTES = (
    b"*.bin filter=lfs diff=lfs merge=lfs -text\n*.safetensors filter=lfs diff=lfs merge=lfs -text\n"
)

_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,95}$")
_SHA = re.compile(r"^[0-9a-f]{40}$")


class HubError(Exception):
    """An HTTP error the stand-in answers with; `code` becomes `X-Error-Code` (how the client types it)."""

    def __init__(self, status: int, message: str, code: str | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.code = code
        self.headers = headers or {}


class FileEntry(BaseModel):
    oid: str = Field(description="Git blob sha1 of the content; also the blob's file name and the ETag.")
    size: int = Field(description="Size in bytes.")


class Commit(BaseModel):
    id: str = Field(description="40 lowercase hex digits.")
    parents: list[str] = Field(description="Parent commit ids (none for the initial commit).")
    title: str = Field(description="Commit summary.")
    message: str = Field(default="", description="Commit description.")
    author: str = Field(description="`system` for the initial commit, else `user`.")
    date: str = Field(description="ISO 8601 UTC time, millisecond precision, `Z` suffix (the Hub's format).")
    files: dict[str, FileEntry] = Field(description="Every file of the repo at this commit.")


class RepoState(BaseModel):
    private: bool = Field(description="Visibility, as set at creation or by the settings PUT.")
    created_at: str = Field(description="ISO 8601 UTC creation time.")
    refs: dict[str, str] = Field(description="Branch name -> head commit id.")
    commit_times: list[float] = Field(
        default_factory=list, description="Unix times of the accepted user commits inside the rate-limit window."
    )


@dataclass(frozen=True)
class RepoRef:
    """One repo, addressed as the URLs do: `datasets`, `org`, `name`."""

    plural: str
    namespace: str
    name: str

    def __post_init__(self) -> None:
        if self.plural not in REPO_TYPES:
            raise HubError(404, f"Unknown repo type '{self.plural}'")
        for part in (self.namespace, self.name):
            if not _NAME.match(part) or ".." in part:
                raise HubError(400, f"Invalid repo id '{self.namespace}/{self.name}'")

    @classmethod
    def of(cls, repo_type: str, namespace: str, name: str) -> RepoRef:
        """The form the test hooks take: `dataset` or `datasets` (model, space alike)."""
        return cls(repo_type if repo_type.endswith("s") else f"{repo_type}s", namespace, name)

    @property
    def id(self) -> str:
        return f"{self.namespace}/{self.name}"

    @property
    def url_prefix(self) -> str:
        """Path of the repo's web pages and files: `org/name` for models, `datasets/org/name` otherwise."""
        return self.id if self.plural == "models" else f"{self.plural}/{self.id}"


@dataclass
class CommitOps:
    """The operations of one commit request, in the order the client sent them."""

    deleted_files: list[str]
    deleted_folders: list[str]
    added: dict[str, bytes]


def git_blob_oid(data: bytes) -> str:
    """The git blob sha1, which the Hub uses as a regular file's oid and ETag."""
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def check_repo_path(path: str) -> str:
    """A file path as a commit may name it: relative POSIX, no empty, `.` or `..` segments."""
    parts = path.split("/")
    if not path or path.startswith("/") or "\\" in path or any(p in ("", ".", "..") for p in parts):
        raise HubError(400, f"Invalid path in repo: '{path}'")
    return path


def tree_entries(files: dict[str, FileEntry], folder: str, *, recursive: bool) -> list[dict]:
    """The Hub's tree listing of `folder` ('' = root): file and directory entries, repo-absolute paths.

    Raises EntryNotFound for a folder with nothing in it (a file path is not a folder either).
    """
    base = folder.strip("/") + "/" if folder.strip("/") else ""
    inside = {path: entry for path, entry in files.items() if path.startswith(base)}
    if base and not inside:
        raise HubError(404, f"{folder} does not exist", "EntryNotFound")
    listed_files: list[str] = []
    listed_dirs: set[str] = set()
    for path in inside:
        rest = path[len(base):].split("/")
        if recursive or len(rest) == 1:
            listed_files.append(path)
        for depth in range(1, len(rest) if recursive else min(2, len(rest))):
            listed_dirs.add(base + "/".join(rest[:depth]))
    entries = [_file_entry(path, files[path]) for path in listed_files]
    entries += [_dir_entry(path, files) for path in listed_dirs]
    return sorted(entries, key=lambda entry: entry["path"])


def paths_info(files: dict[str, FileEntry], paths: list[str]) -> list[dict]:
    """Entries for the given paths, files or folders; missing ones are left out, as the Hub does."""
    entries = []
    for path in dict.fromkeys(p.strip("/") for p in paths):
        if path in files:
            entries.append(_file_entry(path, files[path]))
        elif path and any(p.startswith(path + "/") for p in files):
            entries.append(_dir_entry(path, files))
    return entries


def now_iso() -> str:
    now = datetime.now(UTC)
    return now.strftime("%Y-%m-%dT%H:%M:%S.") + f"{now.microsecond // 1000:03d}Z"


class HubRepos:
    """All repos of one stand-in. Thread-safe; every change is written through to disk atomically."""

    def __init__(self, data_dir: Path, *, commits_per_hour: int = 128, commit_window_s: float = COMMIT_WINDOW_S):
        self.data_dir = Path(data_dir)
        self.commits_per_hour = commits_per_hour
        self.commit_window_s = commit_window_s
        self._lock = threading.Lock()
        (self.data_dir / "blobs").mkdir(parents=True, exist_ok=True)
        (self.data_dir / "repos").mkdir(parents=True, exist_ok=True)

    # -- repos ------------------------------------------------------------------------------------

    def create(self, ref: RepoRef, *, private: bool) -> bool:
        """Create the repo with its initial commit. False if it already existed (then nothing changes)."""
        with self._lock:
            if self._state_path(ref).exists():
                return False
            self._commits_dir(ref).mkdir(parents=True, exist_ok=True)
            initial = self._new_commit(
                parents=[], title="initial commit", message="", author="system",
                files={".gitattributes": self._store_blob(INITIAL_GITATTRIBUTES)},
            )
            self._write_commit(ref, initial)
            state = RepoState(private=private, created_at=initial.date, refs={DEFAULT_BRANCH: initial.id})
            self._write_state(ref, state)
            return True

    def state(self, ref: RepoRef) -> RepoState:
        path = self._state_path(ref)
        if not path.exists():
            raise HubError(404, "Repository not found", "RepoNotFound")
        return RepoState.model_validate_json(path.read_bytes())

    def set_private(self, ref: RepoRef, private: bool) -> None:
        with self._lock:
            state = self.state(ref)
            state.private = private
            self._write_state(ref, state)

    # -- reading ----------------------------------------------------------------------------------

    def resolve(self, ref: RepoRef, revision: str) -> Commit:
        """A branch name or a full commit sha of this repo -> the commit."""
        state = self.state(ref)
        commit_id = state.refs.get(revision)
        if commit_id is None and _SHA.match(revision) and self._commit_path(ref, revision).exists():
            commit_id = revision
        if commit_id is None:
            raise HubError(404, f"Invalid rev id: {revision}", "RevisionNotFound")
        return Commit.model_validate_json(self._commit_path(ref, commit_id).read_bytes())

    def history(self, ref: RepoRef, revision: str) -> list[Commit]:
        """Commits reachable from `revision`, newest first (the order of the Hub's commit list)."""
        commits = [self.resolve(ref, revision)]
        while commits[-1].parents:
            commits.append(Commit.model_validate_json(self._commit_path(ref, commits[-1].parents[0]).read_bytes()))
        return commits

    def blob_path(self, oid: str) -> Path:
        return self.data_dir / "blobs" / oid[:2] / oid

    # -- writing ----------------------------------------------------------------------------------

    def commit(self, ref: RepoRef, branch: str, ops: CommitOps, *, title: str, message: str,
               parent: str | None) -> Commit:
        """Apply one commit to `branch`: deletions first, then additions. Enforces the commit rate limit."""
        with self._lock:
            state = self.state(ref)
            if branch not in state.refs:
                raise HubError(404, f"Invalid rev id: {branch}", "RevisionNotFound")
            head = self.resolve(ref, branch)
            if parent is not None and parent != head.id:
                raise HubError(412, "A commit has happened since. Please refresh and try again.")
            now = time.time()
            recent = [t for t in state.commit_times if now - t < self.commit_window_s]
            if len(recent) >= self.commits_per_hour:
                # A slot frees when the oldest counted commit leaves the window (whole seconds, as HTTP has it).
                retry_after = max(1, math.ceil(min(recent) + self.commit_window_s - now))
                raise HubError(429, RATE_LIMIT_MESSAGE.format(n=self.commits_per_hour),
                               headers={"Retry-After": str(retry_after)})

            files = dict(head.files)
            for path in ops.deleted_files:
                if files.pop(path, None) is None:
                    raise HubError(404, MISSING_DELETE_MESSAGE, "EntryNotFound")
            for folder in ops.deleted_folders:
                inside = [p for p in files if p.startswith(folder.rstrip("/") + "/")]
                if not inside:
                    raise HubError(404, MISSING_DELETE_MESSAGE, "EntryNotFound")
                for path in inside:
                    del files[path]
            for path, data in ops.added.items():
                files[path] = self._store_blob(data)

            new = self._new_commit(parents=[head.id], title=title, message=message, author="user", files=files)
            self._write_commit(ref, new)
            state.refs[branch] = new.id
            state.commit_times = [*recent, now]
            self._write_state(ref, state)
            return new

    # -- helpers ----------------------------------------------------------------------------------

    def _new_commit(self, *, parents: list[str], title: str, message: str, author: str,
                    files: dict[str, FileEntry]) -> Commit:
        # Random salt: two identical commits still get distinct ids, as on the Hub (timestamps differ).
        return Commit(id=secrets.token_hex(20), parents=parents, title=title, message=message, author=author,
                      date=now_iso(), files=files)

    def _store_blob(self, data: bytes) -> FileEntry:
        oid = git_blob_oid(data)
        path = self.blob_path(oid)
        if not path.exists():
            _atomic_write(path, data)
        return FileEntry(oid=oid, size=len(data))

    def _repo_dir(self, ref: RepoRef) -> Path:
        return self.data_dir / "repos" / ref.plural / ref.namespace / ref.name

    def _state_path(self, ref: RepoRef) -> Path:
        return self._repo_dir(ref) / "repo.json"

    def _commits_dir(self, ref: RepoRef) -> Path:
        return self._repo_dir(ref) / "commits"

    def _commit_path(self, ref: RepoRef, commit_id: str) -> Path:
        return self._commits_dir(ref) / f"{commit_id}.json"

    def _write_commit(self, ref: RepoRef, commit: Commit) -> None:
        _atomic_write(self._commit_path(ref, commit.id), commit.model_dump_json().encode())

    def _write_state(self, ref: RepoRef, state: RepoState) -> None:
        _atomic_write(self._state_path(ref), state.model_dump_json(indent=1).encode())


def _file_entry(path: str, entry: FileEntry) -> dict:
    # Never an `xetHash` (or `lfs`): the client would switch to Xet downloads (hf-hub-api README §5).
    return {"type": "file", "oid": entry.oid, "size": entry.size, "path": path}


def _dir_entry(path: str, files: dict[str, FileEntry]) -> dict:
    # Not git's tree hash, but content-derived like it: changes exactly when something inside changes.
    listing = "".join(f"{p} {e.oid}\n" for p, e in sorted(files.items()) if p.startswith(path + "/"))
    return {"type": "directory", "oid": hashlib.sha1(listing.encode()).hexdigest(), "size": 0, "path": path}


def _atomic_write(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
