"""cancel_and_wait: a task that survives one cancellation (as asyncio.wait_for makes one do on
Python 3.11) still ends; results and errors come back."""

from __future__ import annotations

import asyncio

from comap_async.waiting import cancel_and_wait


async def test_cancel_and_wait_ends_a_task_that_swallows_cancellations():
    swallowed = 0

    async def stubborn() -> None:
        nonlocal swallowed
        while True:
            try:
                await asyncio.sleep(10)
            except asyncio.CancelledError:
                swallowed += 1
                if swallowed < 3:
                    continue  # what a wait_for whose inner future completed at the same moment does
                raise

    task = asyncio.create_task(stubborn())
    await asyncio.sleep(0)
    task.cancel()
    await asyncio.sleep(0.05)
    assert not task.done()  # one cancel() was not enough
    results = await asyncio.wait_for(cancel_and_wait([task], retry_s=0.05), 5)
    assert task.cancelled() and swallowed == 3
    assert isinstance(results[0], asyncio.CancelledError)


async def test_cancel_and_wait_returns_results_and_errors_of_finished_tasks():
    async def boom() -> None:
        raise ValueError("x")

    done = asyncio.create_task(asyncio.sleep(0, result=7))
    failed = asyncio.create_task(boom())
    await asyncio.sleep(0.01)
    results = await cancel_and_wait([done, failed])
    assert results[0] == 7 and isinstance(results[1], ValueError)


async def test_wait_until_answers_gives_up_on_its_time_limit_or_a_gone_process():
    import pytest

    from comap_async.waiting import WaitAbandoned, wait_until_answers

    lines: list[tuple] = []
    log = type("Log", (), {"info": lambda self, event, **kw: lines.append((event, kw))})()

    async def refused():
        raise ConnectionError("refused")

    with pytest.raises(WaitAbandoned, match=r"did not answer within 0 s; last error: refused"):
        await wait_until_answers("x", refused, log, asyncio.Event(), "t.waiting", poll_s=0.01, timeout_s=0.05)
    assert lines and lines[0] == ("t.waiting", {"target": "x", "reason": "refused"})
    with pytest.raises(WaitAbandoned, match="exited with code 3"):
        await wait_until_answers(
            "x", refused, log, asyncio.Event(), "t.waiting", poll_s=0.01, gone=lambda: "exited with code 3"
        )
    answers = iter([ConnectionError("not yet"), "ok"])

    async def later():
        a = next(answers)
        if isinstance(a, Exception):
            raise a
        return a

    assert await wait_until_answers("x", later, log, asyncio.Event(), "t.waiting", poll_s=0.01, timeout_s=5) == "ok"
