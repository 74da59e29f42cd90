"""Data parallel on GPUs without a GPU: the decisions NCCL depends on, checked on their own.

A collective's tensor must be on the rank's card under NCCL (a CPU tensor fails with "No backend
type associated with device type cpu", which the gloo tests cannot see), and a rank's step thread
must build its batches on the rank's own card (CUDA's current device is per thread: a bare "cuda"
in the step's thread is card 0 on every rank)."""

from __future__ import annotations

import ast
import asyncio
import threading
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from learner.distributed import DataParallel, check_collective, collective_device, rank_device

REPO = Path(__file__).resolve().parents[2]


def test_the_collective_device_is_the_ranks_card_under_nccl_and_the_cpu_under_gloo():
    assert collective_device("nccl", "cuda:1") == torch.device("cuda:1")
    assert collective_device("gloo", "cuda:1") == torch.device("cpu")
    assert collective_device("gloo", "cpu") == torch.device("cpu")
    with pytest.raises(ValueError, match="NCCL backend needs a CUDA device"):
        collective_device("nccl", "cpu")


def test_the_guard_refuses_a_cpu_tensor_for_nccl():
    with pytest.raises(ValueError, match="NCCL collective got a tensor on cpu"):
        check_collective("nccl", torch.zeros(3))
    t = torch.zeros(3)
    assert check_collective("gloo", t) is t


def test_a_cpu_tensor_never_reaches_an_nccl_collective(monkeypatch):
    """The label counts were a CPU tensor all-reduced in the NCCL group at every step: with the
    decision sending it to the CPU (as the code did), the guard on the helper's path stops it."""
    import learner.distributed as distributed

    reached = []
    monkeypatch.setattr(torch.distributed, "all_reduce", lambda t, *a, **k: reached.append(t))
    monkeypatch.setattr(distributed, "collective_device", lambda backend, device: torch.device("cpu"))
    dp = DataParallel(rank=0, world=2, backend="nccl", device="cuda:0")
    with pytest.raises(ValueError, match="NCCL collective got a tensor on cpu"):
        dp.sum([1, 2])
    params = [torch.nn.Parameter(torch.zeros(2))]
    params[0].grad = torch.ones(2)
    with pytest.raises(ValueError, match="NCCL collective got a tensor on cpu"):
        dp.average_gradients(params)
    assert reached == []


COLLECTIVES = {"all_reduce", "broadcast", "all_gather", "reduce_scatter", "reduce", "all_to_all", "gather", "scatter"}


def test_every_tensor_collective_of_the_learner_goes_through_the_helper():
    """Only :meth:`DataParallel.all_reduce` and :meth:`DataParallel.broadcast` call torch.distributed's
    tensor collectives (they put the tensor on the group's device); ``broadcast_object_list`` is told
    its device."""
    found = []
    for path in sorted((REPO / "learner").rglob("*.py")):
        tree = ast.parse(path.read_text())
        for fn in ast.walk(tree):
            if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            for node in ast.walk(fn):
                if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
                    name = node.func.attr
                    if name in COLLECTIVES and getattr(node.func.value, "id", None) == "dist":
                        found.append((path.name, fn.name, name))
                    if name == "broadcast_object_list":
                        assert any(k.arg == "device" for k in node.keywords), (path.name, fn.name)
    helpers = [("distributed.py", "all_reduce", "all_reduce"), ("distributed.py", "broadcast", "broadcast")]
    assert sorted(found) == helpers


def test_rank_device_names_the_ranks_card():
    assert rank_device("cuda", 1) == "cuda:1"
    assert rank_device("cuda", 0) == "cuda:0"
    assert rank_device("cpu", 1) == "cpu"
    assert rank_device("cuda:2", 1) == "cuda:2"  # named by the user: kept


@pytest.fixture
def rank_one_on_cuda(monkeypatch):
    """torchrun's environment for local rank 1 of 2 on CUDA, torch.distributed's group answers and
    ``torch.cuda.set_device`` recorded with the thread that called it (no GPU here)."""
    import torch.distributed as dist

    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_RANK", "1")
    set_devices = []
    monkeypatch.setattr(
        torch.cuda, "set_device", lambda d: set_devices.append((threading.current_thread().name, torch.device(d)))
    )
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    monkeypatch.setattr(dist, "init_process_group", lambda backend: set_devices.append(("group", backend)))
    monkeypatch.setattr(dist, "get_rank", lambda: 1)
    monkeypatch.setattr(dist, "get_world_size", lambda: 2)
    monkeypatch.setattr(dist, "get_backend", lambda: "nccl")
    return set_devices


def test_a_rank_joins_on_its_own_card(rank_one_on_cuda):
    dp = DataParallel.from_env("cuda")
    assert (dp.rank, dp.world, dp.backend, dp.device) == (1, 2, "nccl", "cuda:1")
    assert dp.collective_device == torch.device("cuda:1")
    assert rank_one_on_cuda == [("MainThread", torch.device("cuda:1")), ("group", "nccl")]


class Built(Exception):
    """Raised by the recording pack(): the batch's device is all this test needs."""


def test_rank_one_builds_its_batches_on_cuda_1_in_the_step_thread(rank_one_on_cuda, tiny_model_dir, monkeypatch):
    import comap_async.models as models
    import learner.trainer as trainer_module
    from comap_async.config import load_config
    from learner.loop import Learner
    from learner.step_thread import step_or_stop
    from tests.fixtures.learner import QuietLog, demo_record

    loaded_on = []
    real_load = models.load_model_and_tokenizer

    def load_on_cpu(path, dtype="float32", device="cpu"):
        loaded_on.append(device)
        return real_load(path, dtype, "cpu")

    packed_on = []

    def pack(units, pad_id, device="cpu"):
        packed_on.append((threading.current_thread().name, device))
        raise Built

    monkeypatch.setattr(models, "load_model_and_tokenizer", load_on_cpu)
    monkeypatch.setattr(trainer_module, "pack", pack)
    # the collectives themselves need a second rank and a card: the values pass through unchanged
    monkeypatch.setattr(DataParallel, "all_reduce", lambda self, t: t)
    monkeypatch.setattr(DataParallel, "broadcast", lambda self, t, src=0: t)
    cfg = load_config(None, [f"model.name_or_path={tiny_model_dir}", "learner.device=cuda", "learner.autocast=off"])
    log = SimpleNamespace(bind=lambda **k: QuietLog(), info=QuietLog().info, warning=QuietLog().warning)
    learner = Learner(cfg, log)
    assert loaded_on == ["cuda:1"] and learner.trainer.device == "cuda:1"
    learner.stop = asyncio.Event()

    async def one_step():
        return await step_or_stop(learner, [{"demos": [demo_record(0)]}])

    with pytest.raises(Built):
        asyncio.run(one_step())
    assert packed_on == [("learner-step", "cuda:1")]
    assert ("learner-step", torch.device("cuda:1")) in rank_one_on_cuda  # the step thread's own current device
