"""``experiments.system.system_running``: a benchmark that runs a system stops it however it is stopped,
also when started as a script's background job (SIGINT ignored) and ended with SIGTERM."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.fixtures.core import free_port

pytestmark = pytest.mark.timeout(120)
REPO = Path(__file__).resolve().parents[2]

CHILD = """
import signal, sys, time
from pathlib import Path
signal.signal(signal.SIGINT, signal.SIG_IGN)  # as a shell without job control starts a background job
from experiments.system import system_running
with system_running("sr", "configs/test.yaml", sys.argv[2:], Path(sys.argv[1]), processes=("broker",)) as proc:
    print(proc.pid, flush=True)
    time.sleep(100)
"""


def _gone(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return True
    return False


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_stopped_benchmark_stops_the_system_it_started(tmp_path, sig):
    sets = [f"run.root={tmp_path / 'runs'}", f"broker.actor_port={free_port()}"]
    sets += [f"broker.learner_port={free_port()}", f"broker.http_port={free_port()}"]
    child = subprocess.Popen(
        [sys.executable, "-c", CHILD, str(tmp_path), *sets],
        cwd=REPO,
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    honcho = None
    try:
        honcho = int(child.stdout.readline())
        time.sleep(3)  # honcho has started the broker
        assert not _gone(honcho)
        child.send_signal(sig)
        assert child.wait(timeout=100) != 0  # it was interrupted, not finished
        assert _gone(honcho), "the benchmark left its system running"
    finally:
        if child.poll() is None:
            child.kill()
        if honcho is not None and not _gone(honcho):
            os.killpg(honcho, signal.SIGKILL)
