"""A job's rows: each source loaded (a Hub dataset at its config, revision and split, or a JSONL file from the run's
artifact store), converted to TRL's conversational formats (`contract.dataset_formats`, the code the control plane
checked the rows with), mixed when the job gives a `mix`, and the evaluation examples held out or loaded."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from datasets import Dataset, interleave_datasets, load_dataset

from loraflow_worker.artifacts import ArtifactStore
from loraflow_worker.artifacts.manifest import SourceRows
from loraflow_worker.contract import DatasetSource, JobInput, RowFormat, SourceFields
from loraflow_worker.contract.dataset_formats import RowError, mixed_format, to_trl_row, trl_format

MIX_SOURCE_COLUMN = "__loraflow_mix_source"
"""A column that marks each mixed row's source while the mix is drawn, to count them; removed after."""


@dataclass
class JobRows:
    """The training rows of a job, in TRL's formats, and how many each source gave (for the manifest)."""

    rows: Dataset
    sources: list[SourceRows]


def load_job_dataset(source: DatasetSource, store: ArtifactStore, work_dir: Path, seed: int) -> JobRows:
    """The rows of `source`: its one source, or its mix drawn with `seed` (`DatasetSource.mix` says how)."""
    if not source.mix:
        rows = _load_source(source, "dataset", store, work_dir)
        return JobRows(rows, [SourceRows(source=describe_source(source, "dataset"), format=source.format,
                                         rows=len(rows))])
    names = [describe_source(entry, f"dataset.mix[{i}]") for i, entry in enumerate(source.mix)]
    parts = _same_columns([_load_source(entry, f"dataset.mix[{i}]", store, work_dir)
                           for i, entry in enumerate(source.mix)], names)
    tagged = [part.add_column(MIX_SOURCE_COLUMN, [i] * len(part)) for i, part in enumerate(parts)]
    # datasets' `first_exhausted` with probabilities stops at the draw that takes a source's last row: nothing repeats.
    mixed = interleave_datasets(tagged, probabilities=[entry.fraction for entry in source.mix], seed=seed,
                                stopping_strategy="first_exhausted")
    counts = Counter(mixed[MIX_SOURCE_COLUMN])
    return JobRows(mixed.remove_columns(MIX_SOURCE_COLUMN), [
        SourceRows(source=name, format=entry.format, fraction=entry.fraction, rows=counts[i])
        for i, (name, entry) in enumerate(zip(names, source.mix))])


def evaluation_split(rows: Dataset, job: JobInput, store: ArtifactStore,
                     work_dir: Path) -> tuple[Dataset, Dataset | None]:
    """(the rows to train on, the held-out rows to evaluate on) under the job's `evaluation`: a share of `rows` held
    out at random with the job's seed (the same rows on every attempt), or the evaluation file from the store (in its
    own `format` and `columns`); at most `max_samples` of them, a seeded sample. Without `evaluation`, or one of task
    evaluations and benchmarks alone: (`rows`, None)."""
    settings, seed = job.evaluation, job.training.seed
    if settings is None or not settings.held_out:
        return rows, None
    if settings.fraction is not None:
        if len(rows) < 2:
            raise ValueError(f"`evaluation.fraction` needs at least 2 examples to hold some out; the dataset has "
                             f"{len(rows)}: add examples or give an evaluation file (`evaluation.local_file`)")
        split = rows.train_test_split(test_size=settings.fraction, seed=seed)
        rows, held_out = split["train"], split["test"]
    else:
        held_out = _to_trl(_load_store_jsonl(store, settings.store_path, work_dir / "data" / "eval.jsonl"), settings,
                           f"evaluation file {settings.store_path}")
    if len(held_out) > settings.max_samples:
        held_out = held_out.shuffle(seed=seed).select(range(settings.max_samples))
    return rows, held_out


def describe_source(source: SourceFields, field: str) -> str:
    """`source` as errors and the manifest name it: the job's field, then what it reads."""
    if source.hub_id is None:
        return f"{field} (file {source.store_path})"
    at = [f"config {source.config}" if source.config else "", f"revision {source.revision}" if source.revision else "",
          f"split {source.split}"]
    return f"{field} (hub {source.hub_id}, {', '.join(filter(None, at))})"


def _load_source(source: SourceFields, field: str, store: ArtifactStore, work_dir: Path) -> Dataset:
    if source.hub_id is not None:
        rows = load_dataset(source.hub_id, source.config, split=source.split, revision=source.revision)
    else:
        rows = _load_store_jsonl(store, source.store_path, work_dir / "data" / Path(source.store_path).name)
    return _to_trl(rows, source, describe_source(source, field))


def _to_trl(rows: Dataset, row_format: RowFormat, name: str) -> Dataset:
    """`rows` converted from `row_format` to TRL's formats; as they are when they already are (`auto`, no renames)."""
    if row_format.format == "auto" and not row_format.columns:
        return rows

    def convert(row: dict, index: int) -> dict:
        try:
            return to_trl_row(row, row_format.format, row_format.columns)
        except RowError as e:
            raise ValueError(f"{name}, row {index + 1}: {e}") from e

    return rows.map(convert, with_indices=True, remove_columns=rows.column_names)


def _same_columns(parts: list[Dataset], names: list[str]) -> list[Dataset]:
    """The mix's sources in one table layout, which `interleave_datasets` needs: `messages` throughout when some are
    chats and others prompt-completion pairs (the pair as one chat: the same text, its completion the assistant
    turn); only the columns that every source has."""
    formats = [trl_format(part[0]) if len(part) else None for part in parts]
    if mixed_format(dict(zip(names, formats))) == "messages":
        parts = [part.map(lambda row: {"messages": row["prompt"] + row["completion"]},
                          remove_columns=["prompt", "completion"]) if f == "prompt-completion" else part
                 for part, f in zip(parts, formats)]
    shared = [c for c in parts[0].column_names if all(c in part.column_names for part in parts)]
    parts = [part.select_columns(shared) for part in parts]
    # Struct fields can come in another order from another file; the first source's layout is the mix's.
    return [parts[0], *(part.cast(parts[0].features) for part in parts[1:])]


def _load_store_jsonl(store: ArtifactStore, store_path: str, local_file: Path) -> Dataset:
    local_file.parent.mkdir(parents=True, exist_ok=True)
    local_file.write_bytes(store.read_bytes(store_path))
    # A single JSONL file is one split, which the `json` builder names "train".
    return load_dataset("json", data_files=str(local_file), split="train",
                        cache_dir=str(local_file.parent.parent / "datasets-cache"))
