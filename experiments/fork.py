"""``comap fork``: a new run that starts from another run's published version.

Ablations and variants then share one warm-up instead of each repeating it (warm-up is most of a
CPU run's first hour). The new run gets, from the source run at version N:

* the learner's checkpoint taken with that publish (every publish is one), so the learner resumes
  at version N's step with its optimizer, schedule and phase;
* version N's adapters (policy, world model, teacher), which the learner loads into the inference
  servers when it starts, as after any restart;
* a copy of the replay holding what the source had stored up to that publish (records stamped
  later are cut), with the registry set to version N and the held-out results of versions up to N.

Its own switches (``method.ablation``, any ``--set``) are whatever the new run is started with:
``COMAP_OVERRIDES="run.name=NEW method.ablation=frozen_wm" honcho start``. ``fork.json`` in the new
run directory records where it came from.
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path
from typing import Any

from comap_async.errors import CommandError
from comap_async.run_files import CHECKPOINT_STATE, VERSION_META, copy_run_configs
from comap_async.wire.messages import ROLES, Registry, adapter_name

FORK_FILE = "fork.json"


class ForkError(CommandError):
    pass


def forkable_versions(src: Path, adapters: Path | None = None) -> dict[int, dict[str, Any]]:
    """Published versions of run ``src`` (its adapters in ``adapters``, default ``src/adapters``)
    whose checkpoint is still there: version -> its metadata (``step``, ``phase``) and
    ``checkpoint`` (the step-N directory)."""
    adapters = adapters or src / "adapters"
    ckpts = {
        int(p.name.split("-")[1]): p for p in (src / "checkpoints").glob("step-*") if (p / CHECKPOINT_STATE).is_file()
    }
    out: dict[int, dict[str, Any]] = {}
    for meta_file in adapters.glob(f"policy-v*/{VERSION_META}"):
        meta = json.loads(meta_file.read_text())
        version, step = int(meta["version"]), int(meta["step"])
        if step in ckpts and all((adapters / adapter_name(r, version)).is_dir() for r in ROLES):
            out[version] = {**meta, "checkpoint": ckpts[step]}
    return out


def fork_run(
    src: Path, dst: Path, version: int | None = None, src_adapters: Path | None = None, dst_adapters: Path | None = None
) -> dict[str, Any]:
    """Create run directory ``dst`` from run ``src`` at ``version`` (default: the newest forkable).
    ``src_adapters``/``dst_adapters``: the two runs' adapter roots (``inference.adapter_root``;
    default ``<run dir>/adapters``); they must differ, or both runs would publish the same names."""
    src_adapters, dst_adapters = src_adapters or src / "adapters", dst_adapters or dst / "adapters"
    if src_adapters.resolve() == dst_adapters.resolve():
        raise ForkError(
            f"the fork would publish into its source's adapter root {src_adapters}: give the new run "
            "its own inference.adapter_root"
        )
    if not (src / "replay").is_dir():
        raise ForkError(f"{src} is not a run directory (no replay/)")
    if dst.exists() and any(dst.iterdir()):
        raise ForkError(f"{dst} already exists and is not empty: choose another --name")
    versions = forkable_versions(src, src_adapters)
    if not versions:
        raise ForkError(
            f"{src} has no published version with its checkpoint still kept (checkpoints/step-N "
            "at the version's step): nothing to fork from"
        )
    if version is None:
        version = max(versions)
    if version not in versions:
        raise ForkError(
            f"version {version} of {src} cannot be forked (no checkpoint at its step); "
            f"forkable: {', '.join(map(str, sorted(versions)))}"
        )
    meta = versions[version]
    try:
        return _copy(src, dst, version, meta, src_adapters, dst_adapters)
    except BaseException:  # no half-made run directory is left to be started by mistake
        shutil.rmtree(dst, ignore_errors=True)
        for role in ROLES:
            shutil.rmtree(dst_adapters / adapter_name(role, version), ignore_errors=True)
        raise


def _copy(
    src: Path, dst: Path, version: int, meta: dict[str, Any], src_adapters: Path, dst_adapters: Path
) -> dict[str, Any]:
    import lmdb

    from broker.ingest import record_counters
    from broker.store import EVAL_KEY, ReplayStore
    from comap_async.wire.messages import STORES

    ckpt: Path = meta["checkpoint"]
    cut_ts = (ckpt / CHECKPOINT_STATE).stat().st_mtime  # the publish's checkpoint: written right after it
    dst.mkdir(parents=True, exist_ok=True)
    shutil.copytree(ckpt, dst / "checkpoints" / ckpt.name)
    copy_adapters(src_adapters, dst_adapters, version)
    (dst_adapters / "latest.json").write_text(json.dumps({k: v for k, v in meta.items() if k != "checkpoint"}))

    (dst / "replay").mkdir()
    source_env = lmdb.open(str(src / "replay"), readonly=True, max_dbs=16)
    try:
        source_env.copy(str(dst / "replay"), compact=True)  # a consistent snapshot, also of a live run
    finally:
        source_env.close()
    store = ReplayStore(dst / "replay", dict.fromkeys(STORES, 1 << 40))
    try:
        removed = store.cut_after(cut_ts, version, uncount=record_counters)
        store.set_registry(msgspec_registry(meta["phase"], version, int(meta["step"])))
        results = store.get_meta(EVAL_KEY, {})
        store.put_meta(EVAL_KEY, {v: r for v, r in results.items() if int(v) <= version})
        kept = {s: store.count(s) for s in STORES}
    finally:
        store.close()
    record = {
        "source": str(src.resolve()),
        "version": version,
        "step": int(meta["step"]),
        "phase": meta["phase"],
        "source_ablation": meta.get("ablation", []),
        "cut_ts": cut_ts,
        "kept": kept,
        "cut": removed,
    }
    (dst / FORK_FILE).write_text(json.dumps(record, indent=1) + "\n")
    copy_run_configs(src, dst, record["step"])  # the fork's learner appends its own start after them
    return record


def copy_adapters(src_root: Path, dst_root: Path, version: int) -> None:
    """Every role's adapter of ``version`` from one adapter root to another (files and mtimes as they are)."""
    for role in ROLES:
        name = adapter_name(role, version)
        shutil.copytree(src_root / name, dst_root / name)


def msgspec_registry(phase: str, version: int, step: int) -> dict[str, Any]:
    """The broker's registry map with every role on ``version`` (as the learner announced it)."""
    import msgspec

    reg = Registry(
        phase=phase,
        versions=dict.fromkeys(ROLES, version),
        adapters={r: adapter_name(r, version) for r in ROLES},
        step=step,
    )
    return msgspec.to_builtins(reg)


def add_arguments(p: argparse.ArgumentParser) -> None:
    from comap_async.cli import add_config_arguments

    p.add_argument("source", help="the run to fork: its run.name under run.root, or its directory")
    p.add_argument("--name", required=True, help="the new run's run.name (a directory under run.root)")
    p.add_argument(
        "--version",
        type=int,
        default=None,
        help="the published version to start from (default: the newest whose checkpoint is kept)",
    )
    p.add_argument(
        "--source-adapters",
        type=Path,
        default=None,
        help="the source run's inference.adapter_root when it was not <its run dir>/adapters",
    )
    add_config_arguments(p)


def run(args: argparse.Namespace) -> int:
    from comap_async.config import load_config

    # the new run's settings: a run that trains, refused before anything is copied
    cfg = load_config(args.config, [*args.overrides, f"run.name={args.name}"], training=True)
    src = Path(args.source).expanduser()
    if not (src / "replay").is_dir():
        src = Path(cfg.run.root).expanduser() / args.source
    record = fork_run(src, cfg.run.dir, args.version, args.source_adapters, cfg.adapter_root)
    dst = cfg.run.dir
    print(
        f"forked {src} at version {record['version']} (step {record['step']}, {record['phase']}) into {dst}: "
        + ", ".join(f"{s} {n}" for s, n in record["kept"].items())
        + f'; start it with COMAP_OVERRIDES="run.name={args.name} ..." honcho start'
    )
    return 0
