"""``actor.reflect_confidence``: the draft's own confidence, read from the draft call's
logprobs, shown in the reflection prompt by the actor and, from the stored sample, by the learner."""

from __future__ import annotations

import math

import msgpack
import pytest

from actors.llm import AgentLLM, draft_token_logprobs
from broker.ingest import Ingest, record_from_store
from comap_async.config import PLAY_SWITCHES, ActorConfig, CoMapConfig
from comap_async.method.fingerprint import fingerprint
from comap_async.method.gates import SampleRule
from comap_async.prompts import ChatTemplate, DecisionTokens, Prompts
from comap_async.wire.protocol import ProtocolError, decode
from evaluator.compare_cells import cell_key, with_ablation
from tests.fixtures.broker import make_transition
from tests.fixtures.calls import ScriptedClient

DECISION = DecisionTokens(" KE", " RE", 0, 1)
SHOWN = "Your confidence in the draft:"


def make_llm(client, on: bool) -> AgentLLM:
    prompts = Prompts(ChatTemplate("{% for m in messages %}{{ m['content'] }}{% endfor %}"), decision=DECISION)
    return AgentLLM(client, prompts, ActorConfig(reflect_confidence=on), "base")


def test_only_the_tokens_of_the_drafts_line_count():
    text = "go to desk 1"
    tokens = ["go", " to", " desk", " 1", "<|im_end|>"]  # a stop token the server may report past the text
    lps = [-0.1, -0.2, -0.3, -0.4, -5.0]
    assert draft_token_logprobs(text, tokens, lps) == [-0.1, -0.2, -0.3, -0.4]
    # a second line and the newline that ends the first are not the draft's
    assert draft_token_logprobs("look\nthen more", ["look", "\n", "then", " more"], [-1.0, -2.0, -3.0, -4.0]) == [-1.0]
    assert draft_token_logprobs(" look", [" ", "look"], [-9.0, -1.0]) == [-1.0]  # spaces alone carry no action


async def test_the_draft_confidence_reaches_the_reflection_prompt():
    draft = ("go to desk 1", ["go", " to", " desk", " 1"], [math.log(0.9), math.log(0.5), math.log(0.4), -0.01], {})
    refl = (" KEEP\nFinal Action: go to desk 1", [" KE", "EP"], [-0.1, -0.1], {" KE": -0.1, " RE": -3.0})
    client = ScriptedClient(draft, refl)
    llm = make_llm(client, on=True)
    d = await llm.draft_scored("state")
    expected = math.exp((math.log(0.9) + math.log(0.5) + math.log(0.4) - 0.01) / 4)
    assert d.action == "go to desk 1" and d.confidence == pytest.approx(expected)  # 0.61: medium
    assert client.calls[0]["logprobs"] == 1  # read from the same call: the sampled text's own tokens
    await llm.reflect("state", d.action, "You arrive at desk 1.", d.confidence)
    assert f"{SHOWN} medium\n" in client.calls[1]["prompt"]


async def test_off_the_draft_asks_no_logprobs_and_the_prompt_is_as_before():
    draft = ("look", ["look"], [math.log(0.2)], {})
    client = ScriptedClient(draft, draft)
    off = await make_llm(client, on=False).draft_scored("state")
    assert off.confidence is None and client.calls[0]["logprobs"] is None
    # the plain draft (the look-ahead's samples) never asks, whatever the switch
    assert (await make_llm(client, on=True).draft("state")) == ("look", None)
    assert client.calls[1]["logprobs"] is None
    prompts = make_llm(client, on=False).prompts
    assert SHOWN not in prompts.reflect("s", "look", "o") and SHOWN in prompts.reflect("s", "look", "o", 0.2)


def test_the_stored_sample_carries_the_confidence_the_learner_renders(tiny_model_dir):
    from transformers import AutoTokenizer

    from learner.batches import Encoder

    ingest = Ingest(SampleRule())
    raw = msgpack.packb({**make_transition(1, draft_confidence=0.3), "seq": 1})
    item = ingest.prepare(decode(raw), raw)
    (sample,) = [record_from_store(store, v) for store, v in item.records if store == "reflections"]
    assert sample["draft_confidence"] == 0.3
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    prompts = Prompts(ChatTemplate.from_model_dir(tiny_model_dir))
    enc = Encoder(tokenizer, prompts, 2048)
    shown = tokenizer.decode(enc.reflection(sample).ids)
    assert f"{SHOWN} low" in shown
    # a sample without one (stored before the switch, or a pair's expert draft) renders today's prompt
    plain = tokenizer.decode(enc.reflection({**sample, "draft_confidence": None}).ids)
    assert SHOWN not in plain


def test_a_confidence_outside_zero_to_one_is_refused_on_the_wire():
    with pytest.raises(ProtocolError):
        decode(msgpack.packb({**make_transition(1, draft_confidence=1.5), "seq": 1}))


def test_the_switch_is_part_of_the_method_and_of_how_compare_plays_a_run():
    off, on = CoMapConfig(), CoMapConfig.model_validate({"actor": {"reflect_confidence": True}})
    assert "reflect_confidence" in on.method_switches and "reflect_confidence" not in off.method_switches
    assert fingerprint(on) != fingerprint(off)  # processes of one run must agree on it
    # a run trained with it is played with it, one trained without it without it
    assert with_ablation(off, [], ["reflect_confidence"]).actor.reflect_confidence
    assert not with_ablation(on, [], []).actor.reflect_confidence
    # one table names the play switches: what playing() sets, method_switches reads back
    for name in PLAY_SWITCHES:
        assert name in off.playing([name]).method_switches and name not in on.playing([]).method_switches
    # rows stored before the switch existed keep their keys (and so --resume) while it is off
    key_off = cell_key(off, "src", 7, "comap", "valid_seen", [])
    assert "reflect_confidence" not in key_off["settings"]["actor"]
    assert cell_key(with_ablation(off, [], ["reflect_confidence"]), "src", 7, "comap", "valid_seen", []) != key_off


def test_a_run_is_evaluated_only_as_it_trained(tmp_path):
    from comap_async.run_files import check_played_as_trained, write_run_ablation

    on = CoMapConfig.model_validate({"actor": {"reflect_confidence": True}})
    check_played_as_trained(on, tmp_path / "no-run-yet")  # nothing recorded: nothing to hold it to
    write_run_ablation(tmp_path, [], ["reflect_confidence"])
    check_played_as_trained(on, tmp_path)
    with pytest.raises(ValueError, match="trained with ablation none, methods reflect_confidence; this config"):
        check_played_as_trained(CoMapConfig(), tmp_path)
