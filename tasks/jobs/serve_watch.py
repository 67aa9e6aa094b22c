"""A serving endpoint's life once it exists (`tasks/jobs/serve.py`): its first answer, the "try it" prompts, the watch.

- `first_answer`: the first request (the first prompt through the base), sent with `/run` as RunPod's OpenAI route
  sends it (`{"openai_route", "openai_input"}`, serving.md §3) so that it can be watched: the seconds to its answer are
  the cold start. `vllm serve` loads the base and every adapter before the worker takes a job (serving.md §4), so a
  worker that dies while starting (an adapter above MAX_LORA_RANK, an unreadable adapter, ...) leaves the job IN_QUEUE
  while RunPod starts another, and another: the endpoint's workers are read as the job waits (`StartupWatch`), and a
  crash loop ends the serve at once, saying what is wrong, rather than waiting out the allowance (`cold_start_minutes`)
  or the budget. The allowance ends any other wait, with what the workers were doing.
- `try_it`: each prompt through the base and through each adapter, by RunPod's OpenAI route with plain httpx (an OpenAI
  client would do the same), one at a time, thinking switched off (`chat_template_kwargs`): the answers side by side,
  with tokens and latency, and the batch's throughput. An answer that is an error, or a 200 of another shape, is
  recorded as such in its cell; the serve goes on (the endpoint answered its first request).
- `watch_serving`: until the serve's time runs out, its budget is reached (RunPod's billed cost, or loraflow's own
  count of worker time × price when that is more: billing lags; both from the endpoint's creation, the cold start
  and "try it" included), its flow run is cancelled, or the endpoint is gone; the endpoint's heartbeat for the
  reconciler all along, and a warning when a Hub adapter's repo moves past the commit the serve checked
  (`RepoWatch`: vLLM downloads adapters without a revision, so workers started after the move load the new commit).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from datetime import UTC, datetime

import httpx
from huggingface_hub import HfApi
from prefect import get_run_logger, task
from prefect.artifacts import create_table_artifact
from prefect.cache_policies import NO_CACHE
from pydantic import BaseModel, Field

from tasks.lifecycle.liveness import beat
from tasks.lifecycle.steps import run_cancel_requested
from tasks.runpod import errors
from tasks.runpod.client import RunpodClient, tls_context
from tasks.runpod.jobs import parse_worker_error
from tasks.runpod.live_catalog import billed_usd
from tasks.runpod.models import Endpoint, EndpointWorker, Health, JobPolicy, RunRequest
from tasks.settings import Settings, make_client

CRASH_LOOP_WORKERS = 2
"""Workers gone while starting, none having answered, that make a crash loop: one could be a host lost; two are not."""
POLL_S = 2.0
WORKERS_EVERY_S = POLL_S
"""How often the endpoint's workers are read while the first request waits: at every status poll. A crash loop is
seen only in a worker read starting and then gone; a worker that dies within a second of its start (a refused
adapter) and is replaced a few seconds later slipped between readings 5 s apart, so that two were seen only by the
ninth or tenth crash."""
WATCH_POLL_S = 5.0
"""How often the watch looks at the run's cancel and the clock (and sends the heartbeat, at its own interval)."""
CANCEL_CHECK_S = 5.0
"""How often the first request's wait reads the run's Prefect state for a cancel."""
COST_EVERY_S = 60.0
"""How often the watch reads the cost (and the endpoint: deleted behind the serve?)."""
ANSWER_TIMEOUT_S = 600.0
UP = frozenset({"IDLE", "RUNNING"})


class ServeStartFailed(RuntimeError):
    """No worker answered the serve's first request: the message says what the endpoint's workers did and why."""


class StartupWatch:
    """What the endpoint's workers did while the first request waited (`GET /v2/serverless/<id>/workers`, `/health`)."""

    def __init__(self) -> None:
        self.starting: set[str] = set()
        self.gone_starting = 0
        self.answered = False
        self.unhealthy = False
        self.samples = self.throttled = self.initializing = 0

    def see(self, workers: list[EndpointWorker] | None, health: Health | None = None) -> None:
        """One reading; None: it could not be read."""
        if health is not None and (health.workers.unhealthy or 0) > 0:
            self.unhealthy = True
        if workers is None:
            return
        self.samples += 1
        statuses = {w.id: w.status for w in workers if w.status != "THROTTLED"}
        self.throttled += any(w.status == "THROTTLED" for w in workers)
        self.initializing += any(s == "INITIALIZING" for s in statuses.values())
        self.unhealthy |= "UNHEALTHY" in statuses.values()
        self.answered |= bool(UP & set(statuses.values()))
        # A worker last seen starting that is gone now died while starting (none has taken a job yet).
        self.gone_starting += len(self.starting - statuses.keys())
        self.starting = {i for i, s in statuses.items() if s not in UP}

    @property
    def crash_loop(self) -> bool:
        return not self.answered and (self.gone_starting >= CRASH_LOOP_WORKERS or self.unhealthy)

    def diagnosis(self, waited_s: float, max_lora_rank: int, gpu: str) -> str:
        if self.crash_loop:
            what = (f"{self.gone_starting} workers started and were gone without taking the request"
                    if self.gone_starting else "RunPod marked a worker unhealthy")
            return (f"the endpoint's workers crash while they start: {what} within {waited_s:.0f} s (a "
                    "crash loop: `vllm serve` stops during its startup and RunPod starts another worker). vLLM stops "
                    f"there when an adapter's rank is above MAX_LORA_RANK ({max_lora_rank} here), an adapter or the "
                    "base cannot be downloaded (a private repo needs hub_token_secret's token), an adapter belongs to "
                    f"another base (its shapes do not fit), or the base and its KV cache do not fit the {gpu}. The "
                    "workers' logs hold vLLM's own words: RunPod's console, Serverless → the endpoint → Workers")
        if self.samples == 0:
            return f"no answer within {waited_s:.0f} s, and the endpoint's workers could not be read"
        if self.throttled == self.samples:
            return (f"no worker started within {waited_s:.0f} s: RunPod had no {gpu} free where the endpoint may run "
                    "(throttled); try later, or add GPU classes to serve.gpu")
        if self.initializing:
            return (f"its worker was still starting after {waited_s:.0f} s (the image pull, the base's download and "
                    "vLLM's startup): raise serve.cold_start_minutes, or keep the base warm in a volume (preload)")
        return f"no worker answered within {waited_s:.0f} s (none was seen starting)"


def first_answer(client: RunpodClient, endpoint_id: str, body: dict, *, allowance_s: float, max_lora_rank: int,
                 gpu: str, cancel_requested: Callable[[], bool], heartbeat: Callable[[], None],
                 clock: Callable[[], float] = time.monotonic, sleep: Callable[[float], None] = time.sleep
                 ) -> float | None:
    """Send `body` (a chat completion) as the endpoint's first job and wait for its answer: the seconds it took, or
    None when the run was cancelled meanwhile. Raises `ServeStartFailed` for a crash loop (at once), a wait past
    `allowance_s`, or a job that ended otherwise than COMPLETED; the job is cancelled first."""
    job = client.run(endpoint_id, RunRequest(
        input={"openai_route": "/v1/chat/completions", "openai_input": body},
        policy=JobPolicy(execution_timeout=int(ANSWER_TIMEOUT_S * 1000), ttl=int((allowance_s + ANSWER_TIMEOUT_S) * 1000))))
    started, watch, next_workers, next_cancel = clock(), StartupWatch(), 0.0, 0.0

    def give_up(message: str) -> ServeStartFailed:
        try:
            client.cancel(endpoint_id, job.id)
        except errors.RunpodError:
            pass  # the endpoint is deleted next, which ends the job anyway
        return ServeStartFailed(message)

    while True:
        heartbeat()
        now = clock()
        if now >= next_cancel:
            next_cancel = now + CANCEL_CHECK_S
            if cancel_requested():
                give_up("the run was cancelled")  # the job cancelled; nothing to raise
                return None
        try:
            status = client.status(endpoint_id, job.id)
        except errors.TRANSIENT_ERRORS:
            status = None
        except errors.NotFoundError as e:
            raise ServeStartFailed(f"the endpoint vanished before it answered ({e})") from e
        if status is not None and status.status == "COMPLETED":
            return now - started
        if status is not None and status.terminal:
            message, _, _ = parse_worker_error(status.error)
            raise ServeStartFailed(f"the first request ended {status.status}: {message or status.error}")
        if status is not None and status.status == "IN_QUEUE" and now >= next_workers:
            next_workers = now + WORKERS_EVERY_S
            watch.see(_read(lambda: client.list_endpoint_workers(endpoint_id)),
                      _read(lambda: client.health(endpoint_id)))
            if watch.crash_loop:
                raise give_up(watch.diagnosis(now - started, max_lora_rank, gpu))
        if now - started > allowance_s:
            raise give_up(watch.diagnosis(now - started, max_lora_rank, gpu))
        sleep(POLL_S)


@task(name="first-answer", cache_policy=NO_CACHE)
def first_answer_task(endpoint: Endpoint, base_model: str, prompt: str, max_tokens: int, allowance_s: float,
                      max_lora_rank: int, gpu: str) -> float | None:
    """`first_answer` for `prompt` through the base, with this run's cancel and the endpoint's heartbeat."""
    body = {"model": base_model, "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
            "temperature": 0}
    with make_client() as client:
        return first_answer(client, endpoint.id, body, allowance_s=allowance_s, max_lora_rank=max_lora_rank, gpu=gpu,
                            cancel_requested=run_cancel_requested, heartbeat=lambda: beat(endpoint, "IN_QUEUE"))


class Answer(BaseModel):
    model: str
    prompt: str
    text: str = ""
    completion_tokens: int = 0
    seconds: float = 0.0
    error: str | None = None


class TryReport(BaseModel):
    """The "try it" batch: every prompt through every model, one request at a time."""

    answers: list[Answer]
    seconds: float = Field(description="Wall time of the whole batch.")

    @property
    def completion_tokens(self) -> int:
        return sum(a.completion_tokens for a in self.answers)

    @property
    def tokens_per_s(self) -> float:
        return self.completion_tokens / self.seconds if self.seconds > 0 else 0.0

    def table(self, models: list[str]) -> list[dict[str, str]]:
        """One row per prompt: the base's answer, each adapter's, and their tokens and latency."""
        rows = []
        for prompt in dict.fromkeys(a.prompt for a in self.answers):
            mine = {a.model: a for a in self.answers if a.prompt == prompt}
            row = {"prompt": prompt}
            for i, model in enumerate(models):
                answer = mine.get(model)
                row["base" if i == 0 else model] = "" if answer is None else answer.error or answer.text
            row["tokens"] = " · ".join(f"{_short(m, i)} {mine[m].completion_tokens}" for i, m in enumerate(models)
                                       if m in mine)
            row["latency (s)"] = " · ".join(f"{_short(m, i)} {mine[m].seconds:.2f}" for i, m in enumerate(models)
                                            if m in mine)
            rows.append(row)
        return rows


NO_THINKING = {"enable_thinking": False}
"""`chat_template_kwargs` of every "try it" request: a thinking model's template (Qwen3's) then opens the answer with
an empty think block, so its few tokens are an answer. vLLM drops, silently, the keys a template does not use
(`resolve_chat_template_kwargs`, vllm/renderers/hf.py), so every model is asked the same way."""


def ask(http: httpx.Client, model: str, prompt: str, max_tokens: int) -> Answer:
    """One chat completion through RunPod's OpenAI route, greedy, without thinking; an error answer, or a 200 without
    `choices[0].message.content`, is kept in `Answer.error`."""
    started = time.monotonic()
    try:
        response = http.post("/chat/completions", json={"model": model, "max_tokens": max_tokens, "temperature": 0,
                                                        "messages": [{"role": "user", "content": prompt}],
                                                        "chat_template_kwargs": NO_THINKING})
    except httpx.HTTPError as e:
        return Answer(model=model, prompt=prompt, seconds=time.monotonic() - started, error=f"{type(e).__name__}: {e}")
    seconds = time.monotonic() - started
    if response.status_code != 200:
        return Answer(model=model, prompt=prompt, seconds=seconds, error=f"HTTP {response.status_code}: "
                      f"{response.text[:300]}")
    try:
        body = response.json()
        text = body["choices"][0]["message"]["content"]
        tokens = int((body.get("usage") or {}).get("completion_tokens") or 0)
    except (ValueError, KeyError, IndexError, TypeError, AttributeError):
        text = None
    if not isinstance(text, str):
        return Answer(model=model, prompt=prompt, seconds=seconds, error="unexpected answer (HTTP 200 without "
                      f"choices[0].message.content): {response.text[:300]}")
    return Answer(model=model, prompt=prompt, seconds=seconds, text=text, completion_tokens=tokens)


def try_it(base_url: str, api_key: str, models: list[str], prompts: list[str], max_tokens: int) -> TryReport:
    """Every prompt through every model (the base first), as an OpenAI client with `base_url` and RunPod's key would."""
    started = time.monotonic()
    with httpx.Client(base_url=base_url, headers={"Authorization": f"Bearer {api_key}"}, verify=tls_context(),
                      timeout=httpx.Timeout(ANSWER_TIMEOUT_S, connect=30.0)) as http:
        answers = [ask(http, model, prompt, max_tokens) for prompt in prompts for model in models]
    return TryReport(answers=answers, seconds=time.monotonic() - started)


@task(name="try-it", cache_policy=NO_CACHE)
def try_it_task(base_url: str, models: list[str], prompts: list[str], max_tokens: int, key: str) -> TryReport:
    """`try_it`, posted as the table artifact `key`; answers that failed are logged."""
    report = try_it(base_url, Settings().api_key(), models, prompts, max_tokens)
    for answer in report.answers:
        if answer.error:
            get_run_logger().warning("%s did not answer %r: %s", answer.model, answer.prompt, answer.error)
    create_table_artifact(table=report.table(models), key=key, description=(
        f"Each prompt through the base and each adapter, greedy, up to {max_tokens} tokens: "
        f"{report.completion_tokens} tokens in {report.seconds:.1f} s ({report.tokens_per_s:.1f} tokens/s, one "
        "request at a time)"))
    return report


class WorkerTime:
    """loraflow's own count of what an endpoint's workers cost since its creation (Unix time `created`): the workers
    seen at each reading × the time since the last × the price per worker-hour, the larger of the two readings'
    counts standing for the interval. Until the first reading, one worker is counted from the creation: the first
    request starts one at once, and its cold start and "try it" happen before the watch reads anything."""

    def __init__(self, created: float, usd_per_hour: float):
        self.usd_per_hour, self.usd, self.last = usd_per_hour, 0.0, (created, 1)

    def add(self, workers: int, now: float) -> float:
        then, before = self.last
        self.usd += max(workers, before) * self.usd_per_hour * max(0.0, now - then) / 3600
        self.last = (now, workers)
        return self.usd


class ServingCost:
    """What the endpoint has cost since its creation, `since`: RunPod's billed figure, or, when that is less (billing
    lags), `WorkerTime`'s count."""

    def __init__(self, client: RunpodClient, endpoint_id: str, since: datetime, usd_per_hour: float,
                 clock: Callable[[], float] = time.time):
        self.client, self.endpoint_id, self.since, self.clock = client, endpoint_id, since, clock
        self.counted = WorkerTime(min(since.timestamp(), clock()), usd_per_hour)  # `clock` is Unix time, as `since`

    def read(self) -> float:
        health = _read(lambda: self.client.health(self.endpoint_id))
        workers = 0 if health is None else sum(getattr(health.workers, n) or 0 for n in
                                               ("idle", "initializing", "ready", "running", "unhealthy"))
        counted = self.counted.add(workers, self.clock())
        billed = billed_usd(self.client, [self.endpoint_id], self.since)
        return max(counted, billed.usd if billed is not None else 0.0)


class RepoWatch:
    """The serve's Hub adapters against the commits its check read (`ServedAdapter.revision`): each move is said once,
    as a warning, with both commits. `read_commit(repo)` is the commit the repo's main branch points at now."""

    def __init__(self, pinned: dict[str, tuple[str, str]], read_commit: Callable[[str], str],
                 warn: Callable[[str], None]):
        self.pinned, self.read_commit, self.warn = pinned, read_commit, warn
        self.moved: dict[str, str] = {}

    def check(self) -> None:
        for name, (repo, revision) in self.pinned.items():
            try:
                now = self.read_commit(repo)
            except Exception:  # noqa: BLE001 - advice only: an unreadable repo is asked again at the next reading
                continue
            if now != revision and self.moved.get(name) != now:
                self.moved[name] = now
                self.warn(f"Adapter {name}'s repo {repo} moved from commit {revision[:12]} (the one this serve checked) "
                          f"to {now[:12]}: vLLM downloads adapters without a revision, so workers that start from now "
                          "on serve the new commit under the same name; stop the serve and start it again to check it")


def watch_serving(*, expires_at: float, budget_usd: float, read_cost: Callable[[], float],
                  endpoint_exists: Callable[[], bool], cancel_requested: Callable[[], bool],
                  heartbeat: Callable[[], None], clock: Callable[[], float] = time.time,
                  sleep: Callable[[float], None] = time.sleep,
                  watch_repos: Callable[[], None] = lambda: None) -> tuple[str, str, float | None]:
    """Until the serve ends: `("expired" | "budget" | "cancelled" | "lost", why, the cost last read)`. The cost, the
    endpoint and the adapters' repos (`watch_repos`) are read every `COST_EVERY_S`, the first time at once;
    `expires_at` is Unix time (`clock`)."""
    cost, next_read = None, clock()
    while True:
        heartbeat()
        now = clock()
        if cancel_requested():
            return "cancelled", "its flow run was cancelled", cost
        if now >= expires_at:
            return "expired", f"its time ran out at {utc(expires_at)}", cost
        if now >= next_read:
            next_read = now + COST_EVERY_S
            if not endpoint_exists():
                return "lost", "the endpoint was deleted behind the serve (the console, or the reconciler)", cost
            watch_repos()
            cost = read_cost()
            if cost >= budget_usd:
                return "budget", f"it cost ${cost:.4f}, reaching budget_usd ${budget_usd:g}", cost
        sleep(max(0.0, min(WATCH_POLL_S, expires_at - now, next_read - now)))


@task(name="watch-serving", cache_policy=NO_CACHE)
def watch_serving_task(endpoint: Endpoint, expires_at: float, budget_usd: float, usd_per_hour: float,
                       pinned: dict[str, tuple[str, str]] | None = None,
                       hub_token_secret: str | None = None) -> tuple[str, str, float | None]:
    """`watch_serving` with this run's cancel, RunPod's billing, the endpoint's heartbeat, and `pinned` (adapter name →
    its Hub repo and the commit the serve checked) against the Hub, read with the serve's token."""
    since = datetime.fromisoformat(endpoint.created_at.replace("Z", "+00:00"))
    settings, logger = Settings(), get_run_logger()
    hub = HfApi(endpoint=settings.hf_endpoint, token=settings.hub_token(hub_token_secret) if pinned else None)
    repos = RepoWatch(pinned or {}, lambda repo: str(hub.model_info(repo).sha), logger.warning)
    for name, (repo, revision) in (pinned or {}).items():
        logger.info("Adapter %s is served from %s at commit %s; the watch says if the repo moves", name, repo,
                    revision[:12])
    with make_client() as client:
        cost = ServingCost(client, endpoint.id, since, usd_per_hour)

        def exists() -> bool:
            try:
                client.get_endpoint(endpoint.id)
            except errors.NotFoundError:
                return False
            except errors.RunpodError:
                return True  # unreadable is not gone: the next reading asks again
            return True

        ended = watch_serving(expires_at=expires_at, budget_usd=budget_usd, read_cost=cost.read,
                              endpoint_exists=exists, cancel_requested=run_cancel_requested,
                              heartbeat=lambda: beat(endpoint, "SERVING"), watch_repos=repos.check)
    get_run_logger().info("Serving ends: %s", ended[1])
    return ended


def _read(read: Callable[[], object]) -> object | None:
    # Advice only: a reading that fails is skipped, never the end of a watch.
    try:
        return read()
    except errors.RunpodError:
        return None


def _short(model: str, index: int) -> str:
    return "base" if index == 0 else model


def utc(epoch_s: float) -> str:
    return datetime.fromtimestamp(epoch_s, UTC).strftime("%Y-%m-%d %H:%M:%S UTC")
