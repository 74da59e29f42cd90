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
from collections.abc import Callable
from pathlib import Path
from typing import Any

from actors.eval_report import label_counts, markdown, reflection_summary, summarize
from comap_async.cli import add_config_arguments

ROLES = ("policy", "wm", "wm_teacher")


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_config_arguments(p)
    p.add_argument("--split", required=True, help="train, valid_seen, valid_unseen or valid_train")
    p.add_argument("--games", type=int, default=None,
                   help="evaluate N games drawn with run.seed, spread over the task types (default: all)")
    p.add_argument("--data", default=None, help="ALFWorld data root (default: env.data_dir or $ALFWORLD_DATA)")
    p.add_argument("--adapters", default="latest",
                   help="adapter version to evaluate: a number, 'latest' (newest in the adapter root) or 'base'")
    p.add_argument("--out", required=True, help="directory for eval.json and eval.md")
    p.add_argument("--envs", type=int, default=None, help="concurrent episodes (default: actor.envs)")
    p.add_argument("--reflection-metrics", action="store_true",
                   help="judge every evaluated step by two branches (draft first, reflected action first; the "
                        "game's expert continues both until the episode ends): URR, HRR, BRP")
    p.add_argument("--reflect-init-labels", action="store_true",
                   help="instead of the CoMap loop, play reflection-mode initialisation on the split's walkthrough "
                        "states with these adapters and report the label distribution (y=1, y=0 from equal drafts, "
                        "y=0 from ties or worse); nothing is stored")
    p.add_argument("--probes", action="store_true",
                   help="instead of the CoMap loop, the held-out probes along each game's walkthrough (greedy): "
                        "world-model Delta-F1 on the expert's and on seeded failure transitions, draft accuracy and "
                        "admissible rate; last line wm_delta_f1=X draft_accuracy=Y admissible_rate=Z")
    p.add_argument("--serve", choices=("auto", "never", "always"), default="auto",
                   help="start an embedded inference server for this run: when none answers (auto), never, always")
    p.add_argument("--serve-timeout", type=float, default=600.0, metavar="S",
                   help="how long to wait for the server started for this run to answer (default 600 s: loading a "
                        "model on a busy CPU takes minutes)")


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


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class _Recorder:
    """Evaluation's outbox: it stores nothing, and counts finished games for the progress bar."""

    def __init__(self, registry: dict[str, Any], on_game: Callable[[], None] | None) -> None:
        self.registry, self.on_registry, self.on_game = registry, None, on_game

    async def put(self, msg: dict[str, Any]) -> None:
        if msg["type"] == "episode" and self.on_game is not None:
            self.on_game()

    async def flush(self, timeout: float | None = None) -> None:
        return None


async def play_games(cfg: Any, games: list, registry: dict[str, Any], log: Any, *, envs: int | None = None,
                     on_step: Callable[[], None] | None = None, on_game: Callable[[], None] | None = None,
                     reflection_metrics: bool = False, phase: str = "coevolve") -> list:
    """Play each game once with the adapters ``registry`` names (``phase``: the CoMap loop, or
    reflection-mode initialisation for its labels); nothing is stored. Returns the
    ``(game, EpisodeStats)`` results."""
    from actors.worker import ActorWorker

    worker = ActorWorker(cfg, log, envs=envs, episodes=len(games), eval_mode=True, games=games,
                         reflection_metrics=reflection_metrics, eval_phase=phase, on_step=on_step)
    return await worker.run(outbox=_Recorder(registry, on_game))


class ServerStartError(RuntimeError):
    """The inference server started for this evaluation never answered (or exited)."""


def server_command(args: argparse.Namespace, overrides: list[str], port: int) -> list[str]:
    """The command line of the embedded server an evaluation starts for itself."""
    return [sys.executable, "-m", "comap_async", "serve", *(["--config", args.config] if args.config else []),
            *sum((["--set", o] for o in overrides), []), "--set", f"inference.port={port}"]


async def wait_for_server(cfg: Any, proc: subprocess.Popen, timeout_s: float, log: Any) -> None:
    """Wait until the server this evaluation started answers ``/v1/models``, as the other processes
    wait for theirs (one ``eval.waiting`` line every 10 s); a server that exits or stays silent for
    ``timeout_s`` raises :class:`ServerStartError` with the reason."""
    from comap_async.wire.inference_client import InferenceClient
    from comap_async.waiting import WaitAbandoned, wait_until_answers

    def exited() -> str | None:
        return None if proc.poll() is None else f"exited with code {proc.returncode} before answering (its log is above)"

    async with InferenceClient.from_config(cfg, retries=0) as client:
        try:
            await wait_until_answers("inference", client.models, log, asyncio.Event(), "eval.waiting", poll_s=0.5,
                                     timeout_s=timeout_s, gone=exited)
        except WaitAbandoned as exc:
            raise ServerStartError(f"the inference server started for this evaluation {exc} (--serve-timeout "
                                   f"{timeout_s:.0f} s)") from None
    log.info("eval.server_ready")


async def _evaluate(cfg: Any, args: argparse.Namespace, log: Any, server: subprocess.Popen | None = None) -> dict[str, Any]:
    from tqdm import tqdm

    from comap_async.envs import games_from_config
    from comap_async.envs.base import spread_sample
    from comap_async.wire.inference_client import InferenceClient

    games = games_from_config(cfg.model_copy(update={"env": cfg.env.model_copy(update={"max_games": None})}), args.split)
    games = spread_sample(games, args.games, cfg.run.seed)
    if not games:
        raise ValueError(f"no games in split {args.split!r}")
    version = resolve_version(args.adapters, cfg.adapter_root)
    if server is not None:
        await wait_for_server(cfg, server, args.serve_timeout, log)
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

    bar = tqdm(total=len(games), desc=f"eval {args.split}", unit="game", file=sys.stderr)
    t0 = time.time()
    steps = [0]

    def on_step() -> None:  # the bar moves with environment steps too: a game can take minutes on a CPU
        steps[0] += 1
        bar.set_postfix_str(f"steps={steps[0]} ({steps[0] / max(time.time() - t0, 1e-9):.2f}/s)")

    if args.probes:
        from actors.probes import run_probes

        try:
            probes = await run_probes(cfg, games, registry, log, on_game=lambda: bar.update(1), on_step=on_step)
        finally:
            bar.close()
        return {"split": args.split, "adapter_version": version, "games": len(games), "probes": probes,
                "wall_s": round(time.time() - t0, 2), "game_names": [g.name for g in games]}

    try:
        results = await play_games(cfg, games, registry, log, envs=args.envs, on_step=on_step,
                                             on_game=lambda: bar.update(1), reflection_metrics=args.reflection_metrics,
                                             phase="reflect_init" if args.reflect_init_labels else "coevolve")
    finally:
        bar.close()
    report = summarize(results, args.split, version, time.time() - t0)
    if args.reflect_init_labels:
        report["reflect_init_labels"] = label_counts(results)
    if args.reflection_metrics:
        judged = [j for _, s in results for j in s.judged_steps]
        report["reflection"] = reflection_summary(judged, cfg.env.max_steps)
    return report


def run(args: argparse.Namespace) -> int:
    from comap_async.config import load_config
    from comap_async.logsetup import configure_logging

    overrides = list(args.overrides) + ([f"env.data_dir={args.data}"] if args.data else [])
    cfg = load_config(args.config, overrides)
    log = configure_logging("eval", run=cfg.run.name)
    server = None
    if args.serve != "never":
        from comap_async.wire.inference_client import InferenceClient

        reachable = args.serve == "auto" and asyncio.run(_probe(InferenceClient.from_config(cfg, retries=0)))
        if not reachable:
            port = _free_port()
            cfg = load_config(args.config, overrides + [f"inference.port={port}",
                                                        f"inference.endpoints=['http://127.0.0.1:{port}']"])
            server = subprocess.Popen(server_command(args, overrides, port))
            log.info("eval.started_server", port=port, pid=server.pid)
    try:
        report = asyncio.run(_evaluate(cfg, args, log, server))
    except (ValueError, ServerStartError) as exc:  # bad split, unknown version, no server: one clear line
        print(f"comap eval: error: {exc}", file=sys.stderr)
        return 2
    finally:
        if server is not None:
            server.terminate()
            try:
                server.wait(timeout=30)
            except subprocess.TimeoutExpired:
                server.kill()
                server.wait()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "eval.json").write_text(json.dumps(report, indent=2))
    if "probes" in report:
        from actors.probes import probe_line

        log.info("eval.done", out=str(out), **{k: v for k, v in report["probes"].items() if not isinstance(v, list)})
        print(probe_line(report["probes"]))
        return 0
    (out / "eval.md").write_text(markdown(report))
    print(markdown(report).split("\n\n")[1])
    if "reflect_init_labels" in report:
        from comap_async.commands.stats import label_line

        print("reflect_init " + label_line(report["reflect_init_labels"]))
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
