"""A step abandoned at SIGTERM hands its StepAborted back to the event loop cleanly (the honcho
system test saw ``NameError: cannot access free variable 'exc'`` in the hand-back callback)."""

from __future__ import annotations

import asyncio
import time
from types import SimpleNamespace

from learner.loop import Learner
from learner.trainer import StepAborted


class AbortableTrainer:
    def __init__(self) -> None:
        self.abort, self.step, self.device = False, 0, "cpu"

    def train_step(self, micro):
        while not self.abort:
            time.sleep(0.01)
        raise StepAborted("abandoned (shutdown)")


async def test_abandoned_step_hands_back_its_error_without_a_callback_error():
    errors: list[dict] = []
    loop = asyncio.get_running_loop()
    loop.set_exception_handler(lambda _loop, ctx: errors.append(ctx))
    fake = SimpleNamespace(
        trainer=AbortableTrainer(),
        stop=asyncio.Event(),
        step_thread=None,
        log=SimpleNamespace(info=lambda *a, **k: None),
    )
    task = asyncio.ensure_future(Learner._step_or_stop(fake, []))
    await asyncio.sleep(0.05)
    fake.stop.set()
    assert await task is None  # abandoned: the caller checkpoints the last completed step
    await asyncio.to_thread(fake.step_thread.join, 5)
    await asyncio.sleep(0.1)  # the thread's hand-back callback runs on the loop now
    assert not fake.step_thread.is_alive() and errors == []
