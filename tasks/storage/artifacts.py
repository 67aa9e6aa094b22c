"""The run's artifact store, seen from the control plane: check and publish the run's local inputs (dataset
file, reward files), as they were read once (`run_files.py`), with the pins the worker checks them against
(`StoredInputs`), read the results.

The store itself (`file://` or `hf://datasets/...`) is the worker package's `open_store`, so both
sides read and write it with the same code.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from loraflow_worker.artifacts import ArtifactNotFound, ArtifactStore, open_store
from loraflow_worker.contract import TRAJECTORIES_FILE, JobResult, RewardSpec, StoredInputs, run_prefix
from loraflow_worker.contract.dataset_formats import (
    ALGORITHM_FORMATS,
    MESSAGE_COLUMNS,
    TRL_FORMATS,
    RowError,
    is_messages,
    preference_problem,
    to_trl_row,
    trl_format,
)
from prefect import task
from prefect.cache_policies import NO_CACHE
from pydantic import BaseModel, Field

from tasks.settings import Settings
from tasks.storage.evaluation_inputs import SECTIONS, evaluation_store_path
from tasks.storage.rewards import check_reward_files, reward_store_paths
from tasks.storage.run_files import RunFile

CONSOLE_TAIL_BYTES = 4000


DATASET_FORMATS = TRL_FORMATS
"""TRL's conversational dataset formats, as a line of a JSONL file (`dataset_formats.TRL_FORMATS`)."""


def check_dataset_jsonl(path: Path, algorithm: str, field: str = "dataset.local_file", data_format: str = "auto",
                        columns: Mapping[str, str] | None = None, shown: str | None = None) -> int:
    """Count the examples of a JSONL dataset file for `algorithm` (`sft`, `grpo` or `dpo`), each line converted from
    `data_format` with `columns` as the worker will convert it; ValueError naming `field` (the spec field that gave
    the file), the first bad line, the field in it and the line shapes `algorithm` accepts. Every line must have the
    format and the columns of the first: the worker reads the file as one table. `shown`: the file as the run names
    it, where `path` is the copy of it that was read (`run_files.RunFile`)."""
    where = f"{field} {shown or path}"
    if not path.is_file():
        raise ValueError(f"{where} does not exist or is not a file")
    try:
        with path.open(encoding="utf-8") as lines:
            count = check_rows(lines, algorithm, where, data_format, columns or {})
    except UnicodeDecodeError as e:
        raise ValueError(f"{where} is not UTF-8 text ({e}): save it as UTF-8 JSON lines") from e
    if count == 0:
        raise ValueError(f"{where} has no examples")
    return count


def first_row_format(path: Path, data_format: str, columns: Mapping[str, str]) -> str | None:
    """The TRL format the first row of a JSONL file (checked with `check_dataset_jsonl`) converts to."""
    with path.open(encoding="utf-8") as lines:
        first = next((line for line in lines if line.strip()), None)
    return trl_format(to_trl_row(json.loads(first), data_format, columns)) if first else None


def check_rows(lines: Iterable[str], algorithm: str, where: str, data_format: str, columns: Mapping[str, str]) -> int:
    """Count the JSON lines of `lines` (blank ones skipped) after checking each the way `check_dataset_jsonl` says;
    `where` starts each error (the field and the file)."""
    accepted = ALGORITHM_FORMATS[algorithm]
    expected = " or ".join(TRL_FORMATS[f] for f in accepted)
    # `auto`'s renamed columns, named as the dataset names them.
    own = {trl: f"`{name}` (as `{trl}`)" for trl, name in columns.items()} if data_format == "auto" else {}
    count, first = 0, None
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        at = f"{where}, line {number}"
        try:
            row = json.loads(line)
        except ValueError as e:
            raise ValueError(f"{at}: not JSON ({e}); expected {_expected(data_format, expected)}") from e
        if not isinstance(row, dict):
            raise ValueError(f"{at}: not a JSON object; expected {_expected(data_format, expected)}")
        try:
            row = to_trl_row(row, data_format, columns)
        except RowError as e:
            raise ValueError(f"{at}: {e} (format {data_format})") from e
        found = trl_format(row)
        if found not in accepted:
            what = (f"a {found} line, which {algorithm} does not train on" if found
                    else f"no {own.get('messages', '`messages`')} or {own.get('prompt', '`prompt`')}")
            raise ValueError(f"{at}: {what}; expected {expected}")
        if found == "preference":
            if (problem := preference_problem(row)) is not None:
                raise ValueError(f"{at}: {own.get(problem.field, f'`{problem.field}`')}: {problem.problem}")
        for column in MESSAGE_COLUMNS[found] if found != "preference" else ():
            if not is_messages(row[column]):
                raise ValueError(f"{at}: {own.get(column, f'`{column}`')} is not a non-empty list of {{\"role\": ..., "
                                 f"\"content\": ...}} messages with text content; expected {expected}")
        if first is None:
            first = (number, found, sorted(row))
        elif (found, sorted(row)) != first[1:]:
            raise ValueError(
                f"{at}: a {found} line with columns {_columns(row)}, but line {first[0]} is a {first[1]} line "
                f"with columns {_columns(first[2])}: every line needs the same format and columns"
            )
        count += 1
    return count


def eval_store_path(run_id: str) -> str:
    """Where `publish_run_inputs` puts a run's evaluation file in the store."""
    return f"{run_prefix(run_id)}/dataset/eval.jsonl"


def mix_store_path(run_id: str, index: int) -> str:
    """Where `publish_run_inputs` puts the file of a run's `dataset.mix[index]` in the store."""
    return f"{run_prefix(run_id)}/dataset/mix-{index}.jsonl"


def tools_store_path(run_id: str, field: str) -> str:
    """Where `publish_run_inputs` puts the file of a run's `grpo.tools` (`field` "tools") or `grpo.environment`
    ("environment") in the store."""
    return f"{run_prefix(run_id)}/tools/{field}.py"


def chat_template_store_path(run_id: str) -> str:
    """Where `publish_run_inputs` puts a run's chat template file (`training.chat_template`) in the store."""
    return f"{run_prefix(run_id)}/chat_template.jinja"


def check_chat_template_file(template: str | None, files: Mapping[str, RunFile]) -> RunFile | None:
    """The local file `training.chat_template` names (a `.jinja` path), as it was read with the run's files (`files`,
    by field: `read_run_files`); None for a TRL template's name or none. ValueError naming the field when the file
    is not text."""
    if template is None or not template.endswith((".jinja", ".j2")):
        return None
    file = files["training.chat_template"]
    try:
        file.copy.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(f"training.chat_template {template}: {type(e).__name__}: {e}; give a .jinja file of UTF-8 text "
                         "or the name of a TRL training template") from e
    return file


def store_path_of(run_id: str, field: str) -> str | None:
    """Where `publish_run_inputs` puts the run's file of `field` (a field of `RunSpec.local_paths`) in the store; None
    for a reward file's field (`reward_store_paths` names those) or a field whose file is not stored."""
    if field == "dataset.local_file":
        return f"{run_prefix(run_id)}/dataset/train.jsonl"
    if field.startswith("dataset.mix[") and field.endswith("].local_file"):
        return mix_store_path(run_id, int(field[len("dataset.mix["):-len("].local_file")]))
    if field.startswith(tuple(f"{section}.{part}" for section in SECTIONS for part in ("tasks[", "benchmarks."))):
        return evaluation_store_path(run_id, field)
    return {"evaluation.local_file": eval_store_path(run_id), "training.chat_template": chat_template_store_path(run_id),
            "grpo.tools": tools_store_path(run_id, "tools"),
            "grpo.environment": tools_store_path(run_id, "environment")}.get(field)


def publish_run_inputs(store_url: str, run_id: str, files: Mapping[str, RunFile], rewards: Sequence[RewardSpec],
                       token: str | None = None) -> tuple[str | None, list[RewardSpec], StoredInputs]:
    """Copy a run's local files, as they were read and checked (`files`, by field: `read_run_files`), into its folder
    of the store in ONE commit (the Hub allows about 128 commits per hour per repo), each where `store_path_of` says:
    the dataset file as `runs/<run_id>/dataset/train.jsonl`, the mix's, the evaluation file, the chat template, the
    tools and environment files, and each reward file under `runs/<run_id>/rewards/` (`reward_store_paths`). What the
    store receives is the copy made at that one read, pinned by the sha256 taken as it was read: the worker refuses any
    other bytes. Returns the dataset's store path (None without a file), `rewards` with each reward file's
    `store_path` set, and the pins of what was stored (the commit, each file's sha256), for the job. A reward file
    that lacks its function is refused (ValueError naming `grpo.rewards[i].name`) before anything is written.
    `token`: the Hub token."""
    reward_files = check_reward_files(rewards, files)
    reward_paths = reward_store_paths(reward_files, run_id)
    stored_files = {reward_paths[file.location]: file for file in reward_files.values()}
    for field, file in files.items():
        if (store_path := store_path_of(run_id, field)) is not None:
            stored_files[store_path] = file
    stored = StoredInputs(sha256={store_path: file.sha256 for store_path, file in stored_files.items()})
    if stored_files:
        fields = set(files)
        what = " and ".join(filter(None, [
            "dataset" if any(f.startswith("dataset.") for f in fields) else "",
            "evaluation file" if "evaluation.local_file" in fields else "",
            "chat template" if "training.chat_template" in fields else "",
            "tools" if fields & {"grpo.tools", "grpo.environment"} else "",
            "evaluation tasks" if any(f.startswith(("evaluation.tasks[", "evaluation.benchmarks.")) for f in fields)
            else "",
            "reward files" if reward_files else ""]))
        stored.revision = open_store(store_url, token).put({path: file.copy for path, file in stored_files.items()},
                                                           message=f"{what} for run {run_id}")
    published = [
        RewardSpec.model_validate({**spec.model_dump(exclude_none=True),
                                   "store_path": reward_paths[reward_files[i].location]})
        if i in reward_files else spec
        for i, spec in enumerate(rewards)
    ]
    dataset_path = store_path_of(run_id, "dataset.local_file") if "dataset.local_file" in files else None
    return dataset_path, published, stored


class RunResults(BaseModel):
    """What a finished run left in its store."""

    done: bool
    result: JobResult | None = None
    manifest: dict[str, Any] | None = None
    console_tail: str | None = None
    adapter_url: str | None = None
    tracker_files_urls: dict[str, str] = Field(
        default_factory=dict, description="Tracker (`wandb`, `mlflow`) → link to its files stored with the run.")
    trajectories: list[dict[str, Any]] = Field(
        default_factory=list, description="GRPO: the trajectories the worker kept at its last logging step.")
    trajectories_url: str | None = Field(default=None, description="Link to all the trajectories kept; None: none.")
    task_answers: dict[str, list[dict[str, Any]]] = Field(
        default_factory=dict, description="Each evaluation task's kept answers (`evaluation/<task>.jsonl`), where the "
        "worker stored them.")
    task_answers_urls: dict[str, str] = Field(default_factory=dict, description="Task → link to its kept answers.")


def read_run_results(store_url: str, run_id: str, token: str | None = None,
                     job_output: Any = None) -> RunResults:
    """Read a run's results. Success is decided by `DONE`, written last, not by the job's status.

    `job_output`: the completed job's output (a `JobResult`), when the job completed: it is the result (it names the
    commit that holds the adapter, and no one who can write the store can change it), and a stored `result.json`
    whose adapter hashes differ from it is refused (`ResultsChanged`). Without it, the stored one is the result."""
    store = open_store(store_url, token)
    prefix = run_prefix(run_id)
    console = _read_text(store, f"{prefix}/console.txt")
    if not store.exists(f"{prefix}/DONE"):
        return RunResults(done=False, console_tail=console[-CONSOLE_TAIL_BYTES:] if console else None)
    result = read_job_result(store, run_id)
    if job_output is not None:
        reported = JobResult.model_validate(job_output)
        if reported.adapter_sha256 != result.adapter_sha256:
            changed = sorted(name for name in reported.adapter_sha256.keys() | result.adapter_sha256.keys()
                             if reported.adapter_sha256.get(name) != result.adapter_sha256.get(name))
            raise ResultsChanged(
                f"{store.display_url(f'{prefix}/result.json')} names other adapter files than the job reported "
                f"(they differ for {', '.join(changed)}): someone with write access to the store changed the run's "
                "results after the worker stored them; nothing of the run is trusted, publish nothing from it")
        result = reported
    try:
        manifest = store.read_json(f"{prefix}/manifest.json")
    except ArtifactNotFound:
        manifest = None
    trajectories = _last_step(_read_text(store, f"{prefix}/{TRAJECTORIES_FILE}"))
    answers = {task: _rows(_read_text(store, f"{prefix}/evaluation/{task}.jsonl"))
               for task in dict.fromkeys(score.task for score in result.metrics.task_scores)}
    answers = {task: rows for task, rows in answers.items() if rows}
    answers_urls = {task: store.display_url(f"{prefix}/evaluation/{task}.jsonl") for task in answers}
    return RunResults(done=True, task_answers=answers, task_answers_urls=answers_urls, result=result,
                      manifest=manifest, adapter_url=store.display_url(result.adapter_path),
                      tracker_files_urls={t.tracker: store.display_url(t.store_path) for t in result.trackers
                                          if t.store_path},
                      trajectories=trajectories,
                      trajectories_url=store.display_url(f"{prefix}/{TRAJECTORIES_FILE}") if trajectories else None)


class ResultsChanged(ValueError):
    """A run's stored `result.json` is not what its job reported: someone changed it in the store."""


def read_job_result(store: ArtifactStore, run_id: str) -> JobResult:
    """The `JobResult` a run stored (`runs/<run_id>/result.json`); ArtifactNotFound when it stored none."""
    return JobResult.model_validate(store.read_json(f"{run_prefix(run_id)}/result.json"))


def _last_step(jsonl: str | None) -> list[dict[str, Any]]:
    """The trajectories of the last logging step in a trajectories file (each line one JSON object with its `step`);
    a line that is not such an object is skipped: the file is a sample to show, not a result to trust."""
    records = []
    for line in (jsonl or "").splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(record, dict) and isinstance(record.get("step"), int):
            records.append(record)
    last = max((record["step"] for record in records), default=None)
    return [record for record in records if record["step"] == last]


def _rows(jsonl: str | None) -> list[dict[str, Any]]:
    """The JSON objects of a JSONL file the worker wrote, those that parse (what it holds is shown, not trusted)."""
    rows = []
    for line in (jsonl or "").splitlines():
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(row, dict):
            rows.append(row)
    return rows


def _expected(data_format: str, trl_shapes: str) -> str:
    if data_format == "alpaca":
        return '{"instruction": ..., "input": ..., "output": ...} (format alpaca)'
    if data_format == "sharegpt":
        return '{"conversations": [{"from": ..., "value": ...}, ...]} (format sharegpt)'
    return trl_shapes


def _columns(row: Any) -> str:
    return ", ".join(f"`{c}`" for c in sorted(row))


def _read_text(store: Any, path: str) -> str | None:
    try:
        return store.read_bytes(path).decode("utf-8", errors="replace")
    except ArtifactNotFound:
        return None


@task(name="publish-run-inputs", cache_policy=NO_CACHE, retries=3, retry_delay_seconds=[2, 10, 30])
def publish_run_inputs_task(store_url: str, run_id: str, files: dict[str, RunFile], rewards: list[RewardSpec],
                            hub_token_secret: str | None = None) -> tuple[str | None, list[RewardSpec], StoredInputs]:
    return publish_run_inputs(store_url, run_id, files, rewards, Settings().store_token(store_url, hub_token_secret))


@task(name="collect", cache_policy=NO_CACHE, retries=3, retry_delay_seconds=[2, 10, 30])
def collect(store_url: str, run_id: str, hub_token_secret: str | None = None, job_output: Any = None) -> RunResults:
    return read_run_results(store_url, run_id, Settings().store_token(store_url, hub_token_secret), job_output)


