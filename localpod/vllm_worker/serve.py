"""The stand-in's `vllm serve`: an OpenAI-compatible server for a base model and its LoRA adapters, on the CPU.

    python serve.py --host 127.0.0.1 --port 8000 --model MODEL [--enable-lora --lora-modules name=path ...]

(run by `main.py`, with the worker environment's interpreter). It parses its flags the way `vllm serve` does for the
flags it models, loads the model and every adapter (`engine.py`), and only then listens, so `/health` answers once
everything is loaded, as vLLM's does [V init_static_loras; serving.md §4]. A bad flag exits 2 (argparse), a failed
load exits 1: either way the worker's `main.py` sees `vllm serve` die during startup.

Routes [V vllm/entrypoints/openai; serving.md §3, §7]: `GET /health`, `GET /v1/models` (a card per served base name,
then one per adapter: `id` its name, `root` its path as given, `parent` the served base), `POST /v1/chat/completions`
(the tokenizer's chat template) and `POST /v1/completions`, answered in vLLM's shapes (`choices`, `usage
{prompt_tokens, completion_tokens, total_tokens}`). The request's `model` picks the base (a served name, or none) or
an adapter (its name); another name answers 404 `NotFoundError` "The model `X` does not exist.". Errors are vLLM's
`{"error": {"message", "type", "param", "code"}}`: a body that does not parse 400 `BadRequestError`; a prompt at
`--max-model-len` or a `max_tokens` past it 400 (`param` input_tokens / max_tokens). `stream: true` answers
server-sent events in vLLM's chunk shapes (`chat.completion.chunk`: the role first, then one `delta.content` per
token, then the `finish_reason`; `text_completion` chunks for completions; a `usage` chunk when
`stream_options.include_usage`; then `data: [DONE]`), every refusal above coming first as a plain JSON error.

Where it departs from vLLM: decoding is greedy unless the request's `temperature` > 0 (vLLM's default temperature is
the model's generation_config.json's, else 1.0); a streamed answer is generated whole, then sent a token a chunk
(vLLM sends each token as it is decoded); `logprobs`, penalties, `echo`, tools' parsing and the other request fields it does not model are ignored (logged),
and unmodelled flags too (logged at startup).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import re
import sys
import time
import uuid
from dataclasses import dataclass
from typing import Any

log = logging.getLogger("vllm_standin.serve")

MAX_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
"""The only `--max-lora-rank` values vLLM accepts [V vllm/config/lora.py]; another exits 2 at argument parsing."""
DTYPES = ("auto", "half", "float16", "bfloat16", "float", "float32")


@dataclass(frozen=True)
class LoRAModule:
    """One adapter of `--lora-modules`: `name=path`, or a JSON object with these fields [V cli_args.py]."""

    name: str
    path: str
    base_model_name: str | None = None
    is_3d_lora_weight: bool = False


class LoRAModules(argparse.Action):
    """`--lora-modules ITEM...`: each item `name=path` (an `=` and no `,`), else one JSON object `{"name", "path",
    "base_model_name"?}`. A JSON array is no object: "Invalid fields for --lora-modules" and `vllm serve` exits 2
    (serving.md §2 [V vllm/entrypoints/openai/cli_args.py LoRAParserAction]). The whole list replaces any earlier
    `--lora-modules`."""

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any,
                 option_string: str | None = None) -> None:
        modules = []
        for item in values or []:
            if not item:
                continue
            if "=" in item and "," not in item:
                name, path = item.split("=")  # two `=` fail here, as they do in vLLM
                modules.append(LoRAModule(name, path))
                continue
            try:
                fields = json.loads(item)
            except json.JSONDecodeError:
                parser.error(f"Invalid JSON format for --lora-modules: {item}")
            try:
                modules.append(LoRAModule(**fields))  # an array: "argument after ** must be a mapping, not list"
            except TypeError as e:
                parser.error(f"Invalid fields for --lora-modules: {item} - {e}")
        setattr(namespace, self.dest, modules)


def model_len(value: str) -> int | None:
    """`--max-model-len`: an integer or a human-readable one (`4k` = 4000, `25.6k`, `4K` = 4096, `1m`, `1M`: decimals
    with the decimal suffixes only); `-1` or `auto`: the most the model allows, where vLLM fits it to the GPU's memory
    [V vllm human_readable_int_or_auto]."""
    text = value.strip()
    if text.lower() in ("-1", "auto"):
        return None
    match = re.fullmatch(r"(\d+(?:\.\d+)?)([kKmM]?)", text)
    if match is None or ("." in match[1] and match[2] in ("", "K", "M")):
        raise argparse.ArgumentTypeError(f"invalid max model length {value!r}")
    return int(float(match[1]) * {"": 1, "k": 1000, "K": 1024, "m": 1000**2, "M": 1024**2}[match[2]])


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="vllm serve", description="localpod's stand-in for `vllm serve`")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--model", default="Qwen/Qwen3-0.6B")
    p.add_argument("--revision")
    p.add_argument("--tokenizer")
    p.add_argument("--tokenizer-revision")
    p.add_argument("--served-model-name", nargs="+")
    p.add_argument("--max-model-len", type=model_len)
    p.add_argument("--enable-lora", action=argparse.BooleanOptionalAction, default=False)
    p.add_argument("--max-loras", type=int, default=1)
    p.add_argument("--max-lora-rank", type=int, default=16, choices=MAX_LORA_RANKS)
    p.add_argument("--max-cpu-loras", type=int)
    p.add_argument("--lora-dtype", default="auto", choices=("auto", "float16", "bfloat16"))
    p.add_argument("--lora-modules", nargs="+", action=LoRAModules)
    p.add_argument("--dtype", default="auto", choices=DTYPES)
    p.add_argument("--seed", type=int)
    p.add_argument("--chat-template")
    p.add_argument("--trust-remote-code", action=argparse.BooleanOptionalAction, default=False)
    p.add_argument("--hf-token")  # accepted (VLLM_EXTRA_ARGS may carry it); huggingface_hub reads HF_TOKEN anyway
    return p


def main(argv: list[str] | None = None) -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    args, ignored = parser().parse_known_args(argv)
    if ignored:
        log.warning("flags the stand-in does not model, ignored: %s", " ".join(a for a in ignored if a.startswith("-")))
    if args.max_loras < 1:
        parser().error("argument --max-loras: must be at least 1")
    if args.max_cpu_loras is not None and args.max_cpu_loras < args.max_loras:
        raise SystemExit(f"ValueError: max_cpu_loras ({args.max_cpu_loras}) must be >= max_loras ({args.max_loras})")
    if args.hf_token:
        os.environ["HF_TOKEN"] = args.hf_token
    # The heavy imports come after the arguments: a bad flag fails at once, as vLLM's parser does.
    import uvicorn
    from engine import Engine

    try:
        engine = Engine(model=args.model, revision=args.revision, tokenizer=args.tokenizer,
                        tokenizer_revision=args.tokenizer_revision,
                        served_names=args.served_model_name or [args.model], max_model_len=args.max_model_len,
                        chat_template=args.chat_template, trust_remote_code=args.trust_remote_code, seed=args.seed)
        engine.load_adapters(args.lora_modules or [], enable_lora=args.enable_lora, max_lora_rank=args.max_lora_rank)
    except Exception as e:  # vLLM's engine start fails the same way: the process ends before it listens
        log.exception("vllm serve (stand-in) failed to start: %s", e)
        sys.exit(1)
    log.info("serving %s (max_model_len %d) and %d adapter(s) on http://%s:%d", ", ".join(engine.served_names),
             engine.max_model_len, len(engine.adapters), args.host, args.port)
    uvicorn.run(app(engine), host=args.host, port=args.port, log_level="warning")


def app(engine: Any) -> Any:
    from fastapi import FastAPI, Request
    from fastapi.exceptions import RequestValidationError
    from fastapi.responses import JSONResponse, Response

    api = FastAPI(title="vllm serve (localpod stand-in)")

    @api.exception_handler(RequestValidationError)
    async def _invalid(_: Request, exc: RequestValidationError) -> JSONResponse:
        return error(400, "BadRequestError", "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}"
                                                       for e in exc.errors()))

    @api.get("/health")
    def health() -> Response:
        return Response(status_code=200)  # vLLM's: an empty 200 once the engine is up

    @api.get("/v1/models")
    def models() -> dict[str, Any]:
        return {"object": "list", "data": model_cards(engine)}

    @api.post("/v1/chat/completions")
    def chat_completions(body: dict[str, Any]) -> Any:
        return answer(engine, body, chat=True)

    @api.post("/v1/completions")
    def completions(body: dict[str, Any]) -> Any:
        return answer(engine, body, chat=False)

    return api


class RequestError(Exception):
    def __init__(self, status: int, kind: str, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status, self.kind, self.message, self.param = status, kind, message, param


def error(status: int, kind: str, message: str, param: str | None = None) -> Any:
    from fastapi.responses import JSONResponse

    return JSONResponse({"error": {"message": message, "type": kind, "param": param, "code": status}},
                        status_code=status)


HONOURED = {"model", "messages", "prompt", "max_tokens", "max_completion_tokens", "temperature", "top_p", "top_k", "n",
            "stop", "seed", "stream", "stream_options", "add_generation_prompt", "chat_template_kwargs", "tools",
            "user"}


def answer(engine: Any, body: dict[str, Any], *, chat: bool) -> Any:
    try:
        return _answer(engine, body, chat=chat)
    except RequestError as e:
        return error(e.status, e.kind, e.message, e.param)


def _answer(engine: Any, body: dict[str, Any], *, chat: bool) -> Any:
    from engine import Sampling

    if chat and not isinstance(body.get("messages"), list):
        raise RequestError(400, "BadRequestError", "messages: Field required (a list of {role, content})")
    if not chat and body.get("prompt") is None:
        raise RequestError(400, "BadRequestError", "prompt: Field required")
    ignored = sorted(body.keys() - HONOURED)
    if ignored:
        log.warning("request fields the stand-in does not model, ignored: %s", ignored)
    name = body.get("model")
    adapter = None
    if name and name not in engine.served_names:
        adapter = engine.adapters.get(name)
        if adapter is None:  # vLLM's check, before anything else of the request [V engine/serving.py]
            raise RequestError(404, "NotFoundError", f"The model `{name}` does not exist.", "model")
    prompts = [_chat_prompt(engine, body)] if chat else _completion_prompts(engine, body["prompt"])
    asked = body.get("max_completion_tokens") if chat else None
    asked = asked if asked is not None else body.get("max_tokens", None if chat else 16)  # completions: 16 [V]
    temperature = _number(body, "temperature", 0.0)
    top_p = _number(body, "top_p", 1.0)
    n = int(_number(body, "n", 1))
    if temperature < 0:
        raise RequestError(400, "BadRequestError", f"temperature must be non-negative, got {temperature}.")
    if not 0 < top_p <= 1:
        raise RequestError(400, "BadRequestError", f"top_p must be in (0, 1], got {top_p}.")
    if n < 1:
        raise RequestError(400, "BadRequestError", f"n must be at least 1, got {n}.")
    if asked is not None and (not isinstance(asked, int) or asked < 1):
        raise RequestError(400, "BadRequestError", f"max_tokens must be at least 1, got {asked}.", "max_tokens")
    seed = body.get("seed")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
        raise RequestError(400, "BadRequestError", f"seed: an integer, got {seed!r}", "seed")
    stop = body.get("stop") or ()
    stop = (stop,) if isinstance(stop, str) else tuple(stop)
    if not all(isinstance(s, str) for s in stop):
        raise RequestError(400, "BadRequestError", "stop: a string or a list of strings", "stop")
    budgets = [_budget(engine, len(prompt), asked) for prompt in prompts]  # every refusal before any answer
    top_k = int(_number(body, "top_k", -1))

    def answers() -> Any:
        """(prompt tokens, the answer) for each prompt, n times: each of the n answers its own draw, reproducible
        with a seed."""
        for prompt, max_tokens in zip(prompts, budgets, strict=True):
            for i in range(n):
                sampling = Sampling(max_tokens=max_tokens, temperature=temperature, top_p=top_p, top_k=top_k,
                                    seed=None if seed is None else seed + i, stop=stop)
                yield len(prompt), engine.generate(prompt, adapter, sampling)

    served = adapter.name if adapter is not None else engine.served_names[0]
    head = {"id": f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}", "created": int(time.time()), "model": served}
    if body.get("stream"):
        from fastapi.responses import StreamingResponse

        usage = bool((body.get("stream_options") or {}).get("include_usage"))
        return StreamingResponse(_events(answers(), head, chat=chat, usage=usage, n=n), media_type="text/event-stream")
    choices, prompt_tokens, completion_tokens = [], 0, 0
    for index, (length, out) in enumerate(answers()):
        prompt_tokens += length if index % n == 0 else 0
        completion_tokens += out.tokens
        choices.append(_choice(index, out, chat=chat))
    return {
        "id": head["id"],
        "object": "chat.completion" if chat else "text_completion",
        "created": head["created"],
        "model": served,
        "choices": choices,
        "service_tier": None,
        "system_fingerprint": None,
        "usage": {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens + completion_tokens,
                  "completion_tokens": completion_tokens, "prompt_tokens_details": None},
        **({"prompt_logprobs": None} if chat else {}),
        "kv_transfer_params": None,
    }


def _events(answers: Any, head: dict[str, Any], *, chat: bool, usage: bool, n: int) -> Any:
    """vLLM's server-sent events for a streamed answer: each `data: <chunk JSON>` and a blank line, `data: [DONE]`
    last [V vllm/entrypoints/openai/serving_chat.py, serving_completion.py `*_stream_generator`]."""
    kind = "chat.completion.chunk" if chat else "text_completion"

    def event(choices: list[dict[str, Any]], **more: Any) -> str:
        return f"data: {json.dumps(head | {'object': kind, 'choices': choices} | more)}\n\n"

    def choice(index: int, text: str | None, finish: Any = None, stop_reason: Any = None, role: bool = False) -> dict:
        if chat:
            delta = ({"role": "assistant", "content": ""} if role else {} if text is None else {"content": text})
            return {"index": index, "delta": delta, "logprobs": None, "finish_reason": finish,
                    **({"stop_reason": stop_reason} if finish else {})}
        return {"index": index, "text": text or "", "logprobs": None, "finish_reason": finish,
                "stop_reason": stop_reason}

    prompt_tokens = completion_tokens = 0
    for index, (length, out) in enumerate(answers):
        prompt_tokens += length if index % n == 0 else 0
        completion_tokens += out.tokens
        if chat:
            yield event([choice(index, None, role=True)])
        for piece in out.pieces:
            yield event([choice(index, piece)])
        yield event([choice(index, None, out.finish_reason, out.stop_reason)])
    if usage:
        yield event([], usage={"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens + completion_tokens,
                               "completion_tokens": completion_tokens})
    yield "data: [DONE]\n\n"


def _chat_prompt(engine: Any, body: dict[str, Any]) -> list[int]:
    messages = []
    for n, message in enumerate(body["messages"]):
        if not isinstance(message, dict) or "role" not in message:
            raise RequestError(400, "BadRequestError", f"messages[{n}]: a message needs a role and content")
        content = message.get("content")
        if isinstance(content, list):  # OpenAI's content parts: their texts, one per line, as vLLM renders them
            content = "\n".join(part.get("text", "") for part in content if isinstance(part, dict))
        messages.append({**message, "content": content if content is not None else ""})
    tokenizer = engine.tokenizer
    if not tokenizer.chat_template:
        raise RequestError(400, "BadRequestError", "As of transformers v4.44, default chat template is no longer "
                           "allowed, so you must provide a chat template if the tokenizer does not define one.")
    try:
        text = tokenizer.apply_chat_template(messages, tools=body.get("tools"), tokenize=False,
                                             add_generation_prompt=body.get("add_generation_prompt", True),
                                             **(body.get("chat_template_kwargs") or {}))
    except Exception as e:  # a template error is the request's fault: 400, as vLLM answers it
        raise RequestError(400, "BadRequestError", str(e)) from e
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def _completion_prompts(engine: Any, prompt: Any) -> list[list[int]]:
    if isinstance(prompt, str):
        prompt = [prompt]
    elif isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
        prompt = [prompt]  # one prompt of token ids
    if not isinstance(prompt, list) or not prompt:
        raise RequestError(400, "BadRequestError", "prompt: a string, a list of strings or of token ids")
    ids = []
    for item in prompt:
        if isinstance(item, str):
            ids.append(engine.tokenizer(item)["input_ids"])
        elif isinstance(item, list) and all(isinstance(t, int) for t in item):
            ids.append(item)
        else:
            raise RequestError(400, "BadRequestError", "prompt: a string, a list of strings or of token ids")
    return ids


def _budget(engine: Any, prompt_tokens: int, asked: int | None) -> int:
    """`max_tokens`, or what the context leaves; vLLM's two refusals, word for word (serving.md §7)."""
    limit = engine.max_model_len
    if prompt_tokens >= limit:
        raise RequestError(400, "BadRequestError", f"This model's maximum context length is {limit} tokens. However, "
                           f"your request has {prompt_tokens} input tokens. Please reduce the length of the input "
                           f"messages. (parameter=input_tokens, value={prompt_tokens})", "input_tokens")
    if asked is None:
        return limit - prompt_tokens
    if prompt_tokens + asked > limit:
        raise RequestError(400, "BadRequestError", f"'max_tokens' or 'max_completion_tokens' is too large: {asked}. "
                           f"This model's maximum context length is {limit} tokens and your request has "
                           f"{prompt_tokens} input tokens ({asked} > {limit} - {prompt_tokens}). "
                           f"(parameter=max_tokens, value={asked})", "max_tokens")
    return asked


def _number(body: dict[str, Any], key: str, default: float) -> float:
    value = body.get(key)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise RequestError(400, "BadRequestError", f"{key}: a number, got {value!r}", key)
    return value


def _choice(index: int, out: Any, *, chat: bool) -> dict[str, Any]:
    if chat:
        message = {"role": "assistant", "content": out.text, "refusal": None, "annotations": None, "audio": None,
                   "function_call": None, "tool_calls": [], "reasoning": None}
        return {"index": index, "message": message, "logprobs": None, "finish_reason": out.finish_reason,
                "stop_reason": out.stop_reason}
    return {"index": index, "text": out.text, "logprobs": None, "finish_reason": out.finish_reason,
            "stop_reason": out.stop_reason, "prompt_logprobs": None}


def model_cards(engine: Any) -> list[dict[str, Any]]:
    """vLLM's `/v1/models` cards: the base under each served name, then each adapter [V models/serving.py]."""
    now = int(time.time())

    def card(id_: str, root: str, parent: str | None, max_model_len: int | None) -> dict[str, Any]:
        permission = {"id": f"modelperm-{uuid.uuid4().hex}", "object": "model_permission", "created": now,
                      "allow_create_engine": False, "allow_sampling": True, "allow_logprobs": True,
                      "allow_search_indices": False, "allow_view": True, "allow_fine_tuning": False,
                      "organization": "*", "group": None, "is_blocking": False}
        return {"id": id_, "object": "model", "created": now, "owned_by": "vllm", "root": root, "parent": parent,
                "max_model_len": max_model_len, "permission": [permission]}

    cards = [card(name, engine.model_path, None, engine.max_model_len) for name in engine.served_names]
    return cards + [card(a.name, a.path, a.parent, None) for a in engine.adapters.values()]


if __name__ == "__main__":
    main()
