"""The evaluator process against a real broker and the embedded server.

Two versions are "published" the way the learner does it (adapter files in the adapter root, an
announce to the broker); `comap evaluator --once` measures the base model and each version on
held-out games, and `comap stats --json` then holds one result per version.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from comap_async.wire.broker_client import BrokerClient
from tests.fixtures.core import free_port
from tests.fixtures.inference import ADMIN_TOKEN, AdapterFactory, start_server, stop_server

pytestmark = pytest.mark.alfworld
REPO = Path(__file__).resolve().parents[2]
ROLES = ("policy", "wm", "wm_teacher")


@pytest.fixture
def server(tiny_model_dir, tmp_path):
    """The embedded server with prompts as long as the probes' (the shared fixture allows 512 tokens)."""
    root, port = tmp_path / "adapters", free_port()
    root.mkdir()
    proc = start_server(
        [
            "--set",
            f"model.name_or_path={tiny_model_dir}",
            "--set",
            f"inference.port={port}",
            "--set",
            f"inference.adapter_root={root}",
            "--set",
            f"inference.admin_token={ADMIN_TOKEN}",
            "--set",
            "inference.max_new_tokens=64",
        ],
        port,
        tmp_path / "serve.log",
        timeout_s=90,
    )
    yield f"http://127.0.0.1:{port}", root
    stop_server(proc)


def evaluator_args(broker, url, adapter_root, alfworld_data, model_cache, tiny_model_dir, *extra: str) -> list[str]:
    """``comap evaluator``'s arguments: the test config pointed at this test's broker, server and games."""
    sets = [
        f"model.cache_dir={model_cache}",
        f"model.name_or_path={tiny_model_dir}",
        f"env.data_dir={alfworld_data}",
        f"run.root={broker.run_root}",
        "run.name=t",
        f"broker.learner_port={broker.learner_port}",
        f"broker.actor_port={broker.actor_port}",
        f"broker.http_port={broker.http_port}",
        f"inference.endpoints=['{url}']",
        f"inference.admin_token={ADMIN_TOKEN}",
        f"inference.adapter_root={adapter_root}",
        *extra,
    ]
    return ["--config", "configs/test.yaml", *sum((["--set", s] for s in sets), [])]


async def test_evaluator_records_one_result_per_published_version(
    broker_factory, server, alfworld_data, model_cache, tiny_model_dir, tmp_path
):
    from comap_async.wire.inference_client import InferenceClient

    url, adapter_root = server
    broker = broker_factory()
    factory = AdapterFactory(tiny_model_dir, adapter_root)
    for v in (1, 2):
        for i, role in enumerate(ROLES):
            factory.random(f"{role}-v{v}", seed=10 * v + i)
    async with BrokerClient(broker.learner_endpoint, timeout_s=10) as client:
        await client.announce("coevolve", dict.fromkeys(ROLES, 2), {r: f"{r}-v2" for r in ROLES}, step=8)
    args = evaluator_args(broker, url, adapter_root, alfworld_data, model_cache, tiny_model_dir)
    r = subprocess.run(
        [sys.executable, "-m", "comap_async", "evaluator", "--once", *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    files = sorted((broker.run_root / "t" / "eval").glob("v*.json"))
    assert [f.name for f in files] == ["v0.json", "v1.json", "v2.json"]
    out = subprocess.run(
        [sys.executable, "-m", "comap_async", "stats", "--json", *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    results = json.loads(out.stdout)["eval"]
    assert [e["version"] for e in results] == [0, 1, 2]
    for e in results:
        assert e["split"] == "valid_seen" and e["games"] == 2 and e["walkthrough_states"] > 0
        assert 0.0 <= e["wm_delta_f1"] <= 1.0 and 0.0 <= e["draft_accuracy"] <= 1.0
        assert e["success_games"] == 1 and 0.0 <= e["success_rate"] <= 1.0 and e["failed_games"] == []
        assert len(e["rows"]) == e["walkthrough_states"] + e["failure_transitions"]  # kept for re-analysis
    # each version was served under the evaluator's own names, loaded from that version's files
    assert [e["adapters"].get("policy") for e in results] == [None, "eval-policy-v1", "eval-policy-v2"]
    loaded = [
        json.loads(line) for line in (tmp_path / "serve.log").read_text().splitlines() if '"adapter.loaded"' in line
    ]
    for v in (1, 2):
        for role in ROLES:
            assert any(e["name"] == f"eval-{role}-v{v}" and e["path"].endswith(f"/{role}-v{v}") for e in loaded)
    async with InferenceClient([url], token=ADMIN_TOKEN) as c:
        assert not [m for m in await c.models() if m.startswith("eval-")]  # unloaded again
    assert list((broker.run_root / "t" / "tensorboard").glob("*.evaluator"))  # eval/ scalars for TensorBoard
    # a second run finds nothing left to do
    again = subprocess.run(
        [sys.executable, "-m", "comap_async", "evaluator", "--once", *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert again.returncode == 0 and "evaluator.result" not in again.stderr + again.stdout


def test_success_games_are_drawn_from_the_split_not_capped_by_the_probe_games(alfworld_data, tmp_path):
    """10 success games with 6 probe games played 6 (they were drawn from the probe games): the CPU
    default's success rate then rested on 6 games where its config asks for 10."""
    from types import SimpleNamespace

    from comap_async.config import load_config
    from evaluator.evaluator import Evaluator

    overrides = [f"run.root={tmp_path}", f"env.data_dir={alfworld_data}", "eval.split=valid_seen"]
    log = SimpleNamespace(info=lambda *a, **k: None, error=lambda *a, **k: None)
    probes, success = Evaluator(load_config(None, overrides + ["eval.games=3", "eval.success_games=7"]), log).games
    assert len(probes) == 3 and len(success) == 7 and len({g.name for g in success}) == 7
    assert {g.name for g in probes} <= {g.name for g in success}
    fewer = Evaluator(load_config(None, overrides + ["eval.games=5", "eval.success_games=2"]), log).games
    assert len(fewer[0]) == 5 and {g.name for g in fewer[1]} <= {g.name for g in fewer[0]}


async def test_probes_beside_the_games_give_every_figure(server, alfworld_data, model_cache, tiny_model_dir, tmp_path):
    """The probes run beside the success games (their calls share the server's batches): one evaluation
    has both the probes' figures and every success game."""
    from comap_async.config import load_config
    from comap_async.logsetup import configure_logging
    from comap_async.wire.inference_client import InferenceClient
    from evaluator.evaluator import Evaluator

    url, adapter_root = server
    factory = AdapterFactory(tiny_model_dir, adapter_root)
    for i, role in enumerate(ROLES):
        factory.random(f"{role}-v1", seed=10 + i)
    sets = [
        f"model.cache_dir={model_cache}",
        f"model.name_or_path={tiny_model_dir}",
        f"env.data_dir={alfworld_data}",
        f"run.root={tmp_path / 'runs'}",
        "run.name=t",
        "env.max_steps=6",
        "eval.success_games=3",
        "eval.envs=3",
        f"inference.endpoints=['{url}']",
        f"inference.admin_token={ADMIN_TOKEN}",
        f"inference.adapter_root={adapter_root}",
    ]
    log = configure_logging("eval-test")
    cfg = load_config("configs/test.yaml", sets)
    async with InferenceClient([url], token=ADMIN_TOKEN) as client:
        together = await Evaluator(cfg, log).evaluate(client, 1, {})
    assert together["success_games"] == 3 and together["walkthrough_states"] > 0


async def test_an_evaluator_with_a_share_rests_as_long_as_it_evaluated(
    broker_factory, server, alfworld_data, model_cache, tiny_model_dir, tmp_path
):
    """``eval.max_share=0.5``: after each evaluation the evaluator rests as long as it took, so the actors'
    calls are not held for good while a new version always waits."""
    url, adapter_root = server
    broker = broker_factory()
    factory = AdapterFactory(tiny_model_dir, adapter_root)
    for i, role in enumerate(ROLES):
        factory.random(f"{role}-v1", seed=10 + i)
    async with BrokerClient(broker.learner_endpoint, timeout_s=10) as client:
        await client.announce("coevolve", dict.fromkeys(ROLES, 1), {r: f"{r}-v1" for r in ROLES}, step=4)
    args = evaluator_args(broker, url, adapter_root, alfworld_data, model_cache, tiny_model_dir, "eval.max_share=0.5")
    log = tmp_path / "evaluator.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "comap_async", "evaluator", *args],
            cwd=REPO,
            stdout=out,
            stderr=subprocess.STDOUT,
            env={**os.environ, "COMAP_LOG_JSON": "1"},
        )
    eval_dir = broker.run_root / "t" / "eval"
    try:
        deadline = time.time() + 600
        while not (eval_dir / "v1.json").exists() and proc.poll() is None and time.time() < deadline:
            time.sleep(0.5)
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    assert (eval_dir / "v1.json").exists(), log.read_text()[-3000:]
    v0, v1 = (json.loads((eval_dir / f"v{v}.json").read_text()) for v in (0, 1))
    resting = [json.loads(line) for line in log.read_text().splitlines() if '"evaluator.resting"' in line]
    assert resting and resting[0]["seconds"] >= v0["eval_s"]  # the whole evaluation, adapter loads included
    # v1 waited, although it was published before v0's evaluation ended
    assert (v1["ts"] - v1["eval_s"]) - v0["ts"] >= resting[0]["seconds"] - 1.0
