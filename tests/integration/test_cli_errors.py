"""Every command's expected failures end with one line on stderr and exit 2: missing data,
a missing model, a busy port; ``--debug`` shows the traceback."""

from __future__ import annotations

import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def comap(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "comap_async", *args], cwd=REPO, capture_output=True, text=True, timeout=timeout
    )


@pytest.mark.parametrize(
    "args, message",
    [
        (["actor", "--set", "env.data_dir=/no/such/alfworld"], "ALFWorld data root /no/such/alfworld does not exist"),
        (["learner", "--set", "model.name_or_path=/no/such/model"], "model directory /no/such/model does not exist"),
        (["serve", "--set", "model.name_or_path=org/not-cached-model"], "not in the Hugging Face cache"),
    ],
)
def test_expected_failures_are_one_line(args, message, tmp_path):
    from comap_async.ports import free_port

    r = comap(*args, "--set", f"run.root={tmp_path}", "--set", f"inference.port={free_port()}")
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2 and lines, r.stderr
    assert lines[-1].startswith(f"comap {args[0]}: error: ") and message in lines[-1], r.stderr[-2000:]
    assert "Traceback" not in r.stderr


@pytest.mark.parametrize("command", ["learner", "actor", "broker"])
def test_training_on_an_evaluation_split_is_refused_in_one_line_before_anything_starts(command):
    started = time.monotonic()
    r = comap(command, "--config", "configs/local.yaml", "--set", "env.split=valid_seen", timeout=60)
    assert r.returncode == 2 and r.stderr.strip().splitlines() == [
        f"comap {command}: error: configs/local.yaml (with --set): env.split='valid_seen' is an evaluation split "
        "of alfworld (valid_seen, valid_unseen, valid_train): training must never read an evaluation split; "
        "train on 'train'"
    ], r.stderr[-2000:]
    assert time.monotonic() - started < 30  # refused on the config alone: no model, games or port first


def test_eval_refuses_to_play_a_run_with_another_method_than_it_trained_under(tmp_path):
    from comap_async.run_files import write_run_ablation

    write_run_ablation(tmp_path / "r1", ["frozen_wm"], ["reflect_confidence"])
    r = comap(
        "eval",
        "--split",
        "valid_seen",
        "--out",
        str(tmp_path / "out"),
        "--set",
        f"run.root={tmp_path}",
        "--set",
        "run.name=r1",
    )
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr[-2000:]
    assert lines[-1] == (
        f"comap eval: error: {tmp_path / 'r1'} trained with ablation frozen_wm, methods reflect_confidence; "
        "this config plays it with ablation none, methods none: evaluate with the run's own config "
        "(or its --set switches)"
    )


def test_a_busy_port_is_refused_before_the_model_loads(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        r = comap("serve", "--port", str(port), "--set", f"run.root={tmp_path}", timeout=60)
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert r.stderr.strip().splitlines()[-1] == (
        f"comap serve: error: 127.0.0.1:{port} is in use (another comap "
        "process?); stop it or set inference.port (or --port)"
    )


def test_debug_shows_the_traceback(tmp_path):
    r = comap("learner", "--debug", "--set", "model.name_or_path=/no/such/model", "--set", f"run.root={tmp_path}")
    assert r.returncode != 0 and "Traceback" in r.stderr and "ModelError" in r.stderr


def test_a_broker_whose_replay_dir_is_a_file_says_so_in_one_line(tmp_path):
    (tmp_path / "t").mkdir()
    (tmp_path / "t" / "replay").write_text("not a directory")
    from comap_async.ports import free_port

    r = comap(
        "broker",
        "--set",
        f"run.root={tmp_path}",
        "--set",
        "run.name=t",
        "--set",
        f"broker.actor_port={free_port()}",
        "--set",
        f"broker.learner_port={free_port()}",
        "--set",
        f"broker.http_port={free_port()}",
        timeout=60,
    )
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert r.stderr.strip().splitlines()[-1].startswith("comap broker: error: cannot start: "), r.stderr[-1500:]


def test_a_broker_whose_http_port_is_busy_exits_in_one_line_with_its_zeromq_ports_closed(tmp_path):
    from comap_async.ports import free_port

    actor_port, learner_port = free_port(), free_port()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        started = time.monotonic()
        r = comap(
            "broker",
            "--set",
            f"run.root={tmp_path}",
            "--set",
            "run.name=t",
            "--set",
            f"broker.actor_port={actor_port}",
            "--set",
            f"broker.learner_port={learner_port}",
            "--set",
            f"broker.http_port={port}",
            "--set",
            "broker.gate_workers=1",
            timeout=30,  # it used to stay up, listening, until a signal
        )
        elapsed = time.monotonic() - started
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr[-2000:]
    errors = [line for line in r.stderr.splitlines() if line.startswith("comap broker: error: ")]
    assert errors == [r.stderr.strip().splitlines()[-1]], r.stderr[-2000:]
    assert errors[0].startswith("comap broker: error: cannot start: OSError: ") and str(port) in errors[0]
    assert elapsed < 15  # the imports take a few seconds on a busy machine; nothing waits for a signal
    for p in (actor_port, learner_port):  # the ZeroMQ ports it bound before the failure are free again
        with socket.socket() as s:
            s.bind(("127.0.0.1", p))


def test_the_procfile_logs_for_people_unless_asked_for_json():
    import subprocess as sp

    for line in (REPO / "Procfile").read_text().splitlines():
        name, _, cmd = line.partition(": ")
        assert cmd.startswith("COMAP_LOG_JSON=${COMAP_LOG_JSON:-0} exec comap "), line
        shown = sp.run(["sh", "-c", cmd.replace("exec comap", "exec env #")], capture_output=True, text=True).stdout
        assert "COMAP_LOG_JSON=0" in shown
