"""A serve's decisions before and around its endpoint, as plain functions: its endpoint's name (kind and expiry, read
back by the reconciler), the slots and workers it asks for, the GPU memory it needs and the GPU it takes, the adapters
as RunPod's vLLM worker reads them (the worker's own argument rules read them back here), MAX_LORA_RANK, the adapters
vLLM refuses, the serve file's refusals and defaults, the container disk, the cold-start diagnosis, "try it", the
cost count and the watch. The endpoint's life itself: tests/test_serve_e2e.py."""

from __future__ import annotations

import importlib.util
import json
import shlex
import sys
from datetime import datetime, timedelta, timezone
from pathlib import Path

import httpx
import pytest
from loraflow_worker.evaluation.vllm_lora import adapter_rank, max_lora_rank
from pydantic import ValidationError

from flows.forms.serve import DEFAULT_MAX_MODEL_LEN, ServeSpec
from flows.serve import check_serve_cap, serve, serving_length
from flows.forms.run import PublishServe, RunSpec
from tasks.jobs.serve import (
    SERVING_TOKEN_ENV,
    VLLM_IMAGE_MIN_CUDA,
    VLLM_WORKER_IMAGE,
    ServePlan,
    TEMPLATE_DISK_GB,
    lora_env,
    serving_disk_gb,
    serving_env,
    serving_request,
    summary_key,
)
from tasks.jobs.serve_watch import CRASH_LOOP_WORKERS, Answer, RepoWatch, StartupWatch, TryReport, WorkerTime, ask, \
    watch_serving
from tasks.lifecycle.liveness import HeartbeatIntervals
from tasks.lifecycle.reconcile import EndpointsSeen, LiveRun, RunsSeen, decide
from tasks.placement.gpu_fit import GIB
from tasks.placement.serving_fit import ServingGpuRefused, choose_serving_gpu, serving_memory
from tasks.placement.weight_cache import DataCenterCache
from tasks.preflight.server_rules import ServerRuleError
from tasks.runpod.catalog import GPU_CLASSES, resolve_gpu
from tasks.runpod.endpoints import MAX_ENDPOINT_NAME, endpoint_name, parse_endpoint_name, run_hash, \
    serving_endpoint_name
from tasks.runpod.live_catalog import GpuOffer
from tasks.runpod.models import Endpoint, EndpointWorker, Health
from tasks.storage.served_adapters import AdapterRefused, ServedAdapter, default_adapter_name, resolve_adapter, \
    run_adapter_refusals, vllm_refusals
from tests.test_spec import minimal

REPO = Path(__file__).resolve().parent.parent
NS = "k7q2mx"
NOW = datetime(2026, 12, 5, 12, 0, tzinfo=timezone.utc)
QWEN3_8B = {"model_type": "qwen3", "hidden_size": 4096, "intermediate_size": 12288, "num_hidden_layers": 36,
            "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 151936,
            "tie_word_embeddings": False, "max_position_embeddings": 40960}


# --- names ---------------------------------------------------------------------------------------------------------

def test_a_serving_endpoints_name_says_its_namespace_its_kind_and_its_expiry_and_parses_back():
    expires = NOW.timestamp() + 8 * 3600 + 0.4
    name = serving_endpoint_name("serve-run-1", "support-bot", NS, expires)
    assert name == f"loraflow-support-bot-{run_hash('serve-run-1')}-{NS}-s{int(expires) + 1}"
    parsed = parse_endpoint_name(name)
    assert parsed.serving and parsed.namespace == NS and parsed.run_hash == run_hash("serve-run-1")
    assert parsed.label == "support-bot" and parsed.attempt == 0
    assert parsed.expires_at == int(expires) + 1  # rounded up: never deleted before its time


def test_a_jobs_endpoint_is_no_serving_endpoint():
    parsed = parse_endpoint_name(endpoint_name("run-1", 2, "support-bot", NS))
    assert not parsed.serving and parsed.expires_at is None and parsed.attempt == 2


@pytest.mark.parametrize("label", ["a" * 200, "ÜBER bot!!", ""])
def test_a_long_serve_name_is_cut_so_the_endpoint_name_fits(label):
    name = serving_endpoint_name("r", label, "z" * 8, NOW.timestamp())
    assert len(name) <= MAX_ENDPOINT_NAME and parse_endpoint_name(name).serving


def test_the_serve_summary_key_is_a_valid_artifact_key():
    assert summary_key("Support_Bot.v2") == "serve-support-bot-v2"


# --- the reconciler ------------------------------------------------------------------------------------------------

def reconcile_one(name, runs, now, min_age=2, created_minutes_ago=30):
    created = (now - timedelta(minutes=created_minutes_ago)).isoformat().replace("+00:00", "Z")
    endpoint = Endpoint.model_validate({"id": "ep", "name": name, "workers": {"min": 0, "max": 2}, "createdAt": created})
    idle = Health.model_validate({"jobs": {"inQueue": 0, "inProgress": 0}, "workers": {"idle": 0}})
    [finding] = decide(EndpointsSeen(endpoints=[endpoint], health={"ep": idle}), RunsSeen(runs=runs), NS, now,
                       silent_after_s=600, idle_grace_s=300, min_age_s=min_age * 60,
                       intervals=HeartbeatIntervals(endpoint_s=60, flow_run_s=180))
    return finding


def test_the_reconciler_keeps_a_serving_endpoint_of_a_live_run_until_its_expiry_though_it_has_no_job():
    name = serving_endpoint_name("serve-run", "bot", NS, (NOW + timedelta(hours=1)).timestamp())
    live = [LiveRun(id="serve-run", state="Running", last_seen=NOW - timedelta(minutes=1))]
    finding = reconcile_one(name, live, NOW)  # idle for longer than the grace: a job's endpoint would go
    assert finding.action == "keep" and "serving until" in finding.reason
    assert finding.expires_at == datetime.fromtimestamp(parse_endpoint_name(name).expires_at, timezone.utc)


def test_the_reconciler_deletes_a_serving_endpoint_once_its_expiry_has_passed_though_its_run_lives():
    name = serving_endpoint_name("serve-run", "bot", NS, (NOW - timedelta(seconds=1)).timestamp())
    live = [LiveRun(id="serve-run", state="Running", last_seen=NOW)]
    finding = reconcile_one(name, live, NOW, created_minutes_ago=1)  # even younger than min_age
    assert finding.action == "delete" and "time ran out" in finding.reason


def test_the_reconciler_deletes_a_serving_endpoint_whose_run_is_gone():
    name = serving_endpoint_name("serve-run", "bot", NS, (NOW + timedelta(hours=1)).timestamp())
    finding = reconcile_one(name, [], NOW)
    assert finding.action == "delete" and "final or missing" in finding.reason


# --- memory and GPU --------------------------------------------------------------------------------------------------

def test_the_memory_estimate_of_qwen3_8b_counts_bf16_weights_lora_slots_and_one_sequences_kv_cache():
    memory = serving_memory(QWEN3_8B, max_model_len=8192, max_loras=2, max_lora_rank=16)
    # 36 layers × (q, k, v, o, gate, up, down) + embeddings + head, in bf16.
    assert memory.weights_bytes == 16_381_470_720
    assert memory.kv_bytes_per_token == 2 * 36 * 8 * 128 * 2 == 147_456  # K and V × layers × KV heads × head dim × bf16
    assert memory.kv_cache_bytes == 8192 * 147_456
    # Two slots at rank 16 over every linear layer's in + out widths (36 × 75,776), in bf16.
    assert memory.lora_bytes == 2 * 16 * 36 * 75_776 * 2
    assert 18 < memory.total_bytes / GIB < 19


def test_a_longer_context_needs_more_kv_cache_and_a_model_can_outgrow_a_24_gib_card():
    short = serving_memory(QWEN3_8B, max_model_len=4096, max_loras=1, max_lora_rank=8)
    long = serving_memory(QWEN3_8B, max_model_len=40960, max_loras=1, max_lora_rank=8)
    assert long.kv_cache_bytes == 10 * short.kv_cache_bytes
    assert short.fits(GPU_CLASSES["RTX 4090"]) and not long.fits(GPU_CLASSES["RTX 4090"])
    assert long.fits(GPU_CLASSES["A100 SXM"])


def offer(gpu, price, stock=("EU-RO-1",), cuda=("12.8", "13.0")):
    return GpuOffer(gpu=gpu, pool=GPU_CLASSES[gpu].pool, usd_per_hour=price, source="catalog",
                    cuda_versions=list(cuda), data_centers={dc: "HIGH" for dc in stock})


def test_the_cheapest_gpu_that_holds_the_serve_and_is_in_stock_is_chosen():
    memory = serving_memory(QWEN3_8B, max_model_len=8192, max_loras=1, max_lora_rank=16)
    gpus = [resolve_gpu(g) for g in ("a100", "4090", "h100")]
    offers = {"A100 SXM": offer("A100 SXM", 2.7), "RTX 4090": offer("RTX 4090", 1.1, stock=()),
              "H100": offer("H100", 2.0)}
    chosen, passed = choose_serving_gpu(gpus, offers, memory, VLLM_IMAGE_MIN_CUDA)
    assert chosen.name == "H100"  # the 4090 is cheaper but has no stock
    assert any("RTX 4090" in p and "no stock" in p for p in passed)


def test_a_serve_no_gpu_of_its_list_holds_is_refused_naming_the_field_and_a_class_that_would():
    memory = serving_memory(QWEN3_8B, max_model_len=40960, max_loras=1, max_lora_rank=8)
    with pytest.raises(ServingGpuRefused, match=r"serve\.gpu: .*RTX 4090 .*cannot hold.*add RTX 5090 to serve\.gpu"):
        choose_serving_gpu([resolve_gpu("4090")], {"RTX 4090": offer("RTX 4090", 1.1)}, memory, VLLM_IMAGE_MIN_CUDA)


def test_a_gpu_list_of_another_form_is_refused_naming_that_forms_field_and_fix():
    memory = serving_memory(QWEN3_8B, max_model_len=40960, max_loras=1, max_lora_rank=8)
    with pytest.raises(ServingGpuRefused, match=r"^evaluate\.gpu: .*add RTX 5090 to evaluate\.gpu, or evaluate fewer "
                       r"adapters\.$"):
        choose_serving_gpu([resolve_gpu("4090")], {"RTX 4090": offer("RTX 4090", 1.1)}, memory, VLLM_IMAGE_MIN_CUDA,
                           field="evaluate.gpu", smaller="evaluate fewer adapters")


def test_a_gpu_whose_hosts_do_not_run_the_vllm_images_cuda_is_passed_over():
    memory = serving_memory(QWEN3_8B, max_model_len=4096, max_loras=1, max_lora_rank=8)
    offers = {"RTX 4090": offer("RTX 4090", 1.1, cuda=("12.8",)), "A100 SXM": offer("A100 SXM", 2.7)}
    chosen, passed = choose_serving_gpu([resolve_gpu("4090"), resolve_gpu("a100")], offers, memory, "13.0")
    assert chosen.name == "A100 SXM" and "no host runs the vLLM worker image" in passed[0]


# --- adapters, env and request ------------------------------------------------------------------------------------

def adapter(name, path, rank=16):
    return ServedAdapter(name=name, source=path, path=path, rank=rank)


def load_script(name: str):
    """A module of the vLLM worker stand-in (a script whose siblings import each other by their bare names)."""
    folder = REPO / "localpod" / "vllm_worker"
    sys.path.insert(0, str(folder))
    try:
        spec = importlib.util.spec_from_file_location(f"standin_{name}", folder / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module  # its dataclasses look their module up
        spec.loader.exec_module(module)
        return module
    finally:
        sys.path.remove(str(folder))


def lora_modules_the_worker_reads(env):
    """What `vllm serve --lora-modules` gets from this env, by the worker's own argument rules (the stand-in copies
    the real worker's args_builder and vLLM's parser)."""
    args_builder, serve = load_script("args_builder"), load_script("serve")
    args, _ = serve.parser().parse_known_args(args_builder.build_args(env))
    return [(m.name, m.path) for m in args.lora_modules]


def test_one_adapter_goes_in_lora_modules_as_name_equals_path():
    env = lora_env([adapter("bot", "org/bot-lora")])
    assert env == {"LORA_MODULES": "bot=org/bot-lora"}
    assert lora_modules_the_worker_reads(env) == [("bot", "org/bot-lora")]


def test_several_adapters_go_in_vllm_extra_args_as_one_lora_modules_list_never_a_json_array():
    env = lora_env([adapter("a", "org/a"), adapter("b", "/data/my adapters/b")])
    assert set(env) == {"VLLM_EXTRA_ARGS"}
    assert shlex.split(env["VLLM_EXTRA_ARGS"]) == ["--lora-modules", "a=org/a", "b=/data/my adapters/b"]
    assert lora_modules_the_worker_reads(env) == [("a", "org/a"), ("b", "/data/my adapters/b")]


@pytest.mark.parametrize(("ranks", "expected"), [([8], 8), ([16], 16), ([8, 17], 32), ([64, 128], 128),
                                                  ([300], 320), ([1], 1)])
def test_max_lora_rank_is_the_smallest_value_vllm_accepts_at_or_above_every_adapters_rank(ranks, expected):
    assert max_lora_rank(ranks) == expected


def test_a_rank_above_what_vllm_accepts_is_refused():
    with pytest.raises(ValueError, match="above 512"):
        max_lora_rank([1024])


def test_an_adapters_rank_is_the_largest_of_r_and_its_per_module_ranks():
    assert adapter_rank({"r": 8, "rank_pattern": {"q_proj": 64}}) == 64
    assert adapter_rank({"r": 16}) == 16
    with pytest.raises(ValueError):
        adapter_rank({"lora_alpha": 16})


PLAIN = {"r": 16, "lora_alpha": 32, "target_modules": ["q_proj", "v_proj"], "use_dora": False,
         "modules_to_save": None, "base_model_name_or_path": "Qwen/Qwen3-8B"}


def test_a_plain_lora_adapter_is_one_vllm_loads():
    assert vllm_refusals(PLAIN) == [] and vllm_refusals(PLAIN | {"target_modules": "all-linear", "r": 512}) == []


def test_an_adapter_with_a_classifiers_head_or_an_init_of_its_first_weights_only_is_one_vllm_loads():
    assert vllm_refusals(PLAIN | {"modules_to_save": ["score"], "init_lora_weights": "gaussian"}) == []
    assert vllm_refusals(PLAIN | {"init_lora_weights": True}) == []  # a PiSSA adapter converted, as loraflow stores it


@pytest.mark.parametrize(("change", "words"), [
    ({"use_dora": True}, "`use_dora` is set: vLLM does not load DoRA adapters"),
    ({"modules_to_save": ["lm_head"]}, "`modules_to_save` is ['lm_head']: vLLM loads LoRA weights only"),
    ({"target_modules": ["q_proj", "lm_head"]}, "`target_modules` includes lm_head"),
    ({"target_modules": r".*\.(embed_tokens|q_proj)"}, "`target_modules` includes embed_tokens"),
    ({"r": 1024}, "`r` 1024 is above 512"),
    ({"lora_bias": True}, "`lora_bias` or `bias` is set: vLLM does not load trained biases"),
    ({"init_lora_weights": "pissa_niter_4"}, "`init_lora_weights` is 'pissa_niter_4': vLLM does not load an adapter "
                                             "whose init rewrites the base"),
    ({"layer_replication": [[0, 4], [2, 5]]}, "it uses layer replication, which vLLM does not implement"),
])
def test_an_adapter_vllm_refuses_is_said_naming_the_field_and_why(change, words):
    assert [words in reason for reason in vllm_refusals(PLAIN | change)] == [True]


def test_an_adapter_config_without_vllms_required_fields_is_refused_naming_them():
    assert vllm_refusals({"r": 8}) == ["`lora_alpha`, `target_modules` missing: vLLM requires r, lora_alpha and "
                                       "target_modules"]


def write_adapter(folder: Path, config: dict) -> Path:
    folder.mkdir(parents=True)
    (folder / "adapter_config.json").write_text(json.dumps(config))
    return folder


def test_a_dora_adapter_is_refused_before_renting_naming_the_entry_the_field_and_the_way_out(tmp_path):
    folder = write_adapter(tmp_path / "dora", PLAIN | {"use_dora": True})
    with pytest.raises(AdapterRefused) as refused:
        resolve_adapter(str(folder), None, base_model="Qwen/Qwen3-8B", store_url=None, token=None, hub_endpoint=None,
                        local_ok=True, field="serve.adapters[1]")
    message = str(refused.value)
    assert message.startswith("serve.adapters[1]: vLLM refuses the adapter") and "`use_dora` is set" in message
    assert "merge it into the base" in message


def test_a_runs_lora_section_is_held_to_the_same_rule_as_its_stored_adapter():
    assert run_adapter_refusals({"rank": 16, "use_dora": True})[0].startswith("`use_dora` is set")
    assert run_adapter_refusals({"rank": 16, "modules_to_save": ["embed_tokens"]})[0].startswith("`modules_to_save`")
    assert run_adapter_refusals({"rank": 16, "target_modules": "all-linear"}) == []
    assert run_adapter_refusals({"rank": 512, "init": "pissa"})[0].startswith("`r` 1024")  # stored at twice the rank


def test_an_adapters_default_name_is_the_last_part_of_its_source():
    assert [default_adapter_name(s) for s in ("runs/3f1c", "org/support-lora", "/data/adapters/bot/")] == \
        ["3f1c", "support-lora", "bot"]


def plan(**changes) -> ServePlan:
    memory = serving_memory(QWEN3_8B, max_model_len=8192, max_loras=2, max_lora_rank=32)
    fields = dict(run_id="run-1", name="bot", endpoint_name=serving_endpoint_name("run-1", "bot", NS, 2e9),
                  expires_at=2e9, base_model="Qwen/Qwen3-8B", base_revision="abc123",
                  adapters=[adapter("a", "org/a", 8), adapter("b", "org/b", 32)], max_lora_rank=32,
                  max_model_len=8192, memory=memory, gpu=GPU_CLASSES["RTX 4090"], usd_per_hour=1.1, max_workers=3,
                  idle_timeout_s=60, budget_usd=20, prompts=["hi"], max_tokens=32, cold_start_s=1200, disk_gb=37)
    return ServePlan(**(fields | changes))


def test_the_endpoint_runs_the_pinned_vllm_image_with_min_zero_max_workers_and_the_serves_idle_timeout():
    request = serving_request(plan(), {"HF_ENDPOINT": "https://hub"})
    assert request.image == VLLM_WORKER_IMAGE and request.image.startswith("runpod/worker-v1-vllm:v2.")
    assert (request.workers.min, request.workers.max, request.workers.idle_timeout) == (0, 3, 60)
    assert request.gpu.count == 1 and request.gpu.pools == ["ADA_24"]
    assert request.gpu.min_cuda_version == "13.0"  # the image's CUDA floor, above the 4090's own 12.8
    assert request.network_volumes is None and request.data_center_ids is None


def test_the_workers_env_names_the_base_lora_settings_and_the_token_variable_the_worker_does_not_log():
    env = serving_env(plan(), {"HF_ENDPOINT": "https://hub", SERVING_TOKEN_ENV: "{{ RUNPOD_SECRET_x }}"})
    assert SERVING_TOKEN_ENV == "HUGGING_FACE_HUB_TOKEN" and "HF_TOKEN" not in env
    assert env["MODEL_NAME"] == "Qwen/Qwen3-8B" and env["MODEL_REVISION"] == "abc123"
    assert (env["ENABLE_LORA"], env["MAX_LORAS"], env["MAX_LORA_RANK"], env["MAX_MODEL_LEN"]) == \
        ("true", "2", "32", "8192")
    assert env["RUNPOD_INIT_TIMEOUT"] == "1200"
    assert "HF_HOME" not in env  # no warm volume: the image's own cache


def test_a_cold_start_allowance_past_20_minutes_reaches_both_clocks_that_end_a_start():
    env = serving_env(plan(cold_start_s=45 * 60), {})
    assert env["RUNPOD_INIT_TIMEOUT"] == env["VLLM_STARTUP_TIMEOUT"] == "2700"  # the worker's own default is 1,200 s


def test_the_container_disk_holds_the_image_vllms_caches_and_the_weights_and_never_less_than_runpods_template():
    assert serving_disk_gb(16 * 10**9, base_on_volume=False) == TEMPLATE_DISK_GB == 150
    assert serving_disk_gb(240 * 10**9, base_on_volume=False) == 240 + 30 + 10
    assert serving_disk_gb(240 * 10**9, base_on_volume=True) == 150  # the weights are on the volume


def test_a_warm_volume_is_attached_and_the_workers_hub_cache_pointed_at_loraflows_copy_on_it():
    cache = DataCenterCache(data_center="EU-RO-1", volume_id="vol1", volume_gb=50)
    request = serving_request(plan(cache=cache), serving_env(plan(cache=cache), {}))
    assert request.network_volumes == ["vol1"] and request.data_center_ids == ["EU-RO-1"]
    # Where preload writes (`<volume>/huggingface/hub`); HF_HUB_CACHE and HUGGINGFACE_HUB_CACHE too, since the image
    # bakes HUGGINGFACE_HUB_CACHE and huggingface_hub prefers it to HF_HOME.
    assert request.env["HF_HOME"] == "/runpod-volume/huggingface"
    assert request.env["HF_HUB_CACHE"] == request.env["HUGGINGFACE_HUB_CACHE"] == "/runpod-volume/huggingface/hub"


# --- the serve file --------------------------------------------------------------------------------------------------

def spec(**serve):
    return ServeSpec.model_validate({"name": "bot", "serve": {"base_model": "Qwen/Qwen3-8B", "hours": 1,
                                                              "budget_usd": 5, "adapters": ["runs/r1"]} | serve})


def test_adapters_are_source_strings_or_name_and_source_tables():
    adapters = spec(adapters=["runs/r1", {"name": "other", "source": "org/x"}]).serve.adapters
    assert [(a.name, a.source) for a in adapters] == [(None, "runs/r1"), ("other", "org/x")]


@pytest.mark.parametrize(("serve", "words"), [
    ({"adapters": ["org/x", "other-org/x"]}, "taken twice"),
    ({"adapters": []}, "adapters"),
    ({"hours": 0}, "hours"),
    ({"max_workers": 0}, "max_workers"),
    ({"adapters": [{"name": "a=b", "source": "org/x"}]}, "name"),
    ({"gpus": ["h100"]}, "gpus"),
    ({"max_model_len": 128, "max_tokens": 128}, "max_tokens 128 leaves no room for a prompt within max_model_len 128"),
])
def test_a_serve_file_with_a_bad_field_is_refused_naming_it(serve, words):
    with pytest.raises(ValidationError, match=words):
        spec(**serve)


def test_a_serve_file_outside_the_inputs_folder_is_refused_before_it_is_read(tmp_path, monkeypatch):
    inputs = tmp_path / "inputs"
    inputs.mkdir()
    secret = tmp_path / "control-plane.toml"
    secret.write_text('key = "rpa_not_yours"\n')
    monkeypatch.setenv("LORAFLOW_INPUTS_DIR", str(inputs))

    with pytest.raises(ServerRuleError) as refused:  # the flow's body, as a deployment run's `serve_file` starts it
        serve.fn(spec(), serve_file=str(secret))
    message = str(refused.value)
    assert message.startswith(f"parameter serve_file {str(secret)!r} is outside this server's inputs folder {inputs} "
                              "(LORAFLOW_INPUTS_DIR)") and "rpa_not_yours" not in message


def test_a_serve_above_the_operators_cap_is_refused_as_a_run_is_naming_the_figures_and_the_setting():
    with pytest.raises(ValueError) as refused:
        check_serve_cap(spec(hours=24, max_workers=5).serve, "H200", 4.0, cap_usd=50)
    assert str(refused.value) == (
        "the serve (H200 at $4.00/hr × serve.max_workers 5 × serve.hours 24) may cost up to $480.00, above this "
        "server's cap of $50.00 per run (LORAFLOW_MAX_RUN_USD, set by its operator): lower serve.hours or "
        "serve.max_workers, or ask the operator")
    check_serve_cap(spec(hours=10).serve, "H200", 4.0, cap_usd=50)


@pytest.mark.parametrize("block", ["hf-token", "runpod-api-key", "loraflow-secret-key-k7q2mx"])
def test_a_serve_naming_one_of_the_servers_own_blocks_as_its_token_is_refused_naming_the_field(block):
    from prefect.logging import disable_run_logger

    from flows.serve import check_serve

    with pytest.raises(ServerRuleError, match=f"hub_token_secret: the Prefect Secret block '{block}' is this server's "
                                              "own"), disable_run_logger():  # the check's first step, before any read
        check_serve.fn(ServeSpec.model_validate(spec().model_dump() | {"hub_token_secret": block}), "serve-run-1")


@pytest.mark.parametrize(("asked", "context", "served"), [
    (None, 1024, 1024),  # a short base is served at its context
    (None, 40960, DEFAULT_MAX_MODEL_LEN),
    (None, None, DEFAULT_MAX_MODEL_LEN),
    (2048, 40960, 2048),
    (1024, 1024, 1024),
])
def test_max_model_len_is_as_asked_else_the_default_or_the_bases_shorter_context(asked, context, served):
    assert serving_length(asked, context, base="tiny") == served


def test_a_serve_file_without_max_model_len_leaves_it_to_the_bases_context():
    assert spec().serve.max_model_len is None


def test_a_max_model_len_above_the_bases_context_is_refused_naming_both():
    with pytest.raises(ValueError, match="serve.max_model_len 2048 is above tiny's context of 1024 tokens"):
        serving_length(2048, 1024, base="tiny")


def test_the_shipped_serve_file_is_a_valid_serve():
    import tomllib

    shipped = ServeSpec.model_validate(tomllib.loads((REPO / "deployments" / "qwen-serve.toml").read_text()))
    assert shipped.serve.hours > 0 and shipped.serve.budget_usd > 0 and shipped.serve.adapters


# --- a run's `[publish] serve` -------------------------------------------------------------------------------------

def test_publish_serve_true_takes_every_default_and_the_runs_budget():
    run = RunSpec.model_validate(minimal(budget_usd=9, publish={"serve": True}))
    assert run.publish.serve == PublishServe() and run.publish.serve.hours == 1 and run.publish.serve.budget_usd is None
    assert run.publish.hub_model_id is None  # serving alone is a reason for [publish]


def test_publish_serve_without_a_budget_of_its_own_or_the_runs_is_refused_naming_both():
    with pytest.raises(ValidationError, match=r"publish.serve needs a budget: set publish.serve.budget_usd .* or the "
                                              r"run's budget_usd"):
        RunSpec.model_validate(minimal(publish={"serve": True}))


def test_publish_serve_false_serves_nothing_and_leaves_publish_naming_no_repo_refused():
    with pytest.raises(ValidationError, match=r"\[publish\] names no repo and serves nothing"):
        RunSpec.model_validate(minimal(publish={"serve": False}))


@pytest.mark.parametrize("field", ["hourz", "adapters", "base_model", "source"])
def test_publish_serve_takes_no_other_setting_and_so_serves_only_the_runs_own_adapter(field):
    # A teammate cannot point a run's serve at someone else's adapter or base: it serves what the run trained.
    with pytest.raises(ValidationError, match=rf"publish.serve.{field}"):
        RunSpec.model_validate(minimal(publish={"serve": {field: "runs/someone-elses-run", "budget_usd": 3}}))


# --- cold start and watch -------------------------------------------------------------------------------------------

def workers(*pairs):
    return [EndpointWorker(id=i, status=s) for i, s in pairs]


def test_workers_that_die_while_starting_one_after_the_other_are_a_crash_loop_said_as_such():
    watch = StartupWatch()
    for n in range(CRASH_LOOP_WORKERS + 1):
        watch.see(workers((f"w{n}", "INITIALIZING")))
        assert watch.crash_loop == (n >= CRASH_LOOP_WORKERS)
    text = watch.diagnosis(95, max_lora_rank=16, gpu="RTX 4090")
    assert "crash loop" in text and "MAX_LORA_RANK (16 here)" in text and "2 workers started and were gone" in text


def test_a_worker_that_answered_and_idled_away_is_no_crash_loop():
    watch = StartupWatch()
    for sample in (workers(("w1", "INITIALIZING")), workers(("w1", "IDLE")), [], workers(("w2", "INITIALIZING")), []):
        watch.see(sample)
    assert not watch.crash_loop


def test_an_unhealthy_worker_is_a_crash_loop_and_no_stock_or_a_slow_start_are_said_otherwise():
    unhealthy = StartupWatch()
    unhealthy.see(workers(("w1", "UNHEALTHY")))
    assert unhealthy.crash_loop and "unhealthy" in unhealthy.diagnosis(30, 16, "H100")
    throttled = StartupWatch()
    throttled.see(workers(("throttled-1", "THROTTLED")))
    assert not throttled.crash_loop and "no H100 free" in throttled.diagnosis(600, 16, "H100")
    slow = StartupWatch()
    slow.see(workers(("w1", "INITIALIZING")), Health.model_validate({"workers": {"initializing": 1}}))
    assert not slow.crash_loop and "cold_start_minutes" in slow.diagnosis(1200, 16, "H100")


class Clock:
    def __init__(self, now=1000.0):
        self.now = now

    def __call__(self):
        return self.now

    def sleep(self, seconds):
        self.now += max(seconds, 0.01)


def watch(clock, *, expires_in=3600.0, budget=10.0, costs=(0.0,), exists=True, cancelled_after=None):
    costs = iter(costs)
    last = [0.0]

    def read_cost():
        last[0] = next(costs, last[0])
        return last[0]

    started = clock()
    return watch_serving(expires_at=started + expires_in, budget_usd=budget, read_cost=read_cost,
                         endpoint_exists=lambda: exists, heartbeat=lambda: None, clock=clock, sleep=clock.sleep,
                         cancel_requested=lambda: cancelled_after is not None and clock() - started >= cancelled_after)


def test_the_watch_ends_the_serve_when_its_hours_run_out():
    clock = Clock()
    ended, reason, _ = watch(clock, expires_in=300)
    assert ended == "expired" and clock.now == pytest.approx(1300, abs=0.1)


def test_the_watch_ends_the_serve_once_its_cost_reaches_the_budget():
    clock = Clock()
    ended, reason, cost = watch(clock, budget=1.0, costs=(0.2, 0.6, 1.05))
    assert (ended, cost) == ("budget", 1.05) and "budget_usd $1" in reason
    assert clock.now == pytest.approx(1120, abs=1)  # read at once, then every minute


def test_the_watch_ends_on_a_cancel_and_on_an_endpoint_deleted_behind_it():
    assert watch(Clock(), cancelled_after=30)[0] == "cancelled"
    assert watch(Clock(), exists=False)[0] == "lost"


def test_the_cost_counts_one_worker_from_the_endpoints_creation_through_the_cold_start_and_try_it():
    count = WorkerTime(created=1000.0, usd_per_hour=3.6)
    assert count.add(0, 1600.0) == pytest.approx(0.6)  # 10 minutes of one worker before the watch's first reading
    assert count.add(2, 1700.0) == pytest.approx(0.6 + 0.2)
    assert count.add(0, 1800.0) == pytest.approx(0.8 + 0.2)  # the two seen last stood for the interval


def test_a_hub_adapters_repo_that_moves_is_said_once_per_commit_with_both_commits():
    heads, said = {"org/a": "a" * 40, "org/b": "b" * 40}, []
    repos = RepoWatch({"a": ("org/a", "a" * 40), "b": ("org/b", "b" * 40)}, heads.__getitem__, said.append)
    repos.check()
    assert said == []
    heads["org/b"] = "c" * 40
    repos.check()
    repos.check()
    assert len(said) == 1 and said[0].startswith(f"Adapter b's repo org/b moved from commit {'b' * 12} (the one this "
                                                 f"serve checked) to {'c' * 12}")


def test_the_watch_reads_the_adapters_repos_with_the_cost():
    clock, looked = Clock(), []
    watch_serving(expires_at=clock() + 130, budget_usd=10, read_cost=lambda: 0.0, endpoint_exists=lambda: True,
                  heartbeat=lambda: None, clock=clock, sleep=clock.sleep, cancel_requested=lambda: False,
                  watch_repos=lambda: looked.append(clock()))
    assert len(looked) == 3  # at once, then every minute


def answered(body: object, status: int = 200) -> tuple[Answer, dict]:
    sent = {}

    def endpoint(request: httpx.Request) -> httpx.Response:
        sent.update(json.loads(request.content))
        return httpx.Response(status, json=body)

    with httpx.Client(base_url="https://api.runpod.ai/v2/ep/openai/v1", transport=httpx.MockTransport(endpoint)) as http:
        return ask(http, "bot", "hi", 16), sent


def test_try_it_asks_without_thinking_and_keeps_the_answer_and_its_tokens():
    answer, sent = answered({"choices": [{"message": {"content": "Hello."}}], "usage": {"completion_tokens": 3}})
    assert (answer.text, answer.completion_tokens, answer.error) == ("Hello.", 3, None)
    assert sent["chat_template_kwargs"] == {"enable_thinking": False} and sent["temperature"] == 0


@pytest.mark.parametrize("body", [{"choices": []}, {"choices": [{"message": {"content": None}}]}, {"object": "error"},
                                  ["not", "an", "answer"]])
def test_an_unexpected_200_is_recorded_as_such_and_not_raised(body):
    answer, _ = answered(body)
    assert answer.error.startswith("unexpected answer (HTTP 200 without choices[0].message.content)")


def test_the_try_it_table_puts_the_base_and_each_adapter_side_by_side_with_tokens_and_latency():
    report = TryReport(seconds=2.0, answers=[
        Answer(model="Qwen/Qwen3-8B", prompt="hi", text="Hello.", completion_tokens=3, seconds=0.5),
        Answer(model="bot", prompt="hi", text="Purple!", completion_tokens=5, seconds=0.7)])
    [row] = report.table(["Qwen/Qwen3-8B", "bot"])
    assert row == {"prompt": "hi", "base": "Hello.", "bot": "Purple!", "tokens": "base 3 · bot 5",
                   "latency (s)": "base 0.50 · bot 0.70"}
    assert report.tokens_per_s == 4.0
