"""Configuration: pydantic models loaded from YAML, with ``--set section.key=value`` overrides.

Every field carries a docstring (``use_attribute_docstrings``), so ``comap config --explain``
and error messages can say what a field means. Invariants that span fields are checked once at
start-up in :meth:`CoMapConfig.check_invariants`, with a ``ValueError`` naming the fields.

The sections live beside this module, one file per role (``run``, ``serving``, ``actor``, ``learner``,
``evaluator``), ``method`` holds what changes the algorithm (the rest is tuning) and ``base`` what they
share; this module composes them and loads the YAML.
"""

from __future__ import annotations

import difflib
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, Field, ValidationError, model_validator

from comap_async.config.actor import ActorConfig
from comap_async.config.base import ConfigError, Section, is_loopback, lookup_env_spec
from comap_async.config.evaluator import EVAL_METHODS, EvalConfig, EvalMethod
from comap_async.config.learner import LearnerConfig
from comap_async.config.method import ABLATIONS, AblationName, Ablations, MethodConfig, ablations
from comap_async.config.run import PROMPT_FORM_SWITCHES, EnvConfig, ModelConfig, PromptForm, RunConfig
from comap_async.config.serving import SHARED_GPU_MEMORY, BrokerConfig, InferenceConfig

__all__ = [
    "ABLATIONS",
    "EVAL_METHODS",
    "PLAY_SWITCHES",
    "PROMPT_FORM_SWITCHES",
    "SHARED_GPU_MEMORY",
    "AblationName",
    "Ablations",
    "ActorConfig",
    "BrokerConfig",
    "CoMapConfig",
    "ConfigError",
    "EnvConfig",
    "EvalConfig",
    "EvalMethod",
    "InferenceConfig",
    "LearnerConfig",
    "MethodConfig",
    "ModelConfig",
    "RunConfig",
    "ablations",
    "is_loopback",
    "load_config",
    "parse_override",
]


PLAY_SWITCHES: dict[str, tuple[str, str]] = {
    "reflect_confidence": ("actor", "reflect_confidence"),
    "show_location": ("env", "show_location"),
}
"""The method switches that change how an episode is played, not only what is trained: name ->
(section, field). A run's ``ablation.json`` names them; ``comap compare`` plays each run with its own.
``env.prompt_form`` is played so too, recorded by its switch names (:data:`PROMPT_FORM_SWITCHES`)."""


TURN_SWITCHES = ("draft_turns", "reflect_turns", "wm_turns", "task_every_turn")
"""The switch names a run recorded for its prompt form (``task_every_turn`` by runs before its removal)."""


def prompt_form_of(methods: Sequence[str]) -> PromptForm:
    """The ``env.prompt_form`` a run recorded with ``methods`` (its ``ablation.json``) played:
    ``all_turns`` for ``reflect_turns`` and ``wm_turns``, ``draft_turns`` for ``draft_turns``, else
    ``window``. A set no form expresses (one of ``reflect_turns`` and ``wm_turns`` without the other,
    ``task_every_turn``) is refused in one line: that run cannot be played as it trained."""
    named = {name for name in TURN_SWITCHES if name in methods}
    if "task_every_turn" in named:
        raise ConfigError(
            "methods name task_every_turn, since removed (docs/findings.md): this run cannot be played as it trained"
        )
    if {"reflect_turns", "wm_turns"} <= named:
        return "all_turns"
    if named & {"reflect_turns", "wm_turns"}:
        raise ConfigError(
            f"methods name {' and '.join(sorted(named))}: env.prompt_form has no form with one of reflect_turns "
            "and wm_turns without the other, so this run cannot be played as it trained"
        )
    return "draft_turns" if "draft_turns" in named else "window"


class CoMapConfig(Section):
    run: RunConfig = Field(default_factory=RunConfig)
    """Run identity and directory."""
    model: ModelConfig = Field(default_factory=ModelConfig)
    """Base model shared by all roles."""
    env: EnvConfig = Field(default_factory=EnvConfig)
    """Text environment."""
    method: MethodConfig = Field(default_factory=MethodConfig)
    """What changes the algorithm: the gates' thresholds, the ablations switched on, the losses' weights."""
    broker: BrokerConfig = Field(default_factory=BrokerConfig)
    """Broker sockets, replay stores and sampling."""
    inference: InferenceConfig = Field(default_factory=InferenceConfig)
    """Inference servers."""
    actor: ActorConfig = Field(default_factory=ActorConfig)
    """Environment workers."""
    learner: LearnerConfig = Field(default_factory=LearnerConfig)
    """Training."""
    eval: EvalConfig = Field(default_factory=EvalConfig)
    """The evaluator process (held-out probes and success rate per adapter version)."""

    @property
    def method_switches(self) -> list[str]:
        """The related methods' training switches that are on (recorded with the run, like the
        ablations): ``imagined_episodes`` (WebEvolver's virtual environment: imagined steps are
        sent and trained), ``paw`` (the policy's auxiliary next-observation loss),
        ``handcoded_demos`` (warm-up demonstrates the handcoded expert's search, not the walkthrough),
        ``admissible_choice`` (actions decoded as one of the admissible commands), ``revise_other_action``
        (a REVISE naming the draft chooses among the other commands),
        ``reflect_confidence`` (the draft's confidence shown in the reflection prompt), ``show_location``
        (where the agent is, in every state), and ``env.prompt_form`` by its switch names
        (:data:`PROMPT_FORM_SWITCHES`): ``draft_turns`` (the draft sees the episode as chat turns),
        ``reflect_turns`` (the reflection continues the draft's conversation), ``wm_turns`` (the world
        model's and the teacher's own conversation)."""
        on = []
        if self.actor.imagined_rollouts > 0:
            on.append("imagined_episodes")
        if self.learner.policy_wm_aux > 0:
            on.append("paw")
        if self.actor.demonstrations == "handcoded":
            on.append("handcoded_demos")
        if self.actor.admissible_choice:
            on.append("admissible_choice")
        if self.actor.revise_other_action:
            on.append("revise_other_action")
        on.extend(name for name, (section, key) in PLAY_SWITCHES.items() if getattr(getattr(self, section), key))
        on.extend(PROMPT_FORM_SWITCHES[self.env.prompt_form])
        return on

    def playing(self, methods: Sequence[str]) -> "CoMapConfig":
        """This config with exactly the switches of :data:`PLAY_SWITCHES` named in ``methods`` on and
        the prompt form they name (:func:`prompt_form_of`): a run evaluated as it trained (``comap
        compare`` from its ``ablation.json``)."""
        update: dict[str, Any] = {}
        for name, (section, key) in PLAY_SWITCHES.items():
            current = update.get(section, getattr(self, section))
            update[section] = current.model_copy(update={key: name in methods})
        env = update.get("env", self.env)
        update["env"] = env.model_copy(update={"prompt_form": prompt_form_of(methods)})
        return self.model_copy(update=update)

    @model_validator(mode="after")
    def check_invariants(self) -> "CoMapConfig":
        b, lr = self.broker, self.learner
        spec = lookup_env_spec(self.env.name)
        if "split" not in self.eval.model_fields_set:
            self.eval.split = spec.held_out_split
        env_splits = spec.splits
        if self.eval.split not in env_splits:
            raise ValueError(
                f"eval.split={self.eval.split!r} is not a split of {self.env.name} ({', '.join(env_splits)})"
            )
        if b.capacity <= lr.batch_size:
            raise ValueError(f"broker.capacity ({b.capacity}) must be larger than learner.batch_size ({lr.batch_size})")
        cap, need = self.actor.max_reflect_init_labels, lr.phases.reflect_init.min_samples
        if cap is not None and cap < need:
            raise ValueError(
                f"actor.max_reflect_init_labels ({cap}) must be at least learner.phases.reflect_init.min_samples "
                f"({need}): the phase would wait for labels no actor sends"
            )
        if self.actor.revise_other_action and not self.actor.admissible_choice:
            raise ValueError(
                "actor.revise_other_action chooses among the admissible commands: it needs actor.admissible_choice"
            )
        if self.learner.demo_loss_share and not self.env.draft_turns:
            raise ValueError(
                "learner.demo_loss_share subsamples the demonstrated turns of a path: it needs env.prompt_form "
                "draft_turns or all_turns"
            )
        if self.actor.demonstrations == "handcoded" and self.env.name != "alfworld":
            raise ValueError(
                f"actor.demonstrations: handcoded needs ALFWorld's handcoded expert (env.name is {self.env.name})"
            )
        if self.env.draft_turns and lr.policy_wm_aux > 0 and not self.actor.reflect_confidence:
            raise ValueError(
                f"learner.policy_wm_aux with env.prompt_form {self.env.prompt_form} selects by the actors' entropy, "
                "the draft's confidence, which the actors measure with actor.reflect_confidence: true (a transition "
                "does not carry the turns its draft saw)"
            )
        if b.window < lr.batch_size:
            raise ValueError(f"broker.window ({b.window}) must be at least learner.batch_size ({lr.batch_size})")
        ports = {
            "broker.actor_port": b.actor_port,
            "broker.learner_port": b.learner_port,
            "broker.http_port": b.http_port,
        }
        if self.inference.host in ("127.0.0.1", "localhost", "0.0.0.0") or self.inference.host == b.host:
            ports["inference.port"] = self.inference.port
        seen: dict[int, str] = {}
        for name, port in ports.items():
            if port in seen:
                raise ValueError(f"{name} and {seen[port]} are both {port}; each listener needs its own port")
            seen[port] = name
        if not is_loopback(b.host):
            if not b.curve:
                raise ValueError(f"broker.host={b.host} is not loopback: set broker.curve: true (run `comap keys`)")
            if not b.http_token:
                raise ValueError(f"broker.host={b.host} is not loopback: set broker.http_token")
        if not is_loopback(self.inference.host) and not self.inference.admin_token:
            raise ValueError(f"inference.host={self.inference.host} is not loopback: set inference.admin_token")
        if not self.inference.endpoints:
            raise ValueError("inference.endpoints must name at least one server")
        return self

    def training_split_problem(self) -> str | None:
        """Why training on this config could read an evaluation split, or None: ``env.split`` is
        ``eval.split`` or one of the environment's evaluation splits (``EnvSpec.eval_splits``).
        Checked by the processes that train or make training data (:func:`load_config` with
        ``training=True``), not by the evaluation commands, which play a split named by their own
        ``--split`` (or ``eval.split``) and never train."""
        split, spec = self.env.split, lookup_env_spec(self.env.name)
        held_out = spec.eval_splits or ()
        if split in held_out:
            return (
                f"env.split={split!r} is an evaluation split of {self.env.name} ({', '.join(held_out)}): "
                f"training must never read an evaluation split; train on {spec.train_split!r}"
            )
        if split == self.eval.split:
            return (
                f"env.split={split!r} is also eval.split: training must never read the split it is evaluated on; "
                f"train on {spec.train_split!r} or evaluate another split"
            )
        return None

    def shared_gpus(self, group: Sequence[int] | None = None) -> list[int]:
        """The GPUs of ``group`` (one vLLM server's; None: every one of ``inference.gpus``) that
        ``learner.gpus`` also lists: a card vLLM and the learner share."""
        return sorted(set(self.inference.gpus if group is None else group) & set(self.learner.gpus))

    def vllm_memory_share(self, group: Sequence[int] | None = None) -> float | None:
        """vLLM's ``--gpu-memory-utilization`` for a server on ``group`` (None: the server's GPUs are
        not known, any of ``inference.gpus``): ``inference.gpu_memory_utilization`` when set, else
        :data:`SHARED_GPU_MEMORY` on a card the learner shares, else None (vLLM's own 0.9, which on a
        shared card leaves the learner too little). ``comap procfile`` and ``comap serve`` both ask here."""
        if self.inference.gpu_memory_utilization is not None:
            return self.inference.gpu_memory_utilization
        return SHARED_GPU_MEMORY if self.shared_gpus(group) else None

    @property
    def adapter_root(self) -> Path:
        """Absolute: the learner publishes paths that the inference servers resolve on their own."""
        root = (
            Path(self.inference.adapter_root).expanduser() if self.inference.adapter_root else self.run.dir / "adapters"
        )
        return root.resolve()

    @property
    def alfworld_data(self) -> Path | None:
        root = self.env.data_dir or os.environ.get("ALFWORLD_DATA")
        return Path(root).expanduser() if root else None


def _suggest(model: type[BaseModel], loc: tuple) -> str:
    """For an unknown key, the closest known field name at that level."""
    cls: Any = model
    for part in loc[:-1]:
        field = cls.model_fields.get(part) if isinstance(part, str) else None
        if field is None or not isinstance(field.annotation, type) or not issubclass(field.annotation, BaseModel):
            return ""
        cls = field.annotation
    close = difflib.get_close_matches(str(loc[-1]), list(cls.model_fields), n=1)
    return f" (did you mean '{close[0]}'?)" if close else ""


REMOVED_FIELDS: dict[str, str] = {
    "inference.client_transport": "http:// endpoints always use the lean keep-alive client, https:// ones aiohttp "
    "(docs/benchmarks.md has the figure that chose it)",
    "eval.probes_beside_games": "the evaluator always runs its probes beside its success games "
    "(docs/benchmarks.md has the figure that chose it)",
    "inference.top_p_candidates": "top-p/top-k rows are sampled from their 256 most likely tokens when those "
    "hold the nucleus, else from a full sort (docs/benchmarks.md has the figure that chose it)",
    "inference.forced_choice_tokens": "a row decoded to a list of choices always runs up to 4 forced tokens in one "
    "verify step (docs/benchmarks.md has the figure that chose it)",
    "inference.prefix_cache_outputs": "a finished request's reply always joins the prefix cache with its prompt "
    "(docs/benchmarks.md has the figure that chose it)",
    "inference.kv_in_place": "rows always join and leave the running batch's KV cache in place "
    "(docs/benchmarks.md has the figure that chose it)",
    "inference.mixed_step_tokens": "joining prompts of up to 2048 uncached tokens are always prefilled in the "
    "decode step's forward (docs/benchmarks.md has the figure that chose it)",
    "learner.fast_path": "the learner always computes its losses at the target positions over packed rows; "
    "the reference computation is a test oracle (tests/fixtures/reference_path.py)",
    "learner.prompt_grad": "the learner always trains through the prompts' keys and values "
    "(docs/benchmarks.md has the figure that chose it)",
    "actor.choice_samples": "greedy decoding among the admissible commands is token by token; the likeliest "
    "whole command changed nothing that mattered at 4.5x the server time (docs/findings.md)",
    "learner.bce_balance_halflife": "the BCE's label balance counts every label since the run began; a "
    "half-life only delayed the gate's shutting by a version or two (docs/findings.md)",
    "eval.repeat_guard": "evaluation episodes have no anti-loop guard; it took the loop rate to 0 and won no "
    "more games (docs/findings.md)",
    "eval.repeat_guard_temperature": "evaluation episodes have no anti-loop guard; it took the loop rate to 0 "
    "and won no more games (docs/findings.md)",
    # the evaluator's tuning constants
    "eval.lookahead_depth": "the look-ahead imagines one step per candidate (actors.lookahead.DEPTH)",
    "eval.lookahead_temperature": "the look-ahead's candidates are drafted at 0.7 (actors.lookahead.TEMPERATURE)",
    "eval.react_max_tokens": "a ReAct answer is up to 96 tokens (actors.eval_methods.REACT_MAX_TOKENS)",
    "eval.every_versions": "the evaluator measures every published version (the newest when more than "
    "evaluator.evaluator.MAX_PENDING wait)",
    "eval.max_pending": "the evaluator skips to the newest version when more than 2 wait "
    "(evaluator.evaluator.MAX_PENDING)",
    "eval.poll_s": "the evaluator asks the broker for a new version every 5 s (evaluator.evaluator.POLL_S)",
    "eval.cycle_stop_turns": "eval.cycle_stop applies in the draft's turns form too, on a cycle played through "
    "alike: its projections had the played outcome in 11 of 11 recurring games (docs/findings.md)",
    "eval.cycle_stop_check": "now comap eval --cycle-check (experiments/studies/cycle_stop.py passes it)",
    # the per-phase settings moved into one section per phase (learner.phases.<phase>)
    "learner.warmup_steps": "now learner.phases.warmup.steps",
    "learner.warmup_epochs": "now learner.phases.warmup.epochs",
    "learner.warmup_max_minutes": "now learner.phases.warmup.max_minutes",
    "learner.warmup_min_demos": "now learner.phases.warmup.min_samples",
    "learner.warmup_publish_every": "now learner.phases.warmup.publish_every",
    "learner.warmup_torch_threads": "a CPU learner takes every core once the actors are quiet in warm-up SFT "
    "(learner/threads.py)",
    "learner.reflect_init_steps": "now learner.phases.reflect_init.steps",
    "learner.reflect_init_epochs": "now learner.phases.reflect_init.epochs",
    "learner.reflect_init_max_minutes": "now learner.phases.reflect_init.max_minutes",
    "learner.reflect_init_min_samples": "now learner.phases.reflect_init.min_samples",
    "learner.reflect_init_batch_size": "now learner.phases.reflect_init.batch_size",
    "learner.reflect_init_lr": "now learner.phases.reflect_init.lr",
    "learner.reflect_init_torch_threads": "a CPU learner takes every core once the labels have stopped coming "
    "in reflection-mode initialisation (learner/threads.py)",
    "learner.total_steps": "now learner.phases.coevolve.steps",
    "learner.coevolve_lr": "now learner.phases.coevolve.lr",
    "learner.coevolve_bce_weight": "co-evolution's BCE weight is method.bce_weight (docs/findings.md)",
    "learner.imagined_share": "with actor.imagined_rollouts a quarter of co-evolution's demonstrations are "
    "imagined steps (comap_async.method.phases.IMAGINED_DEMO_SHARE)",
    "learner.reflect_init_share": "half of each co-evolution reflection batch is suffix-labelled samples "
    "(comap_async.method.phases.SUFFIX_LABEL_SHARE)",
    "learner.wm_anchor_share": "co-evolution's world model trains on co-evolution transitions only",
    # the four booleans that chose each role's prompt became one choice (env.prompt_form)
    "env.draft_turns": "now env.prompt_form: draft_turns (all_turns adds the reflection's and the world model's turns)",
    "env.reflect_turns": "now env.prompt_form: all_turns (the draft's, the reflection's and the world model's "
    "turns together)",
    "env.wm_turns": "now env.prompt_form: all_turns (the draft's, the reflection's and the world model's "
    "turns together)",
    "env.task_every_turn": "the draft's turns name the task once, in the first turn; repeating it in every "
    "turn changed nothing (docs/findings.md)",
    # the learner's tuning constants
    "learner.weight_decay": "AdamW trains without weight decay (the paper names none)",
    "learner.warmup_ratio": "each phase warms its learning rate up over 3 % of its step budget, the paper's, as "
    "every run config did (learner.schedule.WARMUP_RATIO)",
    "learner.max_path_tokens": "a path of the draft's turns ends after its last whole turn within "
    "inference.max_prompt_tokens, the servers' prompt limit it had to stay under",
    "learner.policy_wm_aux_share": "PaW trains on the half of a micro-batch's transitions with the highest action "
    "entropy (learner.paw.SHARE)",
    "learner.policy_wm_aux_q": "PaW's generalized cross-entropy has q 0.7 (learner.paw.Q)",
    "learner.policy_wm_aux_entropy": "PaW's entropy follows env.prompt_form: the learner's policy's in the window "
    "form, the actors' (the draft's confidence) in the turns forms",
    "learner.rounds_episodes": "a round of learner.schedule: rounds waits for as many new episodes as it trains "
    "steps (learner.publish_every)",
    "learner.prefetch": "the learner keeps 4 micro-batches fetched ahead (learner.prefetch.AHEAD)",
    "learner.phases.warmup.torch_threads": "a CPU learner takes every core once the actors are quiet in warm-up "
    "SFT (learner/threads.py)",
    "learner.phases.reflect_init.torch_threads": "a CPU learner takes every core once the labels have stopped "
    "coming in reflection-mode initialisation (learner/threads.py)",
    "learner.phases.coevolve.bce_weight": "co-evolution's BCE weight is method.bce_weight; the paper's 0.01 "
    "there alone shut the gate faster (docs/findings.md)",
    "learner.phases.coevolve.suffix_label_share": "half of each co-evolution reflection batch is suffix-labelled "
    "samples (comap_async.method.phases.SUFFIX_LABEL_SHARE; docs/findings.md)",
    "learner.phases.coevolve.imagined_demo_share": "with actor.imagined_rollouts a quarter of co-evolution's "
    "demonstrations are imagined steps (comap_async.method.phases.IMAGINED_DEMO_SHARE)",
    "learner.phases.coevolve.warmup_transition_share": "co-evolution's world model trains on co-evolution "
    "transitions only (the anchor on warm-up transitions was never used)",
    # the actor's tuning constants
    "actor.outbox_max": "an actor keeps at most 1024 unacknowledged messages before its episodes pause "
    "(comap_async/wire/outbox.py, OUTBOX_MAX)",
    "actor.shutdown_flush_s": "on SIGTERM an actor waits at most 3 s for the broker's acks "
    "(actors/worker.py, SHUTDOWN_FLUSH_S)",
    "actor.env_restarts": "an actor stops when its environment workers die more than 5 times within 10 minutes "
    "(comap_async/envs/__init__.py, ENV_RESTARTS)",
    "actor.logprobs": "the actors always ask for the 20 likeliest alternatives per token (actors/llm.py, TOP_LOGPROBS)",
    "actor.warmup_explore_invalid": "half of warm-up's exploratory actions are inadmissible commands "
    "(actors/expert_play.py, EXPLORE_INVALID)",
    "actor.overlap_teacher": "a step's teacher call always runs beside the next step's draft "
    "(docs/benchmarks.md has the figure that chose it)",
    "actor.wm_temperature": "the student world model samples at actor.temperature (every config set them equal)",
    "actor.imagined_depth": "an imagined episode is 3 steps (actors/imagined.py, DEPTH)",
    "actor.imagined_min_score": "an imagined episode is kept when the critic scores it at least 0.5 "
    "(actors/imagined.py, MIN_SCORE)",
    "actor.max_draft_tokens": "now actor.max_tokens: {draft: N}",
    "actor.max_action_tokens": "now actor.max_tokens: {draft: N}",
    "actor.max_reflection_tokens": "now actor.max_tokens: {reflection: N}",
    "actor.max_final_action_tokens": "now actor.max_tokens: {final_action: N}",
    "actor.max_wm_tokens": "now actor.max_tokens: {wm: N}",
    "actor.max_state_tokens": "now actor.max_tokens: {wm: N}",
    "eval.reflect_decision_first": "an evaluation's reflection is always read decision first (the action gate "
    "keeps the draft at or under tau_p whatever follows); co-evolution's are generated whole",
    "actor.reflect_decision_first": "an evaluation's reflection is always read decision first; co-evolution's "
    "are generated whole (their transitions carry the reflection's own action)",
    # decided where their inputs are
    "env.task_types": "now env.tasks, by name (pick_and_place_simple, look_at_obj_in_light, "
    "pick_clean_then_place_in_recep, pick_heat_then_place_in_recep, pick_cool_then_place_in_recep, "
    "pick_two_obj_and_place)",
    "actor.nice": "beside a CPU learner (learner.device: cpu) the actors run at niceness 5 and the evaluator at 10, "
    "beside a GPU learner at 0 (comap_async/priority.py)",
    "eval.nice": "beside a CPU learner (learner.device: cpu) the actors run at niceness 5 and the evaluator at 10, "
    "beside a GPU learner at 0 (comap_async/priority.py)",
    "inference.max_loras": "vLLM serves 12 adapters in a batch: a run's 3 roles in 2 versions and the evaluators' "
    "copies (comap_async/inference/vllm.py, MAX_LORAS)",
    "eval.probe_states": "the probes send 8 walkthrough states' calls at a time (evaluator/probes.py, PROBE_STATES)",
    # the ablations became one list
    "ablation.frozen_wm": "now one list of the ablations switched on: method.ablation: [frozen_wm]",
    "ablation.no_wmsd": "now one list of the ablations switched on: method.ablation: [no_wmsd]",
    "ablation.no_real_ce": "now one list of the ablations switched on: method.ablation: [no_real_ce]",
    "ablation.no_ws_gate_real": "now one list of the ablations switched on: method.ablation: [no_ws_gate_real]",
    "ablation.no_ws_gate_imagined": "now one list of the ablations switched on: method.ablation: [no_ws_gate_imagined]",
    "ablation.no_action_gate": "now one list of the ablations switched on: method.ablation: [no_action_gate]",
    "ablation.no_future_state": "now one list of the ablations switched on: method.ablation: [no_future_state]",
    "ablation.no_reflect_init": "now one list of the ablations switched on: method.ablation: [no_reflect_init]",
    "ablation.no_expert_sft": "now one list of the ablations switched on: method.ablation: [no_expert_sft]",
    "ablation.no_wm_warmup": "now one list of the ablations switched on: method.ablation: [no_wm_warmup]",
    # the broker's and the inference server's tuning constants
    "broker.capacity_transitions": "now broker.capacity (records kept per store, every store alike)",
    "broker.capacity_reflections": "now broker.capacity (records kept per store, every store alike)",
    "broker.capacity_demos": "now broker.capacity (records kept per store, every store alike)",
    "broker.capacity_episodes": "now broker.capacity (records kept per store, every store alike)",
    "broker.capacity_imagined": "now broker.capacity (records kept per store, every store alike)",
    "broker.map_size_mb": "the LMDB map starts at 256 MB (broker.store.MAP_SIZE_MB) and doubles when full, up to "
    "broker.max_map_size_mb",
    "broker.drain_s": "on SIGTERM the broker drains the actors for at most 2 s (broker.actor_path.DRAIN_S)",
    "broker.drain_quiet_s": "the broker's drain ends once no actor message has come for 0.5 s "
    "(broker.actor_path.DRAIN_QUIET_S)",
    "broker.ack_queue_max": "at most 50,000 replies wait for one peer (broker.server.ACK_QUEUE_MAX)",
    "broker.group_commit": "at most 256 messages go in one LMDB transaction (broker.actor_path.GROUP_COMMIT)",
    "broker.client_retry": "the learner's broker client tries a request 3 times "
    "(comap_async.wire.broker_client.BROKER_RETRY)",
    "inference.retry": "the inference client tries 6 times, waiting from 0.25 s doubling up to 8 s with full "
    "jitter (comap_async.wire.inference_client.INFERENCE_RETRY)",
    "inference.retries": "the inference client tries 6 times, waiting from 0.25 s doubling up to 8 s with full "
    "jitter (comap_async.wire.inference_client.INFERENCE_RETRY)",
    "inference.forward": "the embedded server runs its fused forward on the architectures it supports (the Llama "
    "family), any other model on transformers' forward with peft (docs/benchmarks.md has the figure)",
    "inference.prefix_cache_block": "prefix-cache blocks are always 8 tokens (docs/benchmarks.md has the figure "
    "that chose it)",
    "inference.batch_wait_ms": "the batcher waits 5 ms for more requests (comap_async.inference.engine.BATCH_WAIT_MS)",
    "inference.spare_adapter_slots": "the embedded server keeps 7 spare adapter slots "
    "(comap_async.inference.adapters.SPARE_ADAPTER_SLOTS)",
    "inference.vllm_cpu_kv_cache_gb": "vLLM on a CPU gets 2 GiB of KV cache unless VLLM_CPU_KVCACHE_SPACE is set "
    "(comap_async.inference.vllm.VLLM_CPU_KV_CACHE_GB)",
    "inference.request_priority": "the evaluator's calls carry eval.priority, every other process's none",
    "inference.speculative_tokens": "no prompt-lookup speculative decoding: it gained nothing in co-evolution "
    "(docs/benchmarks.md has the figure); vLLM's takes --speculative-config in inference.vllm_args",
    # the method's settings moved into one section
    "gates.tau_p": "now method.tau_p",
    "gates.tau_q": "now method.tau_q",
    "gates.tau_ws": "now method.tau_ws",
    "ablation": "now method.ablation",
    "learner.eta": "now method.eta",
    "learner.ema_momentum": "now method.ema_momentum",
    "learner.draft_weight": "now method.draft_weight",
    "learner.reflect_weight": "now method.reflect_weight",
    "learner.bce_weight": "now method.bce_weight",
    "learner.bce_gate_labels": "now method.bce_gate_labels",
    "learner.bce_balance": "now method.bce_balance",
}
"""Fields a config may still name from an older release, dotted (``learner.fast_path``), each with what
replaced it: a config naming one is refused with that one line instead of "unknown field". A field goes
here when its path is deleted or moved; a deleted one's last figure stays in docs/benchmarks.md. A section
that became one value (``ablation``) or went away (``gates``) lists its old keys, so its old mapping gets a
line for each; a top-level key has no dot (``ablation``)."""


def _format_errors(err: ValidationError, source: str) -> str:
    lines = []
    for e in err.errors():
        loc = tuple(e["loc"])
        field = ".".join(str(p) for p in loc) or "<root>"
        inp = e.get("input")
        old = [f"{field}.{k}" for k in inp if f"{field}.{k}" in REMOVED_FIELDS] if isinstance(inp, dict) and loc else []
        if old:  # a section that became one value or went away, written the old way: a line for each old key
            lines += [f"{source}: {dotted}: removed: {REMOVED_FIELDS[dotted]}" for dotted in old]
            continue
        if e["type"] == "extra_forbidden" and field in REMOVED_FIELDS:
            reason = f"removed: {REMOVED_FIELDS[field]}"
        elif e["type"] == "extra_forbidden":
            reason = "unknown field" + _suggest(CoMapConfig, loc)
        elif e["type"] == "value_error":
            reason = str(e["ctx"].get("error", e["msg"])) if e.get("ctx") else e["msg"]
            field = field if loc else "<invariant>"
        else:
            reason = f"{e['msg']} (got {e.get('input')!r})"
        lines.append(f"{source}: {field}: {reason}")
    return "\n".join(lines)


def parse_override(text: str) -> tuple[list[str], Any]:
    """``section.key=value`` -> (["section", "key"], parsed YAML value)."""
    if "=" not in text:
        raise ConfigError(f"--set {text!r}: expected section.key=value")
    key, raw = text.split("=", 1)
    path = [p for p in key.strip().split(".") if p]
    if not path:
        raise ConfigError(f"--set {text!r}: empty key")
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError as exc:
        raise ConfigError(f"--set {text!r}: value is not valid YAML: {exc}") from None
    return path, value


def _merged(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    """``over`` on top of ``base``: sections merge key by key, any other value (a list included) replaces."""
    out = dict(base)
    for key, value in over.items():
        below = out.get(key)
        out[key] = _merged(below, value) if isinstance(below, dict) and isinstance(value, dict) else value
    return out


def _read_yaml(p: Path, chain: tuple[Path, ...] = ()) -> dict[str, Any]:
    """A config file's mapping, with the file it ``extends`` (a path relative to it) merged underneath."""
    source = " <- ".join(str(c) for c in (*chain, p))
    if not p.is_file():
        raise ConfigError(f"{source}: config file not found")
    if p.resolve() in {c.resolve() for c in chain}:
        raise ConfigError(f"{source}: 'extends' loops back to a file already read")
    try:
        loaded = yaml.safe_load(p.read_text())
    except yaml.YAMLError as exc:
        raise ConfigError(f"{source}: not valid YAML: {exc}") from None
    if loaded is None:
        loaded = {}
    if not isinstance(loaded, dict):
        raise ConfigError(f"{source}: top level must be a mapping of sections, got {type(loaded).__name__}")
    parent = loaded.pop("extends", None)
    if parent is None:
        return loaded
    if not isinstance(parent, str):
        raise ConfigError(f"{source}: extends: expected a file name, got {parent!r}")
    return _merged(_read_yaml(p.parent / parent, (*chain, p)), loaded)


def load_config(
    path: str | Path | None = None, overrides: list[str] | tuple[str, ...] = (), *, training: bool = False
) -> CoMapConfig:
    """Load a YAML config (or the defaults when ``path`` is None), apply overrides, validate. A file may
    start from another (``extends: local.yaml``, relative to it) and state only what it changes.
    ``training``: the config of a process that trains or makes training data (learner, actor, broker),
    refused when that training could read an evaluation split (:meth:`CoMapConfig.training_split_problem`)."""
    data: dict[str, Any] = {}
    source = "<defaults>"
    if path is not None:
        source = str(path)
        data = _read_yaml(Path(path))
    for item in overrides:
        keys, value = parse_override(item)
        node = data
        for k in keys[:-1]:
            nxt = node.setdefault(k, {})
            if not isinstance(nxt, dict):
                dotted = ".".join(keys)
                if dotted in REMOVED_FIELDS:
                    raise ConfigError(f"--set {item!r}: {dotted}: removed: {REMOVED_FIELDS[dotted]}")
                raise ConfigError(f"--set {item!r}: '{k}' is not a section")
            node = nxt
        node[keys[-1]] = value
        source = f"{source} (with --set)" if "--set" not in source else source
    try:
        cfg = CoMapConfig.model_validate(data)
    except ValidationError as err:
        raise ConfigError(_format_errors(err, source)) from None
    problem = cfg.training_split_problem() if training else None
    if problem:
        raise ConfigError(f"{source}: {problem}")
    return cfg
