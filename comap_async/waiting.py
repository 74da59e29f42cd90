"""Waiting for another process (start-up order never matters) and for cancelled tasks to end."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Iterable
from typing import Any


class WaitAbandoned(RuntimeError):
    """:func:`wait_until_answers` gave up: the time limit passed, or the other process is gone."""


async def wait_until_answers(
    what: str,
    probe: Callable[[], Awaitable[Any]],
    log: Any,
    stop: asyncio.Event,
    event: str,
    every_s: float = 10.0,
    poll_s: float = 1.0,
    timeout_s: float | None = None,
    gone: Callable[[], str | None] | None = None,
) -> Any:
    """Call ``probe()`` until it returns; log ``event`` (target, reason) once per ``every_s`` meanwhile.

    Returns the probe's result, or None when ``stop`` is set first. With ``timeout_s``, or a
    ``gone()`` that returns a reason (e.g. the process being waited for exited), it raises
    :class:`WaitAbandoned` with the reason instead of waiting on.
    """
    t0 = time.monotonic()
    last = 0.0
    while not stop.is_set():
        reason = gone() if gone is not None else None
        if reason is not None:
            raise WaitAbandoned(reason)
        try:
            return await probe()
        except Exception as exc:  # the other process is not up yet: the reason is logged, not lost
            if timeout_s is not None and time.monotonic() - t0 > timeout_s:
                raise WaitAbandoned(f"did not answer within {timeout_s:.0f} s; last error: {str(exc)[:200]}") from None
            if time.monotonic() - last > every_s:
                log.info(event, target=what, reason=waiting_reason(exc))
                last = time.monotonic()
            await asyncio.sleep(poll_s)
    return None


_NOT_UP = ("Connection refused", "Connect call failed", "cannot connect", "ConnectionRefusedError")


def waiting_reason(exc: BaseException) -> str:
    """Why the other process did not answer, as a waiting line says it: a refused connection is a
    process still starting (a normal wait), anything else is quoted."""
    text = str(exc)
    if any(marker in text for marker in _NOT_UP) or isinstance(exc, ConnectionRefusedError):
        return "not accepting connections yet (still starting?)"
    return text[:200]


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


async def until_stopped(aw: Awaitable[Any], stop: asyncio.Event) -> tuple[bool, Any]:
    """``(True, result)`` of ``aw``, or ``(False, None)`` when ``stop`` is set first: ``aw`` is then
    cancelled and waited for (shutdown must not wait for long work such as a publish or an evaluation)."""
    task = asyncio.ensure_future(aw)
    stopper = asyncio.ensure_future(stop.wait())
    await asyncio.wait({task, stopper}, return_when=asyncio.FIRST_COMPLETED)
    stopper.cancel()
    if task.done():
        return True, task.result()
    await cancel_and_wait([task])
    return False, None
