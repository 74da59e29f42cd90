"""The embedded OpenAI-compatible server (aiohttp): the same routes and JSON shapes as vLLM's.

Routes: ``POST /v1/completions`` and ``/v1/chat/completions`` (both also streamed), ``GET /v1/models``,
``POST /v1/load_lora_adapter``,
``POST /v1/unload_lora_adapter`` (bearer token when configured), ``GET /health``, ``GET /metrics``.
The event loop only parses, validates and waits: tokenization and adapter file reads run in a small
thread pool, generation on the engine thread (see engine.py).
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

from comap_async.httpcommon import bearer_matches
from comap_async.inference.choices import ChoiceTrie
from comap_async.inference.engine import Engine, Sequence
from comap_async.inference.slot_registry import AdapterRegistry
from comap_async.inference.token_sampling import (
    CompletionRequest,
    RequestError,
    make_generator,
    parse_completion_request,
)
from comap_async.wire.messages import adapter_family

MAX_WAITING = 1024  # queued sequences beyond this get 503 (clients retry elsewhere / later)
MAX_BODY = 8 << 20


@dataclass
class ServerState:
    engine: Engine
    registry: AdapterRegistry
    tokenizer: Any
    base_name: str
    model_path: str
    max_prompt_tokens: int
    max_new_tokens: int
    max_model_len: int
    executor: ThreadPoolExecutor
    admin_token: str | None = None
    log: Any = None
    chat_template: Any = None  # comap_async.prompts.ChatTemplate of the model (/v1/chat/completions)
    max_prompt_chars: int | None = None  # no text prompt longer can fit max_prompt_tokens (prompt_chars_bound)
    started: int = field(default_factory=lambda: int(time.time()))
    started_at: float = field(default_factory=time.time)
    requests: dict[tuple[str, int], int] = field(default_factory=dict)
    request_seconds: float = 0.0


STATE = web.AppKey("state", ServerState)
METRICS = web.AppKey("metrics", object)  # the server's own prometheus_client CollectorRegistry


def _error(status: int, message: str, err_type: str = "BadRequestError", param: str | None = None) -> web.Response:
    # vLLM's ErrorResponse shape
    body = {"error": {"message": message, "type": err_type, "param": param, "code": status}}
    return web.json_response(body, status=status)


@web.middleware
async def _errors(request: web.Request, handler) -> web.StreamResponse:
    state = request.app[STATE]
    t0 = time.perf_counter()
    status = 500
    try:
        resp = await handler(request)
        status = resp.status
        return resp
    except RequestError as exc:
        status = exc.status
        return _error(exc.status, str(exc), exc.err_type, exc.param)
    except web.HTTPException as exc:
        status = exc.status
        if exc.status < 400:
            raise
        return _error(exc.status, exc.reason if exc.text is None else exc.text, exc.reason.replace(" ", "") + "Error")
    except asyncio.CancelledError:
        status = 499  # client went away
        raise
    except Exception as exc:  # a bug must cost one request, not the server; it is logged with its traceback
        if state.log:
            state.log.exception("http.unhandled", path=request.path)
        return _error(500, f"internal error: {type(exc).__name__}: {exc}", "InternalServerError")
    finally:
        key = (request.path if request.path in _ROUTES else "other", status)
        state.requests[key] = state.requests.get(key, 0) + 1
        state.request_seconds += time.perf_counter() - t0


async def _json(request: web.Request) -> Any:
    raw = await request.read()
    try:
        return json.loads(raw)
    except (ValueError, UnicodeDecodeError) as exc:
        raise RequestError(f"the request body is not valid JSON: {exc}") from None


def _check_admin(request: web.Request) -> None:
    token = request.app[STATE].admin_token
    if not token:
        return
    if not bearer_matches(request.headers.get("Authorization", ""), token):
        raise RequestError(
            "Unauthorized: this endpoint needs 'Authorization: Bearer <inference.admin_token>'", status=401
        )


# ------------------------------------------------------------------ completions
def prompt_chars_bound(tokenizer: Any, max_prompt_tokens: int) -> int:
    """The most characters a text prompt of ``max_prompt_tokens`` tokens can have. A token stands for at
    most as many characters as its vocabulary entry spells (byte-level BPE spells each byte of text as
    one character, SentencePiece the text itself); doubled for normalizers that compose characters."""
    return 2 * max_prompt_tokens * max((len(t) for t in tokenizer.get_vocab()), default=1)


def check_prompt_chars(state: ServerState, lengths: list[int]) -> None:
    """Refuse a text prompt too long to fit before it is tokenized: tokenizing an 8 MB prompt took
    10-32 s and grew the server by 0.9-2.5 GB, to refuse it afterwards all the same."""
    limit = state.max_prompt_chars
    for i, n in enumerate(lengths):
        if limit is not None and n > limit:
            raise RequestError(
                f"prompt {i} has {n} characters; no more than {limit} fit in the server's limit of "
                f"{state.max_prompt_tokens} tokens (inference.max_prompt_tokens)",
                param="prompt",
            )


def _tokenize(tokenizer: Any, prompts: list[str | list[int]]) -> list[list[int]]:
    texts = [p for p in prompts if isinstance(p, str)]
    encoded = iter(tokenizer(texts, add_special_tokens=True)["input_ids"]) if texts else iter(())
    return [list(next(encoded)) if isinstance(p, str) else p for p in prompts]


def _choice_trie(tokenizer: Any, choices: tuple[str, ...], eos_ids: frozenset[int]) -> ChoiceTrie:
    try:
        return ChoiceTrie(tokenizer(list(choices), add_special_tokens=False)["input_ids"], eos_ids)
    except ValueError as exc:
        raise RequestError(str(exc), param="structured_outputs") from None


def _check_lengths(state: ServerState, req: CompletionRequest, ids: list[list[int]]) -> None:
    vocab = len(state.tokenizer)
    for i, p in enumerate(ids):
        n = len(p)
        if n == 0:
            raise RequestError(f"prompt {i} is empty after tokenization", param="prompt")
        if any(t < 0 or t >= vocab for t in p):
            raise RequestError(f"prompt {i} has token ids outside the vocabulary [0, {vocab})", param="prompt")
        if n > state.max_prompt_tokens:
            raise RequestError(
                f"prompt {i} has {n} tokens, more than the server's limit of {state.max_prompt_tokens} "
                "(inference.max_prompt_tokens)",
                param="prompt",
            )
        if n + req.params.max_tokens > state.max_model_len:
            raise RequestError(
                f"This model's maximum context length is {state.max_model_len} tokens. However, you "
                f"requested {n + req.params.max_tokens} tokens ({n} in the messages, "
                f"{req.params.max_tokens} in the completion). Please reduce the length of the "
                "messages or completion.",
                param="max_tokens",
            )


def _logprobs(engine: Engine, seq: Sequence, k: int, as_ids: bool) -> dict[str, Any]:
    name = (lambda t: f"token_id:{t}") if as_ids else engine.token_str
    tokens, offsets, tops = [], [], []
    offset = 0
    for tok, lp, top in zip(seq.out_ids, seq.token_logprobs, seq.top_logprobs):
        s = name(tok)
        d = {s: max(lp, -9999.0)}  # the chosen token first, then the k most likely (as vLLM/OpenAI)
        for t, v in top[:k]:
            d.setdefault(name(t), max(v, -9999.0))
        tokens.append(s)
        offsets.append(offset)
        offset += len(s)
        tops.append(d)
    return {
        "text_offset": offsets,
        "token_logprobs": [max(v, -9999.0) for v in seq.token_logprobs],
        "tokens": tokens,
        "top_logprobs": tops,
    }


async def prepare(state: ServerState, req: CompletionRequest) -> list[list[int]]:
    """The checks every generation request passes before any sequence exists; returns the prompts' ids."""
    if len(req.prompts) * req.n > MAX_WAITING:  # could never be queued: not a busy server, a request to split
        raise RequestError(
            f"this request asks for {len(req.prompts) * req.n} sequences (prompts x n); the server "
            f"queues at most {MAX_WAITING}: send it in parts",
            param="prompt",
        )
    state.registry.resolve(req.model)  # 404 before any work
    check_prompt_chars(state, [len(p) if isinstance(p, str) else 0 for p in req.prompts])
    loop = asyncio.get_running_loop()
    ids = await loop.run_in_executor(state.executor, _tokenize, state.tokenizer, req.prompts)
    _check_lengths(state, req, ids)
    if req.choices is not None:
        req.constraint = await loop.run_in_executor(
            state.executor, _choice_trie, state.tokenizer, req.choices, state.engine.eos_ids
        )
    if state.engine.stats.waiting + len(ids) * req.n > MAX_WAITING:
        raise RequestError(f"server busy: {state.engine.stats.waiting} sequences waiting", status=503)
    if not state.engine.alive:
        raise RequestError("the inference engine has stopped; see the server log", status=503)
    return ids


def submit(
    state: ServerState, req: CompletionRequest, ids: list[list[int]], on_token: Any = None
) -> tuple[list[Sequence], list[asyncio.Future]]:
    """Hand ``n`` sequences per prompt to the engine; each future resolves when its sequence ends.
    ``on_token(seq)`` (engine thread) is called after every generated token (streaming)."""
    loop = asyncio.get_running_loop()
    seqs: list[Sequence] = []
    futures: list[asyncio.Future] = []

    def done(seq: Sequence, fut: asyncio.Future) -> None:
        state.registry.release(seq.slot)
        if not fut.done():
            fut.set_result(seq)

    for p in ids:
        for j in range(req.n):
            fut = loop.create_future()
            seed = None if req.params.seed is None else req.params.seed + j
            seq = Sequence(
                p,
                req.params,
                slot=state.registry.acquire(req.model),
                adapter=adapter_family(req.model or state.registry.base_name),
                generator=make_generator(seed),
                on_token=on_token,
                constraint=req.constraint,
                priority=req.priority,
            )
            seq.on_done = lambda s, f=fut: loop.call_soon_threadsafe(done, s, f)
            seqs.append(seq)
            futures.append(fut)
    state.engine.submit(seqs)
    return seqs, futures


async def finished(seqs: list[Sequence], futures: list[asyncio.Future]) -> None:
    """Wait for every sequence; a cancelled request (client gone) cancels its sequences."""
    try:
        await asyncio.gather(*futures)
    except asyncio.CancelledError:
        for s in seqs:
            s.cancelled = True  # the engine drops them at its next step and releases their slots
        raise
    failed = [s for s in seqs if s.error is not None]
    if failed:
        raise RuntimeError(f"generation failed: {failed[0].error!r}")


def usage(ids: list[list[int]], seqs: list[Sequence]) -> dict[str, Any]:
    prompt_tokens = sum(len(p) for p in ids)
    completion_tokens = sum(len(s.out_ids) for s in seqs)
    return {
        "prompt_tokens": prompt_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "completion_tokens": completion_tokens,
        "prompt_tokens_details": None,
    }


async def completions(request: web.Request) -> web.StreamResponse:
    state = request.app[STATE]
    body = await _json(request)
    stream = isinstance(body, dict) and body.get("stream") is True
    from comap_async.inference.streaming import stream_completions, stream_usage

    include_usage = stream_usage(body, stream) if isinstance(body, dict) else False
    if stream:
        body = {k: v for k, v in body.items() if k not in ("stream", "stream_options")}
    req = parse_completion_request(body, state.max_new_tokens)
    name = req.model or state.base_name
    ids = await prepare(state, req)
    if stream:
        return await stream_completions(request, state, req, ids, name, include_usage)
    seqs, futures = submit(state, req, ids)
    await finished(seqs, futures)
    k = req.params.logprobs
    choices = [
        {
            "index": i,
            "text": s.text,
            "logprobs": _logprobs(state.engine, s, k, req.return_tokens_as_token_ids) if k is not None else None,
            "finish_reason": s.finish_reason,
            "stop_reason": s.stop_reason,
            "prompt_logprobs": None,
        }
        for i, s in enumerate(seqs)
    ]
    return web.json_response(
        {
            "id": f"cmpl-{uuid.uuid4().hex}",
            "object": "text_completion",
            "created": int(time.time()),
            "model": name,
            "choices": choices,
            "usage": usage(ids, seqs),
            "system_fingerprint": None,
            "service_tier": None,
            "kv_transfer_params": None,
        }
    )


async def chat_completions(request: web.Request) -> web.StreamResponse:
    from comap_async.inference.streaming import chat

    return await chat(request, request.app[STATE], await _json(request))


# ------------------------------------------------------------------ models and adapters
def _card(state: ServerState, id_: str, root: str, parent: str | None, created: int) -> dict[str, Any]:
    perm = {
        "id": f"modelperm-{uuid.uuid4().hex}",
        "object": "model_permission",
        "created": created,
        "allow_create_engine": False,
        "allow_sampling": True,
        "allow_logprobs": True,
        "allow_search_indices": False,
        "allow_view": True,
        "allow_fine_tuning": False,
        "organization": "*",
        "group": None,
        "is_blocking": False,
    }
    return {
        "id": id_,
        "object": "model",
        "created": created,
        "owned_by": "vllm",
        "root": root,
        "parent": parent,
        "max_model_len": state.max_model_len if parent is None else None,
        "permission": [perm],
    }


async def models(request: web.Request) -> web.Response:
    state = request.app[STATE]
    data = [_card(state, state.base_name, state.model_path, None, state.started)]
    data += [_card(state, b.name, b.path, state.base_name, b.created) for b in state.registry.bindings.values()]
    return web.json_response({"object": "list", "data": data})


async def load_adapter(request: web.Request) -> web.Response:
    _check_admin(request)
    body = await _json(request)
    if not isinstance(body, dict):
        raise RequestError("the request body must be a JSON object")
    if not body.get("lora_name") or not body.get("lora_path"):
        raise RequestError("Both 'lora_name' and 'lora_path' must be provided.")
    # shielded: a client that gives up mid-load must not leave a half-bound adapter slot behind
    msg = await asyncio.shield(
        request.app[STATE].registry.load(body["lora_name"], body["lora_path"], body.get("load_inplace", False))
    )
    return web.Response(text=msg)


async def unload_adapter(request: web.Request) -> web.Response:
    _check_admin(request)
    body = await _json(request)
    if not isinstance(body, dict):
        raise RequestError("the request body must be a JSON object")
    return web.Response(text=await asyncio.shield(request.app[STATE].registry.unload(body.get("lora_name"))))


async def health(request: web.Request) -> web.Response:
    if not request.app[STATE].engine.alive:
        return _error(503, "the inference engine has stopped", "ServiceUnavailableError")
    return web.Response(status=200)


async def metrics(request: web.Request) -> web.Response:
    """Prometheus text from this server's own registry (see comap_async.inference.metrics)."""
    from comap_async.inference.metrics import render

    body, content_type = render(request.app[STATE], request.app[METRICS])
    return web.Response(body=body, headers={"Content-Type": content_type})


_ROUTES = {
    "/v1/completions": ("POST", completions),
    "/v1/chat/completions": ("POST", chat_completions),
    "/v1/models": ("GET", models),
    "/v1/load_lora_adapter": ("POST", load_adapter),
    "/v1/unload_lora_adapter": ("POST", unload_adapter),
    "/health": ("GET", health),
    "/metrics": ("GET", metrics),
}


def build_app(state: ServerState) -> web.Application:
    app = web.Application(middlewares=[_errors], client_max_size=MAX_BODY)
    app[STATE] = state
    from comap_async.inference.metrics import make_registry

    app[METRICS] = make_registry(state)
    for path, (method, handler) in _ROUTES.items():
        app.router.add_route(method, path, handler)
    return app
