"""A model cached on the shared network volume is checked against the Hub's hashes before it is loaded.

The volume's Hub cache is shared by every run in its datacenter, and a run's own code can write it: a weight file
rewritten there would be trained on, or merged into, by every later run that reads it. So a job that resolves its
base model from the volume (`model_cache.resolve_base_model`: training and merge jobs) checks each file of the
snapshot it is about to load against what the Hub lists for that file at the pinned commit
(`model_info(files_metadata=True)`):

- a file the Hub stores in LFS (the weights): the sha256 of its bytes against the Hub's `lfs.sha256` (the name
  huggingface_hub gives its blob);
- every other file (config.json, the tokenizer's files, the safetensors index): the git blob sha1 of its bytes
  (`sha1(b"blob <size>\\0" + bytes)`) against the Hub's `blobId`. These are small, but they decide as much as the
  weights do (config.json the architecture and dtype, the tokenizer's chat template every example), and hashing
  them is the same code and cheaper than downloading them again, so they are checked like the weights.

The size is compared first, so a file of the wrong size (or no regular file at all: a link to a device would never
end) is rejected without reading it. A file that differs, or is missing, is logged (the file, the Hub's hash, what
the volume holds), removed from the cache (its snapshot link and the blob of the Hub's name) and downloaded again
with `force_download` (so neither that blob nor huggingface_hub's shared Xet blob store is reused), then checked
again: a second mismatch fails the job (`CachedModelCorrupt`). A file in the snapshot folder that is not one of the
files loraflow downloads is removed: transformers picks files up by name (an `adapter_config.json` makes it load
an adapter; a `tokenizer.json` wins over `tokenizer.model`), so a planted file changes what is loaded as surely as a
rewritten one.

Not covered: a writer racing the load, between the check and the read. The check catches what was rewritten at
rest, by an earlier run, which is what a warm cache shared across runs exposes. The container's own cache (no
volume) is not checked: only this run's jobs write it.

Cost: one read of every file, which the load would do anyway (and finds in the page cache after it), plus about
half a CPU-second per GB for sha256 (1.6 GB/s on one core: about 10 s for a 16 GB model), spread over
`HASH_THREADS` files at once; `bench/weight_hash.py` measures it against a plain read of the same bytes. The log
line says how many bytes were hashed in how long.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import stat
import time
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from huggingface_hub import hf_hub_download
from huggingface_hub.hf_api import RepoSibling

CHUNK_BYTES = 8 * 1024 * 1024
"""Read size while hashing: large enough that a read call costs nothing next to hashing it, small enough to keep
memory flat whatever the file's size."""
HASH_THREADS = min(8, os.cpu_count() or 1)
"""Files hashed at once. The training process has the host's cores to itself at this point, before the model loads."""

log = logging.getLogger("loraflow_worker")


class CachedModelCorrupt(RuntimeError):
    """A file of the volume's cached model still differs from the Hub's after it was downloaded again."""


@dataclass(frozen=True)
class HubHash:
    """What the Hub says one file of a commit is."""

    algorithm: str
    """`sha256` (an LFS file) or `git-sha1` (a file stored in git)."""
    hexdigest: str
    """Also the file's blob name in a Hub cache (the download's ETag)."""
    size: int


@dataclass(frozen=True)
class SnapshotCheck:
    """What checking one cached snapshot did."""

    files: int
    bytes_hashed: int
    """Every byte read, the files downloaded again included."""
    seconds: float
    downloaded_again: list[str]
    removed: list[str]
    """Files in the snapshot folder that are not the model's."""


def hub_hash(sibling: RepoSibling) -> HubHash:
    """The hash the Hub gives for `sibling` (from `model_info(files_metadata=True)`)."""
    if sibling.lfs is not None:
        return HubHash("sha256", sibling.lfs.sha256, sibling.lfs.size)
    if sibling.blob_id and sibling.size is not None:
        return HubHash("git-sha1", sibling.blob_id, sibling.size)
    raise ValueError(f"the Hub listed {sibling.rfilename} without its hash (blobId, lfs.sha256): ask for "
                     "model_info(files_metadata=True)")


def file_hash(path: Path, algorithm: str) -> str:
    """The `algorithm` hash (`sha256` or `git-sha1`) of the file at `path`, read in `CHUNK_BYTES` chunks."""
    with open(path, "rb") as file:
        size = os.fstat(file.fileno()).st_size
        digest = hashlib.sha256() if algorithm == "sha256" else hashlib.sha1(b"blob %d\0" % size)
        buffer = memoryview(bytearray(CHUNK_BYTES))
        while read := file.readinto(buffer):
            digest.update(buffer[:read])
    return digest.hexdigest()


def check_snapshot(repo_id: str, sha: str, snapshot: Path, cache_dir: Path,
                   files: Iterable[RepoSibling]) -> SnapshotCheck:
    """Check the snapshot folder `snapshot` of `repo_id` at commit `sha` in the Hub cache `cache_dir`, whose files
    should be `files` (the Hub's listing, as downloaded): download again what differs, remove what is not one of
    them (see the module docstring). Raises `CachedModelCorrupt` when a file differs once downloaded again."""
    started = time.monotonic()
    expected = {sibling.rfilename: hub_hash(sibling) for sibling in files}
    removed = _remove_others(snapshot, set(expected))
    # The shards are hashed side by side: hashlib releases the GIL while it hashes a chunk, and a network volume serves
    # several streams faster than one.
    with ThreadPoolExecutor(max_workers=HASH_THREADS) as pool:
        first = dict(zip(expected, pool.map(lambda item: _found(snapshot / item[0], item[1]), expected.items())))
    hashed, downloaded_again = sum(read for _, read in first.values()), []
    for name, want in expected.items():
        found = first[name][0]
        if found == want.hexdigest:
            continue
        log.warning("%s of %s@%s on the volume is not the Hub's: the Hub has %s %s (%d bytes), the volume holds %s; "
                    "removing it and downloading it again", name, repo_id, sha[:12], want.algorithm, want.hexdigest,
                    want.size, _describe(found, want))
        _download_again(repo_id, sha, name, want, snapshot, cache_dir)
        found, read = _found(snapshot / name, want)
        hashed += read
        if found != want.hexdigest:
            raise CachedModelCorrupt(
                f"{name} of {repo_id}@{sha}: downloaded again into {cache_dir}, it still is not the Hub's "
                f"({want.algorithm} {want.hexdigest}, {want.size} bytes): the volume holds {_describe(found, want)}. "
                "Either something rewrites the volume's cache while this job reads it or the Hub served other bytes "
                "than it lists; the job stops rather than load them"
            )
        downloaded_again.append(name)
    check = SnapshotCheck(files=len(expected), bytes_hashed=hashed, seconds=time.monotonic() - started,
                          downloaded_again=downloaded_again, removed=removed)
    log.info("checked %s@%s on the volume against the Hub's hashes: %d files, %.1f MB hashed in %.2f s (%.0f MB/s); "
             "downloaded again: %s; removed: %s", repo_id, sha[:12], check.files, check.bytes_hashed / 1e6,
             check.seconds, check.bytes_hashed / 1e6 / max(check.seconds, 1e-9),
             ", ".join(downloaded_again) or "none", ", ".join(removed) or "none")
    return check


def _found(path: Path, want: HubHash) -> tuple[str | None, int]:
    """The hash of the file at `path` and the bytes read for it; None (nothing read) when it is missing, is no
    regular file, or its size is not the Hub's."""
    try:
        info = path.stat()  # through the snapshot's link to its blob
    except OSError:
        return None, 0
    if not stat.S_ISREG(info.st_mode) or info.st_size != want.size:
        return None, 0
    return file_hash(path, want.algorithm), info.st_size


def _describe(found: str | None, want: HubHash) -> str:
    return f"{want.algorithm} {found}" if found else "no file of that size"


def _download_again(repo_id: str, sha: str, name: str, want: HubHash, snapshot: Path, cache_dir: Path) -> None:
    _remove(snapshot / name)
    # The blob is named by the Hub's hash whatever it holds, and a blob of that name would be linked, not fetched.
    _remove(snapshot.parent.parent / "blobs" / want.hexdigest)
    hf_hub_download(repo_id, name, revision=sha, cache_dir=cache_dir, force_download=True)


def _remove_others(snapshot: Path, names: set[str]) -> list[str]:
    """Remove from `snapshot` every file (or link) not in `names`, and the folders left empty; returns what went."""
    removed = []
    for folder, subfolders, entries in os.walk(snapshot, topdown=False):
        here = Path(folder)
        # os.walk lists a link to a folder among the folders without entering it.
        for entry in entries + [d for d in subfolders if (here / d).is_symlink()]:
            name = (here / entry).relative_to(snapshot).as_posix()
            if name not in names:
                _remove(here / entry)
                removed.append(name)
        if here != snapshot and not any(here.iterdir()):
            here.rmdir()
    for name in removed:
        log.warning("removed %s from %s on the volume: it is not one of the model's files", name, snapshot)
    return sorted(removed)


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    else:
        path.unlink(missing_ok=True)
