"""What each role of an evaluation method reads (:func:`what_roles_read`): whether its prompt lists the
state's admissible commands, which history it shows (the episode's turns, a window of the last ``k``
steps, or none) and whether the action it gives is decoded among the admissible commands.

Derived, not kept in a table: one probe episode of the method is played by the code an evaluation plays
(:func:`actors.eval_methods.play_method`, :func:`actors.episodes.play_coevolve`) with the config's own
prompts (:meth:`comap_async.prompts.Prompts.from_config`) and a stand-in for the inference server that
records every request, on a scripted game whose observations, actions and commands carry marks; each
role's requests from the episode's last state are read for those marks. Which state a method hands a
role, what a prompt renders of it and whether a request is constrained to a choice are what that code
makes them, so the answer follows any change there. Nothing leaves the process: no server, no files.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import re
from collections.abc import Coroutine, Iterator
from contextvars import ContextVar
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

from actors.episodes import EpisodeContext, play_coevolve
from actors.eval_methods import play_method
from actors.llm import AgentLLM
from comap_async.envs.base import StepResult
from comap_async.prompts import (
    CRITIC_WORDS,
    REACT_ACTION_PREFIX,
    ChatTemplate,
    Conversation,
    DecisionTokens,
    Prompts,
)
from comap_async.wire.messages import Registry
from evaluator.eval_runner import evaluation_config

ROLES = ("draft", "world_model", "reflection", "teacher", "react", "imagine_and_act", "critic")
"""The roles a method may call, by the :class:`~actors.llm.AgentLLM` call that plays them: ``react`` is
ReAct's answer (thought and action), ``imagine_and_act`` Imagine-and-Act's final choice, ``critic`` the
look-ahead's judgement of an imagined continuation."""
NO_ACTION = frozenset({"world_model", "teacher", "critic"})
"""Roles whose answer is an observation or a score: no action to decode (``decoded_among_admissible``
is None)."""

# A ChatML template: what matters here is which contents a prompt carries, not the model's markup.
_CHAT = ChatTemplate(
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
_DECISION = DecisionTokens(" KEEP", " REVISE", 0, 1)
_CRITIC = DecisionTokens(CRITIC_WORDS[0], CRITIC_WORDS[1], 2, 3)
# every answer's first position: the REVISE and YES tokens only, so a reflection is always generated whole
# and continued for its action (which shows whether that action is decoded among the commands)
_TOP = {_DECISION.revise: -0.1, _CRITIC.revise: -0.1}

# the role being played, and whether its state is the probe episode's last one (the one read)
_CALL: ContextVar[tuple[str, bool]] = ContextVar("roles_read_call", default=("", False))


def _observation(t: int) -> str:
    return f"You see probe-{t}-obs."


def _commands(t: int) -> tuple[str, ...]:
    """The admissible commands of the state after ``t`` steps. The server stand-in answers a choice with
    its first (or the second, a revision other than the draft), never the last: the last one in a
    prompt means the prompt lists the commands."""
    return (f"probe-{t + 1}-act", f"probe-{t + 1}-alt", f"probe-{t + 1}-listed")


def _action_of(prompt: str, step: int) -> bool:
    """Whether ``prompt`` shows the action taken at ``step`` (from the state after ``step - 1`` steps)."""
    return re.search(rf"probe-{step}-(?:act|alt)\b", prompt) is not None


@dataclass(frozen=True)
class ProbeRequest:
    """One request of the probe episode."""

    role: str
    prompt: str
    choices: tuple[str, ...] | None
    """The request's ``structured_outputs.choice`` (None: decoded freely)."""
    last: bool
    """Its state is the episode's last one (an imagined continuation of it included)."""


class _ProbeEnv:
    """A scripted game of ``steps`` steps: every observation and command carries its step."""

    def __init__(self, steps: int) -> None:
        self.steps, self.t = steps, 0

    def _result(self) -> StepResult:
        return StepResult(
            observation=_observation(self.t),
            won=False,
            done=self.t >= self.steps,
            admissible=_commands(self.t),
            expert_action=None,
            info={"task": "put the probe in the box"} if self.t == 0 else {},
        )

    async def reset(self, game: Any) -> StepResult:
        self.t = 0
        return self._result()

    async def step(self, action: str) -> StepResult:
        self.t += 1
        return self._result()

    async def walkthrough(self) -> list[str]:
        return []

    async def restore(self, game: Any, actions: Any) -> StepResult:
        self.t = len(actions)
        return self._result()


class _Server:
    """The inference server's stand-in: records each request and answers a choice with its first
    option, anything else with the action line of the game's next step (which every role's parser
    reads: a draft, ReAct's ``Action:`` line, a reflection without ``Final Action:``)."""

    def __init__(self, env: _ProbeEnv) -> None:
        self.env, self.requests = env, []

    async def complete(
        self, *, prompt: str, stop: list[str] | None = None, n: int = 1, structured_outputs: Any = None, **_: Any
    ) -> dict:
        role, last = _CALL.get()
        choices = (structured_outputs or {}).get("choice")
        self.requests.append(ProbeRequest(role, prompt, tuple(choices) if choices else None, last))
        text = choices[0] if choices else f"{REACT_ACTION_PREFIX} probe-{self.env.t + 1}-act"
        for s in stop or ():  # as a server stops: ReAct's thought ends where its action line begins
            text = text.split(s)[0]
        answer = {"text": text, "logprobs": {"tokens": [text], "token_logprobs": [-0.1], "top_logprobs": [_TOP]}}
        return {"choices": [answer] * n}


def _text(state: str | Conversation) -> str:
    if isinstance(state, Conversation):
        return "\n".join([state.first, *(o for _, o in state.turns)])
    return state


class _Recorder(AgentLLM):
    """The actor's model calls as they are, each request tagged with the role that made it."""

    last_observation = ""

    @contextlib.contextmanager
    def _role(self, role: str, state: str | Conversation) -> Iterator[None]:
        token = _CALL.set((role, self.last_observation in _text(state)))
        try:
            yield
        finally:
            _CALL.reset(token)

    async def draft_scored(self, state: Any, *args: Any, **kw: Any) -> Any:
        with self._role("draft", state):
            return await super().draft_scored(state, *args, **kw)

    async def imagine(self, state: str, *args: Any, **kw: Any) -> Any:
        with self._role("world_model", state):
            return await super().imagine(state, *args, **kw)

    async def teacher(self, state: str, *args: Any, **kw: Any) -> Any:
        with self._role("teacher", state):
            return await super().teacher(state, *args, **kw)

    async def reflect(self, state: str, *args: Any, **kw: Any) -> Any:
        with self._role("reflection", state):
            return await super().reflect(state, *args, **kw)

    async def react(self, state: str, *args: Any, **kw: Any) -> Any:
        with self._role("react", state):
            return await super().react(state, *args, **kw)

    async def choose(self, state: str, *args: Any, **kw: Any) -> Any:
        with self._role("imagine_and_act", state):
            return await super().choose(state, *args, **kw)

    async def critic(self, state: str, *args: Any, **kw: Any) -> Any:
        with self._role("critic", state):
            return await super().critic(state, *args, **kw)


def _probe_steps(cfg: Any) -> int:
    """Steps of the probe episode: its last state has one past step more than the history window shows."""
    return cfg.env.history_k + 2


async def _play(cfg: Any, method: str, training: bool) -> list[ProbeRequest]:
    steps = _probe_steps(cfg)
    env = _ProbeEnv(steps)
    server = _Server(env)
    llm = _Recorder(server, Prompts.from_config(_CHAT, cfg, _DECISION, _CRITIC), cfg.actor, "probe")
    llm.last_observation = _observation(steps - 1)

    async def emit(_: Any) -> None:
        return None

    # the facts only key the cycle stop: every probe state is a new one
    ctx = EpisodeContext("probe", cfg, llm, emit, lambda facts, o: facts | {o}, lambda: Registry.serving(0))
    game = SimpleNamespace(name="probe", split=cfg.env.split)
    if method in ("comap", "comap_oracle"):  # as actors.worker plays it
        oracle = _ProbeEnv(steps) if method == "comap_oracle" else None
        await play_coevolve(ctx, env, game, "probe", eval_mode=not training, oracle=oracle)
    else:
        await play_method(ctx, env, game, "probe", method)
    return server.requests


def _run(coro: Coroutine[Any, Any, Any]) -> Any:
    """``coro``'s result, also when called from a running event loop (an experiment runner's)."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(coro)
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        return pool.submit(asyncio.run, coro).result()


def probe_requests(cfg: Any, method: str, *, training: bool = False) -> list[ProbeRequest]:
    """Every request of one probe episode of ``method`` (an evaluation method, or with ``training`` the
    CoMap loop of co-evolution, whose teacher also acts) played with ``cfg`` as an evaluation plays it."""
    if training and method != "comap":
        raise ValueError(f"only comap is played in training, not {method!r}")
    return _run(_play(cfg if training else evaluation_config(cfg), method, training))


def _history(prompt: str, past: int) -> tuple[str, int | None]:
    """The history form a prompt of the state after ``past`` steps shows: ``turns`` (every step: the
    episode's turns), ``window`` of its last ``k`` steps, or ``none``."""
    shown = sum(_action_of(prompt, step) for step in range(1, past + 1))
    if shown == past:
        return "turns", None
    return ("window", shown) if shown else ("none", 0)


def what_roles_read(cfg: Any, method: str, *, training: bool = False) -> dict[str, dict[str, Any]]:
    """Per role ``method`` calls (:data:`ROLES`, in the order of its first call at a step), what it reads:

    * ``admissible``: its prompt lists the state's admissible commands;
    * ``history``: ``turns`` (the whole episode so far, as chat turns; up to the servers' prompt limit),
      ``window`` (the last ``k`` steps in the rendered state) or ``none``; ``k``: the window's steps
      (None for ``turns``, 0 for ``none``);
    * ``decoded_among_admissible``: its action is decoded as one of the admissible commands (a
      reflection's: when its own final action is not one; None for a role that gives no action).

    ``cfg``: a loaded :class:`~comap_async.config.CoMapConfig`; ``method``: ``comap`` or an evaluation
    method (:data:`comap_async.config.EVAL_METHODS`); ``training``: the CoMap loop of co-evolution
    instead of its evaluation (the teacher also acts). Read from one probe episode
    (:func:`probe_requests`); the look-ahead's drafts inside an imagined continuation, which has no
    admissible list, decode freely and are not what its ``draft`` entry describes."""
    past = _probe_steps(cfg) - 1
    listed = _commands(past)[-1]
    commands = set(_commands(past))
    out: dict[str, dict[str, Any]] = {}
    for r in probe_requests(cfg, method, training=training):
        if not r.last:
            continue
        entry = out.get(r.role)
        if entry is None:  # a role's first request reads the real state; later ones may read imagined ones
            history, k = _history(r.prompt, past)
            entry = out[r.role] = {
                "admissible": listed in r.prompt,
                "history": history,
                "k": k,
                "decoded_among_admissible": None if r.role in NO_ACTION else False,
            }
        if r.choices and {c.strip() for c in r.choices} <= commands:
            entry["decoded_among_admissible"] = True
    return out
