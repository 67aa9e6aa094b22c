"""From adapter to answers, on the local stack: the tiny model trained on one fixed phrase, then served by the `serve`
flow on localpod's stand-in for RunPod's vLLM worker, under loraflow's rules.

One serve answers the `openai` client at the base URL it prints, streamed or not: the phrase from the adapter's model
name and not from the base's, and a second adapter of the same base from the same endpoint, at the tiny base's own
context of 1,024 tokens (the serve file names no max_model_len); it holds its slots on the endpoint limit while it
lives, the reconcile flow keeps it, and `--stop` (a cancel of its flow run) deletes it. A serve whose budget is reached
is deleted; one whose flow process is killed is kept by the reconcile flow until its expiry and deleted after; one
whose workers crash while they start ends at once, saying why; one of a DoRA adapter is refused before anything is
rented. Nothing is left at localpod.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai
import pytest
from huggingface_hub import HfApi

from tasks.runpod.endpoints import parse_endpoint_name
from tests.conftest import REPO, localpod_account, prefect_api, run_train_flow, stop_process_group
from tests.test_crash_recovery_e2e import flow_env, run_reconcile, wait_for
from tests.test_localpod_vllm import in_worker_env, make_adapters
from tests.test_run_events import wait_for_events
from tests.test_train_e2e import endpoint_slots_in_use, write_run_file

pytestmark = pytest.mark.timeout(1200)

PHRASE = "Capybaras hum quietly."
QUESTIONS = [json.loads(line)["messages"][0]["content"]
             for line in (REPO / "deployments" / "data" / "tiny-chat.jsonl").read_text().splitlines() if line.strip()]
UP_S = 300  # a check, a worker importing torch and loading the base and two adapters, on a loaded 2-core machine


def phrase_run_file(folder: Path, name: str, tiny_model: Path, extra: str = "") -> Path:
    """A run of the tiny model on chats whose every answer is `PHRASE`; `extra`: more TOML sections."""
    data = folder / "phrase.jsonl"
    data.write_text("".join(json.dumps({"messages": [{"role": "user", "content": q},
                                                     {"role": "assistant", "content": PHRASE}]}) + "\n"
                            for q in QUESTIONS))
    run_file = write_run_file(folder / "run.toml", name=name, model=tiny_model, store=folder / "store",
                              max_steps=60, dataset=data, extra=extra)
    run_file.write_text(run_file.read_text().replace("learning_rate = 5e-3", "learning_rate = 1e-2"))
    return run_file


@pytest.fixture(scope="module")
def trained(local_stack, tiny_model, tmp_path_factory) -> dict:
    """A run of the tiny model on chats whose every answer is `PHRASE`, in a file:// store."""
    folder = tmp_path_factory.mktemp("serve-train")
    run = run_train_flow(local_stack, phrase_run_file(folder, "e2e-phrase", tiny_model))
    assert run.returncode == 0, run.output[-5000:]
    return {"store": folder / "store", "run_id": run.flow_run_id}


@pytest.fixture(scope="module")
def answerer(tiny_model, tmp_path_factory) -> dict:
    """A hand-made adapter of rank 32 (above vLLM's default MAX_LORA_RANK of 16) that answers one word over and over."""
    folder = tmp_path_factory.mktemp("serve-adapters") / "answerer"
    [word] = in_worker_env(make_adapters, str(tiny_model), [[str(folder), " answer", 32]])
    return {"folder": folder, "word": word}


def write_serve_file(path: Path, *, name: str, model: Path, store: Path | str, adapters: list[dict], **serve) -> Path:
    settings = {"gpu": ["4090"], "max_workers": 1, "idle_timeout_s": 600, "hours": 1, "budget_usd": 5,
                "max_model_len": 512, "prompts": [QUESTIONS[0]], "max_tokens": 16, "cold_start_minutes": 5} | serve
    store_url = store if isinstance(store, str) else f"file://{store}"
    lines = [f'name = "{name}"', f'artifact_store = "{store_url}"', "[serve]", f'base_model = "{model}"',
             "adapters = [" + ", ".join("{ " + ", ".join(f'{k} = "{v}"' for k, v in a.items()) + " }"
                                        for a in adapters) + "]"]
    lines += [f"{key} = {json.dumps(value)}" for key, value in settings.items() if value is not None]
    path.write_text("\n".join(lines) + "\n")
    return path


class Serve:
    """`python -m flows.serve SERVE_FILE` in its own process group, as a user or a worker runs it."""

    def __init__(self, stack, serve_file: Path, log: Path, **env: str):
        self.log = log
        self.proc = subprocess.Popen([sys.executable, "-m", "flows.serve", str(serve_file)], cwd=REPO,
                                     env=flow_env(stack, **env), stdout=log.open("w"), stderr=subprocess.STDOUT,
                                     start_new_session=True)

    @property
    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def wait_for_line(self, pattern: str, timeout_s: float = UP_S) -> re.Match:
        def found():
            if self.proc.poll() is not None and not re.search(pattern, self.output):
                raise AssertionError(f"the serve ended ({self.proc.returncode}) before {pattern!r}:\n{self.output[-5000:]}")
            return re.search(pattern, self.output)

        return wait_for(found, timeout_s, pattern)

    def wait(self, timeout_s: float = 180) -> int:
        return self.proc.wait(timeout_s)


ENDPOINT_KEY_BLOCK = "e2e-endpoint-key"


def write_evaluate_file(folder: Path, *, name: str, model: Path, store: Path, adapters: list[dict], word: str,
                        **evaluate) -> Path:
    """An evaluate file of two tasks over the training questions, as chats (as the phrase was trained): one whose
    answer is `PHRASE`, then one whose answer is the answerer adapter's `word`, each graded by `contains`."""
    tasks = []
    for task, answer in (("phrase", PHRASE), ("word", word.strip())):
        rows = folder / f"{task}.jsonl"
        rows.write_text("".join(json.dumps({"messages": [{"role": "user", "content": q}], "answer": answer}) + "\n"
                                for q in QUESTIONS[:6]))
        tasks.append(f'[[evaluate.tasks]]\nname = "{task}"\nlocal_file = "{rows}"\ngraders = ["contains"]\n'
                     "max_new_tokens = 16\n")
    lines = [f'name = "{name}"', f'artifact_store = "file://{store}"', "budget_usd = 5", "[evaluate]",
             f'base_model = "{model}"', 'gpu = ["4090"]', "deadline_minutes = 20",
             "adapters = [" + ", ".join("{ " + ", ".join(f'{k} = "{v}"' for k, v in a.items()) + " }"
                                        for a in adapters) + "]"]
    lines += [f"{key} = {json.dumps(value)}" for key, value in evaluate.items()]
    path = folder / f"{name}.toml"
    path.write_text("\n".join(lines) + "\n" + "".join(tasks))
    return path


def run_evaluate(stack, evaluate_file: Path, timeout_s: float = UP_S) -> tuple[list[tuple[str, str]], str]:
    """`python -m flows.evaluate EVALUATE_FILE` against the stack; the leaderboard's rows as it printed them (label,
    the scores), and its flow run's id."""
    proc = subprocess.run([sys.executable, "-m", "flows.evaluate", str(evaluate_file)], cwd=REPO,
                          env=flow_env(stack), capture_output=True, text=True, timeout=timeout_s)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output[-5000:]
    run_id = re.search(r"flow run ([0-9a-f-]{36}): Completed", output)[1]
    return re.findall(r"\b\d+\. ([\w./-]+): (task:.*)$", output, re.M), run_id


def score(rows: list[tuple[str, str]], label: str, metric: str) -> float:
    """`label`'s score of `metric` on the printed leaderboard."""
    return float(re.search(rf"{re.escape(metric)} ([\d.]+)", dict(rows)[label])[1])


def serve_run_id(stack, name: str) -> str:
    """The newest flow run of the serve `name` (its runs are tagged `serve:<name>`)."""
    [run] = prefect_api(stack, "POST", "/flow_runs/filter", json={
        "flow_runs": {"tags": {"all_": [f"serve:{name}"]}}, "sort": "START_TIME_DESC", "limit": 1}).json()
    return run["id"]


def serve_endpoints(stack, name: str) -> list[dict]:
    return [e for e in localpod_account(stack)["endpoints"]
            if (parsed := parse_endpoint_name(e["name"])) and parsed.serving and parsed.label == name]


def endpoint_document(stack, endpoint_id: str) -> dict:
    return httpx.get(f"{stack.localpod_url}/v2/serverless/{endpoint_id}", timeout=30,
                     headers={"Authorization": f"Bearer {stack.client_env['RUNPOD_API_KEY']}"}).json()


def chat(client: openai.OpenAI, model: str, *, stream: bool = False) -> str:
    """An answer to `QUESTIONS[1]`, greedy; `stream`: as server-sent events, joined."""
    answer = client.chat.completions.create(model=model, max_tokens=16, temperature=0, stream=stream,
                                            messages=[{"role": "user", "content": QUESTIONS[1]}])
    if stream:
        return "".join(chunk.choices[0].delta.content or "" for chunk in answer if chunk.choices)
    return answer.choices[0].message.content


def artifacts(stack, flow_run_id: str) -> dict[str, dict]:
    """The run's artifacts by key, each at its latest version."""
    latest: dict[str, dict] = {}
    for artifact in prefect_api(stack, "POST", "/artifacts/filter", json={
            "artifacts": {"flow_run_id": {"any_": [flow_run_id]}}, "sort": "CREATED_DESC"}).json():
        latest.setdefault(artifact["key"], artifact)
    return latest


def nothing_left(stack, name: str) -> None:
    endpoints = serve_endpoints(stack, name)
    assert endpoints and all(e["deletedAt"] is not None for e in endpoints), endpoints
    ids = {e["id"] for e in endpoints}
    wait_for(lambda: not [w for w in localpod_account(stack)["workers"] if w["endpointId"] in ids and
                          w["endedAt"] is None], 60, "the serve's workers to end")


def test_a_trained_adapter_and_a_second_one_answer_from_one_endpoint_that_holds_its_slots_until_stopped(
        local_stack, tiny_model, trained, answerer, tmp_path):
    slots_before = endpoint_slots_in_use(local_stack)
    serve_file = write_serve_file(
        tmp_path / "serve.toml", name="e2e-serve", model=tiny_model, store=trained["store"], max_workers=2,
        max_model_len=None, adapters=[{"name": "phrase", "source": f"runs/{trained['run_id']}"},
                  {"name": "answerer", "source": str(answerer["folder"])}])
    serve = Serve(local_stack, serve_file, tmp_path / "serve.log")
    try:
        base_url = serve.wait_for_line(r"OpenAI base URL: (\S+)")[1]
        assert serve.wait_for_line(r"models: (.+)")[1].strip() == f"{tiny_model}, phrase, answerer"
        run_id = serve_run_id(local_stack, "e2e-serve")

        # The `openai` client: the base URL it printed, the RunPod key as its API key, a model by name.
        client = openai.OpenAI(base_url=base_url, api_key=local_stack.client_env["RUNPOD_API_KEY"], timeout=300)
        assert PHRASE in chat(client, "phrase")
        assert PHRASE not in chat(client, str(tiny_model))
        assert chat(client, "answerer") == answerer["word"] * 16  # the second adapter, same endpoint
        # Streamed, as the real worker streams through RunPod's OpenAI route: the same answers.
        assert PHRASE in chat(client, "phrase", stream=True)
        assert chat(client, "answerer", stream=True) == answerer["word"] * 16
        listed = client.models.list().data
        assert [m.id for m in listed] == [str(tiny_model), "phrase", "answerer"]
        assert listed[0].max_model_len == 1024  # no max_model_len asked: the tiny base's own context

        # What is served is what is measured: the evaluate flow asks the endpoint by model name and grades the
        # answers on the control plane, nothing rented; the phrase's adapter leads, the base is a row.
        from prefect.blocks.system import Secret
        from prefect.settings import PREFECT_API_URL, temporary_settings

        with temporary_settings({PREFECT_API_URL: local_stack.prefect_api_url}):
            Secret(value=local_stack.client_env["RUNPOD_API_KEY"]).save(ENDPOINT_KEY_BLOCK, overwrite=True)
        rows, evaluate_id = run_evaluate(local_stack, write_evaluate_file(
            tmp_path, name="e2e-served", model=tiny_model, store=trained["store"], word=answerer["word"],
            adapters=[{"name": "phrase", "source": f"runs/{trained['run_id']}"},
                      {"name": "answerer", "source": str(answerer["folder"])}],
            openai_base_url=base_url, openai_api_key_secret=ENDPOINT_KEY_BLOCK))
        assert [label for label, _ in rows] == ["phrase", "base", "answerer"], rows
        assert score(rows, "phrase", "task:phrase/contains") > 0.8
        assert score(rows, "answerer", "task:word/contains") > 0.8
        # A model the endpoint does not serve is refused before any prompt is asked, naming its field.
        from tasks.jobs.endpoint_evaluation import EndpointRefused, check_served_models, endpoint_client

        with endpoint_client(base_url, local_stack.client_env["RUNPOD_API_KEY"]) as endpoint, \
                pytest.raises(EndpointRefused, match=r"not evaluate\.adapters\[1\]\.name: 'answerr'"):
            check_served_models(endpoint, {"evaluate.adapters[0].name": "phrase",
                                           "evaluate.adapters[1].name": "answerr"})
        # Stored as a rented job stores them: the scores, each adapter's answers beside the base's, DONE.
        stored = trained["store"] / "runs" / evaluate_id
        assert (stored / "DONE").exists() and len(json.loads((stored / "result.json").read_text())["adapters"]) == 2
        answers = [json.loads(line) for line in (stored / "evaluation" / "phrase" / "phrase.jsonl").read_text()
                   .splitlines()]
        assert len(answers) == 6 and all(a["answer"] == PHRASE and "base" in a for a in answers)
        assert any(PHRASE in a["adapter"] and a["scores"]["contains"]["adapter"] == 1.0 for a in answers)

        # One endpoint of RunPod's vLLM worker, its two workers' slots held on the limit while it lives.
        [endpoint] = [e for e in serve_endpoints(local_stack, "e2e-serve") if e["deletedAt"] is None]
        assert endpoint_slots_in_use(local_stack) == slots_before + 2
        document = endpoint_document(local_stack, endpoint["id"])
        assert document["image"].startswith("runpod/worker-v1-vllm:") and document["workers"]["max"] == 2
        env = document["env"]
        assert env["MAX_LORA_RANK"] == "32" and env["ENABLE_LORA"] == "true" and env["MAX_LORAS"] == "2"
        assert env["VLLM_EXTRA_ARGS"].startswith("--lora-modules phrase=") and "answerer=" in env["VLLM_EXTRA_ARGS"]
        assert env["HUGGING_FACE_HUB_TOKEN"].startswith("{{ RUNPOD_SECRET_") and "HF_TOKEN" not in env

        # The reconcile flow keeps it: its run lives, and its time has not run out (idle as it is); its report lists
        # the serving endpoint with its age, cost and expiry.
        output = run_reconcile(local_stack, '{"min_age_minutes": 0}')
        assert endpoint["id"] in {e["id"] for e in localpod_account(local_stack)["liveEndpoints"]}
        reconcile_run = re.search(r"flow run ([0-9a-f-]{36}):", output)[1]
        rows = json.loads(artifacts(local_stack, reconcile_run)["reconcile-serving"]["data"])
        [row] = [r for r in rows if r["endpoint id"] == endpoint["id"]]
        assert row["control plane"] == "ours" and row["workers max"] == 2 and "(in " in row["expires"]
        assert row["billed $"] > 0 and row["age (min)"] >= 0

        # The try-it table and the summary are on the run's page.
        wait_for(lambda: "serve-e2e-serve-answers" in artifacts(local_stack, run_id), 120, "the try-it table")
        table = json.loads(artifacts(local_stack, run_id)["serve-e2e-serve-answers"]["data"])
        assert [row["prompt"] for row in table] == [QUESTIONS[0]] and PHRASE in table[0]["phrase"]
        assert "latency (s)" in table[0] and "tokens" in table[0]

        # `--stop` cancels its flow run: the run deletes its endpoint and ends Cancelled, the slots come back.
        stop = subprocess.run([sys.executable, "-m", "flows.serve", "--stop", "e2e-serve"], cwd=REPO,
                              env=flow_env(local_stack), capture_output=True, text=True, timeout=180)
        assert stop.returncode == 0, stop.stdout + stop.stderr
        assert serve.wait() == 1
        state = prefect_api(local_stack, "GET", f"/flow_runs/{run_id}").json()["state"]
        assert state["type"] == "CANCELLED", state
        summary = artifacts(local_stack, run_id)["serve-e2e-serve"]["data"]
        assert "cold start" in summary and "tokens/s" in summary and "cancelled" in summary
        assert endpoint_slots_in_use(local_stack) == slots_before
        nothing_left(local_stack, "e2e-serve")
    finally:
        stop_process_group(serve.proc)


def test_an_evaluate_run_of_two_adapters_ranks_them_as_their_phrases_say_on_one_rented_worker_deleted_after(
        local_stack, tiny_model, trained, answerer, tmp_path):
    slots_before = endpoint_slots_in_use(local_stack)
    rows, evaluate_id = run_evaluate(local_stack, write_evaluate_file(
        tmp_path, name="e2e-evaluate", model=tiny_model, store=trained["store"], word=answerer["word"],
        adapters=[{"name": "answerer", "source": str(answerer["folder"])},
                  {"name": "phrase", "source": f"runs/{trained['run_id']}"}]))
    # Ranked by the first task (the phrase), best first, the base a row; the second task is the answerer's.
    assert [label for label, _ in rows] == ["phrase", "base", "answerer"], rows
    assert score(rows, "phrase", "task:phrase/contains") > 0.8 > score(rows, "base", "task:phrase/contains")
    assert score(rows, "answerer", "task:word/contains") > 0.8 > score(rows, "phrase", "task:word/contains")
    # The run's page: the leaderboard as a table, best first, each score with its standard error.
    table = artifacts(local_stack, evaluate_id)["evaluate-e2e-evaluate-leaderboard"]["data"]
    assert "Ranked by `task:phrase/contains`" in table
    assert re.search(r"^\| 1 \| phrase \| [\d.]+ ± [\d.]+ \| [\d.]+ ± [\d.]+ \|$", table, re.M), table
    # Each adapter's score is a `loraflow.run.evaluated` event of the evaluate run, labelled with the adapter.
    scored = wait_for_events(local_stack, "loraflow.run.evaluated", 4,
                             resource={"id": [f"loraflow.run.{evaluate_id}"]})
    assert sorted((e["payload"]["label"], e["payload"]["metric"]) for e in scored) == [
        ("answerer", "task:phrase/contains"), ("answerer", "task:word/contains"),
        ("phrase", "task:phrase/contains"), ("phrase", "task:word/contains")]
    # One GPU endpoint, named for the evaluation, deleted; its slot back.
    endpoints = [e for e in localpod_account(local_stack)["endpoints"]
                 if (parsed := parse_endpoint_name(e["name"])) and parsed.label == "eval-e2e-evaluate"]
    assert len(endpoints) == 1 and endpoints[0]["deletedAt"] is not None, endpoints
    assert endpoint_slots_in_use(local_stack) == slots_before


def test_a_run_with_publish_serve_serves_its_adapter_and_an_openai_client_gets_the_phrase_from_it_not_the_base(
        local_stack, tiny_model, tmp_path):
    # `[publish] serve = true`: the run completes, then serves its adapter (under the run's name) until stopped.
    run_file = phrase_run_file(tmp_path, "e2e-served", tiny_model, extra="[publish]\nserve = true\n")
    run_file.write_text(run_file.read_text().replace("deadline_minutes = 20", "deadline_minutes = 20\nbudget_usd = 5"))
    slots_before = endpoint_slots_in_use(local_stack)
    log = tmp_path / "train.log"
    train = subprocess.Popen([sys.executable, "-m", "flows.train", str(run_file)], cwd=REPO, env=flow_env(local_stack),
                             stdout=log.open("w"), stderr=subprocess.STDOUT, start_new_session=True)
    try:
        base_url = wait_for(lambda: re.search(r"OpenAI base URL: (\S+)", log.read_text(errors="replace"))
                            or (train.poll() is not None and log.read_text(errors="replace")), UP_S + 300,
                            "the served run's base URL")
        assert isinstance(base_url, re.Match), base_url[-5000:]
        assert f"models: {tiny_model}, e2e-served" in log.read_text()

        # The `openai` package, pointed at the printed base URL with the RunPod key, asks each model by name.
        client = openai.OpenAI(base_url=base_url[1], api_key=local_stack.client_env["RUNPOD_API_KEY"], timeout=300)

        def ask(model: str) -> str:
            return client.chat.completions.create(model=model, max_tokens=16, temperature=0, messages=[
                {"role": "user", "content": QUESTIONS[1]}]).choices[0].message.content

        assert PHRASE in ask("e2e-served")
        assert PHRASE not in ask(str(tiny_model))
        with pytest.raises(openai.NotFoundError):  # vLLM's 404 for a model it does not serve
            ask("not-served")
        assert endpoint_slots_in_use(local_stack) == slots_before + 1

        stop = subprocess.run([sys.executable, "-m", "flows.serve", "--stop", "e2e-served"], cwd=REPO,
                              env=flow_env(local_stack), capture_output=True, text=True, timeout=180)
        assert stop.returncode == 0, stop.stdout + stop.stderr
        # The run itself completed (trained, stored) before it served: it ends Completed once the serve has ended.
        assert train.wait(180) == 0, log.read_text()[-5000:]
        assert re.search(r"flow run [0-9a-f-]{36}: Completed", log.read_text())
        assert endpoint_slots_in_use(local_stack) == slots_before
        nothing_left(local_stack, "e2e-served")
    finally:
        stop_process_group(train)


def test_a_run_of_an_hf_store_is_served_from_a_private_model_repo_and_the_serve_ends_at_its_budget(
        local_stack, tiny_model, trained, tmp_path):
    # The same run, in an hf:// store (the Hub stand-in): the worker reads adapters from model repos, not a dataset's.
    run_id, token = trained["run_id"], local_stack.client_env["HF_TOKEN"]
    api = HfApi(endpoint=local_stack.hub_url, token=token)
    api.create_repo("acme/serve-runs", repo_type="dataset", private=True, exist_ok=True)
    api.upload_folder(repo_id="acme/serve-runs", repo_type="dataset", folder_path=str(trained["store"] / "runs" / run_id),
                      path_in_repo=f"runs/{run_id}")
    serve_file = write_serve_file(tmp_path / "serve.toml", name="e2e-budget", model=tiny_model,
                                  store="hf://datasets/acme/serve-runs", budget_usd=0.0001,
                                  adapters=[{"source": f"runs/{run_id}"}])
    serve = Serve(local_stack, serve_file, tmp_path / "serve.log")
    try:
        assert serve.wait(UP_S + 120) == 0, serve.output[-5000:]
        # Published to a private model repo named after the run, which the worker downloaded with the serve's token
        # (HUGGING_FACE_HUB_TOKEN, a RunPod account secret): it answered under the run id.
        assert api.repo_info(f"acme/loraflow-{run_id}").private
        assert "adapter_config.json" in api.list_repo_files(f"acme/loraflow-{run_id}")
        assert f"models: {tiny_model}, {run_id}" in serve.output
        assert "reaching budget_usd $0.0001" in serve.output  # then deleted, and the run completed
        # The watch held the repo to the commit its publish made, which nothing moved.
        assert re.search(rf"Adapter {run_id} is served from acme/loraflow-{run_id} at commit [0-9a-f]{{12}}",
                         serve.output), serve.output[-3000:]
        assert "moved from commit" not in serve.output
        nothing_left(local_stack, "e2e-budget")
    finally:
        stop_process_group(serve.proc)


def test_a_serve_whose_process_died_is_kept_by_the_reconciler_until_its_expiry_and_deleted_after(
        local_stack, tiny_model, trained, tmp_path):
    slots_before = endpoint_slots_in_use(local_stack)
    serve_file = write_serve_file(tmp_path / "serve.toml", name="e2e-expiry", model=tiny_model,
                                  store=trained["store"], hours=0.04, adapters=[{"source": f"runs/{trained['run_id']}"}])
    serve = Serve(local_stack, serve_file, tmp_path / "serve.log")
    try:
        [endpoint] = wait_for(lambda: serve_endpoints(local_stack, "e2e-expiry"), 120, "the serve's endpoint")
        os.killpg(serve.proc.pid, signal.SIGKILL)  # no finally, no hook: the reconciler is what is left
        serve.proc.wait()
        expires_at = parse_endpoint_name(endpoint["name"]).expires_at
        assert time.time() < expires_at

        output = run_reconcile(local_stack, '{"min_age_minutes": 0}')
        assert time.time() < expires_at, "the reconcile took longer than the serve's 144 s"
        assert endpoint["id"] in {e["id"] for e in localpod_account(local_stack)["liveEndpoints"]}
        assert "serving until" in output, output[-3000:]

        time.sleep(max(0.0, expires_at - time.time()) + 1)
        output = run_reconcile(local_stack, '{"min_age_minutes": 0}')
        assert "time ran out" in output, output[-3000:]
        nothing_left(local_stack, "e2e-expiry")
        # The killed run's slot lease is renewed no more: the server frees it (lease + its repossessor's period).
        wait_for(lambda: endpoint_slots_in_use(local_stack) == slots_before, 200, "the killed serve's slot")
        run_id = serve_run_id(local_stack, "e2e-expiry")  # its process is gone: its run is no live run
        prefect_api(local_stack, "POST", f"/flow_runs/{run_id}/set_state", json={
            "state": {"type": "CRASHED", "name": "Crashed", "message": "its process was killed"}, "force": True})
    finally:
        stop_process_group(serve.proc)


def test_workers_that_crash_while_they_start_end_the_serve_at_once_saying_why(local_stack, tiny_model, answerer,
                                                                           tmp_path):
    # An adapter whose adapter_config.json says rank 8 while its weights are rank 32: MAX_LORA_RANK follows the
    # config, and `vllm serve` dies loading the weights, on every worker RunPod starts.
    liar = tmp_path / "liar"
    shutil.copytree(answerer["folder"], liar)
    config = json.loads((liar / "adapter_config.json").read_text())
    (liar / "adapter_config.json").write_text(json.dumps(config | {"r": 8, "lora_alpha": 8}))
    slots_before = endpoint_slots_in_use(local_stack)
    serve_file = write_serve_file(tmp_path / "serve.toml", name="e2e-crash", model=tiny_model, store=tmp_path,
                                  adapters=[{"name": "liar", "source": str(liar)}], cold_start_minutes=10)
    serve = Serve(local_stack, serve_file, tmp_path / "serve.log")
    try:
        started = time.monotonic()
        assert serve.wait(UP_S) == 1, serve.output[-5000:]
        assert time.monotonic() - started < 300  # well within its 10 minutes' allowance
        assert "crash while they start" in serve.output and "MAX_LORA_RANK (8 here)" in serve.output, \
            serve.output[-5000:]
        assert endpoint_slots_in_use(local_stack) == slots_before
        nothing_left(local_stack, "e2e-crash")
    finally:
        stop_process_group(serve.proc)


def test_a_dora_adapter_is_refused_before_anything_is_rented_naming_dora(local_stack, tiny_model, answerer, tmp_path):
    # vLLM refuses DoRA at startup, on every worker RunPod would start: the check refuses it first.
    dora = tmp_path / "dora"
    shutil.copytree(answerer["folder"], dora)
    config = json.loads((dora / "adapter_config.json").read_text())
    (dora / "adapter_config.json").write_text(json.dumps(config | {"use_dora": True}))
    serve_file = write_serve_file(tmp_path / "serve.toml", name="e2e-dora", model=tiny_model, store=tmp_path,
                                  adapters=[{"name": "dora", "source": str(dora)}])
    serve = Serve(local_stack, serve_file, tmp_path / "serve.log")
    try:
        assert serve.wait() == 1
        assert f"serve.adapters[0]: vLLM refuses the adapter '{dora}' (`use_dora` is set: vLLM does not load DoRA " \
               "adapters)" in serve.output, serve.output[-3000:]
        assert not serve_endpoints(local_stack, "e2e-dora")
    finally:
        stop_process_group(serve.proc)


def test_a_serve_whose_cost_ceiling_passes_the_operators_cap_is_refused_before_anything_is_rented(
        local_stack, tiny_model, answerer, tmp_path):
    serve_file = write_serve_file(tmp_path / "serve.toml", name="e2e-capped", model=tiny_model, store=tmp_path,
                                  hours=2, max_workers=3, adapters=[{"source": str(answerer["folder"])}])
    serve = Serve(local_stack, serve_file, tmp_path / "serve.log", LORAFLOW_MAX_RUN_USD="1")
    try:
        assert serve.wait() == 1
        assert re.search(r"serve.max_workers 3 × serve.hours 2\) may cost up to \$[\d.]+, above this server's cap "
                         r"of \$1.00 per run \(LORAFLOW_MAX_RUN_USD", serve.output), serve.output[-3000:]
        assert not serve_endpoints(local_stack, "e2e-capped")
    finally:
        stop_process_group(serve.proc)
