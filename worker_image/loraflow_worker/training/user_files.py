"""The files a run ships in its artifact store (its dataset files, evaluation file, chat template, reward files, tools
and environment files, grader files): read exactly as the control plane stored them (`RunFilesStore`), and the Python ones imported
on the worker, each as a module of its own."""

from __future__ import annotations

import importlib.util
import re
import sys
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from types import ModuleType
from typing import Any

from loraflow_worker.artifacts import ArtifactChanged, ArtifactNotFound, ArtifactStore
from loraflow_worker.artifacts.pins import check_sha256, sha256_hex
from loraflow_worker.contract import EvaluateInput, JobInput


class UserFileError(ValueError):
    """A run's file cannot be read from the store or imported."""


class RunFilesStore(ArtifactStore):
    """The run's store as its training process (or an evaluate job) reads it. The job's own files (`input_files()`) are
    read at the commit where the control plane stored them (`inputs.revision`), and one whose sha256 is not the one the
    control plane recorded raises `ArtifactChanged`: a teammate who can write the store cannot change a started run.
    Everything else (checkpoints, a parent adapter, what the run writes) goes to the store as it is.

    Every such file is read through `read_bytes`, the one place of the check; `read_sha256` keeps the hash of each
    file read, for the run's manifest."""

    def __init__(self, store: ArtifactStore, job: JobInput | EvaluateInput):
        self.store = store
        self.url = store.url
        self._files = job.input_files()
        self._inputs = job.inputs
        self.read_sha256: dict[str, str] = {}

    def read_bytes(self, path: str, *, revision: str | None = None) -> bytes:
        if path not in self._files:
            return self.store.read_bytes(path, revision=revision)
        pinned = self._inputs
        data = self.store.read_bytes(path, revision=pinned.revision if pinned else None)
        found = sha256_hex(data)
        if pinned is not None:
            check_sha256(path, found, pinned.sha256[path], since=f"after the control plane stored it for the run "
                         f"({self._files[path]}): the run was started with the file it stored")
        self.read_sha256[path] = found
        return data

    def put(self, files: Mapping[str, bytes | Path], *, message: str, delete_prefixes: Sequence[str] = (),
            retry_budget_s: float | None = None) -> str | None:
        return self.store.put(files, message=message, delete_prefixes=delete_prefixes, retry_budget_s=retry_budget_s)

    def exists(self, path: str, *, revision: str | None = None) -> bool:
        return self.store.exists(path, revision=revision)

    def list_files(self, prefix: str) -> list[str]:
        return self.store.list_files(prefix)

    def download(self, prefix: str, dest: Path, *, revision: str | None = None) -> Path:
        return self.store.download(prefix, dest, revision=revision)

    def display_url(self, path: str = "") -> str:
        return self.store.display_url(path)


def import_stored_file(store: ArtifactStore, store_path: str, files_dir: Path) -> ModuleType:
    """The module of the file at `store_path` in `store`, copied into `files_dir` first. UserFileError when the file
    is not in the store, changed after the run was started, or raises while it is imported."""
    try:
        source = store.read_bytes(store_path)
    except ArtifactNotFound as e:
        raise UserFileError(f"{store_path} is not in the artifact store ({e})") from e
    except ArtifactChanged as e:
        raise UserFileError(str(e)) from e
    local = files_dir / store_path
    local.parent.mkdir(parents=True, exist_ok=True)
    local.write_bytes(source)
    # One module per stored file, under a name no installed package has; registered before it runs, as an
    # import would, so that the file's dataclasses and pickling find their module.
    module_name = "loraflow_run_file_" + re.sub(r"\W", "_", store_path.removesuffix(".py"))
    module_spec = importlib.util.spec_from_file_location(module_name, local)
    module = importlib.util.module_from_spec(module_spec)
    sys.modules[module_name] = module
    try:
        module_spec.loader.exec_module(module)
    except Exception as e:  # noqa: BLE001 - whatever the user's file raises, the job must say which file failed
        del sys.modules[module_name]
        raise UserFileError(f"importing it failed: {type(e).__name__}: {e}") from e
    return module


def import_stored_function(store: ArtifactStore, store_path: str, attribute: str,
                           files_dir: Path) -> Callable[..., Any]:
    """The function `attribute` of the file at `store_path` (`import_stored_file`). UserFileError as that says, or when
    the file has no such function."""
    module = import_stored_file(store, store_path, files_dir)
    function = vars(module).get(attribute)
    if not callable(function):
        found = "is not a function" if attribute in vars(module) else "does not exist"
        raise UserFileError(f"`{attribute}` {found} in the file")
    return function
