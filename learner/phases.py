"""When the learner's phases start and end: the stores each waits for, its step budget (sized by the
data held when it starts), its torch threads, and the step that switches to the next phase.

A mixin of :class:`learner.loop.Learner`, kept apart so the loop reads as fetch, learn, publish; it uses
the learner's ``cfg``, ``state`` (:class:`learner.loop.LearnerState`), ``trainer``, ``dp``, ``log``,
``stop`` and ``actors_quiet``.
"""

from __future__ import annotations

import asyncio
import math
import time
from typing import Any

from comap_async.method.routing import after_warmup
from comap_async.wire.messages import COEVOLVE, REFLECT_INIT, WARMUP
from learner.threads import QUIET_STORE, own_threads, phase_threads


class PhaseControl:
    def next_phase(self) -> str | None:
        """The phase to switch to after this step, or None to stay."""
        lc, s, step = self.cfg.learner, self.state, self.trainer.step
        limit = {WARMUP: lc.warmup_max_minutes, REFLECT_INIT: lc.reflect_init_max_minutes}.get(s.phase)
        out_of_time = limit is not None and s.phase_seconds >= 60 * limit
        if s.phase == WARMUP and (step - s.phase_start >= (s.phase_budget or lc.warmup_steps) or out_of_time):
            return after_warmup(self.cfg)
        if s.phase == REFLECT_INIT and (
            step - s.phase_start >= (s.phase_budget or lc.reflect_init_steps) or out_of_time
        ):
            return COEVOLVE
        return None

    def _publish_every(self) -> int:
        """Steps between publishes in the current phase (never in warm-up unless configured)."""
        lc = self.cfg.learner
        if self.state.phase == WARMUP:
            return lc.warmup_publish_every or 1 << 62
        return lc.publish_every

    async def wait_for_store(self, broker: Any, store: str, key: str, need: int, event: str) -> int | None:
        """Poll the broker's stats until ``stores[store][key] >= need`` (one log line per 10 s);
        returns the value reached, or None when stopping."""
        last = 0.0
        while not self.stop.is_set():
            have = (await broker.get_stats())["stores"][store][key]
            if have >= need:
                return have
            if time.monotonic() - last > 10:
                self.log.info(event, store=store, have=have, need=need)
                last = time.monotonic()
            await asyncio.sleep(1.0)
        return None

    @property
    def global_batch(self) -> int:
        """Samples one optimizer step trains on, over every rank (a budget's unit)."""
        lc = self.cfg.learner
        return lc.batch_size * lc.grad_accum * (self.dp.world if self.dp is not None else 1)

    @property
    def reflect_init_batch(self) -> int:
        """Reflection samples per micro-batch of reflection-mode initialisation."""
        lc = self.cfg.learner
        return lc.reflect_init_batch_size or lc.batch_size

    def follow_budget(self, phase: str) -> None:
        """Enter ``phase`` with the step budget just sized from the broker's counts, rank 0's on every
        rank (the ranks read the counts at slightly different moments)."""
        if self.dp is not None:
            self.state.phase_budget = self.dp.follow(self.state.phase_budget)
        self.trainer.scheduler.enter(phase, self.state.phase_start, self.state.phase_budget)

    async def follow_threads(self, phase: str, broker: Any) -> int:
        """Set the phase's torch threads (:func:`~learner.threads.phase_threads`) before a step; returns
        them. A phase's own threads wait until its store (episodes, labels) has stopped growing for a while."""
        import torch

        quiet = True
        if own_threads(self.cfg, phase) is not None:
            written = (await broker.get_stats())["stores"][QUIET_STORE[phase]]["written"]
            # keyed by phase: a new phase's store starts its own window, whatever its count
            quiet = self.actors_quiet.update((phase, written), time.monotonic())
        threads = phase_threads(self.cfg, phase, quiet)
        if torch.get_num_threads() != threads:
            torch.set_num_threads(threads)
            self.log.info("learner.threads", phase=phase, threads=threads)
        return threads

    async def wait_for_demos(self, broker: Any) -> None:
        """Warm-up starts once the broker holds ``warmup_min_demos`` demonstrations."""
        demos = await self.wait_for_store(
            broker, "demos", "count", self.cfg.learner.warmup_min_demos, "learner.waiting_for_demos"
        )
        lc = self.cfg.learner
        if demos is not None and lc.warmup_epochs is not None and self.state.phase_budget is None:
            # sized by the data there is when training starts: later demonstrations only add variety
            self.state.phase_budget = max(lc.warmup_steps, math.ceil(lc.warmup_epochs * demos / self.global_batch))
            self.follow_budget(WARMUP)
            self.log.info("learner.warmup_budget", demos=demos, epochs=lc.warmup_epochs, steps=self.state.phase_budget)

    async def wait_for_reflections(self, broker: Any) -> int | None:
        """``reflect_init`` trains once the broker holds ``reflect_init_min_samples`` reflection
        samples: the actors start labelling them only when the phase is announced. With
        ``reflect_init_epochs`` the phase's budget is then sized by the samples held."""
        lc = self.cfg.learner
        have = await self.wait_for_store(
            broker, "reflections", "count", lc.reflect_init_min_samples, "learner.waiting_for_reflections"
        )
        if have is not None and lc.reflect_init_epochs is not None and self.state.phase_budget is None:
            per_step = self.global_batch // lc.batch_size * self.reflect_init_batch
            self.state.phase_budget = max(lc.reflect_init_steps, math.ceil(lc.reflect_init_epochs * have / per_step))
            self.follow_budget(REFLECT_INIT)
            self.log.info(
                "learner.reflect_init_budget",
                samples=have,
                epochs=lc.reflect_init_epochs,
                steps=self.state.phase_budget,
            )
        return have

    async def wait_for_round(self, broker: Any) -> None:
        """``rounds`` schedule: block until the actors finished ``rounds_episodes`` new episodes."""
        need = self.state.round_episodes + self.cfg.learner.rounds_episodes
        written = await self.wait_for_store(broker, "episodes", "written", need, "learner.waiting_for_round")
        if written is not None:
            self.state.round_episodes = written
