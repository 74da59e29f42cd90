"""Prompt rendering and parsing for every role, in one place (docs/design.md section 1).

Actors and the learner build prompts only through these functions and the model's own chat
template, so both sides produce the same token sequences. Rendering uses jinja2 on the template
stored in the model directory (no transformers import), which keeps actors light.

Roles:
* draft       ``s_t`` -> an action
* reflect     ``(s_t, a_draft, ŝ)`` -> ``Decision: KEEP|REVISE`` + ``Final Action: ...``
* world model ``(s_t, a)`` -> the next observation
* teacher     ``(s_t, a, s')`` -> the next observation, having seen the real one (hindsight)
"""

from __future__ import annotations

import functools
import json
import math
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment

SYSTEM_AGENT = (
    "You are an agent in a text-based household environment. "
    "You act with short commands such as 'go to cabinet 1', 'open fridge 1', 'take apple 1 from countertop 1', "
    "'move apple 1 to countertop 1', 'heat egg 1 with microwave 1'."
)
SYSTEM_WORLD = (
    "You are a world model of a text-based household environment. "
    "Given the current state and an action, you write the exact observation the environment returns."
)


@dataclass(frozen=True)
class Wording:
    """What differs between environments in the prompts: the two system messages (what kind of
    world, and a few of its commands, which a small model needs to see once). Everything else
    (task, recent history, observation, admissible commands, the answer formats) is shared."""

    agent: str
    world: str


ALFWORLD = Wording(agent=SYSTEM_AGENT, world=SYSTEM_WORLD)


def wording_for(env_name: str) -> Wording:
    """The environment's prompt wording, from its registry entry."""
    from comap_async.envs.registry import env_spec

    return env_spec(env_name).wording


DECISION_PREFIX = "Decision:"
FINAL_PREFIX = "Final Action:"
THOUGHT_PREFIX = "Thought:"
REACT_ACTION_PREFIX = "Action:"


# ---------------------------------------------------------------- textual state s_t
def render_state(
    task: str,
    history: Sequence[tuple[str, str]],
    observation: str,
    admissible: Sequence[str] | None = None,
    k: int = 3,
    show_admissible: bool = True,
) -> str:
    """``s_t``: the task, the last ``k`` (action, observation) pairs and the current observation."""
    parts = [f"Task: {task.strip()}"]
    recent = list(history)[-k:] if k > 0 else []
    if recent:
        parts.append("Recent history:")
        parts.extend(f"> {a.strip()}\n{o.strip()}" for a, o in recent)
    parts.append(f"Current observation: {observation.strip()}")
    if show_admissible and admissible:
        parts.append("Admissible commands: " + ", ".join(a.strip() for a in admissible))
    return "\n".join(parts)


# ---------------------------------------------------------------- messages per role
def draft_messages(state: str, wording: Wording = ALFWORLD) -> list[dict[str, str]]:
    return [
        {"role": "system", "content": wording.agent},
        {"role": "user", "content": f"{state}\n\nWhat is your next action? Answer with one command only."},
    ]


CONFIDENCE_WORDS = ((0.9, "high"), (0.6, "medium"), (0.0, "low"))
"""``draft_confidence`` (the draft's geometric-mean token probability) in words: a small model reads
a word more easily than a number."""


def confidence_word(confidence: float) -> str:
    return next(word for floor, word in CONFIDENCE_WORDS if confidence >= floor)


def reflect_messages(
    state: str, a_draft: str, s_hat: str | None, wording: Wording = ALFWORLD, confidence: float | None = None
) -> list[dict[str, str]]:
    """``s_hat`` None: the reflection without the imagined state (ablation ``no_future_state``);
    ``confidence``: the draft's own token probability, shown as a word (``actor.reflect_confidence``:
    the actors and probes from the draft call's logprobs, the learner from a record's ``draft_confidence``)."""
    imagined = "" if s_hat is None else f"Imagined result of the draft: {s_hat.strip()}\n"
    shown = "" if confidence is None else f"Your confidence in the draft: {confidence_word(confidence)}\n"
    return [
        {"role": "system", "content": wording.agent},
        {
            "role": "user",
            "content": (
                f"{state}\n\nYour draft action: {a_draft.strip()}\n{shown}{imagined}\n"
                "Does the draft move you towards the task? Answer exactly in this form:\n"
                f"{DECISION_PREFIX} KEEP or REVISE\n{FINAL_PREFIX} <one command>"
            ),
        },
    ]


def react_messages(state: str, wording: Wording = ALFWORLD) -> list[dict[str, str]]:
    """ReAct (the paper's prompting baseline): a short thought, then the action, from the state alone."""
    return [
        {"role": "system", "content": wording.agent},
        {
            "role": "user",
            "content": (
                f"{state}\n\nThink briefly about what to do next, then act. Answer exactly in "
                f"this form:\n{THOUGHT_PREFIX} <one sentence>\n{REACT_ACTION_PREFIX} <one command>"
            ),
        },
    ]


def choose_messages(state: str, a_draft: str, s_hat: str, wording: Wording = ALFWORLD) -> list[dict[str, str]]:
    """Imagine-and-Act (the paper's prompting baseline): pick the final action after seeing the
    imagined consequence of a candidate; no KEEP/REVISE decision, so no action gate."""
    return [
        {"role": "system", "content": wording.agent},
        {
            "role": "user",
            "content": (
                f"{state}\n\nCandidate action: {a_draft.strip()}\n"
                f"Imagined result of the candidate: {s_hat.strip()}\n\n"
                "Choose your final action: the candidate, or a better command. Answer with one command only."
            ),
        },
    ]


def critic_messages(
    state: str, trajectory: Sequence[tuple[str, str]], wording: Wording = ALFWORLD
) -> list[dict[str, str]]:
    """The look-ahead critic (WebEvolver's imagination engine): the policy judges an imagined
    continuation of the state, the actions with the world model's answers."""
    steps = "\n".join(f"> {a.strip()}\n{o.strip()}" for a, o in trajectory)
    return [
        {"role": "system", "content": wording.agent},
        {
            "role": "user",
            "content": (
                f"{state}\n\nImagined continuation:\n{steps}\n\n"
                "Does this continuation bring the task closer to done? Answer YES or NO."
            ),
        },
    ]


def world_model_messages(state: str, action: str, wording: Wording = ALFWORLD) -> list[dict[str, str]]:
    return [
        {"role": "system", "content": wording.world},
        {"role": "user", "content": f"{state}\n\nAction: {action.strip()}\nWhat does the environment answer?"},
    ]


def teacher_messages(state: str, action: str, real_next: str, wording: Wording = ALFWORLD) -> list[dict[str, str]]:
    """The EMA teacher's context: the world-model prompt plus the real next observation (hindsight)."""
    return [
        {"role": "system", "content": wording.world},
        {
            "role": "user",
            "content": (
                f"{state}\n\nAction: {action.strip()}\n"
                f"(Hindsight: the environment actually answered: {real_next.strip()})\n"
                "What does the environment answer?"
            ),
        },
    ]


def reflection_head(decision: str) -> str:
    """What follows ``Decision:`` up to the final action: the decision word and the ``Final Action:``
    prefix. The actor continues a reflection from here when the model left the line out."""
    return f" {decision}\n{FINAL_PREFIX}"


def reflection_target(decision: str, action: str) -> str:
    """The assistant text after the ``Decision:`` prefix, as trained and as generated."""
    return f"{reflection_head(decision)} {action.strip()}"


@dataclass(frozen=True)
class DecisionTokens:
    """The two outcomes of the decision position (the first token after ``Decision:``): the first
    token of `` KEEP`` and of `` REVISE`` in one model's tokenizer, as text (what a server's logprobs
    name) and as ids (what the learner's logits index).

    ``p`` (:func:`revise_probability`) is read from these two tokens only, by the actor (the server's
    logprobs), the learner (its logits), the probes and the metrics alike (docs/design.md section 6)."""

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


CRITIC_WORDS = (" NO", " YES")
"""The look-ahead critic's answers: its score is P(YES) / (P(YES) + P(NO)) at the first answer token."""
CRITIC_PREFIX = "Answer:"


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
            future_state=reflection_shows_future(cfg.ablation),
            wording=wording_for(cfg.env.name),
            decision=decision,
            critic_answer=critic_answer,
        )

    @classmethod
    def for_model(cls, model_dir: str | Path, cfg: Any) -> "Prompts":
        """:meth:`from_config` with the chat template, decision and critic tokens of ``model_dir``."""
        try:
            critic = DecisionTokens.from_model_dir(model_dir, CRITIC_WORDS)
        except ValueError:  # a tokenizer that does not separate them (a tiny test one): no look-ahead critic
            critic = None
        return cls.from_config(
            ChatTemplate.from_model_dir(model_dir), cfg, DecisionTokens.from_model_dir(model_dir), critic
        )

    def draft(self, state: str) -> str:
        return self.chat.render(draft_messages(state, self.wording))

    def reflect(self, state: str, a_draft: str, s_hat: str, confidence: float | None = None) -> str:
        # The decision word is the first generated token, so its logprobs give p_revise.
        shown = s_hat if self.future_state else None
        messages = reflect_messages(state, a_draft, shown, self.wording, confidence)
        return self.chat.render(messages) + DECISION_PREFIX

    def world_model(self, state: str, action: str) -> str:
        return self.chat.render(world_model_messages(state, action, self.wording))

    def react(self, state: str) -> str:
        # the thought comes first: the generation starts after its prefix
        return self.chat.render(react_messages(state, self.wording)) + THOUGHT_PREFIX

    def choose(self, state: str, a_draft: str, s_hat: str) -> str:
        return self.chat.render(choose_messages(state, a_draft, s_hat, self.wording)) + FINAL_PREFIX

    def critic(self, state: str, trajectory: Sequence[tuple[str, str]]) -> str:
        # the answer word is the first generated token, so its logprobs give the score
        return self.chat.render(critic_messages(state, trajectory, self.wording)) + CRITIC_PREFIX

    def teacher(self, state: str, action: str, real_next: str) -> str:
        return self.chat.render(teacher_messages(state, action, real_next, self.wording))


# ---------------------------------------------------------------- parsing
_ACTION_PREFIX = re.compile(r"^\s*(?:>|action\s*:|final action\s*:|command\s*:|\d+[.)])\s*", re.IGNORECASE)


@dataclass(frozen=True, slots=True)
class Parsed:
    value: str | None
    """The parsed text, or None when nothing usable was found."""
    problem: str | None = None
    """What could not be parsed (for counters), None when clean."""


_PLACEHOLDER = re.compile(r"^<[^<>]*>$")


def parse_action(text: str) -> Parsed:
    """First non-empty line, without prompt-like prefixes, quotes and trailing punctuation. The
    prompts' own placeholder copied back (``<one command>``) is no action."""
    for line in text.splitlines():
        line = _ACTION_PREFIX.sub("", line).strip().strip("\"'`").rstrip(".!").strip()
        if line:
            if _PLACEHOLDER.match(line):
                return Parsed(None, "placeholder")
            return Parsed(line, None if line == text.strip() else "extra_text")
    return Parsed(None, "empty")


_REACT_ACTION = re.compile(r"^\s*action\s*:\s*(.+)$", re.IGNORECASE | re.MULTILINE)


def parse_react(completion: str) -> Parsed:
    """The command on the last ``Action:`` line of a ReAct answer (generated after ``Thought:``)."""
    found = _REACT_ACTION.findall(completion)
    if not found:
        return Parsed(None, "no_action")
    return parse_action(found[-1])


@dataclass(frozen=True, slots=True)
class Reflection:
    decision: str | None
    """KEEP, REVISE, or None when unreadable."""
    final_action: str | None
    """The action after ``Final Action:``, or None."""
    problem: str | None = None


_DECISION = re.compile(r"\b(KEEP|REVISE)\b", re.IGNORECASE)
_FINAL = re.compile(r"final\s*action\s*:\s*(.+)", re.IGNORECASE)


def parse_reflection(completion: str) -> Reflection:
    """Parse the text generated after the ``Decision:`` prefix (or a full answer that repeats it)."""
    text = completion.strip()
    first = text.splitlines()[0] if text else ""
    m = _DECISION.search(first.split(":", 1)[-1] if first.lower().startswith("decision") else first)
    decision = m.group(1).upper() if m else None
    fm = _FINAL.search(text)
    final = parse_action(fm.group(1)).value if fm else None
    problem = None if decision and final else ("no_decision" if not decision else "no_final_action")
    return Reflection(decision, final, problem)


def revise_probability(logprobs: Mapping[str, float] | None, decision: DecisionTokens) -> float | None:
    """``p`` = P(REVISE) / (P(REVISE) + P(KEEP)) at the decision position: a softmax over the two
    decision tokens' log-probabilities (``logprobs``: token text -> logprob, e.g. a server's top-k
    alternatives; the learner's ``learner.losses.revise_probability`` is the same function of its
    logits). A token missing from a top-k list has less probability than every listed one and counts
    as 0; None when neither is listed (the reflection cannot be read)."""
    if not logprobs:
        return None
    keep, revise = logprobs.get(decision.keep), logprobs.get(decision.revise)
    if keep is None and revise is None:
        return None
    if keep is None or revise is None:
        return 1.0 if keep is None else 0.0
    return 1.0 / (1.0 + math.exp(min(keep - revise, 700.0)))


def sequence_confidence(token_logprobs: Sequence[float]) -> float:
    """Geometric-mean token probability (``q_ref``); 0 for an empty sequence."""
    if not token_logprobs:
        return 0.0
    return math.exp(sum(token_logprobs) / len(token_logprobs))
