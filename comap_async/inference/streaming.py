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


async def _stream(
    request: web.Request, state: Any, req: CompletionRequest, ids: list[list[int]], chunk: Any
) -> web.StreamResponse:
    """Generate and send ``chunk(index, text, finish_reason, stop_reason)`` events as tokens come."""
    from comap_async.inference.openai_api import finished, submit

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
    except (ConnectionResetError, asyncio.CancelledError):
        for s in seqs:
            s.cancelled = True
        raise
    await _send(resp, "[DONE]")
    await resp.write_eof()
    return resp


async def stream_completions(
    request: web.Request, state: Any, req: CompletionRequest, ids: list[list[int]], name: str
) -> web.StreamResponse:
    cid, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())

    def chunk(i: int, text: str, finish: str | None, stop: Any) -> dict[str, Any]:
        return {
            "id": cid,
            "object": "text_completion",
            "created": created,
            "model": name,
            "choices": [{"index": i, "text": text, "logprobs": None, "finish_reason": finish, "stop_reason": stop}],
        }

    return await _stream(request, state, req, ids, chunk)


def chat_request(body: Any, state: Any) -> tuple[CompletionRequest, bool]:
    """A ``/v1/chat/completions`` body -> the completion request it amounts to, and whether to stream."""
    if not isinstance(body, dict):
        raise RequestError("the request body must be a JSON object")
    messages = body.get("messages")
    if (
        not isinstance(messages, list)
        or not messages
        or not all(
            isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
            for m in messages
        )
    ):
        raise RequestError(
            "'messages' must be a non-empty list of {role, content} objects with text content", param="messages"
        )
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
    completion["prompt"] = state.chat_template.render([{"role": m["role"], "content": m["content"]} for m in messages])
    return parse_completion_request(completion, state.max_new_tokens), stream


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

    req, stream = chat_request(body, state)
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

        return await _stream(request, state, req, ids, chunk)
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
