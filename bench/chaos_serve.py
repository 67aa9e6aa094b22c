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
import subprocess
import sys
import threading
import time
from contextlib import nullcontext
from pathlib import Path
from typing import Any


from bench.chaos_lib import REPO, Localpod, PrefectApi, RunRecord, WhenReady, runpod_api
from bench.chaos_scenarios import Scenario, scoped
from deployments.local_stack import WORKER_PYTHON
from tasks.jobs.serve import SERVE_TAG

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
    started = time.monotonic()
    with runpod, watch or nullcontext():
        flows.run(record, serve_file, {}, timeout_s)
    record.wall_s = time.monotonic() - started
    if watch is not None and watch.done and scenario.delete_while_serving:
        record.endpoint_deleted = watch.result.request.url.path.rsplit("/", 1)[-1]
    elif watch is not None and watch.done:
        record.serving_reconcile = watch.result
    return record

