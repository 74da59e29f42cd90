"""``comap stats`` reads a running broker: it names the run that broker serves, and refuses, in one
line, to show another run's figures as those of the run asked for (two runs' brokers on one
machine take turns on the default port)."""

from __future__ import annotations

import os
import subprocess
import sys

from tests.fixtures.broker import REPO


def stats(broker, *sets: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("COMAP_OVERRIDES", "COMAP_CONFIG")}
    cmd = [sys.executable, "-m", "comap_async", "stats", "--set", f"broker.http_port={broker.http_port}"]
    for s in sets:
        cmd += ["--set", s]
    return subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=60)


def test_stats_names_the_run_and_refuses_another_runs_broker(broker_proc):
    served = stats(broker_proc, "run.name=t")
    assert served.returncode == 0, served.stderr
    assert served.stdout.splitlines()[0].split() == ["run", "t"]
    assert stats(broker_proc).returncode == 0  # no run asked for: the broker's, named in the first line
    other = stats(broker_proc, "run.name=r31-comap")
    assert other.returncode != 0 and other.stdout == ""
    assert other.stderr.strip().count("\n") == 0  # one line, no traceback
    assert "serves run 't', not 'r31-comap'" in other.stderr
