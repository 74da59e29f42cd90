"""``comap evaluator``: held-out figures for every adapter version, while the system runs.

A process beside the actors (a ``Procfile`` line): it asks the broker for the registry, and for
the base model once and then every published version (the newest when it falls behind:
:data:`MAX_PENDING`) it runs the probes on ``eval.games`` games of ``eval.split`` and the full
CoMap loop on ``eval.success_games`` of them. Each result goes to ``<run dir>/eval/v<N>.json``,
to the broker (``comap stats`` shows it, ``--plot`` draws it) and to TensorBoard (``eval/...``).

It loads each version's adapters under names of its own (``eval-policy-v<N>``...), so the learner
retiring that version from the servers mid-evaluation changes nothing, and it stops on SIGTERM.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import signal
import time
from pathlib import Path
from typing import Any

from comap_async.cli import add_config_arguments
from comap_async.wire.messages import ROLES, Registry, adapter_name

EVAL_PREFIX = "eval-"  # the evaluator serves its own copies of a version's adapters: a publish may retire the learner's
MAX_PENDING = 2
"""When more versions than this wait for evaluation (the learner publishes faster than the evaluator
measures), the newest is evaluated next and the ones between are skipped."""
POLL_S = 5.0
"""How often the evaluator asks the broker for a new version when none waits."""

SCALARS = (
    "wm_delta_f1",
    "wm_delta_f1_failures",
    "draft_accuracy",
    "executed_accuracy",
    "admissible_rate",
    "success_rate",
    "reflection_problem_rate",
    "unreadable_rate",
    "gate_open_rate",
    "p_discrimination",
    "p_auc",
    "confidence_auc",
    "loop_rate",
)


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_config_arguments(p)
    p.add_argument("--once", action="store_true", help="evaluate the pending versions once and exit (tests, scripts)")


def next_version(done: set[int], published: list[int], max_pending: int = MAX_PENDING) -> int | None:
    """The version to evaluate now: the base model (0) first, then the oldest published version newer
    than anything evaluated; the newest instead when more than ``max_pending`` are waiting (the
    evaluator fell behind the learner: the ones between are skipped). None when there is nothing to do."""
    if 0 not in done:
        return 0
    newest_done = max(done)
    pending = sorted(v for v in published if v > newest_done)
    if not pending:
        return None
    return pending[-1] if len(pending) > max_pending else pending[0]


def rest_after(seconds: float, max_share: float | None) -> float:
    """How long to rest after an evaluation of ``seconds`` so evaluating takes at most ``max_share`` of the
    wall clock (``eval.max_share``; 0 when unset)."""
    return 0.0 if max_share is None else seconds * (1.0 / max_share - 1.0)


def published_versions(adapter_root: Path, current: int) -> list[int]:
    """Versions up to ``current`` whose three adapters are on disk (the learner keeps the files)."""
    return [v for v in range(1, current + 1) if all((adapter_root / adapter_name(r, v)).is_dir() for r in ROLES)]


def done_versions(eval_dir: Path) -> set[int]:
    """Versions already evaluated in this run directory (a restarted evaluator does not repeat them)."""
    return {int(p.stem[1:]) for p in eval_dir.glob("v*.json") if p.stem[1:].isdigit()}


class ScalarWriter:
    """TensorBoard scalars without torch (the evaluator is an actor-side process: no torch import)."""

    def __init__(self, logdir: Path) -> None:
        from tensorboard.summary.writer.event_file_writer import EventFileWriter

        self.writer = EventFileWriter(str(logdir), filename_suffix=".evaluator")

    def add(self, tag: str, value: float, step: int) -> None:
        from tensorboard.compat.proto.event_pb2 import Event
        from tensorboard.compat.proto.summary_pb2 import Summary

        self.writer.add_event(
            Event(
                wall_time=time.time(),
                step=step,
                summary=Summary(value=[Summary.Value(tag=tag, simple_value=float(value))]),
            )
        )

    def close(self) -> None:
        self.writer.flush()
        self.writer.close()


class Evaluator:
    def __init__(self, cfg: Any, log: Any, prefix: str = EVAL_PREFIX) -> None:
        self.cfg, self.log = cfg, log
        self.prefix = prefix
        """Of the adapter names it loads: another measurement beside it (a benchmark) takes its own."""
        self.stop = asyncio.Event()
        self.eval_dir = cfg.run.dir / "eval"
        self.results: list[dict[str, Any]] = []

    @functools.cached_property
    def games(self) -> tuple[list, list]:
        """(probe games, success games): seeded, task-spread samples of the split, the same for every
        version (the split is read once). Both are drawn from the whole split, so ``eval.success_games``
        above ``eval.games`` plays that many games (a draw is the prefix of a larger one with the same
        seed: the probe games are among the success games, or the other way round)."""
        from comap_async.envs import games_from_config
        from comap_async.envs.base import spread_sample

        e = self.cfg.eval
        cfg = self.cfg.model_copy(update={"env": self.cfg.env.model_copy(update={"max_games": None})})
        split = games_from_config(cfg, e.split)
        games = spread_sample(split, e.games, self.cfg.run.seed)
        if not games:
            raise ValueError(f"no games in split {e.split!r}")
        return games, spread_sample(split, e.success_games, self.cfg.run.seed) if e.success_games else []

    @functools.cached_property
    def playing_config(self) -> Any:
        """The config its probes and games run under: ``eval.envs`` games at once (their model calls carry
        ``eval.priority``, passed to each)."""
        return self.cfg.model_copy(update={"actor": self.cfg.actor.model_copy(update={"envs": self.cfg.eval.envs})})

    async def evaluate(
        self, client: Any, version: int, registry: dict[str, Any], adapter_dir: Path | None = None
    ) -> dict[str, Any]:
        """``adapter_dir``: where the version's adapters are (default the run's adapter root; inside it)."""
        from comap_async.waiting import cancel_and_wait
        from evaluator.eval_report import summarize
        from evaluator.eval_runner import EvalIncomplete, check_complete, play_games
        from evaluator.probes import run_probes

        eval_registry = Registry.serving(version, prefix=self.prefix)
        names = dict(eval_registry.adapters)
        for role, name in names.items():
            await client.load_adapter(name, str((adapter_dir or self.cfg.adapter_root) / adapter_name(role, version)))
        t0 = time.time()
        cfg = self.playing_config
        probe_games, success_games = self.games

        async def probes() -> dict[str, Any]:
            part = await run_probes(
                cfg,
                probe_games,
                eval_registry,
                self.log,
                failures_per_game=self.cfg.eval.failures_per_game,
                priority=self.cfg.eval.priority,
            )
            return part | {"probe_s": round(time.time() - t0, 1)}

        async def games() -> list | None:
            if not success_games:
                return None
            return await play_games(
                cfg,
                success_games,
                eval_registry,
                self.log,
                envs=self.cfg.eval.envs,
                method=self.cfg.eval.method,
                priority=self.cfg.eval.priority,
            )

        try:
            # the probes beside the games: the longest game sets the time; the probes fill its batches
            both = [asyncio.ensure_future(probes()), asyncio.ensure_future(games())]
            try:
                probe_part, played = await asyncio.gather(*both)
            except BaseException:  # the first error as it was raised, the other part stopped
                await cancel_and_wait(both)
                raise
            result: dict[str, Any] = {
                "version": version,
                "adapters": names,
                "phase": registry.get("phase"),
                "learner_step": registry.get("step", 0),
                "split": self.cfg.eval.split,
                **probe_part,
            }
            if played is not None:
                try:  # a game that crashed is not a lost game: a rate over the rest would read as a lower one
                    check_complete(played, success_games, f"version {version}'s success games")
                except EvalIncomplete as exc:
                    self.log.error("evaluator.incomplete", version=version, error=str(exc))
                    result["success_error"] = str(exc)  # no success_rate for this version
                else:
                    s = summarize(played, self.cfg.eval.split, version, 0.0)
                    result |= {
                        "method": self.cfg.eval.method,
                        "success_rate": s["success_rate"],
                        "success_games": s["games"],
                        "mean_steps": s["mean_steps"],
                        "invalid_action_rate": s["invalid_action_rate"],
                        "loop_rate": s["loop_rate"],
                        "cycle_projected_steps": s["cycle_projected_steps"],
                        "coevolve_delta_f1": s["delta_f1"],
                    }
        finally:
            for name in names.values():
                await client.unload_adapter(name, missing_ok=True)
        result |= {"eval_s": round(time.time() - t0, 1), "ts": time.time()}
        return result

    def record(self, result: dict[str, Any], scalars: ScalarWriter | None) -> None:
        self.eval_dir.mkdir(parents=True, exist_ok=True)
        path = self.eval_dir / f"v{result['version']}.json"
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(result, indent=2))
        tmp.replace(path)
        if scalars is not None:
            for key in SCALARS:
                if result.get(key) is not None:
                    scalars.add(f"eval/{key}", result[key], result["version"])
        self.results.append(result)
        self.log.info("evaluator.result", **{k: v for k, v in result.items() if not isinstance(v, (dict, list))})

    async def run(self, once: bool = False) -> int:
        from comap_async.waiting import until_stopped, wait_until_answers
        from comap_async.wire.broker_client import BrokerClient
        from comap_async.wire.inference_client import InferenceClient

        done = done_versions(self.eval_dir)
        scalars = ScalarWriter(self.cfg.run.dir / "tensorboard")
        async with BrokerClient.from_config(self.cfg) as broker, InferenceClient.from_config(self.cfg) as client:
            try:
                registry = await wait_until_answers(
                    "broker", broker.get_registry, self.log, self.stop, "evaluator.waiting"
                )
                if (
                    registry is None
                    or await wait_until_answers("inference", client.models, self.log, self.stop, "evaluator.waiting")
                    is None
                ):
                    return 0
                while not self.stop.is_set():
                    try:
                        registry = await broker.get_registry()
                    except Exception as exc:  # the broker restarting: ask again on the next round
                        self.log.info("evaluator.waiting", target="broker", reason=str(exc)[:200])
                        registry = None
                    current = int(((registry or {}).get("versions") or {}).get("policy", 0))
                    version = (
                        None
                        if registry is None
                        else next_version(done, published_versions(self.cfg.adapter_root, current))
                    )
                    if version is None:
                        if once:
                            return 0
                        await self._sleep(POLL_S)
                        continue
                    started = time.monotonic()
                    finished, result = await until_stopped(self.evaluate(client, version, registry), self.stop)
                    if not finished:
                        self.log.info("evaluator.abandoned", version=version)
                        break
                    self.record(result, scalars)
                    await broker.report_eval(version, result)
                    done.add(version)
                    rest = rest_after(time.monotonic() - started, self.cfg.eval.max_share)
                    if rest > 0 and not once:
                        self.log.info("evaluator.resting", seconds=round(rest, 1), max_share=self.cfg.eval.max_share)
                        await self._sleep(rest)
            finally:
                scalars.close()
        return 0

    async def _sleep(self, seconds: float) -> None:
        try:
            await asyncio.wait_for(self.stop.wait(), seconds)
        except TimeoutError:
            pass


def run(args: argparse.Namespace) -> int:
    from comap_async.config import load_config
    from comap_async.logsetup import configure_logging
    from comap_async.priority import lower_priority, niceness

    cfg = load_config(args.config, args.overrides)
    log = configure_logging("evaluator", run=cfg.run.name)
    if nice := niceness(cfg, "evaluator"):
        log.info("evaluator.priority", niceness=lower_priority(nice))
    evaluator = Evaluator(cfg, log)

    async def main() -> int:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, evaluator.stop.set)
        return await evaluator.run(once=args.once)

    return asyncio.run(main())
