"""The learner against a real broker and a real embedded server."""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import torch

from comap_async.config import load_config
from comap_async.logsetup import configure_logging
from comap_async.models import load_model_and_tokenizer
from comap_async.prompts import ChatTemplate, Prompts
from comap_async.wire.broker_client import BrokerClient
from comap_async.wire.inference_client import InferenceClient
from comap_async.wire.outbox import Outbox
from learner.loop import Learner
from tests.fixtures.broker import make_transition
from tests.fixtures.system import system_overrides

REPO = Path(__file__).resolve().parents[2]
LOSSES = ("wm/ce", "wm/kl", "policy/draft_ce", "policy/reflect_ce", "policy/bce")
STATE = "Task: put a mug in coffeemachine.\nCurrent observation: You arrive at countertop {i}."
TARGET = "take mug 1 from countertop 1"


def dataset() -> list[dict]:
    """A fixed small dataset: demonstrations, world-model transitions with rollouts, reflections."""
    msgs = []
    for i in range(4):
        s = STATE.format(i=i)
        msgs.append(
            make_transition(
                i,
                actor="demo",
                phase="warmup",
                s=s,
                a_exec=TARGET,
                expert_action=TARGET,
                s_next="You pick up the mug 1 from the countertop 1.",
            )
        )
        msgs.append(
            make_transition(
                i,
                actor="coev",
                phase="coevolve",
                s=s,
                a_exec="go to coffeemachine 1",
                s_next="You arrive at coffeemachine 1. On the coffeemachine 1, you see nothing.",
                s_hat_exec="You arrive at coffeemachine 1. On the coffeemachine 1, you see a mug 2.",
            )
        )
        msgs.append(
            {
                "v": 1,
                "type": "reflection",
                "id": f"r{i}",
                "actor": "refl",
                "game": "g",
                "s": s,
                "a_draft": "go to fridge 1" if i % 2 else TARGET,
                "s_bar": "You arrive at fridge 1." if i % 2 else "You pick up the mug 1.",
                "target": TARGET,
                "y": i % 2,
                "policy_version": 0,
                "wm_version": 0,
                "ts": time.time(),
                "label": "expert_better" if i % 2 else "equal_draft",
            }
        )
    return msgs


async def fill(broker, msgs) -> None:
    async with Outbox(broker.actor_endpoint, ack_timeout_s=1.0) as ob:
        for m in msgs:
            await ob.put({k: v for k, v in m.items() if k not in ("v", "seq")})
        await ob.flush(30)


def learner_config(broker, server, tiny_model_dir, *extra):
    return load_config(
        REPO / "configs" / "test.yaml",
        system_overrides(
            broker,
            server,
            tiny_model_dir,
            "broker.max_staleness=1000",
            "learner.batch_size=4",
            "learner.lr=0.01",
            "learner.lora_dropout=0.0",
            "method.bce_weight=1.0",
            "learner.phases.warmup.steps=0",
            "learner.phases.reflect_init.steps=0",
            "learner.publish_every=20",
            "learner.checkpoint_every=20",
            *extra,
        ),
    )


async def test_learner_halves_losses_publishes_and_server_follows(broker_factory, roomy_server, tiny_model_dir):
    broker = broker_factory()
    await fill(broker, dataset())
    cfg = learner_config(broker, roomy_server, tiny_model_dir, "learner.checkpoint_every=1000")
    prompt = Prompts(ChatTemplate.from_model_dir(tiny_model_dir)).draft(STATE.format(i=0))
    async with InferenceClient([roomy_server.url], token=roomy_server.token) as client:
        before = (
            await client.complete(prompt, model=roomy_server.base_name, max_tokens=8, temperature=0.0, seed=1)
        ).text

        learner = Learner(cfg, configure_logging("learner-test"))
        await learner.run(max_steps=40)
        last = learner.history[-1]
        for name in LOSSES:  # (step 1 is reflection-mode initialisation: no world-model loss yet)
            first = next(m for m in learner.history if name in m)
            assert last[name] <= 0.5 * first[name], f"{name}: {first[name]:.3f} -> {last[name]:.3f}"
        version = learner.state.version
        # v1 at the switch to coevolve (step 1), v2 publish_every=20 steps later (step 21), v3 at the last
        # step of the budget (max_steps=40: a fork's end is published whatever the cadence)
        published = [i + 1 for i, m in enumerate(learner.history) if "learner/publish_s" in m]
        assert version == 3 and published == [1, 21, 40]
        # the learner reports each publish's time to live (loaded everywhere and announced)
        for i in published:
            m = learner.history[i - 1]
            assert 0 < m["learner/publish_live_ms"] <= 1000 * m["learner/publish_s"]
        # every publish is a checkpoint too (checkpoint_every is out of reach here), and so is the exit
        steps = sorted(int(p.name.split("-")[1]) for p in (cfg.run.dir / "checkpoints").glob("step-*"))
        assert steps == [1, 21, 40]

        async with BrokerClient(broker.learner_endpoint) as bc:
            registry = await bc.get_registry()
        assert registry["versions"]["policy"] == version and registry["adapters"]["policy"] == f"policy-v{version}"
        assert registry["phase"] == "coevolve" and registry["step"] == 40
        assert f"policy-v{version}" in await client.models()

        after = (await client.complete(prompt, model=f"policy-v{version}", max_tokens=8, temperature=0.0, seed=1)).text
    assert after != before
    # the served output is the new version's: the same adapter loaded locally generates the same text
    base, tok = load_model_and_tokenizer(str(tiny_model_dir))
    from peft import PeftModel

    local = PeftModel.from_pretrained(base, str(roomy_server.adapter_root / f"policy-v{version}"))
    ids = tok(prompt, return_tensors="pt", add_special_tokens=False)
    with torch.no_grad():
        out = local.generate(**ids, max_new_tokens=8, do_sample=False)
    expected = tok.decode(out[0, ids["input_ids"].shape[1] :], skip_special_tokens=True)
    assert after.strip() == expected.split("\n")[0].strip() or after.strip() == expected.strip()
    assert after.strip().startswith(TARGET[:10])  # it learned the demonstration


def _learner_cmd(overrides: list[str], max_steps: int | None = None) -> list[str]:
    cmd = [sys.executable, "-m", "learner", "--config", str(REPO / "configs" / "test.yaml")]
    for o in overrides:
        cmd += ["--set", o]
    return cmd + (["--max-steps", str(max_steps)] if max_steps is not None else [])


async def test_learner_resumes_bit_identical_after_sigkill(broker_factory, roomy_server, tiny_model_dir, tmp_path):
    broker = broker_factory()
    await fill(broker, dataset())
    overrides = system_overrides(
        broker,
        roomy_server,
        tiny_model_dir,
        "broker.max_staleness=1000",
        "learner.batch_size=4",
        "learner.phases.warmup.steps=0",
        "learner.phases.reflect_init.steps=0",
        "learner.checkpoint_every=3",
        "learner.publish_every=100",
    )
    ckpts = broker.run_root / "t" / "checkpoints"
    env = {**os.environ, "COMAP_LOG_JSON": "1"}
    log = open(tmp_path / "learner1.log", "wb")
    proc = subprocess.Popen(_learner_cmd(overrides), stdout=log, stderr=subprocess.STDOUT, env=env, cwd=REPO)
    deadline = time.monotonic() + 240
    while not (ckpts / "step-00000003" / "state.pt").exists():
        assert proc.poll() is None, (tmp_path / "learner1.log").read_text()[-3000:]
        assert time.monotonic() < deadline, "no checkpoint in time"
        await asyncio.sleep(0.2)
    proc.send_signal(signal.SIGKILL)
    proc.wait(10)
    saved = torch.load(ckpts / "step-00000003" / "state.pt", weights_only=False)
    newest = sorted(p.name for p in ckpts.glob("step-*") if (p / "state.pt").exists())[-1]
    saved = torch.load(ckpts / newest / "state.pt", weights_only=False)
    shutil.copytree(ckpts, tmp_path / "killed")

    # restart with --max-steps 0: resume, then write the resumed state back at the same step
    r = subprocess.run(
        _learner_cmd(overrides, max_steps=0), capture_output=True, text=True, env=env, cwd=REPO, timeout=240
    )
    assert r.returncode == 0, r.stderr[-3000:]
    assert '"event": "learner.resumed"' in r.stderr and f'"step": {saved["step"]}' in r.stderr
    resumed = torch.load(ckpts / newest / "state.pt", weights_only=False)
    assert resumed["step"] == saved["step"]
    for role, tensors in saved["adapters"].items():
        for k, v in tensors.items():
            assert torch.equal(v, resumed["adapters"][role][k]), (role, k)
    for pid, st in saved["optimizer"]["state"].items():
        for k, v in st.items():
            assert torch.equal(v, resumed["optimizer"]["state"][pid][k]), (pid, k)
    assert saved["scheduler"] == resumed["scheduler"]

    # and it trains on from there
    r = subprocess.run(
        _learner_cmd(overrides, max_steps=3), capture_output=True, text=True, env=env, cwd=REPO, timeout=240
    )
    assert r.returncode == 0, r.stderr[-3000:]
    assert (ckpts / f"step-{saved['step'] + 3:08d}" / "state.pt").exists()


async def test_rounds_schedule_trains_only_after_each_round_of_episodes(broker_factory, roomy_server, tiny_model_dir):
    """``learner.schedule: rounds``: after each publish the learner waits for a round of new episodes, as
    many as the steps it then trains (``publish_every``), trains them and publishes (the paper's loop)."""
    from tests.fixtures.broker import make_episode

    broker = broker_factory()
    await fill(broker, dataset())
    cfg = learner_config(
        broker,
        roomy_server,
        tiny_model_dir,
        "learner.schedule=rounds",
        "learner.publish_every=2",
    )
    learner = Learner(cfg, configure_logging("learner-test"))
    run = asyncio.create_task(learner.run(max_steps=5))

    async def settles_at(step: int) -> None:
        for _ in range(300):
            if learner.trainer.step >= step:
                break
            await asyncio.sleep(0.1)
        await asyncio.sleep(2.0)  # and stays there: it waits for the round, not for data
        assert learner.trainer.step == step and not run.done()

    try:
        await settles_at(1)  # one reflect_init step, the switch to coevolve publishes v1, then the round wait
        assert learner.state.version == 1
        # the teacher begins with co-evolution: v1, published at the switch, has the student's weights
        from safetensors.torch import load_file

        root = roomy_server.adapter_root
        student, teacher = (
            load_file(str(root / f"{role}-v1" / "adapter_model.safetensors")) for role in ("wm", "wm_teacher")
        )
        assert student.keys() == teacher.keys() and all(torch.equal(student[k], teacher[k]) for k in student)
        await fill(broker, [make_episode(i, actor="r1") for i in range(2)])
        await settles_at(3)  # a round of 2 episodes: publish_every=2 steps, then v2
        assert learner.state.version == 2
        await fill(broker, [make_episode(0, actor="r2")])
        await asyncio.sleep(2.0)
        assert learner.trainer.step == 3  # 1 of 2 episodes is not a round
        await fill(broker, [make_episode(9, actor="r2")])
        await asyncio.wait_for(run, 60)
        assert learner.trainer.step == 5 and learner.state.version == 3
    finally:
        learner.stop.set()
        await asyncio.gather(run, return_exceptions=True)
