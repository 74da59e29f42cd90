"""``experiments/studies/warmup_switch.py``: one run from empty per value to the end of warm-up SFT (the Procfile's
processes under honcho, tiny model, real ALFWorld games), then that version's drafts on held-out games;
``--resume`` repeats neither."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.fixtures.system import honcho_settings

pytestmark = [pytest.mark.alfworld, pytest.mark.slow]
REPO = Path(__file__).resolve().parents[2]


def test_each_value_warms_up_from_empty_and_its_drafts_are_evaluated(tmp_path, tiny_model_dir, alfworld_data):
    settings = honcho_settings(tmp_path, tiny_model_dir, alfworld_data)
    out = tmp_path / "switch"
    cmd = [sys.executable, "experiments/studies/warmup_switch.py", "env.history_k", "--values", "1,2", "--games", "2"]
    cmd += ["--out", str(out), "--config", "configs/test.yaml", *sum((["--set", s] for s in settings), [])]
    done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]

    rows = json.loads((out / "warmup_switch.json").read_text())["rows"]
    assert [(r["value"], r["run"]) for r in rows] == [("1", "ws-env-history_k-1"), ("2", "ws-env-history_k-2")]
    for r in rows:
        meta = tmp_path / "runs" / r["run"] / "adapters" / f"policy-v{r['version']}" / "comap.json"
        assert json.loads(meta.read_text())["phase"] == "reflect_init"  # warm-up SFT's final weights
        assert r["games"] == 2 and 0 <= r["loop_rate"] <= 1 and r["warm_up_minutes"] > 0
    last = done.stdout.strip().splitlines()[-1]
    assert last.startswith("warmup_switch=env.history_k 1: won=") and " 2: won=" in last

    again = subprocess.run([*cmd, "--resume"], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert again.returncode == 0, again.stderr[-3000:]
    assert json.loads((out / "warmup_switch.json").read_text())["rows"] == rows  # nothing trained or played again
    refused = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=120)
    assert refused.returncode != 0 and "--resume goes on with it" in refused.stderr
    assert "Traceback" not in refused.stderr
