"""Get-batch, kept apart from learn: micro-batches sampled from the broker ahead of the learn step,
each tagged with the phase it was fetched for, so one fetched under a phase is never trained under
the next (``learner/phase_dropped``). What a micro-batch holds is decided in
:mod:`comap_async.method.routing`.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Collection
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from comap_async.method.routing import PHASE_REQUIRES, phase_stores, store_requests

if TYPE_CHECKING:
    from learner.loop import LearnerState

AHEAD = 4
"""Micro-batches the learner keeps fetched ahead of the model (the :class:`Prefetcher`'s ``depth``)."""


@dataclass
class MicroBatch:
    """Records per store, and the phase they were fetched for."""

    phase: str
    stores: dict[str, list]


class Prefetcher:
    """Keeps up to ``depth`` micro-batches ready, each tagged with the phase it was fetched for;
    stores and phase filters follow the current phase (:func:`store_requests`)."""

    def __init__(
        self,
        broker: Any,
        state: LearnerState,
        batch_size: int,
        depth: int,
        seed: int,
        log: Any,
        shares: dict[str, float] | None = None,
        ablation: Collection[str] = (),
        sizes: dict[str, dict[str, int]] | None = None,
    ) -> None:
        self.broker, self.state, self.batch_size, self.log = broker, state, batch_size, log
        self.sizes = sizes or {}  # per phase, per store: items per micro-batch other than batch_size
        self.ablation = ablation
        self.queue: asyncio.Queue = asyncio.Queue(maxsize=depth)
        self.seed = seed
        self.shares = shares or {}
        self.rng = random.Random(seed)
        self.draws = 0
        self.waited_s = 0.0

    async def fetch(self, phase: str) -> dict[str, list]:
        """One micro-batch's records for ``phase`` (stores without items are left out)."""
        mb: dict[str, list] = {}
        for store, n, phases in store_requests(
            phase, self.batch_size, self.shares, self.rng, self.ablation, self.sizes.get(phase)
        ):
            self.draws += 1
            batch = await self.broker.sample(store, n, seed=self.seed * 1_000_003 + self.draws, phases=phases)
            if batch.items:  # imagined steps train the draft as demonstrations do, and nothing else
                mb.setdefault("demos" if store == "imagined" else store, []).extend(batch.items)
        return mb

    async def run(self) -> None:
        last_note = 0.0
        while True:
            phase = self.state.phase
            mb = await self.fetch(phase)
            required = PHASE_REQUIRES.get(phase)
            if not mb or (required is not None and required not in mb):
                if time.monotonic() - last_note > 10:
                    self.log.info(
                        "learner.waiting_for_data",
                        phase=phase,
                        stores=list(phase_stores(phase, self.ablation)),
                        required=required,
                    )
                    last_note = time.monotonic()
                await asyncio.sleep(0.5)
                continue
            t0 = time.monotonic()
            await self.queue.put(MicroBatch(phase, mb))
            self.waited_s += time.monotonic() - t0
