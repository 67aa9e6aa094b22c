"""Judge a chaos run: read back what the Prefect server, localpod and the store say about it
(`read_back`), then list everything that is not as its scenario says (`check_run`; empty: it behaved).
Also what a batch counts across runs: a completed run's stored results, whether its adapter changes the
model, and training processes left running.
"""

from __future__ import annotations

import json
import re
import subprocess
from collections import Counter
from pathlib import Path
from typing import Any

from bench.chaos_lib import PrefectApi, RunRecord, own_token
from bench.chaos_serve import WORKER_CRASHED
from bench.chaos_study import study_problems
from bench.chaos_volumes import volume_race_problems
from deployments.local_stack import check_adapter
from localpod.models import Account

_ATTEMPT_ENDED = re.compile(r"^Attempt (\d+) ended (\w+) ")
_ATTEMPT_ON = re.compile(r"^Attempt (\d+) on \d+ × (.+?): endpoint ")
_ADOPTED = re.compile(r"^Job ended (\w+) but its results were stored completely; adopting them")
_RESUMED = re.compile(r"resuming from the checkpoint at step (\d+)")
_ENDPOINT_ATTEMPT = re.compile(r"-a(\d+)$")
_REQUEUED = re.compile(r"^Job \S+ went back to RunPod's queue after it had started")
_TRAINING_STARTED = re.compile(r"training process \d+ started for run")


def read_back(record: RunRecord, prefect: PrefectApi, account: Account) -> None:
    """Fill in what the Prefect server, localpod and the store say about the run."""
    endpoints = [e for e in account.endpoints if record.owns(e.name)]
    record.endpoint_names = [e.name for e in endpoints]
    # The worker says it resumed in a progress message, which the flow's 2 s polls can miss on a short
    # run, and in its console, which is kept: read the last attempt's worker logs.
    last = max(endpoints, key=lambda e: e.created_at, default=None)
    for w in account.workers:
        if last is not None and w.endpoint_id == last.id and w.log_path and Path(w.log_path).exists():
            if m := _RESUMED.search(Path(w.log_path).read_text(errors="replace")):
                record.resumed_from_step = int(m.group(1))
    ours = {e.id for e in endpoints}
    for w in account.workers:
        if w.endpoint_id in ours and w.log_path and Path(w.log_path).exists():
            console = Path(w.log_path).read_text(errors="replace")
            record.fresh_trainings += bool(_TRAINING_STARTED.search(console)) and not _RESUMED.search(console)
    run_dir = record.run_dir
    record.done = run_dir is not None and (run_dir / "DONE").exists()
    if record.flow_run_id is None:
        return
    state = prefect.state(record.flow_run_id)
    record.state_type, record.state_message = state["type"], state.get("message") or ""
    record.log_messages = prefect.log_messages(record.flow_run_id)
    for message in record.log_messages:
        if m := _ATTEMPT_ENDED.match(message):
            record.retried.append(m.group(2))
        elif m := _ADOPTED.match(message):
            record.adopted_after = m.group(1)
        elif m := _ATTEMPT_ON.match(message):
            record.gpus_used.append(m.group(2))
        elif _REQUEUED.match(message):
            record.requeued += 1


def check_run(record: RunRecord, account: Account, faults: dict[str, dict[str, Any]], max_steps: int) -> list[str]:
    """Everything that is not as the scenario says it must be (empty: the run behaved)."""
    s, problems = record.scenario, []
    if record.flow_run_id is None:
        return [f"no flow run id in the flow's output (exit code {record.returncode}):\n{record.output[-3000:]}"]
    if record.host_killed:
        return _killed_run_problems(record, account)
    if s.flow == "preload":
        return _preload_problems(record, account) + _fault_problems(record, faults)
    if s.flow == "volumes":
        return volume_race_problems(record) + _fault_problems(record, faults)
    if s.flow == "serve":
        return serve_problems(record, account) + _fault_problems(record, faults)
    if s.flow == "study":
        return study_problems(record, account) + _fault_problems(record, faults)
    if record.state_type != s.expect_state:
        problems.append(f"ended {record.state_type}, expected {s.expect_state}: {record.state_message[:1500]}")
    ended = record.retried + ([record.adopted_after] if record.adopted_after else [])
    if tuple(ended) != s.retried:
        problems.append(f"attempts given up: {ended}, expected {list(s.retried)}")
    if record.adopted_after and not s.may_adopt:
        problems.append(f"results adopted after an attempt ended {record.adopted_after}: not expected here")
    live = [e.name for e in account.live_endpoints if e.name.startswith(record.endpoint_prefix)]
    if live:
        problems.append(f"endpoints still live: {live}")
    attempts = Counter(int(m.group(1)) for n in record.endpoint_names if (m := _ENDPOINT_ATTEMPT.search(n)))
    if any(count != 1 for count in attempts.values()):
        problems.append(f"an attempt got more than one endpoint: {sorted(record.endpoint_names)}")
    if sorted(attempts) != list(range(1, len(record.retried) + 2)):
        problems.append(f"endpoints of attempts {sorted(attempts)}, expected 1..{len(record.retried) + 1}")
    if s.final_gpu is not None and record.gpus_used[-1:] != [s.final_gpu]:
        problems.append(f"attempts ran on {record.gpus_used}, expected the last on {s.final_gpu}")
    log = "\n".join(record.log_messages)
    problems += [f"its log never says {text!r}" for text in s.log_says if text not in log]
    problems += [f"its log says {text!r}: {next(m for m in record.log_messages if text in m)[:500]}"
                 for text in s.log_never_says if text in log]
    if s.route_faults_at_step is not None and len(record.fault_ids) < len(s.route_faults) + len(s.worker_faults):
        problems.append(f"its route faults were never added at step {s.route_faults_at_step}: the job ended first")
    if s.delete_endpoint_at_step is not None and record.endpoint_deleted is None:
        problems.append(f"the endpoint was never deleted at step {s.delete_endpoint_at_step}: the job ended first")
    if s.own_token and (not record.worker_tokens or set(record.worker_tokens.values()) != {own_token(record.name)}):
        problems.append(f"its workers booted with HF_TOKEN {sorted(map(str, record.worker_tokens.values()))}, not "
                        "only the run's own")
    if s.tight_reconcile_at_step is not None:
        problems += _tight_reconcile_problems(record.reconcile, s.tight_reconcile_minutes)
    if s.resumes and record.resumed_from_step is None:
        problems.append("the last attempt did not resume from a checkpoint")
    if record.requeued != s.requeues:
        problems.append(f"the job went back to the queue {record.requeued} times after it started, expected "
                        f"{s.requeues}")
    if s.requeues and s.resumes and record.fresh_trainings != 1:
        problems.append(f"{record.fresh_trainings} workers trained from the start into the run's store, expected 1: "
                        "the others must resume from the checkpoint")
    missing = [t for t in s.failure_text if t not in record.state_message]
    if s.expect_state == "FAILED" and missing:
        problems.append(f"the failure message lacks {missing}: {record.state_message[:1500]}")
    if record.state_type == "COMPLETED":
        problems += artifact_problems(record.run_dir, max_steps)
    if s.stale_warm_record and not record.stale_record_cleared:
        problems.append(f"the stale weight-cache record of {s.stale_warm_record} was not cleared")
    if s.stale_warm_record and not any("no longer exists" in line for line in record.output.splitlines()):
        problems.append("the run never said its warm volume no longer exists")
    return problems + _fault_problems(record, faults)


def _killed_run_problems(record: RunRecord, account: Account) -> list[str]:
    """A run whose worker host was killed under it: Crashed (no process is left to say more), nothing left live.
    Its scenario's own faults may not have fired: the run ended first."""
    problems = []
    if record.state_type != "CRASHED":
        problems.append(f"its worker host {record.host_killed} was killed under it, yet it ended {record.state_type}: "
                        f"{record.state_message[:1500]}")
    live = [e.name for e in account.live_endpoints if record.owns(e.name)]
    if live:
        problems.append(f"endpoints still live after its host was killed: {live}")
    return problems


def serve_problems(record: RunRecord, account: Account) -> list[str]:
    """What is not as a serve scenario says: its state (and the failure's words), how its watch said it ended, one
    endpoint and none live, and what was done beside it done."""
    s, problems = record.scenario, []
    expected = "CRASHED" if s.kill_while_serving else s.expect_state  # a killed process says nothing more
    if record.state_type != expected:
        problems.append(f"ended {record.state_type}, expected {expected}: {record.state_message[:1500]}")
    missing = [t for t in s.failure_text if t not in record.state_message]
    if s.expect_state == "FAILED" and missing:
        problems.append(f"the failure message lacks {missing}: {record.state_message[:1500]}")
    ends = [m for m in record.log_messages if m.startswith("Serving ends: ")]
    if s.serve_ends is not None and not any(m.startswith(f"Serving ends: {s.serve_ends}") for m in ends):
        problems.append(f"its watch never said it ended as {s.serve_ends!r}: {ends or 'no end said'}")
    if len(record.endpoint_names) != 1:
        problems.append(f"a serve has one endpoint; it had {sorted(record.endpoint_names)}")
    live = [e.name for e in account.live_endpoints if record.owns(e.name)]
    if live:
        problems.append(f"endpoints still live: {live}")
    if s.delete_while_serving and record.endpoint_deleted is None:
        problems.append("its endpoint was never deleted behind it: it never answered, or ended first")
    # A Prefect worker marks a run whose process died Crashed at once and runs its crash hook: the endpoint goes then.
    worker_crashed = s.kill_while_serving and record.state_message.startswith(WORKER_CRASHED)
    if s.kill_while_serving:
        problems += _expiry_problems(record.expiry_reconcile, worker_crashed)
    if s.reconcile_while_serving or (s.kill_while_serving and not worker_crashed):
        run = record.serving_reconcile
        if run is None:
            problems.append("the reconcile beside the serve never ran: the serve never answered")
        elif run["returncode"] != 0 or not run["kept"] or "serving until" not in run["output"]:
            problems.append(f"the reconcile beside the live serve (exit {run['returncode']}) did not keep its "
                            f"endpoint saying until when it serves (kept: {run['kept']}):\n{run['output'][-2000:]}")
    return problems


def _expiry_problems(run: dict[str, Any] | None, worker_crashed: bool) -> list[str]:
    """A killed serve's endpoint: deleted once its expiry passed, not before; by the reconcile run then, saying its
    time ran out, unless the team's reconcile deployment had deleted it already. A run its worker marked Crashed
    has ended: its crash hook, run by the worker, deletes its endpoint, whatever its expiry."""
    if run is None:
        return ["the serve's process was never killed: it never answered"]
    if run["deleted_at"] is None or run["kept"]:
        ended = "its run ended" if worker_crashed else "its expiry had passed"
        return [f"its endpoint was not deleted once {ended}:\n{run['output'][-2000:]}"]
    if worker_crashed:
        return []
    problems = []
    if run["deleted_at"] < run["expires_at"] - 1:
        problems.append(f"its endpoint was deleted {run['expires_at'] - run['deleted_at']:.0f} s before its expiry")
    if run["live_before"] and (run["returncode"] != 0 or "time ran out" not in run["output"]):
        problems.append(f"the reconcile after the expiry (exit {run['returncode']}) did not say the endpoint's time "
                        f"ran out:\n{run['output'][-2000:]}")
    return problems


def _fault_problems(record: RunRecord, faults: dict[str, dict[str, Any]]) -> list[str]:
    problems = []
    ours = [faults[fault_id] for fault_id in record.fault_ids if fault_id in faults]
    for fault in ours:
        if fault["hits"] == 0 and fault.get("probability") is None:
            problems.append(f"fault {fault['action']} on {fault.get('route', 'the worker')} never fired")
    # A rule that fires by chance may miss a short run; together they must have fired.
    chance = [f for f in ours if f.get("probability") is not None]
    if chance and not any(f["hits"] for f in chance):
        problems.append(f"none of the {len(chance)} faults that fire by chance fired")
    return problems


def _preload_problems(record: RunRecord, account: Account) -> list[str]:
    s, problems = record.scenario, []
    if record.state_type != s.expect_state:
        problems.append(f"ended {record.state_type}, expected {s.expect_state}: {record.state_message[:1500]}")
    missing = [t for t in s.failure_text if t not in record.state_message]
    if s.expect_state == "FAILED" and missing:
        problems.append(f"the failure message lacks {missing}: {record.state_message[:1500]}")
    for dc in s.preload_data_centers:
        row = record.sweep_rows.get(dc)
        if row is None or row["status"] != "error" or "500" not in row.get("note", ""):
            problems.append(f"the sweep's table does not report {dc}'s refused volume: {row}")
    live = [e.name for e in account.live_endpoints if record.owns(e.name)]
    if live:
        problems.append(f"endpoints still live: {live}")
    if record.endpoint_names:
        problems.append(f"endpoints were rented though no volume could be made: {record.endpoint_names}")
    made = [v.id for v in account.volumes if v.data_center in s.preload_data_centers and v.id not in record.volumes_before]
    if made:
        problems.append(f"volumes left in {list(s.preload_data_centers)}: {made}")
    return problems


def _tight_reconcile_problems(run: subprocess.CompletedProcess | None, minutes: float) -> list[str]:
    if run is None:
        return ["the too-tight reconcile never ran: the job ended before it trained"]
    said = run.stdout + run.stderr
    if run.returncode == 0:
        return [f"a reconcile with silent_after_minutes={minutes} was accepted:\n{said[-2000:]}"]
    if "silent_after_minutes" not in said or "heartbeat" not in said:
        return [f"the refused reconcile did not name the setting and the heartbeat:\n{said[-2000:]}"]
    return []


def artifact_problems(run_dir: Path | None, max_steps: int) -> list[str]:
    """What is missing or wrong among a completed run's stored results."""
    if run_dir is None or not (run_dir / "DONE").exists():
        return [f"no DONE in {run_dir}"]
    problems = []
    try:
        metrics = json.loads((run_dir / "metrics.json").read_text())
        if metrics.get("steps") != max_steps:
            problems.append(f"metrics.json says {metrics.get('steps')} steps, expected {max_steps}")
    except (OSError, ValueError) as e:
        problems.append(f"metrics.json unreadable: {e}")
    for name in ("adapter_config.json", "adapter_model.safetensors"):
        if not (run_dir / "adapter" / name).is_file():
            problems.append(f"adapter/{name} missing")
    return problems


def adapter_changes_the_model(base_model: Path, adapter_dir: Path) -> bool:
    """Load the adapter with PEFT onto the base model (in the worker's environment); True when it changes
    the model's output."""
    report = check_adapter(base_model, adapter_dir)
    return bool(report["loads"] and report["changes_output"])


def live_training_processes(root: Path) -> list[int]:
    """Pids of worker training processes whose files lie under `root` (the stack's folder)."""
    pids = []
    for proc in Path("/proc").glob("[0-9]*"):
        try:
            argv = (proc / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"loraflow_worker.training.train_job" in argv and any(a.startswith(str(root).encode()) for a in argv):
            pids.append(int(proc.name))
    return pids
