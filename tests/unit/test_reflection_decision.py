"""The reflection loop's decision: always an action, one p, no cross-entropy on the decision,
nothing unreadable stored, the teacher starting from the student when co-evolution begins."""

from __future__ import annotations

import math

import msgpack
import pytest
import torch

from actors.llm import AgentLLM
from broker.ingest import Ingest
from comap_async.config import ActorConfig, CoMapConfig
from comap_async.method.decision import revise_probability
from comap_async.method.gates import SampleRule, gate_reflection
from comap_async.prompts import ChatTemplate, DecisionTokens, Prompts, reflection_target
from comap_async.wire.protocol import decode
from learner import losses
from tests.fixtures.broker import make_transition
from tests.fixtures.calls import ScriptedClient
from tests.fixtures.learner import make_trainer, reflection_record

DECISION = DecisionTokens(" KE", " RE", 0, 1)


def make_llm(client) -> AgentLLM:
    prompts = Prompts(ChatTemplate("{% for m in messages %}{{ m['content'] }}{% endfor %}"), decision=DECISION)
    return AgentLLM(client, prompts, ActorConfig(max_tokens={"final_action": 16}), "base")


async def test_a_reflection_without_a_final_action_line_is_continued_into_an_action():
    # the model writes the decision word and stops: what the issue saw on 8 of 8 probes
    first = (" REVISE", [" RE", "VISE"], [math.log(0.7), -0.01], {" RE": math.log(0.7), " KE": math.log(0.2)})
    cont = (" open fridge 1", [" open", " fridge", " 1"], [math.log(0.9), math.log(0.8), math.log(0.7)], {})
    client = ScriptedClient(first, cont)
    r = await make_llm(client).reflect("state", "go to desk 1", "You arrive at desk 1.")
    assert r.readable and r.a_ref == "open fridge 1" and r.decision == "REVISE"
    assert r.problem == "no_final_action"  # counted: the text alone was not readable
    assert r.p_revise == pytest.approx(0.7 / 0.9)
    assert r.q_ref == pytest.approx((0.9 * 0.8 * 0.7) ** (1 / 3))  # over the continuation's action tokens
    # the second call continues the same prompt from the decision and the Final Action prefix
    assert client.calls[1]["prompt"] == client.calls[0]["prompt"] + " REVISE\nFinal Action:"
    assert client.calls[1]["max_tokens"] == 16 and "\n" in client.calls[1]["stop"]


async def test_an_undecided_reflection_continues_from_the_likelier_decision():
    first = ("\n", ["\n"], [-0.1], {"\n": -0.1, " KE": math.log(0.05), " RE": math.log(0.15)})
    cont = (" look", [" look"], [math.log(0.5)], {})
    client = ScriptedClient(first, cont)
    r = await make_llm(client).reflect("state", "go to desk 1", "s")
    assert r.readable and r.decision == "REVISE" and r.a_ref == "look" and r.problem == "no_decision"
    assert client.calls[1]["prompt"].endswith("Decision: REVISE\nFinal Action:")


async def test_a_readable_reflection_needs_one_call():
    text = " KEEP\nFinal Action: go to desk 1"
    toks = [" KE", "EP", "\n", "Final", " Action", ":", " go", " to", " desk", " 1"]
    client = ScriptedClient(
        (text, toks, [math.log(0.8)] + [math.log(0.9)] * 9, {" KE": math.log(0.8), " RE": math.log(0.1)})
    )
    r = await make_llm(client).reflect("state", "go to desk 1", "s")
    assert len(client.calls) == 1 and r.problem is None and r.readable and r.a_ref == "go to desk 1"
    assert r.q_ref == pytest.approx(0.9)


async def test_unreadable_reflections():
    # no decision token among the top-k: no p, the draft is executed, nothing to learn from
    client = ScriptedClient(("maybe", ["maybe"], [-0.1], {"maybe": -0.1}))
    r = await make_llm(client).reflect("state", "look", "s")
    assert not r.readable and r.a_ref == "look" and len(client.calls) == 1
    # REVISE, but the continuation writes no action either (the prompt's placeholder copied back)
    revise = (" REVISE\nFinal Action: <one command>", [" RE", "VISE"], [-0.1, -0.1], {" RE": -0.1, " KE": -3.0})
    client = ScriptedClient(revise, (" <one command>", [" <", "one"], [-0.1, -0.1], {}))
    r = await make_llm(client).reflect("state", "look", "s")
    assert not r.readable and r.a_ref == "look" and len(client.calls) == 2


async def test_a_keep_without_an_action_keeps_the_draft():
    # what a fork's policy wrote on 31 of 36 probe states: KEEP, then the prompt's placeholder
    keep = (" KEEP\nFinal Action: <one command>", [" KE", "EP"], [-0.2, -0.1], {" KE": -0.2, " RE": -1.8})
    client = ScriptedClient(keep, (" <one command>", [" <", "one"], [-0.1, -0.1], {}))
    r = await make_llm(client).reflect("state", "go to desk 1", "s")
    # readable: KEEP names its action, the draft (the y = 0 target); still counted as a parse problem
    assert r.readable and r.decision == "KEEP" and r.a_ref == "go to desk 1" and r.problem is not None
    assert r.p_revise == pytest.approx(math.exp(-1.8) / (math.exp(-1.8) + math.exp(-0.2)))
    assert gate_reflection(CoMapConfig(), r, "go to desk 1").reason == "keep"  # the draft runs


def test_an_unreadable_reflection_is_never_stored_as_a_training_sample():
    ingest = Ingest(SampleRule())
    for readable, stores in ((True, ["transitions", "reflections"]), (False, ["transitions"])):
        tr = make_transition(1, reflection_readable=readable)
        raw = msgpack.packb({**tr, "seq": 1})
        item = ingest.prepare(decode(raw), raw)
        assert [store for store, _ in item.records] == stores
    assert item.counters["gate_ag_unreadable"] == 1


def test_the_decision_format_term_is_blind_to_which_word():
    torch.manual_seed(0)
    logits = torch.randn(3, 11, requires_grad=True)
    losses.decision_format_nll(logits, 2, 5).sum().backward()
    # no gradient along the decision (logit REVISE - logit KEEP): the two tokens get the same push
    assert torch.allclose(logits.grad[:, 2], logits.grad[:, 5])
    shifted = logits.detach().clone()
    shifted[:, 5] += 1.3
    shifted[:, 2] -= 0.4
    lse = torch.logsumexp(shifted, -1)
    expected = -torch.log(torch.exp(shifted[:, 2] - lse) + torch.exp(shifted[:, 5] - lse))
    assert torch.allclose(losses.decision_format_nll(shifted, 2, 5), expected, atol=1e-6)


@pytest.mark.parametrize("reference", [False, True])
def test_the_decision_token_carries_no_cross_entropy(tiny_model_dir, reference):
    """The reflection CE over a sample is the CE of its tokens after the decision word's first token,
    plus the decision-neutral format term there; the BCE is the only loss on the choice."""
    t = make_trainer(tiny_model_dir, reference=reference, chunk_tokens=0)
    t.model.eval()
    record = reflection_record(1)
    _, reflect_ce, bce, _ = t.policy_losses([], [record])
    enc = t.encoder
    seq = enc.reflection(record)
    target = enc._ids(reflection_target("REVISE", record["target"]) + enc.eos)
    assert seq.ids[seq.start :] == target and target[0] == enc.revise_id
    from learner.peft_model import activate

    activate(t.model, "policy", trainable=False)
    with torch.no_grad():
        logits = t.model(input_ids=torch.tensor([seq.ids])).logits[0].float()
    at = torch.arange(seq.start - 1, seq.start - 1 + seq.n_target)  # positions predicting the target tokens
    ce = torch.nn.functional.cross_entropy(logits[at[1:]], torch.tensor(seq.ids[seq.start + 1 :]), reduction="sum")
    fmt = losses.decision_format_nll(logits[at[:1]], enc.keep_id, enc.revise_id).sum()
    assert float(reflect_ce) == pytest.approx(float((ce + fmt) / seq.n_target), rel=1e-4)
    p = revise_probability(logits[at[0], enc.keep_id], logits[at[0], enc.revise_id])
    assert float(bce) == pytest.approx(float(-torch.log(p)), rel=1e-4)


def test_the_learner_reads_the_actors_decision_tokens(tiny_model_dir):
    t = make_trainer(tiny_model_dir)
    assert t.encoder.decision == DecisionTokens.from_model_dir(tiny_model_dir)


def test_start_teacher_makes_the_teacher_the_student(tiny_model_dir):
    from learner.ema import paired_lora_tensors
    from tests.fixtures.learner import wm_record

    t = make_trainer(tiny_model_dir)
    for _ in range(2):
        t.train_step([{"transitions": [wm_record()]}])
    pairs = paired_lora_tensors(t.model)
    assert any(not torch.equal(teacher, student) for teacher, student in pairs)
    t.start_teacher()
    assert all(torch.equal(teacher, student) for teacher, student in pairs)


async def test_admissible_choice_regenerates_only_a_final_action_the_state_does_not_admit():
    """``actor.admissible_choice``: an admissible final action is the reflection's, in one call; an
    inadmissible one is generated again from ``Final Action:`` as one of the admissible commands."""
    prompts = Prompts(ChatTemplate("{% for m in messages %}{{ m['content'] }}{% endfor %}"), decision=DECISION)
    llm = AgentLLM(None, prompts, ActorConfig(admissible_choice=True), "base")
    admissible = ["go to desk 1", "go to shelf 2", "look"]
    top = {" RE": math.log(0.8), " KE": math.log(0.1)}
    toks = [" RE", "VISE", "\n", "Final", " Action", ":", " go", " to", " shelf", " 2"]
    llm.client = ScriptedClient((" REVISE\nFinal Action: go to shelf 2", toks, [math.log(0.8)] * 10, top))
    r = await llm.reflect("state", "go to desk 1", "s", admissible=admissible)
    assert len(llm.client.calls) == 1 and r.a_ref == "go to shelf 2" and r.problem is None
    assert "structured_outputs" not in llm.client.calls[0]  # the reflection itself is written freely
    toks[-1] = " 13"
    cont = (" go to shelf 2", [" go", " to", " shelf", " 2"], [math.log(0.5)] * 4, {})
    llm.client = ScriptedClient((" REVISE\nFinal Action: go to shelf 13", toks, [math.log(0.8)] * 10, top), cont)
    r = await llm.reflect("state", "go to desk 1", "s", admissible=admissible)
    assert r.readable and r.decision == "REVISE" and r.a_ref == "go to shelf 2" and r.q_ref == pytest.approx(0.5)
    second = llm.client.calls[1]
    assert second["prompt"] == llm.client.calls[0]["prompt"] + " REVISE\nFinal Action:"
    assert second["structured_outputs"] == {"choice": [" " + a for a in admissible]}
    # without an admissible list (an imagined state) nothing is constrained
    llm.client = ScriptedClient((" REVISE\nFinal Action: go to shelf 13", toks, [math.log(0.8)] * 10, top))
    r = await llm.reflect("state", "go to desk 1", "s")
    assert len(llm.client.calls) == 1 and r.a_ref == "go to shelf 13"


async def test_revise_other_action_regenerates_a_revise_that_names_the_draft():
    prompts = Prompts(ChatTemplate("{% for m in messages %}{{ m['content'] }}{% endfor %}"), decision=DECISION)
    llm = AgentLLM(None, prompts, ActorConfig(admissible_choice=True, revise_other_action=True), "base")
    admissible = ["go to desk 1", "take bowl 1 from desk 1", "look"]
    toks = [" RE", "VISE", "\n", "Final", " Action", ":", " go", " to", " desk", " 1"]
    revise = {" RE": math.log(0.8), " KE": math.log(0.1)}
    cont = (" take bowl 1 from desk 1", [" take", " bowl"], [math.log(0.4), math.log(0.9)], {})
    llm.client = ScriptedClient((" REVISE\nFinal Action: go to desk 1", toks, [math.log(0.8)] * 10, revise), cont)
    r = await llm.reflect("state", "go to desk 1", "s", admissible=admissible)
    assert r.decision == "REVISE" and r.a_ref == "take bowl 1 from desk 1"
    assert r.q_ref == pytest.approx(0.6)  # the policy's own confidence in the other action: the gate still asks
    assert llm.client.calls[1]["structured_outputs"] == {"choice": [" take bowl 1 from desk 1", " look"]}
    # a KEEP naming the draft is what KEEP means: one call
    keep = {" KE": math.log(0.8), " RE": math.log(0.1)}
    toks[:2] = [" KE", "EP"]
    llm.client = ScriptedClient((" KEEP\nFinal Action: go to desk 1", toks, [math.log(0.8)] * 10, keep))
    r = await llm.reflect("state", "go to desk 1", "s", admissible=admissible)
    assert len(llm.client.calls) == 1 and r.a_ref == "go to desk 1"


def test_revise_other_action_needs_admissible_choice():
    from comap_async.config import ConfigError, load_config

    with pytest.raises(ConfigError, match="needs actor.admissible_choice"):
        load_config(None, ["actor.revise_other_action=true"])
    on = load_config(None, ["actor.admissible_choice=true", "actor.revise_other_action=true"])
    assert {"admissible_choice", "revise_other_action"} <= set(on.method_switches)


def choice(text: str, lps: list[float]) -> dict:
    return {"text": text, "logprobs": {"tokens": [text] * len(lps), "token_logprobs": lps, "top_logprobs": []}}


def test_choice_logprob_is_the_whole_commands_end_token_included():
    from actors.llm import choice_logprob

    assert choice_logprob(choice("go to drawer 1", [-0.1, -0.1, -0.1, -0.2, -3.0])) == pytest.approx(-3.5)
    assert choice_logprob(choice("look", [])) == float("-inf")
    assert choice_logprob({"text": "look"}) == float("-inf")


def test_a_state_with_more_commands_than_a_request_may_list_is_a_clear_error():
    from comap_async.inference.choices import MAX_CHOICES

    llm = AgentLLM(None, Prompts(ChatTemplate("x"), decision=DECISION), ActorConfig(admissible_choice=True), "base")
    assert llm.choices(["look", "go to desk 1"], " ") == [" look", " go to desk 1"]
    assert llm.choices([]) is None and llm.choices(None) is None  # imagined states decode freely
    with pytest.raises(ValueError, match="turn the setting off"):
        llm.choices([f"go to shelf {i}" for i in range(MAX_CHOICES + 1)])


async def test_a_decision_first_reflection_generates_past_its_decision_only_when_the_gate_could_open():
    from comap_async.method.gates import decision_first

    cfg = CoMapConfig()
    # evaluation episodes only: co-evolution's transitions carry the whole reflection's action
    assert decision_first(cfg, evaluating=False) is None
    assert decision_first(cfg, evaluating=True) == cfg.method.tau_p
    ungated = cfg.model_copy(update={"method": cfg.method.model_copy(update={"ablation": ["no_action_gate"]})})
    assert decision_first(ungated, evaluating=True) is None
    # p at or below tau_p: one token generated, a KEEP of the draft, which the gate keeps as it would have
    keep = (" KE", [" KE"], [-0.2], {" KE": -0.2, " RE": -1.8})
    client = ScriptedClient(keep)
    r = await make_llm(client).reflect("state", "go to desk 1", "s", keep_at_or_below=0.5)
    assert len(client.calls) == 1 and client.calls[0]["max_tokens"] == 1
    assert r.decision == "KEEP" and r.a_ref == "go to desk 1" and r.readable and r.problem is None
    assert r.p_revise == pytest.approx(math.exp(-1.8) / (math.exp(-1.8) + math.exp(-0.2)))
    assert gate_reflection(cfg, r, "go to desk 1").reason == "keep"
    # above it: the same prompt generated whole, read as without the setting
    revise = {" RE": math.log(0.8), " KE": math.log(0.1)}
    text = " REVISE\nFinal Action: open fridge 1"
    toks = [" RE", "VISE", "\n", "Final", " Action", ":", " open", " fridge", " 1"]
    client = ScriptedClient((" RE", [" RE"], [math.log(0.8)], revise), (text, toks, [math.log(0.9)] * 9, revise))
    r = await make_llm(client).reflect("state", "go to desk 1", "s", keep_at_or_below=0.5)
    assert [c["max_tokens"] for c in client.calls] == [1, make_llm(client).cfg.max_tokens["reflection"]]
    assert client.calls[0]["prompt"] == client.calls[1]["prompt"]
    assert r.decision == "REVISE" and r.a_ref == "open fridge 1" and r.p_revise == pytest.approx(0.8 / 0.9)
    assert gate_reflection(cfg, r, "go to desk 1").open
