"""A real ``comap actor`` whose environment worker is killed with SIGKILL:
it replaces the worker and goes on storing episodes; past its restart budget (a crash loop) it exits
non-zero with one line instead of failing episodes for ever."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.fixtures.broker import stored
from tests.fixtures.system import system_overrides

pytestmark = pytest.mark.alfworld
REPO = Path(__file__).resolve().parents[2]


def children(pid: int) -> list[int]:
    out = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True).stdout
    return [int(x) for x in out.split()]


def start_actor(broker, server, data, tiny_model_dir, log_path, *extra):
    cmd = [sys.executable, "-m", "comap_async", "actor", "--config", str(REPO / "configs" / "test.yaml"), "--envs", "2"]
    for o in system_overrides(
        broker,
        server,
        tiny_model_dir,
        f"env.data_dir={data}",
        "actor.env_workers=1",
        "actor.warmup_explore=0",
        "actor.max_warmup_episodes=1000",
        *extra,
    ):
        cmd += ["--set", o]
    log = open(log_path, "wb")
    return subprocess.Popen(
        cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "COMAP_LOG_JSON": "1"}
    )


async def wait_for_episodes(broker, n: int, proc, timeout: float = 120) -> int:
    deadline = time.monotonic() + timeout
    while (have := len(stored(broker, "episodes"))) < n:
        assert proc.poll() is None and time.monotonic() < deadline, f"{have} episodes, actor rc={proc.poll()}"
        await asyncio.sleep(0.3)
    return have


def cmdline(pid: int) -> bytes:
    """A process's command line (empty once it is gone or a zombie)."""
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ")
    except OSError:
        return b""


def env_worker_of(proc) -> int:
    """The actor's environment worker (a spawn child running _worker_main; not the resource tracker)."""
    for pid in children(proc.pid):
        if b"spawn_main" in cmdline(pid):
            return pid
    raise AssertionError(f"no env worker among {children(proc.pid)}")


async def test_a_killed_env_worker_is_replaced_and_episodes_go_on(
    broker_factory, roomy_server, alfworld_data, tiny_model_dir, tmp_path
):
    broker = broker_factory()
    proc = start_actor(broker, roomy_server, alfworld_data, tiny_model_dir, tmp_path / "actor.log")
    try:
        await wait_for_episodes(broker, 2, proc)
        first = env_worker_of(proc)
        os.kill(first, signal.SIGKILL)
        await asyncio.sleep(1.0)
        before = len(stored(broker, "episodes"))
        await wait_for_episodes(broker, before + 4, proc)  # expert episodes keep winning and landing
        assert env_worker_of(proc) != first
        assert not Path(f"/proc/{first}").exists() or "Z" not in Path(f"/proc/{first}/stat").read_text().split()[2]
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(30)
    log = (tmp_path / "actor.log").read_text()
    assert log.count('"event": "actor.episode_failed"') <= 2  # the episodes on the dead worker, once each
    assert proc.returncode == 0 and '"actor/env_restarts": 1' in log  # counted in the actor's metrics


async def test_past_its_restart_budget_the_actor_exits_with_one_line(
    broker_factory, roomy_server, alfworld_data, tiny_model_dir, tmp_path
):
    """A crash loop: every worker killed as soon as it is there. The budget (``ENV_RESTARTS`` within
    ``ENV_RESTART_WINDOW_S``) is spent in well under a minute, and one more death stops the actor."""
    from comap_async.envs import ENV_RESTART_WINDOW_S, ENV_RESTARTS

    broker = broker_factory()
    proc = start_actor(broker, roomy_server, alfworld_data, tiny_model_dir, tmp_path / "actor.log")
    killed: set[int] = set()
    try:
        await wait_for_episodes(broker, 1, proc)
        deadline = time.monotonic() + 150  # the backoffs sum to 15.5 s, each replacement's start a few more
        while proc.poll() is None and time.monotonic() < deadline:
            alive = [pid for pid in children(proc.pid) if pid not in killed and b"spawn_main" in cmdline(pid)]
            for pid in alive:
                os.kill(pid, signal.SIGKILL)
                killed.add(pid)
            await asyncio.sleep(0.2)
        rc = proc.wait(30)
    finally:
        if proc.poll() is None:
            proc.kill()
    lines = (tmp_path / "actor.log").read_text().strip().splitlines()
    expected = (
        f"comap actor: error: alfworld environment workers died {ENV_RESTARTS + 1} times within "
        f"{ENV_RESTART_WINDOW_S:g} s (restart budget {ENV_RESTARTS})"
    )
    assert rc == 2 and lines[-1].startswith(expected), lines[-5:]
    assert len(killed) == ENV_RESTARTS + 1
    assert "Traceback" not in "\n".join(lines)
