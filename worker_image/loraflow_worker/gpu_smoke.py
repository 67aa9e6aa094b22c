"""GPU smoke run: a random-init Qwen3.5 model with a real model's vocabulary (151,936 tokens) and width (hidden
2048) trained for SFT and GRPO steps through the real worker code, printing for each run the tokens/s, the memory
torch reserved and the device's own peak, what engaged, and the machine's library versions beside the figures.
Usually started by `worker_image/gpu_smoke.sh`:

    python -m loraflow_worker.gpu_smoke                 # on a GPU: the slot's runs (below) within 420 s
    python -m loraflow_worker.gpu_smoke --variants all,no-liger,no-vllm --deadline 900
    python -m loraflow_worker.gpu_smoke --cpu --steps 2 --warmup 1       # the same machinery on CPU (nothing engages)

By default it fits a lent GPU machine's slot (one command of at most 10 minutes): 420 s for SFT with every fast
path installed, SFT without Liger and without flash-linear-attention (each skipped, saying so, where the package
is absent: `all` already ran without it), QLoRA SFT (skipped, not passed, without bitsandbytes), and GRPO without
vLLM. Each run is a child process with its own share of the time left, so one that hangs is killed at the end of
its share and cannot eat the others'.

Each run is its own process also because transformers binds flash-linear-attention when the modeling module is
imported: a variant switches fast paths off, or a memory saver on, in its job's `fast_paths`, or loads the base in
4 bits (`lora.quantization`), and differs from `all` in that alone. Throughput counts only the steps after the warm-up (Triton's kernel compilation, vLLM's start), with CUDA
synchronised at the end of every step so that the clock sees the GPU's work rather than its queue. Memory: torch's
`max_memory_reserved` (what its caching allocator took from the device) and the device's peak as NVML saw it,
sampled in a thread (that also counts the CUDA context, cuBLAS workspaces and vLLM's own pool, which torch never
sees). For GRPO the run counts the completions vLLM returned to TRL, so a colocated vLLM that generated nothing is
a failure, not a fast path.

Before anything runs on a GPU, the smoke refuses a GPU that another process is using (its memory and compute would
skew every figure) and the kernel combinations known to train wrongly or not at all (`kernel_problems`).
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from packaging.version import Version

from loraflow_worker.training.fast_paths import ALLOC_CONF_ENV

RESULT_MARKER = "GPU_SMOKE_RESULT "
RESULTS_FILE = "results.json"
SLOT_DEADLINE_S = 420.0
"""The default budget on a GPU, model build, runs and report included. A lent machine runs one command for at most
600 s; the other 180 s are for installing the carried wheels (`gpu_smoke.sh --carried`) and a margin."""
GIB = 2**30


@dataclass(frozen=True)
class Variant:
    """One configuration of the worker: `all` less the `disabled` fast paths, plus the `forced` memory savers, with
    the base model loaded in `quantization` bits when set. `needs` is (distribution, why): without it the variant
    is skipped, not run."""

    name: str
    algorithms: tuple[str, ...]
    disabled: frozenset[str] = frozenset()
    forced: frozenset[str] = frozenset()
    quantization: str | None = None
    needs: tuple[str, str] | None = None


KERNELS = frozenset({"liger_kernel", "flash_linear_attention", "causal_conv1d", "fused_adamw", "expandable_segments"})
"""The speed-ups `no-kernels` removes together. Precision (bf16) and the memory trade-offs (gradient checkpointing,
8-bit AdamW, which the memory estimate decides) are measured by variants of their own."""
VARIANTS = (
    Variant("all", ("sft", "grpo")),
    Variant("no-liger", ("sft",), disabled=frozenset({"liger_kernel"}),
            needs=("liger-kernel", "without it `all` already ran without Liger")),
    Variant("no-fla", ("sft",), disabled=frozenset({"flash_linear_attention", "causal_conv1d"}),
            needs=("flash-linear-attention", "without it `all` already ran transformers' torch loop")),
    Variant("qlora", ("sft",), quantization="4bit",
            needs=("bitsandbytes", "QLoRA loads the base model in 4 bits through it")),
    Variant("no-fused-adamw", ("sft",), disabled=frozenset({"fused_adamw"})),
    Variant("no-expandable-segments", ("sft",), disabled=frozenset({"expandable_segments"})),
    Variant("no-kernels", ("sft",), disabled=KERNELS),
    Variant("checkpointing", ("sft",), forced=frozenset({"gradient_checkpointing"})),
    Variant("no-checkpointing", ("sft",), disabled=frozenset({"gradient_checkpointing"})),
    Variant("paged-adamw-8bit", ("sft",), forced=frozenset({"paged_adamw_8bit"}),
            needs=("bitsandbytes", "8-bit paged AdamW is its optimizer")),
    Variant("no-vllm", ("grpo",), disabled=frozenset({"vllm_colocate"})),
)
SLOT_RUNS = (("all", "sft"), ("no-liger", "sft"), ("no-fla", "sft"), ("qlora", "sft"), ("no-vllm", "grpo"))
"""What a GPU run does unless `--variants` says otherwise: what fits a lent machine's slot. GRPO goes without vLLM
(`use_vllm=False`): a lent machine has none, and vLLM's start alone would take a large part of the budget."""
CPU_VARIANTS = ("all", "no-kernels")
"""What `--cpu` runs unless `--variants` says otherwise (on CPU every fast path is off anyway)."""
ALGORITHM_WEIGHT = {"sft": 1.0, "grpo": 2.0}
"""A run's share of the time left, relative to the other runs still to come. A GRPO step also generates its
completions token by token (transformers' `generate` without vLLM), so it gets twice an SFT run's share: an
estimate, not a measurement (no GPU run has been timed yet)."""
VERSIONED = ("torch", "transformers", "trl", "peft", "accelerate", "triton", "liger-kernel", "flash-linear-attention",
             "causal-conv1d", "tilelang", "bitsandbytes", "vllm", "nvidia-ml-py")
"""The distributions whose versions the report prints beside the figures ("absent" when not installed)."""


@dataclass(frozen=True)
class Size:
    """Model and batch shape of a smoke run."""

    vocab: int
    hidden: int
    layers: int
    heads: int
    seq_len: int
    batch: int
    generations: int
    completion_len: int


GPU_SIZE = Size(vocab=151_936, hidden=2048, layers=8, heads=16, seq_len=2048, batch=8, generations=8, completion_len=256)
"""Qwen3's vocabulary and a 2B-class width (Qwen3.5-2B: hidden 2048), fewer layers to keep each run short."""
CPU_SIZE = Size(vocab=1024, hidden=64, layers=4, heads=4, seq_len=64, batch=4, generations=2, completion_len=8)


@dataclass(frozen=True)
class Run:
    """One (variant, algorithm) of a smoke run; `skipped` says why it will not run, when it will not."""

    variant: Variant
    algorithm: str
    skipped: str | None = None

    @property
    def weight(self) -> float:
        return ALGORITHM_WEIGHT[self.algorithm]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Train a Qwen3.5-shaped model through the worker, with and without fast paths.")
    parser.add_argument("--cpu", action="store_true", help="Run on CPU (checks the machinery; nothing engages).")
    parser.add_argument("--variants", type=_variant_names, default=None,
                        help=f"Comma-separated variants to run, in this order, each for every algorithm it has (default "
                             f"on a GPU: {', '.join(f'{v}/{a}' for v, a in SLOT_RUNS)}; on CPU: {','.join(CPU_VARIANTS)}). "
                             f"Known: {', '.join(v.name for v in VARIANTS)}.")
    parser.add_argument("--steps", type=int, default=None, help="Timed optimizer steps per run (default 8; 2 on CPU).")
    parser.add_argument("--warmup", type=int, default=None, help="Untimed steps before them, at least 1 (default 2; 1 on CPU).")
    parser.add_argument("--deadline", type=float, default=None,
                        help=f"Seconds for the whole smoke run (default {SLOT_DEADLINE_S:.0f} on a GPU, none on CPU): each "
                             "run gets its share of the time left, and runs that cannot start before it are reported as not run.")
    parser.add_argument("--out", type=Path, default=None, help="Working folder (default: a new temporary folder).")
    parser.add_argument("--variant-timeout", type=float, default=600.0, help="Seconds one run may take at most.")
    parser.add_argument("--allow-busy-gpu", action="store_true",
                        help="Run even when NVML lists another process on the GPU (its figures are then not this run's alone).")
    parser.add_argument("--child", nargs=2, metavar=("VARIANT", "ALGORITHM"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    started = time.monotonic()
    out = args.out or Path(tempfile.mkdtemp(prefix="loraflow-gpu-smoke-"))
    size = CPU_SIZE if args.cpu else GPU_SIZE
    steps = args.steps if args.steps is not None else (2 if args.cpu else 8)
    warmup = args.warmup if args.warmup is not None else (1 if args.cpu else 2)
    if steps < 1 or warmup < 1:
        parser.error("--steps and --warmup must be at least 1 (the first step compiles kernels: it is never timed)")
    if args.child:
        return _child(out, size, args.child[0], args.child[1], warmup, steps)

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
        deadline = args.deadline if args.deadline is not None else SLOT_DEADLINE_S
    print(versions_line(packages, gpu), flush=True)
    if gpu is not None:
        refusal = gpu_refusal(gpu, packages, os.environ, allow_busy=args.allow_busy_gpu)
        if refusal:
            print(f"gpu_smoke: refused: {refusal}", file=sys.stderr)
            return 2
        if gpu["warning"]:
            print(f"warning: {gpu['warning']}", flush=True)

    if args.variants:
        runs = [(variant, algorithm) for variant in _by_name(args.variants) for algorithm in variant.algorithms]
    elif args.cpu:
        runs = [(variant, algorithm) for variant in _by_name(CPU_VARIANTS) for algorithm in variant.algorithms]
    else:
        runs = [(_by_name([name])[0], algorithm) for name, algorithm in SLOT_RUNS]
    planned = [Run(variant, algorithm, skip_reason(variant, packages)) for variant, algorithm in runs]

    model_dir = build_smoke_model(out / "model", size)
    write_datasets(out, size, warmup + steps)
    print(f"model: {model_dir} (Qwen3.5, vocabulary {size.vocab}, hidden {size.hidden}, {size.layers} layers); "
          f"SFT sequences of {size.seq_len} tokens; {warmup} warm-up + {steps} timed steps per run"
          + (f"; {deadline:.0f} s in all, {time.monotonic() - started:.0f} s of it spent" if deadline is not None else ""),
          flush=True)
    deadline_at = started + deadline if deadline is not None else None

    def run_one(run: Run, timeout: float) -> dict:
        return _run_child(out, run, args.cpu, warmup, steps, timeout)

    results = run_variants(planned, run_one, args.variant_timeout, deadline_at)
    took = time.monotonic() - started
    print(report(results))
    print(f"smoke run took {took:.0f} s")
    (out / RESULTS_FILE).write_text(json.dumps(
        {"versions": packages, "gpu": gpu, "size": size.__dict__, "warmup": warmup, "steps": steps,
         "deadline_s": deadline, "took_s": round(took, 1), "runs": results}, indent=2) + "\n")
    print(f"results: {out / RESULTS_FILE}")
    return 0 if all(r.get("error") is None for r in results) else 1


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


def skip_reason(variant: Variant, packages: Mapping[str, str]) -> str | None:
    """Why `variant` cannot run with the installed `packages` (distribution -> version), or None."""
    if variant.needs is None or variant.needs[0] in packages:
        return None
    distribution, why = variant.needs
    return f"{distribution} is not installed ({why})"


def installed_versions() -> dict[str, str]:
    """The versions of `VERSIONED` installed here (distribution -> version); absent ones are left out."""
    versions = {}
    for name in VERSIONED:
        try:
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return versions


def versions_line(packages: Mapping[str, str], gpu: Mapping | None) -> str:
    """One line with the GPU and the library versions, printed beside the figures."""
    import torch

    libraries = ", ".join(f"{name} {packages.get(name, 'absent')}" for name in VERSIONED if name != "torch")
    machine = "no GPU (CPU check)" if gpu is None else (
        f"{gpu['name']} (sm_{gpu['capability'][0]}{gpu['capability'][1]}, {gpu['total_gib']:.0f} GiB), driver {gpu['driver']}"
        if gpu["name"] else "GPU unknown to NVML")
    return f"machine: {machine}; torch {torch.__version__} (CUDA {torch.version.cuda}), {libraries}"


# fla-org/flash-linear-attention issue 640 (root cause in PR 826) and PR 983: Triton >= 3.4.0, < 3.7.1 miscompiles the
# gated chunk_bwd_dqkwg backward on Hopper (wrong db/dg); fla-core 0.5.2 and later refuse exactly that range on
# Hopper, 0.5.0-0.5.1 refuse all of Triton >= 3.4 there unless TileLang takes the kernel, 0.4.x has no guard.
FLA_HOPPER_BAD_TRITON = (Version("3.4.0"), Version("3.7.1"))
FLA_GUARDED_SINCE = Version("0.5.2")
TILELANG_ENV = "FLA_TILELANG"
"""fla's switch for its TileLang backends (`fla/backends.py`): `0` off, any other value on, unset: each backend's
default (fla-core 0.6.0: on for Hopper with Triton >= 3.4 only)."""


def kernel_problems(capability: tuple[int, int] | None, packages: Mapping[str, str], env: Mapping[str, str]) -> list[str]:
    """Combinations of GPU, kernel packages and settings that train wrongly or fail at the first backward, each
    with its source and the fix. `capability` is the GPU's (major, minor); `packages` distribution -> version."""
    fla = packages.get("flash-linear-attention")
    if fla is None or capability is None:
        return []
    sm = f"sm_{capability[0]}{capability[1]}"
    triton = Version(packages["triton"]) if "triton" in packages else None
    tilelang_takes_it = "tilelang" in packages and env.get(TILELANG_ENV) != "0"
    problems = []
    if capability[0] == 9 and triton is not None and triton >= FLA_HOPPER_BAD_TRITON[0]:
        if triton < FLA_HOPPER_BAD_TRITON[1] and not tilelang_takes_it:
            problems.append(f"flash-linear-attention {fla} with triton {triton} on {sm}: Triton >= 3.4.0, < 3.7.1 "
                            "miscompiles fla's gated backward on Hopper (fla issue 640) and fla refuses it at the first "
                            "backward: use triton >= 3.7.1, or leave flash-linear-attention out")
        elif Version(fla) < FLA_GUARDED_SINCE and not tilelang_takes_it:
            problems.append(f"flash-linear-attention {fla} on {sm} with triton {triton}: releases before 0.5.2 either "
                            "refuse Hopper's gated backward on Triton >= 3.4 or carry no guard against its miscompilation "
                            "(fla issue 640): use flash-linear-attention >= 0.5.2 with triton >= 3.7.1")
    forced = env.get(TILELANG_ENV)
    if capability[0] >= 10 and "tilelang" in packages and forced not in (None, "0"):
        # fla PR 948: on B200 the TileLang chunk_bwd_dqkwg's dq/dk/dg errors were 0.07-0.15 against a bf16 floor of
        # ~6e-4; fla-core 0.6.0 enables it on Hopper only, so only an explicit FLA_TILELANG sends Blackwell there.
        problems.append(f"{TILELANG_ENV}={forced} on {sm} sends fla's gated backward to TileLang, whose gradients are "
                        f"wrong on Blackwell (fla PR 948): unset {TILELANG_ENV} or set it to 0")
    return problems


BUSY_USED_BYTES = 2 * GIB
"""Device memory in use, with no process listed, above which the GPU is reported as possibly shared. An idle GPU
shows a few hundred MiB (the driver's own); NVML does not list the processes of other containers' PID namespaces."""


def read_gpu() -> dict:
    """GPU 0 as NVML sees it, without creating a CUDA context in this process: name, compute capability, total and
    used memory, driver, and the compute processes on it (pid, GiB used or None)."""
    try:
        import pynvml  # nvidia-ml-py (in the image's lock, and on the lent machines)
    except ImportError:
        return {"name": None, "capability": None, "processes": [], "warning": "pynvml (nvidia-ml-py) is not installed: "
                "cannot check that the GPU is idle, nor the kernel combinations; the device's memory peak is not measured"}
    pynvml.nvmlInit()
    try:
        handle = _nvml_handle(pynvml)
        memory = pynvml.nvmlDeviceGetMemoryInfo(handle)
        processes = [(p.pid, None if p.usedGpuMemory is None else round(p.usedGpuMemory / GIB, 2))
                     for p in pynvml.nvmlDeviceGetComputeRunningProcesses(handle)]
        gpu = {"name": pynvml.nvmlDeviceGetName(handle), "capability": list(pynvml.nvmlDeviceGetCudaComputeCapability(handle)),
               "total_gib": round(memory.total / GIB, 1), "used_gib": round(memory.used / GIB, 2),
               "driver": pynvml.nvmlSystemGetDriverVersion(), "processes": processes, "warning": None}
    finally:
        pynvml.nvmlShutdown()
    if not processes and memory.used > BUSY_USED_BYTES:
        gpu["warning"] = (f"{gpu['used_gib']} GiB of the GPU is in use but NVML lists no process (another container's "
                          "are not listed here): the device peaks below may include someone else's memory")
    return gpu


def gpu_refusal(gpu: Mapping, packages: Mapping[str, str], env: Mapping[str, str], *, allow_busy: bool) -> str | None:
    """Why the smoke must not run on `gpu` (from `read_gpu`) with these packages and settings, or None."""
    others = [(pid, used) for pid, used in gpu["processes"] if pid != os.getpid()]
    if others and not allow_busy:
        listed = ", ".join(f"pid {pid} ({'?' if used is None else used} GiB)" for pid, used in others)
        return (f"the GPU is in use by another process ({listed}, as NVML's nvmlDeviceGetComputeRunningProcesses "
                "lists them): its memory and compute would skew every figure; stop it, or pass --allow-busy-gpu")
    capability = tuple(gpu["capability"]) if gpu["capability"] else None
    problems = kernel_problems(capability, packages, env)
    return "; ".join(problems) if problems else None


def build_smoke_model(out_dir: Path, size: Size) -> Path:
    """A random-init Qwen3.5 text model (Gated-DeltaNet layers, one full-attention layer in four) of `size`, with
    a tokenizer trained on the shipped chat corpus and padded to the vocabulary, saved into `out_dir` in bf16."""
    import torch
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

    from loraflow_worker.self_test.tiny_model import DEFAULT_CORPUS, IM_END, corpus_from_jsonl, train_tokenizer

    tokenizer = train_tokenizer(corpus_from_jsonl([DEFAULT_CORPUS]), vocab_size=size.vocab)
    head_dim = size.hidden // size.heads
    config = Qwen3_5TextConfig(
        vocab_size=len(tokenizer),
        hidden_size=size.hidden,
        intermediate_size=3 * size.hidden,
        num_hidden_layers=size.layers,
        num_attention_heads=size.heads,
        num_key_value_heads=max(1, size.heads // 4),
        head_dim=head_dim,
        linear_key_head_dim=head_dim,
        linear_value_head_dim=head_dim,
        linear_num_key_heads=size.heads,
        linear_num_value_heads=2 * size.heads,
        full_attention_interval=4,
        max_position_embeddings=4 * size.seq_len,
        tie_word_embeddings=True,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(0)
    model = Qwen3_5ForCausalLM(config).to(torch.bfloat16)
    model.generation_config.eos_token_id = [tokenizer.convert_tokens_to_ids(IM_END), tokenizer.eos_token_id]
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    return out_dir


def write_datasets(out: Path, size: Size, total_steps: int) -> None:
    """The artifact store the children train from: long chats for SFT (each fills the sequence length), the
    shipped chats' questions for GRPO."""
    from loraflow_worker.self_test.tiny_model import BUILTIN_TEXT, DEFAULT_CORPUS

    words = BUILTIN_TEXT.split()
    rng = random.Random(0)
    chats = [json.loads(line)["messages"] for line in DEFAULT_CORPUS.read_text().splitlines() if line.strip()]
    data = out / "store" / "data"
    data.mkdir(parents=True, exist_ok=True)
    with (data / "sft.jsonl").open("w") as f:
        for i in range(size.batch * total_steps):
            # Each word is at least one token, so this fills max_seq_length (the rest is truncated).
            answer = " ".join(rng.choice(words) for _ in range(size.seq_len))
            f.write(json.dumps({"messages": [chats[i % len(chats)][0], {"role": "assistant", "content": answer}]}) + "\n")
    with (data / "grpo.jsonl").open("w") as f:
        for chat in chats:
            f.write(json.dumps({"messages": chat}) + "\n")


def report(results: list[dict]) -> str:
    """A table of the runs: timed steps, tokens/s, how much faster `all` is than each run of the same algorithm
    (the speed-up of what the variant removes, or the cost of what it forces on), the peak memory torch reserved
    and the device's own peak, the completions vLLM generated, and what engaged; then the reasons behind `all`'s
    plan, per algorithm, and what did not run."""
    best = {r["algorithm"]: r["tokens_per_second"] for r in results if r["variant"] == "all" and r.get("tokens_per_second")}
    lines = [f"{'variant':<24}{'algorithm':<10}{'steps':>6}{'tokens/s':>12}{'all/this':>9}{'reserved':>9}{'device':>8}"
             f"{'vLLM':>7}  engaged"]
    for r in results:
        head = f"{r['variant']:<24}{r['algorithm']:<10}"
        if r.get("skipped"):
            lines.append(f"{head}{'skipped':>27}  {r['skipped']}")
            continue
        if r.get("not_run"):
            lines.append(f"{head}{'not run':>27}  {r['not_run']}")
            continue
        if r.get("error"):
            lines.append(f"{head}{'failed':>27}  {r['error']}")
            continue
        ratio = f"{best[r['algorithm']] / r['tokens_per_second']:.2f}" if best.get(r["algorithm"]) and r["tokens_per_second"] else "-"
        reserved = _gib(r.get("max_memory_reserved_gib"))
        device = _gib(r.get("device_peak_gib"))
        vllm = str(r["vllm_completions"]) if r["algorithm"] == "grpo" else "-"
        engaged = ", ".join(name for name, (on, _) in r["fast_paths"].items() if on) or "none"
        lines.append(f"{head}{r['timed_steps']:>6}{r['tokens_per_second']:>12.0f}{ratio:>9}{reserved:>9}{device:>8}"
                     f"{vllm:>7}  {engaged}")
    lines.append("reserved: torch.cuda.max_memory_reserved(), GiB; device: the device's peak used memory less its use "
                 "before the run started (NVML, sampled every 50 ms), GiB")
    for r in results:
        if r["variant"] == "all" and not r.get("error") and not r.get("not_run") and not r.get("skipped"):
            lines.append(f"why (variant `all`, {r['algorithm']}):")
            lines.extend(f"  {name}: {'on' if on else 'off'} - {reason}" for name, (on, reason) in r["fast_paths"].items())
            if r.get("fla_backends"):
                lines.append("  fla backends: " + ", ".join(f"{op} {backend}" for op, backend in sorted(r["fla_backends"].items())))
            if r.get("allocator_probe"):
                lines.append(f"  allocator settings: {r['allocator_probe']}")
    skipped = [r for r in results if r.get("skipped")]
    if skipped:
        lines.append(f"{len(skipped)} run(s) skipped, not passed: " + "; ".join(
            f"{r['variant']}/{r['algorithm']} ({r['skipped']})" for r in skipped))
    not_run = sum(1 for r in results if r.get("not_run"))
    if not_run:
        lines.append(f"{not_run} run(s) not run: the deadline was reached first")
    return "\n".join(lines)


def _gib(value: float | None) -> str:
    return f"{value:.1f}" if value is not None else "-"


def _variant_names(text: str) -> list[str]:
    names = [name.strip() for name in text.split(",") if name.strip()]
    unknown = [name for name in names if name not in {v.name for v in VARIANTS}]
    if unknown or not names:
        raise argparse.ArgumentTypeError(f"unknown variant(s) {', '.join(unknown) or '(none given)'}: "
                                         f"use any of {', '.join(v.name for v in VARIANTS)}")
    return names


def _by_name(names: Sequence[str]) -> list[Variant]:
    known = {v.name: v for v in VARIANTS}
    return [known[name] for name in names]


def _run_child(out: Path, run: Run, cpu: bool, warmup: int, steps: int, timeout: float) -> dict:
    variant, algorithm = run.variant, run.algorithm
    command = [sys.executable, "-m", "loraflow_worker.gpu_smoke", "--out", str(out), "--warmup", str(warmup),
               "--steps", str(steps), "--child", variant.name, algorithm] + (["--cpu"] if cpu else [])
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
    """A child's result, failed when a fast path it reports engaged did not do its work."""
    vllm_engaged = result["fast_paths"]["vllm_colocate"][0]
    if result["algorithm"] == "grpo" and vllm_engaged and not result["vllm_completions"]:
        return {**result, "error": "vllm_colocate is engaged, but vLLM returned no completion to TRL"}
    return result


# The worker reads what the CUDA allocator holds through torch._C._accelerator_getAllocatorSettings, which the
# torch 2.12.0 and 2.13.0 wheels have and the 2.11.0 wheel (a lent machine's own torch) lacks.
ALLOCATOR_GETTER_SINCE = Version("2.12")


def _child(out: Path, size: Size, variant_name: str, algorithm: str, warmup: int, steps: int) -> int:
    import torch
    from transformers import TrainerCallback

    from loraflow_worker.artifacts import open_store
    from loraflow_worker.contract import JobInput

    cuda = torch.cuda.is_available()
    variant = _by_name([variant_name])[0]
    allocator_probe = None
    if cuda and Version(torch.__version__).release < ALLOCATOR_GETTER_SINCE.release:
        # Set before CUDA initialises (fast_paths.gather_facts does so), the variable is what the allocator holds.
        torch._C._accelerator_getAllocatorSettings = lambda: os.environ.get(ALLOC_CONF_ENV, "")
        allocator_probe = (f"read from {ALLOC_CONF_ENV}: torch {torch.__version__} has no "
                           f"torch._C._accelerator_getAllocatorSettings (torch >= {ALLOCATOR_GETTER_SINCE} has)")
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
    job_input = {
        "run_id": run_id,
        "algorithm": algorithm,
        "model": {"id": str(out / "model")},
        "dataset": {"store_path": f"data/{algorithm}.jsonl"},
        "training": {"max_steps": warmup + steps, "batch_size": size.batch, "learning_rate": 1e-4, "logging_steps": 1},
        "artifact_store": (out / "store").as_uri(),
        "fast_paths": {**dict.fromkeys(variant.disabled, False), **dict.fromkeys(variant.forced, True)},
    }
    if variant.quantization:
        job_input["lora"] = {"quantization": variant.quantization}
    if algorithm == "sft":
        job_input["training"]["max_seq_length"] = size.seq_len
    else:
        job_input["training"]["batch_size"] = size.batch * size.generations // 2
        job_input["grpo"] = {"num_generations": size.generations, "max_completion_length": size.completion_len,
                             "rewards": [{"name": "digit_fraction"}]}
    job = JobInput.model_validate(job_input)
    work_dir = out / "work" / run_id
    work_dir.mkdir(parents=True, exist_ok=True)
    if algorithm == "sft":
        from loraflow_worker.training.sft import train_sft as train
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
        outcome = train(job, open_store(job.artifact_store), work_dir, lambda progress: None, callbacks=[throughput])
    finally:
        device = device_memory.stop() if device_memory else None
    (t0, n0), (t1, n1) = throughput.marks[warmup - 1], throughput.marks[-1]
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
        "vllm_completions": vllm["completions"],
        "vllm_imported": "vllm" in sys.modules,
        "fla_backends": _fla_backends(),
        "allocator_probe": allocator_probe,
        "fast_paths": {name: [p.engaged, p.reason] for name, p in outcome.manifest.fast_paths.items()},
        "error": None,
    }
    print(RESULT_MARKER + json.dumps(result), flush=True)
    return 0


class DeviceMemory:
    """The device's used memory as NVML reports it, sampled in a thread while a run trains: its peak less what was
    in use before (the run's whole footprint, the CUDA context and the libraries' own pools included)."""

    INTERVAL_S = 0.05

    def __init__(self, pynvml, handle) -> None:
        self._pynvml, self._handle = pynvml, handle
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self.baseline = self.peak = 0

    @classmethod
    def open(cls) -> DeviceMemory | None:
        """A sampler on the GPU this process uses, or None without pynvml (the report then shows `-`)."""
        try:
            import pynvml
        except ImportError:
            return None
        pynvml.nvmlInit()
        return cls(pynvml, _nvml_handle(pynvml))

    def _used(self) -> int:
        return self._pynvml.nvmlDeviceGetMemoryInfo(self._handle).used

    def start(self) -> None:
        self.baseline = self.peak = self._used()
        self._thread.start()

    def _sample(self) -> None:
        while not self._stop.wait(self.INTERVAL_S):
            self.peak = max(self.peak, self._used())

    def stop(self) -> dict[str, float]:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, self._used())
        self._pynvml.nvmlShutdown()
        return {"peak_gib": round((self.peak - self.baseline) / GIB, 2), "baseline_gib": round(self.baseline / GIB, 2)}


def _nvml_handle(pynvml):
    """NVML's handle of the GPU CUDA calls device 0: the first of CUDA_VISIBLE_DEVICES when that names one (an index
    in NVML's order, which is CUDA's on a one-GPU machine, or a UUID), else NVML's first."""
    first = os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",")[0].strip()
    if first.startswith(("GPU-", "MIG-")):
        return pynvml.nvmlDeviceGetHandleByUUID(first)
    return pynvml.nvmlDeviceGetHandleByIndex(int(first) if first.isdigit() else 0)


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


if __name__ == "__main__":
    sys.exit(main())
