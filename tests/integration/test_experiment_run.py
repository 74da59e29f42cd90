"""``comap experiment run``: a two-arm experiment end to end on the tiny model and real ALFWorld games
(the source trained from empty under honcho, two forks trained the same number of learner steps, every
row on the same held-out games, the paired statistics), killed with -9 in a fork's training and again in
the middle of the evaluation, then resumed on a machine that lost its work directory (the spec keeps its
state in results/): no source or fork is trained again, no finished game is played twice and what
results.json held of the finished games is unchanged."""

from __future__ import annotations

import json
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from tests.fixtures.system import honcho_settings

pytestmark = [pytest.mark.alfworld, pytest.mark.slow, pytest.mark.timeout(1500)]  # three starts of a whole run
REPO = Path(__file__).resolve().parents[2]
GAMES = 3


def write_spec(tmp_path: Path, settings: list[str]) -> Path:
    spec = {
        "name": "tiny-two-arms",
        "config": "configs/test.yaml",
        # a training split: the games the evaluation plays are never the ones the source and forks train on
        "set": [*settings, "env.split=train", "env.max_games=8"],
        "source": {"from_empty": True, "phase": "coevolve", "max_minutes": 10},
        "train": {"steps": 2, "max_minutes": 5},
        "keep_state": True,  # the trained parts packed into results/state: a machine that loses runs/ goes on
        "arms": {"comap": {}, "frozen_wm": {"ablation": ["frozen_wm"]}},
        "evaluation": {
            "split": "valid_seen",
            "games": GAMES,
            "envs": 1,  # one game at a time: a kill lands between two finished games of a row
            "source": ["draft_only"],
            "arms": ["comap"],
            "reference": "source/draft_only",
            "pairs": [["comap/comap", "frozen_wm/comap"]],
            "judged": ["frozen_wm/comap"],  # its steps judged by two branches: URR, HRR, BRP
        },
    }
    path = tmp_path / "tiny-two-arms.yaml"
    path.write_text(yaml.safe_dump(spec))
    return path


class Runner:
    """``comap experiment run`` as a subprocess whose progress lines (stderr) go to a file."""

    def __init__(self, spec: Path, out: Path, log: Path) -> None:
        self.cmd = [sys.executable, "-m", "comap_async", "experiment", "run", str(spec), "--out", str(out)]
        self.log = log

    def start(self) -> subprocess.Popen:
        self.offset = self.log.stat().st_size if self.log.exists() else 0
        with open(self.log, "ab") as err:
            return subprocess.Popen(self.cmd, cwd=REPO, stdout=subprocess.DEVNULL, stderr=err)

    def lines(self) -> list[str]:
        """This start's progress lines so far."""
        text = self.log.read_bytes()[self.offset :].decode(errors="replace")
        return [x for x in re.split(r"[\r\n]", text) if x.startswith("experiment ")]

    def kill_when(self, proc: subprocess.Popen, pattern: str, timeout_s: float, after_s: float = 0.0) -> str:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            hit = [x for x in self.lines() if re.search(pattern, x)]
            if hit:
                time.sleep(after_s)
                proc.send_signal(signal.SIGKILL)
                proc.wait()
                return hit[0]
            assert proc.poll() is None, "the runner ended before " + pattern + ":\n" + self.log.read_text()[-3000:]
            time.sleep(0.2)
        proc.kill()
        raise AssertionError(f"no line matching {pattern!r} in {timeout_s} s:\n" + self.log.read_text()[-3000:])


def finished_games(lines: list[str]) -> dict[str, int]:
    """Games reported finished per row (``row R: game k/N won|lost``)."""
    count: dict[str, int] = {}
    for line in lines:
        m = re.search(r"row (\S+): game \d+/\d+ (won|lost)", line)
        if m:
            count[m[1]] = count.get(m[1], 0) + 1
    return count


def test_an_experiment_killed_twice_resumes_to_the_same_table(tmp_path, tiny_model_dir, alfworld_data):
    spec = write_spec(tmp_path, honcho_settings(tmp_path, tiny_model_dir, alfworld_data))
    out = tmp_path / "results"
    runner = Runner(spec, out, tmp_path / "progress.log")

    # 1. killed -9 in the middle of the first fork's training
    first = runner.start()
    runner.kill_when(first, r"fork comap-s0: training 2 steps", timeout_s=600, after_s=3)
    before = runner.lines()
    assert any("source: v" in x for x in before)

    # 2. resumed: the source is kept, the cut fork trained again; killed -9 once the second row has a game
    second = runner.start()
    runner.kill_when(second, r"row comap/comap: game 1/", timeout_s=900)
    lines2 = runner.lines()
    assert not any("training from empty" in x for x in lines2), "the source was trained again"
    assert any("fork comap-s0: stopped short of its 2 steps" in x for x in lines2)
    assert any("fork frozen_wm-s0: v" in x for x in lines2)
    snapshot = json.loads((out / "results.json").read_text())
    held = {row: dict(r["episodes"]) for row, r in snapshot["rows"].items()}
    assert len(held["source/draft_only"]) == GAMES and len(held["comap/comap"]) >= 1

    # 3. the machine loses its work directory (runs/ is not committed); results/ with its state is kept
    state = out / "state"
    manifests = sorted(p.name.rsplit("-v", 1)[0] for p in state.glob("*-v*.json"))
    assert manifests == ["comap-s0", "frozen_wm-s0", "source"], manifests
    assert (state / "ledger.json").is_file() and (state / "source.json").is_file()
    for manifest in state.glob("*-v*.json"):  # every part of every bundle is there, none left over
        parts = json.loads(manifest.read_text())["parts"]
        assert parts and all((state / p).is_file() for p in parts)
    assert len(list(state.glob("*.tar.xz.*"))) == sum(
        len(json.loads(m.read_text())["parts"]) for m in state.glob("*-v*.json")
    )
    shutil.rmtree(tmp_path / "runs" / "experiments" / "tiny-two-arms")

    # 4. resumed to the end from results/ alone: nothing trained again, no finished game played again
    third = runner.start()
    assert third.wait(timeout=900) == 0, runner.log.read_text()[-3000:]
    lines3 = runner.lines()
    for part in ("source", "fork comap-s0", "fork frozen_wm-s0"):
        assert any(f"{part}: restored from" in x for x in lines3), part
    assert not any("training from empty" in x for x in lines3), "the source was trained again"
    assert any("fork comap-s0: trained" in x and "kept" in x for x in lines3)
    assert not any("training" in x and "steps from step" in x for x in lines3)
    played = finished_games(lines2)
    for row, n in finished_games(lines3).items():
        played[row] = played.get(row, 0) + n
    assert played == {"source/draft_only": GAMES, "comap/comap": GAMES, "frozen_wm/comap": GAMES}

    results = json.loads((out / "results.json").read_text())
    for row, episodes in held.items():
        for game, record in episodes.items():
            assert results["rows"][row]["episodes"][game] == record  # unchanged by the resume
    assert list(results["rows"]["source/draft_only"]["episodes"]) == results["games"]

    # both forks trained exactly the budget past the same fork point
    source_step = results["source"]["step"]
    assert {f["step"] for f in results["forks"].values()} == {source_step + 2}
    for f in results["forks"].values():  # how often each fork's action gate opened in its own training
        assert 0 <= f["gate_opened"] <= f["gate_samples"]
    assert {r["step"] for name, r in results["rows"].items() if name != "source/draft_only"} == {source_step + 2}
    # the statistics: every row against the reference, the spec's pair, a verdict per comparison
    pairs = {(c["row"], c["reference"]) for c in results["comparisons"]}
    assert pairs == {
        ("comap/comap", "source/draft_only"),
        ("frozen_wm/comap", "source/draft_only"),
        ("comap/comap", "frozen_wm/comap"),
    }
    for c in results["comparisons"]:
        assert c["games"] == GAMES and c["verdict"].startswith(c["row"])
    figures = results["figures"]["comap/comap"]
    assert figures["games"] == GAMES and 0.0 <= figures["ci95"][0] <= figures["ci95"][1] <= 1.0
    md = (out / "results.md").read_text()
    assert "| `comap/comap` |" in md and "Verdicts" in md and (out / "results.png").stat().st_size > 1000
    # the judged row: every game's steps counted by (m, z_draft, z_ref), the paper's rates from them
    judged = results["rows"]["frozen_wm/comap"]
    assert judged["judged"] and "judged" not in results["rows"]["comap/comap"]
    for record in judged["episodes"].values():
        assert sum(record["judged"].values()) == record["steps"]
    reflection = results["figures"]["frozen_wm/comap"]["reflection"]
    assert reflection["steps"] == results["figures"]["frozen_wm/comap"]["steps"]
    assert 0.0 <= reflection["urr"] <= 1.0 and "## Reflection: URR, HRR, BRP" in md

    # 5. another spec forks this table's source at its first reflection-mode initialisation version, which the
    # source's bundle kept beside the fork point (the source here is the one unpacked from results/)
    lever = {
        "name": "tiny-lever",
        "config": "configs/test.yaml",
        "set": yaml.safe_load(spec.read_text())["set"],
        "source": {"experiment": "tiny-two-arms", "phase": "reflect_init"},
        "train": {"steps": 3, "max_minutes": 5},
        "arms": {"comap": {}},
        "evaluation": {"split": "valid_seen", "games": 1, "arms": ["comap"]},
    }
    lever_spec = tmp_path / "tiny-lever.yaml"
    lever_spec.write_text(yaml.safe_dump(lever))
    cmd = [sys.executable, "-m", "comap_async", "experiment", "run", str(lever_spec), "--train-only"]
    r = subprocess.run([*cmd, "--out", str(tmp_path / "lever")], cwd=REPO, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    source_dir = tmp_path / "runs" / "experiments" / "tiny-two-arms" / "source"
    starts = [json.loads(p.read_text()) for p in (source_dir / "adapters").glob("policy-v*/comap.json")]
    first = min((m for m in starts if m["phase"] == "reflect_init"), key=lambda m: m["version"])
    forked = json.loads((tmp_path / "runs" / "experiments" / "tiny-lever" / "comap-s0" / "fork.json").read_text())
    assert (forked["version"], forked["phase"], forked["source"]) == (first["version"], "reflect_init", str(source_dir))

    # nothing of the experiment's systems is left running: its pid file gone, the broker's port free
    assert not (tmp_path / "runs" / "experiments" / "tiny-two-arms" / "logs" / "system.pid").exists()
    (http_port,) = [int(s.split("=")[1]) for s in yaml.safe_load(spec.read_text())["set"] if "http_port" in s]
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", http_port))
