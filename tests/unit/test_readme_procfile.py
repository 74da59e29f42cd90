"""The README quotes `comap procfile`'s output for a 4-GPU host: it must be what the command writes."""

from __future__ import annotations

import shlex
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_the_readmes_four_gpu_procfile_is_the_commands_output(capsys, monkeypatch):
    from comap_async.cli import main

    readme = (REPO / "README.md").read_text()
    command = readme.split("(`comap procfile ", 1)[1].split("`)", 1)[0]
    quoted = readme.split(f"(`comap procfile {command}`):\n\n```\n", 1)[1].split("\n```", 1)[0]
    monkeypatch.chdir(REPO)
    assert main(["procfile", *shlex.split(command)]) in (0, None)
    assert capsys.readouterr().out.rstrip("\n") == quoted
