"""An experiment's spec: a committed YAML file that says everything a table depends on.

    name: alfworld-method-table          # results/NAME/ (default: the file's stem)
    config: configs/local.yaml           # every process's config, relative to the repository
    set: []                              # overrides for every process, training and evaluation
    source:                              # the fork point
      from_empty: true                   # train run ``source`` from empty until ...
      phase: coevolve                    # ... it publishes its first version of this phase
      max_minutes: 240                   # a limit, not a budget: the source is trained to the phase
    train:
      steps: 40                          # every fork trains exactly this many learner steps
      max_minutes: 180                   # a limit per fork; a fork short of its steps then is an error
    arms:                                # forks of the source, each trained then evaluated
      comap: {seeds: [0, 1]}
      frozen_wm: {ablation: [frozen_wm]}
    evaluation:
      split: valid_seen
      games: all                         # or N games drawn with ``seed`` over the task types
      decoding: greedy                   # or sampled (at ``temperature``)
      seed: 0
      source: [draft_only]               # how the fork point is played
      arms: [comap, draft_only]          # how each arm's end is played (an arm may list its own ``play``)
      reference: source/draft_only       # every row is compared with this one on the same games
      pairs: [[comap/comap, comap/draft_only]]   # more paired comparisons
    keep_state: false                    # true: what is trained is also packed into results/NAME/state/

A row is ``ARM/METHOD`` (``source/METHOD`` for the fork point); an arm trained with several seeds has a
row per seed (``comap/comap@s1``) and its pooled row (``comap/comap``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from comap_async.errors import CommandError


class SpecError(CommandError):
    """A spec that cannot be run: one line naming the file and the field."""


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class SourceSpec(Strict):
    from_empty: bool = True
    """Train the run ``source`` from empty with the spec's config until it publishes its first ``phase``
    version (a run already there is resumed, not restarted)."""
    phase: Literal["reflect_init", "coevolve"] = "coevolve"
    max_minutes: float = Field(default=240.0, gt=0)
    run_dir: str | None = None
    """Instead of training one: fork this run directory (absolute, or relative to the repository)."""
    experiment: str | None = None
    """Instead of training one: fork the source another spec (``NAME.yaml`` beside this one) trained from empty,
    unpacked from its ``results/NAME/state`` where this machine lacks it (that spec's ``keep_state``)."""
    version: int | None = Field(default=None, ge=1)
    """With ``run_dir``: the version forked (default: its first version of ``phase``)."""

    @model_validator(mode="after")
    def _one_source(self) -> SourceSpec:
        given = [k for k in ("run_dir", "experiment") if getattr(self, k) is not None]
        if len(given) > 1:
            raise ValueError("source: run_dir and experiment exclude each other")
        if given and self.from_empty and "from_empty" in self.model_fields_set:
            raise ValueError(f"source: from_empty and {given[0]} exclude each other")
        if given:
            self.from_empty = False
        if self.version is not None and self.run_dir is None:
            raise ValueError("source.version needs source.run_dir (any other source is forked at its phase)")
        return self


class TrainSpec(Strict):
    steps: int = Field(ge=1)
    """Learner steps each fork trains past the fork point (the same for every arm: never wall-clock)."""
    max_minutes: float = Field(default=180.0, gt=0)


class ArmSpec(Strict):
    ablation: list[str] = []
    """The ablations switched on in this arm (names of ``comap_async.config.AblationName``; its forks get
    them as ``method.ablation``, replacing one of ``set``); none: the method itself."""
    set: list[str] = []
    """More settings of this arm's training and play (e.g. a related method's switch)."""
    seeds: list[int] = [0]
    """``run.seed`` of each fork of this arm: two or more for an arm whose training the table compares."""
    play: list[str] | None = None
    """How this arm's end is played (default: ``evaluation.arms``)."""

    @field_validator("seeds")
    @classmethod
    def _distinct(cls, seeds: list[int]) -> list[int]:
        if not seeds or len(set(seeds)) != len(seeds):
            raise ValueError("seeds must be distinct, at least one")
        return seeds


class EvalSpec(Strict):
    split: str = "valid_seen"
    games: int | Literal["all"] = "all"
    data: str | None = None
    """The environment's data root (default: the config's ``env.data_dir``)."""
    decoding: Literal["greedy", "sampled"] = "greedy"
    temperature: float = Field(default=0.7, gt=0)
    """``sampled``: every model call's temperature."""
    seed: int = 0
    """``run.seed`` of every evaluation: which games ``games: N`` draws, and every sampled call's seed."""
    envs: int | None = Field(default=None, ge=1)
    """Games played at once (default: the config's ``actor.envs``)."""
    source: list[str] = ["draft_only"]
    arms: list[str] = ["comap", "draft_only"]
    reference: str = "source/draft_only"
    pairs: list[tuple[str, str]] = []
    set: list[str] = []
    """Settings of the evaluation only (e.g. ``model.torch_threads=2``: the server has the cores to itself)."""
    judged: list[str] = []
    """CoMap rows whose every step is also judged by two branches, the draft's and the reflected action's,
    each continued by the game's expert to the episode's end: the paper's URR, HRR and BRP. A pooled row
    name judges each of its seeds. Judging plays no model call, only the environment (it does not change
    the row's games), but each judged step replays its branches from the episode's start."""

    @field_validator("games")
    @classmethod
    def _positive(cls, games: int | str) -> int | str:
        if isinstance(games, int) and games < 1:
            raise ValueError("games must be 'all' or a positive number")
        return games


class ExperimentSpec(Strict):
    name: str
    config: str
    set: list[str] = []
    source: SourceSpec = SourceSpec()
    train: TrainSpec | None = None
    """Required with arms: every fork's training budget."""
    arms: dict[str, ArmSpec] = {}
    """The forks; none: the table plays the fork point alone, in each of ``evaluation.source``'s ways."""
    evaluation: EvalSpec = EvalSpec()
    keep_state: bool = False
    """Pack the fork point and each fork's end into ``results/NAME/state/`` as they are trained, to be
    committed: on a machine that lost ``run.root`` the table goes on from them (:mod:`experiments.state`).
    Tens of MB on the CPU default; for a table longer than a machine's life."""

    @field_validator("name")
    @classmethod
    def _slug(cls, name: str) -> str:
        if not name or not all(c.isalnum() or c in "-_" for c in name):
            raise ValueError(f"name {name!r}: letters, digits, - and _ only (it names a directory)")
        return name

    @field_validator("arms")
    @classmethod
    def _arm_names(cls, arms: dict[str, ArmSpec]) -> dict[str, ArmSpec]:
        for name in arms:
            if name == "source" or not all(c.isalnum() or c in "-_" for c in name):
                raise ValueError(f"arm {name!r}: letters, digits, - and _ only, and not 'source'")
        return arms

    @model_validator(mode="after")
    def _rows_exist(self) -> ExperimentSpec:
        from comap_async.config import ABLATIONS, EVAL_METHODS

        if self.arms and self.train is None:
            raise ValueError("train: required with arms (every fork's steps)")
        if not self.arms and not self.evaluation.source:
            raise ValueError("arms: none, and evaluation.source plays nothing: the table would have no row")
        known = ", ".join(ABLATIONS)
        for arm, spec in self.arms.items():
            unknown = [a for a in spec.ablation if a not in ABLATIONS]
            if unknown:
                raise ValueError(f"arms.{arm}.ablation: unknown {', '.join(unknown)}; known: {known}")
        for where, methods in [
            ("evaluation.source", self.evaluation.source),
            ("evaluation.arms", self.evaluation.arms),
        ]:
            bad = [m for m in methods if m not in EVAL_METHODS]
            if bad:
                raise ValueError(f"{where}: unknown method {', '.join(bad)}; known: {', '.join(EVAL_METHODS)}")
        rows = set(self.row_names()) | set(self.seed_row_names())
        for name in [
            self.evaluation.reference,
            *(x for pair in self.evaluation.pairs for x in pair),
            *self.evaluation.judged,
        ]:
            if name not in rows:
                raise ValueError(f"evaluation: row {name!r} is not played; rows: {', '.join(sorted(rows))}")
        for name in self.evaluation.judged:
            if name.split("/", 1)[1].split("@", 1)[0] != "comap":
                raise ValueError(f"evaluation.judged: {name!r} is not a CoMap row (only its steps revise a draft)")
        return self

    def judged_rows(self) -> set[str]:
        """The played rows (a seed's, or a one-seed row) that ``evaluation.judged`` names."""
        seeds = self.seed_row_names()
        out = set()
        for name in self.evaluation.judged:
            each = [s for s in seeds if s.startswith(name + "@s")]
            out.update(each or [name])
        return out

    def plays(self, arm: str) -> list[str]:
        """How ``arm``'s end (or the fork point, ``source``) is played."""
        if arm == "source":
            return self.evaluation.source
        return self.arms[arm].play if self.arms[arm].play is not None else self.evaluation.arms

    def forks(self) -> list[tuple[str, int]]:
        """(arm, seed) of every fork, in table order."""
        return [(arm, seed) for arm, spec in self.arms.items() for seed in spec.seeds]

    def row_names(self) -> list[str]:
        """Every row of the table: the fork point's, then each arm's (pooled over its seeds)."""
        return [f"source/{m}" for m in self.plays("source")] + [
            f"{arm}/{m}" for arm in self.arms for m in self.plays(arm)
        ]

    def seed_row_names(self) -> list[str]:
        """The rows of each seed of an arm trained with several (``ARM/METHOD@sSEED``)."""
        return [
            f"{arm}/{m}@s{seed}"
            for arm, a in self.arms.items()
            if len(a.seeds) > 1
            for m in self.plays(arm)
            for seed in a.seeds
        ]


def load_spec(path: Path) -> ExperimentSpec:
    """The spec in ``path``; :class:`SpecError` (one line) for a missing file, bad YAML or a bad field."""
    try:
        raw = yaml.safe_load(path.read_text())
    except OSError as exc:
        raise SpecError(f"{path}: {exc.strerror or exc}") from None
    except yaml.YAMLError as exc:
        raise SpecError(f"{path}: not YAML ({str(exc).splitlines()[0]})") from None
    if not isinstance(raw, dict):
        raise SpecError(f"{path}: a spec is a mapping of fields, got {type(raw).__name__}")
    raw.setdefault("name", path.stem)
    try:
        return ExperimentSpec.model_validate(raw)
    except ValidationError as exc:
        err = exc.errors()[0]
        where = ".".join(str(x) for x in err["loc"]) or "spec"
        raise SpecError(f"{path}: {where}: {err['msg'].removeprefix('Value error, ')}") from None
