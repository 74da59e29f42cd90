"""The broker's actor path: receive, validate, gate, store in one durable transaction, then ack.

One task does it all: drain the actor ROUTER, validate each frame (a bad one is answered with an
error ack and counted at once), queue the valid ones; take up to ``broker.group_commit`` queued
messages, apply the gates, store them in one durable LMDB transaction, and only then ack each
with the current registry. While a commit syncs, ZeroMQ's I/O thread keeps receiving (the GIL is
released), so the next batch is waiting. When the queue is long the task stops reading; ZeroMQ's
high-water marks then push back on actors.

All LMDB work runs on the event loop thread: map resizing needs no concurrent transaction, and a
storage thread would fight the loop for the GIL on every put (see ``_store_and_ack``).

Everything here runs once per message at tens of thousands of messages a second, so it avoids
pyzmq's multipart helpers (a Python loop with an option lookup per frame: measured 4-7 us per
message against 1-2 us for the plain calls used here) and per-message bookkeeping that can be
done once per batch.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import msgpack
import zmq

from comap_async.protocol import ID_LEN, SCHEMA_VERSION, ProtocolError, decode, error_reason

from broker.ingest import ACTOR_TYPES, best_effort_int
from broker.stats import reject_category, stored_total
from broker.store import StoreRefused, WriteItem

Pending = tuple[bytes, list[bytes], dict[str, Any], bytes]  # ident, delimiter, message, raw frame
_SEND_MORE = zmq.SNDMORE | zmq.NOBLOCK


def _pack_seq(seq: int) -> bytes:
    # a fixed-width uint64 is valid msgpack for any value and costs a fraction of packb
    return b"\xcf" + seq.to_bytes(8, "big") if seq >= 0 else msgpack.packb(seq)


class ActorPath:
    """Mixin of :class:`broker.server.Broker` (which sets the attributes used here)."""

    def _ok_ack(self, seq: int) -> bytes:
        """A positive ack, packed from a cached body (the registry changes rarely, acks are per message)."""
        reg = self.store.registry
        if self._ack_cache[0] is not reg:
            body = {"v": SCHEMA_VERSION, "type": "ack", "ok": True, "error": None, "registry": reg}
            # a msgpack map is a header plus key/value pairs: the same map with "seq" appended
            self._ack_cache = (reg, b"\x86" + msgpack.packb(body, use_bin_type=True)[1:] + b"\xa3seq")
        return self._ack_cache[1] + _pack_seq(seq)

    def _send_ack(self, ident: bytes, delim: list[bytes], seq: int, ok: bool, error: str | None = None,
                  retry: bool = False) -> None:
        if ok:
            data = self._ok_ack(seq)
        else:
            data = msgpack.packb({"v": SCHEMA_VERSION, "type": "ack", "seq": seq, "ok": False,
                                  "error": error[:ID_LEN] if error else None, "registry": self.store.registry,
                                  "retry": retry}, use_bin_type=True)
        send = self._actor_sync.send
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

    def _reject(self, ident: bytes, delim: list[bytes], category: str, reason: str, raw: Any) -> None:
        self.live.reject(category)
        if self.live.should_log("reject:" + category):
            self.log.warning("broker.reject", category=category, reason=reason, peer=ident.hex()[:16],
                             total=self.live.rejects_total)
        seq = best_effort_int(raw, "seq") if isinstance(raw, bytes) else -1
        self._send_ack(ident, delim, seq, False, reason, retry=False)

    def _on_actor_frames(self, frames: list[bytes]) -> None:
        ident, body = frames[0], frames[1:]
        delim: list[bytes] = []
        if len(body) == 2 and body[0] == b"":  # REQ-style envelope: echo the delimiter back
            delim, body = [b""], body[1:]
        if len(body) != 1:
            self._reject(ident, delim, "bad_frames", f"expected one message frame, got {len(body)}", None)
            return
        raw = body[0]
        try:
            msg = decode(raw, self.b.max_message_bytes)
        except ProtocolError as exc:
            self._reject(ident, delim, reject_category(exc), error_reason(exc), raw)
            return
        if msg["type"] not in ACTOR_TYPES:
            self._reject(ident, delim, "wrong_socket", f"'{msg['type']}' is not an actor message (learners use "
                         f"the learner port {self.b.learner_port})", raw)
            return
        self.pending.append((ident, delim, msg, raw))

    async def _actor_loop(self) -> None:
        """Receive, store and ack in one task: drain, commit a batch, ack, repeat; sleep in poll.

        The socket is read and written through a synchronous view (an asyncio NOBLOCK call costs
        a future each, measured ~3x slower per ack). That is safe because only this task touches
        the socket, never while its own poll is pending, and the asyncio poll checks ZMQ_EVENTS
        before it sleeps, so an edge consumed by a synchronous call is not a missed wake-up."""
        self._actor_sync = zmq.Socket.shadow(self.actor_sock.underlying)
        recv, more = self._actor_sync.recv, self._actor_sync.get
        while True:
            received = False
            while not self.ingest_closed and len(self.pending) < self.max_pending:
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
                self.last_actor_rx = time.monotonic()
            if self.pending:
                batch = self.pending[: self.b.group_commit]
                del self.pending[: self.b.group_commit]
                self._store_and_ack(batch)
                await asyncio.sleep(0)  # let HTTP and learner requests run between transactions
                continue
            if self.ingest_closed:
                return  # everything read has been committed and acked
            # while the queue is long we do not read: ZeroMQ's high-water marks push back on actors
            await self.actor_sock.poll(timeout=100, flags=zmq.POLLIN)

    def _prepare_batch(self, batch: list[Pending]) -> tuple[list[WriteItem], list[int | str]]:
        """Gates and records for a batch. ``slots`` maps each message to its item index, or to an
        error string when preparing it failed (a bug for one message must not lose the batch)."""
        items: list[WriteItem] = []
        slots: list[int | str] = []
        per_actor: dict[str, int] = {}
        prepare = self.ingest.prepare
        for _, _, msg, raw in batch:
            actor = msg["actor"]
            per_actor[actor] = per_actor.get(actor, 0) + 1
            try:
                items.append(prepare(msg, raw))
                slots.append(len(items) - 1)
            except Exception as exc:  # noqa: BLE001
                slots.append(f"internal error: {type(exc).__name__}: {str(exc)[:200]}")
        for actor, n in per_actor.items():  # once per batch: last_seen is a clock read and a reorder
            self.live.seen_actor(actor, n)
        parser_errors = self.ingest.parser.errors
        if parser_errors:  # counted and logged; the transition is kept, its text read as unparseable
            self.ingest.parser.errors = 0
            self.live.bump("internal_errors_fact_parser", parser_errors)
            if self.live.should_log("fact_parser"):
                self.log.error("broker.fact_parser_failed", count=parser_errors, last=self.ingest.parser.last_error)
        return items, slots

    def _store_and_ack(self, batch: list[Pending]) -> None:
        """Gates, one durable transaction, then an ack per message (or a refusal for all).

        This runs on the event loop thread on purpose: py-lmdb releases the GIL around every
        put, and a storage thread competing with the loop for the GIL made each commit 3-5 times
        slower than the few milliseconds the transaction takes alone (measured)."""
        try:
            items, slots = self._prepare_batch(batch)
            if items:
                self.store.write(items, dict(self.live.counters))
            self.map_info = self.store.info()
            self.writable_error = None
        except StoreRefused as exc:
            self._refuse(batch, str(exc))
            return
        except Exception as exc:  # noqa: BLE001 - report, refuse this batch, keep serving
            self.live.bump("internal_errors")
            self.log.exception("broker.store_failed", error=repr(exc))
            self._refuse(batch, f"internal storage error: {type(exc).__name__}: {str(exc)[:200]}")
            return
        send_ack = self._send_ack
        for (ident, delim, msg, _), slot in zip(batch, slots):
            if slot.__class__ is int:  # STORED or DUPLICATE: either way it is in the store now
                send_ack(ident, delim, msg["seq"], True)
            else:
                self.live.bump("internal_errors")
                self.log.error("broker.prepare_failed", id=msg.get("id"), error=slot)
                send_ack(ident, delim, msg["seq"], False, slot, retry=False)
        self.live.note_stored_total(stored_total(self.store.state["counters"]))

    def _refuse(self, batch: list[Pending], reason: str) -> None:
        self.writable_error = reason
        self.live.bump("refused", len(batch))
        if self.live.should_log("refused"):
            self.log.error("broker.refusing_writes", reason=reason, refused_total=self.live.counters["refused"])
        for ident, delim, msg, _ in batch:  # the actor keeps them and resends later
            self._send_ack(ident, delim, msg["seq"], False, f"broker cannot store: {reason}", retry=True)
