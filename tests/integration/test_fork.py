"""``comap fork``: a run started from another run's published version resumes at
that version, with the replay as the source had it then and its own switches; on a real broker,
a real learner with the tiny model and a real inference server."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from pathlib import Path

import pytest

from comap_async.logsetup import configure_logging
from comap_async.run_files import append_run_config, read_run_ablation, read_run_configs
from comap_async.wire.inference_client import InferenceClient
from comap_async.wire.messages import ROLES, adapter_name
from experiments.fork import FORK_FILE, ForkError, fork_run, forkable_versions
from learner.loop import Learner
from tests.fixtures.broker import stored
from tests.integration.test_learner_e2e import fill
from tests.integration.test_learner_phases import config, warmup_transitions

REPO = Path(__file__).resolve().parents[2]


async def test_a_fork_resumes_at_the_forked_version_with_the_replay_of_then_and_its_own_switches(
    broker_factory, roomy_server, tiny_model_dir, tmp_path
):
    source = broker_factory()
    await fill(source, warmup_transitions(8))
    # warm-up publishes v1 at step 2 and v2 at step 4, where reflection-mode initialisation begins
    cfg = config(
        source, roomy_server, tiny_model_dir, "learner.phases.warmup.steps=4", "learner.phases.warmup.publish_every=2"
    )
    learner = Learner(cfg, configure_logging("learner-test"))
    assert await asyncio.wait_for(learner.run(max_steps=4), 300) == 0
    await asyncio.sleep(0.05)
    late = [{**t, "id": f"late{i}"} for i, t in enumerate(warmup_transitions(3))]
    await fill(source, late)  # stored after both publishes: no fork may hold them
    src = source.run_root / "t"
    assert sorted(forkable_versions(src, cfg.adapter_root)) == [1, 2]

    target = broker_factory(["method.ablation=frozen_wm"], start=False)  # a run's processes share its switches
    dst = target.run_root / "t"
    fork_adapters = roomy_server.adapter_root / "fork"  # its own adapter root, inside what the server may load
    append_run_config(src, {"restarted": True}, 4, "reflect_init")  # the source restarted after the fork point
    with pytest.raises(ForkError, match="its own inference.adapter_root"):
        fork_run(src, dst, 1, cfg.adapter_root, cfg.adapter_root)
    record = fork_run(src, dst, 1, cfg.adapter_root, fork_adapters)
    assert (record["version"], record["step"], record["phase"]) == (1, 2, "warmup")
    assert record["cut"]["transitions"] == 3 and record["kept"]["transitions"] == 8 == record["kept"]["demos"]
    assert json.loads((dst / FORK_FILE).read_text())["source"] == str(src.resolve())
    assert not (dst / "ablation.json").exists()  # the fork's switches are its own, written when it starts
    assert [c["step"] for c in read_run_configs(dst)] == [0]  # the source's settings up to the fork point
    target.start()
    registry = target.stats()["registry"]
    assert registry["phase"] == "warmup" and registry["versions"]["policy"] == 1 and registry["step"] == 2
    assert [t["id"] for t in stored(target, "transitions")] == [t["id"] for t in stored(source, "transitions")][:8]

    # the source system is gone (its inference server with it): the fork's learner loads v1 itself
    client = InferenceClient.from_config(cfg)
    for name in [adapter_name(r, v) for r in ROLES for v in (1, 2)]:
        await client.unload_adapter(name, missing_ok=True)
    await client.close()
    fork_cfg = config(
        target,
        roomy_server,
        tiny_model_dir,
        "learner.phases.warmup.steps=4",
        "learner.phases.warmup.publish_every=2",
        f"inference.adapter_root={fork_adapters}",
        "method.ablation=frozen_wm",
    )
    forked = Learner(fork_cfg, configure_logging("learner-test"))
    assert await asyncio.wait_for(forked.run(max_steps=2), 300) == 0
    assert forked.trainer.step == 4 and len(forked.history) == 2  # resumed at step 2, trained steps 3 and 4
    assert target.stats()["registry"]["versions"]["policy"] == 2  # its own next version, on its own broker
    assert read_run_ablation(dst) == ["frozen_wm"]
    lineage = read_run_configs(dst)
    assert [c["step"] for c in lineage] == [0, 2]
    assert [c["config"]["method"]["ablation"] for c in lineage] == [[], ["frozen_wm"]]
    assert source.stats()["registry"]["versions"]["policy"] == 2 and read_run_ablation(src) == []


def test_fork_refuses_in_one_line(tmp_path):
    def fork(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            [sys.executable, "-m", "comap_async", "fork", *args, "--set", f"run.root={tmp_path}"],
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=60,
        )

    out = fork("nowhere", "--name", "new")
    assert out.returncode == 2 and out.stderr.count("\n") == 1 and "not a run directory" in out.stderr
    (tmp_path / "src" / "replay").mkdir(parents=True)
    out = fork("src", "--name", "new")
    assert out.returncode == 2 and out.stderr.count("\n") == 1 and "nothing to fork from" in out.stderr
