"""One GPU smoke run, in a process of its own: a variant trains through the worker's own SFT, DPO or GRPO body, and
the process prints its figures (tokens/s after the warm-up, torch's and the device's memory peaks beside the worker's
memory plan of what ran, what engaged, the completions vLLM generated, and a check variant's finding: `checks`) as
one `RESULT_MARKER` line for the runner; a probe variant runs its probe (`probes`) instead and prints what it found."""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

from loraflow_worker.gpu_smoke.machine import GIB, DeviceMemory, installed_versions
from loraflow_worker.gpu_smoke.model_and_data import TASK_PROMPTS, model_dir
from loraflow_worker.gpu_smoke.probes import PROBES, allocator_getter
from loraflow_worker.gpu_smoke.variants import HEAD_CHECK_STEP, TOOL_COMPLETION_TOKENS, Size, Variant, by_name

RESULT_MARKER = "GPU_SMOKE_RESULT "


def run_probe(out: Path, variant: Variant, full_attention: bool) -> int:
    """Run `variant`'s probe on the smoke model in `out` (first thing in the process: `cuda_init` must find CUDA as
    the imports leave it) and print what it found as one `RESULT_MARKER` line; 0."""
    import torch

    started = time.monotonic()
    seen, error = PROBES[variant.probe](model_dir(out, full_attention or variant.full_attention),
                                        torch.cuda.is_available())
    result = {"variant": variant.name, "algorithm": "probe", "took_s": round(time.monotonic() - started, 1),
              "fast_paths": {}, "check": seen, "check_error": error, "error": None}
    print(RESULT_MARKER + json.dumps(result), flush=True)
    return 0


def measure(out: Path, size: Size, variant_name: str, algorithm: str, warmup: int, steps: int, *,
            full_attention: bool = False) -> int:
    """Train `variant_name` for `algorithm` (`warmup` untimed steps, then `steps` timed ones) on the model (the Qwen3
    one of full-attention layers with `full_attention` or where the variant asks for it) and data in `out`, print the
    figures as one `RESULT_MARKER` line; 0."""
    import torch
    from transformers import TrainerCallback

    from loraflow_worker.artifacts import open_store
    from loraflow_worker.contract import JobInput

    variant = by_name([variant_name])[0]
    if variant.probe:
        return run_probe(out, variant, full_attention)
    cuda = torch.cuda.is_available()
    allocator_probe = allocator_getter()
    device_memory = DeviceMemory.open() if cuda else None

    class Throughput(TrainerCallback):
        """(time, tokens seen) at the end of every optimizer step, once the GPU has finished the step's work."""

        def __init__(self) -> None:
            self.marks: list[tuple[float, int]] = []

        def on_step_end(self, args, state, control, **kwargs):
            if cuda:
                torch.cuda.synchronize()  # the kernels are queued asynchronously: wait for them before reading the clock
            self.marks.append((time.perf_counter(), int(state.num_input_tokens_seen)))

    run_id = f"{variant.name}-{algorithm}"
    model = model_dir(out, full_attention or variant.full_attention)
    work_dir = out / "work" / run_id
    work_dir.mkdir(parents=True, exist_ok=True)
    job_input = smoke_job(out, model, size, variant, algorithm, warmup + steps)
    watchers: list = []
    if variant.tools:
        from loraflow_worker.gpu_smoke.checks import teach_tool_call
        from loraflow_worker.self_test.tool_use import LEDGER_ENV

        ledger = work_dir / "ledger.txt"
        os.environ[LEDGER_ENV] = str(ledger)  # where the tool records each call (`tool_use.TOOLS_SOURCE`)
        job_input["lora"]["init_from"] = teach_tool_call(out, model, f"{run_id}-teach")
        if cuda:
            torch.cuda.reset_peak_memory_stats()  # the peaks are the GRPO run's, not the teaching's
    if variant.packing:
        from loraflow_worker.gpu_smoke.checks import PackedLabels

        watchers.append(PackedLabels())
    if variant.modules_to_save:
        from loraflow_worker.gpu_smoke.checks import HeadMoved

        watchers.append(HeadMoved())
    job = JobInput.model_validate(job_input)
    if algorithm == "sft":
        from loraflow_worker.training.sft import train_sft as train
    elif algorithm == "dpo":
        from loraflow_worker.training.dpo import train_dpo as train
    else:
        from loraflow_worker.training.grpo import train_grpo as train
    # Only a GRPO run that may colocate vLLM counts its completions: the counter imports TRL's vLLM module, which
    # imports vLLM wherever it is installed, and an SFT run must not pay for (or be changed by) that import.
    may_use_vllm = algorithm == "grpo" and "vllm" in installed_versions() and "vllm_colocate" not in variant.disabled
    vllm = _count_vllm_completions() if may_use_vllm else {"completions": 0}
    throughput = Throughput()
    if device_memory:
        device_memory.start()
    try:
        outcome = train(job, open_store(job.artifact_store), work_dir, lambda progress: None,
                        callbacks=[throughput, *(w for w in watchers if isinstance(w, TrainerCallback))])
    finally:
        device = device_memory.stop() if device_memory else None
    (t0, n0), (t1, n1) = throughput.marks[warmup - 1], throughput.marks[-1]
    plan = outcome.manifest.memory_plan  # the worker's own plan of what ran (None without CUDA)
    findings = [watcher.result() for watcher in watchers]
    if variant.tools:
        from loraflow_worker.gpu_smoke.checks import tool_syncs

        findings.append(tool_syncs(outcome.manifest, ledger, warmup + steps))
    if variant.task_eval:
        from loraflow_worker.gpu_smoke.checks import task_answering

        findings.append(task_answering(job, work_dir, outcome.adapter_dir, warmup + steps))
    result = {
        "variant": variant.name,
        "algorithm": algorithm,
        "quantization": variant.quantization,
        "timed_steps": len(throughput.marks) - warmup,
        "tokens_per_second": (n1 - n0) / (t1 - t0) if t1 > t0 else 0.0,
        "device": outcome.metrics.device,
        "max_memory_reserved_gib": round(torch.cuda.max_memory_reserved() / GIB, 2) if cuda else None,
        "max_memory_allocated_gib": round(torch.cuda.max_memory_allocated() / GIB, 2) if cuda else None,
        "device_peak_gib": device["peak_gib"] if device else None,
        "device_baseline_gib": device["baseline_gib"] if device else None,
        "plan_estimate_gib": round(plan.estimate_bytes / GIB, 2) if plan else None,
        "plan_breakdown_gib": ({name.removesuffix("_bytes"): round(value / GIB, 2)
                                for name, value in plan.breakdown.model_dump().items() if name.endswith("_bytes")}
                               if plan else None),
        "vllm_completions": vllm["completions"],
        "vllm_imported": "vllm" in sys.modules,
        "fla_backends": _fla_backends(),
        "allocator_probe": allocator_probe,
        "fast_paths": {name: [p.engaged, p.reason] for name, p in outcome.manifest.fast_paths.items()},
        "vllm_weight_syncs": (outcome.manifest.vllm_weight_syncs.model_dump(mode="json")
                              if outcome.manifest.vllm_weight_syncs else None),
        "check": "; ".join(seen for seen, _ in findings) or None,
        "check_error": "; ".join(error for _, error in findings if error) or None,
        "error": None,
    }
    print(RESULT_MARKER + json.dumps(result), flush=True)
    return 0


def smoke_job(out: Path, model: Path, size: Size, variant: Variant, algorithm: str, total_steps: int) -> dict:
    """The job input of `variant`'s `algorithm` run on `model`, reading the data `model_and_data.write_datasets`
    wrote into `out`'s store."""
    data = "tools" if variant.tools else "chats" if variant.packing or variant.task_eval else algorithm
    job_input: dict = {
        "run_id": f"{variant.name}-{algorithm}",
        "algorithm": algorithm,
        "model": {"id": str(model)},
        "dataset": {"store_path": f"data/{data}.jsonl"},
        "training": {"max_steps": max(total_steps, HEAD_CHECK_STEP) if variant.modules_to_save else total_steps,
                     "batch_size": size.batch, "learning_rate": variant.learning_rate or 1e-4, "logging_steps": 1},
        "lora": {},
        "artifact_store": (out / "store").as_uri(),
        "fast_paths": {**dict.fromkeys(variant.disabled, False), **dict.fromkeys(variant.forced, True)},
    }
    if variant.quantization:
        job_input["lora"]["quantization"] = variant.quantization
    if variant.modules_to_save:
        job_input["lora"]["modules_to_save"] = list(variant.modules_to_save)
    if algorithm in ("sft", "dpo"):
        job_input["training"]["max_seq_length"] = size.seq_len
    if variant.packing:
        job_input["training"]["packing"] = True
    if variant.task_eval:
        job_input["evaluation"] = {"tasks": [{
            "name": "chats", "store_path": "data/task.jsonl", "graders": [{"kind": "contains"}, {"kind": "f1"}],
            "max_new_tokens": 32, "samples_kept": TASK_PROMPTS}]}
    if algorithm == "dpo":
        job_input["dpo"] = {"beta": 0.1}
    if algorithm == "grpo":
        job_input["training"]["batch_size"] = size.batch * size.generations // 2
        job_input["grpo"] = {"num_generations": size.generations, "max_completion_length": size.completion_len,
                             "rewards": [{"name": "digit_fraction"}]}
    if variant.tools:
        # The tool and its reward as a run's files in the store (`tool_use`); the adapter that calls it comes from
        # the teaching run (`checks.teach_tool_call`), whose rank and alpha these are.
        job_input["lora"] |= {"rank": 8, "alpha": 16}
        job_input["grpo"] |= {"max_completion_length": max(size.completion_len, TOOL_COMPLETION_TOKENS),
                              "temperature": 0.3, "max_tool_calls": 1, "tools": "tools.py",
                              "tools_store_path": "tools/tools.py",
                              "rewards": [{"name": "reward.py:receipt", "store_path": "rewards/reward.py"}]}
    return job_input


def _fla_backends() -> dict[str, str] | None:
    """The backend fla chose for each operation it dispatched in this process ('triton' where no other backend is
    enabled and available), or None when fla was never imported. TODO: read it from a public API once fla has one
    (fla-core 0.6.0 keeps the registries in `fla.backends._operation_registries`)."""
    if "fla" not in sys.modules:
        return None
    try:
        from fla.backends import _operation_registries
    except ImportError:  # before 0.6, fla kept them in fla.ops.backends (0.5.2): the run's figures stand without them
        return {"all": "unknown (no fla.backends in this fla)"}

    chosen = {}
    for operation, registry in _operation_registries.items():
        active = registry.get_active()
        chosen[operation] = active.backend_type if active else "triton"
    return chosen


def _count_vllm_completions() -> dict[str, int]:
    """Counts the completions vLLM returns to TRL, where TRL's `VLLMGeneration.generate` hands them to the trainer
    (its second result: one token list per completion). Wraps that method in this child process only."""
    from trl.generation.vllm_generation import VLLMGeneration

    counts = {"completions": 0}
    generate = VLLMGeneration.generate

    def counting_generate(self, *args, **kwargs):
        result = generate(self, *args, **kwargs)
        counts["completions"] += len(result[1])
        return result

    VLLMGeneration.generate = counting_generate
    return counts
