"""What an experiment has trained, packed into ``results/NAME/state/`` so that it outlives the machine.

A table of the CPU default takes longer than one sitting (hours of training and evaluation), and the run
directories under ``run.root`` are not committed: a machine that loses them would train the source and
every fork again, and no finished game could be kept (a retrained fork has other adapters). With the
spec's ``keep_state: true`` the runner packs, as each part is trained:

* ``source-vN``: the fork point as a run directory that forks exactly like the source did at
  version N (:func:`experiments.fork.fork_run`'s copy: that version's checkpoint, adapters and the replay
  cut at its publish), with the source's own run files and the first version of each earlier phase but
  warm-up (checkpoint and adapters: another table forks reflection-mode initialisation's start);
* ``ARM-sSEED-vM``: each fork's end, the adapters its rows play and its run files;
* ``ledger.json`` and ``source.json``: what was trained, from which fork point, in how much wall time.

A bundle is a tar archive, xz-compressed, cut into parts of at most 40 MB (``NAME.tar.xz.000``, ...), with
a manifest ``NAME.json`` (its parts and their sha256) written last.

Started on a machine without the work directory, the runner unpacks them where it would have trained
them. The files are byte for byte the trained ones (their mtimes too: a fork of the unpacked source cuts
its replay at the same instant), so a row's adapters digest and its finished games are the same.
"""

from __future__ import annotations

import hashlib
import json
import lzma
import shutil
import tarfile
import tempfile
from pathlib import Path

from experiments.system import write_json

STATE_DIR = "state"
LEDGERS = ("ledger.json", "source.json")
PART_BYTES = 40 << 20
"""A bundle is cut into parts of at most this size: every part is an ordinary file for any git host."""
# A long window: the checkpoint holds the adapters' tensors again (the same bytes, tens of MB apart)
XZ_FILTERS = [{"id": lzma.FILTER_LZMA2, "preset": 6, "dict_size": 128 << 20}]


def bundle_name(run: str, version: int) -> str:
    """A bundle's manifest (``NAME.json``: its parts and their digest); the parts are ``NAME.tar.xz.NNN``."""
    return f"{run}-v{version}.json"


def _run_files(run_dir: Path) -> list[Path]:
    """The run's own small files at its top (the run configs, its ablation, ``fork.json``)."""
    return [p for p in run_dir.iterdir() if p.is_file() and not p.name.endswith(".tmp")]


def _pack_dir(folder: Path, manifest: Path) -> Path:
    """``folder``'s contents into ``manifest``'s parts; the manifest is written last, so a bundle without
    it is unfinished and is packed again."""
    stem = manifest.name.removesuffix(".json")
    manifest.parent.mkdir(parents=True, exist_ok=True)
    whole = manifest.with_name(stem + ".tar.xz.tmp")
    with (
        lzma.open(whole, "wb", format=lzma.FORMAT_XZ, filters=XZ_FILTERS) as xz,
        tarfile.open(fileobj=xz, mode="w") as tar,
    ):
        for path in sorted(folder.iterdir()):
            tar.add(path, arcname=path.name)
    digest, parts = hashlib.sha256(), []
    with whole.open("rb") as src:
        while chunk := src.read(PART_BYTES):
            digest.update(chunk)
            part = manifest.with_name(f"{stem}.tar.xz.{len(parts):03d}")
            part.write_bytes(chunk)
            parts.append(part.name)
    whole.unlink()
    size = sum((manifest.parent / p).stat().st_size for p in parts)
    write_json(manifest, {"parts": parts, "bytes": size, "sha256": digest.hexdigest()})
    return manifest


def bundle_bytes(manifest: Path) -> int:
    return int(json.loads(manifest.read_text())["bytes"])


def pack_fork_point(run_dir: Path, version: int, state: Path) -> Path:
    """The source ``run_dir`` at ``version``, as a run directory forkable at that version and at the first
    version of each earlier phase but warm-up (a lever on reflection-mode initialisation forks its start)."""
    from comap_async.run_files import RUN_CONFIGS
    from experiments.fork import FORK_FILE, copy_adapters, fork_run, forkable_versions

    out = state / bundle_name(run_dir.name, version)
    versions = forkable_versions(run_dir)
    fork_phase = versions[version].get("phase")
    starts = {
        min(v for v, m in versions.items() if m.get("phase") == phase)
        for phase in {m.get("phase") for v, m in versions.items() if v < version}
        if phase not in ("warmup", fork_phase)
    }
    with tempfile.TemporaryDirectory(dir=run_dir.parent) as tmp:  # beside the run: the same disk
        copy = Path(tmp) / run_dir.name
        fork_run(run_dir, copy, version)  # the replay cut at version's publish
        (copy / FORK_FILE).unlink()  # the source is not a fork: its own files follow
        (copy / RUN_CONFIGS).unlink(missing_ok=True)
        for path in _run_files(run_dir):
            shutil.copy2(path, copy / path.name)
        for v in sorted(starts):
            ckpt = versions[v]["checkpoint"]
            shutil.copytree(ckpt, copy / "checkpoints" / ckpt.name)  # copy2: its mtime is the fork's cut
            copy_adapters(run_dir / "adapters", copy / "adapters", v)
        return _pack_dir(copy, out)


def pack_fork_end(run_dir: Path, version: int, state: Path) -> Path:
    """A trained fork's end: its run files and the adapters of ``version`` (what its rows play)."""
    from experiments.fork import copy_adapters

    out = state / bundle_name(run_dir.name, version)
    with tempfile.TemporaryDirectory(dir=run_dir.parent) as tmp:  # beside the run: the same disk
        copy = Path(tmp) / run_dir.name
        (copy / "adapters").mkdir(parents=True)
        for path in _run_files(run_dir):
            shutil.copy2(path, copy / path.name)
        copy_adapters(run_dir / "adapters", copy / "adapters", version)
        return _pack_dir(copy, out)


def unpack(manifest: Path, run_dir: Path) -> None:
    """The bundle of ``manifest`` into ``run_dir`` (replacing what is there), all or nothing; one line
    naming the part when a part is missing or is not what was packed."""
    from experiments.spec import SpecError

    meta = json.loads(manifest.read_text())
    run_dir.parent.mkdir(parents=True, exist_ok=True)
    whole = run_dir.with_name(run_dir.name + ".tar.xz.tmp")
    digest = hashlib.sha256()
    with whole.open("wb") as out:
        for name in meta["parts"]:
            try:
                chunk = (manifest.parent / name).read_bytes()
            except OSError as exc:
                whole.unlink()
                raise SpecError(f"{manifest}: part {name} cannot be read ({exc.strerror or exc})") from None
            digest.update(chunk)
            out.write(chunk)
    if digest.hexdigest() != meta["sha256"]:
        whole.unlink()
        raise SpecError(f"{manifest}: its parts are not the ones packed (sha256 differs): pack it again")
    tmp = run_dir.with_name(run_dir.name + ".unpacking")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        with lzma.open(whole) as xz, tarfile.open(fileobj=xz, mode="r") as tar:
            tar.extractall(tmp, filter="data")  # keeps the files' mtimes; refuses paths out of tmp
    finally:
        whole.unlink()
    shutil.rmtree(run_dir, ignore_errors=True)
    tmp.replace(run_dir)


def save_ledgers(work: Path, state: Path) -> None:
    """The work directory's ledgers copied into ``state`` (each written whole; the source's run directory
    relative to the repository, as in results.json: a committed file names no path outside it)."""
    from experiments.report import repo_relative

    state.mkdir(parents=True, exist_ok=True)
    for name in LEDGERS:
        path = work / name
        if path.exists():
            content = json.loads(path.read_text())
            source = content.get("source") if name == "ledger.json" else None
            if isinstance(source, dict) and source.get("run_dir"):
                source["run_dir"] = repo_relative(source["run_dir"])
            write_json(state / name, content)


def restore_ledgers(work: Path, state: Path) -> bool:
    """``state``'s ledgers into a work directory that has none; True when they were restored (the
    runner records a source it trained by the work directory it finds it in, which may have moved)."""
    if (work / "ledger.json").exists() or not (state / "ledger.json").exists():
        return False
    work.mkdir(parents=True, exist_ok=True)
    for name in LEDGERS:
        if (state / name).exists():
            shutil.copy2(state / name, work / name)
    return True


def remove_bundles(state: Path, run: str) -> None:
    """Every bundle of ``run`` (a fork trained again has another end)."""
    for manifest in state.glob(f"{run}-v*.json"):
        for name in json.loads(manifest.read_text()).get("parts", []):
            (state / name).unlink(missing_ok=True)
        manifest.unlink()
    for part in state.glob(f"{run}-v*.tar.xz.*"):  # of a bundle whose packing was cut short
        part.unlink()
