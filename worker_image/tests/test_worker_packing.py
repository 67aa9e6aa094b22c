"""Packing (`training.packing`): a batch of packed rows gives each example the loss it has alone and unpadded
(positions restart per example, so transformers masks attention across them); no example's first token is trained
from the example before it; a packed run completes and its manifest says packing was engaged; a Gated-DeltaNet hybrid,
whose linear-attention layers would run across examples, is refused."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback

from loraflow_worker.artifacts import open_store
from loraflow_worker.contract import JobInput
from loraflow_worker.self_test.tiny_model import DEFAULT_CORPUS
from loraflow_worker.dataset.loss_mask import ChatTemplate, mask_chat
from loraflow_worker.dataset.packing import packing_problem
from loraflow_worker.training.sft import PackedRows, train_sft

CHATS = [json.loads(line)["messages"] for line in DEFAULT_CORPUS.read_text().splitlines() if line.strip()]


def examples(tokenizer, count: int = 4) -> list[dict[str, list[int]]]:
    """The first chats of different lengths, labelled on their answers as training labels them."""
    rows = []
    for messages in CHATS[:count]:
        chat = mask_chat(tokenizer, messages, ChatTemplate(tokenizer.chat_template, "the tiny model's"))
        rows.append({"input_ids": chat.input_ids,
                     "labels": [t if m else -100 for t, m in zip(chat.input_ids, chat.assistant_masks)]})
    return rows


def per_example_losses(logits: torch.Tensor, labels: torch.Tensor, spans: list[tuple[int, int, int]]) -> list[float]:
    """Each example's mean next-token loss over its labelled tokens, read from (row, start, end) of a batch."""
    losses = []
    for row, start, end in spans:
        losses.append(torch.nn.functional.cross_entropy(logits[row, start:end - 1], labels[row, start + 1:end],
                                                        ignore_index=-100).item())
    return losses


@pytest.fixture(scope="module")
def model_and_rows(tiny_model_dir):
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32, attn_implementation="sdpa").eval()
    return model, examples(tokenizer), tokenizer.pad_token_id


def unpadded_losses(model, rows) -> list[float]:
    losses = []
    with torch.no_grad():
        for row in rows:
            ids, labels = torch.tensor([row["input_ids"]]), torch.tensor([row["labels"]])
            losses += per_example_losses(model(ids).logits, labels, [(0, 0, len(row["input_ids"]))])
    return losses


def packed_batch(rows, pad_token_id):
    """Two packed rows of two examples each, as TRL's packing leaves them, through the worker's collator; the spans
    (row, start, end) of the four examples."""
    packed, spans = [], []
    for number, pair in enumerate((rows[:2], rows[2:4])):
        packed.append({"input_ids": pair[0]["input_ids"] + pair[1]["input_ids"],
                       "labels": pair[0]["labels"] + pair[1]["labels"],
                       "seq_lengths": [len(pair[0]["input_ids"]), len(pair[1]["input_ids"])]})
        first = len(pair[0]["input_ids"])
        spans += [(number, 0, first), (number, first, first + len(pair[1]["input_ids"]))]
    batch = PackedRows(pad_token_id=pad_token_id, return_position_ids=True)(packed)
    return batch, spans


def test_a_packed_batch_gives_each_example_its_unpadded_loss(model_and_rows):
    model, rows, pad = model_and_rows
    assert len({len(r["input_ids"]) for r in rows}) > 1  # examples of different lengths: one row is padded
    batch, spans = packed_batch(rows, pad)
    assert "attention_mask" not in batch and batch["input_ids"].shape[0] == 2
    assert [batch["position_ids"][row, start].item() for row, start, _ in spans] == [0, 0, 0, 0]
    with torch.no_grad():  # as TRL's SFTTrainer calls the model: without a cache (transformers reads packed rows then)
        logits = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"], use_cache=False).logits
    assert per_example_losses(logits, batch["labels"], spans) == pytest.approx(unpadded_losses(model, rows), abs=1e-4)


def test_the_same_rows_with_attention_across_examples_give_other_losses(model_and_rows):
    # What the restarting positions prevent: without them the second example of a row sees the first.
    model, rows, pad = model_and_rows
    batch, spans = packed_batch(rows, pad)
    running = torch.arange(batch["input_ids"].shape[1]).expand(2, -1)
    with torch.no_grad():
        logits = model(input_ids=batch["input_ids"], position_ids=running, use_cache=False).logits
    leaked, alone = per_example_losses(logits, batch["labels"], spans), unpadded_losses(model, rows)
    assert leaked[0] == pytest.approx(alone[0], abs=1e-4)
    assert abs(leaked[1] - alone[1]) > 1e-2 and abs(leaked[3] - alone[3]) > 1e-2


def test_a_packed_run_completes_and_its_manifest_says_packing_was_engaged(tiny_model_dir, tmp_path):
    store = tmp_path / "store"
    (store / "runs/pk/dataset").mkdir(parents=True)
    (store / "runs/pk/dataset/train.jsonl").write_text(DEFAULT_CORPUS.read_text())
    job = JobInput.model_validate({
        "run_id": "pk", "model": {"id": str(tiny_model_dir)}, "artifact_store": store.as_uri(),
        "dataset": {"store_path": "runs/pk/dataset/train.jsonl"},
        "training": {"max_steps": 12, "learning_rate": 1e-2, "batch_size": 2, "max_seq_length": 128,
                     "packing": True, "checkpoint_every_minutes": None},
    })
    outcome = train_sft(job, open_store(job.artifact_store), tmp_path / "work", lambda progress: None)
    packing = outcome.manifest.fast_paths["packing"]
    assert packing.engaged, packing.reason
    assert packing.reason.startswith(f"{len(CHATS)} examples in ") and "rows of at most 128 tokens" in packing.reason
    assert outcome.metrics.steps == 12 and outcome.metrics.final_loss < outcome.metrics.first_loss
    assert 0 < outcome.manifest.loss.token_share < 1  # the loss stays on the answers when packed


class FirstBatch(TrainerCallback):
    """What the model is handed at the first training step, as the trainer feeds it."""

    def __init__(self) -> None:
        self.batch: dict[str, torch.Tensor] | None = None

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        def keep(module, positional, named):
            if self.batch is None:
                self.batch = {name: named[name].clone() for name in ("input_ids", "labels", "position_ids")}

        model.register_forward_pre_hook(keep, with_kwargs=True)


def first_packed_batch(tiny_model_dir, store_root, rows: list[dict], **training) -> dict[str, torch.Tensor]:
    """The first batch of a packed SFT run on `rows`."""
    (store_root / "runs/pk/dataset").mkdir(parents=True)
    (store_root / "runs/pk/dataset/train.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    job = JobInput.model_validate({
        "run_id": "pk", "model": {"id": str(tiny_model_dir)}, "artifact_store": store_root.as_uri(),
        "dataset": {"store_path": "runs/pk/dataset/train.jsonl"},
        "training": {"max_steps": 1, "batch_size": 4, "max_seq_length": 256, "packing": True,
                     "checkpoint_every_minutes": None, **training},
    })
    first = FirstBatch()
    train_sft(job, open_store(job.artifact_store), store_root / "work", lambda progress: None, callbacks=[first])
    return first.batch


def assert_only_each_examples_first_label_is_masked(batch: dict[str, torch.Tensor]) -> None:
    """Every token of every example carries its own label, but the first: (row, index) where an example starts is
    where its position is 0 and the next one's 1 (padding is all 0)."""
    positions, labels, ids = batch["position_ids"], batch["labels"], batch["input_ids"]
    starts = (positions[:, :-1] == 0) & (positions[:, 1:] == 1)
    later_starts = starts[:, 1:].nonzero().tolist()  # an example that follows another in its row
    assert later_starts, "no row packs two examples: the run tests nothing"
    assert (labels[:, :-1][starts] == -100).all(), labels[:, :-1][starts]
    inside = positions > 0
    assert torch.equal(labels[inside], ids[inside])


def test_a_packed_run_trains_no_examples_first_token_from_the_example_before(tiny_model_dir, tmp_path):
    # loss_on "all": each token's label is the token itself, but the first of an example would be predicted from the
    # previous example's last token, which it cannot see.
    rows = [{"messages": messages} for messages in CHATS]
    assert_only_each_examples_first_label_is_masked(first_packed_batch(tiny_model_dir, tmp_path, rows, loss_on="all"))


def test_a_packed_plain_text_run_trains_no_examples_first_token_from_the_example_before(tiny_model_dir, tmp_path):
    rows = [{"text": " ".join(turn["content"] for turn in messages)} for messages in CHATS]
    assert_only_each_examples_first_label_is_masked(first_packed_batch(tiny_model_dir, tmp_path, rows))


class TokenCounts(TrainerCallback):
    """The packed rows a run trains on, and the `num_tokens` TRL logs."""

    def __init__(self) -> None:
        self.rows = None
        self.logged: list[int] = []

    def on_train_begin(self, args, state, control, train_dataloader=None, **kwargs):
        self.rows = train_dataloader.dataset

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs and "num_tokens" in logs:
            self.logged.append(int(logs["num_tokens"]))


def test_a_packed_run_counts_every_token_of_its_rows_not_one_row_per_batch(tiny_model_dir, tmp_path):
    store = tmp_path / "store"
    (store / "runs/pk/dataset").mkdir(parents=True)
    (store / "runs/pk/dataset/train.jsonl").write_text(DEFAULT_CORPUS.read_text())
    job = JobInput.model_validate({
        "run_id": "pk", "model": {"id": str(tiny_model_dir)}, "artifact_store": store.as_uri(),
        "dataset": {"store_path": "runs/pk/dataset/train.jsonl"},
        "training": {"epochs": 1, "batch_size": 4, "max_seq_length": 128, "packing": True, "logging_steps": 1,
                     "checkpoint_every_minutes": None},
    })
    counts = TokenCounts()
    outcome = train_sft(job, open_store(job.artifact_store), tmp_path / "work", lambda progress: None,
                        callbacks=[counts])
    real = sum(len(ids) for ids in counts.rows["input_ids"])  # one epoch: every packed row once, padding apart
    assert len(counts.rows) > outcome.metrics.steps  # batches of several rows: TRL alone counted one row of each
    assert counts.logged[-1] == real
    assert outcome.metrics.tokens == real


def test_packing_is_refused_for_a_gated_deltanet_hybrid():
    assert packing_problem("qwen3") is None
    problem = packing_problem("qwen3_next")
    assert problem.startswith("training.packing: `qwen3_next` is a Gated-DeltaNet hybrid")
    assert "causal-conv1d" in problem and problem.endswith("set training.packing = false")


def test_the_image_has_no_causal_conv1d_as_the_refusal_says():
    # The control plane refuses hybrids before renting on this fact; an image that gains the kernel changes it.
    from pathlib import Path

    lock = (Path(__file__).resolve().parents[1] / "requirements-gpu.lock").read_text()
    assert "\ncausal-conv1d==" not in lock and "\nflash-linear-attention==" in lock
