"""The CLI lists working subcommands; models load through one path."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from comap_async.cli import COMMANDS
from comap_async.models import ModelError, build_tiny_model, load_model_and_tokenizer, resolve_model


def test_help_lists_the_working_subcommands():
    out = subprocess.run(
        [sys.executable, "-m", "comap_async", "--help"], capture_output=True, text=True, check=True
    ).stdout
    for name in COMMANDS:
        assert name in out
    assert "model" in out


def test_every_listed_command_has_a_parser():
    for name in COMMANDS:
        out = subprocess.run([sys.executable, "-m", "comap_async", name, "--help"], capture_output=True, text=True)
        assert out.returncode == 0, out.stderr


def test_tiny_model_loads_and_generates(tiny_model_dir):
    model, tok = load_model_and_tokenizer(str(tiny_model_dir))
    ids = tok("You arrive at desk 1.", return_tensors="pt")
    out = model.generate(**ids, max_new_tokens=4, do_sample=False)
    assert out.shape[1] == ids["input_ids"].shape[1] + 4
    t = time.time()
    assert build_tiny_model(tiny_model_dir) == tiny_model_dir  # idempotent
    assert time.time() - t < 0.5


def test_resolve_model_errors(tmp_path):
    with pytest.raises(ModelError, match="comap model prepare"):
        resolve_model("smollm2-135m-instruct", tmp_path)
    with pytest.raises(ModelError, match="unknown model"):
        resolve_model("nonsense", tmp_path)
    (tmp_path / "empty").mkdir()
    with pytest.raises(ModelError, match="config.json"):
        resolve_model(str(tmp_path / "empty"), tmp_path)
    with pytest.raises(ModelError, match="not in the Hugging Face cache"):  # never passed on as a relative path
        resolve_model("Qwen/Qwen3-4B-not-cached-here", tmp_path)


def test_config_error_exit_code_and_message(tmp_path):
    bad = tmp_path / "c.yaml"
    bad.write_text("method:\n  tau_p: 2\n")
    r = subprocess.run([sys.executable, "-m", "comap_async", "config", "-c", str(bad)], capture_output=True, text=True)
    assert r.returncode == 2 and "method.tau_p" in r.stderr and "Traceback" not in r.stderr
