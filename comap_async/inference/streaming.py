"""Streamed completions (server-sent events) and ``/v1/chat/completions``, in vLLM's shapes.

A researcher talks to a trained policy version, or points an agent harness at it, through chat
completions, usually streamed. Chat renders the messages with the model's chat template (the one
the actors use, non-thinking mode) and generates as ``/v1/completions`` does; ``model`` picks an
adapter. A stream sends each new piece of text as it is decoded, holding back what could still turn
out to be the start of a stop string (or half a UTF-8 character), then the finish reason and
``data: [DONE]``.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from typing import Any

from aiohttp import web

from comap_async.inference.token_sampling import CompletionRequest, RequestError, parse_completion_request

CHAT_FIELDS = (
    "structured_outputs",
    "model",
    "temperature",
    "top_p",
    "top_k",
    "n",
    "stop",
    "seed",
    "stop_token_ids",
    "ignore_eos",
    "skip_special_tokens",
    "include_stop_str_in_output",
)


class TextDeltas:
    """The safe-to-send new text of one sequence after each token (engine thread appends tokens)."""

    def __init__(self, tokenizer: Any, seq: Any) -> None:
        self.tokenizer, self.seq = tokenizer, seq
        self.holdback = max((len(s) for s in seq.params.stop), default=1) - 1
        self.sent = 0

    def delta(self, final: bool = False) -> str:
        """``final``: the sequence has been handed back (its future is done), so ``seq.text`` is complete."""
        seq = self.seq
        if final:  # the engine's text, cut at a stop string
            text = seq.text
        else:
            text = self.tokenizer.decode(list(seq.out_ids), skip_special_tokens=seq.params.skip_special_tokens)
            # the engine may not have ended the sequence yet at a stop string its last token completed
            cut = min((i for stop in seq.params.stop if (i := text.find(stop)) >= 0), default=len(text))
            text = text[: max(0, min(cut, len(text) - self.holdback))]
            while text.endswith("\ufffd"):  # half a UTF-8 character: wait for its other bytes
                text = text[:-1]
        out, self.sent = text[self.sent :], max(self.sent, len(text))
        return out


async def _sse(request: web.Request) -> web.StreamResponse:
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
    await resp.prepare(request)
    return resp


async def _send(resp: web.StreamResponse, payload: Any) -> None:
    await resp.write(f"data: {json.dumps(payload) if not isinstance(payload, str) else payload}\n\n".encode())


def stream_usage(body: dict[str, Any], stream: bool) -> bool:
    """Whether a stream ends with a usage chunk: ``stream_options.include_usage``, as OpenAI and vLLM."""
    options = body.get("stream_options")
    if options is None:
        return False
    if not isinstance(options, dict) or not isinstance(options.get("include_usage", False), bool):
        raise RequestError(
            "'stream_options' must be an object such as {\"include_usage\": true}", param="stream_options"
        )
    return stream and options.get("include_usage", False)


async def _stream(
    request: web.Request,
    state: Any,
    req: CompletionRequest,
    ids: list[list[int]],
    chunk: Any,
    usage_chunk: Any = None,
) -> web.StreamResponse:
    """Generate and send ``chunk(index, text, finish_reason, stop_reason)`` events as tokens come; with
    ``usage_chunk(usage)``, the stream ends with that chunk (no choices) and every other one carries
    ``"usage": null``, as OpenAI sends them with ``stream_options.include_usage``."""
    from comap_async.inference.openai_api import finished, submit, usage

    if usage_chunk is not None:
        plain = chunk

        def chunk(*args: Any) -> dict[str, Any]:
            return {**plain(*args), "usage": None}

    if req.params.logprobs is not None:
        raise RequestError("logprobs are not streamed by the embedded server; send stream=false", param="logprobs")
    loop = asyncio.get_running_loop()
    wake = asyncio.Event()  # a token came, or a sequence ended
    seqs, futures = submit(state, req, ids, on_token=lambda s: loop.call_soon_threadsafe(wake.set))
    for f in futures:
        f.add_done_callback(lambda _: wake.set())
    resp = await _sse(request)
    deltas = [TextDeltas(state.tokenizer, s) for s in seqs]
    done = [False] * len(seqs)
    try:
        while not all(done):
            await wake.wait()
            wake.clear()
            for i, (seq, d) in enumerate(zip(seqs, deltas)):
                if done[i]:
                    continue
                if futures[i].done():
                    done[i] = True
                    if seq.error is None:
                        await _send(resp, chunk(i, d.delta(final=True), seq.finish_reason, seq.stop_reason))
                elif text := d.delta():
                    await _send(resp, chunk(i, text, None, None))
        await finished(seqs, futures)
        if usage_chunk is not None:
            await _send(resp, usage_chunk(usage(ids, seqs)))
    except (ConnectionResetError, asyncio.CancelledError):
        for s in seqs:
            s.cancelled = True
        raise
    await _send(resp, "[DONE]")
    await resp.write_eof()
    return resp


async def stream_completions(
    request: web.Request,
    state: Any,
    req: CompletionRequest,
    ids: list[list[int]],
    name: str,
    include_usage: bool = False,
) -> web.StreamResponse:
    cid, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())
    head = {"id": cid, "object": "text_completion", "created": created, "model": name}

    def chunk(i: int, text: str, finish: str | None, stop: Any) -> dict[str, Any]:
        choice = {"index": i, "text": text, "logprobs": None, "finish_reason": finish, "stop_reason": stop}
        return {**head, "choices": [choice]}

    usage_chunk = (lambda u: {**head, "choices": [], "usage": u}) if include_usage else None
    return await _stream(request, state, req, ids, chunk, usage_chunk)


def message_text(i: int, message: Any) -> str:
    """A chat message's content as text: a string, or OpenAI's list of text parts (joined by newlines,
    as vLLM joins them)."""
    content = message.get("content") if isinstance(message, dict) else None
    if not isinstance(content, (str, list)) or not isinstance(message.get("role"), str):
        raise RequestError(
            "'messages' must be a non-empty list of {role, content} objects with text content", param="messages"
        )
    if isinstance(content, str):
        return content
    texts = []
    for part in content:
        if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            raise RequestError(
                f"messages[{i}].content has a {str(kind)[:40]!r} part: the embedded server reads text parts "
                '({"type": "text", "text": ...}) only',
                param="messages",
            )
        texts.append(part["text"])
    return "\n".join(texts)


def chat_request(body: Any, state: Any) -> tuple[CompletionRequest, bool, bool]:
    """A ``/v1/chat/completions`` body -> the completion request it amounts to, whether to stream, and
    whether the stream ends with a usage chunk."""
    if not isinstance(body, dict):
        raise RequestError("the request body must be a JSON object")
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise RequestError(
            "'messages' must be a non-empty list of {role, content} objects with text content", param="messages"
        )
    texts = [message_text(i, m) for i, m in enumerate(messages)]
    from comap_async.inference.openai_api import check_prompt_chars

    check_prompt_chars(state, [sum(map(len, texts))])  # before the template copies it
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise RequestError("'stream' must be true or false", param="stream")
    completion: dict[str, Any] = {k: body[k] for k in CHAT_FIELDS if k in body}
    max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
    if max_tokens is not None:
        completion["max_tokens"] = max_tokens
    else:  # as vLLM: up to the context, here the server's generation budget
        completion["max_tokens"] = state.max_new_tokens
    if body.get("logprobs"):
        completion["logprobs"] = body.get("top_logprobs") or 0
    # the rendered text, as an actor sends it to /v1/completions (tokenized off the event loop there)
    completion["prompt"] = state.chat_template.render(
        [{"role": m["role"], "content": text} for m, text in zip(messages, texts)]
    )
    return parse_completion_request(completion, state.max_new_tokens), stream, stream_usage(body, stream)


def _chat_logprobs(state: Any, seq: Any, k: int) -> dict[str, Any]:
    content = []
    for tok, lp, top in zip(seq.out_ids, seq.token_logprobs, seq.top_logprobs):
        t = state.engine.token_str(tok)
        content.append(
            {
                "token": t,
                "logprob": max(lp, -9999.0),
                "bytes": list(t.encode()),
                "top_logprobs": [
                    {
                        "token": state.engine.token_str(i),
                        "logprob": max(v, -9999.0),
                        "bytes": list(state.engine.token_str(i).encode()),
                    }
                    for i, v in top[:k]
                ],
            }
        )
    return {"content": content}


async def chat(request: web.Request, state: Any, body: Any) -> web.StreamResponse:
    from comap_async.inference.openai_api import finished, prepare, submit, usage

    req, stream, include_usage = chat_request(body, state)
    name = req.model or state.base_name
    ids = await prepare(state, req)
    cid, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
    if stream:
        started: set[int] = set()

        def chunk(i: int, text: str, finish: str | None, stop: Any) -> dict[str, Any]:
            delta: dict[str, Any] = {"content": text}
            if i not in started:  # the first chunk of a choice names the role
                started.add(i)
                delta = {"role": "assistant", **delta}
            return {
                "id": cid,
                "object": "chat.completion.chunk",
                "created": created,
                "model": name,
                "choices": [
                    {"index": i, "delta": delta, "logprobs": None, "finish_reason": finish, "stop_reason": stop}
                ],
            }

        head = {"id": cid, "object": "chat.completion.chunk", "created": created, "model": name}
        usage_chunk = (lambda u: {**head, "choices": [], "usage": u}) if include_usage else None
        return await _stream(request, state, req, ids, chunk, usage_chunk)
    seqs, futures = submit(state, req, ids)
    await finished(seqs, futures)
    k = req.params.logprobs
    choices = [
        {
            "index": i,
            "message": {"role": "assistant", "content": s.text, "tool_calls": []},
            "logprobs": _chat_logprobs(state, s, k) if k is not None else None,
            "finish_reason": s.finish_reason,
            "stop_reason": s.stop_reason,
        }
        for i, s in enumerate(seqs)
    ]
    return web.json_response(
        {
            "id": cid,
            "object": "chat.completion",
            "created": created,
            "model": name,
            "choices": choices,
            "usage": usage(ids, seqs),
            "prompt_logprobs": None,
        }
    )
