"""Check that this environment (an image, a GPU box) can train: every fast-path package imports, and a short
SFT job (recorded by W&B offline and an MLflow file store), a packed one on ShareGPT rows, one on Alpaca rows that goes
on training the packed job's adapter (`lora.init_from`), a DPO job on the chats' answers preferred to a refusal, a
short GRPO job, and a tool-using GRPO job (from an SFT job that teaches the tiny model the call: `tool_use`) run through
the real handler on a tiny model built offline, between them with every schedule, optimizer and adapter setting that
needs more of the image than the defaults (bitsandbytes' 8-bit AdamW, DoRA, rsLoRA, LoRA+, `modules_to_save`, PiSSA).

    python -m loraflow_worker.self_test                 # inside the image: `docker run --rm IMAGE python -m ...`
    python -m loraflow_worker.self_test --steps 8

    LORAFLOW_REQUIRE_CUDA=1 python -m loraflow_worker.self_test    # on a GPU box: CUDA or nothing, as on RunPod

Needs no network and no GPU (without CUDA the jobs take the CPU branch, under this environment's own library
versions) unless `LORAFLOW_REQUIRE_CUDA=1` says CUDA is required: then, when CUDA cannot start, it runs no job
and says why (runtime/cuda_check.py). Prints one line per fast-path package (version, or why it does not import), one
on CUDA, and one per job (steps, first and final loss or reward, device, what engaged), and for each GRPO job how it
generated (vLLM colocated or not, and why; vLLM's weight syncs and generate calls per step); exits non-zero when
anything failed, a GRPO job whose colocated vLLM failed (the job itself goes on without it) or synced the weights
other than once per step included. On a GPU with vLLM the two GRPO jobs (the tool-using one's rounds take two vLLM
calls each) are where the image's vLLM is proven.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.metadata
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

from loraflow_worker.runtime.cuda_check import REQUIRE_CUDA_ENV, CudaUnavailable, check_cuda, describe_available

FAST_PATH_PACKAGES = {"vllm": "vllm", "liger_kernel": "liger-kernel", "fla": "flash-linear-attention",
                      "bitsandbytes": "bitsandbytes"}
"""Module -> distribution of every package a fast path needs."""


def import_fast_path_packages() -> dict[str, str | None]:
    """module -> None when it imports, else the error; prints each with its distribution's version."""
    problems: dict[str, str | None] = {}
    for module, distribution in FAST_PATH_PACKAGES.items():
        try:
            version = importlib.metadata.version(distribution)
        except importlib.metadata.PackageNotFoundError:
            version = "not installed"
        try:
            importlib.import_module(module)
            problems[module] = None
            print(f"import {module}: ok ({distribution} {version})", flush=True)
        except Exception as exc:  # noqa: BLE001 - report every package, then fail once
            problems[module] = f"{type(exc).__name__}: {exc}"
            print(f"import {module}: FAILED ({distribution} {version}): {problems[module]}", flush=True)
    return problems


def run_jobs(root: Path, steps: int) -> dict[str, dict]:
    """Four SFT jobs, a DPO job and two GRPO jobs through `handler` on a tiny model; job name -> the job's result."""
    from loraflow_worker.contract import CONTRACT_VERSION
    from loraflow_worker.handler import WORK_DIR_ENV, handler
    from loraflow_worker.self_test import tool_use
    from loraflow_worker.self_test.tiny_model import DEFAULT_CORPUS, build_tiny_model, corpus_from_jsonl

    model = build_tiny_model(root / "tiny-model", corpus_from_jsonl([DEFAULT_CORPUS]))
    store = root / "store"
    os.environ[WORK_DIR_ENV] = str(root / "work")
    # Between them, the jobs train with every schedule, optimizer and adapter setting that needs more of the image
    # than the default (bitsandbytes' optimizers, DoRA, LoRA+, PiSSA's conversion), with packing, with the shipped
    # chats as ShareGPT and Alpaca files, and from an earlier job's adapter.
    jobs = {
        # Both trackers, with no credentials and no network: W&B offline and an MLflow file store.
        "sft": {"training": {"max_steps": steps, "learning_rate": 1e-2, "batch_size": 8,
                             "report_to": ["wandb", "mlflow"], "lr_scheduler": "cosine", "warmup_ratio": 0.25,
                             "weight_decay": 0.01, "max_grad_norm": 0.5, "optimizer": "adamw_8bit"},
                "lora": {"use_dora": True, "use_rslora": True, "loraplus_lr_ratio": 4, "modules_to_save": ["lm_head"]}},
        "sft-packed": {"training": {"max_steps": steps, "learning_rate": 1e-2, "batch_size": 8, "packing": True},
                       "dataset": {"format": "sharegpt"}},
        "sft-continued": {"training": {"max_steps": steps, "learning_rate": 1e-2, "batch_size": 8},
                          "dataset": {"format": "alpaca"}, "lora": {"init_from": "runs/self-test-sft-packed"}},
        "dpo": {"algorithm": "dpo", "training": {"max_steps": steps, "learning_rate": 2e-2, "batch_size": 8},
                "dpo": {"beta": 0.1}},
        "grpo": {"algorithm": "grpo",
                 "training": {"max_steps": steps, "learning_rate": 3e-2, "batch_size": 8, "seed": 42,
                              "lr_scheduler": "constant_with_warmup", "warmup_ratio": 0.25},
                 "grpo": {"num_generations": 4, "max_completion_length": 12, "rewards": [{"name": "digit_fraction"}]},
                 "lora": {"init": "pissa"}},
        # The tiny model learns to call the tool (it needs that many steps, whatever --steps says), then calls it.
        "sft-tools": {"training": {"max_steps": max(steps, TEACHING_STEPS), "learning_rate": 1e-2, "batch_size": 4},
                      "lora": {"rank": 8, "alpha": 16}},
        "grpo-tools": {"algorithm": "grpo", "lora": {"init_from": "runs/self-test-sft-tools"},
                       "training": {"max_steps": steps, "learning_rate": 1e-3, "batch_size": 8},
                       "grpo": {"num_generations": 4, "max_completion_length": 192, "temperature": 0.3,
                                "max_tool_calls": 1, "tools": "tools.py",
                                "tools_store_path": _stored(store, "runs/self-test-grpo-tools/tools/tools.py",
                                                            tool_use.TOOLS_SOURCE),
                                "rewards": [{"name": "reward.py:receipt", "store_path": _stored(
                                    store, "runs/self-test-grpo-tools/rewards/reward.py", tool_use.REWARD_SOURCE)}]}},
    }
    own_rows = {"sft-tools": tool_use.teaching_rows(), "grpo-tools": tool_use.prompt_rows()}
    ledger = root / "ledger.txt"
    os.environ[tool_use.LEDGER_ENV] = str(ledger)
    rows = [json.loads(line) for line in DEFAULT_CORPUS.read_text(encoding="utf-8").splitlines() if line.strip()]
    results = {}
    for name, settings in jobs.items():
        run_id = f"self-test-{name}"
        dataset = f"runs/{run_id}/dataset/train.jsonl"
        data_format = settings.get("dataset", {}).get("format", "auto")
        shape = "preference" if settings.get("algorithm") == "dpo" else data_format
        _stored(store, dataset, "".join(json.dumps(_as(shape, row)) + "\n" for row in own_rows.get(name, rows)))
        job_input = {"contract_version": CONTRACT_VERSION, "run_id": run_id, "model": {"id": str(model)},
                     "artifact_store": store.as_uri(), **settings,
                     "dataset": {**settings.get("dataset", {}), "store_path": dataset}}
        started = time.monotonic()
        results[name] = handler({"id": f"job-{run_id}", "input": job_input})
        manifest = json.loads((store / "runs" / run_id / "manifest.json").read_text())
        metrics = results[name]["metrics"]
        engaged = sorted(path for path, state in manifest.get("fast_paths", {}).items() if state.get("engaged"))
        print(f"{name} job completed in {time.monotonic() - started:.0f} s: {metrics['steps']} steps, "
              f"{_trend(metrics)}, device {metrics.get('device')}, engaged: {', '.join(engaged) or 'none'}", flush=True)
        if settings.get("algorithm") == "grpo":
            _check_vllm(name, manifest)
        if settings["training"].get("packing") and "packing" not in engaged:
            raise RuntimeError(f"the {name} job asked for packing and its manifest says packing did not engage")
        accuracies = metrics.get("reward_accuracies") or []
        if settings.get("algorithm") == "dpo" and not (accuracies and accuracies[-1][1] > accuracies[0][1]):
            raise RuntimeError(f"the {name} job's reward accuracy did not rise: {accuracies}")
        if settings.get("grpo", {}).get("tools"):
            called = ledger.read_text().split() if ledger.is_file() else []
            print(f"{name} job called its tool {len(called)} times ({', '.join(sorted(set(called)))})", flush=True)
            if not called or max(reward for _, reward in metrics["rewards"]) <= 0.5:
                raise RuntimeError(f"the {name} job's tool never ran or its answer never reached the reward: ledger "
                                   f"{called}, rewards {metrics['rewards']}")
        parent = settings.get("lora", {}).get("init_from")
        if parent is not None and settings.get("algorithm", "sft") == "sft":  # trained on the same answers, an adapter that went on training starts lower
            parent_first = results[parent.removeprefix("runs/self-test-")]["metrics"]["first_loss"]
            print(f"{name} job started from {parent}'s adapter at loss {metrics['first_loss']:.3f} (that job started "
                  f"at {parent_first:.3f})", flush=True)
            if not metrics["first_loss"] < parent_first:
                raise RuntimeError(f"the {name} job started from {parent} at no lower a loss than that job did: the "
                                   "adapter was not loaded")
        asked = settings["training"].get("report_to", [])
        recorded = {t["tracker"]: t for t in results[name]["trackers"] if t.get("store_path")}
        if sorted(recorded) != sorted(asked):
            raise RuntimeError(f"the {name} job asked trackers {asked} and recorded to {sorted(recorded)}")
        for tracker in recorded.values():
            print(f"{name} job tracked by {tracker['tracker']}: run {tracker['run_id']}, stored at "
                  f"{tracker['store_path']}", flush=True)
    return results


TEACHING_STEPS = 150
"""SFT steps that teach the tiny model to call the tool (`tool_use`)."""


def _check_vllm(name: str, manifest: dict) -> None:
    """Print how a GRPO job generated; fail where its colocated vLLM failed (the job went on without it: here is
    where that must show) or synced the weights other than once per step (`training.vllm_colocate`)."""
    vllm = manifest["fast_paths"]["vllm_colocate"]
    syncs = manifest.get("vllm_weight_syncs")
    line = f"{name} job: vllm_colocate {'on' if vllm['engaged'] else 'off'} ({vllm['reason']})"
    if syncs:
        line += (f"; weight syncs per step {syncs['per_step']}, vLLM generate calls per step "
                 f"{syncs['generate_calls_per_step']}")
    print(line, flush=True)
    if vllm["reason"].startswith("failed: "):
        raise RuntimeError(f"the {name} job's colocated vLLM engine failed (the job went on with transformers' "
                           f"generate): {vllm['reason']}")
    if syncs and any(count != 1 for count in syncs["per_step"].values()):
        raise RuntimeError(f"the {name} job synced its weights into vLLM other than once per step: "
                           f"{syncs['per_step']}")


def _stored(store: Path, path: str, text: str) -> str:
    """Write `text` at `path` in the file store, as the control plane publishes a run's files; `path`."""
    (store / path).parent.mkdir(parents=True, exist_ok=True)
    (store / path).write_text(text, encoding="utf-8")
    return path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m loraflow_worker.self_test", description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=4, help="optimizer steps per job (default 4)")
    args = parser.parse_args(argv)
    problems = import_fast_path_packages()
    try:
        probe = check_cuda(os.environ)
    except (CudaUnavailable, ValueError) as exc:  # CUDA required and absent, or a setting that is neither 0 nor 1
        print(f"self test: FAILED before any job: {exc}", flush=True)
        return 1
    print(f"cuda: {describe_available(probe)}" if probe is not None else
          f"cuda: not required ({REQUIRE_CUDA_ENV} is not 1): without CUDA the jobs train on the CPU", flush=True)
    root = Path(tempfile.mkdtemp(prefix="loraflow-self-test-"))
    try:
        run_jobs(root, args.steps)
    except Exception as exc:  # noqa: BLE001 - the answer is the report
        print(f"self test: a job FAILED: {type(exc).__name__}: {exc}", flush=True)
        return 1
    finally:
        shutil.rmtree(root, ignore_errors=True)
    failed = sorted(module for module, problem in problems.items() if problem)
    if failed:
        print(f"self test: jobs completed, but {', '.join(failed)} do not import", flush=True)
        return 1
    print("self test: ok", flush=True)
    return 0


def _as(data_format: str, row: dict) -> dict:
    """A row of the shipped chats (one user turn, one answer) as the dataset format names it."""
    if data_format == "sharegpt":
        speaker = {"system": "system", "user": "human", "assistant": "gpt"}
        return {"conversations": [{"from": speaker[m["role"]], "value": m["content"]} for m in row["messages"]]}
    if data_format == "preference":  # the chat's own answer preferred to a refusal
        prompt, answer = row["messages"]
        return {"prompt": [prompt], "chosen": [answer],
                "rejected": [{"role": "assistant", "content": "I do not know, and I will not guess."}]}
    if data_format == "alpaca":
        turns = {m["role"]: m["content"] for m in row["messages"]}
        return {"instruction": turns["user"], "input": "", "output": turns["assistant"]}
    return row


def _trend(metrics: dict) -> str:
    accuracies = metrics.get("reward_accuracies") or []
    if accuracies:
        return (f"loss {metrics['first_loss']:.3f} -> {metrics['final_loss']:.3f}, reward accuracy "
                f"{accuracies[0][1]:.2f} -> {accuracies[-1][1]:.2f}")
    rewards = metrics.get("rewards") or []
    if rewards:
        return f"mean reward {rewards[0][1]:.3f} -> {rewards[-1][1]:.3f}"
    if metrics.get("first_loss") is not None:
        return f"loss {metrics['first_loss']:.3f} -> {metrics['final_loss']:.3f}"
    return "no loss recorded"


if __name__ == "__main__":
    sys.exit(main())
