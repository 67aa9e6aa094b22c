"""GPU smoke run: a random-init Qwen3.5 model with a real model's vocabulary (151,936 tokens) and width (hidden
2048) trained for SFT and GRPO steps through the real worker code, once with the fast paths the plan engages
and once without each, printing what engaged and the tokens/s of each variant. Usually started by
`worker_image/gpu_smoke.sh`:

    python -m loraflow_worker.gpu_smoke                                  # on a GPU: every variant, 3 + 20 steps each
    python -m loraflow_worker.gpu_smoke --variants all,no-liger,no-vllm --deadline 900
    python -m loraflow_worker.gpu_smoke --cpu --steps 2 --warmup 1       # the same machinery on CPU (nothing engages)

Each variant runs in its own process, because transformers binds flash-linear-attention when the modeling
module is imported: a variant switches fast paths off with `LORAFLOW_DISABLE_FAST_PATHS`, or a memory saver on
with `LORAFLOW_FORCE_FAST_PATHS`, and differs from `all` in that alone. Throughput counts only the steps after
the warm-up (Triton's kernel compilation, vLLM's start), with CUDA synchronised at the end of every step so that
the clock sees the GPU's work rather than its queue. For GRPO the run counts the completions vLLM returned to
TRL, so a colocated vLLM that generated nothing is a failure, not a fast path.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from loraflow_worker.fast_paths import DISABLE_ENV, FORCE_ENV

RESULT_MARKER = "GPU_SMOKE_RESULT "


@dataclass(frozen=True)
class Variant:
    """One configuration of the worker: `all` less the `disabled` fast paths, plus the `forced` memory savers."""

    name: str
    algorithms: tuple[str, ...]
    disabled: frozenset[str] = frozenset()
    forced: frozenset[str] = frozenset()


KERNELS = frozenset({"liger_kernel", "flash_linear_attention", "causal_conv1d", "fused_adamw", "expandable_segments"})
"""The speed-ups `no-kernels` removes together. Precision (bf16) and the memory trade-offs (gradient checkpointing,
8-bit AdamW, which the memory estimate decides) are measured by variants of their own."""
VARIANTS = (
    Variant("all", ("sft", "grpo")),
    Variant("no-liger", ("sft",), disabled=frozenset({"liger_kernel"})),
    Variant("no-fla", ("sft",), disabled=frozenset({"flash_linear_attention", "causal_conv1d"})),
    Variant("no-fused-adamw", ("sft",), disabled=frozenset({"fused_adamw"})),
    Variant("no-expandable-segments", ("sft",), disabled=frozenset({"expandable_segments"})),
    Variant("no-kernels", ("sft",), disabled=KERNELS),
    Variant("checkpointing", ("sft",), forced=frozenset({"gradient_checkpointing"})),
    Variant("no-checkpointing", ("sft",), disabled=frozenset({"gradient_checkpointing"})),
    Variant("paged-adamw-8bit", ("sft",), forced=frozenset({"paged_adamw_8bit"})),
    Variant("no-vllm", ("grpo",), disabled=frozenset({"vllm_colocate"})),
)
CPU_VARIANTS = ("all", "no-kernels")
"""What `--cpu` runs unless `--variants` says otherwise (on CPU every fast path is off anyway)."""


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
"""Qwen3's vocabulary and a 2B-class width (Qwen3.5-2B: hidden 2048), fewer layers to keep each variant short."""
CPU_SIZE = Size(vocab=1024, hidden=64, layers=4, heads=4, seq_len=64, batch=4, generations=2, completion_len=8)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Train a Qwen3.5-shaped model with and without each fast path.")
    parser.add_argument("--cpu", action="store_true", help="Run on CPU (checks the machinery; nothing engages).")
    parser.add_argument("--variants", type=_variant_names, default=None,
                        help=f"Comma-separated variants to run, in this order (default: all of them on a GPU, "
                             f"{','.join(CPU_VARIANTS)} on CPU). Known: {', '.join(v.name for v in VARIANTS)}.")
    parser.add_argument("--steps", type=int, default=None, help="Timed optimizer steps per run (default 20; 2 on CPU).")
    parser.add_argument("--warmup", type=int, default=None, help="Untimed steps before them, at least 1 (default 3; 1 on CPU).")
    parser.add_argument("--deadline", type=float, default=None,
                        help="Seconds for the whole smoke run: variants that cannot start before it are reported as not run.")
    parser.add_argument("--out", type=Path, default=None, help="Working folder (default: a new temporary folder).")
    parser.add_argument("--variant-timeout", type=float, default=600.0, help="Seconds one variant may take.")
    parser.add_argument("--child", nargs=2, metavar=("VARIANT", "ALGORITHM"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    started = time.monotonic()
    out = args.out or Path(tempfile.mkdtemp(prefix="loraflow-gpu-smoke-"))
    size = CPU_SIZE if args.cpu else GPU_SIZE
    steps = args.steps if args.steps is not None else (2 if args.cpu else 20)
    warmup = args.warmup if args.warmup is not None else (1 if args.cpu else 3)
    if steps < 1 or warmup < 1:
        parser.error("--steps and --warmup must be at least 1 (the first step compiles kernels: it is never timed)")
    if args.child:
        return _child(out, size, args.child[0], args.child[1], warmup, steps)

    if args.cpu:
        os.environ["CUDA_VISIBLE_DEVICES"] = ""  # the children inherit it: torch then sees no GPU
    else:
        import torch

        if not torch.cuda.is_available():
            parser.error("no CUDA device here: run with --cpu for the CPU check")
    variants = args.variants or (list(CPU_VARIANTS) if args.cpu else [v.name for v in VARIANTS])
    model_dir = build_smoke_model(out / "model", size)
    write_datasets(out, size, warmup + steps)
    print(f"model: {model_dir} (Qwen3.5, vocabulary {size.vocab}, hidden {size.hidden}, {size.layers} layers); "
          f"SFT sequences of {size.seq_len} tokens; {warmup} warm-up + {steps} timed steps per run", flush=True)
    runs = [(variant, algorithm) for variant in _by_name(variants) for algorithm in variant.algorithms]
    deadline_at = started + args.deadline if args.deadline is not None else None

    def run_one(variant: Variant, algorithm: str, timeout: float) -> dict:
        return _run_child(out, variant, algorithm, args.cpu, warmup, steps, timeout)

    results = run_variants(runs, run_one, args.variant_timeout, deadline_at)
    print(report(results))
    print(f"smoke run took {time.monotonic() - started:.0f} s")
    return 0 if all(r.get("error") is None for r in results) else 1


def run_variants(runs: Sequence[tuple[Variant, str]], run_one: Callable[[Variant, str, float], dict],
                 variant_timeout: float, deadline_at: float | None, clock: Callable[[], float] = time.monotonic) -> list[dict]:
    """Run each (variant, algorithm) with `run_one(variant, algorithm, timeout)` in order; once `deadline_at` (on
    `clock`) has passed, the rest are reported as not run. A run may take `variant_timeout` seconds, and no
    longer than the deadline leaves."""
    results = []
    for variant, algorithm in runs:
        left = variant_timeout if deadline_at is None else min(variant_timeout, deadline_at - clock())
        if left <= 0:
            results.append({"variant": variant.name, "algorithm": algorithm, "not_run": "deadline reached", "error": None})
            continue
        print(f"-- {variant.name} / {algorithm}", flush=True)
        results.append(run_one(variant, algorithm, left))
    return results


def build_smoke_model(out_dir: Path, size: Size) -> Path:
    """A random-init Qwen3.5 text model (Gated-DeltaNet layers, one full-attention layer in four) of `size`, with
    a tokenizer trained on the shipped chat corpus and padded to the vocabulary, saved into `out_dir` in bf16."""
    import torch
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

    from loraflow_worker.tiny_model import DEFAULT_CORPUS, IM_END, corpus_from_jsonl, train_tokenizer

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
    from loraflow_worker.tiny_model import BUILTIN_TEXT, DEFAULT_CORPUS

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
    (the speed-up of what the variant removes, or the cost of what it forces on), peak memory, the completions
    vLLM generated, and what engaged; then the reasons behind `all`'s plan, per algorithm."""
    best = {r["algorithm"]: r["tokens_per_second"] for r in results if r["variant"] == "all" and r.get("tokens_per_second")}
    lines = [f"{'variant':<24}{'algorithm':<10}{'steps':>6}{'tokens/s':>12}{'all/this':>9}{'peak GiB':>9}{'vLLM':>7}  engaged"]
    for r in results:
        head = f"{r['variant']:<24}{r['algorithm']:<10}"
        if r.get("not_run"):
            lines.append(f"{head}{'not run':>27}  {r['not_run']}")
            continue
        if r.get("error"):
            lines.append(f"{head}{'failed':>27}  {r['error']}")
            continue
        ratio = f"{best[r['algorithm']] / r['tokens_per_second']:.2f}" if best.get(r["algorithm"]) and r["tokens_per_second"] else "-"
        peak = f"{r['peak_memory_gib']:.1f}" if r.get("peak_memory_gib") is not None else "-"
        vllm = str(r["vllm_completions"]) if r["algorithm"] == "grpo" else "-"
        engaged = ", ".join(name for name, (on, _) in r["fast_paths"].items() if on) or "none"
        lines.append(f"{head}{r['timed_steps']:>6}{r['tokens_per_second']:>12.0f}{ratio:>9}{peak:>9}{vllm:>7}  {engaged}")
    for r in results:
        if r["variant"] == "all" and not r.get("error") and not r.get("not_run"):
            lines.append(f"why (variant `all`, {r['algorithm']}):")
            lines.extend(f"  {name}: {'on' if on else 'off'} - {reason}" for name, (on, reason) in r["fast_paths"].items())
    skipped = sum(1 for r in results if r.get("not_run"))
    if skipped:
        lines.append(f"{skipped} run(s) not run: the deadline was reached first")
    return "\n".join(lines)


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


def _run_child(out: Path, variant: Variant, algorithm: str, cpu: bool, warmup: int, steps: int, timeout: float) -> dict:
    command = [sys.executable, "-m", "loraflow_worker.gpu_smoke", "--out", str(out), "--warmup", str(warmup),
               "--steps", str(steps), "--child", variant.name, algorithm] + (["--cpu"] if cpu else [])
    env = {**os.environ, DISABLE_ENV: ",".join(sorted(variant.disabled)), FORCE_ENV: ",".join(sorted(variant.forced)),
           "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    try:
        done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"variant": variant.name, "algorithm": algorithm, "error": f"timed out after {timeout:.0f} s"}
    for line in done.stdout.splitlines():
        if line.startswith(RESULT_MARKER):
            return _checked(json.loads(line[len(RESULT_MARKER):]))
    tail = " | ".join((done.stderr or done.stdout).strip().splitlines()[-3:])
    return {"variant": variant.name, "algorithm": algorithm, "error": f"exit {done.returncode}: {tail[-400:]}"}


def _checked(result: dict) -> dict:
    """A child's result, failed when a fast path it reports engaged did not do its work."""
    vllm_engaged = result["fast_paths"]["vllm_colocate"][0]
    if result["algorithm"] == "grpo" and vllm_engaged and not result["vllm_completions"]:
        return {**result, "error": "vllm_colocate is engaged, but vLLM returned no completion to TRL"}
    return result


def _child(out: Path, size: Size, variant: str, algorithm: str, warmup: int, steps: int) -> int:
    import torch
    from transformers import TrainerCallback

    from loraflow_worker.artifacts import open_store
    from loraflow_worker.contract import JobInput

    cuda = torch.cuda.is_available()

    class Throughput(TrainerCallback):
        """(time, tokens seen) at the end of every optimizer step, once the GPU has finished the step's work."""

        def __init__(self) -> None:
            self.marks: list[tuple[float, int]] = []

        def on_step_end(self, args, state, control, **kwargs):
            if cuda:
                torch.cuda.synchronize()  # the kernels are queued asynchronously: wait for them before reading the clock
            self.marks.append((time.perf_counter(), int(state.num_input_tokens_seen)))

    run_id = f"{variant}-{algorithm}"
    job_input = {
        "run_id": run_id,
        "algorithm": algorithm,
        "model": {"id": str(out / "model")},
        "dataset": {"store_path": f"data/{algorithm}.jsonl"},
        "training": {"max_steps": warmup + steps, "batch_size": size.batch, "learning_rate": 1e-4, "logging_steps": 1},
        "artifact_store": (out / "store").as_uri(),
    }
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
        from loraflow_worker.sft import train_sft as train
    else:
        from loraflow_worker.grpo import train_grpo as train
    vllm = _count_vllm_completions()
    throughput = Throughput()
    outcome = train(job, open_store(job.artifact_store), work_dir, lambda progress: None, callbacks=[throughput])
    (t0, n0), (t1, n1) = throughput.marks[warmup - 1], throughput.marks[-1]
    result = {
        "variant": variant,
        "algorithm": algorithm,
        "timed_steps": len(throughput.marks) - warmup,
        "tokens_per_second": (n1 - n0) / (t1 - t0) if t1 > t0 else 0.0,
        "device": outcome.metrics.device,
        "peak_memory_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2) if cuda else None,
        "vllm_completions": vllm["completions"],
        "fast_paths": {name: [p.engaged, p.reason] for name, p in outcome.manifest.fast_paths.items()},
        "error": None,
    }
    print(RESULT_MARKER + json.dumps(result), flush=True)
    return 0


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
