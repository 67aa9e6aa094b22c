"""Data as people have it, on the worker: Alpaca and ShareGPT files train (converted to TRL's conversational formats
by `contract.dataset_formats`), `columns` renames a dataset's own columns, a mix of sources is drawn by its fractions
with the job's seed and recorded, and a Hub dataset's config and revision choose what `load_dataset` loads (from the
control plane's Hub stand-in)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from huggingface_hub import HfApi

from worker_test_support import hub_stand_in
from loraflow_worker.artifacts import FileStore, open_store
from loraflow_worker.contract import DatasetSource, JobInput
from loraflow_worker.contract.dataset_formats import to_trl_row
from loraflow_worker.self_test.tiny_model import DEFAULT_CORPUS
from loraflow_worker.dataset.loading import evaluation_split, load_job_dataset
from loraflow_worker.training.sft import train_sft


CHATS = [json.loads(line)["messages"] for line in DEFAULT_CORPUS.read_text().splitlines() if line.strip()]
SPEAKERS = {"user": "human", "assistant": "gpt", "system": "system"}
ALPACA = [{"instruction": chat[-2]["content"], "input": "", "output": chat[-1]["content"]} for chat in CHATS]
SHAREGPT = [{"conversations": [{"from": SPEAKERS[m["role"]], "value": m["content"]} for m in chat]} for chat in CHATS]


def store_lines(store_root: Path, store_path: str, rows: list[dict]) -> str:
    (store_root / store_path).parent.mkdir(parents=True, exist_ok=True)
    (store_root / store_path).write_text("".join(json.dumps(row) + "\n" for row in rows))
    return store_path


def sft_job(tmp_path: Path, model_dir: Path, dataset: dict) -> JobInput:
    return JobInput.model_validate({
        "run_id": "data", "model": {"id": str(model_dir)}, "artifact_store": (tmp_path / "store").as_uri(),
        "dataset": dataset,
        "training": {"max_steps": 30, "learning_rate": 1e-2, "batch_size": 8, "checkpoint_every_minutes": None},
    })


@pytest.mark.parametrize("data_format, rows", [("alpaca", ALPACA), ("sharegpt", SHAREGPT)])
def test_an_alpaca_or_sharegpt_file_trains_to_a_falling_loss(tiny_model_dir, tmp_path, data_format, rows):
    path = store_lines(tmp_path / "store", "runs/data/dataset/train.jsonl", rows)
    job = sft_job(tmp_path, tiny_model_dir, {"store_path": path, "format": data_format})

    outcome = train_sft(job, open_store(job.artifact_store), tmp_path / "work", lambda progress: None)

    assert outcome.metrics.steps == 30
    assert outcome.metrics.final_loss < 0.5 * outcome.metrics.first_loss, outcome.metrics.losses
    [source] = outcome.manifest.dataset_sources
    assert (source.format, source.rows, source.fraction) == (data_format, len(rows), None)


def test_an_alpaca_row_becomes_a_prompt_of_the_system_and_the_instruction_with_its_input_and_a_completion():
    row = {"instruction": "Translate to French.", "input": "Good morning", "output": "Bonjour", "system": "Be terse.",
           "source": "kept"}
    assert to_trl_row(row, "alpaca", {}) == {
        "prompt": [{"role": "system", "content": "Be terse."},
                   {"role": "user", "content": "Translate to French.\n\nGood morning"}],
        "completion": [{"role": "assistant", "content": "Bonjour"}],
        "source": "kept",
    }


def test_a_sharegpt_row_becomes_messages_with_chat_roles():
    row = {"conversations": [{"from": "system", "value": "S"}, {"from": "human", "value": "Q"},
                             {"from": "gpt", "value": "A"}]}
    assert to_trl_row(row, "sharegpt", {}) == {"messages": [
        {"role": "system", "content": "S"}, {"role": "user", "content": "Q"}, {"role": "assistant", "content": "A"}]}


def test_columns_map_a_datasets_own_names_to_the_formats(tmp_path):
    store_root = tmp_path / "store"
    store_lines(store_root, "chat.jsonl", [{"conversation": chat} for chat in CHATS])
    store_lines(store_root, "qa.jsonl", [{"question": r["instruction"], "answer": r["output"]} for r in ALPACA])
    store_lines(store_root, "dialog.jsonl", [{"dialog": [{"speaker": t["from"], "text": t["value"]}
                                                         for t in r["conversations"]]} for r in SHAREGPT])
    sources = {
        "chat.jsonl": {"columns": {"messages": "conversation"}},
        "qa.jsonl": {"format": "alpaca", "columns": {"instruction": "question", "output": "answer"}},
        "dialog.jsonl": {"format": "sharegpt",
                         "columns": {"conversations": "dialog", "from": "speaker", "value": "text"}},
    }
    loaded = {path: load_job_dataset(DatasetSource(store_path=path, **fields), FileStore(store_root),
                                     tmp_path / "work", seed=42).rows for path, fields in sources.items()}

    assert loaded["chat.jsonl"].column_names == ["messages"] and loaded["chat.jsonl"][0]["messages"] == CHATS[0]
    assert sorted(loaded["qa.jsonl"].column_names) == ["completion", "prompt"]
    assert loaded["qa.jsonl"][0]["completion"] == [{"role": "assistant", "content": ALPACA[0]["output"]}]
    assert loaded["dialog.jsonl"].column_names == ["messages"] and loaded["dialog.jsonl"][0]["messages"] == CHATS[0]


def test_a_row_the_format_cannot_take_is_refused_naming_the_source_the_row_and_the_field(tmp_path):
    rows = SHAREGPT[:3] + [{"conversations": [{"from": "human", "value": "Q"}, {"from": "bot", "value": "A"}]}]
    path = store_lines(tmp_path / "store", "runs/r/dataset/train.jsonl", rows)
    with pytest.raises(ValueError, match=r"^dataset \(file runs/r/dataset/train.jsonl\), row 4: "
                                         r"`conversations\[1\].from`: 'bot' is not a speaker"):
        load_job_dataset(DatasetSource(store_path=path, format="sharegpt"), FileStore(tmp_path / "store"),
                         tmp_path / "work", seed=42)


def mix_of_two(tmp_path: Path, seed: int):
    store_root = tmp_path / "store"
    alpaca = store_lines(store_root, "runs/m/dataset/mix-0.jsonl", ALPACA * 10)
    sharegpt = store_lines(store_root, "runs/m/dataset/mix-1.jsonl", SHAREGPT * 10)
    source = DatasetSource(mix=[{"store_path": alpaca, "format": "alpaca", "fraction": 0.25},
                                {"store_path": sharegpt, "format": "sharegpt", "fraction": 0.75}])
    return load_job_dataset(source, FileStore(store_root), tmp_path / f"work-{seed}", seed=seed)


def test_a_mix_draws_its_sources_by_their_fractions_and_records_what_each_gave(tmp_path):
    mixed = mix_of_two(tmp_path, seed=42)

    alpaca, sharegpt = mixed.sources
    assert (alpaca.source, alpaca.format, alpaca.fraction) == ("dataset.mix[0] (file runs/m/dataset/mix-0.jsonl)",
                                                               "alpaca", 0.25)
    # The mix stops when the first source runs out: the ShareGPT one, at three draws in four.
    assert sharegpt.rows == len(SHAREGPT) * 10 and alpaca.rows < len(ALPACA) * 10
    assert alpaca.rows + sharegpt.rows == len(mixed.rows)
    assert 0.2 < alpaca.rows / len(mixed.rows) < 0.3
    # Alpaca's prompt-completion pairs join ShareGPT's chats as `messages`.
    assert mixed.rows.column_names == ["messages"]


def test_a_mix_with_the_same_seed_gives_the_same_rows_and_another_seed_other_rows(tmp_path):
    first, again, other = (mix_of_two(tmp_path, seed) for seed in (42, 42, 7))
    assert first.rows["messages"] == again.rows["messages"] and first.sources == again.sources
    assert first.rows["messages"] != other.rows["messages"]


def test_a_hub_datasets_config_and_revision_choose_what_load_dataset_loads(tmp_path):
    # The Hub stand-in runs with the control plane's interpreter (the worker's has no FastAPI); huggingface_hub and
    # datasets read HF_ENDPOINT when imported, so the loading runs in a process whose environment names the stand-in.
    card = ("---\nconfigs:\n- config_name: easy\n  data_files: easy/*.jsonl\n- config_name: hard\n  data_files:\n"
            "  - split: train\n    path: hard/train.jsonl\n---\n")
    with hub_stand_in(tmp_path / "hub") as hub:
        api = HfApi(endpoint=hub.url, token=hub.token)
        api.create_repo("org/levels", repo_type="dataset")
        for path, rows in {"easy/all.jsonl": ALPACA[:4], "hard/train.jsonl": ALPACA[4:10]}.items():
            api.upload_file(path_or_fileobj="".join(json.dumps(r) + "\n" for r in rows).encode(), path_in_repo=path,
                            repo_id="org/levels", repo_type="dataset")
        first = api.upload_file(path_or_fileobj=card.encode(), path_in_repo="README.md", repo_id="org/levels",
                                repo_type="dataset").oid
        api.upload_file(path_or_fileobj=json.dumps(ALPACA[0]).encode() + b"\n", path_in_repo="hard/train.jsonl",
                        repo_id="org/levels", repo_type="dataset")
        source = DatasetSource(hub_id="org/levels", config="hard", revision=first, format="alpaca")
        code = ("import json, sys\nfrom loraflow_worker.artifacts import FileStore\n"
                "from loraflow_worker.contract import DatasetSource\n"
                "from loraflow_worker.dataset.loading import load_job_dataset\n"
                "loaded = load_job_dataset(DatasetSource.model_validate_json(sys.argv[1]), FileStore(sys.argv[2]), "
                "FileStore(sys.argv[2]).root, seed=42)\n"
                "print(json.dumps([loaded.rows.to_list(), loaded.sources[0].source]))\n")
        loading = subprocess.run([sys.executable, "-c", code, source.model_dump_json(), str(tmp_path / "work")],
                                 env=hub.client_env(HF_HOME=str(tmp_path / "hf-home")), capture_output=True,
                                 text=True, timeout=300)

    assert loading.returncode == 0, loading.stderr[-3000:]
    rows, name = json.loads(loading.stdout.splitlines()[-1])
    # The config `hard` at the first commit: its six rows, not the one row its file holds at the branch's head.
    assert [row["completion"][0]["content"] for row in rows] == [r["output"] for r in ALPACA[4:10]]
    assert name == f"dataset (hub org/levels, config hard, revision {first}, split train)"


def test_an_evaluation_file_is_converted_from_its_own_format(tmp_path):
    store_root = tmp_path / "store"
    train = store_lines(store_root, "runs/e/dataset/train.jsonl", [{"messages": chat} for chat in CHATS])
    held_out = store_lines(store_root, "runs/e/dataset/eval.jsonl", SHAREGPT[:3])
    job = JobInput.model_validate({
        "run_id": "e", "model": {"id": "unused"}, "artifact_store": store_root.as_uri(),
        "dataset": {"store_path": train},
        "evaluation": {"store_path": held_out, "format": "sharegpt", "every_steps": 5},
    })
    store = FileStore(store_root)
    rows, evaluation = evaluation_split(load_job_dataset(job.dataset, store, tmp_path / "work", seed=42).rows, job,
                                        store, tmp_path / "work")
    assert len(rows) == len(CHATS) and evaluation["messages"] == CHATS[:3]


def test_a_mix_of_prompt_only_rows_and_chats_is_refused_naming_each_source(tmp_path):
    store_root = tmp_path / "store"
    prompts = store_lines(store_root, "p.jsonl", [{"prompt": chat[:-1], "answer": "x"} for chat in CHATS])
    chats = store_lines(store_root, "c.jsonl", [{"messages": chat} for chat in CHATS])
    source = DatasetSource(mix=[{"store_path": prompts, "fraction": 0.5}, {"store_path": chats, "fraction": 0.5}])
    with pytest.raises(ValueError, match=r": dataset.mix\[0\] \(file p.jsonl\) is prompt-only; dataset.mix\[1\] "
                                         r"\(file c.jsonl\) is messages$"):
        load_job_dataset(source, FileStore(store_root), tmp_path / "work", seed=42)
