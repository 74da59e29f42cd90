"""The learner's device-agnostic code on a real CUDA device: its losses and gradients equal the
reference computation's there (the test oracle, tests/fixtures/reference_path.py), bf16 autocast
trains every loss, a checkpoint taken on the GPU resumes bit-identically (the CUDA generators'
state included), and the learner process trains on the GPU against a real broker and a real
embedded server, which then serves what it published.

Skipped without a GPU: CI has none. Run on a GPU host with ``pytest tests/gpu``; the figures of
the last run on one are in docs/scaling.md.
"""

from __future__ import annotations

import pytest
import torch

from comap_async.models import build_tiny_model
from comap_async.run_files import CHECKPOINT_STATE
from comap_async.wire.messages import ROLES
from learner.checkpoint import latest, load_checkpoint, save_checkpoint
from learner.peft_model import adapter_parameters, load_adapter_state
from tests.fixtures.learner import make_trainer
from tests.unit.test_learner_fast_path import (
    LOSSES,
    RTOL,
    mixed_batch,
    randomize_adapters,
    step_with_grads,
    worst_difference,
)

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]
CUDA = "cuda"


@pytest.fixture(scope="module", params=["llama", "qwen3"])
def model_dir(request, tmp_path_factory):
    """The tiny random model in both architectures the configs use (Qwen3: the GPU configs')."""
    return build_tiny_model(tmp_path_factory.mktemp("gpu-models") / request.param, arch=request.param)


def test_fast_path_equals_the_reference_path_on_the_gpu(model_dir):
    ref = make_trainer(model_dir, CUDA, reference=True, gradient_checkpointing=True, autocast="off")
    fast = make_trainer(model_dir, CUDA, gradient_checkpointing=False, autocast="off")
    for role, state in randomize_adapters(ref).items():
        load_adapter_state(fast.model, role, state)
    a, b = step_with_grads(ref, mixed_batch()), step_with_grads(fast, mixed_batch())
    assert all(a[0][name] > 0 for name in LOSSES)
    assert all(g.device.type == CUDA for g in b[1].values())  # the gradients were computed on the GPU
    assert worst_difference(a, b) < RTOL


def test_bf16_autocast_on_the_gpu_lowers_the_losses_and_keeps_adapters_fp32(model_dir):
    trainer = make_trainer(model_dir, CUDA, autocast="auto")  # the GPU configs' setting
    assert trainer.forward.amp_dtype == torch.bfloat16
    history = [trainer.train_step([mixed_batch()]) for _ in range(30)]
    for name in LOSSES:
        if name == "wm/kl":  # to the EMA teacher, which moves with the student: finite, not falling
            assert all(0 <= m[name] < float("inf") for m in history)
            continue
        assert history[-1][name] < 0.75 * history[0][name], f"{name}: {history[0][name]:.3f} -> {history[-1][name]:.3f}"
    for role in ROLES:
        for _, p in adapter_parameters(trainer.model, role):
            assert p.dtype == torch.float32 and p.device.type == CUDA


def _losses(trainer, steps: int) -> list[float]:
    return [trainer.train_step([mixed_batch()])["policy/loss"] for _ in range(steps)]


def test_a_checkpoint_taken_on_the_gpu_resumes_bit_identically(model_dir, tmp_path):
    """Dropout on: each step's masks come from the CUDA generator, so the resumed steps equal the
    uninterrupted ones only if the checkpoint restored that generator's state too."""
    kw = dict(lora_dropout=0.05)
    a = make_trainer(model_dir, CUDA, **kw)
    _losses(a, 2)
    save_checkpoint(tmp_path, a, {})
    expected = _losses(a, 2)
    saved = torch.load(latest(tmp_path) / CHECKPOINT_STATE, map_location="cpu", weights_only=False)
    assert "cuda" in saved["rng"]  # the GPU generators' state is saved beside the CPU's
    b = make_trainer(model_dir, CUDA, **kw)
    torch.cuda.manual_seed_all(12345)  # another GPU stream of random numbers than the one saved
    load_checkpoint(latest(tmp_path), b)
    assert b.step == 2 and _losses(b, 2) == expected
    c = make_trainer(model_dir, CUDA, **kw)
    load_checkpoint(latest(tmp_path), c)
    torch.cuda.manual_seed_all(12345)  # the same weights, other dropout masks: the losses differ
    assert _losses(c, 2) != expected
