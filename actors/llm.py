"""The actor's view of the models: one call per CoMap role, through the shared inference client.

Which adapter serves a role comes from the broker's registry (riding on every ack); before the
first publish every role is the base model. Parsing is tolerant: what could not be parsed comes
back as ``None`` with a ``problem`` the caller counts, never an exception.

Version stamping: the registry can change between two calls of one step, so a transition is
stamped with the adapter that actually generated each field. After a call, ``last_version(role)``
(``last_model(role)``) is the version (name) that call used; it is task-local (a ContextVar), so
concurrent episodes of one actor, each its own asyncio task, never see each other's calls. (A
call run in a task of its own, e.g. under ``asyncio.gather``, records in that task's context:
read its version there.)
"""

from __future__ import annotations

from collections.abc import Sequence
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any

from actors.registry_view import RegistryView
from comap_async.config import ActorConfig
from comap_async.method.decision import sequence_confidence, top_k_revise_probability
from comap_async.method.gates import canonical_action
from comap_async.prompts import (
    FINAL_PREFIX,
    REACT_ACTION_PREFIX,
    Conversation,
    Prompts,
    parse_action,
    parse_react,
    parse_reflection,
    react_action_head,
    reflection_head,
)
from comap_async.wire.inference_client import MAX_CHOICES
from comap_async.wire.messages import POLICY, WM, WM_TEACHER, adapter_version

STOP_ACTION = ["\n", "<|im_end|>"]
STOP_STATE = ["<|im_end|>", "\n\n"]
TEACHER_TEMPERATURE = 0.0
"""The EMA teacher predicts greedily: its prediction is the world-state gate's reference."""
TOP_LOGPROBS = 20
"""Top-k alternatives asked for per token where a probability is read from two tokens (the reflection's
decision, the critic's answer): both must be among them (vLLM's default cap is 20)."""

# role -> the model name this task's most recent call for that role used (copied on write, so a
# task never changes a mapping another task sees)
_LAST_MODEL: ContextVar[dict[str, str]] = ContextVar("comap_last_model", default={})


@dataclass(frozen=True, slots=True)
class Draft:
    action: str | None
    """None when the output had no usable line."""
    problem: str | None
    confidence: float | None = None
    """The draft's geometric-mean token probability (``actor.reflect_confidence``; else None): the
    reflection prompt shows it as a word (:func:`comap_async.prompts.confidence_word`)."""


@dataclass(frozen=True, slots=True)
class Reflected:
    decision: str  # KEEP or REVISE (KEEP when unreadable)
    a_ref: str  # refined action (the draft when unreadable)
    p_revise: float
    q_ref: float
    problem: str | None
    """What the model's own text lacked (``no_final_action``...), None when it was read as written."""
    readable: bool = True
    """False: no decision probability, or a REVISE with no final action even after the
    continuation; the draft is executed and the step trains no reflection sample. (A KEEP with no
    action keeps the draft: that is what KEEP means, and the ``y = 0`` target by definition.)"""


def choice_budget(max_tokens: int, choices: Sequence[str]) -> int:
    """The token budget of a request decoded among ``choices``: at least the longest choice's UTF-8 bytes and
    the end token (a byte-level token covers at least one byte), so no choice is cut into a prefix that is
    none of them (ScienceWorld's commands, ``move sewer to fountain``, passed a 32-token draft budget on a
    small vocabulary). The decoding stops where a choice ends, so the larger budget costs nothing."""
    return max(max_tokens, max(len(c.encode()) for c in choices) + 1)


def _choice(resp: dict[str, Any]) -> dict[str, Any]:
    return resp["choices"][0]


def first_top_logprobs(choice: dict[str, Any]) -> dict[str, float] | None:
    """The top-k alternatives (token text -> logprob) at a completion's first generated position, where a
    reflection's decision and the critic's answer are read (:func:`top_k_revise_probability`); None when
    the server sent none."""
    tops = (choice.get("logprobs") or {}).get("top_logprobs") or []
    return tops[0] if tops else None


def token_spans(text: str, tokens: list[str], start: int, end: int) -> list[tuple[int, int]]:
    """(index, end offset in ``text``, clipped to ``end``) of each token that carries characters of
    ``text[start:end]`` other than spaces (not the spaces after a colon, not a stop or end-of-turn
    token reported past the text)."""
    out, offset = [], 0
    for i, tok in enumerate(tokens):
        tok_start, offset = offset, offset + len(tok)
        if tok_start < end and offset > start and text[max(tok_start, start) : min(offset, end)].strip():
            out.append((i, min(offset, end)))
    return out


def _line_end(text: str, start: int) -> int:
    end = text.find("\n", start)
    return len(text) if end < 0 else end


def action_token_spans(text: str, tokens: list[str]) -> list[tuple[int, int]]:
    """:func:`token_spans` of the action after ``Final Action:`` (up to the line end)."""
    at = text.find(FINAL_PREFIX)
    if at < 0:
        return []
    start = at + len(FINAL_PREFIX)
    return token_spans(text, tokens, start, _line_end(text, start))


def _logprobs_at(spans: list[tuple[int, int]], token_logprobs: list[float | None]) -> list[float]:
    return [lp for i, _ in spans if (lp := token_logprobs[i]) is not None]


def draft_token_logprobs(text: str, tokens: list[str], token_logprobs: list[float | None]) -> list[float]:
    """Logprobs of the tokens that spell a draft's first line (:func:`token_spans`)."""
    return _logprobs_at(token_spans(text, tokens[: len(token_logprobs)], 0, _line_end(text, 0)), token_logprobs)


def action_token_logprobs(text: str, tokens: list[str], token_logprobs: list[float | None]) -> list[float]:
    """Logprobs of the tokens that spell the action after ``Final Action:`` (up to the line end)."""
    return _logprobs_at(action_token_spans(text, tokens[: len(token_logprobs)]), token_logprobs)


def choice_logprob(choice: dict[str, Any]) -> float:
    """A completion's log-probability as a whole: the sum of its generated tokens' logprobs, the end
    token's included (so ``go to drawer 1`` does not beat ``go to drawer 10`` for being a prefix).
    A completion without logprobs is the least likely."""
    lps = (choice.get("logprobs") or {}).get("token_logprobs") or []
    return sum(lp for lp in lps if lp is not None) if lps else float("-inf")


class AgentLLM:
    def __init__(
        self, client: Any, prompts: Prompts, cfg: ActorConfig, base_model: str, registry: RegistryView | None = None
    ) -> None:
        self.client, self.prompts, self.cfg, self.base_model = client, prompts, cfg, base_model
        self.registry = registry if registry is not None else RegistryView()
        self.stale_adapter_retries = 0

    def model_for(self, role: str) -> str:
        return self.registry.adapter(role) or self.base_model

    @staticmethod
    def last_model(role: str) -> str | None:
        """The model name (adapter or base model) this task's most recent ``role`` call used, or
        None when this task has made none."""
        return _LAST_MODEL.get().get(role)

    @staticmethod
    def last_version(role: str) -> int | None:
        """The adapter version (base model = 0) this task's most recent ``role`` call used, or None
        when this task has made none. Roles: ``policy`` (draft, reflect), ``wm`` (imagine),
        ``wm_teacher`` (teacher)."""
        model = _LAST_MODEL.get().get(role)
        return None if model is None else adapter_version(model)

    async def _complete(
        self,
        role: str,
        prompt: str,
        max_tokens: int,
        stop: list[str],
        temperature: float,
        logprobs: int | None = None,
        choices: list[str] | None = None,
    ) -> dict[str, Any]:
        return _choice(await self._complete_all(role, prompt, max_tokens, stop, temperature, logprobs, choices))

    async def _complete_all(
        self,
        role: str,
        prompt: str,
        max_tokens: int,
        stop: list[str],
        temperature: float,
        logprobs: int | None = None,
        choices: list[str] | None = None,
        n: int = 1,
        top_p: float | None = None,
        seed: int | None = None,
    ) -> dict[str, Any]:
        """The whole response (``n`` choices)."""
        from comap_async.wire.inference_client import InferenceError

        extra = {"structured_outputs": {"choice": choices}} if choices else {}
        if choices:
            max_tokens = choice_budget(max_tokens, choices)
        if n > 1:
            extra["n"] = n
        if seed is not None:
            extra["seed"] = seed
        for attempt in (0, 1):
            model = self.model_for(role)
            try:
                resp = await self.client.complete(
                    prompt=prompt,
                    model=model,
                    max_tokens=max_tokens,
                    temperature=temperature,
                    top_p=self.cfg.top_p if top_p is None else top_p,
                    stop=stop,
                    logprobs=logprobs,
                    **extra,
                )
                _LAST_MODEL.set({**_LAST_MODEL.get(), role: model})
                return resp
            except InferenceError as exc:
                # The learner retires old adapter versions; an actor whose last ack predates two publishes
                # asks for one that is gone (404). Fetch the current registry and retry once.
                if exc.status != 404 or attempt or not self.registry.can_refresh or self.registry.adapter(role) is None:
                    raise
                self.stale_adapter_retries += 1
                await self.registry.refresh()
        raise AssertionError("unreachable")

    def choices(self, admissible: Sequence[str] | None, space: str = "") -> list[str] | None:
        """What an action may be decoded as (``actor.admissible_choice``), each after ``space`` (the
        text a trained action follows: nothing after the assistant header, a space after ``Final
        Action:``); None decodes freely."""
        if not self.cfg.admissible_choice or not admissible:
            return None
        if len(admissible) > MAX_CHOICES:
            raise ValueError(
                f"actor.admissible_choice: this state admits {len(admissible)} commands, more than a request "
                f"may list ({MAX_CHOICES}); turn the setting off for this environment"
            )
        return [space + a.strip() for a in admissible if a.strip()] or None

    async def draft(
        self, state: str | Conversation, temperature: float | None = None, admissible: Sequence[str] | None = None
    ) -> tuple[str | None, str | None]:
        """(action, problem); action None when the output had no usable line. ``temperature``: this
        call's, instead of ``actor.temperature`` (the look-ahead's sampled candidates); ``admissible``:
        the state's commands (:meth:`choices`)."""
        d = await self.draft_scored(state, temperature, confidence=False, admissible=admissible)
        return d.action, d.problem

    async def draft_scored(
        self,
        state: str | Conversation,
        temperature: float | None = None,
        confidence: bool | None = None,
        admissible: Sequence[str] | None = None,
    ) -> Draft:
        """The draft with its confidence when ``confidence`` (default ``actor.reflect_confidence``):
        the tokens' logprobs come with the same call, so the confidence is that of the sampled text."""
        scored = self.cfg.reflect_confidence if confidence is None else confidence
        c = await self._action(
            self.prompts.draft(state),
            self.cfg.max_tokens["draft"],
            self.cfg.temperature if temperature is None else temperature,
            1 if scored else None,
            self.choices(admissible),
        )
        parsed = parse_action(c["text"])
        if not scored or parsed.value is None:
            return Draft(parsed.value, parsed.problem)
        lp = c.get("logprobs") or {}
        tokens, token_lps = lp.get("tokens") or [], lp.get("token_logprobs") or []
        lps = draft_token_logprobs(c["text"], tokens[: len(token_lps)], token_lps)
        return Draft(parsed.value, parsed.problem, sequence_confidence(lps) if lps else None)

    async def _action(
        self, prompt: str, budget: int, temperature: float, logprobs: int | None, choices: list[str] | None
    ) -> dict[str, Any]:
        """One action line of the policy's: decoded among ``choices`` (None: freely)."""
        return await self._complete(POLICY, prompt, budget, STOP_ACTION, temperature, logprobs, choices)

    async def critic(self, state: str, trajectory: list[tuple[str, str]]) -> float | None:
        """The policy's judgement of an imagined continuation of ``state``: P(YES) over the critic's
        two answer tokens at the first generated position (None when neither is among the top-k)."""
        answer = self.prompts.critic_answer
        if answer is None:
            raise ValueError(
                "this model's tokenizer does not separate the critic's answers ' NO' / ' YES' at "
                "their first token: the lookahead method cannot read a score"
            )
        c = await self._complete(POLICY, self.prompts.critic(state, trajectory), 1, ["<|im_end|>"], 0.0, TOP_LOGPROBS)
        return top_k_revise_probability(first_top_logprobs(c), answer)

    async def react(
        self, state: str, max_tokens: int, admissible: Sequence[str] | None = None
    ) -> tuple[str | None, str | None]:
        """ReAct's (action, problem): a thought, then the action, from the state alone (policy adapter).
        ``admissible``: with ``actor.admissible_choice`` the thought is generated freely up to its line's
        end and the action after ``Action:`` as one of them (:meth:`choices`), so ReAct's actions are
        decoded as the draft's are and a comparison of the methods is not one of decodings."""
        prompt = self.prompts.react(state)
        choices = self.choices(admissible, " ")
        if choices is None:
            c = await self._complete(POLICY, prompt, max_tokens, ["<|im_end|>", "\n\n"], self.cfg.temperature)
            parsed = parse_react(c["text"])
            return parsed.value, parsed.problem
        # a thought that runs on into its action on the same line stops there: the action is the choice's
        thought = await self._complete(
            POLICY, prompt, max_tokens, [*STOP_ACTION, REACT_ACTION_PREFIX], self.cfg.temperature
        )
        c = await self._action(
            prompt + react_action_head(thought["text"]), max_tokens, self.cfg.temperature, None, choices
        )
        parsed = parse_action(c["text"])
        return parsed.value, parsed.problem

    async def choose(
        self, state: str, a_draft: str, s_hat: str, admissible: Sequence[str] | None = None
    ) -> tuple[str | None, str | None]:
        """Imagine-and-Act's final (action, problem) after the candidate's imagined consequence."""
        # decoded as a draft is, so the final action is chosen alike
        c = await self._action(
            self.prompts.choose(state, a_draft, s_hat),
            self.cfg.max_tokens["draft"],
            self.cfg.temperature,
            None,
            self.choices(admissible, " "),
        )
        parsed = parse_action(c["text"])
        return parsed.value, parsed.problem

    async def imagine(self, state: str, action: str, conversation: Conversation | None = None) -> str:
        """The world model's (student's) predicted observation, sampled at ``actor.temperature``:
        it is the rollout self-distillation trains on (``s_hat_exec``), as in the paper.
        ``conversation``: the draft's at this state (``env.wm_turns``: the prompt renders it, not ``state``)."""
        c = await self._complete(
            WM,
            self.prompts.world_model(state, action, conversation),
            self.cfg.max_tokens["wm"],
            STOP_STATE,
            self.cfg.temperature,
        )
        return c["text"].strip()

    async def teacher(self, state: str, action: str, real_next: str, conversation: Conversation | None = None) -> str:
        """The EMA teacher's prediction given the real next state (greedy: the gate's reference)."""
        c = await self._complete(
            WM_TEACHER,
            self.prompts.teacher(state, action, real_next, conversation),
            self.cfg.max_tokens["wm"],
            STOP_STATE,
            TEACHER_TEMPERATURE,
        )
        return c["text"].strip()

    async def reflect(
        self,
        state: str,
        a_draft: str,
        s_hat: str,
        confidence: float | None = None,
        admissible: Sequence[str] | None = None,
        keep_at_or_below: float | None = None,
        conversation: Conversation | None = None,
    ) -> Reflected:
        """Decision, refined action, ``p`` and ``q`` of one reflection; always an action when ``p`` can be read.
        ``keep_at_or_below`` (an evaluation's: the action gate's ``tau_p``): the decision
        token is generated alone first, and a ``p`` at or below it is a KEEP of the draft with nothing more
        generated; above it the reflection is generated whole from the same prompt (the server's prefix
        cache holds it), as without the setting.
        ``confidence``: the draft's (:meth:`draft_scored`), shown in the prompt; None shows nothing.
        ``conversation``: the draft's (``env.reflect_turns``: the prompt continues it instead of ``state``).
        ``admissible``: with ``actor.admissible_choice``, a final action not among them is generated
        again from ``Final Action:`` as one of them (:meth:`choices`); with ``actor.revise_other_action``
        a REVISE's as one of them other than the draft.

        ``p`` is read at the first generated token (the decision position). When the model's text has
        no ``Final Action:`` line, the reflection is continued from ``Decision: <X>\\nFinal Action:``
        (X its decision word, or the likelier one by ``p``) and only the action is generated: the
        decision stays the model's, the action comes from the same policy, ``q`` from its tokens."""
        decision_tokens = self.prompts.decision
        if decision_tokens is None:
            raise ValueError("Prompts.decision is not set: build the prompts with Prompts.for_model(model_dir, cfg)")
        prompt = self.prompts.reflect(state, a_draft, s_hat, confidence, conversation)
        if keep_at_or_below is not None:
            first = await self._complete(POLICY, prompt, 1, ["<|im_end|>"], self.cfg.temperature, TOP_LOGPROBS)
            p_first = top_k_revise_probability(first_top_logprobs(first), decision_tokens)
            # unreadable (None): the whole reflection below is, too, and says so
            if p_first is not None and p_first <= keep_at_or_below:
                return Reflected("KEEP", a_draft, p_first, 0.0, None)
        c = await self._complete(
            POLICY, prompt, self.cfg.max_tokens["reflection"], ["<|im_end|>"], self.cfg.temperature, TOP_LOGPROBS
        )
        text = c["text"]
        lp = c.get("logprobs") or {}
        tokens, token_lps = lp.get("tokens") or [], lp.get("token_logprobs") or []
        p_revise = top_k_revise_probability(first_top_logprobs(c), decision_tokens)
        if p_revise is None:
            return Reflected("KEEP", a_draft, 0.0, 0.0, "no_decision_logprob", readable=False)
        # the final action's own budget (the paper: 16 new tokens): a longer one is cut to its first tokens
        spans = action_token_spans(text, tokens[: len(token_lps)])
        budget = self.cfg.max_tokens["final_action"]
        truncated = len(spans) > budget
        if truncated:
            cut = spans[budget - 1][1]
            text, tokens, token_lps = (
                text[:cut],
                tokens[: spans[budget - 1][0] + 1],
                token_lps[: spans[budget - 1][0] + 1],
            )
        r = parse_reflection(text)
        problem = r.problem or ("final_action_truncated" if truncated else None)
        decision = r.decision or ("REVISE" if p_revise > 0.5 else "KEEP")
        choices = self.choices(admissible, " ")
        if choices is not None and decision == "REVISE" and self.cfg.revise_other_action:
            draft = canonical_action(a_draft)
            choices = [c for c in choices if canonical_action(c) != draft] or None
        admitted = choices is None or (r.final_action is not None and " " + r.final_action.strip() in choices)
        if r.final_action is not None and admitted:
            q_ref = sequence_confidence(action_token_logprobs(text, tokens, token_lps))
            return Reflected(decision, r.final_action, p_revise, q_ref, problem)
        head = reflection_head(decision)
        c = await self._action(prompt + head, budget, self.cfg.temperature, 1, choices)
        lp = c.get("logprobs") or {}
        full = head + c["text"]  # the continuation's tokens are the action's, as after a Final Action: line
        action = parse_action(c["text"]).value
        if action is None:
            # the model copies the prompt's "<one command>" after KEEP when it has no other action:
            # a KEEP names its action (the draft); only a REVISE without one says nothing usable
            return Reflected(decision, a_draft, p_revise, 0.0, problem, readable=decision == "KEEP")
        tokens, token_lps = lp.get("tokens") or [], lp.get("token_logprobs") or []
        # the head as one pseudo-token before the generated ones: spans index the generated tokens from 1
        spans = action_token_spans(full, [head] + tokens[: len(token_lps)])
        q_ref = sequence_confidence([lp_ for i, _ in spans if i > 0 and (lp_ := token_lps[i - 1]) is not None])
        return Reflected(decision, action, p_revise, q_ref, problem)
