"""Generation settings of the paper: Qwen3 in non-thinking mode, top-p
0.9, separate token budgets, the student rollout sampled, and the adapter versions each call used."""

from __future__ import annotations

import asyncio
import json
import math
from pathlib import Path
from types import SimpleNamespace

import pytest

from actors.episodes import Episode
from actors.llm import AgentLLM
from actors.registry_view import RegistryView
from comap_async.config import ActorConfig, ConfigError, load_config
from comap_async.prompts import ChatTemplate, DecisionTokens, Prompts
from comap_async.wire.inference_client import InferenceError
from comap_async.wire.messages import Registry, adapter_family, adapter_version

REPO = Path(__file__).resolve().parents[2]

# The generation-prompt part of Qwen3's chat template: a thinking block unless enable_thinking is false.
QWEN3_LIKE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n{% endif %}{% endif %}"
)
# A template that opens a thinking block unless told not to
THINKS_UNLESS_TOLD = (
    "{% for m in messages %}[{{ m['role'] }}]{{ m['content'] }}{% endfor %}"
    "{% if add_generation_prompt %}[assistant]"
    "{% if enable_thinking is not defined or enable_thinking %}<think>{% endif %}{% endif %}"
)
MSGS = [{"role": "system", "content": "sys"}, {"role": "user", "content": "hello"}]


# ------------------------------------------------------------------ point 6: non-thinking mode
@pytest.mark.parametrize("template", [QWEN3_LIKE, THINKS_UNLESS_TOLD], ids=["qwen3", "thinks_unless_told"])
def test_chat_template_renders_non_thinking_mode(template):
    chat = ChatTemplate(template)
    for _ in range(5):  # the skeleton path (after its verified renders) as well as full renders
        out = chat.render(MSGS)
        # nothing left for the model to think in: no block, or one already closed (Qwen3's non-thinking mode)
        assert "<think>" not in out.replace("<think>\n\n</think>\n\n", "")
        assert out.endswith(
            "<|im_start|>assistant\n<think>\n\n</think>\n\n" if template is QWEN3_LIKE else "[assistant]"
        )
    # the flag is what decides: with thinking on the same template leaves the model to open the block
    thinking = ChatTemplate(template, variables={"enable_thinking": True}).render(MSGS)
    assert not thinking.endswith("</think>\n\n") and thinking != out


def test_prompts_from_a_model_dir_with_a_thinking_template(tmp_path):
    (tmp_path / "tokenizer_config.json").write_text(
        json.dumps({"chat_template": THINKS_UNLESS_TOLD, "eos_token": "</s>"})
    )
    prompts = Prompts(ChatTemplate.from_model_dir(tmp_path))  # what actors and the learner both build
    for text in (
        prompts.draft("s"),
        prompts.world_model("s", "look"),
        prompts.teacher("s", "look", "o"),
        prompts.reflect("s", "look", "o"),
    ):
        assert "<think>" not in text


def test_template_without_the_flag_renders_as_before():
    plain = (
        "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}"
        "{% if add_generation_prompt %}<a>{% endif %}"
    )
    assert ChatTemplate(plain).render(MSGS) == "<system>sys<user>hello<a>"


# ------------------------------------------------------------------ point 8: config
def test_paper_generation_defaults_and_gpu_budgets():
    a = ActorConfig()
    assert a.top_p == 0.9 and a.temperature == 0.7
    for name in ("alfworld-qwen3-4b.yaml", "alfworld-qwen3-8b.yaml"):
        g = load_config(REPO / "configs" / name).actor
        assert g.max_tokens == {"draft": 64, "reflection": 128, "final_action": 16, "wm": 192}
        assert (g.temperature, g.top_p) == (0.7, 0.9)
    for name in ("local.yaml", "test.yaml"):  # CPU configs keep small budgets
        c = load_config(REPO / "configs" / name).actor.max_tokens
        assert c["draft"] < 64 and c["reflection"] < 128 and c["wm"] < 192


def test_a_budget_left_out_keeps_its_default_and_only_the_four_calls_have_one(tmp_path):
    c = load_config(None, ["actor.max_tokens.wm=192"]).actor.max_tokens
    assert c == {"draft": 32, "reflection": 40, "final_action": 16, "wm": 192}
    f = tmp_path / "gpu.yaml"
    f.write_text("actor:\n  max_tokens: {draft: 64}\n")
    assert load_config(f).actor.max_tokens["draft"] == 64
    with pytest.raises(ConfigError, match=r"actor.max_tokens: unknown key state: the budgets are draft, reflection"):
        load_config(None, ["actor.max_tokens.state=9"])
    for bad in ("0", "true", "'9'"):
        with pytest.raises(ConfigError, match=r"actor.max_tokens: draft must be a positive number of tokens"):
            load_config(None, [f"actor.max_tokens.draft={bad}"])
    # the four fields they replaced, and the names before those, are refused with the line naming the key
    with pytest.raises(ConfigError, match=r"actor.max_state_tokens: removed: now actor.max_tokens: \{wm: N\}"):
        load_config(None, ["actor.max_state_tokens=33"])


# ------------------------------------------------------------------ point 8: AgentLLM calls
class FakeClient:
    """Records every completion request; answers by role (the prompt says which)."""

    def __init__(self, reflection: str = " KEEP\nFinal Action: look", missing: set[str] | None = None):
        self.calls: list[dict] = []
        self.reflection = reflection
        self.missing = missing or set()  # model names answered with 404 (a retired adapter)

    async def complete(self, **kw):
        self.calls.append(kw)
        if kw["model"] in self.missing:
            raise InferenceError("adapter gone", status=404)
        if kw["prompt"].endswith("Decision:"):
            toks = [" KE", "EP", "\n", "Final", " Action", ":"] + [
                " " + w for w in self.reflection.split("Final Action: ")[1].split()
            ]
            text = "".join(toks)
            lp = {
                "tokens": toks,
                "token_logprobs": [math.log(0.5)] * len(toks),
                "top_logprobs": [{" KE": math.log(0.9), " RE": math.log(0.1)}],
            }
            return {"choices": [{"text": text, "logprobs": lp}]}
        await asyncio.sleep(0)  # let concurrent tasks interleave
        return {"choices": [{"text": "go to desk 1" if "next action" in kw["prompt"] else "You arrive at desk 1."}]}


def make_llm(client, **actor) -> AgentLLM:
    cfg = ActorConfig(**actor)
    return AgentLLM(
        client,
        Prompts(
            ChatTemplate("{% for m in messages %}{{ m['content'] }}{% endfor %}"),
            decision=DecisionTokens(" KE", " RE", 0, 1),
        ),
        cfg,
        "base",
    )


async def test_each_role_samples_with_its_own_settings():
    client = FakeClient()
    llm = make_llm(client, max_tokens={"draft": 64, "reflection": 128, "final_action": 16, "wm": 192})
    await llm.draft("s")
    await llm.imagine("s", "look")
    await llm.reflect("s", "look", "o")
    await llm.teacher("s", "look", "o")
    draft, student, reflect, teacher = client.calls
    assert (draft["max_tokens"], draft["temperature"], draft["top_p"]) == (64, 0.7, 0.9)
    assert (reflect["max_tokens"], reflect["temperature"], reflect["top_p"]) == (128, 0.7, 0.9)
    # the student rollout that self-distillation trains on is sampled, not greedy
    assert (student["max_tokens"], student["temperature"], student["top_p"]) == (192, 0.7, 0.9)
    assert (teacher["max_tokens"], teacher["temperature"]) == (192, 0.0)  # the gate's reference stays greedy
    llm = make_llm(client := FakeClient(), temperature=0.0)
    await llm.imagine("s", "look")
    assert client.calls[0]["temperature"] == 0.0  # at actor.temperature (0 = greedy)


async def test_final_action_has_its_own_budget():
    long = "Final Action: take the very long named apple 1 from the countertop 1 near the window"
    llm = make_llm(FakeClient(reflection=" KEEP\n" + long), max_tokens={"final_action": 4})
    r = await llm.reflect("s", "look", "o")
    assert r.a_ref == "take the very long" and r.problem == "final_action_truncated"
    assert r.q_ref == pytest.approx(0.5)
    r = await make_llm(
        FakeClient(reflection=" KEEP\nFinal Action: open fridge 1"), max_tokens={"final_action": 4}
    ).reflect("s", "d", "o")
    assert r.a_ref == "open fridge 1" and r.problem is None


# ------------------------------------------------------------------ point 8: version stamping
def test_adapter_family_leaves_out_the_version_only():
    assert adapter_family("policy-v3") == "policy" and adapter_family("eval-wm_teacher-v12") == "eval-wm_teacher"
    assert adapter_family("smollm2-135m-instruct") == "smollm2-135m-instruct" and adapter_family("x-vx") == "x-vx"


def test_adapter_version_of_a_model_name():
    assert adapter_version("policy-v3") == 3 and adapter_version("wm_teacher-v12") == 12
    assert adapter_version("base") == 0 and adapter_version("Qwen/Qwen3-4B") == 0 and adapter_version("") == 0


async def test_last_version_is_the_adapter_each_call_used():
    client = FakeClient()
    llm = make_llm(client)
    assert llm.last_version("policy") is None and llm.last_version("wm") is None  # no call yet
    await llm.draft("s")
    assert llm.last_version("policy") == 0 and llm.last_model("policy") == "base"  # base model = version 0
    llm.registry.update({"adapters": {"policy": "policy-v3", "wm": "wm-v2"}})
    await llm.draft("s")
    # a publish lands between the draft and the prediction: each field keeps the version that made it
    llm.registry.update({"adapters": {"policy": "policy-v4", "wm": "wm-v5"}})
    await llm.imagine("s", "go to desk 1")
    assert (llm.last_version("policy"), llm.last_version("wm")) == (3, 5)
    assert [c["model"] for c in client.calls] == ["base", "policy-v3", "wm-v5"]


async def test_last_version_after_a_stale_adapter_retry():
    client = FakeClient(missing={"wm-v1"})

    async def refresh():
        return {"adapters": {"policy": "policy-v2", "wm": "wm-v2"}}

    llm = AgentLLM(client, make_llm(client).prompts, ActorConfig(), "base", registry=RegistryView(fetch=refresh))
    llm.registry.update({"adapters": {"policy": "policy-v1", "wm": "wm-v1"}})
    await llm.imagine("s", "look")
    assert llm.last_version("wm") == 2 and llm.stale_adapter_retries == 1


async def test_last_version_is_per_task():
    """Concurrent episodes of one actor share one AgentLLM: each sees only its own calls."""
    client = FakeClient()
    llm = make_llm(client)
    gate = asyncio.Event()

    async def episode(adapter: str, wait: bool) -> int | None:
        llm.registry.update({"adapters": {"policy": adapter}})
        await llm.draft("s")
        if wait:
            await gate.wait()  # the other episode drafts with another adapter meanwhile
        else:
            gate.set()
        return llm.last_version("policy")

    first = asyncio.create_task(episode("policy-v1", wait=True))
    await asyncio.sleep(0.01)
    second = asyncio.create_task(episode("policy-v7", wait=False))
    assert await asyncio.gather(first, second) == [1, 7]


STEP = dict(
    a_draft="look",
    s_hat="",
    decision="KEEP",
    a_ref="look",
    p_revise=0.0,
    q_ref=1.0,
    a_exec="look",
    s_hat_exec="",
    s_hat_teacher="",
    expert_action=None,
)


def test_transition_stamps_given_versions_over_the_registry():
    registry = Registry(versions={"policy": 9, "wm": 9})
    ctx = SimpleNamespace(
        actor="a",
        cfg=load_config(None),
        llm=None,
        emit=None,
        registry=lambda: registry,
        next_state=lambda facts, text: frozenset(),
        parse_facts=lambda text: frozenset(),
    )
    from comap_async.envs.base import StepResult

    first = StepResult(
        observation="You are in a room.", won=False, done=False, admissible=(), expert_action=None, info={"task": "t"}
    )
    ep = Episode(ctx, SimpleNamespace(name="g", split="valid_seen"), "a:e1", first)
    tr = ep.transition("coevolve", 0, "o", "s", policy_version=3, wm_version=5, **STEP)
    assert (tr.policy_version, tr.wm_version) == (3, 5)
    tr = ep.transition("coevolve", 0, "o", "s", policy_version=0, **STEP)
    assert (tr.policy_version, tr.wm_version) == (0, 9)  # 0 is a version (the base model), None = registry
    tr = ep.transition("coevolve", 0, "o", "s", **STEP)
    assert (tr.policy_version, tr.wm_version) == (9, 9)
    # what AgentLLM.last_version gives before a task's first call of a role: the registry's
    tr = ep.transition("coevolve", 0, "o", "s", policy_version=None, wm_version=None, **STEP)
    assert (tr.policy_version, tr.wm_version) == (9, 9)
