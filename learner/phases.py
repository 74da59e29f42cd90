"""When the learner's phases start and end: the stores each waits for, its step budget (sized by the
data held when it starts), its torch threads, and the step that switches to the next phase.

A mixin of :class:`learner.loop.Learner`, kept apart so the loop reads as fetch, learn, publish; it uses
the learner's ``cfg``, ``state`` (:class:`learner.loop.LearnerState`), ``trainer``, ``dp``, ``log``,
``stop`` and ``actors_quiet``.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from comap_async.method.phases import phase_spec
from comap_async.wire.messages import REFLECT_INIT, WARMUP
from learner.threads import QUIET_STORE, own_threads, phase_threads


class PhaseControl:
    def next_phase(self) -> str | None:
        """The phase to switch to after this step, or None to stay."""
        s = self.state
        spec = phase_spec(self.cfg.learner, s.phase, self.cfg.method.ablation)
        return spec.then if spec.done(self.trainer.step - s.phase_start, s.phase_budget, s.phase_seconds) else None

    def _publish_every(self) -> int:
        """Steps between publishes in the current phase (never in warm-up unless configured)."""
        return phase_spec(self.cfg.learner, self.state.phase).publish_every or 1 << 62

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
        """Warm-up starts once the broker holds its spec's ``min_samples`` demonstrations."""
        await self.wait_for_phase_data(broker, WARMUP)

    async def wait_for_reflections(self, broker: Any) -> int | None:
        """``reflect_init`` trains once the broker holds its spec's ``min_samples`` reflection samples: the
        actors start labelling them only when the phase is announced."""
        return await self.wait_for_phase_data(broker, REFLECT_INIT)

    async def wait_for_phase_data(self, broker: Any, phase: str) -> int | None:
        """Wait until the store ``phase`` requires holds its spec's ``min_samples`` items; a phase sized by
        data (its spec's ``epochs``) then gets its budget from the items held. Returns the count reached, or
        None when stopping."""
        spec = phase_spec(self.cfg.learner, phase, self.cfg.method.ablation)
        have = await self.wait_for_store(
            broker, spec.requires, "count", spec.min_samples, f"learner.waiting_for_{spec.requires}"
        )
        if have is not None and spec.epochs is not None and self.state.phase_budget is None:
            # sized by the data there is when training starts: later items only add variety
            self.state.phase_budget = spec.sized_steps(have, self.global_batch // self.cfg.learner.batch_size)
            self.follow_budget(phase)
            self.log.info(f"learner.{phase}_budget", held=have, epochs=spec.epochs, steps=self.state.phase_budget)
        return have

    async def wait_for_round(self, broker: Any) -> None:
        """``rounds`` schedule: block until the actors finished a round of new episodes, as many as the
        steps the round then trains (``publish_every``)."""
        need = self.state.round_episodes + self.cfg.learner.publish_every
        written = await self.wait_for_store(broker, "episodes", "written", need, "learner.waiting_for_round")
        if written is not None:
            self.state.round_episodes = written
