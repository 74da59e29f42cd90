"""Reject categories, Prometheus text, CURVE key files, and the broker's import weight."""

from __future__ import annotations

import subprocess
import sys

import pytest

from broker.counters import LiveStats, build_snapshot, reject_category
from broker.http import prometheus_text
from comap_async.wire.curve import KeysError, generate_keys, load_client_keys, load_server_keys
from comap_async.wire.protocol import ProtocolError, decode, empty_registry
from tests.fixtures.broker import REPO


@pytest.mark.parametrize(
    "frame,category",
    [
        (b"", "empty"),
        (b"\xc1", "not_msgpack"),
        (b"\x93\x01\x02\x03", "not_a_map"),
        (b"\x81\xa1v\x02", "bad_version"),
        (b"\x82\xa1v\x01\xa4type\xa3foo", "unknown_type"),
        (b"\x82\xa1v\x01\xa4type\xa3ack", "bad_field"),
    ],
)
def test_reject_categories(frame, category):
    with pytest.raises(ProtocolError) as exc:
        decode(frame)
    assert reject_category(exc.value) == category


def test_snapshot_and_prometheus_text():
    live = LiveStats({"reject_not_msgpack": 3, "stored_transitions": 99})
    assert live.counters == {"reject_not_msgpack": 3}  # only loop-owned counters are restored
    live.reject("bad_field")
    live.seen_actor("a1")
    state = {
        "rings": {"transitions": [2, 10], "reflections": [0, 0], "demos": [0, 0], "episodes": [0, 0]},
        "evicted": {"transitions": 2, "reflections": 0, "demos": 0, "episodes": 0},
        "dedup": [0, 8],
        "counters": {
            "stored_transitions": 10,
            "gate_ws_total": 4,
            "gate_ws_imagined": 1,
            "gate_ag_total": 4,
            "gate_ag_open": 2,
            "gate_ag_revised": 2,
            "gate_ag_keep": 2,
        },
    }
    snap = build_snapshot(
        state, {"transitions": 8}, live, empty_registry(), {"writable": True, "map": {"map_size": 1, "map_used": 1}}
    )
    assert snap["stores"]["transitions"] == {"count": 8, "capacity": 8, "evicted": 2, "written": 10}
    assert snap["rejects"] == {"total": 4, "not_msgpack": 3, "bad_field": 1}
    assert snap["gates"]["world_state_adoption"] == 0.25 and snap["gates"]["action_adoption"] == 0.5
    assert snap["gates"]["action_reasons"] == {"revised": 2, "keep": 2}
    text = prometheus_text(snap)
    assert 'comap_broker_rejects_total{reason="not_msgpack"} 3.0' in text
    assert 'comap_broker_store_evicted_total{store="transitions"} 2.0' in text
    assert "comap_broker_writable 1.0" in text
    for line in text.splitlines():  # every sample line is "name{labels} value" or "name value"
        assert line.startswith("#") or len(line.rsplit(" ", 1)) == 2 and float(line.rsplit(" ", 1)[1]) >= 0


def test_keys_roundtrip_and_clear_errors(tmp_path):
    d = generate_keys(tmp_path / "k", ["client", "node2"])
    srv = load_server_keys(d)
    cl = load_client_keys(d, "node2")
    assert cl.server_public == srv.public and len(cl.public) == 40
    assert sorted(p.name for p in srv.authorized_dir.glob("*.key")) == ["client.key", "node2.key"]
    assert generate_keys(d) and load_server_keys(d).public == srv.public  # kept unless --force
    with pytest.raises(KeysError, match="comap keys"):
        load_client_keys(d, "nobody")
    with pytest.raises(KeysError, match="comap keys"):
        load_server_keys(tmp_path / "empty")


def test_broker_modules_do_not_import_torch():
    code = (
        "import sys, broker.server, broker.cli, broker.http, comap_async.wire.outbox, comap_async.wire.broker_client; "
        "print('torch' in sys.modules, 'transformers' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert out.stdout.strip() == "False False", out.stderr
