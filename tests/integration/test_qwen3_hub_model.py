"""The GPU configs' model, by hub id, offline: a tiny random Qwen3 written into a
temporary Hugging Face cache, whose chat template branches on ``enable_thinking`` like Qwen3's.
Every role reads the same snapshot: the prompts (actors, evaluator), the learner's model and one
training step, and ``comap serve`` with an adapter the learner saved."""

from __future__ import annotations

import asyncio
import math

import huggingface_hub.constants
import pytest

from comap_async.config import load_config
from comap_async.models import build_tiny_model, resolve_model
from comap_async.prompts import DecisionTokens, Prompts
from comap_async.wire.inference_client import InferenceClient
from tests.fixtures.core import free_port
from tests.fixtures.inference import ADMIN_TOKEN, start_server, stop_server
from tests.fixtures.learner import demo_record, reflection_record

REPO_ID = "org/tiny-qwen3"
# the shape of Qwen3's template: ChatML, and a generation prompt whose empty thinking block is
# what ``enable_thinking=False`` asks for
QWEN3_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n{% endif %}{% endif %}"
)


@pytest.fixture(scope="module")
def hub_cache(tmp_path_factory):
    cache = tmp_path_factory.mktemp("hub")
    repo = cache / f"models--{REPO_ID.replace('/', '--')}"
    build_tiny_model(repo / "snapshots" / "c0ffee", arch="qwen3", chat_template=QWEN3_TEMPLATE)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("c0ffee")
    return cache


@pytest.fixture
def offline_hub(hub_cache, monkeypatch):
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(hub_cache))
    monkeypatch.setenv("HF_HUB_CACHE", str(hub_cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return hub_cache


def test_prompts_and_a_learner_step_from_the_hub_id(offline_hub, tmp_path):
    from comap_async.logsetup import configure_logging
    from learner.loop import Learner

    cfg = load_config(None, [f"model.name_or_path={REPO_ID}", f"run.root={tmp_path}"])
    path = resolve_model(REPO_ID, cfg.model.cache_dir)
    assert path.startswith(str(offline_hub)) and path.endswith("c0ffee")
    prompts = Prompts.for_model(path, cfg)
    draft = prompts.draft("Task: cool a mug.\nCurrent observation: You arrive at countertop 1.")
    assert draft.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")  # thinking off, as Qwen3 wants it
    decision = DecisionTokens.from_model_dir(path)
    assert decision.keep_id != decision.revise_id
    learner = Learner(cfg, configure_logging("learner-test"))
    assert type(learner.trainer.model.get_base_model()).__name__ == "Qwen3ForCausalLM"
    metrics = learner.trainer.train_step([{"demos": [demo_record(0)], "reflections": [reflection_record(1)]}])
    assert math.isfinite(metrics["policy/loss"]) and metrics["policy/bce"] > 0


def test_the_embedded_server_serves_it_with_a_learner_adapter(offline_hub, tmp_path):
    from learner.publish import save_adapter
    from tests.fixtures.learner import make_trainer

    path = resolve_model(REPO_ID, "~/.cache/comap-async")
    trainer = make_trainer(path)
    trainer.train_step([{"demos": [demo_record(0)]}])
    save_adapter(trainer.model, "policy", tmp_path / "adapters" / "policy-v1")
    port = free_port()
    proc = start_server(
        [
            "--set",
            f"model.name_or_path={REPO_ID}",
            "--set",
            f"inference.port={port}",
            "--set",
            f"inference.adapter_root={tmp_path / 'adapters'}",
            "--set",
            f"inference.admin_token={ADMIN_TOKEN}",
            "--set",
            "inference.max_prompt_tokens=512",
        ],
        port,
        tmp_path / "serve.log",
        timeout_s=90,
    )
    try:

        async def use() -> str:
            client = InferenceClient(f"http://127.0.0.1:{port}", token=ADMIN_TOKEN)
            try:
                await client.load_adapter("policy-v1", str(tmp_path / "adapters" / "policy-v1"))
                out = await client.complete(
                    "<|im_start|>user\nhi<|im_end|>\n", model="policy-v1", max_tokens=4, temperature=0.0, logprobs=2
                )
                return out.raw
            finally:
                await client.close()

        raw = asyncio.run(use())
        assert raw["model"] == "policy-v1" and raw["usage"]["completion_tokens"] >= 1
        assert raw["choices"][0]["logprobs"]["top_logprobs"]  # the decision probability's input works too
    finally:
        stop_server(proc)
