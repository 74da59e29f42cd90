"""``comap compare``'s cells: what one row of the table measured (its key: the run, version, method,
games and the settings that change play), stored under ``OUT/cells`` as soon as it exists, so a
comparison stopped half-way goes on with ``--resume`` from the next unplayed game."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


@dataclass
class Cell:
    """One row of the table still to be played, or read back: ``key`` says what it measured."""

    what: str
    label: str
    kind: str
    method: str
    registry: Any
    key: dict[str, Any]
    run: str | None = None
    ablation: list[str] = field(default_factory=list)
    methods: list[str] = field(default_factory=list)
    """The run's related methods' switches (``ablation.json``)."""
    played_as: list[str] | None = None
    """A prompting method on a run's adapters (``--methods-from``): that run's switches, so the policy
    sees states as it was trained on them (``env.show_location``); None: the config's."""

    def config(self, cfg: Any) -> Any:
        """How this row is played: a run with its own ablation and switches, a prompting method on a
        run's adapters with that run's switches, one on the base model with the config's."""
        if self.run is not None:
            return with_ablation(cfg, self.ablation, self.methods)
        return cfg if self.played_as is None else cfg.playing(self.played_as)

    @property
    def id(self) -> str:
        return key_digest(self.key)


def key_digest(key: dict[str, Any]) -> str:
    """A short stable name for a cell's key (its stored file, its place among the reports)."""
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:20]


def with_ablation(cfg: Any, ablation: list[str], methods: list[str] | tuple[str, ...] = ()) -> Any:
    """``cfg`` with exactly the switches ``ablation`` on, and the related methods' switches among
    ``methods`` that change how an episode is played (``config.PLAY_SWITCHES``): how a run is played,
    as it trained."""
    from comap_async.config import ablations

    played = cfg.playing(methods)
    return played.model_copy(update={"method": played.method.model_copy(update={"ablation": ablations(ablation)})})


DECODING_SWITCHES = (
    ("actor", "admissible_choice"),
    ("actor", "revise_other_action"),
)
"""Settings of how actions are decoded that came after rows were stored (every row plays the config's)."""


def cell_key(cfg: Any, source: str, version: int, method: str, split: str, games: list) -> dict[str, Any]:
    """What a row's figures depend on: the adapters (run directory and version), the method, the
    games, and the settings that change how an episode is played (not where files or servers are)."""
    from comap_async.config import PLAY_SWITCHES, PROMPT_FORM_SWITCHES

    settings = cfg.model_dump(mode="json", include={"env", "eval", "method", "actor", "model"})
    settings["env"].pop("data_dir", None)
    settings["model"].pop("cache_dir", None)
    # how many cores and games at once play it, not how it is played
    settings["model"].pop("torch_threads", None)
    for name in ("envs", "env_workers"):
        settings["actor"].pop(name, None)
    # play and decoding switches came after rows were stored: one that is off keeps their keys (and so
    # --resume) as they were
    for section, key in (*PLAY_SWITCHES.values(), *DECODING_SWITCHES):
        if not settings[section].get(key):
            settings[section].pop(key, None)
    # the prompt form as the play switches it replaced, each stored only when on: rows stored before
    # it keep their keys
    settings["env"].update(dict.fromkeys(PROMPT_FORM_SWITCHES[settings["env"].pop("prompt_form")], True))
    settings["eval"].pop("envs", None)
    settings["seed"] = cfg.run.seed
    settings["inference"] = cfg.model_dump(mode="json", include={"inference": {"dtype"}})["inference"]
    return {
        "source": source,
        "version": version,
        "method": method,
        "split": split,
        "games": [game.name for game in games],
        "settings": settings,
    }


STALE = "measured before its adapters were written (a run forked again under its name?): played again"


class CellStore:
    """``OUT/cells``: each row's evaluation report as soon as it is measured, under a name hashed from
    its key, and a row's finished episodes while it is played, so ``--resume`` plays only the games
    a stopped comparison had not finished."""

    def __init__(self, out: Path, log: Any = None) -> None:
        self.root = out / "cells"
        self.log = log
        self.stale: list[str] = []  # cells older than their adapters, moved aside

    def _path(self, key: dict[str, Any]) -> Path:
        return self.root / f"{key_digest(key)}.json"

    @staticmethod
    def published_at(key: dict[str, Any]) -> float:
        """When the adapters a key names were written (newest file of ``SOURCE/adapters/*-vN``; 0 for
        the base model). A key names a run directory and a version, not weights: a run forked again
        under the same name reaches the same versions with other weights."""
        adapters = Path(key["source"]) / "adapters"
        if key["source"] == "base" or not adapters.is_dir():
            return 0.0
        files = [f for d in adapters.glob(f"*-v{key['version']}") if d.is_dir() for f in d.iterdir()]
        return max((f.stat().st_mtime for f in files), default=0.0)

    def _read(self, path: Path, key: dict[str, Any]) -> dict[str, Any] | None:
        """The stored cell for ``key``, if measured after its adapters were written; a stale one is
        moved aside (``*.stale``), not deleted, and its row played again."""
        try:
            stored = json.loads(path.read_text())
        except (FileNotFoundError, ValueError):  # none yet, or a file cut short: the row is played
            return None
        if stored.get("key") != key:
            return None
        if path.stat().st_mtime < self.published_at(key):
            path.replace(path.with_name(path.name + ".stale"))
            self.stale.append(path.name)
            if self.log is not None:
                self.log.warning(
                    "compare.row_stale",
                    cell=path.name,
                    source=key["source"],
                    version=key["version"],
                    method=key["method"],
                    why=STALE,
                )
            return None
        return stored

    def load(self, key: dict[str, Any]) -> dict[str, Any] | None:
        stored = self._read(self._path(key), key)
        return stored["report"] if stored is not None else None

    def save(self, key: dict[str, Any], report: dict[str, Any]) -> None:
        self._write(self._path(key), {"key": key, "report": report})
        self._partial_path(key).unlink(missing_ok=True)

    def _partial_path(self, key: dict[str, Any]) -> Path:
        return self.root / f"{key_digest(key)}.partial.json"

    def load_partial(self, key: dict[str, Any]) -> tuple[dict[str, dict[str, Any]], float]:
        """The episodes a row cut short had finished (by game name) and the wall time they took."""
        stored = self._read(self._partial_path(key), key)
        if stored is None:
            return {}, 0.0
        return {r["game"]: r for r in stored["episodes"]}, float(stored["wall_s"])

    def save_partial(self, key: dict[str, Any], episodes: list[dict[str, Any]], wall_s: float) -> None:
        self._write(self._partial_path(key), {"key": key, "episodes": episodes, "wall_s": wall_s})

    def _write(self, path: Path, content: dict[str, Any]) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(content, indent=2))
        tmp.replace(path)
