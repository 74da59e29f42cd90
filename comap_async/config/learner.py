"""The learner's section: how it trains (the losses' weights are the method's, ``config.method``)."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field, field_validator

from comap_async.config.base import Section


class WarmupPhase(Section):
    """Warm-up SFT: the draft and the world model on expert demonstrations and their transitions."""

    steps: int = Field(default=200, ge=0)
    """Optimizer steps of warm-up SFT before ``reflect_init`` (the least, with ``epochs``; 0: no warm-up)."""
    epochs: float | None = Field(default=None, gt=0)
    """Size warm-up SFT by data: this many passes over the demonstrations the broker holds when warm-up
    training starts (``ceil(epochs * demos / (batch_size * grad_accum * ranks))`` steps, at least ``steps``);
    the learning-rate schedule spans that budget. ``None``: ``steps`` alone."""
    max_minutes: float | None = Field(default=None, gt=0)
    """...and by time: warm-up SFT ends after this many minutes of training even when its step budget is
    not spent (a slow machine still reaches co-evolution). ``None``: no time limit."""
    min_samples: int = Field(default=200, ge=1)
    """Demonstrations the broker must hold before warm-up training starts."""
    publish_every: int | None = Field(default=None, ge=1)
    """Also publish every this many steps of warm-up SFT (the evaluator then draws the warm-up part of
    the learning curve; actors keep replaying demonstrations). ``None``: the first publish ends warm-up."""


class ReflectInitPhase(Section):
    """Reflection-mode initialisation: the policy's reflection mode on suffix-labelled samples."""

    steps: int = Field(default=100, ge=0)
    """Optimizer steps on suffix-labelled reflection samples before ``coevolve`` (the least, with
    ``epochs``; 0: none)."""
    epochs: float | None = Field(default=None, gt=0)
    """Size reflection-mode initialisation by data: this many passes over the reflection samples the
    broker holds when its training starts (``ceil(epochs * samples / (batch_size * grad_accum * ranks))``
    steps with this phase's ``batch_size``, at least ``steps``; the paper: 3 epochs). ``None``: ``steps`` alone."""
    max_minutes: float | None = Field(default=None, gt=0)
    """...and by time: reflection-mode initialisation ends after this many minutes of training.
    ``None``: no time limit."""
    min_samples: int = Field(default=32, ge=1)
    """Reflection samples the broker must hold before ``reflect_init`` training starts: the actors
    only begin labelling them when the phase begins, and a step without any trains nothing of
    the reflection mode."""
    batch_size: int | None = Field(default=None, ge=1)
    """Reflection samples per micro-batch of reflection-mode initialisation (``None``: ``learner.batch_size``);
    its steps train no world model, so more of them fit a step's time."""
    lr: float | None = Field(default=None, gt=0)
    """Peak learning rate of reflection-mode initialisation (``None``: ``learner.lr``). Its BCE trains one
    decision logit on a few hundred labels, a quarter of them REVISE; at warm-up's rate the balanced
    BCE swung between 0.0003 and 16 from one batch of 4 to the next."""


class CoevolvePhase(Section):
    """Co-evolution: both roles on the policy's own rollouts, gated, with the suffix-labelled samples mixed
    in (``comap_async.method.phases.SUFFIX_LABEL_SHARE``)."""

    steps: int = Field(default=100_000, ge=1)
    """Co-evolution's step budget: horizon of its cosine schedule (counted from the start of
    ``coevolve``; the learner keeps training at the floor afterwards)."""
    lr: float | None = Field(default=None, gt=0)
    """Peak learning rate of co-evolution (``None``: ``learner.lr``). Co-evolution starts its own warm-up and
    cosine, so without it an adapter that reflection-mode initialisation left at the end of its decay
    is driven at warm-up SFT's rate again (docs/findings.md, "The gate also shuts when co-evolution's
    learning rate climbs back")."""


class PhasesConfig(Section):
    """The learner's settings of each phase, read by the method as one spec per phase
    (:func:`comap_async.method.phases.phase_spec`)."""

    warmup: WarmupPhase = Field(default_factory=WarmupPhase)
    """Warm-up SFT."""
    reflect_init: ReflectInitPhase = Field(default_factory=ReflectInitPhase)
    """Reflection-mode initialisation."""
    coevolve: CoevolvePhase = Field(default_factory=CoevolvePhase)
    """Co-evolution."""


class LearnerConfig(Section):
    device: str = "cpu"
    """torch device of the learner (``cpu``, ``cuda``)."""
    gpus: list[Annotated[int, Field(ge=0)]] = Field(default_factory=list)
    """GPU ids the learner trains on (``comap procfile`` sets ``CUDA_VISIBLE_DEVICES``; several: one
    ``torchrun`` data-parallel rank each). A GPU also in ``inference.gpus`` is shared with that vLLM server."""
    lora_r: int = Field(default=8, ge=1)
    """LoRA rank of the three adapters."""
    lora_alpha: int = Field(default=16, ge=1)
    """LoRA alpha."""
    lora_dropout: float = Field(default=0.05, ge=0.0, lt=1.0)
    """LoRA dropout."""
    target_modules: str | list[str] = "all-linear"
    """peft target modules."""
    lr: float = Field(default=1e-4, gt=0)
    """AdamW peak learning rate (no weight decay). Each phase warms it up linearly over 3 % of its step
    budget, the paper's, then decays it (cosine; ``learner.schedule.WARMUP_RATIO``)."""
    batch_size: int = Field(default=8, ge=1)
    """Samples per store per micro-batch."""
    grad_accum: int = Field(default=1, ge=1)
    """Micro-batches per optimizer step."""
    gradient_checkpointing: bool = True
    """Recompute activations in the backward pass: ~30 % more compute for a fraction of the memory.
    The learner needs it only for long sequences (the 135M default model peaks at ~3 GB without it
    at batch 2)."""
    max_seq_len: int = Field(default=1024, ge=16)
    """Longer sequences are truncated from the left of the prompt. (A path of the draft's turns,
    ``env.draft_turns``, trained as one sequence, ends after its last whole turn within
    ``inference.max_prompt_tokens``, the servers' prompt limit.)"""
    chunk_tokens: int = Field(default=1024, ge=0)
    """A micro-batch's sequences go through the model in chunks of at most this many
    tokens (at least one sequence each), each chunk's backward right after its forward, so only
    one chunk's activations are alive; the loss and gradient are the whole micro-batch's. 0: one
    pass per loss."""
    autocast: Literal["auto", "bf16", "off"] = "off"
    """Matmul precision of the frozen base model: ``bf16`` stores its linear weights in bf16 and
    runs the forward under bf16 autocast (LoRA tensors, optimizer, EMA, logits and losses stay
    fp32); ``auto`` = ``bf16`` on a GPU that supports it and on a CPU with native bf16
    instructions (avx512_bf16 or AMX), else ``off`` (fp32). The shipped configs set ``auto``;
    the default stays exact fp32."""

    @field_validator("autocast", mode="before")
    @classmethod
    def _off_is_not_false(cls, value: Any) -> Any:
        return "off" if value is False else value  # YAML 1.1 reads ``autocast: off`` (and --set ...=off) as false

    demo_loss_share: dict[str, Annotated[float, Field(gt=0.0, le=1.0)]] = Field(default_factory=dict)
    """``env.draft_turns``: per first word of a demonstrated action (``go``, ``open``...), the share of
    those turns that carry a loss (the rest stay in the path as context; absent words: all). A path
    is mostly search steps (``go to``, ``open``, ``close``: 80 % of the handcoded expert's actions on
    held-out games), so the draft's CE is mostly theirs; the rare steps that finish a task (``take``,
    ``move``, ``heat``...) get a larger share when the frequent ones are subsampled, as word2vec
    subsamples frequent words. Which turns: a hash of the path's id and the turn, the same on every
    pass; a path keeps at least its last demonstrated action. A ``go`` while the agent carries what it
    took (after a ``take``, before a ``move``) is the word ``deliver``, not ``go``: it names the task's
    receptacle, and ``go: 0.2`` had left it a fifth of its loss. The same share covers a
    KEEP reflection's final action (the draft copied); a reflection's decision and a REVISE's final
    action (the expert's correction) always carry a loss (subsampling the corrections too left the
    reflection copying the draft after REVISE on every held-out step; docs/findings.md)."""
    policy_wm_aux: float = Field(default=0.0, ge=0.0)
    """PaW (``learner/paw.py``): the policy adapter also predicts the next observation of the real
    transitions where its action entropy is highest (half of them, under the generalized
    cross-entropy with ``q`` 0.7: ``learner.paw.SHARE``, ``learner.paw.Q``); the term is kept at this
    fraction of the policy loss (adaptive weight). 0: off (CoMap itself). The entropy follows
    ``env.prompt_form``: in the window form the learner's current policy's over the executed action;
    in the turns forms the actor's as it drafted (minus the log of the draft's confidence, which
    needs ``actor.reflect_confidence``): their transitions do not carry the conversation the draft saw."""
    schedule: Literal["async", "rounds"] = "async"
    """``async``: train continuously and publish every ``publish_every`` steps;
    ``rounds``: the paper's collect-train-publish loop, a round as many new episodes as the steps it
    trains (``publish_every``)."""
    phases: PhasesConfig = Field(default_factory=PhasesConfig)
    """Each phase's own settings: its step budget, when it starts and ends, its rate, batch and publishing."""
    publish_every: int = Field(default=50, ge=1)
    """Publish adapters every this many optimizer steps."""
    checkpoint_every: int = Field(default=50, ge=1)
    """Checkpoint every this many optimizer steps (and at SIGTERM)."""
