"""The artifact store: where a run's dataset, adapter, metrics, manifest and DONE marker live.

One URL names a store, and the same API serves both kinds:

- `file:///abs/path`: a local folder (local mode, tests).
- `hf://datasets/<org>/<repo>`: a private Hugging Face dataset repo. It is created if missing and
  forced private even if it already existed. The endpoint comes from `HF_ENDPOINT` (read by
  huggingface_hub at import) unless given, the token from `HF_TOKEN` unless given.

Every write (`put`, `put_folder`, `delete_prefix`) is ONE commit on the Hub, because the Hub allows about
128 commits per hour per repo: batch what belongs together into one call. A Hub store retries a 429, 5xx
or network error with backoff (writes for `retry_budget_s`, default 10 min; reads up to a minute), then
raises it as `transient`. Light dependencies only: the control plane imports this without the training stack.

`put` returns the Hub commit it made, and reads take a `revision` to read that commit instead of `main`: what someone
wrote to the repo since cannot change what is read. A folder has no revisions (FileStore ignores them); there, the
sha256 a writer recorded is what protects a reader (`artifacts.pins`).
"""

from __future__ import annotations

import contextlib
import glob
import json
import logging
import os
import re
import shutil
import tempfile
from collections.abc import Callable, Generator, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar
from urllib.parse import unquote, urlparse

import backoff
import httpx2
from huggingface_hub import CommitOperationAdd, CommitOperationDelete, HfApi
from huggingface_hub.errors import (
    HfHubHTTPError,
    LocalEntryNotFoundError,
    RemoteEntryNotFoundError,
    RepositoryNotFoundError,
    RevisionNotFoundError,
)
from huggingface_hub.hf_api import RepoFile
from huggingface_hub.utils import parse_ratelimit_headers

log = logging.getLogger("loraflow_worker")
_T = TypeVar("_T")

ACCEPTED_URLS = "`file:///absolute/path` or `hf://datasets/<org>/<repo>`"
HUB_BRANCH = "main"
HUB_COMMITS_PER_HOUR = 128
"""The Hub's commit quota per repo (free plan; some plans allow 256 or 320)."""
HUB_RETRY_BUDGET_S = 600.0
"""How long a write keeps retrying a 429, 5xx or network error: long enough for a finished adapter's
final save to outlast a few minutes of Hub trouble instead of being lost after the GPU time was paid."""
HUB_READ_RETRY_BUDGET_S = 60.0  # reads retry at most this long (or the store's budget): someone is waiting
HUB_FIRST_WAIT_S = 1.0  # first wait when the Hub names none; doubles (with jitter) on each further failure
HUB_MAX_WAIT_S = 60.0  # longest wait, whatever Retry-After asks: the commit window rolls, a slot may free early
HUB_GITATTRIBUTES = ".gitattributes"
"""The Hub puts this file in every new repo; it is the Hub's, not an artifact, so the store hides it."""

_HUB_URL = re.compile(r"^hf://datasets/([A-Za-z0-9][A-Za-z0-9._-]*)/([A-Za-z0-9][A-Za-z0-9._-]*)/?$")
_PARTIAL_SUFFIX = ".loraflow-partial"
"""Suffix of FileStore's staging folder while a write is in flight; nothing under it is ever listed."""


class ArtifactNotFound(Exception):
    """A path (or a prefix with nothing under it) is not in the store. The message names both."""


class ArtifactStoreError(Exception):
    """The store cannot be used as asked: bad URL or path, no access, rate limit, network.

    `transient` is True when the same call may succeed later unchanged (rate limit, 5xx, network).
    """

    def __init__(self, message: str, *, transient: bool = False):
        super().__init__(message)
        self.transient = transient


class ArtifactStore:
    """Files under repo-relative POSIX paths ("runs/abc/DONE"). See `open_store`."""

    url: str

    def put(self, files: Mapping[str, bytes | Path], *, message: str, delete_prefixes: Sequence[str] = (),
            retry_budget_s: float | None = None) -> str | None:
        """Store `files` (path -> content or local file) and remove `delete_prefixes` (folders; missing
        ones ignored) in ONE commit. Deletions apply first, so a file may be replaced in its folder.
        `retry_budget_s`: seconds a Hub store retries this write (None: the store's; 0: none, e.g. heartbeats).
        Returns the revision that holds the write (the Hub commit's id); None for a folder, which has no revisions,
        and when there was nothing to write."""
        raise NotImplementedError

    def read_bytes(self, path: str, *, revision: str | None = None) -> bytes:
        """The file's content at `revision` (None: the latest); ArtifactNotFound if it is not there."""
        raise NotImplementedError

    def exists(self, path: str, *, revision: str | None = None) -> bool:
        """Whether a file (not a folder) is stored at `path`, at `revision` (None: the latest)."""
        raise NotImplementedError

    def list_files(self, prefix: str) -> list[str]:
        """Every file under the folder `prefix` ("" = everything), recursive, repo-relative, sorted."""
        raise NotImplementedError

    def download(self, prefix: str, dest: Path, *, revision: str | None = None) -> Path:
        """Copy every file under the folder `prefix` at `revision` (None: the latest) to `dest/<path relative to
        prefix>`; returns `dest`. ArtifactNotFound if nothing is under `prefix`."""
        raise NotImplementedError

    def delete_prefix(self, prefix: str, *, message: str) -> None:
        """Remove the folder `prefix` in one commit; nothing happens if it is absent."""
        if self.list_files(prefix):
            self.put({}, message=message, delete_prefixes=[prefix])

    def display_url(self, path: str = "") -> str:
        """A link for humans to the store or a path inside it."""
        raise NotImplementedError

    def put_folder(self, local_dir: Path, prefix: str, *, message: str, replace: bool = True) -> str | None:
        """Store every file under `local_dir` as `prefix/<relative path>`, in one commit. With `replace`,
        what was under `prefix` before is removed in the same commit."""
        local_dir = Path(local_dir)
        if not local_dir.is_dir():
            raise ArtifactStoreError(f"put_folder: {local_dir} is not a directory")
        prefix = _clean_prefix(prefix)
        files: dict[str, bytes | Path] = {
            f"{prefix}/{p.relative_to(local_dir).as_posix()}" if prefix else p.relative_to(local_dir).as_posix(): p
            for p in sorted(local_dir.rglob("*"))
            if p.is_file()
        }
        return self.put(files, message=message, delete_prefixes=[prefix] if replace else ())

    def read_json(self, path: str, *, revision: str | None = None) -> Any:
        return json.loads(self.read_bytes(path, revision=revision))

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.url!r})"


def open_store(url: str, token: str | None = None, *, endpoint: str | None = None,
               cache_dir: Path | None = None, retry_budget_s: float = HUB_RETRY_BUDGET_S) -> ArtifactStore:
    """Open the store named by `url` (see the module docstring).

    `token`: HF token (default: huggingface_hub's lookup, `HF_TOKEN` first). `endpoint`: Hub URL
    (default: `HF_ENDPOINT` as huggingface_hub read it). `cache_dir`: huggingface_hub download cache
    (default: `HF_HUB_CACHE`). `retry_budget_s`: seconds a write keeps retrying transient Hub failures
    (reads: at most `HUB_READ_RETRY_BUDGET_S`). The last four only matter for `hf://` URLs.
    """
    if url.startswith("file:"):
        parsed = urlparse(url)
        root = Path(unquote(parsed.path))
        if parsed.netloc or not root.is_absolute():
            raise ArtifactStoreError(f"bad store URL {url!r}: a file URL needs an absolute path; use {ACCEPTED_URLS}")
        return FileStore(root)
    match = _HUB_URL.match(url)
    if match:
        return HubStore(f"{match[1]}/{match[2]}", token=token, endpoint=endpoint, cache_dir=cache_dir,
                        retry_budget_s=retry_budget_s)
    raise ArtifactStoreError(f"bad store URL {url!r}: use {ACCEPTED_URLS}")


class FileStore(ArtifactStore):
    """A local folder, without revisions (reads ignore `revision`). A `put` first writes every new file into a
    staging folder beside them, and only then removes `delete_prefixes` and renames the files into place, in the
    order given: a write that fails part way (a missing source, a full disk) leaves what was there."""

    def __init__(self, root: Path):
        self.root = Path(root)
        self.url = self.root.as_uri()
        self.root.mkdir(parents=True, exist_ok=True)

    def put(self, files: Mapping[str, bytes | Path], *, message: str, delete_prefixes: Sequence[str] = (),
            retry_budget_s: float | None = None) -> None:
        targets = {_clean_path(path): content for path, content in files.items()}
        prefixes = [_clean_prefix(prefix, allow_root=False) for prefix in delete_prefixes]
        # In the store's own folder, so that the renames below stay on one file system (and so atomic).
        staging = Path(tempfile.mkdtemp(dir=self.root, prefix=".put-", suffix=_PARTIAL_SUFFIX))
        try:
            staged = {}
            for number, (path, content) in enumerate(targets.items()):
                staged[path] = staging / str(number)
                if isinstance(content, bytes):
                    staged[path].write_bytes(content)
                else:
                    shutil.copyfile(content, staged[path])
            for prefix in prefixes:
                shutil.rmtree(self.root / prefix, ignore_errors=True)
            for path, source in staged.items():
                target = self.root / path
                target.parent.mkdir(parents=True, exist_ok=True)
                os.replace(source, target)
        finally:
            shutil.rmtree(staging, ignore_errors=True)

    def read_bytes(self, path: str, *, revision: str | None = None) -> bytes:
        try:
            return (self.root / _clean_path(path)).read_bytes()
        except (FileNotFoundError, IsADirectoryError, NotADirectoryError) as e:
            raise ArtifactNotFound(f"{self.url}: no artifact at {path!r}") from e

    def exists(self, path: str, *, revision: str | None = None) -> bool:
        return (self.root / _clean_path(path)).is_file()

    def list_files(self, prefix: str) -> list[str]:
        base = self.root / _clean_prefix(prefix)
        if not base.is_dir():
            return []
        return sorted(
            p.relative_to(self.root).as_posix()
            for p in base.rglob("*")
            if p.is_file() and not any(part.endswith(_PARTIAL_SUFFIX) for part in p.relative_to(self.root).parts)
        )

    def download(self, prefix: str, dest: Path, *, revision: str | None = None) -> Path:
        prefix = _clean_prefix(prefix)
        files = self.list_files(prefix)
        if not files:
            raise ArtifactNotFound(f"{self.url}: nothing under {prefix + '/'!r}")
        dest = Path(dest)
        for path in files:
            target = dest / _relative_to_prefix(path, prefix)
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(self.root / path, target)
        return dest

    def display_url(self, path: str = "") -> str:
        return (self.root / path).as_uri() if path else self.url


class HubStore(ArtifactStore):
    """A private Hugging Face dataset repo; every write is one `create_commit`.

    Every Hub call goes through `_call`, which retries transient failures and maps errors. Only calls
    that are safe to repeat go there: reads, and commits, which are atomic on the Hub (a refused one
    changed nothing) and which `put` rebuilds on each try (see there).
    """

    repo_type = "dataset"

    def __init__(self, repo_id: str, *, token: str | None = None, endpoint: str | None = None,
                 cache_dir: Path | None = None, retry_budget_s: float = HUB_RETRY_BUDGET_S):
        self.repo_id = repo_id
        self.url = f"hf://datasets/{repo_id}"
        self.retry_budget_s = retry_budget_s
        self._read_budget_s = min(retry_budget_s, HUB_READ_RETRY_BUDGET_S)
        self._token = token
        self._api = HfApi(endpoint=endpoint, token=token, library_name="loraflow")
        self._cache_dir = cache_dir
        self._call("open", self._create_private_repo, budget_s=self._read_budget_s)

    def _create_private_repo(self) -> None:
        self._api.create_repo(self.repo_id, repo_type=self.repo_type, private=True, exist_ok=True)
        # create_repo leaves an existing repo as it is: force private, run artifacts are not public.
        self._api.update_repo_settings(self.repo_id, repo_type=self.repo_type, private=True)

    @property
    def endpoint(self) -> str:
        return self._api.endpoint

    def put(self, files: Mapping[str, bytes | Path], *, message: str, delete_prefixes: Sequence[str] = (),
            retry_budget_s: float | None = None) -> str | None:
        additions = {_clean_path(path): content if isinstance(content, bytes) else str(content)
                     for path, content in files.items()}
        prefixes = [_clean_prefix(prefix, allow_root=False) for prefix in delete_prefixes]

        def commit() -> str | None:
            # Built afresh on each try, so retrying a commit that did land (after a timeout) is harmless: gone
            # folders are not deleted again (that fails with 404), and the client drops unchanged files.
            operations: list[CommitOperationAdd | CommitOperationDelete] = [
                CommitOperationDelete(path_in_repo=f"{prefix}/", is_folder=True)
                for prefix in prefixes if self._tree_files(prefix)
            ]
            operations += [CommitOperationAdd(path_in_repo=path, path_or_fileobj=source)
                           for path, source in additions.items()]
            if not operations:
                return None
            # One create_commit is one commit; upload_folder may split into several (hf-hub-api §6). A retry whose
            # files all landed already commits nothing, and the client answers with the branch's head: it holds them.
            return self._api.create_commit(self.repo_id, operations, commit_message=message,
                                           repo_type=self.repo_type, revision=HUB_BRANCH).oid

        if not (additions or prefixes):
            return None
        return self._call("commit to", commit,
                          budget_s=self.retry_budget_s if retry_budget_s is None else retry_budget_s)

    def read_bytes(self, path: str, *, revision: str | None = None) -> bytes:
        path = _clean_path(path)
        return Path(self._call("read", lambda: self._api.hf_hub_download(
            self.repo_id, path, repo_type=self.repo_type, revision=revision or HUB_BRANCH, cache_dir=self._cache_dir),
            path=path, revision=revision, budget_s=self._read_budget_s)).read_bytes()

    def exists(self, path: str, *, revision: str | None = None) -> bool:
        path = _clean_path(path)
        return self._call("check", lambda: self._api.file_exists(
            self.repo_id, path, repo_type=self.repo_type, revision=revision or HUB_BRANCH), path=path,
            revision=revision, budget_s=self._read_budget_s)

    def list_files(self, prefix: str) -> list[str]:
        prefix = _clean_prefix(prefix)
        return self._call("list", lambda: self._tree_files(prefix), path=prefix, budget_s=self._read_budget_s)

    def _tree_files(self, prefix: str) -> list[str]:
        """`list_files` in one try, with huggingface_hub's errors (for use inside a retried call)."""
        try:
            entries = list(self._api.list_repo_tree(self.repo_id, path_in_repo=prefix or None, recursive=True,
                                                    repo_type=self.repo_type, revision=HUB_BRANCH))
        except RemoteEntryNotFoundError:  # the folder is not there
            return []
        return sorted(
            e.path for e in entries
            if isinstance(e, RepoFile) and _is_under(e.path, prefix) and e.path != HUB_GITATTRIBUTES
        )

    def download(self, prefix: str, dest: Path, *, revision: str | None = None) -> Path:
        prefix = _clean_prefix(prefix)
        snapshot = Path(self._call("download", lambda: self._api.snapshot_download(
            self.repo_id, repo_type=self.repo_type, revision=revision or HUB_BRANCH, cache_dir=self._cache_dir,
            allow_patterns=[glob.escape(prefix) + "/*"] if prefix else None,
            ignore_patterns=None if prefix else [HUB_GITATTRIBUTES],
        ), path=prefix, revision=revision, budget_s=self._read_budget_s))
        source = snapshot / prefix if prefix else snapshot
        files = sorted(p for p in source.rglob("*") if p.is_file()) if source.is_dir() else []
        if not files:
            raise ArtifactNotFound(f"{self.url}: nothing under {prefix + '/'!r}")
        dest = Path(dest)
        for file in files:
            target = dest / file.relative_to(source)
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(file, target)  # follows the cache's symlink to the blob
        return dest

    def display_url(self, path: str = "") -> str:
        return f"{self.endpoint}/datasets/{self.repo_id}/tree/{HUB_BRANCH}/{path}".rstrip("/")

    def _call(self, action: str, call: Callable[[], _T], *, path: str | None = None, revision: str | None = None,
              budget_s: float) -> _T:
        """`call()`, tried again after transient failures until `budget_s` is spent; errors mapped to store errors."""
        def warn(details: dict) -> None:
            status = _status(error := details["exception"])
            log.warning("cannot %s %s yet (%s): trying again in %.1f s (try %d; %.0f of %.0f s retry budget spent)",
                        action, self.url, type(error).__name__ if status is None else f"HTTP {status}",
                        details["wait"], details["tries"], details["elapsed"], budget_s)

        spent: dict = {}  # backoff's details (tries, elapsed) when it gives up
        retrying = backoff.on_exception(
            _hub_waits, (HfHubHTTPError, LocalEntryNotFoundError, httpx2.TransportError),
            giveup=lambda e: not _transient(e), max_time=budget_s, jitter=None,  # _hub_waits jitters itself
            on_backoff=warn, on_giveup=spent.update, logger=None, max_wait_s=HUB_MAX_WAIT_S,
        )(call)
        try:
            with self._hub_errors(action, path, revision):
                return retrying()
        except ArtifactStoreError as e:
            if not e.transient:
                raise
            raise ArtifactStoreError(f"{e} Gave up after {spent['tries']} tries in {spent['elapsed']:.0f} s "
                                     f"(retry budget {budget_s:.0f} s).", transient=True) from e.__cause__

    @contextlib.contextmanager
    def _hub_errors(self, action: str, path: str | None = None, revision: str | None = None) -> Iterator[None]:
        """The one place that turns huggingface_hub errors into store errors that say what to check."""
        where = f"{self.url} (endpoint {self.endpoint})"
        try:
            yield
        except RepositoryNotFoundError as e:  # also GatedRepoError; 401 for a bad or missing token
            raise ArtifactStoreError(self._scrub(
                f"cannot {action} {where}: the repo is missing or this token cannot access it. Check the repo "
                f"id, that HF_TOKEN (or the token passed) has write access to it, and HF_ENDPOINT. ({e})"
            )) from e
        except RevisionNotFoundError as e:
            missing = (f"revision {revision!r} not found: the commit the run recorded is not in this repo (was its "
                       "history rewritten?)" if revision else
                       f"branch {HUB_BRANCH!r} not found; the repo may be empty or broken")
            raise ArtifactStoreError(self._scrub(f"cannot {action} {where}: {missing}. ({e})")) from e
        except RemoteEntryNotFoundError as e:
            raise ArtifactNotFound(f"{self.url}: no artifact at {path!r}") from e
        except LocalEntryNotFoundError as e:  # raised when the Hub could not be reached and nothing is cached
            raise ArtifactStoreError(self._scrub(
                f"cannot {action} {path!r} in {where}: the Hub did not answer and no cached copy exists. Check "
                f"the network and HF_ENDPOINT. ({e})"
            ), transient=_transient(e)) from e
        except HfHubHTTPError as e:
            status = _status(e)
            if status == 429:
                hint = (f"the Hub's rate limit was hit (commits: about {HUB_COMMITS_PER_HOUR} per hour per repo). "
                        "Batch files into fewer commits, or retry later")
            elif status in (401, 403):
                hint = "the token was refused; check that HF_TOKEN (or the token passed) has write access"
            else:
                hint = "the Hub refused the request"
            raise ArtifactStoreError(self._scrub(f"cannot {action} {where}: {hint}. ({e})"),
                                     transient=_transient(e)) from e
        except httpx2.TransportError as e:
            raise ArtifactStoreError(
                f"cannot {action} {where}: the Hub could not be reached ({type(e).__name__}). Check the network "
                "and HF_ENDPOINT.", transient=True,
            ) from e

    def _scrub(self, message: str) -> str:
        # Server messages do not echo the token, but a message must never carry it, whatever the server says.
        return message.replace(self._token, "***") if self._token else message


def _status(error: BaseException) -> int | None:
    """The HTTP status behind a huggingface_hub error; None when the Hub did not answer."""
    if isinstance(error, LocalEntryNotFoundError) and error.__cause__ is not None:
        return _status(error.__cause__)  # hf_hub_download's "nothing cached": the cause is what the Hub said
    return error.response.status_code if isinstance(error, HfHubHTTPError) and error.response is not None else None


def _transient(error: BaseException) -> bool:
    """Whether the same call may pass later unchanged: 408, 429, 5xx, or no answer at all."""
    status = _status(error)
    if status is None:
        return isinstance(error, (LocalEntryNotFoundError, httpx2.TransportError))
    return status in (408, 429) or status >= 500


def _hub_waits(*, max_wait_s: float) -> Generator[float, BaseException, None]:
    """backoff wait generator (it sends each failure in): `Retry-After`, or a spent `RateLimit` bucket's reset
    on a 429 (as the Hub's client reads them), else exponential with full jitter; at most `max_wait_s`."""
    exponential = backoff.expo(factor=HUB_FIRST_WAIT_S, max_value=max_wait_s)
    next(exponential)  # past its priming yield
    error = yield 0.0  # primed by backoff with send(None); the value is discarded
    while True:
        asked = None
        if isinstance(error, HfHubHTTPError) and error.response is not None:
            retry_after = error.response.headers.get("Retry-After", "").strip()
            bucket = parse_ratelimit_headers(error.response.headers)
            if retry_after.isdigit():  # an HTTP-date is allowed too, but the Hub sends seconds
                asked = float(retry_after)
            elif error.response.status_code == 429 and bucket is not None and bucket.remaining == 0:
                asked = float(bucket.reset_in_seconds)
        error = yield min(asked, max_wait_s) if asked is not None else backoff.full_jitter(next(exponential))


def _clean_path(path: str) -> str:
    """A file path inside a store: relative POSIX, no empty, `.` or `..` segments."""
    parts = path.split("/")
    if not path or "\\" in path or any(part in ("", ".", "..") for part in parts):
        raise ArtifactStoreError(f"bad artifact path {path!r}: use a relative POSIX path such as 'runs/abc/DONE'")
    return path


def _clean_prefix(prefix: str, *, allow_root: bool = True) -> str:
    """A folder inside a store, without trailing slash; "" is the whole store."""
    stripped = prefix.strip("/")
    if not stripped:
        if not allow_root:
            raise ArtifactStoreError("refusing to delete the whole store: give a folder such as 'runs/abc'")
        return ""
    return _clean_path(stripped)


def _is_under(path: str, prefix: str) -> bool:
    return not prefix or path.startswith(prefix + "/")


def _relative_to_prefix(path: str, prefix: str) -> str:
    return path[len(prefix) + 1:] if prefix else path
