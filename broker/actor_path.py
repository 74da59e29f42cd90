"""The broker's actor path: receive, validate, gate, store in one durable transaction, then ack.

One task does it all: drain the actor ROUTER and queue the frames; hand batches of up to
``broker.group_commit`` frames to the gate pool (:mod:`broker.gate_worker`: decoding, validation
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
done once per batch.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import msgpack
import zmq

import zmq.asyncio

from comap_async.wire.protocol import ID_LEN, SCHEMA_VERSION

from broker.gate_worker import ITEM, REJECT, to_write_item
from broker.counters import stored_total
from broker.store import StoreRefused, WriteItem

Pending = tuple[bytes, list[bytes], bytes]  # ident, delimiter, raw frame
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

    def _reject(self, ident: bytes, delim: list[bytes], category: str, reason: str, seq: int) -> None:
        self.live.reject(category)
        if self.live.should_log("reject:" + category):
            self.log.warning("broker.reject", category=category, reason=reason, peer=ident.hex()[:16],
                             total=self.live.rejects_total)
        self._send_ack(ident, delim, seq, False, reason, retry=False)

    def _on_actor_frames(self, frames: list[bytes]) -> None:
        ident, body = frames[0], frames[1:]
        delim: list[bytes] = []
        if len(body) == 2 and body[0] == b"":  # REQ-style envelope: echo the delimiter back
            delim, body = [b""], body[1:]
        if len(body) != 1:
            self._reject(ident, delim, "bad_frames", f"expected one message frame, got {len(body)}", -1)
            return
        self.pending.append((ident, delim, body[0]))  # decoded and gated by the gate pool

    async def _actor_loop(self) -> None:
        """Receive, gate, store and ack in one task: drain the socket, hand batches to the gate
        pool, commit the oldest gated batch and ack it, repeat; sleep in poll.

        The sockets are read and written through synchronous views (an asyncio NOBLOCK call costs
        a future each, measured ~3x slower per ack). That is safe because only this task touches
        them, never while its own poll is pending, and the asyncio poll checks ZMQ_EVENTS before
        it sleeps, so an edge consumed by a synchronous call is not a missed wake-up."""
        self._actor_sync = zmq.Socket.shadow(self.actor_sock.underlying)
        recv, more = self._actor_sync.recv, self._actor_sync.get
        gates, group = self.gates, self.b.group_commit
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
                self.last_actor_rx = time.monotonic()
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
                for sock in ([self.actor_sock] if reading else []) + gates.sockets:
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
        group = self.b.group_commit
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
            kind = res[0]
            if kind == ITEM:
                items.append(to_write_item(res, raw, shapes))
                stored.append((ident, delim, res[1]))
                per_actor[res[2]] = per_actor.get(res[2], 0) + 1
            elif kind == REJECT:
                self._reject(ident, delim, res[2], res[3], res[1])
            else:  # FAILED: a bug while preparing this message; refused, never half stored
                self.live.bump("internal_errors")
                self.log.error("broker.prepare_failed", seq=res[1], actor=res[2], error=res[3])
                self._send_ack(ident, delim, res[1], False, res[3], retry=False)
        for actor, n in per_actor.items():  # once per batch: last_seen is a clock read and a reorder
            self.live.seen_actor(actor, n)
        if meta["parser_errors"]:  # counted and logged; the transition is kept, its text read as unparseable
            self.live.bump("internal_errors_fact_parser", meta["parser_errors"])
            if self.live.should_log("fact_parser"):
                self.log.error("broker.fact_parser_failed", count=meta["parser_errors"], last=meta["last_error"])
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
        send_ack = self._send_ack
        for ident, delim, seq in stored:  # STORED or DUPLICATE: either way it is in the store now
            send_ack(ident, delim, seq, True)
        self.live.note_stored_total(stored_total(self.store.state["counters"]))

    def _refuse(self, stored: list[tuple[bytes, list[bytes], int]], reason: str) -> None:
        self.writable_error = reason
        self.live.bump("refused", len(stored))
        if self.live.should_log("refused"):
            self.log.error("broker.refusing_writes", reason=reason, refused_total=self.live.counters["refused"])
        for ident, delim, seq in stored:  # the actor keeps them and resends later
            self._send_ack(ident, delim, seq, False, f"broker cannot store: {reason}", retry=True)
