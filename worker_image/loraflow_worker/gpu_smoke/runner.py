"""GPU smoke run: a random-init Qwen3.5 model with a real model's vocabulary (151,936 tokens) and width (hidden
2048) trained for SFT and GRPO steps through the real worker code, printing for each run the tokens/s, the memory
torch reserved and the device's own peak, what engaged, and the machine's library versions beside the figures.
Usually started by `worker_image/gpu_smoke.sh`:

    python -m loraflow_worker.gpu_smoke                 # on a GPU: the slot's runs (below) within 420 s
    python -m loraflow_worker.gpu_smoke --variants all,no-liger,no-vllm --deadline 900
    python -m loraflow_worker.gpu_smoke --memory        # on a GPU: the memory plan against the peaks, within 330 s
    python -m loraflow_worker.gpu_smoke --bf16          # on a GPU: what bf16 does to training (probes), within 400 s
    python -m loraflow_worker.gpu_smoke --cpu --steps 2 --warmup 1       # the same machinery on CPU (nothing engages)

`--list` lists every variant (its algorithms, model, the selections that run it, what it changes or checks) and runs
nothing. The check variants (`variants.CHECK_VARIANTS`: `dpo`, `grpo-qwen3`, `tools-grpo`, `packed`,
`modules-to-save`, `task-eval`) are named with `--variants`; each reports what it checked beside the table, and
fails on a fault.

By default it fits a lent GPU machine's slot (one command of at most 10 minutes): 420 s for SFT with every fast
path installed, SFT without Liger and without flash-linear-attention (each skipped, saying so, where the package
is absent: `all` already ran without it), QLoRA SFT (skipped, not passed, without bitsandbytes), and GRPO without
vLLM. Each run is a child process with its own share of the time left, so one that hangs is killed at the end of
its share and cannot eat the others'.

`--memory` calibrates the memory planner instead: SFT with gradient checkpointing on and off, each with and without
Liger, and QLoRA with checkpointing and as planned (`variants.MEMORY_RUNS`), 1 warm-up and 2 timed steps each, within
330 s, on a Qwen3 model of the same size (full-attention layers only: the lent machines have no
flash-linear-attention, and transformers' torch fallback for Gated-DeltaNet layers is neither what the image runs nor
what the plan counts); a second table sets the plan's estimate of each configuration that ran (the worker's own plan, from its
manifest) beside torch's `max_memory_allocated`, `max_memory_reserved` and NVML's device peak. With the carried
wheels' install (`gpu_smoke.sh --carried .whl --memory`) it is one command of at most 8 minutes on a lent machine.

`--bf16` shows what a bf16 GPU does to training that the CPU tests, in fp32, cannot (`variants.BF16_RUNS`, within
400 s on the same Qwen3 model, one command of at most 8 minutes with the install): the bf16 probes (`probes`: CUDA
initialised by the training process's imports, the base values 200 vLLM syncs change by TRL's merge and unmerge and by
the worker's temporaries, packed against unpacked per-token log-probs with Liger off and on, a bf16 against an fp32
head copy at 1e-5), the head copy of `modules_to_save` trained through the worker at 1e-5 and 1e-4, and the memory
plan against the peaks for QLoRA, `modules_to_save` and DPO.

Each run is its own process also because transformers binds flash-linear-attention when the modeling module is
imported: a variant switches fast paths off, or a memory saver on, in its job's `fast_paths`, or loads the base in
4 bits (`lora.quantization`), and differs from `all` in that alone. Throughput counts only the steps after the warm-up (Triton's kernel compilation, vLLM's start), with CUDA
synchronised at the end of every step so that the clock sees the GPU's work rather than its queue. Memory: torch's
`max_memory_reserved` (what its caching allocator took from the device) and the device's peak as NVML saw it,
sampled in a thread (that also counts the CUDA context, cuBLAS workspaces and vLLM's own pool, which torch never
sees). For GRPO the run counts the completions vLLM returned to TRL, so a colocated vLLM that generated nothing is
a failure, not a fast path.

Before anything runs on a GPU, the smoke refuses a GPU that another process is using (its memory and compute would
skew every figure) and the kernel combinations known to train wrongly or not at all (`machine.kernel_problems`).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

from loraflow_worker.gpu_smoke.machine import gpu_refusal, installed_versions, read_gpu, versions_line
from loraflow_worker.gpu_smoke.measure import RESULT_MARKER, measure
from loraflow_worker.gpu_smoke.model_and_data import build_smoke_model, model_dir, write_datasets
from loraflow_worker.gpu_smoke.report import report
from loraflow_worker.gpu_smoke.variants import (
    BF16_RUNS,
    CPU_SIZE,
    CPU_VARIANTS,
    GPU_SIZE,
    MEMORY_RUNS,
    MEMORY_STEPS,
    SLOT_RUNS,
    VARIANTS,
    Run,
    by_name,
    list_variants,
    parse_variant_names,
    skip_reason,
)

RESULTS_FILE = "results.json"
SLOT_DEADLINE_S = 420.0
"""The default budget on a GPU, model build, runs and report included. A lent machine runs one command for at most
600 s; the other 180 s are for installing the carried wheels (`gpu_smoke.sh --carried`) and a margin."""
MEMORY_DEADLINE_S = 330.0
"""`--memory`'s budget on a GPU: with the carried wheels' install and a margin (150 s), one command of at most 8
minutes."""
BF16_DEADLINE_S = 400.0
"""`--bf16`'s budget on a GPU: with the carried wheels' install and a margin (80 s), one command of at most 8
minutes."""


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m loraflow_worker.gpu_smoke",
        description="Train a Qwen3.5-shaped model through the worker, with and without fast paths.")
    parser.add_argument("--cpu", action="store_true", help="Run on CPU (checks the machinery; nothing engages).")
    parser.add_argument("--variants", type=parse_variant_names, default=None,
                        help=f"Comma-separated variants to run, in this order, each for every algorithm it has (default "
                             f"on a GPU: {', '.join(f'{v}/{a}' for v, a in SLOT_RUNS)}; on CPU: {','.join(CPU_VARIANTS)}). "
                             f"Known: {', '.join(v.name for v in VARIANTS)}.")
    parser.add_argument("--memory", action="store_true",
                        help=f"Calibrate the memory plan: {', '.join(f'{v}/{a}' for v, a in MEMORY_RUNS)} (unless "
                             f"--variants says otherwise), {MEMORY_STEPS[0]} warm-up and {MEMORY_STEPS[1]} timed steps "
                             f"each, {MEMORY_DEADLINE_S:.0f} s on a GPU.")
    parser.add_argument("--bf16", action="store_true",
                        help=f"What bf16 does to training: {', '.join(f'{v}/{a}' for v, a in BF16_RUNS)} (unless "
                             f"--variants says otherwise), {BF16_DEADLINE_S:.0f} s on a GPU.")
    parser.add_argument("--steps", type=int, default=None,
                        help="Timed optimizer steps per run (default 8; 2 on CPU, with --memory or --bf16).")
    parser.add_argument("--warmup", type=int, default=None,
                        help="Untimed steps before them, at least 1 (default 2; 1 on CPU, with --memory or --bf16).")
    parser.add_argument("--deadline", type=float, default=None,
                        help=f"Seconds for the whole smoke run (default {SLOT_DEADLINE_S:.0f} on a GPU, none on CPU): each "
                             "run gets its share of the time left, and runs that cannot start before it are reported as not run.")
    parser.add_argument("--out", type=Path, default=None, help="Working folder (default: a new temporary folder).")
    parser.add_argument("--variant-timeout", type=float, default=600.0, help="Seconds one run may take at most.")
    parser.add_argument("--allow-busy-gpu", action="store_true",
                        help="Run even when NVML lists another process on the GPU (its figures are then not this run's alone).")
    parser.add_argument("--list", action="store_true",
                        help="List every variant (its algorithms, model, the selections that run it, what it changes or "
                             "checks) and run nothing.")
    parser.add_argument("--full-attention", action="store_true", help=argparse.SUPPRESS)  # a child of --memory
    parser.add_argument("--child", nargs=2, metavar=("VARIANT", "ALGORITHM"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.list:
        print(list_variants())
        return 0
    started = time.monotonic()
    out = args.out or Path(tempfile.mkdtemp(prefix="loraflow-gpu-smoke-"))
    size = CPU_SIZE if args.cpu else GPU_SIZE
    short = args.cpu or args.memory or args.bf16
    steps = args.steps if args.steps is not None else (MEMORY_STEPS[1] if short else 8)
    warmup = args.warmup if args.warmup is not None else (MEMORY_STEPS[0] if short else 2)
    if steps < 1 or warmup < 1:
        parser.error("--steps and --warmup must be at least 1 (the first step compiles kernels: it is never timed)")
    if args.child:
        return measure(out, size, args.child[0], args.child[1], warmup, steps, full_attention=args.full_attention)

    packages = installed_versions()
    gpu: dict | None = None
    if args.cpu:
        os.environ["CUDA_VISIBLE_DEVICES"] = ""  # the children inherit it: torch then sees no GPU
        deadline = args.deadline
    else:
        import torch

        if not torch.cuda.is_available():  # counts devices without creating a CUDA context in this process
            parser.error("no CUDA device here: run with --cpu for the CPU check")
        gpu = read_gpu()
        deadline = args.deadline if args.deadline is not None else (
            MEMORY_DEADLINE_S if args.memory else BF16_DEADLINE_S if args.bf16 else SLOT_DEADLINE_S)
    print(versions_line(packages, gpu), flush=True)
    if gpu is not None:
        refusal = gpu_refusal(gpu, packages, os.environ, allow_busy=args.allow_busy_gpu)
        if refusal:
            print(f"gpu_smoke: refused: {refusal}", file=sys.stderr)
            return 2
        if gpu["warning"]:
            print(f"warning: {gpu['warning']}", flush=True)

    planned = selected_runs(args.variants, memory=args.memory, cpu=args.cpu, packages=packages, bf16=args.bf16)

    # The memory calibration trains full-attention layers: a lent machine has no flash-linear-attention, and
    # transformers' torch fallback for Gated-DeltaNet layers is not what the image runs nor what the plan counts.
    # Some check variants train the full-attention model whatever the mode (`Variant.full_attention`).
    full_attention = (args.memory or args.bf16) and not args.variants
    for full in sorted({full_attention or run.variant.full_attention for run in planned if not run.skipped}):
        built = build_smoke_model(model_dir(out, full), size, full_attention=full)
        print(f"model: {built} ({'Qwen3, full attention' if full else 'Qwen3.5'}, vocabulary {size.vocab}, hidden "
              f"{size.hidden}, {size.layers} layers); SFT sequences of {size.seq_len} tokens; {warmup} warm-up + "
              f"{steps} timed steps per run"
              + (f"; {deadline:.0f} s in all, {time.monotonic() - started:.0f} s of it spent" if deadline is not None
                 else ""), flush=True)
    write_datasets(out, size, warmup + steps)
    deadline_at = started + deadline if deadline is not None else None

    def run_one(run: Run, timeout: float) -> dict:
        return _run_child(out, run, args.cpu, warmup, steps, timeout, full_attention)

    results = run_variants(planned, run_one, args.variant_timeout, deadline_at)
    took = time.monotonic() - started
    print(report(results))
    print(f"smoke run took {took:.0f} s")
    (out / RESULTS_FILE).write_text(json.dumps(
        {"versions": packages, "gpu": gpu, "size": size.__dict__, "warmup": warmup, "steps": steps,
         "deadline_s": deadline, "took_s": round(took, 1), "runs": results}, indent=2) + "\n")
    print(f"results: {out / RESULTS_FILE}")
    return 0 if all(r.get("error") is None for r in results) else 1


def selected_runs(variants: Sequence[str] | None, *, memory: bool, cpu: bool, packages: Mapping[str, str],
                  bf16: bool = False) -> list[Run]:
    """The runs to make, in order, each with why it is skipped where its package is missing: the named `variants`
    for every algorithm each has, else the memory calibration's (`--memory`), the bf16 probes' (`--bf16`), the CPU
    check's, or the slot's."""
    if variants:
        runs = [(variant, algorithm) for variant in by_name(variants) for algorithm in variant.algorithms]
    elif memory:
        runs = [(by_name([name])[0], algorithm) for name, algorithm in MEMORY_RUNS]
    elif bf16:
        runs = [(by_name([name])[0], algorithm) for name, algorithm in BF16_RUNS]
    elif cpu:
        runs = [(variant, algorithm) for variant in by_name(CPU_VARIANTS) for algorithm in variant.algorithms]
    else:
        runs = [(by_name([name])[0], algorithm) for name, algorithm in SLOT_RUNS]
    return [Run(variant, algorithm, skip_reason(variant, packages)) for variant, algorithm in runs]


def run_variants(runs: Sequence[Run], run_one: Callable[[Run, float], dict], variant_timeout: float,
                 deadline_at: float | None, clock: Callable[[], float] = time.monotonic) -> list[dict]:
    """Run each of `runs` with `run_one(run, timeout)` in order. A skipped run is reported and takes no time. With a
    deadline (`deadline_at`, on `clock`), each run's timeout is its share of the time left, by weight among the runs
    still to come: what an early finisher leaves passes on, and a hang costs only its own share. Once the deadline
    has passed, the rest are reported as not run. No run gets more than `variant_timeout`."""
    results = []
    for index, run in enumerate(runs):
        head = {"variant": run.variant.name, "algorithm": run.algorithm}
        if run.skipped:
            print(f"-- {run.variant.name} / {run.algorithm}: skipped: {run.skipped}", flush=True)
            results.append({**head, "skipped": run.skipped, "error": None})
            continue
        timeout = variant_timeout
        if deadline_at is not None:
            left = deadline_at - clock()
            if left <= 0:
                results.append({**head, "not_run": "deadline reached", "error": None})
                continue
            weights = sum(r.weight for r in runs[index:] if not r.skipped)
            timeout = min(variant_timeout, left * run.weight / weights)
        print(f"-- {run.variant.name} / {run.algorithm} (at most {timeout:.0f} s)", flush=True)
        results.append(run_one(run, timeout))
    return results


def _run_child(out: Path, run: Run, cpu: bool, warmup: int, steps: int, timeout: float, full_attention: bool) -> dict:
    variant, algorithm = run.variant, run.algorithm
    command = [sys.executable, "-m", "loraflow_worker.gpu_smoke", "--out", str(out), "--warmup", str(warmup),
               "--steps", str(steps), "--child", variant.name, algorithm] + (["--cpu"] if cpu else []) + (
               ["--full-attention"] if full_attention else [])
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    returncode, stdout, stderr = run_in_session(command, env, timeout)
    if returncode is None:
        return {"variant": variant.name, "algorithm": algorithm,
                "error": f"timed out after its share of {timeout:.0f} s; last said: {_tail(stdout, stderr)}"}
    for line in stdout.splitlines():
        if line.startswith(RESULT_MARKER):
            return _checked(json.loads(line[len(RESULT_MARKER):]))
    return {"variant": variant.name, "algorithm": algorithm, "error": f"exit {returncode}: {_tail(stdout, stderr)}"}


def run_in_session(command: Sequence[str], env: Mapping[str, str], timeout: float) -> tuple[int | None, str, str]:
    """Run `command` in a process session of its own for at most `timeout` seconds: (exit status, or None when it
    ran out of time, stdout, stderr). Whatever it started is killed with it when it ends or runs out of time, so
    that its children (vLLM's engine, compile workers), which hold GPU memory, never outlive it: the next run must
    find the GPU as this one did."""
    child = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                             start_new_session=True)
    try:
        stdout, stderr = child.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        _kill_session(child.pid)
        stdout, stderr = child.communicate()
        return None, stdout, stderr
    _kill_session(child.pid)
    return child.returncode, stdout, stderr


def _tail(stdout: str, stderr: str) -> str:
    return " | ".join((stderr or stdout).strip().splitlines()[-3:])[-400:]


def _kill_session(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass  # the session ended with the child


def _checked(result: dict) -> dict:
    """A child's result, failed when a fast path it reports engaged did not do its work, or its check found a fault."""
    vllm_engaged, vllm_reason = result["fast_paths"].get("vllm_colocate", (False, "not a training run"))
    if result["algorithm"] == "grpo" and vllm_engaged and not result["vllm_completions"]:
        return {**result, "error": "vllm_colocate is engaged, but vLLM returned no completion to TRL"}
    if vllm_reason.startswith("failed: "):  # the job went on without it; the smoke is where that must show
        return {**result, "error": f"vllm_colocate {vllm_reason}"}
    if result.get("check_error"):
        return {**result, "error": f"check: {result['check_error']} ({result['check']})"}
    return result
