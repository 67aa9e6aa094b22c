"""The preflight (`python -m flows.preflight RUN_FILE --worker-quota N`): one line per check, the fix on every
warn and FAIL, exit 1 on a FAIL, and nothing created or changed anywhere.

The judging functions are tested directly; the flow runs as a subprocess against the real local stack (Prefect
server, localpod, the Hub stand-in), each run provoking the failures that do not mask each other.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tomllib
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
import yaml
from huggingface_hub import HfApi

from loraflow_worker.contract import ModelSource

from tasks.preflight.account import check_merge_worker, judge_gpus, judge_merge_worker, judge_worker_quota
from tasks.preflight.hub import check_store, judge_hub_write
from tasks.preflight.report import guarded
from tasks.runpod.catalog import resolve_gpu
from tasks.runpod.client import API_URL
from tasks.runpod.live_catalog import CatalogCpuType, GpuOffer
from tasks.runpod.models import Endpoint
from tasks.settings import Settings
from tests.conftest import DATASET, REPO, localpod_account, prefect_api

LINE = re.compile(r"^(ok|warn|FAIL) +(\S.*?) {2,}(\S.*)$")
NO_BLOCK = "preflight-test-no-such-block"


# --- the judging functions ---------------------------------------------------------------------------


def endpoint(name: str, workers_max: int = 1) -> Endpoint:
    return Endpoint.model_validate({"id": name[-8:], "name": name, "workers": {"min": 0, "max": workers_max},
                                    "createdAt": "2026-11-20T10:00:00Z"})


def test_other_endpoints_workers_count_against_the_quota_and_the_fix_names_the_limit_that_fits():
    others = [endpoint("my-vllm-server", workers_max=3), endpoint("loraflow-x-0123456789ab-other-a1")]
    check = judge_worker_quota(others, limit=28, namespace="mine", worker_quota=10)
    assert check.status == "FAIL"
    assert "28 + 4 = 32 > worker quota 10" in check.found
    assert check.fix.startswith("prefect gcl update runpod-endpoints --limit 6 ")


def test_this_control_planes_endpoints_hold_slots_inside_the_limit_and_do_not_count_again():
    ours = [endpoint(f"loraflow-run-0123456789a{i}-mine-a1") for i in range(5)]
    check = judge_worker_quota(ours, limit=5, namespace="mine", worker_quota=5)
    assert check.status == "ok" and "5 + 0 = 5 <= worker quota 5" in check.found


def test_a_missing_limit_is_judged_at_the_quota_the_first_run_creates_it_with(monkeypatch):
    monkeypatch.setenv("LORAFLOW_WORKER_QUOTA", "10")
    check = judge_worker_quota([endpoint("my-vllm-server", workers_max=6)], limit=None, namespace=None, worker_quota=10)
    assert check.status == "FAIL" and "first run creates it with 10 slots" in check.found
    assert check.fix.startswith("prefect gcl create runpod-endpoints --limit 4 ")


def test_without_loraflow_worker_quota_the_limit_is_created_at_a_new_accounts_quota(monkeypatch):
    monkeypatch.delenv("LORAFLOW_WORKER_QUOTA", raising=False)
    check = judge_worker_quota([], limit=None, namespace=None, worker_quota=5)
    assert check.status == "ok" and "first run creates it with 5 slots" in check.found


def test_a_limit_below_the_quota_names_the_update_that_uses_the_rest():
    check = judge_worker_quota([endpoint("my-vllm-server", workers_max=2)], limit=5, namespace="mine",
                               worker_quota=30)
    assert check.status == "ok"
    assert "23 workers of the quota stay unused: prefect gcl update runpod-endpoints --limit 28 uses them" in check.found


def test_the_quota_comes_from_loraflow_worker_quota_when_not_given(monkeypatch):
    from tasks.preflight.account import check_worker_quota

    class Listing:
        def list_endpoints(self):
            return []

    monkeypatch.setenv("LORAFLOW_WORKER_QUOTA", "30")
    monkeypatch.setattr("tasks.preflight.account.read_endpoint_limit", lambda: 40)
    monkeypatch.setattr("tasks.preflight.account.read_namespace", lambda settings: "mine")
    check = check_worker_quota(Listing(), Settings(), worker_quota=None)
    assert check.status == "FAIL" and "40 + 0 = 40 > worker quota 30" in check.found
    assert check.fix.startswith("prefect gcl update runpod-endpoints --limit 30 ")


def test_without_a_given_quota_the_one_runpod_named_in_a_refusal_is_used(monkeypatch):
    from tasks.preflight.account import check_worker_quota

    class Listing:
        def list_endpoints(self):
            return [endpoint("my-vllm-server", workers_max=2)]

    monkeypatch.delenv("LORAFLOW_WORKER_QUOTA", raising=False)
    monkeypatch.setattr("tasks.preflight.account.read_named_quota", lambda: (5, "2026-12-04T10:00:00+00:00"))
    monkeypatch.setattr("tasks.preflight.account.read_endpoint_limit", lambda: 30)
    monkeypatch.setattr("tasks.preflight.account.read_namespace", lambda settings: "mine")
    check = check_worker_quota(Listing(), Settings(), worker_quota=None)
    assert check.status == "FAIL" and "worker quota 5 from RunPod's quota refusal of 2026-12-04T10:00:00" in check.found
    assert check.fix.startswith("prefect gcl update runpod-endpoints --limit 3 ")


def test_a_worker_quota_that_is_not_a_number_is_refused_naming_the_variable(monkeypatch):
    from tasks.lifecycle.quota import configured_worker_quota

    monkeypatch.setenv("LORAFLOW_WORKER_QUOTA", "thirty")
    with pytest.raises(ValueError, match="LORAFLOW_WORKER_QUOTA='thirty' is not a worker quota"):
        configured_worker_quota()


def test_without_the_quota_the_quota_line_warns_naming_the_balance_tiers_and_the_flag():
    check = judge_worker_quota([], limit=28, namespace=None, worker_quota=None)
    assert check.status == "warn" and "--worker-quota N" in check.fix and "$300" in check.fix


def offer(gpu: str, cuda: list[str], stock: dict[str, str]) -> GpuOffer:
    cls = resolve_gpu(gpu)
    return GpuOffer(gpu=cls.name, pool=cls.pool, usd_per_hour=1.0, source="catalog", cuda_versions=cuda,
                    data_centers=stock, cuda_floor="13.0")


def test_a_gpu_below_its_floor_fails_when_no_gpu_of_the_run_meets_its_own():
    gpus = [resolve_gpu("4090")]
    checks = judge_gpus(gpus, [offer("4090", ["12.4", "12.8"], {})], ["13.0"],
                        alternatives=lambda: [])
    [cuda] = [c for c in checks if c.name == "gpu RTX 4090: cuda"]
    assert cuda.status == "FAIL" and "below" in cuda.found and "LORAFLOW_IMAGE_MIN_CUDA" in cuda.fix


def test_a_gpu_whose_card_is_not_in_its_pool_is_skipped_while_another_can_be_rented():
    missing = "GPU class H100: RunPod's catalog does not list its card NVIDIA H100 80GB HBM3 in pool ADA_80_PRO"
    h100 = offer("h100", [], {}).model_copy(update={"source": "static list price", "not_in_pool": missing})
    rtx = offer("4090", ["13.0"], {"EU-RO-1": "HIGH"}).model_copy(update={"cards_from": "catalog"})
    checks = judge_gpus([resolve_gpu("h100"), resolve_gpu("4090")], [h100, rtx], ["13.0", "13.0"])
    [pool] = [c for c in checks if c.name == "gpu H100: pool"]
    assert pool.status == "warn" and "pool ADA_80_PRO" in pool.found and "skips" in pool.found
    assert not [c for c in checks if c.name.startswith("gpu H100:") and c.name != "gpu H100: pool"]
    [rtx_pool] = [c for c in checks if c.name == "gpu RTX 4090: pool"]
    assert rtx_pool.status == "ok" and "NVIDIA GeForce RTX 4090 in pool ADA_24" in rtx_pool.found


def test_a_run_none_of_whose_gpus_is_in_its_pool_fails_the_preflight():
    missing = "GPU class H100: RunPod's catalog does not list its card NVIDIA H100 80GB HBM3 in pool ADA_80_PRO"
    h100 = offer("h100", [], {}).model_copy(update={"source": "static list price", "not_in_pool": missing})
    [pool] = judge_gpus([resolve_gpu("h100")], [h100], ["13.0"])
    assert pool.status == "FAIL" and "tasks/runpod/catalog.py" in pool.fix


SERVERLESS_CPUS = [CatalogCpuType.model_validate({"id": i, "name": i, "vcpu": {"min": 2, "max": 8}, "ramGbPerVcpu": ram,
                                                  "price": {"serverlessPerVcpu": usd}})
                   for i, ram, usd in (("cpu3c", 2.0, 0.03), ("cpu3g", 4.0, 0.04), ("cpu5c", 2.0, 0.05))]


def test_the_merge_worker_line_names_the_serverless_cpu_worker_the_merge_would_rent():
    check = judge_merge_worker(8_000_000_000, SERVERLESS_CPUS, "Qwen/Qwen3-8B", "acme/qwen3-8b-merged")
    assert check.status == "ok"
    assert check.found.startswith("CPU cpu3g × 8 vCPU (32 GB RAM, $0.320/hr) with 58 GB of container disk")
    assert "acme/qwen3-8b-merged" in check.found


def test_a_model_no_serverless_cpu_worker_holds_fails_the_merge_worker_line_naming_the_limit():
    check = judge_merge_worker(14_000_000_000, SERVERLESS_CPUS, "Qwen/Qwen3-14B", "acme/qwen3-14b-merged")
    assert check.status == "FAIL"
    assert check.found.startswith("publish.merged_model_id: the merge of Qwen/Qwen3-14B")
    assert "a serverless CPU worker has at most 8 vCPUs" in check.found
    assert "remove publish.merged_model_id" in check.fix


def test_without_a_runpod_key_the_merge_worker_line_warns():
    check = check_merge_worker(None, ModelSource(id="Qwen/Qwen3-8B"), "acme/m", Settings())
    assert check.status == "warn" and "no RunPod key" in check.found


def test_a_read_only_token_cannot_write_the_store():
    whoami = {"name": "ada", "orgs": [], "auth": {"accessToken": {"displayName": "ro", "role": "read"}}}
    assert "read-only" in judge_hub_write(whoami, "ada", "ada/runs", exists=True)


def test_a_token_whose_user_is_not_in_the_stores_org_cannot_create_the_store():
    whoami = {"name": "ada", "orgs": [{"name": "lab", "roleInOrg": "write"}],
              "auth": {"accessToken": {"displayName": "w", "role": "write"}}}
    assert "neither the token's user (ada) nor one of its orgs (lab)" in judge_hub_write(
        whoami, "elsewhere", "elsewhere/runs", exists=False)


def test_an_org_member_with_the_read_role_cannot_write_the_orgs_store():
    whoami = {"name": "ada", "orgs": [{"name": "lab", "roleInOrg": "read"}],
              "auth": {"accessToken": {"displayName": "w", "role": "write"}}}
    assert "role 'read' in lab" in judge_hub_write(whoami, "lab", "lab/runs", exists=True)


def test_a_fine_grained_token_writes_only_where_it_was_granted_repo_write():
    token = {"displayName": "fg", "role": "fineGrained", "fineGrained": {"scoped": [
        {"entity": {"type": "dataset", "name": "lab/runs"}, "permissions": ["repo.content.read", "repo.write"]}]}}
    whoami = {"name": "ada", "orgs": [{"name": "lab", "roleInOrg": "write"}], "auth": {"accessToken": token}}
    assert judge_hub_write(whoami, "lab", "lab/runs", exists=True) is None
    assert "no repo.write on lab" in judge_hub_write(whoami, "lab", "lab/other", exists=False)


def test_an_error_in_one_check_becomes_its_fail_line():
    def broken():
        raise httpx.ConnectError("connection refused")

    [check] = guarded("worker quota", broken)
    assert check.status == "FAIL" and "ConnectError: connection refused" in check.found and check.fix


def test_a_folder_store_fails_when_the_workers_are_runpods(tmp_path):
    check = check_store(f"file://{tmp_path}/store", Settings(runpod_api_url=API_URL))
    assert check.status == "FAIL" and "hf://datasets/" in check.fix


# --- the flow against the local stack ------------------------------------------------------------------


@dataclass
class Preflight:
    returncode: int
    output: str
    lines: dict[str, tuple[str, str, str | None]]
    """Check name → (status, found, fix)."""
    flow_run_id: str | None


def run_preflight(stack, run_file: Path, *args: str, env: dict[str, str | None] | None = None) -> Preflight:
    """`python -m flows.preflight RUN_FILE ARGS` against the stack; `env` changes (None removes a variable)."""
    base = {k: v for k, v in os.environ.items() if not k.startswith(("PREFECT_", "RUNPOD_", "HF_", "LORAFLOW_"))}
    full = base | stack.client_env | {"HF_TOKEN_BLOCK": NO_BLOCK, "RUNPOD_API_KEY_BLOCK": NO_BLOCK}
    for key, value in (env or {}).items():
        if value is None:
            full.pop(key, None)
        else:
            full[key] = value
    proc = subprocess.run([sys.executable, "-m", "flows.preflight", str(run_file), *args], cwd=REPO, env=full,
                          capture_output=True, text=True, timeout=300)
    lines = {}
    for line in proc.stdout.splitlines():
        if match := LINE.match(line):
            found, _, fix = match.group(3).partition(" — fix: ")
            lines[match.group(2)] = (match.group(1), found, fix or None)
    run = re.search(r"flow run ([0-9a-f-]{36}):", proc.stdout)
    return Preflight(proc.returncode, proc.stdout + proc.stderr, lines, run.group(1) if run else None)


def write_run_file(path: Path, *, model: str, dataset: str, store: str, gpus: str = '["RTX 4090", "A100 SXM"]',
                   budget_usd: float = 5.0) -> Path:
    path.write_text(f'''
name = "preflight-test"
artifact_store = "{store}"
deadline_minutes = 20
budget_usd = {budget_usd}
[model]
id = "{model}"
[dataset]
{dataset}
[compute]
gpu = {gpus}
''')
    return path


def account_state(stack) -> dict:
    """What the preflight must leave as it found it: RunPod's endpoints, volumes, secrets and jobs, and Prefect's
    endpoint limit and namespace Variable."""
    account = localpod_account(stack)
    secrets = httpx.get(f"{stack.localpod_url}/v2/account/secrets", timeout=10,
                        headers={"Authorization": f"Bearer {stack.client_env['RUNPOD_API_KEY']}"}).json()
    limit = prefect_api(stack, "POST", "/v2/concurrency_limits/filter", json={}).json()
    variables = prefect_api(stack, "POST", "/variables/filter", json={}).json()
    # A live endpoint's age grows by itself; what it is does not.
    endpoints = [{k: v for k, v in e.items() if k != "ageSeconds"} for e in account["endpoints"]]
    return {
        "endpoints": endpoints, "volumes": account["volumes"], "jobs": account["jobs"], "secrets": secrets,
        "limit": [(c["name"], c["limit"]) for c in limit if c["name"] == "runpod-endpoints"],
        "namespace": [v["value"] for v in variables if v["name"] == "loraflow-namespace"],
    }


def writes_to_localpod(stack) -> int:
    """Requests localpod has served that could change RunPod state (anything but a GET on its API)."""
    counts = httpx.get(f"{stack.localpod_url}/_localpod/requests", timeout=10).json()["by_route"]
    return sum(n for route, n in counts.items() if route.split()[1].startswith("/v2") and not route.startswith("GET"))


@pytest.fixture
def unchanged(local_stack):
    """Asserts, after the test, that nothing was created or changed on the account, in Prefect or by a write."""
    before, writes = account_state(local_stack), writes_to_localpod(local_stack)
    yield
    assert account_state(local_stack) == before
    assert writes_to_localpod(local_stack) == writes


@pytest.fixture(scope="module")
def hub_repos(local_stack) -> tuple[str, str]:
    """A model and a dataset on the Hub stand-in, as a real run's would be on the Hub."""
    api = HfApi(endpoint=local_stack.hub_url, token=local_stack.client_env["HF_TOKEN"])
    model, dataset = "preflight-org/tiny-model", "preflight-org/tiny-chat"
    api.create_repo(model, exist_ok=True)
    api.upload_file(path_or_fileobj=b'{"model_type": "qwen3"}', path_in_repo="config.json", repo_id=model)
    api.create_repo(dataset, repo_type="dataset", exist_ok=True)
    api.upload_file(path_or_fileobj=str(DATASET), path_in_repo="train.jsonl", repo_id=dataset, repo_type="dataset")
    return model, dataset


def test_a_wrong_runpod_key_fails_the_permission_checks_and_no_image_fails_the_image_check(
        local_stack, hub_repos, tmp_path, unchanged):
    model, dataset = hub_repos
    run_file = write_run_file(tmp_path / "run.toml", model=model, dataset=f'hub_id = "{dataset}"',
                              store=f"file://{tmp_path}/store")
    run = run_preflight(local_stack, run_file, env={"RUNPOD_API_KEY": "not-the-accounts-key",
                                                     "LORAFLOW_WORKER_IMAGE": None})
    assert run.returncode == 1, run.output
    for name, needs in (("runpod key: endpoints", "read/write on Serverless"), ("runpod key: secrets",
                        "read/write on secrets"), ("runpod key: network volumes", "read/write on network volumes")):
        status, found, fix = run.lines[name]
        assert status == "FAIL" and "401" in found, run.output
        assert needs in fix and "write access is not checked" in fix
    status, _, fix = run.lines["worker image"]
    assert status == "FAIL" and "LORAFLOW_WORKER_IMAGE=" in fix and "make image" in fix
    status, found, fix = run.lines["gpu RTX 4090: price"]
    assert status == "warn" and "401" in found and fix  # the catalog error named, the static price used
    assert run.lines["hub: model"][0] == "ok" and run.lines["artifact store"][0] == "ok"  # the others still ran


def test_no_runpod_key_fails_naming_the_variable_and_the_block_and_local_files_are_checked(
        local_stack, hub_repos, tmp_path, unchanged):
    model, _ = hub_repos
    bad = tmp_path / "chat.jsonl"
    bad.write_text('{"messages": [{"role": "user", "content": "hi"}]}\n{"text": "no chat here"}\n')
    (tmp_path / "a-file").write_text("")
    run_file = write_run_file(tmp_path / "run.toml", model=model, dataset=f'local_file = "{bad}"',
                              store=f"file://{tmp_path}/a-file/store")
    run = run_preflight(local_stack, run_file, env={"RUNPOD_API_KEY": None})
    assert run.returncode == 1, run.output
    status, found, fix = run.lines["runpod key: endpoints"]
    assert status == "FAIL" and "RUNPOD_API_KEY" in found and NO_BLOCK in found and "RUNPOD_API_KEY" in fix
    status, found, fix = run.lines["dataset file"]
    assert status == "FAIL" and "line 2" in found and fix
    status, found, fix = run.lines["artifact store"]
    assert status == "FAIL" and "is a file, not a folder" in found and fix


def test_each_failing_check_names_its_fix_and_the_run_exits_1(local_stack, tmp_path, unchanged):
    localpod = local_stack.localpod_url
    run_file = write_run_file(tmp_path / "run.toml", model="preflight-org/no-such-model",
                              dataset='hub_id = "preflight-org/no-such-dataset"', store="hf://datasets/preflight-org/runs",
                              budget_usd=0.1)
    run_file.write_text(f'hub_token_secret = "preflight-no-such-block"\n{run_file.read_text()}')
    try:
        httpx.post(f"{localpod}/_localpod/cuda", json={"pool": "ADA_24", "versions": ["12.4", "12.8"]},
                   timeout=10).raise_for_status()
        httpx.post(f"{localpod}/_localpod/stock", json={"pool": "AMPERE_80", "available": False},
                   timeout=10).raise_for_status()
        run = run_preflight(local_stack, run_file, "--worker-quota", "5", env={
            "LORAFLOW_WORKER_IMAGE": "registry.example/loraflow-worker:latest", "HF_TOKEN": None})
    finally:
        httpx.delete(f"{localpod}/_localpod/cuda", timeout=10).raise_for_status()
        httpx.post(f"{localpod}/_localpod/stock", json={"pool": "AMPERE_80", "available": True},
                   timeout=10).raise_for_status()
    assert run.returncode == 1, run.output
    expected = {
        "worker quota": ("FAIL", "> worker quota 5", "prefect gcl "),
        "worker image": ("FAIL", "names no job contract version", "make image"),
        "gpu RTX 4090: cuda": ("warn", "hosts run CUDA 12.4, 12.8; needs >= 13.0 (below)", "drop RTX 4090"),
        "gpu A100 SXM: stock": ("warn", "no stock now", "keep another GPU"),
        "cost ceiling": ("FAIL", "above budget_usd $0.10", "raise budget_usd"),
        "hub: model": ("FAIL", "preflight-org/no-such-model", "model.id"),
        "hub: dataset": ("FAIL", "no such dataset", "dataset.hub_id"),
        "artifact store": ("FAIL", "no Hub token", "write access to preflight-org"),
        "hub token: hub_token_secret": ("FAIL", "preflight-no-such-block", "create the Secret block"),
    }
    for name, (status, found, fix) in expected.items():
        assert name in run.lines, run.output
        assert run.lines[name][0] == status and found in run.lines[name][1] and fix in run.lines[name][2], \
            (name, run.lines[name])
    assert "gpu RTX 4090: stock" not in run.lines  # below its floor: no stock to count
    assert re.search(r"--limit \d+", run.lines["worker quota"][2])
    [artifact] = prefect_api(local_stack, "POST", "/artifacts/filter", json={
        "artifacts": {"key": {"any_": ["preflight"]}, "flow_run_id": {"any_": [run.flow_run_id]}}}).json()
    rows = json.loads(artifact["data"])  # Prefect stores a table artifact's rows as a JSON string
    assert {(row["check"], row["status"]) for row in rows} >= {(n, s) for n, (s, _, _) in expected.items()}
    assert all(row["fix"] for row in rows if row["status"] != "ok")


def test_a_ready_setup_passes_every_check_and_exits_0(local_stack, hub_repos, tmp_path, unchanged):
    model, dataset = hub_repos
    store = "preflight-org/runs-ready"
    run_file = write_run_file(tmp_path / "run.toml", model=model, dataset=f'hub_id = "{dataset}"',
                              store=f"hf://datasets/{store}")
    run = run_preflight(local_stack, run_file, "--worker-quota", "30")
    assert run.returncode == 0, run.output
    assert len(run.lines) >= 15, run.output
    for name, (status, found, fix) in run.lines.items():
        if name == "artifact store" and status == "warn":
            # The documented warn: a Hub that does not answer /api/whoami-v2 (the stand-in) leaves the token's
            # write access unknown.
            assert "whoami-v2 answered 404" in found and fix
            continue
        assert status == "ok", (name, found, fix)
    assert "EU-RO-1" in run.lines["datacenters with volumes"][1]
    assert not HfApi(endpoint=local_stack.hub_url).repo_exists(store, repo_type="dataset")  # looked at, not made


def test_a_study_file_is_checked_as_its_first_child_once_every_child_is_valid(local_stack, hub_repos, tmp_path,
                                                                               unchanged):
    model, dataset = hub_repos
    run_file = write_run_file(tmp_path / "study.toml", model=model, dataset=f'hub_id = "{dataset}"',
                              store="hf://datasets/preflight-org/runs-study")
    run_file.write_text(run_file.read_text() + '[study]\nseeds = [1, 2]\nmetric = "train_loss"\n')
    run = run_preflight(local_stack, run_file, "--worker-quota", "30")
    assert run.returncode == 0, run.output
    assert "A study of 2 runs, each valid; checking its first, preflight-test-s1 (training.seed=1)" in run.output
    assert run.lines["cost ceiling"][0] == "ok", run.output

    run_file.write_text(run_file.read_text().replace("seeds = [1, 2]", 'grid = {"lora.rank" = [8, 4096]}'))
    refused = run_preflight(local_stack, run_file, "--worker-quota", "30")
    assert refused.returncode == 1 and "child 2 (lora.rank=4096)" in refused.output, refused.output
    assert refused.flow_run_id is None  # refused before the preflight's flow started


def test_the_preflight_deployment_checks_the_qwen_run():
    from flows.forms.run import RunSpec

    deployments = {d["name"]: d for d in yaml.safe_load((REPO / "prefect.yaml").read_text())["deployments"]}
    check = deployments["check"]
    assert check["entrypoint"] == "flows/preflight.py:preflight"
    assert RunSpec.model_validate(check["parameters"]["spec"]) == RunSpec.model_validate(
        tomllib.loads((REPO / "deployments" / "qwen.toml").read_text()))
    assert "worker_quota" in check["parameters"]


# --- a recording of RunPod's answers, replayed ---------------------------------------------------------------

RECORDED_SECRET = ("preflight-recording-secret", "secret-value-only-runpod-holds-1234")
PLAIN_ENV = {"PLAIN_SETTING": "plain-env-value-anyone-reads-5678", "WANDB_API_KEY": "wandb-key-in-plain-env-9012"}


@pytest.fixture
def account_with_secrets(local_stack):
    """An account secret, and an endpoint whose env refers to it and holds plain values too (a person's, not
    loraflow's): what a recording must not write."""
    auth = {"Authorization": f"Bearer {local_stack.client_env['RUNPOD_API_KEY']}"}
    api = f"{local_stack.localpod_url}/v2"
    name, value = RECORDED_SECRET
    secret = httpx.post(f"{api}/account/secrets", json={"name": name, "value": value}, headers=auth, timeout=10)
    secret.raise_for_status()
    env = {"HF_TOKEN": f"{{{{ RUNPOD_SECRET_{name} }}}}", **PLAIN_ENV}
    endpoint = httpx.post(f"{api}/serverless", headers=auth, timeout=10, json={
        "name": "someones-server", "type": "QUEUE", "scaling": {"type": "QUEUE_DELAY", "queueDelay": 4},
        "image": "localpod/unused:latest", "gpu": {"pools": ["ADA_24"]}, "workers": {"max": 0}, "env": env})
    endpoint.raise_for_status()
    yield env
    httpx.delete(f"{api}/serverless/{endpoint.json()['id']}", headers=auth, timeout=10).raise_for_status()
    httpx.delete(f"{api}/account/secrets/{secret.json()['id']}", headers=auth, timeout=10).raise_for_status()


def catalog_reads(url: str, key: str) -> dict[str, object]:
    """What a localpod's catalog answers: GPU types with prices, their serverless stock and CUDA versions (unscoped
    and at the image's floor), and the datacenters with their GPU stock."""
    auth = {"Authorization": f"Bearer {key}"}
    serverless = {"include": "AVAILABILITY", "product": "SERVERLESS"}
    reads = {"gpus": ("/v2/catalog/gpus", {}), "serverless": ("/v2/catalog/gpus", serverless),
             "floor": ("/v2/catalog/gpus", serverless | {"minCudaVersion": "13.0"}),
             "datacenters": ("/v2/catalog/datacenters", {"include": "GPU_AVAILABILITY"})}
    answers = {}
    for what, (path, params) in reads.items():
        answer = httpx.get(f"{url}{path}", params=params, headers=auth, timeout=10)
        answer.raise_for_status()
        answers[what] = answer.json()
    return answers


def test_a_recording_holds_no_secret_and_a_localpod_on_it_serves_the_same_catalog(
        local_stack, hub_repos, account_with_secrets, tmp_path, unchanged):
    from deployments.local_stack import free_port, start_service

    model, dataset = hub_repos
    run_file = write_run_file(tmp_path / "run.toml", model=model, dataset=f'hub_id = "{dataset}"',
                              store=f"file://{tmp_path}/store")
    folder = tmp_path / "recording"
    run = run_preflight(local_stack, run_file, "--worker-quota", "30", "--record", str(folder))
    assert re.search(rf"\d+ answers of RunPod recorded in {re.escape(str(folder))} ", run.output), run.output

    manifest = json.loads((folder / "manifest.json").read_text())
    asked = {(a["route"], tuple(sorted(a["query"].items()))) for a in manifest["answers"]}
    assert ("/v2/catalog/gpus", (("include", "AVAILABILITY"), ("minCudaVersion", "13.0"),
                                 ("product", "SERVERLESS"))) in asked
    assert {route for route, _ in asked} >= {"/v2/catalog/gpus", "/v2/catalog/datacenters", "/v2/serverless",
                                             "/v2/network-volumes", "/v2/account/secrets"}
    assert manifest["api_host"] == "127.0.0.1" and manifest["loraflow_version"]
    written = "\n".join(path.read_text() for path in folder.iterdir())
    known = [local_stack.client_env["RUNPOD_API_KEY"], local_stack.client_env["HF_TOKEN"], RECORDED_SECRET[1],
             *PLAIN_ENV.values()]
    assert [value for value in known if value in written] == []
    assert account_with_secrets["HF_TOKEN"] in written  # a secret's name, not its value: kept

    port = free_port()
    replay = start_service("localpod-replay", [
        sys.executable, "-m", "localpod", "--port", str(port), "--api-key", "replay-key", "--catalog-from", str(folder),
        "--worker-command", f"{sys.executable} -c pass"], dict(os.environ), f"http://127.0.0.1:{port}",
        "/_localpod/account", tmp_path / "replay.log")
    try:
        served = catalog_reads(replay.url, "replay-key")
    finally:
        replay.stop()
    assert "localpod serves the catalog recorded from 127.0.0.1" in (tmp_path / "replay.log").read_text()
    assert served == catalog_reads(local_stack.localpod_url, local_stack.client_env["RUNPOD_API_KEY"])
