"""SFT learns the answers, not the prompts (`training.loss_on`): chats whose user turns are random strings and whose
answers are one short sentence train to a far lower loss on the answers than on every token; a model template
without `{% generation %}` markers (none TRL knows) trains on the answers too, its mask derived from each turn's
prefix; a template that rewrites earlier turns, or a chat whose answer is cut off, is refused naming the fix."""

from __future__ import annotations

import hashlib
import json
import random
import shutil
from pathlib import Path

import pytest
import trl
from transformers import AutoTokenizer

from loraflow_worker.artifacts import open_store
from loraflow_worker.contract import TRL_TRAINING_TEMPLATES, JobInput
from loraflow_worker.self_test.tiny_model import CHAT_TEMPLATE
from loraflow_worker.dataset.loss_mask import ChatTemplate, LossMaskError, check_first_chats, mask_chat
from loraflow_worker.training.sft import train_sft
from loraflow_worker.training.sft_loss import chat_template, trl_template

ANSWER = "Noted, thank you."
UNMARKED_TEMPLATE = CHAT_TEMPLATE.replace("{% generation %}", "").replace("{% endgeneration %}", "")
"""The tiny model's ChatML without its markers: a template TRL has no training version of."""
CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is the capital of France?"},
        {"role": "assistant", "content": "Paris."}, {"role": "user", "content": "And of Peru?"},
        {"role": "assistant", "content": "Lima."}]
SHORT = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello."}]


def random_prompt_chats(count: int = 32) -> list[dict]:
    rng = random.Random(7)
    noise = lambda: "".join(rng.choice("abcdefghijklmnopqrstuvwxyz ") for _ in range(80))  # noqa: E731
    return [{"messages": [{"role": "user", "content": noise()}, {"role": "assistant", "content": ANSWER}]}
            for _ in range(count)]


def unmarked_model(tiny_model_dir: Path, folder: Path) -> Path:
    shutil.copytree(tiny_model_dir, folder)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    tokenizer.chat_template = UNMARKED_TEMPLATE
    tokenizer.save_pretrained(folder)
    return folder


def train(model_dir: Path, folder: Path, rows: list[dict], **training):
    store = folder / "store"
    (store / "runs/lo/dataset").mkdir(parents=True)
    (store / "runs/lo/dataset/train.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    job = JobInput.model_validate({
        "run_id": "lo", "model": {"id": str(model_dir)}, "artifact_store": store.as_uri(),
        "dataset": {"store_path": "runs/lo/dataset/train.jsonl"},
        "training": {"max_steps": 30, "learning_rate": 1e-2, "batch_size": 8, "checkpoint_every_minutes": None,
                     **training},
    })
    return train_sft(job, open_store(job.artifact_store), folder / "work", lambda progress: None)


@pytest.fixture(scope="module")
def runs(tiny_model_dir, tmp_path_factory):
    """The same random-prompt chats trained three ways: the default (the answers, by the template's markers), every
    token, and the answers under a template without markers."""
    rows = random_prompt_chats()
    unmarked = unmarked_model(tiny_model_dir, tmp_path_factory.mktemp("unmarked") / "model")
    return {
        "completion": train(tiny_model_dir, tmp_path_factory.mktemp("completion"), rows),
        "all": train(tiny_model_dir, tmp_path_factory.mktemp("all"), rows, loss_on="all"),
        "unmarked": train(unmarked, tmp_path_factory.mktemp("unmarked-run"), rows),
    }


def test_the_default_loss_on_the_answers_ends_far_below_the_loss_on_every_token(runs):
    answers, everything = runs["completion"].metrics.final_loss, runs["all"].metrics.final_loss
    assert answers < 0.3 * everything, (answers, everything)


def test_a_template_without_markers_trains_on_the_answers_too(runs):
    assert runs["unmarked"].metrics.final_loss < 0.3 * runs["all"].metrics.final_loss
    assert runs["unmarked"].manifest.loss.masked_by == "each assistant turn's rendered prefix"


def test_the_manifest_records_the_share_of_tokens_with_loss(runs):
    answers, everything = runs["completion"].manifest.loss, runs["all"].manifest.loss
    assert (answers.loss_on, everything.loss_on) == ("completion", "all")
    assert everything.token_share == 1.0
    # A short answer after an 80-character prompt: a small share, the same whichever way the turns were found.
    assert 0.05 < answers.token_share < 0.4
    assert abs(runs["unmarked"].manifest.loss.token_share - answers.token_share) < 0.05
    assert answers.chat_template == "the model's own chat template"
    assert answers.masked_by == "the chat template's generation markers"


def test_the_adapter_keeps_the_models_own_template(runs):
    saved = AutoTokenizer.from_pretrained(runs["unmarked"].adapter_dir)
    assert saved.chat_template == UNMARKED_TEMPLATE


@pytest.mark.parametrize("template", [CHAT_TEMPLATE, UNMARKED_TEMPLATE], ids=["markers", "prefixes"])
def test_every_assistant_turn_and_its_end_carry_the_loss_and_nothing_else(tiny_model_dir, template):
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    chat = mask_chat(tokenizer, CHAT, ChatTemplate(template, "test"))
    masked = tokenizer.decode([t for t, m in zip(chat.input_ids, chat.assistant_masks) if m])
    assert masked.replace("\n", "") == "Paris.<|im_end|>Lima.<|im_end|>"
    assert chat.input_ids == tokenizer.apply_chat_template(CHAT, chat_template=template, tokenize=True,
                                                           return_dict=True)["input_ids"]


def test_a_template_that_rewrites_earlier_turns_is_refused(tiny_model_dir):
    # Earlier answers shortened once a later turn follows, as reasoning templates drop earlier thoughts.
    rewriting = UNMARKED_TEMPLATE.replace("{{ message['content'] }}", "{{ message['content'] if loop.last else '...' }}")
    assert rewriting != UNMARKED_TEMPLATE
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    with pytest.raises(LossMaskError, match=r"turn 3 \(assistant\) differently"):
        mask_chat(tokenizer, CHAT, ChatTemplate(rewriting, "the model's own chat template"))


def test_a_chat_whose_answer_is_beyond_max_seq_length_is_refused(tiny_model_dir):
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    chats = [SHORT, random_prompt_chats(1)[0]["messages"]]
    assert 0 < check_first_chats(tokenizer, chats, ChatTemplate(CHAT_TEMPLATE, "t"), max_length=200) < 1
    with pytest.raises(LossMaskError, match=r"example 2: no token of an assistant turn within "
                                            r"training.max_seq_length \(16\)"):
        check_first_chats(tokenizer, chats, ChatTemplate(CHAT_TEMPLATE, "t"), max_length=16)


def test_a_run_whose_first_chats_have_no_answer_in_reach_fails_before_the_model_loads(tiny_model_dir, tmp_path):
    with pytest.raises(LossMaskError, match=r"training.loss_on \"completion\".*training.chat_template.*loss_on = "
                                            r"\"all\""):
        train(tiny_model_dir, tmp_path, random_prompt_chats(8), max_seq_length=8)


def test_a_qwen3_chat_is_rendered_with_trls_training_version_of_its_template(tiny_model_dir, tmp_path):
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    tokenizer.chat_template = trl_template("qwen3")  # Qwen3's own template, which has no markers
    job = JobInput.model_validate({"run_id": "q", "model": {"id": str(tiny_model_dir)}, "artifact_store": "file:///x",
                                   "dataset": {"store_path": "d.jsonl"}})
    template = chat_template(job, tokenizer, open_store(job.artifact_store))
    assert template.source == "TRL's `qwen3_training`, the training version of the model's template"
    chat = mask_chat(tokenizer, CHAT, template)
    masked = tokenizer.decode([t for t, m in zip(chat.input_ids, chat.assistant_masks) if m])
    assert "Paris." in masked and "Lima." in masked and "France" not in masked and "Be brief" not in masked


def test_the_contracts_table_of_trl_training_templates_is_the_installed_trls(tiny_model_dir):
    # The control plane predicts from the table which template the worker trains with; TRL decides it here.
    from trl.chat_template_utils import get_training_chat_template

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    folder = Path(trl.__file__).parent / "chat_templates"
    found = {}
    for original in sorted(folder.glob("*.jinja")):
        if original.stem.endswith("_training"):
            continue
        tokenizer.chat_template = original.read_text(encoding="utf-8")
        try:
            trained = get_training_chat_template(tokenizer)
        except ValueError:  # TRL has no training version of it
            continue
        if trained is not None:
            found[hashlib.sha256(tokenizer.chat_template.encode()).hexdigest()] = next(
                f.stem for f in folder.glob("*_training.jinja") if f.read_text(encoding="utf-8") == trained)
    assert found == TRL_TRAINING_TEMPLATES
