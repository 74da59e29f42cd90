"""Atomic checkpoints: adapters (teacher included), optimizer, scheduler, step, RNG, phase.

A checkpoint is a directory ``step-00000123`` written under a temporary name and renamed into
place, so a learner killed mid-write leaves the previous checkpoint intact; ``latest()`` only ever
sees complete ones.
"""

from __future__ import annotations

import copy
import os
import random
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch

from comap_async.run_files import CHECKPOINT_STATE
from comap_async.wire.messages import ROLES
from learner.peft_model import adapter_state, load_adapter_state

_FILE = CHECKPOINT_STATE


def rng_state() -> dict[str, Any]:
    """The RNG states a step's dropout and sampling draw from (a checkpoint restores them)."""
    import numpy as np

    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():  # dropout masks on a GPU draw from its own generators
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _set_rng_state(state: dict[str, Any]) -> None:
    import numpy as np

    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"].cpu())  # a ByteTensor on the CPU, whatever device it was loaded to
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all([s.cpu() for s in state["cuda"]])


PINNED = "pinned"


def save_checkpoint(root: Path, trainer: Any, extra: dict[str, Any], keep: int = 3, pin: bool = False) -> Path:
    """Write ``root/step-N`` atomically and keep the newest ``keep`` checkpoints, and every pinned
    one (``pin``: the first step of a phase, where a fork redoes that phase with other settings)."""
    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".tmp-", dir=root))
    try:
        with trainer.update_lock:  # a step may be running in another thread: take the last completed one
            state = {
                "step": trainer.step,
                "adapters": {role: adapter_state(trainer.model, role) for role in ROLES},
                "optimizer": copy.deepcopy(trainer.optimizer.state_dict()),
                "scheduler": trainer.scheduler.state_dict(),
                "rng": trainer.rng_at_step_start,
                "label_counts": list(trainer.label_counts),
                "extra": extra,
            }
        torch.save(state, tmp / _FILE)
        if pin:
            (tmp / PINNED).touch()
        final = root / f"step-{state['step']:08d}"
        with open(tmp / _FILE, "rb") as fh:
            os.fsync(fh.fileno())
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    for old in [p for p in sorted(root.glob("step-*")) if not (p / PINNED).exists()][:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    return final


def pinned_steps(root: Path) -> set[int]:
    """The steps of the pinned checkpoints under ``root`` (each phase's first)."""
    return {int(p.name.split("-")[1]) for p in root.glob("step-*") if (p / PINNED).exists()}


def latest(root: Path) -> Path | None:
    done = sorted(p for p in root.glob("step-*") if (p / _FILE).is_file())
    return done[-1] if done else None


def load_checkpoint(path: Path, trainer: Any) -> dict[str, Any]:
    """Restore everything into ``trainer``; returns the ``extra`` dict saved with it."""
    # to the CPU first: RNG states must stay there (set_rng_state refuses a CUDA tensor); adapter
    # tensors are copied into the parameters and the optimizer moves its state to theirs
    state = torch.load(path / _FILE, map_location="cpu", weights_only=False)
    for role in ROLES:
        load_adapter_state(trainer.model, role, state["adapters"][role])
    trainer.optimizer.load_state_dict(state["optimizer"])
    trainer.scheduler.load_state_dict(state["scheduler"])
    trainer.step = state["step"]
    trainer.label_counts = list(state.get("label_counts", (0, 0)))  # absent in checkpoints before bce_balance
    _set_rng_state(state["rng"])
    trainer.rng_at_step_start = state["rng"]
    return state["extra"]
