"""ALFWorld game discovery and data provisioning (no alfworld/textworld import).

The data root has the ``alfworld-download`` layout: ``<root>/json_2.1.1/<split>/<task folder>/
<trial>/{game.tw-pddl,traj_data.json}``. Discovery applies the same filters as the ``alfworld``
package's ``AlfredTWEnv.collect_game_files`` (movable-receptacle and sliced tasks skipped, task
types selected, games without a ``solvable: true`` file skipped), which gives 140 valid_seen and
134 valid_unseen games on the official data. Paths are sorted so that a seed alone decides a
sample on any file system (alfworld itself keeps ``os.walk`` order).
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import tarfile
import tempfile
from collections.abc import Iterable, Sequence
from pathlib import Path

from comap_async.envs.base import GameInfo
from comap_async.errors import CommandError

TASK_TYPES: dict[int, str] = {
    1: "pick_and_place_simple",
    2: "look_at_obj_in_light",
    3: "pick_clean_then_place_in_recep",
    4: "pick_heat_then_place_in_recep",
    5: "pick_cool_then_place_in_recep",
    6: "pick_two_obj_and_place",
}
TASK_TYPE_IDS = {name: i for i, name in TASK_TYPES.items()}


def task_type_ids(names: Iterable[str]) -> list[int]:
    """``env.tasks`` as ALFWorld's task type numbers; one line naming the known ones for a name that is not."""
    unknown = [n for n in names if n not in TASK_TYPE_IDS]
    if unknown:
        raise CommandError(f"env.tasks: unknown ALFWorld task {', '.join(unknown)} (known: {', '.join(TASK_TYPE_IDS)})")
    return [TASK_TYPE_IDS[n] for n in names]


SPLITS = ("train", "valid_seen", "valid_unseen", "valid_train")
JSON_DIR = "json_2.1.1"
DEFAULT_CACHE = "~/.cache/comap-async/alfworld"

HOW_TO_GET_DATA = (
    "get the ALFWorld games with `pip install alfworld && alfworld-download` (then set "
    "ALFWORLD_DATA to its folder, default ~/.cache/alfworld), or extract the offline archives with "
    "`comap data alfworld --archive ../shared/data/alfworld/*.tar.xz --to DIR` and pass `--data DIR` "
    "(or set env.data_dir / ALFWORLD_DATA)"
)


class AlfworldDataError(CommandError, FileNotFoundError):
    """The ALFWorld games are missing or incomplete; the message says how to get them."""


def split_dir(data_root: str | os.PathLike[str], split: str) -> Path:
    """The folder of ``split`` under a data root (the root itself or its ``json_2.1.1``)."""
    if split not in SPLITS:
        raise ValueError(f"unknown ALFWorld split {split!r}; expected one of {', '.join(SPLITS)}")
    root = Path(data_root).expanduser()
    for candidate in (root / JSON_DIR / split, root / split):
        if candidate.is_dir():
            return candidate
    raise AlfworldDataError(
        f"no ALFWorld split {split!r} under {root} (looked for {root / JSON_DIR / split}); {HOW_TO_GET_DATA}"
    )


def _is_solvable(game_file: Path) -> bool:
    with open(game_file) as f:
        # the key sits after the large PDDL strings; json is still the cheapest exact reader
        return bool(json.load(f).get("solvable", False))


def discover_games(
    data_root: str | os.PathLike[str],
    split: str,
    task_types: Iterable[int] | None = None,
    max_games: int | None = None,
    seed: int = 0,
) -> list[GameInfo]:
    """The split's playable games, filtered like alfworld; ``max_games`` samples with ``seed``."""
    base = split_dir(data_root, split)
    wanted = set(TASK_TYPES) if task_types is None else set(task_types)
    unknown = wanted - set(TASK_TYPES)
    if unknown:
        raise ValueError(f"unknown ALFWorld task types {sorted(unknown)}; known: {TASK_TYPES}")
    games: list[GameInfo] = []
    for traj_file in sorted(base.glob("*/*/traj_data.json")):
        trial = traj_file.parent
        if "movable" in str(trial) or "Sliced" in str(trial):
            continue
        game_file = trial / "game.tw-pddl"
        if not game_file.exists():
            continue
        with open(traj_file) as f:
            task_type = TASK_TYPE_IDS.get(json.load(f)["task_type"])
        if task_type not in wanted or not _is_solvable(game_file):
            continue
        games.append(GameInfo(str(game_file), split, task_type, f"{split}/{trial.parent.name}/{trial.name}"))
    if not games:
        raise AlfworldDataError(
            f"no playable ALFWorld games in {base} for task types {sorted(wanted)}; {HOW_TO_GET_DATA}"
        )
    if max_games is not None and max_games < len(games):
        games = sorted(random.Random(seed).sample(games, max_games), key=lambda g: g.path)
    return games


def resolve_data_root(explicit: str | os.PathLike[str] | None = None) -> Path:
    """``explicit``, else ``$ALFWORLD_DATA``; a clear error when neither is set."""
    root = explicit or os.environ.get("ALFWORLD_DATA")
    if not root:
        raise AlfworldDataError(f"no ALFWorld data root given; {HOW_TO_GET_DATA}")
    path = Path(root).expanduser()
    if not path.is_dir():
        raise AlfworldDataError(f"ALFWorld data root {path} does not exist; {HOW_TO_GET_DATA}")
    return path


def default_archive_dir() -> Path:
    """``<repo>/../shared/data/alfworld``: where the offline archives sit beside a checkout."""
    return Path(__file__).resolve().parents[3] / "shared" / "data" / "alfworld"


def _marker(to: Path, archive: Path) -> Path:
    # by content, not mtime: the same archives copied afresh (a new checkout, a CI clone) are not
    # extracted again (hashing the 6 MB of archives takes milliseconds; extracting them, minutes)
    digest = hashlib.sha256(archive.read_bytes()).hexdigest()[:16]
    return to / f".extracted-{archive.name}-{digest}"


def extract_archives(archives: Sequence[str | os.PathLike[str]], to: str | os.PathLike[str]) -> list[Path]:
    """Extract ALFWorld archives into ``to`` once; returns the archives actually extracted now.

    A marker per archive (its name and a hash of its content) makes a second run a no-op; it is written only
    after a complete extraction, so an interrupted run extracts again.
    """
    dest = Path(to).expanduser()
    dest.mkdir(parents=True, exist_ok=True)
    done: list[Path] = []
    for archive in map(Path, archives):
        if not archive.is_file():
            raise AlfworldDataError(f"archive {archive} not found; {HOW_TO_GET_DATA}")
        marker = _marker(dest, archive)
        if marker.exists():
            continue
        # into a scratch folder first, then each file renamed into place: an extraction cut short
        # (a killed test, a full disk) never leaves a truncated game where a complete one was
        with tempfile.TemporaryDirectory(dir=dest, prefix=".extracting-") as scratch:
            with tarfile.open(archive) as tar:
                # the "data" filter refuses absolute paths, links out of the tree and device files
                tar.extractall(scratch, filter="data")
            for path in sorted(Path(scratch).rglob("*")):
                target = dest / path.relative_to(scratch)
                if path.is_dir():
                    target.mkdir(exist_ok=True)
                else:
                    os.replace(path, target)
        marker.touch()
        done.append(archive)
    return done


def games_for_config(cfg, split: str) -> list[GameInfo]:
    """The registry's ``games`` part: ``split``'s games under ``env.data_dir`` (or ``$ALFWORLD_DATA``),
    of the configured task types, at most ``env.max_games`` drawn with the run seed."""
    return discover_games(
        resolve_data_root(cfg.alfworld_data),
        split,
        task_types=None if cfg.env.tasks is None else task_type_ids(cfg.env.tasks),
        max_games=cfg.env.max_games,
        seed=cfg.run.seed,
    )
