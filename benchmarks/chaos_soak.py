"""Chaos soak: the whole system on the tiny model while a random process is killed with SIGKILL.

Starts a broker, an embedded inference server, a learner and an actor (whose environment workers
are its children) on loopback, free ports and a temporary run root, each as a supervised
subprocess: a small supervisor loop here restarts whichever exits, as honcho would restart nothing
(it stops everything when one process dies) but systemd's ``Restart=always`` does. Every
``--kill-every`` seconds (random in the range, seeded) a random process among broker, server,
learner, actor and one of the actor's environment workers gets SIGKILL; the supervisor restarts it
(an environment worker is replaced by the actor itself, which is part of what is checked).

The actor records every message the broker acks (``actor.ack_log``), with unacked ones spilled to
disk (``actor.spill_dir``) so a killed actor resends them. At the end, with everything stopped,
the broker's LMDB stores are read and checked:

* every acked message id is stored exactly once (``lost``: acked, not stored; ``duplicates``: ids
  stored more than once), and no store evicted anything (the capacities are raised so none does);
* every stored episode has all its steps' transitions stored;
* the policy versions the broker announced only grow, the learner's published versions only grow,
  and each announced adapter had been loaded by the server process alive at the announce;
* every kill was followed by the process answering again (broker ``/healthz``, server
  ``/health``, learner: its first step or publish, actor: its first new ack, environment worker:
  a new worker process under the actor), within the stated bound per kind;
* the resident memory of each process, sampled from /proc, stayed under a bound per kind.

    python benchmarks/chaos_soak.py [--minutes 20] [--kill-every 60-120] [--seed 0] [--data DIR]

Prints the figures; last line ``chaos_soak lost=N duplicates=M kills=K``. Exits 1 when a check
failed. The run directory (logs of every process incarnation, the stores, ``rss.csv``) is kept
with ``--keep`` (and always when a check failed).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections import Counter, defaultdict
from datetime import datetime
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from comap_async.wire.messages import COEVOLVE, WARMUP  # noqa: E402 - the repo must be on sys.path first

KINDS = ("broker", "server", "learner", "actor", "env_worker")
COMMANDS = {"broker": "broker", "server": "serve", "learner": "learner", "actor": "actor"}
RECOVERY_BOUND_S = {"broker": 30.0, "server": 120.0, "learner": 180.0, "actor": 120.0, "env_worker": 60.0}
"""Kill -> answering again, per kind: what an operator may expect of a supervised restart on a
busy 2-core host (the learner and the server load torch and the model first)."""
RSS_BOUND_MB = {"broker": 600, "server": 2500, "learner": 3500, "actor": 1200, "env_worker": 1200}
"""Peak resident memory per process of each kind on the tiny model (a leak under restarts shows
as a peak far above the first minutes')."""
LEARNER_BACK = ("learner.step", "publish.done")
"""A restarted learner is back when it trained a step or published again."""
RESTART_DELAY_S = 1.0  # systemd's RestartSec: a crash loop must not spin
# which store holds each acked message type's records
STORE_OF = {"transition": "transitions", "episode": "episodes", "reflection": "reflections", "imagined": "imagined"}


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


# ---- /proc ---------------------------------------------------------------------------------------


def children(pid: int) -> list[int]:
    """The live child processes of ``pid`` (every thread's: a child belongs to the thread that forked it)."""
    out: list[int] = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            out += [int(c) for c in (task / "children").read_text().split()]
        except (OSError, ValueError):
            continue
    return out


def cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def env_workers(actor_pid: int) -> list[int]:
    """The actor's environment workers: its multiprocessing spawn children (not a resource tracker)."""
    return [c for c in children(actor_pid) if "spawn_main" in cmdline(c) and "resource_tracker" not in cmdline(c)]


def rss_mb(pid: int) -> float | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return None


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def http_ok(url: str) -> bool:
    return http_json(url) is not None


def http_json(url: str) -> Any:
    """The JSON answer of a GET (``{}`` for a non-JSON 200), None when it does not answer 200."""
    try:
        with urllib.request.urlopen(url, timeout=2.0) as r:
            body = r.read()
            if r.status != 200:
                return None
    except Exception:  # noqa: BLE001 - down, refusing, half up: not answering
        return None
    try:
        return json.loads(body)
    except ValueError:
        return {}


def log_events(path: Path) -> list[dict[str, Any]]:
    """The JSON log lines of one process incarnation (other lines, e.g. tracebacks, skipped)."""
    out = []
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return out
    for line in text.splitlines():
        if line.startswith("{"):
            try:
                out.append(json.loads(line))
            except ValueError:
                continue
    return out


def event_time(ev: dict[str, Any]) -> float:
    return datetime.fromisoformat(ev["timestamp"].replace("Z", "+00:00")).timestamp()


# ---- supervision ---------------------------------------------------------------------------------


class Supervised:
    """One kind of process, restarted whenever it exits (until stopping); every incarnation logs
    to its own file so its events can be told apart."""

    def __init__(self, kind: str, argv: list[str], env: dict[str, str], logs: Path) -> None:
        self.kind, self.argv, self.env, self.logs = kind, argv, env, logs
        self.proc: subprocess.Popen | None = None
        self.incarnations: list[dict[str, Any]] = []  # pid, start, end, rc, log
        self.restart_at: float | None = None

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None and self.proc.poll() is None else None

    def start(self) -> None:
        path = self.logs / f"{self.kind}.{len(self.incarnations)}.log"
        with open(path, "wb") as out:
            # own session: the final cleanup can signal a process and whatever it left behind
            self.proc = subprocess.Popen(
                self.argv, stdout=out, stderr=subprocess.STDOUT, env=self.env, cwd=REPO, start_new_session=True
            )
        self.incarnations.append({"pid": self.proc.pid, "start": time.time(), "end": None, "rc": None, "log": path})
        self.restart_at = None

    def poll(self, stopping: bool) -> bool:
        """Reap an exit and (unless stopping) restart after :data:`RESTART_DELAY_S`; True when it restarted."""
        if self.proc is not None and self.restart_at is None and (rc := self.proc.poll()) is not None:
            self.incarnations[-1].update(end=time.time(), rc=rc)
            self.restart_at = time.monotonic() + RESTART_DELAY_S
        if not stopping and self.restart_at is not None and time.monotonic() >= self.restart_at:
            self.start()
            return True
        return False

    def incarnation_at(self, t: float) -> dict[str, Any] | None:
        for inc in self.incarnations:
            if inc["start"] <= t and (inc["end"] is None or t < inc["end"]):
                return inc
        return None


class Soak:
    def __init__(self, args: argparse.Namespace, work: Path, model: Path) -> None:
        from comap_async.lifetime import tied_env
        from comap_async.ports import free_port

        self.args, self.work = args, work
        self.rng = random.Random(args.seed)
        self.logs = work / "logs"
        self.logs.mkdir(parents=True, exist_ok=True)
        self.ack_log = work / "acked.log"
        self.http_port, self.inference_port = free_port(), free_port()
        self.run_dir = work / "runs" / "soak"
        overrides = [
            f"run.root={work / 'runs'}",
            "run.name=soak",
            f"model.name_or_path={model}",
            f"env.data_dir={Path(args.data).expanduser()}",
            f"broker.actor_port={free_port()}",
            f"broker.learner_port={free_port()}",
            f"broker.http_port={self.http_port}",
            f"inference.port={self.inference_port}",
            f"inference.endpoints=['http://127.0.0.1:{self.inference_port}']",
            "inference.max_prompt_tokens=2048",
            "broker.max_staleness=100",
            # large enough that no ring evicts during the soak: an evicted record would read as lost
            "broker.capacity=1000000",
            f"actor.spill_dir={work / 'spill'}",
            f"actor.ack_log={self.ack_log}",
        ]
        env = tied_env({**os.environ, "COMAP_LOG_JSON": "1", "PYTHONUNBUFFERED": "1", "COMAP_OVERRIDES": ""})
        config = str(REPO / "configs" / "test.yaml")
        sets = [a for o in [*overrides, *args.set] for a in ("--set", o)]
        self.procs = {
            kind: Supervised(
                kind, [sys.executable, "-m", "comap_async", cmd, "--config", config, *sets], env, self.logs
            )
            for kind, cmd in COMMANDS.items()
        }
        self.kills: list[dict[str, Any]] = []
        self.order: list[str] = []  # the kinds still to kill in this round
        self.rss_peak: dict[str, float] = defaultdict(float)
        self.rss_first: dict[str, float] = {}
        self.rss_rows: list[str] = ["t,kind,pid,rss_mb"]
        self.seen_workers: set[int] = set()
        self.descendants: dict[int, set[int]] = {}  # pid -> its children last seen (orphan check after a kill)
        self.orphan_watch: list[tuple[float, int, str]] = []  # (deadline, pid, of kind)
        self.orphans: list[str] = []

    # -- probes --

    def url(self, kind: str) -> str:
        if kind == "broker":
            return f"http://127.0.0.1:{self.http_port}/healthz"
        return f"http://127.0.0.1:{self.inference_port}/health"

    def ack_bytes(self) -> int:
        try:
            return self.ack_log.stat().st_size
        except OSError:
            return 0

    def serving_registry(self) -> bool:
        """Whether the server lists every adapter the broker's registry names (what actors ask for)."""
        stats = http_json(f"http://127.0.0.1:{self.http_port}/stats")
        models = http_json(f"http://127.0.0.1:{self.inference_port}/v1/models")
        if not stats or not models:
            return False
        return set(stats["registry"].get("adapters", {}).values()) <= {m["id"] for m in models["data"]}

    def learner_back(self, inc: dict[str, Any]) -> bool:
        return any(ev.get("event") in LEARNER_BACK for ev in log_events(inc["log"]))

    def answering(self, kill: dict[str, Any]) -> bool:
        """Whether the killed process's kind is back (see the module docstring)."""
        kind = kill["kind"]
        if kind == "env_worker":
            actor = self.procs["actor"].pid
            return actor is not None and bool(set(env_workers(actor)) - kill["workers_at_kill"])
        sup = self.procs[kind]
        if sup.pid is None or len(sup.incarnations) <= kill["incarnation"] + 1:
            return False  # not restarted yet
        if kind == "broker":
            return http_ok(self.url(kind))
        if kind == "server":  # answering is not enough: actors need the registry's adapters served
            if kill.get("health") is None and http_ok(self.url(kind)):
                kill["health"] = time.monotonic()
            return kill.get("health") is not None and self.serving_registry()
        if kind == "learner":
            return self.learner_back(sup.incarnations[-1])
        return self.ack_bytes() > kill["acks_at_kill"]  # actor: a new ack reached the restarted process

    # -- the loop's parts --

    def sample_rss(self, now: float) -> None:
        pids = [(k, s.pid) for k, s in self.procs.items() if s.pid is not None]
        if (actor := self.procs["actor"].pid) is not None:
            pids += [("env_worker", w) for w in env_workers(actor)]
        for kind, pid in pids:
            mb = rss_mb(pid)
            if mb is None:
                continue
            self.rss_peak[kind] = max(self.rss_peak[kind], mb)
            self.rss_first.setdefault(kind, mb)
            self.rss_rows.append(f"{now:.1f},{kind},{pid},{mb:.1f}")

    def killable(self) -> list[str]:
        """The kinds that are up, once every earlier kill has recovered (one outage at a time: a
        recovery time is then the process's own, not a wait for another one)."""
        if any(k["back"] is None for k in self.kills):
            return []
        up = []
        for kind in self.args.kinds:
            if kind == "env_worker":
                if (actor := self.procs["actor"].pid) is not None and env_workers(actor):
                    up.append(kind)
            elif self.procs[kind].pid is not None:
                up.append(kind)
        return up

    def kill_one(self, now: float) -> bool:
        """SIGKILL the next process due; False (try again shortly) while none can be killed.

        The kinds are drawn in rounds, each a random order of all of them: every kind is killed
        once per round, so a run of ``len(kinds)`` kills or more covers them all."""
        kinds = self.killable()
        if not self.order:
            self.order = self.rng.sample(self.args.kinds, len(self.args.kinds))
        kind = next((k for k in self.order if k in kinds), None)
        if kind is None:
            return False
        self.order.remove(kind)
        workers = env_workers(self.procs["actor"].pid or -1)
        if kind == "env_worker":
            pid, incarnation = self.rng.choice(workers), -1
        else:
            pid, incarnation = self.procs[kind].pid, len(self.procs[kind].incarnations) - 1
            self.procs[kind].incarnations[-1]["killed"] = True
        left = children(pid)  # these must end with it (a dead parent must not leave workers behind)
        os.kill(pid, signal.SIGKILL)
        self.kills.append(
            {
                "kind": kind,
                "pid": pid,
                "t": now,
                "incarnation": incarnation,
                "acks_at_kill": self.ack_bytes(),
                "workers_at_kill": set(workers),
                "back": None,
            }
        )
        self.orphan_watch += [(now + 15.0, c, kind) for c in left]
        log(f"kill -9 {kind} pid {pid} ({len(self.kills)})")
        return True

    def check_orphans(self, now: float, final: bool = False) -> None:
        keep = []
        for deadline, pid, kind in self.orphan_watch:
            if now < deadline and not final:
                keep.append((deadline, pid, kind))
            elif alive(pid):
                self.orphans.append(f"{kind}'s child pid {pid} ({cmdline(pid)[:80]}) outlived it by 15 s")
                os.kill(pid, signal.SIGKILL)
        self.orphan_watch = keep

    def tick(self, now: float, stopping: bool = False) -> None:
        for sup in self.procs.values():
            if sup.poll(stopping):
                log(f"restarted {sup.kind} as pid {sup.pid}")
        for k in self.kills:
            if k["back"] is None and self.answering(k):
                k["back"] = time.monotonic()
                log(f"{k['kind']} back after {k['back'] - k['t']:.1f} s")

    # -- phases --

    def wait_up(self, timeout: float) -> None:
        """Until the broker and the server answer, the learner is training and acks flow."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            self.tick(time.monotonic())
            if (
                http_ok(self.url("broker"))
                and http_ok(self.url("server"))
                and self.learner_back(self.procs["learner"].incarnations[-1])
                and self.ack_bytes() > 0
                and env_workers(self.procs["actor"].pid or -1)
            ):
                return
            time.sleep(1.0)
        raise SystemExit(f"chaos_soak: the system did not come up in {timeout:.0f} s; logs in {self.logs}")

    def run(self) -> None:
        lo, hi = self.args.kill_every
        for sup in self.procs.values():
            sup.start()
        t_start = time.monotonic()
        self.wait_up(self.args.startup_s)
        t0 = time.monotonic()
        log(f"system up after {t0 - t_start:.0f} s; soaking {self.args.minutes} min")
        end = t0 + self.args.minutes * 60
        # no kill in the last interval (at most a minute): the last one must have time to come back
        last_kill = end - min(60.0, hi)
        next_kill, next_rss = t0 + self.rng.uniform(lo, hi), t0
        while (now := time.monotonic()) < end:
            self.tick(now)
            if now >= next_rss:
                self.sample_rss(time.time())
                next_rss = now + self.args.rss_every
            if now >= next_kill and now < last_kill:
                next_kill = now + (self.rng.uniform(lo, hi) if self.kill_one(now) else 5.0)
            self.check_orphans(now)
            time.sleep(0.5)
        # the last kill may still be recovering: its bound, not the soak's end, says when it is late
        while (now := time.monotonic()) < max(
            (k["t"] + RECOVERY_BOUND_S[k["kind"]] for k in self.kills if k["back"] is None), default=0
        ):
            self.tick(now)
            time.sleep(0.5)
        self.stop()

    def stop(self) -> None:
        """SIGTERM to all at once, as honcho does; SIGKILL to whatever is left after 30 s."""
        for sup in self.procs.values():
            if sup.pid is not None:
                sup.incarnations[-1]["stopped"] = True
                os.kill(sup.pid, signal.SIGTERM)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and any(s.pid is not None for s in self.procs.values()):
            time.sleep(0.2)
        for sup in self.procs.values():
            if sup.pid is not None:
                log(f"{sup.kind} ignored SIGTERM for 30 s: killed")
                os.killpg(sup.pid, signal.SIGKILL)
            sup.poll(stopping=True)
        self.check_orphans(time.monotonic(), final=True)

    def kill_all(self) -> None:
        for sup in self.procs.values():
            for inc in sup.incarnations:
                try:
                    os.killpg(inc["pid"], signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    pass


# ---- the checks ------------------------------------------------------------------------------------


def read_stores(run_dir: Path) -> tuple[dict[str, list[dict]], dict[str, int]]:
    """Every record of every store (read-only), and the evictions counted per store."""
    import msgpack

    from broker.store import ReplayStore
    from comap_async.wire.messages import STORES

    replay = ReplayStore(run_dir / "replay", dict.fromkeys(STORES, 1 << 40), readonly=True)
    try:
        records = {s: [msgpack.unpackb(b, raw=False) for b in replay.iter_store(s)] for s in STORES}
        return records, dict(replay.state["evicted"])
    finally:
        replay.close()


def stored_ids(records: dict[str, list[dict]]) -> dict[str, Counter]:
    """Per acked message type, how many times each id is stored (where that type's records go)."""
    out = {t: Counter(r["id"] for r in records[s]) for t, s in STORE_OF.items()}
    # a suffix-labelled reflection is stored as sent; the other reflections are transitions' derived samples
    out["reflection"] = Counter(r["id"] for r in records["reflections"] if r.get("source") == "suffix")
    # a turn_demos path goes to demos, an imagined episode's to imagined: both carry ``turns``
    out["turn_demos"] = Counter(r["id"] for s in ("demos", "imagined") for r in records[s] if "turns" in r)
    return out


def check_delivery(ack_log: Path, records: dict[str, list[dict]]) -> dict[str, Any]:
    acked: dict[str, set[str]] = defaultdict(set)
    lines = 0
    for line in ack_log.read_text().splitlines() if ack_log.exists() else []:
        mtype, _, mid = line.partition(" ")
        acked[mtype].add(mid)
        lines += 1
    ids = stored_ids(records)
    lost = {t: sorted(a - set(ids.get(t, {}))) for t, a in acked.items()}
    dups = {t: sorted(i for i, n in c.items() if n > 1) for t, c in ids.items()}
    dups["transition"] = sorted(i for i, n in Counter(r["id"] for r in records["transitions"]).items() if n > 1)
    return {
        "ack_lines": lines,
        "acked": {t: len(a) for t, a in sorted(acked.items())},
        "stored": {t: sum(1 for i in acked[t] if i in ids.get(t, {})) for t in sorted(acked)},
        "lost": {t: v for t, v in lost.items() if v},
        "duplicates": {t: v for t, v in dups.items() if v},
    }


def check_episodes(records: dict[str, list[dict]]) -> dict[str, Any]:
    """Every stored episode has a stored transition for each of its steps (t = 0 .. steps-1)."""
    steps_of: dict[str, set[int]] = defaultdict(set)
    for tr in records["transitions"]:
        if tr["id"] == f"{tr['episode']}:{tr['t']}":  # the step itself, not an explored or recovery branch
            steps_of[tr["episode"]].add(int(tr["t"]))
    episodes = [e for e in records["episodes"] if not e.get("eval")]
    # warm-up and co-evolution send a transition per step; reflection-mode initialisation sends
    # samples only where the draft differs from the expert, so its episodes have no per-step record
    checked = [e for e in episodes if e["phase"] in (WARMUP, COEVOLVE)]
    incomplete = [e["id"] for e in checked if not set(range(int(e["steps"]))) <= steps_of.get(e["id"], set())]
    return {
        "episodes": len(episodes),
        "checked": len(checked),
        "incomplete": incomplete,
        # begun but never ended: an actor killed under them (or stopped at the end) abandons them
        "abandoned": len(set(steps_of) - {e["id"] for e in episodes}),
    }


def check_versions(soak: Soak) -> dict[str, Any]:
    """Announced versions only grow; published versions only grow; every announced adapter was
    loaded by the server incarnation alive at the announce, before it."""
    announces = sorted(
        (event_time(ev), ev)
        for inc in soak.procs["broker"].incarnations
        for ev in log_events(inc["log"])
        if ev.get("event") == "broker.registry"
    )
    versions = [int(ev["versions"].get("policy", 0)) for _, ev in announces]
    decreases = [(a, b) for a, b in zip(versions, versions[1:]) if b < a]
    published = sorted(
        (event_time(ev), int(ev["version"]))
        for inc in soak.procs["learner"].incarnations
        for ev in log_events(inc["log"])
        if ev.get("event") == "publish.done"
    )
    pub_versions = [v for _, v in published]
    republished = [(a, b) for a, b in zip(pub_versions, pub_versions[1:]) if b <= a]
    loads: dict[int, dict[str, float]] = {}  # server pid -> adapter name -> first load time
    for inc in soak.procs["server"].incarnations:
        for ev in log_events(inc["log"]):
            if ev.get("event") == "adapter.loaded":
                loads.setdefault(inc["pid"], {}).setdefault(ev["name"], event_time(ev))
    unserved = []
    for t, ev in announces:
        inc = soak.procs["server"].incarnation_at(t)
        for name in (ev.get("adapters") or {}).values():
            loaded = loads.get(inc["pid"], {}).get(name) if inc else None
            if loaded is None or loaded > t:
                unserved.append(f"{name} announced at {t:.1f} not loaded by server pid {inc and inc['pid']}")
    metas = []
    adapters = soak.run_dir / "adapters"
    for meta in sorted(adapters.glob("*-v*/comap.json")):
        v = json.loads(meta.read_text())["version"]
        if not meta.parent.name.endswith(f"-v{v}"):
            metas.append(f"{meta.parent.name} says version {v}")
    return {
        "announces": len(announces),
        "last_version": versions[-1] if versions else 0,
        "version_decreases": decreases,
        "publishes": len(published),
        "published_not_growing": republished,
        "announced_unserved": unserved,
        "meta_mismatch": metas,
    }


def log_problems(soak: Soak) -> dict[str, Counter]:
    """Warnings and errors per kind, by event (a failed episode by its error's start)."""
    out: dict[str, Counter] = defaultdict(Counter)
    for kind, sup in soak.procs.items():
        for inc in sup.incarnations:
            for ev in log_events(inc["log"]):
                if ev.get("level") in ("warning", "error", "critical"):
                    name = ev.get("event", "?")
                    if name == "actor.episode_failed":
                        name += ": " + str(ev.get("error", ""))[:70]
                    out[kind][name] += 1
    return out


def summarize(soak: Soak, records: dict[str, list[dict]], evicted: dict[str, int]) -> tuple[list[str], int, int, list]:
    delivery = check_delivery(soak.ack_log, records)
    episodes = check_episodes(records)
    versions = check_versions(soak)
    lost = sum(len(v) for v in delivery["lost"].values())
    dups = sum(len(v) for v in delivery["duplicates"].values())
    failures: list[str] = []
    out = [f"kills: {len(soak.kills)}  " + "  ".join(f"{k}={sum(x['kind'] == k for x in soak.kills)}" for k in KINDS)]
    out.append(f"ack log lines: {delivery['ack_lines']}")
    out.append("acked (distinct ids): " + "  ".join(f"{t}={n}" for t, n in delivery["acked"].items()))
    out.append("stored (of those):    " + "  ".join(f"{t}={n}" for t, n in delivery["stored"].items()))
    out.append("records stored: " + "  ".join(f"{s}={len(r)}" for s, r in records.items()))
    out.append(f"lost={lost} duplicates={dups} evicted={sum(evicted.values())}")
    for name, bad in (("lost", delivery["lost"]), ("duplicated", delivery["duplicates"])):
        for t, ids in bad.items():
            failures.append(f"{len(ids)} {t} ids {name}, e.g. {ids[:3]}")
    if sum(evicted.values()):
        failures.append(f"stores evicted records: {evicted}")
    out.append(
        f"episodes stored: {episodes['episodes']}, with a transition per step {episodes['checked']}: "
        f"incomplete {len(episodes['incomplete'])}; "
        f"abandoned (begun, never finished) {episodes['abandoned']}"
    )
    if episodes["incomplete"]:
        failures.append(f"episodes stored without all their steps: {episodes['incomplete'][:3]}")
    out.append(
        f"versions: {versions['announces']} announces, last policy v{versions['last_version']}, "
        f"{versions['publishes']} publishes; decreases {len(versions['version_decreases'])}, "
        f"published not growing {len(versions['published_not_growing'])}, "
        f"announced before served {len(versions['announced_unserved'])}"
    )
    for key in ("version_decreases", "published_not_growing", "announced_unserved", "meta_mismatch"):
        if versions[key]:
            failures.append(f"{key}: {versions[key][:3]}")
    out.append("recovery s (kill -> answering): max / median / n, bound")
    for kind in KINDS:
        ks = [k for k in soak.kills if k["kind"] == kind]
        if not ks:
            continue
        back = [k["back"] - k["t"] for k in ks if k["back"] is not None]
        never = len(ks) - len(back)
        line = f"  {kind:<10} " + (f"{max(back):6.1f} / {statistics.median(back):6.1f}" if back else "     - /      -")
        out.append(
            line + f" / {len(ks)}, bound {RECOVERY_BOUND_S[kind]:.0f}" + (f"  NOT BACK: {never}" if never else "")
        )
        if kind == "server" and (health := [k["health"] - k["t"] for k in ks if k.get("health") is not None]):
            out.append(f"  {'(/health)':<10} {max(health):6.1f} / {statistics.median(health):6.1f}")
        over = [round(b, 1) for b in back if b > RECOVERY_BOUND_S[kind]]
        if never or over:
            failures.append(f"{kind}: {never} never back, {len(over)} over {RECOVERY_BOUND_S[kind]:.0f} s {over}")
    out.append("peak RSS MB (first sample), bound")
    for kind in KINDS:
        if kind in soak.rss_peak:
            peak = soak.rss_peak[kind]
            out.append(f"  {kind:<10} {peak:7.0f} ({soak.rss_first[kind]:.0f}), bound {RSS_BOUND_MB[kind]}")
            if peak > RSS_BOUND_MB[kind]:
                failures.append(f"{kind} RSS peaked at {peak:.0f} MB, bound {RSS_BOUND_MB[kind]}")
    stops = {k: inc["rc"] for k, sup in soak.procs.items() for inc in sup.incarnations if inc.get("stopped")}
    out.append("exit codes on SIGTERM at the end: " + "  ".join(f"{k}={rc}" for k, rc in stops.items()))
    failures += [f"{k} exited {rc} on SIGTERM" for k, rc in stops.items() if rc != 0]
    failures += soak.orphans
    for kind, sup in soak.procs.items():  # an exit nobody caused: a crash (the supervisor restarted it)
        for inc in sup.incarnations:
            if inc["end"] is not None and not inc.get("killed") and not inc.get("stopped"):
                tail = inc["log"].read_text(errors="replace").strip().splitlines()[-1:] or [""]
                failures.append(f"{kind} pid {inc['pid']} exited by itself (rc {inc['rc']}): {tail[0][:300]}")
    problems = log_problems(soak)
    if problems:
        out.append("warnings and errors in the logs (kind: event x count)")
        for kind, c in problems.items():
            for name, n in c.most_common(6):
                out.append(f"  {kind}: {name} x{n}")
    return out, lost, dups, failures


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--minutes", type=float, default=20.0, help="soak length after the system is up")
    ap.add_argument(
        "--kill-every", default="60-120", help="seconds between kills, LO-HI (uniform, seeded); default 60-120"
    )
    ap.add_argument("--kinds", default=",".join(KINDS), help=f"what may be killed (default: {','.join(KINDS)})")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--data", default=os.environ.get("ALFWORLD_DATA", "~/.cache/comap-async/alfworld"))
    ap.add_argument("--model", default=None, help="a tiny model directory (default: built in the work directory)")
    ap.add_argument("--workdir", default=None, help="where runs and logs go (default: a new temporary directory)")
    ap.add_argument("--keep", action="store_true", help="keep the work directory even when every check passed")
    ap.add_argument("--rss-every", type=float, default=3.0, help="seconds between RSS samples")
    ap.add_argument("--startup-s", type=float, default=420.0, help="how long the system may take to come up")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="one more config override")
    args = ap.parse_args()
    lo, _, hi = args.kill_every.partition("-")
    args.kill_every = (float(lo), float(hi or lo))
    args.kinds = [k.strip() for k in args.kinds.split(",") if k.strip()]
    if unknown := set(args.kinds) - set(KINDS):
        ap.error(f"unknown kinds {sorted(unknown)}; known: {', '.join(KINDS)}")
    if not Path(args.data).expanduser().is_dir():
        ap.error(f"no ALFWorld games at {args.data} (set ALFWORLD_DATA or --data; .ci/install extracts them)")

    from comap_async.models import build_tiny_model

    work = Path(args.workdir or tempfile.mkdtemp(prefix="chaos-soak-"))
    work.mkdir(parents=True, exist_ok=True)
    model = Path(args.model) if args.model else build_tiny_model(work / "tiny")
    soak = Soak(args, work, model)
    try:
        soak.run()
    finally:
        soak.kill_all()
    (work / "rss.csv").write_text("\n".join(soak.rss_rows) + "\n")
    records, evicted = read_stores(soak.run_dir)
    lines, lost, dups, failures = summarize(soak, records, evicted)
    for line in lines:
        print(line)
    for f in failures:
        print(f"CHECK FAILED: {f}")
    if failures or args.keep:
        print(f"run directory kept: {work}")
    else:
        shutil.rmtree(work, ignore_errors=True)
    print(f"chaos_soak lost={lost} duplicates={dups} kills={len(soak.kills)}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
