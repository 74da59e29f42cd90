"""Evaluation runs: play a split once with fixed adapters and the action gate, build the report.

Evaluation emits no training samples. It needs an inference server: the configured endpoints,
or, when none answers, an embedded server started for the run and waited for (``serve="auto"``).
The report is built by :mod:`evaluator.eval_report`; ``comap eval`` (:mod:`evaluator.evaluate`) is the
command line over :func:`run_eval`, and the evaluator process (:mod:`evaluator.evaluator`) plays its
games through :func:`play_games`.
"""

from __future__ import annotations

import asyncio
import collections
import os
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from comap_async.lifetime import tied_env
from comap_async.ports import free_port
from comap_async.wire.messages import (
    COEVOLVE,
    POLICY,
    REFLECT_INIT,
    ROLES,
    Episode,
    Registry,
    adapter_name,
    adapter_version,
)
from evaluator.eval_report import label_counts, reflection_summary, summarize


@dataclass(frozen=True)
class EvalSpec:
    """What one evaluation plays and reports."""

    split: str  # train, valid_seen, valid_unseen or valid_train
    games: int | None = None  # N games drawn with run.seed, spread over the task types (None: all)
    adapters: str = "latest"  # a version number, 'latest' (newest in the adapter root) or 'base'
    envs: int | None = None  # concurrent episodes (None: actor.envs)
    reflection_metrics: bool = False  # judge every step by two branches: URR, HRR, BRP
    reflect_init_labels: bool = False  # play reflection-mode initialisation and count its labels instead
    probes: bool = False  # the held-out probes along each game's walkthrough instead of the CoMap loop
    counterfactual: bool = False  # with probes: reflect on each draft under four futures (evaluator.counterfactual)
    method: str = "comap"  # how the agent acts: the CoMap loop or a baseline (comap_async.config.EvalMethod)
    cycle_check: bool = False  # with eval.cycle_stop: play on, recording whether each projection was exact

    def __post_init__(self) -> None:
        from comap_async.config import EVAL_METHODS

        if self.method not in EVAL_METHODS:
            raise ValueError(f"unknown evaluation method {self.method!r}; choose one of {', '.join(EVAL_METHODS)}")
        if self.method != "comap" and (self.reflection_metrics or self.reflect_init_labels or self.probes):
            raise ValueError(
                f"--reflection-metrics, --reflect-init-labels and --probes measure the CoMap loop; "
                f"they do not apply to --method {self.method}"
            )
        if self.counterfactual and not self.probes:
            raise ValueError("--counterfactual is a kind of probe: add --probes")


def resolve_version(spec: str, adapter_root: Path) -> int:
    """'base' -> 0, a number -> itself (must exist), 'latest' -> newest complete version (0 if none)."""
    if spec == "base":
        return 0
    found = {adapter_version(p.name) for p in adapter_root.glob(adapter_name(POLICY, 0).removesuffix("0") + "*")}
    versions = sorted(v for v in found if v and all((adapter_root / adapter_name(r, v)).is_dir() for r in ROLES))
    if spec == "latest":
        return versions[-1] if versions else 0
    if not spec.isdigit():
        raise ValueError(f"--adapters must be a version number, 'latest' or 'base', got {spec!r}")
    if int(spec) not in versions:
        raise ValueError(f"adapter version {spec} not found in {adapter_root} (have: {versions or 'none'})")
    return int(spec)


class _Recorder:
    """Evaluation's outbox: it stores nothing, and counts finished games for the progress bar."""

    def __init__(self, on_game: Callable[[], None] | None) -> None:
        self.on_registry, self.on_game = None, on_game

    async def put(self, msg: Any) -> None:
        if type(msg) is Episode and self.on_game is not None:
            self.on_game()

    async def flush(self, timeout: float | None = None) -> None:
        return None


def evaluation_config(cfg: Any) -> Any:
    """``cfg`` as an evaluation episode plays it: every model call at ``eval.temperature``."""
    t = cfg.eval.temperature
    return cfg.model_copy(update={"actor": cfg.actor.model_copy(update={"temperature": t})})


async def play_games(
    cfg: Any,
    games: list,
    registry: Registry,
    log: Any,
    *,
    envs: int | None = None,
    on_step: Callable[[], None] | None = None,
    on_game: Callable[[], None] | None = None,
    reflection_metrics: bool = False,
    phase: str = COEVOLVE,
    method: str = "comap",
    priority: int = 0,
    on_result: Callable[[Any, Any], None] | None = None,
    cycle_check: bool = False,
) -> list:
    """Play each game once with the adapters ``registry`` names, at ``eval.temperature`` (``phase``: the CoMap loop, or
    reflection-mode initialisation for its labels; ``method``: the CoMap loop or a baseline of
    :mod:`actors.eval_methods`; ``priority``: its model calls', the evaluator's ``eval.priority``); nothing is
    stored. Returns the
    ``(game, EpisodeStats)`` results (``on_result`` is also called with each as its episode ends).
    ``cycle_check``: with ``eval.cycle_stop``, every episode is played to its end and records whether the
    stop's projection was exact (``EpisodeStats.cycle_check``; ``experiments/studies/cycle_stop.py``)."""
    from actors.worker import ActorWorker

    cfg = evaluation_config(cfg)
    worker = ActorWorker(
        cfg,
        log,
        envs=envs,
        episodes=len(games),
        eval_mode=True,
        games=games,
        reflection_metrics=reflection_metrics,
        eval_phase=phase,
        on_step=on_step,
        eval_method=method,
        priority=priority,
        on_result=on_result,
        cycle_check=cycle_check,
    )
    return await worker.run(outbox=_Recorder(on_game), registry=registry)


# ---- the embedded server an evaluation starts for itself ---------------------------------------


class EvalIncomplete(RuntimeError):
    """Some evaluation episodes failed, so the report would cover fewer games than asked for."""


def check_complete(results: list, games: list, what: str = "") -> None:
    """Raise :class:`EvalIncomplete` unless each game has exactly one result: episodes that failed
    (each is logged as ``actor.episode_failed``; its game has no result), or games played twice and
    others never, make a success rate that is not comparable."""
    prefix = f"{what + ': ' if what else ''}"
    if len(results) < len(games):
        raise EvalIncomplete(
            f"{prefix}{len(games) - len(results)} of {len(games)} episodes failed (see the "
            "actor.episode_failed lines); a success rate over the rest would not be comparable"
        )
    played = collections.Counter(game.name for game, _ in results)
    if played != collections.Counter(game.name for game in games):
        asked = {game.name for game in games}
        never = sorted(asked - set(played))
        twice = sorted(name for name, n in played.items() if n > 1)
        other = sorted(set(played) - asked)
        raise EvalIncomplete(
            f"{prefix}the episodes did not play each game once ({len(never)} never played, "
            f"{len(twice)} more than once, {len(other)} not asked for, e.g. {(never + twice + other)[0]}); "
            "a success rate over them would not be comparable"
        )


class ServerStartError(RuntimeError):
    """The inference server started for this evaluation never answered (or exited)."""


def server_command(config: str | None, overrides: list[str], port: int) -> list[str]:
    """The command line of the embedded server an evaluation starts for itself."""
    return [
        sys.executable,
        "-m",
        "comap_async",
        "serve",
        *(["--config", config] if config else []),
        *sum((["--set", o] for o in overrides), []),
        "--set",
        f"inference.port={port}",
    ]


async def wait_for_server(cfg: Any, proc: subprocess.Popen, timeout_s: float, log: Any) -> None:
    """Wait until the server this evaluation started answers ``/v1/models``, as the other processes
    wait for theirs (one ``eval.waiting`` line every 10 s); a server that exits or stays silent for
    ``timeout_s`` raises :class:`ServerStartError` with the reason."""
    from comap_async.waiting import WaitAbandoned, wait_until_answers
    from comap_async.wire.inference_client import InferenceClient

    def exited() -> str | None:
        return (
            None if proc.poll() is None else f"exited with code {proc.returncode} before answering (its log is above)"
        )

    async with InferenceClient.from_config(cfg, retries=0) as client:
        try:
            await wait_until_answers(
                "inference",
                client.models,
                log,
                asyncio.Event(),
                "eval.waiting",
                poll_s=0.5,
                timeout_s=timeout_s,
                gone=exited,
            )
        except WaitAbandoned as exc:
            raise ServerStartError(
                f"the inference server started for this evaluation {exc} (--serve-timeout {timeout_s:.0f} s)"
            ) from None
    log.info("eval.server_ready")


async def server_answers(cfg: Any) -> bool:
    """Whether an inference server answers at the configured endpoints."""
    from comap_async.wire.inference_client import InferenceClient

    client = InferenceClient.from_config(cfg, retries=0)
    try:
        await client.models()
        return True
    except Exception:  # unreachable is an answer here, not an error
        return False
    finally:
        await client.close()


def start_server(config: str | None, overrides: list[str], log: Any) -> tuple[Any, subprocess.Popen]:
    """Start an embedded server on a free port; returns the configuration that points at it and its process."""
    from comap_async.config import load_config

    port = free_port()
    cfg = load_config(
        config, overrides + [f"inference.port={port}", f"inference.endpoints=['http://127.0.0.1:{port}']"]
    )
    # a command killed by a signal runs no finally: the server stops when this process dies
    server = subprocess.Popen(server_command(config, overrides, port), env=tied_env())
    log.info("eval.started_server", port=port, pid=server.pid)
    return cfg, server


def stop_server(server: subprocess.Popen) -> None:
    server.terminate()
    try:
        server.wait(timeout=30)
    except subprocess.TimeoutExpired:
        server.kill()
        server.wait()


# ---- one evaluation ----------------------------------------------------------------------------


async def evaluate(
    cfg: Any, spec: EvalSpec, log: Any, server: subprocess.Popen | None = None, serve_timeout: float = 600.0
) -> dict[str, Any]:
    """Play ``spec`` against the configured inference server (first waiting up to ``serve_timeout``
    for ``server``, when this evaluation started it) and return the report. Raises ValueError for a
    split without games or an unknown adapter version, :class:`ServerStartError` for a server that
    never answered."""
    from comap_async.envs import games_from_config
    from comap_async.envs.base import spread_sample
    from comap_async.wire.inference_client import InferenceClient

    games = games_from_config(
        cfg.model_copy(update={"env": cfg.env.model_copy(update={"max_games": None})}), spec.split
    )
    games = spread_sample(games, spec.games, cfg.run.seed)
    if not games:
        raise ValueError(f"no games in split {spec.split!r}")
    version = resolve_version(spec.adapters, cfg.adapter_root)
    if server is not None:
        await wait_for_server(cfg, server, serve_timeout, log)
    # copies of its own, under names no other process uses: a running learner retires its versions'
    # names two publishes later, and the evaluator serves its own copies under "eval-..."
    registry = Registry.serving(version, prefix=f"cli{os.getpid()}-")
    async with InferenceClient.from_config(cfg) as client:
        for role, name in registry.adapters.items():
            await client.load_adapter(name, str(cfg.adapter_root / adapter_name(role, version)))
    try:
        return await _evaluate_with(cfg, spec, log, games, version, registry)
    finally:
        async with InferenceClient.from_config(cfg) as client:
            for name in registry.adapters.values():
                await client.unload_adapter(name, missing_ok=True)


async def _evaluate_with(
    cfg: Any, spec: "EvalSpec", log: Any, games: list, version: int, registry: Registry
) -> dict[str, Any]:
    from tqdm import tqdm

    bar = tqdm(total=len(games), desc=f"eval {spec.split}", unit="game", file=sys.stderr)
    t0 = time.time()
    steps = [0]

    def on_step() -> None:  # the bar moves with environment steps too: a game can take minutes on a CPU
        steps[0] += 1
        bar.set_postfix_str(f"steps={steps[0]} ({steps[0] / max(time.time() - t0, 1e-9):.2f}/s)")

    if spec.probes:
        from evaluator.probes import run_probes

        try:
            probes = await run_probes(
                cfg,
                games,
                registry,
                log,
                on_game=lambda: bar.update(1),
                on_step=on_step,
                counterfactual=spec.counterfactual,
            )
        finally:
            bar.close()
        return {
            "split": spec.split,
            "adapter_version": version,
            "games": len(games),
            ("counterfactual" if spec.counterfactual else "probes"): probes,
            "wall_s": round(time.time() - t0, 2),
            "game_names": [g.name for g in games],
        }

    try:
        results = await play_games(
            cfg,
            games,
            registry,
            log,
            envs=spec.envs,
            on_step=on_step,
            on_game=lambda: bar.update(1),
            reflection_metrics=spec.reflection_metrics,
            phase=REFLECT_INIT if spec.reflect_init_labels else COEVOLVE,
            method=spec.method,
            cycle_check=spec.cycle_check,
        )
    finally:
        bar.close()
    check_complete(results, games)
    report = {"method": spec.method} | summarize(results, spec.split, version, time.time() - t0)
    if spec.reflect_init_labels:
        report["reflect_init_labels"] = label_counts(results)
    if spec.reflection_metrics:
        judged = [j for _, s in results for j in s.judged_steps]
        report["reflection"] = reflection_summary(judged, cfg.env.max_steps)
    return report


def run_eval(
    cfg: Any,
    spec: EvalSpec,
    log: Any,
    *,
    config: str | None,
    overrides: list[str],
    serve: str = "auto",
    serve_timeout: float = 600.0,
) -> dict[str, Any]:
    """One evaluation from start to report: with ``serve`` ``auto`` (an embedded server when none
    answers), ``always`` or ``never``; a server started here (from ``config`` and ``overrides``, as
    ``cfg`` was loaded) is stopped before this returns. Raises as :func:`evaluate` does."""
    server = None
    if serve != "never":
        reachable = serve == "auto" and asyncio.run(server_answers(cfg))
        if not reachable:
            cfg, server = start_server(config, overrides, log)
    try:
        return asyncio.run(evaluate(cfg, spec, log, server, serve_timeout))
    finally:
        if server is not None:
            stop_server(server)
