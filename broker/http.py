"""Broker HTTP: ``/healthz`` (open), ``/stats`` JSON and ``/metrics`` Prometheus text (bearer token if set)."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

from aiohttp import web
from prometheus_client.metrics_core import Metric

from broker.ingest import record_from_store
from comap_async.httpcommon import bearer_matches, exposition, family, scrape_registry

MAX_RECORDS = 20_000  # one response stays a few MB at most

if TYPE_CHECKING:
    from broker.server import Broker


def _authorised(request: web.Request, token: str | None) -> bool:
    return not token or bearer_matches(request.headers.get("Authorization", ""), token)


def broker_families(stats: dict[str, Any]) -> list[Metric]:
    """The stats snapshot as Prometheus metric families (counters end in _total)."""
    out: list[Metric] = []

    def metric(name: str, kind: str, help_text: str, samples: list[tuple[dict[str, Any], float]]) -> None:
        out.append(family(kind, f"comap_broker_{name}", help_text, samples))

    stores = stats["stores"]
    metric(
        "store_items", "gauge", "Items held per replay store.", [({"store": s}, v["count"]) for s, v in stores.items()]
    )
    metric(
        "store_capacity",
        "gauge",
        "Ring capacity per replay store.",
        [({"store": s}, v["capacity"]) for s, v in stores.items()],
    )
    metric(
        "store_evicted_total",
        "counter",
        "Items evicted (FIFO) per store.",
        [({"store": s}, v["evicted"]) for s, v in stores.items()],
    )
    metric(
        "store_written_total",
        "counter",
        "Items ever written per store.",
        [({"store": s}, v["written"]) for s, v in stores.items()],
    )
    ing = stats["ingest"]
    metric("stored_total", "counter", "Actor messages stored.", [({}, ing["stored_total"])])
    metric("duplicates_total", "counter", "Resent messages recognised as already stored.", [({}, ing["duplicates"])])
    metric(
        "refused_total",
        "counter",
        "Messages refused because storage failed (disk full, map limit).",
        [({}, ing["refused"])],
    )
    metric("ingest_rate", "gauge", "Messages stored per second (last 10 s).", [({}, ing["rate_per_s"])])
    metric(
        "rejects_total",
        "counter",
        "Rejected (malformed, wrong-version, misrouted) messages by reason.",
        [({"reason": k}, v) for k, v in stats["rejects"].items() if k != "total"],
    )
    metric(
        "stale_skipped_total",
        "counter",
        "Items skipped by sampling as too stale, by store.",
        [({"store": k}, v) for k, v in stats["stale_skipped"].items()],
    )
    metric(
        "peer_events_total",
        "counter",
        "ZeroMQ peer events (handshake failures include CURVE rejections).",
        [({"event": k}, v) for k, v in stats["peers"].items()],
    )
    g = stats["gates"]
    metric(
        "gate_world_state_imagined_total",
        "counter",
        "Reflection samples that use the imagined state.",
        [({}, g["world_state_imagined"])],
    )
    metric("gate_world_state_total", "counter", "Reflection samples derived.", [({}, g["world_state_total"])])
    metric(
        "gate_action_revised_total",
        "counter",
        "Transitions whose revision passed the action gate.",
        [({}, g["action_revised"])],
    )
    metric("gate_action_total", "counter", "Transitions seen by the action gate.", [({}, g["action_total"])])
    metric(
        "actor_last_seen_seconds",
        "gauge",
        "Seconds since each actor's last message.",
        [({"actor": a}, e["age_s"]) for a, e in stats["actors"].items()],
    )
    reg = stats["registry"]
    metric(
        "registry_version", "gauge", "Current adapter versions.", [({"role": r}, v) for r, v in reg["versions"].items()]
    )
    metric(
        "writable",
        "gauge",
        "1 when the broker can store, 0 while it refuses writes.",
        [({}, 1 if stats["writable"] else 0)],
    )
    metric(
        "map_bytes",
        "gauge",
        "LMDB map size and used bytes.",
        [({"kind": "size"}, stats["map"]["map_size"]), ({"kind": "used"}, stats["map"]["map_used"])],
    )
    return out


def prometheus_text(stats: dict[str, Any]) -> str:
    """Render a stats snapshot as Prometheus exposition text (what ``/metrics`` serves)."""
    return exposition(scrape_registry(lambda: broker_families(stats)))[0].decode()


def make_app(broker: "Broker") -> web.Application:
    token = broker.b.http_token
    registry = scrape_registry(lambda: broker_families(broker.stats()))  # this broker's own; read per scrape

    async def healthz(request: web.Request) -> web.Response:
        ok = broker.writable_error is None
        body = {"ok": ok, "writable": ok, "error": broker.writable_error, "registry": broker.store.registry}
        return web.json_response(body, status=200 if ok else 503)

    async def stats(request: web.Request) -> web.Response:
        if not _authorised(request, token):
            return web.json_response({"error": "missing or wrong bearer token"}, status=401)
        return web.Response(text=json.dumps(broker.stats()), content_type="application/json")

    async def metrics(request: web.Request) -> web.Response:
        if not _authorised(request, token):
            return web.Response(text="missing or wrong bearer token\n", status=401)
        body, content_type = exposition(registry)
        return web.Response(body=body, headers={"Content-Type": content_type, "X-Content-Type-Options": "nosniff"})

    async def records(request: web.Request) -> web.Response:
        """The newest ``limit`` records of a store (for `comap stats` and analysis), oldest first."""
        if not _authorised(request, token):
            return web.json_response({"error": "missing or wrong bearer token"}, status=401)
        store = request.query.get("store", "")
        if store not in broker.store.capacities:
            return web.json_response(
                {"error": f"unknown store {store!r}; known: {sorted(broker.store.capacities)}"}, status=400
            )
        try:
            limit = int(request.query.get("limit", "1000"))
        except ValueError:
            return web.json_response({"error": "limit must be an integer"}, status=400)
        if not 1 <= limit <= MAX_RECORDS:
            return web.json_response({"error": f"limit must be in [1, {MAX_RECORDS}]"}, status=400)
        tail, head = broker.store.bounds(store)
        raw = broker.store.get_many(store, range(max(tail, head - limit), head))
        items = [record_from_store(store, v) for v in raw if v is not None]
        return web.Response(
            text=json.dumps({"store": store, "items": items}, default=str), content_type="application/json"
        )

    app = web.Application(client_max_size=64 * 1024)
    app.router.add_get("/healthz", healthz)
    app.router.add_get("/stats", stats)
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/records", records)
    return app


async def start_http(broker: "Broker", host: str, port: int) -> web.AppRunner:
    runner = web.AppRunner(make_app(broker), access_log=None)
    await runner.setup()
    try:
        await web.TCPSite(runner, host, port).start()
    except BaseException:  # a busy port: the runner is not returned, so it is cleaned up here
        await runner.cleanup()
        raise
    return runner
