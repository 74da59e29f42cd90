"""``comap compare``: two tiny-model runs (CoMap and ``frozen_wm``), written
by the learner's own publish and run-file functions, against the prompting baselines on the same
real games; one table and one PNG that opens as an image."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from comap_async.run_files import write_run_ablation
from learner.publish import publish_adapters
from tests.fixtures.learner import QuietLog, RecordingEndpoint, demo_record, make_trainer, reflection_record, wm_record
from tests.fixtures.processes import gone_within

pytestmark = pytest.mark.alfworld
REPO = Path(__file__).resolve().parents[2]


def compare_cmd(runs: list[Path | str], out: Path, games: int, methods: str, env: dict, *more: str) -> list[str]:
    """``comap compare`` on real valid_seen games with the tiny model (``env``: the fixtures' paths)."""
    return [
        sys.executable,
        "-m",
        "comap_async",
        "compare",
        *map(str, runs),
        "--config",
        "configs/test.yaml",
        "--split",
        "valid_seen",
        "--games",
        str(games),
        "--data",
        str(env["data"]),
        "--methods",
        methods,
        "--out",
        str(out),
        "--set",
        f"model.cache_dir={env['cache']}",
        "--set",
        f"run.root={env['root']}",
        *more,
    ]


async def make_run(run_dir: Path, tiny_model_dir: Path, ablation: list[str]) -> None:
    """Three training steps (the world model frozen after the first under ``frozen_wm``), published as v2."""
    trainer = make_trainer(tiny_model_dir)
    batch = {"transitions": [wm_record(0)], "demos": [demo_record(0)], "reflections": [reflection_record(1)]}
    for step in range(3):
        trainer.freeze_wm = "frozen_wm" in ablation and step > 0
        trainer.train_step([batch])
    write_run_ablation(run_dir, ablation)
    for version in (1, 2):
        await publish_adapters(
            trainer.model,
            version,
            "coevolve",
            3,
            root=run_dir / "adapters",
            inference=RecordingEndpoint(),
            endpoints=["http://unused"],
            broker=RecordingEndpoint(),
            log=QuietLog(),
            ablation=ablation,
        )


async def test_compare_writes_one_table_and_a_png(tmp_path, tiny_model_dir, model_cache, alfworld_data):
    runs = {"comap": [], "frozen": ["frozen_wm"]}
    for name, ablation in runs.items():
        await make_run(tmp_path / name, tiny_model_dir, ablation)
    out = tmp_path / "cmp"
    env = {"data": alfworld_data, "cache": model_cache, "root": tmp_path / "runs"}
    runs_dirs = [tmp_path / "comap", tmp_path / "frozen"]
    cmd = compare_cmd(runs_dirs, out, 2, "react,imagine_and_act", env, "--set", "env.max_steps=3")
    r = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    report = json.loads((out / "compare.json").read_text())
    assert report["games"] == 2
    assert [(row["kind"], row["method"], row["ablation"]) for row in report["rows"]] == [
        ("method", "react", []),
        ("method", "imagine_and_act", []),
        ("run", "comap", []),
        ("run", "comap", ["frozen_wm"]),
    ]
    assert all(row["games"] == 2 and 0.0 <= row["success_rate"] <= 1.0 for row in report["rows"])
    assert [row["adapter_version"] for row in report["rows"]] == [0, 0, 2, 2]
    assert report["rows"][0]["delta_f1"] is None and report["rows"][2]["delta_f1"] is not None
    table = (out / "compare.md").read_text()
    assert (
        "| method / run | adapters | success rate | won (95 % interval) | mean score | world-model Delta-F1 |" in table
    )
    assert "ablation frozen_wm (frozen)" in table and "CoMap (comap)" in table and "ReAct (base model)" in table
    from PIL import Image

    with Image.open(out / "compare.png") as img:
        img.verify()
        assert img.format == "PNG" and img.size[0] > 400


def test_compare_refuses_a_directory_that_is_not_a_run(tmp_path, model_cache):
    cmd = [
        sys.executable,
        "-m",
        "comap_async",
        "compare",
        str(tmp_path),
        "--config",
        "configs/test.yaml",
        "--split",
        "valid_seen",
        "--out",
        str(tmp_path / "o"),
        "--set",
        f"model.cache_dir={model_cache}",
    ]
    r = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "is not a run directory" in r.stderr and "Traceback" not in r.stderr


async def test_the_baselines_can_play_with_a_runs_adapters(tmp_path, tiny_model_dir, model_cache, alfworld_data):
    """``--methods-from RUN:VERSION``: the prompting methods with the version the runs were forked from
    (the method table compares them with the warm-up they share), not the base model; a run given as
    ``RUN_DIR:VERSION`` is played at that version."""
    await make_run(tmp_path / "source", tiny_model_dir, [])
    await make_run(tmp_path / "fork", tiny_model_dir, ["frozen_wm"])
    out = tmp_path / "cmp"
    env = {"data": alfworld_data, "cache": model_cache, "root": tmp_path / "runs"}
    source = f"{tmp_path / 'source'}:1"
    # the fork played at its first version, not its newest (RUN_DIR:VERSION)
    cmd = compare_cmd(
        [f"{tmp_path / 'fork'}:1"], out, 1, "draft_only", env, "--methods-from", source, "--set", "env.max_steps=3"
    )
    r = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    rows = json.loads((out / "compare.json").read_text())["rows"]
    assert [(row["method"], row["adapter_version"]) for row in rows] == [("draft_only", 1), ("comap", 1)]
    assert rows[0]["label"] == "Draft only (source v1)" and rows[0]["loop_rate"] is not None
    assert "| loop rate | unreadable answers |" in (out / "compare.md").read_text()
    assert all(0.0 <= row["parse_problem_rate"] <= 1.0 for row in rows)
    # where the server's time went, read from its counters around each row
    assert all(row["server_per_step"]["prompt_tokens"] > 0 and row["server_per_step"]["steps"] > 0 for row in rows)
    assert "The server per played step" in (out / "compare.md").read_text()
    # every row is held in OUT/cells: --resume plays nothing and starts no server
    again = subprocess.run([*cmd, "--resume"], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert again.returncode == 0, again.stderr[-3000:]
    assert again.stderr.count("compare.row_reused") == 2 and "eval.started_server" not in again.stderr
    assert json.loads((out / "compare.json").read_text())["rows"] == rows
    r = subprocess.run(
        [*cmd[: cmd.index("--methods-from") + 1], f"{tmp_path / 'source'}:7", *cmd[cmd.index("--methods-from") + 2 :]],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 2 and "adapter version 7 not found" in r.stderr


async def test_a_comparison_killed_between_games_resumes_at_the_next_game(
    tmp_path, tiny_model_dir, model_cache, alfworld_data
):
    """A row's finished episodes are stored as they end: after a real SIGKILL mid-row, ``--resume``
    keeps them as stored and plays only the row's other games."""
    import os
    import signal
    import time

    await make_run(tmp_path / "source", tiny_model_dir, [])
    out = tmp_path / "cmp"
    env = {"data": alfworld_data, "cache": model_cache, "root": tmp_path / "runs"}
    cmd = compare_cmd([tmp_path / "source"], out, 3, "draft_only", env, "--envs", "1", "--set", "env.max_steps=10")
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True)
    deadline = time.time() + 300
    while not list((out / "cells").glob("*.partial.json")) and time.time() < deadline and proc.poll() is None:
        time.sleep(0.02)
    os.killpg(proc.pid, signal.SIGKILL)  # the command and the server it started
    proc.wait()
    (partial,) = (out / "cells").glob("*.partial.json")
    kept = json.loads(partial.read_text())["episodes"]
    assert 1 <= len(kept) < 3 and not list((out / "cells").glob("*.tmp"))

    again = subprocess.run([*cmd, "--resume"], cwd=REPO, capture_output=True, text=True, timeout=600)
    assert again.returncode == 0, again.stderr[-3000:]
    assert f'"episodes_kept": {len(kept)}, "games_left": {3 - len(kept)}' in again.stderr
    played = again.stderr.count('"event": "actor.episode"')
    assert played == 3 - len(kept) + 3  # the rest of the row killed, then the other row
    rows = json.loads((out / "compare.json").read_text())["rows"]
    assert [row["games"] for row in rows] == [3, 3]
    # the run's row was the one killed: a trained run's row is played before the prompting methods'
    row_file = partial.with_name(partial.name.replace(".partial", ""))
    assert json.loads(row_file.read_text())["key"]["method"] == "comap"
    by_game = {e["game"]: e for e in json.loads(row_file.read_text())["report"]["episodes"]}
    for record in kept:  # the stored episodes are in the report as they were played before the kill
        assert by_game[record["game"]] == {k: v for k, v in record.items() if k != "delta_f1"}
    assert not list((out / "cells").glob("*.partial.json"))


async def test_the_server_a_comparison_started_stops_when_the_comparison_is_killed(
    tmp_path, tiny_model_dir, model_cache, alfworld_data
):
    """A command SIGKILLed runs no ``finally``: the embedded server it started must not be left
    holding the cores (it is tied to the command: ``comap_async.lifetime``)."""
    import os
    import re
    import signal
    import time

    await make_run(tmp_path / "source", tiny_model_dir, [])
    env = {"data": alfworld_data, "cache": model_cache, "root": tmp_path / "runs"}
    cmd = compare_cmd([tmp_path / "source"], tmp_path / "cmp", 3, "draft_only", env, "--envs", "1")
    err = tmp_path / "compare.err"
    with err.open("wb") as sink:
        proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.DEVNULL, stderr=sink, start_new_session=True)
    try:
        deadline, server = time.time() + 120, None
        while server is None and time.time() < deadline and proc.poll() is None:
            found = re.search(r'"pid": (\d+), "event": "eval.started_server"', err.read_text(errors="replace"))
            server = int(found.group(1)) if found else None
            time.sleep(0.05)
        assert server is not None, err.read_text()[-3000:]
        os.kill(proc.pid, signal.SIGKILL)  # the command alone, not its process group
        proc.wait()
        assert gone_within(server, 60), "the server outlived its command"
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # whatever of the group is left, so a failure leaks nothing
        except ProcessLookupError:
            pass


@pytest.mark.parametrize("to_group", [False, True], ids=["kill-INT", "ctrl-C"])
async def test_an_interrupted_comparison_stops_at_once_with_its_server(
    tmp_path, tiny_model_dir, model_cache, alfworld_data, to_group
):
    """SIGINT mid-row, to the command alone (``kill -INT``) or to its process group with the server it
    started (Ctrl-C in a terminal): the episodes in flight are abandoned, not played to their end; the
    server stops; no traceback, exit 130."""
    import os
    import re
    import signal
    import time

    await make_run(tmp_path / "source", tiny_model_dir, [])
    out = tmp_path / "cmp"
    env = {"data": alfworld_data, "cache": model_cache, "root": tmp_path / "runs"}
    # the run's row alone (the CoMap loop: 4-5 calls a step), episodes long enough to be in flight
    cmd = compare_cmd([tmp_path / "source"], out, 4, "", env, "--envs", "2", "--set", "env.max_steps=400")
    err = tmp_path / "compare.err"
    with err.open("wb") as sink:
        # SIGINT as at a terminal: a shell starts background jobs (``cmd &``, CI under ``nohup``) with SIGINT
        # ignored, the children inherit that, and Python then installs no handler: Ctrl-C never came
        proc = subprocess.Popen(
            cmd,
            cwd=REPO,
            stdout=subprocess.DEVNULL,
            stderr=sink,
            start_new_session=True,
            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
        )
    try:
        deadline = time.time() + 300
        # the run's adapters are loaded just before the row's episodes start (a server's log line: the
        # row's progress bar has no newline, so it may sit in a buffer)
        while '"name": "r1-policy-v2"' not in err.read_text(errors="replace") and time.time() < deadline:
            assert proc.poll() is None, err.read_text(errors="replace")[-3000:]
            time.sleep(0.1)
        server = int(re.search(r'"pid": (\d+), "event": "eval.started_server"', err.read_text()).group(1))
        time.sleep(3.0)  # 4 games of up to 400 steps, 2 at a time: about two minutes of episodes in flight
        assert proc.poll() is None, "the row ended before the signal: make its episodes longer"
        sent = time.time()
        (os.killpg if to_group else os.kill)(proc.pid, signal.SIGINT)
        rc = proc.wait(timeout=600)
        stopped_in = time.time() - sent
        tail = err.read_text(errors="replace")[-3000:]
        assert rc == 130, tail
        assert stopped_in < 20, f"{stopped_in:.1f} s to stop: the episodes in flight were played on\n{tail}"
        assert "Traceback" not in tail
        assert gone_within(server, 30), "the server outlived its interrupted command"
        assert not list((out / "cells").glob("*.tmp"))
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
