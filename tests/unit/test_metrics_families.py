"""The shared Prometheus helpers: exact names kept, no ``_created``, one registry per server, read at scrape time."""

from __future__ import annotations

import prometheus_client
import pytest
from prometheus_client.parser import text_string_to_metric_families

from comap_async.httpcommon import exposition, family, scrape_registry


def test_families_keep_names_and_read_counters_at_scrape_time():
    counters = {"n": 0}
    reg_a = scrape_registry(
        lambda: [
            family("counter", "comap_t_events_total", "Events.", [({"kind": "x"}, counters["n"])]),
            family("gauge", "comap_t_level", "Level.", [({}, 2)]),
            family("counter", "comap_t_empty_total", "No samples yet.", []),
        ]
    )
    reg_b = scrape_registry(lambda: [family("gauge", "comap_t_level", "Another server.", [({}, 7)])])
    counters["n"] = 3  # bumped as a plain int; seen by the next scrape
    body, content_type = exposition(reg_a)
    text = body.decode()
    assert content_type == prometheus_client.CONTENT_TYPE_LATEST
    assert 'comap_t_events_total{kind="x"} 3.0' in text and "comap_t_level 2.0" in text
    assert "# TYPE comap_t_events_total counter" in text and "# TYPE comap_t_empty_total counter" in text
    assert "_created" not in text
    fams = {f.name: f for f in text_string_to_metric_families(text)}
    assert fams["comap_t_events"].type == "counter" and fams["comap_t_events"].samples[0].value == 3.0
    assert "comap_t_level 7.0" in exposition(reg_b)[0].decode()  # a second server's registry is its own
    assert b"comap_t_" not in prometheus_client.generate_latest(prometheus_client.REGISTRY)  # never the global one


def test_family_rejects_a_counter_without_total():
    with pytest.raises(ValueError, match="_total"):
        family("counter", "comap_t_events", "x", [])
