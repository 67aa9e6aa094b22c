"""Benchmarks (`evaluation.benchmarks`): EleutherAI's lm-evaluation-harness tasks, scored for the base model once and
for each adapter (the trained one on the worker that trained it; several in an evaluate job), as `BenchmarkScore`
rows.

The harness loads each model itself from local folders: the base from the worker's model folder, an adapter as PEFT
loads it from its folder (the HF backend's `peft=`), or, where vLLM runs (a CUDA device with vLLM installed), the
harness's vLLM backend with each adapter as a LoRA request (`lora_local_path=`, then the request swapped). Private
tasks are the harness's own YAMLs in `task_dir` (read with the TaskManager's `include_path`); the harness reads the
data files they name relative to that folder.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import math
import time
from collections.abc import Callable, Sequence
from importlib.util import find_spec
from pathlib import Path
from typing import TYPE_CHECKING, Any

from loraflow_worker.contract import JobInput
from loraflow_worker.contract.benchmark_tasks import task_dir_names, unknown_benchmark_tasks
from loraflow_worker.contract.task_evaluation import BenchmarkScore, BenchmarkSettings
from loraflow_worker.evaluation.device import evaluation_device, free_gpu_memory

if TYPE_CHECKING:
    from loraflow_worker.artifacts import ArtifactStore

log = logging.getLogger(__name__)


class BenchmarkError(ValueError):
    """A benchmark the harness cannot run as asked (an unknown task name)."""


def job_benchmarks(job: JobInput, store: ArtifactStore, adapter_dir: Path, work_dir: Path,
                   report: Callable[[str], None] = log.info) -> list[BenchmarkScore]:
    """The run's `evaluation.benchmarks` for its base model and its kept adapter (`adapter_dir`), after training; its
    `task_dir` read from the store at the commit where the control plane stored the run's files. Benchmarks that
    fail (a benchmark's data the Hub does not serve, a model the backend cannot load) are reported and left out: the
    trained adapter is stored all the same. None are run once the job's deadline has passed: the worker stops the
    training process soon after it, and the adapter is stored first."""
    assert job.evaluation is not None and job.evaluation.benchmarks is not None
    if job.deadline_epoch_s is not None and time.time() >= job.deadline_epoch_s:
        report("benchmarks skipped: the job's deadline passed as training ended; the adapter is stored without them")
        return []
    try:
        return _job_benchmarks(job, store, adapter_dir, work_dir, report)
    except Exception as e:  # noqa: BLE001 - the adapter is worth more than its scores
        log.exception("benchmarks failed")
        report(f"benchmarks failed, the adapter is stored without their scores: {type(e).__name__}: {e}")
        return []


def _job_benchmarks(job: JobInput, store: ArtifactStore, adapter_dir: Path, work_dir: Path,
                    report: Callable[[str], None]) -> list[BenchmarkScore]:
    from loraflow_worker.runtime.model_cache import resolve_base_model

    assert job.evaluation is not None and job.evaluation.benchmarks is not None
    settings = job.evaluation.benchmarks
    task_dir = stored_task_dir(settings, store, work_dir, job.inputs.revision if job.inputs else None)
    model_path, _ = resolve_base_model(job.model)
    # The trainer's model is gone with the training function's frame: free its memory before the harness loads two.
    free_gpu_memory()
    scored = run_benchmarks(settings, model_path, [adapter_dir], task_dir, device=evaluation_device(), report=report)
    return scored[0] or []


def stored_task_dir(settings: BenchmarkSettings, store: ArtifactStore, work_dir: Path,
                    revision: str | None) -> Path | None:
    """The benchmarks' `task_dir`, downloaded from the store at `revision` (where the control plane stored the job's
    files); None when the job names none."""
    if settings.task_dir_store_path is None:
        return None
    return store.download(settings.task_dir_store_path, work_dir / "benchmark-tasks", revision=revision)


def run_benchmarks(settings: BenchmarkSettings, model_path: Path, adapter_dirs: Sequence[Path], task_dir: Path | None,
                   *, device: str, report: Callable[[str], None] = log.info, deadline_epoch_s: float | None = None,
                   seed: int | None = None) -> list[list[BenchmarkScore] | None]:
    """Score `settings.tasks` for the base model (`model_path`) once and for it with each adapter (`adapter_dirs`),
    with the harness's vLLM backend where vLLM runs on `device`, its HF backend otherwise: each adapter's scores
    against the base's, in `adapter_dirs`' order. Once `deadline_epoch_s` has passed no model is begun: the adapters
    not reached by then get None (a model the harness is scoring is not interrupted). `seed`: the harness's seeds
    (None: its defaults)."""
    private = task_dir_names(task_dir) if task_dir is not None else set()
    # The names the control plane checked before renting, checked again here: a job from another client is refused
    # before a model is loaded.
    unknown = unknown_benchmark_tasks(settings.tasks, private)
    if unknown:
        where = f" nor does the run's task_dir define {'it' if len(unknown) == 1 else 'them'}" if task_dir else ""
        raise BenchmarkError(
            f"evaluation.benchmarks.tasks: lm-evaluation-harness {lm_eval_version()} has no task "
            f"{', '.join(unknown)}{where}; name the harness's tasks (`lm_eval ls tasks`) or ship their YAMLs in "
            "`task_dir`")
    def deadline_passed() -> bool:
        return deadline_epoch_s is not None and time.time() >= deadline_epoch_s

    if deadline_passed():  # nothing to load
        return [None] * len(adapter_dirs)
    from lm_eval.tasks import TaskManager

    # Indexing the harness's own ~15k task names reads thousands of YAMLs (half a minute on a small CPU): skipped
    # when the run asks only for its own tasks and defines no group, the one kind of YAML that names other tasks.
    own_only = set(settings.tasks) <= private and task_dir is not None and not _defines_group(task_dir)
    task_manager = TaskManager(include_path=str(task_dir) if task_dir is not None else None,
                               include_defaults=not own_only)
    use_vllm = device.startswith("cuda") and find_spec("vllm") is not None
    if use_vllm and (refused := vllm_refused_adapter(adapter_dirs)):
        # The harness's vLLM backend would fail on it after the base was scored: the HF backend takes every adapter.
        report(f"benchmarks with transformers: {refused}, which vLLM's LoRA loader refuses")
        use_vllm = False
    score = _with_vllm if use_vllm else _with_transformers
    evaluate = functools.partial(_evaluate, settings, task_manager, task_dir, seed=seed)
    results = score(evaluate, settings, model_path, adapter_dirs, device, deadline_passed, report)
    base, by_adapter = (results[0], results[1:]) if results else (None, [])
    scored: list[list[BenchmarkScore] | None] = []
    for i in range(len(adapter_dirs)):
        if base is None or i >= len(by_adapter):
            scored.append(None)
            continue
        scored.append(benchmark_scores(base, by_adapter[i]))
        which = "adapter" if len(adapter_dirs) == 1 else f"adapter {i + 1}"
        for row in scored[-1]:
            report(f"benchmark {row.task}/{row.metric}: base {_shown(row.base, row.base_stderr)}, {which} "
                   f"{_shown(row.adapter, row.adapter_stderr)}, delta {row.delta:+.4f} (n={row.n})")
    return scored


def vllm_refused_adapter(adapter_dirs: Sequence[Path]) -> str | None:
    """The first of `adapter_dirs` vLLM's LoRA loader refuses, with why (`vllm_lora.vllm_refusals`); None when it
    loads them all."""
    from loraflow_worker.evaluation.vllm_lora import adapter_config, vllm_refusals

    for number, folder in enumerate(adapter_dirs, start=1):
        if reasons := vllm_refusals(adapter_config(folder)):
            which = "the adapter" if len(adapter_dirs) == 1 else f"adapter {number}"
            return f"{which} {' and '.join(reasons)}"
    return None


def _with_transformers(evaluate: Callable[[Any], dict[str, Any]], settings: BenchmarkSettings, model_path: Path,
                       adapter_dirs: Sequence[Path], device: str, deadline_passed: Callable[[], bool],
                       report: Callable[[str], None]) -> list[dict[str, Any]]:
    """[base results, then each adapter's], up to the model before which the deadline passed; the harness's HF
    backend loads each model itself."""
    from lm_eval.models.huggingface import HFLM

    results = []
    for i, adapter_dir in enumerate([None, *adapter_dirs]):
        if deadline_passed():
            break
        which = "the base model" if adapter_dir is None else \
            "the adapter" if len(adapter_dirs) == 1 else f"adapter {i} of {len(adapter_dirs)}"
        report(f"benchmarks: {', '.join(settings.tasks)} for {which} (transformers)")
        peft = {} if adapter_dir is None else {"peft": str(adapter_dir)}
        results.append(evaluate(HFLM(
            pretrained=str(model_path), device=device, batch_size=settings.batch_size, dtype="auto", **peft)))
        free_gpu_memory()
    return results


def _defines_group(task_dir: Path) -> bool:
    return any(line.startswith("group:") for path in [*task_dir.rglob("*.yaml"), *task_dir.rglob("*.yml")]
               for line in path.read_text(errors="replace").splitlines())


def lm_eval_version() -> str:
    from importlib.metadata import version

    return version("lm-eval")


def _with_vllm(evaluate: Callable[[Any], dict[str, Any]], settings: BenchmarkSettings, model_path: Path,
               adapter_dirs: Sequence[Path], device: str, deadline_passed: Callable[[], bool],
               report: Callable[[str], None]) -> list[dict[str, Any]]:
    """[base results, then each adapter's], up to the model before which the deadline passed, from one vLLM engine
    that serves each adapter as a LoRA request: the harness's VLLM sends its `lora_request` with every request, None
    for the base."""
    from lm_eval.models.vllm_causallms import VLLM
    from vllm.lora.request import LoRARequest

    from loraflow_worker.evaluation.vllm_lora import adapter_config, adapter_rank, max_lora_rank

    max_rank = max_lora_rank(adapter_rank(adapter_config(folder)) for folder in adapter_dirs)
    model = VLLM(pretrained=str(model_path), lora_local_path=str(adapter_dirs[0]), max_lora_rank=max_rank,
                 batch_size=settings.batch_size, dtype="auto")
    results = []
    for i, adapter_dir in enumerate([None, *adapter_dirs]):
        if deadline_passed():
            break
        # vLLM tells LoRA adapters apart by their integer id (from 1).
        model.lora_request = None if adapter_dir is None else LoRARequest(f"adapter-{i}", i, str(adapter_dir))
        which = "the base model" if adapter_dir is None else \
            "the adapter" if len(adapter_dirs) == 1 else f"adapter {i} of {len(adapter_dirs)}"
        how = "vLLM" if adapter_dir is None else "vLLM, as a LoRA request"
        report(f"benchmarks: {', '.join(settings.tasks)} for {which} ({how})")
        results.append(evaluate(model))
    del model
    free_gpu_memory()
    return results


def _evaluate(settings: BenchmarkSettings, task_manager: Any, task_dir: Path | None, model: Any, *,
              seed: int | None = None) -> dict[str, Any]:
    from lm_eval import simple_evaluate

    seeds = {} if seed is None else {name: seed for name in (
        "random_seed", "numpy_random_seed", "torch_random_seed", "fewshot_random_seed")}
    # A private task's `data_files` are relative paths: the harness's datasets read them from the working folder.
    with contextlib.chdir(task_dir) if task_dir is not None else contextlib.nullcontext():
        # bootstrap_iters: the standard error of a metric that is not a mean (perplexity, F1, BLEU) is bootstrapped;
        # 1000 draws (the harness's default is 100000, in a pool of every CPU) give it to two digits in seconds.
        results = simple_evaluate(model=model, tasks=list(settings.tasks), num_fewshot=settings.num_fewshot,
                                  limit=settings.limit, batch_size=settings.batch_size, task_manager=task_manager,
                                  log_samples=False, bootstrap_iters=1000, **seeds)
    if results is None:  # the harness returns None on the ranks of a distributed run other than the first
        raise RuntimeError("lm-evaluation-harness returned no results")
    return results


def benchmark_scores(base: dict[str, Any], adapter: dict[str, Any]) -> list[BenchmarkScore]:
    """One row per task (and group) and metric of two `simple_evaluate` results over the same tasks. A metric the
    harness scored under several filters (gsm8k's `exact_match` after `strict-match` and `flexible-extract`) keeps
    the harness's own `metric,filter` name; one scored on the raw output alone is named bare (`acc`)."""
    rows = []
    for task, values in base["results"].items():
        adapter_values = adapter["results"].get(task, {})
        keys = [key for key in values if "," in key and "_stderr," not in key and _is_number(values[key])]
        metrics = [key.split(",", 1)[0] for key in keys]
        for key, metric in zip(keys, metrics):
            if key not in adapter_values:
                continue
            filter_name = key.split(",", 1)[1]
            name = metric if metrics.count(metric) == 1 else key
            stderr_key = f"{metric}_stderr,{filter_name}"
            samples = base.get("n-samples", {}).get(task, {})
            higher = base.get("higher_is_better", {}).get(task, {}).get(metric)
            rows.append(BenchmarkScore(
                task=task, metric=name, n=samples.get("effective"),
                base=float(values[key]), base_stderr=_stderr(values.get(stderr_key)),
                adapter=float(adapter_values[key]), adapter_stderr=_stderr(adapter_values.get(stderr_key)),
                delta=float(adapter_values[key]) - float(values[key]),
                higher_is_better=True if higher is None else bool(higher)))
    return rows


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _stderr(value: Any) -> float | None:
    """The harness writes "N/A" where it computes no standard error (a metric without one, or one example)."""
    return float(value) if _is_number(value) else None


def _shown(value: float, stderr: float | None) -> str:
    return f"{value:.4f}" if stderr is None else f"{value:.4f} ± {stderr:.4f}"
