"""localpod serves an endpoint of RunPod's vLLM worker image (`runpod/worker-v1-vllm:<tag>`) through the image's local
stand-in, and answers RunPod's OpenAI route for it (docs/serving.md, its facts §1–§7).

Live: `python -m localpod` on a free port, its workers the stand-in (`localpod/vllm_worker/`, run with the worker
environment's interpreter) serving the tiny model and LoRA adapters made here with PEFT. Each adapter makes one word
the model's every next token, so greedy decoding through the adapter's name answers that word again and again, and
the base does not. The client speaks the OpenAI wire shape with plain httpx, and streams with the `openai` package
(a test dependency), as a served endpoint's users do.
"""

from __future__ import annotations

import inspect
import json
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import httpx
import openai
import pytest
from huggingface_hub import HfApi

from deployments.local_stack import WORKER_PYTHON, free_port, require_worker_python, start_service
from tests.hub_fixture import HubStandIn, running_hub

KEY = "vllm-stand-in-test-key"
IMAGE = "runpod/worker-v1-vllm:v2.25.2"
HUB_TOKEN = "hf_private_adapter_token_never_logged"
BASE = "tiny-base"
"""The base's served name (`OPENAI_SERVED_MODEL_NAME_OVERRIDE`)."""
QUESTION = [{"role": "user", "content": "What is the answer?"}]
COLD_START_S = 240  # a worker imports torch and loads the model before it takes a job; a loaded 2-core machine is slow

T = TypeVar("T")


def make_adapters(base: str, specs: list[list[Any]]) -> list[str]:
    """Runs in the worker environment (torch, PEFT): for each `[folder, word, rank]`, a LoRA adapter of `base` whose
    last MLP block adds a large push towards `word`'s token embedding (the model's output head is tied to its
    embeddings), whatever the input: its gate and up projections open two intermediate units to (c·a·x) and
    -(c·a·x), whose SiLU-gated products sum to (c·a·x)², and its down projection writes that sum along the word's
    embedding. Returns each word's token text."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(base)
    texts = []
    for folder, word, rank in specs:
        ids = tokenizer.encode(word, add_special_tokens=False)
        assert len(ids) == 1, f"{word!r} is not one token of the tiny model: {ids}"
        model = AutoModelForCausalLM.from_pretrained(base)
        embedding = model.get_input_embeddings().weight.detach()[ids[0]]
        last = model.config.num_hidden_layers - 1
        config = LoraConfig(r=rank, lora_alpha=rank, target_modules=["gate_proj", "up_proj", "down_proj"],
                            layers_to_transform=[last], init_lora_weights=False)
        adapter = get_peft_model(model, config)
        mlp = adapter.base_model.model.model.layers[last].mlp
        direction = torch.randn(model.config.hidden_size, generator=torch.Generator().manual_seed(0))
        with torch.no_grad():
            for projection in (mlp.gate_proj, mlp.up_proj):
                a, b = projection.lora_A["default"].weight, projection.lora_B["default"].weight
                a.zero_()
                b.zero_()
                a[0] = direction / direction.norm()
                b[0, 0], b[1, 0] = 30.0, -30.0
            a, b = mlp.down_proj.lora_A["default"].weight, mlp.down_proj.lora_B["default"].weight
            a.zero_()
            b.zero_()
            a[0, 0] = a[0, 1] = 1.0
            b[:, 0] = 200.0 * embedding / embedding.norm()
        adapter.save_pretrained(folder)
        texts.append(tokenizer.decode(ids))
    return texts


def in_worker_env(function: Callable[..., T], *args: Any) -> T:
    """Call `function(*args)` in the worker environment (it has torch and PEFT; this one has neither); JSON in, out."""
    source = (f"from __future__ import annotations\nimport json, sys\n{inspect.getsource(function)}\n"
              f"print(json.dumps({function.__name__}(*json.loads(sys.argv[1]))))")
    done = subprocess.run([str(require_worker_python()), "-c", source, json.dumps(args)], capture_output=True,
                          text=True, env={"PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1"}, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def wait_for(condition: Callable[[], T], what: str, timeout: float = COLD_START_S) -> T:
    deadline = time.monotonic() + timeout
    while not (value := condition()):
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(0.25)
    return value


@pytest.fixture(scope="module")
def adapters(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """`answerer` (rank 8, answers " answer") and `assistant` (rank 32, above vLLM's default MAX_LORA_RANK of 16,
    answers " assistant"), as local folders."""
    folder = tmp_path_factory.mktemp("adapters")
    answer, assistant = in_worker_env(make_adapters, str(tiny_model),
                                      [[str(folder / "answerer"), " answer", 8], [str(folder / "assistant"), " assistant", 32]])
    return {"answerer": folder / "answerer", "answer": answer, "assistant": folder / "assistant", "assistant_text": assistant}


@pytest.fixture(scope="module")
def hub(tmp_path_factory: pytest.TempPathFactory, adapters: dict[str, Any]) -> Iterator[HubStandIn]:
    """The Hub stand-in, which lets only `HUB_TOKEN` read, holding the `assistant` adapter as `org/assistant-adapter`."""
    with running_hub(tmp_path_factory.mktemp("hub") / "data", require_token=HUB_TOKEN, read_only_token=None) as hub:
        api = HfApi(endpoint=hub.url, token=HUB_TOKEN)
        api.create_repo("org/assistant-adapter", private=True)
        # PEFT's README names the local base folder, which the Hub refuses as `base_model`: the weights suffice.
        api.upload_folder(repo_id="org/assistant-adapter", folder_path=str(adapters["assistant"]),
                          ignore_patterns=["README.md"])
        yield hub


@pytest.fixture(scope="module")
def pod(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    logs = tmp_path_factory.mktemp("vllm-pod")
    port = free_port()
    service = start_service(
        "localpod",
        [sys.executable, "-m", "localpod", "--port", str(port), "--api-key", KEY,
         "--log-dir", str(logs), "--worker-python", str(WORKER_PYTHON), "--long-poll", "1"],
        {"PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1", "HF_HUB_DISABLE_TELEMETRY": "1"},
        f"http://127.0.0.1:{port}", "/_localpod/account", logs / "localpod.log",
    )
    try:
        yield service.url
    finally:
        service.stop()


def api(pod: str) -> httpx.Client:
    return httpx.Client(base_url=f"{pod}/v2", headers={"Authorization": f"Bearer {KEY}"}, timeout=COLD_START_S + 60)


def openai_client(pod: str, endpoint_id: str) -> httpx.Client:
    """What an OpenAI client does with `base_url=<localpod>/v2/<id>/openai/v1` and `api_key=<RunPod key>`."""
    return httpx.Client(base_url=f"{pod}/v2/{endpoint_id}/openai/v1", headers={"Authorization": f"Bearer {KEY}"},
                        timeout=COLD_START_S + 60)


def create_vllm_endpoint(pod: str, env: dict[str, str]) -> str:
    body = {"name": f"serve-{uuid.uuid4().hex[:8]}", "type": "QUEUE", "image": IMAGE, "gpu": {"pools": ["ADA_24"]},
            "scaling": {"type": "REQUEST_COUNT", "requestCount": 1},
            "workers": {"min": 0, "max": 1, "idleTimeout": 600}, "env": env}
    with api(pod) as http:
        return http.post("/serverless", json=body).raise_for_status().json()["id"]


def delete_endpoint(pod: str, endpoint_id: str) -> None:
    with api(pod) as http:
        http.delete(f"/serverless/{endpoint_id}")


def workers_of(pod: str, endpoint_id: str) -> list[dict[str, Any]]:
    account = httpx.get(f"{pod}/_localpod/account", timeout=30).raise_for_status().json()
    return [w for w in account["workers"] if w["endpointId"] == endpoint_id]


def worker_logs(pod: str, endpoint_id: str) -> str:
    return "".join(Path(w["logPath"]).read_text(errors="replace") for w in workers_of(pod, endpoint_id))


def chat(client: httpx.Client, model: str | None, max_tokens: int = 6) -> httpx.Response:
    body = {"messages": QUESTION, "max_tokens": max_tokens, "temperature": 0}
    return client.post("/chat/completions", json=body | ({"model": model} if model else {}))


def content(response: httpx.Response) -> str:
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]["message"]["content"]


@pytest.fixture(scope="module")
def served(pod: str, tiny_model: Path, adapters: dict[str, Any]) -> Iterator[str]:
    """An endpoint serving the tiny model as `tiny-base` and the `answerer` adapter, set as RunPod's template does
    (`LORA_MODULES` as `name=path`); HF_TOKEN set, as a private base would need."""
    endpoint_id = create_vllm_endpoint(pod, {
        "MODEL_NAME": str(tiny_model), "OPENAI_SERVED_MODEL_NAME_OVERRIDE": BASE, "MAX_MODEL_LEN": "512",
        "ENABLE_LORA": "true", "LORA_MODULES": f"answerer={adapters['answerer']}", "HF_TOKEN": HUB_TOKEN,
    })
    yield endpoint_id
    delete_endpoint(pod, endpoint_id)


def test_an_openai_client_gets_the_base_answer_by_its_name_and_the_adapter_answer_by_the_adapters_name(
        pod, served, adapters):
    with openai_client(pod, served) as client:
        base, tuned = chat(client, BASE), chat(client, "answerer")

    assert content(tuned) == adapters["answer"] * 6
    assert adapters["answer"].strip() not in content(base)
    for response, model in ((base, BASE), (tuned, "answerer")):
        answer = response.json()
        assert answer["object"] == "chat.completion" and answer["model"] == model
        assert answer["choices"][0]["finish_reason"] == "length"
        usage = answer["usage"]
        assert usage["prompt_tokens"] > 0 and usage["completion_tokens"] == 6
        assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]


def test_completions_answer_a_prompt_through_the_adapter_and_a_body_without_model_goes_to_the_base(pod, served, adapters):
    with openai_client(pod, served) as client:
        tuned = client.post("/completions", json={"model": "answerer", "prompt": "The quick brown", "max_tokens": 4,
                                                  "temperature": 0})
        base = client.post("/completions", json={"prompt": "The quick brown", "max_tokens": 4, "temperature": 0})

    assert tuned.status_code == 200, tuned.text
    assert tuned.json()["object"] == "text_completion"
    assert tuned.json()["choices"][0]["text"] == adapters["answer"] * 4
    assert base.status_code == 200, base.text
    assert base.json()["model"] == BASE  # the worker's handler filled in the served base name
    assert base.json()["choices"][0]["text"] != adapters["answer"] * 4


def test_models_lists_the_base_card_and_one_card_per_adapter(pod, served, tiny_model, adapters):
    with openai_client(pod, served) as client:
        response = client.get("/models")

    assert response.status_code == 200, response.text
    cards = response.json()["data"]
    assert [(c["id"], c["root"], c["parent"]) for c in cards] == [
        (BASE, str(tiny_model), None),
        ("answerer", str(adapters["answerer"]), BASE),  # the path as LORA_MODULES gave it
    ]
    assert cards[0]["max_model_len"] == 512  # MAX_MODEL_LEN
    assert all(c["object"] == "model" and c["owned_by"] == "vllm" for c in cards)


def test_an_unknown_model_name_gets_vllms_404_and_its_job_fails_as_runpod_python_fails_it(pod, served):
    with openai_client(pod, served) as client:
        response = chat(client, "nobody")
    with api(pod) as http:
        job = http.post(f"/{served}/runsync", json={"input": {"openai_route": "/v1/chat/completions",
                                                              "openai_input": {"model": "nobody", "messages": QUESTION}}}).json()

    assert response.status_code == 404
    assert response.json() == {"error": {"message": "The model `nobody` does not exist.", "type": "NotFoundError",
                                         "param": "model", "code": 404}}
    assert job["status"] == "FAILED"
    # runpod-python's str() of the worker's error: vLLM's status and body inside the worker's own framing.
    assert job["error"].startswith("{'message': 'vLLM returned HTTP 404: {")
    assert "'type': 'worker_error'" in job["error"] and "The model `nobody` does not exist." in job["error"]


def test_runsync_with_messages_and_sampling_params_answers_in_the_workers_list_shape(pod, served, adapters):
    with api(pod) as http:
        tuned = http.post(f"/{served}/runsync", json={"input": {
            "messages": QUESTION, "sampling_params": {"model": "answerer", "max_tokens": 3, "temperature": 0}}}).json()
        base = http.post(f"/{served}/runsync", json={"input": {
            "messages": QUESTION, "sampling_params": {"max_tokens": 3}}}).json()

    assert tuned["status"] == "COMPLETED", tuned
    assert isinstance(tuned["output"], list) and len(tuned["output"]) == 1
    answer = tuned["output"][0]
    assert answer["choices"][0]["message"]["content"] == adapters["answer"] * 3
    assert answer["usage"]["completion_tokens"] == 3
    assert base["status"] == "COMPLETED", base
    assert base["output"][0]["model"] == BASE


def test_an_openai_client_streams_an_adapters_answer_a_token_a_chunk_and_a_completion_too(pod, served, adapters):
    client = openai.OpenAI(base_url=f"{pod}/v2/{served}/openai/v1", api_key=KEY, timeout=COLD_START_S + 60)
    chunks = list(client.chat.completions.create(model="answerer", messages=QUESTION, max_tokens=6, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    texts = [c.choices[0].text for c in client.completions.create(model="answerer", prompt="The quick brown",
                                                                  max_tokens=4, temperature=0, stream=True)]

    assert chunks[0].object == "chat.completion.chunk" and chunks[0].choices[0].delta.role == "assistant"
    deltas = [c.choices[0].delta.content for c in chunks if c.choices and c.choices[0].delta.content]
    assert deltas == [adapters["answer"]] * 6  # one chunk per token
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 6  # stream_options.include_usage
    assert {c.model for c in chunks} == {"answerer"}
    assert "".join(texts) == adapters["answer"] * 4


def test_a_streamed_request_for_an_unknown_model_gets_vllms_404_before_any_event(pod, served):
    client = openai.OpenAI(base_url=f"{pod}/v2/{served}/openai/v1", api_key=KEY, timeout=COLD_START_S + 60)
    with pytest.raises(openai.NotFoundError, match="The model `nobody` does not exist."):
        client.chat.completions.create(model="nobody", messages=QUESTION, max_tokens=2, stream=True)


def test_a_prompt_and_max_tokens_past_max_model_len_get_vllms_400(pod, served):
    with openai_client(pod, served) as client:
        response = client.post("/completions", json={"model": BASE, "prompt": "hello", "max_tokens": 600})

    assert response.status_code == 400
    error = response.json()["error"]
    assert error["type"] == "BadRequestError" and error["param"] == "max_tokens"
    assert "'max_tokens' or 'max_completion_tokens' is too large: 600. This model's maximum context length is 512" \
        in error["message"]


def test_two_adapters_of_vllm_extra_args_each_answer_one_from_a_local_folder_one_from_a_private_hub_repo(
        pod, tiny_model, adapters, hub):
    endpoint_id = create_vllm_endpoint(pod, {
        "MODEL_NAME": str(tiny_model), "ENABLE_LORA": "true", "MAX_LORAS": "2", "MAX_LORA_RANK": "32",
        "VLLM_EXTRA_ARGS": f"--lora-modules answerer={adapters['answerer']} assistant=org/assistant-adapter",
        "HF_ENDPOINT": hub.url, "HF_TOKEN": HUB_TOKEN,
    })
    try:
        with openai_client(pod, endpoint_id) as client:
            first, second = chat(client, "answerer", 4), chat(client, "assistant", 4)
            cards = client.get("/models").json()["data"]
        logs = worker_logs(pod, endpoint_id)
    finally:
        delete_endpoint(pod, endpoint_id)

    assert content(first) == adapters["answer"] * 4
    assert content(second) == adapters["assistant_text"] * 4
    assert [(c["id"], c["root"]) for c in cards[1:]] == [("answerer", str(adapters["answerer"])),
                                                         ("assistant", "org/assistant-adapter")]
    assert hub.downloads("model", "org/assistant-adapter") > 0  # with HUB_TOKEN: the repo is private
    assert HUB_TOKEN not in logs


def test_no_worker_log_shows_hf_token(pod, served):
    with openai_client(pod, served) as client:
        assert chat(client, BASE, 1).status_code == 200  # a worker has started and served

    logs = worker_logs(pod, served)
    assert "Starting vLLM (localpod stand-in)" in logs
    assert HUB_TOKEN not in logs


@pytest.mark.parametrize(("case", "env", "last_words"), [
    ("an adapter above MAX_LORA_RANK", {"LORA_MODULES": "assistant={assistant}"},
     "LoRA rank 32 is greater than max_lora_rank 16."),
    ("LORA_MODULES as a JSON array", {"LORA_MODULES": '[{{"name": "assistant", "path": "{assistant}"}}]'},
     "Invalid fields for --lora-modules"),
    ("an adapter path with no adapter", {"LORA_MODULES": "assistant={assistant}-missing"},
     "No adapter found for"),
])
def test_a_worker_that_cannot_load_its_adapters_exits_at_every_start_and_its_jobs_stay_in_queue(
        pod, tiny_model, adapters, case, env, last_words):
    env = {k: v.format(assistant=adapters["assistant"]) for k, v in env.items()}
    endpoint_id = create_vllm_endpoint(pod, {"MODEL_NAME": str(tiny_model), "ENABLE_LORA": "true", **env})
    try:
        with api(pod) as http:
            job_id = http.post(f"/{endpoint_id}/run", json={"input": {"messages": QUESTION}}).json()["id"]
            crashed = wait_for(lambda: len([w for w in workers_of(pod, endpoint_id) if w["endedAt"]]) >= 2,
                               f"two workers of the endpoint ({case}) to exit")
            status = http.get(f"/{endpoint_id}/status/{job_id}").json()
            health = http.get(f"/{endpoint_id}/health").json()
            ended = [w for w in workers_of(pod, endpoint_id) if w["endedAt"]]
    finally:
        delete_endpoint(pod, endpoint_id)

    assert crashed
    assert all(w["exitCode"] == 1 for w in ended), ended
    assert status["status"] == "IN_QUEUE"
    assert health["jobs"]["inQueue"] == 1 and health["jobs"]["completed"] == 0 and health["jobs"]["failed"] == 0
    assert last_words in Path(ended[0]["logPath"]).read_text(errors="replace")
