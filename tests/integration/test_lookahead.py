"""The look-ahead evaluation method (WebEvolver's imagination engine) on real valid_seen
games with a tiny model on a real embedded server: K sampled candidates, K x D world-model calls
per step, the policy's critic score read from its answer tokens, the best-scored candidate executed."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from comap_async.config import load_config
from comap_async.envs import games_from_config
from comap_async.envs.base import spread_sample
from comap_async.logsetup import configure_logging
from comap_async.method.decision import top_k_revise_probability
from comap_async.method.gates import canonical_action
from comap_async.models import build_tiny_model
from comap_async.prompts import CRITIC_WORDS, DecisionTokens
from comap_async.wire.messages import Registry
from evaluator.eval_runner import play_games
from tests.fixtures.core import free_port
from tests.fixtures.inference import ADMIN_TOKEN, start_server, stop_server

pytestmark = pytest.mark.alfworld
REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def critic_model(tmp_path_factory):
    """The tiny model, its tokenizer also trained on the critic's answers (the default tiny one does
    not separate ' NO' and ' YES' at their first token), served by a real embedded server."""
    model = build_tiny_model(tmp_path_factory.mktemp("tiny-critic") / "m", extra_corpus="Answer: YES Answer: NO\n")
    root, port = tmp_path_factory.mktemp("adapters"), free_port()
    proc = start_server(
        [
            "--set",
            f"model.name_or_path={model}",
            "--set",
            f"inference.port={port}",
            "--set",
            f"inference.adapter_root={root}",
            "--set",
            f"inference.admin_token={ADMIN_TOKEN}",
            "--set",
            "inference.max_prompt_tokens=2048",
        ],
        port,
        root / "serve.log",
        timeout_s=90,
    )
    yield model, f"http://127.0.0.1:{port}"
    stop_server(proc)


@pytest.fixture
def calls(recorded_calls) -> list[dict]:
    return recorded_calls  # every model call of the episode, classified as in test_eval_methods.py


def play(critic_model, tmp_path, alfworld_data, monkeypatch, depth: int):
    from actors import lookahead

    monkeypatch.setattr(lookahead, "DEPTH", depth)
    model, url = critic_model
    cfg = load_config(
        REPO / "configs" / "test.yaml",
        [
            f"run.root={tmp_path}",
            f"model.name_or_path={model}",
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
            play_games(cfg, games, Registry.serving(0), configure_logging("eval-test"), envs=1, method="lookahead"), 300
        )
    )
    assert len(results) == 2
    return model, [s for _, s in results]


def test_lookahead_imagines_each_candidate_and_executes_the_best_scored(
    critic_model, calls, tmp_path, alfworld_data, monkeypatch
):
    model, stats = play(critic_model, tmp_path, alfworld_data, monkeypatch, depth=1)
    steps = [step for s in stats for step in s.lookahead]
    assert len(steps) == sum(s.steps for s in stats) >= 4
    kinds = [c["kind"] for c in calls]
    candidates = sum(len(step.candidates) for step in steps)
    assert kinds.count("draft") == 3 * len(steps)  # K sampled drafts per step
    assert kinds.count("imagine") == kinds.count("critic") == candidates  # K x D world-model calls (D = 1)
    assert {c["temperature"] for c in calls if c["kind"] == "draft"} == {0.7}
    # the critic's score is P(YES) of its first answer token, as the server's logprobs give it
    answer = DecisionTokens.from_model_dir(model, CRITIC_WORDS)
    read = [
        top_k_revise_probability(c["raw"]["choices"][0]["logprobs"]["top_logprobs"][0], answer)
        for c in calls
        if c["kind"] == "critic"
    ]
    assert read == [x for step in steps for x in step.scores]  # (the random model's are mostly None: the
    # choice among read scores is shown with the real model, tests/slow/test_lookahead_default_model.py)
    executed = [action for s in stats for _, action in s.state_actions]
    for step, action in zip(steps, executed):
        read_scores = [x for x in step.scores if x is not None]
        if read_scores:
            assert step.scores[step.chosen] == max(read_scores)
        else:  # no score could be read (neither answer among the top-k): the first sampled candidate
            assert step.chosen == 0
        assert canonical_action(step.candidates[step.chosen]) == action
        assert len({canonical_action(c) for c in step.candidates}) == len(step.candidates)  # duplicates played once


def test_a_deeper_lookahead_asks_the_world_model_up_to_k_times_d(
    critic_model, calls, tmp_path, alfworld_data, monkeypatch
):
    _, stats = play(critic_model, tmp_path, alfworld_data, monkeypatch, depth=3)
    steps = [step for s in stats for step in s.lookahead]
    candidates = sum(len(step.candidates) for step in steps)
    imagined = sum(c["kind"] == "imagine" for c in calls)
    # each candidate's continuation: 1 to D imagined steps (it ends early where the policy's draft
    # in an imagined state does not parse), and one critic call
    assert candidates <= imagined <= 3 * candidates and imagined > candidates
    assert sum(c["kind"] == "critic" for c in calls) == candidates
