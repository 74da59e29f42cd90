"""The broker process: two ZeroMQ ROUTERs, group-committed LMDB storage, the stats HTTP server.

The actor path (receive, validate, gate, store, ack) is :mod:`broker.actor_path`; this module
sets the broker up, serves learners and monitors peers.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import msgpack
import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from comap_async.config import CoMapConfig
from comap_async.wire.protocol import ID_LEN, MAX_ITEMS, SCHEMA_VERSION, ProtocolError, decode, error_reason
from comap_async.waiting import cancel_and_wait

from broker import replay_sampling
from broker.actor_path import ActorPath, Pending
from broker.gate_worker import GatePool
from broker.ingest import Ingest, NextState, best_effort_int, checked_registry
from comap_async.wire.curve import ServerKeys
from broker.counters import LiveStats, build_snapshot, reject_category, stored_total
from broker.store import ReplayStore, StoreRefused

ZAP_DOMAIN = "comap"
LEARNER_TYPES = ("sample", "announce", "get_registry", "get_stats", "eval_result")
EVAL_KEY = b"eval_results"
MAX_EVAL_RESULTS = 2000  # held-out results kept (one per evaluated version)
_MONITOR_EVENTS = {
    zmq.EVENT_HANDSHAKE_FAILED_AUTH: "handshake_failed_auth",
    zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL: "handshake_failed_protocol",
    zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL: "handshake_failed_no_detail",
    zmq.EVENT_DISCONNECTED: "disconnected",
    zmq.EVENT_HANDSHAKE_SUCCEEDED: "handshake_succeeded",
}


class Broker(ActorPath):
    def __init__(self, cfg: CoMapConfig, next_state: NextState, log: Any, server_keys: ServerKeys | None = None,
                 replay_dir: str | Path | None = None, gate_spec: dict[str, Any] | None = None) -> None:
        """``gate_spec`` (:func:`broker.gate_worker.pool_spec`) says how a worker process loads the
        same fact-state update; without it the broker gates in its own process."""
        b = cfg.broker
        self.cfg, self.b, self.log, self.server_keys = cfg, b, log, server_keys
        self.capacities = {"transitions": b.capacity_transitions, "reflections": b.capacity_reflections,
                           "demos": b.capacity_demos, "episodes": b.capacity_episodes}
        self.store = ReplayStore(replay_dir or cfg.run.dir / "replay", self.capacities,
                                 map_size_mb=b.map_size_mb, max_map_size_mb=b.max_map_size_mb)
        self.ingest = Ingest(next_state, cfg.gates)
        self.live = LiveStats(self.store.state["counters"])
        self.live.note_stored_total(stored_total(self.store.state["counters"]))
        self.pending: list[Pending] = []  # frames received, not yet handed to the gate pool
        self.in_gates = 0  # frames handed to the gate pool, not yet stored and acked
        self.max_pending = 4 * b.group_commit
        self.gate_spec = gate_spec
        self.writable_error: str | None = None
        self.map_info: dict[str, Any] = self.store.info()
        # the evaluator's held-out results by version (persisted in ``meta``; served with every /stats)
        self.eval_results: dict[str, Any] = self.store.get_meta(EVAL_KEY, {})
        self.stopping = asyncio.Event()  # set by SIGTERM/SIGINT; shutdown() then drains and closes
        self.ingest_closed = False  # set by shutdown() after the drain: the actor task stops reading
        self.last_actor_rx = float("-inf")  # no actor traffic yet: nothing to drain
        self._tasks: list[asyncio.Task] = []
        self._monitors: list[zmq.asyncio.Socket] = []
        self._ack_cache: tuple[Any, bytes] = (None, b"")
        self._actor_sync: zmq.Socket | None = None
        self.ctx = zmq.asyncio.Context()
        self.auth = None
        self.endpoints: dict[str, str] = {}

    # ---- set-up ------------------------------------------------------------------------------

    def _router(self, port: int, label: str) -> zmq.asyncio.Socket:
        sock = self.ctx.socket(zmq.ROUTER)
        sock.linger = 500
        sock.maxmsgsize = self.b.max_message_bytes  # ZeroMQ drops the peer of an oversized frame
        sock.rcvhwm = max(1000, 4 * self.b.group_commit)  # backpressure on what peers send
        # No limit on what waits to go out: a ROUTER drops a reply silently when the peer's queue is
        # at its high-water mark, and a peer that sent faster than it read lost error acks that
        # way (the fuzz test: 27-393 of 10,000 missing, 2 runs in 15). Each queued reply answers a
        # frame the peer sent, so the queue grows no faster than the peer sends, and a peer that
        # disconnects takes its queue with it.
        sock.sndhwm = 0
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
        self.gates = GatePool(workers, self.ingest, self.b.max_message_bytes, self.b.learner_port,
                              self.gate_spec or {}, self.log, self.ctx)
        self.actor_sock = self._router(self.b.actor_port, "actor")
        self.learner_sock = self._router(self.b.learner_port, "learner")
        self._actor_task = asyncio.create_task(self._actor_loop(), name="actor")
        self._tasks.append(asyncio.create_task(self._learner_loop(), name="learner-recv"))
        from broker.http import start_http

        self.http_runner = await start_http(self, "127.0.0.1" if self.b.host == "localhost" else self.b.host,
                                            self.b.http_port)
        self.log.info("broker.started", **self.endpoints, http_port=self.b.http_port, replay=str(self.store.path),
                      curve=self.server_keys is not None, stores={s: self.store.count(s) for s in self.capacities},
                      registry=self.store.registry)

    async def run(self) -> None:
        await self.start()
        await self.stopping.wait()
        await self.shutdown()

    async def drain_actors(self) -> None:
        """Keep storing and acking until actors have been quiet a moment (at most ``broker.drain_s``).

        ``honcho`` sends SIGTERM to every process at once; the actors then flush their outboxes,
        and a broker that stopped reading at once would leave them waiting for acks until SIGKILL.
        """
        deadline = time.monotonic() + self.b.drain_s
        while (now := time.monotonic()) < deadline and now - self.last_actor_rx < self.b.drain_quiet_s:
            await asyncio.sleep(min(0.05, deadline - now))

    async def shutdown(self) -> None:
        """Drain actors, stop reading, commit and ack what is queued, then close everything."""
        self.stopping.set()
        if not self._actor_task.done():
            await self.drain_actors()
        self.ingest_closed = True
        try:  # the actor task stops reading, commits and acks what it holds, then returns
            await asyncio.wait_for(self._actor_task, timeout=30)
        except Exception as exc:  # noqa: BLE001 - shutdown must finish
            self.log.error("broker.shutdown_flush_failed", error=repr(exc))
        self.gates.close()
        await cancel_and_wait(self._tasks)
        await self.http_runner.cleanup()
        if self.auth is not None:
            self.auth.stop()
        for sock in (*self._monitors, self.actor_sock, self.learner_sock):
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

    async def _reply(self, ident: bytes, delim: list[bytes], msg: dict[str, Any]) -> None:
        if msg.get("error"):
            msg["error"] = msg["error"][:ID_LEN]  # the schema's limit: a longer reason would be rejected
        data = msgpack.packb(msg, use_bin_type=True)
        if len(data) > self.b.max_message_bytes and msg.get("type") == "batch" and len(msg["items"]) > 1:
            # keep the reply under the frame limit the learner enforces: serve fewer items
            msg["items"] = msg["items"][: len(msg["items"]) // 2]
            await self._reply(ident, delim, msg)
            return
        await self.learner_sock.send_multipart([ident, *delim, data])

    async def _learner_request(self, frames: list[bytes]) -> None:
        ident, body = frames[0], frames[1:]
        delim: list[bytes] = []
        if len(body) == 2 and body[0] == b"":
            delim, body = [b""], body[1:]

        def fail(category: str, reason: str, req: int) -> dict[str, Any]:
            self.live.reject(category)
            if self.live.should_log("reject:" + category):
                self.log.warning("broker.learner_reject", category=category, reason=reason)
            return {"v": SCHEMA_VERSION, "type": "reply", "req": req, "ok": False, "error": reason, "data": {}}

        if len(body) != 1:
            await self._reply(ident, delim, fail("bad_frames", f"expected one message frame, got {len(body)}", -1))
            return
        raw = body[0]
        try:
            msg = decode(raw, self.b.max_message_bytes)
        except ProtocolError as exc:
            await self._reply(ident, delim, fail(reject_category(exc), error_reason(exc), best_effort_int(raw, "req")))
            return
        if msg["type"] not in LEARNER_TYPES:
            await self._reply(ident, delim, fail("wrong_socket", f"'{msg['type']}' is not a learner request", -1))
            return
        self.live.bump("learner_requests")
        try:
            reply = await self._handle_learner(msg)
        except StoreRefused as exc:
            reply = {"ok": False, "error": f"broker cannot store: {exc}", "data": {}}
        except ValueError as exc:
            reply = fail("bad_field", str(exc), msg["req"])
        reply = {"v": SCHEMA_VERSION, "type": reply.pop("type", "reply"), "req": msg["req"], **reply}
        await self._reply(ident, delim, reply)

    async def _handle_learner(self, msg: dict[str, Any]) -> dict[str, Any]:
        mtype = msg["type"]
        if mtype == "get_registry":
            return {"ok": True, "error": None, "data": self.store.registry}
        if mtype == "get_stats":
            return {"ok": True, "error": None, "data": self.stats()}
        if mtype == "eval_result":
            return {"ok": True, "error": None, "data": self._record_eval(msg["version"], msg["result"])}
        if mtype == "announce":
            registry = checked_registry(msg)
            old = self.store.registry
            self.store.set_registry(registry)
            if registry["versions"].get("policy", 0) < old["versions"].get("policy", 0):
                self.log.warning("broker.policy_version_decreased", old=old["versions"], new=registry["versions"])
            self.learner_metrics = {k: v for k, v in (msg.get("metrics") or {}).items()
                                    if type(v) in (int, float)}
            self.log.info("broker.registry", **registry)
            return {"ok": True, "error": None, "data": registry}
        # sample
        n = msg["n"]
        if not 1 <= n <= MAX_ITEMS:
            raise ValueError(f"sample: n must be in [1, {MAX_ITEMS}], got {n}")
        current = int(self.store.registry["versions"].get("policy", 0))
        res = sampling.sample(self.store, msg["store"], n, window=self.b.window, current_policy=current,
                              max_staleness=self.b.max_staleness, seed=msg.get("seed"), phases=msg.get("phases"))
        if res.stale_skipped:
            self.live.bump("stale_skipped_" + msg["store"], res.stale_skipped)
        if res.phase_skipped:  # in /stats ``counters``: how much of the window a phase filter passes over
            self.live.bump("phase_skipped_" + msg["store"], res.phase_skipped)
        return {"type": "batch", "store": msg["store"], "items": res.items, "stale_skipped": res.stale_skipped,
                "available": res.available}

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
                    self.log.warning("broker.handshake_failed", socket=label, kind=name, value=event.get("value"),
                                     endpoint=endpoint.decode(errors="replace") if isinstance(endpoint, bytes) else
                                     str(endpoint))
            except Exception as exc:  # noqa: BLE001 - counting must not stop on one odd event
                self.live.bump("internal_errors")
                self.log.error("broker.monitor_error", error=repr(exc))

    def stats(self) -> dict[str, Any]:
        return build_snapshot(self.store.state, self.capacities, self.live, self.store.registry, {
            "writable": self.writable_error is None, "last_error": self.writable_error, "map": self.map_info,
            "pending": len(self.pending) + self.in_gates,
            "gate_workers": {"pids": [w.proc.pid for w in self.gates.workers], "restarts": self.gates.restarts,
                             "batches_gated_in_broker": self.gates.gated_here},
            "curve": self.server_keys is not None, "endpoints": self.endpoints,
            "time": time.time(), "learner": getattr(self, "learner_metrics", {}),
            "eval": [r | {"version": int(k)} for k, r in sorted(self.eval_results.items(), key=lambda kv: int(kv[0]))]})
