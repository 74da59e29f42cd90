"""What an experiment keeps in ``results/NAME/state`` (``experiments/state.py``): a fork's end packed into
parts and unpacked byte for byte with its mtimes, a missing or altered part refused in one line, the
ledgers restored only where the work directory has none. The whole path (a table killed, its work
directory deleted, resumed from its state) is tests/integration/test_experiment_run.py."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

import experiments.state as state
from comap_async.wire.messages import ROLES, adapter_name
from experiments.spec import SpecError


def fake_fork(run_dir: Path, version: int) -> dict[str, bytes]:
    """A run directory with its run files and two versions of every role's adapters (random bytes, which
    do not compress); returns what the packed version's files hold."""
    files = {"config.jsonl": b'{"step": 10}\n', "ablation.json": b'{"ablation": ["frozen_wm"]}', "fork.json": b"{}"}
    for v in (version - 1, version):
        for role in ROLES:
            name = adapter_name(role, v)
            files[f"adapters/{name}/adapter_model.safetensors"] = os.urandom(300_000)
            files[f"adapters/{name}/comap.json"] = json.dumps({"version": v, "step": 10 * v}).encode()
    for rel, content in files.items():
        path = run_dir / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(content)
        os.utime(path, (1_700_000_000, 1_700_000_000))
    return {rel: c for rel, c in files.items() if f"-v{version - 1}/" not in rel}


def test_a_forks_end_is_unpacked_byte_for_byte_from_parts(tmp_path, monkeypatch):
    monkeypatch.setattr(state, "PART_BYTES", 200_000)  # several parts
    run_dir, states = tmp_path / "work" / "comap-s0", tmp_path / "results" / "state"
    expected = fake_fork(run_dir, 3)
    manifest = state.pack_fork_end(run_dir, 3, states)
    assert manifest.name == "comap-s0-v3.json"
    parts = json.loads(manifest.read_text())["parts"]
    assert len(parts) >= 4 and all((states / p).stat().st_size <= 200_000 for p in parts)
    assert state.bundle_bytes(manifest) == sum((states / p).stat().st_size for p in parts)

    restored = tmp_path / "elsewhere" / "comap-s0"
    restored.mkdir(parents=True)
    (restored / "stale").write_text("replaced")
    state.unpack(manifest, restored)
    got = {str(p.relative_to(restored)): p.read_bytes() for p in restored.rglob("*") if p.is_file()}
    assert got == expected  # the other version is not packed, the stale file is gone
    assert {int(p.stat().st_mtime) for p in restored.rglob("*") if p.is_file()} == {1_700_000_000}
    assert not list(restored.parent.glob("*.tmp")) and not list(restored.parent.glob("*.unpacking"))


def test_a_missing_or_altered_part_is_one_line_and_leaves_nothing(tmp_path, monkeypatch):
    monkeypatch.setattr(state, "PART_BYTES", 200_000)
    run_dir, states = tmp_path / "work" / "comap-s0", tmp_path / "state"
    fake_fork(run_dir, 2)
    manifest = state.pack_fork_end(run_dir, 2, states)
    parts = json.loads(manifest.read_text())["parts"]
    target = tmp_path / "new" / "comap-s0"

    altered = states / parts[1]
    altered.write_bytes(altered.read_bytes()[:-1] + b"x")
    with pytest.raises(SpecError, match=r"comap-s0-v2.json: its parts are not the ones packed"):
        state.unpack(manifest, target)
    altered.unlink()
    with pytest.raises(SpecError, match=rf"part {parts[1]} cannot be read"):
        state.unpack(manifest, target)
    assert not target.exists() and not list(target.parent.iterdir())

    state.remove_bundles(states, "comap-s0")  # a fork trained again: its old end goes, parts and manifest
    assert not list(states.iterdir())


def test_ledgers_are_restored_only_where_the_work_directory_has_none(tmp_path):
    work, states = tmp_path / "work", tmp_path / "state"
    work.mkdir()
    (work / "ledger.json").write_text(json.dumps({"source": {"version": 19}, "forks": {}}))
    (work / "source.json").write_text(json.dumps({"wall_s": 6300}))
    state.save_ledgers(work, states)
    assert state.restore_ledgers(work, states) is False  # this machine has its own: kept
    fresh = tmp_path / "fresh"
    assert state.restore_ledgers(fresh, states) is True
    assert json.loads((fresh / "ledger.json").read_text())["source"]["version"] == 19
    assert json.loads((fresh / "source.json").read_text())["wall_s"] == 6300
    assert state.restore_ledgers(tmp_path / "other", tmp_path / "no-state") is False
