"""The learner's client for the broker: sample batches, announce adapter versions, read stats.

One DEALER socket, requests matched to replies by ``req``; each call has a timeout and raises
:class:`BrokerError` with a reason a person can act on. Every request is idempotent (sampling
reads, ``announce`` replaces the registry), so a timed-out call is simply sent again, under the
client's retry policy (:data:`BROKER_RETRY`: 3 attempts; a test passes a shorter one as ``retry``).
"""

from __future__ import annotations

import asyncio
import itertools
from typing import Any

import zmq
import zmq.asyncio

from comap_async import retry as retry_policy
from comap_async.retry import RetryPolicy
from comap_async.waiting import cancel_and_wait
from comap_async.wire.messages import (
    Announce,
    Batch,
    EvalResult,
    GetRegistry,
    GetStats,
    LearnerRequest,
    Message,
    Reply,
    Sample,
)
from comap_async.wire.protocol import DEFAULT_MAX_MESSAGE_BYTES, ProtocolError, decode, encode


class BrokerError(RuntimeError):
    """The broker refused a request or did not answer in time."""


class _NoReply(BrokerError):
    """No reply within the timeout: retried under the policy, then raised as is."""


BROKER_RETRY = RetryPolicy(attempts=3, backoff_s=0.0, backoff_max_s=0.0)
"""The broker client's policy when none is given: a request without a reply within the client's
timeout is sent again, up to 3 tries in all (every request is idempotent), with no wait beyond the
timeout."""


class BrokerClient:
    def __init__(
        self,
        endpoint: str,
        *,
        timeout_s: float = 10.0,
        retry: RetryPolicy | None = None,
        retries: int | None = None,
        client_keys: Any = None,
        max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
        ctx: zmq.asyncio.Context | None = None,
    ) -> None:
        """``retry``: the policy for requests without a reply in ``timeout_s`` (default :data:`BROKER_RETRY`);
        ``retries`` (attempts after the first) overrides its ``attempts``."""
        self.endpoint = endpoint
        self.timeout_s = timeout_s
        self.retry = retry_policy.policy(retry or BROKER_RETRY, attempts=None if retries is None else retries + 1)
        self.max_message_bytes = max_message_bytes
        self._own_ctx = ctx is None
        self.ctx = ctx or zmq.asyncio.Context()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.linger = 0
        self.sock.immediate = True
        self.sock.reconnect_ivl = 100
        self.sock.reconnect_ivl_max = 2000
        if client_keys is not None:
            client_keys.apply(self.sock)
        self.sock.connect(endpoint)
        self._req = itertools.count(1)
        self._waiting: dict[int, asyncio.Future] = {}
        self._recv_task: asyncio.Task | None = None
        self.bad_replies = 0
        self.last_bad_reply: str | None = None

    @classmethod
    def from_config(cls, cfg: Any, **kw: Any) -> "BrokerClient":
        from comap_async.wire.curve import client_connection

        endpoint, keys = client_connection(cfg, cfg.broker.learner_port, kw.pop("client_keys", None))
        return cls(endpoint, client_keys=keys, max_message_bytes=cfg.broker.max_message_bytes, **kw)

    @property
    def retries(self) -> int:
        """Retries after the first attempt (``retry.attempts - 1``)."""
        return self.retry.attempts - 1

    async def close(self) -> None:
        if self._recv_task is not None:
            await cancel_and_wait([self._recv_task])
        for fut in self._waiting.values():
            if not fut.done():
                fut.cancel()
        self.sock.close(linger=0)
        if self._own_ctx:
            self.ctx.destroy(linger=0)

    async def __aenter__(self) -> "BrokerClient":
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.close()

    # ---- requests ------------------------------------------------------------------------------

    async def sample(self, store: str, n: int, seed: int | None = None, phases: list[str] | None = None) -> Batch:
        """Up to ``n`` non-stale items, uniform over the store's newest window (seeded: reproducible);
        with ``phases``, only items produced in those phases (a reflection sample without a phase
        counts as ``reflect_init``)."""
        extra = {"phases": list(phases)} if phases is not None else {}
        rep = await self._request(lambda req: Sample(req=req, store=store, n=n, seed=seed, **extra))
        if not isinstance(rep, Batch):
            raise BrokerError(f"broker answered sample with '{rep.__struct_config__.tag}', not a batch")
        return rep

    async def announce(
        self,
        phase: str,
        versions: dict[str, int],
        adapters: dict[str, str],
        step: int,
        metrics: dict[str, float] | None = None,
    ) -> dict[str, Any]:
        """Replace the broker's registry (after the adapters are live on every inference server);
        ``metrics`` (numbers) are the learner's latest scalars, shown in the broker's /stats."""
        return await self._data(
            lambda req: Announce(
                req=req,
                phase=phase,
                versions=versions,
                adapters=adapters,
                step=step,
                metrics=metrics or {},
            )
        )

    async def report_eval(self, version: int, result: dict[str, Any]) -> dict[str, Any]:
        """Record the held-out result of an adapter version at the broker (``comap stats`` shows it)."""
        return await self._data(lambda req: EvalResult(req=req, version=version, result=result))

    async def get_registry(self) -> dict[str, Any]:
        return await self._data(lambda req: GetRegistry(req=req))

    async def get_stats(self) -> dict[str, Any]:
        return await self._data(lambda req: GetStats(req=req))

    async def _data(self, build: Any) -> dict[str, Any]:
        rep = await self._request(build)
        if not isinstance(rep, Reply):
            raise BrokerError(f"broker answered with '{rep.__struct_config__.tag}', not a reply")
        return rep.data

    async def _request(self, build: Any) -> Message:
        """Send ``build(req)`` (a :data:`LearnerRequest`, built anew per attempt with a fresh ``req``)
        and return the broker's reply to it."""
        if self._recv_task is None or self._recv_task.done():
            self._recv_task = asyncio.create_task(self._recv_loop(), name="broker-client-recv")

        async def attempt(n: int) -> dict[str, Any]:
            req = next(self._req)
            msg: LearnerRequest = build(req)
            mtype = msg.__struct_config__.tag
            try:
                data = encode(msg)
            except ProtocolError as exc:  # the broker would refuse it: say so without a round trip
                raise BrokerError(f"invalid {mtype} request: {exc}") from None
            fut: asyncio.Future = asyncio.get_running_loop().create_future()
            self._waiting[req] = fut
            try:
                rep = await asyncio.wait_for(self._send_and_wait(data, fut), self.timeout_s)
            except TimeoutError:
                last = (
                    f"no reply from the broker at {self.endpoint} within {self.timeout_s}s "
                    f"(attempt {n} of {self.retry.attempts}; is `comap broker` running there, "
                    "with matching CURVE keys?)"
                )
                if self.bad_replies:
                    last += f"; {self.bad_replies} undecodable replies, last: {self.last_bad_reply}"
                raise _NoReply(last) from None
            finally:
                self._waiting.pop(req, None)
            if isinstance(rep, Reply) and not rep.ok:
                raise BrokerError(f"broker refused {mtype}: {rep.error}")  # not retried: the broker answered
            return rep

        return await retry_policy.call(self.retry, attempt, retry_on=_NoReply)

    async def _send_and_wait(self, data: bytes, fut: asyncio.Future) -> Message:
        await self.sock.send(data)  # waits while not connected (immediate): inside the timeout
        return await fut

    async def _recv_loop(self) -> None:
        while True:
            frames = await self.sock.recv_multipart()
            try:
                rep = decode(frames[-1], self.max_message_bytes * 2)
            except ProtocolError as exc:  # counted; a request it belonged to times out naming it
                self.bad_replies += 1
                self.last_bad_reply = str(exc)
                continue
            fut = self._waiting.get(getattr(rep, "req", None))
            if fut is not None and not fut.done():
                fut.set_result(rep)
