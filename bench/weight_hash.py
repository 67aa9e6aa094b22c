"""What checking a cached model against the Hub's hashes costs (`loraflow_worker.runtime.cache_check`), per GB and
projected for a 16 GB model, against merely reading the same bytes, measured in one run.

    .venv-worker/bin/python bench/weight_hash.py
    .venv-worker/bin/python bench/weight_hash.py --files 4 --file-mib 1024 --repeats 5

Writes `--files` safetensors-sized files of `--file-mib` MiB (random bytes) to a temporary folder (refused when the
disk has not twice that free: the bench never writes a whole 16 GB model), then, `--repeats` times in alternating
order, reads them one after the other in the check's 8 MiB chunks without hashing (the baseline), hashes them one
after the other with the worker's own `file_hash` as sha256 (what an LFS weight file is checked by) and as a git blob
sha1 (the small files), and runs the worker's whole check (`check_snapshot`, which hashes `HASH_THREADS` files at
once) on them as a snapshot of LFS files. Each pass runs twice: warm (the files in the page cache, so hashing is
measured against memory-speed reads) and cold (the files' pages dropped first with `posix_fadvise(DONTNEED)`, which
touches no other file, so the read comes from disk as the first read of a model on a volume does). Prints the
medians: GB/s, the time against the read's, the cost beyond the read per GB, and the seconds projected for 16 GB.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "worker_image"))  # run as a script from anywhere

from huggingface_hub.hf_api import BlobLfsInfo, RepoSibling  # noqa: E402

from loraflow_worker.runtime.cache_check import CHUNK_BYTES, HASH_THREADS, check_snapshot, file_hash  # noqa: E402

MODEL_GB = 16.0  # the model size the projection is for
BLOCK_BYTES = 64 * 1024 * 1024  # random bytes written repeatedly into each file


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--files", type=int, default=4, help="files in the set (a model's shards)")
    parser.add_argument("--file-mib", type=int, default=512, help="size of each file, MiB")
    parser.add_argument("--repeats", type=int, default=3, help="times each pass runs (medians are printed)")
    parser.add_argument("--dir", default=None, help="where to write the files (default: the system's temp folder)")
    args = parser.parse_args()

    total = args.files * args.file_mib * 1024 * 1024
    base = Path(args.dir or tempfile.gettempdir())
    free = shutil.disk_usage(base).free
    if free < 2 * total:
        sys.exit(f"{base} has {free / 1e9:.1f} GB free; the bench writes {total / 1e9:.1f} GB and wants twice that "
                 "free: lower --files or --file-mib, or name another --dir")
    with tempfile.TemporaryDirectory(prefix="weight-hash-", dir=base) as folder:
        snapshot = Path(folder) / "snapshot"
        siblings = write_files(snapshot, args.files, args.file_mib)
        files = [snapshot / sibling.rfilename for sibling in siblings]
        print(f"{args.files} files of {args.file_mib} MiB ({total / 1e9:.2f} GB) in {folder}; "
              f"{args.repeats} repeats, {CHUNK_BYTES // (1024 * 1024)} MiB reads, {HASH_THREADS} hashing threads "
              f"in the check ({os.cpu_count()} CPUs)")
        passes: dict[str, Callable[[], object]] = {
            "read": lambda: [read_only(path) for path in files],
            "sha256": lambda: [file_hash(path, "sha256") for path in files],
            "git-sha1": lambda: [file_hash(path, "git-sha1") for path in files],
            "check": lambda: check_snapshot("bench/model", "0" * 40, snapshot, Path(folder), siblings),
        }
        for cache in ("warm", "cold"):
            seconds: dict[str, list[float]] = {name: [] for name in passes}
            for repeat in range(args.repeats):
                order = list(passes) if repeat % 2 == 0 else list(reversed(passes))
                for name in order:
                    seconds[name].append(timed(files, passes[name], cold=cache == "cold"))
            assert not passes["check"]().downloaded_again, "the bench's own files failed the check"
            report(cache, total, {name: statistics.median(times) for name, times in seconds.items()})


def write_files(folder: Path, count: int, mib: int) -> list[RepoSibling]:
    """`count` files of `mib` MiB in `folder`, and what the Hub would list for them as LFS files."""
    folder.mkdir()
    block = os.urandom(BLOCK_BYTES)
    siblings = []
    for number in range(1, count + 1):
        name = f"model-{number:05d}-of-{count:05d}.safetensors"
        digest, size = hashlib.sha256(), mib * 1024 * 1024
        with open(folder / name, "wb") as file:
            left = size
            while left:
                chunk = block[:min(left, BLOCK_BYTES)]
                left -= file.write(chunk)
                digest.update(chunk)
            file.flush()
            os.fsync(file.fileno())
        siblings.append(RepoSibling(rfilename=name, size=size, blob_id="0" * 40,
                                    lfs=BlobLfsInfo(size=size, sha256=digest.hexdigest(), pointer_size=134)))
    return siblings


def read_only(path: Path) -> None:
    """The baseline: what `file_hash` does, without the hashing."""
    buffer = memoryview(bytearray(CHUNK_BYTES))
    with open(path, "rb") as file:
        while file.readinto(buffer):
            pass


def timed(files: list[Path], work: Callable[[], object], *, cold: bool) -> float:
    if cold:
        for path in files:
            with open(path, "rb") as file:
                os.posix_fadvise(file.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
    started = time.perf_counter()
    work()
    return time.perf_counter() - started


def report(cache: str, total: int, seconds: dict[str, float]) -> None:
    read = seconds["read"]
    state = "page cache dropped before each pass" if cache == "cold" else "files in the page cache"
    print(f"--- {cache} ({state}) ---")
    gb = total / 1e9
    print(f"{'read only:':<21}{gb / read:6.2f} GB/s ({read:.2f} s)  baseline; "
          f"{MODEL_GB:.0f} GB: {read / gb * MODEL_GB:.0f} s")
    for name, label in (("sha256", "sha256, one by one:"), ("git-sha1", "git-sha1, one by one:"),
                        ("check", "the check:")):
        hashed = seconds[name]
        print(f"{label:<21}{gb / hashed:6.2f} GB/s ({hashed:.2f} s)  ×{hashed / read:.2f} the read; "
              f"{max(hashed - read, 0.0) / gb:.2f} s/GB beyond it; {MODEL_GB:.0f} GB projected: "
              f"{hashed / gb * MODEL_GB:.0f} s")


if __name__ == "__main__":
    main()
