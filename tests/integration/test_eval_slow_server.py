"""`comap eval --serve always` waits for the server it starts.

The server is real (the embedded one, tiny model); only its start is delayed by a wrapper that
sleeps before exec'ing it, as a model load on a busy CPU does. A server that never answers ends
the evaluation with one clear error line, not a traceback.
"""

from __future__ import annotations

import argparse
import json
import sys

import pytest

from evaluator import eval_runner, evaluate
from tests.fixtures.inference import AdapterFactory

pytestmark = pytest.mark.alfworld


def _args(tmp_path, alfworld_data, model_cache, extra: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    evaluate.add_arguments(p)
    return p.parse_args(
        [
            "--config",
            "configs/test.yaml",
            "--split",
            "valid_seen",
            "--games",
            "2",
            "--data",
            str(alfworld_data),
            "--out",
            str(tmp_path / "out"),
            "--serve",
            "always",
            "--set",
            f"model.cache_dir={model_cache}",
            "--set",
            f"run.root={tmp_path / 'runs'}",
            "--set",
            "env.max_steps=3",
            *extra,
        ]
    )


def _delayed(delay_s: float | None):
    """A ``server_command`` replacement: sleep, then exec the real server (never, when None)."""
    real = eval_runner.server_command

    def command(config, overrides, port):
        argv = real(config, overrides, port)
        if delay_s is None:
            return [sys.executable, "-c", "import time; time.sleep(3600)"]
        code = f"import os, sys, time; time.sleep({delay_s}); os.execv(sys.executable, {argv!r})"
        return [sys.executable, "-c", code]

    return command


def test_eval_waits_for_a_slow_server(tmp_path, alfworld_data, model_cache, tiny_model_dir, monkeypatch, capsys):
    root = tmp_path / "runs" / "test" / "adapters"
    factory = AdapterFactory(tiny_model_dir, root)
    for i, role in enumerate(("policy", "wm", "wm_teacher")):
        factory.random(f"{role}-v1", seed=i)
    monkeypatch.setattr(eval_runner, "server_command", _delayed(15))
    code = evaluate.run(_args(tmp_path, alfworld_data, model_cache, ["--adapters", "1", "--serve-timeout", "300"]))
    err = capsys.readouterr().err
    assert code == 0, err[-3000:]
    report = json.loads((tmp_path / "out" / "eval.json").read_text())
    assert report["adapter_version"] == 1 and report["games"] == 2
    assert "eval.waiting" in err and "Traceback" not in err
    assert "steps=" in err  # the progress bar counts environment steps


def test_eval_with_a_server_that_never_answers_ends_with_one_error_line(
    tmp_path, alfworld_data, model_cache, monkeypatch, capsys
):
    monkeypatch.setattr(eval_runner, "server_command", _delayed(None))
    code = evaluate.run(_args(tmp_path, alfworld_data, model_cache, ["--adapters", "base", "--serve-timeout", "4"]))
    err = capsys.readouterr().err
    assert code == 2
    errors = [line for line in err.splitlines() if line.startswith("comap eval: error:")]
    assert len(errors) == 1 and "did not answer within 4 s" in errors[0]
    assert "Traceback" not in err
