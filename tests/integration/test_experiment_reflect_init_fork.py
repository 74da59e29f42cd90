"""A spec whose arms fork the source at its first reflection-mode initialisation version (a lever on
reflect-init's labels): each fork redoes the whole phase, then co-evolves, and trains the spec's steps
past the fork point: the tiny model, real ALFWorld games, ``comap experiment run --train-only``."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.fixtures.system import honcho_settings

pytestmark = [pytest.mark.alfworld, pytest.mark.slow, pytest.mark.timeout(900)]
REPO = Path(__file__).resolve().parents[2]
REFLECT_INIT_STEPS = 2  # configs/test.yaml's learner.phases.reflect_init.steps


def test_a_fork_at_reflect_inits_first_version_redoes_the_phase(tmp_path, tiny_model_dir, alfworld_data):
    spec = {
        "name": "tiny-reflect-init-lever",
        "config": "configs/test.yaml",
        "set": [*honcho_settings(tmp_path, tiny_model_dir, alfworld_data), "env.split=train", "env.max_games=8"],
        "source": {"from_empty": True, "phase": "reflect_init", "max_minutes": 10},
        "train": {"steps": REFLECT_INIT_STEPS + 2, "max_minutes": 8},
        "arms": {"comap": {}, "pairs": {"set": ["actor.reflect_init_pairs=true"]}},
        "evaluation": {"split": "valid_seen", "games": 1, "arms": ["comap"]},
    }
    path = tmp_path / "lever.yaml"
    path.write_text(yaml.safe_dump(spec))
    out = tmp_path / "results"
    cmd = [sys.executable, "-m", "comap_async", "experiment", "run", str(path), "--out", str(out), "--train-only"]
    r = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]

    root = tmp_path / "runs" / "experiments" / "tiny-reflect-init-lever"
    fork_point = [json.loads(p.read_text()) for p in (root / "source" / "adapters").glob("policy-v*/comap.json")]
    first = min((m for m in fork_point if m["phase"] == "reflect_init"), key=lambda m: m["version"])
    # the source is stopped once it has published the phase's first version (a tiny learner may publish a few
    # more before its stop lands, on a busy machine): the experiment and every fork start from that first one
    ledger = json.loads((root / "ledger.json").read_text())
    assert (ledger["source"]["version"], ledger["source"]["phase"]) == (first["version"], "reflect_init")
    for arm in ("comap-s0", "pairs-s0"):
        forked = json.loads((root / arm / "fork.json").read_text())
        assert (forked["version"], forked["step"], forked["phase"]) == (first["version"], first["step"], "reflect_init")
        latest = json.loads((root / arm / "adapters" / "latest.json").read_text())
        assert latest["step"] == first["step"] + REFLECT_INIT_STEPS + 2, arm
        assert latest["phase"] == "coevolve", arm
        log = (root / "logs" / f"{arm}.log").read_text()
        # the fork trained reflection-mode initialisation's whole budget before co-evolution began
        changes = re.findall(r"learner\.phase .*new=(\w+) old=(\w+) .*step=(\d+)", log)
        assert changes == [("coevolve", "reflect_init", str(first["step"] + REFLECT_INIT_STEPS))], arm
