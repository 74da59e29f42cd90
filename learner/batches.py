"""Turn stored records into token tensors for each loss (the get-batch step, kept apart from learning).

Prompts come from ``comap_async.prompts`` (the same strings the actors sent to the inference
server); a target is tokenised on its own and appended, exactly as generation continues a prompt.
An over-long prompt loses tokens from its middle: the head (chat header, system prompt, task)
and the tail (current observation, admissible commands, the question) stay, the oldest history
goes; the target always survives. A role's prompt that is a conversation (``env.reflect_turns``,
``env.wm_turns``) loses its oldest whole turns instead, as the actors' do. Either is counted
(``truncated``, logged as ``learner/truncated`` per step): ``learner.max_seq_len`` should cover the
longest prompts (see configs/local.yaml).
"""

from __future__ import annotations

import zlib
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from comap_async.config import LearnerConfig
from comap_async.method.gates import action_verb
from comap_async.prompts import Conversation, DecisionTokens, Prompts, reflection_head, reflection_target
from comap_async.wire.records import RecordKind, record_kind

KEEP_HEAD = 128  # kept from a truncated prompt's start: header + system prompt + task are 49-83 SmolLM2 tokens


@dataclass
class Seq:
    ids: list[int]
    start: int  # index of the first target token
    n_target: int
    change: list[bool] | None = None  # per target token: is it a change token (world-model CE only)
    loss: list[bool] | None = None
    """Per target token: does it carry a loss (None: all do). A warm-up path's span runs from its first
    action to its last; the observations and exploratory actions between are context."""

    @property
    def n_loss(self) -> int:
        return self.n_target if self.loss is None else sum(self.loss)


def change_token_flags(target_ids: Sequence[int], before_ids: Collection[int]) -> list[bool]:
    """Which target tokens are *change tokens*: tokens of the real next observation that do not
    occur in the observation before the action (``before_ids``).

    The world model's CE on ``s'`` is dominated by tokens it can copy from the state it was
    shown (``On the countertop 1, you see ...`` repeats what was there); the NLL on the other
    tokens (``wm/change_nll``, docs/design.md section 9) follows what it predicts about the action's
    effect. A proxy on token ids, not on facts: cheap enough to log at every step.
    """
    before = set(before_ids)
    return [t not in before for t in target_ids]


DELIVER = "deliver"
"""``learner.demo_loss_share``'s word for a ``go`` while the agent carries an object it took."""


def loss_word(action: str, carrying: bool) -> str:
    """The word ``learner.demo_loss_share`` looks ``action`` up by: its first word, but a ``go``
    while carrying is :data:`DELIVER`: it picks the one receptacle the task names, not a search step."""
    word = action_verb(action)
    return DELIVER if carrying and word == "go" else word


def carrying_after(carrying: bool, action: str, observation: str) -> bool:
    """Whether the agent carries an object after ``action`` got ``observation`` (ALFWorld's words:
    a ``take`` that picked something up, until a ``move`` put it somewhere)."""
    obs = observation.lstrip().lower()
    if action.startswith("take ") and obs.startswith("you pick up"):
        return True
    if action.startswith("move ") and obs.startswith(("you move", "you put")):
        return False
    return carrying


def carries_loss(action: str, key: str, share: Mapping[str, float], carrying: bool = False) -> bool:
    """Whether a demonstrated ``action`` carries a loss under ``learner.demo_loss_share``: always
    when its word (:func:`loss_word`) has no share, else for that share of keys (a stable hash of
    ``key``: the same turn is chosen on every pass and in every process)."""
    keep = share.get(loss_word(action, carrying), 1.0)
    return keep >= 1.0 or zlib.crc32(key.encode()) / 2**32 < keep


@dataclass
class Encoder:
    tokenizer: Any
    prompts: Prompts
    max_seq_len: int
    max_path_tokens: int = 2048
    """A path of the draft's turns ends after its last whole turn within this many tokens: the servers'
    prompt limit (``inference.max_prompt_tokens``, which the actors' prompts stay under)."""
    demo_loss_share: Mapping[str, float] = field(default_factory=dict)
    """``learner.demo_loss_share``: per first word of a demonstrated action, the share of its turns
    that carry a loss (:func:`carries_loss`)."""

    @classmethod
    def for_learner(cls, tokenizer: Any, prompts: Prompts, lc: LearnerConfig) -> "Encoder":
        """The encoder the learner trains with, from its config section (``learner.*``) and the prompts
        (in the turns forms they hold the servers' prompt limit, ``max_path_tokens``): the benchmarks that
        train as the learner does build it here too."""
        limit = prompts.max_prompt_tokens or cls.max_path_tokens
        return cls(tokenizer, prompts, lc.max_seq_len, limit, lc.demo_loss_share)

    def __post_init__(self) -> None:
        self.truncated = 0  # prompts cut to fit max_seq_len since the trainer last read it
        self._counted = 0
        self._last_text: str | None = None
        self._last_ids: list[int] = []
        self.demo_actions = 0  # demonstrated actions encoded since the trainer last read it
        self.eos = self.tokenizer.eos_token or ""
        self.decision = DecisionTokens.from_tokenizer(
            self._ids, lambda i: self.tokenizer.decode([i], skip_special_tokens=False)
        )
        if self.prompts.decision is not None and self.prompts.decision != self.decision:
            raise ValueError(
                f"the actors' decision tokens {self.prompts.decision} differ from the learner's "
                f"{self.decision}: both must come from the same tokenizer"
            )
        self.keep_id, self.revise_id = self.decision.keep_id, self.decision.revise_id
        # a reflection target's tokens before its final action, per decision (reflection())
        self.reflection_heads = {d: self._ids(reflection_head(d)) for d in ("KEEP", "REVISE")}

    def _ids(self, text: str) -> list[int]:
        # the last text's ids are kept: a conversation's prompt is counted while it is fitted (_count),
        # then encoded (seq), and tokenizing it is most of a sample's encoding
        if text != self._last_text:
            self._last_text, self._last_ids = text, self.tokenizer(text, add_special_tokens=False)["input_ids"]
        return list(self._last_ids)

    def _count(self, text: str) -> int:
        self._counted += 1
        return len(self._ids(text))

    def _fitted(self, prompt: Callable[[], str]) -> str:
        """``prompt()``, a :class:`Prompts` role given :meth:`_count`, counted in ``truncated`` when its
        conversation lost turns to fit (``Prompts._fit`` counts a prompt that fits once, a shortened one more)."""
        self._counted = 0
        text = prompt()
        self.truncated += self._counted > 1
        return text

    def seq(self, prompt: str, target: str, add_eos: bool = True) -> Seq:
        p = self._ids(prompt)
        t = self._ids(target + (self.eos if add_eos else ""))
        t = t[: max(1, self.max_seq_len // 2)]  # a runaway target must not push the prompt out entirely
        room = self.max_seq_len - len(t)
        if len(p) > room:
            self.truncated += 1
            head = min(KEEP_HEAD, room // 2)
            p = p[:head] + p[len(p) - (room - head) :] if room > 0 else []
        return Seq(p + t, len(p), len(t))

    # ------------------------------------------------------------ per role
    def _conversation(self, r: dict[str, Any]) -> Conversation | None:
        """The conversation a record's step was taken in (``env.reflect_turns`` / ``env.wm_turns``)."""
        d = r.get("dialogue")
        return None if d is None else Conversation.from_record(d)

    def _room(self, r: dict[str, Any], target: str, add_eos: bool = True) -> int | None:
        """Prompt tokens that fit beside ``target`` in ``max_seq_len`` when ``r`` carries a conversation:
        one longer than that loses its oldest turns, as the actors' prompts do, not its middle tokens
        (:meth:`seq`'s cut would leave a turn broken). None for an ``s_t`` prompt (:meth:`seq` cuts it)."""
        if r.get("dialogue") is None:
            return None
        return self.max_seq_len - len(self._ids(target + (self.eos if add_eos else "")))

    def world_model_ce(self, r: dict[str, Any]) -> Seq:
        room = self._room(r, r["s_next"])
        conversation = self._conversation(r)
        prompt = self._fitted(lambda: self.prompts.world_model(r["s"], r["a_exec"], conversation, room, self._count))
        s = self.seq(prompt, r["s_next"])
        # the end-of-text token is never a change token; records without ``o`` count every token
        before = self._ids(r.get("o") or "") + ([self.tokenizer.eos_token_id] if self.eos else [])
        s.change = change_token_flags(s.ids[s.start : s.start + s.n_target], before)
        return s

    def world_model_rollout(self, r: dict[str, Any]) -> tuple[Seq, Seq] | None:
        """Student and teacher sequences over the stored student rollout ``s_hat_exec`` (None if empty)."""
        if not r.get("s_hat_exec", "").strip():
            return None
        rollout, conversation = r["s_hat_exec"], self._conversation(r)
        room = self._room(r, rollout, add_eos=False)
        student_prompt = self._fitted(
            lambda: self.prompts.world_model(r["s"], r["a_exec"], conversation, room, self._count)
        )
        student = self.seq(student_prompt, rollout, add_eos=False)
        teacher_prompt = self._fitted(
            lambda: self.prompts.teacher(r["s"], r["a_exec"], r["s_next"], conversation, room, self._count)
        )
        teacher = self.seq(teacher_prompt, rollout, add_eos=False)
        n = min(student.n_target, teacher.n_target)
        return Seq(student.ids, student.start, n), Seq(teacher.ids, teacher.start, n)

    def draft(self, r: dict[str, Any]) -> Seq:
        if record_kind("demos", r) is RecordKind.DEMO_PATH:
            return self.path(r)
        self.demo_actions += 1
        return self.seq(self.prompts.draft(r["s"]), r["target"])

    def path(self, r: dict[str, Any]) -> Seq:
        """A warm-up path (a ``turn_demos`` record, ``env.draft_turns``) as one sequence: the first
        step's draft prompt, then per turn its action (with the end-of-turn token: a loss where the
        action is a demonstration) and what the next step's prompt adds (context). Every action's
        tokens follow exactly the prompt the actors send at that step, tokenised as generation
        continues it; a path longer than ``max_path_tokens`` ends after its last whole turn that fits."""
        turns = [(str(a), str(o)) for a, o in r["turns"]]
        targets = [bool(x) for x in r["targets"]]
        last = max(i for i, x in enumerate(targets) if x)
        conversation = Conversation(r.get("goal", ""), r["first"])
        text = self.prompts.turns_prompt(conversation, fit=False)
        ids, start = self._ids(text), None
        loss: list[bool] = []
        last_demo: tuple[int, int] | None = None  # (offset in ids, tokens) of the last demonstrated action
        carrying = False
        for i in range(last + 1):
            if i:
                conversation = conversation.then(*turns[i - 1])
                prompt = self.prompts.turns_prompt(conversation, fit=False)
                if not prompt.startswith(text):
                    raise ValueError(
                        "env.prompt_form draft_turns: this model's chat template does not extend a conversation turn "
                        "by turn (a step's prompt is not the previous step's prompt, action and end of turn)"
                    )
                gap = self._ids(prompt[len(text) :])
                text = prompt
            else:
                gap = []
            action = turns[i][0].strip()
            act = self._ids(action + self.eos)
            if start is not None and len(ids) + len(gap) + len(act) > self.max_path_tokens:
                self.truncated += 1
                break
            if start is None:
                start = len(ids)
            carry = targets[i] and carries_loss(action, f"{r.get('id', '')}:{i}", self.demo_loss_share, carrying)
            carrying = carrying_after(carrying, action, turns[i][1])
            if targets[i]:
                last_demo = (len(ids) + len(gap), len(act))
            ids += gap + act
            loss += [False] * len(gap) + [carry] * len(act)
            self.demo_actions += carry
            text += action + self.eos
        assert start is not None
        if last_demo is not None and not any(loss):  # every demonstrated action subsampled: the last stays
            at, n = last_demo
            loss[at - start : at - start + n] = [True] * n
            self.demo_actions += 1
        return Seq(ids, start, len(ids) - start, loss=loss)

    def reflection(self, r: dict[str, Any]) -> Seq:
        """A reflection sample: its decision and ``Final Action:`` prefix always carry a loss, and so
        does a REVISE's final action (the correction, the one thing only it teaches); a KEEP's final
        action, the draft copied, under ``demo_loss_share`` (:func:`carries_loss`, keyed by the
        sample's id). With every final action subsampled a REVISE had ~17 targets to learn
        from among 233 copies, and the reflection wrote the draft after REVISE on every held-out step;
        with none subsampled the copies of frequent ``go`` drafts carried full loss too."""
        decision = "REVISE" if int(r["y"]) == 1 else "KEEP"
        target = reflection_target(decision, r["target"])
        conversation, room = self._conversation(r), self._room(r, target)
        prompt = self._fitted(
            lambda: self.prompts.reflect(
                r["s"], r["a_draft"], r["s_bar"], r.get("draft_confidence"), conversation, room, self._count
            )
        )
        s = self.seq(prompt, target)
        action = str(r["target"]).strip()
        if (
            decision == "KEEP"
            and self.demo_loss_share
            and not carries_loss(action, str(r.get("id", "")), self.demo_loss_share)
        ):
            head = self.reflection_heads[decision]
            if s.ids[s.start : s.start + len(head)] == head:  # the head's tokens stay apart from the action's
                s.loss = [i < len(head) for i in range(s.n_target)]
        return s
