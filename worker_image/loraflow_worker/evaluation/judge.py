"""A task's `judge` grader: an OpenAI-compatible model (`judge_model` at `judge_base_url`, its chat completions route)
asked, with the grader's rubric, to score each answer from 0 to 10; the last number of its reply, over 10, is the
score. An answer it does not score (no number in 0-10, or the request failing after retries) counts 0 and as
unscored (`TaskScore.failed`); a request the API refuses outright (a wrong key, model or URL) stops the evaluation
with the API's words."""

from __future__ import annotations

import os
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx

from loraflow_worker.contract.task_evaluation import GraderSettings
from loraflow_worker.evaluation.function_graders import GraderError
from loraflow_worker.evaluation.graders import expected_text, last_number
from loraflow_worker.evaluation.task_rows import TaskRow

TIMEOUT_S = 60.0
ATTEMPTS = 3
PARALLEL_REQUESTS = 8
RETRIED_STATUSES = {408, 409, 429}
"""Statuses worth another try besides 5xx: timeout, conflict, rate limit (OpenAI's guidance on retries)."""

INSTRUCTIONS = ("You grade an answer to a prompt. Follow the rubric. Reply with a short reason, then the score as a "
                "whole number from 0 (worst) to 10 (best) on the last line.")


def judge_messages(grader: GraderSettings, row: TaskRow, answer: str) -> list[dict[str, str]]:
    """What the judge is asked about one answer: the rubric, the prompt, the expected answer (when the row has one)
    and the answer."""
    prompt = row.prompt if isinstance(row.prompt, str) else "\n".join(
        f"{m['role']}: {m.get('content') or ''}" for m in row.prompt)
    parts = [f"Rubric:\n{grader.rubric}", f"Prompt:\n{prompt}"]
    if row.answer is not None:
        parts.append(f"Expected answer:\n{expected_text(row.answer)}")
    parts.append(f"Answer to grade:\n{answer}")
    return [{"role": "system", "content": INSTRUCTIONS}, {"role": "user", "content": "\n\n".join(parts)}]


def judge_score(reply: str) -> float | None:
    """The score in a judge's reply: its last number, over 10; None when there is none in 0-10."""
    number = last_number(reply)
    return number / 10 if number is not None and 0 <= number <= 10 else None


def grade_with_judge(task: str, grader: GraderSettings, rows: list[TaskRow],
                     answers: list[str]) -> tuple[list[float], int]:
    """(one score per answer, how many the judge left unscored)."""
    name = f"task `{task}`, grader `{grader.label}` (judge {grader.judge_model})"
    headers = {}
    if grader.judge_api_key_env is not None:
        key = os.environ.get(grader.judge_api_key_env)
        if not key:
            raise GraderError(f"{name}: the worker has no `{grader.judge_api_key_env}` (`judge_api_key_env`): add it "
                              "to the run's `[worker] secrets`")
        headers["Authorization"] = f"Bearer {key}"
    url = f"{grader.judge_base_url.rstrip('/')}/chat/completions"
    with httpx.Client(timeout=TIMEOUT_S, headers=headers) as client:
        def ask(pair: tuple[TaskRow, str]) -> float | None:
            row, answer = pair
            body = {"model": grader.judge_model, "messages": judge_messages(grader, row, answer), "temperature": 0}
            return _ask(client, url, body, name)

        with ThreadPoolExecutor(PARALLEL_REQUESTS) as pool:
            scored = list(pool.map(ask, zip(rows, answers, strict=True)))
    return [score or 0.0 for score in scored], sum(score is None for score in scored)


def _ask(client: httpx.Client, url: str, body: dict[str, Any], name: str) -> float | None:
    for attempt in range(ATTEMPTS):
        try:
            response = client.post(url, json=body)
        except httpx.HTTPError:
            response = None
        if response is not None and response.is_success:
            try:
                reply = response.json()["choices"][0]["message"]["content"] or ""
            except (ValueError, KeyError, IndexError, TypeError):
                return None
            return judge_score(reply)
        if response is not None and response.status_code < 500 and response.status_code not in RETRIED_STATUSES:
            raise GraderError(f"{name}: {url} answered {response.status_code}: {response.text[:300]}")
        if attempt + 1 < ATTEMPTS:
            time.sleep(2 ** attempt)
    return None
