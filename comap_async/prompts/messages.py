"""The prompts' words: system prompts per environment, the state's rendering, each role's chat messages,
the reflection's target text."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

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
    location: str = "",
) -> str:
    """``s_t``: the task, the last ``k`` (action, observation) pairs, where the agent is (``location``,
    when given and not already shown by the window) and the current observation."""
    parts = [f"Task: {task.strip()}"]
    recent = list(history)[-k:] if k > 0 else []
    if recent:
        parts.append("Recent history:")
        parts.extend(f"> {a.strip()}\n{o.strip()}" for a, o in recent)
    location = location.strip()
    # after the history: a whole-history state still extends the previous step's up to here
    if location and location != observation.strip() and all(location != o.strip() for _, o in recent):
        parts.append(f"Where you are: {location}")
    parts.append(f"Current observation: {observation.strip()}")
    if show_admissible and admissible:
        parts.append("Admissible commands: " + ", ".join(a.strip() for a in admissible))
    return "\n".join(parts)


# ---------------------------------------------------------------- messages per role
def _turn(system: str, user: str) -> list[dict[str, str]]:
    """Every role's prompt: its system text, then one user turn."""
    return [{"role": "system", "content": system}, {"role": "user", "content": user}]


def draft_messages(state: str, wording: Wording = ALFWORLD) -> list[dict[str, str]]:
    return _turn(wording.agent, f"{state}\n\nWhat is your next action? Answer with one command only.")


@dataclass(frozen=True)
class Conversation:
    """The episode so far as chat turns (``env.draft_turns``): the task and first observation, then
    each action as the agent's turn and the observation it got as the next user turn; the paper's
    state, the whole history. A step's draft prompt extends the previous step's by one action and
    one observation, so a warm-up path trains as one sequence with a loss on each action
    (``learner/batches.py``) and the server's prefix cache holds the episode's earlier steps."""

    task: str
    first: str
    turns: tuple[tuple[str, str], ...] = ()

    def then(self, action: str, observation: str) -> "Conversation":
        return Conversation(self.task, self.first, (*self.turns, (action, observation)))

    @classmethod
    def from_record(cls, d: Mapping[str, Any]) -> "Conversation":
        """From a stored ``Dialogue`` (a record's map: ``task``, ``first``, ``turns``)."""
        return cls(str(d["task"]), str(d["first"]), tuple((str(a), str(o)) for a, o in d["turns"]))


def turns_of(seen: str | Conversation) -> Conversation | None:
    """What the draft saw, when it saw the episode's turns (the reflection's and the world model's
    prompts may continue it: ``env.reflect_turns``, ``env.wm_turns``); None for a rendered ``s_t``."""
    return seen if isinstance(seen, Conversation) else None


DRAFT_TURNS_ASK = "Answer each observation with your next action: one command only."


def draft_turn_messages(conversation: Conversation, wording: Wording = ALFWORLD) -> list[dict[str, str]]:
    """The draft's prompt in the turns form (``env.prompt_form`` ``draft_turns``, ``all_turns``): no
    admissible list (it would be repeated in every turn of a trained path); the task and the
    instruction once, in the first turn (repeating the task line in every turn changed nothing:
    docs/findings.md)."""
    c = conversation
    messages = _turn(wording.agent, f"Task: {c.task.strip()}\n{c.first.strip()}\n\n{DRAFT_TURNS_ASK}")
    for action, observation in c.turns:
        messages.append({"role": "assistant", "content": action.strip()})
        messages.append({"role": "user", "content": observation.strip()})
    return messages


CONFIDENCE_WORDS = ((0.9, "high"), (0.6, "medium"), (0.0, "low"))
"""``draft_confidence`` (the draft's geometric-mean token probability) in words: a small model reads
a word more easily than a number."""


def confidence_word(confidence: float) -> str:
    return next(word for floor, word in CONFIDENCE_WORDS if confidence >= floor)


REFLECT_ASK = (
    "Does the draft move you towards the task? Answer exactly in this form:\n"
    f"{DECISION_PREFIX} KEEP or REVISE\n{FINAL_PREFIX} <one command>"
)


def _draft_judged(s_hat: str | None, confidence: float | None) -> str:
    """The reflection's view of the draft: its confidence and imagined result (each when given)."""
    shown = "" if confidence is None else f"Your confidence in the draft: {confidence_word(confidence)}\n"
    imagined = "" if s_hat is None else f"Imagined result of the draft: {s_hat.strip()}\n"
    return shown + imagined


def reflect_messages(
    state: str, a_draft: str, s_hat: str | None, wording: Wording = ALFWORLD, confidence: float | None = None
) -> list[dict[str, str]]:
    """``s_hat`` None: the reflection without the imagined state (ablation ``no_future_state``);
    ``confidence``: the draft's own token probability, shown as a word (``actor.reflect_confidence``:
    the actors and probes from the draft call's logprobs, the learner from a record's ``draft_confidence``)."""
    return _turn(
        wording.agent,
        f"{state}\n\nYour draft action: {a_draft.strip()}\n{_draft_judged(s_hat, confidence)}\n{REFLECT_ASK}",
    )


REFLECT_TURN_HEAD = "That was your draft action; it is not executed yet."


def reflect_turn_messages(
    conversation: Conversation,
    a_draft: str,
    s_hat: str | None,
    wording: Wording = ALFWORLD,
    confidence: float | None = None,
) -> list[dict[str, str]]:
    """The reflection continuing the draft's conversation (``env.prompt_form`` ``all_turns``): the draft's
    messages, the draft as the agent's turn, then one user turn with what :func:`reflect_messages`
    adds to a state. Its prompt starts with the draft's prompt, which the server's prefix cache holds."""
    messages = draft_turn_messages(conversation, wording)
    messages.append({"role": "assistant", "content": a_draft.strip()})
    said = f"{REFLECT_TURN_HEAD}\n{_draft_judged(s_hat, confidence)}\n{REFLECT_ASK}"
    messages.append({"role": "user", "content": said})
    return messages


def react_messages(state: str, wording: Wording = ALFWORLD) -> list[dict[str, str]]:
    """ReAct (the paper's prompting baseline): a short thought, then the action, from the state alone."""
    return _turn(
        wording.agent,
        f"{state}\n\nThink briefly about what to do next, then act. Answer exactly in "
        f"this form:\n{THOUGHT_PREFIX} <one sentence>\n{REACT_ACTION_PREFIX} <one command>",
    )


def react_action_head(thought: str) -> str:
    """What follows ``Thought:`` up to the action when the action is generated on its own (``actor.
    admissible_choice``): the model's thought up to its line's end, then the ``Action:`` prefix, as
    the answer's form writes them."""
    return f"{thought.rstrip()}\n{REACT_ACTION_PREFIX}"


def choose_messages(state: str, a_draft: str, s_hat: str, wording: Wording = ALFWORLD) -> list[dict[str, str]]:
    """Imagine-and-Act (the paper's prompting baseline): pick the final action after seeing the
    imagined consequence of a candidate; no KEEP/REVISE decision, so no action gate."""
    return _turn(
        wording.agent,
        f"{state}\n\nCandidate action: {a_draft.strip()}\n"
        f"Imagined result of the candidate: {s_hat.strip()}\n\n"
        "Choose your final action: the candidate, or a better command. Answer with one command only.",
    )


def critic_messages(
    state: str, trajectory: Sequence[tuple[str, str]], wording: Wording = ALFWORLD
) -> list[dict[str, str]]:
    """The look-ahead critic (WebEvolver's imagination engine): the policy judges an imagined
    continuation of the state, the actions with the world model's answers."""
    steps = "\n".join(f"> {a.strip()}\n{o.strip()}" for a, o in trajectory)
    return _turn(
        wording.agent,
        f"{state}\n\nImagined continuation:\n{steps}\n\n"
        "Does this continuation bring the task closer to done? Answer YES or NO.",
    )


def world_model_messages(state: str, action: str, wording: Wording = ALFWORLD) -> list[dict[str, str]]:
    return _turn(wording.world, f"{state}\n\nAction: {action.strip()}\nWhat does the environment answer?")


WM_TURNS_ASK = "Answer each action with the exact observation the environment returns."


def world_model_turn_messages(
    conversation: Conversation, action: str, wording: Wording = ALFWORLD, hindsight: str | None = None
) -> list[dict[str, str]]:
    """The world model's prompt as its own conversation (``env.wm_turns``): the task and first
    observation once, then each action as a user turn and the observation it got as the model's
    turn, the new ``action`` last. Step t+1's prompt extends step t's by the real observation and the
    next action, so the server's prefix cache holds the episode. ``hindsight`` (the EMA teacher's
    context): the real next observation in the last turn, as :func:`teacher_messages` shows it."""
    c = conversation
    actions = [a for a, _ in c.turns] + [action]
    messages = [{"role": "system", "content": wording.world}]
    for i, a in enumerate(actions):
        said = f"Action: {a.strip()}"
        if i == 0:
            said = f"Task: {c.task.strip()}\n{c.first.strip()}\n\n{WM_TURNS_ASK}\n\n{said}"
        if i == len(c.turns) and hindsight is not None:
            said += f"\n(Hindsight: the environment actually answered: {hindsight.strip()})"
        messages.append({"role": "user", "content": said})
        if i < len(c.turns):
            messages.append({"role": "assistant", "content": c.turns[i][1].strip()})
    return messages


def teacher_messages(state: str, action: str, real_next: str, wording: Wording = ALFWORLD) -> list[dict[str, str]]:
    """The EMA teacher's context: the world-model prompt plus the real next observation (hindsight)."""
    return _turn(
        wording.world,
        f"{state}\n\nAction: {action.strip()}\n"
        f"(Hindsight: the environment actually answered: {real_next.strip()})\n"
        "What does the environment answer?",
    )


def reflection_head(decision: str) -> str:
    """What follows ``Decision:`` up to the final action: the decision word and the ``Final Action:``
    prefix. The actor continues a reflection from here when the model left the line out."""
    return f" {decision}\n{FINAL_PREFIX}"


def reflection_target(decision: str, action: str) -> str:
    """The assistant text after the ``Decision:`` prefix, as trained and as generated."""
    return f"{reflection_head(decision)} {action.strip()}"


CRITIC_WORDS = (" NO", " YES")
"""The look-ahead critic's answers: its score is P(YES) / (P(YES) + P(NO)) at the first answer token."""
CRITIC_PREFIX = "Answer:"
