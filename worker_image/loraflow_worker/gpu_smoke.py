"""GPU smoke run: a small random-init Qwen3.5 model trained for a few SFT and GRPO steps through the real
worker code, once with every fast path that is installed and once with each switched off, printing what
engaged and the tokens/s of each variant. Usually started by `worker_image/gpu_smoke.sh`:

    python -m loraflow_worker.gpu_smoke                  # on a GPU: about 8 SFT and 3 GRPO steps per variant
    python -m loraflow_worker.gpu_smoke --cpu --steps 2  # the same machinery on CPU (tests; nothing engages)

Each variant runs in its own process, because transformers binds flash-linear-attention when the modeling
module is imported: a variant switches fast paths off with `LORAFLOW_DISABLE_FAST_PATHS`. Throughput is
measured after the first step, which includes Triton's kernel compilation.
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
from dataclasses import dataclass
from pathlib import Path

from loraflow_worker.fast_paths import DISABLE_ENV, FAST_PATHS

RESULT_MARKER = "GPU_SMOKE_RESULT "
ALL_OFF = frozenset(FAST_PATHS) - {"bf16"}
"""The baseline variant: every speed-up off (bf16 stays: it is the precision, not a kernel)."""


@dataclass(frozen=True)
class Variant:
    name: str
    disabled: frozenset[str]
    algorithms: tuple[str, ...]


GPU_VARIANTS = (
    Variant("all", frozenset(), ("sft", "grpo")),
    Variant("no-fla", frozenset({"flash_linear_attention", "causal_conv1d"}), ("sft",)),
    Variant("no-liger", frozenset({"liger_kernel"}), ("sft",)),
    Variant("no-checkpointing", frozenset({"gradient_checkpointing"}), ("sft",)),
    Variant("no-8bit-adam", frozenset({"paged_adamw_8bit"}), ("sft",)),
    Variant("no-vllm", frozenset({"vllm_colocate"}), ("grpo",)),
    Variant("none", ALL_OFF, ("sft",)),
)
CPU_VARIANTS = (Variant("all", frozenset(), ("sft", "grpo")), Variant("none", ALL_OFF, ("sft",)))


@dataclass(frozen=True)
class Size:
    """Model and batch shape of a smoke run."""

    hidden: int
    layers: int
    heads: int
    seq_len: int
    batch: int
    generations: int
    completion_len: int


GPU_SIZE = Size(hidden=1024, layers=8, heads=8, seq_len=2048, batch=8, generations=8, completion_len=256)
CPU_SIZE = Size(hidden=64, layers=4, heads=4, seq_len=64, batch=4, generations=2, completion_len=8)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Train a small Qwen3.5 model with and without each fast path.")
    parser.add_argument("--cpu", action="store_true", help="Run on CPU (checks the machinery; nothing engages).")
    parser.add_argument("--steps", type=int, default=None, help="Optimizer steps per SFT run (GRPO: half, at least 2).")
    parser.add_argument("--out", type=Path, default=None, help="Working folder (default: a new temporary folder).")
    parser.add_argument("--variant-timeout", type=float, default=300.0, help="Seconds one variant may take.")
    parser.add_argument("--child", nargs=2, metavar=("VARIANT", "ALGORITHM"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    out = args.out or Path(tempfile.mkdtemp(prefix="loraflow-gpu-smoke-"))
    size = CPU_SIZE if args.cpu else GPU_SIZE
    sft_steps = args.steps or (2 if args.cpu else 8)
    if args.child:
        return _child(out, size, args.child[0], args.child[1], sft_steps)

    if args.cpu:
        os.environ["CUDA_VISIBLE_DEVICES"] = ""  # the children inherit it: torch then sees no GPU
    else:
        import torch

        if not torch.cuda.is_available():
            parser.error("no CUDA device here: run with --cpu for the CPU check")
    started = time.monotonic()
    model_dir = build_smoke_model(out / "model", size)
    write_datasets(out, model_dir, size, sft_steps)
    print(f"model: {model_dir} (Qwen3.5, hidden {size.hidden}, {size.layers} layers); sequences of {size.seq_len} tokens")
    results = []
    for variant in CPU_VARIANTS if args.cpu else GPU_VARIANTS:
        for algorithm in variant.algorithms:
            results.append(_run_child(out, variant, algorithm, args, sft_steps))
    print(report(results))
    print(f"smoke run took {time.monotonic() - started:.0f} s")
    return 0 if all(r.get("error") is None for r in results) else 1


def build_smoke_model(out_dir: Path, size: Size) -> Path:
    """A random-init Qwen3.5 text model (Gated-DeltaNet layers, one full-attention layer in four) with the
    tiny model's locally trained tokenizer, saved into `out_dir`."""
    import torch
    from transformers import AutoTokenizer, Qwen3_5ForCausalLM, Qwen3_5TextConfig

    from loraflow_worker.tiny_model import IM_END, build_tiny_model, corpus_from_jsonl, DEFAULT_CORPUS

    tokenizer_dir = build_tiny_model(out_dir.parent / "tokenizer", corpus_from_jsonl([DEFAULT_CORPUS]))
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
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
        # As in tiny_model: a larger init gives a random model enough signal for LoRA to move the loss.
        initializer_range=0.1,
        tie_word_embeddings=True,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(0)
    model = Qwen3_5ForCausalLM(config)
    model.generation_config.eos_token_id = [tokenizer.convert_tokens_to_ids(IM_END), tokenizer.eos_token_id]
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    return out_dir


def write_datasets(out: Path, model_dir: Path, size: Size, sft_steps: int) -> None:
    """The artifact store the children train from: long chats for SFT, short questions for GRPO."""
    from loraflow_worker.tiny_model import BUILTIN_TEXT, DEFAULT_CORPUS

    words = BUILTIN_TEXT.split()
    rng = random.Random(0)
    chats = [json.loads(line)["messages"] for line in DEFAULT_CORPUS.read_text().splitlines() if line.strip()]
    data = out / "store" / "data"
    data.mkdir(parents=True, exist_ok=True)
    with (data / "sft.jsonl").open("w") as f:
        for i in range(size.batch * sft_steps):
            # Each word is at least one token, so this fills max_seq_length (the rest is truncated).
            answer = " ".join(rng.choice(words) for _ in range(size.seq_len))
            f.write(json.dumps({"messages": [chats[i % len(chats)][0], {"role": "assistant", "content": answer}]}) + "\n")
    with (data / "grpo.jsonl").open("w") as f:
        for chat in chats:
            f.write(json.dumps({"messages": chat}) + "\n")


def report(results: list[dict]) -> str:
    """A table of the variants: engaged fast paths and tokens/s, relative to `all` of the same algorithm."""
    best = {r["algorithm"]: r["tokens_per_second"] for r in results if r["variant"] == "all" and r.get("tokens_per_second")}
    lines = [f"{'variant':<18}{'algorithm':<10}{'tokens/s':>12}{'vs all':>8}  engaged fast paths"]
    for r in results:
        if r.get("error"):
            lines.append(f"{r['variant']:<18}{r['algorithm']:<10}{'failed':>12}{'':>8}  {r['error']}")
            continue
        ratio = r["tokens_per_second"] / best[r["algorithm"]] if best.get(r["algorithm"]) else float("nan")
        engaged = ", ".join(name for name, (on, _) in r["fast_paths"].items() if on) or "none"
        lines.append(f"{r['variant']:<18}{r['algorithm']:<10}{r['tokens_per_second']:>12.0f}{ratio:>8.2f}  {engaged}")
    first = next((r for r in results if not r.get("error")), None)
    if first:
        lines.append("why (variant `all`, " + first["algorithm"] + "):")
        lines.extend(f"  {name}: {'on' if on else 'off'} - {reason}" for name, (on, reason) in first["fast_paths"].items())
    return "\n".join(lines)


def _run_child(out: Path, variant: Variant, algorithm: str, args: argparse.Namespace, sft_steps: int) -> dict:
    command = [sys.executable, "-m", "loraflow_worker.gpu_smoke", "--out", str(out), "--steps", str(sft_steps),
               "--child", variant.name, algorithm] + (["--cpu"] if args.cpu else [])
    env = {**os.environ, DISABLE_ENV: ",".join(sorted(variant.disabled)), "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    print(f"-- {variant.name} / {algorithm}", flush=True)
    try:
        done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=args.variant_timeout)
    except subprocess.TimeoutExpired:
        return {"variant": variant.name, "algorithm": algorithm, "error": f"timed out after {args.variant_timeout:.0f} s"}
    for line in done.stdout.splitlines():
        if line.startswith(RESULT_MARKER):
            return json.loads(line[len(RESULT_MARKER):])
    tail = " | ".join((done.stderr or done.stdout).strip().splitlines()[-3:])
    return {"variant": variant.name, "algorithm": algorithm, "error": f"exit {done.returncode}: {tail[-400:]}"}


def _child(out: Path, size: Size, variant: str, algorithm: str, sft_steps: int) -> int:
    from transformers import TrainerCallback

    from loraflow_worker.artifacts import open_store
    from loraflow_worker.contract import JobInput

    class Throughput(TrainerCallback):
        """Tokens/s after the first optimizer step (which includes Triton's kernel compilation)."""

        def __init__(self) -> None:
            self.marks: list[tuple[float, int]] = []

        def on_step_end(self, args, state, control, **kwargs):
            self.marks.append((time.monotonic(), int(state.num_input_tokens_seen)))

        def tokens_per_second(self) -> float:
            (t0, n0), (t1, n1) = (self.marks[0], self.marks[-1]) if len(self.marks) > 1 else ((0.0, 0), self.marks[-1])
            return (n1 - n0) / (t1 - t0) if t1 > t0 else 0.0

    run_id = f"{variant}-{algorithm}"
    steps = sft_steps if algorithm == "sft" else max(2, sft_steps // 2)
    job_input = {
        "run_id": run_id,
        "algorithm": algorithm,
        "model": {"id": str(out / "model")},
        "dataset": {"store_path": f"data/{algorithm}.jsonl"},
        "training": {"max_steps": steps, "batch_size": size.batch, "learning_rate": 1e-4, "logging_steps": 1},
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
    throughput = Throughput()
    outcome = train(job, open_store(job.artifact_store), work_dir, lambda progress: None, callbacks=[throughput])
    result = {
        "variant": variant,
        "algorithm": algorithm,
        "steps": outcome.metrics.steps,
        "tokens": outcome.metrics.tokens,
        "tokens_per_second": throughput.tokens_per_second(),
        "device": outcome.metrics.device,
        "peak_memory_gb": _peak_memory_gb(),
        "fast_paths": {name: [p.engaged, p.reason] for name, p in outcome.manifest.fast_paths.items()},
        "error": None,
    }
    print(RESULT_MARKER + json.dumps(result), flush=True)
    return 0


def _peak_memory_gb() -> float | None:
    import torch

    return round(torch.cuda.max_memory_allocated() / 2**30, 2) if torch.cuda.is_available() else None


if __name__ == "__main__":
    sys.exit(main())
