"""Data-parallel learner on torch.distributed, proven on CPU with the gloo backend
and 2 ranks started by torchrun: the weights after N steps equal one process's at the same global
batch, and in a whole learner run against a real broker and server rank 0 alone publishes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import torch

from tests.fixtures.broker import stored
from tests.fixtures.dp_trainer_worker import micro_batches, trained_state
from tests.fixtures.learner import make_trainer
from tests.fixtures.system import system_overrides
from tests.integration.test_learner_e2e import fill
from tests.integration.test_learner_phases import warmup_transitions

REPO = Path(__file__).resolve().parents[2]
STEPS = 3


def torchrun(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO), "COMAP_LOG_JSON": "1"}
    return subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", *args],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def test_every_collective_goes_through_the_group_device_helper_on_gloo(tmp_path):
    """The helper's path is the one NCCL takes (only the device differs: tests/unit/test_distributed_devices.py
    checks the NCCL decision and its guard): sums, means of gradients, broadcasts and rank 0's objects."""
    out = torchrun(str(REPO / "tests" / "fixtures" / "dp_collectives_worker.py"), str(tmp_path), timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    for got in ranks:
        assert (got["backend"], got["device"], got["collective_device"]) == ("gloo", "cpu", "cpu")
        assert got["sum"] == [3, 20]
        assert got["half"] == [True, "cpu", 1.5]  # back in the caller's dtype and device
        assert got["broadcast"] == [8]  # rank 1's
        assert got["follow"] == {"phase": "phase-of-rank-0"}
        assert got["grads"] == [[[15.0] * 3] * 2, [0.5] * 4]  # a rank that did not reach it counts as 0
        assert got["params"] == [[[1.0] * 3] * 2, [0.0] * 4]  # rank 0's weights everywhere
        assert got["calls"] and set(got["calls"]) == {"cpu"}  # every tensor reached gloo on the group's device


def test_two_ranks_equal_one_process_at_the_same_global_batch(tiny_model_dir, tmp_path):
    out = torchrun(
        str(REPO / "tests" / "fixtures" / "dp_trainer_worker.py"), str(tiny_model_dir), str(tmp_path), str(STEPS)
    )
    assert out.returncode == 0, out.stderr[-3000:]
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in (0, 1)]
    # one process, both micro-batches accumulated in each step (the same global batch)
    single = make_trainer(tiny_model_dir, autocast="off")
    single_losses = [single.train_step(micro_batches()) for _ in range(STEPS)]
    expected = trained_state(single)
    for rank in ranks:
        assert rank["state"].keys() == expected.keys()
        for name, tensor in expected.items():
            assert torch.allclose(rank["state"][name], tensor, rtol=1e-4, atol=1e-6), name
        assert rank["label_counts"] == single.label_counts == [STEPS, STEPS]  # both ranks' samples counted
    assert any(not torch.equal(t, make_trainer(tiny_model_dir).model.get_parameter(n)) for n, t in expected.items())
    # each rank's losses are its own micro-batch's; their mean is the single process's
    for key in ("policy/loss", "wm/loss"):
        for step in range(STEPS):
            mean = (ranks[0]["losses"][step][key] + ranks[1]["losses"][step][key]) / 2
            assert abs(mean - single_losses[step][key]) < 1e-3 * max(1.0, abs(mean)), (key, step)


def test_torchrun_learner_rank_zero_alone_publishes(broker_factory, roomy_server, tiny_model_dir, tmp_path):
    import asyncio

    broker = broker_factory()
    asyncio.run(fill(broker, warmup_transitions(8)))
    overrides = system_overrides(
        broker,
        roomy_server,
        tiny_model_dir,
        "broker.max_staleness=1000",
        "learner.batch_size=2",
        "learner.lr=0.01",
        "learner.lora_dropout=0.0",
        "learner.phases.warmup.min_samples=4",
        "learner.phases.warmup.steps=4",
        "learner.phases.warmup.publish_every=2",
        "learner.autocast=off",
    )
    out = torchrun(
        "-m",
        "comap_async",
        "learner",
        "--config",
        str(REPO / "configs" / "test.yaml"),
        "--max-steps",
        "4",
        *[w for o in overrides for w in ("--set", o)],
    )
    assert out.returncode == 0, out.stderr[-3000:]
    events = [json.loads(line) for line in (out.stdout + out.stderr).splitlines() if line.startswith("{")]
    publishes = [e for e in events if e.get("event") == "publish.done"]
    assert [e["version"] for e in publishes] == [1, 2] and len({e["pid"] for e in publishes}) == 1
    assert {e.get("rank") for e in events if e.get("event") == "learner.step"} == {0, 1}
    done = [e for e in events if e.get("event") == "learner.rank_done"]
    assert sorted(e["rank"] for e in done) == [0, 1] and len({e["weights"] for e in done}) == 1  # equal weights
    assert {e["step"] for e in done} == {4}
    assert broker.stats()["registry"]["versions"]["policy"] == 2
    ckpts = sorted(p.name for p in (broker.run_root / "t" / "checkpoints").glob("step-*"))
    assert ckpts == ["step-00000002", "step-00000004"]  # written once each, by rank 0
    assert len(stored(broker, "demos")) == 8
