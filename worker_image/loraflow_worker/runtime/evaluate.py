"""An evaluate job: one base model and several of its LoRA adapters asked the same task evaluations and benchmarks,
each adapter scored against one set of base answers, so that adapters of different runs compare on equal terms.

The control plane sends (`"mode": "evaluate"`, contract/evaluate.py)

    {"contract_version": 13, "mode": "evaluate", "run_id": "<flow run id>", "artifact_store": "hf://datasets/acme/runs",
     "base_model": {"id": "Qwen/Qwen3-8B", "revision": "<sha>"},
     "adapters": [{"label": "capybara", "run_id": "<run>", "adapter_revision": "<commit>", "adapter_sha256": {...}},
                  {"label": "hub-one", "source": {"id": "acme/qwen3-lora", "revision": "<sha>"}}],
     "tasks": [...], "benchmarks": {...}, "inputs": {...}, "deadline_epoch_s": ...}

and the worker: reads the task files and grader files at their `inputs` pins (a file changed since is refused, as a
train job refuses it) and imports the graders, before any model comes down; fetches each adapter (a run's, from
`runs/<run_id>/adapter` at `adapter_revision`, every file checked against `adapter_sha256`: one that differs is
refused naming the adapter; a Hub adapter at its pinned revision; a local folder in local mode); loads the base once
(bf16 on a GPU, whatever the adapters trained on: a QLoRA adapter is scored on the bf16 base, as it is served) with
every adapter on it (PEFT); lets the base answer each task once and every adapter after it, grading the base's answers
once and each adapter's against them (`evaluation/tasks.py`, what a run's evaluation after training uses too); then
the benchmarks, the base once and each adapter (`evaluation/benchmarks.py`). It stores each adapter's answers samples
under `runs/<run_id>/evaluation/<label>/<task>.jsonl`, `result.json` and `DONE` last, in one commit, secrets removed
(the environment's and `worker_secret_names`'), and returns the `EvaluateResult`.

At the deadline it stops where it is (a batch of answers is cut at the deadline, no benchmark model is begun after
it), stores what it has and says what is missing (`stopped`); a grader or benchmark that fails is reported the same
way. A redelivered job whose `DONE` exists returns the stored result without answering again. The evaluation runs
in a child process, as training does (`runtime/supervisor.py`): the graders are a teammate's code, and its
environment holds none of RunPod's variables nor credentials other than the forwarded ones and the job's own secrets
(`runtime/environment.evaluate_env`).

    python -m loraflow_worker.runtime.evaluate WORK_DIR/job.json   # the child; writes WORK_DIR/result.json
"""

from __future__ import annotations

import json
import logging
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from loraflow_worker.artifacts import ArtifactChanged, ArtifactNotFound, ArtifactStore, open_store
from loraflow_worker.artifacts.pins import download_pinned
from loraflow_worker.contract import (
    AdapterScores,
    BenchmarkScore,
    EvaluatedAdapter,
    EvaluateInput,
    EvaluateResult,
    Progress,
    run_prefix,
)
from loraflow_worker.runtime.cuda_check import check_cuda
from loraflow_worker.runtime.environment import evaluate_env
from loraflow_worker.runtime.model_cache import resolve_base_model
from loraflow_worker.runtime.redaction import redact_record
from loraflow_worker.runtime.supervisor import (
    RESULT_FILE,
    SPEC_FILE,
    JobFailed,
    child_main,
    run_child,
    send_progress,
)

if TYPE_CHECKING:
    from loraflow_worker.evaluation.tasks import AnsweringAdapter, PreparedTask, TaskResults

log = logging.getLogger("loraflow_worker")


class AdapterUnavailable(ValueError):
    """An adapter of the job cannot be fetched as named (no adapter there, not a PEFT adapter folder)."""


def evaluate_adapters(job: EvaluateInput, work_dir: Path, report: Callable[[Progress], None]) -> EvaluateResult:
    """Evaluate, store, return (see the module docstring): the stored result when the store has this job's `DONE`,
    else the child process's. Raises `JobFailed` with the child's error (secrets removed): an adapter or task file
    that differs from what was recorded (`ArtifactChanged`, naming it), `AdapterUnavailable`, the store's and the
    graders' refusals before any answering starts; `CudaUnavailable` on a GPU endpoint without CUDA."""
    store = open_store(job.artifact_store)
    prefix = run_prefix(job.run_id)
    if store.exists(f"{prefix}/DONE"):
        log.info("evaluate job %s already has DONE in %s: returning the stored result", job.run_id, store.url)
        return EvaluateResult.model_validate(store.read_json(f"{prefix}/result.json"))
    env = evaluate_env(job)
    check_cuda(env)  # on a GPU endpoint (LORAFLOW_REQUIRE_CUDA=1), a worker without CUDA fails in seconds
    spec = work_dir / SPEC_FILE
    spec.write_text(job.model_dump_json(indent=2))
    ended = run_child("loraflow_worker.runtime.evaluate", spec, env, deadline=job.deadline_epoch_s,
                      secret_names=job.worker_secret_names, on_progress=report, process="evaluation process",
                      label=f"evaluate job {job.run_id}")
    # The child's own result, as it stored it: the store's copy is anyone's who can write the store.
    if (work_dir / RESULT_FILE).is_file():
        return EvaluateResult.model_validate_json((work_dir / RESULT_FILE).read_text())
    raise JobFailed(ended.failure_message())


def main(argv: list[str] | None = None) -> int:
    """The evaluation process: the job of `job.json`, its result written beside it (`result.json`), or its error
    (`error.json`)."""
    return child_main(sys.argv[1:] if argv is None else argv, "loraflow_worker.runtime.evaluate",
                      lambda spec: evaluate_and_store(EvaluateInput.model_validate_json(spec.read_text()), spec.parent,
                                                      send_progress))


def evaluate_and_store(job: EvaluateInput, work_dir: Path, report: Callable[[Progress], None]) -> EvaluateResult:
    """The evaluation itself, in the evaluation process (see the module docstring)."""
    # The answering stack (torch, transformers, PEFT) loads in seconds: in the child only.
    from loraflow_worker.evaluation.tasks import AnsweringAdapter, TaskResults, prepare_tasks
    from loraflow_worker.training.user_files import RunFilesStore

    started = time.monotonic()
    store = open_store(job.artifact_store)
    prefix = run_prefix(job.run_id)

    def say(stage: str, message: str) -> None:
        # Within `Progress.message`'s limit: an error quoted in it may be long.
        report(Progress(stage=stage, message=message[:2000]))

    # What can be refused without a model is refused first: a task file changed since, a grader that does not import.
    prepared = prepare_tasks(job.tasks, RunFilesStore(store, job), work_dir)
    say("loading", f"evaluate: fetching {len(job.adapters)} adapter(s) and the base model {job.base_model.id}")
    adapter_dirs = {adapter.label: fetch_adapter(adapter, store, work_dir / "adapters" / adapter.label)
                    for adapter in job.adapters}
    model_path, revision = resolve_base_model(job.base_model)
    # PEFT names an adapter's modules after it: names without a `.`, whatever the labels hold.
    answering = [AnsweringAdapter(f"adapter{i}", adapter.label, f"{prefix}/evaluation/{adapter.label}")
                 for i, adapter in enumerate(job.adapters)]
    results, stopped = TaskResults(), []
    if prepared:
        reason = _answer_tasks(job, prepared, model_path, adapter_dirs, answering, results,
                               lambda message: say("evaluating", message))
        if reason is not None:
            missing = [f"`{a.label}` lacks {', '.join(gone)}" for a in answering
                       if (gone := results.missing(prepared, a.name))]
            stopped.append(f"{reason}: {'; '.join(missing)}" if missing else reason)
    benchmarks: list[list[BenchmarkScore] | None] = [[] for _ in job.adapters]
    if job.benchmarks is not None:
        benchmarks, reason = _run_benchmarks(job, store, model_path, list(adapter_dirs.values()), work_dir,
                                             lambda message: say("evaluating", message))
        if reason is not None:
            stopped.append(reason)
    scores = [AdapterScores(
        label=adapter.label, task_scores=results.scores.get(answerer.name, []), benchmark_scores=benchmarks[i] or [],
        answers_store_path=answerer.answers_folder if any(path.startswith(f"{answerer.answers_folder}/")
                                                          for path in results.files) else None)
        for i, (adapter, answerer) in enumerate(zip(job.adapters, answering))]
    result = EvaluateResult(run_id=job.run_id, adapters=scores, base_model_revision=revision,
                            stopped="; ".join(stopped) or None, seconds=round(time.monotonic() - started, 1))
    # The result holds texts a grader or an error wrote: secrets are removed before it is stored or returned.
    result = EvaluateResult.model_validate(redact_record(result.model_dump(mode="json"), job.worker_secret_names))
    if result.stopped:
        log.warning(result.stopped)
        say("evaluating", result.stopped)
    say("saving", f"evaluate: storing the scores and answers at {store.display_url(prefix)}")
    store_result(store, prefix, result, results.files)
    return result


def fetch_adapter(adapter: EvaluatedAdapter, store: ArtifactStore, dest: Path) -> Path:
    """The local folder of `adapter`: a run's, downloaded from the store at its revision and checked against its
    hashes; a Hub repo's, downloaded at its pinned revision; a local folder, as it is. `ArtifactChanged` or
    `AdapterUnavailable` naming the adapter when it is not what the job recorded or not an adapter."""
    name = f"adapter `{adapter.label}`"
    if adapter.run_id is not None:
        path = f"{run_prefix(adapter.run_id)}/adapter"
        try:
            folder = download_pinned(store, path, dest, revision=adapter.adapter_revision,
                                     sha256=adapter.adapter_sha256, since=f"after run {adapter.run_id} stored it")
        except ArtifactChanged as e:
            raise ArtifactChanged(f"{name}: {e}") from None
        except ArtifactNotFound as e:
            raise AdapterUnavailable(f"{name}: run {adapter.run_id} has no adapter in the artifact store ({e}); name "
                                     "a completed run") from None
    elif Path(adapter.source.id).is_dir():
        folder = Path(adapter.source.id)
    else:
        from huggingface_hub import snapshot_download

        try:  # HF_ENDPOINT and HF_TOKEN from the worker's environment
            folder = Path(snapshot_download(adapter.source.id, revision=adapter.source.revision, local_dir=dest))
        except Exception as e:  # noqa: BLE001 - whatever the Hub answers, the error names the adapter
            raise AdapterUnavailable(f"{name}: {adapter.source.id} at {adapter.source.revision or 'main'} could not "
                                     f"be downloaded ({type(e).__name__}: {e})") from None
    if not (folder / "adapter_config.json").is_file():
        raise AdapterUnavailable(f"{name}: {folder if adapter.source else path} holds no `adapter_config.json`: it is "
                                 "not a PEFT adapter folder")
    return folder


def _answer_tasks(job: EvaluateInput, prepared: list[PreparedTask], model_path: Path, adapter_dirs: dict[str, Path],
                  answering: list[AnsweringAdapter], results: TaskResults, say: Callable[[str], None]) -> str | None:
    """The task evaluations into `results`; None when all ran, else why the rest are missing."""
    from transformers import set_seed

    from loraflow_worker.evaluation.answering import EvaluationDeadline, deadline_passed
    from loraflow_worker.evaluation.tasks import evaluate_task
    from loraflow_worker.evaluation.device import evaluation_device
    from loraflow_worker.evaluation.vllm_answering import open_answerer

    say(f"task evaluations: {len(prepared)} task(s), the base and {len(answering)} adapter(s) answering each")
    try:
        if deadline_passed(job.deadline_epoch_s):
            raise EvaluationDeadline("the job's deadline passed before the task evaluations began")
        set_seed(job.seed)  # a task with a temperature samples
        # The base answers with its own tokenizer and chat template; each adapter with its folder's, when it has one.
        with open_answerer(model_path, {a: adapter_dirs[a.label] for a in answering}, base_tokenizer_dir=model_path,
                           prepared=prepared, device=evaluation_device(), say=say,
                           deadline_epoch_s=job.deadline_epoch_s, seed=job.seed) as answerer:
            for task in prepared:
                evaluate_task(task, answerer, answering, say, results, job.worker_secret_names)
    except EvaluationDeadline as e:
        return f"{e}; give the job a later deadline to evaluate the rest"
    except Exception as e:  # noqa: BLE001 - the scores so far are stored and returned, with what stopped them
        log.exception("the task evaluations failed")  # the supervisor removes secrets from the console
        return f"the task evaluations failed ({type(e).__name__}: {e})"
    return None


def _run_benchmarks(job: EvaluateInput, store: ArtifactStore, model_path: Path, adapter_dirs: list[Path],
                    work_dir: Path, say: Callable[[str], None]) -> tuple[list[list[BenchmarkScore] | None], str | None]:
    """Each adapter's benchmark scores (None: not run), and why some are missing (None: none is)."""
    from loraflow_worker.evaluation.benchmarks import run_benchmarks, stored_task_dir
    from loraflow_worker.evaluation.device import evaluation_device

    assert job.benchmarks is not None
    try:
        task_dir = stored_task_dir(job.benchmarks, store, work_dir, job.inputs.revision if job.inputs else None)
        scores = run_benchmarks(job.benchmarks, model_path, adapter_dirs, task_dir, device=evaluation_device(),
                                report=say, deadline_epoch_s=job.deadline_epoch_s, seed=job.seed)
    except Exception as e:  # noqa: BLE001 - the task scores are stored and returned all the same
        log.exception("benchmarks failed")
        return [None] * len(adapter_dirs), f"the benchmarks failed ({type(e).__name__}: {e})"
    missing = [adapter.label for adapter, scored in zip(job.adapters, scores) if scored is None]
    if missing:
        return scores, (f"the job's deadline passed before the benchmarks of {', '.join(missing)} began; give the job "
                        "a later deadline to run them")
    return scores, None


def store_result(store: ArtifactStore, prefix: str, result: EvaluateResult, files: dict[str, bytes]) -> None:
    """The answers samples, `result.json` and `DONE` in ONE commit, `DONE` last: a reader that sees `DONE` sees the
    rest (a Hub commit is all or nothing; FileStore moves the files into place in the order given)."""
    stored = {**files, f"{prefix}/result.json": result.model_dump_json(indent=2).encode(),
              f"{prefix}/DONE": json.dumps({"run_id": result.run_id}).encode()}
    store.put(stored, message=f"evaluate {result.run_id}: answers, result, DONE")


if __name__ == "__main__":
    sys.exit(main())
