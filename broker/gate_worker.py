"""Gate workers: decode, validate and gate actor messages in other processes (docs/design.md sections 4-5).

Why: per stored transition the broker spent more CPU in ``msgpack`` decoding, validation and the
gates than in ZeroMQ and LMDB together (measured: ~45 us against ~25 us for a 2 KB transition,
when the broker still parsed the world-state gate's facts; the actor does that now). One Python
process can use one core, so that work runs in worker processes while the event loop's process
keeps the sockets, the LMDB transactions and the acks.
Batches are pipelined: while a worker gates batch k+1 the broker commits batch k, and a broker
with nothing to commit while its workers' queues are full gates a batch itself (``/stats``
``gate_workers.batches_gated_in_broker``).

A worker only turns frames into records: it holds no state that matters. The broker keeps every
frame it handed out until the stored batch is acked, so when a worker dies its batches are gated
in the broker process instead (``/stats`` ``gate_workers.restarts``) and a new worker starts; no
frame is lost. Workers ignore SIGTERM/SIGINT (``honcho`` signals the whole group and the broker
still needs them while it drains) and exit when told to, or when the broker process is gone.

``broker.gate_workers: 0`` gates in the broker process (the same code, :func:`prepare_frames`).
"""

from __future__ import annotations

import dataclasses
import multiprocessing
import os
import shutil
import signal
import tempfile
import time
from collections import deque
from typing import Any, Union

import msgpack
import msgspec
import zmq

from broker.counters import reject_category
from broker.ingest import Ingest, best_effort_int
from broker.store import WriteItem
from comap_async.gctune import tune_gc_for_throughput
from comap_async.lifetime import die_with_parent
from comap_async.method.gates import SampleRule
from comap_async.wire.messages import ACTOR_TYPES
from comap_async.wire.protocol import ProtocolError, decode, error_reason, message_type


class Gated(msgspec.Struct, array_like=True, tag=0):
    """A frame to store. ``shape`` indexes the batch's shapes (``meta["shapes"]``), each
    ``[[store, is_frame]..., counters]``, and ``values`` holds the records that are not the frame
    itself (the raw transition is stored as received), in the shape's order. A batch has a handful
    of shapes, so each message travels as a few small fields instead of its own store names and
    counter map (measured: ~4 us less per message for packing, unpacking and counting)."""

    seq: int
    actor: str
    dedup_key: bytes
    values: list[bytes]
    shape: int


class Rejected(msgspec.Struct, array_like=True, tag=1):
    """A frame that is not a valid actor message."""

    seq: int
    category: str
    reason: str


class Failed(msgspec.Struct, array_like=True, tag=2):
    """A valid message whose preparation raised (a bug: the message is refused, never half stored)."""

    seq: int
    actor: str
    reason: str


GateResult = Union[Gated, Rejected, Failed]
"""One result per frame, in order; they travel between processes as small msgpack arrays."""
_encode_results = msgspec.msgpack.Encoder().encode
decode_results = msgspec.msgpack.Decoder(list[GateResult]).decode
STOP = b"stop"
MAX_RESTARTS = 5
_POLL_MS = 1000


def prepare_frames(
    raws: list[bytes], ingest: Ingest, max_bytes: int, learner_port: int, shapes: dict[tuple, int]
) -> list[GateResult]:
    """Decode, validate and gate each frame (pure apart from the parser's error counter); the
    shapes of the items are added to ``shapes`` (shape -> index).

    Never raises: whatever a frame does to the code, it gets a Rejected or Failed result, so one
    frame can neither kill a worker nor stall its batch."""
    out: list[GateResult] = []
    for raw in raws:
        try:
            out.append(_prepare_one(raw, ingest, max_bytes, learner_port, shapes))
        except Exception as exc:  # noqa: BLE001 - a bug for one frame: refused and counted, not fatal
            out.append(
                Failed(best_effort_int(raw, "seq"), "?", f"internal error: {type(exc).__name__}: {str(exc)[:200]}")
            )
    return out


def _prepare_one(raw: bytes, ingest: Ingest, max_bytes: int, learner_port: int, shapes: dict[tuple, int]) -> GateResult:
    try:
        msg = decode(raw, max_bytes)
    except ProtocolError as exc:
        return Rejected(best_effort_int(raw, "seq"), reject_category(exc), error_reason(exc))
    if type(msg) not in ACTOR_TYPES:  # a learner request (it carries "req", not "seq")
        return Rejected(
            best_effort_int(raw, "seq"),
            "wrong_socket",
            f"'{message_type(msg)}' is not an actor message (learners use the learner port {learner_port})",
        )
    try:
        item = ingest.prepare(msg, raw)
    except Exception as exc:  # noqa: BLE001 - refused with its seq, so the actor hears of it
        return Failed(msg.seq, msg.actor, f"internal error: {type(exc).__name__}: {str(exc)[:200]}")
    layout = tuple((store, value is raw) for store, value in item.records)
    shape = (layout, tuple(item.counters.items()))
    index = shapes.get(shape)
    if index is None:
        index = shapes[shape] = len(shapes)
    return Gated(
        msg.seq, msg.actor, item.dedup_key, [value for store, value in item.records if value is not raw], index
    )


def gate_batch(
    raws: list[bytes], ingest: Ingest, max_bytes: int, learner_port: int
) -> tuple[list[GateResult], dict[str, Any]]:
    """:func:`prepare_frames` plus the batch's item shapes."""
    shapes: dict[tuple, int] = {}
    results = prepare_frames(raws, ingest, max_bytes, learner_port, shapes)
    meta = {
        "shapes": [[[list(rec) for rec in layout], dict(counters)] for layout, counters in shapes],
    }
    return results, meta


def to_write_item(result: Gated, raw: bytes, shapes: list[list]) -> WriteItem:
    """The :class:`WriteItem` of a :class:`Gated` result. Items of one shape share one counters map
    (``ReplayStore.write`` adds each map once per batch, times its items)."""
    layout, counters = shapes[result.shape]
    values = iter(result.values)
    return WriteItem(
        result.dedup_key, [(store, raw if is_frame else next(values)) for store, is_frame in layout], counters
    )


# ---- the worker process ----------------------------------------------------------------------


def worker_main(
    endpoint: str,
    rule: dict[str, Any],
    max_bytes: int,
    learner_port: int,
    parent_pid: int,
) -> None:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    # a SIGKILLed broker cannot say stop; off Linux the parent check in the poll loop covers it within a second
    die_with_parent(signal.SIGKILL)
    ingest = Ingest(SampleRule(**rule))
    pack = msgpack.Packer(use_bin_type=True).pack
    ctx = zmq.Context(1)
    sock = ctx.socket(zmq.PAIR)
    sock.linger = 0
    sock.connect(endpoint)
    tune_gc_for_throughput()
    try:
        while True:
            if not sock.poll(_POLL_MS):
                if os.getppid() != parent_pid:
                    return  # the broker is gone
                continue
            frame = sock.recv(copy=True)
            if frame == STOP:
                return
            batch_id, payload = frame[:8], memoryview(frame)[8:]  # an 8-byte batch id, then the frames
            results, meta = gate_batch(msgpack.unpackb(payload, raw=False), ingest, max_bytes, learner_port)
            sock.send_multipart([batch_id, _encode_results(results), pack(meta)], copy=True)
    finally:
        sock.close(0)
        ctx.term()


# ---- the broker's side -----------------------------------------------------------------------


class _Worker:
    def __init__(self, ctx: zmq.Context, spec: dict[str, Any], index: int) -> None:
        self.dir = tempfile.mkdtemp(prefix="comap-gate-")  # 0700: no other user can reach the socket
        self.sock = ctx.socket(zmq.PAIR)  # an asyncio socket: the broker's loop polls it
        self.sock.linger = 0
        self.sock.sndhwm = self.sock.rcvhwm = 0  # at most a few batches are ever in flight
        self.io = zmq.Socket.shadow(self.sock.underlying)  # plain calls: no future per send/recv
        endpoint = f"ipc://{self.dir}/gate.sock"
        self.sock.bind(endpoint)
        self.proc = multiprocessing.get_context("spawn").Process(
            target=worker_main,
            kwargs={**spec, "endpoint": endpoint, "parent_pid": os.getpid()},
            name=f"broker-gate-{index}",
            daemon=True,
        )
        self.proc.start()
        self.inflight: deque[int] = deque()  # batch ids handed to this worker, results not yet in
        self.unsent: deque[bytes] = deque()  # frames the socket has not taken yet

    def flush(self) -> None:
        """Send what waits; a PAIR socket without its peer (still starting, or dead) takes nothing,
        and a blocking send would then freeze the broker's event loop."""
        while self.unsent:
            try:
                self.io.send(self.unsent[0], zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            self.unsent.popleft()

    def close(self, timeout_s: float) -> None:
        if self.proc.is_alive():
            try:
                self.io.send(STOP, zmq.NOBLOCK)
            except zmq.ZMQError:
                pass  # it cannot take the stop: it is killed below
            self.proc.join(timeout_s)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join(1.0)
        self.sock.close(0)
        shutil.rmtree(self.dir, ignore_errors=True)


class GatePool:
    """Hands batches of frames to gate workers and returns the results in submission order.

    ``submit`` gives a batch an id; ``ready`` returns the oldest batch's results once they are
    in (or computes them in this process when there are no workers, or its worker died).
    """

    def __init__(
        self,
        workers: int,
        ingest: Ingest,
        max_bytes: int,
        learner_port: int,
        spec: dict[str, Any],
        log: Any,
        ctx: zmq.Context,
    ) -> None:
        """``spec`` (:func:`pool_spec`) says how a worker rebuilds ``ingest``; it is only read when
        there are workers."""
        self.ingest, self.max_bytes, self.learner_port, self.log = ingest, max_bytes, learner_port, log
        self.spec = {**spec, "max_bytes": max_bytes, "learner_port": learner_port}  # worker_main's arguments
        self.ctx = ctx  # the broker's zmq.asyncio context
        self.generation = 0  # bumped when the set of worker sockets changes (the poller re-registers)
        self.batches: dict[int, list[tuple]] = {}  # id -> (ident, delim, frame)s, until its results are taken
        self.done: dict[int, tuple[list[GateResult], dict[str, Any]]] = {}
        self.order: deque[int] = deque()
        self.next_id = 0
        self.restarts = 0
        self.gated_here = 0  # batches gated in the broker process (no workers, idle broker, dead worker)
        self.workers = [_Worker(self.ctx, self.spec, i) for i in range(workers)]
        self._rr = 0
        self._pack = msgpack.Packer(use_bin_type=True).pack

    @property
    def sockets(self) -> list[zmq.Socket]:
        return [w.sock for w in self.workers]

    @property
    def inflight_batches(self) -> int:
        return len(self.order)

    def can_submit(self) -> bool:
        # two batches per worker: one being gated, one queued, while the broker commits a third
        return not self.workers or len(self.order) < 2 * len(self.workers) + 1

    def submit(self, batch: list[tuple], here: bool = False) -> None:
        """Hand out ``batch`` (``(ident, delim, frame)`` tuples; only the frames travel), or gate
        it in this process now when ``here`` is set or there are no workers."""
        bid = self.next_id
        self.next_id += 1
        self.batches[bid] = batch
        self.order.append(bid)
        if here or not self.workers:
            self._compute_here(bid)
            return
        worker = self.workers[self._rr % len(self.workers)]
        self._rr += 1
        worker.inflight.append(bid)
        worker.unsent.append(bid.to_bytes(8, "big") + self._pack([p[2] for p in batch]))
        worker.flush()

    def _compute_here(self, bid: int) -> None:
        self.gated_here += 1
        self.done[bid] = gate_batch([p[2] for p in self.batches[bid]], self.ingest, self.max_bytes, self.learner_port)

    def collect(self) -> None:
        """Take every result the workers have sent (never blocks)."""
        for worker in self.workers:
            worker.flush()
            while worker.inflight:
                try:
                    bid_raw, payload, meta_raw = worker.io.recv_multipart(zmq.NOBLOCK)
                except zmq.Again:
                    break
                bid = int.from_bytes(bid_raw, "big")
                if bid not in self.batches or bid in self.done:
                    continue  # a batch already gated here after a restart
                worker.inflight.remove(bid)
                self.done[bid] = (decode_results(payload), msgpack.unpackb(meta_raw, raw=False))

    def check_workers(self) -> None:
        """Gate a dead worker's batches here and start a new worker in its place. After
        ``MAX_RESTARTS`` deaths (a parser that cannot load...) no more workers are started: every
        worker's batches are gated here and the broker gates in its own process from then on."""
        dead = [w for w in self.workers if not w.proc.is_alive()]
        if not dead:
            return
        self.restarts += len(dead)
        give_up = self.restarts >= MAX_RESTARTS
        for worker in self.workers if give_up else dead:
            lost = [b for b in worker.inflight if b not in self.done]
            for bid in lost:
                self._compute_here(bid)
            self.log.error(
                "broker.gate_worker_died" if worker in dead else "broker.gate_worker_retired",
                exitcode=worker.proc.exitcode,
                batches_regated=len(lost),
                restarts=self.restarts,
                gating_in_broker_from_now=give_up,
            )
            worker.inflight.clear()
            worker.unsent.clear()
            worker.close(0.5)
        self.workers = (
            []
            if give_up
            else [w if w not in dead else _Worker(self.ctx, self.spec, i) for i, w in enumerate(self.workers)]
        )
        self.generation += 1

    def ready(self) -> tuple[list[tuple], list[GateResult], dict[str, Any]] | None:
        """The oldest submitted batch's frames, results and parser-error meta (:func:`gate_batch`),
        if they are in (results stay in submission order)."""
        self.collect()
        if not self.order or self.order[0] not in self.done:
            return None
        bid = self.order.popleft()
        results, meta = self.done.pop(bid)
        return self.batches.pop(bid), results, meta

    def close(self, timeout_s: float = 2.0) -> None:
        deadline = time.monotonic() + timeout_s
        for worker in self.workers:
            worker.close(max(0.1, deadline - time.monotonic()))
        self.workers = []
        self.generation += 1


def pool_spec(cfg: Any) -> dict[str, Any]:
    """What a worker needs to rebuild the broker's :class:`Ingest` (picklable; :class:`GatePool`
    adds the frame limit and the learner port it is given)."""
    return {"rule": dataclasses.asdict(SampleRule.from_config(cfg))}
