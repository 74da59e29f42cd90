"""The actor process: ``envs`` concurrent episode loops over one environment pool and one outbox.

The phase and adapters come from the registry on the broker's acks. Until the first ack arrives
the actor plays expert episodes: demonstrations are useful in every phase, so nothing is wasted.
Outages of the inference server are retried with backoff and logged once per outage; a broker
outage simply fills the outbox, which pauses the loops (backpressure) until acks resume.
"""

from __future__ import annotations

import asyncio
import os
import random
import socket
import time
from collections import defaultdict
from typing import Any

from actors.episodes import EpisodeContext, EpisodeStats, play_coevolve
from actors.eval_methods import play_method
from actors.expert_play import play_expert, play_reflect_init
from actors.registry_view import RegistryView
from comap_async.envs.pool import EnvPoolExhausted
from comap_async.method.fingerprint import check_method
from comap_async.method.phases import phase_spec
from comap_async.waiting import cancel_and_wait, wait_until_answers
from comap_async.wire.inference_client import affinity
from comap_async.wire.messages import COEVOLVE, POLICY, REFLECT_INIT, WARMUP, Registry

SHUTDOWN_FLUSH_S = 3.0
"""On SIGTERM, how long the actor waits at most for the broker to ack what is queued: ``honcho`` kills 5 s
after SIGTERM; what is still unacked then is logged (and kept in ``actor.spill_dir`` if set)."""


class ActorMetrics:
    """Steps/s, success by adapter version, revision and invalid-action rates (logged periodically)."""

    def __init__(self) -> None:
        self.t0 = time.monotonic()
        self.steps = 0
        self.episodes = 0
        self.by_version: dict[int, list[int]] = defaultdict(lambda: [0, 0])  # version -> [won, played]
        self.revisions = self.invalid = 0
        self.failures = 0
        self.env_restarts = lambda: 0  # the pool's count of replaced environment workers, once it exists

    def add(self, stats: EpisodeStats, version: int) -> None:
        self.steps += stats.steps
        self.episodes += 1
        self.by_version[version][0] += stats.won
        self.by_version[version][1] += 1
        self.revisions += stats.revisions
        self.invalid += stats.invalid

    def summary(self) -> dict[str, Any]:
        dt = max(1e-9, time.monotonic() - self.t0)
        n = max(1, self.steps)
        return {
            "actor/env_restarts": self.env_restarts(),
            "actor/steps_per_s": round(self.steps / dt, 3),
            "actor/episodes": self.episodes,
            "actor/revision_rate": round(self.revisions / n, 4),
            "actor/invalid_rate": round(self.invalid / n, 4),
            "actor/success_by_version": {str(v): round(w / p, 3) for v, (w, p) in sorted(self.by_version.items())},
            "actor/episode_failures": self.failures,
        }


class ActorWorker:
    def __init__(
        self,
        cfg: Any,
        log: Any,
        envs: int | None = None,
        episodes: int | None = None,
        eval_mode: bool = False,
        split: str | None = None,
        games: list | None = None,
        reflection_metrics: bool = False,
        eval_phase: str = COEVOLVE,
        on_step: Any = None,
        eval_method: str = "comap",
        priority: int = 0,
        on_result: Any = None,
        cycle_check: bool = False,
    ) -> None:
        self.cfg, self.log = cfg, log
        self.n_envs = envs or cfg.actor.envs
        self.episode_budget = episodes
        self.eval_mode = eval_mode
        self.reflection_metrics = reflection_metrics  # evaluation: judge every step by two branches
        self.eval_phase = eval_phase  # evaluation plays the CoMap loop, or reflection-mode initialisation
        self.eval_method = eval_method  # evaluation: the CoMap loop or a baseline (actors/eval_methods.py)
        self.priority = priority  # its model calls' priority (the evaluator's: eval.priority; an actor's: 0)
        self.on_step = on_step  # called after every environment step (evaluation's progress bar)
        self.on_result = on_result  # called with (game, stats) as each episode ends (a resumable comparison)
        self.cycle_check = cycle_check  # evaluation: play recurring episodes on, comparing the projection
        self.split = split
        self.games = games
        self.actor_id = f"{socket.gethostname()}-{os.getpid()}-{time.time_ns() % 10**9}"
        self.metrics = ActorMetrics()
        self.results: list[tuple[Any, EpisodeStats]] = []
        self.stop = asyncio.Event()
        self._started = 0
        self._counter = 0
        self._next_game = 0  # fixed games (evaluation): the next one to play
        self._warmup_played = 0
        self._demos_sent = 0  # warm-up's demonstrations from this process
        self._labels_sent = 0  # reflection-mode initialisation's labels from this process
        self.registry = RegistryView()  # replaced in run(): the one view of the broker's registry

    def _claim_episode(self) -> str | None:
        if self.stop.is_set() or (self.episode_budget is not None and self._started >= self.episode_budget):
            return None
        self._started += 1
        self._counter += 1
        return f"{self.actor_id}:e{self._counter}"

    async def _episode_loop(self, ctx: EpisodeContext, pool: Any, games: list, rng: random.Random) -> None:
        env, branch, oracle = pool.env(), None, None
        while (episode_id := self._claim_episode()) is not None:
            affinity.set(episode_id)  # the episode's requests share prefixes: one server's cache holds them
            if not self.eval_mode:  # what the learner trains from this episode must be what it meant
                check_method(self.cfg, self.registry.get().method, "the broker")
            if self.eval_mode or self.games:
                # one cursor for all loops: a loop that finishes its games sooner takes the next game,
                # so each game is played once per pass (a stride per loop replayed some, skipped others)
                game = games[self._next_game % len(games)]
                self._next_game += 1
            else:
                game = rng.choice(games)
            phase, version = self.registry.phase(), self.registry.version(POLICY)
            if not self.eval_mode and self._has_its_share(phase):
                # enough of this phase's data from this process: wait for the learner instead of burning a core
                self._started -= 1
                self._counter -= 1
                await self._idle_until_phase_changes(phase)
                continue
            if phase == WARMUP and not self.eval_mode:
                self._warmup_played += 1
            if not self.eval_mode:
                ctx.llm.client.priority = self._request_priority(phase)
            try:
                if self.eval_mode and self.eval_phase == REFLECT_INIT:  # labels only, nothing trained
                    branch = branch or pool.env()
                    stats = await play_reflect_init(ctx, env, branch, game, episode_id)
                elif self.eval_mode and self.eval_method not in ("comap", "comap_oracle"):
                    stats = await play_method(ctx, env, game, episode_id, self.eval_method)
                elif self.eval_mode:
                    if self.reflection_metrics:
                        branch = branch or pool.env()
                    if self.eval_method == "comap_oracle":  # the draft's true next state, from a third environment
                        oracle = oracle or pool.env()
                    stats = await play_coevolve(
                        ctx, env, game, episode_id, eval_mode=True, branch=branch, oracle=oracle
                    )
                elif phase == WARMUP:
                    if self.cfg.actor.warmup_explore > 0:  # exploratory actions run on a second environment
                        branch = branch or pool.env()
                    stats = await play_expert(ctx, env, game, episode_id, branch=branch)
                elif phase == REFLECT_INIT:
                    branch = branch or pool.env()
                    stats = await play_reflect_init(ctx, env, branch, game, episode_id)
                else:  # a revised step's draft is also taken on the branch: its real next state
                    branch = branch or pool.env()
                    stats = await play_coevolve(ctx, env, game, episode_id, counterfactual=branch)
            except asyncio.CancelledError:
                raise
            except EnvPoolExhausted:  # the environments keep dying: stop the actor, do not spin
                self.metrics.failures += 1
                raise
            except Exception as exc:  # one broken episode must not end the loop; counted and logged
                self.metrics.failures += 1
                self.log.warning("actor.episode_failed", episode=episode_id, game=game.name, error=repr(exc)[:300])
                await asyncio.sleep(1.0)
                continue
            self.metrics.add(stats, version)
            if phase == WARMUP and not self.eval_mode:
                self._demos_sent += stats.demos
            if phase == REFLECT_INIT and not self.eval_mode:
                self._labels_sent += sum(stats.labels.values())
            self.results.append((game, stats))
            if self.on_result is not None:
                self.on_result(game, stats)
            self.log.info(
                "actor.episode",
                episode=episode_id,
                game=game.name,
                phase="eval" if self.eval_mode else phase,
                won=stats.won,
                steps=stats.steps,
                version=version,
                **stats.metrics(),
            )

    def _request_priority(self, phase: str) -> int:
        """The priority of this process's model calls in ``phase``. Reflection-mode initialisation trains on
        the actors' labels alone and waits for them, so their calls rank with the evaluator's
        (``eval.priority``): held behind an evaluation (``inference.priority_hold_s``) they stalled the whole
        run, 2.2 minutes of a 10-minute one (docs/running.md, "A ten-minute try"), not just the actors."""
        own = self.priority
        return min(own, self.cfg.eval.priority) if phase == REFLECT_INIT else own

    def _has_its_share(self, phase: str) -> bool:
        """Whether this process has played its share of ``phase`` (warm-up demonstrations, reflection
        labels): the learner then needs the CPU more than more of the same data."""
        a = self.cfg.actor
        if phase == WARMUP:
            # ...and at least the demonstrations the learner waits for, so one actor alone lets warm-up start
            # (turns form without recovery paths: one per episode, so 100 episodes held the learner for ever)
            need = phase_spec(self.cfg.learner, WARMUP).min_samples
            return self._warmup_played >= a.max_warmup_episodes and self._demos_sent >= need
        if phase == REFLECT_INIT:
            return a.max_reflect_init_labels is not None and self._labels_sent >= a.max_reflect_init_labels
        return False

    async def _idle_until_phase_changes(self, phase: str) -> None:
        if not self.registry.can_refresh:  # no broker to ask (evaluation): nothing to wait for
            self.stop.set()
            return
        try:
            if (await self.registry.refresh()).phase != phase:
                return
        except Exception as exc:  # broker briefly away: ask again on the next round
            self.log.info("actor.waiting", target="broker", reason=str(exc)[:200])
        await asyncio.sleep(5.0)

    async def _report(self) -> None:
        while True:
            await asyncio.sleep(30)
            self.log.info("actor.metrics", **self.metrics.summary())

    async def run(self, outbox: Any = None, registry: Registry | None = None) -> list[tuple[Any, EpisodeStats]]:
        """Play until stopped or out of episodes. ``outbox``: where messages go (default: the
        broker's); ``registry``: fixed adapters (evaluation; default: the broker's, on its acks)."""
        from actors.llm import AgentLLM
        from comap_async.envs import env_pool_from_config, games_from_config, get_next_state
        from comap_async.models import resolve_model
        from comap_async.prompts import Prompts
        from comap_async.wire.inference_client import InferenceClient
        from comap_async.wire.outbox import Outbox

        cfg = self.cfg
        games = self.games or games_from_config(cfg, self.split)
        if not games:
            raise ValueError(f"no games found for split {self.split or cfg.env.split!r}")
        # Tokenizer files only (chat template, decision tokens): actors never load model weights.
        prompts = Prompts.for_model(resolve_model(cfg.model.name_or_path, cfg.model.cache_dir), cfg)
        client = InferenceClient.from_config(cfg, priority=self.priority)
        own_outbox = outbox is None
        outbox = outbox or Outbox.from_config(cfg, log=self.log)
        refresher = None
        if own_outbox:
            from comap_async.wire.broker_client import BrokerClient

            refresher = BrokerClient.from_config(cfg, timeout_s=5.0, retries=2)
        self.registry = RegistryView(fetch=refresher.get_registry if refresher else None)
        self.registry.update(registry)
        llm = AgentLLM(client, prompts, cfg.actor, base_model="", registry=self.registry)
        outbox.on_registry = self.registry.update
        if own_outbox:
            await outbox.start()
            if not self.registry.known:  # the phase before the first ack, from the broker
                self.registry.update(
                    await wait_until_answers("broker", refresher.get_registry, self.log, self.stop, "actor.waiting")
                )
        pool = env_pool_from_config(cfg, workers=cfg.actor.env_workers)
        self.metrics.env_restarts = lambda: pool.restarts
        reporter = asyncio.create_task(self._report())
        try:
            llm.base_model = await self._base_model(client)
            await pool.start()
            ctx = EpisodeContext(
                self.actor_id,
                cfg,
                llm,
                outbox.put,
                get_next_state(cfg.env.name),
                self.registry.get,
                self.on_step,
                self.cycle_check,
            )
            rng = random.Random(f"{cfg.run.seed}-{self.actor_id}")
            loops = [asyncio.create_task(self._episode_loop(ctx, pool, games, rng)) for _ in range(self.n_envs)]
            stopper = asyncio.create_task(self.stop.wait())
            done, _ = await asyncio.wait([stopper, *loops], return_when=asyncio.FIRST_COMPLETED)
            failed = any(t is not stopper and not t.cancelled() and t.exception() is not None for t in done)
            if self.stop.is_set() or failed:  # no new episodes; the running ones get no more time
                ended = await cancel_and_wait(loops)
            else:  # a loop ran out of its episode budget: let the others finish theirs
                ended = await asyncio.gather(*loops, return_exceptions=True)
            stopper.cancel()
            errors = [e for e in ended if isinstance(e, Exception)]
            if errors:  # an episode's own errors are caught in its loop: this is a bug, raise it
                raise errors[0]
            if not own_outbox:
                await outbox.flush(timeout=60)
        finally:
            reporter.cancel()
            if own_outbox:  # first: a broker stopping at the same time drains only briefly
                await outbox.close(flush_timeout=SHUTDOWN_FLUSH_S if self.stop.is_set() else 60.0)
            await pool.close(timeout=1.0 if self.stop.is_set() else 5.0)  # honcho kills 5 s after SIGTERM
            await client.close()
            if refresher is not None:
                await refresher.close()
            self.log.info("actor.done", **self.metrics.summary())
        return self.results

    async def _base_model(self, client: Any) -> str:
        """The served base model's id (the first of /v1/models), once a server answers."""
        models = await wait_until_answers("inference", client.models, self.log, self.stop, "actor.waiting")
        return models[0] if models else ""
