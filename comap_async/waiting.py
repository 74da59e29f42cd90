"""Waiting for another process (start-up order never matters) and for cancelled tasks to end."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Iterable
from typing import Any


async def wait_until_answers(what: str, probe: Callable[[], Awaitable[Any]], log: Any, stop: asyncio.Event,
                             event: str, every_s: float = 10.0, poll_s: float = 1.0) -> Any:
    """Call ``probe()`` until it returns; log ``event`` (target, reason) once per ``every_s`` meanwhile.

    Returns the probe's result, or None when ``stop`` is set first.
    """
    last = 0.0
    while not stop.is_set():
        try:
            return await probe()
        except Exception as exc:  # the other process is not up yet: the reason is logged, not lost
            if time.monotonic() - last > every_s:
                log.info(event, target=what, reason=str(exc)[:200])
                last = time.monotonic()
            await asyncio.sleep(poll_s)
    return None


async def cancel_and_wait(tasks: Iterable[asyncio.Future], retry_s: float = 0.2) -> list[Any]:
    """Cancel ``tasks`` and wait until every one has ended; returns their results or exceptions.

    One ``cancel()`` is not enough on Python 3.11: ``asyncio.wait_for`` returns its inner result
    instead of raising when that result arrives in the same loop iteration as the cancellation,
    and the task then runs on (in a loop, for ever). So a task still running after ``retry_s`` is
    cancelled again, until it ends.
    """
    tasks = list(tasks)
    pending = {t for t in tasks if not t.done()}
    while pending:
        for t in pending:
            t.cancel()
        _, pending = await asyncio.wait(pending, timeout=retry_s)
    return await asyncio.gather(*tasks, return_exceptions=True)
