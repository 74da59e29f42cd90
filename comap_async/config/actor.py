"""The environment workers' section."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, field_validator

from comap_async.config.base import Section

TOKEN_BUDGETS: dict[str, int] = {"draft": 32, "reflection": 40, "final_action": 16, "wm": 128}
"""``actor.max_tokens``' keys and their defaults (the CPU default's budgets; the paper's: 64, 128, 16, 192)."""


class ActorConfig(Section):
    envs: int = Field(default=4, ge=1)
    """Episodes run concurrently in one actor process."""
    max_warmup_episodes: int = Field(default=100, ge=1)
    """Expert episodes one actor process plays in ``warmup``; then, once it has also sent
    ``learner.phases.warmup.min_samples`` demonstrations (so one actor alone lets warm-up training start), it
    idles (polling the registry) until the learner moves on, leaving the CPU to the learner."""
    max_reflect_init_labels: int | None = Field(default=None, ge=1)
    """Suffix-labelled reflection samples one actor process sends in ``reflect_init``; then it idles
    as after its warm-up share (the learner sized the phase by the labels held when it started, so
    later ones only add variety, and rolling them out takes the learner's CPU). At least
    ``learner.phases.reflect_init.min_samples``, so one actor alone lets the phase start. ``None``: no cap."""
    env_workers: int = Field(default=1, ge=1)
    """Worker processes hosting this actor's environments (several environments each)."""
    ack_timeout_s: float = Field(default=2.0, gt=0)
    """Resend a message when its ack has not come after this long."""
    spill_dir: str | None = None
    """If set, unacked messages are written here and survive an actor restart."""
    ack_log: str | None = None
    """If set, every message the broker acks as stored is appended to this file as one line,
    ``<type> <id>``, the moment its ack arrives (several actor processes may share it). Off by
    default; ``benchmarks/chaos_soak.py`` checks the stores against it: every acked id stored once."""
    temperature: float = Field(default=0.7, ge=0.0)
    """Sampling temperature of drafts, reflections and the student world model's predictions
    (``s_hat``, ``s_hat_exec``: the rollout self-distillation trains on is sampled, as in the paper);
    the paper: 0.7; 0 = greedy. The EMA teacher's prediction (the world-state gate's reference) is
    always greedy."""
    top_p: float = Field(default=0.9, gt=0.0, le=1.0)
    """Nucleus sampling of every sampled call: drafts, reflections, student predictions (the paper: 0.9)."""
    max_tokens: dict[str, int] = Field(default_factory=lambda: dict(TOKEN_BUDGETS))
    """New-token budgets by call, a mapping of up to four keys (one left out keeps its default,
    :data:`TOKEN_BUDGETS`, sized for the CPU default): ``draft``, a drafted action (default 32, the
    paper: 64); ``reflection``, a reflection's decision and ``Final Action:`` line (40; 128);
    ``final_action``, the refined action after ``Final Action:`` (16; 16): a longer one is cut to its
    first tokens (``q_ref`` over those) and counted as a parse problem; ``wm``, a world-model
    prediction, student or teacher (128; 192). The GPU configs set the paper's four."""
    warmup_explore: float = Field(default=0.3, ge=0.0, le=1.0)
    """Share of warm-up steps that also execute a non-expert action on a second environment,
    restored to the expert path by replay, and record that real transition for the world model only
    (``explore``; no demonstration): walkthroughs alone never show ``Nothing happens.``."""
    warmup_recovery: bool = True
    """After each exploratory action, the game's expert also acts from the off-path state it left,
    and that step is a demonstration (``recovery``) as well as a real transition: walkthroughs alone
    never show the policy a state one step off the path, so once off it the policy loops. In the
    turns form (``env.draft_turns``) a recovery demonstration is the whole path to the off-path state,
    its prefix learned again: ~80 % of the stored paths, weighting the early search steps; there
    leaving them out drafted the expert's finishing steps on 0.52 of held-out states against 0.07
    after the same 100 learner steps (docs/findings.md, "Recovery paths crowd a turns-form warm-up"), so
    turns-form runs set it false. The window form's (the default) is not measured."""
    demonstrations: Literal["walkthrough", "handcoded"] = "walkthrough"
    """The command sequence warm-up demonstrates and reflection-mode initialisation drafts along:
    ``walkthrough``, the game's recorded winning sequence (it goes straight to where the task's
    object lies, which the agent cannot know: imitated, the policy names a receptacle and takes an
    object that is not there); ``handcoded``, the handcoded expert's own winning play from the
    reset, which searches the likely receptacles and reads each one's contents (the walkthrough
    where the expert does not win within ``env.max_steps``; ALFWorld only). Recorded with the run
    as the method switch ``handcoded_demos``."""
    admissible_choice: bool = False
    """The policy's actions are decoded as one of the environment's admissible commands (vLLM's
    ``structured_outputs.choice``; the embedded server does the same): the draft always, the
    reflection's final action when the model's own is not admissible (continued from ``Final
    Action:`` with the choice; under greedy decoding that is what constraining the whole reflection
    would give). Steps without an admissible list (imagined ones) decode freely. A decoding setting,
    like the temperature: a comparison plays every row with the config's; recorded with a run that
    trains with it as the method switch ``admissible_choice``. On vLLM a choice may come back in
    another tokenization than the tokenizer's (its grammar admits any), so its logprobs, hence the
    draft's confidence, can read lower than the embedded server's
    (docs/inference.md, "Known vLLM differences")."""
    revise_other_action: bool = False
    """With ``admissible_choice``: a reflection that decides REVISE and names the draft again (what the
    CPU default's reflections do on most REVISE states: the draft is in the prompt and copying it is
    easy) has its final action generated again from ``Final Action:`` as one of the admissible
    commands other than the draft. ``q`` is the policy's own probability of that action, so the
    action gate still executes it only when the policy is confident in it (``q > tau_q``); a KEEP, or a
    REVISE that names another action, is left as written. Recorded with a run that trains with it
    as the method switch ``revise_other_action``."""
    reflect_init_pairs: bool = False
    """Reflection-mode initialisation: each ``y = 1`` sample (the expert's action does better than
    the draft) comes with a ``y = 0`` one on the same state whose draft is the expert's action (an
    equal draft, which section 11 labels keep), ``s̄`` its real outcome. Without pairs the labels
    are ~75 % ``y = 1`` on different states, and ``p`` learns the prior, not the draft (docs/findings.md);
    with them a state is seen with both labels."""
    reflect_confidence: bool = False
    """The reflection prompt shows the draft's own confidence (its geometric-mean token probability,
    read from the draft call's logprobs) as a word: high, medium or low
    (:func:`comap_async.prompts.confidence_word`). Offline the policy's doubt in its drafts ranked
    wrong ones above right ones (AUC 0.77) where ``p`` did not (0.48), docs/findings.md. Every
    reflection of the run is rendered so (actors, probes, the learner from each record's
    ``draft_confidence``); recorded with the run as the method switch ``reflect_confidence``."""
    imagined_rollouts: int = Field(default=0, ge=0, le=16)
    """WebEvolver's world model as a virtual environment (arXiv 2504.21024; off: 0): after each
    co-evolution episode, this many imagined episodes start from its real states (drawn with the run
    seed); in each the policy drafts and the world model answers for three steps, no environment step
    taken, and the policy as critic scores the episode (P(YES) that it brings the task closer to
    done); one scored at least 0.5 is kept (:mod:`actors.imagined`, ``DEPTH`` and ``MIN_SCORE``). Kept
    ones are sent for the policy's draft training (a quarter of co-evolution's demonstrations:
    ``comap_async.method.phases.IMAGINED_DEMO_SHARE``), never the world model's."""

    @field_validator("max_tokens", mode="before")
    @classmethod
    def _token_budgets(cls, value: Any) -> dict[str, int]:
        """Only the four calls' keys, each a positive int; a key left out keeps its default."""
        if not isinstance(value, dict):
            raise ValueError(f"a mapping of {', '.join(TOKEN_BUDGETS)} to token counts, got {value!r}")
        unknown = sorted(str(k) for k in value if k not in TOKEN_BUDGETS)
        if unknown:
            raise ValueError(f"unknown key {', '.join(unknown)}: the budgets are {', '.join(TOKEN_BUDGETS)}")
        for key, n in value.items():
            if isinstance(n, bool) or not isinstance(n, int) or n < 1:
                raise ValueError(f"{key} must be a positive number of tokens, got {n!r}")
        return {**TOKEN_BUDGETS, **value}
