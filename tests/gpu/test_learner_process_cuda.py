"""The learner process with ``learner.device: cuda`` (the GPU configs' setting) against a real
broker and a real embedded server: it trains on the GPU, publishes adapters moved to the CPU, and
the server serves the published version. Skipped without a GPU."""

from __future__ import annotations

import pytest
import torch

from comap_async.logsetup import configure_logging
from comap_async.prompts import ChatTemplate, Prompts
from comap_async.wire.inference_client import InferenceClient
from learner.loop import Learner
from tests.integration.test_learner_e2e import LOSSES, STATE, TARGET, dataset, fill, learner_config

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


async def test_the_learner_trains_on_the_gpu_and_the_server_serves_what_it_published(
    broker_factory, roomy_server, tiny_model_dir
):
    broker = broker_factory()
    await fill(broker, dataset())
    cfg = learner_config(broker, roomy_server, tiny_model_dir, "learner.device=cuda", "learner.checkpoint_every=1000")
    learner = Learner(cfg, configure_logging("learner-gpu-test"))
    assert next(learner.trainer.model.parameters()).device.type == "cuda"
    await learner.run(max_steps=40)
    last = learner.history[-1]
    for name in LOSSES:  # (step 1 is reflection-mode initialisation: no world-model loss yet)
        first = next(m for m in learner.history if name in m)
        assert last[name] <= 0.5 * first[name], f"{name}: {first[name]:.3f} -> {last[name]:.3f}"
    version = learner.state.version
    assert version == 2
    prompt = Prompts(ChatTemplate.from_model_dir(tiny_model_dir)).draft(STATE.format(i=0))
    async with InferenceClient([roomy_server.url], token=roomy_server.token) as client:
        assert f"policy-v{version}" in await client.models()
        after = (await client.complete(prompt, model=f"policy-v{version}", max_tokens=8, temperature=0.0, seed=1)).text
    assert after.strip().startswith(TARGET[:10])  # the CPU server serves what the GPU learned
