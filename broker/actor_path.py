"""The broker's actor path: receive, validate, gate, store in one durable transaction, then ack.

:class:`ActorPath` is owned by :class:`broker.server.Broker`, which builds what it needs (the
actor ROUTER, the replay store, the gate pool, the live counters) and hands them to it; the
broker then starts it, reads its state for ``/stats`` and ``/healthz`` (``queued``,
``writable_error``, ``map_info``) and stops it at shutdown.

One task does it all: drain the actor ROUTER and queue the frames; hand batches of up to
:data:`GROUP_COMMIT` frames to the gate pool (:mod:`broker.gate_worker`: decoding, validation
and both gates, in worker processes by default); take the oldest gated batch, answer its rejects,
store its items in one durable LMDB transaction, and only then ack each with the current
registry. While a commit syncs, the gate workers gate the next batches and ZeroMQ's I/O thread
keeps receiving. When the workers' queues are full and no gated batch is ready, the task gates
the next batch itself instead of sleeping, so on a busy host both processes stay at work (the
results still come out in submission order). When the queue is long the task stops reading;
ZeroMQ's high-water marks then push back on actors.

All LMDB work runs on the event loop thread: map resizing needs no concurrent transaction, and a
storage thread would fight the loop for the GIL on every put (see ``_store_and_ack``).

Everything here runs once per message at tens of thousands of messages a second, so it avoids
pyzmq's multipart helpers (a Python loop with an option lookup per frame: measured 4-7 us per
message against 1-2 us for the plain calls used here) and per-message bookkeeping that can be
done once per batch (the positive ack's body, with the registry, is packed once per batch).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

import msgpack
import zmq
import zmq.asyncio

from broker.counters import LiveStats, stored_total
from broker.gate_worker import Gated, GatePool, Rejected, to_write_item
from broker.store import ReplayStore, StoreRefused, WriteItem
from comap_async.wire.messages import ID_LEN, Ack
from comap_async.wire.protocol import encode

Pending = tuple[bytes, list[bytes], bytes]  # ident, delimiter, raw frame
_SEND_MORE = zmq.SNDMORE | zmq.NOBLOCK
_SEQ_MARK = (1 << 62) - 1  # the seq a cached positive ack is encoded with (packed as a uint64)

GROUP_COMMIT = 256
"""Most messages stored per LMDB transaction (acks go out after its commit); four times as many may be
queued or in the gate pool before the actor socket is no longer read."""
DRAIN_S = 2.0
"""On SIGTERM, keep storing and acking actor messages for at most this long, so actors stopping at the
same moment (``honcho`` signals every process at once and kills after 5 s) flush their outboxes."""
DRAIN_QUIET_S = 0.5
"""The drain ends early once no actor message has arrived for this long."""


def _pack_seq(seq: int) -> bytes:
    # a fixed-width uint64 is valid msgpack for any value and costs a fraction of packb
    return b"\xcf" + seq.to_bytes(8, "big") if seq >= 0 else msgpack.packb(seq)


class ActorPath:
    """Receives, gates, stores and acks what actors send on ``sock`` (see the module docstring).

    ``registry`` returns the registry that acks carry; ``group_commit`` is the most frames gated
    and stored together, ``max_pending`` how many may be queued or in the gate pool before the
    socket is no longer read; ``drain_s`` and ``drain_quiet_s`` bound the drain at :meth:`stop`.
    The caller owns ``sock``, ``store`` and ``gates`` and closes them after :meth:`stop`."""

    def __init__(
        self,
        sock: zmq.asyncio.Socket,
        store: ReplayStore,
        gates: GatePool,
        live: LiveStats,
        log: Any,
        *,
        registry: Callable[[], dict[str, Any]],
        group_commit: int,
        max_pending: int,
        drain_s: float,
        drain_quiet_s: float,
    ) -> None:
        self.sock, self.store, self.gates, self.live, self.log = sock, store, gates, live, log
        self.registry = registry
        self.group_commit, self.max_pending = group_commit, max_pending
        self.drain_s, self.drain_quiet_s = drain_s, drain_quiet_s
        self.pending: list[Pending] = []  # frames received, not yet handed to the gate pool
        self.in_gates = 0  # frames handed to the gate pool, not yet stored and acked
        self.writable_error: str | None = None  # why the store refuses writes now (None: it takes them)
        self.map_info: dict[str, Any] = store.info()  # the LMDB map after the last commit
        self.ingest_closed = False  # set by stop() after the drain: the task stops reading
        self.last_rx = float("-inf")  # no actor traffic yet: nothing to drain
        self._ack_cache: tuple[Any, tuple[bytes, bytes]] = (None, (b"", b""))
        self._sync: zmq.Socket | None = None
        self._task: asyncio.Task | None = None

    @property
    def queued(self) -> int:
        """Frames received and not yet stored and acked."""
        return len(self.pending) + self.in_gates

    # ---- lifecycle ---------------------------------------------------------------------------

    def start(self) -> None:
        """Run :meth:`run` as the ``actor`` task."""
        self._task = asyncio.create_task(self.run(), name="actor")

    async def drain(self) -> None:
        """Keep storing and acking until actors have been quiet a moment (at most ``drain_s``).

        ``honcho`` sends SIGTERM to every process at once; the actors then flush their outboxes,
        and a broker that stopped reading at once would leave them waiting for acks until SIGKILL.
        """
        deadline = time.monotonic() + self.drain_s
        while (now := time.monotonic()) < deadline and now - self.last_rx < self.drain_quiet_s:
            await asyncio.sleep(min(0.05, deadline - now))

    async def stop(self) -> None:
        """Drain actors, stop reading, commit and ack what is queued; returns when the task has."""
        if not self._task.done():
            await self.drain()
        self.ingest_closed = True
        try:  # the task stops reading, commits and acks what it holds, then returns
            await asyncio.wait_for(self._task, timeout=30)
        except Exception as exc:  # noqa: BLE001 - shutdown must finish
            self.log.error("broker.shutdown_flush_failed", error=repr(exc))

    # ---- acks --------------------------------------------------------------------------------

    def _ok_parts(self) -> tuple[bytes, bytes]:
        """A positive ack packed around its seq value: (before, after). The registry changes
        rarely and acks are per message, so the ack is encoded once per registry with a marker seq
        (a fixed-width uint64) and only the seq's 8 bytes change per message."""
        reg = self.registry()
        if self._ack_cache[0] is not reg:
            data = encode(Ack(seq=_SEQ_MARK, ok=True, error=None, registry=reg), check=False)
            before, marker, after = data.partition(_pack_seq(_SEQ_MARK))
            assert marker, "the ack's seq is packed as a uint64"
            self._ack_cache = (reg, (before, after))
        return self._ack_cache[1]

    def _send(self, ident: bytes, delim: list[bytes], data: bytes) -> None:
        send = self._sync.send
        try:
            # the ROUTER is not router_mandatory: a full or vanished peer drops the message instead
            # of raising, so a multipart message is never left half sent
            send(ident, _SEND_MORE)
            if delim:
                send(b"", _SEND_MORE)
            send(data, zmq.NOBLOCK)
        except zmq.ZMQError as exc:  # peer gone or its queue full: it will resend and get a duplicate ack
            self.live.bump("peer_ack_dropped")
            if self.live.should_log("ack_drop"):
                self.log.warning("broker.ack_dropped", error=str(exc))

    def _send_nack(self, ident: bytes, delim: list[bytes], seq: int, error: str | None, retry: bool) -> None:
        self._send(
            ident,
            delim,
            encode(
                Ack(seq=seq, ok=False, error=error[:ID_LEN] if error else None, registry=self.registry(), retry=retry),
                check=False,
            ),
        )

    def _reject(self, ident: bytes, delim: list[bytes], category: str, reason: str, seq: int) -> None:
        self.live.reject(category)
        if self.live.should_log("reject:" + category):
            self.log.warning(
                "broker.reject", category=category, reason=reason, peer=ident.hex()[:16], total=self.live.rejects_total
            )
        self._send_nack(ident, delim, seq, reason, retry=False)

    # ---- the task ----------------------------------------------------------------------------

    def _on_actor_frames(self, frames: list[bytes]) -> None:
        ident, body = frames[0], frames[1:]
        delim: list[bytes] = []
        if len(body) == 2 and body[0] == b"":  # REQ-style envelope: echo the delimiter back
            delim, body = [b""], body[1:]
        if len(body) != 1:
            self._reject(ident, delim, "bad_frames", f"expected one message frame, got {len(body)}", -1)
            return
        self.pending.append((ident, delim, body[0]))  # decoded and gated by the gate pool

    async def run(self) -> None:
        """Receive, gate, store and ack in one task: drain the socket, hand batches to the gate
        pool, commit the oldest gated batch and ack it, repeat; sleep in poll. Returns after
        :meth:`stop` once everything read has been committed and acked.

        The socket is read and written through a synchronous view (an asyncio NOBLOCK call costs
        a future each, measured ~3x slower per ack). That is safe because only this task touches
        it, never while its own poll is pending, and the asyncio poll checks ZMQ_EVENTS before
        it sleeps, so an edge consumed by a synchronous call is not a missed wake-up."""
        self._sync = zmq.Socket.shadow(self.sock.underlying)
        recv, more = self._sync.recv, self._sync.get
        gates, group = self.gates, self.group_commit
        pollers: dict[bool, zmq.asyncio.Poller] = {}
        generation, next_check = -1, 0.0
        while True:
            received = False
            while self._reading():
                try:
                    ident = recv(zmq.NOBLOCK)
                except zmq.Again:
                    break
                received = True
                # ZeroMQ delivers a multipart message whole, and a ROUTER prefixes at least one body
                # frame with the peer identity, so the rest is already here
                frames = [ident, recv(zmq.NOBLOCK)]
                while more(zmq.RCVMORE):
                    frames.append(recv(zmq.NOBLOCK))
                try:
                    self._on_actor_frames(frames)
                except Exception as exc:  # noqa: BLE001 - input must never kill the broker
                    self.live.bump("internal_errors")
                    self.log.exception("broker.actor_frame_error", error=repr(exc))
            if received:  # once per drained batch: the drain at shutdown waits for a quiet socket
                self.last_rx = time.monotonic()
            # full batches go out as long as the pool takes them; a partial one only to an idle
            # pool (for latency): one commit and one worker round trip per few frames would
            # cost more than waiting for the batch in flight
            while self.pending and gates.can_submit() and (len(self.pending) >= group or not gates.inflight_batches):
                self._hand_out_batch(here=False)
            done = gates.ready()
            if done is not None:
                self.in_gates -= len(done[0])
                self._store_and_ack(*done)
                await asyncio.sleep(0)  # let HTTP and learner requests run between transactions
                continue
            if len(self.pending) >= group and gates.workers:
                # the workers' queues are full and nothing is ready to commit: rather than sleep,
                # this process gates a batch too (it stays in order behind the workers' batches)
                self._hand_out_batch(here=True)
                await asyncio.sleep(0)
                continue
            if self.ingest_closed and not self.pending and not gates.inflight_batches:
                return  # everything read has been committed and acked
            if generation != gates.generation:  # workers (re)started: poll their new sockets
                pollers.clear()
                generation = gates.generation
            # while the queue is long we do not read (nor wake for the actor socket): ZeroMQ's
            # high-water marks push back on actors
            reading = self._reading()
            if reading not in pollers:
                pollers[reading] = poller = zmq.asyncio.Poller()
                for sock in ([self.sock] if reading else []) + gates.sockets:
                    poller.register(sock, zmq.POLLIN)
            await pollers[reading].poll(timeout=100)
            if gates.inflight_batches and (now := time.monotonic()) >= next_check:
                next_check = now + 0.2
                gates.check_workers()

    def _reading(self) -> bool:
        """Whether the actor socket is read: not after shutdown's drain, nor while the queue is long."""
        return not self.ingest_closed and len(self.pending) + self.in_gates < self.max_pending

    def _hand_out_batch(self, here: bool) -> None:
        """The oldest ``group_commit`` queued frames to the gate pool (``here``: gated in this process now)."""
        group = self.group_commit
        batch = self.pending[:group]
        del self.pending[:group]
        self.in_gates += len(batch)
        self.gates.submit(batch, here=here)

    def _store_and_ack(self, batch: list[Pending], results: list[tuple], meta: dict[str, Any]) -> None:
        """Answer rejects, store the gated items in one durable transaction, then ack each (or
        refuse them all when the store cannot take them: the actors keep them and resend).

        This runs on the event loop thread on purpose: py-lmdb releases the GIL around every
        put, and a storage thread competing with the loop for the GIL made each commit 3-5 times
        slower than the few milliseconds the transaction takes alone (measured)."""
        items: list[WriteItem] = []
        stored: list[tuple[bytes, list[bytes], int]] = []
        per_actor: dict[str, int] = {}
        shapes = meta["shapes"]
        for (ident, delim, raw), res in zip(batch, results):
            kind = type(res)
            if kind is Gated:
                items.append(to_write_item(res, raw, shapes))
                stored.append((ident, delim, res.seq))
                per_actor[res.actor] = per_actor.get(res.actor, 0) + 1
            elif kind is Rejected:
                self._reject(ident, delim, res.category, res.reason, res.seq)
            else:  # Failed: a bug while preparing this message; refused, never half stored
                self.live.bump("internal_errors")
                self.log.error("broker.prepare_failed", seq=res.seq, actor=res.actor, error=res.reason)
                self._send_nack(ident, delim, res.seq, res.reason, retry=False)
        for actor, n in per_actor.items():  # once per batch: last_seen is a clock read and a reorder
            self.live.seen_actor(actor, n)
        if not items:
            return
        try:
            self.store.write(items, dict(self.live.counters))
            self.map_info = self.store.info()
            self.writable_error = None
        except StoreRefused as exc:
            self._refuse(stored, str(exc))
            return
        except Exception as exc:  # noqa: BLE001 - report, refuse this batch, keep serving
            self.live.bump("internal_errors")
            self.log.exception("broker.store_failed", error=repr(exc))
            self._refuse(stored, f"internal storage error: {type(exc).__name__}: {str(exc)[:200]}")
            return
        send, (before, after) = self._send, self._ok_parts()  # the registry is read once per batch
        for ident, delim, seq in stored:  # STORED or DUPLICATE: either way it is in the store now
            send(ident, delim, before + _pack_seq(seq) + after)
        self.live.note_stored_total(stored_total(self.store.state["counters"]))

    def _refuse(self, stored: list[tuple[bytes, list[bytes], int]], reason: str) -> None:
        self.writable_error = reason
        self.live.bump("refused", len(stored))
        if self.live.should_log("refused"):
            self.log.error("broker.refusing_writes", reason=reason, refused_total=self.live.counters["refused"])
        for ident, delim, seq in stored:  # the actor keeps them and resends later
            self._send_nack(ident, delim, seq, f"broker cannot store: {reason}", retry=True)
