"""A run cancelled while its environment worker is busy (a long ALFWorld reset) must end at once:
the evaluator abandons its games on SIGTERM, and honcho kills whatever is still alive 5 s later
(CI's honcho test once failed on exactly this). The worker is killed, not waited for, and
no thread is left behind for ``asyncio.run`` to wait on."""

from __future__ import annotations

import asyncio
import os
import time
from pathlib import Path

from comap_async.envs.pool import AsyncEnvPool
from comap_async.waiting import cancel_and_wait
from tests.fixtures.processes import alive


async def _cancel_during_a_reset(marker: Path) -> float:
    async def play() -> None:
        async with AsyncEnvPool(workers=1, env_name="tests.fixtures.slow_env:SLOW", marker=str(marker)) as pool:
            await pool.env().reset("toy:2")

    task = asyncio.ensure_future(play())
    deadline = time.monotonic() + 60
    while not marker.exists():  # the worker has started and is inside its 30 s reset
        assert not task.done() and time.monotonic() < deadline, "the slow reset never started"
        await asyncio.sleep(0.05)
    t0 = time.monotonic()
    await cancel_and_wait([task])  # re-cancels every 0.2 s, as the evaluator's shutdown does
    return t0


def test_a_run_cancelled_in_a_busy_reset_ends_at_once_and_kills_its_worker(tmp_path):
    marker = tmp_path / "busy"
    t0 = asyncio.run(_cancel_during_a_reset(marker))
    ended_s = time.monotonic() - t0  # asyncio.run has also waited for its executor's threads
    worker = int(marker.read_text())
    assert ended_s < 2.5, f"the run took {ended_s:.1f} s to end after the cancel"
    assert not alive(worker), f"worker {worker} outlived its pool"
    assert worker != os.getpid()


async def _cancel_during_start() -> float:
    pool = AsyncEnvPool(workers=2, env_name="tests.fixtures.slow_env:SLOW")
    task = asyncio.ensure_future(pool.start())
    await asyncio.sleep(0.01)  # spawned, still starting Python: each start-up thread waits on its pipe
    assert not task.done(), "the workers started before the test could cancel them"
    t0 = time.monotonic()
    await cancel_and_wait([task])
    return t0


def test_a_pool_cancelled_while_starting_leaves_no_worker_and_no_waiting_thread():
    before = {int(p) for p in os.listdir("/proc") if p.isdigit()}
    t0 = asyncio.run(_cancel_during_start())
    ended_s = time.monotonic() - t0
    assert ended_s < 2.5, f"the run took {ended_s:.1f} s to end after the cancel"
    spawned = [
        pid
        for pid in ({int(p) for p in os.listdir("/proc") if p.isdigit()} - before)
        if alive(pid) and b"spawn_main" in Path(f"/proc/{pid}/cmdline").read_bytes()
    ]
    assert not spawned, f"workers {spawned} outlived a pool that never started"
