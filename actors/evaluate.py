"""``comap eval``: run a split once with fixed adapters and the action gate; write JSON + Markdown.

Evaluation emits no training samples. It needs an inference server: the configured endpoints,
or, when none answers, an embedded server started for the run (``--serve auto``, the default).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from comap_async.cli import add_config_arguments

ROLES = ("policy", "wm", "wm_teacher")


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_config_arguments(p)
    p.add_argument("--split", required=True, help="train, valid_seen, valid_unseen or valid_train")
    p.add_argument("--games", type=int, default=None, help="evaluate the first N games of the split (default: all)")
    p.add_argument("--data", default=None, help="ALFWorld data root (default: env.data_dir or $ALFWORLD_DATA)")
    p.add_argument("--adapters", default="latest",
                   help="adapter version to evaluate: a number, 'latest' (newest in the adapter root) or 'base'")
    p.add_argument("--out", required=True, help="directory for eval.json and eval.md")
    p.add_argument("--envs", type=int, default=None, help="concurrent episodes (default: actor.envs)")
    p.add_argument("--reflection-metrics", action="store_true",
                   help="judge every revision the reflection proposes by two suffix rollouts (refined vs draft "
                        "first, expert continuation for actor.suffix_horizon steps): URR, HRR, BRP")
    p.add_argument("--serve", choices=("auto", "never", "always"), default="auto",
                   help="start an embedded inference server for this run: when none answers (auto), never, always")


def resolve_version(spec: str, adapter_root: Path) -> int:
    """'base' -> 0, a number -> itself (must exist), 'latest' -> newest complete version (0 if none)."""
    if spec == "base":
        return 0
    versions = sorted({int(p.name.rsplit("-v", 1)[1]) for p in adapter_root.glob("policy-v*")
                       if p.name.rsplit("-v", 1)[1].isdigit() and all((adapter_root / f"{r}-v{p.name.rsplit('-v', 1)[1]}").is_dir() for r in ROLES)})
    if spec == "latest":
        return versions[-1] if versions else 0
    if not spec.isdigit():
        raise ValueError(f"--adapters must be a version number, 'latest' or 'base', got {spec!r}")
    if int(spec) not in versions:
        raise ValueError(f"adapter version {spec} not found in {adapter_root} (have: {versions or 'none'})")
    return int(spec)


def reflection_summary(outcomes: list[tuple[bool, str]], horizon: int) -> dict[str, Any]:
    """URR, HRR, BRP from judged revisions ``(executed by the action gate, suffix outcome)``.

    Our reading of the paper's reflection metrics (its appendix C.2 text was not available to us;
    the counts are reported too, so other definitions can be computed from them):
    URR, useful revision rate: executed revisions whose suffix does better than the draft's;
    HRR, harmful revision rate: executed revisions whose suffix does worse;
    BRP, beneficial revision pass rate: of the proposed revisions that would do better, the
    share the action gate executed. ``None`` where the denominator is zero.
    """
    counts = {f"{side}_{o}": 0 for side in ("executed", "blocked") for o in ("better", "worse", "same")}
    for executed, outcome in outcomes:
        counts[f"{'executed' if executed else 'blocked'}_{outcome}"] += 1
    executed = counts["executed_better"] + counts["executed_worse"] + counts["executed_same"]
    beneficial = counts["executed_better"] + counts["blocked_better"]

    def rate(num: int, den: int) -> float | None:
        return num / den if den else None

    return {"proposed": len(outcomes), "executed": executed, **counts,
            "urr": rate(counts["executed_better"], executed), "hrr": rate(counts["executed_worse"], executed),
            "brp": rate(counts["executed_better"], beneficial), "suffix_horizon": horizon}


def summarize(results: list[tuple[Any, Any]], split: str, version: int, wall_s: float) -> dict[str, Any]:
    n = len(results)
    steps = [s.steps for _, s in results]
    total_steps = max(1, sum(steps))
    f1 = [x for _, s in results for x in s.delta_f1]
    return {
        "split": split, "adapter_version": version, "games": n,
        "success_rate": sum(s.won for _, s in results) / n if n else 0.0,
        "mean_steps": sum(steps) / n if n else 0.0,
        "delta_f1": sum(f1) / len(f1) if f1 else None,
        "delta_f1_transitions": len(f1),
        "revision_rate": sum(s.revisions for _, s in results) / total_steps,
        "invalid_action_rate": sum(s.invalid for _, s in results) / total_steps,
        "wall_s": round(wall_s, 2),
        "episodes": [{"game": g.name, "task_type": g.task_type, "won": s.won, "steps": s.steps,
                      "revisions": s.revisions, "invalid": s.invalid} for g, s in results],
    }


def markdown(report: dict[str, Any]) -> str:
    f1 = "n/a" if report["delta_f1"] is None else f"{report['delta_f1']:.3f}"

    def num(x: float | None) -> str:
        return "n/a" if x is None else f"{x:.3f}"

    rows = [
        f"# Evaluation: {report['split']} (adapters v{report['adapter_version']})", "",
        "| games | success rate | mean steps | world-model Delta-F1 | revision rate | invalid-action rate |",
        "| ---: | ---: | ---: | ---: | ---: | ---: |",
        f"| {report['games']} | {report['success_rate']:.3f} | {report['mean_steps']:.1f} | {f1} | "
        f"{report['revision_rate']:.3f} | {report['invalid_action_rate']:.3f} |", "",
        "| game | won | steps | revisions |", "| --- | :---: | ---: | ---: |",
    ]
    rows += [f"| {e['game']} | {'yes' if e['won'] else 'no'} | {e['steps']} | {e['revisions']} |" for e in report["episodes"]]
    r = report.get("reflection")
    if r is not None:
        rows += ["", f"Reflection (suffix rollouts, horizon {r['suffix_horizon']}):", "",
                 "| proposed | executed | URR | HRR | BRP |", "| ---: | ---: | ---: | ---: | ---: |",
                 f"| {r['proposed']} | {r['executed']} | {num(r['urr'])} | {num(r['hrr'])} | {num(r['brp'])} |"]
    return "\n".join(rows) + "\n"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def _evaluate(cfg: Any, args: argparse.Namespace, log: Any) -> dict[str, Any]:
    from tqdm import tqdm

    from actors.episodes import EpisodeStats
    from actors.worker import ActorWorker
    from comap_async.envs import games_from_config
    from comap_async.inference.client import InferenceClient

    games = games_from_config(cfg.model_copy(update={"env": cfg.env.model_copy(update={"max_games": None})}), args.split)
    games = sorted(games, key=lambda g: g.name)[: args.games or None]
    if not games:
        raise ValueError(f"no games in split {args.split!r}")
    version = resolve_version(args.adapters, cfg.adapter_root)
    client = InferenceClient.from_config(cfg)
    try:
        if version:
            for role in ROLES:
                name = f"{role}-v{version}"
                if name not in await client.models():
                    await client.load_adapter(name, str(cfg.adapter_root / name))
    finally:
        await client.close()
    registry = {"phase": "coevolve", "versions": {r: version for r in ROLES},
                "adapters": {r: f"{r}-v{version}" for r in ROLES} if version else {}, "step": 0}

    class _Recorder:  # evaluation keeps its episode records locally instead of the broker's outbox
        def __init__(self) -> None:
            self.registry, self.on_registry, self.messages = registry, None, []

        async def put(self, msg: dict[str, Any]) -> None:
            self.messages.append(msg)
            if msg["type"] == "episode":
                bar.update(1)

        async def flush(self, timeout: float | None = None) -> None:
            return None

    bar = tqdm(total=len(games), desc=f"eval {args.split}", unit="game", file=sys.stderr)
    worker = ActorWorker(cfg, log, envs=args.envs, episodes=len(games), eval_mode=True, split=args.split, games=games,
                         reflection_metrics=args.reflection_metrics)
    t0 = time.time()
    try:
        results: list[tuple[Any, EpisodeStats]] = await worker.run(outbox=_Recorder())
    finally:
        bar.close()
    report = summarize(results, args.split, version, time.time() - t0)
    if args.reflection_metrics:
        outcomes = [o for _, s in results for o in s.revision_outcomes]
        report["reflection"] = reflection_summary(outcomes, cfg.actor.suffix_horizon)
    return report


def run(args: argparse.Namespace) -> int:
    from comap_async.config import load_config
    from comap_async.logsetup import configure_logging

    overrides = list(args.overrides) + ([f"env.data_dir={args.data}"] if args.data else [])
    cfg = load_config(args.config, overrides)
    log = configure_logging("eval", run=cfg.run.name)
    server = None
    if args.serve != "never":
        from comap_async.inference.client import InferenceClient

        reachable = args.serve == "auto" and asyncio.run(_probe(InferenceClient.from_config(cfg)))
        if not reachable:
            port = _free_port()
            cfg = load_config(args.config, overrides + [f"inference.port={port}",
                                                        f"inference.endpoints=['http://127.0.0.1:{port}']"])
            server = subprocess.Popen([sys.executable, "-m", "comap_async", "serve", *(["--config", args.config] if args.config else []),
                                       *sum((["--set", o] for o in overrides), []), "--set", f"inference.port={port}"])
            log.info("eval.started_server", port=port, pid=server.pid)
    try:
        report = asyncio.run(_evaluate(cfg, args, log))
    except ValueError as exc:  # bad split, no games, unknown adapter version: the user's to fix
        print(f"comap eval: error: {exc}", file=sys.stderr)
        return 2
    finally:
        if server is not None:
            server.terminate()
            server.wait(timeout=30)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "eval.json").write_text(json.dumps(report, indent=2))
    (out / "eval.md").write_text(markdown(report))
    print(markdown(report).split("\n\n")[1])
    log.info("eval.done", out=str(out), success_rate=report["success_rate"], games=report["games"])
    return 0


async def _probe(client: Any) -> bool:
    """Whether an inference server answers at the configured endpoints (closes the client)."""
    try:
        await client.models()
        return True
    except Exception:  # unreachable is an answer here, not an error
        return False
    finally:
        await client.close()
