"""Broker counters that live outside LMDB transactions: rejects, staleness, auth, peers, rates.

Counters bumped by a storage transaction (stored items, duplicates, gate outcomes) are persisted
by that transaction. The ones here are bumped by the event loop; they are written along with the
next storage transaction, so they survive restarts up to the last commit (a SIGKILL can lose the
increments since then, never the data).
"""

from __future__ import annotations

import time
from collections import OrderedDict, deque
from typing import Any

from comap_async.wire.protocol import ProtocolError

# Prefixes of the counters owned by the event loop (restored from the persisted state at start).
LIVE_PREFIXES = (
    "reject_",
    "stale_skipped_",
    "phase_skipped_",
    "refused",
    "internal_errors",
    "peer_",
    "learner_requests",
)
MAX_PEERS = 4096
RATE_WINDOW_S = 10.0


def reject_category(exc: ProtocolError | str) -> str:
    """A bounded label for a reject reason (the full reason goes to the reply and the log)."""
    text = str(exc)
    for prefix, cat in (
        ("not a msgpack message", "not_msgpack"),
        ("empty frame", "empty"),
        ("frame is", "too_large"),
        ("unsupported schema version", "bad_version"),
        ("unknown message type", "unknown_type"),
        ("message must be a map", "not_a_map"),
        ("frame must be bytes", "not_bytes"),
    ):
        if text.startswith(prefix):
            return cat
    return "bad_field"


class LiveStats:
    def __init__(self, persisted: dict[str, int]) -> None:
        self.counters: dict[str, int] = {k: v for k, v in persisted.items() if k.startswith(LIVE_PREFIXES)}
        self.actors: OrderedDict[str, dict[str, Any]] = OrderedDict()
        self.started = time.time()
        self._rate_points: deque[tuple[float, int]] = deque()
        self._last_log: dict[str, float] = {}

    def bump(self, name: str, n: int = 1) -> None:
        self.counters[name] = self.counters.get(name, 0) + n

    def reject(self, category: str) -> None:
        self.bump("reject_" + category)

    @property
    def rejects_total(self) -> int:
        return sum(v for k, v in self.counters.items() if k.startswith("reject_"))

    def seen_actor(self, actor: str, n: int = 1) -> None:
        entry = self.actors.get(actor)
        if entry is None:
            entry = self.actors[actor] = {"messages": 0, "last_seen": 0.0}
            while len(self.actors) > MAX_PEERS:  # bounded: a misbehaving client cannot grow it forever
                self.actors.popitem(last=False)
        else:
            self.actors.move_to_end(actor)
        entry["messages"] += n
        entry["last_seen"] = time.time()

    def note_stored_total(self, total: int) -> None:
        now = time.monotonic()
        self._rate_points.append((now, total))
        while len(self._rate_points) > 2 and now - self._rate_points[0][0] > RATE_WINDOW_S:
            self._rate_points.popleft()

    def ingest_rate(self) -> float:
        """Messages stored per second over the last ~10 s (0 when idle)."""
        if not self._rate_points:
            return 0.0
        now = time.monotonic()
        t0, n0 = self._rate_points[0]
        _, n1 = self._rate_points[-1]
        span = max(now - t0, 1e-3)
        return (n1 - n0) / span if now - self._rate_points[-1][0] < RATE_WINDOW_S else 0.0

    def should_log(self, key: str, every_s: float = 10.0) -> bool:
        """Rate-limit repeated warnings (a flood of bad input must not flood the log too)."""
        now = time.monotonic()
        if now - self._last_log.get(key, -1e9) >= every_s:
            self._last_log[key] = now
            return True
        return False


def stored_total(counters: dict[str, int]) -> int:
    return sum(counters.get(k, 0) for k in ("stored_transitions", "stored_reflection_msgs", "stored_episodes"))


def build_snapshot(
    store_state: dict[str, Any],
    capacities: dict[str, int],
    live: LiveStats,
    registry: dict[str, Any],
    extra: dict[str, Any],
) -> dict[str, Any]:
    """The /stats JSON (also served to learners by ``get_stats``); every key is a string."""
    counters = {**store_state["counters"], **live.counters}
    stores = {}
    for name, (tail, head) in store_state["rings"].items():
        stores[name] = {
            "count": head - tail,
            "capacity": capacities.get(name, 0),
            "evicted": store_state["evicted"][name],
            "written": head,
        }
    ws_total, ag_total = counters.get("gate_ws_total", 0), counters.get("gate_ag_total", 0)
    now = time.time()
    return {
        "uptime_s": round(now - live.started, 3),
        "stores": stores,
        "ingest": {
            "rate_per_s": round(live.ingest_rate(), 2),
            "stored_total": stored_total(counters),
            "duplicates": counters.get("duplicates", 0),
            "refused": counters.get("refused", 0),
            "dedup_index": store_state["dedup"][1] - store_state["dedup"][0],
        },
        "rejects": {
            "total": live.rejects_total,
            **{k[len("reject_") :]: v for k, v in counters.items() if k.startswith("reject_")},
        },
        "gates": {
            "world_state_total": ws_total,
            "world_state_imagined": counters.get("gate_ws_imagined", 0),
            "world_state_adoption": counters.get("gate_ws_imagined", 0) / ws_total if ws_total else None,
            "action_total": ag_total,
            "action_revised": counters.get("gate_ag_open", 0),
            "action_adoption": counters.get("gate_ag_open", 0) / ag_total if ag_total else None,
            "action_reasons": {
                k[len("gate_ag_") :]: v
                for k, v in counters.items()
                if k.startswith("gate_ag_") and k not in ("gate_ag_total", "gate_ag_open")
            },
        },
        # reflection-mode initialisation: samples per label (y = 1 only for expert_better)
        "reflect_init_labels": {
            k[len("reflect_label_") :]: v for k, v in counters.items() if k.startswith("reflect_label_")
        },
        "stale_skipped": {k[len("stale_skipped_") :]: v for k, v in counters.items() if k.startswith("stale_skipped_")},
        "peers": {k[len("peer_") :]: v for k, v in counters.items() if k.startswith("peer_")},
        "actors": {
            a: {"messages": e["messages"], "last_seen": e["last_seen"], "age_s": round(now - e["last_seen"], 3)}
            for a, e in live.actors.items()
        },
        "registry": registry,
        "counters": counters,
        **extra,
    }
