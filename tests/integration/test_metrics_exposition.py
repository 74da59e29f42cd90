"""``/metrics`` of a real broker subprocess and of a real embedded inference server, parsed with
``prometheus_client``'s own parser: the known families, types, labels and values are there, and no
``_created`` series."""

from __future__ import annotations

import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from comap_async.wire.outbox import Outbox
from tests.fixtures.broker import make_transition

pytestmark = pytest.mark.timeout(120)

TOKEN = "metrics-token"


def _scrape(url: str, token: str | None = None) -> tuple[str, dict]:
    """(content type, {family name: family}) of one ``/metrics`` scrape."""
    req = urllib.request.Request(url + "/metrics")
    if token:
        req.add_header("Authorization", f"Bearer {token}")
    with urllib.request.urlopen(req, timeout=10) as r:
        content_type, text = r.headers["Content-Type"], r.read().decode()
    fams = {f.name: f for f in text_string_to_metric_families(text)}
    return content_type, fams


def _value(fam, sample_name: str, **labels: str) -> float:
    got = [s.value for s in fam.samples if s.name == sample_name and s.labels == labels]
    assert len(got) == 1, (sample_name, labels, fam.samples)
    return got[0]


def _no_created(fams: dict) -> None:
    names = [s.name for f in fams.values() for s in f.samples]
    assert names and not [n for n in names if n.endswith("_created")]


async def test_broker_metrics_parse(broker_factory):
    bp = broker_factory([f"broker.http_token={TOKEN}"])
    out = await Outbox(bp.actor_endpoint, ack_timeout_s=1.0).start()
    try:
        await out.put(make_transition(0, phase="warmup"))
        await out.flush(10)
    finally:
        await out.close()
    content_type, fams = _scrape(f"http://127.0.0.1:{bp.http_port}", TOKEN)
    assert content_type.startswith("text/plain") and "version=" in content_type
    _no_created(fams)
    # counters: the family name drops _total, the sample keeps it (as exposed before)
    assert fams["comap_broker_stored"].type == "counter"
    assert _value(fams["comap_broker_stored"], "comap_broker_stored_total") == 1.0
    assert _value(fams["comap_broker_store_written"], "comap_broker_store_written_total", store="transitions") == 1.0
    assert _value(fams["comap_broker_store_items"], "comap_broker_store_items", store="transitions") == 1.0
    assert fams["comap_broker_store_items"].type == "gauge"
    assert _value(fams["comap_broker_writable"], "comap_broker_writable") == 1.0
    assert _value(fams["comap_broker_map_bytes"], "comap_broker_map_bytes", kind="size") > 0
    assert {
        "comap_broker_rejects",
        "comap_broker_peer_events",
        "comap_broker_gate_action",
        "comap_broker_registry_version",
        "comap_broker_ingest_rate",
    } <= set(fams)
    assert fams["comap_broker_rejects"].type == "counter"
    assert bp.http("/metrics")[0] == 401  # the token still guards it
    assert bp.terminate() == 0


async def test_inference_metrics_parse(embedded_server):
    _, before = _scrape(embedded_server.url)
    async with embedded_server.client() as c:
        await c.complete("look", max_tokens=4, ignore_eos=True)
    content_type, fams = _scrape(embedded_server.url)
    assert content_type.startswith("text/plain") and "version=" in content_type
    _no_created(fams)
    gen = fams["comap_inference_generation_tokens"]
    assert gen.type == "counter"
    assert (
        _value(gen, "comap_inference_generation_tokens_total")
        >= _value(before["comap_inference_generation_tokens"], "comap_inference_generation_tokens_total") + 4
    )
    assert (
        _value(
            fams["comap_inference_http_requests"],
            "comap_inference_http_requests_total",
            route="/v1/completions",
            status="200",
        )
        >= 1
    )
    assert _value(fams["comap_inference_decode_steps"], "comap_inference_decode_steps_total") > 0
    assert fams["comap_inference_engine_alive"].type == "gauge"
    assert _value(fams["comap_inference_engine_alive"], "comap_inference_engine_alive") == 1.0
    assert _value(fams["comap_inference_uptime_seconds"], "comap_inference_uptime_seconds") > 0
    assert 0.0 <= _value(fams["comap_inference_idle_fraction"], "comap_inference_idle_fraction") <= 1.0
    assert {
        "comap_inference_adapter_loads",
        "comap_inference_adapter_spare_slots",
        "comap_inference_sequences_running",
        "comap_inference_prefill_seconds",
    } <= set(fams)
