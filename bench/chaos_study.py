"""The chaos scenario of a study (`flow = "study"` in `bench/chaos_scenarios.py`): a grid of three learning rates
whose children are runs of a `train` deployment (`study.deployment`), one at a time; the first child's workers find
no CUDA (it fails, its cost counted), the study's own process is SIGKILLed while the second child trains (its host
lost), and the study is resumed in its own flow run (`python -m flows.study RUN_FILE --resume ID`). The study runs
from a shell, as a person starts and resumes one; its children run on the team's workers (`train/chaos`), or, without
the team setup, on a `train` deployment this scenario serves for itself (`train.serve`, the runner a worker uses).

    record = run_study_scenario(stack, pod, SCENARIOS["study-resume"], name=..., here=..., model=model,
                                timeout_s=900, flows=flows)

`study_problems` judges it: no child handed a run trained with other values, every child accounted for (one
completed run each, no child trained twice), the resumed study completed with its earlier starts' cost in its budget
and the failed child's row, nothing left live.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from bench.chaos_lib import (DATASET, REPO, Localpod, PrefectApi, RunRecord, WhenTraining, runpod_api, wait_for,
                             write_run_file)
from bench.chaos_scenarios import Scenario
from localpod.models import Account
from tasks.lifecycle.study_children import child_key
from tasks.reports.events import RUN_FINISHED, RUN_RESOURCE

RATES = (1e-4, 5e-4, 2e-3)
"""The grid's learning rates, one child each, in the study's order."""
CHILD_STEPS = 12
"""Each child's training steps, whatever the batch's `--max-steps`: the scenario's length is its own (its steps last
`STEP_SECONDS` each, which the scenario's worker fault sets), so that the kill meets the second child training."""
KILL_AT_STEP = 2
"""The second child's training step at which the study's process is killed."""
SHUTDOWN_S = 60
ZOMBIE_MESSAGE = "No heartbeat for"
"""The start of the state message of a run the team stack's zombie automation marked Crashed: its worker host died
(the batch's host kill may take a study's child with it)."""


@dataclass
class StudyFindings:
    """What a study scenario did and what the study left: read from localpod, the Prefect server and the outputs."""

    study_run_id: str | None = None
    killed: bool = False
    """The study's process was SIGKILLed while a child trained."""
    resume_returncode: int | None = None
    children: list[dict[str, Any]] = field(default_factory=list)
    """Every child flow run of the study: `id`, `name`, `key` (its idempotency key), `state`, `message`,
    `learning_rate` (what its spec trained)."""
    rows: list[dict[str, Any]] = field(default_factory=list)
    """The study's table artifact, one row per child."""
    costs: dict[str, float | None] = field(default_factory=dict)
    """Child flow run id → its `loraflow.run.finished` cost (None: the event named none)."""


def write_study_file(path: Path, scenario: Scenario, *, name: str, model: Path, store: Path, deployment: str,
                     dataset: Path = DATASET, token_block: str | None = None) -> Path:
    """The scenario's study file: the chaos run file (the tiny model, `CHILD_STEPS` steps) with a `[study]` of the
    three `RATES`, one child at a time, judged by `train_loss`, its children runs of `deployment`."""
    text = write_run_file(path, scenario, name=name, model=model, store=store, max_steps=CHILD_STEPS).read_text()
    text = text.replace(f'local_file = "{DATASET}"', f'local_file = "{dataset}"')
    if token_block is not None:  # a top-level key: before the first table
        text = text.replace("\n[model]\n", f'\nhub_token_secret = "{token_block}"\n[model]\n', 1)
    text += ("[study]\n"
             f'grid = {{ "training.learning_rate" = {json.dumps(list(RATES))} }}\n'
             'parallel = 1\nbudget_usd = 50\nmetric = "train_loss"\n'
             f'deployment = "{deployment}"\n')
    path.write_text(text)
    return path


def run_study_scenario(stack, pod: Localpod, scenario: Scenario, *, name: str, here: Path, model: Path,
                       timeout_s: float, flows) -> RunRecord:
    """The study, its process killed once its second child trains, then resumed; its findings in the record."""
    record = RunRecord(scenario, name, here / "store")
    record.study = findings = StudyFindings()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PREFECT_", "RUNPOD_"))} | stack.client_env
    served = None
    deployment = getattr(flows, "train_deployment", None)
    if deployment is None:  # no team: this scenario serves the train flow itself
        served, deployment = _serve_train(stack, env, here, f"chaos-{name}", timeout_s)
    try:
        study_file = write_study_file(
            here / "study.toml", scenario, name=name, model=model, store=record.store, deployment=deployment,
            dataset=getattr(flows, "inputs_dir", DATASET.parent) / DATASET.name,
            token_block=getattr(flows, "token_block", None))
        for rule in scenario.worker_faults:
            record.fault_ids.append(pod.add_worker_fault({**rule, "endpoint_name_prefix": record.endpoint_prefix}))
        started = time.monotonic()
        log = here / "study.log"
        with log.open("wb") as out:
            study = subprocess.Popen([sys.executable, "-m", "flows.study", str(study_file)], cwd=REPO, env=env,
                                     stdout=out, stderr=subprocess.STDOUT, start_new_session=True)

        def kill(endpoint_id: str) -> str:
            os.killpg(study.pid, signal.SIGKILL)  # its host lost: no hook, no final state
            return endpoint_id

        runpod = runpod_api(stack)
        with runpod, WhenTraining(pod, runpod, record.endpoint_prefix, KILL_AT_STEP, timeout_s, kill) as killer:
            try:
                study.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                os.killpg(study.pid, signal.SIGKILL)
                study.wait()
        findings.killed = killer.done
        record.output = log.read_text(errors="replace")
        match = re.search(r"study flow run ([0-9a-f-]{36}): starting", record.output)
        findings.study_run_id = record.flow_run_id = match.group(1) if match else None
        if findings.killed and record.flow_run_id:
            try:
                resumed = subprocess.run([sys.executable, "-m", "flows.study", str(study_file), "--resume",
                                          record.flow_run_id], cwd=REPO, env=env, capture_output=True, text=True,
                                         timeout=timeout_s)
                findings.resume_returncode = resumed.returncode
                record.output += "\n--- resumed ---\n" + resumed.stdout + resumed.stderr
            except subprocess.TimeoutExpired as e:
                record.output += f"\n--- resumed ---\n{e.stdout or ''}{e.stderr or ''}\n(ran past {timeout_s:.0f} s)"
        record.returncode = findings.resume_returncode
        record.wall_s = time.monotonic() - started
    finally:
        if served is not None:
            _stop(served)
    if record.flow_run_id:
        _read_study(PrefectApi(stack.prefect_api_url), findings, name)
    return record


def _serve_train(stack, env: dict[str, str], here: Path, name: str, timeout_s: float):
    """`train.serve(name=...)` in a process of its own, once its deployment exists; (the process, `train/<name>`)."""
    log = here / "serve.log"
    with log.open("wb") as out:
        served = subprocess.Popen([sys.executable, "-c", f"from flows.train import train; train.serve(name={name!r})"],
                                  cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"{stack.prefect_api_url}/deployments/name/train/{name}"
    if not wait_for(lambda: served.poll() is not None or _exists(url), timeout_s, interval_s=1) or served.poll():
        _stop(served)
        raise RuntimeError(f"the study scenario's train deployment never came up:\n{log.read_text()[-3000:]}")
    return served, f"train/{name}"


def _exists(url: str) -> bool:
    try:
        return httpx.get(url, timeout=10).status_code == 200
    except httpx.HTTPError:
        return False


def _stop(process: subprocess.Popen) -> None:
    try:
        os.killpg(process.pid, signal.SIGTERM)
        process.wait(SHUTDOWN_S)
    except ProcessLookupError:
        pass
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait()


def _read_study(prefect: PrefectApi, findings: StudyFindings, name: str) -> None:
    runs = prefect.http.post("/flow_runs/filter", json={"flow_runs": {"tags": {"all_": [
        f"study-run:{findings.study_run_id}"]}}}).raise_for_status().json()
    findings.children = [{
        "id": r["id"], "name": r["name"], "key": r.get("idempotency_key"), "state": (r["state"] or {}).get("type"),
        "message": (r["state"] or {}).get("message") or "",
        "learning_rate": ((r.get("parameters") or {}).get("spec") or {}).get("training", {}).get("learning_rate"),
    } for r in runs]
    found = prefect.http.post("/artifacts/filter", json={"artifacts": {"key": {"any_": [f"study-{name}-table"]}},
                                                         "sort": "CREATED_DESC", "limit": 1}).raise_for_status().json()
    if found:
        data = found[0]["data"]
        findings.rows = json.loads(data) if isinstance(data, str) else data
    events = prefect.http.post("/events/filter", json={"filter": {
        "event": {"name": [RUN_FINISHED]}, "resource": {"id": [f"{RUN_RESOURCE}{c['id']}" for c in findings.children]}},
        "limit": 50}).raise_for_status().json()["events"]
    for event in events:
        cost = event.get("payload", {}).get("cost_usd")
        findings.costs[event["resource"]["prefect.resource.id"].removeprefix(RUN_RESOURCE)] = (
            float(cost) if cost is not None else None)


_EARLIER = re.compile(r"Earlier starts of (\d+) child\(ren\) cost \$([0-9.]+)")
_COST_SLACK = 0.0002
"""The table rounds a cost to 4 digits, and the log too."""


def study_problems(record: RunRecord, account: Account) -> list[str]:
    """What is not as the study scenario says (empty: it behaved)."""
    found: StudyFindings = record.study
    if found is None or not found.killed:
        return ["the study's process was never killed while a child trained: its children ended first, or it never "
                f"started:\n{record.output[-3000:]}"]
    problems = []
    if found.resume_returncode != 0 or record.state_type != "COMPLETED":
        problems.append(f"the resumed study exited {found.resume_returncode} and ended {record.state_type}: "
                        f"{record.state_message[:1000]}\n{record.output[-3000:]}")
    log = "\n".join(record.log_messages)
    if "Resumed: " not in log:
        problems.append("the resumed study never said what it found and adopted")
    problems += child_problems(found)
    problems += earlier_cost_problems(found, log)
    live = [e.name for e in account.live_endpoints if record.owns(e.name)]
    if live:
        problems.append(f"endpoints still live: {live}")
    return problems


def child_problems(found: StudyFindings) -> list[str]:
    """Each child run trained its own child's values (its key, made from its index and values, says the values its
    spec trained); each child has one completed run (or died with its worker host), its starts numbered 1..n, and a
    completed row in the study's table."""
    problems = []
    starts = children_by_index(found)
    for child in found.children:
        parts = (child["key"] or "").split(":")
        if len(parts) not in (3, 4) or parts[0] != found.study_run_id:
            problems.append(f"child run {child['name']} has no key of this study: {child['key']!r}")
            continue
        index, start = int(parts[1]), int(parts[3]) if len(parts) == 4 else 1
        values = {"training.learning_rate": child["learning_rate"]}
        if child_key(found.study_run_id, index, values, start) != child["key"]:
            problems.append(f"child run {child['name']} (key {child['key']}) trained learning_rate "
                            f"{child['learning_rate']}: another child's values, not child {index}'s")
    if sorted(starts) != list(range(1, len(RATES) + 1)):
        problems.append(f"children started: {sorted(starts)}, expected 1..{len(RATES)}")
    for index, runs in sorted(starts.items()):
        if [start for start, _ in runs] != list(range(1, len(runs) + 1)):
            problems.append(f"child {index}'s starts are {[start for start, _ in runs]}, expected 1..{len(runs)}")
        ends = [c["state"] for _, c in runs]
        if ends.count("COMPLETED") != 1 and not _died_with_host(runs[-1][1]):
            problems.append(f"child {index} ended {ends} over its starts: one completed run expected, no child "
                            "trained twice")
        elif ends.count("COMPLETED") == 1 and ends[-1] != "COMPLETED":
            problems.append(f"child {index} was started again after it completed: {ends}")
    if len(found.rows) != len(RATES):
        problems.append(f"the study's table has {len(found.rows)} row(s), expected one per child")
    for row in found.rows:
        index = row_index(row, starts)
        if row["state"] != "completed" and not (index in starts and _died_with_host(starts[index][-1][1])):
            problems.append(f"the table says child {row['child']} ended {row['state']}, expected completed")
    return problems


def children_by_index(found: StudyFindings) -> dict[int, list[tuple[int, dict[str, Any]]]]:
    """The child runs by child index (from their keys), each child's as (start, run) in start order."""
    starts: dict[int, list[tuple[int, dict[str, Any]]]] = {}
    for child in found.children:
        parts = (child["key"] or "").split(":")
        if len(parts) in (3, 4) and parts[1].isdigit():
            starts.setdefault(int(parts[1]), []).append((int(parts[3]) if len(parts) == 4 else 1, child))
    return {index: sorted(runs, key=lambda pair: pair[0]) for index, runs in starts.items()}


def row_index(row: dict[str, Any], starts: dict[int, list[tuple[int, dict[str, Any]]]]) -> int | None:
    """The child index of a table row: the row names the child, and its flow runs are named after it (`<child>`, or
    `<child>-<model>-...` as a deployment run)."""
    name = row["child"].removesuffix(" (best)")
    return next((index for index, runs in starts.items()
                 if any(c["name"] == name or c["name"].startswith(f"{name}-") for _, c in runs)), None)


def _died_with_host(run: dict[str, Any]) -> bool:
    return run["state"] == "CRASHED" and run["message"].startswith(ZOMBIE_MESSAGE)


def earlier_cost_problems(found: StudyFindings, log: str) -> list[str]:
    """The resumed study counted what the earlier starts cost (the failed first child's runs): in its budget (its
    log says so) and in that child's row, beside what its completed run cost."""
    starts = children_by_index(found)
    again = {index for index, runs in starts.items() if len(runs) > 1}
    if not again:
        return ["no child was started again after the resume: the scenario's failed first child was not restarted"]
    said = _EARLIER.search(log)
    if said is None or float(said.group(2)) <= 0:
        return [f"the resumed study never counted its earlier starts' cost: {said.group(0) if said else 'not said'}"]
    problems = []
    rows = {row_index(row, starts): row for row in found.rows}
    for index in sorted(again):
        known = [found.costs.get(c["id"]) for _, c in starts[index]]
        row = rows.get(index, {})
        row_cost = row.get("cost (USD)")
        if not isinstance(row_cost, (int, float)) or row_cost + _COST_SLACK < sum(c or 0.0 for c in known):
            problems.append(f"child {row.get('child', index)}'s row costs {row_cost!r}, less than its starts' "
                            f"loraflow.run.finished ({known}): its earlier starts are not counted")
    return problems
