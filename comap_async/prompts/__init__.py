"""Prompt rendering and parsing for every role, in one place (docs/design.md section 1).

Actors and the learner build prompts only through these functions and the model's own chat
template, so both sides produce the same token sequences. Rendering uses jinja2 on the template
stored in the model directory (no transformers import), which keeps actors light.

Roles:
* draft       ``s_t`` -> an action
* reflect     ``(s_t, a_draft, ŝ)`` -> ``Decision: KEEP|REVISE`` + ``Final Action: ...`` (or the draft's
              conversation continued, ``env.reflect_turns``)
* world model ``(s_t, a)`` -> the next observation (or its own conversation, ``env.wm_turns``)
* teacher     ``(s_t, a, s')`` -> the next observation, having seen the real one (hindsight)

The package: ``messages`` (what each role is told), ``template`` (the model's chat template and the
prompt strings per role), ``parsing`` (what the model answered). Every name is importable from here.
"""

from comap_async.prompts.messages import (
    ALFWORLD,
    CONFIDENCE_WORDS,
    CRITIC_PREFIX,
    CRITIC_WORDS,
    DECISION_PREFIX,
    DRAFT_TURNS_ASK,
    FINAL_PREFIX,
    REACT_ACTION_PREFIX,
    SYSTEM_AGENT,
    SYSTEM_WORLD,
    THOUGHT_PREFIX,
    Conversation,
    Wording,
    choose_messages,
    confidence_word,
    critic_messages,
    draft_messages,
    draft_turn_messages,
    react_action_head,
    react_messages,
    reflect_messages,
    reflect_turn_messages,
    reflection_head,
    reflection_target,
    render_state,
    teacher_messages,
    turns_of,
    wording_for,
    world_model_messages,
    world_model_turn_messages,
)
from comap_async.prompts.parsing import (
    Parsed,
    Reflection,
    parse_action,
    parse_react,
    parse_reflection,
)
from comap_async.prompts.template import (
    TEMPLATE_VARIABLES,
    ChatTemplate,
    DecisionTokens,
    Prompts,
)

__all__ = [
    "ALFWORLD",
    "CONFIDENCE_WORDS",
    "CRITIC_PREFIX",
    "CRITIC_WORDS",
    "ChatTemplate",
    "DECISION_PREFIX",
    "DecisionTokens",
    "FINAL_PREFIX",
    "Parsed",
    "Prompts",
    "REACT_ACTION_PREFIX",
    "Reflection",
    "SYSTEM_AGENT",
    "SYSTEM_WORLD",
    "TEMPLATE_VARIABLES",
    "THOUGHT_PREFIX",
    "Wording",
    "choose_messages",
    "confidence_word",
    "critic_messages",
    "draft_messages",
    "draft_turn_messages",
    "Conversation",
    "DRAFT_TURNS_ASK",
    "parse_action",
    "parse_react",
    "parse_reflection",
    "react_action_head",
    "react_messages",
    "reflect_messages",
    "reflect_turn_messages",
    "reflection_head",
    "reflection_target",
    "render_state",
    "teacher_messages",
    "turns_of",
    "wording_for",
    "world_model_messages",
    "world_model_turn_messages",
]
