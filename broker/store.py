"""LMDB replay stores: bounded FIFO rings, a dedup index and persisted counters (docs/design.md section 5).

One LMDB environment holds named databases:

* ``transitions``, ``reflections``, ``demos``, ``episodes``: rings keyed by a big-endian 8-byte
  index; ``head`` is the next index to write and ``tail`` the oldest kept one.
* ``dedup`` (key -> index) and ``dedup_order`` (index -> key): a FIFO ring of message ids already
  stored, so a resent message is acknowledged without being stored twice.
* ``meta``: ``state`` (ring positions, eviction and ingest counters) and ``registry``.

Everything a write changes, ``state`` included, goes into one transaction, so a broker killed at
any instant reopens with rings, dedup index and counters that agree with each other. LMDB's
default durable commit is kept: an ack that follows :meth:`ReplayStore.write` is never lost.

All methods must be called from one thread (the broker's event loop): ``set_mapsize`` needs no
transaction open in this process, which one thread guarantees.
"""

from __future__ import annotations

import copy
import os
import shutil
import struct
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import lmdb
import msgpack

from comap_async.wire.protocol import STORES, empty_registry

_KEY = struct.Struct(">Q")
MB = 1 << 20
MAP_SIZE_MB = 256
"""The LMDB map a new replay starts with; it doubles whenever full, up to ``broker.max_map_size_mb``."""
STORED, DUPLICATE = "stored", "duplicate"


class StoreRefused(RuntimeError):
    """A write was refused (map at its size limit, disk full, I/O error); nothing was changed."""


@dataclass(slots=True)
class WriteItem:
    """One message's effect: records to append and counters to bump, or nothing if it is a duplicate."""

    dedup_key: bytes
    records: list[tuple[str, bytes]]
    counters: dict[str, int] = field(default_factory=dict)


def _pack(obj: Any) -> bytes:
    return msgpack.packb(obj, use_bin_type=True)


def _unpack(data: bytes) -> Any:
    return msgpack.unpackb(data, raw=False)


EVAL_KEY = b"eval_results"
"""The ``meta`` key of the evaluator's held-out results, by version."""


def _fresh_state(stores: Iterable[str]) -> dict[str, Any]:
    return {
        "rings": {s: [0, 0] for s in stores},  # [tail, head]
        "evicted": {s: 0 for s in stores},
        "dedup": [0, 0],
        "counters": {},
    }


class ReplayStore:
    """Bounded FIFO rings over one LMDB environment with a dedup index and persisted counters."""

    def __init__(
        self,
        path: str | Path,
        capacities: dict[str, int],
        *,
        map_size_mb: int = MAP_SIZE_MB,
        max_map_size_mb: int = 65536,
        dedup_capacity: int | None = None,
        readonly: bool = False,
    ) -> None:
        unknown = set(capacities) - set(STORES)
        if unknown:
            raise ValueError(f"unknown stores {sorted(unknown)}; known: {list(STORES)}")
        self.path = Path(path)
        self.capacities = dict(capacities)
        # Resends arrive seconds after the original; remembering as many ids as the rings hold
        # items covers them with a wide margin while keeping the index bounded.
        self.dedup_capacity = dedup_capacity or max(1, sum(capacities.values()))
        self.max_map_size = max(max_map_size_mb, map_size_mb) * MB
        if not readonly:
            self.path.mkdir(parents=True, exist_ok=True)
        self.env = lmdb.open(
            str(self.path),
            map_size=map_size_mb * MB,
            max_dbs=16,
            readonly=readonly,
            lock=True,
            readahead=False,
            meminit=False,
        )
        self._dbs = {}
        for name in (*STORES, "dedup", "dedup_order", "meta"):
            try:
                self._dbs[name] = self.env.open_db(name.encode(), create=not readonly)
            except lmdb.NotFoundError:  # read-only, a replay written before this store existed: it is empty
                if name not in STORES:
                    raise
        self._missing = frozenset(STORES) - set(self._dbs)
        self.last_error: str | None = None
        self.map_grown = 0
        with self.env.begin() as txn:
            raw_state = txn.get(b"state", db=self._dbs["meta"])
            raw_reg = txn.get(b"registry", db=self._dbs["meta"])
        self.state = _fresh_state(STORES)
        if raw_state is not None:
            saved = _unpack(raw_state)
            for key in ("rings", "evicted"):
                self.state[key].update(saved.get(key, {}))
            self.state["dedup"] = saved.get("dedup", [0, 0])
            self.state["counters"] = saved.get("counters", {})
        self.registry: dict[str, Any] = _unpack(raw_reg) if raw_reg is not None else empty_registry()

    # ---- reading -------------------------------------------------------------------------

    def count(self, store: str) -> int:
        tail, head = self.state["rings"][store]
        return head - tail

    def bounds(self, store: str) -> tuple[int, int]:
        tail, head = self.state["rings"][store]
        return tail, head

    def get_many(self, store: str, indices: Iterable[int]) -> list[bytes | None]:
        if store in self._missing:
            return [None for _ in indices]
        db = self._dbs[store]
        with self.env.begin(buffers=False) as txn:
            return [txn.get(_KEY.pack(i), db=db) for i in indices]

    def iter_store(self, store: str) -> Iterable[bytes]:
        """Every record of a store, oldest first (for analysis and tests)."""
        if store in self._missing:
            return
        with self.env.begin() as txn:
            for _, value in txn.cursor(db=self._dbs[store]):
                yield bytes(value)

    def is_duplicate(self, dedup_key: bytes) -> bool:
        with self.env.begin() as txn:
            return txn.get(dedup_key, db=self._dbs["dedup"]) is not None

    def info(self) -> dict[str, Any]:
        info, stat = self.env.info(), self.env.stat()
        used = (info["last_pgno"] + 1) * stat["psize"]
        return {
            "map_size": info["map_size"],
            "map_used": used,
            "max_map_size": self.max_map_size,
            "map_grown": self.map_grown,
        }

    # ---- writing -------------------------------------------------------------------------

    def write(self, items: list[WriteItem], extra_counters: dict[str, int] | None = None) -> list[str]:
        """Store ``items`` in one durable transaction; returns STORED or DUPLICATE per item.

        ``extra_counters`` (absolute values, e.g. reject counts kept by the server) are persisted
        alongside. Grows the map on MapFullError; raises :class:`StoreRefused` with the reason
        when it cannot, leaving the database and ``self.state`` exactly as they were.
        """

        def attempt() -> tuple[list[str], dict[str, Any]]:
            state = copy.deepcopy(self.state)  # a fresh copy per attempt: a failed one left no trace
            return self._write_txn(items, state, extra_counters), state

        results, self.state = self._until_stored(attempt)
        self.last_error = None
        return results

    def get_meta(self, key: bytes, default: Any = None) -> Any:
        """A small persisted object of the ``meta`` database (e.g. held-out results)."""
        with self.env.begin() as txn:
            raw = txn.get(key, db=self._dbs["meta"])
        return default if raw is None else _unpack(raw)

    def put_meta(self, key: bytes, obj: Any) -> None:
        """Persist ``obj`` under ``key`` in ``meta`` (one durable transaction; growth/refusal as write)."""

        def attempt() -> None:
            with self.env.begin(write=True) as txn:
                txn.put(key, _pack(obj), db=self._dbs["meta"])

        self._until_stored(attempt)

    def set_registry(self, registry: dict[str, Any]) -> None:
        """Persist a new registry (one durable transaction); same growth/refusal rules as write."""

        def attempt() -> None:
            with self.env.begin(write=True) as txn:
                txn.put(b"registry", _pack(registry), db=self._dbs["meta"])

        self._until_stored(attempt)
        self.registry = registry

    def _until_stored(self, attempt: Any) -> Any:
        """Run a write transaction, growing the map on MapFullError until it fits; any other LMDB
        error (or the map limit) raises :class:`StoreRefused`. The aborted attempts changed nothing."""
        while True:
            try:
                return attempt()
            except lmdb.MapFullError:
                self._grow_or_refuse()
            except lmdb.Error as exc:
                self._refuse_io(exc)

    def _write_txn(self, items: list[WriteItem], state: dict[str, Any], extra: dict[str, int] | None) -> list[str]:
        dedup_db, order_db, dbs = self._dbs["dedup"], self._dbs["dedup_order"], self._dbs
        counters, rings = state["counters"], state["rings"]
        key = _KEY.pack
        results: list[str] = []
        d_tail, d_head = state["dedup"]
        # Ring heads only grow, so every key is appended (append=True skips LMDB's search), and
        # the records of the whole batch go in with one putmulti per store instead of a put each.
        appends: dict[str, list[tuple[bytes, bytes]]] = {}
        # items often share one counters map (the broker's gate results do): add each map once,
        # times the number of its stored items
        tallies: dict[int, list] = {}
        with self.env.begin(write=True) as txn:
            put = txn.put
            for item in items:
                # one put both tests and records the id: no separate lookup, and a second copy
                # within the same batch sees the first because it is in the same transaction
                if not put(item.dedup_key, key(d_head), db=dedup_db, overwrite=False):
                    counters["duplicates"] = counters.get("duplicates", 0) + 1
                    results.append(DUPLICATE)
                    continue
                put(key(d_head), item.dedup_key, db=order_db, append=True)
                d_head += 1
                for store, value in item.records:
                    ring = rings[store]
                    appends.setdefault(store, []).append((key(ring[1]), value))
                    ring[1] += 1
                tally = tallies.get(id(item.counters))
                if tally is None:
                    tallies[id(item.counters)] = [item.counters, 1]
                else:
                    tally[1] += 1
                results.append(STORED)
            for item_counters, n in tallies.values():
                for k, v in item_counters.items():
                    counters[k] = counters.get(k, 0) + v * n
            for store, pairs in appends.items():
                with txn.cursor(db=dbs[store]) as cur:
                    cur.putmulti(pairs, append=True)
                self._evict(txn, state, store)
            # the dedup index is a ring too: the oldest ids are forgotten first
            while d_head - d_tail > self.dedup_capacity:
                old = txn.pop(key(d_tail), db=order_db)
                if old is not None:
                    txn.delete(old, db=dedup_db)
                d_tail += 1
            state["dedup"] = [d_tail, d_head]
            if extra:
                counters.update(extra)
            txn.put(b"state", _pack(state), db=self._dbs["meta"])
        return results

    def _evict(self, txn: lmdb.Transaction, state: dict[str, Any], store: str) -> None:
        db = self._dbs[store]
        tail, head = state["rings"][store]
        while head - tail > self.capacities[store]:
            txn.delete(_KEY.pack(tail), db=db)
            tail += 1
            state["evicted"][store] += 1
        state["rings"][store] = [tail, head]

    def _grow_or_refuse(self) -> None:
        size = self.env.info()["map_size"]
        if size >= self.max_map_size:
            self.last_error = (
                f"LMDB map is full at its limit ({size // MB} MB = broker.max_map_size_mb); "
                "raise broker.max_map_size_mb or lower broker.capacity"
            )
            raise StoreRefused(self.last_error)
        new = min(self.max_map_size, size * 2)
        self.env.set_mapsize(new)
        self.map_grown += 1

    def _refuse_io(self, exc: lmdb.Error) -> None:
        try:
            free = shutil.disk_usage(self.path).free
        except OSError:
            free = -1
        hint = "disk full" if 0 <= free < 64 * MB else "I/O error"
        self.last_error = (
            f"LMDB write failed ({hint}, {free // MB if free >= 0 else '?'} MB free at {self.path}): {exc}"
        )
        raise StoreRefused(self.last_error) from None

    def cut_after(
        self,
        ts_limit: float,
        version_limit: int | None = None,
        uncount: Callable[[str, dict[str, Any]], dict[str, int]] | None = None,
    ) -> dict[str, int]:
        """Drop, per store, the records from the first one stamped after ``ts_limit`` onwards (a
        fork keeps what its source had stored up to its fork point); returns how many each lost.
        Records are appended in arrival order, so what came later is a suffix of each ring. A
        record without a stamp (reflection samples stored before they carried one) counts as later
        when its ``policy_version`` is above ``version_limit``. ``uncount(store, record)``: the
        counters a dropped record stands for, taken back out of the persisted counters."""

        def later(rec: dict[str, Any]) -> bool:
            if rec.get("ts"):
                return float(rec["ts"]) > ts_limit
            return version_limit is not None and int(rec.get("policy_version", 0)) > version_limit

        removed: dict[str, int] = {}
        counters = self.state["counters"]
        with self.env.begin(write=True) as txn:
            for store, db in ((s, self._dbs[s]) for s in STORES):
                tail, head = self.state["rings"][store]
                cut = head
                for i in range(tail, head):
                    raw = txn.get(_KEY.pack(i), db=db)
                    if raw is not None and later(_unpack(raw)):
                        cut = i
                        break
                for i in range(cut, head):
                    raw = txn.get(_KEY.pack(i), db=db)
                    if uncount is not None and raw is not None:
                        for k, v in uncount(store, _unpack(raw)).items():
                            counters[k] = counters.get(k, 0) - v
                    txn.delete(_KEY.pack(i), db=db)
                self.state["rings"][store] = [tail, cut]
                removed[store] = head - cut
            txn.put(b"state", _pack(self.state), db=self._dbs["meta"])
        return removed

    def close(self) -> None:
        self.env.close()


def key_of(index: int) -> bytes:
    return _KEY.pack(index)


def disk_free_bytes(path: str | Path) -> int:
    return shutil.disk_usage(os.fspath(path)).free
