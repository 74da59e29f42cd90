"""Broker ingest throughput: transitions/s stored with validation, gates and durable group commit,
against a raw ZeroMQ-to-LMDB loop (no validation, no gates, same commit policy) in the same run.

Both servers run as their own process and are fed by the same pipelined DEALER client (this
process) with the same pre-encoded messages: ~2 KB of ALFWorld-like text per transition, phase
``coevolve`` so both gates run (the world-state score measured on the real ALFWorld fact parser
when the messages are made, as an actor does). The rate is messages acked
per second, and the broker only acks after the LMDB commit that stored the message.

    python benchmarks/broker_ingest.py [--n 40000] [--gate-workers 1] [--rounds 3]

Each round measures the raw loop, then the broker; the last line gives the median rate and the
median of the rounds' ratios (this machine's speed drifts between runs, so single runs vary).

CPU per message is also printed for the raw server and for the broker with its gate workers
(from /proc): the ratio of rates depends on how many cores are free for the broker's processes,
the CPU figures do not.

Last line: ``broker_ingest_per_s=X ratio_vs_raw=Y`` (medians over the rounds).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import msgpack
import msgspec
import zmq

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from broker.actor_path import GROUP_COMMIT  # noqa: E402 - the repo must be on sys.path first
from comap_async.ports import free_port  # noqa: E402
from comap_async.wire.messages import COEVOLVE, KEEP, REVISE, Transition  # noqa: E402
from comap_async.wire.protocol import encode  # noqa: E402

OBS = (
    "You arrive at countertop {k}. On the countertop {k}, you see a apple {a}, a bread {b}, a butterknife {c}, "
    "a cellphone {d}, a egg {e}, a knife {f}, a lettuce {g}, a mug {h}, a peppershaker {i}, a plate {j}, "
    "a potato {k}, a soapbottle {a}, a spatula {b}, a spoon {c}, and a tomato {d}."
)
PICK = "You pick up the apple {a} from the countertop {k}."


def OBS_FACTS(text: str) -> frozenset[str]:  # noqa: N802 - a constant-like helper
    from comap_async.envs.alfworld_facts import parse_facts

    return parse_facts(text)


def make_messages(n: int, text_bytes: int) -> list[bytes]:
    from comap_async.envs.alfworld_facts import next_state
    from comap_async.method.gates import world_state_score

    out = []
    for i in range(n):
        # object numbers derived from i: every observation text is new, so the parser's
        # cache only helps where a real stream would (identical student/teacher predictions)
        f = {c: i * 11 + j + 1 for j, c in enumerate("abcdefghijk")}
        o = OBS.format(**f)
        hist = f"Your task is to: put a clean apple in fridge.\n> go to countertop {f['k']}\n{o}\n"
        s = (
            hist
            + "Admissible: "
            + ", ".join(
                f"take {x} {f['a']} from countertop {f['k']}"
                for x in ("apple", "bread", "egg", "knife", "mug", "plate")
            )
        )
        pick = PICK.format(**f)
        # the actor's fact state before the action: what the observation says plus what earlier
        # steps showed elsewhere (~30 facts, a mid-episode state)
        facts = sorted(
            OBS_FACTS(o)
            | {f"in(cd {i % 7 + j}, drawer {j})" for j in range(1, 15)}
            | {f"closed(cabinet {j})" for j in range(1, 5)}
        )
        msg = Transition(
            seq=i,
            id=f"bench:ep{i // 50}:{i % 50}-{i}",
            actor="bench",
            env="alfworld",
            game="train/pick_clean_then_place/trial_1",
            split="train",
            episode=f"bench:ep{i // 50}",
            t=i % 50,
            o=o,
            phase=COEVOLVE,
            goal="put a clean apple in fridge.",
            s=s,
            a_draft=f"take apple {f['a']} from countertop {f['k']}",
            s_hat=pick,
            decision=REVISE if i % 3 == 0 else KEEP,
            a_ref=f"take bread {f['b']} from countertop {f['k']}",
            p_revise=(i % 10) / 10,
            q_ref=((i * 7) % 10) / 10,
            a_exec=f"take apple {f['a']} from countertop {f['k']}",
            s_hat_exec=pick,
            s_hat_teacher=pick if i % 4 else "Nothing happens.",
            s_next=pick,
            reward=0.0,
            done=False,
            won=False,
            expert_action=None,
            policy_version=1,
            wm_version=1,
            ts=time.time(),
            facts=facts,
        )
        # the world-state score, as the actor measures it before sending (the broker parses no text)
        msg.ws_score = world_state_score(next_state, frozenset(facts), msg.s_hat_exec, msg.s_hat_teacher)
        text = sum(len(v) for v in msgspec.structs.asdict(msg).values() if isinstance(v, str))
        if text < text_bytes:  # pad the rendered state up to the target text size
            msg.s += "\n" + "You see nothing special. " * ((text_bytes - text) // 25)
        out.append(encode(msg))
    return out


def cpu_by_process(pid: int) -> dict[int, float]:
    """User + system CPU seconds of ``pid`` and of each live descendant (the gate workers), from
    /proc (Linux)."""
    out: dict[int, float] = {}
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        out[pid] = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            children = [int(c) for c in f.read().split()]
    except (FileNotFoundError, ProcessLookupError):
        return out
    for child in children:
        out.update(cpu_by_process(child))
    return out


def cpu_seconds(pid: int) -> float:
    """User + system CPU of ``pid`` and its live descendants."""
    return sum(cpu_by_process(pid).values())


def drive(endpoint: str, msgs: list[bytes], window: int, timeout_s: float = 300) -> float:
    """Send every message keeping ``window`` unacked; returns acked messages per second."""
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.sndhwm = sock.rcvhwm = 0
    sock.connect(endpoint)
    sent = acked = failed = 0
    t0 = time.perf_counter()
    deadline = time.monotonic() + timeout_s
    poller = zmq.Poller()
    poller.register(sock, zmq.POLLIN)
    while acked < len(msgs):
        while sent < len(msgs) and sent - acked < window:
            sock.send(msgs[sent], copy=False)
            sent += 1
        if poller.poll(1000):
            while True:
                try:
                    ack = sock.recv(zmq.NOBLOCK)
                except zmq.Again:
                    break
                if b"\xa2ok\xc3" not in ack:  # {"ok": true} without decoding: the client is not the subject
                    failed += 1
                acked += 1
        if time.monotonic() > deadline:
            raise RuntimeError(f"timed out: {acked}/{len(msgs)} acked")
    rate = len(msgs) / (time.perf_counter() - t0)
    sock.close(0)
    ctx.term()
    if failed:
        raise RuntimeError(f"{failed} messages were refused")
    return rate


def raw_server(port: int, path: str, group: int) -> None:
    """The baseline: ROUTER -> LMDB put of the raw bytes, durable commit per group, then an ack each."""
    import lmdb

    env = lmdb.open(path, map_size=8 << 30, max_dbs=4)
    db = env.open_db(b"raw")
    ctx = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)
    sock.rcvhwm = sock.sndhwm = 4 * group
    sock.bind(f"tcp://127.0.0.1:{port}")
    ack = msgpack.packb({"v": 1, "type": "ack", "seq": 0, "ok": True, "error": None, "registry": {}})
    print("ready", flush=True)
    key = 0
    while True:
        if not sock.poll(60_000):
            return
        batch = []
        while len(batch) < group:
            try:
                batch.append(sock.recv_multipart(zmq.NOBLOCK))
            except zmq.Again:
                break
        with env.begin(write=True) as txn:
            for frames in batch:
                txn.put(key.to_bytes(8, "big"), frames[-1], db=db, append=True)
                key += 1
        for frames in batch:
            sock.send_multipart([frames[0], ack])


def measure_raw(args: argparse.Namespace, msgs: list[bytes], tmp: str, env: dict[str, str]) -> float:
    """One raw-loop measurement (prints its line); returns msg/s."""
    port = free_port()
    raw = subprocess.Popen(
        [sys.executable, __file__, "--raw-server", str(port), f"{tmp}/raw", "--group-commit", str(args.group_commit)],
        stdout=subprocess.PIPE,
        env=env,
    )
    try:
        assert raw.stdout is not None and raw.stdout.readline().strip() == b"ready"
        cpu0 = cpu_seconds(raw.pid)
        client0 = time.process_time()
        raw_rate = drive(f"tcp://127.0.0.1:{port}", msgs, args.window)
        client_cpu = (time.process_time() - client0) / args.n * 1e6
        raw_cpu = (cpu_seconds(raw.pid) - cpu0) / args.n * 1e6
    finally:
        raw.kill()
        raw.wait()
    print(f"raw zmq->lmdb loop: {raw_rate:,.0f} msg/s, {raw_cpu:.1f} us CPU per message (client: {client_cpu:.1f} us)")
    return raw_rate


def measure_broker(args: argparse.Namespace, msgs: list[bytes], tmp: str, env: dict[str, str]) -> tuple[float, float]:
    """One broker measurement (prints its line); returns (transitions/s, broker + client CPU per message)."""
    ports = [free_port() for _ in range(3)]
    cap = max(args.n, 1000)
    sets = [
        f"run.root={tmp}",
        "run.name=bench",
        f"broker.actor_port={ports[0]}",
        f"broker.learner_port={ports[1]}",
        f"broker.http_port={ports[2]}",
        f"broker.capacity={cap}",
        f"broker.gate_workers={args.gate_workers}",
    ]
    cmd = [sys.executable, "-m", "broker"] + [x for s in sets for x in ("--set", s)]
    broker = subprocess.Popen(cmd, env=env, cwd=REPO)
    try:
        for _ in range(200):
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{ports[2]}/healthz", timeout=1)
                break
            except OSError:
                time.sleep(0.05)
        cpu0 = cpu_by_process(broker.pid)
        client0 = time.process_time()
        rate = drive(f"tcp://127.0.0.1:{ports[0]}", msgs, args.window)
        client_cpu = (time.process_time() - client0) / args.n * 1e6
        cpu1 = cpu_by_process(broker.pid)
        main_cpu = (cpu1.get(broker.pid, 0) - cpu0.get(broker.pid, 0)) / args.n * 1e6
        broker_cpu = (sum(cpu1.values()) - sum(cpu0.get(p, 0) for p in cpu1)) / args.n * 1e6
        stats = json.loads(urllib.request.urlopen(f"http://127.0.0.1:{ports[2]}/stats", timeout=5).read())
    finally:
        broker.terminate()
        broker.wait(30)
    stored = stats["stores"]["transitions"]["count"]
    if stored != args.n or stats["stores"]["reflections"]["count"] != args.n:
        raise SystemExit(f"broker stored {stored} transitions, expected {args.n}")
    g = stats["gates"]
    print(
        f"broker (validation + gates + durable group commit): {rate:,.0f} transitions/s; "
        f"stored {stored} transitions + {stats['stores']['reflections']['count']} reflection samples; "
        f"world-state adoption {g['world_state_adoption']:.2f}, action adoption {g['action_adoption']:.2f}; "
        f"{broker_cpu:.1f} us CPU per message ({main_cpu:.1f} in the broker process, the rest in "
        f"{args.gate_workers} gate workers; client: {client_cpu:.1f} us); "
        f"{stats['gate_workers']['batches_gated_in_broker']} batches gated in the broker process"
    )
    return rate, broker_cpu + client_cpu


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=40_000, help="transitions per measurement")
    ap.add_argument("--text-bytes", type=int, default=2048)
    ap.add_argument(
        "--group-commit", type=int, default=GROUP_COMMIT, help="the raw loop's transaction size (the broker's: 256)"
    )
    ap.add_argument("--window", type=int, default=2048, help="unacked messages the client keeps in flight")
    ap.add_argument("--gate-workers", type=int, default=1, help="broker.gate_workers (0: gate in the broker process)")
    ap.add_argument(
        "--rounds",
        type=int,
        default=3,
        help="raw/broker measurement pairs, interleaved; the last line gives the medians",
    )
    ap.add_argument("--raw-server", nargs=2, metavar=("PORT", "DIR"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.raw_server:
        raw_server(int(args.raw_server[0]), args.raw_server[1], args.group_commit)
        return 0
    if args.rounds < 1 or args.n < 1:
        ap.error("--rounds and --n must be at least 1")

    msgs = make_messages(args.n, args.text_bytes)
    avg = sum(len(m) for m in msgs) / len(msgs)
    print(f"messages: {args.n} transitions, {avg:.0f} bytes each on the wire, group commit {args.group_commit}")
    env = {**os.environ, "PYTHONPATH": str(REPO), "COMAP_LOG_LEVEL": "WARNING"}
    rates, ratios = [], []
    for r in range(args.rounds):
        print(f"-- round {r + 1}/{args.rounds}")
        with tempfile.TemporaryDirectory(prefix="comap-bench-") as tmp:
            # raw loop first: nothing it does warms anything the broker run uses
            raw_rate = measure_raw(args, msgs, tmp, env)
            rate, cpu = measure_broker(args, msgs, tmp, env)
        # what a ratio of 0.5 costs at this round's CPU per message (broker and client share the host)
        print(
            f"round ratio {rate / raw_rate:.2f}; CPU for a ratio of 0.5 at these costs: "
            f"{0.5 * raw_rate * cpu / 1e6:.2f} cores (this host: {os.cpu_count()})"
        )
        rates.append(rate)
        ratios.append(rate / raw_rate)
    # this machine's speed drifts between runs: the median of interleaved pairs is the figure
    print(f"broker_ingest_per_s={statistics.median(rates):.0f} ratio_vs_raw={statistics.median(ratios):.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
