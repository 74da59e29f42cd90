"""Running the system for a while, for the experiments and the benchmarks that train runs: ``honcho start``
of the training processes for some minutes, until a run reaches a phase or a learner step, with a bar over
the wall time, then SIGINT (the learner checkpoints). honcho is tied to this process: killed by any
signal, even -9, this process takes the system down with it (SIGINT from the kernel), so a resumed
experiment never finds the old one's processes on its ports."""

from __future__ import annotations

import contextlib
import json
import os
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable

ROOT = Path(__file__).resolve().parents[1]
TRAINING = ("broker", "inference", "learner", "actor")
# ``python -c`` asks for PR_SET_PDEATHSIG, then execs the command: the request survives exec, so the
# command gets SIGINT when this process dies (no preexec_fn, which is unsafe in a threaded parent)
TIED_EXEC = (
    sys.executable,
    "-c",
    "import os, signal, sys; from comap_async.lifetime import die_with_parent; "
    "die_with_parent(signal.SIGINT); os.execvp(sys.argv[1], sys.argv[1:])",
)


def newest_checkpoint_step(run_dir: Path) -> int | None:
    """The learner step of the run's newest whole checkpoint (``checkpoints/step-N`` holding its state), or
    None before the first: how far a learner has trained, to within ``learner.checkpoint_every`` steps."""
    from comap_async.run_files import CHECKPOINT_STATE

    steps = [
        int(p.name.split("-")[1])
        for p in (run_dir / "checkpoints").glob("step-*")
        if p.name.split("-")[1].isdigit() and (p / CHECKPOINT_STATE).is_file()
    ]
    return max(steps, default=None)


def bar_postfix(run_dir: Path) -> str:
    """``v<newest published version> step <newest checkpoint's step>``, each part once it exists."""
    parts = []
    try:
        parts.append(f"v{json.loads((run_dir / 'adapters' / 'latest.json').read_text())['version']}")
    except (OSError, ValueError, KeyError):  # not published yet, or mid-write
        pass
    step = newest_checkpoint_step(run_dir)
    if step is not None:
        parts.append(f"step {step}")
    return " ".join(parts)


def wait_with_bar(
    proc: subprocess.Popen, name: str, minutes: float, run_dir: Path, until: Callable[[], bool] | None = None
) -> bool:
    """Wait up to ``minutes`` for ``proc`` (``TimeoutExpired`` when it is still running then), with a bar
    over the wall time that shows the run's newest published version and checkpointed learner step
    (:func:`bar_postfix`). True when ``until()`` held
    (checked every 10 s, and when the process stops), False when the process stopped by itself short of it."""
    from tqdm import tqdm

    deadline = time.monotonic() + 60 * minutes
    with tqdm(total=round(60 * minutes), desc=name, unit="s", file=sys.stderr) as bar:
        while True:
            left = deadline - time.monotonic()
            try:
                proc.wait(timeout=max(0.0, min(10.0, left)))
                # a system whose learner ends at its step budget stops by itself, its aim reached
                return until is not None and until()
            except subprocess.TimeoutExpired:
                if until is not None and until():
                    return True
                if left <= 10.0:
                    raise
            bar.n = round(60 * minutes - max(0.0, deadline - time.monotonic()))
            bar.set_postfix_str(bar_postfix(run_dir), refresh=False)
            bar.refresh()


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # a zombie (exited, not yet reaped by its new parent) holds no port or file
    with contextlib.suppress(OSError):
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    return True


def wait_for_previous_system(pid_file: Path, wait_s: float = 60.0) -> None:
    """A system this module started before, whose starter died (killed -9: its honcho got SIGINT from the
    kernel), may still be stopping: wait for it (its learner checkpoints), then kill what is left of it,
    so the next system does not meet it on its ports or in its run directory."""
    if not pid_file.exists():
        return
    with contextlib.suppress(ValueError, OSError):
        pid = int(pid_file.read_text())
        deadline = time.monotonic() + wait_s
        while pid_alive(pid) and time.monotonic() < deadline:
            time.sleep(0.5)
        if pid_alive(pid):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pid, signal.SIGKILL)
            while pid_alive(pid):
                time.sleep(0.2)
    pid_file.unlink(missing_ok=True)


def procfile_with(log_dir: Path, name: str, learner_args: list[str]) -> list[str]:
    """honcho's arguments for the repository's Procfile, or for a copy of it in ``log_dir`` whose learner line
    ends with ``learner_args`` (``--max-steps N``: the learner stops at its budget, so no step past it is
    trained and no version at it is rotated away before it is read)."""
    if not learner_args:
        return []
    lines = []
    for line in (ROOT / "Procfile").read_text().splitlines():
        if line.startswith("learner:"):
            line = f"{line} {shlex.join(learner_args)}"
        lines.append(line)
    path = log_dir / f"Procfile.{name}"
    path.write_text("\n".join(lines) + "\n")
    return ["-f", str(path), "-d", str(ROOT)]


@contextlib.contextmanager
def system_running(
    name: str, config: str, overrides: list[str], log_dir: Path, processes=TRAINING, learner_args: list[str] = ()
):
    """``honcho start`` of run ``name``'s ``processes`` (its output appended to ``log_dir/<name>.log``) for
    the ``with`` block; stopped on leaving it (SIGINT: honcho stops every process, the learner
    checkpoints; SIGKILL after 90 s). ``learner_args`` are added to the learner's command line."""
    env = {**os.environ, "COMAP_OVERRIDES": shlex.join([f"run.name={name}", *overrides])}
    env["COMAP_CONFIG"] = config  # the same config as the evaluation's (honcho's Procfile reads it)
    # SIGINT and SIGTERM both leave the block through its finally: a background job of a script starts with
    # SIGINT ignored, and a plain SIGTERM would end this process and leave the system running
    handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    for sig in handlers:
        signal.signal(sig, signal.default_int_handler)
    pid_file = log_dir / "system.pid"  # one system at a time writes its runs' logs here
    wait_for_previous_system(pid_file)
    try:
        with open(log_dir / f"{name}.log", "ab") as log:
            proc = subprocess.Popen(
                [*TIED_EXEC, "honcho", "start", *procfile_with(log_dir, name, list(learner_args)), *processes],
                cwd=ROOT,
                env=env,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
            pid_file.write_text(str(proc.pid))
            try:
                yield proc
            finally:
                if proc.poll() is None:
                    os.killpg(proc.pid, signal.SIGINT)
                    try:
                        proc.wait(timeout=90)
                    except subprocess.TimeoutExpired:
                        os.killpg(proc.pid, signal.SIGKILL)
                        proc.wait()
                pid_file.unlink(missing_ok=True)
    finally:
        for sig, handler in handlers.items():
            signal.signal(sig, handler)


def run_system(
    name: str,
    config: str,
    overrides: list[str],
    minutes: float,
    log_dir: Path,
    run_dir: Path,
    until: Callable[[], bool] | None = None,
    learner_args: list[str] = (),
) -> float:
    """Run run ``name`` (in ``run_dir``; a run already there resumes) for ``minutes`` or until
    ``until()``, then stop it (SIGINT: the learner checkpoints); returns the wall time it ran. A system
    that stops by itself short of ``until()`` is an error."""
    t0 = time.time()
    with system_running(name, config, overrides, log_dir, learner_args=learner_args) as proc:
        try:
            if wait_with_bar(proc, name, minutes, run_dir, until):
                return time.time() - t0
        except subprocess.TimeoutExpired:
            return time.time() - t0
    raise SystemExit(
        f"{Path(sys.argv[0]).stem}: {name}'s system stopped by itself after {time.time() - t0:.0f} s "
        f"(see {log_dir / f'{name}.log'})"
    )


def first_version_in_phase(run_dir: Path, phase: str) -> dict | None:
    """The run's first forkable version published in ``phase`` (``version``, ``step``, ``phase``), or None
    while it has none. The learner publishes (and pins a checkpoint) as each phase begins, so the first
    ``coevolve`` version is the warmed-up point a table forks (warm-up SFT and reflection-mode initialisation
    done) and the first ``reflect_init`` one is warm-up SFT's end."""
    from experiments.fork import forkable_versions

    found = {v: m for v, m in forkable_versions(run_dir).items() if m.get("phase") == phase}
    if not found:
        return None
    version = min(found)
    return {"version": version, "step": int(found[version]["step"]), "phase": phase}


def write_json(path: Path, content: Any) -> None:
    """Written whole or not at all: a kill between two writes leaves the previous file."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(content, indent=1) + "\n")
    os.replace(tmp, path)


WALL_SAVE_S = 60.0
"""How often a training sitting writes its wall time so far to its ledger."""


def run_to_phase(
    name: str, phase: str, config: str, overrides: list[str], max_minutes: float, out: Path, root: Path, ledger: Path
) -> dict:
    """Run run ``name`` (the whole system but the evaluator; from empty, or resuming one stopped earlier)
    until it publishes its first version in ``phase``, and stop it. The wall time adds up over sittings in
    ``ledger``; returns its record with the version reached (:func:`first_version_in_phase`)."""
    record = json.loads(ledger.read_text()) if ledger.exists() else {"name": name, "wall_s": 0}
    reached = first_version_in_phase(root / name, phase)
    if reached is None:
        t0, before, written = time.time(), record["wall_s"], [time.monotonic()]

        def save_wall() -> None:
            record["wall_s"] = round(before + time.time() - t0)
            write_json(ledger, record)
            written[0] = time.monotonic()

        def reached_phase() -> bool:
            # the sitting's time so far, every minute: a sitting killed with -9 (no finally) still counts
            if time.monotonic() - written[0] >= WALL_SAVE_S:
                save_wall()
            return first_version_in_phase(root / name, phase) is not None

        try:
            run_system(name, config, overrides, max_minutes, out, root / name, until=reached_phase)
        finally:  # a sitting stopped by a signal counts too: the run resumes from its checkpoint next time
            save_wall()
        reached = first_version_in_phase(root / name, phase)
    record.update(reached or {})
    write_json(ledger, record)  # the wall time so far also when it fell short
    if reached is None:
        raise SystemExit(
            f"{Path(sys.argv[0]).stem}: {name} published no {phase} version in {max_minutes:.0f} minutes "
            f"(see {out / f'{name}.log'}); --resume goes on from its checkpoint"
        )
    return record


def run_records(run_dir: Path, store: str, who: str) -> list[dict]:
    """Every record of a run's replay ``store``, oldest first (read-only, beside a running broker);
    ``who`` (the benchmark) names the one-line error when the run has no replay."""
    import msgpack

    from broker.store import ReplayStore
    from comap_async.wire.messages import STORES

    replay_dir = run_dir / "replay"
    if not (replay_dir / "data.mdb").is_file():
        raise SystemExit(f"{who}: no replay at {replay_dir}")
    replay = ReplayStore(replay_dir, dict.fromkeys(STORES, 1 << 40), readonly=True)
    try:
        return [msgpack.unpackb(b, raw=False) for b in replay.iter_store(store)]
    finally:
        replay.close()


def stop_group(proc: subprocess.Popen, timeout_s: float = 120) -> None:
    """SIGTERM a process started with ``start_new_session=True`` and its children; SIGKILL after ``timeout_s``."""
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)


def wait_for(pred: Callable[[], bool], timeout_s: float, what: str, procs: dict | None = None) -> None:
    """Until ``pred()``; a process of ``procs`` (process -> its log) that exits meanwhile ends the wait
    with its log's last line."""
    deadline = time.monotonic() + timeout_s
    while not pred():
        for proc, log in (procs or {}).items():
            if proc.poll() is not None:
                lines = log.read_text(errors="replace").strip().splitlines() or ["(empty log)"]
                raise SystemExit(f"{what}: {log.name} exited with {proc.returncode}: {lines[-1]}")
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what} after {timeout_s:.0f} s")
        time.sleep(1)


def copy_trained_adapters(source: Path, version: int, root: Path) -> dict[str, Path]:
    """A run's adapters of ``version`` (``source/policy-vN``, ``wm-vN``, ``wm_teacher-vN``) copied under
    ``root`` as version 1, the names a fresh server serves; a missing one ends the caller with its path."""
    import shutil

    from comap_async.wire.messages import ROLES, adapter_name

    out = {}
    for role in ROLES:
        src = source / adapter_name(role, version)
        if not (src / "adapter_model.safetensors").is_file():
            raise SystemExit(f"no adapter at {src} (a run's adapter directory and a version it holds)")
        out[role] = Path(shutil.copytree(src, root / adapter_name(role, 1), dirs_exist_ok=True))
    return out
