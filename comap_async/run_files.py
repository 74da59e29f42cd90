"""Files a run directory holds that other processes and commands read: the run's ablation (written
by the learner at start, read by ``comap compare``), the config of each learner start and each
published version's metadata."""

from __future__ import annotations

import json
import time
from pathlib import Path

RUN_ABLATION = "ablation.json"
"""``<run dir>/ablation.json``: ``{"ablation": [names switched on], "methods": [related methods'
switches on]}`` ([] and [] is CoMap itself; ``CoMapConfig.method_switches`` names the methods)."""
CHECKPOINT_STATE = "state.pt"
"""``<run dir>/checkpoints/step-N/state.pt``: the learner's checkpoint (``comap fork`` copies it)."""
RUN_CONFIGS = "config.jsonl"
"""``<run dir>/config.jsonl``: one line per learner start, the step it started at and the whole resolved
config (tokens left out), so a run's learning rate or loss shares can be read back after the fact."""
SECRET_FIELDS = frozenset({"http_token", "admin_token"})
VERSION_META = "comap.json"
"""``<adapter dir>/comap.json`` beside peft's files: version, phase, step and the run's ablation."""


def write_run_ablation(run_dir: Path, active: list[str], methods: list[str] | tuple[str, ...] = ()) -> Path:
    path = Path(run_dir) / RUN_ABLATION
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"ablation": list(active), "methods": list(methods)}) + "\n")
    return path


def append_run_config(run_dir: Path, config: dict, step: int, phase: str) -> Path:
    """Append one learner start to ``config.jsonl``; the bearer tokens are written as set or not, never
    their values."""

    def scrub(node: object) -> object:
        if isinstance(node, dict):
            return {k: (v is not None if k in SECRET_FIELDS else scrub(v)) for k, v in node.items()}
        return node

    start = {"ts": time.time(), "step": step, "phase": phase, "config": scrub(config)}
    return _append_lines(Path(run_dir) / RUN_CONFIGS, [json.dumps(start, default=str)])


def copy_run_configs(src: Path, dst: Path, up_to_step: int) -> None:
    """A fork's lineage: ``src``'s learner starts up to ``up_to_step``, as written there, into ``dst``."""
    starts = [s for s in read_run_configs(src) if s["step"] <= up_to_step]
    if starts:
        _append_lines(Path(dst) / RUN_CONFIGS, [json.dumps(s) for s in starts])


def _append_lines(path: Path, lines: list[str]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a") as f:
        f.writelines(line + "\n" for line in lines)
    return path


def read_run_configs(run_dir: Path) -> list[dict]:
    """Every learner start recorded in ``config.jsonl``, oldest first (``[]`` before it was recorded)."""
    try:
        text = (Path(run_dir) / RUN_CONFIGS).read_text()
    except FileNotFoundError:
        return []
    return [json.loads(line) for line in text.splitlines() if line.strip()]


def read_run_methods(run_dir: Path) -> list[str]:
    """The related methods' switches a run trained with (``[]`` for a file written before they were recorded)."""
    try:
        methods = json.loads((Path(run_dir) / RUN_ABLATION).read_text()).get("methods", [])
    except (OSError, ValueError, AttributeError):
        return []
    return [m for m in methods if isinstance(m, str)] if isinstance(methods, list) else []


def read_run_ablation(run_dir: Path) -> list[str]:
    """The ablations a run trained under; ValueError naming the file when it is missing or unreadable."""
    path = Path(run_dir) / RUN_ABLATION
    try:
        data = json.loads(path.read_text())
        active = data["ablation"]
    except FileNotFoundError:
        raise ValueError(
            f"{run_dir} is not a run directory of this version: no {RUN_ABLATION} "
            "(the learner writes it when it starts)"
        ) from None
    except (ValueError, KeyError, TypeError) as exc:
        raise ValueError(f"{path} is not readable: {exc}") from None
    if not isinstance(active, list) or not all(isinstance(a, str) for a in active):
        raise ValueError(f"{path}: 'ablation' must be a list of names, got {active!r}")
    return active


def check_played_as_trained(cfg: object, run_dir: Path) -> None:
    """ValueError in one line when ``cfg`` would play ``run_dir``'s adapters with another method than
    they trained under: other ablations, or other related methods' switches (``reflect_confidence``
    changes the reflection prompt). A directory without ``ablation.json`` (no learner started
    there yet) passes."""
    if not (Path(run_dir) / RUN_ABLATION).exists():
        return
    trained = (sorted(read_run_ablation(run_dir)), sorted(read_run_methods(run_dir)))
    played = (sorted(cfg.method.ablation), sorted(cfg.method_switches))  # type: ignore[attr-defined]
    if trained != played:

        def say(ablation: list[str], methods: list[str]) -> str:
            return f"ablation {'+'.join(ablation) or 'none'}, methods {'+'.join(methods) or 'none'}"

        raise ValueError(
            f"{run_dir} trained with {say(*trained)}; this config plays it with {say(*played)}: "
            "evaluate with the run's own config (or its --set switches)"
        )
