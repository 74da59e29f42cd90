"""Async client of the OpenAI-compatible inference API (embedded server or vLLM), used by actors and learner.

* Completions go to the endpoint with the fewest requests in flight (ties broken at random), so
  several servers share the load and a slow one gets less; requests made under one
  :data:`affinity` key (an episode) stay on the endpoint its first request went to while that one
  is not much busier than the least busy (``affinity_slack``), so the prompts' shared prefixes are
  in that server's prefix cache.
* Connection errors, timeouts, 429 and 5xx are retried under the client's retry policy
  (:data:`INFERENCE_RETRY`: 6 attempts, exponential backoff with full jitter, so many actors do not
  retry in lockstep), on another endpoint when there is one; an endpoint
  that just failed is avoided for a moment. Other 4xx are the caller's mistake and raise at once.
* After the policy's attempts an :class:`InferenceError` says which endpoints failed and how.
  A caller that retries around the client (the learner's publish) passes ``retry=NO_RETRY``.
* Adapter load/unload go to *every* endpoint: an adapter is only usable once all servers have it.
* Plain ``http://`` endpoints go through :mod:`.http1` (a lean keep-alive client: ~3x less CPU per
  request than aiohttp's, which actors feel at 4-5 requests per step); ``https://`` endpoints use
  aiohttp.
"""

from __future__ import annotations

import asyncio
import collections
import contextvars
import json
import random
import re
import time
from typing import Any

import aiohttp
import orjson

from comap_async import retry as retry_policy
from comap_async.retry import RetryPolicy
from comap_async.wire.completion import Completion
from comap_async.wire.http1 import Http1Pool


class InferenceError(RuntimeError):
    """A request failed for good: after the retry budget, or a non-retryable client error (``status`` 4xx)."""

    def __init__(self, message: str, status: int | None = None, endpoint: str | None = None, attempts: int = 1):
        super().__init__(message)
        self.status, self.endpoint, self.attempts = status, endpoint, attempts


class _Retryable(Exception):
    def __init__(self, message: str, status: int | None = None):
        super().__init__(message)
        self.status = status


def _message(status: int, text: str) -> str:
    try:
        body = json.loads(text)
    except ValueError:
        return text.strip()[:500] or f"HTTP {status}"
    if isinstance(body, dict):
        err = body.get("error")
        if isinstance(err, dict) and err.get("message"):
            return str(err["message"])
        if isinstance(err, str):
            return err
        if body.get("message"):
            return str(body["message"])
    return text.strip()[:500]


affinity: contextvars.ContextVar[str | None] = contextvars.ContextVar("inference_affinity", default=None)
"""The unit of work the current task's requests belong to (an episode: set by the actor's episode
loop and the probes per game); tasks started from it inherit it."""

MAX_CHOICES = 16384
"""The most commands one ``structured_outputs.choice`` request may list (the embedded server's limit;
ScienceWorld's valid-action lists reach a few thousand, ALFWorld's a few dozen)."""
ENGINE_COUNTERS = (
    "prompt_tokens",
    "prefix_cache_hit_tokens",
    "generation_tokens",
    "prefill_seconds",
    "decode_seconds",
    "decode_steps",
    "decode_rows",
    "prefix_cache_evicted_blocks",
)
"""The embedded server's counters an evaluation reads before and after a row (where its time went)."""


def parse_engine_counters(metrics_text: str) -> dict[str, float]:
    """:data:`ENGINE_COUNTERS` from an embedded server's ``/metrics`` text; a counter the text lacks (vLLM
    names its metrics otherwise) is left out."""
    out = {}
    for name in ENGINE_COUNTERS:
        m = re.search(rf"^comap_inference_{name}_total (\S+)$", metrics_text, re.M)
        if m:
            out[name] = float(m.group(1))
    return out


AFFINITY_KEYS = 4096  # the newest keys remembered: many actors' episodes, bounded memory
INFERENCE_RETRY = RetryPolicy(attempts=6, backoff_s=0.25, backoff_max_s=8.0, jitter="full")
"""The client's retry policy when none is given: 6 attempts in all, waiting 0.25 s, doubling up to 8 s,
each wait drawn uniformly below that (full jitter), so actors that failed together do not retry in
lockstep. A test that needs a short one passes ``retry`` (or ``retries``, ``backoff_s``)."""


class InferenceClient:
    def __init__(
        self,
        endpoints: list[str] | str,
        *,
        token: str | None = None,
        timeout_s: float = 120.0,
        retry: RetryPolicy | None = None,
        retries: int | None = None,
        backoff_s: float | None = None,
        backoff_max_s: float | None = None,
        connect_timeout_s: float = 5.0,
        avoid_s: float = 2.0,
        seed: int | None = None,
        affinity_slack: int = 4,
        priority: int = 0,
    ) -> None:
        """``retry``: the retry policy (default :data:`INFERENCE_RETRY`); ``retries`` (attempts after the
        first), ``backoff_s`` and ``backoff_max_s`` override single fields of it. ``priority``: vLLM's
        ``priority`` field on every completion (lower is admitted first; 0: none sent; the evaluator's
        clients pass ``eval.priority``)."""
        eps = [endpoints] if isinstance(endpoints, str) else list(endpoints)
        if not eps:
            raise ValueError("InferenceClient needs at least one endpoint")
        self.endpoints = [e.rstrip("/") for e in eps]
        self.token = token
        self.timeout_s, self.connect_timeout_s = timeout_s, connect_timeout_s
        self.timeout = aiohttp.ClientTimeout(total=timeout_s, sock_connect=connect_timeout_s)
        self.retry = retry_policy.policy(
            retry or INFERENCE_RETRY,
            attempts=None if retries is None else retries + 1,
            backoff_s=backoff_s,
            backoff_max_s=backoff_max_s,
        )
        self.avoid_s = avoid_s
        self.outstanding = {e: 0 for e in self.endpoints}
        self._avoid_until = {e: 0.0 for e in self.endpoints}
        self._rng = random.Random(seed)
        self.affinity_slack = affinity_slack
        self.priority = priority
        self._sticky: collections.OrderedDict[str, str] = collections.OrderedDict()  # affinity key -> endpoint
        self._session: aiohttp.ClientSession | None = None
        self._pool = Http1Pool()
        self._lean: dict[str, bool] = {}
        self._auth_token: str | None = None
        self._auth: dict[str, str] = {}

    @classmethod
    def from_config(cls, cfg: Any, **kw: Any) -> "InferenceClient":
        """A client of ``inference.endpoints``; ``kw`` (e.g. ``priority``, ``retries``) as for the constructor."""
        inf = cfg.inference
        return cls(inf.endpoints, **{"token": inf.admin_token, "timeout_s": inf.request_timeout_s, **kw})

    async def __aenter__(self) -> "InferenceClient":
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.close()

    async def close(self) -> None:
        await self._pool.close()
        if self._session is not None:
            await self._session.close()
            self._session = None

    def _get_session(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            headers = {"Authorization": f"Bearer {self.token}"} if self.token else {}
            # orjson: actors send several requests per environment step; stdlib json is a visible share of it
            self._session = aiohttp.ClientSession(
                timeout=self.timeout,
                headers=headers,
                connector=aiohttp.TCPConnector(limit=0),
                json_serialize=lambda obj: orjson.dumps(obj).decode(),
            )
        return self._session

    # ---------------------------------------------------------------- endpoint choice and retries
    def pick(self, exclude: str | None = None) -> str:
        """Least outstanding requests (or the :data:`affinity` key's endpoint, see the module's
        docstring); endpoints that failed a moment ago only when nothing else is left."""
        now = time.monotonic()
        pool = [e for e in self.endpoints if e != exclude and self._avoid_until[e] <= now]
        if not pool:
            pool = [e for e in self.endpoints if e != exclude] or self.endpoints
        least = min(self.outstanding[e] for e in pool)
        key = affinity.get() if len(self.endpoints) > 1 else None
        if key is not None:
            held = self._sticky.get(key)
            if held in pool and self.outstanding[held] <= least + self.affinity_slack:
                self._sticky.move_to_end(key)
                return held
        choice = self._rng.choice([e for e in pool if self.outstanding[e] == least])
        if key is not None:
            self._sticky[key] = choice
            self._sticky.move_to_end(key)
            if len(self._sticky) > AFFINITY_KEYS:
                self._sticky.popitem(last=False)
        return choice

    @property
    def retries(self) -> int:
        """Retries after the first attempt (``retry.attempts - 1``)."""
        return self.retry.attempts - 1

    def _headers(self) -> dict[str, str]:
        if self.token != self._auth_token:  # built once per token value, not per request
            self._auth_token = self.token
            self._auth = {"Authorization": f"Bearer {self.token}"} if self.token else {}
        return self._auth

    def transport_for(self, endpoint: str) -> str:
        """``"keepalive"`` or ``"aiohttp"``: which client serves ``endpoint`` (https is always aiohttp)."""
        return "keepalive" if self._is_lean(endpoint) else "aiohttp"

    def _is_lean(self, endpoint: str) -> bool:
        lean = self._lean.get(endpoint)  # decided once per endpoint, not per request
        if lean is None:
            lean = self._lean[endpoint] = endpoint.lower().startswith("http://")
        return lean

    async def _once(self, endpoint: str, method: str, path: str, body: Any) -> tuple[int, str]:
        lean = self._is_lean(endpoint)
        self.outstanding[endpoint] = self.outstanding.get(endpoint, 0) + 1
        try:
            if not lean:
                return await self._once_aiohttp(endpoint, method, path, body)
            data = None if body is None else orjson.dumps(body)
            try:
                status, raw = await self._pool.request(
                    endpoint, method, path, data, self._headers(), self.timeout_s, self.connect_timeout_s
                )
            except asyncio.TimeoutError as exc:  # before OSError: TimeoutError is one
                raise _Retryable(str(exc) or f"timed out after {self.timeout_s:g} s") from None
            except OSError as exc:  # ConnectionError, and HttpProtocolError (one of those)
                raise _Retryable(f"{type(exc).__name__}: {exc}") from None
            # error bodies only feed messages, so a server's odd charset must not hide the status
            text = raw.decode() if status < 400 else raw.decode("utf-8", "replace")
            if status >= 500 or status == 429:
                raise _Retryable(f"HTTP {status}: {_message(status, text)}", status)
            return status, text
        finally:
            self.outstanding[endpoint] -= 1

    async def _once_aiohttp(self, endpoint: str, method: str, path: str, body: Any) -> tuple[int, str]:
        try:
            async with self._get_session().request(method, endpoint + path, json=body) as resp:
                text = await resp.text()
                if resp.status >= 500 or resp.status == 429:
                    raise _Retryable(f"HTTP {resp.status}: {_message(resp.status, text)}", resp.status)
                return resp.status, text
        except (aiohttp.ClientConnectionError, aiohttp.ClientPayloadError) as exc:
            raise _Retryable(f"{type(exc).__name__}: {exc}") from None
        except asyncio.TimeoutError:
            raise _Retryable(f"timed out after {self.timeout.total:g} s") from None

    async def _request(
        self, method: str, path: str, body: Any = None, endpoint: str | None = None, retry: RetryPolicy | None = None
    ) -> tuple[int, str, str]:
        """(status, text, endpoint) of the first non-retryable answer; ``endpoint`` pins the server;
        ``retry`` replaces the client's policy for this call."""
        policy = retry or self.retry
        errors: list[str] = []
        endpoint = endpoint.rstrip("/") if endpoint else None
        last: list[Any] = [endpoint, None]  # endpoint and status of the latest attempt

        async def attempt(n: int) -> tuple[int, str, str]:
            ep = endpoint or self.pick(exclude=last[0] if n > 1 and len(self.endpoints) > 1 else None)
            last[0] = ep
            try:
                status, text = await self._once(ep, method, path, body)
            except _Retryable as exc:
                last[1] = exc.status
                errors.append(f"{ep}: {exc}")
                self._avoid_until[ep] = time.monotonic() + self.avoid_s
                raise
            return status, text, ep

        try:
            return await retry_policy.call(policy, attempt, retry_on=_Retryable, rng=self._rng)
        except _Retryable:
            detail = "; ".join(errors[-3:])
            raise InferenceError(
                f"{method} {path} failed after {len(errors)} attempts: {detail}",
                status=last[1],
                endpoint=last[0],
                attempts=len(errors),
            ) from None

    async def _checked(self, method: str, path: str, body: Any = None, endpoint: str | None = None) -> tuple[str, str]:
        status, text, ep = await self._request(method, path, body, endpoint)
        if status >= 400:
            raise InferenceError(
                f"{method} {path} on {ep}: HTTP {status}: {_message(status, text)}", status=status, endpoint=ep
            )
        return text, ep

    # ---------------------------------------------------------------- API
    async def complete(
        self,
        prompt: str | list,
        *,
        model: str | None = None,
        max_tokens: int = 16,
        temperature: float = 1.0,
        top_p: float = 1.0,
        stop: str | list[str] | None = None,
        seed: int | None = None,
        logprobs: int | None = None,
        n: int = 1,
        **extra: Any,
    ) -> Completion:
        """``POST /v1/completions``; ``extra`` passes vLLM's extra fields (``top_k``, ``ignore_eos``, ...)."""
        body: dict[str, Any] = {
            "prompt": prompt,
            "max_tokens": max_tokens,
            "temperature": temperature,
            "top_p": top_p,
            "n": n,
            **extra,
        }
        if model is not None:
            body["model"] = model
        if self.priority:
            body.setdefault("priority", self.priority)
        for key, value in (("stop", stop), ("seed", seed), ("logprobs", logprobs)):
            if value is not None:
                body[key] = value
        text, ep = await self._checked("POST", "/v1/completions", body)
        return Completion.from_json(orjson.loads(text), ep)

    async def _on_all(
        self,
        path: str,
        body: dict[str, Any],
        ok_404: bool = False,
        endpoints: list[str] | None = None,
        retry: RetryPolicy | None = None,
    ) -> None:
        targets = [e.rstrip("/") for e in endpoints] if endpoints else self.endpoints
        results = await asyncio.gather(
            *(self._request("POST", path, body, endpoint=e, retry=retry) for e in targets), return_exceptions=True
        )
        failures = []
        for ep, res in zip(targets, results):
            if isinstance(res, BaseException):
                failures.append((ep, None, str(res)))
            elif res[0] >= 400 and not (ok_404 and res[0] == 404):
                failures.append((ep, res[0], _message(res[0], res[1])))
        if failures:
            detail = "; ".join(f"{ep}: {f'HTTP {st}: ' if st else ''}{msg}" for ep, st, msg in failures)
            raise InferenceError(
                f"POST {path} failed on {len(failures)}/{len(targets)} endpoints: {detail}",
                status=failures[0][1],
                endpoint=failures[0][0],
            )

    async def load_adapter(
        self,
        name: str,
        path: str,
        *,
        load_inplace: bool = False,
        endpoint: str | None = None,
        retry: RetryPolicy | None = None,
    ) -> None:
        """Load a peft adapter directory under ``name`` on every endpoint (or only on ``endpoint``);
        ``retry`` replaces the client's policy (``NO_RETRY`` when the caller retries itself)."""
        body = {"lora_name": name, "lora_path": str(path), "load_inplace": load_inplace}
        await self._on_all("/v1/load_lora_adapter", body, endpoints=[endpoint] if endpoint else None, retry=retry)

    async def unload_adapter(
        self, name: str, *, missing_ok: bool = False, endpoint: str | None = None, retry: RetryPolicy | None = None
    ) -> None:
        """Unload ``name`` everywhere (or on ``endpoint``); ``missing_ok``: a server without it (restarted) is fine."""
        await self._on_all(
            "/v1/unload_lora_adapter",
            {"lora_name": name},
            ok_404=missing_ok,
            endpoints=[endpoint] if endpoint else None,
            retry=retry,
        )

    async def engine_counters(self, endpoint: str | None = None) -> dict[str, float]:
        """The embedded server's engine counters (:data:`ENGINE_COUNTERS`, from ``/metrics``); a server
        that does not expose one (vLLM names its metrics otherwise) leaves it out."""
        text, _ = await self._checked("GET", "/metrics", endpoint=endpoint)
        return parse_engine_counters(text)

    async def model_cards(self, endpoint: str | None = None) -> list[dict[str, Any]]:
        """``GET /v1/models`` data: the base model first, then the adapters."""
        text, _ = await self._checked("GET", "/v1/models", endpoint=endpoint)
        return json.loads(text).get("data", [])

    async def models(self, endpoint: str | None = None) -> list[str]:
        """Served model ids: the base model first, then the adapter names."""
        return [card["id"] for card in await self.model_cards(endpoint)]

    async def health(self, endpoint: str | None = None) -> dict[str, bool] | bool:
        """One attempt, no retries. With ``endpoint``: True, or :class:`InferenceError` when it is not healthy
        (so it can serve as a readiness probe); without: ``{endpoint: healthy}`` for all, never raising."""

        async def one(ep: str) -> tuple[bool, str]:
            try:
                status, text = await self._once(ep, "GET", "/health", None)
                return status == 200, f"HTTP {status}: {_message(status, text)}"
            except _Retryable as exc:
                return False, str(exc)

        if endpoint is not None:
            ok, why = await one(endpoint.rstrip("/"))
            if not ok:
                raise InferenceError(f"{endpoint} is not healthy: {why}", endpoint=endpoint)
            return True
        results = await asyncio.gather(*(one(e) for e in self.endpoints))
        return {e: ok for e, (ok, _) in zip(self.endpoints, results)}
