"""The look-ahead method with the real default model: its critic's answer is read from
the server's logprobs on most steps, and the executed candidate is the best-scored one."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from pathlib import Path

import pytest

from comap_async.config import load_config
from comap_async.envs import games_from_config
from comap_async.envs.base import spread_sample
from comap_async.logsetup import configure_logging
from comap_async.method.gates import canonical_action
from comap_async.models import ModelError, resolve_model
from comap_async.wire.messages import Registry
from evaluator.eval_runner import play_games
from tests.fixtures.core import free_port
from tests.fixtures.inference import ADMIN_TOKEN, start_server, stop_server

pytestmark = [pytest.mark.slow, pytest.mark.alfworld]
REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def default_model_server(tmp_path_factory):
    cfg = load_config(REPO / "configs" / "local.yaml")
    try:
        path = resolve_model(cfg.model.name_or_path, cfg.model.cache_dir)
    except ModelError:  # not prepared yet on this machine: once, offline
        subprocess.run([sys.executable, "-m", "comap_async", "model", "prepare"], check=True, timeout=600)
        path = resolve_model(cfg.model.name_or_path, cfg.model.cache_dir)
    root, port = tmp_path_factory.mktemp("adapters"), free_port()
    proc = start_server(
        [
            "--config",
            str(REPO / "configs" / "local.yaml"),
            "--set",
            f"inference.port={port}",
            "--set",
            f"inference.adapter_root={root}",
            "--set",
            f"inference.admin_token={ADMIN_TOKEN}",
        ],
        port,
        root / "serve.log",
        timeout_s=300,
    )
    yield path, f"http://127.0.0.1:{port}"
    stop_server(proc)


def test_the_critic_scores_and_the_best_candidate_runs(default_model_server, alfworld_data, tmp_path):
    _, url = default_model_server
    cfg = load_config(
        REPO / "configs" / "local.yaml",
        [
            f"run.root={tmp_path}",
            f"inference.endpoints=['{url}']",
            f"inference.admin_token={ADMIN_TOKEN}",
            f"env.data_dir={alfworld_data}",
            "env.max_steps=3",
            "eval.lookahead_k=3",
        ],
    )
    games = spread_sample(games_from_config(cfg, "valid_seen"), 2, cfg.run.seed)
    results = asyncio.run(
        asyncio.wait_for(
            play_games(cfg, games, Registry.serving(0), configure_logging("eval-test"), envs=2, method="lookahead"), 900
        )
    )
    stats = [s for _, s in results]
    steps = [step for s in stats for step in s.lookahead]
    scores = [x for step in steps for x in step.scores]
    assert len(steps) >= 4 and sum(x is not None for x in scores) >= 0.8 * len(scores), scores
    executed = [action for s in stats for _, action in s.state_actions]
    for step, action in zip(steps, executed):
        read = [x for x in step.scores if x is not None]
        assert not read or step.scores[step.chosen] == max(read)
        assert canonical_action(step.candidates[step.chosen]) == action
    assert any(len(step.candidates) > 1 for step in steps)  # sampled candidates differ
