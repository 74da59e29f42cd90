"""A held-out learning curve from an empty run directory: the system under honcho for a wall-clock
budget, the evaluator measuring every adapter version on held-out games.

    python experiments/studies/learning_curve.py [--minutes 90] [--split valid_seen] [--data DIR] [--games 10]
        [--config configs/local.yaml] [--set learner.schedule=rounds] [--out DIR] [--at MINUTES ...]
    python experiments/studies/learning_curve.py --report OUT_DIR [--at 45]

It runs the ``Procfile`` (broker, inference, learner, actor, evaluator) with ``--config`` on free
ports in a new run directory, stops it with SIGTERM after ``--minutes``, then prints one row per
evaluated version (wall time, phase, probes, success rate), the run's env steps/s and learner
tokens/s, the learner's publishes (version and minutes from the start, from its log) and
``first_coevolve_publish_min``, writes ``comap stats --plot`` PNGs into ``--out``, and ends with the line
``wm_delta_f1_gain=X draft_accuracy_gain=Y success_rate_gain=Z`` (latest version minus base).

A ``/stats`` snapshot a minute goes to ``progress.jsonl``; ``--at M`` prints a line with the figures
as they stood M minutes in (throughput over those minutes and over the co-evolution phase within
them, gains of the versions evaluated by then). The system never knows its budget, so the first
45 minutes of a 90-minute run are a 45-minute run: one long async run and a short ``rounds`` run
compare at equal wall time.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import time
import urllib.request
from datetime import datetime
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from comap_async.ports import free_port  # noqa: E402 - the repo must be on sys.path first
from comap_async.wire.messages import COEVOLVE  # noqa: E402
from experiments.system import stop_group  # noqa: E402

GAINS = ("wm_delta_f1", "draft_accuracy", "success_rate")


def _get(port: int, path: str) -> dict:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=10) as r:
        return json.loads(r.read())


def gains(results: list[dict]) -> dict[str, float | None]:
    """Latest evaluated version minus the base model, per figure (None where either is missing)."""
    by_version = {r["version"]: r for r in results}
    base, latest = by_version.get(0), by_version.get(max(by_version)) if by_version else None
    out: dict[str, float | None] = {}
    for key in GAINS:
        a, b = (base or {}).get(key), (latest or {}).get(key)
        out[key] = None if a is None or b is None else b - a
    return out


def table(results: list[dict], t0: float) -> list[str]:
    head = (
        f"{'ver':>4} {'wall_min':>8} {'phase':<12} {'step':>5} {'wm_dF1':>7} {'fail_dF1':>8} {'draft_acc':>9} "
        f"{'admiss':>7} {'success':>7}"
    )
    rows = [head]

    def f(x: float | None) -> str:
        return "-" if x is None else f"{x:.3f}"

    for r in sorted(results, key=lambda r: r["version"]):
        rows.append(
            f"{r['version']:>4} {(r.get('ts', t0) - t0) / 60:>8.1f} {str(r.get('phase')):<12} "
            f"{r.get('learner_step', 0):>5} {f(r.get('wm_delta_f1')):>7} {f(r.get('wm_delta_f1_failures')):>8} "
            f"{f(r.get('draft_accuracy')):>9} {f(r.get('admissible_rate')):>7} {f(r.get('success_rate')):>7}"
        )
    return rows


def snapshot(stats: dict, t: float) -> dict:
    """What the cut at an earlier wall time needs: stored counts, the learner's step and tokens."""
    return {
        "t": t,
        "registry": stats.get("registry", {}),
        "written": {k: v.get("written") for k, v in (stats.get("stores") or {}).items()},
        "learner_tokens_total": (stats.get("learner") or {}).get("learner/tokens_total"),
    }


def cut(results: list[dict], progress: list[dict], t0: float, minutes: float) -> dict:
    """The run's figures as they stood ``minutes`` after its start: what a run stopped then would
    have shown (the system never knows its budget), for comparisons at equal wall time."""
    end = t0 + minutes * 60
    snaps = [p for p in progress if p["t"] <= end]
    last = snaps[-1] if snaps else {}
    span = (last.get("t", t0) - t0) or float("nan")
    tokens = next((p["learner_tokens_total"] for p in reversed(snaps) if p.get("learner_tokens_total")), None)
    out = {
        "at_minutes": minutes,
        "learner_step": last.get("registry", {}).get("step"),
        "transitions_per_s": (last.get("written", {}).get("transitions") or 0) / span,
        "learner_tokens_per_s": None if tokens is None else tokens / span,
    } | phase_rates(snaps, COEVOLVE)
    return out | {f"{k}_gain": v for k, v in gains([r for r in results if r.get("ts", end) <= end]).items()}


def phase_rates(snaps: list[dict], phase: str) -> dict:
    """Throughput while the registry said ``phase``, from the first snapshot in it to the last one
    given: where ``async`` and ``rounds`` differ (warm-up is the same in both schedules)."""
    inside = [p for p in snaps if p.get("registry", {}).get("phase") == phase]
    span = inside[-1]["t"] - inside[0]["t"] if len(inside) > 1 else 0.0
    if span <= 0:
        return {f"{phase}_minutes": 0.0, f"{phase}_transitions_per_s": None, f"{phase}_learner_tokens_per_s": None}
    first, last = inside[0], inside[-1]
    moved = (last["written"].get("transitions") or 0) - (first["written"].get("transitions") or 0)
    t0, t1 = first.get("learner_tokens_total"), last.get("learner_tokens_total")
    return {
        f"{phase}_minutes": span / 60,
        f"{phase}_transitions_per_s": moved / span,
        f"{phase}_learner_tokens_per_s": None if t0 is None or t1 is None else (t1 - t0) / span,
    }


def publishes(log_path: Path, t0: float) -> list[dict]:
    """The learner's publishes in a run's ``honcho.log`` (JSON lines): version, phase, step and minutes
    from the start, oldest first (the adapters on disk are rotated; the log keeps every one)."""
    out = []
    try:
        lines = log_path.read_text(errors="replace").splitlines()
    except OSError:
        return out
    for line in lines:
        if '"publish.done"' not in line:
            continue
        try:
            e = json.loads(line[line.index("{") :])
            t = datetime.fromisoformat(e["timestamp"].replace("Z", "+00:00")).timestamp()
        except (ValueError, KeyError):
            continue
        out.append(
            {"version": e.get("version"), "phase": e.get("phase"), "step": e.get("step"), "minutes": (t - t0) / 60}
        )
    return out


def _fmt(v: object) -> str:
    return "n/a" if v is None else f"{v:.3f}" if isinstance(v, float) else str(v)


def report(out: Path, at: list[float]) -> None:
    """Print the table, the throughput line and the gains line from a finished run's ``--out``."""
    meta = json.loads((out / "run.json").read_text())
    results = json.loads((out / "results.json").read_text())
    progress = (
        [json.loads(line) for line in (out / "progress.jsonl").read_text().splitlines() if line.strip()]
        if (out / "progress.jsonl").exists()
        else []
    )
    t0 = meta["t0"]
    for row in table(results, t0):
        print(row)
    published = publishes(out / "honcho.log", t0)
    if published:
        print("published (version@minutes): " + " ".join(f"v{p['version']}@{p['minutes']:.1f}" for p in published))
    first = next((p for p in published if p["phase"] == COEVOLVE), None)
    print(f"first_coevolve_publish_min={_fmt(None if first is None else first['minutes'])}")
    for minutes in at:
        print(" ".join(f"{k}={_fmt(v)}" for k, v in cut(results, progress, t0, minutes).items()))
    summary = json.loads((out / "stats.json").read_text()) if (out / "stats.json").exists() else {}
    tp = summary.get("throughput", {})
    learner = summary.get("learner", {})
    whole = cut(results, progress, t0, meta["minutes"] + 1) if progress else {}  # + the last snapshot's lag
    print(
        f"env_steps_per_s={tp.get('env_steps_per_s')} transitions_per_s={_fmt(whole.get('transitions_per_s'))} "
        f"learner_tokens_per_s_wall={_fmt(whole.get('learner_tokens_per_s'))} "
        f"learner_tokens_per_s_step={learner.get('learner/tokens_per_s')} "
        f"learner_step={meta.get('registry', {}).get('step')} versions={meta.get('registry', {}).get('versions')}"
    )
    g = gains(results)
    print(" ".join(f"{k}_gain={_fmt(v)}" for k, v in g.items()))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--minutes", type=float, default=90.0)
    ap.add_argument("--config", default="configs/local.yaml")
    ap.add_argument("--split", default="valid_seen")
    ap.add_argument("--data", default=None, help="ALFWorld data root holding --split (default: the config's)")
    ap.add_argument("--games", type=int, default=None, help="held-out probe games (default: eval.games)")
    ap.add_argument("--success-games", type=int, default=None, help="held-out success-rate games (eval.success_games)")
    ap.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE")
    ap.add_argument("--run-root", default=str(REPO / "runs"))
    ap.add_argument("--out", default=None, help="where the log, PNGs and results go (default: the run directory)")
    ap.add_argument(
        "--at",
        type=float,
        action="append",
        default=[],
        metavar="MINUTES",
        help="also print the figures as they stood this many minutes in (repeatable)",
    )
    ap.add_argument(
        "--report",
        default=None,
        metavar="OUT_DIR",
        help="print the report of a finished run's --out directory (with --at) and run nothing",
    )
    args = ap.parse_args()
    if args.report:
        report(Path(args.report), args.at)
        return 0

    name = f"curve-{time.strftime('%Y%m%d-%H%M%S')}"
    run_dir = Path(args.run_root) / name
    out = Path(args.out or run_dir)
    out.mkdir(parents=True, exist_ok=True)
    http = free_port()
    port = free_port()
    overrides = [
        f"run.root={args.run_root}",
        f"run.name={name}",
        f"broker.actor_port={free_port()}",
        f"broker.learner_port={free_port()}",
        f"broker.http_port={http}",
        f"inference.port={port}",
        f"inference.endpoints=['http://127.0.0.1:{port}']",
        f"eval.split={args.split}",
    ]
    if args.data:
        overrides.append(f"env.data_dir={args.data}")
    if args.games:
        overrides.append(f"eval.games={args.games}")
    if args.success_games is not None:
        overrides.append(f"eval.success_games={args.success_games}")
    overrides += args.overrides
    env = {
        **os.environ,
        "COMAP_CONFIG": args.config,
        "COMAP_OVERRIDES": shlex.join(overrides),
        "COMAP_LOG_JSON": "1",
        "PYTHONUNBUFFERED": "1",
        "OMP_NUM_THREADS": "1",
    }
    log_path = out / "honcho.log"
    print(f"run {run_dir} for {args.minutes} min; log {log_path}", file=sys.stderr)
    t0 = time.time()
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "honcho", "start", "-f", str(REPO / "Procfile"), "-d", str(REPO)],
            stdout=log,
            stderr=subprocess.STDOUT,
            env=env,
            cwd=REPO,
            start_new_session=True,
        )
    stats: dict = {}
    progress = open(out / "progress.jsonl", "a")
    try:
        deadline = t0 + args.minutes * 60
        last = last_snap = 0.0
        while time.time() < deadline:
            if proc.poll() is not None:
                print(f"honcho exited early with {proc.returncode}; see {log_path}", file=sys.stderr)
                break
            time.sleep(5)
            if time.time() - last_snap > 60:  # a snapshot a minute: figures at any earlier wall time (--at)
                last_snap = time.time()
                try:
                    progress.write(json.dumps(snapshot(_get(http, "/stats"), last_snap)) + "\n")
                    progress.flush()
                except OSError:
                    pass
            if time.time() - last > 300:  # a progress line every 5 minutes
                last = time.time()
                try:
                    s = _get(http, "/stats")
                    print(
                        f"[{(time.time() - t0) / 60:5.1f} min] phase={s['registry']['phase']} "
                        f"versions={s['registry']['versions'].get('policy')} step={s['registry']['step']} "
                        f"evaluated={[e['version'] for e in s.get('eval', [])]}",
                        file=sys.stderr,
                    )
                except OSError:
                    pass
        t_end = time.time()
        try:
            stats = _get(http, "/stats")
            subprocess.run(
                [
                    sys.executable,
                    "-m",
                    "comap_async",
                    "stats",
                    "--plot",
                    str(out),
                    "--config",
                    args.config,
                    *sum((["--set", o] for o in overrides), []),
                ],
                env=env,
                cwd=REPO,
                capture_output=True,
                timeout=120,
            )
            summary = subprocess.run(
                [
                    sys.executable,
                    "-m",
                    "comap_async",
                    "stats",
                    "--json",
                    "--config",
                    args.config,
                    *sum((["--set", o] for o in overrides), []),
                ],
                env=env,
                cwd=REPO,
                capture_output=True,
                text=True,
                timeout=120,
            )
            if summary.returncode == 0:
                (out / "stats.json").write_text(summary.stdout)
        except (OSError, subprocess.TimeoutExpired) as exc:
            print(f"could not read the broker at the end: {exc}", file=sys.stderr)
        if stats:
            progress.write(json.dumps(snapshot(stats, t_end)) + "\n")
    finally:
        progress.close()
        stop_group(proc, 120)
    results = sorted(
        (json.loads(p.read_text()) for p in (run_dir / "eval").glob("v*.json")), key=lambda r: r["version"]
    )
    (out / "results.json").write_text(json.dumps(results, indent=2))
    (out / "run.json").write_text(
        json.dumps(
            {
                "t0": t0,
                "minutes": args.minutes,
                "run_dir": str(run_dir),
                "overrides": overrides,
                "registry": stats.get("registry", {}),
            }
        )
    )
    report(out, args.at)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
