"""A model's chat template rendered with jinja2 the way transformers does, the decision position's two
tokens, and the prompt strings per role (:class:`Prompts`)."""

from __future__ import annotations

import dataclasses
import functools
import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment

from comap_async.prompts.messages import (
    ALFWORLD,
    CRITIC_PREFIX,
    CRITIC_WORDS,
    DECISION_PREFIX,
    FINAL_PREFIX,
    THOUGHT_PREFIX,
    Conversation,
    Wording,
    choose_messages,
    critic_messages,
    draft_messages,
    draft_turn_messages,
    react_messages,
    reflect_messages,
    reflect_turn_messages,
    reflection_head,
    teacher_messages,
    wording_for,
    world_model_messages,
    world_model_turn_messages,
)
from comap_async.wire.messages import DECISIONS

REFLECTION_CONTINUATION = max((reflection_head(d) for d in DECISIONS), key=len)
"""The longest text a reflection's continuation appends to its prompt (actors/llm.py): a reflection that
leaves out its Final Action line is continued from its prompt and its decision's head."""

FIT_LEFT_OUT_TURNS = 8
"""Turns a draft prompt past the servers' limit leaves out at a time (:meth:`Prompts.turns_prompt`):
the next steps of the episode then extend the same shortened prompt, which the server's prefix
cache holds, until 8 more turns must go. Leaving out one turn a step changed the prompt's start at
every step, and each step of a long episode was a whole ~2,000-token prefill."""


@dataclass(frozen=True)
class DecisionTokens:
    """The two outcomes of the decision position (the first token after ``Decision:``): the first
    token of `` KEEP`` and of `` REVISE`` in one model's tokenizer, as text (what a server's logprobs
    name) and as ids (what the learner's logits index).

    ``p`` (:mod:`comap_async.method.decision`) is read from these two tokens only, by the actor (the
    server's logprobs), the learner (its logits), the probes and the metrics alike (docs/design.md section 6)."""

    keep: str
    revise: str
    keep_id: int
    revise_id: int

    @classmethod
    def from_tokenizer(
        cls,
        encode: Callable[[str], list[int]],
        decode: Callable[[int], str],
        words: tuple[str, str] = (" KEEP", " REVISE"),
    ) -> "DecisionTokens":
        """From a tokenizer's ``encode(text) -> ids`` (no special tokens) and ``decode(id) -> text``.
        ``words``: the (negative, positive) answers; another pair serves another yes/no question
        (the look-ahead critic's :data:`CRITIC_WORDS`), ``p`` then being the positive one's share."""
        keep, revise = encode(words[0]), encode(words[1])
        if not keep or not revise or keep[0] == revise[0]:
            raise ValueError(f"the tokenizer does not separate {words[0]!r} and {words[1]!r} at their first token")
        return cls(decode(keep[0]), decode(revise[0]), keep[0], revise[0])

    @classmethod
    def from_model_dir(cls, path: str | Path, words: tuple[str, str] = (" KEEP", " REVISE")) -> "DecisionTokens":
        """From the model directory's ``tokenizer.json`` (the ``tokenizers`` library: no torch)."""
        file = Path(path) / "tokenizer.json"
        if not file.is_file():
            raise ValueError(f"{path}: no tokenizer.json (needed to read the decision tokens)")
        tok = _tokenizer_file(str(file), file.stat().st_mtime_ns)
        return cls.from_tokenizer(
            lambda text: tok.encode(text, add_special_tokens=False).ids,
            lambda i: tok.decode([i], skip_special_tokens=False),
            words,
        )


@functools.lru_cache(maxsize=4)
def _tokenizer_file(file: str, mtime_ns: int) -> Any:
    """One parse of a ``tokenizer.json`` (as of ``mtime_ns``) for all the token pairs read from it."""
    from tokenizers import Tokenizer

    return Tokenizer.from_file(file)


# ---------------------------------------------------------------- chat template
_NO_SKELETON = object()
_VERIFY = 3  # full renders a skeleton is checked against before it is trusted


def _raise(message: str) -> None:
    raise jinja2.TemplateError(message)


TEMPLATE_VARIABLES: dict[str, Any] = {"enable_thinking": False}
"""Extra variables every chat template is rendered with (``apply_chat_template``'s keyword
arguments). Qwen3 runs in non-thinking mode, as in the paper: its template then closes an empty
``<think></think>`` block in the generation prompt, so drafts do not begin with ``<think>``.
Templates that do not read a variable ignore it."""


@dataclass
class ChatTemplate:
    """A model's chat template rendered with jinja2 the way transformers does."""

    template: str
    special: dict[str, str] = field(default_factory=dict)
    variables: dict[str, Any] = field(default_factory=lambda: dict(TEMPLATE_VARIABLES))
    """Template variables beyond ``messages``/``add_generation_prompt`` (default: non-thinking mode)."""

    def __post_init__(self) -> None:
        env = ImmutableSandboxedEnvironment(
            trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
        )
        env.filters["tojson"] = lambda x, indent=None, ensure_ascii=False: json.dumps(
            x, indent=indent, ensure_ascii=ensure_ascii
        )
        env.globals["raise_exception"] = _raise
        self._compiled = env.from_string(self.template)
        self._skeletons: dict[tuple, Any] = {}
        self._plain_extends = [0]  # conversations whose plain render equalled render_as_generated's (-1: one did not)

    @classmethod
    def from_model_dir(cls, path: str | Path) -> "ChatTemplate":
        p = Path(path)
        cfg_path = p / "tokenizer_config.json"
        cfg: dict[str, Any] = json.loads(cfg_path.read_text()) if cfg_path.is_file() else {}
        template = cfg.get("chat_template")
        jinja_file = p / "chat_template.jinja"
        if template is None and jinja_file.is_file():
            template = jinja_file.read_text()
        if not template:
            raise ValueError(f"{p}: the model has no chat template (tokenizer_config.json / chat_template.jinja)")

        def tok(name: str) -> str:
            v = cfg.get(name)
            return v.get("content", "") if isinstance(v, dict) else (v or "")

        return cls(template, {"bos_token": tok("bos_token"), "eos_token": tok("eos_token")})

    def render(self, messages: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
        """The template's output. Actors render several prompts per step, so for each message-role
        shape the template is rendered once with sentinel contents into a skeleton that is then
        filled by string replacement; the first ``_VERIFY`` uses of a skeleton are checked against a
        full render, and a template that transforms contents falls back to full renders for good."""
        key = (tuple(m["role"] for m in messages), add_generation_prompt)
        skeleton = self._skeletons.get(key)
        if skeleton is None:
            skeleton = self._skeletons[key] = self._make_skeleton(messages, add_generation_prompt)
        if skeleton is _NO_SKELETON:
            return self._full(messages, add_generation_prompt)
        parts, checks = skeleton
        out = parts[0]
        for i, m in enumerate(messages):
            out += m["content"] + parts[i + 1]
        if checks[0] < _VERIFY:
            checks[0] += 1
            if out != self._full(messages, add_generation_prompt):
                self._skeletons[key] = _NO_SKELETON
                return self._full(messages, add_generation_prompt)
        return out

    def render_as_generated(self, messages: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
        """``messages`` with each assistant message placed right after the generation prompt it answered,
        followed by what the template writes after it up to the next one: the prompts of a conversation's
        steps then extend each other (step k+1's is step k's, its answer, the end of turn and the new turn).

        Qwen3's template writes a past assistant turn without the empty ``<think></think>`` block its
        generation prompt (thinking off) put before the answer, so its plain render of step k+1 does not
        start with step k's prompt; here the block stays where the model saw it when it answered. A
        template whose plain render extends anyway (ChatML, SmolLM2's) gives :meth:`render`'s text, and
        once ``_VERIFY`` conversations have shown it, its plain render is used (one render, not one per
        answer: ~4 ms for a 40-turn conversation)."""
        answers = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
        if not answers or self._plain_extends[0] >= _VERIFY:
            return self.render(messages, add_generation_prompt)
        text = self.render(messages[: answers[0]], True)
        for k, at in enumerate(answers):
            last = k + 1 == len(answers)
            upto = len(messages) if last else answers[k + 1]
            after = self._after(messages[:upto], at, add_generation_prompt if last else True)
            if after is None:  # the template does not write the answer once, verbatim: its own render
                return self.render(messages, add_generation_prompt)
            text += messages[at]["content"] + after
        if self._plain_extends[0] >= 0:
            same = text == self.render(messages, add_generation_prompt)
            self._plain_extends[0] = self._plain_extends[0] + 1 if same else -1  # -1: never trusted
        return text

    def _after(self, messages: list[dict[str, str]], at: int, add_generation_prompt: bool) -> str | None:
        """What the template writes after message ``at``'s content (None: it does not write it once)."""
        marker = "\x00comap-answer\x00"
        marked = [*messages[:at], {**messages[at], "content": marker}, *messages[at + 1 :]]
        text = self.render(marked, add_generation_prompt)
        return text.split(marker)[1] if text.count(marker) == 1 else None

    def _full(self, messages: list[dict[str, str]], add_generation_prompt: bool) -> str:
        return self._compiled.render(
            messages=messages, add_generation_prompt=add_generation_prompt, **{**self.variables, **self.special}
        )

    def _make_skeleton(self, messages: list[dict[str, str]], add_generation_prompt: bool) -> Any:
        sentinels = [f"\x00comap-content-{i}\x00" for i in range(len(messages))]
        text = self._full([{**m, "content": s} for m, s in zip(messages, sentinels)], add_generation_prompt)
        parts, rest = [], text
        for s in sentinels:
            if rest.count(s) != 1:  # the template drops, repeats or reorders contents
                return _NO_SKELETON
            head, rest = rest.split(s)
            parts.append(head)
        parts.append(rest)
        return parts, [0]


@dataclass(frozen=True)
class Prompts:
    """Prompt strings per role for one model; the generation starts right after each string."""

    chat: ChatTemplate
    future_state: bool = True
    """False (ablation ``no_future_state``): the reflection prompt leaves out the imagined state,
    in the actors' calls and the learner's samples alike."""
    wording: Wording = ALFWORLD
    """The environment's system messages (its registry entry's, :func:`wording_for`); actors and the
    learner pick the same."""
    decision: DecisionTokens | None = None
    """The decision position's two tokens (needed to read ``p`` from a reflection)."""
    critic_answer: DecisionTokens | None = None
    """The look-ahead critic's NO / YES tokens (:data:`CRITIC_WORDS`)."""
    max_prompt_tokens: int | None = None
    """The servers' prompt limit (``inference.max_prompt_tokens``): a draft prompt of the episode's
    turns that would pass it leaves out its oldest turns (:meth:`draft`). None: no limit applied."""
    count_tokens: Callable[[str], int] | None = field(default=None, compare=False, repr=False)
    reflect_turns: bool = False
    """``env.reflect_turns``: the reflection continues the draft's conversation (:meth:`reflect`)."""
    wm_turns: bool = False
    """``env.wm_turns``: the world model and its teacher see the episode as their own conversation
    (:meth:`world_model`, :meth:`teacher`)."""

    @classmethod
    def from_config(
        cls,
        chat: ChatTemplate,
        cfg: Any,
        decision: DecisionTokens | None = None,
        critic_answer: DecisionTokens | None = None,
    ) -> "Prompts":
        """The prompts a run uses: its environment's wording, its ablation's reflection prompt."""
        from comap_async.method.routing import reflection_shows_future

        return cls(
            chat,
            future_state=reflection_shows_future(cfg.method.ablation),
            wording=wording_for(cfg.env.name),
            decision=decision,
            critic_answer=critic_answer,
            reflect_turns=cfg.env.reflect_turns,
            wm_turns=cfg.env.wm_turns,
        )

    @classmethod
    def for_model(cls, model_dir: str | Path, cfg: Any) -> "Prompts":
        """:meth:`from_config` with the chat template, decision and critic tokens of ``model_dir``."""
        try:
            critic = DecisionTokens.from_model_dir(model_dir, CRITIC_WORDS)
        except ValueError:  # a tokenizer that does not separate them (a tiny test one): no look-ahead critic
            critic = None
        prompts = cls.from_config(
            ChatTemplate.from_model_dir(model_dir), cfg, DecisionTokens.from_model_dir(model_dir), critic
        )
        if not cfg.env.draft_turns:
            return prompts
        file = Path(model_dir) / "tokenizer.json"
        tok = _tokenizer_file(str(file), file.stat().st_mtime_ns)
        return dataclasses.replace(
            prompts,
            max_prompt_tokens=cfg.inference.max_prompt_tokens,
            count_tokens=lambda text: len(tok.encode(text, add_special_tokens=True).ids),  # as the server counts
        )

    def draft(self, state: str | Conversation) -> str:
        """The draft prompt: of a rendered state ``s_t``, or of the episode's turns (``env.draft_turns``)."""
        if isinstance(state, Conversation):
            return self.turns_prompt(state)
        return self.chat.render(draft_messages(state, self.wording))

    def turns_prompt(self, conversation: Conversation, fit: bool = True) -> str:
        """The turns' draft prompt; with ``fit``, its oldest turns (after the first one: the task) left
        out while it would pass ``max_prompt_tokens`` (:meth:`_fit`): a looping greedy episode reaches
        ~2,000 tokens by step 40 on ALFWorld, and the server refuses a longer prompt. The learner renders
        paths whole (``fit`` false) and ends them within the same limit, so a trained prompt is never one
        the actors cut."""

        def render(c: Conversation) -> str:
            return self.chat.render_as_generated(draft_turn_messages(c, self.wording))

        return self._fit(conversation, render) if fit else render(conversation)

    def _fit(
        self,
        conversation: Conversation,
        render: Callable[[Conversation], str],
        limit: int | None = None,
        count: Callable[[str], int] | None = None,
        reserve: str = "",
    ) -> str:
        """``render(conversation)``, its oldest turns left out :data:`FIT_LEFT_OUT_TURNS` at a time while
        it counts more than ``limit`` tokens (default: the servers' ``max_prompt_tokens``, counted as they
        count; no limit known: whole) with ``reserve`` after it (what a later request may append)."""
        limit = self.max_prompt_tokens if limit is None else limit
        count = self.count_tokens if count is None else count
        prompt = render(conversation)
        if limit is None or count is None:
            return prompt
        turns, left_out = conversation.turns, 0
        while left_out < len(turns) and count(prompt + reserve) > limit:
            left_out = min(left_out + FIT_LEFT_OUT_TURNS, len(turns))
            prompt = render(Conversation(conversation.task, conversation.first, turns[left_out:]))
        return prompt

    def reflect(
        self,
        state: str,
        a_draft: str,
        s_hat: str,
        confidence: float | None = None,
        conversation: Conversation | None = None,
        limit: int | None = None,
        count: Callable[[str], int] | None = None,
    ) -> str:
        """The reflection prompt, ending at the decision position: of the state ``s_t``, or with
        ``reflect_turns`` the draft's ``conversation`` continued by the draft (its oldest turns left
        out as :meth:`_fit` does, to ``limit`` tokens as ``count`` counts them: the learner's own)."""
        # The decision word is the first generated token, so its logprobs give p_revise.
        shown = s_hat if self.future_state else None
        if not self.reflect_turns:
            return self.chat.render(reflect_messages(state, a_draft, shown, self.wording, confidence)) + DECISION_PREFIX

        def render(c: Conversation) -> str:
            messages = reflect_turn_messages(c, a_draft, shown, self.wording, confidence)
            return self.chat.render_as_generated(messages) + DECISION_PREFIX

        # the servers must take the continuation's request too; the learner's own limit counts the head as target
        reserve = REFLECTION_CONTINUATION if limit is None else ""
        return self._continue("reflect_turns", conversation, render, limit, count, reserve)

    def world_model(
        self,
        state: str,
        action: str,
        conversation: Conversation | None = None,
        limit: int | None = None,
        count: Callable[[str], int] | None = None,
    ) -> str:
        """The world model's prompt: of ``s_t``, or with ``wm_turns`` of the episode's ``conversation``
        (the draft's at this step; oldest turns left out as :meth:`_fit` does)."""
        if not self.wm_turns:
            return self.chat.render(world_model_messages(state, action, self.wording))
        return self._continue("wm_turns", conversation, self._world_model_render(action), limit, count)

    def _world_model_render(self, action: str, hindsight: str | None = None) -> Callable[[Conversation], str]:
        return lambda c: self.chat.render_as_generated(world_model_turn_messages(c, action, self.wording, hindsight))

    def _continue(
        self,
        setting: str,
        conversation: Conversation | None,
        render: Callable[[Conversation], str],
        limit: int | None,
        count: Callable[[str], int] | None,
        reserve: str = "",
    ) -> str:
        """A role's prompt in the turns form ``env.prompt_form`` ``all_turns`` chose for it (``setting``:
        ``reflect_turns``, ``wm_turns``): ``conversation`` rendered and fitted (:meth:`_fit`); a caller
        without one (a sample stored by a run in another prompt form) is refused."""
        if conversation is None:
            raise ValueError(
                f"env.prompt_form all_turns ({setting}): this prompt has no conversation to continue (a sample "
                "stored by a run in another prompt form?)"
            )
        return self._fit(conversation, render, limit, count, reserve)

    def react(self, state: str) -> str:
        # the thought comes first: the generation starts after its prefix
        return self.chat.render(react_messages(state, self.wording)) + THOUGHT_PREFIX

    def choose(self, state: str, a_draft: str, s_hat: str) -> str:
        return self.chat.render(choose_messages(state, a_draft, s_hat, self.wording)) + FINAL_PREFIX

    def critic(self, state: str, trajectory: Sequence[tuple[str, str]]) -> str:
        # the answer word is the first generated token, so its logprobs give the score
        return self.chat.render(critic_messages(state, trajectory, self.wording)) + CRITIC_PREFIX

    def teacher(
        self,
        state: str,
        action: str,
        real_next: str,
        conversation: Conversation | None = None,
        limit: int | None = None,
        count: Callable[[str], int] | None = None,
    ) -> str:
        """The EMA teacher's prompt: the world model's (:meth:`world_model`) with the real next
        observation in its last turn (hindsight)."""
        if not self.wm_turns:
            return self.chat.render(teacher_messages(state, action, real_next, self.wording))
        return self._continue("wm_turns", conversation, self._world_model_render(action, real_next), limit, count)
