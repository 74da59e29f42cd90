"""`comap eval` on the tiny model: completes and writes eval.json + eval.md."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.alfworld
REPO = Path(__file__).resolve().parents[2]


def test_eval_writes_json_and_markdown(tmp_path, alfworld_data, model_cache):
    out = tmp_path / "out"
    cmd = [
        sys.executable,
        "-m",
        "comap_async",
        "eval",
        "--config",
        "configs/test.yaml",
        "--split",
        "valid_seen",
        "--games",
        "5",
        "--data",
        str(alfworld_data),
        "--out",
        str(out),
        "--reflection-metrics",
        "--set",
        f"model.cache_dir={model_cache}",
        "--set",
        f"run.root={tmp_path / 'runs'}",
    ]
    r = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    report = json.loads((out / "eval.json").read_text())
    for key in ("success_rate", "mean_steps", "delta_f1", "revision_rate", "invalid_action_rate"):
        assert key in report, key
    assert report["games"] == 5 and len(report["episodes"]) == 5 and 0.0 <= report["success_rate"] <= 1.0
    assert report["delta_f1_transitions"] > 0  # Delta-F1 measured on executed transitions
    assert report["mean_steps"] == sum(e["steps"] for e in report["episodes"]) / 5
    refl = report["reflection"]  # every step judged by two branches (the scripted test covers the values)
    assert refl["steps"] == sum(e["steps"] for e in report["episodes"])
    assert 0 <= refl["sum_m_z_draft"] <= refl["sum_z_draft"] <= refl["steps"] and 0.0 <= refl["brp"] <= 1.0
    md = (out / "eval.md").read_text()
    assert "| games | success rate |" in md and md.count("valid_seen/") == 5
    assert "| steps | executed revisions (Σm) | winning drafts (Σz_draft) | URR | HRR | BRP |" in md
    assert "100%" in r.stderr  # the progress bar ran to the end


def test_eval_rejects_unknown_adapter_version(tmp_path, alfworld_data, model_cache):
    cmd = [
        sys.executable,
        "-m",
        "comap_async",
        "eval",
        "--config",
        "configs/test.yaml",
        "--split",
        "valid_seen",
        "--games",
        "1",
        "--data",
        str(alfworld_data),
        "--out",
        str(tmp_path / "o"),
        "--adapters",
        "7",
        "--set",
        f"model.cache_dir={model_cache}",
        "--set",
        f"run.root={tmp_path / 'runs'}",
        "--serve",
        "never",
    ]
    r = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert r.returncode == 2 and "comap eval: error: adapter version 7 not found" in r.stderr
    assert "Traceback" not in r.stderr


def test_eval_probes_end_with_the_probe_line(tmp_path, alfworld_data, model_cache):
    """`comap eval --probes`: greedy probes along the walkthroughs of a
    seeded sample spread over task types; eval.json gets a probes section."""
    out = tmp_path / "out"
    cmd = [
        sys.executable,
        "-m",
        "comap_async",
        "eval",
        "--config",
        "configs/test.yaml",
        "--split",
        "valid_seen",
        "--games",
        "3",
        "--data",
        str(alfworld_data),
        "--out",
        str(out),
        "--probes",
        "--adapters",
        "base",
        "--set",
        f"model.cache_dir={model_cache}",
        "--set",
        f"run.root={tmp_path / 'runs'}",
    ]
    r = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    last = r.stdout.strip().splitlines()[-1]
    assert last.startswith("wm_delta_f1=") and " draft_accuracy=" in last and " admissible_rate=" in last
    report = json.loads((out / "eval.json").read_text())
    p = report["probes"]
    assert p["games"] == 3 and p["walkthrough_states"] > 0 and p["failure_transitions"] > 0
    assert p["wm_scored"] == p["walkthrough_states"] + p["failure_transitions"]
    assert len({n.split("/")[1].split("-")[0] for n in report["game_names"]}) == 3  # three task types
    # the CoMap step on each walkthrough state: the reflection on the greedy draft, gated as the actors gate it
    assert " reflection_problem_rate=" in last and " gate_open_rate=" in last and " p_discrimination=" in last
    assert 0 < p["reflections"] <= p["walkthrough_states"]
    assert sum(p["gate_reasons"].values()) == p["reflections"]
    # the executed action differs from the draft only where the gate opened
    assert p["revisions_fixed"] + p["revisions_broke"] <= p["gate_reasons"].get("revised", 0)
    assert 0.0 <= p["executed_accuracy"] <= 1.0
    assert 0.0 <= p["reflection_problem_rate"] <= 1.0 and 0.0 <= p["unreadable_rate"] <= 1.0
