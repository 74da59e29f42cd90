"""``benchmarks/method_table.py --from-empty``: one command trains a source run from nothing to its first
co-evolution version (the Procfile's processes under honcho, tiny model, real ALFWorld games), forks
it and trains the fork; ``--resume`` then repeats neither."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.fixtures.system import honcho_settings

pytestmark = [pytest.mark.alfworld, pytest.mark.slow]
REPO = Path(__file__).resolve().parents[2]


def test_a_table_from_empty_warms_its_source_up_then_forks_it_and_resume_repeats_nothing(
    tmp_path, tiny_model_dir, alfworld_data
):
    settings = honcho_settings(tmp_path, tiny_model_dir, alfworld_data)
    out = tmp_path / "table"
    cmd = [
        sys.executable,
        "benchmarks/method_table.py",
        "src",
        "--from-empty",
        "--variants",
        "frozen_wm",
        "--minutes",
        "0.3",
        "--train-only",
        "--out",
        str(out),
        "--config",
        "configs/test.yaml",
        *sum((["--set", s] for s in settings), []),
    ]
    done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]

    source = json.loads((out / "source.json").read_text())
    assert source["name"] == "src" and source["phase"] == "coevolve" and source["wall_s"] > 0
    (fork,) = json.loads((out / "forks.json").read_text())
    assert fork["name"] == "src-frozen_wm" and fork["version"] == source["version"] and fork["step"] == source["step"]
    assert fork["phase"] == "coevolve" and fork["wall_s"] >= 18  # trained its 0.3 minutes
    assert (tmp_path / "runs" / "src-frozen_wm" / "fork.json").is_file()

    again = subprocess.run([*cmd, "--resume"], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert again.returncode == 0, again.stderr[-3000:]
    assert json.loads((out / "source.json").read_text())["wall_s"] == source["wall_s"]  # not run again
    assert json.loads((out / "forks.json").read_text()) == [fork]  # kept, not trained again
    assert "method_table_trained=1" in again.stdout
