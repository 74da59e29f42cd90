"""One learn step in a daemon thread, abandoned at shutdown: the step of :class:`learner.loop.Learner`
(its ``trainer``, ``stop`` and ``log``; the thread is kept in its ``step_thread`` for the exit to join)."""

from __future__ import annotations

import asyncio
import threading
from typing import Any

from comap_async.heap import release_freed_memory


def use_device(device: str) -> None:
    """Make ``device`` (``cuda:N``) the calling thread's current CUDA device: the current device is
    per thread, and one set in the main thread (torch.distributed's rank set-up) does not reach the
    step's thread, where kernels and allocations without a device would land on card 0."""
    import torch

    d = torch.device(device)
    if d.type == "cuda" and d.index is not None:
        torch.cuda.set_device(d)


async def step_or_stop(learner: Any, micro: list) -> dict[str, float] | None:
    """Run one step in a daemon thread; None when ``stop`` comes first.

    A step of the default model on one CPU core takes tens of seconds and honcho sends SIGKILL
    5 s after SIGTERM, so shutdown cannot wait for it: the step is told to abandon at its next
    micro-batch, and the checkpoint (taken under the trainer's update lock) holds the last
    completed step. A daemon thread does not keep the exiting process alive.
    """
    loop = asyncio.get_running_loop()
    done: asyncio.Future = loop.create_future()

    def hand_back(settle: Any) -> None:
        if loop.is_closed():
            return  # the step was abandoned and the loop has finished: nobody waits for it
        try:
            loop.call_soon_threadsafe(settle)
        except RuntimeError:
            if not loop.is_closed():  # closed between the check and the call is the same case
                raise

    def work() -> None:
        try:
            use_device(learner.trainer.device)
            result = learner.trainer.train_step(micro)
            release_freed_memory()  # the step's activations, freed in this thread's arena
        except BaseException as exc:  # handed to the event loop, which raises it in _train
            # bound now: Python unbinds ``exc`` when the except block ends, before the loop runs this
            hand_back(lambda err=exc: done.done() or done.set_exception(err))
        else:
            hand_back(lambda: done.done() or done.set_result(result))

    learner.step_thread = threading.Thread(target=work, name="learner-step", daemon=True)
    learner.step_thread.start()
    stopper = asyncio.ensure_future(learner.stop.wait())
    finished, _ = await asyncio.wait({done, stopper}, return_when=asyncio.FIRST_COMPLETED)
    stopper.cancel()
    if done in finished:
        return done.result()
    learner.trainer.abort = True
    done.add_done_callback(lambda f: f.exception())  # an abandoned step's StepAborted is expected
    learner.log.info("learner.step_abandoned", step=learner.trainer.step + 1)
    return None
