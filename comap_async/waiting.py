"""Waiting for another process, so start-up order never matters."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
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
