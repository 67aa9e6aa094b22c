"""The chaos scenarios of the serve flow (`flow = "serve"` in `bench/chaos_scenarios.py`): a serve of the tiny model
and one LoRA adapter on localpod's stand-in for RunPod's vLLM worker, with the scenario's faults scoped to its
endpoint (`loraflow-<run name>-`, the serve being named as the run), and what is done to it once it answers: its
endpoint deleted through RunPod's API, or the reconcile flow run beside it.

    adapter = make_adapter(model, workdir / "adapter")      # once per batch
    record = run_serve_scenario(stack, pod, SCENARIOS["serve-deleted"], name=..., here=..., model=model,
                                adapter=adapter, timeout_s=900, flows=flows)
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from contextlib import nullcontext
from pathlib import Path
from typing import Any


from bench.chaos_lib import REPO, Localpod, PrefectApi, RunRecord, WhenReady, runpod_api, wait_for
from bench.chaos_scenarios import Scenario, scoped
from deployments.local_stack import WORKER_PYTHON
from tasks.jobs.serve import SERVE_TAG
from tasks.runpod.endpoints import parse_endpoint_name

ADAPTER_RANK = 8
"""The batch's adapter rank: above the MAX_LORA_RANK the crash-loop scenario's workers boot with."""

_ADAPTER_SOURCE = """
import sys
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM
model = AutoModelForCausalLM.from_pretrained(sys.argv[1])
config = LoraConfig(r=int(sys.argv[3]), lora_alpha=int(sys.argv[3]), target_modules=["q_proj", "v_proj"],
                    init_lora_weights=False)
get_peft_model(model, config).save_pretrained(sys.argv[2])
"""
_ADAPTER_LOCK = threading.Lock()


def make_adapter(model: Path, folder: Path, rank: int = ADAPTER_RANK) -> Path:
    """A LoRA adapter of `model` with random weights (PEFT, in the worker's environment), made once: what the serve
    scenarios serve. Training one would cost a run; the stand-in loads and applies any adapter of the base alike."""
    with _ADAPTER_LOCK:
        if not (folder / "adapter_config.json").is_file():
            done = subprocess.run([str(WORKER_PYTHON), "-c", _ADAPTER_SOURCE, str(model), str(folder), str(rank)],
                                  capture_output=True, text=True, timeout=600,
                                  env={"PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1"})
            if done.returncode != 0:
                raise RuntimeError(f"could not make the serve scenarios' adapter: {done.stderr[-3000:]}")
    return folder


def write_serve_file(path: Path, scenario: Scenario, *, name: str, model: Path, adapter: Path) -> Path:
    """The scenario's serve file: the tiny model and the adapter on a 4090, for `serve_hours`."""
    settings = {"gpu": ["RTX 4090"], "max_workers": 1, "idle_timeout_s": 600, "hours": scenario.serve_hours,
                "budget_usd": 5, "max_model_len": 512, "prompts": ["Say hello."], "max_tokens": 8,
                "cold_start_minutes": 10}
    lines = [f'name = "{name}"', "[serve]", f'base_model = "{model}"',
             f'adapters = [{{ name = "chaos", source = "{adapter}" }}]']
    lines += [f"{key} = {json.dumps(value)}" for key, value in settings.items()]
    path.write_text("\n".join(lines) + "\n")
    return path


class WhenServing(WhenReady):
    """Acts on one serve once it has said it answers (its flow run, found by its `serve:<name>` tag, logged `OpenAI
    base URL: ...`) and its endpoint is live. Not sooner: an endpoint deleted while the first answer is on its way is a
    serve that never started, not a live one lost."""

    poll_s = 2.0

    def __init__(self, pod: Localpod, prefect: PrefectApi, name: str, prefix: str, timeout_s: float, action):
        self.pod, self.prefect, self.name, self.prefix = pod, prefect, name, prefix
        super().__init__(timeout_s, action)

    def _ready(self) -> str | None:
        return self._live_endpoint() if self._answers() else None

    def _answers(self) -> bool:
        runs = self.prefect.http.post("/flow_runs/filter", json={
            "flow_runs": {"tags": {"all_": [SERVE_TAG.format(name=self.name)]}}}).raise_for_status().json()
        return any(m.startswith("OpenAI base URL: ") for r in runs for m in self.prefect.log_messages(r["id"]))

    def _live_endpoint(self) -> str | None:
        return next((e.id for e in self.pod.account().live_endpoints if e.name.startswith(self.prefix)), None)


def reconcile_beside(stack, pod: Localpod):
    """Runs the reconcile flow (its default policy, any age) from a shell while the serve lives; returns its exit code,
    its output, and whether the serve's endpoint was still live after it."""
    def run(endpoint_id: str) -> dict[str, Any]:
        env = {k: v for k, v in os.environ.items() if not k.startswith(("PREFECT_", "RUNPOD_"))} | stack.client_env
        done = subprocess.run([sys.executable, "-m", "flows.reconcile", json.dumps({"min_age_minutes": 0})], cwd=REPO,
                              env=env, capture_output=True, text=True, timeout=300)
        live = endpoint_id in {e.id for e in pod.account().live_endpoints}
        return {"returncode": done.returncode, "output": done.stdout + done.stderr, "kept": live}
    return run


def serve_processes(flow_run_ids: list[str], serve_file: Path) -> list[int]:
    """The processes running these serve flow runs: a worker's (`PREFECT__FLOW_RUN_ID` in its environment) or a
    shell's (`python -m flows.serve SERVE_FILE`)."""
    pids, marks = [], {f"PREFECT__FLOW_RUN_ID={i}".encode() for i in flow_run_ids}
    for proc in Path("/proc").glob("[0-9]*"):
        try:
            argv = (proc / "cmdline").read_bytes().split(b"\0")
            environ = set((proc / "environ").read_bytes().split(b"\0"))
        except OSError:
            continue
        if marks & environ or (b"flows.serve" in argv and str(serve_file).encode() in argv):
            pids.append(int(proc.name))
    return pids


def serve_run_ids(prefect: PrefectApi, name: str) -> list[str]:
    """The flow runs of the serve named `name` (its tag `serve:<name>`)."""
    runs = prefect.http.post("/flow_runs/filter", json={
        "flow_runs": {"tags": {"all_": [SERVE_TAG.format(name=name)]}}}).raise_for_status().json()
    return [r["id"] for r in runs]


def kill_serve(stack, pod: Localpod, prefect: PrefectApi, name: str, serve_file: Path):
    """SIGKILLs the serve's process (a worker's flow-run process, or a shell's), then runs the reconcile beside its
    endpoint at once."""
    reconcile = reconcile_beside(stack, pod)

    def run(endpoint_id: str) -> dict[str, Any]:
        killed = serve_processes(serve_run_ids(prefect, name), serve_file)
        for pid in killed:
            os.kill(pid, signal.SIGKILL)
        return reconcile(endpoint_id) | {"killed": killed}
    return run


ENDED_RUN_CLEAN_UP_S = 300
"""How long an ended serve's endpoint gets to go (its crash hook, else the team's reconcile deployment: every 30 s,
silence threshold 3 minutes) before the harness's own reconcile runs."""
WORKER_CRASHED = "Process exited with status code"
"""The start of the Crashed state's message a Prefect process worker gives a flow run whose process it saw die (it then
runs the flow's on_crashed hooks itself: the serve's deletes its endpoint)."""


def reconcile_after_expiry(stack, pod: Localpod, endpoint_id: str, wait: bool = True) -> dict[str, Any]:
    """Once the expiry in the endpoint's name has passed (at once unless `wait`), the reconcile from a shell (any age),
    and what localpod says of the endpoint after it."""
    endpoint = next(e for e in pod.account().endpoints if e.id == endpoint_id)
    expires_at = parse_endpoint_name(endpoint.name).expires_at
    if wait:
        time.sleep(max(0.0, expires_at - time.time()) + 2)
    else:  # an ended run's endpoint: its crash hook (run by the worker) deletes it, else the team's reconcile
        wait_for(lambda: endpoint_id not in {e.id for e in pod.account().live_endpoints}, ENDED_RUN_CLEAN_UP_S, 2)
    live_before = endpoint_id in {e.id for e in pod.account().live_endpoints}
    found = reconcile_beside(stack, pod)(endpoint_id)
    gone = next(e for e in pod.account().endpoints if e.id == endpoint_id)
    return found | {"live_before": live_before, "expires_at": expires_at,
                    "deleted_at": gone.deleted_at.timestamp() if gone.deleted_at else None}


def run_serve_scenario(stack, pod: Localpod, scenario: Scenario, *, name: str, here: Path, model: Path, adapter: Path,
                       timeout_s: float, flows) -> RunRecord:
    """A serve with the scenario's faults, and its action once the endpoint answers."""
    record = RunRecord(scenario, name, here / "store")
    serve_file = write_serve_file(here / "serve.toml", scenario, name=name, model=model, adapter=adapter)
    for rule in scenario.route_faults:
        record.fault_ids.append(pod.add_route_fault(scoped(rule, record.endpoint_prefix)))
    for rule in scenario.worker_faults:
        record.fault_ids.append(pod.add_worker_fault({**rule, "endpoint_name_prefix": record.endpoint_prefix}))
    runpod, prefect = runpod_api(stack), PrefectApi(stack.prefect_api_url)
    watch = None
    if scenario.delete_while_serving:
        watch = WhenServing(pod, prefect, name, record.endpoint_prefix, timeout_s,
                            lambda endpoint_id: runpod.delete(f"/serverless/{endpoint_id}").raise_for_status())
    elif scenario.reconcile_while_serving:
        watch = WhenServing(pod, prefect, name, record.endpoint_prefix, timeout_s, reconcile_beside(stack, pod))
    elif scenario.kill_while_serving:
        watch = WhenServing(pod, prefect, name, record.endpoint_prefix, timeout_s,
                            kill_serve(stack, pod, prefect, name, serve_file))
    # A killed serve's slot lease is renewed no more: the shortest lease gives it back within the batch.
    env = {"LORAFLOW_SLOT_LEASE_SECONDS": "60"} if scenario.kill_while_serving else {}
    started = time.monotonic()
    with runpod, watch or nullcontext():
        flows.run(record, serve_file, env, timeout_s)
    if watch is not None and watch.done and scenario.delete_while_serving:
        record.endpoint_deleted = watch.result.request.url.path.rsplit("/", 1)[-1]
    elif watch is not None and watch.done:
        record.serving_reconcile = watch.result
    if scenario.kill_while_serving and watch is not None and watch.done:
        endpoint_id = next(e.id for e in pod.account().endpoints if e.name.startswith(record.endpoint_prefix))
        if record.flow_run_id is None:  # a shell's serve prints its flow run id as it ends: this one was killed
            record.flow_run_id = next(iter(serve_run_ids(prefect, name)), None)
        # A worker outlives the flow process it started: it marks the run Crashed at once and runs the serve's
        # on_crashed hook, which deletes the endpoint. Without one the run stays Running, its endpoint kept until its
        # expiry by the reconcile.
        ended = record.flow_run_id and (prefect.state(record.flow_run_id).get("message") or "").startswith(
            WORKER_CRASHED)
        record.expiry_reconcile = reconcile_after_expiry(stack, pod, endpoint_id, wait=not ended)
        if record.flow_run_id and prefect.state(record.flow_run_id)["type"] == "RUNNING":
            # Nothing marks a shell's killed flow run without the team setup's zombie automation.
            prefect.http.post(f"/flow_runs/{record.flow_run_id}/set_state", json={"state": {
                "type": "CRASHED", "name": "Crashed", "message": "its process was killed (the chaos harness)"},
                "force": True}).raise_for_status()
    record.wall_s = time.monotonic() - started
    return record

