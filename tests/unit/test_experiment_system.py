"""The system an experiment runs for a while (``experiments/system.py``): the wait over a fork's training,
a warm-up's wall time over sittings, and a system left by a killed runner cleared before the next; a driver's
wait that ends when a process it waits on exits, and a run's adapters copied to be served as version 1."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

import experiments.system as system


def test_a_forks_training_wait_ends_at_its_time_or_when_the_system_stops(tmp_path):
    running = subprocess.Popen(["sleep", "30"])
    try:
        t0 = time.monotonic()
        with pytest.raises(subprocess.TimeoutExpired):  # still running at the end of its time: the caller stops it
            system.wait_with_bar(running, "fork", 0.05, tmp_path)
        assert 2.5 < time.monotonic() - t0 < 10
    finally:
        running.kill()
        running.wait()
    stopped = subprocess.Popen(["true"])
    t0 = time.monotonic()
    system.wait_with_bar(stopped, "fork", 0.5, tmp_path)  # stopped by itself: returns at once
    assert time.monotonic() - t0 < 5


def test_a_warm_up_sitting_stopped_by_a_signal_still_counts_its_wall_time(tmp_path, monkeypatch):
    def stopped(*args, **kwargs):
        time.sleep(1.1)
        raise SystemExit(143)

    monkeypatch.setattr(system, "run_system", stopped)
    monkeypatch.setattr(system, "first_version_in_phase", lambda run_dir, phase: None)
    ledger = tmp_path / "source.json"
    ledger.write_text(json.dumps({"name": "sw", "wall_s": 600}))
    with pytest.raises(SystemExit):
        system.run_to_phase("sw", "coevolve", "cfg.yaml", [], 1.0, tmp_path, tmp_path, ledger)
    assert json.loads(ledger.read_text())["wall_s"] == 601


KILLED_SITTING = """
import sys, time
from pathlib import Path
import experiments.system as system

def training(*args, until=None, **kwargs):  # the system's part: a sitting that polls its end, for a while
    while True:
        until()
        time.sleep(0.05)

system.run_system = training
system.first_version_in_phase = lambda run_dir, phase: None
system.WALL_SAVE_S = 0.2
out = Path(sys.argv[1])
system.run_to_phase("sw", "coevolve", "cfg.yaml", [], 1.0, out, out, out / "source.json")
"""


def test_a_warm_up_sitting_killed_with_minus_9_still_counts_most_of_its_wall_time(tmp_path):
    ledger = tmp_path / "source.json"
    ledger.write_text(json.dumps({"name": "sw", "wall_s": 600}))
    root = str(system.Path(system.__file__).resolve().parents[1])
    sitting = subprocess.Popen(
        [sys.executable, "-c", KILLED_SITTING, str(tmp_path)], env={**os.environ, "PYTHONPATH": root}
    )
    try:
        time.sleep(4.0)
        assert sitting.poll() is None, "the sitting ended by itself"
    finally:
        sitting.kill()  # -9: no finally runs in it
        sitting.wait()
    wall = json.loads(ledger.read_text())["wall_s"]
    # started ~4 s before the kill (less its interpreter's start), written every 0.2 s
    assert 601 <= wall <= 605, wall


def test_a_system_left_by_a_killed_runner_is_waited_for_then_killed(tmp_path):
    # a process group as honcho's is (its own session), ignoring SIGINT as a slow shutdown would
    left = subprocess.Popen(["bash", "-c", "trap '' INT; sleep 60 & wait"], start_new_session=True)
    pid_file = tmp_path / "system.pid"
    pid_file.write_text(str(left.pid))
    t0 = time.monotonic()
    system.wait_for_previous_system(pid_file, wait_s=1.0)
    assert 1.0 <= time.monotonic() - t0 < 10
    assert left.wait(timeout=5) == -signal.SIGKILL
    assert not pid_file.exists()
    deadline = time.monotonic() + 10  # its child went with the group (once the kernel has reaped it)
    while time.monotonic() < deadline:
        try:
            os.killpg(left.pid, 0)
        except ProcessLookupError:
            break
        time.sleep(0.1)
    else:
        raise AssertionError("the group's child outlived the kill")


def test_a_system_that_stops_by_itself_is_not_waited_for(tmp_path):
    done = subprocess.Popen(["true"])
    done.wait()
    pid_file = tmp_path / "system.pid"
    pid_file.write_text(str(done.pid))
    t0 = time.monotonic()
    system.wait_for_previous_system(pid_file, wait_s=30.0)
    assert time.monotonic() - t0 < 1 and not pid_file.exists()
    system.wait_for_previous_system(tmp_path / "none.pid")  # no file: nothing to wait for


def test_a_system_is_started_tied_to_its_starter():
    # honcho is exec'd by a Python that asked for SIGINT when its parent dies: a runner killed with -9 takes
    # its system down (graceful: the learner checkpoints)
    pdeathsig = subprocess.run(
        [
            *system.TIED_EXEC,
            "python3",
            "-c",
            "import ctypes; s = ctypes.c_int(); ctypes.CDLL(None).prctl(2, ctypes.byref(s)); print(s.value)",
        ],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert pdeathsig.stdout.strip() == str(int(signal.SIGINT))


def test_a_fork_s_learner_line_carries_its_step_budget(tmp_path):
    args = system.procfile_with(tmp_path, "comap-s0", ["--max-steps", "40"])
    assert args == ["-f", str(tmp_path / "Procfile.comap-s0"), "-d", str(system.ROOT)]
    lines = (tmp_path / "Procfile.comap-s0").read_text().splitlines()
    repo = (system.ROOT / "Procfile").read_text().splitlines()
    assert [x.split(":")[0] for x in lines] == [x.split(":")[0] for x in repo]
    (learner,) = [x for x in lines if x.startswith("learner:")]
    assert learner.endswith("comap learner --config ${COMAP_CONFIG:-configs/local.yaml} --max-steps 40")
    assert [x for x in lines if not x.startswith("learner:")] == [x for x in repo if not x.startswith("learner:")]
    assert system.procfile_with(tmp_path, "source", []) == []  # the repository's Procfile as it is


def test_a_process_that_exits_ends_the_wait_with_its_logs_last_line(tmp_path):
    log = tmp_path / "serve.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-c", "print('loading'); print('comap serve: error: bad setting'); raise SystemExit(2)"],
            stdout=out,
        )
    t0 = time.monotonic()
    with pytest.raises(SystemExit, match=r"the server did not come up: serve.log exited with 2: comap serve: error"):
        system.wait_for(lambda: False, 60, "the server did not come up", {proc: log})
    assert time.monotonic() - t0 < 30


def test_the_wait_ends_when_its_condition_holds_and_times_out_otherwise():
    system.wait_for(lambda: True, 0, "never")
    with pytest.raises(TimeoutError, match="nothing after 0 s"):
        system.wait_for(lambda: False, 0, "nothing")


def test_a_runs_adapters_are_served_as_version_1_and_a_missing_one_is_named(tmp_path):
    source = tmp_path / "run" / "adapters"
    for role in ("policy", "wm", "wm_teacher"):
        (source / f"{role}-v7").mkdir(parents=True)
        (source / f"{role}-v7" / "adapter_model.safetensors").write_bytes(role.encode())
    copied = system.copy_trained_adapters(source, 7, tmp_path / "window")
    assert {r: (p.name, (p / "adapter_model.safetensors").read_bytes()) for r, p in copied.items()} == {
        "policy": ("policy-v1", b"policy"),
        "wm": ("wm-v1", b"wm"),
        "wm_teacher": ("wm_teacher-v1", b"wm_teacher"),
    }
    with pytest.raises(SystemExit, match=r"no adapter at .*policy-v8"):
        system.copy_trained_adapters(source, 8, tmp_path / "other")


def test_the_bar_shows_the_newest_version_and_the_newest_whole_checkpoints_step(tmp_path):
    from comap_async.run_files import CHECKPOINT_STATE
    from experiments.system import bar_postfix

    assert bar_postfix(tmp_path) == ""  # nothing published or checkpointed yet
    (tmp_path / "adapters").mkdir()
    (tmp_path / "adapters" / "latest.json").write_text('{"version": 19, "phase": "coevolve", "step": 285}')
    for step, whole in ((285, True), (300, True), (310, False)):  # 310 still being written: no state yet
        ckpt = tmp_path / "checkpoints" / f"step-{step:08d}"
        ckpt.mkdir(parents=True)
        if whole:
            (ckpt / CHECKPOINT_STATE).write_bytes(b"x")
    (tmp_path / "checkpoints" / "step-tmp").mkdir()  # not a step
    assert bar_postfix(tmp_path) == "v19 step 300"
    (tmp_path / "adapters" / "latest.json").write_text('{"vers')  # mid-write: the step alone
    assert bar_postfix(tmp_path) == "step 300"
