"""The actor's outbox: at-least-once delivery to the broker with acks, resends and backpressure.

Every message gets a sequence number and stays in the outbox until the broker acks it, which the
broker does only after the LMDB commit that stored it (docs/design.md section 4). Unacked messages are
resent after ``ack_timeout_s`` and right after a (re)connection; the broker dedups on the message
id, so resending is always safe. The outbox is bounded: :meth:`Outbox.put` waits while it is full,
which pauses the episode loops instead of dropping data. With ``spill_dir`` each unacked message
is also a file there, so an actor restarted after a crash resends what was never acknowledged.
With ``ack_log`` each acknowledged message is appended there as a line ``<type> <id>`` (what a
soak checks the broker's stores against: every acked id stored exactly once).
Messages go out in the order they were put: while older ones wait for a connection, new ones
queue behind them; after a lost connection everything unacked is resent, in order.

The broker's registry (adapter names/versions, phase) rides on every ack; each ack's is handed to
``on_registry`` (the actor's :class:`~actors.registry_view.RegistryView`, which keeps the one copy).
"""

from __future__ import annotations

import asyncio
import inspect
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from comap_async.waiting import cancel_and_wait
from comap_async.wire.messages import Ack, ActorMessage, Registry
from comap_async.wire.protocol import DEFAULT_MAX_MESSAGE_BYTES, ProtocolError, decode, encode, message_type, validate

OUTBOX_MAX = 1024
"""Unacknowledged messages an actor's outbox keeps before :meth:`Outbox.put` waits (the episode loops
pause: backpressure, nothing dropped)."""


@dataclass(slots=True)
class _Entry:
    data: bytes
    msg_id: str
    mtype: str = ""
    sent_at: float | None = None  # None: due now
    attempts: int = 0
    spill_path: Path | None = None


class Outbox:
    def __init__(
        self,
        endpoint: str,
        *,
        max_pending: int = OUTBOX_MAX,
        ack_timeout_s: float = 2.0,
        client_keys: Any = None,
        spill_dir: str | Path | None = None,
        ack_log: str | Path | None = None,
        on_registry: Callable[[Registry], Any] | None = None,
        on_reject: Callable[[str, str], Any] | None = None,
        max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
        ctx: zmq.asyncio.Context | None = None,
        log: Any = None,
    ) -> None:
        self.endpoint = endpoint
        self.max_pending = max_pending
        self.ack_timeout_s = ack_timeout_s
        self.client_keys = client_keys
        self.spill_dir = Path(spill_dir).expanduser() if spill_dir else None
        self.ack_log = Path(ack_log).expanduser() if ack_log else None
        self._ack_fd: int | None = None
        self.on_registry, self.on_reject = on_registry, on_reject
        self.max_message_bytes = max_message_bytes
        self._own_ctx = ctx is None
        self.ctx = ctx or zmq.asyncio.Context()
        self.log = log
        self.stats = {"sent": 0, "resent": 0, "acked": 0, "rejected": 0, "refused": 0, "bad_acks": 0}
        self._pending: dict[int, _Entry] = {}
        self._seq = 0
        self._spill_prefix = f"{time.time_ns():020d}"
        self._changed = asyncio.Event()  # something was acked (room, flush)
        self._due = asyncio.Event()  # something should be sent now
        # Set while older messages wait to be (re)sent: a new put then queues behind them instead
        # of going straight out, so one actor's messages reach the broker in the order they were put.
        self._backlog = False
        self._tasks: list[asyncio.Task] = []
        self.sock: zmq.asyncio.Socket | None = None
        self._mon: zmq.asyncio.Socket | None = None

    @classmethod
    def from_config(cls, cfg: Any, **kw: Any) -> "Outbox":
        """An outbox for ``cfg`` (a CoMapConfig): endpoint, bounds, timeout, spill dir, CURVE keys."""
        from comap_async.wire.curve import client_connection

        endpoint, keys = client_connection(cfg, cfg.broker.actor_port, kw.pop("client_keys", None))
        return cls(
            endpoint,
            ack_timeout_s=cfg.actor.ack_timeout_s,
            spill_dir=cfg.actor.spill_dir,
            ack_log=cfg.actor.ack_log,
            client_keys=keys,
            max_message_bytes=cfg.broker.max_message_bytes,
            **kw,
        )

    # ---- lifecycle -------------------------------------------------------------------------------

    async def start(self) -> "Outbox":
        sock = self.ctx.socket(zmq.DEALER)
        sock.linger = 0
        # Queue only to a live, handshaken connection: while the broker is down a send fails
        # (and is retried) instead of piling stale copies into a pipe.
        sock.immediate = True
        sock.sndhwm = sock.rcvhwm = max(1000, self.max_pending)
        sock.reconnect_ivl = 100
        sock.reconnect_ivl_max = 2000
        sock.maxmsgsize = max(self.max_message_bytes, 1 << 20) * 2
        if self.client_keys is not None:
            self.client_keys.apply(sock)
        mon = self._mon = sock.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_DISCONNECTED)
        sock.connect(self.endpoint)
        self.sock = sock
        if self.ack_log is not None:
            self.ack_log.parent.mkdir(parents=True, exist_ok=True)
            # O_APPEND: each line is one write at the end, whole, even with other actors appending too
            self._ack_fd = os.open(self.ack_log, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        if self.spill_dir is not None:
            self._load_spill()
        self._tasks = [
            asyncio.create_task(self._recv_loop(), name="outbox-recv"),
            asyncio.create_task(self._send_loop(), name="outbox-send"),
            asyncio.create_task(self._monitor_loop(mon), name="outbox-monitor"),
        ]
        return self

    async def close(self, flush_timeout: float | None = None) -> None:
        if flush_timeout is not None and self._pending:
            try:
                await self.flush(flush_timeout)
            except TimeoutError:
                pass
        if self._pending:  # never silent: say how many and whether a restart will resend them
            kept = self.spill_dir is not None
            self._log(
                "warning",
                "outbox.close_unflushed",
                pending=len(self._pending),
                spilled_to=str(self.spill_dir) if kept else None,
                lost=0 if kept else len(self._pending),
            )
        await cancel_and_wait(self._tasks)
        if self._mon is not None:  # closed here too: a task cancelled before it ran never closes it
            self._mon.close(linger=0)
        if self.sock is not None:
            self.sock.close(linger=0)
        if self._ack_fd is not None:
            os.close(self._ack_fd)
            self._ack_fd = None
        if self._own_ctx:
            self.ctx.destroy(linger=0)

    async def __aenter__(self) -> "Outbox":
        return await self.start()

    async def __aexit__(self, *exc: Any) -> None:
        await self.close()

    # ---- API -----------------------------------------------------------------------------------

    @property
    def pending(self) -> int:
        return len(self._pending)

    async def put(self, msg: ActorMessage | dict[str, Any]) -> int:
        """Queue ``msg`` (a message, or its wire map; ``seq`` is set here); waits while the outbox is full."""
        if isinstance(msg, dict):
            msg = validate({**msg, "seq": 0})
        while len(self._pending) >= self.max_pending:
            self._changed.clear()
            await self._changed.wait()
        self._seq += 1
        seq = msg.seq = self._seq
        data = encode(msg)  # a bad message is the actor's bug: fail loudly here, not at the broker
        if len(data) > self.max_message_bytes:
            raise ProtocolError(
                f"{message_type(msg)} {msg.id!r} is {len(data)} bytes, broker limit {self.max_message_bytes}"
            )
        entry = _Entry(data, msg.id, message_type(msg))
        if self.spill_dir is not None:
            entry.spill_path = self._spill(seq, data)
        self._pending[seq] = entry
        if self._backlog:
            self._due.set()  # the send loop sends it after the older ones
        else:
            self._send(seq, entry)
        return seq

    async def flush(self, timeout: float | None = None) -> None:
        """Wait until every queued message is acknowledged (TimeoutError after ``timeout``)."""

        async def wait_empty() -> None:
            while self._pending:
                self._changed.clear()
                await self._changed.wait()

        await asyncio.wait_for(wait_empty(), timeout)

    # ---- internals ---------------------------------------------------------------------------

    def _log(self, level: str, event: str, **kw: Any) -> None:
        if self.log is not None:
            getattr(self.log, level)(event, **kw)

    def _send(self, seq: int, entry: _Entry) -> bool:
        assert self.sock is not None
        try:
            # NOBLOCK on an asyncio socket returns a finished future; result() raises Again
            self.sock.send(entry.data, zmq.NOBLOCK).result()
        except zmq.Again:  # not connected or queue full: the send loop retries
            entry.sent_at = None
            self._backlog = True
            return False
        self.stats["resent" if entry.attempts else "sent"] += 1
        entry.attempts += 1
        entry.sent_at = time.monotonic()
        return True

    async def _send_loop(self) -> None:
        tick = min(0.25, self.ack_timeout_s / 4)
        while True:
            try:
                await asyncio.wait_for(self._due.wait(), tick)
            except TimeoutError:
                pass
            self._due.clear()
            now = time.monotonic()
            for seq, entry in list(self._pending.items()):  # in seq order
                if entry.sent_at is None or now - entry.sent_at >= self.ack_timeout_s:
                    if seq in self._pending and not self._send(seq, entry):
                        break  # not connected: try again next tick
            else:
                self._backlog = False  # everything due went out: new puts may go straight out

    async def _monitor_loop(self, mon: zmq.asyncio.Socket) -> None:
        while True:
            event = parse_monitor_message(await mon.recv_multipart())
            if event["event"] == zmq.EVENT_DISCONNECTED and self._pending:
                # whatever was in flight on the lost connection may be lost with it: resend it
                # all, in order, once a connection is back (sends fail until then: immediate)
                for entry in self._pending.values():
                    entry.sent_at = None
                self._backlog = True
            elif event["event"] == zmq.EVENT_HANDSHAKE_SUCCEEDED and self._backlog:
                self._due.set()

    async def _recv_loop(self) -> None:
        assert self.sock is not None
        while True:
            frames = await self.sock.recv_multipart()
            try:
                ack = decode(frames[-1], max(self.max_message_bytes, 1 << 20) * 2)
                if type(ack) is not Ack:
                    raise ProtocolError(f"expected an ack, got {message_type(ack)!r}")
            except ProtocolError as exc:
                self.stats["bad_acks"] += 1
                self._log("error", "outbox.bad_ack", error=str(exc))
                continue
            self._on_ack(ack)

    def _on_ack(self, ack: Ack) -> None:
        if self.on_registry is not None:
            res = self.on_registry(ack.registry)
            if inspect.isawaitable(res):
                asyncio.ensure_future(res)
        entry = self._pending.get(ack.seq)
        if entry is None:
            if not ack.ok:  # an error for a frame we cannot match: still worth a loud line
                self._log("error", "outbox.unmatched_error", seq=ack.seq, error=ack.error)
            return  # a duplicate ack of a resend
        if ack.ok:
            self.stats["acked"] += 1
            if self._ack_fd is not None:  # the broker acks after its commit: every line names a stored message
                os.write(self._ack_fd, f"{entry.mtype} {entry.msg_id}\n".encode())
            self._forget(ack.seq, entry)
        elif ack.retry:
            self.stats["refused"] += 1  # broker storage refused: keep it, resend after the timeout
            self._log("warning", "outbox.refused", id=entry.msg_id, error=ack.error)
        else:
            self.stats["rejected"] += 1  # the message itself is bad: resending cannot help
            self._log("error", "outbox.rejected", id=entry.msg_id, error=ack.error)
            self._forget(ack.seq, entry)
            if self.on_reject is not None:
                self.on_reject(entry.msg_id, ack.error or "")

    def _forget(self, seq: int, entry: _Entry) -> None:
        del self._pending[seq]
        if entry.spill_path is not None:
            entry.spill_path.unlink(missing_ok=True)
        self._changed.set()

    def _spill(self, seq: int, data: bytes) -> Path:
        assert self.spill_dir is not None
        path = self.spill_dir / f"{self._spill_prefix}-{seq:012d}.msg"
        tmp = path.with_suffix(".tmp")
        tmp.write_bytes(data)
        os.replace(tmp, path)  # never a half-written file under the final name
        return path

    def _load_spill(self) -> None:
        assert self.spill_dir is not None
        self.spill_dir.mkdir(parents=True, exist_ok=True)
        for stale in self.spill_dir.glob("*.tmp"):
            stale.unlink(missing_ok=True)
        loaded = 0
        for path in sorted(self.spill_dir.glob("*.msg")):
            try:
                msg = decode(path.read_bytes(), 1 << 30)
                self._seq += 1
                msg.seq = self._seq
                data = encode(msg)
            except Exception as exc:  # noqa: BLE001 - a damaged spill file is reported and kept aside
                self._log("error", "outbox.bad_spill_file", path=str(path), error=str(exc))
                path.rename(path.with_suffix(".bad"))
                continue
            self._pending[self._seq] = _Entry(data, msg.id, message_type(msg), spill_path=path)
            loaded += 1
        if loaded:
            self._log("info", "outbox.spill_loaded", messages=loaded)
            self._backlog = True
            self._due.set()
