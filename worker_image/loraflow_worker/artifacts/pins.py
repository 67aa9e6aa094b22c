"""Pinned files: the sha256 a writer records of what it stored, and the one check that what a reader gets back from the
store is that.

Whoever may write the artifact store (a team shares one) could otherwise change a run's reward file after the control
plane stored it, or swap a finished run's adapter before it is published. On the Hub a reader also reads at the
commit the writer made (`revision`); a `file://` store has no revisions, and there the hash alone protects it.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from loraflow_worker.artifacts.store import ArtifactStore

_CHUNK_BYTES = 1 << 20


class ArtifactChanged(Exception):
    """A file read back from the store is not the one that was stored: its sha256 differs from the one recorded
    when it was stored, or it is missing or new. The message names the file and both hashes."""


def sha256_hex(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def file_sha256(path: Path) -> str:
    """sha256 of a local file, read in chunks (an adapter's weights can be gigabytes)."""
    digest = hashlib.sha256()
    with open(path, "rb") as source:
        while chunk := source.read(_CHUNK_BYTES):
            digest.update(chunk)
    return digest.hexdigest()


def folder_sha256(folder: Path) -> dict[str, str]:
    """Path relative to `folder` (POSIX) → sha256, for every file under it."""
    return {path.relative_to(folder).as_posix(): file_sha256(path)
            for path in sorted(Path(folder).rglob("*")) if path.is_file()}


def check_sha256(path: str, found: str, expected: str, *, since: str) -> None:
    """ArtifactChanged naming `path`, both hashes and `since` (when the hash was recorded, e.g. "after the run stored
    it") unless `found` is `expected`."""
    if found != expected:
        raise ArtifactChanged(f"{path} changed {since}: its sha256 was {expected} then and is {found} now. Someone "
                              "with write access to the artifact store replaced it; nothing was read from it")


def download_pinned(store: ArtifactStore, prefix: str, dest: Path, *, revision: str | None,
                    sha256: Mapping[str, str], since: str) -> Path:
    """`store.download(prefix, dest)` at `revision`, then every file checked against `sha256` (path relative to
    `prefix` → sha256): a file that differs, is missing or was added raises ArtifactChanged. An empty `sha256` checks
    nothing (a run stored before its worker recorded hashes: contract version 9 and earlier)."""
    dest = store.download(prefix, dest, revision=revision)
    if not sha256:
        return dest
    found = folder_sha256(dest)
    for name in sorted(found.keys() | sha256.keys()):
        where = f"{prefix}/{name}"
        if name not in sha256:
            raise ArtifactChanged(f"{where} was added {since}: it is not among the files recorded then "
                                  f"({', '.join(sorted(sha256))}). Someone with write access to the artifact store "
                                  "put it there")
        if name not in found:
            raise ArtifactChanged(f"{where} was removed {since}. Someone with write access to the artifact store "
                                  "deleted it")
        check_sha256(where, found[name], sha256[name], since=since)
    return dest
