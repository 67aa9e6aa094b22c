"""A run's local files (its dataset, mix and evaluation files, reward, tools and environment files and chat template),
each read ONCE, before any check reads it; what the checks read and what the store receives is that one read.

A file's path is resolved once (its links followed: the shipped deployments' dataset is a link, as files kept by
git-annex or DVC are), and where it leads must lie inside this server's inputs folder, when it has one. Then the file
is opened without following any link: every folder from the root down that resolved path one by one, each with
`O_NOFOLLOW`, and the file itself with `O_NOFOLLOW`, so a file or folder swapped for a link after its path resolved
(to reach a key file of this machine) is refused, naming the run's field. The bytes are hashed as they
are copied into a private folder of this process (`RunFile.copy`), which every check reads, and the store receives
that copy pinned by that hash (`tasks/storage/artifacts.py`, `publish_run_inputs`): a file swapped after its read (for
a link to a key file, or for other bytes) never reaches the store, and the worker refuses any file whose hash is not
this one. POSIX only (`dir_fd`, `O_NOFOLLOW`), as the control plane is.
"""

from __future__ import annotations

import errno
import hashlib
import os
import stat
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

from tasks.storage.evaluation_inputs import TASK_DIR_FIELDS

_CHUNK_BYTES = 1 << 20
_LINK_ERRNOS = {errno.ELOOP, errno.EMLINK, errno.ENOTDIR}
"""What opening a link with `O_NOFOLLOW` raises: ELOOP (Linux, macOS), EMLINK (FreeBSD); ENOTDIR for a folder that is
now a link (`O_DIRECTORY`)."""


@dataclass(frozen=True)
class RunFile:
    """One local file of a run, as it was read."""

    field: str
    """The run field that names it: `dataset.local_file`, `grpo.rewards[1].name`, `training.chat_template`, ..."""
    path_text: str
    """The path as the run wrote it (relative paths start at the base folder), for messages."""
    location: Path
    """Where it was read: its path with every link resolved."""
    copy: Path
    """The private copy of the bytes read: what the checks read and the store receives."""
    sha256: str
    """sha256 of the bytes read."""


class RunFileRefused(ValueError):
    """A run's file that cannot be read as it must be (a link, not a file, outside the inputs folder, missing); the
    message names the run's field and the fix."""


def read_run_files(local_paths: Sequence[tuple[str, str]], folder: Path, *, base_dir: Path,
                   inputs_dir: Path | None = None) -> dict[str, RunFile]:
    """Read each file of `local_paths` ((field, path as written): `RunSpec.local_paths`; a local model's folder,
    `model.id`, is left where it lies) once into `folder` (private to this process), by its field. Fields that name one
    file share its single read. `RunFileRefused` naming the field for any that cannot be read so."""
    files: dict[str, RunFile] = {}
    read: dict[Path, RunFile] = {}
    for field, path_text in _with_folder_files(local_paths, base_dir, inputs_dir):
        if field == "model.id":
            continue
        location = _location(field, path_text, base_dir, inputs_dir)
        if location in read:
            files[field] = replace(read[location], field=field, path_text=path_text)
            continue
        copy = folder / str(len(read)) / location.name
        read[location] = files[field] = RunFile(field=field, path_text=path_text, location=location, copy=copy,
                                                sha256=_copy_unfollowed(field, path_text, location, copy))
    return files


def _with_folder_files(local_paths: Sequence[tuple[str, str]], base_dir: Path,
                       inputs_dir: Path | None) -> list[tuple[str, str]]:
    """`local_paths` with the benchmarks' task folder (`evaluation.benchmarks.task_dir`, `evaluate.benchmarks.task_dir`) replaced by each of its files,
    as `<field>/<path inside it>`; a link inside it is refused (it could lead out of the folder)."""
    expanded = []
    for field, path_text in local_paths:
        if field not in TASK_DIR_FIELDS:
            expanded.append((field, path_text))
            continue
        folder = _location(field, path_text, base_dir, inputs_dir, folder=True)
        if not folder.is_dir():
            raise RunFileRefused(f"{_where(field, path_text, folder)} is not a folder: name the folder of the "
                                 "harness's task YAML files")
        for parent, folders, names in os.walk(folder):
            for name in sorted(folders + names):
                if (Path(parent) / name).is_symlink():
                    inside = (Path(parent) / name).relative_to(folder)
                    raise RunFileRefused(f"{field} {path_text}: {inside} is a link; put the file itself in the folder")
            for name in sorted(names):
                inside = (Path(parent) / name).relative_to(folder).as_posix()
                expanded.append((f"{field}/{inside}", f"{path_text.rstrip('/')}/{inside}"))
    return expanded


def reward_fields(files: Mapping[str, RunFile]) -> dict[int, RunFile]:
    """The reward files among `files`, by the index of the reward (`grpo.rewards[i].name`) that names each."""
    prefix, suffix = "grpo.rewards[", "].name"
    return {int(field[len(prefix):-len(suffix)]): file for field, file in files.items()
            if field.startswith(prefix) and field.endswith(suffix)}


def _location(field: str, path_text: str, base_dir: Path, inputs_dir: Path | None, folder: bool = False) -> Path:
    path = base_dir / Path(path_text).expanduser()
    if path.name in ("", ".", "..") and not folder:
        raise RunFileRefused(f"{field} {path_text} is a folder, not a file: name the file")
    location = path.resolve()
    if inputs_dir is not None:
        inside = inputs_dir.expanduser().resolve()
        if not location.is_relative_to(inside):
            raise RunFileRefused(f"{_where(field, path_text, location)} is outside this server's inputs folder "
                                 f"{inside} (LORAFLOW_INPUTS_DIR): put the file there and name it by its path inside it")
    return location


def _copy_unfollowed(field: str, path_text: str, location: Path, copy: Path) -> str:
    """Copy the file at `location` to `copy`, opening each folder above it and the file without following a link;
    its sha256."""
    where = _where(field, path_text, location)
    try:
        folder = _open_folder(location.parent)
    except FileNotFoundError as e:
        raise RunFileRefused(f"{where} does not exist (nor does its folder); fix the path (a relative path starts "
                             "at the working folder)") from e
    except OSError as e:
        if e.errno not in _LINK_ERRNOS:
            raise RunFileRefused(f"{where}: its folder cannot be read ({e})") from e
        raise RunFileRefused(f"{where}: a folder above it became a link while it was read; a run's file is read where "
                             "its path lay when checked, never through a link put there since") from e
    try:
        try:
            source = os.open(location.name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=folder)
        except FileNotFoundError as e:
            raise RunFileRefused(f"{where} does not exist or is not a file; fix the path (a relative path starts at "
                                 "the working folder)") from e
        except OSError as e:
            if e.errno not in _LINK_ERRNOS:
                raise RunFileRefused(f"{where} cannot be read ({e})") from e
            raise RunFileRefused(f"{where} became a symbolic link after its path was resolved and checked: a run's "
                                 "file is never read through a link put in its place (it could lead to any file of "
                                 "this machine)") from e
    finally:
        os.close(folder)
    try:
        if not stat.S_ISREG(os.fstat(source).st_mode):
            raise RunFileRefused(f"{where} is not a regular file; name a file")
        copy.parent.mkdir(parents=True, mode=0o700)
        digest = hashlib.sha256()
        with os.fdopen(os.open(copy, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600), "wb") as out:
            while chunk := os.read(source, _CHUNK_BYTES):
                digest.update(chunk)
                out.write(chunk)
        return digest.hexdigest()
    finally:
        os.close(source)


def _where(field: str, path_text: str, location: Path) -> str:
    """The field and the file, as the run names it and, where that differs, where it was looked for."""
    return f"{field} {path_text}" + ("" if str(location) == path_text else f" ({location})")


def _open_folder(folder: Path) -> int:
    """A descriptor of `folder` (absolute, links resolved), reached from the root one folder at a time, none through a
    link. `O_PATH` where there is one (Linux): a folder that may only be searched, not listed, is passed too."""
    flags = os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC | getattr(os, "O_PATH", 0)
    current = os.open(folder.anchor, flags)
    try:
        for part in folder.parts[1:]:
            following = os.open(part, flags | os.O_NOFOLLOW, dir_fd=current)
            os.close(current)
            current = following
    except BaseException:
        os.close(current)
        raise
    return current
