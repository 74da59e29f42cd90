"""Pure parts of the actor's model calls: q_ref covers exactly the refined action's tokens; choice budgets;
ReAct's action decoded among the admissible commands."""

from __future__ import annotations

import math

import pytest

from actors.llm import action_token_logprobs, choice_budget


def test_action_tokens_are_those_after_final_action():
    tokens = [" RE", "VISE", "\n", "Final", " Action", ":", " open", " fridge", " 1", "\n", "junk"]
    lps = [-0.1, -0.2, -0.3, -0.4, -0.5, -0.6, -1.0, -2.0, -3.0, -4.0, -5.0]
    text = "".join(tokens)
    assert action_token_logprobs(text, tokens, lps) == [-1.0, -2.0, -3.0]


def test_no_final_action_gives_no_tokens():
    assert action_token_logprobs(" KEEP", [" KE", "EP"], [-0.1, -0.1]) == []


def test_none_logprobs_are_skipped():
    tokens = ["Final Action:", " look"]
    assert action_token_logprobs("".join(tokens), tokens, [None, math.log(0.5)]) == [pytest.approx(math.log(0.5))]


def test_a_choice_request_budgets_for_its_longest_choice():
    # a byte-level token covers at least a byte: the longest choice's bytes and the end token always fit
    assert choice_budget(32, ["look", "go to fridge 1"]) == 32
    assert choice_budget(4, ["look", "move sewer to fountain"]) == len("move sewer to fountain") + 1
    assert choice_budget(1, ["café"]) == len("café".encode()) + 1


async def test_react_with_admissible_choice_writes_its_thought_then_decodes_its_action_among_the_commands():
    from actors.llm import AgentLLM
    from comap_async.config import ActorConfig
    from comap_async.prompts import ChatTemplate, Prompts
    from tests.fixtures.calls import ScriptedClient

    prompts = Prompts(ChatTemplate("{% for m in messages %}{{ m['content'] }}{% endfor %}"))
    admissible = ["go to desk 1", "look"]
    thought = (" The pen may be on the desk. ", [" The"], [-0.1], {})
    action = (" go to desk 1", [" go"], [-0.1], {})
    llm = AgentLLM(ScriptedClient(thought, action), prompts, ActorConfig(admissible_choice=True), "base")
    assert await llm.react("state", 32, admissible) == ("go to desk 1", None)
    first, second = llm.client.calls
    assert "structured_outputs" not in first and "Action:" in first["stop"]  # the thought is free, up to its action
    assert second["prompt"] == first["prompt"] + " The pen may be on the desk.\nAction:"
    assert second["structured_outputs"] == {"choice": [" go to desk 1", " look"]}
    # off (or no admissible list): one free call, the action read from its Action: line
    llm.cfg = ActorConfig()
    llm.client = ScriptedClient((" I look.\nAction: open drawer 9", [" I"], [-0.1], {}))
    assert await llm.react("state", 32, admissible) == ("open drawer 9", None)
    assert len(llm.client.calls) == 1 and "structured_outputs" not in llm.client.calls[0]
