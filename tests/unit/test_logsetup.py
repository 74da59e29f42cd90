"""Log lines from processes that share one stream (torchrun's ranks) must not interleave."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

# Each rank writes many events to the same unbuffered pipe, as torchrun's workers do.
WRITER = """
import sys
from comap_async.logsetup import configure_logging
log = configure_logging("learner", json=True, rank=int(sys.argv[1]))
for i in range(400):
    log.info("learner.step", step=i, padding="x" * 150)
"""


def test_concurrent_writers_on_one_unbuffered_stream_give_whole_json_lines():
    read_end, write_end = os.pipe()
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONPATH": str(REPO)}
    procs = [
        subprocess.Popen([sys.executable, "-c", WRITER, str(rank)], stderr=write_end, env=env) for rank in (0, 1, 2)
    ]
    os.close(write_end)
    with os.fdopen(read_end) as stream:
        lines = stream.read().splitlines()
    assert all(p.wait(timeout=60) == 0 for p in procs)
    events = [json.loads(line) for line in lines]  # an interleaved line fails to parse
    assert len(events) == 3 * 400
    assert {e["rank"] for e in events} == {0, 1, 2}
