"""A study end to end on the local stack: `python -m flows.study` as a user starts it, its children real train runs
of the tiny model on localpod; refused over its budget, or over the operator's cap on a study, before anything is
rented; cancelled from the CLI while its children train, served the Prefect way (`study.serve`, the runner a Prefect
worker uses); its children as runs of a served `train` deployment, the study's own process killed midway and the
study resumed, each child trained once; a losing child pruned at an evaluation; a TPE search whose children Optuna
picks, in an Optuna study on SQLite."""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
from huggingface_hub import HfApi
from prefect import get_client

from tasks.lifecycle.study_children import child_key, start_deployment_child
from tests.conftest import REPO, localpod_account, prefect_api, stop_process_group
from tests.test_cancel_e2e import LEASE_S, cancel_from_cli, state_of
from tests.test_crash_recovery_e2e import (
    flow_env,
    live_endpoints,
    running_job,
    slots_in_use,
    wait_for,
)
from tests.test_train_e2e import most_live_at_once, write_run_file

pytestmark = pytest.mark.timeout(900)


def write_study_file(path, *, name, tiny_model, store, study: str, max_steps: int = 8, every_steps: int = 4):
    return write_run_file(path, name=name, model=tiny_model, store=store, max_steps=max_steps,
                          extra=f"[evaluation]\nfraction = 0.2\nevery_steps = {every_steps}\n[study]\n" + study)


def run_study(stack, run_file, timeout_s: float = 600, **env) -> tuple[int, str, str | None]:
    proc = subprocess.run([sys.executable, "-m", "flows.study", str(run_file)], check=False, cwd=REPO,
                          env=flow_env(stack, **env), capture_output=True, text=True, timeout=timeout_s)
    output = proc.stdout + proc.stderr
    match = re.search(r"flow run ([0-9a-f-]{36}):", output)
    return proc.returncode, output, match.group(1) if match else None


def children_of(stack, study_run_id: str) -> list[dict]:
    return prefect_api(stack, "POST", "/flow_runs/filter", json={
        "flow_runs": {"tags": {"all_": [f"study-run:{study_run_id}"]}}}).json()


def artifact(stack, key: str) -> dict:
    (found,) = prefect_api(stack, "POST", "/artifacts/filter", json={"artifacts": {"key": {"any_": [key]}},
                                                                       "sort": "CREATED_DESC", "limit": 1}).json()
    return found


def two_live(stack, prefix: str) -> list[dict]:
    """The two live endpoints whose names start with `prefix`; empty until there are two."""
    live = live_endpoints(stack, prefix)
    return live if len(live) == 2 else []


def study_endpoints(stack, name: str) -> list[dict]:
    return [e for e in localpod_account(stack)["endpoints"] if e["name"].startswith(f"loraflow-{name}-")]


def test_two_learning_rates_by_two_seeds_run_as_four_children_two_at_a_time_and_the_best_is_named(
        local_stack, tiny_model, tmp_path):
    run_file = write_study_file(tmp_path / "study.toml", name="e2e-study", tiny_model=tiny_model,
                                store=tmp_path / "store", study='grid = {"training.learning_rate" = [5e-3, 1e-4]}\n'
                                'seeds = [1, 2]\nparallel = 2\nbudget_usd = 50\npublish_best = true\n')
    run_file.write_text(run_file.read_text() + '[publish]\nhub_model_id = "acme/e2e-study-best"\n'
                        'merged_model_id = "acme/e2e-study-best-merged"\n')
    code, output, study_id = run_study(local_stack, run_file)
    assert code == 0, output[-6000:]

    children = children_of(local_stack, study_id)
    assert sorted(c["name"].split("-tiny-model")[0] for c in children) == [
        "e2e-study-lr0p0001-s1", "e2e-study-lr0p0001-s2", "e2e-study-lr0p005-s1", "e2e-study-lr0p005-s2"], children
    assert all(c["state"]["type"] == "COMPLETED" and "study:e2e-study" in c["tags"] for c in children), children
    endpoints = study_endpoints(local_stack, "e2e-study")
    assert len(endpoints) == 4 and all(e["deletedAt"] for e in endpoints), endpoints
    assert most_live_at_once(endpoints) <= 2, endpoints
    assert slots_in_use(local_stack) == 0

    table = json.loads(artifact(local_stack, "study-e2e-study-table")["data"])
    assert len(table) == 4 and all(row["state"] == "completed" and row["eval_loss"] != "" for row in table), table
    (best,) = [row for row in table if row["child"].endswith("(best)")]
    assert best["eval_loss"] == min(row["eval_loss"] for row in table)
    # The higher rate learns the tiny dataset faster in 8 steps: the study picks what the model learnt.
    assert "lr0p005" in best["child"], table
    summary = artifact(local_stack, "study-e2e-study")["data"]
    assert f"**Best child: {best['child'].removesuffix(' (best)')}**" in summary
    assert "data:image/png;base64," in summary  # the children's eval curves, overlaid
    assert all(row["cost (USD)"] != "" for row in table), table

    def study_finished():
        return prefect_api(local_stack, "POST", "/events/filter", json={"filter": {
            "event": {"name": ["loraflow.study.finished"]},
            "resource": {"id": [f"loraflow.study.{study_id}"]}}, "limit": 1}).json()["events"]

    (event,) = wait_for(study_finished, 60, "loraflow.study.finished")
    payload = event["payload"]
    assert payload["status"] == "completed" and payload["states"] == {"completed": 4}, payload
    assert payload["best"]["name"] == best["child"].removesuffix(" (best)"), payload

    # publish_best: the best child's adapter, and it merged into its base, published; no child published its own.
    assert payload["published_model"] == "acme/e2e-study-best", payload
    assert payload["merged_model"] == "acme/e2e-study-best-merged", payload
    hub = HfApi(endpoint=local_stack.hub_url, token=local_stack.client_env["HF_TOKEN"])
    best_run_id = payload["best"]["flow_run_id"]
    titles = [c.title for c in hub.list_repo_commits("acme/e2e-study-best")]
    published = [t for t in titles if t.startswith("loraflow run")]
    assert published == [f"loraflow run {best_run_id}: adapter and model card"], titles
    card = hub.hf_hub_download("acme/e2e-study-best-merged", "README.md")
    assert best_run_id in Path(card).read_text() and "acme/e2e-study-best" in Path(card).read_text()


def test_a_study_whose_children_each_cost_more_than_its_budget_is_refused_before_any_endpoint_exists(
        local_stack, tiny_model, tmp_path):
    run_file = write_study_file(tmp_path / "study.toml", name="e2e-study-budget", tiny_model=tiny_model,
                                store=tmp_path / "store", study="seeds = [1, 2, 3]\nbudget_usd = 0.2\n")
    code, output, study_id = run_study(local_stack, run_file)
    assert code == 1, output[-4000:]
    assert re.search(r"3 of the study's 3 children may each cost more than study.budget_usd \$0.20 alone .*could "
                     r"never start: nothing was rented", output), output[-4000:]
    assert study_endpoints(local_stack, "e2e-study-budget") == []
    assert children_of(local_stack, study_id) == []


def test_a_study_whose_children_each_pass_the_run_cap_but_together_pass_the_study_cap_starts_no_child(
        local_stack, tiny_model, tmp_path):
    # Each child passes LORAFLOW_MAX_RUN_USD; the study names no budget, and sixteen of them pass the study's cap.
    run_file = write_study_file(tmp_path / "study.toml", name="e2e-study-cap", tiny_model=tiny_model,
                                store=tmp_path / "store", study=f"seeds = {list(range(1, 17))}\nparallel = 2\n")
    code, output, study_id = run_study(local_stack, run_file, LORAFLOW_MAX_RUN_USD="100", LORAFLOW_MAX_STUDY_USD="1")
    assert code == 1, output[-4000:]
    assert re.search(r"the study may cost up to \$[\d.]+ \(its 16 children's cost ceilings together.* above this "
                     r"server's cap of \$1.00 per study \(LORAFLOW_MAX_STUDY_USD", output), output[-4000:]
    assert children_of(local_stack, study_id) == []  # no child flow run was created
    assert study_endpoints(local_stack, "e2e-study-cap") == []
    assert not (tmp_path / "store").exists()


def test_a_study_naming_a_field_a_child_cannot_take_is_refused_naming_the_child(local_stack, tiny_model, tmp_path):
    run_file = write_study_file(tmp_path / "study.toml", name="e2e-study-bad", tiny_model=tiny_model,
                                store=tmp_path / "store", study='grid = {"lora.rank" = [8, 4096]}\n')
    code, output, study_id = run_study(local_stack, run_file)
    assert code == 1 and "child 2 (lora.rank=4096)" in output and "lora.rank" in output, output[-4000:]
    assert study_endpoints(local_stack, "e2e-study-bad") == [] and children_of(local_stack, study_id) == []


def test_a_study_whose_dataset_file_is_missing_is_refused_before_any_child_starts(local_stack, tiny_model, tmp_path):
    run_file = write_study_file(tmp_path / "study.toml", name="e2e-study-nofile", tiny_model=tiny_model,
                                store=tmp_path / "store", study='grid = {"training.learning_rate" = [5e-3, 1e-4]}\n')
    missing = tmp_path / "no-such-chats.jsonl"
    run_file.write_text(re.sub(r'local_file = ".*"', f'local_file = "{missing}"', run_file.read_text(), count=1))
    code, output, study_id = run_study(local_stack, run_file)
    assert code == 1, output[-4000:]
    # The children share their files: read once, refused once, naming the first child that names them.
    assert re.search(rf"1 child run\(s\) would be refused for their files, so nothing was started:\n"
                     rf"  - child 1 \(training.learning_rate=0.005\): dataset.local_file {missing} does not exist",
                     output), output[-4000:]
    assert children_of(local_stack, study_id) == [] and study_endpoints(local_stack, "e2e-study-nofile") == []


def test_cancelling_a_served_study_cancels_its_training_children_and_leaks_nothing(local_stack, tiny_model,
                                                                                  tmp_path):
    log_path = tmp_path / "serve.log"
    env = flow_env(local_stack, LORAFLOW_SLOT_LEASE_SECONDS=LEASE_S, LORAFLOW_HEARTBEAT_SECONDS=5)
    proc = subprocess.Popen([sys.executable, "-c", "from flows.study import study; study.serve(name='e2e')"],
                            cwd=REPO, env=env, stdout=log_path.open("wb"), stderr=subprocess.STDOUT,
                            start_new_session=True)
    try:
        deployment = wait_for(lambda: _deployment(local_stack) or proc.poll() is not None, 120, "the deployment")
        assert proc.poll() is None, log_path.read_text()
        run_file = write_study_file(tmp_path / "study.toml", name="e2e-study-cancel", tiny_model=tiny_model,
                                    store=tmp_path / "store", max_steps=100_000,
                                    study="seeds = [1, 2, 3]\nparallel = 2\n")
        spec = tomllib.loads(run_file.read_text())
        study_id = prefect_api(local_stack, "POST", f"/deployments/{deployment}/create_flow_run",
                               json={"parameters": {"spec": spec}}).json()["id"]
        endpoints = wait_for(lambda: two_live(local_stack, "loraflow-e2e-study-cancel-"), 240, "two children's endpoints")
        wait_for(lambda: running_job(local_stack, {e["id"] for e in endpoints}), 180, "a child to train")

        cancel_from_cli(local_stack, study_id)
        wait_for(lambda: state_of(local_stack, study_id)["type"] == "CANCELLED", 120, "the study to be cancelled")
        wait_for(lambda: not live_endpoints(local_stack, "loraflow-e2e-study-cancel-"), 120,
                 "the children's endpoints to be deleted")
        children = children_of(local_stack, study_id)
        assert len(children) == 2 and all(c["state"]["type"] == "CANCELLED" for c in children), children
        wait_for(lambda: slots_in_use(local_stack) == 0, LEASE_S + 30, "every slot to be free")
        assert len(study_endpoints(local_stack, "e2e-study-cancel")) == 2  # the third child never started
    finally:
        stop_process_group(proc)


def _deployment(stack, name: str = "study/e2e") -> str | None:
    import httpx

    response = httpx.get(f"{stack.prefect_api_url}/deployments/name/{name}", timeout=10)
    return response.json()["id"] if response.status_code == 200 else None


def test_cancelling_a_study_started_from_a_shell_cancels_its_children_and_leaks_nothing(local_stack, tiny_model,
                                                                                        tmp_path):
    # No runner watches a study started as `python -m flows.study`: the study sees its own cancel and passes it on.
    run_file = write_study_file(tmp_path / "study.toml", name="e2e-study-shell", tiny_model=tiny_model,
                                store=tmp_path / "store", max_steps=100_000, study="seeds = [1, 2, 3]\nparallel = 2\n")
    log = (tmp_path / "study.log").open("wb")
    proc = subprocess.Popen([sys.executable, "-m", "flows.study", str(run_file)], cwd=REPO,
                            env=flow_env(local_stack, LORAFLOW_SLOT_LEASE_SECONDS=LEASE_S), stdout=log,
                            stderr=subprocess.STDOUT, start_new_session=True)
    try:
        endpoints = wait_for(lambda: two_live(local_stack, "loraflow-e2e-study-shell-"), 240, "two children's endpoints")
        wait_for(lambda: running_job(local_stack, {e["id"] for e in endpoints}), 180, "a child to train")
        (study,) = prefect_api(local_stack, "POST", "/flow_runs/filter", json={
            "flow_runs": {"name": {"like_": "e2e-study-shell study"}}}).json()

        cancel_from_cli(local_stack, study["id"])
        assert proc.wait(timeout=180) == 1, (tmp_path / "study.log").read_text()[-4000:]
        assert state_of(local_stack, study["id"])["type"] == "CANCELLED"
        children = children_of(local_stack, study["id"])
        assert len(children) == 2 and all(c["state"]["type"] == "CANCELLED" for c in children), children
        assert not live_endpoints(local_stack, "loraflow-e2e-study-shell-")
        assert len(study_endpoints(local_stack, "e2e-study-shell")) == 2  # the third child never started
        wait_for(lambda: slots_in_use(local_stack) == 0, LEASE_S + 30, "every slot to be free")
    finally:
        stop_process_group(proc)


def test_the_local_demo_runs_the_shipped_study_file_and_checks_the_best_adapter(tmp_path):
    demo = subprocess.run([sys.executable, "deployments/local.py", "--home", str(tmp_path / "home"), "--run-file",
                           "deployments/local-study.toml"], check=False, cwd=REPO, capture_output=True, text=True,
                          timeout=600)
    assert demo.returncode == 0, demo.stdout[-4000:] + demo.stderr[-4000:]
    rows = [line.split() for line in demo.stdout.splitlines() if " local-study-lr" in line]
    assert len(rows) == 4 and all("completed" in row for row in rows), demo.stdout[-3000:]
    (best,) = [row for row in rows if row[0] == "best"]
    assert best[1].startswith("local-study-lr0p005-"), rows  # the higher rate learns the tiny data in 30 steps
    # Picked by the shipped file's task: the best child's adapter answers the most questions with the trained phrase.
    scores = {row[-4]: float(row[-1]) for row in rows if row[-2] == "task:capitals/contains"}
    assert len(scores) == 4 and float(best[-1]) == max(scores.values()), rows
    assert float(best[-1]) > max(score for name, score in scores.items() if "lr0p0001" in name), rows
    assert "best adapter:" in demo.stdout and "(loads with PEFT onto" in demo.stdout


def test_a_study_of_deployment_children_killed_midway_and_resumed_adopts_them_and_trains_each_child_once(
        local_stack, tiny_model, tmp_path, figures):
    # `train` served the Prefect way (the runner a worker uses): the children are its runs, each in a process of its
    # own. One at a time, so that the kill finds one child completed, one training and one not started.
    serve_log = tmp_path / "serve.log"
    server = subprocess.Popen([sys.executable, "-c", "from flows.train import train; train.serve(name='e2e-study')"],
                              cwd=REPO, env=flow_env(local_stack), stdout=serve_log.open("wb"),
                              stderr=subprocess.STDOUT, start_new_session=True)
    study_log, study = tmp_path / "study.log", None
    try:
        deployment = wait_for(lambda: _deployment(local_stack, "train/e2e-study") or server.poll() is not None, 120,
                              "the served train deployment")
        assert server.poll() is None, serve_log.read_text()
        run_file = write_run_file(
            tmp_path / "study.toml", name="e2e-resume", model=tiny_model, store=tmp_path / "store",
            extra='[evaluation]\nfraction = 0.2\nevery_steps = 100\n[study]\n'
                  'grid = { "training.max_steps" = [4, 400, 6] }\nparallel = 1\nbudget_usd = 50\n'
                  'deployment = "train/e2e-study"\n')
        study = subprocess.Popen([sys.executable, "-m", "flows.study", str(run_file)], cwd=REPO,
                                 env=flow_env(local_stack), stdout=study_log.open("wb"), stderr=subprocess.STDOUT,
                                 start_new_session=True)
        started = wait_for(lambda: re.search(r"study flow run ([0-9a-f-]{36}): starting", study_log.read_text())
                           or study.poll() is not None, 120, "the study to print its flow run id")
        assert study.poll() is None, study_log.read_text()[-4000:]
        study_id = started.group(1)
        keys = [child_key(study_id, i, {"training.max_steps": steps}) for i, steps in ((1, 4), (2, 400), (3, 6))]

        def second_child_training():
            runs = {c["idempotency_key"]: c for c in children_of(local_stack, study_id)}
            first, second = runs.get(keys[0]), runs.get(keys[1])
            if first is None or second is None or first["state"]["type"] != "COMPLETED":
                return None
            endpoints = {e["id"] for e in study_endpoints(local_stack, "e2e-resume-ms400")}
            return second if running_job(local_stack, endpoints) else None

        second = wait_for(second_child_training, 300, "the first child to complete and the second to train")
        study.send_signal(signal.SIGTERM)  # the study's process stops (its host, say): the study ends Crashed
        assert study.wait(timeout=120) != 0, study_log.read_text()[-4000:]
        assert state_of(local_stack, study_id)["type"] == "CRASHED"
        # Its crash is not the children's: the deployment child trains on in its own process.
        assert state_of(local_stack, second["id"])["type"] in {"RUNNING", "COMPLETED"}, second
        assert len(children_of(local_stack, study_id)) == 2  # the third never started

        resumed = subprocess.run([sys.executable, "-m", "flows.study", str(run_file), "--resume", study_id], cwd=REPO,
                                 env=flow_env(local_stack), capture_output=True, text=True, timeout=600)
        output = resumed.stdout + resumed.stderr
        assert resumed.returncode == 0, output[-6000:]
        adopted = re.search(r"Resumed: 2 child run\(s\) found; adopting [12] completed, 0 pruned and [01] still running; "
                            r"1 to start", output)
        assert adopted, output[-6000:]
        figures(f"study resumed after its process was killed: {adopted.group(0)}")
    finally:
        stop_process_group(server)
        if study is not None:
            stop_process_group(study)

    assert state_of(local_stack, study_id)["type"] == "COMPLETED"
    children = children_of(local_stack, study_id)
    # One run per child, each a run of the deployment, a subflow of the study, keyed by the study, its place and its
    # values.
    assert sorted(c["idempotency_key"] for c in children) == sorted(keys), children
    assert all(c["state"]["type"] == "COMPLETED" and c["deployment_id"] == deployment and c["parent_task_run_id"]
               and f"study-run:{study_id}" in c["tags"] for c in children), children
    # The child started after the resume has a tracking task of its own, not an earlier child's.
    assert len({c["parent_task_run_id"] for c in children}) == 3, children
    # No child trained twice: localpod ran one job per child, and every endpoint is gone.
    endpoints = study_endpoints(local_stack, "e2e-resume")
    jobs = [j for j in localpod_account(local_stack)["jobs"] if j["endpointId"] in {e["id"] for e in endpoints}]
    assert len(jobs) == 3 and len(endpoints) == 3 and all(e["deletedAt"] for e in endpoints), (jobs, endpoints)
    table = json.loads(artifact(local_stack, "study-e2e-resume-table")["data"])
    assert sorted(row["child"].removesuffix(" (best)") for row in table) == [
        "e2e-resume-ms4", "e2e-resume-ms400", "e2e-resume-ms6"], table
    assert all(row["state"] == "completed" and row["eval_loss"] != "" for row in table), table


def test_deployment_children_started_after_a_resume_each_get_a_tracking_task_of_their_own(local_stack):
    """A study resumed in a new process starts its children from a fresh flow run context: each child's place in the
    study's graph (its tracking task run) must still be its own, not an earlier child's."""
    from prefect import flow
    from prefect.flow_engine import run_flow
    from prefect.settings import PREFECT_API_URL, temporary_settings

    flow_id = prefect_api(local_stack, "POST", "/flows/", json={"name": "e2e-tracked-child"}).json()["id"]
    prefect_api(local_stack, "POST", "/deployments/", json={"name": "never-run", "flow_id": flow_id})
    tag = "e2e-tracked-children"

    @flow(name="e2e-tracking-study")
    def study_like(keys: list[str], crash: bool) -> None:
        for key in keys:
            start_deployment_child("e2e-tracked-child/never-run", {}, [tag], key)
        if crash:
            raise RuntimeError("the study's process ends")

    with temporary_settings({PREFECT_API_URL: local_stack.prefect_api_url}):
        first = study_like(["s:1", "s:2"], crash=True, return_state=True)
        assert first.is_failed()
        flow_run_id = first.state_details.flow_run_id
        with get_client(sync_client=True) as client:
            resumed = run_flow(study_like, flow_run=client.read_flow_run(flow_run_id),
                               parameters={"keys": ["s:3"], "crash": False}, return_type="state")
        assert resumed.is_completed()
    children = prefect_api(local_stack, "POST", "/flow_runs/filter", json={
        "flow_runs": {"tags": {"all_": [tag]}}}).json()
    tracking = {c["idempotency_key"]: c["parent_task_run_id"] for c in children}
    assert sorted(tracking) == ["s:1", "s:2", "s:3"] and None not in tracking.values(), children
    assert len(set(tracking.values())) == 3, tracking
    for task_run_id in tracking.values():
        assert prefect_api(local_stack, "GET", f"/task_runs/{task_run_id}").json()["flow_run_id"] == str(flow_run_id)


def study_finished_event(stack, study_id: str) -> dict:
    def found():
        return prefect_api(stack, "POST", "/events/filter", json={"filter": {
            "event": {"name": ["loraflow.study.finished"]},
            "resource": {"id": [f"loraflow.study.{study_id}"]}}, "limit": 1}).json()["events"]

    (event,) = wait_for(found, 60, "loraflow.study.finished")
    return event


def test_a_study_that_prunes_cancels_its_losing_child_at_an_evaluation_and_counts_what_it_cost(
        local_stack, tiny_model, tmp_path, figures):
    # A learning rate of 1e-7 leaves the tiny model where it started; 5e-3 learns it: after two evaluations since the
    # first step the loser is plainly above the other child's loss, and is cancelled long before its last step. The
    # tiny model trains ~20 steps a second here alone: 1,200 steps give the study's 5 s polls time to see it.
    max_steps, every_steps = 1200, 40
    run_file = write_study_file(tmp_path / "study.toml", name="e2e-prune", tiny_model=tiny_model,
                                store=tmp_path / "store", max_steps=max_steps, every_steps=every_steps,
                                study='grid = { "training.learning_rate" = [5e-3, 1e-7] }\nparallel = 2\n'
                                      'prune = { rule = "median", after_evals = 2, startup_children = 0 }\n')
    code, output, study_id = run_study(local_stack, run_file)
    assert code == 0, output[-6000:]

    table = {row["child"].removesuffix(" (best)"): row
             for row in json.loads(artifact(local_stack, "study-e2e-prune-table")["data"])}
    winner, loser = table["e2e-prune-lr0p005"], table["e2e-prune-lr1em07"]
    assert winner["state"] == "completed" and loser["state"] == "pruned", table
    step = int(re.match(r"pruned at step (\d+): eval_loss [0-9.]+ \(its best by then\) was worse than the median "
                        r"[0-9.]+ of 1 other child\(ren\) at that step", loser["reason"]).group(1))
    # Pruned before its end; how early depends on this machine's load (the study sees evaluations as the child's
    # polls send them): what it saved is the cost below.
    assert 2 * every_steps <= step < max_steps, loser
    children = {c["name"].split("-tiny-model")[0]: c for c in children_of(local_stack, study_id)}
    pruned_run = children["e2e-prune-lr1em07"]
    assert pruned_run["state"]["type"] == "CANCELLED" and f"study-pruned:{step}" in pruned_run["tags"], pruned_run
    assert children["e2e-prune-lr0p005"]["state"]["type"] == "COMPLETED"
    # Its job cancelled and its endpoint deleted; what it ran is counted, less than the child that trained to the end.
    endpoints = study_endpoints(local_stack, "e2e-prune")
    assert len(endpoints) == 2 and all(e["deletedAt"] for e in endpoints), endpoints
    assert slots_in_use(local_stack) == 0
    # Counted, and no more than the child that trained to the end: under load, the cancel (an event read, the child's
    # watch, its job cancelled) can take as long as the winner's last steps (bench/study.py measures the saving).
    assert 0 < loser["cost (USD)"] <= winner["cost (USD)"], table
    event = study_finished_event(local_stack, study_id)
    assert event["payload"]["states"] == {"completed": 1, "pruned": 1}, event["payload"]
    assert event["payload"]["cost_usd"] == round(loser["cost (USD)"] + winner["cost (USD)"], 4), event["payload"]
    figures(f"study prune: the loser pruned at step {step} of {max_steps}, cost ${loser['cost (USD)']} against the "
            f"winner's ${winner['cost (USD)']}")


def test_a_tpe_search_asks_optuna_for_each_child_and_tells_it_how_each_ended(local_stack, tiny_model, tmp_path):
    import optuna

    storage = f"sqlite:///{tmp_path / 'optuna.db'}"
    run_file = write_study_file(tmp_path / "study.toml", name="e2e-tpe", tiny_model=tiny_model,
                                store=tmp_path / "store", max_steps=4,
                                study='search = "tpe"\ntrials = 3\nparallel = 3\nspace = { '
                                      '"training.learning_rate" = { low = 1e-4, high = 1e-2, log = true }, '
                                      '"lora.rank" = [4, 8] }\n')
    code, output, study_id = run_study(local_stack, run_file, LORAFLOW_OPTUNA_STORAGE=storage)
    assert code == 0, output[-6000:]

    children = {c["name"].split("-tiny-model")[0]: c for c in children_of(local_stack, study_id)}
    assert sorted(children) == ["e2e-tpe-c1", "e2e-tpe-c2", "e2e-tpe-c3"], children
    assert all(c["state"]["type"] == "COMPLETED" for c in children.values()), children
    for child in children.values():
        spec = child["parameters"]["spec"]
        assert 1e-4 <= spec["training"]["learning_rate"] <= 1e-2 and spec["lora"]["rank"] in (4, 8), spec
    # A real Optuna study, named after the study and its flow run: each trial told its child's final eval loss.
    search = optuna.load_study(study_name=f"e2e-tpe-{study_id}", storage=storage)
    rows = json.loads(artifact(local_stack, "study-e2e-tpe-table")["data"])
    table = {row["child"].removesuffix(" (best)"): row for row in rows}
    trials = {t.user_attrs["child"]: t for t in search.get_trials()}
    assert sorted(trials) == sorted(children) and all(t.state.name == "COMPLETE" for t in trials.values()), trials
    for name, trial in trials.items():
        assert trial.user_attrs["flow_run_id"] == children[name]["id"]
        assert round(trial.value, 4) == table[name]["eval_loss"], (trial, table[name])
        spec = children[name]["parameters"]["spec"]
        assert trial.params == {"training.learning_rate": spec["training"]["learning_rate"],
                                "lora.rank": spec["lora"]["rank"]}
    (best,) = [row["child"].removesuffix(" (best)") for row in rows if row["child"].endswith("(best)")]
    assert search.best_trial.user_attrs["child"] == best

    # The study's process gone after its children ended (a crash), and the study resumed where its Optuna file is not
    # (another folder, another machine): its trials are rebuilt from its children's runs, each with the values it
    # trained, and adopted; no trial is asked again with other values, no child trained again.
    prefect_api(local_stack, "POST", f"/flow_runs/{study_id}/set_state",
                json={"state": {"type": "CRASHED", "name": "Crashed"}, "force": True})
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    resumed = subprocess.run([sys.executable, "-m", "flows.study", str(run_file), "--resume", study_id], cwd=REPO,
                             env=flow_env(local_stack, LORAFLOW_OPTUNA_STORAGE=f"sqlite:///{elsewhere / 'optuna.db'}"),
                             capture_output=True, text=True, timeout=600)
    output = resumed.stdout + resumed.stderr
    assert resumed.returncode == 0, output[-6000:]
    assert "lacked 3 trial(s) this study's children ran: rebuilt from their runs' values" in output, output[-6000:]
    assert sorted(c["id"] for c in children_of(local_stack, study_id)) == sorted(c["id"] for c in children.values())
    rebuilt = {t.user_attrs["child"]: t for t in optuna.load_study(
        study_name=f"e2e-tpe-{study_id}", storage=f"sqlite:///{elsewhere / 'optuna.db'}").get_trials()}
    assert sorted(rebuilt) == sorted(children), rebuilt
    for name, trial in rebuilt.items():
        assert trial.params == trials[name].params and trial.state.name == "COMPLETE", (trial, trials[name])
        assert trial.value == trials[name].value and trial.user_attrs["flow_run_id"] == children[name]["id"]
