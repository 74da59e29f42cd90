"""The learner's client for the broker: sample batches, announce adapter versions, read stats.

One DEALER socket, requests matched to replies by ``req``; each call has a timeout and raises
:class:`BrokerError` with a reason a person can act on. Every request is idempotent (sampling
reads, ``announce`` replaces the registry), so a timed-out call is simply retried.
"""

from __future__ import annotations

import asyncio
import itertools
from dataclasses import dataclass
from typing import Any

import zmq
import zmq.asyncio

from comap_async.wire.protocol import DEFAULT_MAX_MESSAGE_BYTES, SCHEMA_VERSION, ProtocolError, decode, encode
from comap_async.waiting import cancel_and_wait


class BrokerError(RuntimeError):
    """The broker refused a request or did not answer in time."""


@dataclass(slots=True)
class Batch:
    store: str
    items: list[dict[str, Any]]
    stale_skipped: int
    available: int


class BrokerClient:
    def __init__(self, endpoint: str, *, timeout_s: float = 10.0, retries: int = 2, client_keys: Any = None,
                 max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES, ctx: zmq.asyncio.Context | None = None) -> None:
        self.endpoint = endpoint
        self.timeout_s, self.retries = timeout_s, retries
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
        return cls(endpoint, client_keys=keys,
                   max_message_bytes=cfg.broker.max_message_bytes, **kw)

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
        rep = await self._request("sample", store=store, n=n, seed=seed, **extra)
        return Batch(rep["store"], rep["items"], rep["stale_skipped"], rep["available"])

    async def announce(self, phase: str, versions: dict[str, int], adapters: dict[str, str], step: int,
                       metrics: dict[str, float] | None = None) -> dict[str, Any]:
        """Replace the broker's registry (after the adapters are live on every inference server);
        ``metrics`` (numbers) are the learner's latest scalars, shown in the broker's /stats."""
        extra = {"metrics": metrics} if metrics else {}
        return (await self._request("announce", phase=phase, versions=versions, adapters=adapters, step=step,
                                    **extra))["data"]

    async def report_eval(self, version: int, result: dict[str, Any]) -> dict[str, Any]:
        """Record the held-out result of an adapter version at the broker (``comap stats`` shows it)."""
        return await self._request("eval_result", version=version, result=result)

    async def get_registry(self) -> dict[str, Any]:
        return (await self._request("get_registry"))["data"]

    async def get_stats(self) -> dict[str, Any]:
        return (await self._request("get_stats"))["data"]

    async def _request(self, mtype: str, **fields: Any) -> dict[str, Any]:
        if self._recv_task is None or self._recv_task.done():
            self._recv_task = asyncio.create_task(self._recv_loop(), name="broker-client-recv")
        last = ""
        for _attempt in range(self.retries + 1):
            req = next(self._req)
            data = encode({"v": SCHEMA_VERSION, "type": mtype, "req": req, **fields})
            fut: asyncio.Future = asyncio.get_running_loop().create_future()
            self._waiting[req] = fut
            try:
                rep = await asyncio.wait_for(self._send_and_wait(data, fut), self.timeout_s)
            except TimeoutError:
                last = (f"no reply from the broker at {self.endpoint} within {self.timeout_s}s "
                        "(is `comap broker` running there, with matching CURVE keys?)")
                if self.bad_replies:
                    last += f"; {self.bad_replies} undecodable replies, last: {self.last_bad_reply}"
                continue
            finally:
                self._waiting.pop(req, None)
            if rep["type"] == "reply" and not rep["ok"]:
                raise BrokerError(f"broker refused {mtype}: {rep['error']}")
            return rep
        raise BrokerError(last)

    async def _send_and_wait(self, data: bytes, fut: asyncio.Future) -> dict[str, Any]:
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
            fut = self._waiting.get(rep.get("req"))
            if fut is not None and not fut.done():
                fut.set_result(rep)
