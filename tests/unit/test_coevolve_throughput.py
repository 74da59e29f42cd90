"""``benchmarks/coevolve_throughput.py``: its settings load over the CPU default, and a window's wait ends at
once, with the reason, when a process it waits on exits (a refused setting used to wait out the timeout)."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

from benchmarks._inference import wait_for
from benchmarks.coevolve_throughput import SETTINGS, copy_trained_adapters


def test_a_process_that_exits_ends_the_wait_with_its_logs_last_line(tmp_path):
    log = tmp_path / "serve.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-c", "print('loading'); print('comap serve: error: bad setting'); raise SystemExit(2)"],
            stdout=out,
        )
    t0 = time.monotonic()
    with pytest.raises(SystemExit, match=r"the server did not come up: serve.log exited with 2: comap serve: error"):
        wait_for(lambda: False, 60, "the server did not come up", {proc: log})
    assert time.monotonic() - t0 < 30


def test_the_wait_ends_when_its_condition_holds_and_times_out_otherwise():
    wait_for(lambda: True, 0, "never")
    with pytest.raises(TimeoutError, match="nothing after 0 s"):
        wait_for(lambda: False, 0, "nothing")


@pytest.mark.parametrize("setting", sorted(SETTINGS))
def test_every_setting_loads_over_the_cpu_default(setting):
    from comap_async.config import load_config

    cfg = load_config(str(Path(__file__).resolve().parents[2] / "configs" / "local.yaml"), SETTINGS[setting])
    if setting == "filed":  # the path issue 29 was filed against
        assert not cfg.env.draft_turns and cfg.inference.prefix_cache_mb == 256


def test_a_runs_adapters_are_served_as_version_1_and_a_missing_one_is_named(tmp_path):
    source = tmp_path / "run" / "adapters"
    for role in ("policy", "wm", "wm_teacher"):
        (source / f"{role}-v7").mkdir(parents=True)
        (source / f"{role}-v7" / "adapter_model.safetensors").write_bytes(role.encode())
    copied = copy_trained_adapters(source, 7, tmp_path / "window")
    assert {r: (p.name, (p / "adapter_model.safetensors").read_bytes()) for r, p in copied.items()} == {
        "policy": ("policy-v1", b"policy"),
        "wm": ("wm-v1", b"wm"),
        "wm_teacher": ("wm_teacher-v1", b"wm_teacher"),
    }
    with pytest.raises(SystemExit, match=r"no adapter at .*policy-v8"):
        copy_trained_adapters(source, 8, tmp_path / "other")
