"""Task evaluations asked of a serving endpoint through its OpenAI route instead of a rented worker (an evaluate
file's `openai_base_url`), so that what is served is what is measured: each prompt of each task asked of the base and
of each adapter by its model name (`/chat/completions`, as the task's sampling says), and each answer graded here by
the built-in graders (`loraflow_worker.evaluation.graders`: plain code of loraflow's). Nothing of the user's runs on
the control plane: function graders, judges and benchmarks are refused by the form in this mode.

The result is an `EvaluateResult`, as the rented job's, so one leaderboard ranks both.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import httpx
from loraflow_worker.artifacts import ArtifactStore
from loraflow_worker.contract import run_prefix
from loraflow_worker.contract.evaluate import AdapterScores, EvaluateResult
from loraflow_worker.contract.task_evaluation import GraderSettings, task_score
from loraflow_worker.evaluation.graders import grade_builtin

from tasks.settings import Settings

REQUEST_TIMEOUT_S = 600.0
"""One answer's wait: a serverless endpoint's first request waits for a cold start (RunPod's OpenAI route holds it)."""
CONCURRENT_REQUESTS = 8
"""Prompts in flight at once, per model: vLLM batches them; more only queue on one worker."""


class EndpointRefused(ValueError):
    """The endpoint cannot answer as asked (unreachable, a model it does not serve): the message names the field."""


@dataclass(frozen=True)
class EndpointTask:
    """One task as the endpoint is asked it: its rows (already checked), graders and sampling."""

    name: str
    rows: list[dict[str, Any]]
    prompts: list[str | list[dict[str, Any]]]
    """Each row's prompt: messages (a chat, asked through `/chat/completions`, rendered by the served model's chat
    template) or text (asked through `/completions` as it is), as the worker answers them."""
    graders: list[GraderSettings]
    max_new_tokens: int
    temperature: float
    top_p: float


def read_api_key(block: str, settings: Settings) -> str:
    """The endpoint's API key from the Prefect Secret block `block` (`evaluate.openai_api_key_secret`). One of the
    server's own blocks is refused before it is read: its key would be sent to a URL the evaluate file chose."""
    from prefect.blocks.system import Secret

    field = "evaluate.openai_api_key_secret"
    if problem := settings.server_block_problem(field, block):
        raise EndpointRefused(problem)
    try:
        value = Secret.load(block).get()
    except Exception as e:  # missing (ValueError), not a Secret block, or the Prefect API unreachable
        raise EndpointRefused(f"{field}: the Prefect Secret block {block!r} cannot be read ({type(e).__name__}: "
                              f"{str(e)[:300]}): create it on the Prefect server this evaluation uses") from e
    if not isinstance(value, str) or not value:
        raise EndpointRefused(f"{field}: the Prefect Secret block {block!r} holds no text: store the API key in it")
    return value


def endpoint_client(base_url: str, api_key: str | None) -> httpx.Client:
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    return httpx.Client(base_url=base_url.rstrip("/") + "/", headers=headers, timeout=REQUEST_TIMEOUT_S)


def check_served_models(client: httpx.Client, wanted: dict[str, str]) -> None:
    """Refuse (naming each field) the models of `wanted` (field → model name) that the endpoint's `/models` does not
    list; an endpoint that does not answer `/models` is refused naming `evaluate.openai_base_url`."""
    try:
        response = client.get("models")
        response.raise_for_status()
        served = {card.get("id") for card in response.json().get("data", []) if isinstance(card, dict)}
    except (httpx.HTTPError, ValueError, AttributeError) as e:
        raise EndpointRefused(f"evaluate.openai_base_url {client.base_url}: its /models did not answer "
                              f"({type(e).__name__}: {str(e)[:200]}): give the OpenAI base URL of an endpoint that "
                              "serves (a serve prints it), and its key in openai_api_key_secret") from e
    missing = [f"{field}: {name!r}" for field, name in wanted.items() if name not in served]
    if missing:
        raise EndpointRefused(f"the endpoint at {client.base_url} serves {sorted(m for m in served if m)}, not "
                              f"{'; '.join(missing)}: name the models as the serve names them (an adapter's `name`)")


def ask(client: httpx.Client, model: str, prompt: str | list[dict[str, Any]], task: EndpointTask) -> str:
    """One answer of `model` to `prompt` (messages: a chat; text: a completion of it), stripped as the worker's."""
    chat = not isinstance(prompt, str)
    try:
        response = client.post("chat/completions" if chat else "completions", json={
            "model": model, ("messages" if chat else "prompt"): prompt, "max_tokens": task.max_new_tokens,
            "temperature": task.temperature, "top_p": task.top_p})
    except httpx.HTTPError as e:
        raise EndpointRefused(f"{model} did not answer a prompt of task {task.name} within {REQUEST_TIMEOUT_S:g} s "
                              f"({type(e).__name__}: {str(e)[:200]}): is the endpoint up?") from e
    if response.status_code >= 400:
        raise EndpointRefused(f"{model} did not answer a prompt of task {task.name}: HTTP {response.status_code} "
                              f"{response.text[:300]}")
    choice = response.json()["choices"][0]
    content = choice["message"].get("content") if chat else choice.get("text")
    return content.strip() if isinstance(content, str) else ""


def answers_of(client: httpx.Client, model: str, task: EndpointTask) -> list[str]:
    with ThreadPoolExecutor(CONCURRENT_REQUESTS) as pool:
        return list(pool.map(lambda prompt: ask(client, model, prompt, task), task.prompts))


def evaluate_endpoint(client: httpx.Client, run_id: str, base_model: str, labels: list[str],
                      tasks: list[EndpointTask], say: Callable[[str], None] = lambda _: None,
                      ) -> tuple[EvaluateResult, dict[str, bytes]]:
    """Ask every task of the base (`base_model`, its model name) and of each adapter (`labels`, their model names),
    grade each answer, and score each adapter against the base's answers. Also: the answers, as the worker stores
    them (`runs/<run_id>/evaluation/<label>/<task>.jsonl`: each row's prompt, expected answer, the base's and the
    adapter's answers and their scores), by store path."""
    began = time.monotonic()
    folder = f"{run_prefix(run_id)}/evaluation"
    scores = {label: AdapterScores(label=label, answers_store_path=f"{folder}/{label}") for label in labels}
    stored: dict[str, bytes] = {}
    for task in tasks:
        expected = [row.get("answer") for row in task.rows]
        say(f"task {task.name}: {len(task.prompts)} prompts of {base_model}")
        base_answers = answers_of(client, base_model, task)
        base = {g.label: grade_builtin(g, base_answers, expected) for g in task.graders}
        for label in labels:
            say(f"task {task.name}: {len(task.prompts)} prompts of {label}")
            answers = answers_of(client, label, task)
            graded = {g.label: grade_builtin(g, answers, expected) for g in task.graders}
            scores[label].task_scores += [task_score(task.name, g, base[g], graded[g]) for g in graded]
            stored[f"{folder}/{label}/{task.name}.jsonl"] = "".join(json.dumps({
                "row": i + 1, "prompt": prompt, "answer": want, "base": base_answers[i], "adapter": answers[i],
                "scores": {g: {"base": base[g][i], "adapter": graded[g][i]} for g in graded}}) + "\n"
                for i, (prompt, want) in enumerate(zip(task.prompts, expected, strict=True))).encode()
    result = EvaluateResult(run_id=run_id, adapters=list(scores.values()), seconds=time.monotonic() - began)
    return result, stored


def store_endpoint_results(store: ArtifactStore, result: EvaluateResult, answers: dict[str, bytes]) -> None:
    """The answers and `result.json` under `runs/<run_id>/` of the store, in one commit, `DONE` last as a job's."""
    prefix = run_prefix(result.run_id)
    store.put(answers | {f"{prefix}/result.json": result.model_dump_json(indent=2).encode()},
              message=f"loraflow evaluate {result.run_id}: answers and scores")
    store.put({f"{prefix}/DONE": b""}, message=f"loraflow evaluate {result.run_id}: done")
