"""The broker process: two ZeroMQ ROUTERs, group-committed LMDB storage, the stats HTTP server.

The actor path (receive, validate, gate, store, ack) is :class:`broker.actor_path.ActorPath`,
which the :class:`Broker` builds in ``start`` from the actor socket, store and gate pool it owns; this
module sets the broker up, serves learners, monitors peers and shuts everything down.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from broker import replay_sampling
from broker.actor_path import DRAIN_QUIET_S, DRAIN_S, GROUP_COMMIT, ActorPath
from broker.counters import LiveStats, build_snapshot, reject_category, stored_total
from broker.gate_worker import GatePool
from broker.ingest import Ingest, best_effort_int, checked_registry
from broker.store import EVAL_KEY, ReplayStore, StoreRefused
from comap_async.config import CoMapConfig
from comap_async.method.fingerprint import fingerprint
from comap_async.method.gates import SampleRule
from comap_async.waiting import cancel_and_wait
from comap_async.wire.curve import ServerKeys
from comap_async.wire.messages import (
    PHASES,
    Announce,
    Batch,
    EvalResult,
    GetRegistry,
    GetStats,
    LearnerRequest,
    Reply,
    Sample,
)
from comap_async.wire.protocol import (
    ID_LEN,
    MAX_ITEMS,
    STORES,
    ProtocolError,
    decode,
    encode,
    error_reason,
    message_type,
)

ZAP_DOMAIN = "comap"
LEARNER_TYPES = LearnerRequest.__args__
MAX_EVAL_RESULTS = 2000  # held-out results kept (one per evaluated version)
ACK_QUEUE_MAX = 50_000
"""Replies queued for one peer (ZeroMQ's send high-water mark per connection). A peer that sends without
reading its acks cannot grow the broker past it: further replies to it are dropped and counted
(``peer_ack_dropped``). Nothing acknowledged is lost that way: an actor's outbox resends what was not
acked and the broker, which stores each id once, acks it again. Flooded by a peer that never reads, the
broker grew 274 MB in 20 s without a bound and 5 MB with one of 20,000
(``tests/integration/test_broker_non_reading_peer.py``)."""
_MONITOR_EVENTS = {
    zmq.EVENT_HANDSHAKE_FAILED_AUTH: "handshake_failed_auth",
    zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL: "handshake_failed_protocol",
    zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL: "handshake_failed_no_detail",
    zmq.EVENT_DISCONNECTED: "disconnected",
    zmq.EVENT_HANDSHAKE_SUCCEEDED: "handshake_succeeded",
}


def refusal(reason: str, req: int) -> Reply:
    """A learner request refused, with its reason cut to the schema's limit (a longer one would
    make the reply itself invalid)."""
    return Reply(req=req, ok=False, error=reason[:ID_LEN], data={})


class Broker:
    def __init__(
        self,
        cfg: CoMapConfig,
        log: Any,
        server_keys: ServerKeys | None = None,
        replay_dir: str | Path | None = None,
        gate_spec: dict[str, Any] | None = None,
    ) -> None:
        """``gate_spec`` (:func:`broker.gate_worker.pool_spec`) says how a worker process rebuilds the
        same gating; without it the broker gates in its own process."""
        b = cfg.broker
        self.cfg, self.b, self.log, self.server_keys = cfg, b, log, server_keys
        self.capacities = dict.fromkeys(STORES, b.capacity)
        self.store = ReplayStore(
            replay_dir or cfg.run.dir / "replay", self.capacities, max_map_size_mb=b.max_map_size_mb
        )
        self.ingest = Ingest(SampleRule.from_config(cfg))
        self.method = fingerprint(cfg)  # the run's reference: every ack's registry carries it
        if self.store.registry.get("method") != self.method:
            self.store.set_registry({**self.store.registry, "method": self.method})
        self.live = LiveStats(self.store.state["counters"])
        self.live.note_stored_total(stored_total(self.store.state["counters"]))
        self.gate_spec = gate_spec
        # the evaluator's held-out results by version (persisted in ``meta``; served with every /stats)
        self.eval_results: dict[str, Any] = self.store.get_meta(EVAL_KEY, {})
        self.stopping = asyncio.Event()  # set by SIGTERM/SIGINT; shutdown() then drains and closes
        self._tasks: list[asyncio.Task] = []
        self._monitors: list[zmq.asyncio.Socket] = []
        self.ctx = zmq.asyncio.Context()
        self.auth = None
        self.endpoints: dict[str, str] = {}
        # set by start(); None until then, so shutdown() closes what a start that failed half-way opened
        self.gates: GatePool | None = None
        self.actor_sock: zmq.asyncio.Socket | None = None
        self.learner_sock: zmq.asyncio.Socket | None = None
        self.actor_path: ActorPath | None = None
        self.http_runner: Any = None

    # ---- set-up ------------------------------------------------------------------------------

    def _router(self, port: int, label: str) -> zmq.asyncio.Socket:
        sock = self.ctx.socket(zmq.ROUTER)
        sock.linger = 500
        sock.maxmsgsize = self.b.max_message_bytes  # ZeroMQ drops the peer of an oversized frame
        sock.rcvhwm = max(1000, 4 * GROUP_COMMIT)  # backpressure on what peers send
        # A ROUTER drops a reply silently when the peer's queue is at its high-water mark. ZeroMQ's
        # default (1000) lost error acks of a peer that sent faster than it read (the fuzz test: 27-393
        # of 10,000, 2 runs in 15); no limit let a peer that never reads grow the broker without bound
        # (60 -> 558 MB in 60 s of empty frames). The bound is per peer and far above what an honest
        # peer leaves unread; a dropped ack only makes an outbox resend (stored once, acked again).
        sock.sndhwm = ACK_QUEUE_MAX
        sock.router_mandatory = False  # a reply to a vanished peer is dropped, never raises
        if self.server_keys is not None:
            sock.curve_server = True
            sock.curve_secretkey = self.server_keys.secret
            sock.curve_publickey = self.server_keys.public
            sock.zap_domain = ZAP_DOMAIN.encode()
        host = "127.0.0.1" if self.b.host == "localhost" else self.b.host
        sock.bind(f"tcp://{host}:{port}")
        self.endpoints[label] = f"tcp://{host}:{port}"
        mon = sock.get_monitor_socket(sum(_MONITOR_EVENTS))
        self._tasks.append(asyncio.create_task(self._monitor(mon, label), name=f"monitor-{label}"))
        return sock

    async def start(self) -> None:
        if self.server_keys is not None:
            from zmq.auth.asyncio import AsyncioAuthenticator

            self.auth = AsyncioAuthenticator(self.ctx)
            self.auth.start()
            # pyzmq looks certificates up by the socket's exact ZAP domain ("*" is used only for an
            # empty one), so register them under the domain the ROUTERs declare.
            self.auth.configure_curve(domain=ZAP_DOMAIN, location=str(self.server_keys.authorized_dir))
        workers = self.b.gate_workers if self.gate_spec is not None else 0
        self.gates = GatePool(
            workers,
            self.ingest,
            self.b.max_message_bytes,
            self.b.learner_port,
            self.gate_spec or {},
            self.log,
            self.ctx,
        )
        self.actor_sock = self._router(self.b.actor_port, "actor")
        self.learner_sock = self._router(self.b.learner_port, "learner")
        store = self.store
        self.actor_path = ActorPath(
            self.actor_sock,
            store,
            self.gates,
            self.live,
            self.log,
            registry=lambda: store.registry,
            group_commit=GROUP_COMMIT,
            max_pending=4 * GROUP_COMMIT,
            drain_s=DRAIN_S,
            drain_quiet_s=DRAIN_QUIET_S,
        )
        self.actor_path.start()
        self._tasks.append(asyncio.create_task(self._learner_loop(), name="learner-recv"))
        from broker.http import start_http

        self.http_runner = await start_http(
            self, "127.0.0.1" if self.b.host == "localhost" else self.b.host, self.b.http_port
        )
        self.log.info(
            "broker.started",
            **self.endpoints,
            http_port=self.b.http_port,
            replay=str(self.store.path),
            curve=self.server_keys is not None,
            stores={s: self.store.count(s) for s in self.capacities},
            registry=self.store.registry,
        )

    async def run(self) -> None:
        await self.start()
        await self.stopping.wait()
        await self.shutdown()

    async def shutdown(self) -> None:
        """Drain actors, stop reading, commit and ack what is queued, then close everything.

        Also after a ``start`` that failed half-way (a busy port): whatever it opened is closed, as
        ZeroMQ ports and gate workers left open would keep the process alive."""
        self.stopping.set()
        if self.actor_path is not None:
            await self.actor_path.stop()
        if self.gates is not None:
            self.gates.close()
        await cancel_and_wait(self._tasks)
        if self.http_runner is not None:
            await self.http_runner.cleanup()
        if self.auth is not None:
            self.auth.stop()
        for sock in (*self._monitors, self.actor_sock, self.learner_sock):
            if sock is not None:
                sock.close(linger=0 if sock in self._monitors else 500)
        self.ctx.destroy(linger=500)  # closes anything left (ZAP socket...) instead of hanging in term()
        self.store.close()
        self.log.info("broker.stopped", stored_total=stored_total(self.store.state["counters"]))

    # ---- learner path ------------------------------------------------------------------------

    async def _learner_loop(self) -> None:
        while not self.stopping.is_set():
            try:
                frames = await self.learner_sock.recv_multipart()
            except asyncio.CancelledError:
                raise
            except zmq.ZMQError as exc:
                self.log.error("broker.learner_recv_failed", error=str(exc))
                await asyncio.sleep(0.1)
                continue
            t = asyncio.create_task(self._learner_request(frames))
            t.add_done_callback(self._tasks_done)

    def _tasks_done(self, t: asyncio.Task) -> None:
        if not t.cancelled() and t.exception() is not None:
            self.live.bump("internal_errors")
            self.log.error("broker.learner_task_failed", error=repr(t.exception()))

    async def _reply(self, ident: bytes, delim: list[bytes], msg: Reply | Batch) -> None:
        data = encode(msg, check=False)  # built here from checked parts: a read-back would cost a decode
        if len(data) > self.b.max_message_bytes and isinstance(msg, Batch) and len(msg.items) > 1:
            # keep the reply under the frame limit the learner enforces: serve fewer items
            msg.items = msg.items[: len(msg.items) // 2]
            await self._reply(ident, delim, msg)
            return
        await self.learner_sock.send_multipart([ident, *delim, data])

    async def _learner_request(self, frames: list[bytes]) -> None:
        ident, body = frames[0], frames[1:]
        delim: list[bytes] = []
        if len(body) == 2 and body[0] == b"":
            delim, body = [b""], body[1:]

        def fail(category: str, reason: str, req: int) -> Reply:
            self.live.reject(category)
            if self.live.should_log("reject:" + category):
                self.log.warning("broker.learner_reject", category=category, reason=reason)
            return refusal(reason, req)

        if len(body) != 1:
            await self._reply(ident, delim, fail("bad_frames", f"expected one message frame, got {len(body)}", -1))
            return
        raw = body[0]
        try:
            msg = decode(raw, self.b.max_message_bytes)
        except ProtocolError as exc:
            await self._reply(ident, delim, fail(reject_category(exc), error_reason(exc), best_effort_int(raw, "req")))
            return
        if not isinstance(msg, LEARNER_TYPES):
            await self._reply(ident, delim, fail("wrong_socket", f"'{message_type(msg)}' is not a learner request", -1))
            return
        self.live.bump("learner_requests")
        try:
            reply = await self._handle_learner(msg)
        except StoreRefused as exc:
            reply = refusal(f"broker cannot store: {exc}", msg.req)
        except ValueError as exc:
            reply = fail("bad_field", str(exc), msg.req)
        await self._reply(ident, delim, reply)

    async def _handle_learner(self, msg: LearnerRequest) -> Reply | Batch:
        if isinstance(msg, GetRegistry):
            return Reply(req=msg.req, ok=True, error=None, data=self.store.registry)
        if isinstance(msg, GetStats):
            return Reply(req=msg.req, ok=True, error=None, data=self.stats())
        if isinstance(msg, EvalResult):
            return Reply(req=msg.req, ok=True, error=None, data=self._record_eval(msg.version, msg.result))
        if isinstance(msg, Announce):
            registry = {**checked_registry(msg), "method": self.method}
            old = self.store.registry
            self.store.set_registry(registry)
            if registry["versions"].get("policy", 0) < old["versions"].get("policy", 0):
                self.log.warning("broker.policy_version_decreased", old=old["versions"], new=registry["versions"])
            self.learner_metrics = {k: v for k, v in msg.metrics.items() if type(v) in (int, float)}
            self.log.info("broker.registry", **registry)
            return Reply(req=msg.req, ok=True, error=None, data=registry)
        assert isinstance(msg, Sample)
        if not 1 <= msg.n <= MAX_ITEMS:
            raise ValueError(f"sample: n must be in [1, {MAX_ITEMS}], got {msg.n}")
        current = int(self.store.registry["versions"].get("policy", 0))
        phases = None if set(msg.phases) >= set(PHASES) else msg.phases  # every phase: no filter to apply
        res = replay_sampling.sample(
            self.store,
            msg.store,
            msg.n,
            window=self.b.window,
            current_policy=current,
            max_staleness=self.b.max_staleness,
            seed=msg.seed,
            phases=phases,
        )
        if res.stale_skipped:
            self.live.bump("stale_skipped_" + msg.store, res.stale_skipped)
        if res.phase_skipped:  # in /stats ``counters``: how much of the window a phase filter passes over
            self.live.bump("phase_skipped_" + msg.store, res.phase_skipped)
        return Batch(
            req=msg.req, store=msg.store, items=res.items, stale_skipped=res.stale_skipped, available=res.available
        )

    def _record_eval(self, version: int, result: dict[str, Any]) -> dict[str, Any]:
        """Keep the evaluator's held-out result of ``version`` (persisted; the newest results win)."""
        if version < 0:
            raise ValueError(f"eval_result: version must be non-negative, got {version}")
        results = {**self.eval_results, str(version): result}
        while len(results) > MAX_EVAL_RESULTS:
            results.pop(min(results, key=int))
        self.store.put_meta(EVAL_KEY, results)  # a refused write leaves the served results as they were
        self.eval_results = results
        self.log.info("broker.eval_result", version=version)
        return {"version": version, "stored": len(results)}

    # ---- monitoring ------------------------------------------------------------------------

    async def _monitor(self, mon: zmq.asyncio.Socket, label: str) -> None:
        self._monitors.append(mon)
        while True:
            frames = await mon.recv_multipart()
            try:
                event = parse_monitor_message(frames)
                name = _MONITOR_EVENTS.get(event["event"])
                if name is None:
                    continue
                self.live.bump(f"peer_{label}_{name}")
                if name.startswith("handshake_failed") and self.live.should_log(f"hs:{label}:{name}"):
                    endpoint = event.get("endpoint", b"")
                    self.log.warning(
                        "broker.handshake_failed",
                        socket=label,
                        kind=name,
                        value=event.get("value"),
                        endpoint=endpoint.decode(errors="replace") if isinstance(endpoint, bytes) else str(endpoint),
                    )
            except Exception as exc:  # noqa: BLE001 - counting must not stop on one odd event
                self.live.bump("internal_errors")
                self.log.error("broker.monitor_error", error=repr(exc))

    @property
    def writable_error(self) -> str | None:
        """Why the store refuses actors' writes now (None while it takes them)."""
        return self.actor_path.writable_error

    def stats(self) -> dict[str, Any]:
        path = self.actor_path
        return build_snapshot(
            self.store.state,
            self.capacities,
            self.live,
            self.store.registry,
            {
                "run": self.cfg.run.name,
                "writable": path.writable_error is None,
                "last_error": path.writable_error,
                "map": path.map_info,
                "pending": path.queued,
                "gate_workers": {
                    "pids": [w.proc.pid for w in self.gates.workers],
                    "restarts": self.gates.restarts,
                    "batches_gated_in_broker": self.gates.gated_here,
                },
                "curve": self.server_keys is not None,
                "endpoints": self.endpoints,
                "time": time.time(),
                "learner": getattr(self, "learner_metrics", {}),
                "eval": [
                    r | {"version": int(k)} for k, r in sorted(self.eval_results.items(), key=lambda kv: int(kv[0]))
                ],
            },
        )
