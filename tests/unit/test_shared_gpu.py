"""One card shared by vLLM and the learner: vLLM's memory share is decided once
(``CoMapConfig.vllm_memory_share``) and applied by ``comap serve --backend vllm`` however it is started,
and the learner loads its weights onto a shared card only after every inference server is healthy
(vLLM's start-up memory profile would otherwise count them as its own)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from comap_async.config import SHARED_GPU_MEMORY, load_config
from comap_async.inference import vllm

REPO = Path(__file__).resolve().parents[2]
QWEN = str(REPO / "configs" / "alfworld-qwen3-4b.yaml")  # the GPU configs' plan: inference.gpus [0], learner.gpus [0]
FOUR = ["inference.gpus=[0,1,2]", "learner.gpus=[3]"]


def share(argv: list[str]) -> str | None:
    return argv[argv.index("--gpu-memory-utilization") + 1] if "--gpu-memory-utilization" in argv else None


def serve_print_command(tiny_model_dir, *overrides: str, visible: str | None = None) -> list[str]:
    """The words of ``comap serve --backend vllm --print-command`` started by hand (no Procfile line)."""
    env = {k: v for k, v in os.environ.items() if k != "CUDA_VISIBLE_DEVICES"}
    if visible is not None:
        env["CUDA_VISIBLE_DEVICES"] = visible
    words = [f"model.name_or_path={tiny_model_dir}", *overrides]
    out = subprocess.run(
        [sys.executable, "-m", "comap_async", "serve", "--backend", "vllm", "--print-command", "--config", QWEN]
        + ["--vllm-python", sys.executable]
        + [w for o in words for w in ("--set", o)],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    return out.stdout.split()


def test_comap_serve_by_hand_leaves_the_shared_card_room_for_the_learner(tiny_model_dir):
    assert share(serve_print_command(tiny_model_dir)) == str(SHARED_GPU_MEMORY)
    assert share(serve_print_command(tiny_model_dir, visible="0")) == str(SHARED_GPU_MEMORY)
    # a 4-GPU host: a server on GPU 1 has its card to itself (vLLM's own default)
    assert share(serve_print_command(tiny_model_dir, *FOUR, visible="1")) is None
    assert share(serve_print_command(tiny_model_dir, "inference.gpu_memory_utilization=0.6")) == "0.6"  # the user's


def test_the_share_is_decided_once_for_procfile_and_serve():
    one = load_config(QWEN, [])
    assert one.shared_gpus() == [0] and one.vllm_memory_share() == SHARED_GPU_MEMORY
    assert share(vllm.build_command(one, "/m", "/p")[0]) == str(SHARED_GPU_MEMORY)  # GPUs not known: any shared
    four = load_config(QWEN, FOUR)
    assert four.shared_gpus() == [] and four.vllm_memory_share() is None
    tp = load_config(QWEN, ["inference.gpus=[0,1,2,3]", "inference.tensor_parallel=2", "learner.gpus=[3]"])
    assert share(vllm.build_command(tp, "/m", "/p", gpus=[0, 1])[0]) is None
    assert share(vllm.build_command(tp, "/m", "/p", gpus=[2, 3])[0]) == str(SHARED_GPU_MEMORY)
    assert vllm.visible_gpus({"CUDA_VISIBLE_DEVICES": "2,3"}) == [2, 3]
    for unknown in ({}, {"CUDA_VISIBLE_DEVICES": ""}, {"CUDA_VISIBLE_DEVICES": "GPU-5e3a"}):
        assert vllm.visible_gpus(unknown) is None


class Log:
    def __init__(self):
        self.events = []

    def info(self, event, **kw):
        self.events.append(event)

    warning = info

    def bind(self, **kw):
        return self


@pytest.fixture
def learner_start(monkeypatch):
    """``run_learner`` with the Learner replaced by one that records when it was built (the model
    load is its constructor's), and inference servers whose health answers fail ``unhealthy`` times."""
    from comap_async.wire.inference_client import InferenceClient
    from learner import loop

    seen = {"health": 0, "unhealthy": 2, "built_after": None}

    async def health(self, endpoint=None):
        seen["health"] += 1
        if seen["health"] <= seen["unhealthy"]:
            raise ConnectionRefusedError("Connection refused")  # vLLM still profiling its memory
        return True

    class Built:
        dp = None
        step_thread = None

        def __init__(self, cfg, log):
            seen["built_after"] = seen["health"]

        async def run(self, max_steps=None):
            return 0

    monkeypatch.setattr(InferenceClient, "health", health)
    monkeypatch.setattr(loop, "Learner", Built)
    return seen


def test_a_learner_on_a_shared_card_loads_only_after_every_server_is_healthy(learner_start, tmp_path):
    from learner.loop import run_learner

    endpoints = 'inference.endpoints=["http://127.0.0.1:9","http://127.0.0.1:10"]'
    cfg = load_config(QWEN, [f"run.root={tmp_path}", endpoints])
    log = Log()
    assert run_learner(cfg, log) == 0
    # two refused answers on the first server, then each server healthy once: only then the model
    assert learner_start["built_after"] == 4 and "learner.waiting_for_shared_gpu" in log.events


def test_a_learner_on_a_card_of_its_own_does_not_wait(learner_start, tmp_path):
    from learner.loop import run_learner

    for overrides in (FOUR, ["learner.device=cpu"]):
        learner_start["health"] = 0
        assert run_learner(load_config(QWEN, [f"run.root={tmp_path}", *overrides]), Log()) == 0
        assert learner_start["built_after"] == 0  # built at once (its run() waits for the servers as before)
