"""Constants and helpers the worker tests share (a module of its own: `conftest` is a name both test
folders use, so tests cannot import from it reliably)."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path

import pytest
from fault_injection.sitecustomize import CRASH_AT_STEP_ENV, CRASH_KIND_ENV, fake_cgroup_root

from loraflow_worker.training import train_job
from loraflow_worker.memory import out_of_memory
from loraflow_worker.artifacts import FileStore
from loraflow_worker.contract import JobInput, JobResult, Progress

from tests.hub_fixture import HubStandIn, running_hub

CONTROL_PLANE_PYTHON = Path(__file__).resolve().parents[2] / ".venv" / "bin" / "python"
"""The control plane's interpreter: the Hub stand-in needs FastAPI, which the worker's environment lacks."""


@contextlib.contextmanager
def hub_stand_in(data_dir: Path) -> Iterator[HubStandIn]:
    """The control-plane tests' local Hub stand-in (tests/hub_fixture.py), serving from `data_dir`."""
    if not CONTROL_PLANE_PYTHON.exists():  # `make install` builds both environments: a missing one is a broken setup
        pytest.fail(f"the Hub stand-in runs with the control plane's interpreter, and {CONTROL_PLANE_PYTHON} is "
                    "missing: run `make install`")
    with running_hub(data_dir, python=CONTROL_PLANE_PYTHON) as stand_in:
        yield stand_in

FAULT_INJECTION_DIR = Path(__file__).resolve().parent / "fault_injection"
"""The test-only fault module's folder (its `sitecustomize` plants the failures): on a training
process's PYTHONPATH, it fails that process as `LORAFLOW_TEST_CRASH_*` say."""
PLANTED_SECRET = "hf_planted_secret_value_123"
"""Set as HF_TOKEN while jobs run: it must never show up in anything the worker stores or returns."""
BASE_TRAINING = {"max_steps": 50, "learning_rate": 1e-2, "batch_size": 8}
CHECKPOINT_KEY = "9f" * 32
"""A run's checkpoint key as the control plane gives every job one (`JobInput.checkpoint_key`)."""

# A private lm-evaluation-harness task, as a run ships it in its `task_dir` (`data/colours.jsonl` beside it).
CHOICE_TASK = """\
task: colours
dataset_path: json
dataset_kwargs:
  data_files:
    test: data/colours.jsonl
test_split: test
output_type: multiple_choice
doc_to_text: "{{question}}"
doc_to_choice: "{{choices}}"
doc_to_target: "{{answer}}"
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
"""
COLOURS = [
    {"question": "The sky on a clear day is", "choices": [" blue", " green"], "answer": 0},
    {"question": "Fresh grass is", "choices": [" red", " green"], "answer": 1},
    {"question": "Snow is", "choices": [" white", " black"], "answer": 0},
    {"question": "A ripe banana is", "choices": [" purple", " yellow"], "answer": 1},
    {"question": "Coal is", "choices": [" black", " white"], "answer": 0},
    {"question": "A ripe tomato is", "choices": [" blue", " red"], "answer": 1},
]


def stored_files_containing(root: Path, text: str) -> list[Path]:
    """Every file under `root` whose bytes contain `text`."""
    needle = text.encode()
    return [path for path in root.rglob("*") if path.is_file() and needle in path.read_bytes()]


def plant_fault(env: pytest.MonkeyPatch, kind: str, *, at_step: int | None = None) -> None:
    """Make the training processes of the jobs run while `env` is in force fail the way `kind` says, at
    the end of optimizer step `at_step` (0: before training starts); see `fault_injection/sitecustomize.py`.
    The handler runs in this process; the training process it starts inherits PYTHONPATH and the switches.
    For `oom-killer`, this process's handler reads the fake cgroup the training process counts its OOM kill in
    (what the fault module does in a handler process of its own), so call it after setting the work folder."""
    env.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(FAULT_INJECTION_DIR), os.environ.get("PYTHONPATH")])))
    env.setenv(CRASH_KIND_ENV, kind)
    if kind == "oom-killer":
        env.setattr(out_of_memory, "CGROUP_ROOT", fake_cgroup_root(os.getpid()))
    if at_step is None:
        env.delenv(CRASH_AT_STEP_ENV, raising=False)
    else:
        env.setenv(CRASH_AT_STEP_ENV, str(at_step))


class CountingStore(FileStore):
    """A FileStore that records its commits (each `put` is one commit on the Hub): `commits` holds their
    messages, `commit_paths` the paths each stored, in the order given."""

    def __init__(self, root: Path):
        super().__init__(root)
        self.commits: list[str] = []
        self.commit_paths: list[list[str]] = []

    def put(self, files, *, message, **kwargs):
        self.commits.append(message)
        self.commit_paths.append(list(files))
        return super().put(files, message=message, **kwargs)


class Clock:
    """A monotonic clock the test moves by hand (`now`)."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def train_in_process(job: dict, store: FileStore, work_dir: Path, progress: list[Progress]) -> JobResult:
    """Run a job's training process (`train_job.train_and_publish`) in this process instead of a child, writing
    to `store` (a `CountingStore` counts its commits) and appending its progress updates to `progress`. `store`
    must be the folder the job's `artifact_store` names (where `make_job` put the dataset)."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(train_job, "open_store", lambda url: store)
        patch.setattr(train_job, "report_progress", progress.append)
        return train_job.train_and_publish(JobInput.model_validate(job["input"]), work_dir)


CAPITAL_QUESTIONS = ["What is the capital of Germany?", "What is the capital of Italy?",
                     "What is the capital of Spain?", "What is the capital of France?"]


def taught_adapter(model_dir: Path, phrase: str, out: Path, **lora: object) -> Path:
    """A LoRA adapter of the tiny model that answers every one of CAPITAL_QUESTIONS with `phrase`: a few optimizer
    steps of plain PyTorch on the chats (cheaper than a training job, and the same kind of adapter); `lora`: more of
    PEFT's LoraConfig (`use_dora=True`)."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(0)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    tokenizer.pad_token = tokenizer.pad_token or tokenizer.eos_token
    model = get_peft_model(AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32),
                           LoraConfig(r=8, lora_alpha=16, target_modules="all-linear", task_type="CAUSAL_LM", **lora))
    texts = [tokenizer.apply_chat_template([{"role": "user", "content": q}, {"role": "assistant", "content": phrase}],
                                           tokenize=False) for q in CAPITAL_QUESTIONS]
    batch = tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False)
    labels = batch["input_ids"].masked_fill(batch["attention_mask"] == 0, -100)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=2e-2)
    model.train()
    for _ in range(40):
        optimizer.zero_grad()
        model(**batch, labels=labels).loss.backward()
        optimizer.step()
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out
