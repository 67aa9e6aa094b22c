"""Before renting, a chat SFT run's first examples are rendered by the model's own tokenizer and masked as the worker
will: a run whose loss would be on no answer is refused naming `training.loss_on`, `training.chat_template` and the
fix; a Hub model's tokenizer comes from its pinned commit. A pass needs no transformers import; a refusal is
transformers' own."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
from huggingface_hub import HfApi
from loraflow_worker.contract import ModelSource, TrainingSettings
from pydantic import SecretStr
from transformers import AutoTokenizer

from tasks.placement.plan import resolve_model
from tasks.preflight.chat_tokenizer import ChatTokenizer
from tasks.preflight.chats import (
    TokenizerTooLarge,
    UnreadableTokenizer,
    check_chats,
    check_chats_in,
    first_chats,
    tokenizer_folder,
)
from tasks.settings import Settings
from tests.conftest import DATASET
from tests.hub_fixture import HubStandIn, hub  # noqa: F401

CHATS = first_chats(DATASET)
REWRITING = (  # ChatML without markers whose earlier answers shrink once a later turn follows
    "{%- for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' }}"
    "{{ message['content'] if loop.last or message['role'] != 'assistant' else '...' }}{{ '<|im_end|>\\n' }}"
    "{%- endfor %}{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{%- endif %}"
)
MULTI_TURN = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello."},
              {"role": "user", "content": "Bye"}, {"role": "assistant", "content": "Goodbye."}]


@pytest.fixture(scope="module")
def tokenizer(tiny_model):
    return AutoTokenizer.from_pretrained(tiny_model)


def with_template(tiny_model: Path, folder: Path, template: str | None) -> Path:
    shutil.copytree(tiny_model, folder)
    tok = AutoTokenizer.from_pretrained(folder)
    tok.chat_template = template
    (folder / "chat_template.jinja").unlink(missing_ok=True)
    tok.save_pretrained(folder)
    return folder


def test_the_shipped_chats_carry_their_loss_on_the_answers_under_the_models_own_markers(tokenizer):
    found = check_chats(CHATS, tokenizer, TrainingSettings())
    assert found.examples == len(CHATS) == 20
    assert 0.1 < found.token_share < 0.9
    assert found.template == "the model's own chat template"
    assert "of their tokens carry the loss" in found.describe()


def test_a_chat_whose_answer_is_beyond_max_seq_length_is_refused_with_the_fix(tokenizer):
    long_prompt = [{"role": "user", "content": "word " * 200}, {"role": "assistant", "content": "ok"}]
    with pytest.raises(ValueError) as refused:
        check_chats([CHATS[0], long_prompt], tokenizer, TrainingSettings(max_seq_length=64))
    message = str(refused.value)
    assert "example 2: no token of an assistant turn within training.max_seq_length (64)" in message
    assert "training.loss_on \"completion\"" in message and "training.chat_template" in message
    assert "training.loss_on = \"all\"" in message


def test_a_template_that_rewrites_earlier_answers_is_refused_and_a_marked_template_file_fixes_it(
        tiny_model, tmp_path, tokenizer):
    rewriting = AutoTokenizer.from_pretrained(with_template(tiny_model, tmp_path / "m", REWRITING))
    with pytest.raises(ValueError, match=r"example 1: the model's own chat template \(no generation markers, "
                                         r"no TRL training version\) renders turn 2 \(assistant\) differently"):
        check_chats([MULTI_TURN], rewriting, TrainingSettings())
    marked = tmp_path / "marked.jinja"
    marked.write_text(tokenizer.chat_template)
    found = check_chats([MULTI_TURN], rewriting, TrainingSettings(chat_template=str(marked)), template_file=marked)
    assert found.template == "training.chat_template (marked.jinja)" and found.token_share > 0


def test_a_model_without_a_chat_template_is_refused_naming_chat_template(tiny_model, tmp_path):
    bare = AutoTokenizer.from_pretrained(with_template(tiny_model, tmp_path / "bare", None))
    with pytest.raises(ValueError, match=r"no chat template .* give training.chat_template"):
        check_chats(CHATS, bare, TrainingSettings())


def test_loss_on_all_and_non_chat_files_need_no_tokenizer(tmp_path):
    pairs = tmp_path / "pairs.jsonl"
    pairs.write_text("".join(json.dumps({"prompt": c[:-1], "completion": c[-1:]}) + "\n" for c in CHATS))
    assert first_chats(pairs) == []


def test_a_hub_models_tokenizer_is_read_at_its_pinned_commit(hub: HubStandIn, tiny_model):  # noqa: F811
    settings = Settings(hf_endpoint=hub.url, hf_token=SecretStr(hub.token))
    api = HfApi(endpoint=hub.url, token=hub.token)
    api.create_repo("org/tiny-chat-model")
    api.upload_folder(repo_id="org/tiny-chat-model", folder_path=str(tiny_model), commit_message="model")
    pinned = resolve_model(ModelSource(id="org/tiny-chat-model"), settings)
    api.upload_file(repo_id="org/tiny-chat-model", path_or_fileobj=REWRITING.encode(), path_in_repo="chat_template.jinja",
                    commit_message="a later template")
    folder = tokenizer_folder(pinned, settings)
    assert not (folder / "model.safetensors").exists()  # the tokenizer, not the weights
    found = check_chats(CHATS, AutoTokenizer.from_pretrained(folder), TrainingSettings())
    assert found.template == "the model's own chat template"  # the pinned commit's, with its markers


def pinned_hub_model(hub: HubStandIn, model: Path, repo_id: str) -> tuple[ModelSource, Settings]:  # noqa: F811
    """`model` uploaded to the Hub stand-in as `repo_id` (made unique: a name the Hub cache already holds would not be
    downloaded), pinned to its commit, and settings that reach it."""
    repo_id = f"{repo_id}-{uuid.uuid4().hex[:8]}"
    settings = Settings(hf_endpoint=hub.url, hf_token=SecretStr(hub.token))
    api = HfApi(endpoint=hub.url, token=hub.token)
    api.create_repo(repo_id)
    api.upload_folder(repo_id=repo_id, folder_path=str(model), commit_message="model")
    return resolve_model(ModelSource(id=repo_id), settings), settings


def test_a_tokenizer_file_above_the_cap_is_refused_naming_it_its_size_and_the_cap_before_any_download(
        hub: HubStandIn, tiny_model, monkeypatch):  # noqa: F811
    pinned, settings = pinned_hub_model(hub, tiny_model, "org/tiny-big-tokenizer")
    size = (tiny_model / "tokenizer.json").stat().st_size
    monkeypatch.setattr("tasks.preflight.chats.TOKENIZER_FILE_MAX_BYTES", size - 1)
    with pytest.raises(TokenizerTooLarge) as refused:
        tokenizer_folder(pinned, settings)
    assert f"{pinned.id}'s tokenizer.json is {size / 2**20:.1f} MiB ({size:,} bytes), above the " \
           f"{(size - 1) / 2**20:.1f} MiB ({size - 1:,} bytes) the control plane downloads of a tokenizer file" \
           in str(refused.value)
    assert hub.downloads("model", pinned.id) == 0
    monkeypatch.setattr("tasks.preflight.chats.TOKENIZER_FILE_MAX_BYTES", size)  # a file of the cap's size is read
    assert (tokenizer_folder(pinned, settings) / "tokenizer.json").stat().st_size == size
    assert hub.downloads("model", pinned.id) > 0


def test_tokenizer_files_above_the_cap_together_are_refused_before_any_download(
        hub: HubStandIn, tiny_model, monkeypatch):  # noqa: F811
    pinned, settings = pinned_hub_model(hub, tiny_model, "org/tiny-many-tokenizer-files")
    monkeypatch.setattr("tasks.preflight.chats.TOKENIZER_MAX_BYTES", (tiny_model / "tokenizer.json").stat().st_size)
    with pytest.raises(TokenizerTooLarge, match=rf"{pinned.id}'s \d+ tokenizer files are .* together, "
                                                r"above the .* the control plane downloads of a tokenizer"):
        tokenizer_folder(pinned, settings)
    assert hub.downloads("model", pinned.id) == 0


# The check as the flow runs it, the cap lowered below the tiny model's tokenizer.json (argv: model id, revision,
# chats file, cap in bytes).
CAPPED_CHECK_FLOW = """
import sys
from loraflow_worker.contract import ModelSource, TrainingSettings
from prefect import flow
import tasks.preflight.chats as chats

chats.TOKENIZER_FILE_MAX_BYTES = int(sys.argv[4])

@flow
def capped_check():
    return chats.check_chats_task(ModelSource(id=sys.argv[1], revision=sys.argv[2]), TrainingSettings(),
                                  [(sys.argv[3], "auto", {})], None)

print("FOUND", capped_check())
"""


def test_a_tokenizer_above_the_cap_leaves_the_check_to_the_worker_with_a_warning(
        hub: HubStandIn, tiny_model, local_stack):  # noqa: F811
    from tests.test_crash_recovery_e2e import flow_env

    pinned, _ = pinned_hub_model(hub, tiny_model, "org/tiny-capped-in-flow")
    cap = (tiny_model / "tokenizer.json").stat().st_size - 1
    env = flow_env(local_stack, HF_ENDPOINT=hub.url, HF_TOKEN=hub.token)
    proc = subprocess.run([sys.executable, "-c", CAPPED_CHECK_FLOW, pinned.id, pinned.revision, str(DATASET), str(cap)],
                          cwd=Path(__file__).resolve().parents[1], env=env, capture_output=True, text=True, timeout=180)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0 and "FOUND None" in proc.stdout, output[-3000:]
    assert f"The first chats were not checked before renting: {pinned.id}'s tokenizer could not be read " \
           f"(TokenizerTooLarge: {pinned.id}'s tokenizer.json is" in output, output[-3000:]
    assert hub.downloads("model", pinned.id) == 0


def test_a_chat_template_file_is_stored_with_the_runs_inputs_and_the_job_reads_its_copy(tmp_path):
    from flows.forms.run import RunSpec
    from flows.train_check import _job_input, job_dataset
    from tasks.storage.artifacts import chat_template_store_path, check_chat_template_file, publish_run_inputs
    from tasks.storage.run_files import read_run_files

    template = tmp_path / "chatml.jinja"
    template.write_text(REWRITING)
    store = tmp_path / "store"
    spec = RunSpec.model_validate({"model": {"id": "org/m"}, "dataset": {"hub_id": "org/d"},
                                   "artifact_store": store.as_uri(), "training": {"chat_template": str(template)}})
    files = read_run_files(spec.local_paths(), tmp_path / "read", base_dir=tmp_path)
    assert check_chat_template_file(spec.training.chat_template, files).location == template
    publish_run_inputs(store.as_uri(), "r1", files, [])
    assert (store / chat_template_store_path("r1")).read_text() == REWRITING
    job = _job_input(spec, "r1", 0.0, ModelSource(id="org/m", revision="a" * 40), job_dataset(spec, "r1", None, {}),
                     [], chat_template_path=chat_template_store_path("r1"))
    assert job.training.chat_template == "runs/r1/chat_template.jinja"


def test_a_chat_template_file_that_does_not_exist_is_refused_naming_the_field(tmp_path):
    from tasks.storage.artifacts import check_chat_template_file
    from tasks.storage.run_files import read_run_files

    with pytest.raises(ValueError, match=r"training.chat_template missing.jinja \(.*missing.jinja\) does not exist or is not a file"):
        read_run_files([("training.chat_template", "missing.jinja")], tmp_path / "read", base_dir=tmp_path)
    assert check_chat_template_file("qwen3_training", {}) is None and check_chat_template_file(None, {}) is None


def test_a_sharegpt_file_is_checked_as_the_chats_it_converts_to(tmp_path, tokenizer):
    rows = [{"conversations": [{"from": "human", "value": "word " * 200}, {"from": "gpt", "value": "ok"}]}]
    path = tmp_path / "sharegpt.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    chats = first_chats(path, "sharegpt")
    assert chats == [[{"role": "user", "content": "word " * 200}, {"role": "assistant", "content": "ok"}]]
    with pytest.raises(ValueError, match=r"example 1: no token of an assistant turn within training.max_seq_length"):
        check_chats(chats, tokenizer, TrainingSettings(max_seq_length=64))


def test_a_passing_check_reads_the_tokenizer_without_importing_transformers(tiny_model):
    script = ("import sys; from pathlib import Path; from loraflow_worker.contract import TrainingSettings; "
              "from tasks.preflight.chats import check_chats_in, first_chats; "
              f"found = check_chats_in(Path({str(tiny_model)!r}), first_chats(Path({str(DATASET)!r})), "
              "TrainingSettings()); print(found.token_share, 'transformers' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True).stdout.split()
    expected = check_chats(CHATS, AutoTokenizer.from_pretrained(tiny_model), TrainingSettings()).token_share
    assert out == [str(expected), "False"]


def test_what_the_fast_path_cannot_pass_is_judged_by_transformers(tiny_model, monkeypatch):
    def differs(*args, **kwargs):
        raise RuntimeError("a rendering the fast path gets wrong")

    monkeypatch.setattr(ChatTokenizer, "apply_chat_template", differs)
    found = check_chats_in(tiny_model, CHATS, TrainingSettings())
    assert found == check_chats(CHATS, AutoTokenizer.from_pretrained(tiny_model), TrainingSettings())


def test_a_refusal_of_the_fast_path_stands_when_transformers_refuses_too(tiny_model, tmp_path):
    with pytest.raises(ValueError, match=r"example 1: the model's own chat template \(no generation markers, no TRL "
                                         r"training version\) renders turn 2 \(assistant\) differently"):
        check_chats_in(with_template(tiny_model, tmp_path / "m", REWRITING), [MULTI_TURN], TrainingSettings())


def test_a_tokenizer_transformers_cannot_read_leaves_the_check_to_the_worker(tiny_model, tmp_path):
    folder = with_template(tiny_model, tmp_path / "m", None)
    (folder / "tokenizer.json").unlink()
    with pytest.raises(UnreadableTokenizer):
        check_chats_in(folder, CHATS, TrainingSettings())
