"""The actor's view of the models: one call per CoMap role, through the shared inference client.

Which adapter serves a role comes from the broker's registry (riding on every ack); before the
first publish every role is the base model. Parsing is tolerant: what could not be parsed comes
back as ``None`` with a ``problem`` the caller counts, never an exception.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from comap_async.config import ActorConfig
from comap_async.prompts import FINAL_PREFIX, Prompts, parse_action, parse_reflection, revise_probability, sequence_confidence

STOP_ACTION = ["\n", "<|im_end|>"]
STOP_STATE = ["<|im_end|>", "\n\n"]


@dataclass(frozen=True, slots=True)
class Reflected:
    decision: str  # KEEP or REVISE (KEEP when unreadable)
    a_ref: str  # refined action (the draft when unreadable)
    p_revise: float
    q_ref: float
    problem: str | None


def _choice(resp: dict[str, Any]) -> dict[str, Any]:
    return resp["choices"][0]


def action_token_logprobs(text: str, tokens: list[str], token_logprobs: list[float | None]) -> list[float]:
    """Logprobs of the tokens that spell the action after ``Final Action:`` (up to the line end)."""
    at = text.find(FINAL_PREFIX)
    if at < 0:
        return []
    start = at + len(FINAL_PREFIX)
    end = text.find("\n", start)
    end = len(text) if end < 0 else end
    out, offset = [], 0
    for tok, lp in zip(tokens, token_logprobs):
        tok_start, offset = offset, offset + len(tok)
        # a token counts when it carries action characters (not only the spaces after the colon)
        if tok_start < end and offset > start and text[max(tok_start, start):min(offset, end)].strip() and lp is not None:
            out.append(lp)
    return out


class AgentLLM:
    def __init__(self, client: Any, prompts: Prompts, cfg: ActorConfig, base_model: str,
                 refresh_registry: Callable[[], Awaitable[dict[str, Any] | None]] | None = None) -> None:
        self.client, self.prompts, self.cfg, self.base_model = client, prompts, cfg, base_model
        self.adapters: dict[str, str] = {}
        self.refresh_registry = refresh_registry
        self.stale_adapter_retries = 0

    def use_registry(self, registry: dict[str, Any] | None) -> None:
        self.adapters = dict((registry or {}).get("adapters") or {})

    def model_for(self, role: str) -> str:
        return self.adapters.get(role) or self.base_model

    async def _complete(self, role: str, prompt: str, max_tokens: int, stop: list[str], temperature: float,
                        logprobs: int | None = None) -> dict[str, Any]:
        from comap_async.inference.client import InferenceError

        for attempt in (0, 1):
            try:
                return _choice(await self.client.complete(
                    prompt=prompt, model=self.model_for(role), max_tokens=max_tokens, temperature=temperature,
                    top_p=self.cfg.top_p, stop=stop, logprobs=logprobs,
                ))
            except InferenceError as exc:
                # The learner retires old adapter versions; an actor whose last ack predates two publishes
                # asks for one that is gone (404). Fetch the current registry and retry once.
                if exc.status != 404 or attempt or self.refresh_registry is None or role not in self.adapters:
                    raise
                self.stale_adapter_retries += 1
                self.use_registry(await self.refresh_registry())
        raise AssertionError("unreachable")

    async def draft(self, state: str) -> tuple[str | None, str | None]:
        """(action, problem); action None when the output had no usable line."""
        c = await self._complete("policy", self.prompts.draft(state), self.cfg.max_action_tokens, STOP_ACTION,
                                 self.cfg.temperature)
        parsed = parse_action(c["text"])
        return parsed.value, parsed.problem

    async def imagine(self, state: str, action: str) -> str:
        """The world model's (student's) predicted observation; greedy for a stable gate input."""
        c = await self._complete("wm", self.prompts.world_model(state, action), self.cfg.max_state_tokens, STOP_STATE, 0.0)
        return c["text"].strip()

    async def teacher(self, state: str, action: str, real_next: str) -> str:
        c = await self._complete("wm_teacher", self.prompts.teacher(state, action, real_next),
                                 self.cfg.max_state_tokens, STOP_STATE, 0.0)
        return c["text"].strip()

    async def reflect(self, state: str, a_draft: str, s_hat: str) -> Reflected:
        c = await self._complete("policy", self.prompts.reflect(state, a_draft, s_hat),
                                 self.cfg.max_action_tokens + 8, ["<|im_end|>"], self.cfg.temperature, self.cfg.logprobs)
        text = c["text"]
        lp = c.get("logprobs") or {}
        tops = lp.get("top_logprobs") or []
        r = parse_reflection(text)
        p_revise = revise_probability(tops[0] if tops else None)
        problem = r.problem
        if p_revise is None:
            p_revise, problem = 0.0, problem or "no_decision_logprob"
        a_ref = r.final_action or a_draft
        q_ref = sequence_confidence(action_token_logprobs(text, lp.get("tokens") or [], lp.get("token_logprobs") or []))
        return Reflected(r.decision or "KEEP", a_ref, p_revise, q_ref, problem)
